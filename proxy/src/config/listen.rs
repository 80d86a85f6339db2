//! The `listen` section: the client-facing TLS listener, its limits and its drain.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Quantity;
use super::problems::Problems;

/// The most `listen.workers`: a thread each, and more threads than cores only add switches.
pub const MAX_WORKERS: usize = 1024;

/// The client-facing listener (DESIGN.md step 1).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Listen {
    /// Address to bind, e.g. `0.0.0.0:6443`.
    pub address: SocketAddr,
    /// PEM file with the serving certificate chain. Reloaded when it changes.
    pub cert: PathBuf,
    /// PEM file with the serving private key. Reloaded when it changes.
    pub key: PathBuf,
    /// PEM file with the CA(s) that sign client certificates. Without it, clients must use
    /// bearer tokens. Reloaded when it changes.
    #[serde(default, rename = "clientCA")]
    pub client_ca: Option<PathBuf>,
    /// Connection and protocol limits.
    #[serde(default)]
    pub limits: ListenLimits,
    /// Probability (0 to 0.02) that an HTTP/2 request is answered with GOAWAY afterwards, so
    /// that long-lived client connections spread over Bulwark replicas again. Like the
    /// apiserver's `--goaway-chance`; about 0.001 is a good value with several replicas.
    #[serde(default)]
    pub goaway_chance: f64,
    /// How a SIGTERM drains this listener.
    #[serde(default)]
    pub shutdown: Shutdown,
    /// The PROXY protocol (v1 and v2) from the load balancers in front; off when absent.
    #[serde(default)]
    pub proxy_protocol: Option<ProxyProtocol>,
    /// Threads that serve client connections, each on a single-threaded runtime with its
    /// own upstream connections; a connection goes to the one with the fewest open. Set it
    /// to the cores Bulwark may use (its CPU limit). 0 (the default) serves them on the
    /// process's main runtime, which `TOKIO_WORKER_THREADS` sizes.
    #[serde(default)]
    pub workers: usize,
}

/// Which peers may tell Bulwark the client's address with a PROXY protocol header, as
/// HAProxy's `send-proxy-v2`, nginx's `proxy_protocol on` and Envoy's upstream PROXY
/// protocol do. Any other peer that sends such a header is refused.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxyProtocol {
    /// Address ranges (`10.0.0.0/8`, `fd00::/8`, or one address) of the load balancers
    /// that may send the header. Required, at least one.
    pub trusted_sources: Vec<ipnet::IpNet>,
    /// Whether a trusted peer must send the header: `true` refuses a connection from one
    /// of them without it (a balancer misconfigured to send none would otherwise make every
    /// client look like the balancer); `false` takes such a connection as it comes.
    #[serde(default = "yes")]
    pub required: bool,
}

fn yes() -> bool {
    true
}

/// Explicit limits on client connections.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ListenLimits {
    /// Largest request head (request line and headers) in bytes; larger gets 431 or a reset.
    pub max_header_bytes: usize,
    /// Time allowed for a request head to arrive in full. For HTTP/1.1 it also bounds the
    /// wait for the next request on a kept-alive connection (hyper starts it whenever it
    /// begins reading a head), and a new connection of either protocol must send its first
    /// request within it.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Time allowed for the TLS handshake.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Concurrent HTTP/2 streams per client connection.
    pub max_concurrent_streams: u32,
    /// A connection with no open request or stream for this long is closed. A quiet watch
    /// keeps its connection.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Interval of HTTP/2 keepalive pings to clients; `0s` (the default) sends none: TCP
    /// keepalive and `TCP_USER_TIMEOUT` find a peer that vanished, as the apiserver's do.
    #[serde(with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// A client that does not answer a keepalive ping within this time is dropped.
    #[serde(with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// Largest request body in bytes (the apiserver's own limit is 3 MiB); larger gets 413.
    pub max_body_bytes: usize,
    /// Request bodies held in memory at once, all requests together. A body is read whole
    /// before it is sent upstream, so that a retry can send it again, and is held until
    /// the apiserver answers; a request whose body does not fit gets 429 at once.
    pub buffered_body_bytes: Quantity,
    /// Request bodies held in memory at once for one flow of the rules (`rule/user`,
    /// `rule/namespace` or `rule`), exempt or not, so that one flow cannot take the whole
    /// `bufferedBodyBytes`.
    pub buffered_body_bytes_per_flow: Quantity,
    /// A request body is read whole before its request is admitted (it holds bytes of the
    /// body budget while it arrives, never seats); one that sends nothing for this long
    /// gets 408.
    #[serde(with = "humantime_serde")]
    pub body_progress_timeout: Duration,
    /// Time allowed for a whole request body to arrive; past it the request gets 408.
    #[serde(with = "humantime_serde")]
    pub body_timeout: Duration,
    /// A response that holds seats or LIST bytes (anything but a started watch) and that
    /// the client has not read for this long (its HTTP/2 window stays shut, or its socket
    /// does not drain) gives them back and is cut off: a client that does not read cannot
    /// keep others out of its level.
    #[serde(with = "humantime_serde")]
    pub send_progress_timeout: Duration,
    /// How often the certificate, key and client CA files are re-read to catch a change
    /// that file-system notifications missed (notifications usually see it at once).
    #[serde(with = "humantime_serde")]
    pub file_check_interval: Duration,
    /// Client connections open at once, all sources together. Past it a new connection is
    /// closed as soon as it is accepted. Bulwark also never lets client connections take
    /// the file descriptors of `reservedFileDescriptors`, whatever this says.
    pub max_connections: usize,
    /// Client connections open at once from one source address (an IPv6 source by its
    /// /64); `0` for no per-source cap. The source is the PROXY protocol's client address
    /// where a trusted balancer sends one, else the peer's: behind a balancer that hides
    /// client addresses without the PROXY protocol, raise it or set it to 0.
    pub max_connections_per_source: usize,
    /// Client connections open at once from one /24 (IPv4) or /48 (IPv6), all its sources
    /// together, counted the way `maxConnectionsPerSource` is; `0` for no cap. At least
    /// `maxConnectionsPerSource` when both are set.
    pub max_connections_per_prefix: usize,
    /// File descriptors kept out of reach of client connections, for upstream
    /// connections, the admin listener (a quarter at most: `admin.limits.maxConnections`),
    /// the audit log and certificate reloads.
    pub reserved_file_descriptors: usize,
    /// Time allowed, from the accept, for a connection's first byte (its TLS ClientHello
    /// or PROXY header): a connection that sends nothing holds its place no longer. The
    /// handshake timeout, which also runs from the accept, bounds it too.
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// Time allowed, from the accept, for a trusted balancer's PROXY header to arrive in
    /// full. Until it has, the client it names is not known, so the connection is counted
    /// against no source. The first byte and handshake timeouts bound it too.
    #[serde(with = "humantime_serde")]
    pub proxy_header_timeout: Duration,
    /// A connection that has not authenticated a request (certificate or accepted token)
    /// within this time after it was accepted is closed: a client that only collects 401s
    /// holds no connection. Requests on the anonymous allowlist do not count. A connection
    /// whose token is still being reviewed, or could not be reviewed through no fault of its
    /// own (the review failed, or Bulwark's reviews in flight stayed at their bound), gets
    /// up to two more periods; one refused by a review bucket gets none.
    #[serde(with = "humantime_serde")]
    pub unauthenticated_timeout: Duration,
    /// A connection whose requests are refused this many times in a row for their
    /// credentials (401, or 429 because its own address's review bucket is empty) is closed.
    pub max_unauthenticated_requests: u32,
}

impl Default for ListenLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: 64 * 1024,
            header_read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            max_concurrent_streams: 250,
            idle_timeout: Duration::from_secs(90),
            keepalive_interval: Duration::ZERO,
            keepalive_timeout: Duration::from_secs(20),
            max_body_bytes: 3 * 1024 * 1024,
            buffered_body_bytes: Quantity(256 * 1024 * 1024),
            buffered_body_bytes_per_flow: Quantity(32 * 1024 * 1024),
            body_progress_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            send_progress_timeout: Duration::from_secs(10),
            file_check_interval: Duration::from_secs(30),
            max_connections: 20_000,
            max_connections_per_source: 1_000,
            max_connections_per_prefix: 8_000,
            reserved_file_descriptors: 1_024,
            first_byte_timeout: Duration::from_secs(5),
            proxy_header_timeout: Duration::from_secs(3),
            unauthenticated_timeout: Duration::from_secs(10),
            max_unauthenticated_requests: 16,
        }
    }
}

/// The SIGTERM sequence: fail `/readyz`, pause, GOAWAY, let requests finish, end watches.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Shutdown {
    /// How long `/readyz` fails before connections are told to go away, so that load
    /// balancers notice.
    #[serde(with = "humantime_serde")]
    pub pause: Duration,
    /// How long in-flight requests may take to finish after GOAWAY; watches end after it.
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            pause: Duration::from_secs(5),
            grace: Duration::from_secs(60),
        }
    }
}

impl Listen {
    pub(super) fn validate(&self, p: &mut Problems) {
        let listen = self;
        p.path("listen.cert", &listen.cert);
        p.path("listen.key", &listen.key);
        if let Some(ca) = &listen.client_ca {
            p.path("listen.clientCA", ca);
        }
        if !(0.0..=0.02).contains(&listen.goaway_chance) {
            p.add(
                "listen.goawayChance",
                format!("{} is outside 0 to 0.02", listen.goaway_chance),
            );
        }
        let l = &listen.limits;
        p.nonzero("listen.limits.maxHeaderBytes", l.max_header_bytes as u64);
        p.positive("listen.limits.headerReadTimeout", l.header_read_timeout);
        p.positive("listen.limits.handshakeTimeout", l.handshake_timeout);
        p.nonzero(
            "listen.limits.maxConcurrentStreams",
            l.max_concurrent_streams.into(),
        );
        p.positive("listen.limits.idleTimeout", l.idle_timeout);
        p.positive("listen.limits.keepaliveTimeout", l.keepalive_timeout);
        p.nonzero("listen.limits.maxBodyBytes", l.max_body_bytes as u64);
        if l.buffered_body_bytes_per_flow.0 < l.max_body_bytes as u64 {
            p.add(
                "listen.limits.bufferedBodyBytesPerFlow",
                "must be at least listen.limits.maxBodyBytes",
            );
        }
        if l.buffered_body_bytes.0 < l.buffered_body_bytes_per_flow.0 {
            p.add(
                "listen.limits.bufferedBodyBytes",
                "must be at least listen.limits.bufferedBodyBytesPerFlow",
            );
        }
        p.positive("listen.limits.bodyProgressTimeout", l.body_progress_timeout);
        p.positive("listen.limits.bodyTimeout", l.body_timeout);
        p.positive("listen.limits.sendProgressTimeout", l.send_progress_timeout);
        p.nonzero("listen.limits.maxConnections", l.max_connections as u64);
        p.prefix_cap(
            "listen.limits",
            l.max_connections_per_source,
            l.max_connections_per_prefix,
        );
        p.positive("listen.limits.firstByteTimeout", l.first_byte_timeout);
        p.positive("listen.limits.proxyHeaderTimeout", l.proxy_header_timeout);
        p.positive(
            "listen.limits.unauthenticatedTimeout",
            l.unauthenticated_timeout,
        );
        p.nonzero(
            "listen.limits.maxUnauthenticatedRequests",
            l.max_unauthenticated_requests.into(),
        );
        if let Some(pp) = &listen.proxy_protocol
            && pp.trusted_sources.is_empty()
        {
            p.add(
                "listen.proxyProtocol.trustedSources",
                "at least one address range is required",
            );
        }
        // A zero pause is a valid choice (no balancer to wait for); a zero grace is not.
        p.positive("listen.shutdown.grace", listen.shutdown.grace);
        if listen.workers > MAX_WORKERS {
            p.add(
                "listen.workers",
                format!(
                    "{} is more than {MAX_WORKERS}; give it the cores Bulwark may use",
                    listen.workers
                ),
            );
        }
    }
}
