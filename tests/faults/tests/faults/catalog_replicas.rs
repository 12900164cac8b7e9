//! Two catalog processes behind one round-robin address, one killed with
//! SIGKILL mid-conversation: a 2025 MCP session started on it and a
//! 2026-07-28 client holding a pin handle both go on through the other,
//! with the same pins; only requests in flight at the kill could be lost.

use faults::{Cluster, Summary, addr_of, all_ready};
use serde_json::{Value, json};
use testkit::{NatsServer, RoundRobin, TestDatabase};

const STATELESS: &str = "2026-07-28";
const HANDLE: &str = "ctxsync.dev/pins";

/// One POST to `/mcp` on a new connection (so the balancer alternates): a
/// 2025 request naming `session`, or with `session` `None` a 2026-07-28 one
/// (its version and capabilities in `_meta` and headers). The status, the
/// session id answered, and the JSON-RPC answer (JSON or SSE).
async fn post(
    url: &str,
    key: &str,
    session: Option<&str>,
    mut body: Value,
) -> (u16, Option<String>, Value) {
    let method = body["method"].as_str().unwrap_or_default().to_owned();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut request = client
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .bearer_auth(key);
    match session {
        Some(session) => {
            request = request
                .header("mcp-session-id", session)
                .header("mcp-protocol-version", "2025-06-18");
        }
        None if method != "initialize" => {
            let meta = body["params"]
                .as_object_mut()
                .expect("params")
                .entry("_meta")
                .or_insert_with(|| json!({}));
            meta["io.modelcontextprotocol/protocolVersion"] = json!(STATELESS);
            meta["io.modelcontextprotocol/clientCapabilities"] = json!({});
            request = request
                .header("mcp-protocol-version", STATELESS)
                .header("mcp-method", &method);
            if let Some(name) = body["params"]["name"].as_str() {
                request = request.header("mcp-name", name);
            }
        }
        None => {}
    }
    let response = request.json(&body).send().await.expect("an answer");
    let status = response.status().as_u16();
    let id = response
        .headers()
        .get("mcp-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = response.text().await.unwrap_or_default();
    let answer = serde_json::from_str(&text).unwrap_or_else(|_| {
        text.lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
            .rfind(|message| message.get("id").is_some())
            .unwrap_or(Value::Null)
    });
    (status, id, answer)
}

fn echo(id: u64, handle: Option<&str>) -> Value {
    let mut params = json!({"name": "notes__echo", "arguments": {"text": format!("call {id}")}});
    if let Some(handle) = handle {
        params["_meta"] = json!({HANDLE: handle});
    }
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
}

fn echoed(answer: &Value) -> bool {
    answer["result"]["isError"] == json!(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_killed_mid_conversation_leaves_both_eras_to_the_other_replica() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("catalog.yaml");
    let record = dir.path().join("record");
    std::fs::create_dir_all(&record).unwrap();
    // JSON is YAML.
    let servers = json!({"tenants": [{"id": "acme", "servers": [{
        "id": "notes",
        "transport": {"stdio": {
            "command": mcp_fixture::fixture_binary().display().to_string(),
            "args": ["--record-dir", record.display().to_string()],
        }},
    }]}]});
    std::fs::write(&config, servers.to_string()).unwrap();
    // One key file for both: each applies the other's memory and sessions.
    let key_file = dir.path().join("memory.key");
    std::fs::write(&key_file, "faults-catalog-replicas-memory-key-0123456789").unwrap();
    let replica = |name: &str| {
        cluster
            .catalog(&config)
            .named(name)
            .env(
                "CTXSYNC_CATALOG_MEMORY_KEY_FILE",
                key_file.display().to_string(),
            )
            .spawn()
    };
    let mut store = cluster.store("store").spawn();
    let mut a = replica("catalog-a");
    let mut b = replica("catalog-b");
    all_ready(&mut [&mut store, &mut a, &mut b]).await;
    let test = cluster.nats("faults-test").await;
    let key = cluster
        .store_client(&test.client)
        .create_tenant_key("acme")
        .await
        .0;
    let balancer = RoundRobin::start(vec![addr_of(&a), addr_of(&b)]).await;
    let url = format!("http://{}/mcp", balancer.addr);

    // A 2025 session, started on A (the balancer's first), and a 2026 list.
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "faults", "version": "1"}}});
    let (status, session, answer) = post(&url, &key, None, initialize).await;
    assert_eq!(status, 200, "{answer}");
    let session = session.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let (status, _, _) = post(&url, &key, Some(&session), initialized).await;
    assert_eq!(status, 202, "B restored the session");
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}});
    let (status, _, listed) = post(&url, &key, None, list.clone()).await;
    assert_eq!(status, 200, "{listed}");
    let handle = listed["result"]["_meta"][HANDLE]
        .as_str()
        .expect("a pin handle")
        .to_owned();

    // Each era's call on each replica in turn, then A is killed and each
    // goes on: every call is counted answered or lost.
    let calls = |ids: std::ops::Range<u64>| {
        let (url, key, session, handle) = (&url, &key, &session, &handle);
        async move {
            let mut answered = 0;
            for id in ids.clone() {
                let (_, _, answer) = post(url, key, Some(session), echo(id, None)).await;
                answered += usize::from(echoed(&answer));
                let (_, _, answer) = post(url, key, None, echo(id, Some(handle))).await;
                answered += usize::from(echoed(&answer));
            }
            (ids.count() * 2, answered)
        }
    };
    let (sent_before, answered_before) = calls(10..14).await;
    let served_by_a = balancer.taken(0);
    assert!(served_by_a >= 4 && balancer.taken(1) >= 4);

    a.kill();
    let (sent_after, answered_after) = calls(20..24).await;
    let (_, _, relisted) = post(&url, &key, Some(&session), list).await;
    assert_eq!(
        relisted["result"]["tools"], listed["result"]["tools"],
        "the same pins"
    );
    assert_eq!(
        balancer.taken(0),
        served_by_a,
        "nothing reached the killed replica"
    );
    let lost = sent_before + sent_after - answered_before - answered_after;
    Summary::new("catalog_replica_killed_mid_conversation")
        .field("calls_before_kill", sent_before)
        .field("calls_after_kill", sent_after)
        .field("answered", answered_before + answered_after)
        .field("lost", lost)
        .emit();
    assert_eq!(lost, 0, "no call outside the kill's moment is lost");
    drop(b);
}
