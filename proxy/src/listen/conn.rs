//! One client connection: the PROXY header and the per-source cap, TLS handshake, HTTP/1.1
//! or HTTP/2, open-request counting for the idle timeout, closing connections that do not
//! authenticate, the GOAWAY chance, and the drain phases.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, Version};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::CertificateDer;
use tokio::net::TcpStream;
use tokio::sync::{Notify, watch};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use super::caps::Connections;
use super::proxy_header::{self, Trust};
use super::tls::TlsState;
use super::{ConnAuth, ConnInfo, DrainPhase, RequestPath};
use crate::metrics::Metrics;
use crate::{Body, BoxError, config};

/// How many more `unauthenticatedTimeout` periods a connection gets whose requests could
/// not be identified through no fault of its own.
const MAX_EXTENSIONS: u32 = 2;

/// How long a connection closed for not authenticating has to flush its last answers.
const LAST_WORDS: Duration = Duration::from_secs(1);

/// hyper refuses an HTTP/1 read buffer smaller than this.
const MIN_H1_BUFFER: usize = 8192;

/// Everything a connection needs that is the same for all connections.
pub(super) struct Settings {
    builder: auto::Builder<TokioExecutor>,
    handshake_timeout: Duration,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    goaway_chance: f64,
    trust: Option<Trust>,
    unauthenticated_timeout: Duration,
    max_unauthenticated_requests: u32,
    metrics: Metrics,
}

impl Settings {
    pub(super) fn new(cfg: &config::Listen, metrics: &Metrics) -> Self {
        let limits = &cfg.limits;
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            // Without a timer hyper silently ignores the header read timeout.
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            // The request head must fit the read buffer, so this caps it: larger gets 431.
            .max_buf_size(limits.max_header_bytes.max(MIN_H1_BUFFER));
        builder
            .http2()
            .timer(TokioTimer::new())
            // h2 answers a larger header block with 431 and refuses the stream.
            .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
            .max_concurrent_streams(limits.max_concurrent_streams)
            .keep_alive_interval(Some(limits.keepalive_interval).filter(|d| !d.is_zero()))
            .keep_alive_timeout(limits.keepalive_timeout);
        Self {
            builder,
            handshake_timeout: limits.handshake_timeout,
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            goaway_chance: cfg.goaway_chance.clamp(0.0, 1.0),
            trust: Trust::from_config(cfg.proxy_protocol.as_ref()),
            unauthenticated_timeout: limits.unauthenticated_timeout,
            max_unauthenticated_requests: limits.max_unauthenticated_requests,
            metrics: metrics.clone(),
        }
    }

    /// Counts a connection refused before its handshake.
    pub(super) fn refused(&self, reason: &'static str) {
        self.metrics
            .connections_refused_total
            .with_label_values(&[reason])
            .inc();
    }

    fn closed(&self, reason: &'static str) {
        self.metrics
            .connections_closed_total
            .with_label_values(&[reason])
            .inc();
    }
}

/// Serves one accepted TCP connection until it closes, is idle, does not authenticate, or
/// the drain closes it.
pub(super) async fn serve<S>(
    tcp: TcpStream,
    peer: SocketAddr,
    tls: Arc<TlsState>,
    settings: Arc<Settings>,
    connections: Connections,
    service: S,
    mut drain: watch::Receiver<DrainPhase>,
) where
    S: RequestPath,
{
    let started = tokio::time::Instant::now();
    let header = proxy_header::accept(
        tcp,
        peer,
        settings.trust.as_ref(),
        settings.handshake_timeout,
    );
    let (tcp, peer) = tokio::select! {
        read = header => match read {
            Ok(found) => found,
            Err(refused) => {
                tracing::debug!(%peer, %refused, "connection refused");
                settings.refused(refused.reason());
                return;
            }
        },
        () = phase_reached(&mut drain, DrainPhase::Close) => return,
    };
    let _source = match connections.admit_source(peer.ip()) {
        Ok(guard) => guard,
        Err(full) => {
            tracing::debug!(%peer, "connection refused: too many from this source");
            settings.refused(full.reason());
            super::reset_on_close(tcp.get_ref());
            return;
        }
    };
    // Each handshake takes the configuration current at accept, so a reload affects new
    // connections only.
    let acceptor = TlsAcceptor::from(tls.current());
    let handshake =
        tokio::time::timeout_at(started + settings.handshake_timeout, acceptor.accept(tcp));
    let stream = tokio::select! {
        done = handshake => match done {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => {
                tracing::debug!(%peer, %error, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
        () = phase_reached(&mut drain, DrainPhase::Close) => return,
    };
    let client_chain = stream
        .get_ref()
        .1
        .peer_certificates()
        .map(|chain| Arc::new(chain.iter().map(|c| c.clone().into_owned()).collect()));
    serve_http(
        TokioIo::new(stream),
        Peer {
            addr: peer,
            client_chain,
            started,
        },
        &settings,
        service,
        drain,
    )
    .await;
}

/// Who is on an established connection, and since when.
pub(super) struct Peer {
    /// The client's address.
    pub(super) addr: SocketAddr,
    /// The client certificate chain the handshake verified, if any.
    pub(super) client_chain: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// When the connection was accepted: the unauthenticated timeout runs from here.
    pub(super) started: tokio::time::Instant,
}

/// Serves HTTP/1.1 or HTTP/2 on a connection past its PROXY header and TLS handshake until
/// it closes, is idle, does not authenticate, or the drain closes it.
pub(super) async fn serve_http<I, S>(
    io: I,
    peer: Peer,
    settings: &Settings,
    service: S,
    mut drain: watch::Receiver<DrainPhase>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: RequestPath,
{
    let Peer {
        addr: peer,
        client_chain,
        started,
    } = peer;
    let (requests, mut open_rx) = Requests::new();
    let goaway = Arc::new(Notify::new());
    let auth = Arc::new(ConnAuth::new(settings.max_unauthenticated_requests));
    let tracked = Tracked {
        inner: service,
        peer,
        peer_ip: ip_header(peer),
        client_chain,
        client_user: Arc::default(),
        auth: auth.clone(),
        requests,
        goaway: goaway.clone(),
        goaway_chance: settings.goaway_chance,
    };
    let conn = settings.builder.serve_connection_with_upgrades(io, tracked);
    tokio::pin!(conn);

    let mut shutting_down = false;
    let mut drain_open = true;
    let auth_deadline = tokio::time::sleep_until(started + settings.unauthenticated_timeout);
    tokio::pin!(auth_deadline);
    let mut auth_pending = true;
    let mut extensions = 0;
    let hard_close = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(hard_close);
    let mut closing = false;
    // A handshake that finished while the drain moved on: the loop below only sees changes
    // from here on.
    match *drain.borrow_and_update() {
        DrainPhase::Serving => {}
        DrainPhase::GoAway => {
            conn.as_mut().graceful_shutdown();
            shutting_down = true;
        }
        DrainPhase::Close => return,
    }
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(error) = done {
                    tracing::debug!(%peer, %error, "client connection ended with an error");
                }
                return;
            }
            () = idle(&mut open_rx, settings.header_read_timeout, settings.idle_timeout) => {
                if shutting_down {
                    // Told to go away a whole idle period ago and still here with nothing
                    // open: the client is not cooperating.
                    tracing::debug!(%peer, "closing a connection that ignored its shutdown");
                    return;
                }
                tracing::debug!(%peer, "closing an idle connection");
                conn.as_mut().graceful_shutdown();
                shutting_down = true;
            }
            () = &mut auth_deadline, if auth_pending => {
                if extensions < MAX_EXTENSIONS && auth.deserves_more_time() {
                    // A review still running or refused by Bulwark's own budget (an
                    // apiserver outage, a restart's backlog) is not the client's fault; a
                    // flood that keeps the budget spent gets no more than a few periods.
                    extensions += 1;
                    auth_deadline
                        .as_mut()
                        .reset(tokio::time::Instant::now() + settings.unauthenticated_timeout);
                    continue;
                }
                auth_pending = false;
                if !auth.authenticated() {
                    tracing::debug!(%peer, "closing a connection that never authenticated");
                    settings.closed("unauthenticated_timeout");
                    conn.as_mut().graceful_shutdown();
                    shutting_down = true;
                    hard_close.as_mut().reset(tokio::time::Instant::now() + LAST_WORDS);
                    closing = true;
                }
            }
            () = auth.give_up.notified(), if !closing => {
                tracing::debug!(%peer, "closing a connection whose credentials keep failing");
                settings.closed("unauthenticated_requests");
                conn.as_mut().graceful_shutdown();
                shutting_down = true;
                hard_close.as_mut().reset(tokio::time::Instant::now() + LAST_WORDS);
                closing = true;
            }
            // GOAWAY lets the last refusals reach the client; a hostile one that holds its
            // streams open gets no longer than this.
            () = &mut hard_close, if closing => return,
            () = goaway.notified(), if !shutting_down => {
                tracing::debug!(%peer, "GOAWAY chance: asking the client to reconnect");
                conn.as_mut().graceful_shutdown();
                shutting_down = true;
            }
            changed = drain.changed(), if drain_open => {
                if changed.is_err() {
                    // Nobody can drain any more; keep serving.
                    drain_open = false;
                    continue;
                }
                match *drain.borrow_and_update() {
                    DrainPhase::Serving => {}
                    DrainPhase::GoAway => if !shutting_down {
                        conn.as_mut().graceful_shutdown();
                        shutting_down = true;
                    },
                    DrainPhase::Close => return,
                }
            }
        }
    }
}

/// Resolves once the drain reaches `phase`; never, if the drain sender is gone first.
pub(super) async fn phase_reached(drain: &mut watch::Receiver<DrainPhase>, phase: DrainPhase) {
    if drain.wait_for(|current| *current >= phase).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What the idle timer needs to know about a connection's requests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Activity {
    /// Whether a request's response has not ended yet (a watch counts until its stream
    /// ends).
    busy: bool,
    /// Whether any request has arrived yet.
    started: bool,
}

/// A connection's open requests: counted on every request, told to the idle timer only when
/// the connection goes from idle to busy or back. Under load it never does, so the
/// connection's task is not woken twice per request for it (`notify_waiters` and the
/// connection's poll were about 2% of a saturated core).
struct Requests {
    open: AtomicUsize,
    activity: watch::Sender<Activity>,
}

impl Requests {
    fn new() -> (Arc<Requests>, watch::Receiver<Activity>) {
        let (activity, rx) = watch::channel(Activity::default());
        let requests = Requests {
            open: AtomicUsize::new(0),
            activity,
        };
        (Arc::new(requests), rx)
    }

    /// Tells the idle timer whether anything is open now. Called after every crossing of
    /// zero, it reads the count then, so the last one called after the last crossing
    /// leaves the right state even when two race.
    fn publish(&self) {
        self.activity.send_if_modified(|a| {
            let now = Activity {
                busy: self.open.load(Ordering::Acquire) > 0,
                started: true,
            };
            std::mem::replace(a, now) != now
        });
    }
}

/// Resolves when the connection has had no open request for the idle limit. Before its first
/// request a connection gets only the header read timeout: a client that completes TLS and
/// then sends nothing (or trickles an HTTP/2 HEADERS frame) does not hold a slot for the
/// whole idle timeout.
async fn idle(activity: &mut watch::Receiver<Activity>, first: Duration, limit: Duration) {
    loop {
        let now = *activity.borrow_and_update();
        let changed = if now.busy {
            activity.changed().await
        } else {
            let limit = if now.started { limit } else { first.min(limit) };
            match tokio::time::timeout(limit, activity.changed()).await {
                Ok(changed) => changed,
                Err(_) => return,
            }
        };
        if changed.is_err() {
            // The service (and with it the sender) is gone: the connection is ending anyway.
            std::future::pending::<()>().await;
        }
    }
}

/// Counts one open request from its arrival until its response body ends or is dropped.
struct OpenGuard(Arc<Requests>);

impl OpenGuard {
    fn new(requests: Arc<Requests>) -> Self {
        if requests.open.fetch_add(1, Ordering::AcqRel) == 0 {
            requests.publish();
        }
        Self(requests)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.publish();
        }
    }
}

/// `peer`'s IP as a header value, whose clones share its bytes.
fn ip_header(peer: SocketAddr) -> HeaderValue {
    let value = HeaderValue::from_maybe_shared(Bytes::from(peer.ip().to_string()))
        .expect("an IP address is a valid header value");
    // Cloned once here, so that the value's buffer is shared from the start and every
    // request's clone only counts a reference.
    drop(value.clone());
    value
}

/// The service hyper drives: inserts [`ConnInfo`], counts open requests, rolls the GOAWAY
/// chance, and hands the request to the caller's tower service.
#[derive(Clone)]
struct Tracked<S> {
    inner: S,
    peer: SocketAddr,
    peer_ip: HeaderValue,
    client_chain: Option<Arc<Vec<CertificateDer<'static>>>>,
    client_user: Arc<std::sync::OnceLock<Result<Arc<crate::identity::User>, String>>>,
    auth: Arc<ConnAuth>,
    requests: Arc<Requests>,
    goaway: Arc<Notify>,
    goaway_chance: f64,
}

impl<S> hyper::service::Service<Request<Incoming>> for Tracked<S>
where
    S: RequestPath,
{
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = TrackedAnswer<S>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        let guard = OpenGuard::new(self.requests.clone());
        let http2 = req.version() == Version::HTTP_2;
        req.extensions_mut().insert(ConnInfo {
            peer: self.peer,
            peer_ip: self.peer_ip.clone(),
            client_chain: self.client_chain.clone(),
            client_user: self.client_user.clone(),
            http2,
            auth: self.auth.clone(),
        });
        let goaway =
            (http2 && self.goaway_chance > 0.0 && rand::random::<f64>() < self.goaway_chance)
                .then(|| self.goaway.clone());
        TrackedAnswer {
            answer: self.inner.clone().oneshot(req),
            guard: Some(guard),
            goaway,
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner service's answer to one request, whose body keeps the request counted as
    /// open. A future of its own rather than a boxed `async` block: the inner service's
    /// future is boxed already, and this saves every request a second allocation and a
    /// copy of it.
    struct TrackedAnswer<S>
    where
        S: RequestPath,
    {
        #[pin]
        answer: tower::util::Oneshot<S, Request<Incoming>>,
        guard: Option<OpenGuard>,
        goaway: Option<Arc<Notify>>,
    }
}

impl<S: RequestPath> Future for TrackedAnswer<S> {
    type Output = Result<Response<TrackedBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = std::task::ready!(this.answer.poll(cx))?;
        // After the response head: GOAWAY lets this stream (and any other in flight)
        // finish while new requests go to a new connection.
        if let Some(goaway) = this.goaway.take() {
            goaway.notify_one();
        }
        let guard = this.guard.take();
        Poll::Ready(Ok(response.map(|inner| TrackedBody { inner, guard })))
    }
}

/// A response body that keeps its request counted as open until it ends or is dropped.
pub(super) struct TrackedBody {
    inner: Body,
    guard: Option<OpenGuard>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let frame = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if !matches!(frame, Some(Ok(_))) {
            this.guard = None;
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn idle_counts_only_time_with_nothing_open() {
        let (tx, mut rx) = Requests::new();
        let first = Duration::from_secs(1);
        let limit = Duration::from_secs(10);
        let start = tokio::time::Instant::now();

        // Before any request: the short first limit.
        idle(&mut rx, first, limit).await;
        assert_eq!(start.elapsed(), first);

        // A request open for a long time (a quiet watch) is never idle.
        let guard = OpenGuard::new(tx.clone());
        let waited = tokio::time::timeout(Duration::from_secs(3600), idle(&mut rx, first, limit));
        assert!(waited.await.is_err(), "an open request is not idle");

        // Once it ends, the full idle limit runs from that moment.
        let ended = tokio::time::Instant::now();
        drop(guard);
        idle(&mut rx, first, limit).await;
        assert_eq!(ended.elapsed(), limit);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn activity_restarts_the_idle_clock() {
        let (tx, mut rx) = Requests::new();
        let limit = Duration::from_secs(10);
        drop(OpenGuard::new(tx.clone()));
        let start = tokio::time::Instant::now();
        let tx2 = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(6)).await;
            drop(OpenGuard::new(tx2));
        });
        idle(&mut rx, limit, limit).await;
        assert_eq!(start.elapsed(), Duration::from_secs(16));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_body_releases_its_request_when_it_ends_or_is_dropped() {
        use http_body_util::BodyExt;
        let (tx, rx) = Requests::new();

        let mut body = TrackedBody {
            inner: crate::full("done"),
            guard: Some(OpenGuard::new(tx.clone())),
        };
        assert!(rx.borrow().busy);
        while body.frame().await.is_some() {}
        assert!(!rx.borrow().busy, "released at the end, before the drop");

        let body = TrackedBody {
            inner: crate::full("never read"),
            guard: Some(OpenGuard::new(tx.clone())),
        };
        assert!(rx.borrow().busy);
        drop(body);
        assert!(!rx.borrow().busy);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_idle_timer_hears_only_of_idle_and_busy() {
        let (tx, mut rx) = Requests::new();
        let first = OpenGuard::new(tx.clone());
        assert!(rx.has_changed().unwrap() && rx.borrow_and_update().busy);
        // More requests while one is open, and some ending: still busy, nothing to wake for.
        let second = OpenGuard::new(tx.clone());
        drop(OpenGuard::new(tx.clone()));
        drop(first);
        assert!(!rx.has_changed().unwrap(), "no change while busy");
        drop(second);
        assert!(rx.has_changed().unwrap() && !rx.borrow_and_update().busy);
    }
}
