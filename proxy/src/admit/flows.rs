//! Per-flow state: the token bucket, the `Retry-After` backoff and the open watches of each
//! flow, in a sharded table whose idle entries are evicted, and which holds at most a fixed
//! number of flows without an open watch, so that memory stays bounded however many
//! identities, nodes, pods and addresses come and go.

use foldhash::{HashMap, HashMapExt as _};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::{NoOpMiddleware, StateInformationMiddleware};
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use prometheus::{IntCounter, IntGauge};
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::rules::Rate;

/// Shortest `Retry-After`: what a flow's first refusal says.
pub(crate) const RETRY_MIN: Duration = Duration::from_secs(1);
/// Longest `Retry-After`, reached while a flow keeps being refused.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(32);

/// governor's clock on tokio's time, so that token buckets follow `tokio::time::pause()`.
#[derive(Clone, Debug)]
pub(crate) struct TokioClock {
    origin: Instant,
}

impl TokioClock {
    pub(crate) fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    // `Duration` since the origin is a `governor::clock::Reference`.
    type Instant = Duration;

    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }
}

/// A token bucket on tokio time.
pub(crate) type Bucket = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Duration>>;

/// A flow's token bucket, which says how many tokens it has left after each take, so that a
/// bucket rebuilt for a new rate (a new fleet share) starts as full as the old one was.
type FlowBucket = RateLimiter<NotKeyed, InMemoryState, TokioClock, StateInformationMiddleware>;

/// At most this many flows are reported to the fleet per renewal (the busiest, for their
/// rate); the Lease stays a few KiB.
pub(crate) const MAX_RATE_FLOWS: usize = 128;

/// A flow is reported to the fleet once it asks for at least this fraction of its rule's
/// rate, or for anything while its bucket holds a share (others report it): a flow no
/// replica reports asks each for under a tenth of its rule, N tenths over N replicas.
pub(crate) const RATE_REPORT_FRACTION: f64 = 0.1;

/// `rate` times `share` (a fraction of the rule's rate this Bulwark holds in its fleet).
/// The burst stays the rule's: it bounds how far ahead of the rate a flow may get, not the
/// rate, and a burst cut to a share's fraction (one request) would refuse a flow that asks
/// for no more than its share whenever two requests came close together.
pub(crate) fn scaled(rate: Rate, share: Option<f64>) -> Rate {
    match share {
        Some(share) if share.is_finite() && (0.0..1.0).contains(&share) => Rate {
            qps: rate.qps * share,
            burst: rate.burst,
        },
        _ => rate,
    }
}

/// The quota of a rate, or `None` when it limits nothing (a non-positive or non-finite
/// rate cannot come from validated rules; it is treated as no limit rather than a panic).
fn quota(rate: Rate) -> Option<Quota> {
    if !(rate.qps.is_finite() && rate.qps > 0.0) {
        return None;
    }
    let period = Duration::try_from_secs_f64(1.0 / rate.qps).ok()?;
    let burst = NonZeroU32::new(rate.burst.max(1))?;
    Some(Quota::with_period(period.max(Duration::from_nanos(1)))?.allow_burst(burst))
}

/// The `Retry-After` of a refusal by a flow's token bucket: when the bucket next admits, in
/// whole seconds (a 1/s bucket says 1 s), plus `pick(max)` more (the caller picks uniformly
/// in `0..=max`, a quarter of the wait) so that a flow's clients refused together do not all
/// come back in the same second; at most [`RETRY_MAX`]. Below 4 s whole seconds leave no
/// room for a quarter: the wait is said as it is.
pub(crate) fn bucket_retry_after(wait: Duration, pick: impl FnOnce(u64) -> u64) -> Duration {
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    let max = secs / 4;
    let jitter = if max == 0 { 0 } else { pick(max).min(max) };
    Duration::from_secs(secs + jitter).min(RETRY_MAX)
}

/// The per-flow `Retry-After` for refusals other than the token bucket's: 1 s on a first refusal, doubling once per advised wait while
/// the flow keeps being refused, up to 32 s; each quiet stretch as long as the current
/// value (beyond the advised wait) halves it again.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Backoff {
    /// Zero when the flow has not been refused (or has fully recovered).
    level: Duration,
    /// When `level` was last set.
    since: Option<Instant>,
    /// The last refusal.
    last: Option<Instant>,
}

impl Backoff {
    /// Records a refusal at `now` and returns the `Retry-After` to send.
    pub(crate) fn refuse(&mut self, now: Instant) -> Duration {
        let (Some(since), Some(last)) = (self.since, self.last) else {
            self.level = RETRY_MIN;
            self.since = Some(now);
            self.last = Some(now);
            return self.level;
        };
        let mut quiet = now
            .saturating_duration_since(last)
            .saturating_sub(self.level);
        let mut decayed = false;
        while self.level > RETRY_MIN && quiet >= self.level {
            quiet -= self.level;
            self.level = (self.level / 2).max(RETRY_MIN);
            decayed = true;
        }
        if decayed || (self.level == RETRY_MIN && quiet >= RETRY_MIN) {
            self.since = Some(now);
        } else if now.saturating_duration_since(since) >= self.level {
            // Refused again after waiting as advised: the flow is still too much.
            self.level = (self.level * 2).min(RETRY_MAX);
            self.since = Some(now);
        }
        self.last = Some(now);
        self.level
    }

    /// Whether nothing is left to remember: the next refusal would say 1 s anyway.
    fn recovered(&self, now: Instant) -> bool {
        match self.last {
            None => true,
            Some(last) => {
                // A full decay from the highest level takes less than 4x `RETRY_MAX`.
                now.saturating_duration_since(last) >= RETRY_MAX * 4
            }
        }
    }
}

/// One flow's token bucket: the rate it enforces, the rule's own rate, and what it held
/// after its last take.
struct Limit {
    /// The rate enforced (the rule's, or this Bulwark's share of it).
    rate: Rate,
    /// The rule's rate.
    rule: Rate,
    bucket: FlowBucket,
    /// Tokens left after the last take, and when.
    left: (u32, Instant),
    /// The part of a token a rebuild could not carry (a bucket holds whole tokens), added
    /// at the next: without it every fleet share change would lose one on average.
    fraction: f64,
    /// Requests that asked for a token since the fleet last read them.
    attempts: u64,
}

impl Limit {
    /// A bucket for `rate` holding what the bucket it replaces would hold now (`left`
    /// tokens at its last take, refilled since at the new rate); a new flow's is full.
    fn new(
        rate: Rate,
        rule: Rate,
        clock: &TokioClock,
        old: Option<&Limit>,
        now: Instant,
    ) -> Option<Self> {
        let bucket = RateLimiter::direct_with_clock(quota(rate)?, clock.clone())
            .with_middleware::<StateInformationMiddleware>();
        let burst = rate.burst.max(1);
        let mut left = burst;
        let mut fraction = 0.0;
        if let Some(old) = old {
            // The bucket reports whole tokens: what it held lies within the next one, half
            // of one on average.
            let (had, at) = old.left;
            let had = if had >= old.rate.burst {
                f64::from(had)
            } else {
                f64::from(had) + 0.5
            };
            let refilled = now.saturating_duration_since(at).as_secs_f64() * rate.qps;
            let exact = (had + refilled + old.fraction).min(f64::from(burst));
            left = exact as u32;
            fraction = exact - f64::from(left);
            if let Some(take) = NonZeroU32::new(burst - left) {
                let _ = bucket.check_n(take);
            }
        }
        Some(Self {
            rate,
            rule,
            bucket,
            left: (left, now),
            fraction,
            attempts: old.map_or(0, |l| l.attempts),
        })
    }
}

/// One flow's state.
struct Flow {
    limit: Option<Limit>,
    backoff: Backoff,
    watches: u32,
    last_seen: Instant,
}

impl Flow {
    fn new(now: Instant) -> Self {
        Self {
            limit: None,
            backoff: Backoff::default(),
            watches: 0,
            last_seen: now,
        }
    }

    fn idle(&self, now: Instant, idle_after: Duration) -> bool {
        self.watches == 0
            && now.saturating_duration_since(self.last_seen) >= idle_after
            && self.backoff.recovered(now)
    }
}

type Shard = Mutex<HashMap<String, Flow>>;

/// The table of flows.
pub(crate) struct Flows {
    shards: Box<[Shard]>,
    clock: TokioClock,
    idle_after: Duration,
    /// The most flows a shard holds before a new one evicts the least recently seen flow
    /// without an open watch.
    per_shard: usize,
    /// `bulwark_flows`: flows remembered.
    gauge: IntGauge,
    /// `bulwark_flows_evicted_total{reason="idle"}`.
    evicted_idle: IntCounter,
    /// `bulwark_flows_evicted_total{reason="capacity"}`.
    evicted_capacity: IntCounter,
    /// Next sweep, as time since the clock's origin, and the shard it sweeps.
    sweep: Mutex<(Duration, usize)>,
    /// The next sweep's time in nanoseconds, read without the lock on every request.
    next_sweep: AtomicU64,
    len: AtomicUsize,
    /// When the fleet last read the flows' attempts ([`Flows::take_rate_demand`]).
    rates_read: Mutex<Option<Instant>>,
}

impl Flows {
    /// A table whose flows are evicted after `idle_after` without requests (and with no
    /// open watch and no recent refusal), and that holds about `capacity` flows at most
    /// (each shard its part): past that a new flow evicts the least recently seen flow of
    /// its shard that holds no open watch. Flows with an open watch are never evicted; their
    /// number is bounded by the watches open.
    pub(crate) fn new(
        shards: usize,
        idle_after: Duration,
        capacity: usize,
        metrics: &Metrics,
    ) -> Self {
        let shards = shards.max(1);
        let evicted = |reason: &str| metrics.flows_evicted_total.with_label_values(&[reason]);
        Self {
            shards: (0..shards).map(|_| Mutex::new(HashMap::new())).collect(),
            clock: TokioClock::new(),
            idle_after,
            per_shard: capacity.div_ceil(shards).max(1),
            gauge: metrics.flows.clone(),
            evicted_idle: evicted("idle"),
            evicted_capacity: evicted("capacity"),
            sweep: Mutex::new((Duration::ZERO, 0)),
            next_sweep: AtomicU64::new(0),
            len: AtomicUsize::new(0),
            rates_read: Mutex::new(None),
        }
    }

    /// Flows currently remembered.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub(crate) fn clock(&self) -> &TokioClock {
        &self.clock
    }

    fn shard(&self, hash: u64) -> &Shard {
        // The high bits: the low ones also pick the flow's queues.
        &self.shards[((hash >> 32) as usize) % self.shards.len()]
    }

    fn with<R>(&self, key: &str, hash: u64, now: Instant, f: impl FnOnce(&mut Flow) -> R) -> R {
        let mut shard = self.shard(hash).lock().unwrap_or_else(|p| p.into_inner());
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            self.make_room(&mut shard, now);
        }
        let flow = match shard.get_mut(key) {
            Some(flow) => flow,
            None => {
                self.added(1);
                shard
                    .entry(key.to_owned())
                    .or_insert_with(|| Flow::new(now))
            }
        };
        flow.last_seen = now;
        f(flow)
    }

    /// A full shard's room for one more flow: its idle flows go, and if none is idle, the
    /// least recently seen without an open watch (its bucket and backoff are forgotten: it
    /// starts again as a new flow). A shard whose every flow holds a watch grows past its
    /// part: those flows are bounded by the watches open.
    fn make_room(&self, shard: &mut HashMap<String, Flow>, now: Instant) {
        let before = shard.len();
        shard.retain(|_, flow| !flow.idle(now, self.idle_after));
        let idle = before - shard.len();
        self.removed(idle);
        self.evicted_idle.inc_by(idle as u64);
        if shard.len() < self.per_shard {
            return;
        }
        let oldest = shard
            .iter()
            .filter(|(_, flow)| flow.watches == 0)
            .min_by_key(|(_, flow)| flow.last_seen)
            .map(|(key, _)| key.clone());
        if let Some(key) = oldest {
            shard.remove(&key);
            self.removed(1);
            self.evicted_capacity.inc();
        }
    }

    fn added(&self, n: usize) {
        self.len.fetch_add(n, Ordering::Relaxed);
        self.gauge.add(n as i64);
    }

    fn removed(&self, n: usize) {
        self.len.fetch_sub(n, Ordering::Relaxed);
        self.gauge.sub(n as i64);
    }

    /// Takes a token from the flow's bucket, or says how long until one is there. `rule`
    /// is the rule's rate, `share` the fraction of it this Bulwark holds in its fleet
    /// (`None`: all of it).
    pub(crate) fn check_rate(
        &self,
        key: &str,
        hash: u64,
        rule: Rate,
        share: Option<f64>,
        now: Instant,
    ) -> Result<(), Duration> {
        let clock = &self.clock;
        let rate = scaled(rule, share);
        self.with(key, hash, now, |flow| {
            match &flow.limit {
                Some(limit) if limit.rate == rate && limit.rule == rule => {}
                // A new flow, its rule's rate changed on reload, or its fleet share moved:
                // a bucket as full as the old one is now.
                old => flow.limit = Limit::new(rate, rule, clock, old.as_ref(), now),
            }
            let Some(limit) = &mut flow.limit else {
                return Ok(());
            };
            limit.attempts += 1;
            match limit.bucket.check() {
                Ok(state) => {
                    limit.left = (state.remaining_burst_capacity(), now);
                    Ok(())
                }
                Err(not_until) => {
                    limit.left = (0, now);
                    Err(not_until.wait_time_from(clock.now()))
                }
            }
        })
    }

    /// The flows that asked for at least [`RATE_REPORT_FRACTION`] of their rule's rate
    /// since the last call, with the rate they asked for and their rule's rate, in
    /// thousandths of a request per second: at most [`MAX_RATE_FLOWS`], the busiest for
    /// their rule. What this Bulwark tells its fleet, so that each flow's rate holds across
    /// all replicas (the rule bounds what any member's report of the flow counts for).
    pub(crate) fn take_rate_demand(&self, now: Instant) -> Vec<(String, u64, u64)> {
        let since = {
            let mut read = self.rates_read.lock().unwrap_or_else(|p| p.into_inner());
            read.replace(now)
        };
        let elapsed = since.map_or(Duration::ZERO, |s| now.saturating_duration_since(s));
        let mut asked: Vec<(f64, String, u64, u64)> = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            for (key, flow) in shard.iter_mut() {
                let Some(limit) = &mut flow.limit else {
                    continue;
                };
                let attempts = std::mem::take(&mut limit.attempts);
                if elapsed.is_zero() || attempts == 0 {
                    continue;
                }
                let per_second = attempts as f64 / elapsed.as_secs_f64();
                let of_rule = per_second / limit.rule.qps;
                // A bucket on a share reports whatever it sees, or a replica holding a
                // floor below the threshold would never get more than the floor.
                if of_rule >= RATE_REPORT_FRACTION || limit.rate != limit.rule {
                    let milli = |per_second: f64| (per_second * 1000.0).round() as u64;
                    asked.push((
                        of_rule,
                        key.clone(),
                        milli(per_second),
                        milli(limit.rule.qps),
                    ));
                }
            }
        }
        asked.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        asked.truncate(MAX_RATE_FLOWS);
        asked
            .into_iter()
            .map(|(_, key, milli, rule)| (key, milli, rule))
            .collect()
    }

    /// Records a refusal of the flow and returns its `Retry-After`.
    pub(crate) fn refuse(&self, key: &str, hash: u64, now: Instant) -> Duration {
        self.with(key, hash, now, |flow| flow.backoff.refuse(now))
    }

    /// Counts an open watch of the flow if it has fewer than `limit` (any number when
    /// `limit` is `None`); `None` when it is at its limit.
    pub(crate) fn open_watch(
        self: &Arc<Self>,
        key: &str,
        hash: u64,
        limit: Option<u32>,
        now: Instant,
    ) -> Option<FlowWatch> {
        let opened = self.with(key, hash, now, |flow| {
            if limit.is_some_and(|limit| flow.watches >= limit) {
                false
            } else {
                flow.watches += 1;
                true
            }
        });
        opened.then(|| FlowWatch {
            flows: self.clone(),
            key: key.to_owned(),
            hash,
        })
    }

    /// Evicts idle flows from one shard when a sweep is due: each shard is swept once per
    /// `idle_after`, a bounded amount of work per call.
    pub(crate) fn maybe_sweep(&self, now: Instant) {
        let at = now.saturating_duration_since(self.clock.origin);
        let at_nanos = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        if at_nanos < self.next_sweep.load(Ordering::Relaxed) {
            return;
        }
        let shard = {
            let mut sweep = self.sweep.lock().unwrap_or_else(|p| p.into_inner());
            if at < sweep.0 {
                return;
            }
            let shards = u32::try_from(self.shards.len()).unwrap_or(u32::MAX);
            let step = (self.idle_after / shards).max(Duration::from_millis(10));
            sweep.0 = at + step;
            self.next_sweep.store(
                u64::try_from(sweep.0.as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            sweep.1 = (sweep.1 + 1) % self.shards.len();
            sweep.1
        };
        self.sweep_shard(shard, now);
    }

    /// Evicts every idle flow now.
    pub(crate) fn sweep_all(&self, now: Instant) {
        for shard in 0..self.shards.len() {
            self.sweep_shard(shard, now);
        }
    }

    fn sweep_shard(&self, index: usize, now: Instant) {
        let mut shard = self.shards[index].lock().unwrap_or_else(|p| p.into_inner());
        let before = shard.len();
        shard.retain(|_, flow| !flow.idle(now, self.idle_after));
        let idle = before - shard.len();
        self.removed(idle);
        self.evicted_idle.inc_by(idle as u64);
    }
}

/// An open watch counted against its flow's limit until dropped. Keep it for the life of
/// the watch stream.
pub struct FlowWatch {
    flows: Arc<Flows>,
    key: String,
    hash: u64,
}

impl std::fmt::Debug for FlowWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowWatch")
            .field("flow", &self.key)
            .finish()
    }
}

impl Drop for FlowWatch {
    fn drop(&mut self) {
        let mut shard = self
            .flows
            .shard(self.hash)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(flow) = shard.get_mut(&self.key) {
            flow.watches = flow.watches.saturating_sub(1);
            flow.last_seen = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[tokio::test(start_paused = true, flavor = "current_thread")]
    async fn retry_after_doubles_while_refused_and_halves_when_quiet() {
        let mut backoff = Backoff::default();
        let start = Instant::now();
        let at = |s: u64| start + secs(s);
        assert_eq!(backoff.refuse(at(0)), secs(1));
        // Many refusals within the advised wait all say the same.
        assert_eq!(backoff.refuse(at(0)), secs(1));
        // A client that waits as advised and is refused again is told to wait longer.
        assert_eq!(backoff.refuse(at(1)), secs(2));
        assert_eq!(backoff.refuse(at(3)), secs(4));
        assert_eq!(backoff.refuse(at(7)), secs(8));
        assert_eq!(backoff.refuse(at(15)), secs(16));
        assert_eq!(backoff.refuse(at(31)), secs(32));
        assert_eq!(backoff.refuse(at(63)), secs(32), "capped at 32 s");
        // Quiet for 32 s beyond the advised 32 s: halved once.
        assert_eq!(backoff.refuse(at(63 + 64)), secs(16));
        // Long quiet: back to 1 s.
        assert_eq!(backoff.refuse(at(1000)), secs(1));
    }

    #[tokio::test(start_paused = true, flavor = "current_thread")]
    async fn token_buckets_follow_paused_tokio_time() {
        let flows = Flows::new(4, secs(60), 1_000, &Metrics::new());
        let rate = Rate { qps: 2.0, burst: 2 };
        let now = Instant::now();
        assert!(flows.check_rate("r/a", 1, rate, None, now).is_ok());
        assert!(flows.check_rate("r/a", 1, rate, None, now).is_ok());
        let wait = flows.check_rate("r/a", 1, rate, None, now).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert!(
            flows.check_rate("r/b", 2, rate, None, now).is_ok(),
            "buckets are per flow"
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(
            flows
                .check_rate("r/a", 1, rate, None, Instant::now())
                .is_ok()
        );
    }

    #[test]
    fn a_bucket_s_retry_after_is_when_it_next_admits_jittered_and_capped() {
        let ms = Duration::from_millis;
        let most = |max: u64| max;
        let none = |_: u64| 0;
        for pick in [none, most] {
            assert_eq!(
                bucket_retry_after(ms(300), pick),
                secs(1),
                "a 1/s bucket says 1 s"
            );
            assert_eq!(bucket_retry_after(ms(1000), pick), secs(1));
            assert_eq!(bucket_retry_after(ms(1001), pick), secs(2));
        }
        assert_eq!(bucket_retry_after(secs(8), none), secs(8));
        assert_eq!(bucket_retry_after(secs(8), |_| 1), secs(9));
        assert_eq!(
            bucket_retry_after(secs(8), most),
            secs(10),
            "at most a quarter more"
        );
        assert_eq!(
            bucket_retry_after(secs(8), |_| 99),
            secs(10),
            "a pick is capped"
        );
        assert_eq!(bucket_retry_after(secs(300), none), RETRY_MAX);
    }

    #[tokio::test(start_paused = true, flavor = "current_thread")]
    async fn a_new_fleet_share_scales_the_bucket_without_refilling_it() {
        let flows = Flows::new(4, secs(60), 1_000, &Metrics::new());
        let rule = Rate {
            qps: 10.0,
            burst: 10,
        };
        let take = |share: Option<f64>| {
            (0..100)
                .take_while(|_| {
                    flows
                        .check_rate("r/a", 1, rule, share, Instant::now())
                        .is_ok()
                })
                .count()
        };
        assert_eq!(take(None), 10, "the whole burst");
        // A share arrives while the bucket is empty: it stays empty, no fresh burst.
        assert_eq!(take(Some(0.5)), 0);
        tokio::time::advance(secs(1)).await;
        assert_eq!(take(Some(0.5)), 5, "refilled at half the rate");
        tokio::time::advance(Duration::from_millis(1500)).await;
        // 1.5 s at 2 per second, and the half token a rebuild credits on average for what
        // a bucket holds between whole tokens.
        let refilled = take(Some(0.2));
        assert!(
            (3..=4).contains(&refilled),
            "refilled at a fifth of the rate: {refilled}"
        );
        tokio::time::advance(secs(100)).await;
        assert_eq!(take(Some(0.2)), 10, "up to the rule's whole burst");
        assert_eq!(
            scaled(rule, Some(0.01)),
            Rate {
                qps: 0.1,
                burst: 10
            },
            "the burst stays the rule's"
        );
        assert_eq!(scaled(rule, Some(1.0)), rule);
        assert_eq!(scaled(rule, Some(f64::NAN)), rule);
    }

    #[tokio::test(start_paused = true, flavor = "current_thread")]
    async fn the_fleet_hears_of_the_flows_near_their_rate_and_only_the_busiest() {
        let flows = Flows::new(4, secs(600), 1_000, &Metrics::new());
        let rule = Rate {
            qps: 10.0,
            burst: 1000,
        };
        assert!(flows.take_rate_demand(Instant::now()).is_empty());
        // Over two seconds: flow `busy` asks 8 per second, `quiet` 0.5 (5% of its rule),
        // refused requests counted too.
        for n in 0..16 {
            let _ = flows.check_rate("r/busy", 1, rule, Some(0.01), Instant::now());
            if n == 0 {
                let _ = flows.check_rate("r/quiet", 2, rule, None, Instant::now());
            }
        }
        tokio::time::advance(secs(2)).await;
        assert_eq!(
            flows.take_rate_demand(Instant::now()),
            vec![("r/busy".to_string(), 8000, 10_000)]
        );
        tokio::time::advance(secs(2)).await;
        assert!(
            flows.take_rate_demand(Instant::now()).is_empty(),
            "each read counts from the last"
        );
        for i in 0..(MAX_RATE_FLOWS + 50) {
            for _ in 0..=(i / 10) {
                let _ = flows.check_rate(&format!("r/{i}"), i as u64, rule, None, Instant::now());
            }
        }
        tokio::time::advance(secs(1)).await;
        let heard = flows.take_rate_demand(Instant::now());
        assert_eq!(heard.len(), MAX_RATE_FLOWS);
        assert_eq!(
            heard[0],
            ("r/170".to_string(), 18_000, 10_000),
            "the busiest first"
        );
        assert!(heard.iter().all(|(_, milli, _)| *milli >= 1_000));
    }

    #[tokio::test(start_paused = true, flavor = "current_thread")]
    async fn a_full_table_forgets_its_least_recently_seen_flow_without_a_watch() {
        let metrics = Metrics::new();
        let flows = Arc::new(Flows::new(1, secs(60), 3, &metrics));
        // A token every 100 s: an emptied bucket stays empty through the test.
        let rate = Rate {
            qps: 0.01,
            burst: 1,
        };
        let evicted = |reason: &str| {
            metrics
                .flows_evicted_total
                .with_label_values(&[reason])
                .get()
        };
        let take = |key: &str| flows.check_rate(key, 1, rate, None, Instant::now());
        // `w` holds a watch; `a` and `b` empty their buckets.
        let watch = flows.open_watch("r/w", 1, Some(1), Instant::now()).unwrap();
        tokio::time::advance(secs(1)).await;
        assert!(take("r/a").is_ok() && take("r/a").is_err());
        tokio::time::advance(secs(1)).await;
        assert!(take("r/b").is_ok());
        assert_eq!((flows.len(), metrics.flows.get()), (3, 3));
        // A fourth takes the place of `a`: seen before `b`, and `w`'s watch keeps it.
        tokio::time::advance(secs(1)).await;
        assert!(take("r/c").is_ok());
        assert_eq!((flows.len(), metrics.flows.get()), (3, 3));
        assert_eq!(evicted("capacity"), 1);
        assert!(take("r/b").is_err(), "b is remembered, its bucket empty");
        assert!(
            flows
                .open_watch("r/w", 1, Some(1), Instant::now())
                .is_none(),
            "w is remembered, its watch counted"
        );
        // A table of flows that all hold a watch grows past its size rather than forget
        // one: they are bounded by the watches open.
        let more: Vec<FlowWatch> = (0..3)
            .map(|i| {
                flows
                    .open_watch(&format!("r/x{i}"), 1, Some(1), Instant::now())
                    .unwrap()
            })
            .collect();
        assert_eq!(flows.len(), 4, "w and x0..x2; b and c were forgotten");
        assert_eq!(evicted("capacity"), 3);
        // Idle flows go first, and are counted as idle.
        drop((watch, more));
        tokio::time::advance(secs(600)).await;
        assert!(take("r/d").is_ok());
        assert_eq!((flows.len(), metrics.flows.get()), (1, 1));
        assert_eq!(evicted("idle"), 4);
        assert_eq!(evicted("capacity"), 3);
        assert!(metrics.render().contains("bulwark_flows_evicted_total"));
    }
}
