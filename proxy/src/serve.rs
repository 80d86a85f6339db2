//! Wires the request path together: the tower stack of DESIGN.md's stages, the listeners,
//! and the SIGTERM drain.
//!
//! ```text
//! listen ─▶ Rescue ─▶ Classify ─▶ Identify ─▶ Admit ─▶ Forward ─▶ upstream pool
//! ```
//! Every stage returns a typed [`ProxyError`]; [`Rescue`] is the one place that turns it
//! into a status, a `Status` body and the metrics.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceBuilder};

use crate::admit::Admission;
use crate::cache::{AuditLog, Cache, CacheError, Gate};
use crate::classify::{self, ClassifyError, RequestInfo};
use crate::config::{self, Config};
use crate::identity::User;
use crate::identity::forward::{ForwardError, Forwarding, OwnToken};
use crate::identity::{self, Credential, Identity, IdentityError, TokenCache, UpstreamReviewer};
use crate::listen::{ConnInfo, DrainPhase, ListenError, Listener};
use crate::logs::{Rejection, RejectionLog};
use crate::metrics::{Metrics, ResourceLabels, ServedBy, code_label, method_label, verb_label};
use crate::rules::Matched;
use crate::rules::{RuleProblem, RuleSet, Rules};
use crate::status::{Reason, Refusal};
use crate::upstream::{
    BodyBudget, BodyFlow, PreferReplica, RetryPolicy, Route, Upstream, UpstreamError, UpstreamTls,
};
use crate::{Body, admin};

/// Why a request was answered by Bulwark itself.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request is malformed.
    #[error(transparent)]
    Classify(#[from] ClassifyError),
    /// The client is not who it needs to be.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The request cannot be forwarded as it is.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// The apiservers could not answer.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// Admission said no (429 with rule, level, reason and `Retry-After`).
    #[error("{}", .0.message)]
    Refused(Refusal),
    /// The cache refused a read it would otherwise answer: 403 from the reader's
    /// SubjectAccessReview, in the apiserver's own words, or an error when no review could
    /// be made.
    #[error("{error}")]
    Cache {
        /// Why.
        #[source]
        error: CacheError,
        /// The reader's rule.
        rule: Arc<str>,
        /// The reader's priority level.
        level: String,
    },
}

impl ProxyError {
    /// The refusal the client sees. Its message never names a replica, a file or why a
    /// credential failed (a 401 says only `Unauthorized`, as the apiserver's does): the
    /// rejection log has the whole error.
    pub fn refusal(&self) -> Refusal {
        let message = self.to_string();
        match self {
            ProxyError::Classify(_) => Refusal::new(Reason::BadRequest, message),
            ProxyError::Identity(IdentityError::ReviewFailed(_)) => {
                Refusal::new(Reason::UpstreamError, "the token could not be reviewed")
                    .retry_after(Duration::from_secs(1))
            }
            ProxyError::Identity(IdentityError::ReviewLimited(limited)) => {
                Refusal::new(Reason::ReviewLimited, message).retry_after(limited.retry_after)
            }
            ProxyError::Identity(_) => Refusal::new(Reason::Unauthenticated, "Unauthorized"),
            ProxyError::Forward(ForwardError::ClientImpersonation) => {
                Refusal::new(Reason::Forbidden, message)
            }
            ProxyError::Forward(ForwardError::Unrepresentable(_)) => {
                Refusal::new(Reason::BadRequest, message)
            }
            ProxyError::Forward(ForwardError::OwnToken { .. }) => Refusal::new(
                Reason::UpstreamError,
                "bulwark's own credential is unavailable",
            ),
            ProxyError::Upstream(e) => e.refusal(),
            ProxyError::Refused(refusal) => refusal.clone(),
            ProxyError::Cache { error, rule, level } => Refusal {
                rule: Some(rule.to_string()),
                level: Some(level.clone()),
                ..Refusal::new(error.reason(), message)
            },
        }
    }

    /// The response for this error, whose [`ProxyError::refusal`] is `refusal`.
    fn into_response(self, refusal: Refusal) -> Response<Body> {
        match self {
            ProxyError::Cache { error, .. } => {
                let mut response = error.into_response();
                for (name, value) in [
                    ("x-bulwark-rule", refusal.rule),
                    ("x-bulwark-level", refusal.level),
                ] {
                    if let Some(value) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
                        response.headers_mut().insert(name, value);
                    }
                }
                response
            }
            _ => refusal.into_response(),
        }
    }
}

/// The metric labels of one request, filled in by whichever stage learns them.
#[derive(Debug, Clone)]
struct Labels {
    verb: &'static str,
    resource: Arc<str>,
}

type LabelSlot = Arc<OnceLock<Labels>>;

/// The user name of a request once identity knows it, for the rejection log.
#[derive(Clone, Default)]
struct WhoSlot(Arc<OnceLock<String>>);

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Maps every [`ProxyError`] to its response and counts every response.
#[derive(Clone)]
pub struct RescueLayer {
    metrics: Metrics,
    log: Arc<RejectionLog>,
}

/// See [`RescueLayer`].
#[derive(Clone)]
pub struct Rescue<S> {
    inner: S,
    metrics: Metrics,
    log: Arc<RejectionLog>,
}

impl<S> Layer<S> for RescueLayer {
    type Service = Rescue<S>;
    fn layer(&self, inner: S) -> Rescue<S> {
        Rescue {
            inner,
            metrics: self.metrics.clone(),
            log: self.log.clone(),
        }
    }
}

impl<S, B> Service<Request<B>> for Rescue<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Response<Body>, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let slot = LabelSlot::default();
        request.extensions_mut().insert(slot.clone());
        let who = WhoSlot::default();
        request.extensions_mut().insert(who.clone());
        let log = self.log.clone();
        let method = method_label(request.method());
        let started = Instant::now();
        let metrics = self.metrics.clone();
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let (response, served_by) = match inner.call(request).await {
                Ok(response) => {
                    let served_by = response
                        .extensions()
                        .get::<ServedBy>()
                        .copied()
                        .unwrap_or(ServedBy::Upstream);
                    (response, served_by)
                }
                Err(error) => {
                    let refusal = error.refusal();
                    let detail = crate::report::chain(&error);
                    tracing::debug!(reason = %refusal.reason, error = %detail, "refused");
                    log.rejected(Rejection {
                        identity: who.0.get().map_or("-", String::as_str),
                        rule: refusal.rule.as_deref().unwrap_or(""),
                        level: refusal.level.as_deref().unwrap_or(""),
                        reason: refusal.reason,
                        detail: &detail,
                    });
                    metrics.reject(
                        refusal.rule.as_deref().unwrap_or(""),
                        refusal.level.as_deref().unwrap_or(""),
                        refusal.reason,
                    );
                    let response = error.into_response(refusal);
                    let served_by = response
                        .extensions()
                        .get::<ServedBy>()
                        .copied()
                        .unwrap_or(ServedBy::Bulwark);
                    (response, served_by)
                }
            };
            let labels = slot.get().cloned().unwrap_or(Labels {
                verb: method,
                resource: Arc::from(""),
            });
            metrics
                .requests_total
                .with_label_values(&[
                    labels.verb,
                    &labels.resource,
                    code_label(&response.status()),
                    served_by.as_str(),
                ])
                .inc();
            metrics
                .request_duration_seconds
                .with_label_values(&[labels.verb, served_by.as_str()])
                .observe(started.elapsed().as_secs_f64());
            Ok(response)
        })
    }
}

/// Classifies the request (400 for malformed paths) and records its labels.
#[derive(Clone, Default)]
pub struct ClassifyLayer {
    resources: ResourceLabels,
}

/// See [`ClassifyLayer`].
#[derive(Clone)]
pub struct Classify<S> {
    inner: S,
    resources: ResourceLabels,
}

impl<S> Layer<S> for ClassifyLayer {
    type Service = Classify<S>;
    fn layer(&self, inner: S) -> Classify<S> {
        Classify {
            inner,
            resources: self.resources.clone(),
        }
    }
}

impl<S, B> Service<Request<B>> for Classify<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let info = classify::classify(request.method(), request.uri());
        if let (Ok(info), Some(slot)) = (&info, request.extensions().get::<LabelSlot>()) {
            let _ = slot.set(Labels {
                verb: verb_label(&info.verb),
                resource: self.resources.label(info),
            });
        }
        let mut inner = self.inner.clone();
        Box::pin(async move {
            request.extensions_mut().insert(Arc::new(info?));
            inner.call(request).await
        })
    }
}

/// Establishes who the client is: certificate first, then bearer token, then the anonymous
/// allowlist; 401 otherwise.
#[derive(Clone)]
pub struct IdentifyLayer {
    tokens: Arc<TokenCache>,
    anonymous: Arc<Vec<String>>,
}

/// See [`IdentifyLayer`].
#[derive(Clone)]
pub struct Identify<S> {
    inner: S,
    tokens: Arc<TokenCache>,
    anonymous: Arc<Vec<String>>,
}

impl<S> Layer<S> for IdentifyLayer {
    type Service = Identify<S>;
    fn layer(&self, inner: S) -> Identify<S> {
        Identify {
            inner,
            tokens: self.tokens.clone(),
            anonymous: self.anonymous.clone(),
        }
    }
}

impl<S, B> Service<Request<B>> for Identify<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let tokens = self.tokens.clone();
        let anonymous = self.anonymous.clone();
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let identity = identify(
                request.headers(),
                request.extensions(),
                request.uri().path(),
                &tokens,
                &anonymous,
            )
            .await?;
            if let Some(who) = request.extensions().get::<WhoSlot>() {
                let _ = who.0.set(identity.name().to_string());
            }
            request.extensions_mut().insert(identity);
            inner.call(request).await
        })
    }
}

async fn identify(
    headers: &http::HeaderMap,
    extensions: &http::Extensions,
    path: &str,
    tokens: &TokenCache,
    anonymous: &[String],
) -> Result<Identity, IdentityError> {
    let conn = extensions.get::<ConnInfo>();
    let chain = conn.and_then(|c| c.client_chain.clone());
    if let Some(leaf) = chain.as_deref().and_then(|c| c.first()) {
        let user = identity::user_from_certificate(leaf)?;
        return Ok(Identity::User {
            user,
            credential: Credential::Certificate,
        });
    }
    if let Some(token) = identity::bearer_token(headers)? {
        let user = tokens
            .authenticate(&token, conn.map(|c| c.peer.ip()))
            .await?;
        return Ok(Identity::User {
            user,
            credential: Credential::Token(token),
        });
    }
    if anonymous.iter().any(|allowed| allowed == path) {
        return Ok(Identity::Anonymous);
    }
    Err(IdentityError::NoCredentials)
}

/// Matches the request to its rule and waits for admission (DESIGN.md steps 5–6): the
/// permit is held until the response body ends, or until the response head for
/// long-running requests. Every classified response names its rule and level.
///
/// Every request passes its flow's token bucket. A read the watch-fed cache can then answer
/// (authorized for this reader, fresh enough) costs the apiservers nothing, so it holds no
/// replica's LIST bytes; it still waits in its level's fair queue for seats sized by its
/// bytes, because it costs Bulwark's own CPU and network ([`Gate`]).
#[derive(Clone)]
pub struct AdmitLayer {
    rules: Arc<Rules>,
    admission: Arc<Admission>,
    cache: Option<Arc<Cache>>,
    bodies: Arc<BodyBudget>,
}

/// See [`AdmitLayer`].
#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    rules: Arc<Rules>,
    admission: Arc<Admission>,
    cache: Option<Arc<Cache>>,
    bodies: Arc<BodyBudget>,
}

impl<S> Layer<S> for AdmitLayer {
    type Service = Admit<S>;
    fn layer(&self, inner: S) -> Admit<S> {
        Admit {
            inner,
            rules: self.rules.clone(),
            admission: self.admission.clone(),
            cache: self.cache.clone(),
            bodies: self.bodies.clone(),
        }
    }
}

/// Names the rule and level on a response.
fn name_rule(response: &mut Response<Body>, matched: &Matched) {
    let headers = response.headers_mut();
    for (name, value) in [
        ("x-bulwark-rule", &*matched.rule),
        ("x-bulwark-level", matched.level.name.as_str()),
    ] {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    }
}

/// The user rules see for a request on the anonymous allowlist.
fn anonymous_user() -> User {
    User {
        username: "system:anonymous".into(),
        groups: vec!["system:unauthenticated".into()],
        ..User::default()
    }
}

impl<S, B> Service<Request<B>> for Admit<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let rules = self.rules.current();
        let admission = self.admission.clone();
        let cache = self.cache.clone();
        let bodies = self.bodies.clone();
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let info = request
                .extensions()
                .get::<Arc<RequestInfo>>()
                .cloned()
                .expect("classified before admission");
            let (user, authenticated) = match request.extensions().get::<Identity>() {
                Some(Identity::User { user, .. }) => (user.clone(), true),
                _ => (anonymous_user(), false),
            };
            let matched = rules.matches(&user, &info);
            admission
                .check_rate(&matched, &user)
                .map_err(ProxyError::Refused)?;
            if let Some(cache) = cache.as_ref().filter(|_| authenticated) {
                let gate = Gate {
                    admission: &admission,
                    matched: &matched,
                };
                let peer = request.extensions().get::<ConnInfo>().map(|c| c.peer.ip());
                let answer = match cache
                    .serve_from(
                        &info,
                        &user,
                        request.headers(),
                        peer,
                        matched.staleness,
                        Some(gate),
                    )
                    .await
                {
                    Ok(Some(response)) => Some(response),
                    Ok(None) => None,
                    Err(CacheError::Refused(refusal)) => return Err(ProxyError::Refused(refusal)),
                    // Counted, logged and answered by Rescue like every refusal.
                    Err(error) => {
                        return Err(ProxyError::Cache {
                            error,
                            rule: matched.rule.clone(),
                            level: matched.level.name.clone(),
                        });
                    }
                };
                if let Some(mut response) = answer {
                    response.extensions_mut().insert(ServedBy::Cache);
                    name_rule(&mut response, &matched);
                    return Ok(response);
                }
            }
            if let Some(cache) = cache.as_ref().filter(|_| info.is_list()) {
                // A LIST the cache does not answer reads its whole scope upstream: the
                // cache's counts say how large that is now.
                let resource = if info.api_group.is_empty() {
                    info.resource.clone()
                } else {
                    format!("{}.{}", info.resource, info.api_group)
                };
                if let Some((_, bytes)) = cache.scope_size(&resource, info.namespace.as_deref()) {
                    admission.observe_scope(&info, bytes);
                }
            }
            let mut permit = admission
                .admit_rated(&matched, &user, &info)
                .await
                .map_err(ProxyError::Refused)?;
            if let Some(replica) = permit.replica() {
                request
                    .extensions_mut()
                    .insert(PreferReplica(Arc::from(replica)));
            }
            // The body is held for retries within the budget of its flow, exempt or not.
            request.extensions_mut().insert(BodyFlow {
                budget: bodies,
                flow: Arc::from(matched.flow.as_str()),
            });
            let mut response = inner.call(request).await?;
            name_rule(&mut response, &matched);
            if info.is_long_running() {
                permit.release_seats();
            }
            let learn = crate::admit::Learn::list(admission, info, &response);
            Ok(response.map(|body| crate::admit::hold(body, permit, learn)))
        })
    }
}

/// The innermost service: rewrites identity headers and sends the request to a replica.
#[derive(Clone)]
pub struct Forward {
    upstream: Upstream,
    forwarding: Arc<Forwarding>,
    timeouts: config::Timeouts,
}

impl Service<Request<Incoming>> for Forward {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.forward(request).await })
    }
}

impl Forward {
    async fn forward(&self, request: Request<Incoming>) -> Result<Response<Body>, ProxyError> {
        let (mut parts, body) = request.into_parts();
        let info = parts
            .extensions
            .get::<Arc<RequestInfo>>()
            .cloned()
            .expect("classified before forwarding");
        let identity = parts
            .extensions
            .get::<Identity>()
            .cloned()
            .expect("identified before forwarding");
        let upgrade = info.is_upgrade() && parts.headers.contains_key(http::header::UPGRADE);
        let credential = self
            .forwarding
            .prepare(&identity, &mut parts.headers, upgrade)?;
        if let Some(peer) = parts.extensions.get::<ConnInfo>().map(|c| c.peer) {
            append_forwarded_for(&mut parts.headers, peer);
        }
        // Keep only path and query: the pool sets scheme and authority per replica.
        if let Some(pq) = parts.uri.path_and_query().cloned() {
            parts.uri = http::Uri::from(pq);
        }
        let route = Route {
            credential,
            retry: if info.is_read() {
                RetryPolicy::Read
            } else {
                RetryPolicy::Write
            },
            long_running: info.is_long_running(),
            watch: info.query.watch || matches!(info.verb, classify::Verb::Watch),
            timeout: self.timeout_for(&info),
        };
        let request = Request::from_parts(parts, body.map_err(Into::into).boxed_unsync());
        let mut response = self.upstream.send(request, route).await?;
        response.extensions_mut().insert(ServedBy::Upstream);
        Ok(response)
    }

    fn timeout_for(&self, info: &RequestInfo) -> Option<Duration> {
        if info.is_long_running() {
            return None;
        }
        Some(if info.is_list() {
            self.timeouts.list
        } else if info.is_read() {
            self.timeouts.read
        } else {
            self.timeouts.write
        })
    }
}

fn append_forwarded_for(headers: &mut http::HeaderMap, peer: SocketAddr) {
    let ip = peer.ip().to_string();
    let value = match headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(existing) => format!("{existing}, {ip}"),
        None => ip,
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert("x-forwarded-for", value);
    }
}

/// The whole request path as one service, outermost layer first.
pub fn stack(
    metrics: Metrics,
    resources: ResourceLabels,
    tokens: Arc<TokenCache>,
    anonymous: Vec<String>,
    admit: AdmitLayer,
    forward: Forward,
) -> impl Service<
    Request<Incoming>,
    Response = Response<Body>,
    Error = Infallible,
    Future = BoxFuture<Response<Body>, Infallible>,
> + Clone
+ Send
+ 'static {
    ServiceBuilder::new()
        // One place that turns errors into statuses and counts every response.
        .layer(RescueLayer {
            metrics,
            log: Arc::new(RejectionLog::default()),
        })
        // Malformed paths never reach identity or upstream.
        .layer(ClassifyLayer { resources })
        // Certificate, token review or the anonymous allowlist; 401 otherwise.
        .layer(IdentifyLayer {
            tokens,
            anonymous: Arc::new(anonymous),
        })
        // Rule match, rate limit, fair queue, seats and LIST bytes; 429 otherwise.
        .layer(admit)
        .service(forward)
}

/// Why Bulwark could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The client listener.
    #[error("listen: {0}")]
    Listen(#[from] ListenError),
    /// The upstream pool.
    #[error("upstream: {0}")]
    Upstream(#[from] UpstreamError),
    /// Identity forwarding.
    #[error("identity: {0}")]
    Forward(#[from] ForwardError),
    /// The admin listener.
    #[error("admin: {0}")]
    Admin(#[from] std::io::Error),
    /// The rule files are invalid.
    #[error("rules: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Rules(Vec<RuleProblem>),
}

/// A running Bulwark: its addresses and the handle that drains it.
pub struct Running {
    /// The client-facing address.
    pub addr: SocketAddr,
    /// The admin address.
    pub admin_addr: SocketAddr,
    /// Shared state of the admin endpoints.
    pub admin: Arc<admin::State>,
    drain: watch::Sender<DrainPhase>,
    shutdown: config::Shutdown,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Starts every part from a validated configuration.
    pub async fn start(config: Config) -> Result<Running, StartError> {
        let metrics = Metrics::new();
        let tls = UpstreamTls::from_config(&config.upstream)?;
        let upstream = Upstream::new(&config.upstream, tls, metrics.clone())?;
        upstream.spawn_probes();
        let own_token = config
            .upstream
            .own
            .token_file
            .clone()
            .map(|path| Arc::new(OwnToken::new(path)));
        let reviewer = UpstreamReviewer::new(upstream.clone(), own_token.clone());
        let tokens = Arc::new(TokenCache::new(
            Arc::new(reviewer),
            config.identity.token_review.clone(),
            metrics.clone(),
        ));
        let forwarding = Forwarding::new(
            config.identity.mode,
            config.upstream.front_proxy.as_ref(),
            own_token.clone(),
        )?;
        let forward = Forward {
            upstream: upstream.clone(),
            forwarding: Arc::new(forwarding),
            timeouts: config.upstream.timeouts.clone(),
        };
        let audit = match &config.audit.path {
            Some(path) => Some(AuditLog::open(path).map_err(|e| {
                StartError::Admin(std::io::Error::new(
                    e.kind(),
                    format!("audit log {}: {e}", path.display()),
                ))
            })?),
            None => None,
        };
        let cache = config.cache.enabled.then(|| {
            Cache::start(
                &config.cache,
                upstream.clone(),
                own_token.clone(),
                metrics.clone(),
                audit,
            )
        });
        let rule_set = match &config.rules.folder {
            Some(folder) => RuleSet::load_dir(folder).map_err(StartError::Rules)?,
            None => RuleSet::builtin(),
        };
        let rules = Rules::new(rule_set, config.rules.folder.clone(), metrics.clone());
        rules.spawn_watch();
        let admission = Admission::new(rules.current().levels(), upstream.clone(), metrics.clone());
        let mut reloaded = rules.subscribe();
        let levels_follow = {
            let admission = admission.clone();
            tokio::spawn(async move {
                while reloaded.changed().await.is_ok() {
                    let set = reloaded.borrow_and_update().clone();
                    admission.update_levels(set.levels());
                }
            })
        };
        let service = stack(
            metrics.clone(),
            ResourceLabels::new(config.cache.resources.iter().map(String::as_str)),
            tokens,
            config.identity.anonymous.clone(),
            AdmitLayer {
                rules: rules.clone(),
                admission: admission.clone(),
                cache: cache.clone(),
                bodies: BodyBudget::new(&config.listen.limits),
            },
            forward,
        );

        let listener = Listener::bind(&config.listen).await?;
        let addr = listener.local_addr();
        listener.spawn_reload();
        let (drain, drain_rx) = watch::channel(DrainPhase::Serving);
        let serving = tokio::spawn(async move {
            if let Err(e) = listener.serve(service, drain_rx).await {
                tracing::error!(error = %e, "listener stopped");
            }
        });

        let admin = Arc::new(admin::State {
            metrics,
            upstream,
            rules,
            admission,
            cache,
            debug_token: admin::debug_token(&config.admin)?,
            draining: AtomicBool::new(false),
        });
        let (admin_addr, admin_task) = admin::serve(config.admin.address, admin.clone()).await?;
        tracing::info!(%addr, %admin_addr, "bulwark serving");
        Ok(Running {
            addr,
            admin_addr,
            admin,
            drain,
            shutdown: config.listen.shutdown.clone(),
            tasks: vec![serving, admin_task, levels_follow],
        })
    }

    /// The SIGTERM sequence of DESIGN.md step 9: `/readyz` fails, a pause lets balancers
    /// notice, GOAWAY, in-flight requests get the grace period, then everything ends.
    pub async fn drain(self) {
        self.admin.draining.store(true, Ordering::SeqCst);
        tracing::info!(pause = ?self.shutdown.pause, "draining: readyz fails");
        tokio::time::sleep(self.shutdown.pause).await;
        let _ = self.drain.send(DrainPhase::GoAway);
        tracing::info!(grace = ?self.shutdown.grace, "draining: GOAWAY sent");
        tokio::time::sleep(self.shutdown.grace).await;
        let _ = self.drain.send(DrainPhase::Close);
        for task in self.tasks {
            task.abort();
        }
    }
}

/// Runs until SIGTERM or Ctrl-C, then drains.
pub async fn run(config: Config) -> Result<(), StartError> {
    let running = Running::start(config).await?;
    shutdown_signal().await;
    running.drain().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

impl UpstreamError {
    /// The refusal for an upstream failure: 503 with `Retry-After` when no replica is
    /// healthy, 504 on timeout, 413 for a body over the apiserver's limit, 429 with
    /// `Retry-After` for a body the body budget has no room for, else 502. The message
    /// names no replica (clients have no use for the fleet's addresses); the rejection log
    /// does.
    pub fn refusal(&self) -> Refusal {
        let message = self.to_string();
        match self {
            UpstreamError::NoHealthyReplica { retry_after } => {
                Refusal::new(Reason::NoHealthyUpstream, message).retry_after(*retry_after)
            }
            UpstreamError::Timeout => Refusal::new(Reason::UpstreamTimeout, message),
            UpstreamError::BodyBudget(_) => {
                Refusal::new(Reason::BodyBudget, message).retry_after(Duration::from_secs(1))
            }
            UpstreamError::BodyTooLarge(_) => {
                Refusal::new(Reason::BadRequest, message).with_status(StatusCode::PAYLOAD_TOO_LARGE)
            }
            UpstreamError::RequestBody(_) | UpstreamError::NotUpgradable => {
                Refusal::new(Reason::BadRequest, message)
            }
            UpstreamError::Connect { .. } | UpstreamError::Tls { .. } => {
                Refusal::new(Reason::UpstreamError, "the apiserver could not be reached")
            }
            UpstreamError::Protocol { .. } => Refusal::new(
                Reason::UpstreamError,
                "the exchange with the apiserver failed",
            ),
            UpstreamError::Interrupted(_) => Refusal::new(
                Reason::UpstreamError,
                "the request may have reached the apiserver but no answer came; not retried",
            ),
            UpstreamError::MissingCredential(_)
            | UpstreamError::Config(_)
            | UpstreamError::File { .. }
            | UpstreamError::Rustls { .. } => {
                Refusal::new(Reason::UpstreamError, "bulwark cannot forward this request")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::review::ReviewError;
    use crate::report::SharedError;
    use crate::upstream::TlsFailure;

    /// The whole answer a client gets for `error`, as Rescue writes it.
    async fn answer(error: ProxyError) -> (StatusCode, String) {
        let refusal = error.refusal();
        let response = error.into_response(refusal);
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn failures_upstream_name_no_replica_and_no_file_to_the_client() {
        let replica = "10.0.0.7:6443";
        let refused = || -> SharedError { Arc::new(std::io::Error::other("refused")) };
        let errors = [
            ProxyError::Upstream(UpstreamError::Connect {
                replica: replica.into(),
                source: Arc::new(std::io::Error::other("refused")),
            }),
            ProxyError::Upstream(UpstreamError::Tls {
                replica: replica.into(),
                source: Arc::new(TlsFailure::Handshake(std::io::Error::other(
                    "bad certificate",
                ))),
            }),
            ProxyError::Upstream(UpstreamError::Protocol {
                replica: replica.into(),
                source: refused(),
            }),
            ProxyError::Upstream(UpstreamError::Interrupted(Arc::new(
                UpstreamError::Protocol {
                    replica: replica.into(),
                    source: refused(),
                },
            ))),
            ProxyError::Upstream(UpstreamError::Config(format!("replica {replica}"))),
            ProxyError::Upstream(UpstreamError::File {
                path: format!("/var/run/secrets/{replica}/ca.crt").into(),
                source: refused(),
            }),
            ProxyError::Identity(IdentityError::ReviewFailed(Arc::new(ReviewError::Status {
                path: "/apis/authentication.k8s.io/v1/tokenreviews",
                status: StatusCode::BAD_GATEWAY,
                message: format!("{replica}: refused"),
            }))),
            ProxyError::Forward(ForwardError::OwnToken {
                path: format!("/var/run/secrets/{replica}/token").into(),
                source: refused(),
            }),
            ProxyError::Cache {
                error: CacheError::ReviewFailed(Arc::new(ReviewError::Upstream {
                    path: "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                    source: UpstreamError::Connect {
                        replica: replica.into(),
                        source: Arc::new(std::io::Error::other("refused")),
                    },
                })),
                rule: Arc::from("r"),
                level: "l".into(),
            },
        ];
        for error in errors {
            let detail = crate::report::chain(&error);
            assert!(
                detail.contains(replica),
                "the log line has the cause: {detail}"
            );
            let (status, body) = answer(error).await;
            assert!(status.is_server_error(), "{detail}: {status}");
            assert!(!body.contains(replica), "{detail}: {body}");
            assert!(!body.contains("/var/run"), "{detail}: {body}");
        }
    }

    #[tokio::test]
    async fn every_401_says_unauthorized_and_nothing_more() {
        for error in [
            IdentityError::NoCredentials,
            IdentityError::MalformedAuthorization,
            IdentityError::TokenRejected("token expired".into()),
            IdentityError::BadCertificate("more than one CN".into()),
        ] {
            let (status, body) = answer(ProxyError::Identity(error)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
            let status: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(status["message"], "Unauthorized");
            assert_eq!(status["reason"], "Unauthorized");
            assert_eq!(status["code"], 401);
        }
    }
}
