//! Bodies stream through Bulwark byte for byte, without being held in its memory.

use std::time::Duration;

use http_body_util::BodyExt;
use sha2::{Digest, Sha256};

use bulwark_testkit::{Client, Cluster, Setup, get};

/// Reads a response body chunk by chunk, hashing it; returns (bytes, digest).
async fn drain(response: http::Response<hyper::body::Incoming>) -> (u64, [u8; 32]) {
    let mut body = response.into_body();
    let mut hash = Sha256::new();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("body frame").into_data() {
            total += data.len() as u64;
            hash.update(&data);
        }
    }
    (total, hash.finalize().into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_list_passes_byte_identical_without_costing_100_mb() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=100x1MiB@big"],
        ..Setup::default()
    })
    .await;
    let process = cluster
        .spawn_process(env!("CARGO_BIN_EXE_bulwark").as_ref())
        .await;
    let path = "/api/v1/namespaces/big/secrets?resourceVersion=0";
    let cert = cluster.pki.client_ca.client_cert("alice", &[]);
    let mut direct = Client::connect(cluster.fleet.addrs()[0], &cluster.pki, Some(&cert)).await;
    let (direct_len, direct_hash) = drain(direct.start(get(path)).await).await;
    let mut through = Client::connect(process.addr, &cluster.pki, Some(&cert)).await;
    let response = through.start(get(path)).await;
    assert_eq!(response.status(), 200);
    let (len, hash) = drain(response).await;
    assert!(direct_len > 100_000_000, "the list is {direct_len} bytes");
    assert_eq!(
        (len, hash),
        (direct_len, direct_hash),
        "bytes differ through Bulwark"
    );
    let peak = process.peak_rss_bytes();
    println!(
        "bulwark peak RSS while streaming a {direct_len}-byte LIST: {} MiB",
        peak >> 20
    );
    assert!(
        peak < 100 << 20,
        "bulwark held {peak} bytes for a {direct_len}-byte list"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_mb_watch_stream_passes_byte_identical() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let start_rv = cluster.fleet.store().resource_version();
    let watch = format!("/api/v1/namespaces/w/configmaps?watch=1&resourceVersion={start_rv}");
    let response = alice.start(get(&watch)).await;
    assert_eq!(response.status(), 200);
    // 64 events of 16 KiB each: a 1 MiB stream.
    for i in 0..64 {
        let value = "x".repeat(16 * 1024);
        cluster
            .fleet
            .store()
            .create(
                "configmaps",
                "w",
                serde_json::json!({"metadata": {"name": format!("cm-{i}")}, "data": {"v": value}}),
            )
            .expect("create");
    }
    let end_rv = cluster.fleet.store().resource_version();
    let bounded = format!("{watch}&timeoutSeconds=2");
    // The same watch replayed straight from the apiserver must give the same bytes.
    let cert = cluster.pki.client_ca.client_cert("alice", &[]);
    let mut direct = Client::connect(cluster.fleet.addrs()[0], &cluster.pki, Some(&cert)).await;
    let through = tokio::time::timeout(Duration::from_secs(10), async {
        let mut again = cluster.client("alice", &[]).await;
        drain(again.start(get(&bounded)).await).await
    });
    let (direct_len, direct_hash) = drain(direct.start(get(&bounded)).await).await;
    let (len, hash) = through.await.expect("watch through bulwark ended");
    assert!(direct_len >= 1 << 20, "{direct_len} bytes");
    assert_eq!((len, hash), (direct_len, direct_hash));
    assert!(end_rv > start_rv);
    drop(response);
}
