//! The official MCP conformance suite (`@modelcontextprotocol/conformance`,
//! pinned in `tests/mcp-servers/package.json`) run against `/mcp`: every
//! server scenario (`--suite all`), with an upstream of our own that offers
//! what the scenarios call (`tests/mcp-servers/conformance-upstream.mjs`)
//! behind the catalog, named `bare`. A scenario that does not apply to a
//! gateway is in `conformance-baseline.yml` with its reason (the suite
//! fails the run if a listed scenario passes); every other must pass.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use catalog::config::{Naming, Processes, ServerConfig};
use common::*;
use ctxsync_mcp::{ServerSpec, TransportSpec};

fn servers_tests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/mcp-servers")
}

/// One scenario's line of the suite's summary: `✓ name: N passed, M failed`.
fn scenario_lines(output: &str) -> Vec<&str> {
    output
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with('✓') || line.starts_with('✗'))
        .collect()
}

/// The checks that failed, from the suite's `checks.json` files.
fn failed_checks(results: &Path) -> Vec<String> {
    let mut failed = Vec::new();
    for entry in std::fs::read_dir(results).into_iter().flatten().flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join("checks.json")) else {
            continue;
        };
        let Ok(checks) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        for check in checks.as_array().into_iter().flatten() {
            if check["status"] == "FAILURE" {
                failed.push(check.to_string());
            }
        }
    }
    failed
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_conformance_suite_passes_against_the_catalog() {
    let upstream = ServerSpec {
        name: "conformance".into(),
        transport: TransportSpec::Stdio {
            command: "node".into(),
            args: vec![
                servers_tests_dir()
                    .join("conformance-upstream.mjs")
                    .display()
                    .to_string(),
            ],
            env: Default::default(),
            cwd: None,
        },
    };
    // One scenario is one MCP session, and the suite ends none of them: a
    // shared process serves them all (a process each would reach the
    // tenant's process bound, as it should).
    let shared = ServerConfig {
        processes: Processes::Shared,
        ..server("conformance", &upstream)
    };
    let mut config = tenants(vec![("acme", vec![shared])]);
    config.tenants[0].naming = Naming::Bare;
    // The suite's ~40 sessions are one client in a hurry: no rate limit.
    let mut settings = settings();
    settings.mcp_rate_limit = None;
    let harness = Harness::start_with_store(config, settings).await;
    let key = harness.tenant_key("acme").await;
    let url = format!("http://{}/mcp", harness.running().http_addr());

    let installed = mcp_fixture::reference::servers_dir();
    let results = tempfile::tempdir().unwrap();
    let run = tokio::process::Command::new(installed.join("node22/bin/node"))
        .arg("--import")
        .arg(servers_tests_dir().join("auth-header.mjs"))
        .arg(installed.join("node_modules/@modelcontextprotocol/conformance/dist/index.js"))
        .args(["server", "--url", &url, "--suite", "all"])
        .arg("--expected-failures")
        .arg(servers_tests_dir().join("conformance-baseline.yml"))
        .arg("-o")
        .arg(results.path())
        .env("MCP_AUTH_HEADER", format!("Bearer {key}"))
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the suite finishes within 300 s")
        .expect("the conformance suite runs on Node 22 (tests/mcp-servers/install.sh)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines = scenario_lines(&stdout);
    println!("CONFORMANCE {} scenarios:", lines.len());
    for line in &lines {
        println!("CONFORMANCE {line}");
    }
    if let Some(total) = stdout.lines().rev().find(|l| l.contains("Total:")) {
        println!("CONFORMANCE {}", total.trim());
    }
    if !output.status.success() {
        for detail in failed_checks(results.path()) {
            println!("CONFORMANCE FAILED CHECK {detail}");
        }
    }
    assert!(
        output.status.success(),
        "a scenario failed that the baseline does not list (or a listed one passed): {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let failed: Vec<&&str> = lines.iter().filter(|l| l.starts_with('✗')).collect();
    assert!(
        failed.len() <= 1,
        "only the baseline's scenarios may fail: {failed:?}"
    );
    assert!(lines.len() >= 30, "every server scenario ran: {stdout}");
    harness.stop().await;
}
