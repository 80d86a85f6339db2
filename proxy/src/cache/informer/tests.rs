//! The informer's transitions: first as the function they are (backoff arithmetic under
//! paused time), then step by step against the simulated apiserver over real TLS, its
//! fault hooks playing the apiserver's refusals, compactions and dropped streams. Those use
//! real time: paused time would jump ahead while the runtime waits on the sockets.

use std::time::Duration;

use bulwark_sim::{Fleet, Pki, Seed, SimConfig};
use serde_json::json;

use super::*;
use crate::metrics::Metrics;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn backoff(then: State, delay: Duration) -> State {
    State::Backoff {
        then: Box::new(then),
        delay,
    }
}

fn watched(end: End, lasted: Duration, resume: Option<u64>) -> Outcome {
    Outcome::Watched {
        end,
        lasted,
        resume,
    }
}

/// The delays of `n` failures of `state` in a row.
fn delays(t: &mut Transitions, state: &State, outcome: Outcome, n: usize) -> Vec<u128> {
    (0..n)
        .map(|_| match t.next(state.clone(), outcome) {
            State::Backoff { then, delay } => {
                assert_eq!(*then, *state);
                delay.as_millis()
            }
            other => panic!("{other:?} after a failure"),
        })
        .collect()
}

#[test]
fn discovery_is_retried_with_a_backoff_that_doubles_up_to_its_cap() {
    let mut t = Transitions::new(true);
    let waits = delays(&mut t, &State::Discover, Outcome::Failed, 8);
    assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    // Found: the full state next, and the backoff starts over.
    assert_eq!(
        t.next(State::Discover, Outcome::Discovered),
        State::WatchList
    );
    assert_eq!(
        delays(
            &mut t,
            &State::WatchList,
            watched(End::Failed, ms(10), None),
            2
        ),
        [100, 200]
    );
}

#[test]
fn a_list_is_followed_by_a_watch_from_its_version_and_retried_when_it_fails() {
    let mut t = Transitions::new(false);
    assert_eq!(t.next(State::Discover, Outcome::Discovered), State::List);
    assert_eq!(
        delays(&mut t, &State::List, Outcome::Failed, 3),
        [100, 200, 400]
    );
    assert_eq!(
        t.next(State::List, Outcome::Listed { rv: 7 }),
        State::Watch { rv: 7 }
    );
    // The list reset the backoff.
    assert_eq!(
        t.next(
            State::Watch { rv: 7 },
            watched(End::Failed, ms(10), Some(9))
        ),
        backoff(State::Watch { rv: 9 }, ms(100))
    );
}

#[test]
fn a_clean_end_watches_again_from_the_last_version_at_once() {
    let mut t = Transitions::new(true);
    let failed = watched(End::Failed, ms(10), Some(5));
    delays(&mut t, &State::Watch { rv: 5 }, failed, 3);
    // Bookmarks and events moved the store from 5 to 12 before the stream ended.
    assert_eq!(
        t.next(
            State::Watch { rv: 5 },
            watched(End::Clean, ms(10), Some(12))
        ),
        State::Watch { rv: 12 }
    );
    // ... and a clean end starts the backoff over.
    assert_eq!(
        t.next(
            State::Watch { rv: 12 },
            watched(End::Failed, ms(10), Some(12))
        ),
        backoff(State::Watch { rv: 12 }, ms(100))
    );
}

#[test]
fn a_410_takes_the_full_state_again_without_waiting() {
    let expired = watched(End::Expired, ms(10), Some(5));
    let mut t = Transitions::new(true);
    assert_eq!(t.next(State::Watch { rv: 5 }, expired), State::WatchList);
    assert_eq!(t.next(State::WatchList, expired), State::WatchList);
    let mut t = Transitions::new(false);
    assert_eq!(t.next(State::Watch { rv: 5 }, expired), State::List);
}

#[test]
fn a_refused_watch_list_falls_back_to_list_for_good() {
    let mut t = Transitions::new(true);
    assert_eq!(
        t.next(State::WatchList, Outcome::WatchListRefused),
        State::List
    );
    assert_eq!(
        t.next(State::List, Outcome::Listed { rv: 3 }),
        State::Watch { rv: 3 }
    );
    let expired = watched(End::Expired, ms(10), Some(3));
    assert_eq!(t.next(State::Watch { rv: 3 }, expired), State::List);
}

#[test]
fn a_watch_list_that_ends_before_its_state_is_in_takes_it_again() {
    let mut t = Transitions::new(true);
    assert_eq!(
        t.next(State::WatchList, watched(End::Clean, ms(10), None)),
        State::WatchList
    );
    assert_eq!(
        t.next(State::WatchList, watched(End::Failed, ms(10), None)),
        backoff(State::WatchList, ms(100))
    );
    // One whose state was in (the initial-events-end bookmark came) watches on from it.
    assert_eq!(
        t.next(State::WatchList, watched(End::Failed, ms(10), Some(8))),
        backoff(State::Watch { rv: 8 }, ms(200))
    );
    assert_eq!(
        t.next(State::WatchList, watched(End::Clean, ms(10), Some(8))),
        State::Watch { rv: 8 }
    );
}

#[test]
fn failing_watches_back_off_to_the_cap_and_a_healthy_one_starts_over() {
    let mut t = Transitions::new(true);
    let watch = State::Watch { rv: 5 };
    let short = watched(End::Failed, ms(10), Some(5));
    assert_eq!(
        delays(&mut t, &watch, short, 8),
        [100, 200, 400, 800, 1600, 3200, 5000, 5000]
    );
    // Just under HEALTHY_WATCH: still a failing watch.
    let almost = watched(End::Failed, HEALTHY_WATCH - ms(1), Some(5));
    assert_eq!(delays(&mut t, &watch, almost, 1), [5000]);
    // One that ran HEALTHY_WATCH, then failed: the first wait again.
    let healthy = watched(End::Failed, HEALTHY_WATCH, Some(5));
    assert_eq!(delays(&mut t, &watch, healthy, 1), [100]);
    assert_eq!(delays(&mut t, &watch, short, 2), [200, 400]);
}

#[tokio::test(start_paused = true)]
async fn a_backoff_waits_its_delay_and_at_most_a_quarter_more() {
    for delay in [ms(100), ms(400), ms(5000)] {
        for _ in 0..20 {
            let started = Instant::now();
            assert_eq!(wait(&State::List, delay).await, State::List);
            let waited = started.elapsed();
            assert!(
                waited >= delay && waited <= delay + delay / 4,
                "{waited:?} for {delay:?}"
            );
        }
    }
}

/// A simulated apiserver seeded with three Secrets in `ns` (events kept: `event_ring`,
/// bookmarks every 100 ms), and an informer of Secrets in front of it, not started.
struct Sim {
    fleet: Fleet,
    informer: Informer,
    slot: Arc<OnceLock<Store>>,
    _dir: tempfile::TempDir,
}

async fn sim(event_ring: usize, watch_list: bool) -> Sim {
    let pki = Arc::new(Pki::new());
    let fleet = Fleet::start(SimConfig {
        pki: pki.clone(),
        seed: vec![Seed {
            resource: "secrets".into(),
            count: 3,
            size: 100,
            namespaces: vec!["ns".into()],
        }],
        event_ring,
        bookmark_interval: ms(100),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, pki.server_ca.cert_pem()).unwrap();
    let (cert, key) = pki
        .client_ca
        .client_cert("bulwark", &["system:masters"])
        .write(dir.path(), "own")
        .unwrap();
    let yaml = format!(
        "replicas: [\"{}\"]\nca: {}\nself: {{cert: {}, key: {}}}\ntimeouts: {{connect: 1s}}\n",
        fleet.addrs()[0],
        ca.display(),
        cert.display(),
        key.display()
    );
    let cfg: crate::config::Upstream = serde_norway::from_str(&yaml).unwrap();
    let slot = Arc::new(OnceLock::new());
    let informer = Informer::new(
        own::Client::from_config(&cfg, Metrics::new()).unwrap(),
        GroupResource {
            group: String::new(),
            resource: "secrets".into(),
        },
        slot.clone(),
        Box::new(|kind| Writer::new(kind, 100, 100)),
        watch_list,
    );
    Sim {
        fleet,
        informer,
        slot,
        _dir: dir,
    }
}

impl Sim {
    /// The store as requests read it.
    fn store(&self) -> Store {
        self.slot.get().expect("discovered").clone()
    }

    /// Full states the store has taken (LIST or WatchList): 1 after the first sync.
    fn full_states(&self) -> u64 {
        self.informer.writer.as_ref().map_or(0, Writer::generation)
    }
}

/// The simulator's version now.
fn rv(fleet: &Fleet) -> u64 {
    fleet.store().resource_version()
}

/// Creates a Secret or a ConfigMap `name` in `ns`; the simulator's version after.
fn create(fleet: &Fleet, resource: &str, name: &str) -> u64 {
    let kind = match resource {
        "secrets" => "Secret",
        _ => "ConfigMap",
    };
    let object = json!({
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns"},
    });
    fleet.store().create(resource, "ns", object).unwrap();
    rv(fleet)
}

/// The watches of Secrets asked for so far, as their `resourceVersion` (`None`: a
/// WatchList), and how many LIST pages of them.
fn calls(fleet: &Fleet) -> (Vec<Option<String>>, usize) {
    let seen = fleet.seen_requests();
    let secrets: Vec<&str> = seen
        .iter()
        .map(|r| r.path.as_str())
        .filter(|p| p.starts_with("/api/v1/secrets"))
        .collect();
    let watches = secrets
        .iter()
        .filter(|p| p.contains("watch=1"))
        .map(|p| {
            p.split(['?', '&'])
                .find_map(|kv| kv.strip_prefix("resourceVersion="))
                .map(str::to_owned)
        })
        .collect();
    let lists = secrets.iter().filter(|p| !p.contains("watch=1")).count();
    (watches, lists)
}

/// The state a backoff goes on with, or `state` itself.
fn after_backoff(state: &State) -> State {
    match state {
        State::Backoff { then, .. } => (**then).clone(),
        other => other.clone(),
    }
}

/// Steps `informer` from `state` until `done` (the step then in progress is dropped); the
/// states it went through, `state` first.
async fn drive(
    informer: &mut Informer,
    mut state: State,
    done: impl std::future::Future<Output = ()>,
) -> Vec<State> {
    let mut went = vec![state.clone()];
    tokio::pin!(done);
    loop {
        tokio::select! {
            next = informer.step(state.clone()) => {
                state = next;
                went.push(state.clone());
            }
            () = &mut done => return went,
        }
    }
}

/// Waits (real time, up to ten seconds) until `done`.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(ms(10)).await;
    }
}

#[tokio::test]
async fn discovery_failing_with_5xx_is_retried_after_its_backoff() {
    let mut s = sim(10_000, false).await;
    s.fleet.replica(0).set_fail(Some(503));
    let state = s.informer.step(State::Discover).await;
    assert_eq!(state, backoff(State::Discover, ms(100)));
    let state = s.informer.step(state).await;
    assert_eq!(state, State::Discover);
    assert_eq!(
        s.informer.step(state).await,
        backoff(State::Discover, ms(200))
    );
    assert!(s.slot.get().is_none(), "no store before discovery");
    s.fleet.replica(0).set_fail(None);
    assert_eq!(s.informer.step(State::Discover).await, State::List);
    assert_eq!(s.store().kind().kind, "Secret");
}

#[tokio::test]
async fn a_refused_watch_list_is_followed_by_a_paginated_list() {
    let mut s = sim(10_000, true).await;
    assert_eq!(s.informer.step(State::Discover).await, State::WatchList);
    // An apiserver without the WatchList feature refuses the request with a 4xx.
    s.fleet.replica(0).set_fail(Some(403));
    assert_eq!(s.informer.step(State::WatchList).await, State::List);
    s.fleet.replica(0).set_fail(None);
    let listed = rv(&s.fleet);
    assert_eq!(
        s.informer.step(State::List).await,
        State::Watch { rv: listed }
    );
    let store = s.store();
    assert!(store.synced());
    assert_eq!(store.size(None).0, 3);
    assert_eq!(store.rv(), listed);
    // (The refusal is the fault hook's: the simulator's request log does not show it.)
    assert_eq!(calls(&s.fleet), (vec![], 1));
    assert!(!s.informer.transitions.watch_list, "LIST from now on");
}

#[tokio::test]
async fn bookmarks_advance_the_version_and_a_dropped_watch_resumes_from_it() {
    let mut s = sim(10_000, true).await;
    assert_eq!(s.informer.step(State::Discover).await, State::WatchList);
    let store = s.store();
    let fleet = &s.fleet;

    // The WatchList fills the store; a write to another resource moves the apiserver's
    // version, which only a bookmark brings to the store; a Secret comes as an event.
    // Then the replica drops every connection.
    let watching = s.informer.step(State::WatchList);
    let (mut rv_bookmark, mut rv_secret) = (0, 0);
    let meanwhile = async {
        until("the WatchList's state is in", || store.synced()).await;
        assert_eq!(store.size(None).0, 3);
        rv_bookmark = create(fleet, "configmaps", "elsewhere");
        until("a bookmark moves the store", || store.rv() == rv_bookmark).await;
        rv_secret = create(fleet, "secrets", "during");
        until("the event is in", || store.rv() == rv_secret).await;
        fleet.replica(0).stop().await;
    };
    let (state, ()) = tokio::join!(watching, meanwhile);
    assert!(rv_secret > rv_bookmark && store.get("ns", "during").0.is_some());
    // However the stream broke (an error backs off first), the informer watches on from
    // the last version it had.
    assert_eq!(after_backoff(&state), State::Watch { rv: rv_secret });
    assert!(store.lag() > Duration::ZERO, "disconnected");

    // A write while nobody watches: the re-watch from that version brings it, with no
    // LIST and no new full state.
    fleet.replica(0).start().await;
    let rv_gap = create(fleet, "secrets", "gap");
    let went = drive(&mut s.informer, state, async {
        until("the re-watch brings the write", || store.rv() == rv_gap).await;
    })
    .await;
    assert!(
        went.iter()
            .all(|state| after_backoff(state) == State::Watch { rv: rv_secret }),
        "{went:?}"
    );
    assert!(store.get("ns", "gap").0.is_some());
    assert_eq!(store.lag(), Duration::ZERO, "connected");
    assert_eq!(s.full_states(), 1, "no relist");
    let (watches, lists) = calls(fleet);
    assert_eq!(lists, 0);
    assert_eq!(watches[0], None, "the WatchList");
    assert!(
        watches[1..]
            .iter()
            .all(|rv| *rv == Some(rv_secret.to_string())),
        "{watches:?}"
    );
}

#[tokio::test]
async fn a_watch_from_a_compacted_version_relists() {
    let mut s = sim(5, false).await;
    let fleet = &s.fleet;
    assert_eq!(s.informer.step(State::Discover).await, State::List);
    let listed = rv(fleet);
    assert_eq!(
        s.informer.step(State::List).await,
        State::Watch { rv: listed }
    );
    // More writes than the apiserver keeps events of, while the informer is not watching.
    for i in 0..10 {
        create(fleet, "configmaps", &format!("c{i}"));
    }
    let rv_last = create(fleet, "secrets", "late");
    let watch = State::Watch { rv: listed };
    assert_eq!(s.informer.step(watch).await, State::List);
    assert_eq!(
        s.informer.step(State::List).await,
        State::Watch { rv: rv_last }
    );
    let store = s.store();
    assert_eq!(store.size(None).0, 4);
    assert!(store.get("ns", "late").0.is_some());
    assert_eq!(s.full_states(), 2, "relisted");
    assert_eq!(calls(fleet), (vec![Some(listed.to_string())], 2));
}
