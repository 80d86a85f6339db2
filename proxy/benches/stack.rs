//! The whole request path per request, against the floor on the same connection, so that
//! the cost of the plumbing between the stages shows as a number (README "Benchmarks"):
//!
//! - `stack/floor`: hyper's server on the client's connection, rewriting each request's
//!   URI and forwarding it on one hyper HTTP/2 client connection to the upstream: the least
//!   a proxy built from Bulwark's crates costs (as `bulwark-loadtest`'s floor);
//! - `stack/bulwark`: Bulwark's whole request path as `Running::start` builds it (Rescue,
//!   Classify, Identify with the token review cached, Admit under an exempt rule, the cache
//!   off, Forward through the upstream pool in front-proxy mode), served on the client's
//!   connection by the listener's HTTP layer (`Running::serve_connection`);
//! - `stack/refused`: the same Bulwark path under a rule whose bucket is empty, so every
//!   request is refused with 429 `rate_limited` (after the first, which its burst serves):
//!   what a refusal costs while a storm is shed, beside what an answer costs, in one run.
//!
//! `stack/bulwark` − `stack/floor` is what Bulwark's request path costs above hyper's: the
//! stages' own work (`--bench stages`) and the plumbing between them. Both subjects answer
//! the same request (a GET of one small object with a bearer token) from the same client to
//! the same upstream, all on one current-thread runtime: one core runs the client, the
//! proxy and the upstream, so a figure is the time of one request through all three.
//!
//! The client's leg is an in-memory pair (`tokio::io::duplex`) with no TLS, so neither
//! figure has a client handshake or client-side encryption in it; a socket's PROXY header
//! and connection caps are not on it either. The upstream's leg is real, as Bulwark's pool
//! requires: TLS over TCP on 127.0.0.1 to hyper's server answering constants.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulwark::listen::ServingTls;
use bulwark::metrics::Metrics;
use bulwark::serve::Running;
use bulwark_sim::pki::{Ca, Pki};
use bulwark_testkit::{BulwarkConfig, Client, Credentials, Names, get, with_token};
use bytes::Bytes;
use criterion::{Criterion, criterion_group};
use http::uri::{Authority, Scheme};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::ServerName;
use tokio::io::DuplexStream;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Handle, Runtime};
use tokio_rustls::TlsConnector;

/// The allocator the `bulwark` binary and the floor run with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The object every GET reads.
const PATH: &str = "/api/v1/namespaces/ns-0/configmaps/configmap-0";
/// What the upstream answers to it.
const OBJECT: &str = r#"{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"configmap-0","namespace":"ns-0","resourceVersion":"1"},"data":{"k":"v"}}"#;
/// What the upstream answers to every TokenReview.
const REVIEW: &str = r#"{"kind":"TokenReview","apiVersion":"authentication.k8s.io/v1","status":{"authenticated":true,"user":{"username":"stack","groups":["system:authenticated"]}}}"#;
/// The TokenReview answer with `STACK_USER=serviceaccount`: a pod's bound ServiceAccount
/// token as the apiserver reviews it, three groups and five extras.
const SA_REVIEW: &str = r#"{"kind":"TokenReview","apiVersion":"authentication.k8s.io/v1","status":{"authenticated":true,"user":{"username":"system:serviceaccount:kube-system:node-agent","uid":"5f0c6b8e-2d7a-4e8b-9a51-1f9e2c3d4b6a","groups":["system:serviceaccounts","system:serviceaccounts:kube-system","system:authenticated"],"extra":{"authentication.kubernetes.io/credential-id":["JTI=9c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f"],"authentication.kubernetes.io/node-name":["node-0042"],"authentication.kubernetes.io/node-uid":["1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"],"authentication.kubernetes.io/pod-name":["node-agent-x7k2p"],"authentication.kubernetes.io/pod-uid":["7e8f9a0b-1c2d-3e4f-5a6b-7c8d9e0f1a2b"]}}}}"#;
/// The client's bearer token.
const TOKEN: &str = "stack-bench-token";
/// Each direction's buffer of the in-memory pair.
const PAIR_BUFFER: usize = 64 * 1024;
/// Bulwark exempts the client, so that no limit shapes the figure (as `passthrough` does).
const MEASURED_RULE: &str = r#"
rules:
  - name: stack-measurement
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: exempt
"#;
/// The client's bucket holds one request and refills once in a thousand seconds: the
/// smoke check is served, every measured request refused.
const REFUSING_RULE: &str = r#"
levels:
  - {name: refusing, seats: 4, queues: 8, handSize: 2, queueLength: 10, maxWait: 1s}
rules:
  - name: stack-refusal
    precedence: 100
    match:
      groups: ["system:authenticated"]
    level: refusing
    rate: {qps: 0.001, burst: 1}
"#;

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let dir = tempfile::tempdir().expect("a folder for the certificates and rules");
    let pki = Pki::new();
    let here = runtime.handle().clone();
    let upstream = runtime.block_on(upstream(&pki, dir.path()));
    let mut floor = runtime.block_on(floor(&here, &pki, upstream));
    let (refusing, mut refused) = runtime.block_on(bulwark(
        &here,
        &pki,
        upstream,
        &dir.path().join("refusing"),
        REFUSING_RULE,
    ));
    let (running, mut bulwark) = runtime.block_on(bulwark(
        &here,
        &pki,
        upstream,
        &dir.path().join("answering"),
        MEASURED_RULE,
    ));

    let mut group = c.benchmark_group("stack");
    group.bench_function("floor", |b| {
        b.iter_custom(|n| requests(&runtime, &mut floor, n, StatusCode::OK))
    });
    group.bench_function("bulwark", |b| {
        b.iter_custom(|n| requests(&runtime, &mut bulwark, n, StatusCode::OK))
    });
    group.bench_function("refused", |b| {
        b.iter_custom(|n| requests(&runtime, &mut refused, n, StatusCode::TOO_MANY_REQUESTS))
    });
    group.finish();
    runtime.block_on(running.drain());
    runtime.block_on(refusing.drain());
}

/// The time `n` requests take one after another on `client`, each answered `status` and
/// read whole.
fn requests(runtime: &Runtime, client: &mut Client, n: u64, status: StatusCode) -> Duration {
    runtime.block_on(async {
        let start = Instant::now();
        for _ in 0..n {
            let answer = client.send(with_token(get(PATH), TOKEN)).await;
            assert_eq!(answer.status, status, "{}", answer.text());
        }
        start.elapsed()
    })
}

/// A client on one end of an in-memory pair whose other end the future `serve` makes
/// serves, spawned on `proxy`.
async fn pair<F>(proxy: &Handle, serve: impl FnOnce(DuplexStream) -> F) -> Client
where
    F: Future<Output = ()> + Send + 'static,
{
    let (client, served) = tokio::io::duplex(PAIR_BUFFER);
    proxy.spawn(serve(served));
    let mut client = Client::plain(client).await.expect("the HTTP/2 handshake");
    // The first answer is the smoke check (and, through Bulwark, the token review the
    // measured requests find cached).
    let answer = client.send(with_token(get(PATH), TOKEN)).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert_eq!(answer.text(), OBJECT);
    client
}

/// The upstream: hyper's server over TLS on 127.0.0.1 (Bulwark's own serving TLS, with a
/// certificate from `pki`'s server CA written into `dir`), answering every TokenReview with
/// [`REVIEW`], [`PATH`] with [`OBJECT`] and anything else (the pool's readiness probes)
/// with `ok`.
async fn upstream(pki: &Pki, dir: &Path) -> SocketAddr {
    let (cert, key) = pki
        .server_ca
        .server_cert(&["127.0.0.1"])
        .write(dir, "upstream")
        .expect("the upstream's certificate");
    let tls = ServingTls::load(&cert, &key, &Metrics::new()).expect("the upstream's TLS");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let addr = listener.local_addr().expect("the port");
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = tls.acceptor();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service_fn(answer))
                    .await;
            });
        }
    });
    addr
}

async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = request.uri().path();
    let body = if path.ends_with("/tokenreviews") {
        match std::env::var("STACK_USER").as_deref() {
            Ok("serviceaccount") => SA_REVIEW,
            _ => REVIEW,
        }
    } else if path == PATH {
        OBJECT
    } else {
        "ok"
    };
    Ok(Response::builder()
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("a response"))
}

/// A client of the upstream's answers with no proxy between: hyper's auto server answering
/// as [`upstream`] does on the other end of the pair. The floor's count less this one is
/// what the floor's proxy costs (its two HTTP/2 connections, and the TLS and sockets of its
/// upstream leg on both ends), the base that Bulwark's count is compared with.
async fn direct(upstream: &Handle) -> Client {
    pair(upstream, |served| async move {
        let _ = auto::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(served), service_fn(answer))
            .await;
    })
    .await
}

/// A client of the floor: hyper's auto server on the pair with every setting its default,
/// forwarding on one HTTP/2 connection over TLS to `upstream`.
async fn floor(proxy: &Handle, pki: &Pki, upstream: SocketAddr) -> Client {
    let connector = TlsConnector::from(Arc::new(bulwark_testkit::tls_config(pki, None)));
    let service = proxy
        .spawn(async move {
            let tcp = TcpStream::connect(upstream).await.expect("the upstream");
            tcp.set_nodelay(true).expect("TCP_NODELAY");
            let tls = connector
                .connect(ServerName::from(upstream.ip()), tcp)
                .await
                .expect("the upstream's TLS handshake");
            let (sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                    .await
                    .expect("the upstream's HTTP/2 handshake");
            tokio::spawn(connection);
            let authority = Authority::try_from(upstream.to_string()).expect("an authority");
            service_fn(move |mut request: Request<Incoming>| {
                let mut sender = sender.clone();
                let mut parts = request.uri().clone().into_parts();
                parts.scheme = Some(Scheme::HTTPS);
                parts.authority = Some(authority.clone());
                *request.uri_mut() = Uri::from_parts(parts).expect("the upstream's URI");
                async move { sender.send_request(request).await }
            })
        })
        .await
        .expect("the floor's upstream connection");
    pair(proxy, |served| async move {
        let _ = auto::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(served), service)
            .await;
    })
    .await
}

/// Bulwark started as production starts it, in front of `upstream` as `passthrough`
/// configures it (the cache off) under `rule`, its files in `dir`, and a client of its
/// request path.
async fn bulwark(
    proxy: &Handle,
    pki: &Pki,
    upstream: SocketAddr,
    dir: &Path,
    rule: &str,
) -> (Running, Client) {
    std::fs::create_dir_all(dir).expect("the subject's folder");
    let serving_ca = Ca::new("stack-bench-serving-ca");
    let credentials =
        Credentials::mint(dir, pki, &serving_ca, Names::default()).expect("the certificates");
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).expect("the rules folder");
    std::fs::write(rules.join("stack.yaml"), rule).expect("the rule file");
    let mut config = BulwarkConfig::new(credentials, vec![upstream]);
    config.cache = false;
    config.rules = Some(rules);
    let running = proxy
        .spawn(async move {
            let running = Running::start(config.config())
                .await
                .expect("bulwark starts");
            let deadline = Instant::now() + Duration::from_secs(20);
            while let Err(why) = running.admin.ready() {
                assert!(
                    Instant::now() < deadline,
                    "bulwark never became ready: {why}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            running
        })
        .await
        .expect("bulwark's start");
    let peer = SocketAddr::from(([127, 0, 0, 1], 40_000));
    let client = pair(proxy, |served| running.serve_connection(served, peer)).await;
    (running, client)
}

criterion_group!(benches, bench);

/// Criterion's timings, or, with `STACK_COUNT=N` and
/// `STACK_SUBJECT=direct|floor|bulwark|refused` set, `N` requests through one subject after as many to warm it, for an instruction count:
/// `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='stack::counted'`
/// counts only the `N` (README "Benchmarks"). Instructions do not swing with the machine
/// as times do, so a change worth a fraction of a microsecond shows. `STACK_USER=
/// serviceaccount` makes the client a pod's ServiceAccount (three groups, five extras)
/// rather than a user with one group.
fn main() {
    // Warnings only, as the `bulwark` binary runs by default: without a subscriber, every
    // span hyper and h2 make would fall back to the `log` crate.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .init();
    let count = std::env::var("STACK_COUNT").ok();
    let Some(count) = count.and_then(|n| n.parse::<u64>().ok()) else {
        benches();
        Criterion::default().configure_from_args().final_summary();
        return;
    };
    let subject = std::env::var("STACK_SUBJECT").unwrap_or_default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let dir = tempfile::tempdir().expect("a folder for the certificates and rules");
    let pki = Pki::new();
    // With `STACK_SPLIT` set, the upstream and the proxy run on threads of their own, so
    // that callgrind's `--separate-threads=yes` counts the proxy's instructions alone.
    let (upstream_side, proxy) = if std::env::var_os("STACK_SPLIT").is_some() {
        (Some(runtime_thread("upstream")), runtime_thread("proxy"))
    } else {
        (None, runtime.handle().clone())
    };
    let upstream = match &upstream_side {
        Some(side) => side.block_on(upstream(&pki, dir.path())),
        None => runtime.block_on(upstream(&pki, dir.path())),
    };
    let (running, mut client) = match subject.as_str() {
        "direct" => {
            let side = upstream_side.unwrap_or_else(|| runtime.handle().clone());
            (None, runtime.block_on(direct(&side)))
        }
        "floor" => (None, runtime.block_on(floor(&proxy, &pki, upstream))),
        "bulwark" | "refused" => {
            let rule = if subject == "refused" {
                REFUSING_RULE
            } else {
                MEASURED_RULE
            };
            let (running, client) =
                runtime.block_on(bulwark(&proxy, &pki, upstream, dir.path(), rule));
            (Some(running), client)
        }
        other => panic!("STACK_SUBJECT must be direct, floor, bulwark or refused, not {other:?}"),
    };
    let status = if subject == "refused" {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    requests(&runtime, &mut client, count, status);
    let took = counted(&runtime, &mut client, count, status);
    println!(
        "{subject}: {count} requests, {:.1} µs each",
        took.as_secs_f64() * 1e6 / count as f64
    );
    if let Some(running) = running {
        runtime.block_on(running.drain());
    }
}

/// A current-thread runtime driven by a thread of its own.
fn runtime_thread(name: &str) -> Handle {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))
        .expect("a thread");
    handle
}

/// The requests an instruction count counts (see `main`).
#[inline(never)]
fn counted(runtime: &Runtime, client: &mut Client, n: u64, status: StatusCode) -> Duration {
    requests(runtime, client, n, status)
}
