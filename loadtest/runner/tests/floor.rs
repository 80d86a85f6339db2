//! The floor (`src/floor.rs`) end to end, started as `passthrough` starts it (this crate's
//! binary, `__floor`) with two workers, in front of a tiny HTTP/2 upstream over TLS on
//! 127.0.0.1: GETs over TLS and HTTP/2, and one over HTTP/1.1, come back with the
//! upstream's answer to the path they asked for, and each worker holds one upstream
//! connection.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bulwark_sim::pki::{Ca, Pki};
use bytes::Bytes;
use http::{Request, Response, header};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// How long the floor may take to listen and to connect its workers upstream: generous,
/// since the test only waits for it and times nothing.
const START: Duration = Duration::from_secs(60);

/// Serves every request with `upstream saw METHOD PATH at AUTHORITY`, over TLS and HTTP/2
/// only, counting the connections it accepts.
async fn upstream(listener: TcpListener, cert: &Ca, connections: Arc<AtomicUsize>) {
    let serving = cert.server_cert(&["127.0.0.1"]);
    let chain = CertificateDer::pem_slice_iter(serving.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(serving.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(config));
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            connections.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
                    let uri = request.uri();
                    let body = format!(
                        "upstream saw {} {} at {}",
                        request.method(),
                        uri.path_and_query().map_or("", |p| p.as_str()),
                        uri.authority().map_or("", |a| a.as_str())
                    );
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
}

/// A TLS connection to the floor, trusting `ca`, offering `alpn`.
async fn connect(
    addr: SocketAddr,
    ca: &Ca,
    alpn: &[u8],
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::from(addr.ip()), tcp)
        .await
        .unwrap();
    assert_eq!(
        tls.get_ref().1.alpn_protocol(),
        Some(alpn),
        "the floor's ALPN"
    );
    tls
}

/// GETs `path` from the floor over HTTP/2 on a connection of its own; status and body.
async fn get_h2(addr: SocketAddr, ca: &Ca, path: &str) -> (u16, String) {
    let tls = connect(addr, ca, b"h2").await;
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(connection);
    let request = Request::get(format!("https://{addr}{path}"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// GETs `path` from the floor over HTTP/1.1; status and body.
async fn get_http1(addr: SocketAddr, ca: &Ca, path: &str) -> (u16, String) {
    let tls = connect(addr, ca, b"http/1.1").await;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::get(path)
        .header(header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn the_floor_forwards_gets_over_tls_and_http2_with_one_upstream_connection_per_worker() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let upstream_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream_listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    upstream(upstream_listener, &pki.server_ca, connections.clone()).await;
    let upstream_ca = dir.path().join("upstream-ca.crt");
    std::fs::write(&upstream_ca, pki.server_ca.cert_pem()).unwrap();
    let serving_ca = Ca::new("floor-serving-ca");
    let (cert, key) = serving_ca
        .server_cert(&["127.0.0.1"])
        .write(dir.path(), "floor")
        .unwrap();

    let addr = bulwark_loadtest::proxy_process::free_port().unwrap();
    let mut floor = bulwark_loadtest::child::command(env!("CARGO_BIN_EXE_bulwark-loadtest"))
        .arg("__floor")
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--cert")
        .arg(&cert)
        .arg("--key")
        .arg(&key)
        .arg("--upstream")
        .arg(upstream_addr.to_string())
        .arg("--upstream-ca")
        .arg(&upstream_ca)
        .arg("--workers")
        .arg("2")
        .spawn()
        .unwrap();
    // Both workers connect upstream as they start, and listen.
    let deadline = tokio::time::Instant::now() + START;
    while connections.load(Ordering::SeqCst) < 2 || TcpStream::connect(addr).await.is_err() {
        if let Some(status) = floor.try_wait().unwrap() {
            panic!("the floor exited at start: {status}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the floor did not start: {} upstream connections",
            connections.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let path = "/api/v1/namespaces/ns-0/configmaps/configmap-0?resourceVersion=0";
    let expected = format!("upstream saw GET {path} at {upstream_addr}");
    // Several connections, so that both workers' listeners are likely to take some.
    for _ in 0..8 {
        assert_eq!(
            get_h2(addr, &serving_ca, path).await,
            (200, expected.clone())
        );
    }
    assert_eq!(
        get_http1(addr, &serving_ca, "/readyz").await,
        (200, format!("upstream saw GET /readyz at {upstream_addr}"))
    );
    // Every request went over the workers' own two connections.
    assert_eq!(connections.load(Ordering::SeqCst), 2);
    floor.kill().await.unwrap();
}
