//! Rules and admission in the request path: every classified answer names its rule and
//! level, and a refusal says why, when to come back, and is counted.

use bulwark_testkit::{Cluster, Setup};

const RULES: &str = r#"
levels:
  - name: tight
    seats: 1
    queues: 4
    handSize: 2
    queueLength: 1
    maxWait: 200ms
rules:
  - name: alice-limited
    precedence: 100
    match:
      users: ["alice"]
    level: tight
    flow: user
    rate: {qps: 1, burst: 2}
  - name: everyone-else
    precedence: 200
    match:
      groups: ["system:authenticated"]
    level: exempt
"#;

const SECRETS: &str = "/api/v1/namespaces/default/secrets";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_flow_gets_429_with_retry_after_rule_and_level_while_others_pass() {
    // Every answer names its rule, so that the 200s show which rule let them in.
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: RULES,
        settings: vec![("rules.answerHeaders", "every")],
        ..super::setup()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let mut statuses = Vec::new();
    let mut refused = None;
    for _ in 0..5 {
        let answer = alice.get(SECRETS).await;
        assert_eq!(answer.headers["x-bulwark-rule"], "alice-limited");
        assert_eq!(answer.headers["x-bulwark-level"], "tight");
        statuses.push(answer.status.as_u16());
        if answer.status == 429 {
            refused = Some(answer);
        }
    }
    assert_eq!(&statuses[..2], [200, 200], "the burst passes: {statuses:?}");
    assert!(statuses[2..].iter().all(|s| *s == 429), "{statuses:?}");
    let refused = refused.unwrap();
    assert_eq!(
        refused.headers["retry-after"], "1",
        "an innocent flow's first 429 says 1 s"
    );
    assert_eq!(refused.headers["x-bulwark-reason"], "rate_limited");
    let status = refused.json();
    assert_eq!(status["reason"], "TooManyRequests");
    assert!(status["details"]["retryAfterSeconds"].as_u64().unwrap() >= 1);
    let message = status["message"].as_str().unwrap();
    assert!(
        message.contains("alice-limited")
            && message.contains("tight")
            && message.contains("rate_limited"),
        "{message}"
    );

    // Another identity is not touched by alice's limit.
    let mut carol = cluster.client("carol", &[]).await;
    for _ in 0..5 {
        let answer = carol.get(SECRETS).await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.headers["x-bulwark-rule"], "everyone-else");
    }

    let (_, metrics) = cluster.admin_get("/metrics").await;
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("bulwark_rejected_requests_total")
                && l.contains(r#"rule="alice-limited""#)
                && l.contains(r#"reason="rate_limited""#)
        })
        .unwrap_or_else(|| panic!("no rejection counted:\n{metrics}"));
    assert!(line.ends_with(" 3"), "{line}");
    assert!(metrics.contains(r#"bulwark_requests_total{code="429",resource="secrets",served_by="bulwark",verb="list"} 3"#), "{metrics}");
    // Every request is counted under its rule, the denominator of the rejection share.
    assert!(
        metrics.contains(r#"bulwark_rule_requests_total{level="tight",rule="alice-limited"} 5"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"bulwark_rule_requests_total{level="exempt",rule="everyone-else"} 5"#),
        "{metrics}"
    );

    let (status, levels) = cluster.admin_get("/debug/levels").await;
    assert!(status == 200 && levels.contains("\"tight\""), "{levels}");
    let (_, rules) = cluster.admin_get("/debug/rules").await;
    assert!(
        rules.contains("alice-limited") && rules.contains("hash"),
        "{rules}"
    );
}

/// `rules.mode: shadow` in Bulwark's configuration (a first install): the rule above says
/// nothing of a mode (so enforce), yet alice's requests over its rate are all served, each
/// counted as the refusal it would have been; with `rules.mode: enforce` the same requests
/// are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_mode_shadow_serves_what_an_enforced_rule_would_refuse_and_counts_it() {
    for mode in ["shadow", "enforce"] {
        let cluster = Cluster::start(Setup {
            replicas: 1,
            rules: RULES,
            settings: vec![("rules.mode", mode)],
            ..super::setup()
        })
        .await;
        let mut alice = cluster.client("alice", &[]).await;
        let mut statuses = Vec::new();
        for _ in 0..5 {
            let answer = alice.get(SECRETS).await;
            // By default only a refusal names its rule.
            let named = answer.headers.get("x-bulwark-rule");
            if answer.status == 429 {
                assert_eq!(named.unwrap(), "alice-limited");
            } else {
                assert_eq!(named, None, "a {} named its rule", answer.status);
            }
            statuses.push(answer.status.as_u16());
        }
        let metrics = cluster.metrics();
        let shadow = r#"bulwark_shadow_rejections_total{level="tight",reason="rate_limited",rule="alice-limited"} 3"#;
        let refused = r#"bulwark_rejected_requests_total{level="tight",reason="rate_limited",rule="alice-limited"} 3"#;
        if mode == "shadow" {
            assert_eq!(statuses, [200; 5], "{mode}");
            assert!(
                metrics.contains(shadow),
                "{mode}: {shadow} not in\n{metrics}"
            );
            assert!(
                !metrics.contains("bulwark_rejected_requests_total{"),
                "{mode}: nothing refused:\n{metrics}"
            );
        } else {
            assert_eq!(statuses, [200, 200, 429, 429, 429], "{mode}");
            assert!(
                metrics.contains(refused),
                "{mode}: {refused} not in\n{metrics}"
            );
            assert!(
                !metrics.contains("bulwark_shadow_rejections_total{"),
                "{mode}:\n{metrics}"
            );
        }
    }
}

/// client-go and kubectl accept gzip, and the apiserver compresses every list over
/// 128 KiB: a LIST seen compressed teaches the cost model the JSON the apiserver built
/// (the gzip trailer's length), not the bytes on the wire, and a Table answer teaches it
/// nothing. Otherwise the byte budget that guards the apiserver's memory would let tens of
/// times more LISTs in at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_or_table_list_teaches_the_cost_model_the_json_the_apiserver_built() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["configmaps=100x100KiB@team"],
        rules: bulwark_testkit::ALICE_LISTS_RULES,
        ..super::setup()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let path = "/api/v1/namespaces/team/configmaps";
    let request = |accept: &str| {
        let mut request = bulwark_testkit::get(path);
        let headers = request.headers_mut();
        headers.insert("accept-encoding", "gzip".parse().unwrap());
        headers.insert("accept", accept.parse().unwrap());
        request
    };
    let table = alice
        .send(request("application/json;as=Table;v=v1;g=meta.k8s.io"))
        .await;
    assert_eq!(table.status, 200);
    let gzipped = alice.send(request("application/json")).await;
    assert_eq!(gzipped.status, 200);
    assert_eq!(gzipped.headers["content-encoding"], "gzip");
    let json = {
        use std::io::Read;
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&gzipped.body[..])
            .read_to_end(&mut out)
            .unwrap();
        out.len() as f64
    };
    let wire = gzipped.body.len() as f64;
    assert!(wire * 20.0 < json, "the list compresses: {wire} of {json}");
    // A second LIST of the scope, held unread: admission reserves what it learned.
    let unread = alice.start(bulwark_testkit::get(path)).await;
    assert_eq!(unread.status(), 200);
    let in_flight = cluster.list_bytes_in_flight();
    assert!(
        in_flight > 0.9 * json && in_flight < 1.1 * json,
        "in-flight LIST bytes {in_flight}: the JSON is {json} bytes, {wire} on the wire"
    );
    drop(unread);
}

/// Who is throttled, as the on-call sees it: `/debug/flows` lists the refused flow with its
/// rate and last refusal, `bulwark_identity_rejections_total` names it, and every answer,
/// refusals included, carries an `Audit-Id` (the client's own when it sent one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_throttled_identity_is_named_by_debug_flows_the_metric_and_every_answers_audit_id() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: RULES,
        settings: vec![("metrics.identities", "5")],
        ..super::setup()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let mut carol = cluster.client("carol", &[]).await;
    let mut audit_ids = std::collections::HashSet::new();
    let mut refused = 0;
    for _ in 0..6 {
        let answer = alice.get(SECRETS).await;
        refused += usize::from(answer.status == 429);
        audit_ids.insert(answer.headers["audit-id"].to_str().unwrap().to_owned());
        let answer = carol.get(SECRETS).await;
        assert_eq!(answer.status, 200);
        audit_ids.insert(answer.headers["audit-id"].to_str().unwrap().to_owned());
    }
    assert!(refused >= 3, "alice was refused {refused} times");
    assert_eq!(audit_ids.len(), 12, "every answer has its own Audit-Id");
    let mut given = bulwark_testkit::get(SECRETS);
    given
        .headers_mut()
        .insert("audit-id", "my-trace-0001".parse().unwrap());
    let answer = alice.send(given).await;
    assert_eq!(answer.status, 429);
    assert_eq!(answer.headers["audit-id"], "my-trace-0001");

    let (status, flows) = cluster.admin_get("/debug/flows").await;
    assert_eq!(status, 200, "{flows}");
    let flows: serde_json::Value = serde_json::from_str(&flows).unwrap();
    let throttled = &flows["mostRefused"][0];
    assert_eq!(throttled["identity"], "alice", "{flows:#}");
    assert_eq!(throttled["rule"], "alice-limited");
    assert_eq!(throttled["level"], "tight");
    assert!(throttled["refusedPerSecond"].as_f64().unwrap() > 0.0);
    let last = &throttled["lastRefusal"];
    assert_eq!(last["reason"], "rate_limited");
    assert_eq!(last["verb"], "list");
    assert_eq!(last["resource"], "secrets");
    assert_eq!(last["namespace"], "default");
    assert_eq!(last["auditId"], "my-trace-0001");
    let busiest: Vec<&str> = flows["busiest"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["identity"].as_str().unwrap())
        .collect();
    assert!(
        busiest.contains(&"carol") && busiest.contains(&"alice"),
        "{busiest:?}"
    );

    let metrics = cluster.metrics();
    let named = format!(
        r#"bulwark_identity_rejections_total{{identity="alice",reason="rate_limited"}} {}"#,
        refused + 1
    );
    assert!(metrics.contains(&named), "{named} not in\n{metrics}");
    assert!(
        !metrics.contains(r#"identity="carol""#),
        "carol was never refused"
    );
}

/// The access log has one line per request, refusals included, each with the `Audit-Id` its
/// answer carried, who asked, what, and the rule, level and reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_a_line_per_request_with_its_audit_id_rule_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.jsonl");
    let setting: &'static str = Box::leak(format!("{{path: {}}}", path.display()).into_boxed_str());
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: RULES,
        settings: vec![("accessLog", setting)],
        ..super::setup()
    })
    .await;
    let mut alice = cluster.client("alice", &[]).await;
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(alice.get(SECRETS).await);
    }
    let lines = cluster.json_lines(&path);
    assert_eq!(lines.len(), 4, "{lines:#?}");
    for (line, answer) in lines.iter().zip(&answers) {
        assert_eq!(
            line["auditId"],
            answer.headers["audit-id"].to_str().unwrap()
        );
        assert_eq!(line["code"], answer.status.as_u16());
        assert_eq!(line["user"], "alice");
        assert_eq!(line["verb"], "list");
        assert_eq!(line["resource"], "secrets");
        assert_eq!(line["namespace"], "default");
        assert_eq!(line["rule"], "alice-limited");
        assert_eq!(line["level"], "tight");
        assert!(line["source"].as_str().unwrap().starts_with("127.0.0.1:"));
    }
    let refused: Vec<_> = lines.iter().filter(|l| l["code"] == 429).collect();
    assert_eq!(refused.len(), 2, "{lines:#?}");
    assert!(
        refused
            .iter()
            .all(|l| l["reason"] == "rate_limited" && l["servedBy"] == "bulwark")
    );
    assert!(lines[0]["reason"].is_null() && lines[0]["servedBy"] == "upstream");
}

/// The one rejection counted for `rule` with `reason`, from the admin `/metrics`.
async fn rejections(cluster: &Cluster, rule: &str, reason: &str) -> String {
    let (_, metrics) = cluster.admin_get("/metrics").await;
    metrics
        .lines()
        .find(|l| {
            l.starts_with("bulwark_rejected_requests_total")
                && l.contains(&format!(r#"rule="{rule}""#))
                && l.contains(&format!(r#"reason="{reason}""#))
        })
        .unwrap_or_else(|| panic!("no {reason} rejection counted for {rule}:\n{metrics}"))
        .to_owned()
}

/// A refusal after admission — the apiservers cannot be reached — names the rule and level
/// that admitted the request, as its answer would have, and is counted with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_after_admission_names_its_rule_and_level_and_is_counted_with_them() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: RULES,
        ..super::setup()
    })
    .await;
    let mut carol = cluster.client("carol", &[]).await;
    assert_eq!(carol.get(SECRETS).await.status, 200);
    cluster.fleet.replica(0).stop().await;
    let refused = carol.get(SECRETS).await;
    assert!(
        [502, 503].contains(&refused.status.as_u16()),
        "{}: {}",
        refused.status,
        refused.text()
    );
    let reason = refused.headers["x-bulwark-reason"].to_str().unwrap();
    assert!(
        ["upstream_error", "no_healthy_upstream"].contains(&reason),
        "{reason}"
    );
    assert_eq!(refused.headers["x-bulwark-rule"], "everyone-else");
    assert_eq!(refused.headers["x-bulwark-level"], "exempt");
    let message = refused.json()["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("everyone-else") && message.contains("exempt"),
        "{message}"
    );
    let line = rejections(&cluster, "everyone-else", reason).await;
    assert!(
        line.contains(r#"level="exempt""#) && line.ends_with(" 1"),
        "{line}"
    );
}

/// A body the request-body budget has no room for is refused after admission (429
/// `body_budget`), with the rule and level that admitted it, and counted with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_budget_gets_429_with_its_rule_and_level_and_is_counted_with_them() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: RULES,
        settings: vec![
            ("listen.limits.maxBodyBytes", "4096"),
            ("listen.limits.bufferedBodyBytesPerFlow", "4Ki"),
            ("listen.limits.bufferedBodyBytes", "4Ki"),
        ],
        ..super::setup()
    })
    .await;
    let put = || {
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "held", "namespace": "default"},
            "data": {"k": "x".repeat(3000)},
        });
        http::Request::put("https://127.0.0.1/api/v1/namespaces/default/configmaps/held")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap()
    };
    // The first body is held while the apiserver takes its time; the second finds no room.
    cluster
        .fleet
        .replica(0)
        .set_delay(std::time::Duration::from_secs(2));
    let mut first = cluster.client("carol", &[]).await;
    let held = tokio::spawn(async move { first.send(put()).await.status });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut carol = cluster.client("carol", &[]).await;
    let refused = carol.send(put()).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.headers["x-bulwark-reason"], "body_budget");
    assert_eq!(refused.headers["x-bulwark-rule"], "everyone-else");
    assert_eq!(refused.headers["x-bulwark-level"], "exempt");
    assert!(refused.headers.contains_key("retry-after"));
    let line = rejections(&cluster, "everyone-else", "body_budget").await;
    assert!(
        line.contains(r#"level="exempt""#) && line.ends_with(" 1"),
        "{line}"
    );
    assert_ne!(held.await.unwrap(), 429, "the first body had room");
}
