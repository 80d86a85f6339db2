//! The admin listener: metrics, health and debug endpoints over the running parts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::task::JoinHandle;

use super::StartError;
use crate::admin::{self, MetricsAuth, Scrapers, State};
use crate::admit::Admission;
use crate::board::Board;
use crate::cache::Cache;
use crate::config::{self, Config};
use crate::fleet::Fleet;
use crate::identity::TokenCache;
use crate::listen::ServingTls;
use crate::metrics::Metrics;
use crate::own;
use crate::rules::Rules;
use crate::upstream::Upstream;

/// The running parts the admin endpoints report on.
pub(super) struct Parts {
    pub(super) metrics: Metrics,
    pub(super) upstream: Upstream,
    pub(super) rules: Arc<Rules>,
    pub(super) admission: Arc<Admission>,
    pub(super) cache: Option<Arc<Cache>>,
    pub(super) fleet: Option<Arc<Fleet>>,
    pub(super) board: Arc<Board>,
    /// For `metricsAccess: authorized`: scrapers' tokens are reviewed like clients'.
    pub(super) tokens: Arc<TokenCache>,
    pub(super) own: own::Client,
}

/// The admin listener, serving.
pub(super) struct Serving {
    pub(super) state: Arc<State>,
    pub(super) addr: SocketAddr,
    pub(super) task: JoinHandle<()>,
}

/// Binds the admin listener (HTTPS with `admin.tls`) and serves the admin endpoints.
pub(super) async fn serve(config: &Config, parts: Parts) -> Result<Serving, StartError> {
    let authorized = config.admin.metrics_access == config::MetricsAccess::Authorized;
    let state = Arc::new(State {
        metrics: parts.metrics,
        upstream: parts.upstream,
        rules: parts.rules,
        admission: parts.admission,
        cache: parts.cache,
        fleet: parts.fleet,
        board: parts.board,
        metrics_auth: authorized.then(|| MetricsAuth {
            tokens: parts.tokens,
            own: parts.own,
            scrapers: Scrapers::new(config.cache.access_review_ttl),
        }),
        debug_token: admin::debug_token(&config.admin)?,
        draining: AtomicBool::new(false),
    });
    let tls = match &config.admin.tls {
        Some(tls) => Some(
            ServingTls::load(&tls.cert, &tls.key, &state.metrics).map_err(StartError::AdminTls)?,
        ),
        None => None,
    };
    let (addr, task) = admin::serve(
        config.admin.address,
        &config.admin.limits,
        state.clone(),
        tls,
    )
    .await
    .map_err(StartError::AdminListen)?;
    Ok(Serving { state, addr, task })
}
