//! The informer's calls to the apiserver, each through Bulwark's own client: discovery of a
//! resource's kind, a paginated LIST, and a watch (or WatchList) whose events go into the
//! store's [`Writer`] as they arrive ([`super::stream`]).

use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::stream::follow;
use crate::cache::store::{Kind, Obj, ObjError, Writer};
use crate::config::GroupResource;
use crate::own::{self, Call, CallError};

/// Items per LIST page.
const PAGE: u64 = 500;
/// Largest LIST page or discovery document read.
const MAX_PAGE_BYTES: usize = 512 * 1024 * 1024;
/// Time allowed for a watch's response head.
const WATCH_HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed for a LIST page.
const LIST_TIMEOUT: Duration = Duration::from_secs(120);

/// Why an informer step failed.
#[derive(Debug, thiserror::Error)]
pub enum InformerError {
    /// The call failed: no apiserver answered, or one answered with an error status.
    #[error(transparent)]
    Call(#[from] CallError),
    /// An answer's body broke off or was too large.
    #[error("{what}: the body")]
    Body {
        /// The path, or which stream.
        what: String,
        /// Why.
        #[source]
        source: crate::BoxError,
    },
    /// An answer is not the JSON it should be.
    #[error("{what}: not the JSON expected")]
    Decode {
        /// What was read.
        what: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// An object is not one the cache can store.
    #[error("{what}: an object")]
    Object {
        /// Where it came from.
        what: String,
        /// Why.
        #[source]
        source: ObjError,
    },
    /// The resource cannot be cached as configured (discovery).
    #[error("discovery of {resource}: {why}")]
    Discovery {
        /// The configured resource.
        resource: String,
        /// What is missing.
        why: String,
    },
    /// The stream broke the watch protocol.
    #[error("{0}")]
    Protocol(String),
    /// The apiserver ended the watch with an error other than 410.
    #[error("watch error: {0}")]
    Watch(String),
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

/// A whole JSON answer; a 410 is [`InformerError::Expired`].
async fn get_json(client: &own::Client, path: &str) -> Result<bytes::Bytes, InformerError> {
    let call = Call::get(path)
        .timeout(LIST_TIMEOUT)
        .max_bytes(MAX_PAGE_BYTES);
    client.bytes(call).await.map_err(expired_or)
}

/// A 410 is the stored history gone ([`InformerError::Expired`]); anything else stays the
/// call's error.
fn expired_or(error: CallError) -> InformerError {
    match error.answered() {
        Some(http::StatusCode::GONE) => InformerError::Expired,
        _ => InformerError::Call(error),
    }
}

/// Finds the preferred version, kind and scope of a configured resource.
pub async fn discover(client: &own::Client, gr: &GroupResource) -> Result<Kind, InformerError> {
    let bad = |why: String| InformerError::Discovery {
        resource: gr.to_string(),
        why,
    };
    let decode = |what: &str| {
        let what = what.to_owned();
        move |source| InformerError::Decode { what, source }
    };
    let version = if gr.group.is_empty() {
        "v1".to_owned()
    } else {
        let group: serde_json::Value =
            serde_json::from_slice(&get_json(client, &format!("/apis/{}", gr.group)).await?)
                .map_err(decode("the API group"))?;
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
    let list: serde_json::Value =
        serde_json::from_slice(&get_json(client, &path).await?).map_err(decode(&path))?;
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
pub async fn list_all(client: &own::Client, kind: &Kind) -> Result<(Vec<Obj>, u64), InformerError> {
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
        let body = get_json(client, &path).await?;
        let page: ListPage<'_> =
            serde_json::from_slice(&body).map_err(|source| InformerError::Decode {
                what: path.clone(),
                source,
            })?;
        for item in page.items {
            objects.push(Obj::parse(item.get().as_bytes()).map_err(|source| {
                InformerError::Object {
                    what: path.clone(),
                    source,
                }
            })?);
        }
        match page.metadata.continue_token.filter(|t| !t.is_empty()) {
            Some(next) => token = Some(next),
            None => {
                let rv = page.metadata.resource_version.parse::<u64>().map_err(|_| {
                    InformerError::Protocol(format!(
                        "{path}: list resourceVersion {:?} is not a number",
                        page.metadata.resource_version
                    ))
                })?;
                return Ok((objects, rv));
            }
        }
    }
}

/// How a watch begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Events after this version (the store's).
    Resume(u64),
    /// A WatchList: the current state as ADDED events up to the `initial-events-end`
    /// bookmark, which replaces the store (a relist without a LIST), then events.
    WatchList,
}

/// Why a watch ended other than cleanly.
#[derive(Debug)]
pub enum WatchError {
    /// The upstream refuses WatchList: it answered the request with a 4xx other than 429.
    Refused,
    /// It failed: [`InformerError::Expired`] for a 410, anything else.
    Failed(InformerError),
}

/// Follows an upstream watch until it ends, its events going into `store`: `Ok` for a
/// clean end.
pub async fn watch(
    client: &own::Client,
    store: &mut Writer,
    start: Start,
) -> Result<(), WatchError> {
    let timeout = 300 + rand::random_range(0..300u32);
    let base = collection_path(store.kind());
    let path = match start {
        Start::Resume(rv) => format!(
            "{base}?watch=1&allowWatchBookmarks=true&resourceVersion={rv}&timeoutSeconds={timeout}"
        ),
        Start::WatchList => format!(
            "{base}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds={timeout}"
        ),
    };
    // A watch's response head comes at once; only its body is long-running. Bounding the
    // wait for the head keeps an informer from hanging on a replica that took the request
    // and never answered.
    let call = Call::get(path).timeout(WATCH_HEAD_TIMEOUT);
    let response = match client.watch(call).await {
        Ok(response) => response,
        Err(error) => {
            return Err(match error.answered() {
                Some(http::StatusCode::GONE) => WatchError::Failed(InformerError::Expired),
                Some(status)
                    if start == Start::WatchList
                        && status.is_client_error()
                        && status != http::StatusCode::TOO_MANY_REQUESTS =>
                {
                    tracing::info!(%status, "the upstream refuses WatchList; listing instead");
                    WatchError::Refused
                }
                _ => WatchError::Failed(InformerError::Call(error)),
            });
        }
    };
    store.set_connected(true);
    let mut initial = (start == Start::WatchList).then(Vec::new);
    let result = follow(response.into_body(), store, &mut initial).await;
    store.set_connected(false);
    match (result, initial) {
        (Ok(()), Some(_)) => Err(WatchError::Failed(InformerError::Protocol(
            "the WatchList ended before its initial-events-end bookmark".into(),
        ))),
        (result, _) => result.map_err(WatchError::Failed),
    }
}
