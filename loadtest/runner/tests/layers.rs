//! The load tester's modules import each other without a cycle: the real control plane and
//! the sandbox stand on the parts they share (the identities and kubeconfigs they hand
//! out, Bulwark as a process, the replicas' samples) and neither on the other nor on the
//! scenarios, which stand on them. Read from the source text
//! ([`bulwark_testkit::layers`]), so that a new `use crate::...` that closes a loop fails
//! here with the loop it closes.

use std::path::Path;

use bulwark_testkit::layers::Graph;

#[test]
fn the_load_tester_s_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = Graph::read(&src, &[]);
    let report = graph.loops_report();
    assert!(report.is_empty(), "{report}");
    for module in ["controlplane", "sandbox", "scenario", "report"] {
        assert!(graph.edges.contains_key(module), "no module {module}");
    }
    // The control plane and the sandbox are places to run scenarios in, not scenarios.
    for (module, banned) in [
        ("controlplane", "scenario"),
        ("controlplane", "sandbox"),
        ("sandbox", "controlplane"),
        ("sandbox", "scenario"),
    ] {
        assert!(
            !graph.imports_of(module).contains(banned),
            "{module} imports {banned} ({:?})",
            graph.files(module, banned)
        );
    }
    // The report pipeline is a leaf every scenario may draw with.
    assert!(
        graph.imports_of("report").is_empty(),
        "report imports {:?}",
        graph.imports_of("report")
    );
}
