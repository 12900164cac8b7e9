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
