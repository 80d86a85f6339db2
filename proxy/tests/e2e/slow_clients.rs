//! Clients that are slow on purpose cannot shut others out of a level: one that never
//! reads its responses gives its seats back after `sendProgressTimeout`, one flow never
//! holds every seat of a level, a cached watch's seats come back once its initial state is
//! encoded, and a request body that trickles in holds no seat at all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;

use bulwark_testkit::{Cluster, Setup, tls_config};

type Body = BoxBody<Bytes, std::convert::Infallible>;

const SECRETS: &str = "/api/v1/namespaces/team/secrets";
/// One Secret: a GET takes one seat, where a LIST may take several.
const ONE: &str = "/api/v1/namespaces/team/secrets/secret-1";

/// Rules with one level, `narrow`, for carol, mallory and alice, each their own flow; `{cap}` is
/// the level's `maxSeatsPerFlow`.
fn rules(seats: u32, cap: u32, max_wait: &str) -> &'static str {
    let text = format!(
        r#"
levels:
  - name: narrow
    seats: {seats}
    maxSeatsPerFlow: {cap}
    queues: 8
    handSize: 2
    maxWait: {max_wait}
rules:
  - name: slow
    precedence: 100
    match:
      users: ["carol", "mallory", "alice"]
    level: narrow
    flow: user
"#
    );
    Box::leak(text.into_boxed_str())
}

/// An HTTP/2 connection as `user` whose streams open with a window of `window` bytes (0: the
/// server may send no body byte until the client says so, which it never does here).
async fn connect(cluster: &Cluster, user: &str, window: u32) -> http2::SendRequest<Body> {
    let cert = cluster.pki.client_ca.client_cert(user, &[]);
    let tcp = tokio::net::TcpStream::connect(cluster.bulwark.addr)
        .await
        .unwrap();
    let tls = TlsConnector::from(Arc::new(tls_config(&cluster.pki, Some(&cert))))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    let (sender, conn) = http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(window)
        .adaptive_window(false)
        .handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

fn get(path: &str) -> Request<Body> {
    Request::get(format!("https://127.0.0.1{path}"))
        .body(http_body_util::Empty::new().boxed())
        .unwrap()
}

/// Seats executing in `level` now, from `/debug/levels`.
async fn executing_seats(cluster: &Cluster, level: &str) -> u64 {
    let (status, body) = cluster.admin_get("/debug/levels").await;
    assert_eq!(status, 200, "{body}");
    let levels: serde_json::Value = serde_json::from_str(&body).unwrap();
    levels["levels"]
        .as_array()
        .unwrap_or_else(|| panic!("{levels}"))
        .iter()
        .find(|l| l["name"] == level && l["draining"] == false)
        .unwrap_or_else(|| panic!("no level {level} in {levels}"))["executingSeats"]
        .as_u64()
        .unwrap()
}

fn cut(cluster: &Cluster) -> f64 {
    cluster.metric_sum("bulwark_responses_cut_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_gives_its_seats_back_and_the_level_serves_others() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=50x1KiB@team"],
        rules: rules(2, 2, "20s"),
        settings: vec![("listen.limits.sendProgressTimeout", "1s")],
        ..super::setup()
    })
    .await;
    // A window of 0: Bulwark may send carol no byte of her answers.
    let mut carol = connect(&cluster, "carol", 0).await;
    let mut held = Vec::new();
    for path in [ONE, SECRETS] {
        carol.ready().await.unwrap();
        let response = carol.send_request(get(path)).await.unwrap();
        assert_eq!(response.status(), 200);
        held.push(response);
    }
    assert_eq!(
        executing_seats(&cluster, "narrow").await,
        2,
        "carol's unread answers hold both seats"
    );
    assert!(cluster.list_bytes_in_flight() > 0.0, "and her LIST's bytes");
    // Alice queues behind them; before the deadline she would wait her whole maxWait.
    let mut alice = connect(&cluster, "alice", 65_535).await;
    alice.ready().await.unwrap();
    let asked = Instant::now();
    let answer = alice.send_request(get(ONE)).await.unwrap();
    let waited = asked.elapsed();
    assert_eq!(answer.status(), 200, "{:?}", answer.headers());
    answer.into_body().collect().await.unwrap();
    assert!(
        waited < Duration::from_secs(10),
        "alice got in once carol's seats came back, not at her maxWait: {waited:?}"
    );
    assert!(cut(&cluster) >= 1.0, "an unread response was cut");
    assert_eq!(executing_seats(&cluster, "narrow").await, 0);
    assert_eq!(
        cluster.list_bytes_in_flight(),
        0.0,
        "the LIST's bytes are back"
    );
    // Carol's connection is closed: her answers end in an error, never as complete lists.
    for response in held {
        let read = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
            .await
            .expect("a cut response ends");
        assert!(read.is_err(), "a cut response is reset, not completed");
    }
    let metrics = cluster.metrics();
    assert!(
        metrics.contains(r#"bulwark_connections_closed_total{reason="client_not_reading"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_slowly_is_not_cut() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=200x1KiB@team"],
        rules: rules(2, 2, "20s"),
        settings: vec![("listen.limits.sendProgressTimeout", "1s")],
        ..super::setup()
    })
    .await;
    // A small window, opened again as the client reads one frame every 10 ms: a read
    // that takes far longer than the deadline, but moves all the time.
    let mut reader = connect(&cluster, "alice", 16 * 1024).await;
    reader.ready().await.unwrap();
    let response = reader.send_request(get(SECRETS)).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut bytes = 0;
    let started = Instant::now();
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap_or_else(|e| panic!("cut after {bytes} bytes: {e}"));
        bytes += frame.data_ref().map_or(0, Bytes::len);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(bytes > 200 * 1024, "the whole list arrived: {bytes} bytes");
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "the read took longer than the deadline: {:?}",
        started.elapsed()
    );
    assert_eq!(cut(&cluster), 0.0, "a client that reads is never cut");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flow_never_holds_every_seat_of_a_level() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        seed: vec!["secrets=20x1KiB@team"],
        // The default cap of a 4-seat level: 3 seats for one flow.
        rules: Box::leak(
            rules(4, 3, "2s")
                .replace("    maxSeatsPerFlow: 3\n", "")
                .into_boxed_str(),
        ),
        settings: vec![("listen.limits.sendProgressTimeout", "5m")],
        ..super::setup()
    })
    .await;
    let mut mallory = connect(&cluster, "carol", 0).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        mallory.ready().await.unwrap();
        held.push(mallory.send_request(get(ONE)).await.unwrap());
    }
    // Mallory's fourth waits for one of her own seats, and is refused at her maxWait.
    mallory.ready().await.unwrap();
    let fourth = tokio::spawn(mallory.send_request(get(ONE)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(executing_seats(&cluster, "narrow").await, 3);
    let mut alice = connect(&cluster, "alice", 65_535).await;
    alice.ready().await.unwrap();
    let answer = alice.send_request(get(ONE)).await.unwrap();
    assert_eq!(
        answer.status(),
        200,
        "the seat one flow may not take is alice's"
    );
    let fourth = fourth.await.unwrap().unwrap();
    assert_eq!(fourth.status(), 429);
    assert_eq!(fourth.headers()["x-bulwark-reason"], "queue_timeout");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_watch_gives_its_seats_back_once_its_state_is_encoded() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        cache: true,
        seed: vec!["secrets=200x1KiB@team"],
        rules: rules(1, 1, "2s"),
        settings: vec![("listen.limits.sendProgressTimeout", "1s")],
        ..super::setup()
    })
    .await
    .ready()
    .await;
    let mut mallory = connect(&cluster, "carol", 0).await;
    mallory.ready().await.unwrap();
    let watch = mallory
        .send_request(get(&format!("{SECRETS}?watch=1&resourceVersion=0")))
        .await
        .unwrap();
    assert_eq!(watch.status(), 200);
    assert!(
        cluster
            .upstream_requests_of("carol")
            .iter()
            .all(|path| !path.contains("watch")),
        "the watch is the cache's"
    );
    assert_eq!(
        executing_seats(&cluster, "narrow").await,
        0,
        "the state is encoded: the seat is back though nothing was sent"
    );
    let mut alice = connect(&cluster, "alice", 65_535).await;
    alice.ready().await.unwrap();
    let answer = alice.send_request(get(SECRETS)).await.unwrap();
    assert_eq!(answer.status(), 200);
    // The state mallory never reads is let go at the deadline: the watch is cut.
    tokio::time::timeout(Duration::from_secs(5), async {
        while cut(&cluster) < 1.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the unread watch is cut");
    drop(watch);
}

/// A POST whose body sends one byte and then nothing; the sender keeps it open.
fn trickling_post(path: &str) -> (Request<Body>, mpsc::Sender<Bytes>) {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|bytes| (Ok(http_body::Frame::data(bytes)), rx))
    });
    let request = Request::post(format!("https://127.0.0.1{path}"))
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .unwrap();
    (request, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_trickles_in_holds_no_seat_and_gets_408() {
    let cluster = Cluster::start(Setup {
        replicas: 1,
        rules: rules(2, 2, "20s"),
        settings: vec![("listen.limits.bodyProgressTimeout", "1s")],
        ..super::setup()
    })
    .await;
    let mut mallory = connect(&cluster, "mallory", 65_535).await;
    let mut posts = Vec::new();
    let mut senders = Vec::new();
    for _ in 0..4 {
        let (request, tx) = trickling_post("/api/v1/namespaces/team/configmaps");
        tx.send(Bytes::from_static(b"{")).await.unwrap();
        mallory.ready().await.unwrap();
        posts.push(tokio::spawn(mallory.send_request(request)));
        senders.push(tx);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        executing_seats(&cluster, "narrow").await,
        0,
        "a body still arriving holds no seat"
    );
    let mut alice = connect(&cluster, "alice", 65_535).await;
    alice.ready().await.unwrap();
    let asked = Instant::now();
    let answer = alice.send_request(get(SECRETS)).await.unwrap();
    assert_eq!(answer.status(), 200);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "alice did not queue"
    );
    for post in posts {
        let response = post.await.unwrap().unwrap();
        assert_eq!(response.status(), 408, "{:?}", response.headers());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let status: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status["code"], 408);
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains("no bytes for 1s"),
            "{status}"
        );
    }
    drop(senders);
}
