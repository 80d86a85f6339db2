//! Reads a rules folder: which files count, and their text, refusing what is too large or
//! not text before parsing anything.
//!
//! A Kubernetes ConfigMap mounted as a volume looks like this:
//! ```text
//! rules/..2026_06_01_12_00_00.123456789/team-a.yaml   the real files, one folder per update
//! rules/..data -> ..2026_06_01_12_00_00.123456789      swapped atomically on update
//! rules/team-a.yaml -> ..data/team-a.yaml               the visible names
//! ```
//! Reading only visible (not dot-prefixed) entries, following symlinks, reads every file
//! once, through the `..data` view, and picks up an update as one atomic swap.

use std::fs;
use std::io::Read;
use std::path::Path;

use super::validate::folder_problem;
use super::{RuleProblem, Source};

/// Largest rule file read; larger ones are refused from their size alone.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Whether a folder entry is a rule file by its name: `*.yaml` or `*.yml`, not hidden.
pub fn is_rule_file_name(name: &str) -> bool {
    if name.starts_with('.') {
        return false;
    }
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".yaml") || lower.ends_with(".yml")
}

/// The rule files of `dir`, sorted by name, and a problem for each that cannot be used
/// (unreadable, too large, not UTF-8) or for the folder itself (unreadable, no rule files).
pub fn read_folder(dir: &Path) -> (Vec<Source>, Vec<RuleProblem>) {
    let mut problems = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            problems.push(folder_problem(
                dir,
                format!("cannot read the rules folder: {e}"),
            ));
            return (Vec::new(), problems);
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| is_rule_file_name(name))
        .collect();
    names.sort();

    let mut sources = Vec::new();
    let mut seen_any = false;
    for name in names {
        let path = dir.join(&name);
        let at_start = |message: String| RuleProblem {
            file: path.clone(),
            line: 1,
            column: 1,
            message,
        };
        // `metadata` follows symlinks, as reading will.
        let meta = match fs::metadata(&path) {
            Ok(meta) => meta,
            Err(e) => {
                seen_any = true;
                problems.push(at_start(format!("cannot read the file: {e}")));
                continue;
            }
        };
        if meta.is_dir() {
            continue;
        }
        seen_any = true;
        if meta.len() > MAX_FILE_BYTES {
            problems.push(at_start(too_large(meta.len())));
            continue;
        }
        match read_limited(&path) {
            Ok(bytes) if bytes.len() as u64 > MAX_FILE_BYTES => {
                // Grew between the size check and the read.
                problems.push(at_start(too_large(bytes.len() as u64)));
            }
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(text) => sources.push(Source { path, text }),
                Err(e) => {
                    let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
                    let line = 1 + valid.iter().filter(|b| **b == b'\n').count();
                    let line_start = valid.iter().rposition(|b| *b == b'\n').map_or(0, |p| p + 1);
                    let column = 1 + String::from_utf8_lossy(&valid[line_start..])
                        .chars()
                        .count();
                    problems.push(RuleProblem {
                        file: path.clone(),
                        line,
                        column,
                        message: "not a YAML file: the text is not valid UTF-8".into(),
                    });
                }
            },
            Err(e) => problems.push(at_start(format!("cannot read the file: {e}"))),
        }
    }
    if !seen_any {
        problems.push(folder_problem(
            dir,
            "no rule files (*.yaml or *.yml) in the folder".into(),
        ));
    }
    (sources, problems)
}

/// Reads at most one byte more than the limit, so a file that grew is still caught.
fn read_limited(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

fn too_large(len: u64) -> String {
    format!("the file is {len} bytes; a rule file may be at most {MAX_FILE_BYTES} bytes (1 MiB)")
}
