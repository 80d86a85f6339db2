//! Who is asking and who is refused: the flows seen over the last two windows, for
//! `/debug/flows`, and the identities refused most, for the opt-in identity label of
//! `bulwark_identity_rejections_total`.
//!
//! Both are bounded whatever the clients do: the board keeps at most [`MAX_FLOWS`] flows
//! (more are counted, not named), and the metric names at most `metrics.identities`
//! identities (the rest are `other`).

use foldhash::{HashMap, HashMapExt as _};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::IntCounterVec;
use serde::Serialize;
use tokio::time::Instant;

use crate::classify::RequestInfo;
use crate::metrics::verb_label;
use crate::status::Reason;

/// Flows the board keeps at most; requests of flows beyond are counted as untracked.
pub const MAX_FLOWS: usize = 4096;
/// Flows `/debug/flows` lists in each of its two lists.
pub const LISTED: usize = 20;
/// The most identities `metrics.identities` may name (the configuration's bound).
pub use crate::config::MAX_IDENTITY_LABELS;
/// Identities refused in one window that the metric remembers to pick the top from.
const MAX_COUNTED_IDENTITIES: usize = 1024;

const SHARDS: usize = 8;

/// What one request tells the board, after its answer.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    /// The user name, `-` when the request was refused before it was identified.
    pub identity: &'a str,
    /// The rule that matched, `""` when none did.
    pub rule: &'a str,
    /// The priority level, `""` when none.
    pub level: &'a str,
    /// How long the request waited for admission.
    pub waited: Duration,
    /// Why it was refused, if it was.
    pub refused: Option<Refused<'a>>,
}

/// A refusal as the board remembers it.
#[derive(Debug, Clone, Copy)]
pub struct Refused<'a> {
    /// Why.
    pub reason: Reason,
    /// What the request asked for, when it was classified.
    pub info: Option<&'a Arc<RequestInfo>>,
    /// Its `Audit-Id`.
    pub audit_id: &'a str,
}

/// The flows seen over the last two windows. Shared by every request (`Arc` it).
#[derive(Debug)]
pub struct Board {
    window: Duration,
    origin: Instant,
    shards: Box<[Mutex<Shard>]>,
}

#[derive(Debug, Default)]
struct Shard {
    /// By identity, then (rule, level): a client has few.
    flows: HashMap<String, Vec<Entry>>,
    len: usize,
    /// Requests of flows the board had no room for, this window and the one before.
    untracked: Tally2<u64>,
}

#[derive(Debug, Clone)]
struct Entry {
    rule: String,
    level: String,
    /// The window `now` counts.
    window: u64,
    now: Tally,
    before: Tally,
    last_refusal: Option<LastRefusal>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    requests: u64,
    refused: u64,
    waited: Duration,
}

#[derive(Debug, Clone, Copy, Default)]
struct Tally2<T> {
    window: u64,
    now: T,
    before: T,
}

#[derive(Debug, Clone)]
struct LastRefusal {
    at: Instant,
    reason: Reason,
    /// What it asked for (shared with the request: a storm's refusals copy no strings of
    /// it; the view writes them).
    info: Option<Arc<RequestInfo>>,
    audit_id: String,
}

impl Entry {
    /// Moves the tallies on to window `w`.
    fn roll(&mut self, w: u64) {
        if self.window == w {
            return;
        }
        self.before = if self.window + 1 == w {
            self.now
        } else {
            Tally::default()
        };
        self.now = Tally::default();
        self.window = w;
    }
}

impl Tally2<u64> {
    fn roll(&mut self, w: u64) {
        if self.window != w {
            self.before = if self.window + 1 == w { self.now } else { 0 };
            self.now = 0;
            self.window = w;
        }
    }
}

/// `/debug/flows`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowsView {
    /// The rates are over this many seconds (the last full window and the current one).
    pub window_seconds: f64,
    /// Flows the board knows.
    pub flows: usize,
    /// Requests per second of flows the board had no room for.
    pub untracked_per_second: f64,
    /// The flows asking the most.
    pub busiest: Vec<FlowView>,
    /// The flows refused the most (only flows with a refusal).
    pub most_refused: Vec<FlowView>,
}

/// One flow on `/debug/flows`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowView {
    /// The user name.
    pub identity: String,
    /// The rule that matched.
    pub rule: String,
    /// Its priority level.
    pub level: String,
    /// Requests per second answered or refused.
    pub requests_per_second: f64,
    /// Refusals per second.
    pub refused_per_second: f64,
    /// Mean wait for admission (the fair queue, the byte budget) in milliseconds.
    pub mean_queue_wait_ms: f64,
    /// The last refusal, if one is remembered.
    pub last_refusal: Option<LastRefusalView>,
}

/// The last refusal of a flow.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LastRefusalView {
    /// How long ago.
    pub seconds_ago: f64,
    /// Why (`X-Bulwark-Reason`).
    pub reason: &'static str,
    /// The verb.
    pub verb: String,
    /// The resource (`secrets`, `deployments.apps`, or the path of a non-resource request).
    pub resource: String,
    /// The namespace.
    pub namespace: Option<String>,
    /// The object's name.
    pub name: Option<String>,
    /// The refusal's `Audit-Id`, as in its log line and its answer.
    pub audit_id: String,
}

impl Board {
    /// Rates over `window` (and the window before it).
    pub fn new(window: Duration) -> Board {
        Board {
            window: window.max(Duration::from_millis(1)),
            origin: Instant::now(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    fn window_at(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.origin);
        (since.as_nanos() / self.window.as_nanos()) as u64
    }

    fn shard(&self, identity: &str) -> &Mutex<Shard> {
        use std::hash::BuildHasher as _;
        let hash = foldhash::fast::FixedState::default().hash_one(identity);
        &self.shards[(hash as usize) % self.shards.len()]
    }

    /// Counts one answered or refused request, answered at `now`.
    pub fn seen(&self, seen: Seen<'_>, now: Instant) {
        let w = self.window_at(now);
        let mut shard = self
            .shard(seen.identity)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let shard = &mut *shard;
        let found = shard
            .flows
            .get_mut(seen.identity)
            .and_then(|flows| {
                flows
                    .iter()
                    .position(|e| e.rule == seen.rule && e.level == seen.level)
                    .map(|i| (flows, i))
            })
            .map(|(flows, i)| &mut flows[i]);
        let entry = match found {
            Some(entry) => entry,
            None => {
                if shard.len >= MAX_FLOWS / SHARDS {
                    forget_stale(shard, w);
                }
                if shard.len >= MAX_FLOWS / SHARDS {
                    shard.untracked.roll(w);
                    shard.untracked.now += 1;
                    return;
                }
                shard.len += 1;
                let flows = shard.flows.entry(seen.identity.to_owned()).or_default();
                flows.push(Entry {
                    rule: seen.rule.to_owned(),
                    level: seen.level.to_owned(),
                    window: w,
                    now: Tally::default(),
                    before: Tally::default(),
                    last_refusal: None,
                });
                flows.last_mut().expect("just pushed")
            }
        };
        entry.roll(w);
        entry.now.requests += 1;
        entry.now.waited += seen.waited;
        if let Some(refused) = seen.refused {
            entry.now.refused += 1;
            let info = refused.info.cloned();
            match &mut entry.last_refusal {
                // The same flow refused again: its last refusal's room is reused.
                Some(last) => {
                    last.at = now;
                    last.reason = refused.reason;
                    last.info = info;
                    last.audit_id.clear();
                    last.audit_id.push_str(refused.audit_id);
                }
                None => {
                    entry.last_refusal = Some(LastRefusal {
                        at: now,
                        reason: refused.reason,
                        info,
                        audit_id: refused.audit_id.to_owned(),
                    })
                }
            }
        }
    }

    /// What `/debug/flows` shows now.
    pub fn view(&self) -> FlowsView {
        let now = Instant::now();
        let w = self.window_at(now);
        // The current window so far, plus the whole window before it.
        let into_window = now.saturating_duration_since(self.origin).as_secs_f64()
            - (w as f64) * self.window.as_secs_f64();
        let span = if w == 0 {
            into_window.max(1e-3)
        } else {
            self.window.as_secs_f64() + into_window
        };
        let mut all = Vec::new();
        let mut untracked = 0;
        let mut flows = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            forget_stale(&mut shard, w);
            shard.untracked.roll(w);
            untracked += shard.untracked.now + shard.untracked.before;
            flows += shard.len;
            for (identity, entries) in &mut shard.flows {
                for entry in entries.iter_mut() {
                    entry.roll(w);
                    let requests = entry.now.requests + entry.before.requests;
                    let refused = entry.now.refused + entry.before.refused;
                    let waited = entry.now.waited + entry.before.waited;
                    all.push(FlowView {
                        identity: identity.clone(),
                        rule: entry.rule.clone(),
                        level: entry.level.clone(),
                        requests_per_second: requests as f64 / span,
                        refused_per_second: refused as f64 / span,
                        mean_queue_wait_ms: if requests == 0 {
                            0.0
                        } else {
                            waited.as_secs_f64() * 1e3 / requests as f64
                        },
                        last_refusal: entry.last_refusal.as_ref().map(|r| {
                            let info = r.info.as_deref();
                            LastRefusalView {
                                seconds_ago: now.saturating_duration_since(r.at).as_secs_f64(),
                                reason: r.reason.as_str(),
                                verb: info
                                    .map_or_else(String::new, |i| verb_label(&i.verb).to_owned()),
                                resource: info.map_or_else(String::new, resource_of),
                                namespace: info
                                    .and_then(|i| i.namespace.as_deref().map(str::to_owned)),
                                name: info.and_then(|i| i.name.as_deref().map(str::to_owned)),
                                audit_id: r.audit_id.clone(),
                            }
                        }),
                    });
                }
            }
        }
        let by = |key: fn(&FlowView) -> f64| {
            move |a: &FlowView, b: &FlowView| {
                key(b)
                    .total_cmp(&key(a))
                    .then_with(|| a.identity.cmp(&b.identity))
                    .then_with(|| a.rule.cmp(&b.rule))
            }
        };
        let mut refused: Vec<FlowView> = all
            .iter()
            .filter(|f| f.refused_per_second > 0.0)
            .cloned()
            .collect();
        refused.sort_by(by(|f| f.refused_per_second));
        refused.truncate(LISTED);
        all.sort_by(by(|f| f.requests_per_second));
        all.truncate(LISTED);
        FlowsView {
            window_seconds: span,
            flows,
            untracked_per_second: untracked as f64 / span,
            busiest: all,
            most_refused: refused,
        }
    }
}

/// Drops the flows that asked nothing in window `w` or the one before.
fn forget_stale(shard: &mut Shard, w: u64) {
    let mut removed = 0;
    shard.flows.retain(|_, entries| {
        let before = entries.len();
        entries.retain(|e| e.window + 1 >= w);
        removed += before - entries.len();
        !entries.is_empty()
    });
    shard.len -= removed;
}

/// `secrets`, `deployments.apps`, `pods/log`, or the path of a non-resource request.
fn resource_of(info: &RequestInfo) -> String {
    if !info.resource_request {
        return info.path.clone();
    }
    let mut resource = info.resource.as_str().to_owned();
    if !info.api_group.is_empty() {
        resource.push('.');
        resource.push_str(&info.api_group);
    }
    if let Some(sub) = &info.subresource {
        resource.push('/');
        resource.push_str(sub);
    }
    resource
}

/// `bulwark_identity_rejections_total{identity, reason}` with at most `k` identities named:
/// the `k` refused most in the last window (a newly refused identity is named at once
/// while a name is free), every other `other`. Off (nothing counted) when `k` is 0.
#[derive(Debug)]
pub struct IdentityRejections {
    k: usize,
    window: Duration,
    counter: IntCounterVec,
    state: Mutex<Named>,
}

#[derive(Debug)]
struct Named {
    started: Instant,
    /// Refusals per identity in this window (at most [`MAX_COUNTED_IDENTITIES`]).
    counts: HashMap<Arc<str>, u64>,
    /// The identities with their own label.
    named: HashSet<Arc<str>>,
}

/// The label of every identity not named.
pub const OTHER: &str = "other";

impl IdentityRejections {
    /// Names up to `k` identities (capped at [`MAX_IDENTITY_LABELS`]), picked anew every
    /// `window`, on `counter` (labels `identity`, `reason`).
    pub fn new(k: u32, window: Duration, counter: IntCounterVec) -> IdentityRejections {
        IdentityRejections {
            k: k.min(MAX_IDENTITY_LABELS) as usize,
            window,
            counter,
            state: Mutex::new(Named {
                started: Instant::now(),
                counts: HashMap::new(),
                named: HashSet::new(),
            }),
        }
    }

    /// Counts one refusal of `identity`.
    pub fn rejected(&self, identity: &str, reason: Reason) {
        if self.k == 0 {
            return;
        }
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if now.saturating_duration_since(state.started) >= self.window {
            self.pick(&mut state);
            state.started = now;
        }
        let key = match state.counts.get_key_value(identity) {
            Some((key, _)) => Some(key.clone()),
            None if state.counts.len() < MAX_COUNTED_IDENTITIES => Some(Arc::from(identity)),
            None => None,
        };
        if let Some(key) = &key {
            *state.counts.entry(key.clone()).or_default() += 1;
            if !state.named.contains(identity) && state.named.len() < self.k {
                state.named.insert(key.clone());
            }
        }
        let label = if state.named.contains(identity) {
            identity
        } else {
            OTHER
        };
        self.counter
            .with_label_values(&[label, reason.as_str()])
            .inc();
    }

    /// Names the `k` identities refused most in the window that ended; the series of those
    /// no longer named go.
    fn pick(&self, state: &mut Named) {
        let mut ranked: Vec<(&Arc<str>, &u64)> = state.counts.iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let next: HashSet<Arc<str>> = ranked
            .into_iter()
            .take(self.k)
            .map(|(id, _)| id.clone())
            .collect();
        for gone in state.named.difference(&next) {
            for reason in Reason::ALL {
                let _ = self.counter.remove_label_values(&[gone, reason.as_str()]);
            }
        }
        state.named = next;
        state.counts.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::core::Collector;

    fn seen<'a>(identity: &'a str, rule: &'a str, refused: Option<Refused<'a>>) -> Seen<'a> {
        Seen {
            identity,
            rule,
            level: "workload",
            waited: Duration::from_millis(4),
            refused,
        }
    }

    fn refusal(reason: Reason) -> Refused<'static> {
        Refused {
            reason,
            info: None,
            audit_id: "id-1",
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_board_lists_the_busiest_and_the_most_refused_flows_with_their_rates() {
        let board = Board::new(Duration::from_secs(10));
        for _ in 0..200 {
            board.seen(seen("busy", "all", None), Instant::now());
        }
        for _ in 0..30 {
            board.seen(
                seen("storm", "lists", Some(refusal(Reason::RateLimited))),
                Instant::now(),
            );
        }
        board.seen(seen("storm", "lists", None), Instant::now());
        tokio::time::advance(Duration::from_secs(10)).await;
        let view = board.view();
        assert_eq!(view.flows, 2);
        assert_eq!(view.busiest[0].identity, "busy");
        assert!((view.busiest[0].requests_per_second - 20.0).abs() < 0.01);
        assert_eq!(view.most_refused.len(), 1);
        let storm = &view.most_refused[0];
        assert_eq!(
            (storm.identity.as_str(), storm.rule.as_str()),
            ("storm", "lists")
        );
        assert!((storm.refused_per_second - 3.0).abs() < 0.01);
        assert!((storm.mean_queue_wait_ms - 4.0).abs() < 0.01);
        let last = storm.last_refusal.as_ref().expect("a refusal");
        assert_eq!(last.reason, "rate_limited");
        assert_eq!(last.audit_id, "id-1");
        assert!((last.seconds_ago - 10.0).abs() < 0.01);
        // Two windows without a request: forgotten.
        tokio::time::advance(Duration::from_secs(20)).await;
        let view = board.view();
        assert_eq!(view.flows, 0);
        assert!(view.busiest.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_board_stays_bounded_however_many_identities_come() {
        let board = Board::new(Duration::from_secs(10));
        let names: Vec<String> = (0..MAX_FLOWS * 2).map(|i| format!("node-{i}")).collect();
        for name in &names {
            board.seen(seen(name, "nodes", None), Instant::now());
        }
        let view = board.view();
        assert!(view.flows <= MAX_FLOWS, "{} flows", view.flows);
        assert!(view.untracked_per_second > 0.0);
        assert_eq!(view.busiest.len(), LISTED);
        // The flows of a window long gone make room for new ones.
        tokio::time::advance(Duration::from_secs(30)).await;
        board.seen(seen("newcomer", "nodes", None), Instant::now());
        assert_eq!(board.view().flows, 1);
    }

    fn counter() -> IntCounterVec {
        IntCounterVec::new(
            prometheus::Opts::new("bulwark_identity_rejections_total", "test"),
            &["identity", "reason"],
        )
        .unwrap()
    }

    fn count(counter: &IntCounterVec, identity: &str) -> u64 {
        counter.with_label_values(&[identity, "rate_limited"]).get()
    }

    #[tokio::test(start_paused = true)]
    async fn a_flows_last_refusal_is_its_latest_with_what_that_request_asked_for() {
        let board = Board::new(Duration::from_secs(10));
        let list = Arc::new(
            crate::classify::classify(
                &http::Method::GET,
                &"/api/v1/namespaces/team/secrets".parse().unwrap(),
            )
            .unwrap(),
        );
        let get = Arc::new(
            crate::classify::classify(
                &http::Method::GET,
                &"/apis/apps/v1/namespaces/ops/deployments/web"
                    .parse()
                    .unwrap(),
            )
            .unwrap(),
        );
        for (info, audit_id, reason) in [
            (&list, "a-long-first-audit-id-0000", Reason::QueueFull),
            (&get, "id-2", Reason::RateLimited),
        ] {
            let refused = Refused {
                reason,
                info: Some(info),
                audit_id,
            };
            board.seen(seen("storm", "lists", Some(refused)), Instant::now());
        }
        let view = board.view();
        let last = view.most_refused[0]
            .last_refusal
            .as_ref()
            .expect("a refusal");
        assert_eq!(
            (
                last.reason,
                last.verb.as_str(),
                last.resource.as_str(),
                last.namespace.as_deref(),
                last.name.as_deref(),
                last.audit_id.as_str(),
            ),
            (
                "rate_limited",
                "get",
                "deployments.apps",
                Some("ops"),
                Some("web"),
                "id-2"
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_metric_names_the_identities_refused_most_and_the_rest_are_other() {
        let metric = counter();
        let named = IdentityRejections::new(2, Duration::from_secs(60), metric.clone());
        named.rejected("early", Reason::RateLimited);
        for _ in 0..10 {
            named.rejected("storm-a", Reason::RateLimited);
        }
        for _ in 0..20 {
            named.rejected("storm-b", Reason::RateLimited);
        }
        // The free names went to the first two refused.
        assert_eq!(count(&metric, "early"), 1);
        assert_eq!(count(&metric, "storm-a"), 10);
        assert_eq!(count(&metric, OTHER), 20);
        // After a window the two refused most are named; `early` is gone from the metric.
        tokio::time::advance(Duration::from_secs(60)).await;
        named.rejected("storm-b", Reason::RateLimited);
        let families = {
            let registry = prometheus::Registry::new();
            registry.register(Box::new(metric.clone())).unwrap();
            registry.gather()
        };
        let identities: HashSet<String> = families[0]
            .get_metric()
            .iter()
            .flat_map(|m| m.get_label().iter())
            .filter(|l| l.name() == "identity")
            .map(|l| l.value().to_owned())
            .collect();
        assert!(!identities.contains("early"), "{identities:?}");
        assert_eq!(count(&metric, "storm-b"), 1);
        assert_eq!(count(&metric, "storm-a"), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn the_metric_never_names_more_than_its_cap_and_is_off_at_zero() {
        let metric = counter();
        let named = IdentityRejections::new(1_000, Duration::from_secs(60), metric.clone());
        for i in 0..500 {
            named.rejected(&format!("node-{i}"), Reason::RateLimited);
        }
        let named_series = metric
            .collect()
            .iter()
            .map(|f| f.get_metric().len())
            .sum::<usize>();
        assert_eq!(named_series, MAX_IDENTITY_LABELS as usize + 1);
        let off = counter();
        IdentityRejections::new(0, Duration::from_secs(60), off.clone())
            .rejected("a", Reason::QueueFull);
        assert_eq!(off.collect()[0].get_metric().len(), 0);
    }
}
