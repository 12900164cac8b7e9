//! Who may ask: every HTTP request needs a tenant key, the tenant comes from
//! the key, and another tenant's agent is answered exactly like an unknown
//! one, over HTTP and over NATS (where the tenant is the subject's). Real
//! store, gate, catalog and nats-server.

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::v1::service_error::Code;
use ctxsync_proto::v1::*;
use futures::StreamExt;
use serde_json::{Value, json};
use testkit::chat::TEST_TENANT_KEY;

/// Every store request of this test's prefix, as the store sees them.
async fn store_requests(h: &Harness) -> async_nats::Subscriber {
    testkit::subscribe(&h.client, h.subjects.store_all()).await
}

/// Requests delivered so far (none are waited for).
fn drain(requests: &mut async_nats::Subscriber) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(Some(message)) = futures::FutureExt::now_or_never(requests.next()) {
        seen.push(message.subject.to_string());
    }
    seen
}

async fn post_turn(
    http: &reqwest::Client,
    h: &Harness,
    key: Option<&str>,
    agent: &str,
) -> (u16, Value, Option<String>) {
    let mut request = http
        .post(h.url("/api/v1/gate"))
        .json(&json!({"chat_id": "chat-1", "agent_id": agent, "first_turn": true}));
    if let Some(key) = key {
        request = request.header("authorization", key);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, response.json().await.unwrap(), challenge)
}

async fn get_context(
    http: &reqwest::Client,
    h: &Harness,
    key: Option<&str>,
    agent: &str,
) -> (u16, Value) {
    let mut request = http.get(h.url(&format!("/api/v1/agents/{agent}/context")));
    if let Some(key) = key {
        request = request.header("authorization", key);
    }
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

#[tokio::test]
async fn requests_without_a_valid_key_are_401_and_never_reach_the_store() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    let anonymous = reqwest::Client::new();
    let mut requests = store_requests(&h).await;

    let unknown_key = testkit::store::new_tenant_key();
    for credential in [
        None,
        Some("Basic YWxhZGRpbjpvcGVuc2VzYW1l".to_owned()),
        Some("Bearer cxs_an-agent-token-is-not-a-tenant-key".to_owned()),
        Some(format!("Bearer {TEST_TENANT_KEY}x")),
    ] {
        let (status, body, challenge) =
            post_turn(&anonymous, &h, credential.as_deref(), &agent).await;
        assert_eq!(status, 401, "{credential:?}: {body}");
        assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
        assert_eq!(challenge.as_deref(), Some("Bearer realm=\"ctxsync\""));
        let (status, body) = get_context(&anonymous, &h, credential.as_deref(), &agent).await;
        assert_eq!(status, 401, "{credential:?}: {body}");
    }
    // Answered without asking anyone: the test's request below is the first
    // thing the store's subjects carry.
    h.api.state(&agent).await;
    let seen = drain(&mut requests);
    assert_eq!(seen, [h.subjects.store_get_agent_state()], "{seen:?}");

    // A well-formed key nobody issued is checked once, then remembered as unknown.
    for _ in 0..3 {
        let (status, body, _) =
            post_turn(&anonymous, &h, Some(&bearer(&unknown_key)), &agent).await;
        assert_eq!(status, 401, "{body}");
    }
    h.api.state(&agent).await;
    let verified = drain(&mut requests)
        .into_iter()
        .filter(|s| *s == h.subjects.store_tenant_key_verify())
        .count();
    assert_eq!(verified, 1, "an unknown key is looked up once");

    // The metrics count every refusal by reason.
    let metrics = anonymous
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for reason in ["missing", "malformed", "unknown_key"] {
        let line = metrics
            .lines()
            .find(|l| {
                l.starts_with("ctxsync_gate_refused_total")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .unwrap_or_else(|| panic!("no refusal counted as {reason}:\n{metrics}"));
        let count: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(count >= 1.0, "{line}");
    }
}

#[tokio::test]
async fn a_valid_key_is_answered_and_a_revoked_key_is_refused_at_once() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    let (key, key_id) = h.api.create_tenant_key(testkit::chat::TEST_TENANT).await;
    let http = reqwest::Client::new();
    let (status, body, _) = post_turn(&http, &h, Some(&bearer(&key)), &agent).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["decision"], "GATE_DECISION_READY");
    assert_eq!(body["projection"]["agent_id"], agent.as_str());
    let (status, _) = get_context(&http, &h, Some(&bearer(&key)), &agent).await;
    assert_eq!(status, 200);

    // The revocation is committed and announced before the store answers;
    // the gate applies the announcement as soon as it arrives.
    h.api.revoke_tenant_key(&key_id).await;
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (status, body, _) = post_turn(&http, &h, Some(&bearer(&key)), &agent).await;
            match status {
                401 => return body,
                200 => tokio::time::sleep(Duration::from_millis(10)).await,
                other => panic!("unexpected {other}: {body}"),
            }
        }
    })
    .await
    .expect("a revoked key is refused within 5 s (the revocation event)");
    assert_eq!(refused["error"]["code"], "unauthenticated");
    let (status, _) = get_context(&http, &h, Some(&bearer(&key)), &agent).await;
    assert_eq!(status, 401);
    // The harness's own key, of the same tenant, still works.
    let (status, _, _) = post_turn(&http, &h, Some(&bearer(TEST_TENANT_KEY)), &agent).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn another_tenants_agent_is_not_found_exactly_like_an_unknown_one() {
    // No catalog runs here: the test's own subscriber sees the preparation
    // (so NATS never answers "no responders"), and the own tenant's turn
    // waits out the catalog's timeout before it proceeds without it.
    let h = Harness::spawn_with(|config| {
        with_catalog(config);
        config.catalog_timeout = Duration::from_millis(500);
    })
    .await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    let (other_key, _) = h.api.create_tenant_key("globex").await;
    let unknown = uuid::Uuid::new_v4().to_string();
    let http = reqwest::Client::new();
    let mut catalog_requests =
        testkit::subscribe(&h.client, format!("{}.catalog.>", h.subjects.prefix())).await;

    let (status, foreign, _) = post_turn(&http, &h, Some(&bearer(&other_key)), &agent).await;
    assert_eq!(status, 404, "{foreign}");
    let (status, missing, _) = post_turn(&http, &h, Some(&bearer(&other_key)), &unknown).await;
    assert_eq!(status, 404, "{missing}");
    let same_shape = |v: &Value, id: &str| {
        v["error"]["message"]
            .as_str()
            .unwrap()
            .replace(id, "<agent>")
    };
    assert_eq!(foreign["error"]["code"], missing["error"]["code"]);
    assert_eq!(same_shape(&foreign, &agent), same_shape(&missing, &unknown));
    assert!(!foreign.to_string().contains("ws__t"), "{foreign}");

    let (status, context) = get_context(&http, &h, Some(&bearer(&other_key)), &agent).await;
    assert_eq!(status, 404, "{context}");
    assert_eq!(same_shape(&context, &agent), same_shape(&missing, &unknown));

    // Over NATS the tenant is the subject's.
    let reply = h.tenant_turn("globex", "chat-1", &agent, true).await;
    let error = reply.error.expect("not found");
    assert_eq!(error.code(), Code::NotFound);
    assert!(reply.projection.is_none());
    let own = h
        .tenant_turn(testkit::chat::TEST_TENANT, "chat-1", &agent, true)
        .await;
    assert_eq!(own.decision(), GateDecision::Ready);

    // A refused turn prepared no catalog session for anybody: the only
    // preparation asked is the own tenant's turn's (twice: nothing answers
    // it here, so the gate asks again at half its catalog timeout).
    h.api.state(&agent).await;
    let own = h.subjects.catalog_prepare(testkit::chat::TEST_TENANT);
    let asked = drain(&mut catalog_requests);
    assert!(
        !asked.is_empty() && asked.iter().all(|subject| *subject == own),
        "{asked:?}"
    );
}

#[tokio::test]
async fn the_http_answer_carries_the_keys_tenant_catalog_pins_with_their_tools() {
    let h = Harness::spawn_with(with_catalog).await;
    let fixture = mcp_fixture::fixture_binary();
    let (_catalog, _stop) = h
        .start_catalog(json!({ "tenants": [
            { "id": "acme", "servers": [
                { "id": "notes", "transport": { "stdio": { "command": fixture, "args": ["--mode", "normal"] } } }
            ]},
            { "id": "globex", "servers": [
                { "id": "secret-notes", "transport": { "stdio": { "command": fixture, "args": ["--mode", "normal"] } } }
            ]}
        ]}))
        .await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    let mut catalog_requests =
        testkit::subscribe(&h.client, format!("{}.catalog.>", h.subjects.prefix())).await;

    // A body naming another tenant is refused; the key decides.
    let response = h
        .http
        .post(h.url("/api/v1/gate"))
        .json(&json!({"chat_id": "c", "agent_id": agent, "first_turn": true, "tenant": "globex"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);

    let (status, body, _) = post_turn(&h.http, &h, None, &agent).await;
    assert_eq!(status, 200, "{body}");
    let catalog = &body["projection"]["catalog"];
    assert_eq!(catalog["status"], "STATUS_READY", "{catalog}");
    let pins = catalog["pins"].as_array().expect("pins with their tools");
    assert_eq!(pins.len(), 1, "{catalog}");
    assert_eq!(pins[0]["server_id"], "notes");
    assert_eq!(pins[0]["transport"], "MCP_TRANSPORT_STDIO");
    assert_eq!(pins[0]["source"], "SOURCE_CONNECTED");
    let mut tools: Vec<&str> = pins[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    tools.sort_unstable();
    assert_eq!(tools, ["add", "echo"]);
    let schema = pins[0]["tools"][0]["input_schema_json"]
        .as_str()
        .expect("the schema's text");
    assert!(
        serde_json::from_str::<serde_json::Value>(schema)
            .unwrap()
            .is_object(),
        "{catalog}"
    );
    assert!(!body.to_string().contains("secret-notes"), "{body}");

    // Prepared on the key's tenant's subject only.
    h.api.state(&agent).await;
    let subjects = drain(&mut catalog_requests);
    assert_eq!(
        subjects,
        [h.subjects.catalog_prepare("acme")],
        "{subjects:?}"
    );
}
