//! snapshot-store against a real nats-server and a real Postgres database.
//!
//! The ordering rules are decided by `store-core` and tested there one by
//! one, in process (`core/tests/rules.rs`). Here each rule has one test end
//! to end, through the SQL, locks and events that carry it out: stale run
//! (`stale_run_push_is_dropped_and_leaves_every_row_untouched`), stale
//! version (`a_late_or_replayed_initial_push_never_moves_the_run_back`),
//! phase regression and a new run starting over
//! (`the_phase_never_moves_back_within_a_run`), superseded startups
//! (`a_late_startup_of_a_replaced_run_is_dropped_and_changes_nothing`),
//! reclaims (`a_live_process_reclaims_its_agent_from_a_late_unknown_run`),
//! repeated startups (`revision_rises_by_one_per_accepted_write_and_not_for_dropped_ones`),
//! which events are published
//! (`discovery_event_is_published_exactly_when_phase_or_run_id_changes_after_commit`,
//! `the_event_state_equals_a_read_after_the_commit`) and resources kept or
//! replaced (`sources_absent_from_a_push_are_deleted`).

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::service_error::Code;
use ctxsync_proto::v1::*;
use ctxsync_runtime::rpc::RpcError;
use ctxsync_runtime::store::StoreClient;
use futures::{FutureExt, StreamExt};
use prost::Message;

const RUN_A: &str = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";
const RUN_B: &str = "5e4d3c2b-1a4b-4f9d-a1c7-e1d7c2f7b0aa";

fn dropped(reply: &StorePushReply) -> Option<PushDropReason> {
    let response = reply.response.as_ref().expect("push response");
    (!response.accepted).then(|| response.drop_reason())
}

#[tokio::test]
async fn phase_and_run_id_round_trip() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
    let state = h.state(&agent).await;
    assert_eq!(state.agent.as_ref().unwrap().agent_run_id, RUN_A);
    let snapshot = state.snapshot.unwrap();
    assert_eq!(snapshot.agent_run_id, RUN_A);
    assert_eq!(snapshot.phase(), Phase::Pending);
    assert_eq!(snapshot.version, 1);

    h.push_ok(&agent, complete(RUN_A, 2, vec![])).await;
    let snapshot = h.state(&agent).await.snapshot.unwrap();
    assert_eq!(snapshot.phase(), Phase::Complete);
    assert_eq!(snapshot.version, 2);
}

#[tokio::test]
async fn phase_is_unspecified_when_the_push_has_no_discovery_message() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.push_ok(
        &agent,
        push("", 0, false, None, vec![instruction("/w/AGENTS.md", "hi")]),
    )
    .await;
    let state = h.state(&agent).await;
    assert_eq!(state.snapshot.as_ref().unwrap().phase(), Phase::Unspecified);
    assert_eq!(sources(&state), ["instruction_file:/w/AGENTS.md"]);
}

#[tokio::test]
async fn stale_run_push_is_dropped_and_leaves_every_row_untouched() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    h.push_ok(
        &agent,
        complete(RUN_A, 1, vec![server("github", &["search"])]),
    )
    .await;
    let before = h.state(&agent).await;

    let reply = h
        .push(
            &agent,
            push(
                RUN_B,
                9,
                true,
                Some(Phase::Pending),
                vec![server("other", &["x"])],
            ),
        )
        .await;
    assert_eq!(dropped(&reply), Some(PushDropReason::StaleRun));
    assert!(reply.response.unwrap().message.contains(RUN_B));
    assert_eq!(h.state(&agent).await, before);
}

#[tokio::test]
async fn update_startup_overwrites_the_run_id_including_to_empty() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let first = h.startup(&agent, RUN_A).await.response.unwrap();
    assert!(first.run_id_changed);
    assert_eq!(first.previous_agent_run_id, "");
    let again = h.startup(&agent, RUN_A).await.response.unwrap();
    assert!(!again.run_id_changed);
    let second = h.startup(&agent, RUN_B).await.response.unwrap();
    assert_eq!(second.previous_agent_run_id, RUN_A);
    assert_eq!(h.state(&agent).await.agent.unwrap().agent_run_id, RUN_B);
    let cleared = h.startup(&agent, "").await.response.unwrap();
    assert!(cleared.run_id_changed);
    assert_eq!(h.state(&agent).await.agent.unwrap().agent_run_id, "");
}

#[tokio::test]
async fn oversized_run_id_is_refused_on_both_paths_and_changes_nothing() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    let before = h.state(&agent).await;
    let long = "r".repeat(65);

    let reply = h.startup(&agent, &long).await;
    let error = reply.error.expect("startup refused");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(
        error.message.contains("agent_run_id_bytes"),
        "{}",
        error.message
    );

    let reply = h.push(&agent, push(&long, 1, true, None, vec![])).await;
    let error = reply.error.expect("push refused");
    assert!(
        error.message.contains("over the limit of 64"),
        "{}",
        error.message
    );
    assert_eq!(h.state(&agent).await, before);

    // Exactly 64 bytes is fine.
    assert_eq!(h.startup(&agent, &"r".repeat(64)).await.error, None);
}

/// The issue's replay: v2 COMPLETE, then the same run's first push again
/// (late from a stalled replica, or replayed). `initial` is the first push
/// of a run, not a reset: it is an old version and changes nothing.
#[tokio::test]
async fn a_late_or_replayed_initial_push_never_moves_the_run_back() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    let first = push(RUN_A, 1, true, Some(Phase::Pending), vec![]);
    h.push_ok(&agent, first.clone()).await;
    h.push_ok(&agent, complete(RUN_A, 2, vec![server("s", &["t"])]))
        .await;
    let before = h.state(&agent).await;

    let reply = h.push(&agent, first).await;
    assert_eq!(dropped(&reply), Some(PushDropReason::StaleVersion));
    let after = h.state(&agent).await;
    assert_eq!(after, before);
    let snapshot = after.snapshot.unwrap();
    assert_eq!((snapshot.version, snapshot.phase()), (2, Phase::Complete));
}

#[tokio::test]
async fn the_phase_never_moves_back_within_a_run() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
    h.push_ok(&agent, complete(RUN_A, 2, vec![])).await;
    let before = h.state(&agent).await;
    for (version, phase) in [(3, Some(Phase::Pending)), (4, None)] {
        let reply = h
            .push(&agent, push(RUN_A, version, false, phase, vec![]))
            .await;
        assert_eq!(
            dropped(&reply),
            Some(PushDropReason::PhaseRegression),
            "version {version} with phase {phase:?}"
        );
        assert!(
            reply.response.unwrap().message.contains("PHASE_COMPLETE"),
            "the drop says what it would have moved back from"
        );
    }
    assert_eq!(h.state(&agent).await, before);
    // Forward within the run is still fine, and a new run starts over.
    h.push_ok(&agent, complete(RUN_A, 5, vec![])).await;
    h.startup(&agent, RUN_B).await;
    h.push_ok(&agent, pending(RUN_B, 1, vec![])).await;
}

fn startup_dropped(reply: &UpdateStartupReply) -> Option<StartupDropReason> {
    assert_eq!(reply.error, None);
    let response = reply.response.as_ref().expect("startup response");
    (response.drop_reason() != StartupDropReason::Unspecified).then(|| response.drop_reason())
}

/// The issue's first failure: the old process's Startup, executed late by a
/// replica that stalled while the agent process was replaced, used to put
/// the old run id back for good. A run the agent moved away from never
/// comes back by a startup, whatever the clocks say.
#[tokio::test]
async fn a_late_startup_of_a_replaced_run_is_dropped_and_changes_nothing() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let mut discovery = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;
    h.startup(&agent, RUN_A).await;
    h.push_ok(&agent, complete(RUN_A, 1, vec![server("old", &["t"])]))
        .await;
    h.startup(&agent, RUN_B).await;
    h.push_ok(&agent, pending(RUN_B, 1, vec![server("new", &["t"])]))
        .await;
    let before = h.state(&agent).await;

    let reply = h.startup(&agent, RUN_A).await;
    assert_eq!(
        startup_dropped(&reply),
        Some(StartupDropReason::SupersededRun)
    );
    let response = reply.response.unwrap();
    assert!(!response.run_id_changed);
    assert_eq!(response.previous_agent_run_id, RUN_B);
    assert!(response.message.contains(RUN_A), "{}", response.message);
    assert_eq!(h.state(&agent).await, before);
    // The live run's pushes go on being accepted, and the dropped startup
    // published nothing: the events are the two runs' and the last push's.
    h.push_ok(&agent, complete(RUN_B, 2, vec![server("new", &["t"])]))
        .await;
    let mut causes = Vec::new();
    for _ in 0..5 {
        let event = next_event(&mut discovery).await;
        causes.push((event.cause(), event.agent_run_id, event.snapshot_version));
    }
    use discovery_changed::Cause::{Push, Startup};
    assert_eq!(
        causes,
        [
            (Startup, RUN_A.to_owned(), 0),
            (Push, RUN_A.to_owned(), 1),
            (Startup, RUN_B.to_owned(), 1),
            (Push, RUN_B.to_owned(), 1),
            (Push, RUN_B.to_owned(), 2),
        ]
    );
}

/// What no rule without clocks can tell apart: a dead process's *first*
/// startup, executed after its successor's. It takes the agent for a while;
/// the live process, told its pushes are stale, reclaims the agent, and
/// the late run then counts as replaced like any other.
#[tokio::test]
async fn a_live_process_reclaims_its_agent_from_a_late_unknown_run() {
    const GHOST: &str = "9c1d2e3f-0000-4aaa-bbbb-cccccccccccc";
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_B).await;
    h.push_ok(&agent, complete(RUN_B, 1, vec![server("live", &["t"])]))
        .await;

    // The ghost's late first startup is indistinguishable from a new process.
    let reply = h.startup(&agent, GHOST).await;
    assert_eq!(startup_dropped(&reply), None);
    let reply = h
        .push(&agent, complete(RUN_B, 2, vec![server("live", &["t"])]))
        .await;
    assert_eq!(dropped(&reply), Some(PushDropReason::StaleRun));
    // A plain startup of the live run is dropped (RUN_B was superseded)...
    assert_eq!(
        startup_dropped(&h.startup(&agent, RUN_B).await),
        Some(StartupDropReason::SupersededRun)
    );
    // ...a reclaim takes it back, and the live report is accepted again.
    let reply = h.api.reclaim(&agent, RUN_B).await;
    assert_eq!(startup_dropped(&reply), None);
    let response = reply.response.unwrap();
    assert!(response.run_id_changed);
    assert_eq!(response.previous_agent_run_id, GHOST);
    h.push_ok(&agent, complete(RUN_B, 3, vec![server("live", &["t"])]))
        .await;
    let state = h.state(&agent).await;
    assert_eq!(state.agent.unwrap().agent_run_id, RUN_B);
    assert_eq!(state.snapshot.unwrap().version, 3);
    // Another late copy of the ghost's startup is now dropped.
    assert_eq!(
        startup_dropped(&h.startup(&agent, GHOST).await),
        Some(StartupDropReason::SupersededRun)
    );
    assert_eq!(h.state(&agent).await.agent.unwrap().agent_run_id, RUN_B);
}

#[tokio::test]
async fn a_reclaim_needs_a_run_id() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let reply = h.api.reclaim(&agent, "").await;
    let error = reply.error.expect("refused");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message.contains("reclaim"), "{}", error.message);
}

#[tokio::test]
async fn only_the_newest_superseded_runs_are_remembered() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let runs: Vec<String> = (0..105).map(|i| format!("run-{i:03}")).collect();
    for run in &runs {
        assert_eq!(startup_dropped(&h.startup(&agent, run).await), None);
    }
    let pool = sqlx::PgPool::connect(h.db.url()).await.unwrap();
    let kept: Vec<String> = sqlx::query_scalar(
        "SELECT agent_run_id FROM snapshot.superseded_runs ORDER BY agent_run_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // 104 runs were replaced; the 100 newest are kept.
    assert_eq!(kept, runs[4..104].to_vec());
}

/// A request its sender has given up on is not executed: here its budget
/// ran out before any replica picked it up.
#[tokio::test]
async fn a_request_past_its_deadline_is_dropped_unexecuted() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    let before = h.state(&agent).await;

    let request = StorePushRequest {
        agent_id: agent.clone(),
        push: Some(complete(RUN_A, 1, vec![server("s", &["t"])])),
    };
    // A budget of nothing: its sender stopped waiting as it sent it.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(ctxsync_runtime::rpc::TIMEOUT_HEADER, "0");
    let inbox = h.client.new_inbox();
    let mut replies = testkit::subscribe(&h.client, inbox.clone()).await;
    h.client
        .publish_with_reply_and_headers(
            h.subjects.store_push(),
            inbox,
            headers,
            request.encode_to_vec().into(),
        )
        .await
        .unwrap();
    // The subject carries this test's own prefix: the count is this request's.
    let series = format!(
        "ctxsync_rpc_expired_total{{subject=\"{}\"}}",
        h.subjects.store_push()
    );
    metric_reaches(&series, 1.0).await;
    assert!(
        replies.next().now_or_never().is_none(),
        "an expired request is not answered"
    );
    assert_eq!(h.state(&agent).await, before, "and not executed");
}

/// The deadline also bounds the wait for the agent's row lock (a replica
/// stalled inside a transaction): past it the push rolls back, and once the
/// lock is free nothing of it lands.
#[tokio::test]
async fn a_deadline_that_passes_in_a_lock_wait_writes_nothing() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    let before = h.state(&agent).await;

    // Another session holds the agent's row lock, as a stalled replica would.
    let pool = sqlx::PgPool::connect(h.db.url()).await.unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM snapshot.agents WHERE agent_id = $1::uuid FOR UPDATE")
        .bind(&agent)
        .execute(&mut *holder)
        .await
        .unwrap();

    let expired = "ctxsync_store_pushes_total{outcome=\"expired\"}";
    let expired_before = metric(expired);
    let answer = StoreClient::new(h.client.clone(), &h.subjects, Duration::from_millis(700))
        .push(&agent, complete(RUN_A, 1, vec![]), None)
        .await;
    // The sender gives up at its deadline; the store's own answer, sent at
    // the same deadline, may still arrive first: either way, nothing written.
    match answer {
        Err(RpcError::TimedOut { .. }) => {}
        Err(error) => assert_eq!(error.code(), Some(Code::DeadlineExceeded), "{error}"),
        Ok(response) => panic!("the push was answered {response:?}"),
    }
    // The store gives up at the deadline, while the lock is still held.
    metric_reaches(expired, expired_before + 1.0).await;
    holder.rollback().await.unwrap();
    assert_eq!(h.state(&agent).await, before);
}

#[tokio::test]
async fn sources_absent_from_a_push_are_deleted() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    h.push_ok(
        &agent,
        pending(
            RUN_A,
            1,
            vec![
                instruction("/w/AGENTS.md", "x"),
                server("a", &["t"]),
                server("b", &["u"]),
            ],
        ),
    )
    .await;
    h.push_ok(&agent, complete(RUN_A, 2, vec![server("b", &["u", "v"])]))
        .await;
    let state = h.state(&agent).await;
    assert_eq!(sources(&state), ["mcp_server:b"]);
    let Some(context_resource::Body::McpServer(b)) = &state.resources[0].body else {
        panic!("server body");
    };
    assert_eq!(b.tools.len(), 2);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM snapshot.resources")
        .fetch_one(&sqlx::PgPool::connect(h.db.url()).await.unwrap())
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

#[tokio::test]
async fn resources_round_trip_with_errors_and_warnings() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let mut failed = server("broken", &[]);
    failed.status = ResourceStatus::Invalid as i32;
    failed.error = "connect failed: [redacted]".into();
    let mut kept = server("kept", &["t"]);
    kept.warning = "reconnect failed; kept the previous connection".into();
    let resources = vec![failed, kept, instruction("/w/AGENTS.md", "be nice")];
    h.push_ok(
        &agent,
        push("", 1, true, Some(Phase::Complete), resources.clone()),
    )
    .await;
    assert_eq!(h.state(&agent).await.resources, resources);
}

/// Waits for the next message on `sub`, or fails after a deadline.
async fn next_message<M: Message + Default>(sub: &mut async_nats::Subscriber) -> M {
    let message = tokio::time::timeout(TIMEOUT, sub.next())
        .await
        .expect("an event within the deadline")
        .expect("subscription open");
    M::decode(message.payload).expect("event decodes")
}

/// The value of one metric series of this process (0 when absent).
fn metric(series: &str) -> f64 {
    ctxsync_runtime::metrics::handle()
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Waits (bounded) until `series` reaches `value`.
async fn metric_reaches(series: &str, value: f64) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    while metric(series) < value {
        assert!(
            std::time::Instant::now() < deadline,
            "{series} stayed at {} (waited for {value})",
            metric(series)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn next_event(sub: &mut async_nats::Subscriber) -> DiscoveryChanged {
    next_message(sub).await
}

#[tokio::test]
async fn discovery_event_is_published_exactly_when_phase_or_run_id_changes_after_commit() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let mut events = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;

    // Startup with a new run id: event.
    h.startup(&agent, RUN_A).await;
    let e = next_event(&mut events).await;
    assert_eq!(e.cause(), discovery_changed::Cause::Startup);
    assert_eq!(
        (e.agent_run_id.as_str(), e.previous_agent_run_id.as_str()),
        (RUN_A, "")
    );
    assert!(!e.has_snapshot);

    // First push: event (no snapshot before).
    h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
    let e = next_event(&mut events).await;
    assert_eq!((e.phase(), e.snapshot_version), (Phase::Pending, 1));

    // Same phase, new content; a dropped push; a repeated startup: no event.
    // The next event must be the phase change that follows them (NATS keeps
    // one publisher's order), which proves none was published in between.
    h.push_ok(&agent, pending(RUN_A, 2, vec![server("s", &["t"])]))
        .await;
    let reply = h.push(&agent, complete(RUN_A, 2, vec![])).await;
    assert_eq!(dropped(&reply), Some(PushDropReason::StaleVersion));
    h.startup(&agent, RUN_A).await;
    h.push_ok(&agent, complete(RUN_A, 3, vec![server("s", &["t"])]))
        .await;
    let e = next_event(&mut events).await;
    assert_eq!(
        (e.phase(), e.previous_phase(), e.snapshot_version),
        (Phase::Complete, Phase::Pending, 3)
    );
    // Unchanged re-push with a higher version: no event; then a restart: event.
    h.push_ok(&agent, complete(RUN_A, 4, vec![server("s", &["t"])]))
        .await;
    h.startup(&agent, RUN_B).await;
    let e = next_event(&mut events).await;
    assert_eq!(e.cause(), discovery_changed::Cause::Startup);
    assert_eq!(
        (e.agent_run_id.as_str(), e.snapshot_agent_run_id.as_str()),
        (RUN_B, RUN_A)
    );
}

#[tokio::test]
async fn a_reader_woken_by_the_event_sees_the_committed_state() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    let mut events = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;
    let pusher = {
        let store = h.api.clone();
        let agent = agent.clone();
        tokio::spawn(async move {
            for version in 1..=20u64 {
                let phase = if version == 20 {
                    Phase::Complete
                } else {
                    Phase::Pending
                };
                store
                    .push(
                        &agent,
                        push(
                            RUN_A,
                            version,
                            version == 1,
                            Some(phase),
                            vec![server("s", &[&format!("t{version}")])],
                        ),
                    )
                    .await;
            }
        })
    };
    for expected in [Phase::Pending, Phase::Complete] {
        let event = next_event(&mut events).await;
        assert_eq!(event.phase(), expected);
        // Read on the event: the snapshot is at least as new as the event says.
        let snapshot = h.state(&agent).await.snapshot.unwrap();
        assert!(snapshot.version >= event.snapshot_version);
        if expected == Phase::Complete {
            assert_eq!((snapshot.phase(), snapshot.version), (Phase::Complete, 20));
        }
    }
    pusher.await.unwrap();
}

#[tokio::test]
async fn two_replicas_racing_pushes_for_one_agent_end_consistent() {
    let h = StoreHarness::spawn_replicas(2).await;
    let agent = h.register("a").await;
    h.startup(&agent, RUN_A).await;
    let mut committed = testkit::subscribe(&h.client, h.subjects.snapshot_committed(&agent)).await;

    // 40 pushes of one run sent at once, in a scrambled order, shared by both replicas.
    let mut versions: Vec<u64> = (1..=40).collect();
    versions.reverse();
    versions.rotate_left(17);
    let (store, agent_id) = (&h.api, agent.as_str());
    let pushes = versions.iter().map(|&version| async move {
        let tools: Vec<String> = (0..version).map(|t| format!("t{t}")).collect();
        let tool_refs: Vec<&str> = tools.iter().map(String::as_str).collect();
        let reply = store
            .push(
                agent_id,
                push(
                    RUN_A,
                    version,
                    false,
                    Some(Phase::Pending),
                    vec![server(&format!("v{version}"), &tool_refs)],
                ),
            )
            .await;
        (version, reply.response.unwrap().accepted)
    });
    let outcomes = futures::future::join_all(pushes).await;
    assert!(outcomes.iter().any(|&(v, accepted)| v == 40 && accepted));

    // The final state is exactly version 40's: row and resources agree.
    let state = h.state(&agent).await;
    assert_eq!(state.snapshot.as_ref().unwrap().version, 40);
    assert_eq!(sources(&state), ["mcp_server:v40"]);
    let Some(context_resource::Body::McpServer(s)) = &state.resources[0].body else {
        panic!("server body");
    };
    assert_eq!(s.tools.len(), 40);

    // Every push that lost the race was dropped for its version, nothing else.
    for (version, accepted) in &outcomes {
        assert!(*accepted || *version < 40, "version {version}");
    }
    // The every-commit events carry each accepted version exactly once.
    let accepted = outcomes.iter().filter(|(_, a)| *a).count();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..accepted {
        let message = tokio::time::timeout(TIMEOUT, committed.next())
            .await
            .expect("commit event")
            .unwrap();
        assert!(seen.insert(SnapshotCommitted::decode(message.payload).unwrap().version));
    }
    assert!(seen.contains(&40));
}

#[tokio::test]
async fn unknown_agent_and_bad_agent_id_are_refused() {
    let h = StoreHarness::spawn().await;
    let reply = h
        .push(
            "5e4d3c2b-1a4b-4f9d-a1c7-e1d7c2f7b0aa",
            push("", 1, true, None, vec![]),
        )
        .await;
    assert_eq!(reply.error.unwrap().code(), Code::NotFound);
    let reply = h.push("not-a-uuid", push("", 1, true, None, vec![])).await;
    assert_eq!(reply.error.unwrap().code(), Code::InvalidArgument);
}

#[tokio::test]
async fn store_stops_gracefully_and_answers_nothing_after() {
    let mut h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    h.shutdown.cancel();
    for store in h.stores.drain(..) {
        tokio::time::timeout(Duration::from_secs(15), store.join())
            .await
            .expect("store stops within its grace");
    }
    let result = StoreClient::new(h.client.clone(), &h.subjects, Duration::from_secs(2))
        .agent_state(&agent)
        .await;
    assert!(
        matches!(result, Err(RpcError::NoResponders { .. })),
        "{result:?}"
    );
}

#[tokio::test]
async fn the_event_state_equals_a_read_after_the_commit() {
    let h = StoreHarness::spawn().await;
    let agent = h.register("a").await;
    let mut discovery = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;
    let mut committed = testkit::subscribe(&h.client, h.subjects.snapshot_committed(&agent)).await;

    // A startup with a new run id: the state rides on DiscoveryChanged.
    h.startup(&agent, RUN_A).await;
    let changed = next_event(&mut discovery).await;
    let read = h.state(&agent).await;
    assert!(read.snapshot.is_none());
    assert_eq!(changed.revision, read.revision);
    assert_eq!(changed.state, Some(read));

    // Content and phase change (the run's first push): on both events (a
    // watcher may take either first). Errors, warnings and non-ASCII text must survive as a read has them.
    let mut kept = server("kept", &["t"]);
    kept.warning = "reconnect failed; kept the previous connection".into();
    let first = vec![
        instruction("/w/AGENTS.md", "Sois bref — ✓"),
        failed_server("broken", "connect failed: [redacted]"),
        kept,
        skill("/w/.agents/skills/review", "review", "Review a change"),
    ];
    h.push_ok(&agent, pending(RUN_A, 1, first.clone())).await;
    let changed = next_event(&mut discovery).await;
    let commit: SnapshotCommitted = next_message(&mut committed).await;
    let read = h.state(&agent).await;
    assert_eq!(read.resources, first);
    assert_eq!(
        (changed.revision, commit.revision),
        (read.revision, read.revision)
    );
    assert_eq!(commit.state.as_ref(), Some(&read));
    assert_eq!(changed.state, Some(read));

    // Content changes, the phase stays: on SnapshotCommitted. No context
    // config in the push: a read has the default one.
    let mut same_phase = pending(RUN_A, 2, vec![server("s", &["t", "u"])]);
    same_phase.context_config = None;
    h.push_ok(&agent, same_phase).await;
    let commit: SnapshotCommitted = next_message(&mut committed).await;
    let read = h.state(&agent).await;
    assert_eq!(
        read.snapshot.as_ref().unwrap().context_config,
        Some(ContextConfig::default())
    );
    assert_eq!(commit.revision, read.revision);
    assert_eq!(commit.state, Some(read));

    // Content and phase change again: on both. DiscoveryChanged's revision shows
    // it is the first DiscoveryChanged since the first push's: the same-phase
    // push published none.
    h.push_ok(&agent, complete(RUN_A, 3, vec![server("s", &["t"])]))
        .await;
    let changed = next_event(&mut discovery).await;
    let commit: SnapshotCommitted = next_message(&mut committed).await;
    let read = h.state(&agent).await;
    assert_eq!(changed.phase(), Phase::Complete);
    assert_eq!(
        (changed.revision, commit.revision),
        (read.revision, read.revision)
    );
    assert_eq!(commit.state.as_ref(), Some(&read));
    assert_eq!(changed.state, Some(read));

    // An unchanged re-push is announced too: its version moved.
    h.push_ok(&agent, complete(RUN_A, 4, vec![server("s", &["t"])]))
        .await;
    let commit: SnapshotCommitted = next_message(&mut committed).await;
    let read = h.state(&agent).await;
    assert_eq!(commit.version, 4);
    assert_eq!(commit.state, Some(read));

    // A restart over a stored snapshot: on DiscoveryChanged.
    h.startup(&agent, RUN_B).await;
    let changed = next_event(&mut discovery).await;
    let read = h.state(&agent).await;
    assert_eq!(changed.cause(), discovery_changed::Cause::Startup);
    assert_eq!(read.snapshot.as_ref().unwrap().agent_run_id, RUN_A);
    assert_eq!(changed.revision, read.revision);
    assert_eq!(changed.state, Some(read));
}

#[tokio::test]
async fn revision_rises_by_one_per_accepted_write_and_not_for_dropped_ones() {
    let h = StoreHarness::spawn_replicas(2).await;
    let agent = h.register("a").await;
    let revision = |state: AgentState| state.revision;
    assert_eq!(revision(h.state(&agent).await), 0);

    h.startup(&agent, RUN_A).await;
    assert_eq!(revision(h.state(&agent).await), 1);
    h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
    assert_eq!(revision(h.state(&agent).await), 2);

    // Dropped for its version, for its run, refused as invalid: no change.
    let reply = h
        .push(&agent, push(RUN_A, 1, false, Some(Phase::Pending), vec![]))
        .await;
    assert_eq!(dropped(&reply), Some(PushDropReason::StaleVersion));
    let reply = h.push(&agent, pending(RUN_B, 1, vec![])).await;
    assert_eq!(dropped(&reply), Some(PushDropReason::StaleRun));
    let reply = h.push(&agent, pending(&"r".repeat(65), 1, vec![])).await;
    assert!(reply.error.is_some());
    assert_eq!(revision(h.state(&agent).await), 2);

    // A repeated startup of the current run writes nothing (live agents
    // re-announce themselves periodically); an unchanged re-push is a write.
    h.startup(&agent, RUN_A).await;
    assert_eq!(revision(h.state(&agent).await), 2);
    h.push_ok(&agent, pending(RUN_A, 2, vec![])).await;
    assert_eq!(revision(h.state(&agent).await), 3);

    // Racing pushes on two replicas: each accepted one takes the next
    // revision, none shares one, the dropped ones take none.
    let mut committed = testkit::subscribe(&h.client, h.subjects.snapshot_committed(&agent)).await;
    let mut versions: Vec<u64> = (3..=30).collect();
    versions.reverse();
    versions.rotate_left(11);
    let (store, agent_id) = (&h.api, agent.as_str());
    let pushes = versions.iter().map(|&version| async move {
        let tool = format!("t{version}");
        let reply = store
            .push(
                agent_id,
                pending(RUN_A, version, vec![server("s", &[&tool])]),
            )
            .await;
        reply.response.expect("push response").accepted
    });
    let accepted = futures::future::join_all(pushes)
        .await
        .into_iter()
        .filter(|&accepted| accepted)
        .count() as u64;
    assert!(accepted >= 1);
    let state = h.state(&agent).await;
    assert_eq!(state.revision, 3 + accepted);
    let mut revisions = Vec::new();
    for _ in 0..accepted {
        let commit: SnapshotCommitted = next_message(&mut committed).await;
        revisions.push(commit.revision);
    }
    revisions.sort_unstable();
    assert_eq!(revisions, (4..=3 + accepted).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_state_over_the_event_limit_is_left_out_and_read_instead() {
    let h = StoreHarness::spawn_with_event_state_max_bytes(2048).await;
    let agent = h.register("a").await;
    let mut discovery = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;
    let mut committed = testkit::subscribe(&h.client, h.subjects.snapshot_committed(&agent)).await;

    // A small state still rides.
    h.startup(&agent, RUN_A).await;
    let changed = next_event(&mut discovery).await;
    assert_eq!(changed.state, Some(h.state(&agent).await));

    let big = vec![instruction("/w/AGENTS.md", &"Be brief. ".repeat(1000))];
    h.push_ok(&agent, pending(RUN_A, 1, big.clone())).await;
    let changed = next_event(&mut discovery).await;
    let commit: SnapshotCommitted = next_message(&mut committed).await;
    assert_eq!((changed.state, commit.state), (None, None));
    let read = h.state(&agent).await;
    assert!(read.encoded_len() > 2048);
    assert_eq!(read.resources, big);
    assert_eq!(
        (changed.revision, commit.revision),
        (read.revision, read.revision)
    );

    // Same phase, still too big: SnapshotCommitted goes out without it too.
    let mut bigger = big.clone();
    bigger.push(server("s", &["t"]));
    h.push_ok(&agent, pending(RUN_A, 2, bigger)).await;
    let commit: SnapshotCommitted = next_message(&mut committed).await;
    assert_eq!(commit.state, None);
    assert_eq!(commit.revision, h.state(&agent).await.revision);

    let metrics = ctxsync_runtime::metrics::handle().render();
    assert!(
        metrics.contains("ctxsync_store_event_state_omitted_total"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_event_state_limit_of_zero_never_attaches_the_state() {
    let h = StoreHarness::spawn_with_event_state_max_bytes(0).await;
    let agent = h.register("a").await;
    let mut discovery = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;
    h.startup(&agent, RUN_A).await;
    let changed = next_event(&mut discovery).await;
    assert_eq!(changed.state, None);
    assert_eq!(changed.revision, h.state(&agent).await.revision);
}
