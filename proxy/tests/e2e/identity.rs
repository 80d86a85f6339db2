//! Identity in each forwarding mode, and every way a client might try to pass as someone else.

use bulwark::config::IdentityMode;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;

use bulwark_testkit::{BAD_TOKEN, Cluster, GOOD_TOKEN, Setup, get};

const SECRETS: &str = "/api/v1/namespaces/default/secrets";

fn with_headers(path: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut request = get(path);
    for (name, value) in headers {
        let name = http::HeaderName::from_bytes(name.as_bytes()).unwrap();
        request.headers_mut().append(name, value.parse().unwrap());
    }
    request
}

const SPOOF: [(&str, &str); 4] = [
    ("x-remote-user", "system:admin"),
    ("x-remote-group", "system:masters"),
    ("x-remote-extra-scopes", "everything"),
    ("x-remote-uid", "0"),
];

async fn cluster(mode: IdentityMode) -> Cluster {
    Cluster::start(Setup {
        replicas: 1,
        mode,
        ..Setup::default()
    })
    .await
}

fn last_seen(cluster: &Cluster, path: &str) -> bulwark_sim::SeenRequest {
    cluster
        .fleet
        .seen_requests()
        .into_iter()
        .rev()
        .find(|s| s.path.starts_with(path))
        .unwrap_or_else(|| panic!("the apiserver never saw {path}"))
}

#[tokio::test]
async fn front_proxy_forwards_the_certificate_user_and_ignores_spoofed_headers() {
    let cluster = cluster(IdentityMode::FrontProxy).await;
    let mut alice = cluster.client("alice", &["dev"]).await;
    let answer = alice.send(with_headers(SECRETS, &SPOOF)).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.json()["kind"], "SecretList");
    let seen = last_seen(&cluster, SECRETS);
    assert_eq!(seen.user, "alice");
    assert_eq!(seen.groups, ["dev", "system:authenticated"]);
    assert!(seen.extra.is_empty(), "{:?}", seen.extra);
    // What alice may not do, she still may not do through Bulwark.
    let nodes = alice.send(with_headers("/api/v1/nodes", &SPOOF)).await;
    assert_eq!(nodes.status, 403);
    assert_eq!(nodes.json()["reason"], "Forbidden");
}

#[tokio::test]
async fn front_proxy_resolves_tokens_by_review_and_never_forwards_a_rejected_one() {
    let cluster = cluster(IdentityMode::FrontProxy).await;
    let mut client = cluster.anonymous_client().await;
    let bearer = format!("Bearer {GOOD_TOKEN}");
    let answer = client
        .send(with_headers(SECRETS, &[("authorization", &bearer)]))
        .await;
    assert_eq!(answer.status, 200);
    let seen = last_seen(&cluster, SECRETS);
    assert_eq!(
        (seen.user.as_str(), seen.uid.as_str()),
        ("tina", "tina-uid")
    );
    assert!(seen.groups.contains(&"system:authenticated".to_string()));

    cluster.fleet.clear_seen();
    let forged = format!("Bearer {BAD_TOKEN}");
    let answer = client
        .send(with_headers(
            "/api/v1/namespaces/kube-system/secrets",
            &[("authorization", &forged)],
        ))
        .await;
    assert_eq!(answer.status, 401);
    assert_eq!(answer.headers["x-bulwark-reason"], "unauthenticated");
    assert_eq!(answer.json()["reason"], "Unauthorized");
    assert_eq!(answer.json()["message"], "Unauthorized");
    let seen = cluster.fleet.seen_requests();
    assert!(
        seen.iter()
            .all(|s| s.path.starts_with("/apis/authentication.k8s.io") || s.path == "/readyz"),
        "a rejected token's request reached the apiserver: {seen:?}"
    );
}

#[tokio::test]
async fn no_credentials_get_401_except_the_anonymous_allowlist() {
    let cluster = cluster(IdentityMode::FrontProxy).await;
    let mut client = cluster.anonymous_client().await;
    let version = client.get("/version").await;
    assert_eq!(version.status, 200);
    assert!(version.json()["gitVersion"].is_string());
    assert_eq!(last_seen(&cluster, "/version").user, "system:anonymous");

    let answer = client.send(with_headers(SECRETS, &SPOOF)).await;
    assert_eq!(answer.status, 401);
    let status = answer.json();
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["code"], 401);
    // The apiserver's own words, and nothing about what was missing.
    assert_eq!(status["message"], "Unauthorized");
}

#[tokio::test]
async fn front_proxy_passes_client_impersonation_for_the_apiserver_to_judge() {
    let cluster = cluster(IdentityMode::FrontProxy).await;
    let mut alice = cluster.client("alice", &[]).await;
    let answer = alice
        .send(with_headers(SECRETS, &[("impersonate-user", "tina")]))
        .await;
    assert_eq!(answer.status, 403, "alice may not impersonate");
    assert!(
        answer.json()["message"]
            .as_str()
            .unwrap()
            .contains("impersonate"),
        "{:?}",
        answer.json()
    );
}

#[tokio::test]
async fn impersonate_mode_acts_as_the_user_and_refuses_client_impersonation() {
    let cluster = cluster(IdentityMode::Impersonate).await;
    let mut alice = cluster.client("alice", &["dev"]).await;
    let answer = alice.send(with_headers(SECRETS, &SPOOF)).await;
    assert_eq!(answer.status, 200);
    let seen = last_seen(&cluster, SECRETS);
    assert_eq!(seen.user, "alice");
    assert_eq!(seen.impersonated_by.as_deref(), Some("bulwark"));
    assert!(seen.groups.contains(&"dev".to_string()));

    let refused = alice
        .send(with_headers(
            SECRETS,
            &[("impersonate-user", "system:admin")],
        ))
        .await;
    assert_eq!(refused.status, 403);
    assert_eq!(refused.headers["x-bulwark-reason"], "forbidden");
}

#[tokio::test]
async fn passthrough_sends_the_reviewed_token_and_refuses_a_forged_one() {
    let cluster = cluster(IdentityMode::Passthrough).await;
    let mut client = cluster.anonymous_client().await;
    let bearer = format!("Bearer {GOOD_TOKEN}");
    let answer = client
        .send(with_headers(
            SECRETS,
            &[("authorization", &bearer), SPOOF[0], SPOOF[1]],
        ))
        .await;
    assert_eq!(answer.status, 200);
    let seen = last_seen(&cluster, SECRETS);
    assert_eq!(seen.user, "tina");
    assert!(!seen.groups.contains(&"system:masters".to_string()));

    let forged = format!("Bearer {BAD_TOKEN}");
    let answer = client
        .send(with_headers("/api/v1/nodes", &[("authorization", &forged)]))
        .await;
    assert_eq!(answer.status, 401);
    assert!(
        cluster
            .fleet
            .seen_requests()
            .iter()
            .all(|s| !s.path.starts_with("/api/v1/nodes")),
        "a forged token's request reached the apiserver"
    );

    // A certificate has nothing to pass through: it travels as front-proxy.
    let mut alice = cluster.client("alice", &[]).await;
    assert_eq!(alice.get(SECRETS).await.status, 200);
    assert_eq!(last_seen(&cluster, SECRETS).user, "alice");
}
