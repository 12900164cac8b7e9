//! The context page's APIs without a browser (the browser test is
//! `tests/e2e/tests/context_page.rs`): the page itself, refusals without a
//! key or ticket, a tenant's list holding only its agents, and the event
//! stream carrying a commit to its tenant only, the catalog view's answer
//! holding the tenant's own servers and aggregates. Real store, gate,
//! catalog and nats-server.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;
use testkit::chat::TEST_TENANT_KEY;
use testkit::report::complete;

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn ticket(h: &Harness, key: &str) -> String {
    let response = reqwest::Client::new()
        .post(h.url("/api/v1/events/ticket"))
        .header("authorization", bearer(key))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["ticket"].as_str().unwrap().to_owned()
}

/// An open event stream, read one server-sent event at a time.
struct Stream {
    response: reqwest::Response,
    buffer: String,
}

impl Stream {
    async fn open(h: &Harness, ticket: &str) -> Self {
        let response = reqwest::Client::new()
            .get(h.url(&format!("/api/v1/events?ticket={ticket}")))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut stream = Self {
            response,
            buffer: String::new(),
        };
        let (name, _) = stream.next().await;
        assert_eq!(name, "ready", "the stream says it is live first");
        stream
    }

    /// The next event (keep-alive comments skipped), bounded.
    async fn next(&mut self) -> (String, Value) {
        tokio::time::timeout(TIMEOUT, async {
            loop {
                if let Some(end) = self.buffer.find("\n\n") {
                    let block: String = self.buffer.drain(..end + 2).collect();
                    let mut name = String::new();
                    let mut data = String::new();
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("event:") {
                            name = v.trim().to_owned();
                        } else if let Some(v) = line.strip_prefix("data:") {
                            data.push_str(v.trim_start());
                        }
                    }
                    if name.is_empty() {
                        continue;
                    }
                    return (name, serde_json::from_str(&data).unwrap());
                }
                let chunk = self.response.chunk().await.unwrap().expect("stream open");
                self.buffer.push_str(&String::from_utf8_lossy(&chunk));
            }
        })
        .await
        .expect("an event within the deadline")
    }
}

#[tokio::test]
async fn the_page_is_served_and_its_apis_refuse_callers_without_a_key_or_ticket() {
    let h = Harness::spawn().await;
    let http = reqwest::Client::new();

    // The page holds no data: it is served to anyone, and loads nothing from elsewhere.
    let page = http.get(h.url("/ui/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("default-src 'self'"), "{csp}");
    let html = page.text().await.unwrap();
    assert!(
        html.contains("Tenant key") && !html.contains("http"),
        "{html}"
    );
    for asset in ["/ui/app.js", "/ui/style.css"] {
        let body = http
            .get(h.url(asset))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            !body.contains("https://"),
            "{asset} loads nothing from elsewhere"
        );
    }

    for (method, path) in [
        (reqwest::Method::GET, "/api/v1/agents"),
        (reqwest::Method::GET, "/api/v1/catalog"),
        (reqwest::Method::POST, "/api/v1/events/ticket"),
    ] {
        let response = http.request(method, h.url(path)).send().await.unwrap();
        assert_eq!(response.status(), 401, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
    }
    let key = testkit::store::new_tenant_key();
    let response = http
        .get(h.url("/api/v1/agents"))
        .header("authorization", bearer(&key))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401, "a key nobody issued");

    // A query that does not parse: without a key still 401 (nothing is told
    // before the caller is known), with one a 400 in the one JSON convention.
    let bad_limit = http
        .get(h.url("/api/v1/agents?limit=many"))
        .send()
        .await
        .unwrap();
    assert_eq!(bad_limit.status(), 401);
    for path in [
        "/api/v1/agents?limit=many",
        "/api/v1/catalog?window_seconds=-1",
    ] {
        let response = http
            .get(h.url(path))
            .header("authorization", bearer(TEST_TENANT_KEY))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid", "{path}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("invalid query string: "),
            "{path}: {body}"
        );
    }

    // A stream needs a ticket, and a ticket opens one stream.
    for query in ["", "?ticket=", "?ticket=cxt_guess"] {
        let response = http
            .get(h.url(&format!("/api/v1/events{query}")))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 401, "{query}");
    }
    let once = ticket(&h, TEST_TENANT_KEY).await;
    let _stream = Stream::open(&h, &once).await;
    let again = http
        .get(h.url(&format!("/api/v1/events?ticket={once}")))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 401, "a ticket is single-use");
}

#[tokio::test]
async fn a_tenant_lists_and_follows_only_its_own_agents() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t", "u"])]))
        .await;
    let (other_key, _) = h.api.create_tenant_key("globex").await;
    let other_api = h.api.clone().in_tenant("globex");
    let other_agent = other_api.register("b", "b").await;

    let list = |key: String| {
        let url = h.url("/api/v1/agents");
        async move {
            let response = reqwest::Client::new()
                .get(url)
                .header("authorization", bearer(&key))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    };
    let mine = list(TEST_TENANT_KEY.to_owned()).await;
    let agents = mine["agents"].as_array().unwrap();
    assert_eq!(agents.len(), 1, "{mine}");
    assert_eq!(agents[0]["agent_id"], agent.as_str());
    assert_eq!(agents[0]["phase"], "PHASE_COMPLETE");
    assert_eq!(agents[0]["freshness"], "FRESHNESS_CURRENT");
    assert_eq!(agents[0]["counts"]["servers_ok"], 1);
    assert_eq!(agents[0]["counts"]["tools"], 2);
    let theirs = list(other_key.clone()).await;
    let ids: Vec<&str> = theirs["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["agent_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [other_agent.as_str()], "{theirs}");
    assert_eq!(theirs["agents"][0]["freshness"], "FRESHNESS_NO_REPORT");
    let url = h.url("/api/v1/agents?q=no-such-agent");
    let none: Value = reqwest::Client::new()
        .get(url)
        .header("authorization", bearer(TEST_TENANT_KEY))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(none["agents"], serde_json::json!([]), "search: {none}");

    // Both tenants follow; a commit of tenant A's agent reaches A's stream
    // with its line and projection, and B's stream sees only B's agent.
    let mut stream_a = Stream::open(&h, &ticket(&h, TEST_TENANT_KEY).await).await;
    let mut stream_b = Stream::open(&h, &ticket(&h, &other_key).await).await;
    h.startup(&agent, RUN_B).await;
    let (name, event) = stream_a.next().await;
    assert_eq!(name, "agent");
    assert_eq!(event["agent_id"], agent.as_str(), "{event}");
    assert_eq!(event["summary"]["freshness"], "FRESHNESS_STALE", "{event}");
    assert_eq!(
        event["projection"]["counts"]["tools_withheld"], 2,
        "{event}"
    );
    assert!(event["committed_at"].is_string(), "{event}");
    h.push_ok(&agent, complete(RUN_B, 1, vec![server("ws", &["t"])]))
        .await;
    let (_, event) = stream_a.next().await;
    assert_eq!(
        event["summary"]["freshness"], "FRESHNESS_CURRENT",
        "{event}"
    );
    assert_eq!(event["projection"]["counts"]["tools"], 1, "{event}");

    other_api.startup(&other_agent, RUN_A).await;
    let (name, event) = tokio::time::timeout(Duration::from_secs(10), stream_b.next())
        .await
        .unwrap();
    assert_eq!(name, "agent");
    assert_eq!(
        event["agent_id"],
        other_agent.as_str(),
        "tenant B's stream carries nothing of tenant A's before its own: {event}"
    );

    // A shutdown ends the open streams instead of waiting for them.
    let mut h = h;
    h.gate_shutdown.cancel();
    let gate = h.gate.take().unwrap();
    tokio::time::timeout(TIMEOUT, gate.join())
        .await
        .expect("the gate stops with streams open");
    tokio::time::timeout(TIMEOUT, async {
        while let Ok(Some(_)) = stream_a.response.chunk().await {}
    })
    .await
    .expect("the stream ends");
}

#[tokio::test]
async fn the_catalog_view_lists_the_tenants_servers_with_warmup_state_and_its_gate_waits() {
    let h = Harness::spawn_with(with_catalog).await;
    let fixture = mcp_fixture::fixture_binary();
    let stdio =
        |args: &[&str]| serde_json::json!({ "stdio": { "command": fixture, "args": args } });
    let yaml = serde_json::json!({
        "tenants": [
            { "id": "acme", "servers": [
                { "id": "notes", "transport": stdio(&["--mode", "normal"]) },
                { "id": "broken", "transport": stdio(&["--mode", "crash"]) },
            ]},
            { "id": "globex", "servers": [
                { "id": "ledger", "transport": stdio(&["--mode", "normal"]) },
            ]},
        ]
    });
    let (catalog, _stop) = h
        .start_catalog_with(yaml, |settings| {
            settings.warmup.enabled = true;
            settings.warmup.attempts = 1;
        })
        .await;
    let mut warmup = catalog.warmup();
    tokio::time::timeout(Duration::from_secs(60), warmup.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes in time")
        .expect("warm-up status open");
    let (other_key, _) = h.api.create_tenant_key("globex").await;

    // A first turn of acme: one preparation and one gate wait.
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    h.turn("chat-1", &agent, true).await;

    let status = |key: String| {
        let url = h.url("/api/v1/catalog");
        async move {
            let response = reqwest::Client::new()
                .get(url)
                .header("authorization", bearer(&key))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    };
    // The catalog stores the gate's wait as it arrives: wait for it, bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mine = loop {
        let mine = status(TEST_TENANT_KEY.to_owned()).await;
        if mine["gate_waits"].as_array().is_some_and(|w| !w.is_empty()) {
            break mine;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gate wait is counted: {mine}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let servers: Vec<(&str, &str)> = mine["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["server_id"].as_str().unwrap(),
                s["warmup"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        servers,
        [
            ("notes", "WARMUP_DISCOVERED"),
            ("broken", "WARMUP_ABANDONED")
        ],
        "{mine}"
    );
    assert_eq!(mine["servers"][0]["remembered"], true, "{mine}");
    assert_eq!(mine["servers"][0]["tool_count"], 2, "{mine}");
    assert_eq!(mine["gate_waits"][0]["wait"]["count"], "1", "{mine}");
    let setups: u64 = mine["setup"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            b["setup"]["count"]
                .as_str()
                .map_or(0, |n| n.parse().unwrap())
        })
        .sum();
    assert_eq!(setups, 1, "one first preparation: {mine}");

    // Another tenant's key sees its own server and none of acme's waits.
    let theirs = status(other_key).await;
    let servers: Vec<&str> = theirs["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["server_id"].as_str().unwrap())
        .collect();
    assert_eq!(servers, ["ledger"], "{theirs}");
    assert!(
        theirs["gate_waits"].as_array().is_none_or(|w| w.is_empty()),
        "{theirs}"
    );
}

/// A ticket request's or a stream's answer, whatever its status.
async fn try_ticket(h: &Harness, key: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(h.url("/api/v1/events/ticket"))
        .header("authorization", bearer(key))
        .send()
        .await
        .unwrap()
}

async fn try_stream(h: &Harness, ticket: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(h.url(&format!("/api/v1/events?ticket={ticket}")))
        .send()
        .await
        .unwrap()
}

/// A 429's body names the bound that refused, by its setting.
async fn assert_too_many(response: reqwest::Response, limit: &str) {
    assert_eq!(response.status(), 429);
    assert_eq!(
        response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many", "{body}");
    assert_eq!(body["error"]["limit"], limit, "{body}");
}

/// The value of one series of the gate's `/metrics`.
async fn metric(h: &Harness, series: &str) -> f64 {
    let text = reqwest::get(h.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in /metrics"))
}

#[tokio::test]
async fn event_streams_are_bounded_per_key_and_per_tenant_without_starving_another_tenant() {
    let h = Harness::spawn_with(|c| {
        c.max_streams_per_key = 2;
        c.max_streams_per_tenant = 3;
    })
    .await;
    let (second_key, second_id) = h.api.create_tenant_key(testkit::chat::TEST_TENANT).await;
    let (third_key, _) = h.api.create_tenant_key(testkit::chat::TEST_TENANT).await;
    let (other_key, _) = h.api.create_tenant_key("globex").await;
    let other_api = h.api.clone().in_tenant("globex");
    let other_agent = other_api.register("b", "b").await;

    let _first = Stream::open(&h, &ticket(&h, TEST_TENANT_KEY).await).await;
    let _second = Stream::open(&h, &ticket(&h, TEST_TENANT_KEY).await).await;
    let refused = try_stream(&h, &ticket(&h, TEST_TENANT_KEY).await).await;
    assert_too_many(refused, "CTXSYNC_GATE_MAX_STREAMS_PER_KEY").await;
    // The tenant's other key has its own streams, up to the tenant's bound.
    let mut of_second_key = Stream::open(&h, &ticket(&h, &second_key).await).await;
    let refused = try_stream(&h, &ticket(&h, &third_key).await).await;
    assert_too_many(refused, "CTXSYNC_GATE_MAX_STREAMS_PER_TENANT").await;
    assert_eq!(
        metric(
            &h,
            r#"ctxsync_gate_page_refused_total{reason="streams_per_key"}"#
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &h,
            r#"ctxsync_gate_page_refused_total{reason="streams_per_tenant"}"#
        )
        .await,
        1.0
    );

    // Another tenant is untouched: its stream opens and carries its agent,
    // and its first turn over HTTP is answered.
    let mut theirs = Stream::open(&h, &ticket(&h, &other_key).await).await;
    other_api.startup(&other_agent, RUN_A).await;
    let (name, event) = theirs.next().await;
    assert_eq!(name, "agent");
    assert_eq!(event["agent_id"], other_agent.as_str(), "{event}");
    let answer = reqwest::Client::new()
        .post(h.url("/api/v1/gate"))
        .header("authorization", bearer(&other_key))
        .json(&serde_json::json!({"chat_id": "c1", "agent_id": other_agent, "first_turn": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);

    // A stream that ends gives its place back: the second key's, ended by
    // its revocation, makes room for the third key.
    h.api.revoke_tenant_key(&second_id).await;
    tokio::time::timeout(TIMEOUT, async {
        while let Ok(Some(_)) = of_second_key.response.chunk().await {}
    })
    .await
    .expect("the revoked key's stream ends");
    let h = &h;
    until("the third key's stream opens".into(), || {
        let third_key = third_key.clone();
        async move { try_stream(h, &ticket(h, &third_key).await).await.status() == 200 }
    })
    .await;
}

#[tokio::test]
async fn tickets_are_bounded_per_tenant_and_never_evict_another_tenants() {
    let h = Harness::spawn_with(|c| c.max_tickets_per_tenant = 3).await;
    let (other_key, _) = h.api.create_tenant_key("globex").await;
    let theirs = ticket(&h, &other_key).await;
    let mine = [
        ticket(&h, TEST_TENANT_KEY).await,
        ticket(&h, TEST_TENANT_KEY).await,
        ticket(&h, TEST_TENANT_KEY).await,
    ];
    assert_too_many(
        try_ticket(&h, TEST_TENANT_KEY).await,
        "CTXSYNC_GATE_MAX_TICKETS_PER_TENANT",
    )
    .await;
    assert_eq!(
        metric(
            &h,
            r#"ctxsync_gate_page_refused_total{reason="tickets_per_tenant"}"#
        )
        .await,
        1.0
    );
    // The other tenant's ticket survived the first tenant's burst and still
    // opens its stream; it may take more of its own.
    Stream::open(&h, &theirs).await;
    ticket(&h, &other_key).await;
    // A redeemed ticket frees its place.
    Stream::open(&h, &mine[0]).await;
    ticket(&h, TEST_TENANT_KEY).await;
}

#[tokio::test]
async fn a_revoked_key_stops_streaming_within_a_second_and_its_tickets_open_nothing() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    let (key, key_id) = h.api.create_tenant_key(testkit::chat::TEST_TENANT).await;
    let (other_key, _) = h.api.create_tenant_key("globex").await;
    let unredeemed = ticket(&h, &key).await;
    let mut stream = Stream::open(&h, &ticket(&h, &key).await).await;
    let mut unaffected = Stream::open(&h, &ticket(&h, TEST_TENANT_KEY).await).await;
    let mut other_tenant = Stream::open(&h, &ticket(&h, &other_key).await).await;

    h.api.revoke_tenant_key(&key_id).await;
    let revoked_at = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(1), async {
        while let Ok(Some(_)) = stream.response.chunk().await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the revoked key's stream is still open {:?} after the revocation",
        revoked_at.elapsed()
    );
    // A ticket taken before the revocation opens nothing after it.
    let response = try_stream(&h, &unredeemed).await;
    assert_eq!(response.status(), 401);
    assert_eq!(try_ticket(&h, &key).await.status(), 401);

    // Streams of the tenant's other key and of another tenant go on.
    h.startup(&agent, RUN_B).await;
    let (name, event) = unaffected.next().await;
    assert_eq!(
        (name.as_str(), &event["agent_id"]),
        ("agent", &Value::from(agent.as_str()))
    );
    let other_api = h.api.clone().in_tenant("globex");
    let other_agent = other_api.register("b", "b").await;
    other_api.startup(&other_agent, RUN_A).await;
    let (_, event) = other_tenant.next().await;
    assert_eq!(event["agent_id"], other_agent.as_str(), "{event}");
}
