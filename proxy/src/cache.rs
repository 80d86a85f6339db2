//! The watch-fed cache (DESIGN.md step 7): one upstream informer per configured resource,
//! and the answers it gives to GET, LIST and WATCH when it may.
//!
//! Where things are: [`plan`] decides whether the cache answers (below), [`answer`]
//! answers, with whole lists from [`lists`] and pages from [`pages`]; [`start`] runs the
//! informers ([`informer`], each the one writer of its resource's [`store`]) and the
//! gauges; [`watch`] streams, [`respond`] encodes, [`authz`] and [`audit`] review and log.
//!
//! [`Cache::serve`] decides in this order:
//! 1. **bypass** (`Ok(None)`): not a cached resource and version, a subresource, a verb
//!    other than get/list/watch, `Impersonate-*` headers, an `Accept` that asks for `as=`
//!    or cannot take JSON, excluded namespaces or names, parameters the cache does not
//!    answer (an *Exact* list, selectors on other fields, values the apiserver would
//!    refuse — it writes the error);
//! 2. **miss** (`Ok(None)`): the first full list is not in, or the cache cannot show at
//!    once that it is fresh enough. The cache never waits for its own watch: a
//!    `resourceVersion=0` read takes what it has; a `NotOlderThan` read (or a watch from
//!    a version) is answered when the cache has already reached that version; a
//!    consistent read (no `resourceVersion`) goes upstream, unless the client's rule
//!    grants `staleness` and the cache lags at most that much. (The cache's version only
//!    moves with its own resource's events and bookmarks, while other writes — Leases —
//!    move the apiserver's: waiting to prove a consistent read fresh cost seconds and
//!    then went upstream anyway.)
//! 3. **authorize** with a SubjectAccessReview for that user ([`authz`]): denied is 403
//!    (audited for Secrets, like an answer), no answer is an error, never data;
//! 4. **answer**: GET, LIST (a chain of the objects' bytes, reused from a byte-bounded
//!    LRU) or WATCH ([`watch`]). Secret reads are written to the audit log.
//!
//! **Pagination**: `limit` is honoured on every cached LIST but a `resourceVersion=0` one,
//! which kube-apiserver v1.36 answers whole from its watch cache whatever the limit. Objects are
//! listed in etcd's key order, and a page ends with the apiserver's own continue token
//! (version, and the last key relative to the list's prefix; see
//! [`apimachinery::continue_token`]), so either the cache or the apiserver can continue
//! it. A continue is served from the cache while its version is within the ring (the cache
//! rolls its state back to it), else it goes upstream; a token the apiserver would refuse
//! goes upstream for its 400.
//!
//! **Versions newer than the cache** go upstream, where the apiserver decides (it waits for
//! a version it is about to reach, and answers 504 `ResourceVersionTooLarge` otherwise).
//! **Versions older than the ring** go upstream too: a watch resuming from before the
//! cache's start (after a Bulwark restart or relist) is streamed by the apiserver's own
//! watch cache, which reaches further back, or refused with its own 410. A 410 from
//! Bulwark would make every such client relist after each restart (a whole LIST each, and
//! its handlers told a replaced state instead of the events in between). Both count as
//! misses (`cache_requests_total{result="miss"}`, `requests_total{served_by="upstream"}`).

pub(crate) mod accept;
mod answer;
pub mod audit;
pub mod authz;
mod informer;
mod lists;
mod pages;
mod plan;
pub mod protobuf;
mod respond;
mod start;
pub(crate) mod store;
mod watch;

use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::{HeaderMap, Response};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::Body;
use crate::classify::RequestInfo;
use crate::config::{self, GroupResource};
use crate::metrics::Metrics;
use crate::own;
use crate::user::User;

pub use accept::Encoding;
pub use apimachinery::status::Status;
pub use audit::AuditLog;
pub use authz::{AccessCache, AccessReviewer, Attributes, Decision, UpstreamAccessReviewer};
pub use plan::Plan;

use apimachinery::selector as select;
use lists::Lists;
use store::Store;

/// Why the cache refused a request it would otherwise answer.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// An answer in the apiserver's own words (403 Forbidden), with the request's
    /// `Audit-Id`, which its audit line names too.
    #[error("{}", .0.message)]
    Status(Box<Status>, String),
    /// No SubjectAccessReview could be made: the request gets an error, never data.
    #[error("the access review for a cached read could not be made")]
    ReviewFailed(#[source] Arc<own::ReviewError>),
}

impl CacheError {
    /// The response that carries a [`CacheError::Status`] as the apiserver writes it.
    pub fn status_response(&self) -> Option<Response<Body>> {
        match self {
            CacheError::Status(status, audit_id) => {
                Some(respond::status_response(status, audit_id))
            }
            CacheError::ReviewFailed(_) => None,
        }
    }
}

/// One configured resource: its store appears once discovery has found its kind.
struct CachedResource {
    gr: GroupResource,
    label: String,
    store: Arc<OnceLock<Store>>,
}

impl CachedResource {
    fn store(&self) -> Option<&Store> {
        self.store.get()
    }
}

/// The watch-fed cache of every configured resource.
pub struct Cache {
    cfg: config::Cache,
    resources: Vec<CachedResource>,
    access: Arc<AccessCache>,
    audit: Option<AuditLog>,
    metrics: Metrics,
    lists: Mutex<Lists>,
    started: Instant,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Cache {
    fn drop(&mut self) {
        for task in self
            .tasks
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            task.abort();
        }
    }
}

impl Cache {
    /// For `/readyz`: every resource has its first full list, or the sync cap has passed.
    pub fn synced(&self) -> bool {
        self.started.elapsed() >= self.cfg.sync_cap
            || self
                .resources
                .iter()
                .all(|s| s.store().is_some_and(|st| st.synced()))
    }

    /// Object count and total bytes of a resource (`secrets`, or `resource.group`) in a
    /// namespace or the whole cluster, for admission's cost estimate; `None` when the
    /// resource is not cached or not synced yet.
    pub fn scope_size(&self, resource: &str, namespace: Option<&str>) -> Option<(u64, u64)> {
        let cached = self
            .resources
            .iter()
            .find(|s| s.label == resource || s.gr.resource == resource)?;
        let store = cached.store()?;
        store.synced().then(|| store.size(namespace))
    }

    /// Event encodings made so far, all resources together: with N watchers of one event it
    /// grows by one, not N.
    pub fn event_encodings(&self) -> u64 {
        self.resources
            .iter()
            .filter_map(CachedResource::store)
            .map(|s| s.encodings().load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// [`Cache::plan`] then [`Cache::answer`], with no admission between: `Ok(None)` means
    /// "go upstream". For callers that admit nothing (tests, tools).
    pub async fn serve(
        &self,
        info: &RequestInfo,
        reader: Reader<'_>,
        staleness: Option<Duration>,
    ) -> Result<Option<Response<Body>>, CacheError> {
        let Some(plan) = self.plan(info, reader.headers, staleness) else {
            return Ok(None);
        };
        self.answer(plan, info, reader, None).await.map(Some)
    }
}

/// Who asks: the user, the request's headers and the client's address (for the audit
/// log's `sourceIPs`; `None` names only the addresses the headers give).
#[derive(Clone, Copy)]
pub struct Reader<'a> {
    /// The user the SubjectAccessReview asks about.
    pub user: &'a User,
    /// The request's headers (`Accept`, `Accept-Encoding`, `Audit-Id`, `User-Agent`).
    pub headers: &'a HeaderMap,
    /// The client's address.
    pub peer: Option<IpAddr>,
}

/// Response extension of a cached watch that starts with the current state: the bytes of
/// that state, which the response sends before any event. Admission watches the client's
/// progress until they are out.
#[derive(Debug, Clone, Copy)]
pub struct InitialState(pub u64);

/// Something held until dropped (admission's seats for a watch's initial state), whose
/// owner the cache need not know.
pub struct Held {
    _thing: Box<dyn Send + Sync>,
}

impl Held {
    /// Holds `thing` until this is dropped.
    pub fn new(thing: impl Send + Sync + 'static) -> Held {
        Held {
            _thing: Box::new(thing),
        }
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held")
    }
}

#[cfg(test)]
mod tests;
