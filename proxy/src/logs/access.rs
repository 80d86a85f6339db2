//! The access log: one JSON line per request, written by the `stages::rescue::Rescue` stage
//! once the answer's head is known — who asked (user, groups, the node and pod a bound
//! token names, source address, user agent), what (verb, resource, namespace, name), the
//! answer (code, who served it, the rule, level and flow, a refusal's reason, the bytes
//! admission expected it to cost), how long until the head, and the `Audit-Id` the answer
//! and the apiserver's audit log carry. A watch whose line was written gets a second line
//! when it ends (`"ended": true`, its lifetime in `seconds`), so that what a client held
//! open can be read back (`bulwark rules suggest` and `replay`). Refusals and 5xx are always written; other answers are
//! sampled at `accessLog.sample`. Refusals of requests that never identified anyone
//! (`unauthenticated`, `review_limited`) are the exception: anyone can send them, so one
//! client could rotate the whole log away with them. They are written at most
//! [`PER_PREFIX`] a second per client prefix (an IPv4 /24, an IPv6 /48) and [`IN_ALL`] a
//! second in all; the rest are counted in `bulwark_access_log_suppressed_total{reason}`.

use std::net::{IpAddr, SocketAddr};
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use lru::LruCache;
use prometheus::IntCounterVec;
use serde::Serialize;

use super::rotate::{Limits, LineFile};
use crate::classify::RequestInfo;
use crate::metrics::{Metrics, verb_label};
use crate::rules::client::{NODE_NAME_CLAIM, POD_NAME_CLAIM, POD_UID_CLAIM};
use crate::status::Reason;
use crate::user::User;

/// Lines a second of refusals that identified no one, per client prefix (a burst of ten).
pub const PER_PREFIX: u32 = 1;

/// Lines a second of refusals that identified no one, all prefixes together (a burst of
/// twice as many).
pub const IN_ALL: u32 = 100;

/// Client prefixes whose line rate is remembered; the least recently seen beyond this
/// start again with a full bucket (the bucket for all of them still holds).
const PREFIXES: usize = 4096;

/// The access log's file and sampling. Cheap to clone.
#[derive(Clone)]
pub struct AccessLog {
    file: LineFile,
    sample: f64,
    anonymous: Arc<AnonymousLines>,
}

/// The buckets of lines for refusals that identified no one.
struct AnonymousLines {
    prefixes: Mutex<LruCache<IpAddr, DefaultDirectRateLimiter>>,
    all: DefaultDirectRateLimiter,
    suppressed: IntCounterVec,
}

impl AnonymousLines {
    fn new(metrics: &Metrics) -> Self {
        let per_second = |n: u32, burst: u32| {
            Quota::per_second(NonZeroU32::new(n).expect("non-zero"))
                .allow_burst(NonZeroU32::new(burst).expect("non-zero"))
        };
        AnonymousLines {
            prefixes: Mutex::new(LruCache::new(
                NonZeroUsize::new(PREFIXES).expect("non-zero"),
            )),
            all: RateLimiter::direct(per_second(IN_ALL, 2 * IN_ALL)),
            suppressed: metrics.access_log_suppressed_total.clone(),
        }
    }

    /// Whether a line for a refusal from `source` may be written now.
    fn allow(&self, source: Option<SocketAddr>, reason: Reason) -> bool {
        let prefix = source.map(|s| crate::net::prefix_of(s.ip()));
        let allowed = prefix.is_none_or(|prefix| {
            let mut prefixes = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
            prefixes
                .get_or_insert(prefix, || {
                    RateLimiter::direct(
                        Quota::per_second(NonZeroU32::new(PER_PREFIX).expect("non-zero"))
                            .allow_burst(NonZeroU32::new(10).expect("non-zero")),
                    )
                })
                .check()
                .is_ok()
        }) && self.all.check().is_ok();
        if !allowed {
            self.suppressed.with_label_values(&[reason.as_str()]).inc();
        }
        allowed
    }
}

/// One request as its line says it.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    /// The `Audit-Id`.
    pub audit_id: &'a str,
    /// The user name, `-` when the request was refused before it was identified.
    pub user: &'a str,
    /// The user, once identified: its groups and the claims flows are keyed by.
    pub identity: Option<&'a User>,
    /// The flow admission put it in, once its rule matched.
    pub flow: Option<&'a str>,
    /// The bytes admission expected the answer to cost, once admitted.
    pub expected_bytes: Option<u64>,
    /// The client's address.
    pub source: Option<SocketAddr>,
    /// The client's `User-Agent` (cut).
    pub user_agent: &'a str,
    /// The HTTP method, when the request was not classified.
    pub method: &'a str,
    /// What it asked for, once classified.
    pub request: Option<&'a RequestInfo>,
    /// The answer's status code.
    pub code: u16,
    /// `upstream`, `cache` or `bulwark`.
    pub served_by: &'a str,
    /// The rule that matched, `""` when none.
    pub rule: &'a str,
    /// Its level, `""` when none.
    pub level: &'a str,
    /// Why Bulwark refused it, if it did.
    pub reason: Option<Reason>,
    /// From the request to the answer's head.
    pub took: Duration,
    /// Of that, how long it waited in its level's queue, when it waited.
    pub waited: Option<Duration>,
    /// Of that, how long it held its seats: from admission to the answer's head.
    pub held: Option<Duration>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Line<'a> {
    time: String,
    audit_id: &'a str,
    user: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    groups: Vec<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pod: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pod_uid: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<String>,
    #[serde(skip_serializing_if = "str::is_empty")]
    user_agent: &'a str,
    verb: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    subresource: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    path: Option<&'a str>,
    code: u16,
    served_by: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    rule: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    level: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expected_bytes: Option<u64>,
    seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    waited_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    held_seconds: Option<f64>,
    /// The share of such answers written, when not all are: rates read back from a sample
    /// are that much too low.
    #[serde(skip_serializing_if = "Option::is_none")]
    sample: Option<f64>,
}

/// The second line of a watch: when it ended, and how long it was open.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct EndLine<'a> {
    time: String,
    audit_id: &'a str,
    user: &'a str,
    verb: &'static str,
    ended: bool,
    seconds: f64,
}

/// Writes a watch's second line when dropped: hold it as long as the watch's body.
pub struct WatchEnd {
    log: AccessLog,
    audit_id: String,
    user: String,
    started: std::time::Instant,
}

impl Drop for WatchEnd {
    fn drop(&mut self) {
        let line = EndLine {
            time: humantime::format_rfc3339_micros(SystemTime::now()).to_string(),
            audit_id: &self.audit_id,
            user: &self.user,
            verb: "watch",
            ended: true,
            seconds: self.started.elapsed().as_secs_f64(),
        };
        self.log
            .file
            .write_line(serde_json::to_vec(&line).unwrap_or_default());
    }
}

impl AccessLog {
    /// Opens (creating) `path` for appending, rotated within `limits`, writing `sample` of
    /// the answered requests (every refusal and 5xx); lines that cannot be written are
    /// counted as `bulwark_log_lines_dropped_total{log="access"}`.
    pub fn open(
        path: &Path,
        sample: f64,
        limits: Limits,
        metrics: &Metrics,
    ) -> std::io::Result<AccessLog> {
        Ok(AccessLog {
            file: LineFile::open(path, limits, "access", metrics)?,
            sample: sample.clamp(0.0, 1.0),
            anonymous: Arc::new(AnonymousLines::new(metrics)),
        })
    }

    /// Writes the line of one request, unless the sample leaves it out; whether it did.
    pub fn record(&self, entry: &Entry<'_>) -> bool {
        let always = entry.reason.is_some() || entry.code >= 500;
        if !(always || self.sample >= 1.0 || rand::random::<f64>() < self.sample) {
            return false;
        }
        if let Some(reason @ (Reason::Unauthenticated | Reason::ReviewLimited)) = entry.reason
            && !self.anonymous.allow(entry.source, reason)
        {
            return false;
        }
        let sampled = (!always && self.sample < 1.0).then_some(self.sample);
        self.file
            .write_line(line(entry, SystemTime::now(), sampled));
        true
    }

    /// The guard that writes a watch's second line when dropped: made when its answer's
    /// head is sent, it times the watch from there.
    pub fn watch_end(&self, audit_id: &str, user: &str) -> WatchEnd {
        WatchEnd {
            log: self.clone(),
            audit_id: audit_id.to_owned(),
            user: user.to_owned(),
            started: std::time::Instant::now(),
        }
    }

    /// The file the lines go to, for SIGHUP's reopen and for flushing at shutdown.
    pub fn file(&self) -> &LineFile {
        &self.file
    }
}

fn line(entry: &Entry<'_>, now: SystemTime, sample: Option<f64>) -> Vec<u8> {
    let info = entry.request;
    let resource_request = info.is_some_and(|i| i.resource_request);
    let line = Line {
        time: humantime::format_rfc3339_micros(now).to_string(),
        audit_id: entry.audit_id,
        user: entry.user,
        groups: entry
            .identity
            .map(|u| u.groups.iter().map(String::as_str).collect())
            .unwrap_or_default(),
        node: claim(entry.identity, NODE_NAME_CLAIM),
        pod: claim(entry.identity, POD_NAME_CLAIM),
        pod_uid: claim(entry.identity, POD_UID_CLAIM),
        source: entry.source.map(|s| s.to_string()),
        user_agent: entry.user_agent,
        verb: info.map_or(entry.method, |i| verb_label(&i.verb)),
        group: info
            .filter(|i| resource_request && !i.api_group.is_empty())
            .map(|i| i.api_group.as_str()),
        resource: info
            .filter(|_| resource_request)
            .map(|i| i.resource.as_str()),
        subresource: info.and_then(|i| i.subresource.as_deref()),
        namespace: info.and_then(|i| i.namespace.as_deref()),
        name: info.and_then(|i| i.name.as_deref()),
        path: info.map(|i| i.path.as_str()),
        code: entry.code,
        served_by: entry.served_by,
        rule: entry.rule,
        level: entry.level,
        flow: entry.flow,
        reason: entry.reason.map(Reason::as_str),
        expected_bytes: entry.expected_bytes,
        seconds: entry.took.as_secs_f64(),
        waited_seconds: entry.waited.map(|w| w.as_secs_f64()),
        held_seconds: entry.held.map(|h| h.as_secs_f64()),
        sample,
    };
    serde_json::to_vec(&line).unwrap_or_default()
}

/// The one value of a claim in a user's extras (a bound token carries one of each).
fn claim<'a>(user: Option<&'a User>, key: &str) -> Option<&'a str> {
    match user?.extra.get(key)?.as_slice() {
        [value] => Some(value.as_str()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry<'a>(info: Option<&'a RequestInfo>, code: u16, reason: Option<Reason>) -> Entry<'a> {
        Entry {
            audit_id: "0a1b",
            user: "system:node:n1",
            identity: None,
            flow: None,
            expected_bytes: None,
            source: Some("10.0.0.7:51000".parse().unwrap()),
            user_agent: "kubelet/v1.36.0",
            method: "GET",
            request: info,
            code,
            served_by: if reason.is_some() {
                "bulwark"
            } else {
                "upstream"
            },
            rule: "nodes",
            level: "heartbeat",
            reason,
            took: Duration::from_micros(1500),
            waited: None,
            held: None,
        }
    }

    #[test]
    fn a_line_says_who_what_the_answer_and_its_audit_id() {
        let info = crate::classify::classify(
            &http::Method::GET,
            &"/apis/apps/v1/namespaces/team/deployments/web"
                .parse()
                .unwrap(),
        )
        .unwrap();
        let line = line(
            &entry(Some(&info), 429, Some(Reason::RateLimited)),
            SystemTime::UNIX_EPOCH,
            None,
        );
        let line: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(
            line,
            serde_json::json!({
                "time": "1970-01-01T00:00:00.000000Z",
                "auditId": "0a1b",
                "user": "system:node:n1",
                "source": "10.0.0.7:51000",
                "userAgent": "kubelet/v1.36.0",
                "verb": "get",
                "group": "apps",
                "resource": "deployments",
                "namespace": "team",
                "name": "web",
                "path": "/apis/apps/v1/namespaces/team/deployments/web",
                "code": 429,
                "servedBy": "bulwark",
                "rule": "nodes",
                "level": "heartbeat",
                "reason": "rate_limited",
                "seconds": 0.0015,
            })
        );
    }

    #[test]
    fn a_line_names_the_groups_claims_flow_and_cost_and_a_watch_gets_an_end_line() {
        let user = User {
            username: "system:serviceaccount:logging:fluent-bit".into(),
            uid: None,
            groups: vec![
                "system:serviceaccounts".into(),
                "system:authenticated".into(),
            ],
            extra: [
                (NODE_NAME_CLAIM, "node-7"),
                (POD_NAME_CLAIM, "fluent-bit-x2k"),
                (POD_UID_CLAIM, "0f6c4a1e-5b7d-4c38-9a55-3d0c2e8b1f42"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), vec![v.to_owned()]))
            .collect(),
        };
        let line = line(
            &Entry {
                user: &user.username,
                identity: Some(&user),
                flow: Some("logging-agents/system:serviceaccount:logging:fluent-bit/node:node-7"),
                expected_bytes: Some(4096),
                ..entry(None, 200, None)
            },
            SystemTime::UNIX_EPOCH,
            None,
        );
        let line: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(
            line["groups"],
            serde_json::json!(["system:serviceaccounts", "system:authenticated"])
        );
        assert_eq!(line["node"], "node-7");
        assert_eq!(line["pod"], "fluent-bit-x2k");
        assert_eq!(line["podUid"], "0f6c4a1e-5b7d-4c38-9a55-3d0c2e8b1f42");
        assert_eq!(
            line["flow"],
            "logging-agents/system:serviceaccount:logging:fluent-bit/node:node-7"
        );
        assert_eq!(line["expectedBytes"], 4096);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.jsonl");
        let log = AccessLog::open(&path, 1.0, Limits::new(1 << 20, 1), &Metrics::new()).unwrap();
        let end = log.watch_end("0a1b", "system:node:n1");
        log.file().flush();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "",
            "nothing before the end"
        );
        drop(end);
        log.file().flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let end: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(end["auditId"], "0a1b");
        assert_eq!(end["verb"], "watch");
        assert_eq!(end["ended"], true);
        assert!(end["seconds"].as_f64().unwrap() >= 0.0);
    }

    #[test]
    fn sampling_keeps_every_refusal_and_5xx_and_a_share_of_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.jsonl");
        let log = AccessLog::open(&path, 0.1, Limits::new(1 << 20, 1), &Metrics::new()).unwrap();
        for _ in 0..2_000 {
            log.record(&entry(None, 200, None));
        }
        for _ in 0..50 {
            log.record(&entry(None, 429, Some(Reason::QueueFull)));
            log.record(&entry(None, 503, None));
        }
        log.file().flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let codes: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["code"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(codes.iter().filter(|c| **c == 429).count(), 50);
        assert_eq!(codes.iter().filter(|c| **c == 503).count(), 50);
        let sampled = codes.iter().filter(|c| **c == 200).count();
        // A sampled line says so; a refusal, always written, does not.
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(
            lines
                .iter()
                .all(|l| (l["code"] == 200) == (l["sample"] == 0.1))
        );
        assert!((120..=280).contains(&sampled), "{sampled} of 2000 at 0.1");
    }

    #[test]
    fn refusals_that_identify_no_one_are_written_a_few_a_second_per_prefix_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.jsonl");
        let metrics = Metrics::new();
        let log = AccessLog::open(&path, 1.0, Limits::new(1 << 20, 1), &metrics).unwrap();
        let from = |ip: &str| Some(SocketAddr::new(ip.parse().unwrap(), 40_000));
        for _ in 0..1_000 {
            log.record(&Entry {
                source: from("198.51.100.7"),
                user: "-",
                ..entry(None, 401, Some(Reason::Unauthenticated))
            });
        }
        // Another address of the same /24 shares its bucket; another /24 has its own.
        for _ in 0..5 {
            log.record(&Entry {
                source: from("198.51.100.8"),
                ..entry(None, 401, Some(Reason::Unauthenticated))
            });
            log.record(&Entry {
                source: from("203.0.113.9"),
                ..entry(None, 429, Some(Reason::ReviewLimited))
            });
        }
        // An identified client's refusals are all written.
        for _ in 0..20 {
            log.record(&entry(None, 429, Some(Reason::QueueFull)));
        }
        log.file().flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let from_prefix = |p: &str| {
            lines
                .iter()
                .filter(|l| l["source"].as_str().is_some_and(|s| s.starts_with(p)))
                .count()
        };
        assert_eq!(
            from_prefix("198.51.100."),
            10,
            "a burst of ten, then a line a second"
        );
        assert_eq!(from_prefix("203.0.113."), 5);
        assert_eq!(
            lines.iter().filter(|l| l["reason"] == "queue_full").count(),
            20
        );
        let suppressed = metrics.render();
        assert!(
            suppressed
                .contains(r#"bulwark_access_log_suppressed_total{reason="unauthenticated"} 995"#),
            "{suppressed}"
        );
    }
}
