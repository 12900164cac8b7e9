//! The warm-up: after ready, one server at a time, rounds, abandon; nothing waits on it.

mod common;

use std::time::{Duration, UNIX_EPOCH};

use catalog::WarmupStatus;
use common::*;
use ctxsync_proto::v1::catalog_pin::Source;

fn warm_settings() -> catalog::Settings {
    let mut settings = settings();
    settings.warmup.enabled = true;
    settings
}

async fn finished(harness: &Harness, bound: Duration) -> WarmupStatus {
    let mut status = harness.running().warmup();
    tokio::time::timeout(bound, status.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes in time")
        .expect("status channel open")
        .clone()
}

fn ready_unix_ms(harness: &Harness) -> u128 {
    harness
        .running()
        .ready_at()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

#[tokio::test]
async fn warmup_starts_after_ready_one_server_at_a_time_and_records_only_its_handshakes() {
    let record = tempfile::tempdir().unwrap();
    let slow = ["--mode", "slow-start", "--delay-ms", "300"];
    let harness = Harness::start(
        tenants(vec![
            (
                "acme",
                vec![
                    fixture("a", record.path(), &slow),
                    fixture("b", record.path(), &slow),
                ],
            ),
            ("other", vec![fixture("c", record.path(), &slow)]),
        ]),
        warm_settings(),
    )
    .await;
    let status = finished(&harness, Duration::from_secs(30)).await;
    assert_eq!(status.discovered, ["acme/a", "acme/b", "other/c"]);
    assert_eq!(status.rounds, 1);
    assert!(status.abandoned.is_empty());

    let starts = mcp_fixture::read_starts(record.path());
    assert_eq!(starts.len(), 3);
    assert!(
        starts.iter().all(|s| s.concurrent == 1),
        "one server at a time: {starts:?}"
    );
    let ready = ready_unix_ms(&harness);
    assert!(
        starts.iter().all(|s| s.unix_ms >= ready),
        "every warm-up start came after ready ({ready}): {starts:?}"
    );
    for table in ["sessions", "pins", "generations"] {
        let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM catalog.{table}"
        )))
        .fetch_one(&harness.pool)
        .await
        .unwrap();
        assert_eq!(count, 0, "the warm-up wrote nothing to catalog.{table}");
    }
    // Its handshakes are recorded for `ctxsync latency`, one per server.
    harness.events_written().await;
    let report = catalog::latency::report(&harness.pool, Duration::from_secs(3600))
        .await
        .unwrap();
    let mut warmed: Vec<(String, String, u64)> = report
        .handshakes
        .iter()
        .filter(|h| h.cause == "warmup")
        .map(|h| (h.tenant.clone(), h.server_id.clone(), h.duration.count))
        .collect();
    warmed.sort();
    assert_eq!(
        warmed,
        [
            ("acme".to_owned(), "a".to_owned(), 1),
            ("acme".to_owned(), "b".to_owned(), 1),
            ("other".to_owned(), "c".to_owned(), 1)
        ]
    );
    assert!(
        report.pins.is_empty(),
        "a warm-up handshake is no pin: {report:?}"
    );

    // The first chat after the warm-up starts no server.
    let reply = harness.prepare("acme", "s1").await;
    assert!(
        reply.pins.iter().all(|p| p.source == Source::Pinned as i32),
        "{reply:?}"
    );
    assert_eq!(mcp_fixture::read_starts(record.path()).len(), 3);
    harness.stop().await;
}

#[tokio::test]
async fn warmup_retries_failed_servers_in_rounds_then_abandons_them() {
    let crash_record = tempfile::tempdir().unwrap();
    let ok_record = tempfile::tempdir().unwrap();
    let mut settings = warm_settings();
    settings.warmup.attempts = 3;
    settings.warmup.retry_interval = Duration::from_millis(200);
    let harness = Harness::start(
        tenants(vec![(
            "acme",
            vec![
                fixture("crash", crash_record.path(), &["--mode", "crash"]),
                fixture("ok", ok_record.path(), &[]),
            ],
        )]),
        settings,
    )
    .await;
    let status = finished(&harness, Duration::from_secs(30)).await;
    assert_eq!(status.rounds, 3);
    assert_eq!(status.discovered, ["acme/ok"]);
    assert_eq!(status.abandoned, ["acme/crash"]);
    let crash_starts = mcp_fixture::read_starts(crash_record.path());
    assert_eq!(crash_starts.len(), 3, "tried once per round");
    for pair in crash_starts.windows(2) {
        assert!(
            pair[1].unix_ms - pair[0].unix_ms >= 200,
            "rounds are retry_interval apart: {crash_starts:?}"
        );
    }
    assert_eq!(
        mcp_fixture::read_starts(ok_record.path()).len(),
        1,
        "a discovered server is not retried"
    );
    let metrics = ctxsync_runtime::metrics::handle().render();
    assert!(
        metrics.contains("ctxsync_catalog_warmup_servers_total{outcome=\"abandoned\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("ctxsync_catalog_warmup_rounds_total"));

    // An abandoned server is left to live discovery at the next preparation.
    let reply = harness.prepare("acme", "s1").await;
    let sources: Vec<_> = reply.pins.iter().map(|p| p.source).collect();
    assert_eq!(sources, [Source::Failed as i32, Source::Pinned as i32]);
    assert_eq!(mcp_fixture::read_starts(crash_record.path()).len(), 4);
    harness.stop().await;
}

#[tokio::test]
async fn nothing_waits_on_a_hanging_warmup() {
    let hang_record = tempfile::tempdir().unwrap();
    let ok_record = tempfile::tempdir().unwrap();
    let mut settings = warm_settings();
    settings.warmup.connect_timeout = Duration::from_secs(120);
    let harness = Harness::start(
        tenants(vec![
            (
                "slow",
                vec![fixture("hang", hang_record.path(), &["--mode", "hang"])],
            ),
            ("acme", vec![fixture("ok", ok_record.path(), &[])]),
        ]),
        settings,
    )
    .await;
    assert!(
        eventually(Duration::from_secs(10), || !mcp_fixture::read_starts(
            hang_record.path()
        )
        .is_empty())
        .await,
        "the warm-up started the hanging server"
    );
    let ready = ready_unix_ms(&harness);
    assert!(mcp_fixture::read_starts(hang_record.path())[0].unix_ms >= ready);

    // Readiness and a chat's preparation do not wait for the stuck handshake.
    let url = format!("http://{}/readyz", harness.running().http_addr());
    let response = tokio::time::timeout(Duration::from_secs(5), reqwest::get(&url))
        .await
        .expect("readyz answers at once")
        .unwrap();
    assert_eq!(response.status(), 200);
    let reply = tokio::time::timeout(Duration::from_secs(15), harness.prepare("acme", "s1"))
        .await
        .expect("a preparation answers while the warm-up hangs");
    assert_eq!(reply.pins.len(), 1);
    assert!(!harness.running().warmup().borrow().finished);

    // Shutdown stops the warm-up and its server.
    let hang_pid = mcp_fixture::read_starts(hang_record.path())[0].pid;
    harness.stop().await;
    assert!(
        eventually(Duration::from_secs(10), || !mcp_fixture::pid_alive(
            hang_pid
        ))
        .await,
        "the hanging server was stopped at shutdown"
    );
}
