//! What `/mcp` relays between an MCP client and the upstream servers behind
//! it, each kind checked with a real upstream and the official TypeScript
//! SDK client: progress, cancellation, logging, completions, resource
//! templates, subscriptions, elicitation and sampling. The client runs the
//! same scenario against server-everything directly and through the
//! catalog (the `bare` naming strategy, so the names are the server's own),
//! and sees the same things.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use catalog::config::{Naming, ServerConfig};
use common::*;
use serde_json::Value;

const DEADLINE: Duration = Duration::from_secs(30);

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/mcp-clients")
}

/// Runs the relay client against `url` (with `key` as a bearer token) and
/// parses what it saw.
async fn relay_client(url: &str, key: Option<&str>, extra: &[&str]) -> Value {
    client_script("relay_client.cjs", url, key, extra).await
}

async fn client_script(script: &str, url: &str, key: Option<&str>, extra: &[&str]) -> Value {
    let mut command = tokio::process::Command::new("node");
    command
        .arg(clients_dir().join(script))
        .args(["--url", url])
        .args(extra)
        .kill_on_drop(true);
    if let Some(key) = key {
        command.args(["--key", key]);
    }
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("the client finishes within 120 s")
        .expect("node runs");
    assert!(
        output.status.success(),
        "{script} failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} prints JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// server-everything on streamable HTTP, for the direct run.
struct DirectEverything {
    child: tokio::process::Child,
    url: String,
}

impl DirectEverything {
    async fn start() -> Self {
        let port = testkit::free_port();
        let index = mcp_fixture::reference::servers_dir()
            .join("node_modules/@modelcontextprotocol/server-everything/dist/index.js");
        let child = tokio::process::Command::new("node")
            .arg(index)
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("server-everything starts");
        let address = format!("127.0.0.1:{port}");
        let listening =
            eventually(DEADLINE, || std::net::TcpStream::connect(&address).is_ok()).await;
        assert!(listening, "server-everything listens on {address}");
        Self {
            child,
            url: format!("http://{address}/mcp"),
        }
    }
}

impl Drop for DirectEverything {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// A catalog whose tenant `acme` names its servers' items bare, with a key.
async fn catalog_with(servers: Vec<ServerConfig>) -> (Harness, String, String) {
    let mut config = tenants(vec![("acme", servers)]);
    config.tenants[0].naming = Naming::Bare;
    let harness = Harness::start_with_store(config, settings()).await;
    let key = harness.tenant_key("acme").await;
    let url = format!("http://{}/mcp", harness.running().http_addr());
    (harness, url, key)
}

/// The relayed count of `kind`.
async fn relayed(harness: &Harness, kind: &str) -> f64 {
    metric(
        harness.running(),
        &format!("ctxsync_catalog_mcp_relayed_total{{kind=\"{kind}\"}}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_sees_through_the_catalog_what_it_sees_directly() {
    let direct = DirectEverything::start().await;
    let seen_directly = relay_client(&direct.url, None, &[]).await;

    let everything = server("everything", &mcp_fixture::reference::everything());
    let (harness, url, key) = catalog_with(vec![everything]).await;
    let seen_through = relay_client(&url, Some(&key), &[]).await;
    println!("RELAYED direct:  {seen_directly}");
    println!("RELAYED catalog: {seen_through}");

    // Every tool that needs a relay is offered (the catalog declares
    // sampling and elicitation to the upstream, as the client does).
    assert_eq!(
        seen_through["tools_offered"],
        seen_directly["tools_offered"]
    );
    // The same progress steps, in the server's numbers.
    assert_eq!(seen_through["progress"], seen_directly["progress"]);
    assert_eq!(seen_through["progress"].as_array().unwrap().len(), 4);
    assert_eq!(seen_through["long_result"], seen_directly["long_result"]);
    // The same completion values, context included.
    assert_eq!(
        seen_through["prompt_completion"],
        seen_directly["prompt_completion"]
    );
    assert_eq!(
        seen_through["prompt_completion"],
        serde_json::json!(["Sales", "Support"])
    );
    assert_eq!(
        seen_through["context_completion"],
        seen_directly["context_completion"]
    );
    assert_eq!(
        seen_through["template_completion_count"],
        seen_directly["template_completion_count"]
    );
    // The server's own URI templates, and a URI one expands read from it.
    assert_eq!(seen_through["templates"], seen_directly["templates"]);
    assert_eq!(
        seen_through["templated_read"],
        seen_directly["templated_read"]
    );
    // The elicitation question reaches the client; its answer the server.
    assert_eq!(seen_through["elicitation"], seen_directly["elicitation"]);
    assert_eq!(seen_through["elicitation_result_has_answer"], true);
    // The sampling request reaches the client; its reply the server.
    assert_eq!(seen_through["sampling"], seen_directly["sampling"]);
    assert_eq!(seen_through["sampling_result_has_reply"], true);
    // Log messages at the client's level, the server named in `logger`.
    assert_eq!(seen_directly["logged"], true);
    assert_eq!(seen_through["logged"], true);
    assert_eq!(seen_through["log_logger"], "everything");
    // Updates of the subscribed resource, and of no other.
    assert_eq!(seen_directly["updated"], true);
    assert_eq!(seen_through["updated"], true);
    assert_eq!(seen_through["updates_only_subscribed"], true);

    for kind in [
        "progress",
        "completion",
        "elicitation",
        "sampling",
        "logging",
        "resource_updated",
    ] {
        assert!(relayed(&harness, kind).await >= 1.0, "{kind} is counted");
    }
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_call_reaches_the_upstream_and_frees_its_process() {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    std::fs::write(&tools_file, r#"[{"name":"sleep","description":"Sleeps"}]"#).unwrap();
    let tools = tools_file.display().to_string();
    let slow = fixture(
        "slow",
        record.path(),
        &["--mode", "changing-tools", "--tools-file", &tools],
    );
    let (harness, url, key) = catalog_with(vec![slow]).await;

    let out = relay_client(
        &url,
        Some(&key),
        &[
            "--cancel-tool",
            "sleep",
            "--cancel-arguments",
            r#"{"ms":20000}"#,
        ],
    )
    .await;
    assert_eq!(out["cancelled"], true, "{out}");
    assert!(
        out["ended_after_ms"].as_u64().unwrap() < 5_000,
        "the call ends at the cancellation, not the sleep's end: {out}"
    );
    // The upstream was told, and its call ended there.
    let told = eventually(DEADLINE, || {
        mcp_fixture::read_cancellations(record.path()).len() == 1
    })
    .await;
    assert!(told, "the fixture records the cancellation");
    assert_eq!(relayed(&harness, "cancellation").await, 1.0);
    // The session ended with the client: its process is given back.
    let stopped = eventually(DEADLINE, || {
        mcp_fixture::live_pids(record.path()).is_empty()
    })
    .await;
    assert!(stopped, "no fixture process outlives the session");
    assert_eq!(harness.running().open_transports(), 0);
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stateless_client_is_asked_in_input_rounds_and_its_answers_reach_the_server() {
    let everything = server("everything", &mcp_fixture::reference::everything());
    let (harness, url, key) = catalog_with(vec![everything]).await;
    let out = client_script("stateless_rounds.mjs", &url, Some(&key), &[]).await;
    println!("ROUNDS {out}");
    assert_eq!(out["protocol"], "2026-07-28", "{out}");
    // server-everything (a 2025 server) asks during the call; the stateless
    // client is asked in an input round, and its answer reaches the server.
    assert_eq!(
        out["elicitation"], "Please provide inputs for the following fields:",
        "{out}"
    );
    assert_eq!(out["elicitation_result_has_answer"], true, "{out}");
    assert_eq!(
        out["sampling"],
        serde_json::json!(["Resource trigger-sampling-request context: say hello"]),
        "{out}"
    );
    assert_eq!(out["sampling_result_has_reply"], true, "{out}");
    assert!(relayed(&harness, "input_round").await >= 2.0);
    // The last step is sent just before the result, and arrives before it.
    assert_eq!(
        out["progress"],
        serde_json::json!([[1, 3], [2, 3], [3, 3]]),
        "{out}"
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_without_the_capability_leaves_the_server_answered_method_not_found() {
    let everything = server("everything", &mcp_fixture::reference::everything());
    let (harness, _url, key) = catalog_with(vec![everything]).await;
    // ctxsync's own client with no relays declares neither capability.
    let options = ctxsync_mcp::ConnectOptions {
        sessions_only: true,
        ..ctxsync_mcp::ConnectOptions::new(DEADLINE)
    };
    let client = ctxsync_mcp::Connection::connect(&harness.mcp_spec(&key), options)
        .await
        .unwrap();
    for tool in ["trigger-elicitation-request", "trigger-sampling-request"] {
        let arguments = serde_json::json!({"prompt": "hi", "maxTokens": 5});
        let answered = client
            .call_tool(tool, arguments.as_object().unwrap().clone(), DEADLINE)
            .await;
        let text = match answered {
            Ok(outcome) => outcome.content_json,
            Err(error) => error.to_string(),
        };
        assert!(
            text.contains("-32601") || text.to_lowercase().contains("method not found"),
            "{tool}: the server was answered -32601: {text}"
        );
    }
    client.close().await;
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clients_progress_on_a_servers_question_goes_back_to_the_server() {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    std::fs::write(
        &tools_file,
        r#"[{"name":"ask","description":"Asks the client"}]"#,
    )
    .unwrap();
    let tools = tools_file.display().to_string();
    let asking = fixture(
        "asking",
        record.path(),
        &["--mode", "changing-tools", "--tools-file", &tools],
    );
    let (harness, url, key) = catalog_with(vec![asking]).await;
    let out = relay_client(&url, Some(&key), &["--ask-tool", "ask"]).await;
    // The question reached the client, its reply the server...
    assert_eq!(
        out["sampling"]["messages"],
        serde_json::json!(["say hi"]),
        "{out}"
    );
    assert_eq!(out["ask_result"], "a sampled reply", "{out}");
    // ...and its progress on the question went back with the server's token.
    let back = eventually(DEADLINE, || {
        mcp_fixture::read_progress(record.path()).len() == 2
    })
    .await;
    let mut received = mcp_fixture::read_progress(record.path());
    received.sort_by(f64::total_cmp);
    assert!(
        back,
        "the fixture received the client's progress: {received:?}"
    );
    assert_eq!(received, [1.0, 2.0]);
    harness.stop().await;
}
