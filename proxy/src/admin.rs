//! The admin listener: `/metrics`, `/healthz`, `/readyz` (DESIGN.md step 10).
//!
//! Plain HTTP on its own address (localhost unless configured), apart from client traffic
//! so that probes and scrapes never queue behind it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::upstream::Upstream;
use crate::{Body, full};

/// What the admin endpoints read.
pub struct State {
    /// Every metric.
    pub metrics: Metrics,
    /// The upstream pool, for readiness.
    pub upstream: Upstream,
    /// Set when SIGTERM arrived: `/readyz` fails from then on.
    pub draining: AtomicBool,
}

impl State {
    /// Ready when not draining and at least one upstream replica is healthy.
    pub fn ready(&self) -> Result<(), String> {
        if self.draining.load(Ordering::SeqCst) {
            return Err("shutting down".into());
        }
        if self.upstream.healthy_replicas() == 0 {
            return Err("no healthy upstream replica".into());
        }
        Ok(())
    }
}

/// Binds the admin listener and serves it in the background.
pub async fn serve(
    address: SocketAddr,
    state: Arc<State>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(address).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(route(&state, request)) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((local, task))
}

fn route(state: &State, request: Request<Incoming>) -> Response<Body> {
    match request.uri().path() {
        "/metrics" => text(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            state.metrics.render(),
        ),
        "/healthz" | "/livez" => text(StatusCode::OK, "text/plain", "ok".into()),
        "/readyz" => match state.ready() {
            Ok(()) => text(StatusCode::OK, "text/plain", "ok".into()),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, "text/plain", why),
        },
        _ => text(StatusCode::NOT_FOUND, "text/plain", "not found".into()),
    }
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
