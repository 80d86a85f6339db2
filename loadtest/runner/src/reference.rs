//! The scenario reference pages (`loadtest/runner/scenarios/*.md`): what each scenario
//! runs, the command, and its current figures. The figures are never typed: each page marks
//! where a recorded result's figures go, and [`refresh`] draws them from that result with
//! the same code that prints a run's table and verdict, so a page cannot say what its
//! result does not. `bulwark-loadtest reference` rewrites the pages after a new recording;
//! `--check` (and `tests/reference.rs`) fails when one is out of date.
//!
//! A marked block reads, in the Markdown source:
//!
//! ```text
//! <!-- figures: list-storm.json -->
//! (drawn from results/list-storm.json)
//! <!-- end figures -->
//! ```
//!
//! The file is named relative to the results folder, `../results` beside the pages.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

const BEGIN: &str = "<!-- figures: ";
const BEGIN_CLOSE: &str = " -->";
const END: &str = "<!-- end figures -->";

/// The folder the pages live in, in this source tree.
pub fn pages_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

/// The results folder the pages' blocks name their files in.
pub fn results_dir(pages: &Path) -> PathBuf {
    pages.join("../results")
}

/// The Markdown a recorded result's block holds: its verdict, then its figures (the text
/// table a run prints, or the cluster scenario's tables).
pub fn figures(json: &Path) -> anyhow::Result<String> {
    let outcome = crate::scenario::recorded(json)?;
    Ok(format!("{}\n\n{}", outcome.verdict(), outcome.figures()?))
}

/// The files a page's blocks name, in order.
pub fn named(page: &str) -> Vec<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix(BEGIN)?.strip_suffix(BEGIN_CLOSE))
        .map(str::to_owned)
        .collect()
}

/// `page` with each block's figures drawn again from the result it names in `results`.
pub fn refresh(page: &str, results: &Path) -> anyhow::Result<String> {
    let mut out = String::with_capacity(page.len());
    let mut rest = page;
    while let Some(at) = rest.find(BEGIN) {
        let (before, block) = rest.split_at(at);
        out.push_str(before);
        let Some(line_end) = block.find('\n') else {
            bail!("a figures marker without a line end");
        };
        let marker = &block[..line_end];
        let Some(name) = marker
            .strip_prefix(BEGIN)
            .and_then(|m| m.strip_suffix(BEGIN_CLOSE))
        else {
            bail!("a figures marker that does not end in `-->`: {marker}");
        };
        if name.contains('/') || name.is_empty() {
            bail!("a figures marker names {name:?}: name a file in the results folder");
        }
        let Some(end) = block.find(END) else {
            bail!("the figures of {name} have no `{END}`");
        };
        let drawn = figures(&results.join(name))?;
        out.push_str(marker);
        out.push('\n');
        out.push_str(&drawn);
        if !drawn.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(END);
        rest = &block[end + END.len()..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The pages in `dir` whose figures are not those of their results, rewritten in place
/// unless `check`.
pub fn run(dir: &Path, check: bool) -> anyhow::Result<Vec<PathBuf>> {
    let results = results_dir(dir);
    let mut stale = Vec::new();
    let mut pages: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    pages.sort();
    for path in pages
        .into_iter()
        .filter(|p| p.extension() == Some("md".as_ref()))
    {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let drawn = refresh(&text, &results).with_context(|| format!("in {}", path.display()))?;
        if drawn != text {
            if !check {
                std::fs::write(&path, &drawn)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            stale.push(path);
        }
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_drawn_from_its_result_and_the_rest_is_kept() {
        let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
        let page = "# list-storm\n\nbefore\n\n<!-- figures: list-storm.json -->\nstale\n<!-- end figures -->\n\nafter\n";
        let drawn = refresh(page, &results).unwrap();
        assert!(drawn.starts_with("# list-storm\n\nbefore\n\n<!-- figures: list-storm.json -->\n"));
        assert!(drawn.ends_with("<!-- end figures -->\n\nafter\n"));
        assert!(!drawn.contains("stale"));
        assert!(drawn.contains("list-storm (scale 1)"), "{drawn}");
        assert_eq!(
            refresh(&drawn, &results).unwrap(),
            drawn,
            "drawing twice changes nothing"
        );
        assert_eq!(named(&drawn), ["list-storm.json"]);
    }

    #[test]
    fn a_bad_marker_is_a_clear_error() {
        let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
        let err = |page: &str| refresh(page, &results).unwrap_err().to_string();
        assert!(
            err("<!-- figures: x.json -->\nno end\n").contains("have no `<!-- end figures -->`")
        );
        assert!(err("<!-- figures: ../x.json -->\n<!-- end figures -->").contains("name a file"));
        assert!(
            format!(
                "{:#}",
                refresh(
                    "<!-- figures: none.json -->\n<!-- end figures -->",
                    &results
                )
                .unwrap_err()
            )
            .contains("none.json")
        );
    }

    #[test]
    fn a_cluster_result_draws_its_tables() {
        let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
        let drawn = figures(&results.join("cluster-1000.json")).unwrap();
        assert!(drawn.contains("| figure | direct | bulwark |"), "{drawn}");
        assert!(drawn.contains("|---|---|---|"));
    }
}
