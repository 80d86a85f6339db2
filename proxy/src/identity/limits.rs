//! How many TokenReviews Bulwark may make: per client address, for everyone (shared fairly
//! between prefixes), at once, and apart from these for re-reviews of accepted tokens.
//!
//! A token neither cache knows costs an upstream review before any rule applies, so an
//! unbounded stream of made-up tokens would be an unbounded stream of reviews. Each review
//! takes a token from its source address's bucket (IPv6 by /64) and from the global bucket,
//! then a slot among the reviews in flight. Buckets live in LRUs of `maxSources` entries,
//! so however many addresses come by, memory stays bounded; one pushed out starts again
//! with a full bucket, which the global bucket still bounds.
//!
//! Once the global bucket is below half full, a prefix (IPv4 /24, IPv6 /48: whoever holds
//! one address commonly holds its neighbours too) takes from it only within its fair
//! share: the global rate divided among the prefixes active in the last second and one
//! more for a newcomer. The per-address bucket stays per address: the nodes of one /24
//! subnet each re-review their own tokens after a Bulwark restart. Many prefixes flooding together then leave the bucket's lower part,
//! and a share of its refill, to the others.
//!
//! A prefix that had a token accepted in the last [`TRUSTED_FOR`] is trusted: it shares
//! only with the other trusted prefixes active now, and the lowest quarter of the global
//! bucket is kept for trusted prefixes alone, so that a flood from prefixes that never had
//! a token accepted (a thousand /24s of made-up tokens) cannot take new tokens' reviews
//! from the nodes and clients Bulwark has served before (until a first token is accepted,
//! nobody is trusted and the whole bucket is everyone's). The trusted prefixes are
//! remembered across restarts in `identity.tokenReview.memoryFile` (after a restart every
//! token is new), saved every minute and at the drain; a file too large to be one Bulwark
//! wrote, or not text, is not read.
//!
//! Re-reviews of tokens already accepted have a bucket and in-flight slots of their own,
//! which unknown tokens never touch: a flood of made-up tokens cannot delay them. They are
//! bounded too, by those and by the number of accepted tokens remembered.

use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use lru::LruCache;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

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
    /// The client prefix's bucket is empty.
    Source,
    /// The bucket of all clients is empty, or this prefix has had its share of it.
    Global,
    /// `maxConcurrent` reviews stayed in flight for `maxWait`.
    InFlight,
    /// The bucket of re-reviews of accepted tokens is empty.
    Refresh,
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bound::Source => "this client address makes too many token reviews",
            Bound::Global => "too many token reviews",
            Bound::InFlight => "too many token reviews in flight",
            Bound::Refresh => "too many token re-reviews",
        })
    }
}

/// A client address as its own review bucket is keyed: IPv4 as is, IPv6 by its /64 (one
/// host commonly holds a whole /64), IPv4-mapped IPv6 as the IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Source(IpAddr);

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        Source(crate::net::source_of(ip))
    }
}

/// A client address as its fair share of the global bucket is keyed: IPv4 by its /24, IPv6
/// by its /48 (a site's usual allocation), IPv4-mapped IPv6 as the IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Prefix(IpAddr);

impl From<IpAddr> for Prefix {
    fn from(ip: IpAddr) -> Self {
        Prefix(crate::net::prefix_of(ip))
    }
}

/// A token bucket, refilled when it is looked at.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn holding(tokens: f64, now: Instant) -> Self {
        Self { tokens, at: now }
    }

    /// Adds what `qps` brought since it was last looked at, up to `capacity`.
    fn refill(&mut self, qps: f64, capacity: f64, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * qps).min(capacity);
        self.at = now;
    }

    /// How long until it holds one token at `qps` (rounded up to the millisecond).
    fn wait(&self, qps: f64) -> Duration {
        let millis = ((1.0 - self.tokens) / qps * 1000.0 - 1e-6).ceil().max(0.0);
        Duration::try_from_secs_f64(millis / 1000.0).unwrap_or(Duration::from_secs(86_400))
    }
}

/// What is remembered of one prefix.
struct PrefixState {
    /// Its fair share of the global bucket, spent only while that is below half full.
    share: Bucket,
    /// The last activity window it was counted in.
    window: u64,
}

/// How many prefixes asked for reviews lately: distinct prefixes counted per one-second
/// window, the busier of this window and the last.
struct Activity {
    window: u64,
    started: Instant,
    current: usize,
    previous: usize,
}

/// How long a prefix stays trusted after a token from it was last accepted.
pub const TRUSTED_FOR: Duration = Duration::from_secs(24 * 3600);

/// The longest line of the memory file, an address and a time: an IPv6 address (39), a
/// space, a `u64` (20) and a newline are 61.
const MEMORY_LINE: u64 = 64;

/// What [`ReviewLimits::load`] read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// Prefixes trusted from the file (those accepted within [`TRUSTED_FOR`]).
    pub taken: usize,
    /// Lines that did not read.
    pub skipped: usize,
}

/// How long a prefix counts as active after it last asked.
const ACTIVITY_WINDOW: Duration = Duration::from_secs(1);

impl Activity {
    fn roll(&mut self, now: Instant) {
        let passed = now.saturating_duration_since(self.started);
        if passed < ACTIVITY_WINDOW {
            return;
        }
        self.previous = if passed < 2 * ACTIVITY_WINDOW {
            self.current
        } else {
            0
        };
        self.current = 0;
        self.window += 1;
        self.started = now;
    }

    fn active(&self) -> usize {
        self.current.max(self.previous).max(1)
    }
}

/// The buckets of unknown tokens' reviews, under one lock.
struct Buckets {
    global: Bucket,
    /// Each address's own bucket (`perSource`).
    sources: LruCache<Source, Bucket>,
    prefixes: LruCache<Prefix, PrefixState>,
    activity: Activity,
    /// Prefixes that had a token accepted, and when last.
    trusted: LruCache<Prefix, Instant>,
    /// How many trusted prefixes asked lately, counted apart.
    trusted_activity: Activity,
}

/// The bounds on TokenReviews, built from `identity.tokenReview`.
pub struct ReviewLimits {
    buckets: Mutex<Buckets>,
    refresh: Mutex<Bucket>,
    rate: config::ReviewRate,
    per_source: config::ReviewRate,
    refresh_rate: config::ReviewRate,
    in_flight: Arc<Semaphore>,
    refreshing: Arc<Semaphore>,
    max_wait: Duration,
}

impl ReviewLimits {
    /// Limits with the configured rates, prefix count, concurrency and wait.
    pub fn new(settings: &config::TokenReview) -> Self {
        let now = Instant::now();
        let prefixes =
            std::num::NonZeroUsize::new(settings.max_sources.max(1)).expect("at least 1");
        // A rate that slipped through validation as 0 (or less) would never refill:
        // one a day instead.
        let sane = |rate: config::ReviewRate| config::ReviewRate {
            qps: if rate.qps.is_finite() && rate.qps > 0.0 {
                rate.qps
            } else {
                1.0 / 86_400.0
            },
            burst: rate.burst.max(1),
        };
        let (rate, per_source, refresh_rate) = (
            sane(settings.rate),
            sane(settings.per_source),
            sane(settings.refresh_rate),
        );
        Self {
            buckets: Mutex::new(Buckets {
                global: Bucket::holding(f64::from(rate.burst), now),
                sources: LruCache::new(prefixes),
                prefixes: LruCache::new(prefixes),
                activity: Activity {
                    window: 0,
                    started: now,
                    current: 0,
                    previous: 0,
                },
                trusted: LruCache::new(prefixes),
                trusted_activity: Activity {
                    window: 0,
                    started: now,
                    current: 0,
                    previous: 0,
                },
            }),
            refresh: Mutex::new(Bucket::holding(f64::from(refresh_rate.burst), now)),
            rate,
            per_source,
            refresh_rate,
            in_flight: Arc::new(Semaphore::new(settings.max_concurrent.max(1))),
            refreshing: Arc::new(Semaphore::new(settings.max_concurrent_refreshes.max(1))),
            max_wait: settings.max_wait,
        }
    }

    /// Takes one review of an unknown token from the source address's bucket, then from
    /// everyone's within the source prefix's fair share. Nothing is taken when either refuses. A
    /// request without a known address (none reaches here from the listener) counts against
    /// everyone's only.
    pub fn take(&self, source: Option<IpAddr>) -> Result<(), Limited> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let Buckets {
            global,
            sources,
            prefixes,
            activity,
            trusted,
            trusted_activity,
        } = &mut *buckets;
        activity.roll(now);
        trusted_activity.roll(now);
        let (global_qps, global_burst) = (self.rate.qps, f64::from(self.rate.burst));
        global.refill(global_qps, global_burst, now);
        let Some(ip) = source else {
            return take_global(global, global_qps);
        };
        let per_source = self.per_source;
        let own = sources.get_or_insert_mut(Source::from(ip), || {
            Bucket::holding(f64::from(per_source.burst), now)
        });
        own.refill(per_source.qps, f64::from(per_source.burst), now);
        if own.tokens < 1.0 {
            return Err(Limited {
                bound: Bound::Source,
                retry_after: own.wait(per_source.qps),
            });
        }
        let prefix = Prefix::from(ip);
        let is_trusted = trusted
            .peek(&prefix)
            .is_some_and(|at| now.saturating_duration_since(*at) < TRUSTED_FOR);
        let activity = if is_trusted {
            trusted_activity
        } else {
            activity
        };
        let state = prefixes.get_or_insert_mut(prefix, || PrefixState {
            // Refilled to the share's capacity below, whatever that is now.
            share: Bucket::holding(f64::INFINITY, now),
            window: u64::MAX,
        });
        if state.window != activity.window {
            state.window = activity.window;
            activity.current += 1;
        }
        // The active prefixes (trusted ones among the trusted) and one more, for whoever
        // comes next.
        let shares = (activity.active() + 1) as f64;
        let (share_qps, share_capacity) =
            (global_qps / shares, (global_burst / 2.0 / shares).max(1.0));
        state.share.refill(share_qps, share_capacity, now);
        let contended = global.tokens < global_burst / 2.0;
        if contended && state.share.tokens < 1.0 {
            return Err(Limited {
                bound: Bound::Global,
                retry_after: state.share.wait(share_qps),
            });
        }
        // The lowest quarter (in whole reviews) is the trusted prefixes' alone, once there
        // are any.
        if !is_trusted && !trusted.is_empty() && global.tokens - 1.0 < (global_burst / 4.0).floor()
        {
            return Err(Limited {
                bound: Bound::Global,
                retry_after: global.wait(global_qps).max(Duration::from_secs(1)),
            });
        }
        take_global(global, global_qps)?;
        if contended {
            state.share.tokens -= 1.0;
        }
        own.tokens -= 1.0;
        Ok(())
    }

    /// A token from `source` was accepted: its prefix is trusted for [`TRUSTED_FOR`].
    pub fn accepted(&self, source: IpAddr) {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        buckets.trusted.put(Prefix::from(source), now);
    }

    /// Writes the trusted prefixes to `path` (through a file beside it, renamed over it):
    /// one line each, the prefix's address and when a token from it was last accepted, in
    /// Unix seconds.
    pub fn save(&self, path: &Path) -> std::io::Result<usize> {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let lines: Vec<String> = {
            let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            buckets
                .trusted
                .iter()
                .filter_map(|(prefix, at)| {
                    let age = now.saturating_duration_since(*at);
                    (age < TRUSTED_FOR).then(|| {
                        let unix = wall
                            .checked_sub(age)
                            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                            .map_or(0, |d| d.as_secs());
                        format!("{} {unix}\n", prefix.0)
                    })
                })
                .collect()
        };
        let partial = path.with_extension("partial");
        std::fs::write(&partial, lines.concat())?;
        std::fs::rename(&partial, path)?;
        Ok(lines.len())
    }

    /// Reads the trusted prefixes [`ReviewLimits::save`] wrote, those still within
    /// [`TRUSTED_FOR`]. A file larger than the prefixes remembered could fill
    /// ([`MEMORY_LINE`] bytes each) is not read at all: an error, as is one that is not
    /// UTF-8. A line that does not read (or names a time out of range) is skipped and
    /// counted.
    pub fn load(&self, path: &Path) -> std::io::Result<Loaded> {
        use std::io::Read;
        let file = std::fs::File::open(path)?;
        let most = {
            let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            buckets.trusted.cap().get() as u64 * MEMORY_LINE
        };
        let size = file.metadata()?.len();
        if size > most {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{size} bytes, more than the {most} the prefixes remembered could fill"),
            ));
        }
        let mut text = String::new();
        file.take(most).read_to_string(&mut text)?;
        let (now, wall) = (Instant::now(), SystemTime::now());
        let mut loaded = Loaded::default();
        let mut read: Vec<(Duration, Prefix)> = Vec::new();
        for line in text.lines() {
            let when = line.split_once(' ').and_then(|(address, unix)| {
                let address = address.parse::<IpAddr>().ok()?;
                let when = SystemTime::UNIX_EPOCH
                    .checked_add(Duration::from_secs(unix.parse::<u64>().ok()?))?;
                Some((Prefix::from(address), when))
            });
            let Some((prefix, when)) = when else {
                loaded.skipped += 1;
                continue;
            };
            // A time ahead of this clock (another node's, skewed) counts as now.
            let age = wall.duration_since(when).unwrap_or_default();
            if age < TRUSTED_FOR {
                read.push((age, prefix));
            }
        }
        // Oldest first, so that the most recent stay when there are more than fit.
        read.sort_by_key(|(age, _)| std::cmp::Reverse(*age));
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        for (age, prefix) in read {
            buckets
                .trusted
                .put(prefix, now.checked_sub(age).unwrap_or(now));
            loaded.taken += 1;
        }
        Ok(loaded)
    }

    /// Takes one re-review of an accepted token from the bucket of re-reviews.
    pub fn take_refresh(&self) -> Result<(), Limited> {
        let rate = self.refresh_rate;
        let mut bucket = self.refresh.lock().unwrap_or_else(|p| p.into_inner());
        bucket.refill(rate.qps, f64::from(rate.burst), Instant::now());
        if bucket.tokens < 1.0 {
            return Err(Limited {
                bound: Bound::Refresh,
                retry_after: bucket.wait(rate.qps),
            });
        }
        bucket.tokens -= 1.0;
        Ok(())
    }

    /// A slot among the reviews in flight, waited for at most `maxWait`.
    pub async fn slot(&self) -> Result<OwnedSemaphorePermit, Limited> {
        wait_for(&self.in_flight, self.max_wait).await
    }

    /// A slot among the re-reviews in flight (apart from other reviews), waited for at
    /// most `maxWait`.
    pub async fn refresh_slot(&self) -> Result<OwnedSemaphorePermit, Limited> {
        wait_for(&self.refreshing, self.max_wait).await
    }
}

fn take_global(global: &mut Bucket, qps: f64) -> Result<(), Limited> {
    if global.tokens < 1.0 {
        return Err(Limited {
            bound: Bound::Global,
            retry_after: global.wait(qps),
        });
    }
    global.tokens -= 1.0;
    Ok(())
}

async fn wait_for(
    slots: &Arc<Semaphore>,
    max_wait: Duration,
) -> Result<OwnedSemaphorePermit, Limited> {
    match tokio::time::timeout(max_wait, slots.clone().acquire_owned()).await {
        Ok(Ok(permit)) => Ok(permit),
        _ => Err(Limited {
            bound: Bound::InFlight,
            retry_after: Duration::from_secs(1),
        }),
    }
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
    async fn an_address_gets_its_burst_then_its_rate() {
        let limits = limits(|s| {
            s.per_source = config::ReviewRate { qps: 2.0, burst: 3 };
        });
        for _ in 0..3 {
            limits.take(ip("10.0.0.1")).unwrap();
        }
        let refused = limits.take(ip("10.0.0.1")).unwrap_err();
        assert_eq!(refused.bound, Bound::Source);
        assert_eq!(refused.retry_after, Duration::from_millis(500));
        // Another address, even of the same /24, has a bucket of its own; so has another
        // IPv6 /64, but not another address of the same /64.
        limits.take(ip("10.0.0.2")).unwrap();
        for _ in 0..3 {
            limits.take(ip("2001:db8::1")).unwrap();
        }
        assert!(limits.take(ip("2001:db8::ffff:1")).is_err());
        limits.take(ip("2001:db8:0:1::2")).unwrap();
        // IPv4-mapped IPv6 is the IPv4 address.
        assert!(limits.take(ip("::ffff:10.0.0.1")).is_err());
        tokio::time::advance(Duration::from_millis(500)).await;
        limits.take(ip("10.0.0.1")).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_nodes_of_one_slash_24_each_get_their_own_bucket() {
        // After a Bulwark restart every node of a node subnet has its tokens reviewed anew:
        // 200 nodes of one /24, five tokens each, well within the global rate.
        let limits = limits(|s| {
            s.per_source = config::ReviewRate { qps: 1.0, burst: 5 };
            s.rate = config::ReviewRate {
                qps: 500.0,
                burst: 2000,
            };
        });
        let taken = (1..=200)
            .flat_map(|host| std::iter::repeat_n(host, 5))
            .filter(|host| limits.take(ip(&format!("10.0.0.{host}"))).is_ok())
            .count();
        assert_eq!(taken, 1000);
        // A sixth from one node is its own bucket's to refuse.
        assert_eq!(
            limits.take(ip("10.0.0.7")).unwrap_err().bound,
            Bound::Source
        );
    }

    #[tokio::test(start_paused = true)]
    async fn every_prefix_together_gets_the_global_rate() {
        let limits = limits(|s| {
            s.rate = config::ReviewRate {
                qps: 10.0,
                burst: 5,
            };
        });
        for i in 0..5 {
            limits.take(ip(&format!("10.0.{i}.1"))).unwrap();
        }
        let refused = limits.take(ip("10.0.200.1")).unwrap_err();
        assert_eq!(refused.bound, Bound::Global);
        assert_eq!(refused.retry_after, Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_prefix_gets_its_reviews_while_the_first_floods() {
        // Prefix buckets large enough (as behind a NAT) that only the global one holds.
        let limits = limits(|s| {
            s.rate = config::ReviewRate {
                qps: 100.0,
                burst: 100,
            };
            s.per_source = config::ReviewRate {
                qps: 10_000.0,
                burst: 10_000,
            };
        });
        let (mut flood_taken, mut flood_refused, mut other_taken) = (0, 0, 0);
        // Two seconds: the flood asks every millisecond from 200 addresses of one /24,
        // the other /24 every 100 ms.
        for ms in 0..2000u32 {
            let host = ms % 200 + 1;
            match limits.take(ip(&format!("10.0.0.{host}"))) {
                Ok(()) => flood_taken += 1,
                Err(_) => flood_refused += 1,
            }
            if ms % 100 == 0 && limits.take(ip("10.0.1.1")).is_ok() {
                other_taken += 1;
            }
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert_eq!(other_taken, 20, "the second /24 was refused");
        assert!(flood_refused > 0);
        // Together within the global bucket: its burst and two seconds of its rate.
        assert!(flood_taken + other_taken <= 100 + 200, "{flood_taken}");
    }

    #[tokio::test(start_paused = true)]
    async fn many_flooding_prefixes_leave_a_fair_share_to_another() {
        let limits = limits(|s| {
            s.rate = config::ReviewRate {
                qps: 100.0,
                burst: 100,
            };
            s.per_source = config::ReviewRate {
                qps: 10_000.0,
                burst: 10_000,
            };
        });
        let (mut flood_taken, mut other_taken) = (0, 0);
        for ms in 0..2000u32 {
            // 20 /24s each asking every 20 ms: 1000 a second together, where a fair share
            // of the global rate is 100 / 21 a second.
            if limits.take(ip(&format!("10.1.{}.1", ms % 20))).is_ok() {
                flood_taken += 1;
            }
            if ms % 250 == 0 && limits.take(ip("10.0.1.1")).is_ok() {
                other_taken += 1;
            }
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert_eq!(other_taken, 8, "the other /24 was refused");
        assert!(flood_taken + other_taken <= 100 + 200, "{flood_taken}");
    }

    /// 1,000 /24s that never had a token accepted, each asking every 100 ms (10,000 a
    /// second, at a global rate of 500), and 16 new tokens at once from a /24 whose nodes
    /// had tokens accepted before.
    async fn flood_and_sixteen_new_tokens(limits: &ReviewLimits) -> usize {
        for round in 0..30u32 {
            for p in 0..1000u32 {
                let _ = limits.take(Some(IpAddr::V4(
                    (0x0b00_0001u32 + (p << 8) + (round % 2)).into(),
                )));
            }
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        (0..16u8)
            .filter(|i| limits.take(ip(&format!("10.9.9.{i}"))).is_ok())
            .count()
    }

    fn flooded() -> ReviewLimits {
        limits(|s| {
            s.rate = config::ReviewRate {
                qps: 500.0,
                burst: 1000,
            };
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefix_that_had_tokens_accepted_keeps_its_reviews_under_a_flood_of_prefixes() {
        let unknown = flooded();
        // Someone once had a token accepted, elsewhere: the reserve is in force.
        unknown.accepted("192.0.2.1".parse().unwrap());
        let reviewed = flood_and_sixteen_new_tokens(&unknown).await;
        assert!(
            reviewed < 8,
            "a prefix never seen shares with the flood: {reviewed}"
        );
        let known = flooded();
        known.accepted("10.9.9.200".parse().unwrap());
        assert_eq!(flood_and_sixteen_new_tokens(&known).await, 16);
    }

    #[tokio::test(start_paused = true)]
    async fn the_trusted_prefixes_survive_a_restart_through_the_memory_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("review-memory");
        let before = flooded();
        before.accepted("10.9.9.200".parse().unwrap());
        before.accepted("2001:db8:7:1::5".parse().unwrap());
        assert_eq!(before.save(&file).unwrap(), 2);
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("10.9.9.0 "), "{text}");
        assert!(text.contains("2001:db8:7:: "), "{text}");
        // A restart: a new limiter that reads the file, with bad lines (one with a time no
        // clock holds) and an old one.
        std::fs::write(
            &file,
            format!("{text}not a line\n10.7.7.0 18446744073709551615\n10.8.8.0 12\n"),
        )
        .unwrap();
        let after = flooded();
        assert_eq!(
            after.load(&file).unwrap(),
            Loaded {
                taken: 2,
                skipped: 2
            },
            "the bad lines are counted, the stale one left out"
        );
        assert_eq!(flood_and_sixteen_new_tokens(&after).await, 16);
        assert!(after.load(&dir.path().join("missing")).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_memory_file_too_large_or_not_text_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("review-memory");
        let unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        // Two lines more than 100 prefixes could fill: too large to be one this Bulwark
        // wrote, whatever it holds.
        let limits = limits(|s| s.max_sources = 100);
        let line = format!("{:<63}\n", format!("10.9.9.0 {unix}"));
        std::fs::write(&file, line.repeat(102)).unwrap();
        let error = limits.load(&file).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData, "{error}");
        std::fs::write(&file, [0xff, 0xfe, b'\n']).unwrap();
        assert!(limits.load(&file).is_err());
        std::fs::write(&file, format!("10.9.9.0 {unix}\n")).unwrap();
        assert_eq!(limits.load(&file).unwrap().taken, 1);
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
                .take(Some(IpAddr::V4((0x0a01_0000u32 + (i << 8)).into())))
                .unwrap();
        }
        let buckets = limits.buckets.into_inner().unwrap();
        assert_eq!(buckets.prefixes.len(), 100);
        assert_eq!(buckets.sources.len(), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn re_reviews_have_a_bucket_of_their_own() {
        let limits = limits(|s| {
            s.rate = config::ReviewRate { qps: 1.0, burst: 1 };
            s.refresh_rate = config::ReviewRate { qps: 2.0, burst: 2 };
        });
        limits.take(ip("10.0.0.1")).unwrap();
        assert!(limits.take(ip("10.0.1.1")).is_err());
        limits.take_refresh().unwrap();
        limits.take_refresh().unwrap();
        let refused = limits.take_refresh().unwrap_err();
        assert_eq!(refused.bound, Bound::Refresh);
        assert_eq!(refused.retry_after, Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_in_flight_are_capped_and_a_waiter_gives_up_after_max_wait() {
        let limits = limits(|s| {
            s.max_concurrent = 2;
            s.max_concurrent_refreshes = 1;
            s.max_wait = Duration::from_millis(300);
        });
        let first = limits.slot().await.unwrap();
        let _second = limits.slot().await.unwrap();
        let started = tokio::time::Instant::now();
        let refused = limits.slot().await.unwrap_err();
        assert_eq!(refused.bound, Bound::InFlight);
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        // Re-reviews have slots of their own.
        let refreshing = limits.refresh_slot().await.unwrap();
        assert!(limits.refresh_slot().await.is_err());
        drop(refreshing);
        // A waiter gets the slot as soon as one is free.
        let waiting = limits.slot();
        drop(first);
        drop(waiting.await.unwrap());
    }
}
