//! The watch-fed cache, where `cache.enabled`.

use std::sync::Arc;

use crate::cache::{AuditLog, Cache};
use crate::config;
use crate::metrics::Metrics;
use crate::own;

/// Starts the cache's informers through Bulwark's own client; `None` when it is off. Its
/// answers are written to the audit log, when there is one.
pub(super) fn start(
    cfg: &config::Cache,
    own: &own::Client,
    metrics: &Metrics,
    audit: Option<AuditLog>,
) -> Option<Arc<Cache>> {
    cfg.enabled
        .then(|| Cache::start(cfg, own.clone(), metrics.clone(), audit))
}
