//! The client side of Bulwark's TLS to the apiservers: one rustls config per credential and
//! protocol, built once from the configured PEM files (ring provider only).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use http::HeaderValue;
use rustls::ClientConfig;
use rustls::crypto::ring;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::{UpstreamCredential, UpstreamError};
use crate::config;
use crate::metrics::{Metrics, earliest_not_after};

/// ALPN protocol id of HTTP/2.
const ALPN_H2: &[u8] = b"h2";
/// ALPN protocol id of HTTP/1.1, used only for upgrades (exec, attach, port-forward).
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The wire protocol a connection is opened for; each has its own ALPN offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alpn {
    /// Pooled HTTP/2 connections.
    H2,
    /// One HTTP/1.1 connection per upgrade.
    Http1,
}

/// The TLS settings of every upstream credential, built from `config::Upstream`.
///
/// Holds, for each credential Bulwark has, a rustls client config offering `h2` and one
/// offering `http/1.1`, all trusting only the configured apiserver CA.
#[derive(Clone)]
pub struct UpstreamTls {
    front_proxy: Option<Configs>,
    own: Configs,
    anonymous: Configs,
    own_token: Option<Arc<TokenFile>>,
    /// When each certificate read expires: `upstream_ca`, `front_proxy`, `own`.
    expiry: Vec<(&'static str, i64)>,
}

/// The pair of client configs of one credential.
#[derive(Clone)]
struct Configs {
    h2: Arc<ClientConfig>,
    http1: Arc<ClientConfig>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("front_proxy", &self.front_proxy.is_some())
            .field("own_token", &self.own_token.is_some())
            .finish_non_exhaustive()
    }
}

impl UpstreamTls {
    /// Reads the CA, the front-proxy certificate and key, and Bulwark's own certificate and
    /// key (or notes its token file) as configured.
    pub fn from_config(cfg: &config::Upstream) -> Result<Self, UpstreamError> {
        let (roots, ca_expiry) = read_roots(&cfg.ca)?;
        let mut expiry: Vec<(&'static str, i64)> =
            ca_expiry.map(|t| ("upstream_ca", t)).into_iter().collect();
        let mut client_cert = |name: &'static str, cert: &Path, key: &Path| {
            let (certs, key) = read_cert_key(cert, key)?;
            expiry.extend(earliest_not_after(&certs).map(|t| (name, t)));
            Configs::new(&roots, Some((certs, key)))
        };
        let front_proxy = match &cfg.front_proxy {
            Some(fp) => Some(client_cert("front_proxy", &fp.cert, &fp.key)?),
            None => None,
        };
        let own = match (&cfg.own.cert, &cfg.own.key) {
            (Some(cert), Some(key)) => client_cert("own", cert, key)?,
            _ => Configs::new(&roots, None)?,
        };
        let anonymous = Configs::new(&roots, None)?;
        let own_token = cfg
            .own
            .token_file
            .as_ref()
            .map(|path| Arc::new(TokenFile::new(path.clone())));
        Ok(Self {
            front_proxy,
            own,
            anonymous,
            own_token,
            expiry,
        })
    }

    /// Publishes when the upstream CA bundle and the client certificates expire (read once
    /// at start: a renewed one takes a restart).
    pub fn record_expiry(&self, metrics: &Metrics) {
        for (certificate, not_after) in &self.expiry {
            metrics
                .certificate_expiry_timestamp_seconds
                .with_label_values(&[certificate])
                .set(*not_after);
        }
    }

    /// The client config for a credential and protocol, or an error when that credential
    /// was not configured.
    pub(crate) fn client_config(
        &self,
        credential: UpstreamCredential,
        alpn: Alpn,
    ) -> Result<Arc<ClientConfig>, UpstreamError> {
        let configs = match credential {
            UpstreamCredential::FrontProxy => self
                .front_proxy
                .as_ref()
                .ok_or(UpstreamError::MissingCredential(credential))?,
            UpstreamCredential::Own => &self.own,
            UpstreamCredential::Anonymous => &self.anonymous,
        };
        Ok(match alpn {
            Alpn::H2 => configs.h2.clone(),
            Alpn::Http1 => configs.http1.clone(),
        })
    }

    /// The `Authorization` value of Bulwark's own identity when it is a token file rather
    /// than a client certificate.
    pub(crate) fn own_bearer(&self) -> Result<Option<HeaderValue>, UpstreamError> {
        match &self.own_token {
            Some(file) => file.bearer().map(Some),
            None => Ok(None),
        }
    }
}

impl Configs {
    fn new(
        roots: &rustls::RootCertStore,
        client_auth: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    ) -> Result<Self, UpstreamError> {
        let build = |alpn: &[u8]| -> Result<Arc<ClientConfig>, UpstreamError> {
            let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|source| UpstreamError::Rustls {
                    what: "TLS versions",
                    source,
                })?
                .with_root_certificates(roots.clone());
            let mut config = match &client_auth {
                Some((certs, key)) => builder
                    .with_client_auth_cert(certs.clone(), key.clone_key())
                    .map_err(|source| UpstreamError::Rustls {
                        what: "client certificate",
                        source,
                    })?,
                None => builder.with_no_client_auth(),
            };
            config.alpn_protocols = vec![alpn.to_vec()];
            Ok(Arc::new(config))
        };
        Ok(Self {
            h2: build(ALPN_H2)?,
            http1: build(ALPN_HTTP1)?,
        })
    }
}

/// The CA bundle that must sign the apiservers' serving certificates, and when the first of
/// them expires.
fn read_roots(path: &Path) -> Result<(rustls::RootCertStore, Option<i64>), UpstreamError> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(file_error(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(file_error(path))?;
    let expiry = earliest_not_after(&certs);
    for cert in certs {
        roots.add(cert).map_err(file_error(path))?;
    }
    if roots.is_empty() {
        return Err(UpstreamError::Config(format!(
            "{}: no CA certificate in the file",
            path.display()
        )));
    }
    Ok((roots, expiry))
}

/// A certificate chain and its private key.
fn read_cert_key(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), UpstreamError> {
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(file_error(cert))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(file_error(cert))?;
    if certs.is_empty() {
        return Err(UpstreamError::Config(format!(
            "{}: no certificate in the file",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(file_error(key))?;
    Ok((certs, key))
}

/// The error for a file that cannot be used, keeping why.
fn file_error<E: std::error::Error + Send + Sync + 'static>(
    path: &Path,
) -> impl FnOnce(E) -> UpstreamError + '_ {
    move |source| UpstreamError::File {
        path: path.to_owned(),
        source: Arc::new(source),
    }
}

/// A bearer token file (a projected ServiceAccount token), re-read when its modification
/// time changes because the kubelet rotates it in place.
struct TokenFile {
    path: PathBuf,
    cached: Mutex<Option<(SystemTime, HeaderValue)>>,
}

impl TokenFile {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            cached: Mutex::new(None),
        }
    }

    fn bearer(&self) -> Result<HeaderValue, UpstreamError> {
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .map_err(file_error(&self.path))?;
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, value)) = cached.as_ref()
            && *at == modified
        {
            return Ok(value.clone());
        }
        let token = std::fs::read_to_string(&self.path).map_err(file_error(&self.path))?;
        let mut value =
            HeaderValue::from_str(&format!("Bearer {}", token.trim())).map_err(|_| {
                UpstreamError::Config(format!(
                    "{}: the token holds characters a header cannot carry",
                    self.path.display()
                ))
            })?;
        value.set_sensitive(true);
        *cached = Some((modified, value.clone()));
        Ok(value)
    }
}
