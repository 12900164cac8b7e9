//! Builders of the discovery report an agent pushes: resources and pushes,
//! as the services' tests write them.

use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;

/// The SHA-256 of a token, as the store keeps it.
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

pub fn skill(dir: &str, name: &str, description: &str) -> ContextResource {
    ContextResource {
        source: format!("skill:{dir}"),
        kind: ResourceKind::Skill as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(context_resource::Body::Skill(Skill {
            dir: dir.into(),
            name: name.into(),
            description: description.into(),
        })),
        ..Default::default()
    }
}

/// The input schema every tool of [`server`] declares: an object with no properties.
pub const EMPTY_OBJECT_SCHEMA: &str = r#"{"type":"object"}"#;

/// A stdio MCP server in `/w/.mcp.json` listing `tools`, each described as
/// "the <tool> tool" with [`EMPTY_OBJECT_SCHEMA`].
pub fn server(name: &str, tools: &[&str]) -> ContextResource {
    server_with_schema(name, tools, EMPTY_OBJECT_SCHEMA)
}

/// Like [`server`], every tool declaring `input_schema_json`.
pub fn server_with_schema(name: &str, tools: &[&str], input_schema_json: &str) -> ContextResource {
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
                    input_schema_json: input_schema_json.into(),
                })
                .collect(),
        })),
        ..Default::default()
    }
}

/// A stdio MCP server that could not be used, with its (sanitized) error.
pub fn failed_server(name: &str, error: &str) -> ContextResource {
    ContextResource {
        status: ResourceStatus::Unreadable as i32,
        error: error.into(),
        ..server(name, &[])
    }
}

/// An MCP config file that does not parse.
pub fn invalid_config(path: &str, error: &str) -> ContextResource {
    ContextResource {
        source: format!("mcp_config:{path}"),
        kind: ResourceKind::McpConfig as i32,
        status: ResourceStatus::Invalid as i32,
        error: error.into(),
        body: Some(context_resource::Body::McpConfig(McpConfig {
            path: path.into(),
            server_names: vec![],
        })),
        ..Default::default()
    }
}

/// A push of `run_id` at `version`, from working dir `/w`; `phase: None` is a
/// push without a discovery message (a legacy agent).
pub fn push(
    run_id: &str,
    version: u64,
    initial: bool,
    phase: Option<Phase>,
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

/// A push while discovery is still running; version 1 is the run's initial push.
pub fn pending(
    run_id: &str,
    version: u64,
    resources: Vec<ContextResource>,
) -> PushContextStateRequest {
    in_phase(Phase::Pending, run_id, version, resources)
}

/// A push once discovery has finished; version 1 is the run's initial push.
pub fn complete(
    run_id: &str,
    version: u64,
    resources: Vec<ContextResource>,
) -> PushContextStateRequest {
    in_phase(Phase::Complete, run_id, version, resources)
}

fn in_phase(
    phase: Phase,
    run_id: &str,
    version: u64,
    resources: Vec<ContextResource>,
) -> PushContextStateRequest {
    push(run_id, version, version == 1, Some(phase), resources)
}

/// The sources of a state's resources, in the store's order.
pub fn sources(state: &AgentState) -> Vec<String> {
    state.resources.iter().map(|r| r.source.clone()).collect()
}
