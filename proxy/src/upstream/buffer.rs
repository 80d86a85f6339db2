//! Request bodies held for retries, within a byte budget.
//!
//! A request body is read whole before it is sent, so that a retry can send it again, and
//! held until the apiserver answers: with a slow apiserver, every write in flight holds up to
//! `listen.limits.maxBodyBytes`. A client request's body counts against a budget for all
//! requests and one for its flow, exempt or not ([`BodyBudget`]), taken as the bytes arrive
//! (the declared length at once) and never waited for, so a request that does not fit is
//! refused at once with 429 instead of hanging. Bulwark's own requests (reviews, informers)
//! are small and bounded by their own limits; they do not count.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{MAX_REQUEST_BODY, UpstreamError};
use crate::config;

/// The unit the budget is counted in: a body of 1 byte holds 1 KiB.
const UNIT: u64 = 1024;

/// The bytes client request bodies may hold, in total and per flow.
#[derive(Debug)]
pub struct BodyBudget {
    /// Free units of the total.
    total: Arc<Semaphore>,
    /// Units held per flow; a flow holding none has no entry.
    flows: Mutex<HashMap<Arc<str>, u64>>,
    per_flow: u64,
    max_body: usize,
}

/// Which budget a body did not fit in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetScope {
    /// `bufferedBodyBytes`, all requests together.
    Total,
    /// `bufferedBodyBytesPerFlow`, the request's flow.
    Flow,
}

impl std::fmt::Display for BudgetScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BudgetScope::Total => "all requests",
            BudgetScope::Flow => "this flow",
        })
    }
}

impl BodyBudget {
    /// The budget of `listen.limits`.
    pub fn new(limits: &config::ListenLimits) -> Arc<Self> {
        let units = |bytes: u64| bytes.div_ceil(UNIT);
        let total = units(limits.buffered_body_bytes.0).min(Semaphore::MAX_PERMITS as u64);
        Arc::new(Self {
            total: Arc::new(Semaphore::new(total as usize)),
            flows: Mutex::new(HashMap::new()),
            per_flow: units(limits.buffered_body_bytes_per_flow.0),
            max_body: limits.max_body_bytes,
        })
    }

    /// Bytes of the total not held now.
    pub fn available_bytes(&self) -> u64 {
        self.total.available_permits() as u64 * UNIT
    }

    /// Flows holding bytes now.
    pub fn flows_holding(&self) -> usize {
        self.flows.lock().expect("body budget lock").len()
    }
}

/// Request extension: the request's body counts against `budget` for `flow`. Set on client
/// requests once their rule is known; a request without it is Bulwark's own.
#[derive(Debug, Clone)]
pub struct BodyFlow {
    /// The budget.
    pub budget: Arc<BodyBudget>,
    /// The flow key of the rule the request matched.
    pub flow: Arc<str>,
}

/// Units of a body's budget, held until dropped.
#[derive(Debug)]
pub struct Held {
    account: BodyFlow,
    permit: Option<OwnedSemaphorePermit>,
    units: u64,
}

impl Held {
    fn new(account: &BodyFlow) -> Self {
        Self {
            account: account.clone(),
            permit: None,
            units: 0,
        }
    }

    /// Holds enough for `bytes` in all, or says which budget has no room.
    fn grow(&mut self, bytes: usize) -> Result<(), UpstreamError> {
        let wanted = (bytes as u64).div_ceil(UNIT);
        if wanted <= self.units {
            return Ok(());
        }
        let more = wanted - self.units;
        let budget = &self.account.budget;
        let mut flows = budget.flows.lock().expect("body budget lock");
        let held = flows.get(&self.account.flow).copied().unwrap_or(0);
        if held + more > budget.per_flow {
            return Err(UpstreamError::BodyBudget(BudgetScope::Flow));
        }
        let permit = u32::try_from(more)
            .ok()
            .and_then(|n| budget.total.clone().try_acquire_many_owned(n).ok())
            .ok_or(UpstreamError::BodyBudget(BudgetScope::Total))?;
        match &mut self.permit {
            Some(held) => held.merge(permit),
            None => self.permit = Some(permit),
        }
        flows.insert(self.account.flow.clone(), held + more);
        self.units = wanted;
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.units == 0 {
            return;
        }
        let mut flows = self.account.budget.flows.lock().expect("body budget lock");
        if let Some(held) = flows.get_mut(&self.account.flow) {
            *held = held.saturating_sub(self.units);
            if *held == 0 {
                flows.remove(&self.account.flow);
            }
        }
    }
}

/// The length a request declares in `Content-Length`, if it is a number.
pub fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// How long a request body may take to arrive ([`read`]).
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadlines {
    /// The longest wait for the next bytes.
    pub progress: Duration,
    /// The longest wait for the whole body.
    pub whole: Duration,
}

/// Reads a client's request body whole before its request is admitted, so that a request
/// takes its seats only once its body is complete, as the apiserver authorizes and queues
/// a request before it reads the body: a client that trickles a body holds bytes of the
/// body budget (its flow's share), never seats. A body that sends nothing for
/// `deadlines.progress`, or is not whole within `deadlines.whole`, is refused with
/// [`UpstreamError::BodyStalled`]. The bytes stay counted until the returned [`Held`] is
/// dropped; `None` for a body that was already whole (every GET's).
pub async fn read<B>(
    body: &mut B,
    declared: Option<u64>,
    account: &BodyFlow,
    deadlines: BodyDeadlines,
) -> Result<Option<(Bytes, Held)>, UpstreamError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<crate::BoxError>,
{
    if body.is_end_stream() {
        return Ok(None);
    }
    let whole = tokio::time::Instant::now() + deadlines.whole;
    let (bytes, held) = buffer(
        body,
        declared,
        Some(account),
        Some((deadlines.progress, whole)),
    )
    .await?;
    Ok(Some((bytes, held.unwrap_or_else(|| Held::new(account)))))
}

/// Reads the request body whole, up to the largest body allowed, holding its bytes in the
/// budget of `account` while they are read and until the returned [`Held`] is dropped;
/// with `deadlines`, each wait for bytes ends at the first of the progress time and the
/// instant the whole body is due.
pub(super) async fn buffer<B>(
    body: &mut B,
    declared: Option<u64>,
    account: Option<&BodyFlow>,
    deadlines: Option<(Duration, tokio::time::Instant)>,
) -> Result<(Bytes, Option<Held>), UpstreamError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<crate::BoxError>,
{
    let limit = account.map_or(MAX_REQUEST_BODY, |a| a.budget.max_body);
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(UpstreamError::BodyTooLarge(limit));
    }
    if body.is_end_stream() {
        return Ok((Bytes::new(), None));
    }
    let mut held = account.map(Held::new);
    let expected = declared.unwrap_or(0) as usize;
    if let Some(held) = held.as_mut() {
        held.grow(expected)?;
    }
    // Allocated at the first frame that does not end the body: one that comes whole in
    // a frame is kept as it came.
    let mut out = Vec::new();
    loop {
        let frame = match deadlines {
            None => body.frame().await,
            Some((progress, whole)) => {
                let due = whole.min(tokio::time::Instant::now() + progress);
                match tokio::time::timeout_at(due, body.frame()).await {
                    Ok(frame) => frame,
                    Err(_) if due == whole => {
                        return Err(UpstreamError::BodyStalled(BodyStall::Whole));
                    }
                    Err(_) => {
                        return Err(UpstreamError::BodyStalled(BodyStall::Progress(progress)));
                    }
                }
            }
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| {
            let e: crate::BoxError = e.into();
            UpstreamError::RequestBody(e.into())
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let needed = out.len() + data.len();
        if needed > limit {
            return Err(UpstreamError::BodyTooLarge(limit));
        }
        if out.is_empty() && body.is_end_stream() {
            // Whole in one frame (a body admission read already, a small write): no copy.
            if let Some(held) = held.as_mut() {
                held.grow(needed)?;
            }
            return Ok((data, held));
        }
        if out.capacity() == 0 {
            out.reserve_exact(expected.min(limit));
        }
        if needed > out.capacity() {
            // Grow as a Vec would, but only by what the budget allows.
            let capacity = needed.max(out.capacity() * 2).min(limit);
            if let Some(held) = held.as_mut() {
                held.grow(capacity)?;
            }
            out.reserve_exact(capacity - out.len());
        }
        out.extend_from_slice(&data);
    }
    Ok((Bytes::from(out), held))
}

/// Why a request body was cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyStall {
    /// Nothing arrived for this long.
    Progress(Duration),
    /// The whole body did not arrive in time.
    Whole,
}

impl std::fmt::Display for BodyStall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyStall::Progress(d) => write!(f, "no bytes for {}", humantime::format_duration(*d)),
            BodyStall::Whole => f.write_str("not whole within the time allowed a request body"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Body;

    async fn buffer_all(
        mut body: Body,
        headers: &HeaderMap,
        account: Option<&BodyFlow>,
    ) -> Result<(Bytes, Option<Held>), UpstreamError> {
        buffer(&mut body, declared_length(headers), account, None).await
    }

    fn budget(total: u64, per_flow: u64) -> Arc<BodyBudget> {
        BodyBudget::new(&config::ListenLimits {
            buffered_body_bytes: config::Quantity(total),
            buffered_body_bytes_per_flow: config::Quantity(per_flow),
            max_body_bytes: 3 << 20,
            ..config::ListenLimits::default()
        })
    }

    fn flow(budget: &Arc<BodyBudget>, name: &str) -> BodyFlow {
        BodyFlow {
            budget: budget.clone(),
            flow: Arc::from(name),
        }
    }

    /// A body that arrives in `chunks` frames of `chunk` bytes, without a length.
    fn chunked(chunks: usize, chunk: usize) -> Body {
        let frames = (0..chunks).map(move |_| {
            Ok::<_, crate::BoxError>(http_body::Frame::data(Bytes::from(vec![b'x'; chunk])))
        });
        http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed_unsync()
    }

    fn with_length(len: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, len.into());
        headers
    }

    #[tokio::test]
    async fn a_body_whole_in_one_frame_is_kept_as_it_came() {
        let budget = budget(8 << 20, 4 << 20);
        let alice = flow(&budget, "r/alice");
        let sent = Bytes::from(vec![b'x'; 5000]);
        let (bytes, held) = buffer_all(crate::full(sent.clone()), &HeaderMap::new(), Some(&alice))
            .await
            .unwrap();
        assert_eq!(bytes.as_ptr(), sent.as_ptr(), "the body was copied");
        assert_eq!(budget.available_bytes(), (8 << 20) - 5 * 1024);
        drop(held);
        assert_eq!(budget.available_bytes(), 8 << 20);
    }

    #[tokio::test]
    async fn a_body_holds_its_bytes_until_dropped() {
        let budget = budget(8 << 20, 4 << 20);
        let alice = flow(&budget, "r/alice");
        let (bytes, held) = buffer_all(
            crate::full(vec![b'x'; 3000]),
            &with_length(3000),
            Some(&alice),
        )
        .await
        .unwrap();
        assert_eq!(bytes.len(), 3000);
        assert_eq!(budget.available_bytes(), (8 << 20) - 3 * 1024);
        assert_eq!(budget.flows_holding(), 1);
        drop(held);
        assert_eq!(budget.available_bytes(), 8 << 20);
        assert_eq!(budget.flows_holding(), 0);
    }

    #[tokio::test]
    async fn a_declared_length_over_the_room_left_is_refused_before_reading() {
        let budget = budget(8 << 20, 4 << 20);
        let alice = flow(&budget, "r/alice");
        let one = buffer_all(
            crate::full(vec![b'x'; 3 << 20]),
            &with_length(3 << 20),
            Some(&alice),
        )
        .await
        .unwrap();
        // The flow has 1 MiB left: a second 3 MiB body of alice's does not fit...
        let err = buffer_all(
            crate::full(vec![b'x'; 3 << 20]),
            &with_length(3 << 20),
            Some(&alice),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, UpstreamError::BodyBudget(BudgetScope::Flow)),
            "{err}"
        );
        // ...bob's does; then the total has 2 MiB left, and carol's does not fit.
        let bob = flow(&budget, "r/bob");
        let two = buffer_all(
            crate::full(vec![b'x'; 3 << 20]),
            &with_length(3 << 20),
            Some(&bob),
        )
        .await
        .unwrap();
        let carol = flow(&budget, "r/carol");
        let err = buffer_all(
            crate::full(vec![b'x'; 3 << 20]),
            &with_length(3 << 20),
            Some(&carol),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, UpstreamError::BodyBudget(BudgetScope::Total)),
            "{err}"
        );
        assert_eq!(budget.flows_holding(), 2, "a refused body holds nothing");
        drop((one, two));
        assert_eq!(budget.available_bytes(), 8 << 20);
        assert_eq!(budget.flows_holding(), 0);
    }

    #[tokio::test]
    async fn a_body_without_a_length_is_counted_as_it_grows() {
        let budget = budget(4 << 20, 4 << 20);
        let alice = flow(&budget, "r/alice");
        let (bytes, held) = buffer_all(chunked(100, 10_000), &HeaderMap::new(), Some(&alice))
            .await
            .unwrap();
        assert_eq!(bytes.len(), 1_000_000);
        let holding = (4 << 20) - budget.available_bytes();
        assert!(
            (1_000_000..=2_000_000).contains(&holding),
            "{holding} bytes held for a 1 MB body"
        );
        // 3 MB more do not fit in what is left (a little over 2 MiB): refused mid-body.
        let err = buffer_all(chunked(300, 10_000), &HeaderMap::new(), Some(&alice))
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::BodyBudget(_)), "{err}");
        drop(held);
        assert_eq!(budget.available_bytes(), 4 << 20);
    }

    #[tokio::test]
    async fn bodies_over_the_largest_allowed_get_413_and_own_requests_hold_nothing() {
        let budget = budget(8 << 20, 4 << 20);
        let alice = flow(&budget, "r/alice");
        let err = buffer_all(chunked(40, 100_000), &HeaderMap::new(), Some(&alice))
            .await
            .unwrap_err();
        assert!(
            matches!(err, UpstreamError::BodyTooLarge(n) if n == 3 << 20),
            "{err}"
        );
        let err = buffer_all(crate::empty(), &with_length(4_000_000), Some(&alice))
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::BodyTooLarge(_)), "{err}");
        let exact = vec![b'x'; MAX_REQUEST_BODY];
        let (bytes, held) = buffer_all(crate::full(exact), &HeaderMap::new(), None)
            .await
            .unwrap();
        assert_eq!((bytes.len(), held.is_none()), (MAX_REQUEST_BODY, true));
        let over = vec![b'x'; MAX_REQUEST_BODY + 1];
        let err = buffer_all(crate::full(over), &HeaderMap::new(), None)
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::BodyTooLarge(_)), "{err}");
        assert_eq!(budget.available_bytes(), 8 << 20);
    }
}
