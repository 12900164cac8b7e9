//! A measurement of the MCP endpoint with 8 real servers, in one run: an MCP
//! client's connect to its full tool list, first after the catalog started
//! (live discovery) and warm (from memory); and the server processes of 10
//! sessions calling every server, per-session against shared. Prints the
//! figures; it runs in CI's measurement step, not with the tests:
//! `cargo test -p catalog --test mcp_measure -- --ignored --nocapture`

mod common;

use std::time::{Duration, Instant};

use catalog::config::{Processes, ServerConfig};
use common::*;
use ctxsync_mcp::{ConnectOptions, Connection, ServerSpec};
use serde_json::{Value, json};
use testkit::store::StoreClient;

const SESSIONS: usize = 10;

fn servers(root: &std::path::Path, processes: Processes) -> Vec<ServerConfig> {
    let mut servers = vec![
        server("everything-1", &mcp_fixture::reference::everything()),
        server("everything-2", &mcp_fixture::reference::everything()),
        server("files-1", &mcp_fixture::reference::filesystem(root)),
        server("files-2", &mcp_fixture::reference::filesystem(root)),
        server(
            "memory-1",
            &mcp_fixture::reference::memory(&root.join("m1.json")),
        ),
        server(
            "memory-2",
            &mcp_fixture::reference::memory(&root.join("m2.json")),
        ),
        server("time-1", &mcp_fixture::reference::time()),
        server("time-2", &mcp_fixture::reference::time()),
    ];
    for server in &mut servers {
        server.processes = processes;
    }
    servers
}

/// One tool of each server and its arguments.
fn call_of(server: &str) -> (String, Value) {
    let kind = server.split('-').next().unwrap();
    let (tool, arguments) = match kind {
        "everything" => ("echo", json!({"message": "x"})),
        "files" => ("list_allowed_directories", json!({})),
        "memory" => ("read_graph", json!({})),
        _ => ("get_current_time", json!({"timezone": "UTC"})),
    };
    (format!("{server}__{tool}"), arguments)
}

struct Measured {
    harness: Harness,
    spec: ServerSpec,
    processes: Processes,
}

impl Measured {
    async fn start(processes: Processes, root: &std::path::Path) -> Self {
        let mut settings = settings();
        settings.connect_timeout = Duration::from_secs(30);
        settings.max_concurrent_starts = 2;
        // It measures the processes 10 sessions start: no process or rate bound.
        settings.max_server_processes = None;
        settings.max_server_processes_per_tenant = None;
        settings.mcp_rate_limit = None;
        let harness =
            Harness::start_with_store(tenants(vec![("acme", servers(root, processes))]), settings)
                .await;
        let store = StoreClient::new(
            harness.client.clone(),
            harness.subjects.clone(),
            REQUEST_TIMEOUT,
            "workspace",
        )
        .retrying_no_responders();
        let key = store.create_tenant_key("acme").await.0;
        let spec = harness.mcp_spec(&key);
        Self {
            harness,
            spec,
            processes,
        }
    }

    /// Connect, initialize, every page of tools/list: the time and the client.
    async fn connect_and_list(&self) -> (Duration, usize, Connection) {
        let started = Instant::now();
        // Sessions: what is measured is a session's own processes.
        let options = ConnectOptions {
            sessions_only: true,
            ..ConnectOptions::new(Duration::from_secs(120))
        };
        let client = Connection::connect(&self.spec, options).await.unwrap();
        let tools = client.list_tools().await.unwrap().len();
        (started.elapsed(), tools, client)
    }

    /// The same in 2026-07-28: `server/discover` then every page of a
    /// stateless tools/list (no session; the pins by the memory's handle).
    async fn discover_and_list(&self) -> (Duration, usize, Connection) {
        let started = Instant::now();
        let options = ConnectOptions::new(Duration::from_secs(120));
        let client = Connection::connect(&self.spec, options).await.unwrap();
        let tools = client.list_tools().await.unwrap().len();
        (started.elapsed(), tools, client)
    }

    /// 10 sessions at once, each calling one tool of every server; returns
    /// the server processes running once all have called (every server is
    /// stdio: a session's transport is a process, and so is a shared one).
    async fn ten_sessions_call_everything(&self) -> usize {
        let mut clients = Vec::new();
        for _ in 0..SESSIONS {
            clients.push(self.connect_and_list().await.2);
        }
        let calls = clients.iter().map(|client| async move {
            for n in 1..=2 {
                for kind in ["everything", "files", "memory", "time"] {
                    let (tool, arguments) = call_of(&format!("{kind}-{n}"));
                    let outcome = client
                        .call_tool(
                            &tool,
                            arguments.as_object().unwrap().clone(),
                            Duration::from_secs(120),
                        )
                        .await
                        .unwrap();
                    let structured: Value = outcome
                        .structured_content_json
                        .as_deref()
                        .map(|s| serde_json::from_str(s).unwrap())
                        .unwrap_or(Value::Null);
                    assert!(
                        structured["error"]["code"].is_null(),
                        "{tool}: {structured}"
                    );
                }
            }
        });
        futures::future::join_all(calls).await;
        let running = self.harness.running();
        let processes = match self.processes {
            Processes::PerSession => running.open_transports(),
            Processes::Shared => running.shared_processes(),
        };
        for client in clients {
            client.close().await;
        }
        processes
    }
}

/// Calls made of `echo` per side when comparing a warm call through the
/// catalog with the same call made directly.
const ECHO_CALLS: usize = 200;

/// `ECHO_CALLS` warm calls of `tool` on `client`, one after another (one
/// call first, untimed, so the server is open): their durations.
async fn warm_calls(client: &Connection, tool: &str) -> Vec<Duration> {
    let arguments = json!({"message": "x"}).as_object().unwrap().clone();
    let timeout = Duration::from_secs(30);
    client
        .call_tool(tool, arguments.clone(), timeout)
        .await
        .unwrap();
    let mut durations = Vec::with_capacity(ECHO_CALLS);
    for _ in 0..ECHO_CALLS {
        let started = Instant::now();
        let outcome = client
            .call_tool(tool, arguments.clone(), timeout)
            .await
            .unwrap();
        durations.push(started.elapsed());
        assert!(!outcome.is_error, "{tool}: {outcome:?}");
    }
    durations
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run with `cargo test -p catalog --test mcp_measure -- --ignored`"]
async fn mcp_clients_get_their_tool_list_warm_in_milliseconds_and_shared_servers_run_once() {
    let root = tempfile::tempdir().unwrap();

    let per_session = Measured::start(Processes::PerSession, root.path()).await;
    let (first, tools, client) = per_session.connect_and_list().await;
    client.close().await;
    let mut warm = Vec::new();
    for _ in 0..10 {
        let (elapsed, warm_tools, client) = per_session.connect_and_list().await;
        assert_eq!(warm_tools, tools);
        warm.push(elapsed);
        client.close().await;
    }
    // The stateless revision, warm: a new client's discover + full list,
    // and a full list again on one client.
    let mut stateless_new = Vec::new();
    for _ in 0..10 {
        let (elapsed, stateless_tools, client) = per_session.discover_and_list().await;
        assert_eq!(stateless_tools, tools);
        stateless_new.push(elapsed);
        client.close().await;
    }
    let (_, _, client) = per_session.discover_and_list().await;
    let mut stateless_again = Vec::new();
    for _ in 0..10 {
        let started = Instant::now();
        assert_eq!(client.list_tools().await.unwrap().len(), tools);
        stateless_again.push(started.elapsed());
    }
    client.close().await;
    // A warm tools/call through the catalog against the same call made
    // directly, on a warm stdio connection to the same upstream.
    let (_, _, client) = per_session.connect_and_list().await;
    let through_catalog = warm_calls(&client, "everything-1__echo").await;
    client.close().await;
    let direct_client = Connection::connect(
        &mcp_fixture::reference::everything(),
        ConnectOptions::new(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    let direct = warm_calls(&direct_client, "echo").await;
    direct_client.close().await;
    let per_session_processes = per_session.ten_sessions_call_everything().await;
    per_session.harness.stop().await;

    let shared = Measured::start(Processes::Shared, root.path()).await;
    // Warm its memory first, as the figure is about the calls.
    shared.connect_and_list().await.2.close().await;
    let shared_processes = shared.ten_sessions_call_everything().await;
    shared.harness.stop().await;

    println!(
        "MCP endpoint with 8 real servers (server-everything, server-filesystem, server-memory, mcp-server-time, 2 each), \
         {tools} tools, Rust rmcp client over streamable HTTP:\n  \
         2025-11-25 session: connect (initialize) -> full tool list, first after the catalog started (live discovery): {:>8.1} ms\n  \
         connect -> full tool list, warm (from memory): {:>8.1} ms median, {:.1} ms max over {} clients\n  \
         2026-07-28 stateless, warm: server/discover -> full tool list {:.1} ms median; \
         full tool list again on one client {:.2} ms median (10 each)\n  \
         server processes for {SESSIONS} sessions calling every server: per-session {per_session_processes}, shared {shared_processes}\n  \
         warm tools/call of server-everything's echo, {ECHO_CALLS} in a row: through /mcp {:.2} ms median, \
         direct (stdio, warm connection) {:.2} ms median: {:.2}x (target <= 1.5x)",
        ms(first),
        ms(median(warm.clone())),
        ms(*warm.iter().max().unwrap()),
        warm.len(),
        ms(median(stateless_new)),
        ms(median(stateless_again)),
        ms(median(through_catalog.clone())),
        ms(median(direct.clone())),
        median(through_catalog).as_secs_f64() / median(direct).as_secs_f64(),
    );
    assert_eq!(per_session_processes, SESSIONS * 8);
    assert_eq!(shared_processes, 8);
    assert!(median(warm) * 5 < first, "warm is well below first");
}
