//! No function of the tree is over 200 lines, and each over 120 says why beside it, in a
//! line comment above its `fn` that starts `Over 120 lines:`. A long function is read by
//! every newcomer who changes it; the reason, where one holds, saves them the split.
//! Read with syn from every Rust file of the repository (tests, benches and the fuzz
//! targets included), so a function that grows past either mark fails here by name.

use std::path::{Path, PathBuf};

use syn::spanned::Spanned;
use syn::visit::Visit;

/// The most lines a function may span, from `fn` to its closing brace.
const MOST: usize = 200;
/// Past this, a function says why beside it.
const SAYS_WHY: usize = 120;
/// What the reason's comment starts with.
const REASON: &str = "// Over 120 lines:";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` file under `dir`, build output and shared folders left out.
fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" && name != "shared" {
                rust_files(&path, files);
            }
        } else if name.ends_with(".rs") {
            files.push(path);
        }
    }
}

/// A function: its name, the line of its `fn` (1-based) and the lines it spans.
struct Function {
    name: String,
    line: usize,
    lines: usize,
}

#[derive(Default)]
struct Functions(Vec<Function>);

impl Functions {
    fn add(&mut self, name: &syn::Ident, sig: &syn::Signature, block: &syn::Block) {
        let line = sig.fn_token.span().start().line;
        let end = block.brace_token.span.close().end().line;
        self.0.push(Function {
            name: name.to_string(),
            line,
            lines: end + 1 - line,
        });
    }
}

impl<'a> Visit<'a> for Functions {
    fn visit_item_fn(&mut self, f: &'a syn::ItemFn) {
        self.add(&f.sig.ident, &f.sig, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'a syn::ImplItemFn) {
        self.add(&f.sig.ident, &f.sig, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'a syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.add(&f.sig.ident, &f.sig, block);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

/// The functions of `text`.
fn functions(text: &str) -> Vec<Function> {
    let file = syn::parse_file(text).expect("the file parses");
    let mut found = Functions::default();
    found.visit_file(&file);
    found.0
}

/// Whether a comment starting with [`REASON`] stands above line `line` (1-based), among
/// the comments, attributes and signature lines that lead to it.
fn says_why(lines: &[&str], line: usize) -> bool {
    lines[..line]
        .iter()
        .rev()
        .take_while(|l| {
            let l = l.trim_start();
            l.starts_with("//")
                || l.starts_with("#[")
                || l.starts_with("pub")
                || l.starts_with("async")
                || l.starts_with("fn")
                || l.starts_with("const")
                || l.starts_with("unsafe")
        })
        .any(|l| l.trim_start().starts_with(REASON))
}

#[test]
fn no_function_is_over_200_lines_and_each_over_120_says_why() {
    let root = root();
    let mut files = Vec::new();
    for dir in ["proxy", "loadtest", "testkit", "apimachinery", "fuzz"] {
        rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    assert!(
        files.len() > 100,
        "the tree is read ({} files)",
        files.len()
    );
    let (mut over, mut silent) = (Vec::new(), Vec::new());
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let relative = file.strip_prefix(&root).unwrap().display();
        for f in functions(&text) {
            let at = format!("{relative}:{} {} ({} lines)", f.line, f.name, f.lines);
            if f.lines > MOST {
                over.push(at);
            } else if f.lines > SAYS_WHY && !says_why(&lines, f.line) {
                silent.push(at);
            }
        }
    }
    assert!(
        over.is_empty() && silent.is_empty(),
        "over {MOST} lines:\n  {}\nover {SAYS_WHY} lines without a `{REASON}` comment:\n  {}",
        over.join("\n  "),
        silent.join("\n  ")
    );
}

#[test]
fn lengths_run_from_fn_to_the_closing_brace_and_reasons_are_found_above() {
    let text = "\
/// Doc.
// Over 120 lines: a reason.
#[inline]
pub async fn one(
    a: u8,
) {
    let s = \"}\";
}

impl X {
    fn two() { inner(); fn nested() {} }
}
";
    let found = functions(text);
    let by_name = |n: &str| found.iter().find(|f| f.name == n).unwrap();
    assert_eq!((by_name("one").line, by_name("one").lines), (4, 5));
    assert_eq!((by_name("two").line, by_name("two").lines), (11, 1));
    assert_eq!(by_name("nested").line, 11);
    let lines: Vec<&str> = text.lines().collect();
    assert!(says_why(&lines, 4));
    assert!(!says_why(&lines, 11));
}
