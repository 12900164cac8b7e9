//! Two store replicas and two gate replicas: a chat waiting on either gate
//! is woken by a commit on either store. HTTP chats pick their gate; NATS
//! chats go to whichever replica the queue group gives them.

use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{
    Cluster, READY_WITHIN, Summary, addr_of, all_ready, metrics_of, tagged_push, url_of, wait_until,
};
use testkit::agent::FakeAgent;
use testkit::chat::{ChatAnswer, http_turn, nats_turn};
use testkit::{NatsServer, Process, TestDatabase};
use tokio::task::JoinHandle;

async fn accepted_pushes(http: &reqwest::Client, store: &Process) -> f64 {
    metrics_of(http, store)
        .await
        .sum("ctxsync_store_pushes_total", &[("outcome", "accepted")])
}

/// Completes the agents' discovery with only `committer` serving the store
/// subjects, asserts it committed every push, and returns the answers of the
/// chats that waited on them.
async fn complete_on(
    http: &reqwest::Client,
    committer: &Process,
    agents: &mut [FakeAgent],
    chats: Vec<Vec<JoinHandle<ChatAnswer>>>,
) -> Vec<(ChatAnswer, Duration)> {
    let before = accepted_pushes(http, committer).await;
    let mut completed = Vec::new();
    for agent in agents.iter_mut() {
        let complete = tagged_push(agent.run_id(), 2, Phase::Complete);
        let answer = agent.push(&complete).await.answer.clone();
        assert!(answer.is_accepted(), "{answer:?}");
        completed.push(Instant::now());
    }
    assert_eq!(
        accepted_pushes(http, committer).await,
        before + agents.len() as f64,
        "{} committed the pushes",
        committer.name()
    );
    let mut answers = Vec::new();
    for (agent_chats, completed_at) in chats.into_iter().zip(completed) {
        for chat in agent_chats {
            let answer = tokio::time::timeout(Duration::from_secs(30), chat)
                .await
                .expect("the waiting chat is answered within 30 s of the commit")
                .expect("chat task");
            let woken_after = answer.answered_at.saturating_duration_since(completed_at);
            answers.push((answer, woken_after));
        }
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_waiting_on_either_gate_is_woken_by_a_commit_on_either_store() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let mut store_a = cluster.store("store-a").spawn();
    let mut store_b = cluster.store("store-b").spawn();
    let mut ingest = cluster.ingest().spawn();
    let gate = |name: &str| {
        cluster
            .gate(name)
            .env("CTXSYNC_GATE_PENDING_TIMEOUT", "60s")
            .spawn()
    };
    let (mut gate_1, mut gate_2) = (gate("gate-1"), gate("gate-2"));
    all_ready(&mut [
        &mut store_a,
        &mut store_b,
        &mut ingest,
        &mut gate_1,
        &mut gate_2,
    ])
    .await;
    let nats_client = cluster.nats("faults-test").await;
    let store_client = cluster.store_client(&nats_client.client);
    store_client.create_test_tenant_key().await;
    let ingest_url = url_of(&ingest);

    // Agent i has a chat waiting on gate 1 (i even) or gate 2 (i odd) over
    // HTTP, and one over NATS, which the gates' queue group gives to either.
    // Agents 0 and 1 complete on store A, 2 and 3 on store B.
    let mut agents = Vec::new();
    let mut chats = Vec::new();
    for i in 0..4 {
        let mut agent =
            FakeAgent::register(&store_client, &ingest_url, &format!("agent-{i}")).await;
        assert!(agent.startup().await.answer.is_accepted());
        let pending = tagged_push(agent.run_id(), 1, Phase::Pending);
        assert!(agent.push(&pending).await.answer.is_accepted());
        let agent_id = agent.agent_id().to_owned();
        let gate = if i % 2 == 0 { &gate_1 } else { &gate_2 };
        let (http, addr, id) = (cluster.http.clone(), addr_of(gate), agent_id.clone());
        let over_http = tokio::spawn(async move {
            http_turn(
                &http,
                addr,
                &format!("http-{id}"),
                &id,
                true,
                Duration::from_secs(90),
            )
            .await
        });
        let (client, subjects) = (nats_client.client.clone(), cluster.subjects.clone());
        let over_nats = tokio::spawn(async move {
            nats_turn(
                &client,
                &subjects,
                &format!("nats-{agent_id}"),
                &agent_id,
                true,
                Duration::from_secs(90),
            )
            .await
        });
        chats.push(vec![over_http, over_nats]);
        agents.push(agent);
    }
    let http = &cluster.http;
    let (first, second) = (&gate_1, &gate_2);
    wait_until(
        "8 chats wait, at least 2 on each gate",
        Duration::from_secs(30),
        || async move {
            let on_1 = metrics_of(http, first)
                .await
                .sum("ctxsync_gate_waiters", &[]);
            let on_2 = metrics_of(http, second)
                .await
                .sum("ctxsync_gate_waiters", &[]);
            if on_1 + on_2 == 8.0 && on_1 >= 2.0 && on_2 >= 2.0 {
                Ok(())
            } else {
                Err(format!("{on_1} waiting on gate-1, {on_2} on gate-2"))
            }
        },
    )
    .await;
    let chats_on_b = chats.split_off(2);
    let (agents_a, agents_b) = agents.split_at_mut(2);

    // A stopped replica leaves the queue group (a SIGSTOPped one would keep
    // its subscription and take half the requests), so store A commits.
    let stopped = store_b.terminate(Duration::from_secs(30)).await;
    assert!(stopped.success(), "store-b exited with {stopped}");
    let mut woken = complete_on(&cluster.http, &store_a, agents_a, chats).await;
    store_b.restart();
    store_b.wait_ready(READY_WITHIN).await;
    let stopped = store_a.terminate(Duration::from_secs(30)).await;
    assert!(stopped.success(), "store-a exited with {stopped}");
    woken.extend(complete_on(&cluster.http, &store_b, agents_b, chats_on_b).await);
    store_a.restart();
    store_a.wait_ready(READY_WITHIN).await;

    let ready = woken.iter().filter(|(a, _)| a.is("ready")).count();
    let slowest = woken.iter().map(|(_, d)| *d).max().unwrap_or_default();
    Summary::new("two_stores_two_gates")
        .field("chats", woken.len())
        .field("woken", ready)
        .field("wake_ms_max", slowest.as_millis())
        .emit();
    for (answer, _) in &woken {
        assert!(
            answer.is("ready"),
            "chat {} ({:?}) answered {}",
            answer.chat_id,
            answer.via,
            answer.decision()
        );
    }
}
