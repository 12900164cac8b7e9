//! A three-node NATS cluster (routes on loopback), every service given the
//! cluster's URL list: the node a service is connected to is killed, and the
//! service fails over to another node with nothing lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{
    Cluster, Summary, addr_of, all_ready, check_pushes, first_turns_both_ways, metrics_of,
    pending_agents, push_until_answered, tagged_push, url_of, wait_until,
};
use testkit::agent::{FakeAgent, stored_agents};
use testkit::{NatsCluster, TestDatabase};

const AGENTS: usize = 25;

async fn start_cluster() -> NatsCluster {
    tokio::task::spawn_blocking(NatsCluster::start)
        .await
        .expect("the cluster starts")
}

/// The one node a service's NATS client (named `client`) is connected to.
async fn node_of_service(nats: &NatsCluster, client: &str) -> usize {
    wait_until(
        &format!("{client} is connected to one node"),
        Duration::from_secs(30),
        || async move {
            match nats.nodes_with_client(client).as_slice() {
                [node] => Ok(*node),
                other => Err(format!("connected to nodes {other:?}")),
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_node_killed_while_fifty_chats_wait_all_are_answered_ready() {
    testkit::init_logs();
    let mut nats = start_cluster().await;
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url_list(), db.url());
    let mut store = cluster.store("store").spawn();
    let mut ingest = cluster.ingest().env("CTXSYNC_STORE_TIMEOUT", "2s").spawn();
    let mut gate = cluster
        .gate("gate")
        .env("CTXSYNC_GATE_PENDING_TIMEOUT", "120s")
        .spawn();
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    let gate_node = node_of_service(&nats, "chat-gate").await;
    // The chats' client is on another node: its requests outlive the kill,
    // and their answers must come back through the cluster.
    let chat_node = (gate_node + 1) % NatsCluster::SIZE;
    let chat_client =
        ctxsync_runtime::nats::connect(nats.node_url(chat_node).as_str(), "faults-chats")
            .await
            .expect("the chats connect");
    let store_client = cluster.store_client(&chat_client.client);
    store_client.create_test_tenant_key().await;
    let ingest_url = url_of(&ingest);

    let mut agents = pending_agents(&store_client, &ingest_url, "agent", AGENTS).await;
    let chats = first_turns_both_ways(
        &cluster.http,
        addr_of(&gate),
        &chat_client.client,
        &cluster.subjects,
        &agents,
    );
    let waiting = chats.len();
    faults::wait_gauge(
        &cluster.http,
        &gate,
        "ctxsync_gate_waiters",
        waiting as f64,
        Duration::from_secs(30),
    )
    .await;
    let gate_reconnects = metrics_of(&cluster.http, &gate)
        .await
        .sum("ctxsync_nats_reconnects_total", &[]);

    nats.kill(gate_node);
    let killed_at = Instant::now();
    // Discovery completes at once, while the gate may still be failing over:
    // whatever the gate missed, it reads again after its gap.
    let mut completed = std::collections::HashMap::new();
    for agent in &mut agents {
        let complete = tagged_push(agent.run_id(), 2, Phase::Complete);
        // The store and ingest may have been on the killed node too.
        push_until_answered(agent, &complete, 100).await;
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
    let answered_in = killed_at.elapsed();
    // The gate did fail over: it counted a reconnect, to a node still up.
    let now = metrics_of(&cluster.http, &gate)
        .await
        .sum("ctxsync_nats_reconnects_total", &[]);
    let new_node = node_of_service(&nats, "chat-gate").await;
    Summary::new("cluster_gate_node_killed_50_chats")
        .field("chats", waiting)
        .field("woken", woken)
        .field("all_answered_ms", answered_in.as_millis())
        .field("wake_ms_max", slowest_wake.as_millis())
        .emit();
    assert_eq!(woken, waiting, "not answered ready: {others:?}");
    assert!(
        now > gate_reconnects,
        "the gate reconnected ({now} reconnects)"
    );
    assert_ne!(new_node, gate_node, "the gate is on a node that runs");
}

/// 1,000 pushes in all.
const PUSHES_PER_AGENT: u64 = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_node_killed_during_a_burst_loses_no_acked_push() {
    testkit::init_logs();
    let mut nats = start_cluster().await;
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url_list(), db.url());
    let mut store = cluster.store("store").spawn();
    // What the store held when its node went is answered 503 after this.
    let mut ingest = cluster.ingest().env("CTXSYNC_STORE_TIMEOUT", "2s").spawn();
    all_ready(&mut [&mut store, &mut ingest]).await;
    let store_node = node_of_service(&nats, "snapshot-store").await;
    let test_node = (store_node + 1) % NatsCluster::SIZE;
    let test_client =
        ctxsync_runtime::nats::connect(nats.node_url(test_node).as_str(), "faults-test")
            .await
            .expect("the test connects");
    let store_client = cluster.store_client(&test_client.client);
    let ingest_url = url_of(&ingest);
    let mut agents = Vec::with_capacity(AGENTS);
    for i in 0..AGENTS {
        let mut agent =
            FakeAgent::register(&store_client, &ingest_url, &format!("burst-{i}")).await;
        let answer = agent.startup().await.answer.clone();
        assert!(answer.is_accepted(), "startup of agent {i}: {answer:?}");
        agents.push(agent);
    }

    let answered = Arc::new(AtomicU64::new(0));
    let burst: Vec<_> = agents
        .into_iter()
        .map(|mut agent| {
            let answered = answered.clone();
            tokio::spawn(async move {
                for version in 1..=PUSHES_PER_AGENT {
                    let phase = if version == PUSHES_PER_AGENT {
                        Phase::Complete
                    } else {
                        Phase::Pending
                    };
                    let sent = agent
                        .push(&tagged_push(agent.run_id(), version, phase))
                        .await;
                    // Pace like a real agent after a failure: "no responders"
                    // is answered at once, and without a pause a burst could
                    // run out while the store is still reconnecting (this
                    // test is about the pushes after that).
                    let failed = matches!(
                        sent.answer,
                        testkit::agent::Answer::ServerError(..)
                            | testkit::agent::Answer::Transport(_)
                    );
                    answered.fetch_add(1, Ordering::SeqCst);
                    if failed {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                (agent.agent_id().to_owned(), agent.into_history())
            })
        })
        .collect();
    let total = AGENTS as u64 * PUSHES_PER_AGENT;
    let progress = answered.clone();
    wait_until(
        "a third of the pushes answered before the kill",
        Duration::from_secs(120),
        || {
            let progress = progress.clone();
            async move {
                let n = progress.load(Ordering::SeqCst);
                if n >= total / 3 {
                    Ok(())
                } else {
                    Err(format!("{n} answered"))
                }
            }
        },
    )
    .await;
    nats.kill(store_node);
    let at_kill = answered.load(Ordering::SeqCst);

    let mut histories = Vec::with_capacity(AGENTS);
    for task in burst {
        let finished = tokio::time::timeout(Duration::from_secs(180), task)
            .await
            .expect("the burst ends within 180 s")
            .expect("an agent task");
        histories.push(finished);
    }
    let new_node = node_of_service(&nats, "snapshot-store").await;
    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let ids: Vec<String> = histories.iter().map(|(id, _)| id.clone()).collect();
    let stored = stored_agents(&pool, &ids).await.unwrap();
    let check = check_pushes(&histories, &stored, 1);
    Summary::new("cluster_store_node_killed_during_burst")
        .field("agents", AGENTS)
        .field("sent", check.sent)
        .field("answered_at_kill", at_kill)
        .field("acked", check.acked)
        .field("unanswered", check.unanswered)
        .field("stored", check.stored)
        .field("lost", check.lost)
        .emit();
    assert_eq!(check.sent, total);
    assert!(
        check.problems.is_empty(),
        "{} problems:\n{}",
        check.problems.len(),
        check.problems.join("\n")
    );
    assert_eq!(check.lost, 0);
    assert_eq!(check.refused, 0, "no push is refused");
    assert_ne!(new_node, store_node, "the store is on a node that runs");
    // The store went on committing on its new node: most of the burst after
    // the kill was acked, not only what came before it.
    assert!(
        check.acked > at_kill + (total - at_kill) / 2,
        "{} acked of {total}, {at_kill} answered before the kill",
        check.acked
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_given_a_list_whose_first_url_is_dead_starts() {
    testkit::init_logs();
    let mut nats = start_cluster().await;
    nats.kill(0);
    let db = TestDatabase::create().await;
    // Node 0 first, and dead: the store connects to another entry.
    let cluster = Cluster::new(nats.url_list(), db.url());
    let mut store = cluster.store("store").spawn();
    all_ready(&mut [&mut store]).await;
    let node = node_of_service(&nats, "snapshot-store").await;
    assert_ne!(node, 0);
    // And it serves: a registration is a store round trip.
    let client = cluster.nats("faults-test").await;
    assert_ne!(nats.node_of(&client.client), Some(0));
    cluster
        .store_client(&client.client)
        .create_test_tenant_key()
        .await;
}
