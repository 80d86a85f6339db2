//! `/openapi/v2` and `/openapi/v3`, served from documents recorded from a real kube-apiserver
//! (`fixtures/kube-apiserver-v1.36/openapi/`, see its `record.sh`), so that kubectl validates
//! (`kubectl apply` without `--validate=false`) and explains against the simulator as it
//! does against the real thing. The v3 index lists only the groups the simulator serves.

use std::io::Read;
use std::sync::OnceLock;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use crate::api::{Query, param, text};
use crate::body::SimBody;

/// The v2 document as protobuf, asked for by `Accept` (the apiserver answers with the
/// dotted form of the same type).
const V2_PROTOBUF_ACCEPT: &str = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf";
const V2_PROTOBUF: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";

/// A recorded document: its bytes gzipped (as stored) and, once asked for, plain.
struct Doc {
    gzipped: &'static [u8],
    plain: OnceLock<Bytes>,
}

impl Doc {
    const fn new(gzipped: &'static [u8]) -> Doc {
        Doc {
            gzipped,
            plain: OnceLock::new(),
        }
    }

    fn plain(&self) -> Bytes {
        self.plain
            .get_or_init(|| {
                let mut out = Vec::new();
                // The fixtures are compiled in; one that does not inflate is a build defect.
                flate2::read::GzDecoder::new(self.gzipped)
                    .read_to_end(&mut out)
                    .expect("a recorded OpenAPI fixture is valid gzip");
                Bytes::from(out)
            })
            .clone()
    }
}

macro_rules! fixture {
    ($path:literal) => {
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/kube-apiserver-v1.36/openapi/",
            $path
        ))
    };
}

static V2_JSON: Doc = Doc::new(fixture!("v2.json.gz"));
static V2_PB: Doc = Doc::new(fixture!("v2.pb.gz"));
const V2_ETAG: &[u8] = fixture!("v2.etag");
/// The `/openapi/v3` index, as recorded and trimmed to the served groups.
const V3_INDEX: &[u8] = fixture!("v3.json");

/// The `/openapi/v3/…` documents, by path below `/openapi/v3/`.
static V3_DOCS: [(&str, Doc); 12] = [
    ("api", Doc::new(fixture!("v3/api.json.gz"))),
    ("api/v1", Doc::new(fixture!("v3/api/v1.json.gz"))),
    ("apis", Doc::new(fixture!("v3/apis.json.gz"))),
    (
        "apis/authentication.k8s.io",
        Doc::new(fixture!("v3/apis/authentication.k8s.io.json.gz")),
    ),
    (
        "apis/authentication.k8s.io/v1",
        Doc::new(fixture!("v3/apis/authentication.k8s.io/v1.json.gz")),
    ),
    (
        "apis/authorization.k8s.io",
        Doc::new(fixture!("v3/apis/authorization.k8s.io.json.gz")),
    ),
    (
        "apis/authorization.k8s.io/v1",
        Doc::new(fixture!("v3/apis/authorization.k8s.io/v1.json.gz")),
    ),
    (
        "apis/coordination.k8s.io",
        Doc::new(fixture!("v3/apis/coordination.k8s.io.json.gz")),
    ),
    (
        "apis/coordination.k8s.io/v1",
        Doc::new(fixture!("v3/apis/coordination.k8s.io/v1.json.gz")),
    ),
    (
        "apis/discovery.k8s.io",
        Doc::new(fixture!("v3/apis/discovery.k8s.io.json.gz")),
    ),
    (
        "apis/discovery.k8s.io/v1",
        Doc::new(fixture!("v3/apis/discovery.k8s.io/v1.json.gz")),
    ),
    ("version", Doc::new(fixture!("v3/version.json.gz"))),
];

/// Whether a path is one this module answers.
pub fn handles(path: &str) -> bool {
    path == "/openapi/v2" || path == "/openapi/v3" || path.starts_with("/openapi/v3/")
}

/// Answers a GET of an OpenAPI path.
pub fn serve(path: &str, q: &Query, headers: &HeaderMap) -> Response<SimBody> {
    let accepts = media_ranges(headers);
    let gzip = headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .any(|v| v.to_str().is_ok_and(|s| s.contains("gzip")));
    if path == "/openapi/v2" {
        let etag = String::from_utf8_lossy(V2_ETAG).trim().to_string();
        return match pick(&accepts, &[V2_PROTOBUF_ACCEPT, V2_PROTOBUF]) {
            Some(Pick::Json) => document(&V2_JSON, "application/json", &etag, gzip, false),
            Some(Pick::Other) => document(&V2_PB, V2_PROTOBUF, &etag, gzip, false),
            None => bare(StatusCode::NOT_ACCEPTABLE),
        };
    }
    if path == "/openapi/v3" {
        // kube-openapi writes the index without setting a type: Go's sniffing calls it text.
        let mut r = text(200, &String::from_utf8_lossy(V3_INDEX));
        r.headers_mut().remove("x-content-type-options");
        return r;
    }
    let rest = path.trim_start_matches("/openapi/v3/");
    let Some((_, doc)) = V3_DOCS.iter().find(|(p, _)| *p == rest) else {
        return bare(StatusCode::NOT_FOUND);
    };
    let Some(hash) = index_hash(rest) else {
        return bare(StatusCode::NOT_FOUND);
    };
    // The v3 documents are recorded as JSON only: a client that takes nothing but protobuf
    // is refused (the apiserver would serve it).
    if pick(&accepts, &[]).is_none() {
        return bare(StatusCode::NOT_ACCEPTABLE);
    }
    match param(q, "hash") {
        // A stale hash is sent to the current document's address.
        Some(h) if h != hash => {
            let mut r = bare(StatusCode::MOVED_PERMANENTLY);
            let h = r.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            insert(h, header::ETAG, &format!("\"{hash}\""));
            insert(
                h,
                header::LOCATION,
                &format!("/openapi/v3/{rest}?hash={hash}"),
            );
            h.insert(header::VARY, HeaderValue::from_static("Accept"));
            r
        }
        Some(_) => document(doc, "application/json", &hash, gzip, true),
        None => document(doc, "application/json", &hash, gzip, false),
    }
}

/// The hash the v3 index gives a document (its `serverRelativeURL`'s `hash`).
fn index_hash(rest: &str) -> Option<String> {
    let index: serde_json::Value = serde_json::from_slice(V3_INDEX).ok()?;
    let url = index.pointer(&format!(
        "/paths/{}",
        rest.replace('~', "~0").replace('/', "~1")
    ))?;
    let url = url.get("serverRelativeURL")?.as_str()?;
    Some(url.split_once("?hash=")?.1.to_string())
}

enum Pick {
    Json,
    /// The first of the other types the endpoint offers.
    Other,
}

/// The media ranges of `Accept`, lowercased, without parameters; none when absent.
fn media_ranges(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|r| {
            r.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_lowercase()
        })
        .filter(|r| !r.is_empty())
        .collect()
}

/// The first range that JSON or one of `others` satisfies, in the client's order.
fn pick(accepts: &[String], others: &[&str]) -> Option<Pick> {
    if accepts.is_empty() {
        return Some(Pick::Json);
    }
    accepts.iter().find_map(|r| match r.as_str() {
        "application/json" | "application/*" | "*/*" => Some(Pick::Json),
        r if others.contains(&r) => Some(Pick::Other),
        _ => None,
    })
}

fn document(
    doc: &Doc,
    content_type: &'static str,
    etag: &str,
    gzip: bool,
    immutable: bool,
) -> Response<SimBody> {
    // The stored gzip is sent as it is to a client that takes gzip: the apiserver compresses
    // bodies this large too.
    let mut r = Response::new(if gzip {
        SimBody::full(Bytes::from_static(doc.gzipped))
    } else {
        SimBody::full(doc.plain())
    });
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    insert(h, header::ETAG, &format!("\"{etag}\""));
    h.insert(header::VARY, HeaderValue::from_static("Accept"));
    if immutable {
        h.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, immutable"),
        );
    }
    r
}

fn insert(h: &mut HeaderMap, name: header::HeaderName, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        h.insert(name, v);
    }
}

/// A response with a status and no body.
fn bare(code: StatusCode) -> Response<SimBody> {
    let mut r = Response::new(SimBody::empty());
    *r.status_mut() = code;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_indexed_document_is_recorded_and_matches_its_hash_path() {
        let index: serde_json::Value = serde_json::from_slice(V3_INDEX).unwrap();
        let paths = index["paths"].as_object().unwrap();
        assert_eq!(paths.len(), V3_DOCS.len());
        for (path, doc) in &V3_DOCS {
            assert!(paths.contains_key(*path), "{path} is not in the index");
            assert!(index_hash(path).is_some_and(|h| h.len() == 128), "{path}");
            let v: serde_json::Value = serde_json::from_slice(&doc.plain()).unwrap();
            assert!(v["openapi"].as_str().is_some_and(|s| s.starts_with("3.")));
        }
        let v2: serde_json::Value = serde_json::from_slice(&V2_JSON.plain()).unwrap();
        assert_eq!(v2["swagger"], "2.0");
        assert!(!V2_PB.plain().is_empty());
    }

    #[test]
    fn accept_picks_json_protobuf_or_nothing() {
        let mut h = HeaderMap::new();
        assert!(matches!(pick(&media_ranges(&h), &[]), Some(Pick::Json)));
        h.insert(header::ACCEPT, HeaderValue::from_static(V2_PROTOBUF_ACCEPT));
        assert!(matches!(
            pick(&media_ranges(&h), &[V2_PROTOBUF_ACCEPT]),
            Some(Pick::Other)
        ));
        assert!(pick(&media_ranges(&h), &[]).is_none());
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/yaml, application/json;q=0.9"),
        );
        assert!(matches!(pick(&media_ranges(&h), &[]), Some(Pick::Json)));
    }
}
