//! `passthrough`: what a proxy costs on a small GET, measured with a load generator that is
//! not the bottleneck. h2load (nghttp2's) sends GETs of one small object over TLS and
//! HTTP/2 — straight to the upstream, then through haproxy, nginx, the floor and Bulwark,
//! the last two with one and with two workers — first at two fixed rates (the latency each
//! proxy adds), then as fast as it can (each proxy's saturation throughput). The proxy's
//! CPU time over each phase, from `/proc`, gives its CPU cost per request.
//!
//! The floor (`crate::floor`) is a bare reverse proxy built from Bulwark's own crates,
//! runtime and allocator, doing nothing but forward: what Bulwark costs above it is
//! Bulwark's own work, and `x floor` in the summary is Bulwark's saturation throughput per
//! core against the floor's.
//!
//! The upstream is nginx answering like an apiserver (the object, a TokenReview, `/readyz`)
//! from static text, so that it is never the bottleneck: about 150k requests/s on one core
//! here. The proxies and the upstream share one core and h2load has another (`taskset`),
//! so a proxy's throughput is what is left of its core after the upstream's share; Bulwark
//! and the floor with two workers get both cores. Every proxy terminates TLS and speaks TLS
//! upstream, HTTP/2 on both legs but for nginx, which speaks HTTP/1.1 upstream.
//!
//! Bulwark does all its per-request work: the client's bearer token reviewed by
//! TokenReview (cached), classification, a rule match (an exempt rule, so that no limit
//! shapes the figures), admission, metrics, the replica pick and the front-proxy headers;
//! its cache is off. Like the floor's, its workers are threads with a runtime and upstream
//! connections each (`listen.workers`), and like the floor and haproxy it puts as many
//! streams on an upstream connection as the upstream takes (`upstream.streamsPerConnection`
//! 1,000 here; 100, the kube-apiserver's limit, by default).
//!
//! `bulwark-refused` is the same Bulwark under a rule whose bucket is empty: every request
//! refused with 429 `rate_limited`, so that what shedding a storm costs a request stands
//! beside what forwarding one costs, in one run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use bulwark_sim::pki::{Ca, Pki};
use bulwark_testkit::{BulwarkConfig, Credentials, Names};
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use super::Options;
use crate::child;
use crate::client::{Target, new_histogram};
use crate::proxy_process::{ProxyProcess, cost_of, free_port, stop_child};
use crate::report::{self, Class, ProxyCost, Report, Run};

/// The object every GET reads.
const PATH: &str = "/api/v1/namespaces/ns-0/configmaps/configmap-0";
/// What the upstream answers to it.
const OBJECT: &str = r#"{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"configmap-0","namespace":"ns-0","resourceVersion":"1"},"data":{"k":"v"}}"#;
/// [`OBJECT`] with its one value padded so that it is `bytes` long (never shorter than
/// [`OBJECT`]): the object every GET reads (`--object-bytes`).
fn object(bytes: Option<u32>) -> String {
    let bare = OBJECT.len();
    let pad = bytes.map_or(0, |b| (b as usize).saturating_sub(bare));
    OBJECT.replacen(r#""k":"v""#, &format!(r#""k":"v{}""#, "v".repeat(pad)), 1)
}
/// What the upstream answers to every TokenReview.
const REVIEW: &str = r#"{"kind":"TokenReview","apiVersion":"authentication.k8s.io/v1","status":{"authenticated":true,"user":{"username":"passthrough","groups":["system:authenticated"]}}}"#;
/// The bearer token h2load sends.
const CLIENT_TOKEN: &str = "passthrough-client-token";
/// h2load's connections where it has one core, and concurrent streams on each.
const CONNECTIONS: u32 = 20;
/// See [`CONNECTIONS`].
const STREAMS: u32 = 10;
/// h2load's connections per worker of the most workers measured where it has cores of its
/// own, so that every worker gets several.
const CONNECTIONS_PER_WORKER: u32 = 8;
/// Concurrent streams the upstream takes on one connection.
const UPSTREAM_STREAMS: u32 = 1_000;
/// The worker counts measured unless `--workers` says otherwise.
pub const DEFAULT_WORKERS: [usize; 2] = [1, 2];
/// The fixed rates the added latency is measured at, requests/s over all connections.
const FIXED_RATES: [u32; 2] = [2_000, 20_000];
/// Requests each target gets before it is measured (connections, the token review).
const WARM_UP: u32 = 2_000;

/// Bulwark exempts the scenario's client, so that the figures are the proxy's own cost.
const MEASURED_RULE: &str = r#"
rules:
  - name: passthrough-measurement
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: exempt
"#;

/// Bulwark refuses the scenario's client: its bucket holds one request and refills once in
/// a thousand seconds, so that every request after the warm-up's first is a 429.
const REFUSING_RULE: &str = r#"
levels:
  - {name: refusing, seats: 4, queues: 8, handSize: 2, queueLength: 10, maxWait: 1s}
rules:
  - name: passthrough-refusal
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: refusing
    rate: {qps: 0.001, burst: 1}
"#;

/// What is measured, in the order it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Subject {
    /// h2load → the upstream.
    Direct,
    /// h2load → haproxy with this many threads → the upstream.
    Haproxy(usize),
    /// h2load → nginx (one worker) → the upstream.
    Nginx,
    /// h2load → the floor (`crate::floor`) with this many workers → the upstream.
    Floor(usize),
    /// h2load → Bulwark with this many worker threads (`listen.workers`) → the upstream.
    Bulwark(usize),
    /// h2load → Bulwark as [`Subject::Bulwark`] but under a rule whose bucket is empty:
    /// every request after the first refused with 429 `rate_limited`, what shedding a
    /// storm costs a request beside what forwarding one does.
    Refused(usize),
}

impl Subject {
    /// What a run measures, in order: direct, haproxy, nginx, then the floor and Bulwark
    /// with each of `workers`, and Bulwark refusing every request with the fewest. haproxy
    /// runs with each of `workers` too when they were asked for (`explicit`), else with one
    /// thread only.
    fn all(workers: &[usize], explicit: bool) -> Vec<Subject> {
        let haproxy = if explicit { workers } else { &[1][..] };
        let mut all = vec![Subject::Direct];
        all.extend(haproxy.iter().map(|&n| Subject::Haproxy(n)));
        all.push(Subject::Nginx);
        all.extend(workers.iter().map(|&n| Subject::Floor(n)));
        all.extend(workers.iter().map(|&n| Subject::Bulwark(n)));
        // A refusal's cost against an answer's: with the fewest workers only.
        all.extend(workers.iter().min().map(|&n| Subject::Refused(n)));
        all
    }

    /// Workers (threads) of the proxy; one for those that have no such setting.
    fn workers(self) -> usize {
        match self {
            Subject::Haproxy(n) | Subject::Floor(n) | Subject::Bulwark(n) | Subject::Refused(n) => {
                n.max(1)
            }
            Subject::Direct | Subject::Nginx => 1,
        }
    }

    /// The run's name in the report: `bulwark`, `bulwark-2-workers`, ...
    fn name(self) -> String {
        let base = match self {
            Subject::Direct => "direct",
            Subject::Haproxy(_) => "haproxy",
            Subject::Nginx => "nginx",
            Subject::Floor(_) => report::FLOOR,
            Subject::Bulwark(_) => "bulwark",
            Subject::Refused(_) => "bulwark-refused",
        };
        match self.workers() {
            1 => base.to_string(),
            n => format!("{base}-{n}-workers"),
        }
    }
}

/// The programs the scenario runs.
struct Tools {
    h2load: PathBuf,
    nginx: PathBuf,
    haproxy: Option<PathBuf>,
    taskset: Option<PathBuf>,
}

/// Where a program is on `PATH` or in `/usr/sbin` (where Debian puts nginx and haproxy).
pub(super) fn find(program: &str) -> Option<PathBuf> {
    child::on_path(program).or_else(|| {
        [Path::new("/usr/sbin"), Path::new("/usr/local/sbin")]
            .iter()
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

impl Tools {
    fn find() -> anyhow::Result<Tools> {
        let need = |program: &str, package: &str| {
            find(program).with_context(|| {
                format!(
                    "passthrough needs {program}, which is not installed; on Debian or \
                     Ubuntu: sudo apt-get install {package}"
                )
            })
        };
        let haproxy = find("haproxy");
        if haproxy.is_none() {
            eprintln!(
                "note: haproxy is not installed, so its run is skipped; on Debian or Ubuntu: \
                 sudo apt-get install haproxy"
            );
        }
        Ok(Tools {
            h2load: need("h2load", "nghttp2-client")?,
            nginx: need("nginx", "nginx")?,
            haproxy,
            taskset: find("taskset"),
        })
    }
}

/// Which cores the proxies, the upstream and the load generator run on.
#[derive(Clone, Debug, PartialEq)]
struct Pinning {
    /// The proxies' cores, in the order workers take them.
    proxy: Vec<usize>,
    /// The upstream's (one nginx worker each).
    upstream: Vec<usize>,
    /// h2load's (one thread each).
    load: Vec<usize>,
}

impl Pinning {
    /// The cores this process may run on, when `taskset` is there to pin.
    fn choose(tools: &Tools, most_workers: usize) -> Option<Pinning> {
        tools.taskset.as_ref()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
        Pinning::over(&cpu_list(list), most_workers)
    }

    /// With room for it (the most workers and at least two cores each for the upstream
    /// and h2load), each gets cores of its own: the proxies the first, the upstream and
    /// h2load half the rest each. Otherwise the proxy and the upstream share the first core
    /// and h2load has the second, and a proxy with more workers takes as many of the cores
    /// as there are.
    fn over(cores: &[usize], most_workers: usize) -> Option<Pinning> {
        let most_workers = most_workers.max(1);
        if cores.len() >= most_workers + 4 && most_workers > 1 {
            let (proxy, rest) = cores.split_at(most_workers);
            let (upstream, load) = rest.split_at(rest.len() / 2);
            return Some(Pinning {
                proxy: proxy.to_vec(),
                upstream: upstream.to_vec(),
                load: load.to_vec(),
            });
        }
        let (first, second) = (*cores.first()?, *cores.get(1)?);
        Some(Pinning {
            proxy: cores.to_vec(),
            upstream: vec![first],
            load: vec![second],
        })
    }

    /// Whether the proxies have cores of their own (not shared with the upstream).
    fn wide(&self) -> bool {
        !self.upstream.contains(&self.proxy[0])
    }

    /// The cores of a subject's processes: as many as it has workers.
    fn proxy_cores(&self, subject: Subject) -> String {
        let n = subject.workers().min(self.proxy.len());
        join(&self.proxy[..n])
    }

    fn describe(pinning: Option<&Pinning>) -> String {
        match pinning {
            Some(p) if p.wide() => format!(
                "proxies on cores {} (as many as they have workers), the upstream (nginx, \
                 {} workers) on cores {}, h2load ({} threads) on cores {}",
                join(&p.proxy),
                p.upstream.len(),
                join(&p.upstream),
                p.load.len(),
                join(&p.load)
            ),
            Some(p) => format!(
                "upstream and proxy on core {}, h2load on core {} (the floor and Bulwark \
                 with two workers: cores {})",
                p.proxy[0],
                p.load[0],
                p.proxy_cores(Subject::Bulwark(2))
            ),
            None => "none: taskset is missing or this machine has one core, so the proxy, \
                     the upstream and h2load share every core"
                .into(),
        }
    }
}

fn join(cores: &[usize]) -> String {
    cores
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The cores of a CPU list as the kernel writes it (`0-3,8,10-11`), in order.
fn cpu_list(list: &str) -> Vec<usize> {
    let mut cores = Vec::new();
    for part in list.trim().split(',') {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(first), Ok(last)) = (first.trim().parse::<usize>(), last.trim().parse::<usize>())
        {
            cores.extend(first..=last);
        }
    }
    cores
}

/// A command for `program`, pinned to `cores` when there is pinning.
fn pinned(tools: &Tools, cores: Option<String>, program: &Path) -> Command {
    match (&tools.taskset, cores) {
        (Some(taskset), Some(cores)) => {
            let mut command = child::command(taskset);
            command.arg("-c").arg(cores).arg(program);
            command
        }
        _ => child::command(program),
    }
}

/// Runs the scenario against every subject that is installed, the floor and Bulwark (and
/// haproxy, when they are given) with each of `workers` (default [`DEFAULT_WORKERS`]).
pub async fn run(
    opts: &Options,
    workers: &[usize],
    object_bytes: Option<u32>,
) -> anyhow::Result<Report> {
    let tools = Tools::find()?;
    let explicit = !workers.is_empty();
    let workers = if explicit {
        workers
    } else {
        &DEFAULT_WORKERS[..]
    };
    let most_workers = workers.iter().copied().max().unwrap_or(1);
    let pinning = Pinning::choose(&tools, most_workers);
    let subjects = Subject::all(workers, explicit);
    let connections = match &pinning {
        Some(p) if p.wide() => CONNECTIONS.max(CONNECTIONS_PER_WORKER * most_workers as u32),
        _ => CONNECTIONS,
    };
    let phase = opts.duration_or(Duration::from_secs(30)) / (FIXED_RATES.len() as u32 + 1);
    let dir = tempfile::Builder::new()
        .prefix("bulwark-passthrough-")
        .tempdir()
        .context("creating the run's folder")?;
    let object = object(object_bytes);
    let bench = Bench::start(dir.path(), &tools, pinning.clone(), connections, &object).await?;
    let mut runs = Vec::new();
    for &subject in &subjects {
        if opts
            .only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|o| o == subject.name()))
        {
            continue;
        }
        if matches!(subject, Subject::Haproxy(_)) && tools.haproxy.is_none() {
            continue;
        }
        eprintln!("== passthrough ({}): starting", subject.name());
        let run = bench.measure(subject, phase).await?;
        eprintln!(
            "== passthrough ({}): {:.0} requests/s at saturation",
            subject.name(),
            run.classes.get("saturation").map_or(0.0, |c| c.rps)
        );
        runs.push((subject.name(), run));
    }
    let cores = runs
        .iter()
        .filter_map(|(name, _)| {
            let subject = subjects.iter().find(|s| s.name() == *name)?;
            let cores = pinning.as_ref()?.proxy_cores(*subject);
            Some((name.clone(), cores.split(',').count()))
        })
        .collect();
    let mut report = Report::new("passthrough", opts.scale, runs);
    let rates: Vec<String> = FIXED_RATES.iter().map(u32::to_string).collect();
    report.bench = Some(report::BenchSetup {
        load_generator: format!(
            "{}, {connections} connections × {STREAMS} streams on {} threads, one bearer \
             token, a GET of a {}-byte object; fixed rates {} requests/s, then saturation; \
             {} s each",
            bench.h2load_version,
            bench.threads(),
            object.len(),
            rates.join(" and "),
            phase.as_secs().max(1)
        ),
        pinning: Pinning::describe(pinning.as_ref()),
        fixed_rates: FIXED_RATES.to_vec(),
        cores,
    });
    Ok(report)
}

/// The upstream and what every subject is started with.
struct Bench<'a> {
    dir: PathBuf,
    tools: &'a Tools,
    pinning: Option<Pinning>,
    pki: Pki,
    /// The serving certificate and key of the upstream, which the proxies serve too.
    serving: (PathBuf, PathBuf),
    /// The CA that signed it, which the proxies verify the upstream with.
    upstream_ca: PathBuf,
    /// h2load's connections.
    connections: u32,
    upstream: Child,
    /// The upstream's TLS listener.
    upstream_addr: SocketAddr,
    /// The upstream's plain listener for `stub_status` (its request count).
    status_addr: SocketAddr,
    h2load_version: String,
}

impl Drop for Bench<'_> {
    /// The upstream with several workers is a master and its workers: stop them all.
    fn drop(&mut self) {
        if let Some(pid) = self.upstream.id() {
            child::signal_group(pid, rustix::process::Signal::KILL);
        }
    }
}

/// How h2load loads a subject.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// A fixed number of requests, as fast as they go, not measured.
    WarmUp,
    /// This many requests/s for this long.
    Fixed(u32, Duration),
    /// As fast as the subject answers, for this long.
    Saturation(Duration),
}

/// A subject's proxy process, if it has one.
enum Front {
    Upstream,
    External { child: Child, name: &'static str },
    Bulwark(ProxyProcess),
}

impl Front {
    /// The proxy process's CPU time so far (user + system), seconds; none for `direct`.
    fn cpu_seconds(&self) -> anyhow::Result<Option<f64>> {
        Ok(match self {
            Front::Upstream => None,
            Front::External { child, .. } => Some(cost_of(child)?.cpu_seconds),
            Front::Bulwark(process) => Some(process.cost()?.cpu_seconds),
        })
    }

    async fn stop(self, dir: &Path) -> anyhow::Result<Option<ProxyCost>> {
        Ok(match self {
            Front::Upstream => None,
            Front::External { mut child, name } => {
                let log =
                    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
                Some(stop_child(&mut child, name, &log).await?)
            }
            Front::Bulwark(process) => Some(process.stop().await?),
        })
    }
}

impl<'a> Bench<'a> {
    /// Writes the upstream's certificate and configuration into `dir` and starts it.
    async fn start(
        dir: &Path,
        tools: &'a Tools,
        pinning: Option<Pinning>,
        connections: u32,
        object: &str,
    ) -> anyhow::Result<Bench<'a>> {
        let pki = Pki::new();
        let (crt, key) = pki
            .server_ca
            .server_cert(&["127.0.0.1", "localhost"])
            .write(dir, "upstream")?;
        let upstream_ca = dir.join("upstream-ca.crt");
        std::fs::write(&upstream_ca, pki.server_ca.cert_pem())?;
        let upstream_workers = pinning.as_ref().map_or(1, |p| p.upstream.len());
        let upstream_addr = free_port()?;
        let status_addr = free_port()?;
        let config = format!(
            r#"{head}  default_type application/json;
  server {{
    listen {upstream_addr} ssl http2;
    ssl_certificate {crt};
    ssl_certificate_key {key};
    http2_max_concurrent_streams {UPSTREAM_STREAMS};
    keepalive_requests 100000000;
    location = /readyz {{ return 200 'ok'; }}
    location = /apis/authentication.k8s.io/v1/tokenreviews {{ return 201 '{REVIEW}'; }}
    location / {{ return 200 '{object}'; }}
  }}
  server {{
    listen {status_addr};
    location / {{ stub_status; }}
  }}
}}
"#,
            head = nginx_head(dir, "upstream", upstream_workers),
            crt = crt.display(),
            key = key.display(),
        );
        let path = dir.join("upstream.conf");
        std::fs::write(&path, config)?;
        let cores = pinning.as_ref().map(|p| join(&p.upstream));
        let mut command = pinned(tools, cores, &tools.nginx);
        command.arg("-c").arg(&path).arg("-p").arg(dir);
        let upstream = spawn(command, dir, "upstream")?;
        let version = Command::new(&tools.h2load)
            .arg("--version")
            .output()
            .await?;
        let mut bench = Bench {
            dir: dir.to_path_buf(),
            tools,
            pinning,
            pki,
            serving: (crt, key),
            upstream_ca,
            connections,
            upstream,
            upstream_addr,
            status_addr,
            h2load_version: String::from_utf8_lossy(&version.stdout).trim().to_string(),
        };
        wait_listening(
            &mut bench.upstream,
            upstream_addr,
            "the upstream nginx",
            dir,
        )
        .await?;
        Ok(bench)
    }

    /// Starts `subject`, warms it up, measures it at each fixed rate and at saturation
    /// (with the proxy's CPU time over each), and stops it.
    async fn measure(&self, subject: Subject, phase: Duration) -> anyhow::Result<Run> {
        let (addr, front) = self.front(subject).await?;
        let url = format!("https://{addr}{PATH}");
        let warm = self.h2load(&url, Load::WarmUp).await?;
        if warm.ok + warm.rejected == 0 {
            let _ = front.stop(&self.dir).await;
            bail!(
                "{}: not one warm-up request succeeded ({} requests, {} refused, {} errors)",
                subject.name(),
                warm.requests,
                warm.rejected,
                warm.errors
            );
        }
        let before = self.upstream_requests().await?;
        let mut classes = std::collections::BTreeMap::new();
        let loads = FIXED_RATES
            .iter()
            .map(|rate| (report::fixed_rate_class(*rate), Load::Fixed(*rate, phase)))
            .chain([(report::SATURATION.to_string(), Load::Saturation(phase))]);
        for (name, load) in loads {
            let speed_before = match load {
                Load::Saturation(_) => Some(self.calibrate(subject).await?),
                _ => None,
            };
            let cpu = front.cpu_seconds()?;
            let mut class = self.h2load(&url, load).await?;
            class.proxy_cpu_seconds = match (cpu, front.cpu_seconds()?) {
                (Some(before), Some(after)) => Some(after - before),
                _ => None,
            };
            if let Some(speed_before) = speed_before {
                class.calibration_ms = Some((speed_before, self.calibrate(subject).await?));
            }
            classes.insert(name, class);
        }
        // The second status read counts itself.
        let upstream = (self.upstream_requests().await?).saturating_sub(before + 1);
        let proxy = front.stop(&self.dir).await?;
        Ok(Run {
            apiserver: report::Apiserver {
                replica_requests: vec![upstream],
                upstream_requests: upstream,
                ..report::Apiserver::default()
            },
            proxy,
            classes,
            event_delivery_p99_ms: None,
            watch_bytes_per_event: None,
            watch_cost: None,
            flood: None,
            fleet: None,
            timeline: None,
        })
    }

    /// How fast the subject's first core is now: `calibrate`'s fixed work there, pinned
    /// like the proxy, in milliseconds.
    async fn calibrate(&self, subject: Subject) -> anyhow::Result<f64> {
        let cores = self.pinning.as_ref().map(|p| {
            let cores = p.proxy_cores(subject);
            cores.split(',').next().unwrap_or_default().to_string()
        });
        let exe = std::env::current_exe().context("finding this program")?;
        let output = pinned(self.tools, cores, &exe)
            .arg("__calibrate")
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .await
            .context("running the calibration")?;
        let text = String::from_utf8_lossy(&output.stdout);
        text.trim()
            .parse()
            .with_context(|| format!("the calibration printed {text:?}"))
    }

    /// Starts the subject's proxy, pinned; returns where h2load connects.
    async fn front(&self, subject: Subject) -> anyhow::Result<(SocketAddr, Front)> {
        let cores = self.pinning.as_ref().map(|p| p.proxy_cores(subject));
        let dir = &self.dir;
        let up = self.upstream_addr;
        let addr = free_port()?;
        let (serving, serving_key) = (self.serving.0.display(), self.serving.1.display());
        let ca = self.upstream_ca.display();
        let (mut child, name) = match subject {
            Subject::Direct => return Ok((up, Front::Upstream)),
            Subject::Bulwark(_) | Subject::Refused(_) => return self.bulwark(subject, cores).await,
            Subject::Floor(workers) => {
                let exe = std::env::current_exe().context("locating this binary")?;
                let mut command = pinned(self.tools, cores, &exe);
                // Logs at Bulwark's level (`ProxyProcess` sets the same).
                command
                    .env("RUST_LOG", "warn")
                    .arg("__floor")
                    .arg("--listen")
                    .arg(addr.to_string())
                    .arg("--cert")
                    .arg(&self.serving.0)
                    .arg("--key")
                    .arg(&self.serving.1)
                    .arg("--upstream")
                    .arg(up.to_string())
                    .arg("--upstream-ca")
                    .arg(&self.upstream_ca)
                    .arg("--workers")
                    .arg(workers.to_string());
                (spawn(command, dir, "floor")?, "floor")
            }
            Subject::Haproxy(threads) => {
                let bundle = dir.join("serving.pem");
                std::fs::write(
                    &bundle,
                    std::fs::read_to_string(&self.serving.0)?
                        + &std::fs::read_to_string(&self.serving.1)?,
                )?;
                let config = haproxy_config(threads, addr, &bundle, up, ca);
                let path = dir.join("haproxy.cfg");
                std::fs::write(&path, config)?;
                let haproxy = self
                    .tools
                    .haproxy
                    .as_ref()
                    .context("haproxy is not installed")?;
                let mut command = pinned(self.tools, cores, haproxy);
                command.arg("-db").arg("-f").arg(&path);
                (spawn(command, dir, "haproxy")?, "haproxy")
            }
            Subject::Nginx => {
                let config = format!(
                    r#"{head}  proxy_temp_path {d}/nginx-tmp;
  upstream up {{ server {up}; keepalive 64; }}
  server {{
    listen {addr} ssl http2;
    ssl_certificate {serving};
    ssl_certificate_key {serving_key};
    http2_max_concurrent_streams 1000;
    # nginx closes a client connection after 1,000 requests by default, and h2load does
    # not reconnect.
    keepalive_requests 100000000;
    location / {{
      proxy_pass https://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_ssl_trusted_certificate {ca}; proxy_ssl_verify on; proxy_ssl_name localhost;
      proxy_ssl_session_reuse on;
    }}
  }}
}}
"#,
                    head = nginx_head(dir, "nginx", 1),
                    d = dir.display(),
                );
                let path = dir.join("nginx.conf");
                std::fs::write(&path, config)?;
                let mut command = pinned(self.tools, cores, &self.tools.nginx);
                command.arg("-c").arg(&path).arg("-p").arg(dir);
                (spawn(command, dir, "nginx")?, "nginx")
            }
        };
        wait_listening(&mut child, addr, name, dir).await?;
        Ok((addr, Front::External { child, name }))
    }

    /// Starts Bulwark (this binary's hidden subcommand) as `subject` (forwarding or
    /// refusing) with its worker threads.
    async fn bulwark(
        &self,
        subject: Subject,
        cores: Option<String>,
    ) -> anyhow::Result<(SocketAddr, Front)> {
        let rule = match subject {
            Subject::Refused(_) => REFUSING_RULE,
            _ => MEASURED_RULE,
        };
        let workers = subject.workers();
        let dir = self.dir.join(subject.name());
        let serving_ca = Ca::new("bulwark-serving-ca");
        let credentials = Credentials::mint(&dir, &self.pki, &serving_ca, Names::default())?;
        let rules = dir.join("rules");
        std::fs::create_dir_all(&rules)?;
        std::fs::write(rules.join("passthrough.yaml"), rule)?;
        let mut config = BulwarkConfig::new(credentials, vec![self.upstream_addr]);
        config.listen = free_port()?;
        config.admin = free_port()?;
        config.cache = false;
        config.rules = Some(rules);
        config.shutdown = (Duration::ZERO, Duration::from_secs(2));
        // Each worker a thread with its own runtime and upstream connection, as the
        // floor's; the main runtime, left with the probes and the admin listener, one
        // thread.
        let config = config.set("listen.workers", &workers.to_string());
        // The upstream takes 1,000 streams on a connection, and the floor and haproxy use
        // as many as it takes; Bulwark's default, 100, is the kube-apiserver's limit, at
        // which h2load's 200 to 640 streams would need two to seven connections.
        let config = config.set(
            "upstream.streamsPerConnection",
            &UPSTREAM_STREAMS.to_string(),
        );
        let path = dir.join("bulwark.yaml");
        config.write(&path)?;
        let exe = std::env::current_exe().context("locating this binary")?;
        let mut command = pinned(self.tools, cores, &exe);
        command.env("TOKIO_WORKER_THREADS", "1");
        let target = Target {
            addr: config.listen,
            ca_pem: serving_ca.cert_pem(),
        };
        let process = ProxyProcess::launch(command, &path, target, config.admin, &dir).await?;
        Ok((config.listen, Front::Bulwark(process)))
    }

    /// h2load's threads: one per core it has.
    fn threads(&self) -> usize {
        self.pinning.as_ref().map_or(1, |p| p.load.len())
    }

    /// Runs h2load against `url` and reads what it saw.
    async fn h2load(&self, url: &str, load: Load) -> anyhow::Result<Class> {
        let cores = self.pinning.as_ref().map(|p| join(&p.load));
        let mut command = pinned(self.tools, cores, &self.tools.h2load);
        command
            .arg("-t")
            .arg(self.threads().to_string())
            .arg("-c")
            .arg(self.connections.to_string())
            .arg("-m")
            .arg(STREAMS.to_string())
            .arg("-H")
            .arg(format!("authorization: Bearer {CLIENT_TOKEN}"));
        let seconds = |d: Duration| d.as_secs().max(1).to_string();
        match load {
            Load::WarmUp => command.arg("-n").arg(WARM_UP.to_string()),
            Load::Fixed(rate, d) => command
                .arg("--rps")
                .arg((rate / self.connections).max(1).to_string())
                .arg("-D")
                .arg(seconds(d)),
            Load::Saturation(d) => command.arg("-D").arg(seconds(d)),
        };
        // h2load appends to its log: every run starts a fresh one.
        let log = self.dir.join("h2load.log");
        match std::fs::remove_file(&log) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        command
            .arg(format!("--log-file={}", log.display()))
            .arg(url);
        let out = command
            .stdin(Stdio::null())
            .output()
            .await
            .context("running h2load")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "h2load failed ({}):\n{stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let summary = Summary::parse(&stdout)
            .with_context(|| format!("h2load printed no summary:\n{stdout}"))?;
        let entries = std::fs::read_to_string(&log).context("reading h2load's log")?;
        Ok(summary.class(&entries))
    }

    /// How many requests the upstream has served so far (nginx's `stub_status`).
    async fn upstream_requests(&self) -> anyhow::Result<u64> {
        let mut stream = tokio::net::TcpStream::connect(self.status_addr).await?;
        stream
            .write_all(b"GET / HTTP/1.0\r\nHost: status\r\n\r\n")
            .await?;
        let mut text = String::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text))
            .await
            .context("the upstream's status did not answer")??;
        stub_status_requests(&text).with_context(|| format!("not nginx's stub_status: {text}"))
    }
}

/// The start of an nginx configuration: `workers` workers in the foreground (one is the
/// process itself, with no master, so that its CPU time is the process's) with its pid,
/// error log (`NAME.log`, which a stop quotes) and body buffers in `dir`, and an `http`
/// block without an access log, left open.
fn nginx_head(dir: &Path, name: &str, workers: usize) -> String {
    let d = dir.display();
    let master = if workers > 1 { "on" } else { "off" };
    format!(
        "daemon off; master_process {master}; worker_processes {workers}; pid {d}/{name}.pid;
error_log {d}/{name}.log warn;
events {{ worker_connections 8000; }}
http {{
  access_log off;
  client_body_temp_path {d}/{name}-tmp;
"
    )
}

/// The total request count in nginx's `stub_status` page:
/// `server accepts handled requests` is followed by a line of those three numbers.
fn stub_status_requests(page: &str) -> Option<u64> {
    let mut lines = page
        .lines()
        .skip_while(|l| !l.contains("accepts handled requests"));
    lines.next()?;
    lines.next()?.split_whitespace().nth(2)?.parse().ok()
}

/// haproxy's configuration: `threads` threads, TLS and HTTP/2 from clients on `addr` with
/// the certificate and key in `bundle`, TLS and HTTP/2 to the upstream `up` verified
/// against the CA file `ca`.
pub(super) fn haproxy_config(
    threads: usize,
    addr: SocketAddr,
    bundle: &Path,
    up: SocketAddr,
    ca: impl std::fmt::Display,
) -> String {
    format!(
        r#"global
  maxconn 8000
  nbthread {threads}
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend clients
  bind {addr} ssl crt {bundle} alpn h2,http/1.1
  default_backend upstream
backend upstream
  http-reuse always
  server up {up} ssl verify required verifyhost localhost ca-file {ca} alpn h2
"#,
        bundle = bundle.display(),
    )
}

/// Starts `command` with its output in `dir/NAME.out`.
pub(super) fn spawn(mut command: Command, dir: &Path, name: &str) -> anyhow::Result<Child> {
    let out = std::fs::File::create(dir.join(format!("{name}.out")))?;
    command
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting {name}"))
}

/// Waits until something accepts connections on `addr`, or says why `child` exited.
pub(super) async fn wait_listening(
    child: &mut Child,
    addr: SocketAddr,
    name: &str,
    dir: &Path,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait()? {
            let out = std::fs::read_to_string(dir.join(format!("{name}.out"))).unwrap_or_default();
            bail!("{name} exited at start ({status}):\n{out}");
        }
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{name} did not listen on {addr} within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What h2load prints at the end of a run that its log does not hold.
#[derive(Debug, PartialEq)]
struct Summary {
    /// How long the measured part ran.
    elapsed: Duration,
    /// Requests that ended, answered or failed.
    done: u64,
}

impl Summary {
    /// Reads `finished in 10.00s, ...` and `requests: N total, N started, N done, ...`.
    fn parse(stdout: &str) -> Option<Summary> {
        let finished = stdout
            .lines()
            .find_map(|l| l.strip_prefix("finished in "))?;
        let elapsed = finished.split(',').next()?.trim();
        let elapsed = match elapsed.strip_suffix("ms") {
            Some(ms) => ms.parse::<f64>().ok()? / 1000.0,
            None => elapsed.strip_suffix('s')?.parse::<f64>().ok()?,
        };
        let requests = stdout.lines().find_map(|l| l.strip_prefix("requests: "))?;
        let done = requests
            .split(", ")
            .find_map(|part| part.strip_suffix(" done"))?
            .parse()
            .ok()?;
        Some(Summary {
            elapsed: Duration::from_secs_f64(elapsed),
            done,
        })
    }

    /// The class figures from h2load's per-request log (`start µs`, `status`, `µs until
    /// the end of the response`, tab-separated): latency of the 2xx answers, 429s as
    /// refused, every other status or unlogged failure as an error.
    fn class(&self, log: &str) -> Class {
        let mut hist: Histogram<u64> = new_histogram();
        let (mut ok, mut rejected, mut logged) = (0u64, 0u64, 0u64);
        for line in log.lines() {
            let mut columns = line.split('\t');
            let (Some(_), Some(status), Some(micros)) =
                (columns.next(), columns.next(), columns.next())
            else {
                continue;
            };
            let (Ok(status), Ok(micros)) = (status.parse::<u16>(), micros.parse::<u64>()) else {
                continue;
            };
            logged += 1;
            match status {
                200..=299 => {
                    ok += 1;
                    let _ = hist.record(micros.max(1));
                }
                429 => rejected += 1,
                _ => {}
            }
        }
        let requests = self.done.max(logged);
        let ms = |q: f64| {
            if hist.is_empty() {
                0.0
            } else {
                hist.value_at_quantile(q) as f64 / 1000.0
            }
        };
        let secs = self.elapsed.as_secs_f64();
        Class {
            requests,
            ok,
            rejected,
            // h2load logs statuses, not headers.
            rejected_by: Default::default(),
            errors: requests - ok - rejected,
            mean_ms: if hist.is_empty() {
                0.0
            } else {
                hist.mean() / 1000.0
            },
            p50_ms: ms(0.5),
            p99_ms: ms(0.99),
            p999_ms: ms(0.999),
            // Answered: a refusing subject's throughput is its refusals'.
            rps: if secs > 0.0 {
                (ok + rejected) as f64 / secs
            } else {
                0.0
            },
            // One bearer token: one identity.
            per_identity_ok: vec![ok],
            // The caller reads the proxy's CPU time around the run, and the core's speed
            // before it.
            proxy_cpu_seconds: None,
            calibration_ms: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_is_padded_to_the_size_asked_and_stays_a_configmap() {
        assert_eq!(object(None), OBJECT);
        assert_eq!(
            object(Some(10)),
            OBJECT,
            "never shorter than the bare object"
        );
        for bytes in [141, 700, 3_000] {
            let padded = object(Some(bytes));
            assert_eq!(padded.len(), bytes as usize);
            let parsed: serde_json::Value = serde_json::from_str(&padded).unwrap();
            assert_eq!(parsed["kind"], "ConfigMap");
            assert_eq!(parsed["metadata"]["name"], "configmap-0");
        }
    }

    const H2LOAD_OUTPUT: &str = "starting benchmark...
spawning thread #0: 20 total client(s). Timing-based test with 0s of warm-up time and 2s of main duration for measurements.
Warm-up phase is over for thread #0.
Main benchmark duration is over for thread #0. Stopping all clients.
Stopped all clients for thread #0

finished in 2.00s, 34912.50 req/s, 5.23MB/s
requests: 69825 total, 70025 started, 69825 done, 69820 succeeded, 5 failed, 5 errored, 0 timeout
status codes: 69820 2xx, 0 3xx, 3 4xx, 0 5xx
traffic: 10.46MB (10968040) total, 0.98MB (1027440) headers (space savings 95.56%), 8.99MB (9425600) data
                     min         max         mean         sd        +/- sd
time for request:      208us     14.37ms       5.69ms      1.12ms    71.83%
";

    #[test]
    fn reads_the_run_length_and_requests_done_from_h2loads_summary() {
        let summary = Summary::parse(H2LOAD_OUTPUT).unwrap();
        assert_eq!(
            summary,
            Summary {
                elapsed: Duration::from_secs(2),
                done: 69825
            }
        );
        let short = "finished in 812.25ms, 2462.29 req/s, 1MB/s\nrequests: 2000 total, 2000 started, 2000 done, 2000 succeeded, 0 failed, 0 errored, 0 timeout\n";
        assert_eq!(
            Summary::parse(short).unwrap().elapsed,
            Duration::from_micros(812_250)
        );
        assert_eq!(Summary::parse("h2load: connection refused\n"), None);
    }

    #[test]
    fn a_class_counts_statuses_and_times_the_answers_from_the_log() {
        let summary = Summary {
            elapsed: Duration::from_secs(2),
            done: 6,
        };
        // Five logged answers (one a 429, one a 503), one request failed unlogged, and a
        // line that is not an entry.
        let log = "1700000000000000\t200\t100\n1700000000000100\t200\t300\n\
                   1700000000000200\t429\t50\n1700000000000300\t503\t70\n\
                   1700000000000400\t200\t200\ngarbage\n";
        let class = summary.class(log);
        assert_eq!(
            (class.requests, class.ok, class.rejected, class.errors),
            (6, 3, 1, 2)
        );
        assert!((class.mean_ms - 0.2).abs() < 0.001, "{class:?}");
        assert!((class.p99_ms - 0.3).abs() < 0.001, "{class:?}");
        // Answered: the 200s and the 429.
        assert!((class.rps - 2.0).abs() < 1e-9);
        assert_eq!(class.per_identity_ok, vec![3]);
    }

    #[test]
    fn the_floor_runs_between_the_other_proxies_and_bulwark_on_as_many_cores() {
        let names = |subjects: Vec<Subject>| -> Vec<String> {
            subjects.into_iter().map(Subject::name).collect()
        };
        assert_eq!(
            names(Subject::all(&DEFAULT_WORKERS, false)),
            [
                "direct",
                "haproxy",
                "nginx",
                "floor",
                "floor-2-workers",
                "bulwark",
                "bulwark-2-workers",
                "bulwark-refused"
            ]
        );
        assert_eq!(
            names(Subject::all(&[1, 4], true)),
            [
                "direct",
                "haproxy",
                "haproxy-4-workers",
                "nginx",
                "floor",
                "floor-4-workers",
                "bulwark",
                "bulwark-4-workers",
                "bulwark-refused"
            ]
        );
        // Two cores: the proxy shares the first with the upstream, h2load has the second,
        // and two workers take both.
        let pinning = Pinning::over(&[0, 1], 2).expect("two cores pin");
        assert!(!pinning.wide());
        assert_eq!(pinning.proxy_cores(Subject::Floor(1)), "0");
        assert_eq!(pinning.proxy_cores(Subject::Floor(2)), "0,1");
        assert_eq!(
            pinning.proxy_cores(Subject::Floor(2)),
            pinning.proxy_cores(Subject::Bulwark(2))
        );
        assert_eq!(pinning.proxy_cores(Subject::Haproxy(1)), "0");
        assert_eq!((pinning.upstream, pinning.load), (vec![0], vec![1]));
        assert_eq!(Pinning::over(&[3], 1), None, "one core cannot be pinned");
    }

    #[test]
    fn with_cores_to_spare_the_proxies_the_upstream_and_h2load_each_get_their_own() {
        let cores: Vec<usize> = (0..16).collect();
        let pinning = Pinning::over(&cores, 8).expect("sixteen cores pin");
        assert!(pinning.wide());
        assert_eq!(pinning.proxy_cores(Subject::Bulwark(1)), "0");
        assert_eq!(pinning.proxy_cores(Subject::Floor(4)), "0,1,2,3");
        assert_eq!(pinning.proxy_cores(Subject::Haproxy(8)), "0,1,2,3,4,5,6,7");
        assert_eq!(pinning.upstream, [8, 9, 10, 11]);
        assert_eq!(pinning.load, [12, 13, 14, 15]);
        // Too few cores for eight workers and the rest: back to sharing.
        let narrow = Pinning::over(&cores[..10], 8).expect("ten cores pin");
        assert!(!narrow.wide());
        assert_eq!(narrow.proxy_cores(Subject::Bulwark(8)), "0,1,2,3,4,5,6,7");
    }

    #[test]
    fn reads_the_kernels_cpu_lists() {
        assert_eq!(cpu_list("0-1\n"), vec![0, 1]);
        assert_eq!(cpu_list("0-2,8,10-11"), vec![0, 1, 2, 8, 10, 11]);
        assert_eq!(cpu_list("3"), vec![3]);
        assert_eq!(cpu_list(""), Vec::<usize>::new());
    }

    #[test]
    fn reads_the_request_count_from_nginxs_stub_status() {
        let page = "Active connections: 3 \nserver accepts handled requests\n 12 12 98765 \nReading: 0 Writing: 1 Waiting: 2 \n";
        assert_eq!(stub_status_requests(page), Some(98765));
        assert_eq!(stub_status_requests("<html>404</html>"), None);
    }
}
