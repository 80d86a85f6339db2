//! One rule file's text → a [`Parsed`] file, and every syntax, type and unknown-field
//! error in it, not only the first.
//!
//! The file is parsed whole first. When that fails, it is cut into its top-level keys and
//! each entry of `levels` and `rules` is parsed on its own, at its own lines, so that one
//! broken entry does not hide the errors of the others, and the entries that parse are still
//! validated. The cutting only reads indentation, `key:` at the left margin and `-` items;
//! anything it cannot follow is left to the whole file's error.

use serde::de::DeserializeOwned;

use super::schema::{LevelDoc, RuleDoc, RuleFile};
use super::spans::Spans;
use super::validate::{Parsed, friendly};
use super::{RuleProblem, Source};

/// What came of parsing one file.
pub(crate) struct Outcome {
    /// The file, or the entries of it that parsed; `None` when nothing could be used.
    pub parsed: Option<Parsed>,
    /// Every error found.
    pub problems: Vec<RuleProblem>,
    /// Whether some levels may be missing from `parsed` (an entry or the whole file failed),
    /// so that rules naming an unknown level are not blamed for it.
    pub levels_lost: bool,
}

/// The plain-words message for a tab in indentation.
pub(crate) const TAB_MESSAGE: &str = "tabs are not allowed for indentation in YAML; use spaces";

/// Parses one file's text; see the module comment.
pub(crate) fn parse(source: &Source) -> Outcome {
    let error = match serde_norway::from_str::<RuleFile>(&source.text) {
        Ok(file) if file.levels.is_empty() && file.rules.is_empty() => {
            return failed(vec![problem(
                source,
                1,
                1,
                "the file defines no levels and no rules".into(),
            )]);
        }
        Ok(file) => {
            return Outcome {
                parsed: Some(Parsed {
                    path: source.path.clone(),
                    builtin: false,
                    spans: Spans::parse(&source.text),
                    file,
                    level_at: Vec::new(),
                    rule_at: Vec::new(),
                }),
                problems: Vec::new(),
                levels_lost: false,
            };
        }
        Err(e) => e,
    };
    let tabs = tab_lines(&source.text);
    let mut problems: Vec<RuleProblem> = tabs
        .iter()
        .map(|&(line, column)| problem(source, line, column, TAB_MESSAGE.into()))
        .collect();
    let whole = yaml_problem(source, &error, "");
    let Some(sections) = sections(&source.text) else {
        problems.retain(|p| p.line != whole.line);
        problems.push(whole);
        problems.sort_by_key(|p| (p.line, p.column));
        return failed(problems);
    };

    let mut file = RuleFile::default();
    let (mut level_at, mut rule_at) = (Vec::new(), Vec::new());
    let mut levels_lost = false;
    let on_tab_line = |p: &RuleProblem| tabs.iter().any(|&(line, _)| line == p.line);
    for section in &sections {
        match (section.key.as_str(), &section.items) {
            ("levels" | "rules", Some(items)) => {
                for (index, &(first, last)) in items.iter().enumerate() {
                    let prefix = format!("{}[{index}]", section.key);
                    let text = entry_text(&source.text, first, last);
                    if section.key == "levels" {
                        match entry::<LevelDoc>(source, &text, &prefix) {
                            Ok(doc) => {
                                file.levels.push(doc);
                                level_at.push(index);
                            }
                            Err(p) => {
                                levels_lost = true;
                                problems.extend(Some(p).filter(|p| !on_tab_line(p)));
                            }
                        }
                    } else {
                        match entry::<RuleDoc>(source, &text, &prefix) {
                            Ok(doc) => {
                                file.rules.push(doc);
                                rule_at.push(index);
                            }
                            Err(p) => problems.extend(Some(p).filter(|p| !on_tab_line(p))),
                        }
                    }
                }
            }
            ("levels" | "rules", None) => {
                // Written on one line (`rules: []`, a flow sequence): parsed as a whole.
                let text = entry_text(&source.text, section.line, section.last);
                match serde_norway::from_str::<RuleFile>(&text) {
                    Ok(part) => {
                        let offset = (file.levels.len(), file.rules.len());
                        level_at.extend((0..part.levels.len()).map(|i| i + offset.0));
                        rule_at.extend((0..part.rules.len()).map(|i| i + offset.1));
                        file.levels.extend(part.levels);
                        file.rules.extend(part.rules);
                    }
                    Err(e) => {
                        levels_lost |= section.key == "levels";
                        let p = yaml_problem(source, &e, "");
                        problems.extend(Some(p).filter(|p| !on_tab_line(p)));
                    }
                }
            }
            (key, _) => {
                // A misspelt `levels:` may hold the levels the rules name.
                levels_lost = true;
                problems.push(problem(
                    source,
                    section.line,
                    1,
                    format!("unknown field `{key}`, expected `levels` or `rules`"),
                ));
            }
        }
    }
    // The whole file's error, unless an entry's error already says it (or it is a tab).
    if !problems.iter().any(|p| p.line == whole.line) {
        problems.push(whole);
    }
    problems.sort_by_key(|p| (p.line, p.column));
    let parsed = (!file.levels.is_empty() || !file.rules.is_empty()).then(|| Parsed {
        path: source.path.clone(),
        builtin: false,
        spans: Spans::parse(&source.text),
        file,
        level_at,
        rule_at,
    });
    Outcome {
        parsed,
        problems,
        levels_lost,
    }
}

fn failed(problems: Vec<RuleProblem>) -> Outcome {
    Outcome {
        parsed: None,
        problems,
        levels_lost: true,
    }
}

fn problem(source: &Source, line: usize, column: usize, message: String) -> RuleProblem {
    RuleProblem {
        file: source.path.clone(),
        line,
        column,
        message,
    }
}

/// A parser error as a problem at its position, its message said in the schema's words,
/// its field path under `prefix` (`rules[2]`) when the text parsed was one entry.
fn yaml_problem(source: &Source, e: &serde_norway::Error, prefix: &str) -> RuleProblem {
    let (line, column) = e
        .location()
        .map(|l| (l.line(), l.column()))
        .unwrap_or((1, 1));
    if let Some(tab) = leading_tab(source.text.lines().nth(line.saturating_sub(1))) {
        return problem(source, line, tab, TAB_MESSAGE.into());
    }
    let message = e.to_string();
    // The position goes in front; drop the parser's own copy of it.
    let suffix = format!(" at line {line} column {column}");
    let mut message = match message.find(&suffix) {
        Some(at) => format!("{}{}", &message[..at], &message[at + suffix.len()..]),
        None => message,
    };
    if !prefix.is_empty() {
        // serde_norway puts the field path first (`match.verbs[0]: ...`) when there is one.
        let has_path = message
            .split_once(": ")
            .is_some_and(|(head, _)| !head.is_empty() && !head.contains(' '));
        message = if has_path {
            format!("{prefix}.{message}")
        } else {
            format!("{prefix}: {message}")
        };
    }
    problem(source, line, column, friendly(&message))
}

/// The 1-based column of the first tab in a line's indentation, if any.
fn leading_tab(line: Option<&str>) -> Option<usize> {
    let line = line?;
    let indent: Vec<char> = line
        .chars()
        .take_while(|c| *c == ' ' || *c == '\t')
        .collect();
    indent.iter().position(|c| *c == '\t').map(|i| i + 1)
}

/// Every line with a tab in its indentation: (line, column of the tab).
fn tab_lines(text: &str) -> Vec<(usize, usize)> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .filter_map(|(i, line)| leading_tab(Some(line)).map(|column| (i + 1, column)))
        .collect()
}

/// Parses one entry, written at its own lines, as `T`.
fn entry<T: DeserializeOwned>(source: &Source, text: &str, prefix: &str) -> Result<T, RuleProblem> {
    serde_norway::from_str::<T>(text).map_err(|e| yaml_problem(source, &e, prefix))
}

/// Lines `first..=last` (1-based) of `text` at their own line numbers (the lines before
/// are left empty), with the `-` that starts a sequence item blanked, so that the entry
/// parses as a mapping and the parser's positions are those of the file.
fn entry_text(text: &str, first: usize, last: usize) -> String {
    let mut out = "\n".repeat(first - 1);
    for (i, line) in text
        .lines()
        .enumerate()
        .skip(first - 1)
        .take(last + 1 - first)
    {
        if i + 1 == first {
            let indent = line.len() - line.trim_start_matches(' ').len();
            if line[indent..].starts_with('-') {
                out.push_str(&line[..indent]);
                out.push(' ');
                out.push_str(&line[indent + 1..]);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// One top-level key of a file.
#[derive(Debug, PartialEq, Eq)]
struct Section {
    key: String,
    /// 1-based line of the key.
    line: usize,
    /// Last line of the section.
    last: usize,
    /// Its block sequence items as (first line, last line); `None` when the value is on the
    /// key's line.
    items: Option<Vec<(usize, usize)>>,
}

/// The top-level keys of a file and their sequence items, or `None` when the text is not
/// laid out as block mappings this can follow (several documents, no `key:` at the left).
fn sections(text: &str) -> Option<Vec<Section>> {
    let lines: Vec<&str> = text.lines().collect();
    let significant = |line: &str| {
        let trimmed = line.trim_start_matches([' ', '\t']);
        !trimmed.is_empty() && !trimmed.starts_with('#')
    };
    let mut sections: Vec<Section> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("---") || line.starts_with("...") {
            if sections.is_empty() && line.trim_end() == "---" {
                continue;
            }
            return None;
        }
        if !significant(line) || line.starts_with([' ', '\t', '-']) {
            continue;
        }
        let (key, rest) = line.split_once(':')?;
        if key.is_empty() || key.contains([' ', '{', '[', '"', '\'']) {
            return None;
        }
        if let Some(previous) = sections.last_mut() {
            previous.last = i;
        }
        let inline = {
            let rest = rest.trim();
            !rest.is_empty() && !rest.starts_with('#')
        };
        sections.push(Section {
            key: key.to_owned(),
            line: i + 1,
            last: lines.len(),
            items: (!inline).then(Vec::new),
        });
    }
    if sections.is_empty() {
        return None;
    }
    for section in &mut sections {
        let Some(items) = section.items.as_mut() else {
            continue;
        };
        // The items' dashes sit at the indentation of the first significant line.
        let mut dash_indent = None;
        for number in section.line + 1..=section.last {
            let line = lines[number - 1];
            if !significant(line) {
                continue;
            }
            let indent = line.len() - line.trim_start_matches(' ').len();
            let rest = &line[indent..];
            let is_dash = rest == "-" || rest.starts_with("- ");
            match dash_indent {
                None if is_dash => dash_indent = Some(indent),
                None => return None,
                Some(d) if is_dash && indent == d => {}
                Some(_) => continue,
            }
            if let Some(last) = items.last_mut() {
                last.1 = number - 1;
            }
            items.push((number, section.last));
        }
    }
    Some(sections)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn check(text: &str) -> (bool, Vec<String>) {
        let source = Source {
            path: PathBuf::from("f.yaml"),
            text: text.to_owned(),
        };
        let outcome = parse(&source);
        let messages = outcome.problems.iter().map(ToString::to_string).collect();
        (outcome.parsed.is_some(), messages)
    }

    #[test]
    fn one_bad_entry_does_not_hide_the_others() {
        let (parsed, messages) = check(
            "levels:\n  - name: a\n    seats: 1\n    queus: 2\nrules:\n  - name: r\n    precedence: high\n    level: a\n  - name: ok\n    precedence: 5\n    level: a\n  - name: s\n    precedence: 6\n    level: a\n    flow: [\n",
        );
        assert!(parsed, "the good rule is kept");
        assert_eq!(messages.len(), 3, "{messages:#?}");
        assert!(messages[0].starts_with("f.yaml:4:5: levels[0]: unknown field `queus`"));
        assert_eq!(
            messages[1],
            "f.yaml:7:17: rules[0].precedence: invalid type: string \"high\", expected an integer"
        );
        assert!(
            messages[2].starts_with("f.yaml:15:11: rules[2].flow: "),
            "{messages:#?}"
        );
    }

    #[test]
    fn tabs_get_plain_words_on_every_line() {
        let (_, messages) =
            check("rules:\n  - name: a\n\tprecedence: 1\n  - name: b\n\t  level: x\n");
        assert_eq!(
            messages,
            [
                format!("f.yaml:3:1: {TAB_MESSAGE}"),
                format!("f.yaml:5:1: {TAB_MESSAGE}"),
            ]
        );
    }

    #[test]
    fn an_unknown_top_level_key_is_named_and_the_rest_checked() {
        let (parsed, messages) =
            check("rule:\n  - name: a\nrules:\n  - name: b\n    precedence: 1\n    level: x\n");
        assert!(parsed);
        assert_eq!(
            messages,
            ["f.yaml:1:1: unknown field `rule`, expected `levels` or `rules`"]
        );
    }

    #[test]
    fn text_it_cannot_follow_keeps_the_whole_file_error() {
        let (parsed, messages) = check("{\"rules\": [}\n");
        assert!(!parsed);
        assert_eq!(messages.len(), 1, "{messages:?}");
        let (_, messages) = check("rules: []\n---\nrules: []\n");
        assert_eq!(messages.len(), 1, "{messages:?}");
    }
}
