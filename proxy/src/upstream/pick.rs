//! Which replica a request goes to: power of two choices on load, ejection with backoff, and
//! the rules that keep a degraded fleet serving (never the last replica, all when most are out).
//!
//! Pure bookkeeping over atomics and one mutex: no I/O, so every rule is tested in memory
//! under paused tokio time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::uri::Authority;
use prometheus::{IntCounter, IntGauge};
use rand::Rng;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{ReplicaView, UpstreamError};

/// Indexes of replicas: as many as a control plane has kept in place, not on the heap.
pub(crate) type Replicas = smallvec::SmallVec<[usize; 8]>;
use crate::config::ReplicaAddr;
use crate::metrics::Metrics;

/// How much a replica that answered 429 counts against itself while throttled: its load is
/// multiplied by this, so it gets a share of traffic again only once the others are busier.
const THROTTLE_FACTOR: f64 = 4.0;

/// How long a 429 lowers a replica's weight when it gave no usable `Retry-After`.
pub(crate) const THROTTLE_DEFAULT: Duration = Duration::from_secs(10);

/// Longest a `Retry-After` from a replica keeps its weight lowered.
pub(crate) const THROTTLE_MAX: Duration = Duration::from_secs(60);

/// Which count balances a request: ordinary requests by pending requests and in-flight LIST
/// bytes, watches by open watches (a watch is cheap per second but lives for minutes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Load {
    /// Pending requests plus in-flight LIST bytes.
    Requests,
    /// Open watch streams.
    Watches,
}

/// Why a replica is taken out of rotation. 5xx answers are never a cause: a failing
/// admission webhook makes every replica answer 5xx.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EjectCause {
    /// TCP connect or TLS handshake failed.
    Connect,
    /// A stream or connection was reset (other than `REFUSED_STREAM`).
    Reset,
    /// `/readyz` answered something other than 200; the replica stays out until a probe
    /// succeeds. Requests waiting on it keep waiting: it answers, so they may well finish.
    Probe,
    /// `/readyz` got no answer at all in time (a stopped process, a wedged node); the
    /// replica stays out until a probe succeeds, and the reads waiting on it are sent to
    /// other replicas at once ([`Replica::unresponsive`]).
    Unresponsive,
}

/// Why a request was sent again after a replica failed it: the `reason` label of
/// `bulwark_upstream_retries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryReason {
    /// It provably never reached the apiserver (connect error, refused stream, GOAWAY).
    NotSent,
    /// The exchange broke after the request may have arrived (a read).
    Reset,
    /// No response head within the attempt limit (a read).
    AttemptTimeout,
    /// The replica was ejected for not answering its probe while the read waited (a read).
    Unresponsive,
}

impl RetryReason {
    const ALL: [RetryReason; 4] = [
        RetryReason::NotSent,
        RetryReason::Reset,
        RetryReason::AttemptTimeout,
        RetryReason::Unresponsive,
    ];

    fn label(self) -> &'static str {
        match self {
            RetryReason::NotSent => "not_sent",
            RetryReason::Reset => "reset",
            RetryReason::AttemptTimeout => "attempt_timeout",
            RetryReason::Unresponsive => "unresponsive",
        }
    }
}

/// One apiserver replica and its live counters.
pub(crate) struct Replica {
    /// The address as configured, also the metric label.
    pub(crate) name: Arc<str>,
    /// Host part of the address (no brackets for IPv6).
    pub(crate) host: String,
    /// Port part of the address.
    pub(crate) port: u16,
    /// The address as every request's `:authority` (or `Host`) names it.
    pub(crate) authority: Authority,
    pending: AtomicU64,
    watches: AtomicU64,
    in_flight_bytes: AtomicU64,
    in_flight_gauge: IntGauge,
    watches_gauge: IntGauge,
    healthy_gauge: IntGauge,
    /// `bulwark_upstream_responses_total` of this replica for each of
    /// [`RESPONSE_CLASSES`], resolved once rather than looked up by label per response.
    responses: [IntCounter; RESPONSE_CLASSES.len()],
    /// `bulwark_upstream_retries_total` of this replica for each [`RetryReason`].
    retries: [IntCounter; RetryReason::ALL.len()],
    /// Bumped when the replica is ejected as [`EjectCause::Unresponsive`]; a read waiting
    /// for its response head subscribes before it is sent and leaves when this changes,
    /// and a response body that then stops is ended ([`super::body::Ejection`]).
    unresponsive: watch::Sender<()>,
    /// `bulwark_responses_cut_total{reason="upstream_unresponsive"}`.
    cut_unresponsive: IntCounter,
}

/// The `code_class` labels of `bulwark_upstream_responses_total`: a status class, or
/// `error` for an exchange that got no answer.
const RESPONSE_CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"];

impl Replica {
    /// The replica at `addr`, its metrics resolved; its name is the address as written
    /// back (`host:port`, the host lowercase).
    fn new(addr: &ReplicaAddr, metrics: &Metrics) -> Result<Self, UpstreamError> {
        let name = addr.to_string();
        let name = name.as_str();
        let bad = |why: &str| UpstreamError::Config(format!("upstream replica {name:?}: {why}"));
        let authority = Authority::from_maybe_shared(bytes::Bytes::from(name.to_owned()))
            .map_err(|_| bad("not a host and port"))?;
        let label = [name];
        Ok(Self {
            name: name.into(),
            host: addr.host.clone(),
            port: addr.port,
            authority,
            pending: AtomicU64::new(0),
            watches: AtomicU64::new(0),
            in_flight_bytes: AtomicU64::new(0),
            in_flight_gauge: metrics.upstream_in_flight.with_label_values(&label),
            watches_gauge: metrics.upstream_watches.with_label_values(&label),
            healthy_gauge: metrics.upstream_healthy.with_label_values(&label),
            responses: RESPONSE_CLASSES.map(|class| {
                metrics
                    .upstream_responses_total
                    .with_label_values(&[name, class])
            }),
            retries: RetryReason::ALL.map(|reason| {
                metrics
                    .upstream_retries_total
                    .with_label_values(&[name, reason.label()])
            }),
            unresponsive: watch::Sender::new(()),
            cut_unresponsive: metrics
                .responses_cut_total
                .with_label_values(&["upstream_unresponsive"]),
        })
    }

    /// Counts one request sent again after this replica failed it.
    pub(crate) fn count_retry(&self, reason: RetryReason) {
        self.retries[reason as usize].inc();
    }

    /// Changes when the replica is ejected for not answering its probe: subscribe before
    /// sending, and wait on [`watch::Receiver::changed`].
    pub(crate) fn unresponsive(&self) -> watch::Receiver<()> {
        self.unresponsive.subscribe()
    }

    /// Counts the response bodies ended because this replica stopped answering.
    pub(crate) fn cut_unresponsive(&self) -> IntCounter {
        self.cut_unresponsive.clone()
    }

    /// Counts one answer of this replica with `status`, or with `None` one exchange that got
    /// no answer.
    pub(crate) fn count_response(&self, status: Option<http::StatusCode>) {
        let class = match status.map(|s| s.as_u16()) {
            Some(100..=199) => 0,
            Some(200..=299) => 1,
            Some(300..=399) => 2,
            Some(400..=499) => 3,
            Some(_) => 4,
            None => 5,
        };
        self.responses[class].inc();
    }

    /// Requests sent and waiting for their response head.
    pub(crate) fn pending(&self) -> u64 {
        self.pending.load(Ordering::Relaxed)
    }

    /// Open watch streams.
    pub(crate) fn watches(&self) -> u64 {
        self.watches.load(Ordering::Relaxed)
    }

    /// In-flight LIST bytes as reported by admission.
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn add_bytes(&self, bytes: u64) {
        self.in_flight_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Removes bytes, saturating at zero so that a double release cannot wrap the counter.
    pub(crate) fn remove_bytes(&self, bytes: u64) {
        let _ = self
            .in_flight_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(bytes))
            });
    }
}

/// Counts a request as pending on its replica until dropped (when its response head arrives
/// or it fails).
pub(crate) struct PendingGuard(Arc<Replica>);

impl PendingGuard {
    pub(crate) fn new(replica: Arc<Replica>) -> Self {
        replica.pending.fetch_add(1, Ordering::Relaxed);
        replica.in_flight_gauge.inc();
        Self(replica)
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::Relaxed);
        self.0.in_flight_gauge.dec();
    }
}

/// Counts an open watch stream on its replica until dropped.
pub(crate) struct ReplicaWatch(Arc<Replica>);

impl ReplicaWatch {
    pub(crate) fn new(replica: Arc<Replica>) -> Self {
        replica.watches.fetch_add(1, Ordering::Relaxed);
        replica.watches_gauge.inc();
        Self(replica)
    }
}

impl Drop for ReplicaWatch {
    fn drop(&mut self) {
        self.0.watches.fetch_sub(1, Ordering::Relaxed);
        self.0.watches_gauge.dec();
    }
}

/// Health of one replica; all replicas' health sits under one lock because the ejection
/// rules look at the whole fleet at once.
#[derive(Debug, Default)]
struct Health {
    /// Out of rotation until then.
    ejected_until: Option<Instant>,
    /// Consecutive ejections since the last success: the exponent of the backoff.
    ejections: u32,
    /// The last `/readyz` failed; only a probe success clears this.
    probe_failed: bool,
    /// Answered 429 recently: counts heavier until then.
    throttled_until: Option<Instant>,
}

impl Health {
    fn out(&self, now: Instant) -> bool {
        self.probe_failed || self.ejected_until.is_some_and(|until| now < until)
    }

    /// Anything but a replica in rotation with a clean record.
    fn troubled(&self, now: Instant) -> bool {
        self.probe_failed
            || self.ejected_until.is_some()
            || self.ejections > 0
            || self.throttled_until.is_some_and(|until| now < until)
    }
}

/// The time a balancer decision is made at, read from the clock at most once, and only
/// if the decision needs it: while every replica is calm, a pick and a success need none.
#[derive(Debug, Default)]
pub(crate) struct Now(std::cell::OnceCell<Instant>);

impl Now {
    /// The time, read now if it was not given or read before.
    pub(crate) fn get(&self) -> Instant {
        *self.0.get_or_init(Instant::now)
    }
}

impl From<Instant> for Now {
    fn from(at: Instant) -> Now {
        Now(std::cell::OnceCell::from(at))
    }
}

/// The replicas, their health, and the pick.
pub(crate) struct Balancer {
    replicas: Vec<Arc<Replica>>,
    health: Mutex<Vec<Health>>,
    /// Whether any replica's health may be troubled ([`Health::troubled`]). While not,
    /// every replica is in rotation, unthrottled, with nothing for a success to clear, and
    /// the pick and the success of every request skip the lock, which the workers'
    /// threads would otherwise pass between them a few times a request. Set under the lock
    /// by whatever troubles a replica; cleared by the next look at the table that finds
    /// none troubled. A pick that reads it just before another thread ejects a replica
    /// is one that took the lock just before the ejection.
    troubled: AtomicBool,
    eject_base: Duration,
    eject_max: Duration,
    /// In-flight LIST bytes that weigh as much as one pending request.
    byte_unit: u64,
}

impl Balancer {
    /// A balancer over the named replicas. `byte_budget` is one replica's in-flight LIST
    /// byte budget; one hundredth of it weighs like one pending request in the pick.
    pub(crate) fn new(
        addrs: &[ReplicaAddr],
        eject_base: Duration,
        eject_max: Duration,
        byte_budget: u64,
        metrics: &Metrics,
    ) -> Result<Self, UpstreamError> {
        if addrs.is_empty() {
            return Err(UpstreamError::Config(
                "at least one upstream replica is required".into(),
            ));
        }
        let replicas = addrs
            .iter()
            .map(|addr| Replica::new(addr, metrics).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        for replica in &replicas {
            replica.healthy_gauge.set(1);
            replica.in_flight_gauge.set(0);
            replica.watches_gauge.set(0);
        }
        let health = replicas.iter().map(|_| Health::default()).collect();
        Ok(Self {
            replicas,
            health: Mutex::new(health),
            troubled: AtomicBool::new(false),
            eject_base,
            eject_max: eject_max.max(eject_base),
            byte_unit: (byte_budget / 100).max(1),
        })
    }

    pub(crate) fn replicas(&self) -> &[Arc<Replica>] {
        &self.replicas
    }

    pub(crate) fn replica(&self, index: usize) -> &Arc<Replica> {
        &self.replicas[index]
    }

    /// The health table with expired ejections cleared (and their gauges set back).
    fn health(&self, now: Instant) -> MutexGuard<'_, Vec<Health>> {
        // A panic elsewhere while holding the lock leaves plain data behind; keep serving.
        let mut health = self.health.lock().unwrap_or_else(|p| p.into_inner());
        for (h, replica) in health.iter_mut().zip(&self.replicas) {
            if h.ejected_until.is_some_and(|until| now >= until) {
                h.ejected_until = None;
                if !h.probe_failed {
                    replica.healthy_gauge.set(1);
                }
            }
        }
        let troubled = health.iter().any(|h| h.troubled(now));
        self.troubled.store(troubled, Ordering::Release);
        health
    }

    /// Whether the health table must be looked at; see `troubled`.
    fn calm(&self) -> bool {
        !self.troubled.load(Ordering::Acquire)
    }

    /// Whether one replica is in rotation now.
    pub(crate) fn in_rotation(&self, index: usize, now: impl Into<Now>) -> bool {
        if self.calm() {
            return index < self.replicas.len();
        }
        let now = now.into().get();
        self.health(now).get(index).is_some_and(|h| !h.out(now))
    }

    /// Replicas in rotation now.
    pub(crate) fn healthy(&self, now: Instant) -> usize {
        if self.calm() {
            return self.replicas.len();
        }
        self.health(now).iter().filter(|h| !h.out(now)).count()
    }

    /// Picks a replica for a request: among replicas in rotation (all of them when more than
    /// half are out), avoiding `exclude` (replicas this request already failed on) unless
    /// nothing else is left, the less loaded of two chosen at random.
    pub(crate) fn pick(
        &self,
        load: Load,
        exclude: &[usize],
        now: impl Into<Now>,
        rng: &mut impl Rng,
    ) -> Option<usize> {
        let now = now.into();
        let (health, in_rotation) = self.rotation(&now);
        let throttled = |i: usize| {
            health
                .as_ref()
                .is_some_and(|h| h[i].throttled_until.is_some_and(|until| now.get() < until))
        };
        let fresh: Replicas = in_rotation
            .iter()
            .copied()
            .filter(|i| !exclude.contains(i))
            .collect();
        let candidates = if fresh.is_empty() { in_rotation } else { fresh };
        match candidates.len() {
            0 => None,
            1 => Some(candidates[0]),
            n => {
                let a = rng.random_range(0..n);
                let mut b = rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                let (a, b) = (candidates[a], candidates[b]);
                let score = |i: usize| self.score(i, load, throttled(i));
                Some(if score(b) < score(a) { b } else { a })
            }
        }
    }

    /// Picks the replica a LIST's bytes are held on (and its request then sent to): the
    /// replica [`Balancer::pick`] chooses for any request (load, pending requests, LIST
    /// bytes in flight and the replica's own 429s counted, ties broken at random), so that
    /// LISTs spread like every other request; when its bytes do not `fit` there, the replica
    /// in rotation with the fewest LIST bytes in flight, if they fit there. The byte budget
    /// and the balancer never disagree about where a LIST lands.
    pub(crate) fn pick_for_bytes(
        &self,
        fits: impl Fn(&str, u64) -> bool,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Option<usize> {
        let fits_on = |i: usize| fits(&self.replicas[i].name, self.replicas[i].in_flight_bytes());
        let chosen = self.pick(Load::Requests, &[], now, rng)?;
        if fits_on(chosen) {
            return Some(chosen);
        }
        let (health, in_rotation) = self.rotation(&Now::from(now));
        drop(health);
        in_rotation
            .into_iter()
            .filter(|&i| i != chosen)
            .min_by_key(|&i| self.replicas[i].in_flight_bytes())
            .filter(|&i| fits_on(i))
    }

    /// Every replica's health now, and the replicas a request may go to: those in
    /// rotation, or all of them when more than half are out.
    /// The health table (none while calm: every replica is in rotation, unthrottled) and
    /// the replicas in rotation.
    fn rotation(&self, now: &Now) -> (Option<MutexGuard<'_, Vec<Health>>>, Replicas) {
        if self.calm() {
            return (None, (0..self.replicas.len()).collect());
        }
        let now = now.get();
        let health = self.health(now);
        let out = health.iter().filter(|h| h.out(now)).count();
        let in_rotation: Replicas = if out * 2 > health.len() {
            (0..health.len()).collect()
        } else {
            (0..health.len()).filter(|&i| !health[i].out(now)).collect()
        };
        (Some(health), in_rotation)
    }

    fn score(&self, index: usize, load: Load, throttled: bool) -> f64 {
        let replica = &self.replicas[index];
        let base = match load {
            Load::Requests => {
                replica.pending() as f64
                    + 1.0
                    + replica.in_flight_bytes() as f64 / self.byte_unit as f64
            }
            Load::Watches => replica.watches() as f64 + 1.0,
        };
        if throttled {
            base * THROTTLE_FACTOR
        } else {
            base
        }
    }

    /// Takes a replica out of rotation for a backoff that doubles with each consecutive
    /// ejection, from `eject_base` up to `eject_max`. Refused (returns false) when it is
    /// the last replica in rotation. A replica already out that failed again (it was used
    /// because most of the fleet is out) has its backoff extended.
    pub(crate) fn eject(&self, index: usize, cause: EjectCause, now: Instant) -> bool {
        let mut health = self.health(now);
        let in_rotation = health.iter().filter(|h| !h.out(now)).count();
        let h = &mut health[index];
        if !h.out(now) && in_rotation <= 1 {
            tracing::warn!(
                replica = %self.replicas[index].name,
                ?cause,
                "not ejecting the last replica in rotation"
            );
            return false;
        }
        let backoff = self
            .eject_base
            .saturating_mul(1u32 << h.ejections.min(20))
            .min(self.eject_max);
        h.ejected_until = Some(now + backoff);
        h.ejections = h.ejections.saturating_add(1);
        self.troubled.store(true, Ordering::Release);
        if matches!(cause, EjectCause::Probe | EjectCause::Unresponsive) {
            h.probe_failed = true;
        }
        self.replicas[index].healthy_gauge.set(0);
        if cause == EjectCause::Unresponsive {
            self.replicas[index].unresponsive.send_replace(());
        }
        tracing::warn!(
            replica = %self.replicas[index].name,
            ?cause,
            ?backoff,
            "replica ejected"
        );
        true
    }

    /// A request got a response head from the replica: its connection-level failures are
    /// over, so the backoff starts from `eject_base` again. A failed probe still holds.
    pub(crate) fn succeeded(&self, index: usize, now: impl Into<Now>) {
        if self.calm() {
            return;
        }
        let mut health = self.health(now.into().get());
        let h = &mut health[index];
        if !h.probe_failed && (h.ejections > 0 || h.ejected_until.is_some()) {
            h.ejections = 0;
            h.ejected_until = None;
            self.replicas[index].healthy_gauge.set(1);
        }
    }

    /// `/readyz` answered 200: the replica is back in rotation at once.
    pub(crate) fn probe_ok(&self, index: usize, now: Instant) {
        let mut health = self.health(now);
        let h = &mut health[index];
        if h.probe_failed || h.ejected_until.is_some() {
            tracing::info!(replica = %self.replicas[index].name, "replica back in rotation");
        }
        h.probe_failed = false;
        h.ejected_until = None;
        h.ejections = 0;
        self.replicas[index].healthy_gauge.set(1);
    }

    /// The replica answered 429: it counts heavier in the pick for `for_how_long`.
    pub(crate) fn throttle(&self, index: usize, for_how_long: Duration, now: Instant) {
        let mut health = self.health(now);
        let until = now + for_how_long.min(THROTTLE_MAX);
        let h = &mut health[index];
        h.throttled_until = Some(h.throttled_until.map_or(until, |u| u.max(until)));
        self.troubled.store(true, Ordering::Release);
    }

    /// When a client refused for lack of a replica should try again: when the first
    /// ejection ends, at least a second.
    pub(crate) fn retry_after(&self, now: Instant) -> Duration {
        self.health(now)
            .iter()
            .filter_map(|h| h.ejected_until)
            .map(|until| until.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::ZERO)
            .clamp(
                Duration::from_secs(1),
                self.eject_max.max(Duration::from_secs(1)),
            )
    }

    /// A view of every replica, for `/debug` and tests.
    pub(crate) fn snapshot(
        &self,
        now: Instant,
        connections: impl Fn(usize) -> usize,
    ) -> Vec<ReplicaView> {
        let health = self.health(now);
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| ReplicaView {
                name: r.name.to_string(),
                healthy: !health[i].out(now),
                pending: r.pending(),
                watches: r.watches(),
                in_flight_bytes: r.in_flight_bytes(),
                connections: connections(i),
                throttled: health[i].throttled_until.is_some_and(|until| now < until),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    const BASE: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(60);

    fn balancer(n: usize) -> (Balancer, Metrics) {
        let metrics = Metrics::new();
        let addrs: Vec<ReplicaAddr> = (0..n)
            .map(|i| format!("10.0.0.{i}:6443").parse().unwrap())
            .collect();
        let b = Balancer::new(&addrs, BASE, MAX, 100 * 1024 * 1024, &metrics).unwrap();
        (b, metrics)
    }

    /// How many of `rounds` picks land on each replica.
    fn spread(b: &Balancer, load: Load, rounds: usize, rng: &mut StdRng) -> Vec<usize> {
        let mut hits = vec![0; b.replicas().len()];
        for _ in 0..rounds {
            hits[b.pick(load, &[], Instant::now(), rng).unwrap()] += 1;
        }
        hits
    }

    #[test]
    fn a_replica_is_named_and_addressed_by_its_configured_address() {
        let m = Metrics::new();
        let r = Replica::new(&"[::1]:6443".parse().unwrap(), &m).unwrap();
        assert_eq!((r.host.as_str(), r.port), ("::1", 6443));
        assert_eq!(
            (&*r.name, r.authority.as_str()),
            ("[::1]:6443", "[::1]:6443")
        );
        let r = Replica::new(&"API.example:443".parse().unwrap(), &m).unwrap();
        assert_eq!(
            (&*r.name, r.authority.as_str()),
            ("api.example:443", "api.example:443")
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_less_loaded_of_two_wins() {
        let (b, _) = balancer(2);
        let mut rng = StdRng::seed_from_u64(1);
        let _busy: Vec<_> = (0..3)
            .map(|_| PendingGuard::new(b.replica(0).clone()))
            .collect();
        assert_eq!(spread(&b, Load::Requests, 50, &mut rng), vec![0, 50]);
        // A pending request stops counting once its response head arrives (guard dropped).
        drop(_busy);
        let hits = spread(&b, Load::Requests, 50, &mut rng);
        assert!(hits[0] > 0 && hits[1] > 0, "{hits:?}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn in_flight_list_bytes_weigh_like_pending_requests() {
        let (b, _) = balancer(2);
        let mut rng = StdRng::seed_from_u64(2);
        // A tenth of the budget weighs like ten pending requests.
        b.replica(0).add_bytes(10 * 1024 * 1024);
        let _five: Vec<_> = (0..5)
            .map(|_| PendingGuard::new(b.replica(1).clone()))
            .collect();
        assert_eq!(spread(&b, Load::Requests, 20, &mut rng), vec![0, 20]);
        b.replica(0).remove_bytes(10 * 1024 * 1024);
        b.replica(0).remove_bytes(1);
        assert_eq!(
            b.replica(0).in_flight_bytes(),
            0,
            "removal saturates at zero"
        );
        assert_eq!(spread(&b, Load::Requests, 20, &mut rng), vec![20, 0]);
    }

    /// Where `rounds` LISTs land when each is answered before the next is sent.
    fn list_spread(b: &Balancer, rounds: usize, rng: &mut StdRng) -> Vec<usize> {
        let mut hits = vec![0; b.replicas().len()];
        for _ in 0..rounds {
            let i = b.pick_for_bytes(|_, _| true, Instant::now(), rng).unwrap();
            hits[i] += 1;
        }
        hits
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn lists_one_after_another_spread_over_the_replicas() {
        // With no LIST in flight every replica ties on bytes: the first in the
        // configuration used to take them all (20 sequential LISTs went 20/0/0).
        let (b, _) = balancer(3);
        let mut rng = StdRng::seed_from_u64(7);
        let hits = list_spread(&b, 60, &mut rng);
        assert!(hits.iter().all(|&h| h >= 10), "{hits:?}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn lists_avoid_a_busy_replica_and_one_that_answers_429() {
        let (b, _) = balancer(3);
        let mut rng = StdRng::seed_from_u64(8);
        let _busy: Vec<_> = (0..20)
            .map(|_| PendingGuard::new(b.replica(0).clone()))
            .collect();
        b.throttle(1, Duration::from_secs(10), Instant::now());
        let hits = list_spread(&b, 60, &mut rng);
        assert_eq!(hits[0], 0, "{hits:?}");
        assert!(hits[2] > hits[1], "{hits:?}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_list_that_does_not_fit_its_pick_goes_where_it_fits_or_nowhere() {
        let (b, _) = balancer(2);
        let mut rng = StdRng::seed_from_u64(9);
        b.replica(0).add_bytes(1000);
        b.replica(1).add_bytes(10);
        for _ in 0..20 {
            let i = b.pick_for_bytes(|_, in_flight| in_flight < 100, Instant::now(), &mut rng);
            assert_eq!(i, Some(1));
        }
        assert_eq!(
            b.pick_for_bytes(|_, in_flight| in_flight < 5, Instant::now(), &mut rng),
            None
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn watches_are_balanced_by_their_own_count() {
        let (b, _) = balancer(2);
        let mut rng = StdRng::seed_from_u64(3);
        let _watches: Vec<_> = (0..4)
            .map(|_| ReplicaWatch::new(b.replica(0).clone()))
            .collect();
        let _pending: Vec<_> = (0..4)
            .map(|_| PendingGuard::new(b.replica(1).clone()))
            .collect();
        // Watches avoid the replica holding watches, requests the one holding requests.
        assert_eq!(spread(&b, Load::Watches, 20, &mut rng), vec![0, 20]);
        assert_eq!(spread(&b, Load::Requests, 20, &mut rng), vec![20, 0]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn power_of_two_choices_spreads_over_a_larger_fleet() {
        let (b, _) = balancer(5);
        let mut rng = StdRng::seed_from_u64(4);
        // Requests that stay pending: the pick keeps the fleet level.
        let mut held = Vec::new();
        for _ in 0..50 {
            let i = b
                .pick(Load::Requests, &[], Instant::now(), &mut rng)
                .unwrap();
            held.push(PendingGuard::new(b.replica(i).clone()));
        }
        let counts: Vec<u64> = b.replicas().iter().map(|r| r.pending()).collect();
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(max - min <= 3, "{counts:?}");
    }

    #[test]
    fn each_answer_is_counted_under_its_replica_and_status_class() {
        let (b, metrics) = balancer(2);
        let replica = b.replica(1);
        for status in [200, 201, 429, 503, 101, 304] {
            replica.count_response(Some(http::StatusCode::from_u16(status).unwrap()));
        }
        replica.count_response(None);
        let count = |name: &str, class: &str| {
            metrics
                .upstream_responses_total
                .with_label_values(&[name, class])
                .get()
        };
        let name = &*replica.name;
        let counts: Vec<u64> = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"]
            .iter()
            .map(|class| count(name, class))
            .collect();
        assert_eq!(counts, [1, 2, 1, 1, 1, 1]);
        assert_eq!(
            count(&b.replica(0).name, "2xx"),
            0,
            "the other replica's are its own"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_ejected_replica_waits_out_a_doubling_backoff() {
        let (b, metrics) = balancer(3);
        let mut rng = StdRng::seed_from_u64(5);
        let now = Instant::now();
        assert!(b.eject(0, EjectCause::Connect, now));
        assert_eq!(b.healthy(now), 2);
        let gauge = metrics
            .upstream_healthy
            .with_label_values(&["10.0.0.0:6443"]);
        assert_eq!(gauge.get(), 0);
        assert_eq!(spread(&b, Load::Requests, 30, &mut rng)[0], 0);

        tokio::time::advance(BASE).await;
        assert_eq!(b.healthy(Instant::now()), 3, "tried again after eject_base");
        assert_eq!(gauge.get(), 1);

        // It fails again without a success in between: twice as long this time.
        assert!(b.eject(0, EjectCause::Reset, Instant::now()));
        tokio::time::advance(BASE).await;
        assert_eq!(b.healthy(Instant::now()), 2);
        tokio::time::advance(BASE).await;
        assert_eq!(b.healthy(Instant::now()), 3);

        // A success resets the backoff to eject_base.
        b.succeeded(0, Instant::now());
        assert!(b.eject(0, EjectCause::Connect, Instant::now()));
        tokio::time::advance(BASE).await;
        assert_eq!(b.healthy(Instant::now()), 3);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_lock_free_pick_holds_only_while_every_replica_is_calm() {
        let (b, _) = balancer(3);
        let mut rng = StdRng::seed_from_u64(7);
        assert!(b.calm(), "a new fleet is calm");
        assert_eq!(b.healthy(Instant::now()), 3);
        // An ejection is seen by the very next pick, lock-free or not.
        assert!(b.eject(1, EjectCause::Connect, Instant::now()));
        assert!(!b.calm());
        assert!(!b.in_rotation(1, Instant::now()));
        assert_eq!(spread(&b, Load::Requests, 30, &mut rng)[1], 0);
        // Back after the backoff, but its ejection count stands until a success clears it.
        tokio::time::advance(BASE).await;
        assert_eq!(b.healthy(Instant::now()), 3);
        assert!(!b.calm(), "a success has yet to reset the backoff");
        b.succeeded(1, Instant::now());
        assert_eq!(b.healthy(Instant::now()), 3);
        assert!(b.calm(), "nothing left to clear");
        // A 429 of the replica's own weighs until it ends, then the fleet is calm again.
        b.throttle(0, Duration::from_secs(5), Instant::now());
        assert!(!b.calm());
        assert!(b.snapshot(Instant::now(), |_| 0)[0].throttled);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(b.healthy(Instant::now()), 3);
        assert!(b.calm());
        // A failed probe holds the replica out until a probe succeeds.
        assert!(b.eject(2, EjectCause::Probe, Instant::now()));
        tokio::time::advance(MAX).await;
        assert!(!b.in_rotation(2, Instant::now()));
        b.probe_ok(2, Instant::now());
        assert!(b.in_rotation(2, Instant::now()));
        assert_eq!(b.healthy(Instant::now()), 3);
        assert!(b.calm());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_backoff_stops_growing_at_eject_max() {
        let (b, _) = balancer(3);
        for _ in 0..12 {
            assert!(b.eject(0, EjectCause::Connect, Instant::now()));
        }
        tokio::time::advance(MAX - Duration::from_millis(1)).await;
        assert_eq!(b.healthy(Instant::now()), 2);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.healthy(Instant::now()), 3);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_last_replica_in_rotation_is_never_ejected() {
        let (b, _) = balancer(2);
        let now = Instant::now();
        assert!(b.eject(0, EjectCause::Connect, now));
        assert!(!b.eject(1, EjectCause::Connect, now));
        assert!(!b.eject(1, EjectCause::Probe, now));
        assert_eq!(b.healthy(now), 1);
        let mut rng = StdRng::seed_from_u64(6);
        assert_eq!(spread(&b, Load::Requests, 10, &mut rng), vec![0, 10]);

        let (single, _) = balancer(1);
        assert!(!single.eject(0, EjectCause::Reset, now));
        assert_eq!(single.healthy(now), 1);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn all_replicas_are_used_when_more_than_half_are_out() {
        let (b, _) = balancer(4);
        let now = Instant::now();
        let mut rng = StdRng::seed_from_u64(7);
        assert!(b.eject(0, EjectCause::Connect, now));
        assert!(b.eject(1, EjectCause::Probe, now));
        // Half out: only the two in rotation are used.
        let hits = spread(&b, Load::Requests, 40, &mut rng);
        assert_eq!(&hits[..2], &[0, 0]);
        // More than half out: every replica takes traffic again.
        assert!(b.eject(2, EjectCause::Reset, now));
        assert_eq!(b.healthy(now), 1);
        let hits = spread(&b, Load::Requests, 200, &mut rng);
        assert!(hits.iter().all(|&h| h > 0), "{hits:?}");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_failed_probe_holds_until_a_probe_succeeds() {
        let (b, _) = balancer(3);
        assert!(b.eject(2, EjectCause::Probe, Instant::now()));
        tokio::time::advance(MAX * 2).await;
        assert_eq!(
            b.healthy(Instant::now()),
            2,
            "backoff over, /readyz still failing"
        );
        b.succeeded(2, Instant::now());
        assert_eq!(
            b.healthy(Instant::now()),
            2,
            "a served request does not override /readyz"
        );
        b.probe_ok(2, Instant::now());
        assert_eq!(b.healthy(Instant::now()), 3);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_probe_success_brings_a_replica_back_before_its_backoff_ends() {
        let (b, _) = balancer(3);
        for _ in 0..5 {
            b.eject(1, EjectCause::Connect, Instant::now());
        }
        assert_eq!(b.healthy(Instant::now()), 2);
        b.probe_ok(1, Instant::now());
        assert_eq!(b.healthy(Instant::now()), 3);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_429_lowers_the_weight_for_a_while() {
        let (b, _) = balancer(2);
        let mut rng = StdRng::seed_from_u64(8);
        b.throttle(0, THROTTLE_DEFAULT, Instant::now());
        // Replica 1 is busier, but not four times as busy: the throttled one still loses.
        let _one = PendingGuard::new(b.replica(1).clone());
        assert_eq!(spread(&b, Load::Requests, 20, &mut rng), vec![0, 20]);
        // Much busier: the throttled one takes traffic rather than piling onto the other.
        let _more: Vec<_> = (0..6)
            .map(|_| PendingGuard::new(b.replica(1).clone()))
            .collect();
        assert_eq!(spread(&b, Load::Requests, 20, &mut rng), vec![20, 0]);
        drop(_more);
        tokio::time::advance(THROTTLE_DEFAULT).await;
        assert_eq!(spread(&b, Load::Requests, 20, &mut rng), vec![20, 0]);
        // It stays in rotation throughout: a 429 is not an ejection.
        assert_eq!(b.healthy(Instant::now()), 2);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_retry_avoids_replicas_already_tried_unless_none_is_left() {
        let (b, _) = balancer(3);
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..20 {
            let i = b.pick(Load::Requests, &[0, 1], Instant::now(), &mut rng);
            assert_eq!(i, Some(2));
        }
        let i = b.pick(Load::Requests, &[0, 1, 2], Instant::now(), &mut rng);
        assert!(i.is_some());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn retry_after_is_when_the_first_ejection_ends() {
        let (b, _) = balancer(3);
        let now = Instant::now();
        assert_eq!(b.retry_after(now), Duration::from_secs(1));
        for _ in 0..4 {
            b.eject(0, EjectCause::Connect, now);
        }
        assert_eq!(b.retry_after(now), Duration::from_secs(8));
    }
}
