//! Pagination: `limit` on a cached LIST, pages that end with the apiserver's own continue
//! token (see [`apimachinery::continue_token`]), and the rest of a list continued from one
//! while its version is within the ring.

use std::sync::Arc;
use std::time::Duration;

use http::Response;

use apimachinery::continue_token::{self, Scope};

use super::answer::Request;
use super::plan::{Freshness, GoUpstream, Planned};
use super::respond::{self, Continue};
use super::store::{Obj, Store};
use super::{Cache, CacheError, watch};
use crate::Body;
use crate::classify::RequestInfo;

/// The rest of a paginated list, at the version its continue token names.
pub(super) struct Continued {
    pub(super) at: u64,
    pub(super) items: Vec<Arc<Obj>>,
}

impl Cache {
    /// [`Cache::plan`] for a LIST with a continue token: the rest of the list at the
    /// token's version (rolled back through the ring), or upstream.
    pub(super) fn plan_continue(
        &self,
        store: &Store,
        filter: &watch::Filter,
        info: &RequestInfo,
        (rv, token): (Option<u64>, &str),
        staleness: Option<Duration>,
    ) -> Result<(Planned, u64), GoUpstream> {
        let q = &info.query;
        let ns = info.namespace.as_deref();
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
        Ok((
            Planned::List {
                continued: Some(continued),
            },
            bytes,
        ))
    }

    /// One page of `items` (those after the previous page), `total` of them if known.
    pub(super) async fn page(
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
}

/// The objects a LIST page holds at most: its `limit`, or all.
pub(super) fn page_limit(info: &RequestInfo) -> usize {
    limit(info).map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX))
}

/// The `limit` a cached LIST honours: none at `resourceVersion=0`, where kube-apiserver
/// v1.36 answers the whole list from its watch cache whatever the limit (with a continue
/// token too: the rest of the list), as the differential suite measured.
pub(super) fn limit(info: &RequestInfo) -> Option<u64> {
    let query = &info.query;
    match query.resource_version.as_deref() {
        Some("0") => None,
        _ => query.limit,
    }
}

/// The bytes of the objects a LIST answers: all of `items`, or the first `limit`.
fn page_bytes(info: &RequestInfo, items: &[Arc<Obj>]) -> u64 {
    let limit = page_limit(info);
    items.iter().take(limit).map(|o| o.body.len() as u64).sum()
}
