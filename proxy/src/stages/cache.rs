//! The cache as a stage, between admission and forwarding: it answers the requests
//! admission admitted as cached answers ([`Source::Cache`]) and passes the rest on.

use super::call::{Admitted, Answered, Cached, Call, Next, Source, Stage, ToApiserver};
use super::error::ProxyError;
use crate::cache::Reader;

/// Answers a cached read, or passes the request on to be forwarded.
#[derive(Clone, Copy, Default)]
pub struct Answer;

impl<B: Send + 'static> Stage<B> for Answer {
    type In = Admitted;
    type Out = ToApiserver;

    async fn run<N: Next<B, Self::Out>>(&self, call: Call<B, Self::In>, next: &N) -> Answered {
        let (admitted, call) = call.take_facts();
        let Admitted {
            info,
            identity,
            matched: _,
            source,
        } = admitted;
        match source {
            Source::Cache(cached) => {
                let Cached {
                    cache,
                    reader,
                    plan,
                    initial_seats,
                } = *cached;
                let reader = Reader {
                    user: &reader,
                    headers: call.request.headers(),
                    peer: call.conn.as_ref().map(|c| c.peer.ip()),
                };
                // Boxed: the answer's future is large, and inline it would make every
                // request's future through this stage as large, cached or not.
                Box::pin(cache.answer(plan, &info, reader, initial_seats))
                    .await
                    .map_err(ProxyError::Cache)
            }
            Source::Upstream { replica, body_flow } => {
                let facts = ToApiserver {
                    info,
                    identity,
                    replica,
                    body_flow,
                };
                next.run(call.learn(facts)).await
            }
        }
    }
}
