//! UpdateStartup: whether a startup overwrites the agent's run id, and the
//! event its commit publishes.

use ctxsync_proto::v1::{
    AgentState, DiscoveryChanged, StartupDropReason, StartupRequest, StartupResponse,
    discovery_changed::Cause, mcp_discovery::Phase,
};

/// The agent row as the store read it.
#[derive(Debug, Clone, Copy)]
pub struct StoredAgent<'a> {
    pub agent_run_id: &'a str,
    pub agent_version: &'a str,
}

/// What to do with a startup.
#[derive(Debug, Clone, PartialEq)]
pub enum StartupPlan {
    /// The current run announced again (live agents repeat it
    /// periodically): answered as is, nothing written, nothing published.
    Repeated(StartupResponse),
    /// A late or replayed startup of a run the agent moved away from:
    /// nothing written, nothing published; the response says why.
    Dropped(StartupResponse),
    /// Overwrite the agent row's run id and version.
    Write(StartupWrite),
}

/// A startup to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupWrite {
    /// The run id written (empty included).
    pub agent_run_id: String,
    /// The run id it replaces.
    pub previous_agent_run_id: String,
    pub run_id_changed: bool,
}

/// A startup the agent row already shows: answered without a write. A
/// reclaim always writes. Asked before the lock too, so a repeat never waits
/// for it.
pub fn repeated_startup(
    agent: StoredAgent<'_>,
    startup: &StartupRequest,
) -> Option<StartupResponse> {
    (!startup.reclaim
        && agent.agent_run_id == startup.agent_run_id
        && agent.agent_version == startup.agent_version)
        .then(|| StartupResponse {
            previous_agent_run_id: agent.agent_run_id.to_owned(),
            ..Default::default()
        })
}

/// Whether the plan depends on the startup's run being superseded: only
/// when the run id changes to a non-empty one (a legacy agent's empty run id
/// is never superseded). The store asks its superseded runs only then.
pub fn superseded_matters(agent: StoredAgent<'_>, startup: &StartupRequest) -> bool {
    agent.agent_run_id != startup.agent_run_id && !startup.agent_run_id.is_empty()
}

/// The decision over the agent row read under its lock. `superseded` says
/// whether the startup's run is one the agent already moved away from; it is
/// only read when [`superseded_matters`].
pub fn plan_startup(
    agent: StoredAgent<'_>,
    startup: &StartupRequest,
    superseded: bool,
) -> StartupPlan {
    if let Some(response) = repeated_startup(agent, startup) {
        return StartupPlan::Repeated(response);
    }
    let previous = agent.agent_run_id;
    if superseded_matters(agent, startup) && superseded && !startup.reclaim {
        return StartupPlan::Dropped(StartupResponse {
            previous_agent_run_id: previous.to_owned(),
            run_id_changed: false,
            drop_reason: StartupDropReason::SupersededRun as i32,
            message: format!(
                "run {:?} was already replaced by another run of this agent \
                 (now {previous:?}): the startup is late or replayed and changed nothing",
                startup.agent_run_id
            ),
        });
    }
    StartupPlan::Write(StartupWrite {
        agent_run_id: startup.agent_run_id.clone(),
        previous_agent_run_id: previous.to_owned(),
        run_id_changed: previous != startup.agent_run_id,
    })
}

impl StartupWrite {
    /// Whether the replaced run joins the superseded ones (and the new one
    /// leaves them, a reclaim): only when the run id changed.
    pub fn records_superseded(&self) -> bool {
        self.run_id_changed
    }

    /// Whether the commit publishes `DiscoveryChanged` (and so needs the
    /// state read under the lock): only when the run id changed.
    pub fn publishes(&self) -> bool {
        self.run_id_changed
    }

    pub fn response(&self) -> StartupResponse {
        StartupResponse {
            previous_agent_run_id: self.previous_agent_run_id.clone(),
            run_id_changed: self.run_id_changed,
            ..Default::default()
        }
    }

    /// The run-id-changed event, from `state`, the agent's state as this
    /// transaction commits it. A startup moves no phase: the phase before is
    /// the phase after, that of the stored snapshot (of whichever run).
    pub fn discovery_changed(
        &self,
        agent_id: &str,
        state: AgentState,
        committed_at: pbjson_types::Timestamp,
    ) -> DiscoveryChanged {
        let snapshot = state.snapshot.as_ref();
        let phase = snapshot.map_or(Phase::Unspecified as i32, |s| s.phase);
        DiscoveryChanged {
            agent_id: agent_id.to_owned(),
            cause: Cause::Startup as i32,
            agent_run_id: self.agent_run_id.clone(),
            previous_agent_run_id: self.previous_agent_run_id.clone(),
            has_snapshot: snapshot.is_some(),
            snapshot_agent_run_id: snapshot.map(|s| s.agent_run_id.clone()).unwrap_or_default(),
            phase,
            previous_phase: phase,
            snapshot_version: snapshot.map(|s| s.version).unwrap_or_default(),
            committed_at: Some(committed_at),
            revision: state.revision,
            state: Some(state),
        }
    }
}
