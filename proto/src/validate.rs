//! Validation of what agents send, shared by agent-ingest (which answers 400)
//! and snapshot-store (which refuses the request): every limit has a name.

use std::collections::HashSet;

use prost::Message;

use crate::limits::*;
use crate::v1::{
    ContextResource, McpTransport, PushContextStateRequest, ResourceKind, ResourceStatus,
    StartupRequest, context_resource::Body, mcp_discovery,
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

fn check_run_id(run_id: &str) -> Result<(), ValidationError> {
    check_len(
        "agent_run_id_bytes",
        || "agent_run_id".into(),
        run_id.len(),
        MAX_RUN_ID_BYTES,
        "bytes",
    )
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
    )
}

pub fn push(request: &PushContextStateRequest) -> Result<(), ValidationError> {
    check_run_id(&request.agent_run_id)?;
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
    Ok(())
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{InstructionFile, McpDiscovery};

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
}
