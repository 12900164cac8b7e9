//! nats-server restarted (same port) while 50 first turns wait, half asked
//! over HTTP and half over NATS.

use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{
    Cluster, Summary, addr_of, all_ready, first_turns_both_ways, metrics_of, pending_agents,
    push_until_answered, tagged_push, url_of, wait_gauge, wait_until,
};
use testkit::{NatsServer, TestDatabase};

const AGENTS: usize = 25;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restarted_while_fifty_chats_wait_all_are_answered_ready() {
    testkit::init_logs();
    let mut nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let mut store = cluster.store("store").spawn();
    let mut ingest = cluster.ingest().spawn();
    let mut gate = cluster
        .gate("gate")
        .env("CTXSYNC_GATE_PENDING_TIMEOUT", "120s")
        .spawn();
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    let nats_client = cluster.nats("faults-test").await;
    let store_client = cluster.store_client(&nats_client.client);
    store_client.create_test_tenant_key().await;
    let ingest_url = url_of(&ingest);

    let mut agents = pending_agents(&store_client, &ingest_url, "agent", AGENTS).await;
    let chats = first_turns_both_ways(
        &cluster.http,
        addr_of(&gate),
        &nats_client.client,
        &cluster.subjects,
        &agents,
    );
    let waiting = chats.len();
    wait_gauge(
        &cluster.http,
        &gate,
        "ctxsync_gate_waiters",
        waiting as f64,
        Duration::from_secs(30),
    )
    .await;

    let reconnects = *nats_client.reconnects().borrow();
    let mut service_reconnects = Vec::new();
    for service in [&store, &ingest, &gate] {
        let count = metrics_of(&cluster.http, service)
            .await
            .sum("ctxsync_nats_reconnects_total", &[]);
        service_reconnects.push((service, count));
    }
    nats.restart();
    let restarted_at = Instant::now();
    // Recovered: every service counted its reconnect (a readiness probe
    // alone could run before a service even saw the disconnect).
    for (service, before) in service_reconnects {
        let http = &cluster.http;
        wait_until(
            &format!("{} reconnects to NATS", service.name()),
            Duration::from_secs(30),
            || async move {
                let now = metrics_of(http, service)
                    .await
                    .sum("ctxsync_nats_reconnects_total", &[]);
                if now > before {
                    Ok(())
                } else {
                    Err(format!("{now} reconnects"))
                }
            },
        )
        .await;
    }
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    let mut test_reconnects = nats_client.reconnects();
    tokio::time::timeout(
        Duration::from_secs(30),
        test_reconnects.wait_for(|n| *n > reconnects),
    )
    .await
    .expect("the test's NATS client reconnects within 30 s")
    .expect("reconnect watch");
    // Its reply inbox is subscribed again before the answers can come.
    ctxsync_runtime::nats::sync_with_server(&nats_client.client)
        .await
        .expect("a round trip after the reconnect");
    let recover = restarted_at.elapsed();

    // Discovery completes: every waiting chat is answered ready.
    let mut completed = std::collections::HashMap::new();
    for agent in &mut agents {
        let complete = tagged_push(agent.run_id(), 2, Phase::Complete);
        // The store may still be settling after the reconnect.
        push_until_answered(agent, &complete, 50).await;
        completed.insert(agent.agent_id().to_owned(), Instant::now());
    }
    let mut slowest_wake = Duration::ZERO;
    let mut woken = 0;
    let mut others = Vec::new();
    for chat in chats {
        let answer = tokio::time::timeout(Duration::from_secs(60), chat)
            .await
            .expect("a chat is answered within 60 s of completion")
            .expect("chat task");
        let completed_at = completed[&answer.agent_id];
        slowest_wake = slowest_wake.max(answer.answered_at.saturating_duration_since(completed_at));
        if answer.is("ready") {
            woken += 1;
        } else {
            others.push(format!(
                "{:?} {}: {}",
                answer.via,
                answer.chat_id,
                answer.decision()
            ));
        }
    }
    Summary::new("nats_restart_50_chats")
        .field("chats", waiting)
        .field("woken", woken)
        .field("recover_ms", recover.as_millis())
        .field("wake_ms_max", slowest_wake.as_millis())
        .emit();
    assert_eq!(woken, waiting, "not answered ready: {others:?}");
}
