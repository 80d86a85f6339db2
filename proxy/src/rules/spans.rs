//! Where each value of a rule file sits (line and column), for validation messages.
//!
//! `serde_norway` gives positions only with its own errors, not for values that parsed
//! fine but are wrong together (a missing level, a duplicate name, an overlap). So once a
//! file has parsed, this scans its text for the block structure (indented mappings, `-`
//! sequences, one-line flow collections `{...}` / `[...]`) and records the position of every
//! key and value by path (`rules/2/match/verbs/0`). It is not a YAML parser: it only has to
//! be right for text the real parser already accepted, and when it cannot follow something
//! (multi-line flow collections, anchors) a lookup falls back to the nearest enclosing item.

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
}

impl Pos {
    /// The start of the file.
    pub const START: Pos = Pos { line: 1, column: 1 };
}

/// A node of the position tree: its own position and its children by key or index.
#[derive(Debug, Default)]
struct Node {
    pos: Option<Pos>,
    children: Vec<(String, Node)>,
}

impl Node {
    fn at(pos: Pos) -> Node {
        Node {
            pos: Some(pos),
            children: Vec::new(),
        }
    }
}

/// The positions of one file's keys and values.
#[derive(Debug)]
pub(crate) struct Spans {
    root: Node,
}

/// One significant line: its number, indentation and text without comment.
struct Line {
    number: usize,
    indent: usize,
    text: Vec<char>,
}

impl Spans {
    /// Scans a file's text.
    pub fn parse(text: &str) -> Spans {
        let mut lines: Vec<Line> = text
            .lines()
            .enumerate()
            .filter_map(|(i, raw)| {
                let indent = raw.chars().take_while(|c| *c == ' ').count();
                let body: Vec<char> = raw.chars().skip(indent).collect();
                let text = strip_comment(&body);
                let is_marker = matches!(text.iter().collect::<String>().as_str(), "---" | "...");
                (!text.is_empty() && !is_marker).then_some(Line {
                    number: i + 1,
                    indent,
                    text,
                })
            })
            .collect();
        let mut i = 0;
        let root = parse_block(&mut lines, &mut i, 0);
        Spans { root }
    }

    /// The position of the value at `path` (keys and sequence indexes), or of the deepest
    /// enclosing item that could be found; the start of the file at worst.
    pub fn find<S: AsRef<str>>(&self, path: &[S]) -> Pos {
        let mut node = &self.root;
        let mut best = node.pos.unwrap_or(Pos::START);
        for key in path {
            match node.children.iter().find(|(k, _)| k == key.as_ref()) {
                Some((_, child)) => {
                    node = child;
                    if let Some(pos) = child.pos {
                        best = pos;
                    }
                }
                None => break,
            }
        }
        best
    }
}

/// The line's text without a trailing comment or trailing spaces. A `#` starts a comment
/// at the start or after a space, outside quotes.
fn strip_comment(body: &[char]) -> Vec<char> {
    let mut quote: Option<char> = None;
    let mut end = body.len();
    for (i, &c) in body.iter().enumerate() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == '#' && (i == 0 || body[i - 1] == ' ' || body[i - 1] == '\t') => {
                end = i;
                break;
            }
            None => {}
        }
    }
    let mut text = body[..end].to_vec();
    while text.last().is_some_and(|c| c.is_whitespace()) {
        text.pop();
    }
    text
}

fn is_dash(text: &[char]) -> bool {
    text == ['-'] || (text.first() == Some(&'-') && text.get(1) == Some(&' '))
}

/// Parses the block starting at line `i`, if it is indented at least `min_indent`.
fn parse_block(lines: &mut [Line], i: &mut usize, min_indent: usize) -> Node {
    let Some(line) = lines.get(*i) else {
        return Node::default();
    };
    if line.indent < min_indent {
        return Node::default();
    }
    let indent = line.indent;
    if is_dash(&line.text) {
        parse_seq(lines, i, indent)
    } else {
        parse_map(lines, i, indent)
    }
}

/// A block sequence whose dashes are at `indent`.
fn parse_seq(lines: &mut [Line], i: &mut usize, indent: usize) -> Node {
    let mut node = Node::default();
    let mut index = 0;
    while let Some(line) = lines.get_mut(*i) {
        if line.indent != indent || !is_dash(&line.text) {
            break;
        }
        let offset = 1 + line.text[1..].iter().take_while(|c| **c == ' ').count();
        let item_pos = Pos {
            line: line.number,
            column: indent + 1 + if line.text.len() > offset { offset } else { 0 },
        };
        node.pos.get_or_insert(item_pos);
        let mut child = if line.text.len() == offset {
            *i += 1;
            parse_block(lines, i, indent + 1)
        } else {
            // The rest of the line is the item's first line, indented where it starts.
            line.text.drain(..offset);
            line.indent = indent + offset;
            parse_block(lines, i, indent + offset)
        };
        child.pos = Some(item_pos);
        node.children.push((index.to_string(), child));
        index += 1;
    }
    node
}

/// A block mapping whose keys are at `indent`.
fn parse_map(lines: &mut [Line], i: &mut usize, indent: usize) -> Node {
    let mut node = Node::default();
    while let Some(line) = lines.get(*i) {
        if line.indent != indent || is_dash(&line.text) {
            break;
        }
        let number = line.number;
        let here = |offset: usize| Pos {
            line: number,
            column: indent + 1 + offset,
        };
        let Some((key, value_start)) = split_key(&line.text) else {
            // A scalar (or flow collection) on its own: the whole block is this value.
            let first = line.text.first().copied();
            let mut scalar = if matches!(first, Some('{' | '[')) {
                parse_flow_at(&line.text, 0, here(0))
            } else {
                Node::at(here(0))
            };
            *i += 1;
            skip_deeper(lines, i, indent);
            if node.children.is_empty() {
                scalar.pos = Some(here(0));
                return scalar;
            }
            continue;
        };
        node.pos.get_or_insert(here(0));
        let value: &[char] = &line.text[value_start..];
        let skipped = value.iter().take_while(|c| **c == ' ').count();
        let value_offset = value_start + skipped;
        let value = &line.text[value_offset..];
        let child = if value.is_empty() || value[0] == '&' && !value.contains(&' ') {
            *i += 1;
            let mut child = match lines.get(*i) {
                Some(next) if next.indent > indent => parse_block(lines, i, indent + 1),
                Some(next) if next.indent == indent && is_dash(&next.text) => {
                    parse_seq(lines, i, indent)
                }
                _ => Node::default(),
            };
            child.pos = Some(here(0));
            child
        } else if value[0] == '{' || value[0] == '[' {
            let child = parse_flow_at(&line.text, value_offset, here(value_offset));
            *i += 1;
            skip_deeper(lines, i, indent);
            child
        } else {
            *i += 1;
            // Block scalars and multi-line plain scalars continue on deeper lines.
            skip_deeper(lines, i, indent);
            Node::at(here(value_offset))
        };
        node.children.push((key, child));
    }
    node
}

/// Skips the lines indented deeper than `indent`.
fn skip_deeper(lines: &[Line], i: &mut usize, indent: usize) {
    while lines.get(*i).is_some_and(|l| l.indent > indent) {
        *i += 1;
    }
}

/// Splits `key: value` into the unquoted key and where the value starts; `None` when the
/// text is not a mapping entry.
fn split_key(text: &[char]) -> Option<(String, usize)> {
    let (key, after) = match text.first()? {
        '{' | '[' => return None,
        q @ ('"' | '\'') => {
            let close = text[1..].iter().position(|c| c == q)? + 1;
            (text[1..close].iter().collect::<String>(), close + 1)
        }
        _ => {
            let colon = (0..text.len())
                .find(|&k| text[k] == ':' && (k + 1 == text.len() || text[k + 1] == ' '))?;
            let key: String = text[..colon].iter().collect();
            (key.trim_end().to_owned(), colon)
        }
    };
    let rest = &text[after..];
    let spaces = rest.iter().take_while(|c| **c == ' ').count();
    if rest.get(spaces) != Some(&':') {
        return None;
    }
    let colon = after + spaces;
    if colon + 1 < text.len() && text[colon + 1] != ' ' {
        return None;
    }
    Some((key, colon + 1))
}

/// Parses a one-line flow collection starting at `text[start]`, whose position is `pos`.
fn parse_flow_at(text: &[char], start: usize, pos: Pos) -> Node {
    let mut p = start;
    let column_of = |k: usize| pos.column + (k - start);
    let mut node = parse_flow(text, &mut p, &|k| Pos {
        line: pos.line,
        column: column_of(k),
    });
    node.pos = Some(pos);
    node
}

fn skip_spaces(text: &[char], p: &mut usize) {
    while text.get(*p).is_some_and(|c| *c == ' ') {
        *p += 1;
    }
}

/// One flow value at `text[*p]`: a mapping, a sequence or a scalar.
fn parse_flow(text: &[char], p: &mut usize, at: &dyn Fn(usize) -> Pos) -> Node {
    skip_spaces(text, p);
    let mut node = Node::at(at(*p));
    match text.get(*p) {
        Some('{') => {
            *p += 1;
            loop {
                skip_spaces(text, p);
                match text.get(*p) {
                    None => break,
                    Some('}') => {
                        *p += 1;
                        break;
                    }
                    Some(',') => {
                        *p += 1;
                        continue;
                    }
                    _ => {}
                }
                let key_pos = at(*p);
                let key = flow_scalar(text, p);
                skip_spaces(text, p);
                let mut value = if text.get(*p) == Some(&':') {
                    *p += 1;
                    parse_flow(text, p, at)
                } else {
                    Node::at(key_pos)
                };
                if value.children.is_empty() && value.pos.is_none() {
                    value.pos = Some(key_pos);
                }
                node.children.push((unquote(&key), value));
            }
        }
        Some('[') => {
            *p += 1;
            let mut index = 0;
            loop {
                skip_spaces(text, p);
                match text.get(*p) {
                    None => break,
                    Some(']') => {
                        *p += 1;
                        break;
                    }
                    Some(',') => {
                        *p += 1;
                        continue;
                    }
                    _ => {}
                }
                let item = parse_flow(text, p, at);
                node.children.push((index.to_string(), item));
                index += 1;
            }
        }
        _ => {
            flow_scalar(text, p);
        }
    }
    node
}

/// A scalar inside a flow collection, up to `,`, `:` (followed by a space), `]` or `}`.
fn flow_scalar(text: &[char], p: &mut usize) -> String {
    let start = *p;
    if let Some(&q @ ('"' | '\'')) = text.get(*p) {
        *p += 1;
        while let Some(&c) = text.get(*p) {
            *p += 1;
            if c == '\\' && q == '"' {
                *p += 1;
            } else if c == q {
                break;
            }
        }
        return text[start..(*p).min(text.len())].iter().collect();
    }
    while let Some(&c) = text.get(*p) {
        let ends_key = c == ':' && matches!(text.get(*p + 1), None | Some(' ' | ',' | '}' | ']'));
        if matches!(c, ',' | ']' | '}') || ends_key {
            break;
        }
        *p += 1;
    }
    text[start..*p].iter().collect::<String>().trim().to_owned()
}

fn unquote(key: &str) -> String {
    let trimmed = key.trim();
    for q in ['"', '\''] {
        if let Some(inner) = trimmed
            .strip_prefix(q)
            .and_then(|rest| rest.strip_suffix(q))
        {
            return inner.to_owned();
        }
    }
    trimmed.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(line: usize, column: usize) -> Pos {
        Pos { line, column }
    }

    const TEXT: &str = "\
# A comment
levels:
  - name: list-heavy   # trailing comment
    seats: 8
    maxWait: 15s
rules:
  - name: ops
    precedence: 500
    match:
      users: [\"a\", b]
      verbs:
        - list
        - watch
      resources: [{group: \"\", resource: secrets}, {group: apps, resource: deployments}]
    rate: {qps: 5, burst: 10}
  -
    name: second
    level: x
";

    #[test]
    fn block_keys_point_at_their_values() {
        let spans = Spans::parse(TEXT);
        assert_eq!(spans.find(&["levels", "0", "name"]), pos(3, 11));
        assert_eq!(spans.find(&["levels", "0", "seats"]), pos(4, 12));
        assert_eq!(spans.find(&["levels", "0"]), pos(3, 5));
        assert_eq!(spans.find(&["rules", "0", "precedence"]), pos(8, 17));
        assert_eq!(spans.find(&["rules", "0", "match"]), pos(9, 5));
        assert_eq!(spans.find(&["rules", "1", "name"]), pos(17, 11));
        assert_eq!(spans.find(&["rules", "1", "level"]), pos(18, 12));
    }

    #[test]
    fn sequences_and_flow_collections_point_at_items() {
        let spans = Spans::parse(TEXT);
        assert_eq!(
            spans.find(&["rules", "0", "match", "users", "1"]),
            pos(10, 20)
        );
        assert_eq!(
            spans.find(&["rules", "0", "match", "verbs", "1"]),
            pos(13, 11)
        );
        assert_eq!(
            spans.find(&["rules", "0", "match", "resources", "1", "resource"]),
            pos(14, 75)
        );
        assert_eq!(spans.find(&["rules", "0", "rate", "burst"]), pos(15, 27));
    }

    #[test]
    fn unknown_paths_fall_back_to_the_deepest_known_item() {
        let spans = Spans::parse(TEXT);
        assert_eq!(spans.find(&["rules", "0", "watches"]), pos(7, 5));
        assert_eq!(spans.find(&["rules", "7"]), pos(6, 1));
        assert_eq!(spans.find::<&str>(&[]), pos(2, 1));
    }

    #[test]
    fn flow_mapping_items_in_a_sequence() {
        let spans =
            Spans::parse("rules:\n- {name: a, precedence: 5}\n- {name: b, precedence: 5}\n");
        assert_eq!(spans.find(&["rules", "1", "precedence"]), pos(3, 25));
        assert_eq!(spans.find(&["rules", "0", "name"]), pos(2, 10));
    }
}
