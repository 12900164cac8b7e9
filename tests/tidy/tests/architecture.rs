//! ARCHITECTURE.md is a map, so it may only name what exists, and the cores
//! it describes are transport-free by their dependency graph, not by habit.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use tidy::{code_of, files, repo_root};

/// Crates a core may not reach, directly or through another crate: each is a
/// transport (NATS, SQL, HTTP server or client).
const TRANSPORTS: &[&str] = &[
    "async-nats",
    "sqlx",
    "sqlx-core",
    "axum",
    "hyper",
    "reqwest",
    "tokio-postgres",
];

/// `cargo metadata` of the workspace: package id → (name, manifest path),
/// and each package's normal and build dependencies (dev ones excluded: a
/// core's tests may start whatever they like).
struct Graph {
    names: BTreeMap<String, (String, PathBuf)>,
    deps: BTreeMap<String, Vec<String>>,
    members: Vec<String>,
}

fn metadata() -> Graph {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(repo_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("metadata is JSON");
    let mut names = BTreeMap::new();
    for package in json["packages"].as_array().unwrap() {
        names.insert(
            package["id"].as_str().unwrap().to_owned(),
            (
                package["name"].as_str().unwrap().to_owned(),
                PathBuf::from(package["manifest_path"].as_str().unwrap()),
            ),
        );
    }
    let mut deps = BTreeMap::new();
    for node in json["resolve"]["nodes"].as_array().unwrap() {
        let id = node["id"].as_str().unwrap().to_owned();
        let normal: Vec<String> = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|dep| {
                dep["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|kind| kind["kind"].as_str() != Some("dev"))
            })
            .map(|dep| dep["pkg"].as_str().unwrap().to_owned())
            .collect();
        deps.insert(id, normal);
    }
    let members = json["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_owned())
        .collect();
    Graph {
        names,
        deps,
        members,
    }
}

/// The path by which `from` reaches a transport crate, if it does.
fn path_to_transport(graph: &Graph, from: &str) -> Option<Vec<String>> {
    let mut seen = BTreeSet::new();
    let mut pending = vec![vec![from.to_owned()]];
    while let Some(path) = pending.pop() {
        let last = path.last().unwrap();
        if !seen.insert(last.clone()) {
            continue;
        }
        let name = &graph.names[last].0;
        if TRANSPORTS.contains(&name.as_str()) {
            return Some(path.iter().map(|id| graph.names[id].0.clone()).collect());
        }
        for dep in graph.deps.get(last).into_iter().flatten() {
            let mut next = path.clone();
            next.push(dep.clone());
            pending.push(next);
        }
    }
    None
}

#[test]
fn cores_reach_no_transport_crate() {
    let graph = metadata();
    let cores: Vec<&String> = graph
        .members
        .iter()
        .filter(|id| graph.names[*id].0.ends_with("-core"))
        .collect();
    assert!(
        cores.len() >= 4,
        "expected the store, gate, publisher and catalog cores among the workspace members, found {:?}",
        cores
            .iter()
            .map(|id| &graph.names[*id].0)
            .collect::<Vec<_>>()
    );
    let mut trouble = Vec::new();
    for core in cores {
        if let Some(path) = path_to_transport(&graph, core) {
            trouble.push(path.join(" -> "));
        }
    }
    assert!(
        trouble.is_empty(),
        "core crates reach a transport:\n{}",
        trouble.join("\n")
    );
}

/// Definitions in the workspace's Rust and protobuf sources: the names a
/// document may use as a type, function, module or setting.
struct Names {
    items: BTreeSet<String>,
    code: String,
}

fn names(root: &Path) -> Names {
    let mut items = BTreeSet::new();
    let mut code = String::new();
    let keywords = [
        "fn", "struct", "enum", "trait", "type", "mod", "const", "static", "union", "message",
        "service", "rpc",
    ];
    for file in files(root, &[".rs", ".proto"]) {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for line in text.lines() {
            let line = code_of(line);
            code.push_str(line);
            code.push('\n');
            let words: Vec<&str> = line
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '!'))
                .filter(|w| !w.is_empty())
                .collect();
            for pair in words.windows(2) {
                if keywords.contains(&pair[0]) || pair[0] == "macro_rules!" {
                    items.insert(pair[1].to_owned());
                }
            }
            // Enum variants and re-exports: `Name,` `Name(` `Name {` at the
            // start of a line, and `use … Name` anywhere.
            let trimmed = line.trim_start();
            let first: String = trimmed
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if first.chars().next().is_some_and(char::is_uppercase) {
                items.insert(first);
            }
            if trimmed.starts_with("pub use") || trimmed.starts_with("use ") {
                for word in &words {
                    items.insert((*word).to_owned());
                }
            }
        }
    }
    // Crate names as code spells them.
    for manifest in files(root, &["Cargo.toml"]) {
        let text = std::fs::read_to_string(&manifest).unwrap_or_default();
        for line in text.lines() {
            if let Some(name) = line.strip_prefix("name = \"") {
                let name = name.trim_end_matches('"');
                items.insert(name.replace('-', "_"));
                items.insert(name.to_owned());
            }
        }
    }
    Names { items, code }
}

/// The backticked spans of a markdown text outside fenced blocks, with the
/// heading (`###`) they are under.
fn spans(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut heading = String::new();
    let mut fenced = false;
    // A span may wrap onto the next line: join each paragraph first.
    let mut paragraph = String::new();
    let flush = |paragraph: &mut String, heading: &str, found: &mut Vec<(String, String)>| {
        let mut parts = paragraph.split('`');
        parts.next();
        while let (Some(inside), Some(_)) = (parts.next(), parts.next()) {
            found.push((heading.to_owned(), inside.to_owned()));
        }
        paragraph.clear();
    };
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if line.starts_with('#') {
            flush(&mut paragraph, &heading, &mut found);
            heading = line.to_owned();
            flush(&mut line.to_owned(), &heading, &mut found);
            continue;
        }
        if line.trim().is_empty() {
            flush(&mut paragraph, &heading, &mut found);
        } else {
            paragraph.push(' ');
            paragraph.push_str(line.trim());
        }
    }
    flush(&mut paragraph, &heading, &mut found);
    found
}

/// The directory of the crate a `###` heading describes (its first
/// backticked path), where a short path like `nats/` is looked up.
fn heading_dir(root: &Path, heading: &str) -> Option<PathBuf> {
    let inside = heading.split('`').nth(1)?;
    let dir = root.join(inside.trim_end_matches('/'));
    dir.is_dir().then_some(dir)
}

/// A span with a `/` is a path when its first part is a directory (of the
/// repository or of the heading's crate); `tools/list` is an MCP method.
fn looks_like_path(root: &Path, dir: Option<&Path>, span: &str) -> bool {
    let extensions = [
        ".rs", ".md", ".toml", ".yaml", ".proto", ".sh", ".mjs", ".conf",
    ];
    !span.contains(' ')
        && !span.contains("://")
        && !span.contains('<')
        && !span.contains('{')
        && !span.contains('*')
        && !span.contains('…')
        && !span.starts_with('$')
        && !span.starts_with('/')
        && (extensions.iter().any(|ext| span.ends_with(ext))
            || span.split_once('/').is_some_and(|(first, _)| {
                let mut bases = vec![root.to_owned()];
                if let Some(dir) = dir {
                    bases.push(dir.to_owned());
                    bases.push(dir.join("src"));
                }
                bases.iter().any(|base| base.join(first).is_dir())
            }))
}

fn is_env_var(span: &str) -> bool {
    ["CTXSYNC_", "NATS_", "DATABASE_"]
        .iter()
        .any(|prefix| span.starts_with(prefix))
        && span
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// `a::b::C`, `Type::method` or a CamelCase type name.
fn rust_path(span: &str) -> Option<Vec<&str>> {
    let ident = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| c.is_alphanumeric() || c == '_')
            && !s.chars().next().unwrap().is_ascii_digit()
    };
    if span.contains("::") {
        let segments: Vec<&str> = span.split("::").collect();
        return segments.iter().all(|s| ident(s)).then_some(segments);
    }
    let camel = span.chars().next().is_some_and(|c| c.is_ascii_uppercase())
        && span.chars().any(|c| c.is_ascii_lowercase())
        && ident(span);
    camel.then(|| vec![span])
}

/// Names of the standard library a document may use.
const STD_NAMES: &[&str] = &["Debug", "Display", "Default", "Clone", "Send", "Sync"];

#[test]
fn architecture_names_only_what_exists() {
    let root = repo_root();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let names = names(&root);
    let mut missing = Vec::new();
    let mut checked = 0;
    for (heading, span) in spans(&text) {
        let dir = heading_dir(&root, &heading);
        if looks_like_path(&root, dir.as_deref(), &span) {
            checked += 1;
            let path = span.trim_end_matches('/');
            let mut candidates = vec![root.join(path)];
            if let Some(dir) = dir {
                candidates.push(dir.join(path));
                candidates.push(dir.join("src").join(path));
            }
            if !candidates.iter().any(|c| c.exists()) {
                missing.push(format!("path `{span}` (under {heading:?})"));
            }
        } else if is_env_var(&span) {
            checked += 1;
            if !names.code.contains(&span) {
                missing.push(format!("setting `{span}`"));
            }
        } else if let Some(flag) = span
            .strip_prefix("--")
            .filter(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        {
            checked += 1;
            let field = flag.replace('-', "_");
            if !names.code.contains(&field) && !names.code.contains(&format!("\"{flag}\"")) {
                missing.push(format!("flag `{span}`"));
            }
        } else if let Some(segments) = rust_path(&span) {
            checked += 1;
            for segment in segments {
                if !names.items.contains(segment) && !STD_NAMES.contains(&segment) {
                    missing.push(format!("`{span}`: no item named {segment}"));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} names checked: is the span parser broken?"
    );
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names what does not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn architecture_stays_a_map() {
    // Half of what it had grown to (48 KB) when it was rewritten as a map.
    const MAX_BYTES: usize = 24 * 1024;
    let size = std::fs::metadata(repo_root().join("ARCHITECTURE.md"))
        .unwrap()
        .len() as usize;
    assert!(
        size <= MAX_BYTES,
        "ARCHITECTURE.md is {size} bytes, over {MAX_BYTES}: move detail into the README of the crate it explains"
    );
}
