//! Reading the repository's own sources for the tidy checks: which files,
//! with comments told apart from code, and the module graph of a crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The repository root (this crate lives in `tests/tidy`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// Every file under `dir` whose name ends with one of `extensions`, skipping
/// build output, dependencies and VCS data.
pub fn files(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !matches!(
                    name.as_str(),
                    "target" | "node_modules" | ".git" | "venv" | ".ctxsync"
                ) {
                    pending.push(path);
                }
            } else if extensions.iter().any(|ext| name.ends_with(ext)) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// A line's code, without a trailing `//` comment (a `//` inside a string
/// literal is kept: the split happens only outside quotes).
pub fn code_of(line: &str) -> &str {
    let mut in_string = false;
    let mut escaped = false;
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if in_string => escaped = true,
            b'"' => in_string = !in_string,
            b'/' if !in_string && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
    }
    line
}

/// The string literals on one line of code (simple `"…"` literals).
pub fn string_literals(code: &str) -> Vec<String> {
    let mut literals = Vec::new();
    let mut current: Option<String> = None;
    let mut escaped = false;
    for c in code.chars() {
        match (&mut current, c) {
            (Some(s), _) if escaped => {
                s.push(c);
                escaped = false;
            }
            (Some(_), '\\') => escaped = true,
            (Some(_), '"') => literals.push(current.take().expect("open")),
            (Some(s), _) => s.push(c),
            (None, '"') => current = Some(String::new()),
            (None, _) => {}
        }
    }
    literals
}

/// The crate root's name in [`module_graph`].
pub const ROOT: &str = "crate";

/// A crate's top-level modules (`src/x.rs` or `src/x/…` is module `x`) and
/// the root ([`ROOT`], `lib.rs`), with, for each, the others it names
/// through `crate::` (or `super::` from a top-level file). The root names
/// every module it declares; a path to anything else of the root (an item
/// it defines or re-exports) is an edge to the root, so a module that uses
/// the root's items while the root declares it is a cycle. Unit-test
/// modules (`#[cfg(test)]` to the end of a file) are left out.
pub fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut sources: BTreeMap<String, Vec<(PathBuf, bool)>> = BTreeMap::new();
    for file in files(src, &[".rs"]) {
        let relative = file.strip_prefix(src).expect("under src").to_owned();
        let first = relative
            .components()
            .next()
            .expect("a file")
            .as_os_str()
            .to_string_lossy()
            .into_owned();
        if first == "main.rs" || first == "bin" {
            continue;
        }
        let module = match first.trim_end_matches(".rs") {
            "lib" => ROOT.to_owned(),
            name => name.to_owned(),
        };
        let top_level = relative.components().count() == 1;
        sources.entry(module).or_default().push((file, top_level));
    }
    let mut modules: BTreeSet<String> = sources.keys().cloned().collect();
    // Modules written inline in the root (`pub mod v1 { … }`) are modules too.
    if let Ok(root) = std::fs::read_to_string(src.join("lib.rs")) {
        for line in root.lines() {
            let line = line.trim_start().trim_start_matches("pub ");
            if let Some(rest) = line.strip_prefix("mod ")
                && rest.trim_end().ends_with('{')
            {
                modules.insert(first_segment(rest));
            }
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, files) in &sources {
        let uses = graph.entry(module.clone()).or_default();
        if module == ROOT {
            uses.extend(modules.iter().filter(|m| *m != ROOT).cloned());
            continue;
        }
        for (file, top_level) in files {
            let text = std::fs::read_to_string(file).expect("readable source");
            for line in text.lines() {
                if line.trim_start().starts_with("#[cfg(test)]") {
                    break;
                }
                let code = code_of(line);
                let mut prefixes = vec!["crate::"];
                if *top_level {
                    prefixes.push("super::");
                }
                for prefix in prefixes {
                    let mut rest = code;
                    while let Some(at) = rest.find(prefix) {
                        rest = &rest[at + prefix.len()..];
                        // `crate::{a::X, b}` names a and b.
                        let names: Vec<String> = match rest.strip_prefix('{') {
                            Some(group) => group
                                .split('}')
                                .next()
                                .unwrap_or_default()
                                .split(',')
                                .map(|path| first_segment(path.trim()))
                                .filter(|name| !name.is_empty())
                                .collect(),
                            None => vec![first_segment(rest)],
                        };
                        for name in names {
                            let target = if modules.contains(&name) {
                                name
                            } else {
                                ROOT.to_owned()
                            };
                            if &target != module {
                                uses.insert(target);
                            }
                        }
                    }
                }
            }
        }
    }
    graph
}

fn first_segment(path: &str) -> String {
    path.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// One cycle in `graph`, if there is any, as the modules along it.
pub fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).expect("on the path");
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_owned(), Mark::Open);
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut marks, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_are_cut_outside_strings_only() {
        assert_eq!(code_of(r#"let a = "x//y"; // note"#), r#"let a = "x//y"; "#);
        assert_eq!(string_literals(r#"f("a.{}", "b\"c")"#), ["a.{}", "b\"c"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_tree_is_not() {
        let graph = |edges: &[(&str, &str)]| {
            let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for (a, b) in edges {
                g.entry((*a).into()).or_default().insert((*b).into());
                g.entry((*b).into()).or_default();
            }
            g
        };
        assert_eq!(
            find_cycle(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])),
            None
        );
        assert_eq!(
            find_cycle(&graph(&[("a", "b"), ("b", "c"), ("c", "a")])),
            Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
        );
    }
}
