//! `bulwark check-config`: every file a valid configuration names, read and checked the way
//! `serve` will use it, so that a missing or broken file is found before anything starts.
//!
//! Certificates and keys parse and each key is its certificate's; CAs parse and hold at
//! least one certificate; token files are readable and not empty; the rules folder loads
//! with the loader `serve` uses. Every problem is returned, each with the configuration
//! line of the field that names the file.

use std::fmt;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::{InconsistentKeys, RootCertStore};

use crate::config::Config;
use crate::rules::RuleSet;
use crate::rules::spans::Spans;

/// One problem with a file the configuration names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileProblem {
    /// The file the problem is in: the configuration (for a file it names that cannot be
    /// used) or a rule file.
    pub file: PathBuf,
    /// 1-based line in `file`; 0 when unknown.
    pub line: usize,
    /// 1-based column in `file`; 0 when not known.
    pub column: usize,
    /// What is wrong, starting with the field (`listen.cert: ...`) when in the configuration.
    pub message: String,
}

impl fmt::Display for FileProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.line, self.column) {
            (0, _) => write!(f, "{}: {}", self.file.display(), self.message),
            (line, 0) => write!(f, "{}:{line}: {}", self.file.display(), self.message),
            (line, column) => write!(
                f,
                "{}:{line}:{column}: {}",
                self.file.display(),
                self.message
            ),
        }
    }
}

/// The line of a dotted field (`upstream.replicas[1]`) in the configuration text; 0 when it
/// cannot be found.
pub fn field_line(text: &str, field: &str) -> usize {
    let path: Vec<String> = field
        .split('.')
        .flat_map(|part| {
            let mut pieces = part.split('[');
            let key = pieces.next().unwrap_or_default().to_owned();
            std::iter::once(key).chain(pieces.map(|p| p.trim_end_matches(']').to_owned()))
        })
        .collect();
    Spans::parse(text).find(&path).line
}

/// Reads and checks every file `config` names (paths already resolved, as
/// [`Config::load`] leaves them). `config_path` and `text` are the configuration's file and
/// text, for positions.
pub fn check(config: &Config, config_path: &Path, text: &str) -> Vec<FileProblem> {
    let mut problems = Vec::new();
    let spans = Spans::parse(text);
    let mut add = |field: &str, message: String| {
        let path: Vec<&str> = field.split('.').collect();
        problems.push(FileProblem {
            file: config_path.to_owned(),
            line: spans.find(&path).line,
            column: 0,
            message: format!("{field}: {message}"),
        });
    };

    let listen = &config.listen;
    cert_and_key(
        ("listen.cert", &listen.cert),
        ("listen.key", &listen.key),
        &mut add,
    );
    if let Some(ca) = &listen.client_ca {
        ca_file("listen.clientCA", ca, &mut add);
    }
    ca_file("upstream.ca", &config.upstream.ca, &mut add);
    if let Some(front_proxy) = &config.upstream.front_proxy {
        cert_and_key(
            ("upstream.frontProxy.cert", &front_proxy.cert),
            ("upstream.frontProxy.key", &front_proxy.key),
            &mut add,
        );
    }
    let own = &config.upstream.own;
    if let (Some(cert), Some(key)) = (&own.cert, &own.key) {
        cert_and_key(
            ("upstream.self.cert", cert),
            ("upstream.self.key", key),
            &mut add,
        );
    }
    if let Some(token) = &own.token_file {
        token_file("upstream.self.tokenFile", token, &mut add);
    }
    if let Some(token) = &config.admin.token_file {
        token_file("admin.tokenFile", token, &mut add);
    }
    if let Some(service) = config
        .fleet
        .as_ref()
        .and_then(|f| f.kubernetes_service.as_ref())
    {
        in_cluster_serving(config, service, &mut add);
    }
    if let Some(tls) = &config.admin.tls {
        cert_and_key(
            ("admin.tls.cert", &tls.cert),
            ("admin.tls.key", &tls.key),
            &mut add,
        );
    }
    let logs = [
        ("audit.path", config.audit.path.as_deref()),
        (
            "accessLog.path",
            config.access_log.as_ref().map(|a| a.path.as_path()),
        ),
    ];
    for (field, path) in logs {
        let folder = path
            .and_then(|p| p.parent())
            .filter(|p| !p.as_os_str().is_empty());
        if let Some(folder) = folder.filter(|f| !f.is_dir()) {
            add(
                field,
                format!("the folder {} does not exist", folder.display()),
            );
        }
    }
    if let Some(folder) = &config.rules.folder
        && let Err(rule_problems) = RuleSet::load_dir(folder)
    {
        if !folder.is_dir() {
            add(
                "rules.folder",
                format!("{} is not a readable folder", folder.display()),
            );
        } else {
            problems.extend(rule_problems.into_iter().map(|p| FileProblem {
                file: p.file,
                line: p.line,
                column: p.column,
                message: p.message,
            }));
        }
    }
    problems
}

/// Reads a file whole, or says why it cannot be read.
fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Every certificate of a PEM file, each parsed as X.509; at least one.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: bad PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{}: no PEM certificate in the file",
            path.display()
        ));
    }
    for (i, cert) in certs.iter().enumerate() {
        x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| {
            format!(
                "{}: certificate {} of the file does not parse: {e}",
                path.display(),
                i + 1
            )
        })?;
    }
    Ok(certs)
}

/// A certificate chain and its key: both parse, and the key is the leaf's.
fn cert_and_key(
    (cert_field, cert_path): (&str, &Path),
    (key_field, key_path): (&str, &Path),
    add: &mut impl FnMut(&str, String),
) {
    let chain = read(cert_path).and_then(|pem| certificates(cert_path, &pem));
    let provider = rustls::crypto::ring::default_provider();
    let key = read(key_path).and_then(|pem| {
        let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => format!(
                "{}: no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file",
                key_path.display()
            ),
            other => format!("{}: bad PEM: {other}", key_path.display()),
        })?;
        provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| format!("{}: unusable private key: {e}", key_path.display()))
    });
    match (chain, key) {
        (Ok(chain), Ok(key)) => match CertifiedKey::new(chain, key).keys_match() {
            Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => {}
            Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch)) => add(
                key_field,
                format!(
                    "{} does not hold the private key of the certificate in {}",
                    key_path.display(),
                    cert_path.display()
                ),
            ),
            Err(e) => add(
                cert_field,
                format!("{}: unusable certificate: {e}", cert_path.display()),
            ),
        },
        (chain, key) => {
            if let Err(e) = chain {
                add(cert_field, e);
            }
            if let Err(e) = key {
                add(key_field, e);
            }
        }
    }
}

/// A CA bundle: at least one certificate, each usable as a trust anchor.
fn ca_file(field: &str, path: &Path, add: &mut impl FnMut(&str, String)) {
    let result = read(path)
        .and_then(|pem| certificates(path, &pem))
        .and_then(|certs| {
            let mut roots = RootCertStore::empty();
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| format!("{}: unusable CA certificate: {e}", path.display()))?;
            }
            Ok(())
        });
    if let Err(e) = result {
        add(field, e);
    }
}

/// With `fleet.kubernetesService`, pods dial Bulwark as the `kubernetes` Service and check
/// its certificate against the CA of `kube-root-ca.crt` (the cluster CA, which signs the
/// apiservers' serving certificates: `upstream.ca`) for the name they dialed: the
/// serving certificate must hold for each of the Service's names and its ClusterIP.
fn in_cluster_serving(
    config: &Config,
    service: &crate::config::KubernetesService,
    add: &mut impl FnMut(&str, String),
) {
    let cert_path = &config.listen.cert;
    let Ok(chain) = read(cert_path).and_then(|pem| certificates(cert_path, &pem)) else {
        return; // listen.cert's own check says why
    };
    let Ok(cas) = read(&config.upstream.ca).and_then(|pem| certificates(&config.upstream.ca, &pem))
    else {
        return; // upstream.ca's own check says why
    };
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(cas);
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let Ok(verifier) =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider).build()
    else {
        return;
    };
    let (leaf, intermediates) = chain.split_first().expect("at least one certificate");
    let names =
        crate::certs::in_cluster_names(&service.service_ip.to_string(), &service.cluster_domain);
    let mut missing = Vec::new();
    for name in &names {
        let Ok(server_name) = rustls::pki_types::ServerName::try_from(name.as_str()) else {
            continue;
        };
        use rustls::client::danger::ServerCertVerifier as _;
        let verdict = verifier.verify_server_cert(
            leaf,
            intermediates,
            &server_name,
            &[],
            rustls::pki_types::UnixTime::now(),
        );
        match verdict {
            Ok(_) => {}
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => missing.push(name.as_str()),
            Err(e) => {
                add(
                    "listen.cert",
                    format!(
                        "{}: pods dialing the kubernetes Service check it against the cluster CA \
                         (upstream.ca, which kube-root-ca.crt carries) and would refuse it: {e}",
                        cert_path.display()
                    ),
                );
                return;
            }
        }
    }
    if !missing.is_empty() {
        add(
            "listen.cert",
            format!(
                "{}: pods dial the kubernetes Service by names this certificate does not hold: \
                 {} (bulwark certs init --in-cluster {} makes one that does)",
                cert_path.display(),
                missing.join(", "),
                service.service_ip
            ),
        );
    }
}

/// A bearer token file: readable and not empty.
fn token_file(field: &str, path: &Path, add: &mut impl FnMut(&str, String)) {
    match std::fs::read_to_string(path) {
        Ok(token) if token.trim().is_empty() => {
            add(field, format!("{} is empty", path.display()));
        }
        Ok(_) => {}
        Err(e) => add(field, format!("cannot read {}: {e}", path.display())),
    }
}
