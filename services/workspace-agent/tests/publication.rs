//! Publication against the real agent-ingest and snapshot-store (real NATS,
//! real Postgres): Startup then pushes, phase transitions as committed, a hung
//! server, a store outage, a 401 and a dropped push.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, DiscoveryChanged, ResourceStatus, context_resource::Body, discovery_changed::Cause,
    mcp_discovery::Phase,
};
use ctxsync_runtime::Shutdown;
use futures::StreamExt;
use prost::Message;
use testkit::stack::{Stack, StackBuilder, Started, TestStack};
use testkit::store::StoreClient;
use testkit::{NatsServer, TestDatabase};
use tokio::sync::watch;
use workspace_agent::{AgentConfig, AgentToken, Backoff, PublishStatus, PublisherConfig, Running};

const RPC_TIMEOUT: Duration = Duration::from_secs(10);

struct Harness {
    nats: NatsServer,
    db: TestDatabase,
    prefix: String,
    subjects: Subjects,
    client: async_nats::Client,
    /// The store's NATS API. Requests are retried on "no responders" because
    /// these tests restart the store.
    store_api: StoreClient,
    store: Option<(Shutdown, snapshot_store::RunningStore)>,
    ingest_url: String,
    /// agent-ingest (in its own stack: the store comes and goes).
    _ingest: (Shutdown, Stack),
}

impl Harness {
    async fn spawn() -> Self {
        let TestStack { nats, db, prefix } = TestStack::private().await;
        let ingest_shutdown = Shutdown::new();
        let ingest = testkit::stack::start(
            StackBuilder::new(nats.url(), &prefix)
                .ingest(|config| config.store_timeout = Duration::from_secs(2)),
            &ingest_shutdown,
        )
        .await;
        let client = async_nats::connect(nats.url()).await.unwrap();
        let subjects = Subjects::new(&prefix).unwrap();
        let mut harness = Self {
            ingest_url: format!("http://{}", ingest.ingest().http_addr()),
            store_api: StoreClient::new(client.clone(), subjects.clone(), RPC_TIMEOUT, "ws")
                .retrying_no_responders(),
            subjects,
            nats,
            db,
            prefix,
            client,
            store: None,
            _ingest: (ingest_shutdown, ingest),
        };
        harness.start_store().await;
        harness
    }

    async fn start_store(&mut self) {
        let builder = StackBuilder::new(self.nats.url(), &self.prefix)
            .database(self.db.url())
            .store(|_| {});
        let Started { running, shutdown } = testkit::stack::start(builder, &Shutdown::new())
            .await
            .stores
            .remove(0);
        self.store = Some((shutdown, running));
    }

    async fn stop_store(&mut self) {
        let (shutdown, store) = self.store.take().expect("store running");
        shutdown.cancel();
        store.join().await;
    }

    /// Registers an agent with `token` under a fresh name; returns its id.
    async fn register(&self, token: &str) -> String {
        let name = format!("agent-{}", uuid::Uuid::new_v4().simple());
        self.store_api.register(&name, token).await
    }

    async fn state(&self, agent_id: &str) -> AgentState {
        self.store_api.state(agent_id).await
    }

    /// A workspace agent on `ws` publishing with `token`.
    async fn start_agent(
        &self,
        ws: &Workspace,
        token: &str,
        handshake_timeout: Duration,
    ) -> (Running, Shutdown) {
        let shutdown = Shutdown::new();
        let agent = workspace_agent::start(
            self.agent_config(ws, token, handshake_timeout),
            shutdown.clone(),
        )
        .await
        .unwrap();
        (agent, shutdown)
    }

    fn agent_config(
        &self,
        ws: &Workspace,
        token: &str,
        handshake_timeout: Duration,
    ) -> AgentConfig {
        let mut publisher = PublisherConfig::new(self.ingest_url.clone(), AgentToken::new(token));
        publisher.backoff = Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_millis(500),
        };
        publisher.request_timeout = Duration::from_secs(5);
        AgentConfig {
            discovery: ws.settings(handshake_timeout),
            publisher,
            watch: true,
            watch_debounce: Duration::from_millis(100),
            http_addr: Some(([127, 0, 0, 1], 0).into()),
            http_limits: Default::default(),
        }
    }
}

/// Every commit of one agent, as the store announces it.
struct Commits {
    snapshots: async_nats::Subscriber,
    discovery: async_nats::Subscriber,
}

impl Commits {
    async fn subscribe(h: &Harness, agent_id: &str) -> Self {
        Self {
            snapshots: testkit::subscribe(&h.client, h.subjects.snapshot_committed(agent_id)).await,
            discovery: testkit::subscribe(&h.client, h.subjects.discovery_changed(agent_id)).await,
        }
    }

    /// Reads the committed state until `accept` holds, woken by commit events.
    async fn wait_state(
        &mut self,
        h: &Harness,
        agent_id: &str,
        what: &str,
        accept: impl Fn(&AgentState) -> bool,
    ) -> AgentState {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let state = h.state(agent_id).await;
            if accept(&state) {
                return state;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.snapshots.next()).await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("event subscription ended"),
                Err(_) => panic!("timed out waiting for committed state: {what}; last: {state:#?}"),
            }
        }
    }

    /// DiscoveryChanged events received so far (without waiting).
    async fn discovery_events(&mut self) -> Vec<DiscoveryChanged> {
        let mut out = Vec::new();
        while let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_millis(200), self.discovery.next()).await
        {
            out.push(DiscoveryChanged::decode(message.payload.as_ref()).unwrap());
        }
        out
    }
}

fn phase(state: &AgentState) -> Option<Phase> {
    state
        .snapshot
        .as_ref()
        .map(|s| Phase::try_from(s.phase).unwrap())
}

fn committed_server<'a>(
    state: &'a AgentState,
    name: &str,
) -> Option<&'a ctxsync_proto::v1::ContextResource> {
    let source = format!("mcp_server:{name}");
    state.resources.iter().find(|r| r.source == source)
}

fn committed_ok(state: &AgentState, name: &str) -> bool {
    committed_server(state, name).is_some_and(|r| r.status == ResourceStatus::Ok as i32)
}

async fn stop_agent(agent: Running, shutdown: Shutdown) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), agent.join())
        .await
        .expect("agent stops in time");
}

/// Waits (bounded) until the publisher's last error mentions `needle`.
async fn wait_error(
    status: &mut watch::Receiver<PublishStatus>,
    needle: &str,
    what: &str,
) -> PublishStatus {
    tokio::time::timeout(
        DEADLINE,
        status.wait_for(|s| s.last_error.as_deref().is_some_and(|e| e.contains(needle))),
    )
    .await
    .expect(what)
    .unwrap()
    .clone()
}

fn token() -> String {
    format!("tok_{}", uuid::Uuid::new_v4().simple())
}

#[tokio::test]
async fn startup_then_pending_then_complete_committed_exactly_once() {
    let h = Harness::spawn().await;
    let token = token();
    let agent_id = h.register(&token).await;
    let mut commits = Commits::subscribe(&h, &agent_id).await;
    let ws = Workspace::new();
    std::fs::write(ws.work().join("AGENTS.md"), "be brief").unwrap();
    ws.write_servers(&[
        (
            "slow",
            fixture(&["--mode", "slow-start", "--delay-ms", "1500"]),
        ),
        ("fast", fixture(&["--mode", "normal"])),
    ]);
    let (agent, shutdown) = h.start_agent(&ws, &token, Duration::from_secs(20)).await;
    let run_id = agent.run_id().to_owned();
    assert!(uuid::Uuid::parse_str(&run_id).is_ok());

    let state = commits
        .wait_state(&h, &agent_id, "complete", |s| {
            phase(s) == Some(Phase::Complete)
        })
        .await;
    assert_eq!(
        state.agent.as_ref().unwrap().agent_run_id,
        run_id,
        "Startup carried the run id"
    );
    assert_eq!(state.snapshot.as_ref().unwrap().agent_run_id, run_id);
    assert!(committed_ok(&state, "slow") && committed_ok(&state, "fast"));
    let config = state
        .snapshot
        .as_ref()
        .unwrap()
        .context_config
        .as_ref()
        .unwrap();
    assert_eq!(config.working_dir, ws.work().display().to_string());
    let agents_md = format!("instruction_file:{}", ws.work().join("AGENTS.md").display());
    assert!(state.resources.iter().any(|r| r.source == agents_md));

    // The operator endpoints.
    let base = format!("http://{}", agent.http_addr().unwrap());
    let ready = reqwest::get(format!("{base}/readyz")).await.unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(
        reqwest::get(format!("{base}/healthz"))
            .await
            .unwrap()
            .status(),
        200
    );

    // A later reload (server added through the file watcher) commits, phase stays COMPLETE.
    ws.write_servers(&[
        (
            "slow",
            fixture(&["--mode", "slow-start", "--delay-ms", "1500"]),
        ),
        ("fast", fixture(&["--mode", "normal"])),
        ("late", fixture(&["--mode", "zero-tools"])),
    ]);
    let state = commits
        .wait_state(&h, &agent_id, "late server committed", |s| {
            committed_ok(s, "late")
        })
        .await;
    assert_eq!(phase(&state), Some(Phase::Complete));

    let events = commits.discovery_events().await;
    let causes: Vec<(Cause, Phase)> = events
        .iter()
        .map(|e| {
            (
                Cause::try_from(e.cause).unwrap(),
                Phase::try_from(e.phase).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        causes.first().map(|c| c.0),
        Some(Cause::Startup),
        "{causes:?}"
    );
    let push_phases: Vec<Phase> = causes
        .iter()
        .filter(|(cause, _)| *cause == Cause::Push)
        .map(|(_, phase)| *phase)
        .collect();
    assert_eq!(
        push_phases,
        [Phase::Pending, Phase::Complete],
        "{events:#?}"
    );
    let first_push = events
        .iter()
        .find(|e| e.cause == Cause::Push as i32)
        .unwrap();
    assert_eq!(
        first_push.snapshot_version, 1,
        "the first push is version 1"
    );
    stop_agent(agent, shutdown).await;
}

#[tokio::test]
async fn a_hung_sibling_does_not_delay_a_healthy_servers_publication() {
    let h = Harness::spawn().await;
    let token = token();
    let agent_id = h.register(&token).await;
    let mut commits = Commits::subscribe(&h, &agent_id).await;
    let ws = Workspace::new();
    ws.write_servers(&[
        ("hung", fixture(&["--mode", "hang"])),
        ("healthy", fixture(&["--mode", "normal"])),
    ]);
    let handshake_timeout = Duration::from_secs(15);
    let started = Instant::now();
    let (agent, shutdown) = h.start_agent(&ws, &token, handshake_timeout).await;
    let state = commits
        .wait_state(&h, &agent_id, "healthy committed", |s| {
            committed_ok(s, "healthy")
        })
        .await;
    assert!(started.elapsed() < handshake_timeout);
    assert_eq!(
        phase(&state),
        Some(Phase::Pending),
        "the hung server is still pending"
    );
    assert!(committed_server(&state, "hung").is_none());
    let state = commits
        .wait_state(&h, &agent_id, "complete", |s| {
            phase(s) == Some(Phase::Complete)
        })
        .await;
    let hung = committed_server(&state, "hung").unwrap();
    assert_eq!(hung.status, ResourceStatus::Invalid as i32);
    assert!(hung.error.contains("within 15s"), "{}", hung.error);
    stop_agent(agent, shutdown).await;
}

#[tokio::test]
async fn publication_retries_through_a_store_outage_and_ends_with_the_latest_state_committed() {
    let mut h = Harness::spawn().await;
    let token = token();
    let agent_id = h.register(&token).await;
    let mut commits = Commits::subscribe(&h, &agent_id).await;
    let ws = Workspace::new();
    let agents_md = ws.work().join("AGENTS.md");
    std::fs::write(&agents_md, "v1").unwrap();
    ws.write_servers(&[("one", fixture(&["--mode", "normal"]))]);
    let (agent, shutdown) = h.start_agent(&ws, &token, Duration::from_secs(20)).await;
    let before = commits
        .wait_state(&h, &agent_id, "complete", |s| {
            phase(s) == Some(Phase::Complete)
        })
        .await;
    let version_before = before.snapshot.as_ref().unwrap().version;

    h.stop_store().await;
    let mut status = agent.publish_status();
    // Change 1: a server added; its push meets the outage (503 from agent-ingest).
    ws.write_servers(&[
        ("one", fixture(&["--mode", "normal"])),
        ("two", fixture(&["--mode", "zero-tools"])),
    ]);
    let seen = wait_error(&mut status, "503", "a push met the outage").await;
    assert!(seen.attempts >= 2);
    // Change 2 during the outage: only the latest state matters.
    std::fs::write(&agents_md, "v2").unwrap();
    let mut reports = agent.reports();
    let source = format!("instruction_file:{}", agents_md.display());
    let latest = wait_report(&mut reports, "v2 and two in the report", |r| {
        let v2 = r.resource(&source).is_some_and(
            |res| matches!(&res.body, Some(Body::InstructionFile(f)) if f.content == "v2"),
        );
        v2 && is_ok(server(r, "two"))
    })
    .await;
    // Still failing: the store is down.
    let failing = status.borrow().clone();
    assert!(failing.last_error.is_some());
    let accepted = failing
        .accepted_report
        .expect("the pre-outage push was accepted");
    assert!(
        server(&accepted, "two").is_none(),
        "nothing after the outage began was accepted"
    );

    h.start_store().await;
    let state = commits
        .wait_state(&h, &agent_id, "latest state committed", |s| {
            s.resources.iter().any(|r| {
                r.source == source
                    && matches!(&r.body, Some(Body::InstructionFile(f)) if f.content == "v2")
            }) && committed_ok(s, "two")
        })
        .await;
    let snapshot = state.snapshot.as_ref().unwrap();
    assert!(snapshot.version > version_before);
    assert_eq!(snapshot.agent_run_id, agent.run_id());
    let mut committed: Vec<_> = state.resources.clone();
    let mut expected: Vec<_> = latest.resources.clone();
    committed.sort_by(|a, b| a.source.cmp(&b.source));
    expected.sort_by(|a, b| a.source.cmp(&b.source));
    assert_eq!(
        committed, expected,
        "the committed resources are the agent's latest report"
    );
    let recovered = tokio::time::timeout(DEADLINE, status.wait_for(|s| s.last_error.is_none()))
        .await
        .expect("publication recovered")
        .unwrap()
        .clone();
    assert_eq!(recovered.accepted.unwrap().1, Phase::Complete);
    stop_agent(agent, shutdown).await;
}

#[tokio::test]
async fn an_unknown_token_is_reported_as_401_and_retried() {
    let h = Harness::spawn().await;
    let ws = Workspace::new();
    ws.write_servers(&[]);
    let (agent, shutdown) = h
        .start_agent(&ws, "tok_not_registered", Duration::from_secs(5))
        .await;
    let mut status = agent.publish_status();
    let seen = wait_error(&mut status, "401", "401 reported").await;
    assert!(!seen.started);
    assert!(
        !seen.last_error.unwrap().contains("tok_not_registered"),
        "the token is never shown"
    );
    let base = format!("http://{}", agent.http_addr().unwrap());
    assert_eq!(
        reqwest::get(format!("{base}/readyz"))
            .await
            .unwrap()
            .status(),
        503
    );
    stop_agent(agent, shutdown).await;
}

/// The late first startup of a process that is gone (executed by a store
/// replica that stalled) takes the agent over. The live process, told its
/// next push is from a previous run, reclaims the agent and republishes.
#[tokio::test]
async fn a_live_agent_taken_over_by_a_late_startup_reclaims_it_and_republishes() {
    const GHOST: &str = "6f0e6f0e-dead-4ead-beef-000000000001";
    let h = Harness::spawn().await;
    let token = token();
    let agent_id = h.register(&token).await;
    let mut commits = Commits::subscribe(&h, &agent_id).await;
    let ws = Workspace::new();
    std::fs::write(ws.work().join("AGENTS.md"), "before").unwrap();
    ws.write_servers(&[]);
    let mut config = h.agent_config(&ws, &token, Duration::from_secs(5));
    // Only the push should notice here.
    config.publisher.reannounce_interval = Duration::ZERO;
    let shutdown = Shutdown::new();
    let agent = workspace_agent::start(config, shutdown.clone())
        .await
        .unwrap();
    let run = agent.run_id().to_owned();
    commits
        .wait_state(&h, &agent_id, "complete", |s| {
            phase(s) == Some(Phase::Complete)
        })
        .await;

    let reply = h.store_api.startup(&agent_id, GHOST).await;
    assert!(
        reply.response.unwrap().run_id_changed,
        "the ghost took over"
    );
    assert_eq!(h.state(&agent_id).await.agent.unwrap().agent_run_id, GHOST);

    std::fs::write(ws.work().join("AGENTS.md"), "after").unwrap();
    agent.reload();
    let state = commits
        .wait_state(&h, &agent_id, "reclaimed and republished", |s| {
            s.agent.as_ref().is_some_and(|a| a.agent_run_id == run)
                && s.resources.iter().any(
                    |r| matches!(&r.body, Some(Body::InstructionFile(f)) if f.content == "after"),
                )
        })
        .await;
    assert_eq!(state.snapshot.unwrap().agent_run_id, run);
    assert_eq!(agent.publish_status().borrow().reclaims, 1);
    let metrics = ctxsync_runtime::metrics::handle().render();
    assert!(
        metrics.contains("ctxsync_agent_reclaims_total"),
        "{metrics}"
    );
    // The ghost's run is now replaced like any other: a further late copy
    // of its startup changes nothing.
    let reply = h.store_api.startup(&agent_id, GHOST).await;
    assert_eq!(
        reply.response.unwrap().drop_reason(),
        ctxsync_proto::v1::StartupDropReason::SupersededRun
    );
    assert_eq!(h.state(&agent_id).await.agent.unwrap().agent_run_id, run);
    stop_agent(agent, shutdown).await;
}

/// Nothing changes in the workspace, so no push would notice the takeover:
/// the periodic re-announcement does, and the context is right again.
#[tokio::test]
async fn a_takeover_is_undone_by_the_reannouncement_when_nothing_changes() {
    const GHOST: &str = "6f0e6f0e-dead-4ead-beef-000000000002";
    let h = Harness::spawn().await;
    let token = token();
    let agent_id = h.register(&token).await;
    let mut commits = Commits::subscribe(&h, &agent_id).await;
    let ws = Workspace::new();
    ws.write_servers(&[]);
    let mut config = h.agent_config(&ws, &token, Duration::from_secs(5));
    config.publisher.reannounce_interval = Duration::from_millis(300);
    config.watch = false;
    let shutdown = Shutdown::new();
    let agent = workspace_agent::start(config, shutdown.clone())
        .await
        .unwrap();
    let run = agent.run_id().to_owned();
    commits
        .wait_state(&h, &agent_id, "complete", |s| {
            phase(s) == Some(Phase::Complete)
        })
        .await;
    let published = agent.publish_status().borrow().attempts;

    h.store_api.startup(&agent_id, GHOST).await;
    // The reclaim's own startup is the commit that wakes us; then the
    // republished report.
    let mut discovery = commits.discovery;
    let deadline = Instant::now() + DEADLINE;
    let mut taken_over = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let message = tokio::time::timeout(left, discovery.next())
            .await
            .expect("the agent takes its agent back within the deadline")
            .expect("subscription open");
        let event = DiscoveryChanged::decode(message.payload.as_ref()).unwrap();
        if event.cause() != Cause::Startup {
            continue;
        }
        if event.agent_run_id == GHOST {
            taken_over = true;
        } else if taken_over && event.agent_run_id == run {
            assert_eq!(event.previous_agent_run_id, GHOST);
            break;
        }
    }
    let mut status = agent.publish_status();
    tokio::time::timeout(
        DEADLINE,
        status.wait_for(|s| s.attempts > published && s.accepted.is_some_and(|(v, _)| v > 1)),
    )
    .await
    .expect("the current report is published again")
    .unwrap();
    let state = h.state(&agent_id).await;
    assert_eq!(state.agent.unwrap().agent_run_id, run);
    let snapshot = state.snapshot.unwrap();
    assert_eq!(
        (snapshot.agent_run_id.as_str(), snapshot.phase()),
        (run.as_str(), Phase::Complete)
    );
    stop_agent(agent, shutdown).await;
}
