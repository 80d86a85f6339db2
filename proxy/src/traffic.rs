//! Recorded traffic, read back: the access log's lines (`logs::access`) as the requests
//! they were, for `bulwark rules suggest` (rules sized from what each client class was
//! served, [`suggest`]) and `bulwark rules replay` (what a rule folder would have refused
//! of it, [`replay`]).
//!
//! A line says who asked (the user, its groups and the node and pod claims flows are keyed
//! by, the source address), what (verb and path), the answer (code, served by, rule, a
//! refusal's reason, the bytes admission expected) and when: its `time` is when the
//! answer's head was sent, `seconds` how long that took, so the request came at `time -
//! seconds`. A watch's second line (`"ended": true`) says how long it stayed open.
//! Lines that are not the access log's (a rotated file's torn last line, another log) are
//! counted and skipped, never fatal.

pub mod replay;
pub mod suggest;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use crate::rules::client::{NODE_NAME_CLAIM, POD_UID_CLAIM};
use crate::user::User;

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Record {
    /// When the request came, in seconds after the recording's first request.
    pub at: f64,
    /// Its `Audit-Id`.
    pub audit_id: String,
    /// Who asked, as admission saw them (groups, and the node and pod UID claims).
    pub user: User,
    /// The client's address.
    pub source: Option<IpAddr>,
    /// The verb (`list`, `watch`, `get`, ...).
    pub verb: String,
    /// The path asked for.
    pub path: String,
    /// The answer's status code.
    pub code: u16,
    /// `upstream`, `cache` or `bulwark`.
    pub served_by: String,
    /// The rule that matched when recorded.
    pub rule: String,
    /// Why Bulwark refused it, if it did.
    pub reason: Option<String>,
    /// The bytes admission expected the answer to cost.
    pub expected_bytes: Option<u64>,
    /// Seconds until the answer's head.
    pub seconds: f64,
    /// Of those, seconds it waited in its level's queue.
    pub waited: f64,
    /// Of those, seconds it held its seats (admission to head), when recorded.
    pub held: Option<f64>,
    /// For a watch: how long it stayed open, when its end was recorded.
    pub open_for: Option<f64>,
}

impl Record {
    /// Whether the request was identified (refusals before identity name no one).
    pub fn identified(&self) -> bool {
        self.user.username != "-" && self.user.username != "system:anonymous"
    }

    /// Whether it was answered rather than refused: by Bulwark (`reason`) or the
    /// apiservers (429).
    pub fn served(&self) -> bool {
        self.reason.is_none() && self.code != 429
    }

    /// How long it held its seats: admission to head where recorded, else its time to
    /// head less its wait in a queue (older lines, which include the token review).
    pub fn seat_seconds(&self) -> f64 {
        self.held.unwrap_or(self.seconds - self.waited).max(0.001)
    }

    /// Whether it is a watch.
    pub fn is_watch(&self) -> bool {
        self.verb == "watch"
    }

    /// A claim of the user's (`authentication.kubernetes.io/...`).
    pub fn claim(&self, key: &str) -> Option<&str> {
        self.user.extra.get(key)?.first().map(String::as_str)
    }
}

/// Requests read from one or more access logs, in the order they came.
#[derive(Debug, Default)]
pub struct Recording {
    /// The requests, by `at`.
    pub records: Vec<Record>,
    /// When the first came.
    pub start: Option<SystemTime>,
    /// How long the recording spans, first request to last line, in seconds.
    pub span: f64,
    /// Lines that were not access-log lines.
    pub skipped: usize,
    /// The smallest share of answered requests the log wrote, when it did not write all.
    pub sampled: Option<f64>,
    /// The files read.
    pub files: Vec<PathBuf>,
}

/// An access-log line: a request, or a watch's end.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Line {
    time: String,
    #[serde(default)]
    audit_id: String,
    #[serde(default)]
    user: String,
    #[serde(default)]
    groups: Vec<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    pod_uid: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    verb: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    code: u16,
    #[serde(default)]
    served_by: String,
    #[serde(default)]
    rule: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    expected_bytes: Option<u64>,
    #[serde(default)]
    seconds: f64,
    #[serde(default)]
    waited_seconds: f64,
    #[serde(default)]
    held_seconds: Option<f64>,
    #[serde(default)]
    ended: bool,
    #[serde(default)]
    sample: Option<f64>,
}

/// Why a recording cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The log wrote a sample of the answered requests: rates from it would be too low.
    #[error(
        "the access log wrote a sample of the answered requests (accessLog.sample: {sample}): rates read from it would be {times:.0}x too low; record with accessLog.sample: 1.0",
        times = 1.0 / .sample
    )]
    Sampled {
        /// The share written.
        sample: f64,
    },
    /// Nothing in the files was an access-log line.
    #[error(
        "no access-log lines in {files} ({skipped} other lines): turn the access log on (accessLog in Bulwark's configuration) and read its files"
    )]
    Empty {
        /// The files, joined.
        files: String,
        /// Lines that were not the access log's.
        skipped: usize,
    },
}

impl Recording {
    /// Reads access-log files (a rotated set in any order: the lines are sorted by time).
    pub fn read(paths: &[PathBuf]) -> Result<Recording, ReadError> {
        let mut texts = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(path).map_err(|source| ReadError::Io {
                path: path.clone(),
                source,
            })?;
            texts.push(text);
        }
        let recording = Recording::parse(texts.iter().map(String::as_str), paths);
        if let Some(sample) = recording.sampled {
            return Err(ReadError::Sampled { sample });
        }
        if recording.records.is_empty() {
            return Err(ReadError::Empty {
                files: paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                skipped: recording.skipped,
            });
        }
        Ok(recording)
    }

    /// The recording the texts hold (each an access-log file's content).
    pub fn parse<'a>(texts: impl IntoIterator<Item = &'a str>, files: &[PathBuf]) -> Recording {
        let mut skipped = 0;
        let mut requests = Vec::new();
        let mut ends: HashMap<String, SystemTime> = HashMap::new();
        let mut last = None::<SystemTime>;
        let mut sampled = None::<f64>;
        for line in texts.into_iter().flat_map(str::lines) {
            if line.trim().is_empty() {
                continue;
            }
            let Some((line, time)) = serde_json::from_str::<Line>(line)
                .ok()
                .and_then(|l| Some((humantime::parse_rfc3339(&l.time).ok()?, l)))
                .map(|(time, l)| (l, time))
            else {
                skipped += 1;
                continue;
            };
            last = Some(last.map_or(time, |l| l.max(time)));
            if let Some(sample) = line.sample {
                sampled = Some(sampled.map_or(sample, |s| s.min(sample)));
            }
            if line.ended {
                ends.insert(line.audit_id, time);
                continue;
            }
            let Some(path) = line.path.clone() else {
                // A request refused before it was classified: nothing a rule can match.
                skipped += 1;
                continue;
            };
            let came = time
                .checked_sub(Duration::from_secs_f64(line.seconds.max(0.0)))
                .unwrap_or(time);
            requests.push((came, time, path, line));
        }
        let start = requests.iter().map(|(came, ..)| *came).min();
        let since = |t: SystemTime| {
            start
                .and_then(|s| t.duration_since(s).ok())
                .map_or(0.0, |d| d.as_secs_f64())
        };
        let mut records: Vec<Record> = requests
            .into_iter()
            .map(|(came, head, path, line)| {
                let open_for = ends
                    .get(&line.audit_id)
                    .and_then(|end| end.duration_since(head).ok())
                    .map(|d| d.as_secs_f64() + line.seconds);
                Record {
                    at: since(came),
                    user: user_of(&line),
                    source: line
                        .source
                        .as_deref()
                        .and_then(|s| s.parse::<SocketAddr>().ok())
                        .map(|s| s.ip()),
                    audit_id: line.audit_id,
                    verb: line.verb,
                    path,
                    code: line.code,
                    served_by: line.served_by,
                    rule: line.rule,
                    reason: line.reason,
                    expected_bytes: line.expected_bytes,
                    seconds: line.seconds,
                    waited: line.waited_seconds,
                    held: line.held_seconds,
                    open_for,
                }
            })
            .collect();
        records.sort_by(|a, b| a.at.total_cmp(&b.at));
        Recording {
            span: last.map_or(0.0, since),
            records,
            start,
            skipped,
            sampled,
            files: files.to_vec(),
        }
    }

    /// The recording's first and last moments, as RFC 3339 text.
    pub fn window(&self) -> (String, String) {
        let at = |secs: f64| {
            self.start.map_or_else(String::new, |s| {
                humantime::format_rfc3339_seconds(s + Duration::from_secs_f64(secs)).to_string()
            })
        };
        (at(0.0), at(self.span))
    }
}

/// The user a line names, with the claims flows are keyed by.
fn user_of(line: &Line) -> User {
    let mut extra = BTreeMap::new();
    if let Some(node) = &line.node {
        extra.insert(NODE_NAME_CLAIM.to_owned(), vec![node.clone()]);
    }
    if let Some(uid) = &line.pod_uid {
        extra.insert(POD_UID_CLAIM.to_owned(), vec![uid.clone()]);
    }
    User {
        username: line.user.clone(),
        uid: None,
        groups: line.groups.clone(),
        extra,
    }
}

/// The files of a rotated access log: `path` and its numbered siblings (`path.1`, ...).
pub fn rotated(path: &Path) -> Vec<PathBuf> {
    let mut files = vec![path.to_path_buf()];
    for n in 1.. {
        let sibling = PathBuf::from(format!("{}.{n}", path.display()));
        if !sibling.exists() {
            break;
        }
        files.push(sibling);
    }
    files
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An access-log line for a test recording.
    pub(crate) fn line(time: &str, user: &str, verb: &str, path: &str, seconds: f64) -> String {
        serde_json::json!({
            "time": time,
            "auditId": format!("{user}-{time}-{verb}"),
            "user": user,
            "groups": ["system:authenticated"],
            "verb": verb,
            "path": path,
            "code": 200,
            "servedBy": "upstream",
            "seconds": seconds,
        })
        .to_string()
    }

    #[test]
    fn a_sampled_log_is_refused_with_how_much_too_low_its_rates_would_be() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.jsonl");
        let mut sampled: serde_json::Value = serde_json::from_str(&line(
            "2026-11-28T10:00:00Z",
            "alice",
            "get",
            "/api/v1/namespaces/a/pods/p",
            0.1,
        ))
        .unwrap();
        sampled["sample"] = 0.01.into();
        std::fs::write(&path, sampled.to_string()).unwrap();
        let err = Recording::read(std::slice::from_ref(&path))
            .unwrap_err()
            .to_string();
        assert!(err.contains("accessLog.sample: 0.01"), "{err}");
        assert!(err.contains("100x too low"), "{err}");
        std::fs::write(&path, "not a log\n").unwrap();
        let err = Recording::read(&[path]).unwrap_err().to_string();
        assert!(err.contains("no access-log lines"), "{err}");
    }

    #[test]
    fn lines_become_requests_in_the_order_they_came_and_watches_know_their_end() {
        let watch = serde_json::json!({
            "time": "2026-11-28T10:00:01Z", "auditId": "w1", "user": "system:node:n1",
            "groups": ["system:nodes", "system:authenticated"], "verb": "watch",
            "path": "/api/v1/secrets", "code": 200, "servedBy": "cache", "seconds": 0.5,
        });
        let end = serde_json::json!({
            "time": "2026-11-28T10:00:31Z", "auditId": "w1", "user": "system:node:n1",
            "verb": "watch", "ended": true, "seconds": 30.0,
        });
        let text = [
            line(
                "2026-11-28T10:00:02Z",
                "alice",
                "get",
                "/api/v1/namespaces/a/pods/p",
                0.1,
            ),
            watch.to_string(),
            "not json".into(),
            end.to_string(),
        ]
        .join("\n");
        let rec = Recording::parse([text.as_str()], &[]);
        assert_eq!(rec.skipped, 1);
        assert_eq!(rec.records.len(), 2);
        let [w, get] = [&rec.records[0], &rec.records[1]];
        assert_eq!(
            w.audit_id, "w1",
            "the watch came first (at head time less its seconds)"
        );
        assert_eq!(w.at, 0.0);
        assert_eq!(w.open_for, Some(30.5));
        assert!((get.at - 1.4).abs() < 1e-6, "{}", get.at);
        assert_eq!(get.open_for, None);
        assert!((rec.span - 30.5).abs() < 1e-6, "{}", rec.span);
        assert_eq!(w.user.groups, ["system:nodes", "system:authenticated"]);
    }
}
