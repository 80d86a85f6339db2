//! The `upstream` section: the apiserver replicas and how Bulwark talks to them.

use std::path::PathBuf;
use std::time::Duration;

use http::HeaderName;
use rustls_pki_types::ServerName;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Quantity;
use super::problems::{Problems, defer};
use super::values::is_hostname_label;

/// The apiserver replicas (DESIGN.md steps 3 and 8).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Upstream {
    /// Each replica's address as `host:port`, addressed one by one, never a Service VIP.
    /// At least one, none twice.
    #[serde(deserialize_with = "replicas")]
    pub replicas: Vec<ReplicaAddr>,
    /// PEM file with the CA that signs the apiservers' serving certificates.
    #[serde(rename = "ca")]
    pub ca: PathBuf,
    /// Name to verify in the apiservers' certificates (default: each replica's host).
    #[serde(
        default,
        deserialize_with = "server_name",
        serialize_with = "server_name_text"
    )]
    pub server_name: Option<ServerName<'static>>,
    /// The front-proxy credential that carries users' requests.
    #[serde(default)]
    pub front_proxy: Option<FrontProxy>,
    /// Bulwark's own identity, for reviews, informers and probes.
    #[serde(rename = "self")]
    pub own: OwnCredential,
    /// Timeouts per verb class.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Concurrent streams Bulwark opens on one connection before opening another (the
    /// apiserver allows about 100).
    #[serde(default = "default_streams_per_connection")]
    pub streams_per_connection: u32,
    /// Heap headroom of one apiserver replica, in bytes or a quantity such as `8Gi`; the
    /// in-flight LIST byte budget is this ÷ 5 ÷ `bulwarkReplicas`.
    #[serde(default = "default_heap_headroom")]
    pub replica_heap_headroom: Quantity,
    /// How many Bulwark replicas share the apiservers.
    #[serde(default = "default_bulwark_replicas")]
    pub bulwark_replicas: u32,
    /// How often each replica's `/readyz` is probed. A probe that gets no answer within the
    /// interval (at least 1 s) ejects the replica as unresponsive, and the reads waiting on
    /// it go to other replicas.
    #[serde(default = "default_probe_interval", with = "humantime_serde")]
    pub probe_interval: Duration,
    /// First wait before an ejected replica is tried again; doubles up to `ejectMax`.
    #[serde(default = "default_eject_base", with = "humantime_serde")]
    pub eject_base: Duration,
    /// Longest wait before an ejected replica is tried again.
    #[serde(default = "default_eject_max", with = "humantime_serde")]
    pub eject_max: Duration,
    /// A response stream whose client has not read for this long is reset upstream, so that
    /// it cannot hold apiserver memory.
    #[serde(default = "default_stall_timeout", with = "humantime_serde")]
    pub stall_timeout: Duration,
}

fn default_streams_per_connection() -> u32 {
    100
}
fn default_heap_headroom() -> Quantity {
    Quantity(8 * 1024 * 1024 * 1024)
}
fn default_bulwark_replicas() -> u32 {
    1
}
fn default_probe_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_eject_base() -> Duration {
    Duration::from_secs(1)
}
fn default_eject_max() -> Duration {
    Duration::from_secs(60)
}
fn default_stall_timeout() -> Duration {
    Duration::from_secs(60)
}

/// The front-proxy client certificate and the request-header names the apiserver expects
/// (its `--requestheader-*` flags).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FrontProxy {
    /// PEM client certificate issued by the apiserver's request-header CA.
    pub cert: PathBuf,
    /// PEM private key of that certificate.
    pub key: PathBuf,
    /// Request-header names, matching the apiserver flags.
    #[serde(default)]
    pub headers: HeaderNames,
}

/// The names of the identity headers (`--requestheader-username-headers` and friends).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct HeaderNames {
    /// Header carrying the user name.
    #[serde(deserialize_with = "user_header", serialize_with = "header_text")]
    pub user: HeaderName,
    /// Header carrying the user's UID (apiserver `--requestheader-uid-headers`, v1.32+);
    /// empty to send none. Clients' own `X-Remote-*` headers are stripped whatever the names.
    #[serde(
        deserialize_with = "uid_header",
        serialize_with = "optional_header_text"
    )]
    pub uid: Option<HeaderName>,
    /// Header carrying each group, repeated.
    #[serde(deserialize_with = "group_header", serialize_with = "header_text")]
    pub group: HeaderName,
    /// Prefix of the headers carrying extra values; the key is percent-encoded after it.
    /// Read as a header name (lowercase, as HTTP/2 sends it).
    #[serde(deserialize_with = "extra_prefix", serialize_with = "header_text")]
    pub extra_prefix: HeaderName,
}

impl Default for HeaderNames {
    fn default() -> Self {
        Self {
            user: HeaderName::from_static("x-remote-user"),
            uid: Some(HeaderName::from_static("x-remote-uid")),
            group: HeaderName::from_static("x-remote-group"),
            extra_prefix: HeaderName::from_static("x-remote-extra-"),
        }
    }
}

/// Reads `upstream.frontProxy.headers.FIELD` as a header name; empty only where
/// `may_be_empty` (then `None`). A problem is set aside for validation, and the default
/// name stands in.
fn header_name<'de, D: Deserializer<'de>>(
    d: D,
    field: &str,
    may_be_empty: bool,
) -> Result<Option<HeaderName>, D::Error> {
    let text = String::deserialize(d)?;
    let field = format!("upstream.frontProxy.headers.{field}");
    if text.is_empty() {
        if !may_be_empty {
            defer(field, "must not be empty".into())?;
        }
        return Ok(None);
    }
    match HeaderName::from_bytes(text.as_bytes()) {
        Ok(name) => Ok(Some(name)),
        Err(_) => {
            defer(field, format!("{text:?} is not a valid HTTP header name"))?;
            Ok(None)
        }
    }
}

fn user_header<'de, D: Deserializer<'de>>(d: D) -> Result<HeaderName, D::Error> {
    Ok(header_name(d, "user", false)?.unwrap_or_else(|| HeaderNames::default().user))
}

fn uid_header<'de, D: Deserializer<'de>>(d: D) -> Result<Option<HeaderName>, D::Error> {
    header_name(d, "uid", true)
}

fn group_header<'de, D: Deserializer<'de>>(d: D) -> Result<HeaderName, D::Error> {
    Ok(header_name(d, "group", false)?.unwrap_or_else(|| HeaderNames::default().group))
}

fn extra_prefix<'de, D: Deserializer<'de>>(d: D) -> Result<HeaderName, D::Error> {
    Ok(
        header_name(d, "extraPrefix", false)?
            .unwrap_or_else(|| HeaderNames::default().extra_prefix),
    )
}

fn header_text<S: Serializer>(name: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(name.as_str())
}

fn optional_header_text<S: Serializer>(name: &Option<HeaderName>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(name.as_ref().map_or("", HeaderName::as_str))
}

/// Bulwark's own identity upstream: a client certificate or a bearer token file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct OwnCredential {
    /// PEM client certificate.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// File with a bearer token (a ServiceAccount token), re-read when it changes.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

/// Upstream timeouts per verb class. Long-running requests (watch, follow, upgrades) have
/// none.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Timeouts {
    /// TCP connect plus TLS handshake to a replica.
    #[serde(with = "humantime_serde")]
    pub connect: Duration,
    /// get, and everything not named below, until the response head arrives.
    #[serde(with = "humantime_serde")]
    pub read: Duration,
    /// list, until the response head arrives.
    #[serde(with = "humantime_serde")]
    pub list: Duration,
    /// create, update, patch, delete, deletecollection.
    #[serde(with = "humantime_serde")]
    pub write: Duration,
    /// One try of a get, a watch's start or another read that is not a list, on one
    /// replica, until its response head; then the read goes to another replica, within
    /// `read` in all. No healthy apiserver holds such a read longer: API Priority and
    /// Fairness queues a request for at most a quarter of its 60 s deadline, then answers
    /// 429 itself. Lists have no such limit: the apiserver sends a list's head only once it
    /// has read the whole result (a consistent list of a large collection from etcd can
    /// take tens of seconds), so a cut would start the same costly read on another replica
    /// and the list would fail anyway; a list leaves a replica that stopped answering when
    /// the probe ejects it. Writes are never sent twice, so none has an attempt limit.
    #[serde(with = "humantime_serde")]
    pub attempt: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            read: Duration::from_secs(60),
            list: Duration::from_secs(60),
            write: Duration::from_secs(60),
            attempt: Duration::from_secs(20),
        }
    }
}

impl Upstream {
    pub(super) fn validate(&self, p: &mut Problems) {
        let up = self;
        p.parsed("upstream.replicas");
        p.path("upstream.ca", &up.ca);
        p.parsed("upstream.serverName");
        if let Some(front_proxy) = &up.front_proxy {
            p.path("upstream.frontProxy.cert", &front_proxy.cert);
            p.path("upstream.frontProxy.key", &front_proxy.key);
            p.parsed("upstream.frontProxy.headers");
        }
        let own = &up.own;
        match (&own.cert, &own.key, &own.token_file) {
            (Some(cert), Some(key), None) => {
                p.path("upstream.self.cert", cert);
                p.path("upstream.self.key", key);
            }
            (None, None, Some(token_file)) => p.path("upstream.self.tokenFile", token_file),
            (None, None, None) => p.add(
                "upstream.self",
                "Bulwark's own credential is required: set cert and key, or tokenFile",
            ),
            (Some(_), Some(_), Some(_)) => p.add(
                "upstream.self",
                "set either cert and key, or tokenFile, not both",
            ),
            (Some(_), None, _) => p.add("upstream.self.key", "required with upstream.self.cert"),
            (None, Some(_), _) => p.add("upstream.self.cert", "required with upstream.self.key"),
        }
        let t = &up.timeouts;
        p.positive("upstream.timeouts.connect", t.connect);
        p.positive("upstream.timeouts.read", t.read);
        p.positive("upstream.timeouts.list", t.list);
        p.positive("upstream.timeouts.write", t.write);
        p.positive("upstream.timeouts.attempt", t.attempt);
        p.nonzero(
            "upstream.streamsPerConnection",
            up.streams_per_connection.into(),
        );
        p.nonzero("upstream.replicaHeapHeadroom", up.replica_heap_headroom.0);
        if up.bulwark_replicas < 1 {
            p.add("upstream.bulwarkReplicas", "must be at least 1");
        }
        p.positive("upstream.probeInterval", up.probe_interval);
        p.positive("upstream.ejectBase", up.eject_base);
        p.positive("upstream.ejectMax", up.eject_max);
        if up.eject_max < up.eject_base {
            p.add(
                "upstream.ejectMax",
                format!(
                    "{} is shorter than upstream.ejectBase ({})",
                    humantime::format_duration(up.eject_max),
                    humantime::format_duration(up.eject_base)
                ),
            );
        }
        p.positive("upstream.stallTimeout", up.stall_timeout);
    }
}

impl Upstream {
    /// The in-flight LIST byte budget of one apiserver replica for this Bulwark replica:
    /// heap headroom ÷ 5 (a LIST costs the apiserver about five times the bytes it reads)
    /// ÷ the number of Bulwark replicas sharing it.
    pub fn list_byte_budget(&self) -> u64 {
        self.replica_heap_headroom.0 / 5 / u64::from(self.bulwark_replicas.max(1))
    }
}

/// An apiserver replica's address: a hostname or IP address and a port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplicaAddr {
    /// Hostname (lowercase) or IP address, IPv6 without brackets.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl std::str::FromStr for ReplicaAddr {
    type Err = String;

    /// Parses `host:port`, `ip:port` or `[ipv6]:port`; the reason on failure says what is
    /// missing or wrong.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (host, port_text) = if let Some(rest) = text.strip_prefix('[') {
            let (ip, port) = rest
                .split_once("]:")
                .ok_or("a bracketed IPv6 address needs \"]:port\" after it")?;
            ip.parse::<std::net::Ipv6Addr>()
                .map_err(|_| format!("{ip:?} is not an IPv6 address"))?;
            (ip, port)
        } else {
            let (host, port) = text.rsplit_once(':').ok_or("the port is missing")?;
            if host.contains(':') {
                return Err("an IPv6 address needs brackets, as in [::1]:6443".into());
            }
            let looks_numeric = host
                .split('.')
                .all(|l| l.bytes().all(|b| b.is_ascii_digit()));
            let valid = if looks_numeric {
                host.parse::<std::net::Ipv4Addr>().is_ok()
            } else {
                host.len() <= 253 && host.split('.').all(is_hostname_label)
            };
            if !valid {
                return Err(format!("{host:?} is not a hostname or IP address"));
            }
            (host, port)
        };
        let port = match port_text.parse::<u16>() {
            // Refuses `+443` and `0443`, which `u16` parsing would accept.
            Ok(port) if port > 0 && port.to_string() == port_text => port,
            _ => return Err(format!("{port_text:?} is not a port from 1 to 65535")),
        };
        Ok(ReplicaAddr {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

impl Serialize for ReplicaAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Reads `upstream.replicas`: at least one, each a [`ReplicaAddr`], none twice; a problem
/// is set aside for validation and the entry left out.
fn replicas<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ReplicaAddr>, D::Error> {
    let texts = Vec::<String>::deserialize(d)?;
    if texts.is_empty() {
        defer(
            "upstream.replicas".into(),
            "at least one replica is required".into(),
        )?;
    }
    let mut seen: Vec<(ReplicaAddr, usize)> = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let field = format!("upstream.replicas[{i}]");
        match text.parse::<ReplicaAddr>() {
            Err(why) => defer(field, format!("{text:?} is not host:port ({why})"))?,
            Ok(addr) => match seen.iter().find(|(other, _)| *other == addr) {
                Some((_, first)) => defer(
                    field,
                    format!("{text:?} repeats upstream.replicas[{first}]"),
                )?,
                None => seen.push((addr, i)),
            },
        }
    }
    Ok(seen.into_iter().map(|(addr, _)| addr).collect())
}

/// Reads `upstream.serverName` as a TLS server name (a DNS name or an IP address).
fn server_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ServerName<'static>>, D::Error> {
    let Some(name) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    match ServerName::try_from(name.clone()) {
        Ok(parsed) => Ok(Some(parsed)),
        Err(_) => {
            defer(
                "upstream.serverName".into(),
                format!("{name:?} is not a DNS name or IP address"),
            )?;
            Ok(None)
        }
    }
}

fn server_name_text<S: Serializer>(
    name: &Option<ServerName<'static>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match name {
        Some(name) => s.serialize_some(&name.to_str()),
        None => s.serialize_none(),
    }
}

impl std::fmt::Display for ReplicaAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_addresses_need_a_host_and_a_port() {
        let ok = |s: &str| s.parse::<ReplicaAddr>().map(|a| a.to_string());
        assert_eq!(ok("apiserver-1:6443").as_deref(), Ok("apiserver-1:6443"));
        assert_eq!(
            ok("K8S.example.com:443").as_deref(),
            Ok("k8s.example.com:443")
        );
        assert_eq!(ok("192.168.1.10:6443").as_deref(), Ok("192.168.1.10:6443"));
        assert_eq!(
            ok("[2001:db8::1]:6443").as_deref(),
            Ok("[2001:db8::1]:6443")
        );
        for bad in [
            "apiserver-1",
            ":6443",
            "-a:6443",
            "a..b:6443",
            "a:06443",
            "a:65536",
            "[2001:db8::1]",
            "2001:db8::1:6443",
            "a b:6443",
        ] {
            assert!(bad.parse::<ReplicaAddr>().is_err(), "{bad} accepted");
        }
    }
}
