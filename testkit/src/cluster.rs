//! A simulated apiserver fleet with a real Bulwark in front, started as production starts
//! it (`Running::start` from a configuration), and the clients that talk to it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bulwark::cache::Cache;
use bulwark::config::{Config, IdentityMode};
use bulwark::serve::Running;
use bulwark_sim::{Fleet, Pki, Policy, PolicyRule, SimConfig, StaticToken};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;

use crate::client::{Client, admin_get};
use crate::config::{BulwarkConfig, Credentials, FRONT_PROXY_CN, Names, OWN_USER};

/// A token the simulated apiserver knows, belonging to `tina` in group `token-users`.
pub const GOOD_TOKEN: &str = "good-token-for-tina";
/// A token nobody knows.
pub const BAD_TOKEN: &str = "forged-token";

/// Every authenticated client goes to the `exempt` level.
pub const UNLIMITED_RULES: &str = r#"
rules:
  - name: test-clients
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: exempt
"#;

/// alice in a level of 10 seats, with no rate: LISTs she leaves unread hold their bytes.
pub const ALICE_LISTS_RULES: &str = r#"
levels:
  - name: lists
    seats: 10
    queues: 8
    handSize: 2
    queueLength: 5
    maxWait: 5s
rules:
  - name: alice
    precedence: 100
    match:
      users: ["alice"]
    level: lists
    flow: user
"#;

/// How a test wants its cluster.
pub struct Setup {
    /// Simulated apiserver replicas.
    pub replicas: usize,
    /// How Bulwark forwards identities.
    pub mode: IdentityMode,
    /// What the store holds at the start, e.g. `secrets=20x1KiB@team,other`.
    pub seed: Vec<&'static str>,
    /// The rule file Bulwark loads; the default lets every test client through unlimited,
    /// so that tests of balancing and identity measure those alone.
    pub rules: &'static str,
    /// A rule folder to load instead of `rules`.
    pub rules_folder: Option<PathBuf>,
    /// Whether Bulwark's watch-fed cache runs (off where a test watches what reaches the
    /// apiservers).
    pub cache: bool,
    /// Threads serving Bulwark's client connections (`listen.workers`); 0 serves them on
    /// the test's runtime.
    pub workers: usize,
    /// Further settings of Bulwark's configuration: dotted path, YAML value.
    pub settings: Vec<(&'static str, &'static str)>,
    /// A last change to the parsed configuration.
    pub tweak: fn(&mut Config),
    /// Who may do what at the apiservers; [`policy`] by default.
    pub policy: Policy,
    /// The apiservers' watch window: events kept before a watch or continue token gets 410.
    pub event_ring: usize,
    /// How often the apiservers send watch bookmarks.
    pub bookmark_interval: Duration,
    /// Where Bulwark's certificates, rules and configuration go; a temporary folder removed
    /// with the cluster when `None`.
    pub dir: Option<PathBuf>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            replicas: 3,
            mode: IdentityMode::FrontProxy,
            seed: Vec::new(),
            rules: UNLIMITED_RULES,
            rules_folder: None,
            cache: false,
            workers: 0,
            settings: Vec::new(),
            tweak: |_| {},
            policy: policy(),
            event_ring: SimConfig::default().event_ring,
            bookmark_interval: Duration::from_secs(1),
            dir: None,
        }
    }
}

/// One policy rule: `users` and `groups` may do `verbs` on `resources` in every namespace.
pub fn grant(users: &[&str], groups: &[&str], verbs: &[&str], resources: &[&str]) -> PolicyRule {
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    PolicyRule {
        users: strings(users),
        groups: strings(groups),
        verbs: strings(verbs),
        resources: strings(resources),
        namespaces: vec!["*".into()],
        names: Vec::new(),
        non_resource_urls: Vec::new(),
    }
}

/// The policy of every test cluster: `bulwark` may review, impersonate and read everything;
/// `alice` may do everything to secrets, configmaps, endpoints and endpointslices; `tina`
/// (a token user) and `carol` may read everything; the node `system:node:n1` may read only
/// the secret `n1-secret`; `system:masters` may do everything; nobody else (`mallory`,
/// `nobody`) may do anything.
pub fn policy() -> Policy {
    let mut node = grant(
        &["system:node:n1"],
        &[],
        &["get", "list", "watch"],
        &["secrets"],
    );
    node.names = vec!["n1-secret".into()];
    Policy {
        rules: vec![
            grant(
                &[OWN_USER],
                &[],
                &["create"],
                &[
                    "tokenreviews.authentication.k8s.io",
                    "subjectaccessreviews.authorization.k8s.io",
                ],
            ),
            grant(
                &[OWN_USER],
                &[],
                &["impersonate"],
                &["users", "groups", "uids", "userextras/*"],
            ),
            grant(&[OWN_USER], &[], &["get", "list", "watch"], &["*"]),
            grant(
                &["alice"],
                &[],
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
                &[
                    "secrets",
                    "configmaps",
                    "endpoints",
                    "endpointslices.discovery.k8s.io",
                ],
            ),
            grant(&["tina", "carol"], &[], &["get", "list", "watch"], &["*"]),
            node,
        ],
    }
}

/// The simulator's configuration for a fleet Bulwark can stand in front of: its PKI, its
/// front-proxy name allowed, `tina`'s token known, and `policy`.
pub fn fleet_config(pki: Arc<Pki>, replicas: usize, policy: Policy) -> SimConfig {
    SimConfig {
        replicas,
        pki,
        front_proxy_allowed_names: vec![FRONT_PROXY_CN.into()],
        tokens: vec![StaticToken {
            token: GOOD_TOKEN.into(),
            user: "tina".into(),
            uid: "tina-uid".into(),
            groups: vec!["token-users".into()],
            ..StaticToken::default()
        }],
        policy,
        ..SimConfig::default()
    }
}

/// A fleet of simulated apiservers with Bulwark in front of them.
pub struct Cluster {
    /// The simulated apiservers.
    pub fleet: Fleet,
    /// Bulwark, in this process.
    pub bulwark: Running,
    /// The CAs of the apiservers, their clients and the front proxy; Bulwark serves with a
    /// certificate from the apiservers' CA and trusts their client CA.
    pub pki: Arc<Pki>,
    /// The configuration Bulwark runs with.
    pub config: BulwarkConfig,
    dir: PathBuf,
    _temp: Option<TempDir>,
}

impl Cluster {
    /// Starts the fleet and Bulwark in front of it.
    pub async fn start(setup: Setup) -> Cluster {
        let (fleet, pki) = start_fleet(&setup).await;
        Cluster::in_front_of(fleet, pki, setup).await
    }

    /// Starts Bulwark in front of a fleet [`start_fleet`] started for `setup`.
    pub async fn in_front_of(fleet: Fleet, pki: Arc<Pki>, setup: Setup) -> Cluster {
        let (dir, temp) = match setup.dir {
            Some(dir) => (dir, None),
            None => {
                let temp = tempfile::tempdir().expect("temp dir");
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        let credentials = Credentials::mint(&dir, &pki, &pki.server_ca, Names::default())
            .expect("certificates written");
        let rules = match setup.rules_folder {
            Some(folder) => folder,
            None => {
                let folder = dir.join("rules");
                std::fs::create_dir_all(&folder).expect("rules folder");
                std::fs::write(folder.join("test.yaml"), setup.rules).expect("rules written");
                folder
            }
        };
        let mut config = BulwarkConfig::new(credentials, fleet.addrs())
            .quick_failover()
            .set("cache.syncCap", "5s");
        config.identity = setup.mode;
        config.rules = Some(rules);
        config.cache = setup.cache;
        config.audit = Some(dir.join("audit.jsonl"));
        if setup.workers > 0 {
            config = config.set("listen.workers", &setup.workers.to_string());
        }
        for (at, yaml) in setup.settings {
            config = config.set(at, yaml);
        }
        config
            .write(&dir.join("bulwark.yaml"))
            .expect("config written");
        let mut parsed = config.config();
        (setup.tweak)(&mut parsed);
        let bulwark = Running::start(parsed).await.expect("bulwark starts");
        Cluster {
            fleet,
            bulwark,
            pki,
            config,
            dir,
            _temp: temp,
        }
    }

    /// Waits (up to 20 s) until Bulwark is ready: a replica healthy and, with the cache on,
    /// the cache's first sync done.
    pub async fn ready(self) -> Cluster {
        until_ready(&self.bulwark).await;
        self
    }

    /// Starts another Bulwark in front of this cluster's fleet with this cluster's
    /// configuration (the same certificates, rules and cache; not [`Setup::tweak`]) and
    /// `settings` on top, its audit log `audit-{name}.jsonl` beside the first's, and waits
    /// as [`Cluster::ready`] does until it is ready.
    pub async fn start_another(&self, name: &str, settings: &[(&str, &str)]) -> Running {
        let mut config = self.config.clone();
        config.audit = Some(self.dir.join(format!("audit-{name}.jsonl")));
        for (at, yaml) in settings {
            config = config.set(at, yaml);
        }
        let bulwark = Running::start(config.config())
            .await
            .unwrap_or_else(|e| panic!("bulwark {name} starts: {e}"));
        until_ready(&bulwark).await;
        bulwark
    }

    /// Bulwark's watch-fed cache (the cluster runs with `cache: true`).
    pub fn cache(&self) -> &Cache {
        self.bulwark
            .admin
            .cache
            .as_deref()
            .expect("the cluster runs with the cache on")
    }

    /// Drains Bulwark as SIGTERM does; the fleet stops when dropped.
    pub async fn stop(self) {
        self.bulwark.drain().await;
    }

    /// The folder of Bulwark's files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client with a certificate for `user` in `groups`.
    pub async fn client(&self, user: &str, groups: &[&str]) -> Client {
        let cert = self.pki.client_ca.client_cert(user, groups);
        Client::connect(self.bulwark.addr, &self.pki, Some(&cert)).await
    }

    /// A client without a certificate (token or anonymous).
    pub async fn anonymous_client(&self) -> Client {
        Client::connect(self.bulwark.addr, &self.pki, None).await
    }

    /// A client without a certificate for a Bulwark of this cluster's certificates at
    /// `addr` (one started as its own process with [`Cluster::process_config`]).
    pub async fn anonymous_client_at(&self, addr: SocketAddr) -> Client {
        Client::connect(addr, &self.pki, None).await
    }

    /// A client of the `kube` crate for `user` in `groups`, through Bulwark, from a
    /// kubeconfig as a user writes it.
    pub async fn kube_client(&self, user: &str, groups: &[&str]) -> kube::Client {
        kube_client(&self.pki, self.bulwark.addr, user, groups).await
    }

    /// The lines of the JSON lines file at `path` that Bulwark writes (an access log), the
    /// last requests' included (the logs' writer threads are waited for).
    pub fn json_lines(&self, path: &Path) -> Vec<serde_json::Value> {
        self.bulwark.flush_logs();
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect()
    }

    /// The audit events Bulwark has written (reads it answered or refused from its cache),
    /// the last requests' included (the log's writer thread is waited for).
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        self.bulwark.flush_logs();
        let path = self
            .config
            .audit
            .as_ref()
            .expect("the audit log is configured");
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("an audit line is JSON"))
            .collect()
    }

    /// Bulwark's metrics as `/metrics` renders them.
    pub fn metrics(&self) -> String {
        self.bulwark.admin.metrics.render()
    }

    /// The sum of a metric family's samples (`bulwark_list_bytes_in_flight`) now.
    pub fn metric_sum(&self, family: &str) -> f64 {
        crate::metric_sum(&self.metrics(), family)
    }

    /// The LIST bytes admission holds on the replicas now (`bulwark_list_bytes_in_flight`).
    pub fn list_bytes_in_flight(&self) -> f64 {
        self.metric_sum("bulwark_list_bytes_in_flight")
    }

    /// Plain HTTP/1.1 GET on Bulwark's admin listener: status and body.
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        admin_get(self.bulwark.admin_addr, path)
            .await
            .unwrap_or_else(|| panic!("GET {path} on the admin listener failed"))
    }

    /// Paths of the requests `user` made that reached the simulated apiservers.
    pub fn upstream_requests_of(&self, user: &str) -> Vec<String> {
        self.fleet
            .seen_requests()
            .into_iter()
            .filter(|r| r.user == user)
            .map(|r| r.path)
            .collect()
    }

    /// This cluster's configuration for Bulwark as its own process: fixed free ports and
    /// an audit log of its own.
    pub fn process_config(&self) -> BulwarkConfig {
        let mut config = self.config.clone();
        config.listen = crate::free_addr();
        config.admin = crate::free_addr();
        config.audit = Some(self.dir.join("process-audit.jsonl"));
        config
    }

    /// Starts the `bulwark` binary at `exe` as its own process with this cluster's
    /// configuration, so that its memory is the operating system's figure.
    pub async fn spawn_process(&self, exe: &Path) -> BulwarkProcess {
        let config = self.process_config();
        let path = self.dir.join("process.yaml");
        config.write(&path).expect("config written");
        let child = tokio::process::Command::new(exe)
            .args(["serve", "--config"])
            .arg(&path)
            .kill_on_drop(true)
            .spawn()
            .expect("bulwark binary starts");
        let addr = config.listen;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "bulwark process never listened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        BulwarkProcess { child, addr }
    }
}

/// Waits (up to 20 s) until `bulwark` is ready: a replica healthy and, with the cache on,
/// the cache's first sync done.
async fn until_ready(bulwark: &Running) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let why = match bulwark.admin.ready() {
            Err(why) => why,
            // Readiness gives up on the cache after its sync cap; a test waits for it.
            Ok(()) if bulwark.admin.cache.as_ref().is_some_and(|c| !c.synced()) => {
                bulwark::admin::NotReady::CacheNotSynced
            }
            Ok(()) => return,
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "bulwark never became ready: {why}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The simulated fleet of `setup`, and the PKI it was minted from.
pub async fn start_fleet(setup: &Setup) -> (Fleet, Arc<Pki>) {
    let pki = Arc::new(Pki::new());
    let fleet = Fleet::start(SimConfig {
        seed: setup
            .seed
            .iter()
            .map(|s| s.parse().expect("seed"))
            .collect(),
        event_ring: setup.event_ring,
        bookmark_interval: setup.bookmark_interval,
        ..fleet_config(pki.clone(), setup.replicas, setup.policy.clone())
    })
    .await
    .expect("simulator starts");
    (fleet, pki)
}

/// A client of the `kube` crate for `user` in `groups` at `server`, whose serving
/// certificate comes from `pki.server_ca`.
pub async fn kube_client(
    pki: &Pki,
    server: SocketAddr,
    user: &str,
    groups: &[&str],
) -> kube::Client {
    let cert = pki.client_ca.client_cert(user, groups);
    let kubeconfig = bulwark_sim::client::kubeconfig(pki, &format!("https://{server}"), &cert);
    let kubeconfig = Kubeconfig::from_yaml(&kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kube config");
    kube::Client::try_from(config).expect("kube client")
}

/// Bulwark running as a child process.
pub struct BulwarkProcess {
    /// The process.
    pub child: tokio::process::Child,
    /// Its client-facing address.
    pub addr: SocketAddr,
}

impl BulwarkProcess {
    /// Peak resident memory of the process so far, from the kernel (`VmHWM`).
    pub fn peak_rss_bytes(&self) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmHWM in /proc status")
            * 1024
    }
}
