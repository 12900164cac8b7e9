//! `catalog.status.<tenant>`: the subject's tenant's servers only, with
//! memory and warm-up state, and its latency aggregates; no content.

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::catalog_server_status::Warmup;
use ctxsync_proto::v1::{CatalogStatusReply, CatalogStatusRequest, GateTurnWaited};
use ctxsync_runtime::Shutdown;
use prost::Message;
use testkit::stack::{StackBuilder, TestStack};

async fn status(harness: &Harness, tenant: &str) -> CatalogStatusReply {
    ctxsync_runtime::rpc::request(
        &harness.client,
        harness.subjects.catalog_status(tenant),
        &CatalogStatusRequest::default(),
        None,
        REQUEST_TIMEOUT,
    )
    .await
    .expect("catalog answers")
}

#[tokio::test]
async fn status_lists_the_subjects_tenant_servers_with_warmup_state_and_gate_waits() {
    let record = tempfile::tempdir().unwrap();
    let mut settings = settings();
    settings.warmup.enabled = true;
    settings.warmup.attempts = 1;
    let harness = Harness::start(
        tenants(vec![
            (
                "acme",
                vec![
                    fixture("a", record.path(), &[]),
                    fixture("crash", record.path(), &["--mode", "crash"]),
                ],
            ),
            ("beta", vec![fixture("b", record.path(), &[])]),
        ]),
        settings,
    )
    .await;
    let mut warmup = harness.running().warmup();
    tokio::time::timeout(Duration::from_secs(60), warmup.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes in time")
        .expect("status channel open");

    // One first preparation and a gate wait of acme, none of beta.
    assert!(harness.prepare("acme", "chat-1").await.error.is_none());
    let wait = GateTurnWaited {
        tenant: "acme".to_owned(),
        outcome: "ready".to_owned(),
        wait_ms: 12,
    };
    harness
        .client
        .publish(
            harness.subjects.gate_turn_waited(),
            wait.encode_to_vec().into(),
        )
        .await
        .unwrap();
    harness.client.flush().await.unwrap();
    let recorded = "SELECT count(*) FROM catalog.events WHERE kind = 'gate.turn.waited'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while harness.count(recorded).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gate wait is recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let acme = status(&harness, "acme").await;
    assert!(acme.error.is_none(), "{:?}", acme.error);
    let servers: Vec<_> = acme
        .servers
        .iter()
        .map(|s| (s.server_id.as_str(), s.remembered, s.warmup))
        .collect();
    assert_eq!(
        servers,
        [
            ("a", true, Warmup::Discovered as i32),
            ("crash", false, Warmup::Abandoned as i32)
        ]
    );
    assert!(acme.servers[0].tool_count > 0 && !acme.servers[0].catalog_hash.is_empty());
    assert_eq!(acme.setup.len(), 12);
    assert_eq!(
        acme.setup
            .iter()
            .map(|b| b.setup.as_ref().unwrap().count)
            .sum::<u64>(),
        1
    );
    let last = acme.setup.last().unwrap().setup.as_ref().unwrap();
    assert_eq!(last.count, 1, "the preparation is in the latest bucket");
    assert!(last.p50_ms.is_some() && last.p90_ms.is_some());
    let waits: Vec<_> = acme
        .gate_waits
        .iter()
        .map(|g| (g.outcome.as_str(), g.wait.as_ref().unwrap().count))
        .collect();
    assert_eq!(waits, [("ready", 1)]);

    // Another tenant sees its own servers and none of acme's aggregates.
    let beta = status(&harness, "beta").await;
    let servers: Vec<_> = beta.servers.iter().map(|s| s.server_id.as_str()).collect();
    assert_eq!(servers, ["b"]);
    assert!(beta.gate_waits.is_empty());
    assert_eq!(
        beta.setup
            .iter()
            .map(|b| b.setup.as_ref().unwrap().count)
            .sum::<u64>(),
        0
    );

    // A body naming another tenant than the subject is refused.
    let refused: CatalogStatusReply = ctxsync_runtime::rpc::request(
        &harness.client,
        harness.subjects.catalog_status("beta"),
        &CatalogStatusRequest {
            tenant: "acme".to_owned(),
            window_seconds: 0,
        },
        None,
        REQUEST_TIMEOUT,
    )
    .await
    .unwrap();
    assert_eq!(error_code(&refused.error), "request.invalid");
    assert!(refused.servers.is_empty());
    harness.stop().await;
}

/// A gate wait another client saw before the catalog was told to stop is
/// recorded, even when it reaches the catalog's connection after the stop
/// began: `ctxsync up --exit-after-demo` stops right after the demo saw its
/// wait, and the client's drain alone drops what is still in the socket.
#[tokio::test]
async fn a_gate_wait_seen_elsewhere_before_a_stop_is_recorded_though_it_arrives_late() {
    use futures::StreamExt as _;
    let TestStack { nats, db, prefix } = TestStack::private().await;
    let late = testkit::LateProxy::start(nats.port()).await;
    let shutdown = Shutdown::new();
    let mut stack = testkit::stack::start(
        StackBuilder::new(nats.url(), &prefix)
            .database(db.url())
            .catalog(tenants(vec![("acme", vec![])]), settings(), |config| {
                config.common.nats_url = late.url();
            }),
        &shutdown,
    )
    .await;
    let catalog = stack.catalogs.remove(0).running;
    let subjects = Subjects::new(&prefix).unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut observer = client.subscribe(subjects.gate_turn_waited()).await.unwrap();
    ctxsync_runtime::nats::sync_with_server(&client)
        .await
        .unwrap();

    // From now on what the server sends the catalog arrives 300 ms late.
    late.delay_to_client(Duration::from_millis(300));
    let wait = GateTurnWaited {
        tenant: "acme".to_owned(),
        outcome: "ready".to_owned(),
        wait_ms: 3,
    };
    client
        .publish(subjects.gate_turn_waited(), wait.encode_to_vec().into())
        .await
        .unwrap();
    tokio::time::timeout(REQUEST_TIMEOUT, observer.next())
        .await
        .expect("the observer sees the wait")
        .expect("subscription open");
    shutdown.cancel();
    tokio::time::timeout(REQUEST_TIMEOUT, catalog.join())
        .await
        .expect("the catalog stops");

    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM catalog.events WHERE kind = 'gate.turn.waited'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, 1, "the wait is recorded once");
    stack.stop().await;
}
