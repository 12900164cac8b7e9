use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One MCP server as configured.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerSpec {
    pub name: String,
    pub transport: TransportSpec,
}

/// How to start or reach one MCP server: the one transport type of ctxsync.
/// The catalog's YAML config deserializes it (`stdio: {...}` or
/// `streamable_http: {...}`, omitted collections empty) and hashes its
/// serialization into a server's memory key; the workspace agent builds it
/// from `.mcp.json` entries.
///
/// `env`, `headers`, `args` and the URL may hold secrets: `Debug` shows the
/// kind only, and every error text that may quote them passes through
/// [`crate::Sanitizer`].
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum TransportSpec {
    /// A child process speaking MCP on stdin/stdout. It inherits this process's
    /// environment with `env` laid over it.
    Stdio {
        command: String,
        #[serde(default)]
        args: Vec<String>,
        /// Secret: never logged, stored or sent.
        #[serde(default)]
        env: BTreeMap<String, String>,
        #[serde(default)]
        cwd: Option<PathBuf>,
    },
    /// An MCP streamable-HTTP endpoint; `headers` are sent with every request.
    StreamableHttp {
        url: String,
        /// Secret: never logged, stored or sent.
        #[serde(default)]
        headers: BTreeMap<String, String>,
    },
    /// A legacy HTTP+SSE endpoint (MCP 2024-11-05): `GET url` opens the
    /// event stream, whose `endpoint` event names where to POST.
    /// A streamable-HTTP server that answers the first POST with a 4xx is
    /// tried this way too (the specification's backwards compatibility).
    Sse {
        url: String,
        /// Secret: never logged, stored or sent.
        #[serde(default)]
        headers: BTreeMap<String, String>,
    },
}

// Hand-written: env values, headers, arguments and URLs are secrets.
impl std::fmt::Debug for TransportSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportSpec")
            .field("kind", &self.kind())
            .finish_non_exhaustive()
    }
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

    /// The kind as the protobuf contract names it.
    pub fn to_proto(self) -> ctxsync_proto::v1::McpTransport {
        match self {
            TransportKind::Stdio => ctxsync_proto::v1::McpTransport::Stdio,
            TransportKind::StreamableHttp => ctxsync_proto::v1::McpTransport::StreamableHttp,
        }
    }

    /// The kind named by [`TransportKind::as_str`]; `None` for any other text.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "stdio" => Some(TransportKind::Stdio),
            "streamable_http" => Some(TransportKind::StreamableHttp),
            _ => None,
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TransportSpec {
    /// Process or HTTP: what bounds and memory rules key on. A legacy SSE
    /// server is reached over HTTP, so it is of the HTTP kind.
    pub fn kind(&self) -> TransportKind {
        match self {
            TransportSpec::Stdio { .. } => TransportKind::Stdio,
            TransportSpec::StreamableHttp { .. } | TransportSpec::Sse { .. } => {
                TransportKind::StreamableHttp
            }
        }
    }

    /// The transport as the protobuf contract names it (SSE distinct).
    pub fn to_proto(&self) -> ctxsync_proto::v1::McpTransport {
        match self {
            TransportSpec::Sse { .. } => ctxsync_proto::v1::McpTransport::Sse,
            other => other.kind().to_proto(),
        }
    }

    /// A short name for messages: `stdio`, `streamable_http` or `sse`.
    pub fn name(&self) -> &'static str {
        match self {
            TransportSpec::Sse { .. } => "sse",
            other => other.kind().as_str(),
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

/// A prompt as the server declared it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptDecl {
    pub name: String,
    /// The whole `Prompt` object as listed (title, description, arguments,
    /// icons), as JSON text: served again as the server gave it.
    pub declaration_json: String,
}

/// A resource as the server declared it, or a resource template: then
/// `uri` is its URI template (it holds `{`, which no URI does) and the
/// declaration a `ResourceTemplate`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceDecl {
    pub uri: String,
    /// The whole `Resource` (or `ResourceTemplate`) object as listed (name,
    /// title, description, MIME type, size, annotations), as JSON text.
    pub declaration_json: String,
}

/// Everything a server declared: what a gateway pins.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Declarations {
    pub tools: Vec<ToolDecl>,
    pub prompts: Vec<PromptDecl>,
    pub resources: Vec<ResourceDecl>,
    /// The shortest `ttlMs` (a cache hint of 2026-07-28) the server's lists
    /// carried; `None` when none did.
    pub ttl: Option<std::time::Duration>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_reads_snake_case_with_defaults_and_refuses_unknown_fields() {
        let stdio: TransportSpec = serde_json::from_str(r#"{"stdio": {"command": "x"}}"#).unwrap();
        assert_eq!(
            stdio,
            TransportSpec::Stdio {
                command: "x".into(),
                args: Vec::new(),
                env: BTreeMap::new(),
                cwd: None,
            }
        );
        let http: TransportSpec =
            serde_json::from_str(r#"{"streamable_http": {"url": "http://h/mcp"}}"#).unwrap();
        assert_eq!(http.kind(), TransportKind::StreamableHttp);
        let unknown =
            serde_json::from_str::<TransportSpec>(r#"{"stdio": {"command": "x", "colour": 1}}"#)
                .unwrap_err();
        assert!(unknown.to_string().contains("colour"), "{unknown}");
    }

    #[test]
    fn debug_shows_the_kind_only() {
        let spec = ServerSpec {
            name: "s".into(),
            transport: TransportSpec::Stdio {
                command: "/opt/sk-cmd".into(),
                args: vec!["--token=sk-arg".into()],
                env: [("K".to_owned(), "sk-env".to_owned())].into(),
                cwd: Some("/sk-cwd".into()),
            },
        };
        let http = TransportSpec::StreamableHttp {
            url: "https://u:sk-pass@h/sk-path".into(),
            headers: [("Authorization".to_owned(), "sk-header".to_owned())].into(),
        };
        let text = format!("{spec:?} {http:?}");
        assert!(!text.contains("sk-"), "{text}");
        assert!(
            text.contains("Stdio") && text.contains("StreamableHttp"),
            "{text}"
        );
    }

    #[test]
    fn kinds_name_themselves_and_their_proto() {
        for kind in [TransportKind::Stdio, TransportKind::StreamableHttp] {
            assert_eq!(TransportKind::from_name(kind.as_str()), Some(kind));
        }
        assert_eq!(TransportKind::from_name("sse"), None);
        assert_eq!(
            TransportKind::StreamableHttp.to_proto(),
            ctxsync_proto::v1::McpTransport::StreamableHttp
        );
    }
}
