//! What the core holds for each first turn waiting for discovery, counted
//! by the allocator. Its own test binary, one test: the allocator's counts
//! are the process's, and nothing else runs meanwhile.
//!
//! A waiting chat holds: its turn's task (the request's ids, an `Arc` of
//! the wait, the wait-for-answer future); the wait's task (its deadline
//! timer, a receiver of the agent's views, the agent's `Interest`); the
//! wait itself (`Waiting`: the ids once, shared with the attempt's map
//! entry, an answer slot of a `OnceLock` and one `Notify`, an ended flag);
//! and a tenth of its agent's watch (ten chats per agent here). A turn that
//! prepares a catalog also holds that preparation, boxed. The gate process
//! adds what the NATS turn server holds per turn: the task it runs in and
//! the reply inbox (the message itself is dropped once decoded); the bench
//! measures the gate processes' RSS (`ctxsync-bench --mode deployed`).

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
