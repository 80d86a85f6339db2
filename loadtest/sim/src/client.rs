//! Client-side helpers for tests and tools: a rustls client config trusting the fleet, a
//! one-shot HTTPS request, and kubeconfig text for kubectl and kube-rs.

use std::net::SocketAddr;
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::pki::{CertKey, Pki};

/// A client TLS config trusting `pki.server_ca`, optionally presenting `cert`, offering
/// these ALPN protocols (e.g. `[b"h2"]`, `[b"http/1.1"]`).
pub fn tls_config(
    pki: &Pki,
    cert: Option<&CertKey>,
    alpn: &[&[u8]],
) -> crate::error::Result<ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.server_ca.cert_der())?;
    let b = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut cfg = match cert {
        Some(ck) => {
            let chain = rustls_pemfile::certs(&mut ck.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()?;
            let key = rustls_pemfile::private_key(&mut ck.key_pem.as_bytes())?
                .ok_or(crate::error::Error::NoKey)?;
            b.with_client_auth_cert(chain, key)?
        }
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(cfg)
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers.
    pub headers: http::HeaderMap,
    /// Body bytes (still compressed if the server compressed them).
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (Null when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Sends one request on a fresh connection (HTTP/2 when `cfg` offers h2, else HTTP/1.1) and
/// reads the whole response.
pub async fn request(
    addr: SocketAddr,
    cfg: &ClientConfig,
    req: http::Request<Bytes>,
) -> crate::error::Result<Reply> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = TlsConnector::from(Arc::new(cfg.clone()))
        .connect(ServerName::try_from("localhost")?, tcp)
        .await?;
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let (parts, body) = req.into_parts();
    let mut req = http::Request::from_parts(parts, Full::new(body));
    let resp = if h2 {
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(tls),
        )
        .await?;
        tokio::spawn(conn);
        send.send_request(req).await?
    } else {
        if !req.headers().contains_key(http::header::HOST) {
            req.headers_mut().insert(
                http::header::HOST,
                http::HeaderValue::from_static("localhost"),
            );
        }
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        send.send_request(req).await?
    };
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// A GET of `path_and_query`.
pub async fn get(
    addr: SocketAddr,
    cfg: &ClientConfig,
    path_and_query: &str,
) -> crate::error::Result<Reply> {
    let req = http::Request::get(format!("https://localhost{path_and_query}")).body(Bytes::new())?;
    request(addr, cfg, req).await
}

/// A kubeconfig for `server` (e.g. `https://127.0.0.1:PORT`) trusting the fleet's serving
/// CA and authenticating with `cert`.
pub fn kubeconfig(pki: &Pki, server: &str, cert: &CertKey) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: sim\n  cluster:\n    server: {server}\n    certificate-authority-data: {}\nusers:\n- name: sim\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: sim\n  context:\n    cluster: sim\n    user: sim\ncurrent-context: sim\n",
        b64(&pki.server_ca.cert_pem()),
        b64(&cert.cert_pem),
        b64(&cert.key_pem)
    )
}
