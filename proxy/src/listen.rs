//! The client-facing TLS listener: connection caps, the PROXY protocol, handshake, limits,
//! reload, drain (DESIGN.md steps 1 and 9).
//!
//! [`Listener::bind`] reads the certificate files and binds the socket, [`Listener::serve`]
//! accepts connections within the caps, reads a trusted balancer's PROXY header, and drives
//! each through TLS and HTTP/1.1 or HTTP/2 into the caller's tower service with a
//! [`ConnInfo`] in every request's extensions, and
//! [`Listener::spawn_reload`] swaps in new certificate files for new handshakes. The caller's
//! SIGTERM handler moves a [`DrainPhase`] watch from `Serving` to `GoAway`, `EndWatches` and
//! `Close`.
//! [`AdminListener`] serves the admin endpoints on the same accept loop and connection
//! handling, with caps and timeouts of its own.

mod caps;
mod conn;
mod proxy_header;
mod reload;
mod tls;
mod workers;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::Body;
use crate::config;
use crate::identity::User;
use crate::identity::review::TokenMemo;
use crate::metrics::Metrics;

pub use crate::net::{prefix_of, source_of};
pub use caps::{Connections, raise_open_file_limit};
#[doc(hidden)]
pub use proxy_header::at_start as proxy_header_at_start;
pub use workers::Worker;

/// What the request path learns from the connection; inserted into every request's extensions.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The client's address: the one a trusted balancer's PROXY header carries, else the
    /// peer's.
    pub peer: SocketAddr,
    /// `peer`'s IP as a header value (what `X-Forwarded-For` appends), made once per
    /// connection.
    pub peer_ip: HeaderValue,
    /// The client certificate chain (leaf first), present only when the client sent one and it
    /// verified against the configured client CA.
    pub client_chain: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// The user the client certificate names, read once per connection by the first
    /// request that needs it (`Err`: why the certificate names no user).
    pub client_user: Arc<OnceLock<Result<Arc<User>, String>>>,
    /// Whether this request came over HTTP/2.
    pub http2: bool,
    /// Where the identity stage reports whether the connection's requests authenticate.
    pub auth: Arc<ConnAuth>,
}

/// Whether a connection's requests authenticate: a connection that never does within
/// `unauthenticatedTimeout`, or whose requests are refused for their credentials
/// `maxUnauthenticatedRequests` times in a row, is closed.
#[derive(Debug)]
pub struct ConnAuth {
    authenticated: AtomicBool,
    refused_in_a_row: AtomicU32,
    max_refused: u32,
    give_up: Notify,
    /// Requests of a not yet authenticated connection still being identified (a token
    /// review can take seconds).
    identifying: AtomicU32,
    /// Whether a request could not be identified through no fault of the client's (no
    /// review could be made) since the last look.
    excused: AtomicBool,
    /// The connection's last bearer token and whom it was accepted for.
    token: TokenMemo,
    /// A response on the connection waited for its client past `sendProgressTimeout`.
    stalled: AtomicBool,
}

impl ConnAuth {
    /// A connection closed after `max_refused` refusals in a row.
    pub fn new(max_refused: u32) -> ConnAuth {
        ConnAuth {
            authenticated: AtomicBool::new(false),
            refused_in_a_row: AtomicU32::new(0),
            max_refused,
            give_up: Notify::new(),
            identifying: AtomicU32::new(0),
            excused: AtomicBool::new(false),
            token: TokenMemo::default(),
            stalled: AtomicBool::new(false),
        }
    }

    /// The connection's last bearer token and whom it was accepted for.
    pub fn token(&self) -> &TokenMemo {
        &self.token
    }

    /// Counts a request of a connection that has not authenticated yet as being identified
    /// until the guard drops; `None` once the connection has authenticated.
    pub fn identifying(self: &Arc<Self>) -> Option<Identifying> {
        if self.authenticated() {
            return None;
        }
        self.identifying.fetch_add(1, Ordering::Relaxed);
        Some(Identifying(self.clone()))
    }

    /// A request could not be identified through no fault of the client's: the review
    /// failed, or Bulwark's reviews in flight stayed at their bound.
    pub fn excused(&self) {
        self.excused.store(true, Ordering::Relaxed);
    }

    /// Whether the connection deserves more time: a request is still being identified,
    /// or one was excused since the last look.
    fn deserves_more_time(&self) -> bool {
        self.identifying.load(Ordering::Relaxed) > 0 || self.excused.swap(false, Ordering::Relaxed)
    }

    /// A request on the connection authenticated.
    pub fn accepted(&self) {
        // Loads first: under load every request lands here, and a store would bounce the
        // cache line between cores for nothing.
        if !self.authenticated.load(Ordering::Relaxed) {
            self.authenticated.store(true, Ordering::Relaxed);
        }
        if self.refused_in_a_row.load(Ordering::Relaxed) != 0 {
            self.refused_in_a_row.store(0, Ordering::Relaxed);
        }
    }

    /// A request on the connection was refused for its credentials.
    pub fn refused(&self) {
        if self.refused_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= self.max_refused {
            self.give_up.notify_one();
        }
    }

    /// `Some(refusals)` once the connection has been refused its credentials
    /// `max_refused` times in a row and is closing.
    pub fn given_up(&self) -> Option<u32> {
        let refused = self.refused_in_a_row.load(Ordering::Relaxed);
        (refused >= self.max_refused).then_some(refused)
    }

    /// A response on the connection was cut off because its client did not read it: the
    /// connection is closed (GOAWAY, then dropped a second later), since a stream that the
    /// client gives no room to is never polled again and cannot be reset on its own.
    pub fn stalled(&self) {
        self.stalled.store(true, Ordering::Relaxed);
        self.give_up.notify_one();
    }

    /// Whether a response on the connection was cut off for its client's not reading.
    fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    /// Whether any request on the connection has authenticated.
    pub fn authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Relaxed)
    }
}
/// One request of a not yet authenticated connection being identified.
#[derive(Debug)]
pub struct Identifying(Arc<ConnAuth>);

impl Drop for Identifying {
    fn drop(&mut self) {
        self.0.identifying.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Drain phases driven by the SIGTERM handler, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DrainPhase {
    /// Accept and serve as usual.
    Serving,
    /// Stop accepting; every connection is shut down gracefully (GOAWAY for HTTP/2,
    /// `Connection: close` for HTTP/1.1) and in-flight requests and streams finish.
    GoAway,
    /// Every watch still open ends cleanly after its last whole event (in the framings
    /// Bulwark reads: JSON lines, protobuf, CBOR sequences), as the apiserver ends its
    /// watches when it shuts down: clients watch again from the last version they saw,
    /// where a stream cut at [`DrainPhase::Close`] could end mid-event, which client-go
    /// takes for a broken stream and answers with a relist.
    EndWatches,
    /// Drop every remaining connection.
    Close,
}

/// Marks a response that streams a watch (set by the request path, which classified the
/// request): its body ends cleanly at [`DrainPhase::EndWatches`].
#[derive(Debug, Clone, Copy)]
pub struct Watching;

/// A serving certificate and key without client certificates (the admin listener's),
/// re-read on demand; [`AdminListener::bind`] takes it.
#[derive(Clone)]
pub struct ServingTls(Arc<tls::TlsState>);

impl ServingTls {
    /// Reads and checks the files now; a problem names the file. The certificate's expiry
    /// goes to `metrics` as `certificate="admin"`.
    pub fn load(
        cert: &std::path::Path,
        key: &std::path::Path,
        metrics: &Metrics,
    ) -> Result<Self, ListenError> {
        tls::TlsState::load(
            tls::TlsFiles {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                client_ca: None,
                role: "admin",
            },
            metrics.clone(),
        )
        .map(|state| Self(Arc::new(state)))
    }

    /// The acceptor for a handshake starting now.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.0.current())
    }

    /// Re-reads the files (blocking file I/O); see [`Reloader::reload`].
    pub fn reload(&self) -> Result<bool, ListenError> {
        self.0.check()
    }
}

/// Re-reads the listener's certificate, key and client CA files on demand.
#[derive(Clone)]
pub struct Reloader(Arc<tls::TlsState>);

impl Reloader {
    /// Re-reads the files now (blocking file I/O): `Ok(true)` if a new configuration was
    /// swapped in, `Ok(false)` if nothing changed since the last attempt, an error (naming
    /// the file) if the new files are unusable, in which case the old configuration stays.
    pub fn reload(&self) -> Result<bool, ListenError> {
        self.0.check()
    }
}

/// Why the listener could not start or a certificate reload was refused.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// A certificate, key or CA file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not valid PEM.
    #[error("{path}: bad PEM: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What the PEM parser said.
        message: String,
    },
    /// The certificate file holds no certificate.
    #[error("{path}: no PEM certificate in the file")]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// The key file holds no private key.
    #[error("{path}: no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file")]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// The key is of a type or form the ring provider cannot use.
    #[error("{path}: unusable private key: {source}")]
    BadKey {
        /// The file.
        path: PathBuf,
        /// What rustls said.
        source: rustls::Error,
    },
    /// The leaf certificate cannot be parsed.
    #[error("{path}: unusable certificate: {source}")]
    BadCertificate {
        /// The file.
        path: PathBuf,
        /// What rustls said.
        source: rustls::Error,
    },
    /// The private key is not the key of the leaf certificate.
    #[error("{key} does not hold the private key of the certificate in {cert}")]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// The client CA file cannot be used to verify client certificates.
    #[error("{path}: unusable client CA: {message}")]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// rustls refused the configuration for another reason.
    #[error("TLS configuration: {0}")]
    Tls(rustls::Error),
    /// The address could not be bound.
    #[error("cannot listen on {address}: {source}")]
    Bind {
        /// The configured address.
        address: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The listening socket itself failed (not a single connection).
    #[error("accepting connections failed: {0}")]
    Accept(std::io::Error),
}

/// The request path a listener serves: one tower service, cloned per connection, that
/// answers every request itself (its errors already turned into statuses).
pub trait RequestPath:
    tower::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static
{
}

impl<S> RequestPath for S where
    S: tower::Service<
            Request<Incoming>,
            Response = Response<Body>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send
        + 'static
{
}

/// A connection the caller opened, with no TLS of its own: an in-memory pair, for one.
pub trait HandoffIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> HandoffIo for T {}

/// Serves connections that did not come through the listener's socket, on the request path
/// every accepted connection takes from its HTTP layer on: [`ConnInfo`], open-request
/// counting, the idle and unauthenticated timeouts, the GOAWAY chance and the drain. What
/// comes before that on a socket is not there: no PROXY header, no TLS (so no client
/// certificate) and no connection caps. For benchmarks of the whole request path over an
/// in-memory connection pair, where TLS would measure rustls instead of Bulwark.
#[derive(Clone)]
pub struct Handoff(Arc<ServeOne>);

/// Serves one connection from the given address until it ends.
type ServeOne = dyn Fn(Box<dyn HandoffIo>, SocketAddr) -> Pin<Box<dyn Future<Output = ()> + Send>>
    + Send
    + Sync;

impl Handoff {
    /// Serves `io` as a connection from `peer` until it closes, is idle, does not
    /// authenticate, or the drain closes it. The future owns what it needs: spawn it.
    pub fn serve(
        &self,
        io: impl HandoffIo,
        peer: SocketAddr,
    ) -> impl Future<Output = ()> + Send + 'static {
        (self.0)(Box::new(io), peer)
    }
}

/// A bound client listener with its TLS configuration loaded; [`Listener::serve`] runs it.
pub struct Listener {
    tcp: TcpListener,
    local_addr: SocketAddr,
    tls: Arc<tls::TlsState>,
    settings: Arc<conn::Settings>,
    file_check_interval: Duration,
    connections: Connections,
}

impl Listener {
    /// Loads the certificate, key and client CA now (a bad file is an error naming it) and
    /// binds the address; its connections are counted in `metrics`.
    pub async fn bind(cfg: &config::Listen, metrics: &Metrics) -> Result<Listener, ListenError> {
        // Three small files, read once at startup: not worth a blocking-pool hop.
        let tls = tls::TlsState::load(tls::TlsFiles::from_config(cfg), metrics.clone())?;
        let tcp = TcpListener::bind(cfg.address)
            .await
            .map_err(|source| ListenError::Bind {
                address: cfg.address,
                source,
            })?;
        let local_addr = tcp.local_addr().map_err(|source| ListenError::Bind {
            address: cfg.address,
            source,
        })?;
        let connections = Connections::new(&cfg.limits, metrics.connections_open.clone());
        metrics
            .connections_max
            .set(i64::try_from(connections.max()).unwrap_or(i64::MAX));
        Ok(Listener {
            tcp,
            local_addr,
            tls: Arc::new(tls),
            settings: Arc::new(conn::Settings::new(cfg, metrics)),
            file_check_interval: cfg.limits.file_check_interval,
            connections,
        })
    }

    /// The bound address (useful when the configured port was 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Watches the cert, key and client CA files (notifications on their folders, so that
    /// Kubernetes' `..data` symlink swaps are seen, plus a re-read every
    /// `limits.fileCheckInterval`). New handshakes use new files; open connections keep
    /// theirs; a change that does not load keeps the old configuration and logs why. Runs
    /// until the handle is aborted.
    pub fn spawn_reload(&self) -> JoinHandle<()> {
        tokio::spawn(reload::run(self.tls.clone(), self.file_check_interval))
    }

    /// A handle that re-reads the certificate files on demand (e.g. on SIGHUP), usable while
    /// [`Listener::serve`] runs.
    pub fn reloader(&self) -> Reloader {
        Reloader(self.tls.clone())
    }

    /// A handle on the number of open client connections, for metrics.
    pub fn connections(&self) -> Connections {
        self.connections.clone()
    }

    /// A [`Handoff`] that serves connections the caller opened with `service`, with this
    /// listener's HTTP settings and limits, until the drain closes them.
    pub fn handoff<S>(&self, service: S, drain: watch::Receiver<DrainPhase>) -> Handoff
    where
        S: RequestPath + Sync,
    {
        let settings = self.settings.clone();
        Handoff(Arc::new(move |io, peer| {
            let (settings, service, drain) = (settings.clone(), service.clone(), drain.clone());
            Box::pin(async move {
                let peer = conn::Peer {
                    addr: peer,
                    client_chain: None,
                    started: tokio::time::Instant::now(),
                };
                conn::serve_http(TokioIo::new(io), peer, &settings, service, drain, None).await;
            })
        }))
    }

    /// Accepts connections and serves them on this runtime until the drain reaches
    /// [`DrainPhase::GoAway`], then stops accepting (the socket is closed) and returns once
    /// every connection has ended, gracefully or at [`DrainPhase::Close`]. If the drain
    /// sender is dropped the listener keeps serving. Errors of single connections are
    /// logged, never returned.
    pub async fn serve<S>(
        self,
        service: S,
        drain: watch::Receiver<DrainPhase>,
    ) -> Result<(), ListenError>
    where
        S: RequestPath,
    {
        let dispatch = workers::Dispatch::local(service, self.shared(&drain));
        self.accept(dispatch, drain).await
    }

    /// As [`Listener::serve`], with each connection served by one of `workers`' threads,
    /// the one with the fewest open connections when it is accepted, and returning only at
    /// [`DrainPhase::Close`] (a thread's runtime ends with it, and an upgraded connection
    /// lives on past its HTTP connection). Dropping the future stops the threads and drops
    /// their connections.
    pub async fn serve_on<S>(
        self,
        workers: Vec<Worker<S>>,
        drain: watch::Receiver<DrainPhase>,
    ) -> Result<(), ListenError>
    where
        S: RequestPath,
    {
        let dispatch = workers::Dispatch::threads(workers, self.shared(&drain))
            .map_err(ListenError::Accept)?;
        self.accept(dispatch, drain).await
    }

    fn shared(&self, drain: &watch::Receiver<DrainPhase>) -> workers::Shared {
        workers::Shared {
            tls: Some(self.tls.clone()),
            settings: self.settings.clone(),
            connections: self.connections.clone(),
            drain: drain.clone(),
        }
    }

    /// The accept loop, until the drain stops it.
    async fn accept(
        self,
        dispatch: workers::Dispatch,
        drain: watch::Receiver<DrainPhase>,
    ) -> Result<(), ListenError> {
        let Listener {
            tcp,
            settings,
            connections,
            ..
        } = self;
        accept(tcp, &settings, &connections, dispatch, drain, "client").await
    }
}

/// The admin listener's socket with its caps and timeouts (DESIGN.md step 10): the client
/// listener's accept loop and connection handling, plain HTTP or TLS without client
/// certificates. At the total cap a new connection evicts the oldest one that has not yet
/// sent a whole request (the admin's service marks those that did), so that a flood of
/// silent connections from many addresses cannot keep the kubelet's probe out; past the
/// per-source and per-prefix caps, and when every connection has made a request, a new
/// connection is reset.
pub struct AdminListener {
    tcp: TcpListener,
    local_addr: SocketAddr,
    tls: Option<ServingTls>,
    settings: Arc<conn::Settings>,
    connections: Connections,
}

impl AdminListener {
    /// Binds `address`; connections are capped and timed by `limits` and counted in
    /// `metrics`' `bulwark_admin_connections_*`.
    pub async fn bind(
        address: SocketAddr,
        limits: &config::AdminLimits,
        tls: Option<ServingTls>,
        metrics: &Metrics,
    ) -> Result<AdminListener, ListenError> {
        let bind_error = |source| ListenError::Bind { address, source };
        let tcp = TcpListener::bind(address).await.map_err(bind_error)?;
        let local_addr = tcp.local_addr().map_err(bind_error)?;
        let connections = Connections::with_caps(
            caps::Caps {
                total: limits.max_connections,
                per_source: limits.max_connections_per_source,
                per_prefix: limits.max_connections_per_prefix,
                evict: true,
            },
            metrics.admin_connections_open.clone(),
        );
        Ok(AdminListener {
            tcp,
            local_addr,
            tls,
            settings: Arc::new(conn::Settings::admin(limits, metrics)),
            connections,
        })
    }

    /// The bound address (useful when the configured port was 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Accepts and serves connections with `service` (each request carries a
    /// [`ConnInfo`]) until the socket fails.
    pub async fn serve<S: RequestPath>(self, service: S) -> Result<(), ListenError> {
        // Nobody drains the admin listener: it answers probes until the process ends.
        let (_, drain) = watch::channel(DrainPhase::Serving);
        let shared = workers::Shared {
            tls: self.tls.map(|tls| tls.0),
            settings: self.settings.clone(),
            connections: self.connections.clone(),
            drain: drain.clone(),
        };
        let dispatch = workers::Dispatch::local(service, shared);
        accept(
            self.tcp,
            &self.settings,
            &self.connections,
            dispatch,
            drain,
            "admin",
        )
        .await
    }
}

/// The accept loop of a listener (`which` names it in logs): admits each connection within
/// the caps and hands it on, until the drain reaches [`DrainPhase::GoAway`].
async fn accept(
    tcp: TcpListener,
    settings: &conn::Settings,
    connections: &Connections,
    mut dispatch: workers::Dispatch,
    mut drain: watch::Receiver<DrainPhase>,
    which: &'static str,
) -> Result<(), ListenError> {
    let mut drain_open = true;
    let mut result = Ok(());
    while *drain.borrow_and_update() == DrainPhase::Serving {
        tokio::select! {
            accepted = tcp.accept() => match accepted {
                Ok((stream, peer)) => {
                    if let Err(error) = client_socket(&stream) {
                        tracing::debug!(%peer, %error, "cannot set the client socket's options");
                    }
                    // A peer is counted against its source and prefix before it sends a
                    // byte, unless it is a trusted balancer: its PROXY header names the
                    // client to count.
                    let ip = peer.ip();
                    match connections.admit(ip, settings.counted_at_accept(ip)) {
                        Ok(admitted) => {
                            if admitted.evicted {
                                settings.closed("evicted");
                            }
                            dispatch.hand(stream, peer, admitted);
                        }
                        Err(full) => refuse(stream, full.reason(), settings),
                    }
                }
                Err(error) => match accept_error(&error) {
                    AcceptError::Transient => {}
                    AcceptError::Exhausted => {
                        tracing::warn!(listener = which, %error, "cannot accept connections; retrying shortly");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    AcceptError::Fatal => {
                        result = Err(ListenError::Accept(error));
                        break;
                    }
                },
            },
            changed = drain.changed(), if drain_open => {
                if changed.is_err() {
                    drain_open = false;
                }
            }
        }
    }
    // Closing the socket now makes new connections fail fast so that clients and load
    // balancers pick another replica.
    drop(tcp);
    tracing::info!(
        listener = which,
        open = connections.open(),
        "stopped accepting connections"
    );
    dispatch.finish().await;
    result
}

/// Closes a connection Bulwark will not serve, with a reset so that the client fails at
/// once (and a balancer tries another replica) instead of waiting on a handshake that will
/// never come.
fn refuse(stream: tokio::net::TcpStream, reason: &'static str, settings: &conn::Settings) {
    settings.refused(reason);
    reset_on_close(&stream);
}

/// TCP keepalive on a client's connection: probes after [`KEEPALIVE_IDLE`] without traffic,
/// every [`KEEPALIVE_EVERY`], [`KEEPALIVE_PROBES`] unanswered close it.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// See [`KEEPALIVE_IDLE`].
const KEEPALIVE_EVERY: Duration = Duration::from_secs(10);
/// See [`KEEPALIVE_IDLE`].
const KEEPALIVE_PROBES: u32 = 3;
/// How long data Bulwark sent may stay unacknowledged before the kernel closes the
/// connection (`TCP_USER_TIMEOUT`): as long as keepalive takes to give up.
const UNACKNOWLEDGED_LIMIT: Duration = Duration::from_secs(60);

/// A client connection's socket options. Small writes (HTTP/2 frames, watch events) must
/// not wait for Nagle. A peer that vanished without a FIN (a node powered off, a balancer
/// that dropped the flow) is found by TCP keepalive and `TCP_USER_TIMEOUT`, as the
/// kube-apiserver finds it, rather than by HTTP/2 pings (`listen.limits.keepaliveInterval`,
/// off by default): the kernel's probes cost the request path nothing, where hyper's ping
/// timer is read on every poll of every connection (about 1,400 instructions a request).
fn client_socket(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let socket = socket2::SockRef::from(stream);
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_EVERY)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    socket.set_tcp_user_timeout(Some(UNACKNOWLEDGED_LIMIT))
}

/// Makes closing `stream` send a reset (SO_LINGER 0) rather than a FIN.
fn reset_on_close(stream: &impl std::os::fd::AsFd) {
    if let Err(error) = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO)) {
        tracing::debug!(%error, "cannot set SO_LINGER");
    }
}

/// How the accept loop reacts to an error from `accept`.
enum AcceptError {
    /// One connection went wrong before it was accepted; carry on.
    Transient,
    /// Out of file descriptors or memory; wait a little so as not to spin.
    Exhausted,
    /// The listening socket itself is broken.
    Fatal,
}

fn accept_error(error: &std::io::Error) -> AcceptError {
    match error.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptError::Exhausted,
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP) => AcceptError::Fatal,
        _ => AcceptError::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::ConnAuth;

    /// An accepted client's socket sends no Nagle-delayed frames and finds a vanished peer
    /// with TCP keepalive and `TCP_USER_TIMEOUT`.
    #[tokio::test]
    async fn a_client_socket_keeps_itself_alive_in_the_kernel() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        super::client_socket(&accepted).unwrap();
        let socket = socket2::SockRef::from(&accepted);
        assert!(accepted.nodelay().unwrap());
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), super::KEEPALIVE_IDLE);
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            super::KEEPALIVE_EVERY
        );
        assert_eq!(
            socket.tcp_keepalive_retries().unwrap(),
            super::KEEPALIVE_PROBES
        );
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(super::UNACKNOWLEDGED_LIMIT)
        );
    }

    #[test]
    fn a_connection_gives_up_after_its_refusals_in_a_row_and_an_acceptance_resets_them() {
        let auth = ConnAuth::new(3);
        auth.refused();
        auth.refused();
        auth.accepted();
        auth.refused();
        auth.refused();
        assert_eq!(
            auth.given_up(),
            None,
            "an acceptance starts the count again"
        );
        auth.refused();
        assert_eq!(auth.given_up(), Some(3));
    }
}
