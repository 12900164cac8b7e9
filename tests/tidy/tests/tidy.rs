//! The repository keeps its own rules: every NATS subject is built by
//! `Subjects`, a store call is made only through its declaration, every
//! document the code cites is in the repository, and no module imports a
//! module that imports it back.

use std::collections::BTreeSet;
use std::path::Path;

use tidy::{code_of, files, find_cycle, module_graph, repo_root, string_literals};

/// Crates with a `src/` of their own.
fn crate_sources(root: &Path) -> Vec<std::path::PathBuf> {
    let mut sources = vec![root.join("proto/src")];
    for parent in ["services", "tests"] {
        for entry in std::fs::read_dir(root.join(parent)).unwrap().flatten() {
            // A service's core is a crate of its own under it (`core/src`).
            for src in [entry.path().join("src"), entry.path().join("core/src")] {
                if src.is_dir() {
                    sources.push(src);
                }
            }
        }
    }
    sources.sort();
    sources
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let root = repo_root();
    let mut cycles = Vec::new();
    for src in crate_sources(&root) {
        let graph = module_graph(&src);
        if let Some(cycle) = find_cycle(&graph) {
            let name = src
                .parent()
                .unwrap()
                .strip_prefix(&root)
                .unwrap()
                .display()
                .to_string();
            cycles.push(format!("{name}: {}", cycle.join(" -> ")));
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

/// The first two tokens of every subject `Subjects` builds (`store.agent`,
/// `gate.turn`, …): a literal holding one after a placeholder is a subject
/// built by hand.
fn subject_stems(root: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(root.join("proto/src/subjects.rs")).unwrap();
    let mut stems = BTreeSet::new();
    for line in text.lines() {
        let code = code_of(line);
        if !code.contains("self.join(") {
            continue;
        }
        for literal in string_literals(code) {
            let tokens: Vec<&str> = literal.split('.').take(2).collect();
            if tokens.len() == 2 && tokens.iter().all(|t| !t.contains('{') && !t.is_empty()) {
                stems.insert(tokens.join("."));
            }
        }
    }
    assert!(stems.len() >= 8, "subjects.rs changed shape: {stems:?}");
    stems
}

/// `file:line: text` of every line of production code (and testkit) outside
/// `proto/src/subjects.rs` whose code (comments cut) `matches`.
fn production_lines_where(root: &Path, matches: impl Fn(&str) -> bool) -> Vec<String> {
    let mut found = Vec::new();
    let mut scanned = crate_sources(root);
    scanned.retain(|src| !src.starts_with(root.join("tests")) || src.ends_with("testkit/src"));
    for src in scanned {
        for file in files(&src, &[".rs"]) {
            if file.ends_with("proto/src/subjects.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (number, line) in text.lines().enumerate() {
                if matches(code_of(line)) {
                    found.push(format!(
                        "{}:{}: {}",
                        file.strip_prefix(root).unwrap().display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    found
}

#[test]
fn every_subject_is_built_by_subjects() {
    let root = repo_root();
    let stems = subject_stems(&root);
    let built_by_hand = production_lines_where(&root, |code| {
        let literals = string_literals(code);
        let by_prefix = code.contains(".prefix()") && literals.iter().any(|l| l.starts_with("{}."));
        let by_stem = literals.iter().any(|literal| {
            stems
                .iter()
                .any(|stem| literal.contains(&format!("}}.{stem}")))
        });
        by_prefix || by_stem
    });
    assert!(
        built_by_hand.is_empty(),
        "subjects built outside ctxsync_proto::subjects::Subjects:\n{}",
        built_by_hand.join("\n")
    );
}

/// The request subjects of `Subjects` whose calls are declared in
/// `ctxsync_proto::rpc` (the store's and the catalog's): named anywhere else
/// in a crate's sources, a subject could be asked with other types than its
/// call's.
fn declared_call_subjects(root: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(root.join("proto/src/subjects.rs")).unwrap();
    let mut methods = BTreeSet::new();
    let mut request_reply = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with("///") {
            request_reply |= line.contains("(request/reply");
            continue;
        }
        let declared = ["store_", "catalog_"].into_iter().find_map(|service| {
            Some((
                service,
                line.strip_prefix("pub fn ")?.strip_prefix(service)?,
            ))
        });
        if let Some((service, rest)) = declared
            && request_reply
        {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            methods.insert(format!("{service}{name}"));
        }
        request_reply = false;
    }
    assert!(
        methods.len() >= 14 && methods.contains("catalog_prepare"),
        "subjects.rs changed shape: {methods:?}"
    );
    methods
}

#[test]
fn store_and_catalog_calls_are_made_through_their_declaration() {
    let root = repo_root();
    let methods = declared_call_subjects(&root);
    let by_hand = production_lines_where(&root, |code| {
        methods.iter().any(|m| code.contains(&format!(".{m}(")))
    });
    assert!(
        by_hand.is_empty(),
        "store or catalog subjects named outside ctxsync_proto::rpc (call them through \
         ctxsync_runtime::store::StoreClient or rpc::call_for_tenant, serve them with \
         rpc::serve_rpc):\n{}",
        by_hand.join("\n")
    );
}

/// The design notes ARCHITECTURE.md holds (`### name` under `## Design notes`).
fn design_notes(root: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let mut notes = BTreeSet::new();
    let mut inside = false;
    for line in text.lines() {
        if let Some(title) = line.strip_prefix("## ") {
            inside = title.trim() == "Design notes";
        } else if inside && let Some(title) = line.strip_prefix("### ") {
            notes.insert(title.trim().to_lowercase());
        }
    }
    notes
}

#[test]
fn every_document_the_code_cites_is_in_the_repository() {
    let root = repo_root();
    let notes = design_notes(&root);
    assert!(!notes.is_empty(), "ARCHITECTURE.md has no design notes");
    let extensions = [
        ".rs",
        ".md",
        ".proto",
        ".yaml",
        ".yml",
        ".sh",
        ".toml",
        ".conf",
        "Dockerfile",
        "run",
    ];
    let mut trouble = Vec::new();
    let mut texts = files(&root, &extensions);
    texts.retain(|f| !f.starts_with(root.join("tests/tidy")));
    for file in texts {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let shown = file.strip_prefix(&root).unwrap().display().to_string();
        for (number, line) in text.lines().enumerate() {
            let at = format!("{shown}:{}", number + 1);
            // Documents this repository never had.
            for outside in ["DESIGN §", "DESIGN.md", "ADR-0", "seed 0", "seeds/"] {
                if line.contains(outside) {
                    trouble.push(format!(
                        "{at}: cites {outside:?}, which is not in the repository"
                    ));
                }
            }
            // "design note: <name>" names a note of ARCHITECTURE.md.
            let lower = line.to_lowercase();
            if let Some(at_note) = lower.find("design note: ") {
                let cited: String = lower[at_note + "design note: ".len()..]
                    .chars()
                    .take_while(|c| {
                        c.is_alphanumeric() || *c == ' ' || *c == '\'' || *c == '-' || *c == ','
                    })
                    .collect();
                let cited = cited.trim().trim_end_matches(',');
                if !notes.iter().any(|note| cited.starts_with(note.as_str())) {
                    trouble.push(format!(
                        "{at}: design note {cited:?} is not in ARCHITECTURE.md"
                    ));
                }
            }
            // Relative markdown links point at files that exist.
            if shown.ends_with(".md") {
                let mut rest = line;
                while let Some(open) = rest.find("](") {
                    rest = &rest[open + 2..];
                    let target: String = rest.chars().take_while(|c| *c != ')').collect();
                    let path = target.split('#').next().unwrap_or_default();
                    if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                        continue;
                    }
                    if !file.parent().unwrap().join(path).exists() {
                        trouble.push(format!("{at}: link to {path} which does not exist"));
                    }
                }
            }
        }
    }
    assert!(trouble.is_empty(), "{}", trouble.join("\n"));
}
