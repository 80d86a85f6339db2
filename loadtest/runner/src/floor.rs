//! The floor: the least a reverse proxy built from Bulwark's own parts costs, for
//! `passthrough` to measure Bulwark against. It is a measuring stick, not a product: no
//! authentication, rules, admission, metrics, health checks, limits, timeouts or
//! reconnection. Whatever Bulwark costs above it is Bulwark's own work; what the floor costs
//! is the price of the crates, the runtime and the allocator that Bulwark is built on.
//!
//! It is built from what Bulwark is built from: hyper 1's auto server (hyper-util) over
//! tokio-rustls with the tree's one crypto provider (ring), hyper's HTTP/2 client over
//! tokio-rustls to the upstream, tokio, and mimalloc (the allocator of the binary it runs
//! in, as in `bulwark`). Every setting is hyper's and rustls' default.
//!
//! It scales as a pool of workers: each worker is a thread with a current-thread runtime,
//! its own listener on the one address (`SO_REUSEPORT`: the kernel spreads connections over
//! them), its own accept loop and its own HTTP/2 connection to the upstream, so that workers
//! share nothing. A request's URI is rewritten to the upstream's and the request forwarded
//! as it came; the answer goes back as it came. A failed upstream request resets the
//! client's stream; a lost upstream connection stops the worker and, with it, the process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response, Version, header};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Where the floor listens, what it serves with, and where it forwards.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The address every worker listens on.
    pub listen: SocketAddr,
    /// The serving certificate chain (PEM) and its key.
    pub cert: PathBuf,
    /// See `cert`.
    pub key: PathBuf,
    /// The upstream, spoken to over TLS and HTTP/2 and verified by its IP address.
    pub upstream: SocketAddr,
    /// The CA bundle (PEM) the upstream's certificate must chain to.
    pub upstream_ca: PathBuf,
    /// Worker threads, each with its own runtime, listener and upstream connection.
    pub workers: usize,
}

/// Starts the workers and serves until one of them stops, with its error.
pub fn run(settings: &Settings) -> anyhow::Result<()> {
    let (acceptor, connector) = tls(settings)?;
    let (stopped, first_stop) = std::sync::mpsc::channel();
    for worker in 0..settings.workers.max(1) {
        let listener = listener(settings.listen)?;
        let (acceptor, connector, stopped) = (acceptor.clone(), connector.clone(), stopped.clone());
        let upstream = settings.upstream;
        std::thread::Builder::new()
            .name(format!("floor-{worker}"))
            .spawn(move || {
                let _ = stopped.send(serve(listener, acceptor, connector, upstream));
            })
            .context("starting a worker thread")?;
    }
    drop(stopped);
    match first_stop.recv() {
        Ok(Err(e)) => Err(e),
        _ => bail!("a worker stopped"),
    }
}

/// The serving (ALPN `h2`, `http/1.1`) and upstream (ALPN `h2`) TLS configurations.
fn tls(settings: &Settings) -> anyhow::Result<(TlsAcceptor, TlsConnector)> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let read = |path: &PathBuf| {
        CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .with_context(|| format!("reading {}", path.display()))
    };
    let key = PrivateKeyDer::from_pem_file(&settings.key)
        .with_context(|| format!("reading {}", settings.key.display()))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(read(&settings.cert)?, key)?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let mut roots = rustls::RootCertStore::empty();
    for cert in read(&settings.upstream_ca)? {
        roots.add(cert)?;
    }
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"h2".to_vec()];
    Ok((Arc::new(server).into(), Arc::new(client).into()))
}

/// A listening socket on `addr` that other workers' sockets share (`SO_REUSEPORT`).
fn listener(addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// One worker: its runtime, its upstream connection and its accept loop.
fn serve(
    listener: std::net::TcpListener,
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    upstream: SocketAddr,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(upstream).await?;
        tcp.set_nodelay(true)?;
        let tls = connector
            .connect(ServerName::from(upstream.ip()), tcp)
            .await?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .context("the upstream's HTTP/2 handshake")?;
        let authority = Authority::try_from(upstream.to_string())?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let server = auto::Builder::new(TokioExecutor::new());
        let accept = async {
            loop {
                // An accept error (out of descriptors) is the client's to retry.
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, server) = (acceptor.clone(), server.clone());
                let (sender, authority) = (sender.clone(), authority.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |request| {
                        forward(request, sender.clone(), authority.clone())
                    });
                    let _ = server.serve_connection(TokioIo::new(tls), service).await;
                });
            }
        };
        tokio::select! {
            ended = connection => bail!("the upstream connection ended: {ended:?}"),
            () = accept => unreachable!("the accept loop never ends"),
        }
    })
}

/// Points `request` at the upstream and sends it on this worker's connection.
async fn forward(
    mut request: Request<Incoming>,
    mut upstream: SendRequest<Incoming>,
    authority: Authority,
) -> anyhow::Result<Response<Incoming>> {
    *request.uri_mut() = upstream_uri(request.uri(), authority)?;
    *request.version_mut() = Version::HTTP_2;
    // An HTTP/1.1 client's Host: HTTP/2 carries the authority in the URI.
    request.headers_mut().remove(header::HOST);
    Ok(upstream.send_request(request).await?)
}

/// `uri`'s path and query on `https://AUTHORITY`.
fn upstream_uri(uri: &Uri, authority: Authority) -> anyhow::Result<Uri> {
    let mut parts = uri.clone().into_parts();
    parts.scheme = Some(Scheme::HTTPS);
    parts.authority = Some(authority);
    parts.path_and_query = Some(
        parts
            .path_and_query
            .unwrap_or(PathAndQuery::from_static("/")),
    );
    Ok(Uri::from_parts(parts)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstream_uri_keeps_path_and_query_and_takes_the_upstreams_authority() {
        let authority = Authority::from_static("127.0.0.1:6443");
        let absolute: Uri = "https://proxy:443/api/v1/pods?limit=5".parse().unwrap();
        assert_eq!(
            upstream_uri(&absolute, authority.clone()).unwrap(),
            "https://127.0.0.1:6443/api/v1/pods?limit=5"
        );
        let origin: Uri = "/readyz".parse().unwrap();
        assert_eq!(
            upstream_uri(&origin, authority.clone()).unwrap(),
            "https://127.0.0.1:6443/readyz"
        );
        let asterisk: Uri = "*".parse().unwrap();
        assert!(upstream_uri(&asterisk, authority).is_ok());
    }

    #[test]
    fn workers_share_one_address() {
        let first = listener("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = first.local_addr().unwrap();
        let second = listener(addr).unwrap();
        assert_eq!(second.local_addr().unwrap(), addr);
    }
}
