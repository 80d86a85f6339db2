//! How many TokenReviews Bulwark may make: per client address, for everyone, and at once.
//!
//! A token neither cache knows costs an upstream review before any rule applies, so an
//! unbounded stream of made-up tokens would be an unbounded stream of reviews. Each review
//! takes a token from its source's bucket and from the global bucket, then a slot among
//! the reviews in flight. A source's bucket lives in an LRU of `maxSources` addresses, so
//! however many addresses come by, memory stays bounded; an address pushed out starts
//! again with a full bucket, which the global bucket still bounds.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed, StateStore};
use governor::{Quota, RateLimiter};
use lru::LruCache;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::admit::TokioClock;
use crate::config;

/// Why a review may not be made now, and when to try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    /// Which bound said no.
    pub bound: Bound,
    /// When a review could be made again.
    pub retry_after: Duration,
}

/// The bound that refused a review.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The client address's bucket is empty.
    Source,
    /// The bucket of all clients is empty.
    Global,
    /// `maxConcurrent` reviews stayed in flight for `maxWait`.
    InFlight,
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bound::Source => "this client address makes too many token reviews",
            Bound::Global => "too many token reviews",
            Bound::InFlight => "too many token reviews in flight",
        })
    }
}

/// A client address as its review bucket is keyed: IPv4 as is, IPv6 by its /64 (one host
/// commonly holds a whole /64), IPv4-mapped IPv6 as the IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Source(IpAddr);

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V6(v6) => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                Source(IpAddr::V6(prefix.into()))
            }
            v4 => Source(v4),
        }
    }
}

/// governor's per-key state (one GCRA arrival time per source) in an LRU.
struct SourceStates(Mutex<LruCache<Source, Nanos>>);

impl StateStore for SourceStates {
    type Key = Source;

    fn measure_and_replace<T, F, E>(&self, key: &Source, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        let mut states = self.0.lock().expect("review source states lock");
        let (answer, next) = f(states.get(key).copied())?;
        states.put(*key, next);
        Ok(answer)
    }
}

type Global = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Duration>>;
type PerSource = RateLimiter<Source, SourceStates, TokioClock, NoOpMiddleware<Duration>>;

/// The bounds on TokenReviews, built from `identity.tokenReview`.
pub struct ReviewLimits {
    global: Global,
    per_source: PerSource,
    in_flight: Arc<Semaphore>,
    max_wait: Duration,
}

impl ReviewLimits {
    /// Limits with the configured rates, address count, concurrency and wait.
    pub fn new(settings: &config::TokenReview) -> Self {
        let clock = TokioClock::new();
        let sources = std::num::NonZeroUsize::new(settings.max_sources.max(1)).expect("at least 1");
        Self {
            global: RateLimiter::new(
                quota(settings.rate),
                InMemoryState::default(),
                clock.clone(),
            ),
            per_source: RateLimiter::new(
                quota(settings.per_source),
                SourceStates(Mutex::new(LruCache::new(sources))),
                clock,
            ),
            in_flight: Arc::new(Semaphore::new(settings.max_concurrent.max(1))),
            max_wait: settings.max_wait,
        }
    }

    /// Takes one review from the source's bucket, then from everyone's. A request without
    /// a known address (none reaches here from the listener) counts against everyone's only.
    pub fn take(&self, source: Option<IpAddr>) -> Result<(), Limited> {
        if let Some(ip) = source {
            self.per_source
                .check_key(&Source::from(ip))
                .map_err(|until| Limited {
                    bound: Bound::Source,
                    retry_after: until.wait_time_from(self.per_source.clock().now()),
                })?;
        }
        self.global.check().map_err(|until| Limited {
            bound: Bound::Global,
            retry_after: until.wait_time_from(self.global.clock().now()),
        })
    }

    /// A slot among the reviews in flight, waited for at most `maxWait`.
    pub async fn slot(&self) -> Result<OwnedSemaphorePermit, Limited> {
        let acquire = self.in_flight.clone().acquire_owned();
        match tokio::time::timeout(self.max_wait, acquire).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(Limited {
                bound: Bound::InFlight,
                retry_after: Duration::from_secs(1),
            }),
        }
    }
}

/// The quota of a validated rate (a rate that slipped through as 0 allows one a day
/// rather than panicking).
fn quota(rate: config::ReviewRate) -> Quota {
    let period = Duration::try_from_secs_f64(1.0 / rate.qps)
        .unwrap_or(Duration::from_secs(86_400))
        .max(Duration::from_nanos(1));
    let burst = NonZeroU32::new(rate.burst.max(1)).expect("at least 1");
    Quota::with_period(period)
        .expect("a positive period")
        .allow_burst(burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(tweak: impl FnOnce(&mut config::TokenReview)) -> ReviewLimits {
        let mut settings = config::TokenReview::default();
        tweak(&mut settings);
        ReviewLimits::new(&settings)
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_gets_its_burst_then_its_rate() {
        let limits = limits(|s| {
            s.per_source = config::ReviewRate { qps: 2.0, burst: 3 };
        });
        for _ in 0..3 {
            limits.take(ip("10.0.0.1")).unwrap();
        }
        let refused = limits.take(ip("10.0.0.1")).unwrap_err();
        assert_eq!(refused.bound, Bound::Source);
        assert_eq!(refused.retry_after, Duration::from_millis(500));
        // Another address has a bucket of its own; the same /64 does not.
        limits.take(ip("10.0.0.2")).unwrap();
        limits.take(ip("2001:db8::1")).unwrap();
        limits.take(ip("2001:db8::2")).unwrap();
        limits.take(ip("2001:db8::3")).unwrap();
        assert!(limits.take(ip("2001:db8::ffff:1")).is_err());
        tokio::time::advance(Duration::from_millis(500)).await;
        limits.take(ip("10.0.0.1")).unwrap();
        assert!(limits.take(ip("10.0.0.1")).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn every_source_together_gets_the_global_rate() {
        let limits = limits(|s| {
            s.rate = config::ReviewRate {
                qps: 10.0,
                burst: 5,
            };
        });
        for i in 0..5 {
            limits.take(ip(&format!("10.0.1.{i}"))).unwrap();
        }
        let refused = limits.take(ip("10.0.1.200")).unwrap_err();
        assert_eq!(refused.bound, Bound::Global);
        assert_eq!(refused.retry_after, Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn memory_is_bounded_by_max_sources() {
        let limits = limits(|s| {
            s.per_source = config::ReviewRate { qps: 1.0, burst: 1 };
            s.rate = config::ReviewRate {
                qps: 1.0,
                burst: 10_000,
            };
            s.max_sources = 100;
        });
        limits.take(ip("10.1.0.0")).unwrap();
        assert!(limits.take(ip("10.1.0.0")).is_err());
        for i in 1..=1000u32 {
            limits
                .take(Some(IpAddr::V4((0x0a01_0000u32 + i).into())))
                .unwrap();
        }
        let states = limits.per_source.into_state_store().0.into_inner().unwrap();
        assert_eq!(states.len(), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_in_flight_are_capped_and_a_waiter_gives_up_after_max_wait() {
        let limits = limits(|s| {
            s.max_concurrent = 2;
            s.max_wait = Duration::from_millis(300);
        });
        let first = limits.slot().await.unwrap();
        let _second = limits.slot().await.unwrap();
        let started = tokio::time::Instant::now();
        let refused = limits.slot().await.unwrap_err();
        assert_eq!(refused.bound, Bound::InFlight);
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        // A waiter gets the slot as soon as one is free.
        let waiting = limits.slot();
        drop(first);
        drop(waiting.await.unwrap());
    }
}
