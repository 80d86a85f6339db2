//! Rule files: arbitrary bytes as the text of one to three rule files of a folder (split at
//! NUL bytes), parsed, validated and compiled as `bulwark rules check` and a reload do.
//!
//! Beyond not panicking: the result is deterministic (same hash, same problems); every
//! problem points into its file (a line and column that exist); and a set that compiled
//! can match, explain and describe requests without panicking, always to one of its own
//! rules and levels.

#![no_main]

use std::path::PathBuf;

use bulwark::identity::User;
use bulwark::rules::{RuleSet, Source};
use libfuzzer_sys::fuzz_target;

/// Requests of several shapes to match against a compiled set.
const REQUESTS: [(&str, &str); 6] = [
    ("get", "/api/v1/namespaces/kube-system/pods/coredns"),
    ("list", "/api/v1/secrets?labelSelector=app%3Dweb"),
    ("watch", "/apis/apps/v1/namespaces/default/deployments"),
    (
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/node-1",
    ),
    ("get", "/healthz"),
    ("create", "/api/v1/namespaces/default/pods/web/exec"),
];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let sources: Vec<Source> = text
        .splitn(3, '\0')
        .enumerate()
        .map(|(i, text)| Source {
            path: PathBuf::from(format!("rules-{i}.yaml")),
            text: text.to_owned(),
        })
        .collect();
    let result = RuleSet::from_sources(&sources);
    match (&result, RuleSet::from_sources(&sources)) {
        (Ok(a), Ok(b)) => assert_eq!(a.hash(), b.hash(), "not deterministic"),
        (Err(a), Err(b)) => assert_eq!(a, &b, "not deterministic"),
        _ => panic!("not deterministic"),
    }
    match result {
        Ok(set) => exercise(&set),
        Err(problems) => {
            assert!(!problems.is_empty());
            for problem in problems {
                let source = sources
                    .iter()
                    .find(|s| s.path == problem.file)
                    .unwrap_or_else(|| panic!("{problem} is in no file"));
                assert!(problem.line >= 1 && problem.column >= 1, "{problem}");
                if yaml_only_breaks(&source.text) {
                    // The parser counts lines at breaks that `str::lines` does not know.
                    continue;
                }
                let lines: Vec<&str> = source.text.lines().collect();
                // One past the last line: the end of a file without a final newline.
                assert!(problem.line <= lines.len() + 1, "{problem}");
                let width = lines.get(problem.line - 1).map_or(0, |l| l.chars().count());
                assert!(
                    problem.column >= 1 && problem.column <= width + 1,
                    "{problem}"
                );
            }
        }
    }
});

fn exercise(set: &RuleSet) {
    let _ = set.to_json();
    // A DaemonSet's bound token, naming its node and pod: `flow: node` and `flow: pod` rules
    // key it by them, the others ignore them.
    let mut agent = bulwark::rules::cli_user("system:serviceaccount:kube-system:kube-proxy", &[]);
    for (claim, value) in [
        (bulwark::rules::client::NODE_NAME_CLAIM, "node-1"),
        (
            bulwark::rules::client::POD_UID_CLAIM,
            "0f3c5e2a-7b1d-4c9e-8a6f-2d4b6c8e0a1f",
        ),
    ] {
        agent.extra.insert(claim.to_owned(), vec![value.to_owned()]);
    }
    let users = [
        bulwark::rules::cli_user("system:node:node-1", &["system:nodes".to_owned()]),
        bulwark::rules::cli_user("system:serviceaccount:kube-system:coredns", &[]),
        agent,
        User::default(),
    ];
    let source = Some(std::net::IpAddr::from([10, 0, 0, 1]));
    for user in &users {
        for (verb, path) in REQUESTS {
            let info = bulwark::rules::request_for(verb, path).expect("a valid request");
            let matched = set.matches_from(user, &info, source);
            assert!(
                set.rule_names().contains(&&*matched.rule),
                "{}",
                matched.rule
            );
            assert!(
                set.levels().iter().any(|l| l.name == matched.level.name),
                "{}",
                matched.level.name
            );
            let _ = set.explain_from(user, &info, source);
        }
    }
}

/// Whether the text has line breaks that YAML counts and `str::lines` does not: a CR on its
/// own, NEL, LS or PS.
fn yaml_only_breaks(text: &str) -> bool {
    text.contains(['\u{85}', '\u{2028}', '\u{2029}'])
        || text
            .match_indices('\r')
            .any(|(i, _)| !text[i + 1..].starts_with('\n'))
}
