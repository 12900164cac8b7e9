//! The `workspace-agent` binary: `inspect` (table and JSON) and its startup errors.

mod common;

use std::process::{Command, Output};

use common::*;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_workspace-agent");

fn agent(ws: &Workspace) -> Command {
    let mut command = Command::new(BIN);
    for var in [
        "CTXSYNC_INGEST_URL",
        "CTXSYNC_AGENT_TOKEN_FILE",
        "CTXSYNC_INSTRUCTIONS_DIRS",
        "CTXSYNC_INSTRUCTIONS_FILE",
        "CTXSYNC_SKILLS_DIRS",
        "CTXSYNC_SKILL_META_FILE",
        "CTXSYNC_MCP_CONFIG_FILES",
        "CTXSYNC_HTTP_ADDR",
        "CTXSYNC_LOG",
    ] {
        command.env_remove(var);
    }
    command
        .env("HOME", ws.home())
        .env("CTXSYNC_WORKDIR", ws.work())
        .env("CTXSYNC_MCP_HANDSHAKE_TIMEOUT", "20s");
    command
}

fn run(command: &mut Command) -> Output {
    let output = command.output().expect("running workspace-agent");
    if !output.status.success() {
        panic!(
            "workspace-agent failed: {}\nstderr: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    output
}

#[test]
fn inspect_json_redacts_inherited_secret_env_values() {
    let ws = Workspace::new();
    ws.write_servers(&[("s", fixture(&["--mode", "secret-error"]))]);
    // Inherited by the agent and so by the server, which echoes FIXTURE_* values.
    let output = run(agent(&ws)
        .env("FIXTURE_SERVICE_TOKEN", "inherited-secret-value-77")
        .args(["inspect", "--json"]));
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(!stdout.contains("inherited-secret-value-77"), "{stdout}");
    let push: Value = serde_json::from_str(&stdout).expect("JSON output");
    assert_eq!(push["mcp_discovery"]["phase"], "PHASE_COMPLETE", "{push:#}");
    let row = push["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["source"] == "mcp_server:s")
        .expect("server row");
    let error = row["error"].as_str().unwrap();
    assert!(
        error.contains("FIXTURE_SERVICE_TOKEN=[redacted]"),
        "{error}"
    );
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains("inherited-secret-value-77"),
        "logs never carry the secret"
    );
}

#[test]
fn logs_never_carry_url_credentials() {
    let ws = Workspace::new();
    let url = format!(
        "http://alice:log-pw-1234@127.0.0.1:{}/private-path/mcp?token=log-query-secret",
        testkit::free_port()
    );
    ws.write_servers(&[("gone", serde_json::json!({"url": url}))]);
    // Debug logs of the agent itself included.
    let output = run(agent(&ws).args(["inspect", "--json", "--log", "debug"]));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("mcp_server:gone"), "{stdout}");
    for secret in ["log-pw-1234", "log-query-secret"] {
        assert!(!stderr.contains(secret), "{secret} in logs: {stderr}");
        assert!(!stdout.contains(secret), "{secret} in output: {stdout}");
    }
    // The URL's structure is no secret: its path stays readable.
    assert!(
        stdout.contains("/private-path/mcp?token=[redacted]"),
        "{stdout}"
    );
}

#[test]
fn inspect_prints_the_resolved_config_and_every_source() {
    let ws = Workspace::new();
    std::fs::write(ws.work().join("AGENTS.md"), "rules").unwrap();
    let skill = ws.work().join(".agents/skills/pdf");
    std::fs::create_dir_all(&skill).unwrap();
    std::fs::write(
        skill.join("SKILL.md"),
        "---\nname: pdf\ndescription: PDFs\n---\n",
    )
    .unwrap();
    ws.write_servers(&[
        ("tools", fixture(&["--mode", "normal"])),
        ("empty", fixture(&["--mode", "zero-tools"])),
        ("crashes", fixture(&["--mode", "crash"])),
        ("bad__name", fixture(&["--mode", "normal"])),
    ]);
    let output = run(agent(&ws).arg("inspect"));
    let table = String::from_utf8(output.stdout).unwrap();
    println!("{table}");
    assert!(table.contains("context config"), "{table}");
    assert!(
        table.contains(&format!("working dir        {}", ws.work().display())),
        "{table}"
    );
    assert!(table.contains(&format!(
        "instructions dirs  {}",
        ws.home().join(".ctxsync").display()
    )));
    assert!(table.contains("mcp discovery phase: PHASE_COMPLETE"));
    let line = |source: &str| {
        table
            .lines()
            .find(|l| l.starts_with(source))
            .unwrap_or_else(|| panic!("no line for {source}:\n{table}"))
            .to_owned()
    };
    assert!(
        line("mcp_server:tools").contains("ok")
            && line("mcp_server:tools").contains("2 tools: echo, add")
    );
    assert!(line("mcp_server:empty").contains("0 tools"));
    assert!(line("mcp_server:crashes").contains("invalid"));
    assert!(line(&format!("mcp_config:{}", ws.mcp_json().display())).contains("invalid"));
    assert!(table.contains("\"bad__name\" contains \"__\""), "{table}");
    assert!(line(&format!("skill:{}", skill.display())).contains("pdf: PDFs"));
    assert!(
        line(&format!(
            "instruction_file:{}",
            ws.work().join("AGENTS.md").display()
        ))
        .contains("5 bytes")
    );
}

#[test]
fn running_without_an_ingest_url_names_the_variable() {
    let ws = Workspace::new();
    let output = agent(&ws).output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("CTXSYNC_INGEST_URL"), "{stderr}");
}

#[test]
fn an_empty_token_file_is_refused_without_printing_anything_secret() {
    let ws = Workspace::new();
    let token_file = ws.dir.path().join("token");
    std::fs::write(&token_file, "\n").unwrap();
    let output = agent(&ws)
        .args(["--ingest-url", "http://127.0.0.1:9", "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is empty") && stderr.contains("CTXSYNC_AGENT_TOKEN_FILE"),
        "{stderr}"
    );
}
