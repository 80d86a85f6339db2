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
