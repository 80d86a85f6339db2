//! bulwark-loadtest: the incident scenarios, the demo and the sandbox — Bulwark against a
//! simulated kube-apiserver fleet, each scenario run once straight at the fleet and once
//! through Bulwark.

mod client;
mod proxy_process;
mod report;
mod sandbox;
mod scenario;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::scenario::Options;

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
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// How long each run drives load, e.g. `30s` or `2m` (default: the scenario's own).
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Multiplies object and client counts.
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    scale: f64,
    /// Run only these targets (comma-separated: `direct`, `bulwark`, `haproxy`, `nginx`).
    #[arg(long, hide = true)]
    only: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Many identities LIST all large Secrets in a loop; innocent clients and heartbeats
    /// carry on beside them.
    ListStorm(Common),
    /// Long-lived HTTP/2 clients while one replica restarts.
    Skew(Common),
    /// Per-node informers on EndpointSlices and their own Secrets under churn.
    Informers(Common),
    /// A monitoring agent per node LISTs Events every few seconds.
    EventsPoll(Common),
    /// A wave of new nodes start their informers within seconds.
    NodeJoin(Common),
    /// Raw proxy overhead on a small GET: direct, Bulwark, haproxy and nginx.
    Passthrough(Common),
    /// A two-minute, scaled-down list-storm plus skew: start here.
    Demo(Common),
    /// A fleet with Bulwark in front and kubeconfigs to try it with kubectl.
    Sandbox {
        /// Folder for the kubeconfigs, certificates and the `ready` file.
        #[arg(long)]
        dir: PathBuf,
        /// Bulwark's rules folder (default: the shipped `rules/examples`, built in).
        #[arg(long)]
        rules: Option<PathBuf>,
    },
    /// Runs Bulwark itself (used by the scenarios, which start it as its own process).
    #[command(name = "__bulwark", hide = true)]
    Bulwark {
        /// Bulwark's configuration file.
        #[arg(long)]
        config: PathBuf,
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

fn main() -> anyhow::Result<()> {
    raise_fd_limit();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(cli.command))
}

async fn run(command: Command) -> anyhow::Result<()> {
    use scenario::{
        demo::Demo, events_poll::EventsPoll, informers::Informers, informers::NodeJoin,
        list_storm::ListStorm, passthrough, skew::Skew,
    };
    let (report, common) = match command {
        Command::Bulwark { config } => {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .init();
            return proxy_process::serve(&config).await;
        }
        Command::Sandbox { dir, rules } => return sandbox::run(&dir, rules).await,
        Command::ListStorm(c) => (scenario::run(&ListStorm, &opts(&c)).await?, c),
        Command::Skew(c) => (scenario::run(&Skew, &opts(&c)).await?, c),
        Command::Informers(c) => (scenario::run(&Informers, &opts(&c)).await?, c),
        Command::EventsPoll(c) => (scenario::run(&EventsPoll, &opts(&c)).await?, c),
        Command::NodeJoin(c) => (scenario::run(&NodeJoin, &opts(&c)).await?, c),
        Command::Demo(c) => (scenario::run(&Demo, &opts(&c)).await?, c),
        Command::Passthrough(c) => (passthrough::run(&opts(&c)).await?, c),
    };
    println!();
    print!("{}", report::table(&report));
    if let Some(path) = &common.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
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
    }
}
