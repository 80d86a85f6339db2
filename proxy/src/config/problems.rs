//! What is wrong with a configuration: each problem under its field, and why loading failed.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// One problem found in a configuration file: the field it concerns and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Problem {
    /// Dotted path of the field as written in the file, e.g. `upstream.replicas[1]`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not valid YAML for this schema: a syntax error, an unknown or duplicate
    /// field, a missing required field or a value of the wrong type. The message names the
    /// field's dotted path and, when known, its line and column.
    #[error("{message}")]
    Parse {
        /// 1-based line of the problem, when known.
        line: Option<usize>,
        /// 1-based column of the problem, when known.
        column: Option<usize>,
        /// The parser's message, e.g. ``upstream.timeouts: unknown field `reed`, expected
        /// one of `connect`, `read`, `list`, `write` at line 12 column 5``.
        message: String,
    },
    /// The file parsed but its values have problems, each listed.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// Collects problems, each under its dotted field path.
pub(super) struct Problems {
    list: Vec<Problem>,
    /// Problems set aside while parsing, each taken into `list` by [`Problems::parsed`]
    /// where its field is checked.
    deferred: Vec<Problem>,
}

impl Problems {
    /// Starts with the problems set aside while parsing.
    pub(super) fn new(deferred: Vec<Problem>) -> Self {
        Self {
            list: Vec::new(),
            deferred,
        }
    }

    /// Every problem, in the order they were found.
    pub(super) fn into_list(mut self) -> Vec<Problem> {
        self.list.append(&mut self.deferred);
        self.list
    }

    pub(super) fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.list.push(Problem {
            field: field.into(),
            message: message.into(),
        });
    }

    /// Takes in the problems set aside while parsing `field` (and its items), here where
    /// its checks would stand.
    pub(super) fn parsed(&mut self, field: &str) {
        let (mine, rest) =
            std::mem::take(&mut self.deferred)
                .into_iter()
                .partition(|p: &Problem| {
                    p.field
                        .strip_prefix(field)
                        .is_some_and(|tail| tail.is_empty() || tail.starts_with(['[', '.']))
                });
        self.deferred = rest;
        self.list.extend::<Vec<Problem>>(mine);
    }

    /// A duration that must be above zero.
    pub(super) fn positive(&mut self, field: &str, value: Duration) {
        if value.is_zero() {
            self.add(field, "must be greater than 0");
        }
    }

    /// A count or size that must be above zero.
    pub(super) fn nonzero(&mut self, field: &str, value: u64) {
        if value == 0 {
            self.add(field, "must be greater than 0");
        }
    }

    /// A per-prefix cap, which must hold at least one source's connections when both are
    /// capped (a prefix holds its sources).
    pub(super) fn prefix_cap(&mut self, section: &str, per_source: usize, per_prefix: usize) {
        if per_source != 0 && per_prefix != 0 && per_prefix < per_source {
            self.add(
                format!("{section}.maxConnectionsPerPrefix"),
                format!(
                    "{per_prefix} is less than {section}.maxConnectionsPerSource ({per_source})"
                ),
            );
        }
    }

    /// A file or folder path that must not be empty.
    pub(super) fn path(&mut self, field: &str, value: &Path) {
        if value.as_os_str().is_empty() {
            self.add(field, "must not be empty");
        }
    }
}

thread_local! {
    /// The problems set aside by the parse [`deferring`] runs on this thread; `None`
    /// outside one.
    static DEFERRED: std::cell::RefCell<Option<Vec<Problem>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs a parse during which [`defer`] sets problems aside, and returns them with its
/// result. serde stops at the first error; a value that parses into a type defers its
/// problem instead, so that validation lists it among all the others.
pub(super) fn deferring<T>(parse: impl FnOnce() -> T) -> (T, Vec<Problem>) {
    let outer = DEFERRED.with(|d| d.replace(Some(Vec::new())));
    let parsed = parse();
    let deferred = DEFERRED.with(|d| d.replace(outer)).unwrap_or_default();
    (parsed, deferred)
}

/// Sets a problem of `field` aside for validation, inside [`deferring`]; outside one (a
/// section deserialized on its own) it is the deserializer's error, so a value that does
/// not parse is never dropped silently.
pub(super) fn defer<E: serde::de::Error>(field: String, message: String) -> Result<(), E> {
    DEFERRED.with(|d| match d.borrow_mut().as_mut() {
        Some(list) => {
            list.push(Problem { field, message });
            Ok(())
        }
        None => Err(E::custom(format!("{field}: {message}"))),
    })
}
