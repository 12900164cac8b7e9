//! Every HTTP answer of every service says `X-Content-Type-Options: nosniff`,
//! so no browser renders a JSON error, an event stream or a metrics page as
//! HTML: answers, refusals (401), unknown paths (404) and bodies over a
//! service's limit (413), on each service's real listener over TCP (the
//! services of the stack in this process, the workspace agent as its binary).

use std::time::Duration;

use reqwest::header::{CONTENT_TYPE, HeaderName};
use reqwest::{Client, RequestBuilder};
use serde_json::json;
use testkit::chat::TEST_TENANT_KEY;

const DEADLINE: Duration = Duration::from_secs(30);
/// chat-gate's request body limit (`chat_gate::http::MAX_BODY_BYTES`).
const GATE_MAX_BODY_BYTES: usize = 64 * 1024;
const NOSNIFF: HeaderName = HeaderName::from_static("x-content-type-options");

/// Sends `request` and asserts its status and that it says `nosniff`.
async fn expect(service: &str, what: &str, request: RequestBuilder, status: u16) {
    let response = request
        .timeout(DEADLINE)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{service} {what}: no answer: {e}"));
    let headers = response.headers().clone();
    let got = response.status().as_u16();
    // An event stream never ends: its head is the answer.
    let streaming = headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let body = if streaming {
        String::new()
    } else {
        response.text().await.unwrap_or_default()
    };
    assert_eq!(got, status, "{service} {what}: {body}");
    assert_eq!(
        headers.get(&NOSNIFF).map(|v| v.as_bytes()),
        Some(&b"nosniff"[..]),
        "{service} {what} ({got}) lacks nosniff: {headers:?}"
    );
}

/// The head of the answer to a POST that declares `length` bytes and sends
/// none (agent-ingest refuses it on the declared length, unread).
async fn declared_too_large(
    addr: std::net::SocketAddr,
    path: &str,
    token: &str,
    length: usize,
) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {token}\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        let mut chunk = [0u8; 4096];
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut chunk).await.expect("an answer");
            assert!(n > 0, "closed before an answer head");
            answer.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("answered without the body");
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_answers_nosniff_on_every_kind_of_answer() {
    let token = "n".repeat(43);
    // `_test` keeps the NATS server and the database for the test's length.
    let e2e::http_stack::HttpStack {
        test: _test,
        shutdown,
        stack,
        store: _,
        agent_id,
    } = e2e::http_stack::start("nosniff", &token).await;

    let http = Client::new();
    let base = |addr: std::net::SocketAddr| format!("http://{addr}");
    let store_url = base(stack.store().http_addr());
    let ingest = base(stack.ingest().http_addr());
    let gate = base(stack.gate().http_addr());
    let catalog_url = base(stack.catalog().http_addr());

    // Every listener's operator routes and its 404.
    for (service, url) in [
        ("snapshot-store", &store_url),
        ("agent-ingest", &ingest),
        ("chat-gate", &gate),
        ("catalog", &catalog_url),
    ] {
        for path in ["/healthz", "/readyz", "/metrics"] {
            expect(service, path, http.get(format!("{url}{path}")), 200).await;
        }
        expect(
            service,
            "unknown path",
            http.get(format!("{url}/no-such-path")),
            404,
        )
        .await;
    }
    expect(
        "snapshot-store",
        "POST /healthz",
        http.post(format!("{store_url}/healthz")),
        405,
    )
    .await;

    // agent-ingest: an answer, a refusal, a body over the request limit
    // (refused on its declared length) and a malformed one.
    let startup = format!("{ingest}/api/v1/agent/startup");
    let run_id = uuid::Uuid::new_v4().to_string();
    expect(
        "agent-ingest",
        "startup",
        http.post(&startup)
            .bearer_auth(&token)
            .json(&json!({ "agent_run_id": run_id })),
        200,
    )
    .await;
    expect(
        "agent-ingest",
        "startup without a token",
        http.post(&startup).json(&json!({ "agent_run_id": run_id })),
        401,
    )
    .await;
    let head = declared_too_large(
        stack.ingest().http_addr(),
        "/api/v1/agent/startup",
        &token,
        ctxsync_proto::limits::MAX_REQUEST_BYTES + 1,
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 413 "), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("\r\nx-content-type-options: nosniff\r\n"),
        "agent-ingest 413 lacks nosniff: {head}"
    );
    expect(
        "agent-ingest",
        "malformed startup",
        http.post(&startup)
            .bearer_auth(&token)
            .header(CONTENT_TYPE, "application/json")
            .body("{"),
        400,
    )
    .await;

    // chat-gate: its API, its page, its event stream and their refusals.
    expect(
        "chat-gate",
        "agents",
        http.get(format!("{gate}/api/v1/agents"))
            .bearer_auth(TEST_TENANT_KEY),
        200,
    )
    .await;
    expect("chat-gate", "page", http.get(format!("{gate}/ui/")), 200).await;
    expect(
        "chat-gate",
        "turn without a key",
        http.post(format!("{gate}/api/v1/gate"))
            .json(&json!({ "chat_id": "c", "agent_id": agent_id })),
        401,
    )
    .await;
    expect(
        "chat-gate",
        "unknown agent",
        http.get(format!(
            "{gate}/api/v1/agents/{}/context",
            uuid::Uuid::new_v4()
        ))
        .bearer_auth(TEST_TENANT_KEY),
        404,
    )
    .await;
    expect(
        "chat-gate",
        "turn over the body limit",
        http.post(format!("{gate}/api/v1/gate"))
            .bearer_auth(TEST_TENANT_KEY)
            .header(CONTENT_TYPE, "application/json")
            .body(vec![b' '; GATE_MAX_BODY_BYTES + 1]),
        413,
    )
    .await;
    let ticket: serde_json::Value = http
        .post(format!("{gate}/api/v1/events/ticket"))
        .bearer_auth(TEST_TENANT_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ticket = ticket["ticket"].as_str().expect("a ticket").to_owned();
    expect(
        "chat-gate",
        "event stream",
        http.get(format!("{gate}/api/v1/events?ticket={ticket}")),
        200,
    )
    .await;
    expect(
        "chat-gate",
        "event stream without a ticket",
        http.get(format!("{gate}/api/v1/events?ticket=nope")),
        401,
    )
    .await;

    // catalog: its MCP endpoint refuses a missing key and a body over rmcp's limit.
    let mcp = format!("{catalog_url}/mcp");
    let initialize = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": { "name": "nosniff", "version": "0" },
        },
    });
    let accept = "application/json, text/event-stream";
    expect(
        "catalog",
        "mcp initialize",
        http.post(&mcp)
            .bearer_auth(TEST_TENANT_KEY)
            .header("accept", accept)
            .json(&initialize),
        200,
    )
    .await;
    expect(
        "catalog",
        "mcp without a key",
        http.post(&mcp).header("accept", accept).json(&initialize),
        401,
    )
    .await;
    expect(
        "catalog",
        "mcp over the body limit",
        http.post(&mcp)
            .bearer_auth(TEST_TENANT_KEY)
            .header("accept", accept)
            .header(CONTENT_TYPE, "application/json")
            .body(vec![b' '; 4 * 1024 * 1024 + 1]),
        413,
    )
    .await;

    // workspace-agent: its operator listener, as the binary serves it.
    let home = tempfile::tempdir().unwrap();
    let workdir = tempfile::tempdir().unwrap();
    let token_file = home.path().join("token");
    std::fs::write(&token_file, &token).unwrap();
    let agent_addr = testkit::free_addr();
    let mut agent = testkit::ProcessBuilder::binary("workspace-agent", "workspace-agent")
        .env("CTXSYNC_INGEST_URL", &ingest)
        .env("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string())
        .env("CTXSYNC_WORKDIR", workdir.path().display().to_string())
        .env("CTXSYNC_HTTP_ADDR", agent_addr.to_string())
        .env("CTXSYNC_NO_WATCH", "true")
        .env("HOME", home.path().display().to_string())
        .spawn();
    agent.wait_ready(DEADLINE).await;
    let agent_url = base(agent_addr);
    for path in ["/healthz", "/readyz", "/metrics"] {
        expect(
            "workspace-agent",
            path,
            http.get(format!("{agent_url}{path}")),
            200,
        )
        .await;
    }
    expect(
        "workspace-agent",
        "unknown path",
        http.get(format!("{agent_url}/no-such-path")),
        404,
    )
    .await;
    agent.terminate(DEADLINE).await;

    shutdown.cancel();
    stack.join().await;
}
