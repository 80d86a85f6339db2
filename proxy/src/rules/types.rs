//! The plain data types that rules hand to admission: a level's definition and the result of
//! matching a request.

use std::sync::Arc;
use std::time::Duration;

/// A level as written in a rule file (or built in: `exempt`, `catch-all`).
#[derive(Clone, Debug, PartialEq)]
pub struct LevelSpec {
    /// Unique name, the `level` label of the fairness metrics.
    pub name: String,
    /// No limits at all: no rate limit, no queue, no seats, no byte budget.
    pub exempt: bool,
    /// Concurrency seats of this Bulwark replica.
    pub seats: u32,
    /// Number of fair queues.
    pub queues: u32,
    /// Queues each flow is dealt (it joins the shortest of its hand).
    pub hand_size: u32,
    /// Requests one queue holds before it refuses with `queue_full`.
    pub queue_length: u32,
    /// Longest a request waits in its queue before it is refused with `queue_timeout`.
    pub max_wait: Duration,
}

/// What separates the flows of a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowBy {
    /// One flow per user name.
    User,
    /// One flow per namespace of the request.
    Namespace,
    /// The whole rule is one flow.
    None,
}

/// Whether a rule's limits refuse requests or only count what they would refuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Limits refuse requests with 429.
    Enforce,
    /// Nothing is refused; would-be refusals are counted and logged.
    Shadow,
}

/// A per-flow token bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Tokens added per second.
    pub qps: f64,
    /// Bucket size: requests that may arrive at once.
    pub burst: u32,
}

/// The rule a request matched, everything admission needs.
#[derive(Clone, Debug)]
pub struct Matched {
    /// The rule's name.
    pub rule: Arc<str>,
    /// The rule's priority level.
    pub level: Arc<LevelSpec>,
    /// Flow key: `"rule/user"`, `"rule/ns"` or `"rule"`.
    pub flow: String,
    /// The per-flow token bucket, if the rule has one.
    pub rate: Option<Rate>,
    /// Open watches allowed per flow, if limited.
    pub watches: Option<u32>,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Bounded staleness the identity accepts from the cache.
    pub staleness: Option<Duration>,
}
