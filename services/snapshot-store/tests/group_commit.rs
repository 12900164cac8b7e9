//! Group commit: several agents' pushes in one transaction, each with the
//! answer, the rows and the events it would have had alone, against a real
//! Postgres database (and a real nats-server for the whole path).

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;
use snapshot_store::db::BatchOutcome;
use snapshot_store::{PushBatcher, PushOutcome, Store, StoreError};
use sqlx::{PgPool, Postgres, Transaction};
use testkit::TestDatabase;
use uuid::Uuid;

const RUN_A: &str = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";
const RUN_B: &str = "5e4d3c2b-1a4b-4f9d-a1c7-e1d7c2f7b0aa";

async fn store() -> (TestDatabase, PgPool, Store) {
    let db = TestDatabase::create().await;
    let pool = PgPool::connect(db.url()).await.expect("database connects");
    Store::migrate(&pool).await.expect("migrations run");
    let store = Store::new(pool.clone());
    (db, pool, store)
}

/// An agent named `name`, started on `run_id`.
async fn agent(store: &Store, name: &str, run_id: &str) -> Uuid {
    let digest: Vec<u8> = Uuid::new_v4()
        .as_bytes()
        .iter()
        .chain(Uuid::new_v4().as_bytes())
        .copied()
        .collect();
    let id = store
        .register("acme", "ws1", name, &digest)
        .await
        .expect("agent registers");
    let startup = StartupRequest {
        agent_run_id: run_id.into(),
        ..Default::default()
    };
    store
        .update_startup(id, &startup, None)
        .await
        .expect("startup");
    id
}

fn done(outcome: &BatchOutcome) -> &Result<PushOutcome, StoreError> {
    match outcome {
        BatchOutcome::Done(outcome) => outcome,
        BatchOutcome::Unlocked(push) => panic!("push v{} handed back unanswered", push.version),
    }
}

fn accepted(outcome: &Result<PushOutcome, StoreError>) -> &AgentState {
    match outcome {
        Ok(PushOutcome::Accepted { state, .. }) => state,
        other => panic!("expected an accepted push, got {other:?}"),
    }
}

fn dropped_for(outcome: &Result<PushOutcome, StoreError>) -> PushDropReason {
    match outcome {
        Ok(PushOutcome::Dropped { reason, .. }) => *reason,
        other => panic!("expected a dropped push, got {other:?}"),
    }
}

#[tokio::test]
async fn one_batch_gives_each_push_the_answer_rows_and_revision_it_would_have_alone() {
    let (_db, pool, store) = store().await;
    let fresh = agent(&store, "fresh", RUN_A).await;
    let stale_run = agent(&store, "stale-run", RUN_A).await;
    let stale_version = agent(&store, "stale-version", RUN_A).await;
    let unchanged = agent(&store, "unchanged", RUN_A).await;
    let invalid = agent(&store, "invalid", RUN_A).await;
    let unknown = Uuid::new_v4();
    for id in [stale_version, unchanged] {
        store
            .push(id, pending(RUN_A, 5, vec![server("s", &["t"])]), None)
            .await
            .expect("first push");
    }
    let revision = |id| {
        let store = store.clone();
        async move { store.agent_state(id).await.expect("state").revision }
    };
    let before: Vec<u64> = futures::future::join_all(
        [fresh, stale_run, stale_version, unchanged, invalid]
            .into_iter()
            .map(revision),
    )
    .await;

    let batch = vec![
        (
            fresh,
            complete(
                RUN_A,
                1,
                vec![server("a", &["x"]), instruction("/w/AGENTS.md", "brief")],
            ),
        ),
        (stale_run, pending(RUN_B, 9, vec![server("b", &["y"])])),
        (stale_version, pending(RUN_A, 5, vec![server("c", &["z"])])),
        // Same content, a later version: written, its resources kept.
        (unchanged, pending(RUN_A, 6, vec![server("s", &["t"])])),
        (invalid, pending(&"r".repeat(65), 1, vec![])),
        (unknown, pending(RUN_A, 1, vec![])),
    ];
    let mut connection = pool.acquire().await.unwrap();
    let outcomes = store
        .push_batch(&mut connection, batch, None)
        .await
        .expect("batch commits");
    assert_eq!(outcomes.len(), 6);

    // Each answer is the one a push alone gets, in the batch's order.
    let fresh_state = accepted(done(&outcomes[0]));
    assert_eq!(dropped_for(done(&outcomes[1])), PushDropReason::StaleRun);
    assert_eq!(
        dropped_for(done(&outcomes[2])),
        PushDropReason::StaleVersion
    );
    let unchanged_state = accepted(done(&outcomes[3]));
    assert!(
        matches!(done(&outcomes[4]), Err(StoreError::Invalid(e)) if e.to_string().contains("64")),
        "{:?}",
        outcomes[4]
    );
    // No row to lock: handed back, for a push alone to answer "not found".
    assert!(matches!(&outcomes[5], BatchOutcome::Unlocked(p) if p.version == 1));

    // The state an accepted push answers with is what a read returns now.
    assert_eq!(fresh_state, &store.agent_state(fresh).await.unwrap());
    assert_eq!(
        unchanged_state,
        &store.agent_state(unchanged).await.unwrap()
    );
    assert_eq!(
        sources(fresh_state),
        ["mcp_server:a", "instruction_file:/w/AGENTS.md"]
    );
    assert_eq!(unchanged_state.snapshot.as_ref().unwrap().version, 6);
    assert_eq!(
        fresh_state.snapshot.as_ref().unwrap().phase(),
        Phase::Complete
    );

    // Written agents rose by one revision; dropped and refused ones by none,
    // and their rows are as they were.
    let after: Vec<u64> = futures::future::join_all(
        [fresh, stale_run, stale_version, unchanged, invalid]
            .into_iter()
            .map(revision),
    )
    .await;
    assert_eq!(
        after,
        [
            before[0] + 1,
            before[1],
            before[2],
            before[3] + 1,
            before[4]
        ]
    );
    assert!(
        store
            .agent_state(stale_run)
            .await
            .unwrap()
            .snapshot
            .is_none()
    );
    let kept = store.agent_state(stale_version).await.unwrap();
    assert_eq!(kept.snapshot.as_ref().unwrap().version, 5);
    assert_eq!(sources(&kept), ["mcp_server:s"]);

    // A batch of dropped pushes only: rolled back, no revision moves.
    let all_dropped = vec![
        (stale_run, pending(RUN_B, 10, vec![])),
        (unchanged, pending(RUN_A, 6, vec![])),
    ];
    let mut connection = pool.acquire().await.unwrap();
    let outcomes = store
        .push_batch(&mut connection, all_dropped, None)
        .await
        .expect("batch");
    assert_eq!(dropped_for(done(&outcomes[0])), PushDropReason::StaleRun);
    assert_eq!(
        dropped_for(done(&outcomes[1])),
        PushDropReason::StaleVersion
    );
    let again: Vec<u64> = futures::future::join_all(
        [fresh, stale_run, stale_version, unchanged, invalid]
            .into_iter()
            .map(revision),
    )
    .await;
    assert_eq!(again, after);
}

/// Another replica, stalled while holding `agent`'s row lock (until the
/// transaction returned is rolled back).
async fn replica_stalled_holding(pool: &PgPool, agent: Uuid) -> Transaction<'static, Postgres> {
    let mut stalled = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM snapshot.agents WHERE agent_id = $1 FOR UPDATE")
        .bind(agent)
        .execute(&mut *stalled)
        .await
        .unwrap();
    stalled
}

#[tokio::test]
async fn a_batch_never_waits_for_an_agent_locked_elsewhere_and_hands_its_push_back() {
    let (_db, pool, store) = store().await;
    let free = agent(&store, "free", RUN_A).await;
    let held = agent(&store, "held", RUN_A).await;

    let stalled = replica_stalled_holding(&pool, held).await;

    // No deadline: a batch that waited for the lock would never return.
    let batch = vec![
        (free, pending(RUN_A, 1, vec![server("a", &["x"])])),
        (held, pending(RUN_A, 1, vec![server("b", &["y"])])),
    ];
    let mut connection = pool.acquire().await.unwrap();
    let outcomes = tokio::time::timeout(TIMEOUT, store.push_batch(&mut connection, batch, None))
        .await
        .expect("the batch does not wait for the held row")
        .expect("batch commits");
    let state = accepted(done(&outcomes[0]));
    assert_eq!(state, &store.agent_state(free).await.unwrap());
    let BatchOutcome::Unlocked(handed_back) = &outcomes[1] else {
        panic!("the held agent's push must come back: {:?}", outcomes[1]);
    };
    assert_eq!(handed_back.resources, [server("b", &["y"])]);
    stalled.rollback().await.unwrap();
    let held_state = store.agent_state(held).await.unwrap();
    assert!(held_state.snapshot.is_none());
    assert_eq!(held_state.revision, 1);
}

/// Waits (bounded) until a backend of `pool`'s database waits for a row lock.
async fn a_lock_wait_starts(pool: &PgPool) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "no lock wait started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_push_waiting_for_a_row_lock_holds_up_no_other_agents_push() {
    let (_db, pool, store) = store().await;
    let free = agent(&store, "free", RUN_A).await;
    let held = agent(&store, "held", RUN_A).await;
    let stalled = replica_stalled_holding(&pool, held).await;

    // One transaction slot only: were it held by the waiting push, the free
    // agent's push could not go until the lock is released.
    let pushes = PushBatcher::start(store.clone(), 1);
    let held_push = tokio::spawn({
        let pushes = pushes.clone();
        async move {
            pushes
                .push(held, pending(RUN_A, 1, vec![server("b", &["y"])]), None)
                .await
        }
    });
    a_lock_wait_starts(&pool).await;
    let free_outcome = tokio::time::timeout(
        TIMEOUT,
        pushes.push(free, pending(RUN_A, 1, vec![server("a", &["x"])]), None),
    )
    .await
    .expect("the free agent's push is not held up");
    assert_eq!(sources(accepted(&free_outcome)), ["mcp_server:a"]);
    assert!(!held_push.is_finished(), "the held agent's push waits");

    // Released, the waiting push lands.
    stalled.rollback().await.unwrap();
    let held_outcome = tokio::time::timeout(TIMEOUT, held_push)
        .await
        .expect("the held agent's push lands once released")
        .unwrap();
    assert_eq!(
        accepted(&held_outcome),
        &store.agent_state(held).await.unwrap()
    );
}

/// The batcher's connections (its own, outside the pool), as Postgres sees them.
async fn batcher_connections(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(snapshot_store::push_batch::PUSH_CONNECTION_NAME)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Postgres drops the batcher's connection (a restart, an operator's
/// pg_terminate_backend): the next pushes are accepted all the same. The
/// dead connection is found by the batch failing on it (each push is then
/// committed alone, through the pool) or, after a second idle, by the ping
/// before use; either way the batcher opens a new one.
#[tokio::test]
async fn pushes_go_on_when_postgres_drops_the_batchers_connection() {
    let (_db, pool, store) = store().await;
    let id = agent(&store, "a", RUN_A).await;
    let pushes = PushBatcher::start(store.clone(), 1);
    let push = |version: u64| {
        let pushes = pushes.clone();
        async move {
            let tool = format!("t{version}");
            pushes
                .push(
                    id,
                    pending(RUN_A, version, vec![server("s", &[&tool])]),
                    None,
                )
                .await
        }
    };
    assert_eq!(sources(accepted(&push(1).await)), ["mcp_server:s"]);
    assert_eq!(
        batcher_connections(&pool).await,
        1,
        "one connection per slot"
    );

    // In the select list, so that it runs for the filtered rows only.
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(snapshot_store::push_batch::PUSH_CONNECTION_NAME)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(terminated, [true]);
    let deadline = std::time::Instant::now() + TIMEOUT;
    while batcher_connections(&pool).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the backend did not go"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    for version in [2, 3] {
        let outcome = tokio::time::timeout(TIMEOUT, push(version))
            .await
            .expect("answered");
        assert_eq!(accepted(&outcome), &store.agent_state(id).await.unwrap());
        assert_eq!(
            accepted(&outcome).snapshot.as_ref().map(|s| s.version),
            Some(version)
        );
    }
    assert_eq!(batcher_connections(&pool).await, 1, "a new one replaced it");
}

#[tokio::test]
async fn concurrent_pushes_over_two_replicas_are_batched_and_each_lands_once() {
    // One push transaction per replica, so concurrent pushes must share.
    let h = StoreHarness::spawn_with(2, |config| config.push_transactions = 1).await;
    const AGENTS: usize = 24;
    const VERSIONS: u64 = 6;
    let mut agents = Vec::with_capacity(AGENTS);
    for n in 0..AGENTS {
        let id = h.register(&format!("agent-{n}")).await;
        h.startup(&id, RUN_A).await;
        agents.push(id);
    }
    let mut committed = testkit::subscribe(&h.client, h.subjects.snapshot_committed_all()).await;
    let batches_before = batch_count();

    // Each agent pushes its versions in order, as a workspace agent does;
    // all agents at once.
    let api = &h.api;
    let runs = agents.iter().map(|agent| async move {
        for version in 1..=VERSIONS {
            let tool = format!("t{version}");
            let reply = api
                .push(agent, pending(RUN_A, version, vec![server("s", &[&tool])]))
                .await;
            assert!(
                reply.response.as_ref().is_some_and(|r| r.accepted),
                "{agent} v{version}: {reply:?}"
            );
        }
    });
    futures::future::join_all(runs).await;

    // Every push landed, and each agent's revision counts its writes.
    for agent in &agents {
        let state = h.state(agent).await;
        assert_eq!(state.snapshot.as_ref().unwrap().version, VERSIONS);
        assert_eq!(state.revision, 1 + VERSIONS);
        assert_eq!(state.resources, [server("s", &[&format!("t{VERSIONS}")])]);
    }
    // One commit event per accepted push, none twice.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..AGENTS * VERSIONS as usize {
        let event: SnapshotCommitted = next_message(&mut committed).await;
        assert!(seen.insert((event.agent_id, event.version)));
    }
    assert!(
        batch_count() > batches_before,
        "no push was committed in a batch"
    );
}

async fn next_message<M: prost::Message + Default>(sub: &mut async_nats::Subscriber) -> M {
    use futures::StreamExt;
    let message = tokio::time::timeout(TIMEOUT, sub.next())
        .await
        .expect("an event within the deadline")
        .expect("subscription open");
    M::decode(message.payload).expect("event decodes")
}

/// Batches committed by this process's stores so far.
fn batch_count() -> f64 {
    ctxsync_runtime::metrics::handle()
        .render()
        .lines()
        .find_map(|line| {
            line.strip_prefix("ctxsync_store_push_batch_size_count")?
                .trim_start_matches(|c| c != ' ')
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

#[tokio::test]
async fn push_transactions_outside_one_to_the_pool_size_fail_the_start_naming_the_env_var() {
    // Refused before anything is reached: neither address needs to answer.
    for (value, connections) in [(0, 16), (17, 16), (4, 3)] {
        let mut config = snapshot_store::Config::new(
            ctxsync_runtime::CommonArgs::for_nats("nats://127.0.0.1:1", "pfx"),
            "postgres://nobody@127.0.0.1:1/none",
        );
        config.push_transactions = value;
        config.database.db_max_connections = connections;
        let Err(error) = snapshot_store::start(config, ctxsync_runtime::Shutdown::new()).await
        else {
            panic!("{value} push transactions over {connections} connections started");
        };
        assert_eq!(
            error.to_string(),
            format!(
                "invalid CTXSYNC_STORE_PUSH_TRANSACTIONS {value}: \
                 must be from 1 to the pool's connections ({connections})"
            )
        );
    }
}
