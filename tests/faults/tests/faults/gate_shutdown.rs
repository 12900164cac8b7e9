//! chat-gate SIGTERM while 10 first turns wait: within the shutdown grace
//! the waits go on (and end `ready` when discovery completes); past it every
//! turn is answered `shutting_down` before the process exits.

use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{Cluster, Summary, addr_of, all_ready, tagged_push, url_of, wait_gauge, wait_until};
use testkit::agent::FakeAgent;
use testkit::chat::{ChatAnswer, http_turn, nats_turn};
use testkit::{NatsServer, Process, TestDatabase};
use tokio::task::JoinHandle;

const TURNS: usize = 10;

struct Waiting {
    _nats: NatsServer,
    _db: TestDatabase,
    _store: Process,
    _ingest: Process,
    gate: Process,
    agents: Vec<FakeAgent>,
    chats: Vec<JoinHandle<ChatAnswer>>,
    _client: ctxsync_runtime::nats::NatsConnection,
}

/// A gate with shutdown grace `grace` and 10 first turns waiting on
/// pending discovery (half over HTTP, half over NATS).
async fn ten_waiting_turns(grace: &str) -> Waiting {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let mut store = cluster.store("store").spawn();
    let mut ingest = cluster.ingest().spawn();
    let mut gate = cluster
        .gate("gate")
        .env("CTXSYNC_SHUTDOWN_GRACE", grace)
        .env("CTXSYNC_GATE_PENDING_TIMEOUT", "120s")
        .spawn();
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    let client = cluster.nats("faults-test").await;
    let store_client = cluster.store_client(&client.client);
    store_client.create_test_tenant_key().await;
    let ingest_url = url_of(&ingest);
    let mut agents = Vec::new();
    let mut chats = Vec::new();
    for i in 0..TURNS {
        let mut agent =
            FakeAgent::register(&store_client, &ingest_url, &format!("agent-{i}")).await;
        assert!(agent.startup().await.answer.is_accepted());
        let pending = tagged_push(agent.run_id(), 1, Phase::Pending);
        assert!(agent.push(&pending).await.answer.is_accepted());
        let agent_id = agent.agent_id().to_owned();
        let chat_id = format!("chat-{i}");
        chats.push(if i % 2 == 0 {
            let (http, addr) = (cluster.http.clone(), addr_of(&gate));
            tokio::spawn(async move {
                http_turn(
                    &http,
                    addr,
                    &chat_id,
                    &agent_id,
                    true,
                    Duration::from_secs(150),
                )
                .await
            })
        } else {
            let (nats, subjects) = (client.client.clone(), cluster.subjects.clone());
            tokio::spawn(async move {
                nats_turn(
                    &nats,
                    &subjects,
                    &chat_id,
                    &agent_id,
                    true,
                    Duration::from_secs(150),
                )
                .await
            })
        });
        agents.push(agent);
    }
    wait_gauge(
        &cluster.http,
        &gate,
        "ctxsync_gate_waiters",
        TURNS as f64,
        Duration::from_secs(30),
    )
    .await;
    Waiting {
        _nats: nats,
        _db: db,
        _store: store,
        _ingest: ingest,
        gate,
        agents,
        chats,
        _client: client,
    }
}

/// SIGTERM, and waits until the gate logged that it is shutting down.
async fn terminate(gate: &Process) -> Instant {
    gate.send_terminate();
    let sent_at = Instant::now();
    wait_until(
        "chat-gate takes the SIGTERM",
        Duration::from_secs(10),
        || async {
            if gate.log().contains("shutdown requested") {
                Ok(())
            } else {
                Err("not logged yet".to_owned())
            }
        },
    )
    .await;
    sent_at
}

async fn answers(chats: Vec<JoinHandle<ChatAnswer>>) -> Vec<ChatAnswer> {
    let mut answers = Vec::new();
    for chat in chats {
        answers.push(
            tokio::time::timeout(Duration::from_secs(60), chat)
                .await
                .expect("a waiting turn is answered within 60 s of the SIGTERM")
                .expect("chat task"),
        );
    }
    answers
}

fn decisions(answers: &[ChatAnswer]) -> Vec<String> {
    answers
        .iter()
        .map(|a| {
            format!(
                "{} ({:?}, {} ms)",
                a.decision(),
                a.via,
                a.elapsed.as_millis()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_sigterm_lets_waiting_turns_finish_ready_within_the_grace() {
    let mut waiting = ten_waiting_turns("20s").await;
    let (gate, agents) = (&mut waiting.gate, &mut waiting.agents);
    let chats = std::mem::take(&mut waiting.chats);
    let terminated_at = terminate(gate).await;
    // Discovery completes well within the grace.
    for agent in agents.iter_mut() {
        let complete = tagged_push(agent.run_id(), 2, Phase::Complete);
        let answer = agent.push(&complete).await.answer.clone();
        assert!(answer.is_accepted(), "{answer:?}");
    }
    let answers = answers(chats).await;
    let exit = gate.wait_exit(Duration::from_secs(30)).await;
    let ready = answers.iter().filter(|a| a.is("ready")).count();
    Summary::new("gate_sigterm_within_grace")
        .field("chats", TURNS)
        .field("woken", ready)
        .field("exit_ms", terminated_at.elapsed().as_millis())
        .emit();
    assert_eq!(ready, TURNS, "answers: {:?}", decisions(&answers));
    assert!(exit.success(), "chat-gate exited with {exit}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_sigterm_answers_shutting_down_when_the_grace_runs_out() {
    let grace = Duration::from_secs(2);
    let mut waiting = ten_waiting_turns("2s").await;
    let gate = &mut waiting.gate;
    let chats = std::mem::take(&mut waiting.chats);
    let terminated_at = terminate(gate).await;
    // Discovery never completes: the grace runs out first.
    let answers = answers(chats).await;
    let exit = gate.wait_exit(Duration::from_secs(30)).await;
    let exited_after = terminated_at.elapsed();
    let shutting_down = answers.iter().filter(|a| a.is("shutting_down")).count();
    Summary::new("gate_sigterm_grace_runs_out")
        .field("chats", TURNS)
        .field("shutting_down", shutting_down)
        .field("exit_ms", exited_after.as_millis())
        .emit();
    assert_eq!(shutting_down, TURNS, "answers: {:?}", decisions(&answers));
    assert!(exit.success(), "chat-gate exited with {exit}");
    assert!(
        exited_after < grace + Duration::from_secs(10),
        "exited {exited_after:?} after SIGTERM, grace {grace:?}"
    );
}
