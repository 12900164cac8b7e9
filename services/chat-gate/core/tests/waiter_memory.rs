//! What the core holds for each first turn waiting for discovery, counted
//! by the allocator: the turn's task, its attempt's task and entries, and
//! its share of its agent's watch. Its own test binary, one test: the
//! allocator's counts are the process's, and nothing else runs meanwhile.
//! The gate process adds what the NATS turn server holds per turn (the
//! bench measures the whole process: chat-gate's README, Memory).

mod common;

use common::*;
use ctxsync_proto::v1::GateDecision;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use testkit::report::{complete, pending};

#[global_allocator]
static ALLOCATOR: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

/// The bound on what one waiting first turn holds in the core, in a test
/// (debug) build, whose futures are larger than a release build's.
const CORE_BYTES_PER_WAITING_CHAT: isize = 3072;

/// Bytes allocated and not freed since `region` began.
fn held(region: &Region<'_, std::alloc::System>) -> isize {
    let change = region.change();
    change.bytes_allocated as isize - change.bytes_deallocated as isize + change.bytes_reallocated
}

#[tokio::test(start_paused = true)]
async fn a_waiting_first_turn_holds_at_most_3_kib_in_the_core() {
    const AGENTS: usize = 100;
    // Ten chats per agent, as the bench's largest wake case.
    const CHATS: usize = 1000;
    let core = Core::new();
    let tools = || vec![server("fs", &["read"])];
    let agents: Vec<String> = (0..AGENTS)
        .map(|_| core.agent_reporting(pending(RUN_A, 1, tools())))
        .collect();
    let chat_ids: Vec<String> = (0..CHATS).map(|c| format!("chat-{c}")).collect();
    let mut turns = Vec::with_capacity(CHATS);
    // One wait first, answered: what the first one costs once (maps that
    // grow, statics made on first use) is no chat's.
    let first = core.spawn_turn("warm-up", &agents[0]);
    core.until_waiting(1).await;
    core.push(&agents[0], complete(RUN_A, 2, tools()));
    assert_eq!(answer(first).await.decision(), GateDecision::Ready);
    core.push(&agents[0], pending(RUN_A, 3, tools()));

    let region = Region::new(ALLOCATOR);
    for (c, chat_id) in chat_ids.iter().enumerate() {
        turns.push(core.spawn_turn(chat_id, &agents[c % AGENTS]));
    }
    core.until_waiting(CHATS).await;
    let per_chat = held(&region) / CHATS as isize;
    println!(
        "the core holds {per_chat} bytes per waiting first turn ({CHATS} chats over {AGENTS} agents)"
    );
    assert!(
        per_chat <= CORE_BYTES_PER_WAITING_CHAT,
        "{per_chat} bytes per waiting chat, over {CORE_BYTES_PER_WAITING_CHAT}"
    );

    // And every one of them is answered once discovery completes.
    for (n, agent) in agents.iter().enumerate() {
        let version = if n == 0 { 4 } else { 2 };
        core.push(agent, complete(RUN_A, version, tools()));
    }
    for turn in turns {
        assert_eq!(answer(turn).await.decision(), GateDecision::Ready);
    }
}
