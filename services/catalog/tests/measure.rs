//! A measurement: preparing a session of 8 real servers live versus from
//! memory, in one run. Prints both; it runs in CI's measurement step, not
//! with the tests: `cargo test -p catalog --test measure -- --ignored --nocapture`

mod common;

use std::time::{Duration, Instant};

use common::*;
use ctxsync_proto::v1::catalog_pin::Source;

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

#[tokio::test]
#[ignore = "measurement: run with `cargo test -p catalog --test measure -- --ignored`"]
async fn preparing_from_memory_takes_milliseconds_against_seconds_live() {
    let root = tempfile::tempdir().unwrap();
    let servers = vec![
        server("everything-1", &mcp_fixture::reference::everything()),
        server("everything-2", &mcp_fixture::reference::everything()),
        server("files-1", &mcp_fixture::reference::filesystem(root.path())),
        server("files-2", &mcp_fixture::reference::filesystem(root.path())),
        server(
            "memory-1",
            &mcp_fixture::reference::memory(&root.path().join("m1.json")),
        ),
        server(
            "memory-2",
            &mcp_fixture::reference::memory(&root.path().join("m2.json")),
        ),
        server("time-1", &mcp_fixture::reference::time()),
        server("time-2", &mcp_fixture::reference::time()),
    ];
    // Production defaults: two stdio starts at a time, a 10 s user-facing bound.
    let mut settings = settings();
    settings.connect_timeout = Duration::from_secs(10);
    settings.max_concurrent_starts = 2;
    let harness = Harness::start(tenants(vec![("acme", servers)]), settings).await;

    let started = Instant::now();
    let live = harness.prepare("acme", "live").await;
    let live_elapsed = started.elapsed();
    assert!(live.error.is_none(), "{live:?}");
    assert!(
        live.pins
            .iter()
            .all(|p| p.source == Source::Connected as i32),
        "every server discovered live: {:?}",
        live.pins
            .iter()
            .map(|p| (&p.server_id, p.source, &p.error))
            .collect::<Vec<_>>()
    );

    let mut remembered = Vec::new();
    for n in 0..20 {
        let started = Instant::now();
        let reply = harness.prepare("acme", &format!("memory-{n}")).await;
        remembered.push(started.elapsed());
        assert!(reply.pins.iter().all(|p| p.source == Source::Pinned as i32));
        for (a, b) in live.pins.iter().zip(&reply.pins) {
            assert_eq!(a.catalog_hash, b.catalog_hash, "{}", a.server_id);
        }
    }
    let memory_median = median(remembered.clone());
    let memory_max = *remembered.iter().max().unwrap();
    println!(
        "catalog preparation of 8 real servers (server-everything, server-filesystem, server-memory, mcp-server-time, 2 each), \
         NATS request/reply round trip included:\n  live:        {:>9.1} ms (service-side {} ms)\n  from memory: {:>9.1} ms median, {:.1} ms max over {} sessions",
        live_elapsed.as_secs_f64() * 1000.0,
        live.duration_ms,
        memory_median.as_secs_f64() * 1000.0,
        memory_max.as_secs_f64() * 1000.0,
        remembered.len()
    );
    harness.events_written().await;
    let report = catalog::latency::report(&harness.pool, Duration::from_secs(3600))
        .await
        .unwrap();
    println!("{}", report.render_text());
    assert!(
        memory_median * 10 < live_elapsed,
        "from memory ({memory_median:?}) is not an order of magnitude below live ({live_elapsed:?})"
    );
    assert!(
        memory_median < Duration::from_millis(500),
        "{memory_median:?}"
    );
    harness.stop().await;
}
