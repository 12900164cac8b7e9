//! PushContextState: whether a push is written, what of it, and the events
//! its commit publishes.

use ctxsync_proto::v1::{
    Agent, AgentState, ContextConfig, ContextResource, DiscoveryChanged, PushContextStateRequest,
    PushDropReason, Snapshot, SnapshotCommitted, discovery_changed::Cause, mcp_discovery::Phase,
};

use crate::content::{PushContent, phase_rank};

/// The agent's snapshot as the store read it under the agent's lock.
#[derive(Debug, Clone, Copy)]
pub struct StoredSnapshot<'a> {
    pub agent_run_id: &'a str,
    pub version: u64,
    pub phase: Phase,
    pub hash: &'a str,
}

/// What to do with a push.
#[derive(Debug, Clone, PartialEq)]
pub enum PushPlan {
    /// Nothing written, nothing published; the answer says why.
    Dropped {
        reason: PushDropReason,
        message: String,
    },
    /// Write the snapshot row (always: its version and receive time move).
    Write(PushWrite),
}

/// An accepted push: what is written, and what the events will say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushWrite {
    /// Whether the resources are replaced: only when the content hash
    /// changed (the stored ones are the push's otherwise).
    pub rewrites_resources: bool,
    /// The agent's current run (the agent row's).
    agent_run_id: String,
    snapshot_agent_run_id: String,
    version: u64,
    phase: Phase,
    hash: String,
    /// The stored snapshot's run and phase, if there was one.
    before: Option<(String, Phase)>,
}

/// The decision over what the store read under the agent's lock: the agent
/// row's run id and the stored snapshot, if any.
pub fn plan_push(
    agent_run_id: &str,
    stored: Option<StoredSnapshot<'_>>,
    push: &PushContextStateRequest,
    content: &PushContent,
) -> PushPlan {
    // A non-empty agent row names the current process: anything else is
    // from a previous one (an empty push run id included).
    if !agent_run_id.is_empty() && push.agent_run_id != agent_run_id {
        return PushPlan::Dropped {
            reason: PushDropReason::StaleRun,
            message: format!(
                "push from agent run {:?} but the agent's current run is {agent_run_id:?}",
                push.agent_run_id
            ),
        };
    }
    // Within a run, versions only move forward and so does the phase. A
    // new process starts over with its own run id, so `initial` is only
    // the first push of a run, never a reset: a late or replayed first
    // push of the running process is an old version like any other.
    let same_run =
        stored.filter(|s| !agent_run_id.is_empty() && s.agent_run_id == push.agent_run_id);
    if let Some(stored) = same_run {
        if push.version <= stored.version {
            return PushPlan::Dropped {
                reason: PushDropReason::StaleVersion,
                message: format!(
                    "version {} is not above the stored version {} of this run",
                    push.version, stored.version
                ),
            };
        }
        if phase_rank(content.phase) < phase_rank(stored.phase) {
            return PushPlan::Dropped {
                reason: PushDropReason::PhaseRegression,
                message: format!(
                    "phase {} would move this run back from {}",
                    content.phase.as_str_name(),
                    stored.phase.as_str_name()
                ),
            };
        }
    }
    PushPlan::Write(PushWrite {
        rewrites_resources: stored.is_none_or(|s| s.hash != content.hash),
        agent_run_id: agent_run_id.to_owned(),
        snapshot_agent_run_id: push.agent_run_id.clone(),
        version: push.version,
        phase: content.phase,
        hash: content.hash.clone(),
        before: stored.map(|s| (s.agent_run_id.to_owned(), s.phase)),
    })
}

impl PushWrite {
    /// The phase-or-run-id-changed event, if either changed (a first
    /// snapshot changes both), without the state (the publisher attaches it).
    pub fn discovery_changed(
        &self,
        agent_id: &str,
        revision: u64,
        committed_at: pbjson_types::Timestamp,
    ) -> Option<DiscoveryChanged> {
        let changed = self.before.as_ref().is_none_or(|(run_id, phase)| {
            *phase != self.phase || *run_id != self.snapshot_agent_run_id
        });
        changed.then(|| DiscoveryChanged {
            agent_id: agent_id.to_owned(),
            cause: Cause::Push as i32,
            agent_run_id: self.agent_run_id.clone(),
            previous_agent_run_id: self.agent_run_id.clone(),
            has_snapshot: true,
            snapshot_agent_run_id: self.snapshot_agent_run_id.clone(),
            phase: self.phase as i32,
            previous_phase: self.before.as_ref().map_or(Phase::Unspecified, |b| b.1) as i32,
            snapshot_version: self.version,
            committed_at: Some(committed_at),
            revision,
            state: None,
        })
    }

    /// The every-push event, unchanged content included: its version and
    /// receive time still changed, and watchers show those. Without the
    /// state (the publisher attaches it).
    pub fn snapshot_committed(
        &self,
        agent_id: &str,
        revision: u64,
        committed_at: pbjson_types::Timestamp,
    ) -> SnapshotCommitted {
        SnapshotCommitted {
            agent_id: agent_id.to_owned(),
            agent_run_id: self.snapshot_agent_run_id.clone(),
            version: self.version,
            phase: self.phase as i32,
            hash: self.hash.clone(),
            committed_at: Some(committed_at),
            revision,
            state: None,
        }
    }

    /// What a read right after the commit returns, built from what the
    /// transaction wrote (no read): the agent row as the lock returned it,
    /// the snapshot as stored, and the push's resources, which are the
    /// stored ones also when unchanged (same hash).
    pub fn state(
        self,
        agent: Agent,
        revision: u64,
        context_config: ContextConfig,
        resources: Vec<ContextResource>,
        received_at: pbjson_types::Timestamp,
    ) -> AgentState {
        AgentState {
            agent: Some(agent),
            snapshot: Some(Snapshot {
                agent_run_id: self.snapshot_agent_run_id,
                version: self.version,
                phase: self.phase as i32,
                hash: self.hash,
                received_at: Some(received_at),
                context_config: Some(context_config),
            }),
            resources,
            revision,
        }
    }
}
