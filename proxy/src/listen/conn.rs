//! One client connection: the first byte, the PROXY header and the per-source cap, TLS
//! handshake (where the listener has TLS), HTTP/1.1
//! or HTTP/2, open-request counting for the idle timeout, closing connections that do not
//! authenticate, the GOAWAY chance, and the drain phases.

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures::task::AtomicWaker;
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

use super::caps::{ConnectionGuard, Connections, SourceGuard};
use super::proxy_header::{self, Refused, Trust};
use super::tls::TlsState;
use super::{ConnAuth, ConnInfo, DrainPhase, RequestPath, Watching};
use crate::metrics::Metrics;
use crate::{Body, BoxError, config};
use prometheus::IntCounterVec;

/// How many more `unauthenticatedTimeout` periods a connection gets whose requests could
/// not be identified through no fault of its own.
const MAX_EXTENSIONS: u32 = 2;

/// How long a connection closed for not authenticating has to flush its last answers.
const LAST_WORDS: Duration = Duration::from_secs(1);

/// The authentication deadline where nothing authenticates: never looked at.
const NEVER_AUTHENTICATES: Duration = Duration::from_secs(3600);

/// hyper refuses an HTTP/1 read buffer smaller than this.
const MIN_H1_BUFFER: usize = 8192;

/// Everything a connection needs that is the same for all connections.
pub(super) struct Settings {
    builder: auto::Builder<TokioExecutor>,
    first_byte_timeout: Duration,
    proxy_header_timeout: Duration,
    handshake_timeout: Duration,
    header_read_timeout: Duration,
    idle_timeout: Duration,
    goaway_chance: f64,
    trust: Option<Trust>,
    /// `None` where nothing authenticates (the admin listener).
    unauthenticated_timeout: Option<Duration>,
    max_unauthenticated_requests: u32,
    /// `bulwark_connections_refused_total` or the admin listener's.
    refused: IntCounterVec,
    /// `bulwark_connections_closed_total` or the admin listener's.
    closed: IntCounterVec,
}

impl Settings {
    /// The client listener's.
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
            first_byte_timeout: limits.first_byte_timeout,
            proxy_header_timeout: limits.proxy_header_timeout,
            handshake_timeout: limits.handshake_timeout,
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            goaway_chance: cfg.goaway_chance.clamp(0.0, 1.0),
            trust: Trust::from_config(cfg.proxy_protocol.as_ref()),
            unauthenticated_timeout: Some(limits.unauthenticated_timeout),
            max_unauthenticated_requests: limits.max_unauthenticated_requests,
            refused: metrics.connections_refused_total.clone(),
            closed: metrics.connections_closed_total.clone(),
        }
    }

    /// The admin listener's: its own timeouts, hyper's defaults otherwise, no PROXY
    /// protocol, no GOAWAY chance, nothing that authenticates.
    pub(super) fn admin(limits: &config::AdminLimits, metrics: &Metrics) -> Self {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout);
        builder.http2().timer(TokioTimer::new());
        Self {
            builder,
            first_byte_timeout: limits.first_byte_timeout,
            proxy_header_timeout: limits.handshake_timeout,
            handshake_timeout: limits.handshake_timeout,
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            goaway_chance: 0.0,
            trust: None,
            unauthenticated_timeout: None,
            max_unauthenticated_requests: u32::MAX,
            refused: metrics.admin_connections_refused_total.clone(),
            closed: metrics.admin_connections_closed_total.clone(),
        }
    }

    /// Whether connections from `peer` are counted against their source at accept: all but
    /// a trusted balancer's, whose PROXY header names the client to count.
    pub(super) fn counted_at_accept(&self, peer: IpAddr) -> bool {
        !self.trust.as_ref().is_some_and(|trust| trust.trusts(peer))
    }

    /// Counts a connection refused before its handshake.
    pub(super) fn refused(&self, reason: &'static str) {
        self.refused.with_label_values(&[reason]).inc();
    }

    /// Counts a connection Bulwark closed.
    pub(super) fn closed(&self, reason: &'static str) {
        self.closed.with_label_values(&[reason]).inc();
    }
}

/// A connection past its first steps (first byte, PROXY header, TLS): what serves it until
/// it closes, and its client's place in the source caps, held as long.
type Serving<'a> = (Pin<Box<dyn Future<Output = ()> + Send + 'a>>, SourceGuard);

/// Serves one accepted TCP connection until it closes, is idle, does not authenticate, is
/// evicted, or the drain closes it: the first byte, the PROXY header and the client's
/// source cap, TLS where the listener has it, then HTTP. `source` holds the peer's place
/// in the source caps where it was counted at accept; `slot`, its place among the
/// connections, which a new one may take until it authenticates.
///
/// The steps before HTTP run in a box of their own, freed once they are done: a task is
/// as large as the largest state of its future, and every idle connection would otherwise
/// keep room for its TLS handshake (its task was 9.9 KB; now 0.5 KB, beside HTTP's state
/// in boxes of their own size).
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve<S>(
    tcp: TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<TlsState>>,
    settings: Arc<Settings>,
    connections: Connections,
    (slot, source): (ConnectionGuard, SourceGuard),
    service: S,
    drain: watch::Receiver<DrainPhase>,
) where
    S: RequestPath,
{
    // Each future is written inside `select!`, which holds it: one made before would
    // be held twice.
    tokio::select! {
        () = async {
            let establishing = Box::pin(establish(
                tcp,
                peer,
                tls,
                &settings,
                connections,
                (&slot, source),
                service,
                drain,
            ));
            // `.await` takes the box, which is freed when the steps end.
            if let Some((serving, _source)) = establishing.await {
                serving.await;
            }
        } => {}
        // An evicted connection is dropped where it stands: it has not authenticated,
        // so nothing of value is lost.
        () = slot.evicted() => {
            tracing::debug!(%peer, "evicted: a new connection needed its place");
        }
    }
}

/// The steps of [`serve`] before HTTP; `None` when the connection ended in one of them.
// Over 120 lines: a connection's life from accept to HTTP in order (first byte, PROXY
// header, source caps, TLS), each step's deadline and refusal counted where it happens.
#[allow(clippy::too_many_arguments)]
async fn establish<'a, S>(
    tcp: TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<TlsState>>,
    settings: &'a Settings,
    connections: Connections,
    (slot, source): (&'a ConnectionGuard, SourceGuard),
    service: S,
    mut drain: watch::Receiver<DrainPhase>,
) -> Option<Serving<'a>>
where
    S: RequestPath,
{
    let started = tokio::time::Instant::now();
    let deadline = |timeout: Duration| started + timeout.min(settings.handshake_timeout);
    let trusted = !settings.counted_at_accept(peer.ip());
    // Nothing is read before the first byte: a connection that sends none costs a socket
    // and a timer for this long, and nothing more. A trusted balancer's first byte begins
    // its header, which has a deadline of its own.
    if !trusted {
        let mut byte = [0u8; 1];
        let first_byte =
            tokio::time::timeout_at(deadline(settings.first_byte_timeout), tcp.peek(&mut byte));
        tokio::select! {
            peeked = first_byte => match peeked {
                Ok(Ok(n)) if n > 0 => {}
                Ok(_) => return None,
                Err(_) => {
                    tracing::debug!(%peer, "closing a connection that sent nothing");
                    settings.closed("first_byte_timeout");
                    super::reset_on_close(&tcp);
                    return None;
                }
            },
            () = phase_reached(&mut drain, DrainPhase::Close) => return None,
        }
    }
    let header = proxy_header::accept(
        tcp,
        peer,
        settings.trust.as_ref(),
        deadline(
            settings
                .proxy_header_timeout
                .min(settings.first_byte_timeout),
        )
        .saturating_duration_since(tokio::time::Instant::now()),
    );
    let (tcp, peer) = tokio::select! {
        read = header => match read {
            Ok(found) => found,
            Err(Refused::Timeout) => {
                tracing::debug!(%peer, "closing a connection whose PROXY header did not come");
                settings.closed(Refused::Timeout.reason());
                return None;
            }
            Err(refused) => {
                tracing::debug!(%peer, %refused, "connection refused");
                settings.refused(refused.reason());
                return None;
            }
        },
        () = phase_reached(&mut drain, DrainPhase::Close) => return None,
    };
    let source = if trusted {
        match connections.admit_source(peer.ip()) {
            Ok(guard) => guard,
            Err(full) => {
                tracing::debug!(%peer, "connection refused: too many from this source");
                settings.refused(full.reason());
                super::reset_on_close(tcp.get_ref());
                return None;
            }
        }
    } else {
        source
    };
    let Some(tls) = tls else {
        let peer = Peer {
            addr: peer,
            client_chain: None,
            started,
        };
        let http = serve_http(
            TokioIo::new(tcp),
            peer,
            settings,
            service,
            drain,
            Some(slot),
        );
        return Some((Box::pin(http), source));
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
                return None;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                settings.closed("handshake_timeout");
                return None;
            }
        },
        () = phase_reached(&mut drain, DrainPhase::Close) => return None,
    };
    let client_chain = stream
        .get_ref()
        .1
        .peer_certificates()
        .map(|chain| Arc::new(chain.iter().map(|c| c.clone().into_owned()).collect()));
    let http = serve_http(
        TokioIo::new(stream),
        Peer {
            addr: peer,
            client_chain,
            started,
        },
        settings,
        service,
        drain,
        Some(slot),
    );
    Some((Box::pin(http), source))
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
/// it closes, is idle, does not authenticate, or the drain closes it. Once it authenticates,
/// `slot` is no longer evicted.
///
/// Not an `async fn`: one keeps its arguments beside what they were moved into for as long
/// as it runs, and `io` (the TLS stream, over a kilobyte) would be held twice by every idle
/// connection. hyper's connection is made here, in a box of its own size, and the future
/// returned holds only what the loop below needs.
pub(super) fn serve_http<'a, I, S>(
    io: I,
    peer: Peer,
    settings: &'a Settings,
    service: S,
    drain: watch::Receiver<DrainPhase>,
    slot: Option<&'a ConnectionGuard>,
) -> impl Future<Output = ()> + Send + 'a
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: RequestPath,
{
    let Peer {
        addr: peer,
        client_chain,
        started,
    } = peer;
    let requests = Requests::new(started, drain.clone());
    let goaway = Arc::new(Notify::new());
    let auth = Arc::new(ConnAuth::new(settings.max_unauthenticated_requests));
    if let Some(slot) = slot {
        slot.watch(&auth);
    }
    let tracked = Tracked {
        inner: service,
        peer,
        peer_ip: ip_header(peer),
        client_chain,
        client_user: Arc::default(),
        auth: auth.clone(),
        requests: requests.clone(),
        goaway: goaway.clone(),
        goaway_chance: settings.goaway_chance,
    };
    let mut conn = Box::pin(settings.builder.serve_connection_with_upgrades(io, tracked));
    async move {
        let mut control = Control {
            peer,
            settings,
            auth: &auth,
            requests: &requests,
            goaway: &goaway,
            drain,
            drain_open: true,
            shutting_down: false,
            idle_from: tokio::time::Instant::now(),
            auth_deadline: Box::pin(tokio::time::sleep_until(
                started
                    + settings
                        .unauthenticated_timeout
                        .unwrap_or(NEVER_AUTHENTICATES),
            )),
            auth_pending: settings.unauthenticated_timeout.is_some(),
            extensions: 0,
            hard_close: None,
        };
        // A handshake that finished while the drain moved on: the loop below only sees changes
        // from here on.
        match *control.drain.borrow_and_update() {
            DrainPhase::Serving => {}
            DrainPhase::GoAway | DrainPhase::EndWatches => {
                conn.as_mut().graceful_shutdown();
                control.shutting_down = true;
            }
            DrainPhase::Close => return,
        }
        let gate = Gate::new();
        loop {
            let next = control.next();
            tokio::pin!(next);
            gate.open();
            let step = std::future::poll_fn(|cx| {
                if let Poll::Ready(done) = conn.as_mut().poll(cx) {
                    return Poll::Ready(Err(done));
                }
                gate.poll(next.as_mut(), cx).map(Ok)
            })
            .await;
            match step {
                Err(done) => {
                    if let Err(error) = done {
                        tracing::debug!(%peer, %error, "client connection ended with an error");
                        // hyper's own HTTP/1.1 timer, before the first request: the
                        // connection sent no request in time.
                        let timed_out = error
                            .downcast_ref::<hyper::Error>()
                            .is_some_and(hyper::Error::is_timeout);
                        if timed_out && requests.activity() == Activity::NeverUsed {
                            settings.closed("header_read_timeout");
                        }
                    }
                    return;
                }
                Ok(Action::Shutdown) => conn.as_mut().graceful_shutdown(),
                Ok(Action::Close) => return,
            }
        }
    }
}

/// What a connection's [`Control`] asks of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// GOAWAY for HTTP/2, `Connection: close` for HTTP/1.1: open requests finish.
    Shutdown,
    /// Drop the connection now.
    Close,
}

/// What ends a connection besides its client: the idle timer, the authentication deadline,
/// credentials refused too often, the GOAWAY chance and the drain.
struct Control<'a> {
    peer: SocketAddr,
    settings: &'a Settings,
    auth: &'a ConnAuth,
    requests: &'a Requests,
    goaway: &'a Notify,
    drain: watch::Receiver<DrainPhase>,
    /// Whether anybody can still drain (the sender is alive).
    drain_open: bool,
    /// Whether the connection has been told to shut down.
    shutting_down: bool,
    /// The idle clock counts from here at the earliest: the connection's start, then the
    /// shutdown the idle timer asked for.
    idle_from: tokio::time::Instant,
    auth_deadline: Pin<Box<tokio::time::Sleep>>,
    /// Whether the authentication deadline is still to be looked at.
    auth_pending: bool,
    /// Authentication periods added for requests that could not be identified through no
    /// fault of the client's.
    extensions: u32,
    /// When a connection closed for not authenticating is dropped, whatever it has open.
    hard_close: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Control<'_> {
    /// The next thing the connection must do; it has been done to the control's state.
    async fn next(&mut self) -> Action {
        let peer = self.peer;
        loop {
            let closing = self.hard_close.is_some();
            let hard_close = async {
                match self.hard_close.as_mut() {
                    Some(sleep) => sleep.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                // GOAWAY lets the last refusals reach the client; a hostile one that holds
                // its streams open gets no longer than this.
                () = hard_close => return Action::Close,
                never_used = idle(
                    self.requests,
                    self.idle_from,
                    self.settings.header_read_timeout,
                    self.settings.idle_timeout,
                ) => {
                    if never_used && !self.shutting_down {
                        tracing::debug!(%peer, "closing a connection that sent no request");
                        self.settings.closed("header_read_timeout");
                    }
                    if self.shutting_down {
                        // Told to go away a whole idle period ago and still here with
                        // nothing open: the client is not cooperating.
                        tracing::debug!(%peer, "closing a connection that ignored its shutdown");
                        return Action::Close;
                    }
                    tracing::debug!(%peer, "closing an idle connection");
                    self.idle_from = tokio::time::Instant::now();
                    return self.shut_down();
                }
                () = self.auth_deadline.as_mut(), if self.auth_pending => {
                    if self.extensions < MAX_EXTENSIONS && self.auth.deserves_more_time() {
                        // A review still running or refused by Bulwark's own budget (an
                        // apiserver outage, a restart's backlog) is not the client's fault;
                        // a flood that keeps the budget spent gets no more than a few
                        // periods.
                        self.extensions += 1;
                        let next = tokio::time::Instant::now()
                            + self.settings.unauthenticated_timeout.unwrap_or(NEVER_AUTHENTICATES);
                        self.auth_deadline.as_mut().reset(next);
                        continue;
                    }
                    self.auth_pending = false;
                    if !self.auth.authenticated() {
                        tracing::debug!(%peer, "closing a connection that never authenticated");
                        return self.close_soon("unauthenticated_timeout");
                    }
                }
                () = self.auth.give_up.notified(), if !closing => {
                    if self.auth.is_stalled() {
                        tracing::debug!(%peer, "closing a connection whose client does not read");
                        return self.close_soon("client_not_reading");
                    }
                    tracing::debug!(%peer, "closing a connection whose credentials keep failing");
                    return self.close_soon("unauthenticated_requests");
                }
                () = self.goaway.notified(), if !self.shutting_down => {
                    tracing::debug!(%peer, "GOAWAY chance: asking the client to reconnect");
                    return self.shut_down();
                }
                changed = self.drain.changed(), if self.drain_open => {
                    if changed.is_err() {
                        // Nobody can drain any more; keep serving.
                        self.drain_open = false;
                        continue;
                    }
                    let phase = *self.drain.borrow_and_update();
                    match phase {
                        DrainPhase::Serving => {}
                        DrainPhase::GoAway | DrainPhase::EndWatches => if !self.shutting_down {
                            return self.shut_down();
                        },
                        DrainPhase::Close => return Action::Close,
                    }
                }
            }
        }
    }

    fn shut_down(&mut self) -> Action {
        self.shutting_down = true;
        Action::Shutdown
    }

    /// Shuts the connection down for not authenticating, and drops it [`LAST_WORDS`] later.
    fn close_soon(&mut self, reason: &'static str) -> Action {
        self.settings.closed(reason);
        self.hard_close = Some(Box::pin(tokio::time::sleep(LAST_WORDS)));
        self.shut_down()
    }
}

/// Polls a connection's [`Control`] only after one of the signals it waits on woke the
/// task. The task wakes for every request's frames; polling the control's `Notify`s, drain
/// watch and timers on each of those wakes took their locks a dozen times a request.
struct Gate {
    flag: Arc<GateFlag>,
    /// Wakes `flag`'s task through the flag: the waker the control is polled with.
    waker: Waker,
}

struct GateFlag {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for GateFlag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Gate {
    fn new() -> Gate {
        let flag = Arc::new(GateFlag {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Gate {
            waker: Waker::from(flag.clone()),
            flag,
        }
    }

    /// Lets the next [`Gate::poll`] through: a new future has not been polled yet.
    fn open(&self) {
        self.flag.woken.store(true, Ordering::Release);
    }

    /// Polls `future` if something woke it since its last poll (or it is new), with a
    /// waker that wakes `cx`'s task; `Pending` without polling it otherwise.
    fn poll<F: Future>(&self, future: Pin<&mut F>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Registered before the flag is read: a wake between the two is seen by the read.
        self.flag.task.register(cx.waker());
        if !self.flag.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        future.poll(&mut Context::from_waker(&self.waker))
    }
}

/// Resolves once the drain reaches `phase`; never, if the drain sender is gone first.
pub(super) async fn phase_reached(drain: &mut watch::Receiver<DrainPhase>, phase: DrainPhase) {
    if drain.wait_for(|current| *current >= phase).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A connection's open requests and, when none is open, since when. The idle timer reads
/// them when it fires rather than being told of every request: under load a connection is
/// never idle, and at a low rate it goes idle after every request, which woke its task twice
/// a request and re-armed the timer each time.
struct Requests {
    open: AtomicUsize,
    /// When the last request ended, in nanoseconds after `base` plus one; [`UNKNOWN`]
    /// while a request is open or its end is being written, [`NEVER`] before the first.
    idle_since: AtomicU64,
    base: tokio::time::Instant,
    /// The drain, for the bodies of watches, which end at [`DrainPhase::EndWatches`].
    drain: watch::Receiver<DrainPhase>,
}

const UNKNOWN: u64 = 0;
const NEVER: u64 = u64::MAX;

/// What the idle timer finds when it looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Activity {
    /// A request is open (a watch counts until its stream ends).
    Busy,
    /// Nothing has been open since then.
    IdleSince(tokio::time::Instant),
    /// No request has arrived yet.
    NeverUsed,
}

impl Requests {
    fn new(base: tokio::time::Instant, drain: watch::Receiver<DrainPhase>) -> Arc<Requests> {
        Arc::new(Requests {
            open: AtomicUsize::new(0),
            idle_since: AtomicU64::new(NEVER),
            base,
            drain,
        })
    }

    fn activity(&self) -> Activity {
        if self.open.load(Ordering::Acquire) > 0 {
            return Activity::Busy;
        }
        match self.idle_since.load(Ordering::Acquire) {
            NEVER => Activity::NeverUsed,
            // The last request's end is being written: idle from about now.
            UNKNOWN => Activity::IdleSince(tokio::time::Instant::now()),
            since => Activity::IdleSince(self.base + Duration::from_nanos(since - 1)),
        }
    }

    fn opened(&self) {
        if self.open.fetch_add(1, Ordering::AcqRel) == 0 {
            self.idle_since.store(UNKNOWN, Ordering::Release);
        }
    }

    fn closed(&self) {
        if self.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            let since = tokio::time::Instant::now().saturating_duration_since(self.base);
            let since = u64::try_from(since.as_nanos()).unwrap_or(NEVER - 1);
            self.idle_since
                .store(since.saturating_add(1).min(NEVER - 1), Ordering::Release);
        }
    }
}

/// Resolves once the connection has had nothing open for `limit`, counted from `from` at
/// the earliest. Before its first request a connection gets only `first` (the header read
/// timeout): a client that completes TLS and then sends nothing (or trickles an HTTP/2
/// HEADERS frame) does not hold a slot for the whole idle timeout. `true` when no request
/// ever came.
async fn idle(
    requests: &Requests,
    from: tokio::time::Instant,
    first: Duration,
    limit: Duration,
) -> bool {
    let sleep = tokio::time::sleep_until(from + first.min(limit));
    tokio::pin!(sleep);
    loop {
        sleep.as_mut().await;
        let now = tokio::time::Instant::now();
        let end = match requests.activity() {
            // Looked at again a whole period later: an open request ends no sooner.
            Activity::Busy => now + limit,
            Activity::NeverUsed => return true,
            Activity::IdleSince(since) => since.max(from) + limit,
        };
        if end <= now {
            return false;
        }
        sleep.as_mut().reset(end);
    }
}

/// Counts one open request from its arrival until its response body ends or is dropped.
struct OpenGuard(Arc<Requests>);

impl OpenGuard {
    fn new(requests: Arc<Requests>) -> Self {
        requests.opened();
        Self(requests)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.closed();
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
        let ending = match (&guard, response.extensions().get::<Watching>()) {
            (Some(guard), Some(Watching)) => Some(watch_end(guard.0.drain.clone())),
            _ => None,
        };
        Poll::Ready(Ok(response.map(|inner| TrackedBody {
            inner,
            guard,
            ending,
        })))
    }
}

/// Ready once the drain reaches [`DrainPhase::EndWatches`] (or its sender is gone, at which
/// point nothing drains any more and it never is).
fn watch_end(mut drain: watch::Receiver<DrainPhase>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(async move {
        if drain
            .wait_for(|phase| *phase >= DrainPhase::EndWatches)
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
    })
}

/// A response body that keeps its request counted as open until it ends or is dropped; a
/// watch's ends cleanly at [`DrainPhase::EndWatches`], between two of its frames while it
/// waits for the next (whole events in JSON, protobuf and CBOR; a relayed watch in a
/// framing Bulwark does not read passes raw chunks, and its end can cut one as Close
/// would).
pub(super) struct TrackedBody {
    inner: Body,
    guard: Option<OpenGuard>,
    ending: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if !matches!(frame, Some(Ok(_))) {
                this.guard = None;
            }
            return Poll::Ready(frame);
        }
        // A watch waits for its next event: the drain is asked only then (a lock, where a
        // frame ready costs nothing more), and an event ready is always sent first.
        if let Some(ending) = &mut this.ending
            && ending.as_mut().poll(cx).is_ready()
        {
            this.ending = None;
            this.guard = None;
            // The stream ends here, and the inner body (a cached watch, or the relay of an
            // apiserver's, whose upstream stream is reset) is dropped now.
            this.inner = crate::empty();
            return Poll::Ready(None);
        }
        Poll::Pending
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

    /// A connection's stream larger than a TLS stream: what serves HTTP must not hold it
    /// beside hyper's connection, which has it already.
    struct Bulky([u8; 4096]);

    impl hyper::rt::Read for Bulky {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: hyper::rt::ReadBufCursor<'_>,
        ) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl hyper::rt::Write for Bulky {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Poll::Ready(Ok(buf.len().min(self.0.len())))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// What an idle connection's task holds: none of the room its first steps needed (the
    /// TLS handshake's state alone is over a kilobyte), and what serves HTTP neither its
    /// stream nor hyper's connection, which sits in a box of its own size. Before, the task
    /// was 9.9 KB, and what serves HTTP 7.9 KB: hyper's connection with the TLS stream in it,
    /// and the stream again, kept as the argument of an `async fn`.
    #[tokio::test]
    async fn a_connections_task_keeps_no_room_for_its_first_steps() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (tcp, peer) = listener.accept().await.unwrap();
        let metrics = Metrics::new();
        let settings = Arc::new(Settings::admin(&config::AdminLimits::default(), &metrics));
        let connections = Connections::new(
            &config::ListenLimits::default(),
            prometheus::IntGauge::new("open", "open").unwrap(),
        );
        let admitted = connections.admit(peer.ip(), true).unwrap();
        let service = tower::service_fn(|_: Request<Incoming>| async {
            Ok::<_, Infallible>(Response::new(crate::empty()))
        });
        let (_drain_tx, drain) = watch::channel(DrainPhase::Serving);

        let http = std::mem::size_of_val(&serve_http(
            Bulky([0; 4096]),
            Peer {
                addr: peer,
                client_chain: None,
                started: tokio::time::Instant::now(),
            },
            &settings,
            service,
            drain.clone(),
            None,
        ));
        assert!(
            http < 1_500,
            "serving HTTP over a 4 KiB stream holds {http} bytes beside hyper's connection"
        );

        let task = std::mem::size_of_val(&serve(
            tcp,
            peer,
            None,
            settings.clone(),
            connections.clone(),
            (admitted.guard, admitted.source),
            service,
            drain,
        ));
        assert!(task < 1_000, "a connection's task holds {task} bytes");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn idle_counts_only_time_with_nothing_open() {
        let start = tokio::time::Instant::now();
        let tx = Requests::new(start, watch::channel(DrainPhase::Serving).1);
        let first = Duration::from_secs(1);
        let limit = Duration::from_secs(10);

        // Before any request: the short first limit.
        idle(&tx, start, first, limit).await;
        assert_eq!(start.elapsed(), first);

        // A request open for a long time (a quiet watch) is never idle.
        let guard = OpenGuard::new(tx.clone());
        let waited =
            tokio::time::timeout(Duration::from_secs(3600), idle(&tx, start, first, limit));
        assert!(waited.await.is_err(), "an open request is not idle");

        // Once it ends, the full idle limit runs from that moment, also for a timer that
        // was waiting when it ended.
        let waiting = tokio::spawn({
            let tx = tx.clone();
            async move { idle(&tx, start, first, limit).await }
        });
        tokio::time::sleep(Duration::from_secs(7)).await;
        let ended = tokio::time::Instant::now();
        drop(guard);
        idle(&tx, start, first, limit).await;
        assert_eq!(ended.elapsed(), limit);
        waiting.await.expect("the waiting timer");
        assert_eq!(ended.elapsed(), limit);

        // Counted from a later start (the shutdown it asked for) when given one.
        let from = tokio::time::Instant::now();
        idle(&tx, from, first, limit).await;
        assert_eq!(from.elapsed(), limit);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn activity_restarts_the_idle_clock() {
        let start = tokio::time::Instant::now();
        let tx = Requests::new(start, watch::channel(DrainPhase::Serving).1);
        let limit = Duration::from_secs(10);
        drop(OpenGuard::new(tx.clone()));
        let tx2 = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(6)).await;
            drop(OpenGuard::new(tx2));
        });
        idle(&tx, start, limit, limit).await;
        assert_eq!(start.elapsed(), Duration::from_secs(16));
    }

    /// Counts its wakes.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn requests_do_not_wake_the_idle_timer() {
        let start = tokio::time::Instant::now();
        let tx = Requests::new(start, watch::channel(DrainPhase::Serving).1);
        let limit = Duration::from_secs(10);
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let timer = idle(&tx, start, limit, limit);
        tokio::pin!(timer);
        assert!(timer.as_mut().poll(&mut cx).is_pending());
        // Requests come and go, one at a time and several at once.
        for _ in 0..100 {
            let one = OpenGuard::new(tx.clone());
            let two = OpenGuard::new(tx.clone());
            drop(one);
            drop(two);
        }
        tokio::task::yield_now().await;
        assert_eq!(wakes.0.load(Ordering::Relaxed), 0, "no request woke it");
        assert_eq!(tx.activity(), Activity::IdleSince(start));
    }

    #[test]
    fn the_gate_polls_a_future_only_after_it_was_woken() {
        let gate = Gate::new();
        let polls = AtomicUsize::new(0);
        let its_waker = std::sync::Mutex::new(None::<Waker>);
        let counted = std::future::poll_fn(|cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            *its_waker.lock().unwrap() = Some(cx.waker().clone());
            Poll::<()>::Pending
        });
        let mut counted = std::pin::pin!(counted);
        let task = Arc::new(Wakes::default());
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);

        // A new future is polled.
        assert!(gate.poll(counted.as_mut(), &mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 1);
        // The task's other wakes (a request's frames) do not poll it.
        for _ in 0..10 {
            assert!(gate.poll(counted.as_mut(), &mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::Relaxed), 1);
        // Its own wake reaches the task, and the next poll polls it.
        its_waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(task.0.load(Ordering::Relaxed), 1);
        assert!(gate.poll(counted.as_mut(), &mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 2);
        // Opened for a new future: polled.
        gate.open();
        assert!(gate.poll(counted.as_mut(), &mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 3);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_body_releases_its_request_when_it_ends_or_is_dropped() {
        use http_body_util::BodyExt;
        let tx = Requests::new(
            tokio::time::Instant::now(),
            watch::channel(DrainPhase::Serving).1,
        );

        let mut body = TrackedBody {
            inner: crate::full("done"),
            guard: Some(OpenGuard::new(tx.clone())),
            ending: None,
        };
        assert_eq!(tx.activity(), Activity::Busy);
        while body.frame().await.is_some() {}
        assert_ne!(
            tx.activity(),
            Activity::Busy,
            "released at the end, before the drop"
        );

        let body = TrackedBody {
            inner: crate::full("never read"),
            guard: Some(OpenGuard::new(tx.clone())),
            ending: None,
        };
        assert_eq!(tx.activity(), Activity::Busy);
        drop(body);
        assert_ne!(tx.activity(), Activity::Busy);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_watchs_body_ends_cleanly_between_frames_when_the_drain_ends_the_watches() {
        use http_body_util::BodyExt;
        let (drain, rx) = watch::channel(DrainPhase::Serving);
        let tx = Requests::new(tokio::time::Instant::now(), rx.clone());
        // A watch that sent one event and waits for the next.
        let (events, frames) = futures::channel::mpsc::unbounded::<Bytes>();
        events
            .unbounded_send(Bytes::from_static(b"{\"type\":\"ADDED\"}\n"))
            .unwrap();
        let inner = http_body_util::StreamBody::new(futures::StreamExt::map(frames, |b| {
            Ok::<_, BoxError>(Frame::data(b))
        }))
        .boxed_unsync();
        let mut body = TrackedBody {
            inner,
            guard: Some(OpenGuard::new(tx.clone())),
            ending: Some(watch_end(rx)),
        };
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"{\"type\":\"ADDED\"}\n");
        drain.send(DrainPhase::GoAway).unwrap();
        let waiting = tokio::time::timeout(Duration::from_secs(1), body.frame()).await;
        assert!(waiting.is_err(), "GOAWAY lets the watch go on");
        drain.send(DrainPhase::EndWatches).unwrap();
        assert!(body.frame().await.is_none(), "ended cleanly, no error");
        assert!(http_body::Body::is_end_stream(&body));
        assert_ne!(
            tx.activity(),
            Activity::Busy,
            "its request is no longer open"
        );
        // The watch itself is let go at once (a relayed one resets its upstream stream).
        assert!(events.is_closed(), "the ended watch's body was kept");
        assert!(body.frame().await.is_none());
    }
}
