//! What Bulwark tells a client it answers itself: the [`Reason`] (the metric label and the
//! `X-Bulwark-Reason` header), the HTTP status it picks, and the [`Refusal`] that writes the
//! status, the `X-Bulwark-*` headers and the Kubernetes `Status` body. Every module that
//! refuses says so with these; `stages::error` decides which refusal each stage's error is.

use std::sync::Arc;
use std::time::Duration;

use apimachinery::status::{Cause, Details, Status};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

/// The request's audit ID, as the apiserver names it.
pub const AUDIT_ID: HeaderName = HeaderName::from_static("audit-id");
/// The addresses a request came through.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// Why Bulwark answered by itself (a [`Reason`]), on every answer it gives itself.
pub const X_BULWARK_REASON: HeaderName = HeaderName::from_static("x-bulwark-reason");
/// The rule that admitted (or refused) a request, on every answer that has one.
pub const X_BULWARK_RULE: HeaderName = HeaderName::from_static("x-bulwark-rule");
/// The rule's priority level.
pub const X_BULWARK_LEVEL: HeaderName = HeaderName::from_static("x-bulwark-level");

/// Why Bulwark answered by itself: one enum for the metric label, the `X-Bulwark-Reason`
/// header, the `Status` message and the logs (DESIGN.md Contracts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The flow's token bucket is empty.
    RateLimited,
    /// The flow's fair queue is full.
    QueueFull,
    /// The request waited in its queue longer than the level allows.
    QueueTimeout,
    /// The replica's in-flight LIST byte budget stayed full.
    ByteBudget,
    /// The flow has as many open watches as its rule allows.
    WatchLimit,
    /// The request bodies held in memory for all requests, or for the request's flow, have
    /// no room for this one.
    BodyBudget,
    /// A bearer token needs a TokenReview, and Bulwark makes no more reviews for now.
    ReviewLimited,
    /// No usable credentials.
    Unauthenticated,
    /// The identity may not do this.
    Forbidden,
    /// The request is malformed.
    BadRequest,
    /// Every apiserver replica is unreachable.
    NoHealthyUpstream,
    /// The apiserver did not answer in time.
    UpstreamTimeout,
    /// The apiserver connection failed.
    UpstreamError,
}

impl Reason {
    /// Every reason, for documentation and tests.
    pub const ALL: [Reason; 13] = [
        Reason::RateLimited,
        Reason::QueueFull,
        Reason::QueueTimeout,
        Reason::ByteBudget,
        Reason::WatchLimit,
        Reason::BodyBudget,
        Reason::ReviewLimited,
        Reason::Unauthenticated,
        Reason::Forbidden,
        Reason::BadRequest,
        Reason::NoHealthyUpstream,
        Reason::UpstreamTimeout,
        Reason::UpstreamError,
    ];

    /// The label and header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RateLimited => "rate_limited",
            Reason::QueueFull => "queue_full",
            Reason::QueueTimeout => "queue_timeout",
            Reason::ByteBudget => "byte_budget",
            Reason::WatchLimit => "watch_limit",
            Reason::BodyBudget => "body_budget",
            Reason::ReviewLimited => "review_limited",
            Reason::Unauthenticated => "unauthenticated",
            Reason::Forbidden => "forbidden",
            Reason::BadRequest => "bad_request",
            Reason::NoHealthyUpstream => "no_healthy_upstream",
            Reason::UpstreamTimeout => "upstream_timeout",
            Reason::UpstreamError => "upstream_error",
        }
    }

    /// The HTTP status this reason is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            Reason::RateLimited
            | Reason::QueueFull
            | Reason::QueueTimeout
            | Reason::ByteBudget
            | Reason::WatchLimit
            | Reason::BodyBudget
            | Reason::ReviewLimited => StatusCode::TOO_MANY_REQUESTS,
            Reason::Unauthenticated => StatusCode::UNAUTHORIZED,
            Reason::Forbidden => StatusCode::FORBIDDEN,
            Reason::BadRequest => StatusCode::BAD_REQUEST,
            Reason::NoHealthyUpstream => StatusCode::SERVICE_UNAVAILABLE,
            Reason::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Reason::UpstreamError => StatusCode::BAD_GATEWAY,
        }
    }
}

/// The Kubernetes `Status.reason` for a status code.
fn k8s_reason(status: StatusCode) -> &'static str {
    match status {
        StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
        StatusCode::UNAUTHORIZED => "Unauthorized",
        StatusCode::FORBIDDEN => "Forbidden",
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        StatusCode::GATEWAY_TIMEOUT => "Timeout",
        StatusCode::PAYLOAD_TOO_LARGE => "RequestEntityTooLarge",
        _ => "InternalError",
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A response Bulwark gives by itself: everything needed to write the status, headers and
/// `Status` body.
#[derive(Debug, Clone)]
pub struct Refusal {
    /// Why.
    pub reason: Reason,
    /// Human-readable detail for the `Status` message. Shared, as the rule and level are:
    /// a storm's refusals are one flow's, refused in the same words, and a clone copies
    /// no string.
    pub message: Arc<str>,
    /// The rule that matched, when rules ran.
    pub rule: Option<Arc<str>>,
    /// The priority level, when rules ran.
    pub level: Option<Arc<str>>,
    /// When the client should try again.
    pub retry_after: Option<Duration>,
    /// A status other than the reason's own (e.g. 413 for a body too large).
    pub status: Option<StatusCode>,
}

impl Refusal {
    /// A refusal with a reason and a message and nothing else.
    pub fn new(reason: Reason, message: impl Into<Arc<str>>) -> Self {
        Self {
            reason,
            message: message.into(),
            rule: None,
            level: None,
            retry_after: None,
            status: None,
        }
    }

    /// Answers with `status` instead of the reason's usual one.
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }

    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        self.status.unwrap_or_else(|| self.reason.status())
    }

    /// Adds a `Retry-After`.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The `Status` JSON body, as the apiserver writes it. A 401 says `Unauthorized` and
    /// nothing more, as the apiserver's does: what failed is for the log.
    pub fn body(&self) -> Bytes {
        let status = self.status();
        let mut message = self.message.to_string();
        if status == StatusCode::UNAUTHORIZED {
            message = "Unauthorized".to_owned();
        } else if let (Some(rule), Some(level)) = (&self.rule, &self.level) {
            message = format!(
                "{message} (bulwark rule {rule}, level {level}, reason {})",
                self.reason
            );
        } else {
            message = format!("{message} (bulwark reason {})", self.reason);
        }
        let details = self.retry_after.map(|after| Details {
            causes: vec![Cause {
                message: message.clone(),
                ..Cause::default()
            }],
            retry_after_seconds: Some(retry_after_secs(after)),
            ..Details::default()
        });
        Bytes::from(
            Status::failure(status.as_u16(), k8s_reason(status), message, details).to_body(),
        )
    }

    /// The full response. What it writes for a refusal it wrote lately on this thread (the
    /// same reason, message, rule, level and `Retry-After`, as a storm's refusals of one
    /// flow are) is taken from this thread's memo ([`Parts`]), not written again.
    pub fn into_response(self) -> http::Response<crate::Body> {
        let written = Parts::recall_or_write(&self);
        let mut response = http::Response::new(Pieces::body(written.body));
        *response.status_mut() = self.status();
        *response.headers_mut() = written.headers;
        response
    }

    /// What the memo of [`Parts`] tells refusals apart by: everything its parts are made of.
    fn words(
        &self,
    ) -> (
        Reason,
        StatusCode,
        &str,
        Option<&str>,
        Option<&str>,
        Option<u64>,
    ) {
        (
            self.reason,
            self.status(),
            &self.message,
            self.rule.as_deref(),
            self.level.as_deref(),
            self.retry_after.map(retry_after_secs),
        )
    }

    /// [`Refusal::words`] hashed: the memo's key.
    fn memo_key(&self) -> u64 {
        use std::hash::BuildHasher as _;
        foldhash::fast::FixedState::default().hash_one(self.words())
    }
}

/// How many refusals' parts each thread keeps: a storm is refused in a few flows' words
/// and a few `Retry-After`s each, and each entry is about half a KiB.
const WRITTEN_MEMO: usize = 256;

thread_local! {
    static WRITTEN: std::cell::RefCell<lru::LruCache<u64, Written>> = std::cell::RefCell::new(
        lru::LruCache::new(std::num::NonZeroUsize::new(WRITTEN_MEMO).expect("not zero")),
    );
}

/// A refusal's answer as written, kept in this thread's memo with the refusal it was
/// written for, to tell it from another of the same hash.
struct Written {
    of: Refusal,
    parts: Parts,
}

/// The parts of a refusal's answer: its `Status` body and its headers (`Content-Type`,
/// `X-Bulwark-Reason`, `Retry-After`, `X-Bulwark-Rule`, `X-Bulwark-Level`). While a storm
/// is shed, the same flow is refused in the same words many times a second; serializing
/// the body each time was about 8,700 instructions of a refusal's 76,000, and inserting
/// the headers one by one about 1,600 more (README, Benchmarks). A clone shares the bytes.
#[derive(Clone)]
struct Parts {
    body: Bytes,
    headers: http::HeaderMap,
}

impl Parts {
    /// `refusal`'s parts from this thread's memo, or written (and kept) now.
    fn recall_or_write(refusal: &Refusal) -> Parts {
        let key = refusal.memo_key();
        let recalled = WRITTEN.with_borrow_mut(|memo| {
            memo.get(&key)
                .filter(|written| written.of.words() == refusal.words())
                .map(|written| written.parts.clone())
        });
        if let Some(parts) = recalled {
            return parts;
        }
        let mut headers = http::HeaderMap::with_capacity(5);
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            X_BULWARK_REASON,
            HeaderValue::from_static(refusal.reason.as_str()),
        );
        if let Some(after) = refusal.retry_after {
            headers.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(after)),
            );
        }
        for (name, value) in [
            (X_BULWARK_RULE, &refusal.rule),
            (X_BULWARK_LEVEL, &refusal.level),
        ] {
            if let Some(value) = value.as_deref().and_then(|v| HeaderValue::from_str(v).ok()) {
                headers.insert(name, value);
            }
        }
        let parts = Parts {
            body: refusal.body(),
            headers,
        };
        let written = Written {
            of: refusal.clone(),
            parts: parts.clone(),
        };
        WRITTEN.with_borrow_mut(|memo| memo.put(key, written));
        parts
    }
}

/// A refusal's body as HTTP/2 sends it cheapest: in DATA frames under [`PIECE`] bytes.
///
/// h2 copies a DATA frame shorter than 4,096 bytes (256 as published; `patches/README.md`)
/// into its write buffer, where the frames of other answers join it; a longer one it keeps
/// aside and writes on its own, so that the next frame of the connection waits for a flush:
/// a TLS record and a `writev` for each answer. A storm's 429s all go to the same few
/// connections; in frames under the threshold, the answers to one read of requests leave in
/// one write (`passthrough`'s `bulwark-refused` measured one `writev` for each refusal
/// before, README Sizing). A refusal's body is one such frame unless its message is long.
struct Pieces {
    rest: Bytes,
}

/// See [`Pieces`]: one byte under h2's threshold.
const PIECE: usize = 4_095;

impl Pieces {
    fn body(bytes: Bytes) -> crate::Body {
        use http_body_util::BodyExt as _;
        Pieces { rest: bytes }
            .map_err(|never: std::convert::Infallible| match never {})
            .boxed_unsync()
    }
}

impl http_body::Body for Pieces {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let n = self.rest.len().min(PIECE);
        std::task::Poll::Ready((n > 0).then(|| Ok(http_body::Frame::data(self.rest.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.rest.len() as u64)
    }
}

/// Whole seconds for `Retry-After`, at least 1.
fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs_f64().ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use http_body::Body as _;
    use http_body_util::BodyExt as _;

    use super::*;

    #[test]
    fn a_429_carries_retry_after_reason_and_a_kubernetes_status() {
        let mut refusal = Refusal::new(Reason::QueueFull, "too many requests queued")
            .retry_after(Duration::from_millis(1500));
        refusal.rule = Some("secret-operators".into());
        refusal.level = Some("list-heavy".into());
        let body = refusal.body();
        let response = refusal.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()["retry-after"], "2");
        assert_eq!(response.headers()["x-bulwark-reason"], "queue_full");
        assert_eq!(response.headers()["x-bulwark-rule"], "secret-operators");
        let status: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["reason"], "TooManyRequests");
        assert_eq!(status["code"], 429);
        assert_eq!(status["details"]["retryAfterSeconds"], 2);
        let message = status["message"].as_str().unwrap();
        assert!(message.contains("secret-operators") && message.contains("list-heavy"));
        assert!(message.contains("queue_full"));
    }

    #[test]
    fn a_401_is_the_apiservers_bare_unauthorized() {
        let mut refusal = Refusal::new(Reason::Unauthenticated, "the token was rejected: expired");
        refusal.rule = Some("r".into());
        refusal.level = Some("l".into());
        let status: serde_json::Value = serde_json::from_slice(&refusal.body()).unwrap();
        assert_eq!(
            status,
            serde_json::json!({
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "Unauthorized",
                "reason": "Unauthorized",
                "code": 401,
            })
        );
        let response = refusal.into_response();
        assert_eq!(response.headers()["x-bulwark-reason"], "unauthenticated");
    }

    /// A refusal answered from the memo gets headers of its own: what the request path
    /// adds to one answer (its `Audit-Id`) is not in the next.
    #[test]
    fn a_remembered_refusals_headers_are_its_own() {
        let refusal = || {
            let mut refusal = Refusal::new(Reason::RateLimited, "flow f is over its rate")
                .retry_after(Duration::from_secs(1));
            refusal.rule = Some("r".into());
            refusal.level = Some("l".into());
            refusal
        };
        let mut first = refusal().into_response();
        first
            .headers_mut()
            .insert(AUDIT_ID, HeaderValue::from_static("first"));
        let second = refusal().into_response();
        assert_eq!(second.headers().get(AUDIT_ID), None);
        let names = |r: &http::Response<crate::Body>| {
            let mut names: Vec<_> = r.headers().keys().map(|n| n.as_str().to_owned()).collect();
            names.sort();
            names
        };
        assert_eq!(
            names(&second),
            [
                "content-type",
                "retry-after",
                "x-bulwark-level",
                "x-bulwark-reason",
                "x-bulwark-rule"
            ]
        );
        assert_eq!(names(&first).len(), 6);
    }

    /// Answers read from the thread's memo say what a refusal written afresh says, and a
    /// refusal that differs in any word (its `Retry-After`, its flow's message, its rule) is
    /// not answered with another's.
    #[test]
    fn a_remembered_refusal_is_answered_as_if_written_afresh() {
        let refusal = |message: &str, rule: &str, after_ms: u64| {
            let mut refusal = Refusal::new(Reason::RateLimited, message)
                .retry_after(Duration::from_millis(after_ms));
            refusal.rule = Some(rule.into());
            refusal.level = Some("workload".into());
            refusal
        };
        let asked = [
            refusal("flow a is over its rate", "r", 1_000),
            refusal("flow a is over its rate", "r", 1_000),
            refusal("flow a is over its rate", "r", 3_000),
            refusal("flow b is over its rate", "r", 1_000),
            refusal("flow a is over its rate", "s", 1_000),
            refusal("flow a is over its rate", "r", 1_000),
        ];
        for refusal in asked {
            let afresh = refusal.body();
            let (retry, rule) = (
                retry_after_secs(refusal.retry_after.unwrap()),
                refusal.rule.clone().unwrap(),
            );
            let response = refusal.into_response();
            assert_eq!(
                response.headers()["retry-after"],
                retry.to_string().as_str()
            );
            assert_eq!(response.headers()["x-bulwark-rule"], &*rule);
            assert_eq!(response.headers()["x-bulwark-level"], "workload");
            let body = futures::executor::block_on(response.into_body().collect())
                .unwrap()
                .to_bytes();
            assert_eq!(body, afresh);
        }
    }

    /// A refusal's body goes in DATA frames h2 copies into its write buffer (under 4,096
    /// bytes), all of it, with its length announced.
    #[tokio::test]
    async fn a_refusal_is_sent_in_pieces_under_h2s_threshold() {
        let mut refusal = Refusal::new(Reason::RateLimited, "x".repeat(10_000))
            .retry_after(Duration::from_secs(1));
        refusal.rule = Some("r".into());
        let whole = refusal.body();
        let mut body = refusal.into_response().into_body();
        assert_eq!(body.size_hint().exact(), Some(whole.len() as u64));
        let mut pieces = Vec::new();
        while let Some(frame) = body.frame().await {
            pieces.push(frame.unwrap().into_data().unwrap());
        }
        assert!(
            pieces.len() >= whole.len() / PIECE,
            "{} pieces",
            pieces.len()
        );
        assert!(pieces.iter().all(|p| !p.is_empty() && p.len() < 4_096));
        assert_eq!(pieces.concat(), whole);
        assert!(body.is_end_stream());
    }

    /// A storm's refusal, its rule, level and flow named, is one DATA frame.
    #[tokio::test]
    async fn a_rate_limited_refusal_is_one_frame() {
        let flow = "system:serviceaccount:kube-system:daemon-set-controller";
        let mut refusal = Refusal::new(
            Reason::RateLimited,
            format!(
                "flow {flow} is over its rate of 20 requests per second (burst 40) across the fleet"
            ),
        )
        .retry_after(Duration::from_secs(1));
        refusal.rule = Some("kube-controller-manager".into());
        refusal.level = Some("workload-high".into());
        let whole = refusal.body();
        let mut body = refusal.into_response().into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, whole, "{} bytes in one frame", whole.len());
        assert!(body.frame().await.is_none());
    }

    #[test]
    fn every_reason_has_a_distinct_label() {
        let labels: std::collections::HashSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), Reason::ALL.len());
    }
}
