//! chat-gate against a real nats-server, a real Postgres and a real snapshot-store:
//! what needs them (event ordering, gaps, the APIs). The decisions, attempts and
//! projections themselves are checked against the core in `core.rs`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;
use ctxsync_runtime::store::StoreClient;
use futures::StreamExt;
use prost::Message;

fn decision(reply: &TurnReply) -> GateDecision {
    assert_eq!(reply.error, None, "the turn was refused");
    reply.decision()
}

// ---- woken by the store's events, failing open (decisions: tests/core.rs) --

#[tokio::test]
async fn pending_then_complete_wakes_the_waiter_within_100ms_of_the_commit() {
    // The safety sweep runs every 10 minutes: only the event can end this wait.
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(pending(RUN_A, 1, vec![server("fs", &["read"])]))
        .await;
    let mut events = testkit::subscribe(&h.client, h.subjects.discovery_changed(&agent)).await;

    let turn = h.spawn_turn("chat-1", &agent);
    h.until_waiting(1).await;
    h.push_ok(
        &agent,
        complete(RUN_A, 2, vec![server("fs", &["read", "write"])]),
    )
    .await;
    let event = tokio::time::timeout(TIMEOUT, events.next())
        .await
        .expect("event")
        .expect("subscription open");
    let event = DiscoveryChanged::decode(event.payload).unwrap();
    assert_eq!(event.phase(), Phase::Complete);

    let (reply, answered_at) = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    let latency = millis_since(committed_at(&event), answered_at);
    println!("wake latency commit -> answer: {latency:.2} ms");
    assert!(latency < 100.0, "answered {latency:.1} ms after the commit");
    assert_eq!(tool_names(&reply), ["fs__read", "fs__write"]);

    let metrics = h
        .http
        .get(h.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "ctxsync_gate_wake_seconds",
        "ctxsync_gate_event_work_seconds",
        "ctxsync_gate_answer_work_seconds",
        "ctxsync_gate_waits_total",
        "ctxsync_gate_waiters",
        "ctxsync_gate_turns_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
}

#[tokio::test]
async fn store_unavailable_fails_open_and_says_why() {
    let mut h = Harness::spawn().await;
    let agent = h.agent_reporting(pending(RUN_A, 1, vec![])).await;
    h.stop_store().await;

    let started = Instant::now();
    let reply = h.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&reply), GateDecision::StoreUnavailable);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "bounded by the store timeout"
    );
    let p = projection(&reply);
    assert!(
        p.store_error.contains("no service answers"),
        "{}",
        p.store_error
    );
    assert!(p.summary.contains("could not be read"), "{}", p.summary);
    assert_eq!(h.gate().waiters_held(), 0);

    let reply = h.turn("chat-1", &agent, false).await;
    assert_eq!(decision(&reply), GateDecision::StoreUnavailable);
    let response = h
        .http
        .get(h.url(&format!("/api/v1/agents/{agent}/context")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
}

#[tokio::test]
async fn a_store_read_lost_on_the_way_is_asked_again_within_the_store_timeout() {
    let mut h = Harness::spawn().await;
    h.stop_store().await;
    // A store that loses the first request (as a connection closing under
    // it would) and answers the next: the agent is not there.
    let mut requests = h
        .client
        .subscribe(h.subjects.store_get_agent_state())
        .await
        .unwrap();
    h.client.flush().await.unwrap();
    let client = h.client.clone();
    let store = tokio::spawn(async move {
        let mut seen = 0;
        while let Some(request) = requests.next().await {
            seen += 1;
            if seen == 1 {
                continue;
            }
            let reply = GetAgentStateReply {
                state: None,
                error: Some(ServiceError {
                    code: service_error::Code::NotFound as i32,
                    message: "no such agent".into(),
                    ..Default::default()
                }),
            };
            client
                .publish(request.reply.unwrap(), reply.encode_to_vec().into())
                .await
                .unwrap();
            return seen;
        }
        seen
    });

    let started = Instant::now();
    let reply = h
        .turn("chat-lost", "0b7c2f5e-8d1a-4c3e-9f2a-6b5d4e3c2a10", true)
        .await;
    let elapsed = started.elapsed();
    assert_eq!(
        reply.error.as_ref().map(|e| e.code()),
        Some(service_error::Code::NotFound),
        "the second attempt's answer is the turn's: {reply:?}"
    );
    assert!(
        elapsed < Duration::from_secs(2),
        "within the store timeout (2 s), both attempts: {elapsed:?}"
    );
    assert_eq!(store.await.unwrap(), 2, "asked twice");
}

// ---- views kept by events --------------------------------------------------

#[tokio::test]
async fn a_fresh_view_answers_new_chats_without_a_store_read() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("s", &["t"])]))
        .await;
    let reads = h.count_store_reads().await;
    let first = h.turn("chat-1", &agent, true).await;
    assert_eq!(decision(&first), GateDecision::Ready);
    ctxsync_runtime::nats::sync_with_server(&h.client)
        .await
        .unwrap();
    assert_eq!(reads.get(), 1, "the first turn on the agent reads");

    for chat in 2..=5 {
        let reply = h.turn(&format!("chat-{chat}"), &agent, true).await;
        assert_eq!(decision(&reply), GateDecision::Ready);
        assert_eq!(tool_names(&reply), ["s__t"]);
        let later = h.turn(&format!("chat-{chat}"), &agent, false).await;
        assert_eq!(decision(&later), GateDecision::NotFirstTurn);
    }
    ctxsync_runtime::nats::sync_with_server(&h.client)
        .await
        .unwrap();
    assert_eq!(reads.get(), 1, "later turns are answered from the view");
    assert_eq!(h.gate().watches().len(), 1);
    assert_eq!(h.gate().watches().held(), 0, "the view stays, idle");
}

/// A gate with a view of an agent offering `tool`, warmed by one first turn.
async fn warm_view_of_an_agent_offering(tool: &str) -> (Harness, String) {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("s", &[tool])]))
        .await;
    assert_eq!(
        decision(&h.turn("warm", &agent, true).await),
        GateDecision::Ready
    );
    (h, agent)
}

/// The latency report's record of a first turn's wait is sent after the
/// turn's answer, on the answer's connection, so it never goes out first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_turns_wait_is_announced_right_after_its_answer() {
    // Warm: the turns below are answered from the view, with no store read
    // in between.
    let (h, agent) = warm_view_of_an_agent_offering("t").await;
    let watcher = ctxsync_runtime::nats::connect(&h.nats.url(), "watcher")
        .await
        .unwrap()
        .client;
    let mut seen = testkit::subscribe(&watcher, ">".to_owned()).await;
    let waits = h.subjects.gate_turn_waited();
    for chat in 0..20 {
        let inbox = h.client.new_inbox();
        let mut answers = testkit::subscribe(&h.client, inbox.clone()).await;
        let request = first_turn_request(&format!("chat-{chat}"), &agent);
        h.client
            .publish_with_reply(
                h.subjects.gate_turn(testkit::chat::TEST_TENANT),
                inbox.clone(),
                request.encode_to_vec().into(),
            )
            .await
            .unwrap();
        let answer = tokio::time::timeout(TIMEOUT, answers.next())
            .await
            .expect("answered")
            .unwrap();
        let reply = TurnReply::decode(answer.payload).unwrap();
        assert_eq!(decision(&reply), GateDecision::Ready);

        let mut answer_seen = false;
        let announced = loop {
            let message = tokio::time::timeout(TIMEOUT, seen.next())
                .await
                .expect("the wait is announced")
                .unwrap();
            if message.subject.as_str() == inbox {
                answer_seen = true;
            } else if message.subject.as_str() == waits {
                assert!(answer_seen, "chat-{chat}: announced before its answer");
                break GateTurnWaited::decode(message.payload).unwrap();
            }
        };
        assert_eq!(
            announced,
            GateTurnWaited {
                tenant: testkit::chat::TEST_TENANT.into(),
                outcome: GateDecision::Ready.label().into(),
                wait_ms: reply.waited_ms,
            }
        );
    }
}

/// A turn sent after a commit's reply is answered with that commit, every
/// time: the gate applies the events its connection delivered before the
/// turn ahead of the turn, and never reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_sent_after_a_commit_is_answered_with_it_without_a_read() {
    let (h, agent) = warm_view_of_an_agent_offering("t1").await;
    let reads = h.count_store_reads().await;
    for version in 2..=150u64 {
        let tool = format!("t{version}");
        h.push_ok(
            &agent,
            complete(RUN_A, version, vec![server("s", &[&tool])]),
        )
        .await;
        let reply = h.turn(&format!("chat-{version}"), &agent, true).await;
        assert_eq!(decision(&reply), GateDecision::Ready);
        assert_eq!(
            tool_names(&reply),
            [format!("s__{tool}")],
            "version {version}"
        );
    }
    ctxsync_runtime::nats::sync_with_server(&h.client)
        .await
        .unwrap();
    assert_eq!(reads.get(), 0);
}

#[tokio::test]
async fn an_event_without_its_state_makes_the_next_turn_read() {
    // The store leaves states over 1 byte out of its events.
    let h = Harness::spawn_with_store(|_| {}, |store| store.event_state_max_bytes = 1).await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("s", &["t1"])]))
        .await;
    assert_eq!(tool_names(&h.turn("chat-1", &agent, true).await), ["s__t1"]);

    let reads = h.count_store_reads().await;
    h.push_ok(&agent, complete(RUN_A, 2, vec![server("s", &["t2"])]))
        .await;
    let reply = h.turn("chat-2", &agent, true).await;
    assert_eq!(tool_names(&reply), ["s__t2"]);
    ctxsync_runtime::nats::sync_with_server(&h.client)
        .await
        .unwrap();
    assert_eq!(reads.get(), 1, "one read for the stateless event");
}

#[tokio::test]
async fn idle_views_expire_and_their_number_is_bounded() {
    let h = Harness::spawn_with(|c| {
        c.max_views = 4;
        c.view_ttl = Duration::from_millis(300);
    })
    .await;
    let mut agents = Vec::new();
    for i in 0..10 {
        let agent = h.register(&format!("a{i}")).await;
        h.startup(&agent, RUN_A).await;
        h.push_ok(&agent, complete(RUN_A, 1, vec![])).await;
        assert_eq!(
            decision(&h.turn("chat", &agent, true).await),
            GateDecision::Ready
        );
        assert!(h.gate().watches().len() <= 4, "at most 4 views");
        agents.push(agent);
    }
    // The newest agent's view survived the evictions.
    assert!(h.gate().watches().is_watched(&agents[9]));
    assert!(!h.gate().watches().is_watched(&agents[0]));
    let gate = h.gate().clone();
    until("idle views expire".into(), move || {
        let empty = gate.watches().is_empty();
        async move { empty }
    })
    .await;
}

// ---- unknown agents ----------------------------------------------------------

fn first_turn(chat_id: &str, agent_id: &str) -> TurnRequest {
    TurnRequest {
        chat_id: chat_id.into(),
        agent_id: agent_id.into(),
        first_turn: true,
        tenant: testkit::chat::TEST_TENANT.into(),
    }
}

fn is_not_found(reply: &TurnReply) -> bool {
    reply
        .error
        .as_ref()
        .is_some_and(|e| e.code() == service_error::Code::NotFound)
}

/// On this single-threaded runtime `join_all` registers every turn before
/// the watch's reader runs: they all share its one read.
#[tokio::test]
async fn concurrent_turns_for_an_unknown_agent_share_one_read_and_leave_no_view() {
    let h = Harness::spawn().await;
    let unknown = uuid::Uuid::new_v4().to_string();
    let gate = h.gate().clone();
    let reads_before = gate.store_reads();
    let replies = futures::future::join_all(
        (0..20).map(|i| gate.turn(first_turn(&format!("chat-{i}"), &unknown))),
    )
    .await;
    assert!(replies.iter().all(is_not_found), "{replies:?}");
    assert_eq!(gate.store_reads() - reads_before, 1, "one shared read");
    assert_eq!(gate.watches().len(), 0, "no view left behind");
    assert!(!gate.watches().is_watched(&unknown));
    assert_eq!(gate.waiters_held(), 0);
    assert_eq!(gate.attempts_held(), 0);

    // The context endpoint leaves nothing behind either.
    let r = h
        .http
        .get(h.url(&format!("/api/v1/agents/{unknown}/context")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(gate.watches().len(), 0);
}

#[tokio::test]
async fn an_agent_that_appears_right_after_a_not_found_answer_is_found_by_the_next_turn() {
    let h = Harness::spawn().await;
    let id = uuid::Uuid::new_v4();
    assert!(is_not_found(&h.turn("chat-1", &id.to_string(), true).await));
    assert!(!h.gate().watches().is_watched(&id.to_string()));

    // An agent comes to exist under that id (registered, then its row given the id).
    let registered = h.register("a").await;
    let pool = sqlx::PgPool::connect(h.db.url()).await.unwrap();
    let moved = sqlx::query("UPDATE snapshot.agents SET agent_id = $1 WHERE agent_id = $2")
        .bind(id)
        .bind(uuid::Uuid::parse_str(&registered).unwrap())
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(moved.rows_affected(), 1);
    let agent = id.to_string();
    h.startup(&agent, RUN_A).await;

    // Over NATS (a fresh view would answer without a read) and in process.
    let turn = h.spawn_turn("chat-1", &agent);
    h.until_waiting(1).await;
    assert_eq!(h.gate().watches().views(), 1, "a view now that it exists");
    h.push_ok(&agent, complete(RUN_A, 1, vec![server("s", &["t"])]))
        .await;
    let (reply, _) = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(tool_names(&reply), ["s__t"]);
    let reply = h.gate().turn(first_turn("chat-2", &agent)).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(h.gate().watches().len(), 1);
}

/// Lookups have their own bound: however many unknown ids are asked about,
/// at most `max_views` are looked up at once, and they never evict views.
#[tokio::test]
async fn lookups_of_unknown_agents_are_bounded_and_never_evict_views() {
    let h = Harness::spawn_with(|c| c.max_views = 4).await;
    let gate = h.gate().clone();
    let mut agents = Vec::new();
    for i in 0..3 {
        let agent = h.register(&format!("a{i}")).await;
        h.startup(&agent, RUN_A).await;
        h.push_ok(&agent, complete(RUN_A, 1, vec![])).await;
        assert_eq!(
            decision(&gate.turn(first_turn("chat", &agent)).await),
            GateDecision::Ready
        );
        agents.push(agent);
    }
    assert_eq!((gate.watches().views(), gate.watches().held()), (3, 0));

    let unknown: Vec<String> = (0..40).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    let mut all = Box::pin(futures::future::join_all(
        unknown.iter().map(|id| gate.turn(first_turn("chat", id))),
    ));
    // One poll registers every turn: four take a lookup slot, the rest wait.
    assert!(futures::poll!(&mut all).is_pending());
    assert_eq!(gate.watches().lookups(), 4);
    assert_eq!(gate.watches().len(), 3 + 4);
    let replies = all.await;
    assert!(replies.iter().all(is_not_found), "{replies:?}");

    assert_eq!(gate.watches().lookups(), 0);
    assert_eq!(gate.watches().len(), 3);
    for agent in &agents {
        assert!(gate.watches().is_watched(agent), "views stay");
    }
}

/// A gate behind a proxy the test can cut or slow, which has answered one
/// chat of an agent whose discovery offers `s__t1`.
async fn behind_proxy_with_an_agent_offering_t1() -> (Harness, String) {
    let h = Harness::spawn_behind_proxy(|_| {}).await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("s", &["t1"])]))
        .await;
    assert_eq!(tool_names(&h.turn("chat-1", &agent, true).await), ["s__t1"]);
    (h, agent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_is_not_trusted_across_a_nats_disconnect() {
    let (h, agent) = behind_proxy_with_an_agent_offering_t1().await;

    // The commit's event is lost while the gate is cut off.
    let proxy = h.proxy.as_ref().unwrap();
    proxy.cut();
    h.until_readyz(503, "the gate sees NATS gone").await;
    h.push_ok(&agent, complete(RUN_A, 2, vec![server("s", &["t2"])]))
        .await;
    proxy.restore();
    h.until_readyz(200, "the gate is back on NATS").await;
    let reply = h.turn("chat-2", &agent, true).await;
    assert_eq!(tool_names(&reply), ["s__t2"], "read again after the gap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_after_a_reconnect_means_the_server_has_the_gates_subscriptions_again() {
    let (h, agent) = behind_proxy_with_an_agent_offering_t1().await;

    // After the reconnect the gate's re-sent subscriptions reach the server
    // 500 ms after the client counts itself connected: a gate that says
    // ready in that window leaves this turn without a responder.
    let proxy = h.proxy.as_ref().unwrap();
    proxy.delay_to_server(Duration::from_millis(500));
    proxy.cut();
    proxy.restore();
    h.until_readyz(503, "the gate sees NATS gone").await;
    h.until_readyz(200, "the gate is back on NATS").await;
    let reply = h.turn("chat-2", &agent, true).await;
    assert_eq!(tool_names(&reply), ["s__t1"]);
}

// ---- the projection over HTTP ------------------------------------------------
// (what a projection holds is decided in the core: tests/core.rs)

async fn context(h: &Harness, agent: &str) -> serde_json::Value {
    let response = h
        .http
        .get(h.url(&format!("/api/v1/agents/{agent}/context")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn json_tools(context: &serde_json::Value) -> Vec<String> {
    context["servers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["tools"].as_array().unwrap().iter())
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn http_answers_are_the_proto_messages_in_json() {
    let h = Harness::spawn().await;
    let agent = h
        .agent_reporting(complete(
            RUN_A,
            1,
            vec![
                server("github", &["search"]),
                failed_server("broken", "spawn failed"),
            ],
        ))
        .await;
    let c = context(&h, &agent).await;
    assert_eq!(c["stale"], false);
    assert_eq!(c["phase"], "PHASE_COMPLETE");
    assert_eq!(c["snapshot_phase"], "PHASE_COMPLETE");
    assert_eq!(json_tools(&c), ["github__search"]);
    assert_eq!(c["counts"]["tools_withheld"], 0);

    let response = h
        .http
        .post(h.url("/api/v1/gate"))
        .json(&serde_json::json!({"chat_id": "chat-1", "agent_id": agent, "first_turn": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["decision"], "GATE_DECISION_READY");
    assert_eq!(body["projection"]["counts"]["servers_failed"], 1);
    // Every field is present, defaults included.
    assert_eq!(body["attempt_reused"], false);
    assert_eq!(body["projection"]["wait_timed_out"], false);
    assert_eq!(body["projection"]["counts"]["tools_withheld"], 0);
    let schema = body["projection"]["servers"][0]["tools"][0]["input_schema_json"]
        .as_str()
        .expect("the schema's JSON text");
    let schema: serde_json::Value = serde_json::from_str(schema).unwrap();
    assert_eq!(schema["type"], "object");
    assert_eq!(schema["properties"]["q"]["type"], "string");
    assert_eq!(
        body["projection"]["catalog"]["status"],
        "STATUS_NOT_REQUESTED"
    );
}

// ---- the API ----------------------------------------------------------------

#[tokio::test]
async fn http_api_refuses_bad_input_clearly_and_404s_unknown_agents() {
    let h = Harness::spawn().await;
    let agent = h.register("a").await;
    let post = |body: serde_json::Value| h.http.post(h.url("/api/v1/gate")).json(&body).send();

    let r = post(serde_json::json!({"chat_id": "c", "agent_id": "nope", "first_turn": true}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("agent_id must be a UUID")
    );

    let r = post(serde_json::json!({"chat_id": "", "agent_id": agent}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    let r = post(serde_json::json!({"chat_id": "x".repeat(300), "agent_id": agent}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("over the limit of 256")
    );

    // NUL cannot be stored (catalog sessions, gate-wait records): refused by name.
    for (field, body) in [
        (
            "chat_id",
            serde_json::json!({"chat_id": "c\u{0}", "agent_id": agent}),
        ),
        (
            // The body's tenant is only ever compared with the key's.
            "tenant differs from the tenant of your key",
            serde_json::json!({"chat_id": "c", "agent_id": agent, "tenant": "\u{0}t"}),
        ),
    ] {
        let r = post(body).await.unwrap();
        assert_eq!(r.status(), 400);
        let body: serde_json::Value = r.json().await.unwrap();
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{field} contains U+0000")) || message.starts_with(field),
            "{message}"
        );
    }

    let r = post(serde_json::json!({"chat_id": "c", "agent_id": agent, "extra": 1}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown field")
    );

    let r = h
        .http
        .post(h.url("/api/v1/gate"))
        .header("content-type", "text/plain")
        .body("hi")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);

    let unknown = "6f1c7a52-9d7e-4a49-8a53-0d6b7f1f2e3d";
    let r = post(serde_json::json!({"chat_id": "c", "agent_id": unknown, "first_turn": true}))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = h
        .http
        .get(h.url(&format!("/api/v1/agents/{unknown}/context")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = h
        .http
        .get(h.url("/api/v1/agents/not-a-uuid/context"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // Over NATS the same refusal is an error, not a decision.
    let reply = h.turn("c", unknown, true).await;
    assert_eq!(reply.error.unwrap().code(), service_error::Code::NotFound);
    assert_eq!(h.gate().waiters_held(), 0);

    let ready: serde_json::Value = h
        .http
        .get(h.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["checks"]["nats"], "ok");
}

// ---- NATS restarts ---------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restarted_while_chats_wait_every_waiter_answers() {
    let mut h = Harness::spawn_with(|c| {
        c.pending_timeout = Duration::from_secs(60);
        c.stale_grace = Duration::from_secs(60);
    })
    .await;
    const AGENTS: usize = 10;
    const CHATS: usize = 3;
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let agent = h.register(&format!("agent-{i}")).await;
        h.startup(&agent, RUN_A).await;
        h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
        agents.push(agent);
    }
    // The chats ask over HTTP, which the NATS restart does not touch.
    let mut turns = Vec::new();
    for (i, agent) in agents.iter().enumerate() {
        for chat in 0..CHATS {
            let http = h.http.clone();
            let url = h.url("/api/v1/gate");
            let body = serde_json::json!({"chat_id": format!("chat-{i}-{chat}"), "agent_id": agent, "first_turn": true});
            turns.push((
                i,
                tokio::spawn(async move {
                    let response = http.post(url).json(&body).send().await.unwrap();
                    assert_eq!(response.status(), 200);
                    response.json::<serde_json::Value>().await.unwrap()
                }),
            ));
        }
    }
    h.until_waiting(AGENTS * CHATS).await;

    h.nats.restart();

    // Once the gate is back on NATS, half the agents complete their run and
    // the other half restart and complete a new one.
    h.until_readyz(200, "the gate is back on NATS").await;
    for (i, agent) in agents.iter().enumerate() {
        let push = if i % 2 == 0 {
            complete(RUN_A, 2, vec![server("s", &["t"])])
        } else {
            complete(RUN_B, 1, vec![server("s", &["t"])])
        };
        let deadline = Instant::now() + TIMEOUT;
        loop {
            // The store may still be reconnecting: retry until it answers.
            let store = StoreClient::new(h.client.clone(), &h.subjects, Duration::from_secs(2));
            let result = async {
                if i % 2 == 1 {
                    let startup = StartupRequest {
                        agent_run_id: RUN_B.into(),
                        agent_version: "test".into(),
                        ..Default::default()
                    };
                    store.update_startup(agent, startup, None).await?;
                }
                store.push(agent, push.clone(), None).await
            }
            .await;
            match result {
                Ok(response) => {
                    assert!(response.accepted);
                    break;
                }
                Err(error) => {
                    assert!(Instant::now() < deadline, "store never came back: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    for (i, turn) in turns {
        let body = tokio::time::timeout(TIMEOUT, turn)
            .await
            .expect("every waiter answers")
            .unwrap();
        assert_eq!(body["decision"], "GATE_DECISION_READY", "{body}");
        let expected_run = if i % 2 == 0 { RUN_A } else { RUN_B };
        assert_eq!(body["projection"]["agent_run_id"], expected_run);
        assert_eq!(body["projection"]["servers"][0]["tools"][0]["name"], "s__t");
    }
    assert_eq!(h.gate().waiters_held(), 0);
    h.stop_store().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_lost_while_the_gate_was_disconnected_are_recovered_on_reconnect() {
    // Only the gate loses NATS: the store commits and publishes meanwhile, so
    // the completing event never reaches the gate. The sweep runs every 10
    // minutes and the wait lasts 60 s: only the re-check after the reconnect
    // can answer this turn in time.
    let h = Harness::spawn_behind_proxy(|c| {
        c.pending_timeout = Duration::from_secs(60);
    })
    .await;
    let agent = h.register("a").await;
    let mut events = testkit::subscribe(&h.client, h.subjects.snapshot_committed(&agent)).await;
    h.startup(&agent, RUN_A).await;
    h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
    // The pending push's events are out before the turn starts: no read
    // they cause can be in flight at the cut (a failed read is retried, which
    // would answer this turn without the re-check under test).
    tokio::time::timeout(TIMEOUT, events.next()).await.unwrap();
    let turn = h.spawn_turn("chat-1", &agent);
    h.until_waiting(1).await;
    let reads_before_cut = h.gate().store_reads();

    let proxy = h.proxy.as_ref().unwrap();
    proxy.cut();
    h.until_readyz(503, "the gate sees NATS gone").await;
    h.push_ok(&agent, complete(RUN_A, 2, vec![server("s", &["t"])]))
        .await;
    assert!(!turn.is_finished(), "the gate cannot have seen the commit");
    assert_eq!(h.gate().waiters_held(), 1);
    assert_eq!(
        h.gate().store_reads(),
        reads_before_cut,
        "no read during the cut"
    );

    proxy.restore();
    let started = Instant::now();
    let (reply, _) = answer(turn).await;
    assert_eq!(decision(&reply), GateDecision::Ready);
    assert_eq!(tool_names(&reply), ["s__t"]);
    assert!(started.elapsed() < Duration::from_secs(10));
}
