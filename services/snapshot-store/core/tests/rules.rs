//! The store's rules for late, replayed and repeated messages, one test per
//! rule, on the decisions alone: no nats-server, no Postgres. What needs
//! them (the SQL carrying a plan out, locking, deadlines, events on the wire,
//! replicas racing) is in snapshot-store's `tests/store.rs`, one end-to-end
//! test per rule.

use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;
use pbjson_types::Timestamp;
use prost::Message;
use store_core::*;

const RUN_A: &str = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";
const RUN_B: &str = "5e4d3c2b-1a4b-4f9d-a1c7-e1d7c2f7b0aa";
const AGENT_ID: &str = "6f0e4a52-3c1b-4d8e-9a7f-2b5c8d1e0f3a";
const AT: Timestamp = Timestamp {
    seconds: 1_700_000_000,
    nanos: 5,
};

// ---- builders ------------------------------------------------------------------

fn server(name: &str) -> ContextResource {
    ContextResource {
        source: format!("mcp_server:{name}"),
        kind: ResourceKind::McpServer as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(context_resource::Body::McpServer(McpServer {
            name: name.into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn push(
    run: &str,
    version: u64,
    phase: Option<Phase>,
    resources: Vec<ContextResource>,
) -> PushContextStateRequest {
    PushContextStateRequest {
        agent_run_id: run.into(),
        version,
        initial: false,
        mcp_discovery: phase.map(|phase| McpDiscovery {
            phase: phase as i32,
        }),
        resources,
        context_config: None,
    }
}

fn startup(run: &str, version: &str) -> StartupRequest {
    StartupRequest {
        agent_run_id: run.into(),
        agent_version: version.into(),
        reclaim: false,
    }
}

fn reclaim(run: &str, version: &str) -> StartupRequest {
    StartupRequest {
        reclaim: true,
        ..startup(run, version)
    }
}

fn agent<'a>(run: &'a str, version: &'a str) -> StoredAgent<'a> {
    StoredAgent {
        agent_run_id: run,
        agent_version: version,
    }
}

/// The plan for `push` against an agent on run `agent_run` whose stored
/// snapshot is `stored` (the push that committed it, as stored).
fn plan(
    agent_run: &str,
    stored: Option<&PushContextStateRequest>,
    push: &PushContextStateRequest,
) -> PushPlan {
    let stored_content = stored.map(PushContent::of);
    let stored = stored
        .zip(stored_content.as_ref())
        .map(|(p, c)| StoredSnapshot {
            agent_run_id: &p.agent_run_id,
            version: p.version,
            phase: c.phase,
            hash: &c.hash,
        });
    plan_push(agent_run, stored, push, &PushContent::of(push))
}

fn written(plan: PushPlan) -> PushWrite {
    match plan {
        PushPlan::Write(write) => write,
        PushPlan::Dropped { reason, message } => panic!("dropped: {reason:?}: {message}"),
    }
}

fn dropped(plan: &PushPlan) -> Option<PushDropReason> {
    match plan {
        PushPlan::Dropped { reason, .. } => Some(*reason),
        PushPlan::Write(_) => None,
    }
}

fn drop_message(plan: &PushPlan) -> &str {
    match plan {
        PushPlan::Dropped { message, .. } => message,
        PushPlan::Write(_) => panic!("written"),
    }
}

fn startup_written(plan: StartupPlan) -> StartupWrite {
    match plan {
        StartupPlan::Write(write) => write,
        other => panic!("not written: {other:?}"),
    }
}

// ---- pushes: which run ---------------------------------------------------------

#[test]
fn a_push_from_another_run_than_the_agents_is_dropped_as_stale_run() {
    let stored = push(RUN_A, 1, Some(Phase::Complete), vec![server("s")]);
    let late = push(RUN_B, 9, Some(Phase::Pending), vec![server("other")]);
    let plan = plan(RUN_A, Some(&stored), &late);
    assert_eq!(dropped(&plan), Some(PushDropReason::StaleRun));
    let message = drop_message(&plan);
    assert!(
        message.contains(RUN_B) && message.contains(RUN_A),
        "{message}"
    );
    // Whatever its version and phase, and with no snapshot stored yet.
    assert_eq!(
        dropped(&self::plan(RUN_A, None, &late)),
        Some(PushDropReason::StaleRun)
    );
}

#[test]
fn a_push_without_a_run_id_is_stale_against_an_agent_that_has_one() {
    let plan = plan(RUN_A, None, &push("", 5, None, vec![]));
    assert_eq!(dropped(&plan), Some(PushDropReason::StaleRun));
}

#[test]
fn an_agent_without_a_run_id_takes_any_runs_push() {
    // A legacy agent (empty run id everywhere), or one whose startup was
    // never stored: nothing to be stale against.
    for run in ["", RUN_A] {
        written(plan("", None, &push(run, 0, None, vec![])));
    }
    let stored = push(RUN_A, 7, Some(Phase::Complete), vec![]);
    written(plan(
        "",
        Some(&stored),
        &push(RUN_B, 1, Some(Phase::Pending), vec![]),
    ));
}

#[test]
fn a_legacy_agents_pushes_are_not_ordered() {
    // No run id, no run to order within: the same version again, and a phase
    // back, are written (each push replaces the last).
    let stored = push("", 3, Some(Phase::Complete), vec![server("a")]);
    for again in [
        push("", 3, Some(Phase::Complete), vec![server("b")]),
        push("", 0, None, vec![]),
    ] {
        written(plan("", Some(&stored), &again));
    }
}

// ---- pushes: within a run ------------------------------------------------------

#[test]
fn a_push_of_the_current_run_with_a_higher_version_is_written() {
    let stored = push(RUN_A, 1, Some(Phase::Pending), vec![]);
    written(plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 2, Some(Phase::Pending), vec![server("s")]),
    ));
}

#[test]
fn within_a_run_a_version_not_above_the_stored_one_is_dropped_as_stale_version() {
    let stored = push(RUN_A, 5, Some(Phase::Pending), vec![]);
    for stale in [5, 4, 0] {
        let plan = plan(
            RUN_A,
            Some(&stored),
            &push(RUN_A, stale, Some(Phase::Complete), vec![]),
        );
        assert_eq!(
            dropped(&plan),
            Some(PushDropReason::StaleVersion),
            "version {stale}"
        );
        assert!(
            drop_message(&plan).contains("stored version 5"),
            "{}",
            drop_message(&plan)
        );
    }
}

#[test]
fn a_late_or_replayed_initial_push_is_a_stale_version_not_a_reset() {
    let stored = push(RUN_A, 2, Some(Phase::Complete), vec![server("s")]);
    let mut first = push(RUN_A, 1, Some(Phase::Pending), vec![]);
    first.initial = true;
    let plan = plan(RUN_A, Some(&stored), &first);
    assert_eq!(dropped(&plan), Some(PushDropReason::StaleVersion));
}

#[test]
fn within_a_run_the_phase_never_moves_back() {
    let stored = push(RUN_A, 2, Some(Phase::Complete), vec![]);
    // No discovery message is UNSPECIFIED: back from COMPLETE too.
    for (version, phase) in [(3, Some(Phase::Pending)), (4, None)] {
        let plan = plan(RUN_A, Some(&stored), &push(RUN_A, version, phase, vec![]));
        assert_eq!(
            dropped(&plan),
            Some(PushDropReason::PhaseRegression),
            "{phase:?}"
        );
        assert!(
            drop_message(&plan).contains("PHASE_COMPLETE"),
            "the drop says what it would have moved back from: {}",
            drop_message(&plan)
        );
    }
    // The same phase, or forward, is fine.
    written(plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 5, Some(Phase::Complete), vec![]),
    ));
    let pending = push(RUN_A, 1, Some(Phase::Pending), vec![]);
    written(plan(
        RUN_A,
        Some(&pending),
        &push(RUN_A, 2, Some(Phase::Complete), vec![]),
    ));
}

#[test]
fn a_stale_version_is_told_before_a_phase_regression() {
    let stored = push(RUN_A, 5, Some(Phase::Complete), vec![]);
    let plan = plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 4, Some(Phase::Pending), vec![]),
    );
    assert_eq!(dropped(&plan), Some(PushDropReason::StaleVersion));
}

#[test]
fn a_new_run_starts_over_with_any_version_and_phase() {
    // The stored snapshot is the previous run's: its version and phase bind
    // nothing of the new run.
    let stored = push(RUN_A, 40, Some(Phase::Complete), vec![]);
    let write = written(plan(
        RUN_B,
        Some(&stored),
        &push(RUN_B, 1, Some(Phase::Pending), vec![]),
    ));
    assert!(write.rewrites_resources);
}

#[test]
fn the_phase_ranks_unspecified_then_pending_then_complete() {
    let ranks = [Phase::Unspecified, Phase::Pending, Phase::Complete].map(phase_rank);
    assert!(ranks[0] < ranks[1] && ranks[1] < ranks[2], "{ranks:?}");
}

#[test]
fn a_push_without_a_discovery_message_has_phase_unspecified() {
    assert_eq!(push_phase(&push("", 0, None, vec![])), Phase::Unspecified);
    assert_eq!(
        push_phase(&push("", 0, Some(Phase::Pending), vec![])),
        Phase::Pending
    );
}

// ---- pushes: what is written -----------------------------------------------------

#[test]
fn resources_are_rewritten_only_when_the_content_hash_changed() {
    let stored = push(RUN_A, 1, Some(Phase::Pending), vec![server("s")]);
    // Same content, higher version: the snapshot row moves, resources stay.
    let same = written(plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 2, Some(Phase::Pending), vec![server("s")]),
    ));
    assert!(!same.rewrites_resources);
    // Other resources, or another phase: rewritten.
    let other = written(plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 2, Some(Phase::Pending), vec![server("t")]),
    ));
    assert!(other.rewrites_resources);
    let phase = written(plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 2, Some(Phase::Complete), vec![server("s")]),
    ));
    assert!(phase.rewrites_resources);
    // The first snapshot has nothing to keep.
    assert!(written(plan(RUN_A, None, &stored)).rewrites_resources);
}

#[test]
fn the_content_hash_covers_all_but_the_version() {
    let base = push(
        RUN_A,
        1,
        Some(Phase::Pending),
        vec![server("a"), server("b")],
    );
    let hash = |p: &PushContextStateRequest| PushContent::of(p).hash;
    let mut again = base.clone();
    again.version = 9;
    again.initial = true;
    assert_eq!(
        hash(&again),
        hash(&base),
        "version and initial are not content"
    );
    // No context config is the default one.
    let mut config = base.clone();
    config.context_config = Some(ContextConfig::default());
    assert_eq!(hash(&config), hash(&base));

    let mut changes = Vec::new();
    let mut run = base.clone();
    run.agent_run_id = RUN_B.into();
    changes.push(("run id", run));
    changes.push((
        "phase",
        push(RUN_A, 1, Some(Phase::Complete), base.resources.clone()),
    ));
    changes.push((
        "resource order",
        push(
            RUN_A,
            1,
            Some(Phase::Pending),
            vec![server("b"), server("a")],
        ),
    ));
    changes.push((
        "resources",
        push(RUN_A, 1, Some(Phase::Pending), vec![server("a")]),
    ));
    let mut context = base.clone();
    context.context_config = Some(ContextConfig {
        mcp_config_files: vec!["/w/.mcp.json".into()],
        ..Default::default()
    });
    changes.push(("context config", context));
    for (what, changed) in changes {
        assert_ne!(hash(&changed), hash(&base), "{what} is content");
    }
}

#[test]
fn the_content_hash_is_length_prefixed_so_resources_do_not_run_together() {
    // Two resources whose encodings, end to end, encode a third one (protobuf
    // concatenation is a merge): different from that one resource.
    let source = ContextResource {
        source: "mcp_server:a".into(),
        ..Default::default()
    };
    let error = ContextResource {
        error: "failed".into(),
        ..Default::default()
    };
    let merged = ContextResource {
        error: "failed".into(),
        ..source.clone()
    };
    assert_eq!(
        [source.encode_to_vec(), error.encode_to_vec()].concat(),
        merged.encode_to_vec()
    );
    let two = push("", 1, None, vec![source, error]);
    let one = push("", 1, None, vec![merged]);
    assert_ne!(PushContent::of(&two).hash, PushContent::of(&one).hash);
}

// ---- pushes: what is published ------------------------------------------------------

#[test]
fn a_push_publishes_discovery_changed_only_when_the_phase_or_run_id_changed() {
    let pending = push(RUN_A, 1, Some(Phase::Pending), vec![]);
    // The first snapshot: changed (there was none).
    let first = written(plan(RUN_A, None, &pending));
    let event = first
        .discovery_changed(AGENT_ID, 2, AT)
        .expect("first snapshot");
    assert_eq!(
        (event.phase(), event.previous_phase(), event.has_snapshot),
        (Phase::Pending, Phase::Unspecified, true)
    );
    // Same run and phase, new content: none.
    let content = written(plan(
        RUN_A,
        Some(&pending),
        &push(RUN_A, 2, Some(Phase::Pending), vec![server("s")]),
    ));
    assert_eq!(content.discovery_changed(AGENT_ID, 3, AT), None);
    // The phase moved: one.
    let complete = written(plan(
        RUN_A,
        Some(&pending),
        &push(RUN_A, 2, Some(Phase::Complete), vec![]),
    ));
    let event = complete
        .discovery_changed(AGENT_ID, 3, AT)
        .expect("phase changed");
    assert_eq!(
        (event.phase(), event.previous_phase()),
        (Phase::Complete, Phase::Pending)
    );
    // A new run's first push, same phase as the old run's: one.
    let new_run = written(plan(
        RUN_B,
        Some(&pending),
        &push(RUN_B, 1, Some(Phase::Pending), vec![]),
    ));
    let event = new_run
        .discovery_changed(AGENT_ID, 4, AT)
        .expect("run changed");
    assert_eq!(event.snapshot_agent_run_id, RUN_B);
}

#[test]
fn the_push_discovery_event_says_what_committed() {
    let stored = push(RUN_A, 1, Some(Phase::Pending), vec![]);
    let write = written(plan(
        RUN_A,
        Some(&stored),
        &push(RUN_A, 2, Some(Phase::Complete), vec![]),
    ));
    assert_eq!(
        write.discovery_changed(AGENT_ID, 7, AT),
        Some(DiscoveryChanged {
            agent_id: AGENT_ID.into(),
            cause: discovery_changed::Cause::Push as i32,
            agent_run_id: RUN_A.into(),
            previous_agent_run_id: RUN_A.into(),
            has_snapshot: true,
            snapshot_agent_run_id: RUN_A.into(),
            phase: Phase::Complete as i32,
            previous_phase: Phase::Pending as i32,
            snapshot_version: 2,
            committed_at: Some(AT),
            revision: 7,
            // The publisher attaches it (it moves between the two events).
            state: None,
        })
    );
}

#[test]
fn every_accepted_push_publishes_snapshot_committed_unchanged_content_included() {
    let stored = push(RUN_A, 1, Some(Phase::Complete), vec![server("s")]);
    let again = push(RUN_A, 2, Some(Phase::Complete), vec![server("s")]);
    let write = written(plan(RUN_A, Some(&stored), &again));
    assert_eq!(write.discovery_changed(AGENT_ID, 5, AT), None);
    assert_eq!(
        write.snapshot_committed(AGENT_ID, 5, AT),
        SnapshotCommitted {
            agent_id: AGENT_ID.into(),
            agent_run_id: RUN_A.into(),
            version: 2,
            phase: Phase::Complete as i32,
            hash: PushContent::of(&again).hash,
            committed_at: Some(AT),
            revision: 5,
            state: None,
        }
    );
}

#[test]
fn the_committed_state_is_what_a_read_after_the_commit_returns() {
    let incoming = push(RUN_A, 3, Some(Phase::Pending), vec![server("s")]);
    let content = PushContent::of(&incoming);
    let write = written(plan(RUN_A, None, &incoming));
    let row = Agent {
        agent_id: AGENT_ID.into(),
        agent_run_id: RUN_A.into(),
        ..Default::default()
    };
    let state = write.state(
        row.clone(),
        4,
        content.context_config.clone(),
        incoming.resources.clone(),
        AT,
    );
    assert_eq!(
        state,
        AgentState {
            agent: Some(row),
            snapshot: Some(Snapshot {
                agent_run_id: RUN_A.into(),
                version: 3,
                phase: Phase::Pending as i32,
                hash: content.hash,
                received_at: Some(AT),
                // None in the push: the default one, as a read has it.
                context_config: Some(ContextConfig::default()),
            }),
            resources: incoming.resources,
            revision: 4,
        }
    );
}

// ---- startups ----------------------------------------------------------------------

#[test]
fn a_repeated_startup_of_the_current_run_is_answered_without_a_write() {
    let current = agent(RUN_A, "1.2");
    let expected = StartupResponse {
        previous_agent_run_id: RUN_A.into(),
        ..Default::default()
    };
    assert_eq!(
        repeated_startup(current, &startup(RUN_A, "1.2")),
        Some(expected.clone())
    );
    // Under the lock too, whatever the superseded runs say.
    for superseded in [false, true] {
        assert_eq!(
            plan_startup(current, &startup(RUN_A, "1.2"), superseded),
            StartupPlan::Repeated(expected.clone())
        );
    }
    // A legacy agent's repeat too.
    assert!(repeated_startup(agent("", ""), &startup("", "")).is_some());
}

#[test]
fn a_startup_of_the_current_run_with_another_version_writes_without_an_event() {
    let current = agent(RUN_A, "1.2");
    assert_eq!(repeated_startup(current, &startup(RUN_A, "1.3")), None);
    let write = startup_written(plan_startup(current, &startup(RUN_A, "1.3"), false));
    assert!(!write.run_id_changed && !write.publishes() && !write.records_superseded());
    assert_eq!(
        write.response(),
        StartupResponse {
            previous_agent_run_id: RUN_A.into(),
            ..Default::default()
        }
    );
}

#[test]
fn a_startup_with_a_new_run_id_overwrites_it_and_supersedes_the_old_one() {
    let write = startup_written(plan_startup(agent(RUN_A, "1"), &startup(RUN_B, "1"), false));
    assert_eq!(write.agent_run_id, RUN_B);
    assert!(write.run_id_changed && write.records_superseded() && write.publishes());
    let response = write.response();
    assert_eq!(
        (
            response.previous_agent_run_id.as_str(),
            response.run_id_changed
        ),
        (RUN_A, true)
    );
    assert_eq!(response.drop_reason(), StartupDropReason::Unspecified);
    // The first startup of an agent replaces the empty run id.
    let first = startup_written(plan_startup(agent("", ""), &startup(RUN_A, "1"), false));
    assert_eq!(
        (first.previous_agent_run_id.as_str(), first.run_id_changed),
        ("", true)
    );
}

#[test]
fn a_startup_may_clear_the_run_id_and_an_empty_run_is_never_superseded() {
    let current = agent(RUN_A, "1");
    let legacy = startup("", "1");
    assert!(!superseded_matters(current, &legacy));
    // Even if the store said so, an empty run id is not dropped.
    let write = startup_written(plan_startup(current, &legacy, true));
    assert_eq!(
        (write.agent_run_id.as_str(), write.run_id_changed),
        ("", true)
    );
}

#[test]
fn a_startup_of_a_superseded_run_is_dropped_and_changes_nothing() {
    let current = agent(RUN_B, "1");
    let late = startup(RUN_A, "1");
    assert!(superseded_matters(current, &late));
    let StartupPlan::Dropped(response) = plan_startup(current, &late, true) else {
        panic!("not dropped");
    };
    assert_eq!(response.drop_reason(), StartupDropReason::SupersededRun);
    assert!(!response.run_id_changed);
    assert_eq!(response.previous_agent_run_id, RUN_B);
    assert!(response.message.contains(RUN_A), "{}", response.message);
    // A run the store does not know as superseded is a new process.
    startup_written(plan_startup(current, &late, false));
}

#[test]
fn a_reclaim_takes_a_superseded_run_back() {
    const GHOST: &str = "9c1d2e3f-0000-4aaa-bbbb-cccccccccccc";
    let current = agent(GHOST, "1");
    let write = startup_written(plan_startup(current, &reclaim(RUN_B, "1"), true));
    assert!(write.run_id_changed && write.records_superseded());
    assert_eq!(write.previous_agent_run_id, GHOST);
    // A reclaim of the current run is no repeat: it writes (without an event).
    let again = agent(RUN_B, "1");
    assert_eq!(repeated_startup(again, &reclaim(RUN_B, "1")), None);
    let write = startup_written(plan_startup(again, &reclaim(RUN_B, "1"), false));
    assert!(!write.publishes());
}

#[test]
fn the_superseded_runs_are_asked_only_when_the_run_id_changes_to_another_one() {
    let current = agent(RUN_A, "1");
    assert!(!superseded_matters(current, &startup(RUN_A, "2")));
    assert!(!superseded_matters(current, &startup("", "1")));
    assert!(superseded_matters(current, &startup(RUN_B, "1")));
    assert!(superseded_matters(agent("", ""), &startup(RUN_B, "1")));
}

#[test]
fn the_startup_event_carries_the_committed_state_and_moves_no_phase() {
    let write = startup_written(plan_startup(agent(RUN_A, "1"), &startup(RUN_B, "1"), false));
    // Over the previous run's COMPLETE snapshot.
    let state = AgentState {
        snapshot: Some(Snapshot {
            agent_run_id: RUN_A.into(),
            version: 4,
            phase: Phase::Complete as i32,
            ..Default::default()
        }),
        revision: 9,
        ..Default::default()
    };
    let event = write.discovery_changed(AGENT_ID, state.clone(), AT);
    assert_eq!(
        event,
        DiscoveryChanged {
            agent_id: AGENT_ID.into(),
            cause: discovery_changed::Cause::Startup as i32,
            agent_run_id: RUN_B.into(),
            previous_agent_run_id: RUN_A.into(),
            has_snapshot: true,
            snapshot_agent_run_id: RUN_A.into(),
            phase: Phase::Complete as i32,
            previous_phase: Phase::Complete as i32,
            snapshot_version: 4,
            committed_at: Some(AT),
            revision: 9,
            state: Some(state),
        }
    );
    // No snapshot yet: says so.
    let event = write.discovery_changed(AGENT_ID, AgentState::default(), AT);
    assert!(!event.has_snapshot);
    assert_eq!(
        (event.phase(), event.snapshot_version),
        (Phase::Unspecified, 0)
    );
}
