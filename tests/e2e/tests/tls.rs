//! TLS across the real binaries, with a CA made at test time: every service
//! reaches NATS over `tls://` with a CA file, agent-ingest and chat-gate serve
//! HTTPS, the operator CLI registers over TLS NATS, and a workspace-agent
//! pushes to ingest over https and discovers an MCP server over https. A chat
//! backend's HTTPS first turn then carries that server's tools.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::stack::{BinaryService, TestStack};
use testkit::tls::TestCa;
use testkit::{NatsServer, Process, workspace_binary};

const DEADLINE: Duration = Duration::from_secs(60);

fn tool_names(answer: &Value) -> Vec<String> {
    answer["servers"]
        .as_array()
        .map(|servers| {
            servers
                .iter()
                .flat_map(|s| s["tools"].as_array().into_iter().flatten())
                .filter_map(|t| t["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_to_ingest_chat_to_gate_services_to_nats_and_agent_to_mcp_over_tls() {
    testkit::init_logs();
    let ca = TestCa::new();
    let ca_file = ca.ca_path().display().to_string();
    let nats_cert = ca.issue_server("nats");
    let nats = NatsServer::start_with_config(&format!(
        "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  timeout: 2\n}}\n",
        nats_cert.cert, nats_cert.key
    ));
    let nats_url = format!("tls://127.0.0.1:{}", nats.port());
    let test_stack = TestStack::on(nats).await;
    let prefix = &test_stack.prefix;
    let https = |common: &mut ctxsync_runtime::CommonArgs, name: &str| {
        let files = ca.issue_server(name);
        common.http.tls_cert = Some(files.cert);
        common.http.tls_key = Some(files.key);
    };
    // Every service on NATS over TLS, trusting the test CA (the builder hands
    // the configuration to the binaries as env vars).
    let on_tls_nats = |common: &mut ctxsync_runtime::CommonArgs| {
        common.nats_url = nats_url.clone();
        common.nats_tls.nats_ca_file = Some(ca.ca_path().to_owned());
    };
    let builder = test_stack
        .builder()
        .store(|store| on_tls_nats(&mut store.common))
        .ingest(|ingest| {
            on_tls_nats(&mut ingest.common);
            https(&mut ingest.common, "ingest");
        })
        .gate(|gate| {
            on_tls_nats(&mut gate.common);
            https(&mut gate.common, "gate");
            gate.pending_timeout = Duration::from_secs(60);
        });
    // Readiness is asked over https (see `Process::wait_ready`): each is
    // connected to NATS over TLS and serves HTTPS.
    let [store, ingest, gate]: [BinaryService; 3] =
        testkit::stack::spawn_binaries(&builder, DEADLINE)
            .await
            .try_into()
            .unwrap_or_else(|_| panic!("three binaries"));
    let (ingest_addr, gate_addr) = (ingest.http_addr, gate.http_addr);
    let (mut store, mut ingest, mut gate) = (store.process, ingest.process, gate.process);

    // The operator CLI reaches the store over TLS NATS too.
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
        .env("NATS_URL", &nats_url)
        .env("CTXSYNC_NATS_CA_FILE", &ca_file)
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
    let created = Command::new(workspace_binary("ctxsync-cli", "ctxsync"))
        .args(["tenant", "key", "create", "--tenant", "acme", "--json"])
        .env("NATS_URL", &nats_url)
        .env("CTXSYNC_NATS_CA_FILE", &ca_file)
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        .output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let created: Value = serde_json::from_slice(&created.stdout).unwrap();
    let tenant_key = created["key"].as_str().unwrap().to_owned();

    // An MCP server that speaks streamable HTTP over TLS only.
    let mcp_cert = ca.issue_server("mcp");
    let mcp = mcp_fixture::HttpFixture::start_tls(&mcp_cert.cert, &mcp_cert.key, &[]).await;
    assert!(mcp.url().starts_with("https://"), "{}", mcp.url());

    let workspace = tempfile::tempdir().unwrap();
    std::fs::write(workspace.path().join("AGENTS.md"), "Tools over TLS.\n").unwrap();
    let mcp_config = json!({ "mcpServers": { "secure": { "url": mcp.url() } } });
    std::fs::write(
        workspace.path().join(".mcp.json"),
        serde_json::to_vec_pretty(&mcp_config).unwrap(),
    )
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let token_file = home.path().join("token");
    std::fs::write(&token_file, registered["token"].as_str().unwrap()).unwrap();
    let agent_env = vec![
        (
            "CTXSYNC_INGEST_URL",
            format!("https://localhost:{}", ingest_addr.port()),
        ),
        ("CTXSYNC_INGEST_CA_FILE", ca_file.clone()),
        ("CTXSYNC_MCP_CA_FILE", ca_file.clone()),
        ("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string()),
        ("CTXSYNC_WORKDIR", workspace.path().display().to_string()),
        ("HOME", home.path().display().to_string()),
    ];
    let mut agent = Process::spawn("workspace-agent", "workspace-agent", &agent_env);

    // The chat backend's side: HTTPS to the gate, trusting the test CA only.
    let http = ca.https_client();
    let started = Instant::now();
    loop {
        let context: Value = http
            .get(format!(
                "https://{gate_addr}/api/v1/agents/{agent_id}/context"
            ))
            .bearer_auth(&tenant_key)
            .timeout(DEADLINE)
            .send()
            .await
            .expect("the gate answers over https")
            .json()
            .await
            .unwrap();
        if tool_names(&context).contains(&"secure__echo".to_owned()) {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the https MCP server's tools did not arrive: {context}\n{}",
            agent.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer: Value = http
        .post(format!("https://{gate_addr}/api/v1/gate"))
        .bearer_auth(&tenant_key)
        .json(&json!({ "chat_id": "chat-tls", "agent_id": agent_id, "first_turn": true }))
        .timeout(DEADLINE)
        .send()
        .await
        .expect("a first turn over https")
        .json()
        .await
        .unwrap();
    assert_eq!(answer["decision"], "GATE_DECISION_READY", "{answer}");
    let tools = tool_names(&answer["projection"]);
    assert!(tools.contains(&"secure__echo".to_owned()), "{tools:?}");

    // Plain HTTP to the TLS listeners gets no answer.
    let plain = reqwest::Client::new()
        .get(format!("http://{gate_addr}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        plain.is_err() || !plain.unwrap().status().is_success(),
        "the gate answered plain http"
    );

    for process in [&mut agent, &mut gate, &mut ingest, &mut store] {
        let status = process.terminate(Duration::from_secs(20)).await;
        assert!(status.success(), "{} exited with {status}", process.name());
    }
    mcp.stop().await;
}
