//! The test's own Postgres killed (SIGKILL, every backend) and restarted
//! while agents push and chats wait.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{
    Cluster, Summary, addr_of, all_ready, check_pushes, first_turns_both_ways, pending_agents,
    push_until_answered, tagged_push, url_of, wait_gauge, wait_until,
};
use testkit::agent::{Answer, FakeAgent, stored_agents};
use testkit::{NatsServer, PrivatePostgres};

const LOAD_AGENTS: usize = 8;
/// Each has one chat waiting over HTTP and one over NATS.
const CHAT_AGENTS: usize = 6;
/// Bounds of one load agent's loop.
const MAX_LOAD_PUSHES: u64 = 3_000;
const LOAD_FOR_AT_MOST: Duration = Duration::from_secs(150);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_and_restarted_under_load_loses_no_acked_push_and_answers_waiting_chats() {
    testkit::init_logs();
    let mut postgres = PrivatePostgres::start().await;
    let nats = NatsServer::start();
    let cluster = Cluster::new(nats.url(), &postgres.url());
    let mut store = cluster.store("store").spawn();
    let mut ingest = cluster.ingest().env("CTXSYNC_STORE_TIMEOUT", "2s").spawn();
    let mut gate = cluster
        .gate("gate")
        .env("CTXSYNC_GATE_PENDING_TIMEOUT", "120s")
        .spawn();
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    let pids = [store.pid(), ingest.pid(), gate.pid()];
    let nats_client = cluster.nats("faults-test").await;
    let store_client = cluster.store_client(&nats_client.client);
    store_client.create_test_tenant_key().await;
    let ingest_url = url_of(&ingest);

    // Chats wait on agents whose discovery is pending.
    let mut chat_agents = pending_agents(&store_client, &ingest_url, "chat", CHAT_AGENTS).await;
    let chats = first_turns_both_ways(
        &cluster.http,
        addr_of(&gate),
        &nats_client.client,
        &cluster.subjects,
        &chat_agents,
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

    // Load: agents push one report after another until told to stop.
    let mut load_agents = Vec::new();
    for i in 0..LOAD_AGENTS {
        let mut agent = FakeAgent::register(&store_client, &ingest_url, &format!("load-{i}")).await;
        assert!(agent.startup().await.answer.is_accepted());
        load_agents.push(agent);
    }
    let accepted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = load_agents
        .into_iter()
        .map(|mut agent| {
            let (accepted, stop) = (accepted.clone(), stop.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                for version in 1..=MAX_LOAD_PUSHES {
                    if stop.load(Ordering::SeqCst) || started.elapsed() > LOAD_FOR_AT_MOST {
                        break;
                    }
                    let push = tagged_push(agent.run_id(), version, Phase::Pending);
                    match agent.push(&push).await.answer {
                        Answer::Accepted => {
                            accepted.fetch_add(1, Ordering::SeqCst);
                        }
                        // Back off as an agent does while the store is down.
                        Answer::ServerError(..) | Answer::Transport(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        _ => {}
                    }
                }
                (agent.agent_id().to_owned(), agent.into_history())
            })
        })
        .collect();
    let count = |at_least: u64| {
        let accepted = accepted.clone();
        move || {
            let accepted = accepted.clone();
            async move {
                let n = accepted.load(Ordering::SeqCst);
                if n >= at_least {
                    Ok(n)
                } else {
                    Err(format!("{n} accepted"))
                }
            }
        }
    };
    wait_until("the load is under way", Duration::from_secs(60), count(100)).await;

    postgres.kill_hard();
    let killed_at = Instant::now();
    let store_addr = addr_of(&store);
    let http = cluster.http.clone();
    wait_until(
        "the store reports Postgres down",
        Duration::from_secs(30),
        || {
            let http = http.clone();
            async move {
                match http.get(format!("http://{store_addr}/readyz")).send().await {
                    Ok(r) if !r.status().is_success() => Ok(()),
                    Ok(r) => Err(format!("/readyz {}", r.status())),
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await;
    postgres.restart().await;
    let back_at = Instant::now();
    let outage = back_at - killed_at;

    // Every service recovers by itself: ready again, pushes accepted again.
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    let before = accepted.load(Ordering::SeqCst);
    wait_until(
        "pushes are accepted again",
        Duration::from_secs(60),
        count(before + 1),
    )
    .await;
    let recover = back_at.elapsed();
    assert_eq!(
        [store.pid(), ingest.pid(), gate.pid()],
        pids,
        "a service was restarted"
    );

    // Discovery completes after the restart: the waiting chats are answered.
    for agent in &mut chat_agents {
        let complete = tagged_push(agent.run_id(), 2, Phase::Complete);
        push_until_answered(agent, &complete, 100).await;
    }
    let mut woken = 0;
    let mut decisions = Vec::new();
    for chat in chats {
        let answer = tokio::time::timeout(Duration::from_secs(60), chat)
            .await
            .expect("a waiting chat is answered within 60 s of completion")
            .expect("chat task");
        if answer.is("ready") {
            woken += 1;
        }
        decisions.push(format!("{:?} {}", answer.via, answer.decision()));
    }

    stop.store(true, Ordering::SeqCst);
    let mut histories = Vec::new();
    for task in load {
        let finished = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the load stops within 60 s")
            .expect("load task");
        histories.push(finished);
    }
    for agent in chat_agents {
        histories.push((agent.agent_id().to_owned(), agent.into_history()));
    }
    let pool = sqlx::PgPool::connect(&postgres.url()).await.unwrap();
    let ids: Vec<String> = histories.iter().map(|(id, _)| id.clone()).collect();
    let stored = stored_agents(&pool, &ids).await.unwrap();
    let check = check_pushes(&histories, &stored, 1);
    Summary::new("postgres_kill9_restart")
        .field("sent", check.sent)
        .field("acked", check.acked)
        .field("unanswered", check.unanswered)
        .field("stored", check.stored)
        .field("lost", check.lost)
        .field("chats", waiting)
        .field("woken", woken)
        .field("outage_ms", outage.as_millis())
        .field("recover_ms", recover.as_millis())
        .emit();
    assert!(
        check.problems.is_empty(),
        "{} problems:\n{}",
        check.problems.len(),
        check.problems.join("\n")
    );
    assert_eq!(check.lost, 0);
    assert!(check.unanswered > 0, "the outage was never seen by a push");
    assert_eq!(
        woken, waiting,
        "every waiting chat is answered ready: {decisions:?}"
    );
}
