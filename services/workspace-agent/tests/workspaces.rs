#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_desktop_file_configured_by_path_runs_its_servers_in_the_workdir() {
    let ws = Workspace::new();
    link_fixture(&ws.work().join("scripts/mcp-server"));
    // Outside the workspace, as Claude Desktop's file is: it belongs to no
    // workspace folder, so its servers run in the agent's CTXSYNC_WORKDIR.
    let path = ws.dir.path().join("Claude/claude_desktop_config.json");
    write(
        &path,
        &json!({"mcpServers": {
            "desktop": {"command": "scripts/mcp-server", "args": ["--record-dir", "rec"]}
        }})
        .to_string(),
    );
    let (push, _) = inspect(&ws, &[("CTXSYNC_MCP_CONFIG_FILES", path.to_str().unwrap())]);
    assert_ok(server(&push, "desktop"), FIXTURE_TOOLS);
    assert_eq!(config(&push, &path)["status"], "RESOURCE_STATUS_OK");
    assert_eq!(mcp_fixture::read_starts(&ws.work().join("rec")).len(), 1);
}
