//! The one place that turns a refusal or failure into an HTTP status with a Kubernetes
//! `Status` body, a reason label and the `X-Bulwark-*` headers: every stage fails with a
//! [`ProxyError`], [`ProxyError::refusal`] decides what the client is told, and
//! `rescue::Rescue` answers, counts and logs it once.

use std::sync::Arc;
use std::time::Duration;

use apimachinery::status::{Cause, Details, Status};
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

use crate::Body;
use crate::cache::CacheError;
use crate::classify::ClassifyError;
use crate::identity::IdentityError;
use crate::identity::forward::ForwardError;
use crate::metrics::ServedBy;
use crate::upstream::UpstreamError;

/// Why a request was answered by Bulwark itself.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request is malformed.
    #[error(transparent)]
    Classify(#[from] ClassifyError),
    /// The client is not who it needs to be.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The request cannot be forwarded as it is.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// The apiservers could not answer.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// Admission said no (429 with rule, level, reason and `Retry-After`).
    #[error("{}", .0.message)]
    Refused(Refusal),
    /// The cache refused a read it would otherwise answer: 403 from the reader's
    /// SubjectAccessReview, in the apiserver's own words, or an error when no review could
    /// be made.
    #[error("{error}")]
    Cache {
        /// Why.
        #[source]
        error: CacheError,
        /// The reader's rule.
        rule: Arc<str>,
        /// The reader's priority level.
        level: String,
    },
}

impl ProxyError {
    /// The refusal the client sees. Its message never names a replica, a file or why a
    /// credential failed (a 401 says only `Unauthorized`, as the apiserver's does): the
    /// rejection log has the whole error.
    pub fn refusal(&self) -> Refusal {
        let message = self.to_string();
        match self {
            ProxyError::Classify(_) => Refusal::new(Reason::BadRequest, message),
            ProxyError::Identity(IdentityError::ReviewFailed(_)) => {
                Refusal::new(Reason::UpstreamError, "the token could not be reviewed")
                    .retry_after(Duration::from_secs(1))
            }
            ProxyError::Identity(IdentityError::ReviewLimited(limited)) => {
                Refusal::new(Reason::ReviewLimited, message).retry_after(limited.retry_after)
            }
            ProxyError::Identity(_) => Refusal::new(Reason::Unauthenticated, "Unauthorized"),
            ProxyError::Forward(ForwardError::ClientImpersonation) => {
                Refusal::new(Reason::Forbidden, message)
            }
            ProxyError::Forward(ForwardError::Unrepresentable(_)) => {
                Refusal::new(Reason::BadRequest, message)
            }
            ProxyError::Forward(ForwardError::OwnToken { .. }) => Refusal::new(
                Reason::UpstreamError,
                "bulwark's own credential is unavailable",
            ),
            ProxyError::Upstream(error) => upstream_refusal(error),
            ProxyError::Refused(refusal) => refusal.clone(),
            ProxyError::Cache { error, rule, level } => {
                let refusal = match error {
                    CacheError::Status(status, _) => {
                        let reason = match status.code {
                            403 => Reason::Forbidden,
                            504 => Reason::UpstreamTimeout,
                            _ => Reason::BadRequest,
                        };
                        Refusal::new(reason, message)
                    }
                    CacheError::ReviewFailed(_) => {
                        Refusal::new(Reason::UpstreamError, "the access review could not be made")
                            .retry_after(Duration::from_secs(1))
                    }
                };
                Refusal {
                    rule: Some(rule.to_string()),
                    level: Some(level.clone()),
                    ..refusal
                }
            }
        }
    }

    /// The response for this error, whose [`ProxyError::refusal`] is `refusal`: a `Status`
    /// the cache wrote in the apiserver's words goes as it is, with Bulwark's headers; every
    /// other refusal is written by [`Refusal::into_response`].
    pub fn into_response(self, refusal: Refusal) -> Response<Body> {
        let ProxyError::Cache { error, .. } = &self else {
            return refusal.into_response();
        };
        let Some(mut response) = error.status_response() else {
            let mut response = refusal.into_response();
            response.extensions_mut().insert(ServedBy::Cache);
            return response;
        };
        let headers = response.headers_mut();
        headers.insert(
            "x-bulwark-reason",
            HeaderValue::from_static(refusal.reason.as_str()),
        );
        for (name, value) in [
            ("x-bulwark-rule", refusal.rule),
            ("x-bulwark-level", refusal.level),
        ] {
            if let Some(value) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
                headers.insert(name, value);
            }
        }
        response
    }
}

/// An upstream failure: 503 with `Retry-After` when no replica is healthy, 504 on timeout,
/// 413 for a body over the apiserver's limit, 429 with `Retry-After` for a body the body
/// budget has no room for, else 502. The message names no replica (clients have no use
/// for the fleet's addresses); the rejection log does.
fn upstream_refusal(error: &UpstreamError) -> Refusal {
    let message = error.to_string();
    match error {
        UpstreamError::NoHealthyReplica { retry_after } => {
            Refusal::new(Reason::NoHealthyUpstream, message).retry_after(*retry_after)
        }
        UpstreamError::Timeout { .. } => Refusal::new(
            Reason::UpstreamTimeout,
            "the apiserver did not answer in time",
        ),
        UpstreamError::BodyBudget(_) => {
            Refusal::new(Reason::BodyBudget, message).retry_after(Duration::from_secs(1))
        }
        UpstreamError::BodyTooLarge(_) => {
            Refusal::new(Reason::BadRequest, message).with_status(StatusCode::PAYLOAD_TOO_LARGE)
        }
        UpstreamError::RequestBody(_) | UpstreamError::NotUpgradable => {
            Refusal::new(Reason::BadRequest, message)
        }
        UpstreamError::Connect { .. } | UpstreamError::Tls { .. } => {
            Refusal::new(Reason::UpstreamError, "the apiserver could not be reached")
        }
        UpstreamError::Protocol { .. } => Refusal::new(
            Reason::UpstreamError,
            "the exchange with the apiserver failed",
        ),
        UpstreamError::Interrupted(_) => Refusal::new(
            Reason::UpstreamError,
            "the request may have reached the apiserver but no answer came; not retried",
        ),
        UpstreamError::MissingCredential(_)
        | UpstreamError::Config(_)
        | UpstreamError::File { .. }
        | UpstreamError::Rustls { .. } => {
            Refusal::new(Reason::UpstreamError, "bulwark cannot forward this request")
        }
    }
}

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
    /// Human-readable detail for the `Status` message.
    pub message: String,
    /// The rule that matched, when rules ran.
    pub rule: Option<String>,
    /// The priority level, when rules ran.
    pub level: Option<String>,
    /// When the client should try again.
    pub retry_after: Option<Duration>,
    /// A status other than the reason's own (e.g. 413 for a body too large).
    pub status: Option<StatusCode>,
}

impl Refusal {
    /// A refusal with a reason and a message and nothing else.
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
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
        let mut message = self.message.clone();
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

    /// The full response.
    pub fn into_response(self) -> http::Response<crate::Body> {
        let mut response = http::Response::new(crate::full(self.body()));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            "x-bulwark-reason",
            HeaderValue::from_static(self.reason.as_str()),
        );
        if let Some(after) = self.retry_after {
            headers.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(after)),
            );
        }
        for (name, value) in [
            ("x-bulwark-rule", &self.rule),
            ("x-bulwark-level", &self.level),
        ] {
            if let Some(value) = value.as_deref().and_then(|v| HeaderValue::from_str(v).ok()) {
                headers.insert(name, value);
            }
        }
        response
    }
}

/// Whole seconds for `Retry-After`, at least 1.
fn retry_after_secs(after: Duration) -> u64 {
    after.as_secs_f64().ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::identity::review::ReviewError;
    use crate::report::SharedError;
    use crate::upstream::TlsFailure;

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

    #[test]
    fn upstream_failures_map_to_the_statuses_the_client_sees() {
        let status = |error| ProxyError::Upstream(error).refusal().status();
        let no = UpstreamError::NoHealthyReplica {
            retry_after: Duration::from_secs(2),
        };
        let refusal = ProxyError::Upstream(no).refusal();
        assert_eq!(refusal.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refusal.reason, Reason::NoHealthyUpstream);
        assert_eq!(refusal.retry_after, Some(Duration::from_secs(2)));
        assert_eq!(
            status(UpstreamError::Timeout { replica: None }),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            status(UpstreamError::Interrupted(Arc::new(
                UpstreamError::Timeout { replica: None }
            ))),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            status(UpstreamError::BodyTooLarge(10)),
            StatusCode::PAYLOAD_TOO_LARGE
        );
    }

    #[test]
    fn every_reason_has_a_distinct_label() {
        let labels: std::collections::HashSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), Reason::ALL.len());
    }

    /// The whole answer a client gets for `error`, as Rescue writes it.
    async fn answer(error: ProxyError) -> (StatusCode, String) {
        let refusal = error.refusal();
        let response = error.into_response(refusal);
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn failures_upstream_name_no_replica_and_no_file_to_the_client() {
        let replica = "10.0.0.7:6443";
        let refused = || -> SharedError { Arc::new(std::io::Error::other("refused")) };
        let errors = [
            ProxyError::Upstream(UpstreamError::Connect {
                replica: replica.into(),
                source: Arc::new(std::io::Error::other("refused")),
            }),
            ProxyError::Upstream(UpstreamError::Tls {
                replica: replica.into(),
                source: Arc::new(TlsFailure::Handshake(std::io::Error::other(
                    "bad certificate",
                ))),
            }),
            ProxyError::Upstream(UpstreamError::Protocol {
                replica: replica.into(),
                source: refused(),
            }),
            ProxyError::Upstream(UpstreamError::Interrupted(Arc::new(
                UpstreamError::Protocol {
                    replica: replica.into(),
                    source: refused(),
                },
            ))),
            ProxyError::Upstream(UpstreamError::Config(format!("replica {replica}"))),
            ProxyError::Upstream(UpstreamError::File {
                path: format!("/var/run/secrets/{replica}/ca.crt").into(),
                source: refused(),
            }),
            ProxyError::Identity(IdentityError::ReviewFailed(Arc::new(ReviewError::Status {
                path: "/apis/authentication.k8s.io/v1/tokenreviews",
                status: StatusCode::BAD_GATEWAY,
                message: format!("{replica}: refused"),
            }))),
            ProxyError::Forward(ForwardError::OwnToken {
                path: format!("/var/run/secrets/{replica}/token").into(),
                source: refused(),
            }),
            ProxyError::Cache {
                error: CacheError::ReviewFailed(Arc::new(ReviewError::Upstream {
                    path: "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                    source: UpstreamError::Connect {
                        replica: replica.into(),
                        source: Arc::new(std::io::Error::other("refused")),
                    },
                })),
                rule: Arc::from("r"),
                level: "l".into(),
            },
        ];
        for error in errors {
            let detail = crate::report::chain(&error);
            assert!(
                detail.contains(replica),
                "the log line has the cause: {detail}"
            );
            let (status, body) = answer(error).await;
            assert!(status.is_server_error(), "{detail}: {status}");
            assert!(!body.contains(replica), "{detail}: {body}");
            assert!(!body.contains("/var/run"), "{detail}: {body}");
        }
    }

    #[tokio::test]
    async fn every_401_says_unauthorized_and_nothing_more() {
        for error in [
            IdentityError::NoCredentials,
            IdentityError::MalformedAuthorization,
            IdentityError::TokenRejected("token expired".into()),
            IdentityError::BadCertificate("more than one CN".into()),
            IdentityError::ConnectionClosing(16),
        ] {
            let (status, body) = answer(ProxyError::Identity(error)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
            let status: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(status["message"], "Unauthorized");
            assert_eq!(status["reason"], "Unauthorized");
            assert_eq!(status["code"], 401);
        }
    }
}
