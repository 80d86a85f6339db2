//! Label and field selectors of lists and watches, parsed as the apiserver parses
//! `labelSelector` and `fieldSelector` (`=`, `==`, `!=`, `in`, `notin`, `key`, `!key`).
//! Field selectors cover `metadata.name` and `metadata.namespace`, the fields every
//! resource indexes; a selector on any other field is an error here (Bulwark's cache then
//! sends the request upstream, where the apiserver decides).

use std::collections::BTreeMap;

/// A selector that could not be parsed; the message is the apiserver's 400 text.
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    /// The label selector is malformed.
    #[error("unable to parse requirement: {0}")]
    Label(String),
    /// The field selector is malformed or names an unsupported field.
    #[error("{0}")]
    Field(String),
}

#[derive(Clone, Debug, PartialEq)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector; empty matches everything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LabelSelector(Vec<Req>);

/// Splits on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 316
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

/// Why a label value is invalid, as apimachinery's `IsValidLabelValue` words it (its
/// messages joined with "; "), or `None` when it is valid.
fn invalid_value(v: &str) -> Option<String> {
    let mut problems = Vec::new();
    if v.len() > 63 {
        problems.push("must be no more than 63 characters");
    }
    let bytes = v.as_bytes();
    let shaped = bytes.is_empty()
        || (bytes[0].is_ascii_alphanumeric()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(b)));
    if !shaped {
        problems.push(
            "a valid label must be an empty string or consist of alphanumeric characters, \
             '-', '_' or '.', and must start and end with an alphanumeric character (e.g. \
             'MyValue',  or 'my_value',  or '12345', regex used for validation is \
             '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')",
        );
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

impl LabelSelector {
    /// Parses a `labelSelector` value.
    pub fn parse(s: &str) -> Result<LabelSelector, SelectError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(LabelSelector(reqs));
        }
        for part in split_top(s) {
            let p = part.trim();
            let bad = || SelectError::Label(format!("invalid requirement: {p:?}"));
            let req = if let Some(k) = p.strip_prefix('!') {
                let k = k.trim();
                if !valid_key(k) {
                    return Err(bad());
                }
                Req::NotExists(k.to_string())
            } else if let Some((k, v)) = p.split_once("!=") {
                Req::Ne(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = p.split_once("==") {
                Req::Eq(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = p.split_once('=') {
                Req::Eq(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, rest)) = split_set_op(p, " notin ") {
                Req::NotIn(k, parse_set(rest).ok_or_else(bad)?)
            } else if let Some((k, rest)) = split_set_op(p, " in ") {
                Req::In(k, parse_set(rest).ok_or_else(bad)?)
            } else {
                Req::Exists(p.to_string())
            };
            let (key, values): (&str, Vec<&String>) = match &req {
                Req::Eq(k, v) | Req::Ne(k, v) => (k, vec![v]),
                Req::In(k, vs) | Req::NotIn(k, vs) => (k, vs.iter().collect()),
                Req::Exists(k) | Req::NotExists(k) => (k, vec![]),
            };
            if !valid_key(key) {
                return Err(bad());
            }
            for (i, v) in values.iter().enumerate() {
                if let Some(why) = invalid_value(v) {
                    return Err(SelectError::Label(format!(
                        "values[{i}][{key}]: Invalid value: {v:?}: {why}"
                    )));
                }
            }
            reqs.push(req);
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether these labels satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => labels.get(k) == Some(v),
            Req::Ne(k, v) => labels.get(k) != Some(v),
            Req::In(k, vs) => labels.get(k).is_some_and(|l| vs.contains(l)),
            Req::NotIn(k, vs) => labels.get(k).is_none_or(|l| !vs.contains(l)),
            Req::Exists(k) => labels.contains_key(k),
            Req::NotExists(k) => !labels.contains_key(k),
        })
    }

    /// True when there are no requirements.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn split_set_op(p: &str, op: &str) -> Option<(String, String)> {
    let i = p.find(op)?;
    Some((
        p[..i].trim().to_string(),
        p[i + op.len()..].trim().to_string(),
    ))
}

fn parse_set(s: String) -> Option<Vec<String>> {
    let inner = s.strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(|v| v.trim().to_string()).collect())
}

/// A field selector term split at its operator, as apimachinery's `splitTerm`: at the first
/// position where `!=`, `==` or `=` starts (tried in that order).
fn split_term(term: &str) -> Option<(&str, &'static str, &str)> {
    term.char_indices().find_map(|(i, _)| {
        let rest = &term[i..];
        ["!=", "==", "="]
            .into_iter()
            .find(|op| rest.starts_with(op))
            .map(|op| (&term[..i], op, &rest[op.len()..]))
    })
}

/// A parsed field selector over `metadata.name` and `metadata.namespace`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FieldSelector(Vec<Req>);

impl FieldSelector {
    /// Parses a `fieldSelector` value as apimachinery's `fields.ParseSelector` does: terms
    /// split on `,`, empty terms skipped, each term split at the first operator, and nothing
    /// trimmed (` metadata.name=a` names another field, `metadata.name= a` another name).
    /// Other fields are rejected as the apiserver rejects fields a resource does not index,
    /// and so are values with `\` escapes or an unescaped `=` (left to the apiserver).
    pub fn parse(s: &str) -> Result<FieldSelector, SelectError> {
        let mut reqs = Vec::new();
        for p in s.split(',').filter(|p| !p.is_empty()) {
            let Some((k, op, v)) = split_term(p) else {
                return Err(SelectError::Field(format!(
                    "invalid selector: '{s}'; can't understand '{p}'"
                )));
            };
            if k != "metadata.name" && k != "metadata.namespace" {
                return Err(SelectError::Field(format!(
                    "field label not supported: {k}"
                )));
            }
            if v.contains(['\\', '=']) {
                return Err(SelectError::Field(format!(
                    "invalid field selector value {v:?}: escapes and '=' are not read here"
                )));
            }
            reqs.push(match op {
                "!=" => Req::Ne(k.to_string(), v.to_string()),
                _ => Req::Eq(k.to_string(), v.to_string()),
            });
        }
        Ok(FieldSelector(reqs))
    }

    /// Whether an object with this namespace and name matches.
    pub fn matches(&self, namespace: &str, name: &str) -> bool {
        self.0.iter().all(|r| {
            let field = |k: &str| {
                if k == "metadata.name" {
                    name
                } else {
                    namespace
                }
            };
            match r {
                Req::Eq(k, v) => field(k) == v,
                Req::Ne(k, v) => field(k) != v,
                _ => true,
            }
        })
    }

    /// The namespace pinned by `metadata.namespace=X`, so a cluster-wide request narrowed to
    /// one namespace can be checked against excluded namespaces.
    pub fn pinned_namespace(&self) -> Option<&str> {
        self.0.iter().find_map(|r| match r {
            Req::Eq(k, v) if k == "metadata.namespace" => Some(v.as_str()),
            _ => None,
        })
    }

    /// The name pinned by `metadata.name=X`.
    pub fn pinned_name(&self) -> Option<&str> {
        self.0.iter().find_map(|r| match r {
            Req::Eq(k, v) if k == "metadata.name" => Some(v.as_str()),
            _ => None,
        })
    }

    /// True when there are no requirements.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn label_values_are_validated_as_the_apiserver_validates_them() {
        for good in ["", "a", "my_value", "My.Value-1", &"x".repeat(63)] {
            assert!(
                LabelSelector::parse(&format!("app={good}")).is_ok(),
                "{good:?}"
            );
        }
        let err = LabelSelector::parse("app=-bad-").unwrap_err().to_string();
        assert!(
            err.starts_with("unable to parse requirement: values[0][app]: Invalid value: \"-bad-\": a valid label must be an empty string"),
            "{err}"
        );
        let err = LabelSelector::parse("app in (a,b_)")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("values[1][app]: Invalid value: \"b_\""),
            "{err}"
        );
        let long = "x".repeat(64);
        let err = LabelSelector::parse(&format!("app!={long}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be no more than 63 characters"), "{err}");
    }

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_operators() {
        let l = labels(&[("app", "web"), ("tier", "fe")]);
        let m = |s: &str| LabelSelector::parse(s).expect(s).matches(&l);
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app!=web"));
        assert!(m("app in (web, db)"));
        assert!(!m("app notin (web,db)"));
        assert!(m("env notin (prod)"));
        assert!(m("!env"));
        assert!(!m("!app"));
        assert!(m(""));
        assert!(LabelSelector::parse("a in b").is_err());
        assert!(LabelSelector::parse("a=b c").is_err());
    }

    #[test]
    fn field_selectors() {
        let f = FieldSelector::parse("metadata.name=x,metadata.namespace!=y").unwrap();
        assert!(f.matches("z", "x"));
        assert!(!f.matches("y", "x"));
        assert_eq!(f.pinned_name(), Some("x"));
        assert!(FieldSelector::parse("spec.nodeName=n").is_err());
    }

    #[test]
    fn field_selectors_are_not_trimmed() {
        // Found by the `selectors` fuzz target: the apiserver keeps whitespace, so
        // `metadata.name= web` asks for the name " web" (and is authorized for that name),
        // not for "web".
        let f = FieldSelector::parse("metadata.name==\n\0\0\0\0\0\0\0web").unwrap();
        assert_eq!(f.pinned_name(), Some("\n\0\0\0\0\0\0\0web"));
        assert!(!f.matches("ns", "\0\0\0\0\0\0\0web"));
        let f = FieldSelector::parse("metadata.name= web").unwrap();
        assert!(!f.matches("ns", "web") && f.matches("ns", " web"));
        // ` metadata.name` is another field; a blank selector is a malformed term.
        assert!(FieldSelector::parse(" metadata.name=web").is_err());
        assert!(FieldSelector::parse(" ").is_err());
        // Empty terms are skipped; `=` in a value is the apiserver's to refuse.
        assert_eq!(
            FieldSelector::parse("metadata.name=web,").unwrap(),
            FieldSelector::parse("metadata.name=web").unwrap()
        );
        assert!(FieldSelector::parse("metadata.name===web").is_err());
        assert!(FieldSelector::parse("").unwrap().is_empty());
    }
}
