//! Per-request balancing over single long-lived HTTP/2 client connections.

use std::time::Duration;

use futures::StreamExt;

use bulwark_testkit::{Cluster, Setup};

const SECRETS: &str = "/api/v1/namespaces/ns-0/secrets";

/// Requests each replica answered for `user` since the counters were read last.
fn per_replica(cluster: &Cluster, user: &str) -> Vec<u64> {
    cluster
        .fleet
        .stats()
        .iter()
        .map(|s| s.requests_by_user.get(user).copied().unwrap_or(0))
        .collect()
}

fn spread(counts: &[u64]) -> f64 {
    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
    counts
        .iter()
        .map(|c| (*c as f64 - mean).abs() / mean)
        .fold(0.0, f64::max)
}

/// Sends `total` GETs over ONE connection, `concurrency` at a time; returns failures.
async fn load(cluster: &Cluster, user: &str, total: usize, concurrency: usize) -> usize {
    let client = cluster.client(user, &[]).await;
    let client = &tokio::sync::Mutex::new(client);
    let sender = client.lock().await.sender();
    futures::stream::iter(0..total)
        .map(|i| {
            let mut sender = sender.clone();
            async move {
                let path = if i % 4 == 0 {
                    SECRETS.to_string()
                } else {
                    format!("{SECRETS}/secret-{}", i % 10)
                };
                let response = sender.send_request(bulwark_testkit::get(&path)).await;
                match response {
                    Ok(r) if r.status().is_success() => {
                        let _ = http_body_util::BodyExt::collect(r.into_body()).await;
                        0
                    }
                    _ => 1,
                }
            }
        })
        .buffer_unordered(concurrency)
        .fold(0, |acc, failed| async move { acc + failed })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_replicas_get_equal_shares_of_one_connection() {
    let cluster = Cluster::start(Setup {
        seed: vec!["secrets=10x1KiB@ns-0"],
        ..Setup::default()
    })
    .await;
    assert_eq!(load(&cluster, "alice", 900, 24).await, 0);
    let counts = per_replica(&cluster, "alice");
    println!(
        "per-replica requests, equal replicas: {counts:?}, max spread {:.1}%",
        spread(&counts) * 100.0
    );
    assert_eq!(counts.iter().sum::<u64>(), 900);
    assert!(spread(&counts) <= 0.10, "spread over 10%: {counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_replica_gets_proportionally_less() {
    let cluster = Cluster::start(Setup {
        seed: vec!["secrets=10x1KiB@ns-0"],
        ..Setup::default()
    })
    .await;
    // Delays well above the test's own CPU time (debug build, 2 cores), so that the
    // replicas' speed is what the pick sees.
    for i in 0..3 {
        cluster
            .fleet
            .replica(i)
            .set_delay(Duration::from_millis(100));
    }
    cluster
        .fleet
        .replica(0)
        .set_delay(Duration::from_millis(500));
    assert_eq!(load(&cluster, "alice", 360, 30).await, 0);
    let counts = per_replica(&cluster, "alice");
    let fast = (counts[1] + counts[2]) as f64 / 2.0;
    println!("per-replica requests, replica 0 five times slower: {counts:?}");
    assert!(
        (counts[0] as f64) < fast * 0.5,
        "the slow replica got {} against {fast} on the others",
        counts[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_gets_its_share_back() {
    let cluster = Cluster::start(Setup {
        seed: vec!["secrets=10x1KiB@ns-0"],
        ..Setup::default()
    })
    .await;
    cluster.fleet.replica(2).stop().await;
    assert_eq!(
        load(&cluster, "alice", 300, 12).await,
        0,
        "reads failed while a replica was down"
    );
    let during = per_replica(&cluster, "alice");
    assert_eq!(during[2], 0);
    cluster.fleet.replica(2).start().await;
    // Probes run every 200 ms: well inside 10 s the replica is back in the pick.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.bulwark.admin.upstream.healthy_replicas() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "replica not back within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(load(&cluster, "carol", 900, 24).await, 0);
    let after = per_replica(&cluster, "carol");
    println!("per-replica requests after the restart: {after:?}");
    assert!(
        spread(&after) <= 0.10,
        "spread over 10% after restart: {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_watches_spread_evenly() {
    let cluster = Cluster::start(Setup::default()).await;
    let client = cluster.client("alice", &[]).await;
    let sender = client.sender();
    let mut streams = Vec::new();
    for _ in 0..200 {
        let mut sender = sender.clone();
        let response = sender
            .send_request(bulwark_testkit::get(
                "/api/v1/namespaces/ns-0/secrets?watch=1&allowWatchBookmarks=true",
            ))
            .await
            .expect("watch starts");
        assert_eq!(response.status(), 200);
        streams.push(response);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let counts = loop {
        let counts: Vec<u64> = cluster
            .fleet
            .stats()
            .iter()
            .map(|s| s.open_watches)
            .collect();
        if counts.iter().sum::<u64>() >= 200 || tokio::time::Instant::now() > deadline {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("open watches per replica: {counts:?}");
    assert_eq!(counts.iter().sum::<u64>(), 200);
    assert!(spread(&counts) <= 0.10, "watch spread over 10%: {counts:?}");
    drop(streams);
}
