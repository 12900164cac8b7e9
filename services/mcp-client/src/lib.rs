//! ctxsync's MCP client, built on the official Rust SDK (`rmcp`).
//!
//! * [`Connection::connect`] starts a stdio server as a process-group leader (so
//!   `npx`/shell grandchildren die with it) or opens a streamable-HTTP session,
//!   bounded by a handshake timeout (rmcp has none of its own); an HTTP
//!   server is reached over streamable HTTP, or legacy HTTP+SSE (module `sse`: a
//!   4xx to the first POST, or `TransportSpec::Sse`).
//! * [`open_and_list`] is connect + list tools within one deadline, killing
//!   the server on failure: every caller opens servers through it.
//!   [`discover`] adds the close, within the same deadline;
//!   [`open_and_list_all`] also lists prompts and resources (the catalog's).
//! * [`catalog_hash`] fingerprints a tool list, [`catalog_hash_all`] a
//!   server's tools, prompts and resources.
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
pub mod relay;
mod sanitize;
mod spec;
mod sse;
mod text;

use sha2::{Digest, Sha256};

pub use connection::{CallOutcome, ConnectOptions, Connection, STDERR_TAIL_BYTES};
pub use error::McpError;
pub use open::{
    Discovery, OpenError, OpenStep, Opened, discover, open_and_list, open_and_list_all,
};
pub use sanitize::{
    MAX_SANITIZED_LEN, MIN_INHERITED_SECRET_LEN, MIN_SECRET_LEN, REDACTED, Sanitizer,
    is_harmless_env_name, is_secret_env_name, looks_secret, process_env,
};
pub use spec::{
    Declarations, PromptDecl, ResourceDecl, ServerInfo, ServerSpec, ToolDecl, TransportKind,
    TransportSpec,
};
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

/// [`catalog_hash`] of the tools, extended by the prompts and resources when
/// there are any: a server without either hashes as its tools alone (so
/// memory entries and generations from before prompts were listed keep
/// their hash).
pub fn catalog_hash_all(
    tools: &[ToolDecl],
    prompts: &[PromptDecl],
    resources: &[ResourceDecl],
) -> String {
    let tools_hash = catalog_hash(tools);
    if prompts.is_empty() && resources.is_empty() {
        return tools_hash;
    }
    let mut prompts: Vec<[&str; 2]> = prompts
        .iter()
        .map(|p| [p.name.as_str(), p.declaration_json.as_str()])
        .collect();
    prompts.sort_unstable();
    let mut resources: Vec<[&str; 2]> = resources
        .iter()
        .map(|r| [r.uri.as_str(), r.declaration_json.as_str()])
        .collect();
    resources.sort_unstable();
    let mut hasher = Sha256::new();
    hasher.update(tools_hash.as_bytes());
    for (section, items) in [(b'p', &prompts), (b'r', &resources)] {
        hasher.update([section]);
        hasher.update((items.len() as u64).to_be_bytes());
        for field in items.iter().flatten() {
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

    #[test]
    fn catalog_hash_all_is_the_tools_hash_without_prompts_or_resources() {
        let tools = [tool("a", "first")];
        assert_eq!(catalog_hash_all(&tools, &[], &[]), catalog_hash(&tools));
        let prompt = |name: &str, json: &str| PromptDecl {
            name: name.into(),
            declaration_json: json.into(),
        };
        let resource = |uri: &str| ResourceDecl {
            uri: uri.into(),
            declaration_json: format!(r#"{{"uri":"{uri}","name":"r"}}"#),
        };
        let with_prompt = catalog_hash_all(&tools, &[prompt("p", "{}")], &[]);
        assert_ne!(with_prompt, catalog_hash(&tools));
        assert_ne!(
            with_prompt,
            catalog_hash_all(&tools, &[prompt("p", r#"{"description":"x"}"#)], &[])
        );
        // A prompt is not a resource of the same text.
        assert_ne!(
            catalog_hash_all(&tools, &[prompt("test://x", "{}")], &[]),
            catalog_hash_all(&tools, &[], &[resource("test://x")])
        );
        // Order of listing does not matter.
        assert_eq!(
            catalog_hash_all(&tools, &[], &[resource("a://1"), resource("a://2")]),
            catalog_hash_all(&tools, &[], &[resource("a://2"), resource("a://1")])
        );
    }
}
