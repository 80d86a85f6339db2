//! Rule files as an operator meets them: the shipped examples load and explain themselves,
//! every kind of bad file is refused with its `file:line:column`, and reloads (on demand,
//! on a file change, on a ConfigMap symlink swap, on SIGHUP) swap in good rules and keep
//! the running ones when the new ones are bad.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bulwark::identity::User;
use bulwark::metrics::Metrics;
use bulwark::rules::{self, Mode, RuleSet, Rules};

/// The shipped example rules.
fn examples() -> PathBuf {
    bulwark_testkit::repo_path("rules/examples")
}

/// The rules every install ships (`deploy/base/rules`; the chart's copy is checked to be
/// the same bytes by `tests/deploy.rs`).
fn shipped() -> PathBuf {
    bulwark_testkit::repo_path("deploy/base/rules")
}

/// `cache.maxStaleness` when the configuration does not set it.
const DEFAULT_MAX_STALENESS: Duration = Duration::from_secs(10);

/// Rule folders good and bad, with their expected output.
fn testdata() -> PathBuf {
    bulwark_testkit::repo_path("rules/testdata")
}

/// `check`'s output with the test data folder taken off the paths.
fn check_output(dir: &Path, base: &Path) -> (u8, String) {
    let checked = rules::check(dir, DEFAULT_MAX_STALENESS);
    let (code, out) = match checked.summary {
        Some(summary) if checked.errors.is_empty() => (0, summary),
        _ => (1, checked.errors.iter().map(|p| format!("{p}\n")).collect()),
    };
    (code, out.replace(&format!("{}/", base.display()), ""))
}

/// Copies the rule files of `from` (not subfolders) into `to`, replacing what is there.
fn replace_files(from: &Path, to: &Path) {
    for entry in fs::read_dir(to).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            fs::remove_file(path).unwrap();
        }
    }
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.path().is_file() {
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

fn user(name: &str, groups: &[&str]) -> User {
    let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
    rules::cli_user(name, &groups)
}

const BAD_CASES: [&str; 10] = [
    "unknown-field",
    "wrong-type",
    "unknown-flow",
    "zero-limits",
    "missing-level",
    "duplicate-names",
    "equal-precedence",
    "invalid-patterns",
    "not-yaml",
    "empty-file",
];

#[test]
fn every_bad_rule_folder_gives_its_errors_with_file_line_and_column() {
    for case in BAD_CASES {
        let dir = testdata().join(case);
        let expected = fs::read_to_string(dir.join("expected.txt")).unwrap();
        let (code, out) = check_output(&dir, &testdata());
        assert_eq!(code, 1, "{case}");
        assert_eq!(out, expected, "case {case}");
    }
}

#[test]
fn an_empty_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("notes.txt"), "not a rule file").unwrap();
    let problems = RuleSet::load_dir(dir.path()).unwrap_err();
    assert_eq!(problems.len(), 1);
    assert_eq!(
        problems[0].to_string(),
        format!(
            "{}: no rule files (*.yaml or *.yml) in the folder",
            dir.path().display()
        )
    );
}

#[test]
fn a_missing_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let problems = RuleSet::load_dir(&missing).unwrap_err();
    assert!(
        problems[0].to_string().starts_with(&format!(
            "{}: cannot read the rules folder",
            missing.display()
        )),
        "{problems:?}"
    );
}

#[test]
fn a_10_mb_file_is_refused_from_its_size() {
    let dir = tempfile::tempdir().unwrap();
    fs::copy(
        examples().join("levels.yaml"),
        dir.path().join("levels.yaml"),
    )
    .unwrap();
    // A sparse file: 10 MB long, nothing written, so nothing needs reading to refuse it.
    let big = fs::File::create(dir.path().join("big.yaml")).unwrap();
    big.set_len(10 * 1024 * 1024).unwrap();
    let problems = RuleSet::load_dir(dir.path()).unwrap_err();
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        vec![format!(
            "{}: the file is 10485760 bytes; a rule file may be at most 1048576 bytes (1 MiB)",
            dir.path().join("big.yaml:1:1").display()
        )]
    );
}

#[test]
fn other_files_hidden_files_and_subfolders_are_ignored() {
    let (code, out) = check_output(&testdata().join("ignored-files"), &testdata());
    assert_eq!(code, 0, "{out}");
    assert!(
        out.starts_with("ignored-files: 1 files, 2 levels, 5 rules, hash "),
        "{out}"
    );
}

/// Lays out `files` like a ConfigMap volume: a timestamped folder, `..data` pointing at it,
/// and visible symlinks through `..data`.
#[cfg(unix)]
fn configmap_update(dir: &Path, stamp: &str, files: &[(&str, String)]) {
    use std::os::unix::fs::symlink;
    let real = dir.join(stamp);
    fs::create_dir(&real).unwrap();
    for (name, text) in files {
        fs::write(real.join(name), text).unwrap();
        let visible = dir.join(name);
        if fs::symlink_metadata(&visible).is_err() {
            symlink(Path::new("..data").join(name), &visible).unwrap();
        }
    }
    // As the kubelet does: a new symlink, renamed over `..data` in one step.
    symlink(stamp, dir.join("..data_tmp")).unwrap();
    fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
}

#[cfg(unix)]
#[test]
fn a_configmap_folder_is_read_once_through_its_data_view() {
    let dir = tempfile::tempdir().unwrap();
    let text = |name: &str| fs::read_to_string(examples().join(name)).unwrap();
    configmap_update(
        dir.path(),
        "..2026_06_01_12_00_00.000000001",
        &[
            ("levels.yaml", text("levels.yaml")),
            ("kubelets.yaml", text("kubelets.yaml")),
        ],
    );
    // Read twice (through the timestamped folder too), the rules would be duplicates.
    let set = RuleSet::load_dir(dir.path()).unwrap();
    assert!(set.rule_names().contains(&"kubelets"));
}

#[test]
fn the_examples_load_and_route_their_clients() {
    let set = RuleSet::load_dir(&examples()).unwrap();
    let route = |u: &User, verb: &str, path: &str| {
        let info = rules::request_for(verb, path).unwrap();
        set.matches(u, &info)
    };

    let operator = user("system:serviceaccount:ops:secret-sync", &[]);
    let m = route(&operator, "list", "/api/v1/secrets");
    assert_eq!(&*m.rule, "secret-operators");
    assert_eq!(m.level.name, "list-heavy");
    assert_eq!(m.level.seats, 8);
    assert_eq!(
        &*m.flow,
        "secret-operators/system:serviceaccount:ops:secret-sync"
    );
    assert_eq!(m.rate.map(|r| (r.qps, r.burst)), Some((5.0, 10)));
    assert_eq!(m.watches, Some(20));
    assert_eq!(m.mode, Mode::Enforce);
    assert_eq!(m.staleness, Some(Duration::from_secs(2)));

    let kubelet = user("system:node:node-7", &["system:nodes"]);
    let heartbeat = route(
        &kubelet,
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/node-7",
    );
    assert_eq!(&*heartbeat.rule, "node-heartbeats");
    assert!(heartbeat.level.exempt);
    assert_eq!(&*heartbeat.flow, "node-heartbeats/system:node:node-7");
    let status = route(&kubelet, "patch", "/api/v1/nodes/node-7/status");
    assert_eq!(&*status.rule, "node-status");
    let pods = route(&kubelet, "watch", "/api/v1/pods");
    assert_eq!(&*pods.rule, "kubelets");
    assert_eq!(&*pods.flow, "kubelets/system:node:node-7");

    let mut proxy = user("system:serviceaccount:kube-system:kube-proxy", &[]);
    proxy.extra.insert(
        "authentication.kubernetes.io/node-name".into(),
        vec!["node-7".into()],
    );
    let m = route(&proxy, "watch", "/apis/discovery.k8s.io/v1/endpointslices");
    assert_eq!(&*m.rule, "kube-proxy");
    assert_eq!(
        &*m.flow, "kube-proxy/system:serviceaccount:kube-system:kube-proxy/node:node-7",
        "one flow per node"
    );
    let controller = user(
        "system:serviceaccount:kube-system:deployment-controller",
        &[],
    );
    assert_eq!(
        &*route(&controller, "list", "/apis/apps/v1/deployments").rule,
        "core-controllers"
    );
    let election = route(
        &user("system:kube-scheduler", &[]),
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler",
    );
    assert_eq!(&*election.rule, "leader-election");

    let admin = user("root", &["system:masters"]);
    let m = route(&admin, "list", "/api/v1/secrets");
    assert_eq!(&*m.rule, "cluster-admins");
    assert!(m.level.exempt);

    let poller = user("system:serviceaccount:monitoring:event-poller", &[]);
    assert_eq!(
        &*route(&poller, "list", "/api/v1/events").rule,
        "monitoring"
    );
    let agent = user("system:serviceaccount:logging:fluent-bit", &[]);
    assert_eq!(
        &*route(&agent, "get", "/api/v1/namespaces/web/pods/web-1").rule,
        "logging-agent"
    );

    let storm = user("storm-17", &["storm"]);
    let m = route(&storm, "list", "/api/v1/secrets");
    assert_eq!(&*m.rule, "cluster-wide-secret-lists");
    assert_eq!(m.level.name, "list-heavy");
    assert_eq!(&*m.flow, "cluster-wide-secret-lists/storm-17");
    assert_eq!(
        &*route(&storm, "list", "/api/v1/namespaces/ns-1/secrets").rule,
        "catch-all"
    );

    let nobody = user("alice", &["devs"]);
    let m = route(&nobody, "list", "/api/v1/namespaces/web/secrets");
    assert_eq!(&*m.rule, "catch-all");
    assert_eq!(m.level.name, "catch-all");
    assert_eq!(&*m.flow, "catch-all/alice");
    assert!(m.rate.is_some());
    let m = route(&nobody, "get", "/version");
    assert_eq!(&*m.rule, "catch-all");

    let names: Vec<&str> = set.levels().iter().map(|l| l.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "exempt",
            "catch-all",
            "nodes",
            "controllers",
            "list-heavy",
            "agents"
        ]
    );
}

#[test]
fn flows_are_keyed_by_user_namespace_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("flows.yaml"),
        "rules:\n\
         - {name: by-ns, precedence: 100, match: {groups: [a]}, level: catch-all, flow: namespace}\n\
         - {name: one, precedence: 101, match: {groups: [b]}, level: catch-all, flow: none}\n",
    )
    .unwrap();
    let set = RuleSet::load_dir(dir.path()).unwrap();
    let list = rules::request_for("list", "/api/v1/namespaces/web/pods").unwrap();
    let all = rules::request_for("list", "/api/v1/pods").unwrap();
    let m = set.matches(&user("x", &["a"]), &list);
    assert_eq!(&*m.flow, "by-ns/web");
    let m = set.matches(&user("x", &["a"]), &all);
    assert_eq!(&*m.flow, "by-ns/");
    let m = set.matches(&user("y", &["b"]), &list);
    assert_eq!(&*m.flow, "one");
    let json = set.to_json();
    let rule = json["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "by-ns")
        .unwrap();
    assert_eq!(rule["flow"], "namespace");
    assert_eq!(
        rule["source"],
        format!("{}:2", dir.path().join("flows.yaml").display())
    );
}

#[test]
fn flows_per_node_and_pod_are_per_user_and_client_and_fall_back_to_the_address() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("flows.yaml"),
        "rules:\n\
         - name: per-node\n\
         \x20 precedence: 100\n\
         \x20 match: {groups: [\"system:serviceaccounts\", \"system:nodes\"]}\n\
         \x20 level: catch-all\n\
         \x20 flow: node\n\
         - {name: per-pod, precedence: 101, match: {groups: [pods]}, level: catch-all, flow: pod}\n",
    )
    .unwrap();
    let set = RuleSet::load_dir(dir.path()).unwrap();
    let watch = rules::request_for("watch", "/api/v1/services").unwrap();
    let source: std::net::IpAddr = "10.0.0.1".parse().unwrap();
    let with = |name: &str, groups: &[&str], claims: &[(&str, &[&str])]| {
        let mut u = user(name, groups);
        for (key, values) in claims {
            u.extra.insert(
                format!("authentication.kubernetes.io/{key}"),
                values.iter().map(|v| v.to_string()).collect(),
            );
        }
        u
    };
    let flow = |u: &User, from: Option<std::net::IpAddr>| {
        set.matches_from(u, &watch, from).flow.to_string()
    };
    let proxy = "system:serviceaccount:kube-system:kube-proxy";
    let cni = "system:serviceaccount:kube-system:cni-agent";

    let on_n1 = with(proxy, &[], &[("node-name", &["n1"])]);
    assert_eq!(
        flow(&on_n1, Some(source)),
        format!("per-node/{proxy}/node:n1")
    );
    let on_n2 = with(proxy, &[], &[("node-name", &["n2"])]);
    assert_ne!(
        flow(&on_n1, None),
        flow(&on_n2, None),
        "two nodes, two flows"
    );
    // Two identities on one node are two flows.
    let cni_on_n1 = with(cni, &[], &[("node-name", &["n1"])]);
    assert_eq!(flow(&cni_on_n1, None), format!("per-node/{cni}/node:n1"));
    // A kubelet is its node.
    let kubelet = user("system:node:n1", &["system:nodes"]);
    assert_eq!(flow(&kubelet, None), "per-node/system:node:n1/node:n1");

    // A claim missing, several, empty, too long or malformed: the source address.
    let long = "n".repeat(254);
    for claims in [
        &[][..],
        &[("node-name", &["n1", "n2"][..])][..],
        &[("node-name", &[""][..])][..],
        &[("node-name", &[long.as_str()][..])][..],
        &[("node-name", &["N1"][..])][..],
        &[("node-name", &["n1/addr:10.0.0.1"][..])][..],
    ] {
        let u = with(proxy, &[], claims);
        assert_eq!(
            flow(&u, Some(source)),
            format!("per-node/{proxy}/addr:10.0.0.1"),
            "{claims:?}"
        );
    }
    // Two users' fallbacks on one address are two flows.
    assert_ne!(
        flow(&with(proxy, &[], &[]), Some(source)),
        flow(&with(cni, &[], &[]), Some(source))
    );
    // A node named like the address is not the address.
    let named_like_ip = with(proxy, &[], &[("node-name", &["10.0.0.1"])]);
    assert_eq!(
        flow(&named_like_ip, Some(source)),
        format!("per-node/{proxy}/node:10.0.0.1")
    );
    assert_ne!(
        flow(&named_like_ip, Some(source)),
        flow(&with(proxy, &[], &[]), Some(source))
    );

    let uid = "0f3c5e2a-7b1d-4c9e-8a6f-2d4b6c8e0a1f";
    let pod = with(
        "p",
        &["pods"],
        &[("pod-uid", &[uid]), ("pod-name", &["web-1"])],
    );
    assert_eq!(flow(&pod, Some(source)), format!("per-pod/p/pod:{uid}"));
    let named_only = with("p", &["pods"], &[("pod-name", &["web-1"])]);
    assert_eq!(flow(&named_only, Some(source)), "per-pod/p/addr:10.0.0.1");

    let json = set.to_json();
    let flows: Vec<&str> = json["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["name"] == "per-node" || r["name"] == "per-pod")
        .map(|r| r["flow"].as_str().unwrap())
        .collect();
    assert_eq!(flows, ["node", "pod"]);
}

#[test]
fn explain_says_which_client_keys_a_flow_and_why_it_fell_back() {
    let proxy = "system:serviceaccount:kube-system:kube-proxy";
    let explain = |extra: &[(&str, &str)], source: Option<&str>| {
        let mut u = user(proxy, &[]);
        for (key, value) in extra {
            u.extra
                .entry(key.to_string())
                .or_default()
                .push(value.to_string());
        }
        let source = source.map(|s| s.parse().unwrap());
        let out = rules::explain_dir(
            &examples(),
            Mode::Enforce,
            &u,
            source,
            "watch",
            "/api/v1/services",
        )
        .unwrap();
        out.lines()
            .find(|l| l.starts_with("  flow: "))
            .unwrap()
            .to_owned()
    };
    let node = "authentication.kubernetes.io/node-name";
    assert_eq!(
        explain(&[(node, "node-1")], None),
        format!("  flow: node, key kube-proxy/{proxy}/node:node-1")
    );
    assert_eq!(
        explain(&[], Some("10.0.0.1")),
        format!(
            "  flow: node, key kube-proxy/{proxy}/addr:10.0.0.1 \
             (no node-name claim: keyed by source address)"
        )
    );
    assert_eq!(
        explain(&[(node, "a"), (node, "b")], Some("10.0.0.1")),
        format!(
            "  flow: node, key kube-proxy/{proxy}/addr:10.0.0.1 \
             (2 node-name claims, not one: keyed by source address)"
        )
    );
    assert_eq!(
        explain(&[], None),
        format!(
            "  flow: node, key kube-proxy/{proxy}/addr:unknown \
             (no node-name claim: keyed by source address, unknown without --source)"
        )
    );
}

#[test]
fn the_builtin_set_has_both_levels_heartbeats_and_the_catch_all() {
    let set = RuleSet::builtin();
    let names: Vec<&str> = set.levels().iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["exempt", "catch-all"]);
    assert_eq!(
        set.rule_names(),
        [
            "node-heartbeats",
            "node-status",
            "leader-election",
            "catch-all"
        ]
    );
    let lease = rules::request_for(
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1",
    )
    .unwrap();
    assert!(
        set.matches(&user("system:node:n1", &["system:nodes"]), &lease)
            .level
            .exempt
    );
    let json = set.to_json();
    assert_eq!(json["hash"], set.hash());
    assert_eq!(json["rules"][3]["precedence"], serde_json::Value::Null);
    assert_eq!(json["rules"][0]["source"], "built-in");
    assert!(json["loadedAt"].as_str().unwrap().ends_with('Z'));
}

#[test]
fn only_nodes_and_control_plane_identities_heartbeat_unthrottled() {
    let set = RuleSet::builtin();
    let lease = |ns: &str| format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/x");
    let rule = |who: &User, verb: &str, path: &str| {
        let m = set.matches(who, &rules::request_for(verb, path).unwrap());
        (m.rule.to_string(), m.level.exempt)
    };
    let node = user("system:node:n1", &["system:nodes"]);
    let mallory = user("mallory", &["devs"]);
    let scheduler = user("system:kube-scheduler", &[]);
    let system_sa = user("system:serviceaccount:kube-system:cloud-controller", &[]);
    let other_sa = user("system:serviceaccount:default:operator", &[]);
    let heartbeat = ("node-heartbeats".to_string(), true);
    let election = ("leader-election".to_string(), true);
    let throttled = ("catch-all".to_string(), false);

    assert_eq!(rule(&node, "update", &lease("kube-node-lease")), heartbeat);
    assert_eq!(
        rule(&mallory, "update", &lease("kube-node-lease")),
        throttled
    );
    assert_eq!(rule(&mallory, "create", &lease("kube-system")), throttled);
    assert_eq!(
        rule(&mallory, "patch", "/api/v1/nodes/n1/status"),
        throttled
    );
    assert_eq!(rule(&other_sa, "update", &lease("default")), throttled);
    for who in [
        &scheduler,
        &system_sa,
        &user("system:kube-controller-manager", &[]),
    ] {
        for verb in ["get", "create", "update"] {
            assert_eq!(rule(who, verb, &lease("kube-system")), election, "{verb}");
        }
        // APF's system-leader-election has no patch or delete.
        assert_eq!(rule(who, "patch", &lease("kube-system")), throttled);
        assert_eq!(rule(who, "delete", &lease("kube-system")), throttled);
    }
    // Each node and controller is a flow of its own.
    let m = set.matches(
        &scheduler,
        &rules::request_for("update", &lease("kube-system")).unwrap(),
    );
    assert_eq!(&*m.flow, "leader-election/system:kube-scheduler");
}

#[test]
fn a_file_rule_named_like_a_heartbeat_rule_replaces_it() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("heartbeats.yaml"),
        "rules:\n  - name: leader-election\n    precedence: 12\n    match:\n      users: [ctrl]\n    level: catch-all\n",
    )
    .unwrap();
    let set = RuleSet::load_dir(dir.path()).unwrap();
    let lease = rules::request_for(
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/x",
    )
    .unwrap();
    assert_eq!(&*set.matches(&user("other", &[]), &lease).rule, "catch-all");
    let m = set.matches(&user("ctrl", &[]), &lease);
    assert_eq!(
        (&*m.rule, m.level.name.as_str()),
        ("leader-election", "catch-all")
    );
}

const EXPLAIN_CASES: [(&str, &str, &[&str], &str, &str); 6] = [
    (
        "secret-storm",
        "storm-17",
        &["storm"],
        "list",
        "/api/v1/secrets",
    ),
    (
        "secret-operator",
        "system:serviceaccount:ops:secret-sync",
        &[],
        "list",
        "/api/v1/secrets",
    ),
    (
        "node-heartbeat",
        "system:node:node-1",
        &["system:nodes"],
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/node-1",
    ),
    (
        "kubelet-watch",
        "system:node:node-1",
        &["system:nodes"],
        "watch",
        "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1",
    ),
    (
        "monitoring-poll",
        "system:serviceaccount:monitoring:event-poller",
        &[],
        "list",
        "/api/v1/events",
    ),
    (
        "unknown-user",
        "alice",
        &["devs"],
        "get",
        "/api/v1/namespaces/default/pods/web-1",
    ),
];

#[test]
fn explain_on_the_examples_prints_the_expected_text() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    for (name, user, groups, verb, path) in EXPLAIN_CASES {
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let out = rules::explain_dir(
            &examples(),
            Mode::Enforce,
            &rules::cli_user(user, &groups),
            None,
            verb,
            path,
        )
        .unwrap();
        let golden = testdata().join("explain").join(format!("{name}.txt"));
        if update {
            fs::write(&golden, &out).unwrap();
        }
        let expected = fs::read_to_string(&golden).unwrap();
        assert_eq!(out, expected, "explain {name}");
    }
}

#[test]
fn explain_refuses_a_bad_request_and_a_bad_folder() {
    let err = rules::explain_dir(
        &examples(),
        Mode::Enforce,
        &user("u", &[]),
        None,
        "lsit",
        "/api/v1/pods",
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("unknown verb \"lsit\""), "{err}");
    let err = rules::explain_dir(
        &examples(),
        Mode::Enforce,
        &user("u", &[]),
        None,
        "get",
        "/api/v1/pods",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("is a list request"), "{err}");
    let err = rules::explain_dir(
        &examples(),
        Mode::Enforce,
        &user("u", &[]),
        None,
        "get",
        "/api/v1/%2e%2e/x",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("encoded"), "{err}");
    let bad = testdata().join("missing-level");
    let err = rules::explain_dir(
        &bad,
        Mode::Enforce,
        &user("u", &[]),
        None,
        "get",
        "/version",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("list-hevy"), "{err}");
}

/// `rules.mode: shadow` puts every rule in shadow mode, the built-in catch-all and the
/// rules that say `mode: enforce` included; `enforce` leaves each rule its own. The mode
/// outlives a reload, and `explain` says when it overrides a rule.
#[test]
fn rules_mode_shadow_overrides_every_rule_and_explain_says_so() {
    let dir = tempfile::tempdir().unwrap();
    replace_files(&examples(), dir.path());
    let operator = user("system:serviceaccount:ops:secret-sync", &[]);
    let requests = [
        (operator.clone(), "list", "/api/v1/secrets"),
        (user("storm-17", &["storm"]), "list", "/api/v1/secrets"),
        (
            user("system:node:n1", &["system:nodes"]),
            "watch",
            "/api/v1/pods",
        ),
        (user("alice", &[]), "get", "/api/v1/namespaces/a/pods/p"),
    ];
    let modes = |set: &RuleSet| -> Vec<(String, Mode)> {
        requests
            .iter()
            .map(|(u, verb, path)| {
                let m = set.matches(u, &rules::request_for(verb, path).unwrap());
                (m.rule.to_string(), m.mode)
            })
            .collect()
    };
    let enforced = RuleSet::load_dir(dir.path()).unwrap();
    assert_eq!(enforced.mode(), Mode::Enforce, "enforce is the default");
    let rule_names: Vec<String> = modes(&enforced).into_iter().map(|(r, _)| r).collect();
    assert_eq!(
        rule_names,
        [
            "secret-operators",
            "cluster-wide-secret-lists",
            "kubelets",
            "catch-all"
        ]
    );
    assert!(modes(&enforced).iter().all(|(_, m)| *m == Mode::Enforce));

    let metrics = Metrics::new();
    let shadowed = Rules::new(
        RuleSet::load_dir(dir.path())
            .unwrap()
            .with_mode(Mode::Shadow),
        Some(dir.path().to_owned()),
        metrics,
    );
    assert!(
        modes(&shadowed.current())
            .iter()
            .all(|(_, m)| *m == Mode::Shadow)
    );
    // Not part of the hash: the same folder is the same set.
    assert_eq!(shadowed.current().hash(), enforced.hash());
    assert_eq!(shadowed.current().to_json()["mode"], "shadow");
    fs::remove_file(dir.path().join("monitoring.yaml")).unwrap();
    shadowed.reload().unwrap();
    assert_ne!(shadowed.current().hash(), enforced.hash(), "reloaded");
    assert!(
        modes(&shadowed.current())
            .iter()
            .all(|(_, m)| *m == Mode::Shadow),
        "a reloaded set keeps rules.mode"
    );

    let explain = |mode| {
        rules::explain_dir(
            &examples(),
            mode,
            &operator,
            None,
            "list",
            "/api/v1/secrets",
        )
        .unwrap()
    };
    let overridden = "  mode: shadow (rules.mode: shadow in Bulwark's configuration overrides the rule's enforce)\n";
    assert!(
        explain(Mode::Shadow).contains(overridden),
        "{}",
        explain(Mode::Shadow)
    );
    assert!(explain(Mode::Enforce).contains("  mode: enforce\n"));
}

#[test]
fn check_summarises_a_good_folder() {
    let checked = rules::check(&examples(), DEFAULT_MAX_STALENESS);
    // CI runs `rules check` on the examples: they must load with no warning either.
    assert!(checked.errors.is_empty(), "{:?}", checked.errors);
    assert!(checked.warnings.is_empty(), "{:?}", checked.warnings);
    let set = RuleSet::load_dir(&examples()).unwrap();
    assert_eq!(
        checked.summary.unwrap(),
        format!(
            "{}: 11 files, 6 levels, 12 rules, hash {}\n",
            examples().display(),
            set.hash()
        )
    );
}

/// Seats of the levels that carried the cluster's own components through `bulwark-loadtest
/// cluster` at 2,000 nodes with no 429 (loadtest/runner/README.md): the nodes' agents (a
/// kubelet's, kube-proxy's and a node daemon's reads at once) on 40, kube-controller-manager,
/// its controllers and kube-scheduler on 30.
const NODE_SEATS: u32 = 40;
const CONTROLLER_SEATS: u32 = 30;

/// What a client sends and where it must land: (what, user, groups, verb, path, rule, the
/// fewest seats of its level).
type Component = (
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static str,
    &'static str,
    &'static str,
    Option<u32>,
);

/// The cluster's own components under the shipped rules: what each sends, the rule it must
/// land in, and the fewest seats its level may have (`None`: exempt). Every
/// `system:serviceaccount:` user gets its ServiceAccount groups, as authentication gives
/// them.
const COMPONENTS: [Component; 13] = [
    (
        "kube-scheduler binds a pod",
        "system:kube-scheduler",
        &[],
        "create",
        "/api/v1/namespaces/default/pods/web-1/binding",
        "kube-scheduler",
        Some(CONTROLLER_SEATS),
    ),
    (
        "kube-scheduler watches the pods to schedule",
        "system:kube-scheduler",
        &[],
        "watch",
        "/api/v1/pods?fieldSelector=status.phase%21%3DSucceeded",
        "kube-scheduler",
        Some(CONTROLLER_SEATS),
    ),
    (
        "kube-scheduler renews its leader Lease",
        "system:kube-scheduler",
        &[],
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler",
        "leader-election",
        None,
    ),
    (
        "a kubelet patches a pod's status",
        "system:node:n1",
        &["system:nodes"],
        "patch",
        "/api/v1/namespaces/default/pods/web-1/status",
        "kubelets",
        Some(NODE_SEATS),
    ),
    (
        "a kubelet watches its pods",
        "system:node:n1",
        &["system:nodes"],
        "watch",
        "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1",
        "kubelets",
        Some(NODE_SEATS),
    ),
    (
        "a kubelet renews its node Lease",
        "system:node:n1",
        &["system:nodes"],
        "update",
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1",
        "node-heartbeats",
        None,
    ),
    (
        "kube-controller-manager's informers list every pod",
        "system:kube-controller-manager",
        &[],
        "list",
        "/api/v1/pods?limit=500",
        "kube-controller-manager",
        Some(CONTROLLER_SEATS),
    ),
    (
        "kube-controller-manager mints a controller's token",
        "system:kube-controller-manager",
        &[],
        "create",
        "/api/v1/namespaces/kube-system/serviceaccounts/job-controller/token",
        "kube-controller-manager",
        Some(CONTROLLER_SEATS),
    ),
    (
        "the job controller creates a pod",
        "system:serviceaccount:kube-system:job-controller",
        &[],
        "create",
        "/api/v1/namespaces/default/pods",
        "kube-system-service-accounts",
        Some(CONTROLLER_SEATS),
    ),
    (
        "the garbage collector deletes a pod",
        "system:serviceaccount:kube-system:generic-garbage-collector",
        &[],
        "delete",
        "/api/v1/namespaces/default/pods/web-1",
        "kube-system-service-accounts",
        Some(CONTROLLER_SEATS),
    ),
    (
        "the EndpointSlice controller updates a slice",
        "system:serviceaccount:kube-system:endpointslice-controller",
        &[],
        "update",
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/web-abcde",
        "kube-system-service-accounts",
        Some(CONTROLLER_SEATS),
    ),
    (
        "kube-proxy watches EndpointSlices",
        "system:serviceaccount:kube-system:kube-proxy",
        &[],
        "watch",
        "/apis/discovery.k8s.io/v1/endpointslices?labelSelector=%21service.kubernetes.io%2Fheadless",
        "kube-proxy",
        Some(NODE_SEATS),
    ),
    (
        "CoreDNS watches Services",
        "system:serviceaccount:kube-system:coredns",
        &[],
        "watch",
        "/api/v1/services",
        "coredns",
        Some(CONTROLLER_SEATS),
    ),
];

/// Under the shipped rules no component of the cluster itself lands in the catch-all (as
/// under the rules shipped before, where the scheduler's bindings, the kubelets' pod status
/// and kube-controller-manager's own requests did), nor in a level with fewer seats than it
/// needs: `explain` names its rule and level. The set loads without a warning.
#[test]
fn the_shipped_rules_give_every_component_of_the_cluster_a_rule_and_the_seats_it_needs() {
    let checked = rules::check(&shipped(), DEFAULT_MAX_STALENESS);
    assert!(checked.errors.is_empty(), "{:?}", checked.errors);
    assert!(checked.warnings.is_empty(), "{:?}", checked.warnings);
    let set = RuleSet::load_dir(&shipped()).unwrap();
    for (what, name, groups, verb, path, rule, seats) in COMPONENTS {
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let user = rules::cli_user(name, &groups);
        let text = rules::explain_dir(&shipped(), Mode::Enforce, &user, None, verb, path)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let matched = text
            .lines()
            .find_map(|l| l.strip_prefix("matched: rule "))
            .unwrap_or_else(|| panic!("{what}:\n{text}"));
        assert!(
            !matched.starts_with("catch-all "),
            "{what} lands in the catch-all:\n{text}"
        );
        assert!(
            matched.starts_with(&format!("{rule} (")),
            "{what}: expected rule {rule}:\n{text}"
        );
        let m = set.matches(
            &rules::cli_user(name, &groups),
            &rules::request_for(verb, path).unwrap(),
        );
        match seats {
            None => assert!(m.level.exempt, "{what}: {}", m.level.name),
            Some(needed) => assert!(
                !m.level.exempt && m.level.seats >= needed && m.mode == Mode::Enforce,
                "{what}: level {} has {} seats, it needs {needed}:\n{text}",
                m.level.name,
                m.level.seats
            ),
        }
        assert!(
            text.contains(&format!("  level: {} (", m.level.name)),
            "{text}"
        );
    }
}

/// (user, groups, verb, path, rule, level).
type Placed = (
    &'static str,
    &'static [&'static str],
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);

/// Everyone else under the shipped rules: DaemonSets by node, operators by pod, people,
/// break-glass admins, and a storm of Secret LISTs on its own few seats; only
/// unauthenticated requests are left to the catch-all.
#[test]
fn the_shipped_rules_place_agents_operators_people_and_the_storm() {
    let set = RuleSet::load_dir(&shipped()).unwrap();
    let route = |name: &str, groups: &[&str], verb: &str, path: &str| {
        let groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        let user = if groups.iter().any(|g| g == "system:unauthenticated") {
            // As Bulwark sees a request on the anonymous allowlist: not authenticated.
            User {
                username: name.to_owned(),
                groups,
                ..User::default()
            }
        } else {
            rules::cli_user(name, &groups)
        };
        let m = set.matches(&user, &rules::request_for(verb, path).unwrap());
        (m.rule.to_string(), m.level.name.clone())
    };
    let cases: [Placed; 10] = [
        (
            "system:serviceaccount:kube-system:cilium",
            &[],
            "watch",
            "/api/v1/pods",
            "cni-agents",
            "system",
        ),
        (
            "system:serviceaccount:kube-system:ebs-csi-node-sa",
            &[],
            "get",
            "/api/v1/nodes/n1",
            "csi-node-plugins",
            "system",
        ),
        (
            "system:serviceaccount:monitoring:kube-state-metrics",
            &[],
            "list",
            "/api/v1/secrets",
            "monitoring-agents",
            "node-agents",
        ),
        (
            "system:serviceaccount:kube-system:fluent-bit",
            &[],
            "watch",
            "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1",
            "logging-agents",
            "node-agents",
        ),
        (
            "system:serviceaccount:cert-manager:cert-manager",
            &[],
            "update",
            "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/cert-manager-controller",
            "workload-leader-election",
            "leader-election",
        ),
        (
            "system:serviceaccount:cert-manager:cert-manager",
            &[],
            "watch",
            "/apis/cert-manager.io/v1/certificates",
            "operators",
            "workload-low",
        ),
        (
            "system:serviceaccount:tenant-3:secret-reader",
            &[],
            "list",
            "/api/v1/secrets",
            "cluster-wide-secret-lists",
            "list-heavy",
        ),
        (
            "alice",
            &["developers"],
            "get",
            "/api/v1/namespaces/default/pods/web-1",
            "people",
            "global-default",
        ),
        (
            "root",
            &["system:masters"],
            "delete",
            "/api/v1/nodes/n1",
            "cluster-admins",
            "exempt",
        ),
        (
            "system:anonymous",
            &["system:unauthenticated"],
            "get",
            "/version",
            "catch-all",
            "catch-all",
        ),
    ];
    for (name, groups, verb, path, rule, level) in cases {
        assert_eq!(
            route(name, groups, verb, path),
            (rule.to_owned(), level.to_owned()),
            "{name} {verb} {path}"
        );
    }
}

fn reloads(metrics: &Metrics, result: &str) -> u64 {
    metrics
        .rules_reload_total
        .with_label_values(&[result])
        .get()
}

fn loaded_hash(metrics: &Metrics) -> Vec<String> {
    metrics
        .registry()
        .gather()
        .iter()
        .filter(|family| family.name() == "bulwark_rules_loaded_info")
        .flat_map(|family| family.get_metric().to_vec())
        .filter(|m| m.get_gauge().get_value() == 1.0)
        .flat_map(|m| m.get_label().to_vec())
        .map(|l| l.value().to_owned())
        .collect()
}

#[test]
fn a_bad_reload_keeps_the_running_rules_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    replace_files(&examples(), dir.path());
    let metrics = Metrics::new();
    let rules = Rules::new(
        RuleSet::load_dir(dir.path()).unwrap(),
        Some(dir.path().to_owned()),
        metrics.clone(),
    );
    let running = rules.current().hash().to_owned();
    assert_eq!(loaded_hash(&metrics), vec![running.clone()]);
    assert_eq!(metrics.rules_stale.get(), 0);

    for (n, case) in BAD_CASES.iter().enumerate() {
        replace_files(&testdata().join(case), dir.path());
        let problems = rules.reload().unwrap_err();
        assert!(!problems.is_empty(), "{case}");
        assert_eq!(rules.current().hash(), running, "{case} replaced the rules");
        assert_eq!(reloads(&metrics, "error"), n as u64 + 1);
        assert_eq!(loaded_hash(&metrics), vec![running.clone()]);
        // The files on disk are not the rules in force, for as long as they stay bad.
        assert_eq!(metrics.rules_stale.get(), 1, "{case}");
    }
    // A 10 MB file and an emptied folder, too.
    replace_files(&examples(), dir.path());
    fs::File::create(dir.path().join("big.yaml"))
        .unwrap()
        .set_len(10 << 20)
        .unwrap();
    assert!(rules.reload().is_err());
    for entry in fs::read_dir(dir.path()).unwrap() {
        fs::remove_file(entry.unwrap().path()).unwrap();
    }
    assert!(rules.reload().is_err());
    assert_eq!(rules.current().hash(), running);
    assert_eq!(reloads(&metrics, "success"), 0);

    // Good rules again, changed: swapped in, counted, announced.
    replace_files(&examples(), dir.path());
    fs::remove_file(dir.path().join("monitoring.yaml")).unwrap();
    let mut changes = rules.subscribe();
    rules.reload().unwrap();
    assert_ne!(rules.current().hash(), running);
    assert!(!rules.current().rule_names().contains(&"monitoring"));
    assert_eq!(reloads(&metrics, "success"), 1);
    assert_eq!(metrics.rules_stale.get(), 0);
    assert_eq!(loaded_hash(&metrics), [rules.current().hash().to_owned()]);
    assert!(changes.has_changed().unwrap());
    assert_eq!(changes.borrow_and_update().hash(), rules.current().hash());
}

/// Waits (real time, bounded) until a new rule set is announced.
async fn next_set(changes: &mut tokio::sync::watch::Receiver<Arc<RuleSet>>) -> Arc<RuleSet> {
    tokio::time::timeout(Duration::from_secs(10), changes.changed())
        .await
        .expect("a reload within 10 s")
        .expect("rules alive");
    changes.borrow_and_update().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_file_is_reloaded_and_a_bad_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    replace_files(&examples(), dir.path());
    let metrics = Metrics::new();
    let rules = Rules::new(
        RuleSet::load_dir(dir.path()).unwrap(),
        Some(dir.path().to_owned()),
        metrics.clone(),
    );
    let mut changes = rules.subscribe();
    rules.spawn_watch();

    fs::write(
        dir.path().join("team.yaml"),
        "rules:\n  - {name: team, precedence: 900, match: {groups: [team]}, level: agents}\n",
    )
    .unwrap();
    let set = next_set(&mut changes).await;
    assert!(set.rule_names().contains(&"team"));
    assert_eq!(rules.current().hash(), set.hash());

    // A bad edit: counted as an error, the running rules stay.
    let errors = reloads(&metrics, "error");
    fs::write(
        dir.path().join("team.yaml"),
        "rules:\n  - {name: team, level: nope}\n",
    )
    .unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while reloads(&metrics, "error") == errors {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the bad edit is seen within 10 s");
    assert_eq!(rules.current().hash(), set.hash());
    assert!(!changes.has_changed().unwrap());
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let text = |name: &str| fs::read_to_string(examples().join(name)).unwrap();
    let files = |kubelet_qps: u32| {
        vec![
            ("levels.yaml", text("levels.yaml")),
            (
                "kubelets.yaml",
                text("kubelets.yaml").replace("qps: 50", &format!("qps: {kubelet_qps}")),
            ),
        ]
    };
    configmap_update(dir.path(), "..2026_06_01_12_00_00.000000001", &files(50));
    let rules = Rules::new(
        RuleSet::load_dir(dir.path()).unwrap(),
        Some(dir.path().to_owned()),
        Metrics::new(),
    );
    let mut changes = rules.subscribe();
    rules.spawn_watch();

    configmap_update(dir.path(), "..2026_06_01_12_05_00.000000002", &files(7));
    let set = next_set(&mut changes).await;
    let info = rules::request_for("list", "/api/v1/pods").unwrap();
    let m = set.matches(&user("system:node:n", &["system:nodes"]), &info);
    assert_eq!(m.rate.map(|r| r.qps), Some(7.0));
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_rules() {
    let dir = tempfile::tempdir().unwrap();
    replace_files(&examples(), dir.path());
    let rules = Rules::new(
        RuleSet::load_dir(dir.path()).unwrap(),
        Some(dir.path().to_owned()),
        Metrics::new(),
    );
    let mut changes = rules.subscribe();
    // Written before the watch starts, so only the signal can pick it up.
    fs::remove_file(dir.path().join("monitoring.yaml")).unwrap();
    rules.spawn_watch();
    // Through kill(1): the workspace forbids `unsafe`, and tokio handles SIGHUP by now.
    assert_eq!(send_sighup_to_self(), 0);
    let set = next_set(&mut changes).await;
    assert!(!set.rule_names().contains(&"monitoring"));
}

#[cfg(unix)]
fn send_sighup_to_self() -> i32 {
    std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .map(|s| s.code().unwrap_or(-1))
        .unwrap_or(-1)
}

#[test]
fn every_mistake_of_a_folder_is_reported_in_one_check() {
    let dir = testdata().join("mistakes");
    let checked = rules::check(&dir, DEFAULT_MAX_STALENESS);
    let strip = |p: &rules::RuleProblem| {
        p.to_string()
            .replace(&format!("{}/", testdata().display()), "")
    };
    let errors: Vec<String> = checked.errors.iter().map(strip).collect();
    let warnings: Vec<String> = checked.warnings.iter().map(strip).collect();
    assert!(checked.summary.is_none());
    let expect_errors = [
        "mistakes/a-levels-and-rules.yaml:53:12: rule misspelt-level: level: \"list-hevy\" is not defined, did you mean \"list-heavy\"?",
        "mistakes/a-levels-and-rules.yaml:55:17: rules[7].precedence: invalid type: string \"high\", expected an integer",
        "mistakes/a-levels-and-rules.yaml:63:17: rule zero-rate: rate.qps: must be above 0, got 0",
        "mistakes/b-tabs.yaml:3:1: tabs are not allowed for indentation in YAML; use spaces",
        "mistakes/c-syntax.yaml:6:10: rules[0]: did not find expected ',' or ']'",
        "mistakes/c-syntax.yaml:9:5: rules[1]: unknown field `levle`",
    ];
    assert_eq!(errors.len(), expect_errors.len(), "{errors:#?}");
    for (got, want) in errors.iter().zip(expect_errors) {
        assert!(got.starts_with(want), "{got}\nwanted {want}");
    }
    let expect_warnings = [
        "a-levels-and-rules.yaml:13:17: rule team-lists is unreachable: rule everyone-reads (",
        "a-levels-and-rules.yaml:23:27: rule core-group: match.resources[0].group: \"core\" is not an API group",
        "a-levels-and-rules.yaml:31:33: rule names: match.resources[0].resource: resource names are plural: \"pod\" in group \"\" is never requested, did you mean \"pods\"?",
        "a-levels-and-rules.yaml:32:35: rule names: match.resources[1].resource: unknown resource \"deploymnets\" in group \"apps\", did you mean \"deployments\"?",
        "a-levels-and-rules.yaml:33:19: rule names: match.resources[2].group: unknown API group \"aps\", did you mean \"apps\"?",
        "a-levels-and-rules.yaml:41:16: rule too-stale: staleness 1m is above cache.maxStaleness (10s)",
        "a-levels-and-rules.yaml:48:11: rule shadow-nothing: mode shadow with no rate and no watches",
    ];
    assert_eq!(warnings.len(), expect_warnings.len(), "{warnings:#?}");
    for (got, want) in warnings.iter().zip(expect_warnings) {
        assert!(
            got.starts_with(&format!("mistakes/{want}")),
            "{got}\nwanted {want}"
        );
    }
    // A larger cap from the configuration silences the staleness warning.
    let relaxed = rules::check(&dir, Duration::from_secs(120));
    assert!(
        !relaxed
            .warnings
            .iter()
            .any(|w| w.message.contains("staleness"))
    );
}
