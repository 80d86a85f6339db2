//! Classification as a stage: what the request asks for, and its metric labels; a
//! malformed request is answered 400 here and never reaches identity or an apiserver.

use std::future::Future;
use std::sync::Arc;

use futures::future::{self, Either};

use super::call::{Answered, Call, Classified, ClassifiedReport, Labels, Next, Stage};
use crate::metrics::{ResourceLabels, verb_label};

/// Classifies the request (400 for malformed paths) and records its labels.
#[derive(Clone, Default)]
pub struct Classify {
    resources: ResourceLabels,
}

impl Classify {
    /// Labels resources from the closed set `resources` (see [`ResourceLabels`]).
    pub fn new(resources: ResourceLabels) -> Classify {
        Classify { resources }
    }
}

impl<B: Send + 'static> Stage<B> for Classify {
    type In = ();
    type Out = Classified;

    /// Not `async`: classification takes no wait, so the next stage's future is this
    /// stage's, with nothing of its own around it.
    fn run<N: Next<B, Self::Out>>(
        &self,
        call: Call<B, Self::In>,
        next: &N,
    ) -> impl Future<Output = Answered> + Send {
        match crate::classify::classify(call.request.method(), call.request.uri()) {
            Ok(info) => {
                let labels = Labels {
                    verb: verb_label(&info.verb),
                    resource: self.resources.label(&info),
                };
                let info = Arc::new(info);
                let _ = call.report.classified.set(ClassifiedReport {
                    labels,
                    info: info.clone(),
                });
                Either::Left(next.run(call.learn(Classified { info })))
            }
            Err(error) => Either::Right(future::ready(Err(error.into()))),
        }
    }
}
