//! Warnings on rules that load but cannot do what they say: a rule no request can reach,
//! groups and resources no apiserver serves, staleness above the cache's cap, a shadow rule
//! with nothing to try. They never refuse a folder; `rules check` prints them.

use std::time::Duration;

use super::RuleProblem;
use super::discovery;
use super::matcher::{self, Matcher};
use super::schema::{ModeDoc, ResourceDoc, RuleDoc};
use super::validate::{MAX_PRECEDENCE, Parsed};

/// Every warning for parsed files (the built-in rules first, as `validate::build` takes
/// them). `max_staleness` is the cache's cap (`cache.maxStaleness`).
pub(crate) fn warnings(files: &[Parsed], max_staleness: Duration) -> Vec<RuleProblem> {
    let mut warnings = Vec::new();
    for parsed in files.iter().filter(|p| !p.builtin) {
        for (i, doc) in parsed.file.rules.iter().enumerate() {
            let at = |path: &[&str]| {
                let mut full = vec!["rules".to_owned(), i.to_string()];
                full.extend(path.iter().map(|p| p.to_string()));
                full
            };
            let mut warn = |path: &[&str], message: String| {
                warnings.push(parsed.problem(&at(path), format!("rule {}: {message}", doc.name)));
            };
            if let Some(staleness) = doc.staleness.filter(|s| *s > max_staleness) {
                warn(
                    &["staleness"],
                    format!(
                        "staleness {} is above cache.maxStaleness ({}), which caps it: reads get at most {}",
                        humantime::format_duration(staleness),
                        humantime::format_duration(max_staleness),
                        humantime::format_duration(max_staleness),
                    ),
                );
            }
            if matches!(doc.mode, ModeDoc::Shadow) && doc.rate.is_none() && doc.watches.is_none() {
                warn(
                    &["mode"],
                    "mode shadow with no rate and no watches: there is no limit to try; give it the limits to try, or drop the rule"
                        .to_owned(),
                );
            }
            for (j, resource) in doc.matches.resources.iter().flatten().enumerate() {
                let index = j.to_string();
                for (field, message) in resource_warnings(resource) {
                    warn(
                        &["match", "resources", &index, field],
                        format!("match.resources[{j}].{field}: {message}"),
                    );
                }
            }
        }
    }
    warnings.extend(unreachable(files));
    warnings.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
    warnings
}

/// What is wrong with a `{group, resource}` that a v1.36 apiserver would never serve:
/// (field, message).
fn resource_warnings(doc: &ResourceDoc) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let groups = discovery::groups();
    let group = match doc.group.as_str() {
        "*" => None,
        "core" => {
            out.push((
                "group",
                "\"core\" is not an API group: the core group (pods, secrets, nodes, ...) is written \"\"".to_owned(),
            ));
            Some("")
        }
        g if groups.contains(g) => Some(g),
        g => {
            // A group with a dot may be a CustomResourceDefinition's or an aggregated API's:
            // only a near miss of a built-in one is worth a word.
            let hint = discovery::closest(g, groups.iter().map(String::as_str));
            match hint {
                Some(near) => out.push((
                    "group",
                    format!("unknown API group {g:?}, did you mean {near:?}?"),
                )),
                None if !g.contains('.') => out.push((
                    "group",
                    format!(
                        "unknown API group {g:?}: the apiserver serves no such group, and a CustomResourceDefinition's group has a dot"
                    ),
                )),
                None => {}
            }
            None
        }
    };
    let resource = doc.resource.split('/').next().unwrap_or_default();
    if resource == "*" || resource.is_empty() {
        return out;
    }
    let known = match group {
        Some(g) => discovery::resources(g),
        None => discovery::groups()
            .iter()
            .flat_map(|g| discovery::resources(g))
            .collect(),
    };
    if known.is_empty() || known.contains(&resource) {
        return out;
    }
    let plural = [
        format!("{resource}s"),
        format!("{resource}es"),
        resource
            .strip_suffix('y')
            .map(|stem| format!("{stem}ies"))
            .unwrap_or_default(),
    ]
    .into_iter()
    .find(|p| known.contains(&p.as_str()));
    let in_group = match group {
        Some(g) => format!(" in group {g:?}"),
        None => String::new(),
    };
    match (plural, group) {
        (Some(plural), _) => out.push((
            "resource",
            format!("resource names are plural: {resource:?}{in_group} is never requested, did you mean {plural:?}?"),
        )),
        // Under group `*` a custom resource may have any name.
        (None, None) => {}
        (None, Some(_)) => {
            let hint = discovery::closest(resource, known.iter().copied())
                .map(|near| format!(", did you mean {near:?}?"))
                .unwrap_or_default();
            out.push((
                "resource",
                format!("unknown resource {resource:?}{in_group}{hint}"),
            ));
        }
    }
    out
}

/// A rule that an earlier rule takes every request of can never be chosen.
fn unreachable(files: &[Parsed]) -> Vec<RuleProblem> {
    struct Entry<'a> {
        file: usize,
        index: usize,
        doc: &'a RuleDoc,
        matcher: Matcher,
    }
    let mut entries: Vec<Entry> = Vec::new();
    for (f, parsed) in files.iter().enumerate() {
        for (index, doc) in parsed.file.rules.iter().enumerate() {
            if !(1..=MAX_PRECEDENCE).contains(&doc.precedence) {
                continue;
            }
            let Ok(matcher) = matcher::compile(&doc.matches) else {
                continue;
            };
            // A file rule named like a built-in one replaces it.
            entries.retain(|e| !(files[e.file].builtin && e.doc.name == doc.name));
            entries.push(Entry {
                file: f,
                index,
                doc,
                matcher,
            });
        }
    }
    let mut warnings = Vec::new();
    for later in entries.iter().filter(|e| !files[e.file].builtin) {
        let earlier = entries
            .iter()
            .filter(|e| e.doc.precedence < later.doc.precedence)
            .filter(|e| e.matcher.covers(&later.matcher))
            .min_by_key(|e| e.doc.precedence);
        if let Some(earlier) = earlier {
            let first =
                files[earlier.file].location(&["rules", &earlier.index.to_string(), "name"]);
            warnings.push(files[later.file].problem(
                &["rules", &later.index.to_string(), "precedence"],
                format!(
                    "rule {} is unreachable: rule {} ({first}, precedence {}) comes first and matches every request it matches",
                    later.doc.name, earlier.doc.name, earlier.doc.precedence
                ),
            ));
        }
    }
    warnings
}
