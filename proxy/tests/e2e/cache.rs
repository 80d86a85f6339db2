//! The watch-fed cache in the real request path: hot reads answered by Bulwark, authorized
//! per reader, with the apiservers never seeing them.

use std::time::Duration;

use crate::harness::{Cluster, Setup};

async fn cached_cluster() -> Cluster {
    let cluster = Cluster::start(Setup {
        replicas: 2,
        seed: vec!["secrets=20x1KiB@team"],
        cache: true,
        ..Setup::default()
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.bulwark.admin.ready().is_err() {
        assert!(tokio::time::Instant::now() < deadline, "cache never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_reads_come_from_the_cache_for_readers_the_apiserver_would_allow() {
    let cluster = cached_cluster().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_rate_applies_to_answers_from_the_cache_too() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=3x1KiB@team"],
        cache: true,
        rules: r#"
rules:
  - name: alice-slow
    precedence: 100
    match:
      users: ["alice"]
    level: catch-all
    flow: user
    rate: {qps: 1, burst: 2}
"#,
        ..Setup::default()
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.bulwark.admin.ready().is_err() {
        assert!(tokio::time::Instant::now() < deadline, "cache never synced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
