//! The catalog as an MCP server (`/mcp`): the official Python and TypeScript
//! SDKs, tenant keys, lazy starts, withdrawal, list_changed, prompts and
//! resources, session end and the process bound, against the real catalog, NATS, Postgres, the fixture
//! and server-everything.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use catalog::config::{Processes, ServerConfig};
use common::*;
use ctxsync_mcp::{ConnectOptions, Connection, ServerSpec, TransportSpec};
use ctxsync_proto::v1::catalog_pin::Source;
use serde_json::{Value, json};
use testkit::store::StoreClient;

const DEADLINE: Duration = Duration::from_secs(30);

const TOOLS_BEFORE: &str =
    r#"[{"name":"echo","description":"Echo"},{"name":"add","description":"Add"}]"#;
const TOOLS_AFTER: &str = r#"[{"name":"add","description":"Add"}]"#;

struct Endpoint {
    harness: Harness,
    /// The configuration it runs, for a replica.
    config: catalog::CatalogConfig,
    url: String,
    key: String,
    record: tempfile::TempDir,
    tools_file: PathBuf,
}

impl Endpoint {
    /// Tenant `acme` with the fixture `notes` (tools from a file it watches)
    /// and `extra` servers, a store for the keys, and a key of `acme`.
    async fn start(extra: Vec<ServerConfig>, settings: catalog::Settings) -> Self {
        Self::start_configured(extra, settings, |_| {}).await
    }

    /// [`Endpoint::start`] with `notes` configured further by `configure`.
    async fn start_configured(
        extra: Vec<ServerConfig>,
        settings: catalog::Settings,
        configure: impl FnOnce(&mut ServerConfig),
    ) -> Self {
        Self::start_with_beta(extra, vec![], settings, configure).await
    }

    /// [`Endpoint::start_configured`] with `beta`'s servers.
    async fn start_with_beta(
        extra: Vec<ServerConfig>,
        beta: Vec<ServerConfig>,
        settings: catalog::Settings,
        configure: impl FnOnce(&mut ServerConfig),
    ) -> Self {
        let record = tempfile::tempdir().unwrap();
        let tools_file = record.path().join("tools.json");
        std::fs::write(&tools_file, TOOLS_BEFORE).unwrap();
        let tools = tools_file.display().to_string();
        let mut notes = fixture(
            "notes",
            record.path(),
            &[
                "--mode",
                "changing-tools",
                "--tools-file",
                &tools,
                "--watch",
            ],
        );
        configure(&mut notes);
        let mut servers = vec![notes];
        servers.extend(extra);
        let config = tenants(vec![("acme", servers), ("beta", beta)]);
        let harness = Harness::start_with_store(config.clone(), settings).await;
        let key = store(&harness).create_tenant_key("acme").await.0;
        let url = format!("http://{}/mcp", harness.running().http_addr());
        Self {
            harness,
            config,
            url,
            key,
            record,
            tools_file,
        }
    }

    fn starts(&self) -> usize {
        mcp_fixture::read_starts(self.record.path()).len()
    }

    async fn no_fixture_running(&self) -> bool {
        eventually(DEADLINE, || {
            mcp_fixture::live_pids(self.record.path()).is_empty()
        })
        .await
    }

    /// What the gate's first turn carries for `acme`: a preparation's pins,
    /// as `server__tool`. Prepares over NATS (live: the memory is warm after).
    async fn gate_names(&self) -> Vec<String> {
        let reply = self.harness.prepare("acme", "gate-session").await;
        assert_eq!(reply.error, None);
        reply
            .pins
            .iter()
            .flat_map(|pin| {
                pin.tools.iter().map(|tool| {
                    format!(
                        "{}{}{}",
                        pin.server_id,
                        catalog::TOOL_NAME_SEPARATOR,
                        tool.name
                    )
                })
            })
            .collect()
    }

    /// A 2025-11-25 client: these tests are of MCP sessions (the
    /// stateless revision's are below, from `stateless_request`).
    async fn client(&self, key: &str) -> Connection {
        let spec = ServerSpec {
            name: "catalog".into(),
            transport: TransportSpec::StreamableHttp {
                url: self.url.clone(),
                headers: BTreeMap::from([("Authorization".into(), format!("Bearer {key}"))]),
            },
        };
        let options = ConnectOptions {
            sessions_only: true,
            ..ConnectOptions::new(DEADLINE)
        };
        Connection::connect(&spec, options)
            .await
            .expect("an MCP client connects to the catalog")
    }
}

fn store(harness: &Harness) -> StoreClient {
    StoreClient::new(
        harness.client.clone(),
        harness.subjects.clone(),
        REQUEST_TIMEOUT,
        "workspace",
    )
    .retrying_no_responders()
}

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/mcp-clients")
}

/// Runs an SDK client script to its end (bounded) and parses its JSON.
async fn run_client(program: PathBuf, script: &str, args: &[&str]) -> Value {
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&program)
            .arg(clients_dir().join(script))
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the client finishes within 120 s")
    .unwrap_or_else(|e| panic!("{} runs: {e}", program.display()));
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

fn python() -> PathBuf {
    mcp_fixture::reference::servers_dir().join("venv/bin/python")
}

fn node() -> PathBuf {
    PathBuf::from("node")
}

fn text_of(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn names(value: &Value) -> Vec<String> {
    let mut names: Vec<String> = value
        .as_array()
        .expect("a list of names")
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// One SDK's whole scenario: connect with the key, list the pins (as the gate
/// names them), a lazy start on the first call, the tools change under the
/// session, list_changed, `tool.withdrawn`, and the session's end stops the server.
async fn sdk_scenario(program: PathBuf, script: &str) {
    let everything = server("everything", &mcp_fixture::reference::everything());
    let endpoint = Endpoint::start(vec![everything], settings()).await;
    let mut gate = endpoint.gate_names().await;
    gate.sort();
    assert!(gate.contains(&"notes__echo".to_owned()), "{gate:?}");
    assert!(
        gate.iter().any(|n| n.starts_with("everything__")),
        "{gate:?}"
    );
    let warm_starts = endpoint.starts();
    assert!(
        endpoint.no_fixture_running().await,
        "the preparation's discovery ended"
    );
    // server-everything's prompts and resources, as the gate's pins carry them.
    let pins = endpoint.harness.prepare("acme", "gate-session").await.pins;
    let everything = pins.iter().find(|p| p.server_id == "everything").unwrap();
    let gate_prompts: Vec<String> = everything
        .prompts
        .iter()
        .map(|p| format!("everything{}{}", catalog::TOOL_NAME_SEPARATOR, p.name))
        .collect();
    // Its resource templates are pinned too, listed apart (`relays.rs`).
    let gate_uris: Vec<String> = everything
        .resources
        .iter()
        .filter(|r| !r.template)
        .map(|r| r.uri.clone())
        .collect();
    let document = gate_uris
        .first()
        .expect("server-everything declares resources");

    let tools_file = endpoint.tools_file.display().to_string();
    let out = run_client(
        program,
        script,
        &[
            "--url",
            &endpoint.url,
            "--key",
            &endpoint.key,
            "--call",
            "notes__echo",
            "--arguments",
            r#"{"text":"hello"}"#,
            "--change-file",
            &tools_file,
            "--change-to",
            TOOLS_AFTER,
            "--call-after",
            "notes__echo",
            "--prompt",
            "everything__simple-prompt",
            "--read",
            document,
        ],
    )
    .await;

    assert_eq!(
        out["protocol"], "2025-11-25",
        "the newest version with sessions"
    );
    assert_eq!(names(&out["tools"]), gate, "{out}");
    assert_eq!(names(&out["prompts"]), sorted(gate_prompts), "{out}");
    assert_eq!(names(&out["resources"]), sorted(gate_uris.clone()), "{out}");
    assert_eq!(
        out["prompt_text"], "This is a simple prompt without arguments.",
        "{out}"
    );
    assert_eq!(out["read_uri"], document.as_str(), "{out}");
    assert_called_then_withdrawn(&out, &endpoint, warm_starts);
    assert!(
        text_of(&out["second_call"]).starts_with("tool.withdrawn: "),
        "{out}"
    );
    // The client closed its session: the catalog session ended, its server stopped.
    assert!(
        endpoint.no_fixture_running().await,
        "the session's server stopped"
    );
    let running = endpoint.harness.running();
    let closed = eventually(DEADLINE, || running.open_transports() == 0).await;
    assert!(closed, "no transport stays open");
    endpoint.harness.stop().await;
}

/// An SDK client's output: its first call of `notes__echo` answered (the
/// server's one start since `warm`), told the list changed, the tool left
/// out after, and its second call `tool.withdrawn`.
fn assert_called_then_withdrawn(out: &Value, endpoint: &Endpoint, warm: usize) {
    assert_eq!(out["first_call"]["is_error"], false, "{out}");
    assert_eq!(text_of(&out["first_call"]), "hello", "{out}");
    assert_eq!(
        endpoint.starts(),
        warm + 1,
        "the call started the server once: the lists were pinned from memory"
    );
    assert_eq!(out["list_changed"], true, "{out}");
    assert!(
        !names(&out["tools_after"]).contains(&"notes__echo".to_owned()),
        "{out}"
    );
    assert_eq!(out["second_call"]["is_error"], true, "{out}");
    assert_eq!(
        out["second_call"]["structured"]["error"]["code"], "tool.withdrawn",
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_lists_the_pins_calls_lazily_and_sees_the_withdrawal() {
    sdk_scenario(python(), "client.py").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_sdk_lists_the_pins_calls_lazily_and_sees_the_withdrawal() {
    sdk_scenario(node(), "client.cjs").await;
}

/// A raw `initialize` POST; returns the status and the session id header.
async fn raw_initialize(url: &str, key: Option<&str>) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new()
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .json(&json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "raw", "version": "1"}}
        }));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.expect("the endpoint answers");
    let status = response.status().as_u16();
    let session = response
        .headers()
        .get("mcp-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, session, response.text().await.unwrap_or_default())
}

async fn raw_post(url: &str, key: &str, session: &str, body: Value) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", session)
        .header("mcp-protocol-version", "2025-06-18")
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("the endpoint answers");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

#[tokio::test]
async fn no_key_or_another_tenants_key_is_refused() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let (status, _, body) = raw_initialize(&endpoint.url, None).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("missing credential"), "{body}");
    let unknown = testkit::store::new_tenant_key();
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&unknown)).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("unknown or revoked tenant key"), "{body}");

    // A session of acme is not reachable with beta's key.
    let beta = store(&endpoint.harness).create_tenant_key("beta").await.0;
    let (status, session, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
    assert_eq!(status, 200, "{body}");
    let session = session.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let (status, body) = raw_post(&endpoint.url, &endpoint.key, &session, initialized).await;
    assert_eq!(status, 202, "{body}");
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    let (status, body) = raw_post(&endpoint.url, &beta, &session, list.clone()).await;
    assert_eq!(status, 404, "{body}");
    assert!(!body.contains("notes__"), "{body}");
    let (status, body) = raw_post(&endpoint.url, &endpoint.key, &session, list).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("notes__echo"), "{body}");
    endpoint.harness.stop().await;
}

#[tokio::test]
async fn a_warm_initialize_and_list_start_no_server() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    endpoint.gate_names().await;
    let warm = endpoint.starts();
    assert_eq!(warm, 1, "the preparation discovered the fixture live");

    let client = endpoint.client(&endpoint.key).await;
    let mut tools: Vec<String> = client
        .list_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    tools.sort();
    assert_eq!(tools, ["notes__add", "notes__echo"]);
    assert_eq!(
        endpoint.starts(),
        warm,
        "initialize and tools/list started nothing"
    );
    client.close().await;
    endpoint.harness.stop().await;
}

/// Three sessions, each calling `notes__echo` twice, all at once; returns the
/// fixture's starts during the calls and its processes running after them.
async fn three_concurrent_sessions(endpoint: &Endpoint) -> (usize, usize, Vec<Connection>) {
    endpoint.gate_names().await;
    assert!(endpoint.no_fixture_running().await);
    let warm = endpoint.starts();
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(endpoint.client(&endpoint.key).await);
    }
    let calls = clients.iter().map(|client| async move {
        for _ in 0..2 {
            let outcome = client
                .call_tool(
                    "notes__echo",
                    json!({"text": "x"}).as_object().unwrap().clone(),
                    DEADLINE,
                )
                .await
                .expect("the call answers");
            assert!(!outcome.is_error, "{}", outcome.content_json);
        }
    });
    futures::future::join_all(calls).await;
    let running = mcp_fixture::live_pids(endpoint.record.path()).len();
    (endpoint.starts() - warm, running, clients)
}

#[tokio::test]
async fn a_per_session_server_runs_once_per_session() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let (starts, running, clients) = three_concurrent_sessions(&endpoint).await;
    assert_eq!((starts, running), (3, 3), "one process per session");
    for client in clients {
        client.close().await;
    }
    assert!(
        endpoint.no_fixture_running().await,
        "every session's server stopped"
    );
    endpoint.harness.stop().await;
}

#[tokio::test]
async fn a_shared_server_runs_once_for_three_concurrent_sessions_and_stops_when_idle() {
    let mut settings = settings();
    settings.shared_idle_timeout = Duration::from_millis(300);
    let endpoint = Endpoint::start_configured(vec![], settings, |notes| {
        notes.processes = Processes::Shared;
    })
    .await;
    let (starts, running, clients) = three_concurrent_sessions(&endpoint).await;
    assert_eq!(
        (starts, running),
        (1, 1),
        "one process for the three sessions"
    );
    assert_eq!(endpoint.harness.running().shared_processes(), 1);

    // One session's end does not stop what the others use.
    let mut clients = clients.into_iter();
    clients.next().unwrap().close().await;
    let rest: Vec<Connection> = clients.collect();
    let outcome = rest[0]
        .call_tool(
            "notes__echo",
            json!({"text": "y"}).as_object().unwrap().clone(),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(!outcome.is_error, "{}", outcome.content_json);
    assert_eq!(
        endpoint.starts(),
        2,
        "the warm discovery and the one shared process"
    );
    for client in rest {
        client.close().await;
    }
    assert!(
        endpoint.no_fixture_running().await,
        "the shared process stops once idle with no session"
    );
    let running = endpoint.harness.running();
    let stopped = eventually(DEADLINE, || running.shared_processes() == 0).await;
    assert!(stopped, "the pool is empty");
    endpoint.harness.stop().await;
}

#[tokio::test]
async fn the_process_bound_refuses_a_start_past_it_with_a_tool_error() {
    let mut settings = settings();
    settings.max_server_processes = Some(1);
    let endpoint = Endpoint::start(vec![], settings).await;
    let echo = || json!({"text": "x"}).as_object().unwrap().clone();
    let first = endpoint.client(&endpoint.key).await;
    let second = endpoint.client(&endpoint.key).await;
    let ok = first
        .call_tool("notes__echo", echo(), DEADLINE)
        .await
        .unwrap();
    assert!(!ok.is_error, "{}", ok.content_json);

    let refused = second
        .call_tool("notes__echo", echo(), DEADLINE)
        .await
        .unwrap();
    assert!(refused.is_error);
    let structured: Value =
        serde_json::from_str(refused.structured_content_json.as_deref().unwrap()).unwrap();
    assert_eq!(
        structured["error"]["code"], "server.process_limit",
        "{structured}"
    );
    assert_eq!(mcp_fixture::live_pids(endpoint.record.path()).len(), 1);

    assert_eq!(endpoint.harness.running().bounded_processes(), 1);

    // The first session's end frees its place.
    first.close().await;
    let running = endpoint.harness.running();
    let freed = eventually(DEADLINE, || running.bounded_processes() == 0).await;
    assert!(freed, "the stopped process gave its place back");
    let ok = second
        .call_tool("notes__echo", echo(), DEADLINE)
        .await
        .unwrap();
    assert!(!ok.is_error, "{}", ok.content_json);
    second.close().await;
    endpoint.harness.stop().await;
}

#[tokio::test]
async fn a_key_over_its_rate_limit_is_answered_429_and_counted() {
    let mut settings = settings();
    settings.mcp_rate_limit = Some(catalog::RateLimit {
        per_second: 0.01,
        burst: 2,
    });
    let endpoint = Endpoint::start(vec![], settings).await;
    for _ in 0..2 {
        let (status, _, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("rate_limited"), "{body}");
    // Retry-After says when the key's next request fits: one every 100 s.
    let refused = reqwest::Client::new()
        .post(&endpoint.url)
        .bearer_auth(&endpoint.key)
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (90..=100).contains(&retry_after),
        "Retry-After: {retry_after}"
    );
    // Another key has its own bucket.
    let other = store(&endpoint.harness).create_tenant_key("acme").await.0;
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&other)).await;
    assert_eq!(status, 200, "{body}");

    let metrics = reqwest::get(format!(
        "http://{}/metrics",
        endpoint.harness.running().http_addr()
    ))
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    let refused = metrics
        .lines()
        .find(|l| l.starts_with("ctxsync_catalog_mcp_refused_total{reason=\"rate_limited\"}"))
        .expect("the refusal series is exported");
    let count: f64 = refused.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(count >= 1.0, "{refused}");
    endpoint.harness.stop().await;
}

#[tokio::test]
async fn a_call_past_the_servers_call_timeout_is_a_tool_error() {
    let endpoint = Endpoint::start_configured(vec![], settings(), |notes| {
        notes.limits.call_timeout_seconds = 1;
    })
    .await;
    std::fs::write(
        &endpoint.tools_file,
        r#"[{"name":"sleep","description":"Sleeps"}]"#,
    )
    .unwrap();
    let client = endpoint.client(&endpoint.key).await;
    let sleep = |ms: u64| json!({"ms": ms}).as_object().unwrap().clone();
    let quick = client
        .call_tool("notes__sleep", sleep(0), DEADLINE)
        .await
        .unwrap();
    assert!(!quick.is_error, "{}", quick.content_json);
    let slow = client
        .call_tool("notes__sleep", sleep(10_000), DEADLINE)
        .await
        .unwrap();
    assert!(slow.is_error);
    let structured: Value =
        serde_json::from_str(slow.structured_content_json.as_deref().unwrap()).unwrap();
    assert_eq!(structured["error"]["code"], "tool.timeout", "{structured}");
    client.close().await;
    endpoint.harness.stop().await;
}

#[tokio::test]
async fn a_revoked_key_is_refused_once_its_revocation_arrives() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let store = store(&endpoint.harness);
    let (key, key_id) = store.create_tenant_key("acme").await;
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&key)).await;
    assert_eq!(status, 200, "{body}");
    // Verified now, so cached: only the revocation event can refuse it.
    store.revoke_tenant_key(&key_id).await;
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match raw_initialize(&endpoint.url, Some(&key)).await {
                (401, _, body) => return body,
                (200, _, _) => tokio::time::sleep(Duration::from_millis(10)).await,
                (other, _, body) => panic!("unexpected {other}: {body}"),
            }
        }
    })
    .await
    .expect("a revoked key is refused within 5 s (the revocation event)");
    assert!(
        refused.contains("unknown or revoked tenant key"),
        "{refused}"
    );
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
    assert_eq!(status, 200, "another key of the tenant still works: {body}");
    endpoint.harness.stop().await;
}

/// `notes` with two prompts and two resources besides its tools.
const DECLARED_BEFORE: &str = r#"{
  "tools": [{"name":"echo","description":"Echo"},{"name":"add","description":"Add"}],
  "prompts": [{"name":"greet","description":"Greets","arguments":["who"]},
              {"name":"farewell","description":"Says goodbye"}],
  "resources": [{"uri":"notes://a","name":"a","text":"alpha"},
                {"uri":"notes://b","name":"b","text":"beta"}]
}"#;
/// `farewell` and `notes://b` are gone, `greet` is unchanged.
const DECLARED_AFTER: &str = r#"{
  "tools": [{"name":"echo","description":"Echo"},{"name":"add","description":"Add"}],
  "prompts": [{"name":"greet","description":"Greets","arguments":["who"]}],
  "resources": [{"uri":"notes://a","name":"a","text":"alpha"}]
}"#;

fn sorted(mut names: Vec<String>) -> Vec<String> {
    names.sort();
    names
}

/// Prompts and resources are remembered, pinned and served like tools: the
/// pins carry them (also when read back from Postgres), a warm session lists
/// them without a start, `prompts/get` and `resources/read` start the server
/// lazily (the fixture's and server-everything's), and after the server
/// drops one the session is told (`list_changed`) and refused with
/// `prompt.withdrawn` / `resource.withdrawn`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_and_resources_are_pinned_served_lazily_and_withdrawn() {
    let everything = server("everything", &mcp_fixture::reference::everything());
    let endpoint = Endpoint::start(vec![everything], settings()).await;
    std::fs::write(&endpoint.tools_file, DECLARED_BEFORE).unwrap();

    // The gate's preparation (NATS) discovers both servers live; its pins
    // carry the prompts and resources, and so does the stored session.
    let prepared = endpoint.harness.prepare("acme", "gate-session").await;
    assert_eq!(prepared.error, None);
    let notes = prepared
        .pins
        .iter()
        .find(|p| p.server_id == "notes")
        .unwrap();
    let prompt_names: Vec<&str> = notes.prompts.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(prompt_names, ["greet", "farewell"]);
    assert_eq!(notes.prompts[0].description, "Greets");
    let uris: Vec<&str> = notes.resources.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(uris, ["notes://a", "notes://b"]);
    assert_eq!(notes.resources[0].mime_type, "text/plain");
    let everything_pin = prepared
        .pins
        .iter()
        .find(|p| p.server_id == "everything")
        .unwrap();
    assert!(
        everything_pin
            .prompts
            .iter()
            .any(|p| p.name == "simple-prompt"),
        "{:?}",
        everything_pin.prompts
    );
    assert!(!everything_pin.resources.is_empty());
    let again = endpoint.harness.prepare("acme", "gate-session").await;
    assert!(again.follow_up, "answered from the stored pins");
    // A stored pin has no handshake time; the rest is what was pinned.
    let without_timing = |pins: &[ctxsync_proto::v1::CatalogPin]| {
        let mut pins = pins.to_vec();
        pins.iter_mut().for_each(|p| p.handshake_ms = 0);
        pins
    };
    assert_eq!(
        without_timing(&again.pins),
        without_timing(&prepared.pins),
        "Postgres keeps prompts and resources"
    );
    assert!(endpoint.no_fixture_running().await);
    let warm = endpoint.starts();

    // A warm MCP session lists them with no start.
    let (changed_tx, mut changed) = tokio::sync::mpsc::unbounded_channel();
    let spec = ServerSpec {
        name: "catalog".into(),
        transport: TransportSpec::StreamableHttp {
            url: endpoint.url.clone(),
            headers: BTreeMap::from([("Authorization".into(), format!("Bearer {}", endpoint.key))]),
        },
    };
    let options = ConnectOptions {
        tools_changed: Some(changed_tx),
        sessions_only: true,
        ..ConnectOptions::new(DEADLINE)
    };
    let client = Connection::connect(&spec, options).await.unwrap();
    let prompts = sorted(
        client
            .list_prompts()
            .await
            .unwrap()
            .into_iter()
            .map(|p| p.name)
            .collect(),
    );
    assert!(prompts.contains(&"notes__greet".to_owned()), "{prompts:?}");
    assert!(
        prompts.contains(&"notes__farewell".to_owned()),
        "{prompts:?}"
    );
    assert!(
        prompts.contains(&"everything__simple-prompt".to_owned()),
        "{prompts:?}"
    );
    let resources = client.list_resources().await.unwrap();
    let resource_uris: Vec<&str> = resources.iter().map(|r| r.uri.as_str()).collect();
    assert!(resource_uris.contains(&"notes://a") && resource_uris.contains(&"notes://b"));
    let everything_uri = everything_pin.resources[0].uri.clone();
    assert!(resource_uris.contains(&everything_uri.as_str()));
    assert_eq!(
        endpoint.starts(),
        warm,
        "listing prompts and resources started nothing"
    );

    // First use starts the server; the answers are the servers' own.
    let greeting: Value = serde_json::from_str(
        &client
            .get_prompt(
                "notes__greet",
                json!({"who": "ada"}).as_object().unwrap().clone(),
                DEADLINE,
            )
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        greeting["messages"][0]["content"]["text"], r#"prompt greet with {"who":"ada"}"#,
        "{greeting}"
    );
    assert_eq!(
        endpoint.starts(),
        warm + 1,
        "prompts/get started the server once"
    );
    let read: Value =
        serde_json::from_str(&client.read_resource("notes://a", DEADLINE).await.unwrap()).unwrap();
    assert_eq!(read["contents"][0]["text"], "alpha", "{read}");
    assert_eq!(
        endpoint.starts(),
        warm + 1,
        "the session's server stays open"
    );
    let simple: Value = serde_json::from_str(
        &client
            .get_prompt("everything__simple-prompt", Default::default(), DEADLINE)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        simple["messages"][0]["content"]["text"], "This is a simple prompt without arguments.",
        "{simple}"
    );
    let document: Value = serde_json::from_str(
        &client
            .read_resource(&everything_uri, DEADLINE)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        document["contents"][0]["uri"],
        everything_uri.as_str(),
        "{document}"
    );

    // The server drops a prompt and a resource: the client is told, the
    // lists leave them out, and using them is refused.
    std::fs::write(&endpoint.tools_file, DECLARED_AFTER).unwrap();
    tokio::time::timeout(DEADLINE, changed.recv())
        .await
        .expect("a list_changed notification within 30 s")
        .unwrap();
    let withdrawn_prompt = tokio::time::timeout(DEADLINE, async {
        loop {
            let names: Vec<String> = client
                .list_prompts()
                .await
                .unwrap()
                .into_iter()
                .map(|p| p.name)
                .collect();
            if !names.contains(&"notes__farewell".to_owned()) {
                return names;
            }
            changed.recv().await;
        }
    })
    .await
    .expect("the withdrawn prompt leaves the list");
    assert!(withdrawn_prompt.contains(&"notes__greet".to_owned()));
    let uris_after: Vec<String> = client
        .list_resources()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.uri)
        .collect();
    assert!(
        !uris_after.contains(&"notes://b".to_owned()),
        "{uris_after:?}"
    );
    assert!(
        uris_after.contains(&"notes://a".to_owned()),
        "{uris_after:?}"
    );
    let refused = client
        .get_prompt("notes__farewell", Default::default(), DEADLINE)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("prompt.withdrawn"), "{refused}");
    assert!(refused.contains("(code -32602)"), "{refused}");
    let refused = client
        .read_resource("notes://b", DEADLINE)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("resource.withdrawn"), "{refused}");
    assert!(refused.contains("(code -32002)"), "{refused}");
    let unknown = client
        .read_resource("notes://never-declared", DEADLINE)
        .await
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("resource.not_found"), "{unknown}");
    // An unchanged prompt still works.
    assert!(
        client
            .get_prompt("notes__greet", Default::default(), DEADLINE)
            .await
            .is_ok()
    );
    client.close().await;
    assert!(
        endpoint.no_fixture_running().await,
        "the session's server stopped"
    );
    endpoint.harness.stop().await;
}

/// A request of `method` naming `session` with `key` (a JSON-RPC `body` for
/// a POST); the status and the body. Not for a stream that stays open.
async fn raw_request(
    method: reqwest::Method,
    url: &str,
    key: &str,
    session: &str,
    body: Option<&Value>,
) -> (u16, String) {
    let mut request = reqwest::Client::new()
        .request(method, url)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-session-id", session)
        .header("mcp-protocol-version", "2025-06-18")
        .bearer_auth(key);
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.expect("the endpoint answers");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

fn echo_call(id: u64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": "notes__echo", "arguments": {"text": "x"}}})
}

/// `ctxsync_catalog_mcp_refused_total` by `reason`.
async fn mcp_refused(endpoint: &Endpoint, reason: &str) -> f64 {
    metric(
        endpoint.harness.running(),
        &format!("ctxsync_catalog_mcp_refused_total{{reason=\"{reason}\"}}"),
    )
    .await
}

fn http_error(body: &str) -> (String, String) {
    let value: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (
        value["error"]["code"].as_str().unwrap().to_owned(),
        value["error"]["limit"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// One key opening sessions past its bound gets 429 (an `HttpErrorReply`
/// naming the bound, like the endpoint's other refusals), a second key of
/// the tenant past the tenant's bound too, while the other tenant's MCP
/// session, its call and its first turn's preparation are unaffected; a
/// session's end gives its place back.
#[tokio::test]
async fn sessions_past_a_keys_or_tenants_bound_are_429_and_another_tenant_is_unaffected() {
    let mut settings = settings();
    settings.mcp_sessions = catalog::SessionLimits {
        per_key: 3,
        per_tenant: 5,
        idle: Duration::from_secs(600),
    };
    let beta_record = tempfile::tempdir().unwrap();
    let beta_notes = fixture("bnotes", beta_record.path(), &[]);
    let endpoint = Endpoint::start_with_beta(vec![], vec![beta_notes], settings, |_| {}).await;
    let store = store(&endpoint.harness);
    let (per_key, per_tenant) = (
        mcp_refused(&endpoint, "sessions_per_key").await,
        mcp_refused(&endpoint, "sessions_per_tenant").await,
    );
    let mut held = Vec::new();
    for _ in 0..3 {
        let (status, session, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
        assert_eq!(status, 200, "{body}");
        held.push(session.unwrap());
    }
    let (status, session, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
    assert_eq!((status, session), (429, None), "{body}");
    assert!(body.contains("maximum of 3 open MCP sessions"), "{body}");
    assert_eq!(
        http_error(&body),
        (
            "too_many".to_owned(),
            "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_KEY".to_owned()
        )
    );
    let other_key = store.create_tenant_key("acme").await.0;
    for _ in 0..2 {
        let (status, _, body) = raw_initialize(&endpoint.url, Some(&other_key)).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&other_key)).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(
        http_error(&body).1,
        "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_TENANT"
    );
    assert!(mcp_refused(&endpoint, "sessions_per_key").await > per_key);
    assert!(mcp_refused(&endpoint, "sessions_per_tenant").await > per_tenant);

    // beta is untouched: a whole MCP session with a call, and a first turn's preparation.
    let beta = store.create_tenant_key("beta").await.0;
    let client = endpoint.client(&beta).await;
    let tools: Vec<String> = client
        .list_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(tools.contains(&"bnotes__echo".to_owned()), "{tools:?}");
    let called = client
        .call_tool(
            "bnotes__echo",
            json!({"text": "b"}).as_object().unwrap().clone(),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(!called.is_error, "{}", called.content_json);
    let turn = endpoint.harness.prepare("beta", "beta-turn").await;
    assert_eq!(turn.error, None);
    assert_eq!(
        sources(&turn),
        [("bnotes".to_owned(), Source::Pinned as i32)]
    );

    // The end of one session gives its place back.
    let (status, body) = raw_request(
        reqwest::Method::DELETE,
        &endpoint.url,
        &endpoint.key,
        &held[0],
        None,
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let (status, _, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        endpoint.harness.running().mcp_sessions(),
        6,
        "5 of acme, 1 of beta"
    );
    client.close().await;
    endpoint.harness.stop().await;
}

/// With one process per tenant, acme's second session gets the tool error
/// naming the tenant bound, while beta's call still starts its server.
#[tokio::test]
async fn a_tenant_at_its_process_bound_gets_the_tool_error_and_another_tenant_still_starts() {
    let mut settings = settings();
    settings.max_server_processes = Some(8);
    settings.max_server_processes_per_tenant = Some(1);
    let beta_record = tempfile::tempdir().unwrap();
    let beta_notes = fixture("bnotes", beta_record.path(), &[]);
    let endpoint = Endpoint::start_with_beta(vec![], vec![beta_notes], settings, |_| {}).await;
    let beta = store(&endpoint.harness).create_tenant_key("beta").await.0;
    let echo = || json!({"text": "x"}).as_object().unwrap().clone();
    let first = endpoint.client(&endpoint.key).await;
    let second = endpoint.client(&endpoint.key).await;
    let ok = first
        .call_tool("notes__echo", echo(), DEADLINE)
        .await
        .unwrap();
    assert!(!ok.is_error, "{}", ok.content_json);
    let refused = second
        .call_tool("notes__echo", echo(), DEADLINE)
        .await
        .unwrap();
    assert!(refused.is_error);
    let structured: Value =
        serde_json::from_str(refused.structured_content_json.as_deref().unwrap()).unwrap();
    assert_eq!(structured["error"]["code"], "server.process_limit");
    let message = structured["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("--max-server-processes-per-tenant"),
        "{message}"
    );

    let other = endpoint.client(&beta).await;
    let started = other
        .call_tool("bnotes__echo", echo(), DEADLINE)
        .await
        .unwrap();
    assert!(!started.is_error, "{}", started.content_json);
    let one = eventually(DEADLINE, || {
        mcp_fixture::live_pids(beta_record.path()).len() == 1
    })
    .await;
    assert!(one, "beta's server runs");
    let running = endpoint.harness.running();
    assert_eq!(
        (
            running.tenant_processes("acme"),
            running.tenant_processes("beta")
        ),
        (1, 1)
    );
    assert_eq!(running.bounded_processes(), 2);
    for client in [first, second, other] {
        client.close().await;
    }
    assert!(endpoint.no_fixture_running().await);
    let freed = eventually(DEADLINE, || running.bounded_processes() == 0).await;
    assert!(freed, "the sessions' ends gave the places back");
    endpoint.harness.stop().await;
}

/// A revoked key's open session ends within a second of the revocation:
/// its GET stream closes, its server stops, its next request is refused
/// (401 with the key, 404 with another key of the tenant).
#[tokio::test]
async fn a_revoked_keys_session_ends_within_a_second_with_its_stream_and_its_server() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let store = store(&endpoint.harness);
    let (key, key_id) = store.create_tenant_key("acme").await;
    let (status, session, body) = raw_initialize(&endpoint.url, Some(&key)).await;
    assert_eq!(status, 200, "{body}");
    let session = session.unwrap();
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let post = reqwest::Method::POST;
    let (status, body) = raw_request(
        post.clone(),
        &endpoint.url,
        &key,
        &session,
        Some(&initialized),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let (status, body) = raw_request(
        post.clone(),
        &endpoint.url,
        &key,
        &session,
        Some(&echo_call(2)),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""isError":false"#), "{body}");
    let record = endpoint.record.path();
    let one = eventually(DEADLINE, || mcp_fixture::live_pids(record).len() == 1).await;
    assert!(one, "the session's server runs");

    let mut stream = reqwest::Client::new()
        .get(&endpoint.url)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", &session)
        .header("mcp-protocol-version", "2025-06-18")
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let first = tokio::time::timeout(DEADLINE, stream.chunk()).await;
    assert!(
        matches!(first, Ok(Ok(Some(_)))),
        "the stream is open: {first:?}"
    );

    store.revoke_tenant_key(&key_id).await;
    let revoked = std::time::Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(Some(_)) = stream.chunk().await {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the GET stream ends within a second of the revocation"
    );
    println!(
        "REVOCATION-SUMMARY the revoked key's GET stream ended {} ms after the revocation",
        revoked.elapsed().as_millis()
    );
    let (status, body) = raw_request(
        post.clone(),
        &endpoint.url,
        &key,
        &session,
        Some(&echo_call(3)),
    )
    .await;
    assert_eq!(status, 401, "{body}");
    let (status, body) = raw_request(
        post,
        &endpoint.url,
        &endpoint.key,
        &session,
        Some(&echo_call(4)),
    )
    .await;
    assert_eq!(
        status, 404,
        "the session is gone for the tenant's other keys: {body}"
    );
    assert!(
        endpoint.no_fixture_running().await,
        "the session's server stopped"
    );
    let running = endpoint.harness.running();
    assert!(eventually(DEADLINE, || running.mcp_sessions() == 0).await);
    assert!(eventually(DEADLINE, || running.open_transports() == 0).await);
    assert!(
        metric(running, "ctxsync_catalog_mcp_sessions_revoked_total").await >= 1.0,
        "counted"
    );
    endpoint.harness.stop().await;
}

/// From `initialize` on, a session is its creator's tenant's: another
/// tenant's key gets the answer of a session that does not exist (404, the
/// same body) for every request — `notifications/initialized`, any other
/// message, GET, DELETE — before and after `initialized`, and the owner's
/// session works throughout.
#[tokio::test]
async fn another_tenants_key_cannot_touch_a_session_before_or_after_initialized() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let beta = store(&endpoint.harness).create_tenant_key("beta").await.0;
    let (status, session, body) = raw_initialize(&endpoint.url, Some(&endpoint.key)).await;
    assert_eq!(status, 200, "{body}");
    let session = session.unwrap();
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    let (status, unknown) = raw_request(
        reqwest::Method::POST,
        &endpoint.url,
        &beta,
        "no-such-session",
        Some(&list),
    )
    .await;
    assert_eq!(status, 404, "{unknown}");
    let touches = [
        (reqwest::Method::POST, Some(initialized.clone())),
        (reqwest::Method::POST, Some(list.clone())),
        (reqwest::Method::POST, Some(echo_call(3))),
        (reqwest::Method::GET, None),
        (reqwest::Method::DELETE, None),
    ];
    let owner_lists = || async {
        let (status, body) = raw_request(
            reqwest::Method::POST,
            &endpoint.url,
            &endpoint.key,
            &session,
            Some(&list),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("notes__echo"), "{body}");
    };
    for stage in ["before initialized", "after initialized"] {
        for (method, body) in &touches {
            let (status, answer) = raw_request(
                method.clone(),
                &endpoint.url,
                &beta,
                &session,
                body.as_ref(),
            )
            .await;
            assert_eq!(
                (status, answer.as_str()),
                (404, unknown.as_str()),
                "{stage}: {method} {body:?}"
            );
        }
        if stage == "before initialized" {
            let (status, body) = raw_request(
                reqwest::Method::POST,
                &endpoint.url,
                &endpoint.key,
                &session,
                Some(&initialized),
            )
            .await;
            assert_eq!(
                status, 202,
                "the owner still initializes its session: {body}"
            );
        }
        owner_lists().await;
    }
    assert_eq!(
        endpoint.starts(),
        1,
        "initialize's discovery only: beta's call started nothing"
    );
    let (status, body) = raw_request(
        reqwest::Method::DELETE,
        &endpoint.url,
        &endpoint.key,
        &session,
        None,
    )
    .await;
    assert_eq!(status, 202, "{body}");
    endpoint.harness.stop().await;
}

// MCP 2026-07-28: stateless requests, pin handles and cache hints.

const STATELESS: &str = "2026-07-28";
const HANDLE: &str = catalog::PIN_HANDLE_META;

/// A 2026-07-28 request as the specification's HTTP transport sends it: no
/// session; the version and capabilities in `_meta`, the version, method
/// and name in headers. The status and the JSON-RPC message answered.
async fn stateless_request(url: &str, key: &str, method: &str, params: Value) -> (u16, Value) {
    stateless_request_as(url, key, method, params, Some(STATELESS)).await
}

/// [`stateless_request`] naming `version` (`None`: no `_meta` version, the
/// header still 2026-07-28).
async fn stateless_request_as(
    url: &str,
    key: &str,
    method: &str,
    mut params: Value,
    version: Option<&str>,
) -> (u16, Value) {
    let meta = params
        .as_object_mut()
        .expect("params are an object")
        .entry("_meta")
        .or_insert_with(|| json!({}));
    if let Some(version) = version {
        meta["io.modelcontextprotocol/protocolVersion"] = json!(version);
        meta["io.modelcontextprotocol/clientCapabilities"] = json!({});
        meta["io.modelcontextprotocol/clientInfo"] = json!({"name": "raw", "version": "1"});
    }
    let name = params
        .get("name")
        .or_else(|| params.get("uri"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let mut request = reqwest::Client::new()
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", version.unwrap_or(STATELESS))
        .header("mcp-method", method)
        .bearer_auth(key)
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}));
    if let Some(name) = name {
        request = request.header("mcp-name", name);
    }
    let response = request.send().await.expect("the endpoint answers");
    assert!(
        response.headers().get("mcp-session-id").is_none(),
        "a stateless request opens no session"
    );
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    (status, answer_of(&text))
}

/// The JSON-RPC answer of a JSON body, or of an SSE body's `data:` lines.
fn answer_of(text: &str) -> Value {
    if let Ok(value) = serde_json::from_str(text) {
        return value;
    }
    text.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
        .rfind(|message| message.get("id").is_some())
        .unwrap_or_else(|| panic!("no JSON-RPC answer in {text:?}"))
}

fn tool_names(list: &Value) -> Vec<String> {
    list["result"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("a tools list: {list}"))
        .iter()
        .map(|tool| tool["name"].as_str().unwrap().to_owned())
        .collect()
}

fn handle_of(list: &Value) -> String {
    list["result"]["_meta"][HANDLE]
        .as_str()
        .unwrap_or_else(|| panic!("a pin handle in the list's _meta: {list}"))
        .to_owned()
}

fn echo_by_handle(handle: &str) -> Value {
    json!({"name": "notes__echo", "arguments": {"text": "hello"}, "_meta": {HANDLE: handle}})
}

/// The whole 2026-07-28 conversation over raw HTTP: `server/discover`, a
/// list with its handle and hints (the same handle again from the same
/// memory, nothing started), a call by handle (the lazy start), the tool
/// changed under the handle (`tool.withdrawn`, and the list by handle
/// leaves it out), another tenant's key holding the handle, and handles
/// not of the catalog's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2026_client_discovers_lists_with_a_handle_and_hints_and_calls_by_handle() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let gate = endpoint.gate_names().await;
    assert!(endpoint.no_fixture_running().await);
    let warm = endpoint.starts();
    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());

    let (status, discover) = stateless_request(url, key, "server/discover", json!({})).await;
    assert_eq!(status, 200, "{discover}");
    println!("CONVERSATION server/discover -> {discover}");
    let versions: Vec<&str> = discover["result"]["supportedVersions"]
        .as_array()
        .unwrap_or_else(|| panic!("supported versions: {discover}"))
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(versions.first(), Some(&STATELESS), "{discover}");
    assert!(versions.contains(&"2025-11-25") && versions.contains(&"2025-06-18"));
    let mut newest_first = versions.clone();
    newest_first.sort_by(|a, b| b.cmp(a));
    assert_eq!(versions, newest_first, "newest first");

    let (status, list) = stateless_request(url, key, "tools/list", json!({})).await;
    assert_eq!(status, 200, "{list}");
    println!("CONVERSATION tools/list -> {list}");
    assert_eq!(tool_names(&list), gate, "the gate's names, in pin order");
    assert_eq!(list["result"]["cacheScope"], "private", "{list}");
    assert_eq!(
        list["result"]["ttlMs"],
        json!(24 * 3600 * 1000),
        "a stdio server's list stays true until its configuration or the release changes"
    );
    let handle = handle_of(&list);
    assert!(handle.starts_with("pins-"), "{handle}");
    let (_, again) = stateless_request(url, key, "tools/list", json!({})).await;
    assert_eq!(handle_of(&again), handle, "the same memory, the same pins");
    assert_eq!(endpoint.starts(), warm, "listing started no server");

    let (status, called) = stateless_request(url, key, "tools/call", echo_by_handle(&handle)).await;
    assert_eq!(status, 200, "{called}");
    println!(
        "CONVERSATION tools/call {} -> {called}",
        echo_by_handle(&handle)
    );
    assert_eq!(called["result"]["isError"], json!(false), "{called}");
    assert_eq!(called["result"]["content"][0]["text"], "hello", "{called}");
    assert_eq!(
        endpoint.starts(),
        warm + 1,
        "the first call started the server"
    );

    // The server's tools change: it says so (--watch), and the next call by
    // the handle re-lists first.
    std::fs::write(&endpoint.tools_file, TOOLS_AFTER).unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let withdrawn = loop {
        let (_, called) = stateless_request(url, key, "tools/call", echo_by_handle(&handle)).await;
        if called["result"]["isError"] == json!(true) {
            break called;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the change never reached the handle's pins: {called}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        withdrawn["result"]["structuredContent"]["error"]["code"], "tool.withdrawn",
        "{withdrawn}"
    );
    let (_, listed) =
        stateless_request(url, key, "tools/list", json!({"_meta": {HANDLE: &handle}})).await;
    assert_eq!(tool_names(&listed), ["notes__add"], "{listed}");
    assert_eq!(handle_of(&listed), handle);

    // Another tenant's key with acme's handle: as if it did not exist.
    let beta = store(&endpoint.harness).create_tenant_key("beta").await.0;
    let (status, refused) =
        stateless_request(url, &beta, "tools/call", echo_by_handle(&handle)).await;
    assert_eq!(status, 200, "{refused}");
    assert_eq!(refused["error"]["code"], json!(-32602), "{refused}");
    assert_eq!(
        refused["error"]["data"]["code"], "session.not_prepared",
        "{refused}"
    );
    assert!(!refused.to_string().contains("hello"), "{refused}");

    for (bad, says) in [
        (json!("pins-never-given"), "names no pins of this tenant"),
        (json!(7), "must be a string"),
        (json!("a".repeat(300)), "over the limit of 256"),
    ] {
        let (_, refused) =
            stateless_request(url, key, "tools/list", json!({"_meta": {HANDLE: bad}})).await;
        assert_eq!(refused["error"]["code"], json!(-32602), "{refused}");
        let message = refused["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{refused}");
    }
    endpoint.harness.stop().await;
}

/// The specification's refusals: a 2026-07-28 request without its `_meta`
/// version, and one naming a version the catalog does not serve (listing
/// those it does).
#[tokio::test]
async fn a_2026_request_without_its_version_or_with_an_unknown_one_is_refused() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());

    let (status, missing) = stateless_request_as(url, key, "tools/list", json!({}), None).await;
    assert_eq!(status, 400, "{missing}");
    assert_eq!(missing["error"]["code"], json!(-32602), "{missing}");
    let message = missing["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("protocolVersion"), "{missing}");

    let (status, unknown) =
        stateless_request_as(url, key, "tools/list", json!({}), Some("2099-01-01")).await;
    assert_eq!(status, 400, "{unknown}");
    assert_eq!(unknown["error"]["code"], json!(-32022), "{unknown}");
    let supported = unknown["error"]["data"]["supported"].to_string();
    assert!(
        supported.contains(STATELESS) && supported.contains("2025-11-25"),
        "{unknown}"
    );
    endpoint.harness.stop().await;
}

/// An HTTP server's pins are fresh for what is left of its reuse window:
/// `ttlMs` falls as the entry ages and is 0 by the handle once the window
/// ended. A stateless list opens no MCP session, so no session bound
/// applies to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_servers_ttl_falls_as_its_discovery_ages_to_0_at_the_windows_end() {
    let web = mcp_fixture::HttpFixture::start(&[]).await;
    let window = Duration::from_secs(3);
    let mut settings = settings();
    settings.discovery_reuse = window;
    settings.mcp_sessions.per_key = 1;
    let endpoint = Endpoint::start(vec![http("web", web.url())], settings).await;
    endpoint.gate_names().await;
    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());

    let ttl = |list: &Value| {
        list["result"]["ttlMs"]
            .as_u64()
            .unwrap_or_else(|| panic!("a ttlMs: {list}"))
    };
    let (_, first) = stateless_request(url, key, "tools/list", json!({})).await;
    let first_ttl = ttl(&first);
    assert!(
        first_ttl > 0 && first_ttl <= window.as_millis() as u64,
        "within the reuse window: {first}"
    );
    // More lists at once than the key may hold sessions: none is one.
    let lists = (0..4).map(|_| stateless_request(url, key, "tools/list", json!({})));
    for (status, list) in futures::future::join_all(lists).await {
        assert_eq!(status, 200, "{list}");
    }
    let aged = Duration::from_millis(1500);
    tokio::time::sleep(aged).await;
    let (_, later) = stateless_request(url, key, "tools/list", json!({})).await;
    let later_ttl = ttl(&later);
    assert!(
        later_ttl <= first_ttl - aged.as_millis() as u64 + 50,
        "{first_ttl} ms, then {later_ttl} ms"
    );
    assert_eq!(handle_of(&later), handle_of(&first), "the same discovery");

    // The window ends: the handle's pins are no longer a list the memory
    // may reuse, so they are stale at once.
    let running = endpoint.harness.running();
    assert!(eventually(DEADLINE, || !running.remembers("acme", "web")).await);
    let by_handle = json!({"_meta": {HANDLE: handle_of(&first)}});
    let (_, ended) = stateless_request(url, key, "tools/list", by_handle).await;
    assert_eq!(ttl(&ended), 0, "{ended}");
    assert_eq!(tool_names(&ended), tool_names(&first), "the pins kept");
    endpoint.harness.stop().await;
}

/// An open `subscriptions/listen` stream, read message by message.
struct Listening {
    response: reqwest::Response,
    buffered: String,
}

impl Listening {
    /// Opens a listen for the three list changes (with `handle`, if any)
    /// and waits for its acknowledgment.
    async fn open(url: &str, key: &str, handle: Option<&str>) -> Self {
        let mut meta = json!({
            "io.modelcontextprotocol/protocolVersion": STATELESS,
            "io.modelcontextprotocol/clientCapabilities": {},
        });
        if let Some(handle) = handle {
            meta[HANDLE] = json!(handle);
        }
        let response = reqwest::Client::new()
            .post(url)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", STATELESS)
            .header("mcp-method", "subscriptions/listen")
            .bearer_auth(key)
            .json(&json!({"jsonrpc": "2.0", "id": 7, "method": "subscriptions/listen", "params": {
                "_meta": meta,
                "notifications": {"toolsListChanged": true, "promptsListChanged": true, "resourcesListChanged": true},
            }}))
            .send()
            .await
            .expect("the endpoint answers");
        assert_eq!(response.status().as_u16(), 200);
        let mut listening = Self {
            response,
            buffered: String::new(),
        };
        let ack = listening.next(DEADLINE).await.expect("an acknowledgment");
        assert_eq!(
            ack["method"], "notifications/subscriptions/acknowledged",
            "{ack}"
        );
        assert_eq!(
            ack["params"]["notifications"]["toolsListChanged"], true,
            "{ack}"
        );
        listening
    }

    /// The next message on the stream within `within`.
    async fn next(&mut self, within: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            while let Some(end) = self.buffered.find('\n') {
                let line: String = self.buffered.drain(..=end).collect();
                if let Some(data) = line.trim().strip_prefix("data:")
                    && let Ok(message) = serde_json::from_str::<Value>(data.trim())
                {
                    return Some(message);
                }
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .ok()?
                .ok()??;
            self.buffered.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

/// `subscriptions/listen` says at once when a list changes: a live
/// discovery that finds an HTTP server's tools different (the memory's
/// change), and a server opened for a handle's pins that withdraws a tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_list_is_announced_on_subscriptions_listen_within_a_second() {
    let record = tempfile::tempdir().unwrap();
    let web_tools = record.path().join("web-tools.json");
    std::fs::write(&web_tools, TOOLS_BEFORE).unwrap();
    let web_file = web_tools.display().to_string();
    let web =
        mcp_fixture::HttpFixture::start(&["--mode", "changing-tools", "--tools-file", &web_file])
            .await;
    let mut settings = settings();
    settings.discovery_reuse = Duration::from_secs(2);
    let endpoint = Endpoint::start(vec![http("web", web.url())], settings).await;
    endpoint.gate_names().await;
    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());

    // The memory: the web server's tools change, its window ends, and the
    // next preparation's live discovery finds them different.
    let mut listening = Listening::open(url, key, None).await;
    std::fs::write(&web_tools, TOOLS_AFTER).unwrap();
    let running = endpoint.harness.running();
    assert!(eventually(DEADLINE, || !running.remembers("acme", "web")).await);
    let reply = endpoint.harness.prepare("acme", "after-the-window").await;
    assert_eq!(reply.error, None);
    let discovered = std::time::Instant::now();
    let told = listening
        .next(Duration::from_secs(1))
        .await
        .expect("a notification within a second of the discovery");
    println!(
        "LISTEN-LATENCY memory change announced {} ms after the discovery returned",
        discovered.elapsed().as_millis()
    );
    assert_eq!(told["method"], "notifications/tools/list_changed", "{told}");

    // A handle's pins: a server opened by a call withdraws a tool.
    let (_, list) = stateless_request(url, key, "tools/list", json!({})).await;
    let handle = handle_of(&list);
    let (_, called) = stateless_request(url, key, "tools/call", echo_by_handle(&handle)).await;
    assert_eq!(called["result"]["content"][0]["text"], "hello", "{called}");
    let mut listening = Listening::open(url, key, Some(&handle)).await;
    std::fs::write(&endpoint.tools_file, TOOLS_AFTER).unwrap();
    let written = std::time::Instant::now();
    let told = listening
        .next(DEADLINE)
        .await
        .expect("a notification of the withdrawal");
    println!(
        "LISTEN-LATENCY withdrawal announced {} ms after the server's tools changed",
        written.elapsed().as_millis()
    );
    assert_eq!(told["method"], "notifications/tools/list_changed", "{told}");
    assert!(
        written.elapsed() < Duration::from_secs(1),
        "within a second"
    );
    let (_, listed) =
        stateless_request(url, key, "tools/list", json!({"_meta": {HANDLE: &handle}})).await;
    let names = tool_names(&listed);
    assert!(
        !names.contains(&"notes__echo".to_owned()) && names.contains(&"notes__add".to_owned()),
        "{listed}"
    );
    endpoint.harness.stop().await;
}

/// One official SDK client of the stateless revision: it discovers and
/// speaks 2026-07-28, lists the pins (as the gate names them) with their
/// handle and hints, calls lazily by the handle, hears on
/// `subscriptions/listen` that a tool was withdrawn, lists without it and is
/// answered `tool.withdrawn` for it; and opens no MCP session throughout.
async fn stateless_sdk_scenario(program: PathBuf, script: &str) {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let gate = endpoint.gate_names().await;
    assert!(endpoint.no_fixture_running().await);
    let warm = endpoint.starts();
    let tools_file = endpoint.tools_file.display().to_string();
    let out = run_client(
        program,
        script,
        &[
            "--url",
            &endpoint.url,
            "--key",
            &endpoint.key,
            "--call",
            "notes__echo",
            "--arguments",
            r#"{"text":"hello"}"#,
            "--listen-seconds",
            "20",
            "--change-file",
            &tools_file,
            "--change-to",
            TOOLS_AFTER,
            "--call-after",
            "notes__echo",
        ],
    )
    .await;

    assert_eq!(out["protocol"], STATELESS, "{out}");
    let listed: Vec<String> = out["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, gate, "the gate's names in pin order: {out}");
    assert_eq!(out["list_hints"]["ttlMs"], json!(24 * 3600 * 1000), "{out}");
    assert_eq!(out["list_hints"]["cacheScope"], "private", "{out}");
    let handle = out["list_hints"]["meta"][HANDLE]
        .as_str()
        .unwrap_or_default();
    assert!(handle.starts_with("pins-"), "{out}");
    assert_called_then_withdrawn(&out, &endpoint, warm);
    assert_eq!(
        endpoint.harness.running().mcp_sessions(),
        0,
        "a stateless client holds no MCP session"
    );
    endpoint.harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_2_speaks_2026_07_28_keeps_its_pins_and_hears_the_withdrawal() {
    stateless_sdk_scenario(python(), "stateless_client.py").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_sdk_2_speaks_2026_07_28_keeps_its_pins_and_hears_the_withdrawal() {
    stateless_sdk_scenario(node(), "stateless_client.mjs").await;
}

/// Two catalog replicas behind one address, each request on a new
/// connection so they alternate: a 2026-07-28 client's lists, calls by
/// handle and a withdrawn tool's call are answered alike by both; with one
/// replica stopped mid-conversation, the other goes on with the same pins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_behind_one_address_answer_a_stateless_conversation_alike() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let mut replica = endpoint
        .harness
        .replica(
            endpoint.harness.subjects.prefix(),
            endpoint.config.clone(),
            settings(),
        )
        .await;
    let gate = endpoint.gate_names().await;
    assert!(endpoint.no_fixture_running().await);
    let warm = endpoint.starts();
    let balancer = testkit::RoundRobin::start(vec![
        replica.running().http_addr(),
        endpoint.harness.running().http_addr(),
    ])
    .await;
    let url = format!("http://{}/mcp", balancer.addr);
    let key = endpoint.key.as_str();
    // Replica 0 learns the memory through the bucket.
    let shared = eventually(DEADLINE, || replica.running().remembers("acme", "notes")).await;
    assert!(shared, "the replica shares the memory");

    let mut handles = Vec::new();
    for _ in 0..2 {
        let (status, list) = stateless_request(&url, key, "tools/list", json!({})).await;
        assert_eq!(status, 200, "{list}");
        assert_eq!(tool_names(&list), gate, "{list}");
        handles.push(handle_of(&list));
    }
    assert_eq!(
        handles[0], handles[1],
        "both replicas name the same pins alike"
    );
    assert_eq!((balancer.taken(0), balancer.taken(1)), (1, 1));
    let handle = handles.remove(0);

    for _ in 0..2 {
        let (_, called) = stateless_request(&url, key, "tools/call", echo_by_handle(&handle)).await;
        assert_eq!(called["result"]["content"][0]["text"], "hello", "{called}");
    }
    assert_eq!(
        endpoint.starts(),
        warm + 2,
        "each replica started its own server on its first call"
    );

    // The tool changes under the handle: both replicas answer tool.withdrawn.
    std::fs::write(&endpoint.tools_file, TOOLS_AFTER).unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut withdrawn_in_a_row = 0;
    while withdrawn_in_a_row < 2 {
        let (_, called) = stateless_request(&url, key, "tools/call", echo_by_handle(&handle)).await;
        let code = &called["result"]["structuredContent"]["error"]["code"];
        withdrawn_in_a_row = if code == "tool.withdrawn" {
            withdrawn_in_a_row + 1
        } else {
            0
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "both replicas never withdrew the tool: {called}"
        );
    }

    // Replica 0 stops mid-conversation: its requests go to the other, which
    // answers the handle's pins as before.
    replica.stop_catalog().await;
    let before = balancer.taken(1);
    for _ in 0..2 {
        let (status, listed) =
            stateless_request(&url, key, "tools/list", json!({"_meta": {HANDLE: &handle}})).await;
        assert_eq!(status, 200, "{listed}");
        assert_eq!(tool_names(&listed), ["notes__add"], "{listed}");
        assert_eq!(handle_of(&listed), handle);
    }
    assert_eq!(
        balancer.taken(1),
        before + 2,
        "the remaining replica answered both"
    );
    replica.stop().await;
    endpoint.harness.stop().await;
}

/// An HTTP server's own `ttlMs`, when shorter than the operator's reuse
/// window, is how long its discovery is reused (and what the catalog's own
/// hint says); past it, the next preparation discovers it live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_servers_own_shorter_ttl_bounds_the_reuse_of_its_discovery() {
    let web = mcp_fixture::HttpFixture::start(&["--ttl-ms", "1500"]).await;
    let endpoint = Endpoint::start(vec![http("web", web.url())], settings()).await;
    endpoint.gate_names().await;
    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());
    let (_, list) = stateless_request(url, key, "tools/list", json!({})).await;
    let ttl = list["result"]["ttlMs"].as_u64().unwrap_or(u64::MAX);
    assert!(
        ttl <= 1500,
        "the server's hint, not the hour's window: {list}"
    );

    let running = endpoint.harness.running();
    let started = std::time::Instant::now();
    assert!(eventually(DEADLINE, || !running.remembers("acme", "web")).await);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "reused for the server's 1.5 s, not the operator's hour"
    );
    let reply = endpoint.harness.prepare("acme", "after-the-hint").await;
    let web_source = sources(&reply)
        .into_iter()
        .find(|(server, _)| server == "web")
        .map(|(_, source)| source);
    assert_eq!(
        web_source,
        Some(Source::Connected as i32),
        "discovered live again"
    );
    endpoint.harness.stop().await;
}

/// A preparation over NATS (the gate's, for a chat) answers its pin handle
/// and hint; the MCP endpoint, given that handle, answers the same pins with
/// the same hint: a chat backend that asked the gate and then calls over
/// MCP sees one catalog. Once the memory has newer lists, the handle's say 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chats_preparation_is_a_pin_handle_the_endpoint_answers_alike() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let reply = endpoint.harness.prepare("acme", "chat-9").await;
    assert_eq!(reply.error, None);
    assert_eq!(reply.pin_handle, "chat-9");
    assert_eq!(reply.ttl_ms, 24 * 3600 * 1000);
    let gate: Vec<String> = reply.pins[0]
        .tools
        .iter()
        .map(|tool| format!("notes{}{}", catalog::TOOL_NAME_SEPARATOR, tool.name))
        .collect();

    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());
    let (_, list) =
        stateless_request(url, key, "tools/list", json!({"_meta": {HANDLE: "chat-9"}})).await;
    assert_eq!(tool_names(&list), gate, "{list}");
    assert_eq!(handle_of(&list), "chat-9");
    assert_eq!(list["result"]["ttlMs"], json!(reply.ttl_ms), "{list}");
    let call =
        json!({"name": "notes__echo", "arguments": {"text": "hello"}, "_meta": {HANDLE: "chat-9"}});
    let (_, called) = stateless_request(url, key, "tools/call", call).await;
    assert_eq!(called["result"]["content"][0]["text"], "hello", "{called}");

    // A configuration change: the memory's lists are other ones now.
    let mut changed = endpoint.config.clone();
    changed.tenants[0].servers[0].classification = Some("internal".into());
    endpoint.harness.running().reload(changed).unwrap();
    let (_, stale) =
        stateless_request(url, key, "tools/list", json!({"_meta": {HANDLE: "chat-9"}})).await;
    assert_eq!(stale["result"]["ttlMs"], json!(0), "{stale}");
    assert_eq!(tool_names(&stale), gate, "the chat keeps its pins");
    endpoint.harness.stop().await;
}

/// A 2025 session started on one replica goes on through the other: each
/// request on a new connection through one round-robin address, so they
/// alternate (the second replica restores the session from the bucket,
/// with the same pins); another tenant's key reaches it on neither; with
/// the replica it started on stopped, it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2025_session_goes_on_through_either_replica() {
    let endpoint = Endpoint::start(vec![], settings()).await;
    let mut replica = endpoint
        .harness
        .replica(
            endpoint.harness.subjects.prefix(),
            endpoint.config.clone(),
            settings(),
        )
        .await;
    endpoint.gate_names().await;
    let balancer = testkit::RoundRobin::start(vec![
        replica.running().http_addr(),
        endpoint.harness.running().http_addr(),
    ])
    .await;
    let url = format!("http://{}/mcp", balancer.addr);
    let key = endpoint.key.as_str();
    let beta = store(&endpoint.harness).create_tenant_key("beta").await.0;

    let (status, session, body) = raw_initialize(&url, Some(key)).await;
    assert_eq!(status, 200, "{body}");
    let session = session.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let (status, body) = raw_post(&url, key, &session, initialized).await;
    assert_eq!(
        status, 202,
        "the other replica restored the session: {body}"
    );
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    for _ in 0..2 {
        let (status, body) = raw_post(&url, key, &session, list.clone()).await;
        assert_eq!(status, 200, "{body}");
        assert!(
            body.contains("notes__echo") && body.contains("notes__add"),
            "{body}"
        );
        let (status, body) = raw_post(&url, &beta, &session, list.clone()).await;
        assert_eq!(status, 404, "{body}");
        assert!(!body.contains("notes__"), "{body}");
    }
    for id in [3, 4] {
        let (status, body) = raw_post(&url, key, &session, echo_call(id)).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(r#""isError":false"#), "{body}");
    }
    assert!(
        balancer.taken(0) >= 4 && balancer.taken(1) >= 4,
        "both replicas served the session: {} and {}",
        balancer.taken(0),
        balancer.taken(1)
    );
    // Both replicas run in this process: one recorder counts for both.
    let restored = metric(
        endpoint.harness.running(),
        "ctxsync_catalog_mcp_sessions_restored_total",
    )
    .await;
    assert_eq!(
        restored, 1.0,
        "restored once, by the replica it did not start on"
    );

    // The replica it started on stops: the other one goes on with it.
    replica.stop_catalog().await;
    for _ in 0..2 {
        let (status, body) = raw_post(&url, key, &session, list.clone()).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("notes__echo"), "{body}");
    }
    replica.stop().await;
    endpoint.harness.stop().await;
}

/// The catalog discovers HTTP servers of either protocol era: one that
/// speaks only 2026-07-28 and one written before it; both are pinned with
/// their tools and called through `/mcp`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_servers_of_either_protocol_era_are_pinned_and_called() {
    let modern = mcp_fixture::HttpFixture::start(&["--protocols", "stateless"]).await;
    let older = mcp_fixture::HttpFixture::start(&["--protocols", "sessions"]).await;
    let endpoint = Endpoint::start(
        vec![http("modern", modern.url()), http("older", older.url())],
        settings(),
    )
    .await;
    let reply = endpoint.harness.prepare("acme", "eras").await;
    for server in ["modern", "older"] {
        let pin = reply
            .pins
            .iter()
            .find(|pin| pin.server_id == server)
            .unwrap_or_else(|| panic!("{server} pinned: {reply:?}"));
        assert_eq!(pin.source(), Source::Connected, "{server}: {pin:?}");
        assert!(pin.tools.iter().any(|tool| tool.name == "echo"), "{server}");
    }
    let (url, key) = (endpoint.url.as_str(), endpoint.key.as_str());
    for server in ["modern", "older"] {
        let call = json!({"name": format!("{server}__echo"), "arguments": {"text": server}});
        let (_, called) = stateless_request(url, key, "tools/call", call).await;
        assert_eq!(called["result"]["content"][0]["text"], server, "{called}");
    }
    endpoint.harness.stop().await;
}
