//! A rule's compiled `match`: whether a request matches, why not (for `explain`), and
//! whether two matches could both take one request (equal precedence must not be
//! ambiguous).
//!
//! Semantics, documented for operators in `rules/README.md`:
//! - every field given must match; an omitted field matches anything;
//! - subjects (`users`, `groups`, `serviceAccounts`) match when any one of them does;
//! - `resources` and `namespaces` make a rule match resource requests, `nonResourceURLs`
//!   non-resource ones; a rule with none of the three matches both kinds;
//! - `resource` follows RBAC: `pods` is the resource without subresource, `pods/log` one
//!   subresource, `pods/*` every subresource of pods, `*/status` every `status`, `*` all;
//! - a cluster-scoped request (no namespace, including a list across all namespaces)
//!   matches only namespace `*` or `""`;
//! - `nonResourceURLs` are exact or end in `*` (a prefix).

use std::fmt;

use http::Method;
use serde_json::{Value, json};

use super::schema::{MatchDoc, ResourceDoc};
use crate::classify::{RequestInfo, Verb};
use crate::identity::User;

/// The prefix of a ServiceAccount's user name.
const SA_PREFIX: &str = "system:serviceaccount:";

/// Verbs a rule may name: the apiserver's resource verbs and lowercase HTTP methods of
/// non-resource requests.
pub(crate) const VERBS: [&str; 12] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
    "post",
    "put",
    "head",
    "options",
];

/// A user or group name, or `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Name {
    Any,
    Exact(String),
}

impl Name {
    fn matches(&self, name: &str) -> bool {
        match self {
            Name::Any => true,
            Name::Exact(n) => n == name,
        }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Name::Any => f.write_str("*"),
            Name::Exact(n) => f.write_str(n),
        }
    }
}

/// A ServiceAccount, as the user name it authenticates with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ServiceAccount {
    /// `ns/name`: the user `system:serviceaccount:ns:name`.
    Exact { written: String, user: String },
    /// `ns/*`: every user starting `system:serviceaccount:ns:`.
    Namespace { written: String, prefix: String },
}

impl ServiceAccount {
    fn matches(&self, username: &str) -> bool {
        match self {
            ServiceAccount::Exact { user, .. } => user == username,
            ServiceAccount::Namespace { prefix, .. } => username
                .strip_prefix(prefix.as_str())
                .is_some_and(|name| !name.is_empty() && !name.contains(':')),
        }
    }

    fn written(&self) -> &str {
        match self {
            ServiceAccount::Exact { written, .. } | ServiceAccount::Namespace { written, .. } => {
                written
            }
        }
    }
}

/// Which subresources a resource pattern takes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Sub {
    /// The resource itself, no subresource (`pods`).
    None,
    /// Any subresource, but not the resource itself (`pods/*`).
    Any,
    /// One subresource (`pods/log`).
    Exact(String),
    /// With or without subresource (`*`).
    Either,
}

/// One `{group, resource}` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ResourcePattern {
    group: Name,
    resource: Name,
    sub: Sub,
}

impl ResourcePattern {
    fn matches(&self, info: &RequestInfo) -> bool {
        self.group.matches(&info.api_group)
            && self.resource.matches(&info.resource)
            && match (&self.sub, info.subresource.as_deref()) {
                (Sub::Either, _) | (Sub::None, None) | (Sub::Any, Some(_)) => true,
                (Sub::Exact(want), Some(sub)) => want == sub,
                _ => false,
            }
    }

    fn overlaps(&self, other: &ResourcePattern) -> bool {
        let names = |a: &Name, b: &Name| match (a, b) {
            (Name::Exact(a), Name::Exact(b)) => a == b,
            _ => true,
        };
        let subs = match (&self.sub, &other.sub) {
            (Sub::Either, _) | (_, Sub::Either) | (Sub::None, Sub::None) => true,
            (Sub::None, _) | (_, Sub::None) => false,
            (Sub::Exact(a), Sub::Exact(b)) => a == b,
            _ => true,
        };
        names(&self.group, &other.group) && names(&self.resource, &other.resource) && subs
    }

    /// Whether every request this pattern of `other` takes, this one takes too.
    fn covers(&self, other: &ResourcePattern) -> bool {
        let names = |a: &Name, b: &Name| *a == Name::Any || a == b;
        let subs = match (&self.sub, &other.sub) {
            (Sub::Either, _) | (Sub::None, Sub::None) => true,
            (Sub::Any, Sub::Any | Sub::Exact(_)) => true,
            (Sub::Exact(a), Sub::Exact(b)) => a == b,
            _ => false,
        };
        names(&self.group, &other.group) && names(&self.resource, &other.resource) && subs
    }

    /// The resource as written: `pods`, `pods/log`, `*/status`, `*`.
    fn resource_text(&self) -> String {
        match &self.sub {
            Sub::None | Sub::Either => self.resource.to_string(),
            Sub::Any => format!("{}/*", self.resource),
            Sub::Exact(sub) => format!("{}/{sub}", self.resource),
        }
    }
}

impl fmt::Display for ResourcePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in group {:?}",
            self.resource_text(),
            self.group.to_string()
        )
    }
}

/// A namespace entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NamespacePattern {
    /// `*`: every namespace and cluster-scoped requests.
    Any,
    /// `""`: cluster-scoped requests only.
    Cluster,
    /// One namespace.
    Exact(String),
}

impl NamespacePattern {
    fn matches(&self, namespace: Option<&str>) -> bool {
        match (self, namespace.filter(|ns| !ns.is_empty())) {
            (NamespacePattern::Any, _) | (NamespacePattern::Cluster, None) => true,
            (NamespacePattern::Exact(want), Some(ns)) => want == ns,
            _ => false,
        }
    }
}

impl fmt::Display for NamespacePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NamespacePattern::Any => f.write_str("*"),
            NamespacePattern::Cluster => f.write_str("\"\""),
            NamespacePattern::Exact(ns) => f.write_str(ns),
        }
    }
}

/// A non-resource URL entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum UrlPattern {
    /// `*`.
    Any,
    /// `/prefix*`.
    Prefix(String),
    /// `/exact`.
    Exact(String),
}

impl UrlPattern {
    fn matches(&self, path: &str) -> bool {
        match self {
            UrlPattern::Any => true,
            UrlPattern::Prefix(prefix) => path.starts_with(prefix.as_str()),
            UrlPattern::Exact(exact) => path == exact,
        }
    }

    fn overlaps(&self, other: &UrlPattern) -> bool {
        match (self, other) {
            (UrlPattern::Any, _) | (_, UrlPattern::Any) => true,
            (UrlPattern::Exact(a), UrlPattern::Exact(b)) => a == b,
            (UrlPattern::Prefix(p), UrlPattern::Exact(e))
            | (UrlPattern::Exact(e), UrlPattern::Prefix(p)) => e.starts_with(p.as_str()),
            (UrlPattern::Prefix(a), UrlPattern::Prefix(b)) => {
                a.starts_with(b.as_str()) || b.starts_with(a.as_str())
            }
        }
    }
}

impl UrlPattern {
    /// Whether every path `other` takes, this one takes too.
    fn covers(&self, other: &UrlPattern) -> bool {
        match (self, other) {
            (UrlPattern::Any, _) => true,
            (_, UrlPattern::Any) => false,
            (UrlPattern::Prefix(p), UrlPattern::Prefix(q) | UrlPattern::Exact(q)) => {
                q.starts_with(p.as_str())
            }
            (UrlPattern::Exact(a), UrlPattern::Exact(b)) => a == b,
            (UrlPattern::Exact(_), UrlPattern::Prefix(_)) => false,
        }
    }
}

impl fmt::Display for UrlPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UrlPattern::Any => f.write_str("*"),
            UrlPattern::Prefix(prefix) => write!(f, "{prefix}*"),
            UrlPattern::Exact(exact) => f.write_str(exact),
        }
    }
}

/// The subjects of a rule: a request matches when its user or one of its groups does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Subjects {
    users: Vec<Name>,
    groups: Vec<Name>,
    service_accounts: Vec<ServiceAccount>,
}

impl Subjects {
    fn matches(&self, user: &User) -> bool {
        self.users.iter().any(|u| u.matches(&user.username))
            || self
                .service_accounts
                .iter()
                .any(|sa| sa.matches(&user.username))
            || self
                .groups
                .iter()
                .any(|g| user.groups.iter().any(|have| g.matches(have)))
    }

    /// Whether one request could match both: any user may be in any group, so a group on
    /// either side always could; otherwise the user names must meet.
    fn overlaps(&self, other: &Subjects) -> bool {
        if !self.groups.is_empty() || !other.groups.is_empty() {
            return true;
        }
        let users = |s: &Subjects| {
            let mut names: Vec<UserPattern> = s
                .users
                .iter()
                .map(|n| match n {
                    Name::Any => UserPattern::Any,
                    Name::Exact(u) => UserPattern::Exact(u.clone()),
                })
                .collect();
            names.extend(s.service_accounts.iter().map(|sa| match sa {
                ServiceAccount::Exact { user, .. } => UserPattern::Exact(user.clone()),
                ServiceAccount::Namespace { prefix, .. } => UserPattern::Prefix(prefix.clone()),
            }));
            names
        };
        let (mine, theirs) = (users(self), users(other));
        mine.iter()
            .any(|a| theirs.iter().any(|b| user_patterns_overlap(a, b)))
    }
}

impl Subjects {
    /// Whether every user `other` takes, this one takes too. Every user has the group
    /// `system:authenticated`, so that group (or `*`) takes everyone.
    fn covers(&self, other: &Subjects) -> bool {
        let everyone = self
            .groups
            .iter()
            .any(|g| g.matches(crate::identity::AUTHENTICATED));
        if everyone || self.users.contains(&Name::Any) {
            return true;
        }
        let user = |name: &str| {
            self.users.iter().any(|u| u.matches(name))
                || self.service_accounts.iter().any(|sa| sa.matches(name))
        };
        other.users.iter().all(|u| match u {
            Name::Any => false,
            Name::Exact(name) => user(name),
        }) && other.groups.iter().all(|g| self.groups.contains(g))
            && other.service_accounts.iter().all(|sa| match sa {
                ServiceAccount::Exact { user: name, .. } => user(name),
                ServiceAccount::Namespace { prefix, .. } => self.service_accounts.iter().any(
                    |mine| matches!(mine, ServiceAccount::Namespace { prefix: p, .. } if p == prefix),
                ),
            })
    }
}

impl fmt::Display for Subjects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if !self.users.is_empty() {
            parts.push(format!("users [{}]", join(&self.users)));
        }
        if !self.groups.is_empty() {
            parts.push(format!("groups [{}]", join(&self.groups)));
        }
        if !self.service_accounts.is_empty() {
            let written: Vec<&str> = self.service_accounts.iter().map(|s| s.written()).collect();
            parts.push(format!("serviceAccounts [{}]", written.join(", ")));
        }
        f.write_str(&parts.join(", "))
    }
}

enum UserPattern {
    Any,
    Exact(String),
    Prefix(String),
}

fn user_patterns_overlap(a: &UserPattern, b: &UserPattern) -> bool {
    match (a, b) {
        (UserPattern::Any, _) | (_, UserPattern::Any) => true,
        (UserPattern::Exact(a), UserPattern::Exact(b)) => a == b,
        (UserPattern::Prefix(p), UserPattern::Exact(u))
        | (UserPattern::Exact(u), UserPattern::Prefix(p)) => u.starts_with(p.as_str()),
        (UserPattern::Prefix(a), UserPattern::Prefix(b)) => a == b,
    }
}

fn join<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether every pattern of `theirs` is covered by one of `mine` (`None`: anything).
fn every_covered<T>(
    mine: &Option<Vec<T>>,
    theirs: &Option<Vec<T>>,
    covers: impl Fn(&T, &T) -> bool,
) -> bool {
    match (mine, theirs) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(a), Some(b)) => b.iter().all(|y| a.iter().any(|x| covers(x, y))),
    }
}

/// A compiled `match`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Matcher {
    /// `None`: every subject.
    subjects: Option<Subjects>,
    /// `None`: every verb.
    verbs: Option<Vec<String>>,
    resources: Option<Vec<ResourcePattern>>,
    namespaces: Option<Vec<NamespacePattern>>,
    urls: Option<Vec<UrlPattern>>,
}

/// The verb of a request as rules name it.
pub(crate) fn verb_name(verb: &Verb) -> &'static str {
    match verb {
        Verb::NonResource(method) => match *method {
            Method::GET => "get",
            Method::POST => "post",
            Method::PUT => "put",
            Method::PATCH => "patch",
            Method::DELETE => "delete",
            Method::HEAD => "head",
            Method::OPTIONS => "options",
            _ => "other",
        },
        resource => resource.resource_verb().unwrap_or_default(),
    }
}

impl Matcher {
    /// Whether resource requests can match at all.
    fn takes_resource_requests(&self) -> bool {
        self.resources.is_some() || self.namespaces.is_some() || self.urls.is_none()
    }

    /// Whether non-resource requests can match at all.
    fn takes_non_resource_requests(&self) -> bool {
        self.urls.is_some() || (self.resources.is_none() && self.namespaces.is_none())
    }

    fn subjects_match(&self, user: &User) -> bool {
        self.subjects.as_ref().is_none_or(|s| s.matches(user))
    }

    fn verbs_match(&self, info: &RequestInfo) -> bool {
        let verb = verb_name(&info.verb);
        self.verbs
            .as_ref()
            .is_none_or(|verbs| verbs.iter().any(|v| v == verb))
    }

    fn resources_match(&self, info: &RequestInfo) -> bool {
        self.resources
            .as_ref()
            .is_none_or(|patterns| patterns.iter().any(|p| p.matches(info)))
    }

    fn namespaces_match(&self, info: &RequestInfo) -> bool {
        self.namespaces.as_ref().is_none_or(|patterns| {
            patterns
                .iter()
                .any(|p| p.matches(info.namespace.as_deref()))
        })
    }

    fn urls_match(&self, info: &RequestInfo) -> bool {
        self.urls
            .as_ref()
            .is_none_or(|patterns| patterns.iter().any(|p| p.matches(&info.path)))
    }

    /// Whether the request matches; allocates nothing.
    pub fn matches(&self, user: &User, info: &RequestInfo) -> bool {
        self.subjects_match(user)
            && self.verbs_match(info)
            && if info.resource_request {
                self.takes_resource_requests()
                    && self.resources_match(info)
                    && self.namespaces_match(info)
            } else {
                self.takes_non_resource_requests() && self.urls_match(info)
            }
    }

    /// Why the request does not match: one line per failing field, empty when it matches.
    pub fn mismatches(&self, user: &User, info: &RequestInfo) -> Vec<String> {
        let mut why = Vec::new();
        if let Some(subjects) = self.subjects.as_ref().filter(|s| !s.matches(user)) {
            why.push(format!(
                "subjects: user {:?} with groups [{}] is not among {subjects}",
                user.username,
                user.groups.join(", ")
            ));
        }
        if !self.verbs_match(info) {
            why.push(format!(
                "verbs: {} is not one of [{}]",
                verb_name(&info.verb),
                self.verbs.as_deref().unwrap_or_default().join(", ")
            ));
        }
        if info.resource_request {
            if !self.takes_resource_requests() {
                why.push(format!(
                    "nonResourceURLs: the rule matches only non-resource URLs, and {} is a resource request",
                    info.path
                ));
            } else {
                if !self.resources_match(info) {
                    let resource = match &info.subresource {
                        Some(sub) => format!("{}/{sub}", info.resource),
                        None => info.resource.as_str().to_owned(),
                    };
                    why.push(format!(
                        "resources: {resource} in group {:?} is not one of [{}]",
                        info.api_group,
                        join(self.resources.as_deref().unwrap_or_default())
                    ));
                }
                if !self.namespaces_match(info) {
                    let patterns = join(self.namespaces.as_deref().unwrap_or_default());
                    why.push(match info.namespace.as_deref().filter(|ns| !ns.is_empty()) {
                        Some(ns) => {
                            format!("namespaces: namespace {ns:?} is not one of [{patterns}]")
                        }
                        None => format!(
                            "namespaces: the request is cluster-scoped, which only * or \"\" match, not [{patterns}]"
                        ),
                    });
                }
            }
        } else if !self.takes_non_resource_requests() {
            why.push(format!(
                "resources: the rule matches only resource requests, and {} is a non-resource URL",
                info.path
            ));
        } else if !self.urls_match(info) {
            why.push(format!(
                "nonResourceURLs: {} is not one of [{}]",
                info.path,
                join(self.urls.as_deref().unwrap_or_default())
            ));
        }
        why
    }

    /// Whether some request could match both `self` and `other`.
    pub fn overlaps(&self, other: &Matcher) -> bool {
        let subjects = match (&self.subjects, &other.subjects) {
            (Some(a), Some(b)) => a.overlaps(b),
            _ => true,
        };
        let verbs = match (&self.verbs, &other.verbs) {
            (Some(a), Some(b)) => a.iter().any(|v| b.contains(v)),
            _ => true,
        };
        let resources = match (&self.resources, &other.resources) {
            (Some(a), Some(b)) => a.iter().any(|x| b.iter().any(|y| x.overlaps(y))),
            _ => true,
        };
        let namespaces = match (&self.namespaces, &other.namespaces) {
            (Some(a), Some(b)) => a.iter().any(|x| {
                b.iter()
                    .any(|y| x == y || *x == NamespacePattern::Any || *y == NamespacePattern::Any)
            }),
            _ => true,
        };
        let urls = match (&self.urls, &other.urls) {
            (Some(a), Some(b)) => a.iter().any(|x| b.iter().any(|y| x.overlaps(y))),
            _ => true,
        };
        let resource_requests = self.takes_resource_requests()
            && other.takes_resource_requests()
            && resources
            && namespaces;
        let non_resource_requests =
            self.takes_non_resource_requests() && other.takes_non_resource_requests() && urls;
        subjects && verbs && (resource_requests || non_resource_requests)
    }

    /// Whether every request that matches `other` also matches `self`, judged strictly:
    /// `false` whenever some request might match `other` alone. A rule after one that
    /// covers it can never be chosen.
    pub fn covers(&self, other: &Matcher) -> bool {
        let subjects = match (&self.subjects, &other.subjects) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(a), Some(b)) => a.covers(b),
        };
        let verbs = match (&self.verbs, &other.verbs) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(a), Some(b)) => b.iter().all(|v| a.contains(v)),
        };
        let resource_requests = !other.takes_resource_requests()
            || (self.takes_resource_requests()
                && every_covered(&self.resources, &other.resources, ResourcePattern::covers)
                && every_covered(&self.namespaces, &other.namespaces, |x, y| {
                    *x == NamespacePattern::Any || x == y
                }));
        let non_resource_requests = !other.takes_non_resource_requests()
            || (self.takes_non_resource_requests()
                && every_covered(&self.urls, &other.urls, UrlPattern::covers));
        subjects && verbs && resource_requests && non_resource_requests
    }

    /// The match as JSON, in the file's schema.
    pub fn to_json(&self) -> Value {
        let mut out = serde_json::Map::new();
        let strings = |items: Vec<String>| Value::from(items);
        if let Some(s) = &self.subjects {
            if !s.users.is_empty() {
                out.insert(
                    "users".into(),
                    strings(s.users.iter().map(ToString::to_string).collect()),
                );
            }
            if !s.groups.is_empty() {
                out.insert(
                    "groups".into(),
                    strings(s.groups.iter().map(ToString::to_string).collect()),
                );
            }
            if !s.service_accounts.is_empty() {
                out.insert(
                    "serviceAccounts".into(),
                    strings(
                        s.service_accounts
                            .iter()
                            .map(|sa| sa.written().to_owned())
                            .collect(),
                    ),
                );
            }
        }
        if let Some(verbs) = &self.verbs {
            out.insert("verbs".into(), strings(verbs.clone()));
        }
        if let Some(resources) = &self.resources {
            let list: Vec<Value> = resources
                .iter()
                .map(|r| json!({"group": r.group.to_string(), "resource": r.resource_text()}))
                .collect();
            out.insert("resources".into(), Value::from(list));
        }
        if let Some(namespaces) = &self.namespaces {
            let list = namespaces
                .iter()
                .map(|n| match n {
                    NamespacePattern::Cluster => String::new(),
                    other => other.to_string(),
                })
                .collect();
            out.insert("namespaces".into(), strings(list));
        }
        if let Some(urls) = &self.urls {
            out.insert(
                "nonResourceURLs".into(),
                strings(urls.iter().map(ToString::to_string).collect()),
            );
        }
        Value::Object(out)
    }
}

/// Whether `s` is a DNS label: lowercase letters, digits and `-`, starting and ending
/// with a letter or digit, at most 63 characters.
pub(crate) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` is a DNS subdomain: dot-separated DNS labels, at most 253 characters.
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Where in the `match` a problem is, and what it is.
pub(crate) struct PatternProblem {
    /// Path below `match`, e.g. `["verbs", "2"]`.
    pub path: Vec<String>,
    /// What is wrong.
    pub message: String,
}

/// Compiles a `match`, collecting every invalid entry.
// Over 120 lines: every list of a `match` checked in the order written and every problem
// collected before any is compiled; the entries' own checks are the functions below.
pub(crate) fn compile(doc: &MatchDoc) -> Result<Matcher, Vec<PatternProblem>> {
    let mut problems = Vec::new();
    let mut problem = |path: Vec<String>, message: String| {
        problems.push(PatternProblem { path, message });
    };
    // An explicit empty list would silently match nothing (or, read the other way,
    // everything): refuse it and say how to write either.
    let mut list = |field: &str, items: &Option<Vec<String>>| -> Vec<(usize, String)> {
        match items {
            Some(items) if items.is_empty() => {
                problem(
                    vec![field.to_owned()],
                    format!("{field}: an empty list; omit {field} to match any"),
                );
                Vec::new()
            }
            Some(items) => items.iter().cloned().enumerate().collect(),
            None => Vec::new(),
        }
    };
    let users = list("users", &doc.users);
    let groups = list("groups", &doc.groups);
    let service_accounts = list("serviceAccounts", &doc.service_accounts);
    let verbs = list("verbs", &doc.verbs);
    let namespaces = list("namespaces", &doc.namespaces);
    let urls = list("nonResourceURLs", &doc.non_resource_urls);
    if doc.resources.as_ref().is_some_and(Vec::is_empty) {
        problem(
            vec!["resources".into()],
            "resources: an empty list; omit resources to match any".into(),
        );
    }

    let at = |field: &str, i: usize| vec![field.to_owned(), i.to_string()];
    let name =
        |field: &str, i: usize, value: &str, problem: &mut dyn FnMut(Vec<String>, String)| {
            if value == "*" {
                Some(Name::Any)
            } else if value.is_empty() || value.contains('*') {
                problem(
                    at(field, i),
                    format!("{field}[{i}]: invalid name {value:?}: a name, or \"*\" alone for any"),
                );
                None
            } else {
                Some(Name::Exact(value.to_owned()))
            }
        };

    let mut compiled_users = Vec::new();
    for (i, u) in &users {
        compiled_users.extend(name("users", *i, u, &mut problem));
    }
    let mut compiled_groups = Vec::new();
    for (i, g) in &groups {
        compiled_groups.extend(name("groups", *i, g, &mut problem));
    }
    let mut compiled_sas = Vec::new();
    for (i, sa) in &service_accounts {
        match service_account(sa) {
            Some(p) => compiled_sas.push(p),
            None => problem(
                at("serviceAccounts", *i),
                format!(
                    "serviceAccounts[{i}]: invalid ServiceAccount {sa:?}: write NAMESPACE/NAME or NAMESPACE/*"
                ),
            ),
        }
    }

    let mut compiled_verbs = Vec::new();
    let mut any_verb = false;
    for (i, v) in &verbs {
        if v == "*" {
            any_verb = true;
        } else if VERBS.contains(&v.as_str()) {
            compiled_verbs.push(v.clone());
        } else {
            problem(
                at("verbs", *i),
                format!(
                    "verbs[{i}]: unknown verb {v:?}, expected \"*\" or one of {}",
                    VERBS.join(", ")
                ),
            );
        }
    }

    let mut compiled_resources = Vec::new();
    for (i, r) in doc.resources.iter().flatten().enumerate() {
        compiled_resources.extend(resource_pattern(i, r, &mut problem));
    }

    let mut compiled_namespaces = Vec::new();
    for (i, ns) in &namespaces {
        if let Some(pattern) = namespace_pattern(ns) {
            compiled_namespaces.push(pattern);
        } else {
            problem(
                at("namespaces", *i),
                format!(
                    "namespaces[{i}]: invalid namespace {ns:?}: a namespace name, \"*\" for all, or \"\" for cluster-scoped requests"
                ),
            );
        }
    }

    let mut compiled_urls = Vec::new();
    for (i, url) in &urls {
        if let Some(pattern) = url_pattern(url) {
            compiled_urls.push(pattern);
        } else {
            problem(
                at("nonResourceURLs", *i),
                format!(
                    "nonResourceURLs[{i}]: invalid URL {url:?}: a path starting with /, exact or ending in *"
                ),
            );
        }
    }

    if !problems.is_empty() {
        return Err(problems);
    }
    let has_subjects =
        doc.users.is_some() || doc.groups.is_some() || doc.service_accounts.is_some();
    Ok(Matcher {
        subjects: has_subjects.then_some(Subjects {
            users: compiled_users,
            groups: compiled_groups,
            service_accounts: compiled_sas,
        }),
        verbs: (doc.verbs.is_some() && !any_verb).then_some(compiled_verbs),
        resources: doc.resources.is_some().then_some(compiled_resources),
        namespaces: doc.namespaces.is_some().then_some(compiled_namespaces),
        urls: doc.non_resource_urls.is_some().then_some(compiled_urls),
    })
}

/// A `NAMESPACE/NAME` or `NAMESPACE/*` entry of `serviceAccounts`; `None` when it is neither.
fn service_account(sa: &str) -> Option<ServiceAccount> {
    sa.split_once('/').and_then(|(ns, name)| {
        if !is_dns_label(ns) {
            None
        } else if name == "*" {
            Some(ServiceAccount::Namespace {
                written: sa.to_owned(),
                prefix: format!("{SA_PREFIX}{ns}:"),
            })
        } else if is_dns_subdomain(name) {
            Some(ServiceAccount::Exact {
                written: sa.to_owned(),
                user: format!("{SA_PREFIX}{ns}:{name}"),
            })
        } else {
            None
        }
    })
}

/// Entry `i` of `resources`: its group and its resource, each problem told to `problem`.
fn resource_pattern(
    i: usize,
    r: &ResourceDoc,
    problem: &mut dyn FnMut(Vec<String>, String),
) -> Option<ResourcePattern> {
    let group = if r.group == "*" {
        Some(Name::Any)
    } else if r.group.is_empty() || is_dns_subdomain(&r.group) {
        Some(Name::Exact(r.group.clone()))
    } else {
        problem(
            vec!["resources".into(), i.to_string(), "group".into()],
            format!(
                "resources[{i}].group: invalid API group {:?}: \"\" for the core group, a group name, or \"*\"",
                r.group
            ),
        );
        None
    };
    let part = |s: &str| {
        if s == "*" {
            Some(Name::Any)
        } else if is_dns_label(s) {
            Some(Name::Exact(s.to_owned()))
        } else {
            None
        }
    };
    let resource = match r.resource.split_once('/') {
        None if r.resource == "*" => Some((Name::Any, Sub::Either)),
        None => part(&r.resource).map(|n| (n, Sub::None)),
        Some((res, sub)) => part(res).zip(part(sub)).map(|(res, sub)| {
            let sub = match sub {
                Name::Any => Sub::Any,
                Name::Exact(s) => Sub::Exact(s),
            };
            (res, sub)
        }),
    };
    if resource.is_none() {
        problem(
            vec!["resources".into(), i.to_string(), "resource".into()],
            format!(
                "resources[{i}].resource: invalid resource {:?}: write RESOURCE, RESOURCE/SUBRESOURCE, RESOURCE/*, */SUBRESOURCE or *",
                r.resource
            ),
        );
    }
    let (resource, sub) = resource?;
    Some(ResourcePattern {
        group: group?,
        resource,
        sub,
    })
}

/// An entry of `namespaces`: a name, `*` for all, or `""` for cluster-scoped requests.
fn namespace_pattern(ns: &str) -> Option<NamespacePattern> {
    if ns == "*" {
        Some(NamespacePattern::Any)
    } else if ns.is_empty() {
        Some(NamespacePattern::Cluster)
    } else if is_dns_label(ns) {
        Some(NamespacePattern::Exact(ns.to_owned()))
    } else {
        None
    }
}

/// An entry of `nonResourceURLs`: `*`, or a path starting with `/`, exact or ending in `*`.
fn url_pattern(url: &str) -> Option<UrlPattern> {
    let star = url.find('*');
    if url == "*" {
        Some(UrlPattern::Any)
    } else if !url.starts_with('/') || star.is_some_and(|s| s != url.len() - 1) {
        None
    } else if star.is_some() {
        Some(UrlPattern::Prefix(url[..url.len() - 1].to_owned()))
    } else {
        Some(UrlPattern::Exact(url.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::schema::RuleFile;

    fn matcher(yaml: &str) -> Matcher {
        let file: RuleFile = serde_norway::from_str(&format!(
            "rules:\n- name: r\n  precedence: 1\n  level: l\n  match: {yaml}\n"
        ))
        .expect("valid test yaml");
        compile(&file.rules[0].matches)
            .unwrap_or_else(|p| panic!("{:?}", p.iter().map(|p| &p.message).collect::<Vec<_>>()))
    }

    fn problems(yaml: &str) -> Vec<String> {
        let file: RuleFile = serde_norway::from_str(&format!(
            "rules:\n- name: r\n  precedence: 1\n  level: l\n  match: {yaml}\n"
        ))
        .expect("valid test yaml");
        match compile(&file.rules[0].matches) {
            Ok(_) => Vec::new(),
            Err(p) => p.into_iter().map(|p| p.message).collect(),
        }
    }

    fn user(name: &str, groups: &[&str]) -> User {
        User {
            username: name.into(),
            uid: None,
            groups: groups.iter().map(|g| g.to_string()).collect(),
            extra: Default::default(),
        }
    }

    fn request(method: &str, path: &str) -> RequestInfo {
        let method = Method::from_bytes(method.as_bytes()).expect("method");
        crate::classify::classify(&method, &path.parse().expect("uri")).expect("classified")
    }

    #[test]
    fn service_accounts_match_their_user_names() {
        let m = matcher("{serviceAccounts: [ops/sync, monitoring/*]}");
        let list = request("GET", "/api/v1/secrets");
        assert!(m.matches(&user("system:serviceaccount:ops:sync", &[]), &list));
        assert!(m.matches(&user("system:serviceaccount:monitoring:agent", &[]), &list));
        assert!(!m.matches(&user("system:serviceaccount:ops:other", &[]), &list));
        assert!(!m.matches(&user("ops/sync", &[]), &list));
    }

    #[test]
    fn subresources_follow_rbac() {
        let pods = matcher("{resources: [{group: \"\", resource: pods}]}");
        let logs = matcher("{resources: [{group: \"\", resource: pods/log}]}");
        let subs = matcher("{resources: [{group: \"\", resource: pods/*}]}");
        let status = matcher("{resources: [{group: \"*\", resource: \"*/status\"}]}");
        let u = user("u", &[]);
        let get = request("GET", "/api/v1/namespaces/a/pods/p");
        let log = request("GET", "/api/v1/namespaces/a/pods/p/log");
        let node_status = request("PATCH", "/api/v1/nodes/n/status");
        assert!(pods.matches(&u, &get) && !pods.matches(&u, &log));
        assert!(logs.matches(&u, &log) && !logs.matches(&u, &get));
        assert!(subs.matches(&u, &log) && !subs.matches(&u, &get));
        assert!(status.matches(&u, &node_status) && !status.matches(&u, &log));
    }

    #[test]
    fn cluster_scoped_requests_match_only_star_or_empty_namespace() {
        let named = matcher("{namespaces: [kube-system]}");
        let star = matcher("{namespaces: [\"*\"]}");
        let cluster = matcher("{namespaces: [\"\"]}");
        let u = user("u", &[]);
        let all = request("GET", "/api/v1/secrets");
        let ns = request("GET", "/api/v1/namespaces/kube-system/secrets");
        assert!(!named.matches(&u, &all) && named.matches(&u, &ns));
        assert!(star.matches(&u, &all) && star.matches(&u, &ns));
        assert!(cluster.matches(&u, &all) && !cluster.matches(&u, &ns));
    }

    #[test]
    fn resource_and_non_resource_rules_keep_to_their_kind() {
        let urls = matcher("{nonResourceURLs: [/healthz, /apis*]}");
        let resources = matcher("{resources: [{group: \"*\", resource: \"*\"}]}");
        let anything = matcher("{verbs: [get, list]}");
        let u = user("u", &[]);
        let healthz = request("GET", "/healthz");
        let discovery = request("GET", "/apis/apps");
        let pods = request("GET", "/api/v1/pods");
        assert!(urls.matches(&u, &healthz) && urls.matches(&u, &discovery));
        assert!(!urls.matches(&u, &pods));
        assert!(resources.matches(&u, &pods) && !resources.matches(&u, &healthz));
        assert!(anything.matches(&u, &pods) && anything.matches(&u, &healthz));
    }

    #[test]
    fn mismatches_name_every_failing_field() {
        let m = matcher(
            "{groups: [system:nodes], verbs: [get], resources: [{group: \"\", resource: pods}], namespaces: [default]}",
        );
        let why = m.mismatches(
            &user("alice", &["system:authenticated"]),
            &request("GET", "/api/v1/namespaces/kube-system/secrets"),
        );
        assert_eq!(
            why,
            vec![
                "subjects: user \"alice\" with groups [system:authenticated] is not among groups [system:nodes]",
                "verbs: list is not one of [get]",
                "resources: secrets in group \"\" is not one of [pods in group \"\"]",
                "namespaces: namespace \"kube-system\" is not one of [default]",
            ]
        );
    }

    #[test]
    fn overlap_is_found_when_one_request_could_match_both() {
        let a = matcher("{users: [alice], verbs: [list]}");
        let b = matcher("{groups: [devs], verbs: [list, get]}");
        let c = matcher("{users: [bob], verbs: [list]}");
        let d = matcher("{users: [alice], verbs: [get]}");
        let e = matcher("{serviceAccounts: [ops/*]}");
        let f = matcher("{users: [\"system:serviceaccount:ops:x\"]}");
        assert!(a.overlaps(&b), "alice may be in devs");
        assert!(!a.overlaps(&c), "different users");
        assert!(!a.overlaps(&d), "different verbs");
        assert!(e.overlaps(&f));
        let pods = matcher("{resources: [{group: \"\", resource: pods}]}");
        let logs = matcher("{resources: [{group: \"\", resource: pods/log}]}");
        let urls = matcher("{nonResourceURLs: [/healthz]}");
        let ns_a = matcher("{namespaces: [a]}");
        let ns_b = matcher("{namespaces: [b]}");
        assert!(!pods.overlaps(&logs));
        assert!(!pods.overlaps(&urls));
        assert!(!ns_a.overlaps(&ns_b));
        assert!(ns_a.overlaps(&pods));
    }

    #[test]
    fn invalid_patterns_are_each_reported() {
        assert_eq!(
            problems(
                "{users: [\"a*\"], serviceAccounts: [ops], verbs: [lsit], namespaces: [\"kube-*\"], nonResourceURLs: [healthz, \"/a*/b\"], resources: [{group: \"Apps\", resource: \"pods/log/x\"}]}"
            ),
            vec![
                "users[0]: invalid name \"a*\": a name, or \"*\" alone for any",
                "serviceAccounts[0]: invalid ServiceAccount \"ops\": write NAMESPACE/NAME or NAMESPACE/*",
                "verbs[0]: unknown verb \"lsit\", expected \"*\" or one of get, list, watch, create, update, patch, delete, deletecollection, post, put, head, options",
                "resources[0].group: invalid API group \"Apps\": \"\" for the core group, a group name, or \"*\"",
                "resources[0].resource: invalid resource \"pods/log/x\": write RESOURCE, RESOURCE/SUBRESOURCE, RESOURCE/*, */SUBRESOURCE or *",
                "namespaces[0]: invalid namespace \"kube-*\": a namespace name, \"*\" for all, or \"\" for cluster-scoped requests",
                "nonResourceURLs[0]: invalid URL \"healthz\": a path starting with /, exact or ending in *",
                "nonResourceURLs[1]: invalid URL \"/a*/b\": a path starting with /, exact or ending in *",
            ]
        );
        assert_eq!(
            problems("{verbs: []}"),
            vec!["verbs: an empty list; omit verbs to match any"]
        );
    }
}
