//! The simulator's own Prometheus metrics: requests by replica, verb, resource, code and
//! (capped) user, plus per-replica gauges read from the live counters at scrape time.

use std::fmt::Write;

use prometheus::{Encoder, IntCounterVec, Opts, Registry, TextEncoder};

use crate::server::{Replica, ReplicaInner};

/// At most this many distinct user label values; later users are counted as `other`.
const MAX_USERS: usize = 50;

/// One per-replica series: name, help, and how to read it from the stats.
type Row = (&'static str, &'static str, fn(&crate::ReplicaStats) -> u64);

/// Registered once per fleet.
pub struct SimMetrics {
    registry: Registry,
    requests: IntCounterVec,
    users: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Default for SimMetrics {
    fn default() -> Self {
        SimMetrics::new()
    }
}

impl SimMetrics {
    /// A fresh registry.
    pub fn new() -> SimMetrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "bulwark_sim_requests_total",
                "Requests served by the simulated apiservers",
            ),
            &["replica", "verb", "resource", "user", "code"],
        )
        .unwrap_or_else(|e| panic!("static metric definition is valid: {e}"));
        let _ = registry.register(Box::new(requests.clone()));
        SimMetrics {
            registry,
            requests,
            users: Default::default(),
        }
    }

    /// Counts one request (`verb` as the apiserver names it; `user` empty when
    /// unauthenticated).
    pub fn observe(&self, replica: usize, verb: &str, resource: &str, user: &str, code: u16) {
        let user = if user.is_empty() {
            "none"
        } else {
            let mut u = self.users.lock().unwrap_or_else(|p| p.into_inner());
            if u.contains(user) || u.len() < MAX_USERS {
                u.insert(user.to_string());
                user
            } else {
                "other"
            }
        };
        let resource = if crate::discovery::RESOURCES
            .iter()
            .any(|r| r.resource == resource)
        {
            resource
        } else {
            "other"
        };
        self.requests
            .with_label_values(&[
                &replica.to_string(),
                verb,
                resource,
                user,
                &code.to_string(),
            ])
            .inc();
    }

    fn gauges(out: &mut String, replicas: &[&ReplicaInner]) {
        let rows: [Row; 6] = [
            (
                "bulwark_sim_in_flight",
                "Requests in flight (watches excluded)",
                |s| s.in_flight,
            ),
            ("bulwark_sim_open_watches", "Open watches", |s| {
                s.open_watches
            }),
            ("bulwark_sim_heap_bytes", "Modelled heap", |s| s.heap_bytes),
            (
                "bulwark_sim_peak_heap_bytes",
                "Highest modelled heap",
                |s| s.peak_heap_bytes,
            ),
            (
                "bulwark_sim_ooms_total",
                "Modelled out-of-memory restarts",
                |s| s.ooms,
            ),
            (
                "bulwark_sim_peak_in_flight",
                "Highest requests in flight",
                |s| s.peak_in_flight,
            ),
        ];
        let stats: Vec<_> = replicas
            .iter()
            .map(|r| (r.index, Replica::stats_of(r)))
            .collect();
        for (name, help, f) in rows {
            let kind = if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (i, s) in &stats {
                let _ = writeln!(out, "{name}{{replica=\"{i}\"}} {}", f(s));
            }
        }
    }

    fn counters(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }

    /// The fleet's metrics.
    pub fn render(&self, replicas: &[Replica]) -> String {
        let mut s = self.counters();
        let inners: Vec<&ReplicaInner> = replicas.iter().map(|r| &*r.inner).collect();
        Self::gauges(&mut s, &inners);
        s
    }

    /// What one replica's `/metrics` shows (the fleet's counters, its own gauges).
    pub fn render_one(&self, rep: &ReplicaInner) -> String {
        let mut s = self.counters();
        Self::gauges(&mut s, &[rep]);
        s
    }
}
