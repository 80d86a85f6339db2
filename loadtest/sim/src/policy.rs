//! A static RBAC-like policy: who may do what. It answers every authorization check of the
//! simulator and its SubjectAccessReview endpoint. `system:masters` may always do anything.

use serde::{Deserialize, Serialize};

/// A list of allow rules; anything not allowed is denied.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// The allow rules, in any order.
    #[serde(default)]
    pub rules: Vec<PolicyRule>,
}

/// One allow rule. A request matches when its user is in `users` or one of its groups is in
/// `groups` (`"*"` matches anyone), and the verb, resource, namespace and name all match.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicyRule {
    /// User names.
    #[serde(default)]
    pub users: Vec<String>,
    /// Group names.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Verbs (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`, `impersonate`, `*`).
    #[serde(default)]
    pub verbs: Vec<String>,
    /// `resource[.group][/subresource]`: `secrets`, `endpointslices.discovery.k8s.io`,
    /// `pods/exec`, `*`; impersonation targets are `users`, `groups`, `uids`,
    /// `serviceaccounts`, `userextras/KEY`, matched in any group.
    #[serde(default)]
    pub resources: Vec<String>,
    /// Namespaces (`"*"` or empty = any, including cluster scope).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Object names (empty = any).
    #[serde(default)]
    pub names: Vec<String>,
    /// Non-resource paths (`/metrics`, `/debug/*`, `*`).
    #[serde(default)]
    pub non_resource_urls: Vec<String>,
}

/// A request as authorization sees it (the apiserver's authorizer attributes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attributes {
    /// User name.
    pub user: String,
    /// Groups.
    pub groups: Vec<String>,
    /// Verb.
    pub verb: String,
    /// True for resource requests.
    pub resource_request: bool,
    /// API group.
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Subresource.
    pub subresource: String,
    /// Namespace ("" = cluster scope).
    pub namespace: String,
    /// Object name.
    pub name: String,
    /// Path for non-resource requests.
    pub path: String,
}

/// Impersonation targets: RBAC writes them without a group, so a rule need not name one.
const IMPERSONATION: &[&str] = &["users", "groups", "uids", "serviceaccounts", "userextras"];

/// Paths every identity may read, as the apiserver's default `system:public-info-viewer`.
const PUBLIC_PATHS: &[&str] = &["/healthz", "/livez", "/readyz", "/version", "/version/"];

fn any_or(list: &[String], v: &str) -> bool {
    list.iter().any(|x| x == "*" || x == v)
}

fn path_matches(pattern: &str, path: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => path.starts_with(prefix),
        None => pattern == path,
    }
}

impl PolicyRule {
    fn subject_matches(&self, a: &Attributes) -> bool {
        any_or(&self.users, &a.user) || a.groups.iter().any(|g| any_or(&self.groups, g))
    }

    fn resource_matches(&self, a: &Attributes) -> bool {
        self.resources.iter().any(|r| {
            if r == "*" {
                return true;
            }
            let (base, sub) = match r.split_once('/') {
                Some((b, s)) => (b, s),
                None => (r.as_str(), ""),
            };
            let (res, group) = base.split_once('.').unwrap_or((base, ""));
            let group_ok = group == a.group || (group.is_empty() && IMPERSONATION.contains(&res));
            let res_ok = res == "*" || res == a.resource;
            let sub_ok = sub == a.subresource || (sub == "*" && !a.subresource.is_empty());
            group_ok && res_ok && sub_ok
        })
    }

    /// Whether this rule allows the request.
    pub fn allows(&self, a: &Attributes) -> bool {
        if !self.subject_matches(a) || !any_or(&self.verbs, &a.verb) {
            return false;
        }
        if !a.resource_request {
            return self
                .non_resource_urls
                .iter()
                .any(|p| path_matches(p, &a.path));
        }
        if !self.resource_matches(a) {
            return false;
        }
        let ns_ok = self.namespaces.is_empty()
            || self.namespaces.iter().any(|n| n == "*")
            || (!a.namespace.is_empty() && self.namespaces.contains(&a.namespace));
        let name_ok = self.names.is_empty() || (!a.name.is_empty() && self.names.contains(&a.name));
        ns_ok && name_ok
    }
}

impl Policy {
    /// A policy allowing everything to members of `group`.
    pub fn allow_all_for_group(group: &str) -> Policy {
        Policy {
            rules: vec![PolicyRule {
                groups: vec![group.to_string()],
                verbs: vec!["*".into()],
                resources: vec!["*".into()],
                non_resource_urls: vec!["*".into()],
                ..PolicyRule::default()
            }],
        }
    }

    /// Parses a policy from YAML (or JSON, which is YAML).
    pub fn from_yaml(s: &str) -> Result<Policy, serde_norway::Error> {
        serde_norway::from_str(s)
    }

    /// Whether the request is allowed: `system:masters`, the apiserver's default
    /// discovery/self-review/public-info grants, or a rule.
    pub fn allows(&self, a: &Attributes) -> bool {
        if a.groups.iter().any(|g| g == "system:masters") {
            return true;
        }
        if builtin_allows(a) {
            return true;
        }
        self.rules.iter().any(|r| r.allows(a))
    }
}

/// The grants of the apiserver's default ClusterRoles that clients rely on.
fn builtin_allows(a: &Attributes) -> bool {
    let authenticated = a.groups.iter().any(|g| g == "system:authenticated");
    if !a.resource_request {
        if a.verb != "get" {
            return false;
        }
        if PUBLIC_PATHS.contains(&a.path.as_str()) {
            return true;
        }
        // system:discovery
        return authenticated
            && (a.path == "/api"
                || a.path.starts_with("/api/")
                || a.path == "/apis"
                || a.path.starts_with("/apis/")
                || a.path == "/openapi"
                || a.path.starts_with("/openapi/"));
    }
    // system:basic-user
    authenticated
        && a.verb == "create"
        && ((a.group == "authorization.k8s.io"
            && (a.resource == "selfsubjectaccessreviews"
                || a.resource == "selfsubjectrulesreviews"))
            || (a.group == "authentication.k8s.io" && a.resource == "selfsubjectreviews"))
}

/// A static bearer token (`--token-auth-file`), or with `extra` one standing in for a bound
/// ServiceAccount token, whose TokenReview names its pod and node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticToken {
    /// The bearer token.
    pub token: String,
    /// User name.
    pub user: String,
    /// User UID.
    #[serde(default)]
    pub uid: String,
    /// Groups.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Extra attributes, e.g. `authentication.kubernetes.io/node-name` (a
    /// `--token-auth-file` token has none; a bound ServiceAccount token's review gives them).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub extra: std::collections::BTreeMap<String, Vec<String>>,
}

/// The 403 message the apiserver writes for a denied request.
pub fn forbidden_message(a: &Attributes) -> String {
    if !a.resource_request {
        return format!(
            "forbidden: User \"{}\" cannot {} path \"{}\"",
            a.user, a.verb, a.path
        );
    }
    let res = if a.subresource.is_empty() {
        a.resource.clone()
    } else {
        format!("{}/{}", a.resource, a.subresource)
    };
    let qualified = if a.group.is_empty() {
        a.resource.clone()
    } else {
        format!("{}.{}", a.resource, a.group)
    };
    let subject = if a.name.is_empty() {
        qualified
    } else {
        format!("{qualified} \"{}\"", a.name)
    };
    let scope = if a.namespace.is_empty() {
        "at the cluster scope".to_string()
    } else {
        format!("in the namespace \"{}\"", a.namespace)
    };
    format!(
        "{subject} is forbidden: User \"{}\" cannot {} resource \"{res}\" in API group \"{}\" {scope}",
        a.user, a.verb, a.group
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(user: &str, verb: &str, resource: &str, ns: &str, name: &str) -> Attributes {
        Attributes {
            user: user.into(),
            groups: vec!["system:authenticated".into()],
            verb: verb.into(),
            resource_request: true,
            resource: resource.into(),
            namespace: ns.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    #[test]
    fn rules_match_user_verb_resource_namespace_name() {
        let p = Policy::from_yaml(
            "rules:\n- users: [alice]\n  verbs: [get, list]\n  resources: [secrets]\n  namespaces: [ns]\n- groups: [ops]\n  verbs: ['*']\n  resources: [endpointslices.discovery.k8s.io]\n  names: [web]\n",
        )
        .unwrap();
        assert!(p.allows(&attrs("alice", "get", "secrets", "ns", "x")));
        assert!(!p.allows(&attrs("alice", "get", "secrets", "other", "x")));
        assert!(!p.allows(&attrs("alice", "delete", "secrets", "ns", "x")));
        let mut a = attrs("bob", "get", "endpointslices", "ns", "web");
        a.group = "discovery.k8s.io".into();
        a.groups.push("ops".into());
        assert!(p.allows(&a));
        a.name = "db".into();
        assert!(!p.allows(&a));
        let mut m = attrs("root", "delete", "nodes", "", "n");
        m.groups.push("system:masters".into());
        assert!(p.allows(&m));
        assert!(Policy::from_yaml("rules:\n- bogus: 1\n").is_err());
    }

    #[test]
    fn forbidden_messages_read_like_the_apiserver() {
        assert_eq!(
            forbidden_message(&attrs("bob", "get", "secrets", "ns", "x")),
            "secrets \"x\" is forbidden: User \"bob\" cannot get resource \"secrets\" in API group \"\" in the namespace \"ns\""
        );
        let mut a = attrs("bob", "list", "leases", "", "");
        a.group = "coordination.k8s.io".into();
        assert_eq!(
            forbidden_message(&a),
            "leases.coordination.k8s.io is forbidden: User \"bob\" cannot list resource \"leases\" in API group \"coordination.k8s.io\" at the cluster scope"
        );
    }
}
