//! The request path's stages ([`crate::stages`]), built once and shared by every worker.

use std::sync::Arc;

use crate::admit::{Admission, SendProgress};
use crate::board::Board;
use crate::cache::Cache;
use crate::config::Config;
use crate::identity::TokenCache;
use crate::listen::RequestPath;
use crate::logs::access::AccessLog;
use crate::metrics::{Metrics, ResourceLabels};
use crate::rules::Rules;
use crate::stages::admit::Admit;
use crate::stages::classify::Classify;
use crate::stages::forward::Forward;
use crate::stages::identity::Identify;
use crate::stages::rescue::RescueLayer;
use crate::stages::stack;
use crate::upstream::{BodyBudget, BodyDeadlines};

/// Every stage before the upstream: their state is shared by every worker's path; only the
/// connections to the apiservers ([`Forward`]) are each worker's own.
#[derive(Clone)]
pub(super) struct Stages {
    rescue: RescueLayer,
    classify: Classify,
    identify: Identify,
    admit: Admit,
}

/// What the stages are built from.
pub(super) struct Parts {
    pub(super) tokens: Arc<TokenCache>,
    pub(super) rules: Arc<Rules>,
    pub(super) admission: Arc<Admission>,
    pub(super) cache: Option<Arc<Cache>>,
    pub(super) access: Option<AccessLog>,
}

impl Stages {
    /// Builds the stages from the configuration and the parts they consult.
    pub(super) fn new(config: &Config, parts: Parts, metrics: &Metrics) -> Stages {
        let limits = &config.listen.limits;
        let rescue = RescueLayer::new(metrics.clone(), config.metrics.identities, parts.access);
        let classify = Classify::new(ResourceLabels::new(
            config.cache.resources.iter().map(|gr| gr.resource.as_str()),
        ));
        let identify = Identify::new(parts.tokens, config.identity.anonymous.clone());
        let admit = Admit::new(
            parts.rules,
            parts.admission,
            parts.cache,
            BodyBudget::new(limits),
            BodyDeadlines {
                progress: limits.body_progress_timeout,
                whole: limits.body_timeout,
            },
            SendProgress {
                timeout: limits.send_progress_timeout,
                cut: metrics
                    .responses_cut_total
                    .with_label_values(&["client_not_reading"]),
            },
            config.rules.answer_headers == crate::config::AnswerHeaders::Every,
        );
        Stages {
            rescue,
            classify,
            identify,
            admit,
        }
    }

    /// The board of flows the rescue layer keeps, for the admin endpoints.
    pub(super) fn board(&self) -> Arc<Board> {
        self.rescue.board()
    }

    /// The whole request path in front of `forward`.
    pub(super) fn path(&self, forward: Forward) -> impl RequestPath + Sync {
        stack(
            self.rescue.clone(),
            self.classify.clone(),
            self.identify.clone(),
            self.admit.clone(),
            forward,
        )
    }
}
