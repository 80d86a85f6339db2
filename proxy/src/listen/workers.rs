//! Where accepted connections are served: on the listener's own runtime, or spread over
//! worker threads that each run a single-threaded runtime with a request path of its own.
//!
//! The accept loop stays in one place ([`super::Listener`]) and hands each connection it
//! admits to the worker with the fewest open connections. A worker then does everything
//! for that connection on its one thread: the PROXY header, TLS, HTTP, the request path
//! and, through its own upstream connections, the apiserver's answer. Nothing of a request
//! changes threads; only state that must be shared (flows, queues, byte budgets, the token
//! cache, the watch cache, metrics) is, behind its own locks and atomics. This is how the
//! floor scales, and what a multi-threaded runtime cannot promise: there a connection's
//! task and its upstream connection's task may sit on different threads and wake each
//! other across them for every request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::FutureExt;
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

use super::caps::{Admitted, ConnectionGuard, Connections, SourceGuard};
use super::conn::{self, Settings};
use super::tls::TlsState;
use super::{DrainPhase, RequestPath};

/// A thread that will serve connections on a single-threaded runtime with `service`, its
/// own request path. Made before the listener serves, so that a runtime that cannot be
/// built stops the start rather than a connection.
pub struct Worker<S> {
    /// Taken by the thread that runs it; see the `Drop`.
    runtime: Option<Runtime>,
    service: S,
}

impl<S> Drop for Worker<S> {
    /// A worker that never ran (the start failed after it was made) drops its runtime
    /// without waiting: a runtime dropped the usual way inside another's task panics.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl<S: RequestPath> Worker<S> {
    /// Builds the worker's runtime (timers and I/O on); the thread starts with the listener.
    pub fn new(service: S) -> std::io::Result<Worker<S>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Worker {
            runtime: Some(runtime),
            service,
        })
    }
}

/// A connection the accept loop admitted, on its way to a worker.
struct Accepted {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    guard: ConnectionGuard,
    source: SourceGuard,
}

/// What every connection of a listener is served with, whichever worker serves it.
#[derive(Clone)]
pub(super) struct Shared {
    /// `None` for plain HTTP (an admin listener without TLS).
    pub(super) tls: Option<Arc<TlsState>>,
    pub(super) settings: Arc<Settings>,
    pub(super) connections: Connections,
    pub(super) drain: watch::Receiver<DrainPhase>,
}

/// The accept loop's side of one worker.
struct Lane {
    /// Unbounded, and bounded all the same: every connection in it holds one of the
    /// listener's connection slots ([`ConnectionGuard`]), so it never holds more than the
    /// connection cap.
    send: mpsc::UnboundedSender<Accepted>,
    /// Connections handed to the worker and not yet ended.
    open: Arc<AtomicUsize>,
}

/// The workers of a serving listener, from the accept loop's side.
pub(super) struct Dispatch {
    lanes: Vec<Lane>,
    /// Where the search for the least busy worker starts, so that ties rotate.
    next: usize,
    /// Each worker's end: a thread's when its runtime is gone, a task's when it returns.
    ended: Vec<oneshot::Receiver<()>>,
    /// Dropped with the dispatch: a worker thread then stops at once, dropping what it
    /// still serves, so that an aborted listener leaves no thread behind.
    stop: Vec<oneshot::Sender<()>>,
    /// The one worker of [`Dispatch::local`], aborted with the dispatch for the same
    /// reason.
    local: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        if let Some(local) = &self.local {
            local.abort();
        }
    }
}

impl Dispatch {
    /// One worker, a task on the caller's runtime.
    pub(super) fn local<S: RequestPath>(service: S, shared: Shared) -> Dispatch {
        let (lane, accepted) = lane();
        let open = lane.open.clone();
        let (ended_tx, ended) = oneshot::channel();
        let local = tokio::spawn(async move {
            serve(accepted, open, service, shared, Until::Ended).await;
            drop(ended_tx);
        });
        Dispatch {
            lanes: vec![lane],
            next: 0,
            ended: vec![ended],
            stop: Vec::new(),
            local: Some(local),
        }
    }

    /// One thread per worker, each running its runtime until the drain closes everything
    /// after the accept loop stopped, or the dispatch is dropped.
    pub(super) fn threads<S: RequestPath>(
        workers: Vec<Worker<S>>,
        shared: Shared,
    ) -> std::io::Result<Dispatch> {
        let mut dispatch = Dispatch {
            lanes: Vec::with_capacity(workers.len()),
            next: 0,
            ended: Vec::with_capacity(workers.len()),
            stop: Vec::with_capacity(workers.len()),
            local: None,
        };
        for (index, mut worker) in workers.into_iter().enumerate() {
            let Some(runtime) = worker.runtime.take() else {
                continue;
            };
            let service = worker.service.clone();
            let (lane, accepted) = lane();
            let open = lane.open.clone();
            let (ended_tx, ended) = oneshot::channel::<()>();
            let (stop_tx, stop) = oneshot::channel::<()>();
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("bulwark-worker-{index}"))
                .spawn(move || {
                    runtime.block_on(async move {
                        tokio::select! {
                            () = serve(accepted, open, service, shared, Until::Close) => {}
                            _ = stop => {}
                        }
                    });
                    // Every task of the worker (its connections) is dropped with the
                    // runtime, before the accept loop hears that the worker has ended.
                    drop(runtime);
                    drop(ended_tx);
                })?;
            dispatch.lanes.push(lane);
            dispatch.ended.push(ended);
            dispatch.stop.push(stop_tx);
        }
        Ok(dispatch)
    }

    /// Hands an admitted connection to the worker with the fewest open connections. A
    /// worker that is gone (it can only have panicked) gets no more; the connection goes to
    /// the next one, or is reset when none is left.
    pub(super) fn hand(
        &mut self,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
        admitted: Admitted,
    ) {
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(error) => {
                tracing::debug!(%peer, %error, "cannot hand the connection to a worker");
                return;
            }
        };
        let mut accepted = Accepted {
            stream,
            peer,
            guard: admitted.guard,
            source: admitted.source,
        };
        while !self.lanes.is_empty() {
            let count = self.lanes.len();
            let start = self.next % count;
            let chosen = (0..count)
                .map(|offset| (start + offset) % count)
                .min_by_key(|&i| self.lanes[i].open.load(Ordering::Relaxed))
                .unwrap_or(start);
            self.next = chosen + 1;
            let lane = &self.lanes[chosen];
            lane.open.fetch_add(1, Ordering::Relaxed);
            match lane.send.send(accepted) {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => {
                    tracing::error!(
                        worker = chosen,
                        "a worker has stopped; it gets no more connections"
                    );
                    self.lanes.swap_remove(chosen);
                    accepted = back;
                }
            }
        }
        super::reset_on_close(&accepted.stream);
    }

    /// Stops handing out connections and waits until every worker has served its last.
    pub(super) async fn finish(mut self) {
        self.lanes.clear();
        for worker in std::mem::take(&mut self.ended) {
            let _ = worker.await;
        }
    }
}

/// One of a worker's open connections, counted until its task ends or is dropped.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn lane() -> (Lane, mpsc::UnboundedReceiver<Accepted>) {
    let (send, accepted) = mpsc::unbounded_channel();
    let lane = Lane {
        send,
        open: Arc::new(AtomicUsize::new(0)),
    };
    (lane, accepted)
}

/// A worker's loop: serves each connection it is handed until the accept loop stops, then
/// until its connections have ended, gracefully or at [`DrainPhase::Close`].
async fn serve<S: RequestPath>(
    mut accepted: mpsc::UnboundedReceiver<Accepted>,
    open: Arc<AtomicUsize>,
    service: S,
    shared: Shared,
    until: Until,
) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            next = accepted.recv() => match next {
                Some(Accepted { stream, peer, guard, source }) => {
                    let stream = match tokio::net::TcpStream::from_std(stream) {
                        Ok(stream) => stream,
                        Err(error) => {
                            open.fetch_sub(1, Ordering::Relaxed);
                            tracing::debug!(%peer, %error, "cannot serve a handed connection");
                            continue;
                        }
                    };
                    let (tls, settings, connections, service, drain) = (
                        shared.tls.clone(),
                        shared.settings.clone(),
                        shared.connections.clone(),
                        service.clone(),
                        shared.drain.clone(),
                    );
                    let open = Open(open.clone());
                    let serve = conn::serve(
                        stream,
                        peer,
                        tls,
                        settings,
                        connections,
                        (guard, source),
                        service,
                        drain,
                    );
                    // Counted until the connection's guards are gone: `map` drops the
                    // connection's future before it runs.
                    tasks.spawn(serve.map(move |()| drop(open)));
                }
                None => break,
            },
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                if let Err(error) = joined {
                    tracing::error!(%error, "a client connection task failed");
                }
            }
        }
    }
    tracing::debug!(open = tasks.len(), "a worker stopped taking connections");
    while let Some(joined) = tasks.join_next().await {
        if let Err(error) = joined {
            tracing::error!(%error, "a client connection task failed");
        }
    }
    if until == Until::Close {
        let mut drain = shared.drain.clone();
        conn::phase_reached(&mut drain, DrainPhase::Close).await;
    }
}

/// How long a worker's loop lasts once the accept loop has stopped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Until {
    /// Until its connections have ended: on the listener's runtime, which lives on.
    Ended,
    /// Until the drain closes everything: a worker thread's runtime ends with its loop,
    /// and an upgraded connection (exec, attach, port-forward) goes on in a task of its own
    /// after its HTTP connection has ended, which must last as long as on the main runtime.
    Close,
}
