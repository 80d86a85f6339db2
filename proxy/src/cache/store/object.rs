//! A cached object and its kind: the object's bytes in the item form a LIST carries
//! (without `kind` and `apiVersion`), read once from the apiserver's encoding, and what
//! the cache knows of the resource's type from discovery.

use std::collections::BTreeMap;
use std::ops::Range;

use apimachinery::continue_token::object_key;
use bytes::{BufMut, Bytes, BytesMut};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use crate::cache::protobuf::ProtoKind;

/// What the cache knows about a resource's type, from discovery.
#[derive(Debug, Clone)]
pub struct Kind {
    /// API group; `""` for the core group.
    pub group: String,
    /// API version served from the cache (the group's preferred one).
    pub version: String,
    /// Plural resource name.
    pub resource: String,
    /// Kind, e.g. `Secret`.
    pub kind: String,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// `{"kind":"Secret","apiVersion":"v1",`: put before an item's bytes (without their `{`)
    /// to make the object as GET and watch events carry it.
    pub prefix: Bytes,
    /// Its protobuf form, when the cache encodes this kind in protobuf.
    pub proto: Option<ProtoKind>,
}

impl Kind {
    /// A kind with its object prefix.
    pub fn new(group: &str, version: &str, resource: &str, kind: &str, namespaced: bool) -> Kind {
        let api_version = Kind::api_version_of(group, version);
        Kind {
            group: group.to_owned(),
            version: version.to_owned(),
            resource: resource.to_owned(),
            kind: kind.to_owned(),
            namespaced,
            prefix: Bytes::from(format!(
                "{{\"kind\":\"{kind}\",\"apiVersion\":\"{api_version}\","
            )),
            proto: ProtoKind::of(group, version, kind),
        }
    }

    fn api_version_of(group: &str, version: &str) -> String {
        if group.is_empty() {
            version.to_owned()
        } else {
            format!("{group}/{version}")
        }
    }

    /// `v1`, `discovery.k8s.io/v1`.
    pub fn api_version(&self) -> String {
        Kind::api_version_of(&self.group, &self.version)
    }

    /// The fields the apiserver's encoder writes for the zero value of this kind, after
    /// `metadata` (a BOOKMARK carries such an object): the shared table's, none for a
    /// kind it does not know.
    pub fn zero_fields(&self) -> &'static str {
        apimachinery::kinds::by_kind(&self.group, &self.kind).map_or("", |r| r.zero_fields)
    }

    /// The object with `kind` and `apiVersion` first, as GET returns it: two pieces, no
    /// copy of the object.
    pub fn full_object(&self, obj: &Obj) -> [Bytes; 2] {
        [self.prefix.clone(), obj.body.slice(1..)]
    }
}

/// One cached object.
#[derive(Debug)]
pub struct Obj {
    /// Namespace; `""` for cluster-scoped objects.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `metadata.resourceVersion`.
    pub rv: u64,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// The object as a LIST item carries it: `{"metadata":…}` without kind and apiVersion,
    /// in an allocation of its own (never a slice of a larger network buffer, which it
    /// would keep alive).
    pub body: Bytes,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Shape {
    #[serde(default)]
    metadata: Meta,
    /// Whether `kind` and `apiVersion` are there, wherever they are.
    #[serde(default)]
    kind: Option<IgnoredAny>,
    #[serde(default)]
    api_version: Option<IgnoredAny>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Meta {
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    resource_version: String,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

/// Why bytes are not an object the cache can keep.
#[derive(Debug, thiserror::Error)]
pub enum ObjError {
    /// Not JSON, or not of an object's shape.
    #[error("the object cannot be read")]
    Json(#[source] serde_json::Error),
    /// JSON, but not an object.
    #[error("the object is not a JSON object")]
    NotAnObject,
    /// No `metadata.name`.
    #[error("the object has no metadata.name")]
    NoName,
    /// The `resourceVersion` is not a number.
    #[error("resourceVersion {0:?} is not a number")]
    ResourceVersion(String),
}

impl Obj {
    /// Reads an object as the apiserver encodes it, with or without `kind` and
    /// `apiVersion` in front; keeps the bytes of the item form.
    pub fn parse(raw: &[u8]) -> Result<Obj, ObjError> {
        let shape: Shape = serde_json::from_slice(raw).map_err(ObjError::Json)?;
        // Whitespace around the object stays out of its bytes: they are spliced into lists
        // and newline-delimited watch events. (serde also reads a struct from an array.)
        let raw = raw.trim_ascii();
        if !raw.starts_with(b"{") {
            return Err(ObjError::NotAnObject);
        }
        let Shape {
            metadata: meta,
            kind,
            api_version,
        } = shape;
        if meta.name.is_empty() {
            return Err(ObjError::NoName);
        }
        let rv = meta
            .resource_version
            .parse::<u64>()
            .map_err(|_| ObjError::ResourceVersion(meta.resource_version.clone()))?;
        Ok(Obj {
            namespace: meta.namespace,
            name: meta.name,
            rv,
            labels: meta.labels.unwrap_or_default(),
            body: item_bytes(raw, kind.is_some() || api_version.is_some())?,
        })
    }

    /// The store key: the object's etcd key after its resource's prefix.
    pub fn key(&self) -> String {
        object_key(&self.namespace, &self.name)
    }

    /// The same object with its `metadata.resourceVersion` replaced: what a selector watch
    /// sends as DELETED when an object leaves it (the previous object at the event's
    /// version, as the apiserver's cacher does).
    pub(crate) fn at_version(&self, rv: u64) -> Bytes {
        // Found where the JSON parser finds it, not by searching the text: an
        // unstructured object's keys are sorted, so `annotations`, `labels` and
        // `managedFields`, which may hold another `"resourceVersion"`, come before it.
        match resource_version_span(&self.body) {
            Some(span) => {
                let new = format!("\"{rv}\"");
                let mut out = BytesMut::with_capacity(self.body.len() + 8);
                out.put_slice(&self.body[..span.start]);
                out.put_slice(new.as_bytes());
                out.put_slice(&self.body[span.end..]);
                out.freeze()
            }
            None => self.body.clone(),
        }
    }
}

/// Where the value of `metadata.resourceVersion` (with its quotes) sits in an object.
fn resource_version_span(object: &[u8]) -> Option<Range<usize>> {
    #[derive(Deserialize)]
    struct Outer<'a> {
        #[serde(borrow)]
        metadata: &'a RawValue,
    }
    #[derive(Deserialize)]
    struct Inner<'a> {
        #[serde(borrow, rename = "resourceVersion")]
        resource_version: &'a RawValue,
    }
    let outer: Outer<'_> = serde_json::from_slice(object).ok()?;
    let inner: Inner<'_> = serde_json::from_str(outer.metadata.get()).ok()?;
    // Both borrow from `object`: the value's offset is the distance between the pointers.
    let value = inner.resource_version.get();
    let start = (value.as_ptr() as usize).checked_sub(object.as_ptr() as usize)?;
    let span = start..start + value.len();
    (span.end <= object.len()).then_some(span)
}

/// The item form of an encoded object: `kind` and `apiVersion` taken out when `typed` (they
/// are there), copied into an exact allocation. The Go encoder writes them first, where
/// they are cut off; elsewhere (an unstructured object's keys are sorted, and `Zeta` sorts
/// before `apiVersion`) the object is rebuilt without them, or events and GETs would carry
/// them twice.
fn item_bytes(raw: &[u8], typed: bool) -> Result<Bytes, ObjError> {
    if let Some(rest) = strip_type_meta(raw) {
        let mut out = BytesMut::with_capacity(rest.len() + 1);
        out.put_u8(b'{');
        out.put_slice(rest);
        return Ok(out.freeze());
    }
    if typed {
        // Not in the Go encoder's order: rebuild without them (key order then follows
        // serde_json's map, which is the only thing that changes).
        let mut value: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(raw).map_err(ObjError::Json)?;
        value.remove("kind");
        value.remove("apiVersion");
        return serde_json::to_vec(&value)
            .map(Bytes::from)
            .map_err(ObjError::Json);
    }
    Ok(Bytes::copy_from_slice(raw))
}

/// `{"kind":"K","apiVersion":"V",REST` → `REST`.
fn strip_type_meta(raw: &[u8]) -> Option<&[u8]> {
    let rest = raw.strip_prefix(b"{\"kind\":\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    let rest = rest[end + 1..].strip_prefix(b",\"apiVersion\":\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    rest[end + 1..].strip_prefix(b",")
}

#[cfg(test)]
mod tests {
    use super::super::{EventType, event_line};
    use super::*;

    fn secret(ns: &str, name: &str, rv: u64, app: &str) -> Obj {
        let raw = format!(
            "{{\"kind\":\"Secret\",\"apiVersion\":\"v1\",\"metadata\":{{\"name\":\"{name}\",\"namespace\":\"{ns}\",\"resourceVersion\":\"{rv}\",\"labels\":{{\"app\":\"{app}\"}}}},\"type\":\"Opaque\"}}"
        );
        Obj::parse(raw.as_bytes()).unwrap()
    }

    #[test]
    fn objects_keep_the_item_form_and_rebuild_the_full_one() {
        let obj = secret("ns", "a", 7, "web");
        assert!(obj.body.starts_with(b"{\"metadata\":{\"name\":\"a\""));
        let kind = Kind::new("", "v1", "secrets", "Secret", true);
        let full: Vec<u8> = kind.full_object(&obj).concat();
        let value: serde_json::Value = serde_json::from_slice(&full).unwrap();
        assert_eq!(value["kind"], "Secret");
        assert_eq!(value["apiVersion"], "v1");
        assert_eq!(value["type"], "Opaque");
        assert!(full.starts_with(b"{\"kind\":\"Secret\",\"apiVersion\":\"v1\",\"metadata\""));
    }

    #[test]
    fn whitespace_around_an_object_stays_out_of_its_bytes() {
        // Found by the `watch_event` fuzz target: the event line dropped the first byte of
        // the object, a tab here, instead of its `{`.
        let obj =
            Obj::parse(b"\t\t{\"metadata\":{\"name\":\"a\",\"resourceVersion\":\"1\"}}\n").unwrap();
        assert!(obj.body.starts_with(b"{") && obj.body.ends_with(b"}"));
        let kind = Kind::new("", "v1", "secrets", "Secret", true);
        let line = event_line(&kind, EventType::Added, &obj.body);
        let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(value["object"]["metadata"]["name"], "a");
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        assert!(Obj::parse(b"[{\"name\":\"a\",\"resourceVersion\":\"1\"}]").is_err());
    }

    #[test]
    fn kind_and_api_version_are_taken_out_wherever_they_are() {
        // Found by the `watch_event` fuzz target: an object whose first key sorts before
        // `apiVersion` kept its own, and its events carried two.
        let obj = Obj::parse(
            b"{\"Zeta\":1,\"apiVersion\":\"v2\",\"kind\":\"Secret\",\"metadata\":{\"name\":\"a\",\"resourceVersion\":\"1\"}}",
        )
        .unwrap();
        assert_eq!(
            &obj.body[..],
            b"{\"Zeta\":1,\"metadata\":{\"name\":\"a\",\"resourceVersion\":\"1\"}}"
        );
        let kind = Kind::new("", "v1", "secrets", "Secret", true);
        let line = event_line(&kind, EventType::Added, &obj.body);
        let text = std::str::from_utf8(&line).unwrap();
        assert_eq!(text.matches("\"apiVersion\"").count(), 1, "{text}");
    }

    #[test]
    fn a_new_version_goes_into_metadata_resource_version_only() {
        // Found by the `watch_event` fuzz target: unstructured objects have sorted keys, so
        // a `"resourceVersion"` inside managedFields (or labels, annotations) came first
        // and was the one rewritten. An escaped key or value was not found at all.
        let raw = br#"{"metadata":{"managedFields":[{"resourceVersion":"5"}],"name":"a","resourceVersion":"5"}}"#;
        let moved = Obj::parse(raw).unwrap().at_version(6);
        assert_eq!(
            &moved[..],
            br#"{"metadata":{"managedFields":[{"resourceVersion":"5"}],"name":"a","resourceVersion":"6"}}"#
        );
        let raw = br#"{"metadata":{"name":"a","resourceVers\u0069on":"\u0035"}}"#;
        let moved = Obj::parse(raw).unwrap().at_version(6);
        let value: serde_json::Value = serde_json::from_slice(&moved).unwrap();
        assert_eq!(value["metadata"]["resourceVersion"], "6");
    }
}
