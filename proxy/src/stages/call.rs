//! One request on its way through the stages, and what each stage has learned about it.
//!
//! A [`Call`] is made once, by `Rescue`, from the request and its connection. Each stage
//! takes the call with the facts of the stages before it and hands on the call with its
//! own added — [`Classified`], [`Identified`], [`Admitted`], then [`ToApiserver`] — so a
//! stage can only be wired after the stages it needs, and none has to look for what
//! another left in the request's extensions.

use std::borrow::Cow;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::{Layer, Service};

use super::error::ProxyError;
use crate::cache::{self, Held};
use crate::classify::RequestInfo;
use crate::identity::{Identity, User};
use crate::listen::ConnInfo;
use crate::rules::Matched;
use crate::upstream::BodyFlow;
use crate::{Body, BoxFuture};

/// A request and what the stages so far know about it (`F`).
pub struct Call<B, F> {
    /// The request as the client sent it.
    pub request: Request<B>,
    /// The connection it came on; `None` only for requests made in tests.
    pub conn: Option<ConnInfo>,
    /// What `Rescue` reports for the request, whatever stage answers it.
    pub report: Arc<Report>,
    /// What the stages so far learned.
    pub facts: F,
}

impl<B> Call<B, ()> {
    /// A call for `request`: its connection is taken from the request's extensions, where
    /// the listener put it.
    pub fn new(mut request: Request<B>) -> Call<B, ()> {
        let conn = request.extensions_mut().remove::<ConnInfo>();
        Call {
            request,
            conn,
            report: Arc::default(),
            facts: (),
        }
    }
}

impl<B, F> Call<B, F> {
    /// The same call with the facts of one more stage.
    pub fn learn<G>(self, facts: G) -> Call<B, G> {
        Call {
            request: self.request,
            conn: self.conn,
            report: self.report,
            facts,
        }
    }

    /// The facts, and the call without them (to hand on with others).
    pub fn take_facts(self) -> (F, Call<B, ()>) {
        let facts = self.facts;
        let call = Call {
            request: self.request,
            conn: self.conn,
            report: self.report,
            facts: (),
        };
        (facts, call)
    }
}

/// What the rejection log and the request metrics say of a request, filled in by the
/// stage that learns it.
#[derive(Debug, Default)]
pub struct Report {
    /// The verb and resource labels (classification).
    pub labels: OnceLock<Labels>,
    /// The client's user name (identity).
    pub who: OnceLock<String>,
    /// What the request asks for (classification).
    pub info: OnceLock<Arc<RequestInfo>>,
    /// How long the request waited for admission (admission).
    pub waited: OnceLock<std::time::Duration>,
}

/// The metric labels of one request.
#[derive(Debug, Clone)]
pub struct Labels {
    /// The verb label.
    pub verb: &'static str,
    /// The resource label (a closed set; see `metrics::ResourceLabels`).
    pub resource: Arc<str>,
}

/// After classification: what the request asks for.
#[derive(Debug, Clone)]
pub struct Classified {
    /// Verb, resource, namespace, name and query.
    pub info: Arc<RequestInfo>,
}

/// After identity: who asks.
#[derive(Debug, Clone)]
pub struct Identified {
    /// What the request asks for.
    pub info: Arc<RequestInfo>,
    /// Who asks, and with which credential.
    pub identity: Identity,
}

impl Identified {
    /// The user the rules see: the identified user, or `system:anonymous` for a request
    /// on the anonymous allowlist (borrowed, not copied, for every identified request).
    pub fn user(&self) -> Cow<'_, User> {
        match &self.identity {
            Identity::User { user, .. } => Cow::Borrowed(user),
            Identity::Anonymous => Cow::Owned(User {
                username: "system:anonymous".into(),
                groups: vec!["system:unauthenticated".into()],
                ..User::default()
            }),
        }
    }
}

/// After admission: the request may run, and where its answer comes from.
pub struct Admitted {
    /// What the request asks for.
    pub info: Arc<RequestInfo>,
    /// Who asks.
    pub identity: Identity,
    /// The reader's rule, level and flow.
    pub matched: Matched,
    /// Where the answer comes from, as admission weighed it.
    pub source: Source,
}

/// Where admission decided an admitted request's answer comes from.
pub enum Source {
    /// Bulwark's cache answers, as planned (boxed: the upstream path, which every
    /// pass-through request takes, need not carry and move it).
    Cache(Box<Cached>),
    /// An apiserver answers.
    Upstream {
        /// The replica holding this LIST's bytes, where it must go.
        replica: Option<Arc<str>>,
        /// The flow whose share of the request-body budget holds the body.
        body_flow: BodyFlow,
    },
}

/// A cached answer admission admitted.
pub struct Cached {
    /// The cache.
    pub cache: Arc<cache::Cache>,
    /// The reader the cache authorizes (the cache answers identified users only).
    pub reader: User,
    /// What it will answer.
    pub plan: cache::Plan,
    /// For a watch that starts with the current state: the seats it holds until that
    /// state is sent.
    pub initial_seats: Option<Held>,
}

/// After the cache passed the request on: what forwarding needs.
pub struct ToApiserver {
    /// What the request asks for.
    pub info: Arc<RequestInfo>,
    /// Who asks.
    pub identity: Identity,
    /// The replica holding this LIST's bytes, where it must go.
    pub replica: Option<Arc<str>>,
    /// The flow whose share of the request-body budget holds the body.
    pub body_flow: BodyFlow,
}

/// What a stage (and the rest of the path after it) gives back: the response, or why
/// Bulwark answers itself.
pub type Answered = Result<Response<Body>, ProxyError>;

/// The rest of the request path after a stage: what takes the call with that stage's facts
/// added.
pub trait Next<B, F>: Clone + Send + Sync + 'static {
    /// Hands the call on.
    fn run(&mut self, call: Call<B, F>) -> BoxFuture<Response<Body>, ProxyError>;
}

impl<T, B, F> Next<B, F> for T
where
    T: Service<
            Call<B, F>,
            Response = Response<Body>,
            Error = ProxyError,
            Future = BoxFuture<Response<Body>, ProxyError>,
        > + Clone
        + Send
        + Sync
        + 'static,
{
    fn run(&mut self, call: Call<B, F>) -> BoxFuture<Response<Body>, ProxyError> {
        self.call(call)
    }
}

/// One stage of the request path: it takes the call with the facts of the stages before
/// it (`In`) and either answers it itself (an answer or a [`ProxyError`]) or hands `next`
/// the call with its own facts added (`Out`). [`Staged`] makes it a tower service.
pub trait Stage<B>: Clone + Send + Sync + 'static {
    /// The facts this stage needs.
    type In;
    /// The facts it hands on.
    type Out;

    /// Runs the stage for one call.
    fn run<N: Next<B, Self::Out>>(
        &self,
        call: Call<B, Self::In>,
        next: N,
    ) -> impl Future<Output = Result<Response<Body>, ProxyError>> + Send;
}

/// A [`Stage`] in front of the rest of the path, as a tower service. Cloned for every
/// call (tower's `call` takes `&mut self`), so it is one `Arc`: cloning it does not clone
/// every stage behind it.
pub struct Staged<T, S> {
    shared: Arc<(T, S)>,
}

impl<T, S> Clone for Staged<T, S> {
    fn clone(&self) -> Self {
        Staged {
            shared: self.shared.clone(),
        }
    }
}

impl<T, S, B> Service<Call<B, T::In>> for Staged<T, S>
where
    T: Stage<B>,
    S: Next<B, T::Out>,
    T::In: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture<Response<Body>, ProxyError>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        // Every stage is always ready: waiting (fair queues) happens per call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: Call<B, T::In>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            let (stage, next) = &*shared;
            Stage::run(stage, call, next.clone()).await
        })
    }
}

/// The tower layer of a [`Stage`].
#[derive(Clone)]
pub struct StageLayer<T>(pub T);

impl<T: Clone, S> Layer<S> for StageLayer<T> {
    type Service = Staged<T, S>;
    fn layer(&self, next: S) -> Staged<T, S> {
        Staged {
            shared: Arc::new((self.0.clone(), next)),
        }
    }
}
