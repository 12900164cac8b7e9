//! `ctxsync up --demo`, the README's run command, as the real binary: every
//! service in one process, a real workspace-agent process, a held first turn.

use std::process::Command;

use testkit::{NatsServer, TestDatabase, workspace_binary};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_demo_holds_the_first_turn_until_discovery_completes_and_stops_cleanly() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let data_dir = tempfile::tempdir().unwrap();
    // The demo runs these binaries from next to ctxsync.
    workspace_binary("workspace-agent", "workspace-agent");
    workspace_binary("mcp-fixture", "mcp-fixture");
    let workspace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/demo/workspace");
    let output = tokio::task::spawn_blocking({
        let (nats_url, db_url) = (nats.url(), db.url().to_owned());
        let data_dir = data_dir.path().to_owned();
        move || {
            Command::new(env!("CARGO_BIN_EXE_ctxsync"))
                .args(["up", "--demo", "--exit-after-demo"])
                .args(["--nats-url", &nats_url, "--database-url", &db_url])
                .arg("--data-dir")
                .arg(&data_dir)
                .args(["--demo-workspace", workspace])
                .args([
                    "--ingest-addr",
                    "127.0.0.1:0",
                    "--store-addr",
                    "127.0.0.1:0",
                ])
                .args([
                    "--gate-addr",
                    "127.0.0.1:0",
                    "--catalog-addr",
                    "127.0.0.1:0",
                ])
                .output()
                .expect("ctxsync runs")
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let position = |needle: &str| {
        stdout
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} missing from:\n{stdout}"))
    };
    // The timeline, in order: the turn is asked while pending and answered after completion.
    let asked = position("chat asks first turn");
    let complete = position("complete               initial MCP discovery finished");
    let answered = position("gate answered          GATE_DECISION_READY");
    assert!(position("ms  registered") < position("ms  startup"));
    assert!(asked < complete && complete < answered);
    assert!(
        stdout.contains("server notes        2 tools: notes__echo, notes__add"),
        "{stdout}"
    );
    assert!(stdout.contains("failed broken"), "{stdout}");
    assert!(stdout.contains("skill release-notes"), "{stdout}");
    assert!(stdout.contains("catalog STATUS_READY"), "{stdout}");
    // The demo's planted secret is never printed.
    assert!(
        !stdout.contains("demo-secret-never-shown") && !stderr.contains("demo-secret-never-shown")
    );

    // `ctxsync latency` right after the demo counts what it did: the held
    // first turn is a recorded gate wait, as long as the demo printed.
    let latency = Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args(["latency", "--json", "--database-url", db.url()])
        .output()
        .expect("ctxsync latency runs");
    assert!(latency.status.success(), "{latency:?}");
    let report: serde_json::Value = serde_json::from_slice(&latency.stdout).unwrap();
    let waits = report["gate_waits"].as_array().expect("gate_waits");
    let ready = waits
        .iter()
        .find(|w| w["outcome"] == "ready")
        .unwrap_or_else(|| panic!("no ready wait recorded: {report}"));
    assert_eq!(ready["wait"]["count"], "1", "{report}");
    assert!(ready["wait"]["max_ms"].as_f64().unwrap() > 0.0, "{report}");
}
