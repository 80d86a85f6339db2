//! What may differ between two apiservers answering the same request, taken out so that
//! the rest can be compared: resource versions, UIDs, timestamps, managed fields, and the
//! version inside continue tokens (the key they resume from must agree).

use base64::Engine;
use serde_json::Value;

/// A response reduced to what must agree.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub status: u16,
    /// The media type, without parameters other than `as=`, lowercased.
    pub content_type: String,
    pub body: Body,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    Empty,
    Json(Value),
    /// A watch stream: one normalized event per line.
    Events(Vec<Value>),
    /// Anything else, as text.
    Text(String),
}

pub fn shape(status: u16, content_type: Option<&str>, body: &[u8], watch: bool) -> Shape {
    let content_type = content_type
        .map(|ct| {
            ct.split(';')
                .map(|p| p.trim().to_ascii_lowercase())
                .filter(|p| !p.is_empty() && !p.starts_with("charset="))
                .collect::<Vec<_>>()
                .join(";")
        })
        .unwrap_or_default();
    let body = if body.is_empty() {
        Body::Empty
    } else if watch && status == 200 {
        Body::Events(
            body.split(|b| *b == b'\n')
                .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
                .map(|l| {
                    serde_json::from_slice(l)
                        .map(normalize)
                        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(l).into()))
                })
                .collect(),
        )
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(v) => Body::Json(normalize(v)),
            Err(_) => Body::Text(String::from_utf8_lossy(body).trim().to_owned()),
        }
    };
    Shape {
        status,
        content_type,
        body,
    }
}

/// The body reduced to `{pointer: value}` for each of `fields` (`null` where absent), or,
/// when it is not JSON, to its length.
pub fn pick(body: &[u8], fields: &[&str]) -> bytes::Bytes {
    match serde_json::from_slice::<Value>(body) {
        Ok(v) => {
            let picked: serde_json::Map<String, Value> = fields
                .iter()
                .map(|f| {
                    (
                        (*f).to_owned(),
                        v.pointer(f).cloned().unwrap_or(Value::Null),
                    )
                })
                .collect();
            bytes::Bytes::from(Value::Object(picked).to_string())
        }
        Err(_) if body.is_empty() => bytes::Bytes::new(),
        Err(_) => bytes::Bytes::from(format!("{} bytes", body.len())),
    }
}

/// Replaces what legitimately differs between two apiservers with placeholders.
pub fn normalize(mut value: Value) -> Value {
    walk(&mut value);
    value
}

fn walk(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("managedFields");
            for (k, v) in map.iter_mut() {
                match k.as_str() {
                    "resourceVersion" if v.is_string() => *v = Value::from("RV"),
                    "uid" if v.is_string() => *v = Value::from("UID"),
                    "creationTimestamp" | "deletionTimestamp" if v.is_string() => {
                        *v = Value::from("TIME")
                    }
                    "continue" if v.is_string() => *v = continue_start(v.as_str().unwrap_or("")),
                    "message" if v.is_string() => {
                        *v = Value::from(digits_out(v.as_str().unwrap_or("")))
                    }
                    _ => walk(v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(walk),
        _ => {}
    }
}

/// The key a continue token resumes from (its version differs between apiservers), or
/// `"UNREADABLE"` when it is not an apiserver token.
fn continue_start(token: &str) -> Value {
    let decoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .ok()
        .and_then(|raw| serde_json::from_slice::<Value>(&raw).ok());
    match decoded {
        Some(v) => serde_json::json!({
            "v": v["v"],
            "start": v["start"],
            "rv": if v["rv"].as_i64().is_some_and(|rv| rv > 0) { "RV" } else { "NONE" },
            "padded": token.ends_with('='),
        }),
        None => Value::from("UNREADABLE"),
    }
}

/// Digits in messages are versions, times and ports: replaced by `N`.
fn digits_out(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut in_number = false;
    for c in message.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    out
}

/// The first difference between two shapes, as a short path and both values.
pub fn first_difference(real: &Shape, sim: &Shape) -> Option<String> {
    if real.status != sim.status {
        return Some(format!("status {} vs {}", real.status, sim.status));
    }
    if real.content_type != sim.content_type {
        return Some(format!(
            "content-type {:?} vs {:?}",
            real.content_type, sim.content_type
        ));
    }
    match (&real.body, &sim.body) {
        (Body::Json(a), Body::Json(b)) => diff_value("", a, b),
        (Body::Events(a), Body::Events(b)) => {
            if a.len() != b.len() {
                let types = |e: &[Value]| {
                    e.iter()
                        .map(|e| e["type"].as_str().unwrap_or("?").to_owned())
                        .collect::<Vec<_>>()
                        .join(",")
                };
                return Some(format!(
                    "{} events [{}] vs {} [{}]",
                    a.len(),
                    types(a),
                    b.len(),
                    types(b)
                ));
            }
            a.iter()
                .zip(b)
                .enumerate()
                .find_map(|(i, (x, y))| diff_value(&format!("[{i}]"), x, y))
        }
        (a, b) if a == b => None,
        (a, b) => Some(format!("body {} vs {}", brief(a), brief(b))),
    }
}

fn brief(body: &Body) -> String {
    let text = match body {
        Body::Empty => "empty".to_owned(),
        Body::Json(v) => v.to_string(),
        Body::Events(e) => format!("{} events", e.len()),
        Body::Text(t) => t.clone(),
    };
    text.chars().take(160).collect()
}

fn diff_value(path: &str, a: &Value, b: &Value) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => {
                        if let Some(d) = diff_value(&format!("{path}.{k}"), v, w) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{path}.{k}: {} vs missing", short(v))),
                }
            }
            y.keys()
                .find(|k| !x.contains_key(*k))
                .map(|k| format!("{path}.{k}: missing vs {}", short(&y[k])))
        }
        (Value::Array(x), Value::Array(y)) if x.len() != y.len() => {
            Some(format!("{path}: {} items vs {}", x.len(), y.len()))
        }
        (Value::Array(x), Value::Array(y)) => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| diff_value(&format!("{path}[{i}]"), v, w)),
        (x, y) if x == y => None,
        (x, y) => Some(format!("{path}: {} vs {}", short(x), short(y))),
    }
}

fn short(v: &Value) -> String {
    v.to_string().chars().take(120).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_uids_and_token_versions_are_taken_out() {
        let token = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(r#"{"v":"meta.k8s.io/v1","rv":42,"start":"a-1\u0000"}"#);
        let a = shape(
            200,
            Some("application/json"),
            format!(r#"{{"metadata":{{"resourceVersion":"42","continue":"{token}"}},"items":[{{"metadata":{{"uid":"x","resourceVersion":"7"}}}}]}}"#).as_bytes(),
            false,
        );
        let token = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(r#"{"v":"meta.k8s.io/v1","rv":9,"start":"a-1\u0000"}"#);
        let b = shape(
            200,
            Some("application/json"),
            format!(r#"{{"metadata":{{"resourceVersion":"9","continue":"{token}"}},"items":[{{"metadata":{{"uid":"y","resourceVersion":"3"}}}}]}}"#).as_bytes(),
            false,
        );
        assert_eq!(first_difference(&a, &b), None);
        let c = shape(
            200,
            Some("application/json"),
            br#"{"metadata":{"continue":"abc="}}"#,
            false,
        );
        assert!(first_difference(&a, &c).is_some());
    }
}
