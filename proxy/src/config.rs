//! The configuration file of `bulwark serve`: its schema, parsing and validation, one
//! file per section under `config/`.
//!
//! Parse (serde, unknown fields are errors; addresses, durations, byte quantities, replica
//! addresses and group-resources become their types here, so no other module parses a
//! configured string again) → validate (every problem, each naming its field) → build (the
//! other modules turn these values into running parts). No I/O happens here except reading
//! the file itself in [`Config::load`], and this module imports no other of the crate.

mod admin;
mod cache;
mod fleet;
mod identity;
mod listen;
mod logs;
mod metrics;
mod problems;
mod rules;
mod upstream;
mod values;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use admin::{Admin, AdminLimits, AdminTls, MetricsAccess};
pub use cache::{Cache, ExcludedName, GroupResource};
pub use fleet::{Fleet, KubernetesService};
pub use identity::{Identity, IdentityMode, ReviewRate, TokenReview};
pub use listen::{Listen, ListenLimits, MAX_WORKERS, ProxyProtocol, Shutdown};
pub use logs::{AccessLog, Audit};
pub use metrics::{MAX_IDENTITY_LABELS, MetricsSettings};
pub use problems::{ConfigError, Problem};
pub use rules::{AnswerHeaders, Rules, RulesMode};
pub use upstream::{FrontProxy, HeaderNames, OwnCredential, ReplicaAddr, Timeouts, Upstream};
pub use values::Quantity;

use problems::Problems;

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Config {
    /// The client-facing TLS listener.
    pub listen: Listen,
    /// The admin listener: metrics, health and debug endpoints.
    #[serde(default)]
    pub admin: Admin,
    /// The kube-apiserver replicas and how Bulwark talks to them.
    pub upstream: Upstream,
    /// How clients are identified and how that identity is forwarded upstream.
    #[serde(default)]
    pub identity: Identity,
    /// Where the rule files live.
    #[serde(default)]
    pub rules: Rules,
    /// The watch-fed cache.
    #[serde(default)]
    pub cache: Cache,
    /// The audit log of reads answered by Bulwark itself.
    #[serde(default)]
    pub audit: Audit,
    /// The fleet of Bulwark replicas that share the apiservers' budgets through Leases;
    /// off when absent (each replica then takes a static `1/bulwarkReplicas`).
    #[serde(default)]
    pub fleet: Option<Fleet>,
    /// What the metrics may say of who is refused.
    #[serde(default)]
    pub metrics: MetricsSettings,
    /// One JSON line per request; off when absent.
    #[serde(default)]
    pub access_log: Option<AccessLog>,
}

impl Config {
    /// Reads, parses and validates a configuration file, then resolves every relative file
    /// path in it (certificates, keys, CA, token files, rules folder, audit log) against the
    /// file's own folder, so that a configuration works from any working directory. Whether
    /// those files exist is checked by the parts that load them.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config: Config = text.parse()?;
        if let Some(base) = path.parent() {
            config.resolve_paths(base);
        }
        Ok(config)
    }

    /// Makes every relative file path in the configuration relative to `base` instead.
    pub fn resolve_paths(&mut self, base: &Path) {
        let resolve = |path: &mut PathBuf| {
            if path.is_relative() {
                *path = base.join(&*path);
            }
        };
        resolve(&mut self.listen.cert);
        resolve(&mut self.listen.key);
        self.listen.client_ca.iter_mut().for_each(resolve);
        self.admin.token_file.iter_mut().for_each(resolve);
        resolve(&mut self.upstream.ca);
        if let Some(front_proxy) = &mut self.upstream.front_proxy {
            resolve(&mut front_proxy.cert);
            resolve(&mut front_proxy.key);
        }
        let own = &mut self.upstream.own;
        for path in [&mut own.cert, &mut own.key, &mut own.token_file] {
            path.iter_mut().for_each(resolve);
        }
        self.rules.folder.iter_mut().for_each(resolve);
        if let Some(fleet) = &mut self.fleet {
            fleet.key_file.iter_mut().for_each(resolve);
        }
        self.audit.path.iter_mut().for_each(resolve);
        self.identity
            .token_review
            .memory_file
            .iter_mut()
            .for_each(resolve);
        if let Some(tls) = &mut self.admin.tls {
            resolve(&mut tls.cert);
            resolve(&mut tls.key);
        }
        if let Some(access) = &mut self.access_log {
            resolve(&mut access.path);
        }
    }
}

impl std::str::FromStr for Config {
    type Err = ConfigError;

    /// Parses and validates configuration text; relative paths stay as written.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        // Values that parse into types (replica addresses, group-resources, header names)
        // set their problems aside rather than stop the parse, so that they are listed
        // with every other problem, each at its place among them.
        let (parsed, deferred) = problems::deferring(|| serde_norway::from_str::<Config>(text));
        let config = parsed.map_err(|e| {
            let location = e.location();
            ConfigError::Parse {
                line: location.as_ref().map(|l| l.line()),
                column: location.as_ref().map(|l| l.column()),
                message: e.to_string(),
            }
        })?;
        let problems = config.problems(deferred);
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

impl Config {
    /// Every semantic problem of a parsed configuration, each naming its field (empty when
    /// the configuration is valid).
    pub fn validate(&self) -> Vec<Problem> {
        self.problems(Vec::new())
    }

    /// The problems of each section in the file's order, with those set aside while
    /// parsing (`deferred`) among their section's.
    fn problems(&self, deferred: Vec<Problem>) -> Vec<Problem> {
        let mut p = Problems::new(deferred);
        self.listen.validate(&mut p);
        self.upstream.validate(&mut p);
        self.identity
            .validate(self.upstream.front_proxy.is_some(), &mut p);
        self.rules.validate(&mut p);
        self.cache.validate(&mut p);
        self.audit.validate(&mut p);
        if let Some(fleet) = &self.fleet {
            fleet.validate(&mut p);
        }
        if let Some(access) = &self.access_log {
            access.validate(&mut p);
        }
        self.metrics.validate(&mut p);
        self.admin
            .validate(self.listen.limits.reserved_file_descriptors, &mut p);
        p.into_list()
    }
}
