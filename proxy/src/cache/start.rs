//! Starting the cache: one informer task per configured resource, with Bulwark's own
//! identity, and the task that keeps the per-resource gauges current.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use super::lists::Lists;
use super::store::Writer;
use super::{
    AccessCache, AccessReviewer, AuditLog, Cache, CachedResource, UpstreamAccessReviewer, informer,
};
use crate::config;
use crate::metrics::Metrics;
use crate::own;

impl Cache {
    /// Starts one informer per configured resource (Bulwark's own identity).
    pub fn start(
        cfg: &config::Cache,
        client: own::Client,
        metrics: Metrics,
        audit: Option<AuditLog>,
    ) -> Arc<Cache> {
        let reviewer = Arc::new(UpstreamAccessReviewer::new(client.clone()));
        let cache = Cache::build(cfg, reviewer, metrics, audit);
        if cfg.enabled {
            let mut tasks = Vec::new();
            for resource in &cache.resources {
                let (ring, buffer) = (cfg.ring_size, cfg.watcher_buffer);
                let relists = cache
                    .metrics
                    .cache_relists_total
                    .with_label_values(&[&resource.label]);
                tasks.push(tokio::spawn(informer::run(
                    client.clone(),
                    resource.gr.clone(),
                    resource.store.clone(),
                    Box::new(move |kind| Writer::new(kind, ring, buffer).counting_relists(relists)),
                    cfg.watch_list,
                )));
            }
            tasks.push(tokio::spawn(gauges(Arc::downgrade(&cache))));
            cache
                .tasks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(tasks);
        }
        cache
    }

    /// The cache of `cfg`'s resources, their stores still empty, with no task running
    /// (tests fill the stores themselves and review with a double).
    pub(super) fn build(
        cfg: &config::Cache,
        reviewer: Arc<dyn AccessReviewer>,
        metrics: Metrics,
        audit: Option<AuditLog>,
    ) -> Arc<Cache> {
        let resources = if cfg.enabled {
            cfg.resources
                .iter()
                .map(|gr| CachedResource {
                    label: gr.to_string(),
                    gr: gr.clone(),
                    store: Arc::new(OnceLock::new()),
                })
                .collect()
        } else {
            Vec::new()
        };
        Arc::new(Cache {
            cfg: cfg.clone(),
            resources,
            access: Arc::new(AccessCache::new(
                reviewer,
                cfg.access_review_ttl,
                metrics.clone(),
            )),
            audit,
            lists: Mutex::new(Lists::new(cfg.list_cache_bytes.0)),
            metrics,
            started: Instant::now(),
            tasks: Mutex::new(Vec::new()),
        })
    }
}

/// Keeps the per-resource gauges current while the cache lives.
async fn gauges(cache: std::sync::Weak<Cache>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(cache) = cache.upgrade() else {
            return;
        };
        let m = &cache.metrics;
        for resource in &cache.resources {
            let Some(store) = resource.store() else {
                continue;
            };
            let (count, bytes) = store.size(None);
            let labels = [resource.label.as_str()];
            m.cache_objects.with_label_values(&labels).set(count as i64);
            m.cache_bytes.with_label_values(&labels).set(bytes as i64);
            m.cache_watchers
                .with_label_values(&labels)
                .set(store.watchers() as i64);
            m.cache_lag_seconds
                .with_label_values(&labels)
                .set(store.lag().as_secs_f64());
        }
    }
}
