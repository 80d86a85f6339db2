//! `sandbox --dir DIR`: a 3-replica simulated fleet with Bulwark in front, freshly minted
//! certificates, and kubeconfigs for a few typical identities, so that a person can point
//! kubectl at Bulwark at once. With `--bulwark-replicas N`, N Bulwarks sharing one budget
//! through Leases behind an L4 balancer. Runs until interrupted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use base64::Engine as _;
use bulwark::serve::Running;
use bulwark_sim::policy::{Policy, PolicyRule};
use bulwark_testkit::{Cluster, Setup};

use crate::balancer::{Balancer, Pick};
use crate::identities::{NODE, NODE_NAMESPACE, NODE_SECRETS, OPERATORS, Servers, kubeconfigs};
use crate::proxy_process::{fleet_setting, write_shipped_rules};

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Who may do what in the sandbox: masters everything (built into the simulator), the
/// operator reads secrets and configmaps everywhere, the node reads its own two secrets,
/// Bulwark reviews, reads and keeps its fleet's Leases, everyone authenticated may read
/// discovery.
fn policy() -> Policy {
    let rule = |groups: &[&str], users: &[&str], verbs: &[&str], resources: &[&str]| PolicyRule {
        groups: strings(groups),
        users: strings(users),
        verbs: strings(verbs),
        resources: strings(resources),
        ..PolicyRule::default()
    };
    let mut node = rule(
        &[],
        &[&format!("system:node:{NODE}")],
        &["get", "list", "watch"],
        &["secrets"],
    );
    node.namespaces = strings(&[NODE_NAMESPACE]);
    node.names = strings(&NODE_SECRETS);
    let mut bulwark_reads = rule(&["bulwark:proxies"], &[], &["get", "list", "watch"], &["*"]);
    bulwark_reads.non_resource_urls = strings(&["*"]);
    let mut discovery = rule(&["system:authenticated"], &[], &["get"], &[]);
    discovery.non_resource_urls = strings(&[
        "/api",
        "/api/*",
        "/apis",
        "/apis/*",
        "/version",
        "/openapi/*",
        "/healthz",
        "/readyz",
        "/livez",
    ]);
    Policy {
        rules: vec![
            rule(
                &[OPERATORS],
                &[],
                &["get", "list", "watch"],
                &["secrets", "configmaps"],
            ),
            node,
            rule(
                &["bulwark:proxies"],
                &[],
                &["create"],
                &[
                    "tokenreviews.authentication.k8s.io",
                    "subjectaccessreviews.authorization.k8s.io",
                ],
            ),
            bulwark_reads,
            rule(
                &["bulwark:proxies"],
                &[],
                &["create", "update"],
                &["leases.coordination.k8s.io"],
            ),
            discovery,
        ],
    }
}

/// Runs the sandbox until Ctrl-C or SIGTERM: the test kit's cluster (a simulated fleet with
/// Bulwark in front, in this process) with the sandbox's policy and objects; with
/// `bulwarks` > 1, that many Bulwarks sharing one budget through Leases behind a
/// round-robin L4 balancer, all serving with certificates from the replicas' CA.
/// Bulwark loads the rules in `rules`, or the built-in copy of the shipped ones
/// (`deploy/base/rules`) without it, and enforces them (`rules.mode: enforce`; the
/// deployments install in shadow mode).
// Over 120 lines: the sandbox's start in the order a person reads it (certificates, the
// fleet, Bulwarks, kubeconfigs, the commands printed), each step naming the last one's
// files.
pub async fn run(dir: &Path, rules: Option<PathBuf>, bulwarks: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ready = dir.join("ready");
    let _ = std::fs::remove_file(&ready);
    let bulwark_dir = dir.join("bulwark");
    let rules = match rules {
        Some(folder) => std::path::absolute(&folder)
            .with_context(|| format!("locating the rules folder {}", folder.display()))?,
        None => write_shipped_rules(&bulwark_dir.join("rules"))?,
    };
    // Who is throttled, named: the ten identities refused most get their own series.
    let mut settings: Vec<(&'static str, &'static str)> =
        vec![("metrics.identities", "10"), ("rules.mode", "enforce")];
    match bulwarks {
        // One JSON line per request beside the audit log (one Bulwark: the others would
        // share its file).
        0 | 1 => settings.push((
            "accessLog",
            format!("{{path: {}}}", bulwark_dir.join("access.jsonl").display()).leak(),
        )),
        // Leaked once: the settings live as long as the sandbox, which is the process.
        n => settings.extend([
            ("upstream.bulwarkReplicas", &*n.to_string().leak()),
            ("fleet", fleet_setting(0).leak()),
        ]),
    }
    let cluster = Cluster::start(Setup {
        replicas: 3,
        seed: vec![
            "secrets=30x2KiB@default,ns-0,ns-1",
            "configmaps=30x1KiB@default,ns-0,ns-1",
            "endpointslices=12x1KiB@default,ns-0,ns-1",
        ],
        rules_folder: Some(rules),
        cache: true,
        policy: policy(),
        bookmark_interval: Duration::from_secs(60),
        dir: Some(bulwark_dir),
        settings,
        ..Setup::default()
    })
    .await;
    for name in NODE_SECRETS {
        let secret = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": NODE_NAMESPACE},
            "type": "Opaque",
            "data": {"token": base64::engine::general_purpose::STANDARD.encode(format!("{name} value"))},
        });
        cluster
            .fleet
            .store()
            .create("secrets", NODE_NAMESPACE, secret)
            .map_err(|e| anyhow::anyhow!("creating secret {name}: {e}"))?;
    }
    let cluster = cluster.ready().await;
    // The others run with the first one's configuration and certificates, as themselves.
    let mut others = Vec::new();
    for i in 1..bulwarks {
        let name = format!("bulwark-{i}");
        others.push(
            cluster
                .start_another(&name, &[("fleet", &fleet_setting(i))])
                .await,
        );
    }
    let all: Vec<&Running> = std::iter::once(&cluster.bulwark).chain(&others).collect();
    let balancer = if others.is_empty() {
        None
    } else {
        let backends = all.iter().map(|b| b.addr).collect();
        Some(Balancer::start(backends, Pick::RoundRobin).await?)
    };
    let server = balancer.as_ref().map_or(cluster.bulwark.addr, |b| b.addr);
    let replica = *cluster
        .fleet
        .addrs()
        .first()
        .context("the fleet has no replica")?;
    // Every Bulwark serves with a certificate from the replicas' CA.
    let ca_pem = cluster.pki.server_ca.cert_pem();
    let servers = Servers {
        bulwark: server,
        bulwark_ca: &ca_pem,
        replica,
        replica_ca: &ca_pem,
    };
    for (file, text) in kubeconfigs(&servers, &cluster.pki.client_ca) {
        let path = dir.join(file);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let listing: String = all
        .iter()
        .map(|b| format!("https://{} http://{}\n", b.addr, b.admin_addr))
        .collect();
    let listing_path = dir.join("bulwarks");
    std::fs::write(&listing_path, listing)
        .with_context(|| format!("writing {}", listing_path.display()))?;
    std::fs::write(&ready, format!("bulwark https://{server}\n"))?;
    let d = dir.display();
    if others.is_empty() {
        println!(
            "Sandbox ready: Bulwark on https://{server}, apiserver replicas {:?}",
            cluster.fleet.addrs()
        );
    } else {
        println!(
            "Sandbox ready: {} Bulwarks behind the balancer on https://{server}, \
             apiserver replicas {:?}",
            all.len(),
            cluster.fleet.addrs()
        );
    }
    println!("  kubectl --kubeconfig {d}/kubeconfig-admin get secrets -A");
    println!("  kubectl --kubeconfig {d}/kubeconfig-operator get configmaps -A");
    println!(
        "  kubectl --kubeconfig {d}/kubeconfig-node-1 -n {NODE_NAMESPACE} get secret {}",
        NODE_SECRETS[0]
    );
    println!("  kubectl --kubeconfig {d}/kubeconfig-nobody get secrets     # forbidden");
    println!(
        "  kubectl --kubeconfig {d}/kubeconfig-direct-admin get secrets -A   # straight to a replica"
    );
    match all.as_slice() {
        [one] => {
            let admin = one.admin_addr;
            println!(
                "  Bulwark metrics: http://{admin}/metrics, who is throttled: http://{admin}/debug/flows"
            );
            println!("  Bulwark's log: {d}/bulwark.log, its access log: {d}/bulwark/access.jsonl");
        }
        several => {
            for (i, b) in several.iter().enumerate() {
                let admin = b.admin_addr;
                println!(
                    "  bulwark-{i} on https://{}: metrics http://{admin}/metrics, \
                     its fleet http://{admin}/debug/fleet, its flows http://{admin}/debug/flows",
                    b.addr
                );
            }
        }
    }
    println!("Ctrl-C to stop.");
    wait_for_signal().await;
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&listing_path);
    drop(balancer);
    // The Bulwarks drain first; the fleet stops when it goes out of scope.
    futures::join!(
        cluster.stop(),
        futures::future::join_all(others.into_iter().map(Running::drain)),
    );
    Ok(())
}

/// Ctrl-C or SIGTERM, whichever comes first.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
