//! The scenario reference pages (`scenarios/*.md`) against what they describe: each shows
//! its recorded results' figures as the runner draws them, each scenario has a page, each
//! recorded result is named by a page or the journal, and only the HTML report the README
//! shows is committed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulwark_loadtest::reference;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn files(dir: &Path, ext: &str) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
        .collect()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether `text` names the file `name` (not as the end of a longer name).
fn names(text: &str, name: &str) -> bool {
    text.match_indices(name).any(|(at, _)| {
        !text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn every_page_shows_its_results_figures() {
    let stale = reference::run(&reference::pages_dir(), true).unwrap();
    assert!(
        stale.is_empty(),
        "out of date (run `cargo run -p bulwark-loadtest -- reference`): {stale:?}"
    );
}

#[test]
fn every_scenario_has_a_page() {
    let help = Command::new(env!("CARGO_BIN_EXE_bulwark-loadtest"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    // The subcommands that are tools, not scenarios.
    let tools = [
        "sandbox",
        "controlplane",
        "report",
        "reference",
        "calibrate",
        "help",
    ];
    let scenarios: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| !tools.contains(name))
        .collect();
    assert!(
        scenarios.contains(&"list-storm") && scenarios.contains(&"cluster"),
        "{help}"
    );
    let pages = files(&reference::pages_dir(), "md");
    for scenario in &scenarios {
        assert!(
            pages.contains(&format!("{scenario}.md")),
            "scenarios/{scenario}.md is missing"
        );
    }
    let index = read(&reference::pages_dir().join("README.md"));
    for page in pages.iter().filter(|p| *p != "README.md") {
        assert!(
            index.contains(&format!("`{page}`")),
            "scenarios/README.md does not list {page}"
        );
    }
}

#[test]
fn every_recorded_result_is_named_by_a_page_or_the_journal() {
    let pages = reference::pages_dir();
    let mut named: BTreeSet<String> = files(&pages, "md")
        .iter()
        .flat_map(|p| reference::named(&read(&pages.join(p))))
        .collect();
    let results = reference::results_dir(&pages);
    for name in &named {
        assert!(
            results.join(name).exists(),
            "a page names {name}, which is not recorded"
        );
    }
    let journal = read(&root().join("docs/journal.md"));
    named.extend(
        files(&results, "json")
            .into_iter()
            .filter(|f| names(&journal, f)),
    );
    let orphans: Vec<String> = files(&results, "json")
        .into_iter()
        .filter(|f| !named.contains(f))
        .collect();
    assert!(orphans.is_empty(), "results nothing names: {orphans:?}");
}

#[test]
fn only_the_html_report_the_readme_shows_is_committed() {
    let readme = read(&root().join("README.md"));
    let results = reference::results_dir(&reference::pages_dir());
    let html = files(&results, "html");
    assert!(!html.is_empty(), "the README's report is committed");
    for report in html {
        assert!(
            readme.contains(&report),
            "results/{report} is committed but the README does not show it: draw it with `bulwark-loadtest report`"
        );
    }
}
