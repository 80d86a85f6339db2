//! Programs from outside the repository that some tests drive (a browser, haproxy,
//! promtool, h2load and nginx, curl, jq and openssl): found on `PATH`, or the test is
//! skipped and says so where its output is read.
//!
//! A test that cannot run writes `SKIPPED <test>: <why>` straight to the process's stderr,
//! past the harness's capture, so `cargo test` shows it beside the test's `ok` rather than
//! hiding it. With `BULWARK_REQUIRE_TOOLS=1` (CI sets it, after installing them all) a
//! missing program fails the test instead.

use std::io::Write as _;
use std::path::PathBuf;

/// The variable that turns a skip into a failure.
pub const REQUIRE: &str = "BULWARK_REQUIRE_TOOLS";

/// `program` on `PATH`, or `None` after [`skip`] with `install` as the hint.
pub fn find(program: &str, install: &str) -> Option<PathBuf> {
    let found = on_path(program);
    if found.is_none() {
        skip(&format!("{program} is not on PATH ({install})"));
    }
    found
}

/// Every one of `programs` on `PATH` (each with its hint), or `None` after one [`skip`]
/// naming those missing.
pub fn find_all<const N: usize>(programs: [(&str, &str); N]) -> Option<[PathBuf; N]> {
    let missing: Vec<String> = programs
        .iter()
        .filter(|(program, _)| on_path(program).is_none())
        .map(|(program, install)| format!("{program} ({install})"))
        .collect();
    if !missing.is_empty() {
        skip(&format!("not on PATH: {}", missing.join(", ")));
        return None;
    }
    Some(programs.map(|(program, _)| on_path(program).expect("found above")))
}

/// `program` on `PATH`, or `None` (reporting nothing).
pub fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    })
}

/// Reports that the running test cannot run, and why: on the real stderr, or as a failure
/// under `BULWARK_REQUIRE_TOOLS=1`.
pub fn skip(why: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    assert!(
        std::env::var_os(REQUIRE).is_none_or(|v| v != "1"),
        "{test} cannot run: {why} ({REQUIRE}=1 requires every tool)"
    );
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_on_path_is_found_and_a_missing_one_is_not() {
        assert!(find("sh", "any shell").is_some());
        assert!(find_all([("sh", "")]).is_some());
        assert!(on_path("no-such-program-bulwark").is_none());
    }
}
