//! What an operator's log collector gets from the real binaries: with
//! `--log-format json` every line, a startup error included, is one JSON
//! object with a `service` field; text logs written to a file carry no
//! terminal escape codes; a refused setting is named with its value.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use testkit::{NatsServer, workspace_binary};

/// A binary (package, name), the settings that stop it at start, and what
/// its error must name.
struct FailingStart {
    package: &'static str,
    bin: &'static str,
    env: Vec<(&'static str, String)>,
    named: &'static str,
}

/// The binaries, each with a setting that stops it at start and the message
/// that must name it.
fn failing_starts(nats_url: &str) -> Vec<FailingStart> {
    let start = |package, bin, env, named| FailingStart {
        package,
        bin,
        env,
        named,
    };
    vec![
        start(
            "snapshot-store",
            "snapshot-store",
            vec![
                ("NATS_URL", nats_url.to_owned()),
                ("DATABASE_URL", "mysql://root@127.0.0.1/x".to_owned()),
            ],
            "DATABASE_URL",
        ),
        start(
            "agent-ingest",
            "agent-ingest",
            vec![
                ("NATS_URL", nats_url.to_owned()),
                ("CTXSYNC_SUBJECT_PREFIX", "a..b".to_owned()),
            ],
            "a..b",
        ),
        start(
            "chat-gate",
            "chat-gate",
            vec![
                ("NATS_URL", nats_url.to_owned()),
                ("CTXSYNC_GATE_MAX_VIEWS", "0".to_owned()),
            ],
            "CTXSYNC_GATE_MAX_VIEWS",
        ),
        start(
            "catalog",
            "catalog",
            vec![
                ("NATS_URL", nats_url.to_owned()),
                ("DATABASE_URL", "postgres://127.0.0.1/x".to_owned()),
                ("CTXSYNC_CATALOG_CONFIG", "/no/such/catalog.yaml".to_owned()),
            ],
            "/no/such/catalog.yaml",
        ),
        start(
            "workspace-agent",
            "workspace-agent",
            vec![("CTXSYNC_WORKDIR", "/no/such/workspace".to_owned())],
            "CTXSYNC_WORKDIR",
        ),
    ]
}

fn run(package: &str, bin: &str, env: &[(&str, String)], format: &str) -> Output {
    let mut command = Command::new(workspace_binary(package, bin));
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CTXSYNC_LOG_FORMAT", format)
        .env("CTXSYNC_LOG", "debug")
        .env("CTXSYNC_HTTP_ADDR", "127.0.0.1:0")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null());
    command.output().expect("the binary runs")
}

#[test]
fn every_line_of_a_failed_start_is_json_with_the_service() {
    let nats = NatsServer::start();
    for FailingStart {
        package,
        bin,
        env,
        named,
    } in failing_starts(&nats.url())
    {
        let output = run(package, bin, &env, "json");
        assert_eq!(output.status.code(), Some(1), "{bin}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "{bin} said nothing");
        for line in &lines {
            let parsed: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{bin}: not a JSON line ({e}): {line}"));
            assert_eq!(parsed["service"], bin, "{bin}: {line}");
        }
        let last: serde_json::Value = serde_json::from_str(lines.last().unwrap()).unwrap();
        assert_eq!(last["level"], "ERROR", "{bin}: {stderr}");
        assert!(
            last["error"].as_str().unwrap_or_default().contains(named),
            "{bin}: the error names {named}: {stderr}"
        );
        assert!(
            !stderr.contains("Error: "),
            "{bin}: a plain error line: {stderr}"
        );
    }
}

#[test]
fn text_logs_in_a_file_have_no_escape_codes_and_a_failed_start_says_so_in_text() {
    let nats = NatsServer::start();
    for FailingStart {
        package,
        bin,
        env,
        named,
    } in failing_starts(&nats.url())
    {
        let output = run(package, bin, &env, "text");
        assert_eq!(output.status.code(), Some(1), "{bin}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains('\u{1b}'),
            "{bin}: escape codes in a pipe: {stderr:?}"
        );
        assert!(
            stderr.contains(&format!("{bin} stopped")) && stderr.contains(named),
            "{bin}: {stderr}"
        );
    }

    // A service that runs, logging to a file (as a process manager would).
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gate.log");
    let file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(workspace_binary("chat-gate", "chat-gate"))
        .env("NATS_URL", nats.url())
        .env("CTXSYNC_LOG_FORMAT", "text")
        .env("CTXSYNC_LOG", "debug")
        .env("CTXSYNC_HTTP_ADDR", "127.0.0.1:0")
        .env_remove("NO_COLOR")
        .stderr(file)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("chat-gate ready")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "chat-gate did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("chat-gate stopped"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes in the log file: {text:?}"
    );
    // Dependency chatter stays below INFO unless asked for: async-nats' own
    // connection events are not repeated next to ours.
    assert!(!text.contains("async_nats"), "{text}");
}

/// Values print as values: a path is a path, not `Some("…")`, in either format.
#[test]
fn a_running_agent_logs_its_workspace_as_a_plain_path() {
    use std::io::{BufRead as _, BufReader};
    let workspace = tempfile::tempdir().unwrap();
    let token = workspace.path().join("token");
    std::fs::write(&token, "t".repeat(40)).unwrap();
    let mut child = Command::new(workspace_binary("workspace-agent", "workspace-agent"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CTXSYNC_LOG_FORMAT", "json")
        .env("CTXSYNC_INGEST_URL", "http://127.0.0.1:9")
        .env("CTXSYNC_AGENT_TOKEN_FILE", &token)
        .env("CTXSYNC_WORKDIR", workspace.path())
        .env("CTXSYNC_HTTP_ADDR", "127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let starting = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = lines
            .recv_timeout(left)
            .expect("the agent logs its start within 30 s");
        let parsed: serde_json::Value = serde_json::from_str(&line).unwrap();
        if parsed["message"] == "workspace agent starting" {
            break parsed;
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        starting["working_dir"],
        workspace.path().display().to_string(),
        "{starting}"
    );
}

/// At the default level an operator follows one report from its push to
/// the chats it woke: the gate that ended a first turn's wait logs the push's
/// trace id (the store and ingest log it on the commit), on the real
/// binaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_logs_the_trace_of_the_push_that_woke_a_first_turn_at_info() {
    use testkit::ProcessBuilder;
    use testkit::report::{complete, pending, server};

    const WITHIN: Duration = Duration::from_secs(60);
    let trace_id = "5bf92f3577b34da6a3ce929d0e0e4737";
    let nats = NatsServer::start();
    let db = testkit::TestDatabase::create().await;
    let prefix = testkit::unique_prefix();
    let service = |package: &str| {
        ProcessBuilder::binary(package, package)
            .env("NATS_URL", nats.url())
            .env("CTXSYNC_SUBJECT_PREFIX", prefix.clone())
            .env("CTXSYNC_HTTP_ADDR", testkit::free_addr().to_string())
            .env("CTXSYNC_LOG", "info")
    };
    let mut store = service("snapshot-store")
        .env("DATABASE_URL", db.url().to_owned())
        .spawn();
    let mut ingest = service("agent-ingest").spawn();
    let mut gate = service("chat-gate")
        .env("CTXSYNC_GATE_CATALOG", "false")
        .env("CTXSYNC_GATE_PENDING_TIMEOUT", "60s")
        .spawn();
    for process in [&mut store, &mut ingest, &mut gate] {
        process.wait_ready(WITHIN).await;
    }
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = ctxsync_proto::subjects::Subjects::new(&prefix).unwrap();
    let store_client = testkit::store::StoreClient::new(client, subjects, WITHIN, "workspace")
        .retrying_no_responders();
    store_client.create_test_tenant_key().await;
    let ingest_url = format!("http://{}", ingest.http_addr().unwrap());
    let mut agent = testkit::agent::FakeAgent::register(&store_client, &ingest_url, "traced").await;
    assert!(agent.startup().await.answer.is_accepted());
    let run_id = agent.run_id().to_owned();
    assert!(
        agent
            .push(&pending(&run_id, 1, vec![]))
            .await
            .answer
            .is_accepted()
    );

    // A first turn waits on the pending discovery ...
    let http = reqwest::Client::new();
    let gate_addr = gate.http_addr().unwrap();
    let agent_id = agent.agent_id().to_owned();
    let turn = tokio::spawn({
        let http = http.clone();
        async move {
            testkit::chat::http_turn(&http, gate_addr, "chat-1", &agent_id, true, WITHIN).await
        }
    });
    let waiting = async {
        loop {
            let metrics = testkit::metrics::Metrics::scrape(&http, gate_addr)
                .await
                .unwrap();
            if metrics.sum("ctxsync_gate_waiters", &[]) >= 1.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(WITHIN, waiting)
        .await
        .expect("the turn waits on the pending discovery");

    // ... and the traced push of the completed discovery wakes it.
    let body =
        prost::Message::encode_to_vec(&complete(&run_id, 2, vec![server("docs", &["search"])]));
    let pushed = http
        .post(format!("{ingest_url}/api/v1/agent/context-state"))
        .bearer_auth(agent.token())
        .header("content-type", "application/x-protobuf")
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(pushed.status(), 200);
    let answer = turn.await.unwrap();
    assert_eq!(
        answer.outcome,
        testkit::chat::Outcome::Decision("ready".into()),
        "{answer:?}"
    );
    let log = gate.log();
    let woken: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("first-turn waits woken by a commit"))
        .collect();
    assert!(
        woken
            .iter()
            .any(|line| line.contains(trace_id) && line.contains(" INFO ")),
        "no INFO line of the gate names the push's trace id {trace_id}: {woken:?}\n{}",
        gate.log_tail(20)
    );
}
