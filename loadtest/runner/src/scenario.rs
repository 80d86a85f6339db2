//! What every scenario shares: a fresh simulated fleet per run, the two targets (`direct`
//! through the fleet's L4 balancer, `bulwark` through Bulwark as its own process), client
//! identities, request loops with deadlines, progress lines, and the final report.
//!
//! A scenario only says what its clients do; the same loops run against both targets and
//! only the address and CA differ.

pub mod cluster;
pub mod conn_flood;
pub mod demo;
pub mod events_poll;
pub mod fleet;
pub mod informers;
pub mod list_storm;
pub mod on_controlplane;
pub mod passthrough;
pub mod progress;
pub mod skew;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use bulwark_sim::pki::Pki;
use bulwark_sim::policy::{Policy, PolicyRule};
use bulwark_sim::{Fleet, HeapModel, Seed, SimConfig};
use bulwark_testkit::{FRONT_PROXY_CN, OWN_GROUP, OWN_USER};
use bytes::Bytes;
use http::Method;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::client::{ClassStats, Client, Identity, Outcome, Read, Target};
use crate::proxy_process::{ProxyProcess, Upstream};
use crate::report::{self, Report, Run, Timeline};

/// A recorded result (`--json`) read back as the scenario that wrote it: the one place
/// that knows each scenario's result type. The `cluster` scenario records a
/// [`cluster::ClusterReport`]; every other scenario a [`Report`].
pub fn recorded(json: &std::path::Path) -> anyhow::Result<Box<dyn report::Outcome>> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    // Read as text each time: a JSON value's map would sort the runs, which a result keeps
    // in the order they ran.
    #[derive(serde::Deserialize)]
    struct Scenario {
        scenario: String,
    }
    let parsing = || format!("parsing {}", json.display());
    let scenario: Scenario = serde_json::from_str(&text).with_context(parsing)?;
    Ok(if scenario.scenario == "cluster" {
        Box::new(serde_json::from_str::<cluster::ClusterReport>(&text).with_context(parsing)?)
    } else {
        Box::new(serde_json::from_str::<Report>(&text).with_context(parsing)?)
    })
}

/// The command-line options every scenario takes.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long each run drives load (scenario default when absent).
    pub duration: Option<Duration>,
    /// Multiplies object and client counts.
    pub scale: f64,
    /// Run only the target with this name.
    pub only: Option<String>,
    /// `informers`, `node-join`: nodes ask for protobuf first, as kubelet and kube-proxy do.
    pub protobuf: bool,
    /// `informers`, `node-join`: Secret watches each node holds.
    pub secrets_per_node: usize,
    /// `informers`, `node-join`: each node's EndpointSlice watch on a connection of its own.
    pub kube_proxy_apart: bool,
    /// `informers`: how long the nodes take to connect, then to start their watches
    /// (the scenario's own when absent).
    pub join_window: Option<Duration>,
    /// `informers`: EndpointSlice updates a second.
    pub slice_churn: u64,
    /// `informers`: EndpointSlices seeded (500 scaled when absent).
    pub endpointslices: Option<usize>,
}

impl Options {
    /// `n` scaled, at least `min`.
    pub fn scaled(&self, n: usize, min: usize) -> usize {
        ((n as f64 * self.scale).round() as usize).max(min)
    }

    /// The run length: `--duration` or the scenario's default.
    pub fn duration_or(&self, default: Duration) -> Duration {
        self.duration.unwrap_or(default)
    }
}

/// The target of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Clients → the simulator's L4 balancer → replicas.
    Direct,
    /// Clients → Bulwark (its own process) → replicas.
    Bulwark,
}

impl Mode {
    /// The run's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Bulwark => "bulwark",
        }
    }
}

/// The simulated fleet a scenario needs.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Apiserver replicas.
    pub replicas: usize,
    /// Seeds such as `secrets=5000x10KiB`.
    pub seed: Vec<String>,
    /// How many concurrent full LISTs of the largest seeded collection a replica survives;
    /// `None` sets no heap limit.
    pub lists_to_oom: Option<u64>,
    /// The replicas' watch bookmark interval.
    pub bookmark_interval: Duration,
    /// Rule files `(name, YAML)` Bulwark gets beside the shipped rules.
    pub extra_rules: Vec<(&'static str, &'static str)>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            replicas: 3,
            seed: Vec::new(),
            lists_to_oom: None,
            bookmark_interval: Duration::from_secs(60),
            extra_rules: Vec::new(),
        }
    }
}

/// Heap of an idle replica in the model.
const BASE_HEAP: u64 = 256 << 20;
/// How long an OOMed replica stays down.
const OOM_RESTART: Duration = Duration::from_secs(3);

impl Setup {
    fn seeds(&self) -> anyhow::Result<Vec<Seed>> {
        self.seed
            .iter()
            .map(|s| s.parse::<Seed>().map_err(anyhow::Error::from))
            .collect()
    }

    /// The heap model: the limit lets `lists_to_oom` full LISTs of the largest seeded
    /// collection run at once (each costs 5x its bytes), and not one more.
    fn heap(&self) -> anyhow::Result<(HeapModel, Option<u64>)> {
        let seeds = self.seeds()?;
        let live: u64 = seeds.iter().map(|s| (s.count * s.size) as u64).sum();
        let largest: u64 = seeds
            .iter()
            .map(|s| (s.count * s.size) as u64)
            .max()
            .unwrap_or(0);
        let headroom = self.lists_to_oom.map(|n| 5 * largest * n + 5 * largest / 2);
        let model = HeapModel {
            base_bytes: BASE_HEAP,
            limit_bytes: headroom.map(|h| BASE_HEAP + live + h),
            restart: OOM_RESTART,
        };
        Ok((model, headroom))
    }
}

/// The policy of every scenario: every client (group `system:authenticated`) may do
/// everything, since the scenarios measure load, not authorization; Bulwark's own identity
/// may review and read everything.
fn policy() -> Policy {
    let all = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut rules = vec![PolicyRule {
        groups: all(&["system:authenticated"]),
        verbs: all(&["*"]),
        resources: all(&["*"]),
        non_resource_urls: all(&["*"]),
        ..PolicyRule::default()
    }];
    rules.push(PolicyRule {
        groups: vec![OWN_GROUP.into()],
        verbs: all(&["create"]),
        resources: all(&[
            "tokenreviews.authentication.k8s.io",
            "subjectaccessreviews.authorization.k8s.io",
        ]),
        ..PolicyRule::default()
    });
    rules.push(PolicyRule {
        groups: vec![OWN_GROUP.into()],
        verbs: all(&["get", "list", "watch"]),
        resources: all(&["*"]),
        non_resource_urls: all(&["*"]),
        ..PolicyRule::default()
    });
    Policy { rules }
}

/// Mints `n` identities of a class: users `CLASS-0`…, each with the class as its group.
pub fn identities(pki: &Pki, class: &str, n: usize) -> Vec<Identity> {
    minted(pki, n, |i| {
        (format!("{class}-{i}"), vec![class.to_string()])
    })
}

/// Mints `n` identities, the `i`-th with the user name and groups `who(i)` says.
fn minted(pki: &Pki, n: usize, who: impl Fn(usize) -> (String, Vec<String>)) -> Vec<Identity> {
    (0..n)
        .map(|i| {
            let (user, groups) = who(i);
            let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
            let ck = pki.client_ca.client_cert(&user, &groups);
            Identity::certificate(ck.cert_pem, ck.key_pem)
        })
        .collect()
}

/// Who a class's clients are, named as a real cluster names them, so that Bulwark's rules
/// see the same users and groups they would see in production. Both runs (direct and
/// through Bulwark) use the same identities.
#[derive(Clone, Copy, Debug)]
pub enum Persona<'a> {
    /// People or plain apps: users `PREFIX-N` in `group`.
    Users {
        /// User name prefix.
        prefix: &'a str,
        /// Their one group besides `system:authenticated`.
        group: &'a str,
    },
    /// One ServiceAccount `name` per namespace `NAMESPACE_PREFIX-N` (tenant operators or
    /// controllers): user `system:serviceaccount:NS:NAME`, groups `system:serviceaccounts`
    /// and `system:serviceaccounts:NS`.
    ServiceAccounts {
        /// Namespace prefix, one namespace per identity.
        namespace_prefix: &'a str,
        /// The ServiceAccount's name.
        name: &'a str,
    },
    /// ServiceAccounts `NAME_PREFIX-N` of one namespace.
    ServiceAccountsIn {
        /// The namespace.
        namespace: &'a str,
        /// Name prefix.
        name_prefix: &'a str,
    },
    /// Kubelets: `system:node:node-N` in `system:nodes`.
    Nodes,
}

impl Persona<'_> {
    /// The user name and groups of identity `i`.
    pub fn who(self, i: usize) -> (String, Vec<String>) {
        let sa = |ns: &str, name: &str| {
            (
                format!("system:serviceaccount:{ns}:{name}"),
                vec![
                    "system:serviceaccounts".to_string(),
                    format!("system:serviceaccounts:{ns}"),
                ],
            )
        };
        match self {
            Persona::Users { prefix, group } => (format!("{prefix}-{i}"), vec![group.to_string()]),
            Persona::ServiceAccounts {
                namespace_prefix,
                name,
            } => sa(&format!("{namespace_prefix}-{i}"), name),
            Persona::ServiceAccountsIn {
                namespace,
                name_prefix,
            } => sa(namespace, &format!("{name_prefix}-{i}")),
            Persona::Nodes => (
                format!("system:node:{}", node_name(i)),
                vec!["system:nodes".to_string()],
            ),
        }
    }

    /// Mints `n` identities of this persona.
    pub fn mint(self, pki: &Pki, n: usize) -> Vec<Identity> {
        minted(pki, n, |i| self.who(i))
    }
}

/// The name of node `i`, as [`Persona::Nodes`] names its kubelet.
pub fn node_name(i: usize) -> String {
    format!("node-{i}")
}

/// One run's world: a fresh fleet and the target clients use.
pub struct Env {
    /// Which target this run uses.
    pub mode: Mode,
    /// The simulated apiservers.
    pub fleet: Arc<Fleet>,
    /// Where clients connect.
    pub target: Target,
    proxy: Option<ProxyProcess>,
    heap_limit: u64,
    peak_watches: Arc<AtomicU64>,
    sampler: JoinHandle<()>,
    timeline: Arc<Mutex<Timeline>>,
    dir: PathBuf,
}

impl Env {
    /// Starts a fresh fleet and, for [`Mode::Bulwark`], Bulwark in front of it.
    pub async fn start(mode: Mode, setup: &Setup, pki: Arc<Pki>) -> anyhow::Result<Env> {
        let (heap, headroom) = setup.heap()?;
        let heap_limit = heap.limit_bytes.unwrap_or(0);
        let config = SimConfig {
            seed: setup.seeds()?,
            heap,
            bookmark_interval: setup.bookmark_interval,
            ..bulwark_testkit::fleet_config(pki.clone(), setup.replicas, policy())
        };
        let fleet = Arc::new(
            Fleet::start(config)
                .await
                .context("starting the simulator")?,
        );
        let dir = run_dir();
        let (target, proxy) = match mode {
            Mode::Direct => {
                let addr = fleet
                    .l4_balancer()
                    .await
                    .context("starting the L4 balancer")?;
                let target = Target {
                    addr,
                    ca_pem: pki.server_ca.cert_pem(),
                };
                (target, None)
            }
            Mode::Bulwark => {
                let rules = if setup.extra_rules.is_empty() {
                    None
                } else {
                    let folder = crate::proxy_process::write_shipped_rules(&dir.join("rules"))?;
                    for (name, yaml) in &setup.extra_rules {
                        let path = folder.join(name);
                        std::fs::write(&path, yaml)
                            .with_context(|| format!("writing {}", path.display()))?;
                    }
                    Some(folder)
                };
                let upstream = Upstream {
                    replicas: fleet.addrs(),
                    pki: &pki,
                    front_proxy_user: FRONT_PROXY_CN,
                    own_user: OWN_USER,
                    own_group: OWN_GROUP,
                    heap_headroom: headroom,
                    rules,
                    identity_mode: None,
                    serving_ca: None,
                    settings: Vec::new(),
                    advertise: None,
                };
                let proxy = ProxyProcess::start(&dir, &upstream).await?;
                (proxy.target.clone(), Some(proxy))
            }
        };
        let peak_watches = Arc::new(AtomicU64::new(0));
        let sampler = {
            let fleet = fleet.clone();
            let peak = peak_watches.clone();
            tokio::spawn(async move {
                loop {
                    let open: u64 = fleet.stats().iter().map(|s| s.open_watches).sum();
                    peak.fetch_max(open, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Ok(Env {
            mode,
            fleet,
            target,
            proxy,
            heap_limit,
            peak_watches,
            sampler,
            timeline: Arc::default(),
            dir,
        })
    }

    /// Bulwark's process id, when this run has one.
    pub fn proxy_pid(&self) -> Option<u32> {
        self.proxy.as_ref().and_then(ProxyProcess::pid)
    }

    /// Collects the fleet's and the proxy's figures, stops both, and builds the run.
    pub async fn finish(self, driven: Driven) -> anyhow::Result<Run> {
        self.sampler.abort();
        let stats = self.fleet.stats();
        let open_now: u64 = stats.iter().map(|s| s.open_watches).sum();
        let peak_watches = self.peak_watches.load(Ordering::Relaxed).max(open_now);
        let proxy = match self.proxy {
            Some(p) => Some(p.stop().await?),
            None => None,
        };
        let _ = std::fs::remove_dir_all(&self.dir);
        let timeline =
            std::mem::take(&mut *self.timeline.lock().unwrap_or_else(|e| e.into_inner()));
        let apiserver = report::Apiserver {
            heap_limit_bytes: self.heap_limit,
            peak_heap_bytes: stats.iter().map(|s| s.peak_heap_bytes).max().unwrap_or(0),
            ooms: stats.iter().map(|s| s.ooms).sum(),
            replica_requests: stats.iter().map(|s| s.requests).collect(),
            replica_peak_inflight: stats.iter().map(|s| s.peak_in_flight).collect(),
            upstream_requests: stats.iter().map(|s| s.requests).sum(),
            upstream_watches: peak_watches,
            ..report::Apiserver::default()
        };
        for (name, stats, _) in &driven.classes {
            if let Some(e) = stats.sample_error() {
                eprintln!("  {} {name}: errors such as: {e}", self.mode.name());
            }
        }
        let classes = driven
            .classes
            .iter()
            .map(|(name, stats, elapsed)| (name.clone(), stats.summary(*elapsed)))
            .collect();
        Ok(Run {
            apiserver,
            proxy,
            classes,
            event_delivery_p99_ms: driven.event_delivery_p99_ms,
            watch_bytes_per_event: driven.watch_bytes_per_event,
            watch_cost: driven.watch_cost,
            flood: None,
            fleet: None,
            timeline: Some(timeline),
        })
    }

    /// Runs `loads` against this run's target for `duration`, with progress lines.
    pub async fn drive_loads(
        &self,
        loads: Vec<Load>,
        duration: Duration,
    ) -> anyhow::Result<Driven> {
        let started = Instant::now();
        let (classes, all) = spawn_loads(&self.target, loads, started + duration)?;
        let progress = self.progress(&classes);
        let joined = all.await;
        progress.abort();
        joined.context("a client loop panicked")?;
        let elapsed = started.elapsed();
        Ok(Driven {
            classes: classes
                .into_iter()
                .map(|(name, stats)| (name, stats, elapsed))
                .collect(),
            event_delivery_p99_ms: None,
            watch_bytes_per_event: None,
            watch_cost: None,
        })
    }

    /// Shows progress (each class's counts, each replica's peak heap so far) and records
    /// the run's timeline until the returned handle is aborted.
    pub fn progress(&self, classes: &[(String, Arc<ClassStats>)]) -> JoinHandle<()> {
        let fleet = self.fleet.clone();
        let sample: progress::Sampler = Arc::new(move || {
            fleet
                .stats()
                .iter()
                .map(|r| progress::ReplicaNow {
                    memory_bytes: r.heap_bytes,
                    peak_bytes: r.peak_heap_bytes,
                    ooms: r.ooms,
                })
                .collect()
        });
        progress::start(
            self.mode.name(),
            &classes.to_vec(),
            self.heap_limit,
            sample,
            self.timeline.clone(),
        )
    }
}

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A folder of this process's own for one run's files (configuration, logs), named apart
/// from every other run's; the run removes it.
fn run_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "bulwark-loadtest-{}-{}",
        std::process::id(),
        RUN_COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// What a scenario's drive produced.
pub struct Driven {
    /// Each class, its statistics and how long its load ran.
    pub classes: Vec<(String, Arc<ClassStats>, Duration)>,
    /// p99 write → event latency, for watch scenarios.
    pub event_delivery_p99_ms: Option<f64>,
    /// Watch stream bytes received per event, for watch scenarios.
    pub watch_bytes_per_event: Option<f64>,
    /// What the nodes' connections and watches cost, for `informers`.
    pub watch_cost: Option<report::WatchCost>,
}

/// Classes by name.
pub type Classes = Vec<(String, Arc<ClassStats>)>;

/// One request a client loop sends.
pub struct Req {
    /// Method.
    pub method: Method,
    /// Path and query.
    pub path: String,
    /// Body and its content type.
    pub body: Option<(Bytes, &'static str)>,
    /// How the answer is read.
    pub read: Read,
    /// Give up after this long (counted as an error).
    pub timeout: Duration,
}

impl Req {
    /// A GET whose body is counted and dropped.
    pub fn get(path: String, timeout: Duration) -> Req {
        Req {
            method: Method::GET,
            path,
            body: None,
            read: Read::Count,
            timeout,
        }
    }
}

/// What the identities of one class do, request after request.
pub struct Load {
    /// The class name (also the identities' group).
    pub class: String,
    /// Its identities.
    pub identities: Vec<Identity>,
    /// Interval between the starts of one identity's requests (a request that takes
    /// longer is followed at once).
    pub think: Duration,
    /// The next request of identity `i` on its `n`-th iteration.
    pub next: Arc<dyn Fn(usize, u64) -> Req + Send + Sync>,
}

/// Starts every identity of every load; each loops until `deadline` and hands its tally to
/// its class. Returns the classes at once; the handle finishes when all loops have.
pub fn spawn_loads(
    target: &Target,
    loads: Vec<Load>,
    deadline: Instant,
) -> anyhow::Result<(Classes, JoinHandle<()>)> {
    spawn_loads_at(loads, deadline, |_, _| target.clone(), None)
}

/// What a scenario hears of every outcome: the class, the identity's index in its load,
/// and the outcome.
pub type Observer = Arc<dyn Fn(&str, usize, &Outcome) + Send + Sync>;

/// Like [`spawn_loads`], with each identity's own target (`target_of(class, index)`: one
/// Bulwark of several, as a balancer pins connections) and an `observer` of every outcome.
pub fn spawn_loads_at(
    loads: Vec<Load>,
    deadline: Instant,
    target_of: impl Fn(&str, usize) -> Target,
    observer: Option<Observer>,
) -> anyhow::Result<(Classes, JoinHandle<()>)> {
    let mut classes = Vec::new();
    let mut tasks = Vec::new();
    for load in loads {
        let stats = ClassStats::new();
        classes.push((load.class.clone(), stats.clone()));
        for (i, identity) in load.identities.iter().enumerate() {
            let mut client = Client::new(&target_of(&load.class, i), identity)?;
            let stats = stats.clone();
            let next = load.next.clone();
            let think = load.think;
            let observer = observer.clone();
            let class = load.class.clone();
            tasks.push(tokio::spawn(async move {
                let mut tally = stats.tally();
                // Spread the first requests so that identities do not start in lockstep.
                let jitter = think.mul_f64(rand::random::<f64>());
                tokio::time::sleep(jitter.min(Duration::from_secs(1))).await;
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let req = next(i, n);
                    n += 1;
                    let sent = Instant::now();
                    let outcome = tokio::select! {
                        o = client.call(req.method, &req.path, req.body, req.read, req.timeout) => o,
                        _ = tokio::time::sleep_until(deadline) => break,
                    };
                    if let Some(observe) = &observer {
                        observe(&class, i, &outcome);
                    }
                    // `think` paces request starts (a fixed rate per identity); a 429's
                    // Retry-After or an error's back-off counts from now.
                    let resume = (sent + think).max(Instant::now() + tally.record(&outcome));
                    if resume >= deadline {
                        break;
                    }
                    tokio::time::sleep_until(resume).await;
                }
                stats.done(tally);
            }));
        }
    }
    let all = tokio::spawn(async move {
        for t in tasks {
            let _ = t.await;
        }
    });
    Ok((classes, all))
}

/// Whether a scenario's outcome for one request was a success; for scenario code that needs
/// the answer (e.g. a write's resourceVersion).
pub fn ok_body(outcome: &Outcome) -> Option<&Bytes> {
    match outcome {
        Outcome::Ok { body, .. } => body.as_ref(),
        _ => None,
    }
}

/// A scenario: the fleet it needs, its classes, and how its clients behave in one run.
pub trait Scenario {
    /// The name on the command line and in the report.
    fn name(&self) -> &'static str;
    /// The fleet it needs.
    fn setup(&self, opts: &Options) -> Setup;
    /// Drives one run's load against `env.target` and reports what the clients saw.
    fn drive(
        &self,
        env: &Env,
        pki: &Pki,
        opts: &Options,
    ) -> impl std::future::Future<Output = anyhow::Result<Driven>> + Send;
}

/// Runs a scenario against both targets, each on a fresh fleet, and builds the report.
pub async fn run<S: Scenario + Sync>(scenario: &S, opts: &Options) -> anyhow::Result<Report> {
    let pki = Arc::new(Pki::new());
    let setup = scenario.setup(opts);
    let mut runs = Vec::new();
    for mode in [Mode::Direct, Mode::Bulwark] {
        if opts
            .only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|o| o == mode.name()))
        {
            continue;
        }
        eprintln!("== {} ({}): starting", scenario.name(), mode.name());
        let env = Env::start(mode, &setup, pki.clone()).await?;
        let driven = scenario.drive(&env, &pki, opts).await?;
        let run = env.finish(driven).await?;
        eprintln!("== {} ({}): done", scenario.name(), mode.name());
        runs.push((mode.name().to_string(), run));
    }
    Ok(Report::new(scenario.name(), opts.scale, runs))
}
