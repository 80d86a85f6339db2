//! bulwark-loadtest: the incident scenarios, the demo and the sandbox — Bulwark against a
//! simulated kube-apiserver fleet, each scenario run once straight at the fleet and once
//! through Bulwark.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use bulwark_loadtest::controlplane::{self, ControlPlane};
use bulwark_loadtest::scenario::{self, Options};
use bulwark_loadtest::{calibrate, floor, identities, proxy_process, reference, report, sandbox};

/// Bulwark's load tester: each scenario runs against a fresh simulated apiserver fleet,
/// once directly (through an L4 balancer) and once through Bulwark, and prints a
/// comparison table.
#[derive(Parser, Debug)]
#[command(name = "bulwark-loadtest", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options of every scenario.
#[derive(Args, Debug, Clone)]
struct Common {
    /// Write the report as JSON to this file (and its HTML report beside it, as FILE.html).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the HTML report (charts and every figure) here instead (default: beside
    /// --json, else bulwark-loadtest-SCENARIO.html in the temporary folder).
    #[arg(long)]
    html: Option<PathBuf>,
    /// How long each run drives load, e.g. `30s` or `2m` (default: the scenario's own).
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Multiplies object and client counts.
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    scale: f64,
    /// Run only these targets (comma-separated: `direct`, `bulwark`, `haproxy`, `nginx`,
    /// `floor`, ...).
    #[arg(long, hide = true)]
    only: Option<String>,
    /// informers, node-join: nodes ask for protobuf first
    /// (`application/vnd.kubernetes.protobuf,application/json`), as kubelet and kube-proxy do.
    #[arg(long)]
    protobuf: bool,
    /// informers, node-join: `fieldSelector=metadata.name` watches of Secrets each node
    /// holds (a kubelet holds one per Secret its pods mount, about 10 to 15).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    secrets_per_node: u16,
    /// informers, node-join: each node's EndpointSlice watch on a connection of its own,
    /// as kube-proxy's is beside the kubelet's: two connections a node.
    #[arg(long)]
    kube_proxy_apart: bool,
    /// informers: how long the nodes take to connect, and then to start their watches
    /// (default 5 s, at most a quarter of the run); thousands of nodes need longer.
    #[arg(long, value_parser = humantime::parse_duration)]
    join_window: Option<Duration>,
    /// informers: EndpointSlice updates a second, each delivered to every node's kube-proxy.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1000))]
    slice_churn: u64,
    /// informers: EndpointSlices seeded, every kube-proxy listing and watching all of them
    /// (default 500 times --scale).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    endpointslices: Option<u64>,
}

/// `list-storm`'s and `informers`' options: the common ones, and a real control plane
/// instead of the simulator.
#[derive(Args, Debug, Clone)]
struct OnControlPlaneArgs {
    #[command(flatten)]
    common: Common,
    /// Run against a real control plane (etcd and kube-apiservers, each in a memory
    /// cgroup) instead of the simulated fleet; needs cgroup v1's memory controller.
    #[arg(long)]
    controlplane: bool,
    /// kube-apiserver replicas, with --controlplane.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
    replicas: u16,
    /// Each kube-apiserver's memory limit, with --controlplane: bytes, or with Ki, Mi, Gi.
    #[arg(long, value_parser = bytes, default_value = "1200Mi")]
    apiserver_memory_limit: u64,
}

/// `passthrough`'s options.
#[derive(Args, Debug, Clone)]
struct PassthroughArgs {
    #[command(flatten)]
    common: Common,
    /// Worker counts to measure the floor, Bulwark and haproxy with (comma-separated,
    /// e.g. `1,2,4,8`). Default: the floor and Bulwark with 1 and 2, haproxy with 1. Where
    /// the machine has the most of them plus four cores, the proxies, the upstream and
    /// h2load each get cores of their own.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=256))]
    workers: Vec<u16>,
    /// The size in bytes of the object every GET reads: the ConfigMap with its one value
    /// padded to it. Default: the bare ConfigMap (130 bytes). At most 4,000: the upstream,
    /// nginx, holds the answer as one value of its configuration, which it reads in 4 KiB.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4_000))]
    object_bytes: Option<u32>,
}

/// `fleet`'s options: a real control plane always.
#[derive(Args, Debug, Clone)]
struct FleetArgs {
    #[command(flatten)]
    common: Common,
    /// kube-apiserver replicas.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
    replicas: u16,
    /// Each kube-apiserver's memory limit: bytes, or with Ki, Mi, Gi.
    #[arg(long, value_parser = bytes, default_value = "1200Mi")]
    apiserver_memory_limit: u64,
}

/// `conn-flood`'s options.
#[derive(Args, Debug, Clone)]
struct ConnFloodArgs {
    #[command(flatten)]
    common: Common,
    /// Flood connections to open (the runner needs one descriptor each, so `ulimit -n`
    /// must exceed it).
    #[arg(long, default_value_t = 5_000)]
    connections: usize,
    /// Loopback source addresses the flood comes from (127.0.0.10 on).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=240))]
    sources: u16,
    /// Flood connection attempts in flight at once.
    #[arg(long, default_value_t = 50)]
    concurrency: usize,
    /// How long the flood is held once open, unless Bulwark closes it all before.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    hold: Duration,
    /// How long after the flood ends Bulwark's descriptors and memory are read again.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    settle: Duration,
    /// Bulwark's `listen.limits.unauthenticatedTimeout` (default: Bulwark's own).
    #[arg(long, value_parser = humantime::parse_duration)]
    unauthenticated_timeout: Option<Duration>,
    /// Also run this `bulwark` binary (`PATH serve --config FILE`), first, as `baseline`.
    #[arg(long, hide = true)]
    bulwark_bin: Option<PathBuf>,
    /// The baseline's configuration leaves out the keys of the connection caps, for a
    /// `bulwark` built before them.
    #[arg(long, hide = true, requires = "bulwark_bin")]
    legacy_config: bool,
    /// Bulwark's open-file limit, soft and hard (set with util-linux `prlimit`).
    #[arg(long, hide = true)]
    bulwark_fd_limit: Option<u64>,
    /// Each flood connection authenticates with a bearer token and is answered, then
    /// idles: what an idle client's connection costs.
    #[arg(long)]
    authenticated: bool,
    /// Also flood haproxy (one thread, TLS and HTTP/2 on both sides) in front of the same
    /// simulator, as `haproxy`, for its memory per connection beside Bulwark's.
    #[arg(long)]
    haproxy: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Many identities LIST all large Secrets in a loop; innocent clients and heartbeats
    /// carry on beside them.
    ListStorm(OnControlPlaneArgs),
    /// The list storm on a real control plane through three Bulwarks with clients pinned
    /// 70/20/10: direct, static split and Lease shares; one Bulwark killed and restarted.
    Fleet(FleetArgs),
    /// Long-lived HTTP/2 clients while one replica restarts.
    Skew(Common),
    /// Per-node informers on EndpointSlices and their own Secrets under churn.
    Informers(OnControlPlaneArgs),
    /// A monitoring agent per node LISTs Events every few seconds.
    EventsPoll(Common),
    /// A wave of new nodes start their informers within seconds.
    NodeJoin(Common),
    /// Raw proxy overhead on a small GET: direct, haproxy, nginx, the floor (a bare proxy
    /// of Bulwark's own crates) and Bulwark.
    Passthrough(PassthroughArgs),
    /// Thousands of TLS connections that collect a 401 and idle, while an authenticated
    /// client works and a new one connects: Bulwark's descriptors, memory and latency.
    ConnFlood(ConnFloodArgs),
    /// A two-minute, scaled-down list-storm plus skew: start here.
    Demo(Common),
    /// A fleet with Bulwark in front and kubeconfigs to try it with kubectl.
    Sandbox {
        /// Folder for the kubeconfigs, certificates and the `ready` file.
        #[arg(long)]
        dir: PathBuf,
        /// Bulwark's rules folder (default: the shipped `deploy/base/rules`, built in).
        #[arg(long)]
        rules: Option<PathBuf>,
        /// Bulwark replicas; more than one run behind a TCP balancer that the kubeconfigs
        /// point at, keeping one budget through Leases in namespace `bulwark`.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
        bulwark_replicas: u16,
    },
    /// A real control plane (etcd and kube-apiservers built from Kubernetes' Go modules,
    /// seeded with RBAC and objects) with Bulwark in front, and kubeconfigs to try it with.
    Controlplane {
        /// Folder for certificates, etcd's data, logs, kubeconfigs and the `ready` file.
        #[arg(long)]
        dir: PathBuf,
        /// kube-apiserver replicas.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
        replicas: u16,
        /// Each kube-apiserver's memory limit, enforced by a cgroup v1 memory cgroup (bytes,
        /// or with a Ki, Mi or Gi suffix); an OOM-killed replica is restarted.
        #[arg(long, value_parser = bytes)]
        apiserver_memory_limit: Option<u64>,
        /// Bulwark's rules folder (default: the shipped `deploy/base/rules` and the loadtest's
        /// own `loadtest/rules`, built in).
        #[arg(long)]
        rules: Option<PathBuf>,
        /// Bulwark replicas; more than one run behind a TCP balancer that the kubeconfigs
        /// point at, keeping one budget through Leases in namespace `bulwark`.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
        bulwark_replicas: u16,
        /// With several Bulwarks: each takes a static 1/N of every budget instead of
        /// sharing through Leases.
        #[arg(long)]
        static_split: bool,
    },
    /// A whole cluster on the real control plane, direct (through an L4 balancer) and
    /// through Bulwark on the same seed: KWOK nodes, kube-controller-manager and
    /// kube-scheduler running a burst of Jobs, an agent per node, probe kubelets and a LIST
    /// storm of large Secrets, each as itself under the shipped rules; NotReady nodes,
    /// Lease renewal latency, Job times, apiserver memory and OOM kills, LISTs and WATCHes
    /// at the apiservers, who was refused.
    Cluster {
        /// Folder for the control plane's files and logs.
        #[arg(long)]
        dir: PathBuf,
        /// Simulated nodes (KWOK).
        #[arg(long, default_value_t = 1000)]
        nodes: usize,
        /// Probe nodes renewing their own Leases, timed at the client (default: one per
        /// 20 nodes, 3 at least).
        #[arg(long)]
        probes: Option<usize>,
        /// LIST storm identities listing every Secret (0: no storm).
        #[arg(long, default_value_t = 10)]
        storm: usize,
        /// Secrets of 100 KiB seeded for the storm.
        #[arg(long, default_value_t = 600)]
        storm_secrets: usize,
        /// The front doors to run, in order: `direct`, `bulwark` or both.
        #[arg(long, default_value = "direct,bulwark")]
        only: String,
        /// Jobs created at once.
        #[arg(long, default_value_t = 3)]
        jobs: usize,
        /// Pods per Job.
        #[arg(long, default_value_t = 200)]
        pods_per_job: u64,
        /// kube-apiserver replicas.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
        replicas: u16,
        /// Each kube-apiserver's memory limit (cgroup v1), e.g. 1200Mi.
        #[arg(long, value_parser = bytes)]
        apiserver_memory_limit: Option<u64>,
        /// Bulwark replicas (behind an L4 balancer, one budget through Leases).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
        bulwark_replicas: u16,
        /// How long the cluster runs after the burst, its Leases watched.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
        settle: std::time::Duration,
        /// Without the per-node agents (`system:node:<name>` listing and watching its pods,
        /// its Secret and the EndpointSlices).
        #[arg(long)]
        no_agents: bool,
        /// Write the figures as JSON here (the HTML report goes beside it).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Draws the HTML report of a recorded `--json` result again.
    Report {
        /// The recorded result.
        json: PathBuf,
        /// Where the HTML report goes (default: beside the result, as .html).
        #[arg(long)]
        html: Option<PathBuf>,
        /// Also write each chart as its own SVG file into this folder.
        #[arg(long)]
        charts: Option<PathBuf>,
    },
    /// Draws the figures of the scenario reference pages (`scenarios/*.md`) again from the
    /// recorded results they name.
    Reference {
        /// The pages' folder (default: this source tree's `loadtest/runner/scenarios`).
        dir: Option<PathBuf>,
        /// Change nothing: fail when a page's figures are not its results'.
        #[arg(long)]
        check: bool,
    },
    /// Runs Bulwark itself (used by the scenarios, which start it as its own process).
    #[command(name = "__bulwark", hide = true)]
    Bulwark {
        /// Bulwark's configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Runs `bulwark guard` (started by the control plane beside the apiservers).
    #[command(name = "__bulwark-guard", hide = true)]
    BulwarkGuard {
        /// Bulwark's configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Times a fixed amount of CPU and memory work and prints its milliseconds
    /// (`src/calibrate.rs`; run by `passthrough` on the proxy's core).
    #[command(name = "__calibrate", hide = true)]
    Calibrate,
    /// Runs the floor, the bare reverse proxy `passthrough` measures Bulwark against
    /// (`src/floor.rs`; started by the scenario as its own process).
    #[command(name = "__floor", hide = true)]
    Floor {
        /// Where to listen.
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// The serving certificate chain, PEM.
        #[arg(long)]
        cert: PathBuf,
        /// Its private key, PEM.
        #[arg(long)]
        key: PathBuf,
        /// The upstream's TLS address.
        #[arg(long)]
        upstream: std::net::SocketAddr,
        /// The CA the upstream's certificate must chain to, PEM.
        #[arg(long)]
        upstream_ca: PathBuf,
        /// Worker threads, each with its own runtime, listener and upstream connection.
        #[arg(long, default_value_t = 1)]
        workers: usize,
    },
}

/// Raises the open-file limit to the hard limit: scenarios open thousands of connections.
fn raise_fd_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    if let Err(e) = setrlimit(Resource::Nofile, raised) {
        eprintln!("note: could not raise the open-file limit: {e}");
    }
}

/// The same allocator as the `bulwark` binary, so that Bulwark measured from this binary
/// (its hidden subcommand) is the Bulwark that ships.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    raise_fd_limit();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Bulwark { .. } | Command::BulwarkGuard { .. } | Command::Floor { .. }
    ) {
        // The subscriber the `bulwark` binary installs, in the floor too: without one,
        // every span hyper and h2 make falls back to the `log` crate (the tree enables
        // tracing's `log` feature), a cost per request that a bare proxy does not pay.
        // Colours only on a terminal, as the `bulwark` binary: the scenarios send its
        // stderr to a log file.
        use std::io::IsTerminal as _;
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .init();
    }
    if let Command::Bulwark { config } = &cli.command {
        // Bulwark on the runtime the `bulwark` binary builds.
        let runtime = bulwark::serve::runtime().context("starting the async runtime")?;
        return runtime.block_on(proxy_process::serve(config));
    }
    if let Command::BulwarkGuard { config } = &cli.command {
        let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
        return runtime.block_on(proxy_process::guard(config));
    }
    if let Command::Calibrate = cli.command {
        println!("{:.3}", calibrate::run().as_secs_f64() * 1e3);
        return Ok(());
    }
    if let Command::Floor {
        listen,
        cert,
        key,
        upstream,
        upstream_ca,
        workers,
    } = cli.command
    {
        return floor::run(&floor::Settings {
            listen,
            cert,
            key,
            upstream,
            upstream_ca,
            workers,
        });
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(cli.command))
}

// Over 120 lines: one arm per subcommand, each handing its options to its scenario.
async fn run(command: Command) -> anyhow::Result<()> {
    use scenario::{
        demo::Demo, events_poll::EventsPoll, informers::Informers, informers::NodeJoin,
        list_storm::ListStorm, passthrough, skew::Skew,
    };
    let (report, common) = match command {
        Command::Bulwark { .. }
        | Command::BulwarkGuard { .. }
        | Command::Floor { .. }
        | Command::Calibrate => {
            unreachable!("main runs Bulwark and the floor on their own runtimes")
        }
        Command::Report { json, html, charts } => return redraw(&json, html, charts),
        Command::Reference { dir, check } => {
            let dir = dir.unwrap_or_else(reference::pages_dir);
            let stale = reference::run(&dir, check)?;
            for page in &stale {
                println!(
                    "{} {}",
                    if check {
                        "out of date:"
                    } else {
                        "drawn again:"
                    },
                    page.display()
                );
            }
            if check && !stale.is_empty() {
                anyhow::bail!(
                    "{} page(s) do not show their results' figures: run `bulwark-loadtest reference`",
                    stale.len()
                );
            }
            return Ok(());
        }
        Command::Sandbox {
            dir,
            rules,
            bulwark_replicas,
        } => {
            // Bulwark's own log lines (refusals, reloads) go to DIR/bulwark.log, as in a pod.
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let log = dir.join("bulwark.log");
            let file = std::fs::File::create(&log)
                .with_context(|| format!("creating {}", log.display()))?;
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .init();
            return sandbox::run(&dir, rules, usize::from(bulwark_replicas)).await;
        }
        Command::Cluster {
            dir,
            nodes,
            probes,
            storm,
            storm_secrets,
            only,
            jobs,
            pods_per_job,
            replicas,
            apiserver_memory_limit,
            bulwark_replicas,
            settle,
            no_agents,
            json,
        } => {
            let mut options = scenario::cluster::ClusterOptions::new(dir, nodes);
            options.probes = probes.unwrap_or(options.probes);
            options.storm = storm;
            options.storm_secrets = storm_secrets;
            options.fronts = scenario::cluster::Front::parse_list(&only)?;
            options.jobs = jobs;
            options.pods_per_job = pods_per_job;
            options.replicas = usize::from(replicas);
            options.memory_limit = apiserver_memory_limit;
            options.bulwarks = usize::from(bulwark_replicas);
            options.settle = settle;
            options.agents = !no_agents;
            let mut report = scenario::cluster::run(&options).await?;
            report.command = command_line();
            let html = json.as_ref().map_or_else(
                || std::env::temp_dir().join("bulwark-loadtest-cluster.html"),
                |j| j.with_extension("html"),
            );
            report::outcome::write(&report, json.as_deref(), &html)?;
            println!(
                "{}\nThe report, with charts: {}",
                report::Outcome::verdict(&report),
                html.display()
            );
            return Ok(());
        }
        Command::Controlplane {
            dir,
            replicas,
            apiserver_memory_limit,
            rules,
            bulwark_replicas,
            static_split,
        } => {
            let mut opts = controlplane::Options::new(dir);
            opts.replicas = usize::from(replicas);
            opts.apiserver_memory_limit = apiserver_memory_limit;
            opts.rules = rules;
            opts.bulwarks = usize::from(bulwark_replicas);
            if static_split {
                opts.fleet = controlplane::FleetMode::Static;
            }
            return run_controlplane(opts).await;
        }
        Command::ListStorm(a) if a.controlplane => {
            let cp = scenario::on_controlplane::ControlPlaneOptions {
                replicas: usize::from(a.replicas),
                memory_limit: a.apiserver_memory_limit,
                bulwark_exe: None,
            };
            let report = scenario::on_controlplane::list_storm(&opts(&a.common), &cp).await?;
            (report, a.common)
        }
        Command::ListStorm(a) => (scenario::run(&ListStorm, &opts(&a.common)).await?, a.common),
        Command::Fleet(a) => {
            let cp = scenario::on_controlplane::ControlPlaneOptions {
                replicas: usize::from(a.replicas),
                memory_limit: a.apiserver_memory_limit,
                bulwark_exe: None,
            };
            let report = scenario::fleet::run(&opts(&a.common), &cp).await?;
            (report, a.common)
        }
        Command::Skew(c) => (scenario::run(&Skew, &opts(&c)).await?, c),
        Command::Informers(a) if a.controlplane => {
            let cp = scenario::on_controlplane::ControlPlaneOptions {
                replicas: usize::from(a.replicas),
                memory_limit: a.apiserver_memory_limit,
                bulwark_exe: None,
            };
            let report = scenario::on_controlplane::informers(&opts(&a.common), &cp).await?;
            (report, a.common)
        }
        Command::Informers(a) => (scenario::run(&Informers, &opts(&a.common)).await?, a.common),
        Command::EventsPoll(c) => (scenario::run(&EventsPoll, &opts(&c)).await?, c),
        Command::NodeJoin(c) => (scenario::run(&NodeJoin, &opts(&c)).await?, c),
        Command::Demo(c) => (scenario::run(&Demo, &opts(&c)).await?, c),
        Command::Passthrough(a) => {
            let workers: Vec<usize> = a.workers.iter().map(|&n| usize::from(n)).collect();
            (
                passthrough::run(&opts(&a.common), &workers, a.object_bytes).await?,
                a.common,
            )
        }
        Command::ConnFlood(a) => {
            let flood = scenario::conn_flood::FloodOptions {
                connections: a.connections,
                sources: usize::from(a.sources),
                concurrency: a.concurrency,
                hold: a.hold,
                settle: a.settle,
                unauthenticated_timeout: a.unauthenticated_timeout,
                bulwark_bin: a.bulwark_bin,
                legacy_config: a.legacy_config,
                bulwark_fd_limit: a.bulwark_fd_limit,
                authenticated: a.authenticated,
                haproxy: a.haproxy,
            };
            (
                scenario::conn_flood::run(&opts(&a.common), &flood).await?,
                a.common,
            )
        }
    };
    println!();
    print!("{}", report::table(&report));
    let html = common.html.clone().unwrap_or_else(|| match &common.json {
        Some(json) => json.with_extension("html"),
        None => std::env::temp_dir().join(format!("bulwark-loadtest-{}.html", report.scenario)),
    });
    report::outcome::write(&report, common.json.as_deref(), &html)?;
    println!(
        "\n{}\nThe report, with charts: {}",
        report::charts::verdict(&report),
        html.display()
    );
    Ok(())
}

/// This run's command line, as a reader would type it again.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("bulwark-loadtest {}", args.join(" "))
}

/// `report`: the HTML report of a recorded result, and each chart as SVG if asked.
fn redraw(
    json: &std::path::Path,
    html: Option<PathBuf>,
    charts: Option<PathBuf>,
) -> anyhow::Result<()> {
    let outcome = scenario::recorded(json)?;
    let html = html.unwrap_or_else(|| json.with_extension("html"));
    report::outcome::write(outcome.as_ref(), None, &html)?;
    println!("{}", outcome.verdict());
    println!("wrote {}", html.display());
    if let Some(dir) = charts {
        for (path, title) in report::outcome::write_charts(outcome.as_ref(), &dir)? {
            println!("wrote {} ({title})", path.display());
        }
    }
    Ok(())
}

/// `controlplane`: starts it, says how to use it, and stops it on Ctrl-C or SIGTERM with
/// each replica's figures.
async fn run_controlplane(opts: controlplane::Options) -> anyhow::Result<()> {
    let began = std::time::Instant::now();
    let replicas = opts.replicas;
    let cp = ControlPlane::start(opts)
        .await
        .context("starting the control plane")?;
    let d = cp.dir().display();
    let kubectl = cp.binaries().kubectl();
    let k = kubectl.display();
    println!(
        "Control plane ready in {:.1} s (etcd and {replicas} kube-apiservers ready in {:.1} s): \
         Bulwark on https://{}, replicas {:?}, etcd on {}",
        began.elapsed().as_secs_f64(),
        cp.started_in().as_secs_f64(),
        cp.bulwark_addr(),
        cp.replica_addrs(),
        cp.etcd_addr().map(|a| a.to_string()).unwrap_or_default(),
    );
    println!("  {k} --kubeconfig {d}/kubeconfig-admin get secrets -A");
    println!("  {k} --kubeconfig {d}/kubeconfig-operator get configmaps -A");
    println!(
        "  {k} --kubeconfig {d}/kubeconfig-node-1 -n {} get secret {}",
        identities::NODE_NAMESPACE,
        identities::NODE_SECRETS[0]
    );
    println!("  {k} --kubeconfig {d}/kubeconfig-nobody get secrets     # forbidden");
    println!("  {k} --kubeconfig {d}/kubeconfig-operator auth whoami");
    println!(
        "  {k} --kubeconfig {d}/kubeconfig-direct-admin get --raw /readyz   # straight to replica 0"
    );
    let admins = cp.bulwark_admin_addrs();
    if admins.len() > 1 {
        println!(
            "  {} Bulwarks {:?} behind the TCP balancer on {}",
            admins.len(),
            cp.bulwark_addrs(),
            cp.bulwark_addr()
        );
        for admin in &admins {
            println!(
                "  Bulwark metrics: http://{admin}/metrics, its fleet: http://{admin}/debug/fleet"
            );
        }
    } else if let Some(admin) = cp.bulwark_admin_addr() {
        println!("  Bulwark metrics: http://{admin}/metrics");
    }
    match admins.len() {
        1 => println!("  Logs: {d}/apiserver-N.log, {d}/etcd.log, {d}/bulwark/bulwark.log"),
        _ => println!("  Logs: {d}/apiserver-N.log, {d}/etcd.log, {d}/bulwark-N/bulwark.log"),
    }
    println!("Ctrl-C to stop.");
    sandbox::wait_for_signal().await;
    let report = cp.report();
    cp.stop().await?;
    for (i, r) in report.iter().enumerate() {
        let memory = match (r.peak_memory_bytes, r.memory_limit_bytes) {
            (Some(peak), Some(limit)) => format!(
                ", peak memory {} of {}",
                report::human_bytes(peak),
                report::human_bytes(limit)
            ),
            _ => String::new(),
        };
        println!(
            "replica {i} ({}): {} OOM kills, {} restarts{memory}",
            r.addr, r.oom_kills, r.restarts
        );
    }
    Ok(())
}

/// A byte count: a plain number, or one with a `Ki`, `Mi` or `Gi` suffix.
fn bytes(s: &str) -> Result<u64, String> {
    let (digits, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let shift = match unit {
        "" => 0,
        "Ki" => 10,
        "Mi" => 20,
        "Gi" => 30,
        _ => return Err(format!("{s:?}: the unit must be Ki, Mi or Gi")),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?} is not a positive byte count"))
}

/// `--scale` must be a positive finite number.
fn positive_scale(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

fn opts(c: &Common) -> Options {
    Options {
        duration: c.duration,
        scale: c.scale,
        only: c.only.clone(),
        protobuf: c.protobuf,
        secrets_per_node: usize::from(c.secrets_per_node),
        kube_proxy_apart: c.kube_proxy_apart,
        join_window: c.join_window,
        slice_churn: c.slice_churn,
        endpointslices: c.endpointslices.map(|n| n as usize),
    }
}
