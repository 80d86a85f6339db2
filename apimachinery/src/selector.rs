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

/// Whether a key is one token of the apiserver's selector lexer (what its parser reads as
/// a key at all); whether it is a valid label key is [`invalid_key`]'s to say.
fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

/// apimachinery's `RegexError`: `msg`, its examples and the regular expression.
fn regex_error(msg: &str, re: &str, examples: &[&str]) -> String {
    let examples: Vec<String> = examples.iter().map(|e| format!("'{e}', ")).collect();
    format!(
        "{msg} (e.g. {}regex used for validation is '{re}')",
        examples.join(" or ")
    )
}

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, the name of a label key and a label value.
fn label_shaped(s: &[u8]) -> bool {
    match (s.first(), s.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && s.iter()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(b))
        }
        _ => false,
    }
}

/// apimachinery's `IsDNS1123Subdomain`: at most 253 bytes of dot-separated lowercase
/// RFC 1123 labels.
fn invalid_subdomain(s: &str) -> Vec<String> {
    const FORMAT: &str = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";
    let mut problems = Vec::new();
    if s.len() > 253 {
        problems.push("must be no more than 253 bytes".to_owned());
    }
    let label = |l: &str| {
        let b = l.as_bytes();
        match (b.first(), b.last()) {
            (Some(first), Some(last)) => {
                (first.is_ascii_lowercase() || first.is_ascii_digit())
                    && (last.is_ascii_lowercase() || last.is_ascii_digit())
                    && b.iter()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            }
            _ => false,
        }
    };
    if !s.split('.').all(label) {
        problems.push(regex_error(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
             characters, '-' or '.', and must start and end with an alphanumeric character",
            FORMAT,
            &["example.com"],
        ));
    }
    problems
}

/// Why a label key is invalid, as apimachinery's `IsLabelKey` words it (its messages
/// joined with "; "): an optional DNS-1123 subdomain prefix of at most 253 bytes and `/`,
/// then a name of at most 63 bytes shaped like a label value; `None` when it is valid.
fn invalid_key(k: &str) -> Option<String> {
    const MESSAGE: &str = "must consist of alphanumeric characters, '-', '_' or '.', and \
                           must start and end with an alphanumeric character";
    const FORMAT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
    const EXAMPLES: [&str; 3] = ["MyName", "my.name", "123-abc"];
    let mut problems = Vec::new();
    let name = match k.split('/').collect::<Vec<_>>()[..] {
        [name] => name,
        [prefix, name] => {
            if prefix.is_empty() {
                problems.push("prefix part must be non-empty".to_owned());
            } else {
                let prefixed = invalid_subdomain(prefix).into_iter();
                problems.extend(prefixed.map(|p| format!("prefix part {p}")));
            }
            name
        }
        _ => {
            return Some(format!(
                "a valid label key {} with an optional DNS subdomain prefix and '/' (e.g. \
                 'example.com/MyName')",
                regex_error(MESSAGE, FORMAT, &EXAMPLES)
            ));
        }
    };
    if name.is_empty() {
        problems.push("name part must be non-empty".to_owned());
    } else if name.len() > 63 {
        problems.push("name part must be no more than 63 bytes".to_owned());
    }
    if !label_shaped(name.as_bytes()) {
        problems.push(format!(
            "name part {}",
            regex_error(MESSAGE, FORMAT, &EXAMPLES)
        ));
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// Why a label value is invalid, as apimachinery's `IsValidLabelValue` words it (its
/// messages joined with "; "), or `None` when it is valid.
fn invalid_value(v: &str) -> Option<String> {
    let mut problems = Vec::new();
    if v.len() > 63 {
        problems.push("must be no more than 63 bytes".to_owned());
    }
    if !v.is_empty() && !label_shaped(v.as_bytes()) {
        problems.push(regex_error(
            "a valid label must be an empty string or consist of alphanumeric characters, \
             '-', '_' or '.', and must start and end with an alphanumeric character",
            "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?",
            &["MyValue", "my_value", "12345"],
        ));
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
            // A bad key is said alone, under the nil field path the apiserver's parser
            // gives it (kube-apiserver v1.36 writes `<nil>`, as the differential suite
            // measured); else the first bad value.
            if let Some(why) = invalid_key(key) {
                return Err(SelectError::Label(format!(
                    "<nil>: Invalid value: {key:?}: {why}"
                )));
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
        assert!(err.contains("must be no more than 63 bytes"), "{err}");
    }

    #[test]
    fn label_keys_are_validated_as_the_apiserver_validates_them() {
        let prefix = "a".repeat(253);
        let name = "x".repeat(63);
        for good in [
            "app".to_owned(),
            "example.com/My_Name-1".to_owned(),
            format!("{prefix}/{name}"),
            name.clone(),
        ] {
            for selector in [format!("{good}=a"), good.clone(), format!("!{good}")] {
                assert!(LabelSelector::parse(&selector).is_ok(), "{selector:?}");
            }
        }
        let long = "x".repeat(64);
        let err = LabelSelector::parse(&format!("{long}=a"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "unable to parse requirement: <nil>: Invalid value: \"{long}\": name part \
                 must be no more than 63 bytes"
            )
        );
        for selector in [long.clone(), format!("!{long}"), format!("{long} in (a)")] {
            assert!(LabelSelector::parse(&selector).is_err(), "{selector:?}");
        }
        let err = LabelSelector::parse(&format!("a{prefix}/x"))
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("prefix part must be no more than 253 bytes"),
            "{err}"
        );
        let err = LabelSelector::parse("Example.com/x")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("prefix part a lowercase RFC 1123 subdomain must consist of"),
            "{err}"
        );
        for (key, problem) in [
            ("/x", "prefix part must be non-empty"),
            ("a/", "name part must be non-empty"),
            ("a/b/c", "a valid label key must consist of"),
            ("-x", "name part must consist of alphanumeric characters"),
        ] {
            let err = LabelSelector::parse(&format!("{key}=v"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(problem), "{key}: {err}");
        }
        // A bad key and a bad value: the key alone.
        let err = LabelSelector::parse(&format!("{long}=-v"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("unable to parse requirement: <nil>: Invalid value:")
                && !err.contains("values[0]"),
            "{err}"
        );
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
