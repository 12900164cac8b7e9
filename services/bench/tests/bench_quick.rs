//! `ctxsync-bench --quick --json`, run as the real binary against a real
//! nats-server and Postgres, so the benchmark cannot rot: every section must
//! report sane numbers and every chat the right answer. The output is a
//! `BenchReport` in the one JSON convention (64-bit integers as strings).
//! Both modes run: `single` (services in the bench's process, on a test's
//! nats-server) and `deployed` (the service binaries, two replicas each, on
//! the three-node cluster the bench starts), and print the same ratios.

use std::process::Command;

use ctxsync_proto::v1::BenchReport;
use serde_json::Value;
use sqlx::Connection;
use testkit::NatsServer;

fn admin_url() -> String {
    std::env::var("CTXSYNC_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// The number at `path`; a 64-bit integer field is a JSON string of digits.
fn number(value: &Value, path: &str) -> f64 {
    let mut current = value;
    for key in path.split('.') {
        current = match key.parse::<usize>() {
            Ok(index) => &current[index],
            Err(_) => &current[key],
        };
    }
    current
        .as_f64()
        .or_else(|| current.as_str()?.parse::<i64>().ok().map(|n| n as f64))
        .unwrap_or_else(|| panic!("{path} is not a number: {current}"))
}

/// A latency section: samples taken, 0 < p50 ≤ p99 ≤ max.
fn assert_latency(report: &Value, path: &str) {
    let samples = number(report, &format!("{path}.samples"));
    let p50 = number(report, &format!("{path}.p50_us"));
    let p99 = number(report, &format!("{path}.p99_us"));
    let max = number(report, &format!("{path}.max_us"));
    assert!(samples >= 1.0, "{path}: no samples");
    assert!(p50 > 0.0, "{path}: p50 {p50}");
    assert!(p99 >= p50, "{path}: p99 {p99} < p50 {p50}");
    assert!(max >= p99, "{path}: max {max} < p99 {p99}");
    assert!(p99 < 60e6, "{path}: p99 {p99} µs is over a minute");
}

/// One test for both modes, one after the other: run at once, each would
/// measure the other's load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run with `cargo test -p ctxsync-bench --test bench_quick -- --ignored`"]
async fn quick_bench_reports_every_section_with_sane_numbers_in_both_modes() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let single = run_bench(&["--nats-url", &nats.url()]).await;
    check_report(&single, "single").await;
    drop(nats);

    // The binaries it runs are built beside ctxsync-bench (`cargo build --bins`).
    for service in ["snapshot-store", "agent-ingest", "chat-gate"] {
        testkit::workspace_binary(service, service);
    }
    let deployed = run_bench(&["--mode", "deployed"]).await;
    check_report(&deployed, "deployed").await;
    let nodes = deployed["environment"]["nats"].as_str().unwrap_or_default();
    assert_eq!(nodes.matches("nats://").count(), 3, "three nodes: {nodes}");
}

/// Runs the bench binary with `args` (plus `--quick --json` and the test's
/// Postgres) and returns its report.
async fn run_bench(args: &[&str]) -> Value {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_ctxsync-bench"))
            .args(["--quick", "--json"])
            .args(&args)
            .args(["--database-url", &admin_url()])
            .env_remove("NATS_URL")
            .env_remove("DATABASE_URL")
            .output()
            .expect("ctxsync-bench runs")
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {stderr}");
    assert!(
        stderr.contains("[bench] wake"),
        "no progress lines: {stderr}"
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    });

    let message: BenchReport = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("stdout is not a BenchReport ({e})"));
    assert_eq!(message.mode, "quick");
    report
}

/// Every section of a quick report of services run in `mode`.
async fn check_report(report: &Value, mode: &str) {
    let report = report.clone();
    assert_eq!(report["mode"], "quick");
    let services = report["environment"]["services"]
        .as_str()
        .unwrap_or_default();
    assert!(services.starts_with(&format!("{mode}:")), "{services}");
    for floor in [
        "floors.nats_pub_sub",
        "floors.nats_pub_sub_idle",
        "floors.nats_two_hops_idle",
        "floors.nats_request_reply",
        "floors.postgres.single_client",
        "floors.store_read",
        "floors.nats_fan_out.latency",
    ] {
        assert_latency(&report, floor);
    }
    assert_eq!(number(&report, "floors.idle_gap_ms"), 2.0);
    assert!(number(&report, "floors.postgres.per_second") > 0.0);
    assert_eq!(number(&report, "floors.postgres.clients"), 8.0);
    // The fan-out floor has the shape of the 1,000-chat case: 100 agents,
    // ten chats each, its publishes spread as that case's commits were.
    assert_eq!(number(&report, "floors.nats_fan_out.publishes"), 100.0);
    assert!(number(&report, "floors.nats_fan_out.span_us") > 0.0);
    assert_eq!(
        number(&report, "floors.nats_fan_out.replies_per_publish"),
        10.0
    );
    assert_eq!(
        number(&report, "floors.nats_fan_out.latency.samples"),
        1000.0
    );

    let wake = report["wake"].as_array().expect("wake cases");
    let chats: Vec<f64> = wake.iter().map(|c| number(c, "chats")).collect();
    assert_eq!(chats, [1.0, 100.0, 1000.0]);
    for (i, case) in wake.iter().enumerate() {
        let expected = number(case, "chats") * number(case, "rounds");
        assert!(expected >= 1.0);
        assert_eq!(number(case, "answered"), expected, "wake case {i}: {case}");
        assert_eq!(number(case, "correct"), expected, "wake case {i}: {case}");
        assert_eq!(case["wrong"].as_array().map(Vec::len), Some(0), "{case}");
        assert_latency(&report, &format!("wake.{i}.latency"));
        assert_latency(&report, &format!("wake.{i}.event_latency"));
        assert!(number(case, "waiting_at_commit") >= 1.0, "{case}");
    }
    // The gate counted its own work on the 1-chat rounds' events and answers
    // (deployed: read from its replicas' /metrics).
    for work in ["gate_event_work_us", "gate_answer_work_us"] {
        assert!(number(&wake[0], work) > 0.0, "{work}: {}", wake[0]);
    }

    assert_eq!(
        number(&report, "gate_ready.correct"),
        number(&report, "gate_ready.asked")
    );
    assert_latency(&report, "gate_ready.latency");

    assert!(report["push"]["pushes"].is_string(), "{}", report["push"]);
    assert!(number(&report, "push.pushes") > 0.0);
    assert!(number(&report, "push.per_second") > 0.0);
    assert_latency(&report, "push.latency");

    assert!(
        report["catalog"]["skipped"].is_null(),
        "the catalog section needs the reference MCP servers (tests/mcp-servers/install.sh): {}",
        report["catalog"]
    );
    assert!(number(&report, "catalog.live_ms") > 0.0);
    assert_latency(&report, "catalog.warm");
    assert_eq!(report["catalog"]["warm_all_pinned"], true);
    assert!(
        number(&report, "catalog.live_ms") * 1000.0 > number(&report, "catalog.warm.p50_us"),
        "live discovery is not slower than pinning from memory: {}",
        report["catalog"]
    );

    assert_latency(&report, "polling.polling_latency");
    assert_latency(&report, "polling.wake_latency");
    assert_eq!(
        number(&report, "polling.wake_latency.samples"),
        number(&report, "polling.rounds")
    );
    // The raw two hops after each round's quiet spell, one per round.
    assert_latency(&report, "polling.two_hops_same_idle");
    assert_eq!(
        number(&report, "polling.two_hops_same_idle.samples"),
        number(&report, "polling.rounds")
    );

    assert!(number(&report, "memory.bytes_per_chat") > 0.0);
    assert_eq!(number(&report, "memory.chats"), 1000.0);
    assert_eq!(report["memory"]["gate_alone"], mode == "deployed");

    assert!(report["mcp"]["skipped"].is_null(), "{}", report["mcp"]);
    for latency in [
        "mcp.call_through_catalog",
        "mcp.call_direct",
        "mcp.call_through_catalog_idle",
        "mcp.call_direct_idle",
        "mcp.call_plain_http",
        "mcp.call_plain_http_idle",
        "mcp.call_stateless",
        "mcp.call_forwarder",
        "mcp.call_forwarder_idle",
        "mcp.list",
        "mcp.first_list",
    ] {
        assert_latency(&report, latency);
    }
    assert_eq!(number(&report, "mcp.call_through_catalog.samples"), 200.0);
    assert_eq!(
        number(&report, "mcp.call_through_catalog_idle.samples"),
        200.0
    );
    assert_eq!(number(&report, "mcp.call_direct_idle.samples"), 200.0);
    assert_eq!(number(&report, "mcp.call_forwarder.samples"), 200.0);
    assert_eq!(number(&report, "mcp.call_forwarder_idle.samples"), 200.0);
    assert_eq!(number(&report, "mcp.call_plain_http_idle.samples"), 200.0);
    // The warm session calls were answered by the endpoint itself, which
    // counted its own work on each.
    assert!(
        number(&report, "mcp.catalog_work_us") > 0.0,
        "{}",
        report["mcp"]
    );
    // ... and its call path timed each call, upstream included.
    assert!(
        number(&report, "mcp.catalog_call_us") > 0.0,
        "{}",
        report["mcp"]
    );
    assert_eq!(number(&report, "mcp.list_clients"), 16.0);
    assert!(number(&report, "mcp.lists_per_second") > 0.0);
    assert!(number(&report, "mcp.tools") > 0.0);

    let targets = report["targets"].as_array().expect("targets");
    let named = |part: &str, like_for_like: bool| {
        targets
            .iter()
            .filter(|t| t["like_for_like"] == like_for_like)
            .filter(|t| t["name"].as_str().is_some_and(|n| n.contains(part)))
            .count()
    };
    // Each like-for-like target names its floor; the earlier wake ratios
    // (three cases, the single one over two idle hops, and its bound) and
    // the back-to-back call ratio are kept apart.
    for part in [
        "two hops after idleness",
        "raw fan-out",
        "raw request/reply",
        "raw Postgres",
        "warm preparation",
        "via /mcp / direct p50",
        "polling wake",
    ] {
        assert_eq!(named(part, true), 1, "{part}: {targets:?}");
    }
    assert_eq!(
        named("memory per waiting chat (gate processes)", true),
        usize::from(mode == "deployed"),
        "{targets:?}"
    );
    assert_eq!(named("/ raw pub→sub p50", false), 3, "{targets:?}");
    assert_eq!(
        named("2× raw pub→sub + one store read", false),
        1,
        "{targets:?}"
    );
    assert_eq!(
        named("2 × raw pub→sub after idleness", false),
        1,
        "{targets:?}"
    );
    // The call's target pairs calls after the same idleness; its back to
    // back ratio is kept apart.
    assert_eq!(
        named("/ direct p50, 2 ms idle before each", true),
        1,
        "{targets:?}"
    );
    assert_eq!(named("/ direct p50, back to back", false), 1, "{targets:?}");
    // Beside it, the least any HTTP hop adds after the same idleness.
    let call_target = targets
        .iter()
        .find(|t| {
            t["name"].as_str()
                == Some("warm tools/call via /mcp / direct p50, 2 ms idle before each")
        })
        .expect("the /mcp call's target");
    assert!(
        call_target["floor"]
            .as_str()
            .is_some_and(|f| f.contains("a bare forwarder after the same idleness")),
        "{call_target}"
    );
    assert_eq!(
        targets.len(),
        7 + usize::from(mode == "deployed") + 6,
        "{targets:?}"
    );
    for target in targets {
        let ratio = number(target, "ratio");
        assert!(ratio.is_finite() && ratio > 0.0, "{target}");
        assert!(target["met"].is_boolean(), "{target}");
        assert!(
            target["floor"].as_str().is_some_and(|f| !f.is_empty()),
            "{target}"
        );
    }
    assert_eq!(report["all_answers_correct"], true);
    assert_eq!(
        report["metrics"]["missing"].as_array().map(Vec::len),
        Some(0),
        "{}",
        report["metrics"]
    );

    // The bench dropped its database.
    let database = report["environment"]["database"]
        .as_str()
        .expect("database name")
        .to_owned();
    assert!(database.starts_with("ctxsync_bench_"), "{database}");
    let mut admin = sqlx::PgConnection::connect(&admin_url()).await.unwrap();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&database)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    assert!(!exists, "the bench database {database} was not dropped");
}
