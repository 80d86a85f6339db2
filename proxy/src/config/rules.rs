//! The `rules` section: where the rule files live, and whether their limits refuse.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// Where the rule files live, and whether their limits refuse.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Rules {
    /// Folder of rule files; without it only the built-in levels apply.
    pub folder: Option<PathBuf>,
    /// `enforce` leaves each rule its own `mode`; `shadow` makes every rule, the built-in
    /// catch-all included, only count what its limits would refuse, whatever its `mode`.
    pub mode: RulesMode,
}

/// The rules' mode over every rule of the folder (`rules.mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RulesMode {
    /// Each rule's own `mode` holds (a rule is enforced unless it says `mode: shadow`).
    #[default]
    Enforce,
    /// Every rule is in shadow mode: nothing is refused by a rule's limits, every would-be
    /// refusal is counted in `bulwark_shadow_rejections_total`. For the first days of a
    /// rule set on a cluster.
    Shadow,
}

impl Rules {
    pub(super) fn validate(&self, p: &mut Problems) {
        if let Some(folder) = &self.folder {
            p.path("rules.folder", folder);
        }
    }
}
