//! `bulwark certs init`: a development PKI and ready kubeconfigs, all ECDSA P-256.
//!
//! Mints, into one folder:
//!
//! | file | what |
//! |---|---|
//! | `ca.crt`, `ca.key` | the development CA: signs Bulwark's serving certificate and every client certificate below |
//! | `client-ca.crt` | the CA Bulwark trusts for client certificates (`listen.clientCA`); here the development CA, in production the cluster's client CA |
//! | `bulwark.crt`, `bulwark.key` | Bulwark's serving certificate for the `--server-name`s |
//! | `front-proxy-ca.crt`, `front-proxy-ca.key` | the front-proxy (request-header) CA, for the apiserver's `--requestheader-client-ca-file` |
//! | `front-proxy-client.crt`, `.key` | Bulwark's front-proxy client certificate |
//! | `bulwark-client.crt`, `.key` | Bulwark's own client certificate (reviews, informers, probes) |
//! | `user-NAME.crt`, `.key`, `kubeconfig-NAME` | per `--identity`: a client certificate and a kubeconfig pointing at Bulwark |
//!
//! CAs already in the folder are reused, so running it again adds identities or renews the
//! leaf certificates without invalidating what was handed out. Every file is written to a
//! temporary name and renamed, so a running Bulwark that watches its files never reads half
//! of one; keys and kubeconfigs are created readable by their owner only.

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use apimachinery::client_cert;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256,
    PublicKeyData, SanType,
};
use x509_parser::time::ASN1Time;

/// Why the PKI could not be minted.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// An `--identity` argument is not `USER[:GROUP,GROUP]`.
    #[error("identity {0:?}: {1}")]
    BadIdentity(String, &'static str),
    /// A `--server-name` is neither an IP address nor a DNS name.
    #[error("server name {0:?} is neither an IP address nor a DNS name")]
    BadServerName(String),
    /// No `--server-name` was given.
    #[error("at least one --server-name is needed")]
    NoServerName,
    /// Two identities would write the same files.
    #[error("identities {0:?} and {1:?} would write the same files (user-{2}.*)")]
    DuplicateIdentity(String, String, String),
    /// A CA in the folder cannot be reused.
    #[error("{path}: cannot reuse this CA: {reason}")]
    BadCa {
        /// The certificate or key file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The validity is zero days.
    #[error("--days must be at least 1")]
    NoValidity,
    /// Key generation or signing failed.
    #[error("minting a certificate: {0}")]
    Mint(#[from] rcgen::Error),
    /// A client certificate could not be assembled or signed.
    #[error("minting a client certificate: {0}")]
    ClientCert(#[from] apimachinery::client_cert::ClientCertError),
    /// A kubeconfig could not be encoded.
    #[error("encoding a kubeconfig: {0}")]
    Kubeconfig(#[from] serde_norway::Error),
}

/// The options of `bulwark certs init`.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Folder for the certificates, keys and kubeconfigs (created when missing).
    pub dir: PathBuf,
    /// The names clients use to reach Bulwark: DNS names or IP addresses (the first is the
    /// serving certificate's CN and the kubeconfigs' host).
    pub server_names: Vec<String>,
    /// The users to mint a client certificate and kubeconfig for.
    pub identities: Vec<IdentitySpec>,
    /// The server URL written into the kubeconfigs. Default: `https://FIRST-NAME:6443`.
    pub server: Option<String>,
    /// CN of the front-proxy client certificate (must be in the apiserver's
    /// `--requestheader-allowed-names`).
    pub front_proxy_name: String,
    /// Bulwark's own identity.
    pub self_identity: IdentitySpec,
    /// Validity of the leaf certificates in days (CAs get ten times as long).
    pub days: u32,
}

impl InitOptions {
    /// Options with the CLI's defaults for everything but the folder and the names.
    pub fn new(dir: impl Into<PathBuf>, server_names: &[&str]) -> InitOptions {
        InitOptions {
            dir: dir.into(),
            server_names: server_names.iter().map(|s| s.to_string()).collect(),
            identities: Vec::new(),
            server: None,
            front_proxy_name: "front-proxy-client".into(),
            self_identity: IdentitySpec {
                user: "bulwark".into(),
                groups: vec!["bulwark:proxies".into()],
            },
            days: 365,
        }
    }
}

/// The names an in-cluster client may dial the apiservers by: the `kubernetes` Service's
/// DNS names in the cluster domain (`cluster.local` unless the cluster says otherwise)
/// and its ClusterIP (`KUBERNETES_SERVICE_HOST`, which `rest.InClusterConfig()` dials). A
/// serving certificate in front of pods must name them all.
pub fn in_cluster_names(service_ip: &str, cluster_domain: &str) -> Vec<String> {
    vec![
        "kubernetes".into(),
        "kubernetes.default".into(),
        "kubernetes.default.svc".into(),
        format!("kubernetes.default.svc.{cluster_domain}"),
        service_ip.into(),
    ]
}

/// A user and its groups, as a client certificate carries them (CN and one `O` per group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentitySpec {
    /// The user name (CN).
    pub user: String,
    /// The groups (`O` values).
    pub groups: Vec<String>,
}

impl FromStr for IdentitySpec {
    type Err = CertsError;

    /// Parses `USER[:GROUP,GROUP]`. Kubernetes user names of the forms
    /// `system:serviceaccount:NS:NAME`, `system:node:NAME` and `system:NAME` contain colons
    /// themselves, so a user starting with `system:` takes that many segments first.
    fn from_str(s: &str) -> Result<Self, CertsError> {
        let bad = |why| CertsError::BadIdentity(s.to_string(), why);
        let segments: Vec<&str> = s.split(':').collect();
        let user_segments = match segments.as_slice() {
            ["system", "serviceaccount", ..] => 4,
            ["system", "node", ..] => 3,
            ["system", ..] => 2,
            _ => 1,
        };
        if segments.len() < user_segments {
            return Err(bad("a system: user is missing a segment"));
        }
        let user = segments[..user_segments].join(":");
        if segments[..user_segments].iter().any(|p| p.is_empty()) {
            return Err(bad("the user name has an empty segment"));
        }
        let groups = if segments.len() > user_segments {
            let rest = segments[user_segments..].join(":");
            rest.split(',').map(str::to_string).collect::<Vec<_>>()
        } else {
            Vec::new()
        };
        if groups.iter().any(String::is_empty) {
            return Err(bad("a group is empty"));
        }
        Ok(IdentitySpec { user, groups })
    }
}

impl fmt::Display for IdentitySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.user)?;
        if !self.groups.is_empty() {
            write!(f, ":{}", self.groups.join(","))?;
        }
        Ok(())
    }
}

/// What [`init`] wrote.
#[derive(Debug, Default)]
pub struct Minted {
    /// Every file written, in order.
    pub written: Vec<PathBuf>,
    /// CA files found in the folder and reused.
    pub reused: Vec<PathBuf>,
}

impl fmt::Display for Minted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for path in &self.reused {
            writeln!(f, "reused  {}", path.display())?;
        }
        for path in &self.written {
            writeln!(f, "wrote   {}", path.display())?;
        }
        Ok(())
    }
}

/// Mints the development PKI and the kubeconfigs into `options.dir` (see the module docs).
pub fn init(options: &InitOptions) -> Result<Minted, CertsError> {
    let first_name = options
        .server_names
        .first()
        .ok_or(CertsError::NoServerName)?;
    let sans = options
        .server_names
        .iter()
        .map(|name| san(name))
        .collect::<Result<Vec<_>, _>>()?;
    if options.days == 0 {
        return Err(CertsError::NoValidity);
    }
    let files = identity_files(&options.identities)?;
    let dir = &options.dir;
    std::fs::create_dir_all(dir).map_err(|source| CertsError::Io {
        path: dir.clone(),
        source,
    })?;

    let validity = Validity::days(options.days);
    let ca_validity = Validity::days(options.days.saturating_mul(10));
    let mut out = Minted::default();

    let ca = load_or_create_ca(dir, "ca", "bulwark-development-ca", &ca_validity, &mut out)?;
    out.write(dir, "client-ca.crt", &ca.cert_pem, false)?;
    let serving = serving_cert(&ca, first_name, sans, &validity)?;
    out.write_pair(dir, "bulwark", &serving)?;

    let front_proxy_ca = load_or_create_ca(
        dir,
        "front-proxy-ca",
        "bulwark-front-proxy-ca",
        &ca_validity,
        &mut out,
    )?;
    let front_proxy = client_cert(&front_proxy_ca, &options.front_proxy_name, &[], &validity)?;
    out.write_pair(dir, "front-proxy-client", &front_proxy)?;

    let own = client_cert(
        &ca,
        &options.self_identity.user,
        &options.self_identity.groups,
        &validity,
    )?;
    out.write_pair(dir, "bulwark-client", &own)?;

    let server = options
        .server
        .clone()
        .unwrap_or_else(|| default_server(first_name));
    for (identity, file) in options.identities.iter().zip(files) {
        let cert = client_cert(&ca, &identity.user, &identity.groups, &validity)?;
        out.write_pair(dir, &format!("user-{file}"), &cert)?;
        let kubeconfig = kubeconfig(&server, &ca.cert_pem, &identity.user, &cert)?;
        out.write(dir, &format!("kubeconfig-{file}"), &kubeconfig, true)?;
    }
    Ok(out)
}

/// The default kubeconfig server: the first name on the apiserver's usual port.
fn default_server(name: &str) -> String {
    match name.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => format!("https://[{ip}]:6443"),
        _ => format!("https://{name}:6443"),
    }
}

/// The file name part for each identity; two identities may not share one.
fn identity_files(identities: &[IdentitySpec]) -> Result<Vec<String>, CertsError> {
    let mut files: Vec<String> = Vec::with_capacity(identities.len());
    for (i, identity) in identities.iter().enumerate() {
        let file = file_safe(&identity.user);
        if let Some(j) = files.iter().position(|f| *f == file) {
            return Err(CertsError::DuplicateIdentity(
                identities[j].user.clone(),
                identities[i].user.clone(),
                file,
            ));
        }
        files.push(file);
    }
    Ok(files)
}

/// A user name as a file name: anything but letters, digits, `.`, `_` and `-` becomes `-`.
fn file_safe(user: &str) -> String {
    user.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

fn san(name: &str) -> Result<SanType, CertsError> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '*')
        });
    if !valid {
        return Err(CertsError::BadServerName(name.to_string()));
    }
    name.to_string()
        .try_into()
        .map(SanType::DnsName)
        .map_err(|_| CertsError::BadServerName(name.to_string()))
}

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct CertKey {
    /// The certificate.
    pub cert_pem: String,
    /// The PKCS#8 private key.
    pub key_pem: String,
}

impl fmt::Debug for CertKey {
    /// Never prints the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertKey").finish_non_exhaustive()
    }
}

/// A CA that signs: its certificate and an issuer built on its key.
struct Ca {
    cert_pem: String,
    cert_der: Vec<u8>,
    issuer: Issuer<'static, KeyPair>,
}

/// A validity window in Unix seconds, starting an hour ago so that clocks a little behind
/// still accept fresh certificates.
struct Validity {
    not_before: i64,
    not_after: i64,
}

impl Validity {
    fn days(days: u32) -> Validity {
        let now = ASN1Time::now().timestamp();
        Validity {
            not_before: now - 3600,
            not_after: now + i64::from(days) * 86_400,
        }
    }

    fn apply(&self, params: &mut CertificateParams) -> Result<(), CertsError> {
        let at = |secs| {
            ASN1Time::from_timestamp(secs)
                .map(|t| t.to_datetime())
                .map_err(|_| CertsError::NoValidity)
        };
        params.not_before = at(self.not_before)?;
        params.not_after = at(self.not_after)?;
        Ok(())
    }
}

fn new_key() -> Result<KeyPair, CertsError> {
    Ok(KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?)
}

/// Reuses `NAME.crt` + `NAME.key` when both exist, else mints and writes a new CA.
fn load_or_create_ca(
    dir: &Path,
    name: &str,
    common_name: &str,
    validity: &Validity,
    out: &mut Minted,
) -> Result<Ca, CertsError> {
    let cert_path = dir.join(format!("{name}.crt"));
    let key_path = dir.join(format!("{name}.key"));
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => {
            let ca = load_ca(&cert_path, &key_path)?;
            out.reused.push(cert_path);
            Ok(ca)
        }
        (false, false) => {
            let mut params = CertificateParams::default();
            let mut dn = DistinguishedName::new();
            dn.push(DnType::CommonName, common_name);
            params.distinguished_name = dn;
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            validity.apply(&mut params)?;
            let key = new_key()?;
            let key_pem = key.serialize_pem();
            let certified = CertifiedIssuer::self_signed(params, key)?;
            let cert_pem = certified.pem();
            out.write_pair(dir, name, &CertKey { cert_pem, key_pem })?;
            load_ca(&cert_path, &key_path)
        }
        (cert, _) => Err(CertsError::BadCa {
            path: if cert { key_path } else { cert_path },
            reason: "missing, while its pair exists; restore it or remove both".into(),
        }),
    }
}

fn load_ca(cert_path: &Path, key_path: &Path) -> Result<Ca, CertsError> {
    let read = |path: &Path| {
        std::fs::read_to_string(path).map_err(|source| CertsError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let bad = |path: &Path, reason: String| CertsError::BadCa {
        path: path.to_path_buf(),
        reason,
    };
    let cert_pem = read(cert_path)?;
    let key_pem = read(key_path)?;
    let key = KeyPair::from_pem(&key_pem).map_err(|e| bad(key_path, e.to_string()))?;
    let der = rustls_pemfile::certs(&mut cert_pem.as_bytes())
        .next()
        .ok_or_else(|| bad(cert_path, "no certificate in the file".into()))?
        .map_err(|e| bad(cert_path, e.to_string()))?;
    let (_, parsed) =
        x509_parser::parse_x509_certificate(&der).map_err(|e| bad(cert_path, e.to_string()))?;
    if parsed.public_key().raw != key.subject_public_key_info().as_slice() {
        return Err(bad(
            key_path,
            "the key does not belong to the certificate".into(),
        ));
    }
    let issuer = Issuer::from_ca_cert_der(&der, key).map_err(|e| bad(cert_path, e.to_string()))?;
    Ok(Ca {
        cert_pem,
        cert_der: der.to_vec(),
        issuer,
    })
}

fn serving_cert(
    ca: &Ca,
    common_name: &str,
    sans: Vec<SanType>,
    validity: &Validity,
) -> Result<CertKey, CertsError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.subject_alt_names = sans;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    validity.apply(&mut params)?;
    let key = new_key()?;
    let cert = params.signed_by(&key, &ca.issuer)?;
    Ok(CertKey {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A client certificate as the apiserver reads it: CN = user, one `O` per group, client
/// authentication only.
fn client_cert(
    ca: &Ca,
    user: &str,
    groups: &[String],
    validity: &Validity,
) -> Result<CertKey, CertsError> {
    let key = new_key()?;
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let subject = client_cert::Subject {
        user,
        groups: &groups,
        not_before: validity.not_before,
        not_after: validity.not_after,
    };
    let der = client_cert::issue(&ca.cert_der, ca.issuer.key(), &key, &subject)?;
    Ok(CertKey {
        cert_pem: client_cert::pem(&der),
        key_pem: key.serialize_pem(),
    })
}

/// A kubeconfig with the CA, the client certificate and its key embedded.
fn kubeconfig(
    server: &str,
    ca_pem: &str,
    user: &str,
    cert: &CertKey,
) -> Result<String, CertsError> {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "bulwark",
            "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)},
        }],
        "users": [{
            "name": user,
            "user": {
                "client-certificate-data": b64(&cert.cert_pem),
                "client-key-data": b64(&cert.key_pem),
            },
        }],
        "contexts": [{"name": user, "context": {"cluster": "bulwark", "user": user}}],
        "current-context": user,
    });
    Ok(serde_norway::to_string(&config)?)
}

impl Minted {
    /// Writes `NAME.key` then `NAME.crt`: a watcher that reloads on the certificate's change
    /// then finds the matching key already in place.
    fn write_pair(&mut self, dir: &Path, name: &str, pair: &CertKey) -> Result<(), CertsError> {
        self.write(dir, &format!("{name}.key"), &pair.key_pem, true)?;
        self.write(dir, &format!("{name}.crt"), &pair.cert_pem, false)
    }

    fn write(
        &mut self,
        dir: &Path,
        name: &str,
        contents: &str,
        secret: bool,
    ) -> Result<(), CertsError> {
        let path = dir.join(name);
        write_atomically(&path, contents.as_bytes(), secret).map_err(|source| CertsError::Io {
            path: path.clone(),
            source,
        })?;
        self.written.push(path);
        Ok(())
    }
}

/// Writes to a temporary file beside `path` and renames it over `path`; a secret is
/// created with mode 0600 before any byte is in it.
fn write_atomically(path: &Path, contents: &[u8], secret: bool) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    // A stale temporary file would keep its old mode; start from nothing.
    let _ = std::fs::remove_file(&tmp);
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        open.mode(if secret { 0o600 } else { 0o644 });
    }
    let mut file = open.open(&tmp)?;
    file.write_all(contents)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests;
