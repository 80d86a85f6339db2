//! The shared "etcd": every object of every resource, one global resourceVersion counter
//! (the etcd revision), a bounded ring of recent events (the watch-cache window) and a
//! broadcast of new events to open watches. Objects are kept pre-encoded as `Bytes`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use apimachinery::continue_token::{Scope, object_key};
use bytes::{BufMut, Bytes, BytesMut};
use serde_json::{Map, Value, json};
use tokio::sync::{broadcast, watch};

use crate::discovery::{self, ResourceDef};

/// Why a store operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum StoreError {
    /// The resource is not one the simulator serves.
    #[error("unknown resource {0}")]
    UnknownResource(String),
    /// No such object.
    #[error("{resource} \"{name}\" not found")]
    NotFound {
        /// Store key of the resource.
        resource: String,
        /// Object name.
        name: String,
    },
    /// Create of an existing object.
    #[error("{resource} \"{name}\" already exists")]
    AlreadyExists {
        /// Store key of the resource.
        resource: String,
        /// Object name.
        name: String,
    },
    /// Update with a stale resourceVersion.
    #[error("conflict on {resource} \"{name}\"")]
    Conflict {
        /// Store key of the resource.
        resource: String,
        /// Object name.
        name: String,
    },
    /// The object is malformed; `field` and `detail` as in a 422 cause.
    #[error("{field}: {detail}")]
    Invalid {
        /// Object name (may be empty).
        name: String,
        /// The offending field path.
        field: String,
        /// The cause reason (`FieldValueRequired`, `FieldValueInvalid`).
        reason: &'static str,
        /// The message.
        detail: String,
    },
    /// The requested history is older than the retained ring.
    #[error("resource version {requested} is older than the retained history ({oldest})")]
    Expired {
        /// The requested version.
        requested: u64,
        /// The oldest version still served.
        oldest: u64,
    },
}

/// One stored object: pre-encoded JSON without `kind`/`apiVersion` (the LIST item form) and
/// the fields selectors need.
#[derive(Debug)]
pub struct Obj {
    /// Namespace ("" for cluster-scoped).
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The resourceVersion it was written at.
    pub rv: u64,
    /// metadata.uid.
    pub uid: String,
    /// metadata.labels.
    pub labels: BTreeMap<String, String>,
    /// `{"metadata":…,…}` without kind and apiVersion.
    pub body: Bytes,
}

impl Obj {
    /// The object with `kind` and `apiVersion` first, as GET and watch events carry it.
    pub fn with_kind(&self, def: &ResourceDef) -> Bytes {
        let prefix = format!(
            "{{\"kind\":\"{}\",\"apiVersion\":\"{}\",",
            def.kind,
            def.api_version()
        );
        let mut b = BytesMut::with_capacity(prefix.len() + self.body.len());
        b.put_slice(prefix.as_bytes());
        b.put_slice(&self.body[1..]);
        b.freeze()
    }

    /// The same object stamped with another resourceVersion (what a watch sends for an
    /// object that left its selector: the previous state at the change's revision).
    pub fn with_rv(&self, rv: u64) -> Obj {
        // metadata is written first and resourceVersion before any user-controlled map, and
        // quotes inside string values are escaped, so the first match is the real field.
        let old = format!("\"resourceVersion\":\"{}\"", self.rv);
        let text = String::from_utf8_lossy(&self.body);
        let body = text.replacen(&old, &format!("\"resourceVersion\":\"{rv}\""), 1);
        Obj {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            rv,
            uid: self.uid.clone(),
            labels: self.labels.clone(),
            body: Bytes::from(body),
        }
    }

    /// The decoded object with kind and apiVersion.
    pub fn to_value(&self, def: &ResourceDef) -> Value {
        serde_json::from_slice(&self.with_kind(def)).unwrap_or(Value::Null)
    }
}

pub use apimachinery::watch::EventType;

/// One change, as kept in the ring and sent to watches.
#[derive(Debug)]
pub struct Event {
    /// The revision of the change.
    pub rv: u64,
    /// What happened.
    pub kind: EventType,
    /// Store key of the resource.
    pub resource: String,
    /// The object after the change (for a delete: the deleted object at the delete's rv).
    pub obj: Arc<Obj>,
    /// The object before the change, so a selector watch can tell an object that left it.
    pub prev: Option<Arc<Obj>>,
    /// The encoded watch line of this event as it happened, built once and shared by every
    /// watcher that sends it unchanged.
    pub line: std::sync::OnceLock<Bytes>,
}

/// Where a watch starts.
#[derive(Clone, Copy, Debug)]
pub enum WatchFrom {
    /// Current state as synthetic ADDED events, then changes.
    Now,
    /// Changes after this revision.
    After(u64),
}

/// What a new watch gets: initial objects, backlog from the ring, and the live feed.
pub struct WatchStart {
    /// Objects to send as synthetic ADDED (empty when starting from a revision).
    pub initial: Vec<Arc<Obj>>,
    /// Events after the requested revision that are already in the ring.
    pub backlog: Vec<Arc<Event>>,
    /// New events.
    pub rx: broadcast::Receiver<Arc<Event>>,
    /// The store revision at subscription.
    pub rv: u64,
}

/// A `RESOURCE=COUNTxSIZE[@ns,ns…]` seed: objects created before the fleet starts.
#[derive(Clone, Debug, PartialEq)]
pub struct Seed {
    /// Store key, e.g. `secrets` or `endpointslices.discovery.k8s.io`.
    pub resource: String,
    /// How many objects.
    pub count: usize,
    /// Approximate encoded size of each object in bytes.
    pub size: usize,
    /// Namespaces to spread over (round robin); defaults to `ns-0`…`ns-9`.
    pub namespaces: Vec<String>,
}

impl Seed {
    /// Object `i` of the seed as the fleet stores it: its namespace (empty when
    /// cluster-scoped), name and JSON, for seeding the same objects elsewhere (a real
    /// control plane).
    pub fn object(&self, i: usize) -> Result<(String, String, Value), StoreError> {
        let def = def_of(&self.resource)?;
        let ns = if def.namespaced && !self.namespaces.is_empty() {
            self.namespaces[i % self.namespaces.len()].clone()
        } else {
            String::new()
        };
        let name = format!("{}-{i}", def.singular);
        let object = seed_object(def, &ns, &name, i, self.size);
        Ok((ns, name, object))
    }
}

/// A seed string that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("bad seed {0:?}: expected RESOURCE=COUNTxSIZE[@ns,…], e.g. secrets=5000x10KiB")]
pub struct SeedError(String);

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("KiB") {
        (n, 1024)
    } else if let Some(n) = s.strip_suffix("MiB") {
        (n, 1024 * 1024)
    } else if let Some(n) = s.strip_suffix("KB") {
        (n, 1000)
    } else if let Some(n) = s.strip_suffix('B') {
        (n, 1)
    } else {
        (s, 1)
    };
    num.trim().parse::<usize>().ok().map(|n| n * mult)
}

impl FromStr for Seed {
    type Err = SeedError;
    fn from_str(s: &str) -> Result<Seed, SeedError> {
        let err = || SeedError(s.to_string());
        let (res, rest) = s.split_once('=').ok_or_else(err)?;
        let (spec, nss) = match rest.split_once('@') {
            Some((a, b)) => (a, b.split(',').map(|n| n.trim().to_string()).collect()),
            None => (rest, (0..10).map(|i| format!("ns-{i}")).collect()),
        };
        let (count, size) = spec.split_once('x').ok_or_else(err)?;
        let count = count.trim().parse().map_err(|_| err())?;
        let size = parse_size(size).ok_or_else(err)?;
        let def = discovery::by_key(res.trim())
            .or_else(|| {
                discovery::RESOURCES
                    .iter()
                    .find(|d| d.resource == res.trim())
            })
            .filter(|d| d.stored())
            .ok_or_else(err)?;
        Ok(Seed {
            resource: def.key(),
            count,
            size,
            namespaces: nss,
        })
    }
}

struct Inner {
    rv: u64,
    /// Per resource, objects by their etcd key after the resource's prefix
    /// ([`object_key`]): the apiserver's LIST order.
    tables: HashMap<String, BTreeMap<String, Arc<Obj>>>,
    ring: VecDeque<Arc<Event>>,
    ring_cap: usize,
    /// Highest revision whose events may have been dropped: history after it is complete.
    floor: u64,
    live_bytes: u64,
}

/// The shared object store of a fleet.
pub struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Event>>,
    rv_tx: watch::Sender<u64>,
    writes: AtomicU64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("rv", &self.resource_version())
            .finish()
    }
}

/// Now as RFC 3339 seconds (`2026-06-15T04:14:53Z`).
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A random RFC 4122 version 4 UUID.
pub fn new_uid() -> String {
    let b: [u8; 16] = rand::random();
    let h = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut s = format!("{}-{}-4{}-", h(0..4), h(4..6), &h(6..8)[1..]);
    s.push_str(&format!(
        "{:x}{}-{}",
        8 | (b[8] & 0x3),
        &h(8..10)[1..],
        h(10..16)
    ));
    s
}

fn random_suffix() -> String {
    const ALPHA: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHA[rand::random_range(0..ALPHA.len())] as char)
        .collect()
}

const META_ORDER: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
];

/// Writes `map` as JSON with `order`'s keys first (in that order), then the rest, then
/// `last` — the field order the apiserver's Go structs give.
fn write_ordered(out: &mut Vec<u8>, map: &Map<String, Value>, order: &[&str], last: &[&str]) {
    out.push(b'{');
    let mut first = true;
    let mut put = |out: &mut Vec<u8>, k: &str, v: &Value| {
        if !first {
            out.push(b',');
        }
        first = false;
        // Encoding a String/Value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, k);
        out.push(b':');
        let _ = serde_json::to_writer(&mut *out, v);
    };
    for k in order {
        if let Some(v) = map.get(*k) {
            put(out, k, v);
        }
    }
    for (k, v) in map {
        if !order.contains(&k.as_str()) && !last.contains(&k.as_str()) {
            put(out, k, v);
        }
    }
    for k in last {
        if let Some(v) = map.get(*k) {
            put(out, k, v);
        }
    }
    out.push(b'}');
}

/// Encodes a complete object (metadata filled in) into its stored form; at `rv` 0 (a
/// dry-run create, never stored) without a resourceVersion, as the apiserver answers one.
fn encode(mut v: Map<String, Value>, rv: u64) -> Obj {
    v.remove("kind");
    v.remove("apiVersion");
    let meta = match v.remove("metadata") {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    let mut meta = meta;
    if rv == 0 {
        meta.remove("resourceVersion");
    } else {
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
    }
    let s = |k: &str| {
        meta.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let (namespace, name, uid) = (s("namespace"), s("name"), s("uid"));
    let labels = meta
        .get("labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"metadata\":");
    write_ordered(&mut out, &meta, META_ORDER, &[]);
    if !v.is_empty() {
        let mut rest = Vec::new();
        write_ordered(
            &mut rest,
            &v,
            &["spec", "data", "binaryData", "stringData", "type"],
            &["status"],
        );
        if rest.len() > 2 {
            out.push(b',');
            out.extend_from_slice(&rest[1..rest.len() - 1]);
        }
    }
    out.push(b'}');
    Obj {
        namespace,
        name,
        rv,
        uid,
        labels,
        body: Bytes::from(out),
    }
}

fn as_object(v: Value, name_hint: &str) -> Result<Map<String, Value>, StoreError> {
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(StoreError::Invalid {
            name: name_hint.to_string(),
            field: "<body>".into(),
            reason: "FieldValueInvalid",
            detail: "Invalid value: the object must be a JSON object".into(),
        }),
    }
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// RFC 6902 JSON patch (add, remove, replace, test, copy, move).
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops.as_array().ok_or("a JSON patch must be an array")?;
    for op in ops {
        let kind = op.get("op").and_then(Value::as_str).ok_or("missing op")?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or("missing path")?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| format!("missing value for {kind}"))
        };
        match kind {
            "add" => pointer_set(target, path, value()?, true)?,
            "replace" => {
                target
                    .pointer(path)
                    .ok_or_else(|| format!("path {path} not found"))?;
                pointer_set(target, path, value()?, false)?
            }
            "remove" => {
                pointer_remove(target, path)?;
            }
            "test" => {
                if target.pointer(path) != Some(&value()?) {
                    return Err(format!("test failed at {path}"));
                }
            }
            "copy" | "move" => {
                let from = op
                    .get("from")
                    .and_then(Value::as_str)
                    .ok_or("missing from")?;
                let v = target
                    .pointer(from)
                    .cloned()
                    .ok_or_else(|| format!("path {from} not found"))?;
                if kind == "move" {
                    pointer_remove(target, from)?;
                }
                pointer_set(target, path, v, true)?
            }
            other => return Err(format!("unknown op {other}")),
        }
    }
    Ok(())
}

fn unescape(t: &str) -> String {
    t.replace("~1", "/").replace("~0", "~")
}

fn split_pointer(path: &str) -> Result<(&str, String), String> {
    let i = path.rfind('/').ok_or_else(|| format!("bad path {path}"))?;
    Ok((&path[..i], unescape(&path[i + 1..])))
}

fn pointer_set(target: &mut Value, path: &str, v: Value, insert: bool) -> Result<(), String> {
    if path.is_empty() {
        *target = v;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    match target.pointer_mut(parent) {
        Some(Value::Object(m)) => {
            m.insert(last, v);
            Ok(())
        }
        Some(Value::Array(a)) => {
            if last == "-" {
                a.push(v);
                return Ok(());
            }
            let i: usize = last.parse().map_err(|_| format!("bad index {last}"))?;
            if insert && i <= a.len() {
                a.insert(i, v);
            } else if !insert && i < a.len() {
                a[i] = v;
            } else {
                return Err(format!("index {i} out of range"));
            }
            Ok(())
        }
        _ => Err(format!("path {parent} not found")),
    }
}

fn pointer_remove(target: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, last) = split_pointer(path)?;
    match target.pointer_mut(parent) {
        Some(Value::Object(m)) => m
            .remove(&last)
            .ok_or_else(|| format!("path {path} not found")),
        Some(Value::Array(a)) => {
            let i: usize = last.parse().map_err(|_| format!("bad index {last}"))?;
            if i < a.len() {
                Ok(a.remove(i))
            } else {
                Err(format!("index {i} out of range"))
            }
        }
        _ => Err(format!("path {parent} not found")),
    }
}

fn def_of(resource: &str) -> Result<&'static ResourceDef, StoreError> {
    discovery::by_key(resource)
        .filter(|d| d.stored())
        .ok_or_else(|| StoreError::UnknownResource(resource.to_string()))
}

fn meta_str<'a>(v: &'a Map<String, Value>, k: &str) -> Option<&'a str> {
    v.get("metadata")
        .and_then(|m| m.get(k))
        .and_then(Value::as_str)
}

impl Store {
    /// An empty store whose ring keeps `event_ring` events.
    pub fn new(event_ring: usize) -> Store {
        let (tx, _) = broadcast::channel(event_ring.clamp(1024, 65_536));
        let (rv_tx, _) = watch::channel(1);
        Store {
            inner: Mutex::new(Inner {
                rv: 1,
                tables: HashMap::new(),
                ring: VecDeque::new(),
                ring_cap: event_ring.max(1),
                floor: 1,
                live_bytes: 0,
            }),
            tx,
            rv_tx,
            writes: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the maps consistent (every mutation is a
        // single insert/remove), so a poisoned lock is still safe to use.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current revision.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Creates, updates, patches and deletes applied so far (seeding excluded).
    pub fn applied_writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Encoded bytes of every live object.
    pub fn live_bytes(&self) -> u64 {
        self.lock().live_bytes
    }

    /// The oldest revision a watch can still start after.
    pub fn oldest_watchable(&self) -> u64 {
        self.lock().floor
    }

    /// Number of objects of a resource.
    pub fn len(&self, resource: &str) -> usize {
        self.lock().tables.get(resource).map_or(0, BTreeMap::len)
    }

    /// Waits until the store reaches `rv`, at most `timeout`; true when reached.
    pub async fn wait_for(&self, rv: u64, timeout: Duration) -> bool {
        let mut rx = self.rv_tx.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|cur| *cur >= rv))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The stored object.
    pub fn get_obj(&self, resource: &str, namespace: &str, name: &str) -> Option<Arc<Obj>> {
        self.lock()
            .tables
            .get(resource)?
            .get(&object_key(namespace, name))
            .cloned()
    }

    /// The object as a GET returns it (with kind and apiVersion).
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let def = def_of(resource).ok()?;
        self.get_obj(resource, namespace, name)
            .map(|o| o.to_value(def))
    }

    fn commit(
        &self,
        g: &mut Inner,
        kind: EventType,
        resource: &str,
        obj: Arc<Obj>,
        prev: Option<Arc<Obj>>,
    ) {
        let key = object_key(&obj.namespace, &obj.name);
        let table = g.tables.entry(resource.to_string()).or_default();
        let old_len = prev.as_ref().map_or(0, |p| p.body.len() as u64);
        if kind == EventType::Deleted {
            table.remove(&key);
            g.live_bytes = g.live_bytes.saturating_sub(old_len);
        } else {
            table.insert(key, obj.clone());
            g.live_bytes = g.live_bytes.saturating_sub(old_len) + obj.body.len() as u64;
        }
        let ev = Arc::new(Event {
            rv: g.rv,
            kind,
            resource: resource.to_string(),
            obj,
            prev,
            line: std::sync::OnceLock::new(),
        });
        g.ring.push_back(ev.clone());
        while g.ring.len() > g.ring_cap {
            if let Some(old) = g.ring.pop_front() {
                g.floor = old.rv;
            }
        }
        // No receivers is fine: nobody is watching.
        let _ = self.tx.send(ev);
        self.rv_tx.send_replace(g.rv);
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Creates an object (JSON in, with or without kind/apiVersion) in `namespace` (ignored
    /// for cluster-scoped resources); returns the stored object.
    pub fn create(&self, resource: &str, namespace: &str, obj: Value) -> Result<Value, StoreError> {
        let def = def_of(resource)?;
        let o = self.create_obj(def, namespace, obj, false)?;
        Ok(o.to_value(def))
    }

    /// As [`Store::create`], returning the stored object. A `dry_run` checks and answers
    /// as the create would, without a resourceVersion, and stores nothing.
    pub fn create_obj(
        &self,
        def: &ResourceDef,
        namespace: &str,
        obj: Value,
        dry_run: bool,
    ) -> Result<Arc<Obj>, StoreError> {
        let mut v = as_object(obj, "")?;
        let meta = v.entry("metadata").or_insert_with(|| json!({}));
        if !meta.is_object() {
            *meta = json!({});
        }
        let Some(m) = meta.as_object_mut() else {
            unreachable!("just made an object")
        };
        let mut name = m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if name.is_empty() {
            match m.get("generateName").and_then(Value::as_str) {
                Some(g) if !g.is_empty() => name = format!("{g}{}", random_suffix()),
                _ => {
                    return Err(StoreError::Invalid {
                        name: String::new(),
                        field: "metadata.name".into(),
                        reason: "FieldValueRequired",
                        detail: "Required value: name or generateName is required".into(),
                    });
                }
            }
        }
        if let Some(bad) = invalid_name(&name) {
            return Err(StoreError::Invalid {
                name: name.clone(),
                field: "metadata.name".into(),
                reason: "FieldValueInvalid",
                detail: format!("Invalid value: \"{name}\": {bad}"),
            });
        }
        m.insert("name".into(), json!(name));
        if def.namespaced {
            m.insert("namespace".into(), json!(namespace));
        } else {
            m.remove("namespace");
        }
        m.insert("uid".into(), json!(new_uid()));
        m.insert("creationTimestamp".into(), json!(now_rfc3339()));
        m.remove("resourceVersion");
        apply_defaults(def, &mut v);
        let ns = if def.namespaced { namespace } else { "" };
        let mut g = self.lock();
        let key = object_key(ns, &name);
        if g.tables
            .get(&def.key())
            .is_some_and(|t| t.contains_key(&key))
        {
            return Err(StoreError::AlreadyExists {
                resource: def.key(),
                name,
            });
        }
        if dry_run {
            return Ok(Arc::new(encode(v, 0)));
        }
        g.rv += 1;
        let obj = Arc::new(encode(v, g.rv));
        self.commit(&mut g, EventType::Added, &def.key(), obj.clone(), None);
        Ok(obj)
    }

    /// Replaces an object (PUT). A `metadata.resourceVersion` in the body must match the
    /// stored one (else `Conflict`); without it the update is unconditional.
    pub fn update(&self, resource: &str, namespace: &str, obj: Value) -> Result<Value, StoreError> {
        let def = def_of(resource)?;
        let o = self.update_obj(def, namespace, None, obj, false)?;
        Ok(o.to_value(def))
    }

    /// As [`Store::update`]; `path_name` (from the URL) must match the body's name. A
    /// `dry_run` answers the object as it would be stored, at its current resourceVersion,
    /// and stores nothing.
    pub fn update_obj(
        &self,
        def: &ResourceDef,
        namespace: &str,
        path_name: Option<&str>,
        obj: Value,
        dry_run: bool,
    ) -> Result<Arc<Obj>, StoreError> {
        let mut v = as_object(obj, path_name.unwrap_or_default())?;
        apply_defaults(def, &mut v);
        let name = meta_str(&v, "name").unwrap_or_default().to_string();
        if let Some(p) = path_name
            && p != name
        {
            return Err(StoreError::Invalid {
                name: p.to_string(),
                field: "metadata.name".into(),
                reason: "FieldValueInvalid",
                detail: format!("Invalid value: \"{name}\": field is immutable"),
            });
        }
        let want_rv = meta_str(&v, "resourceVersion").map(str::to_string);
        self.replace(def, namespace, &name, want_rv.as_deref(), dry_run, |_| {
            Ok(Value::Object(v))
        })
    }

    /// Applies a JSON merge patch (strategic merge is treated the same).
    pub fn patch(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
        patch: &Value,
    ) -> Result<Value, StoreError> {
        let def = def_of(resource)?;
        let o = self.patch_obj(def, namespace, name, PatchKind::Merge, patch, false)?;
        Ok(o.to_value(def))
    }

    /// Applies a merge or JSON patch to the stored object (only to the answer when
    /// `dry_run`, as [`Store::update_obj`]).
    pub fn patch_obj(
        &self,
        def: &ResourceDef,
        namespace: &str,
        name: &str,
        kind: PatchKind,
        patch: &Value,
        dry_run: bool,
    ) -> Result<Arc<Obj>, StoreError> {
        let want_rv = patch
            .get("metadata")
            .and_then(|m| m.get("resourceVersion"))
            .and_then(Value::as_str)
            .map(str::to_string);
        self.replace(def, namespace, name, want_rv.as_deref(), dry_run, |old| {
            let mut cur = old;
            match kind {
                PatchKind::Merge => merge_patch(&mut cur, patch),
                PatchKind::Json => {
                    json_patch(&mut cur, patch).map_err(|e| StoreError::Invalid {
                        name: name.to_string(),
                        field: "<patch>".into(),
                        reason: "FieldValueInvalid",
                        detail: e,
                    })?
                }
            }
            Ok(cur)
        })
    }

    /// Read-modify-write under the lock; identity fields are kept, no-op writes skipped.
    fn replace(
        &self,
        def: &ResourceDef,
        namespace: &str,
        name: &str,
        want_rv: Option<&str>,
        dry_run: bool,
        f: impl FnOnce(Value) -> Result<Value, StoreError>,
    ) -> Result<Arc<Obj>, StoreError> {
        let ns = if def.namespaced { namespace } else { "" };
        let rk = def.key();
        let mut g = self.lock();
        let key = object_key(ns, name);
        let old = g
            .tables
            .get(&rk)
            .and_then(|t| t.get(&key))
            .cloned()
            .ok_or_else(|| StoreError::NotFound {
                resource: rk.clone(),
                name: name.to_string(),
            })?;
        if let Some(w) = want_rv
            && !w.is_empty()
            && w != old.rv.to_string()
        {
            return Err(StoreError::Conflict {
                resource: rk,
                name: name.to_string(),
            });
        }
        let old_v: Value = serde_json::from_slice(&old.body).unwrap_or(Value::Null);
        let new_v = as_object(f(old_v.clone())?, name)?;
        let mut new_v = new_v;
        let meta = new_v.entry("metadata").or_insert_with(|| json!({}));
        if let (Some(m), Some(om)) = (meta.as_object_mut(), old_v.get("metadata")) {
            for k in ["name", "namespace", "uid", "creationTimestamp"] {
                match om.get(k) {
                    Some(v) => m.insert(k.into(), v.clone()),
                    None => m.remove(k),
                };
            }
        }
        let same = encode(new_v.clone(), old.rv);
        if same.body == old.body {
            return Ok(old);
        }
        if dry_run {
            return Ok(Arc::new(same));
        }
        g.rv += 1;
        let obj = Arc::new(encode(new_v, g.rv));
        self.commit(&mut g, EventType::Modified, &rk, obj.clone(), Some(old));
        Ok(obj)
    }

    /// Deletes an object and returns it as last stored.
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Result<Value, StoreError> {
        let def = def_of(resource)?;
        let o = self.delete_obj(def, namespace, name, None, false)?;
        Ok(o.to_value(def))
    }

    /// Deletes an object, with an optional resourceVersion precondition; returns the
    /// deleted object at the delete's revision. A `dry_run` checks the same and returns the
    /// object as stored, deleting nothing.
    pub fn delete_obj(
        &self,
        def: &ResourceDef,
        namespace: &str,
        name: &str,
        want_rv: Option<&str>,
        dry_run: bool,
    ) -> Result<Arc<Obj>, StoreError> {
        let ns = if def.namespaced { namespace } else { "" };
        let rk = def.key();
        let mut g = self.lock();
        let key = object_key(ns, name);
        let old = g
            .tables
            .get(&rk)
            .and_then(|t| t.get(&key))
            .cloned()
            .ok_or_else(|| StoreError::NotFound {
                resource: rk.clone(),
                name: name.to_string(),
            })?;
        if let Some(w) = want_rv
            && !w.is_empty()
            && w != old.rv.to_string()
        {
            return Err(StoreError::Conflict {
                resource: rk,
                name: name.to_string(),
            });
        }
        if dry_run {
            return Ok(old);
        }
        g.rv += 1;
        let v = serde_json::from_slice::<Value>(&old.body)
            .ok()
            .and_then(|v| as_object(v, name).ok())
            .unwrap_or_default();
        let obj = Arc::new(encode(v, g.rv));
        self.commit(&mut g, EventType::Deleted, &rk, obj.clone(), Some(old));
        Ok(obj)
    }

    /// Every object of a resource in `namespace` (or all namespaces when `None`) in the
    /// apiserver's key order, as of revision `at` (current when `None`), and that revision.
    /// History older than the ring is `Expired`.
    pub fn list(
        &self,
        resource: &str,
        namespace: Option<&str>,
        at: Option<u64>,
    ) -> Result<(u64, Vec<Arc<Obj>>), StoreError> {
        let g = self.lock();
        let in_scope = |ns: &str| namespace.is_none_or(|n| n == ns);
        let mut items: BTreeMap<String, Arc<Obj>> = match g.tables.get(resource) {
            None => BTreeMap::new(),
            Some(t) => t
                .range::<String, _>(Scope::of(namespace).range())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        let rv = match at {
            None => g.rv,
            Some(at) if at >= g.rv => g.rv,
            Some(at) if at < g.floor => {
                return Err(StoreError::Expired {
                    requested: at,
                    oldest: g.floor,
                });
            }
            Some(at) => {
                // Roll the newer changes back, newest first.
                for ev in g.ring.iter().rev().take_while(|e| e.rv > at) {
                    if ev.resource != resource || !in_scope(&ev.obj.namespace) {
                        continue;
                    }
                    let key = object_key(&ev.obj.namespace, &ev.obj.name);
                    match &ev.prev {
                        Some(p) => items.insert(key, p.clone()),
                        None => items.remove(&key),
                    };
                }
                at
            }
        };
        Ok((rv, items.into_values().collect()))
    }

    /// Encoded bytes of every object of a resource in a scope: what a LIST from etcd reads.
    pub fn scope_bytes(&self, resource: &str, namespace: Option<&str>) -> u64 {
        let g = self.lock();
        let Some(t) = g.tables.get(resource) else {
            return 0;
        };
        t.range::<String, _>(Scope::of(namespace).range())
            .map(|(_, o)| o.body.len() as u64)
            .sum()
    }

    /// Subscribes a watch on a resource (all namespaces; the caller filters).
    pub fn watch(&self, resource: &str, from: WatchFrom) -> Result<WatchStart, StoreError> {
        let g = self.lock();
        let rx = self.tx.subscribe();
        match from {
            WatchFrom::Now => {
                let initial = g
                    .tables
                    .get(resource)
                    .map(|t| t.values().cloned().collect())
                    .unwrap_or_default();
                Ok(WatchStart {
                    initial,
                    backlog: Vec::new(),
                    rx,
                    rv: g.rv,
                })
            }
            WatchFrom::After(rv) => {
                if rv < g.floor {
                    return Err(StoreError::Expired {
                        requested: rv,
                        oldest: g.floor + 1,
                    });
                }
                let backlog = g
                    .ring
                    .iter()
                    .filter(|e| e.rv > rv && e.resource == resource)
                    .cloned()
                    .collect();
                Ok(WatchStart {
                    initial: Vec::new(),
                    backlog,
                    rx,
                    rv: g.rv,
                })
            }
        }
    }

    /// Inserts seed objects directly (no events, no write count), as if they had been
    /// written long ago and compacted away.
    pub fn seed(&self, seed: &Seed) -> Result<(), StoreError> {
        let def = def_of(&seed.resource)?;
        let mut g = self.lock();
        let add = |g: &mut Inner, rk: &str, v: Value| {
            g.rv += 1;
            let Ok(m) = as_object(v, "") else { return };
            let o = encode(m, g.rv);
            g.live_bytes += o.body.len() as u64;
            g.tables
                .entry(rk.to_string())
                .or_default()
                .insert(object_key(&o.namespace, &o.name), Arc::new(o));
        };
        if def.namespaced {
            for ns in &seed.namespaces {
                let exists = g
                    .tables
                    .get("namespaces")
                    .is_some_and(|t| t.contains_key(ns));
                if !exists {
                    add(
                        &mut g,
                        "namespaces",
                        seed_object(discovery::by_key("namespaces").unwrap_or(def), "", ns, 0, 0),
                    );
                }
            }
        }
        for i in 0..seed.count {
            let ns = if def.namespaced && !seed.namespaces.is_empty() {
                seed.namespaces[i % seed.namespaces.len()].as_str()
            } else {
                ""
            };
            let name = format!("{}-{i}", def.singular);
            add(
                &mut g,
                &def.key(),
                seed_object(def, ns, &name, i, seed.size),
            );
        }
        g.floor = g.rv;
        self.rv_tx.send_replace(g.rv);
        Ok(())
    }
}

/// The apiserver's defaulting for the fields clients commonly leave out.
fn apply_defaults(def: &ResourceDef, v: &mut Map<String, Value>) {
    // Empty maps are not written back (Go's `omitempty`).
    if let Some(Value::Object(m)) = v.get_mut("metadata") {
        for field in ["labels", "annotations"] {
            if m.get(field)
                .is_some_and(|l| l.as_object().is_some_and(Map::is_empty))
            {
                m.remove(field);
            }
        }
    }
    match def.kind {
        "Secret"
            if v.get("type")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty) =>
        {
            v.insert("type".into(), json!("Opaque"));
        }
        "Namespace" => {
            let name = meta_str(v, "name").unwrap_or_default().to_string();
            if let Some(Value::Object(m)) = v.get_mut("metadata") {
                let labels = m.entry("labels").or_insert_with(|| json!({}));
                if let Value::Object(l) = labels {
                    l.insert("kubernetes.io/metadata.name".into(), json!(name));
                }
            }
            v.entry("spec")
                .or_insert_with(|| json!({"finalizers": ["kubernetes"]}));
            v.insert("status".into(), json!({"phase": "Active"}));
        }
        _ => {}
    }
}

/// How a PATCH body is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchKind {
    /// JSON merge patch (also used for strategic merge patch).
    Merge,
    /// RFC 6902 JSON patch.
    Json,
}

/// Why a name is not a valid DNS subdomain, if it is not.
fn invalid_name(name: &str) -> Option<&'static str> {
    let ok = name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    (!ok).then_some("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
}

/// A seed object of roughly `size` encoded bytes.
fn seed_object(def: &ResourceDef, ns: &str, name: &str, i: usize, size: usize) -> Value {
    use base64::Engine;
    let mut meta = json!({
        "name": name, "uid": new_uid(), "creationTimestamp": now_rfc3339(),
        "labels": {"app": format!("sim-{}", i % 10), "seq": i.to_string()},
    });
    if def.namespaced {
        meta["namespace"] = json!(ns);
    }
    let overhead = 200 + name.len() + ns.len();
    let fill = size.saturating_sub(overhead);
    let mut v = json!({"metadata": meta});
    match def.resource {
        "secrets" => {
            let raw: Vec<u8> = (0..fill * 3 / 4).map(|j| (j * 31 + i) as u8).collect();
            v["data"] = json!({"payload": base64::engine::general_purpose::STANDARD.encode(raw)});
            v["type"] = json!("Opaque");
        }
        "configmaps" => v["data"] = json!({"payload": "x".repeat(fill)}),
        "namespaces" => {
            v["spec"] = json!({"finalizers": ["kubernetes"]});
            v["status"] = json!({"phase": "Active"});
            v["metadata"]["labels"] = json!({"kubernetes.io/metadata.name": name});
        }
        "endpointslices" => {
            v["addressType"] = json!("IPv4");
            let n = (fill / 60).max(1);
            v["endpoints"] = json!((0..n).map(|j| json!({"addresses": [format!("10.{}.{}.{}", i % 250, j / 250 % 250, j % 250)], "conditions": {"ready": true}})).collect::<Vec<_>>());
            v["ports"] = json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
        }
        _ => {
            if fill > 0 {
                v["metadata"]["annotations"] = json!({"sim.bulwark.dev/filler": "x".repeat(fill)});
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_parses() {
        let s: Seed = "secrets=5000x10KiB".parse().unwrap();
        assert_eq!(
            (s.resource.as_str(), s.count, s.size, s.namespaces.len()),
            ("secrets", 5000, 10240, 10)
        );
        let s: Seed = "endpointslices=3x1KiB@a,b".parse().unwrap();
        assert_eq!(s.resource, "endpointslices.discovery.k8s.io");
        assert_eq!(s.namespaces, ["a", "b"]);
        assert!("bogus=1x1".parse::<Seed>().is_err());
        assert!("secrets=1".parse::<Seed>().is_err());
    }

    #[test]
    fn seeded_objects_have_roughly_the_asked_size() {
        let st = Store::new(100);
        st.seed(&"secrets=20x10KiB".parse().unwrap()).unwrap();
        let (_, items) = st.list("secrets", None, None).unwrap();
        assert_eq!(items.len(), 20);
        for o in items {
            let n = o.body.len();
            assert!((9_000..11_500).contains(&n), "{n}");
        }
    }

    #[test]
    fn writes_bump_one_global_revision_and_history_rolls_back() {
        let st = Store::new(100);
        let a = st
            .create("secrets", "ns", json!({"metadata": {"name": "a"}}))
            .unwrap();
        let rv_a: u64 = a["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        st.create("configmaps", "ns", json!({"metadata": {"name": "c"}}))
            .unwrap();
        st.patch("secrets", "ns", "a", &json!({"data": {"k": "dg=="}}))
            .unwrap();
        st.create("secrets", "ns", json!({"metadata": {"name": "b"}}))
            .unwrap();
        assert_eq!(st.resource_version(), rv_a + 3);
        let (_, at_a) = st.list("secrets", Some("ns"), Some(rv_a)).unwrap();
        assert_eq!(at_a.len(), 1);
        assert_eq!(at_a[0].rv, rv_a);
        assert_eq!(st.applied_writes(), 4);
        let err = st.update(
            "secrets",
            "ns",
            json!({"metadata": {"name": "a", "resourceVersion": rv_a.to_string()}}),
        );
        assert!(matches!(err, Err(StoreError::Conflict { .. })));
    }

    #[test]
    fn noop_patch_does_not_write() {
        let st = Store::new(100);
        st.create(
            "secrets",
            "ns",
            json!({"metadata": {"name": "a"}, "data": {"k": "dg=="}}),
        )
        .unwrap();
        let rv = st.resource_version();
        st.patch("secrets", "ns", "a", &json!({"data": {"k": "dg=="}}))
            .unwrap();
        assert_eq!(st.resource_version(), rv);
    }

    #[test]
    fn ring_eviction_expires_old_history() {
        let st = Store::new(2);
        for i in 0..5 {
            st.create(
                "secrets",
                "ns",
                json!({"metadata": {"name": format!("s{i}")}}),
            )
            .unwrap();
        }
        assert!(matches!(
            st.list("secrets", None, Some(2)),
            Err(StoreError::Expired { .. })
        ));
        assert!(st.watch("secrets", WatchFrom::After(2)).is_err());
        assert!(
            st.watch("secrets", WatchFrom::After(st.resource_version() - 1))
                .is_ok()
        );
    }

    #[test]
    fn stored_form_puts_metadata_first() {
        let st = Store::new(10);
        let v = st.create("secrets", "ns", json!({"kind": "Secret", "apiVersion": "v1", "type": "Opaque", "data": {}, "metadata": {"name": "x", "labels": {"a": "b"}}})).unwrap();
        let o = st.get_obj("secrets", "ns", "x").unwrap();
        let s = std::str::from_utf8(&o.body).unwrap();
        assert!(
            s.starts_with("{\"metadata\":{\"name\":\"x\",\"namespace\":\"ns\",\"uid\":"),
            "{s}"
        );
        assert_eq!(v["kind"], "Secret");
        assert_eq!(o.labels.get("a").map(String::as_str), Some("b"));
        let uid = new_uid();
        assert_eq!(uid.len(), 36);
        assert_eq!(&uid[14..15], "4");
    }
}
