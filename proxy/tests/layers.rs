//! The modules of `proxy/src` import each other without a cycle: the request path
//! (`stages`) sits above the domain modules, `status` is a leaf they all may use, and each
//! domain module only imports the ones below it. Read from the source text
//! ([`bulwark_testkit::layers`]), so that a new `use crate::...` that closes a loop fails
//! here with the loop it closes.

use std::path::Path;

use bulwark_testkit::layers::Graph;

/// Imports that close a loop, each with why it is still there. Only test code may be
/// listed: (importing file, relative to `proxy/src`; imported top-level module).
const KNOWN: &[(&str, &str, &str)] = &[(
    "fleet/tests.rs",
    "admit",
    "the fleet's rate tests drive admission's token buckets (admit::flows) across replicas",
)];

#[test]
fn the_top_level_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = Graph::read(&src, KNOWN);
    let report = graph.loops_report();
    assert!(report.is_empty(), "{report}");
    let Graph { edges, by } = graph;
    assert!(edges.contains_key("stages") && edges.contains_key("status"));
    // Only the start-up wiring imports the request path, and status imports no module.
    for (module, targets) in &edges {
        assert!(
            module == "serve" || !targets.contains("stages"),
            "{module} imports stages"
        );
    }
    assert!(
        edges["status"].is_empty(),
        "status imports {:?}",
        edges["status"]
    );
    // The configuration is parsed into the runtime's types without the runtime: it
    // imports no other module, so every module may read it.
    assert!(
        edges["config"].is_empty(),
        "config imports {:?}",
        edges["config"]
            .iter()
            .map(|t| (t, &by[&("config".to_owned(), t.clone())]))
            .collect::<Vec<_>>()
    );
    // Bulwark's own calls go through `own`: the cache and the fleet reach the apiservers
    // through it, not through identity's reviews or the pool directly.
    for module in ["cache", "fleet"] {
        for banned in ["identity", "upstream"] {
            assert!(
                !edges[module].contains(banned),
                "{module} imports {banned} ({:?})",
                by[&(module.to_owned(), banned.to_owned())]
            );
        }
    }
    // `own` sits on the pool alone; the configuration and the metrics it builds one from
    // are leaves.
    assert!(
        edges["own"]
            .iter()
            .all(|t| ["upstream", "config", "metrics"].contains(&t.as_str())),
        "own imports {:?}",
        edges["own"]
    );
}

/// One place builds requests with Bulwark's own credential: `own`. The pool itself (its
/// probes) and identity forwarding in impersonate mode (a client's request, sent as
/// Bulwark impersonating it) are the only others that name it.
#[test]
fn only_the_own_client_sends_with_bulwarks_own_credential() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut naming = Vec::new();
    for file in bulwark_testkit::layers::files(&src) {
        let code = std::fs::read_to_string(&file).unwrap();
        if code.contains("UpstreamCredential::Own") {
            let relative = file.strip_prefix(&src).unwrap().to_string_lossy();
            naming.push(relative.into_owned());
        }
    }
    naming.sort();
    for file in &naming {
        assert!(
            file == "own.rs" || file == "identity/forward.rs" || file.starts_with("upstream"),
            "{file} sends as Bulwark itself"
        );
    }
    assert!(naming.contains(&"own.rs".to_owned()), "{naming:?}");
}
