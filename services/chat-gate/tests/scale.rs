//! 10,000 chats waiting on 1,000 agents, all woken correctly by their agents'
//! discovery events. Prints the wake latency (commit → answer) and the memory
//! the waiters hold. A measurement: it runs in CI's measurement step, not with
//! the tests: `cargo test -p chat-gate --test scale -- --ignored --nocapture`.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use ctxsync_proto::v1::*;
use futures::{StreamExt, stream};
use prost::Message;

const AGENTS: usize = 1_000;
const CHATS_PER_AGENT: usize = 10;
const CONCURRENCY: usize = 32;

/// Resident memory of this process, in bytes.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages");
    pages * 4096
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run with `cargo test -p chat-gate --test scale -- --ignored`"]
async fn ten_thousand_chats_waiting_on_a_thousand_agents_are_all_answered_correctly() {
    let h = Harness::spawn_with(|c| {
        c.pending_timeout = Duration::from_secs(120);
        c.stale_grace = Duration::from_secs(120);
    })
    .await;
    let started = Instant::now();

    // Every agent is running and still discovering; half of them report a
    // stale snapshot of a previous run first, so not every wait is the same.
    let agents: Vec<String> = stream::iter(0..AGENTS)
        .map(|i| {
            let h = &h;
            async move {
                let agent = h.register(&format!("agent-{i}")).await;
                if i % 2 == 1 {
                    h.startup(&agent, RUN_B).await;
                    h.push_ok(&agent, complete(RUN_B, 1, vec![server("old", &["x"])]))
                        .await;
                }
                h.startup(&agent, RUN_A).await;
                if i % 2 == 0 {
                    h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
                }
                agent
            }
        })
        .buffered(CONCURRENCY)
        .collect()
        .await;
    let setup = started.elapsed();

    // The commit time of every agent's completing push, from its event.
    let commits: Arc<Mutex<HashMap<String, SystemTime>>> = Arc::default();
    let mut events = testkit::subscribe(&h.client, h.subjects.discovery_changed_all()).await;
    let recorded = commits.clone();
    let recorder = tokio::spawn(async move {
        while let Some(message) = events.next().await {
            let event = DiscoveryChanged::decode(message.payload).unwrap();
            if event.phase() == mcp_discovery::Phase::Complete {
                recorded
                    .lock()
                    .unwrap()
                    .insert(event.agent_id.clone(), committed_at(&event));
            }
        }
    });

    let rss_before = rss_bytes();
    let reads_before = h.gate().store_reads();
    let waiting_started = Instant::now();
    let mut turns = Vec::with_capacity(AGENTS * CHATS_PER_AGENT);
    for chat in 0..CHATS_PER_AGENT {
        for (i, agent) in agents.iter().enumerate() {
            turns.push((i, h.spawn_turn(&format!("chat-{i}-{chat}"), agent)));
        }
    }
    h.until_waiting(AGENTS * CHATS_PER_AGENT).await;
    let registered = waiting_started.elapsed();
    let rss_waiting = rss_bytes();
    let reads_to_register = h.gate().store_reads() - reads_before;
    assert_eq!(h.gate().watches().len(), AGENTS);

    let reads_before_wake = h.gate().store_reads();
    let completing = Instant::now();
    stream::iter(agents.iter().enumerate())
        .for_each_concurrent(CONCURRENCY, |(i, agent)| {
            let h = &h;
            async move {
                let tools = [format!("tool{i}")];
                let tools: Vec<&str> = tools.iter().map(String::as_str).collect();
                let version = if i % 2 == 0 { 2 } else { 1 };
                h.push_ok(agent, complete(RUN_A, version, vec![server("s", &tools)]))
                    .await;
            }
        })
        .await;
    let completed = completing.elapsed();

    let mut latencies = Vec::with_capacity(turns.len());
    for (i, turn) in turns {
        let (reply, answered_at) = answer(turn).await;
        assert_eq!(reply.error, None);
        assert_eq!(reply.decision(), GateDecision::Ready, "agent {i}");
        let projection = reply.projection.as_ref().unwrap();
        assert_eq!(projection.agent_run_id, RUN_A);
        assert_eq!(projection.snapshot_agent_run_id, RUN_A);
        assert!(!projection.stale);
        assert_eq!(tool_names(&reply), [format!("s__tool{i}")]);
        let commit = *commits
            .lock()
            .unwrap()
            .get(&agents[i])
            .expect("the completing event was seen");
        latencies.push(millis_since(commit, answered_at));
    }
    let wake_reads = h.gate().store_reads() - reads_before_wake;
    recorder.abort();
    assert_eq!(h.gate().waiters_held(), 0);
    assert_eq!(
        h.gate().attempts_held(),
        0,
        "completed attempts are not kept"
    );
    let gate = h.gate().clone();
    until("every agent view is released".into(), move || {
        let held = gate.watches().held();
        async move { held == 0 }
    })
    .await;

    let turn_future = std::mem::size_of_val(&h.gate().turn(TurnRequest::default()));
    latencies.sort_by(f64::total_cmp);
    let held = rss_waiting.saturating_sub(rss_before);
    println!("--- 10,000 chats on 1,000 agents ---");
    println!(
        "setup {:.1} s; 10,000 waits registered in {:.2} s with {} store reads; 1,000 completing pushes in {:.2} s",
        setup.as_secs_f64(),
        registered.as_secs_f64(),
        reads_to_register,
        completed.as_secs_f64()
    );
    println!(
        "wake latency commit -> answer (ms): p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 0.99),
        percentile(&latencies, 1.0)
    );
    println!("store reads to wake all 10,000: {wake_reads} (1,000 agents)");
    println!(
        "memory held by 10,000 waiters: {:.1} MiB RSS ({} bytes per waiter, caller task included)",
        held as f64 / (1024.0 * 1024.0),
        held / (AGENTS * CHATS_PER_AGENT) as u64
    );
    println!("of which the caller's turn future is {turn_future} bytes");
    assert!(
        wake_reads <= 3 * AGENTS as u64,
        "reads are shared per agent, not per waiter ({wake_reads})"
    );
}
