//! The layout tables of the README and DESIGN.md against the tree: every folder they name
//! exists, every top-level folder of the repository is in both, and the `proxy/` row names
//! every top-level module of `proxy/src`, so a new module or folder cannot go unlisted.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The rows of the `## Layout` table of `doc`: (first cell, second cell).
fn layout(doc: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join(doc)).unwrap();
    let section = text
        .split("\n## Layout\n")
        .nth(1)
        .unwrap_or_else(|| panic!("{doc} has a `## Layout` section"));
    section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let mut cells = l.trim_matches('|').splitn(2, '|');
            let first = cells.next()?.trim().to_owned();
            let second = cells.next()?.trim().to_owned();
            first.starts_with('`').then_some((first, second))
        })
        .collect()
}

/// The `code` spans of a cell.
fn spans(cell: &str) -> BTreeSet<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The top-level modules of the `bulwark` crate: the library's and the binary's.
fn proxy_modules() -> BTreeSet<String> {
    let mut modules = BTreeSet::new();
    for file in ["proxy/src/lib.rs", "proxy/src/main.rs"] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for line in text.lines() {
            let line = line.trim_start_matches("pub ");
            if let Some(name) = line.strip_prefix("mod ").and_then(|l| l.strip_suffix(';')) {
                modules.insert(name.to_owned());
            }
        }
    }
    modules
}

/// The repository's top-level folders, as a clone has them.
fn top_level_folders() -> BTreeSet<String> {
    let ignored = ["target", "shared"];
    std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
        .filter(|n| !n.starts_with('.') && !ignored.contains(&n.as_str()))
        .collect()
}

fn check(doc: &str) {
    let rows = layout(doc);
    assert!(rows.len() > 5, "{doc}: the layout table is read");
    let mut listed = BTreeSet::new();
    for (first, _) in &rows {
        for path in spans(first) {
            assert!(
                root().join(&path).exists(),
                "{doc} lists `{path}`, which is not in the tree"
            );
            listed.insert(
                path.trim_end_matches('/')
                    .split('/')
                    .next()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    for folder in top_level_folders() {
        assert!(
            listed.contains(&folder),
            "{doc}'s layout table does not list `{folder}/`"
        );
    }
    let (_, proxy) = rows
        .iter()
        .find(|(first, _)| first == "`proxy/`")
        .unwrap_or_else(|| panic!("{doc} has a `proxy/` row"));
    let named = spans(proxy);
    for module in proxy_modules() {
        assert!(
            named.contains(&module),
            "{doc}'s `proxy/` row does not name the module `{module}`"
        );
    }
}

#[test]
fn the_readme_layout_table_matches_the_tree() {
    check("README.md");
}

#[test]
fn the_design_layout_table_matches_the_tree() {
    check("docs/DESIGN.md");
}

#[test]
fn the_modules_are_read() {
    let modules = proxy_modules();
    for module in ["listen", "stages", "serve", "cli"] {
        assert!(modules.contains(module), "{modules:?}");
    }
}
