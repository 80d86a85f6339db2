//! Bulwark's own calls to the apiservers: TokenReviews, SubjectAccessReviews, the
//! informers' discovery, LISTs and WATCHes, the fleet's Leases, and whatever comes next.
//!
//! One [`Client`] builds every such request: JSON in and out, Bulwark's own credential
//! (its client certificate, or its token file, which the upstream pool reads and adds: the
//! one reader of that file), a deadline, a bound on the answer read, the pool's choice of
//! replica and its retries, and one error type ([`CallError`]) that names the call and
//! keeps the apiserver's `Status` message.
//!
//! Every own call is a read, a review (which changes nothing), a write conditional on a
//! `resourceVersion`, or a create whose repeat is answered 409: so each may be retried on
//! another replica like a read, and none can be applied twice.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::upstream::{RetryPolicy, Route, Upstream, UpstreamCredential, UpstreamError};

/// Time allowed for a call's whole answer unless the call says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest answer read unless the call says otherwise: a review, a Lease list.
pub const DEFAULT_MAX_BYTES: usize = 4 << 20;

/// Largest error answer read: enough for any `Status`.
const MAX_ERROR_BYTES: usize = 64 * 1024;

/// The client of Bulwark's own calls. Cheap to clone: it shares the upstream pool.
#[derive(Clone)]
pub struct Client {
    upstream: Upstream,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("own::Client").finish_non_exhaustive()
    }
}

/// One call: what to ask, how long to wait, how much to read.
#[derive(Debug, Clone)]
pub struct Call {
    method: Method,
    path: String,
    body: Option<Vec<u8>>,
    timeout: Duration,
    max_bytes: usize,
}

impl Call {
    /// A GET of `path` (with its query).
    pub fn get(path: impl Into<String>) -> Call {
        Call {
            method: Method::GET,
            path: path.into(),
            body: None,
            timeout: DEFAULT_TIMEOUT,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// A POST of `object` as JSON: a review, or a create.
    pub fn post(path: impl Into<String>, object: &impl Serialize) -> Result<Call, CallError> {
        Call::with_body(Method::POST, path.into(), object)
    }

    /// A PUT of `object` as JSON: a replace, conditional on the `resourceVersion` it holds.
    pub fn put(path: impl Into<String>, object: &impl Serialize) -> Result<Call, CallError> {
        Call::with_body(Method::PUT, path.into(), object)
    }

    /// A DELETE of `path`.
    pub fn delete(path: impl Into<String>) -> Call {
        Call {
            method: Method::DELETE,
            ..Call::get(path)
        }
    }

    fn with_body(method: Method, path: String, object: &impl Serialize) -> Result<Call, CallError> {
        let body = serde_json::to_vec(object).map_err(|source| CallError::Encode {
            method: method.clone(),
            path: path.clone(),
            source,
        })?;
        Ok(Call {
            method,
            body: Some(body),
            ..Call::get(path)
        })
    }

    /// Gives up after `timeout` (for a watch: on its response head).
    pub fn timeout(mut self, timeout: Duration) -> Call {
        self.timeout = timeout;
        self
    }

    /// Reads at most `max_bytes` of the answer.
    pub fn max_bytes(mut self, max_bytes: usize) -> Call {
        self.max_bytes = max_bytes;
        self
    }

    /// The call's path, as errors name it.
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl Client {
    /// Calls through `upstream`'s replicas with Bulwark's own credential.
    pub fn new(upstream: Upstream) -> Client {
        Client { upstream }
    }

    /// A client with a pool of its own for the configured replicas (one that serves no
    /// client requests: tests, and tools that only make Bulwark's own calls).
    pub fn from_config(
        cfg: &crate::config::Upstream,
        metrics: crate::metrics::Metrics,
    ) -> Result<Client, UpstreamError> {
        let tls = crate::upstream::UpstreamTls::from_config(cfg)?;
        Ok(Client::new(Upstream::new(cfg, tls, metrics)?))
    }

    /// The answer of a successful call; any other status is [`CallError::Status`].
    pub async fn bytes(&self, call: Call) -> Result<Bytes, CallError> {
        let max_bytes = call.max_bytes;
        let (method, path) = (call.method.clone(), call.path.clone());
        let response = self.send(call, false).await?;
        let status = response.status();
        let limit = if status.is_success() {
            max_bytes
        } else {
            MAX_ERROR_BYTES.min(max_bytes)
        };
        let body = crate::read_to_limit(response.into_body(), limit)
            .await
            .map_err(|source| CallError::Read {
                method: method.clone(),
                path: path.clone(),
                source,
            })?;
        if status.is_success() {
            Ok(body)
        } else {
            Err(CallError::status(method, path, status, &body))
        }
    }

    /// The answer of a successful call, decoded from JSON.
    pub async fn json<T: DeserializeOwned>(&self, call: Call) -> Result<T, CallError> {
        let (method, path) = (call.method.clone(), call.path.clone());
        let body = self.bytes(call).await?;
        serde_json::from_slice(&body).map_err(|source| CallError::Decode {
            method,
            path,
            source,
        })
    }

    /// A long-running GET (a watch): the response of a success, its body for the caller to
    /// follow; any other status is [`CallError::Status`]. Only the head is bounded by the
    /// call's timeout, so a replica that took the request and never answered cannot hang
    /// the caller.
    pub async fn watch(&self, call: Call) -> Result<http::Response<crate::Body>, CallError> {
        let (method, path) = (call.method.clone(), call.path.clone());
        let response = self.send(call, true).await?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = crate::read_to_limit(response.into_body(), MAX_ERROR_BYTES)
            .await
            .unwrap_or_default();
        Err(CallError::status(method, path, status, &body))
    }

    async fn send(
        &self,
        call: Call,
        watch: bool,
    ) -> Result<http::Response<crate::Body>, CallError> {
        let mut request = http::Request::builder()
            .method(call.method.clone())
            .uri(call.path.as_str())
            .header(http::header::ACCEPT, "application/json");
        if call.body.is_some() {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(call.body.map_or_else(crate::empty, crate::full))
            .map_err(|source| CallError::Request {
                method: call.method.clone(),
                path: call.path.clone(),
                source,
            })?;
        let route = Route {
            credential: UpstreamCredential::Own,
            // See the module's note: every own call may be sent again.
            retry: RetryPolicy::Read,
            long_running: false,
            watch,
            timeout: Some(call.timeout),
            // A replica ejected for not answering its probe still moves these on at once.
            attempt_timeout: None,
            client_timeout: None,
            replica: None,
            body_flow: None,
        };
        self.upstream
            .send(request, route)
            .await
            .map_err(|source| CallError::Upstream {
                method: call.method,
                path: call.path,
                source: Box::new(source),
            })
    }
}

/// Why an own call has no answer, naming the call.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The object could not be written as JSON.
    #[error("{method} {path}: encoding the request")]
    Encode {
        /// The method.
        method: Method,
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The request could not be built (a path that is no URI).
    #[error("{method} {path}: building the request")]
    Request {
        /// The method.
        method: Method,
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: http::Error,
    },
    /// No apiserver answered: none reachable, the deadline passed, or Bulwark's own
    /// credential is unavailable.
    #[error("{method} {path}")]
    Upstream {
        /// The method.
        method: Method,
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: Box<UpstreamError>,
    },
    /// The answer broke off or was larger than the call reads.
    #[error("{method} {path}: reading the answer")]
    Read {
        /// The method.
        method: Method,
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: crate::ReadError,
    },
    /// The apiserver answered with an error status.
    #[error("{method} {path} answered {status}: {message}")]
    Status {
        /// The method.
        method: Method,
        /// The path.
        path: String,
        /// The status.
        status: StatusCode,
        /// The `reason` of its `Status` body (`Conflict`, `NotFound`, `Expired`), if any.
        reason: String,
        /// The `message` of its `Status` body, or the start of a body that is none.
        message: String,
    },
    /// The answer is not the JSON expected.
    #[error("{method} {path}: the answer is not the JSON expected")]
    Decode {
        /// The method.
        method: Method,
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

impl CallError {
    fn status(method: Method, path: String, status: StatusCode, body: &[u8]) -> CallError {
        let parsed = serde_json::from_slice::<serde_json::Value>(body).ok();
        let field = |name: &str| {
            parsed
                .as_ref()
                .and_then(|v| v[name].as_str())
                .map(str::to_owned)
        };
        let message = field("message")
            .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned());
        CallError::Status {
            method,
            path,
            status,
            reason: field("reason").unwrap_or_default(),
            message,
        }
    }

    /// The apiserver's status, when it answered with an error.
    pub fn answered(&self) -> Option<StatusCode> {
        match self {
            CallError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Why a review (a TokenReview or a SubjectAccessReview) has no answer.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// A TokenReview's `status.user` is not a user.
    #[error("TokenReview status.user")]
    User(#[source] serde_json::Error),
    /// A SubjectAccessReview came back without a status.
    #[error("the SubjectAccessReview has no status")]
    NoStatus,
}

/// Time allowed for a review.
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest review answer read.
const MAX_REVIEW_BYTES: usize = 1 << 20;

impl Client {
    /// Posts a review object (a TokenReview or a SubjectAccessReview) and returns the
    /// answer.
    pub async fn review(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, ReviewError> {
        let call = Call::post(path, body)?
            .timeout(REVIEW_TIMEOUT)
            .max_bytes(MAX_REVIEW_BYTES);
        Ok(self.json(call).await?)
    }
}
