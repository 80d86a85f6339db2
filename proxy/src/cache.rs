//! The watch-fed cache (DESIGN.md step 7): one upstream informer per configured resource,
//! and the answers it gives to GET, LIST and WATCH when it may.
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
pub mod audit;
pub mod authz;
mod informer;
pub mod protobuf;

pub use accept::Encoding;
mod respond;
pub(crate) mod store;
mod watch;

use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::Body;
use crate::classify::{RequestInfo, Verb};
use crate::config::{self, GroupResource};
use crate::metrics::Metrics;
use crate::own;
use crate::user::User;

pub use apimachinery::status::Status;
pub use audit::AuditLog;
pub use authz::{AccessCache, AccessReviewer, Attributes, Decision, UpstreamAccessReviewer};

use apimachinery::continue_token::{self, Scope};
use apimachinery::selector as select;
use apimachinery::status::{Details, qualified};
use respond::Continue;
use select::{FieldSelector, LabelSelector};
use store::{Obj, Store, Writer};

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

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ListKey {
    resource: String,
    namespace: Option<String>,
    labels: Option<String>,
    fields: Option<String>,
    rv: u64,
    gzip: bool,
    encoding: Encoding,
}

/// The LRU of encoded LIST responses, bounded in bytes.
struct Lists {
    entries: lru::LruCache<ListKey, ListAnswer>,
    bytes: u64,
    limit: u64,
}

/// A whole LIST answer as it was sent, and whether it was gzipped: a client that asked for
/// gzip gets a small answer uncompressed, and must be told so again when it is reused.
#[derive(Clone)]
struct ListAnswer {
    pieces: Arc<[Bytes]>,
    gzipped: bool,
}

impl Lists {
    fn get(&mut self, key: &ListKey) -> Option<ListAnswer> {
        self.entries.get(key).cloned()
    }

    fn put(&mut self, key: ListKey, answer: ListAnswer) {
        let size = cost(&answer.pieces);
        if size > self.limit / 4 {
            // One response may not take most of the budget.
            return;
        }
        if let Some(old) = self.entries.put(key, answer) {
            self.bytes -= cost(&old.pieces);
        }
        self.bytes += size;
        while self.bytes > self.limit {
            match self.entries.pop_lru() {
                Some((_, old)) => self.bytes -= cost(&old.pieces),
                None => break,
            }
        }
    }
}

fn cost(pieces: &[Bytes]) -> u64 {
    pieces.iter().map(|p| p.len() as u64 + 16).sum()
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

/// Why the cache leaves a request to the apiservers.
enum GoUpstream {
    /// Not something the cache answers, whatever it holds.
    Bypass(&'static str),
    /// Something it answers, but not now (not synced, not fresh enough, out of its ring).
    Miss(&'static str),
}

/// How fresh an answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freshness {
    /// Any state the cache has (`resourceVersion=0`).
    Any,
    /// At least this version (`NotOlderThan`).
    AtLeast(u64),
    /// The apiserver's current state (no resourceVersion).
    Consistent,
}

/// What the cache will answer for a request ([`Cache::plan`]), and how many bytes of
/// objects that answer holds, for admission to weigh before it is given.
pub struct Plan {
    resource: usize,
    store: Store,
    filter: watch::Filter,
    what: Planned,
    bytes: u64,
    encoding: Encoding,
}

impl Plan {
    /// The bytes of objects the answer holds (a watch from a version: none).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("resource", &self.resource)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

enum Planned {
    Get {
        name: String,
    },
    List {
        continued: Option<Continued>,
    },
    Watch {
        from: Option<u64>,
        watch_list: bool,
        /// For a watch from a version: its events, subscribed when planned, so that the
        /// ring cannot move past that version while admission decides.
        start: Option<store::WatchStart>,
    },
}

/// The rest of a paginated list, at the version its continue token names.
struct Continued {
    at: u64,
    items: Vec<Arc<Obj>>,
}

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

    fn build(
        cfg: &config::Cache,
        reviewer: Arc<dyn AccessReviewer>,
        metrics: Metrics,
        audit: Option<AuditLog>,
    ) -> Arc<Cache> {
        let resources = if cfg.enabled {
            cfg.group_resources()
                .into_iter()
                .map(|gr| CachedResource {
                    label: gr.to_string(),
                    gr,
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
            lists: Mutex::new(Lists {
                entries: lru::LruCache::unbounded(),
                bytes: 0,
                limit: cfg.list_cache_bytes.0,
            }),
            metrics,
            started: Instant::now(),
            tasks: Mutex::new(Vec::new()),
        })
    }

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

    /// Whether the cache answers this request, and how large its answer is, decided from
    /// what the cache holds now, without I/O: admission weighs the answer before it is
    /// given. `None` means "go upstream" (a bypass or a miss, counted either way).
    pub fn plan(
        &self,
        info: &RequestInfo,
        headers: &HeaderMap,
        staleness: Option<Duration>,
    ) -> Option<Plan> {
        let (index, resource) = self.resource_for(info)?;
        let verb = info.verb.to_string();
        let planned = self.plan_in(index, resource, info, headers, staleness);
        let label = match &planned {
            Ok(_) => "hit",
            Err(GoUpstream::Miss(why)) => {
                tracing::debug!(resource = %resource.label, why, "cache miss");
                "miss"
            }
            Err(GoUpstream::Bypass(why)) => {
                tracing::debug!(resource = %resource.label, why, "cache bypass");
                "bypass"
            }
        };
        self.metrics
            .cache_requests_total
            .with_label_values(&[&resource.label, &verb, label])
            .inc();
        planned.ok()
    }

    /// Answers a planned request: a SubjectAccessReview for the reader first (denied is
    /// 403, audited for Secrets like an answer; no review is an error, never data), then
    /// the answer built from the cache as it is now — after any wait for admission.
    /// `initial_seats` are held while a watch sends its initial state.
    pub async fn answer(
        &self,
        plan: Plan,
        info: &RequestInfo,
        reader: Reader<'_>,
        initial_seats: Option<Held>,
    ) -> Result<Response<Body>, CacheError> {
        let audit_id = reader
            .headers
            .get("audit-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map_or_else(audit::new_audit_id, str::to_owned);
        let request = Request {
            resource: &self.resources[plan.resource],
            store: plan.store,
            info,
            user: reader.user,
            headers: reader.headers,
            peer: reader.peer,
            filter: plan.filter,
            audit_id,
            encoding: plan.encoding,
        };
        match plan.what {
            Planned::Get { name } => self.answer_get(request, name).await,
            Planned::List { continued } => self.answer_list(request, continued).await,
            Planned::Watch {
                from,
                watch_list,
                start,
            } => {
                self.answer_watch(request, (from, start), watch_list, initial_seats)
                    .await
            }
        }
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

    fn resource_for(&self, info: &RequestInfo) -> Option<(usize, &CachedResource)> {
        if !info.resource_request {
            return None;
        }
        self.resources
            .iter()
            .enumerate()
            .find(|(_, r)| r.gr.group == info.api_group && r.gr.resource == info.resource)
    }

    fn plan_in(
        &self,
        index: usize,
        resource: &CachedResource,
        info: &RequestInfo,
        headers: &HeaderMap,
        staleness: Option<Duration>,
    ) -> Result<Plan, GoUpstream> {
        if let Some(why) = self.bypass(info, headers) {
            return Err(GoUpstream::Bypass(why));
        }
        let Some(store) = resource.store().cloned() else {
            return Err(GoUpstream::Miss("not synced"));
        };
        let encoding =
            accept::negotiate(headers, store.kind().proto.is_some()).map_err(GoUpstream::Bypass)?;
        if !store.synced() {
            return Err(GoUpstream::Miss("not synced"));
        }
        if info.api_version != store.kind().version {
            return Err(GoUpstream::Bypass("another API version"));
        }
        if !store.kind().namespaced && info.namespace.is_some() {
            // The apiserver answers 404 for a namespaced path to a cluster-scoped resource.
            return Err(GoUpstream::Bypass(
                "a namespace on a cluster-scoped resource",
            ));
        }
        let q = &info.query;
        let filter = match (
            LabelSelector::parse(q.label_selector.as_deref().unwrap_or_default()),
            FieldSelector::parse(q.field_selector.as_deref().unwrap_or_default()),
        ) {
            (Ok(labels), Ok(fields)) => watch::Filter {
                namespace: info.namespace.as_deref().map(str::to_owned),
                labels,
                fields,
            },
            _ => return Err(GoUpstream::Bypass("a selector the cache does not answer")),
        };
        if let Some(why) = self.excluded(info, &filter) {
            return Err(GoUpstream::Bypass(why));
        }
        let rv = match q.resource_version.as_deref().map(str::parse::<u64>) {
            None => None,
            Some(Ok(rv)) => Some(rv),
            Some(Err(_)) => {
                return Err(GoUpstream::Bypass("a resourceVersion that is not a number"));
            }
        };
        let (what, bytes) = match info.verb {
            Verb::Get => self.plan_get(&store, info, rv, staleness)?,
            Verb::List => self.plan_list(&store, &filter, info, rv, staleness)?,
            Verb::Watch => self.plan_watch(&store, &filter, info, rv, staleness)?,
            _ => return Err(GoUpstream::Bypass("not a read")),
        };
        Ok(Plan {
            resource: index,
            store,
            filter,
            what,
            bytes,
            encoding,
        })
    }

    /// Why the request must go upstream whatever the cache holds, if it must.
    fn bypass(&self, info: &RequestInfo, headers: &HeaderMap) -> Option<&'static str> {
        if info.subresource.is_some() {
            return Some("a subresource");
        }
        if !matches!(info.verb, Verb::Get | Verb::List | Verb::Watch) {
            return Some("not a read");
        }
        if info.verb == Verb::Watch && info.name.is_some() {
            // The legacy `/watch/…/NAME` form: rare, and authorized by name upstream.
            return Some("a watch of one named object");
        }
        if headers
            .keys()
            .any(|name| name.as_str().starts_with("impersonate-"))
        {
            return Some("impersonation");
        }
        None
    }

    /// Why the request may reach an excluded namespace or name, if it may.
    fn excluded(&self, info: &RequestInfo, filter: &watch::Filter) -> Option<&'static str> {
        let namespace = info
            .namespace
            .as_deref()
            .or_else(|| filter.fields.pinned_namespace());
        let name = info.name.as_deref().or_else(|| filter.fields.pinned_name());
        let cfg = &self.cfg;
        match namespace {
            Some(ns) if cfg.exclude_namespaces.iter().any(|e| e == ns) => {
                return Some("an excluded namespace");
            }
            None if !cfg.exclude_namespaces.is_empty() => {
                return Some("all namespaces, some excluded");
            }
            _ => {}
        }
        let hit = cfg.exclude_names.iter().any(|entry| {
            let (ens, ename) = entry.split_once('/').unwrap_or(("", entry.as_str()));
            namespace.is_none_or(|ns| ens.is_empty() || ns == ens)
                && name.is_none_or(|n| n == ename)
        });
        hit.then_some("an excluded name")
    }

    fn plan_get(
        &self,
        store: &Store,
        info: &RequestInfo,
        rv: Option<u64>,
        staleness: Option<Duration>,
    ) -> Result<(Planned, u64), GoUpstream> {
        if info.query.resource_version_match.is_some() {
            return Err(GoUpstream::Bypass("resourceVersionMatch on a get"));
        }
        let Some(name) = info.name.clone() else {
            return Err(GoUpstream::Bypass("a get without a name"));
        };
        let freshness = match rv {
            // Only an identity that accepts staleness gets a consistent GET from the cache.
            None if staleness.is_none() => {
                return Err(GoUpstream::Bypass(
                    "a consistent get (one key read upstream)",
                ));
            }
            None => Freshness::Consistent,
            Some(0) => Freshness::Any,
            Some(n) => Freshness::AtLeast(n),
        };
        if !self.fresh(store, freshness, staleness) {
            return Err(GoUpstream::Miss("not fresh enough"));
        }
        Ok((Planned::Get { name: name.into() }, 0))
    }

    fn plan_list(
        &self,
        store: &Store,
        filter: &watch::Filter,
        info: &RequestInfo,
        rv: Option<u64>,
        staleness: Option<Duration>,
    ) -> Result<(Planned, u64), GoUpstream> {
        let q = &info.query;
        let ns = info.namespace.as_deref();
        if let Some(token) = &q.continue_token {
            // The apiserver continues with `resourceVersion=0` as without one, and refuses
            // any other version (400) or a resourceVersionMatch (422): it writes those.
            if rv.is_some_and(|rv| rv != 0) || q.resource_version_match.is_some() {
                return Err(GoUpstream::Bypass("continue with a resourceVersion"));
            }
            // A token the apiserver refuses goes to it rather than being refused here: its
            // 400 quotes Go's JSON errors, which the cache cannot word byte for byte, and
            // it answers only after its own authorization (403 before 400).
            let Ok(resume) = continue_token::decode(token) else {
                return Err(GoUpstream::Bypass("a continue token the apiserver refuses"));
            };
            let from = Scope::of(ns).resume_key(&resume.start);
            let (all, at) = match resume.at() {
                Some(at) => {
                    if store.rv() < at {
                        return Err(GoUpstream::Miss("a continue newer than the cache"));
                    }
                    match store.list_from(ns, Some(at), &from) {
                        Some(listed) => listed,
                        None => return Err(GoUpstream::Miss("a continue older than the ring")),
                    }
                }
                // A negative version: the token the apiserver hands out with its 410 for a
                // continue it compacted away. The rest of the list at the latest version, a
                // consistent read, as the apiserver's watch cache serves it.
                None => {
                    if !self.fresh(store, Freshness::Consistent, staleness) {
                        return Err(GoUpstream::Miss("not fresh enough"));
                    }
                    match store.list_from(ns, None, &from) {
                        Some(listed) => listed,
                        None => return Err(GoUpstream::Miss("a continue the cache cannot list")),
                    }
                }
            };
            let items: Vec<Arc<Obj>> = all.into_iter().filter(|o| filter.matches(o)).collect();
            let bytes = page_bytes(info, &items);
            let continued = Continued { at, items };
            return Ok((
                Planned::List {
                    continued: Some(continued),
                },
                bytes,
            ));
        }
        let freshness = match (rv, q.resource_version_match.as_deref()) {
            (None, None) => Freshness::Consistent,
            (None, Some(_)) => {
                return Err(GoUpstream::Bypass(
                    "resourceVersionMatch without resourceVersion",
                ));
            }
            (Some(_), Some("Exact")) => return Err(GoUpstream::Bypass("an exact list")),
            (Some(0), Some("NotOlderThan") | None) => Freshness::Any,
            (Some(n), Some("NotOlderThan")) => Freshness::AtLeast(n),
            (Some(_), None) if q.limit.is_some() => {
                return Err(GoUpstream::Bypass("an exact list"));
            }
            (Some(n), None) => Freshness::AtLeast(n),
            (Some(_), Some(_)) => {
                return Err(GoUpstream::Bypass("an unknown resourceVersionMatch"));
            }
        };
        if !self.fresh(store, freshness, staleness) {
            return Err(GoUpstream::Miss("not fresh enough"));
        }
        let bytes = answer_bytes(store, filter, ns, page_limit(info));
        Ok((Planned::List { continued: None }, bytes))
    }

    fn plan_watch(
        &self,
        store: &Store,
        filter: &watch::Filter,
        info: &RequestInfo,
        rv: Option<u64>,
        staleness: Option<Duration>,
    ) -> Result<(Planned, u64), GoUpstream> {
        let q = &info.query;
        let watch_list = match q.send_initial_events {
            None => false,
            Some(true)
                if q.resource_version_match.as_deref() == Some("NotOlderThan")
                    && q.allow_watch_bookmarks =>
            {
                true
            }
            Some(_) => {
                return Err(GoUpstream::Bypass(
                    "sendInitialEvents the cache does not answer",
                ));
            }
        };
        if !watch_list && q.resource_version_match.is_some() {
            return Err(GoUpstream::Bypass("resourceVersionMatch on a watch"));
        }
        // `from`: the version to stream events after; `None` starts with the state.
        let (freshness, from) = match (rv, watch_list) {
            (None, _) => (Freshness::Consistent, None),
            (Some(0), _) => (Freshness::Any, None),
            (Some(n), true) => (Freshness::AtLeast(n), None),
            (Some(n), false) => (Freshness::AtLeast(n), Some(n)),
        };
        if !self.fresh(store, freshness, staleness) {
            return Err(GoUpstream::Miss("not fresh enough"));
        }
        // A watch that starts with the current state sends a LIST's worth of objects
        // first: admission weighs it like a LIST of that size. A watch from a version
        // sends events as they come.
        let (bytes, start) = match from {
            None => (
                answer_bytes(store, filter, info.namespace.as_deref(), usize::MAX),
                None,
            ),
            // A version the ring no longer holds (a client resuming across a Bulwark
            // restart or relist, whose cache starts later) goes to the apiserver, whose
            // own watch cache reaches further back: it streams, or answers 410 itself.
            Some(n) => match store.watch_after(n) {
                Ok(start) => (0, Some(start)),
                Err(_) => return Err(GoUpstream::Miss("a watch older than the cache's events")),
            },
        };
        Ok((
            Planned::Watch {
                from,
                watch_list,
                start,
            },
            bytes,
        ))
    }

    /// Whether the store is fresh enough now; the cache never waits for it.
    fn fresh(&self, store: &Store, freshness: Freshness, staleness: Option<Duration>) -> bool {
        match freshness {
            Freshness::Any => true,
            Freshness::AtLeast(rv) => store.rv() >= rv,
            Freshness::Consistent => staleness
                .map(|s| s.min(self.cfg.max_staleness))
                .is_some_and(|bound| store.lag() <= bound),
        }
    }

    /// Asks the apiserver, through the decision cache, whether the user may do this.
    /// [`Cache::authorize`] for a list or watch: its name is the one
    /// `fieldSelector=metadata.name=X` pins, as the apiserver has it, or none.
    async fn authorize_collection(
        &self,
        request: &Request<'_>,
        verb: &str,
    ) -> Result<Attributes, CacheError> {
        let name = request.info.field_selector_name().unwrap_or_default();
        self.authorize(request, verb, name).await
    }

    async fn authorize(
        &self,
        request: &Request<'_>,
        verb: &str,
        name: &str,
    ) -> Result<Attributes, CacheError> {
        let kind = request.store.kind();
        let attrs = Attributes {
            verb: verb.to_owned(),
            group: kind.group.clone(),
            version: kind.version.clone(),
            resource: kind.resource.clone(),
            namespace: request
                .info
                .namespace
                .as_deref()
                .unwrap_or_default()
                .to_owned(),
            name: name.to_owned(),
        };
        match self.access.check(request.user, &attrs).await {
            Ok(Decision::Allowed) => Ok(attrs),
            Ok(Decision::Denied(reason)) => {
                // The apiserver audits the requests it refuses too.
                self.audit(request, verb, Some(name).filter(|n| !n.is_empty()), 403);
                let status = forbidden(request.user, &attrs, &reason);
                Err(CacheError::Status(
                    Box::new(status),
                    request.audit_id.clone(),
                ))
            }
            Err(e) => Err(CacheError::ReviewFailed(e)),
        }
    }

    fn audit(&self, request: &Request<'_>, verb: &str, name: Option<&str>, code: u16) {
        let (Some(log), kind) = (&self.audit, request.store.kind()) else {
            return;
        };
        if !(kind.group.is_empty() && kind.resource == "secrets") {
            return;
        }
        let uri = if request.info.query.raw.is_empty() {
            request.info.path.clone()
        } else {
            format!("{}?{}", request.info.path, request.info.query.raw)
        };
        log.write(&audit::Record {
            audit_id: &request.audit_id,
            request_uri: &uri,
            verb,
            user: request.user,
            resource: &kind.resource,
            namespace: request.info.namespace.as_deref(),
            name,
            group: &kind.group,
            version: &kind.version,
            code,
            user_agent: request
                .headers
                .get(http::header::USER_AGENT)
                .and_then(|v| v.to_str().ok()),
            source_ips: &audit::source_ips(request.headers, request.peer),
        });
    }

    async fn answer_get(
        &self,
        request: Request<'_>,
        name: String,
    ) -> Result<Response<Body>, CacheError> {
        self.authorize(&request, "get", &name).await?;
        let kind = request.store.kind();
        let namespace = request.info.namespace.as_deref().unwrap_or_default();
        let (obj, _) = request.store.get(namespace, &name);
        let Some(obj) = obj else {
            let status = Status::failure(
                404,
                "NotFound",
                format!(
                    "{} not found",
                    qualified(&kind.group, &kind.resource, &name)
                ),
                Some(Details::of(&name, &kind.group, &kind.resource)),
            );
            let response = respond::status_response(&status, &request.audit_id);
            return Ok(self.give(&request, ("get", Some(&name), 404), response));
        };
        let pieces = respond::object_answer(kind, &obj, request.encoding)
            .map_err(|e| self.unencodable(&e, &request, ("get", Some(&name))))?;
        let response = self.respond(&request, pieces).await;
        Ok(self.give(&request, ("get", Some(&name), 200), response))
    }

    /// The apiserver's 500 for a cached object that does not encode in protobuf (its JSON
    /// not reading as its kind): an error, never a silently different object, audited like
    /// any other answer (`verb`, `name`).
    fn unencodable(
        &self,
        error: &protobuf::ProtoError,
        request: &Request<'_>,
        (verb, name): (&str, Option<&str>),
    ) -> CacheError {
        tracing::warn!(error = %crate::report::Chain(error), "a cached object does not encode in protobuf");
        self.audit(request, verb, name, 500);
        let status = Status::failure(500, "InternalError", error.to_string(), None);
        CacheError::Status(Box::new(status), request.audit_id.clone())
    }

    /// Gives an answer and writes its audit line `(verb, name, code)`.
    fn give(
        &self,
        request: &Request<'_>,
        (verb, name, code): (&str, Option<&str>, u16),
        response: Response<Body>,
    ) -> Response<Body> {
        self.audit(request, verb, name, code);
        response
    }

    async fn answer_list(
        &self,
        request: Request<'_>,
        continued: Option<Continued>,
    ) -> Result<Response<Body>, CacheError> {
        self.authorize_collection(&request, "list").await?;
        if let Some(Continued { at, items }) = continued {
            let total_after = if request.filter.selects() {
                None
            } else {
                Some(items.len() as u64)
            };
            let response = self.page(&request, at, items, total_after).await?;
            return Ok(self.give(&request, ("list", None, 200), response));
        }
        let q = &request.info.query;
        let ns = request.info.namespace.as_deref();
        // Listed now: what waited for admission answers with the cache of now.
        let (items, list_rv) = request.store.list(ns, |o| request.filter.matches(o));
        if limit(request.info).is_some() {
            let count = items.len() as u64;
            let total = (!request.filter.selects()).then_some(count);
            let response = self.page(&request, list_rv, items, total).await?;
            return Ok(self.give(&request, ("list", None, 200), response));
        }
        let gzip = wants_gzip(request.headers);
        let key = ListKey {
            resource: request.resource.label.clone(),
            namespace: ns.map(str::to_owned),
            labels: q.label_selector.clone(),
            fields: q.field_selector.clone(),
            rv: list_rv,
            gzip,
            encoding: request.encoding,
        };
        let cached = self
            .lists
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key);
        if let Some(ListAnswer { pieces, gzipped }) = cached {
            let response = self.send(&request, pieces, gzipped);
            return Ok(self.give(&request, ("list", None, 200), response));
        }
        let pieces = respond::list_answer(
            request.store.kind(),
            list_rv,
            None,
            &items,
            request.encoding,
        )
        .map_err(|e| self.unencodable(&e, &request, ("list", None)))?;
        drop(items);
        let (pieces, gzipped) = encode(pieces, gzip).await;
        self.lists.lock().unwrap_or_else(|p| p.into_inner()).put(
            key,
            ListAnswer {
                pieces: pieces.clone(),
                gzipped,
            },
        );
        let response = self.send(&request, pieces, gzipped);
        Ok(self.give(&request, ("list", None, 200), response))
    }

    /// One page of `items` (those after the previous page), `total` of them if known.
    async fn page(
        &self,
        request: &Request<'_>,
        rv: u64,
        items: Vec<Arc<Obj>>,
        total: Option<u64>,
    ) -> Result<Response<Body>, CacheError> {
        let limit = page_limit(request.info);
        let scope = Scope::of(request.info.namespace.as_deref());
        let next = (items.len() > limit).then(|| {
            let last = items[limit - 1].key();
            Continue {
                rv,
                start: format!("{}\0", scope.relative(&last)),
                remaining: total.map(|t| t - limit as u64),
            }
        });
        let page = &items[..items.len().min(limit)];
        let kind = request.store.kind();
        let pieces = respond::list_answer(kind, rv, next.as_ref(), page, request.encoding)
            .map_err(|e| self.unencodable(&e, request, ("list", None)))?;
        Ok(self.respond(request, pieces).await)
    }

    async fn respond(&self, request: &Request<'_>, pieces: Arc<[Bytes]>) -> Response<Body> {
        let (pieces, gzipped) = encode(pieces, wants_gzip(request.headers)).await;
        self.send(request, pieces, gzipped)
    }

    fn send(&self, request: &Request<'_>, pieces: Arc<[Bytes]>, gzipped: bool) -> Response<Body> {
        let mut response = respond::response(
            StatusCode::OK,
            respond::chain_body(pieces),
            &request.audit_id,
            respond::content_type(request.encoding, false),
        );
        if gzipped {
            response.headers_mut().insert(
                http::header::CONTENT_ENCODING,
                HeaderValue::from_static("gzip"),
            );
        }
        response
    }

    async fn answer_watch(
        &self,
        request: Request<'_>,
        (from, planned): (Option<u64>, Option<store::WatchStart>),
        watch_list: bool,
        initial_seats: Option<Held>,
    ) -> Result<Response<Body>, CacheError> {
        let q = &request.info.query;
        let attrs = self.authorize_collection(&request, "watch").await?;
        // A watch from a version subscribed when it was planned; one that starts with the
        // state takes the state of now, after admission.
        let start = match planned {
            Some(start) => start,
            None => request.store.watch_state(),
        };
        // As the apiserver: 0 or none is a random time in [min-request-timeout, 2x) to
        // spread re-watches, a negative value ends the watch at once.
        let timeout = apimachinery::params::watch_timeout(
            q.timeout_seconds,
            apimachinery::params::MIN_REQUEST_TIMEOUT,
        );
        let options = watch::Options {
            filter: request.filter.clone(),
            bookmarks: q
                .allow_watch_bookmarks
                .then_some(self.cfg.bookmark_interval),
            initial_events_end: watch_list,
            timeout,
            from,
            encoding: request.encoding,
        };
        let reauth = watch::Reauthorize {
            access: self.access.clone(),
            user: request.user.clone(),
            attrs,
            every: self.cfg.reauthorize_interval,
        };
        let (body, initial_bytes) = watch::body(
            request.store.clone(),
            start,
            options,
            Some(reauth),
            initial_seats,
            self.metrics.clone(),
        );
        let content_type = respond::content_type(request.encoding, true);
        let mut response = respond::response(StatusCode::OK, body, &request.audit_id, content_type);
        if initial_bytes > 0 {
            response
                .extensions_mut()
                .insert(InitialState(initial_bytes));
        }
        Ok(self.give(&request, ("watch", None, 200), response))
    }
}

/// The objects a LIST page holds at most: its `limit`, or all.
fn page_limit(info: &RequestInfo) -> usize {
    limit(info).map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX))
}

/// The `limit` a cached LIST honours: none at `resourceVersion=0`, where kube-apiserver
/// v1.36 answers the whole list from its watch cache whatever the limit (with a continue
/// token too: the rest of the list), as the differential suite measured.
fn limit(info: &RequestInfo) -> Option<u64> {
    let query = &info.query;
    match query.resource_version.as_deref() {
        Some("0") => None,
        _ => query.limit,
    }
}

/// The bytes of the objects an answer holds: the first `limit` of those `filter` selects in
/// `ns`. A whole scope is as large as the store counts it; only a narrower answer needs a
/// listing to know its size.
fn answer_bytes(store: &Store, filter: &watch::Filter, ns: Option<&str>, limit: usize) -> u64 {
    if !filter.selects() && limit == usize::MAX {
        return store.size(ns).1;
    }
    let (items, _) = store.list(ns, |o| filter.matches(o));
    items.iter().take(limit).map(|o| o.body.len() as u64).sum()
}

/// The bytes of the objects a LIST answers: all of `items`, or the first `limit`.
fn page_bytes(info: &RequestInfo, items: &[Arc<Obj>]) -> u64 {
    let limit = page_limit(info);
    items.iter().take(limit).map(|o| o.body.len() as u64).sum()
}

/// Gzips when asked and large enough.
async fn encode(pieces: Arc<[Bytes]>, gzip: bool) -> (Arc<[Bytes]>, bool) {
    let total: usize = pieces.iter().map(Bytes::len).sum();
    if !gzip || total < respond::GZIP_THRESHOLD {
        return (pieces, false);
    }
    match respond::gzip(pieces.clone()).await {
        Ok(zipped) => (Arc::from([zipped]), true),
        Err(e) => {
            tracing::warn!(error = %e, "gzip failed; answering uncompressed");
            (pieces, false)
        }
    }
}

/// What one answer carries through its steps.
struct Request<'a> {
    resource: &'a CachedResource,
    store: Store,
    info: &'a RequestInfo,
    user: &'a User,
    headers: &'a HeaderMap,
    peer: Option<IpAddr>,
    filter: watch::Filter,
    audit_id: String,
    encoding: Encoding,
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

/// The apiserver's 403 for a denied request.
fn forbidden(user: &User, attrs: &Attributes, reason: &str) -> Status {
    let scope = if attrs.namespace.is_empty() {
        "at the cluster scope".to_owned()
    } else {
        format!("in the namespace \"{}\"", attrs.namespace)
    };
    let mut message = format!(
        "{} is forbidden: User \"{}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
        qualified(&attrs.group, &attrs.resource, &attrs.name),
        user.username,
        attrs.verb,
        attrs.resource,
        attrs.group,
    );
    if !reason.is_empty() {
        message.push_str(": ");
        message.push_str(reason);
    }
    Status::failure(
        403,
        "Forbidden",
        message,
        Some(Details::of(&attrs.name, &attrs.group, &attrs.resource)),
    )
}

fn wants_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            let mut parts = coding.split(';');
            let name = parts.next().unwrap_or_default().trim();
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            name.eq_ignore_ascii_case("gzip") && !refused
        })
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

#[cfg(test)]
mod tests;
