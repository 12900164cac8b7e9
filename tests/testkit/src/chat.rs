//! Chat backends asking chat-gate for a turn, over HTTP (`POST /api/v1/gate`
//! with a tenant key) and over NATS (`<prefix>.gate.turn.<tenant>`), answered
//! in one shape so a test can count decisions whichever way the chat came.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{GateDecision, TurnReply, TurnRequest, service_error::Code};
use ctxsync_runtime::rpc;
use serde_json::{Value, json};

/// Which API a chat used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Http,
    Nats,
}

/// What the gate answered one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A decision, as the HTTP API names it (`ready`, `timed_out_pending`,
    /// `shutting_down`, ...).
    Decision(String),
    /// The gate knows no agent with this id.
    NotFound,
    /// Refused otherwise (the code or status, and the message).
    Refused(String),
    /// No answer (timeout, transport error, undecodable).
    NoAnswer(String),
}

/// One turn's answer.
#[derive(Debug, Clone)]
pub struct ChatAnswer {
    pub via: Via,
    pub chat_id: String,
    pub agent_id: String,
    pub outcome: Outcome,
    /// The projection's run ids and offered tools (`server__tool`).
    pub agent_run_id: String,
    pub snapshot_agent_run_id: String,
    pub tools: Vec<String>,
    pub waited_ms: u64,
    /// When the answer arrived, and how long after the ask.
    pub answered_at: Instant,
    pub elapsed: Duration,
}

impl ChatAnswer {
    /// The decision's name, or `not_found`, `refused: ..`, `no answer: ..`.
    pub fn decision(&self) -> String {
        match &self.outcome {
            Outcome::Decision(name) => name.clone(),
            Outcome::NotFound => "not_found".into(),
            Outcome::Refused(why) => format!("refused: {why}"),
            Outcome::NoAnswer(why) => format!("no answer: {why}"),
        }
    }

    pub fn is(&self, decision: &str) -> bool {
        matches!(&self.outcome, Outcome::Decision(name) if name == decision)
    }

    fn new(via: Via, chat_id: &str, agent_id: &str, asked: Instant, outcome: Outcome) -> Self {
        Self {
            via,
            chat_id: chat_id.to_owned(),
            agent_id: agent_id.to_owned(),
            outcome,
            agent_run_id: String::new(),
            snapshot_agent_run_id: String::new(),
            tools: Vec::new(),
            waited_ms: 0,
            answered_at: Instant::now(),
            elapsed: asked.elapsed(),
        }
    }
}

/// The HTTP API's name of a decision (`GATE_DECISION_READY` → `ready`).
pub fn decision_name(reply: &TurnReply) -> String {
    reply.decision().label().to_owned()
}

/// The tenant of [`TEST_TENANT_KEY`], and of the agents `StoreClient` registers.
pub const TEST_TENANT: &str = "acme";

/// The tenant key [`http_turn`] presents. A test makes it valid in its own
/// database with `StoreClient::create_test_tenant_key` (each test has its own
/// database, so one well-known key is enough).
pub const TEST_TENANT_KEY: &str = "cxk_testkeyofthetenantacme000000000000000000000";

/// A first turn (or a later one) over HTTP with [`TEST_TENANT_KEY`]; waits at
/// most `timeout`.
pub async fn http_turn(
    http: &reqwest::Client,
    gate: SocketAddr,
    chat_id: &str,
    agent_id: &str,
    first_turn: bool,
    timeout: Duration,
) -> ChatAnswer {
    http_turn_as(
        http,
        gate,
        TEST_TENANT_KEY,
        chat_id,
        agent_id,
        first_turn,
        timeout,
    )
    .await
}

/// [`http_turn`] presenting `tenant_key`.
pub async fn http_turn_as(
    http: &reqwest::Client,
    gate: SocketAddr,
    tenant_key: &str,
    chat_id: &str,
    agent_id: &str,
    first_turn: bool,
    timeout: Duration,
) -> ChatAnswer {
    let asked = Instant::now();
    let sent = http
        .post(format!("http://{gate}/api/v1/gate"))
        .bearer_auth(tenant_key)
        .json(&json!({ "chat_id": chat_id, "agent_id": agent_id, "first_turn": first_turn }))
        .timeout(timeout)
        .send()
        .await;
    let answer = |outcome| ChatAnswer::new(Via::Http, chat_id, agent_id, asked, outcome);
    let response = match sent {
        Ok(response) => response,
        Err(error) => return answer(Outcome::NoAnswer(error.to_string())),
    };
    let status = response.status();
    let body: Value = match response.json().await {
        Ok(body) => body,
        Err(error) => return answer(Outcome::NoAnswer(format!("{status}: {error}"))),
    };
    if !status.is_success() {
        return answer(if body["error"]["code"] == "not_found" {
            Outcome::NotFound
        } else {
            Outcome::Refused(format!("{status}: {body}"))
        });
    }
    // The proto name (`GATE_DECISION_READY`), named here as over NATS (`ready`).
    let decision = body["decision"].as_str().unwrap_or("missing");
    let mut answered = answer(Outcome::Decision(
        GateDecision::from_str_name(decision)
            .map_or_else(|| format!("unknown {decision}"), |d| d.label().to_owned()),
    ));
    let projection = &body["projection"];
    answered.agent_run_id = projection["agent_run_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    answered.snapshot_agent_run_id = projection["snapshot_agent_run_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    answered.tools = projection["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|server| server["tools"].as_array().into_iter().flatten())
        .filter_map(|tool| tool["name"].as_str().map(str::to_owned))
        .collect();
    answered.waited_ms = body["waited_ms"].as_u64().unwrap_or_default();
    answered
}

/// A first turn (or a later one) over NATS as [`TEST_TENANT`]; waits at most `timeout`.
pub async fn nats_turn(
    client: &async_nats::Client,
    subjects: &Subjects,
    chat_id: &str,
    agent_id: &str,
    first_turn: bool,
    timeout: Duration,
) -> ChatAnswer {
    nats_turn_as(
        client,
        subjects,
        TEST_TENANT,
        chat_id,
        agent_id,
        first_turn,
        timeout,
    )
    .await
}

/// [`nats_turn`] on `tenant`'s subject.
pub async fn nats_turn_as(
    client: &async_nats::Client,
    subjects: &Subjects,
    tenant: &str,
    chat_id: &str,
    agent_id: &str,
    first_turn: bool,
    timeout: Duration,
) -> ChatAnswer {
    let asked = Instant::now();
    let request = TurnRequest {
        chat_id: chat_id.into(),
        agent_id: agent_id.into(),
        first_turn,
        tenant: String::new(),
    };
    let subject = subjects.gate_turn(tenant);
    let answer = |outcome| ChatAnswer::new(Via::Nats, chat_id, agent_id, asked, outcome);
    let reply: TurnReply = match rpc::request(client, subject, &request, None, timeout).await {
        Ok(reply) => reply,
        Err(error) => return answer(Outcome::NoAnswer(error.to_string())),
    };
    if let Some(error) = &reply.error {
        return answer(if error.code() == Code::NotFound {
            Outcome::NotFound
        } else {
            Outcome::Refused(format!("{}: {}", error.code().as_str_name(), error.message))
        });
    }
    let mut answered = answer(Outcome::Decision(decision_name(&reply)));
    if let Some(projection) = &reply.projection {
        answered.agent_run_id = projection.agent_run_id.clone();
        answered.snapshot_agent_run_id = projection.snapshot_agent_run_id.clone();
        answered.tools = projection
            .servers
            .iter()
            .flat_map(|server| server.tools.iter().map(|tool| tool.name.clone()))
            .collect();
    }
    answered.waited_ms = u64::from(reply.waited_ms);
    answered
}
