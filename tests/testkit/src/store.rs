//! A small typed client of snapshot-store's NATS API, for tests that register
//! agents and report for them as agent-ingest would.

use std::time::{Duration, Instant};

use ctxsync_proto::Message;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::*;
use ctxsync_runtime::rpc::{self, RpcError};

use crate::report::sha;

/// A Startup of `run_id` with agent version `test`.
pub fn startup(run_id: &str, reclaim: bool) -> StartupRequest {
    StartupRequest {
        agent_run_id: run_id.into(),
        agent_version: "test".into(),
        reclaim,
    }
}

/// Requests to one store (one subject prefix). Cheap to clone into tasks.
/// Every call panics when the store does not answer, and the calls that name
/// a result (`register`, `push_ok`, `state`) assert the store reported no error.
#[derive(Clone)]
pub struct StoreClient {
    client: async_nats::Client,
    subjects: Subjects,
    timeout: Duration,
    tenant: String,
    workspace: String,
    retry_no_responders: bool,
}

impl StoreClient {
    /// Agents are registered in tenant `acme`, workspace `workspace`.
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        timeout: Duration,
        workspace: &str,
    ) -> Self {
        Self {
            client,
            subjects,
            timeout,
            tenant: "acme".into(),
            workspace: workspace.into(),
            retry_no_responders: false,
        }
    }

    /// Retries a request that meets "no responders", bounded by the timeout.
    /// `snapshot_store::start` returns once its SUBs are written to the
    /// socket, not once nats-server has processed them, so right after a
    /// (re)start a request can find no store yet.
    pub fn retrying_no_responders(mut self) -> Self {
        self.retry_no_responders = true;
        self
    }

    /// One request on `subject`, panicking when the store does not answer.
    pub async fn request<Req: Message, Resp: Message + Default>(
        &self,
        subject: String,
        request: &Req,
    ) -> Resp {
        let deadline = Instant::now() + self.timeout;
        loop {
            match rpc::request(&self.client, subject.clone(), request, None, self.timeout).await {
                Ok(reply) => return reply,
                Err(RpcError::NoResponders { .. })
                    if self.retry_no_responders && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(error) => panic!("store request on {subject} failed: {error:?}"),
            }
        }
    }

    /// Registers agent `name` with the SHA-256 of `token`; returns its id.
    pub async fn register(&self, name: &str, token: &str) -> String {
        let reply: RegisterAgentReply = self
            .request(
                self.subjects.store_register_agent(),
                &RegisterAgentRequest {
                    tenant: self.tenant.clone(),
                    workspace: self.workspace.clone(),
                    name: name.into(),
                    token_sha256: sha(token),
                },
            )
            .await;
        assert_eq!(reply.error, None);
        reply.agent_id
    }

    /// The agent's Startup with `run_id` (agent version `test`), as answered.
    pub async fn startup(&self, agent_id: &str, run_id: &str) -> UpdateStartupReply {
        self.startup_request(agent_id, startup(run_id, false)).await
    }

    /// The Startup of a live process reclaiming its agent with `run_id`.
    pub async fn reclaim(&self, agent_id: &str, run_id: &str) -> UpdateStartupReply {
        self.startup_request(agent_id, startup(run_id, true)).await
    }

    /// Any Startup, as answered.
    pub async fn startup_request(
        &self,
        agent_id: &str,
        startup: StartupRequest,
    ) -> UpdateStartupReply {
        self.request(
            self.subjects.store_update_startup(),
            &UpdateStartupRequest {
                agent_id: agent_id.into(),
                startup: Some(startup),
            },
        )
        .await
    }

    /// A push, as answered.
    pub async fn push(&self, agent_id: &str, push: PushContextStateRequest) -> StorePushReply {
        self.request(
            self.subjects.store_push(),
            &StorePushRequest {
                agent_id: agent_id.into(),
                push: Some(push),
            },
        )
        .await
    }

    /// Pushes and asserts the store accepted it.
    pub async fn push_ok(&self, agent_id: &str, push: PushContextStateRequest) {
        let reply = self.push(agent_id, push).await;
        assert_eq!(reply.error, None);
        assert!(reply.response.unwrap().accepted, "push was dropped");
    }

    /// The agent's committed state.
    pub async fn state(&self, agent_id: &str) -> AgentState {
        let reply: GetAgentStateReply = self
            .request(
                self.subjects.store_get_agent_state(),
                &GetAgentStateRequest {
                    agent_id: agent_id.into(),
                },
            )
            .await;
        assert_eq!(reply.error, None);
        reply.state.expect("state")
    }
}
