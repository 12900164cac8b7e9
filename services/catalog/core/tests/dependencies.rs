//! The core stays a core: nothing it depends on, directly or through
//! another crate, is a transport (read from the workspace's Cargo.lock,
//! which lists every package with its dependencies, dev-dependencies
//! included).

use std::collections::{BTreeMap, BTreeSet};

/// Crates the core must not reach: NATS, Postgres, HTTP servers and
/// clients, MCP transports, process spawning.
const TRANSPORTS: &[&str] = &[
    "async-nats",
    "sqlx",
    "sqlx-core",
    "sqlx-postgres",
    "axum",
    "hyper",
    "rmcp",
    "reqwest",
    "process-wrap",
    "ctxsync-mcp",
    "ctxsync-runtime",
];

/// Package name to the names of its dependencies.
fn lock_graph() -> BTreeMap<String, Vec<String>> {
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../Cargo.lock"))
        .expect("the workspace's Cargo.lock");
    let mut graph = BTreeMap::new();
    for package in lock.split("[[package]]").skip(1) {
        let mut name = None;
        let mut dependencies = Vec::new();
        let mut in_dependencies = false;
        for line in package.lines().map(str::trim) {
            if let Some(value) = line.strip_prefix("name = ") {
                name = Some(value.trim_matches('"').to_owned());
            } else if line.starts_with("dependencies = [") {
                in_dependencies = true;
            } else if in_dependencies && line == "]" {
                in_dependencies = false;
            } else if in_dependencies {
                // `"name"`, or `"name version"` when two versions are locked.
                let dependency = line.trim_matches(|c| c == '"' || c == ',');
                let dependency = dependency.split(' ').next().unwrap_or_default();
                dependencies.push(dependency.to_owned());
            }
        }
        if let Some(name) = name {
            graph
                .entry(name)
                .or_insert_with(Vec::new)
                .extend(dependencies);
        }
    }
    graph
}

#[test]
fn the_core_reaches_no_transport() {
    let graph = lock_graph();
    assert!(graph.contains_key("catalog-core"), "catalog-core is locked");
    let mut reached = BTreeSet::new();
    let mut next = vec!["catalog-core".to_owned()];
    while let Some(package) = next.pop() {
        for dependency in graph.get(&package).into_iter().flatten() {
            if reached.insert(dependency.clone()) {
                next.push(dependency.clone());
            }
        }
    }
    let forbidden: Vec<_> = TRANSPORTS
        .iter()
        .filter(|t| reached.contains(**t))
        .collect();
    assert!(forbidden.is_empty(), "catalog-core reaches {forbidden:?}");
    assert!(
        reached.contains("ctxsync-proto"),
        "the walk follows the graph"
    );
}
