//! The load tester is three crates that stand on each other in one direction: the report
//! pipeline (`loadtest/report`) on nothing of the load tester, the real control plane
//! (`loadtest/controlplane`: processes, PKI, kubeconfigs, Bulwark as a process) on the
//! report, and the scenarios and the sandbox (`loadtest/runner`) on both. Cargo refuses a
//! cycle between crates; within each, the modules import each other without one. Read
//! from the source text ([`bulwark_testkit::layers`]), so that a new `use crate::...` that
//! closes a loop fails here with the loop it closes.

use std::path::{Path, PathBuf};

use bulwark_testkit::layers::Graph;

fn loadtest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The names of the crates `crate_dir`'s manifest depends on (normal dependencies only).
fn dependencies(crate_dir: &str) -> Vec<String> {
    let manifest = std::fs::read_to_string(loadtest().join(crate_dir).join("Cargo.toml")).unwrap();
    manifest
        .split("\n[dependencies]\n")
        .nth(1)
        .expect("a [dependencies] table")
        .lines()
        .take_while(|l| !l.starts_with('['))
        .filter_map(|l| l.split(['.', ' ', '=']).next())
        .filter(|name| !name.is_empty() && !name.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_load_tester_s_crates_stand_on_each_other_in_one_direction() {
    let report = dependencies("report");
    assert!(
        report.iter().all(|d| !d.starts_with("bulwark")),
        "the report pipeline depends on {report:?}"
    );
    let controlplane = dependencies("controlplane");
    assert!(controlplane.contains(&"bulwark-report".to_owned()));
    assert!(
        !controlplane.contains(&"bulwark-loadtest".to_owned()),
        "{controlplane:?}"
    );
    let runner = dependencies("runner");
    for needed in ["bulwark-controlplane", "bulwark-report"] {
        assert!(runner.contains(&needed.to_owned()), "{runner:?}");
    }
}

#[test]
fn within_each_crate_the_modules_import_each_other_without_a_cycle() {
    for crate_dir in ["report", "controlplane", "runner"] {
        let graph = Graph::read(&loadtest().join(crate_dir).join("src"), &[]);
        assert!(!graph.edges.is_empty(), "{crate_dir}: its modules are read");
        let report = graph.loops_report();
        assert!(report.is_empty(), "{crate_dir}: {report}");
    }
    // The sandbox is a place to run scenarios in, not a scenario.
    let runner = Graph::read(&loadtest().join("runner/src"), &[]);
    assert!(
        !runner.imports_of("sandbox").contains("scenario"),
        "sandbox imports scenario ({:?})",
        runner.files("sandbox", "scenario")
    );
}
