//! The outermost stage: makes the request's [`Call`], turns every [`ProxyError`] into its
//! answer through the one mapping ([`ProxyError::refusal`]), and counts every response
//! and logs every refusal, once.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tokio::time::Instant;
use tower::{Layer, Service};

use crate::call::{Call, Labels};
use crate::logs::{Rejection, RejectionLog};
use crate::metrics::{Metrics, ServedBy, code_label, method_label};
use crate::status::ProxyError;
use crate::{Body, BoxFuture};

/// See [`Rescue`].
#[derive(Clone)]
pub struct RescueLayer {
    metrics: Metrics,
    log: Arc<RejectionLog>,
}

impl RescueLayer {
    /// Counts in `metrics`; logs refusals to the rejection log.
    pub fn new(metrics: Metrics) -> RescueLayer {
        RescueLayer {
            metrics,
            log: Arc::new(RejectionLog::default()),
        }
    }
}

impl<S> Layer<S> for RescueLayer {
    type Service = Rescue<S>;
    fn layer(&self, inner: S) -> Rescue<S> {
        Rescue {
            inner,
            metrics: self.metrics.clone(),
            log: self.log.clone(),
        }
    }
}

/// Answers every request: the inner stages' response, or the refusal for their error.
#[derive(Clone)]
pub struct Rescue<S> {
    inner: S,
    metrics: Metrics,
    log: Arc<RejectionLog>,
}

impl<S, B> Service<Request<B>> for Rescue<S>
where
    S: Service<Call<B, ()>, Response = Response<Body>, Error = ProxyError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Response<Body>, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let method = method_label(request.method());
        let call = Call::new(request);
        let report = call.report.clone();
        let started = Instant::now();
        let (metrics, log) = (self.metrics.clone(), self.log.clone());
        let mut inner = self.inner.clone();
        Box::pin(async move {
            let (response, served_by) = match inner.call(call).await {
                Ok(response) => {
                    let served_by = served_by(&response).unwrap_or(ServedBy::Upstream);
                    (response, served_by)
                }
                Err(error) => {
                    let refusal = error.refusal();
                    let detail = crate::report::chain(&error);
                    tracing::debug!(reason = %refusal.reason, error = %detail, "refused");
                    log.rejected(Rejection {
                        identity: report.who.get().map_or("-", String::as_str),
                        rule: refusal.rule.as_deref().unwrap_or(""),
                        level: refusal.level.as_deref().unwrap_or(""),
                        reason: refusal.reason,
                        detail: &detail,
                    });
                    metrics.reject(
                        refusal.rule.as_deref().unwrap_or(""),
                        refusal.level.as_deref().unwrap_or(""),
                        refusal.reason,
                    );
                    let response = error.into_response(refusal);
                    let served_by = served_by(&response).unwrap_or(ServedBy::Bulwark);
                    (response, served_by)
                }
            };
            let labels = report.labels.get().cloned().unwrap_or(Labels {
                verb: method,
                resource: Arc::from(""),
            });
            metrics
                .requests_total
                .with_label_values(&[
                    labels.verb,
                    &labels.resource,
                    code_label(&response.status()),
                    served_by.as_str(),
                ])
                .inc();
            metrics
                .request_duration_seconds
                .with_label_values(&[labels.verb, served_by.as_str()])
                .observe(started.elapsed().as_secs_f64());
            Ok(response)
        })
    }
}

fn served_by(response: &Response<Body>) -> Option<ServedBy> {
    response.extensions().get::<ServedBy>().copied()
}
