//! Flows per client over real TLS: a DaemonSet's bound ServiceAccount tokens, one
//! identity on every node, get a watch limit per node (`flow: node`), and a client whose
//! credential names no node one per address.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use bulwark_sim::{Fleet, Pki, SimConfig, StaticToken};
use bulwark_testkit::{Client, Cluster, Setup, fleet_config, get, grant, with_token};

const KUBE_PROXY: &str = "system:serviceaccount:kube-system:kube-proxy";

const RULES: &str = r#"
levels:
  - name: nodes
    seats: 10
    queues: 16
    handSize: 4
    queueLength: 10
    maxWait: 5s
rules:
  - name: kube-proxy
    precedence: 90
    match:
      serviceAccounts: [kube-system/kube-proxy]
    level: nodes
    flow: node
    watches: 2
"#;

/// The token of kube-proxy's ServiceAccount on `node` (`None`: a token naming no node).
fn token(node: Option<&str>) -> StaticToken {
    let mut extra = BTreeMap::new();
    if let Some(node) = node {
        extra.insert(
            "authentication.kubernetes.io/node-name".to_owned(),
            vec![node.to_owned()],
        );
    }
    StaticToken {
        token: format!("tok-{}", node.unwrap_or("none")),
        user: KUBE_PROXY.into(),
        groups: vec![
            "system:serviceaccounts".into(),
            "system:serviceaccounts:kube-system".into(),
        ],
        extra,
        ..StaticToken::default()
    }
}

/// Starts a watch with `token` on `client`: its status and `X-Bulwark-Reason`. An admitted
/// watch's stream goes into `open`, to stay open.
async fn watch(
    client: &mut Client,
    token: &str,
    open: &mut Vec<http::Response<hyper::body::Incoming>>,
) -> (u16, String) {
    let response = client
        .start(with_token(
            get("/api/v1/namespaces/default/secrets?watch=true"),
            token,
        ))
        .await;
    let status = response.status().as_u16();
    let reason = response
        .headers()
        .get("x-bulwark-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    open.push(response);
    (status, reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemonset_s_watches_are_limited_per_node_over_real_tls() {
    let pki = Arc::new(Pki::new());
    let mut policy = bulwark_testkit::policy();
    policy.rules.push(grant(
        &[KUBE_PROXY],
        &[],
        &["get", "list", "watch"],
        &["secrets"],
    ));
    let fleet = Fleet::start(SimConfig {
        seed: vec!["secrets=2x1KiB@default".parse().expect("seed")],
        tokens: vec![token(Some("node-1")), token(Some("node-2")), token(None)],
        ..fleet_config(pki.clone(), 1, policy)
    })
    .await
    .expect("simulator starts");
    let cluster = Cluster::in_front_of(
        fleet,
        pki,
        Setup {
            rules: RULES,
            ..super::setup()
        },
    )
    .await
    .ready()
    .await;

    // Every watch on one connection from 127.0.0.1, as a node's kube-proxy would send them.
    let mut client = cluster.anonymous_client().await;
    let mut open = Vec::new();
    let admitted = (200, String::new());
    let refused = (429, "watch_limit".to_owned());
    for _ in 0..2 {
        assert_eq!(watch(&mut client, "tok-node-1", &mut open).await, admitted);
    }
    assert_eq!(
        watch(&mut client, "tok-node-1", &mut open).await,
        refused,
        "node-1's third watch"
    );
    // Another node of the same ServiceAccount has its own limit, from the same address.
    for _ in 0..2 {
        assert_eq!(watch(&mut client, "tok-node-2", &mut open).await, admitted);
    }
    // A token that names no node is keyed by its address...
    for _ in 0..2 {
        assert_eq!(watch(&mut client, "tok-none", &mut open).await, admitted);
    }
    assert_eq!(watch(&mut client, "tok-none", &mut open).await, refused);
    // ...so that another address is another client.
    let from: IpAddr = [127, 0, 0, 2].into();
    let mut other = Client::connect_from(cluster.bulwark.addr, from, &cluster.pki, None).await;
    assert_eq!(watch(&mut other, "tok-none", &mut open).await, admitted);
}
