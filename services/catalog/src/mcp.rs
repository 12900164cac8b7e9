//! The catalog's use of the MCP client: declarations to catalogs, errors
//! to sanitized failures, and its types as the core names them.

use std::time::Duration;

use catalog_core::call::CallFailure;
use catalog_core::tools::{Catalog, Prompt, Resource, Tool};
use catalog_core::{Failure, Transport};
use ctxsync_mcp::{Declarations, McpError, Sanitizer, ServerSpec, TransportKind};

pub fn catalog_of(declared: Declarations) -> Catalog {
    let hash =
        ctxsync_mcp::catalog_hash_all(&declared.tools, &declared.prompts, &declared.resources);
    Catalog {
        tools: declared
            .tools
            .into_iter()
            .map(|t| Tool {
                name: t.name,
                description: t.description,
                input_schema_json: t.input_schema_json,
            })
            .collect(),
        prompts: declared
            .prompts
            .into_iter()
            .map(|p| Prompt::declared(p.name, p.declaration_json))
            .collect(),
        resources: declared
            .resources
            .into_iter()
            .map(|r| Resource::declared(r.uri, r.declaration_json))
            .collect(),
        hash,
    }
}

/// A failed live attempt, sanitized of the server's secrets.
pub fn failure(spec: &ServerSpec, error: &McpError, duration: Duration) -> Failure {
    Failure {
        kind: error.kind(),
        message: Sanitizer::for_server(spec).sanitize(&error.to_string()),
        duration,
    }
}

/// The transport as the core names it.
pub fn transport_of(kind: TransportKind) -> Transport {
    match kind {
        TransportKind::Stdio => Transport::Stdio,
        TransportKind::StreamableHttp => Transport::StreamableHttp,
    }
}

/// A call's failure as the core classifies it, sanitized.
pub fn call_failure(spec: &ServerSpec, error: McpError) -> CallFailure {
    match error {
        McpError::Timeout { after } => CallFailure::Timeout { after },
        McpError::Cancelled => CallFailure::Cancelled,
        e @ McpError::Protocol { .. } => CallFailure::Protocol {
            message: failure(spec, &e, Duration::ZERO).message,
        },
        e => CallFailure::Transport {
            message: failure(spec, &e, Duration::ZERO).message,
        },
    }
}
