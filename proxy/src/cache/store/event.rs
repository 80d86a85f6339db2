//! Events: one change kept in the ring and sent to every watch, and the wire forms of
//! watch events (JSON lines, protobuf frames, bookmarks), each encoded once and shared.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::{BufMut, Bytes, BytesMut};

use super::{Kind, Obj};
use crate::cache::accept::Encoding;
use crate::cache::protobuf;
use apimachinery::status::Status;

pub use apimachinery::watch::EventType;

/// One change, kept in the ring and sent to every watch. Its wire form is encoded once,
/// on first use, and shared by every watcher.
#[derive(Debug)]
pub struct Event {
    /// The version of the change.
    pub rv: u64,
    /// What happened.
    pub kind: EventType,
    /// The object after the change (for a delete, the deleted object).
    pub obj: Arc<Obj>,
    /// The object before the change, if the cache had it.
    pub prev: Option<Arc<Obj>>,
    /// Per encoding, per type the event is sent as.
    lines: [[OnceLock<Bytes>; 3]; 2],
    /// Per encoding.
    left: [OnceLock<Bytes>; 2],
}

impl Event {
    pub(super) fn new(rv: u64, kind: EventType, obj: Arc<Obj>, prev: Option<Arc<Obj>>) -> Event {
        Event {
            rv,
            kind,
            obj,
            prev,
            lines: Default::default(),
            left: Default::default(),
        }
    }

    /// The event as a watch stream in `encoding` carries it, for this event's object sent
    /// as `as_type` (a selector watch may see a MODIFIED as ADDED): a JSON line
    /// `{"type":T,"object":{kind,apiVersion,…}}\n` or a protobuf frame. Encoded at most
    /// once per encoding and type, whatever the number of watchers; `counter` counts
    /// encodings.
    pub fn line(
        &self,
        kind: &Kind,
        as_type: EventType,
        encoding: Encoding,
        counter: &AtomicU64,
    ) -> Bytes {
        self.lines[encoding as usize][as_type as usize]
            .get_or_init(|| {
                counter.fetch_add(1, Ordering::Relaxed);
                encode_event(kind, as_type.as_str(), encoding, &self.obj.body)
            })
            .clone()
    }

    /// The DELETED event for a selector watch the object left: the previous object at this
    /// event's version.
    pub fn left_line(&self, kind: &Kind, encoding: Encoding, counter: &AtomicU64) -> Bytes {
        let Some(prev) = &self.prev else {
            return self.line(kind, EventType::Deleted, encoding, counter);
        };
        self.left[encoding as usize]
            .get_or_init(|| {
                counter.fetch_add(1, Ordering::Relaxed);
                encode_event(
                    kind,
                    EventType::Deleted.as_str(),
                    encoding,
                    &prev.at_version(self.rv),
                )
            })
            .clone()
    }
}

/// One watch event of `item` (an object's cached JSON) in `encoding`. An object that does
/// not encode in protobuf (the cache's JSON not reading as its kind) becomes an ERROR
/// event with a 500 Status, as the apiserver reports an object it cannot encode: the
/// client sees the failure and watches again rather than missing the change unawares.
pub fn encode_event(kind: &Kind, type_name: &str, encoding: Encoding, item: &[u8]) -> Bytes {
    match (encoding, kind.proto) {
        (Encoding::Json, _) => json_event(kind, type_name, item),
        (Encoding::Protobuf, Some(proto)) => match proto.message(item) {
            Ok(message) => {
                let object = protobuf::envelope(&kind.api_version(), &kind.kind, message);
                Bytes::from(protobuf::watch_frame(type_name, object))
            }
            Err(error) => {
                tracing::warn!(kind = %kind.kind, error = %crate::report::Chain(&error), "a cached object does not encode in protobuf");
                protobuf_error_event(&error.to_string())
            }
        },
        (Encoding::Protobuf, None) => protobuf_error_event("this kind has no protobuf form"),
    }
}

/// An ERROR frame of a protobuf watch with a 500 Status saying `message`.
pub fn protobuf_error_event(message: &str) -> Bytes {
    let status = Status::failure(500, "InternalError", message.to_owned(), None);
    let object = protobuf::status(&status.to_bytes()).unwrap_or_default();
    Bytes::from(protobuf::watch_frame("ERROR", object))
}

/// `{"type":T,"object":` + prefix + item without `{` + `}\n`, in one allocation.
pub fn event_line(kind: &Kind, as_type: EventType, item: &[u8]) -> Bytes {
    json_event(kind, as_type.as_str(), item)
}

fn json_event(kind: &Kind, type_name: &str, item: &[u8]) -> Bytes {
    let head = b"{\"type\":\"";
    let mid = b"\",\"object\":";
    let ty = type_name.as_bytes();
    let body = item.get(1..).unwrap_or_default();
    let mut out = BytesMut::with_capacity(
        head.len() + ty.len() + mid.len() + kind.prefix.len() + body.len() + 2,
    );
    out.put_slice(head);
    out.put_slice(ty);
    out.put_slice(mid);
    out.put_slice(&kind.prefix);
    out.put_slice(body);
    out.put_slice(b"}\n");
    out.freeze()
}

/// A BOOKMARK event at `rv` in `encoding`, annotated as the end of a WatchList's initial
/// events when asked.
pub fn bookmark_line(kind: &Kind, rv: u64, initial_events_end: bool, encoding: Encoding) -> Bytes {
    let annotation = if initial_events_end {
        ",\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}"
    } else {
        ""
    };
    let object = format!(
        "{{\"metadata\":{{\"resourceVersion\":\"{rv}\"{annotation}}}{}}}",
        kind.zero_fields()
    );
    encode_event(kind, "BOOKMARK", encoding, object.as_bytes())
}
