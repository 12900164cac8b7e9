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

/// A crate's top-level modules (`src/x.rs` or `src/x/…` is module `x`) and,
/// for each, the other top-level modules its files name through `crate::`.
/// The crate root (`lib.rs`, `main.rs`) declares and re-exports; it is no
/// module of the graph.
pub fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files(src, &[".rs"]) {
        let relative = file.strip_prefix(src).expect("under src");
        let first = relative
            .components()
            .next()
            .expect("a file")
            .as_os_str()
            .to_string_lossy()
            .into_owned();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" || module == "main" || relative.starts_with("bin") {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable source");
        let uses = graph.entry(module.clone()).or_default();
        let top_level_submodule = relative.components().count() == 1;
        for line in text.lines() {
            let code = code_of(line);
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    uses.insert(name);
                }
            }
            // `super::x` from a top-level module's file names the root's x.
            if top_level_submodule && !code.contains("mod tests") {
                let mut rest = code;
                while let Some(at) = rest.find("super::") {
                    rest = &rest[at + "super::".len()..];
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != module && name != "super" {
                        uses.insert(name);
                    }
                }
            }
        }
    }
    // Only edges to modules of this crate (not items the root defines).
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for uses in graph.values_mut() {
        uses.retain(|m| modules.contains(m));
    }
    graph
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
