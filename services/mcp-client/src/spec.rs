use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One MCP server as configured.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerSpec {
    pub name: String,
    pub transport: TransportSpec,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransportSpec {
    /// A child process speaking MCP on stdin/stdout. It inherits this process's
    /// environment with `env` laid over it.
    Stdio {
        command: String,
        args: Vec<String>,
        env: BTreeMap<String, String>,
        cwd: Option<PathBuf>,
    },
    /// An MCP streamable-HTTP endpoint; `headers` are sent with every request.
    StreamableHttp {
        url: String,
        headers: BTreeMap<String, String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransportKind {
    Stdio,
    StreamableHttp,
}

impl TransportKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Stdio => "stdio",
            TransportKind::StreamableHttp => "streamable_http",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TransportSpec {
    pub fn kind(&self) -> TransportKind {
        match self {
            TransportSpec::Stdio { .. } => TransportKind::Stdio,
            TransportSpec::StreamableHttp { .. } => TransportKind::StreamableHttp,
        }
    }
}

/// A tool as the server declared it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolDecl {
    pub name: String,
    /// Empty when the server gave none.
    pub description: String,
    /// The input schema object exactly as `serde_json` serializes it (keys sorted).
    pub input_schema_json: String,
}

/// What the server said about itself in the handshake.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Empty when the server sent no implementation info.
    pub name: String,
    pub version: String,
    /// The negotiated protocol version, e.g. `2025-11-25`.
    pub protocol_version: String,
}
