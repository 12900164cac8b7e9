//! MCP discovery against the fixture server (failure modes) and the real
//! reference servers: outcomes, phase, reload, list_changed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use ctxsync_proto::v1::{ResourceStatus, context_resource::Body, mcp_discovery::Phase};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use workspace_agent::discovery;

const TIMEOUT: Duration = Duration::from_secs(20);

fn start(ws: &Workspace, timeout: Duration) -> (discovery::DiscoveryHandle, CancellationToken) {
    testkit::init_logs();
    let shutdown = CancellationToken::new();
    (
        discovery::start(ws.settings(timeout), shutdown.clone()),
        shutdown,
    )
}

async fn stop(handle: discovery::DiscoveryHandle, shutdown: CancellationToken) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), handle.join())
        .await
        .expect("discovery stops and closes its connections in time");
}

#[tokio::test]
async fn zero_servers_complete_at_once() {
    let ws = Workspace::new();
    ws.write_servers(&[]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let report = handle.reports().borrow().clone();
    assert_eq!(
        report.phase,
        Phase::Complete,
        "zero servers: complete at once"
    );
    assert_eq!(report.resources.len(), 1, "{report:#?}");
    assert_eq!(report.resources[0].status, ResourceStatus::Ok as i32);
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn missing_file_is_not_an_error_and_config_errors_are_attributed_to_their_files() {
    let ws = Workspace::new();
    let bad_json = ws.work().join("bad.json");
    std::fs::write(&bad_json, "{\"mcpServers\": {").unwrap();
    let semantic = ws.work().join("semantic.json");
    write_config(
        &semantic,
        &[
            ("no_command", json!({"args": ["x"]})),
            ("a__b", json!({"command": "x"})),
        ],
    );
    let files = format!("missing.json,{},{}", bad_json.display(), semantic.display());
    let env = BTreeMap::from([("CTXSYNC_MCP_CONFIG_FILES".to_owned(), files)]);
    let shutdown = CancellationToken::new();
    let handle = discovery::start(ws.settings_with_env(TIMEOUT, env), shutdown.clone());
    let report = handle.reports().borrow().clone();
    assert_eq!(report.phase, Phase::Complete);
    assert!(
        report
            .resource(&format!(
                "mcp_config:{}",
                ws.work().join("missing.json").display()
            ))
            .is_none()
    );
    let bad = report
        .resource(&format!("mcp_config:{}", bad_json.display()))
        .unwrap();
    assert_eq!(bad.status, ResourceStatus::Invalid as i32);
    assert!(
        bad.error
            .starts_with(&format!("{}: invalid JSON at line ", bad_json.display())),
        "{}",
        bad.error
    );
    let sem = report
        .resource(&format!("mcp_config:{}", semantic.display()))
        .unwrap();
    assert_eq!(sem.status, ResourceStatus::Invalid as i32);
    assert!(
        sem.error.contains("\"no_command\"") && sem.error.contains("\"a__b\""),
        "{}",
        sem.error
    );
    // A named server with a config error has its own failed row; a bad
    // name has none (it cannot be a row's key).
    let servers: Vec<&str> = report
        .resources
        .iter()
        .filter_map(|r| r.source.strip_prefix("mcp_server:"))
        .collect();
    assert_eq!(servers, ["no_command"]);
    let no_command = report.resource("mcp_server:no_command").unwrap();
    assert_eq!(no_command.status, ResourceStatus::Invalid as i32);
    assert!(
        sem.error.contains(&no_command.error),
        "{} / {}",
        sem.error,
        no_command.error
    );
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn first_occurrence_wins_across_files() {
    let ws = Workspace::new();
    let first = ws.work().join("first.json");
    let second = ws.work().join("second.json");
    write_config(&first, &[("dup", fixture(&["--mode", "normal"]))]);
    write_config(
        &second,
        &[
            ("dup", fixture(&["--mode", "crash"])),
            ("other", fixture(&["--mode", "zero-tools"])),
        ],
    );
    let env = BTreeMap::from([(
        "CTXSYNC_MCP_CONFIG_FILES".to_owned(),
        format!("{},{}", first.display(), second.display()),
    )]);
    let shutdown = CancellationToken::new();
    let handle = discovery::start(ws.settings_with_env(TIMEOUT, env), shutdown.clone());
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    let dup = server(&report, "dup").unwrap();
    assert_eq!(dup.status, ResourceStatus::Ok as i32, "{dup:?}");
    assert_eq!(tool_names(dup), ["echo", "add"]);
    let Some(Body::McpServer(body)) = &dup.body else {
        panic!()
    };
    assert_eq!(body.config_path, first.display().to_string());
    assert!(is_ok(server(&report, "other")));
    let second_row = report
        .resource(&format!("mcp_config:{}", second.display()))
        .unwrap();
    assert!(
        second_row.warning.contains("\"dup\" is shadowed"),
        "{second_row:?}"
    );
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn zero_tool_server_stays_ok() {
    let ws = Workspace::new();
    ws.write_servers(&[("empty", fixture(&["--mode", "zero-tools"]))]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    let row = server(&report, "empty").expect("a row for the zero-tool server");
    assert_eq!(row.status, ResourceStatus::Ok as i32);
    assert!(row.error.is_empty());
    assert!(tool_names(row).is_empty());
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn partial_failure_carries_the_sanitized_connect_error() {
    let ws = Workspace::new();
    ws.write_servers(&[
        ("good", fixture(&["--mode", "normal"])),
        (
            "leaky",
            fixture_with_env(
                &["--mode", "secret-error"],
                &[("FIXTURE_DB_PASSWORD", "hunter2-configured")],
            ),
        ),
    ]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    assert!(is_ok(server(&report, "good")));
    let leaky = server(&report, "leaky").unwrap();
    assert_eq!(leaky.status, ResourceStatus::Invalid as i32);
    assert!(
        leaky.error.contains("refused the credentials"),
        "{}",
        leaky.error
    );
    assert!(
        !leaky.error.contains("hunter2-configured"),
        "{}",
        leaky.error
    );
    assert!(
        leaky.error.contains("FIXTURE_DB_PASSWORD=[redacted]"),
        "{}",
        leaky.error
    );
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn total_failure_completes_with_every_server_failed() {
    let ws = Workspace::new();
    ws.write_servers(&[
        ("crashes", fixture(&["--mode", "crash"])),
        (
            "missing",
            json!({"command": "/nonexistent/mcp-server-binary"}),
        ),
        (
            "refused",
            json!({"url": format!("http://127.0.0.1:{}/mcp", testkit::free_port())}),
        ),
    ]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    for name in ["crashes", "missing", "refused"] {
        let row = server(&report, name).unwrap_or_else(|| panic!("row for {name}"));
        assert_eq!(
            row.status,
            ResourceStatus::Invalid as i32,
            "{name}: {row:?}"
        );
        assert!(!row.error.is_empty(), "{name} has an error");
    }
    // The arg `crash` is a configured non-flag arg: the sanitizer hides it even in "crashing".
    let crashed = &server(&report, "crashes").unwrap().error;
    assert!(
        crashed.contains("exited during the handshake (exit status: 3)"),
        "{crashed}"
    );
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn a_hung_sibling_does_not_delay_a_healthy_server() {
    let ws = Workspace::new();
    ws.write_servers(&[
        ("hung", fixture(&["--mode", "hang"])),
        ("healthy", fixture(&["--mode", "normal"])),
    ]);
    let handshake_timeout = Duration::from_secs(10);
    let started = Instant::now();
    let (handle, shutdown) = start(&ws, handshake_timeout);
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "healthy server published", |r| {
        is_ok(server(r, "healthy"))
    })
    .await;
    assert!(
        started.elapsed() < handshake_timeout,
        "healthy outcome came before the hung one timed out"
    );
    assert_eq!(
        report.phase,
        Phase::Pending,
        "the hung server is still pending"
    );
    assert!(server(&report, "hung").is_none(), "no row while connecting");
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    let hung = server(&report, "hung").unwrap();
    assert_eq!(hung.status, ResourceStatus::Invalid as i32);
    assert!(hung.error.contains("within 10s"), "{}", hung.error);
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn phase_moves_from_pending_to_complete_exactly_once() {
    let ws = Workspace::new();
    ws.write_servers(&[
        (
            "slow",
            fixture(&["--mode", "slow-start", "--delay-ms", "700"]),
        ),
        ("fast", fixture(&["--mode", "normal"])),
    ]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    let mut phases = vec![reports.borrow_and_update().phase];
    let observer = async {
        while reports.changed().await.is_ok() {
            let report = reports.borrow_and_update().clone();
            if phases.last() != Some(&report.phase) {
                phases.push(report.phase);
            }
            // Later reloads (a server added, one broken) must not move it back.
            if is_ok(server(&report, "late")) && is_invalid(server(&report, "broken")) {
                break;
            }
            if report.phase == Phase::Complete && server(&report, "late").is_none() {
                ws.write_servers(&[
                    (
                        "slow",
                        fixture(&["--mode", "slow-start", "--delay-ms", "700"]),
                    ),
                    ("fast", fixture(&["--mode", "normal"])),
                    (
                        "late",
                        fixture(&["--mode", "slow-start", "--delay-ms", "300"]),
                    ),
                    ("broken", fixture(&["--mode", "crash"])),
                ]);
                handle.reload();
            }
        }
    };
    tokio::time::timeout(DEADLINE, observer)
        .await
        .expect("reload finished");
    assert_eq!(phases, [Phase::Pending, Phase::Complete]);
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn failed_reconnect_keeps_the_old_connection_with_a_warning() {
    let ws = Workspace::new();
    ws.write_servers(&[("svc", fixture(&["--mode", "normal"]))]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    wait_report(&mut reports, "svc up", |r| is_ok(server(r, "svc"))).await;
    ws.write_servers(&[("svc", fixture(&["--mode", "crash"]))]);
    handle.reload();
    let report = wait_report(&mut reports, "warning after failed reconnect", |r| {
        server(r, "svc").is_some_and(|s| !s.warning.is_empty())
    })
    .await;
    let row = server(&report, "svc").unwrap();
    assert_eq!(row.status, ResourceStatus::Ok as i32);
    assert!(row.error.is_empty());
    assert!(
        row.warning.contains("previous connection is kept"),
        "{}",
        row.warning
    );
    assert!(row.warning.contains("exit status: 3"), "{}", row.warning);
    assert_eq!(
        tool_names(row),
        ["echo", "add"],
        "the previous connection's tools stay"
    );
    assert_eq!(report.phase, Phase::Complete);
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn removed_server_leaves_the_report() {
    let ws = Workspace::new();
    ws.write_servers(&[
        ("stays", fixture(&["--mode", "normal"])),
        ("goes", fixture(&["--mode", "zero-tools"])),
    ]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    wait_report(&mut reports, "both up", |r| {
        is_ok(server(r, "stays")) && is_ok(server(r, "goes"))
    })
    .await;
    ws.write_servers(&[("stays", fixture(&["--mode", "normal"]))]);
    handle.reload();
    let report = wait_report(&mut reports, "goes removed", |r| {
        server(r, "goes").is_none()
    })
    .await;
    assert!(is_ok(server(&report, "stays")));
    assert_eq!(report.phase, Phase::Complete);
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn list_changed_relists_the_tools() {
    let ws = Workspace::new();
    let tools_file = ws.dir.path().join("tools.json");
    std::fs::write(&tools_file, r#"[{"name": "alpha", "description": "a"}]"#).unwrap();
    let file = tools_file.display().to_string();
    ws.write_servers(&[(
        "changing",
        fixture(&["--mode", "changing-tools", "--tools-file", &file, "--watch"]),
    )]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let mut reports = handle.reports();
    wait_report(&mut reports, "alpha listed", |r| {
        server(r, "changing").is_some_and(|s| tool_names(s) == ["alpha"])
    })
    .await;
    std::fs::write(
        &tools_file,
        r#"[{"name": "alpha", "description": "a"}, {"name": "beta", "description": "b"}]"#,
    )
    .unwrap();
    let report = wait_report(&mut reports, "beta listed after list_changed", |r| {
        server(r, "changing").is_some_and(|s| tool_names(s) == ["alpha", "beta"])
    })
    .await;
    assert_eq!(
        server(&report, "changing").unwrap().status,
        ResourceStatus::Ok as i32
    );
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn the_file_watcher_reloads_changed_configs() {
    let ws = Workspace::new();
    ws.write_servers(&[("one", fixture(&["--mode", "normal"]))]);
    let (handle, shutdown) = start(&ws, TIMEOUT);
    let _watcher = workspace_agent::watch::spawn(
        handle.context_config(),
        Duration::from_millis(100),
        handle.reload_sender(),
        shutdown.clone(),
    )
    .unwrap();
    let mut reports = handle.reports();
    wait_report(&mut reports, "one up", |r| is_ok(server(r, "one"))).await;
    ws.write_servers(&[
        ("one", fixture(&["--mode", "normal"])),
        ("two", fixture(&["--mode", "zero-tools"])),
    ]);
    wait_report(&mut reports, "two discovered through the watcher", |r| {
        is_ok(server(r, "two")) && is_ok(server(r, "one"))
    })
    .await;
    // An instruction file appearing in the working dir is picked up too.
    std::fs::write(ws.work().join("AGENTS.md"), "be nice").unwrap();
    let source = format!("instruction_file:{}", ws.work().join("AGENTS.md").display());
    wait_report(&mut reports, "AGENTS.md picked up", |r| {
        r.resource(&source).is_some()
    })
    .await;
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn connects_respect_the_concurrency_bound() {
    let ws = Workspace::new();
    let record = ws.dir.path().join("record");
    let record_arg = record.display().to_string();
    let servers: Vec<(String, serde_json::Value)> = (0..4)
        .map(|i| {
            (
                format!("s{i}"),
                fixture(&[
                    "--mode",
                    "slow-start",
                    "--delay-ms",
                    "800",
                    "--record-dir",
                    &record_arg,
                ]),
            )
        })
        .collect();
    let refs: Vec<(&str, serde_json::Value)> = servers
        .iter()
        .map(|(n, v)| (n.as_str(), v.clone()))
        .collect();
    ws.write_servers(&refs);
    let mut settings = ws.settings(TIMEOUT);
    settings.max_concurrent_connects = 2;
    let shutdown = CancellationToken::new();
    let handle = discovery::start(settings, shutdown.clone());
    let mut reports = handle.reports();
    wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    let mut starts: Vec<u128> = mcp_fixture::read_starts(&record)
        .iter()
        .map(|s| s.unix_ms)
        .collect();
    starts.sort_unstable();
    assert_eq!(starts.len(), 4);
    // With two at a time, the third starts only after one of the first two finished (≥ 800 ms).
    assert!(starts[2] - starts[0] >= 700, "starts: {starts:?}");
    stop(handle, shutdown).await;
}

#[tokio::test]
async fn real_reference_servers_list_what_they_list() {
    let ws = Workspace::new();
    let root = ws.dir.path().join("fs-root");
    std::fs::create_dir_all(&root).unwrap();
    use mcp_fixture::reference;
    let specs = [
        reference::everything(),
        reference::filesystem(&root),
        reference::memory(&ws.dir.path().join("memory.jsonl")),
        reference::time(),
    ];
    let entries: Vec<(String, serde_json::Value)> =
        specs.iter().map(|s| (s.name.clone(), entry(s))).collect();
    let refs: Vec<(&str, serde_json::Value)> = entries
        .iter()
        .map(|(n, v)| (n.as_str(), v.clone()))
        .collect();
    ws.write_servers(&refs);
    let (handle, shutdown) = start(&ws, Duration::from_secs(60));
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    for spec in &specs {
        let row = server(&report, &spec.name).unwrap_or_else(|| panic!("row for {}", spec.name));
        assert_eq!(
            row.status,
            ResourceStatus::Ok as i32,
            "{}: {row:?}",
            spec.name
        );
        // Ground truth: what the server lists to a one-shot discovery.
        let direct = ctxsync_mcp::discover(spec, Duration::from_secs(60))
            .await
            .unwrap();
        let mut expected: Vec<String> = direct.tools.iter().map(|t| t.name.clone()).collect();
        let mut got = tool_names(row);
        expected.sort();
        got.sort();
        if spec.name == "everything" {
            // It may add tools after `initialized` (and notify): the first list is a subset.
            assert!(
                expected.iter().all(|t| got.contains(t))
                    || got.iter().all(|t| expected.contains(t)),
                "{got:?} vs {expected:?}"
            );
            assert!(got.iter().any(|t| t == "echo"), "{got:?}");
        } else {
            assert_eq!(got, expected, "{}", spec.name);
        }
    }
    let names = |name: &str| tool_names(server(&report, name).unwrap());
    assert!(names("time").contains(&"get_current_time".to_owned()));
    assert!(names("time").contains(&"convert_time".to_owned()));
    assert!(names("memory").contains(&"create_entities".to_owned()));
    assert!(
        names("filesystem").contains(&"read_text_file".to_owned())
            || names("filesystem").contains(&"read_file".to_owned())
    );
    stop(handle, shutdown).await;
}
