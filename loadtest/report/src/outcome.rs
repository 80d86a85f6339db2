//! One pipeline for every scenario's result: whatever a scenario records implements
//! [`Outcome`], and is written (`--json`, the HTML page), drawn again from its file, cut
//! into SVG charts and quoted on its reference page by the same functions.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::html::{Item, Page, Table, render};

/// What one run of a scenario recorded.
pub trait Outcome {
    /// The scenario's name, as its `--json` file records it.
    fn scenario(&self) -> &str;

    /// The result as its `--json` file holds it.
    fn json(&self) -> serde_json::Result<String>;

    /// The HTML page: charts and tables.
    fn page(&self) -> anyhow::Result<Page>;

    /// One paragraph saying what the run showed.
    fn verdict(&self) -> String;

    /// The figures a reference page quotes under the verdict, as Markdown.
    fn figures(&self) -> anyhow::Result<String>;
}

/// Writes `outcome` as JSON to `json` (when given) and its page to `html`.
pub fn write(outcome: &dyn Outcome, json: Option<&Path>, html: &Path) -> anyhow::Result<()> {
    if let Some(path) = json {
        std::fs::write(path, outcome.json()?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    let page = outcome.page().context("drawing the report's charts")?;
    std::fs::write(html, render(&page)).with_context(|| format!("writing {}", html.display()))
}

/// Writes each chart of `outcome`'s page into `dir` as `SCENARIO-N.svg`; the files and
/// the charts' titles.
pub fn write_charts(outcome: &dyn Outcome, dir: &Path) -> anyhow::Result<Vec<(PathBuf, String)>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let page = outcome.page()?;
    let mut written = Vec::new();
    for item in page.sections.iter().flat_map(|s| &s.items) {
        if let Item::Chart(chart) = item {
            let path = dir.join(format!("{}-{}.svg", outcome.scenario(), written.len() + 1));
            std::fs::write(&path, &chart.svg)
                .with_context(|| format!("writing {}", path.display()))?;
            written.push((path, chart.title.clone()));
        }
    }
    Ok(written)
}

/// The tables of `page` as Markdown, one after another.
pub fn tables(page: &Page) -> String {
    let tables: Vec<String> = page
        .sections
        .iter()
        .flat_map(|s| &s.items)
        .filter_map(|item| match item {
            Item::Table(table) => Some(markdown(table)),
            Item::Chart(_) => None,
        })
        .collect();
    tables.join("\n")
}

/// A table as Markdown, `|` in cells escaped.
pub fn markdown(table: &Table) -> String {
    let row = |cells: &[String]| {
        let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
        format!("| {} |\n", cells.join(" | "))
    };
    let mut out = row(&table.header);
    out.push_str(&format!("|{}\n", "---|".repeat(table.header.len())));
    for r in &table.rows {
        out.push_str(&row(r));
    }
    out
}

impl Outcome for crate::Report {
    fn scenario(&self) -> &str {
        &self.scenario
    }

    fn json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }

    fn page(&self) -> anyhow::Result<Page> {
        crate::charts::page(self)
    }

    fn verdict(&self) -> String {
        crate::charts::verdict(self)
    }

    fn figures(&self) -> anyhow::Result<String> {
        Ok(format!("```text\n{}```\n", crate::table(self)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_becomes_markdown_with_its_bars_escaped() {
        let table = Table {
            header: vec!["a".into(), "b".into()],
            rows: vec![vec!["1".into(), "x|y".into()]],
        };
        assert_eq!(markdown(&table), "| a | b |\n|---|---|\n| 1 | x\\|y |\n");
    }
}
