//! The whole path across real processes: the `snapshot-store`, `agent-ingest`,
//! `chat-gate`, `ctxsync` and `workspace-agent` binaries, a real nats-server,
//! a real Postgres database and a real npm MCP server.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ctxsync_proto::v1::{discovery_changed::Cause, mcp_discovery::Phase};
use serde_json::{Value, json};
use testkit::stack::{BinaryService, TestStack};
use testkit::{Process, workspace_binary};

use e2e::workspace::{event_where, stdio_entry};

const DEADLINE: Duration = Duration::from_secs(60);

/// A workspace with an instruction file, the real npm memory server, and our
/// fixture starting slowly, so discovery stays PENDING for a while.
fn write_workspace(dir: &Path) {
    std::fs::write(dir.join("AGENTS.md"), "Use the memory server for notes.\n").unwrap();
    let memory = mcp_fixture::reference::memory(&dir.join("memory.jsonl"));
    let slow =
        mcp_fixture::fixture_spec("slow", &["--mode", "slow-start", "--delay-ms", "1500"], &[]);
    let config =
        json!({ "mcpServers": { "memory": stdio_entry(&memory), "slow": stdio_entry(&slow) } });
    std::fs::write(
        dir.join(".mcp.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
}

fn tool_names(answer: &Value) -> Vec<String> {
    answer["servers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["tools"].as_array().unwrap().iter())
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

async fn first_turn(
    http: reqwest::Client,
    gate: SocketAddr,
    chat: &'static str,
    agent: String,
) -> Value {
    let response = http
        .post(format!("http://{gate}/api/v1/gate"))
        .json(&json!({ "chat_id": chat, "agent_id": agent, "first_turn": true }))
        .timeout(DEADLINE)
        .send()
        .await
        .expect("gate answers");
    assert!(response.status().is_success(), "{}", response.status());
    response.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_turn_waits_for_discovery_and_a_restart_withholds_old_tools_until_the_new_run_completes()
 {
    let test_stack = TestStack::private().await;
    let (nats, prefix) = (&test_stack.nats, &test_stack.prefix);
    let subjects = test_stack.subjects();
    // The store, ingest and gate binaries, configured by the stack builder.
    let builder = test_stack
        .builder()
        .store(|_| {})
        .ingest(|_| {})
        .gate(|gate| {
            gate.pending_timeout = Duration::from_secs(60);
            gate.stale_grace = Duration::from_secs(60);
        });
    let [store, ingest, gate]: [BinaryService; 3] =
        testkit::stack::spawn_binaries(&builder, DEADLINE)
            .await
            .try_into()
            .unwrap_or_else(|_| panic!("three binaries"));
    let (ingest_addr, gate_addr) = (ingest.http_addr, gate.http_addr);
    let (mut store, mut ingest, mut gate) = (store.process, ingest.process, gate.process);

    // Register through the operator CLI.
    let registered = Command::new(workspace_binary("ctxsync-cli", "ctxsync"))
        .args([
            "agent",
            "register",
            "--tenant",
            "acme",
            "--workspace",
            "w",
            "--name",
            "dev",
            "--json",
        ])
        .env("NATS_URL", nats.url())
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        .output()
        .unwrap();
    assert!(
        registered.status.success(),
        "{}",
        String::from_utf8_lossy(&registered.stderr)
    );
    let registered: Value = serde_json::from_slice(&registered.stdout).unwrap();
    let agent_id = registered["agent_id"].as_str().unwrap().to_owned();

    // The chat backend's tenant key, issued by the operator CLI too.
    let created = Command::new(workspace_binary("ctxsync-cli", "ctxsync"))
        .args(["tenant", "key", "create", "--tenant", "acme", "--json"])
        .env("NATS_URL", nats.url())
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        .output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let created: Value = serde_json::from_slice(&created.stdout).unwrap();
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {}", created["key"].as_str().unwrap())
            .parse()
            .unwrap(),
    );
    let http = reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap();

    let workspace = tempfile::tempdir().unwrap();
    write_workspace(workspace.path());
    let home = tempfile::tempdir().unwrap();
    let token_file = home.path().join("token");
    std::fs::write(&token_file, registered["token"].as_str().unwrap()).unwrap();
    let agent_env = vec![
        ("CTXSYNC_INGEST_URL", format!("http://{ingest_addr}")),
        ("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string()),
        ("CTXSYNC_WORKDIR", workspace.path().display().to_string()),
        ("HOME", home.path().display().to_string()),
    ];

    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut events = testkit::subscribe(&client, subjects.discovery_changed(&agent_id)).await;

    // 1. A first turn asked while discovery is pending is answered with the
    //    tools right after discovery completes.
    let mut agent = Process::spawn("workspace-agent", "workspace-agent", &agent_env);
    let startup = event_where(&mut events, DEADLINE, |e| e.cause() == Cause::Startup).await;
    let run_1 = startup.agent_run_id.clone();
    event_where(&mut events, DEADLINE, |e| e.phase() == Phase::Pending).await;
    let turn = tokio::spawn(first_turn(
        http.clone(),
        gate_addr,
        "chat-1",
        agent_id.clone(),
    ));
    event_where(&mut events, DEADLINE, |e| e.phase() == Phase::Complete).await;
    let completed_at = Instant::now();
    let answer = turn.await.unwrap();
    let answered_after = completed_at.elapsed();
    assert_eq!(answer["decision"], "GATE_DECISION_READY", "{answer}");
    assert!(answer["waited_ms"].as_u64().unwrap() >= 500, "{answer}");
    assert!(
        answered_after < Duration::from_secs(2),
        "answered {answered_after:?} after completion"
    );
    let projection = &answer["projection"];
    assert_eq!(projection["agent_run_id"], run_1.as_str());
    assert_eq!(projection["stale"], false);
    let tools = tool_names(projection);
    assert!(
        tools.contains(&"memory__create_entities".to_owned()),
        "{tools:?}"
    );
    assert!(tools.contains(&"slow__echo".to_owned()), "{tools:?}");
    let tool_count = tools.len();

    // 2. The agent process dies and a new one starts: its Startup makes the
    //    stored report stale; no answer offers the old process's tools, and a
    //    first turn waits until the new run completes.
    agent.kill();
    let mut agent = Process::spawn("workspace-agent", "workspace-agent", &agent_env);
    let restart = event_where(&mut events, DEADLINE, |e| e.cause() == Cause::Startup).await;
    let run_2 = restart.agent_run_id.clone();
    assert_ne!(run_1, run_2);
    let context: Value = http
        .get(format!(
            "http://{gate_addr}/api/v1/agents/{agent_id}/context"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    if context["snapshot_agent_run_id"] == run_1.as_str() {
        // Still the old process's report: its tools are withheld.
        assert_eq!(context["stale"], true, "{context}");
        assert!(tool_names(&context).is_empty(), "{context}");
        assert_eq!(context["counts"]["tools_withheld"], tool_count);
        assert!(
            context["summary"].as_str().unwrap().contains("withheld"),
            "{context}"
        );
    } else {
        // The new process already reported: only its own (pending) outcomes show.
        assert_eq!(
            context["snapshot_agent_run_id"],
            run_2.as_str(),
            "{context}"
        );
        assert_eq!(context["stale"], false);
    }
    let turn = tokio::spawn(first_turn(
        http.clone(),
        gate_addr,
        "chat-2",
        agent_id.clone(),
    ));
    event_where(&mut events, DEADLINE, |e| {
        e.snapshot_agent_run_id == run_2 && e.phase() == Phase::Complete
    })
    .await;
    let answer = turn.await.unwrap();
    assert_eq!(answer["decision"], "GATE_DECISION_READY", "{answer}");
    let projection = &answer["projection"];
    assert_eq!(projection["agent_run_id"], run_2.as_str());
    assert_eq!(projection["snapshot_agent_run_id"], run_2.as_str());
    assert_eq!(projection["stale"], false);
    assert_eq!(tool_names(projection).len(), tool_count);

    // 3. Every process stops cleanly on SIGTERM.
    for process in [&mut agent, &mut gate, &mut ingest, &mut store] {
        let status = process.terminate(Duration::from_secs(20)).await;
        assert!(status.success(), "{} exited with {status}", process.name());
    }
}
