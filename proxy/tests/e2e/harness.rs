//! A simulated fleet with Bulwark in front, certificates minted per test, and clients that
//! speak real TLS and HTTP/2 to Bulwark.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bulwark::config::{Config, IdentityMode};
use bulwark::serve::Running;
use bulwark_sim::{CertKey, Fleet, Pki, Policy, PolicyRule, SimConfig, StaticToken};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tempfile::TempDir;
use tokio_rustls::TlsConnector;

/// The CN of Bulwark's front-proxy certificate, allowed by the simulated apiserver.
pub const FRONT_PROXY_CN: &str = "front-proxy-client";
/// A token the simulated apiserver knows, belonging to `tina` in group `token-users`.
pub const GOOD_TOKEN: &str = "good-token-for-tina";
/// A token nobody knows.
pub const BAD_TOKEN: &str = "forged-token";

/// A fleet of simulated apiservers with Bulwark in front of them.
pub struct Cluster {
    pub fleet: Fleet,
    pub bulwark: Running,
    pub pki: Arc<Pki>,
    _dir: TempDir,
}

/// How a test wants its cluster.
pub struct Setup {
    pub replicas: usize,
    pub mode: IdentityMode,
    pub seed: Vec<&'static str>,
    pub tweak: fn(&mut Config),
    /// The rule file Bulwark loads; the default lets every test client through unlimited,
    /// so that tests of balancing and identity measure those alone.
    pub rules: &'static str,
    /// Whether Bulwark's watch-fed cache runs (off where a test watches what reaches the
    /// apiservers).
    pub cache: bool,
}

/// Every authenticated client goes to the `exempt` level.
pub const UNLIMITED_RULES: &str = r#"
rules:
  - name: test-clients
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: exempt
"#;

impl Default for Setup {
    fn default() -> Self {
        Setup {
            replicas: 3,
            mode: IdentityMode::FrontProxy,
            seed: Vec::new(),
            tweak: |_| {},
            rules: UNLIMITED_RULES,
            cache: false,
        }
    }
}

/// The policy of every test cluster: `bulwark` may review and impersonate, `alice` may read
/// secrets, `tina` (a token user) and `carol` may read everything, `system:masters` may do everything.
fn policy() -> Policy {
    let rule = |users: &[&str], groups: &[&str], verbs: &[&str], resources: &[&str]| PolicyRule {
        users: users.iter().map(|s| s.to_string()).collect(),
        groups: groups.iter().map(|s| s.to_string()).collect(),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        resources: resources.iter().map(|s| s.to_string()).collect(),
        namespaces: vec!["*".into()],
        names: Vec::new(),
        non_resource_urls: Vec::new(),
    };
    Policy {
        rules: vec![
            rule(
                &["bulwark"],
                &[],
                &["create"],
                &[
                    "tokenreviews.authentication.k8s.io",
                    "subjectaccessreviews.authorization.k8s.io",
                ],
            ),
            rule(
                &["bulwark"],
                &[],
                &["impersonate"],
                &["users", "groups", "uids", "userextras/*"],
            ),
            rule(&["bulwark"], &[], &["get", "list", "watch"], &["*"]),
            rule(
                &["alice"],
                &[],
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
                &["secrets", "configmaps"],
            ),
            rule(&["tina", "carol"], &[], &["get", "list", "watch"], &["*"]),
        ],
    }
}

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

impl Cluster {
    /// The LIST bytes admission holds on the replicas now (`bulwark_list_bytes_in_flight`).
    pub fn list_bytes_in_flight(&self) -> f64 {
        self.bulwark
            .admin
            .metrics
            .render()
            .lines()
            .filter(|l| l.starts_with("bulwark_list_bytes_in_flight{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub async fn start(setup: Setup) -> Cluster {
        let pki = Arc::new(Pki::new());
        let fleet = Fleet::start(SimConfig {
            replicas: setup.replicas,
            pki: pki.clone(),
            front_proxy_allowed_names: vec![FRONT_PROXY_CN.into()],
            tokens: vec![StaticToken {
                token: GOOD_TOKEN.into(),
                user: "tina".into(),
                uid: "tina-uid".into(),
                groups: vec!["token-users".into()],
            }],
            policy: policy(),
            seed: setup
                .seed
                .iter()
                .map(|s| s.parse().expect("seed"))
                .collect(),
            bookmark_interval: Duration::from_secs(1),
            ..SimConfig::default()
        })
        .await
        .expect("simulator starts");
        let dir = tempfile::tempdir().expect("temp dir");
        let path = |name: &str| dir.path().join(name);
        let write = |name: &str, pem: &str| std::fs::write(path(name), pem).expect("write pem");
        write("upstream-ca.crt", &pki.server_ca.cert_pem());
        write("client-ca.crt", &pki.client_ca.cert_pem());
        pki.server_ca
            .server_cert(&["127.0.0.1", "localhost"])
            .write(dir.path(), "serving")
            .unwrap();
        pki.front_proxy_ca
            .client_cert(FRONT_PROXY_CN, &[])
            .write(dir.path(), "front-proxy")
            .unwrap();
        pki.client_ca
            .client_cert("bulwark", &["bulwark:proxies"])
            .write(dir.path(), "self")
            .unwrap();
        let replicas: Vec<String> = fleet
            .addrs()
            .iter()
            .map(|a| format!("      - \"{a}\""))
            .collect();
        let mode = match setup.mode {
            IdentityMode::FrontProxy => "front-proxy",
            IdentityMode::Impersonate => "impersonate",
            IdentityMode::Passthrough => "passthrough",
        };
        std::fs::create_dir(dir.path().join("rules")).unwrap();
        std::fs::write(dir.path().join("rules/test.yaml"), setup.rules).unwrap();
        let d = dir.path().display();
        let yaml = format!(
            r#"
listen:
  address: 127.0.0.1:0
  cert: {d}/serving.crt
  key: {d}/serving.key
  clientCA: {d}/client-ca.crt
  shutdown: {{pause: 100ms, grace: 1s}}
admin:
  address: 127.0.0.1:0
upstream:
  replicas:
{replicas}
  ca: {d}/upstream-ca.crt
  frontProxy: {{cert: {d}/front-proxy.crt, key: {d}/front-proxy.key}}
  self: {{cert: {d}/self.crt, key: {d}/self.key}}
  probeInterval: 200ms
  ejectBase: 200ms
  ejectMax: 1s
  timeouts: {{connect: 1s, read: 10s, list: 30s, write: 10s}}
identity:
  mode: {mode}
rules:
  folder: {d}/rules
cache:
  enabled: {cache}
  syncCap: 5s
audit:
  path: {d}/audit.jsonl
"#,
            cache = setup.cache,
            replicas = replicas.join("\n")
        );
        let mut config: Config = yaml.parse().expect("test config is valid");
        (setup.tweak)(&mut config);
        std::fs::write(dir.path().join("bulwark.yaml"), &yaml).expect("write config");
        let bulwark = Running::start(config).await.expect("bulwark starts");
        Cluster {
            fleet,
            bulwark,
            pki,
            _dir: dir,
        }
    }

    /// Starts the `bulwark` binary as its own process with this cluster's configuration,
    /// so that its memory is the operating system's figure.
    pub async fn spawn_process(&self) -> BulwarkProcess {
        let dir = self._dir.path();
        let port = free_port();
        let yaml = std::fs::read_to_string(dir.join("bulwark.yaml"))
            .unwrap()
            .replacen(
                "address: 127.0.0.1:0",
                &format!("address: 127.0.0.1:{port}"),
                1,
            );
        let admin_port = free_port();
        let yaml = yaml.replacen(
            "address: 127.0.0.1:0",
            &format!("address: 127.0.0.1:{admin_port}"),
            1,
        );
        let path = dir.join("process.yaml");
        std::fs::write(&path, yaml).unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_bulwark"))
            .args(["serve", "--config"])
            .arg(&path)
            .kill_on_drop(true)
            .spawn()
            .expect("bulwark binary starts");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
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

    /// The audit events Bulwark has written (reads it answered from its cache).
    pub fn audit_events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self._dir.path().join("audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("an audit line is JSON"))
            .collect()
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
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Bulwark running as a child process.
pub struct BulwarkProcess {
    pub child: tokio::process::Child,
    pub addr: SocketAddr,
}

impl BulwarkProcess {
    /// Peak resident memory of the process so far, from the kernel (`VmHWM`).
    pub fn peak_rss_bytes(&self) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmHWM in /proc status")
            * 1024
    }
}

/// One HTTP/2 connection to Bulwark.
pub struct Client {
    sender: http2::SendRequest<Full<Bytes>>,
}

/// A response with its whole body.
pub struct Answer {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

pub fn tls_config(pki: &Pki, cert: Option<&CertKey>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.server_ca.cert_der()).unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let mut config = match cert {
        Some(cert) => {
            let chain: Vec<CertificateDer<'static>> =
                rustls_pemfile::certs(&mut cert.cert_pem.as_bytes())
                    .collect::<Result<_, _>>()
                    .unwrap();
            let key: PrivateKeyDer<'static> =
                rustls_pemfile::private_key(&mut cert.key_pem.as_bytes())
                    .unwrap()
                    .unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    config
}

impl Client {
    pub async fn connect(addr: SocketAddr, pki: &Pki, cert: Option<&CertKey>) -> Client {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let tls = TlsConnector::from(Arc::new(tls_config(pki, cert)))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .expect("TLS handshake");
        let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("HTTP/2 handshake");
        tokio::spawn(conn);
        Client { sender }
    }

    /// Sends a request and reads the whole answer.
    pub async fn send(&mut self, request: Request<Full<Bytes>>) -> Answer {
        let response = self.start(request).await;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// Sends a request and returns the streaming response.
    pub async fn start(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> Response<hyper::body::Incoming> {
        self.sender.ready().await.expect("connection ready");
        self.sender.send_request(request).await.expect("response")
    }

    /// A handle that sends on the same connection from many tasks.
    pub fn sender(&self) -> http2::SendRequest<Full<Bytes>> {
        self.sender.clone()
    }

    pub async fn get(&mut self, path: &str) -> Answer {
        self.send(get(path)).await
    }
}

/// A GET request for `path` on Bulwark.
pub fn get(path: &str) -> Request<Full<Bytes>> {
    Request::get(format!("https://127.0.0.1{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap()
}
