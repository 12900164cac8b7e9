//! Memory, preparation and calls against a real nats-server, a real Postgres
//! database and real MCP servers (the fixture): one end-to-end test per
//! rule across real processes. The rules themselves (pin, withdraw, forget,
//! the reuse window, requests refused) are tested in process, on paused
//! time, in `services/catalog/core/tests/rules.rs`.

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::Message;
use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{CatalogCallReply, CatalogCallRequest, CatalogEvent, CatalogPrepareReply};
use futures::StreamExt;

const PINNED: i32 = Source::Pinned as i32;
const CONNECTED: i32 = Source::Connected as i32;
const FAILED: i32 = Source::Failed as i32;

#[tokio::test]
async fn a_remembered_server_is_pinned_without_starting_it() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![fixture("fx", record.path(), &[])]).await;

    let first = harness.prepare("acme", "s1").await;
    assert_eq!(error_code(&first.error), "");
    assert_eq!(sources(&first), [("fx".to_owned(), CONNECTED)]);
    let tools: Vec<_> = first.pins[0]
        .tools
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(tools, ["echo", "add"]);
    assert_eq!(mcp_fixture::read_starts(record.path()).len(), 1);

    let second = harness.prepare("acme", "s2").await;
    assert_eq!(sources(&second), [("fx".to_owned(), PINNED)]);
    assert_eq!(second.pins[0].catalog_hash, first.pins[0].catalog_hash);
    assert_eq!(second.pins[0].tools, first.pins[0].tools);
    assert_eq!(
        mcp_fixture::read_starts(record.path()).len(),
        1,
        "pinning from memory started no process"
    );
    let pinned = harness.events_of("mcp.server.pinned").await;
    assert_eq!(pinned.len(), 1);
    assert_eq!(pinned[0].0.as_deref(), Some("s2"));
    assert_eq!(pinned[0].2["transport"], "stdio");
    let connected = harness.events_of("mcp.server.connected").await;
    assert_eq!(connected.len(), 1);
    assert_eq!(connected[0].0.as_deref(), Some("s1"));
    assert!(connected[0].2["duration_ms"].is_u64());
    harness.stop().await;
}

#[tokio::test]
async fn a_config_change_is_a_different_entry() {
    let record = tempfile::tempdir().unwrap();
    let original = || tenants(vec![("acme", vec![fixture("fx", record.path(), &[])])]);
    let changed = || {
        let mut server = fixture("fx", record.path(), &[]);
        server.classification = Some("restricted".into());
        tenants(vec![("acme", vec![server])])
    };
    let harness = Harness::start(original(), settings()).await;
    assert_eq!(
        sources(&harness.prepare("acme", "s1").await),
        [("fx".to_owned(), CONNECTED)]
    );
    assert_eq!(
        sources(&harness.prepare("acme", "s2").await),
        [("fx".to_owned(), PINNED)]
    );

    harness.running().reload(changed()).unwrap();
    assert_eq!(
        sources(&harness.prepare("acme", "s3").await),
        [("fx".to_owned(), CONNECTED)],
        "a changed classification is not the remembered entry"
    );
    assert_eq!(mcp_fixture::read_starts(record.path()).len(), 2);

    harness.running().reload(original()).unwrap();
    assert_eq!(
        sources(&harness.prepare("acme", "s4").await),
        [("fx".to_owned(), PINNED)],
        "the original config's entry is still remembered"
    );
    assert_eq!(mcp_fixture::read_starts(record.path()).len(), 2);
    assert_eq!(
        harness
            .count("SELECT count(DISTINCT server_key) FROM catalog.generations")
            .await,
        2,
        "each config has its own history"
    );
    harness.stop().await;
}

fn write_tools(path: &std::path::Path, tools: &[(&str, &str)]) {
    let json: Vec<_> = tools
        .iter()
        .map(|(name, description)| serde_json::json!({"name": name, "description": description}))
        .collect();
    std::fs::write(path, serde_json::to_vec(&json).unwrap()).unwrap();
}

#[tokio::test]
async fn a_failed_live_discovery_at_preparation_is_reported_sanitized_and_forgotten() {
    let record = tempfile::tempdir().unwrap();
    let secret = "hunter2-very-secret-token";
    let spec = mcp_fixture::fixture_spec(
        "bad",
        &[
            "--mode",
            "secret-error",
            "--record-dir",
            &record.path().display().to_string(),
        ],
        &[("FIXTURE_TOKEN", secret)],
    );
    let harness = Harness::start_acme(vec![
        server("bad", &spec),
        fixture("ok", record.path(), &[]),
    ])
    .await;
    let reply = harness.prepare("acme", "s1").await;
    assert_eq!(error_code(&reply.error), "");
    assert_eq!(
        sources(&reply),
        [("bad".to_owned(), FAILED), ("ok".to_owned(), CONNECTED)]
    );
    let message = &reply.pins[0].error;
    assert!(!message.is_empty());
    assert!(!message.contains(secret), "{message}");
    harness.events_written().await;
    let events: Vec<String> = sqlx::query_scalar("SELECT payload::text FROM catalog.events")
        .fetch_all(&harness.pool)
        .await
        .unwrap();
    assert!(events.iter().all(|e| !e.contains(secret)));
    assert_eq!(harness.running().remembered(), 1);
    assert_eq!(
        harness.count("SELECT count(*) FROM catalog.pins").await,
        1,
        "a failed server is not pinned"
    );
    let call = harness
        .call("acme", "s1", "bad", "echo", serde_json::json!({}))
        .await;
    assert_eq!(error_code(&call.error), "server.not_pinned");
    harness.stop().await;
}

/// NUL in a tool description or in a server's stderr would fail every
/// Postgres write carrying it (text and jsonb refuse it): the client cleans it.
#[tokio::test]
async fn servers_whose_output_holds_nul_are_stored_cleaned_and_pinned() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![
        fixture("described", record.path(), &["--mode", "nul-tools"]),
        fixture("crashing", record.path(), &["--mode", "crash-nul"]),
    ])
    .await;
    let first = harness.prepare("acme", "s1").await;
    assert_eq!(error_code(&first.error), "", "{:?}", first.error);
    assert_eq!(
        sources(&first),
        [
            ("described".to_owned(), CONNECTED),
            ("crashing".to_owned(), FAILED)
        ]
    );
    let descriptions: Vec<&str> = first.pins[0]
        .tools
        .iter()
        .map(|t| t.description.as_str())
        .collect();
    assert_eq!(
        descriptions,
        [
            "Returns its text\u{fffd} argument, loudly\u{fffd}",
            "Adds\u{fffd} two\nnumbers\u{fffd}"
        ]
    );
    let failure = &first.pins[1].error;
    assert!(
        failure.contains("\u{fffd}\u{fffd}bad bytes\u{fffd} before failing"),
        "{failure}"
    );
    let stored: Vec<(String, String)> =
        sqlx::query_as("SELECT name, description FROM catalog.generation_tools ORDER BY position")
            .fetch_all(&harness.pool)
            .await
            .unwrap();
    let expected: Vec<(String, String)> = first.pins[0]
        .tools
        .iter()
        .map(|t| (t.name.clone(), t.description.clone()))
        .collect();
    assert_eq!(stored, expected);
    assert_eq!(harness.events_of("mcp.server.connected").await.len(), 1);

    let second = harness.prepare("acme", "s2").await;
    assert_eq!(second.pins[0].source, PINNED);
    assert_eq!(second.pins[0].tools, first.pins[0].tools);
    let call = harness
        .call(
            "acme",
            "s2",
            "described",
            "echo",
            serde_json::json!({"text": "hi"}),
        )
        .await;
    assert!(call.ok, "{:?}", call.error);
    harness.stop().await;
}

#[tokio::test]
async fn the_first_call_starts_a_pinned_server_and_its_transport_stays_open() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![fixture("fx", record.path(), &[])]).await;
    let mut connected_events = testkit::subscribe(
        &harness.client,
        harness.subjects.catalog_event("mcp.server.connected"),
    )
    .await;
    harness.prepare("acme", "s1").await;
    assert_eq!(
        sources(&harness.prepare("acme", "s2").await),
        [("fx".to_owned(), PINNED)]
    );
    assert_eq!(mcp_fixture::read_starts(record.path()).len(), 1);
    assert!(
        eventually(Duration::from_secs(10), || mcp_fixture::live_pids(
            record.path()
        )
        .is_empty())
        .await,
        "discovery closed its server (in the background)"
    );

    let reply = harness
        .call(
            "acme",
            "s2",
            "fx",
            "echo",
            serde_json::json!({"text": "hello"}),
        )
        .await;
    assert!(reply.ok, "{reply:?}");
    assert!(reply.content_json.contains("hello"));
    assert_eq!(
        mcp_fixture::read_starts(record.path()).len(),
        2,
        "the first call started the server"
    );
    let reply = harness
        .call(
            "acme",
            "s2",
            "fx",
            "add",
            serde_json::json!({"a": 2, "b": 3}),
        )
        .await;
    assert!(reply.ok && reply.content_json.contains('5'), "{reply:?}");
    assert_eq!(
        mcp_fixture::read_starts(record.path()).len(),
        2,
        "later calls reuse the transport"
    );
    assert_eq!(
        mcp_fixture::live_pids(record.path()).len(),
        1,
        "the session's server runs"
    );
    assert_eq!(harness.running().open_transports(), 1);

    // The preparation's connect and the call's connect, both published.
    let mut causes = Vec::new();
    for _ in 0..2 {
        let message = tokio::time::timeout(Duration::from_secs(10), connected_events.next())
            .await
            .expect("a connected event")
            .unwrap();
        let event = CatalogEvent::decode(message.payload).unwrap();
        let payload: serde_json::Value = serde_json::from_str(&event.payload_json).unwrap();
        assert_eq!(event.payload_version, 1);
        assert_eq!(payload["transport"], "stdio");
        assert!(payload["duration_ms"].is_u64());
        causes.push((
            event.session_id,
            payload["cause"].as_str().unwrap().to_owned(),
        ));
    }
    assert_eq!(
        causes,
        [
            ("s1".into(), "preparation".into()),
            ("s2".into(), "call".into())
        ]
    );

    let ended = harness.end_session("acme", "s2").await;
    assert_eq!(ended.released, 1);
    assert!(
        eventually(Duration::from_secs(10), || mcp_fixture::live_pids(
            record.path()
        )
        .is_empty())
        .await,
        "ending the session stopped the server"
    );
    assert_eq!(harness.running().open_transports(), 0);
    harness.stop().await;
}

#[tokio::test]
async fn idle_sessions_release_their_transports() {
    let record = tempfile::tempdir().unwrap();
    let mut settings = settings();
    settings.session_idle_timeout = Duration::from_millis(300);
    let harness = Harness::start(
        tenants(vec![("acme", vec![fixture("fx", record.path(), &[])])]),
        settings,
    )
    .await;
    harness.prepare("acme", "s1").await;
    let reply = harness
        .call("acme", "s1", "fx", "echo", serde_json::json!({"text": "x"}))
        .await;
    assert!(reply.ok);
    assert!(
        eventually(Duration::from_secs(10), || mcp_fixture::live_pids(
            record.path()
        )
        .is_empty())
        .await,
        "the idle session's server was stopped"
    );
    // A later call starts it again and says so.
    let reply = harness
        .call("acme", "s1", "fx", "echo", serde_json::json!({"text": "y"}))
        .await;
    assert!(reply.ok);
    let connected = harness.events_of("mcp.server.connected").await;
    let causes: Vec<_> = connected
        .iter()
        .map(|(_, _, p)| p["cause"].as_str().unwrap())
        .collect();
    assert_eq!(
        causes,
        ["preparation", "call", "call"],
        "the reconnect emitted mcp.server.connected"
    );
    harness.stop().await;
}

#[tokio::test]
async fn tools_changed_between_pin_and_call_are_withdrawn_or_unadvertised() {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    write_tools(
        &tools_file,
        &[("echo", "Echo"), ("add", "Add"), ("gone", "Soon removed")],
    );
    let file = tools_file.display().to_string();
    let harness = Harness::start_acme(vec![fixture(
        "fx",
        record.path(),
        &["--mode", "changing-tools", "--tools-file", &file],
    )])
    .await;
    let mut changed_events = testkit::subscribe(
        &harness.client,
        harness.subjects.catalog_event("mcp.catalog.changed"),
    )
    .await;
    let pin = harness.prepare("acme", "s1").await;
    assert_eq!(pin.pins[0].tools.len(), 3);

    // Between pin and first call: `add` changes, `gone` goes, `new` arrives.
    write_tools(
        &tools_file,
        &[
            ("echo", "Echo"),
            ("add", "Add, now differently"),
            ("new", "New"),
        ],
    );

    let echo = harness
        .call(
            "acme",
            "s1",
            "fx",
            "echo",
            serde_json::json!({"text": "still here"}),
        )
        .await;
    assert!(echo.ok, "an unchanged tool still works: {echo:?}");
    let add = harness
        .call(
            "acme",
            "s1",
            "fx",
            "add",
            serde_json::json!({"a": 1, "b": 1}),
        )
        .await;
    assert_eq!(error_code(&add.error), "tool.withdrawn", "{add:?}");
    let gone = harness
        .call("acme", "s1", "fx", "gone", serde_json::json!({}))
        .await;
    assert_eq!(error_code(&gone.error), "tool.withdrawn");
    let new = harness
        .call("acme", "s1", "fx", "new", serde_json::json!({}))
        .await;
    assert_eq!(
        error_code(&new.error),
        "tool.not_found",
        "an added tool stays unadvertised"
    );

    let message = tokio::time::timeout(Duration::from_secs(10), changed_events.next())
        .await
        .expect("mcp.catalog.changed published")
        .unwrap();
    let event = CatalogEvent::decode(message.payload).unwrap();
    let payload: serde_json::Value = serde_json::from_str(&event.payload_json).unwrap();
    assert_eq!(event.server_id, "fx");
    assert_eq!(payload["previous_hash"], pin.pins[0].catalog_hash.as_str());
    assert_ne!(payload["catalog_hash"], pin.pins[0].catalog_hash.as_str());
    assert_eq!(payload["added"], serde_json::json!(["new"]));
    assert_eq!(payload["removed"], serde_json::json!(["gone"]));
    assert_eq!(payload["changed"], serde_json::json!(["add"]));
    assert_eq!(
        harness.events_of("mcp.catalog.changed").await.len(),
        1,
        "stored once"
    );
    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.generations")
            .await,
        2,
        "the new generation is in the history"
    );
    harness.stop().await;
}

#[tokio::test]
async fn a_tools_list_changed_notification_mid_session_withdraws_the_changed_tool() {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    write_tools(&tools_file, &[("echo", "Echo"), ("add", "Add")]);
    let file = tools_file.display().to_string();
    let harness = Harness::start_acme(vec![fixture(
        "fx",
        record.path(),
        &["--mode", "changing-tools", "--tools-file", &file, "--watch"],
    )])
    .await;
    let mut changed_events = testkit::subscribe(
        &harness.client,
        harness.subjects.catalog_event("mcp.catalog.changed"),
    )
    .await;
    harness.prepare("acme", "s1").await;
    assert!(
        harness
            .call("acme", "s1", "fx", "echo", serde_json::json!({"text": "a"}))
            .await
            .ok
    );
    write_tools(&tools_file, &[("echo", "Echo changed")]);
    // The server notifies; the next call re-lists. Retry the call until the
    // notification has arrived (bounded), which the changed event proves.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = harness
            .call("acme", "s1", "fx", "echo", serde_json::json!({"text": "b"}))
            .await;
        if error_code(&reply.error) == "tool.withdrawn" {
            break;
        }
        assert!(reply.ok, "{reply:?}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the change was never seen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let message = tokio::time::timeout(Duration::from_secs(5), changed_events.next())
        .await
        .expect("mcp.catalog.changed published")
        .unwrap();
    let payload: serde_json::Value =
        serde_json::from_str(&CatalogEvent::decode(message.payload).unwrap().payload_json).unwrap();
    assert_eq!(payload["removed"], serde_json::json!(["add"]));
    assert_eq!(payload["changed"], serde_json::json!(["echo"]));
    harness.stop().await;
}

#[tokio::test]
async fn an_unreachable_server_answers_tool_server_unreachable() {
    let web = mcp_fixture::HttpFixture::start(&[]).await;
    let mut web_config = http("web", web.url());
    if let ctxsync_mcp::TransportSpec::StreamableHttp { headers, .. } = &mut web_config.transport {
        headers.insert(
            "Authorization".into(),
            "Bearer top-secret-header-value".into(),
        );
    }
    let harness = Harness::start_acme(vec![web_config]).await;
    let pin = harness.prepare("acme", "s1").await;
    assert_eq!(sources(&pin), [("web".to_owned(), CONNECTED)]);
    let url = web.url().to_owned();
    web.stop().await;

    let reply = harness
        .call(
            "acme",
            "s1",
            "web",
            "echo",
            serde_json::json!({"text": "x"}),
        )
        .await;
    assert_eq!(
        error_code(&reply.error),
        "tool.server_unreachable",
        "{reply:?}"
    );
    let message = &reply.error.as_ref().unwrap().message;
    assert!(!message.contains("top-secret-header-value"), "{message}");
    // A URL without credentials is no secret: the user sees where it failed.
    assert!(message.contains(&url), "the URL stays readable: {message}");
    let called = harness.events_of("mcp.tool.called").await;
    assert_eq!(called.len(), 1);
    assert_eq!(called[0].2["outcome"], "server_unreachable");
    harness.stop().await;
}

#[tokio::test]
async fn a_failure_on_the_nth_server_commits_nothing() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![
        fixture("first", record.path(), &[]),
        fixture("second", record.path(), &[]),
        fixture("third", record.path(), &["--mode", "zero-tools"]),
        fixture("fourth", record.path(), &[]),
    ])
    .await;
    // A real database failure at the third server's write.
    sqlx::raw_sql(
        "CREATE FUNCTION fail_third() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.server_id = 'third' THEN RAISE EXCEPTION 'injected failure at the third server'; END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER fail_third BEFORE INSERT ON catalog.generations
           FOR EACH ROW EXECUTE FUNCTION fail_third();",
    )
    .execute(&harness.pool)
    .await
    .unwrap();

    let reply = harness.prepare("acme", "s1").await;
    assert_eq!(error_code(&reply.error), "catalog.internal", "{reply:?}");
    assert!(reply.pins.is_empty());
    for table in [
        "sessions",
        "pins",
        "generations",
        "generation_tools",
        "events",
    ] {
        let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM catalog.{table}"
        )))
        .fetch_one(&harness.pool)
        .await
        .unwrap();
        assert_eq!(
            count, 0,
            "catalog.{table} holds nothing of the failed preparation"
        );
    }

    sqlx::raw_sql("DROP TRIGGER fail_third ON catalog.generations")
        .execute(&harness.pool)
        .await
        .unwrap();
    let reply = harness.prepare("acme", "s1").await;
    assert_eq!(error_code(&reply.error), "");
    assert_eq!(reply.pins.len(), 4);
    assert!(
        reply.pins.iter().all(|p| p.source == PINNED),
        "the discoveries were remembered"
    );
    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.generations")
            .await,
        4
    );
    let servers: Vec<String> = sqlx::query_scalar(
        "SELECT server_id FROM catalog.events WHERE kind = 'mcp.server.pinned' ORDER BY id",
    )
    .fetch_all(&harness.pool)
    .await
    .unwrap();
    assert_eq!(
        servers,
        ["first", "second", "third", "fourth"],
        "events in configured-server order"
    );
    harness.stop().await;
}

#[tokio::test]
async fn a_generation_is_written_once_however_many_sessions_pin_it() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![
        fixture("a", record.path(), &[]),
        fixture("b", record.path(), &["--mode", "zero-tools"]),
    ])
    .await;
    let replies = futures::future::join_all((0..10).map(|i| {
        let harness = &harness;
        async move { harness.prepare("acme", &format!("s{i}")).await }
    }))
    .await;
    assert!(
        replies
            .iter()
            .all(|r| r.error.is_none() && r.pins.len() == 2)
    );
    for i in 10..20 {
        harness.prepare("acme", &format!("s{i}")).await;
    }
    // The same session asked again concurrently is prepared once.
    let again = futures::future::join_all((0..5).map(|_| harness.prepare("acme", "s0"))).await;
    assert!(again.iter().all(|r| r.follow_up && r.pins.len() == 2));

    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.generations")
            .await,
        2
    );
    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.generation_tools")
            .await,
        2,
        "echo and add, once"
    );
    assert_eq!(
        harness.count("SELECT count(*) FROM catalog.sessions").await,
        20
    );
    assert_eq!(harness.count("SELECT count(*) FROM catalog.pins").await, 40);
    harness.stop().await;
}

#[tokio::test]
async fn concurrent_first_preparations_from_memory_write_one_session_whole() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![
        fixture("a", record.path(), &[]),
        fixture("b", record.path(), &[]),
    ])
    .await;
    // Discovered and written once: what follows pins from memory, each
    // session in one statement.
    let live = harness.prepare("acme", "live").await;
    assert!(live.error.is_none(), "{live:?}");
    let replies = futures::future::join_all((0..6).map(|_| harness.prepare("acme", "new"))).await;
    assert!(replies.iter().all(|r| r.error.is_none()), "{replies:?}");
    let first: Vec<_> = replies.iter().filter(|r| !r.follow_up).collect();
    assert_eq!(first.len(), 1, "one preparation writes it: {replies:?}");
    assert!(first[0].pins.iter().all(|p| p.source == PINNED));
    let hashes = |reply: &CatalogPrepareReply| {
        reply
            .pins
            .iter()
            .map(|p| (p.server_id.clone(), p.catalog_hash.clone()))
            .collect::<Vec<_>>()
    };
    assert!(
        replies.iter().all(|r| hashes(r) == hashes(first[0])),
        "every answer names the written pins: {replies:?}"
    );
    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.sessions WHERE session_id = 'new'")
            .await,
        1
    );
    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.pins WHERE session_id = 'new'")
            .await,
        2
    );
    let positions: Vec<(i32, String)> = sqlx::query_as(
        "SELECT position, server_id FROM catalog.pins WHERE session_id = 'new' ORDER BY position",
    )
    .fetch_all(&harness.pool)
    .await
    .unwrap();
    assert_eq!(positions, [(0, "a".to_owned()), (1, "b".to_owned())]);
    // The writer's events, in order, and the prepared event last.
    let kinds: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT kind, server_id FROM catalog.events
         WHERE session_id = 'new' AND coalesce(payload->>'follow_up', 'false') = 'false'
         ORDER BY id",
    )
    .fetch_all(&harness.pool)
    .await
    .unwrap();
    assert_eq!(
        kinds,
        [
            ("mcp.server.pinned".to_owned(), Some("a".to_owned())),
            ("mcp.server.pinned".to_owned(), Some("b".to_owned())),
            ("catalog.session.prepared".to_owned(), None),
        ]
    );
    harness.stop().await;
}

#[tokio::test]
async fn a_result_over_the_servers_limit_is_refused_by_name() {
    let record = tempfile::tempdir().unwrap();
    let mut small = fixture("fx", record.path(), &[]);
    small.limits.max_content_bytes = 64;
    let harness = Harness::start_acme(vec![small]).await;
    harness.prepare("acme", "s1").await;
    let fits = harness
        .call(
            "acme",
            "s1",
            "fx",
            "echo",
            serde_json::json!({"text": "short"}),
        )
        .await;
    assert!(fits.ok, "{fits:?}");
    let long = "x".repeat(200);
    let refused = harness
        .call(
            "acme",
            "s1",
            "fx",
            "echo",
            serde_json::json!({ "text": long }),
        )
        .await;
    assert_eq!(error_code(&refused.error), "tool.result_too_large");
    let message = &refused.error.as_ref().unwrap().message;
    assert!(message.contains("max_content_bytes = 64"), "{message}");
    assert!(!message.contains(&long));
    harness.stop().await;
}

/// The tenant is the subject's (which NATS permissions confine): a session
/// prepared for one tenant cannot be called or ended on another tenant's
/// subject, and a body naming another tenant than its subject is refused.
#[tokio::test]
async fn a_session_is_bound_to_the_tenant_of_its_subject() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start(
        tenants(vec![
            ("acme", vec![fixture("fx", record.path(), &[])]),
            ("globex", vec![fixture("fx", record.path(), &[])]),
        ]),
        settings(),
    )
    .await;
    let prepared = harness.prepare("acme", "s1").await;
    assert_eq!(prepared.error, None);
    let echo = serde_json::json!({"text": "hi"});

    let foreign = harness
        .call("globex", "s1", "fx", "echo", echo.clone())
        .await;
    assert_eq!(
        error_code(&foreign.error),
        "session.not_prepared",
        "{foreign:?}"
    );
    let ended = harness.end_session("globex", "s1").await;
    assert_eq!(ended.released, 0);

    let smuggled: CatalogCallReply = ctxsync_runtime::rpc::request(
        &harness.client,
        harness.subjects.catalog_call("globex"),
        &CatalogCallRequest {
            tenant: "acme".into(),
            session_id: "s1".into(),
            server_id: "fx".into(),
            tool: "echo".into(),
            arguments_json: echo.to_string(),
            ..Default::default()
        },
        None,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(
        error_code(&smuggled.error),
        "request.invalid",
        "{smuggled:?}"
    );
    assert!(
        smuggled
            .error
            .unwrap()
            .message
            .contains("differs from the subject's tenant"),
    );
    assert_eq!(
        harness
            .count("SELECT count(*) FROM catalog.sessions WHERE tenant = 'globex'")
            .await,
        0
    );

    let own = harness.call("acme", "s1", "fx", "echo", echo).await;
    assert!(own.ok, "{own:?}");
    harness.stop().await;
}
