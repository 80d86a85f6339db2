//! The fleet's Leases at the apiservers: this replica's own, written with Bulwark's own
//! credential (as token reviews and the cache's informers are), and everyone's, read by one
//! LIST of the namespace per renew period.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Method, StatusCode};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

use super::share::{Demand, Member};
use crate::BoxFuture;
use crate::identity::forward::{ForwardError, OwnToken};
use crate::upstream::{self, RetryPolicy, Route, Upstream, UpstreamError};

/// The annotation a member's [`Demand`] travels in.
pub const DEMAND_ANNOTATION: &str = "bulwark.io/demand";

/// The largest Lease list read: a namespace of a few Leases is a few KiB.
const MAX_LIST_BYTES: usize = 4 << 20;

/// Why a Lease could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Bulwark's own token could not be read.
    #[error("own token: {0}")]
    OwnToken(#[from] ForwardError),
    /// The request could not be built (a namespace or name that is no path).
    #[error("building the request: {0}")]
    Request(#[source] http::Error),
    /// No apiserver answered.
    #[error("{method} {path}: {source}")]
    Upstream {
        /// The request method.
        method: Method,
        /// The request path.
        path: String,
        /// What went wrong.
        source: Box<UpstreamError>,
    },
    /// The answer could not be read.
    #[error("{path}: reading the answer: {source}")]
    Read {
        /// The request path.
        path: String,
        /// What went wrong.
        source: crate::ReadError,
    },
    /// The apiserver refused.
    #[error("{method} {path}: {status}: {message}")]
    Status {
        /// The request method.
        method: Method,
        /// The request path.
        path: String,
        /// The answer's status.
        status: StatusCode,
        /// The `Status` message.
        message: String,
    },
    /// The answer is not a Lease (list).
    #[error("{path}: {source}")]
    Decode {
        /// The request path.
        path: String,
        /// What went wrong.
        source: serde_json::Error,
    },
    /// The store is unreachable (tests' in-memory stores).
    #[error("lease store unreachable")]
    Unreachable,
}

/// Where the fleet's Leases live: the apiservers, or memory in tests.
pub trait LeaseStore: Send + Sync + 'static {
    /// Creates or renews this replica's Lease with `member`'s renewal and demand.
    fn write(&self, member: &Member) -> BoxFuture<(), LeaseError>;
    /// Every Lease of the fleet (the namespace's Leases with the prefix), expired or not.
    fn list(&self) -> BoxFuture<Vec<Member>, LeaseError>;
}

/// The Lease object for `member`, named `name` in `namespace`.
pub fn lease_object(
    name: &str,
    namespace: &str,
    member: &Member,
    resource_version: Option<String>,
) -> Lease {
    let demand = serde_json::to_string(&member.demand).unwrap_or_else(|_| "{}".into());
    let micros = member
        .renewed
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    let renewed = Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH);
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            resource_version,
            annotations: Some([(DEMAND_ANNOTATION.to_string(), demand)].into()),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_string(),
                    "bulwark".to_string(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(member.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(member.duration.as_secs()).unwrap_or(i32::MAX),
            ),
            renew_time: Some(MicroTime(renewed)),
            ..LeaseSpec::default()
        }),
    }
}

/// The member a Lease shows, if it is one of the fleet's (named with `prefix`, held, and
/// renewed). A demand that does not parse counts as none: the member still holds a floor.
pub fn member_of(lease: &Lease, prefix: &str) -> Option<Member> {
    let name = lease.metadata.name.as_deref()?;
    name.strip_prefix(prefix)?;
    let spec = lease.spec.as_ref()?;
    let identity = spec.holder_identity.clone()?;
    let micros = u64::try_from(spec.renew_time.as_ref()?.0.as_microsecond()).ok()?;
    let renewed = SystemTime::UNIX_EPOCH + Duration::from_micros(micros);
    let duration = Duration::from_secs(u64::try_from(spec.lease_duration_seconds?).ok()?);
    let demand = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DEMAND_ANNOTATION))
        .and_then(|json| serde_json::from_str::<Demand>(json).ok())
        .unwrap_or_default();
    Some(Member {
        identity,
        renewed,
        duration,
        demand,
    })
}

/// The Leases at the apiservers, through Bulwark's own credential.
pub struct UpstreamLeases {
    upstream: Upstream,
    own_token: Option<Arc<OwnToken>>,
    namespace: String,
    prefix: String,
    name: String,
    timeout: Duration,
    /// The resourceVersion of this replica's Lease as last written: the next renewal is
    /// conditional on it, so a Lease someone else changed is read again, not overwritten
    /// blindly.
    resource_version: Mutex<Option<String>>,
}

impl UpstreamLeases {
    /// The Leases named `prefix…` in `namespace`; this replica's is `name`. Each call
    /// gives up after `timeout`.
    pub fn new(
        upstream: Upstream,
        own_token: Option<Arc<OwnToken>>,
        namespace: &str,
        prefix: &str,
        name: &str,
        timeout: Duration,
    ) -> Self {
        Self {
            upstream,
            own_token,
            namespace: namespace.to_string(),
            prefix: prefix.to_string(),
            name: name.to_string(),
            timeout,
            resource_version: Mutex::new(None),
        }
    }

    fn collection(&self) -> String {
        format!(
            "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
            self.namespace
        )
    }

    fn own_path(&self) -> String {
        format!("{}/{}", self.collection(), self.name)
    }

    /// One call as Bulwark itself: the status and body of a success, or why not.
    async fn call(
        &self,
        method: Method,
        path: String,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), LeaseError> {
        let mut request = http::Request::builder()
            .method(method.clone())
            .uri(path.as_str())
            .header(http::header::ACCEPT, "application/json");
        if body.is_some() {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
        }
        if let Some(own) = &self.own_token {
            request = request.header(http::header::AUTHORIZATION, own.header()?);
        }
        let request = request
            .body(body.map_or_else(crate::empty, crate::full))
            .map_err(LeaseError::Request)?;
        let route = Route {
            credential: upstream::UpstreamCredential::Own,
            // A renewal is conditional on its resourceVersion, so sending it again cannot
            // overwrite anything; reads are reads.
            retry: RetryPolicy::Read,
            long_running: false,
            watch: false,
            timeout: Some(self.timeout),
            attempt_timeout: None,
            client_timeout: None,
            replica: None,
            body_flow: None,
        };
        let response =
            self.upstream
                .send(request, route)
                .await
                .map_err(|source| LeaseError::Upstream {
                    method: method.clone(),
                    path: path.clone(),
                    source: Box::new(source),
                })?;
        let status = response.status();
        let body = crate::read_to_limit(response.into_body(), MAX_LIST_BYTES)
            .await
            .map_err(|source| LeaseError::Read {
                path: path.clone(),
                source,
            })?;
        if status.is_success() {
            return Ok((status, body));
        }
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_default();
        Err(LeaseError::Status {
            method,
            path,
            status,
            message,
        })
    }

    fn remember(&self, body: &[u8], path: &str) -> Result<(), LeaseError> {
        let lease: Lease = serde_json::from_slice(body).map_err(|source| LeaseError::Decode {
            path: path.to_string(),
            source,
        })?;
        *self
            .resource_version
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = lease.metadata.resource_version;
        Ok(())
    }

    fn encode(&self, member: &Member, resource_version: Option<String>) -> Vec<u8> {
        let lease = lease_object(&self.name, &self.namespace, member, resource_version);
        serde_json::to_vec(&lease).unwrap_or_default()
    }

    async fn write_once(&self, member: &Member) -> Result<(), LeaseError> {
        let known = self
            .resource_version
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let result = match known {
            Some(rv) => {
                let body = self.encode(member, Some(rv));
                self.call(Method::PUT, self.own_path(), Some(body)).await
            }
            None => {
                let body = self.encode(member, None);
                self.call(Method::POST, self.collection(), Some(body)).await
            }
        };
        match result {
            Ok((_, body)) => self.remember(&body, &self.own_path()),
            Err(LeaseError::Status { status, .. })
                if status == StatusCode::CONFLICT || status == StatusCode::NOT_FOUND =>
            {
                // Created before (a restart), changed by someone else, or deleted: read
                // what is there (or learn it is gone) and write once more.
                match self.call(Method::GET, self.own_path(), None).await {
                    Ok((_, body)) => self.remember(&body, &self.own_path())?,
                    Err(LeaseError::Status { status, .. }) if status == StatusCode::NOT_FOUND => {
                        *self
                            .resource_version
                            .lock()
                            .unwrap_or_else(|p| p.into_inner()) = None;
                    }
                    Err(e) => return Err(e),
                }
                let known = self
                    .resource_version
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                let (method, path) = match &known {
                    Some(_) => (Method::PUT, self.own_path()),
                    None => (Method::POST, self.collection()),
                };
                let body = self.encode(member, known);
                let (_, answer) = self.call(method, path, Some(body)).await?;
                self.remember(&answer, &self.own_path())
            }
            Err(e) => Err(e),
        }
    }

    async fn list_once(&self) -> Result<Vec<Member>, LeaseError> {
        let path = self.collection();
        let (_, body) = self.call(Method::GET, path.clone(), None).await?;
        let list: k8s_openapi::List<Lease> =
            serde_json::from_slice(&body).map_err(|source| LeaseError::Decode { path, source })?;
        Ok(list
            .items
            .iter()
            .filter_map(|lease| member_of(lease, &self.prefix))
            .collect())
    }
}

impl LeaseStore for Arc<UpstreamLeases> {
    fn write(&self, member: &Member) -> BoxFuture<(), LeaseError> {
        let this = self.clone();
        let member = member.clone();
        Box::pin(async move { this.write_once(&member).await })
    }

    fn list(&self) -> BoxFuture<Vec<Member>, LeaseError> {
        let this = self.clone();
        Box::pin(async move { this.list_once().await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::share::Bytes;

    #[test]
    fn a_member_goes_into_a_lease_and_comes_back_out() {
        let mut demand = Demand::default();
        demand.bytes.insert(
            "10.0.0.11:6443".into(),
            Bytes {
                wanted: 5,
                in_flight: 3,
            },
        );
        let member = Member {
            identity: "node-a".into(),
            renewed: SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456),
            duration: Duration::from_secs(10),
            demand,
        };
        let lease = lease_object("bulwark-node-a", "bulwark", &member, Some("7".into()));
        let json = serde_json::to_value(&lease).unwrap();
        assert_eq!(json["spec"]["renewTime"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(json["spec"]["leaseDurationSeconds"], 10);
        assert_eq!(json["metadata"]["resourceVersion"], "7");
        let back: Lease = serde_json::from_value(json).unwrap();
        assert_eq!(member_of(&back, "bulwark-"), Some(member.clone()));
        assert_eq!(member_of(&back, "other-"), None, "not the fleet's prefix");
        let mut garbled = back.clone();
        garbled
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(DEMAND_ANNOTATION.into(), "{not json".into());
        assert_eq!(
            member_of(&garbled, "bulwark-").map(|m| m.demand),
            Some(Demand::default()),
            "a demand that does not parse counts as none"
        );
        let mut unheld = back;
        unheld.spec.as_mut().unwrap().holder_identity = None;
        assert_eq!(member_of(&unheld, "bulwark-"), None);
    }
}
