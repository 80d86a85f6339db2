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
    /// Which answers name their rule and level in `X-Bulwark-Rule` and `X-Bulwark-Level`:
    /// `refusals` (the default) or `every` answer. The access log, `/debug/flows` and the
    /// metrics name them either way; on every answer they cost about 3,200 instructions of
    /// a forwarded GET's 119,000 (README, Benchmarks), for what a client rarely reads.
    pub answer_headers: AnswerHeaders,
}

/// See [`Rules::answer_headers`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnswerHeaders {
    /// Only Bulwark's refusals, and failures after admission, name their rule and level.
    #[default]
    Refusals,
    /// Every answer that went through a rule names it.
    Every,
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
