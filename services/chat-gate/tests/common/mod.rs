//! A chat-gate and a snapshot-store on their own nats-server and database.
//! Agents are registered and report through the store's NATS API, as
//! agent-ingest would; chats ask the gate over NATS, HTTP or in process.
#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant, SystemTime};

use chat_gate::{Config, RunningGate};
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::*;
use ctxsync_runtime::{CommonArgs, Shutdown, rpc};
use snapshot_store::RunningStore;
// `server` below stands in for testkit's: its tools take `Q_SCHEMA`.
pub use testkit::report::*;
use testkit::stack::{Stack, StackBuilder, Started, TestStack};
use testkit::store::StoreClient;
use testkit::{NatsServer, TestDatabase};

pub const TIMEOUT: Duration = Duration::from_secs(30);
pub const RUN_A: &str = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";
pub const RUN_B: &str = "5e4d3c2b-1a4b-4f9d-a1c7-e1d7c2f7b0aa";

pub struct Harness {
    pub nats: NatsServer,
    pub db: TestDatabase,
    pub subjects: Subjects,
    /// The test's own client (quick to reconnect, like the services').
    pub client: async_nats::Client,
    /// The store's NATS API, through `client`.
    pub api: StoreClient,
    pub store_shutdown: Shutdown,
    pub store: Option<RunningStore>,
    pub gate_shutdown: Shutdown,
    pub gate: Option<RunningGate>,
    pub http: reqwest::Client,
    /// Between the gate and NATS, for [`Harness::spawn_behind_proxy`].
    pub proxy: Option<testkit::LateProxy>,
}

/// Gate settings for tests: waits long enough that only an event ends them,
/// and a safety sweep that never runs within a test.
pub fn gate_config(nats_url: &str, prefix: &str) -> Config {
    let mut config = Config::new(CommonArgs::for_nats(nats_url, prefix));
    config.pending_timeout = Duration::from_secs(20);
    config.stale_grace = Duration::from_secs(20);
    config.sweep_interval = Duration::from_secs(600);
    // Tests of the catalog section turn it on (`with_catalog`).
    config.catalog = false;
    config
}

/// A gate that prepares the tenant's catalog on first turns.
pub fn with_catalog(config: &mut Config) {
    config.catalog = true;
}

impl Harness {
    pub async fn spawn() -> Self {
        Self::spawn_with(|_| {}).await
    }

    pub async fn spawn_with(configure: impl FnOnce(&mut Config)) -> Self {
        Self::spawn_inner(configure, |_| {}, false).await
    }

    /// With the snapshot-store's configuration changed too.
    pub async fn spawn_with_store(
        configure: impl FnOnce(&mut Config),
        configure_store: impl FnOnce(&mut snapshot_store::Config),
    ) -> Self {
        Self::spawn_inner(configure, configure_store, false).await
    }

    /// The gate reaches NATS through a proxy the test can cut or slow, while
    /// the store and the test's client stay connected at full speed.
    pub async fn spawn_behind_proxy(configure: impl FnOnce(&mut Config)) -> Self {
        Self::spawn_inner(configure, |_| {}, true).await
    }

    async fn spawn_inner(
        configure: impl FnOnce(&mut Config),
        configure_store: impl FnOnce(&mut snapshot_store::Config),
        behind_proxy: bool,
    ) -> Self {
        let TestStack { nats, db, prefix } = TestStack::private().await;
        let mut proxy = None;
        let gate_nats_url = if behind_proxy {
            proxy
                .insert(testkit::LateProxy::start(nats.port()).await)
                .url()
        } else {
            nats.url()
        };
        // The store and the gate each under a shutdown of their own (the
        // children of this one), so a test can stop the store alone.
        let stack = testkit::stack::start(
            StackBuilder::new(nats.url(), &prefix)
                .database(db.url())
                .store(configure_store)
                .gate(|config| {
                    *config = gate_config(&gate_nats_url, &prefix);
                    configure(config);
                }),
            &Shutdown::new(),
        )
        .await;
        let Stack {
            mut stores,
            mut gates,
            ..
        } = stack;
        let Started {
            running: store,
            shutdown: store_shutdown,
        } = stores.remove(0);
        let Started {
            running: gate,
            shutdown: gate_shutdown,
        } = gates.remove(0);
        let client = ctxsync_runtime::nats::connect(&nats.url(), "test")
            .await
            .expect("test client connects")
            .client;
        let subjects = Subjects::new(&prefix).unwrap();
        let api = StoreClient::new(client.clone(), subjects.clone(), TIMEOUT, "ws1");
        api.create_test_tenant_key().await;
        Self {
            api,
            nats,
            db,
            subjects,
            client,
            store_shutdown,
            store: Some(store),
            gate_shutdown,
            gate: Some(gate),
            http: authenticated_http(),
            proxy,
        }
    }

    pub fn gate(&self) -> &chat_gate::Gate {
        self.gate.as_ref().expect("gate running").gate()
    }

    pub fn url(&self, path: &str) -> String {
        format!(
            "http://{}{path}",
            self.gate.as_ref().expect("gate running").http_addr()
        )
    }

    /// Stops snapshot-store (its subjects then have no responders).
    pub async fn stop_store(&mut self) {
        self.store_shutdown.cancel();
        if let Some(store) = self.store.take() {
            store.join().await;
        }
    }

    /// Registers agent `name`, whose token is its name.
    pub async fn register(&self, name: &str) -> String {
        self.api.register(name, name).await
    }

    /// The agent's Startup, asserting the store took it.
    pub async fn startup(&self, agent_id: &str, run_id: &str) {
        let reply = self.api.startup(agent_id, run_id).await;
        assert_eq!(reply.error, None);
    }

    /// Pushes and asserts the store accepted it.
    pub async fn push_ok(&self, agent_id: &str, push: PushContextStateRequest) {
        self.api.push_ok(agent_id, push).await
    }

    /// Agent `a`, started with the run of `first` and having pushed it.
    pub async fn agent_reporting(&self, first: PushContextStateRequest) -> String {
        let agent = self.register("a").await;
        self.startup(&agent, &first.agent_run_id).await;
        self.push_ok(&agent, first).await;
        agent
    }

    /// A turn over the gate's NATS API, as the agents' tenant.
    pub async fn turn(&self, chat_id: &str, agent_id: &str, first_turn: bool) -> TurnReply {
        self.tenant_turn(testkit::chat::TEST_TENANT, chat_id, agent_id, first_turn)
            .await
    }

    /// A turn of `tenant`'s chat over the gate's NATS API.
    pub async fn tenant_turn(
        &self,
        tenant: &str,
        chat_id: &str,
        agent_id: &str,
        first_turn: bool,
    ) -> TurnReply {
        rpc::request(
            &self.client,
            self.subjects.gate_turn(tenant),
            &TurnRequest {
                chat_id: chat_id.into(),
                agent_id: agent_id.into(),
                first_turn,
                tenant: String::new(),
            },
            None,
            TIMEOUT,
        )
        .await
        .expect("gate answers")
    }

    /// A first turn over NATS in the background; the answer comes with the
    /// time it arrived.
    pub fn spawn_turn(
        &self,
        chat_id: &str,
        agent_id: &str,
    ) -> tokio::task::JoinHandle<(TurnReply, SystemTime)> {
        let (client, subject) = (
            self.client.clone(),
            self.subjects.gate_turn(testkit::chat::TEST_TENANT),
        );
        let request = first_turn_request(chat_id, agent_id);
        tokio::spawn(async move {
            let reply: TurnReply = rpc::request(&client, subject, &request, None, TIMEOUT)
                .await
                .expect("gate answers");
            (reply, SystemTime::now())
        })
    }

    /// A first turn called on the gate in-process, so that aborting the task
    /// drops the caller's future (a NATS caller going away cancels nothing).
    pub fn spawn_turn_in_process(
        &self,
        chat_id: &str,
        agent_id: &str,
    ) -> tokio::task::JoinHandle<(TurnReply, SystemTime)> {
        let gate = self.gate().clone();
        let request = first_turn_request(chat_id, agent_id);
        tokio::spawn(async move {
            let reply = gate.turn(request).await;
            (reply, SystemTime::now())
        })
    }

    /// A first turn over the gate's HTTP API in the background; the answer
    /// (status 200 asserted) comes with the time it arrived.
    pub fn spawn_http_turn(
        &self,
        chat_id: &str,
        agent_id: &str,
    ) -> tokio::task::JoinHandle<(serde_json::Value, SystemTime)> {
        let (http, url) = (self.http.clone(), self.url("/api/v1/gate"));
        let body =
            serde_json::json!({"chat_id": chat_id, "agent_id": agent_id, "first_turn": true});
        tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&body)
                .send()
                .await
                .expect("gate answers");
            assert_eq!(response.status(), 200);
            let body = response.json().await.expect("a JSON answer");
            (body, SystemTime::now())
        })
    }

    /// Another chat-gate replica on the same NATS server and prefix.
    pub async fn spawn_replica(&self, configure: impl FnOnce(&mut Config)) -> Replica {
        let builder = self.builder().gate(|config| {
            *config = gate_config(&self.nats.url(), self.subjects.prefix());
            configure(config);
        });
        let Started { running, shutdown } = builder
            .start(&Shutdown::new())
            .await
            .expect("the replica starts")
            .gates
            .remove(0);
        Replica {
            shutdown,
            gate: Some(running),
        }
    }

    /// Waits (bounded) until the gate's `/readyz` answers `status` (503
    /// while it has no NATS connection).
    pub async fn until_readyz(&self, status: u16, what: &str) {
        let (http, ready) = (self.http.clone(), self.url("/readyz"));
        until(what.into(), || {
            let (http, ready) = (http.clone(), ready.clone());
            async move {
                http.get(ready)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == status)
            }
        })
        .await;
    }

    /// Waits (bounded) until the gate holds `n` waits.
    pub async fn until_waiting(&self, n: usize) {
        let gate = self.gate().clone();
        until(format!("the gate holds {n} waits"), move || {
            let held = gate.waiters_held();
            async move { held == n }
        })
        .await;
    }

    /// A catalog service on this test's NATS, prefix and database, serving
    /// `config` (the catalog's YAML as JSON), without warm-up.
    pub async fn start_catalog(&self, config: serde_json::Value) -> (catalog::Running, Shutdown) {
        self.start_catalog_with(config, |settings| settings.warmup.enabled = false)
            .await
    }

    /// A catalog with its settings changed from the defaults.
    pub async fn start_catalog_with(
        &self,
        config: serde_json::Value,
        configure: impl FnOnce(&mut catalog::Settings),
    ) -> (catalog::Running, Shutdown) {
        let mut settings = catalog::Settings::default();
        configure(&mut settings);
        let servers = catalog::config::CatalogConfig::from_yaml(&config.to_string()).unwrap();
        let Started { running, shutdown } = self
            .builder()
            .catalog(servers, settings, |_| {})
            .start(&Shutdown::new())
            .await
            .expect("catalog starts")
            .catalogs
            .remove(0);
        (running, shutdown)
    }

    /// A stack builder on this test's NATS, prefix and database, with no service yet.
    pub fn builder(&self) -> StackBuilder {
        StackBuilder::new(self.nats.url(), self.subjects.prefix()).database(self.db.url())
    }

    /// Counts the store reads of this test's prefix, as the store sees them.
    pub async fn count_store_reads(&self) -> ReadCounter {
        let mut subscriber =
            testkit::subscribe(&self.client, self.subjects.store_get_agent_state()).await;
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = count.clone();
        let task = tokio::spawn(async move {
            use futures::StreamExt;
            while subscriber.next().await.is_some() {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        ReadCounter { count, task }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.gate_shutdown.cancel();
        self.store_shutdown.cancel();
    }
}

/// A second chat-gate, stopped when dropped.
pub struct Replica {
    pub shutdown: Shutdown,
    pub gate: Option<RunningGate>,
}

impl Replica {
    pub fn gate(&self) -> &chat_gate::Gate {
        self.gate.as_ref().expect("replica running").gate()
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(gate) = self.gate.take() {
            tokio::time::timeout(TIMEOUT, gate.join())
                .await
                .expect("the replica stops");
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub struct ReadCounter {
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadCounter {
    pub fn get(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for ReadCounter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP client that presents the test tenant's key on every request.
pub fn authenticated_http() -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {}", testkit::chat::TEST_TENANT_KEY)
            .parse()
            .unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap()
}

pub fn first_turn_request(chat_id: &str, agent_id: &str) -> TurnRequest {
    TurnRequest {
        chat_id: chat_id.into(),
        agent_id: agent_id.into(),
        first_turn: true,
        tenant: testkit::chat::TEST_TENANT.into(),
    }
}

/// Re-checks `condition` until it holds, failing the test after `TIMEOUT`.
pub async fn until<F, Fut>(what: String, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + TIMEOUT;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The answer of a background turn, bounded.
pub async fn answer(
    turn: tokio::task::JoinHandle<(TurnReply, SystemTime)>,
) -> (TurnReply, SystemTime) {
    tokio::time::timeout(TIMEOUT, turn)
        .await
        .expect("the turn answers in time")
        .expect("the turn task does not panic")
}

/// A tool input schema with one property, to see schemas reach the chat as objects.
pub const Q_SCHEMA: &str = r#"{"type":"object","properties":{"q":{"type":"string"}}}"#;

/// [`testkit::report::server`] whose tools take [`Q_SCHEMA`].
pub fn server(name: &str, tools: &[&str]) -> ContextResource {
    server_with_schema(name, tools, Q_SCHEMA)
}

pub fn tool_names(reply: &TurnReply) -> Vec<String> {
    reply
        .projection
        .as_ref()
        .expect("projection")
        .servers
        .iter()
        .flat_map(|s| s.tools.iter().map(|t| t.name.clone()))
        .collect()
}

pub fn projection(reply: &TurnReply) -> &ChatProjection {
    reply.projection.as_ref().expect("projection")
}

pub fn millis_since(since: SystemTime, at: SystemTime) -> f64 {
    at.duration_since(since).unwrap_or_default().as_secs_f64() * 1000.0
}

pub fn committed_at(event: &DiscoveryChanged) -> SystemTime {
    let ts = event.committed_at.as_ref().expect("committed_at");
    SystemTime::UNIX_EPOCH + Duration::new(ts.seconds as u64, ts.nanos as u32)
}
