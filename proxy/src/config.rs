//! The configuration file of `bulwark serve`: its schema, parsing and validation.
//!
//! Parse (serde, unknown fields are errors) → validate (every problem, each naming its
//! field) → build (the other modules turn these plain values into running parts). No I/O
//! happens here except reading the file itself in [`Config::load`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Config {
    /// The client-facing TLS listener.
    pub listen: Listen,
    /// The admin listener: metrics, health and debug endpoints.
    #[serde(default)]
    pub admin: Admin,
    /// The kube-apiserver replicas and how Bulwark talks to them.
    pub upstream: Upstream,
    /// How clients are identified and how that identity is forwarded upstream.
    #[serde(default)]
    pub identity: Identity,
    /// Where the rule files live.
    #[serde(default)]
    pub rules: Rules,
    /// The watch-fed cache.
    #[serde(default)]
    pub cache: Cache,
    /// The audit log of reads answered by Bulwark itself.
    #[serde(default)]
    pub audit: Audit,
    /// The fleet of Bulwark replicas that share the apiservers' budgets through Leases;
    /// off when absent (each replica then takes a static `1/bulwarkReplicas`).
    #[serde(default)]
    pub fleet: Option<Fleet>,
    /// What the metrics may say of who is refused.
    #[serde(default)]
    pub metrics: MetricsSettings,
    /// One JSON line per request; off when absent.
    #[serde(default)]
    pub access_log: Option<AccessLog>,
}

/// The access log: one JSON line per request (who, what, the answer, the rule and level,
/// the refusal's reason, the `Audit-Id`), sampled or full, rotated by size like the audit
/// log.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AccessLog {
    /// File the lines are appended to. Required.
    pub path: PathBuf,
    /// Fraction (0 to 1) of answered requests logged; every refusal and every 5xx is
    /// logged whatever the fraction.
    #[serde(default = "one")]
    pub sample: f64,
    /// Bytes per file before it is rotated, as for `audit.maxSize`. At least 64Ki.
    #[serde(default = "default_log_size")]
    pub max_size: Quantity,
    /// Rotated files kept, as for `audit.maxFiles`. At least 1.
    #[serde(default = "default_log_files")]
    pub max_files: u32,
}

fn one() -> f64 {
    1.0
}
fn default_log_size() -> Quantity {
    Quantity(100 * 1024 * 1024)
}
fn default_log_files() -> u32 {
    5
}

/// What the metrics may say of who is refused.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MetricsSettings {
    /// How many identities `bulwark_identity_rejections_total` names: the ones refused most
    /// in the last minute, the rest counted as `other`. 0 (the default) counts nothing;
    /// at most 100, for a bounded number of series.
    #[serde(default)]
    pub identities: u32,
}

/// Membership of the fleet of Bulwark replicas through `coordination.k8s.io/v1` Leases:
/// each replica renews its own Lease with its recent demand, and the apiservers' LIST byte
/// budgets and the levels' seats are split among the live ones by that demand.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Fleet {
    /// Namespace of the Leases (Bulwark's own). Required.
    pub namespace: String,
    /// Every replica's Lease is named this prefix followed by its identity; the members
    /// are the unexpired Leases with the prefix.
    #[serde(default = "default_lease_prefix")]
    pub lease_prefix: String,
    /// This replica's identity in the fleet (a DNS label); default: the `POD_NAME`
    /// environment variable, else the host name.
    #[serde(default)]
    pub identity: Option<String>,
    /// How often the Lease is renewed and the others' read.
    #[serde(default = "default_renew_interval", with = "humantime_serde")]
    pub renew_interval: Duration,
    /// How long a Lease not renewed counts as a member (whole seconds, at least twice
    /// `renewInterval`): the time a stopped replica's share stays away.
    #[serde(default = "default_lease_duration", with = "humantime_serde")]
    pub lease_duration: Duration,
    /// File of the fleet's HMAC keys, one a line, each at least 32 bytes (mounted from a
    /// Secret only Bulwark's ServiceAccount may read): every Lease is signed with the
    /// first, and a Lease no key verifies does not count. Read at start and every renew
    /// period; list a new key second everywhere before moving it first. Default: none,
    /// and Leases are unauthenticated: anyone who may write Leases in the namespace can
    /// shrink the fleet's shares (deploy/README.md).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// With `keyFile`: sign this replica's Lease but also count Leases with no MAC (one with
    /// a wrong MAC is still rejected). Only for turning the key on: set it with `keyFile`,
    /// and once every replica runs with both, remove it; otherwise the replicas that have
    /// the key reject the Leases of those that do not yet, and take their shares. Default:
    /// false.
    #[serde(default)]
    pub accept_unsigned: bool,
    /// Publish the `kubernetes` Service's endpoints (`default/kubernetes` EndpointSlices and
    /// Endpoints), so that pods dialing the Service reach the apiservers through the live
    /// replicas, and the apiservers themselves when none is live (DESIGN.md "In-cluster
    /// clients"). Needs `keyFile` without `acceptUnsigned`: only a signed Lease may put an
    /// address behind the Service every pod dials. Default: not published.
    #[serde(default)]
    pub kubernetes_service: Option<KubernetesService>,
}

/// The `kubernetes` Service's endpoints as the fleet publishes them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubernetesService {
    /// The address pods dial for this replica: its pod or host IP and the port it listens
    /// on. Absent on `bulwark guard`, which publishes the others' and serves nothing.
    #[serde(default)]
    pub endpoint: Option<SocketAddr>,
    /// The apiservers' advertised addresses (`--advertise-address:--secure-port`):
    /// published as serving-but-terminating, which kube-proxy uses only while no replica is
    /// ready, so pods reach the apiservers directly when no Bulwark is live.
    pub apiservers: Vec<SocketAddr>,
    /// The Service's ClusterIP (`KUBERNETES_SERVICE_HOST`: the first address of the
    /// apiservers' `--service-cluster-ip-range`), which `check-config` wants in the serving
    /// certificate. Default: 10.96.0.1, kubeadm's.
    #[serde(default = "default_service_ip", rename = "serviceIP")]
    pub service_ip: std::net::IpAddr,
    /// The cluster's DNS domain, for the name `kubernetes.default.svc.DOMAIN`. Default:
    /// `cluster.local`.
    #[serde(default = "default_cluster_domain")]
    pub cluster_domain: String,
}

fn default_service_ip() -> std::net::IpAddr {
    std::net::Ipv4Addr::new(10, 96, 0, 1).into()
}

fn default_cluster_domain() -> String {
    "cluster.local".into()
}

fn default_lease_prefix() -> String {
    "bulwark-".into()
}
fn default_renew_interval() -> Duration {
    Duration::from_secs(2)
}
fn default_lease_duration() -> Duration {
    Duration::from_secs(10)
}

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
    /// Interval of HTTP/2 keepalive pings to clients; `0s` sends none.
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
            keepalive_interval: Duration::from_secs(30),
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

/// The admin listener (DESIGN.md step 10): plain HTTP on localhost by default; HTTPS with
/// `tls`, and `/metrics` for authorized scrapers only with `metricsAccess: authorized`, the
/// way Kubernetes components protect theirs.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Admin {
    /// Address to bind; localhost unless configured.
    pub address: SocketAddr,
    /// File holding the bearer token that `/debug/*` requires when the admin listener is not
    /// bound to localhost; with `metricsAccess: authorized` it opens `/metrics` too.
    pub token_file: Option<PathBuf>,
    /// Serve HTTPS with this certificate and key (re-read when they change).
    pub tls: Option<AdminTls>,
    /// Who may read `/metrics`.
    pub metrics_access: MetricsAccess,
    /// Connection caps and timeouts, the client listener's kind, smaller.
    pub limits: AdminLimits,
}

impl Default for Admin {
    fn default() -> Self {
        Self {
            address: SocketAddr::from(([127, 0, 0, 1], 9443)),
            token_file: None,
            tls: None,
            metrics_access: MetricsAccess::Anyone,
            limits: AdminLimits::default(),
        }
    }
}

/// The admin listener's connection caps and timeouts. Its connections live on the file
/// descriptors `listen.limits.reservedFileDescriptors` keeps back, so its total must fit in
/// a quarter of them: a flood of the admin port then cannot take what upstream connections
/// and certificate reloads need.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct AdminLimits {
    /// Admin connections open at once; past it a new one is reset as soon as it is
    /// accepted. Probes and scrapes need a handful.
    pub max_connections: usize,
    /// Admin connections open at once from one source address (an IPv6 source by its
    /// /64); `0` for no cap.
    pub max_connections_per_source: usize,
    /// Admin connections open at once from one /24 or /48; `0` for no cap. At least
    /// `maxConnectionsPerSource` when both are set.
    pub max_connections_per_prefix: usize,
    /// Time allowed, from the accept, for the first byte.
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// Time allowed, from the accept, for the TLS handshake (with `admin.tls`).
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Time allowed for a request head to arrive in full; a new connection must send its
    /// first request within it.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// A connection with no open request for this long is closed.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
}

impl Default for AdminLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            max_connections_per_source: 16,
            max_connections_per_prefix: 32,
            first_byte_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// The admin listener's serving certificate.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdminTls {
    /// PEM file with the certificate chain.
    pub cert: PathBuf,
    /// PEM file with its private key.
    pub key: PathBuf,
}

/// Who may read `/metrics` on the admin listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum MetricsAccess {
    /// Anyone who reaches the listener (bind it to localhost, or keep it behind a network
    /// policy).
    #[default]
    Anyone,
    /// A caller whose bearer token a TokenReview accepts and whom a SubjectAccessReview
    /// allows `get` on the non-resource URL `/metrics` (as `system:monitoring` is in a
    /// cluster), both made upstream with Bulwark's own identity, or the admin token
    /// (`admin.tokenFile`). Needs `tls`.
    Authorized,
}

/// The apiserver replicas (DESIGN.md steps 3 and 8).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Upstream {
    /// Each replica's address as `host:port`, addressed one by one, never a Service VIP.
    pub replicas: Vec<String>,
    /// PEM file with the CA that signs the apiservers' serving certificates.
    #[serde(rename = "ca")]
    pub ca: PathBuf,
    /// Name to verify in the apiservers' certificates (default: each replica's host).
    #[serde(default)]
    pub server_name: Option<String>,
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
    pub user: String,
    /// Header carrying the user's UID (apiserver `--requestheader-uid-headers`, v1.32+);
    /// empty to send none. Clients' own `X-Remote-*` headers are stripped whatever the names.
    pub uid: String,
    /// Header carrying each group, repeated.
    pub group: String,
    /// Prefix of the headers carrying extra values; the key is percent-encoded after it.
    pub extra_prefix: String,
}

impl Default for HeaderNames {
    fn default() -> Self {
        Self {
            user: "X-Remote-User".into(),
            uid: "X-Remote-Uid".into(),
            group: "X-Remote-Group".into(),
            extra_prefix: "X-Remote-Extra-".into(),
        }
    }
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

/// How clients are identified and how the identity goes upstream.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Identity {
    /// `front-proxy` (default), `impersonate` or `passthrough`.
    pub mode: IdentityMode,
    /// Paths forwarded without credentials on their own upstream connection.
    pub anonymous: Vec<String>,
    /// The TokenReview cache.
    pub token_review: TokenReview,
}

impl Default for Identity {
    fn default() -> Self {
        Self {
            mode: IdentityMode::FrontProxy,
            anonymous: [
                "/version",
                "/healthz",
                "/livez",
                "/readyz",
                "/.well-known/openid-configuration",
                "/openid/v1/jwks",
                "/api/v1/namespaces/kube-public/configmaps/cluster-info",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            token_review: TokenReview::default(),
        }
    }
}

/// How a client's identity is forwarded upstream (DESIGN.md step 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdentityMode {
    /// Front-proxy certificate plus `X-Remote-*` headers; needs no impersonation rights.
    FrontProxy,
    /// Bulwark's own identity plus `Impersonate-*` headers.
    Impersonate,
    /// The client's bearer token is sent unchanged.
    Passthrough,
}

/// The cache of TokenReview results, and the bounds on the reviews it makes.
///
/// A token in neither cache costs one upstream TokenReview before any rule applies, so
/// reviews are bounded on their own: per source prefix, overall (shared fairly between
/// prefixes), and in flight. An accepted token is re-reviewed in the background before its
/// `ttl` ends, with a budget of its own that unknown tokens cannot spend.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct TokenReview {
    /// How long an accepted token is trusted (capped by the token's own expiry). The
    /// apiserver's own cache of token checks keeps a result 10 s, so a revoked token stops
    /// working about as soon as it would without Bulwark.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long before `ttl` ends a request with the token starts its re-review in the
    /// background, so that a token in use never waits for one (at most half the `ttl`).
    #[serde(with = "humantime_serde")]
    pub refresh_ahead: Duration,
    /// The longest an accepted token is served since the review that last accepted it,
    /// while its re-reviews fail or cannot be made (never past the token's own expiry).
    /// A re-review that rejects the token ends it at once.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// How long a rejected token is remembered (a review that failed is not).
    #[serde(with = "humantime_serde")]
    pub failure_ttl: Duration,
    /// Most accepted tokens remembered.
    pub max_entries: usize,
    /// Most rejected tokens remembered, in a cache of their own so that a flood of bad
    /// tokens cannot push good ones out.
    pub max_rejected_entries: usize,
    /// Longest bearer token reviewed; a longer one gets 401 without a review.
    pub max_token_bytes: usize,
    /// Reviews of unknown tokens Bulwark makes for all clients together. Once the bucket
    /// is below half full, each client prefix gets a fair share of it: the rate divided
    /// among the prefixes active in the last second, and one more.
    pub rate: ReviewRate,
    /// Reviews of unknown tokens Bulwark makes for one client address (IPv6 by its /64).
    pub per_source: ReviewRate,
    /// Client addresses (and prefixes, for the fair share) whose review rate is remembered;
    /// the least recently seen beyond this start again with a full bucket.
    pub max_sources: usize,
    /// Re-reviews of accepted tokens, apart from `rate` and `perSource` so that unknown
    /// tokens cannot spend them.
    pub refresh_rate: ReviewRate,
    /// Reviews of unknown tokens in flight at once. 128: when Bulwark starts (or pods
    /// are first led through it), every pod's token is new, and at 32 in flight the
    /// `cluster` scenario's 2,000 pods on 1,000 nodes got thousands of 429s in the first
    /// seconds while the apiservers answered each review in tens of milliseconds.
    pub max_concurrent: usize,
    /// Re-reviews of accepted tokens in flight at once, apart from `maxConcurrent`.
    pub max_concurrent_refreshes: usize,
    /// How long a request waits for a review to start while `maxConcurrent` are in flight
    /// before it gets 429 (and a re-review waits while `maxConcurrentRefreshes` are).
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// A file where the client prefixes that had tokens accepted in the last day are kept
    /// (written every minute and at the drain, read at start), so that after a restart,
    /// when every token is new, they still get the larger share of reviews a flood of
    /// unknown prefixes cannot take. A file that does not read at start (too large to be
    /// one Bulwark wrote, not text) is a warning and ignored. `None`: remembered in memory
    /// only.
    pub memory_file: Option<PathBuf>,
}

impl Default for TokenReview {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            refresh_ahead: Duration::from_secs(3),
            max_age: Duration::from_secs(60),
            failure_ttl: Duration::from_secs(10),
            max_entries: 10_000,
            max_rejected_entries: 1_000,
            max_token_bytes: 16 * 1024,
            rate: ReviewRate {
                qps: 500.0,
                burst: 1_000,
            },
            per_source: ReviewRate {
                qps: 20.0,
                burst: 100,
            },
            max_sources: 10_000,
            refresh_rate: ReviewRate {
                qps: 500.0,
                burst: 1_000,
            },
            max_concurrent: 128,
            max_concurrent_refreshes: 8,
            max_wait: Duration::from_secs(1),
            memory_file: None,
        }
    }
}

/// A token bucket of TokenReviews.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReviewRate {
    /// Reviews per second, sustained.
    pub qps: f64,
    /// Reviews allowed at once on a full bucket.
    pub burst: u32,
}

/// Where the rule files live, and whether their limits refuse.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Rules {
    /// Folder of rule files; without it only the built-in levels apply.
    pub folder: Option<PathBuf>,
    /// `enforce` leaves each rule its own `mode`; `shadow` makes every rule, the built-in
    /// catch-all included, only count what its limits would refuse, whatever its `mode`.
    pub mode: RulesMode,
}

/// The rules' mode over every rule of the folder (`rules.mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RulesMode {
    /// Each rule's own `mode` holds (a rule is enforced unless it says `mode: shadow`).
    #[default]
    Enforce,
    /// Every rule is in shadow mode: nothing is refused by a rule's limits, every would-be
    /// refusal is counted in `bulwark_shadow_rejections_total`. For the first days of a
    /// rule set on a cluster.
    Shadow,
}

/// The watch-fed cache (DESIGN.md step 7).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Cache {
    /// Whether the cache runs at all.
    pub enabled: bool,
    /// Resources kept, as `resource` for the core group or `resource.group`.
    pub resources: Vec<String>,
    /// Namespaces never served from the cache.
    pub exclude_namespaces: Vec<String>,
    /// Objects never served from the cache, as `namespace/name` (or `name` for
    /// cluster-scoped objects); a list or watch that could include one goes upstream.
    pub exclude_names: Vec<String>,
    /// Events kept per resource for watches that resume.
    pub ring_size: usize,
    /// How long `/readyz` waits for the caches' first full lists before it reports ready
    /// anyway (cacheable requests go upstream until a cache is synced).
    #[serde(with = "humantime_serde")]
    pub sync_cap: Duration,
    /// The largest bounded staleness a rule may grant (a rule's `staleness` above it is
    /// capped to it).
    #[serde(with = "humantime_serde")]
    pub max_staleness: Duration,
    /// Bytes of encoded LIST responses kept for reuse (an LRU), as a number or a quantity.
    pub list_cache_bytes: Quantity,
    /// Events buffered per watcher; a watcher that falls this far behind is disconnected.
    pub watcher_buffer: usize,
    /// How often open watches served from the cache are authorized again (with jitter).
    #[serde(with = "humantime_serde")]
    pub reauthorize_interval: Duration,
    /// How long a SubjectAccessReview answer for a cache read is reused.
    #[serde(with = "humantime_serde")]
    pub access_review_ttl: Duration,
    /// How often a watch served from the cache that allows bookmarks gets one (the
    /// apiserver sends about one a minute).
    #[serde(with = "humantime_serde")]
    pub bookmark_interval: Duration,
    /// Whether the informers start (and relist) with a WatchList (`sendInitialEvents`),
    /// which spares the apiserver a LIST; an upstream that refuses it gets a paginated
    /// LIST instead.
    pub watch_list: bool,
}

impl Default for Cache {
    fn default() -> Self {
        Self {
            enabled: true,
            resources: vec![
                "secrets".into(),
                "endpoints".into(),
                "endpointslices.discovery.k8s.io".into(),
            ],
            exclude_namespaces: Vec::new(),
            exclude_names: Vec::new(),
            ring_size: 10_000,
            sync_cap: Duration::from_secs(60),
            max_staleness: Duration::from_secs(10),
            list_cache_bytes: Quantity(256 * 1024 * 1024),
            watcher_buffer: 1_000,
            reauthorize_interval: Duration::from_secs(300),
            access_review_ttl: Duration::from_secs(10),
            bookmark_interval: Duration::from_secs(60),
            watch_list: true,
        }
    }
}

/// The audit log.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Audit {
    /// File that audit events are appended to, as JSON lines.
    pub path: Option<PathBuf>,
    /// Bytes per file: the file is rotated (`path` → `path.1` …) before a line that would
    /// take it past this, so no line is split across files. At least 64Ki.
    pub max_size: Quantity,
    /// Rotated files kept beside `path` (`path.1` … `path.N`), the oldest deleted; the log
    /// takes at most `maxSize × (maxFiles + 1)` on disk. At least 1.
    pub max_files: u32,
}

impl Default for Audit {
    fn default() -> Self {
        Audit {
            path: None,
            // 600 MiB on disk at most: about 3 hours of 100 cached Secret reads a second
            // (600-byte lines) for the node's log agent to ship.
            max_size: Quantity(100 * 1024 * 1024),
            max_files: 5,
        }
    }
}

impl AccessLog {
    /// The bytes the log may take on disk: `maxSize × (maxFiles + 1)`.
    pub fn max_disk_bytes(&self) -> u64 {
        self.max_size
            .0
            .saturating_mul(u64::from(self.max_files) + 1)
    }
}

impl Audit {
    /// The bytes the log may take on disk: `maxSize × (maxFiles + 1)`.
    pub fn max_disk_bytes(&self) -> u64 {
        self.max_size
            .0
            .saturating_mul(u64::from(self.max_files) + 1)
    }
}

/// A byte count written as a plain number or a Kubernetes quantity (`512Mi`, `8Gi`, `2G`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Quantity(pub u64);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A visitor rather than an untagged enum: errors raised inside it carry the field's
        // path and line.
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Quantity;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte count such as 1048576 or 512Mi")
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Quantity, E> {
                Ok(Quantity(n))
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Quantity, E> {
                u64::try_from(n)
                    .map(Quantity)
                    .map_err(|_| E::custom(format!("{n} is negative; a byte count is 0 or more")))
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Quantity, E> {
                s.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl std::str::FromStr for Quantity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, suffix) = s.split_at(split);
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?} is not a byte quantity such as 512Mi"))?;
        let unit: u64 = match suffix {
            "" => 1,
            "k" | "K" => 1_000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            "T" => 1_000_000_000_000,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            _ => return Err(format!("{s:?} has an unknown unit {suffix:?}")),
        };
        n.checked_mul(unit)
            .map(Quantity)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

/// One problem found in a configuration file: the field it concerns and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Problem {
    /// Dotted path of the field as written in the file, e.g. `upstream.replicas[1]`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not valid YAML for this schema: a syntax error, an unknown or duplicate
    /// field, a missing required field or a value of the wrong type. The message names the
    /// field's dotted path and, when known, its line and column.
    #[error("{message}")]
    Parse {
        /// 1-based line of the problem, when known.
        line: Option<usize>,
        /// 1-based column of the problem, when known.
        column: Option<usize>,
        /// The parser's message, e.g. ``upstream.timeouts: unknown field `reed`, expected
        /// one of `connect`, `read`, `list`, `write` at line 12 column 5``.
        message: String,
    },
    /// The file parsed but its values have problems, each listed.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

impl Config {
    /// Reads, parses and validates a configuration file, then resolves every relative file
    /// path in it (certificates, keys, CA, token files, rules folder, audit log) against the
    /// file's own folder, so that a configuration works from any working directory. Whether
    /// those files exist is checked by the parts that load them.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config: Config = text.parse()?;
        if let Some(base) = path.parent() {
            config.resolve_paths(base);
        }
        Ok(config)
    }

    /// Makes every relative file path in the configuration relative to `base` instead.
    pub fn resolve_paths(&mut self, base: &Path) {
        let resolve = |path: &mut PathBuf| {
            if path.is_relative() {
                *path = base.join(&*path);
            }
        };
        resolve(&mut self.listen.cert);
        resolve(&mut self.listen.key);
        self.listen.client_ca.iter_mut().for_each(resolve);
        self.admin.token_file.iter_mut().for_each(resolve);
        resolve(&mut self.upstream.ca);
        if let Some(front_proxy) = &mut self.upstream.front_proxy {
            resolve(&mut front_proxy.cert);
            resolve(&mut front_proxy.key);
        }
        let own = &mut self.upstream.own;
        for path in [&mut own.cert, &mut own.key, &mut own.token_file] {
            path.iter_mut().for_each(resolve);
        }
        self.rules.folder.iter_mut().for_each(resolve);
        if let Some(fleet) = &mut self.fleet {
            fleet.key_file.iter_mut().for_each(resolve);
        }
        self.audit.path.iter_mut().for_each(resolve);
        self.identity
            .token_review
            .memory_file
            .iter_mut()
            .for_each(resolve);
        if let Some(tls) = &mut self.admin.tls {
            resolve(&mut tls.cert);
            resolve(&mut tls.key);
        }
        if let Some(access) = &mut self.access_log {
            resolve(&mut access.path);
        }
    }
}

fn validate_fleet(fleet: &Fleet, p: &mut Problems) {
    if !is_dns_label(&fleet.namespace) {
        p.add(
            "fleet.namespace",
            format!(
                "{:?} is not a namespace name (a DNS label)",
                fleet.namespace
            ),
        );
    }
    let prefix_ok = fleet.lease_prefix.len() < 63
        && fleet
            .lease_prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !fleet.lease_prefix.starts_with(['-', '.']);
    if !prefix_ok {
        p.add(
            "fleet.leasePrefix",
            format!(
                "{:?} must be lower-case letters, digits, '-' and '.', shorter than 63, not starting with '-' or '.'",
                fleet.lease_prefix
            ),
        );
    }
    if let Some(identity) = &fleet.identity
        && !is_dns_label(identity)
    {
        p.add("fleet.identity", format!("{identity:?} is not a DNS label"));
    }
    if let Some(key_file) = &fleet.key_file {
        p.path("fleet.keyFile", key_file);
    } else if fleet.accept_unsigned {
        p.add(
            "fleet.acceptUnsigned",
            "needs fleet.keyFile: without a key every Lease is unsigned",
        );
    }
    if let Some(service) = &fleet.kubernetes_service {
        if fleet.key_file.is_none() || fleet.accept_unsigned {
            p.add(
                "fleet.kubernetesService",
                "needs fleet.keyFile and no fleet.acceptUnsigned: an unsigned Lease could put \
                 any address behind the Service every pod dials",
            );
        }
        if service.apiservers.is_empty() {
            p.add(
                "fleet.kubernetesService.apiservers",
                "needs the apiservers' advertised addresses: without them no Bulwark live \
                 leaves pods no endpoint",
            );
        }
        if service.endpoint.is_some_and(|e| e.ip().is_unspecified()) {
            p.add(
                "fleet.kubernetesService.endpoint",
                "must be an address pods can dial, not 0.0.0.0 or ::",
            );
        }
    }
    p.positive("fleet.renewInterval", fleet.renew_interval);
    let duration = fleet.lease_duration;
    if duration.subsec_nanos() != 0 || duration.as_secs() == 0 || duration.as_secs() > 3600 {
        p.add(
            "fleet.leaseDuration",
            "must be whole seconds, from 1s to 1h (a Lease counts in seconds)",
        );
    } else if duration < fleet.renew_interval * 2 {
        p.add(
            "fleet.leaseDuration",
            format!(
                "{} is shorter than twice fleet.renewInterval ({}): one late renewal would drop the replica",
                humantime::format_duration(duration),
                humantime::format_duration(fleet.renew_interval)
            ),
        );
    }
}

impl std::str::FromStr for Config {
    type Err = ConfigError;

    /// Parses and validates configuration text; relative paths stay as written.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let config: Config = serde_norway::from_str(text).map_err(|e| {
            let location = e.location();
            ConfigError::Parse {
                line: location.as_ref().map(|l| l.line()),
                column: location.as_ref().map(|l| l.column()),
                message: e.to_string(),
            }
        })?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// Collects problems, each under its dotted field path.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            field: field.into(),
            message: message.into(),
        });
    }

    /// A duration that must be above zero.
    fn positive(&mut self, field: &str, value: Duration) {
        if value.is_zero() {
            self.add(field, "must be greater than 0");
        }
    }

    /// A count or size that must be above zero.
    fn nonzero(&mut self, field: &str, value: u64) {
        if value == 0 {
            self.add(field, "must be greater than 0");
        }
    }

    /// A per-prefix cap, which must hold at least one source's connections when both are
    /// capped (a prefix holds its sources).
    fn prefix_cap(&mut self, section: &str, per_source: usize, per_prefix: usize) {
        if per_source != 0 && per_prefix != 0 && per_prefix < per_source {
            self.add(
                format!("{section}.maxConnectionsPerPrefix"),
                format!(
                    "{per_prefix} is less than {section}.maxConnectionsPerSource ({per_source})"
                ),
            );
        }
    }

    /// A file or folder path that must not be empty.
    fn path(&mut self, field: &str, value: &Path) {
        if value.as_os_str().is_empty() {
            self.add(field, "must not be empty");
        }
    }
}

impl Config {
    /// Every semantic problem of a parsed configuration, each naming its field (empty when
    /// the configuration is valid).
    pub fn validate(&self) -> Vec<Problem> {
        let mut p = Problems::default();
        self.validate_listen(&mut p);
        self.validate_upstream(&mut p);
        self.validate_identity(&mut p);
        if let Some(folder) = &self.rules.folder {
            p.path("rules.folder", folder);
        }
        self.validate_cache(&mut p);
        if let Some(path) = &self.audit.path {
            p.path("audit.path", path);
        }
        if self.audit.max_size.0 < 64 * 1024 {
            p.add(
                "audit.maxSize",
                "must be at least 64Ki (each file holds whole lines)",
            );
        }
        if self.audit.max_files == 0 {
            p.add(
                "audit.maxFiles",
                "must be at least 1 (0 would delete the log at each rotation)",
            );
        }
        if let Some(fleet) = &self.fleet {
            validate_fleet(fleet, &mut p);
        }
        if let Some(access) = &self.access_log {
            p.path("accessLog.path", &access.path);
            if !(0.0..=1.0).contains(&access.sample) {
                p.add(
                    "accessLog.sample",
                    format!("{} is outside 0 to 1", access.sample),
                );
            }
            if access.max_size.0 < 64 * 1024 {
                p.add(
                    "accessLog.maxSize",
                    "must be at least 64Ki (each file holds whole lines)",
                );
            }
            if access.max_files == 0 {
                p.add(
                    "accessLog.maxFiles",
                    "must be at least 1 (0 would delete the log at each rotation)",
                );
            }
        }
        if self.metrics.identities > crate::board::MAX_IDENTITY_LABELS {
            p.add(
                "metrics.identities",
                format!(
                    "{} is more than {} (each name is a series of its own)",
                    self.metrics.identities,
                    crate::board::MAX_IDENTITY_LABELS
                ),
            );
        }
        // A non-local admin address without a token file is allowed: `/debug/*` is then
        // refused (see `Admin::debug_needs_token`), the rest still works.
        if let Some(token_file) = &self.admin.token_file {
            p.path("admin.tokenFile", token_file);
        }
        if let Some(tls) = &self.admin.tls {
            p.path("admin.tls.cert", &tls.cert);
            p.path("admin.tls.key", &tls.key);
        }
        self.validate_admin_limits(&mut p);
        if self.admin.metrics_access == MetricsAccess::Authorized && self.admin.tls.is_none() {
            p.add(
                "admin.metricsAccess",
                "authorized needs admin.tls: a bearer token must not cross the network in the clear"
                    .to_string(),
            );
        }
        p.0
    }

    fn validate_listen(&self, p: &mut Problems) {
        let listen = &self.listen;
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
        p.positive("listen.limits.keepaliveInterval", l.keepalive_interval);
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

    fn validate_admin_limits(&self, p: &mut Problems) {
        let l = &self.admin.limits;
        p.nonzero("admin.limits.maxConnections", l.max_connections as u64);
        let share = self.listen.limits.reserved_file_descriptors / 4;
        if l.max_connections > share {
            p.add(
                "admin.limits.maxConnections",
                format!(
                    "{} is more than {share}, a quarter of listen.limits.reservedFileDescriptors \
                     (admin connections use the reserve; the rest is for upstream connections, \
                     logs and reloads)",
                    l.max_connections
                ),
            );
        }
        p.prefix_cap(
            "admin.limits",
            l.max_connections_per_source,
            l.max_connections_per_prefix,
        );
        p.positive("admin.limits.firstByteTimeout", l.first_byte_timeout);
        p.positive("admin.limits.handshakeTimeout", l.handshake_timeout);
        p.positive("admin.limits.headerReadTimeout", l.header_read_timeout);
        p.positive("admin.limits.idleTimeout", l.idle_timeout);
    }

    fn validate_upstream(&self, p: &mut Problems) {
        let up = &self.upstream;
        if up.replicas.is_empty() {
            p.add("upstream.replicas", "at least one replica is required");
        }
        let mut seen: Vec<(ReplicaAddr, usize)> = Vec::new();
        for (i, replica) in up.replicas.iter().enumerate() {
            let field = format!("upstream.replicas[{i}]");
            match replica.parse::<ReplicaAddr>() {
                Err(why) => p.add(field, format!("{replica:?} is not host:port ({why})")),
                Ok(addr) => match seen.iter().find(|(other, _)| *other == addr) {
                    Some((_, first)) => p.add(
                        field,
                        format!("{replica:?} repeats upstream.replicas[{first}]"),
                    ),
                    None => seen.push((addr, i)),
                },
            }
        }
        p.path("upstream.ca", &up.ca);
        if let Some(name) = &up.server_name
            && rustls_pki_types::ServerName::try_from(name.as_str()).is_err()
        {
            p.add(
                "upstream.serverName",
                format!("{name:?} is not a DNS name or IP address"),
            );
        }
        if let Some(front_proxy) = &up.front_proxy {
            p.path("upstream.frontProxy.cert", &front_proxy.cert);
            p.path("upstream.frontProxy.key", &front_proxy.key);
            let h = &front_proxy.headers;
            for (field, value, may_be_empty) in [
                ("user", &h.user, false),
                ("uid", &h.uid, true),
                ("group", &h.group, false),
                ("extraPrefix", &h.extra_prefix, false),
            ] {
                let field = format!("upstream.frontProxy.headers.{field}");
                if value.is_empty() {
                    if !may_be_empty {
                        p.add(field, "must not be empty");
                    }
                } else if http::HeaderName::from_bytes(value.as_bytes()).is_err() {
                    p.add(field, format!("{value:?} is not a valid HTTP header name"));
                }
            }
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

    fn validate_identity(&self, p: &mut Problems) {
        let id = &self.identity;
        if id.mode == IdentityMode::FrontProxy && self.upstream.front_proxy.is_none() {
            p.add(
                "upstream.frontProxy",
                "required when identity.mode is front-proxy (the default)",
            );
        }
        for (i, path) in id.anonymous.iter().enumerate() {
            let field = format!("identity.anonymous[{i}]");
            if !path.starts_with('/') {
                p.add(field, format!("{path:?} must start with '/'"));
            } else if path.contains(['?', '#']) {
                p.add(
                    field,
                    format!("{path:?} must be a path without query or fragment"),
                );
            }
        }
        let tr = &id.token_review;
        p.positive("identity.tokenReview.ttl", tr.ttl);
        if tr.max_age < tr.ttl {
            p.add("identity.tokenReview.maxAge", "must be at least ttl");
        }
        p.positive("identity.tokenReview.failureTtl", tr.failure_ttl);
        p.nonzero("identity.tokenReview.maxEntries", tr.max_entries as u64);
        p.nonzero(
            "identity.tokenReview.maxRejectedEntries",
            tr.max_rejected_entries as u64,
        );
        p.nonzero(
            "identity.tokenReview.maxTokenBytes",
            tr.max_token_bytes as u64,
        );
        for (field, rate) in [
            ("identity.tokenReview.rate", tr.rate),
            ("identity.tokenReview.perSource", tr.per_source),
            ("identity.tokenReview.refreshRate", tr.refresh_rate),
        ] {
            if !(rate.qps.is_finite() && rate.qps > 0.0) {
                p.add(format!("{field}.qps"), "must be greater than 0");
            }
            p.nonzero(&format!("{field}.burst"), u64::from(rate.burst));
        }
        p.nonzero("identity.tokenReview.maxSources", tr.max_sources as u64);
        p.nonzero(
            "identity.tokenReview.maxConcurrent",
            tr.max_concurrent as u64,
        );
        p.nonzero(
            "identity.tokenReview.maxConcurrentRefreshes",
            tr.max_concurrent_refreshes as u64,
        );
        p.positive("identity.tokenReview.maxWait", tr.max_wait);
    }

    fn validate_cache(&self, p: &mut Problems) {
        let cache = &self.cache;
        for (i, resource) in cache.resources.iter().enumerate() {
            let field = format!("cache.resources[{i}]");
            if GroupResource::parse(resource).is_none() {
                p.add(
                    field,
                    format!(
                        "{resource:?} is not a resource name such as \"secrets\" or \"endpointslices.discovery.k8s.io\""
                    ),
                );
            } else if let Some(first) = cache.resources[..i].iter().position(|r| r == resource) {
                p.add(
                    field,
                    format!("{resource:?} repeats cache.resources[{first}]"),
                );
            }
        }
        for (i, namespace) in cache.exclude_namespaces.iter().enumerate() {
            if !is_dns_label(namespace) {
                p.add(
                    format!("cache.excludeNamespaces[{i}]"),
                    format!("{namespace:?} is not a namespace name"),
                );
            }
        }
        for (i, entry) in cache.exclude_names.iter().enumerate() {
            let valid = match entry.split_once('/') {
                Some((namespace, name)) => is_dns_label(namespace) && is_object_name(name),
                None => is_object_name(entry),
            };
            if !valid {
                p.add(
                    format!("cache.excludeNames[{i}]"),
                    format!("{entry:?} is not namespace/name or name"),
                );
            }
        }
        p.nonzero("cache.ringSize", cache.ring_size as u64);
        p.positive("cache.syncCap", cache.sync_cap);
        p.nonzero("cache.listCacheBytes", cache.list_cache_bytes.0);
        p.nonzero("cache.watcherBuffer", cache.watcher_buffer as u64);
        p.positive("cache.reauthorizeInterval", cache.reauthorize_interval);
        p.positive("cache.accessReviewTtl", cache.access_review_ttl);
        p.positive("cache.bookmarkInterval", cache.bookmark_interval);
    }
}

impl Upstream {
    /// The in-flight LIST byte budget of one apiserver replica for this Bulwark replica:
    /// heap headroom ÷ 5 (a LIST costs the apiserver about five times the bytes it reads)
    /// ÷ the number of Bulwark replicas sharing it.
    pub fn list_byte_budget(&self) -> u64 {
        self.replica_heap_headroom.0 / 5 / u64::from(self.bulwark_replicas.max(1))
    }

    /// The replicas' addresses, parsed. Invalid entries are skipped; [`Config::validate`]
    /// reports them.
    pub fn replica_addrs(&self) -> Vec<ReplicaAddr> {
        self.replicas
            .iter()
            .filter_map(|r| r.parse().ok())
            .collect()
    }
}

impl Timeouts {
    /// How long the upstream may take to send the response head of this request; `None`
    /// for long-running requests, which have no request timeout.
    pub fn for_request(&self, info: &crate::classify::RequestInfo) -> Option<Duration> {
        use crate::classify::Verb;
        if info.is_long_running() {
            return None;
        }
        Some(match &info.verb {
            Verb::List => self.list,
            Verb::Get | Verb::Watch => self.read,
            Verb::NonResource(method)
                if method == http::Method::GET || method == http::Method::HEAD =>
            {
                self.read
            }
            _ => self.write,
        })
    }

    /// The limit on one try of a request until its response head ([`Timeouts::attempt`]):
    /// resource reads that are not lists, watches' starts included; `None` for lists,
    /// writes, non-resource reads (`/openapi/v2`, discovery) and the long-running requests whose head waits on something other than the apiserver
    /// (a pod's proxy, `log?follow`, a profile).
    pub fn attempt_for(&self, info: &crate::classify::RequestInfo) -> Option<Duration> {
        use crate::classify::Verb;
        let head_from_apiserver = !info.is_long_running() || info.verb == Verb::Watch;
        // Non-resource reads (`/openapi/v2` of a cluster with many CRDs, discovery) can be
        // slow on every replica: sending them again would triple the work for a 504.
        (info.resource_request && info.is_read() && !info.is_list() && head_from_apiserver)
            .then_some(self.attempt)
    }
}

impl Admin {
    /// Whether `/debug/*` requires the bearer token: when the listener is not bound to a
    /// loopback address. Without a `tokenFile` such a listener refuses `/debug/*`.
    pub fn debug_needs_token(&self) -> bool {
        !self.address.ip().is_loopback()
    }
}

impl Cache {
    /// The configured resources as group and resource (entries that do not parse are
    /// skipped; [`Config::validate`] reports them).
    pub fn group_resources(&self) -> Vec<GroupResource> {
        self.resources
            .iter()
            .filter_map(|r| GroupResource::parse(r))
            .collect()
    }
}

/// A resource of an API group, e.g. `endpointslices` of `discovery.k8s.io`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupResource {
    /// The API group; `""` for the core group.
    pub group: String,
    /// The resource (plural, lowercase).
    pub resource: String,
}

impl GroupResource {
    /// Parses `resource` (core group) or `resource.group`.
    pub fn parse(text: &str) -> Option<GroupResource> {
        let (resource, group, group_ok) = match text.split_once('.') {
            Some((resource, group)) => (resource, group, group.split('.').all(is_dns_label)),
            None => (text, "", true),
        };
        (is_dns_label(resource) && group_ok && group.len() <= 253).then(|| GroupResource {
            group: group.to_owned(),
            resource: resource.to_owned(),
        })
    }
}

impl std::fmt::Display for GroupResource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() {
            f.write_str(&self.resource)
        } else {
            write!(f, "{}.{}", self.resource, self.group)
        }
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

impl std::fmt::Display for ReplicaAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A DNS-1123 label: 1 to 63 lowercase letters, digits or `-`, starting and ending with a
/// letter or digit (namespace names, resource names, group name labels).
fn is_dns_label(text: &str) -> bool {
    let bytes = text.as_bytes();
    (1..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

/// A hostname label: like a DNS label but in any case.
fn is_hostname_label(text: &str) -> bool {
    is_dns_label(&text.to_ascii_lowercase())
}

/// An object name that can appear in a path: non-empty, not `.` or `..`, no `/` or `%`
/// (the apiserver's `IsValidPathSegmentName`).
fn is_object_name(text: &str) -> bool {
    !text.is_empty() && text != "." && text != ".." && !text.contains(['/', '%'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_like_kubernetes_ones() {
        let q = |s: &str| s.parse::<Quantity>().map(|q| q.0);
        assert_eq!(q("512Mi"), Ok(512 << 20));
        assert_eq!(q("8Gi"), Ok(8 << 30));
        assert_eq!(q("2G"), Ok(2_000_000_000));
        assert_eq!(q("1000"), Ok(1000));
        assert!(q("1.5Gi").is_err());
        assert!(q("Gi").is_err());
        assert!(q("8GB").unwrap_err().contains("unknown unit"));
        assert!(q("99999999999Ti").unwrap_err().contains("too large"));
    }

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

    #[test]
    fn group_resources_are_a_label_and_an_optional_subdomain() {
        let gr = |s: &str| GroupResource::parse(s).map(|g| (g.group, g.resource));
        assert_eq!(gr("secrets"), Some(("".into(), "secrets".into())));
        assert_eq!(
            gr("leases.coordination.k8s.io"),
            Some(("coordination.k8s.io".into(), "leases".into()))
        );
        for bad in [
            "",
            "Secrets",
            "secrets.",
            ".secrets",
            "pods/status",
            "a..b",
            "-x",
        ] {
            assert_eq!(gr(bad), None, "{bad:?} accepted");
        }
    }
}
