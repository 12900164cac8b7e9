//! A snapshot-store on its own nats-server and database, driven over NATS.
#![allow(dead_code)]

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::*;
use ctxsync_runtime::{CommonArgs, DatabaseArgs, Shutdown, rpc};
use snapshot_store::{Config, RunningStore};
use testkit::{NatsServer, TestDatabase};

pub const TIMEOUT: Duration = Duration::from_secs(10);

pub struct StoreHarness {
    pub nats: NatsServer,
    pub db: TestDatabase,
    pub subjects: Subjects,
    pub client: async_nats::Client,
    pub shutdown: Shutdown,
    pub stores: Vec<RunningStore>,
}

pub fn config(nats_url: &str, prefix: &str, db_url: &str) -> Config {
    Config {
        common: CommonArgs::for_nats(nats_url, prefix),
        database: DatabaseArgs::new(db_url),
    }
}

impl StoreHarness {
    pub async fn spawn() -> Self {
        Self::spawn_replicas(1).await
    }

    pub async fn spawn_replicas(replicas: usize) -> Self {
        testkit::init_logs();
        let nats = NatsServer::start();
        let db = TestDatabase::create().await;
        let prefix = testkit::unique_prefix();
        let shutdown = Shutdown::new();
        let mut stores = Vec::new();
        for _ in 0..replicas {
            stores.push(
                snapshot_store::start(config(&nats.url(), &prefix, db.url()), shutdown.clone())
                    .await
                    .expect("snapshot-store starts"),
            );
        }
        let client = async_nats::connect(nats.url())
            .await
            .expect("test client connects");
        Self {
            nats,
            db,
            subjects: Subjects::new(&prefix).unwrap(),
            client,
            shutdown,
            stores,
        }
    }

    pub async fn register(&self, name: &str) -> String {
        let reply: RegisterAgentReply = rpc::request(
            &self.client,
            self.subjects.store_register_agent(),
            &RegisterAgentRequest {
                tenant: "acme".into(),
                workspace: "ws1".into(),
                name: name.into(),
                token_sha256: sha(name),
            },
            None,
            TIMEOUT,
        )
        .await
        .expect("register answers");
        assert_eq!(reply.error, None);
        reply.agent_id
    }

    pub async fn startup(&self, agent_id: &str, run_id: &str) -> UpdateStartupReply {
        rpc::request(
            &self.client,
            self.subjects.store_update_startup(),
            &UpdateStartupRequest {
                agent_id: agent_id.into(),
                startup: Some(StartupRequest {
                    agent_run_id: run_id.into(),
                    agent_version: "test".into(),
                }),
            },
            None,
            TIMEOUT,
        )
        .await
        .expect("startup answers")
    }

    pub async fn push(&self, agent_id: &str, push: PushContextStateRequest) -> StorePushReply {
        rpc::request(
            &self.client,
            self.subjects.store_push(),
            &StorePushRequest {
                agent_id: agent_id.into(),
                push: Some(push),
            },
            None,
            TIMEOUT,
        )
        .await
        .expect("push answers")
    }

    /// Pushes and asserts the store accepted it.
    pub async fn push_ok(&self, agent_id: &str, push: PushContextStateRequest) {
        let reply = self.push(agent_id, push).await;
        assert_eq!(reply.error, None);
        assert!(reply.response.unwrap().accepted, "push was dropped");
    }

    pub async fn state(&self, agent_id: &str) -> AgentState {
        let reply: GetAgentStateReply = rpc::request(
            &self.client,
            self.subjects.store_get_agent_state(),
            &GetAgentStateRequest {
                agent_id: agent_id.into(),
            },
            None,
            TIMEOUT,
        )
        .await
        .expect("get answers");
        assert_eq!(reply.error, None);
        reply.state.expect("state")
    }
}

pub fn sha(token: &str) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes()).to_vec()
}

pub fn instruction(path: &str, content: &str) -> ContextResource {
    ContextResource {
        source: format!("instruction_file:{path}"),
        kind: ResourceKind::InstructionFile as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(context_resource::Body::InstructionFile(InstructionFile {
            path: path.into(),
            content: content.into(),
            truncated: false,
        })),
        ..Default::default()
    }
}

pub fn server(name: &str, tools: &[&str]) -> ContextResource {
    ContextResource {
        source: format!("mcp_server:{name}"),
        kind: ResourceKind::McpServer as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(context_resource::Body::McpServer(McpServer {
            name: name.into(),
            transport: McpTransport::Stdio as i32,
            config_path: "/w/.mcp.json".into(),
            tools: tools
                .iter()
                .map(|t| McpTool {
                    name: (*t).into(),
                    description: format!("the {t} tool"),
                    input_schema_json: r#"{"type":"object"}"#.into(),
                })
                .collect(),
        })),
        ..Default::default()
    }
}

pub fn push(
    run_id: &str,
    version: u64,
    initial: bool,
    phase: Option<mcp_discovery::Phase>,
    resources: Vec<ContextResource>,
) -> PushContextStateRequest {
    PushContextStateRequest {
        agent_run_id: run_id.into(),
        version,
        initial,
        mcp_discovery: phase.map(|p| McpDiscovery { phase: p as i32 }),
        resources,
        context_config: Some(ContextConfig {
            working_dir: "/w".into(),
            ..Default::default()
        }),
    }
}

pub fn sources(state: &AgentState) -> Vec<String> {
    state.resources.iter().map(|r| r.source.clone()).collect()
}
