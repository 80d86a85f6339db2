//! The pool of connections to the apiserver replicas, and their probes.

use crate::config;
use crate::metrics::Metrics;
use crate::upstream::{Upstream, UpstreamError, UpstreamTls};

/// The pool for the configured replicas, its credentials' expiry in the metrics, probing
/// every replica's `/readyz`.
pub(super) fn start(cfg: &config::Upstream, metrics: &Metrics) -> Result<Upstream, UpstreamError> {
    let tls = UpstreamTls::from_config(cfg)?;
    tls.record_expiry(metrics);
    let upstream = Upstream::new(cfg, tls, metrics.clone())?;
    upstream.spawn_probes();
    Ok(upstream)
}
