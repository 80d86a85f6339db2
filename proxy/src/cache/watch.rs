//! Watch streams served from the cache: the initial state when asked (WatchList ends it
//! with the `k8s.io/initial-events-end` bookmark), the ring's backlog, then live events
//! from the broadcast, each event's line encoded once and shared. Selector transitions
//! follow the apiserver's cacher (an object leaving the selector is DELETED); bookmarks
//! when asked; the stream ends at `timeoutSeconds`, on a relist, when the watcher falls
//! further behind than its buffer, or when a periodic re-authorization says no.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Held;
use super::accept::Encoding;
use super::authz::{AccessCache, Attributes, Decision};
use super::select::{FieldSelector, LabelSelector};
use super::store::{Event, EventType, Obj, Store, WatchStart, bookmark_line};
use crate::metrics::Metrics;
use crate::own::ReviewError;
use crate::user::User;

/// Which objects a watch (or list) sees.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Namespace scope; `None` for all.
    pub namespace: Option<String>,
    /// `labelSelector`.
    pub labels: LabelSelector,
    /// `fieldSelector`.
    pub fields: FieldSelector,
}

impl Filter {
    /// Whether the object is in scope and matches both selectors.
    pub fn matches(&self, obj: &Obj) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| ns == obj.namespace)
            && self.labels.matches(&obj.labels)
            && self.fields.matches(&obj.namespace, &obj.name)
    }

    /// Whether the filter selects anything beyond the namespace.
    pub fn selects(&self) -> bool {
        !self.labels.is_empty() || !self.fields.is_empty()
    }
}

/// How one watch behaves.
pub struct Options {
    /// Objects and events it sees.
    pub filter: Filter,
    /// Send bookmarks this often (`None`: the client did not allow them).
    pub bookmarks: Option<Duration>,
    /// End the initial state with the `initial-events-end` bookmark (WatchList).
    pub initial_events_end: bool,
    /// When the stream ends.
    pub timeout: Duration,
    /// The version the client asked to start after, if any.
    pub from: Option<u64>,
    /// JSON lines or protobuf frames.
    pub encoding: Encoding,
}

/// Periodic re-authorization of an open watch.
pub struct Reauthorize {
    /// The decision cache.
    pub access: Arc<AccessCache>,
    /// Who watches.
    pub user: User,
    /// What they watch.
    pub attrs: Attributes,
    /// About how often (with jitter).
    pub every: Duration,
}

struct Watcher {
    store: Store,
    options: Options,
    /// The initial state, encoded when the watch started (its seats went back then).
    initial: VecDeque<Bytes>,
    end_bookmark: Option<u64>,
    backlog: VecDeque<Arc<Event>>,
    rx: tokio::sync::broadcast::Receiver<Arc<Event>>,
    generation: tokio::sync::watch::Receiver<u64>,
    last_rv: u64,
    next_bookmark: Option<Instant>,
    /// `None`: further away than time can count (no end but the others).
    deadline: Option<Instant>,
    reauth: Option<Reauthorize>,
    next_reauth: Option<Instant>,
    review: Option<JoinHandle<Result<Decision, Arc<ReviewError>>>>,
    /// One timer for the bookmark, the re-authorization and the deadline, set to the
    /// earliest ([`Watcher::next_wake`]) and moved only when that moves: a delivered event
    /// makes and drops no timer.
    timer: Pin<Box<tokio::time::Sleep>>,
    metrics: Metrics,
    done: bool,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(review) = self.review.take() {
            review.abort();
        }
    }
}

/// Up to ±20 %, so that watches opened together are not re-authorized together.
fn jittered(every: Duration) -> Duration {
    every.mul_f64(rand::random_range(0.8..1.2))
}

impl Watcher {
    fn convert(&mut self, out: &mut BytesMut, event: &Event) {
        self.last_rv = self.last_rv.max(event.rv);
        let filter = &self.options.filter;
        let counter = self.store.encodings();
        let kind = self.store.kind();
        let encoding = self.options.encoding;
        let now = event.kind != EventType::Deleted && filter.matches(&event.obj);
        let before = match (&event.prev, event.kind) {
            (Some(prev), _) => filter.matches(prev),
            // A delete of an object the cache did not have: judge by the object itself.
            (None, EventType::Deleted) => filter.matches(&event.obj),
            (None, _) => false,
        };
        let line = match (now, before) {
            (true, false) => event.line(kind, EventType::Added, encoding, counter),
            (true, true) => event.line(kind, EventType::Modified, encoding, counter),
            (false, true) if event.kind == EventType::Deleted => {
                event.line(kind, EventType::Deleted, encoding, counter)
            }
            (false, true) => event.left_line(kind, encoding, counter),
            (false, false) => return,
        };
        out.extend_from_slice(&line);
    }

    fn slow(&mut self) -> Option<Bytes> {
        self.metrics
            .cache_slow_watchers_total
            .with_label_values(&[&resource_label(&self.store)])
            .inc();
        self.done = true;
        None
    }

    /// The earliest of the next bookmark, the next re-authorization (while none runs) and
    /// the deadline.
    fn next_wake(&self) -> Option<Instant> {
        let reauth = self.next_reauth.filter(|_| self.review.is_none());
        [self.next_bookmark, reauth, self.deadline]
            .into_iter()
            .flatten()
            .min()
    }

    // Over 120 lines: the events, the relist, the one timer's three ends and the review,
    // in one `select!`.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let kind = self.store.kind().clone();
        if let Some(chunk) = self.initial.pop_front() {
            return Some(chunk);
        }
        let mut out = BytesMut::new();
        if let Some(rv) = self.end_bookmark.take() {
            out.extend_from_slice(&bookmark_line(&kind, rv, true, self.options.encoding));
        }
        while let Some(event) = self.backlog.pop_front() {
            self.convert(&mut out, &event);
            if out.len() >= 64 * 1024 {
                return Some(out.freeze());
            }
        }
        if !out.is_empty() {
            return Some(out.freeze());
        }
        loop {
            let wake = self.next_wake();
            if let Some(at) = wake
                && self.timer.deadline() != at
            {
                self.timer.as_mut().reset(at);
            }
            tokio::select! {
                received = self.rx.recv() => match received {
                    Ok(event) => {
                        self.convert(&mut out, &event);
                        // Take whatever else is already queued into the same frame.
                        loop {
                            match self.rx.try_recv() {
                                Ok(event) => self.convert(&mut out, &event),
                                Err(TryRecvError::Empty) => break,
                                Err(TryRecvError::Lagged(_)) => return self.slow(),
                                Err(TryRecvError::Closed) => { self.done = true; break; }
                            }
                            if out.len() >= 64 * 1024 {
                                break;
                            }
                        }
                        if !out.is_empty() {
                            return Some(out.freeze());
                        }
                    }
                    // Too far behind: the broadcast dropped events for this watcher. Close
                    // it, as the apiserver closes slow watchers; the client re-watches.
                    Err(RecvError::Lagged(_)) => return self.slow(),
                    Err(RecvError::Closed) => {
                        self.done = true;
                        return None;
                    }
                },
                _ = self.generation.changed() => {
                    // The cache relisted: history may have been lost, every watch ends.
                    self.done = true;
                    return None;
                }
                _ = self.timer.as_mut(), if wake.is_some() => {
                    let now = Instant::now();
                    if self.deadline.is_some_and(|at| at <= now) {
                        self.done = true;
                        return None;
                    }
                    if self.review.is_none() && self.next_reauth.is_some_and(|at| at <= now) {
                        if let Some(reauth) = &self.reauth {
                            let access = reauth.access.clone();
                            let user = reauth.user.clone();
                            let attrs = reauth.attrs.clone();
                            self.review = Some(tokio::spawn(async move { access.check(&user, &attrs).await }));
                        }
                        self.next_reauth = None;
                    }
                    if self.next_bookmark.is_some_and(|at| at <= now) {
                        let rv = self.store.rv();
                        // Deliver every event up to that version before vouching for it.
                        loop {
                            match self.rx.try_recv() {
                                Ok(event) => self.convert(&mut out, &event),
                                Err(TryRecvError::Empty) => break,
                                Err(TryRecvError::Lagged(_)) => return self.slow(),
                                Err(TryRecvError::Closed) => break,
                            }
                        }
                        self.last_rv = self.last_rv.max(rv);
                        out.extend_from_slice(&bookmark_line(&kind, self.last_rv, false, self.options.encoding));
                        self.next_bookmark = self.options.bookmarks.map(|every| now + every);
                        return Some(out.freeze());
                    }
                }
                decided = async { self.review.as_mut().expect("guarded").await }, if self.review.is_some() => {
                    self.review = None;
                    // Allowed, or no answer: a review that fails keeps the watch open.
                    if let Ok(Ok(Decision::Denied(_))) = decided {
                        tracing::info!(resource = %resource_label(&self.store), "access revoked; closing a cached watch");
                        self.done = true;
                        return None;
                    }
                    self.next_reauth = self.reauth.as_ref().map(|r| Instant::now() + jittered(r.every));
                }
            }
        }
    }
}

fn resource_label(store: &Store) -> String {
    crate::config::GroupResource {
        group: store.kind().group.clone(),
        resource: store.kind().resource.clone(),
    }
    .to_string()
}

/// The body of a watch that has subscribed, and the bytes of the initial state it starts
/// with. That state is encoded here, before the body is sent, and `initial_seats` go back
/// to their level then: seats pay for the work of a watch's start, not for a client's pace
/// in reading it.
pub fn body(
    store: Store,
    start: WatchStart,
    options: Options,
    reauth: Option<Reauthorize>,
    initial_seats: Option<Held>,
    metrics: Metrics,
) -> (crate::Body, u64) {
    let now = Instant::now();
    let WatchStart {
        initial,
        backlog,
        rx,
        rv,
        generation,
    } = start;
    let mut objects: VecDeque<Arc<Obj>> = initial.into();
    let mut encoded = VecDeque::new();
    while let Some(chunk) =
        super::respond::added_frames(store.kind(), &mut objects, options.encoding, |o| {
            options.filter.matches(o)
        })
    {
        encoded.push_back(chunk);
    }
    drop(initial_seats);
    let initial_bytes = encoded.iter().map(|c: &Bytes| c.len() as u64).sum();
    let watcher = Watcher {
        initial: encoded,
        end_bookmark: options.initial_events_end.then_some(rv),
        backlog: backlog.into(),
        rx,
        generation,
        last_rv: options.from.unwrap_or(rv),
        next_bookmark: options.bookmarks.map(|every| now + every),
        deadline: now.checked_add(options.timeout),
        next_reauth: reauth.as_ref().map(|r| now + jittered(r.every)),
        reauth,
        review: None,
        // Set to its first end in `next_chunk`, before it is first polled.
        timer: Box::pin(tokio::time::sleep_until(now)),
        store,
        options,
        metrics,
        done: false,
    };
    let stream = futures::stream::unfold(watcher, |mut w| async move {
        w.next_chunk().await.map(|chunk| (chunk, w))
    })
    .map(|chunk| Ok::<_, crate::BoxError>(http_body::Frame::data(chunk)));
    (StreamBody::new(stream).boxed_unsync(), initial_bytes)
}
