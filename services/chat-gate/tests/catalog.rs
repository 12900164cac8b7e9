//! A first turn also gets the tenant's catalog pins, from the real catalog
//! service; a catalog that does not answer fails open.

mod common;

use common::*;
use ctxsync_proto::v1::catalog_section::Status;
use ctxsync_proto::v1::*;
use ctxsync_runtime::Shutdown;

async fn start_catalog(h: &Harness) -> (catalog::Running, Shutdown) {
    let fixture = mcp_fixture::fixture_binary();
    let yaml = serde_json::json!({
        "tenants": [{ "id": "acme", "servers": [
            { "id": "notes", "transport": { "stdio": { "command": fixture, "args": ["--mode", "normal"] } } }
        ]}]
    });
    h.start_catalog(yaml).await
}

#[tokio::test]
async fn a_first_turn_carries_the_tenants_catalog_pins_next_to_the_workspace_projection() {
    let h = Harness::spawn_with(with_catalog).await;
    let (_catalog, _stop) = start_catalog(&h).await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;

    let reply = h.tenant_turn("acme", "chat-1", &agent, true).await;
    assert_eq!(reply.decision(), GateDecision::Ready);
    let projection = projection(&reply);
    assert_eq!(tool_names(&reply), ["ws__t"]);
    let section = projection.catalog.as_ref().unwrap();
    assert_eq!(section.status(), Status::Ready, "{}", section.error);
    assert_eq!(section.pins.len(), 1);
    let pin = &section.pins[0];
    assert_eq!(pin.server_id, "notes");
    let mut tools: Vec<_> = pin.tools.iter().map(|t| t.name.as_str()).collect();
    tools.sort();
    assert_eq!(tools, ["add", "echo"]);
    // The handle a chat backend passes to the catalog's MCP endpoint for
    // these same pins, and how long they are the catalog's current ones (a
    // stdio server's: until its configuration or the release changes).
    assert_eq!(section.pin_handle, "chat-1");
    assert_eq!(section.ttl_ms, 24 * 3600 * 1000);
    assert!(
        projection
            .summary
            .contains("catalog offers 1 server with 2 tools"),
        "{}",
        projection.summary
    );

    // Later turns don't prepare the catalog again.
    let later = h.tenant_turn("acme", "chat-1", &agent, false).await;
    assert_eq!(
        projection_of(&later).catalog.as_ref().unwrap().status(),
        Status::NotRequested
    );
}

#[tokio::test]
async fn a_catalog_that_does_not_answer_fails_open_and_the_projection_says_so() {
    let h = Harness::spawn_with(with_catalog).await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    // No catalog runs on this prefix.
    let reply = h.tenant_turn("acme", "chat-1", &agent, true).await;
    assert_eq!(reply.decision(), GateDecision::Ready);
    assert_eq!(tool_names(&reply), ["ws__t"]);
    let projection = projection(&reply);
    let section = projection.catalog.as_ref().unwrap();
    assert_eq!(section.status(), Status::Failed);
    assert!(
        section.error.contains("did not answer"),
        "{}",
        section.error
    );
    assert!(
        projection.summary.contains("catalog is unavailable"),
        "{}",
        projection.summary
    );
}

fn projection_of(reply: &TurnReply) -> &ChatProjection {
    reply.projection.as_ref().expect("projection")
}

#[tokio::test]
async fn first_turn_waits_reach_the_latency_report_by_outcome() {
    let h = Harness::spawn_with(with_catalog).await;
    let (_catalog, _stop) = start_catalog(&h).await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    h.tenant_turn("acme", "chat-1", &agent, true).await;
    h.tenant_turn("acme", "chat-2", &agent, true).await;
    // Not a first turn: not a wait.
    h.tenant_turn("acme", "chat-2", &agent, false).await;

    let pool = sqlx::PgPool::connect(h.db.url()).await.unwrap();
    let report_pool = pool.clone();
    until("two gate waits recorded".into(), move || {
        let pool = report_pool.clone();
        async move {
            let report = catalog::latency::report(&pool, std::time::Duration::from_secs(3600))
                .await
                .unwrap();
            report.gate_waits.iter().map(|w| w.wait.count).sum::<u64>() == 2
        }
    })
    .await;
    let report = catalog::latency::report(&pool, std::time::Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(report.gate_waits.len(), 1);
    assert_eq!(report.gate_waits[0].outcome, "ready");
    assert!(report.render_text().contains("ready"));
    // Aggregates only: no chat id reaches the report.
    assert!(!report.render_json().contains("chat-1"));
}

/// A stand-in catalog on the harness's prefix: it answers the prepare
/// requests `answer` chooses (by their order, from 1) after `delay`, each
/// with a pin named after the request it answers, and drops the rest (as a
/// connection closing under a request does). Returns how many it saw.
async fn stand_in_catalog(
    h: &Harness,
    answer: fn(usize) -> bool,
    delay: std::time::Duration,
) -> tokio::task::JoinHandle<usize> {
    use futures::StreamExt;
    use prost::Message;
    let mut requests = h
        .client
        .subscribe(h.subjects.catalog_prepare("acme"))
        .await
        .unwrap();
    h.client.flush().await.unwrap();
    let client = h.client.clone();
    tokio::spawn(async move {
        let mut seen = 0;
        let deadline = tokio::time::sleep(std::time::Duration::from_secs(5));
        tokio::pin!(deadline);
        loop {
            let request = tokio::select! {
                request = requests.next() => request.unwrap(),
                () = &mut deadline => return seen,
            };
            seen += 1;
            if !answer(seen) {
                continue;
            }
            let reply = CatalogPrepareReply {
                pins: vec![CatalogPin {
                    server_id: format!("answer-to-request-{seen}"),
                    ..Default::default()
                }],
                ..Default::default()
            };
            let client = client.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                client
                    .publish(request.reply.unwrap(), reply.encode_to_vec().into())
                    .await
                    .unwrap();
            });
        }
    })
}

/// A gate preparing catalogs within 2 s, and an agent complete with a tool.
async fn gate_and_agent() -> (Harness, String) {
    let h = Harness::spawn_with(|config| {
        with_catalog(config);
        config.catalog_timeout = std::time::Duration::from_secs(2);
    })
    .await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    (h, agent)
}

#[tokio::test]
async fn a_preparation_lost_on_the_way_is_asked_again_within_the_catalog_timeout() {
    let (h, agent) = gate_and_agent().await;
    let catalog = stand_in_catalog(&h, |n| n == 2, std::time::Duration::ZERO).await;

    let started = std::time::Instant::now();
    let reply = h.tenant_turn("acme", "chat-lost", &agent, true).await;
    let elapsed = started.elapsed();
    let section = projection(&reply).catalog.as_ref().unwrap();
    assert_eq!(section.status(), Status::Ready, "{}", section.error);
    assert_eq!(section.pins[0].server_id, "answer-to-request-2");
    assert!(
        elapsed >= std::time::Duration::from_secs(1) && elapsed < std::time::Duration::from_secs(2),
        "asked again at half the catalog timeout (2 s) and answered within it: {elapsed:?}"
    );
    assert_eq!(catalog.await.unwrap(), 2, "asked twice");
}

#[tokio::test]
async fn a_slow_preparation_is_not_abandoned_for_the_second_request() {
    let (h, agent) = gate_and_agent().await;
    // The first request's answer comes at 1.5 s, past the second request
    // (at 1 s), which is never answered.
    let catalog = stand_in_catalog(&h, |n| n == 1, std::time::Duration::from_millis(1500)).await;

    let reply = h.tenant_turn("acme", "chat-slow", &agent, true).await;
    let section = projection(&reply).catalog.as_ref().unwrap();
    assert_eq!(section.status(), Status::Ready, "{}", section.error);
    assert_eq!(section.pins[0].server_id, "answer-to-request-1");
    assert_eq!(catalog.await.unwrap(), 2, "asked again while waiting");
}

#[tokio::test]
async fn a_catalog_that_never_answers_fails_the_section_at_the_catalog_timeout() {
    let (h, agent) = gate_and_agent().await;
    let catalog = stand_in_catalog(&h, |_| false, std::time::Duration::ZERO).await;

    let started = std::time::Instant::now();
    let reply = h.tenant_turn("acme", "chat-silent", &agent, true).await;
    let elapsed = started.elapsed();
    assert_eq!(reply.decision(), GateDecision::Ready);
    let section = projection(&reply).catalog.as_ref().unwrap();
    assert_eq!(section.status(), Status::Failed);
    assert!(
        section.error.contains("did not answer"),
        "{}",
        section.error
    );
    assert!(
        elapsed >= std::time::Duration::from_secs(2) && elapsed < std::time::Duration::from_secs(3),
        "both requests within the one catalog timeout (2 s): {elapsed:?}"
    );
    assert_eq!(catalog.await.unwrap(), 2, "asked twice, not more");
}
