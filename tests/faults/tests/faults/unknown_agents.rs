//! 10,000 unknown agent ids asked at the gate: every answer is not-found,
//! and the gate keeps nothing for them (no views, bounded memory).

use std::time::{Duration, Instant};

use faults::{Cluster, Summary, addr_of, all_ready, metrics_of};
use futures::StreamExt;
use testkit::chat::{ChatAnswer, Outcome, http_turn, nats_turn};
use testkit::{NatsServer, Process, TestDatabase};

const UNKNOWN: usize = 10_000;
/// Of them, asked over HTTP (the rest over NATS).
const OVER_HTTP: usize = 1_000;
/// Asked before the baseline, so warm-up allocations don't count.
const WARM_UP: usize = 300;
/// The gate's resident memory may grow by less than this across the 10,000.
const RSS_GROWTH_BOUND_KIB: u64 = 16 * 1024;
/// `CTXSYNC_GATE_ATTEMPT_TTL` here: the gate refreshes `ctxsync_gate_views`
/// every quarter of it.
const ATTEMPT_TTL: Duration = Duration::from_secs(1);

fn rss_kib(process: &Process) -> u64 {
    let pid = process.pid().expect("the gate runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc status")
}

/// Asks a first turn for `count` random agent ids, 64 at a time over NATS
/// and 16 at a time over HTTP.
async fn ask_unknown(
    cluster: &Cluster,
    client: &async_nats::Client,
    gate: &Process,
    count: usize,
    over_http: usize,
) -> Vec<ChatAnswer> {
    let addr = addr_of(gate);
    let nats = futures::stream::iter(0..count - over_http)
        .map(|i| {
            let id = uuid::Uuid::new_v4().to_string();
            async move {
                nats_turn(
                    client,
                    &cluster.subjects,
                    &format!("chat-{i}"),
                    &id,
                    true,
                    Duration::from_secs(30),
                )
                .await
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>();
    let http = futures::stream::iter(0..over_http)
        .map(|i| {
            let id = uuid::Uuid::new_v4().to_string();
            async move {
                http_turn(
                    &cluster.http,
                    addr,
                    &format!("chat-http-{i}"),
                    &id,
                    true,
                    Duration::from_secs(30),
                )
                .await
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>();
    let (mut answers, over_http) = futures::join!(nats, http);
    answers.extend(over_http);
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_unknown_agent_ids_are_not_found_and_leave_no_views() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let mut store = cluster.store("store").spawn();
    let mut gate = cluster
        .gate("gate")
        .env(
            "CTXSYNC_GATE_ATTEMPT_TTL",
            format!("{}s", ATTEMPT_TTL.as_secs()),
        )
        .spawn();
    all_ready(&mut [&mut store, &mut gate]).await;
    let client = cluster.nats("faults-test").await;
    cluster
        .store_client(&client.client)
        .create_test_tenant_key()
        .await;

    let warm = ask_unknown(&cluster, &client.client, &gate, WARM_UP, WARM_UP / 10).await;
    assert!(warm.iter().all(|a| a.outcome == Outcome::NotFound));
    let rss_before = rss_kib(&gate);
    let started = Instant::now();
    let answers = ask_unknown(&cluster, &client.client, &gate, UNKNOWN, OVER_HTTP).await;
    let took = started.elapsed();
    // The views gauge is refreshed every ATTEMPT_TTL / 4: past two refreshes
    // it counts what the gate holds now.
    tokio::time::sleep(ATTEMPT_TTL / 2 + Duration::from_millis(100)).await;
    let views = metrics_of(&cluster.http, &gate)
        .await
        .sum("ctxsync_gate_views", &[]);
    let rss_after = rss_kib(&gate);
    let not_found = answers
        .iter()
        .filter(|a| a.outcome == Outcome::NotFound)
        .count();
    let others: Vec<String> = answers
        .iter()
        .filter(|a| a.outcome != Outcome::NotFound)
        .take(5)
        .map(|a| format!("{:?} {}", a.via, a.decision()))
        .collect();
    let growth = rss_after.saturating_sub(rss_before);
    Summary::new("unknown_agent_ids")
        .field("sent", UNKNOWN)
        .field("not_found", not_found)
        .field("views", views)
        .field("rss_growth_kib", growth)
        .field("took_ms", took.as_millis())
        .emit();
    assert_eq!(not_found, UNKNOWN, "other answers, e.g. {others:?}");
    assert_eq!(views, 0.0, "views held after unknown ids");
    assert!(
        growth < RSS_GROWTH_BOUND_KIB,
        "the gate's RSS grew by {growth} KiB (from {rss_before}), bound {RSS_GROWTH_BOUND_KIB} KiB"
    );
}
