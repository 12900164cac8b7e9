//! The fixture binary as the suites run it. Having an integration test also
//! makes `cargo test --workspace` build `target/<profile>/mcp-fixture` with
//! the workspace's features before any test starts: without one, the first
//! test to need it ran `cargo build -p mcp-fixture`, which resolves features
//! for that package alone and rebuilt rmcp and its dependencies mid-run.

use std::process::Command;

#[test]
fn crash_mode_exits_3_before_the_handshake_saying_so() {
    let output = Command::new(env!("CARGO_BIN_EXE_mcp-fixture"))
        .args(["--mode", "crash"])
        .env_remove("MCP_FIXTURE_MODE")
        .output()
        .expect("the fixture runs");
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert!(output.stdout.is_empty(), "nothing on stdout: no handshake");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("crashing at start as asked"),
        "{output:?}"
    );
}

#[test]
fn an_unknown_mode_is_refused_naming_the_flag() {
    let output = Command::new(env!("CARGO_BIN_EXE_mcp-fixture"))
        .args(["--mode", "no-such-mode"])
        .env_remove("MCP_FIXTURE_MODE")
        .output()
        .expect("the fixture runs");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--mode"),
        "{output:?}"
    );
}
