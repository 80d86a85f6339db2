//! `fleet`: the list storm on a real control plane through a fleet of three Bulwarks, the
//! way they are deployed: behind a load balancer that pins long-lived connections, here
//! 70/20/10 over the three. Each run gets a fresh control plane:
//!
//! - `direct`: every client through a TCP balancer straight to the apiservers;
//! - `static`: three Bulwarks, each a static third of every budget (no `fleet:`);
//! - `leases`: three Bulwarks sharing the budgets by demand through their Leases.
//!
//! A third of the way in, the Bulwark with 70% of the clients is killed (SIGKILL); its
//! clients' front door moves them to the next, as a balancer's health check does. Two
//! thirds of the way in it is started again. The figures: each apiserver's storm LISTs in
//! flight by its own metrics against its budget, OOM kills, each storm identity's rate over
//! all Bulwarks against its rule, and how long the survivors took to hold the whole budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::time::Instant;

use super::list_storm::{self, Sizes};
use super::on_controlplane::{self, ControlPlaneOptions};
use super::{Observer, Options, spawn_loads_at};
use crate::balancer::{Balancer, Pick};
use crate::client::{Outcome, Target};
use crate::controlplane::{ControlPlane, FleetMode};
use crate::proxy_process::admin_text;
use crate::report::{FleetFigures, Report, Run};
use bulwark_testkit::metric_sum;

/// Bulwark replicas in the fleet runs.
pub const BULWARKS: usize = 3;
/// Storm identities, whatever the scale (which sizes the objects): fewer than
/// `list-storm`'s, each with many connections, so that each asks for more than its rule
/// while its connections wait out the `Retry-After` of their 429s, as client-go does.
const STORM_IDENTITIES: usize = 6;
/// Connections each storm identity holds, pinned like every client.
const STORM_CONNECTIONS: usize = 40;
/// The shipped storm rule's rate (`deploy/base/rules/secret-lists.yaml`, checked by a test).
pub const STORM_RULE_QPS: f64 = 1.0;
/// The storm identities' FlowSchema on the apiservers: they are ServiceAccounts.
const STORM_FLOW_SCHEMA: &str = "service-accounts";
/// How often the apiservers' metrics are read.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// How long an apiserver may take to answer for its metrics.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The Bulwark that is killed: the one with 70% of the clients.
const VICTIM: usize = 0;

/// How the runs reach the apiservers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Straight, through a TCP balancer.
    Direct,
    /// Three Bulwarks, each a static third.
    Static,
    /// Three Bulwarks sharing through Leases.
    Leases,
}

impl Split {
    /// The run's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Split::Direct => "direct",
            Split::Static => "static",
            Split::Leases => "leases",
        }
    }
}

/// The Bulwark client `i` of a class is pinned to: 7 in 10 to the first, 2 to the second,
/// 1 to the third.
pub fn pinned(i: usize) -> usize {
    match i % 10 {
        0..=6 => 0,
        7 | 8 => 1,
        _ => 2,
    }
}

/// Runs `direct`, `static` and `leases` (those `--only` names), each on a fresh control
/// plane.
pub async fn run(opts: &Options, cp: &ControlPlaneOptions) -> anyhow::Result<Report> {
    let mut sizes = Sizes::at(opts);
    sizes.storm = STORM_IDENTITIES;
    let seeds = on_controlplane::seeds(&sizes)?;
    sizes.secrets = on_controlplane::secrets(&sizes);
    let mut runs = Vec::new();
    for split in [Split::Direct, Split::Static, Split::Leases] {
        if opts
            .only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|o| o == split.name()))
        {
            continue;
        }
        eprintln!("== fleet on a control plane ({}): starting", split.name());
        let run = one_run(split, opts, cp, &sizes, &seeds).await?;
        eprintln!("== fleet on a control plane ({}): done", split.name());
        runs.push((split.name().to_string(), run));
    }
    Ok(Report::new("fleet-controlplane", opts.scale, runs))
}

/// One storm identity's answers, all Bulwarks together.
struct StormCount {
    /// Answers other than a 429 `rate_limited` (requests its token buckets let through),
    /// per second of the run.
    passed: Vec<AtomicU64>,
    rejected: AtomicU64,
    rate_limited: AtomicU64,
}

impl StormCount {
    fn new(seconds: usize) -> Self {
        Self {
            passed: (0..seconds).map(|_| AtomicU64::new(0)).collect(),
            rejected: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
        }
    }

    /// Requests per second passed over the seconds in `windows` (`[from, to)` each).
    fn rate(&self, windows: &[(usize, usize)]) -> f64 {
        let (mut n, mut secs) = (0, 0);
        for &(from, to) in windows {
            let to = to.min(self.passed.len());
            for c in self.passed.get(from..to).into_iter().flatten() {
                n += c.load(Ordering::Relaxed);
                secs += 1;
            }
        }
        if secs == 0 {
            0.0
        } else {
            n as f64 / secs as f64
        }
    }
}

/// Seconds after a start (the run's, or a Bulwark's) before rates count as steady: the
/// fleet has seen the flows by then.
const SETTLE_S: usize = 10;

/// What the sampler saw of the apiservers: per apiserver, (second of the run, storm LISTs
/// executing) for each answer.
#[derive(Default)]
struct Samples {
    series: Vec<Vec<(usize, u64)>>,
    taken: u64,
}

impl Samples {
    /// Per apiserver: the most LIST bytes executing at once in `windows`, and the samples
    /// there over the budget. A LIST bigger than the budget running alone is what the
    /// budget allows, so "over" is more than `max(budget, one LIST)`.
    fn figures(
        &self,
        windows: &[(usize, usize)],
        list_bytes: u64,
        budget: u64,
    ) -> (Vec<u64>, Vec<u64>) {
        let allowed = budget.max(list_bytes);
        self.series
            .iter()
            .map(|series| {
                let inside = series
                    .iter()
                    .filter(|(t, _)| windows.iter().any(|(from, to)| (*from..*to).contains(t)))
                    .map(|&(_, n)| n * list_bytes);
                let peak = inside.clone().max().unwrap_or(0);
                let over = inside.filter(|&bytes| bytes > allowed).count() as u64;
                (peak, over)
            })
            .unzip()
    }
}

async fn one_run(
    split: Split,
    opts: &Options,
    cp_opts: &ControlPlaneOptions,
    sizes: &Sizes,
    seeds: &[bulwark_sim::Seed],
) -> anyhow::Result<Run> {
    let dir = std::env::temp_dir().join(format!(
        "bulwark-loadtest-fleet-{}-{}",
        std::process::id(),
        split.name()
    ));
    let mut options = cp_opts.options(&dir, seeds);
    // Secrets stay out of Bulwark's cache here: every storm LIST reaches the apiservers,
    // and the byte budget is what protects them (`list-storm` shows the cache answering).
    options.bulwark_settings = vec![(
        "cache.resources".to_string(),
        "[endpoints, endpointslices.discovery.k8s.io]".to_string(),
    )];
    if split != Split::Direct {
        options.bulwarks = BULWARKS;
        options.fleet = match split {
            Split::Leases => FleetMode::Leases,
            _ => FleetMode::Static,
        };
    }
    let began = Instant::now();
    let mut cp = ControlPlane::start(options)
        .await
        .context("starting the control plane")?;
    eprintln!(
        "  control plane seeded and ready in {:.1} s",
        began.elapsed().as_secs_f64()
    );
    let headroom = cp
        .bulwark_heap_headroom()
        .context("the apiservers have no memory limit")?;
    let budget = headroom / 5;
    let list_bytes = sizes.secrets as u64 * on_controlplane::SECRET_BYTES_N;

    let (doors, targets) = front_doors(&cp, split).await?;

    let mut loads = list_storm::loads(cp.pki(), sizes);
    let storm = loads
        .iter_mut()
        .find(|l| l.class == "storm")
        .context("the list storm has a storm class")?;
    storm.identities = storm
        .identities
        .iter()
        .flat_map(|id| std::iter::repeat_n(id.clone(), STORM_CONNECTIONS))
        .collect();
    let duration = opts.duration_or(Duration::from_secs(90));
    let seconds = duration.as_secs() as usize + 2;
    let counts: Arc<Vec<StormCount>> =
        Arc::new((0..sizes.storm).map(|_| StormCount::new(seconds)).collect());
    let started = Instant::now();
    let observer = storm_observer(counts.clone(), started);

    let target_of = |_: &str, i: usize| targets[pinned(i).min(targets.len() - 1)].clone();
    let (classes, all) = spawn_loads_at(loads, started + duration, target_of, Some(observer))?;
    let progress = on_controlplane::progress(split.name(), &classes);
    let samples = Arc::new(Mutex::new(Samples {
        series: vec![Vec::new(); cp_opts.replicas],
        taken: 0,
    }));
    let sampler = sample_storm_lists(cp.admin_clients().await?, samples.clone(), started);

    let mut figures = FleetFigures {
        list_bytes_budget: budget,
        storm_rule_qps: STORM_RULE_QPS,
        ..FleetFigures::default()
    };
    if split != Split::Direct {
        kill_and_restart(
            &mut cp,
            split,
            started,
            duration,
            cp_opts.replicas,
            &mut figures,
        )
        .await?;
    }
    all.await.context("a client loop panicked")?;
    let elapsed = started.elapsed();
    progress.abort();
    sampler.abort();
    drop(doors);

    let proxy = cp.bulwark_cost();
    let replicas = cp.report();
    cp.stop().await.context("stopping the control plane")?;
    let _ = std::fs::remove_dir_all(&dir);
    for (name, stats) in &classes {
        if let Some(e) = stats.sample_error() {
            eprintln!("  {} {name}: errors such as: {e}", split.name());
        }
    }
    settle(&mut figures, &samples, &counts, elapsed, list_bytes, budget);
    let apiserver = cp_opts.apiserver(&replicas);
    Ok(Run {
        apiserver,
        proxy,
        classes: classes
            .iter()
            .map(|(name, stats)| (name.clone(), stats.summary(elapsed)))
            .collect(),
        event_delivery_p99_ms: None,
        watch_bytes_per_event: None,
        watch_cost: None,
        flood: None,
        fleet: Some(figures),
        timeline: None,
    })
}

/// The front doors: one balancer straight to the apiservers, or one per Bulwark that
/// prefers it and moves its clients to the next while it is down; and where each sends.
async fn front_doors(
    cp: &ControlPlane,
    split: Split,
) -> anyhow::Result<(Vec<Balancer>, Vec<Target>)> {
    let mut doors = Vec::new();
    let targets = match split {
        Split::Direct => {
            let door = Balancer::start(cp.replica_addrs(), Pick::RoundRobin).await?;
            let target = Target {
                addr: door.addr,
                ca_pem: cp.pki().server_ca.cert_pem(),
            };
            doors.push(door);
            vec![target]
        }
        _ => {
            let bulwarks = cp.bulwark_addrs();
            let ca_pem = cp.bulwark_ca_pem().unwrap_or_default().to_string();
            let mut targets = Vec::new();
            for first in 0..bulwarks.len() {
                let mut order = bulwarks.clone();
                order.rotate_left(first);
                let door = Balancer::start(order, Pick::Preferring).await?;
                targets.push(Target {
                    addr: door.addr,
                    ca_pem: ca_pem.clone(),
                });
                doors.push(door);
            }
            targets
        }
    };
    Ok((doors, targets))
}

/// Counts each storm identity's LISTs that passed, a second at a time, and its 429s.
fn storm_observer(counts: Arc<Vec<StormCount>>, started: Instant) -> Observer {
    Arc::new(move |class: &str, i: usize, outcome: &Outcome| {
        if class != "storm" {
            return;
        }
        let Some(c) = counts.get(i / STORM_CONNECTIONS) else {
            return;
        };
        match outcome {
            Outcome::Rejected { reason, .. } => {
                c.rejected.fetch_add(1, Ordering::Relaxed);
                if reason.as_deref() == Some("rate_limited") {
                    c.rate_limited.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            Outcome::Error(_) => return,
            Outcome::Ok { .. } => {}
        }
        let second = started.elapsed().as_secs() as usize;
        if let Some(slot) = c.passed.get(second) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
    })
}

/// Every `SAMPLE_EVERY`, the storm LISTs each replica is executing, into `samples`.
fn sample_storm_lists(
    admins: Vec<kube::Client>,
    samples: Arc<Mutex<Samples>>,
    started: Instant,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SAMPLE_EVERY).await;
            // Every replica at once: one that does not answer in time is left out of
            // this sample.
            let reads = admins.iter().map(|admin| async move {
                let request = http::Request::get("/metrics").body(Vec::new()).ok()?;
                let text = tokio::time::timeout(SCRAPE_TIMEOUT, admin.request_text(request))
                    .await
                    .ok()?
                    .ok()?;
                Some(storm_lists_executing(&text))
            });
            let executing = futures::future::join_all(reads).await;
            let second = started.elapsed().as_secs() as usize;
            let mut s = samples.lock().unwrap_or_else(|p| p.into_inner());
            s.taken += 1;
            for (i, n) in executing.into_iter().enumerate() {
                if let Some(n) = n {
                    s.series[i].push((second, n));
                }
            }
        }
    })
}

/// Kills Bulwark `VICTIM` a third into the run and starts it again at two thirds, timing
/// how long the survivors take to take over and (with Leases) the victim to rejoin.
async fn kill_and_restart(
    cp: &mut ControlPlane,
    split: Split,
    started: Instant,
    duration: Duration,
    replicas: usize,
    figures: &mut FleetFigures,
) -> anyhow::Result<()> {
    tokio::time::sleep_until(started + duration / 3).await;
    cp.kill_bulwark(VICTIM).await?;
    let killed = Instant::now();
    figures.killed_at_s = Some((killed - started).as_secs_f64());
    let admins = cp.bulwark_admin_addrs();
    let survivors: Vec<_> = (0..admins.len())
        .filter(|&i| i != VICTIM)
        .map(|i| admins[i])
        .collect();
    let restart_at = started + duration * 2 / 3;
    // Taken over: every survivor sees two members, the dead one's share no longer
    // kept for it. (What they then hold follows their demand, and a share grows only
    // once the others can have seen the demand behind it.)
    let (took, held) = wait_for(&survivors, restart_at, |members, _| {
        members.iter().all(|&m| m == BULWARKS as u64 - 1)
    })
    .await;
    figures.takeover_s = took.map(|t| (t - killed).as_secs_f64());
    figures.survivors_share = Some(held / replicas as u64);
    eprintln!(
        "  killed bulwark-{VICTIM} at {:.0} s; survivors took over: {}",
        figures.killed_at_s.unwrap_or(0.0),
        figures
            .takeover_s
            .map_or_else(|| "never".to_string(), |s| format!("in {s:.1} s"))
    );
    tokio::time::sleep_until(restart_at).await;
    cp.start_bulwark(VICTIM).await?;
    let restarted = Instant::now();
    figures.restarted_at_s = Some((restarted - started).as_secs_f64());
    if split == Split::Leases {
        let (back, _) = wait_for(&admins, started + duration, |members, _| {
            members.iter().all(|&m| m == BULWARKS as u64)
        })
        .await;
        figures.rejoin_s = back.map(|t| (t - restarted).as_secs_f64());
    }
    Ok(())
}

/// The run's figures from the samples and the storm's counts: over the whole run, the
/// steady parts (after `SETTLE_S`, outside the outage) and the outage.
fn settle(
    figures: &mut FleetFigures,
    samples: &Mutex<Samples>,
    counts: &[StormCount],
    elapsed: Duration,
    list_bytes: u64,
    budget: u64,
) {
    let end = elapsed.as_secs() as usize;
    let whole = [(0, end)];
    let (steady, outage) = match (figures.killed_at_s, figures.restarted_at_s) {
        (Some(k), Some(r)) => {
            let (k, r) = (k as usize, r as usize);
            (vec![(SETTLE_S, k), (r + SETTLE_S, end)], vec![(k, r)])
        }
        _ => (vec![(SETTLE_S, end)], Vec::new()),
    };
    {
        let s = samples.lock().unwrap_or_else(|p| p.into_inner());
        (figures.peak_list_bytes, figures.samples_over_budget) =
            s.figures(&whole, list_bytes, budget);
        (
            figures.steady_peak_list_bytes,
            figures.steady_samples_over_budget,
        ) = s.figures(&steady, list_bytes, budget);
        figures.samples = s.taken;
        figures.list_bytes = list_bytes;
    }
    figures.storm_rates = counts.iter().map(|c| c.rate(&whole)).collect();
    figures.storm_steady_rates = counts.iter().map(|c| c.rate(&steady)).collect();
    if !outage.is_empty() {
        figures.storm_outage_rates = counts.iter().map(|c| c.rate(&outage)).collect();
    }
    figures.storm_429s = counts
        .iter()
        .map(|c| {
            (
                c.rejected.load(Ordering::Relaxed),
                c.rate_limited.load(Ordering::Relaxed),
            )
        })
        .collect();
}

/// Polls the Bulwarks at `admins` every 50 ms until `done(members each sees, LIST bytes
/// budget they hold together)` or `until`; returns when it was done (`None`: never) and
/// the budget held at the last poll.
async fn wait_for(
    admins: &[std::net::SocketAddr],
    until: Instant,
    done: impl Fn(&[u64], u64) -> bool,
) -> (Option<Instant>, u64) {
    let mut held = 0;
    while Instant::now() < until {
        let mut members = Vec::new();
        held = 0;
        for &admin in admins {
            let text = admin_text(admin, "/metrics").await.unwrap_or_default();
            members.push(metric_sum(&text, "bulwark_fleet_members") as u64);
            held += metric_sum(&text, "bulwark_list_bytes_budget") as u64;
        }
        if done(&members, held) {
            return (Some(Instant::now()), held);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (None, held)
}

/// The storm's LISTs an apiserver executes now, by its own metrics.
fn storm_lists_executing(metrics: &str) -> u64 {
    let schema = format!("flow_schema=\"{STORM_FLOW_SCHEMA}\"");
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_flowcontrol_current_executing_requests{")
                && l.contains(&schema)
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_are_pinned_70_20_10() {
        let mut per = [0; 3];
        for i in 0..100 {
            per[pinned(i)] += 1;
        }
        assert_eq!(per, [70, 20, 10]);
    }

    #[test]
    fn the_storm_rule_is_the_shipped_one() {
        let (_, text) = crate::proxy_process::SHIPPED_RULES
            .iter()
            .find(|(name, _)| *name == "secret-lists.yaml")
            .unwrap();
        assert!(
            text.contains(&format!("rate: {{qps: {STORM_RULE_QPS}, burst: 2}}")),
            "{text}"
        );
    }

    #[test]
    fn over_budget_is_more_than_one_list_bigger_than_the_budget() {
        let s = Samples {
            series: vec![vec![(0, 3), (5, 1), (12, 2), (20, 0)]],
            taken: 4,
        };
        // LISTs of 100 bytes, a budget of 50: one alone is allowed.
        assert_eq!(s.figures(&[(0, 30)], 100, 50), (vec![300], vec![2]));
        assert_eq!(s.figures(&[(10, 30)], 100, 50), (vec![200], vec![1]));
        // LISTs of 10 bytes, a budget of 25: two fit.
        assert_eq!(s.figures(&[(0, 30)], 10, 25), (vec![30], vec![1]));
    }

    #[test]
    fn the_storm_s_lists_are_read_by_flow_schema() {
        let text = "\
# HELP bulwark_fleet_members x
bulwark_fleet_members 2
bulwark_fleet_members_other 7
bulwark_list_bytes_budget{replica=\"a\"} 100
bulwark_list_bytes_budget{replica=\"b\"} 50
apiserver_flowcontrol_current_executing_requests{flow_schema=\"service-accounts\",priority_level=\"workload-low\"} 3
apiserver_flowcontrol_current_executing_requests{flow_schema=\"global-default\",priority_level=\"global-default\"} 5
";
        assert_eq!(storm_lists_executing(text), 3);
    }
}
