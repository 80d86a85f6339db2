//! One resource's cached state: the objects as raw JSON bytes with their resourceVersion,
//! a ring of recent events that keeps each event's previous object, and the broadcast that
//! fans new events out to open watches.
//!
//! One writer, many readers, in the types (as kube-runtime's `reflector::store`): the
//! informer alone holds the [`Writer`], whose mutations take `&mut self`; requests hold
//! cloneable, read-only [`Store`]s. Readers take the read lock only long enough to clone
//! `Arc`s; a watch subscribes to the broadcast under the same lock that the writer sends
//! under, so its snapshot and its live feed neither overlap nor leave a gap.
//!
//! Objects are keyed by their etcd key after the resource's prefix (`namespace/name`, or
//! `name`), so that lists walk them in the apiserver's order and a page can end where the
//! apiserver would continue it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::{Bound, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use apimachinery::continue_token::{Scope, object_key};
use bytes::{BufMut, Bytes, BytesMut};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use super::accept::Encoding;
use super::protobuf::{self, ProtoKind};
use apimachinery::status::Status;

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
    /// `metadata` (a BOOKMARK carries such an object).
    pub fn zero_fields(&self) -> &'static str {
        match self.kind.as_str() {
            "Pod" => ",\"spec\":{\"containers\":null},\"status\":{}",
            "Namespace" | "Node" | "Service" => ",\"spec\":{},\"status\":{}",
            "Lease" => ",\"spec\":{}",
            "EndpointSlice" => ",\"addressType\":\"\",\"endpoints\":null",
            _ => "",
        }
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
    fn new(rv: u64, kind: EventType, obj: Arc<Obj>, prev: Option<Arc<Obj>>) -> Event {
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

/// Object count and bytes of a scope.
#[derive(Debug, Default, Clone, Copy)]
struct Size {
    count: u64,
    bytes: u64,
}

struct State {
    objects: BTreeMap<String, Arc<Obj>>,
    ring: VecDeque<Arc<Event>>,
    /// The version the cache has reached.
    rv: u64,
    /// History after this version is complete in the ring.
    floor: u64,
    synced: bool,
    total: Size,
    namespaces: HashMap<String, Size>,
    /// Since when the upstream watch is down (`None` while it runs).
    disconnected_since: Option<Instant>,
}

impl State {
    fn account(&mut self, obj: &Obj, sign: i64) {
        let bytes = obj.body.len() as u64;
        let apply = |size: &mut Size| {
            if sign > 0 {
                size.count += 1;
                size.bytes += bytes;
            } else {
                size.count = size.count.saturating_sub(1);
                size.bytes = size.bytes.saturating_sub(bytes);
            }
        };
        apply(&mut self.total);
        let ns = self.namespaces.entry(obj.namespace.clone()).or_default();
        apply(ns);
        if ns.count == 0 {
            self.namespaces.remove(&obj.namespace);
        }
    }
}

/// What a new watch starts from.
pub struct WatchStart {
    /// Current objects, when the watch begins with the state (synthetic ADDED).
    pub initial: Vec<Arc<Obj>>,
    /// Events after the requested version already in the ring.
    pub backlog: Vec<Arc<Event>>,
    /// New events.
    pub rx: broadcast::Receiver<Arc<Event>>,
    /// The cache's version at subscription.
    pub rv: u64,
    /// The relist generation at subscription; a change ends the watch.
    pub generation: watch::Receiver<u64>,
}

/// Why a watch cannot start from the version it asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expired {
    /// The oldest version a watch can start after.
    pub oldest: u64,
}

/// What the writer and every reader of one resource share.
struct Shared {
    kind: Kind,
    state: RwLock<State>,
    tx: broadcast::Sender<Arc<Event>>,
    generation: watch::Sender<u64>,
    encodings: AtomicU64,
}

/// One resource's store as requests read it: cloneable, and read-only by construction (the
/// mutations are the [`Writer`]'s alone). A clone is an `Arc`'s; a read takes the read lock
/// only long enough to clone `Arc`s.
#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
}

/// One resource's store as the informer writes it: the one writer. Not `Clone`, and every
/// mutation takes `&mut self`, so that nothing but its holder can change the store. It reads
/// like any [`Store`] (`Deref`).
pub struct Writer {
    store: Store,
    ring_size: usize,
    relists: Option<prometheus::IntCounter>,
}

impl Writer {
    /// An empty, unsynced store. A watcher may fall `watcher_buffer` events behind before it
    /// is disconnected.
    pub fn new(kind: Kind, ring_size: usize, watcher_buffer: usize) -> Writer {
        let (tx, _) = broadcast::channel(watcher_buffer.max(1));
        let shared = Shared {
            kind,
            state: RwLock::new(State {
                objects: BTreeMap::new(),
                ring: VecDeque::new(),
                rv: 0,
                floor: 0,
                synced: false,
                total: Size::default(),
                namespaces: HashMap::new(),
                disconnected_since: Some(Instant::now()),
            }),
            tx,
            generation: watch::channel(0).0,
            encodings: AtomicU64::new(0),
        };
        Writer {
            store: Store {
                shared: Arc::new(shared),
            },
            ring_size: ring_size.max(1),
            relists: None,
        }
    }

    /// Counts every full state after the first in `counter` (`cache_relists_total`).
    pub fn counting_relists(mut self, counter: prometheus::IntCounter) -> Writer {
        self.relists = Some(counter);
        self
    }

    /// A read handle on what this writer writes.
    pub fn as_reader(&self) -> Store {
        self.store.clone()
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        // Every mutation is a few map operations that leave the state consistent, so a
        // poisoned lock is still usable.
        self.store
            .shared
            .state
            .write()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces everything with a full list at `rv`. Ends every open watch (they
    /// re-watch) and forgets the ring: history before the list is unknown.
    pub fn replace(&mut self, objects: Vec<Obj>, rv: u64) {
        let mut state = self.write();
        state.objects.clear();
        state.total = Size::default();
        state.namespaces.clear();
        for obj in objects {
            state.account(&obj, 1);
            state.objects.insert(obj.key(), Arc::new(obj));
        }
        state.ring.clear();
        state.rv = rv;
        state.floor = rv;
        if state.synced
            && let Some(counter) = &self.relists
        {
            counter.inc();
        }
        state.synced = true;
        self.store.shared.generation.send_modify(|g| *g += 1);
    }

    /// Applies one event from the upstream watch. Events at or below the cache's version
    /// are duplicates (a re-watch overlaps) and are dropped; false then.
    pub fn apply(&mut self, kind: EventType, obj: Obj) -> bool {
        let mut state = self.write();
        if obj.rv <= state.rv {
            return false;
        }
        let rv = obj.rv;
        let key = obj.key();
        let obj = Arc::new(obj);
        let prev = if kind == EventType::Deleted {
            state.objects.remove(&key)
        } else {
            state.objects.insert(key, obj.clone())
        };
        if let Some(prev) = &prev {
            state.account(prev, -1);
        }
        if kind != EventType::Deleted {
            state.account(&obj, 1);
        }
        let event = Arc::new(Event::new(rv, kind, obj, prev));
        state.ring.push_back(event.clone());
        while state.ring.len() > self.ring_size {
            if let Some(old) = state.ring.pop_front() {
                state.floor = old.rv;
            }
        }
        state.rv = rv;
        // Sent under the write lock, which a watch subscribes under: its snapshot and its
        // live feed neither overlap nor leave a gap. No receivers is fine: nobody watches.
        let _ = self.store.shared.tx.send(event);
        true
    }

    /// A BOOKMARK from upstream: the cache has every event up to `rv`.
    pub fn advance(&mut self, rv: u64) {
        let mut state = self.write();
        if rv > state.rv {
            state.rv = rv;
        }
    }

    /// Records whether the upstream watch runs (for bounded staleness and the lag metric).
    pub fn set_connected(&mut self, connected: bool) {
        let mut state = self.write();
        match (connected, state.disconnected_since) {
            (true, Some(_)) => state.disconnected_since = None,
            (false, None) => state.disconnected_since = Some(Instant::now()),
            _ => {}
        }
    }

    /// How many times the store was replaced by a full state.
    pub fn generation(&self) -> u64 {
        *self.store.shared.generation.borrow()
    }
}

impl std::ops::Deref for Writer {
    type Target = Store;

    fn deref(&self) -> &Store {
        &self.store
    }
}

impl Store {
    fn read(&self) -> RwLockReadGuard<'_, State> {
        // See `Writer::write`: a poisoned lock is still consistent.
        self.shared.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The resource's type.
    pub fn kind(&self) -> &Kind {
        &self.shared.kind
    }

    /// Event encodings made, for the fan-out efficiency check.
    pub fn encodings(&self) -> &AtomicU64 {
        &self.shared.encodings
    }

    /// How far behind the apiserver the cache may be: zero while the upstream watch runs,
    /// else the time since it stopped.
    pub fn lag(&self) -> std::time::Duration {
        self.read()
            .disconnected_since
            .map_or(std::time::Duration::ZERO, |since| since.elapsed())
    }

    /// Whether the first full list is in.
    pub fn synced(&self) -> bool {
        self.read().synced
    }

    /// The version the cache has reached.
    pub fn rv(&self) -> u64 {
        self.read().rv
    }

    /// The oldest version a watch can start after.
    #[cfg(test)]
    pub fn floor(&self) -> u64 {
        self.read().floor
    }

    /// Objects and bytes cached, in all or one namespace.
    pub fn size(&self, namespace: Option<&str>) -> (u64, u64) {
        let state = self.read();
        let size = match namespace {
            None => state.total,
            Some(ns) => state.namespaces.get(ns).copied().unwrap_or_default(),
        };
        (size.count, size.bytes)
    }

    /// Open watches of this resource.
    pub fn watchers(&self) -> usize {
        self.shared.tx.receiver_count()
    }

    /// The object under `namespace/name`, with the cache's version.
    pub fn get(&self, namespace: &str, name: &str) -> (Option<Arc<Obj>>, u64) {
        let state = self.read();
        let obj = state.objects.get(&object_key(namespace, name)).cloned();
        (obj, state.rv)
    }

    /// Every object in scope (all namespaces when `None`) that `keep` accepts, in the
    /// apiserver's key order, with the cache's version.
    pub fn list(
        &self,
        namespace: Option<&str>,
        keep: impl Fn(&Obj) -> bool,
    ) -> (Vec<Arc<Obj>>, u64) {
        let state = self.read();
        let items = scope(&state.objects, namespace, "")
            .filter(|o| keep(o))
            .cloned()
            .collect();
        (items, state.rv)
    }

    /// For a continued list: the objects in scope whose key is `from` or after, in key
    /// order, as of version `at` (rolled back through the ring) or the latest when `None`,
    /// with that version; `None` when `at` is older than the ring or newer than the cache.
    pub fn list_from(
        &self,
        namespace: Option<&str>,
        at: Option<u64>,
        from: &str,
    ) -> Option<(Vec<Arc<Obj>>, u64)> {
        let state = self.read();
        let at = at.unwrap_or(state.rv);
        if at < state.floor || at > state.rv {
            return None;
        }
        let mut items: BTreeMap<String, Arc<Obj>> = scope(&state.objects, namespace, from)
            .map(|o| (o.key(), o.clone()))
            .collect();
        let wanted = |key: &str| Scope::of(namespace).contains(key) && key >= from;
        for event in state.ring.iter().rev().take_while(|e| e.rv > at) {
            let key = event.obj.key();
            if !wanted(&key) {
                continue;
            }
            match &event.prev {
                Some(prev) => items.insert(key, prev.clone()),
                None => items.remove(&key),
            };
        }
        Some((items.into_values().collect(), at))
    }

    /// Subscribes a watch that starts with the current objects (synthetic ADDED).
    pub fn watch_state(&self) -> WatchStart {
        let state = self.read();
        WatchStart {
            initial: state.objects.values().cloned().collect(),
            backlog: Vec::new(),
            rx: self.shared.tx.subscribe(),
            rv: state.rv,
            generation: self.shared.generation.subscribe(),
        }
    }

    /// Subscribes a watch that starts with the ring's events after `n`, or [`Expired`]
    /// when they are gone (`n` is older than the ring). The caller has made sure the cache
    /// reached `n`.
    pub fn watch_after(&self, n: u64) -> Result<WatchStart, Expired> {
        let state = self.read();
        if n < state.floor {
            return Err(Expired {
                oldest: state.floor,
            });
        }
        Ok(WatchStart {
            initial: Vec::new(),
            backlog: state
                .ring
                .iter()
                .skip_while(|e| e.rv <= n)
                .cloned()
                .collect(),
            rx: self.shared.tx.subscribe(),
            rv: state.rv,
            generation: self.shared.generation.subscribe(),
        })
    }
}

/// The objects in scope (all namespaces when `None`) whose key is `from` or after.
fn scope<'a>(
    objects: &'a BTreeMap<String, Arc<Obj>>,
    namespace: Option<&str>,
    from: &str,
) -> impl Iterator<Item = &'a Arc<Obj>> + 'a {
    let (low, high) = Scope::of(namespace).range();
    let low = match low {
        Bound::Included(low) if low.as_str() > from => low,
        _ => from.to_owned(),
    };
    objects
        .range::<String, _>(low..)
        .take_while(move |(key, _)| match &high {
            Bound::Excluded(high) => key.as_str() < high.as_str(),
            _ => true,
        })
        .map(|(_, o)| o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(ns: &str, name: &str, rv: u64, app: &str) -> Obj {
        let raw = format!(
            "{{\"kind\":\"Secret\",\"apiVersion\":\"v1\",\"metadata\":{{\"name\":\"{name}\",\"namespace\":\"{ns}\",\"resourceVersion\":\"{rv}\",\"labels\":{{\"app\":\"{app}\"}}}},\"type\":\"Opaque\"}}"
        );
        Obj::parse(raw.as_bytes()).unwrap()
    }

    fn store() -> Writer {
        Writer::new(Kind::new("", "v1", "secrets", "Secret", true), 3, 16)
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

    #[test]
    fn duplicates_are_dropped_and_the_ring_is_bounded() {
        let mut s = store();
        s.replace(vec![secret("ns", "a", 5, "web")], 5);
        assert!(!s.apply(EventType::Modified, secret("ns", "a", 5, "web")));
        for rv in 6..10 {
            assert!(s.apply(EventType::Modified, secret("ns", "a", rv, "web")));
        }
        assert_eq!(s.rv(), 9);
        assert_eq!(s.floor(), 6);
        assert!(s.watch_after(5).is_err());
        let start = s.watch_after(6).ok().unwrap();
        let rvs: Vec<u64> = start.backlog.iter().map(|e| e.rv).collect();
        assert_eq!(rvs, [7, 8, 9]);
    }

    #[test]
    fn a_continued_list_sees_the_state_at_its_version() {
        let mut s = store();
        s.replace(vec![secret("ns", "a", 5, "web")], 5);
        s.apply(EventType::Added, secret("ns", "b", 6, "web"));
        s.apply(EventType::Deleted, secret("ns", "a", 7, "web"));
        let names = |v: Option<(Vec<Arc<Obj>>, u64)>| {
            v.unwrap()
                .0
                .iter()
                .map(|o| o.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(s.list_from(None, Some(5), "")), ["a"]);
        assert_eq!(names(s.list_from(None, Some(6), "")), ["a", "b"]);
        assert_eq!(names(s.list_from(Some("ns"), Some(7), "")), ["b"]);
        assert_eq!(names(s.list_from(None, Some(6), "ns/a\0")), ["b"]);
        assert_eq!(names(s.list_from(Some("ns"), None, "ns/b")), ["b"]);
        assert!(s.list_from(None, Some(8), "").is_none());
    }

    #[test]
    fn an_object_leaving_a_selector_is_deleted_at_the_event_version() {
        let mut s = store();
        s.replace(vec![secret("ns", "a", 5, "web")], 5);
        s.apply(EventType::Modified, secret("ns", "a", 6, "db"));
        let start = s.watch_after(5).ok().unwrap();
        let counter = AtomicU64::new(0);
        let line = start.backlog[0].left_line(s.kind(), Encoding::Json, &counter);
        let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(value["type"], "DELETED");
        assert_eq!(value["object"]["metadata"]["labels"]["app"], "web");
        assert_eq!(value["object"]["metadata"]["resourceVersion"], "6");
    }

    #[test]
    fn sizes_follow_the_objects() {
        let mut s = store();
        s.replace(
            vec![secret("a", "x", 5, "web"), secret("b", "y", 5, "web")],
            5,
        );
        let (count, bytes) = s.size(None);
        assert_eq!(count, 2);
        assert_eq!(s.size(Some("a")).0, 1);
        s.apply(EventType::Deleted, secret("a", "x", 6, "web"));
        assert_eq!(s.size(Some("a")), (0, 0));
        assert!(s.size(None).1 < bytes);
    }
}
