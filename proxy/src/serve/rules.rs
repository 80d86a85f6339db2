//! The rule set: loaded from the folder (or the built-in levels), watched for changes.

use std::sync::Arc;

use super::StartError;
use crate::config;
use crate::metrics::Metrics;
use crate::rules::{RuleSet, Rules};

/// Loads the rules in their configured mode and starts watching their folder.
pub(super) fn start(cfg: &config::Rules, metrics: &Metrics) -> Result<Arc<Rules>, StartError> {
    let rule_set = match &cfg.folder {
        Some(folder) => RuleSet::load_dir(folder).map_err(StartError::Rules)?,
        None => RuleSet::builtin(),
    }
    .with_mode(cfg.mode.into());
    if cfg.mode == config::RulesMode::Shadow {
        tracing::warn!(
            "rules.mode is shadow: no rule refuses; would-be refusals are counted in \
             bulwark_shadow_rejections_total"
        );
    }
    let rules = Rules::new(rule_set, cfg.folder.clone(), metrics.clone());
    rules.spawn_watch();
    Ok(rules)
}
