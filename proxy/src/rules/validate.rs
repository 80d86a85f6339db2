//! Parsed files → one validated, compiled rule set, with every problem found at once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::builtin::{self, BUILTIN_SOURCE, CATCH_ALL, EXEMPT};
use super::discovery;
use super::matcher::{self, Matcher};
use super::schema::{FlowDoc, LevelDoc, ModeDoc, RuleDoc, RuleFile};
use super::spans::{Pos, Spans};
use super::types::{FlowBy, LevelSpec, Mode, Rate, RuleHeaders};
use super::{CompiledRule, RuleProblem};

/// Highest precedence a file may give.
pub(crate) const MAX_PRECEDENCE: i64 = 10_000;
/// Upper bounds that keep a typo (an extra zero or three) from allocating a fortune.
const MAX_SEATS: i64 = 100_000;
const MAX_QUEUES: i64 = 4_096;
const MAX_HAND_SIZE: i64 = 32;
const MAX_QUEUE_LENGTH: i64 = 100_000;
const MAX_BURST: i64 = 1_000_000;
const MAX_QPS: f64 = 1_000_000.0;
const MAX_WATCHES: i64 = 1_000_000;

/// One parsed file, ready for validation.
pub(crate) struct Parsed {
    /// Where it came from, as shown in messages; `built-in` for the built-in rules.
    pub path: PathBuf,
    /// Whether this is the built-in rules.
    pub builtin: bool,
    /// The content.
    pub file: RuleFile,
    /// Positions of its values.
    pub spans: Spans,
    /// Where each level of `file` sits among the file's written levels, when some could
    /// not be parsed and were left out (empty: every level, in order).
    pub level_at: Vec<usize>,
    /// The same for rules.
    pub rule_at: Vec<usize>,
}

impl Parsed {
    /// The position of `path`, a path in `file` (indexes among the parsed entries).
    fn find<S: AsRef<str>>(&self, path: &[S]) -> Pos {
        let mut written: Vec<String> = path.iter().map(|p| p.as_ref().to_owned()).collect();
        if let [section, index, ..] = written.as_mut_slice() {
            let at = match section.as_str() {
                "levels" => &self.level_at,
                "rules" => &self.rule_at,
                _ => &Vec::new(),
            };
            if let Some(original) = index.parse::<usize>().ok().and_then(|i| at.get(i)) {
                *index = original.to_string();
            }
        }
        self.spans.find(&written)
    }

    pub(crate) fn problem<S: AsRef<str>>(&self, path: &[S], message: String) -> RuleProblem {
        let Pos { line, column } = self.find(path);
        RuleProblem {
            file: self.path.clone(),
            line,
            column,
            message,
        }
    }

    pub(crate) fn location<S: AsRef<str>>(&self, path: &[S]) -> String {
        if self.builtin {
            return BUILTIN_SOURCE.to_owned();
        }
        let Pos { line, column } = self.find(path);
        format!("{}:{line}:{column}", self.path.display())
    }
}

/// Whether a level or rule name is usable in flow keys, metric labels and headers.
fn valid_name(name: &str) -> bool {
    name.len() <= 63 && matcher::is_dns_subdomain(name)
}

const NAME_RULE: &str = "lowercase letters, digits, '-' and '.', starting and ending with a letter or digit, at most 63 characters";

/// Checks `value` against `min..=max`.
fn in_range(field: &str, value: i64, min: i64, max: i64) -> Option<String> {
    if value < min {
        Some(if min == 1 {
            format!("{field}: must be at least 1, got {value}")
        } else {
            format!("{field}: must be at least {min}, got {value}")
        })
    } else if value > max {
        Some(format!("{field}: must be at most {max}, got {value}"))
    } else {
        None
    }
}

/// Validates a level, returning its spec or the problems, as (path below the level, message).
fn level_spec(doc: &LevelDoc) -> Result<LevelSpec, Vec<(&'static str, String)>> {
    let mut problems = Vec::new();
    let mut check = |field: &'static str, value: i64, min: i64, max: i64| {
        if let Some(message) = in_range(field, value, min, max) {
            problems.push((field, message));
        }
    };
    check("seats", doc.seats, 1, MAX_SEATS);
    check("queues", doc.queues, 1, MAX_QUEUES);
    check("queueLength", doc.queue_length, 1, MAX_QUEUE_LENGTH);
    let hand_max = doc.queues.clamp(1, MAX_HAND_SIZE);
    if doc.hand_size < 1 || doc.hand_size > hand_max {
        problems.push((
            "handSize",
            if doc.hand_size < 1 {
                format!("handSize: must be at least 1, got {}", doc.hand_size)
            } else {
                format!(
                    "handSize: must be at most {hand_max} (queues, and never above {MAX_HAND_SIZE}), got {}",
                    doc.hand_size
                )
            },
        ));
    }
    if doc.max_wait.is_zero() {
        problems.push(("maxWait", "maxWait: must be above 0s".to_owned()));
    }
    let max_seats_per_flow = doc
        .max_seats_per_flow
        .unwrap_or_else(|| super::schema::default_max_seats_per_flow(doc.seats));
    if doc.max_seats_per_flow.is_some()
        && let Some(message) = in_range("maxSeatsPerFlow", max_seats_per_flow, 1, doc.seats.max(1))
    {
        problems.push(("maxSeatsPerFlow", message));
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    // In range, so the conversions cannot fail; fall back to the bound regardless.
    let narrow = |v: i64| u32::try_from(v).unwrap_or(u32::MAX);
    Ok(LevelSpec {
        name: doc.name.clone(),
        exempt: false,
        seats: narrow(doc.seats),
        queues: narrow(doc.queues),
        hand_size: narrow(doc.hand_size),
        queue_length: narrow(doc.queue_length),
        max_wait: doc.max_wait,
        max_seats_per_flow: narrow(max_seats_per_flow),
    })
}

/// A validated set: its levels and its rules by precedence (the catch-all apart).
pub(crate) type Built = (Vec<Arc<LevelSpec>>, Vec<CompiledRule>);

/// A problem below a rule: (path below the rule, message).
type RuleItemProblem = (Vec<String>, String);

/// Where a name was first defined: (file index, item index).
type Origin = (usize, usize);

/// A rule that passed its own checks, before overlaps are looked for.
struct Candidate {
    origin: Origin,
    precedence: u32,
    matcher: Matcher,
    compiled: CompiledRule,
}

/// Builds a rule set from parsed files (the built-in rules first). `incomplete` is set when
/// some files could not be parsed: references to levels they may define are then not
/// reported as missing.
// Over 120 lines: the levels, then the rules that name them, in one pass over the files,
// each step on the maps the one before built, so the problems come out in file order.
pub(crate) fn build(files: &[Parsed], incomplete: bool) -> Result<Built, Vec<RuleProblem>> {
    let mut problems = Vec::new();

    // Levels: the built-in ones, then each file's.
    let mut levels: Vec<(Option<Origin>, LevelSpec)> = vec![
        (None, builtin::exempt_level()),
        (None, builtin::catch_all_level()),
    ];
    let mut level_origin: HashMap<String, Origin> = HashMap::new();
    // Levels defined with bad values: rules naming them are not also told they are missing.
    let mut invalid_levels: Vec<String> = Vec::new();
    for (f, parsed) in files.iter().enumerate() {
        for (i, doc) in parsed.file.levels.iter().enumerate() {
            let index = i.to_string();
            let at = |field: &str| vec!["levels".to_owned(), index.clone(), field.to_owned()];
            let label = format!("level {}", doc.name);
            if !valid_name(&doc.name) {
                problems.push(parsed.problem(
                    &at("name"),
                    format!("level {:?}: invalid name: {NAME_RULE}", doc.name),
                ));
                continue;
            }
            if doc.name == EXEMPT {
                problems.push(parsed.problem(
                    &at("name"),
                    format!(
                        "{label}: the built-in level {EXEMPT} has no limits and cannot be redefined"
                    ),
                ));
                continue;
            }
            if let Some(&(pf, pi)) = level_origin.get(&doc.name) {
                let first = files[pf].location(&["levels", &pi.to_string(), "name"]);
                problems.push(parsed.problem(
                    &at("name"),
                    format!("{label}: duplicate level name, first defined at {first}"),
                ));
                continue;
            }
            level_origin.insert(doc.name.clone(), (f, i));
            match level_spec(doc) {
                Ok(spec) => match levels.iter_mut().find(|(_, l)| l.name == spec.name) {
                    // A file's `catch-all` replaces the built-in numbers, in its place.
                    Some(builtin) => *builtin = (Some((f, i)), spec),
                    None => levels.push((Some((f, i)), spec)),
                },
                Err(level_problems) => {
                    invalid_levels.push(doc.name.clone());
                    for (field, message) in level_problems {
                        problems.push(parsed.problem(&at(field), format!("{label}: {message}")));
                    }
                }
            }
        }
    }
    let levels: Vec<Arc<LevelSpec>> = levels.into_iter().map(|(_, l)| Arc::new(l)).collect();
    let level_names: Vec<&str> = levels.iter().map(|l| l.name.as_str()).collect();
    let level_by_name = |name: &str| levels.iter().find(|l| l.name == name).cloned();

    // Rules: a file rule named like a built-in one replaces it.
    let mut rule_origin: HashMap<String, Origin> = HashMap::new();
    let mut candidates: Vec<Candidate> = Vec::new();
    for (f, parsed) in files.iter().enumerate() {
        for (i, doc) in parsed.file.rules.iter().enumerate() {
            let index = i.to_string();
            let at = |path: &[&str]| {
                let mut full = vec!["rules".to_owned(), index.clone()];
                full.extend(path.iter().map(|p| p.to_string()));
                full
            };
            if !valid_name(&doc.name) {
                problems.push(parsed.problem(
                    &at(&["name"]),
                    format!("rule {:?}: invalid name: {NAME_RULE}", doc.name),
                ));
                continue;
            }
            let label = format!("rule {}", doc.name);
            if doc.name == CATCH_ALL {
                problems.push(parsed.problem(
                    &at(&["name"]),
                    format!(
                        "{label}: the built-in rule {CATCH_ALL} cannot be redefined; redefine the level {CATCH_ALL}, or add a rule with precedence {MAX_PRECEDENCE} and no match"
                    ),
                ));
                continue;
            }
            match rule_origin.get(&doc.name) {
                Some(&(pf, pi)) if !files[pf].builtin => {
                    let first = files[pf].location(&["rules", &pi.to_string(), "name"]);
                    problems.push(parsed.problem(
                        &at(&["name"]),
                        format!("{label}: duplicate rule name, first defined at {first}"),
                    ));
                    continue;
                }
                Some(_) => candidates.retain(|c| *c.compiled.name != *doc.name),
                None => {}
            }
            rule_origin.insert(doc.name.clone(), (f, i));
            let report_missing = !incomplete && !invalid_levels.contains(&doc.level);
            match rule(doc, &level_by_name, &level_names, report_missing) {
                Ok((precedence, matcher, compiled)) => candidates.push(Candidate {
                    origin: (f, i),
                    precedence,
                    matcher,
                    compiled: CompiledRule {
                        source: (!parsed.builtin).then(|| {
                            let pos = parsed.find(&at(&["name"]));
                            (parsed.path.clone(), pos.line)
                        }),
                        ..compiled
                    },
                }),
                Err(rule_problems) => {
                    for (path, message) in rule_problems {
                        let mut full = vec!["rules".to_owned(), index.clone()];
                        full.extend(path);
                        problems.push(parsed.problem(&full, format!("{label}: {message}")));
                    }
                }
            }
        }
    }

    // Equal precedence must never leave the choice to file order.
    for (b, later) in candidates.iter().enumerate() {
        for earlier in &candidates[..b] {
            if earlier.precedence == later.precedence && earlier.matcher.overlaps(&later.matcher) {
                let (ef, ei) = earlier.origin;
                let (lf, li) = later.origin;
                let first = files[ef].location(&["rules", &ei.to_string(), "precedence"]);
                problems.push(files[lf].problem(
                    &["rules", &li.to_string(), "precedence"],
                    format!(
                        "rule {}: precedence {} is also that of rule {} ({first}) and both could match the same request; give them different precedences or matches that cannot meet",
                        later.compiled.name, later.precedence, earlier.compiled.name
                    ),
                ));
            }
        }
    }

    if !problems.is_empty() {
        return Err(problems);
    }
    let mut rules: Vec<CompiledRule> = candidates.into_iter().map(|c| c.compiled).collect();
    rules.sort_by_key(|r| r.precedence);
    Ok((levels, rules))
}

/// Validates one rule: its precedence, matcher and the rule, or (path below the rule,
/// message) for each problem. A missing level is a problem only if `report_missing`.
// Over 120 lines: one rule's fields checked in the order they are written, every problem
// collected against the one rule being compiled.
fn rule(
    doc: &RuleDoc,
    level_by_name: &dyn Fn(&str) -> Option<Arc<LevelSpec>>,
    level_names: &[&str],
    report_missing: bool,
) -> Result<(u32, Matcher, CompiledRule), Vec<RuleItemProblem>> {
    let mut problems: Vec<RuleItemProblem> = Vec::new();
    let mut add = |path: &[&str], message: String| {
        problems.push((path.iter().map(|s| s.to_string()).collect(), message));
    };
    if let Some(message) = in_range("precedence", doc.precedence, 1, MAX_PRECEDENCE) {
        add(&["precedence"], message);
    }
    let level = level_by_name(&doc.level);
    if level.is_none() && report_missing {
        let hint = discovery::closest(&doc.level, level_names.iter().copied())
            .map(|name| format!(", did you mean {name:?}?"))
            .unwrap_or_default();
        add(
            &["level"],
            format!(
                "level: {:?} is not defined{hint} (levels: {})",
                doc.level,
                level_names.join(", ")
            ),
        );
    }
    let exempt = level.as_ref().is_some_and(|l| l.exempt);
    let rate = match &doc.rate {
        None => None,
        Some(rate) => {
            let mut ok = true;
            if !rate.qps.is_finite() || rate.qps <= 0.0 {
                add(
                    &["rate", "qps"],
                    format!("rate.qps: must be above 0, got {}", rate.qps),
                );
                ok = false;
            } else if rate.qps > MAX_QPS {
                add(
                    &["rate", "qps"],
                    format!("rate.qps: must be at most {MAX_QPS}, got {}", rate.qps),
                );
                ok = false;
            }
            if let Some(message) = in_range("rate.burst", rate.burst, 1, MAX_BURST) {
                add(&["rate", "burst"], message);
                ok = false;
            }
            if exempt {
                add(
                    &["rate"],
                    format!("rate: level {EXEMPT} has no limits, so a rate would never apply"),
                );
            }
            ok.then(|| Rate {
                qps: rate.qps,
                burst: u32::try_from(rate.burst).unwrap_or(u32::MAX),
            })
        }
    };
    let watches = match doc.watches {
        None => None,
        Some(w) => {
            if let Some(message) = in_range("watches", w, 1, MAX_WATCHES) {
                add(&["watches"], message);
            } else if exempt {
                add(
                    &["watches"],
                    format!(
                        "watches: level {EXEMPT} has no limits, so a watch limit would never apply"
                    ),
                );
            }
            u32::try_from(w).ok()
        }
    };
    if doc.staleness.is_some_and(|s| s.is_zero()) {
        add(
            &["staleness"],
            "staleness: must be above 0s; omit it for consistent reads".to_owned(),
        );
    }
    let matcher = match matcher::compile(&doc.matches) {
        Ok(m) => Some(m),
        Err(pattern_problems) => {
            for p in pattern_problems {
                let mut path = vec!["match".to_owned()];
                path.extend(p.path);
                problems.push((path, format!("match.{}", p.message)));
            }
            None
        }
    };
    match (level, matcher) {
        (Some(level), Some(matcher)) if problems.is_empty() => {
            let compiled = CompiledRule {
                headers: RuleHeaders::new(&doc.name, &level.name),
                name: Arc::from(doc.name.as_str()),
                precedence: u32::try_from(doc.precedence).unwrap_or(u32::MAX),
                source: None,
                matcher: matcher.clone(),
                level,
                flow: match doc.flow {
                    FlowDoc::User => FlowBy::User,
                    FlowDoc::Namespace => FlowBy::Namespace,
                    FlowDoc::None => FlowBy::None,
                    FlowDoc::Node => FlowBy::Node,
                    FlowDoc::Pod => FlowBy::Pod,
                },
                rate,
                watches,
                mode: match doc.mode {
                    ModeDoc::Enforce => Mode::Enforce,
                    ModeDoc::Shadow => Mode::Shadow,
                },
                staleness: doc.staleness,
            };
            Ok((compiled.precedence, matcher, compiled))
        }
        // A missing level that is not reported: the set is refused for another problem.
        _ if problems.is_empty() => Err(Vec::new()),
        _ => Err(problems),
    }
}

/// The built-in catch-all rule, given the (maybe redefined) catch-all level.
pub(crate) fn catch_all_rule(levels: &[Arc<LevelSpec>]) -> CompiledRule {
    let level = levels
        .iter()
        .find(|l| l.name == CATCH_ALL)
        .cloned()
        .unwrap_or_else(|| Arc::new(builtin::catch_all_level()));
    CompiledRule {
        headers: RuleHeaders::new(CATCH_ALL, &level.name),
        name: Arc::from(CATCH_ALL),
        precedence: u32::MAX,
        source: None,
        matcher: Matcher::default(),
        level,
        flow: builtin::CATCH_ALL_FLOW,
        rate: Some(builtin::CATCH_ALL_RATE),
        watches: None,
        mode: builtin::CATCH_ALL_MODE,
        staleness: None,
    }
}

/// The built-in heartbeat rules as a parsed file.
pub(crate) fn builtin_file() -> Parsed {
    let file = serde_norway::from_str(builtin::HEARTBEAT_RULES).unwrap_or_default();
    Parsed {
        path: PathBuf::from(BUILTIN_SOURCE),
        builtin: true,
        file,
        spans: Spans::parse(builtin::HEARTBEAT_RULES),
        level_at: Vec::new(),
        rule_at: Vec::new(),
    }
}

/// Says what the parser's Rust type names stand for.
pub(crate) fn friendly(message: &str) -> String {
    const NAMES: [(&str, &str); 8] = [
        (
            "expected struct RuleFile",
            "expected a rule file: a mapping with `levels` and `rules`",
        ),
        ("expected struct LevelDoc", "expected a level: a mapping"),
        ("expected struct RuleDoc", "expected a rule: a mapping"),
        ("expected struct MatchDoc", "expected a match: a mapping"),
        (
            "expected struct ResourceDoc",
            "expected a mapping {group, resource}",
        ),
        ("expected struct RateDoc", "expected a mapping {qps, burst}"),
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
    ];
    NAMES
        .iter()
        .fold(message.to_owned(), |m, (from, to)| m.replace(from, to))
}

/// Folder-level problem (no line).
pub(crate) fn folder_problem(dir: &Path, message: String) -> RuleProblem {
    RuleProblem {
        file: dir.to_owned(),
        line: 0,
        column: 0,
        message,
    }
}
