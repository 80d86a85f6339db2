//! The cache as a stage, between admission and forwarding: it answers the requests
//! admission admitted as cached answers ([`Source::Cache`]) and passes the rest on.

use std::task::{Context, Poll};

use http::Response;
use tower::{Layer, Service};

use super::Reader;
use crate::call::{Admitted, Call, Source, ToApiserver};
use crate::status::ProxyError;
use crate::{Body, BoxFuture};

/// See [`Answer`].
#[derive(Clone, Copy, Default)]
pub struct CacheLayer;

impl<S> Layer<S> for CacheLayer {
    type Service = Answer<S>;
    fn layer(&self, inner: S) -> Answer<S> {
        Answer { inner }
    }
}

/// Answers a cached read, or passes the request on to be forwarded.
#[derive(Clone)]
pub struct Answer<S> {
    inner: S,
}

impl<S, B> Service<Call<B, Admitted>> for Answer<S>
where
    S: Service<Call<B, ToApiserver>, Response = Response<Body>, Error = ProxyError>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: Call<B, Admitted>) -> Self::Future {
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let (admitted, call) = call.take_facts();
            let Admitted {
                info,
                identity,
                user,
                matched,
                source,
            } = admitted;
            match source {
                Source::Cache {
                    cache,
                    plan,
                    initial_seats,
                } => {
                    let reader = Reader {
                        user: &user,
                        headers: call.request.headers(),
                        peer: call.conn.as_ref().map(|c| c.peer.ip()),
                    };
                    cache
                        .answer(plan, &info, reader, initial_seats)
                        .await
                        .map_err(|error| ProxyError::Cache {
                            error,
                            rule: matched.rule.clone(),
                            level: matched.level.name.clone(),
                        })
                }
                Source::Upstream { replica, body_flow } => {
                    let facts = ToApiserver {
                        info,
                        identity,
                        replica,
                        body_flow,
                    };
                    inner.call(call.learn(facts)).await
                }
            }
        })
    }
}
