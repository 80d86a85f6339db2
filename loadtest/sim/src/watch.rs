//! WATCH streams: newline-delimited JSON events with kind/apiVersion on every object,
//! synthetic ADDED for the current state, BOOKMARKs (periodic, and the
//! `k8s.io/initial-events-end` one that ends a WatchList's initial state), selector
//! transitions as ADDED/DELETED, and the end of the stream at `timeoutSeconds`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures::Stream;
use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};
use tokio::time::{Instant, Interval};

use crate::discovery::ResourceDef;
use crate::select::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use crate::store::{Event, EventType, Obj, Store, WatchStart};

/// Which objects a watch sees.
#[derive(Clone, Debug, Default)]
pub struct WatchFilter {
    /// Namespace scope (`None` = all).
    pub namespace: Option<String>,
    /// labelSelector.
    pub labels: LabelSelector,
    /// fieldSelector.
    pub fields: FieldSelector,
}

impl WatchFilter {
    /// Whether an object is in scope and matches both selectors.
    pub fn matches(&self, o: &Obj) -> bool {
        self.namespace.as_deref().is_none_or(|n| n == o.namespace)
            && self.labels.matches(&o.labels)
            && self.fields.matches(&o.namespace, &o.name)
    }
}

/// How a watch behaves beyond its start point.
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// Send BOOKMARK events this often (None = no bookmarks).
    pub bookmarks: Option<Duration>,
    /// End the initial state with the `k8s.io/initial-events-end` bookmark.
    pub initial_events_end: bool,
    /// End the stream after this long.
    pub timeout: Duration,
}

/// One event line: `{"type":T,"object":OBJ}\n`.
pub fn event_line(out: &mut BytesMut, def: &ResourceDef, kind: &str, obj: &Obj) {
    out.put_slice(b"{\"type\":\"");
    out.put_slice(kind.as_bytes());
    out.put_slice(b"\",\"object\":");
    out.put_slice(&obj.with_kind(def));
    out.put_slice(b"}\n");
}

/// A BOOKMARK line at `rv`.
pub fn bookmark_line(out: &mut BytesMut, def: &ResourceDef, rv: u64, initial_end: bool) {
    let ann = if initial_end {
        ",\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}"
    } else {
        ""
    };
    let s = format!(
        "{{\"type\":\"BOOKMARK\",\"object\":{{\"kind\":\"{}\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{rv}\"{ann}}}{}}}}}\n",
        def.kind,
        def.api_version(),
        def.zero_fields
    );
    out.put_slice(s.as_bytes());
}

/// The one-line stream a watch gets when it cannot start: an ERROR event with a Status.
pub fn error_line(err: &ApiError) -> Bytes {
    Bytes::from(err.status.error_event())
}

struct W {
    def: &'static ResourceDef,
    store: Arc<Store>,
    filter: WatchFilter,
    initial: VecDeque<Arc<Obj>>,
    end_bookmark: Option<u64>,
    backlog: VecDeque<Arc<Event>>,
    rx: broadcast::Receiver<Arc<Event>>,
    last_rv: u64,
    bookmarks: Option<Interval>,
    /// `None`: further away than time can count.
    deadline: Option<Instant>,
    done: bool,
}

/// Batch lines into chunks of about this size, so a big initial state is not one write per
/// object.
const CHUNK: usize = 64 * 1024;

impl W {
    fn convert(&mut self, out: &mut BytesMut, ev: &Event) {
        self.last_rv = self.last_rv.max(ev.rv);
        let now = self.filter.matches(&ev.obj);
        let before = ev.prev.as_ref().is_some_and(|p| self.filter.matches(p));
        let kind = match ev.kind {
            EventType::Added if now => Some(EventType::Added),
            EventType::Modified if now && before => Some(EventType::Modified),
            EventType::Modified if now => Some(EventType::Added),
            EventType::Modified if before => Some(EventType::Deleted),
            EventType::Deleted if before => Some(EventType::Deleted),
            _ => None,
        };
        match kind {
            Some(k) if k == ev.kind => {
                let line = ev.line.get_or_init(|| {
                    let mut b = BytesMut::new();
                    event_line(&mut b, self.def, k.as_str(), &ev.obj);
                    b.freeze()
                });
                out.extend_from_slice(line);
            }
            // An object that left the selector is sent as DELETED with its previous state at
            // this revision, as the apiserver's watch cache does.
            Some(EventType::Deleted) => match &ev.prev {
                Some(p) => event_line(out, self.def, "DELETED", &p.with_rv(ev.rv)),
                None => event_line(out, self.def, "DELETED", &ev.obj),
            },
            Some(k) => event_line(out, self.def, k.as_str(), &ev.obj),
            None => {}
        }
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = BytesMut::new();
        while let Some(o) = self.initial.pop_front() {
            if self.filter.matches(&o) {
                event_line(&mut out, self.def, "ADDED", &o);
                if out.len() >= CHUNK {
                    return Some(out.freeze());
                }
            }
        }
        if let Some(rv) = self.end_bookmark.take() {
            bookmark_line(&mut out, self.def, rv, true);
        }
        while let Some(ev) = self.backlog.pop_front() {
            self.convert(&mut out, &ev);
            if out.len() >= CHUNK {
                return Some(out.freeze());
            }
        }
        if !out.is_empty() {
            return Some(out.freeze());
        }
        loop {
            let tick = async {
                match self.bookmarks.as_mut() {
                    Some(i) => {
                        i.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                r = self.rx.recv() => match r {
                    Ok(ev) => {
                        if ev.resource == self.def.key() {
                            self.convert(&mut out, &ev);
                        }
                        if !out.is_empty() {
                            return Some(out.freeze());
                        }
                    }
                    // A watcher that cannot keep up is closed, as the apiserver closes it;
                    // the client re-watches from its last resourceVersion.
                    Err(RecvError::Lagged(_)) | Err(RecvError::Closed) => {
                        self.done = true;
                        return None;
                    }
                },
                _ = tick => {
                    // Deliver everything up to the store's revision before vouching for it.
                    let rv = self.store.resource_version();
                    loop {
                        match self.rx.try_recv() {
                            Ok(ev) => {
                                if ev.resource == self.def.key() {
                                    self.convert(&mut out, &ev);
                                } else {
                                    self.last_rv = self.last_rv.max(ev.rv);
                                }
                            }
                            Err(TryRecvError::Empty) => break,
                            Err(_) => {
                                self.done = true;
                                return None;
                            }
                        }
                    }
                    self.last_rv = self.last_rv.max(rv);
                    bookmark_line(&mut out, self.def, self.last_rv, false);
                    return Some(out.freeze());
                }
                _ = async {
                    match self.deadline {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.done = true;
                    return None;
                }
            }
        }
    }
}

/// The event stream of a watch that has been subscribed.
pub fn stream(
    def: &'static ResourceDef,
    store: Arc<Store>,
    start: WatchStart,
    filter: WatchFilter,
    opts: WatchOptions,
    from_rv: Option<u64>,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let bookmarks = opts.bookmarks.map(|d| {
        let mut i = tokio::time::interval_at(Instant::now() + d, d);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let w = W {
        def,
        store,
        filter,
        initial: start.initial.into(),
        end_bookmark: opts.initial_events_end.then_some(start.rv),
        backlog: start.backlog.into(),
        rx: start.rx,
        last_rv: from_rv.unwrap_or(start.rv),
        bookmarks,
        deadline: Instant::now().checked_add(opts.timeout),
        done: false,
    };
    futures::stream::unfold(
        w,
        |mut w| async move { w.next_chunk().await.map(|c| (c, w)) },
    )
}
