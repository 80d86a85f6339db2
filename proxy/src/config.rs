//! The configuration file of `bulwark serve`: its schema, parsing and validation.
//!
//! Parse (serde, unknown fields are errors) → validate (every problem, each naming its
//! field) → build (the other modules turn these plain values into running parts). No I/O
//! happens here except reading the file itself in [`Config::load`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
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
}

/// The client-facing listener (DESIGN.md step 1).
#[derive(Debug, Clone, Deserialize)]
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
}

/// Explicit limits on client connections.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct ListenLimits {
    /// Largest request head (request line and headers) in bytes; larger gets 431 or a reset.
    pub max_header_bytes: usize,
    /// Time allowed for a request head to arrive in full.
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
    /// Interval of HTTP/2 keepalive pings to clients.
    #[serde(with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// A client that does not answer a keepalive ping within this time is dropped.
    #[serde(with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// Largest request body in bytes (the apiserver's own limit is 3 MiB).
    pub max_body_bytes: usize,
    /// How often the certificate, key and client CA files are re-read to catch a change
    /// that file-system notifications missed (notifications usually see it at once).
    #[serde(with = "humantime_serde")]
    pub file_check_interval: Duration,
}

impl Default for ListenLimits {
    fn default() -> Self {
        Self {
            max_header_bytes: 64 * 1024,
            header_read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            max_concurrent_streams: 250,
            idle_timeout: Duration::from_secs(600),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            max_body_bytes: 3 * 1024 * 1024,
            file_check_interval: Duration::from_secs(30),
        }
    }
}

/// The SIGTERM sequence: fail `/readyz`, pause, GOAWAY, let requests finish, end watches.
#[derive(Debug, Clone, Deserialize)]
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

/// The admin listener (DESIGN.md step 10). Plain HTTP.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Admin {
    /// Address to bind; localhost unless configured.
    pub address: SocketAddr,
    /// File holding the bearer token that `/debug/*` requires when the admin listener is not
    /// bound to localhost.
    pub token_file: Option<PathBuf>,
}

impl Default for Admin {
    fn default() -> Self {
        Self {
            address: SocketAddr::from(([127, 0, 0, 1], 9443)),
            token_file: None,
        }
    }
}

/// The apiserver replicas (DESIGN.md steps 3 and 8).
#[derive(Debug, Clone, Deserialize)]
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
    /// How often each replica's `/readyz` is probed.
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
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct HeaderNames {
    /// Header carrying the user name.
    pub user: String,
    /// Header carrying the user's UID (apiserver `--requestheader-uid-headers`, v1.32+);
    /// empty to send none.
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
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Deserialize)]
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
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            read: Duration::from_secs(60),
            list: Duration::from_secs(60),
            write: Duration::from_secs(60),
        }
    }
}

/// How clients are identified and how the identity goes upstream.
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdentityMode {
    /// Front-proxy certificate plus `X-Remote-*` headers; needs no impersonation rights.
    FrontProxy,
    /// Bulwark's own identity plus `Impersonate-*` headers.
    Impersonate,
    /// The client's bearer token is sent unchanged.
    Passthrough,
}

/// The cache of TokenReview results.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct TokenReview {
    /// How long an accepted token is trusted (capped by the token's own expiry).
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long a rejected token or a failed review is remembered.
    #[serde(with = "humantime_serde")]
    pub failure_ttl: Duration,
    /// Most tokens remembered.
    pub max_entries: usize,
}

impl Default for TokenReview {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            failure_ttl: Duration::from_secs(10),
            max_entries: 10_000,
        }
    }
}

/// Where the rule files live.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Rules {
    /// Folder of rule files; without it only the built-in levels apply.
    pub folder: Option<PathBuf>,
}

/// The watch-fed cache (DESIGN.md step 7).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Cache {
    /// Whether the cache runs at all.
    pub enabled: bool,
    /// Resources kept, as `resource` for the core group or `resource.group`.
    pub resources: Vec<String>,
    /// Namespaces never served from the cache.
    pub exclude_namespaces: Vec<String>,
    /// Events kept per resource for watches that resume.
    pub ring_size: usize,
    /// Longest a cache may serve before its first full list is in (then `/readyz` passes).
    #[serde(with = "humantime_serde")]
    pub sync_cap: Duration,
}

impl Default for Cache {
    fn default() -> Self {
        Self {
            enabled: false,
            resources: vec![
                "secrets".into(),
                "endpoints".into(),
                "endpointslices.discovery.k8s.io".into(),
            ],
            exclude_namespaces: Vec::new(),
            ring_size: 10_000,
            sync_cap: Duration::from_secs(60),
        }
    }
}

/// The audit log.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Audit {
    /// File that audit events are appended to, as JSON lines.
    pub path: Option<PathBuf>,
}

/// A byte count written as a plain number or a Kubernetes quantity (`512Mi`, `8Gi`, `2G`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity(pub u64);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(Quantity(n)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
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
    /// Dotted path of the field, e.g. `upstream.replicas[1]`.
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
    /// The file was read but has problems, each listed.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

impl Config {
    /// Reads, parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config: Config = text.parse()?;
        Ok(config)
    }
}

impl std::str::FromStr for Config {
    type Err = ConfigError;

    /// Parses and validates configuration text; relative paths stay as written.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let config: Config = serde_norway::from_str(text).map_err(|e| {
            ConfigError::Invalid(vec![Problem {
                field: "(file)".into(),
                message: e.to_string(),
            }])
        })?;
        let problems = config.validate();
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

impl Config {
    /// Every semantic problem of a parsed configuration (empty when it is valid).
    pub fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut bad = |field: &str, message: &str| {
            problems.push(Problem {
                field: field.into(),
                message: message.into(),
            })
        };
        if self.upstream.replicas.is_empty() {
            bad("upstream.replicas", "at least one replica is required");
        }
        if !(0.0..=0.02).contains(&self.listen.goaway_chance) {
            bad("listen.goawayChance", "must be between 0 and 0.02");
        }
        let own = &self.upstream.own;
        match (&own.cert, &own.key, &own.token_file) {
            (Some(_), Some(_), None) | (None, None, Some(_)) => {}
            _ => bad(
                "upstream.self",
                "set either cert and key, or tokenFile (not both)",
            ),
        }
        if self.identity.mode == IdentityMode::FrontProxy && self.upstream.front_proxy.is_none() {
            bad(
                "upstream.frontProxy",
                "required when identity.mode is front-proxy",
            );
        }
        problems
    }
}
