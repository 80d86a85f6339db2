//! `list-storm --controlplane`: the list storm against a real control plane (etcd and
//! kube-apiservers, each in a memory cgroup the kernel enforces) instead of the simulated
//! fleet. `direct` reaches the replicas through a TCP balancer (each connection to the
//! next replica, as a cloud load balancer does), `bulwark` through Bulwark; each run gets
//! a fresh control plane. The apiservers' figures are the kernel's: cgroup peak memory and
//! OOM kills.
//!
//! `informers --controlplane` runs the informers scenario the same way; its figures are
//! the watches the replicas count open on their own `/metrics` and event delivery.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::list_storm::{self, Sizes};
use super::{Classes, Mode, Options, informers, spawn_loads};
use crate::balancer::{Balancer, Pick};
use crate::client::Target;
use crate::controlplane::{self, ControlPlane};
use crate::report::{self, Report, Run};

/// The control plane each run starts.
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    /// kube-apiserver replicas.
    pub replicas: usize,
    /// Each replica's memory limit in bytes.
    pub memory_limit: u64,
    /// A `bulwark-loadtest` binary to run Bulwark with; `None` is this very binary.
    pub bulwark_exe: Option<std::path::PathBuf>,
}

impl ControlPlaneOptions {
    /// The control plane of one run in `dir`: these replicas and memory limit, `seeds`
    /// created first, every authenticated user allowed everything (as the simulated fleet).
    pub(crate) fn options(
        &self,
        dir: &std::path::Path,
        seeds: &[bulwark_sim::Seed],
    ) -> controlplane::Options {
        let mut options = controlplane::Options::new(dir);
        options.replicas = self.replicas;
        options.apiserver_memory_limit = Some(self.memory_limit);
        options.seed = seeds.to_vec();
        options.open_rbac = true;
        options.bulwark_exe = self.bulwark_exe.clone();
        options
    }

    /// The apiservers' figures from the control plane's `report` at the end of a run: the
    /// kernel's peak memory and OOM kills per replica.
    pub(crate) fn apiserver(&self, replicas: &[controlplane::ReplicaReport]) -> report::Apiserver {
        let peaks: Vec<u64> = replicas
            .iter()
            .map(|r| r.peak_memory_bytes.unwrap_or(0))
            .collect();
        report::Apiserver {
            heap_limit_bytes: self.memory_limit,
            peak_heap_bytes: peaks.iter().copied().max().unwrap_or(0),
            ooms: replicas.iter().map(|r| r.oom_kills).sum(),
            replica_peak_memory_bytes: peaks,
            replica_oom_kills: replicas.iter().map(|r| r.oom_kills).collect(),
            ..report::Apiserver::default()
        }
    }
}

/// Bytes of each seeded Secret: fewer, larger objects than the simulated storm's, so that
/// seeding a real apiserver takes seconds.
const SECRET_BYTES: &str = "100KiB";
/// [`SECRET_BYTES`] in bytes.
pub(crate) const SECRET_BYTES_N: u64 = 100 << 10;

/// Seeded Secrets per simulated one: three times the simulated storm's bytes (150 MB at
/// scale 1) in 100 KiB Secrets.
pub(crate) fn secrets(sizes: &Sizes) -> usize {
    (sizes.secrets * 3 / 10).max(10)
}

/// The seeds: the list storm's Secrets, ConfigMaps and Leases.
pub(crate) fn seeds(sizes: &Sizes) -> anyhow::Result<Vec<bulwark_sim::Seed>> {
    let secrets = secrets(sizes);
    [
        format!("secrets={secrets}x{SECRET_BYTES}"),
        format!("configmaps={}x1KiB", sizes.configmaps),
        format!("leases={}x300B@kube-node-lease", sizes.heartbeat),
    ]
    .iter()
    .map(|s| s.parse().map_err(anyhow::Error::from))
    .collect()
}

/// Runs the list storm against a fresh control plane per target.
pub async fn list_storm(opts: &Options, cp: &ControlPlaneOptions) -> anyhow::Result<Report> {
    let mut sizes = Sizes::at(opts);
    let seeds = seeds(&sizes)?;
    // The innocents read `secret-N` for N below the seeded count.
    sizes.secrets = secrets(&sizes);
    run_modes("list-storm", opts, cp, &Work::ListStorm(&sizes), &seeds).await
}

/// Runs the informers scenario against a fresh control plane per target.
pub async fn informers(opts: &Options, cp: &ControlPlaneOptions) -> anyhow::Result<Report> {
    let sizes = informers::sizes(opts, 2_000);
    let seeds = informers::seed(&sizes)
        .iter()
        .map(|s| s.parse().map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<bulwark_sim::Seed>>>()?;
    run_modes("informers", opts, cp, &Work::Informers(&sizes), &seeds).await
}

/// Runs `work` direct and through Bulwark (those `--only` names), each on a fresh control
/// plane, into the report of scenario `NAME-controlplane`.
async fn run_modes(
    name: &str,
    opts: &Options,
    cp: &ControlPlaneOptions,
    work: &Work<'_>,
    seeds: &[bulwark_sim::Seed],
) -> anyhow::Result<Report> {
    let mut runs = Vec::new();
    for mode in [Mode::Direct, Mode::Bulwark] {
        if opts
            .only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|o| o == mode.name()))
        {
            continue;
        }
        eprintln!("== {name} on a control plane ({}): starting", mode.name());
        let run = one_run(mode, opts, cp, work, seeds).await?;
        eprintln!("== {name} on a control plane ({}): done", mode.name());
        runs.push((mode.name().to_string(), run));
    }
    Ok(Report::new(
        &format!("{name}-controlplane"),
        opts.scale,
        runs,
    ))
}

/// What a run drives.
enum Work<'a> {
    ListStorm(&'a Sizes),
    Informers(&'a informers::Sizes),
}

// Over 120 lines: one run's life in order (control plane, front doors, loads, sampling,
// stop), its handles shared by every step.
async fn one_run(
    mode: Mode,
    opts: &Options,
    cp_opts: &ControlPlaneOptions,
    work: &Work<'_>,
    seeds: &[bulwark_sim::Seed],
) -> anyhow::Result<Run> {
    let dir = std::env::temp_dir().join(format!(
        "bulwark-loadtest-cp-{}-{}",
        std::process::id(),
        mode.name()
    ));
    let options = cp_opts.options(&dir, seeds);
    let began = Instant::now();
    let cp = ControlPlane::start(options)
        .await
        .context("starting the control plane")?;
    let at_rest: Vec<String> = cp
        .report()
        .iter()
        .map(|r| report::human_bytes(r.peak_memory_bytes.unwrap_or(0)))
        .collect();
    eprintln!(
        "  control plane seeded and ready in {:.1} s; replicas peaked at [{}] so far, limit {}",
        began.elapsed().as_secs_f64(),
        at_rest.join(", "),
        report::human_bytes(cp_opts.memory_limit)
    );
    let (target, balancer) = match mode {
        Mode::Bulwark => (
            Target {
                addr: cp.bulwark_addr(),
                ca_pem: cp.bulwark_ca_pem().unwrap_or_default().to_string(),
            },
            None,
        ),
        _ => {
            let balancer = Balancer::start(cp.replica_addrs(), Pick::RoundRobin).await?;
            (
                Target {
                    addr: balancer.addr,
                    ca_pem: cp.pki().server_ca.cert_pem(),
                },
                Some(balancer),
            )
        }
    };
    let duration = opts.duration_or(Duration::from_secs(60));
    let started = Instant::now();
    // Each replica's memory over time, its OOM kills and each class's 429s, for the
    // report's charts, with the progress line.
    let timeline = Arc::new(std::sync::Mutex::new(report::Timeline::default()));
    let sampler = cp.replica_sampler();
    let timeline_progress = |mode: &'static str, classes: &Classes| {
        super::progress::start(
            mode,
            classes,
            cp_opts.memory_limit,
            sampler.clone(),
            timeline.clone(),
        )
    };
    let (classes, event_delivery_p99_ms, watch_bytes_per_event, watch_cost, upstream_watches) =
        match work {
            Work::ListStorm(sizes) => {
                let loads = list_storm::loads(cp.pki(), sizes);
                let (classes, all) = spawn_loads(&target, loads, started + duration)?;
                let progress = timeline_progress(mode.name(), &classes);
                all.await.context("a client loop panicked")?;
                progress.abort();
                (classes, None, None, None, 0)
            }
            Work::Informers(sizes) => {
                // The replicas' own count of open watches, sampled while the informers run; the
                // count before they start is the replicas' own informers (and Bulwark's).
                eprintln!(
                    "  watches open on the replicas before the informers: {}",
                    cp.open_watches().await
                );
                let peak = Arc::new(AtomicU64::new(0));
                let driven = {
                    let cp = &cp;
                    let peak = peak.clone();
                    let sampler = async move {
                        loop {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            peak.fetch_max(cp.open_watches().await, Ordering::Relaxed);
                        }
                    };
                    let window = informers::join_window(opts, duration);
                    // Direct, the replicas serve the watches; through Bulwark, Bulwark does.
                    let meter = match mode {
                        Mode::Bulwark => cp.bulwark_pid().map(informers::Meter::bulwark),
                        _ => {
                            let pids = cp.replica_pids();
                            Some(informers::Meter {
                                measured: "kube-apiserver",
                                pids: Box::new(move || pids.clone()),
                            })
                        }
                    };
                    let plan = informers::Plan {
                        sizes,
                        duration,
                        join_window: window,
                        protobuf: opts.protobuf,
                        meter,
                    };
                    let nodes = informers::drive_nodes(
                        &target,
                        |c| timeline_progress(mode.name(), c),
                        cp.pki(),
                        plan,
                    );
                    tokio::select! {
                        d = nodes => d?,
                        () = sampler => unreachable!("the sampler never ends"),
                    }
                };
                let classes = driven
                    .classes
                    .into_iter()
                    .map(|(name, stats, _)| (name, stats))
                    .collect();
                let watches = peak.load(Ordering::Relaxed);
                eprintln!(
                    "  peak watches open on the replicas: {watches}; event delivery p99 {:.1} ms",
                    driven.event_delivery_p99_ms.unwrap_or(0.0)
                );
                (
                    classes,
                    driven.event_delivery_p99_ms,
                    driven.watch_bytes_per_event,
                    driven.watch_cost,
                    watches,
                )
            }
        };
    let elapsed = started.elapsed();
    drop(balancer);
    let proxy = match mode {
        Mode::Bulwark => cp.bulwark_cost(),
        _ => None,
    };
    let replicas = cp.report();
    for (i, r) in replicas.iter().enumerate() {
        eprintln!(
            "  replica {i}: peak {} of {}, {} OOM kills, {} restarts",
            report::human_bytes(r.peak_memory_bytes.unwrap_or(0)),
            report::human_bytes(r.memory_limit_bytes.unwrap_or(0)),
            r.oom_kills,
            r.restarts
        );
    }
    cp.stop().await.context("stopping the control plane")?;
    let _ = std::fs::remove_dir_all(&dir);
    for (name, stats) in &classes {
        if let Some(e) = stats.sample_error() {
            eprintln!("  {} {name}: errors such as: {e}", mode.name());
        }
    }
    let apiserver = report::Apiserver {
        upstream_watches,
        ..cp_opts.apiserver(&replicas)
    };
    Ok(Run {
        apiserver,
        proxy,
        classes: classes
            .iter()
            .map(|(name, stats)| (name.clone(), stats.summary(elapsed)))
            .collect(),
        event_delivery_p99_ms,
        watch_bytes_per_event,
        watch_cost,
        flood: None,
        fleet: None,
        timeline: Some(std::mem::take(
            &mut *timeline.lock().unwrap_or_else(|e| e.into_inner()),
        )),
    })
}

/// Prints each class's counts every five seconds, the lines headed by `mode`.
pub(crate) fn progress(mode: &'static str, classes: &Classes) -> JoinHandle<()> {
    let classes = classes.clone();
    let started = Instant::now();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let mut line = format!("  [{mode} {:>3}s]", started.elapsed().as_secs());
            for (name, c) in &classes {
                let l = &c.live;
                line.push_str(&format!(
                    " {name}: {} ok {} 429 {} err;",
                    l.ok.load(Ordering::Relaxed),
                    l.rejected.load(Ordering::Relaxed),
                    l.errors.load(Ordering::Relaxed)
                ));
            }
            eprintln!("{line}");
        }
    })
}
