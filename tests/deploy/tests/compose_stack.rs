//! The compose stack for real: images built from the binaries this test run
//! produced (no Rust in a container), NATS and Postgres in containers from
//! the local images `tests/docker/setup.sh` builds, every service and the
//! demo workspace agent in containers. A first turn over HTTP is answered
//! `ready` with the demo agent's tools; of the two catalogs, one restarted
//! pins from the shared JetStream bucket without starting a server; a chat
//! waiting across a restart of the NATS container is still woken; `down -v`
//! removes everything.
//!
//! Needs a Docker engine and the local images: `bash tests/setup.sh`
//! prepares both (a missing engine is a failure, never a skip).

use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use common::{NATS_IMAGE, POSTGRES_IMAGE, build_images, require_engine_and_images, tool_names};
use deploy_checks::{deploy_dir, run};
use serde_json::{Value, json};
use testkit::agent::{Answer, FakeAgent};
use testkit::report::{complete, pending, server};

const DEADLINE: Duration = Duration::from_secs(120);

/// One compose project on free ports; `down -v` when dropped.
struct Stack {
    project: String,
    env: Vec<(String, String)>,
    ports: Ports,
}

struct Ports {
    ingest: u16,
    gate: u16,
    nats: u16,
    catalog: u16,
}

impl Stack {
    fn compose(&self) -> Command {
        let mut command = Command::new("docker-compose");
        command
            .arg("-f")
            .arg(deploy_dir().join("compose.yaml"))
            .args(["-p", &self.project])
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        command
    }

    fn up(slim: &str, mcp: &str) -> Stack {
        let ports = Ports {
            ingest: testkit::free_port(),
            gate: testkit::free_port(),
            nats: testkit::free_port(),
            catalog: testkit::free_port(),
        };
        let env = vec![
            ("CTXSYNC_IMAGE", slim.to_owned()),
            ("CTXSYNC_MCP_IMAGE", mcp.to_owned()),
            ("CTXSYNC_NATS_IMAGE", NATS_IMAGE.to_owned()),
            ("CTXSYNC_POSTGRES_IMAGE", POSTGRES_IMAGE.to_owned()),
            ("CTXSYNC_INGEST_PORT", ports.ingest.to_string()),
            ("CTXSYNC_STORE_PORT", testkit::free_port().to_string()),
            ("CTXSYNC_GATE_PORT", ports.gate.to_string()),
            ("CTXSYNC_CATALOG_PORT", ports.catalog.to_string()),
            ("CTXSYNC_CATALOG_2_PORT", testkit::free_port().to_string()),
            ("CTXSYNC_NATS_PORT", ports.nats.to_string()),
            ("CTXSYNC_POSTGRES_PORT", testkit::free_port().to_string()),
            // Long enough that only the wake ends the wait across the restart.
            ("CTXSYNC_GATE_PENDING_TIMEOUT", "120s".to_owned()),
        ];
        let stack = Stack {
            project: format!("ctxsynctest{}", std::process::id()),
            env: env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            ports,
        };
        // Waits for every health check and for the one-shot services.
        run(stack.compose().args(["up", "-d", "--no-build"]));
        stack
    }

    /// `docker-compose ps`, for the log of the test.
    fn ps(&self) -> String {
        run(self.compose().arg("ps"))
    }

    fn logs(&self, service: &str) -> String {
        run(self.compose().args(["logs", "--no-color", service]))
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(out) = self
                .compose()
                .args(["logs", "--no-color", "--tail", "40"])
                .output()
        {
            eprintln!("{}", String::from_utf8_lossy(&out.stdout));
        }
        let _ = self
            .compose()
            .args(["down", "-v", "--timeout", "30"])
            .output();
    }
}

/// The operator CLI on the host, as the published NATS port's `ctxsync-cli` user.
fn ctxsync(stack: &Stack, args: &[&str]) -> String {
    run(
        Command::new(testkit::workspace_binary("ctxsync-cli", "ctxsync"))
            .args(args)
            .env(
                "NATS_URL",
                format!(
                    "nats://ctxsync-cli:dev-ctxsync-cli@127.0.0.1:{}",
                    stack.ports.nats
                ),
            )
            .env("CTXSYNC_SUBJECT_PREFIX", "ctxsync"),
    )
}

async fn until<T, F, Fut>(what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(done) = attempt().await {
            return done;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{what}: not within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn first_turn(
    http: reqwest::Client,
    gate: u16,
    key: String,
    chat: &str,
    agent: &str,
) -> Value {
    let response = http
        .post(format!("http://127.0.0.1:{gate}/api/v1/gate"))
        .bearer_auth(key)
        .json(&json!({"chat_id": chat, "agent_id": agent, "first_turn": true}))
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .expect("the gate answers");
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// The sum of `name`'s samples whose labels contain `label` (every sample
/// when empty), or `None` while the port does not answer.
async fn metric_sum(http: &reqwest::Client, port: u16, name: &str, label: &str) -> Option<f64> {
    let text = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter(|l| l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_stack_answers_a_first_turn_and_survives_a_nats_restart() {
    testkit::init_logs();
    let started = Instant::now();
    require_engine_and_images();
    let context = tempfile::tempdir().unwrap();
    let (slim, mcp) = build_images(context.path());
    let built = started.elapsed();
    let stack = Stack::up(&slim, &mcp);
    let up = started.elapsed();
    eprintln!("docker-compose ps:\n{}", stack.ps());

    // The demo agent (registered by the stack, its id in the log) reports the
    // demo workspace from its container; a chat backend's key, from the host.
    let registered = stack.logs("register-demo-agent");
    let demo_agent = registered
        .lines()
        .find_map(|l| l.split("agent_id").nth(1))
        .map(|rest| rest.trim().to_owned())
        .unwrap_or_else(|| panic!("no agent id in the registration log:\n{registered}"));
    let key: Value = serde_json::from_str(&ctxsync(
        &stack,
        &["tenant", "key", "create", "--tenant", "demo", "--json"],
    ))
    .unwrap();
    let key = key["key"].as_str().unwrap().to_owned();
    let http = reqwest::Client::new();
    let answer = first_turn(
        http.clone(),
        stack.ports.gate,
        key.clone(),
        "demo-chat",
        &demo_agent,
    )
    .await;
    assert_eq!(answer["decision"], "GATE_DECISION_READY", "{answer}");
    let tools = tool_names(&answer);
    assert!(tools.contains(&"fixture__echo".to_owned()), "{answer}");
    let catalog = &answer["projection"]["catalog"];
    assert_eq!(catalog["status"], "STATUS_READY", "{catalog}");
    assert_eq!(catalog["pins"][0]["server_id"], "fixture", "{catalog}");

    // Two catalogs share one memory through JetStream: the one restarted
    // finds the demo server's entry fresh in the bucket, and with the other
    // stopped it alone pins the next chat, having started no server.
    run(stack.compose().args(["restart", "catalog"]));
    let catalog_port = stack.ports.catalog;
    let shared = r#"outcome="shared""#;
    until(
        "the restarted catalog's warm-up shares the demo server",
        || {
            let http = http.clone();
            async move {
                let shared = metric_sum(
                    &http,
                    catalog_port,
                    "ctxsync_catalog_warmup_servers_total",
                    shared,
                )
                .await?;
                (shared >= 1.0).then_some(())
            }
        },
    )
    .await;
    run(stack.compose().args(["stop", "catalog-2"]));
    let after_restart = first_turn(
        http.clone(),
        stack.ports.gate,
        key.clone(),
        "after-catalog-restart",
        &demo_agent,
    )
    .await;
    let pins = &after_restart["projection"]["catalog"]["pins"];
    assert_eq!(pins[0]["server_id"], "fixture", "{after_restart}");
    assert_eq!(pins[0]["source"], "SOURCE_PINNED", "{after_restart}");
    let starts = metric_sum(
        &http,
        catalog_port,
        "ctxsync_catalog_handshake_seconds_count",
        "",
    )
    .await
    .expect("the restarted catalog serves its metrics");
    let discovered = metric_sum(
        &http,
        catalog_port,
        "ctxsync_catalog_warmup_servers_total",
        r#"outcome="discovered""#,
    )
    .await
    .unwrap();
    assert_eq!(
        (starts, discovered),
        (0.0, 0.0),
        "the restarted catalog started no server"
    );
    eprintln!("COMPOSE-CATALOG-RESTART pinned from the bucket, servers started {starts}");

    // A second agent, driven from the host: pending, a chat waits, NATS restarts.
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    let registered: Value = serde_json::from_str(&ctxsync(
        &stack,
        &[
            "agent",
            "register",
            "--tenant=demo",
            "--workspace=demo",
            "--name=restart-test",
            &format!("--token-file={}", token_file.display()),
            "--json",
        ],
    ))
    .unwrap();
    let agent_id = registered["agent_id"].as_str().unwrap().to_owned();
    let token = std::fs::read_to_string(&token_file).unwrap();
    let ingest = format!("http://127.0.0.1:{}", stack.ports.ingest);
    let mut agent = FakeAgent::with_token(&ingest, &agent_id, &token);
    assert!(agent.startup().await.answer.is_accepted());
    let run_id = agent.run_id().to_owned();
    assert!(
        agent
            .push(&pending(&run_id, 1, vec![]))
            .await
            .answer
            .is_accepted()
    );
    let waiting = tokio::spawn({
        let (http, gate, key, agent) = (
            http.clone(),
            stack.ports.gate,
            key.clone(),
            agent_id.clone(),
        );
        async move { first_turn(http, gate, key, "restart-chat", &agent).await }
    });
    let gate_port = stack.ports.gate;
    until("the chat waits on the gate", || {
        let http = http.clone();
        async move {
            (metric_sum(&http, gate_port, "ctxsync_gate_waiters", "").await? >= 1.0).then_some(())
        }
    })
    .await;
    run(stack.compose().args(["restart", "nats"]));
    // Once the services are back on NATS, the completing push is accepted.
    until("the completing push is accepted after the restart", || {
        let mut attempt = FakeAgent::with_token(&ingest, &agent_id, &token);
        attempt.set_run_id(&run_id);
        let push = complete(&run_id, 2, vec![server("restarted", &["t"])]);
        async move {
            let sent = attempt.push(&push).await;
            (sent.answer == Answer::Accepted).then_some(())
        }
    })
    .await;
    let woken = tokio::time::timeout(DEADLINE, waiting)
        .await
        .expect("the waiting chat is answered")
        .unwrap();
    assert_eq!(woken["decision"], "GATE_DECISION_READY", "{woken}");
    assert_eq!(tool_names(&woken), ["restarted__t"], "{woken}");
    eprintln!(
        "COMPOSE-SUMMARY images_built_s={} stack_up_s={} total_s={}",
        built.as_secs(),
        (up - built).as_secs(),
        started.elapsed().as_secs()
    );
    drop(stack);
}
