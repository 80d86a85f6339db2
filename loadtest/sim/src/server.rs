//! Replicas: a TLS listener each (ALPN h2 + http/1.1, 100 streams per HTTP/2 connection),
//! connections that die with the replica, and the per-request fault hooks.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{AuthConfig, DeferredVerifier, PeerCert};
use crate::body::SimBody;
use crate::faults::{Counters, Faults, ReplicaStats};
use crate::heap::{Heap, HeapModel};
use crate::metrics::SimMetrics;
use crate::policy::Policy;
use crate::store::Store;
use crate::{Pki, SeenRequest, SimConfig};

/// Fleet-wide state every replica serves from.
pub struct Shared {
    pub(crate) store: Arc<Store>,
    pub(crate) pki: Arc<Pki>,
    pub(crate) auth: AuthConfig,
    pub(crate) policy: Policy,
    pub(crate) heap: HeapModel,
    pub(crate) bookmark_interval: std::time::Duration,
    pub(crate) seen: Mutex<VecDeque<SeenRequest>>,
    pub(crate) metrics: SimMetrics,
    tls: Arc<ServerConfig>,
    verifier: Arc<DeferredVerifier>,
}

fn pem_certs(pem: &str) -> crate::error::Result<Vec<rustls_pki_types::CertificateDer<'static>>> {
    Ok(rustls_pemfile::certs(&mut pem.as_bytes()).collect::<Result<Vec<_>, _>>()?)
}

impl Shared {
    /// Builds the TLS config and store of a fleet.
    pub fn new(cfg: &SimConfig) -> crate::error::Result<Shared> {
        let pki = cfg.pki.clone();
        let verifier = Arc::new(DeferredVerifier::new(
            pki.client_ca.cert_der(),
            pki.front_proxy_ca.cert_der(),
        )?);
        let serving = pki.server_ca.server_cert(&["127.0.0.1", "localhost"]);
        let mut chain = pem_certs(&serving.cert_pem)?;
        chain.push(pki.server_ca.cert_der());
        let key = rustls_pemfile::private_key(&mut serving.key_pem.as_bytes())?
            .ok_or(crate::error::Error::NoKey)?;
        let mut tls =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_client_cert_verifier(verifier.clone())
                .with_single_cert(chain, key)?;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Shared {
            store: Arc::new(Store::new(cfg.event_ring)),
            pki,
            auth: AuthConfig {
                front_proxy_allowed_names: cfg.front_proxy_allowed_names.clone(),
                tokens: cfg.tokens.clone(),
                anonymous: cfg.anonymous,
            },
            policy: cfg.policy.clone(),
            heap: cfg.heap.clone(),
            bookmark_interval: cfg.bookmark_interval,
            seen: Mutex::new(VecDeque::new()),
            metrics: SimMetrics::new(),
            tls: Arc::new(tls),
            verifier,
        })
    }
}

struct Running {
    cancel: CancellationToken,
    accept: JoinHandle<()>,
    /// The connection tasks: a stop waits for them, so that no response byte (a watch
    /// event included) leaves a stopped replica.
    connections: TaskTracker,
}

/// One replica's state.
pub struct ReplicaInner {
    pub(crate) index: usize,
    pub(crate) addr: SocketAddr,
    pub(crate) shared: Arc<Shared>,
    pub(crate) faults: Faults,
    pub(crate) counters: Arc<Counters>,
    pub(crate) heap: Arc<Heap>,
    run: tokio::sync::Mutex<Option<Running>>,
    /// Cancels the live connections of the current incarnation; readable without awaiting.
    cancel: Mutex<CancellationToken>,
    manually_stopped: AtomicBool,
    /// The first listener, kept from `bind` so the first start reuses the reserved port.
    first_listener: Mutex<Option<TcpListener>>,
}

/// A handle to one simulated apiserver replica.
#[derive(Clone)]
pub struct Replica {
    pub(crate) inner: Arc<ReplicaInner>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("index", &self.inner.index)
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl Replica {
    pub(crate) async fn bind(index: usize, shared: Arc<Shared>) -> crate::error::Result<Replica> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        Ok(Replica {
            inner: Arc::new(ReplicaInner {
                index,
                addr,
                shared,
                faults: Faults::new(),
                counters: Arc::new(Counters::default()),
                heap: Arc::new(Heap::default()),
                run: tokio::sync::Mutex::new(None),
                cancel: Mutex::new(CancellationToken::new()),
                manually_stopped: AtomicBool::new(false),
                first_listener: Mutex::new(Some(l)),
            }),
        })
    }

    /// The replica's address (the same across stop/start).
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Its index in the fleet.
    pub fn index(&self) -> usize {
        self.inner.index
    }

    /// Whether it is accepting connections.
    pub async fn is_running(&self) -> bool {
        self.inner.run.lock().await.is_some()
    }

    /// Closes the listener and drops every connection, like a crash.
    pub async fn stop(&self) {
        self.inner.manually_stopped.store(true, Ordering::SeqCst);
        stop_inner(&self.inner).await;
    }

    /// Listens again on the same address.
    pub async fn start(&self) {
        self.inner.manually_stopped.store(false, Ordering::SeqCst);
        start_inner(&self.inner).await;
    }

    /// Cancels all connections without waiting (used when the fleet is dropped).
    pub(crate) fn shutdown_now(&self) {
        self.inner
            .cancel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cancel();
    }

    /// Adds this delay before every response head.
    pub fn set_delay(&self, d: std::time::Duration) {
        self.inner.faults.set_delay(d);
    }

    /// Answers every non-probe request with this status: a `Status` body, except 429,
    /// which is API Priority and Fairness rejecting the request's flow (as the apiserver's
    /// filter answers it: plain text, `Retry-After`, the flow schema's and priority
    /// level's UIDs).
    pub fn set_fail(&self, status: Option<u16>) {
        self.inner.faults.set_fail(status);
    }

    /// Resets every response stream after this many body bytes.
    pub fn set_reset_mid_body(&self, after_bytes: Option<u64>) {
        self.inner.faults.set_reset_mid_body(after_bytes);
    }

    /// Freezes the replica, like SIGSTOP: connections stay open and TCP connects still
    /// succeed, but no TLS handshake completes and no request (probes included) is
    /// answered until [`Replica::thaw`]; a request is counted as it arrives. Requests
    /// waiting when it thaws are answered then.
    pub fn freeze(&self) {
        self.inner.faults.set_frozen(true);
    }

    /// Ends [`Replica::freeze`]: like SIGCONT.
    pub fn thaw(&self) {
        self.inner.faults.set_frozen(false);
    }

    /// Refuses every new stream (HTTP/2 `REFUSED_STREAM`; HTTP/1.1: the connection is closed).
    pub fn set_refuse_streams(&self, on: bool) {
        self.inner.faults.set_refuse_streams(on);
    }

    /// A snapshot of the replica's counters.
    pub fn stats(&self) -> ReplicaStats {
        Replica::stats_of(&self.inner)
    }

    pub(crate) fn stats_of(inner: &ReplicaInner) -> ReplicaStats {
        let c = &inner.counters;
        let sh = &inner.shared;
        let live = sh.store.live_bytes();
        let (last_user, last_headers_seen) =
            c.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        ReplicaStats {
            requests: c.requests.load(Ordering::Relaxed),
            in_flight: c.in_flight.load(Ordering::Relaxed),
            peak_in_flight: c.peak_in_flight.load(Ordering::Relaxed),
            open_watches: c.open_watches.load(Ordering::Relaxed),
            peak_watches: c.peak_watches.load(Ordering::Relaxed),
            heap_bytes: inner.heap.current(&sh.heap, live),
            peak_heap_bytes: inner.heap.peak().max(inner.heap.current(&sh.heap, live)),
            ooms: c.ooms.load(Ordering::Relaxed),
            requests_by_user: c.by_user.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            last_user,
            last_headers_seen,
        }
    }
}

async fn stop_inner(inner: &Arc<ReplicaInner>) {
    let mut run = inner.run.lock().await;
    if let Some(r) = run.take() {
        r.cancel.cancel();
        // The accept task owns the listener; waiting for it guarantees the port is free.
        let _ = r.accept.await;
        // A cancelled connection is only closed once its task runs again: without this
        // wait, a change made right after `stop` could still reach an open watch.
        r.connections.close();
        r.connections.wait().await;
    }
    // In-flight counts and heap charges are released as the cancelled connections drop
    // their response bodies.
}

async fn start_inner(inner: &Arc<ReplicaInner>) {
    let mut run = inner.run.lock().await;
    if run.is_some() {
        return;
    }
    let first = inner
        .first_listener
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    let listener = match first {
        Some(l) => l,
        None => {
            // The port was ours a moment ago; retry briefly in case the old socket lingers.
            let mut tries = 0;
            loop {
                match bind_reuse(inner.addr) {
                    Ok(l) => break l,
                    Err(e) if tries < 50 => {
                        tries += 1;
                        tracing::debug!(addr = %inner.addr, error = %e, "rebind failed, retrying");
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                    Err(e) => {
                        tracing::error!(addr = %inner.addr, error = %e, "cannot listen again");
                        return;
                    }
                }
            }
        }
    };
    let cancel = CancellationToken::new();
    *inner.cancel.lock().unwrap_or_else(|p| p.into_inner()) = cancel.clone();
    let connections = TaskTracker::new();
    let accept = tokio::spawn(accept_loop(
        inner.clone(),
        listener,
        cancel.clone(),
        connections.clone(),
    ));
    *run = Some(Running {
        cancel,
        accept,
        connections,
    });
}

fn bind_reuse(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.set_reuseaddr(true)?;
    s.bind(addr)?;
    s.listen(1024)
}

async fn accept_loop(
    inner: Arc<ReplicaInner>,
    listener: TcpListener,
    cancel: CancellationToken,
    connections: TaskTracker,
) {
    let acceptor = TlsAcceptor::from(inner.shared.tls.clone());
    loop {
        let (tcp, _) = tokio::select! {
            _ = cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let inner = inner.clone();
        let acceptor = acceptor.clone();
        let cancel = cancel.clone();
        connections.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = serve_conn(inner, acceptor, tcp, cancel.clone()) => {}
            }
        });
    }
}

async fn serve_conn(
    inner: Arc<ReplicaInner>,
    acceptor: TlsAcceptor,
    tcp: tokio::net::TcpStream,
    cancel: CancellationToken,
) {
    // A frozen process never reads the client's hello.
    inner.faults.thawed().await;
    let tls = match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp))
        .await
    {
        Ok(Ok(t)) => t,
        _ => return,
    };
    let (_, conn) = tls.get_ref();
    let peer: Option<PeerCert> = conn
        .peer_certificates()
        .and_then(|c| inner.shared.verifier.inspect(c));
    let h2 = conn.alpn_protocol() == Some(b"h2");
    let peer = Arc::new(peer);
    let svc = {
        let inner = inner.clone();
        let cancel = cancel.clone();
        service_fn(move |req: Request<Incoming>| {
            let inner = inner.clone();
            let peer = peer.clone();
            let cancel = cancel.clone();
            async move { serve_request(inner, peer, req, h2, cancel).await }
        })
    };
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http2().max_concurrent_streams(100);
    if let Err(e) = b
        .serve_connection_with_upgrades(TokioIo::new(tls), svc)
        .await
    {
        tracing::debug!(error = %e, "connection ended with error");
    }
}

const PROBES: &[&str] = &["/healthz", "/livez", "/readyz"];

async fn serve_request(
    inner: Arc<ReplicaInner>,
    peer: Arc<Option<PeerCert>>,
    req: Request<Incoming>,
    h2: bool,
    cancel: CancellationToken,
) -> Result<Response<SimBody>, h2::Error> {
    let path = req.uri().path().to_string();
    let probe = PROBES
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}/")));
    if probe {
        // Probes are slowed and frozen like everything else but never failed or refused: a
        // replica is unhealthy only when it is down.
        inner.faults.thawed().await;
        let delay = inner.faults.delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        return Ok(crate::api::text(200, "ok"));
    }
    inner.counters.requests.fetch_add(1, Ordering::Relaxed);
    let f = &inner.faults;
    f.thawed().await;
    if f.refuse_streams() {
        // hyper resets an HTTP/2 stream with the h2 reason found in the service error;
        // for HTTP/1.1 a service error closes the connection.
        let _ = h2;
        return Err(h2::Error::from(h2::Reason::REFUSED_STREAM));
    }
    let delay = f.delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut resp = if let Some(code) = f.fail() {
        if code == 429 {
            crate::api::apf_rejection()
        } else {
            crate::api::status_response(&crate::status::injected(code))
        }
    } else {
        crate::api::handle(&inner, peer.as_ref().as_ref(), req, cancel).await
    };
    if let Some(n) = f.reset_mid_body() {
        let body = std::mem::replace(resp.body_mut(), SimBody::empty());
        *resp.body_mut() = body.reset_after(Some(n));
        resp.headers_mut().remove(http::header::CONTENT_LENGTH);
    }
    Ok(resp)
}

/// Runs the OOM of a replica: counts it, drops every connection, refuses connections for
/// the configured restart time, then listens again (unless stopped by hand meanwhile).
pub(crate) fn oom(inner: &Arc<ReplicaInner>) {
    inner.counters.ooms.fetch_add(1, Ordering::Relaxed);
    let inner = inner.clone();
    tokio::spawn(async move {
        stop_inner(&inner).await;
        tokio::time::sleep(inner.shared.heap.restart).await;
        if !inner.manually_stopped.load(Ordering::SeqCst) {
            start_inner(&inner).await;
        }
    });
}
