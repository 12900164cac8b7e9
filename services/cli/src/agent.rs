//! `ctxsync agent register` and `ctxsync agent show`.

use std::fmt::Write as _;
use std::time::Duration;

use base64::Engine;
use ctxsync_proto::subjects::Subjects;
use std::path::Path;

use ctxsync_proto::v1::{
    AgentState, RegisterAgentRequest, ResourceKind, ResourceStatus, RotateAgentTokenRequest,
    context_resource::Body, service_error::Code,
};
use ctxsync_runtime::rpc;
use ctxsync_runtime::store::StoreClient;
use rand::RngCore;
use sha2::Digest;

#[derive(Debug, thiserror::Error)]
pub enum AgentCommandError {
    #[error(transparent)]
    Rpc(rpc::RpcError),
    /// Nothing answers the store's subject: the operator's next step.
    #[error(
        "snapshot-store is not running (nothing answers on {subject}): start it (or `ctxsync up`), \
         and check that NATS_URL and CTXSYNC_SUBJECT_PREFIX are the services' own"
    )]
    StoreNotRunning { subject: String },
    #[error("snapshot-store refused: {0}")]
    Store(String),
    #[error("snapshot-store refused: {0}")]
    Exists(String),
    #[error("token file {path}: {reason}")]
    TokenFile { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
}

impl From<rpc::RpcError> for AgentCommandError {
    fn from(error: rpc::RpcError) -> Self {
        match error {
            rpc::RpcError::NoResponders { subject } => Self::StoreNotRunning { subject },
            rpc::RpcError::Service {
                code: Code::AlreadyExists,
                message,
                ..
            } => Self::Exists(message),
            rpc::RpcError::Service { message, .. } => Self::Store(message),
            error => Self::Rpc(error),
        }
    }
}

/// A new agent's id and its token (shown once; the store keeps only its hash).
#[derive(Debug)]
pub struct Registered {
    pub agent_id: String,
    pub token: String,
}

impl Registered {
    /// What `--json` prints.
    pub fn to_proto(&self) -> ctxsync_proto::v1::AgentRegistered {
        ctxsync_proto::v1::AgentRegistered {
            agent_id: self.agent_id.clone(),
            token: self.token.clone(),
        }
    }
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
    let agent_id = StoreClient::new(nats.clone(), subjects, timeout)
        .register_agent(RegisterAgentRequest {
            tenant: tenant.into(),
            workspace: workspace.into(),
            name: name.into(),
            token_sha256: sha2::Sha256::digest(token.as_bytes()).to_vec(),
        })
        .await?;
    Ok(Registered { agent_id, token })
}

/// What `register --token-file` does when the agent exists already.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IfExists {
    /// Refuse (nothing is written).
    Fail,
    /// Keep the agent: reuse the token file when it holds the agent's valid
    /// token, otherwise give the agent a new token (written to the file).
    Keep,
    /// Give the existing agent a new token; the old one stops working.
    Rotate,
}

/// What `register --token-file` did.
#[derive(Debug)]
pub struct RegisteredToFile {
    pub agent_id: String,
    pub token_file: String,
    /// `registered`, `kept` (the file's token was valid) or `rotated`.
    pub outcome: &'static str,
}

impl RegisteredToFile {
    /// What `--json` prints.
    pub fn to_proto(&self) -> ctxsync_proto::v1::AgentTokenFileWritten {
        use ctxsync_proto::v1::agent_token_file_written::Outcome;
        let outcome = match self.outcome {
            "registered" => Outcome::Registered,
            "kept" => Outcome::Kept,
            "rotated" => Outcome::Rotated,
            _ => Outcome::Unspecified,
        };
        ctxsync_proto::v1::AgentTokenFileWritten {
            agent_id: self.agent_id.clone(),
            token_file: self.token_file.clone(),
            outcome: outcome as i32,
        }
    }
}

fn token_file_error(path: &Path, reason: impl std::fmt::Display) -> AgentCommandError {
    AgentCommandError::TokenFile {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// Writes the token next to `path` and renames it into place (mode 0600), so
/// the file holds either the old token or the whole new one, never less.
fn write_token_file(path: &Path, token: &str) -> Result<(), AgentCommandError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let temporary = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("token"),
        std::process::id()
    ));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)
        .and_then(|mut file| {
            file.write_all(token.as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temporary, path));
    if let Err(error) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(token_file_error(path, error));
    }
    Ok(())
}

/// The agent the token in `path` belongs to, if the file holds a valid token
/// of the agent named `tenant/workspace/name`.
async fn valid_token_in(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    path: &Path,
    (tenant, workspace, name): (&str, &str, &str),
) -> Result<Option<String>, AgentCommandError> {
    let token = match std::fs::read_to_string(path) {
        Ok(token) => token.trim().to_owned(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(token_file_error(path, error)),
    };
    if token.is_empty() {
        return Ok(None);
    }
    let Some(agent_id) = StoreClient::new(nats.clone(), subjects, timeout)
        .authenticate_agent(sha2::Sha256::digest(token.as_bytes()).to_vec())
        .await?
    else {
        return Ok(None);
    };
    let state = show(nats, subjects, timeout, &agent_id).await?;
    let agent = state.agent.unwrap_or_default();
    let same = (
        agent.tenant.as_str(),
        agent.workspace.as_str(),
        agent.name.as_str(),
    ) == (tenant, workspace, name);
    Ok(same.then_some(agent_id))
}

/// `register --token-file`: the token goes to `path`, never to the output.
/// Checks the file can be written before anything is registered.
#[allow(clippy::too_many_arguments)]
pub async fn register_to_file(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    tenant: &str,
    workspace: &str,
    name: &str,
    path: &Path,
    if_exists: IfExists,
) -> Result<RegisteredToFile, AgentCommandError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(token_file_error(path, "its directory does not exist"));
    }
    if path.is_dir() {
        return Err(token_file_error(path, "is a directory"));
    }
    let done = |agent_id: String, outcome| RegisteredToFile {
        agent_id,
        token_file: path.display().to_string(),
        outcome,
    };
    let who = (tenant, workspace, name);
    if if_exists == IfExists::Keep
        && let Some(agent_id) = valid_token_in(nats, subjects, timeout, path, who).await?
    {
        return Ok(done(agent_id, "kept"));
    }
    match register(nats, subjects, timeout, tenant, workspace, name).await {
        Ok(registered) => {
            write_token_file(path, &registered.token)?;
            Ok(done(registered.agent_id, "registered"))
        }
        Err(AgentCommandError::Exists(message)) if if_exists == IfExists::Fail => {
            Err(AgentCommandError::Exists(format!(
                "{message} (--if-exists keep reuses it, --if-exists rotate gives it a new token)"
            )))
        }
        Err(AgentCommandError::Exists(_)) => {
            let token = new_token();
            let agent_id = StoreClient::new(nats.clone(), subjects, timeout)
                .rotate_agent_token(RotateAgentTokenRequest {
                    tenant: tenant.into(),
                    workspace: workspace.into(),
                    name: name.into(),
                    token_sha256: sha2::Sha256::digest(token.as_bytes()).to_vec(),
                })
                .await?;
            write_token_file(path, &token)?;
            Ok(done(agent_id, "rotated"))
        }
        Err(error) => Err(error),
    }
}

pub async fn show(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    agent_id: &str,
) -> Result<AgentState, AgentCommandError> {
    let state = StoreClient::new(nats.clone(), subjects, timeout)
        .agent_state(agent_id)
        .await?;
    Ok(state)
}

fn status_name(status: i32) -> &'static str {
    match ResourceStatus::try_from(status).unwrap_or_default() {
        ResourceStatus::Ok => "ok",
        ResourceStatus::Invalid => "invalid",
        ResourceStatus::Unreadable => "unreadable",
        ResourceStatus::Oversize => "oversize",
        ResourceStatus::Excluded => "excluded",
        ResourceStatus::Disabled => "disabled",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(code: Code) -> rpc::RpcError {
        rpc::RpcError::Service {
            subject: "p.store.agent.register".into(),
            code,
            message: "an agent named \"a\" already exists in t/w".into(),
            reason: String::new(),
        }
    }

    #[test]
    fn an_existing_agent_is_told_apart_by_its_code() {
        assert!(matches!(
            AgentCommandError::from(refusal(Code::AlreadyExists)),
            AgentCommandError::Exists(_)
        ));
        let other = AgentCommandError::from(refusal(Code::InvalidArgument));
        assert!(matches!(other, AgentCommandError::Store(_)), "{other:?}");
        assert_eq!(
            other.to_string(),
            "snapshot-store refused: an agent named \"a\" already exists in t/w"
        );
        let missing = AgentCommandError::from(rpc::RpcError::NoResponders {
            subject: "p.store.agent.register".into(),
        });
        assert!(matches!(missing, AgentCommandError::StoreNotRunning { .. }));
    }
}
