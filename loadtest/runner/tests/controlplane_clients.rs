//! Real clients through Bulwark in front of a real control plane, each compared with what
//! the kube-apiserver itself says: a user whose RBAC names one Secret reads it from the
//! cache and nothing else (the cache asks the real authorizer with SubjectAccessReviews);
//! client-go informers (kubelet's and kube-proxy's content types, LIST+WATCH and
//! WatchList) hold the same objects through Bulwark as straight from a replica, also
//! across replica restarts, and resume their watches across a Bulwark restart without a
//! relist; continue tokens minted on one path are redeemed on the other;
//! kubectl apply, client-side and server-side, writes what it says. One control plane
//! serves every section.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{ControlPlane, Options};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

/// kubelet's `Accept` (protobuf, JSON for what has no protobuf).
const KUBELET_ACCEPT: &str = "application/vnd.kubernetes.protobuf,application/json";
/// kube-proxy's `Accept`.
const KUBE_PROXY_ACCEPT: &str = "application/vnd.kubernetes.protobuf, */*";
/// A reader that takes protobuf only.
const PROTOBUF_ONLY: &str = "application/vnd.kubernetes.protobuf";

/// The namespaces of the extra Secrets: `team-a/` sorts before `team/` in etcd's key
/// order ('-' < '/') but after it by namespace name.
const TEAM_NAMESPACES: [&str; 2] = ["team", "team-a"];
/// Their names, likewise ordered differently by key and by name.
const TEAM_SECRETS: [&str; 5] = ["x", "x-1", "x.1", "x1", "xa"];

/// Runs the control plane's kubectl with a kubeconfig; returns success and all output.
async fn kubectl(cp: &ControlPlane, kubeconfig: &str, args: &[&str]) -> (bool, String) {
    cp.kubectl(kubeconfig, args).await.expect("kubectl runs")
}

/// Runs `cpdriver` and parses its one JSON document; panics with its stderr on failure.
async fn cpdriver(cp: &ControlPlane, args: &[String]) -> Value {
    let out = tokio::process::Command::new(cp.binaries().dir().join("cpdriver"))
        .args(args)
        .output()
        .await
        .expect("cpdriver runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cpdriver {args:?} failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "cpdriver {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn path_arg(cp: &ControlPlane, kubeconfig: &str) -> String {
    cp.kubeconfig(kubeconfig).display().to_string()
}

/// A raw request; the body on 2xx, the status code otherwise.
async fn call(client: &Client, request: http::Request<Vec<u8>>) -> Result<String, u16> {
    match client.request_text(request).await {
        Ok(text) => Ok(text),
        Err(kube::Error::Api(status)) => Err(status.code),
        Err(e) => panic!("the request failed without an answer: {e}"),
    }
}

fn get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path).body(Vec::new()).unwrap()
}

/// The apiserver's own answer to `nobody` (the admin impersonating it, straight at a
/// replica): the RBAC truth Bulwark's answers are held to.
async fn apiserver_answers_nobody(direct: &Client, path: &str) -> Result<String, u16> {
    let request = http::Request::get(path)
        .header("Impersonate-User", "nobody")
        .body(Vec::new())
        .unwrap();
    call(direct, request).await
}

/// The sum of `bulwark_requests_total` samples with all of `labels`, from Bulwark's admin
/// `/metrics`.
async fn requests_total(cp: &ControlPlane, labels: &[&str]) -> f64 {
    let admin = cp.bulwark_admin_addr().expect("Bulwark runs");
    let (_, text) = bulwark_testkit::admin_get(admin, "/metrics")
        .await
        .expect("Bulwark's admin listener answers");
    text.lines()
        .filter(|l| l.starts_with("bulwark_requests_total{"))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Bulwark's `cache.accessReviewTtl`: from the config the control plane wrote, else the
/// default.
fn access_review_ttl(cp: &ControlPlane) -> Duration {
    let config = std::fs::read_to_string(cp.dir().join("bulwark/bulwark.yaml")).unwrap();
    let config: serde_norway::Value = serde_norway::from_str(&config).unwrap();
    match config["cache"]["accessReviewTtl"].as_str() {
        Some(ttl) => humantime::parse_duration(ttl).unwrap(),
        None => bulwark::config::Cache::default().access_review_ttl,
    }
}

/// Namespaces `team` and `team-a` with [`TEAM_SECRETS`] each.
async fn seed_team_secrets(admin: &Client) {
    for ns in TEAM_NAMESPACES {
        let namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap();
        let secrets = Api::<Secret>::namespaced(admin.clone(), ns);
        for name in TEAM_SECRETS {
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": name},
                "stringData": {"who": format!("{ns}/{name}")},
            }))
            .unwrap();
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .unwrap();
        }
    }
}

/// Section 1: `nobody` may get one named Secret, `team/x`.
// Over 120 lines: one reader per kind of grant against the same cache, each answer beside
// the apiserver's own.
async fn cache_authorization(cp: &ControlPlane, admin: &Client, direct: &Client) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "get-x"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["x"], "verbs": ["get", "watch"]}],
    }))
    .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "nobody-get-x"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "get-x"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "nobody"}],
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "team")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let bindings = Api::<RoleBinding>::namespaced(admin.clone(), "team");
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let ttl = access_review_ttl(cp);
    let nobody = cp.client("nobody").await.unwrap();
    let x = "/api/v1/namespaces/team/secrets/x?resourceVersion=0";

    // Each replica's RBAC authorizer sees the binding a moment after it is written, and a
    // denial is remembered for a while: allow both.
    let cache_gets = [
        "served_by=\"cache\"",
        "verb=\"get\"",
        "resource=\"secrets\"",
        "code=\"200\"",
    ];
    let began = Instant::now();
    let body = loop {
        match call(&nobody, get(x)).await {
            Ok(body) => break body,
            Err(403) if began.elapsed() < ttl + Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(code) => panic!("nobody's GET of team/x: {code} after {:?}", began.elapsed()),
        }
    };
    let secret: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(secret["metadata"]["name"], "x", "{body}");
    assert_eq!(secret["metadata"]["namespace"], "team", "{body}");
    let before = requests_total(cp, &cache_gets).await;
    let body = call(&nobody, get(x)).await.expect("granted");
    assert!(body.contains("\"name\":\"x\""), "{body}");
    let after = requests_total(cp, &cache_gets).await;
    assert_eq!(
        after - before,
        1.0,
        "the GET was served from Bulwark's cache"
    );

    // Everything RBAC does not name is refused, by the cache too.
    for path in [
        "/api/v1/namespaces/team/secrets/x-1?resourceVersion=0",
        "/api/v1/namespaces/team-a/secrets/x?resourceVersion=0",
        "/api/v1/namespaces/team/secrets?resourceVersion=0",
        "/api/v1/namespaces/team/secrets",
        "/api/v1/namespaces/team/secrets?resourceVersion=0&fieldSelector=metadata.name%3Dx",
        "/api/v1/secrets?resourceVersion=0",
    ] {
        assert_eq!(call(&nobody, get(path)).await, Err(403), "{path}");
        assert_eq!(
            apiserver_answers_nobody(direct, path).await.map(|_| ()),
            Err(403),
            "the apiserver agrees: {path}"
        );
    }

    // A watch by name is a watch of that Secret: allowed for x, 403 for another name.
    let cache_watches = [
        "served_by=\"cache\"",
        "verb=\"watch\"",
        "resource=\"secrets\"",
    ];
    let before = requests_total(cp, &cache_watches).await;
    let watch = |name: &str| {
        format!(
            "/api/v1/namespaces/team/secrets?fieldSelector=metadata.name%3D{name}\
             &resourceVersion=0&watch=1&timeoutSeconds=2"
        )
    };
    let events = call(&nobody, get(&watch("x")))
        .await
        .expect("nobody watches team/x");
    let events: Vec<Value> = events
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "ADDED");
    assert_eq!(events[0]["object"]["metadata"]["name"], "x");
    assert_eq!(requests_total(cp, &cache_watches).await - before, 1.0);
    assert_eq!(call(&nobody, get(&watch("x-1"))).await, Err(403));
    for (name, code) in [("x", Ok(())), ("x-1", Err(403))] {
        assert_eq!(
            apiserver_answers_nobody(direct, &watch(name))
                .await
                .map(|_| ()),
            code,
            "the apiserver agrees: watch {name}"
        );
    }

    // Revoked: within the TTL of the last allowed review (plus RBAC's own propagation).
    bindings
        .delete("nobody-get-x", &DeleteParams::default())
        .await
        .unwrap();
    let revoked = Instant::now();
    let until_refused = async |path: &str, what: &str| loop {
        match call(&nobody, get(path)).await {
            Err(403) => break,
            Ok(_) => {
                assert!(
                    revoked.elapsed() < ttl + Duration::from_secs(3),
                    "nobody still {what} team/x {:?} after the RoleBinding went (TTL {ttl:?})",
                    revoked.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(code) => panic!("{code}"),
        }
    };
    until_refused(x, "reads").await;
    eprintln!(
        "the RoleBinding's deletion took effect in {:.1} s (accessReviewTtl {ttl:?})",
        revoked.elapsed().as_secs_f64()
    );
    // The watch's own review (verb watch) was allowed after the GET's: it may outlive the
    // GET's by that gap, never the TTL.
    until_refused(&watch("x"), "watches").await;
}

/// Section 3: pages through Bulwark continued straight at the replica, and the other way.
async fn pagination_across(cp: &ControlPlane) {
    let via = path_arg(cp, "admin");
    let direct = path_arg(cp, "direct-admin");
    let pages = async |first: &str, second: &str, limit: &str| {
        let args = [
            "list-pages",
            "--kubeconfig",
            first,
            "--continue-via",
            second,
            "--resource",
            "secrets",
            "--limit",
            limit,
        ]
        .map(String::from);
        cpdriver(cp, &args).await
    };
    let names = |v: &Value| -> Vec<String> {
        v["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_string())
            .collect()
    };
    let full = names(&pages(&direct, &direct, "10000").await);
    assert!(full.len() >= 40, "{full:?}");
    for ns in TEAM_NAMESPACES {
        for name in TEAM_SECRETS {
            assert!(full.contains(&format!("{ns}/{name}")), "{full:?}");
        }
    }
    let (bulwark_first, direct_first) =
        tokio::join!(pages(&via, &direct, "3"), pages(&direct, &via, "3"),);
    for (what, result) in [
        ("through Bulwark, continued directly", bulwark_first),
        ("directly, continued through Bulwark", direct_first),
    ] {
        let got = names(&result);
        eprintln!("{what}: {} names in {} pages", got.len(), result["pages"]);
        assert_eq!(got, full, "{what}");
        assert_eq!(
            result["pages"].as_u64(),
            Some(full.len().div_ceil(3) as u64),
            "{what}"
        );
    }
    let mut unique = full.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), full.len(), "no Secret twice");
}

/// The arguments of a cpdriver comparison (`informer-compare`, `object-compare`) of
/// `resource` through Bulwark (the admin) against the apiserver (direct-admin), both clients
/// asking with `accept`, and `extra` flags.
fn compare_args(
    cp: &ControlPlane,
    subcommand: &str,
    resource: &str,
    accept: &str,
    extra: &[&str],
) -> Vec<String> {
    let (via, direct) = (path_arg(cp, "admin"), path_arg(cp, "direct-admin"));
    let common = [
        subcommand,
        "--via",
        &via,
        "--direct",
        &direct,
        "--resource",
        resource,
        "--accept",
        accept,
    ];
    common.iter().chain(extra).map(|a| a.to_string()).collect()
}

/// One `informer-compare` run; panics unless the stores agree.
async fn informers_agree(cp: &ControlPlane, resource: &str, accept: &str, watchlist: bool) {
    let churn = ["--churn", "30", "--timeout", "120s"];
    let mut args = compare_args(cp, "informer-compare", resource, accept, &churn);
    if watchlist {
        args.push("--watchlist".into());
    }
    let result = cpdriver(cp, &args).await;
    eprintln!("{resource}, Accept {accept:?}, watchlist {watchlist}: {result}");
    assert_eq!(
        result["equal"], true,
        "{resource}, Accept {accept:?}, watchlist {watchlist}: {result}"
    );
    assert_eq!(result["churned"], 30, "{result}");
    assert!(result["via_count"].as_u64() > Some(0), "{result}");
}

/// Section 2: every combination of resource, content type and list mode, at once.
async fn informers(cp: &ControlPlane) {
    let mut runs = Vec::new();
    for resource in ["secrets", "endpointslices"] {
        for accept in [KUBELET_ACCEPT, KUBE_PROXY_ACCEPT, PROTOBUF_ONLY] {
            for watchlist in [false, true] {
                runs.push(informers_agree(cp, resource, accept, watchlist));
            }
        }
    }
    futures::future::join_all(runs).await;
}

/// Section 2, protobuf: readers that take protobuf only are answered from Bulwark's cache
/// (their LISTs and watches count as served by the cache), and every object they decode
/// with client-go, as a list item and as a GET, is semantically equal to the apiserver's
/// own protobuf answer: metadata (uid, timestamps, owners, managedFields) and content.
async fn protobuf_from_the_cache(cp: &ControlPlane) {
    let cached = |verb: &'static str| {
        let labels = [
            format!("verb=\"{verb}\""),
            "served_by=\"cache\"".to_string(),
        ];
        async move {
            let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
            requests_total(cp, &labels).await
        }
    };
    let (watches, gets) = (cached("watch").await, cached("get").await);
    // LIST at resourceVersion=0, then WATCH from it: both from the cache. (A WatchList
    // is a consistent read, which goes upstream for an identity that does not accept
    // staleness, as the admin does not.)
    tokio::join!(
        informers_agree(cp, "secrets", PROTOBUF_ONLY, false),
        informers_agree(cp, "endpointslices", PROTOBUF_ONLY, false),
    );
    assert!(
        cached("watch").await >= watches + 2.0,
        "protobuf-only informers watch Bulwark's cache"
    );
    for (resource, namespace) in [
        ("secrets", "team-a"),
        ("endpointslices", "default"),
        ("secrets", "kube-system"),
    ] {
        let args = compare_args(
            cp,
            "object-compare",
            resource,
            PROTOBUF_ONLY,
            &["--namespace", namespace],
        );
        let result = cpdriver(cp, &args).await;
        eprintln!("{resource} in {namespace}, protobuf: {result}");
        assert_eq!(result["equal"], true, "{resource} in {namespace}: {result}");
        assert_eq!(result["protobuf_via"], true, "{result}");
        assert_eq!(result["protobuf_direct"], true, "{result}");
        if namespace != "kube-system" {
            assert!(result["items"].as_u64() > Some(0), "{result}");
        }
    }
    assert!(
        cached("get").await > gets,
        "the GETs at resourceVersion=0 came from the cache"
    );
}

/// Section 2, restarts: informers through Bulwark started while replica 1 is down (it comes
/// back a second later), then after replica 0 was down while objects changed through
/// Bulwark (so through replica 1): Bulwark's cache follows them through replica 1, and
/// agrees with replica 0 once it is back.
async fn informers_across_restarts(cp: &ControlPlane, admin_via_bulwark: &Client) {
    cp.stop_replica(1).await.unwrap();
    let restart = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        cp.start_replica(1).await.unwrap();
    };
    tokio::join!(
        informers_agree(cp, "secrets", KUBELET_ACCEPT, true),
        informers_agree(cp, "endpointslices", KUBE_PROXY_ACCEPT, false),
        restart,
    );

    cp.stop_replica(0).await.unwrap();
    let (post, delete) = (PostParams::default(), DeleteParams::default());
    let secrets = Api::<Secret>::namespaced(admin_via_bulwark.clone(), "team-a");
    let slices = Api::<EndpointSlice>::namespaced(admin_via_bulwark.clone(), "team-a");
    for i in 0..5 {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": format!("while-down-{i}")},
            "stringData": {"i": i.to_string()},
        }))
        .unwrap();
        retry(|| secrets.create(&post, &secret)).await;
    }
    retry(|| secrets.delete("while-down-0", &delete)).await;
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "while-down"},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["192.0.2.7"]}],
    }))
    .unwrap();
    retry(|| slices.create(&post, &slice)).await;
    let began = Instant::now();
    let cached = "/api/v1/namespaces/team-a/secrets/while-down-4?resourceVersion=0";
    while call(admin_via_bulwark, get(cached)).await.is_err() {
        assert!(
            began.elapsed() < Duration::from_secs(15),
            "Bulwark's cache did not follow a write made while replica 0 was down"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cp.start_replica(0).await.unwrap();
    tokio::join!(
        informers_agree(cp, "secrets", KUBE_PROXY_ACCEPT, false),
        informers_agree(cp, "endpointslices", KUBELET_ACCEPT, true),
    );
}

/// Retries a write for a few seconds while Bulwark notices a replica went away.
async fn retry<T, F, Fut>(mut write: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = kube::Result<T>>,
{
    let began = Instant::now();
    loop {
        match write().await {
            Ok(v) => return v,
            Err(e) if began.elapsed() < Duration::from_secs(15) => {
                eprintln!("retrying a write: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("a write through Bulwark failed: {e}"),
        }
    }
}

/// Section 5: client-go informers (kubelet's Secrets, kube-proxy's EndpointSlices, each in
/// a fresh namespace) through Bulwark while Bulwark is restarted, with an empty cache, as a
/// rollout does; writes go on before, during and after. The drain ends their watches
/// cleanly (the driver sees the body's EOF, not a cut), and the informers resume their
/// watches: the apiservers count no namespaced LIST of either resource in that time
/// (Bulwark's own informers list the whole cluster, and by WatchList), each informer sent
/// one LIST in all (its first sync, counted by the driver on its transport), and each was
/// told exactly the events an informer straight at the apiserver was told, in order.
async fn informers_resume_across_a_bulwark_restart(cp: &mut ControlPlane) {
    let dir = cp.dir().join("resume");
    std::fs::create_dir_all(&dir).unwrap();
    let runs = [
        ("secrets", KUBELET_ACCEPT),
        ("endpointslices", KUBE_PROXY_ACCEPT),
    ];
    let mut drivers = Vec::new();
    for (resource, accept) in runs {
        let (ready, done) = (
            dir.join(format!("{resource}.ready")),
            dir.join(format!("{resource}.done")),
        );
        let flags = [
            "--ready-file",
            &ready.display().to_string(),
            "--done-file",
            &done.display().to_string(),
            "--timeout",
            "120s",
        ]
        .map(String::from);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let args = compare_args(cp, "informer-resume", resource, accept, &flags);
        let command = tokio::process::Command::new(cp.binaries().dir().join("cpdriver"))
            .args(&args)
            .kill_on_drop(true)
            .output();
        drivers.push((resource, ready, done, tokio::spawn(command)));
    }
    let began = Instant::now();
    for (resource, ready, _, _) in &drivers {
        while !ready.exists() {
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "the {resource} informers never synced"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let relists = async |cp: &ControlPlane, resource: &str| {
        let resource = format!("resource=\"{resource}\"");
        let labels = ["verb=\"LIST\"", "scope=\"namespace\"", resource.as_str()];
        cp.apiserver_requests(&labels).await
    };
    // Writes before the restart.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut before = Vec::new();
    for (resource, _) in runs {
        before.push(relists(cp, resource).await);
    }
    let restarted = Instant::now();
    cp.restart_bulwark().await.expect("Bulwark restarts");
    eprintln!(
        "Bulwark restarted in {:.1} s",
        restarted.elapsed().as_secs_f64()
    );
    // Writes while the informers find the new Bulwark, then after.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (_, _, done, _) in &drivers {
        std::fs::write(done, "").unwrap();
    }
    for ((resource, _, _, driver), before) in drivers.into_iter().zip(before) {
        let out = driver.await.unwrap().expect("cpdriver runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "cpdriver informer-resume: {stderr}");
        let result: Value = serde_json::from_slice(&out.stdout).unwrap();
        let after = relists(cp, resource).await;
        eprintln!(
            "{resource} across a Bulwark restart: {result}; namespaced LISTs at the apiservers \
             {before} before, {after} after"
        );
        assert_eq!(result["equal"], true, "{resource}: {result}");
        // The watch open through the restart was ended by the drain, cleanly: client-go
        // reads an end mid-event, or a reset, as a broken stream and relists.
        let first_watch = result["via_requests"].as_array().and_then(|r| {
            r.iter()
                .filter_map(Value::as_str)
                .find(|l| l.starts_with("WATCH"))
        });
        assert!(
            first_watch.is_some_and(|w| w.ends_with("body: EOF")),
            "{resource}: the drain cut the watch: {result}"
        );
        assert!(result["churned"].as_u64() > Some(30), "{result}");
        assert_eq!(result["via_lists"], 1, "{resource} relisted: {result}");
        assert!(
            result["via_watches"].as_u64() >= Some(2),
            "resumed: {result}"
        );
        assert_eq!(after, before, "{resource}: the apiservers served a relist");
    }
    let resumed_upstream = requests_total(cp, &["verb=\"watch\"", "served_by=\"upstream\""]).await;
    eprintln!("watches the new Bulwark sent upstream: {resumed_upstream}");
}

/// Section 4: kubectl apply through Bulwark, client-side (validated against the OpenAPI
/// document read through Bulwark) and server-side, twice each.
async fn kubectl_apply(cp: &ControlPlane, direct: &Client) {
    let dir = cp.dir().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    let manifest = |name: &str, value: &str| {
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\n  namespace: team\n\
             data:\n  setting: {value}\n---\napiVersion: v1\nkind: Secret\nmetadata:\n  \
             name: {name}\n  namespace: team\ntype: Opaque\nstringData:\n  password: {value}\n"
        )
    };
    let configmaps = Api::<ConfigMap>::namespaced(direct.clone(), "team");
    let secrets = Api::<Secret>::namespaced(direct.clone(), "team");
    for (name, server_side) in [
        ("applied-client-side", false),
        ("applied-server-side", true),
    ] {
        for value in ["first", "second"] {
            let file = dir.join(format!("{name}-{value}.yaml"));
            std::fs::write(&file, manifest(name, value)).unwrap();
            let file = file.display().to_string();
            let mut args = vec!["apply", "-f", &file];
            if server_side {
                args.push("--server-side");
            }
            let (ok, text) = kubectl(cp, "admin", &args).await;
            assert!(ok, "kubectl {args:?}: {text}");
            let configmap = configmaps.get(name).await.unwrap();
            let data = configmap.data.unwrap_or_default();
            assert_eq!(
                data.get("setting").map(String::as_str),
                Some(value),
                "{name}"
            );
            let secret = secrets.get(name).await.unwrap();
            let data = secret.data.unwrap_or_default();
            assert_eq!(
                data.get("password").map(|b| b.0.as_slice()),
                Some(value.as_bytes()),
                "{name}"
            );
            let annotations = configmap.metadata.annotations.unwrap_or_default();
            assert_eq!(
                annotations.contains_key("kubectl.kubernetes.io/last-applied-configuration"),
                !server_side,
                "{name}"
            );
            let managers: Vec<_> = configmap
                .metadata
                .managed_fields
                .unwrap_or_default()
                .into_iter()
                .filter_map(|m| Some((m.manager?, m.operation?)))
                .collect();
            let expected = if server_side {
                ("kubectl".to_string(), "Apply".to_string())
            } else {
                (
                    "kubectl-client-side-apply".to_string(),
                    "Update".to_string(),
                )
            };
            assert!(managers.contains(&expected), "{name}: {managers:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_through_bulwark_agree_with_the_apiserver() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path());
    opts.replicas = 2;
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    // Section 3 counts the namespaced EndpointSlice LISTs the apiservers serve: the
    // kubernetes Service's publisher would add its own (controlplane_incluster tests it).
    opts.kubernetes_service = false;
    let began = Instant::now();
    let mut cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    eprintln!(
        "control plane ready in {:.1} s",
        began.elapsed().as_secs_f64()
    );
    let direct = cp.client("direct-admin").await.unwrap();
    let admin = cp.client("admin").await.unwrap();
    seed_team_secrets(&direct).await;

    let mut lap = Instant::now();
    let mut timed = |what: &str| {
        eprintln!("{what}: {:.1} s", lap.elapsed().as_secs_f64());
        lap = Instant::now();
    };
    pagination_across(&cp).await;
    timed("pagination across paths");
    cache_authorization(&cp, &admin, &direct).await;
    timed("cache authorization");
    kubectl_apply(&cp, &direct).await;
    timed("kubectl apply");
    informers(&cp).await;
    timed("informers, 12 combinations");
    protobuf_from_the_cache(&cp).await;
    timed("protobuf from the cache");
    informers_across_restarts(&cp, &admin).await;
    timed("informers across restarts");
    informers_resume_across_a_bulwark_restart(&mut cp).await;
    timed("informers resume across a Bulwark restart");
    cp.stop().await.unwrap();
    eprintln!("whole test: {:.1} s", began.elapsed().as_secs_f64());
}
