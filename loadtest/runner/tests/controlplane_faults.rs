//! Faults against a real control plane (etcd and a kube-apiserver built from Kubernetes'
//! own Go modules) with Bulwark in front as its own process, each section stating what a
//! user observes:
//!
//! 1. broken rule files dropped into the live folder: the old rules keep serving, the
//!    failed reloads are counted, and a fixed file is picked up;
//! 2. HTTP/2 SETTINGS, PING and WINDOW_UPDATE floods: Bulwark's memory and CPU stay
//!    bounded and an innocent client is served throughout;
//! 3. zero-window readers of a large LIST and of a watch, and slow readers of both: memory
//!    stays bounded, flow control is honoured, innocent clients are served;
//! 4. slow request bodies: memory stays bounded and a client of another level is served
//!    (the slow bodies hold their own level's seats while they arrive, as in the
//!    apiserver's API Priority and Fairness);
//! 5. etcd frozen for 15 s: writes and consistent reads get the apiserver's own answers
//!    within their timeouts, cached reads keep being served, and afterwards the cache
//!    catches up without a relist storm;
//! 6. a cached LIST read twice by a gzip-accepting client decodes both times (a reused
//!    small answer was once labelled gzip while plain).
//!
//! Each test starts its own control plane of one replica (a few seconds), so that one
//! fault's traces cannot blur another's figures. Bulwark's figures are the operating
//! system's (`/proc/PID/status` and `/proc/PID/stat`). Without the binaries the control
//! plane builds them (`loadtest/controlplane/build.sh`, Go 1.26) or fails: these tests
//! never skip.

use std::future::Future;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{ControlPlane, NAMESPACES, Options, SECRETS_PER_NAMESPACE};
use bulwark_loadtest::proxy_process::write_shipped_rules;
use futures::StreamExt as _;
use http_body_util::BodyExt as _;
use kube::Client;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpSocket;
use tokio_rustls::client::TlsStream;

/// The namespace of the large collection.
const NAMESPACE: &str = "faults";
/// ConfigMaps there, and bytes in each: a LIST (or a watch from resourceVersion 0) of
/// about 10 MB, ten times Bulwark's upstream stream window.
const CONFIGMAPS: usize = 300;
const CONFIGMAP_BYTES: usize = 32 * 1024;
/// Most Bulwark's resident memory may grow above its level before a fault, while it
/// lasts. The 16 slow or zero-window readers below would hold over 150 MB if Bulwark
/// buffered their answers; held to the upstream window of each stream (1 MiB) they hold
/// about 40 MB.
const RSS_GROWTH_BOUND: u64 = 64 << 20;
/// Most CPU Bulwark may spend on one flooding connection, in cores: one connection is one
/// task, so a flood must never spread over more than the core it runs on.
const FLOOD_CPU_BOUND: f64 = 1.2;
/// Longest an innocent client's request may take while a fault goes on.
const INNOCENT_LATENCY_BOUND: Duration = Duration::from_secs(5);
/// How long each fault goes on.
const FLOOD_FOR: Duration = Duration::from_secs(5);
const SLOW_FOR: Duration = Duration::from_secs(6);
const FREEZE_FOR: Duration = Duration::from_secs(15);
/// The `timeout` a client asks the apiserver for while etcd is frozen.
const APISERVER_TIMEOUT_S: u64 = 4;

// HTTP/2 frame types, flags and settings (RFC 9113).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const DATA: u8 = 0x0;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const SETTINGS_ENABLE_PUSH: u16 = 0x2;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;
/// HPACK static table: `:status: 200`, as the first byte of an answer's header block.
const STATUS_200: u8 = 0x88;

/// A control plane of one replica with Bulwark in front (its rules in `rules`, the shipped
/// ones and the loadtest's own unless given), and the `direct-admin` client; with `configmaps`, the large
/// collection seeded.
async fn start(dir: &Path, rules: Option<PathBuf>, configmaps: bool) -> (ControlPlane, Client) {
    let began = Instant::now();
    let mut opts = Options::new(dir.join("cp"));
    opts.replicas = 1;
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    opts.rules = rules;
    // These tests count the apiserver's LISTs and WATCHes of EndpointSlices to see the
    // cache's relists: the fleet's reads of the `kubernetes` Service's slices would count
    // with them (controlplane_incluster.rs tests those).
    opts.kubernetes_service = false;
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    let direct = cp.client("direct-admin").await.unwrap();
    if configmaps {
        seed_configmaps(&direct).await;
    }
    eprintln!(
        "control plane ready{} in {:.1} s",
        if configmaps { " and seeded" } else { "" },
        began.elapsed().as_secs_f64()
    );
    (cp, direct)
}

/// The operator's cluster-wide Secret lists are limited by the shipped
/// `cluster-wide-secret-lists` rule (1 per second, burst 2) and the admin is exempt
/// (`cluster-admins`). A file of invalid YAML, then one of valid YAML naming a level
/// that does not exist, are dropped into the live folder: each reload fails and is
/// counted in `bulwark_rules_reload_total{result="error"}`, and both clients are treated
/// exactly as before. A fixed file (the operator exempt) is then picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_rule_files_leave_the_old_rules_serving() {
    let dir = tempfile::tempdir().unwrap();
    let rules = write_shipped_rules(&dir.path().join("rules")).unwrap();
    let (cp, _) = start(dir.path(), Some(rules.clone()), false).await;
    let cp = &cp;
    let operator = cp.client_without_retries("operator").await.unwrap();
    let admin = cp.client_without_retries("admin").await.unwrap();
    let lists = "/api/v1/secrets?resourceVersion=0";
    let assert_old_rules = |when: &'static str| {
        let operator = operator.clone();
        let admin = admin.clone();
        async move {
            let statuses = burst(&operator, lists, 6).await;
            assert!(
                statuses.iter().any(|s| s == "429 rate_limited"),
                "{when}: the operator's burst of 6 cluster-wide Secret lists is still limited: \
                 {statuses:?}"
            );
            let statuses = burst(&admin, lists, 6).await;
            assert!(
                statuses.iter().all(|s| s == "200"),
                "{when}: the admin is still exempt: {statuses:?}"
            );
        }
    };
    assert_old_rules("before").await;

    let file = rules.join("zz-dropped.yaml");
    let errors = reloads(cp, "error").await;
    std::fs::write(&file, "rules:\n  - name: [unclosed\n    level: exempt\n").unwrap();
    wait_for_reloads(cp, "error", errors + 1.0).await;
    assert_old_rules("after a file of invalid YAML").await;

    let errors = reloads(cp, "error").await;
    std::fs::write(
        &file,
        "rules:\n  - name: operator-secret-lists\n    precedence: 700\n    match:\n      \
         users: [operator]\n      verbs: [list]\n      resources: [{group: \"\", resource: \
         secrets}]\n      namespaces: [\"\"]\n    level: no-such-level\n    flow: user\n",
    )
    .unwrap();
    wait_for_reloads(cp, "error", errors + 1.0).await;
    assert_old_rules("after a rule naming a level that does not exist").await;

    let successes = reloads(cp, "success").await;
    std::fs::write(
        &file,
        "rules:\n  - name: operator-secret-lists\n    precedence: 700\n    match:\n      \
         users: [operator]\n      verbs: [list]\n      resources: [{group: \"\", resource: \
         secrets}]\n      namespaces: [\"\"]\n    level: exempt\n    flow: user\n",
    )
    .unwrap();
    wait_for_reloads(cp, "success", successes + 1.0).await;
    // The new rule may reach the running set a moment after the reload is counted.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let statuses = burst(&operator, lists, 6).await;
        if statuses.iter().all(|s| s == "200") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fixed file exempts the operator: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let successes = reloads(cp, "success").await;
    std::fs::remove_file(&file).unwrap();
    wait_for_reloads(cp, "success", successes + 1.0).await;
}

/// Four floods, one after the other, each from one authenticated HTTP/2
/// connection, for [`FLOOD_FOR`] each: SETTINGS, PING and WINDOW_UPDATE frames from a
/// client that reads whatever Bulwark answers (the costliest kind: every acknowledgement
/// is written), then PING frames from one that never reads its acknowledgements. Bulwark's resident memory grows by less than
/// [`RSS_GROWTH_BOUND`], it spends at most [`FLOOD_CPU_BOUND`] cores, and an innocent
/// client's GETs all succeed within [`INNOCENT_LATENCY_BOUND`] meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_floods_cost_bounded_memory_and_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = start(dir.path(), None, true).await;
    let cp = &cp;
    let pid = cp.bulwark_pid().expect("Bulwark runs");
    let innocent = cp.client_without_retries("operator").await.unwrap();
    let ping = frame(PING, 0, 0, b"floodme!");
    let floods: [(&str, Vec<u8>, bool); 4] = [
        (
            "SETTINGS",
            frame(SETTINGS, 0, 0, &settings_payload(&[(0x3, 100)])),
            true,
        ),
        ("PING", ping.clone(), true),
        (
            "WINDOW_UPDATE",
            frame(WINDOW_UPDATE, 0, 0, &1u32.to_be_bytes()),
            true,
        ),
        // Its acknowledgements pile up unread: Bulwark must stop reading, not queue them.
        ("PING (never reading)", ping, false),
    ];
    for (name, one, reads) in floods {
        let rss_before = rss(pid);
        let cpu_before = cpu_seconds(pid);
        let start = Instant::now();
        let (report, peak, served) = tokio::join!(
            flood(cp, &one, FLOOD_FOR, reads),
            peak_rss(pid, FLOOD_FOR),
            innocent_gets(&innocent, FLOOD_FOR),
        );
        let cores = (cpu_seconds(pid) - cpu_before) / start.elapsed().as_secs_f64();
        let growth = peak.saturating_sub(rss_before);
        eprintln!(
            "{name} flood: {} frames sent, {} acknowledgements read, closed by Bulwark: {}; \
             Bulwark RSS {} → peak {} (+{}), {cores:.2} cores; innocent: {served}",
            report.frames,
            report.acks,
            report.closed,
            mib(rss_before),
            mib(peak),
            mib(growth),
        );
        assert!(report.frames > 10_000, "{name}: the flood did flood");
        assert!(
            growth < RSS_GROWTH_BOUND,
            "{name} flood: Bulwark's RSS grew by {}",
            mib(growth)
        );
        assert!(
            cores < FLOOD_CPU_BOUND,
            "{name} flood: Bulwark used {cores:.2} cores"
        );
        served.assert_all_served(name);
    }
}

/// Clients that set `SETTINGS_INITIAL_WINDOW_SIZE` to 0 and never open a
/// window: 8 LISTs of the 10 MB collection on one connection and 8 watches from
/// resourceVersion 0 (the same bytes as initial events) on another. Each stream gets its
/// answer's head and not one byte of body (Bulwark honours the windows), Bulwark's
/// resident memory grows by less than [`RSS_GROWTH_BOUND`] (the answers are over 150 MB
/// together), and an innocent client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_window_readers_hold_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = start(dir.path(), None, true).await;
    let cp = &cp;
    let pid = cp.bulwark_pid().expect("Bulwark runs");
    let innocent = cp.client_without_retries("operator").await.unwrap();
    let lists: Vec<String> = (0..8)
        .map(|_| format!("/api/v1/namespaces/{NAMESPACE}/configmaps"))
        .collect();
    let watches: Vec<String> = (0..8)
        .map(|_| format!("/api/v1/namespaces/{NAMESPACE}/configmaps?watch=1&resourceVersion=0"))
        .collect();
    let rss_before = rss(pid);
    let (list_report, watch_report, peak, served) = tokio::join!(
        zero_window(cp, &lists, SLOW_FOR),
        zero_window(cp, &watches, SLOW_FOR),
        peak_rss(pid, SLOW_FOR),
        innocent_gets(&innocent, SLOW_FOR),
    );
    let growth = peak.saturating_sub(rss_before);
    eprintln!(
        "zero-window readers: LISTs {list_report:?}, watches {watch_report:?}; Bulwark RSS {} → \
         peak {} (+{}); innocent: {served}",
        mib(rss_before),
        mib(peak),
        mib(growth)
    );
    for (what, report, wanted) in [
        ("LIST", &list_report, lists.len()),
        ("watch", &watch_report, watches.len()),
    ] {
        assert_eq!(
            report.answered, wanted,
            "every zero-window {what} got its 200 head: {report:?}"
        );
        assert_eq!(
            report.data_bytes, 0,
            "no body byte past a zero window ({what}): {report:?}"
        );
        assert!(!report.goaway, "the {what} connection was not sent away");
    }
    assert!(
        growth < RSS_GROWTH_BOUND,
        "zero-window readers: Bulwark's RSS grew by {}",
        mib(growth)
    );
    served.assert_all_served("zero-window readers");
}

/// HTTP/1.1 clients with a 4 KiB receive buffer that read 1 KiB every 100 ms:
/// 8 of a LIST of the 10 MB collection, 8 of a watch from resourceVersion 0. Each is
/// served (a 200 head, then bytes as fast as it reads), Bulwark's resident memory grows by
/// less than [`RSS_GROWTH_BOUND`], and an innocent client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_hold_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = start(dir.path(), None, true).await;
    let cp = &cp;
    let pid = cp.bulwark_pid().expect("Bulwark runs");
    let innocent = cp.client_without_retries("operator").await.unwrap();
    let list = format!("/api/v1/namespaces/{NAMESPACE}/configmaps");
    let watch = format!("/api/v1/namespaces/{NAMESPACE}/configmaps?watch=1&resourceVersion=0");
    let readers = (0..16).map(|i| {
        let path = if i % 2 == 0 { &list } else { &watch };
        slow_reader(cp, path, SLOW_FOR)
    });
    let rss_before = rss(pid);
    let (read, peak, served) = tokio::join!(
        futures::future::join_all(readers),
        peak_rss(pid, SLOW_FOR),
        innocent_gets(&innocent, SLOW_FOR),
    );
    let growth = peak.saturating_sub(rss_before);
    let least = read.iter().map(|(_, n)| *n).min().unwrap_or(0);
    eprintln!(
        "slow readers: 16 read at least {least} bytes each; Bulwark RSS {} → peak {} (+{}); \
         innocent: {served}",
        mib(rss_before),
        mib(peak),
        mib(growth)
    );
    for (head, bytes) in &read {
        assert!(
            head.starts_with("HTTP/1.1 200"),
            "a slow reader's answer: {head}"
        );
        // 1 KiB per 100 ms for the whole time, less the start: at least half of it.
        assert!(
            *bytes >= 1024 * 10 * SLOW_FOR.as_secs() / 2,
            "a slow reader was served as fast as it reads: {bytes} bytes"
        );
    }
    assert!(
        growth < RSS_GROWTH_BOUND,
        "slow readers: Bulwark's RSS grew by {}",
        mib(growth)
    );
    served.assert_all_served("slow readers");
}

/// One user (matched by the catch-all rule, like most unknown clients) starts 20 POSTs
/// that each declare a 2 MiB body and send a byte a second. An innocent client of another
/// level (the admin) is served within [`INNOCENT_LATENCY_BOUND`] meanwhile; Bulwark's
/// resident memory grows by less than [`RSS_GROWTH_BOUND`] (a body is read only once its
/// request is admitted, and then within the body budget); and once the slow bodies are gone
/// their user may send again.
///
/// What this does not hold: a request keeps its seat in its priority level while its body
/// arrives, as the apiserver's API Priority and Fairness (which admits before the handler
/// reads the body) keeps its seat, so the slow bodies hold the catch-all level's seats for
/// as long as they take (at most the write timeout) and its other requests queue meanwhile.
/// The figures are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_hold_bounded_memory_and_leave_other_levels_served() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = start(dir.path(), None, true).await;
    let cp = &cp;
    const SLOW: usize = 20;
    const DECLARED: usize = 2 << 20;
    let pid = cp.bulwark_pid().expect("Bulwark runs");
    let innocent = cp.client_without_retries("admin").await.unwrap();
    let rss_before = rss(pid);
    let bodies = (0..SLOW).map(|_| slow_body(cp, "trickler", DECLARED, SLOW_FOR));
    let level = async {
        tokio::time::sleep(SLOW_FOR / 2).await;
        let catch_all = ["level=\"catch-all\""];
        (
            bulwark_sum(cp, "bulwark_level_executing_seats{", &catch_all).await,
            bulwark_sum(cp, "bulwark_level_waiting_requests{", &catch_all).await,
        )
    };
    let (answers, peak, served, (seats, waiting)) = tokio::join!(
        futures::future::join_all(bodies),
        peak_rss(pid, SLOW_FOR),
        innocent_gets(&innocent, SLOW_FOR),
        level,
    );
    let growth = peak.saturating_sub(rss_before);
    let refused: Vec<&(String, Duration)> = answers.iter().flatten().collect();
    eprintln!(
        "slow bodies: {} of {SLOW} answered before their body ended: {refused:?}; midway the \
         catch-all level had {seats} seats executing and {waiting} requests waiting; Bulwark \
         RSS {} → peak {} (+{}); innocent: {served}",
        refused.len(),
        mib(rss_before),
        mib(peak),
        mib(growth)
    );
    served.assert_all_served("slow bodies");
    assert!(
        growth < RSS_GROWTH_BOUND,
        "slow bodies: Bulwark's RSS grew by {}",
        mib(growth)
    );

    // The slow bodies' connections are closed: their budget is free again.
    let trickler = raw_client(cp, "trickler").await;
    let body =
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "after-trickle"}});
    let (status, reason) = send(
        &trickler,
        http::Method::POST,
        &format!("/api/v1/namespaces/{NAMESPACE}/configmaps"),
        Some(&body),
    )
    .await
    .map(|a| (a.status, a.bulwark_reason))
    .unwrap();
    // `trickler` may not create ConfigMaps: the apiserver's 403 says the body went through.
    assert_eq!(
        (status, reason.as_deref()),
        (403, None),
        "the budget came back"
    );
}

/// etcd is stopped (SIGSTOP) for [`FREEZE_FOR`], then continued. Meanwhile a
/// write and a consistent read, each asking the apiserver for a 4 s `timeout`, get the
/// apiserver's own answer (its 504 timeout `Status`, no `X-Bulwark-Reason`; for the read,
/// Bulwark's 504 where the apiserver reset the stream at the timeout instead) within 10 s,
/// not a hang; cached
/// reads (Secrets at resourceVersion 0) keep being answered 200 by Bulwark's cache. Afterwards
/// a Secret written straight to the apiserver reaches Bulwark's cache within 30 s,
/// `bulwark_cache_relists_total` rises by at most one per cached resource, and the
/// apiserver counts at most two LIST or WATCH requests per cached resource (a relist and a
/// resumed watch).
// Over 120 lines: the freeze, the outage and the recovery in order, each phase asserting on
// what the one before left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_frozen_for_15_s() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, direct) = start(dir.path(), None, true).await;
    let (cp, direct) = (&cp, &direct);
    let admin = cp.client_without_retries("admin").await.unwrap();
    let operator = cp.client_without_retries("operator").await.unwrap();
    // Single Secrets: each read is its own object (`cached_lists_keep_their_encoding`
    // covers whole LISTs read twice).
    let cached = |i: usize| {
        format!(
            "/api/v1/namespaces/{}/secrets/secret-{}?resourceVersion=0",
            NAMESPACES[0],
            i % SECRETS_PER_NAMESPACE
        )
    };
    // Warm up the cache's access reviews, so that the reads below need nothing upstream
    // but the reviews the apiserver answers without etcd.
    for i in 0..SECRETS_PER_NAMESPACE {
        let secret: Value =
            serde_json::from_str(&operator.request_text(get(&cached(i))).await.unwrap()).unwrap();
        assert_eq!(secret["kind"], "Secret");
    }
    let relists_before = bulwark_samples(cp, "bulwark_cache_relists_total{").await;
    let lists_before = apiserver_lists(direct).await;
    let cache_served_before = bulwark_sum(
        cp,
        "bulwark_requests_total{",
        &["served_by=\"cache\"", "code=\"200\""],
    )
    .await;

    let pid = cp.etcd_pid().expect("etcd runs");
    let frozen = Frozen::stop(pid);
    let frozen_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let write_body =
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "while-frozen"}});
    let write_path =
        format!("/api/v1/namespaces/{NAMESPACE}/configmaps?timeout={APISERVER_TIMEOUT_S}s");
    let read_path =
        format!("/api/v1/namespaces/{NAMESPACE}/configmaps?limit=1&timeout={APISERVER_TIMEOUT_S}s");
    let write = timed(send(
        &admin,
        http::Method::POST,
        &write_path,
        Some(&write_body),
    ));
    let read = timed(send(&admin, http::Method::GET, &read_path, None));
    let cached_reads = async {
        let mut statuses = Vec::new();
        while frozen_at.elapsed() < FREEZE_FOR - Duration::from_secs(1) {
            let began = Instant::now();
            let status = match operator.request_text(get(&cached(statuses.len()))).await {
                Ok(body) if body.contains("\"kind\":\"Secret\"") => "200".to_string(),
                Ok(body) => format!("200 but not a Secret: {body}"),
                Err(e) => e.to_string(),
            };
            statuses.push((status, began.elapsed()));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        statuses
    };
    let ((write, write_took), (read, read_took), cached_reads) =
        tokio::join!(write, read, cached_reads);
    let remaining = FREEZE_FOR.saturating_sub(frozen_at.elapsed());
    tokio::time::sleep(remaining).await;
    drop(frozen);
    let thawed_at = Instant::now();
    eprintln!(
        "etcd frozen: write {:?} in {write_took:?}, consistent read {:?} in {read_took:?}, {} \
         cached reads: {:?}",
        write.as_ref().map(Answer::summary),
        read.as_ref().map(Answer::summary),
        cached_reads.len(),
        cached_reads
    );
    for (what, answer, took) in [
        ("write", &write, write_took),
        ("consistent read", &read, read_took),
    ] {
        let answer = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("the {what} got no answer: {e}"));
        assert!(
            took < Duration::from_secs(APISERVER_TIMEOUT_S + 6),
            "the {what} was answered within its timeout, not after {took:?}"
        );
        assert!(
            answer.status >= 500,
            "the {what} failed while etcd was frozen: {}",
            answer.summary()
        );
        // The apiserver times a consistent read out either with its 504 Status or, when
        // the handler has begun, with a reset of the stream (INTERNAL_ERROR): past the
        // read's own `timeout` Bulwark answers that with its own 504, and sends nothing
        // again (a retry once made it take twice the timeout). A write always gets the
        // Status.
        let reset = what == "consistent read"
            && answer.status == 504
            && answer.bulwark_reason.as_deref() == Some("upstream_timeout");
        if !reset {
            assert_eq!(
                answer.bulwark_reason,
                None,
                "the {what}'s answer is the apiserver's own: {}",
                answer.summary()
            );
            assert_eq!(
                (answer.outcome.as_deref(), answer.reason.as_deref()),
                (Some("Failure"), Some("Timeout")),
                "the {what}'s answer is the apiserver's timeout Status: {}",
                answer.summary()
            );
        }
    }
    assert!(cached_reads.len() >= 10, "{cached_reads:?}");
    assert!(
        cached_reads
            .iter()
            .all(|(s, t)| s == "200" && *t < INNOCENT_LATENCY_BOUND),
        "every cached read was served while etcd was frozen: {cached_reads:?}"
    );
    let cache_served = bulwark_sum(
        cp,
        "bulwark_requests_total{",
        &["served_by=\"cache\"", "code=\"200\""],
    )
    .await;
    assert!(
        cache_served - cache_served_before >= cached_reads.len() as f64,
        "the cached reads came from Bulwark's cache"
    );

    // After: a Secret written straight to the apiserver reaches Bulwark's cache.
    let name = "after-the-freeze";
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}});
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let created = direct
            .request_text(
                http::Request::post(format!("/api/v1/namespaces/{}/secrets", NAMESPACES[0]))
                    .header("Content-Type", "application/json")
                    .body(secret.to_string().into_bytes())
                    .unwrap(),
            )
            .await;
        match created {
            Ok(_) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "the apiserver recovers: {e}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
    let path = format!(
        "/api/v1/namespaces/{}/secrets/{name}?resourceVersion=0",
        NAMESPACES[0]
    );
    loop {
        match operator.request_text(get(&path)).await {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "Bulwark's cache caught up after the freeze: {e}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
    let caught_up = thawed_at.elapsed();
    let relists_after = bulwark_samples(cp, "bulwark_cache_relists_total{").await;
    let lists_after = apiserver_lists(direct).await;
    eprintln!(
        "after the freeze: the cache caught up {caught_up:?} after SIGCONT; relists before \
         {relists_before:?} after {relists_after:?}; apiserver LISTs of cached resources \
         before {lists_before:?} after {lists_after:?}"
    );
    for (series, after) in &relists_after {
        let before = relists_before
            .iter()
            .find(|(s, _)| s == series)
            .map_or(0.0, |(_, v)| *v);
        assert!(
            after - before <= 1.0,
            "at most one relist of {series}: {before} → {after}"
        );
    }
    for (resource, after) in &lists_after {
        let before = lists_before
            .iter()
            .find(|(r, _)| r == resource)
            .map_or(0.0, |(_, v)| *v);
        assert!(
            after - before <= 2.0,
            "at most one relist and one resumed watch of {resource} reached the apiserver: \
             {before} → {after}"
        );
    }
}

/// A whole cached LIST (Secrets of one namespace at resourceVersion 0, about 25 KB, under
/// the 128 KiB above which the cache compresses) read twice by a client that accepts gzip,
/// as kube-rs, client-go and kubectl all do: both answers decode to the same list. (The
/// cache's reused LIST answers were once labelled with the encoding the client asked for,
/// not the one they were stored in: the second said `Content-Encoding: gzip` over plain
/// JSON and the client could not read it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_lists_keep_their_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = start(dir.path(), None, false).await;
    let operator = cp.client_without_retries("operator").await.unwrap();
    let path = format!(
        "/api/v1/namespaces/{}/secrets?resourceVersion=0",
        NAMESPACES[0]
    );
    let served_before = bulwark_sum(&cp, "bulwark_requests_total{", &["served_by=\"cache\""]).await;
    for read in ["first", "second", "third"] {
        let answer = send(&operator, http::Method::GET, &path, None)
            .await
            .unwrap();
        assert_eq!(
            (answer.status, answer.kind.as_deref()),
            (200, Some("SecretList")),
            "the {read} read: {}",
            answer.summary()
        );
    }
    let served = bulwark_sum(&cp, "bulwark_requests_total{", &["served_by=\"cache\""]).await;
    assert_eq!(served - served_before, 3.0, "the cache answered all three");
}

/// etcd stopped with SIGSTOP; dropping it continues etcd, so that a failed assertion
/// leaves nothing frozen.
struct Frozen(rustix::process::Pid);

impl Frozen {
    fn stop(pid: u32) -> Frozen {
        let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(self.0, rustix::process::Signal::CONT);
    }
}

/// 300 ConfigMaps of 8 KiB in [`NAMESPACE`].
async fn seed_configmaps(direct: &Client) {
    let namespace =
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}});
    direct
        .request_text(post("/api/v1/namespaces", &namespace))
        .await
        .unwrap();
    let filler = "x".repeat(CONFIGMAP_BYTES);
    let creates = (0..CONFIGMAPS).map(|i| {
        let body = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("cm-{i}")},
            "data": {"filler": filler},
        });
        let direct = direct.clone();
        async move {
            direct
                .request_text(post(
                    &format!("/api/v1/namespaces/{NAMESPACE}/configmaps"),
                    &body,
                ))
                .await
                .unwrap();
        }
    });
    futures::stream::iter(creates)
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
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

/// One answer: its status, Bulwark's reason if Bulwark answered by itself, and the
/// `kind` and `reason` of its body.
#[derive(Debug)]
struct Answer {
    status: u16,
    bulwark_reason: Option<String>,
    kind: Option<String>,
    /// The body's `status` (`Failure` in an error `Status`).
    outcome: Option<String>,
    reason: Option<String>,
    message: Option<String>,
}

impl Answer {
    fn summary(&self) -> String {
        format!(
            "{} (X-Bulwark-Reason {:?}) {:?} {:?} {:?}: {:?}",
            self.status, self.bulwark_reason, self.kind, self.outcome, self.reason, self.message
        )
    }
}

/// Sends `method path` with an optional JSON body and reads the whole answer; a body that
/// cannot be read is told in `message`.
async fn send(
    client: &Client,
    method: http::Method,
    path: &str,
    body: Option<&Value>,
) -> Result<Answer, String> {
    let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header("Content-Type", "application/json")
        .body(kube::client::Body::from(bytes))
        .unwrap();
    let response = client.send(request).await.map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    let (json, unread) = match body.collect().await {
        Ok(body) => (
            serde_json::from_slice(&body.to_bytes()).unwrap_or(Value::Null),
            None,
        ),
        Err(e) => (
            Value::Null,
            Some(format!("the body could not be read: {e}")),
        ),
    };
    let text = |v: &Value| v.as_str().map(str::to_string);
    Ok(Answer {
        status: parts.status.as_u16(),
        bulwark_reason: parts
            .headers
            .get("x-bulwark-reason")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        kind: text(&json["kind"]),
        outcome: text(&json["status"]),
        reason: text(&json["reason"]),
        message: unread.or_else(|| text(&json["message"])),
    })
}

/// `future` and how long it took.
async fn timed<T>(future: impl Future<Output = T>) -> (T, Duration) {
    let began = Instant::now();
    let out = future.await;
    (out, began.elapsed())
}

/// `n` GETs of `path` one after the other: `200`, or the status and Bulwark's reason.
async fn burst(client: &Client, path: &str, n: usize) -> Vec<String> {
    let mut statuses = Vec::new();
    for _ in 0..n {
        let answer = send(client, http::Method::GET, path, None).await.unwrap();
        statuses.push(match answer.bulwark_reason {
            Some(reason) => format!("{} {reason}", answer.status),
            None => answer.status.to_string(),
        });
    }
    statuses
}

/// A kube client without retries for `user` (no groups), with a fresh certificate.
async fn raw_client(cp: &ControlPlane, user: &str) -> Client {
    let cert = cp.pki().client_ca.client_cert(user, &[]);
    let yaml = bulwark_loadtest::identities::kubeconfig(
        cp.bulwark_addr(),
        cp.bulwark_ca_pem().unwrap(),
        user,
        &cert.cert_pem,
        &cert.key_pem,
    );
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&yaml).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    config.default_retry = false;
    Client::try_from(config).unwrap()
}

/// What an innocent client saw while a fault went on.
struct Served {
    ok: usize,
    failures: Vec<String>,
    slowest: Duration,
}

impl std::fmt::Display for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} GETs ok, {} failed, slowest {:?}",
            self.ok,
            self.failures.len(),
            self.slowest
        )
    }
}

impl Served {
    fn assert_all_served(&self, during: &str) {
        assert!(
            self.failures.is_empty(),
            "{during}: the innocent client's failures: {:?}",
            self.failures
        );
        assert!(
            self.ok >= 5,
            "{during}: the innocent client got {} answers",
            self.ok
        );
        assert!(
            self.slowest < INNOCENT_LATENCY_BOUND,
            "{during}: the innocent client waited {:?}",
            self.slowest
        );
    }
}

/// GETs of one ConfigMap every 100 ms for `span`, as an innocent client.
async fn innocent_gets(client: &Client, span: Duration) -> Served {
    let until = Instant::now() + span;
    let path = format!("/api/v1/namespaces/{NAMESPACE}/configmaps/cm-0");
    let mut served = Served {
        ok: 0,
        failures: Vec::new(),
        slowest: Duration::ZERO,
    };
    while Instant::now() < until {
        let began = Instant::now();
        let answer =
            tokio::time::timeout(INNOCENT_LATENCY_BOUND * 2, client.request_text(get(&path))).await;
        let took = began.elapsed();
        served.slowest = served.slowest.max(took);
        match answer {
            Ok(Ok(_)) => served.ok += 1,
            Ok(Err(e)) => served.failures.push(format!("{e} after {took:?}")),
            Err(_) => served.failures.push(format!("no answer in {took:?}")),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    served
}

/// Bulwark's resident memory now, from `/proc/PID/status`.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// The largest [`rss`] sampled every 50 ms for `span`.
async fn peak_rss(pid: u32, span: Duration) -> u64 {
    let until = Instant::now() + span;
    let mut peak = rss(pid);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss(pid));
    }
    peak
}

/// User plus system CPU time of the process so far, from `/proc/PID/stat` (fields 14 and
/// 15, counted after the command name's last `)`).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / rustix::param::clock_ticks_per_second() as f64
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// Bulwark's admin `/metrics`.
async fn bulwark_metrics(cp: &ControlPlane) -> String {
    let addr = cp.bulwark_admin_addr().expect("Bulwark runs");
    let (_, text) = bulwark_testkit::admin_get(addr, "/metrics")
        .await
        .expect("Bulwark's admin listener answers");
    text
}

/// Every sample whose line starts with `prefix`: (series, value).
async fn bulwark_samples(cp: &ControlPlane, prefix: &str) -> Vec<(String, f64)> {
    samples(&bulwark_metrics(cp).await, prefix)
}

fn samples(text: &str, prefix: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of the samples starting with `prefix` that carry all of `labels`.
async fn bulwark_sum(cp: &ControlPlane, prefix: &str, labels: &[&str]) -> f64 {
    bulwark_samples(cp, prefix)
        .await
        .iter()
        .filter(|(s, _)| labels.iter().all(|l| s.contains(l)))
        .map(|(_, v)| v)
        .sum()
}

/// `bulwark_rules_reload_total{result}`.
async fn reloads(cp: &ControlPlane, result: &str) -> f64 {
    bulwark_sum(
        cp,
        "bulwark_rules_reload_total{",
        &[&format!("result=\"{result}\"")],
    )
    .await
}

/// Waits up to 10 s for `bulwark_rules_reload_total{result}` to reach `at_least`.
async fn wait_for_reloads(cp: &ControlPlane, result: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = reloads(cp, result).await;
        if now >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "bulwark_rules_reload_total{{result=\"{result}\"}} stayed at {now}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The apiserver's `apiserver_request_total` of LISTs and ended WATCHes (a relist by
/// WatchList is a watch) per cached resource (Secrets, Endpoints, EndpointSlices), summed
/// over codes and scopes.
async fn apiserver_lists(direct: &Client) -> Vec<(String, f64)> {
    let text = direct.request_text(get("/metrics")).await.unwrap();
    ["secrets", "endpoints", "endpointslices"]
        .into_iter()
        .map(|resource| {
            let sum = samples(&text, "apiserver_request_total{")
                .iter()
                .filter(|(s, _)| {
                    (s.contains("verb=\"LIST\"") || s.contains("verb=\"WATCH\""))
                        && s.contains(&format!("resource=\"{resource}\""))
                })
                .fold(0.0, |sum, (_, v)| sum + v);
            (resource.to_string(), sum)
        })
        .collect()
}

/// A TLS connection to Bulwark with the client certificate `cert`, offering
/// `alpn`, with the socket's receive buffer set to `receive_buffer` bytes if given.
async fn connect(
    cp: &ControlPlane,
    cert: &bulwark_sim::pki::CertKey,
    alpn: &[u8],
    receive_buffer: Option<u32>,
) -> TlsStream<tokio::net::TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(cp.bulwark_ca_pem().unwrap().as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let chain = CertificateDer::pem_slice_iter(cert.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(cert.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![alpn.to_vec()];
    let socket = TcpSocket::new_v4().unwrap();
    if let Some(bytes) = receive_buffer {
        socket.set_recv_buffer_size(bytes).unwrap();
    }
    let tcp = socket.connect(cp.bulwark_addr()).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
    connector.connect(name, tcp).await.unwrap()
}

/// One HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap();
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn settings_payload(params: &[(u16, u32)]) -> Vec<u8> {
    params
        .iter()
        .flat_map(|(id, value)| id.to_be_bytes().into_iter().chain(value.to_be_bytes()))
        .collect()
}

/// The HEADERS frame of a GET of `path` on `stream`, HPACK-encoded by hand: the static
/// table's `:method GET` and `:scheme https`, then `:path` and `:authority` as literals
/// without indexing (no Huffman coding).
fn get_frame(stream: u32, path: &str) -> Vec<u8> {
    let mut block = vec![0x82, 0x87];
    for (name_index, value) in [(4u8, path), (1u8, "127.0.0.1")] {
        let len = u8::try_from(value.len()).ok().filter(|l| *l < 127).unwrap();
        block.push(name_index);
        block.push(len);
        block.extend_from_slice(value.as_bytes());
    }
    frame(HEADERS, END_STREAM | END_HEADERS, stream, &block)
}

/// Reads one frame: type, flags, stream and payload.
async fn read_frame(
    reader: &mut (impl AsyncRead + Unpin),
) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    reader.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).await?;
    Ok((head[3], head[4], stream, payload))
}

/// What a flooding connection did.
#[derive(Debug, Default)]
struct FloodReport {
    frames: u64,
    acks: u64,
    closed: bool,
}

/// One authenticated HTTP/2 connection (a GET of `/version` first) that writes `one`
/// frame over and over, in batches, for `span`, and, if `reads`, reads (and counts) what
/// comes back.
async fn flood(cp: &ControlPlane, one: &[u8], span: Duration, reads: bool) -> FloodReport {
    let flooder = cp.pki().client_ca.client_cert("flooder", &[]);
    let tls = connect(cp, &flooder, b"h2", None).await;
    let (mut reader, mut writer) = tokio::io::split(tls);
    let mut start = PREFACE.to_vec();
    start.extend(frame(SETTINGS, 0, 0, &[]));
    start.extend(get_frame(1, "/version"));
    writer.write_all(&start).await.unwrap();
    let until = Instant::now() + span;
    let read = tokio::spawn(async move {
        let mut acks = 0u64;
        let mut closed = false;
        if !reads {
            // Holds the connection open without reading a byte.
            tokio::time::sleep_until(until.into()).await;
            return (acks, closed);
        }
        loop {
            match tokio::time::timeout_at(until.into(), read_frame(&mut reader)).await {
                Ok(Ok((kind, flags, _, _))) => {
                    if (kind == PING || kind == SETTINGS) && flags & ACK != 0 {
                        acks += 1;
                    }
                    if kind == GOAWAY {
                        closed = true;
                    }
                }
                Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                Err(_) => break,
            }
        }
        (acks, closed)
    });
    let batch: Vec<u8> = one.iter().copied().cycle().take(one.len() * 512).collect();
    let mut report = FloodReport::default();
    while Instant::now() < until {
        match tokio::time::timeout_at(until.into(), writer.write_all(&batch)).await {
            Ok(Ok(())) => report.frames += 512,
            Ok(Err(_)) => {
                report.closed = true;
                break;
            }
            Err(_) => break,
        }
    }
    let (acks, closed) = read.await.unwrap();
    report.acks = acks;
    report.closed |= closed;
    report
}

/// What a zero-window connection got.
#[derive(Debug, Default)]
struct ZeroWindowReport {
    /// Streams answered with a `:status 200` head.
    answered: usize,
    /// Body bytes received on any stream.
    data_bytes: u64,
    /// Whether Bulwark sent GOAWAY or closed the connection.
    goaway: bool,
}

/// One HTTP/2 connection (as the admin, exempt from every limit) that sets
/// `SETTINGS_INITIAL_WINDOW_SIZE` to 0, GETs every path on its own stream, and never opens
/// a window, for `span`; it acknowledges Bulwark's SETTINGS and reads frames.
async fn zero_window(cp: &ControlPlane, paths: &[String], span: Duration) -> ZeroWindowReport {
    let tls = connect(cp, &admin_cert(cp), b"h2", None).await;
    let (mut reader, mut writer) = tokio::io::split(tls);
    let mut start = PREFACE.to_vec();
    start.extend(frame(
        SETTINGS,
        0,
        0,
        &settings_payload(&[(SETTINGS_ENABLE_PUSH, 0), (SETTINGS_INITIAL_WINDOW_SIZE, 0)]),
    ));
    for (i, path) in paths.iter().enumerate() {
        start.extend(get_frame(1 + 2 * u32::try_from(i).unwrap(), path));
    }
    writer.write_all(&start).await.unwrap();
    let until = Instant::now() + span;
    let mut report = ZeroWindowReport::default();
    loop {
        match tokio::time::timeout_at(until.into(), read_frame(&mut reader)).await {
            Ok(Ok((kind, flags, _, payload))) => match kind {
                SETTINGS if flags & ACK == 0 => {
                    writer
                        .write_all(&frame(SETTINGS, ACK, 0, &[]))
                        .await
                        .unwrap();
                }
                HEADERS if payload.first() == Some(&STATUS_200) => report.answered += 1,
                DATA => report.data_bytes += payload.len() as u64,
                GOAWAY => report.goaway = true,
                _ => {}
            },
            Ok(Err(_)) => {
                report.goaway = true;
                break;
            }
            Err(_) => break,
        }
    }
    report
}

/// An HTTP/1.1 GET of `path` as the admin over a socket with a 4 KiB receive buffer,
/// read 1 KiB every 100 ms for `span`: the answer's first line and the bytes read.
async fn slow_reader(cp: &ControlPlane, path: &str, span: Duration) -> (String, u64) {
    let mut tls = connect(cp, &admin_cert(cp), b"http/1.1", Some(4096)).await;
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/json\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let until = Instant::now() + span;
    let mut head = Vec::new();
    let mut total = 0u64;
    let mut buf = [0u8; 1024];
    while Instant::now() < until {
        match tokio::time::timeout_at(until.into(), tls.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => {
                if head.len() < 64 {
                    head.extend_from_slice(&buf[..n.min(64)]);
                }
                total += n as u64;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let line = String::from_utf8_lossy(&head)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    (line, total)
}

/// An HTTP/1.1 POST of a ConfigMap as `user` that declares a body of `declared` bytes and
/// sends one byte a second for `span`, then closes: the status (with Bulwark's reason)
/// and the time of an answer that came before the body ended, if one did.
async fn slow_body(
    cp: &ControlPlane,
    user: &str,
    declared: usize,
    span: Duration,
) -> Option<(String, Duration)> {
    let cert = cp.pki().client_ca.client_cert(user, &[]);
    let tls = connect(cp, &cert, b"http/1.1", None).await;
    let (mut reader, mut writer) = tokio::io::split(tls);
    let head = format!(
        "POST /api/v1/namespaces/{NAMESPACE}/configmaps HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{"
    );
    let began = Instant::now();
    writer.write_all(head.as_bytes()).await.unwrap();
    let until = began + span;
    let trickle = async move {
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if writer.write_all(b" ").await.is_err() {
                break;
            }
        }
    };
    let answer = async {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
            let text = String::from_utf8_lossy(&raw);
            if let Some((head, _)) = text.split_once("\r\n\r\n") {
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .unwrap_or_default()
                    .to_string();
                let reason = head.lines().find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("x-bulwark-reason:")
                        .map(|r| r.trim().to_string())
                });
                let status = match reason {
                    Some(reason) => format!("{status} {reason}"),
                    None => status,
                };
                return Some((status, began.elapsed()));
            }
        }
    };
    tokio::select! {
        () = trickle => None,
        answered = answer => answered,
    }
}

/// The admin's certificate (group `system:masters`, exempt from every limit).
fn admin_cert(cp: &ControlPlane) -> bulwark_sim::pki::CertKey {
    cp.pki().client_ca.client_cert("admin", &["system:masters"])
}
