//! Schemathesis (pinned in tests/schemathesis/requirements.txt, installed by
//! tests/schemathesis/install.sh) generates requests from `proto/openapi.yaml`
//! against the real agent-ingest and chat-gate on a real nats-server and
//! Postgres, with a valid credential and with an invalid one: no answer is a
//! 5xx, and every answer's status, content type, headers and body are the
//! document's; malformed input is refused and no operation ignores its
//! credential. Bounded in examples per operation and in time per run; the
//! schemathesis reports are printed (`--nocapture`) and are the failure message.
//! The working directory is a fresh temp dir: no schemathesis.toml applies.

use std::path::PathBuf;
use std::time::Instant;

use testkit::chat::TEST_TENANT_KEY;
use testkit::report::{complete, server};

const DOCUMENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto/openapi.yaml");
/// Test cases per operation and phase.
const MAX_EXAMPLES: &str = "25";
/// Seconds per run (four runs, two at a time: about 55 s in all on 2
/// cores); schemathesis stops generating when it is spent.
const MAX_TIME: &str = "25";
/// Reproducible failures: the same inputs on every run.
const SEED: &str = "24";
/// What every answer is held to. Not `positive_data_acceptance`: the
/// document gives the JSON shape the services parse, not every limit
/// `ctxsync_proto::validate` applies (those are its documented 400s).
const CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,\
response_headers_conformance,response_schema_conformance,negative_data_rejection,\
ignored_auth,unsupported_method,missing_required_header";

/// The venv's `schemathesis`, or a failure saying how to install it.
fn schemathesis() -> PathBuf {
    let dir = std::env::var_os("CTXSYNC_SCHEMATHESIS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|home| PathBuf::from(home).join(".cache/ctxsync/schemathesis"))
        })
        .expect("HOME or CTXSYNC_SCHEMATHESIS_DIR is set");
    let bin = dir.join("venv/bin/schemathesis");
    assert!(
        bin.is_file(),
        "schemathesis is missing at {}: run `bash tests/schemathesis/install.sh` (or tests/setup.sh)",
        bin.display()
    );
    bin
}

/// One schemathesis run against `base` with `Authorization: Bearer
/// <bearer>`, on the `operations` operations whose path matches `paths`: its
/// report when it found anything or did not test them all.
async fn run(
    bin: &PathBuf,
    name: &str,
    base: &str,
    bearer: &str,
    (paths, operations): (&str, usize),
) -> Option<String> {
    let workdir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let output = tokio::process::Command::new(bin)
        .current_dir(workdir.path())
        .args(["run", DOCUMENT, "--url", base])
        .args(["--include-path-regex", paths])
        .args(["--header", &format!("Authorization: Bearer {bearer}")])
        .args(["--checks", CHECKS])
        .args(["--max-examples", MAX_EXAMPLES, "--max-time", MAX_TIME])
        .args(["--seed", SEED, "--workers", "2", "--request-timeout", "10"])
        .args(["--generation-database", "none", "--no-color"])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!(
        "== schemathesis {name} ({:.1} s)\n{stdout}{stderr}",
        started.elapsed().as_secs_f64()
    );
    let tested = stdout.contains(&format!("Tested: {operations}\n"));
    (!output.status.success() || !tested).then(|| {
        format!(
            "schemathesis found problems with {name} ({}, {operations} operations expected):\n{stdout}\n{stderr}",
            output.status
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_answer_outside_the_openapi_document() {
    let bin = schemathesis();
    let token = "s".repeat(43);
    // `_test` keeps the NATS server and the database for the test's length.
    let e2e::http_stack::HttpStack {
        test: _test,
        shutdown,
        stack,
        store,
        agent_id,
    } = e2e::http_stack::start("schemathesis", &token).await;
    // An agent with a report, so the gate's listings have something in them.
    let run_id = uuid::Uuid::new_v4().to_string();
    store.startup(&agent_id, &run_id).await;
    store
        .push_ok(
            &agent_id,
            complete(&run_id, 1, vec![server("docs", &["search"])]),
        )
        .await;

    let ingest = format!("http://{}", stack.ingest().http_addr());
    let gate = format!("http://{}", stack.gate().http_addr());
    // Each service's own operations and the operator endpoints it serves.
    let ingest_paths = ("^/(api/v1/agent/|healthz|readyz|metrics)", 5);
    let gate_paths = (
        "^/(api/v1/(gate|agents|catalog|events)|ui/|healthz|readyz|metrics)",
        10,
    );
    let invalid = "cxk_notakeyofanytenant00000000000000000000000";
    // Two runs at a time, each against another service: one run keeps
    // about 0.85 of the machine's 2 cores busy (schemathesis, the service,
    // Postgres), so a pair generates about as many cases in its time bound
    // as either alone, in half the wall time of four in a row.
    let mut found = Vec::new();
    for [(first, first_bearer), (second, second_bearer)] in [
        [
            ("agent-ingest, valid token", token.as_str()),
            ("chat-gate, valid key", TEST_TENANT_KEY),
        ],
        [
            ("agent-ingest, invalid token", "not-a-token"),
            ("chat-gate, invalid key", invalid),
        ],
    ] {
        let (ingest_found, gate_found) = tokio::join!(
            run(&bin, first, &ingest, first_bearer, ingest_paths),
            run(&bin, second, &gate, second_bearer, gate_paths),
        );
        found.extend(ingest_found.into_iter().chain(gate_found));
    }
    if !found.is_empty() {
        // What the services counted, so that a failure says whether the store
        // was slow (transaction times) or dropped requests past their deadline.
        found.push(format!(
            "the services' metrics:\n{}",
            timing_metrics(&format!("{ingest}/metrics")).await
        ));
    }
    assert!(found.is_empty(), "{}", found.join("\n"));

    shutdown.cancel();
    stack.join().await;
}

/// The lines of `/metrics` at `url` that show how long requests took and
/// which were dropped past their deadline.
async fn timing_metrics(url: &str) -> String {
    let text = match reqwest::get(url).await {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(error) => return format!("cannot read {url}: {error}"),
    };
    text.lines()
        .filter(|line| {
            !line.starts_with('#')
                && (line.starts_with("ctxsync_rpc_expired_total")
                    || line.starts_with("ctxsync_store_push_transaction_seconds")
                    || line.starts_with("ctxsync_store_startups_total")
                    || line.starts_with("ctxsync_ingest_request"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}
