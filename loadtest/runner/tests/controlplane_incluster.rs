//! Pods through Bulwark, on a real control plane: the fleet publishes the `kubernetes`
//! Service's EndpointSlices, and a client built the way `rest.InClusterConfig()` builds it
//! (a bound ServiceAccount token file, the CA of `kube-root-ca.crt`, the Service's
//! ClusterIP as the name it verifies) dials the address kube-proxy would send it to. It is
//! served by Bulwark as its ServiceAccount, extras and all, and held to its rule; with
//! every Bulwark killed it is served by the apiservers within the Lease duration, and it
//! comes back through Bulwark when they start again. Without the binaries the control plane
//! builds them (`loadtest/controlplane/build.sh`, Go 1.26) or fails: this test never skips.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bulwark::fleet::endpoints::reachable;
use bulwark_loadtest::controlplane::{ControlPlane, KUBERNETES_SERVICE_IP, Options};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

const NAMESPACE: &str = "incluster";
const AGENT: &str = "system:serviceaccount:incluster:agent";
/// The fleet's Lease duration (Bulwark's default).
const LEASE: Duration = Duration::from_secs(10);

/// The rule the agent is held to: a small bucket, so that its fifth quick request is
/// refused by Bulwark, and only by Bulwark.
const AGENT_RULE: &str = "\
rules:
  - name: incluster-agent
    precedence: 50
    match:
      serviceAccounts: [incluster/agent]
      verbs: [\"*\"]
      resources: [{group: \"*\", resource: \"*\"}]
      namespaces: [\"*\"]
    level: node-agents
    flow: user
    rate: {qps: 0.2, burst: 4}
    mode: enforce
";

/// What the Service leads to now, as kube-proxy reads its EndpointSlices.
async fn service_leads_to(admin: &Client) -> Vec<SocketAddr> {
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), "default");
    let listed = slices
        .list(&ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
        .await
        .expect("the Service's slices");
    let mut addrs = reachable(&listed.items);
    addrs.sort();
    addrs
}

/// Waits until the Service leads to exactly `wanted`; returns how long that took.
async fn until_service_leads_to(
    admin: &Client,
    wanted: &[SocketAddr],
    within: Duration,
) -> Duration {
    let started = Instant::now();
    let mut wanted = wanted.to_vec();
    wanted.sort();
    loop {
        let now = service_leads_to(admin).await;
        if now == wanted {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "the kubernetes Service still leads to {now:?}, not {wanted:?}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A client as `rest.InClusterConfig()` makes one inside a pod: the token file, the CA of
/// `kube-root-ca.crt`, and the Service's ClusterIP as the host it verifies; `dial` is
/// where kube-proxy's rules send the connection.
fn in_cluster_client(dial: SocketAddr, token_file: &Path, ca_pem: &str) -> Client {
    let url = format!("https://{dial}").parse().unwrap();
    let mut config = kube::Config::new(url);
    config.tls_server_name = Some(KUBERNETES_SERVICE_IP.into());
    config.root_cert = Some(pem_certificates(ca_pem));
    config.auth_info.token_file = Some(token_file.display().to_string());
    config.default_retry = false;
    Client::try_from(config).expect("an in-cluster client")
}

fn pem_certificates(pem: &str) -> Vec<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .map(|c| c.expect("a PEM certificate").to_vec())
        .collect()
}

/// Who the apiserver says the client is (a SelfSubjectReview).
async fn whoami(client: &Client) -> Result<Value, kube::Error> {
    let request = http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
        .header("content-type", "application/json")
        .body(
            serde_json::to_vec(&json!({
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "SelfSubjectReview",
            }))
            .unwrap(),
        )
        .unwrap();
    let text = client.request_text(request).await?;
    Ok(serde_json::from_str(&text).unwrap())
}

/// Creates the agent's namespace, ServiceAccount (with `view` in its namespace), a pod on
/// node `n1` for its token to be bound to, and `kube-root-ca.crt` as kube-controller-
/// manager's root-CA publisher writes it (the cluster CA; that controller is not running
/// here). Returns the bound token, written to a file.
async fn agent_token(cp: &ControlPlane, admin: &Client, dir: &Path) -> (PathBuf, String) {
    let kubectl = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, out) = cp.kubectl("admin", &args).await.expect("kubectl");
        assert!(ok, "kubectl {args:?}: {out}");
    };
    let manifest = dir.join("agent.yaml");
    let ca = cp.pki().server_ca.cert_pem();
    let objects = json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "agent", "namespace": NAMESPACE}},
            {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "kube-root-ca.crt", "namespace": NAMESPACE},
             "data": {"ca.crt": ca}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "agent-view", "namespace": NAMESPACE},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
             "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": NAMESPACE}]},
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "agent-0", "namespace": NAMESPACE},
             "spec": {"serviceAccountName": "agent", "nodeName": "n1",
                      "containers": [{"name": "agent", "image": "agent"}]}},
        ],
    });
    std::fs::write(&manifest, serde_json::to_string(&objects).unwrap()).unwrap();
    kubectl(vec![
        "apply".into(),
        "-f".into(),
        manifest.display().to_string(),
    ])
    .await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let pod = pods.get("agent-0").await.expect("the agent's pod");
    let uid = pod.metadata.uid.expect("a uid");
    // A bound token, as the kubelet asks for a projected volume.
    let request = http::Request::post(format!(
        "/api/v1/namespaces/{NAMESPACE}/serviceaccounts/agent/token"
    ))
    .header("content-type", "application/json")
    .body(
        serde_json::to_vec(&json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "agent-0", "uid": uid},
            },
        }))
        .unwrap(),
    )
    .unwrap();
    let answer: Value = serde_json::from_str(&admin.request_text(request).await.unwrap()).unwrap();
    let token = answer["status"]["token"]
        .as_str()
        .expect("a token")
        .to_owned();
    let file = dir.join("token");
    std::fs::write(&file, &token).unwrap();
    let root_ca: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(admin.clone(), NAMESPACE);
    let ca_pem = root_ca.get("kube-root-ca.crt").await.unwrap().data.unwrap()["ca.crt"].clone();
    (file, ca_pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_the_apiservers_through_bulwark_and_directly_when_none_is_live() {
    let dir = tempfile::tempdir().unwrap();
    let rules =
        bulwark_loadtest::proxy_process::write_shipped_rules(&dir.path().join("rules")).unwrap();
    std::fs::write(rules.join("incluster-agent.yaml"), AGENT_RULE).unwrap();
    let mut opts = Options::new(dir.path().join("cp"));
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    opts.replicas = 2;
    opts.bulwarks = 2;
    opts.rules = Some(rules);
    let mut cp = ControlPlane::start(opts)
        .await
        .expect("the control plane starts");
    let admin = cp.admin_clients().await.unwrap().remove(0);
    assert!(
        cp.node_ip().is_some(),
        "this host has no address but loopback for the kubernetes Service's endpoints"
    );
    let bulwarks = cp.advertised_bulwarks();
    let apiservers = cp.advertised_apiservers();

    // The fleet and the guard publish the live Bulwarks; the apiservers wait behind them.
    until_service_leads_to(&admin, &bulwarks, Duration::from_secs(30)).await;
    let (token_file, ca_pem) = agent_token(&cp, &admin, dir.path()).await;

    // Through the address kube-proxy picks: Bulwark, which identifies the ServiceAccount
    // with its pod and node, forwards exactly that, and holds it to its rule.
    let dial = service_leads_to(&admin).await[0];
    assert!(bulwarks.contains(&dial));
    let client = in_cluster_client(dial, &token_file, &ca_pem);
    let me = whoami(&client)
        .await
        .expect("a SelfSubjectReview through Bulwark");
    let user = &me["status"]["userInfo"];
    assert_eq!(user["username"], AGENT);
    assert_eq!(
        user["extra"]["authentication.kubernetes.io/pod-name"],
        json!(["agent-0"])
    );
    assert_eq!(
        user["extra"]["authentication.kubernetes.io/node-name"],
        json!(["n1"])
    );
    let mut refused = None;
    for _ in 0..8 {
        match whoami(&client).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 429 => {
                refused = Some(status.message);
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let refused = refused.expect("the agent's rule refuses its burst");
    assert!(refused.contains("incluster-agent"), "{refused}");

    // Every Bulwark killed (a node lost: no drain): within the Lease duration the Service
    // leads to the apiservers, and the same client is served by them.
    let killed = Instant::now();
    for i in 0..bulwarks.len() {
        cp.kill_bulwark(i).await.unwrap();
    }
    until_service_leads_to(&admin, &apiservers, LEASE + Duration::from_secs(5)).await;
    let direct_after = killed.elapsed();
    let dial = service_leads_to(&admin).await[0];
    assert!(apiservers.contains(&dial));
    let direct = in_cluster_client(dial, &token_file, &ca_pem);
    let me = whoami(&direct)
        .await
        .expect("served by an apiserver directly");
    assert_eq!(me["status"]["userInfo"]["username"], AGENT);
    for _ in 0..8 {
        whoami(&direct)
            .await
            .expect("no Bulwark rule applies to a direct client");
    }

    // Started again: back through Bulwark.
    let started = Instant::now();
    for i in 0..bulwarks.len() {
        cp.start_bulwark(i).await.unwrap();
    }
    until_service_leads_to(&admin, &bulwarks, Duration::from_secs(30)).await;
    let bulwark_after = started.elapsed();
    let dial = service_leads_to(&admin).await[0];
    let client = in_cluster_client(dial, &token_file, &ca_pem);
    assert_eq!(
        whoami(&client).await.unwrap()["status"]["userInfo"]["username"],
        AGENT
    );
    println!(
        "in-cluster client: every Bulwark killed -> the Service leads to the apiservers in \
         {direct_after:?}; Bulwarks started -> back through them {bulwark_after:?} after \
         the first start began"
    );
    assert!(
        direct_after <= LEASE + Duration::from_secs(1),
        "{direct_after:?}"
    );
    cp.stop().await.unwrap();
}
