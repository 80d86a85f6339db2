//! The `admin` section: the admin listener, its access and its limits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::problems::Problems;

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

impl Admin {
    /// `reserved_fds` is `listen.limits.reservedFileDescriptors`, a quarter of which the
    /// admin connections may take.
    pub(super) fn validate(&self, reserved_fds: usize, p: &mut Problems) {
        // A non-local admin address without a token file is allowed: `/debug/*` is then
        // refused (see `Admin::debug_needs_token`), the rest still works.
        if let Some(token_file) = &self.token_file {
            p.path("admin.tokenFile", token_file);
        }
        if let Some(tls) = &self.tls {
            p.path("admin.tls.cert", &tls.cert);
            p.path("admin.tls.key", &tls.key);
        }
        self.limits.validate(reserved_fds, p);
        if self.metrics_access == MetricsAccess::Authorized && self.tls.is_none() {
            p.add(
                "admin.metricsAccess",
                "authorized needs admin.tls: a bearer token must not cross the network in the clear"
                    .to_string(),
            );
        }
    }
}

impl AdminLimits {
    fn validate(&self, reserved_fds: usize, p: &mut Problems) {
        let l = self;
        p.nonzero("admin.limits.maxConnections", l.max_connections as u64);
        let share = reserved_fds / 4;
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
}

impl Admin {
    /// Whether `/debug/*` requires the bearer token: when the listener is not bound to a
    /// loopback address. Without a `tokenFile` such a listener refuses `/debug/*`.
    pub fn debug_needs_token(&self) -> bool {
        !self.address.ip().is_loopback()
    }
}
