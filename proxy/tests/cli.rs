//! The `bulwark` binary refuses a bad configuration before serving anything.

use std::process::Command;

fn bulwark(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(args)
        .output()
        .expect("bulwark runs")
}

#[test]
fn an_invalid_config_prints_one_line_per_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(
        &path,
        "listen:\n  address: 127.0.0.1:0\n  cert: a.crt\n  key: a.key\n  goawayChance: 0.5\n\
         upstream:\n  replicas: []\n  ca: ca.crt\n  self: {tokenFile: t}\nidentity:\n  mode: impersonate\n",
    )
    .unwrap();
    let out = bulwark(&["serve", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let problems: Vec<&str> = stderr.lines().filter(|l| l.contains("bad.yaml")).collect();
    assert_eq!(problems.len(), 2, "{stderr}");
    assert!(stderr.contains("upstream.replicas"), "{stderr}");
    assert!(stderr.contains("listen.goawayChance"), "{stderr}");
}

#[test]
fn an_unknown_field_is_named_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.yaml");
    std::fs::write(
        &path,
        "listen:\n  address: 127.0.0.1:0\n  cert: a.crt\n  key: a.key\n  goawayChanse: 0.001\n\
         upstream:\n  replicas: [\"127.0.0.1:6443\"]\n  ca: ca.crt\n  self: {tokenFile: t}\n",
    )
    .unwrap();
    let out = bulwark(&["serve", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("goawayChanse"), "{stderr}");
}

#[test]
fn a_missing_config_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing.yaml");
    let out = bulwark(&["serve", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.yaml"));
}

#[test]
fn rules_check_reports_every_mistake_of_a_folder_in_one_run() {
    let dir = bulwark_testkit::repo_path("rules/testdata/mistakes");
    let out = bulwark(&["rules", "check", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for message in [
        "a-levels-and-rules.yaml:13:17: warning: rule team-lists is unreachable",
        "\"core\" is not an API group",
        "did you mean \"pods\"?",
        "unknown resource \"deploymnets\" in group \"apps\", did you mean \"deployments\"?",
        "unknown API group \"aps\", did you mean \"apps\"?",
        "warning: rule too-stale: staleness 1m is above cache.maxStaleness (10s)",
        "warning: rule shadow-nothing: mode shadow with no rate and no watches",
        "level: \"list-hevy\" is not defined, did you mean \"list-heavy\"?",
        "a-levels-and-rules.yaml:55:17: rules[7].precedence: invalid type",
        "a-levels-and-rules.yaml:63:17: rule zero-rate: rate.qps: must be above 0",
        "b-tabs.yaml:3:1: tabs are not allowed for indentation in YAML; use spaces",
        "c-syntax.yaml:6:10: rules[0]: did not find expected ',' or ']'",
        "c-syntax.yaml:9:5: rules[1]: unknown field `levle`",
    ] {
        assert!(
            stderr.contains(message),
            "missing {message:?} in:\n{stderr}"
        );
    }
    assert!(!stderr.contains("cannot start any token"), "{stderr}");
}

#[test]
fn rules_check_warnings_alone_exit_0_unless_strict() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("r.yaml"),
        "rules:\n  - name: stale\n    precedence: 5\n    level: catch-all\n    staleness: 30s\n",
    )
    .unwrap();
    let path = dir.path().to_str().unwrap();
    let out = bulwark(&["rules", "check", path]);
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: rule stale: staleness 30s"),
        "{stderr}"
    );
    assert_eq!(
        bulwark(&["rules", "check", "--strict", path]).status.code(),
        Some(1)
    );
    // The configuration's cap is used when given.
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("bulwark.yaml");
    std::fs::write(
        &config,
        "listen:\n  address: 127.0.0.1:0\n  cert: a.crt\n  key: a.key\n\
         upstream:\n  replicas: [\"127.0.0.1:6443\"]\n  ca: ca.crt\n  self: {tokenFile: t}\n\
         identity:\n  mode: impersonate\ncache:\n  maxStaleness: 1m\n",
    )
    .unwrap();
    let out = bulwark(&[
        "rules",
        "check",
        "--strict",
        "--config",
        config.to_str().unwrap(),
        path,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `rules explain --config FILE` explains under the configuration's `rules.mode`: a rule's
/// own `mode: enforce` overridden by `shadow` is said so.
#[test]
fn rules_explain_says_when_rules_mode_overrides_a_rule() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bulwark.yaml");
    std::fs::write(
        &config,
        "listen:\n  address: 127.0.0.1:0\n  cert: a.crt\n  key: a.key\n\
         upstream:\n  replicas: [\"127.0.0.1:6443\"]\n  ca: ca.crt\n  self: {tokenFile: t}\n\
         identity:\n  mode: impersonate\nrules:\n  mode: shadow\n",
    )
    .unwrap();
    let examples = bulwark_testkit::repo_path("rules/examples");
    let explain = |config: Option<&std::path::Path>| {
        let mut args = vec!["rules", "explain", examples.to_str().unwrap()];
        if let Some(config) = config {
            args.extend(["--config", config.to_str().unwrap()]);
        }
        args.extend([
            "--user",
            "system:serviceaccount:ops:secret-sync",
            "list",
            "/api/v1/secrets",
        ]);
        let out = bulwark(&args);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let shadow = explain(Some(&config));
    assert!(
        shadow.contains(
            "mode: shadow (rules.mode: shadow in Bulwark's configuration overrides the rule's enforce)"
        ),
        "{shadow}"
    );
    let own = explain(None);
    assert!(own.contains("  mode: enforce\n"), "{own}");
}

/// The shipped example configuration, copied to `root/proxy/` so that its relative paths
/// (`../certs/dev/...`, `../rules/examples`, `../var/...`) land under `root`.
fn example_under(root: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(root.join("proxy")).unwrap();
    let path = root.join("proxy/bulwark.example.yaml");
    std::fs::copy(
        bulwark_testkit::repo_path("proxy/bulwark.example.yaml"),
        &path,
    )
    .unwrap();
    path
}

/// The line of the example configuration that sets a path ending in `file` (not a comment).
fn example_line(file: &str) -> usize {
    let example = include_str!("../bulwark.example.yaml");
    1 + example
        .lines()
        .position(|l| !l.trim_start().starts_with('#') && l.contains(file))
        .unwrap_or_else(|| panic!("the example sets no {file}"))
}

#[test]
fn check_config_names_every_missing_file_of_the_example_and_exits_2() {
    let root = tempfile::tempdir().unwrap();
    let config = example_under(root.path());
    let out = bulwark(&["check-config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for (field, file) in [
        ("listen.cert", "certs/dev/bulwark.crt"),
        ("listen.key", "certs/dev/bulwark.key"),
        ("listen.clientCA", "certs/dev/client-ca.crt"),
        ("upstream.ca", "certs/dev/apiserver-ca.crt"),
        (
            "upstream.frontProxy.cert",
            "certs/dev/front-proxy-client.crt",
        ),
        (
            "upstream.frontProxy.key",
            "certs/dev/front-proxy-client.key",
        ),
        ("upstream.self.cert", "certs/dev/bulwark-client.crt"),
        ("upstream.self.key", "certs/dev/bulwark-client.key"),
    ] {
        let line = example_line(file);
        let want = format!("bulwark.example.yaml:{line}: {field}: cannot read ");
        let found = stderr
            .lines()
            .any(|l| l.contains(&want) && l.contains(file));
        assert!(found, "no line for {field} ({file}) in:\n{stderr}");
    }
    assert!(stderr.contains("rules.folder: "), "{stderr}");
    assert!(stderr.contains("audit.path: the folder"), "{stderr}");
}

#[test]
fn check_config_passes_the_example_with_its_files_and_finds_a_wrong_key() {
    let root = tempfile::tempdir().unwrap();
    let config = example_under(root.path());
    let certs = root.path().join("certs/dev");
    let out = bulwark(&[
        "certs",
        "init",
        "--dir",
        certs.to_str().unwrap(),
        "--server-name",
        "localhost",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::copy(certs.join("ca.crt"), certs.join("apiserver-ca.crt")).unwrap();
    std::fs::create_dir_all(root.path().join("var")).unwrap();
    let rules = root.path().join("rules/examples");
    std::fs::create_dir_all(&rules).unwrap();
    for entry in std::fs::read_dir(bulwark_testkit::repo_path("rules/examples")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), rules.join(entry.file_name())).unwrap();
    }
    let out = bulwark(&["check-config", config.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The serving key replaced by another key, a CA that is not PEM, a broken rule file.
    std::fs::copy(
        certs.join("front-proxy-client.key"),
        certs.join("bulwark.key"),
    )
    .unwrap();
    std::fs::write(certs.join("apiserver-ca.crt"), "not a certificate\n").unwrap();
    std::fs::write(
        rules.join("zz-broken.yaml"),
        "rules:\n  - name: x\n    precedence: 0\n    level: catch-all\n",
    )
    .unwrap();
    let out = bulwark(&["check-config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "bulwark.example.yaml:{}: listen.key: ",
            example_line("certs/dev/bulwark.key")
        )) && stderr.contains("does not hold the private key of the certificate in"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "bulwark.example.yaml:{}: upstream.ca: ",
            example_line("certs/dev/apiserver-ca.crt")
        )) && stderr.contains("no PEM certificate in the file"),
        "{stderr}"
    );
    assert!(
        stderr.contains("zz-broken.yaml:3:17: rule x: precedence: must be at least 1"),
        "{stderr}"
    );
}

#[test]
fn check_config_names_the_file_of_a_yaml_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, "listen:\n  address: [\n").unwrap();
    let out = bulwark(&["check-config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("broken.yaml:"), "{stderr}");
}

#[test]
fn check_config_wants_what_pods_dial_in_the_serving_certificate_and_certs_init_makes_it() {
    let root = tempfile::tempdir().unwrap();
    let config = example_under(root.path());
    let certs = root.path().join("certs/dev");
    let init = |extra: &[&str]| {
        let mut args = vec![
            "certs",
            "init",
            "--dir",
            certs.to_str().unwrap(),
            "--server-name",
            "localhost",
        ];
        args.extend_from_slice(extra);
        let out = bulwark(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    init(&[]);
    std::fs::copy(certs.join("ca.crt"), certs.join("apiserver-ca.crt")).unwrap();
    std::fs::create_dir_all(root.path().join("var")).unwrap();
    let rules = root.path().join("rules/examples");
    std::fs::create_dir_all(&rules).unwrap();
    for entry in std::fs::read_dir(bulwark_testkit::repo_path("rules/examples")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), rules.join(entry.file_name())).unwrap();
    }
    let key = root.path().join("fleet.key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef\n").unwrap();
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!(
        "fleet:\n  namespace: bulwark\n  keyFile: {}\n  kubernetesService:\n    \
         apiservers: [\"10.0.0.1:6443\"]\n",
        key.display()
    ));
    std::fs::write(&config, text).unwrap();
    let check = || bulwark(&["check-config", config.to_str().unwrap()]);

    // A certificate for localhost alone: pods would refuse it by every name they dial.
    let out = check();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "pods dial the kubernetes Service by names this certificate does not hold: \
             kubernetes, kubernetes.default, kubernetes.default.svc, \
             kubernetes.default.svc.cluster.local, 10.96.0.1"
        ),
        "{stderr}"
    );

    // `--in-cluster` names them all, from the same CA.
    init(&["--in-cluster", "10.96.0.1"]);
    let out = check();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A cluster CA that did not sign it: refused whatever the names.
    let other = root.path().join("other");
    let out = bulwark(&[
        "certs",
        "init",
        "--dir",
        other.to_str().unwrap(),
        "--server-name",
        "x",
    ]);
    assert!(out.status.success());
    std::fs::copy(other.join("ca.crt"), certs.join("apiserver-ca.crt")).unwrap();
    let out = check();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("check it against the cluster CA") && stderr.contains("would refuse it"),
        "{stderr}"
    );
}

#[test]
fn rules_explain_takes_a_credential_s_extras_and_the_client_s_address() {
    let dir = bulwark_testkit::repo_path("rules/examples");
    let proxy = "system:serviceaccount:kube-system:kube-proxy";
    let explain = |more: &[&str]| {
        let mut args = vec!["rules", "explain", dir.to_str().unwrap(), "--user", proxy];
        args.extend(more);
        args.extend(["watch", "/api/v1/services"]);
        bulwark(&args)
    };
    let out = explain(&["--extra", "authentication.kubernetes.io/node-name=node-1"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "  flow: node, key kube-proxy/{proxy}/node:node-1\n"
        )),
        "{stdout}"
    );
    let out = explain(&["--source", "10.0.0.1"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "  flow: node, key kube-proxy/{proxy}/addr:10.0.0.1 \
             (no node-name claim: keyed by source address)\n"
        )),
        "{stdout}"
    );
    let out = explain(&["--extra", "no-value"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected KEY=VALUE"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
