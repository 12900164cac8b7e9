//! The chat projection: what a chat may use of an agent's committed snapshot.
//!
//! Freshness is the run id comparison alone (timestamps come from different
//! clocks): a snapshot describes the running process only when its run id
//! equals the agent row's. Tools of any other snapshot are withheld; PENDING
//! does not withhold tools, it only says the list may still grow.

use std::fmt::Write as _;

use ctxsync_proto::v1::{
    AgentState, CatalogSection, ChatProjection, ContextResource, DisabledServer, FailedServer,
    GateDecision, InvalidConfigFile, ProjectedInstructionFile, ProjectedServer, ProjectedSkill,
    ProjectedTool, ProjectionCounts, ResourceKind, ResourceStatus, catalog_section,
    context_resource::Body, mcp_discovery::Phase,
};

/// Separates a server's name from its tool's in the names offered to a model.
pub const TOOL_NAME_SEPARATOR: &str = "__";

/// How ready an agent's state is for a first turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The agent row has no run id, or the current run reports no phase: nothing to wait for.
    Legacy,
    /// The current run's discovery is COMPLETE.
    Ready,
    /// The current run's discovery is PENDING.
    Pending,
    /// The current run has not reported (no snapshot at all).
    NoSnapshot,
    /// Only another run's snapshot exists.
    Stale,
}

impl Readiness {
    pub fn of(state: &AgentState) -> Self {
        let agent_run_id = state
            .agent
            .as_ref()
            .map(|a| a.agent_run_id.as_str())
            .unwrap_or_default();
        if agent_run_id.is_empty() {
            return Self::Legacy;
        }
        match &state.snapshot {
            None => Self::NoSnapshot,
            Some(snapshot) if snapshot.agent_run_id != agent_run_id => Self::Stale,
            Some(snapshot) => match snapshot.phase() {
                Phase::Complete => Self::Ready,
                Phase::Pending => Self::Pending,
                // A run id without a phase gives no completeness guarantee.
                Phase::Unspecified => Self::Legacy,
            },
        }
    }

    /// The answer for a wait that ended in this state (at its deadline unless it ends waits).
    pub fn decision(self) -> GateDecision {
        match self {
            Self::Ready => GateDecision::Ready,
            Self::Legacy => GateDecision::Legacy,
            Self::Pending => GateDecision::TimedOutPending,
            Self::NoSnapshot => GateDecision::TimedOutNoSnapshot,
            Self::Stale => GateDecision::TimedOutStale,
        }
    }

    /// Whether a first turn stops waiting in this state.
    pub fn ends_wait(self) -> bool {
        matches!(self, Self::Ready | Self::Legacy)
    }
}

/// A snapshot is stale when it was produced by another process than the one
/// the agent row names (empty run ids included: both empty is the legacy case).
pub fn is_stale(state: &AgentState) -> bool {
    match (&state.agent, &state.snapshot) {
        (Some(agent), Some(snapshot)) => agent.agent_run_id != snapshot.agent_run_id,
        (None, Some(_)) => true,
        _ => false,
    }
}

fn is_ok(resource: &ContextResource) -> bool {
    resource.status() == ResourceStatus::Ok
}

/// Projects a state read from the store; `summary` is filled by [`finish`].
pub fn build(agent_id: &str, state: &AgentState) -> ChatProjection {
    let agent_run_id = state
        .agent
        .as_ref()
        .map(|a| a.agent_run_id.clone())
        .unwrap_or_default();
    let stale = is_stale(state);
    let mut projection = ChatProjection {
        agent_id: agent_id.to_owned(),
        agent_run_id: agent_run_id.clone(),
        stale,
        catalog: Some(CatalogSection {
            status: catalog_section::Status::NotRequested as i32,
            ..Default::default()
        }),
        ..Default::default()
    };
    if let Some(snapshot) = &state.snapshot {
        projection.has_snapshot = true;
        projection.snapshot_agent_run_id = snapshot.agent_run_id.clone();
        projection.snapshot_version = snapshot.version;
        projection.snapshot_hash = snapshot.hash.clone();
        projection.snapshot_phase = snapshot.phase;
        if !stale && !agent_run_id.is_empty() {
            projection.phase = snapshot.phase;
        }
    }

    let mut counts = ProjectionCounts::default();
    for resource in &state.resources {
        match (resource.kind(), &resource.body) {
            (ResourceKind::McpServer, Some(Body::McpServer(server))) if is_ok(resource) => {
                let tool_count = server.tools.len() as u32;
                if tool_count == 0 {
                    counts.servers_zero_tools += 1;
                } else {
                    counts.servers_ok += 1;
                }
                let tools: Vec<ProjectedTool> = if stale {
                    counts.tools_withheld += tool_count;
                    Vec::new()
                } else {
                    counts.tools += tool_count;
                    server
                        .tools
                        .iter()
                        .map(|tool| ProjectedTool {
                            name: format!("{}{TOOL_NAME_SEPARATOR}{}", server.name, tool.name),
                            server: server.name.clone(),
                            tool: tool.name.clone(),
                            description: tool.description.clone(),
                            input_schema_json: tool.input_schema_json.clone(),
                        })
                        .collect()
                };
                projection.servers.push(ProjectedServer {
                    name: server.name.clone(),
                    transport: server.transport,
                    config_path: server.config_path.clone(),
                    tools,
                    tools_withheld: if stale { tool_count } else { 0 },
                    warning: resource.warning.clone(),
                });
            }
            // Disabled in its config file: not started, and not a failure.
            (ResourceKind::McpServer, body) if resource.status() == ResourceStatus::Disabled => {
                counts.servers_disabled += 1;
                let (name, config_path) = match body {
                    Some(Body::McpServer(server)) => {
                        (server.name.clone(), server.config_path.clone())
                    }
                    _ => (source_name(&resource.source), String::new()),
                };
                projection
                    .disabled_servers
                    .push(DisabledServer { name, config_path });
            }
            (ResourceKind::McpServer, body) => {
                counts.servers_failed += 1;
                let (name, config_path) = match body {
                    Some(Body::McpServer(server)) => {
                        (server.name.clone(), server.config_path.clone())
                    }
                    _ => (source_name(&resource.source), String::new()),
                };
                projection.failed_servers.push(FailedServer {
                    name,
                    config_path,
                    status: resource.status,
                    error: resource.error.clone(),
                });
            }
            (ResourceKind::McpConfig, body) if !is_ok(resource) => {
                counts.invalid_config_files += 1;
                let path = match body {
                    Some(Body::McpConfig(config)) => config.path.clone(),
                    _ => source_name(&resource.source),
                };
                projection.invalid_config_files.push(InvalidConfigFile {
                    path,
                    status: resource.status,
                    error: resource.error.clone(),
                });
            }
            (ResourceKind::InstructionFile, Some(Body::InstructionFile(file)))
                if matches!(
                    resource.status(),
                    ResourceStatus::Ok | ResourceStatus::Oversize
                ) =>
            {
                counts.instruction_files += 1;
                projection.instruction_files.push(ProjectedInstructionFile {
                    path: file.path.clone(),
                    content: file.content.clone(),
                    truncated: file.truncated || resource.status() == ResourceStatus::Oversize,
                });
            }
            (ResourceKind::Skill, Some(Body::Skill(skill))) if is_ok(resource) => {
                counts.skills += 1;
                projection.skills.push(ProjectedSkill {
                    name: skill.name.clone(),
                    description: skill.description.clone(),
                    dir: skill.dir.clone(),
                });
            }
            _ => {}
        }
    }
    projection.counts = Some(counts);
    projection
}

/// `"mcp_server:github"` → `"github"`.
fn source_name(source: &str) -> String {
    source
        .split_once(':')
        .map_or(source, |(_, rest)| rest)
        .to_owned()
}

/// A projection for a turn the drain cut short before the agent's state was known.
pub fn shutting_down(agent_id: &str, waited_ms: u32) -> ChatProjection {
    ChatProjection {
        agent_id: agent_id.to_owned(),
        counts: Some(ProjectionCounts::default()),
        catalog: Some(CatalogSection {
            status: catalog_section::Status::NotRequested as i32,
            ..Default::default()
        }),
        summary: format!(
            "This chat-gate replica is shutting down and stopped after {waited_ms} ms, before \
             the agent's context was read. Ask again: another replica answers."
        ),
        ..Default::default()
    }
}

/// A projection for a turn that proceeds without the store's state.
pub fn unavailable(agent_id: &str, reason: &str) -> ChatProjection {
    let mut projection = ChatProjection {
        agent_id: agent_id.to_owned(),
        store_error: reason.to_owned(),
        counts: Some(ProjectionCounts::default()),
        catalog: Some(CatalogSection {
            status: catalog_section::Status::NotRequested as i32,
            ..Default::default()
        }),
        ..Default::default()
    };
    finish(&mut projection, GateDecision::StoreUnavailable, 0);
    projection
}

fn plural(n: u32, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// Sets the timed-out flag and writes the summary for the decision made.
///
/// The wording states what was reported and what was not; it never claims a
/// server works now (a listed tool may still fail when called).
pub fn finish(projection: &mut ChatProjection, decision: GateDecision, waited_ms: u32) {
    describe(projection, decision, waited_ms);
    if decision == GateDecision::ShuttingDown {
        projection.summary.insert_str(
            0,
            &format!(
                "This chat-gate replica is shutting down and stopped waiting after {waited_ms} ms, \
                 before the wait ended: ask again, another replica answers. What it had: "
            ),
        );
    }
}

fn describe(projection: &mut ChatProjection, decision: GateDecision, waited_ms: u32) {
    projection.wait_timed_out = matches!(
        decision,
        GateDecision::TimedOutPending
            | GateDecision::TimedOutNoSnapshot
            | GateDecision::TimedOutStale
    );
    let counts = projection.counts.unwrap_or_default();
    let mut s = String::new();

    if decision == GateDecision::StoreUnavailable {
        let _ = write!(
            s,
            "The workspace context could not be read ({}). This turn proceeds without \
             workspace tools, instructions or skills.",
            projection.store_error
        );
        projection.summary = s;
        return;
    }

    // Completeness first: it qualifies everything after it.
    if !projection.has_snapshot {
        s.push_str("The workspace agent has not reported its context yet: no workspace tools, instructions or skills are available.");
        if projection.wait_timed_out {
            let _ = write!(s, " Waited {waited_ms} ms for the report.");
        }
        projection.summary = s;
        return;
    }
    if projection.stale {
        let _ = write!(
            s,
            "The stored workspace context was reported by a previous agent process, not the one running now: its {} withheld.",
            plural(counts.tools_withheld, "tool is", "tools are")
        );
        if projection.wait_timed_out {
            let _ = write!(
                s,
                " Waited {waited_ms} ms for the current process to report."
            );
        }
    } else if projection.agent_run_id.is_empty() || projection.phase == Phase::Unspecified as i32 {
        s.push_str("The workspace agent does not report whether MCP discovery has finished: the tools below are what it last reported.");
    } else if projection.phase == Phase::Pending as i32 {
        if projection.wait_timed_out {
            let _ = write!(
                s,
                "MCP discovery had not finished after waiting {waited_ms} ms: the tools below may be incomplete."
            );
        } else {
            s.push_str("MCP discovery is still running: the tools below may be incomplete.");
        }
    } else {
        s.push_str("MCP discovery has finished for the running agent process.");
    }

    // Per-source outcomes.
    let listed: Vec<String> = projection
        .servers
        .iter()
        .filter(|server| server.tools.len() as u32 + server.tools_withheld > 0)
        .map(|server| {
            let n = server.tools.len() as u32 + server.tools_withheld;
            format!("{} ({})", server.name, plural(n, "tool", "tools"))
        })
        .collect();
    if !listed.is_empty() {
        let _ = write!(
            s,
            " {} listed tools: {}.",
            plural(counts.servers_ok, "MCP server", "MCP servers"),
            listed.join(", ")
        );
    }
    if counts.servers_zero_tools > 0 {
        let names: Vec<&str> = projection
            .servers
            .iter()
            .filter(|server| server.tools.is_empty() && server.tools_withheld == 0)
            .map(|server| server.name.as_str())
            .collect();
        let _ = write!(
            s,
            " {} listed no tools: {}.",
            plural(counts.servers_zero_tools, "MCP server", "MCP servers"),
            names.join(", ")
        );
    }
    if counts.servers_failed > 0 {
        let names: Vec<&str> = projection
            .failed_servers
            .iter()
            .map(|server| server.name.as_str())
            .collect();
        let _ = write!(
            s,
            " {} could not be used: {} (see the errors).",
            plural(counts.servers_failed, "MCP server", "MCP servers"),
            names.join(", ")
        );
    }
    if counts.servers_disabled > 0 {
        let names: Vec<&str> = projection
            .disabled_servers
            .iter()
            .map(|server| server.name.as_str())
            .collect();
        let _ = write!(
            s,
            " {} disabled in {} config: {}.",
            plural(counts.servers_disabled, "MCP server is", "MCP servers are"),
            if counts.servers_disabled == 1 {
                "its"
            } else {
                "their"
            },
            names.join(", ")
        );
    }
    if counts.invalid_config_files > 0 {
        let paths: Vec<&str> = projection
            .invalid_config_files
            .iter()
            .map(|file| file.path.as_str())
            .collect();
        let _ = write!(
            s,
            " {} could not be used: {}.",
            plural(
                counts.invalid_config_files,
                "MCP config file",
                "MCP config files"
            ),
            paths.join(", ")
        );
    }
    if counts.servers_ok
        + counts.servers_zero_tools
        + counts.servers_failed
        + counts.servers_disabled
        == 0
    {
        s.push_str(" No MCP servers were reported.");
    }
    let _ = write!(
        s,
        " {} and {} are available.",
        plural(
            counts.instruction_files,
            "instruction file",
            "instruction files"
        ),
        plural(counts.skills, "skill", "skills")
    );
    projection.summary = s;
}

/// Adds the tenant's catalog section and says in the summary what it holds.
pub fn add_catalog(projection: &mut ChatProjection, section: CatalogSection) {
    let mut sentence = String::new();
    match section.status() {
        catalog_section::Status::Ready => {
            let usable: Vec<_> = section
                .pins
                .iter()
                .filter(|p| p.source() != ctxsync_proto::v1::catalog_pin::Source::Failed)
                .collect();
            let tools: usize = usable.iter().map(|p| p.tools.len()).sum();
            let failed = section.pins.len() - usable.len();
            let _ = write!(
                sentence,
                " The operator's catalog offers {} with {} (servers start on first use).",
                plural(usable.len() as u32, "server", "servers"),
                plural(tools as u32, "tool", "tools")
            );
            if failed > 0 {
                let _ = write!(
                    sentence,
                    " {} of the catalog could not be discovered.",
                    plural(failed as u32, "server", "servers")
                );
            }
        }
        catalog_section::Status::Failed => {
            let _ = write!(
                sentence,
                " The operator's catalog is unavailable for this turn ({}).",
                section.error
            );
        }
        _ => {}
    }
    projection.summary.push_str(&sentence);
    projection.catalog = Some(section);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ctxsync_proto::v1::{Agent, McpServer, McpTool, Snapshot};

    fn state(agent_run: &str, snapshot_run: Option<&str>, phase: Phase) -> AgentState {
        AgentState {
            agent: Some(Agent {
                agent_run_id: agent_run.into(),
                ..Default::default()
            }),
            snapshot: snapshot_run.map(|run| Snapshot {
                agent_run_id: run.into(),
                phase: phase as i32,
                ..Default::default()
            }),
            resources: vec![ContextResource {
                source: "mcp_server:s".into(),
                kind: ResourceKind::McpServer as i32,
                status: ResourceStatus::Ok as i32,
                body: Some(Body::McpServer(McpServer {
                    name: "s".into(),
                    tools: vec![McpTool {
                        name: "t".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                })),
                ..Default::default()
            }],
            revision: 1,
        }
    }

    #[test]
    fn readiness_follows_the_run_id_comparison() {
        assert_eq!(
            Readiness::of(&state("", Some("r"), Phase::Complete)),
            Readiness::Legacy
        );
        assert_eq!(
            Readiness::of(&state("r", None, Phase::Complete)),
            Readiness::NoSnapshot
        );
        assert_eq!(
            Readiness::of(&state("r", Some(""), Phase::Complete)),
            Readiness::Stale
        );
        assert_eq!(
            Readiness::of(&state("r", Some("r"), Phase::Pending)),
            Readiness::Pending
        );
        assert_eq!(
            Readiness::of(&state("r", Some("r"), Phase::Complete)),
            Readiness::Ready
        );
    }

    #[test]
    fn stale_tools_are_withheld_and_pending_ones_are_not() {
        let stale = build("a", &state("r2", Some("r1"), Phase::Complete));
        assert!(stale.stale);
        assert!(stale.servers[0].tools.is_empty());
        assert_eq!(stale.counts.unwrap().tools_withheld, 1);

        let pending = build("a", &state("r", Some("r"), Phase::Pending));
        assert!(!pending.stale);
        assert_eq!(pending.servers[0].tools[0].name, "s__t");
    }

    #[test]
    fn a_disabled_server_is_listed_apart_and_never_counted_failed() {
        let mut state = state("r", Some("r"), Phase::Complete);
        state.resources.push(ContextResource {
            source: "mcp_server:off".into(),
            kind: ResourceKind::McpServer as i32,
            status: ResourceStatus::Disabled as i32,
            body: Some(Body::McpServer(McpServer {
                name: "off".into(),
                config_path: "/w/.roo/mcp.json".into(),
                ..Default::default()
            })),
            ..Default::default()
        });
        let mut projection = build("a", &state);
        finish(&mut projection, GateDecision::Ready, 0);
        let counts = projection.counts.unwrap();
        assert_eq!(
            (
                counts.servers_ok,
                counts.servers_failed,
                counts.servers_disabled
            ),
            (1, 0, 1)
        );
        assert!(projection.failed_servers.is_empty());
        assert_eq!(
            projection.disabled_servers,
            [DisabledServer {
                name: "off".into(),
                config_path: "/w/.roo/mcp.json".into()
            }]
        );
        assert!(
            projection
                .summary
                .contains(" 1 MCP server is disabled in its config: off."),
            "{}",
            projection.summary
        );
    }
}
