//! The informer's transitions, as the function they are (backoff arithmetic under paused
//! time).

use std::time::Duration;

use super::*;

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
