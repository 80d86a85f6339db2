//! Bad input through the whole stack: each gets its precise answer, and other clients keep
//! being served.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use bulwark_testkit::{Cluster, Setup, get, tls_config};

async fn one_replica() -> Cluster {
    Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=3x1KiB@default"],
        ..Setup::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_separators_and_dot_segments_get_400_and_never_reach_the_apiserver() {
    let cluster = one_replica().await;
    let mut alice = cluster.client("alice", &[]).await;
    for path in [
        "/api/v1/namespaces/default%2Fsecrets",
        "/api/v1/namespaces/default/secrets/%2E%2E",
        "/api/v1/namespaces/default/../kube-system/secrets",
        "/api/v1/namespaces/default/./secrets",
        "/api//v1/namespaces/default/secrets",
    ] {
        let answer = alice.get(path).await;
        assert_eq!(answer.status, 400, "{path}");
        assert_eq!(answer.headers["x-bulwark-reason"], "bad_request", "{path}");
        assert_eq!(answer.json()["kind"], "Status", "{path}");
    }
    assert!(
        cluster
            .fleet
            .seen_requests()
            .iter()
            .all(|s| !s.path.contains("%2") && !s.path.contains("/./") && !s.path.contains("//")),
        "a malformed path reached the apiserver"
    );
    assert_eq!(
        alice.get("/api/v1/namespaces/default/secrets").await.status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_over_the_apiserver_limit_gets_413() {
    let cluster = one_replica().await;
    let mut alice = cluster.client("alice", &[]).await;
    let body = Bytes::from(vec![b' '; 4 * 1024 * 1024]);
    let request = Request::post("https://127.0.0.1/api/v1/namespaces/default/configmaps")
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let answer = alice.send(request).await;
    assert_eq!(answer.status, 413);
    assert_eq!(cluster.fleet.applied_writes(), 0);
    assert_eq!(
        alice.get("/api/v1/namespaces/default/secrets").await.status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_get_431_and_the_connection_keeps_serving() {
    let cluster = one_replica().await;
    let mut alice = cluster.client("alice", &[]).await;
    let mut request = get("/api/v1/namespaces/default/secrets");
    request
        .headers_mut()
        .insert("x-padding", "a".repeat(100 * 1024).parse().unwrap());
    assert_eq!(alice.send(request).await.status, 431);
    assert_eq!(
        alice.get("/api/v1/namespaces/default/secrets").await.status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_foreign_certificates_are_cut_off_while_others_are_served() {
    let cluster = one_replica().await;
    // Plain text where a TLS ClientHello belongs.
    let mut raw = tokio::net::TcpStream::connect(cluster.bulwark.addr)
        .await
        .unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut answer))
        .await
        .expect("the connection is closed promptly");
    // Nothing but (at most) a TLS alert record comes back.
    assert!(
        answer.is_empty() || answer[0] == 0x15,
        "answered {answer:?}"
    );

    // A client certificate from a CA Bulwark does not trust.
    let stranger = bulwark_sim::Ca::new("someone-else");
    let cert = stranger.client_cert("mallory", &["system:masters"]);
    let tcp = tokio::net::TcpStream::connect(cluster.bulwark.addr)
        .await
        .unwrap();
    let refused = async {
        let mut tls = TlsConnector::from(Arc::new(tls_config(&cluster.pki, Some(&cert))))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await?;
        // TLS 1.3 reports the client certificate verdict on the first read.
        tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
        let mut buf = [0u8; 16];
        match tls.read(&mut buf).await? {
            0 => Err(std::io::Error::other("closed")),
            _ => Ok(()),
        }
    };
    assert!(refused.await.is_err(), "a foreign certificate was accepted");
    assert!(
        cluster
            .fleet
            .seen_requests()
            .iter()
            .all(|s| s.user != "mallory"),
        "mallory reached the apiserver"
    );

    let mut alice = cluster.client("alice", &[]).await;
    assert_eq!(
        alice.get("/api/v1/namespaces/default/secrets").await.status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drain_fails_readyz_first_then_stops_taking_connections() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=3x1KiB@default"],
        // A pause long enough that a loaded machine still sees it.
        tweak: |c| c.listen.shutdown.pause = Duration::from_secs(2),
        ..Setup::default()
    })
    .await;
    let admin = cluster.bulwark.admin_addr;
    let readyz = || async move {
        let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
        s.write_all(b"GET /readyz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    assert!(readyz().await.starts_with("HTTP/1.1 200"));
    let mut alice = cluster.client("alice", &[]).await;
    let addr = cluster.bulwark.addr;
    let Cluster { bulwark, fleet, .. } = cluster;
    let draining = tokio::spawn(bulwark.drain());
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        readyz().await.starts_with("HTTP/1.1 503"),
        "readyz must fail first"
    );
    // During the pause, clients are still served.
    assert_eq!(
        alice.get("/api/v1/namespaces/default/secrets").await.status,
        200
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting connections after GOAWAY"
    );
    draining.await.unwrap();
    drop(fleet);
}
