//! The watch-fed cache in the real request path: hot reads answered by Bulwark, authorized
//! per reader, with the apiservers never seeing them.

use std::time::Duration;

use http_body_util::BodyExt;

use bulwark_testkit::{Cluster, Setup};

/// `replicas` seeded with `seed`, the cache on, `rules` loaded, and Bulwark ready (its
/// cache synced).
async fn synced(replicas: usize, seed: Vec<&'static str>, rules: &'static str) -> Cluster {
    Cluster::start(Setup {
        replicas,
        seed,
        cache: true,
        rules,
        ..super::setup()
    })
    .await
    .ready()
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_reads_come_from_the_cache_for_readers_the_apiserver_would_allow() {
    let cluster = synced(
        2,
        vec!["secrets=20x1KiB@team"],
        bulwark_testkit::UNLIMITED_RULES,
    )
    .await;
    cluster.fleet.clear_seen();
    let mut alice = cluster.client("alice", &[]).await;
    let list = alice
        .get("/api/v1/namespaces/team/secrets?resourceVersion=0")
        .await;
    assert_eq!(list.status, 200);
    let body = list.json();
    assert_eq!(body["kind"], "SecretList");
    assert_eq!(body["items"].as_array().unwrap().len(), 20);
    let one = alice
        .get("/api/v1/namespaces/team/secrets/secret-3?resourceVersion=0")
        .await;
    assert_eq!(one.status, 200);
    assert_eq!(one.json()["metadata"]["name"], "secret-3");
    let seen = cluster.fleet.seen_requests();
    assert!(
        seen.iter().all(|s| s.user != "alice"),
        "alice's cached reads reached the apiserver: {seen:?}"
    );
    assert!(
        seen.iter().any(|s| s
            .path
            .starts_with("/apis/authorization.k8s.io/v1/subjectaccessreviews")),
        "no SubjectAccessReview was made for the cached answers"
    );

    // Someone the apiserver would refuse gets 403 from the cache path, and no data.
    let mut nobody = cluster.client("nobody", &[]).await;
    for path in [
        "/api/v1/namespaces/team/secrets?resourceVersion=0",
        "/api/v1/secrets?resourceVersion=0",
        "/api/v1/namespaces/team/secrets/secret-3?resourceVersion=0",
    ] {
        let answer = nobody.get(path).await;
        assert_eq!(answer.status, 403, "{path}");
        assert_eq!(answer.json()["kind"], "Status", "{path}");
        let status = answer.json();
        assert!(
            status.get("items").is_none() && status.get("data").is_none(),
            "{path}"
        );
    }

    let metrics = cluster.bulwark.admin.metrics.render();
    assert!(
        metrics.contains(r#"served_by="cache""#),
        "no request counted as served by the cache"
    );
}

/// A 403 from the cache is a refusal like any other: counted with its reason, rule and
/// level, and audited with the client's address, as the apiserver audits what it refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_refusals_are_counted_and_audited() {
    let cluster = synced(
        1,
        vec!["secrets=3x1KiB@team"],
        bulwark_testkit::UNLIMITED_RULES,
    )
    .await;
    let mut nobody = cluster.client("nobody", &[]).await;
    let answer = nobody
        .get("/api/v1/namespaces/team/secrets/secret-1?resourceVersion=0")
        .await;
    assert_eq!(answer.status, 403);
    assert_eq!(answer.json()["reason"], "Forbidden");
    assert_eq!(answer.headers["x-bulwark-reason"], "forbidden");
    let metrics = cluster.bulwark.admin.metrics.render();
    assert!(
        metrics.contains(
            r#"bulwark_rejected_requests_total{level="exempt",reason="forbidden",rule="test-clients"} 1"#
        ),
        "{metrics}"
    );
    let events = cluster.audit_events();
    let refused: Vec<_> = events
        .iter()
        .filter(|e| e["user"]["username"] == "nobody")
        .collect();
    assert_eq!(refused.len(), 1, "{events:?}");
    assert_eq!(refused[0]["responseStatus"]["code"], 403);
    assert_eq!(refused[0]["objectRef"]["name"], "secret-1");
    assert_eq!(
        refused[0]["auditID"],
        answer.headers["audit-id"].to_str().unwrap()
    );
    assert_eq!(refused[0]["sourceIPs"], serde_json::json!(["127.0.0.1"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_rate_applies_to_answers_from_the_cache_too() {
    let cluster = synced(
        1,
        vec!["secrets=3x1KiB@team"],
        r#"
rules:
  - name: alice-slow
    precedence: 100
    match:
      users: ["alice"]
    level: catch-all
    flow: user
    rate: {qps: 1, burst: 2}
"#,
    )
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let path = "/api/v1/namespaces/team/secrets?resourceVersion=0";
    let statuses: Vec<u16> = futures::future::join_all((0..4).map(|_| async {
        let mut c = cluster.client("alice", &[]).await;
        c.get(path).await.status.as_u16()
    }))
    .await;
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        2,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        2,
        "{statuses:?}"
    );
    let answer = alice.get(path).await;
    assert_eq!(answer.status, 429);
    assert_eq!(answer.headers["x-bulwark-reason"], "rate_limited");
}

/// A cached answer costs Bulwark's CPU and network rather than the apiservers' memory, and
/// it takes its seats in the reader's level like any request: while one reader holds the
/// level's only seat with a large cached LIST it has not finished reading, another flow
/// of that level (carol) waits and is refused at `maxWait`; once the LIST is read, it is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_answers_hold_seats_in_the_readers_level_until_their_body_ends() {
    let cluster = synced(
        1,
        vec!["secrets=200x100KiB@team"],
        r#"
levels:
  - name: one-seat
    seats: 1
    queues: 8
    handSize: 2
    queueLength: 5
    maxWait: 500ms
rules:
  - name: readers
    precedence: 100
    match:
      users: ["alice", "carol"]
    level: one-seat
    flow: user
"#,
    )
    .await;
    let list = "/api/v1/namespaces/team/secrets?resourceVersion=0";
    let one = "/api/v1/namespaces/team/secrets/secret-3?resourceVersion=0";
    cluster.fleet.clear_seen();

    let mut alice = cluster.client("alice", &[]).await;
    let unread = alice.start(bulwark_testkit::get(list)).await;
    assert_eq!(unread.status(), 200);

    let mut carol = cluster.client("carol", &[]).await;
    let refused = carol.get(one).await;
    assert_eq!(
        refused.status, 429,
        "carol was answered while alice held the seat"
    );
    assert_eq!(refused.headers["x-bulwark-reason"], "queue_timeout");
    assert_eq!(refused.headers["x-bulwark-level"], "one-seat");

    // A watch that starts with the current state sends a LIST's worth of Secrets: it
    // waits for seats like that LIST, and is refused at maxWait too.
    let initial = carol
        .get("/api/v1/namespaces/team/secrets?watch=true&resourceVersion=0")
        .await;
    assert_eq!(
        initial.status, 429,
        "an initial-state watch skipped the queue"
    );
    assert_eq!(initial.headers["x-bulwark-reason"], "queue_timeout");
    // A cached watch from a version starts at once all the same: it sends events as they
    // come, so it only counts against the flow's watch limit.
    let version = cluster.fleet.store().resource_version();
    let watch = carol
        .start(bulwark_testkit::get(&format!(
            "/api/v1/namespaces/team/secrets?watch=true&resourceVersion={version}"
        )))
        .await;
    assert_eq!(
        watch.status(),
        200,
        "a cached watch from a version waited for a seat"
    );
    drop(watch);

    let body = unread.into_body().collect().await.unwrap().to_bytes();
    let items = serde_json::from_slice::<serde_json::Value>(&body).unwrap()["items"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(items, 200);
    // The initial-state watch now starts; once its 200 ADDED events are read, it gives the
    // seat back while it stays open, and carol's GET is answered.
    let mut watch = carol
        .start(bulwark_testkit::get(
            "/api/v1/namespaces/team/secrets?watch=true&resourceVersion=0",
        ))
        .await
        .into_body();
    let mut added = 0;
    let mut pending = Vec::new();
    while added < 200 {
        let frame = watch.frame().await.expect("the watch ended early").unwrap();
        if let Ok(data) = frame.into_data() {
            pending.extend_from_slice(&data);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let event: serde_json::Value = serde_json::from_slice(&line).unwrap();
                assert_eq!(event["type"], "ADDED");
                added += 1;
            }
        }
    }
    let answered = carol.get(one).await;
    assert_eq!(
        answered.status, 200,
        "the watch kept its seat after its initial state"
    );
    assert_eq!(answered.json()["metadata"]["name"], "secret-3");
    drop(watch);
    assert!(
        cluster
            .fleet
            .seen_requests()
            .iter()
            .all(|s| s.user != "alice" && s.user != "carol"),
        "the reads were meant to come from the cache"
    );
}

/// A watch answered from the cache counts against its flow's watch limit while it is
/// open, as one the apiserver answers does, and takes no seat once started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_watches_count_against_the_flows_watch_limit() {
    let cluster = synced(
        1,
        vec!["secrets=3x1KiB@team"],
        r#"
levels:
  - name: one-seat
    seats: 1
    queues: 8
    handSize: 2
    queueLength: 5
    maxWait: 500ms
rules:
  - name: watchers
    precedence: 100
    match:
      users: ["alice"]
    level: one-seat
    flow: user
    watches: 1
"#,
    )
    .await;
    let watch = "/api/v1/namespaces/team/secrets?watch=true&resourceVersion=0";
    cluster.fleet.clear_seen();
    let mut alice = cluster.client("alice", &[]).await;
    let open = alice.start(bulwark_testkit::get(watch)).await;
    assert_eq!(open.status(), 200);

    let second = alice.get(watch).await;
    assert_eq!(second.status, 429);
    assert_eq!(second.headers["x-bulwark-reason"], "watch_limit");
    // The open watch holds no seat: a GET of the same level is answered.
    let one = alice
        .get("/api/v1/namespaces/team/secrets/secret-1?resourceVersion=0")
        .await;
    assert_eq!(one.status, 200);

    drop(open);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let reopened = loop {
        let mut again = cluster.client("alice", &[]).await;
        let response = again.start(bulwark_testkit::get(watch)).await;
        if response.status() == 200 || tokio::time::Instant::now() > deadline {
            break response;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(reopened.status(), 200, "the closed watch still counted");
    assert!(
        cluster
            .fleet
            .seen_requests()
            .iter()
            .all(|s| s.user != "alice"),
        "the watches were meant to come from the cache"
    );
}

/// A cached LIST that waits for its seats is built when they are granted, not when it
/// arrived: it answers with what the cache holds then, as the apiserver answers a LIST it
/// queued. (A LIST built before the wait would hand its reader a stale version, and every
/// event since would reach that reader's watch late.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_list_that_waited_for_seats_answers_with_the_cache_of_when_it_runs() {
    let cluster = synced(
        1,
        vec!["secrets=200x100KiB@team", "secrets=2x1KiB@other"],
        r#"
levels:
  - name: one-seat
    seats: 1
    queues: 8
    handSize: 2
    queueLength: 5
    maxWait: 20s
rules:
  - name: readers
    precedence: 100
    match:
      users: ["alice", "carol"]
    level: one-seat
    flow: user
"#,
    )
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let unread = alice
        .start(bulwark_testkit::get(
            "/api/v1/namespaces/team/secrets?resourceVersion=0",
        ))
        .await;
    assert_eq!(unread.status(), 200);

    // Carol's LIST waits behind alice's unread one for the level's only seat.
    let mut carol = cluster.client("carol", &[]).await;
    let waiting = tokio::spawn(async move {
        carol
            .get("/api/v1/namespaces/other/secrets?resourceVersion=0")
            .await
    });
    let metrics = || cluster.bulwark.admin.metrics.render();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !metrics().contains(r#"bulwark_level_waiting_requests{level="one-seat"} 1"#) {
        assert!(tokio::time::Instant::now() < deadline, "carol never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Meanwhile a Secret is created, and the cache sees it.
    let mut admin = cluster.client("admin", &["system:masters"]).await;
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "made-while-waiting", "namespace": "other"},
    });
    let create = http::Request::post("https://127.0.0.1/api/v1/namespaces/other/secrets")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            secret.to_string(),
        )))
        .unwrap();
    assert_eq!(admin.send(create).await.status, 201);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while admin
        .get("/api/v1/namespaces/other/secrets/made-while-waiting?resourceVersion=0")
        .await
        .status
        != 200
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache never saw it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Alice finishes; carol's LIST runs now and holds the new Secret.
    unread.into_body().collect().await.unwrap();
    let answer = waiting.await.unwrap();
    assert_eq!(answer.status, 200);
    let names: Vec<String> = answer.json()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        names.iter().any(|n| n == "made-while-waiting"),
        "the LIST was built before it waited: {names:?}"
    );
}

/// A LIST of a cached resource that goes upstream is costed by the cache's own count of
/// that scope, before Bulwark has seen any LIST of it: while an exact-version LIST of
/// 20 MB streams unread, the replica's in-flight LIST bytes are those 20 MB, not the
/// guess for an unknown scope (a quarter of a replica's budget, about 200 MB here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_list_of_a_cached_resource_is_costed_by_the_caches_count() {
    let cluster = synced(
        1,
        vec!["secrets=200x100KiB@team"],
        bulwark_testkit::ALICE_LISTS_RULES,
    )
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    // The current version, from a small cached read (a GET: no LIST is seen upstream).
    let one = alice
        .get("/api/v1/namespaces/team/secrets/secret-0?resourceVersion=0")
        .await;
    assert_eq!(one.status, 200);
    let version = cluster.fleet.store().resource_version();
    let exact = format!(
        "/api/v1/namespaces/team/secrets?resourceVersion={version}&resourceVersionMatch=Exact"
    );
    let unread = alice.start(bulwark_testkit::get(&exact)).await;
    assert_eq!(unread.status(), 200);
    let in_flight = cluster.list_bytes_in_flight();
    let scope = (200 * 100 * 1024) as f64;
    assert!(
        in_flight > 0.9 * scope && in_flight < 1.3 * scope,
        "in-flight LIST bytes {in_flight}, the scope holds about {scope}"
    );
    drop(unread);
}

/// Reads a watch until it ends: its bytes, and whether it ended cleanly (END_STREAM) rather
/// than with an error (a reset stream, a dropped connection). `arrived` is told once the
/// first `events` lines are in.
async fn until_the_end(
    mut body: hyper::body::Incoming,
    events: usize,
    arrived: tokio::sync::oneshot::Sender<()>,
) -> (Vec<u8>, Result<(), String>) {
    let mut bytes = Vec::new();
    let mut arrived = Some(arrived);
    loop {
        match body.frame().await {
            None => return (bytes, Ok(())),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    bytes.extend_from_slice(&data);
                }
                if bytes.iter().filter(|b| **b == b'\n').count() >= events
                    && let Some(arrived) = arrived.take()
                {
                    let _ = arrived.send(());
                }
            }
            Some(Err(e)) => return (bytes, Err(e.to_string())),
        }
    }
}

/// The drain ends every watch cleanly after its last whole event before it drops the
/// connections, as the apiserver ends its own when it shuts down: a watch from the cache and
/// one relayed from an apiserver both end with END_STREAM on a line's end, so client-go
/// watches again from its last version. Cut at Close instead, mid-event or not, a stream
/// ends with an error, which client-go answers with a relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_ends_every_watch_cleanly_before_it_drops_the_connections() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=3x1KiB@team"],
        cache: true,
        rules: bulwark_testkit::UNLIMITED_RULES,
        tweak: |c| {
            c.listen.shutdown.pause = Duration::from_millis(10);
            c.listen.shutdown.grace = Duration::from_millis(200);
        },
        ..super::setup()
    })
    .await
    .ready()
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let cached = alice
        .start(bulwark_testkit::get(
            "/api/v1/namespaces/team/secrets?watch=true&resourceVersion=0",
        ))
        .await;
    assert_eq!(cached.status(), 200);
    let rv = cluster.fleet.store().resource_version();
    let relayed = alice
        .start(bulwark_testkit::get(&format!(
            "/api/v1/namespaces/team/configmaps?watch=true&resourceVersion={rv}"
        )))
        .await;
    assert_eq!(relayed.status(), 200);
    let (cached_in, cached_arrived) = tokio::sync::oneshot::channel();
    let (relayed_in, relayed_arrived) = tokio::sync::oneshot::channel();
    let cached = tokio::spawn(until_the_end(cached.into_body(), 3, cached_in));
    let relayed = tokio::spawn(until_the_end(relayed.into_body(), 1, relayed_in));
    cluster
        .fleet
        .store()
        .create(
            "configmaps",
            "team",
            serde_json::json!({"metadata": {"name": "during"}, "data": {"v": "1"}}),
        )
        .expect("create");
    let both = async { (cached_arrived.await, relayed_arrived.await) };
    let (cached_arrived, relayed_arrived) = tokio::time::timeout(Duration::from_secs(10), both)
        .await
        .expect("the watches' events arrive");
    assert!(cached_arrived.is_ok() && relayed_arrived.is_ok());

    let Cluster { bulwark, fleet, .. } = cluster;
    let drained = tokio::time::timeout(Duration::from_secs(10), bulwark.drain());
    drained.await.expect("the drain ends");
    for (what, watch, events) in [("cached", cached, 3), ("relayed", relayed, 1)] {
        let (bytes, end) = watch.await.unwrap();
        assert_eq!(end, Ok(()), "the {what} watch ended with an error");
        assert!(bytes.ends_with(b"\n"), "the {what} watch ended mid-event");
        let lines: Vec<serde_json::Value> = bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines.len(), events, "{what}: {lines:?}");
        assert!(
            lines.iter().all(|l| l["type"] == "ADDED"),
            "{what}: {lines:?}"
        );
    }
    drop(fleet);
}
