//! The `metrics` section: what the metrics may say of who is refused.

use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// What the metrics may say of who is refused.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MetricsSettings {
    /// How many identities `bulwark_identity_rejections_total` names: the ones refused most
    /// in the last minute, the rest counted as `other`. 0 (the default) counts nothing;
    /// at most 100, for a bounded number of series.
    #[serde(default)]
    pub identities: u32,
}

/// The most identities `metrics.identities` may name: each is a series of its own.
pub const MAX_IDENTITY_LABELS: u32 = 100;

impl MetricsSettings {
    pub(super) fn validate(&self, p: &mut Problems) {
        if self.identities > MAX_IDENTITY_LABELS {
            p.add(
                "metrics.identities",
                format!(
                    "{} is more than {MAX_IDENTITY_LABELS} (each name is a series of its own)",
                    self.identities,
                ),
            );
        }
    }
}
