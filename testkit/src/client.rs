//! Clients that speak real TLS and HTTP/2 to Bulwark (or HTTP/2 alone over an in-memory
//! connection), and plain HTTP/1.1 to its admin listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bulwark_sim::{CertKey, Pki};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

/// One HTTP/2 connection to Bulwark.
pub struct Client {
    sender: http2::SendRequest<Full<Bytes>>,
}

/// A response with its whole body.
pub struct Answer {
    /// Its status.
    pub status: http::StatusCode,
    /// Its headers.
    pub headers: http::HeaderMap,
    /// Its body.
    pub body: Bytes,
}

impl Answer {
    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A client TLS configuration trusting the apiservers' serving CA (which Bulwark's serving
/// certificate comes from), presenting `cert` if given, offering HTTP/2.
pub fn tls_config(pki: &Pki, cert: Option<&CertKey>) -> rustls::ClientConfig {
    bulwark_sim::client::tls_config(pki, cert, &[b"h2"]).expect("client TLS configuration")
}

impl Client {
    /// Connects to `addr` with TLS (presenting `cert` if given) and HTTP/2.
    pub async fn connect(addr: SocketAddr, pki: &Pki, cert: Option<&CertKey>) -> Client {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        Client::over(tcp, pki, cert)
            .await
            .expect("TLS and HTTP/2 handshakes")
    }

    /// Connects to `addr` from the local address `from` (any of 127.0.0.0/8 reaches a
    /// listener on 127.0.0.1), so that one test can be many client addresses.
    pub async fn connect_from(
        addr: SocketAddr,
        from: std::net::IpAddr,
        pki: &Pki,
        cert: Option<&CertKey>,
    ) -> Client {
        let tcp = tcp_from(from, addr)
            .await
            .expect("connect from the client address");
        Client::over(tcp, pki, cert)
            .await
            .expect("TLS and HTTP/2 handshakes")
    }

    /// TLS (presenting `cert` if given) and HTTP/2 over a connection the caller opened (from
    /// an address of its choice, or through a balancer); the error says which handshake
    /// failed.
    pub async fn over(
        tcp: tokio::net::TcpStream,
        pki: &Pki,
        cert: Option<&CertKey>,
    ) -> Result<Client, String> {
        let tls = TlsConnector::from(Arc::new(tls_config(pki, cert)))
            .connect(ServerName::try_from("127.0.0.1").expect("name"), tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        Client::plain(tls).await
    }

    /// HTTP/2 over a connection as it is, adding no TLS: a TLS stream ([`Client::over`]),
    /// or one end of an in-memory pair whose other end `Running::serve_connection` serves.
    pub async fn plain<I>(io: I) -> Result<Client, String>
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
        tokio::spawn(conn);
        Ok(Client { sender })
    }

    /// Sends a request and reads the whole answer, or says why the connection could not.
    pub async fn try_send(&mut self, request: Request<Full<Bytes>>) -> Result<Answer, String> {
        self.sender.ready().await.map_err(|e| e.to_string())?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// Sends a request and reads the whole answer.
    pub async fn send(&mut self, request: Request<Full<Bytes>>) -> Answer {
        let response = self.start(request).await;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// Sends a request and returns the streaming response.
    pub async fn start(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> Response<hyper::body::Incoming> {
        self.sender.ready().await.expect("connection ready");
        self.sender.send_request(request).await.expect("response")
    }

    /// A handle that sends on the same connection from many tasks.
    pub fn sender(&self) -> http2::SendRequest<Full<Bytes>> {
        self.sender.clone()
    }

    /// GETs `path` and reads the whole answer.
    pub async fn get(&mut self, path: &str) -> Answer {
        self.send(get(path)).await
    }

    /// GETs `path` with `Authorization: Bearer token`.
    pub async fn get_with_token(&mut self, path: &str, token: &str) -> Answer {
        self.send(with_token(get(path), token)).await
    }
}

/// A TCP connection to `to` from the local address `from` (any of 127.0.0.0/8 reaches a
/// listener on 127.0.0.1).
pub async fn tcp_from(
    from: std::net::IpAddr,
    to: SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = match from {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }?;
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

/// A GET request for `path` on Bulwark.
pub fn get(path: &str) -> Request<Full<Bytes>> {
    Request::get(format!("https://127.0.0.1{path}"))
        .body(Full::new(Bytes::new()))
        .expect("request")
}

/// A POST of a JSON `body` to `path` on Bulwark.
pub fn post_json(path: &str, body: &serde_json::Value) -> Request<Full<Bytes>> {
    Request::post(format!("https://127.0.0.1{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request")
}

/// `request` with `Authorization: Bearer token`.
pub fn with_token(mut request: Request<Full<Bytes>>, token: &str) -> Request<Full<Bytes>> {
    request.headers_mut().insert(
        http::header::AUTHORIZATION,
        format!("Bearer {token}").parse().expect("header value"),
    );
    request
}

/// Plain HTTP/1.1 GET on an admin listener: status and body; `None` when the listener is
/// not there (yet) or the answer is not HTTP.
pub async fn admin_get(admin: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8(response).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}
