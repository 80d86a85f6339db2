//! The client-facing listener over real TLS on 127.0.0.1: client certificates, handshake and
//! header limits, certificate reload, the idle timeout, the GOAWAY chance, the drain, the
//! connection caps against silent sockets, and the admin listener's caps and timeouts.
//!
//! Each test mints its own PKI (rcgen, ECDSA) and serves a trivial service that answers
//! `200 ok` and records the [`ConnInfo`] of every request, so nothing here depends on the
//! rest of the proxy. Timeouts are short; waits for something that must happen are bounded
//! by [`PATIENCE`], which is never an assertion of speed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bulwark::config::{Listen, ListenLimits, Shutdown};
use bulwark::listen::{
    ConnInfo, Connections, DrainPhase, Handoff, ListenError, Listener, Reloader, Worker,
};
use bulwark::{Body, BoxError};
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// Upper bound on waiting for something that must happen soon.
const PATIENCE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// PKI
// ---------------------------------------------------------------------------------------

/// A certificate authority minted for one test.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    der: CertificateDer<'static>,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Result<Self> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        Ok(Self {
            der: cert.der().clone(),
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    fn server(&self) -> Result<Leaf> {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, "bulwark");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    fn client(&self, user: &str) -> Result<Leaf> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        params
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn expired_client(&self, user: &str) -> Result<Leaf> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Result<Leaf> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Leaf {
            der: cert.der().clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        })
    }
}

/// A certificate and its key.
struct Leaf {
    der: CertificateDer<'static>,
    cert_pem: String,
    key_pem: String,
    key_der: Vec<u8>,
}

impl Leaf {
    fn identity(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (
            vec![self.der.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
        )
    }
}

/// A folder removed when the test ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "bulwark-listen-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Serving files laid out the way Kubernetes mounts a Secret: `tls.crt -> ..data/tls.crt`,
/// `..data -> ..v1`, so that an update is a swap of the `..data` symlink.
struct SecretMount {
    dir: TempDir,
    version: usize,
}

impl SecretMount {
    fn new(server: &Leaf, client_ca: Option<&Ca>) -> Result<Self> {
        let dir = TempDir::new()?;
        let mut mount = Self { dir, version: 0 };
        mount.update(
            &server.cert_pem,
            &server.key_pem,
            client_ca.map(|ca| &ca.pem[..]),
        )?;
        for name in ["tls.crt", "tls.key", "ca.crt"] {
            std::os::unix::fs::symlink(format!("..data/{name}"), mount.dir.0.join(name))?;
        }
        Ok(mount)
    }

    /// Writes a new version folder and swaps `..data` to it atomically, as the kubelet does.
    fn update(&mut self, cert: &str, key: &str, ca: Option<&str>) -> Result<()> {
        self.version += 1;
        let version = format!("..v{}", self.version);
        let folder = self.dir.0.join(&version);
        std::fs::create_dir(&folder)?;
        std::fs::write(folder.join("tls.crt"), cert)?;
        std::fs::write(folder.join("tls.key"), key)?;
        std::fs::write(folder.join("ca.crt"), ca.unwrap_or(""))?;
        let tmp = self.dir.0.join("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp)?;
        std::fs::rename(&tmp, self.dir.0.join("..data"))?;
        Ok(())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }
}

// ---------------------------------------------------------------------------------------
// The server under test
// ---------------------------------------------------------------------------------------

fn limits() -> ListenLimits {
    ListenLimits {
        handshake_timeout: Duration::from_millis(500),
        header_read_timeout: Duration::from_millis(500),
        idle_timeout: Duration::from_secs(60),
        ..ListenLimits::default()
    }
}

fn listen_config(mount: &SecretMount, client_ca: bool, limits: ListenLimits) -> Listen {
    Listen {
        address: SocketAddr::from(([127, 0, 0, 1], 0)),
        cert: mount.path("tls.crt"),
        key: mount.path("tls.key"),
        client_ca: client_ca.then(|| mount.path("ca.crt")),
        limits,
        goaway_chance: 0.0,
        shutdown: Shutdown::default(),
        proxy_protocol: None,
        workers: 0,
    }
}

/// A running listener with the recording test service behind it.
struct Server {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<ConnInfo>>>,
    drain: watch::Sender<DrainPhase>,
    serve: JoinHandle<Result<(), ListenError>>,
    connections: Connections,
    reloader: Reloader,
    reload: Option<JoinHandle<()>>,
    handoff: Handoff,
    metrics: bulwark::metrics::Metrics,
}

impl Server {
    async fn start(cfg: &Listen, watch_files: bool) -> Result<Self> {
        Self::start_on(cfg, watch_files, 0).await
    }

    /// Serves on `workers` threads of its own, or on the test's runtime with 0.
    async fn start_on(cfg: &Listen, watch_files: bool, workers: usize) -> Result<Self> {
        let metrics = bulwark::metrics::Metrics::new();
        let listener = Listener::bind(cfg, &metrics).await?;
        let addr = listener.local_addr();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (drain, drain_rx) = watch::channel(DrainPhase::Serving);
        let reload = watch_files.then(|| listener.spawn_reload());
        let connections = listener.connections();
        let reloader = listener.reloader();
        let handoff = listener.handoff(test_service(seen.clone()), drain_rx.clone());
        let serve = if workers == 0 {
            tokio::spawn(listener.serve(test_service(seen.clone()), drain_rx))
        } else {
            let workers = (0..workers)
                .map(|_| Worker::new(test_service(seen.clone())))
                .collect::<Result<Vec<_>, _>>()?;
            tokio::spawn(listener.serve_on(workers, drain_rx))
        };
        Ok(Self {
            addr,
            seen,
            drain,
            serve,
            connections,
            reloader,
            reload,
            handoff,
            metrics,
        })
    }

    fn last_seen(&self) -> Option<ConnInfo> {
        self.seen.lock().ok()?.last().cloned()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.serve.abort();
        if let Some(reload) = &self.reload {
            reload.abort();
        }
    }
}

/// `/quiet`: one line, then a body that stays open and silent (a quiet watch).
/// `/ticks`: a line every 50 ms, forever. `/thread`: the name of the thread serving it.
/// Anything else: `200 ok`.
fn test_service(
    seen: Arc<Mutex<Vec<ConnInfo>>>,
) -> impl tower::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(move |req: Request<Incoming>| {
        let seen = seen.clone();
        async move {
            if let (Some(info), Ok(mut seen)) = (req.extensions().get::<ConnInfo>(), seen.lock()) {
                seen.push(info.clone());
            }
            let body: Body = match req.uri().path() {
                "/quiet" => StreamBody::new(
                    futures::stream::once(async { data("first\n") })
                        .chain(futures::stream::pending()),
                )
                .boxed_unsync(),
                "/ticks" => StreamBody::new(
                    tokio_stream_interval(Duration::from_millis(50)).map(|()| data("tick\n")),
                )
                .boxed_unsync(),
                "/thread" => bulwark::full(
                    std::thread::current()
                        .name()
                        .unwrap_or("unnamed")
                        .to_owned(),
                ),
                _ => bulwark::full("ok"),
            };
            Ok::<_, Infallible>(Response::new(body))
        }
    })
}

fn data(text: &'static str) -> Result<Frame<Bytes>, BoxError> {
    Ok(Frame::data(Bytes::from_static(text.as_bytes())))
}

fn tokio_stream_interval(period: Duration) -> impl futures::Stream<Item = ()> + Send {
    futures::stream::unfold(tokio::time::interval(period), |mut interval| async move {
        interval.tick().await;
        Some(((), interval))
    })
}

// ---------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------

fn client_tls(
    ca: &Ca,
    alpn: &[&[u8]],
    identity: Option<&Leaf>,
) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der.clone())?;
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots);
    let mut config = match identity {
        Some(leaf) => {
            let (chain, key) = leaf.identity();
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

async fn tls_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost")?;
    Ok(TlsConnector::from(config).connect(name, tcp).await?)
}

type H2Sender = hyper::client::conn::http2::SendRequest<Empty<Bytes>>;
type H1Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// An HTTP/2 client connection and the task driving it (it ends when the server closes or
/// sends GOAWAY with nothing left open).
async fn h2(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<(H2Sender, JoinHandle<hyper::Result<()>>)> {
    let tls = tls_connect(addr, config).await?;
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .handshake(TokioIo::new(tls))
        .await?;
    Ok((sender, tokio::spawn(conn)))
}

async fn h1(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<(H1Sender, JoinHandle<hyper::Result<()>>)> {
    let tls = tls_connect(addr, config).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    Ok((sender, tokio::spawn(conn)))
}

fn get(path: &str) -> Request<Empty<Bytes>> {
    let mut req = Request::new(Empty::new());
    *req.uri_mut() = format!("https://localhost{path}")
        .parse()
        .expect("valid test URI");
    req
}

fn get_h1(path: &str) -> Request<Empty<Bytes>> {
    let mut req = Request::new(Empty::new());
    *req.uri_mut() = path.parse().expect("valid test URI");
    req.headers_mut().insert(
        http::header::HOST,
        http::HeaderValue::from_static("localhost"),
    );
    req
}

/// Sends a GET over a fresh HTTP/2 connection and returns the status and body.
async fn fetch(addr: SocketAddr, config: Arc<rustls::ClientConfig>) -> Result<(StatusCode, Bytes)> {
    let (mut sender, _conn) = h2(addr, config).await?;
    let response = sender.send_request(get("/")).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// Reads the next data frame of a streaming response.
async fn next_data(body: &mut Incoming) -> Result<Bytes> {
    loop {
        match tokio::time::timeout(PATIENCE, body.frame()).await {
            Err(_) => bail!("no data within {PATIENCE:?}"),
            Ok(None) => bail!("stream ended"),
            Ok(Some(frame)) => {
                if let Ok(data) = frame?.into_data() {
                    return Ok(data);
                }
            }
        }
    }
}

/// Waits (bounded) for a raw socket to be closed by the server; returns what it sent first.
async fn closed_by_server(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut got = Vec::new();
    match tokio::time::timeout(PATIENCE, stream.read_to_end(&mut got)).await {
        Err(_) => bail!("connection still open after {PATIENCE:?}"),
        // A reset is as closed as an EOF.
        Ok(_) => Ok(got),
    }
}

/// A counter's value in the metrics' text (0 when it was never counted).
fn counted(metrics: &bulwark::metrics::Metrics, series: &str) -> u64 {
    metrics
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// A TCP connection to `addr` from `source` (any 127/8 address is this host's).
async fn connect_from(source: [u8; 4], addr: SocketAddr) -> Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    Ok(socket.connect(addr).await?)
}

/// Connects from `source` and waits (bounded) for the server to close the connection: a
/// connection refused at accept (a reset can beat the connect's own completion).
async fn refused_from(source: [u8; 4], addr: SocketAddr) -> Result<()> {
    match connect_from(source, addr).await {
        Ok(mut stream) => closed_by_server(&mut stream).await.map(drop),
        Err(error)
            if error
                .downcast_ref::<std::io::Error>()
                .map(std::io::Error::kind)
                == Some(std::io::ErrorKind::ConnectionReset) =>
        {
            Ok(())
        }
        Err(error) => Err(error),
    }
}

/// Waits (bounded) until the listener counts `n` connections open.
async fn until_open(connections: &Connections, n: usize) -> Result<()> {
    within(&format!("{n} connections open"), async {
        while connections.open() != n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// A GET of `/` over HTTP/2 on a connection already open.
async fn fetch_over(
    tcp: TcpStream,
    config: Arc<rustls::ClientConfig>,
) -> Result<(StatusCode, Bytes)> {
    let tls = TlsConnector::from(config)
        .connect(ServerName::try_from("localhost")?, tcp)
        .await?;
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .handshake(TokioIo::new(tls))
        .await?;
    let _conn = tokio::spawn(conn);
    let response = sender.send_request(get("/")).await?;
    let status = response.status();
    Ok((status, response.into_body().collect().await?.to_bytes()))
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(PATIENCE, fut)
        .await
        .with_context(|| format!("{what}: not within {PATIENCE:?}"))
}

// ---------------------------------------------------------------------------------------
// Connections handed over
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_handed_over_connection_is_served_as_its_peer_until_the_drain() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let server = Server::start(&listen_config(&mount, true, limits()), false).await?;
    let (client, served) = tokio::io::duplex(64 * 1024);
    let peer = SocketAddr::from(([192, 0, 2, 7], 40_000));
    let serving = tokio::spawn(server.handoff.serve(served, peer));

    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client)).await?;
    let _conn = tokio::spawn(conn);
    let response = sender.send_request(get("/")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.into_body().collect().await?.to_bytes(), "ok");
    let info = server.last_seen().context("service saw a request")?;
    assert_eq!(info.peer, peer, "the address the caller gave");
    assert!(info.client_chain.is_none(), "no TLS, no certificate");
    assert!(info.http2);

    // The drain ends it as it ends the listener's own connections.
    server.drain.send(DrainPhase::GoAway)?;
    within("the handed-over connection closed", serving).await??;
    assert!(sender.send_request(get("/")).await.is_err());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Client certificates
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn client_certificate_chain_reaches_the_service_and_token_clients_still_connect() -> Result<()>
{
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let server = Server::start(&listen_config(&mount, true, limits()), false).await?;

    let alice = ca.client("alice")?;
    let (status, body) = fetch(server.addr, client_tls(&ca, &[b"h2"], Some(&alice))?).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "ok");
    let info = server.last_seen().context("service saw a request")?;
    let chain = info.client_chain.context("client chain recorded")?;
    assert_eq!(chain[0], alice.der, "the leaf the client presented");
    assert!(info.http2);
    assert!(info.peer.ip().is_loopback());

    // A token client: no certificate, still served, no chain.
    let (mut sender, _conn) = h1(server.addr, client_tls(&ca, &[b"http/1.1"], None)?).await?;
    let response = sender.send_request(get_h1("/")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    let info = server.last_seen().context("service saw a request")?;
    assert!(info.client_chain.is_none());
    assert!(!info.http2);
    Ok(())
}

#[tokio::test]
async fn wrong_ca_and_expired_certificates_are_refused_and_others_still_served() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let other = Ca::new("someone-else")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let server = Server::start(&listen_config(&mount, true, limits()), false).await?;

    for (what, leaf) in [
        ("wrong CA", other.client("mallory")?),
        ("expired", ca.expired_client("old-alice")?),
    ] {
        // With TLS 1.3 the client learns of the refusal on its first read, so the
        // failure may surface in the handshake or in the request.
        let refused = fetch(server.addr, client_tls(&ca, &[b"h2"], Some(&leaf))?).await;
        assert!(
            refused.is_err(),
            "{what} certificate was served: {refused:?}"
        );
    }
    assert!(
        server.seen.lock().map(|s| s.is_empty()).unwrap_or(false),
        "no refused client reached the service"
    );

    let good = ca.client("alice")?;
    let (status, _) = fetch(server.addr, client_tls(&ca, &[b"h2"], Some(&good))?).await?;
    assert_eq!(status, StatusCode::OK);
    Ok(())
}

#[tokio::test]
async fn without_a_client_ca_no_certificate_is_requested() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let server = Server::start(&listen_config(&mount, false, limits()), false).await?;
    // The client has a certificate but is never asked for it.
    let alice = ca.client("alice")?;
    let (status, _) = fetch(server.addr, client_tls(&ca, &[b"h2"], Some(&alice))?).await?;
    assert_eq!(status, StatusCode::OK);
    let info = server.last_seen().context("service saw a request")?;
    assert!(info.client_chain.is_none());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Handshake and header limits
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn garbage_and_a_stalled_handshake_are_closed_while_others_are_served() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let server = Server::start(&listen_config(&mount, false, limits()), false).await?;

    // Plain HTTP on a TLS port.
    let mut garbage = TcpStream::connect(server.addr).await?;
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await?;
    closed_by_server(&mut garbage).await?;

    // Connects and says nothing: cut at the handshake timeout. Meanwhile another client
    // is served.
    let mut stalled = TcpStream::connect(server.addr).await?;
    let (status, _) = fetch(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    assert_eq!(status, StatusCode::OK);
    let sent = closed_by_server(&mut stalled).await?;
    assert!(sent.is_empty(), "nothing to say to a silent client");

    let (status, _) = fetch(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    assert_eq!(status, StatusCode::OK);
    Ok(())
}

#[tokio::test]
async fn oversized_headers_get_431_or_a_closed_stream() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let limits = ListenLimits {
        max_header_bytes: 8192,
        ..limits()
    };
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;
    let big = http::HeaderValue::from_str(&"x".repeat(12 * 1024))?;

    // HTTP/1.1: the head does not fit the buffer.
    let (mut sender, _conn) = h1(server.addr, client_tls(&ca, &[b"http/1.1"], None)?).await?;
    let mut req = get_h1("/");
    req.headers_mut().insert("x-big", big.clone());
    // The server may also close (and reset) before the client has read the 431.
    if let Ok(response) = sender.send_request(req).await {
        assert_eq!(
            response.status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
    }

    // HTTP/2: the header block is over SETTINGS_MAX_HEADER_LIST_SIZE.
    let (mut sender, _conn) = h2(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    let mut req = get("/");
    req.headers_mut().insert("x-big", big);
    if let Ok(response) = sender.send_request(req).await {
        assert_eq!(
            response.status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
    }

    assert!(
        server.seen.lock().map(|s| s.is_empty()).unwrap_or(false),
        "no oversized request reached the service"
    );
    // A normal request still works, even on the same HTTP/2 connection.
    let response = sender.send_request(get("/")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    Ok(())
}

#[tokio::test]
async fn headers_trickling_in_are_cut_off_at_the_header_timeout() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let limits = ListenLimits {
        header_read_timeout: Duration::from_millis(300),
        ..limits()
    };
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;

    let mut tls = tls_connect(server.addr, client_tls(&ca, &[b"http/1.1"], None)?).await?;
    // A first request completes normally, so the connection is past its first-request
    // limit and only the header read timeout can stop the trickle of the second.
    tls.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut first = Vec::new();
    while !first.ends_with(b"\r\n\r\nok") {
        let mut chunk = [0u8; 1024];
        let n = within("first response", tls.read(&mut chunk)).await??;
        if n == 0 {
            bail!("closed before the first response");
        }
        first.extend_from_slice(&chunk[..n]);
    }
    assert!(first.starts_with(b"HTTP/1.1 200"));
    let (mut reader, mut writer) = tokio::io::split(tls);
    let closed = tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = reader.read_to_end(&mut sink).await;
    });
    writer
        .write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        .await?;
    writer.flush().await?;
    // One byte every 100 ms, a hundred bytes at most: far longer than the timeout.
    let mut cut_off = false;
    for _ in 0..100 {
        if closed.is_finished() || writer.write_all(b"a").await.is_err() {
            cut_off = true;
            break;
        }
        if writer.flush().await.is_err() {
            cut_off = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cut_off, "a client trickling its headers was never cut off");
    assert_eq!(
        server.seen.lock().map(|s| s.len()).unwrap_or(0),
        1,
        "only the first request"
    );

    let (status, _) = fetch(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    assert_eq!(status, StatusCode::OK);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Reload
// ---------------------------------------------------------------------------------------

async fn served_leaf(addr: SocketAddr, config: Arc<rustls::ClientConfig>) -> Result<Vec<u8>> {
    let tls = tls_connect(addr, config).await?;
    let certs = tls
        .get_ref()
        .1
        .peer_certificates()
        .context("server sent certificates")?;
    Ok(certs[0].to_vec())
}

#[tokio::test]
async fn certificate_and_client_ca_reload_on_a_secret_swap_keeping_open_connections() -> Result<()>
{
    let ca = Ca::new("bulwark-ca")?;
    let client_ca_1 = Ca::new("clients-1")?;
    let client_ca_2 = Ca::new("clients-2")?;
    let first = ca.server()?;
    let mut mount = SecretMount::new(&first, Some(&client_ca_1))?;
    // The periodic check is an hour away: what happens here comes from notifications.
    let limits = ListenLimits {
        file_check_interval: Duration::from_secs(3600),
        ..limits()
    };
    let server = Server::start(&listen_config(&mount, true, limits), true).await?;
    let alice_1 = client_ca_1.client("alice")?;
    let alice_2 = client_ca_2.client("alice")?;

    assert_eq!(
        served_leaf(server.addr, client_tls(&ca, &[b"h2"], None)?).await?,
        first.der.to_vec()
    );
    let (mut open, open_conn) = h2(server.addr, client_tls(&ca, &[b"h2"], Some(&alice_1))?).await?;
    assert_eq!(open.send_request(get("/")).await?.status(), StatusCode::OK);

    // The kubelet swaps in a new certificate and a new client CA.
    let second = ca.server()?;
    mount.update(&second.cert_pem, &second.key_pem, Some(&client_ca_2.pem))?;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while served_leaf(server.addr, client_tls(&ca, &[b"h2"], None)?).await? != second.der.to_vec() {
        if tokio::time::Instant::now() > deadline {
            bail!("new handshakes still get the old certificate after {PATIENCE:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _) = fetch(server.addr, client_tls(&ca, &[b"h2"], Some(&alice_2))?).await?;
    assert_eq!(status, StatusCode::OK, "a client of the new CA is accepted");
    let chain = server
        .last_seen()
        .and_then(|i| i.client_chain)
        .context("chain")?;
    assert_eq!(chain[0], alice_2.der);
    assert!(
        fetch(server.addr, client_tls(&ca, &[b"h2"], Some(&alice_1))?)
            .await
            .is_err(),
        "a client of the old CA is refused on new connections"
    );

    // The connection opened before the swap keeps working.
    assert_eq!(open.send_request(get("/")).await?.status(), StatusCode::OK);
    assert!(!open_conn.is_finished());

    // A broken update (key of another certificate) is refused; the last good one stays.
    let stranger = ca.server()?;
    mount.update(&second.cert_pem, &stranger.key_pem, Some(&client_ca_2.pem))?;
    let refused = server.reloader.reload();
    assert!(
        matches!(refused, Err(ListenError::KeyMismatch { .. }) | Ok(false)),
        "{refused:?}"
    );
    assert_eq!(
        served_leaf(server.addr, client_tls(&ca, &[b"h2"], None)?).await?,
        second.der.to_vec()
    );
    Ok(())
}

#[tokio::test]
async fn bind_names_the_bad_file() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let server = ca.server()?;
    let mount = SecretMount::new(&server, None)?;
    let mut cfg = listen_config(&mount, false, limits());
    cfg.key = mount.dir.0.join("missing.key");
    let error = Listener::bind(&cfg, &bulwark::metrics::Metrics::new())
        .await
        .err()
        .context("bind must fail")?;
    assert!(error.to_string().contains("missing.key"), "{error}");

    let other = ca.server()?;
    let wrong_key = mount.dir.0.join("other.key");
    std::fs::write(&wrong_key, &other.key_pem)?;
    cfg.key = wrong_key;
    let error = Listener::bind(&cfg, &bulwark::metrics::Metrics::new())
        .await
        .err()
        .context("bind must fail")?;
    assert!(matches!(error, ListenError::KeyMismatch { .. }), "{error}");
    assert!(error.to_string().contains("other.key"), "{error}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Idle timeout, GOAWAY chance, drain
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn idle_timeout_closes_idle_connections_but_not_a_quiet_watch() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let limits = ListenLimits {
        idle_timeout: Duration::from_millis(300),
        keepalive_interval: Duration::from_secs(60),
        ..limits()
    };
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;
    let config = client_tls(&ca, &[b"h2"], None)?;

    let (mut idle, idle_conn) = h2(server.addr, config.clone()).await?;
    let (mut watching, watch_conn) = h2(server.addr, config).await?;
    let response = idle.send_request(get("/")).await?;
    response.into_body().collect().await?;
    let mut quiet = watching.send_request(get("/quiet")).await?.into_body();
    assert_eq!(next_data(&mut quiet).await?, "first\n");

    // The connection whose request ended goes away by itself.
    within("idle connection closed", idle_conn).await???;

    // Well past several idle timeouts, the quiet watch's connection is still open and
    // still takes requests.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(!watch_conn.is_finished(), "a quiet watch is not idle");
    let response = watching.send_request(get("/")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    drop(quiet);
    Ok(())
}

#[tokio::test]
async fn goaway_chance_one_sends_every_http2_client_away_after_its_request() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let mut cfg = listen_config(&mount, false, limits());
    cfg.goaway_chance = 1.0;
    let server = Server::start(&cfg, false).await?;

    let (mut sender, conn) = h2(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    let response = sender.send_request(get("/")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.into_body().collect().await?.to_bytes(), "ok");
    // GOAWAY ends the client connection cleanly; the idle timeout is a minute away.
    within("connection ended after GOAWAY", conn).await???;
    assert!(sender.send_request(get("/")).await.is_err());

    // HTTP/1.1 has no GOAWAY: its keep-alive connection carries on.
    let (mut sender, _conn) = h1(server.addr, client_tls(&ca, &[b"http/1.1"], None)?).await?;
    for _ in 0..3 {
        let response = sender.send_request(get_h1("/")).await?;
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await?;
    }
    Ok(())
}

#[tokio::test]
async fn drain_goaway_finishes_streams_then_close_drops_them() -> Result<()> {
    drain_goaway_finishes_streams_then_close_drops_them_on(0).await
}

#[tokio::test]
async fn on_worker_threads_drain_goaway_finishes_streams_then_close_drops_them() -> Result<()> {
    drain_goaway_finishes_streams_then_close_drops_them_on(2).await
}

async fn drain_goaway_finishes_streams_then_close_drops_them_on(workers: usize) -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    // hyper's header read timeout also ends idle HTTP/1.1 keep-alive connections; keep it
    // out of the way so that only the drain closes them here.
    let limits = ListenLimits {
        header_read_timeout: Duration::from_secs(30),
        ..limits()
    };
    let mut server =
        Server::start_on(&listen_config(&mount, false, limits), false, workers).await?;

    let (mut streaming, _stream_conn) = h2(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    let mut ticks = streaming.send_request(get("/ticks")).await?.into_body();
    assert_eq!(next_data(&mut ticks).await?, "tick\n");
    let (mut keepalive, keepalive_conn) =
        h1(server.addr, client_tls(&ca, &[b"http/1.1"], None)?).await?;
    keepalive
        .send_request(get_h1("/"))
        .await?
        .into_body()
        .collect()
        .await?;
    assert_eq!(server.connections.open(), 2);

    server.drain.send(DrainPhase::GoAway)?;

    // The listener stops accepting: connecting fails.
    within("listener closed", async {
        while TcpStream::connect(server.addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await?;
    // The idle HTTP/1.1 connection is closed.
    within("idle keep-alive connection closed", keepalive_conn).await???;
    // The HTTP/2 connection takes no new request, but its stream keeps flowing.
    within("new streams refused after GOAWAY", async {
        while streaming.send_request(get("/")).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await?;
    assert_eq!(next_data(&mut ticks).await?, "tick\n");
    assert!(!server.serve.is_finished(), "serve waits for open streams");

    server.drain.send(DrainPhase::Close)?;
    let ended = within("stream dropped at Close", async {
        // Frames already in flight may still arrive; then the stream must end.
        while let Some(Ok(_)) = ticks.frame().await {}
    });
    ended.await?;
    within("serve returned", &mut server.serve).await???;
    assert_eq!(server.connections.open(), 0);
    Ok(())
}

#[tokio::test]
async fn connections_spread_evenly_over_worker_threads_and_each_stays_on_its_own() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let server = Server::start_on(&listen_config(&mount, false, limits()), false, 2).await?;
    let mut served_by = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (mut client, conn) = h2(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
        let mut threads = Vec::new();
        for _ in 0..3 {
            let body = client.send_request(get("/thread")).await?.into_body();
            threads.push(String::from_utf8(
                body.collect().await?.to_bytes().to_vec(),
            )?);
        }
        threads.dedup();
        assert_eq!(threads.len(), 1, "one connection, one thread: {threads:?}");
        served_by.push(threads.remove(0));
        clients.push((client, conn));
    }
    served_by.sort();
    assert_eq!(
        served_by,
        [
            "bulwark-worker-0",
            "bulwark-worker-0",
            "bulwark-worker-1",
            "bulwark-worker-1"
        ],
        "each connection goes to the worker with the fewest open"
    );
    assert_eq!(server.connections.open(), 4);
    Ok(())
}

/// The name of the thread that serves a request on `client`'s connection.
async fn serving_thread(client: &mut H2Sender) -> Result<String> {
    let body = client.send_request(get("/thread")).await?.into_body();
    Ok(String::from_utf8(
        body.collect().await?.to_bytes().to_vec(),
    )?)
}

#[tokio::test]
async fn a_new_connection_goes_to_the_worker_with_the_fewest_open() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let server = Server::start_on(&listen_config(&mount, false, limits()), false, 2).await?;
    let tls = || client_tls(&ca, &[b"h2"], None);
    let (mut a, a_conn) = h2(server.addr, tls()?).await?;
    let (mut b, _b_conn) = h2(server.addr, tls()?).await?;
    let (mut c, c_conn) = h2(server.addr, tls()?).await?;
    let (on_a, on_b, on_c) = (
        serving_thread(&mut a).await?,
        serving_thread(&mut b).await?,
        serving_thread(&mut c).await?,
    );
    assert_ne!(on_a, on_b, "the second connection goes to the idle worker");
    assert_eq!(on_a, on_c, "a tie goes round");
    // Both of one worker's connections close: it has none open, the other one.
    drop((a, c));
    a_conn.abort();
    c_conn.abort();
    within("two connections closed", async {
        while server.connections.open() > 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await?;
    let (mut d, _d_conn) = h2(server.addr, tls()?).await?;
    assert_eq!(
        serving_thread(&mut d).await?,
        on_a,
        "the next connection goes to the worker with none open, not the next in turn"
    );
    Ok(())
}

#[tokio::test]
async fn stopping_a_listener_on_worker_threads_drops_their_connections() -> Result<()> {
    stopping_a_listener_drops_its_connections_on(2).await
}

#[tokio::test]
async fn stopping_a_listener_on_its_runtime_drops_its_connections() -> Result<()> {
    stopping_a_listener_drops_its_connections_on(0).await
}

async fn stopping_a_listener_drops_its_connections_on(workers: usize) -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let server = Server::start_on(&listen_config(&mount, false, limits()), false, workers).await?;
    let (mut client, conn) = h2(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    let mut ticks = client.send_request(get("/ticks")).await?.into_body();
    assert_eq!(next_data(&mut ticks).await?, "tick\n");
    assert_eq!(server.connections.open(), 1);
    let connections = server.connections.clone();
    // Aborts the listener's task, as a drain's end or a dropped runtime does.
    drop(server);
    let _ = within("the worker's connection closed", conn).await?;
    within("the connection's slot given back", async {
        while connections.open() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn new_connections_after_goaway_are_not_accepted() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let mut server = Server::start(&listen_config(&mount, false, limits()), false).await?;
    server.drain.send(DrainPhase::GoAway)?;
    // Nothing open: serve returns at once, and the port is closed.
    within("serve returned", &mut server.serve).await???;
    assert!(
        fetch(server.addr, client_tls(&ca, &[b"h2"], None)?)
            .await
            .is_err()
    );
    Ok(())
}

#[tokio::test]
async fn http2_streams_beyond_the_limit_wait_for_a_free_one() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let limits = ListenLimits {
        max_concurrent_streams: 1,
        ..limits()
    };
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;
    let (mut sender, _conn) = h2(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;

    let mut quiet = sender.send_request(get("/quiet")).await?.into_body();
    assert_eq!(next_data(&mut quiet).await?, "first\n");
    // The server allows one stream: the client holds the second request back meanwhile.
    let mut second = tokio::spawn(sender.send_request(get("/")));
    let early = tokio::time::timeout(Duration::from_millis(300), &mut second).await;
    assert!(early.is_err(), "a second stream ran beside the first");
    assert_eq!(server.seen.lock().map(|s| s.len()).unwrap_or(0), 1);

    // Once the first stream is gone, the second goes through.
    drop(quiet);
    let response = within("second request", second).await???;
    assert_eq!(response.status(), StatusCode::OK);
    Ok(())
}

#[tokio::test]
async fn an_http2_client_that_ignores_keepalive_pings_is_dropped() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    // Only the pings can end this connection: the other limits are far away.
    let limits = ListenLimits {
        keepalive_interval: Duration::from_millis(200),
        keepalive_timeout: Duration::from_millis(200),
        header_read_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(60),
        ..limits()
    };
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;

    // A hand-made HTTP/2 client: preface and an empty SETTINGS frame, then it reads
    // whatever comes (so TCP never stalls) and answers nothing, PINGs included.
    let mut tls = tls_connect(server.addr, client_tls(&ca, &[b"h2"], None)?).await?;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
    tls.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?;
    tls.flush().await?;
    let mut sink = Vec::new();
    // An error (dropped without a TLS close_notify) is as closed as a clean EOF.
    let _ = within("silent client dropped", tls.read_to_end(&mut sink)).await?;
    // The server spoke (SETTINGS, then at least one PING) before giving up.
    assert!(sink.len() > 9, "server sent {} bytes", sink.len());
    Ok(())
}

#[tokio::test]
async fn tls12_and_tls13_clients_are_both_served() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let server = Server::start(&listen_config(&mount, true, limits()), false).await?;
    let alice = ca.client("alice")?;
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der.clone())?;
        let (chain, key) = alice.identity();
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[version])?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tls = tls_connect(server.addr, Arc::new(config.clone())).await?;
        assert_eq!(tls.get_ref().1.protocol_version(), Some(version.version));
        let (status, _) = fetch(server.addr, Arc::new(config)).await?;
        assert_eq!(status, StatusCode::OK);
        let chain = server
            .last_seen()
            .and_then(|i| i.client_chain)
            .context("chain")?;
        assert_eq!(chain[0], alice.der, "{:?}", version.version);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Connection caps against silent sockets (issue 33)
// ---------------------------------------------------------------------------------------

/// Caps scaled down from the defaults, with timeouts long enough that silent sockets hold
/// their places for the whole test unless something closes them.
fn capped(total: usize, per_source: usize) -> ListenLimits {
    ListenLimits {
        max_connections: total,
        max_connections_per_source: per_source,
        max_connections_per_prefix: 0,
        handshake_timeout: Duration::from_secs(30),
        first_byte_timeout: Duration::from_secs(30),
        proxy_header_timeout: Duration::from_secs(30),
        ..limits()
    }
}

/// Opens `n` TCP connections from `source` that send nothing, and waits until the listener
/// holds them all.
async fn silent(n: usize, source: [u8; 4], server: &Server, open: usize) -> Result<Vec<TcpStream>> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(connect_from(source, server.addr).await?);
    }
    until_open(&server.connections, open).await?;
    Ok(held)
}

#[tokio::test]
async fn silent_sockets_filling_the_total_cap_do_not_lock_out_a_client_with_a_certificate()
-> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let server = Server::start(&listen_config(&mount, true, capped(20, 1000)), false).await?;
    let victim = client_tls(&ca, &[b"h2"], Some(&ca.client("alice")?))?;

    let mut held = silent(20, [127, 0, 0, 1], &server, 20).await?;
    let tcp = connect_from([127, 0, 0, 1], server.addr).await?;
    let (status, _) = within("the victim's request", fetch_over(tcp, victim)).await??;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        counted(
            &server.metrics,
            r#"bulwark_connections_closed_total{reason="evicted"}"#
        ),
        1
    );
    // The oldest silent socket made the room.
    closed_by_server(&mut held[0]).await?;
    Ok(())
}

#[tokio::test]
async fn with_the_proxy_protocol_an_untrusted_peer_is_capped_as_one_source_before_any_header()
-> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let mut cfg = listen_config(&mount, true, capped(20, 5));
    cfg.proxy_protocol = Some(bulwark::config::ProxyProtocol {
        trusted_sources: vec!["10.0.0.0/8".parse()?],
        required: true,
    });
    let server = Server::start(&cfg, false).await?;
    let victim = client_tls(&ca, &[b"h2"], Some(&ca.client("alice")?))?;

    let _held = silent(5, [127, 0, 0, 1], &server, 5).await?;
    for _ in 0..15 {
        refused_from([127, 0, 0, 1], server.addr).await?;
    }
    assert_eq!(server.connections.open(), 5);
    assert_eq!(
        counted(
            &server.metrics,
            r#"bulwark_connections_refused_total{reason="max_connections_per_source"}"#
        ),
        15
    );
    let tcp = connect_from([127, 0, 1, 1], server.addr).await?;
    let (status, _) = within("the victim's request", fetch_over(tcp, victim)).await??;
    assert_eq!(status, StatusCode::OK);
    Ok(())
}

#[tokio::test]
async fn silent_sockets_from_a_trusted_balancer_do_not_lock_out_its_clients() -> Result<()> {
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, Some(&ca))?;
    let mut limits = capped(20, 5);
    limits.proxy_header_timeout = Duration::from_millis(300);
    let mut cfg = listen_config(&mount, true, limits);
    cfg.proxy_protocol = Some(bulwark::config::ProxyProtocol {
        trusted_sources: vec!["127.0.0.1/32".parse()?],
        required: true,
    });
    let server = Server::start(&cfg, false).await?;
    let victim = client_tls(&ca, &[b"h2"], Some(&ca.client("alice")?))?;
    let through_balancer = |client: &'static str| async move {
        let mut tcp = connect_from([127, 0, 0, 1], server.addr).await?;
        tcp.write_all(format!("PROXY TCP4 {client} 127.0.0.1 40000 6443\r\n").as_bytes())
            .await?;
        Ok::<_, anyhow::Error>(tcp)
    };

    // The balancer is not one source: all its clients come from it. Its silent sockets
    // (no header) fill the total cap, and a client with a certificate still gets in.
    let mut no_header = silent(20, [127, 0, 0, 1], &server, 20).await?;
    let tcp = through_balancer("192.0.2.10").await?;
    let (status, _) = within("the victim's request", fetch_over(tcp, victim.clone())).await??;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        server
            .last_seen()
            .context("a request")?
            .peer
            .ip()
            .to_string(),
        "192.0.2.10"
    );
    // The rest go at the PROXY header deadline, counted.
    for stream in &mut no_header {
        closed_by_server(stream).await?;
    }
    assert!(
        counted(
            &server.metrics,
            r#"bulwark_connections_closed_total{reason="proxy_header_timeout"}"#
        ) >= 15
    );

    // A header naming one client, then silence: that client is capped as one source.
    let mut one_client = Vec::new();
    for _ in 0..20 {
        one_client.push(through_balancer("198.51.100.7").await?);
    }
    until_open(&server.connections, 5).await?;
    let tcp = through_balancer("192.0.2.11").await?;
    let (status, _) = within("the victim's request", fetch_over(tcp, victim)).await??;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        counted(
            &server.metrics,
            r#"bulwark_connections_refused_total{reason="max_connections_per_source"}"#
        ),
        15
    );
    Ok(())
}

#[tokio::test]
async fn a_socket_that_sends_nothing_is_closed_at_the_first_byte_timeout_and_counted() -> Result<()>
{
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let mut limits = capped(20, 1000);
    limits.first_byte_timeout = Duration::from_millis(200);
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;

    let started = std::time::Instant::now();
    let mut stalled = TcpStream::connect(server.addr).await?;
    closed_by_server(&mut stalled).await?;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed at the first byte timeout, long before the handshake timeout"
    );
    assert_eq!(
        counted(
            &server.metrics,
            r#"bulwark_connections_closed_total{reason="first_byte_timeout"}"#
        ),
        1
    );
    // A handshake begun and never finished is counted too.
    let mut limits = capped(20, 1000);
    limits.handshake_timeout = Duration::from_millis(300);
    let server = Server::start(&listen_config(&mount, false, limits), false).await?;
    let mut half = TcpStream::connect(server.addr).await?;
    half.write_all(&[0x16, 0x03, 0x01, 0x00, 0x40]).await?;
    closed_by_server(&mut half).await?;
    assert_eq!(
        counted(
            &server.metrics,
            r#"bulwark_connections_closed_total{reason="handshake_timeout"}"#
        ),
        1
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The admin listener's caps and timeouts
// ---------------------------------------------------------------------------------------

/// An admin listener serving the test service, and its metrics.
async fn admin(
    limits: &bulwark::config::AdminLimits,
    tls: Option<&SecretMount>,
) -> Result<(SocketAddr, bulwark::metrics::Metrics, JoinHandle<()>)> {
    let metrics = bulwark::metrics::Metrics::new();
    let tls = match tls {
        Some(mount) => Some(bulwark::listen::ServingTls::load(
            &mount.path("tls.crt"),
            &mount.path("tls.key"),
            &metrics,
        )?),
        None => None,
    };
    let address = SocketAddr::from(([127, 0, 0, 1], 0));
    let listener = bulwark::listen::AdminListener::bind(address, limits, tls, &metrics).await?;
    let addr = listener.local_addr();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let task = tokio::spawn(async move {
        listener.serve(test_service(seen)).await.ok();
    });
    Ok((addr, metrics, task))
}

/// `GET /healthz` over plain HTTP/1.1 on a fresh connection from `source`.
async fn healthz_from(source: [u8; 4], addr: SocketAddr) -> Result<StatusCode> {
    let tcp = connect_from(source, addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    let _conn = tokio::spawn(conn);
    Ok(sender.send_request(get_h1("/healthz")).await?.status())
}

#[tokio::test]
async fn admin_silent_connections_are_capped_and_closed_while_healthz_answers() -> Result<()> {
    let series_of = |reason: &str| format!("bulwark_admin_connections_{reason}");
    let limits = bulwark::config::AdminLimits {
        max_connections: 4,
        max_connections_per_source: 3,
        max_connections_per_prefix: 3,
        first_byte_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let (addr, metrics, _task) = admin(&limits, None).await?;

    let started = std::time::Instant::now();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(connect_from([127, 0, 0, 1], addr).await?);
    }
    // A fourth from the same source is reset; another source is answered.
    refused_from([127, 0, 0, 1], addr).await?;
    assert_eq!(
        within("/healthz", healthz_from([127, 0, 1, 1], addr)).await??,
        StatusCode::OK
    );
    // At the total, a probe from anywhere else evicts the oldest silent connection.
    let open = |n: u64| {
        let metrics = &metrics;
        within("admin connections open", async move {
            while counted(metrics, "bulwark_admin_connections_open") != n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    open(3).await?;
    held.push(connect_from([127, 0, 2, 1], addr).await?);
    open(4).await?;
    assert_eq!(
        within("/healthz at the cap", healthz_from([127, 0, 3, 1], addr)).await??,
        StatusCode::OK,
        "a silent flood keeps the probe out"
    );
    assert!(
        started.elapsed() < limits.first_byte_timeout,
        "the test outran its timeout"
    );

    // The oldest was evicted for it; every other silent connection is closed at the first
    // byte timeout.
    for stream in &mut held {
        closed_by_server(stream).await?;
    }
    assert_eq!(
        counted(&metrics, &series_of(r#"closed_total{reason="evicted"}"#)),
        1
    );
    let series = |reason| format!("bulwark_admin_connections_{reason}");
    assert_eq!(
        counted(
            &metrics,
            &series(r#"refused_total{reason="max_connections_per_source"}"#)
        ),
        1
    );
    assert_eq!(
        counted(
            &metrics,
            &series(r#"refused_total{reason="max_connections"}"#)
        ),
        0
    );
    assert_eq!(
        counted(
            &metrics,
            &series(r#"closed_total{reason="first_byte_timeout"}"#)
        ),
        3
    );
    assert_eq!(counted(&metrics, "bulwark_admin_connections_open"), 0);
    // Client connection metrics are not the admin listener's.
    assert_eq!(counted(&metrics, "bulwark_connections_open"), 0);
    assert_eq!(
        within("/healthz", healthz_from([127, 0, 0, 1], addr)).await??,
        StatusCode::OK
    );
    Ok(())
}

#[tokio::test]
async fn admin_tls_connections_that_send_no_request_are_closed_at_the_header_timeout() -> Result<()>
{
    let ca = Ca::new("bulwark-ca")?;
    let mount = SecretMount::new(&ca.server()?, None)?;
    let limits = bulwark::config::AdminLimits {
        header_read_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let (addr, metrics, _task) = admin(&limits, Some(&mount)).await?;

    // Handshakes finished, then nothing: the audit's 3,000 held for 130 s, scaled down.
    let config = client_tls(&ca, &[b"h2"], None)?;
    let mut idle = Vec::new();
    for _ in 0..5 {
        idle.push(tls_connect(addr, config.clone()).await?);
    }
    for stream in &mut idle {
        let mut got = Vec::new();
        within("the server's close", stream.read_to_end(&mut got))
            .await?
            .ok();
    }
    assert_eq!(
        counted(
            &metrics,
            r#"bulwark_admin_connections_closed_total{reason="header_read_timeout"}"#
        ),
        5
    );
    let (status, _) = fetch(addr, config).await?;
    assert_eq!(status, StatusCode::OK);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The patched h2 (patches/README.md)
// ---------------------------------------------------------------------------------------

/// A sensitive header value (Bulwark marks the `Audit-Id` so, on every answer) goes over
/// HTTP/2 as it is, not Huffman-coded: its bytes are on the wire verbatim. With h2 as
/// published they are not.
#[tokio::test]
async fn an_audit_id_goes_to_the_client_as_it_is() -> Result<()> {
    const ID: &str = "0f8e5a3c-9b1d-4c2e-8a7f-6d5e4c3b2a19";
    let (client, relay_client) = tokio::io::duplex(64 * 1024);
    let (relay_server, served) = tokio::io::duplex(64 * 1024);
    let service = hyper::service::service_fn(|_: Request<Incoming>| async {
        let mut response = Response::new(Empty::<Bytes>::new());
        let mut id = http::HeaderValue::from_static(ID);
        id.set_sensitive(true);
        response.headers_mut().insert("audit-id", id);
        Ok::<_, Infallible>(response)
    });
    tokio::spawn(
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(served), service),
    );
    // What the server sends, recorded on its way to the client.
    let sent = Arc::new(Mutex::new(Vec::new()));
    let (mut from_client, mut to_client) = tokio::io::split(relay_client);
    let (mut from_server, mut to_server) = tokio::io::split(relay_server);
    tokio::spawn(async move { tokio::io::copy(&mut from_client, &mut to_server).await });
    let recorded = sent.clone();
    tokio::spawn(async move {
        let mut chunk = [0u8; 4096];
        while let Ok(n @ 1..) = from_server.read(&mut chunk).await {
            recorded.lock().unwrap().extend_from_slice(&chunk[..n]);
            if to_client.write_all(&chunk[..n]).await.is_err() {
                break;
            }
        }
    });
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client)).await?;
    tokio::spawn(conn);
    let response = sender.send_request(get("/")).await?;
    assert_eq!(response.headers()["audit-id"], ID);
    let sent = sent.lock().unwrap().clone();
    assert!(
        sent.windows(ID.len()).any(|w| w == ID.as_bytes()),
        "the Audit-Id is not on the wire as it is: Huffman-coded?"
    );
    Ok(())
}
