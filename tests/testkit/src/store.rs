//! snapshot-store's client for tests that register agents and report for
//! them as agent-ingest would: the services' own client
//! (`ctxsync_runtime::store::StoreClient`), with the store's answers as it
//! sent them (a refusal in the reply's `error`), for tests of those answers.

use std::time::{Duration, Instant};

use ctxsync_proto::rpc::Reply as _;
use ctxsync_proto::rpc::store::{self, StoreRpc};
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::*;
use ctxsync_runtime::rpc::RpcError;

use crate::report::sha;

/// A Startup of `run_id` with agent version `test`.
pub fn startup(run_id: &str, reclaim: bool) -> StartupRequest {
    StartupRequest {
        agent_run_id: run_id.into(),
        agent_version: "test".into(),
        reclaim,
    }
}

/// A fresh tenant key in the format chat-gate accepts: `cxk_` and 43
/// base64url characters (32 random bytes).
pub fn new_tenant_key() -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let random: Vec<u8> = (0..3)
        .flat_map(|_| uuid::Uuid::new_v4().into_bytes())
        .collect();
    let body: String = random
        .iter()
        .take(43)
        .map(|b| ALPHABET[usize::from(b & 63)] as char)
        .collect();
    format!("cxk_{body}")
}

/// Requests to one store (one subject prefix). Cheap to clone into tasks.
/// Every call panics when the store does not answer, and the calls that name
/// a result (`register`, `push_ok`, `state`) assert the store reported no error.
#[derive(Clone)]
pub struct StoreClient {
    store: ctxsync_runtime::store::StoreClient,
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
            store: ctxsync_runtime::store::StoreClient::new(client, &subjects, timeout),
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

    /// The services' client of the same store.
    pub fn client(&self) -> &ctxsync_runtime::store::StoreClient {
        &self.store
    }

    /// One call of `M`, panicking when the store does not answer: its
    /// reply as the store sent it, a refusal in the reply's `error`.
    pub async fn request<M: StoreRpc>(&self, request: &M::Request) -> M::Reply {
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.store.call::<M>(request, None).await {
                Ok(reply) => return reply,
                Err(error @ RpcError::Service { .. }) => {
                    return M::Reply::failed(error.to_service_error());
                }
                Err(RpcError::NoResponders { .. })
                    if self.retry_no_responders && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(error) => panic!("store call failed: {error:?}"),
            }
        }
    }

    /// Registers agent `name` with the SHA-256 of `token`; returns its id.
    pub async fn register(&self, name: &str, token: &str) -> String {
        let reply = self
            .request::<store::RegisterAgent>(&RegisterAgentRequest {
                tenant: self.tenant.clone(),
                workspace: self.workspace.clone(),
                name: name.into(),
                token_sha256: sha(token),
            })
            .await;
        assert_eq!(reply.error, None);
        reply.agent_id
    }

    /// The tenant agents are registered in (`acme` unless [`StoreClient::in_tenant`]).
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The same store, registering agents in `tenant`.
    pub fn in_tenant(mut self, tenant: &str) -> Self {
        tenant.clone_into(&mut self.tenant);
        self
    }

    /// Issues a tenant key of `tenant` (as `ctxsync tenant key create` does)
    /// and returns the key and its id.
    pub async fn create_tenant_key(&self, tenant: &str) -> (String, String) {
        let key = new_tenant_key();
        let id = self.add_tenant_key(tenant, &key).await;
        (key, id)
    }

    /// Makes `testkit::chat::TEST_TENANT_KEY` a valid key of
    /// `testkit::chat::TEST_TENANT` in this store; returns its id.
    pub async fn create_test_tenant_key(&self) -> String {
        self.add_tenant_key(crate::chat::TEST_TENANT, crate::chat::TEST_TENANT_KEY)
            .await
    }

    async fn add_tenant_key(&self, tenant: &str, key: &str) -> String {
        let reply = self
            .request::<store::CreateTenantKey>(&CreateTenantKeyRequest {
                tenant: tenant.into(),
                label: "test".into(),
                key_sha256: sha(key),
            })
            .await;
        assert_eq!(reply.error, None);
        reply.key.expect("the created key").key_id
    }

    /// Revokes a tenant key by id.
    pub async fn revoke_tenant_key(&self, key_id: &str) {
        let reply = self
            .request::<store::RevokeTenantKey>(&RevokeTenantKeyRequest {
                key_id: key_id.into(),
            })
            .await;
        assert_eq!(reply.error, None);
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
        self.request::<store::UpdateStartup>(&UpdateStartupRequest {
            agent_id: agent_id.into(),
            startup: Some(startup),
        })
        .await
    }

    /// A push, as answered.
    pub async fn push(&self, agent_id: &str, push: PushContextStateRequest) -> StorePushReply {
        self.request::<store::PushContextState>(&StorePushRequest {
            agent_id: agent_id.into(),
            push: Some(push),
        })
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
        let reply = self
            .request::<store::GetAgentState>(&GetAgentStateRequest {
                agent_id: agent_id.into(),
            })
            .await;
        assert_eq!(reply.error, None);
        reply.state.expect("state")
    }
}
