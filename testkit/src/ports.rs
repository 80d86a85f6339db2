//! Ports for child processes that bind them themselves (etcd, kube-apiserver, Bulwark).
//!
//! A port the kernel picks with `bind(0)` comes from its ephemeral range, the range outgoing
//! connections take their local ports from: between the check and the child's own bind, any
//! connection on the machine can take it (CI saw etcd fail to bind its peer port so). These
//! ports come from below that range instead, where only listeners go, starting at a place of
//! this process's own so that test binaries and the tools they start rarely meet; each one
//! is bound once to check that it is free.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out; below it live well-known and registered services.
const LOWEST: u16 = 10_000;

/// The next candidate, as an offset from [`LOWEST`]; `u32::MAX` until first use.
static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);

/// A port on 127.0.0.1 that was free a moment ago and that no outgoing connection will take.
pub fn free_port() -> u16 {
    free_addr().port()
}

/// [`free_port`] as a socket address on 127.0.0.1.
pub fn free_addr() -> SocketAddr {
    let highest = ephemeral_start().saturating_sub(1);
    if highest <= LOWEST + 1_000 {
        // No room below the ephemeral range: take the kernel's pick.
        return kernel_pick();
    }
    let span = u32::from(highest - LOWEST);
    let start = (std::process::id().wrapping_mul(7_919) ^ clock_noise()) % span;
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = LOWEST + u16::try_from(offset).unwrap_or(0);
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if TcpListener::bind(addr).is_ok() {
            return addr;
        }
    }
    kernel_pick()
}

fn kernel_pick() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding a port on 127.0.0.1")
}

/// The first port of the kernel's ephemeral range (Linux's default when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn clock_noise() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_free_distinct_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for port in ports {
            assert!(port < ephemeral_start(), "{port} is in the ephemeral range");
            TcpListener::bind(("127.0.0.1", port)).expect("still free");
        }
    }
}
