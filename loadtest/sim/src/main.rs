//! The `bulwark-sim` binary: starts a simulated apiserver fleet, writes its PKI, a policy
//! and a kubeconfig into a directory, prints the addresses, and serves until Ctrl-C.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use bulwark_sim::{Fleet, HeapModel, Policy, Seed, SimConfig};
use clap::Parser;

/// Command-line flags.
#[derive(Parser, Debug)]
#[command(name = "bulwark-sim", about = "A simulated kube-apiserver fleet")]
struct Args {
    /// Number of replicas.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Objects to create first, e.g. `secrets=5000x10KiB` or `configmaps=10x1KiB@a,b`.
    #[arg(long)]
    seed: Vec<Seed>,
    /// Directory for ca.crt, client certs, policy.yaml and kubeconfig.
    #[arg(long)]
    dir: PathBuf,
    /// Policy file (YAML); default: only system:masters may do anything.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Heap at which a replica OOMs, in MiB (default: never).
    #[arg(long)]
    heap_limit_mib: Option<u64>,
    /// Base heap of a replica in MiB.
    #[arg(long, default_value_t = 64)]
    heap_base_mib: u64,
    /// Restart time after an OOM, e.g. `2s`.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    restart: Duration,
    /// Watch bookmark period.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    bookmark_interval: Duration,
    /// Watch-cache window in events.
    #[arg(long, default_value_t = 10_000)]
    event_ring: usize,
    /// Reject requests without credentials (`--anonymous-auth=false`).
    #[arg(long)]
    no_anonymous: bool,
    /// Also start the L4 balancer.
    #[arg(long)]
    l4: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let policy = match &args.policy {
        Some(p) => Policy::from_yaml(&std::fs::read_to_string(p)?)
            .with_context(|| format!("parsing {}", p.display()))?,
        None => Policy::default(),
    };
    let cfg = SimConfig {
        replicas: args.replicas,
        policy: policy.clone(),
        seed: args.seed.clone(),
        heap: HeapModel {
            base_bytes: args.heap_base_mib << 20,
            limit_bytes: args.heap_limit_mib.map(|m| m << 20),
            restart: args.restart,
        },
        event_ring: args.event_ring,
        bookmark_interval: args.bookmark_interval,
        anonymous: !args.no_anonymous,
        ..SimConfig::default()
    };
    let pki = cfg.pki.clone();
    let fleet = Fleet::start(cfg).await?;
    let dir = &args.dir;
    std::fs::write(dir.join("ca.crt"), pki.server_ca.cert_pem())?;
    std::fs::write(dir.join("client-ca.crt"), pki.client_ca.cert_pem())?;
    std::fs::write(
        dir.join("front-proxy-ca.crt"),
        pki.front_proxy_ca.cert_pem(),
    )?;
    let admin = pki.client_ca.client_cert("admin", &["system:masters"]);
    admin.write(dir, "admin")?;
    pki.front_proxy_ca
        .client_cert("front-proxy-client", &[])
        .write(dir, "front-proxy-client")?;
    std::fs::write(dir.join("policy.yaml"), serde_norway::to_string(&policy)?)?;
    let first = fleet.addrs()[0];
    std::fs::write(
        dir.join("kubeconfig"),
        bulwark_sim::client::kubeconfig(&pki, &format!("https://{first}"), &admin),
    )?;
    for (i, a) in fleet.addrs().iter().enumerate() {
        println!("replica {i}: https://{a}");
    }
    if args.l4 {
        println!("l4 balancer: https://{}", fleet.l4_balancer().await?);
    }
    println!(
        "files in {} (kubeconfig uses replica 0 as system:masters)",
        dir.display()
    );
    tokio::signal::ctrl_c().await?;
    Ok(())
}
