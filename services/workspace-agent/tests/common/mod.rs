//! Helpers shared by the agent's integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ctxsync_mcp::{ServerSpec, TransportSpec};
use ctxsync_proto::v1::{ContextResource, ResourceStatus, context_resource::Body};
use serde_json::{Value, json};
use tokio::sync::watch;
use workspace_agent::DiscoverySettings;
use workspace_agent::report::{Report, SharedReport};

/// A workspace: a temp dir with `home/` and `work/`.
pub struct Workspace {
    pub dir: tempfile::TempDir,
}

impl Workspace {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        std::fs::create_dir_all(dir.path().join("work")).unwrap();
        Self { dir }
    }

    pub fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    pub fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    pub fn mcp_json(&self) -> PathBuf {
        self.work().join(".mcp.json")
    }

    /// Writes `work/.mcp.json` with these servers (in order).
    pub fn write_servers(&self, servers: &[(&str, Value)]) {
        write_config(&self.mcp_json(), servers);
    }

    pub fn settings(&self, handshake_timeout: Duration) -> DiscoverySettings {
        self.settings_with_env(handshake_timeout, BTreeMap::new())
    }

    pub fn settings_with_env(
        &self,
        handshake_timeout: Duration,
        env: BTreeMap<String, String>,
    ) -> DiscoverySettings {
        DiscoverySettings {
            env,
            home: Some(self.home()),
            working_dir: Some(self.work()),
            handshake_timeout,
            max_concurrent_connects: 8,
            max_servers: workspace_agent::args::Cli::defaults()
                .common
                .mcp_max_servers,
        }
    }
}

pub fn write_config(path: &Path, servers: &[(&str, Value)]) {
    // Built by hand to keep the order of the servers.
    let entries: Vec<String> = servers
        .iter()
        .map(|(name, value)| format!("{}: {}", json!(name), value))
        .collect();
    let text = format!("{{\"mcpServers\": {{{}}}}}", entries.join(", "));
    // Write then rename, as editors do, so a watcher never sees half a file.
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The `.mcp.json` entry of a spec.
pub fn entry(spec: &ServerSpec) -> Value {
    match &spec.transport {
        TransportSpec::Stdio {
            command,
            args,
            env,
            cwd,
        } => {
            let mut v = json!({"command": command, "args": args, "env": env});
            if let Some(cwd) = cwd {
                v["cwd"] = json!(cwd);
            }
            v
        }
        TransportSpec::StreamableHttp { url, headers } => {
            json!({"type": "http", "url": url, "headers": headers})
        }
        TransportSpec::Sse { url, headers } => {
            json!({"type": "sse", "url": url, "headers": headers})
        }
    }
}

/// A fixture entry in a mode, with extra args.
pub fn fixture(args: &[&str]) -> Value {
    entry(&mcp_fixture::fixture_spec("x", args, &[]))
}

pub fn fixture_with_env(args: &[&str], env: &[(&str, &str)]) -> Value {
    entry(&mcp_fixture::fixture_spec("x", args, env))
}

pub const DEADLINE: Duration = Duration::from_secs(60);

/// Waits (bounded) for a report that satisfies `accept`.
pub async fn wait_report(
    reports: &mut watch::Receiver<SharedReport>,
    what: &str,
    accept: impl Fn(&Report) -> bool,
) -> SharedReport {
    let outcome = tokio::time::timeout(DEADLINE, reports.wait_for(|r| accept(r)))
        .await
        .map(|r| r.map(|report| report.clone()));
    match outcome {
        Ok(Ok(report)) => report,
        Ok(Err(_)) => panic!("discovery stopped while waiting for: {what}"),
        Err(_) => panic!(
            "timed out waiting for: {what}; last report: {:#?}",
            reports.borrow()
        ),
    }
}

pub fn server<'a>(report: &'a Report, name: &str) -> Option<&'a ContextResource> {
    report.resource(&format!("mcp_server:{name}"))
}

pub fn tool_names(resource: &ContextResource) -> Vec<String> {
    match &resource.body {
        Some(Body::McpServer(s)) => s.tools.iter().map(|t| t.name.clone()).collect(),
        other => panic!("not an mcp server row: {other:?}"),
    }
}

pub fn is_ok(resource: Option<&ContextResource>) -> bool {
    resource.is_some_and(|r| r.status == ResourceStatus::Ok as i32)
}

pub fn is_invalid(resource: Option<&ContextResource>) -> bool {
    resource.is_some_and(|r| r.status == ResourceStatus::Invalid as i32)
}
