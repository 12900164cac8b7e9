//! The context page in a real browser (issue 17): Debian's Chromium driven by
//! playwright-core (`tests/browser/driver.mjs`, installed by
//! `tests/browser/install.sh`) against the real binaries, a real nats-server,
//! a real Postgres database and a real `workspace-agent` process.
//!
//! The page shows a new agent live, then its discovery pending and complete
//! with the tools, without a reload, within a second of the commit; a
//! restarted agent's old tools as withheld until the new run completes; a
//! failed server's and a broken config file's errors, with a planted secret
//! marker nowhere in the page or its traffic; the key prompt without a key,
//! another tenant's agent as not found, and the catalog view with a real
//! catalog's configured server and its two charts. Screenshots of each state go to
//! `target/context-page/`; one line `PAGE-SUMMARY` gives the measured times.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{discovery_changed::Cause, mcp_discovery::Phase};
use serde_json::{Value, json};
use testkit::{NatsServer, Process, TestDatabase, workspace_binary};

use e2e::workspace::{event_where, stdio_entry};

const DEADLINE: Duration = Duration::from_secs(60);

fn addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], testkit::free_port()))
}

/// `target/` of the running test (`target/<profile>/deps/<test>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

fn browser_dir() -> PathBuf {
    std::env::var_os("CTXSYNC_BROWSER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/ctxsync/browser")
        })
}

/// The browser, one command at a time.
struct Browser {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Browser {
    fn start() -> Self {
        let dir = browser_dir();
        let chromium = Path::new("/usr/bin/chromium");
        assert!(
            chromium.exists() && dir.join("node_modules/playwright-core").exists(),
            "Chromium or playwright-core missing: run tests/setup.sh (or tests/browser/install.sh)"
        );
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../browser/driver.mjs");
        let mut child = Command::new("node")
            .arg(script)
            .env("CTXSYNC_BROWSER_DIR", &dir)
            .env("CHROMIUM", chromium)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("node runs (tests/setup.sh installs it)");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut browser = Self {
            child,
            stdin,
            stdout,
        };
        browser.answer();
        browser
    }

    fn answer(&mut self) -> Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        match line.trim_end().split_once(' ') {
            Some(("OK", json)) => serde_json::from_str(json).unwrap(),
            _ => panic!("browser: {line:?}"),
        }
    }

    /// Runs one command (the driver bounds each wait by its deadline).
    fn run(&mut self, command: Value) -> Value {
        writeln!(self.stdin, "{command}").unwrap();
        self.answer()
    }

    fn screenshot(&mut self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}.png"));
        self.run(json!({ "op": "screenshot", "path": path }));
        assert!(path.exists(), "{} written", path.display());
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({ "op": "close" }));
        let _ = self.child.wait();
    }
}

/// A good server starting slowly (discovery stays PENDING for a while), a
/// server that fails echoing the secret in its env, a broken config file.
fn write_workspace(dir: &Path, secret: &str) -> PathBuf {
    std::fs::write(dir.join("AGENTS.md"), "Use the good server for sums.\n").unwrap();
    let good =
        mcp_fixture::fixture_spec("good", &["--mode", "slow-start", "--delay-ms", "2500"], &[]);
    let failing = mcp_fixture::fixture_spec(
        "failing",
        &["--mode", "secret-error"],
        &[("FIXTURE_TOKEN", secret)],
    );
    let config =
        json!({ "mcpServers": { "good": stdio_entry(&good), "failing": stdio_entry(&failing) } });
    std::fs::write(
        dir.join(".mcp.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    let broken = dir.join("broken.mcp.json");
    std::fs::write(&broken, "{ \"mcpServers\": { \"x\": ").unwrap();
    broken
}

fn cli(nats: &NatsServer, prefix: &str, args: &[&str]) -> Value {
    let output = Command::new(workspace_binary("ctxsync-cli", "ctxsync"))
        .args(args)
        .arg("--json")
        .env("NATS_URL", nats.url())
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Milliseconds since the epoch of an RFC 3339 timestamp (as pbjson writes it).
fn millis(timestamp: &Value) -> f64 {
    let text = timestamp.as_str().expect("a timestamp");
    chrono::DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("{text:?}: {e}"))
        .timestamp_micros() as f64
        / 1000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_page_follows_an_agent_live_in_a_real_browser() {
    testkit::init_logs();
    let out = target_dir().join("context-page");
    std::fs::create_dir_all(&out).unwrap();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let prefix = testkit::unique_prefix();
    let subjects = Subjects::new(&prefix).unwrap();
    let (store_addr, ingest_addr, gate_addr) = (addr(), addr(), addr());
    let base = |http_addr: SocketAddr| {
        vec![
            ("NATS_URL", nats.url()),
            ("CTXSYNC_SUBJECT_PREFIX", prefix.clone()),
            ("CTXSYNC_HTTP_ADDR", http_addr.to_string()),
        ]
    };
    let mut store_env = base(store_addr);
    store_env.push(("DATABASE_URL", db.url().to_owned()));
    let mut store = Process::spawn("snapshot-store", "snapshot-store", &store_env);
    let mut ingest = Process::spawn("agent-ingest", "agent-ingest", &base(ingest_addr));
    let mut gate = Process::spawn("chat-gate", "chat-gate", &base(gate_addr));
    // A catalog with one server of tenant A, for the catalog view.
    let catalog_dir = tempfile::tempdir().unwrap();
    let catalog_config = catalog_dir.path().join("catalog.yaml");
    let fixture = mcp_fixture::fixture_binary();
    std::fs::write(
        &catalog_config,
        json!({ "tenants": [{ "id": "acme", "servers": [
            { "id": "notes", "transport": { "stdio": { "command": fixture, "args": ["--mode", "normal"] } } }
        ]}]})
        .to_string(),
    )
    .unwrap();
    let mut catalog_env = base(addr());
    catalog_env.push(("DATABASE_URL", db.url().to_owned()));
    catalog_env.push((
        "CTXSYNC_CATALOG_CONFIG",
        catalog_config.display().to_string(),
    ));
    let mut catalog = Process::spawn("catalog", "catalog", &catalog_env);
    store.wait_ready(DEADLINE).await;
    ingest.wait_ready(DEADLINE).await;
    gate.wait_ready(DEADLINE).await;
    catalog.wait_ready(DEADLINE).await;

    let key_a = cli(
        &nats,
        &prefix,
        &["tenant", "key", "create", "--tenant", "acme"],
    )["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let key_b = cli(
        &nats,
        &prefix,
        &["tenant", "key", "create", "--tenant", "globex"],
    )["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let secret = format!("PAGESECRET{}", uuid::Uuid::new_v4().simple());
    let url = format!("http://{gate_addr}/ui/");

    // 1. No key: the page asks for one (the key field has the focus).
    let mut browser = Browser::start();
    browser.run(json!({ "op": "open", "url": url }));
    let login = browser.run(json!({ "op": "wait_login" }));
    assert_eq!(login["focused"], "key", "{login}");
    let shot_login = browser.screenshot(&out, "1-key-prompt");

    // 2. Tenant A's key, typed; the list is live and empty. A new agent
    //    appears in it when its process starts.
    browser.run(json!({ "op": "login", "key": key_a }));
    let registered = cli(
        &nats,
        &prefix,
        &[
            "agent",
            "register",
            "--tenant",
            "acme",
            "--workspace",
            "web",
            "--name",
            "dev",
        ],
    );
    let agent_id = registered["agent_id"].as_str().unwrap().to_owned();
    let workspace = tempfile::tempdir().unwrap();
    let broken = write_workspace(workspace.path(), &secret);
    let home = tempfile::tempdir().unwrap();
    let token_file = home.path().join("token");
    std::fs::write(&token_file, registered["token"].as_str().unwrap()).unwrap();
    let agent_env = vec![
        ("CTXSYNC_INGEST_URL", format!("http://{ingest_addr}")),
        ("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string()),
        ("CTXSYNC_WORKDIR", workspace.path().display().to_string()),
        (
            "CTXSYNC_MCP_CONFIG_FILES",
            format!(".mcp.json,{}", broken.display()),
        ),
        ("HOME", home.path().display().to_string()),
    ];
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut events = testkit::subscribe(&client, subjects.discovery_changed(&agent_id)).await;
    let mut agent = Process::spawn("workspace-agent", "workspace-agent", &agent_env);
    let run_1 = event_where(&mut events, DEADLINE, |e| e.cause() == Cause::Startup)
        .await
        .agent_run_id;
    browser.run(json!({ "op": "wait_row", "agent_id": agent_id }));
    let shot_list = browser.screenshot(&out, "2-agents");

    // 3. Its page (reached with Tab and Enter) shows discovery pending, then
    //    complete with the tools, without a reload.
    browser.run(json!({ "op": "open_agent", "agent_id": agent_id }));
    browser.run(json!({ "op": "wait_phase", "phase": "PHASE_PENDING", "stale": false }));
    let shot_pending = browser.screenshot(&out, "3-agent-pending");
    let complete = event_where(&mut events, DEADLINE, |e| e.phase() == Phase::Complete).await;
    assert_eq!(complete.snapshot_agent_run_id, run_1);
    let done = browser.run(json!({
        "op": "wait_phase", "phase": "PHASE_COMPLETE", "stale": false, "min_tools": 2
    }));
    let renders = done["renders"].as_array().unwrap();
    assert!(
        renders
            .iter()
            .any(|r| r["phase"] == "PHASE_PENDING" && r["stale"] == false),
        "pending shown first: {renders:?}"
    );
    let completed = renders.last().unwrap();
    assert_eq!(completed["origin"], "event", "no reload: {completed}");
    let commit_to_page_ms = completed["at"].as_f64().unwrap() - millis(&completed["committedAt"]);
    assert!(
        commit_to_page_ms < 1000.0,
        "the page showed the completed discovery {commit_to_page_ms} ms after its commit"
    );
    let schema = browser.run(json!({ "op": "expand_first_tool" }));
    assert!(
        schema["schema"].as_str().unwrap().contains("properties"),
        "{schema}"
    );
    let shot_complete = browser.screenshot(&out, "4-agent-complete");

    // 4. The failed server and the broken config file show their errors;
    //    the planted secret is nowhere.
    browser.run(json!({ "op": "wait_text", "selector": ".failed-server", "text": "failing" }));
    browser.run(
        json!({ "op": "wait_text", "selector": ".invalid-config", "text": "broken.mcp.json" }),
    );

    // 5. The agent process restarts: the old run's tools turn withheld (the
    //    startup's commit), until the new run completes.
    agent.kill();
    let before_restart = browser.run(json!({ "op": "renders" }))["renders"]
        .as_array()
        .unwrap()
        .len();
    let mut agent = Process::spawn("workspace-agent", "workspace-agent", &agent_env);
    let run_2 = event_where(&mut events, DEADLINE, |e| e.cause() == Cause::Startup)
        .await
        .agent_run_id;
    assert_ne!(run_1, run_2);
    event_where(&mut events, DEADLINE, |e| {
        e.snapshot_agent_run_id == run_2 && e.phase() == Phase::Complete
    })
    .await;
    let done = browser.run(json!({
        "op": "wait_phase", "phase": "PHASE_COMPLETE", "stale": false, "min_tools": 2
    }));
    let after: Vec<&Value> = done["renders"].as_array().unwrap()[before_restart..]
        .iter()
        .collect();
    let withheld = after
        .iter()
        .position(|r| r["stale"] == true)
        .unwrap_or_else(|| panic!("the restart showed the old tools withheld: {after:?}"));
    assert_eq!(after[withheld]["tools"], 0, "{after:?}");
    assert!(
        after[withheld]["withheld"].as_u64().unwrap() >= 2,
        "{after:?}"
    );
    let completed_again = after
        .iter()
        .position(|r| {
            r["phase"] == "PHASE_COMPLETE" && r["stale"] == false && r["tools"].as_u64() >= Some(2)
        })
        .expect("complete again");
    assert!(
        withheld < completed_again,
        "withheld until complete: {after:?}"
    );
    assert!(
        after[withheld..completed_again]
            .iter()
            .all(|r| r["phase"] != "PHASE_COMPLETE" || r["stale"] == true),
        "no completion shown before the new run's: {after:?}"
    );
    let restart_ms = after[completed_again]["at"].as_f64().unwrap()
        - millis(&after[completed_again]["committedAt"]);
    let shot_restarted = browser.screenshot(&out, "5-agent-restarted-complete");

    // 5b. A live update keeps the keyboard's place: the agent's link,
    //     reached with Tab, has the focus again once the list is drawn anew
    //     for the agent's next report (its instruction file changed).
    browser.run(json!({ "op": "goto_hash", "hash": "#" }));
    browser.run(json!({ "op": "wait_row", "agent_id": agent_id }));
    let tabbed = browser.run(json!({ "op": "tab_to_agent", "agent_id": agent_id }));
    std::fs::write(
        workspace.path().join("AGENTS.md"),
        "Use the good server for sums and notes.\n",
    )
    .unwrap();
    let focused = browser.run(json!({
        "op": "focused_after_render", "since": tabbed["list_renders"]
    }));
    assert_eq!(
        focused,
        json!({ "tag": "A", "agent_id": agent_id }),
        "the focus once the list was drawn again"
    );
    browser.run(json!({ "op": "enter" }));
    browser.run(json!({
        "op": "wait_phase", "phase": "PHASE_COMPLETE", "stale": false, "min_tools": 2
    }));

    // 6. A phone's screen.
    browser.run(json!({ "op": "open", "url": format!("{url}#agent/{agent_id}"), "viewport": { "width": 390, "height": 844 } }));
    browser.run(json!({ "op": "login", "key": key_a }));
    browser.run(
        json!({ "op": "wait_phase", "phase": "PHASE_COMPLETE", "stale": false, "min_tools": 2 }),
    );
    let shot_phone = browser.screenshot(&out, "6-agent-phone");
    let leaked = browser.run(json!({ "op": "search", "needle": secret }));
    assert_eq!(leaked["in_page"], false, "{leaked}");
    assert_eq!(leaked["in_traffic"], false, "{leaked}");
    assert_eq!(leaked["in_requests"], false, "{leaked}");

    // 7. Tenant B's key cannot open tenant A's agent.
    browser.run(json!({ "op": "open", "url": url }));
    browser.run(json!({ "op": "wait_login" }));
    browser.run(json!({ "op": "login", "key": key_b }));
    browser.run(json!({ "op": "goto_hash", "hash": format!("#agent/{agent_id}") }));
    browser.run(json!({ "op": "wait_text", "selector": "#agent-error", "text": "No such agent" }));
    let shot_other_tenant = browser.screenshot(&out, "7-other-tenant");
    for key in [&key_a, &key_b] {
        let found = browser.run(json!({ "op": "search", "needle": key }));
        assert_eq!(found["in_page"], false, "a key is never rendered: {found}");
    }
    let leaked = browser.run(json!({ "op": "search", "needle": secret }));
    assert_eq!(leaked["in_traffic"], false, "{leaked}");

    // 8. Tenant A's catalog view after a first turn: its configured server,
    //    the setup chart and the gate wait the turn recorded.
    let http = reqwest::Client::new();
    let turn = http
        .post(format!("http://{gate_addr}/api/v1/gate"))
        .bearer_auth(&key_a)
        .json(&json!({ "chat_id": "chat-catalog", "agent_id": agent_id, "first_turn": true }))
        .send()
        .await
        .unwrap();
    assert_eq!(turn.status(), 200);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let status: Value = http
            .get(format!("http://{gate_addr}/api/v1/catalog"))
            .bearer_auth(&key_a)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if status["gate_waits"]
            .as_array()
            .is_some_and(|w| !w.is_empty())
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the catalog counts the turn's wait: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    browser.run(json!({ "op": "open", "url": format!("{url}#catalog") }));
    browser.run(json!({ "op": "wait_login" }));
    browser.run(json!({ "op": "login", "key": key_a }));
    let view = browser.run(json!({ "op": "wait_catalog", "server_id": "notes" }));
    assert!(view["row"].as_str().unwrap().contains("notes"), "{view}");
    let charts: Vec<&str> = view["charts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["chart"].as_str().unwrap())
        .collect();
    assert_eq!(charts, ["setup", "waits"], "{view}");
    assert!(
        view["charts"][0]["title"]
            .as_str()
            .unwrap()
            .starts_with("First-turn setup"),
        "{view}"
    );
    let waits = view["charts"][1]["label"].as_str().unwrap();
    assert!(waits.contains(" 1") && !waits.ends_with("none"), "{view}");
    let shot_catalog = browser.screenshot(&out, "8-catalog");
    drop(browser);

    println!(
        "PAGE-SUMMARY commit_to_page_ms={commit_to_page_ms:.0} restart_complete_to_page_ms={restart_ms:.0} screenshots={}",
        [
            &shot_login,
            &shot_list,
            &shot_pending,
            &shot_complete,
            &shot_restarted,
            &shot_phone,
            &shot_other_tenant,
            &shot_catalog
        ]
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(",")
    );
    for process in [&mut agent, &mut gate, &mut catalog, &mut ingest, &mut store] {
        let status = process.terminate(Duration::from_secs(20)).await;
        assert!(status.success(), "{} exited with {status}", process.name());
    }
}
