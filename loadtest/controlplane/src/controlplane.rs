//! A real control plane on 127.0.0.1 with Bulwark in front: one etcd and N kube-apiserver
//! replicas (Kubernetes' own code, built from Go modules by `loadtest/controlplane/build.sh`),
//! seeded with the sandbox's identities as real RBAC and some objects, and the sandbox's
//! kubeconfigs. For tests that need the real authenticators and authorizers, and for
//! `bulwark-loadtest controlplane`.
//!
//! Every process is a child that never outlives its owner (see [`crate::child`]); with a
//! memory limit each kube-apiserver runs in its own cgroup v1 memory cgroup, where the
//! kernel's OOM killer kills it as on a node, and it is restarted as a kubelet would.

mod binaries;
mod cgroup;
mod components;
mod pki;
mod seed;

use std::ffi::OsString;
use std::net::SocketAddr;

use bulwark_testkit::free_addr;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use rustix::process::Signal;
use tokio::process::Child;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use binaries::{BIN_ENV, Binaries, ComponentBinaries};
pub use cgroup::{CgroupError, MemoryCgroup};
pub use components::{Components, KWOK_ANNOTATION, KWOK_USER, NODE_LEASE_SECONDS, kwok_node};
pub use pki::FRONT_PROXY_NAME;
pub use seed::{BULWARK_GROUP, BULWARK_USER, NAMESPACES, SECRETS_PER_NAMESPACE};

use crate::balancer::{Balancer, Pick};
use crate::child;
use crate::identities::{Servers, kubeconfigs};
use crate::proxy_process::{ProxyProcess, Upstream, write_loadtest_rules};

/// How long a stopped process gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(15);
/// A restart after an OOM kill waits this long, doubling while the replica keeps dying
/// within [`STABLE_RUN`], up to [`RESTART_BACKOFF_MAX`] (a kubelet's CrashLoopBackOff,
/// shortened).
const RESTART_BACKOFF_MIN: Duration = Duration::from_secs(1);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(30);
const STABLE_RUN: Duration = Duration::from_secs(60);
/// Lines of a log quoted in an error.
const LOG_TAIL_LINES: usize = 40;

/// Why the control plane could not start or do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// The Go binaries are not there.
    #[error(
        "{} lacks {}: build them with loadtest/controlplane/build.sh (Go 1.26), or point \
         {BIN_ENV} at a folder that has them",
        dir.display(),
        missing.join(", ")
    )]
    MissingBinaries {
        /// The folder looked in.
        dir: PathBuf,
        /// The binaries it lacks.
        missing: Vec<&'static str>,
    },
    /// `build.sh` failed.
    #[error("{script} failed ({status}); its output is above")]
    Build {
        /// The script.
        script: PathBuf,
        /// How it exited.
        status: ExitStatus,
    },
    /// A memory cgroup could not be set up.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// `bulwark certs init` failed.
    #[error("minting the development PKI: {0}")]
    Certs(#[from] bulwark::certs::CertsError),
    /// A certificate or key could not be loaded or made.
    #[error("certificates: {0}")]
    Pki(String),
    /// kubectl refused what the cluster's components need (their RBAC).
    #[error("{0}")]
    Setup(String),
    /// A process could not be started.
    #[error("starting {what}: {source}")]
    Spawn {
        /// Which process.
        what: String,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A process exited before it was ready.
    #[error("{what} exited before it was ready ({status}); the end of {}:\n{tail}", log.display())]
    Exited {
        /// Which process.
        what: String,
        /// How it exited.
        status: String,
        /// Its log.
        log: PathBuf,
        /// The last lines of its log.
        tail: String,
    },
    /// A process did not become ready in time.
    #[error("{what} was not ready after {timeout:?} (last: {last}); the end of {}:\n{tail}", log.display())]
    NotReady {
        /// Which process.
        what: String,
        /// How long it had.
        timeout: Duration,
        /// The last answer or error of its readiness check.
        last: String,
        /// Its log.
        log: PathBuf,
        /// The last lines of its log.
        tail: String,
    },
    /// A kubeconfig could not be read.
    #[error("a kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// A request to an apiserver failed.
    #[error("{what}: {source}")]
    Kube {
        /// What was asked.
        what: String,
        /// What went wrong.
        source: kube::Error,
    },
    /// The seed data could not be written.
    #[error("seeding: {0}")]
    Seed(String),
    /// Bulwark did not start.
    #[error("starting Bulwark: {0:#}")]
    Proxy(anyhow::Error),
    /// No replica has this index.
    #[error("there is no replica {0}")]
    NoReplica(usize),
    /// The replica has no running process.
    #[error("replica {0} is not running")]
    NotRunning(usize),
    /// The replica is running already.
    #[error("replica {0} is running already")]
    AlreadyRunning(usize),
}

/// What to start.
#[derive(Clone, Debug)]
pub struct Options {
    /// Folder for certificates, etcd's data, logs, kubeconfigs and `ready`.
    pub dir: PathBuf,
    /// kube-apiserver replicas.
    pub replicas: usize,
    /// Each kube-apiserver's memory limit in bytes, enforced by a cgroup v1 memory cgroup.
    pub apiserver_memory_limit: Option<u64>,
    /// The folder of the Go binaries; `None` locates them ([`Binaries::locate`]).
    pub binaries: Option<PathBuf>,
    /// A `bulwark-loadtest` binary to run Bulwark with; `None` is this very binary.
    pub bulwark_exe: Option<PathBuf>,
    /// Bulwark's rules folder; `None` writes the built-in copies of the shipped rules
    /// (`deploy/base/rules`) and the loadtest's own (`loadtest/rules`: KWOK's controller,
    /// the operator `ops/secret-sync`) into the control plane's folder.
    pub rules: Option<PathBuf>,
    /// Where cgroup v1's memory controller is mounted.
    pub cgroup_root: PathBuf,
    /// How long etcd, each kube-apiserver and the RBAC seed may take to be ready.
    pub ready_timeout: Duration,
    /// Objects to create before Bulwark starts (so that its byte budget sees the replicas'
    /// memory with them), as the simulated fleet seeds them.
    pub seed: Vec<bulwark_sim::Seed>,
    /// Whether every authenticated user may do everything, as in the scenarios' fleet.
    pub open_rbac: bool,
    /// Bulwark's `identity.mode`; `None` is `front-proxy`.
    pub identity_mode: Option<String>,
    /// Bulwark replicas. More than one run behind a TCP balancer (round robin per
    /// connection, as a cloud load balancer), which the kubeconfigs point at, with
    /// `upstream.bulwarkReplicas` set to their number. None (0) is the cluster without
    /// Bulwark: the balancer is in front of the kube-apiservers themselves, and the front
    /// door ([`ControlPlane::front_door`]) is the balancer.
    pub bulwarks: usize,
    /// How several Bulwarks keep one budget.
    pub fleet: FleetMode,
    /// More Bulwark settings, as `BulwarkConfig::set` takes them (`cache.resources`,
    /// `[endpoints]`).
    pub bulwark_settings: Vec<(String, String)>,
    /// Whether pods reach the apiservers through Bulwark: with [`FleetMode::Leases`], the
    /// fleet (one Bulwark or several) publishes the `kubernetes` Service's endpoints, and a
    /// `bulwark guard` publishes the apiservers when no Bulwark is live (DESIGN.md
    /// "In-cluster clients"). Default: on.
    pub kubernetes_service: bool,
    /// Whether each Bulwark writes every request to `access.jsonl` in its folder (the
    /// recording `bulwark rules suggest` and `replay` read). Default: off.
    pub access_log: bool,
}

/// The file name of each Bulwark's access log in its folder ([`Options::access_log`]).
pub const ACCESS_LOG: &str = "access.jsonl";

/// How several Bulwark replicas share the apiservers' budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetMode {
    /// Through Leases in namespace `bulwark` (`fleet:` in their config), by demand.
    Leases,
    /// Each a static 1/`bulwarkReplicas` of every budget (no `fleet:`).
    Static,
}

pub use crate::proxy_process::{FLEET_NAMESPACE, fleet_setting};

/// The `fleet:` setting of Bulwark `i` when the fleet publishes the `kubernetes` Service:
/// signed Leases (`key_file`), and the apiservers behind the replicas. Each replica's
/// address is its listen address (127.0.0.1 and a port of its own).
pub fn fleet_publishing(i: usize, key_file: &Path, apiservers: &[SocketAddr]) -> String {
    let apiservers: Vec<String> = apiservers.iter().map(|a| format!("\"{a}\"")).collect();
    format!(
        "{{namespace: {FLEET_NAMESPACE}, identity: bulwark-{i}, keyFile: {:?}, \
         kubernetesService: {{apiservers: [{}]}}}}",
        key_file.display().to_string(),
        apiservers.join(", ")
    )
}

/// The host's first address that is not loopback, link-local or unspecified: what the
/// `kubernetes` Service's endpoints can name (the apiserver refuses the others). `None` on
/// a host with loopback alone.
pub fn node_address() -> Option<std::net::IpAddr> {
    let addrs = if_addrs::get_if_addrs().ok()?;
    addrs
        .into_iter()
        .map(|i| i.ip())
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
        .find(|ip| match ip {
            std::net::IpAddr::V4(v4) => !v4.is_link_local(),
            std::net::IpAddr::V6(v6) => !v6.is_unicast_link_local(),
        })
}

/// The ClusterIP of the `kubernetes` Service: the first address of the apiservers'
/// `--service-cluster-ip-range`, which in-cluster clients dial and Bulwark's and the
/// apiservers' serving certificates name.
pub const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";

impl Options {
    /// Three replicas without a memory limit, the binaries located, this binary as Bulwark.
    pub fn new(dir: impl Into<PathBuf>) -> Options {
        Options {
            dir: dir.into(),
            replicas: 3,
            apiserver_memory_limit: None,
            binaries: None,
            bulwark_exe: None,
            rules: None,
            cgroup_root: PathBuf::from(cgroup::DEFAULT_ROOT),
            ready_timeout: Duration::from_secs(180),
            seed: Vec::new(),
            open_rbac: false,
            identity_mode: None,
            bulwarks: 1,
            fleet: FleetMode::Leases,
            bulwark_settings: Vec::new(),
            kubernetes_service: true,
            access_log: false,
        }
    }
}

/// A running control plane: stop it with [`ControlPlane::stop`]; dropping it kills every
/// process at once.
pub struct ControlPlane {
    dir: PathBuf,
    binaries: Binaries,
    pki: pki::Files,
    ready_timeout: Duration,
    etcd: Option<Etcd>,
    replicas: Vec<Replica>,
    /// Each Bulwark replica: how it is started, and its process while it runs.
    bulwarks: Vec<BulwarkSlot>,
    /// The balancer in front of several Bulwarks.
    balancer: Option<Balancer>,
    /// The binary Bulwark runs from, for a restart.
    bulwark_exe: Option<PathBuf>,
    /// The heap headroom Bulwark was configured with (`None`: its default).
    heap_headroom: Option<u64>,
    /// `bulwark guard`, publishing the `kubernetes` Service when no Bulwark is live.
    guard: Option<Child>,
    /// The host's own address, which the `kubernetes` Service's endpoints name, when the
    /// fleet publishes them ([`Options::kubernetes_service`]).
    node_ip: Option<std::net::IpAddr>,
    started_in: Duration,
    stopped: bool,
}

/// One Bulwark replica: its folder (configuration, certificates, log), addresses, and
/// its process while it runs.
struct BulwarkSlot {
    dir: PathBuf,
    target: crate::Target,
    admin: SocketAddr,
    process: Option<ProxyProcess>,
}

/// One etcd member on 127.0.0.1.
struct Etcd {
    child: Child,
    client: SocketAddr,
}

/// How one kube-apiserver replica is started, every time.
struct Spec {
    index: usize,
    program: PathBuf,
    args: Vec<OsString>,
    addr: SocketAddr,
    log: PathBuf,
    cgroup: Option<MemoryCgroup>,
}

/// What the replica's supervisor and its owner share.
#[derive(Default)]
struct Shared {
    /// The running process (also its process group), 0 when none runs.
    pid: AtomicU32,
    oom_kills: AtomicU64,
    restarts: AtomicU64,
    /// Set before the owner kills on purpose, so that the exit is not reported.
    stopping: AtomicBool,
    /// Set once `/readyz` answered; an exit before that is the starter's error to report.
    ready: AtomicBool,
    /// Why the replica exited on its own and stayed down.
    exit: Mutex<Option<String>>,
}

struct Replica {
    spec: Arc<Spec>,
    shared: Arc<Shared>,
    running: Mutex<Option<Running>>,
}

/// A supervisor task that owns the process, and the way to tell it to stop.
struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// A replica frozen by [`ControlPlane::freeze_replica`]; dropping this thaws it (SIGCONT).
#[must_use = "dropping it thaws the replica at once"]
#[derive(Debug)]
pub struct Frozen {
    pid: u32,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        child::signal_group(self.pid, Signal::CONT);
    }
}

/// One replica's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaReport {
    /// Its address.
    pub addr: SocketAddr,
    /// Times the kernel's OOM killer killed it.
    pub oom_kills: u64,
    /// Times it was restarted after an OOM kill.
    pub restarts: u64,
    /// Peak memory of its cgroup in bytes (only with a memory limit).
    pub peak_memory_bytes: Option<u64>,
    /// Its memory limit in bytes, if any.
    pub memory_limit_bytes: Option<u64>,
}

impl ControlPlane {
    /// Starts etcd and the replicas, waits for each `/readyz`, seeds RBAC and objects,
    /// starts Bulwark in front, writes the kubeconfigs and then `DIR/ready`.
    pub async fn start(opts: Options) -> Result<ControlPlane, Error> {
        let dir = std::path::absolute(&opts.dir).map_err(|source| Error::Io {
            path: opts.dir.clone(),
            source,
        })?;
        create_dir(&dir)?;
        let ready = dir.join("ready");
        let _ = std::fs::remove_file(&ready);
        let binaries = match &opts.binaries {
            Some(folder) => Binaries::at(folder.clone())?,
            None => Binaries::locate().await?,
        };
        let pki_dir = dir.join("pki");
        create_dir(&pki_dir)?;
        let pki = pki::mint(&pki_dir)?;
        let mut cp = ControlPlane {
            dir,
            binaries,
            pki,
            ready_timeout: opts.ready_timeout,
            etcd: None,
            replicas: Vec::new(),
            bulwarks: Vec::new(),
            balancer: None,
            bulwark_exe: None,
            heap_headroom: None,
            guard: None,
            node_ip: None,
            started_in: Duration::ZERO,
            stopped: false,
        };
        // From here on, a failure drops `cp`, which kills whatever was started.
        let began = Instant::now();
        if opts.kubernetes_service && opts.fleet == FleetMode::Leases && opts.bulwarks > 0 {
            cp.node_ip = node_address();
            if cp.node_ip.is_none() {
                tracing::warn!(
                    "no address but loopback on this host: the kubernetes Service's \
                     endpoints cannot name one, so pods are not led through Bulwark"
                );
            }
        }
        cp.start_etcd().await?;
        cp.start_replicas(&opts).await?;
        cp.started_in = began.elapsed();
        let admin = cp.admin_client(0).await?;
        seed::seed(&admin).await?;
        if opts.open_rbac {
            seed::open_rbac(&admin).await?;
        }
        seed::bulk(&admin, &opts.seed).await?;
        for i in 0..cp.replicas.len() {
            let client = cp.admin_client(i).await?;
            seed::wait_for_rbac(&client, cp.ready_timeout).await?;
        }
        if opts.bulwarks > 1 || (opts.bulwarks == 1 && cp.publishes_service(&opts)) {
            seed::fleet_rbac(&admin).await?;
        }
        if opts.bulwarks > 0 {
            seed::flowcontrol(&admin).await?;
        }
        if opts.bulwarks == 0 {
            let balancer = Balancer::start(cp.replica_addrs(), Pick::RoundRobin)
                .await
                .map_err(Error::Proxy)?;
            cp.balancer = Some(balancer);
        } else {
            cp.start_bulwarks(&opts).await?;
        }
        cp.write_kubeconfigs()?;
        let bulwark = cp.bulwark_addr();
        std::fs::write(&ready, format!("bulwark https://{bulwark}\n")).map_err(|source| {
            Error::Io {
                path: ready.clone(),
                source,
            }
        })?;
        Ok(cp)
    }

    /// The folder holding everything.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CAs: the serving CA of the replicas, and the client CA that mints identities
    /// they (and Bulwark) accept.
    pub fn pki(&self) -> &bulwark_sim::pki::Pki {
        &self.pki.pki
    }

    /// The Go binaries used (its `kubectl` matches the apiservers' version).
    pub fn binaries(&self) -> &Binaries {
        &self.binaries
    }

    /// Each kube-apiserver replica's address, by index.
    pub fn replica_addrs(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(|r| r.spec.addr).collect()
    }

    /// etcd's client address.
    pub fn etcd_addr(&self) -> Option<SocketAddr> {
        self.etcd.as_ref().map(|e| e.client)
    }

    /// Bulwark's address, where every kubeconfig but `direct-admin` points: the balancer's
    /// with several Bulwarks (127.0.0.1:0 only while the control plane is still starting).
    pub fn bulwark_addr(&self) -> SocketAddr {
        match (&self.balancer, self.bulwarks.first()) {
            (Some(balancer), _) => balancer.addr,
            (None, Some(slot)) => slot.target.addr,
            (None, None) => SocketAddr::from(([127, 0, 0, 1], 0)),
        }
    }

    /// The heap headroom per apiserver replica the Bulwarks were configured with; each
    /// apiserver's in-flight LIST byte budget is a fifth of it (`None`: Bulwark's default).
    pub fn bulwark_heap_headroom(&self) -> Option<u64> {
        self.heap_headroom
    }

    /// Each Bulwark replica's own address, by index.
    pub fn bulwark_addrs(&self) -> Vec<SocketAddr> {
        self.bulwarks.iter().map(|b| b.target.addr).collect()
    }

    /// Each Bulwark replica's admin listener (`/metrics`, `/debug/fleet`), by index.
    pub fn bulwark_admin_addrs(&self) -> Vec<SocketAddr> {
        self.bulwarks.iter().map(|b| b.admin).collect()
    }

    /// The first Bulwark's admin listener (`/metrics`, `/readyz`).
    pub fn bulwark_admin_addr(&self) -> Option<SocketAddr> {
        self.bulwarks.first().map(|b| b.admin)
    }

    /// The first Bulwark's process id, while it runs (for `/proc` figures).
    pub fn bulwark_pid(&self) -> Option<u32> {
        self.bulwarks
            .first()
            .and_then(|b| b.process.as_ref())
            .and_then(ProxyProcess::pid)
    }

    /// The process ids of the kube-apiserver replicas running now.
    pub fn replica_pids(&self) -> Vec<u32> {
        self.replicas
            .iter()
            .map(|r| r.shared.pid.load(Ordering::Relaxed))
            .filter(|&pid| pid != 0)
            .collect()
    }

    /// etcd's process id, while it runs (for faults such as SIGSTOP).
    pub fn etcd_pid(&self) -> Option<u32> {
        self.etcd.as_ref().and_then(|e| e.child.id())
    }

    /// The Bulwarks' peak RSS (the highest of them) and CPU time (all together) so far,
    /// of those running.
    pub fn bulwark_cost(&self) -> Option<crate::report::ProxyCost> {
        let costs: Vec<_> = self
            .bulwarks
            .iter()
            .filter_map(|b| b.process.as_ref()?.cost().ok())
            .collect();
        (!costs.is_empty()).then(|| crate::report::ProxyCost {
            peak_rss_bytes: costs.iter().map(|c| c.peak_rss_bytes).max().unwrap_or(0),
            cpu_seconds: costs.iter().map(|c| c.cpu_seconds).sum(),
        })
    }

    /// Kills Bulwark replica `i` with SIGKILL (a node lost): no drain, and its Lease is left
    /// to expire.
    pub async fn kill_bulwark(&mut self, i: usize) -> Result<(), Error> {
        let slot = self.bulwarks.get_mut(i).ok_or(Error::NoReplica(i))?;
        let process = slot.process.take().ok_or(Error::NotRunning(i))?;
        process.kill().await.map_err(Error::Proxy)
    }

    /// Starts Bulwark replica `i` again on its addresses with its configuration, after
    /// [`ControlPlane::kill_bulwark`]; waits until it is ready.
    pub async fn start_bulwark(&mut self, i: usize) -> Result<(), Error> {
        let exe = self
            .bulwark_exe
            .clone()
            .ok_or_else(|| Error::Proxy(anyhow::anyhow!("Bulwark never ran")))?;
        let slot = self.bulwarks.get_mut(i).ok_or(Error::NoReplica(i))?;
        if slot.process.is_some() {
            return Err(Error::AlreadyRunning(i));
        }
        let config = slot.dir.join("bulwark.yaml");
        let process = ProxyProcess::launch(
            crate::child::command(&exe),
            &config,
            slot.target.clone(),
            slot.admin,
            &slot.dir,
        )
        .await
        .map_err(Error::Proxy)?;
        slot.process = Some(process);
        Ok(())
    }

    /// The PEM of the CA that signed Bulwark's serving certificate.
    pub fn bulwark_ca_pem(&self) -> Option<&str> {
        self.bulwarks.first().map(|b| b.target.ca_pem.as_str())
    }

    /// Where the cluster's clients connect, and the CA they trust there: Bulwark (the
    /// balancer in front of several), or without Bulwark the balancer in front of the
    /// kube-apiservers.
    pub fn front_door(&self) -> crate::Target {
        crate::Target {
            addr: self.bulwark_addr(),
            ca_pem: match self.bulwark_ca_pem() {
                Some(pem) => pem.to_owned(),
                None => self.pki.pki.server_ca.cert_pem(),
            },
        }
    }

    /// Each replica's own `/metrics`, by index; a replica that does not answer has none.
    pub async fn replica_metrics(&self) -> Vec<Option<String>> {
        let mut texts = Vec::new();
        for i in 0..self.replicas.len() {
            let text = async {
                let admin = self.admin_client(i).await.ok()?;
                let request = http::Request::get("/metrics").body(Vec::new()).ok()?;
                admin.request_text(request).await.ok()
            };
            texts.push(text.await);
        }
        texts
    }

    /// Each Bulwark's access log, where [`Options::access_log`] turned it on.
    pub fn access_logs(&self) -> Vec<PathBuf> {
        self.bulwarks
            .iter()
            .map(|b| b.dir.join(ACCESS_LOG))
            .filter(|p| p.exists())
            .collect()
    }

    /// The path of a kubeconfig: `admin`, `operator`, `node-1`, `nobody` (through Bulwark) or
    /// `direct-admin` (straight to replica 0).
    pub fn kubeconfig(&self, name: &str) -> PathBuf {
        self.dir.join(format!("kubeconfig-{name}"))
    }

    /// Runs the control plane's kubectl with one of the kubeconfigs: whether it succeeded,
    /// and its stdout followed by its stderr.
    pub async fn kubectl(
        &self,
        kubeconfig: &str,
        args: &[&str],
    ) -> std::io::Result<(bool, String)> {
        let out = tokio::process::Command::new(self.binaries().kubectl())
            .arg("--kubeconfig")
            .arg(self.kubeconfig(kubeconfig))
            .args(args)
            .output()
            .await?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        Ok((out.status.success(), text))
    }

    /// A `kube` client from one of the kubeconfigs (see [`ControlPlane::kubeconfig`]).
    pub async fn client(&self, name: &str) -> Result<Client, Error> {
        let path = self.kubeconfig(name);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        client_from_yaml(&text, true).await
    }

    /// Like [`ControlPlane::client`], without kube's retries of 429, 503 and 504 answers:
    /// for callers that want to see those answers, headers and all.
    pub async fn client_without_retries(&self, name: &str) -> Result<Client, Error> {
        let path = self.kubeconfig(name);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        client_from_yaml(&text, false).await
    }

    /// How long etcd and every replica took to be ready.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// Each replica's figures.
    pub fn report(&self) -> Vec<ReplicaReport> {
        self.replicas
            .iter()
            .map(|r| ReplicaReport {
                addr: r.spec.addr,
                oom_kills: r.shared.oom_kills.load(Ordering::Relaxed),
                restarts: r.shared.restarts.load(Ordering::Relaxed),
                peak_memory_bytes: r.spec.cgroup.as_ref().and_then(MemoryCgroup::peak_bytes),
                memory_limit_bytes: r.spec.cgroup.as_ref().map(MemoryCgroup::limit),
            })
            .collect()
    }

    /// Samples each replica's memory now and its peak (from its cgroup; 0 without a
    /// memory limit) and its OOM kills so far, for progress lines and the report's
    /// timeline; it holds the replicas' own handles, not the control plane.
    pub fn replica_sampler(&self) -> crate::sample::Sampler {
        let replicas: Vec<(Arc<Spec>, Arc<Shared>)> = self
            .replicas
            .iter()
            .map(|r| (r.spec.clone(), r.shared.clone()))
            .collect();
        Arc::new(move || {
            replicas
                .iter()
                .map(|(spec, shared)| crate::sample::ReplicaNow {
                    memory_bytes: spec
                        .cgroup
                        .as_ref()
                        .and_then(MemoryCgroup::usage_bytes)
                        .unwrap_or(0),
                    peak_bytes: spec
                        .cgroup
                        .as_ref()
                        .and_then(MemoryCgroup::peak_bytes)
                        .unwrap_or(0),
                    ooms: shared.oom_kills.load(Ordering::Relaxed),
                })
                .collect()
        })
    }

    /// Each replica's memory now, from its cgroup (`None` without a memory limit).
    pub fn memory_usage(&self) -> Vec<Option<u64>> {
        self.replicas
            .iter()
            .map(|r| r.spec.cgroup.as_ref().and_then(MemoryCgroup::usage_bytes))
            .collect()
    }

    /// Times the kernel OOM-killed replica `i`.
    pub fn oom_kills(&self, i: usize) -> u64 {
        self.replicas
            .get(i)
            .map_or(0, |r| r.shared.oom_kills.load(Ordering::Relaxed))
    }

    /// Whether the kernel has OOM-killed replica `i` at least once.
    pub fn was_oom_killed(&self, i: usize) -> bool {
        self.oom_kills(i) > 0
    }

    /// Times replica `i` was restarted after an OOM kill.
    pub fn restarts(&self, i: usize) -> u64 {
        self.replicas
            .get(i)
            .map_or(0, |r| r.shared.restarts.load(Ordering::Relaxed))
    }

    /// Whether replica `i` has a running process.
    pub fn is_running(&self, i: usize) -> bool {
        self.replicas
            .get(i)
            .is_some_and(|r| r.shared.pid.load(Ordering::Relaxed) != 0)
    }

    /// Freezes replica `i` with SIGSTOP, as a wedged node or a debugger would: its sockets
    /// stay open and the kernel still accepts connections, but it answers nothing until the
    /// returned guard is dropped, which sends SIGCONT (also when a test panics, so that
    /// the replica can be stopped afterwards).
    pub fn freeze_replica(&self, i: usize) -> Result<Frozen, Error> {
        let replica = self.replicas.get(i).ok_or(Error::NoReplica(i))?;
        let pid = replica.shared.pid.load(Ordering::Relaxed);
        if pid == 0 {
            return Err(Error::NotRunning(i));
        }
        child::signal_group(pid, Signal::STOP);
        Ok(Frozen { pid })
    }

    /// Stops replica `i` (SIGTERM, then SIGKILL after a grace period) and waits for it to
    /// exit; stopping a stopped replica does nothing.
    pub async fn stop_replica(&self, i: usize) -> Result<(), Error> {
        let replica = self.replicas.get(i).ok_or(Error::NoReplica(i))?;
        replica.stop().await;
        Ok(())
    }

    /// Starts replica `i` again, on the same address and with the same flags, and waits
    /// for its `/readyz`.
    pub async fn start_replica(&self, i: usize) -> Result<(), Error> {
        let replica = self.replicas.get(i).ok_or(Error::NoReplica(i))?;
        if replica.is_supervised() {
            return Err(Error::AlreadyRunning(i));
        }
        replica.launch()?;
        self.wait_replica_ready(i).await
    }

    /// Stops Bulwark, the replicas and etcd in that order, each with SIGTERM first, and
    /// removes the memory cgroups and `DIR/ready`.
    pub async fn stop(mut self) -> Result<(), Error> {
        self.stopped = true;
        let _ = std::fs::remove_file(self.dir.join("ready"));
        let mut first_error = None;
        if let Some(mut guard) = self.guard.take() {
            terminate(&mut guard).await;
        }
        for proxy in self.bulwarks.iter_mut().filter_map(|b| b.process.take()) {
            if let Err(e) = proxy.stop().await {
                first_error.get_or_insert(Error::Proxy(e));
            }
        }
        for replica in &self.replicas {
            replica.stop().await;
        }
        if let Some(mut etcd) = self.etcd.take() {
            terminate(&mut etcd.child).await;
        }
        for replica in &self.replicas {
            if let Some(cgroup) = &replica.spec.cgroup
                && let Err(source) = cgroup.remove(Duration::from_secs(5))
            {
                first_error.get_or_insert(Error::Io {
                    path: cgroup.path().to_path_buf(),
                    source,
                });
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    async fn start_etcd(&mut self) -> Result<(), Error> {
        let data = self.dir.join("etcd");
        if data.exists() {
            std::fs::remove_dir_all(&data).map_err(|source| Error::Io {
                path: data.clone(),
                source,
            })?;
        }
        let client = free_addr();
        let peer = free_addr();
        let log = self.dir.join("etcd.log");
        let url = |addr: SocketAddr| format!("http://{addr}");
        let args: Vec<OsString> = vec![
            "--name=controlplane".into(),
            flag("--data-dir", &data),
            format!("--listen-client-urls={}", url(client)).into(),
            format!("--advertise-client-urls={}", url(client)).into(),
            format!("--listen-peer-urls={}", url(peer)).into(),
            format!("--initial-advertise-peer-urls={}", url(peer)).into(),
            format!("--initial-cluster=controlplane={}", url(peer)).into(),
            "--initial-cluster-state=new".into(),
            // A test cluster lives for minutes: durability is not worth an fsync per write.
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        let mut child = spawn("etcd", &self.binaries.etcd(), &args, &log, None)?;
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Error::Exited {
                    what: "etcd".into(),
                    status: status.to_string(),
                    tail: log_tail(&log),
                    log,
                });
            }
            let last = match crate::proxy_process::admin_get(client, "/health").await {
                Ok(200) => break,
                Ok(code) => format!("/health answered {code}"),
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: "etcd".into(),
                    timeout: self.ready_timeout,
                    last,
                    tail: log_tail(&log),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.etcd = Some(Etcd { child, client });
        Ok(())
    }

    /// Where the apiservers listen: 127.0.0.1, or every address when the `kubernetes`
    /// Service leads pods to them by the host's own address.
    fn bind_ip(&self) -> std::net::IpAddr {
        match self.node_ip {
            Some(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
            None => std::net::Ipv4Addr::LOCALHOST.into(),
        }
    }

    async fn start_replicas(&mut self, opts: &Options) -> Result<(), Error> {
        let etcd = self
            .etcd_addr()
            .map(|a| format!("http://{a}"))
            .unwrap_or_default();
        for index in 0..opts.replicas {
            let cgroup = match opts.apiserver_memory_limit {
                Some(limit) => Some(MemoryCgroup::create(&opts.cgroup_root, index, limit)?),
                None => None,
            };
            let addr = free_addr();
            let cert_dir = self.dir.join(format!("apiserver-{index}"));
            create_dir(&cert_dir)?;
            let spec = Spec {
                index,
                program: self.binaries.kube_apiserver(),
                args: apiserver_args(&self.pki, &etcd, addr, self.bind_ip(), &cert_dir),
                addr,
                log: self.dir.join(format!("apiserver-{index}.log")),
                cgroup,
            };
            // A log from an earlier run would be mistaken for this one's.
            let _ = std::fs::remove_file(&spec.log);
            self.replicas.push(Replica {
                spec: Arc::new(spec),
                shared: Arc::default(),
                running: Mutex::new(None),
            });
        }
        for replica in &self.replicas {
            replica.launch()?;
        }
        let waits = (0..self.replicas.len()).map(|i| self.wait_replica_ready(i));
        futures::future::try_join_all(waits).await?;
        Ok(())
    }

    /// Polls replica `i`'s `/readyz` with the admin certificate until it answers 200.
    async fn wait_replica_ready(&self, i: usize) -> Result<(), Error> {
        let replica = &self.replicas[i];
        let what = format!("kube-apiserver replica {i} ({})", replica.spec.addr);
        let client = self.admin_client(i).await?;
        let deadline = Instant::now() + self.ready_timeout;
        let mut last = String::from("no answer yet");
        loop {
            if let Some(status) = replica.shared.exit.lock().ok().and_then(|e| e.clone()) {
                return Err(Error::Exited {
                    what,
                    status,
                    log: replica.spec.log.clone(),
                    tail: log_tail(&replica.spec.log),
                });
            }
            let request = http::Request::get("/readyz").body(Vec::new());
            if let Ok(request) = request {
                match client.request_text(request).await {
                    Ok(_) => {
                        replica.shared.ready.store(true, Ordering::Relaxed);
                        return Ok(());
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    what,
                    timeout: self.ready_timeout,
                    last,
                    log: replica.spec.log.clone(),
                    tail: log_tail(&replica.spec.log),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn start_bulwarks(&mut self, opts: &Options) -> Result<(), Error> {
        let exe = match &opts.bulwark_exe {
            Some(exe) => exe.clone(),
            None => std::env::current_exe().map_err(|source| Error::Io {
                path: PathBuf::from("the running binary"),
                source,
            })?,
        };
        self.bulwark_exe = Some(exe.clone());
        // Pods trust the CA that `kube-root-ca.crt` carries: the cluster's, which signs the
        // apiservers' serving certificates. Bulwark's comes from it too when pods reach
        // the apiservers through Bulwark; otherwise from a CA of its own.
        let publishing = self.publishes_service(opts);
        let own_ca;
        let serving_ca = if publishing {
            &self.pki.pki.server_ca
        } else {
            own_ca = bulwark_sim::pki::Ca::new("bulwark-serving-ca");
            &own_ca
        };
        let key_file = self.dir.join("fleet.key");
        if publishing {
            let key: String = (0..64)
                .map(|_| char::from(b"0123456789abcdef"[rand::random_range(0..16)]))
                .collect();
            pki::write(&self.dir, "fleet.key", &format!("{key}\n"), true)?;
        }
        let rules = match &opts.rules {
            Some(folder) => folder.clone(),
            None => write_loadtest_rules(&self.dir.join("rules")).map_err(Error::Proxy)?,
        };
        let n = opts.bulwarks;
        self.heap_headroom = self.heap_headroom();
        for i in 0..n {
            let dir = match n {
                1 => self.dir.join("bulwark"),
                _ => self.dir.join(format!("bulwark-{i}")),
            };
            let mut settings = opts.bulwark_settings.clone();
            if opts.access_log {
                settings.push((
                    "accessLog".to_string(),
                    format!(
                        "{{path: {}, sample: 1.0, maxSize: 1Gi}}",
                        dir.join(ACCESS_LOG).display()
                    ),
                ));
            }
            if n > 1 {
                settings.push(("upstream.bulwarkReplicas".to_string(), n.to_string()));
            }
            if publishing {
                let fleet = fleet_publishing(i, &key_file, &self.advertised_replicas());
                settings.push(("fleet".to_string(), fleet));
            } else if n > 1 && opts.fleet == FleetMode::Leases {
                settings.push(("fleet".to_string(), fleet_setting(i)));
            }
            let upstream = Upstream {
                replicas: self.replica_addrs(),
                pki: &self.pki.pki,
                front_proxy_user: FRONT_PROXY_NAME,
                own_user: BULWARK_USER,
                own_group: BULWARK_GROUP,
                heap_headroom: self.heap_headroom,
                rules: Some(rules.clone()),
                identity_mode: opts.identity_mode.as_deref(),
                serving_ca: Some(serving_ca),
                settings,
                advertise: self.node_ip.filter(|_| publishing),
            };
            let process = ProxyProcess::start_exe(&exe, &dir, &upstream)
                .await
                .map_err(Error::Proxy)?;
            self.bulwarks.push(BulwarkSlot {
                dir,
                target: process.target.clone(),
                admin: process.admin,
                process: Some(process),
            });
        }
        if n > 1 {
            let balancer = Balancer::start(self.bulwark_addrs(), Pick::RoundRobin)
                .await
                .map_err(Error::Proxy)?;
            self.balancer = Some(balancer);
        }
        if publishing {
            self.start_guard(&exe)?;
        }
        Ok(())
    }

    /// The apiservers as the `kubernetes` Service names them: the host's own address and
    /// each replica's port.
    fn advertised_replicas(&self) -> Vec<SocketAddr> {
        let ip = self.node_ip.unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
        self.replica_addrs()
            .into_iter()
            .map(|a| SocketAddr::new(ip, a.port()))
            .collect()
    }

    /// The apiservers as the `kubernetes` Service leads pods to them when no Bulwark is
    /// live.
    pub fn advertised_apiservers(&self) -> Vec<SocketAddr> {
        self.advertised_replicas()
    }

    /// Each Bulwark as the `kubernetes` Service leads pods to it.
    pub fn advertised_bulwarks(&self) -> Vec<SocketAddr> {
        let ip = self.node_ip.unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
        self.bulwark_addrs()
            .into_iter()
            .map(|a| SocketAddr::new(ip, a.port()))
            .collect()
    }

    /// Whether the fleet publishes the `kubernetes` Service ([`Options::kubernetes_service`]):
    /// asked for, and the host has an address other than loopback for its endpoints.
    fn publishes_service(&self, opts: &Options) -> bool {
        self.node_ip.is_some() && opts.fleet == FleetMode::Leases && opts.bulwarks > 0
    }

    /// The address the `kubernetes` Service's endpoints name, when the fleet publishes it.
    pub fn node_ip(&self) -> Option<std::net::IpAddr> {
        self.node_ip
    }

    /// Starts `bulwark guard` with the first Bulwark's configuration (it reads `upstream`
    /// and `fleet` only), as a static Pod beside the apiservers would run it.
    fn start_guard(&mut self, exe: &Path) -> Result<(), Error> {
        let dir = self.dir.join("guard");
        create_dir(&dir)?;
        let config = self.bulwarks[0].dir.join("bulwark.yaml");
        let log = dir.join("guard.log");
        let io = |source| Error::Io {
            path: log.clone(),
            source,
        };
        let file = std::fs::File::create(&log).map_err(io)?;
        let child = crate::child::command(exe)
            .arg(crate::proxy_process::GUARD_SUBCOMMAND)
            .arg("--config")
            .arg(&config)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone().map_err(io)?)
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .map_err(io)?;
        self.guard = Some(child);
        Ok(())
    }

    /// What a replica has left for requests under its memory limit, for Bulwark's byte
    /// budget: the limit less the most any replica uses once seeded (its caches and
    /// runtime), and never less than a quarter of the limit.
    fn heap_headroom(&self) -> Option<u64> {
        let cgroups = self.replicas.iter().filter_map(|r| r.spec.cgroup.as_ref());
        let limit = cgroups.clone().map(MemoryCgroup::limit).min()?;
        let used = cgroups
            .filter_map(MemoryCgroup::usage_bytes)
            .max()
            .unwrap_or(0);
        Some(limit.saturating_sub(used).max(limit / 4))
    }

    fn write_kubeconfigs(&self) -> Result<(), Error> {
        let replica_ca = self.pki.pki.server_ca.cert_pem();
        let front = self.front_door();
        let servers = Servers {
            bulwark: front.addr,
            bulwark_ca: &front.ca_pem,
            replica: self.replicas.first().ok_or(Error::NoReplica(0))?.spec.addr,
            replica_ca: &replica_ca,
        };
        for (file, text) in kubeconfigs(&servers, &self.pki.pki.client_ca) {
            pki::write(&self.dir, file, &text, true)?;
        }
        Ok(())
    }

    /// Stops Bulwark (SIGTERM, its short drain) and starts a new process on the same
    /// addresses with the same configuration and certificates, as a rollout does: its cache
    /// starts empty while the clients' kubeconfigs stay valid. Waits until it is ready.
    pub async fn restart_bulwark(&mut self) -> Result<(), Error> {
        let slot = self.bulwarks.first_mut().ok_or(Error::NoReplica(0))?;
        let proxy = slot.process.take().ok_or(Error::NotRunning(0))?;
        proxy.stop().await.map_err(Error::Proxy)?;
        self.start_bulwark(0).await
    }

    /// The sum over the replicas of `apiserver_request_total` samples with all of `labels`
    /// (`verb="LIST"`, `resource="secrets"`), each replica's own count from its `/metrics`;
    /// a replica that does not answer counts none.
    pub async fn apiserver_requests(&self, labels: &[&str]) -> u64 {
        self.sum_over_metrics(|text| request_total(text, labels))
            .await
    }

    /// Watches open on the replicas, as each counts them on its own `/metrics`
    /// (`apiserver_longrunning_requests{verb="WATCH"}`), summed; a replica that does not
    /// answer counts none.
    pub async fn open_watches(&self) -> u64 {
        self.sum_over_metrics(longrunning_watches).await
    }

    /// `count` of each replica's own `/metrics`, summed; a replica that does not answer
    /// counts none.
    async fn sum_over_metrics(&self, count: impl Fn(&str) -> u64) -> u64 {
        let mut sum = 0;
        for i in 0..self.replicas.len() {
            let Ok(admin) = self.admin_client(i).await else {
                continue;
            };
            let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
                continue;
            };
            if let Ok(text) = admin.request_text(request).await {
                sum += count(&text);
            }
        }
        sum
    }

    /// A `system:masters` client straight to each replica, by index (for its `/metrics`).
    pub async fn admin_clients(&self) -> Result<Vec<Client>, Error> {
        let mut clients = Vec::new();
        for i in 0..self.replicas.len() {
            clients.push(self.admin_client(i).await?);
        }
        Ok(clients)
    }

    /// A `system:masters` client straight to replica `i`.
    async fn admin_client(&self, i: usize) -> Result<Client, Error> {
        let replica = self.replicas.get(i).ok_or(Error::NoReplica(i))?;
        let admin = self
            .pki
            .pki
            .client_ca
            .client_cert("admin", &["system:masters"]);
        let yaml = crate::identities::kubeconfig(
            replica.spec.addr,
            &self.pki.pki.server_ca.cert_pem(),
            "admin",
            &admin.cert_pem,
            &admin.key_pem,
        );
        client_from_yaml(&yaml, true).await
    }
}

impl Drop for ControlPlane {
    /// Kills every process at once (SIGKILL to each process group) and removes the cgroups;
    /// [`ControlPlane::stop`] is the orderly way.
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        let _ = std::fs::remove_file(self.dir.join("ready"));
        for replica in &self.replicas {
            replica.shared.stopping.store(true, Ordering::Relaxed);
            let pid = replica.shared.pid.load(Ordering::Relaxed);
            if pid != 0 {
                child::signal_group(pid, Signal::KILL);
            }
        }
        if let Some(pid) = self.etcd.as_ref().and_then(|e| e.child.id()) {
            child::signal_group(pid, Signal::KILL);
        }
        for replica in &self.replicas {
            if let Some(cgroup) = &replica.spec.cgroup {
                let _ = cgroup.remove(Duration::from_secs(2));
            }
        }
        // Bulwark and etcd are also killed when their handles drop, right after this.
    }
}

impl Replica {
    fn is_supervised(&self) -> bool {
        self.running
            .lock()
            .map(|r| r.as_ref().is_some_and(|r| !r.task.is_finished()))
            .unwrap_or(false)
    }

    /// Starts the process and its supervisor.
    fn launch(&self) -> Result<(), Error> {
        let what = format!("kube-apiserver replica {}", self.spec.index);
        let child = spawn(
            &what,
            &self.spec.program,
            &self.spec.args,
            &self.spec.log,
            self.spec.cgroup.as_ref(),
        )?;
        self.shared.stopping.store(false, Ordering::Relaxed);
        self.shared.ready.store(false, Ordering::Relaxed);
        if let Ok(mut exit) = self.shared.exit.lock() {
            *exit = None;
        }
        self.shared
            .pid
            .store(child.id().unwrap_or(0), Ordering::Relaxed);
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(supervise(
            self.spec.clone(),
            self.shared.clone(),
            child,
            stopped,
        ));
        if let Ok(mut running) = self.running.lock() {
            *running = Some(Running { stop, task });
        }
        Ok(())
    }

    /// Tells the supervisor to stop the process and waits until it has.
    async fn stop(&self) {
        let running = self.running.lock().ok().and_then(|mut r| r.take());
        if let Some(Running { stop, task }) = running {
            self.shared.stopping.store(true, Ordering::Relaxed);
            let _ = stop.send(());
            let _ = task.await;
        }
    }
}

/// Owns a replica's process: on an OOM kill restarts it after a back-off, on any other exit
/// records why and leaves it down, and on a stop request terminates it.
async fn supervise(
    spec: Arc<Spec>,
    shared: Arc<Shared>,
    mut child: Child,
    mut stop: oneshot::Receiver<()>,
) {
    enum Event {
        Exited(std::io::Result<ExitStatus>),
        Stop,
    }
    let what = format!("kube-apiserver replica {}", spec.index);
    let mut backoff = RESTART_BACKOFF_MIN;
    loop {
        let started = Instant::now();
        let ooms_before = spec.cgroup.as_ref().map_or(0, MemoryCgroup::oom_kills);
        let event = tokio::select! {
            status = child.wait() => Event::Exited(status),
            _ = &mut stop => Event::Stop,
        };
        let status = match event {
            Event::Stop => {
                terminate(&mut child).await;
                shared.pid.store(0, Ordering::Relaxed);
                return;
            }
            Event::Exited(status) => status,
        };
        shared.pid.store(0, Ordering::Relaxed);
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let described = match &status {
            Ok(s) => s.to_string(),
            Err(e) => format!("unknown: {e}"),
        };
        let oom = status.is_ok_and(|s| s.signal() == Some(libc_sigkill()))
            && spec
                .cgroup
                .as_ref()
                .is_some_and(|c| c.oom_kills() > ooms_before);
        if !oom {
            if shared.ready.load(Ordering::Relaxed) {
                eprintln!(
                    "controlplane: {what} exited ({described}) and stays down; the end of {}:\n{}",
                    spec.log.display(),
                    log_tail(&spec.log)
                );
            }
            if let Ok(mut exit) = shared.exit.lock() {
                *exit = Some(described);
            }
            return;
        }
        shared.oom_kills.fetch_add(1, Ordering::Relaxed);
        if started.elapsed() > STABLE_RUN {
            backoff = RESTART_BACKOFF_MIN;
        }
        let limit = spec.cgroup.as_ref().map_or(0, MemoryCgroup::limit);
        eprintln!(
            "controlplane: the kernel OOM-killed {what} at its {} limit; restarting it in \
             {backoff:?}",
            crate::report::human_bytes(limit)
        );
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = &mut stop => return,
        }
        backoff = (backoff * 2).min(RESTART_BACKOFF_MAX);
        match spawn(
            &what,
            &spec.program,
            &spec.args,
            &spec.log,
            spec.cgroup.as_ref(),
        ) {
            Ok(next) => {
                child = next;
                shared.pid.store(child.id().unwrap_or(0), Ordering::Relaxed);
                shared.restarts.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                eprintln!("controlplane: restarting {what}: {e}");
                if let Ok(mut exit) = shared.exit.lock() {
                    *exit = Some(format!("OOM-killed, then the restart failed: {e}"));
                }
                return;
            }
        }
    }
}

/// SIGKILL's number, as `ExitStatus::signal` reports it.
fn libc_sigkill() -> i32 {
    Signal::KILL.as_raw()
}

/// SIGTERM to the process group, SIGKILL after [`STOP_GRACE`], and the exit reaped.
async fn terminate(child: &mut Child) {
    let Some(pid) = child.id() else {
        return;
    };
    child::signal_group(pid, Signal::TERM);
    if tokio::time::timeout(STOP_GRACE, child.wait())
        .await
        .is_err()
    {
        eprintln!("controlplane: pid {pid} did not exit {STOP_GRACE:?} after SIGTERM; killing it");
        child::signal_group(pid, Signal::KILL);
        let _ = child.wait().await;
    }
}

/// Starts `program` with its output appended to `log`; inside `cgroup` when given, joined
/// by a shell that writes its own pid into the cgroup and then becomes the program, so the
/// program's every allocation is charged to the cgroup.
fn spawn(
    what: &str,
    program: &Path,
    args: &[OsString],
    log: &Path,
    cgroup: Option<&MemoryCgroup>,
) -> Result<Child, Error> {
    let io = |source| Error::Io {
        path: log.to_path_buf(),
        source,
    };
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(io)?;
    let err = out.try_clone().map_err(io)?;
    let mut command = match cgroup {
        Some(cgroup) => {
            let mut c = child::command("sh");
            c.arg("-c")
                .arg(r#"echo $$ > "$1" && shift && exec "$@""#)
                .arg("sh")
                .arg(cgroup.procs_file())
                .arg(program);
            c
        }
        None => child::command(program),
    };
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|source| Error::Spawn {
            what: format!("{what} ({})", program.display()),
            source,
        })
}

/// The flags of every replica: TLS and client certificates from the development PKI, the
/// request-header authenticator trusting only Bulwark's front-proxy certificate, Node and
/// RBAC authorization, service-account tokens, and API Priority and Fairness (the
/// default, said explicitly).
fn apiserver_args(
    pki: &pki::Files,
    etcd: &str,
    addr: SocketAddr,
    bind: std::net::IpAddr,
    cert_dir: &Path,
) -> Vec<OsString> {
    vec![
        format!("--etcd-servers={etcd}").into(),
        format!("--bind-address={bind}").into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={}", addr.port()).into(),
        flag("--cert-dir", cert_dir),
        flag("--tls-cert-file", &pki.serving_cert),
        flag("--tls-private-key-file", &pki.serving_key),
        flag("--client-ca-file", &pki.client_ca),
        flag("--requestheader-client-ca-file", &pki.front_proxy_ca),
        format!("--requestheader-allowed-names={FRONT_PROXY_NAME}").into(),
        "--requestheader-username-headers=X-Remote-User".into(),
        "--requestheader-group-headers=X-Remote-Group".into(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
        "--requestheader-uid-headers=X-Remote-Uid".into(),
        "--authorization-mode=Node,RBAC".into(),
        // Only an allocation range kept in etcd (no traffic); without it the apiserver
        // warns that its default is deprecated.
        "--service-cluster-ip-range=10.96.0.0/16".into(),
        "--service-account-issuer=https://kubernetes.default.svc".into(),
        flag("--service-account-key-file", &pki.sa_pub),
        flag("--service-account-signing-key-file", &pki.sa_key),
        "--enable-priority-and-fairness=true".into(),
        // Every replica has the same address and a port of its own: the `kubernetes`
        // Service's endpoints (one address, one port) cannot name them all.
        "--endpoint-reconciler-type=none".into(),
        // Identity leases are named after the host name, which every replica here shares:
        // they would fight over one lease every ten seconds. The peer proxy needs them.
        "--feature-gates=APIServerIdentity=false,UnknownVersionInteroperabilityProxy=false".into(),
        // On SIGTERM, end watches at once (their clients resume elsewhere) rather than
        // hold the shutdown for its full minute, as Bulwark's cache watches would.
        "--shutdown-watch-termination-grace-period=10s".into(),
        "--profiling=false".into(),
    ]
}

fn flag(name: &str, path: &Path) -> OsString {
    let mut f = OsString::from(name);
    f.push("=");
    f.push(path);
    f
}

fn create_dir(dir: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// The last lines of a log, for error messages.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// The sum of `apiserver_longrunning_requests{verb="WATCH",...}` in a Prometheus text
/// exposition.
fn longrunning_watches(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_longrunning_requests{") && l.contains("verb=\"WATCH\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The sum of `apiserver_request_total` samples with all of `labels` in a Prometheus text
/// exposition.
fn request_total(metrics: &str, labels: &[&str]) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A `kube` client from kubeconfig text, with short timeouts: every server is local.
/// `retry` keeps kube's default retries of 429, 503 and 504 answers.
async fn client_from_yaml(yaml: &str, retry: bool) -> Result<Client, Error> {
    let kubeconfig = Kubeconfig::from_yaml(yaml)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(30));
    config.default_retry = retry;
    Client::try_from(config).map_err(|source| Error::Kube {
        what: "building a client".into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longrunning_watches_sums_the_watch_series() {
        let text = "# TYPE apiserver_longrunning_requests gauge\n\
apiserver_longrunning_requests{component=\"apiserver\",resource=\"secrets\",verb=\"WATCH\",version=\"v1\"} 7\n\
apiserver_longrunning_requests{component=\"apiserver\",resource=\"pods\",verb=\"WATCH\",version=\"v1\"} 3\n\
apiserver_longrunning_requests{component=\"apiserver\",resource=\"pods\",subresource=\"log\",verb=\"CONNECT\",version=\"v1\"} 2\n\
apiserver_longrunning_requests_total 99\n";
        assert_eq!(longrunning_watches(text), 10);
    }

    #[test]
    fn request_total_sums_the_series_with_every_label() {
        let text = "# TYPE apiserver_request_total counter\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",resource=\"secrets\",scope=\"namespace\",verb=\"LIST\"} 4\n\
apiserver_request_total{code=\"410\",component=\"apiserver\",resource=\"secrets\",scope=\"namespace\",verb=\"LIST\"} 1\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",resource=\"secrets\",scope=\"cluster\",verb=\"LIST\"} 9\n\
apiserver_request_total{code=\"200\",component=\"apiserver\",resource=\"secrets\",scope=\"namespace\",verb=\"WATCH\"} 3\n";
        let labels = [
            "verb=\"LIST\"",
            "resource=\"secrets\"",
            "scope=\"namespace\"",
        ];
        assert_eq!(request_total(text, &labels), 5);
        assert_eq!(request_total(text, &["verb=\"LIST\""]), 14);
    }

    /// The supervisor against the kernel's own OOM killer: a process that allocates past
    /// its cgroup's limit is killed, counted as an OOM kill and restarted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_oom_killed_process_is_counted_and_restarted() {
        let root = Path::new(cgroup::DEFAULT_ROOT);
        if !root.join("memory.limit_in_bytes").exists() {
            eprintln!("no cgroup v1 memory controller here: nothing to test");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let cgroup = MemoryCgroup::create(root, 0, 32 << 20).unwrap();
        let cgroup_path = cgroup.path().to_path_buf();
        // A string that doubles forever: the process grows until the kernel kills it.
        let replica = Replica {
            spec: Arc::new(Spec {
                index: 0,
                program: PathBuf::from("awk"),
                args: vec![r#"BEGIN { s = "x"; while (1) s = s s }"#.into()],
                addr: SocketAddr::from(([127, 0, 0, 1], 1)),
                log: dir.path().join("awk.log"),
                cgroup: Some(cgroup),
            }),
            shared: Arc::default(),
            running: Mutex::new(None),
        };
        replica.launch().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while replica.shared.restarts.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "no restart after an OOM kill");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(replica.shared.oom_kills.load(Ordering::Relaxed) >= 1);
        assert!(
            replica.shared.exit.lock().unwrap().is_none(),
            "it was not left down"
        );
        replica.stop().await;
        assert_eq!(replica.shared.pid.load(Ordering::Relaxed), 0);
        let peak = replica
            .spec
            .cgroup
            .as_ref()
            .and_then(MemoryCgroup::peak_bytes);
        assert!(peak.is_some_and(|p| p >= 30 << 20), "peak {peak:?}");
        replica
            .spec
            .cgroup
            .as_ref()
            .unwrap()
            .remove(Duration::from_secs(5))
            .unwrap();
        assert!(!cgroup_path.exists());
    }

    #[test]
    fn every_replica_trusts_only_bulwarks_front_proxy_name() {
        let dir = tempfile::tempdir().unwrap();
        let files = pki::mint(dir.path()).unwrap();
        let args = apiserver_args(
            &files,
            "http://127.0.0.1:2379",
            SocketAddr::from(([127, 0, 0, 1], 6443)),
            std::net::Ipv4Addr::LOCALHOST.into(),
            dir.path(),
        );
        let args: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        for expected in [
            "--requestheader-allowed-names=bulwark-front-proxy",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--requestheader-uid-headers=X-Remote-Uid",
            "--secure-port=6443",
            "--bind-address=127.0.0.1",
            "--authorization-mode=Node,RBAC",
        ] {
            assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
        }
    }
}
