//! A snapshot-store on its own nats-server and database, driven over NATS.
#![allow(dead_code)]

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::*;
use ctxsync_runtime::{CommonArgs, Shutdown};
use snapshot_store::{Config, RunningStore};
pub use testkit::report::*;
use testkit::stack::{StackBuilder, TestStack};
use testkit::store::StoreClient;
use testkit::{NatsServer, TestDatabase};

pub const TIMEOUT: Duration = Duration::from_secs(10);

pub struct StoreHarness {
    pub nats: NatsServer,
    pub db: TestDatabase,
    pub subjects: Subjects,
    pub client: async_nats::Client,
    pub shutdown: Shutdown,
    pub stores: Vec<RunningStore>,
    /// The store's NATS API, through `client`.
    pub api: StoreClient,
}

pub fn config(nats_url: &str, prefix: &str, db_url: &str) -> Config {
    Config::new(CommonArgs::for_nats(nats_url, prefix), db_url)
}

impl StoreHarness {
    pub async fn spawn() -> Self {
        Self::spawn_replicas(1).await
    }

    pub async fn spawn_replicas(replicas: usize) -> Self {
        Self::spawn_with(replicas, |_| {}).await
    }

    /// One store whose events carry states of at most `max_bytes`.
    pub async fn spawn_with_event_state_max_bytes(max_bytes: usize) -> Self {
        Self::spawn_with(1, |config| config.event_state_max_bytes = max_bytes).await
    }

    /// `replicas` stores, each with the configuration `configure` leaves.
    pub async fn spawn_with(replicas: usize, configure: impl Fn(&mut Config)) -> Self {
        let TestStack { nats, db, prefix } = TestStack::private().await;
        let shutdown = Shutdown::new();
        let mut builder = StackBuilder::new(nats.url(), &prefix).database(db.url());
        for _ in 0..replicas {
            builder = builder.store(&configure);
        }
        let stores = testkit::stack::start(builder, &shutdown)
            .await
            .stores
            .into_iter()
            .map(|started| started.running)
            .collect();
        let client = async_nats::connect(nats.url())
            .await
            .expect("test client connects");
        let subjects = Subjects::new(&prefix).unwrap();
        Self {
            api: StoreClient::new(client.clone(), subjects.clone(), TIMEOUT, "ws1"),
            nats,
            db,
            subjects,
            client,
            shutdown,
            stores,
        }
    }

    /// Registers agent `name`, whose token is its name.
    pub async fn register(&self, name: &str) -> String {
        self.api.register(name, name).await
    }

    pub async fn startup(&self, agent_id: &str, run_id: &str) -> UpdateStartupReply {
        self.api.startup(agent_id, run_id).await
    }

    pub async fn push(&self, agent_id: &str, push: PushContextStateRequest) -> StorePushReply {
        self.api.push(agent_id, push).await
    }

    /// Pushes and asserts the store accepted it.
    pub async fn push_ok(&self, agent_id: &str, push: PushContextStateRequest) {
        self.api.push_ok(agent_id, push).await
    }

    pub async fn state(&self, agent_id: &str) -> AgentState {
        self.api.state(agent_id).await
    }
}
