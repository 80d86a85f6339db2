//! `cluster`: a whole cluster through a Bulwark fleet on the real control plane. KWOK keeps
//! N simulated nodes Ready and renews their Leases; kube-controller-manager and
//! kube-scheduler run bursts of Jobs whose pods KWOK runs; every one of their requests goes
//! through Bulwark as its own identity, under the shipped rules. The figures are the ones a
//! cluster's operator looks at: nodes that went NotReady, how old the node Leases got, how
//! long a burst's pods took to be scheduled and to finish, each apiserver's memory against
//! its limit and its OOM kills, what Bulwark refused and what it cost.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use futures::StreamExt;
use kube::Client;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::controlplane::{ControlPlane, NODE_LEASE_SECONDS, Options, kwok_node};
use crate::proxy_process::admin_text;
use crate::report::ProxyCost;
use crate::report::charts::{Bars, Lines, bars, lines};
use crate::report::html::{Chart, Item, Page, Section, Table};

/// What to run.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Where the control plane's files go.
    pub dir: std::path::PathBuf,
    /// Simulated nodes.
    pub nodes: usize,
    /// Jobs created at once in the burst.
    pub jobs: usize,
    /// Pods of each Job.
    pub pods_per_job: u64,
    /// kube-apiserver replicas.
    pub replicas: usize,
    /// Each one's memory limit.
    pub memory_limit: Option<u64>,
    /// Bulwark replicas (a fleet behind an L4 balancer when more than one).
    pub bulwarks: usize,
    /// How long the cluster runs on after the burst, its Leases watched.
    pub settle: Duration,
    /// Whether every node also runs an agent as `system:node:<name>`.
    pub agents: bool,
    /// A `bulwark-loadtest` binary to run Bulwark with; `None` is this very binary.
    pub bulwark_exe: Option<std::path::PathBuf>,
}

/// The run's figures, as written to JSON.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterReport {
    /// `cluster`.
    pub scenario: String,
    /// Simulated nodes.
    pub nodes: usize,
    /// kube-apiserver replicas.
    pub replicas: usize,
    /// Bulwark replicas.
    pub bulwarks: usize,
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
    /// Each Job of the burst.
    pub jobs: Vec<JobFigures>,
    /// Pods bound per second over the burst (all pods over the time until the last bound).
    pub scheduling_pods_per_s: f64,
    /// Each apiserver replica: peak memory, limit, OOM kills.
    pub apiservers: Vec<ApiserverFigures>,
    /// Samples over time: seconds since the burst, memory per replica (bytes), nodes not
    /// Ready, oldest Lease (s).
    pub samples: Vec<Sample>,
    /// Requests Bulwark matched per rule.
    pub rule_requests: BTreeMap<String, f64>,
    /// Requests Bulwark refused per rule and reason.
    pub refused: BTreeMap<String, f64>,
    /// Bulwark's peak memory and CPU (the first replica).
    pub bulwark: Option<ProxyCost>,
    /// The per-node agents' requests (lists and watches), when they ran.
    #[serde(default)]
    pub agents: Option<crate::report::Class>,
}

/// One Job of the burst.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct JobFigures {
    /// Its name.
    pub name: String,
    /// Its pods.
    pub pods: u64,
    /// Seconds from its creation to all its pods bound to nodes.
    pub scheduled_s: f64,
    /// Seconds from its creation to all its pods succeeded (run by KWOK).
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
    /// Nodes not Ready.
    pub not_ready: usize,
    /// The oldest node Lease's age.
    pub oldest_lease_s: f64,
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

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
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

/// Runs the scenario.
pub async fn run(o: &ClusterOptions) -> anyhow::Result<ClusterReport> {
    let mut opts = Options::new(&o.dir);
    opts.replicas = o.replicas;
    opts.apiserver_memory_limit = o.memory_limit;
    opts.bulwarks = o.bulwarks;
    opts.bulwark_exe = o.bulwark_exe.clone();
    eprintln!(
        "cluster: starting etcd, {} kube-apiservers and {} Bulwark(s)",
        o.replicas, o.bulwarks
    );
    let cp = ControlPlane::start(opts)
        .await
        .context("starting the control plane")?;
    let result = drive(&cp, o).await;
    let stopped = cp.stop().await;
    let report = result?;
    stopped.context("stopping the control plane")?;
    Ok(report)
}

async fn drive(cp: &ControlPlane, o: &ClusterOptions) -> anyhow::Result<ClusterReport> {
    let admin = cp.client("admin").await?;
    eprintln!("cluster: creating {} KWOK nodes", o.nodes);
    let created = futures::stream::iter(0..o.nodes)
        .map(|i| {
            let admin = admin.clone();
            async move {
                post(
                    &admin,
                    "/api/v1/nodes",
                    &kwok_node(&format!("kwok-node-{i}")),
                )
                .await
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    if o.agents {
        prepare_agents(cp, &admin, o.nodes).await?;
    }
    let mut components = cp.start_components().await?;
    let started = Instant::now();
    loop {
        if let Some(exited) = components.exited() {
            anyhow::bail!("{exited}");
        }
        let (seen, not_ready, _) = look(&admin).await?;
        eprint!("\rcluster: {} of {} nodes Ready", seen - not_ready, o.nodes);
        if seen == o.nodes && not_ready == 0 {
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
    // The agents run as long as the burst is watched (`settle`); their figures are theirs
    // once they end.
    let agents_until = tokio::time::Instant::now() + o.settle;
    let agent_stats = crate::client::ClassStats::new();
    let mut agent_tasks = if o.agents {
        eprintln!("cluster: starting an agent per node (its pods, its Secret, the EndpointSlices)");
        start_agents(cp, o.nodes, &agent_stats, agents_until)
    } else {
        Vec::new()
    };
    let agents_started = Instant::now();

    let burst = Instant::now();
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
    let mut samples = Vec::new();
    let mut ages = Vec::new();
    let mut not_ready_max = 0;
    let mut last_bound = 0.0_f64;
    let until = o.settle;
    let mut peak_line = String::new();
    loop {
        if let Some(exited) = components.exited() {
            anyhow::bail!("{exited}");
        }
        let t = burst.elapsed().as_secs_f64();
        let (_, not_ready, lease_ages) = look(&admin).await?;
        not_ready_max = not_ready_max.max(not_ready);
        let oldest = lease_ages.iter().copied().fold(0.0, f64::max);
        ages.extend(lease_ages);
        for figures in jobs.iter_mut().filter(|j| j.done_s == 0.0) {
            let pods = get(
                &admin,
                &format!(
                    "/api/v1/namespaces/default/pods?labelSelector=job-name%3D{}",
                    figures.name
                ),
            )
            .await?;
            let bound = pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["spec"]["nodeName"].is_string())
                .count() as u64;
            if figures.scheduled_s == 0.0 && bound >= figures.pods {
                figures.scheduled_s = t;
                last_bound = last_bound.max(t);
            }
            let status = get(
                &admin,
                &format!("/apis/batch/v1/namespaces/default/jobs/{}", figures.name),
            )
            .await?;
            if status["status"]["succeeded"].as_u64().unwrap_or(0) >= figures.pods {
                figures.done_s = t;
            }
        }
        let memory = cp.memory_usage();
        let peak = memory.iter().flatten().max().copied().unwrap_or(0);
        let line = format!(
            "cluster: {t:.0} s after the burst: {} of {} Jobs done, {not_ready} nodes not Ready, oldest Lease {oldest:.0} s, apiserver memory peak now {} MiB",
            jobs.iter().filter(|j| j.done_s > 0.0).count(),
            jobs.len(),
            peak >> 20
        );
        if line != peak_line {
            eprint!("\r{line}   ");
            peak_line = line;
        }
        samples.push(Sample {
            t,
            memory,
            not_ready,
            oldest_lease_s: oldest,
        });
        let done = jobs.iter().all(|j| j.done_s > 0.0);
        if done && burst.elapsed() >= until {
            break;
        }
        anyhow::ensure!(
            burst.elapsed() < until + Duration::from_secs(600),
            "the burst's Jobs did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    eprintln!();
    let ending = futures::future::join_all(agent_tasks.iter_mut());
    if tokio::time::timeout(Duration::from_secs(60), ending)
        .await
        .is_err()
    {
        eprintln!("cluster: some agents did not end a minute after their deadline");
        agent_tasks.iter().for_each(|t| t.abort());
    }
    let agents = o
        .agents
        .then(|| agent_stats.summary(agents_started.elapsed()));
    components.stop().await;

    ages.sort_by(f64::total_cmp);
    let pods_total = o.pods_per_job * o.jobs as u64;
    let mut rule_requests = BTreeMap::new();
    let mut refused = BTreeMap::new();
    if let Some(admin_addr) = cp.bulwark_admin_addr() {
        let metrics = admin_text(admin_addr, "/metrics").await.unwrap_or_default();
        for line in metrics.lines() {
            let Some((name, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let label = |key: &str| {
                name.split(&format!("{key}=\"")[..])
                    .nth(1)
                    .and_then(|rest| rest.split('"').next())
                    .unwrap_or("")
                    .to_owned()
            };
            if name.starts_with("bulwark_rule_requests_total{") {
                *rule_requests.entry(label("rule")).or_insert(0.0) += value;
            } else if name.starts_with("bulwark_rejected_requests_total{") {
                let key = format!("{} {}", label("rule"), label("reason"));
                *refused.entry(key).or_insert(0.0) += value;
            }
        }
    }
    Ok(ClusterReport {
        scenario: "cluster".into(),
        nodes: o.nodes,
        replicas: o.replicas,
        bulwarks: o.bulwarks,
        all_ready_s,
        not_ready_max,
        lease_age_p50_s: percentile(&ages, 0.5),
        lease_age_p99_s: percentile(&ages, 0.99),
        lease_age_max_s: ages.last().copied().unwrap_or(0.0),
        jobs,
        scheduling_pods_per_s: if last_bound > 0.0 {
            pods_total as f64 / last_bound
        } else {
            0.0
        },
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
        refused,
        bulwark: cp.bulwark_cost(),
        agents,
    })
}

/// The namespace of the agents' Secrets, one per node, named after it.
const AGENT_NAMESPACE: &str = "kwok-agents";

/// What the nodes' agents may read beyond a kubelet's own: the EndpointSlices of the
/// cluster (as a node's proxy or monitoring daemon reads them) and the Secrets of
/// [`AGENT_NAMESPACE`] (each agent watches only its own, by name).
fn agent_rbac() -> String {
    format!(
        "apiVersion: v1
kind: Namespace
metadata:
  name: {AGENT_NAMESPACE}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: kwok-node-agents
rules:
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: kwok-node-agents
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kwok-node-agents}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: Group, name: \"system:nodes\"}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: kwok-node-agents
  namespace: {AGENT_NAMESPACE}
rules:
  - apiGroups: [\"\"]
    resources: [secrets]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: kwok-node-agents
  namespace: {AGENT_NAMESPACE}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: kwok-node-agents}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: Group, name: \"system:nodes\"}}]
"
    )
}

/// Grants the agents their reads and creates each node's Secret.
async fn prepare_agents(cp: &ControlPlane, admin: &Client, nodes: usize) -> anyhow::Result<()> {
    let path = cp.dir().join("agents-rbac.yaml");
    std::fs::write(&path, agent_rbac()).with_context(|| format!("writing {}", path.display()))?;
    let (applied, said) = cp
        .kubectl("admin", &["apply", "-f", &path.display().to_string()])
        .await?;
    anyhow::ensure!(applied, "granting the node agents their reads: {said}");
    let created = futures::stream::iter(0..nodes)
        .map(|i| {
            let admin = admin.clone();
            async move {
                let secret = json!({
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": format!("kwok-node-{i}")},
                    "data": {"config": "c2V0dGluZ3M="},
                });
                post(
                    &admin,
                    &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/secrets"),
                    &secret,
                )
                .await
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    Ok(())
}

/// One agent per node, as `system:node:<name>` in `system:nodes`, through Bulwark: it
/// lists and watches its own pods (`spec.nodeName`), its own Secret and every
/// EndpointSlice, as a kubelet and the nodes' logging and monitoring daemons do, on one
/// connection. Started a few at a time so that the handshakes do not all land at once.
fn start_agents(
    cp: &ControlPlane,
    nodes: usize,
    stats: &std::sync::Arc<crate::client::ClassStats>,
    until: tokio::time::Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    let target = crate::client::Target {
        addr: cp.bulwark_addr(),
        ca_pem: cp.bulwark_ca_pem().unwrap_or_default().to_owned(),
    };
    (0..nodes)
        .filter_map(|i| {
            let name = format!("kwok-node-{i}");
            let cert = cp
                .pki()
                .client_ca
                .client_cert(&format!("system:node:{name}"), &["system:nodes"]);
            let identity = crate::client::Identity {
                cert_pem: cert.cert_pem,
                key_pem: cert.key_pem,
            };
            let client = crate::client::Client::new(&target, &identity).ok()?;
            let stats = stats.clone();
            let start = tokio::time::Instant::now() + Duration::from_millis(10 * i as u64);
            Some(tokio::spawn(async move {
                tokio::time::sleep_until(start).await;
                let received = std::sync::Arc::new(super::informers::Received::default());
                let reflect = |path: String| {
                    super::informers::reflector(
                        client.clone(),
                        stats.tally(),
                        path,
                        until,
                        None,
                        received.clone(),
                    )
                };
                let (mut pods, secret, slices) = tokio::join!(
                    reflect(format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{name}")),
                    reflect(format!(
                        "/api/v1/namespaces/{AGENT_NAMESPACE}/secrets?fieldSelector=metadata.name%3D{name}"
                    )),
                    reflect("/apis/discovery.k8s.io/v1/endpointslices".into()),
                );
                pods.merge(secret);
                pods.merge(slices);
                stats.done(pods);
            }))
        })
        .collect()
}

/// The one line at the top of the report.
pub fn verdict(r: &ClusterReport) -> String {
    let ooms: u64 = r.apiservers.iter().map(|a| a.oom_kills).sum();
    let refused: f64 = r.refused.values().fold(0.0, |a, b| a + b);
    let slowest = r.jobs.iter().map(|j| j.done_s).fold(0.0, f64::max);
    format!(
        "{} nodes through {} Bulwark(s): {} went NotReady, Leases at most {:.0} s old (p99 {:.0} s, lease {NODE_LEASE_SECONDS} s); {} Jobs of {} pods done in {:.1} s at most; {ooms} apiserver OOM kills; {refused:.0} requests refused.",
        r.nodes,
        r.bulwarks,
        r.not_ready_max,
        r.lease_age_max_s,
        r.lease_age_p99_s,
        r.jobs.len(),
        r.jobs.first().map_or(0, |j| j.pods),
        slowest,
    )
}

/// The report as a self-contained HTML page.
pub fn page(r: &ClusterReport) -> anyhow::Result<Page> {
    let x_max = r.samples.last().map_or(1.0, |s| s.t).max(1.0);
    let limit = r.apiservers.iter().filter_map(|a| a.limit_bytes).max();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let replicas = r.samples.first().map_or(0, |s| s.memory.len());
    let memory_series = (0..replicas)
        .map(|i| {
            let points = r
                .samples
                .iter()
                .filter_map(|s| Some((s.t, mib(s.memory.get(i).copied().flatten()?))))
                .collect();
            (
                format!("apiserver {i}"),
                crate::report::charts::colour(i),
                points,
            )
        })
        .collect::<Vec<_>>();
    let y_max = r
        .samples
        .iter()
        .flat_map(|s| s.memory.iter().flatten())
        .map(|b| mib(*b))
        .fold(limit.map_or(1.0, mib), f64::max);
    let memory = lines(&Lines {
        title: "apiserver memory (MiB) after the burst",
        y_desc: "MiB",
        series: memory_series,
        limit: limit.map(mib),
        limit_label: "memory limit",
        marks: Vec::new(),
        x_max,
        y_max: y_max * 1.05,
    })?;
    let leases = lines(&Lines {
        title: "the oldest node Lease (s) and nodes not Ready",
        y_desc: "seconds / nodes",
        series: vec![
            (
                "oldest Lease (s)".into(),
                crate::report::charts::colour(0),
                r.samples.iter().map(|s| (s.t, s.oldest_lease_s)).collect(),
            ),
            (
                "nodes not Ready".into(),
                crate::report::charts::colour(1),
                r.samples
                    .iter()
                    .map(|s| (s.t, s.not_ready as f64))
                    .collect(),
            ),
        ],
        limit: Some(f64::from(NODE_LEASE_SECONDS)),
        limit_label: "Lease duration",
        marks: Vec::new(),
        x_max,
        y_max: f64::from(NODE_LEASE_SECONDS) * 1.2,
    })?;
    let jobs = bars(&Bars {
        title: "each Job: seconds to all pods bound, and to all succeeded",
        y_desc: "seconds",
        categories: r.jobs.iter().map(|j| j.name.clone()).collect(),
        series: vec![
            (
                "scheduled".into(),
                r.jobs.iter().map(|j| j.scheduled_s).collect(),
            ),
            ("done".into(), r.jobs.iter().map(|j| j.done_s).collect()),
        ],
        limit: None,
        log_y: false,
    })?;
    let mut figures = Table {
        header: vec!["figure".into(), "value".into()],
        rows: vec![
            vec!["nodes".into(), r.nodes.to_string()],
            vec![
                "all Ready after (s)".into(),
                format!("{:.1}", r.all_ready_s),
            ],
            vec![
                "most nodes NotReady at once".into(),
                r.not_ready_max.to_string(),
            ],
            vec![
                "Lease age p50 / p99 / max (s)".into(),
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    r.lease_age_p50_s, r.lease_age_p99_s, r.lease_age_max_s
                ),
            ],
            vec![
                "pods bound per second".into(),
                format!("{:.1}", r.scheduling_pods_per_s),
            ],
        ],
    };
    for (i, a) in r.apiservers.iter().enumerate() {
        figures.rows.push(vec![
            format!("apiserver {i}: peak / limit (MiB), OOM kills"),
            format!(
                "{} / {}, {}",
                a.peak_bytes.map_or("-".into(), |b| (b >> 20).to_string()),
                a.limit_bytes.map_or("-".into(), |b| (b >> 20).to_string()),
                a.oom_kills
            ),
        ]);
    }
    if let Some(agents) = &r.agents {
        figures.rows.push(vec![
            "node agents: requests, ok, 429, errors, p99 (ms)".into(),
            format!(
                "{}, {}, {}, {}, {:.1}",
                agents.requests, agents.ok, agents.rejected, agents.errors, agents.p99_ms
            ),
        ]);
    }
    if let Some(cost) = &r.bulwark {
        figures.rows.push(vec![
            "Bulwark: peak RSS (MiB), CPU (s)".into(),
            format!("{}, {:.1}", cost.peak_rss_bytes >> 20, cost.cpu_seconds),
        ]);
    }
    let rules = Table {
        header: vec!["Bulwark rule".into(), "requests".into()],
        rows: r
            .rule_requests
            .iter()
            .map(|(k, v)| vec![k.clone(), format!("{v:.0}")])
            .chain(
                r.refused
                    .iter()
                    .map(|(k, v)| vec![format!("refused: {k}"), format!("{v:.0}")]),
            )
            .collect(),
    };
    Ok(Page {
        title: format!("cluster: {} KWOK nodes", r.nodes),
        verdict: verdict(r),
        notes: vec![format!(
            "{} kube-apiservers, {} Bulwark(s); kube-controller-manager, kube-scheduler and KWOK through Bulwark as themselves, under rules/examples.",
            r.replicas, r.bulwarks
        )],
        sections: vec![
            Section {
                title: "The apiservers".into(),
                items: vec![Item::Chart(Chart {
                    title: "apiserver memory after the burst".into(),
                    svg: memory,
                })],
            },
            Section {
                title: "The nodes".into(),
                items: vec![Item::Chart(Chart {
                    title: "oldest node Lease and nodes not Ready".into(),
                    svg: leases,
                })],
            },
            Section {
                title: "The burst".into(),
                items: vec![Item::Chart(Chart {
                    title: "Jobs: to scheduled and to done".into(),
                    svg: jobs,
                })],
            },
            Section {
                title: "Figures".into(),
                items: vec![Item::Table(figures), Item::Table(rules)],
            },
        ],
    })
}
