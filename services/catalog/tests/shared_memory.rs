//! The memory shared across replicas in a JetStream key-value bucket, and
//! the claimed warm-up: restarts and replicas pin without starting servers.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use catalog::WarmupStatus;
use catalog::config::ServerConfig;
use catalog::settings::memory_bucket_name;
use common::*;
use ctxsync_mcp::TransportSpec;
use ctxsync_proto::v1::catalog_pin::Source;
use futures::StreamExt as _;
use testkit::stack::TestStack;

const PINNED: i32 = Source::Pinned as i32;
const CONNECTED: i32 = Source::Connected as i32;

fn write_tools(path: &Path, tools: &[(&str, &str)]) {
    let json: Vec<_> = tools
        .iter()
        .map(|(name, description)| serde_json::json!({"name": name, "description": description}))
        .collect();
    std::fs::write(path, serde_json::to_vec(&json).unwrap()).unwrap();
}

fn starts(record: &Path) -> usize {
    mcp_fixture::read_starts(record).len()
}

/// `entry` as a replica holding the test key puts it into `bucket`.
fn sealed(
    bucket: &str,
    key: &catalog::config::ServerKey,
    entry: &ctxsync_proto::v1::CatalogMemoryEntry,
) -> bytes::Bytes {
    catalog::MemoryKey::new(TEST_MEMORY_KEY).unwrap().seal(
        bucket,
        key.as_str(),
        &ctxsync_proto::Message::encode_to_vec(entry),
    )
}

/// A stdio server's memory entry with one tool, `echo`, described so,
/// discovered at `discovered_at_unix_ms` by `release`.
fn echo_entry(
    description: &str,
    discovered_at_unix_ms: u64,
    release: &str,
) -> ctxsync_proto::v1::CatalogMemoryEntry {
    ctxsync_proto::v1::CatalogMemoryEntry {
        transport: ctxsync_proto::v1::McpTransport::Stdio as i32,
        tools: vec![ctxsync_proto::v1::McpTool {
            name: "echo".into(),
            description: description.into(),
            input_schema_json: r#"{"type":"object"}"#.into(),
        }],
        catalog_hash: "whatever".into(),
        discovered_at_unix_ms,
        release: release.into(),
        ..Default::default()
    }
}

/// Settings whose memory bucket is `bucket` (another prefix's, to share it).
fn sharing(bucket: &str) -> catalog::Settings {
    let mut settings = settings();
    settings.memory.bucket = Some(bucket.to_owned());
    settings
}

#[tokio::test]
async fn a_restarted_catalog_pins_every_server_from_the_bucket_with_no_start() {
    let record = tempfile::tempdir().unwrap();
    let servers = || {
        tenants(vec![(
            "acme",
            vec![
                fixture("a", record.path(), &[]),
                fixture("b", record.path(), &["--page-size", "1"]),
                fixture(
                    "c",
                    record.path(),
                    &["--mode", "slow-start", "--delay-ms", "200"],
                ),
            ],
        )])
    };
    let mut first = Harness::start(servers(), settings()).await;
    let live = first.prepare("acme", "s1").await;
    assert!(live.pins.iter().all(|p| p.source == CONNECTED), "{live:?}");
    assert_eq!(starts(record.path()), 3);
    first.stop_catalog().await;

    // The same configuration, restarted: its memory is loaded before it serves.
    let prefix = first.subjects.prefix().to_owned();
    let restarted = first.replica(&prefix, servers(), settings()).await;
    assert_eq!(restarted.running().remembered(), 3, "loaded at start");
    let reply = restarted.prepare("acme", "s2").await;
    assert_eq!(
        sources(&reply),
        [
            ("a".to_owned(), PINNED),
            ("b".to_owned(), PINNED),
            ("c".to_owned(), PINNED)
        ]
    );
    for (pinned, discovered) in reply.pins.iter().zip(&live.pins) {
        assert_eq!(pinned.catalog_hash, discovered.catalog_hash);
        assert_eq!(pinned.tools, discovered.tools);
    }
    assert_eq!(
        starts(record.path()),
        3,
        "the restarted catalog started no server"
    );
    println!(
        "RESTART-SUMMARY first preparation after restart: {} ms (the live one: {} ms), 0 starts",
        reply.duration_ms, live.duration_ms
    );
    assert!(
        reply.duration_ms < 1000,
        "pinned in milliseconds: {} ms",
        reply.duration_ms
    );
    restarted.stop().await;
    first.stop().await;
}

#[tokio::test]
async fn two_replicas_share_discoveries_configuration_changes_and_failures() {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    write_tools(&tools_file, &[("echo", "Echo")]);
    let file = tools_file.display().to_string();
    let fx = || {
        fixture(
            "fx",
            record.path(),
            &["--mode", "changing-tools", "--tools-file", &file],
        )
    };
    let changed = || {
        let mut server = fx();
        server.classification = Some("internal".into());
        tenants(vec![("acme", vec![server])])
    };
    // Replica B has its own subject prefix, so the test can address each
    // replica (on one prefix the queue group picks either), and A's bucket.
    let a = Harness::start(tenants(vec![("acme", vec![fx()])]), settings()).await;
    let bucket = memory_bucket_name(a.subjects.prefix());

    // A discovers live.
    assert_eq!(
        sources(&a.prepare("acme", "a1").await),
        [("fx".to_owned(), CONNECTED)]
    );
    assert_eq!(starts(record.path()), 1);

    // B pins it from the bucket: no start.
    let b = a
        .replica(
            &testkit::unique_prefix(),
            tenants(vec![("acme", vec![fx()])]),
            sharing(&bucket),
        )
        .await;
    assert!(b.running().remembers("acme", "fx"), "loaded at start");
    assert_eq!(
        sources(&b.prepare("acme", "b1").await),
        [("fx".to_owned(), PINNED)]
    );
    assert_eq!(starts(record.path()), 1, "B started no server");

    // A configuration change discovered on A is a new entry on both.
    a.running().reload(changed()).unwrap();
    b.running().reload(changed()).unwrap();
    assert!(!a.running().remembers("acme", "fx") && !b.running().remembers("acme", "fx"));
    assert_eq!(
        sources(&a.prepare("acme", "a2").await),
        [("fx".to_owned(), CONNECTED)]
    );
    assert_eq!(starts(record.path()), 2);
    assert!(
        eventually(Duration::from_secs(10), || b
            .running()
            .remembers("acme", "fx"))
        .await,
        "B received A's new entry"
    );
    assert_eq!(
        a.running().remembered(),
        2,
        "the old configuration's entry stays"
    );
    assert_eq!(b.running().remembered(), 2);
    assert_eq!(
        sources(&b.prepare("acme", "b2").await),
        [("fx".to_owned(), PINNED)]
    );
    assert_eq!(starts(record.path()), 2);

    // A failed call on B: the server can no longer list its tools. A forgets.
    std::fs::remove_file(&tools_file).unwrap();
    let call = b
        .call(
            "acme",
            "b2",
            "fx",
            "echo",
            serde_json::json!({"text": "hi"}),
        )
        .await;
    assert_eq!(
        error_code(&call.error),
        "tool.server_unreachable",
        "{call:?}"
    );
    assert!(
        eventually(Duration::from_secs(10), || !a
            .running()
            .remembers("acme", "fx"))
        .await,
        "A forgot the entry B's failed call forgot"
    );
    assert_eq!(
        a.running().remembered(),
        1,
        "only the failed configuration's entry went"
    );
    let reply = a.prepare("acme", "a3").await;
    assert_eq!(
        sources(&reply),
        [("fx".to_owned(), Source::Failed as i32)],
        "A tried it live: {reply:?}"
    );
    b.stop().await;
    a.stop().await;
}

#[tokio::test]
async fn the_buckets_hold_no_secret() {
    let record = tempfile::tempdir().unwrap();
    let web = mcp_fixture::HttpFixture::start(&[]).await;
    let record_arg = record.path().display().to_string();
    let stdio = catalog::config::ServerConfig {
        credential_ref: Some("vault:acme/SECRET-CREDREF-4471".into()),
        ..server(
            "local",
            &mcp_fixture::fixture_spec(
                "local",
                &["--record-dir", &record_arg, "SECRET-ARG-4471"],
                &[("API_TOKEN", "SECRET-ENV-4471")],
            ),
        )
    };
    let mut headers = BTreeMap::new();
    headers.insert(
        "Authorization".to_owned(),
        "Bearer SECRET-HEADER-4471".to_owned(),
    );
    let remote = ServerConfig {
        transport: TransportSpec::StreamableHttp {
            url: format!("{}?token=SECRET-QUERY-4471", web.url()),
            headers,
        },
        ..http("remote", web.url())
    };
    let mut settings = settings();
    settings.warmup.enabled = true;
    let harness = Harness::start(tenants(vec![("acme", vec![stdio, remote])]), settings).await;
    let mut status = harness.running().warmup();
    let status = tokio::time::timeout(Duration::from_secs(60), status.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes")
        .unwrap()
        .clone();
    assert_eq!(
        status.discovered,
        ["acme/local", "acme/remote"],
        "{status:?}"
    );
    let reply = harness.prepare("acme", "s1").await;
    assert_eq!(
        sources(&reply),
        [("local".to_owned(), PINNED), ("remote".to_owned(), PINNED)]
    );

    // Every key and value of both buckets, read back through async-nats.
    let js = async_nats::jetstream::new(harness.client.clone());
    let name = memory_bucket_name(harness.subjects.prefix());
    let mut read = Vec::new();
    for bucket in [name.clone(), format!("{name}_claims")] {
        let store = js.get_key_value(&bucket).await.expect("the bucket exists");
        let keys: Vec<String> = store
            .keys()
            .await
            .unwrap()
            .map(|k| k.unwrap())
            .collect()
            .await;
        for key in keys {
            let mut history = store.history(&key).await.unwrap();
            while let Some(entry) = history.next().await {
                let entry = entry.unwrap();
                read.push((bucket.clone(), key.clone(), entry.value.to_vec()));
            }
        }
    }
    let memory_entries = read.iter().filter(|(b, _, _)| *b == name).count();
    assert_eq!(memory_entries, 2, "one entry per server");
    for (bucket, key, value) in &read {
        for text in [key.as_bytes(), value.as_slice()] {
            let text = String::from_utf8_lossy(text);
            assert!(
                !text.contains("4471"),
                "bucket {bucket} key {key} holds a planted secret: {text}"
            );
        }
    }
    harness.stop().await;
    web.stop().await;
}

/// Warms three slow servers (one record dir each) on two replicas started
/// together on `builder`'s NATS and `prefix`, sharing one bucket (of
/// `replicas`) or each its own; the starts of each server.
async fn warm_two_replicas(
    builder: testkit::stack::StackBuilder,
    prefix: &str,
    share: bool,
    replicas: usize,
) -> Vec<usize> {
    let records: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let slow = ["--mode", "slow-start", "--delay-ms", "300"];
    let servers = tenants(vec![(
        "acme",
        records
            .iter()
            .enumerate()
            .map(|(i, r)| fixture(&format!("s{i}"), r.path(), &slow))
            .collect(),
    )]);
    let mut settings = settings();
    settings.warmup.enabled = true;
    settings.memory.replicas = replicas;
    let mut builder = builder;
    for replica in 0..2 {
        let mut settings = settings.clone();
        if !share {
            // Each its own bucket: the replicas share nothing, as before.
            settings.memory.bucket = Some(format!("{}_{replica}", memory_bucket_name(prefix)));
        }
        builder = builder.catalog(servers.clone(), settings, |_| {});
    }
    let shutdown = ctxsync_runtime::Shutdown::new();
    let running = testkit::stack::start(builder, &shutdown).await;
    let mut finished: Vec<WarmupStatus> = Vec::new();
    for replica in &running.catalogs {
        let mut status = replica.running.warmup();
        finished.push(
            tokio::time::timeout(Duration::from_secs(60), status.wait_for(|s| s.finished))
                .await
                .expect("the warm-up finishes")
                .unwrap()
                .clone(),
        );
    }
    for (status, replica) in finished.iter().zip(&running.catalogs) {
        assert_eq!(status.discovered.len(), 3, "{status:?}");
        assert!(status.abandoned.is_empty(), "{status:?}");
        assert_eq!(replica.running.remembered(), 3);
    }
    let starts = records.iter().map(|r| starts(r.path())).collect();
    shutdown.cancel();
    running.stop().await;
    starts
}

#[tokio::test]
async fn two_replicas_started_together_start_each_server_once_during_warmup() {
    let stack = TestStack::private().await;
    let before = warm_two_replicas(stack.builder(), &stack.prefix, false, 1).await;
    let stack = TestStack::private().await;
    let after = warm_two_replicas(stack.builder(), &stack.prefix, true, 1).await;
    println!(
        "WARMUP-SUMMARY starts per server, two replicas warming together: not shared {before:?}, shared {after:?}"
    );
    assert_eq!(
        before,
        [2, 2, 2],
        "without sharing each replica starts each server"
    );
    assert_eq!(
        after,
        [1, 1, 1],
        "one replica warms each server; the other pins it"
    );
}

/// Two processes that spin for as long as they are held: a busy machine,
/// whose scheduling delays open the window between one replica's release
/// of a claim and the other's watch delivering the entry.
struct CpuLoad(Vec<std::process::Child>);

impl CpuLoad {
    fn start(processes: usize) -> Self {
        Self(
            (0..processes)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("a busy loop starts")
                })
                .collect(),
        )
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::test]
async fn two_replicas_warming_together_on_a_three_node_cluster_under_load_start_each_server_once() {
    const RUNS: usize = 20;
    let cluster = testkit::stack::ClusterStack::private().await;
    let load = CpuLoad::start(2);
    let mut runs = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        // Each run its own prefix (so its own bucket, replicated on all
        // three nodes) and database, on the one cluster.
        let db = testkit::TestDatabase::create().await;
        let prefix = testkit::unique_prefix();
        let builder = testkit::stack::StackBuilder::new(cluster.nats.url_list(), prefix.clone())
            .database(db.url());
        runs.push(warm_two_replicas(builder, &prefix, true, 3).await);
    }
    drop(load);
    let twice = runs
        .iter()
        .filter(|starts| starts.iter().any(|&n| n != 1))
        .count();
    println!(
        "WARMUP-CLUSTER-SUMMARY runs {RUNS}, two replicas on three nodes under load, runs with a server not started exactly once: {twice}; starts per run {runs:?}"
    );
    assert_eq!(
        twice, 0,
        "every server started exactly once in every run: {runs:?}"
    );
}

#[tokio::test]
async fn a_restarted_replicas_warmup_pins_fresh_entries_and_discovers_older_ones_again() {
    let recent_record = tempfile::tempdir().unwrap();
    let stale_record = tempfile::tempdir().unwrap();
    let recent = fixture("recent", recent_record.path(), &[]);
    let stale = fixture("stale", stale_record.path(), &[]);
    let servers = || tenants(vec![("acme", vec![recent.clone(), stale.clone()])]);
    let mut first = Harness::start(servers(), settings()).await;
    first.stop_catalog().await;

    // This release remembered both: one half an hour ago, one two hours ago.
    let js = async_nats::jetstream::new(first.client.clone());
    let bucket = memory_bucket_name(first.subjects.prefix());
    let store = js.get_key_value(&bucket).await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    for (server, age) in [(&recent, 30 * 60), (&stale, 2 * 3600)] {
        let key = catalog::config::ServerKey::of("acme", server);
        let entry = echo_entry(
            "Echo",
            (now - Duration::from_secs(age)).as_millis() as _,
            env!("CARGO_PKG_VERSION"),
        );
        store
            .put(key.as_str(), sealed(&bucket, &key, &entry))
            .await
            .unwrap();
    }

    let mut settings = settings();
    settings.warmup.enabled = true;
    settings.warmup.fresh = Duration::from_secs(3600);
    let prefix = first.subjects.prefix().to_owned();
    let restarted = first.replica(&prefix, servers(), settings).await;
    let mut status = restarted.running().warmup();
    let status = tokio::time::timeout(Duration::from_secs(60), status.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes")
        .unwrap()
        .clone();
    assert!(status.abandoned.is_empty(), "{status:?}");
    assert_eq!(
        (starts(recent_record.path()), starts(stale_record.path())),
        (0, 1),
        "the entry within the fresh window is pinned as it is; the older one is discovered again"
    );
    let reply = restarted.prepare("acme", "s1").await;
    assert_eq!(reply.pins.len(), 2, "{reply:?}");
    assert!(reply.pins.iter().all(|p| p.source == PINNED), "{reply:?}");
    restarted.stop().await;
    first.stop().await;
}

#[tokio::test]
async fn an_entry_of_another_release_is_pinned_until_the_warmup_discovers_it_first() {
    let record = tempfile::tempdir().unwrap();
    let tools_file = record.path().join("tools.json");
    write_tools(&tools_file, &[("echo", "Echo")]);
    let file = tools_file.display().to_string();
    let old = fixture(
        "old",
        record.path(),
        &["--mode", "changing-tools", "--tools-file", &file],
    );
    let new_record = tempfile::tempdir().unwrap();
    let new = fixture("new", new_record.path(), &[]);
    let servers = || tenants(vec![("acme", vec![new.clone(), old.clone()])]);
    let mut first = Harness::start(servers(), settings()).await;
    first.stop_catalog().await;

    // Another release remembered `old` with a tool description that changed since.
    let js = async_nats::jetstream::new(first.client.clone());
    let store = js
        .get_key_value(memory_bucket_name(first.subjects.prefix()))
        .await
        .unwrap();
    let key = catalog::config::ServerKey::of("acme", &old);
    let entry = echo_entry("Old echo", 1, "0.0.0-previous");
    let bucket = memory_bucket_name(first.subjects.prefix());
    store
        .put(key.as_str(), sealed(&bucket, &key, &entry))
        .await
        .unwrap();

    let mut settings = settings();
    settings.warmup.enabled = true;
    let prefix = first.subjects.prefix().to_owned();
    let restarted = first.replica(&prefix, servers(), settings).await;
    let mut status = restarted.running().warmup();
    let status = tokio::time::timeout(Duration::from_secs(60), status.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes")
        .unwrap()
        .clone();
    assert_eq!(
        status.discovered,
        ["acme/old", "acme/new"],
        "another release's entry is re-discovered first"
    );
    assert_eq!(starts(record.path()), 1, "the warm-up started it once");
    let reply = restarted.prepare("acme", "s1").await;
    let pin = reply.pins.iter().find(|p| p.server_id == "old").unwrap();
    assert_eq!(pin.source, PINNED);
    assert_eq!(
        pin.tools[0].description, "Echo",
        "the re-discovered tools are pinned"
    );
    let stored = store.get(key.as_str()).await.unwrap().unwrap();
    let bucket = memory_bucket_name(prefix.as_str());
    let opened = catalog::MemoryKey::new(TEST_MEMORY_KEY)
        .unwrap()
        .open(&bucket, key.as_str(), &stored)
        .map(<[u8]>::to_vec)
        .expect("sealed by the restarted replica");
    let stored =
        <ctxsync_proto::v1::CatalogMemoryEntry as ctxsync_proto::Message>::decode(&*opened)
            .unwrap();
    assert_eq!(
        stored.release,
        env!("CARGO_PKG_VERSION"),
        "this release wrote it back"
    );
    restarted.stop().await;
    first.stop().await;
}

#[tokio::test]
async fn without_jetstream_the_catalog_serves_from_its_own_memory() {
    // An account without JetStream: every bucket operation is refused.
    let nats = testkit::NatsServer::start_with_config(
        "accounts { NOJS: { users: [{user: nojs, password: nojs}] } }",
    );
    let url = nats.url().replace("nats://", "nats://nojs:nojs@");
    let record = tempfile::tempdir().unwrap();
    let servers = tenants(vec![("acme", vec![fixture("fx", record.path(), &[])])]);
    let db = testkit::TestDatabase::create().await;
    let prefix = testkit::unique_prefix();
    let shutdown = ctxsync_runtime::Shutdown::new();
    let builder = testkit::stack::StackBuilder::new(url.clone(), &prefix)
        .database(db.url())
        .catalog(servers, settings(), |_| {});
    let started = tokio::time::timeout(
        Duration::from_secs(20),
        testkit::stack::start(builder, &shutdown),
    )
    .await
    .expect("the catalog starts without waiting on the bucket");
    let client = async_nats::ConnectOptions::with_user_and_password("nojs".into(), "nojs".into())
        .connect(nats.url())
        .await
        .unwrap();
    let subjects = ctxsync_proto::subjects::Subjects::new(&prefix).unwrap();
    let prepare = async |session: &str| {
        let request = ctxsync_proto::v1::CatalogPrepareRequest {
            tenant: "acme".into(),
            session_id: session.into(),
        };
        ctxsync_runtime::rpc::request::<_, ctxsync_proto::v1::CatalogPrepareReply>(
            &client,
            subjects.catalog_prepare("acme"),
            &request,
            None,
            REQUEST_TIMEOUT,
        )
        .await
    };
    let first = prepare("s1").await.unwrap();
    assert_eq!(sources(&first), [("fx".to_owned(), CONNECTED)]);
    let second = prepare("s2").await.unwrap();
    assert_eq!(
        sources(&second),
        [("fx".to_owned(), PINNED)],
        "the in-process memory serves"
    );
    assert_eq!(starts(record.path()), 1);
    let readyz = format!("http://{}/readyz", started.catalog().http_addr());
    assert_eq!(reqwest::get(&readyz).await.unwrap().status(), 200);
    shutdown.cancel();
    started.stop().await;
}

/// A NATS server whose one account, `app`, has JetStream or not, switched by
/// a restart; catalogs of one prefix and database on it, and one fixture.
struct Switchable {
    nats: testkit::NatsServer,
    db: testkit::TestDatabase,
    prefix: String,
    record: tempfile::TempDir,
}

impl Switchable {
    fn account(jetstream: bool) -> String {
        let jetstream = if jetstream { "jetstream: enabled" } else { "" };
        format!("accounts {{ APP: {{ {jetstream}\n users: [{{user: app, password: app}}] }} }}")
    }

    async fn without_jetstream() -> Self {
        Self {
            nats: testkit::NatsServer::start_with_config(&Self::account(false)),
            db: testkit::TestDatabase::create().await,
            prefix: testkit::unique_prefix(),
            record: tempfile::tempdir().unwrap(),
        }
    }

    /// Restarts the server with JetStream on or off (its store kept).
    fn switch(&mut self, jetstream: bool) {
        self.nats.restart_with_config(&Self::account(jetstream));
    }

    async fn catalog(
        &self,
        settings: catalog::Settings,
        shutdown: &ctxsync_runtime::Shutdown,
    ) -> testkit::stack::Stack {
        let url = self.nats.url().replace("nats://", "nats://app:app@");
        let servers = tenants(vec![("acme", vec![fixture("fx", self.record.path(), &[])])]);
        let builder = testkit::stack::StackBuilder::new(url, &self.prefix)
            .database(self.db.url())
            .catalog(servers, settings, |_| {});
        testkit::stack::start(builder, shutdown).await
    }

    async fn client(&self) -> async_nats::Client {
        async_nats::ConnectOptions::with_user_and_password("app".into(), "app".into())
            .connect(self.nats.url())
            .await
            .unwrap()
    }

    async fn prepare(&self, session: &str) -> ctxsync_proto::v1::CatalogPrepareReply {
        let subjects = ctxsync_proto::subjects::Subjects::new(&self.prefix).unwrap();
        let request = ctxsync_proto::v1::CatalogPrepareRequest {
            tenant: "acme".into(),
            session_id: session.into(),
        };
        ctxsync_runtime::rpc::request::<_, ctxsync_proto::v1::CatalogPrepareReply>(
            &self.client().await,
            subjects.catalog_prepare("acme"),
            &request,
            None,
            REQUEST_TIMEOUT,
        )
        .await
        .unwrap()
    }

    fn starts(&self) -> usize {
        starts(self.record.path())
    }

    /// Waits until the memory bucket holds `entries` values.
    async fn until_bucket_holds(&self, entries: u64, why: &str) {
        let js = async_nats::jetstream::new(self.client().await);
        let stream = format!("KV_{}", memory_bucket_name(&self.prefix));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let held = match js.get_stream(&stream).await {
                Ok(mut stream) => stream.info().await.map_or(0, |i| i.state.messages),
                Err(_) => 0,
            };
            if held == entries {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "{why}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test]
async fn a_discovery_made_while_jetstream_was_away_is_shared_once_it_is_back() {
    // No JetStream at first: the catalog serves from its own memory.
    let mut world = Switchable::without_jetstream().await;
    let first_shutdown = ctxsync_runtime::Shutdown::new();
    let first = world.catalog(settings(), &first_shutdown).await;
    let live = world.prepare("s1").await;
    assert_eq!(sources(&live), [("fx".to_owned(), CONNECTED)]);
    assert_eq!(world.starts(), 1);

    // JetStream is back: the bucket opens and the discovery it missed is
    // written into it.
    world.switch(true);
    world
        .until_bucket_holds(
            1,
            "the entry discovered without JetStream never reached the bucket",
        )
        .await;
    first_shutdown.cancel();
    first.stop().await;

    // A replica started now pins from the bucket: no server starts.
    let second_shutdown = ctxsync_runtime::Shutdown::new();
    let second = world.catalog(settings(), &second_shutdown).await;
    assert_eq!(second.catalog().remembered(), 1, "loaded at start");
    let pinned = world.prepare("s2").await;
    assert_eq!(sources(&pinned), [("fx".to_owned(), PINNED)]);
    assert_eq!(pinned.pins[0].catalog_hash, live.pins[0].catalog_hash);
    assert_eq!(world.starts(), 1, "the new replica started no server");
    second_shutdown.cancel();
    second.stop().await;
}

#[tokio::test]
async fn a_warmup_waits_for_a_bucket_slow_to_open_and_pins_what_it_holds() {
    // The bucket holds a discovery of the fixture …
    let mut world = Switchable::without_jetstream().await;
    world.switch(true);
    let first_shutdown = ctxsync_runtime::Shutdown::new();
    let first = world.catalog(settings(), &first_shutdown).await;
    assert_eq!(
        sources(&world.prepare("s1").await),
        [("fx".to_owned(), CONNECTED)]
    );
    world
        .until_bucket_holds(1, "the discovery reached the bucket")
        .await;
    first_shutdown.cancel();
    first.stop().await;

    // … but cannot be opened when a warming replica starts.
    world.switch(false);
    let mut warming = settings();
    warming.warmup.enabled = true;
    let second_shutdown = ctxsync_runtime::Shutdown::new();
    let second = world.catalog(warming, &second_shutdown).await;
    assert_eq!(second.catalog().remembered(), 0, "nothing loaded");
    world.switch(true);
    let mut status = second.catalog().warmup();
    let finished = tokio::time::timeout(Duration::from_secs(60), status.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes")
        .unwrap()
        .clone();
    assert_eq!(finished.discovered, ["acme/fx"], "{finished:?}");
    assert_eq!(
        world.starts(),
        1,
        "the warm-up pinned the bucket's entry once the bucket opened"
    );
    assert_eq!(
        sources(&world.prepare("s2").await),
        [("fx".to_owned(), PINNED)]
    );
    second_shutdown.cancel();
    second.stop().await;
}

#[tokio::test]
async fn an_http_entry_expires_at_the_same_moment_on_every_replica() {
    let web = mcp_fixture::HttpFixture::start(&[]).await;
    let servers = || tenants(vec![("acme", vec![http("web", web.url())])]);
    let mut short = settings();
    short.discovery_reuse = Duration::from_millis(1500);
    let a = Harness::start(servers(), short.clone()).await;
    let mut on_b = short;
    on_b.memory.bucket = Some(memory_bucket_name(a.subjects.prefix()));
    let b = a.replica(&testkit::unique_prefix(), servers(), on_b).await;
    assert_eq!(
        sources(&a.prepare("acme", "a1").await),
        [("web".to_owned(), CONNECTED)]
    );
    assert!(
        eventually(Duration::from_secs(10), || b
            .running()
            .remembers("acme", "web"))
        .await,
        "B received A's discovery"
    );
    assert_eq!(
        sources(&b.prepare("acme", "b1").await),
        [("web".to_owned(), PINNED)]
    );
    // The window runs from the discovery time in the entry: once A's entry
    // is past it, so is B's.
    assert!(
        eventually(Duration::from_secs(10), || !a
            .running()
            .remembers("acme", "web"))
        .await,
        "A's entry expired"
    );
    assert!(!b.running().remembers("acme", "web"), "B's expired with it");
    assert_eq!(
        sources(&b.prepare("acme", "b2").await),
        [("web".to_owned(), CONNECTED)]
    );
    b.stop().await;
    a.stop().await;
    web.stop().await;
}

/// The values the bucket's stream holds now (a `Store`'s status is cached).
async fn stored(js: &async_nats::jetstream::Context, bucket: &str) -> u64 {
    let mut stream = js.get_stream(format!("KV_{bucket}")).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// `ctxsync_catalog_memory_refused_total` by `reason`.
async fn memory_refused(h: &Harness, reason: &str) -> f64 {
    metric(
        h.running(),
        &format!("ctxsync_catalog_memory_refused_total{{reason=\"{reason}\"}}"),
    )
    .await
}

/// Waits until the series of `reason` is at least `at_least`.
async fn until_refused(h: &Harness, reason: &str, at_least: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let now = memory_refused(h, reason).await;
        if now >= at_least {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{reason} refusals reach {at_least} within 15 s (now {now})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes a forged value and waits until it is refused for `reason`. The
/// bucket keeps one value per key, so a value replaced before the watch
/// delivered it is never seen: each forgery is refused before the next.
async fn refused_once<T>(h: &Harness, reason: &str, write: impl Future<Output = T>) {
    let before = memory_refused(h, reason).await;
    write.await;
    until_refused(h, reason, before + 1.0).await;
}

/// Entries only a catalog replica sealed are applied: what a request aimed
/// at the bucket makes the catalog write (its own reply payload published
/// on the bucket key's subject), a well-formed entry with no tools put by a user allowed
/// to write the bucket, one sealed under another key and a replica's real
/// entry replayed under another server's key are each ignored and counted,
/// and the other tenant's next preparation still pins its server's tools
/// from memory with no start.
#[tokio::test]
async fn forged_memory_entries_are_ignored_and_the_other_tenants_tools_stay_pinned() {
    use ctxsync_proto::Message as _;
    let record = tempfile::tempdir().unwrap();
    let servers = tenants(vec![
        ("acme", vec![fixture("fa", record.path(), &[])]),
        (
            "beta",
            vec![fixture("fb", record.path(), &["--page-size", "1"])],
        ),
    ]);
    let acme_key = servers.enabled_servers("acme").unwrap()[0].key.clone();
    let beta_key = servers.enabled_servers("beta").unwrap()[0].key.clone();
    let h = Harness::start(servers, settings()).await;
    let live = h.prepare("beta", "b1").await;
    assert_eq!(sources(&live), [("fb".to_owned(), CONNECTED)]);
    assert!(!live.pins[0].tools.is_empty());
    assert_eq!(
        sources(&h.prepare("acme", "a1").await),
        [("fa".to_owned(), CONNECTED)]
    );
    let started = starts(record.path());

    let bucket = memory_bucket_name(h.subjects.prefix());
    let js = async_nats::jetstream::new(h.client.clone());
    let kv = js
        .get_key_value(&bucket)
        .await
        .expect("the catalog made its bucket");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let acme_value = loop {
        if let Some(value) = kv.get(acme_key.as_str()).await.unwrap() {
            break value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the catalog's own entry reaches the bucket within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The attack: a call's reply (the catalog's own answer) published on the key's subject.
    let reply = h
        .call(
            "acme",
            "no-such-session",
            "fa",
            "echo",
            serde_json::json!({}),
        )
        .await;
    assert_eq!(error_code(&reply.error), "session.not_prepared");
    let subject = format!("$KV.{bucket}.{}", beta_key.as_str());
    let publish = |payload: Vec<u8>| {
        let (js, subject) = (js.clone(), subject.clone());
        async move {
            js.publish(subject, payload.into())
                .await
                .unwrap()
                .await
                .expect("a user allowed to write the bucket writes it")
        }
    };
    refused_once(&h, "unsealed", publish(reply.encode_to_vec())).await;
    // A well-formed entry saying the server has no tools, put as the catalog would, unsealed.
    let empty = ctxsync_proto::v1::CatalogMemoryEntry {
        transport: ctxsync_proto::v1::McpTransport::Stdio as i32,
        release: env!("CARGO_PKG_VERSION").into(),
        discovered_at_unix_ms: 1,
        ..Default::default()
    }
    .encode_to_vec();
    let put = kv.put(beta_key.as_str(), empty.clone().into());
    refused_once(&h, "unsealed", async { put.await.unwrap() }).await;
    // The same, sealed under a key no replica holds.
    let other = catalog::MemoryKey::new(&[9; 32]).unwrap();
    let sealed = other.seal(&bucket, beta_key.as_str(), &empty).to_vec();
    refused_once(&h, "bad_tag", publish(sealed)).await;
    // A replica's real entry of acme's server, replayed under beta's key.
    refused_once(&h, "bad_tag", publish(acme_value.to_vec())).await;

    let pinned = h.prepare("beta", "b2").await;
    assert_eq!(sources(&pinned), [("fb".to_owned(), PINNED)], "{pinned:?}");
    assert_eq!(pinned.pins[0].tools, live.pins[0].tools);
    assert_eq!(pinned.pins[0].catalog_hash, live.pins[0].catalog_hash);
    assert_eq!(starts(record.path()), started, "nothing started");
    assert_eq!(h.running().remembered(), 2);
    h.stop().await;
}

/// The memory is bounded: with room for 2 entries, a third server is still
/// answered (live) but remembered nowhere, the refusal is counted, the
/// bucket (created with the bound) refuses a third key from anyone, and the
/// map never grows past 2.
#[tokio::test]
async fn the_memory_past_its_bound_refuses_new_entries_and_nothing_grows() {
    let record = tempfile::tempdir().unwrap();
    let servers = || {
        tenants(vec![(
            "acme",
            vec![
                fixture("a", record.path(), &[]),
                fixture("b", record.path(), &["--page-size", "1"]),
                fixture("c", record.path(), &["--page-size", "2"]),
            ],
        )])
    };
    let bucket = format!("bounded_{}", testkit::unique_prefix().replace('.', "_"));
    let mut settings = sharing(&bucket);
    settings.memory.max_entries = 2;
    let h = Harness::start(servers(), settings).await;
    let full = memory_refused(&h, "full").await;
    let live = h.prepare("acme", "s1").await;
    assert!(live.pins.iter().all(|p| p.source == CONNECTED), "{live:?}");
    assert_eq!(h.running().remembered(), 2, "the map holds its bound");
    until_refused(&h, "full", full + 1.0).await;

    let js = async_nats::jetstream::new(h.client.clone());
    let kv = js.get_key_value(&bucket).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stored(&js, &bucket).await != 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bucket holds the two entries within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A third key is refused by the bucket itself, whoever writes it.
    let key = catalog::MemoryKey::new(TEST_MEMORY_KEY).unwrap();
    let third = "ab".repeat(32);
    let sealed = key.seal(&bucket, &third, b"whatever");
    let refused = kv.put(third.as_str(), sealed).await;
    assert!(
        refused.is_err(),
        "the bucket's bound refuses it: {refused:?}"
    );
    assert_eq!(stored(&js, &bucket).await, 2, "nothing grew in the bucket");

    // The next preparation pins the two remembered servers and discovers the third again.
    let next = h.prepare("acme", "s2").await;
    let pinned = next.pins.iter().filter(|p| p.source == PINNED).count();
    assert_eq!(pinned, 2, "{next:?}");
    assert_eq!(h.running().remembered(), 2, "nothing grew");
    h.stop().await;
}

/// A bucket filled by someone else's values (ignored, yet taking its room)
/// refuses the catalog's put: counted as full, the bucket still works, and
/// this replica still remembers the server in its own map.
#[tokio::test]
async fn a_bucket_filled_by_forged_values_refuses_the_catalogs_put_as_full() {
    let record = tempfile::tempdir().unwrap();
    let servers = tenants(vec![("acme", vec![fixture("a", record.path(), &[])])]);
    let bucket = format!("filled_{}", testkit::unique_prefix());
    let mut settings = sharing(&bucket);
    settings.memory.max_entries = 2;
    let h = Harness::start(servers, settings).await;
    let js = async_nats::jetstream::new(h.client.clone());
    let kv = js.get_key_value(&bucket).await.unwrap();
    let (full, unsealed) = (
        memory_refused(&h, "full").await,
        memory_refused(&h, "unsealed").await,
    );
    for key in ["aa", "bb"] {
        kv.put(key.repeat(32).as_str(), "junk".into())
            .await
            .unwrap();
    }
    until_refused(&h, "unsealed", unsealed + 2.0).await;
    assert_eq!(h.running().remembered(), 0, "nothing of it applied");

    let live = h.prepare("acme", "s1").await;
    assert_eq!(sources(&live), [("a".to_owned(), CONNECTED)]);
    until_refused(&h, "full", full + 1.0).await;
    assert!(
        h.running().remembers("acme", "a"),
        "this replica's map has it"
    );
    assert_eq!(stored(&js, &bucket).await, 2, "the bucket refused the put");
    let next = h.prepare("acme", "s2").await;
    assert_eq!(sources(&next), [("a".to_owned(), PINNED)]);
    h.stop().await;
}
