//! Whole LIST answers: a chain of the objects' bytes, encoded once per version, selector,
//! encoding and compression, and reused from an LRU bounded in bytes.

use std::sync::Arc;

use bytes::Bytes;
use http::Response;

use super::answer::{Request, encode, wants_gzip};
use super::pages::{Continued, limit};
use super::respond;
use super::store::Obj;
use super::{Cache, CacheError, Encoding};
use crate::Body;

/// What makes two whole LIST answers the same bytes.
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
pub(super) struct Lists {
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
    /// An empty LRU of at most `limit` bytes.
    pub(super) fn new(limit: u64) -> Lists {
        Lists {
            entries: lru::LruCache::unbounded(),
            bytes: 0,
            limit,
        }
    }

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

impl Cache {
    /// A LIST: authorized, then a page of a continued list, a page of `limit` objects, or
    /// the whole list.
    pub(super) async fn answer_list(
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
        let ns = request.info.namespace.as_deref();
        // Listed now: what waited for admission answers with the cache of now.
        let (items, list_rv) = request.store.list(ns, |o| request.filter.matches(o));
        if limit(request.info).is_some() {
            let count = items.len() as u64;
            let total = (!request.filter.selects()).then_some(count);
            let response = self.page(&request, list_rv, items, total).await?;
            return Ok(self.give(&request, ("list", None, 200), response));
        }
        let response = self.whole_list(&request, items, list_rv).await?;
        Ok(self.give(&request, ("list", None, 200), response))
    }

    /// A whole list of `items` at `rv`, from the LRU when it holds this answer, else
    /// encoded (and gzipped when asked) and kept there.
    async fn whole_list(
        &self,
        request: &Request<'_>,
        items: Vec<Arc<Obj>>,
        rv: u64,
    ) -> Result<Response<Body>, CacheError> {
        let q = &request.info.query;
        let ns = request.info.namespace.as_deref();
        let gzip = wants_gzip(request.headers);
        let key = ListKey {
            resource: request.resource.label.clone(),
            namespace: ns.map(str::to_owned),
            labels: q.label_selector.clone(),
            fields: q.field_selector.clone(),
            rv,
            gzip,
            encoding: request.encoding,
        };
        let cached = self
            .lists
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key);
        if let Some(ListAnswer { pieces, gzipped }) = cached {
            return Ok(self.send(request, pieces, gzipped));
        }
        let pieces = respond::list_answer(request.store.kind(), rv, None, &items, request.encoding)
            .map_err(|e| self.unencodable(&e, request, ("list", None)))?;
        drop(items);
        let (pieces, gzipped) = encode(pieces, gzip).await;
        self.lists.lock().unwrap_or_else(|p| p.into_inner()).put(
            key,
            ListAnswer {
                pieces: pieces.clone(),
                gzipped,
            },
        );
        Ok(self.send(request, pieces, gzipped))
    }
}
