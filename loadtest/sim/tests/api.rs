//! API semantics over real sockets: gzip, selectors (LIST and WATCH), resourceVersion
//! semantics, writes and their errors, the LIST memory cost rule, exec and logs.

use std::time::Duration;

use bulwark_sim::client::{self, Reply};
use bulwark_sim::{Fleet, HeapModel, SimConfig};
use bytes::Bytes;
use futures::{SinkExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, WatchEvent, WatchParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn admin_tls(fleet: &Fleet, alpn: &[&[u8]]) -> rustls::ClientConfig {
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    client::tls_config(fleet.pki(), Some(&admin), alpn).unwrap()
}

async fn send(fleet: &Fleet, method: &str, path: &str, ct: &str, body: Value) -> Reply {
    let tls = admin_tls(fleet, &[b"h2"]);
    let req = http::Request::builder()
        .method(method)
        .uri(format!("https://localhost{path}"))
        .header("content-type", ct)
        .body(Bytes::from(body.to_string()))
        .unwrap();
    client::request(fleet.addrs()[0], &tls, req).await.unwrap()
}

async fn get(fleet: &Fleet, path: &str, headers: &[(&str, &str)]) -> Reply {
    let tls = admin_tls(fleet, &[b"h2"]);
    let mut b = http::Request::get(format!("https://localhost{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    client::request(fleet.addrs()[0], &tls, b.body(Bytes::new()).unwrap())
        .await
        .unwrap()
}

fn names(r: &Reply) -> Vec<String> {
    r.json()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

async fn fleet(seed: &str) -> Fleet {
    Fleet::start(SimConfig {
        seed: vec![seed.parse().unwrap()],
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn large_lists_are_gzipped_when_the_client_accepts_it() {
    let fleet = fleet("secrets=40x8KiB@big").await;
    let plain = get(&fleet, "/api/v1/namespaces/big/secrets", &[]).await;
    assert!(plain.body.len() > 128 * 1024);
    assert!(plain.headers.get("content-encoding").is_none());
    let z = get(
        &fleet,
        "/api/v1/namespaces/big/secrets",
        &[("accept-encoding", "gzip")],
    )
    .await;
    assert_eq!(z.headers["content-encoding"], "gzip");
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&z.body[..]), &mut out).unwrap();
    assert_eq!(out, plain.body);
    let small = get(
        &fleet,
        "/api/v1/namespaces/big/secrets?labelSelector=seq%3D1",
        &[("accept-encoding", "gzip")],
    )
    .await;
    assert!(
        small.headers.get("content-encoding").is_none(),
        "small bodies are not compressed"
    );
    assert_eq!(names(&small), ["secret-1"]);
}

#[tokio::test]
async fn label_and_field_selectors_filter_lists() {
    let fleet = fleet("configmaps=20x256B").await;
    let q = |s: &str| format!("/api/v1/configmaps?{s}");
    assert_eq!(
        names(&get(&fleet, &q("labelSelector=app%3Dsim-3"), &[]).await),
        ["configmap-13", "configmap-3"]
    );
    assert_eq!(
        names(
            &get(
                &fleet,
                &q("labelSelector=app+in+(sim-1,sim-2),seq!%3D12"),
                &[]
            )
            .await
        ),
        ["configmap-1", "configmap-11", "configmap-2"]
    );
    assert_eq!(
        get(&fleet, &q("labelSelector=app+notin+(sim-1)"), &[])
            .await
            .json()["items"]
            .as_array()
            .unwrap()
            .len(),
        18
    );
    assert_eq!(
        get(&fleet, &q("labelSelector=!app"), &[]).await.json()["items"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    assert_eq!(
        names(&get(&fleet, &q("fieldSelector=metadata.name%3Dconfigmap-4"), &[]).await),
        ["configmap-4"]
    );
    assert_eq!(
        names(&get(&fleet, &q("fieldSelector=metadata.namespace%3Dns-5"), &[]).await),
        ["configmap-15", "configmap-5"]
    );
    let bad = get(&fleet, &q("fieldSelector=spec.x%3D1"), &[]).await;
    assert_eq!(bad.status, 400);
    // Paginated with a selector: continue is set, remainingItemCount is not.
    let p = get(&fleet, &q("labelSelector=app%3Dsim-3&limit=1"), &[]).await;
    assert!(p.json()["metadata"]["continue"].is_string());
    assert!(p.json()["metadata"].get("remainingItemCount").is_none());
}

#[tokio::test]
async fn resource_version_semantics() {
    let fleet = fleet("secrets=3x256B@a").await;
    let st = fleet.store();
    let rv0 = st.resource_version();
    st.create("secrets", "a", json!({"metadata": {"name": "later"}}))
        .unwrap();
    let exact = get(
        &fleet,
        &format!("/api/v1/namespaces/a/secrets?resourceVersion={rv0}&resourceVersionMatch=Exact"),
        &[],
    )
    .await;
    assert_eq!(exact.json()["metadata"]["resourceVersion"], rv0.to_string());
    assert_eq!(names(&exact).len(), 3, "an exact read sees the past");
    let any = get(
        &fleet,
        "/api/v1/namespaces/a/secrets?resourceVersion=0",
        &[],
    )
    .await;
    assert_eq!(names(&any).len(), 4);
    let bad = get(
        &fleet,
        "/api/v1/namespaces/a/secrets?resourceVersion=0&resourceVersionMatch=Exact",
        &[],
    )
    .await;
    assert_eq!(
        (bad.status, bad.json()["reason"].clone()),
        (422, json!("Invalid"))
    );
    // The storage layer reads a continue token before the version: a bad one is a 400.
    let bad = get(
        &fleet,
        "/api/v1/namespaces/a/secrets?resourceVersion=1&continue=abc",
        &[],
    )
    .await;
    assert_eq!(
        (bad.status, bad.json()["reason"].clone()),
        (400, json!("BadRequest"))
    );
}

#[tokio::test]
async fn continue_tokens_are_the_apiservers() {
    use apimachinery::continue_token::{self, ContinueError};
    let fleet = fleet("secrets=6x256B@team,team-a").await;
    let rv = fleet.store().resource_version() as i64;
    let list = |path: String| {
        let fleet = &fleet;
        async move { get(fleet, &path, &[]).await }
    };
    let keys = |r: &Reply| {
        r.json()["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                let meta = &i["metadata"];
                format!(
                    "{}/{}",
                    meta["namespace"].as_str().unwrap(),
                    meta["name"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    // Across namespaces, keys in etcd's byte order (`team-a/` before `team/`), and tokens
    // carrying `namespace/name`, unpadded.
    let page = list("/api/v1/secrets?limit=3".into()).await;
    assert_eq!(
        keys(&page),
        ["team-a/secret-1", "team-a/secret-3", "team-a/secret-5"]
    );
    let token = page.json()["metadata"]["continue"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!token.contains('='));
    assert_eq!(token, continue_token::encode_after(rv, "/team-a/secret-5"));
    assert_eq!(page.json()["metadata"]["remainingItemCount"], 3);
    // In a namespace, `/name` (relative to the namespace's prefix without its slash).
    let page = list("/api/v1/namespaces/team/secrets?limit=1".into()).await;
    let token = page.json()["metadata"]["continue"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(token, continue_token::encode_after(rv, "/secret-0"));
    // A token an apiserver wrote continues, with `resourceVersion=0` too.
    let next = continue_token::encode_after(rv, "secret-0");
    let page = list(format!(
        "/api/v1/namespaces/team/secrets?limit=5&resourceVersion=0&continue={next}"
    ))
    .await;
    assert_eq!(keys(&page), ["team/secret-2", "team/secret-4"]);
    let next = continue_token::encode_after(rv, "team-a/secret-5");
    let page = list(format!("/api/v1/secrets?limit=1&continue={next}")).await;
    assert_eq!(keys(&page), ["team/secret-0"]);
    // The apiserver's refusals, in its words.
    let padded = format!("{}=", continue_token::encode_after(rv, "secret-0"));
    let climbing = continue_token::encode(rv, "../kube-system/x");
    for (token, error) in [
        (padded.clone(), ContinueError::Base64(padded.len() - 1)),
        (climbing, ContinueError::NotClean("../kube-system/x".into())),
        (continue_token::encode(0, "x"), ContinueError::ZeroVersion),
    ] {
        let bad = list(format!(
            "/api/v1/namespaces/team/secrets?limit=1&continue={token}"
        ))
        .await;
        assert_eq!(
            (
                bad.status,
                bad.json()["reason"].clone(),
                bad.json()["message"].clone()
            ),
            (400, json!("BadRequest"), json!(error.status_message()))
        );
    }
    let good = continue_token::encode_after(rv, "secret-0");
    let bad = list(format!(
        "/api/v1/namespaces/team/secrets?resourceVersion=5&continue={good}"
    ))
    .await;
    assert_eq!(
        (bad.status, bad.json()["message"].clone()),
        (
            400,
            json!("specifying resource version is not allowed when using continue")
        )
    );
    let bad = list(format!(
        "/api/v1/namespaces/team/secrets?resourceVersion=0&resourceVersionMatch=NotOlderThan&continue={good}"
    ))
    .await;
    assert_eq!(bad.status, 422);
}

#[tokio::test]
async fn an_expired_continue_hands_out_a_token_for_the_latest_state() {
    use apimachinery::continue_token;
    let fleet = Fleet::start(SimConfig {
        seed: vec!["secrets=4x256B@a".parse().unwrap()],
        event_ring: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let first = get(&fleet, "/api/v1/namespaces/a/secrets?limit=1", &[]).await;
    let token = first.json()["metadata"]["continue"]
        .as_str()
        .unwrap()
        .to_owned();
    for name in ["a-late", "z-late", "zz-late"] {
        fleet
            .store()
            .create("secrets", "a", json!({"metadata": {"name": name}}))
            .unwrap();
    }
    let path = |token: &str| format!("/api/v1/namespaces/a/secrets?limit=10&continue={token}");
    let expired = get(&fleet, &path(&token), &[]).await;
    assert_eq!(expired.status, 410);
    let inconsistent = expired.json()["metadata"]["continue"]
        .as_str()
        .unwrap()
        .to_owned();
    let resume = continue_token::decode(&inconsistent).unwrap();
    assert_eq!((resume.rv, resume.start.as_str()), (-1, "secret-0\0"));
    // It continues after the same key, at the latest state.
    let rest = get(&fleet, &path(&inconsistent), &[]).await;
    assert_eq!(rest.status, 200);
    assert_eq!(
        names(&rest),
        ["secret-1", "secret-2", "secret-3", "z-late", "zz-late"]
    );
    assert_eq!(
        rest.json()["metadata"]["resourceVersion"],
        fleet.store().resource_version().to_string()
    );
}

#[tokio::test]
async fn writes_and_their_errors() {
    let fleet = fleet("secrets=1x256B@a").await;
    let base = "/api/v1/namespaces/a/secrets";
    let c = send(&fleet, "POST", base, "application/json", json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "w", "labels": {"x": "1"}}})).await;
    assert_eq!(c.status, 201);
    let rv = c.json()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let mut obj = c.json();
    obj["data"] = json!({"k": "dg=="});
    let u = send(
        &fleet,
        "PUT",
        &format!("{base}/w"),
        "application/json",
        obj.clone(),
    )
    .await;
    assert_eq!(u.status, 200);
    assert_ne!(
        u.json()["metadata"]["resourceVersion"].as_str().unwrap(),
        rv
    );
    let stale = send(&fleet, "PUT", &format!("{base}/w"), "application/json", obj).await;
    assert_eq!(
        (stale.status, stale.json()["reason"].clone()),
        (409, json!("Conflict"))
    );
    let p = send(
        &fleet,
        "PATCH",
        &format!("{base}/w"),
        "application/strategic-merge-patch+json",
        json!({"metadata": {"labels": {"y": "2"}}}),
    )
    .await;
    assert_eq!(p.json()["metadata"]["labels"], json!({"x": "1", "y": "2"}));
    let p = send(
        &fleet,
        "PATCH",
        &format!("{base}/w"),
        "application/json-patch+json",
        json!([{"op": "remove", "path": "/metadata/labels/x"}]),
    )
    .await;
    assert_eq!(p.json()["metadata"]["labels"], json!({"y": "2"}));
    let p = send(
        &fleet,
        "PATCH",
        &format!("{base}/w"),
        "application/apply-patch+yaml",
        json!({}),
    )
    .await;
    assert_eq!(p.status, 415);
    let writes = fleet.applied_writes();
    let d = send(
        &fleet,
        "DELETE",
        &format!("{base}/w"),
        "application/json",
        json!({}),
    )
    .await;
    // A delete that completes at once answers with a success Status naming the object.
    assert_eq!(
        (
            d.status,
            d.json()["kind"].clone(),
            d.json()["status"].clone(),
            d.json()["details"]["name"].clone()
        ),
        (200, json!("Status"), json!("Success"), json!("w"))
    );
    assert_eq!(fleet.applied_writes(), writes + 1);
    let d = send(
        &fleet,
        "DELETE",
        &format!("{base}/w"),
        "application/json",
        json!({}),
    )
    .await;
    assert_eq!(d.status, 404);
    let mismatch = send(
        &fleet,
        "POST",
        base,
        "application/json",
        json!({"metadata": {"name": "m", "namespace": "other"}}),
    )
    .await;
    assert_eq!(mismatch.status, 400);
    let dc = send(&fleet, "DELETE", base, "application/json", json!({})).await;
    assert_eq!(
        (dc.status, dc.json()["kind"].clone()),
        (200, json!("SecretList"))
    );
    assert_eq!(fleet.store().len("secrets"), 0);
}

#[tokio::test]
async fn selector_watches_see_objects_enter_and_leave() {
    let fleet = fleet("secrets=1x256B@a").await;
    let admin = fleet
        .pki()
        .client_ca
        .client_cert("admin", &["system:masters"]);
    let kc = client::kubeconfig(
        fleet.pki(),
        &format!("https://{}", fleet.addrs()[0]),
        &admin,
    );
    let cfg = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&kc).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let api: Api<Secret> = Api::namespaced(kube::Client::try_from(cfg).unwrap(), "a");
    let rv = fleet.store().resource_version().to_string();
    let mut w = api
        .watch(&WatchParams::default().labels("team=x").timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    let st = fleet.store();
    st.create(
        "secrets",
        "a",
        json!({"metadata": {"name": "s", "labels": {"team": "y"}}}),
    )
    .unwrap();
    st.patch(
        "secrets",
        "a",
        "s",
        &json!({"metadata": {"labels": {"team": "x"}}}),
    )
    .unwrap();
    st.patch("secrets", "a", "s", &json!({"data": {"k": "dg=="}}))
        .unwrap();
    st.patch(
        "secrets",
        "a",
        "s",
        &json!({"metadata": {"labels": {"team": "z"}}}),
    )
    .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(5), w.try_next())
            .await
            .unwrap()
            .unwrap()
        {
            Some(WatchEvent::Added(_)) => seen.push("ADDED"),
            Some(WatchEvent::Modified(_)) => seen.push("MODIFIED"),
            Some(WatchEvent::Deleted(_)) => seen.push("DELETED"),
            Some(WatchEvent::Bookmark(_)) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(seen, ["ADDED", "MODIFIED", "DELETED"]);
    // The legacy watch path works the same.
    let r = get(
        &fleet,
        "/api/v1/watch/namespaces/a/secrets?timeoutSeconds=1",
        &[],
    )
    .await;
    assert_eq!(String::from_utf8_lossy(&r.body).lines().count(), 2);
    // A negative timeout is a deadline already past: the state, then the end, at once.
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        get(
            &fleet,
            "/api/v1/watch/namespaces/a/secrets?timeoutSeconds=-1",
            &[],
        ),
    )
    .await
    .expect("a negative timeoutSeconds ends the watch at once");
    assert_eq!(String::from_utf8_lossy(&r.body).lines().count(), 2);
    // A named legacy watch sees its object alone; a field selector may only repeat the name.
    for query in ["", "&fieldSelector=metadata.name%3Ds"] {
        let r = get(
            &fleet,
            &format!("/api/v1/watch/namespaces/a/secrets/s?timeoutSeconds=-1{query}"),
            &[],
        )
        .await;
        let body = String::from_utf8_lossy(&r.body).into_owned();
        assert_eq!(body.lines().count(), 1, "{query}: {body}");
        assert!(body.contains("\"name\":\"s\""), "{query}: {body}");
    }
    let r = get(
        &fleet,
        "/api/v1/watch/namespaces/a/secrets/s?timeoutSeconds=-1&fieldSelector=metadata.name%3Dother",
        &[],
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["message"],
        "fieldSelector metadata.name doesn't match requested name"
    );
}

#[tokio::test]
async fn etcd_lists_cost_their_scope_and_cache_lists_their_response() {
    // ~100 KiB per namespace x 10; a LIST from etcd charges 5x the namespace even with a
    // selector that matches one object, one from the cache 5x its small response.
    let heap = HeapModel {
        base_bytes: 0,
        limit_bytes: Some(1024 * 1024 + 300 * 1024),
        restart: Duration::from_secs(60),
    };
    let fleet = Fleet::start(SimConfig {
        seed: vec!["secrets=100x10KiB".parse().unwrap()],
        heap,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let r = get(
        &fleet,
        "/api/v1/namespaces/ns-1/secrets?labelSelector=seq%3D1&resourceVersion=0",
        &[],
    )
    .await;
    assert_eq!(names(&r), ["secret-1"]);
    assert_eq!(fleet.replica(0).stats().ooms, 0);
    let tls = admin_tls(&fleet, &[b"h2"]);
    let _ = client::get(
        fleet.addrs()[0],
        &tls,
        "/api/v1/namespaces/ns-1/secrets?labelSelector=seq%3D1",
    )
    .await;
    assert_eq!(fleet.replica(0).stats().ooms, 1);
}

#[tokio::test]
async fn exec_echoes_raw_and_over_the_websocket_channel_protocol() {
    let fleet = fleet("secrets=1x256B@a").await;
    fleet.store().create("pods", "a", json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})).unwrap();
    let tls = std::sync::Arc::new(admin_tls(&fleet, &[b"http/1.1"]));
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(fleet.addrs()[0])
            .await
            .unwrap();
        tokio_rustls::TlsConnector::from(tls.clone())
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap()
    };
    // Raw upgrade.
    let mut s = connect().await;
    s.write_all(b"POST /api/v1/namespaces/a/pods/p/exec?command=cat&stdin=true HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nContent-Length: 0\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s.write_all(b"ping").await.unwrap();
    let n = s.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"ping");
    // WebSocket v5.channel.k8s.io, as kubectl speaks it.
    let req = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
        "wss://localhost/api/v1/namespaces/a/pods/p/exec?command=cat&stdin=true&stdout=true",
    )
    .unwrap();
    let mut req = req;
    req.headers_mut().insert(
        "sec-websocket-protocol",
        "v5.channel.k8s.io".parse().unwrap(),
    );
    let (mut ws, resp) = tokio_tungstenite::client_async(req, connect().await)
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "v5.channel.k8s.io"
    );
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::Binary(Bytes::from_static(b"\x00hello")))
        .await
        .unwrap();
    assert_eq!(
        ws.next().await.unwrap().unwrap(),
        Message::Binary(Bytes::from_static(b"\x01hello"))
    );
    ws.send(Message::Binary(Bytes::from_static(b"\xff\x00")))
        .await
        .unwrap();
    let status = ws.next().await.unwrap().unwrap().into_data();
    assert_eq!(&status[..], b"\x03{\"metadata\":{},\"status\":\"Success\"}");
    // A pod that does not exist is a 404.
    let r = get(&fleet, "/api/v1/namespaces/a/pods/nope/exec", &[]).await;
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn logs_follow_streams_lines() {
    let fleet = fleet("secrets=1x256B@a").await;
    fleet
        .store()
        .create("pods", "a", json!({"metadata": {"name": "p"}}))
        .unwrap();
    let r = get(&fleet, "/api/v1/namespaces/a/pods/p/log", &[]).await;
    assert_eq!(String::from_utf8_lossy(&r.body).lines().count(), 3);
    let tls = std::sync::Arc::new(admin_tls(&fleet, &[b"http/1.1"]));
    let tcp = tokio::net::TcpStream::connect(fleet.addrs()[0])
        .await
        .unwrap();
    let mut s = tokio_rustls::TlsConnector::from(tls)
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    s.write_all(
        b"GET /api/v1/namespaces/a/pods/p/log?follow=true HTTP/1.1\r\nHost: localhost\r\n\r\n",
    )
    .await
    .unwrap();
    let mut got = String::new();
    let mut buf = vec![0u8; 1024];
    while got.matches("log line").count() < 3 {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(got.contains("p log line 2"));
}

// Over 120 lines: each dry-run write beside the state it must leave unchanged, in one
// store.
#[tokio::test]
async fn dry_run_writes_answer_as_the_write_would_and_change_nothing() {
    let fleet = fleet("secrets=2x64B@d").await;
    let store = fleet.store();
    let rv = store.resource_version();
    let writes = store.applied_writes();
    let ns = "/api/v1/namespaces/d/secrets";
    let json = "application/json";
    let created = send(
        &fleet,
        "POST",
        &format!("{ns}?dryRun=All"),
        json,
        json!({"metadata": {"name": "new"}, "data": {"k": "dg=="}}),
    )
    .await;
    assert_eq!(created.status, 201, "{:?}", created.json());
    let c = created.json();
    // Defaulted and given identity as a create would, but never stored: no resourceVersion.
    assert_eq!(c["type"], "Opaque");
    assert_eq!(c["metadata"]["namespace"], "d");
    assert!(c["metadata"]["uid"].is_string() && c["metadata"]["creationTimestamp"].is_string());
    assert!(c["metadata"].get("resourceVersion").is_none(), "{c}");
    assert!(store.get("secrets", "d", "new").is_none());
    let dup = send(
        &fleet,
        "POST",
        &format!("{ns}?dryRun=All"),
        json,
        json!({"metadata": {"name": "secret-0"}}),
    )
    .await;
    assert_eq!(dup.status, 409);

    let before = store.get("secrets", "d", "secret-0").unwrap();
    let stored_rv = before["metadata"]["resourceVersion"].clone();
    let updated = send(
        &fleet,
        "PUT",
        &format!("{ns}/secret-0?dryRun=All"),
        json,
        json!({"metadata": {"name": "secret-0"}, "data": {"k": "eA=="}}),
    )
    .await;
    assert_eq!(updated.status, 200);
    assert_eq!(updated.json()["data"]["k"], "eA==");
    // The answer carries the version the object is stored at: none was taken.
    assert_eq!(updated.json()["metadata"]["resourceVersion"], stored_rv);
    let patched = send(
        &fleet,
        "PATCH",
        &format!("{ns}/secret-0?dryRun=All"),
        "application/merge-patch+json",
        json!({"metadata": {"labels": {"dry": "run"}}}),
    )
    .await;
    assert_eq!(patched.status, 200);
    assert_eq!(patched.json()["metadata"]["labels"]["dry"], "run");
    assert_eq!(patched.json()["metadata"]["resourceVersion"], stored_rv);
    // A delete reads its options from the body when it has one, from the query otherwise.
    let deleted = send(
        &fleet,
        "DELETE",
        &format!("{ns}/secret-0?dryRun=bogus"),
        json,
        json!({"kind": "DeleteOptions", "apiVersion": "v1", "dryRun": ["All"]}),
    )
    .await;
    assert_eq!(deleted.status, 200);
    assert_eq!(deleted.json()["status"], "Success");
    let tls = admin_tls(&fleet, &[b"h2"]);
    let req = http::Request::delete(format!("https://localhost{ns}?dryRun=All"))
        .body(Bytes::new())
        .unwrap();
    let collection = client::request(fleet.addrs()[0], &tls, req).await.unwrap();
    assert_eq!(collection.status, 200);
    assert_eq!(names(&collection), ["secret-0", "secret-1"]);
    assert_eq!(store.get("secrets", "d", "secret-0").unwrap(), before);
    assert_eq!(store.len("secrets"), 2);
    assert_eq!(
        (store.resource_version(), store.applied_writes()),
        (rv, writes)
    );

    // An unknown value is the options' 422, for every write.
    for (method, path, options) in [
        ("POST", ns.to_string(), "CreateOptions"),
        ("PUT", format!("{ns}/secret-0"), "UpdateOptions"),
        ("PATCH", format!("{ns}/secret-0"), "PatchOptions"),
        ("DELETE", format!("{ns}/secret-0"), "DeleteOptions"),
        ("DELETE", ns.to_string(), "DeleteOptions"),
    ] {
        // A delete's options come in its body.
        let (path, body) = if method == "DELETE" {
            (path, json!({"dryRun": ["All", "foo"]}))
        } else {
            (
                format!("{path}?dryRun=All&dryRun=foo"),
                json!({"metadata": {"name": "secret-0"}}),
            )
        };
        let ct = if method == "PATCH" {
            "application/merge-patch+json"
        } else {
            json
        };
        let r = send(&fleet, method, &path, ct, body).await;
        assert_eq!(r.status, 422, "{method} {path}");
        assert_eq!(
            r.json()["message"],
            format!(
                "{options}.meta.k8s.io \"\" is invalid: dryRun: Unsupported value: [\"All\",\"foo\"]: supported values: \"All\""
            )
        );
        assert_eq!(
            r.json()["details"]["causes"][0]["reason"],
            "FieldValueNotSupported"
        );
    }

    // A watch from before the dry runs sees only the real write after them.
    send(
        &fleet,
        "POST",
        ns,
        json,
        json!({"metadata": {"name": "real"}}),
    )
    .await;
    let w = get(
        &fleet,
        &format!("{ns}?watch=1&resourceVersion={rv}&timeoutSeconds=1"),
        &[],
    )
    .await;
    let events: Vec<Value> = w
        .body
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["object"]["metadata"]["name"], "real");
}

#[tokio::test]
async fn openapi_is_served_from_the_recorded_documents() {
    let fleet = fleet("secrets=1x64B@o").await;
    let v2 = get(&fleet, "/openapi/v2", &[]).await;
    assert_eq!(v2.status, 200);
    assert_eq!(v2.headers["content-type"], "application/json");
    assert_eq!(v2.json()["swagger"], "2.0");
    assert!(v2.json()["definitions"]["io.k8s.api.core.v1.Secret"].is_object());
    let pb = get(
        &fleet,
        "/openapi/v2",
        &[(
            "accept",
            "application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
        )],
    )
    .await;
    assert_eq!(pb.status, 200);
    assert_eq!(
        pb.headers["content-type"],
        "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
    );
    assert_eq!(pb.headers["etag"], v2.headers["etag"]);
    let yaml = get(&fleet, "/openapi/v2", &[("accept", "application/yaml")]).await;
    assert_eq!(yaml.status, 406);

    let index = get(&fleet, "/openapi/v3", &[]).await;
    assert_eq!(index.status, 200);
    let url = index.json()["paths"]["api/v1"]["serverRelativeURL"]
        .as_str()
        .unwrap()
        .to_string();
    let doc = get(&fleet, &url, &[("accept-encoding", "gzip")]).await;
    assert_eq!(doc.status, 200);
    assert_eq!(doc.headers["cache-control"], "public, immutable");
    assert_eq!(doc.headers["content-encoding"], "gzip");
    let plain = get(&fleet, "/openapi/v3/api/v1", &[]).await;
    assert_eq!(plain.json()["openapi"], "3.0.0");
    assert!(plain.json()["paths"]["/api/v1/namespaces/{namespace}/secrets"].is_object());
    let stale = get(&fleet, "/openapi/v3/api/v1?hash=0", &[]).await;
    assert_eq!(stale.status, 301);
    assert_eq!(stale.headers["location"], url.as_str());
    // Only the groups the simulator serves are indexed.
    assert_eq!(
        get(&fleet, "/openapi/v3/apis/apps/v1", &[]).await.status,
        404
    );
}
