//! A self-contained HTML page of titled charts and tables: the report a person opens in a
//! browser. Charts arrive as SVG text and are inlined, styles are inline too, so the file
//! needs no network and no other file to open.
//!
//! The page knows nothing of scenarios: a scenario (or [`super::charts`]) builds the
//! sections, and a new scenario adds its own charts without touching this module.

use std::fmt::Write as _;

/// A whole report page.
#[derive(Debug, Clone, Default)]
pub struct Page {
    /// The page's title, e.g. `list-storm (scale 1)`.
    pub title: String,
    /// One line at the top saying what the run showed.
    pub verdict: String,
    /// Lines under the verdict: how the run was made.
    pub notes: Vec<String>,
    /// The sections, in order.
    pub sections: Vec<Section>,
}

/// A titled group of charts and tables, laid out side by side where they fit.
#[derive(Debug, Clone, Default)]
pub struct Section {
    /// The section's heading.
    pub title: String,
    /// Its charts and tables.
    pub items: Vec<Item>,
}

/// One chart or table.
#[derive(Debug, Clone)]
pub enum Item {
    /// A chart drawn as SVG.
    Chart(Chart),
    /// A table of text cells.
    Table(Table),
}

/// A chart: its title (for readers that cannot see it) and its SVG document.
#[derive(Debug, Clone)]
pub struct Chart {
    /// What the chart shows.
    pub title: String,
    /// An `<svg>` document, inlined as is.
    pub svg: String,
}

/// A table: a header row and rows of cells; the first column is the row's label.
#[derive(Debug, Clone, Default)]
pub struct Table {
    /// Column headings.
    pub header: Vec<String>,
    /// Rows of cells, each as long as the header.
    pub rows: Vec<Vec<String>>,
}

/// Text made safe inside HTML elements and attributes.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222;background:#fff}\
h1{font-size:22px;margin:0 0 8px}\
.verdict{font-size:18px;padding:10px 14px;border-left:6px solid #1f77b4;background:#f2f6fa;margin:8px 0 12px}\
.notes{color:#555;font-size:13px;margin:0 0 16px}\
h2{font-size:17px;margin:24px 0 8px;border-bottom:1px solid #ddd}\
.row{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}\
figure{margin:0}\
table{border-collapse:collapse;font-size:13px}\
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right;white-space:pre}\
td:first-child,th:first-child{text-align:left}\
tr.group td{background:#f4f4f4;font-weight:bold}";

/// The page as one HTML document.
pub fn render(page: &Page) -> String {
    let mut out = String::new();
    let title = escape(&page.title);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n\
         <p class=\"verdict\">{}</p>\n",
        escape(&page.verdict)
    );
    if !page.notes.is_empty() {
        out.push_str("<p class=\"notes\">");
        let notes: Vec<String> = page.notes.iter().map(|n| escape(n)).collect();
        out.push_str(&notes.join("<br>"));
        out.push_str("</p>\n");
    }
    for section in &page.sections {
        let _ = writeln!(
            out,
            "<h2>{}</h2>\n<div class=\"row\">",
            escape(&section.title)
        );
        for item in &section.items {
            match item {
                Item::Chart(chart) => {
                    let _ = writeln!(
                        out,
                        "<figure class=\"chart\" role=\"img\" aria-label=\"{}\">\n{}\n</figure>",
                        escape(&chart.title),
                        strip_xml_declaration(&chart.svg)
                    );
                }
                Item::Table(table) => table_html(&mut out, table),
            }
        }
        out.push_str("</div>\n");
    }
    out.push_str("</body>\n</html>\n");
    out
}

/// An SVG document without the `<?xml …?>` line, which has no place inside HTML.
fn strip_xml_declaration(svg: &str) -> &str {
    let trimmed = svg.trim_start();
    if trimmed.starts_with("<?xml") {
        trimmed
            .find("?>")
            .map_or(trimmed, |i| trimmed[i + 2..].trim_start())
    } else {
        trimmed
    }
}

/// A table; a row whose cells after the first are all empty is a group heading.
fn table_html(out: &mut String, table: &Table) {
    out.push_str("<table>\n<tr>");
    for h in &table.header {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr>\n");
    for row in &table.rows {
        let group = row.iter().skip(1).all(String::is_empty);
        out.push_str(if group {
            "<tr class=\"group\">"
        } else {
            "<tr>"
        });
        for cell in row {
            let _ = write!(out, "<td>{}</td>", escape(cell));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_inlines_its_charts_and_escapes_text() {
        let page = Page {
            title: "a <b> & c".into(),
            verdict: "OOM kills: direct 3, bulwark 0".into(),
            notes: vec!["scale 0.1".into()],
            sections: vec![Section {
                title: "memory".into(),
                items: vec![
                    Item::Chart(Chart {
                        title: "memory over time".into(),
                        svg: "<?xml version=\"1.0\"?>\n<svg width=\"10\"><rect/></svg>".into(),
                    }),
                    Item::Table(Table {
                        header: vec!["".into(), "direct".into()],
                        rows: vec![
                            vec!["apiserver".into(), "".into()],
                            vec!["OOM kills".into(), "3".into()],
                        ],
                    }),
                ],
            }],
        };
        let html = render(&page);
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<h1>a &lt;b&gt; &amp; c</h1>"));
        assert!(html.contains("<svg width=\"10\"><rect/></svg>"));
        assert!(!html.contains("<?xml"), "no XML declaration inside HTML");
        assert!(html.contains("<tr class=\"group\"><td>apiserver</td>"));
        assert!(html.contains("<td>OOM kills</td><td>3</td>"));
        // Nothing to fetch: no scripts, stylesheets or images from elsewhere.
        assert!(!html.contains("<script") && !html.contains("<link") && !html.contains("src="));
    }
}
