//! ctxsync's MCP client, built on the official Rust SDK (`rmcp`).
//!
//! * [`Connection::connect`] starts a stdio server as a process-group leader (so
//!   `npx`/shell grandchildren die with it) or opens a streamable-HTTP session,
//!   bounded by a handshake timeout (rmcp has none of its own).
//! * [`open_and_list`] is connect + list tools within one deadline, killing
//!   the server on failure: every caller opens servers through it.
//!   [`discover`] adds the close, within the same deadline.
//! * [`catalog_hash`] fingerprints a tool list.
//! * [`Sanitizer`] must be applied to every error text before it leaves the
//!   process: [`McpError`]'s `Display` can contain URLs with credentials,
//!   argument values and server stderr.
//! * What a server says (tool names and descriptions, error messages, its
//!   stderr) comes out cleaned of control characters ([`clean_text`]): NUL in
//!   a tool description must not fail the database write that stores it.

mod connection;
mod error;
pub mod https;
mod open;
mod sanitize;
mod spec;
mod text;

use sha2::{Digest, Sha256};

pub use connection::{CallOutcome, ConnectOptions, Connection, STDERR_TAIL_BYTES};
pub use error::McpError;
pub use open::{Discovery, OpenError, OpenStep, Opened, discover, open_and_list};
pub use sanitize::{
    MAX_SANITIZED_LEN, MIN_INHERITED_SECRET_LEN, MIN_SECRET_LEN, REDACTED, Sanitizer,
    is_harmless_env_name, is_secret_env_name, process_env,
};
pub use spec::{ServerInfo, ServerSpec, ToolDecl, TransportKind, TransportSpec};
pub use text::{clean_string, clean_text};

/// SHA-256 (hex) over the tool list sorted by name: the same tools give the same
/// hash whatever order the server listed them in.
pub fn catalog_hash(tools: &[ToolDecl]) -> String {
    let mut sorted: Vec<&ToolDecl> = tools.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.name, &a.description, &a.input_schema_json).cmp(&(
            &b.name,
            &b.description,
            &b.input_schema_json,
        ))
    });
    let mut hasher = Sha256::new();
    for tool in sorted {
        // Length-prefixed fields: no two different lists serialize the same.
        for field in [&tool.name, &tool.description, &tool.input_schema_json] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field.as_bytes());
        }
    }
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, description: &str) -> ToolDecl {
        ToolDecl {
            name: name.into(),
            description: description.into(),
            input_schema_json: r#"{"type":"object"}"#.into(),
        }
    }

    #[test]
    fn catalog_hash_ignores_order_and_sees_every_field() {
        let a = [tool("a", "first"), tool("b", "second")];
        let b = [tool("b", "second"), tool("a", "first")];
        assert_eq!(catalog_hash(&a), catalog_hash(&b));
        assert_eq!(catalog_hash(&a).len(), 64);
        let changed_description = [tool("a", "first!"), tool("b", "second")];
        assert_ne!(catalog_hash(&a), catalog_hash(&changed_description));
        let mut changed_schema = a.clone();
        changed_schema[0].input_schema_json = r#"{"type":"object","properties":{}}"#.into();
        assert_ne!(catalog_hash(&a), catalog_hash(&changed_schema));
        // Field boundaries matter: ("ab", "c") is not ("a", "bc").
        assert_ne!(
            catalog_hash(&[tool("ab", "c")]),
            catalog_hash(&[tool("a", "bc")])
        );
        assert_ne!(catalog_hash(&[]), catalog_hash(&a));
    }
}
