//! The catalog killed (SIGKILL) while its Postgres is down and calls keep
//! being answered: every call is answered, and of the events their answers
//! did not wait for, what the kill loses is at most what the event queue
//! holds (`CTXSYNC_CATALOG_EVENT_QUEUE`, plus the batch being retried); the
//! rest were dropped and counted before the kill.

use std::time::Duration;

use ctxsync_proto::rpc::catalog;
use ctxsync_proto::v1::{CatalogCallRequest, CatalogPrepareRequest};
use ctxsync_runtime::rpc;
use faults::{Cluster, READY_WITHIN, Summary, addr_of, wait_until};
use testkit::metrics::Metrics;
use testkit::{NatsServer, PrivatePostgres};

/// The catalog's event queue in this case.
const QUEUE: usize = 8;
/// Calls answered while Postgres is down.
const CALLS: usize = 40;
const TIMEOUT: Duration = Duration::from_secs(20);

async fn calls_stored(url: &str) -> Result<i64, String> {
    let pool = sqlx::PgPool::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let count =
        sqlx::query_scalar("SELECT count(*) FROM catalog.events WHERE kind = 'mcp.tool.called'")
            .fetch_one(&pool)
            .await
            .map_err(|e| e.to_string());
    pool.close().await;
    count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_killed_with_events_queued_loses_at_most_its_queue() {
    testkit::init_logs();
    let mut postgres = PrivatePostgres::start().await;
    let nats = NatsServer::start();
    let cluster = Cluster::new(nats.url(), &postgres.url());
    let record = tempfile::tempdir().unwrap();
    let config = record.path().join("catalog.yaml");
    let fixture = serde_json::json!({
        "tenants": [{"id": "acme", "servers": [{
            "id": "fx",
            "transport": {"stdio": {
                "command": mcp_fixture::fixture_binary().display().to_string(),
                "args": ["--record-dir", record.path().display().to_string()],
            }},
        }]}],
    });
    // JSON is YAML.
    std::fs::write(&config, fixture.to_string()).unwrap();
    let mut catalog_process = cluster
        .catalog(&config)
        .env("CTXSYNC_CATALOG_EVENT_QUEUE", QUEUE.to_string())
        .spawn();
    catalog_process.wait_ready(READY_WITHIN).await;
    let nats_client = cluster.nats("faults-test").await;
    let client = &nats_client.client;

    let prepared = rpc::call_for_tenant::<catalog::Prepare>(
        client,
        &cluster.subjects,
        "acme",
        &CatalogPrepareRequest {
            tenant: "acme".into(),
            session_id: "s1".into(),
        },
        None,
        TIMEOUT,
    )
    .await
    .expect("the session is prepared");
    assert_eq!(prepared.pins.len(), 1);
    let subjects = &cluster.subjects;
    let call = |text: String| async move {
        rpc::call_for_tenant::<catalog::Call>(
            client,
            subjects,
            "acme",
            &CatalogCallRequest {
                tenant: "acme".into(),
                session_id: "s1".into(),
                server_id: "fx".into(),
                tool: "echo".into(),
                arguments_json: serde_json::json!({ "text": text }).to_string(),
                ..Default::default()
            },
            None,
            TIMEOUT,
        )
        .await
    };
    // The first call opens the server; its event is written.
    assert!(call("before".into()).await.expect("answered").ok);
    let url = postgres.url();
    wait_until("the first call's event is stored", TIMEOUT, || async {
        match calls_stored(&url).await? {
            1 => Ok(()),
            n => Err(format!("{n} stored")),
        }
    })
    .await;

    postgres.kill_hard();
    for i in 0..CALLS {
        let reply = call(format!("while down {i}")).await.expect("answered");
        assert!(
            reply.ok,
            "call {i} answered while Postgres is down: {reply:?}"
        );
    }
    let metrics = Metrics::scrape(&cluster.http, addr_of(&catalog_process))
        .await
        .expect("the catalog's metrics");
    let dropped = metrics.sum("ctxsync_catalog_events_dropped_total", &[]) as usize;
    catalog_process.kill();
    postgres.restart().await;

    let stored = usize::try_from(calls_stored(&postgres.url()).await.unwrap()).unwrap() - 1;
    let lost = CALLS - stored - dropped;
    Summary::new("catalog_killed_with_events_queued")
        .field("calls", CALLS)
        .field("queue", QUEUE)
        .field("stored", stored)
        .field("dropped", dropped)
        .field("lost", lost)
        .emit();
    assert_eq!(stored, 0, "nothing was written while Postgres was down");
    assert!(
        lost <= 2 * QUEUE,
        "{lost} events lost by the kill, over the queue's {QUEUE} and the batch in hand"
    );
    assert!(
        dropped >= CALLS - 2 * QUEUE,
        "{dropped} of {CALLS} dropped: the queue held more than its bound"
    );
}
