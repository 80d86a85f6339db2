//! Bulwark in front of a real control plane (etcd and kube-apiservers built from
//! Kubernetes' own Go modules): real clients — the matching kubectl and kube-rs — through
//! Bulwark, against the apiservers' real client-certificate and request-header
//! authenticators and their real RBAC authorizer. One control plane serves every section,
//! which keeps the wall time to one start. Without the binaries the control plane builds
//! them (`loadtest/controlplane/build.sh`, Go 1.26) or fails: this test never skips.

use std::path::PathBuf;
use std::time::Instant;

use base64::Engine as _;
use bulwark_loadtest::controlplane::{ControlPlane, NAMESPACES, Options, SECRETS_PER_NAMESPACE};
use bulwark_loadtest::identities;
use bulwark_sim::pki::{Ca, CertKey};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{Value, json};

/// Runs the control plane's kubectl with a kubeconfig; returns success and all output.
async fn kubectl(cp: &ControlPlane, kubeconfig: &str, args: &[&str]) -> (bool, String) {
    cp.kubectl(kubeconfig, args).await.expect("kubectl runs")
}

/// A raw request; `Ok` with the JSON body on 2xx, `Err` with the status code otherwise.
async fn call(client: &Client, request: http::Request<Vec<u8>>) -> Result<Value, u16> {
    match client.request::<Value>(request).await {
        Ok(v) => Ok(v),
        Err(kube::Error::Api(status)) => Err(status.code),
        Err(e) => panic!("the request failed without an answer: {e}"),
    }
}

fn get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path).body(Vec::new()).unwrap()
}

/// `POST /apis/authentication.k8s.io/v1/selfsubjectreviews`, plus `headers`: the
/// `userInfo` the apiserver authenticated, or the status code of the refusal.
async fn review_self(client: &Client, headers: &[(&str, &str)]) -> Result<Value, u16> {
    let mut request = http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
        .header("Content-Type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"});
    let review = call(client, request.body(body.to_string().into_bytes()).unwrap()).await?;
    Ok(review["status"]["userInfo"].clone())
}

/// The user and groups the apiserver authenticated for `client`, plus `headers`.
async fn whoami(client: &Client, headers: &[(&str, &str)]) -> (String, Vec<String>) {
    let info = review_self(client, headers)
        .await
        .expect("a SelfSubjectReview is allowed for everyone");
    let groups = info["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| g.as_str().map(str::to_string))
        .collect();
    (
        info["username"].as_str().unwrap_or_default().to_string(),
        groups,
    )
}

/// A client to Bulwark that presents `cert` (PEM certificate and key), or nothing.
async fn client_with(cp: &ControlPlane, cert: Option<&CertKey>) -> Client {
    let yaml = match cert {
        Some(cert) => identities::kubeconfig(
            cp.bulwark_addr(),
            cp.bulwark_ca_pem().expect("Bulwark's CA"),
            "someone",
            &cert.cert_pem,
            &cert.key_pem,
        ),
        None => {
            let ca = base64::engine::general_purpose::STANDARD
                .encode(cp.bulwark_ca_pem().expect("Bulwark's CA"));
            json!({
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "bulwark", "cluster": {
                    "server": format!("https://{}", cp.bulwark_addr()),
                    "certificate-authority-data": ca,
                }}],
                "users": [{"name": "anonymous", "user": {}}],
                "contexts": [{"name": "anonymous", "context": {"cluster": "bulwark", "user": "anonymous"}}],
                "current-context": "anonymous",
            })
            .to_string()
        }
    };
    let kubeconfig = Kubeconfig::from_yaml(&yaml).unwrap();
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap();
    config.default_retry = false;
    Client::try_from(config).unwrap()
}

/// The seeded readers through Bulwark, judged by the real authorizer: the admin lists
/// every Secret with kubectl, `nobody` is refused, node-1 reads its own Secrets and no
/// other.
async fn each_reader_is_judged_by_real_rbac(cp: &ControlPlane) {
    // The admin (system:masters) lists every seeded Secret through Bulwark with kubectl.
    let (ok, text) = kubectl(cp, "admin", &["get", "secrets", "-A", "--no-headers"]).await;
    assert!(ok, "{text}");
    let listed = text.lines().count();
    let seeded = (NAMESPACES.len() + 1) * SECRETS_PER_NAMESPACE + 2;
    assert_eq!(listed, seeded, "{text}");
    for ns in ["default", "ns-0", "ns-1"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(ns) && l.contains("secret-0")),
            "{ns}: {text}"
        );
    }
    assert!(text.contains("node-1-kubelet-config"), "{text}");

    // `nobody` is authenticated but bound to nothing: real RBAC says 403.
    let (ok, text) = kubectl(cp, "nobody", &["get", "secrets"]).await;
    assert!(!ok && text.contains("Forbidden"), "{text}");
    assert!(
        text.contains(r#"User "nobody" cannot list resource "secrets""#),
        "{text}"
    );
    let nobody = cp.client("nobody").await.unwrap();
    assert_eq!(
        call(&nobody, get("/api/v1/namespaces/ns-0/secrets/secret-0")).await,
        Err(403)
    );

    // node-1 reads its own Secrets by name, and nothing else.
    let node = cp.client("node-1").await.unwrap();
    let own = call(
        &node,
        get("/api/v1/namespaces/ns-0/secrets/node-1-kubelet-config"),
    )
    .await
    .expect("node-1 gets its own secret");
    assert_eq!(own["metadata"]["name"], "node-1-kubelet-config");
    let by_name = call(
        &node,
        get("/api/v1/namespaces/ns-0/secrets?fieldSelector=metadata.name%3Dnode-1-registry-pull"),
    )
    .await
    .expect("node-1 lists its own secret by name");
    assert_eq!(
        by_name["items"].as_array().map(Vec::len),
        Some(1),
        "{by_name}"
    );
    assert_eq!(
        call(&node, get("/api/v1/namespaces/ns-0/secrets/secret-0")).await,
        Err(403)
    );
    assert_eq!(
        call(&node, get("/api/v1/namespaces/ns-0/secrets")).await,
        Err(403)
    );
}

/// Every way the e2e suite tries to pass as someone else, judged here by the real
/// authenticators and authorizer rather than the simulator's reading of them.
async fn no_client_passes_as_someone_else(cp: &ControlPlane) {
    let nobody = cp.client("nobody").await.unwrap();
    // A client's own identity headers give it nothing: Bulwark strips them, and the
    // apiserver believes identity headers only from the front-proxy certificate.
    let spoof = [
        ("X-Remote-User", "system:admin"),
        ("X-Remote-Group", "system:masters"),
        ("X-Remote-Uid", "0"),
        ("X-Remote-Extra-Scopes", "everything"),
    ];
    let info = review_self(&nobody, &spoof).await.unwrap();
    assert_eq!(info["username"], "nobody");
    assert_eq!(info["groups"], json!(["system:authenticated"]));
    assert!(info.get("uid").is_none(), "{info}");
    assert!(info.get("extra").is_none(), "{info}");
    let mut request = http::Request::get("/api/v1/namespaces/ns-0/secrets");
    for (name, value) in spoof {
        request = request.header(name, value);
    }
    assert_eq!(
        call(&nobody, request.body(Vec::new()).unwrap()).await,
        Err(403)
    );

    // Every other way the e2e suite tries to pass as someone else, judged here by the
    // real authenticators and authorizer rather than the simulator's reading of them.
    // - No credentials, with identity headers: Bulwark answers 401 as the apiserver would.
    let anonymous = client_with(cp, None).await;
    assert_eq!(review_self(&anonymous, &spoof).await, Err(401));
    let mut request = http::Request::get("/api/v1/namespaces/ns-0/secrets");
    for (name, value) in spoof {
        request = request.header(name, value);
    }
    assert_eq!(
        call(&anonymous, request.body(Vec::new()).unwrap()).await,
        Err(401)
    );
    // - A made-up bearer token: the real TokenReview rejects it, so does Bulwark.
    let mut request = http::Request::get("/api/v1/namespaces/ns-0/secrets")
        .header("Authorization", "Bearer forged-0123456789abcdef0123456789");
    for (name, value) in spoof {
        request = request.header(name, value);
    }
    assert_eq!(
        call(&anonymous, request.body(Vec::new()).unwrap()).await,
        Err(401)
    );
    // - Client impersonation passes for the apiserver to judge, and real RBAC refuses it
    //   to a user with no `impersonate` verb.
    assert_eq!(
        review_self(&nobody, &[("Impersonate-User", "system:admin")]).await,
        Err(403)
    );
    assert_eq!(
        review_self(
            &nobody,
            &[
                ("Impersonate-Group", "system:masters"),
                ("Impersonate-User", "nobody")
            ]
        )
        .await,
        Err(403)
    );
    // - A certificate from a CA Bulwark does not trust, or one expired, is cut off in the
    //   handshake: no answer at all, let alone the apiserver's.
    let foreign = Ca::new("foreign-ca").client_cert("admin", &["system:masters"]);
    let expired = cp
        .pki()
        .client_ca
        .expired_client_cert("admin", &["system:masters"]);
    for (what, cert) in [("foreign", &foreign), ("expired", &expired)] {
        let client = client_with(cp, Some(cert)).await;
        let request = http::Request::get("/api/v1/namespaces/ns-0/secrets")
            .body(Vec::new())
            .unwrap();
        match client.request::<Value>(request).await {
            Err(kube::Error::Api(status)) => {
                panic!("a {what} certificate got an answer: {status:?}")
            }
            Ok(v) => panic!("a {what} certificate was served: {v}"),
            Err(_) => {}
        }
    }
    // - The same user with a certificate from the trusted CA is who it says.
    let trusted = cp.pki().client_ca.client_cert("nobody", &[]);
    let (user, _) = whoami(&client_with(cp, Some(&trusted)).await, &spoof).await;
    assert_eq!(user, "nobody");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulwark_in_front_of_a_real_control_plane() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path());
    opts.replicas = 2;
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    // The memory cgroups need cgroup v1's memory controller (and root); the rest does not.
    let cgroups = opts.cgroup_root.join("memory.limit_in_bytes").exists();
    if cgroups {
        opts.apiserver_memory_limit = Some(4 << 30);
    } else {
        eprintln!("no cgroup v1 memory controller: the replicas run without a memory limit");
    }
    let began = Instant::now();
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    eprintln!(
        "etcd and 2 kube-apiservers ready in {:.1} s; seeded and Bulwark ready in {:.1} s",
        cp.started_in().as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
    assert!(dir.path().join("ready").exists());
    let mode = std::fs::metadata(cp.kubeconfig("admin"))
        .unwrap()
        .permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o077,
        0,
        "kubeconfigs hold keys"
    );
    if cgroups {
        // Bulwark's LIST byte budget: the limit less what a seeded replica already uses.
        let config = std::fs::read_to_string(dir.path().join("bulwark/bulwark.yaml")).unwrap();
        let config: serde_norway::Value = serde_norway::from_str(&config).unwrap();
        let headroom = config["upstream"]["replicaHeapHeadroom"].as_u64().unwrap();
        assert!(headroom > 1 << 30 && headroom < 4 << 30, "{headroom}");
    }
    let admin_config = std::fs::read_to_string(cp.kubeconfig("admin")).unwrap();
    assert!(
        admin_config.contains(&format!("https://{}", cp.bulwark_addr())),
        "kubeconfig-admin points at Bulwark"
    );

    each_reader_is_judged_by_real_rbac(&cp).await;

    // Bulwark's front-proxy certificate reaches the request-header authenticator: the
    // apiserver sees the operator, with the groups of the operator's certificate.
    let operator = cp.client("operator").await.unwrap();
    let (user, groups) = whoami(&operator, &[]).await;
    assert_eq!(user, "operator");
    assert!(
        groups.iter().any(|g| g == "sandbox:operators"),
        "{groups:?}"
    );
    assert!(
        groups.iter().any(|g| g == "system:authenticated"),
        "{groups:?}"
    );
    let (ok, text) = kubectl(&cp, "operator", &["get", "configmaps", "-A"]).await;
    assert!(ok && text.contains("configmap-0"), "{text}");

    no_client_passes_as_someone_else(&cp).await;

    // direct-admin goes straight to replica 0 with its own client certificate.
    let direct = std::fs::read_to_string(cp.kubeconfig("direct-admin")).unwrap();
    assert!(direct.contains(&format!("https://{}", cp.replica_addrs()[0])));
    let (ok, text) = kubectl(&cp, "direct-admin", &["auth", "whoami"]).await;
    assert!(
        ok && text.contains("admin") && text.contains("system:masters"),
        "{text}"
    );

    // A replica stops and starts again; Bulwark keeps serving from the other meanwhile.
    cp.stop_replica(1).await.unwrap();
    assert!(!cp.is_running(1));
    let admin = cp.client("admin").await.unwrap();
    for _ in 0..5 {
        let list = call(&admin, get("/api/v1/namespaces/ns-1/configmaps"))
            .await
            .expect("Bulwark serves with one replica down");
        assert!(
            list["items"]
                .as_array()
                .is_some_and(|items| !items.is_empty())
        );
    }
    cp.start_replica(1).await.unwrap();
    assert!(cp.is_running(1));

    for (i, replica) in cp.report().iter().enumerate() {
        assert_eq!(replica.oom_kills, 0, "replica {i}: {replica:?}");
        if cgroups {
            let peak = replica
                .peak_memory_bytes
                .expect("a cgroup reports its peak");
            assert!(peak > 50 << 20, "replica {i} peaked at {peak} bytes");
        }
    }
    let cgroup_dirs: Vec<PathBuf> = if cgroups {
        let root = PathBuf::from("/sys/fs/cgroup/memory");
        (0..2)
            .map(|i| root.join(format!("bulwark-cp-{}-{i}", std::process::id())))
            .collect()
    } else {
        Vec::new()
    };
    assert!(cgroup_dirs.iter().all(|d| d.exists()));
    cp.stop().await.unwrap();
    assert!(!dir.path().join("ready").exists());
    assert!(
        cgroup_dirs.iter().all(|d| !d.exists()),
        "stop removes the cgroups"
    );
    eprintln!("whole test: {:.1} s", began.elapsed().as_secs_f64());
}
