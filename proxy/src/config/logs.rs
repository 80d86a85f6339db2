//! The `audit` and `accessLog` sections: the file logs and how they rotate.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Quantity;
use super::problems::Problems;

/// The access log: one JSON line per request (who, what, the answer, the rule and level,
/// the refusal's reason, the `Audit-Id`), sampled or full, rotated by size like the audit
/// log.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AccessLog {
    /// File the lines are appended to. Required.
    pub path: PathBuf,
    /// Fraction (0 to 1) of answered requests logged; every refusal and every 5xx is
    /// logged whatever the fraction.
    #[serde(default = "one")]
    pub sample: f64,
    /// Bytes per file before it is rotated, as for `audit.maxSize`. At least 64Ki.
    #[serde(default = "default_log_size")]
    pub max_size: Quantity,
    /// Rotated files kept, as for `audit.maxFiles`. At least 1.
    #[serde(default = "default_log_files")]
    pub max_files: u32,
}

fn one() -> f64 {
    1.0
}
fn default_log_size() -> Quantity {
    Quantity(100 * 1024 * 1024)
}
fn default_log_files() -> u32 {
    5
}

/// The audit log.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct Audit {
    /// File that audit events are appended to, as JSON lines.
    pub path: Option<PathBuf>,
    /// Bytes per file: the file is rotated (`path` → `path.1` …) before a line that would
    /// take it past this, so no line is split across files. At least 64Ki.
    pub max_size: Quantity,
    /// Rotated files kept beside `path` (`path.1` … `path.N`), the oldest deleted; the log
    /// takes at most `maxSize × (maxFiles + 1)` on disk. At least 1.
    pub max_files: u32,
}

impl Default for Audit {
    fn default() -> Self {
        Audit {
            path: None,
            // 600 MiB on disk at most: about 3 hours of 100 cached Secret reads a second
            // (600-byte lines) for the node's log agent to ship.
            max_size: Quantity(100 * 1024 * 1024),
            max_files: 5,
        }
    }
}

impl AccessLog {
    /// The bytes the log may take on disk: `maxSize × (maxFiles + 1)`.
    pub fn max_disk_bytes(&self) -> u64 {
        self.max_size
            .0
            .saturating_mul(u64::from(self.max_files) + 1)
    }
}

impl Audit {
    /// The bytes the log may take on disk: `maxSize × (maxFiles + 1)`.
    pub fn max_disk_bytes(&self) -> u64 {
        self.max_size
            .0
            .saturating_mul(u64::from(self.max_files) + 1)
    }
}

impl Audit {
    pub(super) fn validate(&self, p: &mut Problems) {
        if let Some(path) = &self.path {
            p.path("audit.path", path);
        }
        if self.max_size.0 < 64 * 1024 {
            p.add(
                "audit.maxSize",
                "must be at least 64Ki (each file holds whole lines)",
            );
        }
        if self.max_files == 0 {
            p.add(
                "audit.maxFiles",
                "must be at least 1 (0 would delete the log at each rotation)",
            );
        }
    }
}

impl AccessLog {
    pub(super) fn validate(&self, p: &mut Problems) {
        p.path("accessLog.path", &self.path);
        if !(0.0..=1.0).contains(&self.sample) {
            p.add(
                "accessLog.sample",
                format!("{} is outside 0 to 1", self.sample),
            );
        }
        if self.max_size.0 < 64 * 1024 {
            p.add(
                "accessLog.maxSize",
                "must be at least 64Ki (each file holds whole lines)",
            );
        }
        if self.max_files == 0 {
            p.add(
                "accessLog.maxFiles",
                "must be at least 1 (0 would delete the log at each rotation)",
            );
        }
    }
}
