//! The gate's decisions, attempts and projections, against its core in
//! process: agents' states kept in memory the way snapshot-store commits
//! them (each commit a new revision, handed to the core as the store's event
//! would be, with its state), and time paused, so every timeout is exact and
//! none takes real time. No nats-server, no Postgres: what needs them (event
//! ordering, gaps, the APIs, end to end) is in chat-gate's `tests/gate.rs` and
//! the others.

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;
use gate_core::projection;
use gate_core::{EventUpdate, ReadError};
use testkit::report::{complete, failed_server, instruction, invalid_config, pending, push, skill};
use tokio::time::Instant;

// ---- decisions -------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn already_complete_answers_ready_at_once() {
    let core = Core::new();
    let agent = core.agent_reporting(complete(RUN_A, 1, vec![server("github", &["search"])]));

    let started = Instant::now();
    let reply = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(started.elapsed(), Duration::ZERO, "no wait at all");
    assert_eq!(tool_names(&reply), ["github__search"]);
    let p = projection_of(&reply);
    assert_eq!(p.phase(), Phase::Complete);
    assert!(!p.stale && !p.wait_timed_out);
    assert_eq!(core.gate.attempts_started(), 0, "nothing waited");
}

#[tokio::test(start_paused = true)]
async fn legacy_agent_answers_immediately_with_phase_unspecified() {
    let core = Core::new();
    let agent = core.register();
    core.startup(&agent, "");
    // No snapshot at all, and the waits are 20 s: a legacy agent still doesn't wait.
    let started = Instant::now();
    let reply = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&reply), GateDecision::Legacy);
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(projection_of(&reply).phase(), Phase::Unspecified);

    core.push(&agent, push("", 0, false, None, vec![server("s", &["t"])]));
    let reply = core.turn("chat-2", &agent, true).await;
    assert_eq!(decision(&reply), GateDecision::Legacy);
    assert_eq!(projection_of(&reply).phase(), Phase::Unspecified);
    assert_eq!(tool_names(&reply), ["s__t"], "both empty: not stale");
    assert_eq!(core.gate.attempts_started(), 0);
}

#[tokio::test(start_paused = true)]
async fn no_snapshot_then_one_appears_wakes_the_waiter() {
    let core = Core::new();
    let agent = core.register();
    core.startup(&agent, RUN_A);

    let turn = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    core.push(&agent, complete(RUN_A, 1, vec![server("fs", &["read"])]));
    let reply = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(
        reply.waited_ms, 250,
        "woken by the commit, before the grace"
    );
    assert_eq!(tool_names(&reply), ["fs__read"]);
    assert_eq!(core.gate.waiters_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn pending_then_complete_wakes_the_waiter_at_the_commit() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![server("fs", &["read"])]));
    let turn = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!turn.is_finished(), "a pending run is waited for");
    core.push(
        &agent,
        complete(RUN_A, 2, vec![server("fs", &["read", "write"])]),
    );
    let reply = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(reply.waited_ms, 3000, "answered when the event arrived");
    assert_eq!(tool_names(&reply), ["fs__read", "fs__write"]);
}

/// Each wait ends at its own deadline, from the turn's start: the pending
/// timeout once the current run reported PENDING, the grace otherwise.
#[tokio::test(start_paused = true)]
async fn waits_time_out_at_their_own_deadline_with_what_they_have() {
    struct Case {
        name: &'static str,
        reported: fn(&Core) -> String,
        decision: GateDecision,
        waited_ms: u32,
        stale: bool,
        tools: &'static [&'static str],
        tools_withheld: u32,
        has_snapshot: bool,
        snapshot_run_id: &'static str,
        summary: &'static [&'static str],
    }
    let cases = [
        Case {
            name: "pending times out after the pending timeout and keeps its tools",
            reported: |core| core.agent_reporting(pending(RUN_A, 1, vec![server("fs", &["read"])])),
            decision: GateDecision::TimedOutPending,
            waited_ms: 600,
            stale: false,
            tools: &["fs__read"],
            tools_withheld: 0,
            has_snapshot: true,
            snapshot_run_id: RUN_A,
            summary: &["had not finished"],
        },
        Case {
            name: "a stale run times out after the grace only",
            reported: |core| {
                let agent =
                    core.agent_reporting(complete(RUN_A, 1, vec![server("old", &["x", "z"])]));
                core.startup(&agent, RUN_B);
                agent
            },
            decision: GateDecision::TimedOutStale,
            waited_ms: 400,
            stale: true,
            tools: &[],
            tools_withheld: 2,
            has_snapshot: true,
            snapshot_run_id: RUN_A,
            summary: &["previous agent process", "withheld"],
        },
        Case {
            name: "a legacy snapshot under an agent with a run id is stale",
            reported: |core| {
                let agent = core.register();
                core.push(
                    &agent,
                    push("", 0, false, None, vec![server("legacy", &["t"])]),
                );
                core.startup(&agent, RUN_A); // upgraded agent, not reported yet
                agent
            },
            decision: GateDecision::TimedOutStale,
            waited_ms: 400,
            stale: true,
            tools: &[],
            tools_withheld: 1,
            has_snapshot: true,
            snapshot_run_id: "",
            summary: &["previous agent process"],
        },
        Case {
            name: "no snapshot times out after the grace",
            reported: |core| {
                let agent = core.register();
                core.startup(&agent, RUN_A);
                agent
            },
            decision: GateDecision::TimedOutNoSnapshot,
            waited_ms: 400,
            stale: false,
            tools: &[],
            tools_withheld: 0,
            has_snapshot: false,
            snapshot_run_id: "",
            summary: &["has not reported"],
        },
    ];
    for case in cases {
        let core = Core::with(|s| {
            s.pending_timeout = Duration::from_millis(600);
            s.stale_grace = Duration::from_millis(400);
        });
        let agent = (case.reported)(&core);
        let reply = core.turn("chat-1", &agent, true).await;
        let name = case.name;
        assert_eq!(decision(&reply), case.decision, "{name}");
        assert_eq!(
            reply.waited_ms, case.waited_ms,
            "{name}: the deadline that applied"
        );
        let p = projection_of(&reply);
        assert!(p.wait_timed_out, "{name}");
        assert_eq!(p.stale, case.stale, "{name}");
        assert_eq!(p.has_snapshot, case.has_snapshot, "{name}");
        assert_eq!(tools(p), case.tools, "{name}");
        assert_eq!(
            p.counts.unwrap().tools_withheld,
            case.tools_withheld,
            "{name}"
        );
        if case.decision == GateDecision::TimedOutPending {
            assert_eq!(p.phase(), Phase::Pending, "{name}");
        }
        assert_eq!(p.snapshot_agent_run_id, case.snapshot_run_id, "{name}");
        for expected in case.summary {
            assert!(
                p.summary.contains(expected),
                "{name}: {expected:?} not in {}",
                p.summary
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn stale_run_waits_for_the_current_run() {
    let core = Core::new();
    let agent = core.agent_reporting(complete(RUN_A, 1, vec![server("old", &["x"])]));
    core.startup(&agent, RUN_B); // the agent restarted

    let turn = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    core.push(&agent, pending(RUN_B, 1, vec![]));
    tokio::task::yield_now().await;
    assert!(
        !turn.is_finished(),
        "the new run's PENDING does not end the wait"
    );
    core.push(&agent, complete(RUN_B, 2, vec![server("new", &["y"])]));
    let reply = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(
        tool_names(&reply),
        ["new__y"],
        "never the previous run's tools"
    );
    assert_eq!(projection_of(&reply).snapshot_agent_run_id, RUN_B);
}

#[tokio::test(start_paused = true)]
async fn store_unavailable_fails_open_and_says_why() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));
    *core.memory.unavailable.lock().unwrap() = Some("no service answers on the store".into());

    // In process the turn reads: the store's failure is the answer.
    let reply = core.gate.turn(Core::request("chat-1", &agent, true)).await;
    assert_eq!(decision(&reply), GateDecision::StoreUnavailable);
    let p = projection_of(&reply);
    assert_eq!(p.store_error, "no service answers on the store");
    assert!(p.summary.contains("could not be read"), "{}", p.summary);
    assert_eq!(core.gate.waiters_held(), 0);

    let reply = core.gate.turn(Core::request("chat-1", &agent, false)).await;
    assert_eq!(decision(&reply), GateDecision::StoreUnavailable);
    assert!(matches!(
        core.gate.context(TENANT, &agent).await,
        Err(ReadError::Unavailable(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn only_first_turns_wait() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![server("s", &["t"])]));
    let started = Instant::now();
    let reply = core.turn("chat-1", &agent, false).await;
    assert_eq!(decision(&reply), GateDecision::NotFirstTurn);
    assert_eq!(started.elapsed(), Duration::ZERO, "no wait at all");
    assert_eq!(reply.waited_ms, 0);
    assert_eq!(tool_names(&reply), ["s__t"]);
    assert_eq!(core.gate.attempts_started(), 0);
}

#[tokio::test(start_paused = true)]
async fn caller_cancelled_while_pending_does_not_cancel_the_others() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));

    let cancelled = core.spawn_turn_in_process("chat-1", &agent);
    let other_chat = core.spawn_turn("chat-2", &agent);
    core.until_waiting(2).await;
    cancelled.abort();
    assert!(cancelled.await.unwrap_err().is_cancelled());

    // The cancelled caller's wait goes on: a later caller of that chat joins it.
    let same_chat = core.spawn_turn("chat-1", &agent);
    let gate = core.gate.clone();
    until("the later caller joined the wait", move || {
        gate.attempts_joined() == 1
    })
    .await;
    core.push(&agent, complete(RUN_A, 2, vec![server("s", &["t"])]));
    let same = answer(same_chat).await;
    let other = answer(other_chat).await;
    assert_eq!(decision(&same), GateDecision::Ready);
    assert_eq!(decision(&other), GateDecision::Ready);
    assert!(same.joined_attempt, "the cancelled caller's wait survived");
    assert_eq!(core.gate.attempts_started(), 2);
    assert_eq!(core.gate.waiters_held(), 0);
    assert_eq!(core.gate.attempts_held(), 0);
    let gate = core.gate.clone();
    until("no turn holds the agent's view", move || {
        gate.watches().held() == 0
    })
    .await;
}

// ---- retries of failed reads ---------------------------------------------------

#[test]
fn read_retries_start_at_100_ms_and_double_up_to_1_s_without_end() {
    use gate_core::watch::{RETRY_MAX, RETRY_MIN, retry_delays};
    assert_eq!(
        (RETRY_MIN, RETRY_MAX),
        (Duration::from_millis(100), Duration::from_secs(1))
    );
    let delays: Vec<Duration> = retry_delays().take(50).collect();
    assert_eq!(delays.len(), 50, "no last retry");
    // Doubling is computed in f32 seconds: within a microsecond of the ideal.
    for (delay, ideal_ms) in delays.iter().zip([100, 200, 400, 800]) {
        let ideal = Duration::from_millis(ideal_ms);
        assert!(
            delay.abs_diff(ideal) < Duration::from_micros(1),
            "{delay:?} for {ideal:?}"
        );
    }
    assert!(delays[4..].iter().all(|&d| d == RETRY_MAX), "{delays:?}");
}

#[tokio::test(start_paused = true)]
async fn a_failed_read_is_retried_with_backoff_while_a_turn_waits_and_reset_by_a_success() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));
    let turn = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    let unavailable = |reason: Option<&str>| {
        *core.memory.unavailable.lock().unwrap() = reason.map(str::to_owned);
    };
    // A commit whose event comes without its state (too large): it asks for a read.
    let stateless_commit = || {
        let revision = {
            let mut states = core.memory.states.lock().unwrap();
            let state = states.get_mut(&agent).expect("registered");
            state.revision += 1;
            state.revision
        };
        core.gate
            .apply_event(&agent, EventUpdate::new(revision, None, None));
    };
    let reads_before = core.reads();
    let reads = || core.reads() - reads_before;
    let ms = Duration::from_millis;

    unavailable(Some("no service answers on the store"));
    let start = Instant::now();
    stateless_commit();
    // Read at once, then after 100, 200, 400, 800 ms, then every second
    // (each timer rounds up to tokio's millisecond: checked 10 ms around).
    for (n, at) in [0, 100, 300, 700, 1500, 2500, 3500].into_iter().enumerate() {
        if at > 0 {
            tokio::time::sleep_until(start + ms(at - 10)).await;
            assert_eq!(reads(), n as u64, "no read yet just before {at} ms");
        }
        tokio::time::sleep_until(start + ms(at + 10)).await;
        assert_eq!(reads(), n as u64 + 1, "read {} at {at} ms", n + 1);
    }
    // The store is back: the next retry succeeds, and nothing more is read.
    unavailable(None);
    tokio::time::sleep_until(start + ms(4510)).await;
    assert_eq!(reads(), 8);
    tokio::time::sleep_until(start + ms(6000)).await;
    assert_eq!(reads(), 8, "no retry after a success");
    assert!(!turn.is_finished(), "a failed read keeps the wait");

    // Failing again starts over at the shortest delay.
    unavailable(Some("no service answers on the store"));
    stateless_commit();
    tokio::time::sleep_until(start + ms(6010)).await;
    assert_eq!(reads(), 9);
    tokio::time::sleep_until(start + ms(6090)).await;
    assert_eq!(reads(), 9);
    tokio::time::sleep_until(start + ms(6110)).await;
    assert_eq!(reads(), 10, "retried after 100 ms again");

    unavailable(None);
    core.push(&agent, complete(RUN_A, 2, vec![]));
    assert_eq!(decision(&answer(turn).await), GateDecision::Ready);
}

// ---- the attempt cache -----------------------------------------------------

#[tokio::test(start_paused = true)]
async fn attempt_concurrent_callers_share_one_wait() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));

    let first = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    let joiners: Vec<_> = (0..4).map(|_| core.spawn_turn("chat-1", &agent)).collect();
    // Every joiner has joined before the commit.
    let gate = core.gate.clone();
    until("the joiners have joined", move || {
        gate.attempts_joined() == 4
    })
    .await;
    core.push(&agent, complete(RUN_A, 2, vec![]));
    let first = answer(first).await;
    assert_eq!(decision(&first), GateDecision::Ready);
    assert!(!first.joined_attempt);
    for joiner in joiners {
        let reply = answer(joiner).await;
        assert_eq!(decision(&reply), GateDecision::Ready);
        assert!(reply.joined_attempt);
    }
    assert_eq!(core.gate.attempts_started(), 1, "one wait for the chat");
    assert_eq!(core.gate.waiters_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn attempt_timed_out_is_reused_and_refreshed_from_the_view_without_a_read() {
    let core = Core::with(|s| {
        s.stale_grace = Duration::from_millis(300);
        s.pending_timeout = Duration::from_millis(300);
    });
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![server("s", &["t"])]));
    let first = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&first), GateDecision::TimedOutPending);
    assert_eq!(
        core.gate.attempts_held(),
        1,
        "the timed-out wait is remembered"
    );

    let reads = core.reads();
    let started = Instant::now();
    let again = core.turn("chat-1", &agent, true).await;
    assert_eq!(started.elapsed(), Duration::ZERO, "did not wait again");
    assert_eq!(decision(&again), GateDecision::TimedOutPending);
    assert!(again.attempt_reused);
    assert!(projection_of(&again).wait_timed_out);
    assert_eq!(tool_names(&again), ["s__t"]);
    assert_eq!(core.reads() - reads, 0, "the fresh view is the refresh");
    assert_eq!(core.gate.attempts_started(), 1);

    // Another chat is not affected by chat-1's memory.
    let other = core.turn("chat-2", &agent, true).await;
    assert!(!other.attempt_reused);
    assert_eq!(core.gate.attempts_started(), 2);
}

#[tokio::test(start_paused = true)]
async fn attempt_timed_out_is_refreshed_once_complete() {
    let core = Core::with(|s| s.pending_timeout = Duration::from_millis(300));
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));
    let first = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&first), GateDecision::TimedOutPending);

    core.push(&agent, complete(RUN_A, 2, vec![server("s", &["t"])]));
    let again = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&again), GateDecision::Ready);
    assert_eq!(tool_names(&again), ["s__t"]);
    assert!(!projection_of(&again).wait_timed_out);
    assert_eq!(
        core.gate.attempts_held(),
        0,
        "a completed attempt is not kept"
    );
}

#[tokio::test(start_paused = true)]
async fn attempt_timed_out_expires() {
    let core = Core::with(|s| {
        s.pending_timeout = Duration::from_millis(200);
        s.attempt_ttl = Duration::from_millis(500);
    });
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));
    let first = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&first), GateDecision::TimedOutPending);
    assert_eq!(core.gate.attempts_held(), 1);

    // The memory is dropped by the gate's own expiry, not by this turn.
    let expired_at = Instant::now() + Duration::from_millis(500);
    let gate = core.gate.clone();
    until_within(
        "the remembered attempt expires",
        Duration::from_secs(1),
        move || gate.attempts_held() == 0,
    )
    .await;
    assert!(Instant::now() >= expired_at, "not before its time to live");
    let again = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&again), GateDecision::TimedOutPending);
    assert!(!again.attempt_reused, "waited again");
    assert_eq!(again.waited_ms, 200);
    assert_eq!(core.gate.attempts_started(), 2);
}

#[tokio::test(start_paused = true)]
async fn attempt_new_run_rearms_the_wait() {
    let core = Core::with(|s| {
        s.pending_timeout = Duration::from_millis(300);
        s.stale_grace = Duration::from_secs(20);
    });
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));
    let first = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&first), GateDecision::TimedOutPending);

    // The agent restarts: the chat's next first turn waits for the new run.
    core.startup(&agent, RUN_B);
    let turn = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    core.push(&agent, complete(RUN_B, 1, vec![server("s", &["t"])]));
    let reply = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert!(!reply.attempt_reused);
    assert_eq!(projection_of(&reply).agent_run_id, RUN_B);
    assert_eq!(core.gate.attempts_started(), 2);
}

#[tokio::test(start_paused = true)]
async fn attempt_completed_is_forgotten_and_the_next_first_turn_follows_the_view() {
    let core = Core::new();
    let agent = core.agent_reporting(pending(RUN_A, 1, vec![]));
    let turn = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    assert_eq!(core.gate.attempts_held(), 1);
    core.push(&agent, complete(RUN_A, 2, vec![]));
    let reply = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(core.gate.attempts_held(), 0);

    // Nothing of the finished attempt is trusted: the agent restarts, and the
    // chat's next first turn waits for the new run, with no store read (the
    // startup's event carried the state).
    let reads = core.reads();
    core.startup(&agent, RUN_B);
    let again = core.spawn_turn("chat-1", &agent);
    core.until_waiting(1).await;
    core.push(&agent, complete(RUN_B, 1, vec![server("s", &["t"])]));
    let again = answer(again).await;
    assert_eq!(decision(&again), GateDecision::Ready);
    assert!(!again.attempt_reused && !again.joined_attempt);
    assert_eq!(projection_of(&again).agent_run_id, RUN_B);
    assert_eq!(tool_names(&again), ["s__t"]);
    assert_eq!(core.reads() - reads, 0, "the events carried every state");
}

// ---- projections -----------------------------------------------------------

/// Freshness is the run id comparison alone: which snapshots offer their
/// tools, what the phase says, and what a first turn decides.
#[tokio::test(start_paused = true)]
async fn projection_freshness() {
    struct Case {
        name: &'static str,
        state: fn(&Core) -> String,
        stale: bool,
        phase: Phase,
        snapshot_phase: Phase,
        tools: &'static [&'static str],
        withheld: u32,
        /// What a first turn decides (ready and legacy answer at once).
        first_turn: Option<GateDecision>,
    }
    let cases = [
        Case {
            name: "same run offers tools",
            state: |core| core.agent_reporting(complete(RUN_A, 1, vec![server("s", &["t"])])),
            stale: false,
            phase: Phase::Complete,
            snapshot_phase: Phase::Complete,
            tools: &["s__t"],
            withheld: 0,
            first_turn: Some(GateDecision::Ready),
        },
        Case {
            name: "different run withholds tools",
            state: |core| {
                let agent = core.agent_reporting(complete(RUN_A, 1, vec![server("s", &["t"])]));
                core.startup(&agent, RUN_B);
                agent
            },
            stale: true,
            phase: Phase::Unspecified,
            snapshot_phase: Phase::Complete,
            tools: &[],
            withheld: 1,
            first_turn: None,
        },
        Case {
            name: "legacy snapshot under current agent is stale",
            state: |core| {
                let agent = core.register();
                core.push(&agent, push("", 0, false, None, vec![server("s", &["t"])]));
                core.startup(&agent, RUN_A);
                agent
            },
            stale: true,
            phase: Phase::Unspecified,
            snapshot_phase: Phase::Unspecified,
            tools: &[],
            withheld: 1,
            first_turn: None,
        },
        Case {
            // A legacy agent never waits, but it gets no tools of the newer process either.
            name: "newer snapshot under legacy agent is stale",
            state: |core| {
                let agent = core.agent_reporting(complete(RUN_A, 1, vec![server("s", &["t"])]));
                core.startup(&agent, ""); // rolled back to a legacy agent
                agent
            },
            stale: true,
            phase: Phase::Unspecified,
            snapshot_phase: Phase::Complete,
            tools: &[],
            withheld: 1,
            first_turn: Some(GateDecision::Legacy),
        },
        Case {
            name: "both empty offers tools",
            state: |core| core.agent_reporting(push("", 0, false, None, vec![server("s", &["t"])])),
            stale: false,
            phase: Phase::Unspecified,
            snapshot_phase: Phase::Unspecified,
            tools: &["s__t"],
            withheld: 0,
            first_turn: Some(GateDecision::Legacy),
        },
    ];
    for case in cases {
        let core = Core::new();
        let agent = (case.state)(&core);
        let name = case.name;
        let state = core.memory.states.lock().unwrap()[&agent].clone();
        // The pure function, and what the context read answers.
        let built = projection::build(&agent, &state);
        let context = core.gate.context(TENANT, &agent).await.expect("context");
        for p in [&built, &context] {
            assert_eq!(p.stale, case.stale, "{name}");
            assert_eq!(p.phase(), case.phase, "{name}");
            assert_eq!(p.snapshot_phase(), case.snapshot_phase, "{name}");
            assert_eq!(tools(p), case.tools, "{name}");
            assert_eq!(p.counts.unwrap().tools_withheld, case.withheld, "{name}");
            assert_eq!(p.servers[0].tools_withheld, case.withheld, "{name}");
        }
        if let Some(expected) = case.first_turn {
            let reply = core.turn("chat-1", &agent, true).await;
            assert_eq!(decision(&reply), expected, "{name}");
            assert_eq!(tool_names(&reply), case.tools, "{name}");
            assert_eq!(projection_of(&reply).stale, case.stale, "{name}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn projection_outcome_counts_and_summary() {
    let core = Core::new();
    let agent = core.register();
    core.startup(&agent, RUN_A);
    let mut with_warning = server("memory", &["remember"]);
    with_warning.warning = "reload failed; kept the previous session".into();
    core.push(
        &agent,
        complete(
            RUN_A,
            1,
            vec![
                instruction("/w/AGENTS.md", "Be brief."),
                skill("/w/.agents/skills/deploy", "deploy", "Deploys the app"),
                invalid_config("/w/sub/.mcp.json", "invalid JSON at line 3"),
                server("github", &["search", "open_issue"]),
                with_warning,
                server("empty", &[]),
                failed_server("broken", "spawn failed: token=[redacted]"),
            ],
        ),
    );

    let reply = core.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    let p = projection_of(&reply);
    let counts = p.counts.unwrap();
    assert_eq!(
        (
            counts.servers_ok,
            counts.servers_zero_tools,
            counts.servers_failed,
            counts.invalid_config_files,
            counts.tools,
            counts.instruction_files,
            counts.skills,
        ),
        (2, 1, 1, 1, 3, 1, 1)
    );
    assert_eq!(
        tool_names(&reply),
        ["github__search", "github__open_issue", "memory__remember"]
    );
    let tool = &p.servers[0].tools[0];
    assert_eq!(
        (tool.server.as_str(), tool.tool.as_str()),
        ("github", "search")
    );
    assert_eq!(tool.description, "the search tool");
    assert_eq!(tool.input_schema_json, Q_SCHEMA);
    assert_eq!(
        p.servers[1].warning,
        "reload failed; kept the previous session"
    );
    assert_eq!(p.failed_servers[0].name, "broken");
    assert_eq!(p.failed_servers[0].error, "spawn failed: token=[redacted]");
    assert_eq!(p.invalid_config_files[0].path, "/w/sub/.mcp.json");
    assert_eq!(p.invalid_config_files[0].error, "invalid JSON at line 3");
    assert_eq!(p.instruction_files[0].content, "Be brief.");
    assert_eq!(p.skills[0].name, "deploy");
    assert_eq!(p.skills[0].dir, "/w/.agents/skills/deploy");
    assert_eq!(
        p.catalog.as_ref().unwrap().status(),
        catalog_section::Status::NotRequested
    );

    let summary = &p.summary;
    for expected in [
        "MCP discovery has finished",
        "github (2 tools)",
        "memory (1 tool)",
        "listed no tools: empty",
        "could not be used: broken",
        "/w/sub/.mcp.json",
        "1 instruction file and 1 skill",
    ] {
        assert!(
            summary.contains(expected),
            "{expected:?} not in {summary:?}"
        );
    }
    let lower = summary.to_lowercase();
    assert!(
        !lower.contains("healthy") && !lower.contains("connected"),
        "{summary}"
    );
}
