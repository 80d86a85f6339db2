//! Three Bulwarks in one process in front of one simulated apiserver, keeping one LIST
//! byte budget through their Leases: each sees the others, the budget follows the LIST
//! demand, a stopped one's share comes back, and one that cannot write its Lease holds the
//! static split.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bulwark::serve::Running;
use bulwark_sim::{Fleet, Pki};
use bulwark_testkit::{
    ALICE_LISTS_RULES, BulwarkConfig, Client, Credentials, Names, OWN_USER, Setup, admin_get,
    grant, metric_sum, policy, start_fleet,
};
use serde_json::Value;

/// The fleet's whole of the apiserver's in-flight LIST bytes: the default heap headroom
/// (8 GiB) ÷ 5.
const WHOLE: f64 = (8u64 << 30) as f64 / 5.0;

/// One simulated apiserver with configmaps to LIST; Bulwark's own user may write Leases
/// when `leases` is set.
async fn apiserver(leases: bool) -> (Fleet, Arc<Pki>) {
    let mut policy = policy();
    if leases {
        policy.rules.push(grant(
            &[OWN_USER],
            &[],
            &["create", "update"],
            &["leases.coordination.k8s.io"],
        ));
    }
    start_fleet(&Setup {
        replicas: 1,
        seed: vec!["configmaps=100x100KiB@team"],
        policy,
        ..Setup::default()
    })
    .await
}

/// A Bulwark named `identity` in a fleet of three configured, renewing every 200 ms with
/// Leases that last 1 s.
async fn bulwark(fleet: &Fleet, pki: &Pki, dir: &Path, identity: &str) -> Running {
    let dir = dir.join(identity);
    let credentials = Credentials::mint(&dir, pki, &pki.server_ca, Names::default())
        .expect("certificates written");
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("rules folder");
    std::fs::write(rules.join("test.yaml"), ALICE_LISTS_RULES).expect("rules written");
    let mut config = BulwarkConfig::new(credentials, fleet.addrs())
        .quick_failover()
        .set("upstream.bulwarkReplicas", "3")
        .set(
            "fleet",
            &format!(
                "{{namespace: bulwark, identity: {identity}, renewInterval: 200ms, leaseDuration: 1s}}"
            ),
        );
    config.cache = false;
    config.rules = Some(rules);
    Running::start(config.config())
        .await
        .expect("bulwark starts")
}

/// `/debug/fleet` of `bulwark`.
async fn debug_fleet(bulwark: &Running) -> Value {
    let (status, body) = admin_get(bulwark.admin_addr, "/debug/fleet")
        .await
        .expect("admin answers");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("JSON")
}

/// The live members `bulwark` sees.
async fn members(bulwark: &Running) -> Vec<String> {
    let debug = debug_fleet(bulwark).await;
    debug["shares"]["members"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The LIST byte budget `bulwark` exports (`bulwark_list_bytes_budget`).
fn budget(bulwark: &Running) -> f64 {
    metric_sum(&bulwark.admin.metrics.render(), "bulwark_list_bytes_budget")
}

/// The seats `bulwark` may use in the `lists` level now (`/debug/levels`).
async fn lists_seats(bulwark: &Running) -> u64 {
    let (status, body) = admin_get(bulwark.admin_addr, "/debug/levels")
        .await
        .expect("admin answers");
    assert_eq!(status, 200, "{body}");
    let levels: Value = serde_json::from_str(&body).expect("JSON");
    levels["levels"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["name"] == "lists"))
        .and_then(|l| l["seatsLimit"].as_u64())
        .unwrap_or_else(|| panic!("no lists level: {levels}"))
}

/// Waits up to `within` for `done`, polling every 20 ms; says `what` when it never is.
async fn eventually<F: std::future::Future<Output = bool>>(
    within: Duration,
    what: &str,
    mut done: impl FnMut() -> F,
) {
    let deadline = tokio::time::Instant::now() + within;
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_bulwarks_split_the_list_budget_by_demand_and_a_stopped_ones_share_comes_back() {
    let (fleet, pki) = apiserver(true).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let a = bulwark(&fleet, &pki, dir.path(), "bulwark-a").await;
    // Alone, A holds the whole, not a third.
    eventually(
        Duration::from_secs(5),
        "A alone holds the whole",
        || async { budget(&a) == WHOLE.floor() },
    )
    .await;
    assert_eq!(debug_fleet(&a).await["shares"]["standing"], "alone");
    assert_eq!(
        lists_seats(&a).await,
        30,
        "the level's 10 seats x 3 replicas"
    );

    let b = bulwark(&fleet, &pki, dir.path(), "bulwark-b").await;
    let c = bulwark(&fleet, &pki, dir.path(), "bulwark-c").await;
    let all = ["bulwark-a", "bulwark-b", "bulwark-c"]
        .map(String::from)
        .to_vec();
    for (name, replica) in [("A", &a), ("B", &b), ("C", &c)] {
        eventually(
            Duration::from_secs(2),
            &format!("{name} sees all three"),
            || {
                let all = all.clone();
                async move { members(replica).await == all }
            },
        )
        .await;
    }
    // Nobody asks: equal thirds.
    let third = (WHOLE.floor() / 3.0).floor();
    eventually(Duration::from_secs(2), "equal thirds", || async {
        [&a, &b, &c].iter().all(|r| budget(r) == third)
    })
    .await;
    assert_eq!(lists_seats(&b).await, 10);

    // alice LISTs through A and leaves the answer unread: its bytes stay in flight there.
    let cert = pki.client_ca.client_cert("alice", &[]);
    let mut alice = Client::connect(a.addr, &pki, Some(&cert)).await;
    let unread = alice
        .start(bulwark_testkit::get("/api/v1/namespaces/team/configmaps"))
        .await;
    assert_eq!(unread.status(), 200);
    // A gets all but the floors of B and C (10% of a third each).
    let floor = (third / 10.0).floor();
    eventually(
        Duration::from_secs(5),
        "A's budget follows its demand",
        || async {
            budget(&a) > WHOLE - 2.0 * floor - 3.0 && budget(&b) == floor && budget(&c) == floor
        },
    )
    .await;
    // The level's seats follow the same way: B and C keep one each to start with.
    assert_eq!(lists_seats(&b).await, 1);
    assert_eq!(lists_seats(&c).await, 1);
    assert_eq!(lists_seats(&a).await, 28);
    let sum = budget(&a) + budget(&b) + budget(&c);
    assert!(sum <= WHOLE, "the shares add up to {sum}, over {WHOLE}");
    let debug = debug_fleet(&a).await;
    let held = &debug["shares"]["listBytes"][fleet.addrs()[0].to_string()];
    assert!(held["demand"].as_u64().unwrap() > 0, "{debug}");
    assert_eq!(held["demand"], held["fleetDemand"], "{debug}");

    // B stops: within its lease duration (1 s) and a renew period, A and C split without it.
    b.drain().await;
    let two = ["bulwark-a", "bulwark-c"].map(String::from).to_vec();
    eventually(Duration::from_secs(3), "C sees B gone", || {
        let two = two.clone();
        let c = &c;
        async move { members(c).await == two }
    })
    .await;
    let floor_of_two = (WHOLE.floor() / 2.0 / 10.0).floor();
    eventually(Duration::from_secs(2), "B's share comes back", || async {
        budget(&c) == floor_of_two && budget(&a) > WHOLE - floor_of_two - 2.0
    })
    .await;
    assert!(budget(&a) + budget(&c) <= WHOLE);
    drop(unread);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulwark_that_cannot_write_its_lease_holds_the_static_split_not_the_whole() {
    // Bulwark's own user may read Leases but not create them.
    let (fleet, pki) = apiserver(false).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let a = bulwark(&fleet, &pki, dir.path(), "bulwark-a").await;
    eventually(
        Duration::from_secs(5),
        "A reports its failed renewal",
        || async { debug_fleet(&a).await["lastError"].is_string() },
    )
    .await;
    let debug = debug_fleet(&a).await;
    assert_eq!(debug["shares"]["standing"], "static", "{debug}");
    let error = debug["lastError"].as_str().unwrap();
    assert!(error.contains("403"), "{error}");
    // Alone but unable to renew: a third (the static split), never the whole.
    assert_eq!(budget(&a), (WHOLE.floor() / 3.0).floor());
    let metrics = a.admin.metrics.render();
    assert_eq!(metric_sum(&metrics, "bulwark_fleet_static"), 1.0);
    assert_eq!(metric_sum(&metrics, "bulwark_fleet_members"), 0.0);
    assert!(
        metrics.contains("bulwark_fleet_renewals_total{result=\"error\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_bulwark_renews_the_lease_it_left_with_one_write_and_one_list_a_period() {
    let (fleet, pki) = apiserver(true).await;
    // The Lease a previous run of bulwark-a left behind, long expired.
    let leases = "leases.coordination.k8s.io";
    let left = fleet
        .store()
        .create(
            leases,
            "bulwark",
            serde_json::json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": "bulwark-bulwark-a", "namespace": "bulwark"},
                "spec": {
                    "holderIdentity": "bulwark-a",
                    "leaseDurationSeconds": 1,
                    "renewTime": "2020-01-01T00:00:00.000000Z",
                },
            }),
        )
        .expect("old Lease stored");
    let dir = tempfile::tempdir().expect("temp dir");
    let a = bulwark(&fleet, &pki, dir.path(), "bulwark-a").await;
    eventually(Duration::from_secs(5), "A renews its old Lease", || async {
        debug_fleet(&a).await["shares"]["standing"] == "alone"
    })
    .await;
    let renewed = fleet
        .store()
        .get(leases, "bulwark", "bulwark-bulwark-a")
        .expect("the Lease is there");
    assert_ne!(
        renewed["metadata"]["resourceVersion"],
        left["metadata"]["resourceVersion"]
    );
    assert_ne!(renewed["spec"]["renewTime"], "2020-01-01T00:00:00.000000Z");
    assert!(
        renewed["metadata"]["annotations"]["bulwark.io/demand"].is_string(),
        "{renewed}"
    );

    // Over a second (five renew periods): at most one write and one list a period (fewer
    // only when a loaded machine delays the timer), nothing else.
    fleet.clear_seen();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let traffic: Vec<(String, String)> = fleet
        .seen_requests()
        .into_iter()
        .filter(|r| r.user == OWN_USER && r.path.contains("/leases"))
        .map(|r| (r.method, r.path))
        .collect();
    let collection = "/apis/coordination.k8s.io/v1/namespaces/bulwark/leases";
    let own = format!("{collection}/bulwark-bulwark-a");
    let writes = traffic
        .iter()
        .filter(|(m, p)| m == "PUT" && *p == own)
        .count();
    let lists = traffic
        .iter()
        .filter(|(m, p)| m == "GET" && *p == collection)
        .count();
    assert!((2..=6).contains(&writes), "{traffic:?}");
    assert!((2..=6).contains(&lists), "{traffic:?}");
    assert_eq!(writes + lists, traffic.len(), "{traffic:?}");
}
