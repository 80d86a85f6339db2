//! Bulwark behind its load balancer and under hostile connection load: the PROXY protocol
//! from trusted balancers only (with haproxy's `send-proxy-v2` in front), connection caps per
//! source that refuse fast and a total cap at which the oldest unauthenticated connection
//! makes room, and connections that never authenticate (or keep failing to) closed, while
//! established clients and the admin listener keep answering.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use bulwark_testkit::{Client, Cluster, Setup, UNLIMITED_RULES, metric_sum};

/// A TCP connection to `to` from the loopback address `from` (any of 127.0.0.0/8 is ours).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> std::io::Result<TcpStream> {
    bulwark_testkit::tcp_from(from.into(), to).await
}

/// A TLS and HTTP/2 client without a certificate, connected from `from`.
async fn anonymous_from(cluster: &Cluster, from: [u8; 4]) -> Result<Client, String> {
    let tcp = connect_from(from, cluster.bulwark.addr)
        .await
        .map_err(|e| e.to_string())?;
    Client::over(tcp, &cluster.pki, None).await
}

fn metric(cluster: &Cluster, line: &str) -> f64 {
    let text = cluster.bulwark.admin.metrics.render();
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// haproxy in TCP mode on a free port, sending a PROXY v2 header to `bulwark` for every
/// connection; killed when dropped. `None` where haproxy is not on PATH (the test reported
/// skipped).
async fn haproxy_in_front_of(bulwark: SocketAddr, dir: &std::path::Path) -> Option<Haproxy> {
    let binary = bulwark_testkit::tools::find("haproxy", "apt-get install haproxy")?;
    let port = bulwark_testkit::free_port();
    let config = format!(
        "global\n  maxconn 1000\n\
         defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 30s\n  timeout server 30s\n\
         frontend clients\n  bind 127.0.0.1:{port}\n  default_backend bulwark\n\
         backend bulwark\n  server b1 {bulwark} send-proxy-v2\n"
    );
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, config).expect("haproxy config written");
    let child = tokio::process::Command::new(binary)
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .kill_on_drop(true)
        .spawn()
        .expect("haproxy starts");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "haproxy never listened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(Haproxy {
        _child: child,
        addr,
    })
}

struct Haproxy {
    _child: tokio::process::Child,
    addr: SocketAddr,
}

fn source_ips_of(cluster: &Cluster, user: &str) -> Vec<serde_json::Value> {
    cluster
        .audit_events()
        .into_iter()
        .filter(|e| e["user"]["username"] == user)
        .map(|e| e["sourceIPs"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_haproxy_send_proxy_v2_the_client_address_is_the_real_one() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=3x1KiB@team"],
        cache: true,
        settings: vec![(
            "listen.proxyProtocol",
            "{trustedSources: [127.0.0.1/32], required: true}",
        )],
        ..Setup::default()
    })
    .await
    .ready()
    .await;
    let Some(haproxy) = haproxy_in_front_of(cluster.bulwark.addr, cluster.dir()).await else {
        return;
    };

    // A client at 127.0.0.2 through haproxy, which connects to Bulwark from 127.0.0.1.
    let tcp = connect_from([127, 0, 0, 2], haproxy.addr).await.unwrap();
    let cert = cluster.pki.client_ca.client_cert("nobody", &[]);
    let mut client = Client::over(tcp, &cluster.pki, Some(&cert)).await.unwrap();
    let path = "/api/v1/namespaces/team/secrets/secret-1?resourceVersion=0";
    let refused = client.get(path).await;
    assert_eq!(refused.status, 403, "{}", refused.text());
    assert_eq!(
        source_ips_of(&cluster, "nobody"),
        [serde_json::json!(["127.0.0.2"])],
        "the audit log names the client behind the balancer, not the balancer"
    );

    // The trusted balancer's address without a header is refused: it is required.
    let direct = connect_from([127, 0, 0, 1], cluster.bulwark.addr)
        .await
        .unwrap();
    let error = Client::over(direct, &cluster.pki, Some(&cert)).await.err();
    assert!(
        error.is_some(),
        "a trusted peer without a header was served"
    );

    // Anyone else claiming an address with a header is refused.
    let mut forged = connect_from([127, 0, 0, 3], cluster.bulwark.addr)
        .await
        .unwrap();
    let header = b"PROXY TCP4 10.9.9.9 10.0.0.1 5555 6443\r\n";
    forged.write_all(header).await.unwrap();
    let error = Client::over(forged, &cluster.pki, Some(&cert)).await.err();
    assert!(error.is_some(), "a forged PROXY header was accepted");

    // ... while the same untrusted address speaking TLS straight away is served as itself.
    let plain = connect_from([127, 0, 0, 3], cluster.bulwark.addr)
        .await
        .unwrap();
    let alice_cert = cluster.pki.client_ca.client_cert("eve", &[]);
    let mut eve = Client::over(plain, &cluster.pki, Some(&alice_cert))
        .await
        .unwrap();
    assert_eq!(eve.get(path).await.status, 403);
    assert_eq!(
        source_ips_of(&cluster, "eve"),
        [serde_json::json!(["127.0.0.3"])]
    );

    let refused = |reason: &str| {
        metric(
            &cluster,
            &format!(r#"bulwark_connections_refused_total{{reason="{reason}"}}"#),
        )
    };
    assert_eq!(refused("proxy_header_missing"), 1.0);
    assert_eq!(refused("proxy_header_untrusted"), 1.0);
}

/// Opens `n` connections from `from`, 25 at a time, each sending one request without
/// credentials (401) and then idling, answering pings; returns those that were served.
async fn idle_flood(cluster: &Cluster, from: [u8; 4], n: usize) -> Vec<Client> {
    let mut open = Vec::new();
    let addr = cluster.bulwark.addr;
    let pki = cluster.pki.clone();
    for batch in 0..n.div_ceil(25) {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in (batch * 25)..((batch + 1) * 25).min(n) {
            let pki = pki.clone();
            tasks.spawn(async move {
                let tcp = connect_from(from, addr).await.ok()?;
                let mut client = Client::over(tcp, &pki, None).await.ok()?;
                let answer = client
                    .try_send(bulwark_testkit::get("/api/v1/pods"))
                    .await
                    .ok()?;
                assert_eq!(answer.status, 401);
                Some(client)
            });
        }
        while let Some(done) = tasks.join_next().await {
            open.extend(done.expect("flood task"));
        }
    }
    open
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_flood_is_capped_refused_fast_and_closed_while_clients_are_served() {
    bulwark::listen::raise_open_file_limit();
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: UNLIMITED_RULES,
        settings: vec![
            ("listen.limits.maxConnections", "300"),
            ("listen.limits.maxConnectionsPerSource", "120"),
            ("listen.limits.unauthenticatedTimeout", "10s"),
        ],
        ..Setup::default()
    })
    .await
    .ready()
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    assert_eq!(
        alice.get("/api/v1/namespaces/team/configmaps").await.status,
        200
    );

    // Four sources of 150 each: each source is cut at 120, and the total at 300, where
    // each new connection evicts the oldest one that has not authenticated.
    let mut flood = Vec::new();
    for source in 10..14u8 {
        flood.extend(idle_flood(&cluster, [127, 0, 0, source], 150).await);
    }
    let open = metric(&cluster, "bulwark_connections_open");
    assert!(open <= 300.0, "{open} open: the caps did not hold");
    assert!(
        flood.len() >= 250,
        "only {} flood connections served",
        flood.len()
    );
    assert!(
        metric(
            &cluster,
            r#"bulwark_connections_refused_total{reason="max_connections_per_source"}"#
        ) >= 30.0
    );
    let evicted = || {
        metric(
            &cluster,
            r#"bulwark_connections_closed_total{reason="evicted"}"#,
        )
    };
    assert!(evicted() >= 1.0);

    // Past the cap a new connection is served at once, in the place of the oldest
    // unauthenticated one; alice's authenticated connection is never the one to go.
    let before = evicted();
    let newcomer = tokio::time::timeout(
        Duration::from_secs(2),
        anonymous_from(&cluster, [127, 0, 0, 20]),
    )
    .await
    .expect("a connection past the cap was left hanging");
    assert!(newcomer.is_ok(), "a connection past the cap was not served");
    assert_eq!(evicted(), before + 1.0);
    drop(newcomer);

    // The established, authenticated client and the admin listener answer throughout.
    for _ in 0..20 {
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            alice.get("/api/v1/namespaces/team/configmaps"),
        )
        .await
        .expect("alice's GET hung during the flood");
        assert_eq!(answer.status, 200);
        let (status, _) = cluster.admin_get("/readyz").await;
        assert_eq!(status, 200);
    }

    // The flood's connections never authenticated: they are closed after the timeout and
    // their places are free again.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let open = metric(&cluster, "bulwark_connections_open");
    assert!(
        open <= 2.0,
        "{open} connections still open after the timeout"
    );
    // Each was evicted or closed at the timeout.
    assert!(
        metric(
            &cluster,
            r#"bulwark_connections_closed_total{reason="unauthenticated_timeout"}"#
        ) + evicted()
            >= flood.len() as f64
    );
    for client in flood.iter_mut().take(5) {
        assert!(
            client
                .try_send(bulwark_testkit::get("/healthz"))
                .await
                .is_err(),
            "a closed flood connection still answers"
        );
    }
    let mut fresh = anonymous_from(&cluster, [127, 0, 0, 20]).await.unwrap();
    let answer = fresh
        .try_send(bulwark_testkit::get("/readyz"))
        .await
        .unwrap();
    assert_eq!(
        answer.status, 200,
        "a new client is served once the flood is gone"
    );
    assert_eq!(
        alice.get("/api/v1/namespaces/team/configmaps").await.status,
        200
    );
    assert!(metric_sum(&cluster.metrics(), "bulwark_connections_max") == 300.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_keeps_collecting_401s_is_closed_and_one_that_authenticates_is_kept() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        settings: vec![
            ("listen.limits.maxUnauthenticatedRequests", "5"),
            ("listen.limits.unauthenticatedTimeout", "2s"),
        ],
        ..Setup::default()
    })
    .await
    .ready()
    .await;
    let mut prober = anonymous_from(&cluster, [127, 0, 0, 1]).await.unwrap();
    let mut answered = 0;
    for _ in 0..10 {
        match prober
            .try_send(bulwark_testkit::with_token(
                bulwark_testkit::get("/api/v1/pods"),
                "not a token",
            ))
            .await
        {
            Ok(answer) => {
                assert_eq!(answer.status, 401);
                answered += 1;
            }
            Err(_) => break,
        }
    }
    // The fifth refusal closes the connection with a GOAWAY; a request the client sent
    // before it read the GOAWAY is still answered (refused, without a review), never more.
    assert!(
        (5..=6).contains(&answered),
        "the connection was not closed after 5 refusals in a row: {answered} answers"
    );
    assert_eq!(
        metric(
            &cluster,
            r#"bulwark_connections_closed_total{reason="unauthenticated_requests"}"#
        ),
        1.0
    );

    // A client that authenticates keeps its connection past the timeout, even with some
    // refused requests between its good ones.
    let mut alice = cluster.client("alice", &[]).await;
    assert_eq!(
        alice.get("/api/v1/namespaces/team/configmaps").await.status,
        200
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        alice.get("/api/v1/namespaces/team/configmaps").await.status,
        200
    );
    assert_eq!(
        metric(
            &cluster,
            r#"bulwark_connections_closed_total{reason="unauthenticated_timeout"}"#
        ),
        0.0,
        "alice's connection was closed as unauthenticated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_token_review_is_slow_keeps_its_connection() {
    // The apiserver answers everything, its TokenReview included, in 1.6 s: longer than the
    // unauthenticated timeout. A client waiting on its review is not a client that never
    // authenticates.
    let cluster = Cluster::start(Setup {
        replicas: 1,
        settings: vec![("listen.limits.unauthenticatedTimeout", "1s")],
        ..Setup::default()
    })
    .await
    .ready()
    .await;
    cluster
        .fleet
        .replica(0)
        .set_delay(Duration::from_millis(1600));
    let mut tina = cluster.anonymous_client().await;
    let answer = tina
        .try_send(bulwark_testkit::with_token(
            bulwark_testkit::get("/api/v1/namespaces/team/configmaps"),
            bulwark_testkit::GOOD_TOKEN,
        ))
        .await
        .expect("the connection was closed while its token was being reviewed");
    assert_eq!(answer.status, 200);
    assert_eq!(
        metric(
            &cluster,
            r#"bulwark_connections_closed_total{reason="unauthenticated_timeout"}"#
        ),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_that_empties_the_review_bucket_buys_its_connection_no_time() {
    // One review a second for everyone: a client that sends a new token every 100 ms is
    // refused review_limited by the bucket it empties itself. That is its own doing, not
    // Bulwark's: its connection is closed at the unauthenticated timeout like any other
    // that never authenticates, not given the extra periods a failed review earns.
    let cluster = Cluster::start(Setup {
        replicas: 1,
        settings: vec![
            ("listen.limits.unauthenticatedTimeout", "1s"),
            ("listen.limits.maxUnauthenticatedRequests", "1000"),
            ("identity.tokenReview.rate", "{qps: 1, burst: 1}"),
        ],
        ..Setup::default()
    })
    .await
    .ready()
    .await;
    let mut flooder = anonymous_from(&cluster, [127, 0, 0, 31]).await.unwrap();
    let started = std::time::Instant::now();
    let mut limited = 0;
    let lived = loop {
        let token = format!("flood-{}", started.elapsed().as_nanos());
        match flooder
            .try_send(bulwark_testkit::with_token(
                bulwark_testkit::get("/api/v1/pods"),
                &token,
            ))
            .await
        {
            Ok(answer) => {
                if answer.status == 429 {
                    assert_eq!(answer.headers["x-bulwark-reason"], "review_limited");
                    limited += 1;
                }
            }
            Err(_) => break started.elapsed(),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the flooding connection is still open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        limited > 3,
        "the flood was refused by the bucket: {limited}"
    );
    assert!(
        lived < Duration::from_millis(2_500),
        "closed at its timeout and last second, not given more periods: lived {lived:?}"
    );
    assert_eq!(
        metric(
            &cluster,
            r#"bulwark_connections_closed_total{reason="unauthenticated_timeout"}"#
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_writes_the_prefixes_trusted_for_token_reviews_and_a_restart_reads_them() {
    // After a restart every token is new, and the prefixes that had tokens accepted are
    // what keeps their reviews under a flood. The minute's write may not have come yet when
    // SIGTERM does: the drain writes them last, and the next Bulwark starts from them.
    let dir = tempfile::tempdir().unwrap();
    let memory = dir.path().join("review-memory");
    let setting: &'static str = Box::leak(memory.display().to_string().into_boxed_str());
    let setup = || Setup {
        replicas: 1,
        dir: Some(dir.path().to_path_buf()),
        settings: vec![("identity.tokenReview.memoryFile", setting)],
        ..Setup::default()
    };
    let cluster = Cluster::start(setup()).await.ready().await;
    let mut tina = anonymous_from(&cluster, [127, 0, 0, 51]).await.unwrap();
    let answer = tina
        .send(bulwark_testkit::with_token(
            bulwark_testkit::get("/api/v1/namespaces/team/configmaps"),
            bulwark_testkit::GOOD_TOKEN,
        ))
        .await;
    assert_eq!(answer.status, 200);
    assert!(!memory.exists(), "not written before the minute");
    cluster.stop().await;
    let written = std::fs::read_to_string(&memory).unwrap();
    assert!(written.starts_with("127.0.0.0 "), "{written:?}");

    // The next Bulwark reads them at start: with no token accepted, it writes them again.
    Cluster::start(setup()).await.ready().await.stop().await;
    let rewritten = std::fs::read_to_string(&memory).unwrap();
    assert!(rewritten.starts_with("127.0.0.0 "), "{rewritten:?}");

    // A file that is not one Bulwark wrote is ignored with a warning: Bulwark starts all
    // the same, trusting nobody.
    std::fs::write(&memory, [0xff_u8; 16]).unwrap();
    Cluster::start(setup()).await.ready().await.stop().await;
    assert_eq!(std::fs::read_to_string(&memory).unwrap(), "");
}
