//! Discovery against the public reference MCP servers (installed by
//! `tests/mcp-servers/install.sh`; missing servers fail these tests).

use std::time::Duration;

use ctxsync_mcp::{ServerSpec, catalog_hash, discover};
use mcp_fixture::reference;

const TIMEOUT: Duration = Duration::from_secs(30);

fn names(spec: &ServerSpec, tools: &[ctxsync_mcp::ToolDecl]) -> Vec<String> {
    let names: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
    assert!(
        tools.iter().all(|t| t.input_schema_json.starts_with('{')),
        "{}: every tool has an object schema",
        spec.name
    );
    names
}

async fn discover_ok(spec: &ServerSpec) -> ctxsync_mcp::Discovery {
    discover(spec, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("discovering {}: {e}", spec.name))
}

#[tokio::test]
async fn server_everything_lists_its_tools_and_hashes_stably() {
    let spec = reference::everything();
    let first = discover_ok(&spec).await;
    assert_eq!(
        names(&spec, &first.tools),
        [
            "echo",
            "get-annotated-message",
            "get-env",
            "get-resource-links",
            "get-resource-reference",
            "get-structured-content",
            "get-sum",
            "get-tiny-image",
            "gzip-file-as-resource",
            "toggle-simulated-logging",
            "toggle-subscriber-updates",
            "trigger-long-running-operation",
            "simulate-research-query",
        ]
    );
    assert_eq!(first.server_info.name, "mcp-servers/everything");
    assert_eq!(first.server_info.protocol_version, "2025-11-25");

    let second = discover_ok(&spec).await;
    assert_eq!(
        first.tools, second.tools,
        "tools/list is byte-stable across runs"
    );
    assert_eq!(catalog_hash(&first.tools), catalog_hash(&second.tools));
}

#[tokio::test]
async fn server_filesystem_lists_its_tools() {
    let root = tempfile::tempdir().unwrap();
    let spec = reference::filesystem(root.path());
    let discovery = discover_ok(&spec).await;
    assert_eq!(
        names(&spec, &discovery.tools),
        [
            "read_file",
            "read_text_file",
            "read_media_file",
            "read_multiple_files",
            "write_file",
            "edit_file",
            "create_directory",
            "list_directory",
            "list_directory_with_sizes",
            "directory_tree",
            "move_file",
            "search_files",
            "get_file_info",
            "list_allowed_directories",
        ]
    );
    assert_eq!(discovery.server_info.name, "secure-filesystem-server");
}

#[tokio::test]
async fn server_memory_lists_its_tools() {
    let dir = tempfile::tempdir().unwrap();
    let spec = reference::memory(&dir.path().join("memory.jsonl"));
    let discovery = discover_ok(&spec).await;
    assert_eq!(
        names(&spec, &discovery.tools),
        [
            "create_entities",
            "create_relations",
            "add_observations",
            "delete_entities",
            "delete_observations",
            "delete_relations",
            "read_graph",
            "search_nodes",
            "open_nodes",
        ]
    );
    assert_eq!(discovery.server_info.name, "memory-server");
}

#[tokio::test]
async fn mcp_server_time_lists_its_tools_and_answers_a_call() {
    let spec = reference::time();
    let discovery = discover_ok(&spec).await;
    assert_eq!(
        names(&spec, &discovery.tools),
        ["get_current_time", "convert_time"]
    );
    assert_eq!(discovery.server_info.name, "mcp-time");

    let connection =
        ctxsync_mcp::Connection::connect(&spec, ctxsync_mcp::ConnectOptions::new(TIMEOUT))
            .await
            .unwrap();
    let mut arguments = serde_json::Map::new();
    arguments.insert("timezone".into(), "UTC".into());
    let outcome = connection
        .call_tool("get_current_time", arguments, TIMEOUT)
        .await
        .unwrap();
    assert!(!outcome.is_error, "{}", outcome.content_json);
    assert!(
        outcome.content_json.contains("UTC"),
        "{}",
        outcome.content_json
    );
    connection.close().await;
}
