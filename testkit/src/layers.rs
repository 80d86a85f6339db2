//! The module graph of a crate's `src`, read from its source text: which top-level modules
//! import which, and the loops among them. The proxy's and the load tester's layering
//! tests (`proxy/tests/layers.rs`, `loadtest/runner/tests/layers.rs`) read their crates
//! with it, so that a new `use crate::...` that closes a loop fails with the loop it closes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The top-level modules of a crate and the imports between them.
pub struct Graph {
    /// Each module and the modules it imports.
    pub edges: BTreeMap<String, BTreeSet<String>>,
    /// Each edge and the files (relative to `src`) that make it.
    pub by: BTreeMap<(String, String), Vec<String>>,
}

impl Graph {
    /// Reads `src`, leaving out the imports listed in `known`: (importing file, relative to
    /// `src`; imported top-level module; why it is still there).
    pub fn read(src: &Path, known: &[(&str, &str, &str)]) -> Graph {
        let modules = modules(src);
        let mut by: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (module, files) in &modules {
            edges.entry(module.clone()).or_default();
            for file in files {
                let relative = file
                    .strip_prefix(src)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                let code = std::fs::read_to_string(file).unwrap();
                for target in imports(&code) {
                    if &target == module || !modules.contains_key(&target) {
                        continue;
                    }
                    if known.iter().any(|(f, t, _)| *f == relative && *t == target) {
                        continue;
                    }
                    edges.get_mut(module).unwrap().insert(target.clone());
                    by.entry((module.clone(), target))
                        .or_default()
                        .push(relative.clone());
                }
            }
        }
        Graph { edges, by }
    }

    /// The modules `module` imports (none for a module that is not there).
    pub fn imports_of(&self, module: &str) -> BTreeSet<String> {
        self.edges.get(module).cloned().unwrap_or_default()
    }

    /// The files that make the edge `from -> to`.
    pub fn files(&self, from: &str, to: &str) -> Vec<String> {
        self.by
            .get(&(from.to_owned(), to.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// Each loop (a strongly connected component of more than one module) with the edges
    /// and files that make it; empty when there is none.
    pub fn loops_report(&self) -> String {
        let mut report = String::new();
        for component in &loops(&self.edges) {
            report.push_str(&format!("a loop through {component:?}:\n"));
            for from in component {
                for to in &self.edges[from] {
                    if component.contains(to) {
                        let files = &self.by[&(from.clone(), to.clone())];
                        report.push_str(&format!("  {from} -> {to} ({})\n", files.join(", ")));
                    }
                }
            }
        }
        report
    }
}

/// Every file of `src`'s top-level modules (`lib.rs` and `main.rs` left out).
pub fn files(src: &Path) -> Vec<PathBuf> {
    modules(src).into_values().flatten().collect()
}

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
pub fn imports(code: &str) -> BTreeSet<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imports_are_read_from_paths_and_groups_but_not_comments() {
        let code = "use crate::a::B;\nuse crate::{b, c::{D, E}, d};\n// crate::e\nlet x = crate::f::g();\nfoo::crate::h;";
        let found: Vec<_> = imports(code).into_iter().collect();
        assert_eq!(found, ["a", "b", "c", "d", "f"]);
    }

    #[test]
    fn a_loop_is_found_and_a_chain_is_not() {
        let graph = |pairs: &[(&str, &str)]| {
            let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for (a, b) in pairs {
                edges.entry((*a).into()).or_default().insert((*b).into());
                edges.entry((*b).into()).or_default();
            }
            edges
        };
        assert!(loops(&graph(&[("a", "b"), ("b", "c")])).is_empty());
        assert_eq!(
            loops(&graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])),
            [["a", "b", "c"]]
        );
    }
}
