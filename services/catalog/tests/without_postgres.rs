//! What the catalog answers while Postgres is down, on a Postgres server of
//! the test's own, killed and restarted. Its events are written in the
//! background, off the answers: calls are answered while it is down, their
//! events land once it is back (each with the time of its call), a full
//! queue drops and counts rather than delays, and a shutdown writes what is
//! queued. A warm `/mcp` list, of a 2025 session or by a 2026-07-28 pin
//! handle, is answered from memory: with Postgres down, and with it up
//! without running one statement (counted by `pg_stat_statements`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use catalog::Settings;
use common::{Harness, fixture, settings, tenants};
use ctxsync_mcp::{ConnectOptions, Connection};
use testkit::{NatsServer, PrivatePostgres};

/// The `mcp.tool.called` events stored, read on the test's own connection
/// (the harness's pool would wait for the killed server's connections).
async fn calls_stored(url: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.expect("postgres is up");
    let count =
        sqlx::query_scalar("SELECT count(*) FROM catalog.events WHERE kind = 'mcp.tool.called'")
            .fetch_one(&pool)
            .await
            .expect("count the calls");
    pool.close().await;
    count
}

/// The process's count of dropped events (this binary's tests are the only
/// ones that fill a queue, and only this one does).
fn dropped_so_far() -> f64 {
    testkit::metrics::Metrics::from_text(ctxsync_runtime::metrics::handle().render())
        .sum("ctxsync_catalog_events_dropped_total", &[])
}

async fn echo(harness: &Harness, text: &str) {
    let reply = harness
        .call(
            "acme",
            "s1",
            "fx",
            "echo",
            serde_json::json!({ "text": text }),
        )
        .await;
    assert!(reply.ok, "{reply:?}");
}

/// A catalog with one fixture server, its session `s1` prepared and
/// called once (the call opens the server: later calls write nothing but
/// their event).
async fn started(postgres: &PrivatePostgres, settings: Settings) -> (Harness, tempfile::TempDir) {
    let record = tempfile::tempdir().unwrap();
    let nats = Arc::new(NatsServer::start());
    let harness = Harness::start_on_url(
        nats,
        postgres.url(),
        tenants(vec![("acme", vec![fixture("fx", record.path(), &[])])]),
        settings,
        true,
    )
    .await;
    assert_eq!(harness.prepare("acme", "s1").await.error, None);
    echo(&harness, "before").await;
    harness.events_written().await;
    assert_eq!(calls_stored(&postgres.url()).await, 1);
    (harness, record)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_answered_while_postgres_is_down_and_their_events_land_when_it_is_back() {
    let mut postgres = PrivatePostgres::start().await;
    let (harness, _record) = started(&postgres, settings()).await;

    postgres.kill_hard();
    let called_at = chrono::Utc::now();
    for i in 0..20 {
        echo(&harness, &format!("while down {i}")).await;
    }
    postgres.restart().await;
    harness.events_written().await;
    assert_eq!(calls_stored(&postgres.url()).await, 21);

    // Each keeps the time of its call, not of its write.
    let pool = sqlx::PgPool::connect(&postgres.url()).await.unwrap();
    let latest: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT max(occurred_at) FROM catalog.events WHERE kind = 'mcp.tool.called'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let restarted_at = chrono::Utc::now();
    assert!(
        latest >= called_at,
        "{latest} before the calls at {called_at}"
    );
    assert!(latest <= restarted_at, "{latest} after {restarted_at}");
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_drops_and_counts_events_and_never_delays_an_answer() {
    let mut postgres = PrivatePostgres::start().await;
    let bound = 5;
    let (harness, _record) = started(
        &postgres,
        Settings {
            event_queue: bound,
            ..settings()
        },
    )
    .await;

    postgres.kill_hard();
    let dropped_before = dropped_so_far();
    let calls = 20;
    for i in 0..calls {
        echo(&harness, &format!("while down {i}")).await;
    }
    let dropped = dropped_so_far() - dropped_before;
    postgres.restart().await;
    harness.events_written().await;
    // The writer holds at most one queue's worth in its retried batch,
    // besides the queue itself.
    let kept = calls_stored(&postgres.url()).await - 1;
    assert!(
        (bound as i64 + 1..=2 * bound as i64).contains(&kept),
        "{kept} of {calls} events kept with a queue of {bound}"
    );
    assert_eq!(
        dropped,
        (calls - kept) as f64,
        "every dropped event is counted"
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_writes_the_events_still_queued() {
    let mut postgres = PrivatePostgres::start().await;
    let (mut harness, _record) = started(&postgres, settings()).await;

    postgres.kill_hard();
    for i in 0..10 {
        echo(&harness, &format!("while down {i}")).await;
    }
    // Back, and at once the shutdown: the writer is between two retries
    // when it is told to finish, and writes what it holds within the grace.
    postgres.restart().await;
    harness.stop_catalog().await;
    assert_eq!(calls_stored(&postgres.url()).await, 11);
    harness.stop().await;
}

fn names(tools: Vec<ctxsync_mcp::ToolDecl>) -> Vec<String> {
    let mut names: Vec<String> = tools.into_iter().map(|t| t.name).collect();
    names.sort();
    names
}

/// A 2025 session (its pins stored at its initialize) and a 2026-07-28
/// stateless client (its first list pinned the memory under a handle), each
/// with the tools it listed once.
async fn warm_clients(harness: &Harness) -> Vec<(Connection, Vec<String>)> {
    let store = testkit::store::StoreClient::new(
        harness.client.clone(),
        harness.subjects.clone(),
        Duration::from_secs(10),
        "workspace",
    );
    let key = store.create_tenant_key("acme").await.0;
    let spec = harness.mcp_spec(&key);
    let mut clients = Vec::new();
    for sessions_only in [true, false] {
        let options = ConnectOptions {
            sessions_only,
            ..ConnectOptions::new(Duration::from_secs(30))
        };
        let client = Connection::connect(&spec, options)
            .await
            .expect("an MCP client connects to the catalog");
        let warm = names(client.list_tools().await.unwrap());
        assert!(!warm.is_empty());
        clients.push((client, warm));
    }
    assert_eq!(clients[0].1, clients[1].1, "both eras list the same pins");
    clients
}

/// The statements Postgres ran since the last reset, with their counts,
/// but for the test's own about `pg_stat_statements`.
async fn statements_run(pool: &sqlx::PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT query, calls FROM pg_stat_statements
         WHERE query NOT ILIKE '%pg_stat_statements%' ORDER BY calls DESC",
    )
    .fetch_all(pool)
    .await
    .expect("read pg_stat_statements")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_mcp_list_of_either_era_runs_no_postgres_statement() {
    let postgres = PrivatePostgres::start_counting_statements().await;
    let (harness, _record) = started(&postgres, settings()).await;
    let clients = warm_clients(&harness).await;
    let pool = sqlx::PgPool::connect(&postgres.url()).await.unwrap();
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .unwrap();
    harness.events_written().await;
    sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(&pool)
        .await
        .unwrap();

    for (client, warm) in &clients {
        for _ in 0..20 {
            assert_eq!(&names(client.list_tools().await.unwrap()), warm);
        }
    }
    let during_lists = statements_run(&pool).await;
    assert!(
        during_lists.is_empty(),
        "40 warm lists ran statements: {during_lists:?}"
    );

    // The count sees the catalog's statements: a call's event, once
    // written, is one.
    echo(&harness, "counted").await;
    harness.events_written().await;
    let after_call = statements_run(&pool).await;
    assert!(
        after_call
            .iter()
            .any(|(query, _)| query.contains("catalog.events")),
        "the call's event was not counted: {after_call:?}"
    );
    for (client, _) in clients {
        client.close().await;
    }
    pool.close().await;
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_mcp_list_of_either_era_is_answered_with_postgres_down() {
    let mut postgres = PrivatePostgres::start().await;
    let (mut harness, _record) = started(&postgres, settings()).await;
    let clients = warm_clients(&harness).await;

    // Nothing of a warm list is read from Postgres: it answers the same
    // with the server gone (the key was checked, and is remembered).
    postgres.kill_hard();
    for (client, warm) in &clients {
        for _ in 0..3 {
            assert_eq!(&names(client.list_tools().await.unwrap()), warm);
        }
    }
    for (client, _) in clients {
        client.close().await;
    }
    postgres.restart().await;
    harness.stop_catalog().await;
    harness.stop().await;
}

/// How many times Postgres ran the events' INSERT since the last reset.
async fn event_inserts(pool: &sqlx::PgPool) -> i64 {
    statements_run(pool)
        .await
        .iter()
        .filter(|(query, _)| query.contains("INSERT INTO catalog.events"))
        .map(|(_, calls)| calls)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_calls_share_one_write_of_their_events() {
    let postgres = PrivatePostgres::start_counting_statements().await;
    // Longer than the burst below can take: it falls in one gathering.
    let settings = Settings {
        event_batch_wait: Duration::from_secs(60),
        ..settings()
    };
    let (harness, _record) = started(&postgres, settings).await;
    let pool = sqlx::PgPool::connect(&postgres.url()).await.unwrap();
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(&pool)
        .await
        .unwrap();

    for i in 0..20 {
        echo(&harness, &format!("busy {i}")).await;
    }
    assert_eq!(
        calls_stored(&postgres.url()).await,
        1,
        "the burst's events are still gathering"
    );
    // A flush ends the gathering: one statement writes all twenty.
    harness.events_written().await;
    assert_eq!(calls_stored(&postgres.url()).await, 21);
    assert_eq!(event_inserts(&pool).await, 1);
    pool.close().await;
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_event_is_written_once_its_gathering_time_passes() {
    let postgres = PrivatePostgres::start().await;
    let settings = Settings {
        event_batch_wait: Duration::from_millis(200),
        ..settings()
    };
    let (harness, _record) = started(&postgres, settings).await;
    echo(&harness, "alone").await;
    // No flush: the writer's own timer ends the batch.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while calls_stored(&postgres.url()).await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lone event was not written within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    harness.stop().await;
}
