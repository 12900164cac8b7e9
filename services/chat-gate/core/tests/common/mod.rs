//! The gate's core on a store kept in memory, for its tests: agents'
//! states committed the way snapshot-store commits them (each commit a new
//! revision, handed to the core as the store's event would be, with its
//! state).
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ctxsync_proto::v1::*;
use futures::FutureExt;
use futures::future::BoxFuture;
use gate_core::{EventUpdate, Gate, GateSettings, ReadError, StateSource};
use testkit::report::server_with_schema;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub const TENANT: &str = testkit::chat::TEST_TENANT;
pub const RUN_A: &str = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";
pub const RUN_B: &str = "5e4d3c2b-1a4b-4f9d-a1c7-e1d7c2f7b0aa";
pub const Q_SCHEMA: &str = r#"{"type":"object","properties":{"q":{"type":"string"}}}"#;

pub fn server(name: &str, tools: &[&str]) -> ContextResource {
    server_with_schema(name, tools, Q_SCHEMA)
}

// ---- the store, in memory ----------------------------------------------------

/// Agents' committed states, as snapshot-store keeps them.
#[derive(Default)]
pub struct Memory {
    pub states: Mutex<HashMap<String, AgentState>>,
    /// Set: every read fails as a store that does not answer.
    pub unavailable: Mutex<Option<String>>,
    pub reads: AtomicU64,
    pub gaps: Option<watch::Sender<u64>>,
}

impl StateSource for Memory {
    fn read<'a>(&'a self, agent_id: &'a str) -> BoxFuture<'a, Result<AgentState, ReadError>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let result = match self.unavailable.lock().unwrap().clone() {
            Some(reason) => Err(ReadError::Unavailable(reason)),
            None => self
                .states
                .lock()
                .unwrap()
                .get(agent_id)
                .cloned()
                .ok_or_else(|| ReadError::NotFound(format!("agent {agent_id} not found"))),
        };
        async move { result }.boxed()
    }

    fn gaps(&self) -> watch::Receiver<u64> {
        self.gaps.as_ref().expect("gaps").subscribe()
    }
}

/// A gate on [`Memory`], with the waits of the NATS harness: long enough
/// that only an event ends them.
pub struct Core {
    pub gate: Gate,
    pub memory: Arc<Memory>,
    pub _stop: tokio_util::sync::DropGuard,
}

impl Core {
    pub fn new() -> Self {
        Self::with(|_| {})
    }

    pub fn with(configure: impl FnOnce(&mut GateSettings)) -> Self {
        // The service's defaults but longer waits: the core's tests state
        // their settings (the core cannot name chat-gate's flags).
        let mut settings = GateSettings {
            pending_timeout: Duration::from_secs(20),
            stale_grace: Duration::from_secs(20),
            store_timeout: Duration::from_secs(2),
            attempt_ttl: Duration::from_secs(600),
            views: gate_core::ViewLimits {
                max_views: 10_000,
                idle_ttl: Duration::from_secs(600),
            },
            drain: gate_core::drain_window(Duration::from_secs(10)),
        };
        configure(&mut settings);
        let memory = Arc::new(Memory {
            gaps: Some(watch::channel(0).0),
            ..Memory::default()
        });
        let gate = Gate::new(settings, memory.clone(), CancellationToken::new());
        let stop = CancellationToken::new();
        // The expiry of remembered attempts, as the service runs it (no sweep).
        gate.spawn_housekeeping(Duration::ZERO, stop.clone());
        Self {
            gate,
            memory,
            _stop: stop.drop_guard(),
        }
    }

    /// Commits a change of an agent's state and hands its event to the gate.
    pub fn commit(&self, agent_id: &str, change: impl FnOnce(&mut AgentState)) {
        let state = {
            let mut states = self.memory.states.lock().unwrap();
            let state = states.entry(agent_id.to_owned()).or_default();
            change(state);
            state.revision += 1;
            state.clone()
        };
        self.gate.apply_event(
            agent_id,
            EventUpdate::new(state.revision, Some(state), None),
        );
    }

    /// A new agent of the test tenant, with no run and no snapshot.
    pub fn register(&self) -> String {
        let agent_id = uuid::Uuid::new_v4().to_string();
        self.commit(&agent_id, |state| {
            state.agent = Some(Agent {
                agent_id: agent_id.clone(),
                tenant: TENANT.into(),
                ..Default::default()
            });
        });
        agent_id
    }

    /// The agent's process (re)started: the row's run id changes, the snapshot stays.
    pub fn startup(&self, agent_id: &str, run_id: &str) {
        self.commit(agent_id, |state| {
            state.agent.as_mut().expect("registered").agent_run_id = run_id.into();
        });
    }

    /// An accepted push: it replaces the snapshot and its resources.
    pub fn push(&self, agent_id: &str, push: PushContextStateRequest) {
        self.commit(agent_id, |state| {
            state.snapshot = Some(Snapshot {
                agent_run_id: push.agent_run_id,
                version: push.version,
                phase: push.mcp_discovery.map(|d| d.phase).unwrap_or_default(),
                hash: format!("hash-{}", push.version),
                context_config: push.context_config,
                ..Default::default()
            });
            state.resources = push.resources;
        });
    }

    pub fn agent_reporting(&self, first: PushContextStateRequest) -> String {
        let agent_id = self.register();
        self.startup(&agent_id, &first.agent_run_id);
        self.push(&agent_id, first);
        agent_id
    }

    pub fn request(chat_id: &str, agent_id: &str, first_turn: bool) -> TurnRequest {
        TurnRequest {
            chat_id: chat_id.into(),
            agent_id: agent_id.into(),
            first_turn,
            tenant: TENANT.into(),
        }
    }

    /// A turn as the NATS turn server hands it over: after every event
    /// committed so far was applied.
    pub async fn turn(&self, chat_id: &str, agent_id: &str, first_turn: bool) -> TurnReply {
        let request = Self::request(chat_id, agent_id, first_turn);
        self.gate.turn_after_events(request).await.reply
    }

    pub fn spawn_turn(&self, chat_id: &str, agent_id: &str) -> tokio::task::JoinHandle<TurnReply> {
        let (gate, request) = (self.gate.clone(), Self::request(chat_id, agent_id, true));
        tokio::spawn(async move { gate.turn_after_events(request).await.reply })
    }

    /// A turn of a caller outside the gate's connection (HTTP, in process): it reads.
    pub fn spawn_turn_in_process(
        &self,
        chat_id: &str,
        agent_id: &str,
    ) -> tokio::task::JoinHandle<TurnReply> {
        let (gate, request) = (self.gate.clone(), Self::request(chat_id, agent_id, true));
        tokio::spawn(async move { gate.turn(request).await })
    }

    pub fn reads(&self) -> u64 {
        self.memory.reads.load(Ordering::SeqCst)
    }

    pub async fn until_waiting(&self, n: usize) {
        let gate = self.gate.clone();
        until("waits in progress", move || gate.waiters_held() == n).await;
    }
}

/// Lets the other tasks run (no time passes) until `condition` holds.
pub async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if condition() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never happened: {what}");
}

/// Lets time pass, in steps, until `condition` holds, within `limit`.
pub async fn until_within(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub async fn answer(turn: tokio::task::JoinHandle<TurnReply>) -> TurnReply {
    tokio::time::timeout(Duration::from_secs(30), turn)
        .await
        .expect("the turn answers in time")
        .expect("the turn task does not panic")
}

pub fn decision(reply: &TurnReply) -> GateDecision {
    assert_eq!(reply.error, None, "the turn was refused");
    reply.decision()
}

pub fn projection_of(reply: &TurnReply) -> &ChatProjection {
    reply.projection.as_ref().expect("projection")
}

pub fn tool_names(reply: &TurnReply) -> Vec<String> {
    tools(projection_of(reply))
}

pub fn tools(projection: &ChatProjection) -> Vec<String> {
    projection
        .servers
        .iter()
        .flat_map(|s| s.tools.iter().map(|t| t.name.clone()))
        .collect()
}
