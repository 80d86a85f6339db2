//! Can the cache answer this? The decision ([`Cache::plan`]), made from what the cache
//! holds now and without I/O: a bypass (not something the cache answers), a miss (not now:
//! not synced, not fresh enough, out of its ring) or a [`Plan`] of the answer, with the
//! bytes of objects it holds for admission to weigh.

use std::time::Duration;

use http::HeaderMap;

use super::pages::{Continued, page_limit};
use super::select::{FieldSelector, LabelSelector};
use super::store::{self, Store};
use super::{Cache, CachedResource, Encoding, accept, watch};
use crate::classify::{RequestInfo, Verb};

/// Why the cache leaves a request to the apiservers.
pub(super) enum GoUpstream {
    /// Not something the cache answers, whatever it holds.
    Bypass(&'static str),
    /// Something it answers, but not now (not synced, not fresh enough, out of its ring).
    Miss(&'static str),
}

/// How fresh an answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Freshness {
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
    pub(super) resource: usize,
    pub(super) store: Store,
    pub(super) filter: watch::Filter,
    pub(super) what: Planned,
    pub(super) bytes: u64,
    pub(super) encoding: Encoding,
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

pub(super) enum Planned {
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

impl Cache {
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
        let filter = filter_of(info)?;
        if let Some(why) = self.excluded(info, &filter) {
            return Err(GoUpstream::Bypass(why));
        }
        let rv = resource_version(info)?;
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
            namespace.is_none_or(|ns| entry.namespace.as_deref().is_none_or(|ens| ns == ens))
                && name.is_none_or(|n| n == entry.name)
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
            return self.plan_continue(store, filter, info, (rv, token), staleness);
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
            Some(n) => match store.watch_after(n, filter.fields.pinned_name()) {
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
    pub(super) fn fresh(
        &self,
        store: &Store,
        freshness: Freshness,
        staleness: Option<Duration>,
    ) -> bool {
        match freshness {
            Freshness::Any => true,
            Freshness::AtLeast(rv) => store.rv() >= rv,
            Freshness::Consistent => staleness
                .map(|s| s.min(self.cfg.max_staleness))
                .is_some_and(|bound| store.lag() <= bound),
        }
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

/// The objects a request selects: its namespace and selectors, when the cache answers them.
fn filter_of(info: &RequestInfo) -> Result<watch::Filter, GoUpstream> {
    let q = &info.query;
    match (
        LabelSelector::parse(q.label_selector.as_deref().unwrap_or_default()),
        FieldSelector::parse(q.field_selector.as_deref().unwrap_or_default()),
    ) {
        (Ok(labels), Ok(fields)) => Ok(watch::Filter {
            namespace: info.namespace.as_deref().map(str::to_owned),
            labels,
            fields,
        }),
        _ => Err(GoUpstream::Bypass("a selector the cache does not answer")),
    }
}

/// The request's `resourceVersion`, when it is a number the cache can compare.
fn resource_version(info: &RequestInfo) -> Result<Option<u64>, GoUpstream> {
    match info
        .query
        .resource_version
        .as_deref()
        .map(str::parse::<u64>)
    {
        None => Ok(None),
        Some(Ok(rv)) => Ok(Some(rv)),
        Some(Err(_)) => Err(GoUpstream::Bypass("a resourceVersion that is not a number")),
    }
}
