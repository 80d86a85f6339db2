//! What a scenario reports: the `--json` schema of the loadtest issue and the comparison
//! table printed at the end of every run.
//!
//! The JSON shape is a contract (other tools read it), so the field names here are exactly
//! the issue's and `serde` writes them without renaming. A recorded result reads back
//! (fields it lacks take their defaults), so its HTML report can be drawn again later
//! (`bulwark-loadtest report`).

pub mod charts;
pub mod html;
pub mod outcome;

pub use outcome::Outcome;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// The whole `--json` document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Scenario name, e.g. `list-storm`.
    pub scenario: String,
    /// The `--scale` factor the scenario ran at.
    pub scale: f64,
    /// One run per target: `direct`, `bulwark` (and `haproxy`, `nginx` for passthrough),
    /// in the order they ran; written as a JSON object keyed by target.
    #[serde(serialize_with = "as_map", deserialize_with = "from_map")]
    pub runs: Vec<(String, Run)>,
    /// How the load was made, for scenarios that measure with an outside load generator
    /// (`passthrough`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bench: Option<BenchSetup>,
}

impl Report {
    /// A report of `runs`, in the order they ran.
    pub fn new(scenario: &str, scale: f64, runs: Vec<(String, Run)>) -> Report {
        Report {
            scenario: scenario.to_string(),
            scale,
            runs,
            bench: None,
        }
    }
}

/// The load generator and the cores of a measurement.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchSetup {
    /// Which generator, and the shape of its load.
    pub load_generator: String,
    /// Which cores the proxy, the upstream and the generator ran on.
    pub pinning: String,
    /// The fixed rates the generator held, requests/s, each measured as the class
    /// [`fixed_rate_class`] names.
    #[serde(default)]
    pub fixed_rates: Vec<u32>,
    /// How many cores each target's processes were pinned to (none where unpinned).
    #[serde(default)]
    pub cores: BTreeMap<String, usize>,
}

/// The class of a bench's phase at a fixed `rate` (requests/s).
pub fn fixed_rate_class(rate: u32) -> String {
    format!("fixed_rate_{rate}")
}

/// The class of a bench's phase as fast as the target answers.
pub const SATURATION: &str = "saturation";

/// The target a bench's figures are held against: the bare proxy of `src/floor.rs`.
pub const FLOOR: &str = "floor";

/// Writes `(name, run)` pairs as a JSON object, keeping their order.
fn as_map<S: serde::Serializer>(runs: &[(String, Run)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(runs.len()))?;
    for (name, run) in runs {
        map.serialize_entry(name, run)?;
    }
    map.end()
}

/// Reads a JSON object of runs back into `(name, run)` pairs, in the order written.
fn from_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<(String, Run)>, D::Error> {
    struct Runs;
    impl<'de> serde::de::Visitor<'de> for Runs {
        type Value = Vec<(String, Run)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object of runs keyed by target")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut runs = Vec::new();
            while let Some(entry) = map.next_entry()? {
                runs.push(entry);
            }
            Ok(runs)
        }
    }
    d.deserialize_map(Runs)
}

/// One run of a scenario against one target, on a fresh simulator.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Run {
    /// What the simulated apiservers went through.
    pub apiserver: Apiserver,
    /// The proxy process's own cost, from the operating system; absent for `direct`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyCost>,
    /// Client-side figures per class of clients.
    pub classes: BTreeMap<String, Class>,
    /// p99 of write acknowledged → watch event received (informers, node-join only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_delivery_p99_ms: Option<f64>,
    /// Watch stream bytes the nodes received per event, bookmarks included (informers,
    /// node-join only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watch_bytes_per_event: Option<f64>,
    /// What the nodes' connections and watches cost the process serving them (informers
    /// only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watch_cost: Option<WatchCost>,
    /// What an idle-connection flood did (conn-flood only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flood: Option<Flood>,
    /// How a fleet of Bulwarks kept the apiservers' budget (fleet only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetFigures>,
    /// What was sampled every tick while the load ran (the simulated fleet's scenarios).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
}

/// Figures sampled every tick of a run, for the report's charts over time.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Timeline {
    /// Seconds into the load of each tick.
    pub seconds: Vec<f64>,
    /// Per replica, per tick: its highest memory since the tick before, bytes (the
    /// simulator's modelled heap; a real apiserver's cgroup usage).
    pub replica_memory_bytes: Vec<Vec<u64>>,
    /// Per replica: seconds into the load of each of its OOM kills.
    pub oom_kills_at_s: Vec<Vec<f64>>,
    /// Per class, per tick: 429s since the tick before.
    pub rejected: BTreeMap<String, Vec<u64>>,
}

/// The fleet scenario's figures: the apiservers' LIST bytes against their budget, each
/// storm identity's rate against its rule, and a Bulwark's death and return.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FleetFigures {
    /// Each apiserver's in-flight LIST byte budget (heap headroom ÷ 5): the fleet's whole.
    pub list_bytes_budget: u64,
    /// Per apiserver: the most storm LIST bytes it executed at once, by its own metrics
    /// (`apiserver_flowcontrol_current_executing_requests` of the storm's FlowSchema,
    /// sampled every second, times the bytes one LIST reads).
    pub peak_list_bytes: Vec<u64>,
    /// Per apiserver: samples with more than the budget executing (more than one LIST,
    /// when one is bigger than the budget: one such runs alone, as the budget allows).
    pub samples_over_budget: Vec<u64>,
    /// The same two while every Bulwark runs and has run for 10 s (the steady windows).
    pub steady_peak_list_bytes: Vec<u64>,
    /// See `steady_peak_list_bytes`.
    pub steady_samples_over_budget: Vec<u64>,
    /// The bytes one storm LIST reads.
    pub list_bytes: u64,
    /// Samples taken per apiserver.
    pub samples: u64,
    /// The storm rule's rate, requests per second.
    pub storm_rule_qps: f64,
    /// Per storm identity: requests per second that passed its token buckets (every
    /// answer but a 429 `rate_limited`), over the whole run, all Bulwarks together.
    pub storm_rates: Vec<f64>,
    /// The same while every Bulwark runs and has run for 10 s: from 10 s to the kill, and
    /// from 10 s after the restart to the end (the whole run from 10 s without a kill).
    pub storm_steady_rates: Vec<f64>,
    /// The same from the kill to the restart.
    pub storm_outage_rates: Vec<f64>,
    /// Per storm identity: 429s, and of those `rate_limited`.
    pub storm_429s: Vec<(u64, u64)>,
    /// Seconds into the run a Bulwark was killed, and started again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed_at_s: Option<f64>,
    /// See `killed_at_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restarted_at_s: Option<f64>,
    /// Seconds from the kill until every survivor saw two members; `None`: not within the
    /// wait (the static split never does).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub takeover_s: Option<f64>,
    /// Seconds from the restart until every Bulwark saw three members.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rejoin_s: Option<f64>,
    /// What the survivors held of each apiserver's budget together when they took over
    /// (or at the end of the wait).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub survivors_share: Option<u64>,
}

/// An idle-connection flood and what Bulwark and its other clients went through.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Flood {
    /// Flood connections attempted.
    pub connections: u64,
    /// Loopback source addresses they came from.
    pub sources: u64,
    /// Connection attempts in flight at once.
    pub concurrency: u64,
    /// Served: TLS and HTTP/2 set up and the request answered 401.
    pub accepted: u64,
    /// Reset or closed during the TCP, TLS or HTTP/2 handshake or the request.
    pub refused: u64,
    /// No answer within the attempt's 10 s.
    pub timed_out: u64,
    /// An answer other than 401.
    pub other: u64,
    /// Attempts never started (the flood's opening ran out of time).
    pub not_attempted: u64,
    /// Seconds from the first attempt until the last had ended.
    pub opened_in_s: f64,
    /// Accepted connections that Bulwark closed while the client still held them.
    pub closed_by_bulwark: u64,
    /// Seconds from the flood's start to its end: Bulwark had closed every accepted
    /// connection, or the client let go of the rest after the hold.
    pub lasted_s: f64,
    /// Bulwark's open-file limit (soft).
    pub fd_limit: u64,
    /// Bulwark's open file descriptors.
    pub fds: Phases,
    /// Bulwark's resident memory (`VmRSS`).
    pub rss_bytes: Phases,
    /// The authenticated client's GETs before the flood.
    pub gets_before: FloodLatency,
    /// The authenticated client's GETs during the flood.
    pub gets_during: FloodLatency,
    /// `/readyz` polls on the admin listener during the flood.
    pub readyz_during: FloodLatency,
    /// A new authenticated client connecting once the flood is open.
    pub new_client: NewClient,
    /// `bulwark_connections_refused_total` by reason at the flood's end (empty where
    /// Bulwark has no such metric).
    pub bulwark_refused: BTreeMap<String, u64>,
    /// `bulwark_connections_closed_total` by reason at the flood's end.
    pub bulwark_closed: BTreeMap<String, u64>,
    /// The first failed flood connection's error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

/// A figure before the flood, at its peak, and a while after it ended.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Phases {
    /// Before the flood.
    pub idle: u64,
    /// The highest while the flood was open.
    pub peak: u64,
    /// `--settle` after the flood ended.
    pub after: u64,
}

/// Requests of one kind in one phase.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FloodLatency {
    /// Requests sent.
    pub requests: u64,
    /// Answered with success.
    pub ok: u64,
    /// Failed: another status, an error, no answer in time.
    pub failed: u64,
    /// Latency of the successful ones, milliseconds.
    pub p50_ms: f64,
    /// See `p50_ms`.
    pub p99_ms: f64,
    /// See `p50_ms`.
    pub max_ms: f64,
    /// Why the first failure failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_failure: Option<String>,
}

/// A new client's attempt to connect during the flood.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct NewClient {
    /// Whether it connected and its first GET succeeded.
    pub connected: bool,
    /// How long that took (or until it gave up), milliseconds.
    pub ms: f64,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The simulated apiserver fleet's figures for one run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Apiserver {
    /// Each replica's heap limit in bytes (0 when the scenario sets none).
    pub heap_limit_bytes: u64,
    /// Highest modelled heap of any replica.
    pub peak_heap_bytes: u64,
    /// Out-of-memory restarts, summed over replicas.
    pub ooms: u64,
    /// Requests each replica served.
    pub replica_requests: Vec<u64>,
    /// Highest concurrent requests of each replica.
    pub replica_peak_inflight: Vec<u64>,
    /// Requests all replicas served.
    pub upstream_requests: u64,
    /// Peak of concurrently open watches over the whole fleet.
    pub upstream_watches: u64,
    /// Each replica's peak memory (real control plane only: its cgroup's peak usage).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replica_peak_memory_bytes: Vec<u64>,
    /// Each replica's OOM kills by the kernel (real control plane only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replica_oom_kills: Vec<u64>,
}

/// The proxy process's resource use as the operating system counted it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ProxyCost {
    /// Peak resident set size (`VmHWM`).
    pub peak_rss_bytes: u64,
    /// User plus system CPU time.
    pub cpu_seconds: f64,
}

/// What a process serving the nodes' watches spent on them, in three steps: before any
/// node connects, once every node's connections are open (one GET each, then idle), and
/// with every watch open while the churn runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WatchCost {
    /// Whose memory and CPU these are: `Bulwark` or `kube-apiserver` (every replica's).
    pub measured: String,
    /// Client connections the nodes opened.
    pub connections: u64,
    /// Watches they held open.
    pub watches: u64,
    /// Resident memory (`VmRSS`) before the nodes connected.
    pub rss_before_bytes: u64,
    /// Resident memory with every connection open and idle.
    pub rss_connected_bytes: u64,
    /// Mean resident memory over the steady state, every watch open.
    pub rss_watching_bytes: u64,
    /// CPU seconds the process used over the steady state.
    pub steady_cpu_seconds: f64,
    /// Watch events (not bookmarks) the nodes received over the steady state.
    pub steady_events: u64,
    /// Secret update acknowledged → its watcher's event: p50, p99, max in ms.
    pub secret_delivery_ms: Option<[f64; 3]>,
    /// EndpointSlice update acknowledged → the last kube-proxy's event, over the updates
    /// every kube-proxy received: p50, p99, max in ms.
    pub slice_to_all_ms: Option<[f64; 3]>,
    /// Updates every kube-proxy received (those counted above).
    pub slice_updates_to_all: u64,
}

impl WatchCost {
    /// Memory each open, idle connection added.
    pub fn per_connection_bytes(&self) -> Option<u64> {
        self.rss_connected_bytes
            .saturating_sub(self.rss_before_bytes)
            .checked_div(self.connections)
    }

    /// Memory each watch added on top of its connection.
    pub fn per_watch_bytes(&self) -> Option<u64> {
        self.rss_watching_bytes
            .saturating_sub(self.rss_connected_bytes)
            .checked_div(self.watches)
    }

    /// CPU microseconds per delivered event over the steady state (bookmarks, the churn's
    /// writes and the process's own work included).
    pub fn cpu_us_per_event(&self) -> Option<f64> {
        (self.steady_events > 0).then(|| self.steady_cpu_seconds * 1e6 / self.steady_events as f64)
    }
}

/// One class of clients' figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Class {
    /// Requests that got an answer or failed.
    pub requests: u64,
    /// Answers with a 2xx status.
    pub ok: u64,
    /// Answers with 429.
    pub rejected: u64,
    /// The 429s by the reason each gave (`X-Bulwark-Reason`; `-` for one without, such as
    /// the apiserver's own).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub rejected_by: BTreeMap<String, u64>,
    /// Every other failure: other statuses, resets, timeouts, connection errors.
    pub errors: u64,
    /// Mean latency of successful requests, milliseconds.
    pub mean_ms: f64,
    /// Latency percentiles of successful requests, milliseconds.
    pub p50_ms: f64,
    /// See `p50_ms`.
    pub p99_ms: f64,
    /// See `p50_ms`.
    pub p999_ms: f64,
    /// Successful requests per second over the run.
    pub rps: f64,
    /// Successful requests of each identity in the class.
    pub per_identity_ok: Vec<u64>,
    /// The proxy process's CPU time (user + system) while this class's load ran, seconds:
    /// benches (`passthrough`) only, where one class is one phase of load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_cpu_seconds: Option<f64>,
    /// How long the fixed work of `calibrate` took on the proxy's core just before and
    /// just after this class's load, milliseconds (`passthrough`'s saturation only): the
    /// higher, the slower the machine was at the time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration_ms: Option<(f64, f64)>,
}

impl Class {
    /// The proxy's CPU time per answered request (successful or refused with 429: a
    /// subject that refuses is measured by what its refusals cost), microseconds, where it
    /// was measured.
    pub fn cpu_us_per_request(&self) -> Option<f64> {
        let cpu = self.proxy_cpu_seconds?;
        let answered = self.ok + self.rejected;
        (answered > 0).then(|| cpu * 1e6 / answered as f64)
    }
}

/// Jain's fairness index of a set of allocations: 1 when all are equal, 1/n when one gets
/// everything. An empty set or one where nobody got anything counts as perfectly fair.
pub fn jain(values: &[u64]) -> f64 {
    let n = values.len() as f64;
    let sum: f64 = values.iter().map(|&v| v as f64).sum();
    let squares: f64 = values.iter().map(|&v| (v as f64) * (v as f64)).sum();
    if values.is_empty() || squares == 0.0 {
        return 1.0;
    }
    sum * sum / (n * squares)
}

/// Bytes in a short human form (`1.5 GiB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A list of counts written compactly: `[a, b, c]`.
fn list(values: &[u64]) -> String {
    let parts: Vec<String> = values.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// The rows of one part of a run that only some scenarios record (the fleet, the flood, the
/// watch cost): a heading, then a row per figure with a cell per run, `-` where a run has
/// none of it.
struct Part<'a, T> {
    rows: &'a mut Vec<(String, Vec<String>)>,
    runs: &'a [&'a Run],
    get: fn(&Run) -> Option<&T>,
}

impl<'a, T> Part<'a, T> {
    /// The part's heading row, or `None` (no rows) when no run recorded it.
    fn start(
        rows: &'a mut Vec<(String, Vec<String>)>,
        runs: &'a [&'a Run],
        title: &str,
        get: fn(&Run) -> Option<&T>,
    ) -> Option<Part<'a, T>> {
        if runs.iter().all(|r| get(r).is_none()) {
            return None;
        }
        rows.push((title.to_string(), vec![String::new(); runs.len()]));
        Some(Part { rows, runs, get })
    }

    /// A row: `label`, and `f` of each run's part.
    fn add(&mut self, label: &str, f: &dyn Fn(&T) -> String) {
        let cells = self
            .runs
            .iter()
            .map(|r| (self.get)(r).map_or_else(|| "-".to_string(), f))
            .collect();
        self.rows.push((format!("  {label}"), cells));
    }
}

/// The fleet rows: LIST bytes on each apiserver against its budget, the storm identities'
/// rates against their rule, and the takeover of a killed Bulwark's share.
fn fleet_rows(rows: &mut Vec<(String, Vec<String>)>, runs: &[&Run]) {
    let Some(mut part) = Part::start(rows, runs, "fleet", |r| r.fleet.as_ref()) else {
        return;
    };
    let seconds = |s: Option<f64>| s.map_or_else(|| "never".to_string(), |s| format!("{s:.1} s"));
    part.add("LIST bytes budget / apiserver", &|f| {
        human_bytes(f.list_bytes_budget)
    });
    part.add("peak LIST bytes per apiserver", &|f| {
        let peaks: Vec<String> = f.peak_list_bytes.iter().map(|b| human_bytes(*b)).collect();
        peaks.join(", ")
    });
    part.add("bytes one storm LIST reads", &|f| human_bytes(f.list_bytes));
    part.add("samples over budget", &|f| {
        format!("{} of {}", list(&f.samples_over_budget), f.samples)
    });
    part.add("peak LIST bytes, steady", &|f| {
        let peaks: Vec<String> = f
            .steady_peak_list_bytes
            .iter()
            .map(|b| human_bytes(*b))
            .collect();
        peaks.join(", ")
    });
    part.add("samples over budget, steady", &|f| {
        list(&f.steady_samples_over_budget)
    });
    part.add("storm rule (req/s)", &|f| {
        format!("{:.2}", f.storm_rule_qps)
    });
    let rates = |v: &[f64]| -> String {
        let v: Vec<String> = v.iter().map(|r| format!("{r:.2}")).collect();
        v.join(", ")
    };
    let range = |v: &[f64], rule: f64| -> String {
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        if v.is_empty() {
            "-".into()
        } else {
            format!("{:.2} – {:.2}", min / rule, max / rule)
        }
    };
    part.add("storm rate per identity, steady", &|f| {
        rates(&f.storm_steady_rates)
    });
    part.add("  steady ÷ rule (min – max)", &|f| {
        range(&f.storm_steady_rates, f.storm_rule_qps)
    });
    part.add("storm rate, one Bulwark dead", &|f| {
        rates(&f.storm_outage_rates)
    });
    part.add("storm rate, whole run", &|f| rates(&f.storm_rates));
    part.add("storm 429s (rate) per identity", &|f| {
        let v: Vec<String> = f
            .storm_429s
            .iter()
            .map(|(all, rate)| format!("{all} ({rate})"))
            .collect();
        v.join(", ")
    });
    part.add(
        "Bulwark killed / restarted at",
        &|f| match (f.killed_at_s, f.restarted_at_s) {
            (Some(k), Some(r)) => format!("{k:.0} s / {r:.0} s"),
            _ => "-".into(),
        },
    );
    part.add("survivors took over in", &|f| match f.killed_at_s {
        Some(_) => seconds(f.takeover_s),
        None => "-".into(),
    });
    part.add("survivors' share / apiserver", &|f| {
        f.survivors_share.map_or_else(|| "-".into(), human_bytes)
    });
    part.add("restarted one rejoined in", &|f| match f.restarted_at_s {
        Some(_) => seconds(f.rejoin_s),
        None => "-".into(),
    });
}

/// The watch cost's rows, when a run measured it.
fn watch_cost_rows(rows: &mut Vec<(String, Vec<String>)>, runs: &[&Run]) {
    let Some(mut part) = Part::start(rows, runs, "watch cost", |r| r.watch_cost.as_ref()) else {
        return;
    };
    let bytes = |b: Option<u64>| b.map_or_else(|| "-".to_string(), human_bytes);
    let ms = |t: &Option<[f64; 3]>| match t {
        Some([p50, p99, max]) => format!("{p50:.1} / {p99:.1} / {max:.1}"),
        None => "-".to_string(),
    };
    part.add("measured", &|w| w.measured.clone());
    part.add("connections / watches", &|w| {
        format!("{} / {}", w.connections, w.watches)
    });
    part.add("RSS before / connected / watching", &|w| {
        format!(
            "{} / {} / {}",
            human_bytes(w.rss_before_bytes),
            human_bytes(w.rss_connected_bytes),
            human_bytes(w.rss_watching_bytes)
        )
    });
    part.add("RSS per idle connection", &|w| {
        bytes(w.per_connection_bytes())
    });
    part.add("RSS per watch", &|w| bytes(w.per_watch_bytes()));
    part.add("CPU µs per delivered event", &|w| {
        w.cpu_us_per_event()
            .map_or_else(|| "-".to_string(), |us| format!("{us:.1}"))
    });
    part.add("Secret → watcher p50/p99/max ms", &|w| {
        ms(&w.secret_delivery_ms)
    });
    part.add("EndpointSlice → every kube-proxy ms", &|w| {
        format!(
            "{} ({} updates)",
            ms(&w.slice_to_all_ms),
            w.slice_updates_to_all
        )
    });
}

/// The conn-flood rows: the flood, Bulwark's descriptors and memory, and what the other
/// clients saw.
fn flood_rows(rows: &mut Vec<(String, Vec<String>)>, runs: &[&Run]) {
    let Some(mut part) = Part::start(rows, runs, "flood", |r| r.flood.as_ref()) else {
        return;
    };
    let phases = |p: &Phases, show: &dyn Fn(u64) -> String| {
        format!("{} / {} / {}", show(p.idle), show(p.peak), show(p.after))
    };
    // A run that measured no such requests (haproxy's has no admin listener or working
    // client) shows none.
    let latency = |l: &FloodLatency| {
        if l.ok + l.failed == 0 {
            return "-".to_string();
        }
        format!("{:.1} / {:.1} / {:.1}", l.p50_ms, l.p99_ms, l.max_ms)
    };
    let counts = |l: &FloodLatency| {
        if l.ok + l.failed == 0 {
            return "-".to_string();
        }
        format!("{} / {}", l.ok, l.failed)
    };
    let reasons = |m: &BTreeMap<String, u64>| {
        if m.is_empty() {
            return "-".to_string();
        }
        let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
        parts.join(", ")
    };
    part.add("connections (sources x in flight)", &|f| {
        format!("{} ({} x {})", f.connections, f.sources, f.concurrency)
    });
    part.add("accepted / refused / timed out / other", &|f| {
        format!(
            "{} / {} / {} / {}",
            f.accepted,
            f.refused,
            f.timed_out,
            f.other + f.not_attempted
        )
    });
    part.add("opened in", &|f| format!("{:.1} s", f.opened_in_s));
    part.add("closed by Bulwark", &|f| f.closed_by_bulwark.to_string());
    part.add("lasted", &|f| format!("{:.1} s", f.lasted_s));
    part.add("Bulwark's refusals", &|f| reasons(&f.bulwark_refused));
    part.add("Bulwark's closes", &|f| reasons(&f.bulwark_closed));
    part.add("fd limit", &|f| f.fd_limit.to_string());
    part.add("fds idle / peak / after", &|f| {
        phases(&f.fds, &|n| n.to_string())
    });
    part.add("RSS idle / peak / after", &|f| {
        phases(&f.rss_bytes, &human_bytes)
    });
    part.add("RSS per accepted connection", &|f| {
        f.rss_bytes
            .peak
            .saturating_sub(f.rss_bytes.idle)
            .checked_div(f.accepted)
            .map_or_else(|| "-".to_string(), human_bytes)
    });
    part.add("GETs before: ok / failed", &|f| counts(&f.gets_before));
    part.add("GETs before: p50 / p99 / max ms", &|f| {
        latency(&f.gets_before)
    });
    part.add("GETs during: ok / failed", &|f| counts(&f.gets_during));
    part.add("GETs during: p50 / p99 / max ms", &|f| {
        latency(&f.gets_during)
    });
    part.add("/readyz during: ok / failed", &|f| counts(&f.readyz_during));
    part.add("/readyz during: p50 / p99 / max ms", &|f| {
        latency(&f.readyz_during)
    });
    part.add("new client", &|f| {
        let n = &f.new_client;
        if n.connected {
            format!("connected in {:.1} ms", n.ms)
        } else if n.ms == 0.0 && n.error.is_none() {
            "-".to_string()
        } else {
            format!("failed after {:.1} s", n.ms / 1000.0)
        }
    });
}

/// The rows of the comparison table: each a label and one cell per run, grouped under
/// rows whose cells are empty (apiserver, proxy process, each class).
pub type Rows = Vec<(String, Vec<String>)>;

/// A section's title row: no cells.
fn section(rows: &mut Rows, runs: &[&Run], title: &str) {
    rows.push((title.to_string(), vec![String::new(); runs.len()]));
}

/// A row of the table: `label`, indented under its section, and `f` of each run.
fn row(runs: &[&Run], label: &str, f: &dyn Fn(&Run) -> String) -> (String, Vec<String>) {
    (format!("  {label}"), runs.iter().map(|r| f(r)).collect())
}

/// The comparison table's rows, one cell per run in the order they ran.
pub fn figures(report: &Report) -> Rows {
    let runs: Vec<&Run> = report.runs.iter().map(|(_, r)| r).collect();
    let runs = &runs[..];
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();

    section(&mut rows, runs, "apiserver");
    rows.push(row(runs, "heap limit / replica", &|r| {
        if r.apiserver.heap_limit_bytes == 0 {
            "none".into()
        } else {
            human_bytes(r.apiserver.heap_limit_bytes)
        }
    }));
    rows.push(row(runs, "peak heap", &|r| {
        human_bytes(r.apiserver.peak_heap_bytes)
    }));
    rows.push(row(runs, "OOM kills", &|r| r.apiserver.ooms.to_string()));
    if runs
        .iter()
        .any(|r| !r.apiserver.replica_peak_memory_bytes.is_empty())
    {
        rows.push(row(runs, "peak memory per replica", &|r| {
            let peaks: Vec<String> = r
                .apiserver
                .replica_peak_memory_bytes
                .iter()
                .map(|b| human_bytes(*b))
                .collect();
            peaks.join(", ")
        }));
        rows.push(row(runs, "OOM kills per replica", &|r| {
            list(&r.apiserver.replica_oom_kills)
        }));
    }
    rows.push(row(runs, "requests per replica", &|r| {
        list(&r.apiserver.replica_requests)
    }));
    rows.push(row(runs, "peak in-flight per replica", &|r| {
        list(&r.apiserver.replica_peak_inflight)
    }));
    rows.push(row(runs, "requests upstream", &|r| {
        r.apiserver.upstream_requests.to_string()
    }));
    rows.push(row(runs, "peak open watches", &|r| {
        r.apiserver.upstream_watches.to_string()
    }));
    if runs.iter().any(|r| r.proxy.is_some()) {
        section(&mut rows, runs, "proxy process");
        rows.push(row(runs, "peak RSS", &|r| match r.proxy {
            Some(p) => human_bytes(p.peak_rss_bytes),
            None => "-".into(),
        }));
        rows.push(row(runs, "CPU seconds", &|r| match r.proxy {
            Some(p) => format!("{:.2}", p.cpu_seconds),
            None => "-".into(),
        }));
    }
    if runs.iter().any(|r| r.watch_bytes_per_event.is_some()) {
        rows.push(row(
            runs,
            "watch bytes per event",
            &|r| match r.watch_bytes_per_event {
                Some(b) => format!("{b:.0}"),
                None => "-".into(),
            },
        ));
    }
    if runs.iter().any(|r| r.event_delivery_p99_ms.is_some()) {
        rows.push(row(
            runs,
            "event delivery p99",
            &|r| match r.event_delivery_p99_ms {
                Some(ms) => format!("{ms:.1} ms"),
                None => "-".into(),
            },
        ));
    }

    watch_cost_rows(&mut rows, runs);
    flood_rows(&mut rows, runs);
    fleet_rows(&mut rows, runs);

    class_rows(&mut rows, runs);

    rows
}

/// Each class's rows: its counts, its 429s by reason (when any gave one), its rate,
/// latency, fairness and, for a bench, the proxy's CPU a request.
fn class_rows(rows: &mut Vec<(String, Vec<String>)>, runs: &[&Run]) {
    let mut classes: Vec<&String> = runs.iter().flat_map(|r| r.classes.keys()).collect();
    classes.sort();
    classes.dedup();
    for class in classes {
        section(rows, runs, &format!("class {class}"));
        let get = |r: &Run| r.classes.get(class).cloned().unwrap_or_default();
        rows.push(row(runs, "requests", &|r| get(r).requests.to_string()));
        rows.push(row(runs, "ok / 429 / errors", &|r| {
            let c = get(r);
            format!("{} / {} / {}", c.ok, c.rejected, c.errors)
        }));
        if runs.iter().any(|r| !get(r).rejected_by.is_empty()) {
            rows.push(row(runs, "429 by reason", &|r| {
                let c = get(r);
                if c.rejected_by.is_empty() {
                    return "-".into();
                }
                (c.rejected_by.iter())
                    .map(|(reason, n)| format!("{reason} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }));
        }
        rows.push(row(runs, "ok per second", &|r| {
            format!("{:.1}", get(r).rps)
        }));
        rows.push(row(runs, "mean ms", &|r| format!("{:.3}", get(r).mean_ms)));
        rows.push(row(runs, "p50 / p99 / p99.9 ms", &|r| {
            let c = get(r);
            format!("{:.1} / {:.1} / {:.1}", c.p50_ms, c.p99_ms, c.p999_ms)
        }));
        rows.push(row(runs, "fairness (Jain)", &|r| {
            format!("{:.3}", jain(&get(r).per_identity_ok))
        }));
        if runs.iter().any(|r| get(r).proxy_cpu_seconds.is_some()) {
            rows.push(row(runs, "proxy CPU µs / request", &|r| {
                get(r)
                    .cpu_us_per_request()
                    .map_or_else(|| "-".into(), |us| format!("{us:.1}"))
            }));
        }
    }
}

/// A bench's figures per target (`passthrough`), one row each in the order they ran:
/// saturation throughput, the proxy's CPU time per request there, that throughput per core
/// against the floor's on as many cores (`x floor`), and the mean and p99 latency each
/// target adds to `direct`'s at every fixed rate (marked with the rate it reached where it
/// fell more than 5% short). The first row is the header; `None` for other scenarios.
pub fn bench_summary(report: &Report) -> Option<Vec<Vec<String>>> {
    let bench = report.bench.as_ref()?;
    let class = |run: &Run, name: &str| run.classes.get(name).cloned().unwrap_or_default();
    let cores = |name: &str| bench.cores.get(name).copied().unwrap_or(1).max(1);
    let per_core = |name: &str, run: &Run| class(run, SATURATION).rps / cores(name) as f64;
    // The floor on as many cores as `name`, else the floor on one.
    let floor_for = |name: &str| {
        let floors = report.runs.iter().filter(|(n, _)| n.starts_with(FLOOR));
        let same = floors.clone().find(|(n, _)| cores(n) == cores(name));
        same.or_else(|| floors.clone().find(|(n, _)| n == FLOOR))
    };
    let direct = report
        .runs
        .iter()
        .find(|(n, _)| n == "direct")
        .map(|(_, r)| r);
    let calibrated = report
        .runs
        .iter()
        .any(|(_, run)| class(run, SATURATION).calibration_ms.is_some());
    let mut header = vec![
        "target".to_string(),
        "saturation req/s".into(),
        "CPU µs/req".into(),
        "x floor".into(),
    ];
    if calibrated {
        header.push("core ms before / after".into());
    }
    for rate in &bench.fixed_rates {
        header.push(format!(
            "+mean / +p99 µs at {}/s",
            thousands(f64::from(*rate))
        ));
    }
    let mut rows = vec![header];
    for (name, run) in &report.runs {
        let saturation = class(run, SATURATION);
        let mut row = vec![
            name.clone(),
            thousands(saturation.rps),
            saturation
                .cpu_us_per_request()
                .map_or_else(|| "-".into(), |us| format!("{us:.1}")),
            match floor_for(name) {
                Some((floor, f)) if name != "direct" && per_core(floor, f) > 0.0 => {
                    format!("{:.2}", per_core(name, run) / per_core(floor, f))
                }
                _ => "-".into(),
            },
        ];
        if calibrated {
            row.push(match saturation.calibration_ms {
                Some((before, after)) => format!("{before:.0} / {after:.0}"),
                None => "-".into(),
            });
        }
        for rate in &bench.fixed_rates {
            let phase = fixed_rate_class(*rate);
            let c = class(run, &phase);
            let base = direct.map(|d| class(d, &phase));
            row.push(match base {
                _ if c.ok == 0 => "-".into(),
                Some(_) if name == "direct" => format!(
                    "{:.0} / {:.0} (base)",
                    c.mean_ms * 1000.0,
                    c.p99_ms * 1000.0
                ),
                Some(d) if d.ok > 0 => {
                    let mut cell = format!(
                        "{:+.0} / {:+.0}",
                        (c.mean_ms - d.mean_ms) * 1000.0,
                        (c.p99_ms - d.p99_ms) * 1000.0
                    );
                    if c.rps < 0.95 * f64::from(*rate) {
                        cell.push_str(&format!(" (at {}/s)", thousands(c.rps)));
                    }
                    cell
                }
                _ => "-".into(),
            });
        }
        rows.push(row);
    }
    Some(rows)
}

/// A count rounded to a whole number, with thousands separated: `165,362`.
pub fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The comparison table: one column per run, one row per figure, grouped by apiserver,
/// proxy and each class.
pub fn table(report: &Report) -> String {
    let names: Vec<&String> = report.runs.iter().map(|(n, _)| n).collect();
    let runs = report.runs.len();
    let rows = figures(report);
    // Widths in characters, as `format!` pads: labels may hold a `µ`.
    let label_width = rows
        .iter()
        .map(|(l, _)| l.chars().count())
        .max()
        .unwrap_or(0);
    let widths: Vec<usize> = (0..runs)
        .map(|i| {
            rows.iter()
                .map(|(_, cells)| cells[i].chars().count())
                .chain(std::iter::once(names[i].chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    if let Some(bench) = &report.bench {
        let _ = writeln!(out, "load: {}", bench.load_generator);
        let _ = writeln!(out, "pinning: {}", bench.pinning);
    }
    let _ = write!(
        out,
        "{:<label_width$}",
        format!("{} (scale {})", report.scenario, report.scale)
    );
    for (name, w) in names.iter().zip(&widths) {
        let _ = write!(out, "  {name:>w$}");
    }
    out.push('\n');
    let total = label_width + widths.iter().map(|w| w + 2).sum::<usize>();
    out.push_str(&"-".repeat(total));
    out.push('\n');
    for (label, cells) in &rows {
        let _ = write!(out, "{label:<label_width$}");
        for (cell, w) in cells.iter().zip(&widths) {
            let _ = write!(out, "  {cell:>w$}");
        }
        out.push('\n');
    }
    if let Some(summary) = bench_summary(report) {
        out.push('\n');
        out.push_str(&aligned(&summary));
    }
    out
}

/// Rows of cells as text: the first column left-aligned, the others right-aligned, a rule
/// under the first row.
fn aligned(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (n, row) in rows.iter().enumerate() {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            let pad = " ".repeat(w - cell.chars().count());
            if i == 0 {
                line.push_str(&format!("{cell}{pad}"));
            } else {
                line.push_str(&format!("  {pad}{cell}"));
            }
        }
        out.push_str(&line);
        out.push('\n');
        if n == 0 {
            out.push_str(&"-".repeat(line.chars().count()));
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let mut direct = Run::default();
        direct.apiserver.heap_limit_bytes = 3 << 30;
        direct.apiserver.ooms = 4;
        direct.apiserver.replica_requests = vec![10, 20, 30];
        direct.classes.insert(
            "storm".into(),
            Class {
                requests: 12,
                ok: 9,
                rejected: 0,
                errors: 3,
                per_identity_ok: vec![9, 0],
                ..Class::default()
            },
        );
        let mut bulwark = direct.clone();
        bulwark.apiserver.ooms = 0;
        bulwark.proxy = Some(ProxyCost {
            peak_rss_bytes: 50 << 20,
            cpu_seconds: 1.25,
        });
        let runs = vec![
            ("direct".to_string(), direct),
            ("bulwark".to_string(), bulwark),
        ];
        Report::new("list-storm", 0.1, runs)
    }

    /// A bench as `passthrough` records it: direct, nginx (which falls short of the higher
    /// rate), the floor and Bulwark on one and on two cores.
    pub(crate) fn bench() -> Report {
        let phase = |rps: f64, mean_ms: f64, p99_ms: f64, cpu: Option<f64>| Class {
            requests: 10_000,
            ok: 10_000,
            rps,
            mean_ms,
            p99_ms,
            proxy_cpu_seconds: cpu,
            ..Class::default()
        };
        let run = |slow: f64, saturation: f64, cpu: Option<f64>| {
            let mut run = Run::default();
            run.classes.insert(
                fixed_rate_class(2_000),
                phase(2_000.0, 0.1 + slow, 0.3 + 2.0 * slow, cpu),
            );
            let rps = saturation.min(20_000.0);
            run.classes.insert(
                fixed_rate_class(20_000),
                phase(rps, 0.2 + slow, 0.5 + 2.0 * slow, cpu),
            );
            run.classes
                .insert(SATURATION.into(), phase(saturation, 1.0, 2.0, cpu));
            run.proxy = cpu.map(|cpu_seconds| ProxyCost {
                peak_rss_bytes: 1 << 20,
                cpu_seconds,
            });
            run
        };
        let runs = vec![
            ("direct".to_string(), run(0.0, 160_000.0, None)),
            ("nginx".to_string(), run(0.5, 9_000.0, Some(0.2))),
            ("floor".to_string(), run(0.1, 60_000.0, Some(0.1))),
            (
                "floor-2-workers".to_string(),
                run(0.1, 80_000.0, Some(0.11)),
            ),
            ("bulwark".to_string(), run(1.0, 30_000.0, Some(0.2))),
            (
                "bulwark-2-workers".to_string(),
                run(0.7, 60_000.0, Some(0.25)),
            ),
        ];
        let mut report = Report::new("passthrough", 1.0, runs);
        report.bench = Some(BenchSetup {
            load_generator: "h2load".into(),
            pinning: "cores".into(),
            fixed_rates: vec![2_000, 20_000],
            cores: [
                ("nginx".to_string(), 1),
                ("floor".to_string(), 1),
                ("floor-2-workers".to_string(), 2),
                ("bulwark".to_string(), 1),
                ("bulwark-2-workers".to_string(), 2),
            ]
            .into(),
        });
        report
    }

    #[test]
    fn a_bench_summary_holds_each_target_against_direct_and_the_floor() {
        let summary = bench_summary(&bench()).unwrap();
        assert_eq!(
            summary[0],
            [
                "target",
                "saturation req/s",
                "CPU µs/req",
                "x floor",
                "+mean / +p99 µs at 2,000/s",
                "+mean / +p99 µs at 20,000/s"
            ]
        );
        let row = |name: &str| summary.iter().find(|r| r[0] == name).unwrap().clone();
        assert_eq!(
            row("direct"),
            [
                "direct",
                "160,000",
                "-",
                "-",
                "100 / 300 (base)",
                "200 / 500 (base)"
            ]
        );
        // 0.2 s of CPU over 10,000 requests; 30k/s against the one-core floor's 60k/s.
        assert_eq!(
            row("bulwark"),
            [
                "bulwark",
                "30,000",
                "20.0",
                "0.50",
                "+1000 / +2000",
                "+1000 / +2000"
            ]
        );
        // Two cores against the floor on two cores: 60k/s against 80k/s.
        assert_eq!(row("bulwark-2-workers")[3], "0.75");
        assert_eq!(row("floor")[3], "1.00");
        assert_eq!(row("floor-2-workers")[3], "1.00");
        // nginx holds 2,000/s but not 20,000/s: its latency there says so.
        assert_eq!(row("nginx")[3], "0.15");
        assert_eq!(row("nginx")[4], "+500 / +1000");
        assert_eq!(row("nginx")[5], "+500 / +1000 (at 9,000/s)");
        // Other scenarios have none.
        assert!(bench_summary(&sample()).is_none());
    }

    #[test]
    fn a_bench_with_calibrations_says_how_fast_the_core_was_around_each_saturation() {
        let mut report = bench();
        for (name, ms) in [("floor", (300.0, 310.0)), ("bulwark", (450.0, 290.0))] {
            let run = &mut report.runs.iter_mut().find(|(n, _)| n == name).unwrap().1;
            run.classes.get_mut(SATURATION).unwrap().calibration_ms = Some(ms);
        }
        let summary = bench_summary(&report).unwrap();
        assert_eq!(summary[0][4], "core ms before / after");
        let row = |name: &str| summary.iter().find(|r| r[0] == name).unwrap().clone();
        assert_eq!(row("bulwark")[2..5], ["20.0", "0.50", "450 / 290"]);
        assert_eq!(row("floor")[4], "300 / 310");
        assert_eq!(row("direct")[4], "-");
        assert_eq!(row("bulwark")[5], "+1000 / +2000");
    }

    #[test]
    fn a_bench_reads_back_from_its_json_and_older_ones_without_the_new_fields() {
        let text = serde_json::to_string(&bench()).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert_eq!(bench_summary(&back), bench_summary(&bench()));
        let old = r#"{"scenario":"passthrough","scale":1.0,"runs":{"direct":{}},
            "bench":{"load_generator":"h2load","pinning":"none"}}"#;
        let old: Report = serde_json::from_str(old).unwrap();
        assert_eq!(bench_summary(&old).unwrap().len(), 2);
        let v = serde_json::to_value(sample()).unwrap();
        assert!(
            v["runs"]["bulwark"]["classes"]["storm"]
                .get("proxy_cpu_seconds")
                .is_none(),
            "absent outside benches"
        );
    }

    #[test]
    fn cpu_per_request_needs_the_cpu_time_and_an_answer() {
        let mut class = Class {
            ok: 4,
            proxy_cpu_seconds: Some(0.000_1),
            ..Class::default()
        };
        assert_eq!(class.cpu_us_per_request(), Some(25.0));
        class.ok = 0;
        assert_eq!(class.cpu_us_per_request(), None);
        assert_eq!(Class::default().cpu_us_per_request(), None);
    }

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_000.0), "1,000");
        assert_eq!(thousands(165_361.8), "165,362");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }

    #[test]
    fn a_bench_table_ends_with_its_summary_aligned() {
        let text = table(&bench());
        assert!(text.contains("proxy CPU µs / request"), "{text}");
        let summary: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("target"))
            .collect();
        assert_eq!(summary.len(), 2 + 6, "{text}");
        let width = summary[0].chars().count();
        assert!(
            summary.iter().all(|l| l.chars().count() == width),
            "aligned:\n{text}"
        );
        // The comparison table above it is aligned in characters too, `µ` and all.
        let top: Vec<&str> = text.lines().skip(2).take_while(|l| !l.is_empty()).collect();
        let width = top[0].chars().count();
        assert!(top.iter().all(|l| l.chars().count() == width), "{text}");
    }

    #[test]
    fn jain_is_one_for_equal_shares_and_one_over_n_for_a_monopoly() {
        assert!((jain(&[5, 5, 5, 5]) - 1.0).abs() < 1e-12);
        assert!((jain(&[8, 0, 0, 0]) - 0.25).abs() < 1e-12);
        assert!((jain(&[]) - 1.0).abs() < 1e-12);
        assert!((jain(&[0, 0]) - 1.0).abs() < 1e-12);
        // (1+3)^2 / (2 * (1+9)) = 16/20
        assert!((jain(&[1, 3]) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn a_flood_shows_memory_per_connection_and_dashes_for_what_a_run_did_not_measure() {
        let flood = Flood {
            accepted: 2000,
            rss_bytes: Phases {
                idle: 20 << 20,
                peak: (20 << 20) + 2000 * 21 * 1024,
                after: 21 << 20,
            },
            ..Flood::default()
        };
        let rows = figures(&Report::new(
            "conn-flood",
            1.0,
            vec![(
                "haproxy".into(),
                Run {
                    flood: Some(flood),
                    ..Run::default()
                },
            )],
        ));
        let row = |label: &str| {
            rows.iter()
                .find(|(l, _)| l.trim() == label)
                .map(|(_, c)| c[0].clone())
        };
        assert_eq!(
            row("RSS per accepted connection").as_deref(),
            Some("21.0 KiB")
        );
        assert_eq!(row("GETs during: ok / failed").as_deref(), Some("-"));
        assert_eq!(
            row("/readyz during: p50 / p99 / max ms").as_deref(),
            Some("-")
        );
        assert_eq!(row("new client").as_deref(), Some("-"));
    }

    #[test]
    fn a_watch_cost_splits_memory_into_connections_and_watches() {
        let w = WatchCost {
            measured: "Bulwark".into(),
            connections: 1000,
            watches: 6500,
            rss_before_bytes: 64 << 20,
            rss_connected_bytes: (64 << 20) + 1000 * 25 * 1024,
            rss_watching_bytes: (64 << 20) + 1000 * 25 * 1024 + 6500 * 8 * 1024,
            steady_cpu_seconds: 2.0,
            steady_events: 100_000,
            ..WatchCost::default()
        };
        assert_eq!(w.per_connection_bytes(), Some(25 * 1024));
        assert_eq!(w.per_watch_bytes(), Some(8 * 1024));
        assert_eq!(w.cpu_us_per_event(), Some(20.0));
        // Memory that fell, or no connections, reads as nothing rather than a wrap.
        let fell = WatchCost {
            rss_connected_bytes: 1,
            rss_before_bytes: 2,
            ..w.clone()
        };
        assert_eq!(fell.per_connection_bytes(), Some(0));
        assert_eq!(WatchCost::default().per_connection_bytes(), None);
        assert_eq!(WatchCost::default().cpu_us_per_event(), None);
        let rows = figures(&Report::new(
            "informers",
            0.25,
            vec![(
                "bulwark".into(),
                Run {
                    watch_cost: Some(w),
                    ..Run::default()
                },
            )],
        ));
        let row = |label: &str| {
            rows.iter()
                .find(|(l, _)| l.trim() == label)
                .map(|(_, c)| c[0].clone())
        };
        assert_eq!(row("RSS per watch").as_deref(), Some("8.0 KiB"));
        assert_eq!(row("RSS per idle connection").as_deref(), Some("25.0 KiB"));
    }

    #[test]
    fn human_bytes_picks_a_readable_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn json_has_the_issue_schema() {
        let v = serde_json::to_value(sample()).unwrap();
        assert_eq!(v["scenario"], "list-storm");
        assert_eq!(v["scale"], 0.1);
        let direct = &v["runs"]["direct"];
        assert!(direct.get("proxy").is_none(), "direct has no proxy figures");
        assert!(direct.get("event_delivery_p99_ms").is_none());
        for key in [
            "heap_limit_bytes",
            "peak_heap_bytes",
            "ooms",
            "replica_requests",
            "replica_peak_inflight",
            "upstream_requests",
            "upstream_watches",
        ] {
            assert!(direct["apiserver"].get(key).is_some(), "missing {key}");
        }
        let bulwark = &v["runs"]["bulwark"];
        assert_eq!(bulwark["proxy"]["peak_rss_bytes"], 50u64 << 20);
        assert_eq!(bulwark["proxy"]["cpu_seconds"], 1.25);
        let storm = &bulwark["classes"]["storm"];
        for key in [
            "requests",
            "ok",
            "rejected",
            "errors",
            "mean_ms",
            "p50_ms",
            "p99_ms",
            "p999_ms",
            "rps",
            "per_identity_ok",
        ] {
            assert!(storm.get(key).is_some(), "missing {key}");
        }
        assert_eq!(storm["per_identity_ok"], serde_json::json!([9, 0]));
    }

    #[test]
    fn table_has_a_column_per_run_and_aligned_rows() {
        let text = table(&sample());
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("list-storm (scale 0.1)"));
        assert!(lines[0].contains("bulwark") && lines[0].contains("direct"));
        let width = lines[0].len();
        assert!(
            lines.iter().all(|l| l.len() == width),
            "rows aligned:\n{text}"
        );
        let ooms = lines.iter().find(|l| l.contains("OOM kills")).unwrap();
        let cells: Vec<&str> = ooms.split_whitespace().collect();
        // runs keep the order they ran in: direct, then bulwark
        assert_eq!(&cells[cells.len() - 2..], ["4", "0"]);
        assert!(text.contains("3.0 GiB"));
        assert!(text.contains("50.0 MiB"));
        assert!(text.contains("9 / 0 / 3"));
        assert!(text.contains("class storm"));
        // per_identity_ok [9, 0]: Jain = 81 / (2 * 81) = 0.5
        assert!(text.contains("0.500"));
    }

    /// A class whose 429s gave reasons has a row of them; a run without any shows `-`.
    #[test]
    fn a_class_with_refusals_shows_them_by_reason() {
        let mut report = sample();
        let (_, bulwark) = (report.runs.iter_mut())
            .find(|(name, _)| name == "bulwark")
            .unwrap();
        let storm = bulwark.classes.get_mut("storm").unwrap();
        storm.rejected_by =
            BTreeMap::from([("queue_full".to_owned(), 2), ("rate_limited".to_owned(), 7)]);
        let text = table(&report);
        let row = text
            .lines()
            .find(|l| l.contains("429 by reason"))
            .unwrap_or_else(|| panic!("a row of reasons:\n{text}"));
        assert!(row.contains("queue_full 2, rate_limited 7"), "{row}");
        assert!(row.split_whitespace().any(|cell| cell == "-"), "{row}");
        assert!(!table(&sample()).contains("429 by reason"));
    }
}
