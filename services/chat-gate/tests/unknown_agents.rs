//! 10,000 turns for agent ids nobody registered, against a real nats-server,
//! Postgres and snapshot-store: each is answered not found and leaves no view
//! behind, and a real agent's view is unaffected. Alone in its binary, so the
//! process-wide `ctxsync_gate_views` gauge is this gate's.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ctxsync_proto::v1::*;
use futures::{StreamExt, stream};

const IDS: usize = 10_000;
const CONCURRENCY: usize = 200;

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

async fn views_gauge(h: &Harness) -> f64 {
    let metrics = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("ctxsync_gate_views "))
        .unwrap_or_else(|| panic!("ctxsync_gate_views missing from /metrics:\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_unknown_agent_ids_leave_no_view_behind() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("s", &["t"])]))
        .await;
    assert_eq!(
        h.turn("chat-0", &agent, true).await.decision(),
        GateDecision::Ready
    );
    assert_eq!(h.gate().watches().views(), 1);

    let rss_before = rss_bytes();
    let started = Instant::now();
    // Most over NATS, every tenth over HTTP, as many at once as CONCURRENCY.
    let not_found = stream::iter(0..IDS)
        .map(|i| {
            let h = &h;
            async move {
                let id = uuid::Uuid::new_v4().to_string();
                if i % 10 == 0 {
                    let r = h
                        .http
                        .post(h.url("/api/v1/gate"))
                        .json(&serde_json::json!({"chat_id": "c", "agent_id": id, "first_turn": true}))
                        .send()
                        .await
                        .unwrap();
                    r.status() == 404
                } else {
                    let reply = h.turn("c", &id, i % 2 == 0).await;
                    reply
                        .error
                        .is_some_and(|e| e.code() == service_error::Code::NotFound)
                }
            }
        })
        .buffer_unordered(CONCURRENCY)
        .filter(|found| std::future::ready(*found))
        .count()
        .await;
    let took = started.elapsed();
    let rss_after = rss_bytes();
    println!(
        "{IDS} unknown ids answered in {:.1} s; RSS {:+.1} MiB; {} views held",
        took.as_secs_f64(),
        (rss_after as f64 - rss_before as f64) / (1024.0 * 1024.0),
        h.gate().watches().len()
    );
    assert_eq!(not_found, IDS, "every unknown id is answered not found");
    assert!(took < Duration::from_secs(120), "took {took:?}");

    // Only the real agent's view is held, and the gauge says so.
    let watches = h.gate().watches();
    assert_eq!(watches.lookups(), 0);
    assert_eq!(watches.len(), 1);
    assert!(watches.is_watched(&agent));
    assert_eq!(views_gauge(&h).await, 1.0);

    // Its view is still fresh: a new chat is answered without a store read.
    let reads = h.gate().store_reads();
    let reply = h.turn("chat-1", &agent, true).await;
    assert_eq!(reply.decision(), GateDecision::Ready);
    assert_eq!(tool_names(&reply), ["s__t"]);
    assert_eq!(h.gate().store_reads(), reads, "answered from the view");
}
