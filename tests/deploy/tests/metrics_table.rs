//! The README's metrics table names exactly the metrics the code records or
//! describes, each in the row of the service whose code has it.

use std::collections::{BTreeMap, BTreeSet};

use deploy_checks::{metric_names_in_code, repo_root};

fn table() -> BTreeMap<String, BTreeSet<String>> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let table = readme
        .split("Metrics (all prefixed `ctxsync_`)")
        .nth(1)
        .expect("the README's metrics table");
    let mut rows = BTreeMap::new();
    for line in table.lines().skip_while(|l| !l.starts_with('|')) {
        let Some(row) = line.strip_prefix('|') else {
            break;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        if cells.len() < 2 || cells[0] == "service" || cells[0].starts_with("---") {
            continue;
        }
        let names = cells[1]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|name| format!("ctxsync_{name}"))
            .collect();
        rows.insert(cells[0].to_owned(), names);
    }
    rows
}

/// `ctxsync_*` literals in one crate's `src`.
fn names_in(dir: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut stack = vec![repo_root().join("services").join(dir).join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for piece in text.split('"').skip(1).step_by(2) {
                    if piece.starts_with("ctxsync_")
                        && piece.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    {
                        names.insert(piece.to_owned());
                    }
                }
            }
        }
    }
    names
}

#[test]
fn the_readme_metrics_table_matches_the_code() {
    let table = table();
    let documented: BTreeSet<String> = table.values().flatten().cloned().collect();
    let in_code = metric_names_in_code();
    assert_eq!(
        documented.difference(&in_code).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "documented, but in no code"
    );
    assert_eq!(
        in_code.difference(&documented).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "in the code, but not in the README's table"
    );
    for (row, dir) in [
        ("every one", "runtime"),
        ("agent-ingest", "agent-ingest"),
        ("snapshot-store", "snapshot-store"),
        ("workspace-agent", "workspace-agent"),
        ("chat-gate", "chat-gate"),
        ("catalog", "catalog"),
    ] {
        let names = names_in(dir);
        for name in &table[row] {
            assert!(
                names.contains(name),
                "{name} (row {row}) is not in services/{dir}"
            );
        }
    }
}
