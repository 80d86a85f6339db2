//! The load clients: one identity per client, HTTP/2 over rustls (ring) with a client
//! certificate, latency in HDR histograms, bytes counted without decoding bodies.
//!
//! The same code talks to every target; only the address and the CA differ, so nothing here
//! can special-case Bulwark.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hdrhistogram::Histogram;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use crate::report;

/// Why a client could not be built or connected.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A PEM certificate or key could not be read.
    #[error("bad PEM: {0}")]
    Pem(String),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// TCP connect, TLS handshake or HTTP/2 handshake failed.
    #[error("connect {addr}: {message}")]
    Connect {
        /// Where to.
        addr: SocketAddr,
        /// What went wrong.
        message: String,
    },
}

pub use bulwark_controlplane::Target;

/// One client identity: a client certificate with CN = user and O = its class, or, for a
/// client inside the cluster, a ServiceAccount token.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Certificate chain, PEM (empty for an in-cluster client).
    pub cert_pem: String,
    /// Private key, PEM (empty for an in-cluster client).
    pub key_pem: String,
    /// A client inside the cluster, as `rest.InClusterConfig()` makes one.
    pub in_cluster: Option<InCluster>,
}

/// How a pod's client reaches the apiservers: a bearer token, no client certificate, and
/// the `kubernetes` Service's ClusterIP as the name it verifies, whichever endpoint
/// kube-proxy sends its connection to (the target's address).
#[derive(Clone, Debug)]
pub struct InCluster {
    /// The ServiceAccount token.
    pub token: String,
    /// The name the serving certificate is checked for (`KUBERNETES_SERVICE_HOST`).
    pub server_name: std::net::IpAddr,
    /// The address its connections come from: its node's, so that per-source bounds see
    /// one node's pods as one source, as in a cluster (`None`: the host's own).
    pub source: Option<std::net::IpAddr>,
}

impl Identity {
    /// A client certificate identity.
    pub fn certificate(cert_pem: String, key_pem: String) -> Identity {
        Identity {
            cert_pem,
            key_pem,
            in_cluster: None,
        }
    }

    /// A pod's identity: its token, checking the serving certificate for `server_name`.
    pub fn in_cluster(token: String, server_name: std::net::IpAddr) -> Identity {
        Identity {
            cert_pem: String::new(),
            key_pem: String::new(),
            in_cluster: Some(InCluster {
                token,
                server_name,
                source: None,
            }),
        }
    }

    /// The same pod, its connections from `source` (its node's address).
    pub fn from_source(mut self, source: std::net::IpAddr) -> Identity {
        if let Some(pod) = &mut self.in_cluster {
            pod.source = Some(source);
        }
        self
    }
}

/// A connected (or reconnecting) HTTP/2 client for one identity. Clones share the
/// connection, so one identity can hold several streams (an informer and its watches).
#[derive(Clone)]
pub struct Client {
    target: Target,
    tls: TlsConnector,
    sender: Option<SendRequest<Full<Bytes>>>,
    accept: &'static str,
    /// An in-cluster client's `Authorization` and the name its TLS checks.
    in_cluster: Option<(http::HeaderValue, ServerName<'static>)>,
    /// Where its connections come from, when not the host's own address.
    source: Option<std::net::IpAddr>,
}

/// What kubelet and most client-go programs send: protobuf first, JSON for the rest.
pub const PROTOBUF_FIRST: &str = "application/vnd.kubernetes.protobuf,application/json";

/// The result of one request, as the scenario statistics count it.
#[derive(Debug)]
pub enum Outcome {
    /// A 2xx answer, read to the end.
    Ok {
        /// Body bytes received.
        bytes: u64,
        /// Request sent → last body byte.
        latency: Duration,
        /// The body, when it was asked for (small answers only).
        body: Option<Bytes>,
    },
    /// A 429, with the wait its `Retry-After` asks for.
    Rejected {
        /// How long to wait before the next request.
        retry_after: Duration,
        /// Bulwark's `X-Bulwark-Reason` (`rate_limited`, `queue_full`, ...), if it sent one.
        reason: Option<String>,
    },
    /// Anything else: another status, a reset, a timeout, a connection failure.
    Error(String),
}

/// How the body of an answer is consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// Count the bytes and drop them (LISTs of any size).
    Count,
    /// Keep the body (small answers the scenario needs, e.g. a write's resourceVersion).
    Keep,
    /// Count the bytes but keep the first [`HEAD_BYTES`] (a list's `metadata`).
    Head,
}

/// How much of a body [`Read::Head`] keeps.
pub const HEAD_BYTES: usize = 4096;

/// client-go's wait when a 429 carries no usable `Retry-After`.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Longest `Retry-After` honoured, so that a run stays bounded.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(32);

fn tls_connector(target: &Target, identity: &Identity) -> Result<TlsConnector, ClientError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(target.ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| ClientError::Pem(format!("CA: {e}")))?;
        roots.add(cert)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = if identity.in_cluster.is_some() {
        builder.with_no_client_auth()
    } else {
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| ClientError::Pem(format!("client certificate: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes())
            .map_err(|e| ClientError::Pem(format!("client key: {e}")))?;
        builder.with_client_auth_cert(chain, key)?
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

impl Client {
    /// A client for this identity; it connects on its first request.
    pub fn new(target: &Target, identity: &Identity) -> Result<Client, ClientError> {
        let in_cluster = match &identity.in_cluster {
            Some(pod) => {
                let mut bearer = http::HeaderValue::try_from(format!("Bearer {}", pod.token))
                    .map_err(|e| ClientError::Pem(format!("token: {e}")))?;
                bearer.set_sensitive(true);
                Some((bearer, ServerName::IpAddress(pod.server_name.into())))
            }
            None => None,
        };
        Ok(Client {
            target: target.clone(),
            tls: tls_connector(target, identity)?,
            sender: None,
            accept: "application/json",
            in_cluster,
            source: identity.in_cluster.as_ref().and_then(|pod| pod.source),
        })
    }

    /// The same client asking for `accept` (default: `application/json`).
    pub fn with_accept(mut self, accept: &'static str) -> Client {
        self.accept = accept;
        self
    }

    /// Opens the HTTP/2 connection now, unless one is open.
    pub async fn connect(&mut self) -> Result<(), ClientError> {
        if let Some(sender) = &self.sender
            && !sender.is_closed()
        {
            return Ok(());
        }
        self.sender = None;
        let addr = self.target.addr;
        let fail = |message: String| ClientError::Connect { addr, message };
        let tcp = match self.source {
            Some(source) => {
                let socket = match source {
                    std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
                    std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
                }
                .and_then(|s| s.bind(SocketAddr::new(source, 0)).map(|()| s))
                .map_err(|e| fail(format!("binding {source}: {e}")))?;
                socket.connect(addr).await
            }
            None => TcpStream::connect(addr).await,
        }
        .map_err(|e| fail(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let name = match &self.in_cluster {
            Some((_, name)) => name.clone(),
            None => ServerName::IpAddress(addr.ip().into()),
        };
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| fail(format!("TLS: {e}")))?;
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .adaptive_window(true)
            .max_frame_size(1 << 20)
            .handshake(TokioIo::new(tls))
            .await
            .map_err(|e| fail(format!("HTTP/2: {e}")))?;
        // The connection task ends when the server closes it or every sender is dropped.
        tokio::spawn(conn);
        self.sender = Some(sender);
        Ok(())
    }

    /// Sends a request and returns its response head; the caller reads the body.
    pub async fn start(
        &mut self,
        method: Method,
        path: &str,
        body: Option<(Bytes, &'static str)>,
    ) -> Result<http::Response<Incoming>, String> {
        self.connect().await.map_err(|e| e.to_string())?;
        let Some(sender) = self.sender.as_mut() else {
            return Err("not connected".into());
        };
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("https://{}{path}", self.target.addr))
            .header(http::header::ACCEPT, self.accept);
        if let Some((bearer, _)) = &self.in_cluster {
            builder = builder.header(http::header::AUTHORIZATION, bearer.clone());
        }
        let body = match body {
            Some((bytes, content_type)) => {
                builder = builder.header(http::header::CONTENT_TYPE, content_type);
                bytes
            }
            None => Bytes::new(),
        };
        let request = builder.body(Full::new(body)).map_err(|e| e.to_string())?;
        if let Err(e) = sender.ready().await {
            self.sender = None;
            return Err(format!("connection closed: {e}"));
        }
        match sender.send_request(request).await {
            Ok(response) => Ok(response),
            Err(e) => {
                if sender.is_closed() {
                    self.sender = None;
                }
                Err(e.to_string())
            }
        }
    }

    /// Sends a request, reads its answer and classifies it; gives up after `timeout`.
    pub async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: Option<(Bytes, &'static str)>,
        read: Read,
        timeout: Duration,
    ) -> Outcome {
        let started = Instant::now();
        let exchange = async {
            let response = self.start(method, path, body).await?;
            let status = response.status();
            if status == StatusCode::TOO_MANY_REQUESTS {
                let retry_after = retry_after(response.headers());
                let reason = bulwark_reason(response.headers());
                // Drain the Status body so the stream closes cleanly.
                let _ = response.into_body().collect().await;
                return Ok(Outcome::Rejected {
                    retry_after,
                    reason,
                });
            }
            let mut body = response.into_body();
            let mut bytes = 0u64;
            let mut kept = BytesMut::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| format!("body: {e}"))?;
                if let Some(data) = frame.data_ref() {
                    bytes += data.len() as u64;
                    let room = match read {
                        _ if !status.is_success() => usize::MAX,
                        Read::Keep => usize::MAX,
                        Read::Head => HEAD_BYTES.saturating_sub(kept.len()),
                        Read::Count => 0,
                    };
                    kept.extend_from_slice(&data[..data.len().min(room)]);
                }
            }
            if !status.is_success() {
                let text = String::from_utf8_lossy(&kept[..kept.len().min(200)]).into_owned();
                return Ok(Outcome::Error(format!("{status}: {text}")));
            }
            Ok(Outcome::Ok {
                bytes,
                latency: started.elapsed(),
                body: (read != Read::Count).then(|| kept.freeze()),
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(message)) => Outcome::Error(message),
            Err(_) => Outcome::Error(format!("timed out after {timeout:?}")),
        }
    }

    /// Starts a watch (or any streaming GET): the response when it is a 2xx, else the
    /// outcome to count.
    pub async fn stream(&mut self, path: &str, timeout: Duration) -> Result<Lines, Outcome> {
        let response =
            match tokio::time::timeout(timeout, self.start(Method::GET, path, None)).await {
                Ok(Ok(response)) => response,
                Ok(Err(message)) => return Err(Outcome::Error(message)),
                Err(_) => return Err(Outcome::Error("watch head timed out".into())),
            };
        let status = response.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Err(Outcome::Rejected {
                retry_after: retry_after(response.headers()),
                reason: bulwark_reason(response.headers()),
            });
        }
        if !status.is_success() {
            return Err(Outcome::Error(format!("watch: {status}")));
        }
        let framing = match response.headers().get(http::header::CONTENT_TYPE) {
            Some(t)
                if t.as_bytes()
                    .starts_with(b"application/vnd.kubernetes.protobuf") =>
            {
                Framing::LengthPrefixed
            }
            _ => Framing::Lines,
        };
        Ok(Lines {
            body: response.into_body(),
            buf: BytesMut::new(),
            framing,
            bytes: 0,
        })
    }
}

/// Bulwark's reason for answering by itself (`X-Bulwark-Reason`).
fn bulwark_reason(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("x-bulwark-reason")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The wait a 429 asks for, as client-go reads `Retry-After` (whole seconds), bounded.
pub fn retry_after(headers: &http::HeaderMap) -> Duration {
    headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_RETRY_AFTER)
        .min(MAX_RETRY_AFTER)
}

/// How a watch stream separates its events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// JSON: one event per line.
    Lines,
    /// Protobuf (`;stream=watch`): each event after its 4-byte big-endian length.
    LengthPrefixed,
}

/// A watch stream, split into events without copying the body twice.
pub struct Lines {
    body: Incoming,
    buf: BytesMut,
    framing: Framing,
    bytes: u64,
}

impl Lines {
    /// The next complete event (a line without its newline, or a frame without its
    /// length); `None` at a clean end of stream.
    pub async fn next(&mut self) -> Result<Option<Bytes>, String> {
        loop {
            if let Some(event) = self.split() {
                return Ok(Some(event));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(e.to_string()),
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.bytes += data.len() as u64;
                        self.buf.extend_from_slice(data);
                    }
                }
            }
        }
    }

    fn split(&mut self) -> Option<Bytes> {
        match self.framing {
            Framing::Lines => {
                let at = self.buf.iter().position(|&b| b == b'\n')?;
                let line = self.buf.split_to(at + 1).freeze();
                Some(line.slice(..at))
            }
            Framing::LengthPrefixed => {
                let len = u32::from_be_bytes(self.buf.get(..4)?.try_into().ok()?) as usize;
                if self.buf.len() < 4 + len {
                    return None;
                }
                let frame = self.buf.split_to(4 + len).freeze();
                Some(frame.slice(4..))
            }
        }
    }

    /// How the stream frames its events.
    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// Body bytes received since the last call.
    pub fn take_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.bytes)
    }
}

/// The pause after `failures` failures in a row: 100 ms doubling up to 5 s.
pub fn backoff(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(6);
    Duration::from_millis(100 << exp).min(Duration::from_secs(5))
}

/// Live counters of one class, read by the progress printer while the run goes on.
#[derive(Debug, Default)]
pub struct Live {
    /// Requests finished.
    pub requests: AtomicU64,
    /// 2xx answers.
    pub ok: AtomicU64,
    /// 429 answers.
    pub rejected: AtomicU64,
    /// Other failures.
    pub errors: AtomicU64,
    /// Body bytes of 2xx answers.
    pub bytes: AtomicU64,
}

/// One identity's own counts; merged into its class when the identity stops.
pub struct Tally {
    hist: Histogram<u64>,
    requests: u64,
    ok: u64,
    rejected: u64,
    /// The 429s by reason (see [`REASONS_KEPT`]).
    rejected_by: BTreeMap<String, u64>,
    errors: u64,
    last_error: Option<String>,
    /// Failures in a row, for the back-off.
    failures: u32,
    live: Arc<Live>,
}

impl Tally {
    /// Counts one outcome; returns how long the identity should pause before its next
    /// request: a 429's `Retry-After`, or after failures a back-off that doubles from
    /// 100 ms to 5 s (as client-go's reflectors back off), so that a dead replica is not
    /// hammered by the load tester itself.
    pub fn record(&mut self, outcome: &Outcome) -> Duration {
        self.requests += 1;
        self.live.requests.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Outcome::Ok { latency, bytes, .. } => {
                self.ok += 1;
                self.live.ok.fetch_add(1, Ordering::Relaxed);
                self.live.bytes.fetch_add(*bytes, Ordering::Relaxed);
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
                self.hist.saturating_record(micros.max(1));
                self.failures = 0;
                Duration::ZERO
            }
            Outcome::Rejected {
                retry_after,
                reason,
            } => {
                self.rejected += 1;
                count_reason(&mut self.rejected_by, reason.as_deref().unwrap_or("-"), 1);
                self.live.rejected.fetch_add(1, Ordering::Relaxed);
                *retry_after
            }
            Outcome::Error(message) => {
                self.errors += 1;
                if self.last_error.is_none() {
                    self.last_error = Some(message.clone());
                }
                self.live.errors.fetch_add(1, Ordering::Relaxed);
                self.failures = self.failures.saturating_add(1);
                backoff(self.failures)
            }
        }
    }

    /// Adds another tally of the same identity (from a parallel loop) to this one.
    pub fn merge(&mut self, other: Tally) {
        let _ = self.hist.add(&other.hist);
        self.requests += other.requests;
        self.ok += other.ok;
        self.rejected += other.rejected;
        for (reason, n) in other.rejected_by {
            count_reason(&mut self.rejected_by, &reason, n);
        }
        self.errors += other.errors;
        if self.last_error.is_none() {
            self.last_error = other.last_error;
        }
    }
}

/// The most distinct reasons a tally keeps apart; any further one counts as `other` (a
/// server could name its 429s any way it likes).
const REASONS_KEPT: usize = 16;

/// Adds `n` 429s of `reason` to `by`, keeping at most [`REASONS_KEPT`] reasons apart.
fn count_reason(by: &mut BTreeMap<String, u64>, reason: &str, n: u64) {
    let reason = if by.contains_key(reason) || by.len() < REASONS_KEPT {
        reason
    } else {
        "other"
    };
    *by.entry(reason.to_owned()).or_default() += n;
}

/// All identities of one class: live counters and, once they stop, their tallies.
pub struct ClassStats {
    /// Counters for progress lines.
    pub live: Arc<Live>,
    tallies: Mutex<Vec<Tally>>,
}

/// An empty latency histogram in microseconds.
pub fn new_histogram() -> Histogram<u64> {
    // 1 µs to 1 h at 3 significant digits; these bounds are valid, so this cannot fail.
    Histogram::new_with_bounds(1, 3_600_000_000, 3)
        .unwrap_or_else(|_| Histogram::new(3).expect("3 significant digits is valid"))
}

impl ClassStats {
    /// An empty class.
    pub fn new() -> Arc<ClassStats> {
        Arc::new(ClassStats {
            live: Arc::new(Live::default()),
            tallies: Mutex::new(Vec::new()),
        })
    }

    /// A tally for one more identity of this class.
    pub fn tally(&self) -> Tally {
        Tally {
            hist: new_histogram(),
            requests: 0,
            ok: 0,
            rejected: 0,
            rejected_by: BTreeMap::new(),
            errors: 0,
            last_error: None,
            failures: 0,
            live: self.live.clone(),
        }
    }

    /// Hands an identity's tally back when it stops.
    pub fn done(&self, tally: Tally) {
        if let Ok(mut tallies) = self.tallies.lock() {
            tallies.push(tally);
        }
    }

    /// One of the errors the class saw, to show what went wrong.
    pub fn sample_error(&self) -> Option<String> {
        let tallies = self.tallies.lock().ok()?;
        tallies.iter().find_map(|t| t.last_error.clone())
    }

    /// The class's figures over a run of `elapsed`.
    pub fn summary(&self, elapsed: Duration) -> report::Class {
        let tallies = match self.tallies.lock() {
            Ok(t) => t,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut hist = new_histogram();
        let mut class = report::Class::default();
        for t in tallies.iter() {
            let _ = hist.add(&t.hist);
            class.requests += t.requests;
            class.ok += t.ok;
            class.rejected += t.rejected;
            for (reason, n) in &t.rejected_by {
                count_reason(&mut class.rejected_by, reason, *n);
            }
            class.errors += t.errors;
            class.per_identity_ok.push(t.ok);
        }
        let ms = |q: f64| {
            if hist.is_empty() {
                0.0
            } else {
                hist.value_at_quantile(q) as f64 / 1000.0
            }
        };
        class.mean_ms = if hist.is_empty() {
            0.0
        } else {
            hist.mean() / 1000.0
        };
        class.p50_ms = ms(0.5);
        class.p99_ms = ms(0.99);
        class.p999_ms = ms(0.999);
        let secs = elapsed.as_secs_f64();
        class.rps = if secs > 0.0 {
            class.ok as f64 / secs
        } else {
            0.0
        };
        class
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulwark_sim::pki::Pki;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    type TestBody = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

    /// A tiny TLS HTTP/2 server that requires a client certificate: `/big` answers 1 MiB,
    /// `/busy` 429 with `Retry-After: 3`, `/watch` two lines in three frames, `/who` the
    /// client certificate count.
    async fn server(pki: &Pki) -> SocketAddr {
        let serving = pki.server_ca.server_cert(&["127.0.0.1"]);
        let chain = CertificateDer::pem_slice_iter(serving.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(serving.key_pem.as_bytes()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(pki.client_ca.cert_der()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .unwrap();
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                        let body: TestBody = match req.uri().path() {
                            "/big" => Full::new(Bytes::from(vec![b'x'; 1 << 20])).boxed(),
                            "/busy" => {
                                return Ok::<_, std::convert::Infallible>(
                                    http::Response::builder()
                                        .status(429)
                                        .header("retry-after", "3")
                                        .body(Full::new(Bytes::from("{}")).boxed())
                                        .unwrap(),
                                );
                            }
                            "/watch" => {
                                let frames = ["{\"a\":", "1}\n{\"b\"", ":2}\n"]
                                    .map(|s| Ok(Frame::data(Bytes::from(s))));
                                StreamBody::new(futures::stream::iter(frames)).boxed()
                            }
                            _ => Full::new(Bytes::from("nope")).boxed(),
                        };
                        let status = if req.uri().path() == "/missing" {
                            404
                        } else {
                            200
                        };
                        Ok(http::Response::builder().status(status).body(body).unwrap())
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        addr
    }

    fn client(pki: &Pki, addr: SocketAddr) -> Client {
        let ck = pki.client_ca.client_cert("storm-0", &["storm"]);
        let target = Target {
            addr,
            ca_pem: pki.server_ca.cert_pem(),
        };
        let identity = Identity::certificate(ck.cert_pem, ck.key_pem);
        Client::new(&target, &identity).unwrap()
    }

    #[tokio::test]
    async fn counts_bytes_classifies_statuses_and_splits_watch_lines() {
        let pki = Pki::new();
        let addr = server(&pki).await;
        let mut c = client(&pki, addr);
        let t = Duration::from_secs(5);
        match c.call(Method::GET, "/big", None, Read::Count, t).await {
            Outcome::Ok { bytes, body, .. } => {
                assert_eq!(bytes, 1 << 20);
                assert!(body.is_none(), "counted bodies are not kept");
            }
            other => panic!("{other:?}"),
        }
        match c.call(Method::GET, "/big", None, Read::Head, t).await {
            Outcome::Ok { bytes, body, .. } => {
                assert_eq!(bytes, 1 << 20);
                assert_eq!(body.unwrap().len(), HEAD_BYTES);
            }
            other => panic!("{other:?}"),
        }
        match c.call(Method::GET, "/busy", None, Read::Count, t).await {
            Outcome::Rejected { retry_after, .. } => {
                assert_eq!(retry_after, Duration::from_secs(3))
            }
            other => panic!("{other:?}"),
        }
        match c.call(Method::GET, "/missing", None, Read::Count, t).await {
            Outcome::Error(message) => assert!(message.starts_with("404"), "{message}"),
            other => panic!("{other:?}"),
        }
        let mut lines = c
            .stream("/watch", t)
            .await
            .map_err(|o| format!("{o:?}"))
            .unwrap();
        assert_eq!(
            lines.next().await.unwrap().unwrap(),
            Bytes::from("{\"a\":1}")
        );
        assert_eq!(
            lines.next().await.unwrap().unwrap(),
            Bytes::from("{\"b\":2}")
        );
        assert_eq!(lines.next().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_refused_connection_is_an_error_not_a_panic() {
        let pki = Pki::new();
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let mut c = client(&pki, addr);
        match c
            .call(Method::GET, "/", None, Read::Count, Duration::from_secs(2))
            .await
        {
            Outcome::Error(message) => assert!(message.contains("connect"), "{message}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_follows_the_header_within_bounds() {
        let mut h = http::HeaderMap::new();
        assert_eq!(retry_after(&h), Duration::from_secs(1));
        h.insert(http::header::RETRY_AFTER, "4".parse().unwrap());
        assert_eq!(retry_after(&h), Duration::from_secs(4));
        h.insert(http::header::RETRY_AFTER, "3600".parse().unwrap());
        assert_eq!(retry_after(&h), Duration::from_secs(32));
        h.insert(http::header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&h), Duration::from_secs(1));
    }

    #[test]
    fn failures_back_off_exponentially_and_success_resets() {
        assert_eq!(backoff(1), Duration::from_millis(100));
        assert_eq!(backoff(2), Duration::from_millis(200));
        assert_eq!(backoff(6), Duration::from_millis(3200));
        assert_eq!(backoff(7), Duration::from_secs(5));
        assert_eq!(backoff(1000), Duration::from_secs(5));
        let class = ClassStats::new();
        let mut t = class.tally();
        let fail = Outcome::Error("reset".into());
        assert_eq!(t.record(&fail), Duration::from_millis(100));
        assert_eq!(t.record(&fail), Duration::from_millis(200));
        let ok = Outcome::Ok {
            bytes: 1,
            latency: Duration::from_millis(1),
            body: None,
        };
        assert_eq!(t.record(&ok), Duration::ZERO);
        assert_eq!(t.record(&fail), Duration::from_millis(100));
    }

    /// The class keeps its 429s apart by the reason each gave, and at most
    /// `REASONS_KEPT` reasons apart whatever a server names them.
    #[test]
    fn a_class_counts_its_429s_by_reason() {
        let class = ClassStats::new();
        let refused = |reason: Option<&str>| Outcome::Rejected {
            retry_after: Duration::from_secs(1),
            reason: reason.map(str::to_owned),
        };
        let mut a = class.tally();
        let mut b = class.tally();
        for _ in 0..3 {
            a.record(&refused(Some("rate_limited")));
        }
        a.record(&refused(Some("queue_full")));
        b.record(&refused(Some("rate_limited")));
        b.record(&refused(None));
        class.done(a);
        class.done(b);
        let summary = class.summary(Duration::from_secs(1));
        assert_eq!(summary.rejected, 6);
        assert_eq!(
            summary.rejected_by,
            BTreeMap::from([
                ("-".to_owned(), 1),
                ("queue_full".to_owned(), 1),
                ("rate_limited".to_owned(), 4)
            ])
        );
        let mut many = class.tally();
        for i in 0..40 {
            many.record(&refused(Some(&format!("made-up-{i}"))));
        }
        assert_eq!(many.rejected_by.len(), REASONS_KEPT + 1);
        assert_eq!(many.rejected_by["other"], 40 - REASONS_KEPT as u64);
    }

    #[test]
    fn class_summary_merges_identities() {
        let class = ClassStats::new();
        let mut a = class.tally();
        let mut b = class.tally();
        for ms in [1, 2, 3] {
            a.record(&Outcome::Ok {
                bytes: 10,
                latency: Duration::from_millis(ms),
                body: None,
            });
        }
        assert_eq!(
            b.record(&Outcome::Rejected {
                retry_after: Duration::from_secs(2),
                reason: None,
            }),
            Duration::from_secs(2)
        );
        b.record(&Outcome::Error("reset".into()));
        class.done(a);
        class.done(b);
        let s = class.summary(Duration::from_secs(3));
        assert_eq!((s.requests, s.ok, s.rejected, s.errors), (5, 3, 1, 1));
        assert_eq!(s.per_identity_ok, vec![3, 0]);
        assert!((s.rps - 1.0).abs() < 1e-9);
        assert!((s.p50_ms - 2.0).abs() < 0.01, "{}", s.p50_ms);
        assert!((s.p99_ms - 3.0).abs() < 0.01, "{}", s.p99_ms);
        assert_eq!(class.live.requests.load(Ordering::Relaxed), 5);
    }
}
