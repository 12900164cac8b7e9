//! Real workspaces as people write them (issue 25): one config file per
//! shape and feature, each run through the real `workspace-agent inspect
//! --json` (started from ANOTHER directory than the workspace) against real
//! servers — the reference servers and the project's fixture, over stdio,
//! streamable HTTP and legacy HTTP+SSE — asserting the servers found, their
//! outcomes and the exact errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::Workspace;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_workspace-agent");

/// `workspace-agent inspect --json` for `ws`, run from a directory that is
/// not the workspace, with `env` added.
fn inspect(ws: &Workspace, env: &[(&str, &str)]) -> (Value, String) {
    let elsewhere = tempfile::tempdir().unwrap();
    let mut command = Command::new(BIN);
    for (var, _) in std::env::vars() {
        if var.starts_with("CTXSYNC_") {
            command.env_remove(var);
        }
    }
    command
        .current_dir(elsewhere.path())
        .env("HOME", ws.home())
        .env("CTXSYNC_WORKDIR", ws.work())
        .env("CTXSYNC_MCP_HANDSHAKE_TIMEOUT", "20s")
        .envs(env.iter().copied())
        .args(["inspect", "--json"]);
    let output: Output = command.output().expect("running workspace-agent");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "workspace-agent failed: {stderr}");
    let push: Value = serde_json::from_slice(&output.stdout).expect("JSON output");
    assert_eq!(push["mcp_discovery"]["phase"], "PHASE_COMPLETE", "{push:#}");
    (push, stderr)
}

fn row<'a>(push: &'a Value, source: &str) -> &'a Value {
    push["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["source"] == source)
        .unwrap_or_else(|| panic!("no row {source} in {push:#}"))
}

fn server<'a>(push: &'a Value, name: &str) -> &'a Value {
    row(push, &format!("mcp_server:{name}"))
}

fn config<'a>(push: &'a Value, path: &Path) -> &'a Value {
    row(push, &format!("mcp_config:{}", path.display()))
}

fn servers(push: &Value) -> Vec<String> {
    push["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["source"].as_str()?.strip_prefix("mcp_server:"))
        .map(str::to_owned)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn tools(row: &Value) -> Vec<String> {
    row["mcp_server"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

#[track_caller]
fn assert_ok(row: &Value, expected_tools: &[&str]) {
    assert_eq!(row["status"], "RESOURCE_STATUS_OK", "{row:#}");
    assert_eq!(row["error"], "", "{row:#}");
    assert_eq!(tools(row), expected_tools, "{row:#}");
}

fn fixture_bin() -> String {
    mcp_fixture::fixture_binary().display().to_string()
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn link_fixture(at: &Path) {
    std::fs::create_dir_all(at.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(mcp_fixture::fixture_binary(), at).unwrap();
}

fn everything_bin() -> PathBuf {
    let ctxsync_mcp::TransportSpec::Stdio { command, .. } =
        mcp_fixture::reference::everything().transport
    else {
        panic!("stdio")
    };
    PathBuf::from(command)
}

const FIXTURE_TOOLS: &[&str] = &["echo", "add"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_expands_variables_in_every_field() {
    let ws = Workspace::new();
    let http =
        mcp_fixture::HttpFixture::start(&["--require-header", "Authorization: Bearer k9x8c7v6"])
            .await;
    let base = http.url().trim_end_matches("/mcp").to_owned();
    let ref_dir = everything_bin().parent().unwrap().display().to_string();
    std::fs::create_dir_all(ws.work().join("data")).unwrap();
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {
            "fixture": {
                "command": "${FIXTURE_BIN}",
                "args": ["--mode", "${MODE:-normal}", "--record-dir", "${RECORDS}"],
                "env": {"FIXTURE_TOKEN": "${TOKEN}"},
                "cwd": "${DATA_DIR:-data}"
            },
            "everything": {"command": "${REF_BIN_DIR}/mcp-server-everything", "args": ["stdio"]},
            "remote": {"type": "http", "url": "${BASE}/mcp", "headers": {"Authorization": "Bearer ${API_KEY}"}}
        }})
        .to_string(),
    );
    let (push, _) = inspect(
        &ws,
        &[
            ("FIXTURE_BIN", &fixture_bin()),
            ("RECORDS", "rec"),
            ("TOKEN", "t0k3n-from-env-11"),
            ("REF_BIN_DIR", &ref_dir),
            ("BASE", &base),
            ("API_KEY", "k9x8c7v6"),
        ],
    );
    assert_eq!(servers(&push), ["everything", "fixture", "remote"]);
    assert_ok(server(&push, "fixture"), FIXTURE_TOOLS);
    assert_ok(server(&push, "remote"), FIXTURE_TOOLS);
    let everything = server(&push, "everything");
    assert_eq!(everything["status"], "RESOURCE_STATUS_OK", "{everything:#}");
    assert!(
        tools(everything).contains(&"echo".to_owned()),
        "{everything:#}"
    );
    // `cwd` defaulted by ${DATA_DIR:-data}, relative to the workspace: the
    // relative --record-dir landed there.
    assert_eq!(
        mcp_fixture::read_starts(&ws.work().join("data/rec")).len(),
        1
    );
    assert_eq!(
        config(&push, &ws.mcp_json())["status"],
        "RESOURCE_STATUS_OK"
    );
    http.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_variable_without_default_fails_its_server_alone() {
    let ws = Workspace::new();
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {
            "needs_key": {"command": fixture_bin(), "env": {"API_KEY": "${UNSET_API_KEY}"}},
            "fine": {"command": fixture_bin()}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "fine"), FIXTURE_TOOLS);
    let failed = server(&push, "needs_key");
    let error = "server \"needs_key\": \"env\" \"API_KEY\" uses the variable \"UNSET_API_KEY\", which is not set and has no default (write ${UNSET_API_KEY:-default} to give one)";
    assert_eq!(failed["status"], "RESOURCE_STATUS_INVALID");
    assert_eq!(failed["error"], error);
    let file = config(&push, &ws.mcp_json());
    assert_eq!(file["status"], "RESOURCE_STATUS_INVALID");
    assert_eq!(file["error"], error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vs_code_servers_inputs_and_workspace_folder() {
    let ws = Workspace::new();
    link_fixture(&ws.work().join("bin/mcp-fixture"));
    let http =
        mcp_fixture::HttpFixture::start(&["--require-header", "X-Api-Key: in9ut-v4lue"]).await;
    let path = ws.work().join(".vscode/mcp.json");
    write(
        &path,
        &format!(
            r#"{{
  // .vscode/mcp.json as VS Code writes it
  "inputs": [
    {{"type": "promptString", "id": "api-key", "description": "The API key", "password": true}}
  ],
  "servers": {{
    "local": {{"type": "stdio", "command": "${{workspaceFolder}}/bin/mcp-fixture", "args": ["--mode", "normal"]}},
    "remote": {{"type": "http", "url": "{}", "headers": {{"X-Api-Key": "${{input:api-key}}"}}}},
  }},
}}"#,
            http.url()
        ),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_eq!(servers(&push), ["local", "remote"]);
    assert_ok(server(&push, "local"), FIXTURE_TOOLS);
    let remote = server(&push, "remote");
    assert_eq!(remote["status"], "RESOURCE_STATUS_INVALID");
    assert_eq!(
        remote["error"],
        "server \"remote\": \"headers\" \"X-Api-Key\" needs the input \"api-key\", which a headless agent cannot prompt for: set CTXSYNC_MCP_INPUT_API_KEY"
    );
    let (push, _) = inspect(&ws, &[("CTXSYNC_MCP_INPUT_API_KEY", "in9ut-v4lue")]);
    assert_ok(server(&push, "remote"), FIXTURE_TOOLS);
    http.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursor_jsonc_with_comments_and_trailing_commas() {
    let ws = Workspace::new();
    let path = ws.work().join(".cursor/mcp.json");
    write(
        &path,
        &format!(
            "{{\n  // Cursor's file, with comments\n  \"mcpServers\": {{\n    /* the fixture */\n    \"fixture\": {{\"command\": \"{}\", \"args\": [\"--mode\", \"normal\",],}},\n  }},\n}}\n",
            fixture_bin()
        ),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "fixture"), FIXTURE_TOOLS);
    assert_eq!(config(&push, &path)["status"], "RESOURCE_STATUS_OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jsonc_syntax_error_names_the_file_line_and_what_was_expected() {
    let ws = Workspace::new();
    write(
        &ws.mcp_json(),
        "{\n  // a comment\n  \"mcpServers\": {\n    \"a\": {\"command\": \"x\"}\n    \"b\": {\"command\": \"y\"}\n  }\n}\n",
    );
    let (push, _) = inspect(&ws, &[]);
    let file = config(&push, &ws.mcp_json());
    assert_eq!(file["status"], "RESOURCE_STATUS_INVALID");
    assert_eq!(
        file["error"],
        format!(
            "{}: invalid JSON at line 5, column 5: expected a , before the next entry or a }} to close the object",
            ws.mcp_json().display()
        )
    );
    assert!(servers(&push).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_utf8_bom_is_read() {
    let ws = Workspace::new();
    write(
        &ws.mcp_json(),
        &format!(
            "\u{feff}{}",
            json!({"mcpServers": {"fixture": {"command": fixture_bin()}}})
        ),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "fixture"), FIXTURE_TOOLS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roo_disabled_servers_are_not_started_and_reported_disabled() {
    let ws = Workspace::new();
    let records = ws.dir.path().join("records");
    let path = ws.work().join(".roo/mcp.json");
    let record = records.display().to_string();
    let off = json!({"command": fixture_bin(), "args": ["--record-dir", record], "disabled": true, "alwaysAllow": []});
    write(
        &path,
        &json!({"mcpServers": {
            "off1": off, "off2": off,
            "off_http": {"type": "streamable-http", "url": "http://127.0.0.1:9/mcp", "disabled": true},
            "on": {"command": fixture_bin(), "disabled": false}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_eq!(servers(&push), ["off1", "off2", "off_http", "on"]);
    assert_ok(server(&push, "on"), FIXTURE_TOOLS);
    for (name, transport) in [
        ("off1", "MCP_TRANSPORT_STDIO"),
        ("off2", "MCP_TRANSPORT_STDIO"),
        ("off_http", "MCP_TRANSPORT_STREAMABLE_HTTP"),
    ] {
        let row = server(&push, name);
        assert_eq!(row["status"], "RESOURCE_STATUS_DISABLED", "{row:#}");
        assert_eq!(row["error"], "");
        assert_eq!(row["mcp_server"]["transport"], transport);
    }
    assert!(
        mcp_fixture::read_starts(&records).is_empty(),
        "a disabled server was started"
    );
    assert_eq!(config(&push, &path)["status"], "RESOURCE_STATUS_OK");
}

/// HTTP servers of either protocol era: one that speaks only 2026-07-28
/// (stateless, `server/discover`), one written before it (sessions only,
/// no `server/discover`); both are discovered with their tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_servers_of_either_protocol_era_are_discovered() {
    let ws = Workspace::new();
    let stateless = mcp_fixture::HttpFixture::start(&["--protocols", "stateless"]).await;
    let sessions = mcp_fixture::HttpFixture::start(&["--protocols", "sessions"]).await;
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {
            "modern": {"type": "http", "url": stateless.url()},
            "older": {"type": "http", "url": sessions.url()}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "modern"), FIXTURE_TOOLS);
    assert_ok(server(&push, "older"), FIXTURE_TOOLS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_sse_servers_typed_or_found_by_fallback() {
    let ws = Workspace::new();
    let sse = mcp_fixture::HttpFixture::start_sse(&[]).await;
    let gone = format!("http://127.0.0.1:{}/sse", testkit::free_port());
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {
            "typed": {"type": "sse", "url": sse.url()},
            "untyped": {"url": sse.url()},
            "gone": {"type": "sse", "url": gone}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "typed"), FIXTURE_TOOLS);
    assert_eq!(
        server(&push, "typed")["mcp_server"]["transport"],
        "MCP_TRANSPORT_SSE"
    );
    assert_ok(server(&push, "untyped"), FIXTURE_TOOLS);
    let gone_row = server(&push, "gone");
    assert_eq!(gone_row["status"], "RESOURCE_STATUS_INVALID");
    assert_eq!(
        gone_row["error"],
        format!(
            "transport error: GET {gone}: error sending request for url ({gone}): client error (Connect): tcp connect error: Connection refused (os error 111)"
        )
    );
    sse.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_helper_output_is_sent_and_never_shown() {
    let ws = Workspace::new();
    let http = mcp_fixture::HttpFixture::start(&[
        "--require-header",
        "Authorization: Bearer h3lper-t0ken-5",
    ])
    .await;
    write(
        &ws.work().join("auth.sh"),
        "#!/bin/sh\nprintf '{\"Authorization\": \"Bearer h3lper-t0ken-5\"}'\n",
    );
    write(
        &ws.work().join("fail.sh"),
        "#!/bin/sh\necho h3lper-t0ken-5 >&2\nexit 3\n",
    );
    write(
        &ws.work().join("junk.sh"),
        "#!/bin/sh\necho not json h3lper-t0ken-5\n",
    );
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {
            "helped": {"url": http.url(), "headersHelper": "sh auth.sh"},
            "unhelped": {"url": http.url()},
            "failing": {"url": http.url(), "headersHelper": "sh fail.sh"},
            "junk": {"url": http.url(), "headersHelper": "sh junk.sh"},
            "endless": {"url": http.url(), "headersHelper": "yes h3lper-t0ken-5"}
        }})
        .to_string(),
    );
    let (push, stderr) = inspect(&ws, &[]);
    assert_ok(server(&push, "helped"), FIXTURE_TOOLS);
    assert_eq!(
        server(&push, "unhelped")["status"],
        "RESOURCE_STATUS_INVALID"
    );
    assert!(
        server(&push, "unhelped")["error"]
            .as_str()
            .unwrap()
            .contains("401"),
        "{:#}",
        server(&push, "unhelped")
    );
    assert_eq!(
        server(&push, "failing")["error"],
        "headersHelper failed (exit status: 3)"
    );
    assert_eq!(
        server(&push, "junk")["error"],
        "headersHelper did not print a JSON object of header names to strings"
    );
    assert_eq!(
        server(&push, "endless")["error"],
        "headersHelper printed more than 65536 bytes"
    );
    let text = format!("{push} {stderr}");
    assert!(
        !text.contains("h3lper-t0ken-5"),
        "the helper's secret leaked: {text}"
    );
    http.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_command_starts_in_the_workspace_while_the_agent_runs_elsewhere() {
    let ws = Workspace::new();
    link_fixture(&ws.work().join("scripts/mcp-server"));
    link_fixture(&ws.work().join("tools/bin/srv"));
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {
            "relative": {"command": "scripts/mcp-server", "args": ["--mode", "normal", "--record-dir", "rec"]},
            "in_cwd": {"command": "./bin/srv", "cwd": "tools", "args": ["--record-dir", "rec"]}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "relative"), FIXTURE_TOOLS);
    assert_ok(server(&push, "in_cwd"), FIXTURE_TOOLS);
    // Each ran where the rule says: the workspace, and its `cwd` under it.
    assert_eq!(mcp_fixture::read_starts(&ws.work().join("rec")).len(), 1);
    assert_eq!(
        mcp_fixture::read_starts(&ws.work().join("tools/rec")).len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leading_underscore_name_and_a_tilde_command_are_accepted() {
    let ws = Workspace::new();
    link_fixture(&ws.home().join("bin/mcp-fixture"));
    write(
        &ws.mcp_json(),
        &json!({"mcpServers": {"_private": {"command": "~/bin/mcp-fixture"}}}).to_string(),
    );
    let (push, _) = inspect(&ws, &[]);
    assert_ok(server(&push, "_private"), FIXTURE_TOOLS);
}

/// Peak resident memory (VmHWM) of a running process, in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Issue 24, finding 7: 20,000 servers in one `.mcp.json` under the size
/// limit. The agent starts at most its cap (the default, 200), with at most
/// 8 connects at once, reports how many it skipped and why, and stays under
/// 100 MiB of peak RSS and 30 s (measured here: see the README).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_servers_are_capped_bounded_and_reported() {
    const SERVERS: usize = 20_000;
    const RSS_BOUND_KIB: u64 = 100 * 1024;
    const TIME_BOUND: std::time::Duration = std::time::Duration::from_secs(30);
    let ws = Workspace::new();
    // Commands that fail fast: what is measured is the agent, not servers.
    let entries: Vec<String> = (0..SERVERS)
        .map(|i| format!(r#""s{i:05}":{{"command":"/nonexistent/srv"}}"#))
        .collect();
    let text = format!(r#"{{"mcpServers":{{{}}}}}"#, entries.join(","));
    assert!(text.len() < 1024 * 1024, "{} bytes", text.len());
    write(&ws.mcp_json(), &text);

    let elsewhere = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new(BIN)
        .current_dir(elsewhere.path())
        .env_remove("CTXSYNC_MCP_MAX_SERVERS")
        .env_remove("CTXSYNC_MCP_CONCURRENCY")
        .env("HOME", ws.home())
        .env("CTXSYNC_WORKDIR", ws.work())
        .args(["inspect", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut { stdout }, &mut out).unwrap();
        out
    });
    let mut peak = 0;
    let status = loop {
        if let Some(kib) = peak_rss_kib(pid) {
            peak = peak.max(kib);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < TIME_BOUND,
            "no report within {TIME_BOUND:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let took = started.elapsed();
    assert!(status.success());
    let push: Value = serde_json::from_slice(&reader.join().unwrap()).unwrap();
    eprintln!("{SERVERS} servers: report in {took:?}, peak RSS {peak} KiB");
    assert!(peak > 0 && peak < RSS_BOUND_KIB, "peak RSS {peak} KiB");
    assert!(took < TIME_BOUND, "{took:?}");
    assert_eq!(push["mcp_discovery"]["phase"], "PHASE_COMPLETE");
    let file = config(&push, &ws.mcp_json());
    assert_eq!(
        file["warning"],
        "19800 servers of this file not started: the workspace's limit of 200 started servers was reached (CTXSYNC_MCP_MAX_SERVERS (--mcp-max-servers))"
    );
    let started_rows = servers(&push);
    assert_eq!(started_rows.len(), 200);
    assert_eq!(started_rows.first().map(String::as_str), Some("s00000"));
    assert_eq!(started_rows.last().map(String::as_str), Some("s00199"));
    assert_eq!(
        server(&push, "s00000")["error"],
        "cannot start `/nonexistent/srv`: no such file: /nonexistent/srv"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_desktop_file_configured_by_path_runs_its_servers_in_the_workdir() {
    let ws = Workspace::new();
    link_fixture(&ws.work().join("scripts/mcp-server"));
    // Outside the workspace, as Claude Desktop's file is: it belongs to no
    // workspace folder, so its servers run in the agent's CTXSYNC_WORKDIR.
    let path = ws.dir.path().join("Claude/claude_desktop_config.json");
    write(
        &path,
        &json!({"mcpServers": {
            "desktop": {"command": "scripts/mcp-server", "args": ["--record-dir", "rec"]}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[("CTXSYNC_MCP_CONFIG_FILES", path.to_str().unwrap())]);
    assert_ok(server(&push, "desktop"), FIXTURE_TOOLS);
    assert_eq!(config(&push, &path)["status"], "RESOURCE_STATUS_OK");
    assert_eq!(mcp_fixture::read_starts(&ws.work().join("rec")).len(), 1);
}
