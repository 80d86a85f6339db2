//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/debug/levels`, `/debug/rules`,
//! `/debug/upstream`, `/debug/fleet`, `/debug/flows`, `/debug/log-level` (GET it; PUT a
//! filter such as `debug` or `info,bulwark::admit=debug` to change it) (DESIGN.md step 10).
//!
//! Plain HTTP on its own address (localhost unless configured), apart from client traffic
//! so that probes and scrapes never queue behind it, with connection caps and timeouts of
//! its own (`admin.limits`) so that a flood of it cannot take the descriptors the rest of
//! the process needs. `/debug/*` needs the configured token
//! when the listener is not bound to a loopback address.

mod scrapers;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::task::JoinHandle;

use crate::admit::Admission;
use crate::cache::Cache;
use crate::config;
use crate::fleet::Fleet;
use crate::listen::{AdminListener, ConnInfo, ListenError};
use crate::metrics::Metrics;
use crate::report::Chain;
use crate::rules::Rules;
use crate::upstream::Upstream;
use crate::{Body, full};

pub use scrapers::{Limited, Scrapers};

/// What the admin endpoints read.
pub struct State {
    /// Every metric.
    pub metrics: Metrics,
    /// The upstream pool, for readiness.
    pub upstream: Upstream,
    /// The rules in force, for `/debug/rules`.
    pub rules: Arc<Rules>,
    /// Admission, for `/debug/levels`.
    pub admission: Arc<Admission>,
    /// The cache, whose first sync `/readyz` waits for (up to its cap).
    pub cache: Option<Arc<Cache>>,
    /// The fleet membership, for `/debug/fleet`; `None` when the fleet is off.
    pub fleet: Option<Arc<Fleet>>,
    /// The flows seen, for `/debug/flows`.
    pub board: Arc<crate::board::Board>,
    /// Who may read `/metrics`: `None` for anyone who reaches the listener.
    pub metrics_auth: Option<MetricsAuth>,
    /// What `/debug/*` requires: `Open` on loopback, else the token (or nothing is served).
    pub debug_token: DebugAccess,
    /// Set when SIGTERM arrived: `/readyz` fails from then on.
    pub draining: AtomicBool,
}

impl State {
    /// Ready when not draining and at least one upstream replica is healthy.
    pub fn ready(&self) -> Result<(), NotReady> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(NotReady::Draining);
        }
        if self.upstream.healthy_replicas() == 0 {
            return Err(NotReady::NoHealthyUpstream);
        }
        if self.cache.as_ref().is_some_and(|c| !c.synced()) {
            return Err(NotReady::CacheNotSynced);
        }
        Ok(())
    }
}

/// Why `/readyz` fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// SIGTERM arrived.
    #[error("shutting down")]
    Draining,
    /// No upstream replica is in rotation.
    #[error("no healthy upstream replica")]
    NoHealthyUpstream,
    /// The cache has not finished its first list.
    #[error("the cache has not finished its first list")]
    CacheNotSynced,
}

/// Who may read `/debug/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DebugAccess {
    /// Bound to loopback: anyone who can reach it.
    Open,
    /// Only requests with `Authorization: Bearer <token>`.
    Token(String),
    /// Not on loopback and no token configured: nobody.
    Closed,
}

/// The debug access for an admin configuration; reads the token file.
pub fn debug_token(admin: &config::Admin) -> std::io::Result<DebugAccess> {
    if admin.address.ip().is_loopback() {
        return Ok(DebugAccess::Open);
    }
    match &admin.token_file {
        Some(path) => {
            let token = std::fs::read_to_string(path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            Ok(DebugAccess::Token(token.trim().to_string()))
        }
        None => Ok(DebugAccess::Closed),
    }
}

fn debug_allowed(access: &DebugAccess, headers: &http::HeaderMap) -> bool {
    match access {
        DebugAccess::Open => true,
        DebugAccess::Closed => false,
        DebugAccess::Token(token) => headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| {
                // Constant-time comparison: the token guards the admin port.
                given.len() == token.len()
                    && given
                        .bytes()
                        .zip(token.bytes())
                        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                        == 0
            }),
    }
}

/// Whether the request carries the configured admin token (never true on a loopback
/// listener, whose `/debug/*` is open without one).
fn holds_admin_token(access: &DebugAccess, headers: &http::HeaderMap) -> bool {
    matches!(access, DebugAccess::Token(_)) && debug_allowed(access, headers)
}

/// How `/metrics` callers are checked (`admin.metricsAccess: authorized`): a TokenReview of
/// their bearer token, then a SubjectAccessReview of `get` on `/metrics`, both upstream.
pub struct MetricsAuth {
    /// Reviews (and caches) bearer tokens, as for clients.
    pub tokens: Arc<crate::identity::review::TokenCache>,
    /// Bulwark's own client, which makes the SubjectAccessReview.
    pub own: crate::own::Client,
    /// Decisions remembered per user, and scrapes bounded per source and per user.
    pub scrapers: Scrapers,
}

/// How often the admin listener's certificate files are checked for a change.
const TLS_RELOAD_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Binds the admin listener and serves it in the background: HTTPS with `tls`, within
/// `limits`' caps and timeouts (the client listener's machinery, [`AdminListener`]).
pub async fn serve(
    address: SocketAddr,
    limits: &config::AdminLimits,
    state: Arc<State>,
    tls: Option<crate::listen::ServingTls>,
) -> Result<(SocketAddr, JoinHandle<()>), ListenError> {
    let listener = AdminListener::bind(address, limits, tls.clone(), &state.metrics).await?;
    let local = listener.local_addr();
    if let Some(tls) = tls {
        tokio::spawn(async move {
            let mut every = tokio::time::interval(TLS_RELOAD_EVERY);
            every.tick().await;
            loop {
                every.tick().await;
                let files = tls.clone();
                match tokio::task::spawn_blocking(move || files.reload()).await {
                    Ok(Ok(true)) => tracing::info!("admin listener certificate reloaded"),
                    Ok(Ok(false)) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(error = %Chain(&e), "admin listener certificate not reloaded; the old one stays")
                    }
                    Err(_) => {}
                }
            }
        });
    }
    let service = tower::service_fn(move |request: Request<Incoming>| {
        let state = state.clone();
        async move {
            // Every request the listener serves carries its connection's details. A
            // connection that sent a whole request is a prober or a scraper, no longer one
            // a silent flood's newcomers may evict at the cap.
            let conn = request.extensions().get::<ConnInfo>();
            if let Some(conn) = conn {
                conn.auth.accepted();
            }
            let peer = conn.map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |info| info.peer);
            Ok::<_, Infallible>(handle(&state, request, peer).await)
        }
    });
    let task = tokio::spawn(async move {
        if let Err(error) = listener.serve(service).await {
            tracing::error!(error = %Chain(&error), "the admin listener stopped");
        }
    });
    Ok((local, task))
}

/// Whether the caller of `request` may read `/metrics`: `Err` is the answer when not.
async fn metrics_allowed(
    auth: &MetricsAuth,
    request: &Request<Incoming>,
    peer: SocketAddr,
) -> Result<(), Response<Body>> {
    use crate::cache::authz::{Decision, review_non_resource};
    let refuse = |status, why: String| text(status, "text/plain", format!("{why}\n"));
    auth.scrapers
        .allow_source(peer.ip())
        .map_err(|limited| too_many(limited, peer))?;
    let token = match crate::identity::bearer_token(request.headers()) {
        Ok(Some(token)) => token,
        Ok(None) | Err(_) => {
            return Err(refuse(
                StatusCode::UNAUTHORIZED,
                "/metrics needs a bearer token".into(),
            ));
        }
    };
    let user = match auth.tokens.authenticate(&token, Some(peer.ip())).await {
        Ok(user) => user,
        Err(e) => {
            tracing::info!(%peer, error = %Chain(&e), "a /metrics caller was not authenticated");
            return Err(refuse(StatusCode::UNAUTHORIZED, "Unauthorized".into()));
        }
    };
    auth.scrapers
        .allow_user(&user)
        .map_err(|limited| too_many(limited, peer))?;
    let forbidden = || {
        refuse(
            StatusCode::FORBIDDEN,
            format!("{} may not get /metrics", user.username),
        )
    };
    if let Some(decision) = auth.scrapers.remembered(&user) {
        // Said at info when the authorizer decided; a caller that keeps asking is not news.
        return decision.map_err(|why| {
            tracing::debug!(%peer, user = user.username, why, "a /metrics caller was refused");
            forbidden()
        });
    }
    let denied = |why: String| {
        tracing::info!(%peer, user = user.username, why, "a /metrics caller was refused");
        forbidden()
    };
    match review_non_resource(&auth.own, &user, "get", "/metrics").await {
        Ok(Decision::Allowed) => {
            auth.scrapers.remember(&user, Ok(()));
            Ok(())
        }
        Ok(Decision::Denied(why)) => {
            auth.scrapers.remember(&user, Err(why.clone()));
            Err(denied(why))
        }
        Err(e) => {
            tracing::warn!(%peer, error = %Chain(&e), "no SubjectAccessReview for a /metrics caller");
            Err(refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "the caller could not be authorized: no SubjectAccessReview could be made".into(),
            ))
        }
    }
}

/// 429 for a scraper past its bound, with the second it may come back in.
fn too_many(limited: Limited, peer: SocketAddr) -> Response<Body> {
    let who = match limited {
        Limited::Source => "this address",
        Limited::User => "this user",
    };
    tracing::debug!(%peer, who, "a /metrics caller scrapes too often");
    let mut response = text(
        StatusCode::TOO_MANY_REQUESTS,
        "text/plain",
        format!("{who} scrapes /metrics too often; retry later\n"),
    );
    response.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    response
}

/// The longest log filter `PUT /debug/log-level` takes.
const MAX_LOG_FILTER: usize = 4096;

/// [`route`], after reading the body of `PUT /debug/log-level`, the one request with a body.
async fn handle(state: &State, request: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    // The admin token opens `/metrics` too: the on-call who holds it for `/debug/*` reads
    // what Prometheus reads, without a ServiceAccount token of a scraper.
    if request.uri().path() == "/metrics"
        && let Some(auth) = &state.metrics_auth
        && !holds_admin_token(&state.debug_token, request.headers())
        && let Err(refused) = metrics_allowed(auth, &request, peer).await
    {
        return refused;
    }
    if request.uri().path() != "/debug/log-level" || request.method() != http::Method::PUT {
        return route(state, request);
    }
    if !debug_allowed(&state.debug_token, request.headers()) {
        return route(state, request);
    }
    use http_body_util::BodyExt;
    let body = match http_body_util::Limited::new(request.into_body(), MAX_LOG_FILTER)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes(),
        Err(e) => {
            return text(
                StatusCode::BAD_REQUEST,
                "text/plain",
                format!("the log filter could not be read (at most {MAX_LOG_FILTER} bytes): {e}\n"),
            );
        }
    };
    match crate::logs::set_log_level(&String::from_utf8_lossy(&body)) {
        Ok(()) => text(
            StatusCode::OK,
            "text/plain",
            format!("{}\n", crate::logs::log_level().unwrap_or_default()),
        ),
        Err(why) => text(StatusCode::BAD_REQUEST, "text/plain", format!("{why}\n")),
    }
}

fn route(state: &State, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path();
    if path.starts_with("/debug/") && !debug_allowed(&state.debug_token, request.headers()) {
        return text(
            StatusCode::FORBIDDEN,
            "text/plain",
            "the debug endpoints need the admin token\n".into(),
        );
    }
    match path {
        "/debug/levels" => json(state.admission.levels_json()),
        "/debug/rules" => json(state.rules.current().to_json()),
        "/debug/upstream" => json(upstream_json(&state.upstream)),
        "/debug/log-level" => match crate::logs::log_level() {
            Some(level) => text(StatusCode::OK, "text/plain", format!("{level}\n")),
            None => text(
                StatusCode::NOT_FOUND,
                "text/plain",
                "this process's log filter cannot be changed\n".into(),
            ),
        },
        "/debug/flows" => json(serde_json::to_value(state.board.view()).unwrap_or_default()),
        "/debug/fleet" => json(match &state.fleet {
            Some(fleet) => fleet.debug_json(),
            None => serde_json::json!({
                "enabled": false,
                "reason": "no fleet section in the configuration: each replica holds the static split",
            }),
        }),
        "/metrics" => text(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            state.metrics.render(),
        ),
        "/healthz" | "/livez" => text(StatusCode::OK, "text/plain", "ok".into()),
        "/readyz" => match state.ready() {
            Ok(()) => text(StatusCode::OK, "text/plain", "ok".into()),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                why.to_string(),
            ),
        },
        _ => text(StatusCode::NOT_FOUND, "text/plain", "not found".into()),
    }
}

/// `/debug/upstream`: each replica's state in the pick — in rotation, counted heavier after
/// a 429 of its own, pending requests, watches, LIST bytes, connections.
fn upstream_json(upstream: &Upstream) -> serde_json::Value {
    let replicas: Vec<serde_json::Value> = upstream
        .snapshot()
        .into_iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name,
                "healthy": r.healthy,
                "throttled": r.throttled,
                "pending": r.pending,
                "watches": r.watches,
                "inFlightBytes": r.in_flight_bytes,
                "connections": r.connections,
            })
        })
        .collect();
    serde_json::json!({ "replicas": replicas })
}

fn json(value: serde_json::Value) -> Response<Body> {
    let mut body = serde_json::to_string_pretty(&value).unwrap_or_default();
    body.push('\n');
    text(StatusCode::OK, "application/json", body)
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    response
}
