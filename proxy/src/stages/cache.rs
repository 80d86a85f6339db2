//! The cache as a stage, between admission and forwarding: it answers the requests
//! admission admitted as cached answers ([`Source::Cache`]) and passes the rest on.

use std::future::Future;
use std::sync::Arc;

use futures::future::Either;

use super::call::{Admitted, Answered, Cached, Call, Next, Source, Stage, ToApiserver};
use super::error::ProxyError;
use crate::cache::Reader;
use crate::classify::RequestInfo;

/// Answers a cached read, or passes the request on to be forwarded.
#[derive(Clone, Copy, Default)]
pub struct Answer;

impl<B: Send + 'static> Stage<B> for Answer {
    type In = Admitted;
    type Out = ToApiserver;

    /// Not `async`: which way the call goes is known at once, so a forwarded request's
    /// future is the next stage's, with nothing of this stage's around it.
    fn run<N: Next<B, Self::Out>>(
        &self,
        call: Call<B, Self::In>,
        next: &N,
    ) -> impl Future<Output = Answered> + Send {
        let (admitted, call) = call.take_facts();
        let Admitted {
            info,
            identity,
            matched: _,
            source,
        } = admitted;
        match source {
            // Boxed: the answer's future is large, and inline it would make every request's
            // future as large, cached or not.
            Source::Cache(cached) => Either::Left(Box::pin(answer(call, info, *cached))),
            Source::Upstream { replica, body_flow } => {
                let facts = ToApiserver {
                    info,
                    identity,
                    replica,
                    body_flow,
                };
                Either::Right(next.run(call.learn(facts)))
            }
        }
    }
}

/// The cache's answer to the call.
async fn answer<B>(call: Call<B, ()>, info: Arc<RequestInfo>, cached: Cached) -> Answered {
    let Cached {
        cache,
        reader,
        plan,
        initial_seats,
    } = cached;
    let reader = Reader {
        user: &reader,
        headers: call.request.headers(),
        peer: call.conn.as_ref().map(|c| c.peer.ip()),
    };
    cache
        .answer(plan, &info, reader, initial_seats)
        .await
        .map_err(ProxyError::Cache)
}
