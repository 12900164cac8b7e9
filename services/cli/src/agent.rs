//! `ctxsync agent register` and `ctxsync agent show`.

use std::fmt::Write as _;
use std::time::Duration;

use base64::Engine;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, GetAgentStateReply, GetAgentStateRequest, RegisterAgentReply, RegisterAgentRequest,
    ResourceKind, ResourceStatus, context_resource::Body,
};
use ctxsync_runtime::rpc;
use rand::RngCore;
use sha2::Digest;

#[derive(Debug, thiserror::Error)]
pub enum AgentCommandError {
    #[error(transparent)]
    Rpc(#[from] rpc::RpcError),
    #[error("snapshot-store refused: {0}")]
    Store(String),
    #[error("{0}")]
    Invalid(String),
}

/// A new agent's id and its token (shown once; the store keeps only its hash).
#[derive(Debug, serde::Serialize)]
pub struct Registered {
    pub agent_id: String,
    pub token: String,
}

/// A fresh agent token: 32 random bytes, URL-safe base64, with a recognizable prefix.
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "cxs_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

pub async fn register(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    tenant: &str,
    workspace: &str,
    name: &str,
) -> Result<Registered, AgentCommandError> {
    let token = new_token();
    let reply: RegisterAgentReply = rpc::request(
        nats,
        subjects.store_register_agent(),
        &RegisterAgentRequest {
            tenant: tenant.into(),
            workspace: workspace.into(),
            name: name.into(),
            token_sha256: sha2::Sha256::digest(token.as_bytes()).to_vec(),
        },
        None,
        timeout,
    )
    .await?;
    if let Some(error) = reply.error {
        return Err(AgentCommandError::Store(error.message));
    }
    Ok(Registered {
        agent_id: reply.agent_id,
        token,
    })
}

pub async fn show(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    agent_id: &str,
) -> Result<AgentState, AgentCommandError> {
    let reply: GetAgentStateReply = rpc::request(
        nats,
        subjects.store_get_agent_state(),
        &GetAgentStateRequest {
            agent_id: agent_id.into(),
        },
        None,
        timeout,
    )
    .await?;
    if let Some(error) = reply.error {
        return Err(AgentCommandError::Store(error.message));
    }
    Ok(reply.state.unwrap_or_default())
}

fn status_name(status: i32) -> &'static str {
    match ResourceStatus::try_from(status).unwrap_or_default() {
        ResourceStatus::Ok => "ok",
        ResourceStatus::Invalid => "invalid",
        ResourceStatus::Unreadable => "unreadable",
        ResourceStatus::Oversize => "oversize",
        ResourceStatus::Excluded => "excluded",
        ResourceStatus::Unspecified => "?",
    }
}

fn kind_name(kind: i32) -> &'static str {
    match ResourceKind::try_from(kind).unwrap_or_default() {
        ResourceKind::InstructionFile => "instruction_file",
        ResourceKind::Skill => "skill",
        ResourceKind::McpConfig => "mcp_config",
        ResourceKind::McpServer => "mcp_server",
        ResourceKind::Unspecified => "?",
    }
}

/// A human-readable report of an agent's committed state.
pub fn render(state: &AgentState) -> String {
    let mut out = String::new();
    let agent = state.agent.clone().unwrap_or_default();
    let _ = writeln!(out, "agent      {}", agent.agent_id);
    let _ = writeln!(
        out,
        "name       {}/{}/{}",
        agent.tenant, agent.workspace, agent.name
    );
    let run = if agent.agent_run_id.is_empty() {
        "(none: legacy agent)"
    } else {
        &agent.agent_run_id
    };
    let _ = writeln!(out, "run id     {run}");
    match &state.snapshot {
        None => {
            let _ = writeln!(out, "snapshot   none yet");
        }
        Some(snapshot) => {
            let fresh = if snapshot.agent_run_id == agent.agent_run_id {
                "current run"
            } else {
                "STALE: from another run"
            };
            let _ = writeln!(
                out,
                "snapshot   version {} of run {:?} ({fresh}), phase {}",
                snapshot.version,
                snapshot.agent_run_id,
                snapshot.phase().as_str_name()
            );
        }
    }
    let _ = writeln!(out, "resources  {}", state.resources.len());
    for resource in &state.resources {
        let detail = match &resource.body {
            Some(Body::McpServer(server)) => format!("{} tools", server.tools.len()),
            Some(Body::InstructionFile(file)) => format!(
                "{} bytes{}",
                file.content.len(),
                if file.truncated { ", truncated" } else { "" }
            ),
            Some(Body::Skill(skill)) => skill.name.clone(),
            Some(Body::McpConfig(config)) => format!("{} servers", config.server_names.len()),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:<16} {:<10} {}  {}",
            kind_name(resource.kind),
            status_name(resource.status),
            resource.source,
            detail
        );
        for (label, text) in [("error", &resource.error), ("warning", &resource.warning)] {
            if !text.is_empty() {
                let _ = writeln!(out, "      {label}: {text}");
            }
        }
    }
    out
}
