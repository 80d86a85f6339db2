//! The upstream pool against the simulated apiserver fleet over real TLS and HTTP/2:
//! replicas that stop, fail, refuse, reset and stall, and what a client of the pool sees.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bulwark::metrics::Metrics;
use bulwark::stages::error::ProxyError;
use bulwark::upstream::{
    RetryPolicy, Route, Upstream, UpstreamCredential, UpstreamError, UpstreamReplica, UpstreamTls,
};
use bulwark_sim::{Fleet, Pki, Seed, SimConfig};
use bulwark_testkit::{BulwarkConfig, Credentials, Names};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A fleet, a pool in front of it, and the folder holding the pool's certificates.
struct Setup {
    fleet: Fleet,
    upstream: Upstream,
    metrics: Metrics,
    _dir: tempfile::TempDir,
}

/// Starts `replicas` simulated apiservers with `seed`, and a pool whose config is the
/// defaults plus short test timeouts plus the `upstream` settings in `extra`.
async fn setup(replicas: usize, seed: Vec<Seed>, extra: &[(&str, &str)]) -> Result<Setup> {
    let pki = Arc::new(Pki::new());
    let fleet = Fleet::start(SimConfig {
        seed,
        ..bulwark_testkit::fleet_config(pki.clone(), replicas, bulwark_testkit::policy())
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let names = Names {
        own_group: "system:masters",
        ..Names::default()
    };
    let credentials = Credentials::mint(dir.path(), &pki, &pki.server_ca, names)?;
    let mut config = BulwarkConfig::new(credentials, fleet.addrs())
        .set("upstream.timeouts", "{connect: 2s}")
        .set("upstream.ejectBase", "200ms")
        .set("upstream.ejectMax", "2s")
        .set("upstream.probeInterval", "100ms");
    for (key, yaml) in extra {
        config = config.set(&format!("upstream.{key}"), yaml);
    }
    let cfg = config.config().upstream;
    let metrics = Metrics::new();
    let upstream = Upstream::new(&cfg, UpstreamTls::from_config(&cfg)?, metrics.clone())?;
    Ok(Setup {
        fleet,
        upstream,
        metrics,
        _dir: dir,
    })
}

fn seed(resource: &str, count: usize, size: usize) -> Seed {
    Seed {
        resource: resource.into(),
        count,
        size,
        namespaces: vec!["ns-0".into()],
    }
}

/// The status a client gets for an upstream failure, through Bulwark's one mapping.
fn status_of(error: UpstreamError) -> StatusCode {
    ProxyError::Upstream(error).refusal().status()
}

fn read() -> Route {
    Route {
        credential: UpstreamCredential::FrontProxy,
        retry: RetryPolicy::Read,
        long_running: false,
        watch: false,
        timeout: Some(Duration::from_secs(10)),
        attempt_timeout: None,
        client_timeout: None,
        replica: None,
        body_flow: None,
    }
}

fn write() -> Route {
    Route {
        retry: RetryPolicy::Write,
        ..read()
    }
}

fn watch() -> Route {
    Route {
        long_running: true,
        watch: true,
        timeout: None,
        ..read()
    }
}

/// A request as the request path hands it over: origin form, front-proxy identity headers.
fn request(method: &str, path: &str, body: &str) -> Request<bulwark::Body> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("x-remote-user", "admin")
        .header("x-remote-group", "system:masters")
        .header("content-type", "application/json")
        .body(bulwark::full(body.to_owned()))
        .expect("valid request")
}

fn get(path: &str) -> Request<bulwark::Body> {
    request("GET", path, "")
}

fn create_configmap(name: &str) -> Request<bulwark::Body> {
    request(
        "POST",
        "/api/v1/namespaces/ns-0/configmaps",
        &format!(r#"{{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"{name}"}}}}"#),
    )
}

/// Waits (real time, bounded) until `check` holds; a deadline, not a speed assertion.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The whole body of a response.
async fn drain(response: http::Response<bulwark::Body>) -> Result<bytes::Bytes> {
    let collected = response
        .into_body()
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok(collected.to_bytes())
}

fn replica_of(response: &http::Response<bulwark::Body>) -> String {
    response
        .extensions()
        .get::<UpstreamReplica>()
        .map(|r| r.0.to_string())
        .unwrap_or_default()
}

#[tokio::test]
async fn requests_reach_the_replicas_with_their_path_and_identity() -> Result<()> {
    let s = setup(2, vec![seed("secrets", 3, 100)], &[]).await?;
    let response = s
        .upstream
        .send(get("/api/v1/namespaces/ns-0/secrets?limit=2"), read())
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(!replica_of(&response).is_empty());
    let body = drain(response).await?;
    let list: serde_json::Value = serde_json::from_slice(&body)?;
    assert_eq!(list["kind"], "SecretList");
    assert_eq!(list["items"].as_array().map(Vec::len), Some(2));
    let seen = s.fleet.seen_requests();
    let last = seen.last().context("the fleet saw the request")?;
    assert_eq!(last.path, "/api/v1/namespaces/ns-0/secrets?limit=2");
    assert_eq!(last.user, "admin");
    Ok(())
}

#[tokio::test]
async fn a_stopped_replica_moves_reads_without_failing() -> Result<()> {
    let s = setup(3, vec![seed("secrets", 5, 100)], &[]).await?;
    // Warm connections to every replica (the pick is random among idle replicas, so keep
    // going until each has been picked).
    for _ in 0..200 {
        if s.upstream.snapshot().iter().all(|r| r.connections >= 1) {
            break;
        }
        let r = s
            .upstream
            .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), read())
            .await?;
        assert_eq!(r.status(), StatusCode::OK);
        drain(r).await?;
    }
    assert!(s.upstream.snapshot().iter().all(|r| r.connections >= 1));
    s.fleet.replica(0).stop().await;
    let stopped = s.fleet.addrs()[0].to_string();
    for _ in 0..30 {
        let r = s
            .upstream
            .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), read())
            .await?;
        assert_eq!(r.status(), StatusCode::OK);
        assert_ne!(replica_of(&r), stopped);
        drain(r).await?;
    }
    assert_eq!(s.upstream.healthy_replicas(), 2);
    assert!(!s.upstream.snapshot()[0].healthy);
    Ok(())
}

#[tokio::test]
async fn probes_eject_a_stopped_replica_and_bring_it_back() -> Result<()> {
    let s = setup(3, vec![], &[]).await?;
    s.upstream.spawn_probes();
    s.fleet.replica(1).stop().await;
    eventually("the stopped replica is ejected", || {
        s.upstream.healthy_replicas() == 2
    })
    .await;
    let gauge = s
        .metrics
        .upstream_healthy
        .with_label_values(&[&s.fleet.addrs()[1].to_string()]);
    assert_eq!(gauge.get(), 0);
    s.fleet.replica(1).start().await;
    eventually("the restarted replica is back", || {
        s.upstream.healthy_replicas() == 3
    })
    .await;
    assert_eq!(gauge.get(), 1);
    Ok(())
}

#[tokio::test]
async fn a_write_racing_a_stop_is_answered_or_failed_never_applied_twice() -> Result<()> {
    let s = setup(2, vec![], &[]).await?;
    // Writes wait before being applied, so the stop lands while they are in flight.
    for replica in s.fleet.replicas() {
        replica.set_delay(Duration::from_millis(300));
    }
    let before = s.fleet.applied_writes();
    let mut writes = Vec::new();
    for i in 0..20 {
        let upstream = s.upstream.clone();
        writes.push(tokio::spawn(async move {
            upstream
                .send(create_configmap(&format!("race-{i}")), write())
                .await
                .map(|r| r.status())
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.fleet.replica(0).stop().await;
    let (mut created, mut failed) = (0, 0);
    for w in writes {
        match w.await? {
            Ok(StatusCode::CREATED) => created += 1,
            // A 409 would mean the write was sent again after it had been applied.
            Ok(other) => panic!("unexpected answer {other}"),
            Err(UpstreamError::Interrupted(_)) => failed += 1,
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    assert_eq!(created + failed, 20);
    assert!(
        failed > 0,
        "some writes were in flight on the stopped replica"
    );
    let applied = s.fleet.applied_writes() - before;
    assert_eq!(
        applied, created,
        "every answered write applied once, no other"
    );
    Ok(())
}

#[tokio::test]
async fn a_write_applied_but_unanswered_is_not_sent_again() -> Result<()> {
    let s = setup(2, vec![], &[]).await?;
    // Every replica applies the write, then resets the stream: the answer may be lost.
    for replica in s.fleet.replicas() {
        replica.set_reset_mid_body(Some(0));
    }
    let before = s.fleet.applied_writes();
    let mut interrupted = 0;
    for i in 0..10 {
        match s
            .upstream
            .send(create_configmap(&format!("lost-{i}")), write())
            .await
        {
            // The head made it before the reset; the body then fails.
            Ok(r) => assert_eq!(r.status(), StatusCode::CREATED),
            Err(UpstreamError::Interrupted(_)) => interrupted += 1,
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    assert!(interrupted > 0, "some answers were lost");
    assert_eq!(
        s.fleet.applied_writes() - before,
        10,
        "each write applied once"
    );
    Ok(())
}

#[tokio::test]
async fn refused_streams_are_retried_even_for_writes_without_ejecting() -> Result<()> {
    let s = setup(2, vec![], &[]).await?;
    s.fleet.replica(0).set_refuse_streams(true);
    let before = s.fleet.applied_writes();
    for i in 0..10 {
        let r = s
            .upstream
            .send(create_configmap(&format!("refused-{i}")), write())
            .await?;
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    assert_eq!(s.fleet.applied_writes() - before, 10);
    assert_eq!(s.upstream.healthy_replicas(), 2);
    Ok(())
}

#[tokio::test]
async fn five_hundreds_are_counted_and_never_eject() -> Result<()> {
    let s = setup(2, vec![seed("secrets", 1, 100)], &[]).await?;
    s.upstream.spawn_probes();
    s.fleet.replica(0).set_fail(Some(500));
    let failing = s.fleet.addrs()[0].to_string();
    let mut fives = 0;
    for _ in 0..30 {
        let r = s
            .upstream
            .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), read())
            .await?;
        if r.status() == StatusCode::INTERNAL_SERVER_ERROR {
            fives += 1;
            assert_eq!(replica_of(&r), failing);
        }
        drain(r).await?;
    }
    assert!(fives > 0, "the failing replica kept getting requests");
    assert_eq!(s.upstream.healthy_replicas(), 2);
    let counted = s
        .metrics
        .upstream_responses_total
        .with_label_values(&[&failing, "5xx"])
        .get();
    assert_eq!(counted, fives);
    Ok(())
}

/// API Priority and Fairness refusing one flow says nothing about the replica as a whole:
/// the 429 reaches the client as the apiserver wrote it, and the replica keeps its weight.
#[tokio::test]
async fn a_flows_own_apf_429_passes_through_and_lowers_no_weight() -> Result<()> {
    let s = setup(2, vec![seed("secrets", 1, 100)], &[]).await?;
    s.fleet.replica(0).set_fail(Some(429));
    let throttling = s.fleet.addrs()[0].to_string();
    let mut refused = 0;
    for _ in 0..30 {
        let r = s
            .upstream
            .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), read())
            .await?;
        if r.status() == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
            assert_eq!(replica_of(&r), throttling);
            assert_eq!(r.headers()["retry-after"], "1");
            assert!(
                r.headers()
                    .contains_key("x-kubernetes-pf-prioritylevel-uid")
            );
            assert_eq!(
                drain(r).await?,
                "Too many requests, please try again later.\n"
            );
        } else {
            drain(r).await?;
        }
    }
    assert!(refused > 0, "the throttling replica kept getting requests");
    assert!(
        s.upstream.snapshot().iter().all(|r| !r.throttled),
        "{:?}",
        s.upstream.snapshot()
    );
    Ok(())
}

#[tokio::test]
async fn every_replica_down_is_no_healthy_replica_with_retry_after() -> Result<()> {
    let s = setup(2, vec![], &[]).await?;
    for replica in s.fleet.replicas() {
        replica.stop().await;
    }
    let err = s
        .upstream
        .send(get("/api/v1/namespaces"), read())
        .await
        .expect_err("nothing is listening");
    match err {
        UpstreamError::NoHealthyReplica { retry_after } => {
            assert!(retry_after >= Duration::from_secs(1))
        }
        other => panic!("expected NoHealthyReplica, got {other:?}"),
    }
    assert_eq!(
        err_status(s.upstream.send(create_configmap("x"), write()).await),
        503
    );
    Ok(())
}

fn err_status(r: Result<http::Response<bulwark::Body>, UpstreamError>) -> u16 {
    match r {
        Ok(r) => r.status().as_u16(),
        Err(e) => status_of(e).as_u16(),
    }
}

#[tokio::test]
async fn a_response_head_slower_than_the_timeout_is_a_timeout() -> Result<()> {
    let s = setup(1, vec![], &[]).await?;
    s.fleet.replica(0).set_delay(Duration::from_secs(5));
    let route = Route {
        timeout: Some(Duration::from_millis(200)),
        ..read()
    };
    let err = s
        .upstream
        .send(get("/api/v1/namespaces"), route)
        .await
        .expect_err("the head is late");
    assert!(matches!(err, UpstreamError::Timeout { .. }), "{err:?}");
    assert_eq!(status_of(err), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(s.upstream.snapshot()[0].pending, 0);
    Ok(())
}

#[tokio::test]
async fn another_connection_opens_when_the_streams_of_one_are_taken() -> Result<()> {
    let s = setup(1, vec![], &[("streamsPerConnection", "2")]).await?;
    s.fleet.replica(0).set_delay(Duration::from_millis(300));
    let sends: Vec<_> = (0..5)
        .map(|_| s.upstream.send(get("/api/v1/namespaces"), read()))
        .collect();
    for r in futures::future::join_all(sends).await {
        let r = r?;
        assert_eq!(r.status(), StatusCode::OK);
        drain(r).await?;
    }
    assert_eq!(s.upstream.snapshot()[0].connections, 3);
    Ok(())
}

#[tokio::test]
async fn slow_reading_large_lists_do_not_stall_other_streams() -> Result<()> {
    // About 16 MiB each: far more than one stream's window.
    let s = setup(
        1,
        vec![seed("secrets", 1600, 10 * 1024)],
        &[("stallTimeout", "60s")],
    )
    .await?;
    let mut unread = Vec::new();
    for _ in 0..4 {
        let big = s
            .upstream
            .send(get("/api/v1/namespaces/ns-0/secrets"), read())
            .await?;
        assert_eq!(big.status(), StatusCode::OK);
        unread.push(big);
    }
    // Nobody reads the big bodies; give the replica time to fill every window it may fill
    // (a wait for the bad case to build up, not a speed assertion).
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Other requests on the same connection still flow. The bound only turns a stalled
    // connection into a failure instead of a hang.
    for _ in 0..20 {
        let small = async {
            let r = s
                .upstream
                .send(get("/api/v1/namespaces/ns-0/secrets/secret-1"), read())
                .await?;
            assert_eq!(r.status(), StatusCode::OK);
            drain(r).await
        };
        tokio::time::timeout(Duration::from_secs(10), small)
            .await
            .context("a small request stalled behind the unread LISTs")??;
    }
    assert_eq!(s.upstream.snapshot()[0].connections, 1);
    for big in unread {
        let body = drain(big).await?;
        let list: serde_json::Value = serde_json::from_slice(&body)?;
        assert_eq!(list["items"].as_array().map(Vec::len), Some(1600));
    }
    Ok(())
}

#[tokio::test]
async fn a_client_that_stops_reading_gets_its_upstream_stream_reset() -> Result<()> {
    let s = setup(
        1,
        vec![seed("secrets", 1600, 10 * 1024)],
        &[("stallTimeout", "300ms")],
    )
    .await?;
    let big = s
        .upstream
        .send(get("/api/v1/namespaces/ns-0/secrets"), read())
        .await?;
    // The stalled stream is released upstream: the replica is no longer serving it.
    eventually("the replica stops serving the stalled LIST", || {
        s.fleet.stats()[0].in_flight == 0
    })
    .await;
    // The client never sees a truncated success.
    assert!(big.into_body().collect().await.is_err());
    Ok(())
}

#[tokio::test]
async fn a_list_cut_mid_body_is_an_error_and_a_watch_cut_mid_body_ends_cleanly() -> Result<()> {
    // About 5 MiB of secrets, cut after 2 MiB: more than one stream window, so the
    // response head has certainly reached the pool before the reset.
    let s = setup(1, vec![seed("secrets", 500, 10 * 1024)], &[]).await?;
    s.fleet.replica(0).set_reset_mid_body(Some(2 * 1024 * 1024));
    let list = s
        .upstream
        .send(get("/api/v1/namespaces/ns-0/secrets"), read())
        .await?;
    assert!(list.into_body().collect().await.is_err());
    let watch_response = s
        .upstream
        .send(
            get("/api/v1/namespaces/ns-0/secrets?watch=true&resourceVersion=0"),
            watch(),
        )
        .await?;
    assert_eq!(watch_response.status(), StatusCode::OK);
    let events = drain(watch_response).await?;
    // The events up to the cut, each whole, then a clean end: no half event.
    assert!(events.len() > 1024 * 1024, "{} bytes", events.len());
    assert!(events.ends_with(b"\n"));
    for line in events.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let event: serde_json::Value = serde_json::from_slice(line)?;
        assert_eq!(event["type"], "ADDED");
    }
    eventually("the watch is no longer counted", || {
        s.upstream.snapshot()[0].watches == 0
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn watches_are_counted_while_open() -> Result<()> {
    let s = setup(2, vec![seed("secrets", 2, 100)], &[]).await?;
    let mut open = Vec::new();
    for _ in 0..4 {
        open.push(
            s.upstream
                .send(get("/api/v1/namespaces/ns-0/secrets?watch=true"), watch())
                .await?,
        );
    }
    let counts: Vec<u64> = s.upstream.snapshot().iter().map(|r| r.watches).collect();
    assert_eq!(counts, vec![2, 2], "balanced by watch count");
    drop(open);
    eventually("closed watches are no longer counted", || {
        s.upstream.snapshot().iter().all(|r| r.watches == 0)
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn an_upgrade_echoes_both_ways() -> Result<()> {
    let s = setup(1, vec![seed("pods", 1, 200)], &[]).await?;
    let upstream = s.upstream.clone();
    // A plain HTTP/1.1 front that hands requests to the pool, as the request path does.
    let front = TcpListener::bind("127.0.0.1:0").await?;
    let front_addr = front.local_addr()?;
    tokio::spawn(async move {
        let Ok((tcp, _)) = front.accept().await else {
            return;
        };
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let upstream = upstream.clone();
            async move {
                let req = req.map(|b| b.map_err(bulwark::BoxError::from).boxed_unsync());
                let route = Route {
                    long_running: true,
                    timeout: None,
                    ..write()
                };
                Ok::<_, Infallible>(match upstream.send(req, route).await {
                    Ok(r) => r,
                    Err(e) => {
                        let mut r = http::Response::new(bulwark::full(e.to_string()));
                        *r.status_mut() = status_of(e);
                        r
                    }
                })
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(tcp), service)
            .with_upgrades()
            .await;
    });
    let mut client = tokio::net::TcpStream::connect(front_addr).await?;
    client
        .write_all(
            b"POST /api/v1/namespaces/ns-0/pods/pod-0/exec?command=cat&stdin=true&stdout=true HTTP/1.1\r\n\
              Host: bulwark\r\n\
              X-Remote-User: admin\r\n\
              X-Remote-Group: system:masters\r\n\
              Connection: Upgrade\r\n\
              Upgrade: SPDY/3.1\r\n\
              Content-Length: 0\r\n\r\n",
        )
        .await?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        client.read_exact(&mut byte).await?;
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    for message in [&b"ping"[..], b"a second message"] {
        client.write_all(message).await?;
        let mut echoed = vec![0u8; message.len()];
        client.read_exact(&mut echoed).await?;
        assert_eq!(echoed, message);
    }
    Ok(())
}

#[tokio::test]
async fn an_oversized_body_is_refused_before_anything_is_sent() -> Result<()> {
    let s = setup(1, vec![], &[]).await?;
    let before = s.fleet.stats()[0].requests;
    let huge = "x".repeat(bulwark::upstream::MAX_REQUEST_BODY + 1);
    let err = s
        .upstream
        .send(
            request("POST", "/api/v1/namespaces/ns-0/configmaps", &huge),
            write(),
        )
        .await
        .expect_err("too large");
    assert_eq!(status_of(err), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(s.fleet.stats()[0].requests, before);
    Ok(())
}

/// Sends one read to replica `i` so that its connection is open (a frozen replica accepts
/// TCP but completes no handshake, so only a request on an open connection reaches it).
async fn warm(s: &Setup, i: usize) -> Result<()> {
    let route = Route {
        replica: Some(s.fleet.addrs()[i].to_string().into()),
        ..read()
    };
    let r = s.upstream.send(get("/api/v1/namespaces"), route).await?;
    assert_eq!(replica_of(&r), s.fleet.addrs()[i].to_string());
    drain(r).await?;
    Ok(())
}

fn retries(s: &Setup, replica: usize, reason: &str) -> u64 {
    s.metrics
        .upstream_retries_total
        .with_label_values(&[&s.fleet.addrs()[replica].to_string(), reason])
        .get()
}

#[tokio::test]
async fn a_read_on_a_frozen_replica_goes_to_another_at_its_attempt_limit() -> Result<()> {
    let s = setup(3, vec![seed("secrets", 1, 100)], &[]).await?;
    warm(&s, 0).await?;
    s.fleet.replica(0).freeze();
    let frozen = s.fleet.addrs()[0].to_string();
    let route = Route {
        replica: Some(frozen.clone().into()),
        attempt_timeout: Some(Duration::from_millis(300)),
        ..read()
    };
    let started = std::time::Instant::now();
    let r = s
        .upstream
        .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), route)
        .await?;
    let took = started.elapsed();
    assert_eq!(r.status(), StatusCode::OK);
    assert_ne!(replica_of(&r), frozen);
    drain(r).await?;
    // It reached the frozen replica first (the warm-up was its other request).
    assert_eq!(s.fleet.replica(0).stats().requests, 2);
    assert_eq!(retries(&s, 0, "attempt_timeout"), 1);
    // A bound, not a speed target: well before the request's own 10 s timeout.
    assert!(took < Duration::from_secs(5), "{took:?}");
    s.fleet.replica(0).thaw();
    Ok(())
}

#[tokio::test]
async fn reads_waiting_on_a_replica_ejected_as_unresponsive_go_to_another() -> Result<()> {
    let s = setup(3, vec![seed("secrets", 1, 100)], &[]).await?;
    s.upstream.spawn_probes();
    warm(&s, 0).await?;
    s.fleet.replica(0).freeze();
    let frozen = s.fleet.addrs()[0].to_string();
    // No attempt limit: only the ejection can move these reads on.
    let route = Route {
        replica: Some(frozen.clone().into()),
        ..read()
    };
    let started = std::time::Instant::now();
    let r = s
        .upstream
        .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), route)
        .await?;
    let took = started.elapsed();
    assert_eq!(r.status(), StatusCode::OK);
    assert_ne!(replica_of(&r), frozen);
    drain(r).await?;
    assert!(!s.upstream.snapshot()[0].healthy, "ejected");
    assert_eq!(s.fleet.replica(0).stats().requests, 2);
    assert_eq!(retries(&s, 0, "unresponsive"), 1);
    // The probe (every 100 ms, no answer within 1 s) ejects it: well before the 10 s timeout.
    assert!(took < Duration::from_secs(5), "{took:?}");
    s.fleet.replica(0).thaw();
    eventually("the thawed replica is back", || {
        s.upstream.healthy_replicas() == 3
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn a_write_on_a_frozen_replica_is_never_sent_again() -> Result<()> {
    let s = setup(2, vec![], &[]).await?;
    s.upstream.spawn_probes();
    warm(&s, 0).await?;
    let before: Vec<u64> = s.fleet.stats().iter().map(|r| r.requests).collect();
    s.fleet.replica(0).freeze();
    let frozen = s.fleet.addrs()[0].to_string();
    // The replica is ejected as unresponsive while the write waits, and the attempt limit
    // passes: neither sends a write that may have arrived to another replica.
    let route = Route {
        replica: Some(frozen.clone().into()),
        timeout: Some(Duration::from_secs(3)),
        attempt_timeout: Some(Duration::from_millis(200)),
        ..write()
    };
    let err = s
        .upstream
        .send(create_configmap("once"), route)
        .await
        .expect_err("a frozen replica never answers");
    assert!(
        matches!(&err, UpstreamError::Timeout { replica: Some(r) } if **r == *frozen),
        "{err:?}"
    );
    assert!(err.to_string().contains(&frozen), "{err}");
    assert_eq!(status_of(err), StatusCode::GATEWAY_TIMEOUT);
    assert!(!s.upstream.snapshot()[0].healthy, "ejected meanwhile");
    let after: Vec<u64> = s.fleet.stats().iter().map(|r| r.requests).collect();
    assert_eq!(
        (after[0] - before[0], after[1] - before[1]),
        (1, 0),
        "seen once, by the frozen replica"
    );
    assert_eq!(s.fleet.applied_writes(), 0);
    // Thawed, the replica applies the one write it holds, once.
    s.fleet.replica(0).thaw();
    eventually("the held write is applied", || {
        s.fleet.applied_writes() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.fleet.applied_writes(), 1);
    Ok(())
}

#[tokio::test]
async fn a_read_cut_off_past_its_own_timeout_is_not_sent_again() -> Result<()> {
    // The apiserver ends a request at its `timeout` parameter by resetting the stream; a
    // second try past that deadline would make the client wait twice as long for nothing.
    for (client_timeout, retried) in [(Some(Duration::from_millis(200)), false), (None, true)] {
        let s = setup(2, vec![seed("secrets", 1, 100)], &[]).await?;
        warm(&s, 0).await?;
        s.fleet.replica(0).set_delay(Duration::from_secs(3));
        let slow = s.fleet.addrs()[0].to_string();
        let route = Route {
            replica: Some(slow.clone().into()),
            client_timeout,
            ..read()
        };
        let replica = s.fleet.replica(0).clone();
        // The replica drops the request once the client's own timeout has passed.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            replica.stop().await;
        });
        let result = s
            .upstream
            .send(get("/api/v1/namespaces/ns-0/secrets/secret-0"), route)
            .await;
        if retried {
            let r = result?;
            assert_eq!(r.status(), StatusCode::OK);
            assert_ne!(replica_of(&r), slow);
        } else {
            let err = result.expect_err("a read past its own timeout was sent again");
            assert!(matches!(err, UpstreamError::Timeout { .. }), "{err:?}");
            assert_eq!(status_of(err), StatusCode::GATEWAY_TIMEOUT);
            assert_eq!(s.fleet.replica(1).stats().requests, 0);
        }
    }
    Ok(())
}
