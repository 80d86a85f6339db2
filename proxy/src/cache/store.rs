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
//!
//! A watch pinned to one name (`fieldSelector=metadata.name=`, a kubelet's watch of each
//! Secret its pods mount) takes its events from one of [`NAME_SHARDS`] broadcasts, the one
//! of its name's hash, instead of the resource's: a Secret's update wakes the watches whose
//! names share its shard, not every Secret watch of every node (as the apiserver's cacher
//! sends an event only to the watchers its index of them names).

mod event;
mod object;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasher as _;
use std::ops::Bound;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use apimachinery::continue_token::{Scope, object_key};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

pub use event::{Event, EventType, bookmark_line, encode_event, event_line};
pub use object::{Kind, Obj, ObjError};

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

/// The broadcasts that watches pinned to one name share, by the name's hash: 7,500 nodes'
/// 90,000 Secret watches are about 350 a shard, each woken by its shard's events only.
pub const NAME_SHARDS: usize = 256;

/// The shard of a name's broadcast: a fixed hash, the same in every process.
fn name_shard(name: &str) -> usize {
    foldhash::fast::FixedState::default().hash_one(name) as usize % NAME_SHARDS
}

/// What the writer and every reader of one resource share.
struct Shared {
    kind: Kind,
    state: RwLock<State>,
    /// Every event, for the watches not pinned to one name.
    tx: broadcast::Sender<Arc<Event>>,
    /// Each event again on its name's shard, for the watches pinned to one name; made by
    /// the first such watch (each is `watcher_buffer` slots).
    by_name: OnceLock<Box<[broadcast::Sender<Arc<Event>>]>>,
    watcher_buffer: usize,
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
            by_name: OnceLock::new(),
            watcher_buffer: watcher_buffer.max(1),
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
        if let Some(shards) = self.store.shared.by_name.get() {
            let _ = shards[name_shard(&event.obj.name)].send(event.clone());
        }
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
        let pinned = self.shared.by_name.get().map_or(0, |shards| {
            shards.iter().map(broadcast::Sender::receiver_count).sum()
        });
        self.shared.tx.receiver_count() + pinned
    }

    /// A new watch's live feed, under the read lock: every event, or, for a watch pinned to
    /// `name`, its name's shard.
    fn subscribe(&self, name: Option<&str>) -> broadcast::Receiver<Arc<Event>> {
        match name {
            None => self.shared.tx.subscribe(),
            Some(name) => {
                let buffer = self.shared.watcher_buffer;
                let shards = self.shared.by_name.get_or_init(|| {
                    (0..NAME_SHARDS)
                        .map(|_| broadcast::channel(buffer).0)
                        .collect()
                });
                shards[name_shard(name)].subscribe()
            }
        }
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

    /// Subscribes a watch that starts with the current objects in scope (all namespaces
    /// when `None`) that `keep` accepts (synthetic ADDED); `name` where its field selector
    /// pins one: in a namespace, its object is looked up rather than searched for, and it
    /// is fed only its name's shard's events. A kubelet's WatchList of one Secret took a
    /// reference to every Secret in the cache before, to keep one.
    pub fn watch_state(
        &self,
        namespace: Option<&str>,
        name: Option<&str>,
        keep: impl Fn(&Obj) -> bool,
    ) -> WatchStart {
        let state = self.read();
        let initial = match (namespace, name) {
            (Some(namespace), Some(name)) => state
                .objects
                .get(&object_key(namespace, name))
                .filter(|o| keep(o))
                .cloned()
                .into_iter()
                .collect(),
            _ => scope(&state.objects, namespace, "")
                .filter(|o| keep(o))
                .cloned()
                .collect(),
        };
        WatchStart {
            initial,
            backlog: Vec::new(),
            rx: self.subscribe(name),
            rv: state.rv,
            generation: self.shared.generation.subscribe(),
        }
    }

    /// Subscribes a watch that starts with the ring's events after `n`, or [`Expired`]
    /// when they are gone (`n` is older than the ring). The caller has made sure the cache
    /// reached `n`. `name` as for [`Store::watch_state`].
    pub fn watch_after(&self, n: u64, name: Option<&str>) -> Result<WatchStart, Expired> {
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
            rx: self.subscribe(name),
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
    use crate::cache::accept::Encoding;

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
    fn duplicates_are_dropped_and_the_ring_is_bounded() {
        let mut s = store();
        s.replace(vec![secret("ns", "a", 5, "web")], 5);
        assert!(!s.apply(EventType::Modified, secret("ns", "a", 5, "web")));
        for rv in 6..10 {
            assert!(s.apply(EventType::Modified, secret("ns", "a", rv, "web")));
        }
        assert_eq!(s.rv(), 9);
        assert_eq!(s.floor(), 6);
        assert!(s.watch_after(5, None).is_err());
        let start = s.watch_after(6, None).ok().unwrap();
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
        let start = s.watch_after(5, None).ok().unwrap();
        let counter = AtomicU64::new(0);
        let line = start.backlog[0].left_line(s.kind(), Encoding::Json, &counter);
        let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(value["type"], "DELETED");
        assert_eq!(value["object"]["metadata"]["labels"]["app"], "web");
        assert_eq!(value["object"]["metadata"]["resourceVersion"], "6");
    }

    #[test]
    fn a_watch_from_the_state_starts_with_the_objects_in_its_scope_only() {
        let mut s = store();
        s.replace(
            vec![
                secret("a", "x", 1, "web"),
                secret("a", "y", 2, "db"),
                secret("b", "x", 3, "web"),
            ],
            3,
        );
        let keys = |start: WatchStart| start.initial.iter().map(|o| o.key()).collect::<Vec<_>>();
        assert_eq!(keys(s.watch_state(Some("a"), Some("x"), |_| true)), ["a/x"]);
        assert!(keys(s.watch_state(Some("a"), Some("z"), |_| true)).is_empty());
        assert_eq!(
            keys(s.watch_state(Some("a"), None, |_| true)),
            ["a/x", "a/y"]
        );
        assert_eq!(
            keys(s.watch_state(None, Some("x"), |o| o.name == "x")),
            ["a/x", "b/x"]
        );
        assert_eq!(
            keys(s.watch_state(None, None, |o| {
                o.labels.get("app").is_some_and(|a| a == "web")
            })),
            ["a/x", "b/x"]
        );
    }

    #[test]
    fn a_watch_pinned_to_a_name_is_fed_its_names_shard_only() {
        let mut s = store();
        s.replace(vec![secret("ns", "a", 5, "web")], 5);
        // A name on another shard than "a"'s.
        let other = (0..)
            .map(|i| format!("b{i}"))
            .find(|n| name_shard(n) != name_shard("a"))
            .unwrap();
        let mut all = s.watch_after(5, None).ok().unwrap().rx;
        let mut a = s.watch_state(Some("ns"), Some("a"), |_| true).rx;
        let mut b = s.watch_after(5, Some(&other)).ok().unwrap().rx;
        assert_eq!(s.watchers(), 3);
        s.apply(EventType::Modified, secret("ns", "a", 6, "db"));
        s.apply(EventType::Added, secret("ns", &other, 7, "web"));
        s.apply(EventType::Deleted, secret("ns", "a", 8, "db"));
        let rvs = |rx: &mut broadcast::Receiver<Arc<Event>>| {
            std::iter::from_fn(|| rx.try_recv().ok().map(|e| e.rv)).collect::<Vec<_>>()
        };
        assert_eq!(rvs(&mut all), [6, 7, 8]);
        assert_eq!(rvs(&mut a), [6, 8], "a's update and delete, not {other}'s");
        assert_eq!(rvs(&mut b), [7]);
        drop((all, a));
        assert_eq!(s.watchers(), 1);
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
