//! snapshot-store's client: every caller of the store (chat-gate, agent-ingest,
//! the tenant-key verifier, the CLI, the tests) asks through it, with the
//! calls of [`ctxsync_proto::rpc::store`], and meets every failure as one
//! [`RpcError`]: the store's own refusals as [`RpcError::Service`] with its
//! code.

use std::time::Duration;

use async_nats::HeaderMap;
use ctxsync_proto::rpc::store::{self, StoreRpc};
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, AuthenticateAgentRequest, CreateTenantKeyRequest, GetAgentStateRequest,
    ListAgentsRequest, ListTenantKeysRequest, PushContextStateRequest, PushContextStateResponse,
    RegisterAgentRequest, RevokeTenantKeyRequest, RotateAgentTokenRequest, StartupRequest,
    StartupResponse, StorePushRequest, TenantKey, UpdateStartupRequest, VerifyTenantKeyRequest,
};

use crate::rpc::{self, RpcError};

/// One page of a tenant's agents and the id to continue after (empty at the end).
pub type AgentPage = (Vec<AgentState>, String);

/// Calls to snapshot-store under one subject prefix, each bounded by `timeout`.
#[derive(Debug, Clone)]
pub struct StoreClient {
    client: async_nats::Client,
    subjects: Subjects,
    timeout: Duration,
}

impl StoreClient {
    pub fn new(client: async_nats::Client, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            client,
            subjects: subjects.clone(),
            timeout,
        }
    }

    /// How long a call waits for its answer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Any store call: its reply (its `error` empty), or the failure.
    /// `headers` ride along (a trace context); the deadline is added.
    pub async fn call<M: StoreRpc>(
        &self,
        request: &M::Request,
        headers: Option<HeaderMap>,
    ) -> Result<M::Reply, RpcError> {
        rpc::call::<M>(&self.client, &self.subjects, request, headers, self.timeout).await
    }

    /// Registers an agent by its token's SHA-256; returns its id.
    pub async fn register_agent(&self, request: RegisterAgentRequest) -> Result<String, RpcError> {
        let reply = self.call::<store::RegisterAgent>(&request, None).await?;
        Ok(reply.agent_id)
    }

    /// Gives the agent named in `request` a new token; returns its id.
    pub async fn rotate_agent_token(
        &self,
        request: RotateAgentTokenRequest,
    ) -> Result<String, RpcError> {
        let reply = self.call::<store::RotateAgentToken>(&request, None).await?;
        Ok(reply.agent_id)
    }

    /// The agent a token's SHA-256 belongs to; `None` when no agent has it.
    pub async fn authenticate_agent(
        &self,
        token_sha256: Vec<u8>,
    ) -> Result<Option<String>, RpcError> {
        let request = AuthenticateAgentRequest { token_sha256 };
        let reply = self
            .call::<store::AuthenticateAgent>(&request, None)
            .await?;
        Ok(Some(reply.agent_id).filter(|id| !id.is_empty()))
    }

    /// An agent process's Startup, as the store answered it (accepted or dropped).
    pub async fn update_startup(
        &self,
        agent_id: &str,
        startup: StartupRequest,
        headers: Option<HeaderMap>,
    ) -> Result<StartupResponse, RpcError> {
        let request = UpdateStartupRequest {
            agent_id: agent_id.to_owned(),
            startup: Some(startup),
        };
        let reply = self.call::<store::UpdateStartup>(&request, headers).await?;
        reply
            .response
            .ok_or_else(|| self.incomplete::<store::UpdateStartup>("response"))
    }

    /// An agent's report, as the store answered it (accepted or dropped).
    pub async fn push(
        &self,
        agent_id: &str,
        push: PushContextStateRequest,
        headers: Option<HeaderMap>,
    ) -> Result<PushContextStateResponse, RpcError> {
        let request = StorePushRequest {
            agent_id: agent_id.to_owned(),
            push: Some(push),
        };
        let reply = self
            .call::<store::PushContextState>(&request, headers)
            .await?;
        reply
            .response
            .ok_or_else(|| self.incomplete::<store::PushContextState>("response"))
    }

    /// The agent's row, snapshot and resources, read in one transaction.
    pub async fn agent_state(&self, agent_id: &str) -> Result<AgentState, RpcError> {
        let request = GetAgentStateRequest {
            agent_id: agent_id.to_owned(),
        };
        let reply = self.call::<store::GetAgentState>(&request, None).await?;
        reply
            .state
            .ok_or_else(|| self.incomplete::<store::GetAgentState>("state"))
    }

    /// One page of `tenant`'s agents, ordered by id, after `after` (empty: from the first).
    pub async fn list_agents(
        &self,
        tenant: &str,
        limit: u32,
        after: &str,
    ) -> Result<AgentPage, RpcError> {
        let request = ListAgentsRequest {
            tenant: tenant.to_owned(),
            limit,
            after_agent_id: after.to_owned(),
        };
        let reply = self.call::<store::ListAgents>(&request, None).await?;
        Ok((reply.states, reply.next_after_agent_id))
    }

    /// Records a new key of `tenant` by its SHA-256.
    pub async fn create_tenant_key(
        &self,
        request: CreateTenantKeyRequest,
    ) -> Result<TenantKey, RpcError> {
        let reply = self.call::<store::CreateTenantKey>(&request, None).await?;
        reply
            .key
            .ok_or_else(|| self.incomplete::<store::CreateTenantKey>("key"))
    }

    /// Keys, of one tenant when `tenant` is not empty.
    pub async fn list_tenant_keys(
        &self,
        tenant: &str,
        include_revoked: bool,
    ) -> Result<Vec<TenantKey>, RpcError> {
        let request = ListTenantKeysRequest {
            tenant: tenant.to_owned(),
            include_revoked,
        };
        Ok(self
            .call::<store::ListTenantKeys>(&request, None)
            .await?
            .keys)
    }

    /// Revokes a key (revoking a revoked one is not an error).
    pub async fn revoke_tenant_key(&self, key_id: &str) -> Result<TenantKey, RpcError> {
        let request = RevokeTenantKeyRequest {
            key_id: key_id.to_owned(),
        };
        let reply = self.call::<store::RevokeTenantKey>(&request, None).await?;
        reply
            .key
            .ok_or_else(|| self.incomplete::<store::RevokeTenantKey>("key"))
    }

    /// The valid key with this SHA-256; `None` when it is unknown or revoked.
    pub async fn verify_tenant_key(
        &self,
        key_sha256: Vec<u8>,
    ) -> Result<Option<TenantKey>, RpcError> {
        let request = VerifyTenantKeyRequest { key_sha256 };
        Ok(self
            .call::<store::VerifyTenantKey>(&request, None)
            .await?
            .key)
    }

    fn incomplete<M: StoreRpc>(&self, field: &'static str) -> RpcError {
        RpcError::Incomplete {
            subject: M::subject(&self.subjects),
            field,
        }
    }
}
