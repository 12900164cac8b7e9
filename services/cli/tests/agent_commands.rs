//! `ctxsync agent register` and `ctxsync agent show`, run as the real binary
//! against a real snapshot-store.

use std::process::Command;

use ctxsync_runtime::Shutdown;
use testkit::stack::StackBuilder;
use testkit::{NatsServer, TestDatabase};

/// Runs the binary (blocking: the test runtime has a second worker for the store).
fn ctxsync(nats: &NatsServer, prefix: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args(args)
        .env("NATS_URL", nats.url())
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        // As on a machine that sets it: errors still print no backtrace.
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("ctxsync runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_prints_id_and_token_once_and_show_prints_the_report() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let prefix = testkit::unique_prefix();
    let shutdown = Shutdown::new();
    let _store = testkit::stack::start(
        StackBuilder::new(nats.url(), &prefix)
            .database(db.url())
            .store(|_| {}),
        &shutdown,
    )
    .await;

    let out = ctxsync(
        &nats,
        &prefix,
        &[
            "agent",
            "register",
            "--tenant",
            "acme",
            "--workspace",
            "ws",
            "--name",
            "dev",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let registered: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let agent_id = registered["agent_id"].as_str().unwrap().to_owned();
    let token = registered["token"].as_str().unwrap();
    assert!(token.starts_with("cxs_") && token.len() > 40, "{token}");

    // The store holds the token's digest, never the token.
    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT token_sha256 FROM snapshot.agents WHERE agent_id = $1::uuid")
            .bind(&agent_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    use sha2::Digest;
    assert_eq!(stored, sha2::Sha256::digest(token.as_bytes()).to_vec());

    // The same name twice is refused with a clear message.
    let again = ctxsync(
        &nats,
        &prefix,
        &[
            "agent",
            "register",
            "--tenant",
            "acme",
            "--workspace",
            "ws",
            "--name",
            "dev",
        ],
    );
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));

    let show = ctxsync(&nats, &prefix, &["agent", "show", &agent_id, "--json"]);
    assert!(
        show.status.success(),
        "{}",
        String::from_utf8_lossy(&show.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(report["agent"]["agent_id"], agent_id);
    assert_eq!(report["agent"]["name"], "dev");
    assert!(report.get("snapshot").is_none());

    let table = ctxsync(&nats, &prefix, &["agent", "show", &agent_id]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("snapshot   none yet"), "{text}");

    // An unreachable NATS is one clear error naming the variable.
    let out = Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args(["agent", "show", &agent_id])
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("NATS_URL"));
    shutdown.cancel();
}

/// `register --token-file --if-exists`: what a second `docker compose up`
/// runs. The token goes to the file (0600), never to the output; a valid
/// token file keeps the agent; a lost one gets a new token, and the old
/// token stops authenticating; `fail` refuses and leaves the file alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_to_a_token_file_is_idempotent() {
    use std::os::unix::fs::PermissionsExt;
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let prefix = testkit::unique_prefix();
    let _store = testkit::stack::start(
        StackBuilder::new(nats.url(), &prefix)
            .database(db.url())
            .store(|_| {}),
        &Shutdown::new(),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent-token");
    let file_arg = format!("--token-file={}", file.display());
    let register = |if_exists: &str| {
        ctxsync(
            &nats,
            &prefix,
            &[
                "agent",
                "register",
                "--tenant=demo",
                "--workspace=demo",
                "--name=demo-agent",
                &file_arg,
                &format!("--if-exists={if_exists}"),
                "--json",
            ],
        )
    };
    let parse = |out: &std::process::Output| -> serde_json::Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };

    let first = register("keep");
    let first_json = parse(&first);
    assert_eq!(first_json["outcome"], "OUTCOME_REGISTERED");
    let token = std::fs::read_to_string(&file).unwrap();
    assert!(token.starts_with("cxs_"));
    assert!(!String::from_utf8_lossy(&first.stdout).contains(&token));
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let agent_id = first_json["agent_id"].as_str().unwrap().to_owned();

    let again = parse(&register("keep"));
    assert_eq!(again["outcome"], "OUTCOME_KEPT");
    assert_eq!(again["agent_id"], agent_id.as_str());
    assert_eq!(std::fs::read_to_string(&file).unwrap(), token);

    let refused = register("fail");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("already exists") && stderr.contains("--if-exists keep"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), token);

    std::fs::remove_file(&file).unwrap();
    let rotated = parse(&register("keep"));
    assert_eq!(rotated["outcome"], "OUTCOME_ROTATED");
    assert_eq!(rotated["agent_id"], agent_id.as_str());
    let new_token = std::fs::read_to_string(&file).unwrap();
    assert_ne!(new_token, token);
    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT token_sha256 FROM snapshot.agents WHERE agent_id = $1::uuid")
            .bind(&agent_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    use sha2::Digest;
    assert_eq!(stored, sha2::Sha256::digest(new_token.as_bytes()).to_vec());

    // A directory that does not exist is refused before anything is registered.
    let missing = dir.path().join("no-such-dir/token");
    let out = ctxsync(
        &nats,
        &prefix,
        &[
            "agent",
            "register",
            "--tenant=demo",
            "--workspace=demo",
            "--name=other",
            &format!("--token-file={}", missing.display()),
        ],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("its directory does not exist"));
    let others: i64 =
        sqlx::query_scalar("SELECT count(*) FROM snapshot.agents WHERE name = 'other'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(others, 0);
}

/// What an operator meets first: a bad name is refused before anything is
/// connected (no NATS runs here at all), and `agent show` without a store
/// says what to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_names_and_a_missing_store_get_messages_that_say_what_to_do() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let prefix = testkit::unique_prefix();
    let out = ctxsync(
        &nats,
        &prefix,
        &[
            "agent",
            "register",
            "--tenant",
            "bad tenant",
            "--workspace",
            "w",
            "--name",
            "n",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid --tenant")
            && stderr.contains("must be 1 to 64 characters of letters, digits, '-' or '_'"),
        "{stderr}"
    );
    assert!(!stderr.contains("store the token"), "{stderr}");
    assert!(out.stdout.is_empty());
    // One line, whatever RUST_BACKTRACE says (ctxsync() sets it to 1).
    assert_eq!(
        stderr.trim_end(),
        "error: invalid --tenant: tenant \"bad tenant\" must be 1 to 64 characters of letters, digits, '-' or '_'"
    );

    let out = ctxsync(
        &nats,
        &prefix,
        &["agent", "show", "51e7ad71-5c05-47f8-924f-ec320f745c17"],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "snapshot-store is not running (nothing answers on {prefix}.store.agent.get): start it"
        )),
        "{stderr}"
    );
}

/// `ctxsync up` refuses a busy port naming its own flag, and a demo
/// workspace that is not there, before it starts or registers anything.
#[test]
fn up_checks_its_ports_and_the_demo_workspace_before_starting() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let out = Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args(["up", "--gate-addr", &format!("127.0.0.1:{port}")])
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "cannot listen on 127.0.0.1:{port} (--gate-addr / CTXSYNC_GATE_ADDR)"
        )),
        "{stderr}"
    );

    let elsewhere = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args([
            "up",
            "--demo",
            "--ingest-addr=127.0.0.1:0",
            "--store-addr=127.0.0.1:0",
        ])
        .args(["--gate-addr=127.0.0.1:0", "--catalog-addr=127.0.0.1:0"])
        .current_dir(elsewhere.path())
        .env("NATS_URL", "nats://127.0.0.1:1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the demo workspace deploy/demo/workspace (--demo-workspace / CTXSYNC_DEMO_WORKSPACE) is not a directory"),
        "{stderr}"
    );
    // Nothing was started or written there.
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
}
