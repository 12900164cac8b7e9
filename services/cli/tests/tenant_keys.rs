//! `ctxsync tenant key create|list|revoke`, run as the real binary against a
//! real snapshot-store: a key is shown once, only its digest is stored, list
//! never shows a key, and bad input is refused before anything is written.

use std::process::Command;

use ctxsync_runtime::Shutdown;
use sha2::Digest;
use testkit::stack::StackBuilder;
use testkit::{NatsServer, TestDatabase};

fn ctxsync(nats: &NatsServer, prefix: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ctxsync"))
        .args(args)
        .env("NATS_URL", nats.url())
        .env("CTXSYNC_SUBJECT_PREFIX", prefix)
        .output()
        .expect("ctxsync runs")
}

fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_shown_once_stored_as_digests_listed_without_secrets_and_revoked() {
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

    let created = stdout(&ctxsync(
        &nats,
        &prefix,
        &[
            "tenant",
            "key",
            "create",
            "--tenant",
            "acme",
            "--label",
            "chat backend",
            "--json",
        ],
    ));
    let created: serde_json::Value = serde_json::from_str(&created).unwrap();
    let key = created["key"].as_str().unwrap().to_owned();
    let key_id = created["key_id"].as_str().unwrap().to_owned();
    assert!(key.starts_with("cxk_") && key.len() == 47, "{key}");
    assert!(key_id.starts_with("tk_"), "{key_id}");
    assert_eq!(created["tenant"], "acme");

    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT key_sha256 FROM snapshot.tenant_keys WHERE key_id = $1")
            .bind(&key_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(stored, sha2::Sha256::digest(key.as_bytes()).to_vec());

    let other = stdout(&ctxsync(
        &nats,
        &prefix,
        &["tenant", "key", "create", "--tenant", "globex"],
    ));
    assert!(other.contains("key    cxk_"), "{other}");

    let listed = stdout(&ctxsync(&nats, &prefix, &["tenant", "key", "list"]));
    assert!(
        listed.contains(&key_id) && listed.contains("chat backend"),
        "{listed}"
    );
    assert!(listed.contains("globex"), "{listed}");
    assert!(!listed.contains("cxk_"), "list never shows a key: {listed}");
    let acme_only = stdout(&ctxsync(
        &nats,
        &prefix,
        &["tenant", "key", "list", "--tenant", "acme", "--json"],
    ));
    let acme_only: serde_json::Value = serde_json::from_str(&acme_only).unwrap();
    assert_eq!(acme_only.as_array().unwrap().len(), 1, "{acme_only}");
    assert_eq!(acme_only[0]["revoked_at"], serde_json::Value::Null);

    let revoked = stdout(&ctxsync(
        &nats,
        &prefix,
        &["tenant", "key", "revoke", &key_id],
    ));
    assert!(
        revoked.contains(&format!("revoked {key_id} (tenant acme)")),
        "{revoked}"
    );
    // Revoking again is not an error; the key stays listed with --all only.
    stdout(&ctxsync(
        &nats,
        &prefix,
        &["tenant", "key", "revoke", &key_id],
    ));
    let active = stdout(&ctxsync(
        &nats,
        &prefix,
        &["tenant", "key", "list", "--tenant", "acme"],
    ));
    assert!(!active.contains(&key_id), "{active}");
    let all = stdout(&ctxsync(
        &nats,
        &prefix,
        &[
            "tenant", "key", "list", "--tenant", "acme", "--all", "--json",
        ],
    ));
    let all: serde_json::Value = serde_json::from_str(&all).unwrap();
    assert!(all[0]["revoked_at"].is_string(), "{all}");

    // Refused with the rule, nothing written.
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM snapshot.tenant_keys")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = count().await;
    for (args, expected) in [
        (
            vec!["tenant", "key", "create", "--tenant", "bad tenant"],
            "must be 1 to 64 characters",
        ),
        (
            vec!["tenant", "key", "create", "--tenant", "a.b"],
            "must be 1 to 64 characters",
        ),
        (
            vec!["tenant", "key", "revoke", "cxk_not-an-id"],
            "is not a key id",
        ),
        (
            vec!["tenant", "key", "revoke", "tk_0000000000000000"],
            "not found",
        ),
    ] {
        let out = ctxsync(&nats, &prefix, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("cxk_"),
            "{args:?}"
        );
    }
    assert_eq!(count().await, before);
}
