//! Reading a watch stream: newline-delimited JSON events, applied to the store's
//! [`Writer`] as they come, a WatchList's initial state gathered until its
//! `initial-events-end` bookmark replaces the store with it.

use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::calls::InformerError;
use crate::cache::store::{EventType, Obj, Writer};

/// Longest line of a watch stream (one object) read.
const MAX_LINE: usize = 64 * 1024 * 1024;

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
    #[serde(default)]
    annotations: Option<std::collections::HashMap<String, String>>,
}

/// Reads `body` to its end, each event into `store`; while `initial` holds a WatchList's
/// state, ADDED events gather there instead.
pub(super) async fn follow(
    mut body: crate::Body,
    store: &mut Writer,
    initial: &mut Option<Vec<Obj>>,
) -> Result<(), InformerError> {
    let mut buffer = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame
            .map_err(|source| InformerError::Body {
                what: "watch stream".into(),
                source,
            })?
            .into_data()
        else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line = buffer.split_to(end + 1);
            let line = &line[..end];
            if !line.iter().all(u8::is_ascii_whitespace) {
                handle_line(line, store, initial)?;
            }
        }
        if buffer.len() > MAX_LINE {
            return Err(InformerError::Protocol("a watch event is too long".into()));
        }
    }
    if buffer.has_remaining() && !buffer.iter().all(u8::is_ascii_whitespace) {
        handle_line(&buffer, store, initial)?;
    }
    Ok(())
}

/// One line of a watch stream. While `initial` holds a WatchList's state, ADDED events
/// gather there until the `initial-events-end` bookmark replaces the store with them.
fn handle_line(
    line: &[u8],
    store: &mut Writer,
    initial: &mut Option<Vec<Obj>>,
) -> Result<(), InformerError> {
    let event: WatchLine<'_> =
        serde_json::from_slice(line).map_err(|source| InformerError::Decode {
            what: "a watch event".into(),
            source,
        })?;
    let raw = event.object.get().as_bytes();
    if let Some(kind) = EventType::parse(&event.kind) {
        let obj = Obj::parse(raw).map_err(|source| InformerError::Object {
            what: "a watch event".into(),
            source,
        })?;
        match initial {
            Some(objects) if kind == EventType::Added => objects.push(obj),
            Some(_) => {
                return Err(InformerError::Protocol(format!(
                    "a {} event before the end of a WatchList's initial events",
                    event.kind
                )));
            }
            None => {
                store.apply(kind, obj);
            }
        }
        return Ok(());
    }
    match event.kind.as_str() {
        "BOOKMARK" => bookmark(raw, store, initial),
        "ERROR" => Err(watch_error(raw)),
        other => Err(InformerError::Protocol(format!(
            "unknown watch event type {other:?}"
        ))),
    }
}

/// A BOOKMARK: the store has every event up to its version, and a WatchList's
/// `initial-events-end` one replaces the store with the initial state gathered.
fn bookmark(
    raw: &[u8],
    store: &mut Writer,
    initial: &mut Option<Vec<Obj>>,
) -> Result<(), InformerError> {
    let bookmark: Bookmark =
        serde_json::from_slice(raw).map_err(|source| InformerError::Decode {
            what: "a bookmark".into(),
            source,
        })?;
    let rv = bookmark.metadata.resource_version.parse::<u64>().ok();
    let end = bookmark.metadata.annotations.as_ref().is_some_and(|a| {
        a.get("k8s.io/initial-events-end")
            .is_some_and(|v| v == "true")
    });
    match (initial.is_some(), end, rv) {
        (true, true, Some(rv)) => {
            let objects = initial.take().unwrap_or_default();
            store.replace(objects, rv);
        }
        (true, true, None) => {
            return Err(InformerError::Protocol(
                "the initial-events-end bookmark has no numeric resourceVersion".into(),
            ));
        }
        (false, _, Some(rv)) => store.advance(rv),
        _ => {}
    }
    Ok(())
}

/// The error an ERROR event ends the watch with: 410 is the history gone.
fn watch_error(raw: &[u8]) -> InformerError {
    let status: serde_json::Value = serde_json::from_slice(raw).unwrap_or_default();
    if status["code"] == 410 {
        InformerError::Expired
    } else {
        InformerError::Watch(status["message"].as_str().unwrap_or("unknown").to_owned())
    }
}
