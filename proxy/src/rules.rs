//! Rule files: which priority level and flow each request belongs to (DESIGN.md step 5).
//!
//! A folder of YAML files (schema in `rules/README.md`) is read, parsed, validated and
//! compiled into an immutable [`RuleSet`]; [`RuleSet::matches`] picks the first rule by
//! precedence, the built-in catch-all last. [`Rules`] holds the running set and swaps in a
//! new one when the folder changes or on SIGHUP, only once it validated.
//!
//! The stages stay apart: [`load`] does the I/O (which files, size limits), `validate`
//! parses and checks them with every problem reported at once as `file:line:column:
//! message`, `matcher` decides matches, `reload` watches the folder.

mod builtin;
pub mod client;
mod discovery;
mod lint;
pub mod load;
mod matcher;
mod parse;
mod reload;
mod schema;
pub(crate) mod spans;
pub mod types;
mod validate;

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Method;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub use builtin::{CATCH_ALL, EXEMPT};
pub use reload::Rules;
pub use types::*;

use crate::classify::{RequestInfo, Verb};
use crate::identity::User;
use client::{Client, Fallback};
use matcher::Matcher;

/// One problem with the rules: where it is and what is wrong.
///
/// Displayed as `file:line:column: message`, or `folder: message` for a problem with the
/// folder itself (`line` 0).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct RuleProblem {
    /// The file (or folder) with the problem.
    pub file: PathBuf,
    /// 1-based line; 0 when the problem is not in a file.
    pub line: usize,
    /// 1-based column; 0 when the problem is not in a file.
    pub column: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for RuleProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                self.line,
                self.column,
                self.message
            )
        }
    }
}

impl RuleProblem {
    /// The problem as a warning line: `file:line:column: warning: message`.
    pub fn warning_line(&self) -> String {
        if self.line == 0 {
            format!("{}: warning: {}", self.file.display(), self.message)
        } else {
            format!(
                "{}:{}:{}: warning: {}",
                self.file.display(),
                self.line,
                self.column,
                self.message
            )
        }
    }
}

/// A rule file's name and text, as read from the folder.
#[derive(Debug, Clone)]
pub struct Source {
    /// The file's path, as shown in messages.
    pub path: PathBuf,
    /// Its content.
    pub text: String,
}

/// A compiled rule.
#[derive(Debug, Clone)]
pub(crate) struct CompiledRule {
    name: Arc<str>,
    /// Lower first; `u32::MAX` for the catch-all.
    precedence: u32,
    /// File and line of its name; `None` when built in.
    source: Option<(PathBuf, usize)>,
    matcher: Matcher,
    level: Arc<LevelSpec>,
    flow: FlowBy,
    rate: Option<Rate>,
    watches: Option<u32>,
    mode: Mode,
    staleness: Option<Duration>,
    headers: RuleHeaders,
}

/// The parts of a flow key put together, in one allocation.
fn flow_key(parts: &[&str]) -> Arc<str> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len <= FLOW_KEY_ON_STACK {
        // Put together on the stack, so that the key's one allocation is its own.
        let mut flow = [0u8; FLOW_KEY_ON_STACK];
        let mut at = 0;
        for part in parts {
            flow[at..at + part.len()].copy_from_slice(part.as_bytes());
            at += part.len();
        }
        if let Ok(flow) = std::str::from_utf8(&flow[..len]) {
            return Arc::from(flow);
        }
    }
    Arc::from(parts.concat())
}

/// The longest flow key [`flow_key`] puts together without a buffer on the heap.
const FLOW_KEY_ON_STACK: usize = 192;

/// `rule/user/node:NAME`, `rule/user/pod:UID` or `rule/user/addr:IP`: the user stays in
/// the key, so that two identities on one node (kube-proxy and a CNI agent) are two flows.
/// Neither a rule name nor a client has a `/`, so the key says which user and which client
/// it is whatever the user name holds.
fn client_key(rule: &str, user: &str, client: Client<'_>) -> Arc<str> {
    use std::io::Write;
    // Room for the longest address text, 45 bytes (an IPv6 address with an IPv4 tail).
    let mut addr = [0u8; 48];
    let (kind, name) = match client {
        Client::Node(name) => ("/node:", name),
        Client::Pod(uid) => ("/pod:", uid),
        Client::Addr(None) => ("/addr:", "unknown"),
        Client::Addr(Some(ip)) => {
            let mut rest = &mut addr[..];
            let _ = write!(rest, "{ip}");
            let written = 48 - rest.len();
            (
                "/addr:",
                std::str::from_utf8(&addr[..written]).unwrap_or("unknown"),
            )
        }
    };
    flow_key(&[rule, "/", user, kind, name])
}

impl CompiledRule {
    /// What admission needs of this rule for `user`'s request from `source`, in `mode`
    /// (the rule's own, or shadow when `rules.mode` says so).
    fn matched(
        &self,
        user: &User,
        info: &RequestInfo,
        source: Option<IpAddr>,
        mode: Mode,
    ) -> Matched {
        Matched {
            rule: self.name.clone(),
            level: self.level.clone(),
            flow: self.flow_of(user, info, source).0,
            rate: self.rate,
            watches: self.watches,
            mode,
            staleness: self.staleness,
            headers: self.headers.clone(),
        }
    }

    /// The flow key of a request, and for a rule keyed per client why its client is its
    /// source address when it is.
    fn flow_of(
        &self,
        user: &User,
        info: &RequestInfo,
        source: Option<IpAddr>,
    ) -> (Arc<str>, Option<Fallback>) {
        match self.flow {
            FlowBy::User => (flow_key(&[&self.name, "/", &user.username]), None),
            FlowBy::Namespace => (
                flow_key(&[&self.name, "/", info.namespace.as_deref().unwrap_or("")]),
                None,
            ),
            FlowBy::None => (self.name.clone(), None),
            FlowBy::Node | FlowBy::Pod => {
                let (client, fallback) = client::client_of(self.flow, user, source);
                (client_key(&self.name, &user.username, client), fallback)
            }
        }
    }

    /// `precedence 500, team.yaml:7` or `built-in`.
    fn origin(&self) -> String {
        let precedence = if self.precedence == u32::MAX {
            "after all others".to_owned()
        } else {
            format!("precedence {}", self.precedence)
        };
        match &self.source {
            Some((path, line)) => {
                let name = path.file_name().unwrap_or(path.as_os_str());
                format!("{precedence}, {}:{line}", name.to_string_lossy())
            }
            None => format!("{precedence}, built-in"),
        }
    }

    fn to_json(&self) -> Value {
        let mut rule = json!({
            "name": &*self.name,
            "precedence": (self.precedence != u32::MAX).then_some(self.precedence),
            "source": match &self.source {
                Some((path, line)) => format!("{}:{line}", path.display()),
                None => builtin::BUILTIN_SOURCE.to_owned(),
            },
            "match": self.matcher.to_json(),
            "level": self.level.name,
            "flow": flow_name(self.flow),
            "mode": mode_name(self.mode),
        });
        if let Some(rate) = self.rate {
            rule["rate"] = json!({"qps": rate.qps, "burst": rate.burst});
        }
        if let Some(watches) = self.watches {
            rule["watches"] = json!(watches);
        }
        if let Some(staleness) = self.staleness {
            rule["staleness"] = json!(humantime::format_duration(staleness).to_string());
        }
        rule
    }
}

fn flow_name(flow: FlowBy) -> &'static str {
    match flow {
        FlowBy::User => "user",
        FlowBy::Namespace => "namespace",
        FlowBy::None => "none",
        FlowBy::Node => "node",
        FlowBy::Pod => "pod",
    }
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Enforce => "enforce",
        Mode::Shadow => "shadow",
    }
}

fn level_json(level: &LevelSpec) -> Value {
    if level.exempt {
        return json!({"name": level.name, "exempt": true});
    }
    json!({
        "name": level.name,
        "exempt": false,
        "seats": level.seats,
        "queues": level.queues,
        "handSize": level.hand_size,
        "queueLength": level.queue_length,
        "maxWait": humantime::format_duration(level.max_wait).to_string(),
    })
}

fn level_text(level: &LevelSpec) -> String {
    if level.exempt {
        return format!("{} (exempt: no limits)", level.name);
    }
    format!(
        "{} (seats {}, queues {}, handSize {}, queueLength {}, maxWait {})",
        level.name,
        level.seats,
        level.queues,
        level.hand_size,
        level.queue_length,
        humantime::format_duration(level.max_wait)
    )
}

/// An immutable compiled snapshot of the rules.
#[derive(Debug)]
pub struct RuleSet {
    levels: Vec<Arc<LevelSpec>>,
    /// By precedence, lowest first; the catch-all is not among them.
    rules: Vec<CompiledRule>,
    catch_all: CompiledRule,
    files: Vec<PathBuf>,
    hash: String,
    loaded_at: SystemTime,
    /// `rules.mode`: `Shadow` puts every rule in shadow mode, `Enforce` leaves each its own.
    mode: Mode,
}

impl From<crate::config::RulesMode> for Mode {
    fn from(mode: crate::config::RulesMode) -> Mode {
        match mode {
            crate::config::RulesMode::Enforce => Mode::Enforce,
            crate::config::RulesMode::Shadow => Mode::Shadow,
        }
    }
}

impl RuleSet {
    /// Reads, parses and validates every rule file of `dir`; every problem at once.
    pub fn load_dir(dir: &Path) -> Result<RuleSet, Vec<RuleProblem>> {
        let (sources, mut problems) = load::read_folder(dir);
        match RuleSet::from_sources(&sources) {
            Ok(set) if problems.is_empty() => Ok(set),
            Ok(_) => Err(problems),
            Err(more) => {
                // Problems from unreadable files first, then the rest, in file order.
                problems.extend(more);
                problems
                    .sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
                Err(problems)
            }
        }
    }

    /// Parses and validates rule files already read (no I/O); every problem at once.
    pub fn from_sources(sources: &[Source]) -> Result<RuleSet, Vec<RuleProblem>> {
        RuleSet::from_parsed(sources, parse_sources(sources))
    }

    fn from_parsed(sources: &[Source], parsed: ParsedSources) -> Result<RuleSet, Vec<RuleProblem>> {
        let ParsedSources {
            files: parsed,
            mut problems,
            levels_lost,
        } = parsed;
        match validate::build(&parsed, levels_lost) {
            Ok(_) if !problems.is_empty() => Err(problems),
            Ok((levels, rules)) => Ok(RuleSet::new(
                levels,
                rules,
                sources.iter().map(|s| s.path.clone()).collect(),
            )),
            Err(more) => {
                problems.extend(more);
                Err(problems)
            }
        }
    }

    /// The built-in set alone: `exempt` and `catch-all` levels, the heartbeat rules and the
    /// catch-all rule.
    pub fn builtin() -> RuleSet {
        match validate::build(&[validate::builtin_file()], false) {
            Ok((levels, rules)) => RuleSet::new(levels, rules, Vec::new()),
            // The built-in rules are tested to validate; never serve without a catch-all.
            Err(_) => {
                let levels = vec![
                    Arc::new(builtin::exempt_level()),
                    Arc::new(builtin::catch_all_level()),
                ];
                RuleSet::new(levels, Vec::new(), Vec::new())
            }
        }
    }

    fn new(levels: Vec<Arc<LevelSpec>>, rules: Vec<CompiledRule>, files: Vec<PathBuf>) -> Self {
        let catch_all = validate::catch_all_rule(&levels);
        let mut set = RuleSet {
            levels,
            rules,
            catch_all,
            files,
            hash: String::new(),
            loaded_at: SystemTime::now(),
            mode: Mode::Enforce,
        };
        let digest = Sha256::digest(set.content_json(false).to_string().as_bytes());
        set.hash = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        set
    }

    /// The set under `rules.mode`: with [`Mode::Shadow`] every rule (the built-in ones
    /// included) only counts what its limits would refuse, whatever its own `mode`; with
    /// [`Mode::Enforce`] each rule keeps its own. Not part of the hash, which is the
    /// folder's.
    pub fn with_mode(mut self, mode: Mode) -> RuleSet {
        self.mode = mode;
        self
    }

    /// `rules.mode` over this set: [`Mode::Enforce`] unless [`RuleSet::with_mode`] said
    /// otherwise.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The mode a rule runs in under `rules.mode`.
    fn mode_of(&self, rule: &CompiledRule) -> Mode {
        match self.mode {
            Mode::Shadow => Mode::Shadow,
            Mode::Enforce => rule.mode,
        }
    }

    /// The rule a request matches: the first by precedence, the catch-all last. Without
    /// the client's address ([`RuleSet::matches_from`] has it), a `node` or `pod` flow whose
    /// client names no node or pod is keyed `addr:unknown`.
    pub fn matches(&self, user: &User, info: &RequestInfo) -> Matched {
        self.matches_from(user, info, None)
    }

    /// [`RuleSet::matches`] for a request from `source`, the client's address (the one a
    /// trusted balancer's PROXY header carries, else the peer's), which keys the flows of
    /// `flow: node` and `flow: pod` rules whose client names no node or pod.
    pub fn matches_from(&self, user: &User, info: &RequestInfo, source: Option<IpAddr>) -> Matched {
        let rule = self.rule_for(user, info);
        rule.matched(user, info, source, self.mode_of(rule))
    }

    fn rule_for(&self, user: &User, info: &RequestInfo) -> &CompiledRule {
        self.rules
            .iter()
            .find(|r| r.matcher.matches(user, info))
            .unwrap_or(&self.catch_all)
    }

    /// Every level, the built-in ones included.
    pub fn levels(&self) -> &[Arc<LevelSpec>] {
        &self.levels
    }

    /// A hash of the compiled content (16 hex digits): equal for sets that behave the same.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// When this set was built.
    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }

    /// The names of the rules, lowest precedence first, the catch-all last.
    pub fn rule_names(&self) -> Vec<&str> {
        self.rules
            .iter()
            .chain(std::iter::once(&self.catch_all))
            .map(|r| &*r.name)
            .collect()
    }

    /// Why `verb path` by `user` lands where it does: the matching rule, its level and
    /// flow, and for every rule tried before it, which fields did not match.
    pub fn explain(&self, user: &User, verb: &str, path: &str) -> String {
        match request_for(verb, path) {
            Ok(info) => self.explain_request(user, &info),
            Err(e) => format!("cannot explain {verb} {path}: {e}\n"),
        }
    }

    /// [`RuleSet::explain`] for a classified request.
    pub fn explain_request(&self, user: &User, info: &RequestInfo) -> String {
        self.explain_from(user, info, None)
    }

    /// [`RuleSet::explain_request`] for a request from `source`: the address that keys a
    /// per-client flow whose client names no node or pod.
    pub fn explain_from(&self, user: &User, info: &RequestInfo, source: Option<IpAddr>) -> String {
        use std::fmt::Write;
        let rule = self.rule_for(user, info);
        let (flow, fallback) = rule.flow_of(user, info, source);
        let mode = self.mode_of(rule);
        let mut out = String::new();
        let query = if info.query.raw.is_empty() {
            String::new()
        } else {
            format!("?{}", info.query.raw)
        };
        let _ = writeln!(
            out,
            "request: {} {}{query}",
            matcher::verb_name(&info.verb),
            info.path
        );
        let _ = writeln!(
            out,
            "user: {} (groups: {})",
            user.username,
            user.groups.join(", ")
        );
        let _ = writeln!(out, "matched: rule {} ({})", rule.name, rule.origin());
        let _ = writeln!(out, "  level: {}", level_text(&rule.level));
        let _ = write!(out, "  flow: {}, key {flow}", flow_name(rule.flow));
        match (fallback, source) {
            (Some(why), Some(_)) => {
                let _ = writeln!(out, " ({why}: keyed by source address)");
            }
            (Some(why), None) => {
                let _ = writeln!(
                    out,
                    " ({why}: keyed by source address, unknown without --source)"
                );
            }
            (None, _) => {
                let _ = writeln!(out);
            }
        }
        if let Some(rate) = rule.rate {
            let _ = writeln!(out, "  rate: {} qps, burst {}", rate.qps, rate.burst);
        }
        if let Some(watches) = rule.watches {
            let _ = writeln!(out, "  watches: {watches} per flow");
        }
        if mode == rule.mode {
            let _ = writeln!(out, "  mode: {}", mode_name(rule.mode));
        } else {
            let _ = writeln!(
                out,
                "  mode: {} (rules.mode: {} in Bulwark's configuration overrides the rule's {})",
                mode_name(mode),
                mode_name(self.mode),
                mode_name(rule.mode)
            );
        }
        if let Some(staleness) = rule.staleness {
            let _ = writeln!(
                out,
                "  staleness: {}",
                humantime::format_duration(staleness)
            );
        }
        let tried: Vec<&CompiledRule> = self
            .rules
            .iter()
            .take_while(|r| !std::ptr::eq(*r, rule))
            .collect();
        if tried.is_empty() {
            let _ = writeln!(out, "no rule comes before it");
        } else {
            let _ = writeln!(out, "rules tried before it, and why they did not match:");
            for r in tried {
                let _ = writeln!(out, "  {} ({}):", r.name, r.origin());
                for why in r.matcher.mismatches(user, info) {
                    let _ = writeln!(out, "    {why}");
                }
            }
        }
        out
    }

    /// The loaded snapshot for `/debug/rules`: hash, load time, files, levels, rules (each
    /// with the file and line it came from).
    pub fn to_json(&self) -> Value {
        let mut value = self.content_json(true);
        value["hash"] = json!(self.hash);
        value["mode"] = json!(mode_name(self.mode));
        value["loadedAt"] = json!(humantime::format_rfc3339_seconds(self.loaded_at).to_string());
        value["files"] = json!(
            self.files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
        );
        value
    }

    /// Levels and rules; without sources, what the set does whatever file it came from:
    /// the input of the hash.
    fn content_json(&self, with_sources: bool) -> Value {
        let mut rules: Vec<Value> = self.rules.iter().map(CompiledRule::to_json).collect();
        rules.push(self.catch_all.to_json());
        if !with_sources {
            for rule in &mut rules {
                if let Some(obj) = rule.as_object_mut() {
                    obj.remove("source");
                }
            }
        }
        json!({
            "levels": self.levels.iter().map(|l| level_json(l)).collect::<Vec<_>>(),
            "rules": rules,
        })
    }
}

/// The method a verb arrives with, for classifying `explain`'s request.
fn method_for(verb: &str) -> Option<Method> {
    Some(match verb {
        "get" | "list" | "watch" => Method::GET,
        "create" | "post" => Method::POST,
        "update" | "put" => Method::PUT,
        "patch" => Method::PATCH,
        "delete" | "deletecollection" => Method::DELETE,
        "head" => Method::HEAD,
        "options" => Method::OPTIONS,
        _ => return None,
    })
}

/// Why `verb path` is not a request `explain` can speak of.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The verb is none the rules know.
    #[error("unknown verb {verb:?}, expected one of {}", matcher::VERBS.join(", "))]
    UnknownVerb {
        /// The verb given.
        verb: String,
    },
    /// The path is not a request target.
    #[error("invalid path {path:?}")]
    InvalidPath {
        /// The path given.
        path: String,
        /// Why.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// The request is one the proxy would refuse as malformed.
    #[error(transparent)]
    Classify(#[from] crate::classify::ClassifyError),
    /// The verb does not fit the path (a list of a named object, a get of a collection).
    #[error(
        "{path} with {verb} is a {got} request (a list or watch takes a collection path, a get a named object)"
    )]
    VerbMismatch {
        /// The path given.
        path: String,
        /// The verb given.
        verb: String,
        /// The verb the path and method make.
        got: &'static str,
    },
}

/// Classifies `verb path` as the request a client would send: `path` may carry a query;
/// `watch` on a collection is a watch, as `?watch=true` would make it.
pub fn request_for(verb: &str, path: &str) -> Result<RequestInfo, RequestError> {
    let method = method_for(verb).ok_or_else(|| RequestError::UnknownVerb {
        verb: verb.to_owned(),
    })?;
    let uri: http::Uri = path.parse().map_err(|source| RequestError::InvalidPath {
        path: path.to_owned(),
        source,
    })?;
    let mut info = crate::classify::classify(&method, &uri)?;
    if verb == "watch" && info.verb == Verb::List {
        info.verb = Verb::Watch;
    }
    let got = matcher::verb_name(&info.verb);
    if info.resource_request && got != verb {
        return Err(RequestError::VerbMismatch {
            path: path.to_owned(),
            verb: verb.to_owned(),
            got,
        });
    }
    Ok(info)
}

/// Why `explain` has no answer.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// The folder's rules are invalid; one line per problem.
    #[error("{}", .0.iter().map(|p| format!("{p}\n")).collect::<String>())]
    Rules(Vec<RuleProblem>),
    /// The request cannot be classified.
    #[error(transparent)]
    Request(#[from] RequestError),
}

/// Every file parsed, the built-in rules first: what validation takes.
struct ParsedSources {
    files: Vec<validate::Parsed>,
    problems: Vec<RuleProblem>,
    /// Some levels may be missing (a file or a level entry did not parse).
    levels_lost: bool,
}

fn parse_sources(sources: &[Source]) -> ParsedSources {
    let mut out = ParsedSources {
        files: vec![validate::builtin_file()],
        problems: Vec::new(),
        levels_lost: false,
    };
    for source in sources {
        let outcome = parse::parse(source);
        out.files.extend(outcome.parsed);
        out.problems.extend(outcome.problems);
        out.levels_lost |= outcome.levels_lost;
    }
    out
}

/// What `bulwark rules check DIR` found: every error of every file, and the warnings.
#[derive(Debug)]
pub struct Checked {
    /// A one-line summary when the folder is valid (warnings or not).
    pub summary: Option<String>,
    /// Every problem that refuses the folder, in file order.
    pub errors: Vec<RuleProblem>,
    /// Rules that load but cannot do what they say: unreachable ones, groups and resources
    /// no apiserver serves, staleness above `max_staleness`, shadow rules without limits.
    pub warnings: Vec<RuleProblem>,
}

/// `bulwark rules check DIR`: reads and validates the folder as `serve` would, and warns on
/// what loads but cannot work. `max_staleness` is the cache's cap (`cache.maxStaleness`).
pub fn check(dir: &Path, max_staleness: Duration) -> Checked {
    let (sources, read_problems) = load::read_folder(dir);
    let parsed = parse_sources(&sources);
    let warnings = lint::warnings(&parsed.files, max_staleness);
    let result = RuleSet::from_parsed(&sources, parsed);
    let mut errors = read_problems;
    let summary = match result {
        Ok(set) if errors.is_empty() => Some(format!(
            "{}: {} files, {} levels, {} rules, hash {}\n",
            dir.display(),
            set.files.len(),
            set.levels.len(),
            set.rules.len() + 1,
            set.hash
        )),
        Ok(_) => None,
        Err(more) => {
            errors.extend(more);
            None
        }
    };
    errors.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
    Checked {
        summary,
        errors,
        warnings,
    }
}

/// `bulwark rules explain DIR --user U [--group G]... [--extra K=V]... [--source ADDR]
/// VERB PATH`, for `user` (see [`cli_user`]) connecting from `source`, under `mode`
/// (Bulwark's `rules.mode`).
pub fn explain_dir(
    dir: &Path,
    mode: Mode,
    user: &User,
    source: Option<IpAddr>,
    verb: &str,
    path: &str,
) -> Result<String, ExplainError> {
    let set = RuleSet::load_dir(dir)
        .map_err(ExplainError::Rules)?
        .with_mode(mode);
    let info = request_for(verb, path)?;
    Ok(set.explain_from(user, &info, source))
}

/// The user `explain` speaks of, with the groups authentication adds: the user gets
/// `system:authenticated`, and a ServiceAccount user its `system:serviceaccounts` groups.
pub fn cli_user(name: &str, groups: &[String]) -> User {
    let mut all: Vec<String> = groups.to_vec();
    if let Some(namespace) = name
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
        .map(|(ns, _)| ns)
    {
        for group in [
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{namespace}"),
        ] {
            if !all.contains(&group) {
                all.push(group);
            }
        }
    }
    User {
        username: name.to_owned(),
        uid: None,
        groups: all,
        extra: Default::default(),
    }
    .with_authenticated_group()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_key_is_the_rule_and_the_key_however_long() {
        assert_eq!(
            &*flow_key(&["nodes", "/", "system:node:n-1"]),
            "nodes/system:node:n-1"
        );
        assert_eq!(&*flow_key(&["ns", "/", ""]), "ns/");
        assert_eq!(&*flow_key(&["r", "/", "ü-ser"]), "r/ü-ser");
        let long = "u".repeat(FLOW_KEY_ON_STACK);
        assert_eq!(&*flow_key(&["rule", "/", &long]), format!("rule/{long}"));
    }

    #[test]
    fn a_client_key_names_its_kind_so_a_node_named_like_an_address_is_not_that_address() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let addr = client_key("r", "u", Client::Addr(Some(ip)));
        assert_eq!(&*addr, "r/u/addr:10.0.0.1");
        // `10.0.0.1` is a DNS subdomain, so a claim may name such a node.
        assert_eq!(
            &*client_key("r", "u", Client::Node("10.0.0.1")),
            "r/u/node:10.0.0.1"
        );
        assert_eq!(
            &*client_key("r", "u", Client::Pod("10.0.0.1")),
            "r/u/pod:10.0.0.1"
        );
        assert_eq!(
            &*client_key("r", "u", Client::Addr(None)),
            "r/u/addr:unknown"
        );
        let v6: IpAddr = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap();
        assert_eq!(
            &*client_key("r", "u", Client::Addr(Some(v6))),
            "r/u/addr:ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
        );
        let long = "u".repeat(FLOW_KEY_ON_STACK);
        assert_eq!(
            &*client_key("r", &long, Client::Node("n1")),
            format!("r/{long}/node:n1")
        );
    }
}
