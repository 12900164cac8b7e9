//! The latency report over a recorded run: the expected aggregates, no content.

mod common;

use std::time::Duration;

use catalog::latency;
use common::*;

const SENTINEL: &str = "CONTENT-SENTINEL-7f3a";

#[tokio::test]
async fn the_latency_report_prints_the_expected_aggregates_and_no_content() {
    let record = tempfile::tempdir().unwrap();
    let harness = Harness::start_acme(vec![
        fixture("a", record.path(), &[]),
        fixture("b", record.path(), &[]),
    ])
    .await;
    let session = |n: u32| format!("chat-{SENTINEL}-{n}");
    // Three new sessions (the first live, two from memory), one asked again.
    for n in 1..=3 {
        assert!(harness.prepare("acme", &session(n)).await.error.is_none());
    }
    assert!(harness.prepare("acme", &session(1)).await.follow_up);
    // Calls: the first to each server starts it; a later one reuses it.
    let text = serde_json::json!({ "text": SENTINEL });
    assert!(
        harness
            .call("acme", &session(2), "a", "echo", text.clone())
            .await
            .ok
    );
    assert!(
        harness
            .call("acme", &session(2), "a", "echo", text)
            .await
            .ok
    );
    let add = harness
        .call(
            "acme",
            &session(2),
            "b",
            "add",
            serde_json::json!({"a": 1, "b": 2}),
        )
        .await;
    assert!(add.ok);
    let withdrawn = harness
        .call("acme", &session(2), "b", "nope", serde_json::json!({}))
        .await;
    assert_eq!(error_code(&withdrawn.error), "tool.not_found");

    harness.events_written().await;
    let report = latency::report(&harness.pool, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(report.preparations.first.count, 3);
    assert_eq!(report.preparations.follow_up.count, 1);
    assert_eq!(report.preparations.live_discovery.count, 3);
    assert!(
        report.preparations.first.p50_ms.is_some() && report.preparations.first.p90_ms.is_some()
    );
    assert!(report.preparations.first.max_ms >= report.preparations.first.p50_ms);
    assert_eq!(
        (
            report.pinned_total,
            report.connected_total,
            report.failed_total
        ),
        (4, 2, 0)
    );
    let per_server: Vec<_> = report
        .pins
        .iter()
        .map(|p| (p.server_id.as_str(), p.pinned, p.connected))
        .collect();
    assert_eq!(per_server, [("a", 2, 1), ("b", 2, 1)]);
    let handshakes: Vec<_> = report
        .handshakes
        .iter()
        .map(|h| {
            (
                h.server_id.as_str(),
                h.transport.as_str(),
                h.cause.as_str(),
                h.duration.count,
            )
        })
        .collect();
    assert_eq!(
        handshakes,
        [
            ("a", "stdio", "call", 1),
            ("a", "stdio", "preparation", 1),
            ("b", "stdio", "call", 1),
            ("b", "stdio", "preparation", 1)
        ]
    );
    assert_eq!(report.calls.first_call.count, 2);
    assert_eq!(report.calls.follow_up_call.count, 1);
    assert_eq!(report.calls.setup.count, 2);
    assert!(report.calls.first_call.p50_ms >= report.calls.follow_up_call.p50_ms);
    let outcomes: Vec<_> = report
        .calls
        .by_outcome
        .iter()
        .map(|c| (c.name.as_str(), c.count))
        .collect();
    assert_eq!(
        outcomes,
        [("ok", 3)],
        "a refused call never reached a server"
    );
    assert!(report.catalog_changes.is_empty());

    let text = report.render_text();
    let json = report.render_json();
    for rendered in [&text, &json] {
        assert!(
            !rendered.contains(SENTINEL),
            "no argument, result or session content:\n{rendered}"
        );
    }
    for expected in [
        "first (new session)",
        "follow-up",
        "phase: live discovery",
        "acme/a",
        "acme/b stdio at call",
        "outcomes: ok 3",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
    let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(parsed["preparations"]["first"]["count"], "3");
    assert_eq!(parsed["pinned_total"], "4");
    println!("{text}");

    // The window bounds the report.
    let later = tokio::time::Instant::now() + Duration::from_millis(50);
    tokio::time::sleep_until(later).await;
    let empty = latency::report(&harness.pool, Duration::from_millis(10))
        .await
        .unwrap();
    assert_eq!(empty.preparations.first.count, 0);
    assert_eq!(empty.pinned_total, 0);
    assert!(empty.handshakes.is_empty());
    harness.stop().await;
}
