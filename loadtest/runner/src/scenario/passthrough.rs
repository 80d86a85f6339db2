//! `passthrough`: raw proxy overhead on a small GET — straight to one replica, through
//! Bulwark, through haproxy and through nginx (Debian's packages, configured here as
//! TLS-terminating reverse proxies to the same replica) — first at a fixed rate, then at
//! saturation.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bulwark_sim::pki::{Ca, Pki};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::{Driven, Env, Load, Mode, Options, Req, Scenario, Setup, identities};
use crate::client::Target;
use crate::report::{ProxyCost, Report};

/// The scenario.
pub struct Passthrough {
    modes: Vec<Mode>,
}

/// The small object every GET reads.
const PATH: &str = "/api/v1/namespaces/ns-0/configmaps/configmap-0";
/// Requests per second of each `fixed_rate` identity.
const PER_IDENTITY_RPS: u64 = 20;

/// An external reverse proxy (haproxy or nginx) started for one run.
pub struct External {
    child: Child,
    /// Where clients connect.
    pub target: Target,
    name: &'static str,
    log: PathBuf,
}

fn binary(mode: Mode) -> &'static str {
    match mode {
        Mode::Nginx => "nginx",
        _ => "haproxy",
    }
}

/// Where a program is on `PATH` (or in `/usr/sbin`, where Debian puts these two).
fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

impl External {
    /// Writes a TLS-terminating reverse proxy config for `upstream` and starts the proxy in
    /// the foreground; it verifies client certificates against the simulator's client CA
    /// and talks to the replica with a client certificate of its own.
    pub async fn start(
        mode: Mode,
        dir: &Path,
        upstream: SocketAddr,
        pki: &Pki,
    ) -> anyhow::Result<External> {
        let name = binary(mode);
        let exe = find(name).with_context(|| format!("{name} is not installed"))?;
        std::fs::create_dir_all(dir)?;
        let serving_ca = Ca::new(&format!("{name}-serving-ca"));
        let serving = serving_ca.server_cert(&["127.0.0.1", "localhost"]);
        let (crt, key) = serving.write(dir, "serving")?;
        let own = pki.client_ca.client_cert("external-proxy", &["fixed_rate"]);
        let (own_crt, own_key) = own.write(dir, "upstream-client")?;
        let client_ca = dir.join("client-ca.crt");
        std::fs::write(&client_ca, pki.client_ca.cert_pem())?;
        let upstream_ca = dir.join("upstream-ca.crt");
        std::fs::write(&upstream_ca, pki.server_ca.cert_pem())?;
        let addr = free_port()?;
        let log = dir.join(format!("{name}.log"));
        let d = |p: &Path| p.to_string_lossy().into_owned();
        let mut command = match mode {
            Mode::Nginx => {
                let tmp = dir.join("nginx-tmp");
                std::fs::create_dir_all(&tmp)?;
                let t = d(&tmp);
                let config = format!(
                    r#"daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {log} warn;
events {{ worker_connections 8000; }}
http {{
  access_log off;
  client_body_temp_path {t}/body;
  proxy_temp_path {t}/proxy;
  fastcgi_temp_path {t}/fastcgi;
  uwsgi_temp_path {t}/uwsgi;
  scgi_temp_path {t}/scgi;
  upstream apiserver {{ server {upstream}; keepalive 64; }}
  server {{
    listen {addr} ssl http2;
    ssl_certificate {crt};
    ssl_certificate_key {key};
    ssl_client_certificate {client_ca};
    ssl_verify_client on;
    http2_max_concurrent_streams 250;
    location / {{
      proxy_pass https://apiserver;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_ssl_certificate {own_crt};
      proxy_ssl_certificate_key {own_key};
      proxy_ssl_trusted_certificate {upstream_ca};
      proxy_ssl_verify on;
      proxy_ssl_name localhost;
      proxy_ssl_server_name on;
      proxy_ssl_session_reuse on;
    }}
  }}
}}
"#,
                    dir = d(dir),
                    log = d(&log),
                    crt = d(&crt),
                    key = d(&key),
                    client_ca = d(&client_ca),
                    own_crt = d(&own_crt),
                    own_key = d(&own_key),
                    upstream_ca = d(&upstream_ca),
                );
                let path = dir.join("nginx.conf");
                std::fs::write(&path, config)?;
                let mut c = Command::new(exe);
                c.arg("-c")
                    .arg(&path)
                    .arg("-p")
                    .arg(dir)
                    .arg("-e")
                    .arg(&log);
                c
            }
            _ => {
                // haproxy wants each certificate and its key in one PEM file.
                let bundle = dir.join("serving.pem");
                std::fs::write(&bundle, format!("{}{}", serving.cert_pem, serving.key_pem))?;
                let own_bundle = dir.join("upstream-client.pem");
                std::fs::write(&own_bundle, format!("{}{}", own.cert_pem, own.key_pem))?;
                let config = format!(
                    r#"global
  maxconn 8000
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend clients
  bind {addr} ssl crt {bundle} ca-file {client_ca} verify required alpn h2,http/1.1
  default_backend apiserver
backend apiserver
  http-reuse always
  server replica {upstream} ssl verify required verifyhost localhost ca-file {upstream_ca} crt {own} alpn h2
"#,
                    bundle = d(&bundle),
                    client_ca = d(&client_ca),
                    upstream_ca = d(&upstream_ca),
                    own = d(&own_bundle),
                );
                let path = dir.join("haproxy.cfg");
                std::fs::write(&path, config)?;
                let mut c = Command::new(exe);
                c.arg("-db").arg("-f").arg(&path);
                c
            }
        };
        let out = std::fs::File::create(dir.join(format!("{name}.out")))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let mut external = External {
            child,
            target: Target {
                addr,
                ca_pem: serving_ca.cert_pem(),
            },
            name,
            log,
        };
        external.wait_listening(dir).await?;
        Ok(external)
    }

    async fn wait_listening(&mut self, dir: &Path) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait()? {
                let out = std::fs::read_to_string(dir.join(format!("{}.out", self.name)))
                    .unwrap_or_default();
                bail!("{} exited at start ({status}):\n{out}", self.name);
            }
            if tokio::net::TcpStream::connect(self.target.addr)
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not listen on {} within 10 s",
                    self.name,
                    self.target.addr
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Measures and stops the proxy.
    pub async fn stop(mut self) -> anyhow::Result<ProxyCost> {
        let tail = std::fs::read_to_string(&self.log).unwrap_or_default();
        crate::proxy_process::stop_child(&mut self.child, self.name, &tail).await
    }
}

/// The scenario measures the proxy's own overhead, not a limit: its identities are exempt
/// (under the shipped rules they would be catch-all users, held to 20 requests/s each).
const MEASURED_RULE: &str = r#"
rules:
  - name: passthrough-measurement
    precedence: 50
    match:
      groups: [fixed_rate, saturation]
    level: exempt
"#;

impl Scenario for Passthrough {
    fn name(&self) -> &'static str {
        "passthrough"
    }

    fn setup(&self, _opts: &Options) -> Setup {
        Setup {
            replicas: 1,
            seed: vec!["configmaps=10x1KiB".into()],
            extra_rules: vec![("passthrough.yaml", MEASURED_RULE)],
            ..Setup::default()
        }
    }

    fn modes(&self) -> Vec<Mode> {
        self.modes.clone()
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(Duration::from_secs(20));
        let fixed = Load {
            class: "fixed_rate".into(),
            identities: identities(pki, "fixed_rate", opts.scaled(10, 1)),
            think: Duration::from_millis(1000 / PER_IDENTITY_RPS),
            next: Arc::new(|_, _| Req::get(PATH.into(), Duration::from_secs(10))),
        };
        let saturation = Load {
            class: "saturation".into(),
            identities: identities(pki, "saturation", opts.scaled(64, 1)),
            think: Duration::ZERO,
            next: Arc::new(|_, _| Req::get(PATH.into(), Duration::from_secs(10))),
        };
        // One phase after the other, so that the fixed-rate latencies are not measured
        // under saturation.
        let mut first = env.drive_loads(vec![fixed], duration / 2).await?;
        let second = env.drive_loads(vec![saturation], duration / 2).await?;
        first.classes.extend(second.classes);
        Ok(first)
    }
}

/// Runs the scenario against every target that is installed; says how to install the
/// missing ones.
pub async fn run(opts: &Options) -> anyhow::Result<Report> {
    let mut modes = vec![Mode::Replica, Mode::Bulwark];
    for mode in [Mode::Haproxy, Mode::Nginx] {
        if find(binary(mode)).is_some() {
            modes.push(mode);
        } else {
            eprintln!(
                "note: {0} is not installed, so its run is skipped; on Debian or Ubuntu: \
                 sudo apt-get install {0}",
                binary(mode)
            );
        }
    }
    super::run(&Passthrough { modes }, opts).await
}
