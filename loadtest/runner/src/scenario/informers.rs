//! `informers` and `node-join`: every node runs a kube-proxy-like informer on
//! EndpointSlices (LIST `resourceVersion=0`, then WATCH with bookmarks) and kubelet-like
//! watches of its own two Secrets, while a churn client updates EndpointSlices; the figure
//! that matters is event delivery latency (write acknowledged → event received).

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

/// The steady-state scenario.
pub struct Informers;

/// The join-wave scenario.
pub struct NodeJoin;

/// EndpointSlices updated by the churn client, in total per second.
const CHURN_PER_SECOND: u64 = 20;
/// How long a received event waits for its write's acknowledgement to be matched.
const MATCH_WINDOW: Duration = Duration::from_secs(5);
const SLICES_PATH: &str = "/apis/discovery.k8s.io/v1/endpointslices";

/// When each churn write was acknowledged, by the resourceVersion it produced.
#[derive(Default)]
pub(super) struct Acks {
    at: RwLock<HashMap<u64, Instant>>,
}

/// Where an EndpointSlice watcher matches events to writes and records their latency.
pub(super) type Delivery = (Arc<Acks>, Arc<Mutex<Histogram<u64>>>);

/// The counts of one run.
pub(super) struct Sizes {
    nodes: usize,
    slices: usize,
    /// Secret watches a node holds, each of a Secret of its own.
    secrets_per_node: usize,
    /// Whether a node's EndpointSlice watch has a connection of its own (kube-proxy's).
    kube_proxy_apart: bool,
}

pub(super) fn sizes(opts: &Options, nodes: usize) -> Sizes {
    Sizes {
        nodes: opts.scaled(nodes, 2),
        slices: opts.scaled(500, 10),
        secrets_per_node: opts.secrets_per_node.max(1),
        kube_proxy_apart: opts.kube_proxy_apart,
    }
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
pub(super) async fn reflector(
    mut client: Client,
    mut tally: Tally,
    list_path: String,
    deadline: Instant,
    delivery: Option<Delivery>,
    received: Arc<Received>,
) -> Tally {
    let mut local = new_histogram();
    let mut pending: VecDeque<(u64, Instant)> = VecDeque::new();
    let sep = if list_path.contains('?') { '&' } else { '?' };
    'relist: while Instant::now() < deadline {
        let path = format!("{list_path}{sep}resourceVersion=0");
        let list = tokio::select! {
            o = client.call(Method::GET, &path, None, Read::Head, Duration::from_secs(60)) => o,
            _ = tokio::time::sleep_until(deadline) => break,
        };
        let pause = tally.record(&list);
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
                    tally.record(&Outcome::Ok {
                        bytes: 0,
                        latency: started.elapsed(),
                        body: None,
                    });
                    lines
                }
                Err(outcome) => {
                    let pause = tally.record(&outcome);
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
                        tally.record(&Outcome::Error(format!("watch cut: {e}")));
                        break;
                    }
                };
                let Some((kind, version)) = event_head(&line, lines.framing()) else {
                    continue;
                };
                received.events.fetch_add(1, Ordering::Relaxed);
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
                if let Some((acks, _)) = &delivery {
                    settle(acks, &mut pending, &mut local);
                }
            }
        }
    }
    if let Some((acks, hist)) = &delivery {
        settle(acks, &mut pending, &mut local);
        if let Ok(mut h) = hist.lock() {
            let _ = h.add(&local);
        }
    }
    tally
}

/// Watch bytes and events received by every node, for bytes per event.
#[derive(Default)]
pub(super) struct Received {
    bytes: AtomicU64,
    events: AtomicU64,
}

/// Records the delivery latency of every received event whose write has been acknowledged;
/// an event that arrived before its acknowledgement counts as zero.
fn settle(acks: &Acks, pending: &mut VecDeque<(u64, Instant)>, hist: &mut Histogram<u64>) {
    let Ok(at) = acks.at.read() else { return };
    pending.retain(|(rv, received)| match at.get(rv) {
        Some(acked) => {
            let micros = received.saturating_duration_since(*acked).as_micros();
            hist.saturating_record(u64::try_from(micros).unwrap_or(u64::MAX).max(1));
            false
        }
        None => received.elapsed() < MATCH_WINDOW,
    });
}

/// One node: its kubelet's watches of its `secrets` Secrets and its kube-proxy's of the
/// EndpointSlices, on `kubelet`'s connection, or the latter on `kube_proxy`'s where it has
/// one of its own.
async fn node(
    (kubelet, kube_proxy): (Client, Option<Client>),
    class: Arc<ClassStats>,
    (index, secrets): (usize, usize),
    (start, deadline): (Instant, Instant),
    delivery: Delivery,
    received: Arc<Received>,
) {
    tokio::time::sleep_until(start).await;
    let secret = |k: usize| {
        let n = secrets * index + k;
        format!(
            "/api/v1/namespaces/ns-{}/secrets?fieldSelector=metadata.name%3Dsecret-{n}",
            n % 10
        )
    };
    let slices = reflector(
        kube_proxy.unwrap_or_else(|| kubelet.clone()),
        class.tally(),
        SLICES_PATH.into(),
        deadline,
        Some(delivery),
        received.clone(),
    );
    let secrets = futures::future::join_all((0..secrets).map(|k| {
        reflector(
            kubelet.clone(),
            class.tally(),
            secret(k),
            deadline,
            None,
            received.clone(),
        )
    }));
    let (mut all, each) = tokio::join!(slices, secrets);
    for tally in each {
        all.merge(tally);
    }
    class.done(all);
}

/// Updates EndpointSlices round robin at [`CHURN_PER_SECOND`] and records when each write
/// was acknowledged.
async fn churn(
    mut client: Client,
    class: Arc<ClassStats>,
    slices: usize,
    acks: Arc<Acks>,
    deadline: Instant,
) {
    let mut tally = class.tally();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / CHURN_PER_SECOND));
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::time::sleep_until(deadline) => break,
        }
        let k = (n as usize) % slices;
        let path = format!(
            "/apis/discovery.k8s.io/v1/namespaces/ns-{}/endpointslices/endpointslice-{k}",
            k % 10
        );
        let body = Bytes::from(format!(
            r#"{{"metadata":{{"labels":{{"loadtest.bulwark.dev/generation":"{n}"}}}}}}"#
        ));
        n += 1;
        let outcome = tokio::select! {
            o = client.call(Method::PATCH, &path, Some((body, "application/merge-patch+json")), Read::Keep, Duration::from_secs(10)) => o,
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

/// Runs `nodes` nodes whose informers start spread over `join_window`, plus the churn;
/// `progress` reports on the classes while they run.
pub(super) async fn drive_nodes(
    target: &Target,
    progress: impl FnOnce(&Classes) -> tokio::task::JoinHandle<()>,
    pki: &Pki,
    s: &Sizes,
    duration: Duration,
    join_window: Duration,
    protobuf: bool,
) -> anyhow::Result<Driven> {
    let node_ids: Vec<Identity> = Persona::Nodes.mint(pki, s.nodes);
    // The EndpointSlice controller of kube-controller-manager.
    let churn_id = Persona::ServiceAccountsIn {
        namespace: "kube-system",
        name_prefix: "endpointslice-controller",
    }
    .mint(pki, 1);
    let nodes = ClassStats::new();
    let churner = ClassStats::new();
    let acks = Arc::new(Acks::default());
    let hist = Arc::new(Mutex::new(new_histogram()));
    let received = Arc::new(Received::default());
    let started = Instant::now();
    let deadline = started + duration;
    let classes = vec![
        ("nodes".to_string(), nodes.clone()),
        ("churn".to_string(), churner.clone()),
    ];
    let progress = progress(&classes);
    let mut tasks = Vec::new();
    for (i, id) in node_ids.iter().enumerate() {
        let start = started + join_window.mul_f64(i as f64 / s.nodes as f64);
        let connect = || -> anyhow::Result<Client> {
            let client = Client::new(target, id)?;
            Ok(if protobuf {
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
        tasks.push(tokio::spawn(node(
            (connect()?, kube_proxy),
            nodes.clone(),
            (i, s.secrets_per_node),
            (start, deadline),
            (acks.clone(), hist.clone()),
            received.clone(),
        )));
    }
    for id in &churn_id {
        tasks.push(tokio::spawn(churn(
            Client::new(target, id)?,
            churner.clone(),
            s.slices,
            acks.clone(),
            deadline,
        )));
    }
    for t in tasks {
        t.await?;
    }
    progress.abort();
    let elapsed = started.elapsed();
    let p99 = match hist.lock() {
        Ok(h) if !h.is_empty() => Some(h.value_at_quantile(0.99) as f64 / 1000.0),
        _ => None,
    };
    Ok(Driven {
        classes: classes
            .into_iter()
            .map(|(name, stats)| (name, stats, elapsed))
            .collect(),
        // Always present for these scenarios; 0 when no event could be matched.
        event_delivery_p99_ms: Some(p99.unwrap_or(0.0)),
        watch_bytes_per_event: {
            let events = received.events.load(Ordering::Relaxed);
            (events > 0).then(|| received.bytes.load(Ordering::Relaxed) as f64 / events as f64)
        },
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
        let window = Duration::from_secs(5).min(duration / 4);
        drive_nodes(
            &env.target,
            |c| env.progress(c),
            pki,
            &sizes(opts, 2_000),
            duration,
            window,
            opts.protobuf,
        )
        .await
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
        drive_nodes(
            &env.target,
            |c| env.progress(c),
            pki,
            &sizes(opts, 1_000),
            duration,
            window,
            opts.protobuf,
        )
        .await
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
        let acks = Acks::default();
        let t0 = Instant::now();
        let mut pending = VecDeque::from([(5, t0 + Duration::from_millis(30)), (6, t0), (7, t0)]);
        {
            let mut at = acks.at.write().unwrap();
            at.insert(5, t0);
            at.insert(6, t0 + Duration::from_millis(10)); // event arrived before the ack
        }
        let mut hist = new_histogram();
        settle(&acks, &mut pending, &mut hist);
        assert_eq!(hist.len(), 2);
        assert_eq!(pending.len(), 1, "rv 7 waits for its ack");
        assert!(
            hist.max() >= 29_000 && hist.max() <= 31_000,
            "{}",
            hist.max()
        );
    }
}
