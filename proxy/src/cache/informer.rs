//! One upstream informer per cached resource, with Bulwark's own identity, as an explicit
//! state machine (after kube-runtime's `watcher`): [`State::Discover`] finds the resource's
//! kind and makes the store; [`State::WatchList`] (or, where the upstream refuses it,
//! [`State::List`], for good) takes the full state; [`State::Watch`] follows events with
//! bookmarks from the store's version; [`State::Backoff`] waits before a retry.
//!
//! [`Informer::step`] does one state's work (a call, [`calls`]) and hands what came of it,
//! an [`Outcome`], to [`Transitions::next`], a function of no I/O that picks the next state:
//! a clean end re-watches from the last version, a 410 relists, any other error backs off
//! and retries. One backoff serves them all: it doubles from the first wait to the cap and
//! starts over after a success or a watch that lasted [`HEALTHY_WATCH`]. Events at or below
//! the store's version are duplicates of a re-watch and dropped, so none is missed, doubled
//! or reordered.

mod calls;
mod stream;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use super::store::{Kind, Store, Writer};
use crate::config::GroupResource;
use crate::own;
use calls::{InformerError, Start, WatchError};

/// Backoff between failed attempts: from the first to the last, doubling. The cap is short
/// because a stale cache answers nobody consistently, and a Bulwark runs only a handful of
/// informers (one per cached resource), so their retries cannot load an apiserver.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));
/// A watch that lasted this long was healthy; the backoff starts over after it.
const HEALTHY_WATCH: Duration = Duration::from_secs(5);

/// What an informer does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Find the resource's preferred version, kind and scope; the store is made then.
    Discover,
    /// Take the full state with a WatchList: the objects as ADDED events up to the
    /// `initial-events-end` bookmark, which replaces the store, then events on the same
    /// stream.
    WatchList,
    /// Take the full state with a paginated LIST.
    List,
    /// Follow the events after `rv`, with bookmarks.
    Watch {
        /// The version to watch from: the store's.
        rv: u64,
    },
    /// Wait `delay` (and up to a quarter more), then go on with `then`.
    Backoff {
        /// The state to retry.
        then: Box<State>,
        /// The wait before jitter.
        delay: Duration,
    },
}

/// What came of a state's work: the input of [`Transitions::next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Discovery found the kind; the store exists.
    Discovered,
    /// A LIST replaced the store's state at `rv`.
    Listed {
        /// The list's version.
        rv: u64,
    },
    /// The upstream refused the WatchList: LIST from now on.
    WatchListRefused,
    /// A watch (or WatchList) ended.
    Watched {
        /// How.
        end: End,
        /// How long it ran, from the request to its end.
        lasted: Duration,
        /// The version to watch on from: the store's, `None` when a WatchList ended
        /// before its initial state was in (nothing to resume).
        resume: Option<u64>,
    },
    /// Discovery or a LIST failed.
    Failed,
}

/// How a watch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The stream ended (its `timeoutSeconds`): watch again at once.
    Clean,
    /// 410 Gone: the history after the version is compacted away; take the state again.
    Expired,
    /// Any other error: back off, then watch again.
    Failed,
}

/// The one backoff: waits from `BACKOFF.0`, doubling up to `BACKOFF.1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff { next: BACKOFF.0 }
    }

    /// The wait before the next retry; the one after is twice as long, up to the cap.
    fn delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (delay * 2).min(BACKOFF.1);
        delay
    }

    /// Starts over after a success.
    fn reset(&mut self) {
        self.next = BACKOFF.0;
    }
}

/// The informer's transitions: what it remembers across states (whether the upstream
/// takes WatchList, the backoff) and the choice of the next state, without I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transitions {
    watch_list: bool,
    backoff: Backoff,
}

impl Transitions {
    /// Takes the full state by WatchList when `watch_list`, else by LIST.
    pub fn new(watch_list: bool) -> Transitions {
        Transitions {
            watch_list,
            backoff: Backoff::new(),
        }
    }

    /// The state after `state` came to `outcome`.
    pub fn next(&mut self, state: State, outcome: Outcome) -> State {
        match outcome {
            Outcome::Discovered => {
                self.backoff.reset();
                self.full_state()
            }
            Outcome::Listed { rv } => {
                self.backoff.reset();
                State::Watch { rv }
            }
            Outcome::WatchListRefused => {
                self.watch_list = false;
                State::List
            }
            Outcome::Failed => self.back_off(state),
            Outcome::Watched {
                end,
                lasted,
                resume,
            } => {
                if lasted >= HEALTHY_WATCH {
                    // A watch that ran a while was healthy: a failure now starts over.
                    self.backoff.reset();
                }
                let again = match resume {
                    Some(rv) => State::Watch { rv },
                    None => self.full_state(),
                };
                match end {
                    End::Clean => {
                        self.backoff.reset();
                        again
                    }
                    End::Expired => self.full_state(),
                    End::Failed => self.back_off(again),
                }
            }
        }
    }

    /// How the full state is taken: WatchList until the upstream refuses it.
    fn full_state(&self) -> State {
        if self.watch_list {
            State::WatchList
        } else {
            State::List
        }
    }

    fn back_off(&mut self, then: State) -> State {
        State::Backoff {
            then: Box::new(then),
            delay: self.backoff.delay(),
        }
    }
}

/// Makes the store's writer once discovery has found the kind.
pub type MakeWriter = Box<dyn FnOnce(Kind) -> Writer + Send>;

/// One resource's informer: its calls, its store's writer (once discovered) and its
/// transitions.
pub struct Informer {
    client: own::Client,
    gr: GroupResource,
    label: String,
    slot: Arc<OnceLock<Store>>,
    make: Option<MakeWriter>,
    writer: Option<Writer>,
    transitions: Transitions,
}

impl Informer {
    /// An informer of `gr` whose store, made by `make` after discovery, is published in
    /// `slot` for requests to read.
    pub fn new(
        client: own::Client,
        gr: GroupResource,
        slot: Arc<OnceLock<Store>>,
        make: MakeWriter,
        watch_list: bool,
    ) -> Informer {
        Informer {
            client,
            label: gr.to_string(),
            gr,
            slot,
            make: Some(make),
            writer: None,
            transitions: Transitions::new(watch_list),
        }
    }

    /// Does `state`'s work and returns the state after it.
    pub async fn step(&mut self, state: State) -> State {
        let outcome = match &state {
            State::Backoff { then, delay } => return wait(then, *delay).await,
            State::Discover => self.discover().await,
            State::WatchList | State::List | State::Watch { .. } => {
                // Only discovery leads past `Discover`, and it made the writer.
                let Some(writer) = self.writer.as_mut() else {
                    return State::Discover;
                };
                let (client, label) = (&self.client, self.label.as_str());
                match &state {
                    State::List => list(client, label, writer).await,
                    State::Watch { rv } => watch(client, label, writer, Start::Resume(*rv)).await,
                    _ => watch(client, label, writer, Start::WatchList).await,
                }
            }
        };
        self.transitions.next(state, outcome)
    }

    async fn discover(&mut self) -> Outcome {
        match calls::discover(&self.client, &self.gr).await {
            Ok(kind) => {
                if let Some(make) = self.make.take() {
                    let writer = make(kind);
                    let _ = self.slot.set(writer.as_reader());
                    self.writer = Some(writer);
                }
                Outcome::Discovered
            }
            Err(e) => {
                tracing::warn!(resource = %self.label, error = %crate::report::Chain(&e), "cache discovery failed; retrying");
                Outcome::Failed
            }
        }
    }
}

/// [`State::List`]'s work: a paginated LIST replaces the store's state.
async fn list(client: &own::Client, label: &str, writer: &mut Writer) -> Outcome {
    match calls::list_all(client, writer.kind()).await {
        Ok((objects, rv)) => {
            tracing::info!(resource = %label, objects = objects.len(), rv, "cache listed");
            writer.replace(objects, rv);
            Outcome::Listed { rv }
        }
        Err(e) => {
            tracing::warn!(resource = %label, error = %crate::report::Chain(&e), "cache list failed; retrying");
            Outcome::Failed
        }
    }
}

/// [`State::Watch`]'s and [`State::WatchList`]'s work: a watch, followed to its end.
async fn watch(client: &own::Client, label: &str, writer: &mut Writer, start: Start) -> Outcome {
    let generation = writer.generation();
    let started = Instant::now();
    let result = calls::watch(client, writer, start).await;
    let lasted = started.elapsed();
    let replaced = writer.generation() != generation;
    let resume = match start {
        Start::Resume(_) => Some(writer.rv()),
        Start::WatchList => replaced.then(|| writer.rv()),
    };
    if start == Start::WatchList && replaced {
        tracing::info!(resource = %label, rv = writer.rv(), "cache synced by WatchList");
    }
    let end = match (result, start) {
        (Ok(()), _) => End::Clean,
        (Err(WatchError::Refused), _) => return Outcome::WatchListRefused,
        (Err(WatchError::Failed(InformerError::Expired)), Start::Resume(_)) => {
            tracing::info!(resource = %label, "cache watch expired; relisting");
            End::Expired
        }
        (Err(WatchError::Failed(InformerError::Expired)), Start::WatchList) => End::Expired,
        (Err(WatchError::Failed(e)), Start::Resume(_)) => {
            tracing::warn!(resource = %label, error = %crate::report::Chain(&e), "cache watch failed; retrying");
            End::Failed
        }
        (Err(WatchError::Failed(e)), Start::WatchList) => {
            tracing::warn!(resource = %label, error = %crate::report::Chain(&e), "cache WatchList failed; retrying");
            End::Failed
        }
    };
    Outcome::Watched {
        end,
        lasted,
        resume,
    }
}

/// A backoff's wait: `delay` and up to a quarter more, then `then`.
async fn wait(then: &State, delay: Duration) -> State {
    tokio::time::sleep(jitter(delay)).await;
    then.clone()
}

/// Up to a quarter more, so that many informers do not retry in step.
fn jitter(base: Duration) -> Duration {
    base + base.mul_f64(rand::random_range(0.0..0.25))
}

/// Runs one resource's informer forever, from discovery.
pub async fn run(
    client: own::Client,
    gr: GroupResource,
    slot: Arc<OnceLock<Store>>,
    make: MakeWriter,
    watch_list: bool,
) {
    let mut informer = Informer::new(client, gr, slot, make, watch_list);
    let mut state = State::Discover;
    loop {
        state = informer.step(state).await;
    }
}

#[cfg(test)]
mod tests;
