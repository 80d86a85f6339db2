//! Bulwark as its own process: the runner re-executes itself with the hidden `__bulwark`
//! subcommand, so that Bulwark's memory and CPU are the operating system's figures and
//! `cargo run -p bulwark-loadtest` needs nothing else built.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use bulwark_sim::pki::{Ca, Pki};
use bulwark_testkit::{BulwarkConfig, Credentials, Names};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use crate::Target;
use crate::report::ProxyCost;

/// The namespace of the fleet's Leases.
pub const FLEET_NAMESPACE: &str = "bulwark";

/// The `fleet:` setting of Bulwark `i` of several: Leases in [`FLEET_NAMESPACE`], named by
/// its index.
pub fn fleet_setting(i: usize) -> String {
    format!("{{namespace: {FLEET_NAMESPACE}, identity: bulwark-{i}}}")
}

/// The name of the hidden subcommand that runs Bulwark in this binary.
pub const SUBCOMMAND: &str = "__bulwark";

/// The hidden subcommand that runs `bulwark guard` (the `kubernetes` Service's publisher).
pub const GUARD_SUBCOMMAND: &str = "__bulwark-guard";

/// The rules Bulwark ships for a cluster (`deploy/base/rules/*.yaml`, which the kustomize
/// base and the Helm chart install), compiled in so that no path is baked into the binary;
/// every run writes them into its own folder unless told otherwise.
pub const SHIPPED_RULES: [(&str, &str); 8] = [
    (
        "agents.yaml",
        include_str!("../../../deploy/base/rules/agents.yaml"),
    ),
    (
        "cluster-admins.yaml",
        include_str!("../../../deploy/base/rules/cluster-admins.yaml"),
    ),
    (
        "control-plane.yaml",
        include_str!("../../../deploy/base/rules/control-plane.yaml"),
    ),
    (
        "levels.yaml",
        include_str!("../../../deploy/base/rules/levels.yaml"),
    ),
    (
        "nodes.yaml",
        include_str!("../../../deploy/base/rules/nodes.yaml"),
    ),
    (
        "people.yaml",
        include_str!("../../../deploy/base/rules/people.yaml"),
    ),
    (
        "secret-lists.yaml",
        include_str!("../../../deploy/base/rules/secret-lists.yaml"),
    ),
    (
        "workloads.yaml",
        include_str!("../../../deploy/base/rules/workloads.yaml"),
    ),
];

/// The loadtest's own rules (`loadtest/rules/*.yaml`), for identities only its real
/// control plane has: KWOK's controller, which speaks for every simulated node, and the
/// operator `ops/secret-sync` whose rate the fleet test measures. Written beside
/// [`SHIPPED_RULES`] on the real control plane.
pub const LOADTEST_RULES: [(&str, &str); 2] = [
    (
        "kwok.yaml",
        include_str!("../../../loadtest/rules/kwok.yaml"),
    ),
    (
        "secret-operator.yaml",
        include_str!("../../../loadtest/rules/secret-operator.yaml"),
    ),
];

/// How long Bulwark may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// What Bulwark is put in front of, and with which credentials.
pub struct Upstream<'a> {
    /// The apiserver replicas, addressed one by one.
    pub replicas: Vec<SocketAddr>,
    /// The simulator's PKI: its serving CA, its client CA (which Bulwark also trusts for its
    /// own clients) and its front-proxy CA.
    pub pki: &'a Pki,
    /// CN of the front-proxy certificate; the simulator must allow it.
    pub front_proxy_user: &'a str,
    /// Bulwark's own user and group, which the simulator's policy lets review and watch.
    pub own_user: &'a str,
    /// See `own_user`.
    pub own_group: &'a str,
    /// Heap headroom of one replica, for Bulwark's in-flight LIST byte budget.
    pub heap_headroom: Option<u64>,
    /// Bulwark's `rules.folder`: `None` writes [`SHIPPED_RULES`] into the run's folder and
    /// uses that. Whichever, the rules are enforced (`rules.mode: enforce`), as the
    /// scenarios check who is refused.
    pub rules: Option<PathBuf>,
    /// Bulwark's `identity.mode`; `None` is `front-proxy`.
    pub identity_mode: Option<&'a str>,
    /// The CA Bulwark's serving certificate comes from; `None` mints one. Replicas of a
    /// fleet behind one balancer share one, so that one kubeconfig trusts them all.
    pub serving_ca: Option<&'a Ca>,
    /// More settings, as `BulwarkConfig::set` takes them (`upstream.bulwarkReplicas`, `3`).
    pub settings: Vec<(String, String)>,
    /// The host's own address, for the `kubernetes` Service (which refuses loopback
    /// endpoints): Bulwark then listens on every address, and its
    /// `fleet.kubernetesService.endpoint` is this one with its port. Clients still dial
    /// 127.0.0.1.
    pub advertise: Option<std::net::IpAddr>,
}

/// A running Bulwark process.
pub struct ProxyProcess {
    child: Child,
    /// Where clients connect, with the CA of Bulwark's serving certificate.
    pub target: Target,
    /// Bulwark's admin listener (metrics, health).
    pub admin: SocketAddr,
    log: PathBuf,
}

/// A free port on 127.0.0.1 for a child to bind, from below the ephemeral range (see
/// [`bulwark_testkit::ports`]).
pub fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(bulwark_testkit::free_addr())
}

/// Writes the PEM files and the YAML config of a Bulwark in front of `upstream` into `dir`
/// (with the test kit's one configuration writer) and returns the config file, the client
/// target and the admin address.
pub fn write_config(
    dir: &Path,
    upstream: &Upstream<'_>,
) -> anyhow::Result<(PathBuf, Target, SocketAddr)> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let minted;
    let serving_ca = match upstream.serving_ca {
        Some(ca) => ca,
        None => {
            minted = Ca::new("bulwark-serving-ca");
            &minted
        }
    };
    let names = Names {
        front_proxy: upstream.front_proxy_user,
        own_user: upstream.own_user,
        own_group: upstream.own_group,
    };
    let credentials = Credentials::mint(dir, upstream.pki, serving_ca, names)
        .with_context(|| format!("writing certificates into {}", dir.display()))?;
    let mut config = BulwarkConfig::new(credentials, upstream.replicas.clone())
        .set("upstream.probeInterval", "1s");
    config.listen = free_port()?;
    config.admin = free_port()?;
    config.shutdown = (Duration::ZERO, Duration::from_secs(2));
    config.heap_headroom = upstream.heap_headroom;
    for (path, yaml) in &upstream.settings {
        config = config.set(path, yaml);
    }
    let dial = config.listen;
    if let Some(ip) = upstream.advertise {
        let endpoint = SocketAddr::new(ip, dial.port());
        config.listen = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), dial.port());
        config = config.set(
            "fleet.kubernetesService.endpoint",
            &format!("\"{endpoint}\""),
        );
    }
    if let Some(mode) = upstream.identity_mode {
        config.identity =
            serde_norway::from_str(mode).with_context(|| format!("identity mode {mode:?}"))?;
    }
    config.rules = Some(match &upstream.rules {
        Some(folder) => std::path::absolute(folder)
            .with_context(|| format!("locating the rules folder {}", folder.display()))?,
        None => write_shipped_rules(&dir.join("rules"))?,
    });
    // The deployments install in shadow mode; the runs measure the rules as enforced.
    config = config.set("rules.mode", "enforce");
    let path = dir.join("bulwark.yaml");
    config.write(&path)?;
    let target = Target {
        addr: dial,
        ca_pem: serving_ca.cert_pem(),
    };
    Ok((path, target, config.admin))
}

/// Writes [`SHIPPED_RULES`] into `folder` and returns it.
pub fn write_shipped_rules(folder: &Path) -> anyhow::Result<PathBuf> {
    write_rules(folder, &SHIPPED_RULES)
}

/// Writes [`SHIPPED_RULES`] and [`LOADTEST_RULES`] into `folder` and returns it: the rules
/// of the real control plane's runs.
pub fn write_loadtest_rules(folder: &Path) -> anyhow::Result<PathBuf> {
    write_rules(folder, &SHIPPED_RULES)?;
    write_rules(folder, &LOADTEST_RULES)
}

fn write_rules(folder: &Path, files: &[(&str, &str)]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(folder).with_context(|| format!("creating {}", folder.display()))?;
    for (name, text) in files {
        let path = folder.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(folder.to_path_buf())
}

impl ProxyProcess {
    /// Writes a config into `dir`, starts Bulwark from this same binary and waits until its
    /// admin `/readyz` answers 200.
    pub async fn start(dir: &Path, upstream: &Upstream<'_>) -> anyhow::Result<ProxyProcess> {
        let exe = std::env::current_exe().context("locating this binary")?;
        ProxyProcess::start_exe(&exe, dir, upstream).await
    }

    /// Like [`ProxyProcess::start`], with `exe` (a `bulwark-loadtest` binary) instead of this
    /// one: an integration test's own binary has no `__bulwark` subcommand.
    pub async fn start_exe(
        exe: &Path,
        dir: &Path,
        upstream: &Upstream<'_>,
    ) -> anyhow::Result<ProxyProcess> {
        let (config, target, admin) = write_config(dir, upstream)?;
        ProxyProcess::launch(crate::child::command(exe), &config, target, admin, dir).await
    }

    /// Starts Bulwark from `command` (a `bulwark-loadtest` binary, perhaps behind a wrapper
    /// such as `taskset`) with the configuration at `config`, logging into `dir`, and waits
    /// until its admin `/readyz` answers 200.
    pub async fn launch(
        command: Command,
        config: &Path,
        target: Target,
        admin: SocketAddr,
        dir: &Path,
    ) -> anyhow::Result<ProxyProcess> {
        ProxyProcess::launch_as(command, SUBCOMMAND, config, target, admin, dir).await
    }

    /// Like [`ProxyProcess::launch`], with `command` any program that takes
    /// `SUBCOMMAND --config FILE`: the `bulwark` binary itself is `serve`.
    pub async fn launch_as(
        mut command: Command,
        subcommand: &str,
        config: &Path,
        target: Target,
        admin: SocketAddr,
        dir: &Path,
    ) -> anyhow::Result<ProxyProcess> {
        let log = dir.join("bulwark.log");
        let log_file = std::fs::File::create(&log)?;
        let child = command
            .arg(subcommand)
            .arg("--config")
            .arg(config)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .context("starting the Bulwark process")?;
        let mut process = ProxyProcess {
            child,
            target,
            admin,
            log,
        };
        process.wait_ready().await?;
        Ok(process)
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "Bulwark exited before it was ready ({status}); its log:\n{}",
                    self.log_tail()
                );
            }
            if admin_get(self.admin, "/readyz")
                .await
                .is_ok_and(|code| code == 200)
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "Bulwark was not ready after {READY_TIMEOUT:?}; its log:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The last lines Bulwark logged, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Its process id, while it runs: for faults and figures read from `/proc`.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Its peak RSS and CPU time so far.
    pub fn cost(&self) -> anyhow::Result<ProxyCost> {
        cost_of(&self.child)
    }

    /// Kills it with SIGKILL, as a node failure or an OOM kill does: no drain, no goodbye
    /// to its clients or its Lease.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await.context("killing Bulwark")
    }

    /// Measures the process, then stops it with SIGTERM (its drain is configured short) and
    /// waits for it to exit.
    pub async fn stop(mut self) -> anyhow::Result<ProxyCost> {
        let tail = self.log_tail();
        stop_child(&mut self.child, "Bulwark", &tail).await
    }
}

/// A child process's peak RSS and CPU time so far, from `/proc`.
pub fn cost_of(child: &Child) -> anyhow::Result<ProxyCost> {
    let pid = child.id().context("the proxy process has exited")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    Ok(ProxyCost {
        peak_rss_bytes: vm_hwm(&status).context("no VmHWM in /proc status")?,
        cpu_seconds: cpu_seconds(&stat, rustix::param::clock_ticks_per_second())
            .context("unreadable /proc stat")?,
    })
}

/// A process's resident memory (`VmRSS`) and CPU time so far, from `/proc`; `None` once
/// it has exited.
pub fn usage(pid: u32) -> Option<(u64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    let cpu = cpu_seconds(&stat, rustix::param::clock_ticks_per_second())?;
    Some((kib * 1024, cpu))
}

/// Measures a proxy process, sends it SIGTERM, waits up to 15 s for it to exit (then kills
/// it), and returns what it cost.
pub async fn stop_child(
    child: &mut Child,
    what: &str,
    log_tail: &str,
) -> anyhow::Result<ProxyCost> {
    let cost = cost_of(child)?;
    if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok())
        && let Some(pid) = rustix::process::Pid::from_raw(pid)
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    match tokio::time::timeout(Duration::from_secs(15), child.wait()).await {
        Ok(status) => {
            let status = status?;
            if !status.success() && status.code().is_some() {
                eprintln!("note: {what} exited with {status}; log:\n{log_tail}");
            }
        }
        Err(_) => {
            eprintln!("note: {what} did not exit 15 s after SIGTERM; killing it");
            child.kill().await?;
        }
    }
    Ok(cost)
}

/// `VmHWM` (peak resident set) in bytes from `/proc/PID/status`.
fn vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// utime + stime in seconds from `/proc/PID/stat`. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last `)`.
fn cpu_seconds(stat: &str, ticks_per_second: u64) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ")" comes field 3 (state); utime is field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / ticks_per_second.max(1) as f64)
}

/// A plain HTTP/1.1 GET on the admin listener; returns the status code.
pub async fn admin_get(admin: SocketAddr, path: &str) -> anyhow::Result<u16> {
    let mut stream = tokio::net::TcpStream::connect(admin).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut head = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut head)).await??;
    let line = String::from_utf8_lossy(&head[..n]);
    let code = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("not an HTTP answer")?;
    Ok(code)
}

/// A plain HTTP/1.1 GET on the admin listener; the body.
pub async fn admin_text(admin: SocketAddr, path: &str) -> anyhow::Result<String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(admin).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut text = Vec::new();
        stream.read_to_end(&mut text).await?;
        anyhow::Ok(String::from_utf8_lossy(&text).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(5), exchange).await??;
    let (_, body) = text.split_once("\r\n\r\n").context("not an HTTP answer")?;
    Ok(body.to_string())
}

/// The body of the hidden subcommand: load the config and serve until SIGTERM.
pub async fn serve(config: &Path) -> anyhow::Result<()> {
    let config = bulwark::config::Config::load(config)?;
    bulwark::serve::run(config).await?;
    Ok(())
}

/// `bulwark guard --config FILE`, in this process.
pub async fn guard(config: &Path) -> anyhow::Result<()> {
    let config = bulwark::config::Config::load(config)?;
    bulwark::serve::guard(config).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_and_loadtest_rule_file_is_embedded() {
        for (folder, embedded) in [
            ("deploy/base/rules", &SHIPPED_RULES[..]),
            ("loadtest/rules", &LOADTEST_RULES[..]),
        ] {
            let folder = format!("{}/../../{folder}", env!("CARGO_MANIFEST_DIR"));
            let mut files: Vec<String> = std::fs::read_dir(&folder)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
                .collect();
            files.sort();
            let names: Vec<&str> = embedded.iter().map(|(n, _)| *n).collect();
            assert_eq!(names, files, "{folder}");
            for (name, text) in embedded {
                assert_eq!(
                    std::fs::read_to_string(format!("{folder}/{name}")).unwrap(),
                    *text,
                    "{folder}/{name}"
                );
            }
        }
    }

    #[test]
    fn the_shipped_and_loadtest_rules_load_together() {
        let dir = tempfile::tempdir().unwrap();
        let folder = write_loadtest_rules(dir.path()).unwrap();
        let set = bulwark::rules::RuleSet::load_dir(&folder).unwrap_or_else(|problems| {
            panic!(
                "{}",
                problems
                    .iter()
                    .map(|p| format!("{p}\n"))
                    .collect::<String>()
            )
        });
        for rule in [
            "kwok-node-heartbeats",
            "kwok",
            "secret-operators",
            "kubelets",
        ] {
            assert!(set.rule_names().contains(&rule), "{rule}");
        }
    }

    #[test]
    fn the_generated_config_loads_the_rules_folder() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::new();
        let upstream = Upstream {
            replicas: vec!["127.0.0.1:1".parse().unwrap()],
            pki: &pki,
            front_proxy_user: "fp",
            own_user: "bulwark",
            own_group: "bulwark:proxies",
            heap_headroom: None,
            rules: None,
            identity_mode: None,
            serving_ca: None,
            settings: Vec::new(),
            advertise: None,
        };
        let (path, _, _) = write_config(dir.path(), &upstream).unwrap();
        let config = bulwark::config::Config::load(&path).unwrap();
        assert_eq!(
            config.rules.mode,
            bulwark::config::RulesMode::Enforce,
            "the runs enforce the rules"
        );
        let folder = config.rules.folder.unwrap();
        assert_eq!(folder, dir.path().join("rules"));
        let written = std::fs::read_dir(&folder).unwrap().count();
        assert_eq!(written, SHIPPED_RULES.len());
    }

    #[test]
    fn reads_peak_rss_from_proc_status() {
        let status = "Name:\tbulwark\nVmPeak:\t  9000 kB\nVmHWM:\t   2048 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(vm_hwm(status), Some(2 * 1024 * 1024));
        assert_eq!(vm_hwm("Name:\tx\n"), None);
    }

    #[test]
    fn reads_cpu_time_from_proc_stat_even_with_odd_command_names() {
        let stat = "4242 (we ird) name)) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 150 0 0 20 0 4 0";
        assert_eq!(cpu_seconds(stat, 100), Some(4.0));
        assert_eq!(cpu_seconds("garbage", 100), None);
    }

    #[test]
    fn our_own_process_has_readable_figures() {
        let pid = std::process::id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        assert!(vm_hwm(&status).unwrap() > 0);
        assert!(cpu_seconds(&stat, rustix::param::clock_ticks_per_second()).is_some());
    }
}
