//! Figures for the watch-fed cache (a program, not a timed test; it asserts nothing):
//! - memory: growth of this process's RSS, from the OS, when the cache syncs 10,000
//!   secrets of 10 KiB, against their JSON size;
//! - fan-out: N watchers (2,000 by default) through the listener, events created in the
//!   simulator at a steady rate: upstream watches the simulator sees, delivery p99, RSS;
//! - LIST `resourceVersion=0` of 5,000 secrets: requests per second and p99 from the cache
//!   (through Bulwark's whole request path, authorized), from the simulator directly, and
//!   from a plain hyper server sending the same pre-encoded bytes over TLS (the limit of
//!   this machine).
//!
//! Run: `cargo bench -p bulwark --bench cache` (add `--profile dev` for a quick look; the
//! ratios matter, not the absolute figures). `BENCH_SECONDS` sets each load's duration.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulwark_testkit::{Cluster, Setup};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

type Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr, pki: &bulwark_sim::Pki, user: &str) -> anyhow::Result<Sender> {
    let cert = pki.client_ca.client_cert(user, &[]);
    let config = bulwark_sim::client::tls_config(pki, Some(&cert), &[b"h2"])?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(rustls::pki_types::ServerName::try_from("127.0.0.1")?, tcp)
        .await?;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// `streams` concurrent GET loops over `connections` connections for `seconds`.
async fn load(
    name: &str,
    addr: SocketAddr,
    pki: &bulwark_sim::Pki,
    path: &str,
    seconds: u64,
) -> anyhow::Result<(f64, Duration)> {
    let (connections, streams) = (2, 8);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for c in 0..connections {
        let sender = connect(addr, pki, "alice").await?;
        for _ in 0..streams / connections {
            let mut sender = sender.clone();
            let uri = format!("https://127.0.0.1{path}");
            let _ = c;
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut bytes = 0usize;
                while Instant::now() < deadline {
                    let started = Instant::now();
                    let request = http::Request::get(&uri).body(Full::new(Bytes::new()))?;
                    sender.ready().await?;
                    let response = sender.send_request(request).await?;
                    anyhow::ensure!(response.status() == 200, "status {}", response.status());
                    bytes += response.into_body().collect().await?.to_bytes().len();
                    latencies.push(started.elapsed());
                }
                Ok::<_, anyhow::Error>((latencies, bytes))
            }));
        }
    }
    let started = Instant::now();
    let mut all = Vec::new();
    let mut bytes = 0;
    for task in tasks {
        let (latencies, b) = task.await??;
        all.extend(latencies);
        bytes += b;
    }
    let elapsed = started.elapsed().as_secs_f64().max(seconds as f64);
    all.sort();
    let p99 = all.get(all.len() * 99 / 100).copied().unwrap_or_default();
    let rate = all.len() as f64 / elapsed;
    println!(
        "| {name:<26} | {rate:>8.1} | {:>8.1} | {:>9.1} |",
        p99.as_secs_f64() * 1000.0,
        bytes as f64 / elapsed / 1e6
    );
    Ok((rate, p99))
}

/// A plain HTTP/2 server over TLS answering every request with `body`.
async fn plain_server(pki: &bulwark_sim::Pki, body: Bytes) -> anyhow::Result<SocketAddr> {
    let cert = pki.server_ca.server_cert(&["127.0.0.1"]);
    let chain =
        rustls_pemfile::certs(&mut cert.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key = rustls_pemfile::private_key(&mut cert.key_pem.as_bytes())?
        .ok_or_else(|| anyhow::anyhow!("no key"))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let body = body.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |_req| {
                    let body = body.clone();
                    async move {
                        let mut response = http::Response::new(Full::new(body));
                        response.headers_mut().insert(
                            "content-type",
                            http::HeaderValue::from_static("application/json"),
                        );
                        Ok::<_, std::convert::Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// Bulwark with its cache on in front of `replicas` seeded with `seed`; every client is
/// exempt from admission (the test kit's default rules).
fn with_cache(replicas: usize, seed: &'static str) -> Setup {
    Setup {
        replicas,
        seed: vec![seed],
        cache: true,
        bookmark_interval: Duration::from_millis(200),
        settings: vec![("cache.syncCap", "30s")],
        ..Setup::default()
    }
}

/// Watchers through Bulwark, events at a steady rate, delivery latency from the write in
/// the simulator's store to the line arriving at each watcher.
async fn fan_out() -> anyhow::Result<()> {
    let watchers: usize = std::env::var("WATCHERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let events: usize = std::env::var("EVENTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let cluster = Cluster::start(with_cache(2, "endpoints=100x1KiB@default"))
        .await
        .ready()
        .await;
    let rss_before = rss_bytes();
    let per_connection = 100;
    // Each connection is opened just before its first watch: the listener closes a
    // connection that sends no request within its header timeout.
    let mut senders: Vec<Sender> = Vec::new();
    let created: Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>> = Arc::default();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Vec<Duration>>();
    for i in 0..watchers {
        if i % per_connection == 0 {
            senders.push(connect(cluster.bulwark.addr, &cluster.pki, "alice").await?);
        }
        let mut sender = senders[i / per_connection].clone();
        let request = http::Request::get(
            "https://127.0.0.1/api/v1/namespaces/default/endpoints?watch=1&resourceVersion=0",
        )
        .body(Full::new(Bytes::new()))?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        anyhow::ensure!(
            response.status() == 200,
            "watch status {}",
            response.status()
        );
        let mut body = response.into_body();
        let created = created.clone();
        let done = done_tx.clone();
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut buffer = Vec::new();
            while latencies.len() < events {
                let Some(Ok(frame)) = body.frame().await else {
                    break;
                };
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                let now = Instant::now();
                buffer.extend_from_slice(&data);
                while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = buffer.drain(..=end).collect();
                    let text = String::from_utf8_lossy(&line);
                    if let Some(at) = text
                        .split("\"name\":\"")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        && at.starts_with("bench-")
                        && let Some(t) = created.lock().unwrap().get(at).copied()
                    {
                        latencies.push(now - t);
                    }
                }
            }
            let _ = done.send(latencies);
        });
    }
    drop(done_tx);
    let upstream_watches: u64 = cluster.fleet.stats().iter().map(|s| s.open_watches).sum();
    let started = Instant::now();
    for i in 0..events {
        let name = format!("bench-{i}");
        created.lock().unwrap().insert(name.clone(), Instant::now());
        cluster.fleet.store().create(
            "endpoints",
            "default",
            serde_json::json!({"metadata": {"name": name}, "subsets": [{"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 80}]}]}),
        )?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut all = Vec::new();
    while let Some(latencies) = done_rx.recv().await {
        all.extend(latencies);
    }
    let rss_after = rss_bytes();
    all.sort();
    let p = |q: usize| {
        all.get(all.len() * q / 100)
            .copied()
            .unwrap_or_default()
            .as_secs_f64()
            * 1000.0
    };
    println!("## fan-out: {watchers} watchers of endpoints, {events} events at 20/s");
    println!(
        "| upstream watches | deliveries | expected | p50 ms | p99 ms | RSS growth | elapsed |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {upstream_watches} | {} | {} | {:.1} | {:.1} | {:.1} MB | {:.1} s |",
        all.len(),
        watchers * events,
        p(50),
        p(99),
        rss_after.saturating_sub(rss_before) as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    println!();
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);

    // Memory: the fleet (and its copy of the objects) first, then the cache.
    let setup = with_cache(1, "secrets=10000x10KiB");
    let (fleet, pki) = bulwark_testkit::start_fleet(&setup).await;
    let json = fleet.store().live_bytes();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_bytes();
    let synced_at = Instant::now();
    let cluster = Cluster::in_front_of(fleet, pki, setup).await.ready().await;
    let sync = synced_at.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = rss_bytes();
    let (count, cached) = cluster
        .cache()
        .scope_size("secrets", None)
        .unwrap_or_default();
    println!("## memory: 10,000 secrets of 10 KiB");
    println!("| objects | JSON bytes | cached bytes | RSS growth | growth / JSON | sync time |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {count} | {:.1} MB | {:.1} MB | {:.1} MB | {:.2}x | {:.2} s |",
        json as f64 / 1e6,
        cached as f64 / 1e6,
        after.saturating_sub(before) as f64 / 1e6,
        after.saturating_sub(before) as f64 / json as f64,
        sync.as_secs_f64()
    );
    drop(cluster);

    fan_out().await?;

    // Throughput of LIST resourceVersion=0 of 5,000 secrets.
    let cluster = Cluster::start(with_cache(1, "secrets=5000x1KiB"))
        .await
        .ready()
        .await;
    let path = "/api/v1/secrets?resourceVersion=0";
    let mut sender = connect(cluster.bulwark.addr, &cluster.pki, "alice").await?;
    let response = sender
        .send_request(
            http::Request::get(format!("https://127.0.0.1{path}")).body(Full::new(Bytes::new()))?,
        )
        .await?;
    let encoded = response.into_body().collect().await?.to_bytes();
    let plain = plain_server(&cluster.pki, encoded.clone()).await?;
    println!();
    println!(
        "## LIST resourceVersion=0 of 5,000 secrets ({:.1} MB each), {seconds} s, 8 streams over 2 connections",
        encoded.len() as f64 / 1e6
    );
    println!("| server                     | req/s    | p99 ms   | MB/s      |");
    println!("|---|---|---|---|");
    let (cache_rate, _) = load(
        "cache (authorized, TLS)",
        cluster.bulwark.addr,
        &cluster.pki,
        path,
        seconds,
    )
    .await?;
    let (sim_rate, _) = load(
        "simulator",
        cluster.fleet.addrs()[0],
        &cluster.pki,
        path,
        seconds,
    )
    .await?;
    let (plain_rate, _) = load(
        "plain hyper, same bytes",
        plain,
        &cluster.pki,
        path,
        seconds,
    )
    .await?;
    println!();
    println!(
        "cache / simulator: {:.1}x; cache / plain hyper: {:.0} %",
        cache_rate / sim_rate.max(f64::MIN_POSITIVE),
        100.0 * cache_rate / plain_rate.max(f64::MIN_POSITIVE)
    );
    Ok(())
}
