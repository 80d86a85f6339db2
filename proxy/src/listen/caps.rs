//! How many client connections may be open: in all, and from one source.
//!
//! Each open connection holds a file descriptor and an HTTP/2 connection's buffers. Without
//! a cap, idle connections from one host can take every descriptor, and then nothing works:
//! not new clients, not the admin listener, not a certificate reload, not the upstream
//! connections the admitted clients need. So the total is capped below the process's
//! descriptor limit with a reserve kept back, one source gets at most its own cap, and a
//! connection past a cap is closed (with a reset, so the client fails at once and tries
//! another replica) as soon as it is accepted.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use prometheus::IntGauge;
use tokio::sync::Notify;

use super::ConnAuth;
use crate::config::ListenLimits;
use crate::net::{prefix_of, source_of};

/// The connection caps and the connections they count; cheap to clone.
#[derive(Debug, Clone)]
pub struct Connections(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    open: AtomicUsize,
    caps: Caps,
    /// `bulwark_connections_open` (or the admin listener's), kept equal to `open`.
    gauge: IntGauge,
    counts: Mutex<Counts>,
}

/// The caps of one listener.
#[derive(Debug, Clone, Copy)]
pub(super) struct Caps {
    /// Connections open at once, all sources together.
    pub(super) total: usize,
    /// From one source (`0`: no cap).
    pub(super) per_source: usize,
    /// From one /24 (IPv4) or /48 (IPv6) (`0`: no cap).
    pub(super) per_prefix: usize,
    /// Whether a connection past the total evicts the oldest one that has not
    /// authenticated instead of being refused.
    pub(super) evict: bool,
}

/// What the caps count, behind one lock taken once when a connection is admitted and once
/// when it ends (never per request).
#[derive(Debug, Default)]
struct Counts {
    /// Open connections per source; a source leaves the map with its last connection, so
    /// the map is never larger than the connections open.
    sources: HashMap<IpAddr, usize>,
    /// The same per /24 or /48.
    prefixes: HashMap<IpAddr, usize>,
    /// Connections that may be evicted, oldest first, by admission number. A connection
    /// leaves when it ends, or when an eviction looks at it and finds it authenticated, so
    /// the map is never larger than the connections open and each entry is looked at once.
    unproven: BTreeMap<u64, Arc<Slot>>,
    next: u64,
}

/// Which cap refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    /// `maxConnections`, or the descriptors left after the reserve.
    Total,
    /// `maxConnectionsPerSource`.
    Source,
    /// `maxConnectionsPerPrefix`.
    Prefix,
}

impl Full {
    /// The `reason` label of `bulwark_connections_refused_total`.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Full::Total => "max_connections",
            Full::Source => "max_connections_per_source",
            Full::Prefix => "max_connections_per_prefix",
        }
    }
}

impl Default for Connections {
    /// No caps: for listeners built without a configuration.
    fn default() -> Self {
        Connections::with_caps(
            Caps {
                total: usize::MAX,
                per_source: 0,
                per_prefix: 0,
                evict: false,
            },
            unregistered(),
        )
    }
}

impl Connections {
    /// The caps of `limits`, the total lowered to what the descriptor limit leaves after
    /// the reserve.
    pub(super) fn new(limits: &ListenLimits, gauge: IntGauge) -> Self {
        let descriptors = open_file_limit();
        let max = limits
            .max_connections
            .min(usable(descriptors, limits.reserved_file_descriptors));
        if max < limits.max_connections {
            tracing::warn!(
                configured = limits.max_connections,
                max,
                descriptors,
                reserved = limits.reserved_file_descriptors,
                "the open-file limit lowers listen.limits.maxConnections; raise the limit \
                 (ulimit -n) to serve more clients"
            );
        }
        Connections::with_caps(
            Caps {
                total: max,
                per_source: limits.max_connections_per_source,
                per_prefix: limits.max_connections_per_prefix,
                evict: true,
            },
            gauge,
        )
    }

    pub(super) fn with_caps(caps: Caps, gauge: IntGauge) -> Self {
        Connections(Arc::new(Inner {
            open: AtomicUsize::new(0),
            caps,
            gauge,
            counts: Mutex::default(),
        }))
    }

    /// Client connections open right now (including those still in their handshake).
    pub fn open(&self) -> usize {
        self.0.open.load(Ordering::Relaxed)
    }

    /// The total cap in force.
    pub fn max(&self) -> usize {
        self.0.caps.total
    }

    /// Counts a connection just accepted from `peer` against the total and, when `source`
    /// says so, against the peer's source and prefix caps (a trusted balancer's connections
    /// are counted by the client address its PROXY header names, later, with
    /// [`Connections::admit_source`]). At the total cap the oldest connection that has not
    /// authenticated is evicted to make room, where the caps say so; `evicted` tells.
    pub(super) fn admit(&self, peer: IpAddr, source: bool) -> Result<Admitted, Full> {
        let caps = &self.0.caps;
        let mut counts = self.0.counts.lock().expect("connection counts");
        let keys = source.then(|| keys(peer));
        if let Some(keys) = keys {
            counts.check(caps, keys)?;
        }
        let mut evicted = false;
        if self.0.open.load(Ordering::Acquire) < caps.total {
            self.0.open.fetch_add(1, Ordering::AcqRel);
            self.0.gauge.inc();
        } else if caps.evict && counts.evict_oldest() {
            // The evicted connection's slot passes to this one: the count stays.
            evicted = true;
        } else {
            return Err(Full::Total);
        }
        let source = keys.map(|keys| {
            counts.add(keys);
            SourceGuard(Some((self.0.clone(), keys)))
        });
        let slot = Arc::new(Slot::default());
        let id = counts.next;
        counts.next += 1;
        if caps.evict {
            counts.unproven.insert(id, slot.clone());
        }
        Ok(Admitted {
            guard: ConnectionGuard {
                inner: self.0.clone(),
                id,
                slot,
            },
            source: source.unwrap_or(SourceGuard(None)),
            evicted,
        })
    }

    /// Counts one connection from `source` until the guard drops, or says the source or
    /// its prefix is full.
    pub(super) fn admit_source(&self, source: IpAddr) -> Result<SourceGuard, Full> {
        let caps = &self.0.caps;
        if caps.per_source == 0 && caps.per_prefix == 0 {
            return Ok(SourceGuard(None));
        }
        let keys = keys(source);
        let mut counts = self.0.counts.lock().expect("connection counts");
        counts.check(caps, keys)?;
        counts.add(keys);
        Ok(SourceGuard(Some((self.0.clone(), keys))))
    }

    /// Sources with an open connection (bounded by the connections open).
    #[cfg(test)]
    fn sources(&self) -> usize {
        self.0
            .counts
            .lock()
            .expect("connection counts")
            .sources
            .len()
    }
}

impl Counts {
    fn check(&self, caps: &Caps, (source, prefix): (IpAddr, IpAddr)) -> Result<(), Full> {
        let at = |map: &HashMap<IpAddr, usize>, key| map.get(&key).copied().unwrap_or(0);
        if caps.per_source != 0 && at(&self.sources, source) >= caps.per_source {
            return Err(Full::Source);
        }
        if caps.per_prefix != 0 && at(&self.prefixes, prefix) >= caps.per_prefix {
            return Err(Full::Prefix);
        }
        Ok(())
    }

    fn add(&mut self, (source, prefix): (IpAddr, IpAddr)) {
        *self.sources.entry(source).or_default() += 1;
        *self.prefixes.entry(prefix).or_default() += 1;
    }

    fn remove(&mut self, (source, prefix): (IpAddr, IpAddr)) {
        for (map, key) in [(&mut self.sources, source), (&mut self.prefixes, prefix)] {
            if let Some(open) = map.get_mut(&key) {
                *open -= 1;
                if *open == 0 {
                    map.remove(&key);
                }
            }
        }
    }

    /// Tells the oldest connection that has not authenticated to close, and takes its
    /// slot; `false` when every open connection has authenticated.
    fn evict_oldest(&mut self) -> bool {
        while let Some((_, slot)) = self.unproven.pop_first() {
            if slot.auth.get().is_some_and(|auth| auth.authenticated()) {
                continue;
            }
            slot.moved.store(true, Ordering::Release);
            slot.evict.notify_one();
            return true;
        }
        false
    }
}

/// A connection admitted by [`Connections::admit`].
#[derive(Debug)]
pub(super) struct Admitted {
    /// Its place in the total.
    pub(super) guard: ConnectionGuard,
    /// Its place in its source's and prefix's caps, when counted at accept.
    pub(super) source: SourceGuard,
    /// Whether another connection was evicted to make room for it.
    pub(super) evicted: bool,
}

/// What an eviction needs of one connection.
#[derive(Debug, Default)]
struct Slot {
    /// Notified when the connection is evicted (a permit is kept if nobody waits yet).
    evict: Notify,
    /// Whether its requests authenticate, once it is past its handshake.
    auth: OnceLock<Arc<ConnAuth>>,
    /// Whether its place in the total passed to the connection that evicted it.
    moved: AtomicBool,
}

/// Holds one connection of the total.
#[derive(Debug)]
pub(super) struct ConnectionGuard {
    inner: Arc<Inner>,
    id: u64,
    slot: Arc<Slot>,
}

impl ConnectionGuard {
    /// From now on the connection counts as authenticated once `auth` says so, and is no
    /// longer evicted then.
    pub(super) fn watch(&self, auth: &Arc<ConnAuth>) {
        let _ = self.slot.auth.set(auth.clone());
    }

    /// Resolves when the connection is evicted.
    pub(super) async fn evicted(&self) {
        self.slot.evict.notified().await;
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        if self.inner.caps.evict {
            // Under the lock, so that an eviction either took this slot already or never
            // will.
            let mut counts = self.inner.counts.lock().expect("connection counts");
            counts.unproven.remove(&self.id);
            if self.slot.moved.load(Ordering::Acquire) {
                return;
            }
            self.inner.open.fetch_sub(1, Ordering::AcqRel);
            self.inner.gauge.dec();
        } else {
            self.inner.open.fetch_sub(1, Ordering::AcqRel);
            self.inner.gauge.dec();
        }
    }
}

/// Holds one connection of a source and its prefix (nothing when not counted).
#[derive(Debug)]
pub(super) struct SourceGuard(Option<(Arc<Inner>, (IpAddr, IpAddr))>);

impl Drop for SourceGuard {
    fn drop(&mut self) {
        if let Some((inner, keys)) = self.0.take() {
            inner.counts.lock().expect("connection counts").remove(keys);
        }
    }
}

/// A gauge no registry reads.
fn unregistered() -> IntGauge {
    IntGauge::new("bulwark_connections_open", "unregistered").expect("valid metric definition")
}

/// A connection's source and prefix, as the caps count them.
fn keys(ip: IpAddr) -> (IpAddr, IpAddr) {
    (source_of(ip), prefix_of(ip))
}

/// Descriptors client connections may use: the limit less the reserve, and never fewer
/// than a handful, so that a tiny limit still serves someone.
fn usable(descriptors: u64, reserved: usize) -> usize {
    let left = usize::try_from(descriptors)
        .unwrap_or(usize::MAX)
        .saturating_sub(reserved);
    left.max(16)
}

/// The process's soft open-file limit (`u64::MAX` when unlimited).
fn open_file_limit() -> u64 {
    #[cfg(unix)]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX)
    }
    #[cfg(not(unix))]
    {
        u64::MAX
    }
}

/// Raises the process's soft open-file limit to its hard limit, as the Go runtime does for
/// the apiserver: the default soft limit of 1,024 is far below what a front door needs.
/// Returns the soft limit in force afterwards.
pub fn raise_open_file_limit() -> u64 {
    #[cfg(unix)]
    {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let limit = getrlimit(Resource::Nofile);
        if limit.current != limit.maximum {
            let raised = Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            };
            if let Err(error) = setrlimit(Resource::Nofile, raised) {
                tracing::warn!(%error, "cannot raise the open-file limit");
            }
        }
    }
    open_file_limit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(total: usize, per_source: usize, per_prefix: usize, evict: bool) -> Connections {
        Connections::with_caps(
            Caps {
                total,
                per_source,
                per_prefix,
                evict,
            },
            unregistered(),
        )
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_total_cap_refuses_past_it_and_frees_a_place_when_one_closes() {
        let caps = caps(2, 0, 0, false);
        let a = caps.admit(ip("192.0.2.1"), true).unwrap();
        let _b = caps.admit(ip("192.0.2.2"), true).unwrap();
        assert_eq!(caps.admit(ip("192.0.2.3"), true).unwrap_err(), Full::Total);
        assert_eq!(caps.open(), 2);
        drop(a);
        assert!(caps.admit(ip("192.0.2.3"), true).is_ok());
    }

    #[test]
    fn one_source_is_capped_without_touching_another() {
        let caps = caps(100, 2, 0, false);
        let a = ip("192.0.2.1");
        let b = ip("192.0.2.2");
        let first = caps.admit_source(a).unwrap();
        let _second = caps.admit_source(a).unwrap();
        assert_eq!(caps.admit_source(a).unwrap_err(), Full::Source);
        let _other = caps.admit_source(b).unwrap();
        drop(first);
        let _again = caps.admit_source(a).unwrap();
        assert_eq!(caps.sources(), 2);
    }

    #[test]
    fn a_source_is_counted_at_accept_unless_its_header_will_name_the_client() {
        let caps = caps(100, 2, 0, false);
        let peer = ip("192.0.2.1");
        let _a = caps.admit(peer, true).unwrap();
        let _b = caps.admit(peer, true).unwrap();
        assert_eq!(caps.admit(peer, true).unwrap_err(), Full::Source);
        // A trusted balancer is not one source: each of its clients is, later.
        let balancer = ip("10.0.0.1");
        let held: Vec<_> = (0..10)
            .map(|_| caps.admit(balancer, false).unwrap())
            .collect();
        assert_eq!(held.len(), 10);
    }

    #[test]
    fn a_prefix_is_capped_beside_its_sources() {
        let caps = caps(100, 2, 3, false);
        let _a = caps.admit(ip("198.51.100.1"), true).unwrap();
        let _b = caps.admit(ip("198.51.100.2"), true).unwrap();
        let _c = caps.admit(ip("198.51.100.3"), true).unwrap();
        let same_24 = caps.admit(ip("198.51.100.4"), true);
        assert_eq!(same_24.unwrap_err(), Full::Prefix);
        let _other_24 = caps.admit(ip("198.51.101.4"), true).unwrap();
        let _v6 = caps.admit_source(ip("2001:db8:1:1::1")).unwrap();
        let _v6 = caps.admit_source(ip("2001:db8:1:2::1")).unwrap();
        let _v6 = caps.admit_source(ip("2001:db8:1:3::1")).unwrap();
        let same_48 = caps.admit_source(ip("2001:db8:1:4::1"));
        assert_eq!(same_48.unwrap_err(), Full::Prefix);
        let _other_48 = caps.admit_source(ip("2001:db8:2::1")).unwrap();
    }

    #[test]
    fn ipv6_sources_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let caps = caps(100, 1, 0, false);
        let _one = caps.admit_source(ip("2001:db8:1:2::1")).unwrap();
        let same_64 = caps.admit_source(ip("2001:db8:1:2:ffff::9"));
        assert_eq!(same_64.unwrap_err(), Full::Source);
        let _other_64 = caps.admit_source(ip("2001:db8:1:3::1")).unwrap();
        let _v4 = caps.admit_source(ip("192.0.2.9")).unwrap();
        let mapped = caps.admit_source(ip("::ffff:192.0.2.9"));
        assert_eq!(mapped.unwrap_err(), Full::Source);
    }

    #[test]
    fn closed_sources_leave_the_map() {
        let caps = caps(10_000, 5, 256, false);
        let guards: Vec<_> = (0..1000u32)
            .map(|i| caps.admit_source(IpAddr::from(i.to_be_bytes())).unwrap())
            .collect();
        assert_eq!(caps.sources(), 1000);
        drop(guards);
        assert_eq!(caps.sources(), 0);
        let counts = caps.0.counts.lock().unwrap();
        assert!(counts.prefixes.is_empty());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn at_the_total_the_oldest_unauthenticated_connection_is_evicted() {
        let caps = caps(3, 0, 0, true);
        let peer = ip("192.0.2.1");
        let first = caps.admit(peer, true).unwrap();
        let second = caps.admit(peer, true).unwrap();
        let third = caps.admit(peer, true).unwrap();
        // The first has authenticated a request: it is not the one to go.
        let auth = Arc::new(ConnAuth::new(1));
        first.guard.watch(&auth);
        auth.accepted();
        let fourth = caps.admit(peer, true).unwrap();
        assert!(fourth.evicted);
        assert_eq!(caps.open(), 3, "the evicted connection's slot passed on");
        tokio::time::timeout(std::time::Duration::from_secs(1), second.guard.evicted())
            .await
            .expect("the oldest unauthenticated connection is told to close");
        drop(second);
        assert_eq!(caps.open(), 3);
        let fifth = caps.admit(peer, true).unwrap();
        assert!(fifth.evicted, "then the next oldest");
        drop((third, fifth, fourth));
        assert_eq!(caps.open(), 1);
        // Every connection open has authenticated: nothing to evict, the new one is refused.
        let rest: Vec<_> = (0..2).map(|_| caps.admit(peer, true).unwrap()).collect();
        for admitted in &rest {
            admitted.guard.watch(&auth);
        }
        assert_eq!(caps.admit(peer, true).unwrap_err(), Full::Total);
        assert_eq!(caps.open(), 3);
        drop(first);
        assert_eq!(caps.open(), 2);
    }

    #[test]
    fn the_reserve_comes_off_the_descriptor_limit() {
        assert_eq!(usable(1024, 256), 768);
        assert_eq!(usable(1024, 4096), 16);
        assert_eq!(usable(u64::MAX, 1024), usize::MAX - 1024);
    }
}
