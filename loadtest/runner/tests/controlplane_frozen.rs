//! A kube-apiserver replica that stops answering (SIGSTOP) while clients read through
//! Bulwark: the probe ejects it within about a second, and the reads that were waiting on
//! it go to the other replicas then, instead of waiting out the one-minute request timeout.
//! A read whose answer had begun when the replica stopped cannot go elsewhere (its head is
//! the client's already): its body is ended with a reset soon after the ejection, counted,
//! rather than left to hang until the client gives up. Every other read succeeds, and the
//! slowest read of all takes about the ejection time. The replica gets
//! SIGCONT whatever happens, so the control plane can stop. Without the binaries the
//! control plane builds them (`loadtest/controlplane/build.sh`, Go 1.26) or fails: this
//! test never skips.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bulwark_loadtest::controlplane::{ControlPlane, Options};
use kube::Client;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The replica frozen (replica 0 also serves the `direct-admin` kubeconfig; keep it whole).
const FROZEN: usize = 1;
/// Concurrent readers.
const READERS: usize = 8;
/// What the readers read: a get and two lists, none of them answered by Bulwark's cache.
const PATHS: [&str; 3] = [
    "/api/v1/namespaces/default",
    "/api/v1/namespaces",
    "/api/v1/namespaces/kube-system/configmaps",
];
/// One read: how long it took and whether it succeeded (or why not).
type Read = (Duration, Result<(), String>);

/// Reads `PATHS` in turn until `stop`. The harness's clients give up on a read after 30 s
/// (their read timeout): a read left waiting on the frozen replica fails there.
async fn reader(client: Client, stop: Arc<AtomicBool>) -> Vec<Read> {
    let mut reads = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let path = PATHS[n % PATHS.len()];
        n += 1;
        let request = http::Request::get(path).body(Vec::new()).unwrap();
        let started = Instant::now();
        let outcome = match client.request_text(request).await {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("{path}: {e}")),
        };
        reads.push((started.elapsed(), outcome));
    }
    reads
}

/// A GET on Bulwark's admin listener (plain HTTP): the body.
async fn admin_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    raw.split_once("\r\n\r\n")
        .map_or(raw.clone(), |(_, body)| body.to_owned())
}

/// The sum of every sample of `name` whose labels contain each of `labels`.
fn sample(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_leave_a_frozen_apiserver_at_its_ejection() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = Options::new(dir.path().join("cp"));
    opts.bulwark_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_bulwark-loadtest")));
    let cp = ControlPlane::start(opts)
        .await
        .expect("the control plane starts");
    let admin = cp.bulwark_admin_addr().expect("Bulwark's admin listener");
    let frozen_name = cp.replica_addrs()[FROZEN].to_string();
    let client = cp.client_without_retries("admin").await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|_| tokio::spawn(reader(client.clone(), stop.clone())))
        .collect();
    // Reads spread over every replica first, so that Bulwark holds a connection to each.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let frozen_at = Instant::now();
    let reads = {
        let _frozen = cp.freeze_replica(FROZEN).expect("the replica is running");
        tokio::time::sleep(Duration::from_secs(8)).await;
        stop.store(true, Ordering::Relaxed);
        let mut reads = Vec::new();
        for reader in readers {
            reads.extend(reader.await.expect("a reader ran"));
        }
        reads
        // SIGCONT here, and on any panic above.
    };
    let held = frozen_at.elapsed();
    let failed: Vec<&String> = reads.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
    let slowest = reads
        .iter()
        .map(|(took, _)| *took)
        .max()
        .unwrap_or_default();
    let metrics = admin_get(admin, "/metrics").await;
    let left = sample(
        &metrics,
        "bulwark_upstream_retries_total",
        &[
            &format!("replica=\"{frozen_name}\""),
            "reason=\"unresponsive\"",
        ],
    );
    let cut = sample(
        &metrics,
        "bulwark_responses_cut_total",
        &["reason=\"upstream_unresponsive\""],
    );
    eprintln!(
        "frozen replica {frozen_name} for {held:?}: {} reads, {} failed, slowest {slowest:?}, \
         {left} reads moved off it at its ejection, {cut} answers cut mid-body",
        reads.len(),
        failed.len(),
    );
    // Only answers already begun on the frozen replica may fail, each a body cut there (at
    // most one a reader), and each counted.
    assert!(failed.len() <= READERS, "failed reads: {failed:?}");
    assert!(
        failed.iter().all(|e| e.contains("body")),
        "a read failed other than mid-body: {failed:?}"
    );
    assert!(
        cut >= failed.len() as f64,
        "{} reads failed, {cut} answers cut: {failed:?}",
        failed.len()
    );
    assert!(left >= 1.0, "no read was waiting on the frozen replica");
    // The probe (every second, no answer within a second) ejects it in about two seconds;
    // a read waiting on it then goes elsewhere, far from the one-minute request timeout.
    assert!(
        slowest < Duration::from_secs(10),
        "slowest read {slowest:?}"
    );
    cp.stop().await.expect("the control plane stops");
}
