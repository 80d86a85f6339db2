//! From shadow to enforce: traffic recorded in Bulwark's access log over real TLS (a
//! logging DaemonSet's bound tokens on five nodes, kubelets, a person, and a tenant's
//! operator storming every namespace's Secrets), `bulwark rules suggest` from it,
//! `bulwark rules check` of the folder it writes, and `bulwark rules replay` of the same
//! recording against it: the cluster's own clients refused never, the storm refused.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use bulwark_sim::{Fleet, Pki, SimConfig, StaticToken};
use bulwark_testkit::{Cluster, Setup, fleet_config, get, grant, with_token};

const AGENT: &str = "system:serviceaccount:logging:fluent-bit";
const STORM: &str = "system:serviceaccount:tenant-1:secret-reader";

/// The rules in force while recording: the storm's cluster-wide lists at 1/s, as shipped.
const RULES: &str = r#"
levels:
  - {name: agents, seats: 10, queues: 16, handSize: 4, queueLength: 50, maxWait: 5s}
  - {name: heavy, seats: 2, queues: 8, handSize: 2, queueLength: 10, maxWait: 5s}
rules:
  - name: agents
    precedence: 100
    match: {serviceAccounts: [logging/*]}
    level: agents
    flow: node
  - name: secret-lists
    precedence: 800
    match: {verbs: [list, watch], resources: [{group: "", resource: secrets}], namespaces: [""]}
    level: heavy
    rate: {qps: 1, burst: 2}
"#;

/// A bound ServiceAccount token of `user` for a pod on `node`.
fn token(name: &str, user: &str, node: &str, pod_uid: &str) -> StaticToken {
    let claims = [
        ("authentication.kubernetes.io/node-name", node),
        ("authentication.kubernetes.io/pod-uid", pod_uid),
        ("authentication.kubernetes.io/pod-name", name),
    ];
    StaticToken {
        token: format!("tok-{name}"),
        user: user.into(),
        groups: vec!["system:serviceaccounts".into()],
        extra: claims
            .into_iter()
            .map(|(k, v)| (k.to_owned(), vec![v.to_owned()]))
            .collect::<BTreeMap<_, _>>(),
        ..StaticToken::default()
    }
}

fn bulwark(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(args)
        .output()
        .expect("bulwark runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fleet with the agents' and the storm's bound tokens, and Bulwark in front under
/// `RULES`, writing every request to the access log at `log`.
async fn recording_cluster(log: &Path) -> Cluster {
    let pki = Arc::new(Pki::new());
    let mut policy = bulwark_testkit::policy();
    policy.rules.push(grant(
        &[AGENT, STORM, "alice"],
        &["system:nodes"],
        &["get", "list", "watch"],
        &["secrets"],
    ));
    let mut tokens: Vec<StaticToken> = (1..=5)
        .map(|n| {
            token(
                &format!("fluent-bit-{n}"),
                AGENT,
                &format!("node-{n}"),
                &format!("00000000-0000-4000-8000-00000000000{n}"),
            )
        })
        .collect();
    tokens.push(token(
        "reader",
        STORM,
        "node-1",
        "00000000-0000-4000-8000-0000000000aa",
    ));
    let fleet = Fleet::start(SimConfig {
        seed: vec!["secrets=4x1KiB@default".parse().expect("seed")],
        tokens,
        ..fleet_config(pki.clone(), 1, policy)
    })
    .await
    .expect("simulator starts");
    let setting: &'static str =
        Box::leak(format!("{{path: {}, sample: 1.0}}", log.display()).into_boxed_str());
    Cluster::in_front_of(
        fleet,
        pki,
        Setup {
            rules: RULES,
            settings: vec![("accessLog", setting)],
            ..super::setup()
        },
    )
    .await
    .ready()
    .await
}

/// The traffic recorded: each node's agent holds a watch of its namespace's Secrets and
/// reads them five times a second; each kubelet reads one Secret as often; a person lists
/// now and then; the storm lists every namespace's Secrets six times a tick, and is
/// refused under `RULES`. Returns once every watch's end is in the log.
async fn record_traffic(cluster: &Cluster, log: &Path) {
    let mut watches = Vec::new();
    let mut agents = Vec::new();
    for n in 1..=5 {
        let mut client = cluster.anonymous_client().await;
        let response = client
            .start(with_token(
                get("/api/v1/namespaces/default/secrets?watch=true"),
                &format!("tok-fluent-bit-{n}"),
            ))
            .await;
        assert_eq!(response.status(), 200);
        watches.push(response);
        agents.push(client);
    }
    let mut kubelets = Vec::new();
    for n in 1..=3 {
        kubelets.push(
            cluster
                .client(&format!("system:node:node-{n}"), &["system:nodes"])
                .await,
        );
    }
    let mut alice = cluster.client("alice", &[]).await;
    let mut storm = cluster.anonymous_client().await;
    let mut storm_refused = 0;
    for tick in 0..20 {
        for (n, agent) in agents.iter_mut().enumerate() {
            let answer = agent
                .get_with_token(
                    "/api/v1/namespaces/default/secrets",
                    &format!("tok-fluent-bit-{}", n + 1),
                )
                .await;
            assert_eq!(answer.status, 200, "the agents are served while recorded");
        }
        for kubelet in &mut kubelets {
            let answer = kubelet.get("/api/v1/namespaces/default/secrets").await;
            assert_eq!(answer.status, 200);
        }
        if tick % 5 == 0 {
            assert_eq!(
                alice.get("/api/v1/namespaces/default/secrets").await.status,
                200
            );
        }
        // The storm: six cluster-wide lists a tick, whatever it is told.
        for _ in 0..6 {
            let answer = storm.get_with_token("/api/v1/secrets", "tok-reader").await;
            storm_refused += usize::from(answer.status == 429);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        storm_refused > 60,
        "the recording refused the storm: {storm_refused}"
    );
    // The watches end: each gets its second line.
    drop(watches);
    drop(agents);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ended = cluster
            .json_lines(log)
            .iter()
            .filter(|l| l["ended"] == true)
            .count();
        if ended == 5 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{ended} of 5 watch ends logged"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_suggested_from_recorded_traffic_refuse_the_storm_and_no_one_else() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.jsonl");
    let cluster = recording_cluster(&log).await;

    record_traffic(&cluster, &log).await;

    // Each admitted request's line says how long it held its seats, within its time to
    // head; a refusal's, which held none, does not.
    for line in cluster.json_lines(&log) {
        if line["ended"] == true {
            continue;
        }
        match line["heldSeconds"].as_f64() {
            Some(held) => assert!(
                line["code"] == 200 && held <= line["seconds"].as_f64().unwrap(),
                "{line}"
            ),
            None => assert_eq!(line["code"], 429, "{line}"),
        }
    }
    let out = dir.path().join("suggested");
    let (ok, stdout, stderr) = bulwark(&[
        "rules",
        "suggest",
        "--access-log",
        log.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stdout}{stderr}");
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "cluster-wide-secret-lists.yaml",
            "kubelets.yaml",
            "levels.yaml",
            "logging-fluent-bit.yaml",
            "people.yaml"
        ],
        "{stdout}"
    );
    let agents_rule = std::fs::read_to_string(out.join("logging-fluent-bit.yaml")).unwrap();
    for expected in [
        "serviceAccounts: [logging/fluent-bit]",
        "level: node-agents",
        "flow: node",
        "watches: 2",
        "mode: shadow",
        "# The most watches one flow (node:node-",
    ] {
        assert!(agents_rule.contains(expected), "{expected}:\n{agents_rule}");
    }
    let (ok, stdout, stderr) = bulwark(&["rules", "check", out.to_str().unwrap()]);
    assert!(ok, "the suggestion passes rules check: {stdout}{stderr}");

    let (ok, stdout, stderr) = bulwark(&[
        "rules",
        "replay",
        "--access-log",
        log.to_str().unwrap(),
        "--rules",
        out.to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert!(ok, "{stderr}");
    let replay: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let refused = |user: &str| -> u64 {
        replay["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["user"].as_str().unwrap().starts_with(user))
            .flat_map(|r| r["refused"].as_object().unwrap().values())
            .map(|v| v.as_u64().unwrap())
            .sum()
    };
    for user in [AGENT, "system:node:", "alice"] {
        assert_eq!(refused(user), 0, "{user} is never refused: {stdout}");
    }
    assert!(
        refused(STORM) >= 40,
        "the storm is refused again under the suggestion: {stdout}"
    );
    let (ok, table, _) = bulwark(&[
        "rules",
        "replay",
        "--access-log",
        log.to_str().unwrap(),
        "--rules",
        out.to_str().unwrap(),
    ]);
    assert!(ok);
    eprintln!("{agents_rule}\n{table}");
    assert!(table.starts_with("RULE"), "{table}");
    assert!(table.contains("cluster-wide-secret-lists"), "{table}");
}
