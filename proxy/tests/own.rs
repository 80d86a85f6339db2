//! Bulwark's own client against the simulated apiserver over real TLS and HTTP/2: what a
//! caller (a review, an informer, the fleet) gets for each kind of answer.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use bulwark::metrics::Metrics;
use bulwark::own::{Call, CallError, Client};
use bulwark::upstream::{Upstream, UpstreamTls};
use bulwark_sim::{Fleet, Pki, Seed, SimConfig};
use bulwark_testkit::{BulwarkConfig, Credentials, Names};
use http::StatusCode;

/// A simulated apiserver and an own client in front of it.
async fn setup() -> Result<(Fleet, Client, tempfile::TempDir)> {
    let pki = Arc::new(Pki::new());
    let fleet = Fleet::start(SimConfig {
        seed: vec![Seed {
            resource: "configmaps".into(),
            count: 3,
            size: 100,
            namespaces: vec!["ns-0".into()],
        }],
        ..bulwark_testkit::fleet_config(pki.clone(), 1, bulwark_testkit::policy())
    })
    .await?;
    let dir = tempfile::tempdir()?;
    let names = Names {
        own_group: "system:masters",
        ..Names::default()
    };
    let credentials = Credentials::mint(dir.path(), &pki, &pki.server_ca, names)?;
    let cfg = BulwarkConfig::new(credentials, fleet.addrs())
        .set("upstream.timeouts", "{connect: 1s}")
        .config()
        .upstream;
    let upstream = Upstream::new(&cfg, UpstreamTls::from_config(&cfg)?, Metrics::new())?;
    Ok((fleet, Client::new(upstream), dir))
}

fn lease(name: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": "ns-0"},
        "spec": {"holderIdentity": name},
    })
}

const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/ns-0/leases";

#[tokio::test]
async fn a_success_is_its_json_and_an_error_keeps_the_apiservers_reason_and_message() {
    let (_fleet, client, _dir) = setup().await.unwrap();
    let list: serde_json::Value = client
        .json(Call::get("/api/v1/namespaces/ns-0/configmaps"))
        .await
        .unwrap();
    assert_eq!(list["items"].as_array().map(Vec::len), Some(3));

    let missing = client
        .json::<serde_json::Value>(Call::get("/api/v1/namespaces/ns-0/configmaps/nope"))
        .await
        .unwrap_err();
    assert_eq!(missing.answered(), Some(StatusCode::NOT_FOUND));
    let CallError::Status {
        reason, message, ..
    } = &missing
    else {
        panic!("{missing:?}");
    };
    assert_eq!(reason, "NotFound");
    assert!(message.contains("nope"), "{message}");
    let shown = missing.to_string();
    assert!(
        shown.contains("GET /api/v1/namespaces/ns-0/configmaps/nope answered 404"),
        "{shown}"
    );
}

#[tokio::test]
async fn a_create_sent_twice_is_answered_409_and_never_applied_twice() {
    let (_fleet, client, _dir) = setup().await.unwrap();
    let created: serde_json::Value = client
        .json(Call::post(LEASES, &lease("a")).unwrap())
        .await
        .unwrap();
    let rv = created["metadata"]["resourceVersion"].as_str().unwrap();
    assert!(!rv.is_empty());

    let again = client
        .json::<serde_json::Value>(Call::post(LEASES, &lease("a")).unwrap())
        .await
        .unwrap_err();
    assert_eq!(again.answered(), Some(StatusCode::CONFLICT), "{again:?}");

    // A replace conditional on an old version is refused, not applied.
    let mut stale = lease("a");
    stale["metadata"]["resourceVersion"] = "1".into();
    let conflict = client
        .json::<serde_json::Value>(Call::put(format!("{LEASES}/a"), &stale).unwrap())
        .await
        .unwrap_err();
    assert_eq!(
        conflict.answered(),
        Some(StatusCode::CONFLICT),
        "{conflict:?}"
    );
    let list: serde_json::Value = client.json(Call::get(LEASES)).await.unwrap();
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn an_answer_larger_than_the_call_reads_is_an_error_not_a_truncation() {
    let (_fleet, client, _dir) = setup().await.unwrap();
    let error = client
        .bytes(Call::get("/api/v1/namespaces/ns-0/configmaps").max_bytes(64))
        .await
        .unwrap_err();
    assert!(matches!(error, CallError::Read { .. }), "{error:?}");

    let error = client
        .json::<Vec<u8>>(Call::get("/api/v1/namespaces/ns-0/configmaps"))
        .await
        .unwrap_err();
    assert!(matches!(error, CallError::Decode { .. }), "{error:?}");
}

#[tokio::test]
async fn no_apiserver_answering_is_an_upstream_error_naming_the_call_within_its_timeout() {
    let (fleet, client, _dir) = setup().await.unwrap();
    fleet.replica(0).stop().await;
    let started = std::time::Instant::now();
    let error = client
        .bytes(Call::get(LEASES).timeout(Duration::from_secs(2)))
        .await
        .unwrap_err();
    assert!(matches!(error, CallError::Upstream { .. }), "{error:?}");
    assert!(error.to_string().contains(LEASES), "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_watch_hands_back_its_stream_and_a_refused_one_is_its_status() {
    let (_fleet, client, _dir) = setup().await.unwrap();
    let response = client
        .watch(Call::get(format!("{LEASES}?watch=1&timeoutSeconds=1")))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    drop(response);
    let refused = client
        .watch(Call::get("/api/v1/namespaces/ns-0/nothings?watch=1"))
        .await
        .unwrap_err();
    assert_eq!(
        refused.answered(),
        Some(StatusCode::NOT_FOUND),
        "{refused:?}"
    );
}
