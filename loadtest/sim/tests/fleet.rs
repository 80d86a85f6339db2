//! The fleet over real TLS sockets: authentication, impersonation, authorization, reviews,
//! fault hooks, the memory model and the L4 balancer, as a client observes them.

use std::time::Duration;

use bulwark_sim::client::{self, Reply};
use bulwark_sim::{Fleet, HeapModel, Pki, Policy, SimConfig, StaticToken};
use bytes::Bytes;
use serde_json::{Value, json};

fn cfg() -> SimConfig {
    SimConfig {
        replicas: 2,
        front_proxy_allowed_names: vec!["front-proxy".into()],
        tokens: vec![StaticToken { token: "tok-alice".into(), user: "alice".into(), uid: "u-1".into(), groups: vec!["dev".into()], ..StaticToken::default() }],
        policy: Policy::from_yaml(
            "rules:\n- users: [alice]\n  verbs: [get, list, watch]\n  resources: [secrets]\n  namespaces: [ns-1]\n- users: [imp]\n  verbs: [impersonate]\n  resources: [users, groups]\n- users: [proxy]\n  verbs: [create]\n  resources: [tokenreviews.authentication.k8s.io, subjectaccessreviews.authorization.k8s.io]\n",
        )
        .unwrap(),
        seed: vec!["secrets=20x1KiB".parse().unwrap()],
        ..SimConfig::default()
    }
}

async fn get_as(
    fleet: &Fleet,
    i: usize,
    cert: Option<&bulwark_sim::CertKey>,
    path: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let tls = client::tls_config(fleet.pki(), cert, &[b"h2"]).unwrap();
    let mut b = http::Request::get(format!("https://localhost{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    client::request(fleet.addrs()[i], &tls, b.body(Bytes::new()).unwrap())
        .await
        .unwrap()
}

async fn post_as(fleet: &Fleet, cert: &bulwark_sim::CertKey, path: &str, body: Value) -> Reply {
    let tls = client::tls_config(fleet.pki(), Some(cert), &[b"http/1.1"]).unwrap();
    let req = http::Request::post(format!("https://localhost{path}"))
        .header("content-type", "application/json")
        .body(Bytes::from(body.to_string()))
        .unwrap();
    client::request(fleet.addrs()[0], &tls, req).await.unwrap()
}

#[tokio::test]
async fn client_certs_tokens_and_anonymous_are_told_apart() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let pki = fleet.pki();
    let alice = pki.client_ca.client_cert("alice", &["dev", "qa"]);
    let r = get_as(
        &fleet,
        0,
        Some(&alice),
        "/api/v1/namespaces/ns-1/secrets",
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let seen = fleet.seen_requests().pop().unwrap();
    assert_eq!((seen.user.as_str(), seen.replica), ("alice", 0));
    assert_eq!(seen.groups, ["dev", "qa", "system:authenticated"]);

    let r = get_as(
        &fleet,
        1,
        None,
        "/api/v1/namespaces/ns-1/secrets",
        &[("authorization", "Bearer tok-alice")],
    )
    .await;
    assert_eq!(r.status, 200);
    let seen = fleet.seen_requests().pop().unwrap();
    assert_eq!(
        (seen.user.as_str(), seen.uid.as_str(), seen.replica),
        ("alice", "u-1", 1)
    );
    assert_eq!(
        fleet.replica(1).stats().requests_by_user.get("alice"),
        Some(&1)
    );

    let r = get_as(
        &fleet,
        0,
        None,
        "/api/v1/namespaces/ns-1/secrets",
        &[("authorization", "Bearer nope")],
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["reason"], "Unauthorized");

    let expired = pki.client_ca.expired_client_cert("alice", &[]);
    let r = get_as(
        &fleet,
        0,
        Some(&expired),
        "/api/v1/namespaces/ns-1/secrets",
        &[],
    )
    .await;
    assert_eq!(
        r.status, 401,
        "an expired client cert is a 401, not a handshake failure"
    );

    let r = get_as(&fleet, 0, None, "/api/v1/namespaces/ns-1/secrets", &[]).await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.json()["message"],
        "secrets is forbidden: User \"system:anonymous\" cannot list resource \"secrets\" in API group \"\" in the namespace \"ns-1\""
    );
    let r = get_as(
        &fleet,
        0,
        Some(&alice),
        "/api/v1/namespaces/ns-2/secrets/secret-2",
        &[],
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.json(),
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "secrets \"secret-2\" is forbidden: User \"alice\" cannot get resource \"secrets\" in API group \"\" in the namespace \"ns-2\"",
            "reason": "Forbidden", "details": {"name": "secret-2", "kind": "secrets"}, "code": 403})
    );
}

#[tokio::test]
async fn anonymous_off_means_401() {
    let fleet = Fleet::start(SimConfig {
        anonymous: false,
        ..cfg()
    })
    .await
    .unwrap();
    assert_eq!(
        get_as(&fleet, 0, None, "/api/v1/namespaces/ns-1/secrets", &[])
            .await
            .status,
        401
    );
    // Probes stay answerable.
    assert_eq!(get_as(&fleet, 0, None, "/readyz", &[]).await.body, "ok");
}

#[tokio::test]
async fn front_proxy_headers_are_authoritative_only_from_the_front_proxy() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let pki = fleet.pki();
    let fp = pki.front_proxy_ca.client_cert("front-proxy", &[]);
    let hdrs = [
        ("x-remote-user", "alice"),
        ("x-remote-group", "dev"),
        ("x-remote-group", "ops"),
        ("x-remote-extra-scopes%2Fa", "s1"),
        ("x-remote-uid", "u-9"),
    ];
    let r = get_as(
        &fleet,
        0,
        Some(&fp),
        "/api/v1/namespaces/ns-1/secrets",
        &hdrs,
    )
    .await;
    assert_eq!(r.status, 200);
    let s = fleet.seen_requests().pop().unwrap();
    assert_eq!(s.user, "alice");
    assert_eq!(s.groups, ["dev", "ops", "system:authenticated"]);
    assert_eq!(s.uid, "u-9");
    assert_eq!(s.extra.get("scopes/a").unwrap(), &["s1"]);
    assert!(
        fleet
            .replica(0)
            .stats()
            .last_headers_seen
            .iter()
            .any(|(k, v)| k == "x-remote-user" && v == "alice")
    );

    // The same headers from a user's client cert are ignored.
    let bob = pki.client_ca.client_cert("bob", &[]);
    let r = get_as(
        &fleet,
        0,
        Some(&bob),
        "/api/v1/namespaces/ns-1/secrets",
        &hdrs,
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(fleet.seen_requests().pop().unwrap().user, "bob");

    // A front-proxy connection without X-Remote-User is anonymous.
    get_as(&fleet, 0, Some(&fp), "/version", &[]).await;
    assert_eq!(
        fleet.seen_requests().pop().unwrap().user,
        "system:anonymous"
    );

    // A front-proxy cert with a CN not allowed gets 401 for X-Remote-* requests.
    let other = pki.front_proxy_ca.client_cert("someone", &[]);
    assert_eq!(
        get_as(
            &fleet,
            0,
            Some(&other),
            "/api/v1/namespaces/ns-1/secrets",
            &hdrs
        )
        .await
        .status,
        401
    );
}

#[tokio::test]
async fn impersonation_is_checked_per_attribute() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let imp = fleet.pki().client_ca.client_cert("imp", &[]);
    let r = get_as(
        &fleet,
        0,
        Some(&imp),
        "/api/v1/namespaces/ns-1/secrets",
        &[("impersonate-user", "alice"), ("impersonate-group", "x")],
    )
    .await;
    assert_eq!(r.status, 200);
    let s = fleet.seen_requests().pop().unwrap();
    assert_eq!(
        (s.user.as_str(), s.impersonated_by.as_deref()),
        ("alice", Some("imp"))
    );
    assert_eq!(s.groups, ["x", "system:authenticated"]);
    let r = get_as(
        &fleet,
        0,
        Some(&imp),
        "/api/v1/namespaces/ns-1/secrets",
        &[("impersonate-user", "alice"), ("impersonate-uid", "7")],
    )
    .await;
    assert_eq!(r.status, 403);
    let alice = fleet.pki().client_ca.client_cert("alice", &[]);
    let r = get_as(
        &fleet,
        0,
        Some(&alice),
        "/api/v1/namespaces/ns-1/secrets",
        &[("impersonate-user", "bob")],
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(
        r.json()["message"],
        "users \"bob\" is forbidden: User \"alice\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"
    );
}

#[tokio::test]
async fn token_and_subject_access_reviews() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let proxy = fleet.pki().client_ca.client_cert("proxy", &[]);
    let r = post_as(&fleet, &proxy, "/apis/authentication.k8s.io/v1/tokenreviews", json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "tok-alice"}})).await;
    assert_eq!(r.status, 201);
    let v = r.json();
    assert_eq!(v["status"]["authenticated"], true);
    assert_eq!(v["status"]["user"]["username"], "alice");
    assert_eq!(
        v["status"]["user"]["groups"],
        json!(["dev", "system:authenticated"])
    );
    let r = post_as(
        &fleet,
        &proxy,
        "/apis/authentication.k8s.io/v1/tokenreviews",
        json!({"spec": {"token": "bad"}}),
    )
    .await;
    assert_eq!(r.json()["status"], json!({"user": {}}));

    let sar = |ns: &str| json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {"user": "alice", "groups": ["system:authenticated"], "resourceAttributes": {"verb": "list", "resource": "secrets", "namespace": ns, "version": "v1"}}});
    let r = post_as(
        &fleet,
        &proxy,
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        sar("ns-1"),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["status"]["allowed"].clone()),
        (201, json!(true))
    );
    let r = post_as(
        &fleet,
        &proxy,
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        sar("ns-2"),
    )
    .await;
    assert_eq!(r.json()["status"]["allowed"], false);
    // Callers need `create` on the review resources.
    let alice = fleet.pki().client_ca.client_cert("alice", &[]);
    let r = post_as(
        &fleet,
        &alice,
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        sar("ns-1"),
    )
    .await;
    assert_eq!(r.status, 403);
}

fn admin_tls(pki: &Pki, alpn: &[&[u8]]) -> rustls::ClientConfig {
    let admin = pki.client_ca.client_cert("admin", &["system:masters"]);
    client::tls_config(pki, Some(&admin), alpn).unwrap()
}

#[tokio::test]
async fn a_frozen_replica_answers_nothing_until_it_thaws() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    let a0 = fleet.addrs()[0];
    fleet.replica(0).freeze();
    let read = tokio::spawn({
        let tls = tls.clone();
        async move { client::get(a0, &tls, "/api/v1/namespaces").await }
    });
    let probe = tokio::spawn(async move { client::get(a0, &tls, "/readyz").await });
    // Real time: a frozen replica answers nothing however long the wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!read.is_finished(), "a frozen replica answered a read");
    assert!(!probe.is_finished(), "a frozen replica answered its probe");
    fleet.replica(0).thaw();
    assert_eq!(read.await.unwrap().unwrap().status, 200);
    assert_eq!(probe.await.unwrap().unwrap().status, 200);
    assert_eq!(fleet.replica(0).stats().requests, 1);
}

#[tokio::test]
async fn fault_hooks_take_effect_immediately() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    let a0 = fleet.addrs()[0];
    let r0 = fleet.replica(0);

    r0.set_fail(Some(503));
    let r = client::get(a0, &tls, "/api/v1/secrets").await.unwrap();
    assert_eq!(
        (r.status, r.json()["reason"].clone()),
        (503, json!("ServiceUnavailable"))
    );
    assert_eq!(
        client::get(a0, &tls, "/readyz").await.unwrap().status,
        200,
        "probes stay healthy"
    );
    r0.set_fail(None);

    r0.set_refuse_streams(true);
    let err = client::get(a0, &tls, "/api/v1/secrets").await.unwrap_err();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    let reason = std::iter::from_fn(|| {
        let this = cause?;
        cause = this.source();
        Some(this)
    })
    .find_map(|e| e.downcast_ref::<h2::Error>())
    .and_then(h2::Error::reason);
    assert_eq!(reason, Some(h2::Reason::REFUSED_STREAM), "{err:?}");
    let h1 = admin_tls(fleet.pki(), &[b"http/1.1"]);
    assert!(
        client::get(a0, &h1, "/api/v1/secrets").await.is_err(),
        "HTTP/1.1: connection closed"
    );
    r0.set_refuse_streams(false);

    r0.set_reset_mid_body(Some(100));
    let err = client::get(a0, &tls, "/api/v1/secrets").await.unwrap_err();
    let mut causes = vec![err.to_string()];
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        causes.push(c.to_string());
        cause = c.source();
    }
    let causes = causes.join(": ");
    assert!(causes.contains("stream"), "{causes}");
    r0.set_reset_mid_body(None);

    r0.set_delay(Duration::from_millis(50));
    assert_eq!(
        client::get(a0, &tls, "/api/v1/secrets")
            .await
            .unwrap()
            .status,
        200
    );
    r0.set_delay(Duration::ZERO);

    r0.stop().await;
    assert!(
        client::get(a0, &tls, "/version").await.is_err(),
        "a stopped replica refuses connections"
    );
    assert_eq!(
        client::get(fleet.addrs()[1], &tls, "/version")
            .await
            .unwrap()
            .status,
        200
    );
    r0.start().await;
    assert_eq!(
        client::get(a0, &tls, "/version").await.unwrap().status,
        200,
        "back on the same address"
    );
}

#[tokio::test]
async fn stop_drops_open_watches() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    let a0 = fleet.addrs()[0];
    let watch = tokio::spawn({
        let tls = tls.clone();
        async move { client::get(a0, &tls, "/api/v1/secrets?watch=1").await }
    });
    for _ in 0..100 {
        if fleet.replica(0).stats().open_watches == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(fleet.replica(0).stats().open_watches, 1);
    fleet.replica(0).stop().await;
    let r = tokio::time::timeout(Duration::from_secs(5), watch)
        .await
        .expect("watch ended")
        .unwrap();
    assert!(r.is_err(), "the watch is cut, not ended cleanly");
}

/// Once `stop` returns, nothing more leaves the replica: a change made right after it never
/// reaches a watch that was open on it (the cache's 410 relist tests rely on this).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaves_a_replica_after_stop_returns() {
    use http_body_util::BodyExt;
    let fleet = Fleet::start(cfg()).await.unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    let tcp = tokio::net::TcpStream::connect(fleet.addrs()[0])
        .await
        .unwrap();
    let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect(
            rustls::pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let request = http::Request::get("https://localhost/api/v1/namespaces/default/secrets?watch=1")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let response = send.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();

    fleet.replica(0).stop().await;
    for i in 0..50 {
        fleet
            .store()
            .create(
                "secrets",
                "default",
                json!({"metadata": {"name": format!("after-stop-{i}")}, "data": {"k": "djE="}}),
            )
            .unwrap();
    }
    let mut seen = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                seen.extend_from_slice(data);
            }
        }
    });
    read.await.expect("the watch ended");
    assert!(
        !String::from_utf8_lossy(&seen).contains("after-stop"),
        "a stopped replica sent an event: {}",
        String::from_utf8_lossy(&seen)
    );
}

#[tokio::test]
async fn a_list_past_the_heap_limit_ooms_the_replica() {
    let seed = "secrets=200x10KiB".parse().unwrap();
    let heap = HeapModel {
        base_bytes: 1 << 20,
        limit_bytes: Some(8 << 20),
        restart: Duration::from_millis(300),
    };
    let fleet = Fleet::start(SimConfig {
        replicas: 1,
        seed: vec![seed],
        heap,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    let a0 = fleet.addrs()[0];
    // One namespace (~200 KiB read, ~1 MiB charged) fits.
    let r = client::get(a0, &tls, "/api/v1/namespaces/ns-1/secrets")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let s = fleet.replica(0).stats();
    assert_eq!(s.ooms, 0);
    assert!(
        s.peak_heap_bytes > s.heap_bytes,
        "the LIST's charge shows in the peak: {s:?}"
    );
    // The whole cluster (~2 MiB read, ~10 MiB charged) does not.
    let _ = client::get(a0, &tls, "/api/v1/secrets").await;
    assert_eq!(fleet.replica(0).stats().ooms, 1);
    let mut back = false;
    for _ in 0..100 {
        if client::get(a0, &tls, "/version").await.is_ok() {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(back, "the replica restarts");
}

#[tokio::test]
async fn the_l4_balancer_pins_connections_round_robin_and_skips_dead_replicas() {
    let fleet = Fleet::start(SimConfig {
        replicas: 3,
        ..cfg()
    })
    .await
    .unwrap();
    let lb = fleet.l4_balancer().await.unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    for _ in 0..3 {
        client::get(lb, &tls, "/api/v1/namespaces/ns-1/secrets")
            .await
            .unwrap();
    }
    let per: Vec<u64> = fleet.stats().iter().map(|s| s.requests).collect();
    assert_eq!(per, [1, 1, 1]);
    fleet.replica(1).stop().await;
    for _ in 0..4 {
        assert_eq!(
            client::get(lb, &tls, "/api/v1/namespaces/ns-1/secrets")
                .await
                .unwrap()
                .status,
            200
        );
    }
    let per: Vec<u64> = fleet.stats().iter().map(|s| s.requests).collect();
    assert_eq!(per[1], 1);
    assert_eq!(per[0] + per[2], 6);
}

#[tokio::test]
async fn metrics_count_requests_by_user() {
    let fleet = Fleet::start(cfg()).await.unwrap();
    let tls = admin_tls(fleet.pki(), &[b"h2"]);
    client::get(fleet.addrs()[0], &tls, "/api/v1/namespaces/ns-1/secrets")
        .await
        .unwrap();
    let m = client::get(fleet.addrs()[0], &tls, "/metrics")
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&m.body);
    assert!(text.contains("bulwark_sim_requests_total{code=\"200\",replica=\"0\",resource=\"secrets\",user=\"admin\",verb=\"list\"} 1"), "{text}");
    assert!(
        fleet
            .metrics_text()
            .contains("bulwark_sim_heap_bytes{replica=\"1\"}")
    );
}
