//! Admission (DESIGN.md step 6): decides whether, and when, a classified and matched request
//! may run.
//!
//! In order: the flow's token bucket (`flows`), the rule's per-flow watch limit, the cost
//! of the request (`cost`: seats, and bytes for a LIST), then the level's shuffle-sharded
//! fair queues (`queue`) until both the seats and, for a LIST, the bytes on a replica
//! (`budget`) are free — holding neither while it waits. A refusal is a [`Refusal`] with
//! the rule, the level, the reason and the flow's own `Retry-After`. Shadow-mode rules
//! refuse nothing: they count and log what they would have refused. Exempt levels have no
//! limits at all.
//!
//! Refusals are counted in `bulwark_rejected_requests_total` by the layer that answers them
//! (`stages::rescue::Rescue`), not here, so that each is counted once.
//!
//! Wiring: build one [`Admission`] from the rule set's levels and the [`Upstream`], call
//! [`Admission::update_levels`] with the levels of every new rule set, and for each matched
//! request [`Admission::admit`] it, saying where its answer comes from ([`Answer`]); the
//! stage that does so for every request is `stages::admit`. Keep the [`Permit`] alive until
//! the response body ends; for a long-running request call [`Permit::release_seats`] at the
//! response head, and for a watch keep [`Permit::watch_guard`] with the stream. A LIST's
//! response teaches the cost model through [`hold`] with a [`Learn`]: the JSON size the
//! apiserver built, measured on the wire where the response shows it ([`measure`]), so that
//! costs follow the collection.

mod budget;
mod cost;
pub(crate) mod flows;
mod local;
pub mod measure;
mod progress;
mod queue;
#[cfg(test)]
mod tests;

use foldhash::{HashMap, HashMapExt as _};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use governor::{Quota, RateLimiter};
use serde_json::json;
use tokio::time::Instant;

use crate::Body;
use crate::classify::{RequestInfo, Verb};
use crate::fleet::FleetShares;
use crate::identity::User;
use crate::metrics::Metrics;
use crate::rules::{LevelSpec, Matched, Mode, Rate};
use crate::status::{Reason, Refusal};
use crate::upstream::Upstream;

pub use budget::{ByteBudget, LocalBudget, Reservation, UpstreamBudget};
pub use flows::FlowWatch;
pub use local::ProxyLocal;
pub use progress::SendProgress;

use cost::CostModel;
use flows::{Bucket, Flows};
use queue::{BytesHeld, Level, SeatGrant, WaitEnd, flow_hash};

/// Where a request's answer comes from, as admission weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// An apiserver answers: seats, and for a LIST its bytes on a replica.
    Upstream,
    /// Bulwark's cache answers with `bytes` of objects: seats by those bytes.
    Cache {
        /// The bytes of objects in the answer.
        bytes: u64,
    },
}

/// The flows a Bulwark remembers at most by default: a flow is some 400 bytes with its key,
/// so the table stays within about 40 MB whatever the clients do.
pub const MAX_FLOWS: usize = 100_000;

/// Tunables of admission; the defaults suit a production fleet.
#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    /// LIST bytes that weigh as one seat. `None`: a hundredth of a replica's byte budget,
    /// the same weight the replica pick gives in-flight bytes.
    pub seat_unit_bytes: Option<u64>,
    /// What a LIST of a scope never seen is assumed to cost. `None`: a quarter of a
    /// replica's byte budget, so a cold start admits a few unknown LISTs per replica, not
    /// a storm.
    pub unknown_list_bytes: Option<u64>,
    /// A flow with no request for this long (and no open watch, and no recent refusal)
    /// is forgotten.
    pub flow_idle: Duration,
    /// Shards of the flow table (lock contention).
    pub flow_shards: usize,
    /// Flows remembered at most (those with an open watch aside): past it a new flow
    /// evicts the least recently seen of its shard (`bulwark_flows_evicted_total`).
    pub max_flows: usize,
    /// LIST scopes and shapes remembered by the cost model (each, LRU).
    pub cost_capacity: usize,
    /// Shadow-mode would-be refusals logged per second (the rest are only counted).
    pub shadow_logs_per_second: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            seat_unit_bytes: None,
            unknown_list_bytes: None,
            flow_idle: Duration::from_secs(300),
            flow_shards: 64,
            max_flows: MAX_FLOWS,
            cost_capacity: 100_000,
            shadow_logs_per_second: 5,
        }
    }
}

/// What this Bulwark asks of the fleet ([`Admission::fleet_demand`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FleetDemand {
    /// LIST bytes waiting for seats or room, all levels together.
    pub list_bytes: u64,
    /// Per level: seats executing and waiting.
    pub seats: std::collections::BTreeMap<String, u64>,
}

/// The admission controller: one per Bulwark, shared behind an `Arc`.
pub struct Admission {
    shared: Arc<Shared>,
}

/// What levels and byte reservations reach back to.
pub(crate) struct Shared {
    levels: RwLock<HashMap<String, Arc<Level>>>,
    /// Levels replaced by a reload that still hold queued or executing requests.
    draining: Mutex<Vec<Arc<Level>>>,
    flows: Arc<Flows>,
    cost: CostModel,
    budget: Arc<dyn ByteBudget>,
    metrics: Metrics,
    shadow_log: Option<Bucket>,
    weak: Weak<Shared>,
}

impl Shared {
    /// Bytes were released: LISTs waiting for bytes in any level may go now.
    pub(crate) fn redispatch_byte_blocked(&self) {
        let levels: Vec<Arc<Level>> = {
            let current = self.levels.read().unwrap_or_else(|p| p.into_inner());
            let draining = self.draining.lock().unwrap_or_else(|p| p.into_inner());
            current.values().chain(draining.iter()).cloned().collect()
        };
        for level in levels {
            level.redispatch_if_byte_blocked();
        }
    }

    fn new_level(&self, spec: Arc<LevelSpec>) -> Arc<Level> {
        Level::new(spec, self.budget.clone(), self.weak.clone(), &self.metrics)
    }
}

/// Held while the request executes: seats (released at the response head for long-running
/// requests, else when the response body ends), LIST bytes on a replica, and for a watch
/// its place in the flow's watch limit. Dropping it releases everything.
#[derive(Default)]
pub struct Permit {
    // Bytes before seats: when both go, the bytes are free by the time the level
    // dispatches again.
    bytes: Option<BytesHeld>,
    seats: Option<SeatGrant>,
    watch: Option<FlowWatch>,
    expected_bytes: u64,
    level: Option<Arc<LevelSpec>>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("level", &self.level.as_ref().map(|l| &l.name))
            .field("seats", &self.seats.is_some())
            .field("replica", &self.replica())
            .field("expected_bytes", &self.expected_bytes)
            .field("watch", &self.watch.is_some())
            .finish()
    }
}

impl Permit {
    /// Gives the seats back (at the response head of a long-running request). The LIST
    /// bytes and the watch stay held until the permit is dropped.
    pub fn release_seats(&mut self) {
        self.seats = None;
    }

    /// Takes the seats out of the permit, to be given back when the returned [`Seats`] is
    /// dropped: a cached watch holds them while it sends its initial state.
    pub fn take_seats(&mut self) -> Option<Seats> {
        self.seats.take().map(|grant| Seats { _grant: grant })
    }

    /// The LIST bytes the request was admitted with (0 for anything but a LIST).
    pub fn expected_bytes(&self) -> u64 {
        self.expected_bytes
    }

    /// The replica whose byte budget holds this LIST's bytes.
    pub fn replica(&self) -> Option<&str> {
        self.bytes.as_ref().and_then(|b| b.replica())
    }

    /// Whether the permit still holds seats.
    pub fn holds_seats(&self) -> bool {
        self.seats.is_some()
    }

    /// Whether it holds what other requests wait for, seats or LIST bytes: its response is
    /// then watched for its client's pace ([`hold`]).
    pub fn holds_what_others_wait_for(&self) -> bool {
        self.seats.is_some() || self.bytes.is_some()
    }

    /// For a watch with a per-flow limit: the guard that keeps it counted. Keep it for the
    /// life of the stream; the rest of the permit may be dropped.
    pub fn watch_guard(&mut self) -> Option<FlowWatch> {
        self.watch.take()
    }
}

/// Seats taken out of a [`Permit`]; dropping them gives them back to their level.
pub struct Seats {
    _grant: SeatGrant,
}

/// A would-be refusal, before it is turned into a [`Refusal`] or counted in shadow mode.
struct Verdict {
    reason: Reason,
    message: Arc<str>,
    /// A lower bound for `Retry-After` (the token bucket's own wait).
    at_least: Duration,
}

impl Admission {
    /// Admission for the levels of a rule set, with the in-flight LIST byte budgets of
    /// `upstream`'s replicas.
    pub fn new(levels: &[Arc<LevelSpec>], upstream: Upstream, metrics: Metrics) -> Arc<Self> {
        let budget = Arc::new(UpstreamBudget::new(upstream, &metrics));
        Self::with_budget(levels, budget, AdmissionConfig::default(), metrics)
    }

    /// As [`Admission::new`], with each replica's byte budget and each level's seats the
    /// shares this Bulwark holds in its fleet.
    pub fn in_fleet(
        levels: &[Arc<LevelSpec>],
        upstream: Upstream,
        shares: FleetShares,
        metrics: Metrics,
    ) -> Arc<Self> {
        let budget = Arc::new(UpstreamBudget::new(upstream, &metrics).in_fleet(shares));
        Self::with_budget(levels, budget, AdmissionConfig::default(), metrics)
    }

    /// Admission over any [`ByteBudget`] (a [`LocalBudget`] in tests and benches).
    pub fn with_budget(
        levels: &[Arc<LevelSpec>],
        budget: Arc<dyn ByteBudget>,
        config: AdmissionConfig,
        metrics: Metrics,
    ) -> Arc<Self> {
        let per_replica = budget.budget();
        let seat_unit = config
            .seat_unit_bytes
            .unwrap_or((per_replica / 100).max(64 * 1024));
        let unknown = config.unknown_list_bytes.unwrap_or(per_replica / 4);
        let flows = Arc::new(Flows::new(
            config.flow_shards,
            config.flow_idle,
            config.max_flows,
            &metrics,
        ));
        let shadow_log = std::num::NonZeroU32::new(config.shadow_logs_per_second)
            .map(|n| RateLimiter::direct_with_clock(Quota::per_second(n), flows.clock().clone()));
        let shared = Arc::new_cyclic(|weak| Shared {
            levels: RwLock::new(HashMap::new()),
            draining: Mutex::new(Vec::new()),
            flows,
            cost: CostModel::new(seat_unit, unknown, config.cost_capacity),
            budget,
            metrics,
            shadow_log,
            weak: weak.clone(),
        });
        let admission = Arc::new(Self { shared });
        admission.update_levels(levels);
        admission
    }

    /// Takes the levels of a new rule set. A level whose definition did not change keeps
    /// its queues and everything in them; a changed or removed level finishes what it
    /// queued and runs (it drains) while new requests go to its successor. Nothing queued
    /// or executing is dropped.
    pub fn update_levels(&self, levels: &[Arc<LevelSpec>]) {
        let shared = &self.shared;
        let mut current = shared.levels.write().unwrap_or_else(|p| p.into_inner());
        let mut old = std::mem::take(&mut *current);
        let mut retired = Vec::new();
        for spec in levels {
            let level = match old.remove(&spec.name) {
                Some(level) if *level.spec == **spec => level,
                Some(level) => {
                    retired.push(level);
                    shared.new_level(spec.clone())
                }
                None => shared.new_level(spec.clone()),
            };
            current.insert(spec.name.clone(), level);
        }
        retired.extend(old.into_values());
        drop(current);
        let mut draining = shared.draining.lock().unwrap_or_else(|p| p.into_inner());
        for level in retired {
            level.set_draining();
            draining.push(level);
        }
        draining.retain(|level| !level.idle());
    }

    /// The level of a matched request: the current one of that name. A request matched
    /// against rules whose levels were not handed to [`Admission::update_levels`] yet
    /// creates its level.
    fn level(&self, spec: &Arc<LevelSpec>) -> Arc<Level> {
        if let Some(level) = self
            .shared
            .levels
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&spec.name)
        {
            return level.clone();
        }
        let mut levels = self
            .shared
            .levels
            .write()
            .unwrap_or_else(|p| p.into_inner());
        levels
            .entry(spec.name.clone())
            .or_insert_with(|| self.shared.new_level(spec.clone()))
            .clone()
    }

    /// The one entry point: waits (fair queue) until the request may run, or refuses it.
    /// First the flow's token bucket — answers from the cache pass it too, since a rate is
    /// a promise about an identity wherever the answer comes from — then what the answer
    /// costs:
    ///
    /// - [`Answer::Upstream`]: the watch limit, the fair queue, seats and the LIST bytes
    ///   on the replica the balancer picks ([`Permit::replica`]);
    /// - [`Answer::Cache`]: seats by the answer's bytes in the level's fair queue. Such an
    ///   answer costs no apiserver memory, so it holds no replica's LIST bytes; it costs
    ///   Bulwark's CPU and network, which the level's seats share fairly between flows (a
    ///   storm of cluster-wide LISTs answered from the cache would otherwise take every
    ///   core from the small requests of other levels). A cached watch from a version only
    ///   counts against the flow's watch limit: it sends events as they come, so queueing
    ///   it would guard nothing. A cached watch that starts with the current state sends a
    ///   LIST's worth of objects first: it waits for seats like a LIST of that size (take
    ///   them out with [`Permit::take_seats`] and hold them until that state is sent).
    pub async fn admit(
        &self,
        m: &Matched,
        info: &RequestInfo,
        user: &User,
        answer: Answer,
    ) -> Result<Permit, Refusal> {
        self.check_rate(m, user)?;
        match answer {
            Answer::Upstream => {
                let bytes = self.shared.cost.bytes(info);
                self.admit_cost(m, user, info, bytes, bytes).await
            }
            Answer::Cache { bytes } if info.verb == Verb::Watch && bytes == 0 => {
                self.admit_watch_only(m, user)
            }
            Answer::Cache { bytes } => self.admit_cost(m, user, info, bytes, 0).await,
        }
    }

    /// The flow's token bucket. Each request is counted here, once, under its rule
    /// (`bulwark_rule_requests_total`).
    fn check_rate(&self, m: &Matched, user: &User) -> Result<(), Refusal> {
        self.shared
            .metrics
            .count_rule(&m.rule, m.level.name.as_str());
        let Some(rate) = m.rate.filter(|_| !m.level.exempt) else {
            return Ok(());
        };
        let shared = &self.shared;
        let now = Instant::now();
        shared.flows.maybe_sweep(now);
        let level = self.level(&m.level);
        let hash = flow_hash(&m.flow);
        let share = shared.budget.rate_share(&m.flow);
        if let Err(wait) = shared.flows.check_rate(&m.flow, hash, rate, share, now) {
            let held = flows::scaled(rate, share);
            let message = over_rate(&m.flow, hash, rate, held);
            self.verdict(
                m,
                &level,
                user,
                hash,
                now,
                Verdict {
                    reason: Reason::RateLimited,
                    message,
                    at_least: wait,
                },
            )?;
        }
        Ok(())
    }

    fn admit_watch_only(&self, m: &Matched, user: &User) -> Result<Permit, Refusal> {
        let level = self.level(&m.level);
        let mut permit = Permit {
            level: Some(level.spec.clone()),
            ..Permit::default()
        };
        if !m.level.exempt {
            permit.watch = self.open_watch(m, user, &level, flow_hash(&m.flow), Instant::now())?;
        }
        Ok(permit)
    }

    /// The flow's place in its watch limit (`None` without a limit), or a refusal.
    fn open_watch(
        &self,
        m: &Matched,
        user: &User,
        level: &Level,
        hash: u64,
        now: Instant,
    ) -> Result<Option<FlowWatch>, Refusal> {
        let flows = &self.shared.flows;
        if m.watches.is_none() {
            return Ok(None);
        }
        if let Some(guard) = flows.open_watch(&m.flow, hash, m.watches, now) {
            return Ok(Some(guard));
        }
        self.verdict(
            m,
            level,
            user,
            hash,
            now,
            Verdict {
                reason: Reason::WatchLimit,
                message: format!(
                    "flow {} has {} open watches, as many as its rule allows",
                    m.flow,
                    m.watches.unwrap_or(0)
                )
                .into(),
                at_least: Duration::ZERO,
            },
        )?;
        // Shadow mode: the watch runs and still counts.
        Ok(flows.open_watch(&m.flow, hash, None, now))
    }

    /// The watch limit and the fair queue for a request of `seat_bytes` (its seats) that
    /// must also hold `budget_bytes` of LIST budget on a replica.
    async fn admit_cost(
        &self,
        m: &Matched,
        user: &User,
        info: &RequestInfo,
        seat_bytes: u64,
        budget_bytes: u64,
    ) -> Result<Permit, Refusal> {
        if m.level.exempt {
            return Ok(Permit {
                level: Some(m.level.clone()),
                ..Permit::default()
            });
        }
        let shared = &self.shared;
        let now = Instant::now();
        let level = self.level(&m.level);
        let hash = flow_hash(&m.flow);
        let shadow = m.mode == Mode::Shadow;

        let mut permit = Permit {
            level: Some(level.spec.clone()),
            ..Permit::default()
        };
        if info.verb == Verb::Watch {
            permit.watch = self.open_watch(m, user, &level, hash, now)?;
        }

        let seats = shared.cost.seats(seat_bytes, level.spec.seats);
        let bytes = budget_bytes;
        permit.expected_bytes = bytes;

        if shadow {
            if level.would_be_full(hash, seats) {
                self.verdict(m, &level, user, hash, now, queue_full(m, &level))?;
            }
            // Shadow requests hold no seats, but their LISTs use real apiserver memory.
            if bytes > 0 {
                permit.bytes = shared
                    .budget
                    .reserve_anyway(bytes)
                    .map(|r| BytesHeld::new(r, shared.weak.clone()));
            }
            return Ok(permit);
        }

        let ticket = match level.enqueue(hash, seats, bytes, now) {
            Ok(ticket) => ticket,
            Err(queue::Full) => {
                self.verdict(m, &level, user, hash, now, queue_full(m, &level))?;
                return Ok(permit);
            }
        };
        match ticket.wait(now + level.spec.max_wait).await {
            Ok(grant) => {
                permit.seats = Some(grant.seats);
                permit.bytes = grant.bytes;
                Ok(permit)
            }
            Err(end) => {
                let verdict = match end {
                    WaitEnd::Timeout => Verdict {
                        reason: Reason::QueueTimeout,
                        message: format!(
                            "waited {:?} in level {} without a free seat",
                            level.spec.max_wait, level.spec.name
                        )
                        .into(),
                        at_least: Duration::ZERO,
                    },
                    WaitEnd::Bytes => Verdict {
                        reason: Reason::ByteBudget,
                        message: format!(
                            "waited {:?} for {bytes} bytes of LIST budget on an apiserver replica",
                            level.spec.max_wait
                        )
                        .into(),
                        at_least: Duration::ZERO,
                    },
                };
                self.verdict(m, &level, user, hash, Instant::now(), verdict)?;
                Ok(permit)
            }
        }
    }

    /// Turns a would-be refusal into a refusal (enforce), or counts and logs it (shadow,
    /// where it returns `Ok` and the request goes on).
    fn verdict(
        &self,
        m: &Matched,
        level: &Level,
        user: &User,
        hash: u64,
        now: Instant,
        verdict: Verdict,
    ) -> Result<(), Refusal> {
        let shared = &self.shared;
        let level_name = level.spec.name.as_str();
        if m.mode == Mode::Shadow {
            shared
                .metrics
                .shadow_rejections_total
                .with_label_values(&[&*m.rule, level_name, verdict.reason.as_str()])
                .inc();
            if shared
                .shadow_log
                .as_ref()
                .is_some_and(|l| l.check().is_ok())
            {
                tracing::info!(
                    rule = %m.rule,
                    level = level_name,
                    flow = %m.flow,
                    user = %user.username,
                    reason = %verdict.reason,
                    "shadow mode: would have refused"
                );
            }
            return Ok(());
        }
        let retry_after = match verdict.reason {
            // The bucket says when it next admits: backing off further would only leave
            // its tokens unused while every client of the flow waits.
            Reason::RateLimited => {
                flows::bucket_retry_after(verdict.at_least, |max| rand::random_range(0..=max))
            }
            _ => shared
                .flows
                .refuse(&m.flow, hash, now)
                .max(verdict.at_least)
                .min(flows::RETRY_MAX),
        };
        tracing::debug!(
            rule = %m.rule,
            level = level_name,
            flow = %m.flow,
            user = %user.username,
            reason = %verdict.reason,
            ?retry_after,
            "refused"
        );
        let mut refusal = Refusal::new(verdict.reason, verdict.message).retry_after(retry_after);
        refusal.rule = Some(m.rule.clone());
        refusal.level = Some(level.name.clone());
        Err(refusal)
    }

    /// Learns a LIST's cost from its response: `bytes` of body, `objects` items if known.
    pub fn observe_list(&self, info: &RequestInfo, bytes: u64, objects: Option<u64>) {
        self.shared.cost.observe(info, bytes, objects);
    }

    /// Learns the whole size of the scope a LIST reads from the watch-fed cache's counts
    /// (DESIGN.md step 6: "once the cache exists, from the cache's counts").
    pub fn observe_scope(&self, info: &RequestInfo, bytes: u64) {
        self.shared.cost.observe_scope(info, bytes);
    }

    /// The LIST bytes admission expects for a request now (0 for anything but a LIST).
    pub fn expected_bytes(&self, info: &RequestInfo) -> u64 {
        self.shared.cost.bytes(info)
    }

    /// Flows whose state is remembered (token bucket, backoff, watches).
    pub fn flows(&self) -> usize {
        self.shared.flows.len()
    }

    /// Forgets every idle flow now (admission also does this a shard at a time as
    /// requests arrive).
    pub fn evict_idle_flows(&self) {
        self.shared.flows.sweep_all(Instant::now());
    }

    /// The levels in force (and draining), in no order.
    fn all_levels(&self) -> Vec<Arc<Level>> {
        let shared = &self.shared;
        let current = shared.levels.read().unwrap_or_else(|p| p.into_inner());
        let draining = shared.draining.lock().unwrap_or_else(|p| p.into_inner());
        current.values().chain(draining.iter()).cloned().collect()
    }

    /// What this Bulwark asks of the fleet now: LIST bytes waiting in every level, and per
    /// level (not exempt) the seats executing and waiting.
    pub fn fleet_demand(&self) -> FleetDemand {
        let mut demand = FleetDemand::default();
        for level in self.all_levels() {
            if level.spec.exempt {
                continue;
            }
            let (seats, bytes) = level.demand();
            demand.list_bytes = demand.list_bytes.saturating_add(bytes);
            *demand.seats.entry(level.spec.name.clone()).or_default() += seats;
        }
        demand
    }

    /// The flows asking for a notable part of their rule's rate since the last call, with
    /// their rule's rate, in thousandths of a request per second: what this Bulwark tells
    /// its fleet so that the rate holds across replicas.
    pub fn rate_demand(
        &self,
    ) -> std::collections::BTreeMap<String, crate::fleet::share::RateAsked> {
        self.shared
            .flows
            .take_rate_demand(Instant::now())
            .into_iter()
            .map(|(flow, asked, rule)| (flow, crate::fleet::share::RateAsked { asked, rule }))
            .collect()
    }

    /// Each level's configured seats (not exempt ones): its static share of the fleet's.
    pub fn configured_seats(&self) -> std::collections::BTreeMap<String, u64> {
        let current = self.shared.levels.read().unwrap_or_else(|p| p.into_inner());
        current
            .values()
            .filter(|l| !l.spec.exempt)
            .map(|l| (l.spec.name.clone(), u64::from(l.spec.seats.max(1))))
            .collect()
    }

    /// Dispatches what may go in every level: the seats or bytes it may use changed.
    pub fn redispatch(&self) {
        for level in self.all_levels() {
            level.redispatch();
        }
    }

    /// `/debug/levels`: per level, its seats, queues, waiting and executing requests.
    pub fn levels_json(&self) -> serde_json::Value {
        let shared = &self.shared;
        let mut levels: Vec<(bool, Arc<Level>)> = {
            let current = shared.levels.read().unwrap_or_else(|p| p.into_inner());
            let mut draining = shared.draining.lock().unwrap_or_else(|p| p.into_inner());
            draining.retain(|level| !level.idle());
            current
                .values()
                .map(|l| (false, l.clone()))
                .chain(draining.iter().map(|l| (true, l.clone())))
                .collect()
        };
        levels.sort_by(|a, b| a.1.spec.name.cmp(&b.1.spec.name).then(a.0.cmp(&b.0)));
        let out: Vec<serde_json::Value> = levels
            .iter()
            .map(|(draining, level)| {
                let spec = &level.spec;
                let view = level.view();
                json!({
                    "name": spec.name,
                    "exempt": spec.exempt,
                    "draining": draining,
                    "seats": spec.seats,
                    "seatsLimit": view.seats_limit,
                    "queues": spec.queues,
                    "handSize": spec.hand_size,
                    "queueLength": spec.queue_length,
                    "maxWaitSeconds": spec.max_wait.as_secs_f64(),
                    "maxSeatsPerFlow": spec.max_seats_per_flow,
                    "activeQueues": view.active_queues,
                    "waiting": view.waiting,
                    "executingRequests": view.executing_requests,
                    "executingSeats": view.executing_seats,
                })
            })
            .collect();
        json!({ "levels": out, "flows": shared.flows.len() })
    }
}

/// How many flows' rate-limit messages each thread keeps (see [`over_rate`]).
const OVER_RATE_MEMO: usize = 256;

/// A flow, its rate and the share held (as bits), and their message.
type OverRate = (Arc<str>, [u64; 4], Arc<str>);

thread_local! {
    /// Per flow (by its hash): see [`OverRate`].
    static OVER_RATE: std::cell::RefCell<lru::LruCache<u64, OverRate>> =
        std::cell::RefCell::new(lru::LruCache::new(
            std::num::NonZeroUsize::new(OVER_RATE_MEMO).expect("not zero"),
        ));
}

/// The message of a refusal of `flow` (whose [`flow_hash`] is `hash`) over its `rate`, of
/// which this replica holds `held`. A storm's flow is refused in these words many times a
/// second: they are written once per thread while the rate and the share stay, not at each
/// refusal (about 1,400 instructions a refusal).
fn over_rate(flow: &Arc<str>, hash: u64, rate: Rate, held: Rate) -> Arc<str> {
    let numbers = [
        rate.qps.to_bits(),
        u64::from(rate.burst),
        held.qps.to_bits(),
        u64::from(held.burst),
    ];
    let recalled = OVER_RATE.with_borrow_mut(|memo| {
        memo.get(&hash)
            .filter(|(of, said, _)| **of == **flow && *said == numbers)
            .map(|(_, _, message)| message.clone())
    });
    if let Some(message) = recalled {
        return message;
    }
    let message: Arc<str> = if held == rate {
        format!(
            "flow {flow} is over its rate of {} requests per second (burst {})",
            rate.qps, rate.burst
        )
    } else {
        format!(
            "flow {flow} is over its rate of {} requests per second (burst {}) across the \
             Bulwark fleet; this replica holds {:.3} of it (burst {}) for the flow's requests \
             it sees",
            rate.qps, rate.burst, held.qps, held.burst
        )
    }
    .into();
    OVER_RATE.with_borrow_mut(|memo| memo.put(hash, (flow.clone(), numbers, message.clone())));
    message
}

fn queue_full(m: &Matched, level: &Level) -> Verdict {
    Verdict {
        reason: Reason::QueueFull,
        message: format!(
            "the queue of flow {} in level {} holds {} requests already",
            m.flow, level.spec.name, level.spec.queue_length
        )
        .into(),
        at_least: Duration::ZERO,
    }
}

/// The response body of an admitted request: it holds `permit` until it ends (or is
/// dropped), and with `learn` reports the LIST's size to the cost model when it ends. A
/// body that holds seats or LIST bytes, or that sends a cached watch's initial state of
/// `initial` bytes, and whose client stops reading gives the permit back and is cut off
/// after `send`'s deadline, and its connection `conn` is closed ([`progress`]).
pub fn hold(
    body: Body,
    permit: Permit,
    learn: Option<Learn>,
    send: &SendProgress,
    initial: Option<u64>,
    conn: Option<&Arc<crate::listen::ConnAuth>>,
) -> Body {
    use http_body_util::BodyExt;
    let watched = (permit.holds_what_others_wait_for() || initial.is_some())
        && !http_body::Body::is_end_stream(&body);
    // Watched from the start: hyper polls a body only once the client has room for it, so
    // a client whose window is shut from the first byte never lets it be polled at all.
    let (permit, progress) = if watched {
        (
            None,
            Some(progress::Progress::watch(permit, send, conn.cloned())),
        )
    } else {
        (Some(permit), None)
    };
    Guarded {
        body,
        _permit: permit,
        learn,
        progress,
        initial,
        rest: None,
    }
    .boxed_unsync()
}

/// A LIST response that teaches the cost model what the LIST cost the apiserver, once its
/// body has ended.
pub struct Learn {
    admission: Arc<Admission>,
    info: Arc<RequestInfo>,
    meter: measure::Meter,
}

impl Learn {
    /// For a successful LIST whose response headers show the apiserver's cost; `None` for
    /// anything else (a protobuf, Table or metadata-only answer is far smaller than the
    /// JSON the apiserver built, and would shrink the estimate that guards its memory).
    pub fn list(
        admission: Arc<Admission>,
        info: Arc<RequestInfo>,
        response: &http::Response<Body>,
    ) -> Option<Learn> {
        if !info.is_list() || response.status() != http::StatusCode::OK {
            return None;
        }
        let encoding = measure::Encoding::of(response.headers())?;
        Some(Learn {
            admission,
            info,
            meter: measure::Meter::new(encoding),
        })
    }
}

impl Learn {
    /// Reports what the LIST cost, once its body has ended.
    fn finish(learn: Option<Learn>) {
        if let Some(learn) = learn
            && let Some(bytes) = learn.meter.json_bytes()
        {
            learn.admission.observe_list(&learn.info, bytes, None);
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that holds its admission permit until it ends, and teaches
    /// admission what a LIST cost.
    struct Guarded {
        #[pin]
        body: Body,
        // `None` when `progress` holds it.
        _permit: Option<Permit>,
        learn: Option<Learn>,
        // Set while the body holds what others wait for and its client's pace is watched.
        progress: Option<Arc<progress::Progress>>,
        // A cached watch's initial state still to send: watched until it is out.
        initial: Option<u64>,
        // The rest of a large frame of a watched body, handed out a chunk at a time.
        rest: Option<bytes::Bytes>,
    }
}

impl http_body::Body for Guarded {
    type Data = bytes::Bytes;
    type Error = crate::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let mut this = self.project();
        if this.progress.as_ref().is_some_and(|p| p.is_cut()) {
            // What it still holds upstream goes now; the error resets the client's stream.
            this.body.set(crate::empty());
            *this.progress = None;
            *this.learn = None;
            *this.rest = None;
            return Poll::Ready(Some(Err(
                "the client did not read its response in time; it was cut off".into(),
            )));
        }
        if let Some(rest) = this.rest.as_mut() {
            let chunk = if rest.len() > progress::CHUNK {
                rest.split_to(progress::CHUNK)
            } else {
                this.rest.take().unwrap_or_default()
            };
            handed(this.progress, this.initial, this._permit, chunk.len());
            return Poll::Ready(Some(Ok(http_body::Frame::data(chunk))));
        }
        let polled = this.body.as_mut().poll_frame(cx);
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(learn), Some(data)) = (this.learn.as_mut(), frame.data_ref()) {
                    learn.meter.feed(data);
                }
                // A body that knows it has ended is not polled again (hyper stops at
                // `is_end_stream`): its last frame is the end.
                if this.body.is_end_stream() {
                    Learn::finish(this.learn.take());
                }
                let frame = match frame.into_data() {
                    // A watched body goes out in chunks no larger than a connection takes at
                    // a time, so that a client that reads, however slowly, polls it again
                    // before the deadline.
                    Ok(mut data) if this.progress.is_some() && data.len() > progress::CHUNK => {
                        *this.rest = Some(data.split_off(progress::CHUNK));
                        handed(this.progress, this.initial, this._permit, data.len());
                        http_body::Frame::data(data)
                    }
                    Ok(data) => {
                        handed(this.progress, this.initial, this._permit, data.len());
                        http_body::Frame::data(data)
                    }
                    Err(frame) => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                Learn::finish(this.learn.take());
                Poll::Ready(None)
            }
            // A body that failed did not show its whole size.
            Poll::Ready(Some(Err(error))) => {
                *this.learn = None;
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => {
                if let Some(progress) = this.progress.as_ref() {
                    progress.polled(false);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let rest = self.rest.as_ref().map_or(0, |r| r.len() as u64);
        let inner = self.body.size_hint();
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(inner.lower() + rest);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + rest);
        }
        hint
    }
}

/// `bytes` of a watched body went to the connection: its client is waited for now, and a
/// cached watch's initial state may be out, after which it is not watched for its events
/// (the permit it holds then is its place in the watch limit).
fn handed(
    progress: &mut Option<Arc<progress::Progress>>,
    initial: &mut Option<u64>,
    permit: &mut Option<Permit>,
    bytes: usize,
) {
    let Some(watched) = progress.as_ref() else {
        return;
    };
    watched.polled(true);
    if let Some(left) = initial.as_mut() {
        *left = left.saturating_sub(bytes as u64);
        if *left == 0 {
            *initial = None;
            if let Some(watched) = progress.take() {
                *permit = watched.into_permit();
            }
        }
    }
}
