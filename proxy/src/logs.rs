//! Rate-limited log lines for refusals: one line per identity, rule and reason per interval,
//! and a bounded number of lines per interval overall, so a storm of 429s cannot flood the
//! log (the metrics count every refusal; the log names who and why).
//!
//! A line carries the identity's user name, rule, level, reason, the detail the client is not
//! told (which replica failed, why a token was rejected) and how many refusals were left
//! unlogged since the last line — never a token, a header or a body.
//!
//! File logs (the audit log, an access log) are written through [`rotate`], which keeps each
//! to a bounded number of bounded files.

pub mod access;
pub mod rotate;

use foldhash::{HashMap, HashMapExt as _};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::classify::RequestInfo;
use crate::metrics::verb_label;
use crate::status::Reason;

/// Rate limiting of refusal log lines. Shared by every request (`Arc` it).
#[derive(Debug)]
pub struct RejectionLog {
    interval: Duration,
    max_lines: u32,
    state: Mutex<State>,
    /// Hashes an identity, rule and reason into their key in `State::seen` (seeded at
    /// random, so that an identity cannot easily share another's key; if two did, their
    /// lines would be counted as one).
    keys: foldhash::fast::RandomState,
}

#[derive(Debug)]
struct State {
    /// When the current interval started.
    window_start: Instant,
    /// Lines written in the current interval.
    lines: u32,
    /// Identity, rule and reason already logged in the current interval (their hash: a
    /// collision only folds two into one line's count), with refusals left unlogged since.
    /// Hashed rather than copied: a storm's refusals are counted here one by one.
    seen: HashMap<u64, u64>,
    /// Refusals left unlogged in earlier intervals, reported on the next line.
    carried: u64,
}

/// One refusal to log.
#[derive(Clone, Copy)]
pub struct Rejection<'a> {
    /// The user name (`Identity::name`), never a credential.
    pub identity: &'a str,
    /// The rule that matched, or "" when none did.
    pub rule: &'a str,
    /// The priority level, or "".
    pub level: &'a str,
    /// Why.
    pub reason: Reason,
    /// What went wrong, for operators: the error behind the refusal, which may name a
    /// replica or a file the client's answer leaves out. Written out only for a line that
    /// is written: most refusals of a storm are counted, not logged.
    pub detail: &'a dyn std::fmt::Display,
    /// What the request asked for, once classified.
    pub request: Option<&'a RequestInfo>,
    /// The client's address (the PROXY header's, behind a trusted balancer).
    pub source: Option<SocketAddr>,
    /// The client's `User-Agent`, cut to [`USER_AGENT_MAX`] bytes.
    pub user_agent: &'a str,
    /// The `Audit-Id` the refusal was answered with.
    pub audit_id: &'a str,
}

/// The longest `User-Agent` a log line repeats.
pub const USER_AGENT_MAX: usize = 256;

impl RejectionLog {
    /// At most one line per identity, rule and reason per `interval`, and at most
    /// `max_lines` lines per `interval` in all.
    pub fn new(interval: Duration, max_lines: u32) -> RejectionLog {
        RejectionLog {
            interval,
            max_lines,
            state: Mutex::new(State {
                window_start: Instant::now(),
                lines: 0,
                seen: HashMap::new(),
                carried: 0,
            }),
            keys: foldhash::fast::RandomState::default(),
        }
    }

    /// Logs the refusal at `info` unless its line is rate-limited.
    pub fn rejected(&self, rejection: Rejection<'_>) {
        if let Some(suppressed) = self.admit(&rejection) {
            let info = rejection.request;
            let resource = info.map(|i| {
                if i.resource_request {
                    i.resource.as_str()
                } else {
                    i.path.as_str()
                }
            });
            tracing::info!(
                identity = rejection.identity,
                rule = rejection.rule,
                level = rejection.level,
                reason = rejection.reason.as_str(),
                detail = %rejection.detail,
                verb = info.map(|i| verb_label(&i.verb)),
                resource,
                group = info.map(|i| i.api_group.as_str()).filter(|g| !g.is_empty()),
                subresource = info.and_then(|i| i.subresource.as_deref()),
                namespace = info.and_then(|i| i.namespace.as_deref()),
                name = info.and_then(|i| i.name.as_deref()),
                source = rejection.source.map(tracing::field::display),
                user_agent = rejection.user_agent,
                audit_id = rejection.audit_id,
                suppressed,
                "request rejected"
            );
        }
    }

    /// Whether to write a line now; `Some(n)` with the number of refusals (of any identity)
    /// left unlogged since the previous line.
    fn admit(&self, rejection: &Rejection<'_>) -> Option<u64> {
        let now = Instant::now();
        // A poisoned lock only means another thread panicked mid-update; the counts are
        // still usable for rate limiting.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now.duration_since(state.window_start) >= self.interval {
            let unlogged: u64 = state.seen.values().sum();
            state.carried += unlogged;
            state.seen.clear();
            state.lines = 0;
            state.window_start = now;
        }
        let key = {
            use std::hash::BuildHasher as _;
            self.keys
                .hash_one((rejection.identity, rejection.rule, rejection.reason))
        };
        if let Some(unlogged) = state.seen.get_mut(&key) {
            *unlogged += 1;
            return None;
        }
        if state.lines >= self.max_lines {
            state.carried += 1;
            return None;
        }
        state.lines += 1;
        state.seen.insert(key, 0);
        Some(std::mem::take(&mut state.carried))
    }
}

impl Default for RejectionLog {
    /// One line per identity, rule and reason per 10 s; at most 100 lines per 10 s.
    fn default() -> Self {
        RejectionLog::new(Duration::from_secs(10), 100)
    }
}

/// Sets the process's log filter; installed by the binary, which owns the subscriber.
pub type LevelSetter = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The log filter in force and how to change it.
struct LevelControl {
    current: Mutex<String>,
    set: LevelSetter,
}

static LEVEL: std::sync::OnceLock<LevelControl> = std::sync::OnceLock::new();

/// Makes the log filter changeable at run time (`PUT /debug/log-level`): `current` is the
/// filter in force (`RUST_LOG`'s directives, or `info`). Only the first call counts.
pub fn install_level_control(current: String, set: LevelSetter) {
    let _ = LEVEL.set(LevelControl {
        current: Mutex::new(current),
        set,
    });
}

/// The log filter in force, when it can be changed.
pub fn log_level() -> Option<String> {
    let control = LEVEL.get()?;
    Some(
        control
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    )
}

/// Changes the log filter to `directives` (`debug`, `info,bulwark::admit=debug`): the old
/// filter stays when they do not parse.
pub fn set_log_level(directives: &str) -> Result<(), String> {
    let control = LEVEL
        .get()
        .ok_or_else(|| "this process's log filter cannot be changed".to_string())?;
    let directives = directives.trim();
    if directives.is_empty() {
        return Err("an empty log filter; send e.g. `debug` or `info,bulwark::admit=debug`".into());
    }
    (control.set)(directives)?;
    *control.current.lock().unwrap_or_else(|p| p.into_inner()) = directives.to_owned();
    tracing::warn!(filter = directives, "log filter changed");
    Ok(())
}

/// Parses a log filter for [`set_log_level`] (and `RUST_LOG` at start). Field values in
/// span filters (`[span{field=value}]`) are matched literally: as regular expressions, a
/// filter under 100 bytes took seconds and hundreds of MB to compile and stalled the admin
/// listener, so a value that reads as one is refused, saying why.
pub fn parse_filter(directives: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    if let Some(c) = directives
        .chars()
        .find(|c| matches!(c, '(' | ')' | '|' | '*' | '+' | '?' | '\\' | '^' | '$'))
    {
        return Err(format!(
            "{c:?} in a log filter: field values are matched literally, regular expressions \
             are not accepted"
        ));
    }
    let mut depth = 0u32;
    for c in directives.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if depth > 1 {
            return Err(
                "nested braces in a log filter: field values are matched literally, \
                 regular expressions are not accepted"
                    .into(),
            );
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .with_regex(false)
        .parse(directives)
        .map_err(|e| format!("{directives:?} is not a log filter: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_filter_with_a_regular_expression_is_refused_and_a_literal_field_is_kept() {
        // Under 100 bytes: as a regex, a DFA that doubles with every dot (a minute to
        // compile in a debug build).
        let hostile = "info,bulwark[request{user=.*a................}]=trace";
        let refused = parse_filter(hostile).unwrap_err();
        assert!(refused.contains("regular expressions"), "{refused}");
        assert!(parse_filter("info,bulwark[request{user=(a|b)}]=trace").is_err());
        // Dots alone are literal dots now, and cheap.
        assert!(parse_filter("info,bulwark[request{user=a.........}]=trace").is_ok());
        assert!(parse_filter("info,bulwark[request{user=x{2}}]=debug").is_err());
        assert!(parse_filter("info,bulwark::admit=debug").is_ok());
        assert!(parse_filter("info,bulwark[request{user=alice}]=debug").is_ok());
        assert!(parse_filter("info,=nonsense=").is_err());
    }

    fn rejection<'a>(identity: &'a str, reason: Reason) -> Rejection<'a> {
        Rejection {
            identity,
            rule: "secret-lists",
            level: "list-heavy",
            reason,
            detail: &"waited 15s",
            request: None,
            source: None,
            user_agent: "",
            audit_id: "",
        }
    }

    #[tokio::test(start_paused = true)]
    async fn one_line_per_identity_rule_and_reason_per_interval() {
        let log = RejectionLog::new(Duration::from_secs(10), 100);
        assert_eq!(log.admit(&rejection("alice", Reason::QueueFull)), Some(0));
        for _ in 0..50 {
            assert_eq!(log.admit(&rejection("alice", Reason::QueueFull)), None);
        }
        // Another identity or reason gets its own line.
        assert_eq!(log.admit(&rejection("bob", Reason::QueueFull)), Some(0));
        assert_eq!(log.admit(&rejection("alice", Reason::RateLimited)), Some(0));
        tokio::time::advance(Duration::from_secs(10)).await;
        // The next line reports the 50 refusals that were not logged.
        assert_eq!(log.admit(&rejection("alice", Reason::QueueFull)), Some(50));
        assert_eq!(log.admit(&rejection("bob", Reason::QueueFull)), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn many_identities_share_a_bounded_number_of_lines() {
        let log = RejectionLog::new(Duration::from_secs(10), 3);
        let names: Vec<String> = (0..1000).map(|i| format!("node-{i}")).collect();
        let written = names
            .iter()
            .filter(|n| log.admit(&rejection(n, Reason::RateLimited)).is_some())
            .count();
        assert_eq!(written, 3);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(
            log.admit(&rejection("node-0", Reason::RateLimited)),
            Some(997)
        );
    }

    /// The line itself: names identity, rule, reason and detail, and nothing else of the
    /// request.
    #[test]
    fn the_line_names_identity_rule_and_reason() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(move || writer.clone())
            .finish();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        tracing::subscriber::with_default(subscriber, || {
            runtime.block_on(async {
                let log = RejectionLog::default();
                let info = crate::classify::classify(
                    &http::Method::GET,
                    &"/api/v1/namespaces/team/secrets?limit=500".parse().unwrap(),
                )
                .unwrap();
                let line = Rejection {
                    request: Some(&info),
                    source: Some("10.1.2.3:40112".parse().unwrap()),
                    user_agent: "kubectl/v1.36.0",
                    audit_id: "5f0c3a4e-0000-4000-8000-000000000001",
                    ..rejection("system:node:n1", Reason::QueueTimeout)
                };
                log.rejected(line);
                log.rejected(line);
            })
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON line"))
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        let fields = &lines[0]["fields"];
        assert_eq!(fields["message"], "request rejected");
        assert_eq!(fields["identity"], "system:node:n1");
        assert_eq!(fields["rule"], "secret-lists");
        assert_eq!(fields["level"], "list-heavy");
        assert_eq!(fields["reason"], "queue_timeout");
        assert_eq!(fields["detail"], "waited 15s");
        assert_eq!(fields["suppressed"], 0);
        assert_eq!(fields["verb"], "list");
        assert_eq!(fields["resource"], "secrets");
        assert_eq!(fields["namespace"], "team");
        assert_eq!(fields["source"], "10.1.2.3:40112");
        assert_eq!(fields["user_agent"], "kubectl/v1.36.0");
        assert_eq!(fields["audit_id"], "5f0c3a4e-0000-4000-8000-000000000001");
        assert!(fields.get("name").is_none(), "a list names no object");
    }
}
