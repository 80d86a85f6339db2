//! Response bodies from the apiservers: streamed to the client through a small bounded
//! channel, reset upstream when the client stalls, and ended the right way when the
//! upstream stream fails or its replica stops answering (cleanly after the last whole event
//! for a watch, with an error for anything else).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::{Body, BoxError};

/// A response whose `Content-Length` is at most this is passed to the client directly,
/// without the pump: it fits in the upstream stream's flow-control window (64 KiB), so the
/// apiserver finishes sending it whether or not the client reads, and a stalled client
/// holds only these bytes in Bulwark, never an apiserver stream. The pump (a task, a
/// channel and a stall timer for every frame) cost a small GET more than the proxying.
pub(crate) const DIRECT_MAX: u64 = 64 * 1024;

/// Frames buffered between the upstream stream and the client. Small, so that a stalled
/// client is noticed quickly and holds little memory beyond its HTTP/2 stream window.
const CHANNEL_FRAMES: usize = 8;

/// What the pump hands the client side.
enum Item {
    Frame(Frame<Bytes>),
    /// The upstream stream ended (or, for a watch, failed): end the body cleanly.
    End,
    /// The upstream stream failed: the client must see a reset, not a truncated success.
    Error(BoxError),
}

/// How a failure of the upstream body is shown to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFailure {
    /// End the body cleanly after the last whole event: watch clients simply watch again
    /// from the last version they saw, and never get half an event.
    End(Framing),
    /// End the body with an error so the client sees a reset.
    Error,
}

/// How the events of a watch stream are delimited, so that a cut stream can end on an
/// event boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// One JSON event per line.
    Lines,
    /// Protobuf: each event preceded by its length as 4 big-endian bytes.
    LengthPrefixed,
    /// CBOR (`application/cbor-seq`, RFC 8742): each event one CBOR data item, nothing
    /// between them; where one ends is read from the item itself.
    CborSequence,
    /// Unknown: bytes pass as they come.
    Unframed,
}

impl Framing {
    /// The framing of a watch response with this `Content-Type`.
    pub(crate) fn of(content_type: Option<&http::HeaderValue>) -> Self {
        let content_type = content_type
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        if content_type.contains("protobuf") {
            Framing::LengthPrefixed
        } else if content_type.contains("cbor") {
            Framing::CborSequence
        } else if content_type.contains("json") {
            Framing::Lines
        } else {
            Framing::Unframed
        }
    }
}

/// The most of one event a watch stream's framer holds back: four times the largest
/// object etcd stores by default (1.5 MiB), an event's envelope and encoding included.
const MAX_HELD: usize = 6 << 20;

/// Holds back the incomplete last event of a watch stream until the rest arrives.
struct Framer {
    framing: Framing,
    tail: BytesMut,
}

impl Framer {
    fn new(framing: Framing) -> Self {
        Self {
            framing,
            tail: BytesMut::new(),
        }
    }

    /// The whole events that `data` completes, possibly empty. An event held back past
    /// [`MAX_HELD`] bytes is no event of a stream in this framing (a mislabelled one, a
    /// length no object has): from there the bytes pass as they come.
    fn push(&mut self, data: Bytes) -> Bytes {
        let whole = self.push_framed(data);
        if self.tail.len() <= MAX_HELD {
            return whole;
        }
        tracing::debug!(
            held = self.tail.len(),
            "a watch event held back past its bound; the stream passes on unframed"
        );
        let held = self.unframe();
        let mut out = BytesMut::with_capacity(whole.len() + held.len());
        out.extend_from_slice(&whole);
        out.extend_from_slice(&held);
        out.freeze()
    }

    /// Gives up framing: from here on the bytes pass as they come; what was held back is
    /// returned, to go first.
    fn unframe(&mut self) -> Bytes {
        self.framing = Framing::Unframed;
        self.tail.split().freeze()
    }

    fn push_framed(&mut self, data: Bytes) -> Bytes {
        match self.framing {
            Framing::Unframed => data,
            Framing::Lines => match data.iter().rposition(|&b| b == b'\n') {
                // The common case: whole events only, nothing held back, nothing copied.
                Some(last) if self.tail.is_empty() && last + 1 == data.len() => data,
                Some(last) => {
                    self.tail.extend_from_slice(&data[..=last]);
                    let out = self.tail.split().freeze();
                    self.tail.extend_from_slice(&data[last + 1..]);
                    out
                }
                None => {
                    self.tail.extend_from_slice(&data);
                    Bytes::new()
                }
            },
            Framing::LengthPrefixed => {
                self.tail.extend_from_slice(&data);
                let mut end = 0;
                while let Some(header) = self.tail.get(end..end + 4) {
                    let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
                    let next = end + 4 + len as usize;
                    if next > self.tail.len() {
                        break;
                    }
                    end = next;
                }
                self.tail.split_to(end).freeze()
            }
            Framing::CborSequence => {
                if self.tail.is_empty() {
                    // The common case: whole events only, nothing held back, nothing copied.
                    match whole_cbor_items(&data) {
                        Some(end) if end == data.len() => return data,
                        Some(end) => {
                            self.tail.extend_from_slice(&data[end..]);
                            return data.slice(..end);
                        }
                        None => self.tail.extend_from_slice(&data),
                    }
                } else {
                    self.tail.extend_from_slice(&data);
                    if let Some(end) = whole_cbor_items(&self.tail) {
                        return self.tail.split_to(end).freeze();
                    }
                }
                tracing::debug!(
                    "a CBOR watch stream holds something that is not CBOR; passed on unframed"
                );
                self.unframe()
            }
        }
    }

    /// What is still held back, for a stream that ended normally.
    fn finish(&mut self) -> Bytes {
        self.tail.split().freeze()
    }
}

/// Where the last whole CBOR data item of `bytes` ends (0 when the first is not whole);
/// `None` when they are not CBOR.
fn whole_cbor_items(bytes: &[u8]) -> Option<usize> {
    let mut items = minicbor::Decoder::new(bytes);
    let mut end = 0;
    while end < bytes.len() {
        match items.skip() {
            Ok(()) => end = items.position(),
            Err(e) if e.is_end_of_input() => break,
            Err(_) => return None,
        }
    }
    Some(end)
}

/// How a body notices that its replica stopped answering: the replica's ejection as
/// unresponsive, and how long the body may then stand still before it is ended. A frozen
/// apiserver (a stopped process, a host gone quiet) leaves its streams open, and its HTTP/2
/// keepalive finds it only after up to 50 s: until then a LIST half sent would hang its
/// client, and a watch would deliver nothing.
pub(crate) struct Ejection {
    /// Changes when the replica is ejected as unresponsive (subscribed before the request
    /// was sent, so an ejection while it waited for its head counts).
    pub(crate) ejected: watch::Receiver<()>,
    /// How long a body may go without a frame once its replica was ejected (the probe's own
    /// limit): a replica only slow to answer its probe keeps the streams it still feeds,
    /// and a quiet watch on it is ended once, cleanly, to be watched again elsewhere.
    pub(crate) grace: Duration,
    /// Counts a body ended this way.
    pub(crate) cut: prometheus::IntCounter,
}

/// Streams `upstream` to the returned body through a task that gives up (dropping, and so
/// resetting, the upstream stream) when the client has not taken a frame for
/// `stall_timeout`, or when the replica was ejected as unresponsive and the stream then
/// stood still ([`Ejection`]). `keep` (connection lease, watch count, …) is held until the
/// upstream stream is done.
pub(crate) fn stream<B, K>(
    upstream: B,
    on_failure: OnFailure,
    stall_timeout: Duration,
    replica: std::sync::Arc<str>,
    ejection: Option<Ejection>,
    keep: K,
) -> Body
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError> + Send,
    K: Send + 'static,
{
    if upstream.is_end_stream() {
        drop(keep);
        return crate::empty();
    }
    let size_hint = upstream.size_hint();
    if on_failure == OnFailure::Error && size_hint.exact().is_some_and(|n| n <= DIRECT_MAX) {
        return Direct {
            upstream,
            keep: Some(keep),
            ejection,
            frozen: None,
        }
        .boxed_unsync();
    }
    let (tx, rx) = mpsc::channel(CHANNEL_FRAMES);
    tokio::spawn(pump(
        upstream,
        tx,
        on_failure,
        stall_timeout,
        replica,
        ejection,
        keep,
    ));
    Pumped {
        rx,
        size_hint,
        done: false,
    }
    .boxed_unsync()
}

async fn pump<B, K>(
    mut upstream: B,
    tx: mpsc::Sender<Item>,
    on_failure: OnFailure,
    stall_timeout: Duration,
    replica: std::sync::Arc<str>,
    mut ejection: Option<Ejection>,
    keep: K,
) where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError> + Send,
{
    let mut framer = Framer::new(match on_failure {
        OnFailure::End(framing) => framing,
        OnFailure::Error => Framing::Unframed,
    });
    // Set once the replica is ejected as unresponsive: from then on the stream may never
    // stand still for the grace (what a frozen process had in flight still trickles in).
    let mut move_by: Option<Instant> = None;
    'pump: loop {
        // While waiting for upstream data, also notice a client that went away, so the
        // upstream stream (a quiet watch, say) is reset at once rather than at its next
        // event, and a replica that stopped answering.
        let frame = tokio::select! {
            // A frame ready is taken before anything else: a stream the replica still
            // feeds is never cut.
            biased;
            frame = upstream.frame() => {
                if let (Some(_), Some(e)) = (move_by, &ejection) {
                    move_by = Some(Instant::now() + e.grace);
                }
                frame.map(|f| f.map_err(Into::into))
            }
            () = tx.closed() => break,
            ejected = async { ejection.as_mut()?.ejected.changed().await.ok() }, if ejection.is_some() && move_by.is_none() => {
                match (ejected, ejection.as_ref()) {
                    (Some(()), Some(e)) => move_by = Some(Instant::now() + e.grace),
                    // The replica is gone from the set: nothing more to hear from it.
                    _ => ejection = None,
                }
                continue;
            }
            () = super::until(move_by) => {
                if let Some(e) = &ejection {
                    e.cut.inc();
                }
                tracing::info!(%replica, "replica ejected as unresponsive and the response stood still; ending it");
                Some(Err(BoxError::from(format!(
                    "apiserver {replica} stopped answering mid-response"
                ))))
            }
        };
        let items = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let whole = framer.push(data);
                    if whole.is_empty() {
                        continue;
                    }
                    vec![Item::Frame(Frame::data(whole))]
                }
                Err(trailers) => vec![Item::Frame(trailers)],
            },
            None => {
                let rest = framer.finish();
                if rest.is_empty() {
                    vec![Item::End]
                } else {
                    vec![Item::Frame(Frame::data(rest)), Item::End]
                }
            }
            Some(Err(e)) => {
                tracing::debug!(%replica, error = %e, "upstream response body failed");
                match on_failure {
                    // The incomplete event held back is dropped with the stream.
                    OnFailure::End(_) => vec![Item::End],
                    OnFailure::Error => vec![Item::Error(e)],
                }
            }
        };
        for item in items {
            let last = !matches!(item, Item::Frame(_));
            match tx.send_timeout(item, stall_timeout).await {
                Ok(()) if last => break 'pump,
                Ok(()) => {}
                Err(SendTimeoutError::Timeout(_)) => {
                    tracing::info!(
                        %replica,
                        ?stall_timeout,
                        "client stopped reading; resetting the upstream stream"
                    );
                    break 'pump;
                }
                Err(SendTimeoutError::Closed(_)) => break 'pump,
            }
        }
        // The grace counts from when the pump waits again, not while a slow client read.
        if let (Some(_), Some(e)) = (move_by, &ejection) {
            move_by = Some(Instant::now() + e.grace);
        }
    }
    // Dropping the upstream body before it ended resets its stream (CANCEL), which frees
    // the apiserver's memory for it; then the lease and counters go.
    drop(upstream);
    drop(keep);
}

pin_project_lite::pin_project! {
    /// A small response body of known length, polled straight from the upstream stream;
    /// `keep` is released when it ends, fails or is dropped. When the rest of it is not
    /// there at once, it waits on its replica's ejection too: a process stopped between
    /// the head and the body would otherwise hold it until the upstream keepalive.
    struct Direct<B, K> {
        #[pin]
        upstream: B,
        keep: Option<K>,
        ejection: Option<Ejection>,
        // Made at the first wait only (most bodies are there with their head): ready once
        // the replica was ejected as unresponsive and the grace has passed since.
        frozen: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
    }
}

impl<B, K> HttpBody for Direct<B, K>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        let polled = match this.upstream.poll_frame(cx) {
            Poll::Pending => {
                if this.frozen.is_none()
                    && let Some(e) = this.ejection.as_ref()
                {
                    let (mut ejected, grace) = (e.ejected.clone(), e.grace);
                    *this.frozen = Some(Box::pin(async move {
                        if ejected.changed().await.is_ok() {
                            tokio::time::sleep(grace).await;
                        } else {
                            std::future::pending::<()>().await;
                        }
                    }));
                }
                if let Some(frozen) = this.frozen.as_mut()
                    && frozen.as_mut().poll(cx).is_ready()
                {
                    *this.frozen = None;
                    *this.keep = None;
                    if let Some(e) = this.ejection.take() {
                        e.cut.inc();
                    }
                    return Poll::Ready(Some(Err(
                        "the apiserver stopped answering mid-response".into()
                    )));
                }
                return Poll::Pending;
            }
            Poll::Ready(polled) => polled,
        };
        match polled {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            Some(Err(e)) => {
                *this.keep = None;
                Poll::Ready(Some(Err(e.into())))
            }
            None => {
                *this.keep = None;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.upstream.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.upstream.size_hint()
    }
}

/// The client side of the pump.
struct Pumped {
    rx: mpsc::Receiver<Item>,
    size_hint: SizeHint,
    done: bool,
}

impl HttpBody for Pumped {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Item::Frame(frame))) => Poll::Ready(Some(Ok(frame))),
            Poll::Ready(Some(Item::End)) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Item::Error(e))) => {
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            // The pump gave up (the client stalled) or died without saying how the stream
            // ended: never pass that off as a complete response.
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(Some(Err("upstream response stream was abandoned".into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.size_hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    type Upstream = (
        mpsc::Sender<Result<Frame<Bytes>, BoxError>>,
        Box<dyn FnOnce() -> Body>,
    );

    /// An upstream body fed by the test, and a way to stream it.
    fn upstream(on_failure: OnFailure, stall: Duration, dropped: Arc<AtomicBool>) -> Upstream {
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let make = move || {
            let frames = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|frame| (frame, rx))
            });
            let body = StreamBody::new(Box::pin(frames));
            stream(body, on_failure, stall, "r0".into(), None, Flag(dropped))
        };
        (tx, Box::new(make))
    }

    /// Sets its flag when dropped: shows when the pump lets go of what it keeps.
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::from_static(s.as_bytes())))
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_complete_response_arrives_whole_and_releases_its_lease() {
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(OnFailure::Error, Duration::from_secs(60), dropped.clone());
        let body = make();
        tx.send(data("hello ")).await.unwrap();
        tx.send(data("world")).await.unwrap();
        drop(tx);
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "hello world");
        tokio::task::yield_now().await;
        assert!(dropped.load(Ordering::SeqCst));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_failure_mid_body_is_an_error_for_a_list() {
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(OnFailure::Error, Duration::from_secs(60), dropped);
        let body = make();
        tx.send(data("{\"items\":[")).await.unwrap();
        tx.send(Err("stream reset".into())).await.unwrap();
        assert!(body.collect().await.is_err());
    }

    #[test]
    fn json_watch_events_are_released_whole() {
        let mut f = Framer::new(Framing::Lines);
        assert_eq!(f.push(Bytes::from_static(b"{\"a\":1}\n")), "{\"a\":1}\n");
        assert_eq!(f.push(Bytes::from_static(b"{\"b\"")), "");
        assert_eq!(f.push(Bytes::from_static(b":2}\n{\"c\"")), "{\"b\":2}\n");
        assert_eq!(
            f.push(Bytes::from_static(b":3}\n{\"d\":4}\n")),
            "{\"c\":3}\n{\"d\":4}\n"
        );
        assert_eq!(f.finish(), "");
        f.push(Bytes::from_static(b"{\"e\""));
        assert_eq!(f.finish(), "{\"e\"", "a normal end passes everything on");
    }

    #[test]
    fn protobuf_watch_events_are_released_whole() {
        let mut f = Framer::new(Framing::LengthPrefixed);
        let event = |body: &[u8]| {
            let mut e = (body.len() as u32).to_be_bytes().to_vec();
            e.extend_from_slice(body);
            e
        };
        let (one, two) = (event(b"first"), event(b"second event"));
        let mut stream = one.clone();
        stream.extend_from_slice(&two);
        assert_eq!(f.push(Bytes::copy_from_slice(&stream[..2])), "");
        assert_eq!(
            f.push(Bytes::copy_from_slice(&stream[2..12])),
            Bytes::from(one)
        );
        assert_eq!(
            f.push(Bytes::copy_from_slice(&stream[12..])),
            Bytes::from(two)
        );
        assert_eq!(f.finish(), "");
    }

    /// A watch event as the apiserver sends it in CBOR: a map of `type` and `object`, the
    /// object's fields a map again (its data as a byte string, as a Secret's is).
    fn cbor_event(kind: &str, name: &str, data: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        let mut e = minicbor::Encoder::new(&mut bytes);
        e.map(2).unwrap().str("type").unwrap().str(kind).unwrap();
        e.str("object").unwrap().map(3).unwrap();
        e.str("kind").unwrap().str("Secret").unwrap();
        e.str("metadata").unwrap().map(1).unwrap();
        e.str("name").unwrap().str(name).unwrap();
        e.str("data").unwrap().bytes(data).unwrap();
        bytes
    }

    #[test]
    fn cbor_watch_events_are_released_whole() {
        let one = cbor_event("ADDED", "a", b"first");
        let two = cbor_event("MODIFIED", "b", &[7; 300]);
        let stream = [one.clone(), two.clone()].concat();
        // Cut everywhere: an event is released once its last byte has come, never before.
        for cut in 1..stream.len() {
            let mut f = Framer::new(Framing::CborSequence);
            let first = f.push(Bytes::copy_from_slice(&stream[..cut]));
            let expected = if cut >= one.len() { &one[..] } else { &[][..] };
            assert_eq!(first, expected, "cut at {cut}");
            let rest = f.push(Bytes::copy_from_slice(&stream[cut..]));
            assert_eq!([first, rest].concat(), stream, "cut at {cut}");
            assert_eq!(f.finish(), "");
        }
        // Whole events in one frame pass as they came.
        let mut f = Framer::new(Framing::CborSequence);
        let whole = Bytes::from(stream.clone());
        let out = f.push(whole.clone());
        assert_eq!(out.as_ptr(), whole.as_ptr(), "not copied");
        // A normal end passes on what was held back.
        f.push(Bytes::copy_from_slice(&one[..3]));
        assert_eq!(f.finish(), &one[..3]);
    }

    #[test]
    fn a_cbor_stream_that_is_not_cbor_passes_on_unframed() {
        let one = cbor_event("ADDED", "a", b"x");
        // 0x1c (an unsigned integer with a reserved length) is no CBOR item.
        let mut f = Framer::new(Framing::CborSequence);
        let bad = [&one[..], &[0x1c, 1, 2][..]].concat();
        assert_eq!(f.push(Bytes::from(bad.clone())), bad);
        assert_eq!(f.push(Bytes::from_static(b"more")), "more");
        // Held back, then found not to be CBOR: 0xff inside the `type` key's text is no
        // UTF-8. What was held back goes first.
        let mut f = Framer::new(Framing::CborSequence);
        assert_eq!(f.push(Bytes::copy_from_slice(&one[..4])), "");
        let out = f.push(Bytes::from_static(&[0xff, 1, 2]));
        assert_eq!(out, [&one[..4], &[0xff, 1, 2][..]].concat());
        assert_eq!(f.push(Bytes::from_static(b"more")), "more");
    }

    /// JSON sent as CBOR reads as the start of a text string longer than any object (`{` is
    /// a text string with an 8-byte length): never whole, and so held back only up to the
    /// bound, then passed on, as is a protobuf length no object has.
    #[test]
    fn an_event_that_never_ends_is_held_back_only_up_to_the_bound() {
        for framing in [
            Framing::CborSequence,
            Framing::LengthPrefixed,
            Framing::Lines,
        ] {
            let mut f = Framer::new(framing);
            let start = Bytes::from_static(b"{\"type\":\"ADDED\"");
            let chunk = Bytes::from(vec![b'a'; 1 << 20]);
            let mut out = f.push(start.clone());
            let mut sent = start.len();
            while out.is_empty() {
                assert!(sent <= MAX_HELD + chunk.len(), "{framing:?} held {sent}");
                out = f.push(chunk.clone());
                sent += chunk.len();
            }
            assert_eq!(out.len(), sent, "{framing:?}: all of it, once");
            assert!(out.starts_with(&start));
            assert_eq!(f.push(Bytes::from_static(b"more")), "more");
        }
    }

    #[test]
    fn framing_follows_the_content_type() {
        let of = |v: &'static str| Framing::of(Some(&http::HeaderValue::from_static(v)));
        assert_eq!(of("application/json"), Framing::Lines);
        assert_eq!(
            of("application/vnd.kubernetes.protobuf;stream=watch"),
            Framing::LengthPrefixed
        );
        assert_eq!(of("application/cbor-seq"), Framing::CborSequence);
        assert_eq!(of("text/plain"), Framing::Unframed);
        assert_eq!(Framing::of(None), Framing::Unframed);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_watch_cut_mid_event_ends_after_the_last_whole_event() {
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(
            OnFailure::End(Framing::Lines),
            Duration::from_secs(60),
            dropped,
        );
        let body = make();
        tx.send(data("{\"type\":\"ADDED\"}\n{\"type\":\"MOD"))
            .await
            .unwrap();
        tx.send(Err("stream reset".into())).await.unwrap();
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "{\"type\":\"ADDED\"}\n");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_failure_mid_body_ends_a_watch_cleanly() {
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(
            OnFailure::End(Framing::Lines),
            Duration::from_secs(60),
            dropped,
        );
        let body = make();
        tx.send(data("{\"type\":\"ADDED\"}\n")).await.unwrap();
        tx.send(Err("stream reset".into())).await.unwrap();
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "{\"type\":\"ADDED\"}\n");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_stalled_client_gets_its_upstream_stream_reset() {
        let stall = Duration::from_secs(30);
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(OnFailure::Error, stall, dropped.clone());
        let mut body = make();
        // The client reads nothing; upstream keeps sending until the channel is full.
        let mut sent = 0;
        while tokio::time::timeout(Duration::from_millis(1), tx.send(data("x")))
            .await
            .is_ok()
        {
            sent += 1;
        }
        assert!(sent >= CHANNEL_FRAMES, "sent {sent}");
        assert!(!dropped.load(Ordering::SeqCst));
        tokio::time::sleep(stall).await;
        tokio::task::yield_now().await;
        assert!(
            dropped.load(Ordering::SeqCst),
            "pump let go of the upstream"
        );
        assert!(tx.is_closed(), "upstream stream dropped");
        // What was buffered still arrives, then an error: never a clean end.
        let mut frames = 0;
        let outcome = loop {
            match body.frame().await {
                Some(Ok(_)) => frames += 1,
                Some(Err(_)) => break "error",
                None => break "clean end",
            }
        };
        assert!(frames > 0);
        assert_eq!(outcome, "error");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_slow_but_reading_client_is_not_cut() {
        let stall = Duration::from_secs(30);
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(OnFailure::Error, stall, dropped);
        let mut body = make();
        let producer = tokio::spawn(async move {
            for _ in 0..40 {
                tx.send(data("x")).await.unwrap();
            }
        });
        let mut got = 0;
        while let Some(frame) = body.frame().await {
            frame.unwrap();
            got += 1;
            // Slower than the producer, but well inside the stall timeout per frame.
            tokio::time::sleep(Duration::from_secs(20)).await;
        }
        assert_eq!(got, 40);
        producer.await.unwrap();
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_client_that_goes_away_releases_a_quiet_upstream_stream() {
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, make) = upstream(
            OnFailure::End(Framing::Lines),
            Duration::from_secs(60),
            dropped.clone(),
        );
        let body = make();
        tx.send(data("event\n")).await.unwrap();
        tokio::task::yield_now().await;
        drop(body);
        tokio::task::yield_now().await;
        assert!(dropped.load(Ordering::SeqCst));
        assert!(tx.is_closed());
    }

    /// What feeds a test's upstream body.
    type Frames = mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

    /// A body fed by the test from a replica that the test ejects as unresponsive: the
    /// frames' sender, the ejection's, the body, and what counts the cut.
    fn from_ejectable(
        on_failure: OnFailure,
    ) -> (Frames, watch::Sender<()>, Body, prometheus::IntCounter) {
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let frames = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|frame| (frame, rx))
        });
        let (eject, body, cut) = ejectable(StreamBody::new(Box::pin(frames)), on_failure);
        (tx, eject, body, cut)
    }

    /// `upstream` streamed as from a replica the test ejects with the returned sender
    /// (grace 1 s), and what counts the cut.
    fn ejectable<B>(
        upstream: B,
        on_failure: OnFailure,
    ) -> (watch::Sender<()>, Body, prometheus::IntCounter)
    where
        B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError> + Send,
    {
        let eject = watch::Sender::new(());
        let cut = prometheus::IntCounter::new("cut", "cut").unwrap();
        let ejection = Ejection {
            ejected: eject.subscribe(),
            grace: Duration::from_secs(1),
            cut: cut.clone(),
        };
        let body = stream(
            upstream,
            on_failure,
            Duration::from_secs(60),
            "r0".into(),
            Some(ejection),
            (),
        );
        (eject, body, cut)
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_list_half_sent_by_a_replica_that_stops_answering_ends_with_an_error() {
        let (tx, eject, body, cut) = from_ejectable(OnFailure::Error);
        tx.send(data("{\"items\":[")).await.unwrap();
        let started = Instant::now();
        eject.send_replace(());
        // The upstream stream stays open (a stopped process keeps its sockets).
        let outcome = body.collect().await;
        assert!(outcome.is_err(), "a half-sent LIST must not end cleanly");
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(1),
            "ended at the grace"
        );
        assert_eq!(cut.get(), 1);
        assert!(tx.is_closed(), "the upstream stream is let go");
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_watch_on_a_replica_that_stops_answering_ends_cleanly_after_its_last_event() {
        let (tx, eject, body, cut) = from_ejectable(OnFailure::End(Framing::Lines));
        tx.send(data("{\"type\":\"ADDED\"}\n{\"type\":\"MOD"))
            .await
            .unwrap();
        eject.send_replace(());
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "{\"type\":\"ADDED\"}\n");
        assert_eq!(cut.get(), 1);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_stream_its_replica_still_feeds_after_an_ejection_is_kept() {
        let (tx, eject, body, cut) = from_ejectable(OnFailure::Error);
        let feeder = tokio::spawn(async move {
            tx.send(data("a")).await.unwrap();
            eject.send_replace(());
            // Slower than usual, but each frame within the grace: the replica answers.
            for _ in 0..5 {
                tokio::time::sleep(Duration::from_millis(900)).await;
                tx.send(data("b")).await.unwrap();
            }
            // A second ejection later, and the rest comes in time too.
            eject.send_replace(());
            tokio::time::sleep(Duration::from_millis(500)).await;
            tx.send(data("c")).await.unwrap();
        });
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "abbbbbc");
        assert_eq!(cut.get(), 0);
        feeder.await.unwrap();
    }

    /// A body fed by the test that declares its length, as an answer with
    /// `Content-Length` does: small ones are polled directly, without the pump.
    struct Declared {
        frames: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
        len: u64,
    }

    impl HttpBody for Declared {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.frames.poll_recv(cx)
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.len)
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_small_answer_whose_replica_froze_after_its_head_ends_with_an_error() {
        let (tx, frames) = mpsc::channel(1);
        let (eject, body, cut) = ejectable(Declared { frames, len: 10 }, OnFailure::Error);
        // The head came; the body never will. The replica is ejected a moment later.
        let ejector = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            eject.send_replace(());
            eject
        });
        let started = Instant::now();
        assert!(body.collect().await.is_err(), "never a clean end");
        assert_eq!(started.elapsed(), Duration::from_millis(1300));
        assert_eq!(cut.get(), 1);
        drop((tx, ejector.await.unwrap()));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_small_answer_that_arrives_within_the_grace_after_an_ejection_is_kept() {
        let (tx, frames) = mpsc::channel(1);
        let (eject, body, cut) = ejectable(Declared { frames, len: 5 }, OnFailure::Error);
        let feeder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            eject.send_replace(());
            tokio::time::sleep(Duration::from_millis(800)).await;
            tx.send(data("hello")).await.unwrap();
            drop(tx);
            eject
        });
        assert_eq!(body.collect().await.unwrap().to_bytes(), "hello");
        assert_eq!(cut.get(), 0);
        drop(feeder.await.unwrap());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_slow_client_does_not_make_a_fed_stream_look_frozen() {
        let (tx, eject, mut body, cut) = from_ejectable(OnFailure::Error);
        eject.send_replace(());
        // The replica answers at once; the client takes a frame every 2 s, twice the grace,
        // so the pump waits on the client far longer than the grace between frames.
        let feeder = tokio::spawn(async move {
            for _ in 0..20 {
                tx.send(data("x")).await.unwrap();
            }
        });
        let mut frames = 0;
        while let Some(frame) = body.frame().await {
            assert!(frame.is_ok(), "cut after {frames} frames");
            frames += 1;
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        assert_eq!(frames, 20);
        assert_eq!(cut.get(), 0);
        feeder.await.unwrap();
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn what_a_frozen_replica_had_in_flight_does_not_keep_its_stream_open() {
        // Ejected after the request was sent and before its body was read (the
        // subscription taken before sending still holds the change), then the bytes the
        // stopped process had already written arrive, and nothing more.
        let (tx, eject, body, cut) = from_ejectable(OnFailure::Error);
        eject.send_replace(());
        tokio::task::yield_now().await;
        tx.send(data("{")).await.unwrap();
        assert!(body.collect().await.is_err());
        assert_eq!(cut.get(), 1);
    }
}
