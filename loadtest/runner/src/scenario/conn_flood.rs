//! `conn-flood`: thousands of TLS connections that each send one request without
//! credentials (401) and then idle, answering HTTP/2 pings, while an authenticated client
//! keeps working, the admin listener is polled and a new client tries to connect; what the
//! flood costs Bulwark in file descriptors and memory, during it and after it.
//!
//! The flood comes from many loopback sources (127.0.0.10 on, the client socket bound to
//! each) so that a per-source cap does not hide what the total does. With `--bulwark-bin`
//! a `bulwark` binary (an older build, say) runs first as `baseline`, then this build as
//! `bulwark`, and the table shows them side by side.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use bulwark_sim::pki::Pki;
use bulwark_sim::{Fleet, SimConfig};
use bulwark_testkit::{FRONT_PROXY_CN, OWN_GROUP, OWN_USER};
use bytes::Bytes;
use futures::StreamExt as _;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use super::{Options, Persona};
use crate::client::{Client, Outcome, Read, Target, new_histogram};
use crate::proxy_process::{self, ProxyProcess, Upstream, stop_child};
use crate::report::{self, Flood, FloodLatency, NewClient, Phases, Report, Run};

/// The scenario's own options.
#[derive(Clone, Debug)]
pub struct FloodOptions {
    /// Flood connections to open.
    pub connections: usize,
    /// Loopback source addresses they come from (127.0.0.10 on).
    pub sources: usize,
    /// Connection attempts in flight at once.
    pub concurrency: usize,
    /// How long the client holds the flood open once it is opened, unless Bulwark has
    /// closed every connection before.
    pub hold: Duration,
    /// How long after the flood ends the last file-descriptor and memory figures are read.
    pub settle: Duration,
    /// Bulwark's `listen.limits.unauthenticatedTimeout` (its default when absent).
    pub unauthenticated_timeout: Option<Duration>,
    /// Also measure this `bulwark` binary (`PATH serve --config FILE`), first, as
    /// `baseline`.
    pub bulwark_bin: Option<PathBuf>,
    /// The baseline's configuration names only keys that Bulwark knew before the
    /// connection caps (no `listen.limits` settings of this scenario).
    pub legacy_config: bool,
    /// Bulwark's open-file limit (soft and hard), set with util-linux `prlimit`; the
    /// runner's own limit when absent.
    pub bulwark_fd_limit: Option<u64>,
    /// Each flood connection sends a bearer token the apiserver knows, and its one GET is
    /// answered, so that it stays open as an idle client's would: what an idle
    /// authenticated connection costs.
    pub authenticated: bool,
    /// Also flood haproxy in front of the same simulator, as `haproxy`: its memory and
    /// descriptors per connection beside Bulwark's.
    pub haproxy: bool,
}

/// The authenticated client's pace.
const GET_EVERY: Duration = Duration::from_millis(50);
/// `/readyz` polling pace.
const READYZ_EVERY: Duration = Duration::from_millis(100);
/// How often Bulwark's descriptors and memory are read.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// How long the authenticated client works before the flood.
const BEFORE: Duration = Duration::from_secs(5);
/// One request's (or one `/readyz` poll's) limit.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// One flood connection's limit: TCP, TLS, HTTP/2 and the 401.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// No flood attempt starts later than this after the first.
const OPEN_WITHIN: Duration = Duration::from_secs(180);
/// The first loopback source's last octet.
const FIRST_SOURCE: u8 = 10;
/// What the authenticated clients GET: a small object Bulwark forwards upstream.
const GET_PATH: &str = "/api/v1/namespaces/default/configmaps/configmap-0";
/// What a flood connection asks for without credentials.
const FLOOD_PATH: &str = "/api/v1/namespaces/default/pods";
/// Descriptors the runner keeps for itself beyond one per flood connection: the
/// simulator's listeners and Bulwark's upstream connections, the clients, `/proc` reads.
const RUNNER_FDS: u64 = 512;

/// The rule under which `--authenticated`'s connections (the token user `tina`) are served.
const IDLE_CLIENTS_RULE: &str = r#"
rules:
  - name: idle-clients
    precedence: 2
    match:
      users: ["tina"]
    level: exempt
"#;

/// The authenticated users: `user-0` works through the flood, `user-1` arrives during it.
const PEOPLE: Persona<'static> = Persona::Users {
    prefix: "user",
    group: "developers",
};

/// Runs the flood against each Bulwark (the baseline binary first, when given).
pub async fn run(opts: &Options, flood: &FloodOptions) -> anyhow::Result<Report> {
    if flood.connections == 0 || flood.sources == 0 || flood.concurrency == 0 {
        bail!("--connections, --sources and --concurrency must be positive");
    }
    if flood.sources > 240 {
        bail!("--sources: at most 240 (127.0.0.10 to 127.0.0.249)");
    }
    check_own_fd_limit(flood.connections)?;
    let pki = Arc::new(Pki::new());
    let mut runs = Vec::new();
    let mut bins: Vec<(&str, Option<&Path>)> = Vec::new();
    if let Some(bin) = &flood.bulwark_bin {
        bins.push(("baseline", Some(bin)));
    }
    bins.push(("bulwark", None));
    for (name, bin) in bins {
        if opts
            .only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|o| o == name))
        {
            continue;
        }
        eprintln!("== conn-flood ({name}): starting");
        let run = one_run(name, bin, flood, pki.clone()).await?;
        eprintln!("== conn-flood ({name}): done");
        runs.push((name.to_string(), run));
    }
    let haproxy_wanted = opts
        .only
        .as_deref()
        .is_none_or(|only| only.split(',').any(|o| o == "haproxy"));
    if flood.haproxy && haproxy_wanted {
        eprintln!("== conn-flood (haproxy): starting");
        let run = haproxy_run(flood, pki.clone()).await?;
        eprintln!("== conn-flood (haproxy): done");
        runs.push(("haproxy".to_string(), run));
    }
    Ok(Report::new("conn-flood", opts.scale, runs))
}

/// The same flood against haproxy (one thread, TLS and HTTP/2 on both sides) in front of a
/// fresh simulator: its descriptors and memory before, with the flood open, and after.
/// haproxy has no admin listener, metrics or authentication of its own, so the figures of
/// Bulwark's run that come from those stay empty.
async fn haproxy_run(flood: &FloodOptions, pki: Arc<Pki>) -> anyhow::Result<Run> {
    let program = super::passthrough::find("haproxy").context(
        "conn-flood --haproxy needs haproxy; on Debian or Ubuntu: apt-get install haproxy",
    )?;
    let fleet = start_fleet(pki.clone()).await?;
    let dir = super::run_dir();
    std::fs::create_dir_all(&dir)?;
    let serving = pki.server_ca.server_cert(&["127.0.0.1", "localhost"]);
    let bundle = dir.join("serving.pem");
    std::fs::write(&bundle, format!("{}{}", serving.cert_pem, serving.key_pem))?;
    let ca = dir.join("upstream-ca.pem");
    std::fs::write(&ca, pki.server_ca.cert_pem())?;
    let addr = proxy_process::free_port()?;
    let up = *fleet
        .addrs()
        .first()
        .context("the simulator has no replica")?;
    let config = dir.join("haproxy.cfg");
    std::fs::write(
        &config,
        super::passthrough::haproxy_config(1, addr, &bundle, up, ca.display()),
    )?;
    let mut command = crate::child::command(program);
    command.arg("-db").arg("-f").arg(&config);
    let mut child = super::passthrough::spawn(command, &dir, "haproxy")?;
    let measured = async {
        super::passthrough::wait_listening(&mut child, addr, "haproxy", &dir).await?;
        let pid = child.id().context("haproxy exited")?;
        let target = Target {
            addr,
            ca_pem: pki.server_ca.cert_pem(),
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let idle = sample(pid).await?;
        let flood_start = Instant::now();
        let opened = open_flood(target, flood).await?;
        let opened_at = Instant::now();
        let at_open = sample(pid).await?;
        let accepted = opened.accepted.len() as u64;
        if let Some(per) = at_open
            .1
            .checked_sub(idle.1)
            .and_then(|g| g.checked_div(accepted))
        {
            eprintln!(
                "  [haproxy] {} a connection ({accepted} connections open)",
                report::human_bytes(per)
            );
        }
        tokio::time::sleep_until(opened_at + flood.hold).await;
        let closed = opened.closed_by_bulwark.load(Ordering::Relaxed);
        let flood_end = Instant::now();
        opened.letting_go.store(true, Ordering::Relaxed);
        drop(opened.accepted);
        tokio::time::sleep(flood.settle).await;
        let after = sample(pid).await?;
        anyhow::Ok(Flood {
            connections: flood.connections as u64,
            sources: flood.sources as u64,
            concurrency: flood.concurrency as u64,
            accepted,
            refused: opened.refused,
            timed_out: opened.timed_out,
            other: opened.other,
            not_attempted: opened.not_attempted,
            opened_in_s: (opened_at - flood_start).as_secs_f64(),
            closed_by_bulwark: closed,
            lasted_s: (flood_end - flood_start).as_secs_f64(),
            fd_limit: fd_limit(pid)?,
            fds: Phases {
                idle: idle.0,
                peak: at_open.0,
                after: after.0,
            },
            rss_bytes: Phases {
                idle: idle.1,
                peak: at_open.1,
                after: after.1,
            },
            first_error: opened.first_error,
            ..Flood::default()
        })
    }
    .await;
    let cost = stop_child(&mut child, "haproxy", "").await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Run {
        proxy: cost.ok(),
        flood: Some(measured?),
        ..Run::default()
    })
}

/// The simulator every run of the flood stands in front of: one replica, the ConfigMaps
/// its GETs read.
async fn start_fleet(pki: Arc<Pki>) -> anyhow::Result<Fleet> {
    Fleet::start(SimConfig {
        seed: vec!["configmaps=10x1KiB@default".parse()?],
        ..bulwark_testkit::fleet_config(pki, 1, super::policy())
    })
    .await
    .context("starting the simulator")
}

/// The runner holds one descriptor per flood connection: its limit must leave room, or
/// the client (not Bulwark) would be what fails.
fn check_own_fd_limit(connections: usize) -> anyhow::Result<()> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let needed = connections as u64 + RUNNER_FDS;
    if limit < needed {
        bail!(
            "the runner's open-file limit is {limit}; {connections} flood connections need \
             about {needed} (raise `ulimit -n` or use fewer --connections)"
        );
    }
    Ok(())
}

/// When each request of a loop was sent and how it went (its latency, or why it failed).
type Log = Arc<Mutex<Vec<(Instant, Result<Duration, String>)>>>;

/// Bulwark's descriptors and resident memory over time.
type Samples = Arc<Mutex<Vec<(Instant, u64, u64)>>>;

async fn one_run(
    name: &str,
    bin: Option<&Path>,
    flood: &FloodOptions,
    pki: Arc<Pki>,
) -> anyhow::Result<Run> {
    let fleet = start_fleet(pki.clone()).await?;
    let dir = super::run_dir();
    let legacy = bin.is_some() && flood.legacy_config;
    let proxy = start_bulwark(&dir, &fleet, &pki, bin, flood, legacy).await?;
    let result = measure(name, &proxy, &fleet, &pki, flood).await;
    let cost = proxy.stop().await?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut run = result?;
    run.proxy = Some(cost);
    Ok(run)
}

/// Writes the configuration and starts Bulwark: this binary's hidden subcommand, or the
/// `bulwark` binary at `bin`, under `prlimit` when its descriptors are limited.
async fn start_bulwark(
    dir: &Path,
    fleet: &Fleet,
    pki: &Pki,
    bin: Option<&Path>,
    flood: &FloodOptions,
    legacy: bool,
) -> anyhow::Result<ProxyProcess> {
    let upstream = Upstream {
        replicas: fleet.addrs(),
        pki,
        front_proxy_user: FRONT_PROXY_CN,
        own_user: OWN_USER,
        own_group: OWN_GROUP,
        heap_headroom: None,
        rules: None,
        identity_mode: None,
        serving_ca: None,
        settings: Vec::new(),
        advertise: None,
    };
    let (config, target, admin) = proxy_process::write_config(dir, &upstream)?;
    if flood.authenticated && !legacy {
        // Thousands of connections of one identity, one GET each: exempt, so that every one
        // is answered and stays, as thousands of kubelets' would under their own flows.
        std::fs::write(
            dir.join("rules").join("idle-clients.yaml"),
            IDLE_CLIENTS_RULE,
        )?;
    }
    if legacy {
        // A binary from before the connection limits knows no `listen.limits` key the
        // test configuration sets.
        let text = std::fs::read_to_string(&config)?;
        let mut doc: serde_norway::Value = serde_norway::from_str(&text)?;
        if let Some(listen) = doc
            .get_mut("listen")
            .and_then(serde_norway::Value::as_mapping_mut)
        {
            listen.remove("limits");
        }
        std::fs::write(&config, serde_norway::to_string(&doc)?)?;
    }
    if let (Some(timeout), false) = (flood.unauthenticated_timeout, legacy) {
        let text = std::fs::read_to_string(&config)?;
        let millis = format!("{}ms", timeout.as_millis());
        let text = bulwark_testkit::config::with_values(
            &text,
            &[("listen.limits.unauthenticatedTimeout", millis.as_str())],
        );
        std::fs::write(&config, text)?;
    }
    let this = std::env::current_exe().context("locating this binary")?;
    let (program, subcommand) = match bin {
        Some(bin) => (bin.to_path_buf(), "serve"),
        None => (this, proxy_process::SUBCOMMAND),
    };
    let command = match flood.bulwark_fd_limit {
        Some(n) => {
            let mut c = crate::child::command("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg("--").arg(program);
            c
        }
        None => crate::child::command(program),
    };
    ProxyProcess::launch_as(command, subcommand, &config, target, admin, dir).await
}

/// Before, during and after the flood: every figure of one run.
// Over 120 lines: before, during and after the flood in order, every figure read from the
// same process at the same moments.
async fn measure(
    name: &str,
    proxy: &ProxyProcess,
    fleet: &Fleet,
    pki: &Pki,
    flood: &FloodOptions,
) -> anyhow::Result<Run> {
    let pid = proxy.pid().context("Bulwark exited")?;
    let fd_limit = fd_limit(pid).context("reading Bulwark's open-file limit")?;
    let people = PEOPLE.mint(pki, 2);
    let mut worker = Client::new(&proxy.target, &people[0])?;
    worker
        .connect()
        .await
        .context("the authenticated client's connection")?;

    let started = Instant::now();
    let gets: Log = Arc::default();
    let readyz: Log = Arc::default();
    let samples: Samples = Arc::default();
    let loops = [
        spawn_gets(worker, gets.clone()),
        spawn_readyz(proxy.admin, readyz.clone()),
        spawn_sampler(pid, samples.clone()),
    ];

    tokio::time::sleep(BEFORE).await;
    let idle = sample(pid).await?;
    let flood_start = Instant::now();
    eprintln!(
        "  [{name}] idle: {} fds, {} RSS (limit {fd_limit}); opening {} connections",
        idle.0,
        report::human_bytes(idle.1),
        flood.connections
    );
    let opened = open_flood(proxy.target.clone(), flood).await?;
    let opened_at = Instant::now();
    let at_open = sample(pid).await?;
    eprintln!(
        "  [{name}] opened in {:.1} s: {} accepted, {} refused, {} timed out; Bulwark {} fds, {} RSS",
        (opened_at - flood_start).as_secs_f64(),
        opened.accepted.len(),
        opened.refused,
        opened.timed_out,
        at_open.0,
        report::human_bytes(at_open.1),
    );
    if let Some(per) = at_open
        .1
        .checked_sub(idle.1)
        .and_then(|grown| grown.checked_div(opened.accepted.len() as u64))
    {
        eprintln!(
            "  [{name}] {} a connection ({} of resident memory for {} connections)",
            report::human_bytes(per),
            report::human_bytes(at_open.1 - idle.1),
            opened.accepted.len()
        );
    }
    let new_client = new_client(&proxy.target, &people[1]).await;

    // Held until Bulwark has closed every accepted connection, or for `hold`.
    let accepted = opened.accepted.len() as u64;
    let hold_until = opened_at + flood.hold;
    while Instant::now() < hold_until
        && (accepted == 0 || opened.closed_by_bulwark.load(Ordering::Relaxed) < accepted)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let closed_by_bulwark = opened.closed_by_bulwark.load(Ordering::Relaxed);
    let flood_end = Instant::now();
    let metrics = proxy_process::admin_text(proxy.admin, "/metrics")
        .await
        .unwrap_or_default();
    opened.letting_go.store(true, Ordering::Relaxed);
    drop(opened.accepted);
    eprintln!(
        "  [{name}] flood over after {:.1} s ({closed_by_bulwark} closed by Bulwark); settling for {:?}",
        (flood_end - flood_start).as_secs_f64(),
        flood.settle
    );
    tokio::time::sleep(flood.settle).await;
    let after = sample(pid).await?;
    for l in loops {
        l.abort();
    }
    let ended = Instant::now();

    let samples = samples.lock().expect("samples").clone();
    let during = |at: Instant| at >= flood_start && at <= flood_end;
    let peak_fds = samples
        .iter()
        .filter(|s| during(s.0))
        .map(|s| s.1)
        .chain([at_open.0])
        .max()
        .unwrap_or(0);
    let peak_rss = samples
        .iter()
        .filter(|s| during(s.0))
        .map(|s| s.2)
        .chain([at_open.1])
        .max()
        .unwrap_or(0);
    let gets = gets.lock().expect("gets").clone();
    let readyz = readyz.lock().expect("readyz").clone();
    let stats = fleet.stats();
    let report = Flood {
        connections: flood.connections as u64,
        sources: flood.sources as u64,
        concurrency: flood.concurrency as u64,
        accepted,
        refused: opened.refused,
        timed_out: opened.timed_out,
        other: opened.other,
        not_attempted: opened.not_attempted,
        opened_in_s: (opened_at - flood_start).as_secs_f64(),
        closed_by_bulwark,
        lasted_s: (flood_end - flood_start).as_secs_f64(),
        fd_limit,
        fds: Phases {
            idle: idle.0,
            peak: peak_fds,
            after: after.0,
        },
        rss_bytes: Phases {
            idle: idle.1,
            peak: peak_rss,
            after: after.1,
        },
        gets_before: latency(&gets, |at| at < flood_start),
        gets_during: latency(&gets, during),
        readyz_during: latency(&readyz, during),
        new_client,
        bulwark_refused: by_reason(&metrics, "bulwark_connections_refused_total"),
        bulwark_closed: by_reason(&metrics, "bulwark_connections_closed_total"),
        first_error: opened.first_error,
    };
    let mut classes = BTreeMap::new();
    classes.insert("authenticated".to_string(), class(&gets, ended - started));
    Ok(Run {
        apiserver: report::Apiserver {
            replica_requests: stats.iter().map(|s| s.requests).collect(),
            replica_peak_inflight: stats.iter().map(|s| s.peak_in_flight).collect(),
            upstream_requests: stats.iter().map(|s| s.requests).sum(),
            ..report::Apiserver::default()
        },
        classes,
        flood: Some(report),
        fleet: None,
        ..Run::default()
    })
}

/// The authenticated client's GETs, one every [`GET_EVERY`], until aborted.
fn spawn_gets(mut client: Client, log: Log) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(GET_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let sent = Instant::now();
            let outcome = client
                .call(Method::GET, GET_PATH, None, Read::Count, REQUEST_TIMEOUT)
                .await;
            let result = match outcome {
                Outcome::Ok { latency, .. } => Ok(latency),
                Outcome::Rejected { .. } => Err("429".to_string()),
                Outcome::Error(e) => Err(e),
            };
            log.lock().expect("log").push((sent, result));
        }
    })
}

/// `/readyz` on the admin listener every [`READYZ_EVERY`], until aborted; anything but a
/// 200 within [`REQUEST_TIMEOUT`] is a failure.
fn spawn_readyz(admin: SocketAddr, log: Log) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(READYZ_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let sent = Instant::now();
            let polled =
                tokio::time::timeout(REQUEST_TIMEOUT, proxy_process::admin_get(admin, "/readyz"))
                    .await;
            let result = match polled {
                Ok(Ok(200)) => Ok(sent.elapsed()),
                Ok(Ok(code)) => Err(format!("status {code}")),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
            };
            log.lock().expect("log").push((sent, result));
        }
    })
}

/// Reads Bulwark's descriptors and memory every [`SAMPLE_EVERY`], until aborted.
fn spawn_sampler(pid: u32, samples: Samples) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Ok((fds, rss)) = sample(pid).await {
                samples
                    .lock()
                    .expect("samples")
                    .push((Instant::now(), fds, rss));
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    })
}

/// Bulwark's open file descriptors (entries of `/proc/PID/fd`) and resident memory
/// (`VmRSS`), read off the runtime's threads.
async fn sample(pid: u32) -> anyhow::Result<(u64, u64)> {
    tokio::task::spawn_blocking(move || {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss = vm_rss(&status).context("no VmRSS in /proc status")?;
        Ok((fds, rss))
    })
    .await?
}

/// `VmRSS` in bytes from `/proc/PID/status`.
fn vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The soft open-file limit from `/proc/PID/limits`.
fn fd_limit(pid: u32) -> anyhow::Result<u64> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    max_open_files(&limits).context("no readable `Max open files` line")
}

fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// The flood as the client saw it.
struct Opened {
    /// The connections that were served, held open (their tasks answer pings).
    accepted: Vec<SendRequest<Full<Bytes>>>,
    refused: u64,
    timed_out: u64,
    other: u64,
    not_attempted: u64,
    first_error: Option<String>,
    /// Accepted connections that ended before the client let go: Bulwark closed them.
    closed_by_bulwark: Arc<AtomicU64>,
    /// Set before the client drops its connections, so their end is not counted.
    letting_go: Arc<AtomicBool>,
}

/// How one flood connection went.
enum Attempt {
    Accepted(SendRequest<Full<Bytes>>),
    Refused(String),
    TimedOut,
    Other(String),
    NotAttempted,
}

/// Opens the flood: `connections` attempts, at most `concurrency` at a time, source `i`
/// of `sources` bound for the `i`-th.
async fn open_flood(target: Target, flood: &FloodOptions) -> anyhow::Result<Opened> {
    let tls = anonymous_tls(&target)?;
    let closed_by_bulwark = Arc::new(AtomicU64::new(0));
    let letting_go = Arc::new(AtomicBool::new(false));
    let give_up = Instant::now() + OPEN_WITHIN;
    let sources = flood.sources;
    let token = flood.authenticated.then_some(bulwark_testkit::GOOD_TOKEN);
    let (closed, going) = (closed_by_bulwark.clone(), letting_go.clone());
    let attempts = futures::stream::iter(0..flood.connections)
        .map(move |i| {
            let source = Ipv4Addr::new(127, 0, 0, FIRST_SOURCE + (i % sources) as u8);
            let tls = tls.clone();
            let closed = closed.clone();
            let letting_go = going.clone();
            let target = target.addr;
            async move {
                if Instant::now() > give_up {
                    return Attempt::NotAttempted;
                }
                let attempt = flood_connection(source, target, tls, token, closed, letting_go);
                match tokio::time::timeout(ATTEMPT_TIMEOUT, attempt).await {
                    Ok(done) => done,
                    Err(_) => Attempt::TimedOut,
                }
            }
        })
        .buffer_unordered(flood.concurrency);
    tokio::pin!(attempts);
    let mut opened = Opened {
        accepted: Vec::with_capacity(flood.connections),
        refused: 0,
        timed_out: 0,
        other: 0,
        not_attempted: 0,
        first_error: None,
        closed_by_bulwark,
        letting_go,
    };
    let mut done = 0usize;
    while let Some(attempt) = attempts.next().await {
        done += 1;
        if done.is_multiple_of(1000) {
            eprintln!("    {done} attempts, {} accepted", opened.accepted.len());
        }
        match attempt {
            Attempt::Accepted(sender) => opened.accepted.push(sender),
            Attempt::Refused(e) => {
                opened.refused += 1;
                opened.first_error.get_or_insert(e);
            }
            Attempt::TimedOut => opened.timed_out += 1,
            Attempt::Other(e) => {
                opened.other += 1;
                opened.first_error.get_or_insert(e);
            }
            Attempt::NotAttempted => opened.not_attempted += 1,
        }
    }
    Ok(opened)
}

/// One flood connection from `source`: TCP, TLS without a certificate, HTTP/2, one GET
/// answered 401 (or, with a `token`, answered); then the connection's task keeps it (and
/// answers pings) until it ends.
async fn flood_connection(
    source: Ipv4Addr,
    to: SocketAddr,
    tls: TlsConnector,
    token: Option<&str>,
    closed_by_bulwark: Arc<AtomicU64>,
    letting_go: Arc<AtomicBool>,
) -> Attempt {
    let tcp = match bulwark_testkit::tcp_from(IpAddr::V4(source), to).await {
        Ok(tcp) => tcp,
        Err(e) => return Attempt::Refused(format!("TCP: {e}")),
    };
    let name = ServerName::IpAddress(to.ip().into());
    let stream = match tls.connect(name, tcp).await {
        Ok(s) => s,
        Err(e) => return Attempt::Refused(format!("TLS: {e}")),
    };
    let handshake = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .handshake(TokioIo::new(stream))
        .await;
    let (mut sender, conn) = match handshake {
        Ok(h) => h,
        Err(e) => return Attempt::Refused(format!("HTTP/2: {e}")),
    };
    tokio::spawn(async move {
        let _ = conn.await;
        if !letting_go.load(Ordering::Relaxed) {
            closed_by_bulwark.fetch_add(1, Ordering::Relaxed);
        }
    });
    let mut request = Request::builder().method(Method::GET);
    request = match token {
        Some(token) => request
            .uri(format!("https://{to}{GET_PATH}"))
            .header(http::header::AUTHORIZATION, format!("Bearer {token}")),
        None => request.uri(format!("https://{to}{FLOOD_PATH}")),
    };
    let request = request
        .body(Full::new(Bytes::new()))
        .expect("a valid request");
    let answer = async {
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        response.into_body().collect().await?;
        Ok::<_, hyper::Error>(status)
    };
    match answer.await {
        Ok(StatusCode::UNAUTHORIZED) if token.is_none() => Attempt::Accepted(sender),
        Ok(status)
            if token.is_some() && (status.is_success() || status == StatusCode::FORBIDDEN) =>
        {
            Attempt::Accepted(sender)
        }
        Ok(status) => Attempt::Other(format!("status {status}")),
        Err(e) => Attempt::Refused(format!("request: {e}")),
    }
}

/// TLS to the target with its CA and no client certificate, offering HTTP/2.
fn anonymous_tls(target: &Target) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(target.ca_pem.as_bytes()) {
        roots.add(cert.context("the target's CA")?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// A new authenticated client during the flood: connect (TLS with its certificate,
/// HTTP/2) and one GET, within [`ATTEMPT_TIMEOUT`].
async fn new_client(target: &Target, identity: &crate::client::Identity) -> NewClient {
    let started = Instant::now();
    let attempt = async {
        let mut client = Client::new(target, identity).map_err(|e| e.to_string())?;
        client.connect().await.map_err(|e| e.to_string())?;
        match client
            .call(Method::GET, GET_PATH, None, Read::Count, ATTEMPT_TIMEOUT)
            .await
        {
            Outcome::Ok { .. } => Ok(()),
            Outcome::Rejected { .. } => Err("429".to_string()),
            Outcome::Error(e) => Err(e),
        }
    };
    let result = match tokio::time::timeout(ATTEMPT_TIMEOUT, attempt).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {ATTEMPT_TIMEOUT:?}")),
    };
    NewClient {
        connected: result.is_ok(),
        ms: started.elapsed().as_secs_f64() * 1000.0,
        error: result.err(),
    }
}

/// Latency and failures of the requests of `log` sent when `when` says.
fn latency(
    log: &[(Instant, Result<Duration, String>)],
    when: impl Fn(Instant) -> bool,
) -> FloodLatency {
    let mut hist = new_histogram();
    let mut out = FloodLatency::default();
    for (_, result) in log.iter().filter(|(at, _)| when(*at)) {
        out.requests += 1;
        match result {
            Ok(latency) => {
                out.ok += 1;
                let _ = hist.record(latency.as_micros().max(1) as u64);
            }
            Err(e) => {
                out.failed += 1;
                out.first_failure.get_or_insert_with(|| e.clone());
            }
        }
    }
    if !hist.is_empty() {
        let ms = |v: u64| v as f64 / 1000.0;
        out.p50_ms = ms(hist.value_at_quantile(0.5));
        out.p99_ms = ms(hist.value_at_quantile(0.99));
        out.max_ms = ms(hist.max());
    }
    out
}

/// The authenticated client's whole run in the shape of every scenario's classes.
fn class(log: &[(Instant, Result<Duration, String>)], elapsed: Duration) -> report::Class {
    let mut hist = new_histogram();
    let mut c = report::Class::default();
    for (_, result) in log {
        c.requests += 1;
        match result {
            Ok(latency) => {
                c.ok += 1;
                let _ = hist.record(latency.as_micros().max(1) as u64);
            }
            Err(_) => c.errors += 1,
        }
    }
    if !hist.is_empty() {
        let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        c.mean_ms = hist.mean() / 1000.0;
        c.p50_ms = ms(0.5);
        c.p99_ms = ms(0.99);
        c.p999_ms = ms(0.999);
    }
    c.rps = c.ok as f64 / elapsed.as_secs_f64().max(1e-9);
    c.per_identity_ok = vec![c.ok];
    c
}

/// The samples of the counter `name` by their `reason` label, from Prometheus text.
fn by_reason(metrics: &str, name: &str) -> BTreeMap<String, u64> {
    let prefix = format!("{name}{{reason=\"");
    metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let (reason, value) = rest.split_once("\"}")?;
            let value: f64 = value.trim().parse().ok()?;
            Some((reason.to_string(), value as u64))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_resident_memory_and_the_open_file_limit_from_proc() {
        let status = "Name:\tbulwark\nVmHWM:\t   2048 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(vm_rss(status), Some(1000 * 1024));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63429                63429                processes \n\
                      Max open files            20000                40000                files     \n";
        assert_eq!(max_open_files(limits), Some(20000));
        assert_eq!(max_open_files("Limit\n"), None);
    }

    #[test]
    fn counts_connections_by_reason_from_the_metrics_text() {
        let text = "# HELP bulwark_connections_refused_total x\n\
                    bulwark_connections_refused_total{reason=\"max_connections\"} 12\n\
                    bulwark_connections_refused_total{reason=\"max_connections_per_source\"} 3\n\
                    bulwark_connections_closed_total{reason=\"unauthenticated_timeout\"} 200\n";
        let refused = by_reason(text, "bulwark_connections_refused_total");
        assert_eq!(refused.len(), 2);
        assert_eq!(refused["max_connections"], 12);
        assert_eq!(
            by_reason(text, "bulwark_connections_closed_total")["unauthenticated_timeout"],
            200
        );
        assert!(by_reason("", "bulwark_connections_closed_total").is_empty());
    }

    #[test]
    fn latency_counts_only_the_window_and_keeps_the_first_failure() {
        let t0 = Instant::now();
        let log = vec![
            (t0, Ok(Duration::from_millis(2))),
            (t0 + Duration::from_secs(1), Err("reset".to_string())),
            (t0 + Duration::from_secs(2), Ok(Duration::from_millis(8))),
            (t0 + Duration::from_secs(3), Err("timeout".to_string())),
        ];
        let l = latency(&log, |at| at >= t0 + Duration::from_secs(1));
        assert_eq!((l.requests, l.ok, l.failed), (3, 1, 2));
        assert_eq!(l.first_failure.as_deref(), Some("reset"));
        assert!((l.max_ms - 8.0).abs() < 0.1, "{l:?}");
    }
}
