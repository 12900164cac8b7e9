//! The compose stack for real: images built from the binaries this test run
//! produced (no Rust in a container), NATS and Postgres in containers from
//! the local images `tests/docker/setup.sh` builds, every service and the
//! demo workspace agent in containers. A first turn over HTTP is answered
//! `ready` with the demo agent's tools; a chat waiting across a restart of
//! the NATS container is still woken; `down -v` removes everything.
//!
//! Needs a Docker engine and the local images: `bash tests/setup.sh`
//! prepares both (a missing engine is a failure, never a skip).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use deploy_checks::{deploy_dir, run};
use serde_json::{Value, json};
use testkit::agent::{Answer, FakeAgent};
use testkit::report::{complete, pending, server};

const BASE_IMAGE: &str = "ctxsync-local/debian:bookworm";
const NATS_IMAGE: &str = "ctxsync-local/nats:2.9";
const POSTGRES_IMAGE: &str = "ctxsync-local/postgres:15";
/// The binaries the images hold, from this test run's build.
const BINARIES: [(&str, &str); 8] = [
    ("snapshot-store", "snapshot-store"),
    ("agent-ingest", "agent-ingest"),
    ("chat-gate", "chat-gate"),
    ("catalog", "catalog"),
    ("workspace-agent", "workspace-agent"),
    ("ctxsync-cli", "ctxsync"),
    ("ctxsync-bench", "ctxsync-bench"),
    ("mcp-fixture", "mcp-fixture"),
];
const DEADLINE: Duration = Duration::from_secs(120);

fn docker() -> Command {
    Command::new("docker")
}

fn require_engine_and_images() {
    let info = Command::new("docker").arg("info").output();
    assert!(
        matches!(&info, Ok(out) if out.status.success()),
        "no Docker engine answers: run `bash tests/setup.sh` (it installs and starts one): {info:?}"
    );
    for image in [BASE_IMAGE, NATS_IMAGE, POSTGRES_IMAGE] {
        let found = docker().args(["image", "inspect", image]).output().unwrap();
        assert!(
            found.status.success(),
            "local image {image} is missing: run `bash tests/setup.sh`"
        );
    }
}

/// `ctxsync-compose-test:slim` and `:mcp` from stripped copies of this run's binaries.
fn build_images(context: &Path) -> (String, String) {
    let prebuilt = context.join("prebuilt");
    std::fs::create_dir_all(&prebuilt).unwrap();
    for (package, bin) in BINARIES {
        let binary = testkit::workspace_binary(package, bin);
        run(Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(prebuilt.join(bin))
            .arg(&binary));
    }
    let dockerfile = deploy_dir().join("docker/Dockerfile");
    let mut tags = Vec::new();
    for target in ["slim", "mcp"] {
        let tag = format!("ctxsync-compose-test:{target}");
        run(docker()
            // The legacy builder, as Debian's engine has it (no buildx needed).
            .env("DOCKER_BUILDKIT", "0")
            .args(["build", "-q", "-f"])
            .arg(&dockerfile)
            .args(["--target", target, "-t", &tag])
            .args(["--build-arg", &format!("BUILDER_IMAGE={BASE_IMAGE}")])
            .args(["--build-arg", &format!("BASE_IMAGE={BASE_IMAGE}")])
            .args(["--build-arg", "MCP_RUNTIMES="])
            .arg(context));
        tags.push(tag);
    }
    (tags[0].clone(), tags[1].clone())
}

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
        };
        let env = vec![
            ("CTXSYNC_IMAGE", slim.to_owned()),
            ("CTXSYNC_MCP_IMAGE", mcp.to_owned()),
            ("CTXSYNC_NATS_IMAGE", NATS_IMAGE.to_owned()),
            ("CTXSYNC_POSTGRES_IMAGE", POSTGRES_IMAGE.to_owned()),
            ("CTXSYNC_INGEST_PORT", ports.ingest.to_string()),
            ("CTXSYNC_STORE_PORT", testkit::free_port().to_string()),
            ("CTXSYNC_GATE_PORT", ports.gate.to_string()),
            ("CTXSYNC_CATALOG_PORT", testkit::free_port().to_string()),
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

fn tool_names(answer: &Value) -> Vec<String> {
    answer["projection"]["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["tools"].as_array().into_iter().flatten())
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect()
}

async fn gauge(http: &reqwest::Client, port: u16, name: &str) -> Option<f64> {
    let text = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
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
        async move { (gauge(&http, gate_port, "ctxsync_gate_waiters").await? >= 1.0).then_some(()) }
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
