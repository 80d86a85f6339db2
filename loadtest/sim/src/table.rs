//! Alternative representations negotiated through `Accept`: `as=Table` (what kubectl get
//! asks for), `as=PartialObjectMetadata` and `as=PartialObjectMetadataList` (metadata-only
//! informers), for GET and LIST.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::discovery::ResourceDef;
use crate::store::Obj;

/// What the client asked the body to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum As {
    /// The object or list itself.
    Plain,
    /// A `meta.k8s.io` Table.
    Table,
    /// PartialObjectMetadata / PartialObjectMetadataList.
    Metadata,
}

/// The representation to answer with, from the first acceptable `Accept` entry; `None` when
/// nothing offered is something the simulator can produce (406).
pub fn negotiate(accept: Option<&str>) -> Option<As> {
    let Some(accept) = accept.filter(|a| !a.trim().is_empty()) else {
        return Some(As::Plain);
    };
    for entry in accept.split(',') {
        let mut parts = entry.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default();
        if media != "application/json" && media != "*/*" && media != "application/*" {
            continue;
        }
        let params: Vec<(&str, &str)> = parts.filter_map(|p| p.split_once('=')).collect();
        let get = |k: &str| params.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
        match get("as") {
            None => return Some(As::Plain),
            Some("Table") if get("g") == Some("meta.k8s.io") => return Some(As::Table),
            Some("PartialObjectMetadata" | "PartialObjectMetadataList")
                if get("g") == Some("meta.k8s.io") =>
            {
                return Some(As::Metadata);
            }
            _ => continue,
        }
    }
    None
}

fn metadata_of(o: &Obj) -> (Value, Value) {
    let v: Value = serde_json::from_slice(&o.body).unwrap_or(Value::Null);
    (v.get("metadata").cloned().unwrap_or(json!({})), v)
}

fn partial(meta: Value) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta})
}

/// `kubectl`-style age: 45s, 3m12s, 5h, 3d.
fn age(ts: &str) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let then = parse_ts(ts).unwrap_or(now);
    let s = now.saturating_sub(then);
    match s {
        0..120 => format!("{s}s"),
        120..600 => format!("{}m{}s", s / 60, s % 60),
        600..10_800 => format!("{}m", s / 60),
        10_800..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

fn parse_ts(ts: &str) -> Option<u64> {
    let b = ts.as_bytes();
    if b.len() < 19 {
        return None;
    }
    let n = |r: std::ops::Range<usize>| ts.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (hh, mm, ss) = (n(11..13)?, n(14..16)?, n(17..19)?);
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + hh * 3600 + mm * 60 + ss).ok()
}

fn column(name: &str, ty: &str, format: &str, description: &str) -> Value {
    json!({"name": name, "type": ty, "format": format, "description": description, "priority": 0})
}

/// The columns and cells the apiserver's printers give a kind.
fn columns(def: &ResourceDef) -> Vec<Value> {
    let name = column(
        "Name",
        "string",
        "name",
        "Name must be unique within a namespace.",
    );
    let age = column(
        "Age",
        "string",
        "",
        "CreationTimestamp is a timestamp representing the server time when this object was created.",
    );
    match def.kind {
        "Secret" => vec![
            name,
            column(
                "Type",
                "string",
                "",
                "Used to facilitate programmatic handling of secret data.",
            ),
            column("Data", "string", "", "Data contains the secret data."),
            age,
        ],
        "ConfigMap" => vec![
            name,
            column(
                "Data",
                "string",
                "",
                "Data contains the configuration data.",
            ),
            age,
        ],
        "Namespace" => vec![
            name,
            column("Status", "string", "", "The status of the namespace"),
            age,
        ],
        _ => vec![name, age],
    }
}

fn cells(def: &ResourceDef, meta: &Value, full: &Value) -> Vec<Value> {
    let name = meta.get("name").cloned().unwrap_or(json!(""));
    let age = json!(age(meta
        .get("creationTimestamp")
        .and_then(Value::as_str)
        .unwrap_or_default()));
    let count = |k: &str| {
        full.get(k)
            .and_then(Value::as_object)
            .map_or(0, |m| m.len())
    };
    match def.kind {
        "Secret" => vec![
            name,
            full.get("type").cloned().unwrap_or(json!("Opaque")),
            json!(count("data")),
            age,
        ],
        "ConfigMap" => vec![name, json!(count("data") + count("binaryData")), age],
        "Namespace" => vec![
            name,
            full.pointer("/status/phase")
                .cloned()
                .unwrap_or(json!("Active")),
            age,
        ],
        _ => vec![name, age],
    }
}

/// A Table of these objects.
pub fn table(def: &ResourceDef, rv: Option<u64>, list_meta: Value, objs: &[&Arc<Obj>]) -> Value {
    let rows: Vec<Value> = objs
        .iter()
        .map(|o| {
            let (meta, full) = metadata_of(o);
            json!({"cells": cells(def, &meta, &full), "object": partial(meta)})
        })
        .collect();
    let mut metadata = list_meta;
    if let Some(rv) = rv {
        metadata["resourceVersion"] = json!(rv.to_string());
    }
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata, "columnDefinitions": columns(def), "rows": rows})
}

/// A PartialObjectMetadata of one object.
pub fn metadata_object(o: &Obj) -> Value {
    partial(metadata_of(o).0)
}

/// A PartialObjectMetadataList of these objects, with the list's metadata.
pub fn metadata_list(list_meta: Value, objs: &[&Arc<Obj>]) -> Value {
    let items: Vec<Value> = objs.iter().map(|o| partial(metadata_of(o).0)).collect();
    json!({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta, "items": items})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_picks_the_first_supported_entry() {
        let kubectl = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
        assert_eq!(negotiate(Some(kubectl)), Some(As::Table));
        assert_eq!(
            negotiate(Some(
                "application/vnd.kubernetes.protobuf, application/json"
            )),
            Some(As::Plain)
        );
        assert_eq!(
            negotiate(Some(
                "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
            )),
            Some(As::Metadata)
        );
        assert_eq!(negotiate(Some("application/vnd.kubernetes.protobuf")), None);
        assert_eq!(negotiate(None), Some(As::Plain));
    }

    #[test]
    fn timestamps_parse() {
        assert_eq!(parse_ts("1970-01-02T00:00:01Z"), Some(86_401));
        assert_eq!(parse_ts("2026-06-15T04:14:53Z"), Some(1_781_496_893));
    }
}
