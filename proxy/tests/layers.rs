//! The modules of `proxy/src` import each other without a cycle: the request path
//! (`stages`) sits above the domain modules, `status` is a leaf they all may use, and each
//! domain module only imports the ones below it. Read from the source text, so that a new
//! `use crate::...` that closes a loop fails here with the loop it closes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Imports that close a loop, each with why it is still there. Only test code may be
/// listed: (importing file, relative to `proxy/src`; imported top-level module).
const KNOWN: &[(&str, &str, &str)] = &[(
    "fleet/tests.rs",
    "admit",
    "the fleet's rate tests drive admission's token buckets (admit::flows) across replicas",
)];

/// Every top-level module of `src` (a `foo.rs` beside `lib.rs`) and the files it is made of.
fn modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        if module == "lib" || module == "main" {
            continue;
        }
        let mut files = vec![path.clone()];
        collect(&src.join(module), &mut files);
        modules.insert(module.to_owned(), files);
    }
    modules
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The top-level modules `code` names as `crate::name` or in `crate::{name, ...}`, comments
/// left out (a doc link is no import).
fn imports(code: &str) -> BTreeSet<String> {
    let code: String = code
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$' || c == ':') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            // The first name of every item at the group's own depth.
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.insert(first_name(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            found.insert(first_name(&item));
        } else {
            found.insert(first_name(rest));
        }
    }
    found.remove("");
    found
}

fn first_name(text: &str) -> String {
    text.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn loops(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(walk: &mut Walk<'a>, v: &'a str) {
        let n = walk.index.len();
        walk.index.insert(v, n);
        walk.low.insert(v, n);
        walk.stack.push(v);
        for w in &walk.edges[v] {
            let w = w.as_str();
            if !walk.index.contains_key(w) {
                visit(walk, w);
                let low = walk.low[v].min(walk.low[w]);
                walk.low.insert(v, low);
            } else if walk.stack.contains(&w) {
                let low = walk.low[v].min(walk.index[w]);
                walk.low.insert(v, low);
            }
        }
        if walk.low[v] == walk.index[v] {
            let mut component = Vec::new();
            while let Some(w) = walk.stack.pop() {
                component.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                walk.found.push(component);
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            visit(&mut walk, v);
        }
    }
    walk.found
}

#[test]
fn the_top_level_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    assert!(modules.contains_key("stages") && modules.contains_key("status"));
    // Each edge with the files that make it.
    let mut by: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, files) in &modules {
        edges.entry(module.clone()).or_default();
        for file in files {
            let relative = file
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let code = std::fs::read_to_string(file).unwrap();
            for target in imports(&code) {
                if &target == module || !modules.contains_key(&target) {
                    continue;
                }
                if KNOWN.iter().any(|(f, t, _)| *f == relative && *t == target) {
                    continue;
                }
                edges.get_mut(module).unwrap().insert(target.clone());
                by.entry((module.clone(), target))
                    .or_default()
                    .push(relative.clone());
            }
        }
    }
    let found = loops(&edges);
    let mut report = String::new();
    for component in &found {
        report.push_str(&format!("a loop through {component:?}:\n"));
        for from in component {
            for to in &edges[from] {
                if component.contains(to) {
                    let files = &by[&(from.clone(), to.clone())];
                    report.push_str(&format!("  {from} -> {to} ({})\n", files.join(", ")));
                }
            }
        }
    }
    assert!(found.is_empty(), "{report}");
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
    for files in modules(&src).values() {
        for file in files {
            let code = std::fs::read_to_string(file).unwrap();
            if code.contains("UpstreamCredential::Own") {
                let relative = file.strip_prefix(&src).unwrap().to_string_lossy();
                naming.push(relative.into_owned());
            }
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

#[test]
fn imports_are_read_from_paths_and_groups_but_not_comments() {
    let code = "use crate::a::B;\nuse crate::{b, c::{D, E}, d};\n// crate::e\nlet x = crate::f::g();\nfoo::crate::h;";
    let found: Vec<_> = imports(code).into_iter().collect();
    assert_eq!(found, ["a", "b", "c", "d", "f"]);
}
