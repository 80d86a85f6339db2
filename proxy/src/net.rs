//! Client addresses as Bulwark keys its per-client bounds: a source (one host) and a
//! prefix (one network). Connection caps, token-review buckets, the access log's bound and
//! the admin's scrape bound all key by these, so that one client is one key everywhere.

use std::net::IpAddr;

/// A client address as one source: IPv4 (and IPv4-mapped IPv6) by address, IPv6 by its
/// /64, which one host commonly holds whole.
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !(u128::MAX >> 64)).into()),
        v4 => v4,
    }
}

/// A client address's prefix: the /24 (IPv4, and IPv4-mapped IPv6) or /48 (IPv6) around
/// it, which one network commonly holds whole.
pub fn prefix_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !(u128::MAX >> 48)).into()),
        IpAddr::V4(v4) => IpAddr::V4((u32::from(v4) & !0xff).into()),
    }
}
