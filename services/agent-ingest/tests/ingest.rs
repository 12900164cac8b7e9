//! agent-ingest over real HTTP, in front of a real snapshot-store, NATS and Postgres.

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;
use ctxsync_runtime::Shutdown;
use prost::Message;
use reqwest::StatusCode;
use serde_json::json;
use testkit::report::{instruction, pending};
use testkit::stack::{Stack, StackBuilder, Started, TestStack};
use testkit::store::StoreClient;
use testkit::{NatsServer, TestDatabase};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMEOUT: Duration = Duration::from_secs(10);
const RUN: &str = "6f1c7a52-37a8-4c1e-9a51-0d7c9e1b2a33";

struct Harness {
    _nats: NatsServer,
    _db: TestDatabase,
    subjects: Subjects,
    client: async_nats::Client,
    /// The store's NATS API, through `client`.
    api: StoreClient,
    store_shutdown: Shutdown,
    store: Option<snapshot_store::RunningStore>,
    base: String,
    http: reqwest::Client,
    _shutdown: Shutdown,
    /// agent-ingest, running until `_shutdown` is cancelled.
    _stack: Stack,
}

impl Harness {
    async fn spawn() -> Self {
        let TestStack { nats, db, prefix } = TestStack::private().await;
        let shutdown = Shutdown::new();
        let mut stack = testkit::stack::start(
            StackBuilder::new(nats.url(), &prefix)
                .database(db.url())
                .store(|_| {})
                .ingest(|config| config.store_timeout = Duration::from_secs(2)),
            &shutdown,
        )
        .await;
        // The store has a shutdown of its own: a test stops it alone.
        let Started {
            running: store,
            shutdown: store_shutdown,
        } = stack.stores.remove(0);
        let ingest = stack.ingest();
        let base = format!("http://{}", ingest.http_addr());
        let client = async_nats::connect(nats.url()).await.unwrap();
        let subjects = Subjects::new(&prefix).unwrap();
        Self {
            _nats: nats,
            _db: db,
            api: StoreClient::new(client.clone(), subjects.clone(), TIMEOUT, "ws"),
            subjects,
            client,
            store_shutdown,
            store: Some(store),
            base,
            http: reqwest::Client::new(),
            _shutdown: shutdown,
            _stack: stack,
        }
    }

    /// Registers an agent with `token` and returns its id.
    async fn register(&self, name: &str, token: &str) -> String {
        self.api.register(name, token).await
    }

    async fn state(&self, agent_id: &str) -> AgentState {
        self.api.state(agent_id).await
    }

    async fn post_proto(
        &self,
        path: &str,
        token: Option<&str>,
        body: Vec<u8>,
    ) -> reqwest::Response {
        let mut request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-protobuf")
            .body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send().await.unwrap()
    }

    /// A JSON body, as `application/json`.
    async fn post_json(
        &self,
        path: &str,
        token: &str,
        body: serde_json::Value,
    ) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn push(&self, token: &str, push: &PushContextStateRequest) -> reqwest::Response {
        self.post_proto(
            "/api/v1/agent/context-state",
            Some(token),
            push.encode_to_vec(),
        )
        .await
    }

    /// One series' value in ingest's `/metrics` (0 before its first sample).
    async fn metric(&self, series: &str) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .map_or(0.0, |value| value.trim().parse().unwrap())
    }

    async fn startup(&self, token: &str, run_id: &str) -> reqwest::Response {
        let startup = StartupRequest {
            agent_run_id: run_id.into(),
            agent_version: "1.0".into(),
            ..Default::default()
        };
        self.post_proto(
            "/api/v1/agent/startup",
            Some(token),
            startup.encode_to_vec(),
        )
        .await
    }
}

/// A pending push of `RUN` without a context config.
fn push(version: u64, resources: Vec<ContextResource>) -> PushContextStateRequest {
    PushContextStateRequest {
        context_config: None,
        ..pending(RUN, version, resources)
    }
}

/// The JSON error body, asserting its code and (when given) its limit.
async fn expect_error(
    response: reqwest::Response,
    status: StatusCode,
    code: &str,
    limit: Option<&str>,
) -> String {
    assert_eq!(response.status(), status);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    if let Some(limit) = limit {
        assert_eq!(body["error"]["limit"], limit, "{body}");
    }
    body["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn startup_and_push_round_trip_in_protobuf() {
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    let response = h.startup("tok-a", RUN).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "application/x-protobuf");
    let startup = StartupResponse::decode(response.bytes().await.unwrap()).unwrap();
    assert!(startup.run_id_changed);

    let response = h
        .push(
            "tok-a",
            &push(1, vec![instruction("/w/AGENTS.md", "hello")]),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let answer = PushContextStateResponse::decode(response.bytes().await.unwrap()).unwrap();
    assert!(answer.accepted);
    let state = h.state(&agent).await;
    assert_eq!(state.snapshot.unwrap().agent_run_id, RUN);
    assert_eq!(state.resources, vec![instruction("/w/AGENTS.md", "hello")]);
}

#[tokio::test]
async fn protobuf_fields_from_the_future_are_accepted_dropped_and_counted() {
    use prost::encoding::{WireType, encode_key, encode_varint};
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    let series = |message: &str| {
        format!(r#"ctxsync_ingest_unknown_fields_total{{message="ctxsync.v1.{message}"}}"#)
    };
    let counted = |message: &'static str| {
        let series = series(message);
        let h = &h;
        async move { h.metric(&series).await }
    };
    let before = [
        counted("StartupRequest").await,
        counted("PushContextStateRequest").await,
        counted("ContextResource").await,
    ];

    // A newer agent's startup: field 99 is a varint this ingest does not know.
    let mut startup = StartupRequest {
        agent_run_id: RUN.into(),
        agent_version: "2.0".into(),
        ..Default::default()
    }
    .encode_to_vec();
    encode_key(99, WireType::Varint, &mut startup);
    encode_varint(1, &mut startup);
    let response = h
        .post_proto("/api/v1/agent/startup", Some("tok-a"), startup)
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let state = h.state(&agent).await;
    assert_eq!(state.agent.as_ref().unwrap().agent_version, "2.0");

    // Its push: a new message-typed field 7 at the top, and resources[1]
    // with a new string field 99.
    let mut body = push(1, vec![instruction("/w/AGENTS.md", "hello")]).encode_to_vec();
    let mut resource = instruction("/w/CLAUDE.md", "hi").encode_to_vec();
    prost::encoding::string::encode(99, &"from the future".to_owned(), &mut resource);
    prost::encoding::bytes::encode(5, &resource, &mut body);
    prost::encoding::bytes::encode(7, &vec![0x08, 0x01], &mut body);
    let response = h
        .post_proto("/api/v1/agent/context-state", Some("tok-a"), body)
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let answer = PushContextStateResponse::decode(response.bytes().await.unwrap()).unwrap();
    assert!(answer.accepted, "{answer:?}");
    // Stored as this version of the contract knows it: without the new fields.
    let state = h.state(&agent).await;
    assert_eq!(state.snapshot.unwrap().version, 1);
    assert_eq!(
        state.resources,
        vec![
            instruction("/w/AGENTS.md", "hello"),
            instruction("/w/CLAUDE.md", "hi")
        ]
    );

    // One each, by the message type that does not define it.
    let after = [
        counted("StartupRequest").await,
        counted("PushContextStateRequest").await,
        counted("ContextResource").await,
    ];
    assert_eq!(
        after,
        [before[0] + 1.0, before[1] + 1.0, before[2] + 1.0],
        "{before:?}"
    );
}

#[tokio::test]
async fn json_bodies_use_the_proto3_json_mapping() {
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    let response = h
        .post_json(
            "/api/v1/agent/startup",
            "tok-a",
            json!({ "agentRunId": RUN, "agentVersion": "1.0" }),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["run_id_changed"], true);

    let response = h
        .post_json("/api/v1/agent/context-state", "tok-a", json!({
            "agent_run_id": RUN,
            "version": "1",
            "initial": true,
            "mcpDiscovery": { "phase": "PHASE_COMPLETE" },
            "resources": [{
                "source": "skill:/w/.agents/skills/review",
                "kind": "RESOURCE_KIND_SKILL",
                "status": "RESOURCE_STATUS_OK",
                "skill": { "dir": "/w/.agents/skills/review", "name": "review", "description": "Reviews code" }
            }]
        }))
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["accepted"], true);
    let state = h.state(&agent).await;
    assert_eq!(state.snapshot.unwrap().phase(), Phase::Complete);
    assert_eq!(state.resources[0].source, "skill:/w/.agents/skills/review");

    // Unknown fields (unlike protobuf's: a JSON name is typed by hand) and
    // enum values are refused with the reason.
    let response = h
        .post_json(
            "/api/v1/agent/context-state",
            "tok-a",
            json!({ "agentRunId": RUN, "color": "blue" }),
        )
        .await;
    let message = expect_error(response, StatusCode::BAD_REQUEST, "malformed", None).await;
    assert!(message.contains("color"), "{message}");
    let response = h
        .post_json(
            "/api/v1/agent/context-state",
            "tok-a",
            json!({ "agentRunId": RUN, "mcpDiscovery": { "phase": "PHASE_DONE" } }),
        )
        .await;
    expect_error(response, StatusCode::BAD_REQUEST, "malformed", None).await;
}

#[tokio::test]
async fn missing_malformed_and_unknown_tokens_are_refused() {
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    let body = push(1, vec![]).encode_to_vec();
    let response = h
        .post_proto("/api/v1/agent/context-state", None, body.clone())
        .await;
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    expect_error(response, StatusCode::UNAUTHORIZED, "unauthenticated", None).await;
    let response = h.push("tok-unknown", &push(1, vec![])).await;
    let message = expect_error(response, StatusCode::UNAUTHORIZED, "unauthenticated", None).await;
    assert_eq!(message, "unknown agent token");
    let response = h
        .http
        .post(format!("{}/api/v1/agent/startup", h.base))
        .header("authorization", "Basic dG9rLWE=")
        .header("content-type", "application/x-protobuf")
        .send()
        .await
        .unwrap();
    expect_error(response, StatusCode::UNAUTHORIZED, "unauthenticated", None).await;
    assert!(h.state(&agent).await.snapshot.is_none());
}

#[tokio::test]
async fn a_token_only_ever_writes_its_own_agent() {
    let h = Harness::spawn().await;
    let a = h.register("a", "tok-a").await;
    let b = h.register("b", "tok-b").await;
    h.startup("tok-b", RUN).await;
    let b_before = h.state(&b).await;
    // The agent is named by the token alone: there is no way to address b with a's token.
    assert_eq!(
        h.startup("tok-a", "other-run").await.status(),
        StatusCode::OK
    );
    assert_eq!(
        h.push("tok-a", &push(1, vec![instruction("/a", "x")]))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(h.state(&b).await, b_before);
    assert_eq!(h.state(&a).await.agent.unwrap().agent_run_id, "other-run");
}

/// Every limit is refused with its name, and nothing is written.
#[tokio::test]
async fn every_limit_is_refused_by_name_and_writes_nothing() {
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    h.startup("tok-a", RUN).await;
    h.push("tok-a", &push(1, vec![instruction("/w/AGENTS.md", "kept")]))
        .await;
    let before = h.state(&agent).await;

    let long_run = "r".repeat(65);
    let response = h.startup("tok-a", &long_run).await;
    expect_error(
        response,
        StatusCode::BAD_REQUEST,
        "limit_exceeded",
        Some("agent_run_id_bytes"),
    )
    .await;
    let mut p = push(2, vec![]);
    p.agent_run_id = long_run;
    let response = h.push("tok-a", &p).await;
    let message = expect_error(
        response,
        StatusCode::BAD_REQUEST,
        "limit_exceeded",
        Some("agent_run_id_bytes"),
    )
    .await;
    assert!(
        message.contains("65 bytes") && message.contains("64"),
        "{message}"
    );

    let many = (0..1001)
        .map(|i| instruction(&format!("/f{i}"), "x"))
        .collect();
    let response = h.push("tok-a", &push(2, many)).await;
    expect_error(
        response,
        StatusCode::BAD_REQUEST,
        "limit_exceeded",
        Some("resources_count"),
    )
    .await;

    let big = instruction("/big", &"x".repeat(256 * 1024 + 1));
    let response = h.push("tok-a", &push(2, vec![big])).await;
    expect_error(
        response,
        StatusCode::BAD_REQUEST,
        "limit_exceeded",
        Some("resource_body_bytes"),
    )
    .await;

    let mut long_source = instruction("/s", "x");
    long_source.source = "s".repeat(1025);
    let response = h.push("tok-a", &push(2, vec![long_source])).await;
    expect_error(
        response,
        StatusCode::BAD_REQUEST,
        "limit_exceeded",
        Some("source_bytes"),
    )
    .await;

    let mut long_error = instruction("/e", "x");
    long_error.error = "e".repeat(4097);
    let response = h.push("tok-a", &push(2, vec![long_error])).await;
    expect_error(
        response,
        StatusCode::BAD_REQUEST,
        "limit_exceeded",
        Some("error_bytes"),
    )
    .await;

    let response = h
        .push(
            "tok-a",
            &push(2, vec![instruction("/d", "1"), instruction("/d", "2")]),
        )
        .await;
    let message = expect_error(response, StatusCode::BAD_REQUEST, "invalid", None).await;
    assert!(message.contains("duplicate source"), "{message}");

    let mut unknown_status = instruction("/u", "x");
    unknown_status.status = 99;
    let response = h.push("tok-a", &push(2, vec![unknown_status])).await;
    let message = expect_error(response, StatusCode::BAD_REQUEST, "invalid", None).await;
    assert!(message.contains("99"), "{message}");

    let response = h
        .post_proto(
            "/api/v1/agent/context-state",
            Some("tok-a"),
            vec![0xff, 0xff, 0xff],
        )
        .await;
    expect_error(response, StatusCode::BAD_REQUEST, "malformed", None).await;

    let response = h
        .http
        .post(format!("{}/api/v1/agent/context-state", h.base))
        .bearer_auth("tok-a")
        .header("content-type", "text/plain")
        .body("hello")
        .send()
        .await
        .unwrap();
    expect_error(
        response,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        None,
    )
    .await;

    // Over 4 MiB in total, each resource within its own limit.
    let huge: Vec<_> = (0..20)
        .map(|i| instruction(&format!("/h{i}"), &"h".repeat(250 * 1024)))
        .collect();
    let response = h.push("tok-a", &push(2, huge)).await;
    expect_error(
        response,
        StatusCode::PAYLOAD_TOO_LARGE,
        "limit_exceeded",
        Some("request_bytes"),
    )
    .await;

    assert_eq!(h.state(&agent).await, before);
}

#[tokio::test]
async fn an_oversized_declared_body_is_refused_before_it_is_read() {
    let h = Harness::spawn().await;
    h.register("a", "tok-a").await;
    let addr = h.base.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    // Declare 5 MiB and send none of it: the answer must come anyway.
    let head = format!(
        "POST /api/v1/agent/context-state HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer tok-a\r\n\
         content-type: application/x-protobuf\r\ncontent-length: {}\r\n\r\n",
        5 * 1024 * 1024
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 1024];
    let n = tokio::time::timeout(TIMEOUT, stream.read(&mut answer))
        .await
        .expect("answered without the body")
        .unwrap();
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("request_bytes"), "{text}");
}

#[tokio::test]
async fn store_unavailable_answers_503_with_a_retry_hint() {
    let mut h = Harness::spawn().await;
    h.register("a", "tok-a").await;
    // Authenticate once so the token is cached, then stop the store.
    assert_eq!(h.startup("tok-a", RUN).await.status(), StatusCode::OK);
    h.store_shutdown.cancel();
    h.store.take().unwrap().join().await;

    let response = h.push("tok-a", &push(1, vec![])).await;
    assert_eq!(response.headers()["retry-after"], "1");
    let message = expect_error(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "unavailable",
        None,
    )
    .await;
    assert!(message.contains("snapshot-store"), "{message}");
    // An unknown token cannot be checked either: 503, not 401.
    let response = h.push("tok-new", &push(1, vec![])).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn stale_pushes_answer_200_with_the_drop_reason() {
    let h = Harness::spawn().await;
    h.register("a", "tok-a").await;
    h.startup("tok-a", RUN).await;
    let mut old = push(1, vec![]);
    old.agent_run_id = "previous-process".into();
    let response = h.push("tok-a", &old).await;
    assert_eq!(response.status(), StatusCode::OK);
    let answer = PushContextStateResponse::decode(response.bytes().await.unwrap()).unwrap();
    assert!(!answer.accepted);
    assert_eq!(answer.drop_reason(), PushDropReason::StaleRun);
}

#[tokio::test]
async fn health_readiness_and_metrics_are_served() {
    let h = Harness::spawn().await;
    let get = |path: &str| h.http.get(format!("{}{path}", h.base)).send();
    assert_eq!(get("/healthz").await.unwrap().status(), StatusCode::OK);
    let ready = get("/readyz").await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(body["checks"]["nats"], "ok");
    h.register("a", "tok-a").await;
    h.startup("tok-a", RUN).await;
    let metrics = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("ctxsync_ingest_requests_total"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_push_trace_id_reaches_the_discovery_event() {
    use futures::StreamExt;
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    h.startup("tok-a", RUN).await;
    let mut events = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let response = h
        .http
        .post(format!("{}/api/v1/agent/context-state", h.base))
        .bearer_auth("tok-a")
        .header("content-type", "application/x-protobuf")
        .header("traceparent", parent)
        .body(push(1, vec![]).encode_to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let event = tokio::time::timeout(TIMEOUT, events.next())
        .await
        .expect("event")
        .unwrap();
    let trace = ctxsync_runtime::trace::TraceContext::from_nats(event.headers.as_ref())
        .expect("the event carries a traceparent");
    assert_eq!(trace.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
}

#[tokio::test]
async fn a_push_near_the_request_limit_is_committed_whole() {
    let h = Harness::spawn().await;
    let agent = h.register("a", "tok-a").await;
    h.startup("tok-a", RUN).await;
    // 15 × 240 KiB ≈ 3.5 MiB: under every limit, over NATS's default 1 MiB payload.
    let files: Vec<_> = (0..15)
        .map(|i| instruction(&format!("/big{i}"), &"b".repeat(240 * 1024)))
        .collect();
    let response = h.push("tok-a", &push(1, files.clone())).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        PushContextStateResponse::decode(response.bytes().await.unwrap())
            .unwrap()
            .accepted
    );
    assert_eq!(h.state(&agent).await.resources, files);
}
