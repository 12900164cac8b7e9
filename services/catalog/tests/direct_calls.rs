//! Calls of 2025 MCP sessions that `/mcp` answers itself
//! (design note: the catalog as an MCP server), in raw HTTP so each answer's shape
//! is seen: a session whose client declared neither elicitation nor
//! sampling has its `tools/call` answered as `application/json`, or as an
//! SSE stream when progress comes first, exactly as rmcp's session worker
//! answers the same call for a session it must keep (whose client may be
//! asked questions); a `notifications/cancelled` reaches the upstream, and
//! a client that goes away does not end its call; what
//! the endpoint does not take is answered as rmcp answers it; and a session
//! in use never idles out while an unused one does.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Harness, eventually, fixture, metric, server, settings, tenants};
use reqwest::StatusCode;
use serde_json::{Value, json};

const VERSION: &str = "2025-11-25";
const DEADLINE: Duration = Duration::from_secs(20);

/// A 2025 session opened by hand.
struct Raw {
    http: reqwest::Client,
    url: String,
    key: String,
    id: String,
}

/// An answer: its status, content type and the JSON-RPC messages it held
/// (the body's JSON, or each SSE event's data).
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    content_type: String,
    messages: Vec<Value>,
}

impl Raw {
    async fn open(harness: &Harness, key: &str, capabilities: Value) -> Self {
        let http = reqwest::Client::new();
        let url = format!("http://{}/mcp", harness.running().http_addr());
        let initialize = json!({
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {
                "protocolVersion": VERSION,
                "capabilities": capabilities,
                "clientInfo": {"name": "direct-calls-test", "version": "1"},
            },
        });
        let response = http
            .post(&url)
            .bearer_auth(key)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(initialize.to_string())
            .send()
            .await
            .expect("initialize is answered");
        assert_eq!(response.status(), StatusCode::OK);
        let id = response
            .headers()
            .get("mcp-session-id")
            .expect("a session id")
            .to_str()
            .unwrap()
            .to_owned();
        let raw = Self {
            http,
            url,
            key: key.to_owned(),
            id,
        };
        let initialized = raw
            .post(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        assert_eq!(initialized.status, StatusCode::ACCEPTED);
        raw
    }

    fn request(&self, body: String) -> reqwest::RequestBuilder {
        self.request_of(VERSION, body)
    }

    fn request_of(&self, version: &str, body: String) -> reqwest::RequestBuilder {
        self.http
            .post(&self.url)
            .bearer_auth(&self.key)
            .header("mcp-session-id", &self.id)
            .header("mcp-protocol-version", version)
            .header("content-type", "application/json")
            .body(body)
    }

    async fn post(&self, body: Value) -> Answer {
        let request = self
            .request(body.to_string())
            .header("accept", "application/json, text/event-stream");
        answer(request).await
    }

    async fn call(&self, id: u64, tool: &str, arguments: Value) -> Answer {
        self.post(json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments},
        }))
        .await
    }
}

async fn answer(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("the endpoint answers");
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = response.text().await.expect("a body");
    let messages = if content_type.starts_with("text/event-stream") {
        text.lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(str::trim)
            .filter(|data| !data.is_empty())
            .map(|data| serde_json::from_str(data).expect("an event is JSON"))
            .collect()
    } else if content_type.starts_with("application/json") {
        vec![serde_json::from_str(&text).expect("a JSON body")]
    } else {
        Vec::new()
    };
    Answer {
        status,
        content_type,
        messages,
    }
}

/// A catalog serving `servers` to tenant `acme`, with a store for its keys.
async fn catalog(
    servers: Vec<catalog::config::ServerConfig>,
    settings: catalog::Settings,
) -> Harness {
    Harness::start_with_store(tenants(vec![("acme", servers)]), settings).await
}

async fn direct(harness: &Harness, answer: &str) -> f64 {
    metric(
        harness.running(),
        &format!("ctxsync_catalog_mcp_direct_total{{answer=\"{answer}\"}}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_answered_as_json_alike_the_sdks_answer_to_a_session_it_keeps() {
    let record = tempfile::tempdir().unwrap();
    let harness = catalog(vec![fixture("fx", record.path(), &[])], settings()).await;
    let key = harness.tenant_key("acme").await;
    let plain = Raw::open(&harness, &key, json!({})).await;
    let asked = Raw::open(&harness, &key, json!({"sampling": {}})).await;

    let here = plain.call(7, "fx__echo", json!({"text": "hi"})).await;
    assert_eq!(here.status, StatusCode::OK);
    assert_eq!(here.content_type, "application/json", "{here:?}");
    let kept = asked.call(7, "fx__echo", json!({"text": "hi"})).await;
    assert_eq!(kept.status, StatusCode::OK);
    assert!(
        kept.content_type.starts_with("text/event-stream"),
        "{kept:?}"
    );

    // The same JSON-RPC answer, word for word: a 2025 result has no
    // `resultType`.
    assert_eq!(here.messages.len(), 1, "{here:?}");
    let result = kept.messages.last().expect("the sdk's answer");
    assert_eq!(&here.messages[0], result);
    assert_eq!(
        here.messages[0]["result"],
        json!({"content": [{"type": "text", "text": "hi"}], "isError": false})
    );
    // A tool the session did not pin: the same tool error both ways.
    let unknown_here = plain.call(8, "fx__nope", json!({})).await;
    let unknown_kept = asked.call(8, "fx__nope", json!({})).await;
    assert_eq!(
        &unknown_here.messages[0],
        unknown_kept.messages.last().unwrap()
    );
    assert_eq!(unknown_here.messages[0]["result"]["isError"], true);

    // The counter is the process's (tests of this binary run at once).
    assert!(direct(&harness, "json").await >= 2.0);
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_progress_streams_before_its_result() {
    let everything = server("everything", &mcp_fixture::reference::everything());
    let harness = catalog(vec![everything], settings()).await;
    let key = harness.tenant_key("acme").await;
    let session = Raw::open(&harness, &key, json!({})).await;
    let answer = session
        .post(json!({
            "jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {
                "name": "everything__trigger-long-running-operation",
                "arguments": {"duration": 1, "steps": 4},
                "_meta": {"progressToken": "steps"},
            },
        }))
        .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer.content_type.starts_with("text/event-stream"),
        "{answer:?}"
    );
    let (result, steps) = answer.messages.split_last().expect("messages");
    let progress: Vec<f64> = steps
        .iter()
        .map(|step| {
            assert_eq!(step["method"], "notifications/progress", "{step}");
            assert_eq!(step["params"]["progressToken"], "steps", "{step}");
            step["params"]["progress"].as_f64().unwrap()
        })
        .collect();
    assert_eq!(progress, [1.0, 2.0, 3.0, 4.0], "{answer:?}");
    assert_eq!(result["id"], 3, "{result}");
    assert_eq!(result["result"]["isError"], false, "{result}");
    assert!(direct(&harness, "stream").await >= 1.0);
    harness.stop().await;
}

/// A catalog whose server `slow` has a tool `sleep`, and a session of it
/// whose preparation's discovery process is gone (a call starts its own).
async fn sleeper() -> (tempfile::TempDir, Harness, Arc<Raw>) {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    std::fs::write(&tools_file, r#"[{"name":"sleep","description":"Sleeps"}]"#).unwrap();
    let tools = tools_file.display().to_string();
    let slow = fixture(
        "slow",
        record.path(),
        &["--mode", "changing-tools", "--tools-file", &tools],
    );
    let harness = catalog(vec![slow], settings()).await;
    let key = harness.tenant_key("acme").await;
    let session = Arc::new(Raw::open(&harness, &key, json!({})).await);
    let discovered = eventually(DEADLINE, || {
        mcp_fixture::live_pids(record.path()).is_empty()
    })
    .await;
    assert!(discovered, "the discovery's process exits");
    (record, harness, session)
}

/// A call `id` of `sleep` for `ms`, once its server is at it.
async fn sleeping(
    session: &Arc<Raw>,
    record: &tempfile::TempDir,
    id: u64,
    ms: u64,
) -> tokio::task::JoinHandle<Answer> {
    let call = tokio::spawn({
        let session = session.clone();
        async move { session.call(id, "slow__sleep", json!({"ms": ms})).await }
    });
    let sleeping = eventually(DEADLINE, || {
        !mcp_fixture::read_sleeping(record.path()).is_empty()
    })
    .await;
    assert!(sleeping, "the call reaches its server");
    call
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_reaches_the_upstream() {
    let (record, harness, session) = sleeper().await;
    let started = tokio::time::Instant::now();
    // Cancelled once the server is at it.
    let call = sleeping(&session, &record, 5, 20_000).await;
    let cancelled = session
        .post(json!({
            "jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": 5, "reason": "the user stopped it"},
        }))
        .await;
    assert_eq!(cancelled.status, StatusCode::ACCEPTED);

    let answer = call.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the call ends at the cancellation, not the sleep's end"
    );
    assert_eq!(answer.messages[0]["result"]["isError"], true, "{answer:?}");
    let told = eventually(DEADLINE, || {
        mcp_fixture::read_cancellations(record.path()).len() == 1
    })
    .await;
    assert!(
        told,
        "the upstream was told of the cancellation: {answer:?}"
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_does_not_end_its_call() {
    let (record, harness, session) = sleeper().await;
    let call = sleeping(&session, &record, 7, 1500).await;
    // The client gives up: its request's connection closes mid-call.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    let ok = "ctxsync_catalog_calls_total{outcome=\"ok\"}";
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while metric(harness.running(), ok).await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the call ends with its server's result"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        mcp_fixture::read_cancellations(record.path()).is_empty(),
        "the upstream was not told to cancel"
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_endpoint_does_not_take_is_answered_as_the_sdk_answers_it() {
    let record = tempfile::tempdir().unwrap();
    let harness = catalog(vec![fixture("fx", record.path(), &[])], settings()).await;
    let key = harness.tenant_key("acme").await;
    let plain = Raw::open(&harness, &key, json!({})).await;
    let asked = Raw::open(&harness, &key, json!({"elicitation": {}})).await;

    let call = json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "fx__echo", "arguments": {"text": "x"}},
    });
    for what in [
        "accepts JSON only",
        "is not JSON",
        "names a revision without sessions",
    ] {
        let odd = |raw: &Raw| match what {
            "accepts JSON only" => raw
                .request(call.to_string())
                .header("accept", "application/json"),
            "is not JSON" => raw
                .request("{not json".into())
                .header("accept", "application/json, text/event-stream"),
            _ => raw
                .request_of("2026-07-28", call.to_string())
                .header("accept", "application/json, text/event-stream"),
        };
        let here = answer(odd(&plain)).await;
        let kept = answer(odd(&asked)).await;
        assert_eq!(here.status, kept.status, "a request that {what}");
        assert_eq!(
            here.content_type, kept.content_type,
            "a request that {what}"
        );
        assert_eq!(here.messages, kept.messages, "a request that {what}");
    }
    // Other methods are the SDK's, on either session.
    let listed = plain
        .post(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}))
        .await;
    assert!(listed.content_type.starts_with("text/event-stream"));
    assert!(listed.messages.last().unwrap()["result"]["tools"].is_array());
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_in_use_never_idles_out_and_an_unused_one_does() {
    let record = tempfile::tempdir().unwrap();
    let mut settings = settings();
    settings.mcp_sessions.idle = Duration::from_millis(800);
    let harness = catalog(vec![fixture("fx", record.path(), &[])], settings).await;
    let key = harness.tenant_key("acme").await;
    let session = Raw::open(&harness, &key, json!({})).await;

    // Calls answered by the endpoint itself, over three idle bounds.
    let until = tokio::time::Instant::now() + Duration::from_millis(2400);
    let mut id = 0;
    while tokio::time::Instant::now() < until {
        id += 1;
        let answer = session
            .call(id, "fx__echo", json!({"text": "still here"}))
            .await;
        assert_eq!(answer.status, StatusCode::OK, "call {id}: {answer:?}");
        assert_eq!(answer.content_type, "application/json");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Left alone, it ends.
    let mut ended = false;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !ended && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        ended = metric(harness.running(), "ctxsync_catalog_mcp_sessions_idle_total").await >= 1.0;
    }
    assert!(ended, "the unused session idled out");
    id += 1;
    let after = session.call(id, "fx__echo", json!({"text": "gone"})).await;
    assert_eq!(after.status, StatusCode::NOT_FOUND);
    harness.stop().await;
}
