//! A whole cluster through Bulwark: a real control plane (etcd and a kube-apiserver built
//! from Kubernetes' Go modules) with Bulwark in front, and the real kube-controller-manager,
//! kube-scheduler and KWOK's controller talking to it through Bulwark, each as itself. KWOK
//! keeps simulated nodes Ready and renews their Leases; a Job's pods are created by the
//! controller manager, bound by the scheduler and run by KWOK, and every one of those
//! requests is Bulwark's to admit. Without the binaries the control plane builds them
//! (`loadtest/controlplane/build.sh`, Go 1.26) or fails: this test never skips.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{
    Components, ControlPlane, NODE_LEASE_SECONDS, Options, kwok_node,
};
use bulwark_loadtest::proxy_process::admin_text;
use bulwark_loadtest::scenario::cluster;
use bulwark_testkit::metric_sum;
use kube::Client;
use serde_json::Value;

const NODES: usize = 20;
const PODS: u64 = 60;

async fn get(client: &Client, path: &str) -> Value {
    cluster::get(client, path).await.unwrap()
}

async fn post(client: &Client, path: &str, body: &Value) -> Value {
    cluster::post(client, path, body).await.unwrap()
}

/// Polls `check` every half second until it is `Some`, or panics with `what` and the
/// components' state after `within`.
async fn until<T, F, Fut>(
    components: &mut Components,
    within: Duration,
    what: &str,
    mut check: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(exited) = components.exited() {
            panic!("{exited}");
        }
        match check().await {
            Ok(done) => return done,
            Err(last) if Instant::now() > deadline => panic!("{what} within {within:?}: {last}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

// Over 120 lines: one Job through the real components from creation to success, each step
// waiting on the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_manager_scheduler_and_kwok_run_a_job_through_bulwark() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path().join("cp"));
    opts.replicas = 1;
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    let cp = ControlPlane::start(opts)
        .await
        .unwrap_or_else(|e| panic!("the control plane did not start: {e}"));
    let admin = cp.client("admin").await.unwrap();
    for i in 0..NODES {
        post(
            &admin,
            "/api/v1/nodes",
            &kwok_node(&format!("kwok-node-{i}")),
        )
        .await;
    }
    let mut components = cp
        .start_components()
        .await
        .unwrap_or_else(|e| panic!("the components did not start: {e}"));

    // KWOK keeps every node Ready and its Lease fresh, through Bulwark.
    until(
        &mut components,
        Duration::from_secs(90),
        "every node Ready",
        || async {
            let (seen, not_ready, _) = cluster::look(&admin).await.unwrap();
            let ready = seen - not_ready;
            if ready == NODES {
                Ok(())
            } else {
                Err(format!("{ready} of {NODES} Ready"))
            }
        },
    )
    .await;
    until(
        &mut components,
        Duration::from_secs(60),
        "every node Lease renewed",
        || async {
            let (_, _, ages) = cluster::look(&admin).await.unwrap();
            let fresh = ages
                .iter()
                .filter(|age| **age < f64::from(NODE_LEASE_SECONDS))
                .count();
            if fresh == NODES {
                Ok(())
            } else {
                Err(format!("{fresh} of {NODES} Leases fresh"))
            }
        },
    )
    .await;

    // A Job of PODS pods: the controller manager creates them, the scheduler binds them to
    // the KWOK nodes, KWOK runs them to completion.
    let created = Instant::now();
    post(
        &admin,
        "/apis/batch/v1/namespaces/default/jobs",
        &cluster::job("burst", PODS),
    )
    .await;
    until(
        &mut components,
        Duration::from_secs(120),
        "the Job's pods all succeeded",
        || async {
            let job = get(&admin, "/apis/batch/v1/namespaces/default/jobs/burst").await;
            let succeeded = job["status"]["succeeded"].as_u64().unwrap_or(0);
            if succeeded == PODS {
                Ok(())
            } else {
                Err(format!(
                    "{succeeded} of {PODS} succeeded: {}",
                    job["status"]
                ))
            }
        },
    )
    .await;
    let took = created.elapsed();
    let pods = get(
        &admin,
        "/api/v1/namespaces/default/pods?labelSelector=job-name%3Dburst",
    )
    .await;
    let on_kwok = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| {
            p["spec"]["nodeName"]
                .as_str()
                .is_some_and(|n| n.starts_with("kwok-node-"))
        })
        .count();
    assert_eq!(on_kwok as u64, PODS, "every pod bound to a KWOK node");
    eprintln!("a Job of {PODS} pods on {NODES} KWOK nodes: created to all succeeded in {took:?}");

    // Every one of them went through Bulwark under its own rules, none refused.
    let admin_addr = cp.bulwark_admin_addr().expect("Bulwark's admin address");
    let metrics = admin_text(admin_addr, "/metrics").await.unwrap();
    for rule in [
        "kwok-node-heartbeats",
        "kwok-node-status",
        "kwok",
        "kube-controller-manager",
        "kube-scheduler",
        "kube-system-service-accounts",
        "leader-election",
    ] {
        let matched = metrics
            .lines()
            .filter(|l| {
                l.starts_with("bulwark_rule_requests_total")
                    && l.contains(&format!("rule=\"{rule}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        assert!(matched > 0.0, "no request matched rule {rule}:\n{metrics}");
    }
    let refused = metric_sum(&metrics, "bulwark_rejected_requests_total");
    assert_eq!(
        refused, 0.0,
        "Bulwark refused the cluster's own components:\n{metrics}"
    );
    components.stop().await;
    cp.stop().await.unwrap();
}

/// `bulwark-loadtest cluster` at a small size, direct and through Bulwark on the same
/// seed: the nodes' pods (a logging agent listing and watching its node's pods, its Secret
/// and the EndpointSlices, and a kube-proxy watching Services and EndpointSlices, each with
/// a ServiceAccount token bound to its node, through the `kubernetes` Service), the probe
/// kubelets renewing their Leases and a small LIST storm from tenant operators' pods are
/// all answered beside KWOK and the controllers; no node goes NotReady, the
/// Job finishes, the apiservers' own metrics show what they served, and the report draws
/// each chart once per front door.
// Over 120 lines: one scenario run, direct and through Bulwark, then suggest and replay of
// its recording, all judged on that one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_scenario_runs_nodes_agents_probes_and_a_storm_direct_and_through_bulwark() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = cluster::ClusterOptions::new(dir.path().join("cp"), 10);
    options.probes = 2;
    options.jobs = 1;
    options.pods_per_job = 20;
    options.replicas = 1;
    // Past two renewal periods (10 s), so that each probe renews at least twice whenever its
    // first renewal falls: with 8 s a run whose Job ended quickly saw one renewal a probe.
    options.settle = Duration::from_secs(21);
    options.storm = 2;
    options.storm_secrets = 20;
    options.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    let report = cluster::run(&options).await.unwrap();
    assert_eq!(report.nodes, 10);
    let fronts: Vec<&str> = report.runs.iter().map(|r| r.front.as_str()).collect();
    assert_eq!(fronts, ["direct", "bulwark"]);
    for run in &report.runs {
        let front = &run.front;
        assert_eq!(run.not_ready_max, 0, "{front}: {run:#?}");
        assert!(run.jobs[0].done_s > 0.0, "{front}: {run:#?}");
        assert!(
            run.jobs[0].running_s > 0.0 && run.jobs[0].running_s <= run.jobs[0].done_s,
            "{front}: {run:#?}"
        );
        assert!(
            run.lease_age_max_s < f64::from(NODE_LEASE_SECONDS),
            "{front}: {run:#?}"
        );
        // Two probes renewing every 10 s over the run, each timed at the client.
        let renewals = &run.lease_renewals;
        assert!(
            renewals.ok >= 4 && renewals.errors == 0 && renewals.p99_ms > 0.0,
            "{front}: {renewals:#?}"
        );
        let agents = run.agents.as_ref().expect("the agents ran");
        // Each agent's three lists and three watches, every one answered.
        assert!(
            agents.ok >= 60 && agents.errors == 0 && agents.rejected == 0,
            "{front}: {agents:#?}"
        );
        let proxies = run.kube_proxies.as_ref().expect("the kube-proxies ran");
        // Each kube-proxy's two lists and two watches, every one answered.
        assert!(
            proxies.ok >= 40 && proxies.errors == 0 && proxies.rejected == 0,
            "{front}: {proxies:#?}"
        );
        let storm = run.storm.as_ref().expect("the storm ran");
        assert!(storm.ok > 0, "{front}: {storm:#?}");
        // The apiservers' own counts: the agents' and the controllers' LISTs and watches.
        let lists: f64 = run.samples.iter().map(|s| s.lists_per_s).sum();
        let events: f64 = run.samples.iter().map(|s| s.watch_events_per_s).sum();
        let open = run
            .samples
            .iter()
            .map(|s| s.open_watches)
            .fold(0.0, f64::max);
        // At least each agent's three watches and each kube-proxy's two.
        assert!(
            lists > 0.0 && events > 0.0 && open >= 50.0,
            "{front}: {:#?}",
            run.samples
        );
    }
    let bulwark = &report.runs[1];
    // Only the storm may be refused; every node and controller was answered.
    assert!(
        bulwark
            .refused
            .keys()
            .all(|k| k.contains("cluster-wide-secret-lists")),
        "{:?}",
        bulwark.refused
    );
    // From the recording to rules: suggested from what the run served, replayed against
    // the same recording, the cluster's own clients are refused nothing and the storm is
    // refused again.
    let logs = cluster::access_logs(&options);
    assert_eq!(
        logs.len(),
        1,
        "the run through Bulwark recorded its requests"
    );
    let recording = bulwark::traffic::Recording::read(&logs).unwrap();
    let suggestion = bulwark::traffic::suggest::suggest(
        &recording,
        &bulwark::traffic::suggest::Options::default(),
    );
    let rules = bulwark::rules::RuleSet::from_sources(&suggestion.sources())
        .unwrap_or_else(|p| panic!("{p:?}\n{:#?}", suggestion.files));
    let names: Vec<&str> = suggestion.files.iter().map(|(n, _)| n.as_str()).collect();
    for class in [
        "logging-fluent-bit.yaml",
        "kube-system-kube-proxy.yaml",
        "kube-controller-manager.yaml",
        "kube-scheduler.yaml",
        "cluster-wide-secret-lists.yaml",
    ] {
        assert!(names.contains(&class), "{class} in {names:?}");
    }
    let replay = bulwark::traffic::replay::replay(
        &recording,
        &rules,
        bulwark::traffic::replay::DEFAULT_LIST_BUDGET,
    );
    eprintln!("{names:?}\n{}", replay.table());
    let storm = replay.refused_where(|r| r.rule == "cluster-wide-secret-lists");
    let others = replay.refused_where(|r| r.rule != "cluster-wide-secret-lists");
    assert_eq!(others, 0, "only the storm is refused:\n{}", replay.table());
    assert!(storm > 0, "the storm is refused again:\n{}", replay.table());
    // The pods were Bulwark's clients, each under its rule: they came through the
    // kubernetes Service.
    for (rule, at_least) in [("logging-agents", 60.0), ("kube-proxy", 40.0)] {
        let served = bulwark.rule_requests.get(rule).copied().unwrap_or(0.0);
        assert!(served >= at_least, "{rule}: {:?}", bulwark.rule_requests);
    }
    assert!(
        bulwark
            .rule_requests
            .get("node-heartbeats")
            .copied()
            .unwrap_or(0.0)
            >= 4.0,
        "the probes' renewals: {:?}",
        bulwark.rule_requests
    );
    assert!(report.runs[0].bulwark.is_none() && bulwark.bulwark.is_some());
    let html = bulwark_loadtest::report::html::render(&cluster::page(&report).unwrap());
    // Memory, nodes, LISTs and watches, requests per replica, refusals: once per front
    // door; the Jobs once; latency of the probes, the agents, the kube-proxies and the
    // storm once each.
    assert_eq!(html.matches("<svg").count(), 15);
    for run in &report.runs {
        assert!(
            run.samples
                .iter()
                .any(|s| s.requests_per_s.first().is_some_and(|r| *r > 0.0)),
            "{}: {:#?}",
            run.front,
            run.samples
        );
    }
}
