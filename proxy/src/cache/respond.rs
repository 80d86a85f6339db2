//! The bytes of cache answers, shaped like the apiserver's: LIST responses as a chain of
//! the objects' own `Bytes`, GET objects with `kind` and `apiVersion` in front, `Status`
//! errors (encoded by [`apimachinery::status`]), and gzip above its threshold.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode};
use http_body::{Frame, SizeHint};

use apimachinery::continue_token;
use apimachinery::status::Status;

use super::accept::Encoding;
use super::protobuf::{self, ProtoError};
use super::store::{Kind, Obj, encode_event};
use crate::{Body, BoxError};

/// Responses at least this large are gzipped for clients that accept it (the apiserver's
/// threshold).
pub const GZIP_THRESHOLD: usize = 128 * 1024;

/// A piece at least this large is sent as its own frame; smaller ones are gathered into
/// frames of up to [`FRAME`] bytes so that a LIST of small objects is not a frame per comma.
const ZERO_COPY_MIN: usize = 16 * 1024;
/// The size of a gathered frame.
const FRAME: usize = 64 * 1024;

/// A response body that is a chain of shared pieces.
pub struct Chain {
    pieces: Arc<[Bytes]>,
    next: usize,
    remaining: u64,
}

impl Chain {
    /// A body over `pieces`.
    pub fn new(pieces: Arc<[Bytes]>) -> Chain {
        let remaining = pieces.iter().map(|p| p.len() as u64).sum();
        Chain {
            pieces,
            next: 0,
            remaining,
        }
    }
}

impl http_body::Body for Chain {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        while this.next < this.pieces.len() && this.pieces[this.next].is_empty() {
            this.next += 1;
        }
        let Some(first) = this.pieces.get(this.next) else {
            return Poll::Ready(None);
        };
        if first.len() >= ZERO_COPY_MIN {
            this.next += 1;
            this.remaining -= first.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(first.clone()))));
        }
        let mut frame = BytesMut::with_capacity(FRAME);
        while let Some(piece) = this.pieces.get(this.next) {
            if !frame.is_empty()
                && (piece.len() >= ZERO_COPY_MIN || frame.len() + piece.len() > FRAME)
            {
                break;
            }
            frame.put_slice(piece);
            this.next += 1;
        }
        this.remaining -= frame.len() as u64;
        Poll::Ready(Some(Ok(Frame::data(frame.freeze()))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// Where a list continues: the version and the key after the last item of the page.
#[derive(Debug, Clone)]
pub struct Continue {
    /// The version the list is a snapshot of.
    pub rv: u64,
    /// Where the next page starts, after the list's key prefix: the last item's key
    /// relative to the list's scope (`name` in a namespace, `namespace/name` across all),
    /// then NUL, as the apiserver writes it (so that either Bulwark or the apiserver can
    /// continue the list).
    pub start: String,
    /// Items after this page when the list has no selector (else unknown).
    pub remaining: Option<u64>,
}

/// A LIST response: `{"kind":"SecretList","apiVersion":"v1","metadata":{…},"items":[…]}\n`,
/// the items being the objects' own bytes.
pub fn list_pieces(
    kind: &Kind,
    rv: u64,
    next: Option<&Continue>,
    items: &[Arc<Obj>],
) -> Arc<[Bytes]> {
    let mut meta = format!("{{\"resourceVersion\":\"{rv}\"");
    if let Some(next) = next {
        meta.push_str(&format!(
            ",\"continue\":\"{}\"",
            continue_token::encode(i64::try_from(next.rv).unwrap_or(i64::MAX), &next.start)
        ));
        if let Some(remaining) = next.remaining {
            meta.push_str(&format!(",\"remainingItemCount\":{remaining}"));
        }
    }
    meta.push('}');
    let head = format!(
        "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{meta},\"items\":[",
        kind.kind,
        kind.api_version()
    );
    let comma = Bytes::from_static(b",");
    let mut pieces = Vec::with_capacity(items.len() * 2 + 2);
    pieces.push(Bytes::from(head));
    for (i, obj) in items.iter().enumerate() {
        if i > 0 {
            pieces.push(comma.clone());
        }
        pieces.push(obj.body.clone());
    }
    pieces.push(Bytes::from_static(b"]}\n"));
    pieces.into()
}

/// A LIST response in `encoding`: JSON as [`list_pieces`], or protobuf (one piece) for a
/// kind that has it; JSON for one that has not (negotiation sends those upstream).
pub fn list_answer(
    kind: &Kind,
    rv: u64,
    next: Option<&Continue>,
    items: &[Arc<Obj>],
    encoding: Encoding,
) -> Result<Arc<[Bytes]>, ProtoError> {
    let Some(proto) = kind.proto.filter(|_| encoding == Encoding::Protobuf) else {
        return Ok(list_pieces(kind, rv, next, items));
    };
    let messages = items
        .iter()
        .map(|obj| proto.message(&obj.body))
        .collect::<Result<Vec<_>, _>>()?;
    let token = next.map(|next| {
        continue_token::encode(i64::try_from(next.rv).unwrap_or(i64::MAX), &next.start)
    });
    let rv = rv.to_string();
    let meta = protobuf::ListMeta {
        resource_version: &rv,
        next: token.as_deref(),
        remaining_item_count: next
            .and_then(|n| n.remaining)
            .map(|r| i64::try_from(r).unwrap_or(i64::MAX)),
    };
    let raw = protobuf::list_message(&meta, messages.iter().map(Vec::as_slice));
    let list = protobuf::envelope(&kind.api_version(), &format!("{}List", kind.kind), raw);
    Ok(Arc::from([Bytes::from(list)]))
}

/// A GET response in `encoding`: JSON as [`object_pieces`], or protobuf (one piece).
pub fn object_answer(
    kind: &Kind,
    obj: &Obj,
    encoding: Encoding,
) -> Result<Arc<[Bytes]>, ProtoError> {
    let Some(proto) = kind.proto.filter(|_| encoding == Encoding::Protobuf) else {
        return Ok(object_pieces(kind, obj));
    };
    let object = protobuf::envelope(&kind.api_version(), &kind.kind, proto.message(&obj.body)?);
    Ok(Arc::from([Bytes::from(object)]))
}

/// The `Content-Type` of an answer in `encoding` (`watch`: of a watch stream).
pub fn content_type(encoding: Encoding, watch: bool) -> &'static str {
    match (encoding, watch) {
        (Encoding::Json, _) => "application/json",
        (Encoding::Protobuf, false) => protobuf::MEDIA_TYPE,
        (Encoding::Protobuf, true) => protobuf::WATCH_MEDIA_TYPE,
    }
}

/// A GET response's pieces: the object with kind and apiVersion, and a newline.
pub fn object_pieces(kind: &Kind, obj: &Obj) -> Arc<[Bytes]> {
    let [prefix, rest] = kind.full_object(obj);
    Arc::from([prefix, rest, Bytes::from_static(b"\n")])
}

/// Gzips pieces (on a blocking thread: it is CPU work).
pub async fn gzip(pieces: Arc<[Bytes]>) -> std::io::Result<Bytes> {
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let total: usize = pieces.iter().map(Bytes::len).sum();
        let mut encoder = flate2::write::GzEncoder::new(
            Vec::with_capacity(total / 4),
            flate2::Compression::fast(),
        );
        for piece in pieces.iter() {
            encoder.write_all(piece)?;
        }
        encoder.finish().map(Bytes::from)
    })
    .await
    .map_err(std::io::Error::other)?
}

/// A JSON response with the headers every cache answer carries.
pub fn json_response(status: StatusCode, body: Body, audit_id: &str) -> Response<Body> {
    response(status, body, audit_id, "application/json")
}

/// A response of `content_type` with the headers every cache answer carries.
pub fn response(
    status: StatusCode,
    body: Body,
    audit_id: &str,
    content_type: &'static str,
) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    headers.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    if let Ok(id) = HeaderValue::from_str(audit_id) {
        headers.insert(crate::status::AUDIT_ID, id);
    }
    response
        .extensions_mut()
        .insert(crate::metrics::ServedBy::Cache);
    response
}

/// A chain as a body.
pub fn chain_body(pieces: Arc<[Bytes]>) -> Body {
    use http_body_util::BodyExt;
    Chain::new(pieces).boxed_unsync()
}

/// The response that carries `status`, with its `Retry-After` when it gives one.
pub fn status_response(status: &Status, audit_id: &str) -> Response<Body> {
    let code = StatusCode::from_u16(status.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = json_response(code, crate::full(status.to_body()), audit_id);
    if let Some(after) = status.details.as_ref().and_then(|d| d.retry_after_seconds) {
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, HeaderValue::from(after));
    }
    response
}

/// Chunks of a watch stream's initial state: ADDED events (JSON lines or protobuf frames)
/// copied into frames of about [`FRAME`] bytes.
pub fn added_frames(
    kind: &Kind,
    objects: &mut VecDeque<Arc<Obj>>,
    encoding: Encoding,
    keep: impl Fn(&Obj) -> bool,
) -> Option<Bytes> {
    let mut out = BytesMut::new();
    while let Some(obj) = objects.pop_front() {
        if !keep(&obj) {
            continue;
        }
        match encoding {
            Encoding::Json => {
                out.put_slice(b"{\"type\":\"ADDED\",\"object\":");
                out.put_slice(&kind.prefix);
                out.put_slice(obj.body.get(1..).unwrap_or_default());
                out.put_slice(b"}\n");
            }
            Encoding::Protobuf => {
                out.put_slice(&encode_event(kind, "ADDED", encoding, &obj.body));
            }
        }
        if out.len() >= FRAME {
            break;
        }
    }
    (!out.is_empty()).then(|| out.freeze())
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn obj(name: &str, size: usize) -> Arc<Obj> {
        let raw = format!(
            "{{\"metadata\":{{\"name\":\"{name}\",\"namespace\":\"ns\",\"resourceVersion\":\"3\"}},\"data\":{{\"k\":\"{}\"}}}}",
            "x".repeat(size)
        );
        Arc::new(Obj::parse(raw.as_bytes()).unwrap())
    }

    #[tokio::test]
    async fn a_list_is_the_apiserver_shape_and_shares_the_object_bytes() {
        let kind = Kind::new("", "v1", "secrets", "Secret", true);
        let items = vec![obj("a", 10), obj("b", 40_000), obj("c", 10)];
        let pieces = list_pieces(&kind, 9, None, &items);
        assert!(pieces.iter().any(|p| p.as_ptr() == items[1].body.as_ptr()));
        let body = Chain::new(pieces).collect().await.unwrap().to_bytes();
        assert!(body.starts_with(b"{\"kind\":\"SecretList\",\"apiVersion\":\"v1\",\"metadata\":{\"resourceVersion\":\"9\"},\"items\":[{\"metadata\""));
        assert!(body.ends_with(b"]}\n"));
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["items"].as_array().unwrap().len(), 3);
        assert!(value["items"][0].get("kind").is_none());
    }

    #[test]
    fn a_page_ends_with_the_apiservers_continue_token() {
        let kind = Kind::new("", "v1", "secrets", "Secret", true);
        let next = Continue {
            rv: 12345,
            start: "foo\0".into(),
            remaining: Some(3),
        };
        let pieces = list_pieces(&kind, 12345, Some(&next), &[obj("a", 1)]);
        let body = pieces.concat();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        // `{"v":"meta.k8s.io/v1","rv":12345,"start":"foo\u0000"}`, unpadded base64url.
        assert_eq!(
            value["metadata"]["continue"],
            "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MTIzNDUsInN0YXJ0IjoiZm9vXHUwMDAwIn0"
        );
        assert_eq!(value["metadata"]["remainingItemCount"], 3);
    }
}
