//! kill -9 of a store replica during a burst of pushes, twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{Cluster, READY_WITHIN, Summary, all_ready, check_pushes, tagged_push, url_of};
use testkit::agent::{FakeAgent, stored_agents};
use testkit::{NatsServer, TestDatabase};

const AGENTS: usize = 25;
/// 2,000 pushes in all.
const PUSHES_PER_AGENT: u64 = 80;
/// Agents hold here until the first killed replica is back, so the second
/// kill also lands inside the burst however fast the machine pushes.
const HOLD_AT_VERSION: u64 = PUSHES_PER_AGENT * 3 / 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_replica_killed_twice_during_a_burst_loses_no_acked_push() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let mut store_a = cluster.store("store-a").spawn();
    let mut store_b = cluster.store("store-b").spawn();
    // What the killed replica held is answered 503 after this.
    let mut ingest = cluster.ingest().env("CTXSYNC_STORE_TIMEOUT", "2s").spawn();
    all_ready(&mut [&mut store_a, &mut store_b, &mut ingest]).await;
    let nats_client = cluster.nats("faults-test").await;
    let store = cluster.store_client(&nats_client.client);
    let ingest_url = url_of(&ingest);

    let mut agents = Vec::with_capacity(AGENTS);
    for i in 0..AGENTS {
        let mut agent = FakeAgent::register(&store, &ingest_url, &format!("burst-{i}")).await;
        let answer = agent.startup().await.answer.clone();
        assert!(answer.is_accepted(), "startup of agent {i}: {answer:?}");
        agents.push(agent);
    }

    let answered = Arc::new(AtomicU64::new(0));
    let (open, opened) = tokio::sync::watch::channel(false);
    let burst: Vec<_> = agents
        .into_iter()
        .map(|mut agent| {
            let answered = answered.clone();
            let mut opened = opened.clone();
            tokio::spawn(async move {
                for version in 1..=PUSHES_PER_AGENT {
                    if version == HOLD_AT_VERSION + 1 {
                        tokio::time::timeout(Duration::from_secs(120), opened.wait_for(|o| *o))
                            .await
                            .expect("the rest of the burst is released within 120 s")
                            .expect("the release channel is open");
                    }
                    let phase = if version == PUSHES_PER_AGENT {
                        Phase::Complete
                    } else {
                        Phase::Pending
                    };
                    let push = tagged_push(agent.run_id(), version, phase);
                    agent.push(&push).await;
                    answered.fetch_add(1, Ordering::SeqCst);
                }
                (agent.agent_id().to_owned(), agent.into_history())
            })
        })
        .collect();

    let total = AGENTS as u64 * PUSHES_PER_AGENT;
    let mut recover = Duration::ZERO;
    for (kill, at) in [(1, total / 3), (2, total * 7 / 10)] {
        let progress = answered.clone();
        faults::wait_until(
            &format!("{at} pushes answered before kill {kill}"),
            Duration::from_secs(120),
            || {
                let progress = progress.clone();
                async move {
                    let n = progress.load(Ordering::SeqCst);
                    if n >= at {
                        Ok(())
                    } else {
                        Err(format!("{n} answered"))
                    }
                }
            },
        )
        .await;
        store_a.kill();
        let killed_at = Instant::now();
        store_a.restart();
        store_a.wait_ready(READY_WITHIN).await;
        recover = recover.max(killed_at.elapsed());
        open.send_replace(true);
    }

    let mut histories = Vec::with_capacity(AGENTS);
    for task in burst {
        let finished = tokio::time::timeout(Duration::from_secs(180), task)
            .await
            .expect("the burst ends within 180 s")
            .expect("an agent task");
        histories.push(finished);
    }
    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let ids: Vec<String> = histories.iter().map(|(id, _)| id.clone()).collect();
    let stored = stored_agents(&pool, &ids).await.unwrap();
    let check = check_pushes(&histories, &stored, 1);
    Summary::new("store_kill9_during_burst")
        .field("agents", AGENTS)
        .field("kills", 2)
        .field("sent", check.sent)
        .field("acked", check.acked)
        .field("unanswered", check.unanswered)
        .field("stored", check.stored)
        .field("lost", check.lost)
        .field("recover_ms", recover.as_millis())
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
    assert!(
        check.acked >= total - 200,
        "only {} of {total} pushes were acked: the replica that stayed up should answer nearly all",
        check.acked
    );
}
