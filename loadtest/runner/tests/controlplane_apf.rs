//! The apiserver's own API Priority and Fairness rejecting one user, through Bulwark: a
//! real kube-apiserver's 429 reaches the client as the apiserver wrote it (`Retry-After` and
//! the `X-Kubernetes-PF-*` headers naming the flow schema and priority level), and Bulwark
//! does not hold it against the replica: it is one flow over its share, not a replica out
//! of room, so other users keep being served there and the replica is neither throttled in
//! Bulwark's pick nor taken out of rotation. Without the binaries the control plane builds
//! them (`loadtest/controlplane/build.sh`, Go 1.26) or fails: this test never skips.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{ControlPlane, Options};
use bulwark_loadtest::proxy_process::write_shipped_rules;
use futures::StreamExt as _;
use http_body_util::BodyExt as _;
use kube::Client;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The user whose requests APF gets to reject (the `operator` kubeconfig's).
const HAMMERED_USER: &str = "operator";
/// The namespace of the ConfigMaps the hammered user lists.
const NAMESPACE: &str = "apf-hammer";
/// ConfigMaps there, and bytes in each: every LIST reads about 2.4 MB, slow enough that
/// concurrent ones overlap at the apiserver.
const CONFIGMAPS: usize = 300;
const CONFIGMAP_BYTES: usize = 8 * 1024;
/// Concurrent LISTs per round, and how long the rounds may go on before the test gives up.
const CONCURRENCY: usize = 40;
const HAMMER_FOR: Duration = Duration::from_secs(60);
/// 429s to collect before stopping.
const REJECTIONS_WANTED: usize = 5;

const PF_FLOW_SCHEMA_UID: &str = "x-kubernetes-pf-flowschema-uid";
const PF_PRIORITY_LEVEL_UID: &str = "x-kubernetes-pf-prioritylevel-uid";

/// One answer: status, headers, body.
struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: Vec<u8>,
}

/// Sends `method path` (with a JSON body, if any) and reads the whole answer.
async fn send(client: &Client, method: http::Method, path: &str, body: Option<&Value>) -> Answer {
    let mut request = http::Request::builder().method(method).uri(path);
    let bytes = match body {
        Some(body) => {
            request = request.header("Content-Type", "application/json");
            body.to_string().into_bytes()
        }
        None => Vec::new(),
    };
    let response = client
        .send(request.body(kube::client::Body::from(bytes)).unwrap())
        .await
        .unwrap_or_else(|e| panic!("{path}: no answer: {e}"));
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{path}: the body broke off: {e}"))
        .to_bytes()
        .to_vec();
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

fn header<'a>(answer: &'a Answer, name: &str) -> Option<&'a str> {
    answer.headers.get(name).and_then(|v| v.to_str().ok())
}

/// `path` on Bulwark's admin listener: status and body.
async fn admin(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body.to_string())
}

/// Bulwark's view of every replica: (name, in rotation, throttled).
async fn replicas(addr: SocketAddr) -> Vec<(String, bool, bool)> {
    let (code, body) = admin(addr, "/debug/upstream").await;
    assert_eq!(code, 200, "{body}");
    // The body may be chunked; the JSON object is between the first `{` and the last `}`.
    let json = &body[body.find('{').unwrap()..=body.rfind('}').unwrap()];
    let view: Value = serde_json::from_str(json).unwrap();
    view["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap().to_string(),
                r["healthy"].as_bool().unwrap(),
                r["throttled"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// The value of every sample of `name` whose labels contain `label`.
fn samples(metrics: &str, name: &str, label: &str) -> Vec<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

/// Something slow to list: `CONFIGMAPS` ConfigMaps of `CONFIGMAP_BYTES` in `NAMESPACE`.
async fn fill_namespace(admin_client: &Client) {
    let created = send(
        admin_client,
        http::Method::POST,
        "/api/v1/namespaces",
        Some(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})),
    )
    .await;
    assert_eq!(
        created.status,
        201,
        "{}",
        String::from_utf8_lossy(&created.body)
    );
    let filler: String = "0123456789abcdef".repeat(CONFIGMAP_BYTES / 16);
    let path = format!("/api/v1/namespaces/{NAMESPACE}/configmaps");
    futures::stream::iter(0..CONFIGMAPS)
        .map(|i| {
            let (client, path, filler) = (admin_client, &path, &filler);
            async move {
                let body = json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("configmap-{i}")},
                    "data": {"filler": filler},
                });
                let answer = send(client, http::Method::POST, path, Some(&body)).await;
                assert_eq!(
                    answer.status,
                    201,
                    "{}",
                    String::from_utf8_lossy(&answer.body)
                );
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<()>>()
        .await;
}

/// A priority level of one share (a few seats per apiserver) that neither borrows nor
/// queues, and a flow schema that puts the operator there ahead of every built-in one:
/// their UIDs, (flow schema, priority level).
async fn tiny_priority_level(admin_client: &Client) -> (String, String) {
    let level = send(
        admin_client,
        http::Method::POST,
        "/apis/flowcontrol.apiserver.k8s.io/v1/prioritylevelconfigurations",
        Some(&json!({
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": "bulwark-test-tiny"},
            "spec": {"type": "Limited", "limited": {
                "nominalConcurrencyShares": 1,
                "lendablePercent": 0,
                "borrowingLimitPercent": 0,
                "limitResponse": {"type": "Reject"},
            }},
        })),
    )
    .await;
    assert_eq!(
        level.status,
        201,
        "{}",
        String::from_utf8_lossy(&level.body)
    );
    let level: Value = serde_json::from_slice(&level.body).unwrap();
    let schema = send(
        admin_client,
        http::Method::POST,
        "/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas",
        Some(&json!({
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": "bulwark-test-operator"},
            "spec": {
                "priorityLevelConfiguration": {"name": "bulwark-test-tiny"},
                "matchingPrecedence": 50,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [{
                    "subjects": [{"kind": "User", "user": {"name": HAMMERED_USER}}],
                    "resourceRules": [{
                        "verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                        "namespaces": ["*"], "clusterScope": true,
                    }],
                }],
            },
        })),
    )
    .await;
    assert_eq!(
        schema.status,
        201,
        "{}",
        String::from_utf8_lossy(&schema.body)
    );
    let schema: Value = serde_json::from_slice(&schema.body).unwrap();
    let schema_uid = schema["metadata"]["uid"].as_str().unwrap().to_string();
    let level_uid = level["metadata"]["uid"].as_str().unwrap().to_string();
    (schema_uid, level_uid)
}

/// Waits until eight answers in a row to the operator name the flow schema `schema_uid`.
async fn until_applied(operator: &Client, schema_uid: &str) {
    let probe = format!("/api/v1/namespaces/{NAMESPACE}/configmaps?limit=1");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut in_a_row = 0;
    while in_a_row < 8 {
        assert!(
            Instant::now() < deadline,
            "the flow schema was never applied"
        );
        let answer = send(operator, http::Method::GET, &probe, None).await;
        if header(&answer, PF_FLOW_SCHEMA_UID) == Some(schema_uid) {
            in_a_row += 1;
        } else {
            in_a_row = 0;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

// Over 120 lines: the storm and its bystanders run at once and are judged together at the
// end; the setup is in functions of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apf_rejection_passes_through_and_costs_the_replica_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // The shipped rules, and the hammered user exempt in Bulwark: its own fair queues would
    // otherwise hold the storm back before the apiserver's APF saw it.
    let rules = write_shipped_rules(&dir.path().join("rules")).unwrap();
    std::fs::write(
        rules.join("apf-hammer.yaml"),
        format!(
            "rules:\n  - name: apf-hammer\n    precedence: 2\n    match:\n      users: [{HAMMERED_USER}]\n    level: exempt\n    flow: user\n"
        ),
    )
    .unwrap();
    let mut opts = Options::new(dir.path().join("cp"));
    opts.replicas = 2;
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    opts.rules = Some(rules);
    let began = Instant::now();
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    eprintln!(
        "control plane ready in {:.1} s",
        began.elapsed().as_secs_f64()
    );
    let bulwark_admin = cp.bulwark_admin_addr().unwrap();
    let admin_client = cp.client("admin").await.unwrap();

    fill_namespace(&admin_client).await;

    let (schema_uid, level_uid) = tiny_priority_level(&admin_client).await;

    // Every apiserver applies the new configuration on its own: wait until several answers
    // in a row (Bulwark spreads them over both replicas) name the new flow schema.
    let operator = cp.client_without_retries(HAMMERED_USER).await.unwrap();
    until_applied(&operator, &schema_uid).await;
    let before = replicas(bulwark_admin).await;
    assert!(
        before
            .iter()
            .all(|(_, healthy, throttled)| *healthy && !throttled),
        "{before:?}"
    );

    // Meanwhile: other users through Bulwark, every answer of which must be a success, and
    // Bulwark's view of the replicas, which must never show one throttled or ejected.
    let done = Arc::new(AtomicBool::new(false));
    let innocent_ok = Arc::new(AtomicU64::new(0));
    let mut innocents = Vec::new();
    for (kubeconfig, path) in [
        ("admin", "/api/v1/namespaces/ns-0/configmaps"),
        (
            "node-1",
            "/api/v1/namespaces/ns-0/secrets/node-1-kubelet-config",
        ),
    ] {
        let client = cp.client_without_retries(kubeconfig).await.unwrap();
        let (done, ok) = (done.clone(), innocent_ok.clone());
        innocents.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let answer = send(&client, http::Method::GET, path, None).await;
                if answer.status == 200 {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    failures.push(format!(
                        "{kubeconfig} {path}: {} {}",
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    ));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            failures
        }));
    }
    let watcher = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut seen_bad = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let now = replicas(bulwark_admin).await;
                if now
                    .iter()
                    .any(|(_, healthy, throttled)| !healthy || *throttled)
                {
                    seen_bad.push(now);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            seen_bad
        })
    };

    // The storm: rounds of concurrent LISTs by the operator until APF has said no enough.
    let list = format!("/api/v1/namespaces/{NAMESPACE}/configmaps");
    let hammer_until = Instant::now() + HAMMER_FOR;
    let (mut sent, mut ok, mut rejected) = (0usize, 0usize, Vec::new());
    while rejected.len() < REJECTIONS_WANTED && Instant::now() < hammer_until {
        let answers = futures::future::join_all(
            (0..CONCURRENCY).map(|_| send(&operator, http::Method::GET, &list, None)),
        )
        .await;
        for answer in answers {
            sent += 1;
            match answer.status {
                200 => ok += 1,
                429 => rejected.push(answer),
                other => panic!(
                    "the operator's LIST answered {other}: {}",
                    String::from_utf8_lossy(&answer.body)
                ),
            }
        }
    }
    // A little longer, so that a throttle a 429 would have caused has time to show.
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.store(true, Ordering::Relaxed);
    let mut innocent_failures = Vec::new();
    for task in innocents {
        innocent_failures.extend(task.await.unwrap());
    }
    let seen_bad = watcher.await.unwrap();
    eprintln!(
        "operator LISTs: {sent} sent, {ok} answered 200, {} answered 429; other users: {} \
         answered 200",
        rejected.len(),
        innocent_ok.load(Ordering::Relaxed)
    );

    assert!(
        !rejected.is_empty(),
        "APF rejected none of {sent} concurrent LISTs"
    );
    for answer in &rejected {
        let headers = &answer.headers;
        // The apiserver's answer, not Bulwark's: APF's headers, naming what was created.
        assert_eq!(
            header(answer, PF_FLOW_SCHEMA_UID),
            Some(schema_uid.as_str()),
            "{headers:?}"
        );
        assert_eq!(
            header(answer, PF_PRIORITY_LEVEL_UID),
            Some(level_uid.as_str()),
            "{headers:?}"
        );
        let retry_after = header(answer, "retry-after").and_then(|v| v.parse::<u64>().ok());
        assert!(retry_after.is_some_and(|s| s >= 1), "{headers:?}");
        // APF answers in plain text, where Bulwark's own refusals are a JSON Status.
        let body = String::from_utf8_lossy(&answer.body);
        assert!(body.starts_with("Too many requests"), "{body}");
        assert!(
            header(answer, "content-type").is_some_and(|t| t.starts_with("text/plain")),
            "{headers:?}"
        );
    }
    assert!(innocent_failures.is_empty(), "{innocent_failures:#?}");
    assert!(innocent_ok.load(Ordering::Relaxed) > 0);
    assert!(
        seen_bad.is_empty(),
        "Bulwark throttled or ejected a replica for APF's 429s: {seen_bad:?}"
    );
    let after = replicas(bulwark_admin).await;
    assert_eq!(after, before);
    let (_, metrics) = admin(bulwark_admin, "/metrics").await;
    let healthy = samples(&metrics, "bulwark_upstream_healthy", "replica=");
    assert_eq!(healthy, [1.0, 1.0], "{metrics}");
    let upstream_4xx: f64 = samples(
        &metrics,
        "bulwark_upstream_responses_total",
        "code_class=\"4xx\"",
    )
    .iter()
    .sum();
    assert!(upstream_4xx >= rejected.len() as f64, "{metrics}");

    cp.stop().await.unwrap();
    eprintln!("whole test: {:.1} s", began.elapsed().as_secs_f64());
}
