//! `cluster`: a whole cluster on the real control plane, run twice on the same seed: once
//! with its clients reaching the kube-apiservers through an L4 balancer (`direct`), once
//! through a Bulwark fleet (`bulwark`). KWOK keeps N simulated nodes Ready and renews their
//! Leases; kube-controller-manager and kube-scheduler run a burst of Jobs whose pods KWOK
//! runs; an agent per node lists and watches its pods, its Secret and the EndpointSlices as
//! `system:node:<name>`; a few probe nodes renew their own Leases as kubelets do, timing
//! each renewal at the client; and a LIST storm of large Secrets runs on top. Every one of
//! those clients goes through the front door as its own identity, under the shipped rules
//! (`deploy/base/rules`, enforced) and, for KWOK's controller, the loadtest's own
//! (`loadtest/rules`).
//!
//! The figures are the ones a cluster's operator looks at: nodes that went NotReady, the
//! Lease renewal latency at the client and how old the Leases got, how long a burst's pods
//! took to be scheduled and to finish, each apiserver's memory against its limit and its
//! OOM kills over time, the LISTs and WATCHes the apiservers served (their own metrics),
//! who was refused (Bulwark's rules, the apiservers' FlowSchemas) over time, and what
//! Bulwark cost.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use futures::StreamExt;
use kube::Client;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::list_storm::STORM;
use super::{Load, Req, spawn_loads_at};
use crate::client::{ClassStats, Target};
use crate::controlplane::{Components, ControlPlane, NODE_LEASE_SECONDS, Options, kwok_node};
use crate::proxy_process::admin_text;
use crate::report::{Class, ProxyCost};

mod metrics;
mod page;
mod probes;
use metrics::scrape;
pub use metrics::{Rates, counters};
use page::run_line;
pub use page::{page, verdict};
use probes::{probe_name, probe_node, start_probes};

mod pods;

/// The cluster's front door in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// An L4 balancer in front of the kube-apiservers (each connection to the next).
    Direct,
    /// Bulwark (a fleet behind an L4 balancer when more than one).
    Bulwark,
}

impl Front {
    /// Its name in the report and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Front::Direct => "direct",
            Front::Bulwark => "bulwark",
        }
    }

    /// The fronts named in a comma-separated list (`direct,bulwark`).
    pub fn parse_list(list: &str) -> anyhow::Result<Vec<Front>> {
        list.split(',')
            .map(|name| match name.trim() {
                "direct" => Ok(Front::Direct),
                "bulwark" => Ok(Front::Bulwark),
                other => anyhow::bail!("no front door {other:?}: direct or bulwark"),
            })
            .collect()
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Where the control planes' files go (one folder per front door).
    pub dir: std::path::PathBuf,
    /// Simulated nodes (KWOK's).
    pub nodes: usize,
    /// Probe nodes: each renews its own Lease and status as its kubelet would, timed at
    /// the client; tainted so that no pod lands on them.
    pub probes: usize,
    /// Jobs created at once in the burst.
    pub jobs: usize,
    /// Pods of each Job.
    pub pods_per_job: u64,
    /// kube-apiserver replicas.
    pub replicas: usize,
    /// Each one's memory limit.
    pub memory_limit: Option<u64>,
    /// Bulwark replicas in the `bulwark` run.
    pub bulwarks: usize,
    /// How long the cluster runs on after the burst, its Leases watched; the storm and the
    /// agents run this long.
    pub settle: Duration,
    /// Whether every node also runs its pods that talk to the apiservers, as pods do
    /// (`scenario/cluster/pods.rs`): a logging agent and a kube-proxy, each with a
    /// ServiceAccount token bound to its node, through the `kubernetes` Service.
    pub agents: bool,
    /// LIST storm identities (0: no storm), each listing every Secret of the cluster with
    /// no resourceVersion, again and again.
    pub storm: usize,
    /// Secrets of 100 KiB seeded for the storm.
    pub storm_secrets: usize,
    /// The front doors, in the order they run.
    pub fronts: Vec<Front>,
    /// A `bulwark-loadtest` binary to run Bulwark with; `None` is this very binary.
    pub bulwark_exe: Option<std::path::PathBuf>,
}

impl ClusterOptions {
    /// The default for `nodes` nodes: both front doors, agents, a probe per 20 nodes (3 at
    /// least), a storm of 10 identities on 600 Secrets of 100 KiB (60 MiB).
    pub fn new(dir: impl Into<std::path::PathBuf>, nodes: usize) -> ClusterOptions {
        ClusterOptions {
            dir: dir.into(),
            nodes,
            probes: (nodes / 20).clamp(3, 200),
            jobs: 3,
            pods_per_job: 200,
            replicas: 3,
            memory_limit: None,
            bulwarks: 1,
            settle: Duration::from_secs(60),
            agents: true,
            storm: 10,
            storm_secrets: 600,
            fronts: vec![Front::Direct, Front::Bulwark],
            bulwark_exe: None,
        }
    }
}

/// Bytes of each Secret the storm lists.
const STORM_SECRET_BYTES: u64 = 100 << 10;

/// The scenario's figures, as written to JSON: the set-up, and a run per front door.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterReport {
    /// `cluster`.
    pub scenario: String,
    /// KWOK's nodes.
    pub nodes: usize,
    /// Probe nodes.
    pub probes: usize,
    /// kube-apiserver replicas.
    pub replicas: usize,
    /// Bulwark replicas in the `bulwark` run.
    pub bulwarks: usize,
    /// Jobs in the burst, and pods of each.
    pub jobs: usize,
    /// See `jobs`.
    pub pods_per_job: u64,
    /// Storm identities, Secrets they list, and those Secrets' bytes in all.
    pub storm: usize,
    /// See `storm`.
    pub storm_secrets: usize,
    /// See `storm`.
    pub storm_bytes: u64,
    /// The command line that produced it.
    #[serde(default)]
    pub command: String,
    /// The rule folders Bulwark loaded in the `bulwark` run, and their mode (reports
    /// recorded before this field ran under `rules/examples`).
    #[serde(default = "examples_rules")]
    pub rules: String,
    /// One run per front door, in the order they ran.
    pub runs: Vec<ClusterRun>,
}

/// The rules a Bulwark run loads: the shipped set and the loadtest's own, enforced.
pub const RULES: &str = "deploy/base/rules and loadtest/rules, enforced";

/// The rules of the reports recorded before they were named in them.
fn examples_rules() -> String {
    "rules/examples".into()
}

/// One front door's run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterRun {
    /// `direct` or `bulwark`.
    pub front: String,
    /// Seconds from the components' start to every node Ready.
    pub all_ready_s: f64,
    /// The most nodes seen not Ready at once after they were all Ready (0 is the goal).
    pub not_ready_max: usize,
    /// The age of the node Leases' `renewTime` over the run's samples: p50, p99, max (s).
    pub lease_age_p50_s: f64,
    /// See `lease_age_p50_s`.
    pub lease_age_p99_s: f64,
    /// See `lease_age_p50_s`.
    pub lease_age_max_s: f64,
    /// The probe nodes' Lease renewals, timed at the client.
    pub lease_renewals: Class,
    /// Each Job of the burst.
    pub jobs: Vec<JobFigures>,
    /// Pods bound per second over the burst (all pods over the time until the last bound;
    /// 0 when not all were bound).
    pub scheduling_pods_per_s: f64,
    /// Each apiserver replica: peak memory, limit, OOM kills.
    pub apiservers: Vec<ApiserverFigures>,
    /// Samples over time from the burst on.
    pub samples: Vec<Sample>,
    /// Requests Bulwark matched per rule (the `bulwark` run).
    pub rule_requests: BTreeMap<String, f64>,
    /// Requests refused over the run: `rule NAME reason` by Bulwark, `APF SCHEMA` by the
    /// apiservers' own fairness.
    pub refused: BTreeMap<String, f64>,
    /// Bulwark's peak memory and CPU (the first replica; the `bulwark` run).
    pub bulwark: Option<ProxyCost>,
    /// The per-node logging agents' requests (lists and watches), when they ran.
    pub agents: Option<Class>,
    /// The per-node kube-proxies' requests (lists and watches of Services and
    /// EndpointSlices), when they ran.
    #[serde(default)]
    pub kube_proxies: Option<Class>,
    /// The storm's LISTs, when it ran.
    pub storm: Option<Class>,
    /// How often kube-controller-manager, kube-scheduler and KWOK exited and were started
    /// again during the burst (a controller manager that loses its leader Lease exits).
    #[serde(default)]
    pub component_restarts: BTreeMap<String, u64>,
}

/// One Job of the burst.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct JobFigures {
    /// Its name.
    pub name: String,
    /// Its pods.
    pub pods: u64,
    /// Seconds from its creation to all its pods bound to nodes (0: never).
    pub scheduled_s: f64,
    /// Seconds from its creation to all its pods Running (or past it, Succeeded) as KWOK
    /// reports them (0: never, or not recorded).
    #[serde(default)]
    pub running_s: f64,
    /// Seconds from its creation to all its pods succeeded, run by KWOK (0: never).
    pub done_s: f64,
}

/// One apiserver replica.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ApiserverFigures {
    /// Peak memory of its cgroup.
    pub peak_bytes: Option<u64>,
    /// Its limit.
    pub limit_bytes: Option<u64>,
    /// OOM kills.
    pub oom_kills: u64,
}

/// One sample.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the burst.
    pub t: f64,
    /// Memory per replica.
    pub memory: Vec<Option<u64>>,
    /// OOM kills per replica so far.
    #[serde(default)]
    pub oom_kills: Vec<u64>,
    /// Nodes not Ready.
    pub not_ready: usize,
    /// The oldest node Lease's age.
    pub oldest_lease_s: f64,
    /// The slowest of the probes' Lease renewals since the last sample, at the client.
    #[serde(default)]
    pub slowest_renewal_s: f64,
    /// LISTs per second the apiservers served since the last sample (their
    /// `apiserver_request_total`).
    #[serde(default)]
    pub lists_per_s: f64,
    /// Requests per second each replica served since the last sample (its own
    /// `apiserver_request_total`), by index.
    #[serde(default)]
    pub requests_per_s: Vec<f64>,
    /// Watches open at the apiservers (their `apiserver_longrunning_requests`).
    #[serde(default)]
    pub open_watches: f64,
    /// Watch events per second the apiservers sent since the last sample
    /// (`apiserver_watch_events_total`).
    #[serde(default)]
    pub watch_events_per_s: f64,
    /// Refusals per second since the last sample, by who refused and whom (the keys of
    /// [`ClusterRun::refused`]).
    #[serde(default)]
    pub refused_per_s: BTreeMap<String, f64>,
    /// What the Bulwarks held at the sample, summed over them (runs through Bulwark).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bulwark: Option<BulwarkGauges>,
}

/// What Bulwarks hold at a moment, by their own gauges: the figures of a replica's size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BulwarkGauges {
    /// Client connections open (`bulwark_connections_open`).
    pub connections: f64,
    /// Watches the cache serves (`bulwark_cache_watchers`).
    pub watchers: f64,
    /// Watches held open to the apiservers (`bulwark_upstream_watches`).
    pub upstream_watches: f64,
    /// Bytes the cache holds (`bulwark_cache_bytes`).
    pub cached_bytes: f64,
    /// Objects it holds (`bulwark_cache_objects`).
    pub cached_objects: f64,
    /// Resident memory (`process_resident_memory_bytes`).
    pub resident_bytes: f64,
}

impl BulwarkGauges {
    /// Each gauge's largest value over `samples`.
    pub fn peaks<'a>(
        samples: impl IntoIterator<Item = &'a BulwarkGauges>,
    ) -> Option<BulwarkGauges> {
        samples.into_iter().fold(None, |most, g| {
            let m = most.unwrap_or_default();
            Some(BulwarkGauges {
                connections: m.connections.max(g.connections),
                watchers: m.watchers.max(g.watchers),
                upstream_watches: m.upstream_watches.max(g.upstream_watches),
                cached_bytes: m.cached_bytes.max(g.cached_bytes),
                cached_objects: m.cached_objects.max(g.cached_objects),
                resident_bytes: m.resident_bytes.max(g.resident_bytes),
            })
        })
    }
}

/// `GET path`'s JSON.
pub async fn get(client: &Client, path: &str) -> anyhow::Result<Value> {
    let request = http::Request::get(path).body(Vec::new())?;
    client
        .request::<Value>(request)
        .await
        .with_context(|| format!("GET {path}"))
}

/// `POST path` of `body` as JSON, and the answer's JSON.
pub async fn post(client: &Client, path: &str, body: &Value) -> anyhow::Result<Value> {
    let request = http::Request::post(path)
        .header("Content-Type", "application/json")
        .body(body.to_string().into_bytes())?;
    client
        .request::<Value>(request)
        .await
        .with_context(|| format!("POST {path}"))
}

fn ready(node: &Value) -> bool {
    node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// The nodes, those not Ready, and each node Lease's age in seconds.
pub async fn look(admin: &Client) -> anyhow::Result<(usize, usize, Vec<f64>)> {
    let nodes = get(admin, "/api/v1/nodes").await?;
    let items = nodes["items"].as_array().cloned().unwrap_or_default();
    let not_ready = items.iter().filter(|n| !ready(n)).count();
    let leases = get(
        admin,
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
    )
    .await?;
    let now = SystemTime::now();
    let ages = leases["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            let at = humantime::parse_rfc3339_weak(l["spec"]["renewTime"].as_str()?).ok()?;
            Some(now.duration_since(at).unwrap_or_default().as_secs_f64())
        })
        .collect();
    Ok((items.len(), not_ready, ages))
}

/// A Job of `pods` pods run at once, each to completion.
pub fn job(name: &str, pods: u64) -> Value {
    json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "work", "image": "registry.invalid/work:1"}],
            }},
        },
    })
}

/// Runs the scenario: a fresh control plane per front door, on the same seed.
pub async fn run(o: &ClusterOptions) -> anyhow::Result<ClusterReport> {
    let mut report = ClusterReport {
        scenario: "cluster".into(),
        nodes: o.nodes,
        probes: o.probes,
        replicas: o.replicas,
        bulwarks: o.bulwarks,
        jobs: o.jobs,
        pods_per_job: o.pods_per_job,
        storm: o.storm,
        storm_secrets: o.storm_secrets,
        storm_bytes: o.storm_secrets as u64 * STORM_SECRET_BYTES,
        command: String::new(),
        rules: RULES.into(),
        runs: Vec::new(),
    };
    for &front in &o.fronts {
        eprintln!("== cluster ({}): starting", front.name());
        let run = run_front(o, front).await?;
        eprintln!("== cluster ({}): {}", front.name(), run_line(&run));
        report.runs.push(run);
    }
    for log in access_logs(o) {
        eprintln!(
            "cluster: Bulwark's access log, every request (bulwark rules suggest --access-log): {}",
            log.display()
        );
    }
    Ok(report)
}

/// The access logs the run through Bulwark wrote (every request, for `bulwark rules
/// suggest` and `replay`), left in its folder.
pub fn access_logs(o: &ClusterOptions) -> Vec<std::path::PathBuf> {
    let dir = o.dir.join(Front::Bulwark.name());
    let mut logs: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("bulwark"))
        .map(|e| e.path().join(crate::controlplane::ACCESS_LOG))
        .filter(|p| p.exists())
        .collect();
    logs.sort();
    logs
}

async fn run_front(o: &ClusterOptions, front: Front) -> anyhow::Result<ClusterRun> {
    let mut opts = Options::new(o.dir.join(front.name()));
    opts.replicas = o.replicas;
    // Every request through Bulwark, recorded: what `bulwark rules suggest` reads.
    opts.access_log = front == Front::Bulwark;
    opts.apiserver_memory_limit = o.memory_limit;
    opts.bulwarks = match front {
        Front::Direct => 0,
        Front::Bulwark => o.bulwarks,
    };
    opts.bulwark_exe = o.bulwark_exe.clone();
    if o.storm > 0 {
        opts.seed = vec![
            format!(
                "secrets={}x{}KiB",
                o.storm_secrets,
                STORM_SECRET_BYTES >> 10
            )
            .parse()
            .context("the storm's seed")?,
        ];
    }
    eprintln!(
        "cluster ({}): starting etcd and {} kube-apiservers{}",
        front.name(),
        o.replicas,
        match front {
            Front::Direct => " behind an L4 balancer".to_string(),
            Front::Bulwark => format!(" behind {} Bulwark(s)", o.bulwarks),
        }
    );
    let cp = ControlPlane::start(opts)
        .await
        .context("starting the control plane")?;
    let result = drive(&cp, o, front).await;
    let stopped = cp.stop().await;
    let run = result?;
    stopped.context("stopping the control plane")?;
    Ok(run)
}

/// Posts each of `objects` to `path`, 16 at a time.
async fn post_all(admin: &Client, path: &str, objects: Vec<Value>) -> anyhow::Result<()> {
    let created = futures::stream::iter(objects)
        .map(|object| async move { post(admin, path, &object).await })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    Ok(())
}

// Over 120 lines: a cluster run in the order it happens (nodes, pods, probes, components,
// the burst, the watch, the ending), each step holding the handles the next one stops.
async fn drive(cp: &ControlPlane, o: &ClusterOptions, front: Front) -> anyhow::Result<ClusterRun> {
    let admin = cp.client("admin").await?;
    // The run's own look at the cluster goes straight to replica 0, so that it neither
    // loads nor waits on the front door under test.
    let observer = cp.client("direct-admin").await?;
    let target = cp.front_door();
    create_nodes(&admin, o).await?;
    if o.storm > 0 {
        grant(cp, "storm-rbac.yaml", &storm_rbac(o.storm)).await?;
    }
    let storm_accounts: Vec<(String, String)> = (0..o.storm).map(storm_account).collect();
    let mut pods =
        pods::Pods::prepare(cp, &observer, front, o.agents, o.nodes, &storm_accounts).await?;
    let (stop_probes, stopped) = tokio::sync::watch::channel(false);
    let probe_stats = ClassStats::new();
    let slowest = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut probes = start_probes(cp, &target, o.probes, &probe_stats, &slowest, stopped);
    let mut components = cp.start_components().await?;
    let all_ready_s = until_all_ready(&mut components, &observer, o.nodes + o.probes).await?;

    // The agents and the storm run as long as the burst is watched (`settle`).
    let until = tokio::time::Instant::now() + o.settle;
    let (agent_stats, proxy_stats) = (ClassStats::new(), ClassStats::new());
    let mut agent_tasks = pods.start_nodes(&agent_stats, &proxy_stats, until);
    let storm = if o.storm > 0 {
        eprintln!(
            "cluster: a storm of {} identities listing {} Secrets of {} KiB",
            o.storm,
            o.storm_secrets,
            STORM_SECRET_BYTES >> 10
        );
        let targets = pods.targets.clone();
        Some(spawn_loads_at(
            vec![storm_load(std::mem::take(&mut pods.storm_tokens))],
            until,
            move |_, i| targets[i % targets.len()].clone(),
            None,
        )?)
    } else {
        None
    };
    let burst = Instant::now();
    let mut rates = Rates::default();
    let _ = scrape(cp, &mut rates, 0.0).await;
    let names: Vec<String> = (0..o.jobs).map(|j| format!("burst-{j}")).collect();
    for name in &names {
        post(
            &admin,
            "/apis/batch/v1/namespaces/default/jobs",
            &job(name, o.pods_per_job),
        )
        .await?;
    }
    let mut jobs: Vec<JobFigures> = names
        .iter()
        .map(|n| JobFigures {
            name: n.clone(),
            pods: o.pods_per_job,
            ..JobFigures::default()
        })
        .collect();
    let Watched {
        samples,
        mut ages,
        not_ready_max,
        last_bound,
        refused,
    } = watch_burst(
        cp,
        &observer,
        &mut components,
        front,
        o.settle,
        (burst, rates),
        &mut jobs,
        &slowest,
    )
    .await;
    let _ = stop_probes.send(true);
    let ending = futures::future::join_all(agent_tasks.iter_mut().chain(probes.iter_mut()));
    if tokio::time::timeout(Duration::from_secs(60), ending)
        .await
        .is_err()
    {
        eprintln!("cluster: some agents did not end a minute after their deadline");
        agent_tasks.iter().chain(&probes).for_each(|t| t.abort());
    }
    let storm = match storm {
        Some((classes, all)) => {
            let _ = tokio::time::timeout(Duration::from_secs(90), all).await;
            classes
                .first()
                .map(|(_, stats)| stats.summary(burst.elapsed()))
        }
        None => None,
    };
    let agents = o.agents.then(|| agent_stats.summary(burst.elapsed()));
    let kube_proxies = o.agents.then(|| proxy_stats.summary(burst.elapsed()));
    let component_restarts = components
        .restarts()
        .into_iter()
        .map(|(name, n)| (name.to_owned(), n))
        .collect();
    components.stop().await;

    ages.sort_by(f64::total_cmp);
    let pods_total = o.pods_per_job * o.jobs as u64;
    let rule_requests = rule_requests(cp).await;
    Ok(ClusterRun {
        front: front.name().into(),
        all_ready_s,
        not_ready_max,
        lease_age_p50_s: percentile(&ages, 0.5),
        lease_age_p99_s: percentile(&ages, 0.99),
        lease_age_max_s: ages.last().copied().unwrap_or(0.0),
        lease_renewals: probe_stats.summary(burst.elapsed()),
        scheduling_pods_per_s: if jobs.iter().all(|j| j.scheduled_s > 0.0) && last_bound > 0.0 {
            pods_total as f64 / last_bound
        } else {
            0.0
        },
        jobs,
        apiservers: cp
            .report()
            .into_iter()
            .map(|r| ApiserverFigures {
                peak_bytes: r.peak_memory_bytes,
                limit_bytes: r.memory_limit_bytes,
                oom_kills: r.oom_kills,
            })
            .collect(),
        samples,
        rule_requests,
        refused: refused.into_iter().filter(|(_, n)| *n >= 0.5).collect(),
        bulwark: cp.bulwark_cost(),
        agents,
        kube_proxies,
        storm,
        component_restarts,
    })
}

/// Creates the KWOK nodes and the probe nodes, and each probe node's Lease.
async fn create_nodes(admin: &Client, o: &ClusterOptions) -> anyhow::Result<()> {
    eprintln!(
        "cluster: creating {} KWOK nodes and {} probe nodes",
        o.nodes, o.probes
    );
    let nodes = (0..o.nodes)
        .map(|i| kwok_node(&format!("kwok-node-{i}")))
        .chain((0..o.probes).map(|i| probe_node(&probe_name(i))))
        .collect();
    post_all(admin, "/api/v1/nodes", nodes).await?;
    let leases = (0..o.probes)
        .map(|i| {
            json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": probe_name(i)},
                "spec": {"holderIdentity": probe_name(i), "leaseDurationSeconds": NODE_LEASE_SECONDS},
            })
        })
        .collect();
    post_all(
        admin,
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
        leases,
    )
    .await?;
    Ok(())
}

/// Waits until all `all` nodes are Ready (at most five minutes); how long that took, s.
async fn until_all_ready(
    components: &mut Components,
    observer: &Client,
    all: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    loop {
        if let Some(exited) = components.exited() {
            anyhow::bail!("{exited}");
        }
        let (seen, not_ready, _) = look(observer).await?;
        eprint!("\rcluster: {} of {all} nodes Ready", seen - not_ready);
        if seen == all && not_ready == 0 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "the nodes were not all Ready in 5 minutes"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let all_ready_s = started.elapsed().as_secs_f64();
    eprintln!(" in {all_ready_s:.1} s");
    Ok(all_ready_s)
}

/// What watching the burst saw.
struct Watched {
    samples: Vec<Sample>,
    /// Every probe Lease's age at every look, seconds.
    ages: Vec<f64>,
    not_ready_max: usize,
    /// When the last Job had all its pods bound, seconds after the burst.
    last_bound: f64,
    /// 429s by who refused whom, over the run.
    refused: BTreeMap<String, f64>,
}

/// Watches the burst (begun at `burst`, the apiservers' counters read then into `rates`)
/// every 3 s until every Job is done and `settle` has passed (or 3 minutes past `settle`):
/// the nodes, the Jobs, the apiservers' calls and memory, and the slowest Lease renewal, a
/// sample each time; components that exit are started again.
#[allow(clippy::too_many_arguments)]
async fn watch_burst(
    cp: &ControlPlane,
    observer: &Client,
    components: &mut Components,
    front: Front,
    settle: Duration,
    (burst, mut rates): (Instant, Rates),
    jobs: &mut [JobFigures],
    slowest: &std::sync::atomic::AtomicU64,
) -> Watched {
    let mut samples: Vec<Sample> = Vec::new();
    let mut ages = Vec::new();
    let mut not_ready_max = 0;
    let mut last_bound = 0.0_f64;
    let mut refused = BTreeMap::new();
    let mut peak = 0;
    let mut unseen = 0;
    // After the settle time the run waits this much longer for unfinished Jobs.
    let grace = Duration::from_secs(180);
    loop {
        for exited in components.restart_exited() {
            eprintln!("\ncluster: {exited}\ncluster: started it again");
        }
        let t = burst.elapsed().as_secs_f64();
        let previous = samples.last();
        // A replica that does not answer (OOM-killed) leaves the sample's
        // cluster figures as they were last seen; the run goes on.
        let (not_ready, oldest) = match look(observer).await {
            Ok((_, not_ready, lease_ages)) => {
                let oldest = lease_ages.iter().copied().fold(0.0, f64::max);
                ages.extend(lease_ages);
                (not_ready, oldest)
            }
            Err(_) => {
                unseen += 1;
                previous.map_or((0, 0.0), |s| (s.not_ready, s.oldest_lease_s))
            }
        };
        not_ready_max = not_ready_max.max(not_ready);
        for figures in jobs.iter_mut().filter(|j| j.done_s == 0.0) {
            let Ok((bound, running, succeeded)) = job_progress(observer, &figures.name).await
            else {
                continue;
            };
            if figures.running_s == 0.0 && running >= figures.pods {
                figures.running_s = t;
            }
            if figures.scheduled_s == 0.0 && bound >= figures.pods {
                figures.scheduled_s = t;
                last_bound = last_bound.max(t);
            }
            if succeeded >= figures.pods {
                figures.done_s = t;
            }
        }
        let scraped = scrape(cp, &mut rates, t).await;
        for (key, per_s) in &scraped.refused_per_s {
            let dt = t - previous.map_or(0.0, |s| s.t);
            *refused.entry(key.clone()).or_insert(0.0) += per_s * dt;
        }
        let replicas = cp.report();
        let memory = cp.memory_usage();
        peak = memory.iter().flatten().copied().fold(peak, u64::max);
        let ooms: u64 = replicas.iter().map(|r| r.oom_kills).sum();
        eprint!(
            "\rcluster ({}): {t:>4.0} s after the burst: {} of {} Jobs done, {not_ready} nodes not Ready, oldest Lease {oldest:.0} s, apiserver peak {} MiB, {ooms} OOM kills, {:.0} LIST/s   ",
            front.name(),
            jobs.iter().filter(|j| j.done_s > 0.0).count(),
            jobs.len(),
            peak >> 20,
            scraped.lists_per_s,
        );
        let slowest_renewal_s = slowest.swap(0, std::sync::atomic::Ordering::Relaxed) as f64 / 1e6;
        samples.push(Sample {
            t,
            slowest_renewal_s,
            memory,
            oom_kills: replicas.iter().map(|r| r.oom_kills).collect(),
            not_ready,
            oldest_lease_s: oldest,
            ..scraped
        });
        let done = jobs.iter().all(|j| j.done_s > 0.0);
        if (done && burst.elapsed() >= settle) || burst.elapsed() >= settle + grace {
            break;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    eprintln!();
    if unseen > 0 {
        eprintln!("cluster: the front door did not answer {unseen} of the samples");
    }
    Watched {
        samples,
        ages,
        not_ready_max,
        last_bound,
        refused,
    }
}

/// Requests by rule, summed over every Bulwark's metrics.
async fn rule_requests(cp: &ControlPlane) -> BTreeMap<String, f64> {
    let mut rule_requests = BTreeMap::new();
    for admin_addr in cp.bulwark_admin_addrs() {
        let metrics = admin_text(admin_addr, "/metrics").await.unwrap_or_default();
        for (rule, n) in counters(&metrics, "bulwark_rule_requests_total", &["rule"]) {
            *rule_requests.entry(rule).or_insert(0.0) += n;
        }
    }
    rule_requests
}

/// How many of a Job's pods are bound to nodes, how many are Running or past it, and how
/// many succeeded.
async fn job_progress(admin: &Client, name: &str) -> anyhow::Result<(u64, u64, u64)> {
    let pods = get(
        admin,
        &format!("/api/v1/namespaces/default/pods?labelSelector=job-name%3D{name}"),
    )
    .await?;
    let items = || pods["items"].as_array().into_iter().flatten();
    let bound = items()
        .filter(|p| p["spec"]["nodeName"].is_string())
        .count() as u64;
    let running = items()
        .filter(|p| matches!(p["status"]["phase"].as_str(), Some("Running" | "Succeeded")))
        .count() as u64;
    let job = get(
        admin,
        &format!("/apis/batch/v1/namespaces/default/jobs/{name}"),
    )
    .await?;
    Ok((
        bound,
        running,
        job["status"]["succeeded"].as_u64().unwrap_or(0),
    ))
}

/// The storm: identities listing every Secret of the cluster with no resourceVersion,
/// one LIST after another, as a cluster-wide informer that relists without end.
/// The `i`-th storm identity's ServiceAccount: `tenant-i/secret-reader`.
fn storm_account(i: usize) -> (String, String) {
    let (user, _) = STORM.who(i);
    let mut parts = user.rsplitn(3, ':');
    let name = parts.next().unwrap_or_default().to_owned();
    let namespace = parts.next().unwrap_or_default().to_owned();
    (namespace, name)
}

/// The storm: tenant operators in pods, each with its token, listing every Secret.
fn storm_load(tokens: Vec<String>) -> Load {
    Load {
        class: "storm".into(),
        identities: tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                crate::client::Identity::in_cluster(t, pods::service_ip())
                    .from_source(pods::node_source(i))
            })
            .collect(),
        think: Duration::from_millis(10),
        next: Arc::new(|_, _| Req::get("/api/v1/secrets".into(), Duration::from_secs(60))),
    }
}

/// What the storm's identities may do: read every Secret (as the tenant operators whose
/// informers they stand for).
fn storm_rbac(identities: usize) -> String {
    let subjects: Vec<String> = (0..identities)
        .map(|i| {
            let (_, groups) = STORM.who(i);
            format!(
                "  - {{apiGroup: rbac.authorization.k8s.io, kind: Group, name: \"{}\"}}\n",
                groups.last().map_or("", String::as_str)
            )
        })
        .collect();
    format!(
        "apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: cluster-storm-secret-readers
rules:
  - apiGroups: [\"\"]
    resources: [secrets]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: cluster-storm-secret-readers
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-storm-secret-readers}}
subjects:
{}",
        subjects.concat()
    )
}

/// Applies `yaml` as the admin, from `DIR/file`.
pub(crate) async fn grant(cp: &ControlPlane, file: &str, yaml: &str) -> anyhow::Result<()> {
    let path = cp.dir().join(file);
    std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
    let (applied, said) = cp
        .kubectl("admin", &["apply", "-f", &path.display().to_string()])
        .await?;
    anyhow::ensure!(applied, "applying {file}: {said}");
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A client of the front door as node `name`'s kubelet: `system:node:<name>` in
/// `system:nodes`, with a client certificate.
fn node_client(cp: &ControlPlane, target: &Target, name: &str) -> Option<crate::client::Client> {
    let cert = cp
        .pki()
        .client_ca
        .client_cert(&format!("system:node:{name}"), &["system:nodes"]);
    let identity = crate::client::Identity::certificate(cert.cert_pem, cert.key_pem);
    crate::client::Client::new(target, &identity).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storm_identity_is_a_tenants_service_account() {
        assert_eq!(
            storm_account(3),
            ("tenant-3".to_owned(), "secret-reader".to_owned())
        );
    }

    #[test]
    fn the_storm_may_read_every_secret_and_nothing_else() {
        let yaml = storm_rbac(2);
        assert!(yaml.contains("resources: [secrets]"));
        assert!(yaml.contains("name: \"system:serviceaccounts:tenant-0\""));
        assert!(yaml.contains("name: \"system:serviceaccounts:tenant-1\""));
        assert!(!yaml.contains("tenant-2"));
    }
}
