//! Admission tests under paused tokio time on a current-thread runtime, no sockets:
//! fairness between flows, LIST cost, byte budgets, refusals, shadow mode, reload and
//! eviction, each as a client would observe them (admitted when, refused why).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::{Instant, sleep};

use super::queue::{deal, flow_hash};
use super::*;
use crate::classify::classify;
use crate::rules::{LevelSpec, Matched, Mode, Rate, RuleHeaders};

fn level(name: &str, seats: u32, queues: u32, hand: u32, queue_length: u32) -> Arc<LevelSpec> {
    Arc::new(LevelSpec {
        name: name.into(),
        exempt: false,
        seats,
        queues,
        hand_size: hand,
        queue_length,
        max_wait: Duration::from_secs(60),
        max_seats_per_flow: 0,
    })
}

fn matched(level: &Arc<LevelSpec>, flow: &str) -> Matched {
    Matched {
        rule: Arc::from(flow.split('/').next().unwrap_or(flow)),
        level: level.clone(),
        flow: flow.into(),
        rate: None,
        watches: None,
        mode: Mode::Enforce,
        staleness: None,
        headers: RuleHeaders::default(),
    }
}

fn req(uri: &str) -> RequestInfo {
    classify(&http::Method::GET, &uri.parse().unwrap()).unwrap()
}

fn user(name: &str) -> User {
    User {
        username: name.into(),
        ..User::default()
    }
}

/// Admission over one in-memory replica with `budget` bytes, where 1,000 bytes weigh one
/// seat.
fn admission(levels: &[Arc<LevelSpec>], budget: Arc<LocalBudget>) -> (Arc<Admission>, Metrics) {
    let metrics = Metrics::new();
    let config = AdmissionConfig {
        seat_unit_bytes: Some(1_000),
        unknown_list_bytes: Some(1_000),
        flow_idle: Duration::from_secs(60),
        ..AdmissionConfig::default()
    };
    let admission = Admission::with_budget(levels, budget, config, metrics.clone());
    (admission, metrics)
}

fn big_budget() -> Arc<LocalBudget> {
    Arc::new(LocalBudget::new(1, u64::MAX / 4))
}

fn level_json(admission: &Admission, name: &str) -> serde_json::Value {
    admission.levels_json()["levels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name && l["draining"] == false)
        .cloned()
        .unwrap()
}

/// What one flow got during a run.
#[derive(Default, Debug)]
struct Tally {
    admitted: u32,
    refused: Vec<Reason>,
    /// Seat-seconds used.
    seat_time: f64,
    longest_wait: Duration,
}

/// Runs `clients` concurrent clients of `m`, each admitting `info` and holding it for
/// `hold` in a loop until `until`; a refused client waits `Retry-After` and tries again.
fn spawn_clients(
    admission: &Arc<Admission>,
    m: &Matched,
    info: &RequestInfo,
    clients: usize,
    hold: Duration,
    until: Instant,
    tally: &Rc<RefCell<Tally>>,
) {
    for _ in 0..clients {
        let (admission, m, info, tally) =
            (admission.clone(), m.clone(), info.clone(), tally.clone());
        tokio::task::spawn_local(async move {
            while Instant::now() < until {
                let asked = Instant::now();
                match admission
                    .admit(&m, &info, &user("u"), Answer::Upstream)
                    .await
                {
                    Ok(permit) => {
                        let waited = asked.elapsed();
                        let seats = admission
                            .shared
                            .cost
                            .seats(permit.expected_bytes(), m.level.seats);
                        {
                            let mut t = tally.borrow_mut();
                            t.admitted += 1;
                            t.longest_wait = t.longest_wait.max(waited);
                        }
                        sleep(hold).await;
                        tally.borrow_mut().seat_time += f64::from(seats) * hold.as_secs_f64();
                        drop(permit);
                    }
                    Err(refusal) => {
                        tally.borrow_mut().refused.push(refusal.reason);
                        sleep(refusal.retry_after.unwrap_or(Duration::from_secs(1))).await;
                    }
                }
            }
        });
    }
}

async fn run_local<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::LocalSet::new().run_until(f).await
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn a_flooding_flow_cannot_starve_another_flow_in_its_level() {
    run_local(async {
        let spec = level("shared", 4, 32, 2, 100);
        let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
        let get = req("/api/v1/namespaces/a/configmaps/c");
        let until = Instant::now() + Duration::from_secs(30);
        let flood = Rc::new(RefCell::new(Tally::default()));
        let quiet = Rc::new(RefCell::new(Tally::default()));
        spawn_clients(
            &admission,
            &matched(&spec, "flood/a"),
            &get,
            150,
            Duration::from_millis(100),
            until,
            &flood,
        );
        // Let the flood fill its queues first.
        sleep(Duration::from_millis(500)).await;
        spawn_clients(
            &admission,
            &matched(&spec, "quiet/b"),
            &get,
            1,
            Duration::from_millis(100),
            until,
            &quiet,
        );
        sleep(Duration::from_secs(31)).await;
        let (flood, quiet) = (flood.borrow(), quiet.borrow());
        assert!(quiet.refused.is_empty(), "{:?}", quiet.refused);
        // A FIFO would make it wait behind ~150 requests on 4 seats: ~3.7 s each time.
        assert!(
            quiet.longest_wait <= Duration::from_millis(250),
            "the quiet flow waited {:?}",
            quiet.longest_wait
        );
        assert!(quiet.admitted >= 100, "{}", quiet.admitted);
        assert!(
            flood.admitted > quiet.admitted,
            "the flood still uses the spare seats"
        );
    })
    .await;
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn ten_seat_lists_and_one_seat_gets_share_seat_time_equally() {
    run_local(async {
        let spec = level("mixed", 10, 64, 1, 1000);
        let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
        let list = req("/api/v1/namespaces/big/secrets");
        admission.observe_list(&list, 10_000, Some(10));
        assert_eq!(
            admission
                .shared
                .cost
                .seats(admission.expected_bytes(&list), 10),
            10
        );
        let get = req("/api/v1/namespaces/small/secrets/s");
        let (lists, gets) = (matched(&spec, "lister/x"), matched(&spec, "getter/y"));
        assert_ne!(
            deal(flow_hash(&lists.flow), 64, 1),
            deal(flow_hash(&gets.flow), 64, 1),
            "the two flows must not share a queue for this test"
        );
        let until = Instant::now() + Duration::from_secs(60);
        let l = Rc::new(RefCell::new(Tally::default()));
        let g = Rc::new(RefCell::new(Tally::default()));
        let hold = Duration::from_millis(100);
        spawn_clients(&admission, &lists, &list, 5, hold, until, &l);
        spawn_clients(&admission, &gets, &get, 40, hold, until, &g);
        sleep(Duration::from_secs(61)).await;
        let (l, g) = (l.borrow(), g.borrow());
        assert!(l.refused.is_empty() && g.refused.is_empty());
        let (a, b) = (l.seat_time, g.seat_time);

        assert!(
            (a - b).abs() / a.max(b) <= 0.10,
            "LIST flow {a:.1} seat-s ({} requests), GET flow {b:.1} seat-s ({} requests)",
            l.admitted,
            g.admitted
        );
        // And the level was kept busy: at least half its seat-time used.
        assert!(a + b >= 0.5 * 10.0 * 60.0, "{a} + {b}");
    })
    .await;
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn shuffle_sharding_keeps_a_flow_whole_when_it_shares_a_queue_with_a_flood() {
    run_local(async {
        let (queues, hand) = (8usize, 2usize);
        let spec = level("sharded", 2, queues as u32, hand as u32, 5);
        let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
        let flood = matched(&spec, "flood/a");
        let flood_hand = deal(flow_hash(&flood.flow), queues, hand);
        // A flow whose hand shares exactly one queue with the flood's, and whose first
        // card is that queue: only joining the shorter queue of the hand saves it.
        let victim = (0..)
            .map(|i| format!("victim/{i}"))
            .find(|key| {
                let h = deal(flow_hash(key), queues, hand);
                h.iter().filter(|q| flood_hand.contains(q)).count() == 1
                    && flood_hand.contains(&h[0])
            })
            .unwrap();
        let victim = matched(&spec, &victim);
        let get = req("/api/v1/namespaces/a/pods/p");
        let until = Instant::now() + Duration::from_secs(20);
        let f = Rc::new(RefCell::new(Tally::default()));
        let v = Rc::new(RefCell::new(Tally::default()));
        spawn_clients(
            &admission,
            &flood,
            &get,
            60,
            Duration::from_millis(200),
            until,
            &f,
        );
        sleep(Duration::from_millis(100)).await;
        spawn_clients(
            &admission,
            &victim,
            &get,
            1,
            Duration::from_millis(200),
            until,
            &v,
        );
        sleep(Duration::from_secs(21)).await;
        let (f, v) = (f.borrow(), v.borrow());
        assert!(
            f.refused.contains(&Reason::QueueFull),
            "the flood fills its queues and is refused"
        );
        assert!(
            v.refused.is_empty(),
            "the shared flow was refused: {:?}",
            v.refused
        );
        assert!(
            v.longest_wait <= Duration::from_millis(500),
            "{:?}",
            v.longest_wait
        );
    })
    .await;
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn the_cost_estimate_follows_a_collection_that_grows_tenfold() {
    let spec = level("lists", 100, 8, 2, 10);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let m = matched(&spec, "op/x");
    let all = req("/api/v1/secrets");
    let filtered = req("/api/v1/secrets?labelSelector=team%3Da");
    // 100 secrets of 1 kB.
    admission.observe_list(&all, 100_000, Some(100));
    assert_eq!(admission.expected_bytes(&all), 100_000);
    // The collection grows tenfold; clients see bigger responses as it grows.
    for size in [250_000u64, 500_000, 1_000_000] {
        admission.observe_list(&filtered, size / 10, Some(size / 10_000));
        admission.observe_list(&all, size, Some(size / 1_000));
    }
    assert_eq!(admission.expected_bytes(&all), 1_000_000);
    // An etcd LIST with a selector still reads the whole grown collection.
    assert_eq!(admission.expected_bytes(&filtered), 1_000_000);
    let permit = admission
        .admit(&m, &filtered, &user("x"), Answer::Upstream)
        .await
        .unwrap();
    assert_eq!(permit.expected_bytes(), 1_000_000);
    drop(permit);
    // Only filtered LISTs seen: the largest one raises the scope at once.
    let pods = req("/api/v1/pods?fieldSelector=spec.nodeName%3Dn1");
    admission.observe_list(&pods, 10_000, Some(10));
    admission.observe_list(&pods, 100_000, Some(100));
    assert_eq!(admission.expected_bytes(&pods), 100_000);
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn the_byte_budget_holds_under_concurrent_lists_and_an_oversized_list_runs_alone() {
    run_local(async {
        let spec = level("lists", 100, 64, 4, 100);
        let budget = Arc::new(LocalBudget::new(2, 1_000));
        let (admission, _) = admission(std::slice::from_ref(&spec), budget.clone());
        let small = req("/api/v1/namespaces/small/secrets");
        let huge = req("/api/v1/namespaces/huge/secrets");
        admission.observe_list(&small, 300, Some(3));
        admission.observe_list(&huge, 5_000, Some(50));
        let peak = Rc::new(RefCell::new(vec![0u64; 2]));
        let huge_alone = Rc::new(RefCell::new(0u32));
        let done = Rc::new(RefCell::new(0u32));
        let mut tasks = Vec::new();
        for i in 0..40 {
            let info = if i % 10 == 5 {
                huge.clone()
            } else {
                small.clone()
            };
            let m = matched(&spec, &format!("lister/{i}"));
            let (admission, budget, peak, huge_alone, done) = (
                admission.clone(),
                budget.clone(),
                peak.clone(),
                huge_alone.clone(),
                done.clone(),
            );
            tasks.push(tokio::task::spawn_local(async move {
                let permit = admission
                    .admit(&m, &info, &user("u"), Answer::Upstream)
                    .await
                    .expect("admitted");
                let now = budget.in_flight();
                for (p, n) in peak.borrow_mut().iter_mut().zip(&now) {
                    *p = (*p).max(*n);
                }
                if permit.expected_bytes() == 5_000 {
                    let replica = permit.replica().unwrap();
                    let index: usize = replica[1..].parse().unwrap();
                    assert_eq!(
                        now[index], 5_000,
                        "an oversized LIST runs alone on {replica}"
                    );
                    *huge_alone.borrow_mut() += 1;
                }
                // While LISTs wait for bytes they hold no seats.
                let level = level_json(&admission, "lists");
                assert!(level["executingRequests"].as_u64().unwrap() <= 2 * 3);
                sleep(Duration::from_millis(100)).await;
                drop(permit);
                *done.borrow_mut() += 1;
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*done.borrow(), 40);
        assert_eq!(*huge_alone.borrow(), 4);
        // The small ones never pushed a replica over its budget.
        let peak = peak.borrow();
        assert!(peak.iter().all(|&p| p <= 1_000 || p == 5_000), "{peak:?}");
        assert_eq!(budget.in_flight(), vec![0, 0]);
    })
    .await;
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn a_list_whose_bytes_never_free_is_refused_with_byte_budget() {
    let mut spec = (*level("lists", 10, 4, 1, 10)).clone();
    spec.max_wait = Duration::from_secs(2);
    let spec = Arc::new(spec);
    let budget = Arc::new(LocalBudget::new(1, 1_000));
    let (admission, _) = admission(std::slice::from_ref(&spec), budget.clone());
    let list = req("/api/v1/namespaces/a/secrets");
    admission.observe_list(&list, 800, Some(8));
    let first = admission
        .admit(&matched(&spec, "a/1"), &list, &user("u"), Answer::Upstream)
        .await
        .unwrap();
    let started = Instant::now();
    let refusal = admission
        .admit(&matched(&spec, "b/2"), &list, &user("u"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::ByteBudget);
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert_eq!(level_json(&admission, "lists")["waiting"], 0);
    drop(first);
    assert_eq!(budget.in_flight(), vec![0]);
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn retry_after_grows_and_decays_per_flow_and_an_innocent_flow_hears_one_second() {
    // One seat, no queue: while a long request holds the seat, everyone else is refused.
    let spec = level("tiny", 1, 1, 1, 0);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let get = req("/api/v1/namespaces/a/pods/p");
    let holder = admission
        .admit(
            &matched(&spec, "holder/h"),
            &get,
            &user("h"),
            Answer::Upstream,
        )
        .await
        .unwrap();
    let noisy = matched(&spec, "noisy/n");
    let mut heard = Vec::new();
    for _ in 0..7 {
        let refusal = admission
            .admit(&noisy, &get, &user("n"), Answer::Upstream)
            .await
            .unwrap_err();
        assert_eq!(refusal.reason, Reason::QueueFull);
        let after = refusal.retry_after.unwrap();
        heard.push(after.as_secs());
        // The client waits exactly as told and tries again.
        sleep(after).await;
    }
    assert_eq!(heard, vec![1, 2, 4, 8, 16, 32, 32]);
    let innocent = admission
        .admit(
            &matched(&spec, "innocent/i"),
            &get,
            &user("i"),
            Answer::Upstream,
        )
        .await
        .unwrap_err();
    assert_eq!(innocent.retry_after, Some(Duration::from_secs(1)));
    let response = innocent.into_response();
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(response.headers()["x-bulwark-rule"], "innocent");
    assert_eq!(response.headers()["x-bulwark-level"], "tiny");
    assert_eq!(response.headers()["x-bulwark-reason"], "queue_full");
    // The noisy flow stops for a while: its Retry-After shrinks.
    sleep(Duration::from_secs(32)).await;
    let after = admission
        .admit(&noisy, &get, &user("n"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(after.retry_after, Some(Duration::from_secs(16)));
    sleep(Duration::from_secs(600)).await;
    let after = admission
        .admit(&noisy, &get, &user("n"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(after.retry_after, Some(Duration::from_secs(1)));
    drop(holder);
    assert!(
        admission
            .admit(&noisy, &get, &user("n"), Answer::Upstream)
            .await
            .is_ok()
    );
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn a_rate_limited_flow_is_refused_with_its_rule_and_level() {
    let spec = level("rated", 10, 8, 2, 10);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let mut m = matched(&spec, "poller/u1");
    m.rate = Some(Rate { qps: 2.0, burst: 2 });
    let get = req("/api/v1/namespaces/a/events");
    assert!(
        admission
            .admit(&m, &get, &user("u1"), Answer::Upstream)
            .await
            .is_ok()
    );
    assert!(
        admission
            .admit(&m, &get, &user("u1"), Answer::Upstream)
            .await
            .is_ok()
    );
    let refusal = admission
        .admit(&m, &get, &user("u1"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::RateLimited);
    assert_eq!(refusal.rule.as_deref(), Some("poller"));
    assert_eq!(refusal.level.as_deref(), Some("rated"));
    assert_eq!(refusal.retry_after, Some(Duration::from_secs(1)));
    // Another flow of the same rule has its own bucket.
    let mut other = m.clone();
    other.flow = "poller/u2".into();
    assert!(
        admission
            .admit(&other, &get, &user("u2"), Answer::Upstream)
            .await
            .is_ok()
    );
    sleep(Duration::from_millis(500)).await;
    assert!(
        admission
            .admit(&m, &get, &user("u1"), Answer::Upstream)
            .await
            .is_ok()
    );
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn shadow_mode_passes_everything_and_counts() {
    let spec = level("shadowed", 1, 1, 1, 0);
    let (admission, metrics) = admission(std::slice::from_ref(&spec), big_budget());
    let mut m = matched(&spec, "trial/u");
    m.rate = Some(Rate { qps: 1.0, burst: 1 });
    m.watches = Some(1);
    let watch = req("/api/v1/namespaces/a/pods?watch=true");
    let get = req("/api/v1/namespaces/a/pods/p");
    // An enforced flow holds the level's only seat.
    let holder = admission
        .admit(
            &matched(&spec, "holder/h"),
            &get,
            &user("h"),
            Answer::Upstream,
        )
        .await
        .unwrap();
    m.mode = Mode::Shadow;
    let mut permits = Vec::new();
    for _ in 0..10 {
        permits.push(
            admission
                .admit(&m, &watch, &user("u"), Answer::Upstream)
                .await
                .expect("shadow never refuses"),
        );
    }
    let count = |reason: &str| {
        metrics
            .shadow_rejections_total
            .with_label_values(&["trial", "shadowed", reason])
            .get()
    };
    assert_eq!(count("rate_limited"), 9);
    assert_eq!(count("watch_limit"), 9);
    assert_eq!(count("queue_full"), 10);
    assert!(metrics.render().contains("bulwark_shadow_rejections_total"));
    // The same rule enforced refuses.
    m.mode = Mode::Enforce;
    let refusal = admission
        .admit(&m, &watch, &user("u"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::RateLimited);
    drop((holder, permits));
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn a_reload_under_load_drops_nothing() {
    run_local(async {
        let spec = level("busy", 2, 16, 2, 100);
        let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
        let get = req("/api/v1/namespaces/a/pods/p");
        let done = Rc::new(RefCell::new((0u32, Vec::new())));
        let start = |admission: &Arc<Admission>, m: Matched, n: usize| {
            for _ in 0..n {
                let (admission, m, get, done) =
                    (admission.clone(), m.clone(), get.clone(), done.clone());
                tokio::task::spawn_local(async move {
                    match admission
                        .admit(&m, &get, &user("u"), Answer::Upstream)
                        .await
                    {
                        Ok(permit) => {
                            sleep(Duration::from_millis(100)).await;
                            drop(permit);
                            done.borrow_mut().0 += 1;
                        }
                        Err(refusal) => done.borrow_mut().1.push(refusal.reason),
                    }
                });
            }
        };
        for i in 0..20 {
            start(&admission, matched(&spec, &format!("r/{i}")), 2);
        }
        sleep(Duration::from_millis(1)).await;
        assert_eq!(level_json(&admission, "busy")["waiting"], 38);
        // Same definition: the level keeps its queues and what waits in them.
        admission.update_levels(&[Arc::new((*spec).clone()), level("other", 1, 1, 1, 1)]);
        assert_eq!(level_json(&admission, "busy")["waiting"], 38);
        assert_eq!(
            admission.levels_json()["levels"].as_array().unwrap().len(),
            2
        );
        sleep(Duration::from_millis(150)).await;
        // Changed definition: the old level drains, new requests go to the new one.
        let bigger = level("busy", 4, 16, 2, 100);
        admission.update_levels(std::slice::from_ref(&bigger));
        let levels = admission.levels_json();
        let draining: Vec<_> = levels["levels"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["draining"] == true)
            .collect();
        // The removed level held nothing and is gone at once; the changed one drains.
        assert_eq!(draining.len(), 1, "{levels}");
        assert_eq!(draining[0]["name"], "busy");
        for i in 0..10 {
            start(&admission, matched(&bigger, &format!("r/{i}")), 2);
        }
        sleep(Duration::from_secs(10)).await;
        let done = done.borrow();
        assert!(done.1.is_empty(), "refused: {:?}", done.1);
        assert_eq!(done.0, 60);
        // Drained levels are forgotten at the next reload.
        admission.update_levels(std::slice::from_ref(&bigger));
        assert_eq!(
            admission.levels_json()["levels"].as_array().unwrap().len(),
            1
        );
    })
    .await;
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn idle_flows_are_evicted() {
    let spec = level("many", 100, 64, 4, 10);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let get = req("/api/v1/namespaces/a/pods/p");
    let watch = req("/api/v1/namespaces/a/pods?watch=true");
    let rate = Some(Rate {
        qps: 10.0,
        burst: 10,
    });
    for i in 0..10_000 {
        let mut m = matched(&spec, &format!("agents/node-{i}"));
        m.rate = rate;
        drop(
            admission
                .admit(&m, &get, &user("u"), Answer::Upstream)
                .await
                .unwrap(),
        );
    }
    assert_eq!(admission.flows(), 10_000);
    // One flow keeps a watch open: it is not forgotten.
    let mut watcher = matched(&spec, "agents/watcher");
    watcher.watches = Some(5);
    let mut permit = admission
        .admit(&watcher, &watch, &user("w"), Answer::Upstream)
        .await
        .unwrap();
    let guard = permit.watch_guard().unwrap();
    drop(permit);
    // Time passes with a trickle of other requests: each sweeps a little.
    for i in 0..200 {
        sleep(Duration::from_secs(1)).await;
        let mut m = matched(&spec, &format!("later/{i}"));
        m.rate = rate;
        drop(
            admission
                .admit(&m, &get, &user("u"), Answer::Upstream)
                .await
                .unwrap(),
        );
    }
    assert!(
        admission.flows() <= 201,
        "{} flows remembered",
        admission.flows()
    );
    drop(guard);
    sleep(Duration::from_secs(3600)).await;
    admission.evict_idle_flows();
    assert_eq!(admission.flows(), 0);
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn level_seats_shrink_with_the_share_of_healthy_replicas() {
    let spec = level("fleet", 6, 16, 4, 100);
    let budget = Arc::new(LocalBudget::new(3, 1_000_000));
    let (admission, metrics) = admission(std::slice::from_ref(&spec), budget.clone());
    let get = req("/api/v1/namespaces/a/pods/p");
    budget.set_healthy(1);
    let mut permits = Vec::new();
    for i in 0..2 {
        permits.push(
            admission
                .admit(
                    &matched(&spec, &format!("r/{i}")),
                    &get,
                    &user("u"),
                    Answer::Upstream,
                )
                .await
                .unwrap(),
        );
    }
    let (third, u) = (matched(&spec, "r/3"), user("u"));
    let timed = tokio::time::timeout(
        Duration::from_secs(1),
        admission.admit(&third, &get, &u, Answer::Upstream),
    )
    .await;
    assert!(
        timed.is_err(),
        "a third request waits: 6 seats x 1/3 healthy = 2"
    );
    assert_eq!(level_json(&admission, "fleet")["seatsLimit"], 2);
    assert_eq!(
        metrics
            .level_seats_limit
            .with_label_values(&["fleet"])
            .get(),
        2
    );
    budget.set_healthy(3);
    for i in 2..6 {
        permits.push(
            admission
                .admit(
                    &matched(&spec, &format!("r/{i}")),
                    &get,
                    &user("u"),
                    Answer::Upstream,
                )
                .await
                .unwrap(),
        );
    }
    assert_eq!(level_json(&admission, "fleet")["executingSeats"], 6);
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn watches_take_a_seat_only_while_starting_then_count_against_the_flow() {
    let spec = level("watchers", 1, 4, 1, 10);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let watch = req("/api/v1/namespaces/a/pods?watch=true");
    let mut m = matched(&spec, "agent/a");
    m.watches = Some(2);
    let mut streams = Vec::new();
    for _ in 0..2 {
        let mut permit = admission
            .admit(&m, &watch, &user("a"), Answer::Upstream)
            .await
            .unwrap();
        assert!(permit.holds_seats());
        // The response head arrived: the watch runs on without a seat.
        permit.release_seats();
        streams.push(permit.watch_guard().unwrap());
        drop(permit);
    }
    assert_eq!(level_json(&admission, "watchers")["executingSeats"], 0);
    let refusal = admission
        .admit(&m, &watch, &user("a"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::WatchLimit);
    streams.pop();
    assert!(
        admission
            .admit(&m, &watch, &user("a"), Answer::Upstream)
            .await
            .is_ok()
    );
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn a_client_that_goes_away_leaves_its_queue_and_frees_nothing_it_did_not_hold() {
    let spec = level("cancel", 1, 4, 1, 10);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let get = req("/api/v1/namespaces/a/pods/p");
    let holder = admission
        .admit(&matched(&spec, "h/1"), &get, &user("u"), Answer::Upstream)
        .await
        .unwrap();
    let gone = tokio::time::timeout(
        Duration::from_secs(1),
        admission.admit(&matched(&spec, "g/2"), &get, &user("u"), Answer::Upstream),
    )
    .await;
    assert!(gone.is_err());
    let level = level_json(&admission, "cancel");
    assert_eq!(level["waiting"], 0);
    assert_eq!(level["executingSeats"], 1, "the holder keeps its seat");
    drop(holder);
    assert_eq!(level_json(&admission, "cancel")["executingSeats"], 0);
    // A queue timeout says so.
    let holder = admission
        .admit(&matched(&spec, "h/1"), &get, &user("u"), Answer::Upstream)
        .await
        .unwrap();
    let refusal = admission
        .admit(&matched(&spec, "t/3"), &get, &user("u"), Answer::Upstream)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::QueueTimeout);
    drop(holder);
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn exempt_levels_have_no_limits() {
    let mut spec = (*level("exempt", 1, 1, 1, 0)).clone();
    spec.exempt = true;
    let spec = Arc::new(spec);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let mut m = matched(&spec, "admins/root");
    m.rate = Some(Rate { qps: 1.0, burst: 1 });
    let list = req("/api/v1/secrets");
    let mut permits = Vec::new();
    for _ in 0..100 {
        permits.push(
            admission
                .admit(&m, &list, &user("root"), Answer::Upstream)
                .await
                .unwrap(),
        );
    }
    assert!(permits.iter().all(|p| !p.holds_seats()));
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn one_flow_holds_at_most_its_cap_of_a_levels_seats() {
    let mut spec = (*level("capped", 4, 8, 2, 10)).clone();
    spec.max_seats_per_flow = 3;
    let spec = Arc::new(spec);
    let (admission, _) = admission(std::slice::from_ref(&spec), big_budget());
    let get = req("/api/v1/namespaces/a/pods/p");
    let hog = matched(&spec, "r/hog");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            admission
                .admit(&hog, &get, &user("hog"), Answer::Upstream)
                .await
                .unwrap(),
        );
    }
    // The hog's fourth waits behind its own seats, though one seat is free...
    let fourth = tokio::time::timeout(
        Duration::from_secs(1),
        admission.admit(&hog, &get, &user("hog"), Answer::Upstream),
    )
    .await;
    assert!(fourth.is_err(), "the hog took a fourth seat");
    assert_eq!(level_json(&admission, "capped")["executingSeats"], 3);
    // ...which is another flow's at once.
    let other = admission
        .admit(
            &matched(&spec, "r/other"),
            &get,
            &user("other"),
            Answer::Upstream,
        )
        .now_or_never()
        .expect("admitted without waiting")
        .unwrap();
    assert!(other.holds_seats());
    // One of the hog's own ending lets its next one in.
    held.pop();
    let next = admission
        .admit(&hog, &get, &user("hog"), Answer::Upstream)
        .now_or_never()
        .expect("admitted without waiting");
    assert!(next.unwrap().holds_seats());
}

/// Rules with one level and a kube-proxy rule keyed by `flow` with 10 watches per flow.
fn kube_proxy_rules(flow: &str) -> crate::rules::RuleSet {
    let text = format!(
        "levels:\n\
         \x20 - {{name: nodes, seats: 10, queues: 64, handSize: 6, queueLength: 50}}\n\
         rules:\n\
         \x20 - name: kube-proxy\n\
         \x20   precedence: 90\n\
         \x20   match: {{serviceAccounts: [kube-system/kube-proxy]}}\n\
         \x20   level: nodes\n\
         \x20   flow: {flow}\n\
         \x20   watches: 10\n"
    );
    crate::rules::RuleSet::from_sources(&[crate::rules::Source {
        path: "kube-proxy.yaml".into(),
        text,
    }])
    .unwrap()
}

/// kube-proxy's ServiceAccount, with the node-name claim of a bound token on `node`.
fn kube_proxy_on(node: Option<&str>) -> User {
    let mut user = crate::rules::cli_user("system:serviceaccount:kube-system:kube-proxy", &[]);
    if let Some(node) = node {
        user.extra.insert(
            crate::rules::client::NODE_NAME_CLAIM.into(),
            vec![node.into()],
        );
    }
    user
}

/// Opens a watch of `user` from `source` under `set` and keeps it open; the refusal if any.
async fn open_watch(
    admission: &Admission,
    set: &crate::rules::RuleSet,
    user: &User,
    source: std::net::IpAddr,
    open: &mut Vec<FlowWatch>,
) -> Result<(), Refusal> {
    let watch = req("/api/v1/services?watch=true");
    let m = set.matches_from(user, &watch, Some(source));
    let mut permit = admission.admit(&m, &watch, user, Answer::Upstream).await?;
    // The response head arrived: the watch runs on without its seat.
    permit.release_seats();
    open.push(permit.watch_guard().expect("a limited watch is counted"));
    Ok(())
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn a_daemonset_on_2000_nodes_gets_its_watch_limit_per_node_under_flow_node() {
    let set = kube_proxy_rules("node");
    let (admission, _) = admission(set.levels(), big_budget());
    let mut open = Vec::new();
    // One ServiceAccount on 2,000 nodes, each behind its own address: all admitted.
    for i in 0..2_000u32 {
        let node = format!("node-{i}");
        let source = std::net::IpAddr::from([10, 1, (i / 256) as u8, (i % 256) as u8]);
        open_watch(
            &admission,
            &set,
            &kube_proxy_on(Some(&node)),
            source,
            &mut open,
        )
        .await
        .unwrap_or_else(|r| panic!("{node} refused: {}", r.message));
    }
    assert_eq!(open.len(), 2_000);
    assert_eq!(admission.flows(), 2_000, "one flow per node");
    // One node's kube-proxy: nine more make its ten, the eleventh is refused.
    let on_0 = kube_proxy_on(Some("node-0"));
    let source = std::net::IpAddr::from([10, 1, 0, 0]);
    for _ in 0..9 {
        open_watch(&admission, &set, &on_0, source, &mut open)
            .await
            .unwrap();
    }
    let refusal = open_watch(&admission, &set, &on_0, source, &mut open)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::WatchLimit);
    assert_eq!(refusal.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refusal.reason.as_str(), "watch_limit");
    assert!(
        refusal.message.contains("node:node-0"),
        "{}",
        refusal.message
    );
    // Another node's flow is untouched, even from the same address.
    open_watch(
        &admission,
        &set,
        &kube_proxy_on(Some("node-1")),
        source,
        &mut open,
    )
    .await
    .unwrap();

    // The same fleet keyed by user: one flow, and the eleventh node is refused.
    let set = kube_proxy_rules("user");
    let (by_user, _) = self::admission(set.levels(), big_budget());
    let mut open = Vec::new();
    let mut refused = None;
    for i in 0..11u32 {
        let node = format!("node-{i}");
        let source = std::net::IpAddr::from([10, 1, 0, i as u8]);
        if let Err(refusal) = open_watch(
            &by_user,
            &set,
            &kube_proxy_on(Some(&node)),
            source,
            &mut open,
        )
        .await
        {
            refused = Some((i, refusal.reason));
        }
    }
    assert_eq!(refused, Some((10, Reason::WatchLimit)));
}

#[tokio::test(start_paused = true, flavor = "current_thread")]
async fn clients_without_a_node_claim_get_a_flow_per_address_and_user() {
    let set = kube_proxy_rules("node");
    let (admission, _) = admission(set.levels(), big_budget());
    let mut open = Vec::new();
    let a = std::net::IpAddr::from([10, 0, 0, 1]);
    let b = std::net::IpAddr::from([10, 0, 0, 2]);
    // No claim (a client certificate's user): keyed by its address.
    let unnamed = kube_proxy_on(None);
    for _ in 0..10 {
        open_watch(&admission, &set, &unnamed, a, &mut open)
            .await
            .unwrap();
    }
    let refusal = open_watch(&admission, &set, &unnamed, a, &mut open)
        .await
        .unwrap_err();
    assert_eq!(refusal.reason, Reason::WatchLimit);
    // Another address is another client.
    open_watch(&admission, &set, &unnamed, b, &mut open)
        .await
        .unwrap();
    // A node named like the full address's text is not that address.
    open_watch(
        &admission,
        &set,
        &kube_proxy_on(Some("10.0.0.1")),
        a,
        &mut open,
    )
    .await
    .unwrap();
}

/// A flow's rate-limit message read from the thread's memo says what one written afresh
/// says: another share of the fleet, or another flow of the same hash, is not answered
/// with a message kept for the first.
#[test]
fn a_remembered_over_rate_message_follows_its_flow_rate_and_share() {
    let rate = Rate {
        qps: 5.0,
        burst: 10,
    };
    let half = Rate { qps: 2.5, burst: 5 };
    let (a, b): (Arc<str>, Arc<str>) = (Arc::from("team-a"), Arc::from("team-b"));
    let alone = over_rate(&a, 7, rate, rate);
    assert_eq!(
        &*alone,
        "flow team-a is over its rate of 5 requests per second (burst 10)"
    );
    assert_eq!(over_rate(&a, 7, rate, rate), alone);
    let shared = over_rate(&a, 7, rate, half);
    assert!(
        shared.contains("across the Bulwark fleet; this replica holds 2.500 of it (burst 5)"),
        "{shared}"
    );
    // The same hash for another flow: its own name.
    assert!(over_rate(&b, 7, rate, rate).starts_with("flow team-b is over"));
    assert_eq!(over_rate(&a, 7, rate, rate), alone);
}
