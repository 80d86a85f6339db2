//! `informers` and `node-join`: every node runs a kube-proxy-like informer on
//! EndpointSlices (LIST `resourceVersion=0`, then WATCH with bookmarks) and kubelet-like
//! watches of its own two Secrets, while a churn client updates EndpointSlices; the figure
//! that matters is event delivery latency (write acknowledged → event received).
//!
//! `informers` also measures what the nodes cost the process that serves their watches
//! (Bulwark, or with `--controlplane --only direct` every kube-apiserver): its memory before
//! the nodes connect, once every connection is open and idle (one GET each), and with every
//! watch open, and its CPU per delivered event in the steady state; a second churn updates
//! Secrets, so that a Secret's way to its one watcher is timed beside an EndpointSlice's to
//! every kube-proxy.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bulwark_sim::pki::Pki;
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::Method;
use serde::Deserialize;
use tokio::time::Instant;

use super::{Classes, Driven, Env, Options, Persona, Scenario, Setup};
#[cfg(test)]
use crate::client::HEAD_BYTES;
use crate::client::{
    ClassStats, Client, Framing, Identity, Outcome, PROTOBUF_FIRST, Read, Tally, Target,
    new_histogram,
};
use crate::proxy_process;
use crate::report::WatchCost;

/// The steady-state scenario.
pub struct Informers;

/// The join-wave scenario.
pub struct NodeJoin;

/// Secrets updated by the Secret churn client (when the run measures its watch cost), in
/// total per second.
const SECRET_CHURN_PER_SECOND: u64 = 10;
/// How long after the last node's watches started the steady state begins: their lists
/// are answered and the first bookmarks sent (a quarter of the run in a short one).
const SETTLE: Duration = Duration::from_secs(10);
/// How long every node's connections idle, open, before their watches start (an eighth of
/// the run in a short one).
const IDLE_BEFORE_WATCHES: Duration = Duration::from_secs(3);
/// How long a received event waits for its write's acknowledgement to be matched.
const MATCH_WINDOW: Duration = Duration::from_secs(5);
const SLICES_PATH: &str = "/apis/discovery.k8s.io/v1/endpointslices";

/// When each churn write was acknowledged, by the resourceVersion it produced.
#[derive(Default)]
pub(super) struct Acks {
    at: RwLock<HashMap<u64, Instant>>,
}

/// Where a watcher matches events to writes and records their latency.
#[derive(Clone)]
pub(super) struct Delivery {
    acks: Arc<Acks>,
    /// Every matched event's latency, in µs.
    each: Arc<Mutex<Histogram<u64>>>,
    /// Per update (by resourceVersion): how many watchers received it, and the latest of
    /// their latencies in µs.
    reach: Arc<Mutex<HashMap<u64, (usize, u64)>>>,
}

impl Delivery {
    fn new() -> Delivery {
        Delivery {
            acks: Arc::default(),
            each: Arc::new(Mutex::new(new_histogram())),
            reach: Arc::default(),
        }
    }

    /// p50, p99 and max of every matched event's latency, in ms.
    fn each_ms(&self) -> Option<[f64; 3]> {
        let h = self.each.lock().ok()?;
        quantiles_ms(&h)
    }

    /// p50, p99 and max, in ms, of the time until the last of `watchers` received an
    /// update, over the updates all of them received; and how many those were.
    fn to_all_ms(&self, watchers: usize) -> (Option<[f64; 3]>, u64) {
        let mut h = new_histogram();
        if let Ok(reach) = self.reach.lock() {
            for &(n, last) in reach.values() {
                if n >= watchers {
                    h.saturating_record(last);
                }
            }
        }
        (quantiles_ms(&h), h.len())
    }
}

/// p50, p99 and max of a µs histogram, in ms; `None` when it is empty.
fn quantiles_ms(h: &Histogram<u64>) -> Option<[f64; 3]> {
    (!h.is_empty()).then(|| [0.5, 0.99, 1.0].map(|q| h.value_at_quantile(q) as f64 / 1000.0))
}

/// The counts of one run.
pub(super) struct Sizes {
    nodes: usize,
    slices: usize,
    /// Secret watches a node holds, each of a Secret of its own.
    secrets_per_node: usize,
    /// Whether a node's EndpointSlice watch has a connection of its own (kube-proxy's).
    kube_proxy_apart: bool,
    /// EndpointSlices updated by the churn client, in total per second.
    slice_churn: u64,
}

pub(super) fn sizes(opts: &Options, nodes: usize) -> Sizes {
    Sizes {
        nodes: opts.scaled(nodes, 2),
        slices: opts.endpointslices.unwrap_or_else(|| opts.scaled(500, 10)),
        secrets_per_node: opts.secrets_per_node.max(1),
        kube_proxy_apart: opts.kube_proxy_apart,
        slice_churn: opts.slice_churn,
    }
}

/// How long the nodes take to connect, and then to start their watches: `--join-window`,
/// else 5 s; at most a quarter of the run either way, so that a steady state is left.
pub(super) fn join_window(opts: &Options, duration: Duration) -> Duration {
    opts.join_window
        .unwrap_or(Duration::from_secs(5))
        .min(duration / 4)
}

pub(super) fn seed(s: &Sizes) -> Vec<String> {
    vec![
        format!("endpointslices={}x1KiB", s.slices),
        format!("secrets={}x2KiB", s.secrets_per_node * s.nodes),
    ]
}

/// The head of a watch event: its type and the object's resourceVersion.
#[derive(Deserialize)]
struct EventHead {
    #[serde(rename = "type")]
    kind: String,
    object: ObjectHead,
}

#[derive(Deserialize)]
struct ObjectHead {
    #[serde(default)]
    metadata: Meta,
}

#[derive(Deserialize, Default)]
struct Meta {
    #[serde(default, rename = "resourceVersion")]
    resource_version: Option<String>,
}

/// A protobuf object's metadata: field 1 of every kind this scenario watches (Secret,
/// EndpointSlice); the rest of the message is skipped.
#[derive(Clone, PartialEq, prost::Message)]
struct MetadataOnly {
    #[prost(message, optional, tag = "1")]
    metadata: Option<k8s_pb::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
}

/// A watch event's type and its object's resourceVersion, in either encoding.
fn event_head(event: &[u8], framing: Framing) -> Option<(String, Option<String>)> {
    use prost::Message;
    match framing {
        Framing::Lines => {
            let event: EventHead = serde_json::from_slice(event).ok()?;
            Some((event.kind, event.object.metadata.resource_version))
        }
        Framing::LengthPrefixed => {
            let event =
                k8s_pb::apimachinery::pkg::apis::meta::v1::WatchEvent::decode(event).ok()?;
            let object = event.object.and_then(|o| o.raw).unwrap_or_default();
            let rv = object
                .strip_prefix(b"k8s\0")
                .and_then(|b| k8s_pb::apimachinery::pkg::runtime::Unknown::decode(b).ok())
                .and_then(|u| MetadataOnly::decode(u.raw?.as_slice()).ok())
                .and_then(|m| m.metadata?.resource_version);
            Some((event.r#type?, rv))
        }
    }
}

/// One length-delimited field `tag` of a protobuf message in `buf` (cut short where `buf`
/// ends), skipping the fields before it.
fn protobuf_field<'a>(buf: &mut &'a [u8], tag: u32) -> Option<&'a [u8]> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    loop {
        let (number, wire) = decode_key(buf).ok()?;
        match wire {
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(buf).ok()?).ok()?;
                let (value, rest) = buf.split_at(len.min(buf.len()));
                *buf = rest;
                if number == tag {
                    return Some(value);
                }
            }
            WireType::Varint => {
                decode_varint(buf).ok()?;
            }
            _ => return None,
        }
    }
}

/// The list's `metadata.resourceVersion` from the first bytes of a list response: JSON,
/// or protobuf (`k8s\0`, `runtime.Unknown.raw`, the list's `metadata`, which comes first).
fn list_rv(head: &[u8]) -> Option<String> {
    use prost::Message;
    if let Some(mut unknown) = head.strip_prefix(b"k8s\0") {
        let mut list = protobuf_field(&mut unknown, 2)?;
        let meta = protobuf_field(&mut list, 1)?;
        return k8s_pb::apimachinery::pkg::apis::meta::v1::ListMeta::decode(meta)
            .ok()?
            .resource_version;
    }
    let text = std::str::from_utf8(head).ok().or_else(|| {
        // The head may end inside a multi-byte character; the metadata comes first anyway.
        let valid = std::str::from_utf8(head).err()?.valid_up_to();
        std::str::from_utf8(&head[..valid]).ok()
    })?;
    let at = text.find("\"resourceVersion\":\"")? + "\"resourceVersion\":\"".len();
    let end = text[at..].find('"')?;
    Some(text[at..at + end].to_string())
}

/// A reflector: LIST `resourceVersion=0`, then WATCH from the list's version, re-watching
/// from the last seen version when a watch ends and relisting after an error. Events of
/// EndpointSlices are matched against the churn's acknowledgements.
///
/// The informers of one node record into one `tally` (so their back-off after errors is
/// the node's): a tally's histogram is about 180 KiB, too much to keep per watch at
/// 100,000 watches (7,500 nodes' would take 35 GiB, with another per watch for delivery
/// before these went straight into `delivery`'s).
pub(super) async fn reflector(
    mut client: Client,
    tally: &Mutex<Tally>,
    list_path: String,
    deadline: Instant,
    delivery: Option<Delivery>,
    received: Arc<Received>,
) {
    let mut pending: VecDeque<(u64, Instant)> = VecDeque::new();
    let sep = if list_path.contains('?') { '&' } else { '?' };
    'relist: while Instant::now() < deadline {
        let path = format!("{list_path}{sep}resourceVersion=0");
        let list = tokio::select! {
            o = client.call(Method::GET, &path, None, Read::Head, Duration::from_secs(60)) => o,
            _ = tokio::time::sleep_until(deadline) => break,
        };
        let pause = record(tally, &list);
        let Some(mut rv) = super::ok_body(&list).and_then(|b| list_rv(b)) else {
            tokio::time::sleep(pause.max(Duration::from_millis(100))).await;
            continue;
        };
        while Instant::now() < deadline {
            let path = format!(
                "{list_path}{sep}watch=1&allowWatchBookmarks=true&resourceVersion={rv}&timeoutSeconds=300"
            );
            let started = Instant::now();
            let stream = tokio::select! {
                s = client.stream(&path, Duration::from_secs(30)) => s,
                _ = tokio::time::sleep_until(deadline) => break 'relist,
            };
            let mut lines = match stream {
                Ok(lines) => {
                    record(
                        tally,
                        &Outcome::Ok {
                            bytes: 0,
                            latency: started.elapsed(),
                            body: None,
                        },
                    );
                    lines
                }
                Err(outcome) => {
                    let pause = record(tally, &outcome);
                    tokio::time::sleep(pause).await;
                    continue 'relist;
                }
            };
            loop {
                let line = tokio::select! {
                    l = lines.next() => l,
                    _ = tokio::time::sleep_until(deadline) => break 'relist,
                };
                received
                    .bytes
                    .fetch_add(lines.take_bytes(), Ordering::Relaxed);
                let line: Bytes = match line {
                    Ok(Some(line)) => line,
                    // The watch ended (timeout or the server closed it): resume from `rv`.
                    Ok(None) => break,
                    Err(e) => {
                        record(tally, &Outcome::Error(format!("watch cut: {e}")));
                        break;
                    }
                };
                let Some((kind, version)) = event_head(&line, lines.framing()) else {
                    continue;
                };
                received.events.fetch_add(1, Ordering::Relaxed);
                if kind != "BOOKMARK" {
                    received.changes.fetch_add(1, Ordering::Relaxed);
                }
                if kind == "ERROR" {
                    // 410 Gone or similar: start over with a fresh list.
                    continue 'relist;
                }
                if let Some(v) = version {
                    if kind == "MODIFIED"
                        && let Ok(n) = v.parse::<u64>()
                    {
                        pending.push_back((n, Instant::now()));
                    }
                    rv = v;
                }
                if let Some(delivery) = &delivery {
                    settle(delivery, &mut pending);
                }
            }
        }
    }
    if let Some(delivery) = &delivery {
        settle(delivery, &mut pending);
    }
}

/// Counts one outcome in a node's shared tally; the pause it asks for (`Tally::record`).
fn record(tally: &Mutex<Tally>, outcome: &Outcome) -> Duration {
    tally
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .record(outcome)
}

/// Watch bytes and events received by every node, for bytes per event.
#[derive(Default)]
pub(super) struct Received {
    bytes: AtomicU64,
    events: AtomicU64,
    /// Events other than bookmarks.
    changes: AtomicU64,
}

/// Records the delivery latency of every received event whose write has been acknowledged,
/// and counts the update as reaching one more watcher; an event that arrived before its
/// acknowledgement counts as zero.
fn settle(delivery: &Delivery, pending: &mut VecDeque<(u64, Instant)>) {
    let Ok(at) = delivery.acks.at.read() else {
        return;
    };
    let mut matched = Vec::new();
    pending.retain(|(rv, received)| match at.get(rv) {
        Some(acked) => {
            let micros = received.saturating_duration_since(*acked).as_micros();
            let micros = u64::try_from(micros).unwrap_or(u64::MAX).max(1);
            matched.push((*rv, micros));
            false
        }
        None => received.elapsed() < MATCH_WINDOW,
    });
    drop(at);
    if matched.is_empty() {
        return;
    }
    if let Ok(mut each) = delivery.each.lock() {
        for &(_, micros) in &matched {
            each.saturating_record(micros);
        }
    }
    if let Ok(mut reach) = delivery.reach.lock() {
        for (rv, micros) in matched {
            let (n, last) = reach.entry(rv).or_insert((0, 0));
            *n += 1;
            *last = (*last).max(micros);
        }
    }
}

/// When a node does what.
#[derive(Clone, Copy)]
struct Timing {
    /// A GET on each of its connections, then idle until `start` (when the run measures
    /// idle connections first).
    connect: Option<Instant>,
    /// Its watches start.
    start: Instant,
    /// Everything stops.
    deadline: Instant,
}

/// One node: its kubelet's watches of its `secrets` Secrets and its kube-proxy's of the
/// EndpointSlices, on `kubelet`'s connection, or the latter on `kube_proxy`'s where it has
/// one of its own.
async fn node(
    (mut kubelet, mut kube_proxy): (Client, Option<Client>),
    class: Arc<ClassStats>,
    (index, secrets): (usize, usize),
    timing: Timing,
    (slices_delivery, secrets_delivery): (Delivery, Option<Delivery>),
    received: Arc<Received>,
) {
    let all = Mutex::new(class.tally());
    if let Some(at) = timing.connect {
        tokio::time::sleep_until(at).await;
        for client in std::iter::once(&mut kubelet).chain(kube_proxy.as_mut()) {
            let outcome = client
                .call(
                    Method::GET,
                    "/api",
                    None,
                    Read::Count,
                    Duration::from_secs(30),
                )
                .await;
            record(&all, &outcome);
        }
    }
    tokio::time::sleep_until(timing.start).await;
    let slices = reflector(
        kube_proxy.unwrap_or_else(|| kubelet.clone()),
        &all,
        SLICES_PATH.into(),
        timing.deadline,
        Some(slices_delivery),
        received.clone(),
    );
    let secrets = futures::future::join_all((0..secrets).map(|k| {
        reflector(
            kubelet.clone(),
            &all,
            secret_path(secrets * index + k, true),
            timing.deadline,
            secrets_delivery.clone(),
            received.clone(),
        )
    }));
    tokio::join!(slices, secrets);
    class.done(all.into_inner().unwrap_or_else(|e| e.into_inner()));
}

/// Secret `n`'s path: its kubelet's watch path (a `fieldSelector` on its name in its
/// namespace) or the object's own.
fn secret_path(n: usize, watch: bool) -> String {
    let ns = n % 10;
    if watch {
        format!("/api/v1/namespaces/ns-{ns}/secrets?fieldSelector=metadata.name%3Dsecret-{n}")
    } else {
        format!("/api/v1/namespaces/ns-{ns}/secrets/secret-{n}")
    }
}

/// EndpointSlice `k`'s path.
fn slice_path(k: usize) -> String {
    format!(
        "/apis/discovery.k8s.io/v1/namespaces/ns-{}/endpointslices/endpointslice-{k}",
        k % 10
    )
}

/// Updates the objects at `paths` round robin, `per_second` in total, and records when
/// each write was acknowledged.
async fn churn(
    mut client: Client,
    class: Arc<ClassStats>,
    (paths, per_second): (Vec<String>, u64),
    acks: Arc<Acks>,
    deadline: Instant,
) {
    let mut tally = class.tally();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / per_second.max(1)));
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::time::sleep_until(deadline) => break,
        }
        let path = &paths[(n as usize) % paths.len()];
        let body = Bytes::from(format!(
            r#"{{"metadata":{{"labels":{{"loadtest.bulwark.dev/generation":"{n}"}}}}}}"#
        ));
        n += 1;
        let outcome = tokio::select! {
            o = client.call(Method::PATCH, path, Some((body, "application/merge-patch+json")), Read::Keep, Duration::from_secs(10)) => o,
            _ = tokio::time::sleep_until(deadline) => break,
        };
        let acked = Instant::now();
        if let Some(rv) = super::ok_body(&outcome)
            .and_then(|b| serde_json::from_slice::<ObjectHead>(b).ok())
            .and_then(|o| o.metadata.resource_version)
            .and_then(|v| v.parse::<u64>().ok())
            && let Ok(mut at) = acks.at.write()
        {
            at.insert(rv, acked);
        }
        tally.record(&outcome);
    }
    class.done(tally);
}

/// Whose memory and CPU a run's watch cost is read from: Bulwark's process, or every
/// kube-apiserver replica's.
pub(super) struct Meter {
    /// What the figures are of, in the report.
    pub(super) measured: &'static str,
    /// The processes' ids now.
    pub(super) pids: Box<dyn Fn() -> Vec<u32> + Send + Sync>,
}

impl Meter {
    /// Bulwark's process.
    pub(super) fn bulwark(pid: u32) -> Meter {
        Meter {
            measured: "Bulwark",
            pids: Box::new(move || vec![pid]),
        }
    }

    /// Resident memory and CPU seconds of its processes now, summed.
    fn now(&self) -> (u64, f64) {
        (self.pids)()
            .into_iter()
            .filter_map(proxy_process::usage)
            .fold((0, 0.0), |(rss, cpu), (r, c)| (rss + r, cpu + c))
    }
}

/// What the meter read at each step of a run.
#[derive(Default)]
struct Readings {
    before: u64,
    connected: u64,
    /// Resident memory sampled every second over the steady state.
    watching: Vec<u64>,
    /// CPU seconds and events received (not bookmarks) at the start and the end of the
    /// steady state.
    steady: Option<((f64, u64), (f64, u64))>,
}

/// Reads `meter` before the nodes connect, just before their watches start
/// (`watches_at`), then every second from `steady_from` until `deadline`.
async fn read_meter(
    meter: Arc<Meter>,
    received: Arc<Received>,
    (watches_at, steady_from, deadline): (Instant, Instant, Instant),
    readings: Arc<Mutex<Readings>>,
) {
    let read = move || {
        let meter = meter.clone();
        async move {
            tokio::task::spawn_blocking(move || meter.now())
                .await
                .unwrap_or_default()
        }
    };
    let store = |f: &dyn Fn(&mut Readings)| {
        if let Ok(mut r) = readings.lock() {
            f(&mut r);
        }
    };
    let (before, _) = read().await;
    store(&|r| r.before = before);
    tokio::time::sleep_until(watches_at - Duration::from_millis(500)).await;
    let (connected, _) = read().await;
    store(&|r| r.connected = connected);
    tokio::time::sleep_until(steady_from).await;
    let (_, cpu) = read().await;
    let first = (cpu, received.changes.load(Ordering::Relaxed));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() + Duration::from_secs(1) < deadline {
        tick.tick().await;
        let (rss, cpu) = read().await;
        let last = (cpu, received.changes.load(Ordering::Relaxed));
        store(&|r| {
            r.watching.push(rss);
            r.steady = Some((first, last));
        });
    }
}

/// How many nodes, how they come up, and what they measure.
pub(super) struct Plan<'a> {
    pub(super) sizes: &'a Sizes,
    pub(super) duration: Duration,
    /// Nodes start over this long.
    pub(super) join_window: Duration,
    pub(super) protobuf: bool,
    /// Connect every node first, churn Secrets too and read the watch cost off this meter.
    pub(super) meter: Option<Meter>,
}

/// Runs the plan's nodes, whose informers start spread over its join window, plus the
/// churn; `progress` reports on the classes while they run.
// Over 120 lines: the run's clients, its churns and its meter are set up in order and
// share the same deliveries and counts.
pub(super) async fn drive_nodes(
    target: &Target,
    progress: impl FnOnce(&Classes) -> tokio::task::JoinHandle<()>,
    pki: &Pki,
    plan: Plan<'_>,
) -> anyhow::Result<Driven> {
    let s = plan.sizes;
    let join_window = plan.join_window;
    let node_ids: Vec<Identity> = Persona::Nodes.mint(pki, s.nodes);
    // The EndpointSlice controller of kube-controller-manager.
    let churn_id = Persona::ServiceAccountsIn {
        namespace: "kube-system",
        name_prefix: "endpointslice-controller",
    }
    .mint(pki, 1);
    let nodes = ClassStats::new();
    let churner = ClassStats::new();
    let slices = Delivery::new();
    let secrets = plan.meter.is_some().then(Delivery::new);
    let received = Arc::new(Received::default());
    let started = Instant::now();
    let deadline = started + plan.duration;
    // With a meter, every node connects over the first window, then all idle a moment
    // before their watches start over the second.
    let watches_at = match plan.meter {
        Some(_) => started + join_window + IDLE_BEFORE_WATCHES.min(plan.duration / 8),
        None => started,
    };
    let mut classes = vec![
        ("nodes".to_string(), nodes.clone()),
        ("churn".to_string(), churner.clone()),
    ];
    let secret_churner = secrets.as_ref().map(|_| {
        let c = ClassStats::new();
        classes.push(("secret-churn".to_string(), c.clone()));
        c
    });
    let progress = progress(&classes);
    let readings = Arc::new(Mutex::new(Readings::default()));
    let steady_from = watches_at + join_window + SETTLE.min(plan.duration / 4);
    let meter = plan.meter.map(|meter| {
        let measured = meter.measured;
        let task = tokio::spawn(read_meter(
            Arc::new(meter),
            received.clone(),
            (watches_at, steady_from, deadline),
            readings.clone(),
        ));
        (measured, task)
    });
    let mut tasks = Vec::new();
    let spread = |i: usize| join_window.mul_f64(i as f64 / s.nodes as f64);
    for (i, id) in node_ids.iter().enumerate() {
        let connect = || -> anyhow::Result<Client> {
            let client = Client::new(target, id)?;
            Ok(if plan.protobuf {
                client.with_accept(PROTOBUF_FIRST)
            } else {
                client
            })
        };
        let kube_proxy = if s.kube_proxy_apart {
            Some(connect()?)
        } else {
            None
        };
        let timing = Timing {
            connect: meter.as_ref().map(|_| started + spread(i)),
            start: watches_at + spread(i),
            deadline,
        };
        tasks.push(tokio::spawn(node(
            (connect()?, kube_proxy),
            nodes.clone(),
            (i, s.secrets_per_node),
            timing,
            (slices.clone(), secrets.clone()),
            received.clone(),
        )));
    }
    for id in &churn_id {
        tasks.push(tokio::spawn(churn(
            Client::new(target, id)?,
            churner.clone(),
            ((0..s.slices).map(slice_path).collect(), s.slice_churn),
            slices.acks.clone(),
            deadline,
        )));
        if let (Some(secrets), Some(class)) = (&secrets, &secret_churner) {
            let paths = (0..s.nodes * s.secrets_per_node)
                .map(|n| secret_path(n, false))
                .collect();
            // The churns start once every watch has, so that each update has its watcher.
            let client = Client::new(target, id)?;
            let (class, acks) = (class.clone(), secrets.acks.clone());
            let at = watches_at + join_window;
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                churn(
                    client,
                    class,
                    (paths, SECRET_CHURN_PER_SECOND),
                    acks,
                    deadline,
                )
                .await;
            }));
        }
    }
    for t in tasks {
        t.await?;
    }
    progress.abort();
    let elapsed = started.elapsed();
    let watch_cost = match meter {
        Some((measured, task)) => {
            task.abort();
            let r = std::mem::take(&mut *readings.lock().unwrap_or_else(|e| e.into_inner()));
            // A run too short for a steady state measured none.
            let ((cpu0, events0), (cpu1, events1)) = r.steady.unwrap_or_default();
            let (slice_to_all_ms, slice_updates_to_all) = slices.to_all_ms(s.nodes);
            (!r.watching.is_empty()).then(|| WatchCost {
                measured: measured.to_string(),
                connections: (s.nodes * if s.kube_proxy_apart { 2 } else { 1 }) as u64,
                watches: (s.nodes * (s.secrets_per_node + 1)) as u64,
                rss_before_bytes: r.before,
                rss_connected_bytes: r.connected,
                rss_watching_bytes: (r.watching.iter().sum::<u64>())
                    .checked_div(r.watching.len() as u64)
                    .unwrap_or(0),
                steady_cpu_seconds: (cpu1 - cpu0).max(0.0),
                steady_events: events1.saturating_sub(events0),
                secret_delivery_ms: secrets.as_ref().and_then(Delivery::each_ms),
                slice_to_all_ms,
                slice_updates_to_all,
            })
        }
        None => None,
    };
    Ok(Driven {
        classes: classes
            .into_iter()
            .map(|(name, stats)| (name, stats, elapsed))
            .collect(),
        // Always present for these scenarios; 0 when no event could be matched.
        event_delivery_p99_ms: Some(slices.each_ms().map_or(0.0, |[_, p99, _]| p99)),
        watch_bytes_per_event: {
            let events = received.events.load(Ordering::Relaxed);
            (events > 0).then(|| received.bytes.load(Ordering::Relaxed) as f64 / events as f64)
        },
        watch_cost,
    })
}

impl Scenario for Informers {
    fn name(&self) -> &'static str {
        "informers"
    }

    fn setup(&self, opts: &Options) -> Setup {
        Setup {
            seed: seed(&sizes(opts, 2_000)),
            bookmark_interval: Duration::from_secs(5),
            ..Setup::default()
        }
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(Duration::from_secs(60));
        // Nodes come up over the first few seconds, as a running cluster's already have.
        let window = join_window(opts, duration);
        let pid = env.proxy_pid();
        let plan = Plan {
            sizes: &sizes(opts, 2_000),
            duration,
            join_window: window,
            protobuf: opts.protobuf,
            meter: pid.map(Meter::bulwark),
        };
        drive_nodes(&env.target, |c| env.progress(c), pki, plan).await
    }
}

impl Scenario for NodeJoin {
    fn name(&self) -> &'static str {
        "node-join"
    }

    fn setup(&self, opts: &Options) -> Setup {
        Setup {
            seed: seed(&sizes(opts, 1_000)),
            bookmark_interval: Duration::from_secs(5),
            ..Setup::default()
        }
    }

    async fn drive(&self, env: &Env, pki: &Pki, opts: &Options) -> anyhow::Result<Driven> {
        let duration = opts.duration_or(Duration::from_secs(30));
        // The whole wave joins within 10 seconds (less in very short runs).
        let window = Duration::from_secs(10).min(duration / 2);
        let plan = Plan {
            sizes: &sizes(opts, 1_000),
            duration,
            join_window: window,
            protobuf: opts.protobuf,
            meter: None,
        };
        drive_nodes(&env.target, |c| env.progress(c), pki, plan).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_rv_reads_the_list_metadata() {
        let head = br#"{"kind":"EndpointSliceList","apiVersion":"discovery.k8s.io/v1","metadata":{"resourceVersion":"4711"},"items":[{"metadata":{"resourceVersion":"12""#;
        assert_eq!(list_rv(head).as_deref(), Some("4711"));
        assert_eq!(list_rv(b"{\"kind\":\"Status\"}"), None);
        // A head cut inside a multi-byte character still reads.
        let mut cut = br#"{"metadata":{"resourceVersion":"9"},"items":["#.to_vec();
        cut.extend_from_slice(&"é".as_bytes()[..1]);
        assert_eq!(list_rv(&cut).as_deref(), Some("9"));
    }

    #[test]
    fn list_rv_reads_a_protobuf_lists_metadata_from_its_head() {
        use bulwark::cache::protobuf::{ListMeta, ProtoKind, envelope, list_message};
        let item = ProtoKind::EndpointSlice
            .message(br#"{"metadata":{"name":"e","resourceVersion":"12"},"addressType":"IPv4"}"#)
            .unwrap();
        let meta = ListMeta {
            resource_version: "4711",
            next: None,
            remaining_item_count: None,
        };
        let items = vec![item.as_slice(); 1000];
        let list = envelope(
            "discovery.k8s.io/v1",
            "EndpointSliceList",
            list_message(&meta, items),
        );
        assert!(list.len() > HEAD_BYTES);
        assert_eq!(list_rv(&list[..HEAD_BYTES]).as_deref(), Some("4711"));
        assert_eq!(list_rv(b"k8s\0garbage"), None);
    }

    #[test]
    fn event_head_reads_json_lines_and_protobuf_frames_alike() {
        use bulwark::cache::protobuf::{ProtoKind, envelope, watch_frame};
        let json = br#"{"type":"MODIFIED","object":{"kind":"Secret","metadata":{"resourceVersion":"77"}}}"#;
        let want = Some(("MODIFIED".to_string(), Some("77".to_string())));
        assert_eq!(event_head(json, Framing::Lines), want);
        let object = envelope(
            "v1",
            "Secret",
            ProtoKind::Secret
                .message(br#"{"metadata":{"name":"s","resourceVersion":"77"},"data":{"k":"dg=="}}"#)
                .unwrap(),
        );
        let frame = watch_frame("MODIFIED", object);
        assert_eq!(event_head(&frame[4..], Framing::LengthPrefixed), want);
        assert_eq!(event_head(b"\xff\xff", Framing::LengthPrefixed), None);
    }

    #[test]
    fn delivery_is_matched_to_acknowledgements_and_clamped_at_zero() {
        let delivery = Delivery::new();
        let acks = &delivery.acks;
        let t0 = Instant::now();
        let mut pending = VecDeque::from([(5, t0 + Duration::from_millis(30)), (6, t0), (7, t0)]);
        {
            let mut at = acks.at.write().unwrap();
            at.insert(5, t0);
            at.insert(6, t0 + Duration::from_millis(10)); // event arrived before the ack
        }
        settle(&delivery, &mut pending);
        let hist = delivery.each.lock().unwrap();
        assert_eq!(hist.len(), 2);
        assert_eq!(pending.len(), 1, "rv 7 waits for its ack");
        assert!(
            hist.max() >= 29_000 && hist.max() <= 31_000,
            "{}",
            hist.max()
        );
    }

    #[test]
    fn an_update_counts_to_all_only_once_every_watcher_has_it() {
        let delivery = Delivery::new();
        let t0 = Instant::now();
        {
            let mut at = delivery.acks.at.write().unwrap();
            at.insert(5, t0);
            at.insert(6, t0);
        }
        // Three watchers get rv 5 after 10, 20 and 40 ms; only two get rv 6.
        for (ms, rvs) in [(10, &[5, 6][..]), (20, &[5, 6][..]), (40, &[5][..])] {
            let mut pending = rvs
                .iter()
                .map(|&rv| (rv, t0 + Duration::from_millis(ms)))
                .collect();
            settle(&delivery, &mut pending);
        }
        let (to_all, updates) = delivery.to_all_ms(3);
        assert_eq!(updates, 1);
        let [_, _, max] = to_all.unwrap();
        assert!((39.0..=41.0).contains(&max), "{max}");
        assert_eq!(delivery.to_all_ms(4), (None, 0));
    }
}
