//! Admission as a stage (DESIGN.md steps 5–6): matches the request to its rule, asks the
//! cache whether it will answer and how large that answer is, and waits for admission
//! ([`Admission::admit`]) of the answer wherever it comes from. The permit is held until
//! the response body ends, or until the response head for long-running requests; every
//! response of an admitted request names its rule and level.

use std::sync::Arc;
use std::task::Poll;

use http::Response;

use super::call::{
    Admitted, AdmittedReport, Answered, Cached, Call, Identified, Next, Source, Stage,
};
use super::error::ProxyError;
use crate::Body;
use crate::admit::{Admission, Answer, Learn, SendProgress, hold};
use crate::cache::{Cache, Held};
use crate::classify::Verb;
use crate::identity::Identity;
use crate::rules::{RuleHeaders, Rules};
use crate::status::{X_BULWARK_LEVEL, X_BULWARK_RULE};
use crate::upstream::{BodyBudget, BodyDeadlines, BodyFlow, declared_length, read_body};

/// Decides whether, when and from where a request is answered.
#[derive(Clone)]
pub struct Admit {
    rules: Arc<Rules>,
    admission: Arc<Admission>,
    cache: Option<Arc<Cache>>,
    bodies: Arc<BodyBudget>,
    body_deadlines: BodyDeadlines,
    send_progress: SendProgress,
    /// Whether every answer names its rule and level, not only refusals.
    name_every_answer: bool,
}

impl Admit {
    /// Matches against `rules` and admits through `admission`; `cache`, when it runs,
    /// answers what it can; request bodies are read whole before admission within
    /// `body_deadlines`, and held for retries within `bodies`; a response whose client
    /// stops reading gives its seats and bytes back after `send_progress`'s deadline. With
    /// `name_every_answer`, every answer carries `X-Bulwark-Rule` and `X-Bulwark-Level`.
    pub fn new(
        rules: Arc<Rules>,
        admission: Arc<Admission>,
        cache: Option<Arc<Cache>>,
        bodies: Arc<BodyBudget>,
        body_deadlines: BodyDeadlines,
        send_progress: SendProgress,
        name_every_answer: bool,
    ) -> Admit {
        Admit {
            name_every_answer,
            rules,
            admission,
            cache,
            bodies,
            body_deadlines,
            send_progress,
        }
    }
}

impl<B> Stage<B> for Admit
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<crate::BoxError>,
{
    type In = Identified;
    type Out = Admitted;

    // Over 120 lines: admission's steps in the order a request takes them (flow, cache,
    // body, seats, response pacing), each on what the one before decided.
    async fn run<N: Next<B, Self::Out>>(&self, call: Call<B, Self::In>, next: &N) -> Answered {
        let Admit {
            rules,
            admission,
            cache,
            bodies,
            body_deadlines,
            send_progress,
            name_every_answer,
        } = self;
        let (facts, mut call) = call.take_facts();
        let info = facts.info.clone();
        let user = facts.user();
        // The client's address keys a per-client flow (`flow: node`, `flow: pod`) whose
        // credential names no node or pod.
        let client_addr = call.conn.as_ref().map(|c| c.peer.ip());
        let matched = rules.current().matches_from(&user, &info, client_addr);
        let _ = call.report.flow.set(matched.flow.clone());
        // Only an identified reader is authorized by the cache; the anonymous allowlist
        // holds no cached resource.
        let cached = match &facts.identity {
            Identity::User { user, .. } => cache.as_ref().map(|cache| (cache, user)),
            Identity::Anonymous => None,
        };
        let plan = cached
            .and_then(|(cache, _)| cache.plan(&info, call.request.headers(), matched.staleness));
        let answer = match &plan {
            Some(plan) => Answer::Cache {
                bytes: plan.bytes(),
            },
            None => {
                if let Some(bytes) = cache.as_ref().and_then(|c| scope_bytes(c, &info)) {
                    // A LIST the cache does not answer reads its whole scope upstream:
                    // the cache's counts say how large that is now.
                    admission.observe_scope(&info, bytes);
                }
                Answer::Upstream
            }
        };
        // A body is read whole before its request may take seats (as the apiserver queues
        // a request before it reads its body): a client that trickles one holds bytes of
        // its flow's body budget meanwhile, never a seat others are waiting for.
        let _body = if plan.is_none() && !call.request.body().is_end_stream() {
            let flow = BodyFlow {
                budget: bodies.clone(),
                flow: matched.flow.clone(),
            };
            let declared = declared_length(call.request.headers());
            match read_body(call.request.body_mut(), declared, &flow, *body_deadlines).await {
                Ok(Some((bytes, held))) => {
                    call.body = Some(bytes);
                    Some(held)
                }
                Ok(None) => None,
                Err(error) => {
                    return Err(ProxyError::from(error)
                        .admitted(matched.rule.clone(), matched.level.name.as_str().into()));
                }
            }
        } else {
            None
        };
        // Most requests are admitted at once: only one that waits reads the clock.
        let admitted = {
            let mut admitted = std::pin::pin!(admission.admit(&matched, &info, &user, answer));
            match futures::poll!(admitted.as_mut()) {
                Poll::Ready(admitted) => admitted,
                Poll::Pending => {
                    let asked = tokio::time::Instant::now();
                    let admitted = admitted.await;
                    let _ = call.report.waited.set(asked.elapsed());
                    admitted
                }
            }
        };
        let mut permit = admitted.map_err(ProxyError::Refused)?;
        let _ = call.report.admitted.set(AdmittedReport {
            expected_bytes: permit.expected_bytes(),
            at: tokio::time::Instant::now(),
            named: matched.headers.clone(),
        });
        let source = match (plan, cached) {
            (Some(plan), Some((cache, reader))) => Source::Cache(Box::new(Cached {
                cache: cache.clone(),
                reader: reader.clone(),
                plan,
                initial_seats: (info.verb == Verb::Watch)
                    .then(|| permit.take_seats())
                    .flatten()
                    .map(Held::new),
            })),
            _ => Source::Upstream {
                replica: permit.replica().map(Arc::from),
                // The body is held for retries within its flow's budget, exempt or not.
                body_flow: BodyFlow {
                    budget: bodies.clone(),
                    flow: matched.flow.clone(),
                },
            },
        };
        let upstream = matches!(source, Source::Upstream { .. });
        // Only a response that may be watched for its client's pace (one whose permit holds
        // what others wait for, or a watch that may start with a cached state) needs the
        // connection.
        let conn = (permit.holds_what_others_wait_for() || info.verb == Verb::Watch)
            .then(|| call.conn.as_ref().map(|c| c.auth.clone()))
            .flatten();
        drop(user);
        let (rule, level, headers) = (
            matched.rule.clone(),
            matched.level.clone(),
            matched.headers.clone(),
        );
        let admitted = Admitted {
            info: info.clone(),
            identity: facts.identity,
            matched,
            source,
        };
        // A refusal after admission (the cache's, the body budget's, the apiservers'
        // failures) names the rule and level that admitted it; an answer does where every
        // answer is to.
        let mut response = match next.run(call.learn(admitted)).await {
            Ok(response) => response,
            Err(error) => return Err(error.admitted(rule, level.name.as_str().into())),
        };
        if *name_every_answer {
            name_rule(&mut response, headers);
        }
        if upstream && info.is_long_running() {
            permit.release_seats();
        }
        let learn = upstream
            .then(|| Learn::list(admission.clone(), info, &response))
            .flatten();
        let initial = response
            .extensions()
            .get::<crate::cache::InitialState>()
            .map(|state| state.0);
        Ok(response.map(|body| hold(body, permit, learn, send_progress, initial, conn.as_ref())))
    }
}

/// The bytes of the whole scope a LIST reads, as the cache counts them.
fn scope_bytes(cache: &Cache, info: &crate::classify::RequestInfo) -> Option<u64> {
    if !info.is_list() {
        return None;
    }
    let resource = if info.api_group.is_empty() {
        info.resource.clone()
    } else {
        compact_str::format_compact!("{}.{}", info.resource, info.api_group)
    };
    cache
        .scope_size(&resource, info.namespace.as_deref())
        .map(|(_, bytes)| bytes)
}

/// Names the rule and level on a response.
fn name_rule(response: &mut Response<Body>, named: RuleHeaders) {
    let headers = response.headers_mut();
    for (name, value) in [(X_BULWARK_RULE, named.rule), (X_BULWARK_LEVEL, named.level)] {
        if let Some(value) = value {
            headers.insert(name, value);
        }
    }
}
