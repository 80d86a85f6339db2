//! How many client connections may be open: in all, and from one source.
//!
//! Each open connection holds a file descriptor and an HTTP/2 connection's buffers. Without
//! a cap, idle connections from one host can take every descriptor, and then nothing works:
//! not new clients, not the admin listener, not a certificate reload, not the upstream
//! connections the admitted clients need. So the total is capped below the process's
//! descriptor limit with a reserve kept back, one source gets at most its own cap, and a
//! connection past a cap is closed (with a reset, so the client fails at once and tries
//! another replica) as soon as it is accepted.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::IntGauge;

use crate::config::ListenLimits;

/// The connection caps and the connections they count; cheap to clone.
#[derive(Debug, Clone)]
pub struct Connections(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    open: AtomicUsize,
    max: usize,
    per_source: usize,
    /// `bulwark_connections_open`, kept equal to `open`.
    gauge: IntGauge,
    /// Open connections per source; a source leaves the map with its last connection, so
    /// the map is never larger than the connections open.
    sources: Mutex<HashMap<IpAddr, usize>>,
}

/// Which cap refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    /// `maxConnections`, or the descriptors left after the reserve.
    Total,
    /// `maxConnectionsPerSource`.
    Source,
}

impl Full {
    /// The `reason` label of `bulwark_connections_refused_total`.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Full::Total => "max_connections",
            Full::Source => "max_connections_per_source",
        }
    }
}

impl Default for Connections {
    /// No caps: for listeners built without a configuration.
    fn default() -> Self {
        Connections::with_caps(usize::MAX, 0, unregistered())
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
        Connections::with_caps(max, limits.max_connections_per_source, gauge)
    }

    fn with_caps(max: usize, per_source: usize, gauge: IntGauge) -> Self {
        Connections(Arc::new(Inner {
            open: AtomicUsize::new(0),
            max,
            per_source,
            gauge,
            sources: Mutex::default(),
        }))
    }

    /// Client connections open right now (including those still in their handshake).
    pub fn open(&self) -> usize {
        self.0.open.load(Ordering::Relaxed)
    }

    /// The total cap in force.
    pub fn max(&self) -> usize {
        self.0.max
    }

    /// Counts one connection against the total until the guard drops, or says it is full.
    pub(super) fn admit(&self) -> Result<ConnectionGuard, Full> {
        let admitted = self
            .0
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.0.max).then_some(open + 1)
            });
        match admitted {
            Ok(_) => {
                self.0.gauge.inc();
                Ok(ConnectionGuard(self.0.clone()))
            }
            Err(_) => Err(Full::Total),
        }
    }

    /// Counts one connection from `source` until the guard drops, or says the source is
    /// full.
    pub(super) fn admit_source(&self, source: IpAddr) -> Result<SourceGuard, Full> {
        let key = source_key(source);
        if self.0.per_source == 0 {
            return Ok(SourceGuard(None));
        }
        let mut sources = self.0.sources.lock().expect("source counts");
        let open = sources.entry(key).or_default();
        if *open >= self.0.per_source {
            return Err(Full::Source);
        }
        *open += 1;
        Ok(SourceGuard(Some((self.0.clone(), key))))
    }

    /// Sources with an open connection (bounded by the connections open).
    #[cfg(test)]
    fn sources(&self) -> usize {
        self.0.sources.lock().expect("source counts").len()
    }
}

/// Holds one connection of the total.
#[derive(Debug)]
pub(super) struct ConnectionGuard(Arc<Inner>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.gauge.dec();
    }
}

/// Holds one connection of a source (nothing when there is no per-source cap).
#[derive(Debug)]
pub(super) struct SourceGuard(Option<(Arc<Inner>, IpAddr)>);

impl Drop for SourceGuard {
    fn drop(&mut self) {
        if let Some((inner, key)) = self.0.take() {
            let mut sources = inner.sources.lock().expect("source counts");
            if let Some(open) = sources.get_mut(&key) {
                *open -= 1;
                if *open == 0 {
                    sources.remove(&key);
                }
            }
        }
    }
}

/// A gauge no registry reads.
fn unregistered() -> IntGauge {
    IntGauge::new("bulwark_connections_open", "unregistered").expect("valid metric definition")
}

/// A source as it is counted: IPv4 (and IPv4-mapped IPv6) by address, IPv6 by its /64,
/// which one host commonly holds whole.
fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
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

    #[test]
    fn the_total_cap_refuses_past_it_and_frees_a_place_when_one_closes() {
        let caps = Connections::with_caps(2, 0, unregistered());
        let a = caps.admit().unwrap();
        let _b = caps.admit().unwrap();
        assert_eq!(caps.admit().unwrap_err(), Full::Total);
        assert_eq!(caps.open(), 2);
        drop(a);
        assert!(caps.admit().is_ok());
    }

    #[test]
    fn one_source_is_capped_without_touching_another() {
        let caps = Connections::with_caps(100, 2, unregistered());
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let first = caps.admit_source(a).unwrap();
        let _second = caps.admit_source(a).unwrap();
        assert_eq!(caps.admit_source(a).unwrap_err(), Full::Source);
        let _other = caps.admit_source(b).unwrap();
        drop(first);
        let _again = caps.admit_source(a).unwrap();
        assert_eq!(caps.sources(), 2);
    }

    #[test]
    fn ipv6_sources_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let caps = Connections::with_caps(100, 1, unregistered());
        let _one = caps
            .admit_source("2001:db8:1:2::1".parse().unwrap())
            .unwrap();
        let same_64 = caps.admit_source("2001:db8:1:2:ffff::9".parse().unwrap());
        assert_eq!(same_64.unwrap_err(), Full::Source);
        let _other_64 = caps
            .admit_source("2001:db8:1:3::1".parse().unwrap())
            .unwrap();
        let _v4 = caps.admit_source("192.0.2.9".parse().unwrap()).unwrap();
        let mapped = caps.admit_source("::ffff:192.0.2.9".parse().unwrap());
        assert_eq!(mapped.unwrap_err(), Full::Source);
    }

    #[test]
    fn closed_sources_leave_the_map() {
        let caps = Connections::with_caps(10_000, 5, unregistered());
        let guards: Vec<_> = (0..1000u32)
            .map(|i| caps.admit_source(IpAddr::from(i.to_be_bytes())).unwrap())
            .collect();
        assert_eq!(caps.sources(), 1000);
        drop(guards);
        assert_eq!(caps.sources(), 0);
    }

    #[test]
    fn the_reserve_comes_off_the_descriptor_limit() {
        assert_eq!(usable(1024, 256), 768);
        assert_eq!(usable(1024, 4096), 16);
        assert_eq!(usable(u64::MAX, 1024), usize::MAX - 1024);
    }
}
