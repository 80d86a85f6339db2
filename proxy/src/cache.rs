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

pub mod audit;
pub mod authz;
mod informer;
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
use crate::admit::{Admission, Permit};
use crate::classify::{RequestInfo, Verb};
use crate::config::{self, GroupResource};
use crate::identity::User;
use crate::identity::forward::OwnToken;
use crate::metrics::Metrics;
use crate::rules::Matched;
use crate::status::{Reason, Refusal};
use crate::upstream::Upstream;

pub use audit::AuditLog;
pub use authz::{AccessCache, AccessReviewer, Attributes, Decision, UpstreamAccessReviewer};
pub use respond::Status;

use apimachinery::continue_token::{self, Scope};
use apimachinery::selector as select;
use respond::{Continue, Details};
use select::{FieldSelector, LabelSelector};
use store::{Obj, ResourceStore};

/// Why the cache refused a request it would otherwise answer.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// An answer in the apiserver's own words (403 Forbidden), with the request's
    /// `Audit-Id`, which its audit line names too.
    #[error("{}", .0.message)]
    Status(Box<Status>, String),
    /// No SubjectAccessReview could be made: the request gets an error, never data.
    #[error("the access review for a cached read could not be made")]
    ReviewFailed(#[source] Arc<crate::identity::review::ReviewError>),
    /// The reader's admission ([`Gate`]) refused the answer: 429 like any refusal.
    #[error("{}", .0.message)]
    Refused(Refusal),
}

impl CacheError {
    /// The reason label for metrics and `X-Bulwark-Reason`.
    pub fn reason(&self) -> Reason {
        match self {
            CacheError::Status(status, _) if status.code == 403 => Reason::Forbidden,
            CacheError::Status(status, _) if status.code == 504 => Reason::UpstreamTimeout,
            CacheError::Status(..) => Reason::BadRequest,
            CacheError::ReviewFailed(_) => Reason::UpstreamError,
            CacheError::Refused(refusal) => refusal.reason,
        }
    }

    /// The response: the `Status` as the apiserver writes it, or 502 with `Retry-After`
    /// when no review could be made.
    pub fn into_response(self) -> Response<Body> {
        let reason = self.reason();
        let mut response = match self {
            CacheError::Status(status, audit_id) => (*status).into_response(&audit_id),
            // Why goes to the log (Rescue's rejection line), not to the client.
            CacheError::ReviewFailed(_) => crate::status::Refusal::new(
                Reason::UpstreamError,
                "the access review could not be made",
            )
            .retry_after(Duration::from_secs(1))
            .into_response(),
            CacheError::Refused(refusal) => refusal.into_response(),
        };
        response.headers_mut().insert(
            "x-bulwark-reason",
            HeaderValue::from_static(reason.as_str()),
        );
        response
            .extensions_mut()
            .insert(crate::metrics::ServedBy::Cache);
        response
    }
}

/// What a cache answer passes once it is authorized and before any of it is given or
/// audited: the reader's admission (DESIGN.md step 6 comes before step 7) — its flow's
/// watch limit and seats in its level's fair queue, sized by the answer's bytes. Without a
/// gate every answer is given at once.
#[derive(Clone, Copy)]
pub struct Gate<'a> {
    /// The admission controller.
    pub admission: &'a Arc<Admission>,
    /// The reader's rule, level and flow.
    pub matched: &'a Matched,
}

/// One configured resource: its store appears once discovery has found its kind.
struct Slot {
    gr: GroupResource,
    label: String,
    store: Arc<OnceLock<Arc<ResourceStore>>>,
}

impl Slot {
    fn store(&self) -> Option<&Arc<ResourceStore>> {
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
}

/// The LRU of encoded LIST responses, bounded in bytes.
struct Lists {
    entries: lru::LruCache<ListKey, Arc<[Bytes]>>,
    bytes: u64,
    limit: u64,
}

impl Lists {
    fn get(&mut self, key: &ListKey) -> Option<Arc<[Bytes]>> {
        self.entries.get(key).cloned()
    }

    fn put(&mut self, key: ListKey, pieces: Arc<[Bytes]>) {
        let size = cost(&pieces);
        if size > self.limit / 4 {
            // One response may not take most of the budget.
            return;
        }
        if let Some(old) = self.entries.put(key, pieces) {
            self.bytes -= cost(&old);
        }
        self.bytes += size;
        while self.bytes > self.limit {
            match self.entries.pop_lru() {
                Some((_, old)) => self.bytes -= cost(&old),
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
    slots: Vec<Slot>,
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

/// What [`Cache::serve`] decided before answering.
enum Outcome {
    Hit(Response<Body>),
    Miss(&'static str),
    Bypass(&'static str),
}

/// How fresh an answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// Any state the cache has (`resourceVersion=0`).
    Any,
    /// At least this version (`NotOlderThan`).
    AtLeast(u64),
    /// The apiserver's current state (no resourceVersion).
    Consistent,
}

impl Cache {
    /// Starts one informer per configured resource (Bulwark's own identity).
    pub fn start(
        cfg: &config::Cache,
        upstream: Upstream,
        own_token: Option<Arc<OwnToken>>,
        metrics: Metrics,
        audit: Option<AuditLog>,
    ) -> Arc<Cache> {
        let reviewer = Arc::new(UpstreamAccessReviewer::new(upstream.clone(), own_token));
        let cache = Cache::build(cfg, reviewer, metrics, audit);
        if cfg.enabled {
            let mut tasks = Vec::new();
            for slot in &cache.slots {
                let (ring, buffer) = (cfg.ring_size, cfg.watcher_buffer);
                let relists = cache
                    .metrics
                    .cache_relists_total
                    .with_label_values(&[&slot.label]);
                tasks.push(tokio::spawn(informer::run(
                    upstream.clone(),
                    slot.gr.clone(),
                    slot.store.clone(),
                    move |kind| {
                        Arc::new(ResourceStore::new(kind, ring, buffer).counting_relists(relists))
                    },
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
        let slots = if cfg.enabled {
            cfg.group_resources()
                .into_iter()
                .map(|gr| Slot {
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
            slots,
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
                .slots
                .iter()
                .all(|s| s.store().is_some_and(|st| st.synced()))
    }

    /// Object count and total bytes of a resource (`secrets`, or `resource.group`) in a
    /// namespace or the whole cluster, for admission's cost estimate; `None` when the
    /// resource is not cached or not synced yet.
    pub fn scope_size(&self, resource: &str, namespace: Option<&str>) -> Option<(u64, u64)> {
        let slot = self
            .slots
            .iter()
            .find(|s| s.label == resource || s.gr.resource == resource)?;
        let store = slot.store()?;
        store.synced().then(|| store.size(namespace))
    }

    /// Event encodings made so far, all resources together: with N watchers of one event it
    /// grows by one, not N.
    pub fn event_encodings(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(Slot::store)
            .map(|s| s.encodings.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// [`Cache::serve_from`] a client whose address is not known (its audit lines name
    /// only the addresses its headers give).
    pub async fn serve(
        &self,
        info: &RequestInfo,
        user: &User,
        headers: &HeaderMap,
        staleness: Option<Duration>,
        gate: Option<Gate<'_>>,
    ) -> Result<Option<Response<Body>>, CacheError> {
        self.serve_from(info, user, headers, None, staleness, gate)
            .await
    }

    /// Serves the request from the cache when it may (cacheable, fresh enough, authorized);
    /// `Ok(None)` means "go upstream" (bypass or miss); `Err` is a refusal (403 as a
    /// `Status`; a review that cannot be made is an error, never data). `peer` is the
    /// client's address, for the audit log's `sourceIPs`.
    pub async fn serve_from(
        &self,
        info: &RequestInfo,
        user: &User,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
        staleness: Option<Duration>,
        gate: Option<Gate<'_>>,
    ) -> Result<Option<Response<Body>>, CacheError> {
        let Some(slot) = self.slot_for(info) else {
            return Ok(None);
        };
        let verb = info.verb.to_string();
        let reader = Reader {
            user,
            headers,
            peer,
        };
        let result = self.answer(slot, info, reader, staleness, gate).await;
        let label = match &result {
            Ok(Outcome::Hit(_)) | Err(_) => "hit",
            Ok(Outcome::Miss(why)) => {
                tracing::debug!(resource = %slot.label, why, "cache miss");
                "miss"
            }
            Ok(Outcome::Bypass(why)) => {
                tracing::debug!(resource = %slot.label, why, "cache bypass");
                "bypass"
            }
        };
        self.metrics
            .cache_requests_total
            .with_label_values(&[&slot.label, &verb, label])
            .inc();
        match result? {
            Outcome::Hit(response) => Ok(Some(response)),
            Outcome::Miss(_) | Outcome::Bypass(_) => Ok(None),
        }
    }

    fn slot_for(&self, info: &RequestInfo) -> Option<&Slot> {
        if !info.resource_request {
            return None;
        }
        self.slots
            .iter()
            .find(|s| s.gr.group == info.api_group && s.gr.resource == info.resource)
    }

    async fn answer(
        &self,
        slot: &Slot,
        info: &RequestInfo,
        Reader {
            user,
            headers,
            peer,
        }: Reader<'_>,
        staleness: Option<Duration>,
        gate: Option<Gate<'_>>,
    ) -> Result<Outcome, CacheError> {
        if let Some(why) = self.bypass(info, headers) {
            return Ok(Outcome::Bypass(why));
        }
        let Some(store) = slot.store().filter(|s| s.synced()).cloned() else {
            return Ok(Outcome::Miss("not synced"));
        };
        if info.api_version != store.kind.version {
            return Ok(Outcome::Bypass("another API version"));
        }
        if !store.kind.namespaced && info.namespace.is_some() {
            // The apiserver answers 404 for a namespaced path to a cluster-scoped resource.
            return Ok(Outcome::Bypass("a namespace on a cluster-scoped resource"));
        }
        let q = &info.query;
        let filter = match (
            LabelSelector::parse(q.label_selector.as_deref().unwrap_or_default()),
            FieldSelector::parse(q.field_selector.as_deref().unwrap_or_default()),
        ) {
            (Ok(labels), Ok(fields)) => watch::Filter {
                namespace: info.namespace.clone(),
                labels,
                fields,
            },
            _ => return Ok(Outcome::Bypass("a selector the cache does not answer")),
        };
        if let Some(why) = self.excluded(info, &filter) {
            return Ok(Outcome::Bypass(why));
        }
        let rv = match q.resource_version.as_deref().map(str::parse::<u64>) {
            None => None,
            Some(Ok(rv)) => Some(rv),
            Some(Err(_)) => return Ok(Outcome::Bypass("a resourceVersion that is not a number")),
        };
        let audit_id = headers
            .get("audit-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map_or_else(audit::new_audit_id, str::to_owned);
        let request = Request {
            slot,
            store,
            info,
            user,
            headers,
            peer,
            filter,
            audit_id,
            gate,
        };
        match info.verb {
            Verb::Get => self.get(request, rv, staleness).await,
            Verb::List => self.list(request, rv, staleness).await,
            Verb::Watch => self.watch(request, rv, staleness).await,
            _ => Ok(Outcome::Bypass("not a read")),
        }
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
        if !accepts_plain_json(headers) {
            return Some("Accept asks for another form");
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

    /// Whether the store is fresh enough for `need` now; the cache never waits for it.
    fn fresh(&self, request: &Request<'_>, need: Need, staleness: Option<Duration>) -> bool {
        let store = &request.store;
        match need {
            Need::Any => true,
            Need::AtLeast(rv) => store.rv() >= rv,
            Need::Consistent => staleness
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
        let kind = &request.store.kind;
        let attrs = Attributes {
            verb: verb.to_owned(),
            group: kind.group.clone(),
            version: kind.version.clone(),
            resource: kind.resource.clone(),
            namespace: request.info.namespace.clone().unwrap_or_default(),
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
        let (Some(log), kind) = (&self.audit, &request.store.kind) else {
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

    async fn get(
        &self,
        request: Request<'_>,
        rv: Option<u64>,
        staleness: Option<Duration>,
    ) -> Result<Outcome, CacheError> {
        let q = &request.info.query;
        if q.resource_version_match.is_some() {
            return Ok(Outcome::Bypass("resourceVersionMatch on a get"));
        }
        let Some(name) = request.info.name.clone() else {
            return Ok(Outcome::Bypass("a get without a name"));
        };
        let need = match rv {
            // Only an identity that accepts staleness gets a consistent GET from the cache.
            None if staleness.is_none() => {
                return Ok(Outcome::Bypass("a consistent get (one key read upstream)"));
            }
            None => Need::Consistent,
            Some(0) => Need::Any,
            Some(n) => Need::AtLeast(n),
        };
        if !self.fresh(&request, need, staleness) {
            return Ok(Outcome::Miss("not fresh enough"));
        }
        self.authorize(&request, "get", &name).await?;
        let permit = self.admit(&request, 0).await?;
        let kind = &request.store.kind;
        let namespace = request.info.namespace.as_deref().unwrap_or_default();
        let (obj, _) = request.store.get(namespace, &name);
        let Some(obj) = obj else {
            let status = Status::failure(
                404,
                "NotFound",
                format!(
                    "{} not found",
                    respond::qualified(&kind.group, &kind.resource, &name)
                ),
                Some(Details {
                    name: name.clone(),
                    group: kind.group.clone(),
                    kind: kind.resource.clone(),
                    ..Details::default()
                }),
            );
            let response = status.into_response(&request.audit_id);
            return Ok(self.give(&request, ("get", Some(&name), 404), response, permit));
        };
        let pieces = respond::object_pieces(kind, &obj);
        let response = self.respond(&request, pieces).await;
        Ok(self.give(&request, ("get", Some(&name), 200), response, permit))
    }

    /// The reader's admission ([`Gate`]) for an answer of about `bytes`, once it is
    /// authorized and before it is built, so that an answer that waited for its seats is
    /// built from the cache as it is when they are granted. The seats are held until the
    /// answer's body ends (a watch takes them out, see [`Cache::watch`]).
    async fn admit(&self, request: &Request<'_>, bytes: u64) -> Result<Option<Permit>, CacheError> {
        let Some(gate) = request.gate else {
            return Ok(None);
        };
        let permit = gate
            .admission
            .admit_cached(gate.matched, request.user, request.info, bytes)
            .await
            .map_err(CacheError::Refused)?;
        Ok(Some(permit))
    }

    /// The bytes of the objects a watch that starts with the current state sends first.
    fn initial_bytes(&self, request: &Request<'_>) -> u64 {
        let ns = request.info.namespace.as_deref();
        if request.filter.selects() {
            let (items, _) = request.store.list(ns, |o| request.filter.matches(o));
            items.iter().map(|o| o.body.len() as u64).sum()
        } else {
            request.store.size(ns).1
        }
    }

    /// Gives an admitted answer, holding its `permit`, and writes its audit line `(verb,
    /// name, code)`. A refused answer is neither built, given nor audited.
    fn give(
        &self,
        request: &Request<'_>,
        (verb, name, code): (&str, Option<&str>, u16),
        response: Response<Body>,
        permit: Option<Permit>,
    ) -> Outcome {
        let response = match permit {
            Some(permit) => response.map(|body| crate::admit::hold(body, permit, None)),
            None => response,
        };
        self.audit(request, verb, name, code);
        Outcome::Hit(response)
    }

    async fn list(
        &self,
        request: Request<'_>,
        rv: Option<u64>,
        staleness: Option<Duration>,
    ) -> Result<Outcome, CacheError> {
        let q = &request.info.query;
        let ns = request.info.namespace.as_deref();
        if let Some(token) = &q.continue_token {
            // The apiserver continues with `resourceVersion=0` as without one, and refuses
            // any other version (400) or a resourceVersionMatch (422): it writes those.
            if rv.is_some_and(|rv| rv != 0) || q.resource_version_match.is_some() {
                return Ok(Outcome::Bypass("continue with a resourceVersion"));
            }
            // A token the apiserver refuses goes to it rather than being refused here: its
            // 400 quotes Go's JSON errors, which the cache cannot word byte for byte, and
            // it answers only after its own authorization (403 before 400).
            let Ok(resume) = continue_token::decode(token) else {
                return Ok(Outcome::Bypass("a continue token the apiserver refuses"));
            };
            let from = Scope::of(ns).resume_key(&resume.start);
            let (all, at) = match resume.at() {
                Some(at) => {
                    if request.store.rv() < at {
                        return Ok(Outcome::Miss("a continue newer than the cache"));
                    }
                    match request.store.list_from(ns, Some(at), &from) {
                        Some(listed) => listed,
                        None => return Ok(Outcome::Miss("a continue older than the ring")),
                    }
                }
                // A negative version: the token the apiserver hands out with its 410 for a
                // continue it compacted away. The rest of the list at the latest version, a
                // consistent read, as the apiserver's watch cache serves it.
                None => {
                    if !self.fresh(&request, Need::Consistent, staleness) {
                        return Ok(Outcome::Miss("not fresh enough"));
                    }
                    match request.store.list_from(ns, None, &from) {
                        Some(listed) => listed,
                        None => return Ok(Outcome::Miss("a continue the cache cannot list")),
                    }
                }
            };
            self.authorize_collection(&request, "list").await?;
            let items: Vec<Arc<Obj>> = all
                .into_iter()
                .filter(|o| request.filter.matches(o))
                .collect();
            let total_after = if request.filter.selects() {
                None
            } else {
                Some(items.len() as u64)
            };
            let permit = self.admit(&request, page_bytes(&request, &items)).await?;
            let response = self.page(&request, at, items, total_after).await;
            return Ok(self.give(&request, ("list", None, 200), response, permit));
        }
        let need = match (rv, q.resource_version_match.as_deref()) {
            (None, None) => Need::Consistent,
            (None, Some(_)) => {
                return Ok(Outcome::Bypass(
                    "resourceVersionMatch without resourceVersion",
                ));
            }
            (Some(_), Some("Exact")) => return Ok(Outcome::Bypass("an exact list")),
            (Some(0), Some("NotOlderThan") | None) => Need::Any,
            (Some(n), Some("NotOlderThan")) => Need::AtLeast(n),
            (Some(_), None) if q.limit.is_some() => return Ok(Outcome::Bypass("an exact list")),
            (Some(n), None) => Need::AtLeast(n),
            (Some(_), Some(_)) => return Ok(Outcome::Bypass("an unknown resourceVersionMatch")),
        };
        if !self.fresh(&request, need, staleness) {
            return Ok(Outcome::Miss("not fresh enough"));
        }
        self.authorize_collection(&request, "list").await?;
        let select = |o: &Obj| request.filter.matches(o);
        let permit = match request.gate {
            // A whole scope is as large as the store counts it; only a narrower answer
            // needs a listing to know its size.
            Some(_) if !request.filter.selects() && limit(&request).is_none() => {
                let (_, bytes) = request.store.size(ns);
                self.admit(&request, bytes).await?
            }
            Some(_) => {
                let (items, _) = request.store.list(ns, select);
                let bytes = page_bytes(&request, &items);
                drop(items);
                self.admit(&request, bytes).await?
            }
            None => None,
        };
        // Listed after admission: what waited for seats answers with the cache of now.
        let (items, list_rv) = request.store.list(ns, select);
        if limit(&request).is_some() {
            let count = items.len() as u64;
            let total = (!request.filter.selects()).then_some(count);
            let response = self.page(&request, list_rv, items, total).await;
            return Ok(self.give(&request, ("list", None, 200), response, permit));
        }
        let gzip = wants_gzip(request.headers);
        let key = ListKey {
            resource: request.slot.label.clone(),
            namespace: ns.map(str::to_owned),
            labels: q.label_selector.clone(),
            fields: q.field_selector.clone(),
            rv: list_rv,
            gzip,
        };
        let cached = self
            .lists
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key);
        if let Some(pieces) = cached {
            let response = self.send(&request, pieces, gzip);
            return Ok(self.give(&request, ("list", None, 200), response, permit));
        }
        let pieces = respond::list_pieces(&request.store.kind, list_rv, None, &items);
        drop(items);
        let (pieces, gzipped) = encode(pieces, gzip).await;
        self.lists
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(key, pieces.clone());
        let response = self.send(&request, pieces, gzipped);
        Ok(self.give(&request, ("list", None, 200), response, permit))
    }

    /// One page of `items` (those after the previous page), `total` of them if known.
    async fn page(
        &self,
        request: &Request<'_>,
        rv: u64,
        items: Vec<Arc<Obj>>,
        total: Option<u64>,
    ) -> Response<Body> {
        let limit = page_limit(request);
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
        let pieces = respond::list_pieces(&request.store.kind, rv, next.as_ref(), page);
        self.respond(request, pieces).await
    }

    async fn respond(&self, request: &Request<'_>, pieces: Arc<[Bytes]>) -> Response<Body> {
        let (pieces, gzipped) = encode(pieces, wants_gzip(request.headers)).await;
        self.send(request, pieces, gzipped)
    }

    fn send(&self, request: &Request<'_>, pieces: Arc<[Bytes]>, gzipped: bool) -> Response<Body> {
        let mut response = respond::json_response(
            StatusCode::OK,
            respond::chain_body(pieces),
            &request.audit_id,
        );
        if gzipped {
            response.headers_mut().insert(
                http::header::CONTENT_ENCODING,
                HeaderValue::from_static("gzip"),
            );
        }
        response
    }

    async fn watch(
        &self,
        request: Request<'_>,
        rv: Option<u64>,
        staleness: Option<Duration>,
    ) -> Result<Outcome, CacheError> {
        let q = &request.info.query;
        let watch_list = match q.send_initial_events {
            None => false,
            Some(true)
                if q.resource_version_match.as_deref() == Some("NotOlderThan")
                    && q.allow_watch_bookmarks =>
            {
                true
            }
            Some(_) => {
                return Ok(Outcome::Bypass(
                    "sendInitialEvents the cache does not answer",
                ));
            }
        };
        if !watch_list && q.resource_version_match.is_some() {
            return Ok(Outcome::Bypass("resourceVersionMatch on a watch"));
        }
        // `from`: the version to stream events after; `None` starts with the state.
        let (need, from) = match (rv, watch_list) {
            (None, _) => (Need::Consistent, None),
            (Some(0), _) => (Need::Any, None),
            (Some(n), true) => (Need::AtLeast(n), None),
            (Some(n), false) => (Need::AtLeast(n), Some(n)),
        };
        if !self.fresh(&request, need, staleness) {
            return Ok(Outcome::Miss("not fresh enough"));
        }
        let attrs = self.authorize_collection(&request, "watch").await?;
        // A watch that starts with the current state sends a LIST's worth of objects
        // first: it waits for seats like a LIST of that size and holds them until the
        // initial state is sent. A watch from a version takes none.
        let initial_bytes = match from {
            None => self.initial_bytes(&request),
            Some(_) => 0,
        };
        let mut permit = self.admit(&request, initial_bytes).await?;
        let initial_seats = permit.as_mut().and_then(Permit::take_seats);
        let start = match request.store.watch(from) {
            Ok(start) => start,
            Err(expired) => {
                let status = Status::failure(
                    410,
                    "Expired",
                    format!(
                        "too old resource version: {} ({})",
                        from.unwrap_or_default(),
                        expired.oldest
                    ),
                    None,
                );
                let response = respond::json_response(
                    StatusCode::OK,
                    crate::full(status.error_line()),
                    &request.audit_id,
                );
                return Ok(self.give(&request, ("watch", None, 200), response, permit));
            }
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
        };
        let reauth = watch::Reauthorize {
            access: self.access.clone(),
            user: request.user.clone(),
            attrs,
            every: self.cfg.reauthorize_interval,
        };
        let body = watch::body(
            request.store.clone(),
            start,
            options,
            Some(reauth),
            initial_seats,
            self.metrics.clone(),
        );
        let response = respond::json_response(StatusCode::OK, body, &request.audit_id);
        Ok(self.give(&request, ("watch", None, 200), response, permit))
    }
}

/// The objects a LIST page holds at most: its `limit`, or all.
fn page_limit(request: &Request<'_>) -> usize {
    limit(request).map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX))
}

/// The `limit` a cached LIST honours: none at `resourceVersion=0`, where kube-apiserver
/// v1.36 answers the whole list from its watch cache whatever the limit (with a continue
/// token too: the rest of the list), as the differential suite measured.
fn limit(request: &Request<'_>) -> Option<u64> {
    let query = &request.info.query;
    match query.resource_version.as_deref() {
        Some("0") => None,
        _ => query.limit,
    }
}

/// The bytes of the objects a LIST answers: all of `items`, or the first `limit`.
fn page_bytes(request: &Request<'_>, items: &[Arc<Obj>]) -> u64 {
    let limit = page_limit(request);
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

/// What one cacheable request carries through the steps.
struct Request<'a> {
    slot: &'a Slot,
    store: Arc<ResourceStore>,
    info: &'a RequestInfo,
    user: &'a User,
    headers: &'a HeaderMap,
    peer: Option<IpAddr>,
    filter: watch::Filter,
    audit_id: String,
    gate: Option<Gate<'a>>,
}

/// Who asks: the user, the request's headers and the client's address.
struct Reader<'a> {
    user: &'a User,
    headers: &'a HeaderMap,
    peer: Option<IpAddr>,
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
        respond::qualified(&attrs.group, &attrs.resource, &attrs.name),
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
        Some(Details {
            name: attrs.name.clone(),
            group: attrs.group.clone(),
            kind: attrs.resource.clone(),
            ..Details::default()
        }),
    )
}

/// Whether the client takes plain JSON: no `as=` (Table, PartialObjectMetadata) and some
/// range that JSON satisfies. No `Accept` at all takes JSON.
fn accepts_plain_json(headers: &HeaderMap) -> bool {
    let mut any = false;
    let mut json = false;
    for value in headers.get_all(http::header::ACCEPT) {
        let Ok(value) = value.to_str() else {
            return false;
        };
        for range in value.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            if media.is_empty() {
                continue;
            }
            any = true;
            if parts.any(|p| p.trim().to_ascii_lowercase().starts_with("as=")) {
                return false;
            }
            json |= matches!(media.as_str(), "application/json" | "application/*" | "*/*");
        }
    }
    !any || json
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
        for slot in &cache.slots {
            let Some(store) = slot.store() else { continue };
            let (count, bytes) = store.size(None);
            let labels = [slot.label.as_str()];
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
