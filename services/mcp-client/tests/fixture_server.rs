//! The client against our own fixture server in each of its modes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ctxsync_mcp::{
    ConnectOptions, Connection, McpError, Sanitizer, ServerSpec, TransportSpec, catalog_hash,
    discover,
};
use mcp_fixture::{HttpFixture, fixture_spec, live_pids, pid_alive, read_starts, wait_group_gone};
use serde_json::json;

const GENEROUS: Duration = Duration::from_secs(20);

fn options(handshake_timeout: Duration) -> ConnectOptions {
    ConnectOptions::new(handshake_timeout)
}

fn arguments(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match value {
        serde_json::Value::Object(map) => map,
        _ => panic!("arguments must be an object"),
    }
}

fn tool_names(tools: &[ctxsync_mcp::ToolDecl]) -> Vec<&str> {
    tools.iter().map(|t| t.name.as_str()).collect()
}

#[tokio::test]
async fn normal_server_lists_and_calls_tools() {
    let spec = fixture_spec("fixture", &["--mode", "normal"], &[]);
    let connection = Connection::connect(&spec, options(GENEROUS)).await.unwrap();
    let info = connection.server_info();
    assert_eq!(info.name, "mcp-fixture");
    assert!(!info.protocol_version.is_empty());

    let tools = connection.list_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["echo", "add"]);
    assert_eq!(tools[0].description, "Returns its text argument");
    assert_eq!(
        tools[0].input_schema_json,
        r#"{"properties":{"text":{"type":"string"}},"required":["text"],"type":"object"}"#
    );

    let echoed = connection
        .call_tool("echo", arguments(json!({"text": "hello there"})), GENEROUS)
        .await
        .unwrap();
    assert!(!echoed.is_error);
    assert_eq!(
        echoed.content_json,
        r#"[{"type":"text","text":"hello there"}]"#
    );

    let sum = connection
        .call_tool("add", arguments(json!({"a": 2, "b": 3})), GENEROUS)
        .await
        .unwrap();
    assert_eq!(sum.content_json, r#"[{"type":"text","text":"5"}]"#);

    let tool_error = connection
        .call_tool("add", arguments(json!({"a": "x"})), GENEROUS)
        .await
        .unwrap();
    assert!(
        tool_error.is_error,
        "a tool-level failure is flagged, not an Err"
    );

    let unknown = connection
        .call_tool("nope", serde_json::Map::new(), GENEROUS)
        .await
        .unwrap_err();
    assert!(matches!(unknown, McpError::Protocol { .. }), "{unknown}");
    assert!(
        unknown.to_string().contains("unknown tool nope"),
        "{unknown}"
    );

    let pid = connection.pid().expect("stdio connection has a pid");
    connection.close().await;
    assert!(!pid_alive(pid), "close() leaves no server process");
}

#[tokio::test]
async fn pagination_is_followed_to_the_last_page() {
    let paged = discover(&fixture_spec("paged", &["--page-size", "1"], &[]), GENEROUS)
        .await
        .unwrap();
    let whole = discover(&fixture_spec("whole", &[], &[]), GENEROUS)
        .await
        .unwrap();
    assert_eq!(tool_names(&paged.tools), ["echo", "add"]);
    assert_eq!(paged.tools, whole.tools);
    assert_eq!(catalog_hash(&paged.tools), catalog_hash(&whole.tools));
}

#[tokio::test]
async fn slow_start_within_the_timeout_succeeds() {
    let record = tempfile::tempdir().unwrap();
    let record_dir = record.path().to_str().unwrap();
    let spec = fixture_spec(
        "slow",
        &[
            "--mode",
            "slow-start",
            "--delay-ms",
            "700",
            "--record-dir",
            record_dir,
        ],
        &[],
    );
    let started = Instant::now();
    let discovery = discover(&spec, Duration::from_secs(10)).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(700));
    assert_eq!(tool_names(&discovery.tools), ["echo", "add"]);
    let starts = read_starts(record.path());
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert_eq!(starts[0].concurrent, 1);
    assert!(live_pids(record.path()).is_empty(), "the server has exited");
}

#[tokio::test]
async fn hung_server_times_out_and_its_process_group_is_gone() {
    let record = tempfile::tempdir().unwrap();
    let record_dir = record.path().to_str().unwrap();
    let spec = fixture_spec("hang", &["--mode", "hang", "--record-dir", record_dir], &[]);
    let bound = Duration::from_millis(800);
    let started = Instant::now();
    let error = Connection::connect(&spec, options(bound))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        matches!(error, McpError::Timeout { after } if after == bound),
        "{error}"
    );
    assert_eq!(error.to_string(), "no answer from the server within 800ms");
    assert!(elapsed >= bound, "{elapsed:?}");
    assert!(elapsed < bound + Duration::from_secs(2), "{elapsed:?}");

    let starts = read_starts(record.path());
    assert_eq!(starts.len(), 1, "{starts:?}");
    let pid = starts[0].pid;
    assert!(!pid_alive(pid), "the server itself is dead");
    let survivors = wait_group_gone(pid, Duration::from_secs(2)).await;
    assert!(
        survivors.is_empty(),
        "grandchildren survived: {survivors:?}"
    );
}

#[tokio::test]
async fn discover_is_bounded_by_its_timeout_too() {
    let spec = fixture_spec("hang", &["--mode", "hang"], &[]);
    let started = Instant::now();
    let error = discover(&spec, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(error, McpError::Timeout { .. }), "{error}");
    assert!(started.elapsed() < Duration::from_millis(2500));
}

#[tokio::test]
async fn crashing_server_reports_its_exit_status_and_stderr() {
    let spec = fixture_spec("crash", &["--mode", "crash"], &[]);
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    match &error {
        McpError::Exited {
            status,
            stderr_tail,
        } => {
            assert_eq!(status, "exit status: 3");
            assert_eq!(stderr_tail, "mcp-fixture: crashing at start as asked");
        }
        other => panic!("expected Exited, got {other:?}"),
    }
    assert_eq!(
        error.to_string(),
        "server exited during the handshake (exit status: 3); stderr: mcp-fixture: crashing at start as asked"
    );
}

#[tokio::test]
async fn control_characters_on_stderr_are_cleaned_from_the_error() {
    let spec = fixture_spec("nul", &["--mode", "crash-nul"], &[]);
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    match &error {
        McpError::Exited { stderr_tail, .. } => assert_eq!(
            stderr_tail,
            "mcp-fixture: \u{fffd}\u{fffd}bad bytes\u{fffd} before failing\u{fffd}"
        ),
        other => panic!("expected Exited, got {other:?}"),
    }
    let text = Sanitizer::for_server(&spec).sanitize(&error.to_string());
    assert!(!text.chars().any(|c| c.is_control()), "{text:?}");
}

#[tokio::test]
async fn tool_texts_are_cleaned_of_control_characters() {
    let spec = fixture_spec("nul", &["--mode", "nul-tools"], &[]);
    let discovery = discover(&spec, GENEROUS).await.unwrap();
    let tools = &discovery.tools;
    assert_eq!(tool_names(tools), ["echo", "add"]);
    assert_eq!(
        tools[0].description,
        "Returns its text\u{fffd} argument, loudly\u{fffd}"
    );
    assert_eq!(tools[1].description, "Adds\u{fffd} two\nnumbers\u{fffd}");
    // The schema is JSON text: its NUL is the escape `\u0000`, storable as is.
    assert!(
        tools[0].input_schema_json.contains(r#""the text\u0000""#),
        "{}",
        tools[0].input_schema_json
    );
    for tool in tools {
        for text in [&tool.name, &tool.description, &tool.input_schema_json] {
            assert!(!text.contains('\0'), "{text:?}");
        }
    }
}

#[tokio::test]
async fn missing_command_names_the_command() {
    let spec = ServerSpec {
        name: "missing".into(),
        transport: TransportSpec::Stdio {
            command: "ctxsync-no-such-mcp-server".into(),
            args: vec![],
            env: BTreeMap::new(),
            cwd: None,
        },
    };
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    assert!(matches!(error, McpError::Spawn { .. }), "{error:?}");
    assert_eq!(
        error.to_string(),
        "cannot start `ctxsync-no-such-mcp-server`: command not found on PATH: ctxsync-no-such-mcp-server"
    );
}

#[tokio::test]
async fn missing_working_directory_is_reported_as_such() {
    let mut spec = fixture_spec("cwd", &[], &[]);
    if let TransportSpec::Stdio { cwd, .. } = &mut spec.transport {
        *cwd = Some("/nonexistent/ctxsync-workdir".into());
    }
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("working directory /nonexistent/ctxsync-workdir does not exist"),
        "{error}"
    );
}

#[tokio::test]
async fn zero_tools_is_a_valid_outcome() {
    let discovery = discover(
        &fixture_spec("empty", &["--mode", "zero-tools"], &[]),
        GENEROUS,
    )
    .await
    .unwrap();
    assert!(discovery.tools.is_empty());
    assert_eq!(discovery.server_info.name, "mcp-fixture");
}

#[tokio::test]
async fn changed_tools_are_notified_and_relisted() {
    let dir = tempfile::tempdir().unwrap();
    let tools_file = dir.path().join("tools.json");
    std::fs::write(
        &tools_file,
        r#"[{"name": "alpha", "description": "first"}]"#,
    )
    .unwrap();
    let spec = fixture_spec(
        "changing",
        &[
            "--mode",
            "changing-tools",
            "--tools-file",
            tools_file.to_str().unwrap(),
            "--watch",
        ],
        &[],
    );
    let (sender, mut changes) = tokio::sync::mpsc::unbounded_channel();
    let connection = Connection::connect(
        &spec,
        ConnectOptions {
            tools_changed: Some(sender),
            ..ConnectOptions::new(GENEROUS)
        },
    )
    .await
    .unwrap();
    let before = connection.list_tools().await.unwrap();
    assert_eq!(tool_names(&before), ["alpha"]);

    std::fs::write(
        &tools_file,
        r#"[{"name": "alpha", "description": "first"}, {"name": "beta", "description": "second"}]"#,
    )
    .unwrap();
    let changed = tokio::time::timeout(Duration::from_secs(10), changes.recv())
        .await
        .expect("list_changed notification within 10s")
        .expect("channel open");
    assert_eq!(changed, "changing");

    let after = connection.list_tools().await.unwrap();
    assert_eq!(tool_names(&after), ["alpha", "beta"]);
    assert_ne!(catalog_hash(&before), catalog_hash(&after));
    connection.close().await;
}

#[tokio::test]
async fn secret_error_is_fully_sanitized() {
    let url =
        "https://svc-user:svc-pass-9@api.example.test:8443/v1/tenant-4242?token=query-secret-1";
    let url_arg = format!("--url={url}");
    let spec = fixture_spec(
        "secret",
        &["--mode", "secret-error", &url_arg, "positional9secret2"],
        &[
            ("FIXTURE_API_TOKEN", "env-secret-value-3"),
            ("FIXTURE_PLAIN", "configured-value-4"),
        ],
    );
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    let raw = error.to_string();
    let secrets = [
        "svc-user",
        "svc-pass-9",
        "tenant-4242",
        "query-secret-1",
        "positional9secret2",
        "env-secret-value-3",
        "configured-value-4",
    ];
    // The raw text really carries them: otherwise this test could not fail.
    for secret in secrets {
        assert!(raw.contains(secret), "raw error lacks {secret}: {raw}");
    }
    let sanitized = Sanitizer::for_server(&spec).sanitize(&raw);
    for secret in secrets {
        assert!(!sanitized.contains(secret), "{secret} leaked: {sanitized}");
    }
    assert!(sanitized.contains("refused the credentials"), "{sanitized}");
    assert!(
        sanitized.contains("api.example.test:8443"),
        "host stays: {sanitized}"
    );
    assert!(sanitized.contains("[redacted]"), "{sanitized}");
}

#[tokio::test]
async fn dropping_a_connection_kills_the_process_group() {
    let spec = fixture_spec("dropped", &[], &[]);
    let connection = Connection::connect(&spec, options(GENEROUS)).await.unwrap();
    let pid = connection.pid().unwrap();
    assert!(pid_alive(pid));
    drop(connection);
    let survivors = wait_group_gone(pid, Duration::from_secs(3)).await;
    assert!(survivors.is_empty(), "{survivors:?}");
}

#[tokio::test]
async fn streamable_http_transport_lists_and_calls() {
    let server = HttpFixture::start(&["--page-size", "1"]).await;
    let spec = server.spec("http-fixture");
    assert_eq!(spec.transport.kind().as_str(), "streamable_http");
    let connection = Connection::connect(&spec, options(GENEROUS)).await.unwrap();
    assert_eq!(connection.server_info().name, "mcp-fixture");
    assert_eq!(connection.pid(), None);
    let tools = connection.list_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["echo", "add"]);
    let echoed = connection
        .call_tool("echo", arguments(json!({"text": "over http"})), GENEROUS)
        .await
        .unwrap();
    assert_eq!(
        echoed.content_json,
        r#"[{"type":"text","text":"over http"}]"#
    );
    connection.close().await;

    let discovery = discover(&spec, GENEROUS).await.unwrap();
    assert_eq!(discovery.tools, tools);
    server.stop().await;
}

#[tokio::test]
async fn unreachable_http_server_error_is_sanitized() {
    // A port nobody listens on.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!(
        "http://alice-user:wonderland-7@127.0.0.1:{port}/mcp/tenant-path-8?api_key=query-secret-9"
    );
    let spec = ServerSpec {
        name: "unreachable".into(),
        transport: TransportSpec::StreamableHttp {
            url: url.clone(),
            headers: BTreeMap::from([(
                "Authorization".to_string(),
                "Bearer header-token-10".to_string(),
            )]),
        },
    };
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    let raw = error.to_string();
    assert!(matches!(error, McpError::Transport { .. }), "{error:?}");
    assert!(
        raw.contains("wonderland-7") || raw.contains("tenant-path-8"),
        "raw text has the URL: {raw}"
    );
    let sanitized = Sanitizer::for_server(&spec).sanitize(&raw);
    for secret in [
        "alice-user",
        "wonderland-7",
        "query-secret-9",
        "header-token-10",
    ] {
        assert!(!sanitized.contains(secret), "{secret} leaked: {sanitized}");
    }
    // The structure around the secrets stays: scheme, host, port, path, query key.
    assert!(
        sanitized.contains(&format!(
            "http://127.0.0.1:{port}/mcp/tenant-path-8?api_key=[redacted]"
        )),
        "{sanitized}"
    );
    assert!(
        sanitized.contains("Connection refused"),
        "the cause stays: {sanitized}"
    );
}

#[tokio::test]
async fn invalid_header_value_is_rejected_without_echoing_it() {
    let spec = ServerSpec {
        name: "bad-header".into(),
        transport: TransportSpec::StreamableHttp {
            url: "http://127.0.0.1:9/mcp".into(),
            headers: BTreeMap::from([("X-Key".to_string(), "line\nbreak-secret".to_string())]),
        },
    };
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    assert!(matches!(error, McpError::InvalidSpec { .. }), "{error:?}");
    assert!(!error.to_string().contains("break-secret"), "{error}");
    assert!(error.to_string().contains("X-Key"), "{error}");
}

fn sse_spec(name: &str, url: &str) -> ServerSpec {
    ServerSpec {
        name: name.into(),
        transport: TransportSpec::Sse {
            url: url.into(),
            headers: BTreeMap::new(),
        },
    }
}

#[tokio::test]
async fn legacy_sse_transport_lists_and_calls() {
    let server = HttpFixture::start_sse(&[]).await;
    assert!(server.url().ends_with("/sse"), "{}", server.url());
    let spec = sse_spec("sse-fixture", server.url());
    assert_eq!(spec.transport.name(), "sse");
    assert_eq!(
        spec.transport.to_proto(),
        ctxsync_proto::v1::McpTransport::Sse
    );
    let connection = Connection::connect(&spec, options(GENEROUS)).await.unwrap();
    assert_eq!(connection.server_info().name, "mcp-fixture");
    let tools = connection.list_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["echo", "add"]);
    let echoed = connection
        .call_tool("echo", arguments(json!({"text": "over sse"})), GENEROUS)
        .await
        .unwrap();
    assert_eq!(
        echoed.content_json,
        r#"[{"type":"text","text":"over sse"}]"#
    );
    connection.close().await;
    server.stop().await;
}

#[tokio::test]
async fn a_streamable_http_url_that_answers_4xx_falls_back_to_legacy_sse() {
    let server = HttpFixture::start_sse(&[]).await;
    let spec = ServerSpec {
        name: "fallback".into(),
        transport: TransportSpec::StreamableHttp {
            url: server.url().to_owned(),
            headers: BTreeMap::new(),
        },
    };
    let discovery = discover(&spec, GENEROUS).await.unwrap();
    assert_eq!(tool_names(&discovery.tools), ["echo", "add"]);
    server.stop().await;
}

#[tokio::test]
async fn an_unreachable_sse_server_says_so_and_keeps_the_url_readable() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let spec = sse_spec(
        "gone",
        &format!("http://127.0.0.1:{port}/v1/sse?token=sse-token-42"),
    );
    let error = Connection::connect(&spec, options(GENEROUS))
        .await
        .unwrap_err();
    let sanitized = Sanitizer::for_server(&spec).sanitize(&error.to_string());
    assert!(!sanitized.contains("sse-token-42"), "{sanitized}");
    assert!(
        sanitized.starts_with(&format!(
            "transport error: GET http://127.0.0.1:{port}/v1/sse?token=[redacted]: "
        )),
        "{sanitized}"
    );
    assert!(sanitized.contains("Connection refused"), "{sanitized}");
}

/// An HTTP server is asked in its own era: the 2026-07-28 one statelessly
/// after `server/discover`, the 2025 one (no `server/discover`) through
/// `initialize`; both list and call alike.
#[tokio::test]
async fn http_servers_of_either_protocol_era_are_discovered_and_called() {
    for (protocols, expected) in [("stateless", "2026-07-28"), ("sessions", "2025-11-25")] {
        let server = HttpFixture::start(&["--protocols", protocols, "--page-size", "1"]).await;
        let spec = server.spec("http-fixture");
        let connection = Connection::connect(&spec, options(GENEROUS))
            .await
            .unwrap_or_else(|e| panic!("{protocols}: {e}"));
        assert_eq!(
            connection.server_info().protocol_version,
            expected,
            "{protocols}: the revision agreed on"
        );
        let tools = connection.list_tools().await.unwrap();
        assert_eq!(tool_names(&tools), ["echo", "add"], "{protocols}");
        let echoed = connection
            .call_tool("echo", arguments(json!({"text": protocols})), GENEROUS)
            .await
            .unwrap();
        assert_eq!(
            echoed.content_json,
            format!(r#"[{{"type":"text","text":"{protocols}"}}]"#),
            "{protocols}"
        );
        connection.close().await;
        let discovery = discover(&spec, GENEROUS).await.unwrap();
        assert_eq!(discovery.tools, tools, "{protocols}");
        server.stop().await;
    }
}
