//! One GET over HTTP/1.1, with TLS verified against a given CA or in the clear: how the
//! command line reads a replica's admin listener and the fleet's Leases. A connection per
//! request: an operator's command makes a few.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{StatusCode, Uri};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};

/// The largest answer read: `/debug/*` pages and a namespace's Leases are far smaller.
const MAX_BODY: usize = 16 << 20;

/// Why a GET got no answer.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The URL is not `http(s)://HOST:PORT[/PATH]`.
    #[error("{0:?} is not an http:// or https:// URL")]
    Url(String),
    /// An https URL and no CA to verify it with.
    #[error("{0} is https and no CA verifies it: pass --admin-ca")]
    NoCa(String),
    /// The name to verify is not a DNS name or an IP address.
    #[error("{0:?} is not a name a certificate can carry")]
    ServerName(String),
    /// The TCP connection failed.
    #[error("unreachable: {0}")]
    Connect(std::io::Error),
    /// The TLS handshake failed (an unknown CA, a certificate for another name).
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    /// HTTP failed on the connection.
    #[error("{0}")]
    Http(#[from] hyper::Error),
    /// The request could not be built (a token that is no header value).
    #[error("the request could not be built: {0}")]
    Request(#[from] http::Error),
    /// The answer is larger than [`MAX_BODY`].
    #[error("the answer was cut short or is larger than {MAX_BODY} bytes: {0}")]
    Body(String),
    /// Nothing came back in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Where and how to GET: the TLS configuration for https, the name to verify, a token.
#[derive(Clone, Default)]
pub struct Dial {
    /// The client configuration for https URLs; `None`: https URLs are refused.
    pub tls: Option<Arc<ClientConfig>>,
    /// The name the certificate must carry (default: the URL's host).
    pub server_name: Option<String>,
    /// `Authorization: Bearer` this.
    pub bearer: Option<String>,
    /// The longest a request may take, connection and answer included.
    pub timeout: Duration,
}

/// GETs `path` under `base` (`https://host:port[/prefix]`): the status and the body.
pub async fn get(base: &str, path: &str, dial: &Dial) -> Result<(StatusCode, Bytes), FetchError> {
    let timeout = dial.timeout;
    tokio::time::timeout(timeout, get_now(base, path, dial))
        .await
        .map_err(|_| FetchError::Timeout(timeout))?
}

async fn get_now(base: &str, path: &str, dial: &Dial) -> Result<(StatusCode, Bytes), FetchError> {
    let bad = || FetchError::Url(base.to_owned());
    let uri: Uri = base.parse().map_err(|_| bad())?;
    let https = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => return Err(bad()),
    };
    let authority = uri.authority().ok_or_else(bad)?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
    let prefix = uri.path().trim_end_matches('/');
    let request = http::Request::get(format!("{prefix}{path}"))
        .header(http::header::HOST, authority.as_str())
        .header(http::header::ACCEPT, "application/json");
    let request = match &dial.bearer {
        Some(token) => request.header(http::header::AUTHORIZATION, format!("Bearer {token}")),
        None => request,
    }
    .body(Empty::<Bytes>::new())?;
    let tcp = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(FetchError::Connect)?;
    if !https {
        return exchange(tcp, request).await;
    }
    let tls = dial
        .tls
        .clone()
        .ok_or_else(|| FetchError::NoCa(base.to_owned()))?;
    let name = dial.server_name.as_deref().unwrap_or(host);
    let name = ServerName::try_from(name.to_owned())
        .map_err(|_| FetchError::ServerName(name.to_owned()))?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(FetchError::Tls)?;
    exchange(stream, request).await
}

async fn exchange<I>(
    io: I,
    request: http::Request<Empty<Bytes>>,
) -> Result<(StatusCode, Bytes), FetchError>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await?;
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| FetchError::Body(e.to_string()))?
        .to_bytes();
    Ok((status, body))
}

/// A client configuration that trusts the CA certificates of `pem`, presenting
/// `client` (certificate chain and key, PEM) when given.
pub fn client_config(
    pem: &[u8],
    client: Option<(&[u8], &[u8])>,
) -> Result<Arc<ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut &pem[..]) {
        let cert = cert.map_err(|e| format!("the CA does not read as PEM: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("a CA certificate is not usable: {e}"))?;
    }
    if roots.is_empty() {
        return Err("no CA certificate in it".into());
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
    let mut config = match client {
        Some((cert, key)) => {
            let chain = rustls_pemfile::certs(&mut &cert[..])
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("the client certificate does not read as PEM: {e}"))?;
            if chain.is_empty() {
                return Err("no certificate in the client certificate".into());
            }
            let key = rustls_pemfile::private_key(&mut &key[..])
                .map_err(|e| format!("the client key does not read as PEM: {e}"))?
                .ok_or("no private key in the client key")?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("the client certificate is not usable: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
