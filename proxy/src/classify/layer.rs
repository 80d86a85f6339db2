//! Classification as a stage: what the request asks for, and its metric labels; a
//! malformed request is answered 400 here and never reaches identity or an apiserver.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use tower::{Layer, Service};

use crate::call::{Call, Classified, Labels};
use crate::metrics::{ResourceLabels, verb_label};
use crate::status::ProxyError;
use crate::{Body, BoxFuture};

/// See [`Classify`].
#[derive(Clone, Default)]
pub struct ClassifyLayer {
    resources: ResourceLabels,
}

impl ClassifyLayer {
    /// Labels resources from the closed set `resources` (see [`ResourceLabels`]).
    pub fn new(resources: ResourceLabels) -> ClassifyLayer {
        ClassifyLayer { resources }
    }
}

impl<S> Layer<S> for ClassifyLayer {
    type Service = Classify<S>;
    fn layer(&self, inner: S) -> Classify<S> {
        Classify {
            inner,
            resources: self.resources.clone(),
        }
    }
}

/// Classifies the request (400 for malformed paths) and records its labels.
#[derive(Clone)]
pub struct Classify<S> {
    inner: S,
    resources: ResourceLabels,
}

impl<S, B> Service<Call<B, ()>> for Classify<S>
where
    S: Service<Call<B, Classified>, Response = Response<Body>, Error = ProxyError>
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

    fn call(&mut self, call: Call<B, ()>) -> Self::Future {
        let classified = super::classify(call.request.method(), call.request.uri());
        if let Ok(info) = &classified {
            let _ = call.report.labels.set(Labels {
                verb: verb_label(&info.verb),
                resource: self.resources.label(info),
            });
        }
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let info = Arc::new(classified?);
            inner.call(call.learn(Classified { info })).await
        })
    }
}
