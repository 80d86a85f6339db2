//! A small local stack around the cache, standing in for the proxy's wiring: a simulated
//! fleet, Bulwark's TLS listener, the cache in front of the upstream pool, and certificates
//! minted per test. A request the cache does not answer is forwarded with the client's
//! identity in front-proxy mode, as the proxy does.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bulwark::cache::{AuditLog, Cache};
use bulwark::classify::{self, Verb};
use bulwark::config::Config;
use bulwark::identity::forward::Forwarding;
use bulwark::identity::{self, Credential, Identity};
use bulwark::listen::{ConnInfo, DrainPhase, Listener};
use bulwark::metrics::Metrics;
use bulwark::upstream::{RetryPolicy, Route, Upstream, UpstreamTls};
use bulwark::{Body, BoxError};
use bulwark_sim::{Fleet, Pki, Policy, PolicyRule, SimConfig};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;

/// The CN of the front-proxy certificate, allowed by the simulated apiserver.
const FRONT_PROXY_CN: &str = "front-proxy-client";

/// A fleet, the cache, and a listener in front of both.
pub struct Stack {
    pub fleet: Fleet,
    pub cache: Arc<Cache>,
    pub metrics: Metrics,
    pub addr: SocketAddr,
    pub pki: Arc<Pki>,
    pub audit_path: std::path::PathBuf,
    _drain: tokio::sync::watch::Sender<DrainPhase>,
    _dir: TempDir,
}

/// How a test wants its stack.
pub struct Options {
    pub replicas: usize,
    /// The simulator's watch-cache window (events before 410).
    pub event_ring: usize,
    pub seed: Vec<&'static str>,
    /// Extra YAML under `cache:`.
    pub cache_yaml: &'static str,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            replicas: 2,
            event_ring: 10_000,
            seed: Vec::new(),
            cache_yaml: "",
        }
    }
}

fn rule(users: &[&str], verbs: &[&str], resources: &[&str], names: &[&str]) -> PolicyRule {
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    PolicyRule {
        users: strings(users),
        groups: Vec::new(),
        verbs: strings(verbs),
        resources: strings(resources),
        namespaces: vec!["*".into()],
        names: strings(names),
        non_resource_urls: Vec::new(),
    }
}

/// `bulwark` may review and read everything; `alice` may read and write secrets; the node
/// `system:node:n1` may read only the secret `n1-secret`; `mallory` may do nothing.
fn policy() -> Policy {
    Policy {
        rules: vec![
            rule(
                &["bulwark"],
                &["create"],
                &[
                    "tokenreviews.authentication.k8s.io",
                    "subjectaccessreviews.authorization.k8s.io",
                ],
                &[],
            ),
            rule(&["bulwark"], &["get", "list", "watch"], &["*"], &[]),
            rule(
                &["alice"],
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
                &["secrets", "endpoints", "endpointslices.discovery.k8s.io"],
                &[],
            ),
            rule(
                &["system:node:n1"],
                &["get", "list", "watch"],
                &["secrets"],
                &["n1-secret"],
            ),
        ],
    }
}

/// A simulated fleet with the stack's policy.
pub async fn fleet(options: &Options) -> (Fleet, Arc<Pki>) {
    let pki = Arc::new(Pki::new());
    let fleet = Fleet::start(SimConfig {
        replicas: options.replicas,
        pki: pki.clone(),
        front_proxy_allowed_names: vec![FRONT_PROXY_CN.into()],
        policy: policy(),
        seed: options
            .seed
            .iter()
            .map(|s| s.parse().expect("seed"))
            .collect(),
        event_ring: options.event_ring,
        bookmark_interval: Duration::from_millis(200),
        ..SimConfig::default()
    })
    .await
    .expect("simulator starts");
    (fleet, pki)
}

impl Stack {
    pub async fn start(options: Options) -> Stack {
        let (fleet, pki) = fleet(&options).await;
        Stack::with_fleet(fleet, pki, options).await
    }

    /// The cache and listener in front of a fleet made by [`fleet`].
    pub async fn with_fleet(fleet: Fleet, pki: Arc<Pki>, options: Options) -> Stack {
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, pem: &str| std::fs::write(dir.path().join(name), pem).unwrap();
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
        let d = dir.path().display();
        let audit_path = dir.path().join("audit.jsonl");
        let yaml = format!(
            r#"
listen:
  address: 127.0.0.1:0
  cert: {d}/serving.crt
  key: {d}/serving.key
  clientCA: {d}/client-ca.crt
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
cache:
  enabled: true
  syncCap: 30s
{cache_yaml}
audit:
  path: {audit}
"#,
            replicas = replicas.join("\n"),
            cache_yaml = options.cache_yaml,
            audit = audit_path.display(),
        );
        let config: Config = yaml.parse().expect("test config is valid");
        let metrics = Metrics::new();
        let tls = UpstreamTls::from_config(&config.upstream).expect("upstream TLS");
        let upstream = Upstream::new(&config.upstream, tls, metrics.clone()).expect("upstream");
        upstream.spawn_probes();
        let audit = AuditLog::open(&audit_path).expect("audit log");
        let cache = Cache::start(
            &config.cache,
            upstream.clone(),
            None,
            metrics.clone(),
            Some(audit),
        );
        let forwarding = Arc::new(
            Forwarding::new(
                config.identity.mode,
                config.upstream.front_proxy.as_ref(),
                None,
            )
            .expect("forwarding"),
        );
        let listener = Listener::bind(&config.listen).await.expect("listener");
        let addr = listener.local_addr();
        let (drain, drain_rx) = tokio::sync::watch::channel(DrainPhase::Serving);
        let service_cache = cache.clone();
        let service = tower::service_fn(move |request: Request<Incoming>| {
            let cache = service_cache.clone();
            let upstream = upstream.clone();
            let forwarding = forwarding.clone();
            async move { Ok::<_, Infallible>(handle(request, &cache, &upstream, &forwarding).await) }
        });
        tokio::spawn(async move {
            let _ = listener.serve(service, drain_rx).await;
        });
        let stack = Stack {
            fleet,
            cache,
            metrics,
            addr,
            pki,
            audit_path,
            _drain: drain,
            _dir: dir,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !stack.cache.synced() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the cache never synced"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stack
    }

    /// A kube client for `user` through the stack, from a kubeconfig as a user writes it.
    pub async fn kube_client(&self, user: &str) -> kube::Client {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let cert = self.pki.client_ca.client_cert(user, &[]);
        let kubeconfig = format!(
            r#"
apiVersion: v1
kind: Config
clusters:
- name: bulwark
  cluster:
    server: https://{addr}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: ctx
  context: {{cluster: bulwark, user: {user}}}
current-context: ctx
"#,
            addr = self.addr,
            ca = b64(&self.pki.server_ca.cert_pem()),
            cert = b64(&cert.cert_pem),
            key = b64(&cert.key_pem),
        );
        let kubeconfig = Kubeconfig::from_yaml(&kubeconfig).expect("kubeconfig");
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .expect("kube config");
        kube::Client::try_from(config).expect("kube client")
    }

    /// Cache answers so far, for the given verb.
    pub fn hits(&self, verb: &str) -> u64 {
        self.metrics
            .cache_requests_total
            .with_label_values(&["secrets", verb, "hit"])
            .get()
    }

    /// Requests `user` made that reached the simulated apiservers.
    pub fn upstream_requests_of(&self, user: &str) -> Vec<String> {
        self.fleet
            .seen_requests()
            .into_iter()
            .filter(|r| r.user == user)
            .map(|r| r.path)
            .collect()
    }
}

fn refuse(status: StatusCode, message: String) -> Response<Body> {
    let mut response = Response::new(bulwark::full(message));
    *response.status_mut() = status;
    response
}

/// Classify, identify by certificate, the cache, else forward upstream.
async fn handle(
    request: Request<Incoming>,
    cache: &Cache,
    upstream: &Upstream,
    forwarding: &Forwarding,
) -> Response<Body> {
    let info = match classify::classify(request.method(), request.uri()) {
        Ok(info) => info,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let chain = request
        .extensions()
        .get::<ConnInfo>()
        .and_then(|c| c.client_chain.clone());
    let Some(user) = chain
        .as_deref()
        .and_then(|c| c.first())
        .and_then(|leaf| identity::user_from_certificate(leaf).ok())
    else {
        return refuse(StatusCode::UNAUTHORIZED, "no client certificate".into());
    };
    let peer = request.extensions().get::<ConnInfo>().map(|c| c.peer.ip());
    match cache
        .serve_from(&info, &user, request.headers(), peer, None, None)
        .await
    {
        Ok(Some(response)) => return response,
        Err(e) => return e.into_response(),
        Ok(None) => {}
    }
    let (mut parts, body) = request.into_parts();
    let identity = Identity::User {
        user,
        credential: Credential::Certificate,
    };
    let credential = match forwarding.prepare(&identity, &mut parts.headers, false) {
        Ok(c) => c,
        Err(e) => return refuse(StatusCode::FORBIDDEN, e.to_string()),
    };
    if let Some(pq) = parts.uri.path_and_query().cloned() {
        parts.uri = http::Uri::from(pq);
    }
    let watch = info.verb == Verb::Watch;
    let route = Route {
        credential,
        retry: if info.is_read() {
            RetryPolicy::Read
        } else {
            RetryPolicy::Write
        },
        long_running: info.is_long_running(),
        watch,
        timeout: (!watch).then_some(Duration::from_secs(30)),
    };
    let body = body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync();
    match upstream.send(Request::from_parts(parts, body), route).await {
        Ok(response) => response,
        Err(e) => refuse(e.status(), e.to_string()),
    }
}
