//! Bulwark's `impersonate` and `passthrough` identity modes in front of a real control
//! plane (etcd and a kube-apiserver built from Kubernetes' own Go modules): the real RBAC
//! authorizer judges the impersonated user, the real TokenReview judges ServiceAccount
//! tokens from the real TokenRequest API. One control plane per mode, started side by side.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{BULWARK_USER, ControlPlane, Options};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{Value, json};

/// A raw request; `Ok` with the JSON body on 2xx, `Err` with the status code and message
/// otherwise.
async fn call(client: &Client, request: http::Request<Vec<u8>>) -> Result<Value, (u16, String)> {
    match client.request::<Value>(request).await {
        Ok(v) => Ok(v),
        Err(kube::Error::Api(status)) => Err((status.code, status.message)),
        Err(e) => panic!("the request failed without an answer: {e}"),
    }
}

fn get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path).body(Vec::new()).unwrap()
}

fn post(path: &str, body: &Value) -> http::Request<Vec<u8>> {
    http::Request::post(path)
        .header("Content-Type", "application/json")
        .body(body.to_string().into_bytes())
        .unwrap()
}

/// The user a SelfSubjectReview reports for `client`, plus `headers`.
async fn whoami(client: &Client, headers: &[(&str, &str)]) -> Result<String, (u16, String)> {
    let mut request = http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
        .header("Content-Type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"});
    let review = call(client, request.body(body.to_string().into_bytes()).unwrap()).await?;
    Ok(review["status"]["userInfo"]["username"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

async fn start(dir: &std::path::Path, mode: &str) -> ControlPlane {
    let mut opts = Options::new(dir);
    opts.replicas = 1;
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    opts.identity_mode = Some(mode.to_string());
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane ({mode}) did not start: {e}"));
    let config = std::fs::read_to_string(dir.join("bulwark/bulwark.yaml")).unwrap();
    let config: serde_norway::Value = serde_norway::from_str(&config).unwrap();
    assert_eq!(config["identity"]["mode"].as_str(), Some(mode));
    cp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impersonate_mode_against_real_rbac() {
    let began = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let cp = start(dir.path(), "impersonate").await;
    // Straight to the replica: through Bulwark the admin would be impersonated too.
    let admin = cp.client("direct-admin").await.unwrap();
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "bulwark:impersonator"},
        "rules": [
            {"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]},
            {"apiGroups": ["authentication.k8s.io"], "resources": ["uids", "userextras/*"], "verbs": ["impersonate"]},
        ],
    });
    call(
        &admin,
        post("/apis/rbac.authorization.k8s.io/v1/clusterroles", &role),
    )
    .await
    .expect("the impersonation ClusterRole is created");
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "bulwark:impersonator"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "bulwark:impersonator"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": BULWARK_USER}],
    });
    call(
        &admin,
        post(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            &binding,
        ),
    )
    .await
    .expect("the impersonation binding is created");

    // The operator (client certificate, group sandbox:operators) through Bulwark; the
    // binding reaches the RBAC authorizer's informer within moments.
    let operator = cp.client_without_retries("operator").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let user = loop {
        match whoami(&operator, &[]).await {
            Ok(user) => break user,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "impersonation never allowed: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(user, "operator");

    // Exactly what RBAC grants the operator: configmaps yes, pods no.
    let list = call(&operator, get("/api/v1/namespaces/ns-0/configmaps"))
        .await
        .expect("the operator lists configmaps");
    assert!(
        list["items"]
            .as_array()
            .is_some_and(|items| !items.is_empty()),
        "{list}"
    );
    let (code, message) = call(&operator, get("/api/v1/namespaces/ns-0/pods"))
        .await
        .expect_err("the operator may not list pods");
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(r#"User "operator" cannot list resource "pods""#),
        "{message}"
    );
    // `nobody` is bound to nothing.
    let nobody = cp.client_without_retries("nobody").await.unwrap();
    let (code, message) = call(&nobody, get("/api/v1/namespaces/ns-0/configmaps"))
        .await
        .expect_err("nobody may not list configmaps");
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(r#"User "nobody" cannot list resource "configmaps""#),
        "{message}"
    );

    // A client's own Impersonate-User would act as Bulwark's: Bulwark refuses it.
    let (code, message) = whoami(&nobody, &[("Impersonate-User", "operator")])
        .await
        .expect_err("client impersonation is refused");
    assert_eq!(code, 403, "{message}");
    assert!(message.contains("not accepted by this proxy"), "{message}");
    let mut request = http::Request::get("/api/v1/namespaces/ns-0/configmaps");
    request = request.header("Impersonate-User", "system:admin");
    let (code, _) = call(&operator, request.body(Vec::new()).unwrap())
        .await
        .expect_err("client impersonation is refused");
    assert_eq!(code, 403);

    cp.stop().await.unwrap();
    eprintln!("impersonate: {:.1} s", began.elapsed().as_secs_f64());
}

/// A client to Bulwark with a bearer token and no client certificate.
async fn token_client(cp: &ControlPlane, dir: &std::path::Path, token: &str) -> Client {
    let ca = dir.join("bulwark-ca.crt");
    std::fs::write(&ca, cp.bulwark_ca_pem().expect("Bulwark's CA")).unwrap();
    let yaml = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "bulwark", "cluster": {
            "server": format!("https://{}", cp.bulwark_addr()),
            "certificate-authority": ca.to_string_lossy(),
        }}],
        "users": [{"name": "token", "user": {"token": token}}],
        "contexts": [{"name": "token", "context": {"cluster": "bulwark", "user": "token"}}],
        "current-context": "token",
    });
    let kubeconfig = Kubeconfig::from_yaml(&yaml.to_string()).unwrap();
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap();
    config.default_retry = false;
    Client::try_from(config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_mode_with_real_service_account_tokens() {
    let began = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let cp = start(dir.path(), "passthrough").await;
    let admin = cp.client("direct-admin").await.unwrap();
    let (ns, name) = ("ns-0", "reader");
    call(
        &admin,
        post(
            &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
            &json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
        ),
    )
    .await
    .expect("the ServiceAccount is created");
    call(
        &admin,
        post(
            &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles"),
            &json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": name},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
            }),
        ),
    )
    .await
    .expect("the Role is created");
    call(
        &admin,
        post(
            &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
            &json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
            }),
        ),
    )
    .await
    .expect("the RoleBinding is created");
    let request = json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600},
    });
    let issued = call(
        &admin,
        post(
            &format!("/api/v1/namespaces/{ns}/serviceaccounts/{name}/token"),
            &request,
        ),
    )
    .await
    .expect("the TokenRequest API issues a token");
    let token = issued["status"]["token"]
        .as_str()
        .expect("a token")
        .to_string();

    // Through Bulwark: its TokenReview accepts the token, and the apiserver sees the
    // ServiceAccount itself.
    let sa = token_client(&cp, dir.path(), &token).await;
    let user = whoami(&sa, &[])
        .await
        .expect("the ServiceAccount token is accepted");
    assert_eq!(user, format!("system:serviceaccount:{ns}:{name}"));
    // RBAC applies to the ServiceAccount, eventually consistent with the new binding.
    let deadline = Instant::now() + Duration::from_secs(30);
    let list = loop {
        match call(&sa, get(&format!("/api/v1/namespaces/{ns}/configmaps"))).await {
            Ok(list) => break list,
            Err(e) => {
                assert!(Instant::now() < deadline, "never allowed: {e:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(
        list["items"]
            .as_array()
            .is_some_and(|items| !items.is_empty()),
        "{list}"
    );
    let (code, message) = call(&sa, get(&format!("/api/v1/namespaces/{ns}/secrets")))
        .await
        .expect_err("the ServiceAccount may not list secrets");
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            r#"User "system:serviceaccount:{ns}:{name}" cannot list resource "secrets""#
        )),
        "{message}"
    );
    let (code, message) = call(&sa, get("/api/v1/namespaces/ns-1/configmaps"))
        .await
        .expect_err("the Role is only in its namespace");
    assert_eq!(code, 403, "{message}");

    // A made-up token: Bulwark's TokenReview rejects it.
    let random = token_client(&cp, dir.path(), "not-a-real-token-0123456789abcdef").await;
    let (code, message) = whoami(&random, &[])
        .await
        .expect_err("a made-up token is rejected");
    assert_eq!((code, message.as_str()), (401, "Unauthorized"));
    let (code, _) = call(&random, get(&format!("/api/v1/namespaces/{ns}/configmaps")))
        .await
        .expect_err("a made-up token is rejected");
    assert_eq!(code, 401);

    cp.stop().await.unwrap();
    eprintln!("passthrough: {:.1} s", began.elapsed().as_secs_f64());
}
