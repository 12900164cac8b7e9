//! Validation of what agents send, shared by agent-ingest (which answers 400)
//! and snapshot-store (which refuses the request): every limit has a name.

use std::collections::HashSet;

use prost::Message;

use crate::limits::*;
use crate::v1::{
    ContextConfig, ContextResource, McpTransport, PushContextStateRequest, ResourceKind,
    ResourceStatus, StartupRequest, context_resource::Body, mcp_discovery,
};

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// A size or count limit was exceeded.
    #[error("{field} is {actual} {unit}, over the limit of {max} ({limit})")]
    Limit {
        limit: &'static str,
        field: String,
        actual: usize,
        max: usize,
        unit: &'static str,
    },
    /// A field holds a value the contract does not allow.
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
}

impl ValidationError {
    /// The limit's name, for errors that exceeded one.
    pub fn limit(&self) -> Option<&'static str> {
        match self {
            Self::Limit { limit, .. } => Some(limit),
            Self::Invalid { .. } => None,
        }
    }
}

fn check_len(
    limit: &'static str,
    field: impl FnOnce() -> String,
    actual: usize,
    max: usize,
    unit: &'static str,
) -> Result<(), ValidationError> {
    if actual > max {
        return Err(ValidationError::Limit {
            limit,
            field: field(),
            actual,
            max,
            unit,
        });
    }
    Ok(())
}

/// Refuses U+0000 in `value`: Postgres `text` cannot hold it, so it would
/// fail every write that carries it. `field` names the exact place.
pub fn no_nul(field: impl FnOnce() -> String, value: &str) -> Result<(), ValidationError> {
    match value.find('\0') {
        None => Ok(()),
        Some(at) => Err(ValidationError::Invalid {
            field: field(),
            reason: format!("contains U+0000 (NUL) at byte {at}; text may not hold NUL"),
        }),
    }
}

/// [`no_nul`] over every element of a repeated string field.
fn no_nul_in(field: impl Fn() -> String, values: &[String]) -> Result<(), ValidationError> {
    for (index, value) in values.iter().enumerate() {
        no_nul(|| format!("{}[{index}]", field()), value)?;
    }
    Ok(())
}

fn check_run_id(run_id: &str) -> Result<(), ValidationError> {
    check_len(
        "agent_run_id_bytes",
        || "agent_run_id".into(),
        run_id.len(),
        MAX_RUN_ID_BYTES,
        "bytes",
    )?;
    no_nul(|| "agent_run_id".into(), run_id)
}

pub fn startup(request: &StartupRequest) -> Result<(), ValidationError> {
    check_run_id(&request.agent_run_id)?;
    if request.reclaim && request.agent_run_id.is_empty() {
        return Err(ValidationError::Invalid {
            field: "reclaim".into(),
            reason: "a reclaim needs a run id (legacy agents have nothing to reclaim)".into(),
        });
    }
    check_len(
        "agent_version_bytes",
        || "agent_version".into(),
        request.agent_version.len(),
        MAX_AGENT_VERSION_BYTES,
        "bytes",
    )?;
    no_nul(|| "agent_version".into(), &request.agent_version)
}

pub fn push(request: &PushContextStateRequest) -> Result<(), ValidationError> {
    check_run_id(&request.agent_run_id)?;
    // The store keeps versions in a signed 64-bit column.
    if i64::try_from(request.version).is_err() {
        return Err(ValidationError::Invalid {
            field: "version".into(),
            reason: format!(
                "{} does not fit in a signed 64-bit integer (at most {})",
                request.version,
                i64::MAX
            ),
        });
    }
    if let Some(discovery) = &request.mcp_discovery
        && mcp_discovery::Phase::try_from(discovery.phase).is_err()
    {
        return Err(ValidationError::Invalid {
            field: "mcp_discovery.phase".into(),
            reason: format!("unknown enum value {}", discovery.phase),
        });
    }
    check_len(
        "resources_count",
        || "resources".into(),
        request.resources.len(),
        MAX_RESOURCES,
        "resources",
    )?;
    let mut sources = HashSet::with_capacity(request.resources.len());
    for (index, resource) in request.resources.iter().enumerate() {
        resource_ok(index, resource)?;
        if !sources.insert(resource.source.as_str()) {
            return Err(ValidationError::Invalid {
                field: format!("resources[{index}].source"),
                reason: format!("duplicate source {:?}", resource.source),
            });
        }
    }
    if let Some(config) = &request.context_config {
        context_config_text(config)?;
    }
    Ok(())
}

fn context_config_text(config: &ContextConfig) -> Result<(), ValidationError> {
    let field = |name: &str| format!("context_config.{name}");
    no_nul(|| field("working_dir"), &config.working_dir)?;
    no_nul_in(|| field("instructions_dirs"), &config.instructions_dirs)?;
    no_nul(|| field("instructions_file"), &config.instructions_file)?;
    no_nul_in(|| field("skills_dirs"), &config.skills_dirs)?;
    no_nul(|| field("skill_meta_file"), &config.skill_meta_file)?;
    no_nul_in(|| field("mcp_config_files"), &config.mcp_config_files)
}

/// No string of the resource, its body included, holds NUL.
fn resource_text(index: usize, resource: &ContextResource) -> Result<(), ValidationError> {
    let field = |name: &str| format!("resources[{index}].{name}");
    no_nul(|| field("source"), &resource.source)?;
    no_nul(|| field("error"), &resource.error)?;
    no_nul(|| field("warning"), &resource.warning)?;
    match &resource.body {
        None => Ok(()),
        Some(Body::InstructionFile(file)) => {
            no_nul(|| field("instruction_file.path"), &file.path)?;
            no_nul(|| field("instruction_file.content"), &file.content)
        }
        Some(Body::Skill(skill)) => {
            no_nul(|| field("skill.dir"), &skill.dir)?;
            no_nul(|| field("skill.name"), &skill.name)?;
            no_nul(|| field("skill.description"), &skill.description)
        }
        Some(Body::McpConfig(config)) => {
            no_nul(|| field("mcp_config.path"), &config.path)?;
            no_nul_in(|| field("mcp_config.server_names"), &config.server_names)
        }
        Some(Body::McpServer(server)) => {
            no_nul(|| field("mcp_server.name"), &server.name)?;
            no_nul(|| field("mcp_server.config_path"), &server.config_path)?;
            for (t, tool) in server.tools.iter().enumerate() {
                let tool_field = |name: &str| field(&format!("mcp_server.tools[{t}].{name}"));
                no_nul(|| tool_field("name"), &tool.name)?;
                no_nul(|| tool_field("description"), &tool.description)?;
                no_nul(|| tool_field("input_schema_json"), &tool.input_schema_json)?;
            }
            Ok(())
        }
    }
}

fn resource_ok(index: usize, resource: &ContextResource) -> Result<(), ValidationError> {
    let field = |name: &str| format!("resources[{index}].{name}");
    if resource.source.is_empty() {
        return Err(ValidationError::Invalid {
            field: field("source"),
            reason: "must not be empty".into(),
        });
    }
    check_len(
        "source_bytes",
        || field("source"),
        resource.source.len(),
        MAX_SOURCE_BYTES,
        "bytes",
    )?;
    check_len(
        "error_bytes",
        || field("error"),
        resource.error.len(),
        MAX_ERROR_BYTES,
        "bytes",
    )?;
    check_len(
        "warning_bytes",
        || field("warning"),
        resource.warning.len(),
        MAX_ERROR_BYTES,
        "bytes",
    )?;
    let kind = match ResourceKind::try_from(resource.kind) {
        Ok(ResourceKind::Unspecified) | Err(_) => {
            return Err(ValidationError::Invalid {
                field: field("kind"),
                reason: format!("unknown or unspecified kind {}", resource.kind),
            });
        }
        Ok(kind) => kind,
    };
    if matches!(
        ResourceStatus::try_from(resource.status),
        Ok(ResourceStatus::Unspecified) | Err(_)
    ) {
        return Err(ValidationError::Invalid {
            field: field("status"),
            reason: format!("unknown or unspecified status {}", resource.status),
        });
    }
    if let Some(body) = &resource.body {
        let body_len = match body {
            Body::InstructionFile(b) => b.encoded_len(),
            Body::Skill(b) => b.encoded_len(),
            Body::McpConfig(b) => b.encoded_len(),
            Body::McpServer(b) => b.encoded_len(),
        };
        check_len(
            "resource_body_bytes",
            || field("body"),
            body_len,
            MAX_RESOURCE_BODY_BYTES,
            "bytes",
        )?;
        let body_kind = match body {
            Body::InstructionFile(_) => ResourceKind::InstructionFile,
            Body::Skill(_) => ResourceKind::Skill,
            Body::McpConfig(_) => ResourceKind::McpConfig,
            Body::McpServer(_) => ResourceKind::McpServer,
        };
        if body_kind != kind {
            return Err(ValidationError::Invalid {
                field: field("body"),
                reason: format!(
                    "body is {} but kind is {}",
                    body_kind.as_str_name(),
                    kind.as_str_name()
                ),
            });
        }
        if let Body::McpServer(server) = body
            && McpTransport::try_from(server.transport).is_err()
        {
            return Err(ValidationError::Invalid {
                field: field("mcp_server.transport"),
                reason: format!("unknown enum value {}", server.transport),
            });
        }
    }
    resource_text(index, resource)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{InstructionFile, McpConfig, McpDiscovery, McpServer, McpTool, Skill};

    fn resource(source: &str) -> ContextResource {
        ContextResource {
            source: source.into(),
            kind: ResourceKind::InstructionFile as i32,
            status: ResourceStatus::Ok as i32,
            body: Some(Body::InstructionFile(InstructionFile {
                path: "/a".into(),
                content: "x".into(),
                truncated: false,
            })),
            ..Default::default()
        }
    }

    #[test]
    fn run_id_limit_is_named() {
        let err = push(&PushContextStateRequest {
            agent_run_id: "x".repeat(65),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(err.limit(), Some("agent_run_id_bytes"));
        assert!(
            startup(&StartupRequest {
                agent_run_id: "x".repeat(64),
                ..Default::default()
            })
            .is_ok()
        );
    }

    #[test]
    fn duplicate_sources_and_mismatched_bodies_are_invalid() {
        let dup = PushContextStateRequest {
            resources: vec![resource("a"), resource("a")],
            ..Default::default()
        };
        assert!(matches!(push(&dup), Err(ValidationError::Invalid { .. })));
        let mut wrong = resource("b");
        wrong.kind = ResourceKind::Skill as i32;
        let err = push(&PushContextStateRequest {
            resources: vec![wrong],
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("body is"), "{err}");
    }

    #[test]
    fn unknown_enum_values_are_invalid() {
        let err = push(&PushContextStateRequest {
            mcp_discovery: Some(McpDiscovery { phase: 7 }),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("unknown enum value 7"), "{err}");
        let mut bad = resource("c");
        bad.status = 42;
        assert!(
            push(&PushContextStateRequest {
                resources: vec![bad],
                ..Default::default()
            })
            .is_err()
        );
    }

    /// A push with every string field filled, each resource of another body.
    fn full_push() -> PushContextStateRequest {
        let server = ContextResource {
            source: "mcp_server:s".into(),
            kind: ResourceKind::McpServer as i32,
            status: ResourceStatus::Ok as i32,
            error: "e".into(),
            warning: "w".into(),
            body: Some(Body::McpServer(McpServer {
                name: "s".into(),
                transport: McpTransport::Stdio as i32,
                config_path: "/w/.mcp.json".into(),
                tools: vec![
                    McpTool {
                        name: "a".into(),
                        description: "d".into(),
                        input_schema_json: "{}".into(),
                    },
                    McpTool {
                        name: "b".into(),
                        description: "d".into(),
                        input_schema_json: "{}".into(),
                    },
                ],
            })),
        };
        let skill = ContextResource {
            source: "skill:/k".into(),
            kind: ResourceKind::Skill as i32,
            status: ResourceStatus::Ok as i32,
            body: Some(Body::Skill(Skill {
                dir: "/k".into(),
                name: "k".into(),
                description: "d".into(),
            })),
            ..Default::default()
        };
        let config = ContextResource {
            source: "mcp_config:/w/.mcp.json".into(),
            kind: ResourceKind::McpConfig as i32,
            status: ResourceStatus::Ok as i32,
            body: Some(Body::McpConfig(McpConfig {
                path: "/w/.mcp.json".into(),
                server_names: vec!["s".into(), "t".into()],
            })),
            ..Default::default()
        };
        PushContextStateRequest {
            agent_run_id: "run".into(),
            version: 1,
            resources: vec![resource("/a"), skill, config, server],
            context_config: Some(ContextConfig {
                working_dir: "/w".into(),
                instructions_dirs: vec!["/h".into(), "/w".into()],
                instructions_file: "AGENTS.md".into(),
                skills_dirs: vec![".agents/skills".into()],
                skill_meta_file: "SKILL.md".into(),
                mcp_config_files: vec![".mcp.json".into()],
            }),
            ..Default::default()
        }
    }

    fn body(push: &mut PushContextStateRequest, index: usize) -> &mut Body {
        push.resources[index].body.as_mut().unwrap()
    }

    #[test]
    fn nul_is_refused_in_every_string_with_its_exact_path() {
        push(&full_push()).expect("the full push is valid");
        type Edit = fn(&mut PushContextStateRequest) -> &mut String;
        let edits: Vec<(&str, Edit)> = vec![
            ("agent_run_id", |p| &mut p.agent_run_id),
            ("resources[0].source", |p| &mut p.resources[0].source),
            ("resources[3].error", |p| &mut p.resources[3].error),
            ("resources[3].warning", |p| &mut p.resources[3].warning),
            ("resources[0].instruction_file.path", |p| match body(p, 0) {
                Body::InstructionFile(f) => &mut f.path,
                _ => unreachable!(),
            }),
            ("resources[0].instruction_file.content", |p| {
                match body(p, 0) {
                    Body::InstructionFile(f) => &mut f.content,
                    _ => unreachable!(),
                }
            }),
            ("resources[1].skill.dir", |p| match body(p, 1) {
                Body::Skill(s) => &mut s.dir,
                _ => unreachable!(),
            }),
            ("resources[1].skill.name", |p| match body(p, 1) {
                Body::Skill(s) => &mut s.name,
                _ => unreachable!(),
            }),
            ("resources[1].skill.description", |p| match body(p, 1) {
                Body::Skill(s) => &mut s.description,
                _ => unreachable!(),
            }),
            ("resources[2].mcp_config.path", |p| match body(p, 2) {
                Body::McpConfig(c) => &mut c.path,
                _ => unreachable!(),
            }),
            ("resources[2].mcp_config.server_names[1]", |p| {
                match body(p, 2) {
                    Body::McpConfig(c) => &mut c.server_names[1],
                    _ => unreachable!(),
                }
            }),
            ("resources[3].mcp_server.name", |p| match body(p, 3) {
                Body::McpServer(s) => &mut s.name,
                _ => unreachable!(),
            }),
            ("resources[3].mcp_server.config_path", |p| {
                match body(p, 3) {
                    Body::McpServer(s) => &mut s.config_path,
                    _ => unreachable!(),
                }
            }),
            ("resources[3].mcp_server.tools[1].name", |p| {
                match body(p, 3) {
                    Body::McpServer(s) => &mut s.tools[1].name,
                    _ => unreachable!(),
                }
            }),
            (
                "resources[3].mcp_server.tools[0].description",
                |p| match body(p, 3) {
                    Body::McpServer(s) => &mut s.tools[0].description,
                    _ => unreachable!(),
                },
            ),
            (
                "resources[3].mcp_server.tools[1].input_schema_json",
                |p| match body(p, 3) {
                    Body::McpServer(s) => &mut s.tools[1].input_schema_json,
                    _ => unreachable!(),
                },
            ),
            ("context_config.working_dir", |p| {
                &mut p.context_config.as_mut().unwrap().working_dir
            }),
            ("context_config.instructions_dirs[1]", |p| {
                &mut p.context_config.as_mut().unwrap().instructions_dirs[1]
            }),
            ("context_config.instructions_file", |p| {
                &mut p.context_config.as_mut().unwrap().instructions_file
            }),
            ("context_config.skills_dirs[0]", |p| {
                &mut p.context_config.as_mut().unwrap().skills_dirs[0]
            }),
            ("context_config.skill_meta_file", |p| {
                &mut p.context_config.as_mut().unwrap().skill_meta_file
            }),
            ("context_config.mcp_config_files[0]", |p| {
                &mut p.context_config.as_mut().unwrap().mcp_config_files[0]
            }),
        ];
        for (path, edit) in edits {
            let mut request = full_push();
            edit(&mut request).push_str("x\0y");
            let error = push(&request).unwrap_err();
            match &error {
                ValidationError::Invalid { field, reason } => {
                    assert_eq!(field, path);
                    assert!(reason.contains("NUL"), "{reason}");
                }
                other => panic!("{path}: {other}"),
            }
        }
    }

    #[test]
    fn nul_is_refused_in_startups() {
        for (field, request) in [
            (
                "agent_run_id",
                StartupRequest {
                    agent_run_id: "r\0".into(),
                    ..Default::default()
                },
            ),
            (
                "agent_version",
                StartupRequest {
                    agent_version: "\0".into(),
                    ..Default::default()
                },
            ),
        ] {
            let error = startup(&request).unwrap_err();
            assert!(
                error
                    .to_string()
                    .starts_with(&format!("{field}: contains U+0000")),
                "{error}"
            );
        }
        // Other control characters are the agent's to clean; storable, so valid.
        assert!(
            startup(&StartupRequest {
                agent_version: "v\u{1b}[0m\u{7f}".into(),
                ..Default::default()
            })
            .is_ok()
        );
    }

    #[test]
    fn versions_past_i64_are_invalid() {
        for (version, ok) in [
            (0, true),
            (i64::MAX as u64, true),
            (i64::MAX as u64 + 1, false),
            (u64::MAX, false),
        ] {
            let result = push(&PushContextStateRequest {
                version,
                ..Default::default()
            });
            assert_eq!(result.is_ok(), ok, "{version}: {result:?}");
        }
    }
}
