//! Just enough of the Kubernetes protobuf encoding to read the request bodies kubectl's
//! typed commands send (`create configmap|secret|namespace`, `auth can-i`, `auth whoami`):
//! the `k8s\0` + `runtime.Unknown` envelope and a few message types, decoded to JSON.
//! Responses stay JSON, which those clients also accept.

use base64::Engine;
use serde_json::{Map, Value, json};

/// The protobuf media type.
pub const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// A body that is not the protobuf the simulator understands.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// Not `k8s\0` + Unknown, or truncated.
    #[error("malformed protobuf body: {0}")]
    Malformed(&'static str),
    /// A kind without a schema here.
    #[error("protobuf bodies of kind {0} are not supported by the simulator; send JSON")]
    Unsupported(String),
}

#[derive(Clone, Copy)]
enum F {
    Str,
    Int,
    Bool,
    MapStr,
    MapBytes,
    RepStr,
    Msg(&'static [Field]),
}

type Field = (u64, &'static str, F);

const TYPE_META: &[Field] = &[(1, "apiVersion", F::Str), (2, "kind", F::Str)];
const TIME: &[Field] = &[(1, "seconds", F::Int), (2, "nanos", F::Int)];
const OBJECT_META: &[Field] = &[
    (1, "name", F::Str),
    (2, "generateName", F::Str),
    (3, "namespace", F::Str),
    (5, "uid", F::Str),
    (6, "resourceVersion", F::Str),
    (7, "generation", F::Int),
    (8, "creationTimestamp", F::Msg(TIME)),
    (11, "labels", F::MapStr),
    (12, "annotations", F::MapStr),
    (14, "finalizers", F::RepStr),
];
const CONFIG_MAP: &[Field] = &[
    (1, "metadata", F::Msg(OBJECT_META)),
    (2, "data", F::MapStr),
    (3, "binaryData", F::MapBytes),
    (4, "immutable", F::Bool),
];
const SECRET: &[Field] = &[
    (1, "metadata", F::Msg(OBJECT_META)),
    (2, "data", F::MapBytes),
    (3, "type", F::Str),
    (4, "stringData", F::MapStr),
    (5, "immutable", F::Bool),
];
const NAMESPACE_SPEC: &[Field] = &[(1, "finalizers", F::RepStr)];
const NAMESPACE: &[Field] = &[
    (1, "metadata", F::Msg(OBJECT_META)),
    (2, "spec", F::Msg(NAMESPACE_SPEC)),
];
const RESOURCE_ATTRS: &[Field] = &[
    (1, "namespace", F::Str),
    (2, "verb", F::Str),
    (3, "group", F::Str),
    (4, "version", F::Str),
    (5, "resource", F::Str),
    (6, "subresource", F::Str),
    (7, "name", F::Str),
];
const NON_RESOURCE_ATTRS: &[Field] = &[(1, "path", F::Str), (2, "verb", F::Str)];
const SSAR_SPEC: &[Field] = &[
    (1, "resourceAttributes", F::Msg(RESOURCE_ATTRS)),
    (2, "nonResourceAttributes", F::Msg(NON_RESOURCE_ATTRS)),
];
const SSAR: &[Field] = &[
    (1, "metadata", F::Msg(OBJECT_META)),
    (2, "spec", F::Msg(SSAR_SPEC)),
];
const SSR: &[Field] = &[(1, "metadata", F::Msg(OBJECT_META))];

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, ProtoError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self
                .b
                .split_first()
                .ok_or(ProtoError::Malformed("truncated varint"))?;
            self.b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(ProtoError::Malformed("varint too long"))
    }

    fn bytes(&mut self) -> Result<&'a [u8], ProtoError> {
        let n = usize::try_from(self.varint()?).map_err(|_| ProtoError::Malformed("length"))?;
        if n > self.b.len() {
            return Err(ProtoError::Malformed("truncated field"));
        }
        let (v, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(v)
    }

    /// Next (field number, wire type), skipping nothing.
    fn key(&mut self) -> Result<Option<(u64, u64)>, ProtoError> {
        if self.b.is_empty() {
            return Ok(None);
        }
        let k = self.varint()?;
        Ok(Some((k >> 3, k & 7)))
    }

    fn skip(&mut self, wire: u64) -> Result<(), ProtoError> {
        match wire {
            0 => self.varint().map(drop),
            1 => self.take(8),
            2 => self.bytes().map(drop),
            5 => self.take(4),
            _ => Err(ProtoError::Malformed("unsupported wire type")),
        }
    }

    fn take(&mut self, n: usize) -> Result<(), ProtoError> {
        if n > self.b.len() {
            return Err(ProtoError::Malformed("truncated fixed field"));
        }
        self.b = &self.b[n..];
        Ok(())
    }
}

fn str_of(b: &[u8]) -> Value {
    Value::String(String::from_utf8_lossy(b).into_owned())
}

/// Decodes a map entry message (key = 1, value = 2).
fn entry(b: &[u8], bytes_value: bool) -> Result<(String, Value), ProtoError> {
    let mut r = Reader { b };
    let (mut k, mut v) = (String::new(), Value::String(String::new()));
    while let Some((n, w)) = r.key()? {
        match (n, w) {
            (1, 2) => k = String::from_utf8_lossy(r.bytes()?).into_owned(),
            (2, 2) => {
                let raw = r.bytes()?;
                v = if bytes_value {
                    json!(base64::engine::general_purpose::STANDARD.encode(raw))
                } else {
                    str_of(raw)
                };
            }
            (_, w) => r.skip(w)?,
        }
    }
    Ok((k, v))
}

fn message(b: &[u8], schema: &'static [Field]) -> Result<Map<String, Value>, ProtoError> {
    let mut r = Reader { b };
    let mut out = Map::new();
    while let Some((n, w)) = r.key()? {
        let Some((_, name, kind)) = schema.iter().find(|f| f.0 == n).copied() else {
            r.skip(w)?;
            continue;
        };
        match (kind, w) {
            (F::Str, 2) => {
                out.insert(name.into(), str_of(r.bytes()?));
            }
            (F::Int, 0) => {
                out.insert(name.into(), json!(r.varint()? as i64));
            }
            (F::Bool, 0) => {
                out.insert(name.into(), json!(r.varint()? != 0));
            }
            (F::MapStr | F::MapBytes, 2) => {
                let (k, v) = entry(r.bytes()?, matches!(kind, F::MapBytes))?;
                if let Value::Object(m) = out.entry(name).or_insert_with(|| json!({})) {
                    m.insert(k, v);
                }
            }
            (F::RepStr, 2) => {
                let s = str_of(r.bytes()?);
                if let Value::Array(a) = out.entry(name).or_insert_with(|| json!([])) {
                    a.push(s);
                }
            }
            (F::Msg(inner), 2) => {
                let m = message(r.bytes()?, inner)?;
                // Times arrive as {seconds, nanos}; servers set them anyway.
                if inner.as_ptr() != TIME.as_ptr() {
                    out.insert(name.into(), Value::Object(m));
                }
            }
            (_, w) => r.skip(w)?,
        }
    }
    Ok(out)
}

/// Decodes a `k8s\0`-prefixed protobuf object into JSON (with kind and apiVersion).
pub fn decode(body: &[u8]) -> Result<Value, ProtoError> {
    let rest = body
        .strip_prefix(b"k8s\0")
        .ok_or(ProtoError::Malformed("missing k8s magic"))?;
    let mut r = Reader { b: rest };
    let (mut tm, mut raw) = (Map::new(), &[][..]);
    while let Some((n, w)) = r.key()? {
        match (n, w) {
            (1, 2) => tm = message(r.bytes()?, TYPE_META)?,
            (2, 2) => raw = r.bytes()?,
            (_, w) => r.skip(w)?,
        }
    }
    let kind = tm
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let schema = match kind.as_str() {
        "ConfigMap" => CONFIG_MAP,
        "Secret" => SECRET,
        "Namespace" => NAMESPACE,
        "SelfSubjectAccessReview" => SSAR,
        "SelfSubjectReview" => SSR,
        _ => return Err(ProtoError::Unsupported(kind)),
    };
    let mut obj = message(raw, schema)?;
    obj.insert("kind".into(), json!(kind));
    if let Some(av) = tm.get("apiVersion") {
        obj.insert("apiVersion".into(), av.clone());
    }
    Ok(Value::Object(obj))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(n: u64, b: &[u8]) -> Vec<u8> {
        let mut v = vec![((n << 3) | 2) as u8, b.len() as u8];
        v.extend_from_slice(b);
        v
    }

    #[test]
    fn decodes_a_configmap_envelope() {
        let meta = [
            field(1, b"foo"),
            field(3, b"default"),
            field(11, &[field(1, b"a"), field(2, b"b")].concat()),
        ]
        .concat();
        let cm = [
            field(1, &meta),
            field(2, &[field(1, b"k"), field(2, b"v")].concat()),
        ]
        .concat();
        let tm = [field(1, b"v1"), field(2, b"ConfigMap")].concat();
        let mut body = b"k8s\0".to_vec();
        body.extend([field(1, &tm), field(2, &cm)].concat());
        let v = decode(&body).unwrap();
        assert_eq!(
            v,
            json!({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "foo", "namespace": "default", "labels": {"a": "b"}}, "data": {"k": "v"}})
        );
        assert!(decode(b"{}").is_err());
        assert!(decode(b"k8s\0\x0a\xff").is_err());
    }
}
