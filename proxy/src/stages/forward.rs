//! Forwarding as the innermost stage: rewrites the identity headers for the apiserver
//! (`identity::forward`), adds `X-Forwarded-For`, and sends the request to a replica
//! through the pool.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::TryFutureExt;
use futures::future::{self, Either};
use http::{HeaderValue, Request};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::call::{Answered, Call, Next, ToApiserver};
use super::error::ProxyError;
use crate::Body;
use crate::classify::Verb;
use crate::config::Timeouts;
use crate::identity::forward::Forwarding;
use crate::status::X_FORWARDED_FOR;
use crate::upstream::{RetryPolicy, Route, Upstream};

/// Sends each request to a replica, as the client it acts for.
#[derive(Clone)]
pub struct Forward {
    upstream: Upstream,
    forwarding: Arc<Forwarding>,
    timeouts: Timeouts,
}

impl Forward {
    /// Forwards to `upstream`, with identity headers from `forwarding`, within `timeouts`.
    pub fn new(upstream: Upstream, forwarding: Arc<Forwarding>, timeouts: Timeouts) -> Forward {
        Forward {
            upstream,
            forwarding,
            timeouts,
        }
    }

    /// The same forwarding over the upstream's view with connections of its own, for one
    /// worker thread ([`Upstream::with_own_connections`]).
    pub fn with_own_connections(&self) -> Forward {
        Forward {
            upstream: self.upstream.with_own_connections(),
            ..self.clone()
        }
    }

    /// Rewrites the request for the apiserver and routes it: all the work before the
    /// upstream exchange, done before any future is made, so that the one future boxed per
    /// request holds only the exchange.
    fn prepare(
        &self,
        call: Call<Incoming, ToApiserver>,
    ) -> Result<(Request<Body>, Route), ProxyError> {
        let (facts, call) = call.take_facts();
        let ToApiserver {
            info,
            identity,
            replica,
            body_flow,
        } = facts;
        let exchange = call.into_exchange();
        let (mut parts, body) = exchange.request.into_parts();
        // A body admission read whole is sent as it was read, and counted in the budget by
        // admission, not again here.
        let (body, body_flow) = match exchange.body {
            Some(bytes) => (crate::full(bytes), None),
            None => (body.map_err(Into::into).boxed_unsync(), Some(body_flow)),
        };
        let upgrade = info.is_upgrade() && parts.headers.contains_key(http::header::UPGRADE);
        let credential = self
            .forwarding
            .prepare(&identity, &mut parts.headers, upgrade)?;
        if let Some(conn) = &exchange.conn {
            append_forwarded_for(&mut parts.headers, &conn.peer_ip);
        }
        // Keep only path and query: the pool sets scheme and authority per replica.
        if let Some(pq) = parts.uri.path_and_query().cloned() {
            parts.uri = http::Uri::from(pq);
        }
        let route = Route {
            credential,
            retry: if info.is_read() {
                RetryPolicy::Read
            } else {
                RetryPolicy::Write
            },
            long_running: info.is_long_running(),
            watch: info.query.watch || matches!(info.verb, Verb::Watch),
            timeout: self.timeouts.for_request(&info),
            attempt_timeout: self.timeouts.attempt_for(&info),
            client_timeout: own_timeout(parts.uri.query()),
            replica,
            body_flow,
        };
        let request = Request::from_parts(parts, body);
        Ok((request, route))
    }
}

impl Next<Incoming, ToApiserver> for Forward {
    fn run(&self, call: Call<Incoming, ToApiserver>) -> impl Future<Output = Answered> + Send {
        // The request is rewritten and taken apart before any future is made, and no
        // future of this stage's own wraps the exchange's: every forwarded request's future
        // holds it.
        match self.prepare(call) {
            // Served by the upstream: what `Rescue` counts a response without `ServedBy` as.
            Ok((request, route)) => {
                Either::Left(self.upstream.send(request, route).map_err(ProxyError::from))
            }
            Err(error) => Either::Right(future::ready(Err(error))),
        }
    }
}

/// A request's own `timeout` parameter (`timeout=30s`, `1m30s`), as the apiserver reads it
/// for requests that are not watches; `None` when absent or not a duration.
fn own_timeout(query: Option<&str>) -> Option<Duration> {
    let value = query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("timeout="))?;
    let value = percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .ok()?;
    humantime::parse_duration(&value)
        .ok()
        .filter(|d| !d.is_zero())
}

/// Appends the client's address (`peer_ip`) to `X-Forwarded-For`, after any the client
/// sent.
fn append_forwarded_for(headers: &mut http::HeaderMap, peer_ip: &HeaderValue) {
    let Some(existing) = headers.get(X_FORWARDED_FOR) else {
        headers.insert(X_FORWARDED_FOR, peer_ip.clone());
        return;
    };
    let mut value = Vec::with_capacity(existing.len() + 2 + peer_ip.len());
    value.extend_from_slice(existing.as_bytes());
    value.extend_from_slice(b", ");
    value.extend_from_slice(peer_ip.as_bytes());
    // The text is taken as it is: no second copy.
    if let Ok(value) = HeaderValue::from_maybe_shared(bytes::Bytes::from(value)) {
        headers.insert(X_FORWARDED_FOR, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_address_follows_those_it_came_through() {
        let peer = HeaderValue::from_static("192.0.2.7");
        let mut headers = http::HeaderMap::new();
        append_forwarded_for(&mut headers, &peer);
        assert_eq!(headers[X_FORWARDED_FOR], "192.0.2.7");
        headers.insert(
            X_FORWARDED_FOR,
            HeaderValue::from_static("10.0.0.1, 10.0.0.2"),
        );
        append_forwarded_for(&mut headers, &HeaderValue::from_static("2001:db8::1"));
        assert_eq!(headers[X_FORWARDED_FOR], "10.0.0.1, 10.0.0.2, 2001:db8::1");
    }

    #[test]
    fn the_own_timeout_is_read_as_the_apiserver_reads_it() {
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(own_timeout(Some("timeout=4s")), secs(4));
        assert_eq!(own_timeout(Some("limit=5&timeout=1m30s")), secs(90));
        assert_eq!(own_timeout(Some("timeout=1m%2030s")), secs(90));
        assert_eq!(own_timeout(Some("timeoutSeconds=5")), None);
        assert_eq!(own_timeout(Some("timeout=0s")), None);
        assert_eq!(own_timeout(Some("timeout=soon")), None);
        assert_eq!(own_timeout(None), None);
    }
}
