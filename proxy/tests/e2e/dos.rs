//! Denial of service through Bulwark itself: what a hostile client can make it spend (token
//! reviews, metric series, buffered request bodies) stays bounded, and it is told so with
//! the usual `Status` answers.

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use rand::Rng;
use rand::distr::Alphanumeric;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{Cluster, Setup, get};

/// A random alphanumeric string of `len` characters.
fn random(len: usize) -> String {
    rand::rng()
        .sample_iter(Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

/// `GET /metrics` from the admin listener.
async fn metrics(cluster: &Cluster) -> String {
    let mut s = tokio::net::TcpStream::connect(cluster.bulwark.admin_addr)
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_methods_paths_and_headers_leave_no_trace_in_the_metrics() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        ..Setup::default()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let mut sent = Vec::new();
    for _ in 0..300 {
        let method = format!("Q{}", random(200).to_uppercase());
        let request = Request::builder()
            .method(method.as_bytes())
            .uri("https://127.0.0.1/api/v1/namespaces/default/configmaps")
            .body(Full::new(Bytes::new()))
            .unwrap();
        alice.send(request).await;
        sent.push(method.to_lowercase());
    }
    for _ in 0..300 {
        let (a, b) = (random(40), random(40));
        sent.extend([a.clone(), b.clone()]);
        for path in [
            format!("/api/v1/namespaces/default/{a}"),
            format!("/apis/{a}.example.com/v1/{b}/x"),
            format!("/{a}/{b}"),
        ] {
            alice.get(&path).await;
        }
    }
    for _ in 0..300 {
        let (name, value) = (random(30).to_lowercase(), random(200));
        sent.extend([name.clone(), value.clone()]);
        let mut request = get("/api/v1/namespaces/default/configmaps");
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
        alice.send(request).await;
    }
    let text = metrics(&cluster).await;
    println!(
        "/metrics after 300 random methods, 900 random paths and 300 random headers: {} bytes",
        text.len()
    );
    for s in &sent {
        assert!(!text.contains(s.as_str()), "{s} appears in /metrics");
    }
    assert!(
        text.contains("verb=\"other\""),
        "unknown methods are counted as other"
    );
    assert!(
        text.len() < 256 * 1024,
        "/metrics grew to {} bytes",
        text.len()
    );
}
