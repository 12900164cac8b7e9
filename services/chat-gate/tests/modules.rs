//! No module of chat-gate, or of its core (the `gate-core` crate), uses a
//! module that uses it back, directly or through others. Read from the
//! source: every `crate::a::b` and `super::a` path outside comments is a use
//! of the deepest module it names. That the core uses no transport and
//! nothing of chat-gate is its crate's dependencies' to enforce.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

fn modules(dir: &Path, prefix: &Module, out: &mut BTreeMap<Module, PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src readable") {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        if path.is_dir() {
            let mut inner = prefix.clone();
            inner.push(name);
            modules(&path, &inner, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let mut module = prefix.clone();
            if !matches!(name.as_str(), "mod" | "lib" | "main") {
                module.push(name);
            }
            out.insert(module, path);
        }
    }
}

fn ident_path(text: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut rest = text;
    loop {
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        parts.push(rest[..end].to_owned());
        match rest[end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    parts
}

/// The deepest module `path` names (the crate root for an item of its own).
fn resolve(known: &BTreeMap<Module, PathBuf>, mut path: Module) -> Option<Module> {
    if path.is_empty() {
        return None;
    }
    while !path.is_empty() && !known.contains_key(&path) {
        path.pop();
    }
    Some(path)
}

fn uses(known: &BTreeMap<Module, PathBuf>) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut edges = BTreeMap::new();
    for (module, file) in known {
        let text = std::fs::read_to_string(file).unwrap();
        let is_dir_module = matches!(
            file.file_stem().unwrap().to_str(),
            Some("mod" | "lib" | "main")
        );
        let mut used = BTreeSet::new();
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or_default();
            for (at, _) in code.match_indices("crate::") {
                let after = &code[at + "crate::".len()..];
                let paths = match after.strip_prefix('{') {
                    Some(group) => group.split(',').map(ident_path).collect(),
                    None => vec![ident_path(after)],
                };
                used.extend(paths.into_iter().filter_map(|p| resolve(known, p)));
            }
            for (at, _) in code.match_indices("super::") {
                let mut parent = module.clone();
                if !is_dir_module {
                    parent.pop();
                }
                parent.pop();
                parent.extend(ident_path(&code[at + "super::".len()..]));
                used.extend(resolve(known, parent));
            }
        }
        used.remove(module);
        edges.insert(module.clone(), used);
    }
    edges
}

fn name(module: &Module) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

#[test]
fn no_module_uses_a_module_that_uses_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    check_modules(&root.join("src"));
    check_modules(&root.join("core/src"));
}

fn check_modules(src: &Path) {
    let mut known = BTreeMap::new();
    modules(src, &Vec::new(), &mut known);
    let edges = uses(&known);
    for (from, to) in &edges {
        println!(
            "{} -> {:?}",
            name(from),
            to.iter().map(name).collect::<Vec<_>>()
        );
    }
    // Depth-first from each module: a path back to it is a cycle.
    for start in edges.keys() {
        let mut stack: Vec<Vec<&Module>> = vec![vec![start]];
        let mut seen = BTreeSet::new();
        while let Some(path) = stack.pop() {
            let last = *path.last().unwrap();
            for next in &edges[last] {
                if next == start {
                    let cycle: Vec<String> = path.iter().map(|m| name(m)).collect();
                    panic!("import cycle: {} -> {}", cycle.join(" -> "), name(start));
                }
                if seen.insert(next) {
                    let mut longer = path.clone();
                    longer.push(next);
                    stack.push(longer);
                }
            }
        }
    }
    // The root uses every module (it declares and wires them): none uses it.
    for (from, to) in &edges {
        assert!(
            from.is_empty() || !to.contains(&Vec::new()),
            "{} uses an item of the crate root",
            name(from)
        );
    }
}
