//! The plain data that rules hand to admission: a level's limits, how flows are keyed, and
//! what a request matched. Shared by `rules` (which builds them) and `admit` (which enforces
//! them), so it holds data only.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

/// A level as written in a rule file (or built in: `exempt`, `catch-all`).
#[derive(Clone, Debug, PartialEq)]
pub struct LevelSpec {
    /// The level's name, unique in a rule set.
    pub name: String,
    /// Whether the level has no limits at all (the built-in `exempt`): no queue, no seats,
    /// no rate, no byte budget. The numbers below are meaningless when set.
    pub exempt: bool,
    /// Concurrency seats of this Bulwark replica.
    pub seats: u32,
    /// Number of fair queues.
    pub queues: u32,
    /// Queues dealt to each flow (shuffle sharding); a flow joins the shortest of its hand.
    pub hand_size: u32,
    /// Requests one queue may hold before `queue_full`.
    pub queue_length: u32,
    /// Longest wait in a queue before `queue_timeout`.
    pub max_wait: Duration,
    /// The most seats one flow may hold at once (scaled with the seats when a fleet share
    /// or lost replicas shrink them); `seats` or more, or 0, for no cap.
    pub max_seats_per_flow: u32,
}

/// What a rule's flows are keyed by: each flow gets its own token bucket, fair-queue hand
/// and watch count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlowBy {
    /// One flow per user name.
    User,
    /// One flow per namespace of the request (cluster-scoped requests share one).
    Namespace,
    /// One flow for the whole rule.
    None,
    /// One flow per user and node: the node a bound ServiceAccount token names
    /// (`authentication.kubernetes.io/node-name`) or a kubelet's (`system:node:<name>`),
    /// else the client's source address.
    Node,
    /// One flow per user and pod: the pod UID a bound ServiceAccount token names
    /// (`authentication.kubernetes.io/pod-uid`), else the client's source address.
    Pod,
}

/// Whether a rule's limits reject requests or only count what they would have rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Refuse with 429.
    Enforce,
    /// Let everything through; count and log would-be rejections.
    Shadow,
}

/// A per-flow token bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Sustained requests per second.
    pub qps: f64,
    /// Requests allowed at once on a full bucket.
    pub burst: u32,
}

/// The rule a request matched, everything admission needs.
#[derive(Clone, Debug)]
pub struct Matched {
    /// The rule's name.
    pub rule: Arc<str>,
    /// The rule's priority level.
    pub level: Arc<LevelSpec>,
    /// The flow key: `rule/user`, `rule/namespace`, `rule`, or per client
    /// `rule/user/node:NAME`, `rule/user/pod:UID` or `rule/user/addr:IP`.
    pub flow: Arc<str>,
    /// The per-flow token bucket, if the rule has one.
    pub rate: Option<Rate>,
    /// Most open watches per flow, if limited.
    pub watches: Option<u32>,
    /// Enforce or shadow.
    pub mode: Mode,
    /// How stale a cached read may be for this identity, if the rule opts into it.
    pub staleness: Option<Duration>,
    /// The rule and level as the headers of every answer name them.
    pub headers: RuleHeaders,
}

/// `X-Bulwark-Rule` and `X-Bulwark-Level` of a rule, made once when the rule is compiled
/// (a name that is not a valid header value is left out).
#[derive(Clone, Debug, Default)]
pub struct RuleHeaders {
    /// The rule's name.
    pub rule: Option<HeaderValue>,
    /// Its level's name.
    pub level: Option<HeaderValue>,
}

impl RuleHeaders {
    /// The headers naming `rule` at `level`.
    pub fn new(rule: &str, level: &str) -> RuleHeaders {
        RuleHeaders {
            rule: HeaderValue::from_str(rule).ok(),
            level: HeaderValue::from_str(level).ok(),
        }
    }
}
