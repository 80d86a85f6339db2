//! The YAML schema of a rule file, exactly as written (DESIGN.md "Rules"): parsed with
//! `serde_norway`, unknown fields refused, values kept wide (`i64`, optional lists) so that
//! validation can name every bad value at once instead of stopping at the first.

use std::time::Duration;

use serde::Deserialize;

/// One rule file: priority levels and the rules that send requests to them.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RuleFile {
    /// Priority levels defined by this file, usable by rules of every file.
    #[serde(default)]
    pub levels: Vec<LevelDoc>,
    /// Rules defined by this file.
    #[serde(default)]
    pub rules: Vec<RuleDoc>,
}

/// A priority level: concurrency seats and the fair queues in front of them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct LevelDoc {
    /// Unique name (lowercase letters, digits, `-`, `.`; at most 63 characters).
    pub name: String,
    /// Concurrency seats of this Bulwark replica (at least 1).
    pub seats: i64,
    /// Number of fair queues (default 64).
    #[serde(default = "default_queues")]
    pub queues: i64,
    /// Queues dealt to each flow; it joins the shortest (default 6, at most `queues`).
    #[serde(default = "default_hand_size")]
    pub hand_size: i64,
    /// Requests one queue may hold before `queue_full` (default 50).
    #[serde(default = "default_queue_length")]
    pub queue_length: i64,
    /// Longest wait in a queue before `queue_timeout` (default 15s).
    #[serde(default = "default_max_wait", with = "humantime_serde")]
    pub max_wait: Duration,
    /// The most seats one flow may hold at once, 1 to `seats` (default: `seats` less a
    /// quarter, rounded down, so that other flows keep at least a quarter of a level of 4
    /// seats or more).
    #[serde(default)]
    pub max_seats_per_flow: Option<i64>,
}

/// The default per-flow cap of a level of `seats`: all but a quarter.
pub(crate) fn default_max_seats_per_flow(seats: i64) -> i64 {
    seats - seats / 4
}

/// Default number of queues of a level.
pub(crate) const DEFAULT_QUEUES: i64 = 64;
/// Default hand size of a level.
pub(crate) const DEFAULT_HAND_SIZE: i64 = 6;
/// Default queue length of a level.
pub(crate) const DEFAULT_QUEUE_LENGTH: i64 = 50;
/// Default longest wait in a queue.
pub(crate) const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(15);

fn default_queues() -> i64 {
    DEFAULT_QUEUES
}
fn default_hand_size() -> i64 {
    DEFAULT_HAND_SIZE
}
fn default_queue_length() -> i64 {
    DEFAULT_QUEUE_LENGTH
}
fn default_max_wait() -> Duration {
    DEFAULT_MAX_WAIT
}

/// A rule: which requests it matches and where they go.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RuleDoc {
    /// Unique name (same syntax as level names).
    pub name: String,
    /// Lower is tried first, 1 to 10000.
    pub precedence: i64,
    /// What the rule matches; omitted, it matches every request.
    #[serde(default, rename = "match")]
    pub matches: MatchDoc,
    /// The priority level requests go to.
    pub level: String,
    /// What flows are keyed by (default `user`).
    #[serde(default)]
    pub flow: FlowDoc,
    /// A token bucket per flow.
    #[serde(default)]
    pub rate: Option<RateDoc>,
    /// Most open watches per flow.
    #[serde(default)]
    pub watches: Option<i64>,
    /// `enforce` (default) or `shadow`.
    #[serde(default)]
    pub mode: ModeDoc,
    /// How stale a cached read may be for these requests.
    #[serde(default, with = "humantime_serde")]
    pub staleness: Option<Duration>,
}

/// The match of a rule. Every field given must match; an omitted field matches anything.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct MatchDoc {
    /// User names, or `*`.
    pub users: Option<Vec<String>>,
    /// Group names, or `*`.
    pub groups: Option<Vec<String>>,
    /// ServiceAccounts as `NAMESPACE/NAME` or `NAMESPACE/*`.
    pub service_accounts: Option<Vec<String>>,
    /// Verbs (`get`, `list`, `watch`, `create`, ...), or `*`.
    pub verbs: Option<Vec<String>>,
    /// API group and resource pairs.
    pub resources: Option<Vec<ResourceDoc>>,
    /// Namespaces, `*`, or `""` for cluster-scoped requests.
    pub namespaces: Option<Vec<String>>,
    /// Non-resource paths, exact or ending in `*`.
    #[serde(rename = "nonResourceURLs")]
    pub non_resource_urls: Option<Vec<String>>,
}

/// One API group and resource.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ResourceDoc {
    /// API group: `""` for the core group, or `*`.
    pub group: String,
    /// Resource, `resource/subresource`, `resource/*`, `*/subresource` or `*`.
    pub resource: String,
}

/// A per-flow token bucket.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RateDoc {
    /// Sustained requests per second (above 0).
    pub qps: f64,
    /// Requests allowed at once on a full bucket (at least 1).
    pub burst: i64,
}

/// What flows are keyed by.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum FlowDoc {
    /// One flow per user.
    #[default]
    User,
    /// One flow per namespace.
    Namespace,
    /// One flow for the rule.
    None,
    /// One flow per user and node (else per user and source address).
    Node,
    /// One flow per user and pod (else per user and source address).
    Pod,
}

/// Enforce or shadow.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ModeDoc {
    /// Refuse.
    #[default]
    Enforce,
    /// Only count.
    Shadow,
}
