//! The apiserver replicas: connection pool, per-request pick, health, retries (step 8).
//!
//! [`Upstream::send`] takes a request whose identity headers are already rewritten, picks a
//! replica ([`pick`]), takes a stream slot on a pooled HTTP/2 connection for the request's
//! credential ([`pool`]), and returns the response head with a streaming body ([`body`]).
//! Failures that provably never reached an apiserver are retried for every request; a read
//! is also retried when it may have arrived; a write that may have arrived never is.
//! Upgrades (exec, attach, port-forward) get their own HTTP/1.1 connection and are spliced.

mod body;
mod buffer;
mod pick;
mod pool;
mod tls;

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::Authority;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::Body;
use crate::config;
use crate::metrics::Metrics;
use crate::report::{Chain, SharedError, find_source};

use body::{Framing, OnFailure};
use pick::{Balancer, EjectCause, Load, Now, PendingGuard, ReplicaWatch, RetryReason};
use pool::{Lease, Pool, ReqBody};

pub use buffer::{
    BodyBudget, BodyDeadlines, BodyFlow, BodyStall, BudgetScope, Held as BodyHeld, declared_length,
    read as read_body,
};
pub use tls::UpstreamTls;

/// Largest request body of Bulwark's own requests, and the default of
/// `listen.limits.maxBodyBytes`: the apiserver's own limit. Bodies are buffered so that a
/// retry can send them again ([`buffer`]).
pub const MAX_REQUEST_BODY: usize = 3 * 1024 * 1024;

/// Which upstream credential a request travels with; each has its own connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamCredential {
    /// The front-proxy client certificate: users' requests with `X-Remote-*` headers.
    FrontProxy,
    /// Bulwark's own identity (client certificate, or TLS plus its bearer token): reviews,
    /// informers, impersonation and `/readyz` probes.
    Own,
    /// TLS without a client certificate: the anonymous allowlist and passthrough-mode
    /// tokens, on connections of their own because an anonymous request on a shared
    /// HTTP/2 connection can make the apiserver tear that connection down.
    Anonymous,
}

/// When a failed request may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Retried on another replica while no response byte has reached the client.
    Read,
    /// Retried only when it provably never reached an apiserver.
    Write,
}

/// What the pool needs to know about a request.
#[derive(Debug, Clone)]
pub struct Route {
    /// The credential it travels with.
    pub credential: UpstreamCredential,
    /// When it may be retried.
    pub retry: RetryPolicy,
    /// Watch, `follow`, upgrade: no request timeout.
    pub long_running: bool,
    /// Balanced by watch count and counted in `upstream_watches`; a failure mid-stream
    /// ends the body cleanly (clients watch again).
    pub watch: bool,
    /// Time allowed until the response head, every attempt together; ignored for
    /// long-running requests.
    pub timeout: Option<Duration>,
    /// Time allowed to one attempt on one replica until its response head, for a read;
    /// after it the read goes to another replica (`upstream.timeouts.attempt`). Ignored
    /// for writes, which are never sent twice.
    pub attempt_timeout: Option<Duration>,
    /// The request's own deadline (its `timeout` parameter), after which the apiserver ends
    /// it: a read cut off past it is not sent again, the client has stopped waiting.
    pub client_timeout: Option<Duration>,
    /// The replica that holds this LIST's bytes ([`Upstream::hold_list_bytes`]): the first
    /// attempt goes there while it is in rotation, so the bytes are counted where they land.
    pub replica: Option<Arc<str>>,
    /// The flow whose share of the request-body budget holds the body while it may be
    /// sent again; `None` holds it outside any flow's share.
    pub body_flow: Option<BodyFlow>,
}

/// A replica's state, for `/debug` and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaView {
    /// The address as configured.
    pub name: String,
    /// In rotation.
    pub healthy: bool,
    /// Requests waiting for their response head.
    pub pending: u64,
    /// Open watch streams.
    pub watches: u64,
    /// In-flight LIST bytes as reported by admission.
    pub in_flight_bytes: u64,
    /// Open pooled HTTP/2 connections, all credentials together.
    pub connections: usize,
    /// Counted heavier in the pick after a 429 of its own (not a flow's APF rejection).
    pub throttled: bool,
}

/// LIST bytes counted against a replica while this lives (see
/// [`Upstream::hold_in_flight_bytes`]).
pub struct InFlightBytes {
    replica: Arc<pick::Replica>,
    bytes: u64,
}

impl InFlightBytes {
    /// The replica the bytes are held on.
    pub fn replica(&self) -> &Arc<str> {
        &self.replica.name
    }
}

impl std::fmt::Debug for InFlightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightBytes")
            .field("replica", &self.replica.name)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for InFlightBytes {
    fn drop(&mut self) {
        self.replica.remove_bytes(self.bytes);
    }
}

/// Response extension naming the replica that answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamReplica(pub Arc<str>);

/// Why a request could not be forwarded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    /// No replica took the request: every attempt failed before reaching an apiserver.
    #[error("no apiserver replica could take the request")]
    NoHealthyReplica {
        /// When the client should try again.
        retry_after: Duration,
    },
    /// No response head within the route's timeout (or, for a read that no other replica
    /// could take, within its attempt limit).
    #[error(
        "{} did not answer in time",
        replica.as_ref().map_or("the apiserver".to_owned(), |r| format!("apiserver {r}"))
    )]
    Timeout {
        /// The replica that was waited on, when the request had reached one.
        replica: Option<Arc<str>>,
    },
    /// TCP connect to a replica failed, or took longer than the connect timeout.
    #[error("cannot connect to apiserver {replica}")]
    Connect {
        /// The replica, as configured.
        replica: Arc<str>,
        /// What the connect said.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// TLS handshake with a replica failed.
    #[error("TLS with apiserver {replica}")]
    Tls {
        /// The replica, as configured.
        replica: Arc<str>,
        /// What the handshake said.
        #[source]
        source: Arc<TlsFailure>,
    },
    /// The HTTP/2 or HTTP/1.1 exchange with a replica failed.
    #[error("apiserver {replica}")]
    Protocol {
        /// The replica, as configured.
        replica: Arc<str>,
        /// What hyper said.
        #[source]
        source: SharedError,
    },
    /// The connection failed after the request may have reached the apiserver; it is a
    /// write, so it was not sent again. The source is the failure, naming the replica.
    #[error("the request may have reached the apiserver but no answer came; not retried")]
    Interrupted(#[source] Arc<UpstreamError>),
    /// The request body is larger than the largest allowed (the bytes).
    #[error("the request body is larger than {0} bytes")]
    BodyTooLarge(usize),
    /// Holding the request body would pass the budget of request bodies held at once.
    #[error("the request bodies held for {0} would pass their budget; retry later")]
    BodyBudget(BudgetScope),
    /// The client's request body came too slowly ([`read_body`]).
    #[error("the request body stalled: {0}")]
    BodyStalled(BodyStall),
    /// The client's request body could not be read.
    #[error("reading the request body")]
    RequestBody(#[source] SharedError),
    /// An upgrade was asked for on a connection that cannot upgrade (HTTP/2).
    #[error("the request asks for an upgrade its connection cannot make")]
    NotUpgradable,
    /// The route names a credential that is not configured.
    #[error("no {0:?} credential is configured")]
    MissingCredential(UpstreamCredential),
    /// The configuration cannot be used.
    #[error("upstream configuration: {0}")]
    Config(String),
    /// A file the configuration names cannot be used: the CA bundle, a client certificate
    /// or key, or the own token file.
    #[error("upstream configuration: {}", path.display())]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Why it cannot be used.
        #[source]
        source: SharedError,
    },
    /// The TLS settings cannot be built.
    #[error("upstream configuration: {what}")]
    Rustls {
        /// Which part.
        what: &'static str,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
}

/// Why a TLS connection to a replica could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TlsFailure {
    /// The handshake failed.
    #[error(transparent)]
    Handshake(std::io::Error),
    /// The handshake agreed on another application protocol than the one asked for.
    #[error("negotiated protocol {got:?}, wanted {wanted:?}")]
    Alpn {
        /// What the replica chose, if anything.
        got: Option<String>,
        /// What Bulwark asked for.
        wanted: String,
    },
}

impl UpstreamError {
    /// A failed exchange with `replica`.
    pub(crate) fn protocol(replica: &Arc<str>, source: hyper::Error) -> Self {
        UpstreamError::Protocol {
            replica: replica.clone(),
            source: Arc::new(source),
        }
    }
}

/// How long a response lowers its replica's weight: a 429 does, for its `Retry-After`,
/// unless API Priority and Fairness wrote it (it names the flow schema and priority level it
/// classified the request into). That one refuses the request's own flow — one user or
/// controller over its share, or its level full on this replica — and lowering the replica
/// for everyone would push the other flows away from a replica with room for them.
fn replica_throttle(status: StatusCode, headers: &http::HeaderMap) -> Option<Duration> {
    if status != StatusCode::TOO_MANY_REQUESTS
        || headers.contains_key(APF_FLOW_SCHEMA_UID)
        || headers.contains_key(APF_PRIORITY_LEVEL_UID)
    {
        return None;
    }
    let retry_after = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .filter(|d| !d.is_zero())
        .unwrap_or(pick::THROTTLE_DEFAULT);
    Some(retry_after)
}

/// The response header API Priority and Fairness names a request's flow schema in.
const APF_FLOW_SCHEMA_UID: &str = "x-kubernetes-pf-flowschema-uid";
/// The response header API Priority and Fairness names a request's priority level in.
const APF_PRIORITY_LEVEL_UID: &str = "x-kubernetes-pf-prioritylevel-uid";

/// The apiserver replicas and the connections to them. Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    /// Shared by every worker's view ([`Upstream::with_own_connections`]).
    balancer: Arc<Balancer>,
    pool: Arc<Pool>,
    /// Every view's pool, for the connection counts of [`Upstream::snapshot`].
    pools: Arc<Mutex<Vec<Weak<Pool>>>>,
    tls: UpstreamTls,
    stall_timeout: Duration,
    probe_interval: Duration,
    byte_budget: u64,
    probes: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for probe in self.probes.get_mut().unwrap_or_else(|p| p.into_inner()) {
            probe.abort();
        }
    }
}

/// How an attempt failed, and so whether the request may go again.
enum Failure {
    /// Provably never reached an apiserver: any request may be retried.
    NotSent {
        error: UpstreamError,
        eject: Option<EjectCause>,
    },
    /// May have reached the apiserver: only reads are retried.
    MaybeSent {
        error: UpstreamError,
        eject: Option<EjectCause>,
    },
    /// Retrying cannot help.
    Fatal(UpstreamError),
}

/// How many times a request that may have reached an apiserver is sent again: a read goes
/// to at most two other replicas, so that a fleet-wide slowness costs at most three times
/// the work, never once per replica.
const MAX_RESENDS: usize = 2;

/// How one attempt ended.
enum Attempt {
    /// The replica answered, or failed in a way [`Failure`] sorts.
    Done(Result<(Response<Incoming>, Option<Lease>), Failure>),
    /// A read left the replica before its response head: `why` is
    /// [`RetryReason::AttemptTimeout`] or [`RetryReason::Unresponsive`].
    Unanswered(RetryReason),
    /// The request's own deadline passed.
    Deadline,
}

/// Waits until `deadline`, or forever without one.
async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The parts of a request that every attempt sends again.
struct Resendable {
    method: Method,
    path_and_query: http::uri::PathAndQuery,
    headers: HeaderMap,
    body: Bytes,
    upgrade: bool,
}

impl Resendable {
    /// The request as every attempt sends it again. What is the same for every attempt is
    /// done once, here: over HTTP/2, no `Host` header (the host goes as `:authority`, and a
    /// `Host` beside it must not differ) and no hop-by-hop headers. Each attempt sends a
    /// copy: the values are shared, not copied, except those made as text (the identity
    /// headers), which are moved to a shared buffer of their own at their first copy;
    /// moving every value to one shared buffer beforehand cost more than it saved.
    fn new(
        method: Method,
        path_and_query: http::uri::PathAndQuery,
        mut headers: HeaderMap,
        body: Bytes,
        upgrade: bool,
    ) -> Resendable {
        if !upgrade {
            headers.remove(header::HOST);
            strip_hop_by_hop(&mut headers);
        }
        Resendable {
            method,
            path_and_query,
            headers,
            body,
            upgrade,
        }
    }
}

impl Upstream {
    /// The pool for the configured replicas. Opens no connection yet.
    pub fn new(
        cfg: &config::Upstream,
        tls: UpstreamTls,
        metrics: Metrics,
    ) -> Result<Self, UpstreamError> {
        let byte_budget = cfg.replica_heap_headroom.0 / 5 / u64::from(cfg.bulwark_replicas.max(1));
        let balancer = Balancer::new(
            &cfg.replicas,
            cfg.eject_base,
            cfg.eject_max,
            byte_budget,
            &metrics,
        )?;
        let pool = Arc::new(Pool::new(
            balancer.replicas(),
            cfg.server_name.as_ref(),
            tls.clone(),
            cfg.timeouts.connect,
            cfg.streams_per_connection,
        )?);
        Ok(Self {
            inner: Arc::new(Inner {
                balancer: Arc::new(balancer),
                pools: Arc::new(Mutex::new(vec![Arc::downgrade(&pool)])),
                pool,
                tls,
                stall_timeout: cfg.stall_timeout,
                probe_interval: cfg.probe_interval,
                byte_budget,
                probes: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The same replicas, health, ejections and byte budgets, with connections of its own:
    /// a worker thread's view, whose connections are opened (and their tasks run) on the
    /// worker's runtime, so that a request and its upstream stream never change threads.
    /// Probes stay with `self`.
    pub fn with_own_connections(&self) -> Upstream {
        let inner = &self.inner;
        let pool = Arc::new(inner.pool.empty_like());
        inner
            .pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&pool));
        Upstream {
            inner: Arc::new(Inner {
                balancer: inner.balancer.clone(),
                pool,
                pools: inner.pools.clone(),
                tls: inner.tls.clone(),
                stall_timeout: inner.stall_timeout,
                probe_interval: inner.probe_interval,
                byte_budget: inner.byte_budget,
                probes: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Starts probing each replica's `/readyz` every `probe_interval` with the Own
    /// credential: a failure takes it out of rotation, a success brings it back. Calling
    /// it again does nothing; the probes stop when the last clone of `self` is dropped.
    pub fn spawn_probes(&self) {
        let mut probes = self.inner.probes.lock().unwrap_or_else(|p| p.into_inner());
        if !probes.is_empty() {
            return;
        }
        for index in 0..self.inner.balancer.replicas().len() {
            let weak = Arc::downgrade(&self.inner);
            let interval = self.inner.probe_interval.max(Duration::from_millis(10));
            probes.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let Some(inner) = weak.upgrade() else { break };
                    inner.probe(index).await;
                }
            }));
        }
    }

    /// Forwards a request (origin-form URI, identity headers already rewritten) to a
    /// replica and returns its response head with a streaming body. Sets scheme,
    /// authority and `Host` for the replica; the path bytes go unchanged.
    ///
    /// Not an `async fn`: its future is the exchange's own, without a second copy of the
    /// request and route around it.
    pub fn send(
        &self,
        req: Request<Body>,
        route: Route,
    ) -> impl Future<Output = Result<Response<Body>, UpstreamError>> + Send + '_ {
        // One clock read for the exchange's start, its deadline and its first attempt's
        // limit.
        let started = Instant::now();
        let deadline = route
            .timeout
            .filter(|_| !route.long_running)
            .map(|limit| started + limit);
        self.inner.send(req, route, started, deadline)
    }

    /// Replicas in rotation.
    pub fn healthy_replicas(&self) -> usize {
        self.inner.balancer.healthy(Instant::now())
    }

    /// Replicas configured.
    pub fn replicas(&self) -> usize {
        self.inner.balancer.replicas().len()
    }

    /// Every replica's state.
    pub fn snapshot(&self) -> Vec<ReplicaView> {
        let inner = &self.inner;
        let mut pools = inner.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|pool| pool.strong_count() > 0);
        let pools: Vec<Arc<Pool>> = pools.iter().filter_map(Weak::upgrade).collect();
        inner.balancer.snapshot(Instant::now(), |i| {
            pools.iter().map(|pool| pool.connections(i)).sum()
        })
    }

    /// One replica's in-flight LIST byte budget: heap headroom ÷ 5 ÷ Bulwark replicas.
    pub fn byte_budget(&self) -> u64 {
        self.inner.byte_budget
    }

    /// Holds `bytes` of LIST budget on the replica the balancer picks for them
    /// ([`pick::Balancer::pick_for_bytes`]) when `fits` (its name, its bytes in flight);
    /// `None` when no replica can be used or it has no room. Send the request there with
    /// [`Route::replica`].
    pub fn hold_list_bytes(
        &self,
        bytes: u64,
        fits: impl Fn(&str, u64) -> bool,
    ) -> Option<InFlightBytes> {
        let balancer = &self.inner.balancer;
        let index = balancer.pick_for_bytes(fits, Instant::now(), &mut rand::rng())?;
        let replica = balancer.replica(index).clone();
        replica.add_bytes(bytes);
        Some(InFlightBytes { replica, bytes })
    }
}

impl Inner {
    /// The request is taken apart before the future is made: an `async fn` would keep it
    /// (240 bytes) twice in its future, which is in every forwarded request's.
    // Over 120 lines: one retry loop whose attempts share the request's parts, its deadline,
    // its body timer and the last failure; each branch says why a replica is left or kept,
    // and apart they would pass all of that between them.
    fn send(
        &self,
        mut req: Request<Body>,
        route: Route,
        started: Instant,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Response<Body>, UpstreamError>> + Send + '_ {
        let upgrade = wants_upgrade(req.headers());
        let downstream_upgrade = upgrade.then(|| req.extensions_mut().remove::<OnUpgrade>());
        let (parts, body) = req.into_parts();
        let preferred = route.replica.as_ref().and_then(|name| {
            self.balancer
                .replicas()
                .iter()
                .position(|r| r.name == *name)
        });
        async move {
            let mut downstream_upgrade = match downstream_upgrade {
                Some(on_upgrade) => Some(on_upgrade.ok_or(UpstreamError::NotUpgradable)?),
                None => None,
            };
            // Held until the apiserver has answered (or every attempt failed). The attempts end
            // themselves at the deadline, naming their replica; this ends the reading of the
            // request body before them. (A body already whole, as every GET's, is ready at the
            // first poll, so its timer is never armed.)
            let mut body = body;
            let buffered = buffer::buffer(
                &mut body,
                buffer::declared_length(&parts.headers),
                route.body_flow.as_ref(),
                None,
            );
            let (body, _held) = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, buffered)
                    .await
                    .map_err(|_| UpstreamError::Timeout { replica: None })??,
                None => buffered.await?,
            };
            let path_and_query = parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
            let resendable =
                Resendable::new(parts.method, path_and_query, parts.headers, body, upgrade);
            let load = if route.watch {
                Load::Watches
            } else {
                Load::Requests
            };
            // A read may leave a replica that has not answered: at its attempt limit, or when
            // the replica is ejected for not answering its probe. A write waits: it may have
            // arrived, and it is never sent twice.
            let read = route.retry == RetryPolicy::Read && !resendable.upgrade;
            let replicas = self.balancer.replicas().len();
            let mut tried = pick::Replicas::new();
            let mut only_not_sent = true;
            let mut last_error = None;
            // The replica that failed the last attempt and why, counted once a retry starts.
            let mut retrying: Option<(usize, RetryReason)> = None;
            let mut resends = 0;
            for _ in 0..=replicas {
                let preferred = preferred
                    .filter(|&i| tried.is_empty() && self.balancer.in_rotation(i, Now::default()));
                let Some(index) = preferred.or_else(|| self.pick(load, &tried)) else {
                    break;
                };
                if let Some((failed, why)) = retrying.take() {
                    let unanswered =
                        matches!(why, RetryReason::AttemptTimeout | RetryReason::Unresponsive);
                    // A replica that did not answer is not asked again: only another may help.
                    if unanswered && tried.contains(&index) {
                        break;
                    }
                    self.balancer.replica(failed).count_retry(why);
                }
                tried.push(index);
                let replica = self.balancer.replica(index).clone();
                let attempt = self.attempt(index, route.credential, &resendable);
                // Subscribed before the request leaves: an ejection during it is seen.
                let mut unresponsive = replica.unresponsive();
                let attempt = if read {
                    // The first attempt starts when the exchange does.
                    let at = if tried.len() == 1 {
                        started
                    } else {
                        Instant::now()
                    };
                    let limit = route
                        .attempt_timeout
                        .map(|limit| at + limit)
                        .filter(|limit| deadline.is_none_or(|deadline| *limit < deadline));
                    // One timer for whichever comes first: the attempt's limit, when set, is
                    // before the request's deadline.
                    tokio::select! {
                        biased;
                        done = attempt => Attempt::Done(done),
                        _ = unresponsive.changed() => Attempt::Unanswered(RetryReason::Unresponsive),
                        () = until(limit.or(deadline)) => match limit {
                            Some(_) => Attempt::Unanswered(RetryReason::AttemptTimeout),
                            None => Attempt::Deadline,
                        },
                    }
                } else {
                    tokio::select! {
                        biased;
                        done = attempt => Attempt::Done(done),
                        () = until(deadline) => Attempt::Deadline,
                    }
                };
                let name = replica.name.clone();
                let outcome = match attempt {
                    Attempt::Done(outcome) => outcome,
                    Attempt::Deadline => {
                        replica.count_response(None);
                        tracing::warn!(replica = %name, "no response head before the request's deadline");
                        return Err(UpstreamError::Timeout {
                            replica: Some(name),
                        });
                    }
                    Attempt::Unanswered(why) => {
                        replica.count_response(None);
                        only_not_sent = false;
                        last_error = Some(UpstreamError::Timeout {
                            replica: Some(name.clone()),
                        });
                        if resends >= MAX_RESENDS {
                            tracing::warn!(replica = %name, ?why, "read unanswered; no retry left");
                            break;
                        }
                        tracing::info!(replica = %name, ?why, "read unanswered; retrying on another replica");
                        resends += 1;
                        retrying = Some((index, why));
                        continue;
                    }
                };
                match outcome {
                    Ok((response, lease)) => {
                        return Ok(self.respond(
                            index,
                            response,
                            lease,
                            route,
                            &mut downstream_upgrade,
                            unresponsive,
                        ));
                    }
                    Err(failure) => {
                        replica.count_response(None);
                        match failure {
                            Failure::Fatal(error) => return Err(error),
                            Failure::NotSent { error, eject } => {
                                tracing::debug!(replica = %name, error = %Chain(&error), "not sent; retrying");
                                self.eject(index, eject);
                                last_error = Some(error);
                                retrying = Some((index, RetryReason::NotSent));
                            }
                            Failure::MaybeSent { error, eject } => {
                                self.eject(index, eject);
                                only_not_sent = false;
                                if !read {
                                    tracing::warn!(replica = %name, error = %Chain(&error), "write may have arrived; not retried");
                                    return Err(UpstreamError::Interrupted(Arc::new(error)));
                                }
                                if route
                                    .client_timeout
                                    .is_some_and(|limit| started.elapsed() >= limit)
                                {
                                    // The apiserver ends a request at its own `timeout` (Go's
                                    // timeout handler resets the stream): past it, the answer is
                                    // the client's 504, not a second try it no longer waits for.
                                    tracing::debug!(replica = %name, error = %Chain(&error), "read ended at its own timeout");
                                    return Err(UpstreamError::Timeout {
                                        replica: Some(name.clone()),
                                    });
                                }
                                if resends >= MAX_RESENDS {
                                    tracing::warn!(replica = %name, error = %Chain(&error), "read failed; no retry left");
                                    last_error = Some(error);
                                    break;
                                }
                                tracing::debug!(replica = %name, error = %Chain(&error), "read failed; retrying");
                                last_error = Some(error);
                                resends += 1;
                                retrying = Some((index, RetryReason::Reset));
                            }
                        }
                    }
                }
            }
            let no_replica = UpstreamError::NoHealthyReplica {
                retry_after: self.balancer.retry_after(Instant::now()),
            };
            Err(match last_error {
                Some(_) if only_not_sent => no_replica,
                Some(error) => error,
                None => no_replica,
            })
        }
    }

    fn pick(&self, load: Load, tried: &[usize]) -> Option<usize> {
        // The thread-local RNG is not Send; keep it inside this synchronous call.
        self.balancer
            .pick(load, tried, Now::default(), &mut rand::rng())
    }

    fn eject(&self, index: usize, cause: Option<EjectCause>) {
        if let Some(cause) = cause {
            self.balancer.eject(index, cause, Instant::now());
        }
    }

    /// One try on one replica, until the response head.
    async fn attempt(
        &self,
        index: usize,
        credential: UpstreamCredential,
        resendable: &Resendable,
    ) -> Result<(Response<Incoming>, Option<Lease>), Failure> {
        let replica = self.balancer.replica(index).clone();
        let _pending = PendingGuard::new(replica.clone());
        let bearer = match credential {
            UpstreamCredential::Own => self.tls.own_bearer().map_err(Failure::Fatal)?,
            _ => None,
        };
        let request =
            build_request(resendable, &replica.authority, bearer).map_err(Failure::Fatal)?;
        if resendable.upgrade {
            // Boxed like the pool's connects: only upgrades take this path.
            let mut sender = Box::pin(self.pool.connect_http1(&replica, index, credential))
                .await
                .map_err(connect_failure)?;
            if let Err(e) = sender.ready().await {
                return Err(Failure::NotSent {
                    error: UpstreamError::protocol(&replica.name, e),
                    eject: Some(EjectCause::Reset),
                });
            }
            return match sender.send_request(request).await {
                Ok(response) => Ok((response, None)),
                Err(e) => Err(classify_hyper_error(&replica.name, e)),
            };
        }
        let (lease, mut sender) = self
            .pool
            .acquire(&replica, index, credential)
            .await
            .map_err(connect_failure)?;
        match sender.try_send_request(request).await {
            Ok(response) => Ok((response, Some(lease))),
            // hyper hands the request back when it never started writing it: the
            // connection closed between the pick and the send.
            Err(e) if e.message().is_some() => Err(Failure::NotSent {
                error: UpstreamError::protocol(&replica.name, e.into_error()),
                eject: None,
            }),
            Err(e) => Err(classify_hyper_error(&replica.name, e.into_error())),
        }
    }

    /// Turns a response head into the client's response: counts it, lowers the weight on a
    /// 429 of the replica's own (see [`replica_throttle`]), splices an upgrade, streams the
    /// body.
    fn respond(
        &self,
        index: usize,
        mut response: Response<Incoming>,
        lease: Option<Lease>,
        route: Route,
        downstream_upgrade: &mut Option<OnUpgrade>,
        unresponsive: watch::Receiver<()>,
    ) -> Response<Body> {
        let replica = self.balancer.replica(index).clone();
        let status = response.status();
        replica.count_response(Some(status));
        self.balancer.succeeded(index, Now::default());
        if let Some(for_how_long) = replica_throttle(status, response.headers()) {
            self.balancer.throttle(index, for_how_long, Instant::now());
        }
        if status == StatusCode::SWITCHING_PROTOCOLS
            && let Some(downstream) = downstream_upgrade.take()
        {
            let upstream = hyper::upgrade::on(&mut response);
            let name = replica.name.clone();
            tokio::spawn(async move {
                match tokio::try_join!(downstream, upstream) {
                    Ok((down, up)) => {
                        let (mut down, mut up) = (TokioIo::new(down), TokioIo::new(up));
                        match tokio::io::copy_bidirectional(&mut down, &mut up).await {
                            Ok((sent, received)) => {
                                tracing::debug!(replica = %name, sent, received, "upgrade closed")
                            }
                            Err(e) => tracing::debug!(replica = %name, error = %e, "upgrade ended"),
                        }
                    }
                    Err(e) => tracing::debug!(replica = %name, error = %e, "upgrade failed"),
                }
            });
            let (parts, _) = response.into_parts();
            let mut response = Response::from_parts(parts, crate::empty());
            response
                .extensions_mut()
                .insert(UpstreamReplica(replica.name.clone()));
            return response;
        }
        let watch = route.watch.then(|| ReplicaWatch::new(replica.clone()));
        let on_failure = if route.watch {
            OnFailure::End(Framing::of(response.headers().get(header::CONTENT_TYPE)))
        } else {
            OnFailure::Error
        };
        let (parts, incoming) = response.into_parts();
        let ejection = body::Ejection {
            ejected: unresponsive,
            grace: self.probe_limit(),
            cut: replica.cut_unresponsive(),
        };
        let body = body::stream(
            incoming,
            on_failure,
            self.stall_timeout,
            replica.name.clone(),
            Some(ejection),
            (lease, watch),
        );
        let mut response = Response::from_parts(parts, body);
        response
            .extensions_mut()
            .insert(UpstreamReplica(replica.name.clone()));
        response
    }

    /// How long a probe may wait for its answer: the probe interval, at least a second.
    fn probe_limit(&self) -> Duration {
        self.probe_interval.max(Duration::from_secs(1))
    }

    /// One `/readyz` probe with the Own credential.
    async fn probe(&self, index: usize) {
        let resendable = Resendable {
            method: Method::GET,
            path_and_query: http::uri::PathAndQuery::from_static("/readyz"),
            headers: HeaderMap::new(),
            body: Bytes::new(),
            upgrade: false,
        };
        let limit = self.probe_limit();
        let now = || Instant::now();
        let name = &self.balancer.replica(index).name;
        // Err: why, and the cause: a replica that answered something is not ready; one
        // that gave no answer in time (a connect timing out included) is unresponsive.
        let outcome = tokio::time::timeout(limit, async {
            let (response, lease) = self
                .attempt(index, UpstreamCredential::Own, &resendable)
                .await
                .map_err(|f| match f {
                    Failure::NotSent { error, .. }
                    | Failure::MaybeSent { error, .. }
                    | Failure::Fatal(error) => {
                        let cause = if timed_out(&error) {
                            EjectCause::Unresponsive
                        } else {
                            EjectCause::Probe
                        };
                        (Chain(&error).to_string(), cause)
                    }
                })?;
            let status = response.status();
            // Read the short answer to the end so the stream closes cleanly.
            let _ = Limited::new(response.into_body(), 64 * 1024)
                .collect()
                .await;
            drop(lease);
            if status == StatusCode::OK {
                Ok(())
            } else {
                Err((format!("/readyz answered {status}"), EjectCause::Probe))
            }
        })
        .await
        .unwrap_or_else(|_| {
            Err((
                format!("/readyz did not answer within {limit:?}"),
                EjectCause::Unresponsive,
            ))
        });
        match outcome {
            Ok(()) => self.balancer.probe_ok(index, now()),
            Err((why, cause)) => {
                tracing::warn!(replica = %name, %why, ?cause, "readiness probe failed");
                self.balancer.eject(index, cause, now());
            }
        }
    }
}

/// Whether a failed exchange is a connect that timed out (a replica that accepts TCP but
/// never completes the handshake: stopped, or wedged).
fn timed_out(error: &UpstreamError) -> bool {
    matches!(error, UpstreamError::Connect { source, .. }
        if source.kind() == std::io::ErrorKind::TimedOut)
}

/// A connect-stage failure: the request never left Bulwark. Configuration problems cannot
/// be fixed by trying elsewhere.
fn connect_failure(error: UpstreamError) -> Failure {
    match error {
        UpstreamError::MissingCredential(_)
        | UpstreamError::Config(_)
        | UpstreamError::File { .. }
        | UpstreamError::Rustls { .. } => Failure::Fatal(error),
        error => Failure::NotSent {
            error,
            eject: Some(EjectCause::Connect),
        },
    }
}

/// Sorts a failed exchange into "never reached the apiserver" or "may have".
fn classify_hyper_error(replica: &Arc<str>, error: hyper::Error) -> Failure {
    let (sent, eject) = match find_source::<h2::Error>(&error) {
        // The apiserver refused the stream before processing it.
        Some(h2)
            if h2.is_reset()
                && h2.is_remote()
                && h2.reason() == Some(h2::Reason::REFUSED_STREAM) =>
        {
            (false, None)
        }
        // A graceful GOAWAY fails only streams above its last-stream-id, which the
        // apiserver promises it never processed; streams below it finish normally.
        Some(h2)
            if h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR) =>
        {
            (false, None)
        }
        Some(_) => (true, Some(EjectCause::Reset)),
        // The replica is reachable; this exchange was malformed.
        None if error.is_parse() || error.is_user() => (true, None),
        None => (true, Some(EjectCause::Reset)),
    };
    let error = UpstreamError::protocol(replica, error);
    if sent {
        Failure::MaybeSent { error, eject }
    } else {
        Failure::NotSent { error, eject }
    }
}

/// True when the request asks for an HTTP/1.1 upgrade (`Connection: upgrade`).
fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Removes the HTTP/1.1 connection-level headers an HTTP/2 request must not carry (hyper
/// would drop them too, but with a warning per request).
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests carry none: one look at the names they have, not a lookup per name.
    let hop = |name: &header::HeaderName| {
        name == header::CONNECTION
            || name == header::TRANSFER_ENCODING
            || name == header::UPGRADE
            || name == header::TE
            || name == "keep-alive"
            || name == "proxy-connection"
    };
    if !headers.keys().any(hop) {
        return;
    }
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .collect();
    for name in named {
        headers.remove(name.as_str());
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::HeaderName::from_static("keep-alive"),
        header::HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
    if headers.get(header::TE).is_some_and(|te| te != "trailers") {
        headers.remove(header::TE);
    }
}

/// The request for one attempt on a replica: HTTP/2 with the replica as `:authority`, or
/// HTTP/1.1 in origin form with `Host` for an upgrade.
fn build_request(
    resendable: &Resendable,
    authority: &Authority,
    bearer: Option<HeaderValue>,
) -> Result<Request<ReqBody>, UpstreamError> {
    let mut headers = resendable.headers.clone();
    let (uri, version) = if resendable.upgrade {
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| UpstreamError::Config(format!("{authority} cannot be a Host header")))?;
        headers.insert(header::HOST, host);
        (
            Uri::from(resendable.path_and_query.clone()),
            Version::HTTP_11,
        )
    } else {
        // Without Host or hop-by-hop headers since `Resendable` was made.
        let uri = Uri::builder()
            .scheme("https")
            .authority(authority.clone())
            .path_and_query(resendable.path_and_query.clone())
            .build()
            .map_err(|e| UpstreamError::Config(format!("{authority} as authority: {e}")))?;
        (uri, Version::HTTP_2)
    };
    if let Some(bearer) = bearer
        && !headers.contains_key(header::AUTHORIZATION)
    {
        headers.insert(header::AUTHORIZATION, bearer);
    }
    let mut request = Request::new(Full::new(resendable.body.clone()));
    *request.method_mut() = resendable.method.clone();
    *request.uri_mut() = uri;
    *request.version_mut() = version;
    *request.headers_mut() = headers;
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn authority(text: &str) -> Authority {
        text.parse().unwrap()
    }

    fn resendable(upgrade: bool) -> Resendable {
        resendable_with(upgrade, HeaderMap::new())
    }

    /// A GET kept for retries, with `extra` headers besides its own.
    fn resendable_with(upgrade: bool, extra: HeaderMap) -> Resendable {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("bulwark.example"));
        headers.insert("x-remote-user", HeaderValue::from_static("alice"));
        headers.extend(extra);
        Resendable::new(
            Method::GET,
            "/api/v1/namespaces/a/pods?labelSelector=a%3Db&limit=5"
                .parse()
                .unwrap(),
            headers,
            Bytes::new(),
            upgrade,
        )
    }

    #[test]
    fn a_request_kept_for_retries_keeps_every_header_and_its_path() {
        let mut headers = HeaderMap::new();
        headers.insert("x-remote-user", HeaderValue::from_static("alice"));
        headers.append("x-remote-group", HeaderValue::from_static("dev"));
        headers.append("x-remote-group", HeaderValue::from_static(""));
        headers.append(
            "x-remote-group",
            HeaderValue::from_static("system:authenticated"),
        );
        let mut token = HeaderValue::from_static("Bearer secret");
        token.set_sensitive(true);
        headers.insert(header::AUTHORIZATION, token);
        let before = headers.clone();
        let kept = Resendable::new(
            Method::GET,
            "/api/v1/pods?limit=5".parse().unwrap(),
            headers,
            Bytes::new(),
            false,
        );
        // Every attempt sends the same.
        for _ in 0..2 {
            let req = build_request(&kept, &authority("a:1"), None).unwrap();
            assert_eq!(req.uri().path_and_query().unwrap(), "/api/v1/pods?limit=5");
            let headers = req.headers();
            assert_eq!(*headers, before);
            assert!(headers[header::AUTHORIZATION].is_sensitive());
            assert!(!headers["x-remote-user"].is_sensitive());
            let groups: Vec<_> = headers.get_all("x-remote-group").iter().collect();
            assert_eq!(groups, ["dev", "", "system:authenticated"]);
        }
    }

    #[test]
    fn an_http2_request_names_the_replica_as_authority_and_keeps_the_path_bytes() {
        let req = build_request(&resendable(false), &authority("10.0.0.1:6443"), None).unwrap();
        assert_eq!(
            req.uri().to_string(),
            "https://10.0.0.1:6443/api/v1/namespaces/a/pods?labelSelector=a%3Db&limit=5"
        );
        assert_eq!(req.version(), Version::HTTP_2);
        assert!(req.headers().get(header::HOST).is_none());
        assert_eq!(req.headers()["x-remote-user"], "alice");
    }

    #[test]
    fn connection_level_headers_do_not_go_over_http2() {
        let mut hop = HeaderMap::new();
        hop.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-hop"),
        );
        hop.insert("x-hop", HeaderValue::from_static("1"));
        hop.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        hop.insert(header::TE, HeaderValue::from_static("gzip"));
        hop.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        let t = resendable_with(false, hop);
        let req = build_request(&t, &authority("a:1"), None).unwrap();
        for name in [
            "connection",
            "x-hop",
            "keep-alive",
            "te",
            "transfer-encoding",
        ] {
            assert!(req.headers().get(name).is_none(), "{name} kept");
        }
        assert_eq!(req.headers()["x-remote-user"], "alice");
    }

    #[test]
    fn an_upgrade_goes_in_origin_form_with_the_replica_as_host() {
        let req = build_request(&resendable(true), &authority("10.0.0.1:6443"), None).unwrap();
        assert_eq!(
            req.uri().to_string(),
            "/api/v1/namespaces/a/pods?labelSelector=a%3Db&limit=5"
        );
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.headers()[header::HOST], "10.0.0.1:6443");
    }

    #[test]
    fn the_own_token_is_added_only_when_no_authorization_is_present() {
        let bearer = HeaderValue::from_static("Bearer own");
        let req =
            build_request(&resendable(false), &authority("a:1"), Some(bearer.clone())).unwrap();
        assert_eq!(req.headers()[header::AUTHORIZATION], "Bearer own");
        let mut t = resendable(false);
        t.headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer user"),
        );
        let req = build_request(&t, &authority("a:1"), Some(bearer)).unwrap();
        assert_eq!(req.headers()[header::AUTHORIZATION], "Bearer user");
    }

    #[test]
    fn upgrade_is_recognised_among_connection_tokens() {
        let mut headers = HeaderMap::new();
        assert!(!wants_upgrade(&headers));
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(wants_upgrade(&headers));
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert!(!wants_upgrade(&headers));
    }

    /// A config whose CA is a freshly minted one in a temp folder (removed when dropped).
    fn config(replicas: &[&str]) -> (config::Upstream, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        let ca = params.self_signed(&key).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        let yaml = format!(
            "replicas: {replicas:?}\nca: {}\nself: {{tokenFile: {}}}\n",
            dir.path().join("ca.pem").display(),
            dir.path().join("token").display()
        );
        (serde_norway::from_str(&yaml).unwrap(), dir)
    }

    #[test]
    fn tls_settings_fail_with_the_file_named() {
        let (mut cfg, dir) = config(&["a:1"]);
        cfg.ca = dir.path().join("missing.pem");
        let err = UpstreamTls::from_config(&cfg).unwrap_err().to_string();
        assert!(err.contains("missing.pem"), "{err}");
        std::fs::write(dir.path().join("empty.pem"), "").unwrap();
        cfg.ca = dir.path().join("empty.pem");
        let err = UpstreamTls::from_config(&cfg).unwrap_err().to_string();
        assert!(err.contains("no CA certificate"), "{err}");
    }

    #[test]
    fn the_expiry_of_the_ca_and_the_front_proxy_certificate_is_published() {
        let (mut cfg, dir) = config(&["a:1"]);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["front-proxy".to_string()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2030, 1, 1);
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(dir.path().join("fp.crt"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("fp.key"), key.serialize_pem()).unwrap();
        cfg.front_proxy = Some(
            serde_norway::from_str(&format!(
                "{{cert: {}, key: {}}}",
                dir.path().join("fp.crt").display(),
                dir.path().join("fp.key").display()
            ))
            .unwrap(),
        );
        let metrics = Metrics::new();
        UpstreamTls::from_config(&cfg)
            .unwrap()
            .record_expiry(&metrics);
        let expiry = |name: &str| {
            metrics
                .certificate_expiry_timestamp_seconds
                .with_label_values(&[name])
                .get()
        };
        assert_eq!(expiry("front_proxy"), 1_893_456_000);
        // rcgen's default validity ends in 4096: far, but there.
        assert!(expiry("upstream_ca") > 1_893_456_000);
        assert!(
            !metrics
                .render()
                .contains("bulwark_certificate_expiry_timestamp_seconds{certificate=\"own\"}"),
            "no own certificate configured"
        );
    }

    #[test]
    fn a_route_without_its_credential_configured_is_refused() {
        let (cfg, _dir) = config(&["a:1"]);
        let tls = UpstreamTls::from_config(&cfg).unwrap();
        let err = tls
            .client_config(UpstreamCredential::FrontProxy, tls::Alpn::H2)
            .unwrap_err();
        assert!(matches!(
            err,
            UpstreamError::MissingCredential(UpstreamCredential::FrontProxy)
        ));
        assert!(
            tls.client_config(UpstreamCredential::Own, tls::Alpn::H2)
                .is_ok()
        );
    }

    #[test]
    fn the_own_token_is_read_and_follows_rotation() {
        let (cfg, dir) = config(&["a:1"]);
        let tls = UpstreamTls::from_config(&cfg).unwrap();
        assert!(tls.own_bearer().is_err(), "token file missing");
        std::fs::write(dir.path().join("token"), "first\n").unwrap();
        assert_eq!(tls.own_bearer().unwrap().unwrap(), "Bearer first");
        // Rotation writes a new file; its modification time changes.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.path().join("token"), "second").unwrap();
        assert_eq!(tls.own_bearer().unwrap().unwrap(), "Bearer second");
    }

    #[test]
    fn in_flight_bytes_are_counted_per_replica_until_released() {
        let (cfg, _dir) = config(&["a:1", "b:2"]);
        let tls = UpstreamTls::from_config(&cfg).unwrap();
        let upstream = Upstream::new(&cfg, tls, Metrics::new()).unwrap();
        assert_eq!(upstream.byte_budget(), (8u64 << 30) / 5);
        // Each hold lands on the replica with the fewest bytes in flight.
        let first = upstream.hold_list_bytes(4096, |_, _| true).unwrap();
        let second = upstream.hold_list_bytes(10, |_, _| true).unwrap();
        assert_ne!(first.replica(), second.replica());
        let third = upstream.hold_list_bytes(1, |_, _| true).unwrap();
        assert_eq!(third.replica(), second.replica());
        let mut bytes: Vec<u64> = upstream
            .snapshot()
            .iter()
            .map(|r| r.in_flight_bytes)
            .collect();
        bytes.sort();
        assert_eq!(bytes, vec![11, 4096]);
        // No room: nothing is held.
        assert!(
            upstream
                .hold_list_bytes(1, |_, in_flight| in_flight < 11)
                .is_none()
        );
        drop((first, second, third));
        let bytes: Vec<u64> = upstream
            .snapshot()
            .iter()
            .map(|r| r.in_flight_bytes)
            .collect();
        assert_eq!(bytes, vec![0, 0]);
        assert_eq!((upstream.replicas(), upstream.healthy_replicas()), (2, 2));
    }

    #[test]
    fn a_malformed_replica_address_never_reaches_the_pool() {
        // The configuration reads each replica into an address; one that is not cannot be
        // given to a pool at all, and reading the section names it.
        let yaml = "replicas: [\"a:notaport\"]\nca: ca.pem\nself: {tokenFile: t}\n";
        let err = serde_norway::from_str::<config::Upstream>(yaml).unwrap_err();
        assert!(
            err.to_string()
                .contains("upstream.replicas[0]: \"a:notaport\" is not host:port"),
            "{err}"
        );
    }

    /// The request path spawns `send` on a multi-threaded runtime from generic code; this
    /// stops compiling if its future loses `Send`.
    #[allow(dead_code)]
    fn send_is_send_in_generic_callers(upstream: &Upstream, req: Request<Body>, route: Route) {
        fn is_send<T: Send>(_: T) {}
        is_send(upstream.send(req, route));
    }

    #[test]
    fn only_a_429_of_the_replicas_own_lowers_its_weight() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = http::HeaderMap::new();
            for (name, value) in pairs {
                h.insert(*name, HeaderValue::from_static(value));
            }
            h
        };
        let too_many = StatusCode::TOO_MANY_REQUESTS;
        // Overloaded as a whole (max-in-flight, or a hop without APF): lowered.
        assert_eq!(
            replica_throttle(too_many, &headers(&[("retry-after", "7")])),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            replica_throttle(too_many, &headers(&[])),
            Some(pick::THROTTLE_DEFAULT)
        );
        // One flow refused by API Priority and Fairness: the replica keeps its weight.
        for apf in [APF_FLOW_SCHEMA_UID, APF_PRIORITY_LEVEL_UID] {
            let h = headers(&[("retry-after", "7"), (apf, "5f8a4d0c")]);
            assert_eq!(replica_throttle(too_many, &h), None, "{apf}");
        }
        assert_eq!(replica_throttle(StatusCode::OK, &headers(&[])), None);
    }
}
