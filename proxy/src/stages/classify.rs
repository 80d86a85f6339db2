//! Classification as a stage: what the request asks for, and its metric labels; a
//! malformed request is answered 400 here and never reaches identity or an apiserver.

use std::sync::Arc;

use super::call::{Answered, Call, Classified, Labels, Next, Stage};
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

    async fn run<N: Next<B, Self::Out>>(&self, call: Call<B, Self::In>, next: &N) -> Answered {
        let info = crate::classify::classify(call.request.method(), call.request.uri())?;
        let _ = call.report.labels.set(Labels {
            verb: verb_label(&info.verb),
            resource: self.resources.label(&info),
        });
        let info = Arc::new(info);
        let _ = call.report.info.set(info.clone());
        next.run(call.learn(Classified { info })).await
    }
}
