//! Fault hooks of a replica (delay, injected status, mid-body reset, refused streams,
//! freeze) and its request statistics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Fault settings, read on every request; all take effect immediately.
#[derive(Debug)]
pub struct Faults {
    delay_us: AtomicU64,
    fail: AtomicU16,
    /// `u64::MAX` = off.
    reset_after: AtomicU64,
    refuse: AtomicBool,
    /// True while the replica answers nothing, like a stopped (SIGSTOP) process.
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults::new()
    }
}

impl Faults {
    /// No faults.
    pub fn new() -> Faults {
        Faults {
            delay_us: AtomicU64::new(0),
            fail: AtomicU16::new(0),
            reset_after: AtomicU64::new(u64::MAX),
            refuse: AtomicBool::new(false),
            frozen: tokio::sync::watch::Sender::new(false),
        }
    }
    /// Sets whether the replica is frozen: while it is, requests (probes included) and TLS
    /// handshakes wait, unanswered, and go on when it thaws, as a stopped process's would.
    pub fn set_frozen(&self, on: bool) {
        self.frozen.send_replace(on);
    }
    /// Waits while the replica is frozen.
    pub async fn thawed(&self) {
        let mut frozen = self.frozen.subscribe();
        // The sender lives as long as `self`; an error cannot happen while we borrow it.
        let _ = frozen.wait_for(|on| !on).await;
    }
    /// Sets the delay before every response head.
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(
            d.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }
    /// The delay before every response head.
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us.load(Ordering::Relaxed))
    }
    /// Sets the status every non-probe request gets.
    pub fn set_fail(&self, status: Option<u16>) {
        self.fail.store(status.unwrap_or(0), Ordering::Relaxed);
    }
    /// The status every non-probe request gets.
    pub fn fail(&self) -> Option<u16> {
        Some(self.fail.load(Ordering::Relaxed)).filter(|s| *s != 0)
    }
    /// Sets the body length after which streams are reset.
    pub fn set_reset_mid_body(&self, after: Option<u64>) {
        self.reset_after
            .store(after.unwrap_or(u64::MAX), Ordering::Relaxed);
    }
    /// The body length after which streams are reset.
    pub fn reset_mid_body(&self) -> Option<u64> {
        Some(self.reset_after.load(Ordering::Relaxed)).filter(|n| *n != u64::MAX)
    }
    /// Sets whether new streams are refused.
    pub fn set_refuse_streams(&self, on: bool) {
        self.refuse.store(on, Ordering::Relaxed);
    }
    /// Whether new streams are refused.
    pub fn refuse_streams(&self) -> bool {
        self.refuse.load(Ordering::Relaxed)
    }
}

/// A snapshot of one replica's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplicaStats {
    /// Requests received (probes excluded, refused streams included).
    pub requests: u64,
    /// Requests being served now (watches excluded).
    pub in_flight: u64,
    /// Highest `in_flight` seen.
    pub peak_in_flight: u64,
    /// Watches open now.
    pub open_watches: u64,
    /// Highest `open_watches` seen.
    pub peak_watches: u64,
    /// Modelled heap now.
    pub heap_bytes: u64,
    /// Highest modelled heap seen.
    pub peak_heap_bytes: u64,
    /// Times the replica ran out of memory.
    pub ooms: u64,
    /// Requests per authenticated (effective) user.
    pub requests_by_user: HashMap<String, u64>,
    /// The user of the last request.
    pub last_user: Option<String>,
    /// Headers of the last request as received (lower-case names, in order).
    pub last_headers_seen: Vec<(String, String)>,
}

/// The user and headers of the last request.
pub(crate) type LastRequest = (Option<String>, Vec<(String, String)>);

/// Live counters of one replica.
#[derive(Debug, Default)]
pub struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) peak_in_flight: AtomicU64,
    pub(crate) open_watches: AtomicU64,
    pub(crate) peak_watches: AtomicU64,
    pub(crate) ooms: AtomicU64,
    pub(crate) by_user: Mutex<HashMap<String, u64>>,
    pub(crate) last: Mutex<LastRequest>,
}

/// Which gauge a [`GaugeGuard`] holds.
#[derive(Clone, Copy, Debug)]
pub enum Gauge {
    /// Requests in flight.
    InFlight,
    /// Open watches.
    Watches,
}

/// Holds one unit of a gauge until dropped (attached to response bodies).
#[derive(Debug)]
pub struct GaugeGuard {
    counters: Arc<Counters>,
    which: Gauge,
}

impl Counters {
    fn gauge(&self, g: Gauge) -> (&AtomicU64, &AtomicU64) {
        match g {
            Gauge::InFlight => (&self.in_flight, &self.peak_in_flight),
            Gauge::Watches => (&self.open_watches, &self.peak_watches),
        }
    }

    /// Takes one unit of a gauge, recording the peak.
    pub fn enter(self: &Arc<Self>, which: Gauge) -> GaugeGuard {
        let (g, peak) = self.gauge(which);
        let now = g.fetch_add(1, Ordering::AcqRel) + 1;
        peak.fetch_max(now, Ordering::AcqRel);
        GaugeGuard {
            counters: self.clone(),
            which,
        }
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.counters
            .gauge(self.which)
            .0
            .fetch_sub(1, Ordering::AcqRel);
    }
}
