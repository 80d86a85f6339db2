//! One upstream informer per cached resource, with Bulwark's own identity: discovery of the
//! resource's kind, a paginated LIST, then a WATCH with bookmarks from the list's version;
//! a re-watch from the last version when the stream ends, a relist on 410, backoff on
//! errors. Events at or below the cache's version are duplicates of a re-watch and dropped,
//! so none is missed, doubled or reordered.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::store::{EventType, Kind, Obj, ResourceStore};
use crate::config::GroupResource;
use crate::metrics::Metrics;
use crate::upstream::{Credential, RetryPolicy, Route, Upstream};

/// Items per LIST page.
const PAGE: u64 = 500;
/// Largest LIST page or discovery document read.
const MAX_PAGE_BYTES: usize = 512 * 1024 * 1024;
/// Time allowed for a LIST page.
const LIST_TIMEOUT: Duration = Duration::from_secs(120);
/// Backoff between failed attempts: from the first to the last, doubling.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(30));
/// Longest line of a watch stream (one object) read.
const MAX_LINE: usize = 64 * 1024 * 1024;

/// Why an informer step failed.
#[derive(Debug, thiserror::Error)]
pub enum InformerError {
    /// The apiserver could not be reached or answered badly.
    #[error("{0}")]
    Upstream(String),
    /// The stored history is gone: relist.
    #[error("resource version expired")]
    Expired,
}

/// The path of the collection, e.g. `/api/v1/secrets`.
pub fn collection_path(kind: &Kind) -> String {
    if kind.group.is_empty() {
        format!("/api/{}/{}", kind.version, kind.resource)
    } else {
        format!("/apis/{}/{}/{}", kind.group, kind.version, kind.resource)
    }
}

/// A GET with Bulwark's own identity.
async fn get(
    upstream: &Upstream,
    path: &str,
    long_running: bool,
) -> Result<http::Response<crate::Body>, InformerError> {
    let request = http::Request::get(path)
        .header(http::header::ACCEPT, "application/json")
        .body(crate::empty())
        .map_err(|e| InformerError::Upstream(e.to_string()))?;
    let route = Route {
        credential: Credential::Own,
        retry: RetryPolicy::Read,
        long_running,
        watch: long_running,
        timeout: (!long_running).then_some(LIST_TIMEOUT),
    };
    upstream
        .send(request, route)
        .await
        .map_err(|e| InformerError::Upstream(format!("{path}: {e}")))
}

/// A whole JSON answer; a non-2xx is an error (410 is [`InformerError::Expired`]).
async fn get_json(upstream: &Upstream, path: &str) -> Result<bytes::Bytes, InformerError> {
    let response = get(upstream, path, false).await?;
    let status = response.status();
    let body = crate::read_to_limit(response.into_body(), MAX_PAGE_BYTES)
        .await
        .map_err(|e| InformerError::Upstream(format!("{path}: {e}")))?;
    if status == http::StatusCode::GONE {
        return Err(InformerError::Expired);
    }
    if !status.is_success() {
        return Err(InformerError::Upstream(format!(
            "{path} answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)])
        )));
    }
    Ok(body)
}

/// Finds the preferred version, kind and scope of a configured resource.
pub async fn discover(upstream: &Upstream, gr: &GroupResource) -> Result<Kind, InformerError> {
    let bad = |what: String| InformerError::Upstream(format!("discovery of {gr}: {what}"));
    let version = if gr.group.is_empty() {
        "v1".to_owned()
    } else {
        let group: serde_json::Value =
            serde_json::from_slice(&get_json(upstream, &format!("/apis/{}", gr.group)).await?)
                .map_err(|e| bad(e.to_string()))?;
        group["preferredVersion"]["version"]
            .as_str()
            .ok_or_else(|| bad("no preferredVersion".into()))?
            .to_owned()
    };
    let path = if gr.group.is_empty() {
        "/api/v1".to_owned()
    } else {
        format!("/apis/{}/{version}", gr.group)
    };
    let list: serde_json::Value = serde_json::from_slice(&get_json(upstream, &path).await?)
        .map_err(|e| bad(e.to_string()))?;
    let resource = list["resources"]
        .as_array()
        .and_then(|all| all.iter().find(|r| r["name"] == gr.resource.as_str()))
        .ok_or_else(|| bad(format!("{path} does not list {}", gr.resource)))?;
    let verbs: Vec<&str> = resource["verbs"]
        .as_array()
        .map(|v| v.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    if !verbs.contains(&"list") || !verbs.contains(&"watch") {
        return Err(bad("the resource does not support list and watch".into()));
    }
    let kind = resource["kind"]
        .as_str()
        .ok_or_else(|| bad("no kind".into()))?;
    let namespaced = resource["namespaced"].as_bool().unwrap_or(false);
    Ok(Kind::new(
        &gr.group,
        &version,
        &gr.resource,
        kind,
        namespaced,
    ))
}

#[derive(Deserialize)]
struct ListPage<'a> {
    #[serde(default)]
    metadata: ListMeta,
    #[serde(borrow, default)]
    items: Vec<&'a RawValue>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    #[serde(default)]
    resource_version: String,
    #[serde(default, rename = "continue")]
    continue_token: Option<String>,
}

/// Lists every object, page by page, and returns them with the list's version.
pub async fn list_all(upstream: &Upstream, kind: &Kind) -> Result<(Vec<Obj>, u64), InformerError> {
    let base = collection_path(kind);
    let mut objects = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let path = match &token {
            None => format!("{base}?limit={PAGE}"),
            Some(t) => format!(
                "{base}?limit={PAGE}&continue={}",
                percent_encoding::utf8_percent_encode(t, percent_encoding::NON_ALPHANUMERIC)
            ),
        };
        let body = get_json(upstream, &path).await?;
        let page: ListPage<'_> = serde_json::from_slice(&body)
            .map_err(|e| InformerError::Upstream(format!("{path}: {e}")))?;
        for item in page.items {
            objects.push(
                Obj::parse(item.get().as_bytes())
                    .map_err(|e| InformerError::Upstream(format!("{path}: an item: {e}")))?,
            );
        }
        match page.metadata.continue_token.filter(|t| !t.is_empty()) {
            Some(next) => token = Some(next),
            None => {
                let rv = page.metadata.resource_version.parse::<u64>().map_err(|_| {
                    InformerError::Upstream(format!(
                        "{path}: list resourceVersion {:?} is not a number",
                        page.metadata.resource_version
                    ))
                })?;
                return Ok((objects, rv));
            }
        }
    }
}

#[derive(Deserialize)]
struct WatchLine<'a> {
    #[serde(rename = "type")]
    kind: String,
    #[serde(borrow)]
    object: &'a RawValue,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bookmark {
    metadata: BookmarkMeta,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BookmarkMeta {
    resource_version: String,
}

/// Follows the upstream watch from the store's version until it ends. `Ok` for a clean
/// end (watch again), `Expired` for a 410 (relist), another error for backoff.
pub async fn watch(upstream: &Upstream, store: &ResourceStore) -> Result<(), InformerError> {
    let timeout = 300 + rand::random_range(0..300u32);
    let path = format!(
        "{}?watch=1&allowWatchBookmarks=true&resourceVersion={}&timeoutSeconds={timeout}",
        collection_path(&store.kind),
        store.rv()
    );
    let response = get(upstream, &path, true).await?;
    let status = response.status();
    if status == http::StatusCode::GONE {
        return Err(InformerError::Expired);
    }
    if !status.is_success() {
        let body = crate::read_to_limit(response.into_body(), 64 * 1024)
            .await
            .unwrap_or_default();
        return Err(InformerError::Upstream(format!(
            "{path} answered {status}: {}",
            String::from_utf8_lossy(&body)
        )));
    }
    store.set_connected(true);
    let result = follow(response.into_body(), store).await;
    store.set_connected(false);
    result
}

async fn follow(mut body: crate::Body, store: &ResourceStore) -> Result<(), InformerError> {
    let mut buffer = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame
            .map_err(|e| InformerError::Upstream(format!("watch stream: {e}")))?
            .into_data()
        else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line = buffer.split_to(end + 1);
            let line = &line[..end];
            if !line.iter().all(u8::is_ascii_whitespace) {
                handle_line(line, store)?;
            }
        }
        if buffer.len() > MAX_LINE {
            return Err(InformerError::Upstream("a watch event is too long".into()));
        }
    }
    if buffer.has_remaining() && !buffer.iter().all(u8::is_ascii_whitespace) {
        handle_line(&buffer, store)?;
    }
    Ok(())
}

fn handle_line(line: &[u8], store: &ResourceStore) -> Result<(), InformerError> {
    let event: WatchLine<'_> = serde_json::from_slice(line)
        .map_err(|e| InformerError::Upstream(format!("a watch event: {e}")))?;
    let raw = event.object.get().as_bytes();
    if let Some(kind) = EventType::parse(&event.kind) {
        let obj =
            Obj::parse(raw).map_err(|e| InformerError::Upstream(format!("a watch event: {e}")))?;
        store.apply(kind, obj);
        return Ok(());
    }
    match event.kind.as_str() {
        "BOOKMARK" => {
            let bookmark: Bookmark = serde_json::from_slice(raw)
                .map_err(|e| InformerError::Upstream(format!("a bookmark: {e}")))?;
            if let Ok(rv) = bookmark.metadata.resource_version.parse::<u64>() {
                store.advance(rv);
            }
            Ok(())
        }
        "ERROR" => {
            let status: serde_json::Value = serde_json::from_slice(raw).unwrap_or_default();
            if status["code"] == 410 {
                Err(InformerError::Expired)
            } else {
                Err(InformerError::Upstream(format!(
                    "watch error: {}",
                    status["message"].as_str().unwrap_or("unknown")
                )))
            }
        }
        other => Err(InformerError::Upstream(format!(
            "unknown watch event type {other:?}"
        ))),
    }
}

/// Runs one resource's informer forever: discover, list, watch, and again.
pub async fn run(
    upstream: Upstream,
    gr: GroupResource,
    slot: Arc<std::sync::OnceLock<Arc<ResourceStore>>>,
    make: impl FnOnce(Kind) -> Arc<ResourceStore> + Send,
    metrics: Metrics,
) {
    let label = gr.to_string();
    let mut backoff = BACKOFF.0;
    let kind = loop {
        match discover(&upstream, &gr).await {
            Ok(kind) => break kind,
            Err(e) => {
                tracing::warn!(resource = %label, error = %e, "cache discovery failed; retrying");
                tokio::time::sleep(jitter(backoff)).await;
                backoff = (backoff * 2).min(BACKOFF.1);
            }
        }
    };
    let store = slot.get_or_init(|| make(kind)).clone();
    backoff = BACKOFF.0;
    let mut listed = false;
    loop {
        match list_all(&upstream, &store.kind).await {
            Ok((objects, rv)) => {
                tracing::info!(resource = %label, objects = objects.len(), rv, "cache listed");
                if listed {
                    metrics
                        .cache_relists_total
                        .with_label_values(&[&label])
                        .inc();
                }
                listed = true;
                store.replace(objects, rv);
                backoff = BACKOFF.0;
            }
            Err(e) => {
                tracing::warn!(resource = %label, error = %e, "cache list failed; retrying");
                tokio::time::sleep(jitter(backoff)).await;
                backoff = (backoff * 2).min(BACKOFF.1);
                continue;
            }
        }
        loop {
            match watch(&upstream, &store).await {
                Ok(()) => backoff = BACKOFF.0,
                Err(InformerError::Expired) => {
                    tracing::info!(resource = %label, "cache watch expired; relisting");
                    break;
                }
                Err(e) => {
                    tracing::warn!(resource = %label, error = %e, "cache watch failed; retrying");
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(BACKOFF.1);
                }
            }
        }
    }
}

/// Up to a quarter more, so that many informers do not retry in step.
fn jitter(base: Duration) -> Duration {
    base + base.mul_f64(rand::random_range(0.0..0.25))
}
