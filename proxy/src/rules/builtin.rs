//! The levels and rules every rule set has, whatever the files say.
//!
//! - level `exempt`: no limits at all; it cannot be redefined;
//! - level `catch-all`: a small share for requests no rule matched; a file may redefine it
//!   to change its numbers;
//! - the heartbeat rules (`node-heartbeats`, `node-status`, `leader-election`): small
//!   writes that keep nodes and controllers alive, exempt unless a file defines a rule of the
//!   same name, which then replaces the built-in one. Like APF's `system-node-high` and
//!   `system-leader-election` FlowSchemas, they match only the identities that heartbeat
//!   (nodes; kube-controller-manager, kube-scheduler and kube-system's ServiceAccounts):
//!   anyone else's Lease writes are ordinary, throttled traffic. One flow per user, so that
//!   each node and controller has its own share of the request-body budget;
//! - rule `catch-all`: matches every request no other rule did, after all of them, one flow
//!   per user with a per-user token bucket; it cannot be redefined (a rule with an empty
//!   `match` and precedence 10000 catches everything before it).

use std::time::Duration;

use super::types::{FlowBy, LevelSpec, Mode, Rate};

/// The name of the level with no limits.
pub const EXEMPT: &str = "exempt";
/// The name of the catch-all level and rule.
pub const CATCH_ALL: &str = "catch-all";

/// What `file` of a built-in item is shown as.
pub const BUILTIN_SOURCE: &str = "built-in";

/// The built-in `exempt` level.
pub fn exempt_level() -> LevelSpec {
    LevelSpec {
        name: EXEMPT.into(),
        exempt: true,
        seats: 0,
        queues: 0,
        hand_size: 0,
        queue_length: 0,
        max_wait: Duration::ZERO,
        max_seats_per_flow: 0,
    }
}

/// The built-in `catch-all` level: a small share, so that unknown clients cannot take the
/// capacity that named ones were given.
pub fn catch_all_level() -> LevelSpec {
    LevelSpec {
        name: CATCH_ALL.into(),
        exempt: false,
        seats: 4,
        queues: 64,
        hand_size: 6,
        queue_length: 50,
        max_wait: Duration::from_secs(15),
        // One user may not hold every seat: the others keep one of the four.
        max_seats_per_flow: 3,
    }
}

/// The catch-all rule's flows and bucket: one flow per user, so one noisy unknown client
/// cannot starve the other unknown clients.
pub const CATCH_ALL_FLOW: FlowBy = FlowBy::User;
/// The catch-all rule's per-user token bucket (client-go's defaults are 5 qps, burst 10;
/// kubectl's 50/100 for discovery bursts).
pub const CATCH_ALL_RATE: Rate = Rate {
    qps: 20.0,
    burst: 100,
};
/// The catch-all rule's mode.
pub const CATCH_ALL_MODE: Mode = Mode::Enforce;

/// The heartbeat rules, in the rule file schema, parsed by the same code as any file.
pub const HEARTBEAT_RULES: &str = r#"
rules:
  # Kubelets renew their node Lease every 10 s; a missed renewal marks the node NotReady.
  - name: node-heartbeats
    precedence: 10
    match:
      groups: ["system:nodes"]
      verbs: [get, create, update, patch]
      resources: [{group: coordination.k8s.io, resource: leases}]
      namespaces: [kube-node-lease]
    level: exempt
    flow: user
  # Kubelets report node status; before Leases this was the heartbeat.
  - name: node-status
    precedence: 11
    match:
      groups: ["system:nodes"]
      verbs: [get, create, update, patch]
      resources: [{group: "", resource: nodes}, {group: "", resource: nodes/status}]
    level: exempt
    flow: user
  # Controllers and schedulers renew their leader-election Lease; a missed renewal makes
  # them restart. The subjects and verbs of APF's system-leader-election.
  - name: leader-election
    precedence: 12
    match:
      users: ["system:kube-controller-manager", "system:kube-scheduler"]
      serviceAccounts: [kube-system/*]
      verbs: [get, create, update]
      resources: [{group: coordination.k8s.io, resource: leases}]
    level: exempt
    flow: user
"#;
