//! The one place Bulwark's configuration is written for tests, the sandbox and the load
//! scenarios: the certificate files it reads, and its YAML with named knobs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulwark::config::{Config, IdentityMode};
use bulwark_sim::{Ca, Pki};
use serde_json::{Value, json};
use serde_norway::Value as Yaml;

/// The CN of Bulwark's front-proxy certificate; the simulated apiservers allow it.
pub const FRONT_PROXY_CN: &str = "front-proxy-client";
/// Bulwark's own user at the apiservers (token and access reviews, the cache's informers).
pub const OWN_USER: &str = "bulwark";
/// Bulwark's own group.
pub const OWN_GROUP: &str = "bulwark:proxies";

/// Who Bulwark is to the apiservers: the CN of its front-proxy certificate, and its own
/// user and group.
#[derive(Clone, Copy, Debug)]
pub struct Names<'a> {
    /// CN of the front-proxy certificate.
    pub front_proxy: &'a str,
    /// Bulwark's own user.
    pub own_user: &'a str,
    /// Bulwark's own group.
    pub own_group: &'a str,
}

impl Default for Names<'_> {
    fn default() -> Self {
        Names {
            front_proxy: FRONT_PROXY_CN,
            own_user: OWN_USER,
            own_group: OWN_GROUP,
        }
    }
}

/// The certificate files Bulwark reads: its serving certificate, the CA of its clients, the
/// CA of the apiservers, its front-proxy certificate and its own client certificate.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// Serving certificate and key.
    pub serving: (PathBuf, PathBuf),
    /// The CA Bulwark verifies client certificates with (the apiservers' client CA).
    pub client_ca: PathBuf,
    /// The CA of the apiservers' serving certificates.
    pub upstream_ca: PathBuf,
    /// Front-proxy certificate and key.
    pub front_proxy: (PathBuf, PathBuf),
    /// Bulwark's own client certificate and key.
    pub own: (PathBuf, PathBuf),
}

impl Credentials {
    /// Mints Bulwark's certificates from the simulator's `pki` into `dir`; its serving
    /// certificate (for 127.0.0.1 and localhost) comes from `serving_ca`.
    pub fn mint(
        dir: &Path,
        pki: &Pki,
        serving_ca: &Ca,
        names: Names<'_>,
    ) -> std::io::Result<Credentials> {
        std::fs::create_dir_all(dir)?;
        let client_ca = dir.join("client-ca.crt");
        std::fs::write(&client_ca, pki.client_ca.cert_pem())?;
        let upstream_ca = dir.join("upstream-ca.crt");
        std::fs::write(&upstream_ca, pki.server_ca.cert_pem())?;
        Ok(Credentials {
            serving: serving_ca
                .server_cert(&serving_names())
                .write(dir, "serving")?,
            client_ca,
            upstream_ca,
            front_proxy: pki
                .front_proxy_ca
                .client_cert(names.front_proxy, &[])
                .write(dir, "front-proxy")?,
            own: pki
                .client_ca
                .client_cert(names.own_user, &[names.own_group])
                .write(dir, "self")?,
        })
    }
}

/// The names Bulwark's serving certificate carries: 127.0.0.1 and localhost, and what an
/// in-cluster client dials (the `kubernetes` Service's names and ClusterIP 10.96.0.1).
pub fn serving_names() -> Vec<&'static str> {
    vec![
        "127.0.0.1",
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
        "10.96.0.1",
    ]
}

/// Bulwark's configuration with named knobs; everything else is Bulwark's default unless
/// [`BulwarkConfig::set`] says otherwise.
#[derive(Clone, Debug)]
pub struct BulwarkConfig {
    /// The client listener (`127.0.0.1:0`: any free port, in-process only).
    pub listen: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    /// The certificate files.
    pub credentials: Credentials,
    /// The apiserver replicas.
    pub replicas: Vec<SocketAddr>,
    /// How clients' identities reach the apiservers.
    pub identity: IdentityMode,
    /// The rule folder; `None` is the built-in rules.
    pub rules: Option<PathBuf>,
    /// Whether the watch-fed cache runs (Bulwark's default: it does).
    pub cache: bool,
    /// Where the cache writes its audit log.
    pub audit: Option<PathBuf>,
    /// The drain's pause and grace period.
    pub shutdown: (Duration, Duration),
    /// One replica's heap headroom, for the LIST byte budget (Bulwark's default if `None`).
    pub heap_headroom: Option<u64>,
    settings: Vec<(String, String)>,
}

impl BulwarkConfig {
    /// Bulwark in front of `replicas` with `credentials`, listening on any free port, in
    /// front-proxy mode with the built-in rules and the cache on.
    pub fn new(credentials: Credentials, replicas: Vec<SocketAddr>) -> BulwarkConfig {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        BulwarkConfig {
            listen: any,
            admin: any,
            credentials,
            replicas,
            identity: IdentityMode::FrontProxy,
            rules: None,
            cache: true,
            audit: None,
            shutdown: (Duration::from_millis(100), Duration::from_secs(1)),
            heap_headroom: None,
            // Every simulated client, node and load generator connects from 127.0.0.1: no
            // per-source or per-prefix connection cap (a test of the caps sets them); the
            // prefix cap's default (8,000) would stop 7,500 nodes' 15,000 connections.
            settings: vec![
                ("listen.limits.maxConnectionsPerSource".into(), "0".into()),
                ("listen.limits.maxConnectionsPerPrefix".into(), "0".into()),
            ],
        }
    }

    /// Sets one more value, at a dotted path (`upstream.probeInterval`), as YAML (`200ms`).
    pub fn set(mut self, path: &str, yaml: &str) -> BulwarkConfig {
        self.settings.push((path.into(), yaml.into()));
        self
    }

    /// Probes, ejections and timeouts short enough for a test to watch a replica fail and
    /// come back.
    pub fn quick_failover(self) -> BulwarkConfig {
        self.set("upstream.probeInterval", "200ms")
            .set("upstream.ejectBase", "200ms")
            .set("upstream.ejectMax", "1s")
            .set(
                "upstream.timeouts",
                "{connect: 1s, read: 10s, list: 30s, write: 10s}",
            )
    }

    /// The configuration file's text.
    pub fn yaml(&self) -> String {
        let path = |p: &Path| Value::String(p.display().to_string());
        let c = &self.credentials;
        let mut upstream = json!({
            "replicas": self.replicas.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "ca": path(&c.upstream_ca),
            "frontProxy": {"cert": path(&c.front_proxy.0), "key": path(&c.front_proxy.1)},
            "self": {"cert": path(&c.own.0), "key": path(&c.own.1)},
        });
        if let Some(headroom) = self.heap_headroom {
            upstream["replicaHeapHeadroom"] = headroom.into();
        }
        let mode = match self.identity {
            IdentityMode::FrontProxy => "front-proxy",
            IdentityMode::Impersonate => "impersonate",
            IdentityMode::Passthrough => "passthrough",
        };
        let millis = |d: Duration| format!("{}ms", d.as_millis());
        let mut doc = json!({
            "listen": {
                "address": self.listen.to_string(),
                "cert": path(&c.serving.0),
                "key": path(&c.serving.1),
                "clientCA": path(&c.client_ca),
                "shutdown": {"pause": millis(self.shutdown.0), "grace": millis(self.shutdown.1)},
            },
            "admin": {"address": self.admin.to_string()},
            "upstream": upstream,
            "identity": {"mode": mode},
            "cache": {"enabled": self.cache},
        });
        if let Some(rules) = &self.rules {
            doc["rules"] = json!({"folder": path(rules)});
        }
        if let Some(audit) = &self.audit {
            doc["audit"] = json!({"path": path(audit)});
        }
        let mut doc = serde_norway::to_value(&doc).expect("a JSON value is YAML");
        for (at, yaml) in &self.settings {
            set_value(&mut doc, at, yaml);
        }
        serde_norway::to_string(&doc).expect("YAML serializes")
    }

    /// The configuration as Bulwark reads it (validated: a test configuration is valid).
    pub fn config(&self) -> Config {
        let yaml = self.yaml();
        yaml.parse()
            .unwrap_or_else(|e| panic!("the test configuration is invalid: {e}\n{yaml}"))
    }

    /// Writes the configuration file to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.yaml())
    }
}

/// `yaml` (a configuration or any YAML mapping) with each `(dotted path, YAML value)` set;
/// missing mappings on the way are created.
pub fn with_values(yaml: &str, values: &[(&str, &str)]) -> String {
    let mut doc: Yaml = serde_norway::from_str(yaml).expect("the configuration is YAML");
    for (at, value) in values {
        set_value(&mut doc, at, value);
    }
    serde_norway::to_string(&doc).expect("YAML serializes")
}

/// Sets the YAML `value` at the dotted path `at` (YAML, not JSON: `.nan` stays a number).
fn set_value(doc: &mut Yaml, at: &str, value: &str) {
    let value: Yaml = serde_norway::from_str(value)
        .unwrap_or_else(|e| panic!("the value of {at} is not YAML ({e}): {value}"));
    let mut node = doc;
    for key in at.split('.') {
        if !node.is_mapping() {
            *node = Yaml::Mapping(Default::default());
        }
        node = node
            .as_mapping_mut()
            .expect("a mapping")
            .entry(Yaml::String(key.into()))
            .or_insert(Yaml::Null);
    }
    *node = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_set_at_dotted_paths_creating_what_is_missing() {
        let yaml = with_values(
            "listen: {address: 127.0.0.1:1}\n",
            &[
                ("listen.limits.maxHeaderBytes", "10"),
                ("cache.enabled", "false"),
            ],
        );
        let doc: Value = serde_norway::from_str(&yaml).unwrap();
        assert!(
            yaml.find("listen").unwrap() < yaml.find("cache").unwrap(),
            "{yaml}"
        );
        assert_eq!(
            doc,
            json!({
                "listen": {"address": "127.0.0.1:1", "limits": {"maxHeaderBytes": 10}},
                "cache": {"enabled": false},
            })
        );
    }
}
