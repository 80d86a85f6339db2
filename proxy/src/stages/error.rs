//! The stage error: why a request was answered by Bulwark itself. Every stage fails with a
//! [`ProxyError`], [`ProxyError::refusal`] is the one mapping that decides what the client
//! is told, and `rescue::Rescue` answers, counts and logs it once.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Response, StatusCode};

use crate::Body;
use crate::cache::CacheError;
use crate::classify::ClassifyError;
use crate::identity::IdentityError;
use crate::identity::forward::ForwardError;
use crate::metrics::ServedBy;
use crate::status::{Reason, Refusal, X_BULWARK_LEVEL, X_BULWARK_REASON, X_BULWARK_RULE};
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
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A failure after admission (the cache's, forwarding's or the apiservers'): its answer
    /// names the rule and level that admitted the request, as every answer to an admitted
    /// request does, and it is counted with them.
    #[error("{error}")]
    Admitted {
        /// Why.
        #[source]
        error: Box<ProxyError>,
        /// The request's rule.
        rule: Arc<str>,
        /// The rule's priority level.
        level: Arc<str>,
    },
}

impl ProxyError {
    /// The refusal the client sees. Its message never names a replica, a file or why a
    /// credential failed (a 401 says only `Unauthorized`, as the apiserver's does): the
    /// rejection log has the whole error.
    pub fn refusal(&self) -> Refusal {
        // Written only where the refusal says it: a refusal from admission, a storm's
        // every answer, carries its own words.
        let message = || self.to_string();
        match self {
            ProxyError::Classify(_) => Refusal::new(Reason::BadRequest, message()),
            ProxyError::Identity(IdentityError::ReviewFailed(_)) => {
                Refusal::new(Reason::UpstreamError, "the token could not be reviewed")
                    .retry_after(Duration::from_secs(1))
            }
            ProxyError::Identity(IdentityError::ReviewLimited(limited)) => {
                Refusal::new(Reason::ReviewLimited, message()).retry_after(limited.retry_after)
            }
            ProxyError::Identity(_) => Refusal::new(Reason::Unauthenticated, "Unauthorized"),
            ProxyError::Forward(ForwardError::ClientImpersonation) => {
                Refusal::new(Reason::Forbidden, message())
            }
            ProxyError::Forward(ForwardError::Unrepresentable(_)) => {
                Refusal::new(Reason::BadRequest, message())
            }
            ProxyError::Upstream(error) => upstream_refusal(error),
            ProxyError::Refused(refusal) => refusal.clone(),
            ProxyError::Cache(error) => match error {
                CacheError::Status(status, _) => {
                    let reason = match status.code {
                        403 => Reason::Forbidden,
                        504 => Reason::UpstreamTimeout,
                        _ => Reason::BadRequest,
                    };
                    Refusal::new(reason, message())
                }
                CacheError::ReviewFailed(_) => {
                    Refusal::new(Reason::UpstreamError, "the access review could not be made")
                        .retry_after(Duration::from_secs(1))
                }
            },
            ProxyError::Admitted { error, rule, level } => Refusal {
                rule: Some(rule.clone()),
                level: Some(level.clone()),
                ..error.refusal()
            },
        }
    }

    /// This error as a failure after admission by `rule` at `level`.
    pub fn admitted(self, rule: Arc<str>, level: Arc<str>) -> ProxyError {
        ProxyError::Admitted {
            error: Box::new(self),
            rule,
            level,
        }
    }

    /// The response for this error, whose [`ProxyError::refusal`] is `refusal`: a `Status`
    /// the cache wrote in the apiserver's words goes as it is, with Bulwark's headers; every
    /// other refusal is written by [`Refusal::into_response`].
    pub fn into_response(self, refusal: Refusal) -> Response<Body> {
        let error = match self {
            ProxyError::Admitted { error, .. } => return error.into_response(refusal),
            ProxyError::Cache(error) => error,
            _ => return refusal.into_response(),
        };
        let Some(mut response) = error.status_response() else {
            let mut response = refusal.into_response();
            response.extensions_mut().insert(ServedBy::Cache);
            return response;
        };
        let headers = response.headers_mut();
        headers.insert(
            X_BULWARK_REASON,
            HeaderValue::from_static(refusal.reason.as_str()),
        );
        for (name, value) in [
            (X_BULWARK_RULE, refusal.rule),
            (X_BULWARK_LEVEL, refusal.level),
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
        UpstreamError::BodyStalled(_) => {
            Refusal::new(Reason::BadRequest, message).with_status(StatusCode::REQUEST_TIMEOUT)
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

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::cache::Status;
    use crate::own::{CallError, ReviewError};
    use crate::report::SharedError;
    use crate::upstream::TlsFailure;

    #[test]
    fn a_malformed_request_is_a_400() {
        for target in [
            "/api/v1/proxy/namespaces/default/pods/web-0",
            "/api/v1/pods/%2e%2e",
        ] {
            let uri: http::Uri = target.parse().unwrap();
            let error = crate::classify::classify(&http::Method::GET, &uri).unwrap_err();
            let refusal = ProxyError::Classify(error).refusal();
            assert_eq!(refusal.status(), StatusCode::BAD_REQUEST, "{target}");
            assert_eq!(refusal.reason, Reason::BadRequest, "{target}");
        }
    }

    #[tokio::test]
    async fn a_cache_refusal_is_the_apiservers_status_with_bulwarks_headers() {
        let forbidden = Status::failure(403, "Forbidden", "secrets \"one\" is forbidden", None);
        let error = ProxyError::Cache(CacheError::Status(Box::new(forbidden), "audit-1".into()))
            .admitted(Arc::from("r"), "l".into());
        let refusal = error.refusal();
        assert_eq!(refusal.reason, Reason::Forbidden);
        let response = error.into_response(refusal);
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        let headers = response.headers();
        assert_eq!(headers["x-bulwark-reason"], "forbidden");
        assert_eq!(headers["x-bulwark-rule"], "r");
        assert_eq!(headers["x-bulwark-level"], "l");
        assert_eq!(headers["audit-id"], "audit-1");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let status: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status["message"], "secrets \"one\" is forbidden");

        let error = ProxyError::Cache(CacheError::ReviewFailed(Arc::new(ReviewError::Call(
            CallError::Status {
                method: http::Method::POST,
                path: "/apis/authorization.k8s.io/v1/subjectaccessreviews".into(),
                status: StatusCode::INTERNAL_SERVER_ERROR,
                reason: "InternalError".into(),
                message: "etcd is down".into(),
            },
        ))))
        .admitted(Arc::from("r"), "l".into());
        let refusal = error.refusal();
        assert_eq!(refusal.reason, Reason::UpstreamError);
        assert_eq!(
            error.into_response(refusal).status(),
            StatusCode::BAD_GATEWAY
        );
    }

    #[test]
    fn a_failure_after_admission_names_its_rule_and_level() {
        let no = UpstreamError::NoHealthyReplica {
            retry_after: Duration::from_secs(2),
        };
        let error = ProxyError::Upstream(no).admitted(Arc::from("r"), "l".into());
        let refusal = error.refusal();
        assert_eq!(refusal.reason, Reason::NoHealthyUpstream);
        assert_eq!(refusal.retry_after, Some(Duration::from_secs(2)));
        assert_eq!(
            (refusal.rule.as_deref(), refusal.level.as_deref()),
            (Some("r"), Some("l"))
        );
        let response = error.into_response(refusal);
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["x-bulwark-rule"], "r");
        assert_eq!(response.headers()["x-bulwark-level"], "l");
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
            ProxyError::Identity(IdentityError::ReviewFailed(Arc::new(ReviewError::Call(
                CallError::Status {
                    method: http::Method::POST,
                    path: "/apis/authentication.k8s.io/v1/tokenreviews".into(),
                    status: StatusCode::BAD_GATEWAY,
                    reason: String::new(),
                    message: format!("{replica}: refused"),
                },
            )))),
            ProxyError::Cache(CacheError::ReviewFailed(Arc::new(ReviewError::Call(
                CallError::Upstream {
                    method: http::Method::POST,
                    path: "/apis/authorization.k8s.io/v1/subjectaccessreviews".into(),
                    source: Box::new(UpstreamError::Connect {
                        replica: replica.into(),
                        source: Arc::new(std::io::Error::other("refused")),
                    }),
                },
            ))))
            .admitted(Arc::from("r"), "l".into()),
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
