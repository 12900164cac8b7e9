//! The catalog's use of the MCP client: declarations to catalogs, and
//! errors to sanitized texts.

use std::time::Duration;

use ctxsync_mcp::{Declarations, McpError, Sanitizer, ServerSpec};

use crate::tools::{Catalog, Prompt, Resource, Tool};

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

/// A failed live attempt, safe to log, store and send.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Stable name of the error kind (`timeout`, `spawn`, `exited`, ...).
    pub kind: &'static str,
    /// Sanitized of the server's secrets.
    pub message: String,
    pub duration: Duration,
}

impl Failure {
    pub fn from_error(spec: &ServerSpec, error: &McpError, duration: Duration) -> Self {
        Self {
            kind: error.kind(),
            message: Sanitizer::for_server(spec).sanitize(&error.to_string()),
            duration,
        }
    }
}
