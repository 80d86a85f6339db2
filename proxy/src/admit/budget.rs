//! The in-flight LIST byte budget of each apiserver replica, behind a small trait so that the
//! queue logic is tested without an upstream pool.
//!
//! A LIST holds its bytes on one replica from dispatch until its response body ends. The
//! bytes are also what moves the replica pick (the balancer weighs in-flight bytes), so the
//! budget reserves on the replica with the most room.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::IntGauge;

use crate::fleet::FleetShares;
use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// Bytes counted against one replica until dropped.
pub struct Reservation {
    replica: Arc<str>,
    bytes: u64,
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Reservation {
    /// A reservation of `bytes` on `replica`; `release` runs once when it is dropped.
    pub fn new(
        replica: Arc<str>,
        bytes: u64,
        release: impl FnOnce() + Send + Sync + 'static,
    ) -> Self {
        Self {
            replica,
            bytes,
            release: Some(Box::new(release)),
        }
    }

    /// The replica the bytes are counted on.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("replica", &self.replica)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// Where LIST bytes are counted, and how much of the fleet is healthy.
pub trait ByteBudget: Send + Sync {
    /// One replica's budget in bytes.
    fn budget(&self) -> u64;

    /// Reserves `bytes` on the healthy replica with the fewest in-flight bytes if they fit
    /// in its budget, or if they are more than a whole budget and that replica holds
    /// nothing (such a LIST runs alone). `None` when no replica has room.
    fn try_reserve(&self, bytes: u64) -> Option<Reservation>;

    /// Counts `bytes` on the least loaded replica without checking the budget: shadow-mode
    /// LISTs use real apiserver memory even when nothing is enforced.
    fn reserve_anyway(&self, bytes: u64) -> Option<Reservation>;

    /// `(healthy, configured)` replicas; level seats shrink with this share.
    fn health(&self) -> (usize, usize);

    /// The seats `level` may use before health shrinks them: its `configured` seats, or
    /// its share of the fleet's.
    fn level_seats(&self, level: &str, configured: u32) -> u32 {
        let _ = level;
        configured
    }

    /// The fraction of its rule's rate `flow` may use here; `None`: all of it (no other
    /// replica of the fleet sees it).
    fn rate_share(&self, flow: &str) -> Option<f64> {
        let _ = flow;
        None
    }
}

/// Whether `bytes` may join `in_flight` on a replica with budget `budget`; a LIST bigger
/// than the budget runs alone where `alone` allows it.
fn fits(in_flight: u64, bytes: u64, budget: u64, alone: bool) -> bool {
    in_flight.saturating_add(bytes) <= budget || (alone && in_flight == 0 && bytes > budget)
}

/// The byte budget over the real upstream pool (in a fleet: this Bulwark's share of each
/// replica's): counts through
/// [`Upstream::hold_list_bytes`] on the replica the balancer picks for them, and exports
/// `bulwark_list_bytes_in_flight` and `bulwark_list_bytes_budget`.
pub struct UpstreamBudget {
    upstream: Upstream,
    /// Makes check-then-add atomic among admission's reservations (levels dispatch
    /// concurrently); the counters themselves are atomics in the pool.
    lock: Mutex<()>,
    in_flight: HashMap<String, IntGauge>,
    /// This Bulwark's shares in its fleet; `None`: the static budget.
    fleet: Option<FleetShares>,
}

impl UpstreamBudget {
    /// Each replica's budget and each level's seats become this Bulwark's share in its
    /// fleet (the static ones until the fleet publishes shares).
    pub fn in_fleet(mut self, shares: FleetShares) -> Self {
        self.fleet = Some(shares);
        self
    }

    /// The in-flight LIST byte budget of `replica` now.
    fn budget_of(&self, replica: &str) -> u64 {
        self.fleet
            .as_ref()
            .and_then(|f| f.list_bytes(replica))
            .unwrap_or_else(|| self.upstream.byte_budget())
    }

    /// A budget over `upstream`'s replicas, each with `upstream.byte_budget()`.
    pub fn new(upstream: Upstream, metrics: &Metrics) -> Self {
        let mut in_flight = HashMap::new();
        for replica in upstream.snapshot() {
            metrics
                .list_bytes_budget
                .with_label_values(&[replica.name.as_str()])
                .set(i64::try_from(upstream.byte_budget()).unwrap_or(i64::MAX));
            let gauge = metrics
                .list_bytes_in_flight
                .with_label_values(&[replica.name.as_str()]);
            gauge.set(0);
            in_flight.insert(replica.name, gauge);
        }
        Self {
            upstream,
            lock: Mutex::new(()),
            in_flight,
            fleet: None,
        }
    }

    fn reserve(&self, bytes: u64, check: bool) -> Option<Reservation> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let held = self.upstream.hold_list_bytes(bytes, |replica, in_flight| {
            let alone = self.fleet.as_ref().is_none_or(|f| f.may_run_alone(replica));
            !check || fits(in_flight, bytes, self.budget_of(replica), alone)
        })?;
        let replica = held.replica().clone();
        let gauge = self.in_flight.get(&*replica).cloned();
        let as_i64 = i64::try_from(bytes).unwrap_or(i64::MAX);
        if let Some(gauge) = &gauge {
            gauge.add(as_i64);
        }
        Some(Reservation::new(replica, bytes, move || {
            drop(held);
            if let Some(gauge) = gauge {
                gauge.sub(as_i64);
            }
        }))
    }
}

impl ByteBudget for UpstreamBudget {
    fn budget(&self) -> u64 {
        self.upstream.byte_budget()
    }

    fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        self.reserve(bytes, true)
    }

    fn reserve_anyway(&self, bytes: u64) -> Option<Reservation> {
        self.reserve(bytes, false)
    }

    fn health(&self) -> (usize, usize) {
        (self.upstream.healthy_replicas(), self.upstream.replicas())
    }

    fn level_seats(&self, level: &str, configured: u32) -> u32 {
        self.fleet
            .as_ref()
            .and_then(|f| f.seats(level))
            .unwrap_or(configured)
    }

    fn rate_share(&self, flow: &str) -> Option<f64> {
        self.fleet.as_ref().and_then(|f| f.rate_share(flow))
    }
}

/// A byte budget kept in memory, for tests and benches: named replicas with one budget
/// each, and a settable number of healthy ones (the first `healthy` are healthy).
pub struct LocalBudget {
    budget: u64,
    replicas: Vec<(Arc<str>, Arc<AtomicU64>)>,
    healthy: AtomicUsize,
    lock: Mutex<()>,
}

impl LocalBudget {
    /// `replicas` replicas named `r0`, `r1`, ..., each with `budget` bytes, all healthy.
    pub fn new(replicas: usize, budget: u64) -> Self {
        Self {
            budget,
            replicas: (0..replicas.max(1))
                .map(|i| (Arc::from(format!("r{i}")), Arc::new(AtomicU64::new(0))))
                .collect(),
            healthy: AtomicUsize::new(replicas.max(1)),
            lock: Mutex::new(()),
        }
    }

    /// Marks the first `healthy` replicas healthy and the rest out.
    pub fn set_healthy(&self, healthy: usize) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    /// Bytes in flight on each replica, in order.
    pub fn in_flight(&self) -> Vec<u64> {
        self.replicas
            .iter()
            .map(|(_, b)| b.load(Ordering::Relaxed))
            .collect()
    }

    fn reserve(&self, bytes: u64, check: bool) -> Option<Reservation> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let healthy = self
            .healthy
            .load(Ordering::Relaxed)
            .min(self.replicas.len());
        let usable = if healthy == 0 {
            &self.replicas[..]
        } else {
            &self.replicas[..healthy]
        };
        let (name, counter) = usable
            .iter()
            .min_by_key(|(_, b)| b.load(Ordering::Relaxed))?;
        if check && !fits(counter.load(Ordering::Relaxed), bytes, self.budget, true) {
            return None;
        }
        counter.fetch_add(bytes, Ordering::Relaxed);
        let counter = counter.clone();
        Some(Reservation::new(name.clone(), bytes, move || {
            counter.fetch_sub(bytes, Ordering::Relaxed);
        }))
    }
}

impl ByteBudget for LocalBudget {
    fn budget(&self) -> u64 {
        self.budget
    }

    fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        self.reserve(bytes, true)
    }

    fn reserve_anyway(&self, bytes: u64) -> Option<Reservation> {
        self.reserve(bytes, false)
    }

    fn health(&self) -> (usize, usize) {
        (
            self.healthy
                .load(Ordering::Relaxed)
                .min(self.replicas.len()),
            self.replicas.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_admits_what_fits_and_one_oversized_list_alone() {
        let budget = LocalBudget::new(1, 100);
        let a = budget.try_reserve(60).expect("fits");
        assert!(budget.try_reserve(50).is_none(), "60 + 50 is over 100");
        let b = budget.try_reserve(40).expect("60 + 40 fits exactly");
        drop((a, b));
        let big = budget
            .try_reserve(500)
            .expect("an oversized LIST runs on an idle replica");
        assert!(
            budget.try_reserve(1).is_none(),
            "nothing joins an oversized LIST"
        );
        drop(big);
        assert_eq!(budget.in_flight(), vec![0]);
    }

    #[test]
    fn reservations_go_to_the_replica_with_the_most_room() {
        let budget = LocalBudget::new(3, 100);
        let held: Vec<_> = (0..3).map(|_| budget.try_reserve(50).unwrap()).collect();
        assert_eq!(budget.in_flight(), vec![50, 50, 50]);
        let names: std::collections::HashSet<_> = held.iter().map(|r| r.replica()).collect();
        assert_eq!(names.len(), 3);
    }
}
