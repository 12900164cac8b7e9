//! `ctxsync` given a cluster's URL list in NATS_URL: it reaches a store that
//! runs on the cluster (another node, perhaps) when the list's first entry is
//! dead, and a bad entry is one error naming it.

use std::process::Command;

use ctxsync_runtime::Shutdown;
use testkit::stack::ClusterStack;

fn ctxsync(nats_url: &str, prefix: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args(args)
        .env("NATS_URL", nats_url)
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        .output()
        .expect("ctxsync runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_whose_first_url_is_dead_reaches_the_store_on_the_cluster() {
    let stack = ClusterStack::private().await;
    let shutdown = Shutdown::new();
    let _store = testkit::stack::start(stack.builder().store(|_| {}), &shutdown).await;
    let dead = format!("nats://127.0.0.1:{}", testkit::free_port());
    let list = format!("{dead},{}", stack.nats.url_list());
    let prefix = stack.prefix.clone();
    let register = [
        "agent",
        "register",
        "--tenant",
        "acme",
        "--workspace",
        "ws",
        "--name",
        "dev",
        "--json",
    ];
    let out = tokio::task::spawn_blocking(move || ctxsync(&list, &prefix, &register))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let registered: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(registered["agent_id"].is_string(), "{registered}");

    // A bad entry is refused before anything is asked, named with its
    // credentials redacted.
    let bad = format!("nats://u:secret@127.0.0.1:1,,{}", stack.nats.url_list());
    let out = ctxsync(&bad, &stack.prefix, &["agent", "show", "any"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid NATS_URL (--nats-url) entry \"\": an empty entry"),
        "{stderr}"
    );
    assert!(!stderr.contains("secret"), "{stderr}");
    shutdown.cancel();
}
