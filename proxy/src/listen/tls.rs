//! The serving TLS configuration: read the certificate, key and client CA files, check them,
//! build a rustls `ServerConfig`, and swap it in when the files change.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::{InconsistentKeys, RootCertStore, ServerConfig};
use sha2::{Digest, Sha256};

use super::ListenError;
use crate::config;
use crate::metrics::Metrics;

/// ALPN protocols offered to clients, most preferred first.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The files a serving configuration is built from.
#[derive(Debug, Clone)]
pub(super) struct TlsFiles {
    pub(super) cert: PathBuf,
    pub(super) key: PathBuf,
    pub(super) client_ca: Option<PathBuf>,
    /// The `certificate` label of its expiry metric (`serving`, `admin`).
    pub(super) role: &'static str,
}

impl TlsFiles {
    pub(super) fn from_config(cfg: &config::Listen) -> Self {
        Self {
            cert: cfg.cert.clone(),
            key: cfg.key.clone(),
            client_ca: cfg.client_ca.clone(),
            role: "serving",
        }
    }

    /// Every file, for watching.
    pub(super) fn paths(&self) -> impl Iterator<Item = &Path> {
        [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
    }
}

/// The contents of the files at one moment.
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

/// A digest of [`Contents`], so that a check can tell "changed" from "touched".
type Fingerprint = [u8; 32];

impl Contents {
    fn read(files: &TlsFiles) -> Result<Self, ListenError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| ListenError::Read {
                path: path.to_owned(),
                source,
            })
        };
        Ok(Self {
            cert: read(&files.cert)?,
            key: read(&files.key)?,
            client_ca: files.client_ca.as_deref().map(read).transpose()?,
        })
    }

    fn fingerprint(&self) -> Fingerprint {
        let mut hash = Sha256::new();
        // Length prefixes keep (cert, key) = ("ab", "c") apart from ("a", "bc").
        for part in [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()] {
            match part {
                Some(bytes) => {
                    hash.update((bytes.len() as u64 + 1).to_be_bytes());
                    hash.update(bytes);
                }
                None => hash.update(0u64.to_be_bytes()),
            }
        }
        hash.finalize().into()
    }
}

/// The live serving configuration: read by every accepted connection, replaced by reloads.
pub(super) struct TlsState {
    pub(super) files: TlsFiles,
    current: ArcSwap<ServerConfig>,
    /// The fingerprint of the contents last tried, good or bad, so that a bad file is
    /// reported once rather than at every check.
    last_seen: Mutex<Fingerprint>,
    /// Where the certificates in force say when they expire.
    metrics: Metrics,
}

impl TlsState {
    /// Reads and checks the files now; any problem is an error naming the file. The
    /// certificates' expiry goes to `metrics`, now and at every reload.
    pub(super) fn load(files: TlsFiles, metrics: Metrics) -> Result<Self, ListenError> {
        let contents = Contents::read(&files)?;
        let config = build(&files, &contents)?;
        record_expiry(&metrics, &files, &contents);
        Ok(Self {
            last_seen: Mutex::new(contents.fingerprint()),
            current: ArcSwap::from(config),
            files,
            metrics,
        })
    }

    /// The configuration for a handshake starting now.
    pub(super) fn current(&self) -> Arc<ServerConfig> {
        self.current.load_full()
    }

    /// Re-reads the files (blocking file I/O). Returns `Ok(true)` when a new configuration
    /// was swapped in, `Ok(false)` when the contents are those last tried, and an error when
    /// new contents are unusable; the previous configuration then stays in use.
    pub(super) fn check(&self) -> Result<bool, ListenError> {
        let contents = Contents::read(&self.files)?;
        let fingerprint = contents.fingerprint();
        {
            // A poisoned lock only means another check panicked mid-compare; the value is
            // still a plain array.
            let mut last = self
                .last_seen
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if *last == fingerprint {
                return Ok(false);
            }
            *last = fingerprint;
        }
        let config = build(&self.files, &contents)?;
        record_expiry(&self.metrics, &self.files, &contents);
        self.current.store(config);
        Ok(true)
    }
}

/// Publishes the expiry of the serving chain and of the client CA bundle in force (contents
/// that [`build`] accepted, so they parse).
fn record_expiry(metrics: &Metrics, files: &TlsFiles, contents: &Contents) {
    if let Ok(chain) = certificates(&files.cert, &contents.cert) {
        metrics.set_certificate_expiry(files.role, &chain);
    }
    if let (Some(path), Some(pem)) = (&files.client_ca, &contents.client_ca)
        && let Ok(bundle) = certificates(path, pem)
    {
        metrics.set_certificate_expiry("client_ca", &bundle);
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Builds a serving configuration: TLS 1.2 and 1.3, ALPN `h2` and `http/1.1`, client
/// certificates optional when a client CA is configured and not requested otherwise.
fn build(files: &TlsFiles, contents: &Contents) -> Result<Arc<ServerConfig>, ListenError> {
    let provider = provider();
    let chain = certificates(&files.cert, &contents.cert)?;
    if chain.is_empty() {
        return Err(ListenError::NoCertificate {
            path: files.cert.clone(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(&contents.key).map_err(|e| match e {
        pem::Error::NoItemsFound => ListenError::NoKey {
            path: files.key.clone(),
        },
        other => ListenError::Pem {
            path: files.key.clone(),
            message: other.to_string(),
        },
    })?;
    let signing_key = provider
        .key_provider
        .load_private_key(key)
        .map_err(|source| ListenError::BadKey {
            path: files.key.clone(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing_key);
    match certified.keys_match() {
        // ring exposes the public key of every key type it loads; "unknown" cannot be checked
        // and is accepted, as rustls itself does.
        Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => {}
        Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch)) => {
            return Err(ListenError::KeyMismatch {
                cert: files.cert.clone(),
                key: files.key.clone(),
            });
        }
        Err(source) => {
            return Err(ListenError::BadCertificate {
                path: files.cert.clone(),
                source,
            });
        }
    }

    let versions = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(ListenError::Tls)?;
    let builder = match (&files.client_ca, &contents.client_ca) {
        (Some(path), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            for ca in certificates(path, pem)? {
                roots.add(ca).map_err(|e| ListenError::ClientCa {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            }
            if roots.is_empty() {
                return Err(ListenError::ClientCa {
                    path: path.clone(),
                    message: "no PEM certificate in the file".into(),
                });
            }
            // Optional: token clients connect without a certificate; a certificate that is
            // presented must verify, or the handshake fails.
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| ListenError::ClientCa {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            versions.with_client_cert_verifier(verifier)
        }
        _ => versions.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(certified)));
    config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// Every certificate in a PEM file; other sections (keys, CRLs) are skipped.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, ListenError> {
    CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ListenError::Pem {
            path: path.to_owned(),
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, body: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, body).expect("write test file");
        path
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "bulwark-listen-tls-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    fn self_signed() -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        (cert.pem(), key.serialize_pem())
    }

    fn files(dir: &Path, cert: &[u8], key: &[u8], ca: Option<&[u8]>) -> TlsFiles {
        TlsFiles {
            cert: write(dir, "tls.crt", cert),
            key: write(dir, "tls.key", key),
            client_ca: ca.map(|ca| write(dir, "ca.crt", ca)),
            role: "serving",
        }
    }

    #[test]
    fn good_files_load_with_alpn() {
        let dir = temp_dir("good");
        let (cert, key) = self_signed();
        let state = TlsState::load(
            files(&dir, cert.as_bytes(), key.as_bytes(), None),
            Metrics::new(),
        )
        .expect("loads");
        assert_eq!(
            state.current().alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        assert!(!state.check().expect("unchanged files check fine"));
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn problems_name_the_file() {
        let dir = temp_dir("bad");
        let (cert, key) = self_signed();
        let (_, other_key) = self_signed();

        let err = TlsState::load(
            files(&dir, b"not pem", key.as_bytes(), None),
            Metrics::new(),
        )
        .err()
        .expect("no certificate");
        assert!(matches!(err, ListenError::NoCertificate { .. }), "{err}");
        assert!(err.to_string().contains("tls.crt"), "{err}");

        let err = TlsState::load(
            files(&dir, cert.as_bytes(), cert.as_bytes(), None),
            Metrics::new(),
        )
        .err()
        .expect("no key");
        assert!(matches!(err, ListenError::NoKey { .. }), "{err}");
        assert!(err.to_string().contains("tls.key"), "{err}");

        let err = TlsState::load(
            files(&dir, cert.as_bytes(), other_key.as_bytes(), None),
            Metrics::new(),
        )
        .err()
        .expect("mismatch");
        assert!(matches!(err, ListenError::KeyMismatch { .. }), "{err}");

        let broken = "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
        let err = TlsState::load(
            files(&dir, broken.as_bytes(), key.as_bytes(), None),
            Metrics::new(),
        )
        .err()
        .expect("bad base64");
        assert!(matches!(err, ListenError::Pem { .. }), "{err}");

        let err = TlsState::load(
            files(&dir, cert.as_bytes(), key.as_bytes(), Some(b"")),
            Metrics::new(),
        )
        .err()
        .expect("empty CA");
        assert!(matches!(err, ListenError::ClientCa { .. }), "{err}");
        assert!(err.to_string().contains("ca.crt"), "{err}");

        let missing = TlsFiles {
            cert: dir.join("absent.crt"),
            key: dir.join("absent.key"),
            client_ca: None,
            role: "serving",
        };
        let err = TlsState::load(missing, Metrics::new())
            .err()
            .expect("missing file");
        assert!(matches!(err, ListenError::Read { .. }), "{err}");
        assert!(err.to_string().contains("absent.crt"), "{err}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_bad_change_keeps_the_old_config_and_is_reported_once() {
        let dir = temp_dir("reload");
        let (cert, key) = self_signed();
        let files = files(&dir, cert.as_bytes(), key.as_bytes(), None);
        let state = TlsState::load(files.clone(), Metrics::new()).expect("loads");
        let before = state.current();

        std::fs::write(&files.key, b"garbage").expect("write");
        assert!(state.check().is_err());
        assert!(Arc::ptr_eq(&before, &state.current()));
        // Same bad contents: nothing new to say.
        assert!(!state.check().expect("already reported"));

        let (cert2, key2) = self_signed();
        std::fs::write(&files.cert, cert2).expect("write");
        std::fs::write(&files.key, key2).expect("write");
        assert!(state.check().expect("new files load"));
        assert!(!Arc::ptr_eq(&before, &state.current()));
        std::fs::remove_dir_all(dir).ok();
    }

    /// A self-signed certificate and key that expire at the start of `year`.
    fn expiring(year: i32) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        params.not_after = rcgen::date_time_ymd(year, 1, 1);
        let cert = params.self_signed(&key).expect("cert");
        (cert.pem(), key.serialize_pem())
    }

    fn expiry(metrics: &Metrics, certificate: &str) -> i64 {
        metrics
            .certificate_expiry_timestamp_seconds
            .with_label_values(&[certificate])
            .get()
    }

    #[test]
    fn expiry_of_the_certificates_in_force_is_published_and_follows_reloads() {
        const Y2030: i64 = 1_893_456_000;
        const Y2031: i64 = 1_924_992_000;
        let dir = temp_dir("expiry");
        let (cert, key) = expiring(2031);
        let (ca_2030, _) = expiring(2030);
        let (ca_2031, _) = expiring(2031);
        let bundle = format!("{ca_2031}{ca_2030}");
        let files = files(
            &dir,
            cert.as_bytes(),
            key.as_bytes(),
            Some(bundle.as_bytes()),
        );
        let metrics = Metrics::new();
        let state = TlsState::load(files.clone(), metrics.clone()).expect("loads");
        assert_eq!(expiry(&metrics, "serving"), Y2031);
        // A bundle is as good as its first certificate to expire.
        assert_eq!(expiry(&metrics, "client_ca"), Y2030);

        // Renewed: the new expiry. Broken: the expiry of what is still in force.
        let (cert, key) = expiring(2030);
        std::fs::write(&files.cert, cert).expect("write");
        std::fs::write(&files.key, key).expect("write");
        assert!(state.check().expect("new files load"));
        assert_eq!(expiry(&metrics, "serving"), Y2030);
        std::fs::write(&files.key, b"garbage").expect("write");
        assert!(state.check().is_err());
        assert_eq!(expiry(&metrics, "serving"), Y2030);
        std::fs::remove_dir_all(dir).ok();
    }
}
