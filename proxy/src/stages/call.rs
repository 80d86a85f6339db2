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

use http::{Request, Response};

use super::error::ProxyError;
use crate::Body;
use crate::cache::{self, Held};
use crate::classify::RequestInfo;
use crate::identity::{ANONYMOUS, Identity, User};
use crate::listen::ConnInfo;
use crate::rules::Matched;
use crate::upstream::BodyFlow;

/// A request and what the stages so far know about it (`F`). The request, its connection
/// and its report are boxed once ([`Exchange`], reached through `Deref`), so that handing
/// the call from stage to stage moves a pointer and the facts: each stage's future holds
/// its call for as long as it runs, and the stages' futures nest.
pub struct Call<B, F> {
    exchange: Box<Exchange<B>>,
    /// What the stages so far learned.
    pub facts: F,
}

/// What every stage sees of a call, whatever it learned.
pub struct Exchange<B> {
    /// The request as the client sent it.
    pub request: Request<B>,
    /// The connection it came on; `None` only for requests made in tests.
    pub conn: Option<ConnInfo>,
    /// What `Rescue` reports for the request, whatever stage answers it.
    pub report: Arc<Report>,
    /// The request body, read whole before admission (`Admit`); the request's own body
    /// has then ended. `None` when the body was whole already (every GET's).
    pub body: Option<bytes::Bytes>,
}

impl<B> Call<B, ()> {
    /// A call for `request`: its connection is taken from the request's extensions, where
    /// the listener put it.
    pub fn new(mut request: Request<B>) -> Call<B, ()> {
        let conn = request.extensions_mut().remove::<ConnInfo>();
        Call {
            exchange: Box::new(Exchange {
                request,
                conn,
                report: Arc::default(),
                body: None,
            }),
            facts: (),
        }
    }
}

impl<B, F> Call<B, F> {
    /// The same call with the facts of one more stage.
    pub fn learn<G>(self, facts: G) -> Call<B, G> {
        Call {
            exchange: self.exchange,
            facts,
        }
    }

    /// The facts, and the call without them (to hand on with others).
    pub fn take_facts(self) -> (F, Call<B, ()>) {
        let call = Call {
            exchange: self.exchange,
            facts: (),
        };
        (self.facts, call)
    }

    /// The request, its connection and its report, out of the call.
    pub fn into_exchange(self) -> Exchange<B> {
        *self.exchange
    }
}

impl<B, F> std::ops::Deref for Call<B, F> {
    type Target = Exchange<B>;
    fn deref(&self) -> &Exchange<B> {
        &self.exchange
    }
}

impl<B, F> std::ops::DerefMut for Call<B, F> {
    fn deref_mut(&mut self) -> &mut Exchange<B> {
        &mut self.exchange
    }
}

/// What the rejection log and the request metrics say of a request, filled in by the
/// stage that learns it.
#[derive(Debug, Default)]
pub struct Report {
    /// What the request asks for and its metric labels (classification).
    pub classified: OnceLock<ClassifiedReport>,
    /// The client's user, `None` for an anonymous request (identity); see [`Report::who`].
    pub user: OnceLock<Option<Arc<User>>>,
    /// How long the request waited for admission (admission).
    pub waited: OnceLock<std::time::Duration>,
    /// The flow the request was admitted in, or refused for (admission).
    pub flow: OnceLock<Arc<str>>,
    /// What admission said when it let the request in (one cell, set once: each cell
    /// set costs a request about 85 instructions).
    pub admitted: OnceLock<AdmittedReport>,
}

/// What the report keeps of a classified request.
#[derive(Debug)]
pub struct ClassifiedReport {
    /// The verb and resource labels.
    pub labels: Labels,
    /// What the request asks for.
    pub info: Arc<RequestInfo>,
}

impl Report {
    /// What the request asks for, once classified.
    pub fn info(&self) -> Option<&Arc<RequestInfo>> {
        self.classified.get().map(|c| &c.info)
    }
}

/// What the report keeps of an admitted request's admission.
#[derive(Debug)]
pub struct AdmittedReport {
    /// The bytes admission expected the answer to cost (a LIST's, by what it reads).
    pub expected_bytes: u64,
    /// When admission let it in: from there to the answer's head it held its seats.
    pub at: tokio::time::Instant,
    /// The rule and level that admitted it, whether or not its answer names them
    /// (`rules.answerHeaders`).
    pub named: crate::rules::RuleHeaders,
}

impl Report {
    /// The client's user name: `-` before (or without) identity.
    pub fn who(&self) -> &str {
        match self.user.get() {
            Some(Some(user)) => &user.username,
            Some(None) => ANONYMOUS,
            None => "-",
        }
    }
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
                username: ANONYMOUS.into(),
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
    pub reader: Arc<User>,
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
/// added. Its future is not boxed: the stages after `Rescue` make one future, which
/// `Rescue` boxes once per request.
pub trait Next<B, F>: Send + Sync + 'static {
    /// Hands the call on.
    fn run(&self, call: Call<B, F>) -> impl Future<Output = Answered> + Send;
}

/// One stage of the request path: it takes the call with the facts of the stages before
/// it (`In`) and either answers it itself (an answer or a [`ProxyError`]) or hands `next`
/// the call with its own facts added (`Out`). [`Staged`] puts it in front of the rest.
pub trait Stage<B>: Send + Sync + 'static {
    /// The facts this stage needs.
    type In;
    /// The facts it hands on.
    type Out;

    /// Runs the stage for one call.
    fn run<N: Next<B, Self::Out>>(
        &self,
        call: Call<B, Self::In>,
        next: &N,
    ) -> impl Future<Output = Answered> + Send;
}

/// A [`Stage`] in front of the rest of the path (`next`).
pub struct Staged<T, S> {
    stage: T,
    next: S,
}

impl<T, S> Staged<T, S> {
    /// `stage`, then `next`.
    pub fn new(stage: T, next: S) -> Staged<T, S> {
        Staged { stage, next }
    }
}

impl<T, S, B> Next<B, T::In> for Staged<T, S>
where
    T: Stage<B>,
    S: Next<B, T::Out>,
{
    fn run(&self, call: Call<B, T::In>) -> impl Future<Output = Answered> + Send {
        self.stage.run(call, &self.next)
    }
}
