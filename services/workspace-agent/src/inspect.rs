//! `workspace-agent inspect`: discovery once, printed, nothing published.

use std::fmt::Write as _;

use ctxsync_proto::v1::{
    ContextConfig, PushContextStateRequest, ResourceStatus, context_resource::Body,
    mcp_discovery::Phase,
};
use tokio_util::sync::CancellationToken;

use crate::discovery::{self, DiscoverySettings};
use crate::report::Report;

/// Runs the initial discovery to completion (every server succeeded, failed or
/// timed out), closes every connection and returns the report.
pub async fn discover_once(settings: DiscoverySettings) -> Report {
    let shutdown = CancellationToken::new();
    let handle = discovery::start(settings, shutdown.clone());
    let mut reports = handle.reports();
    let report = reports
        .wait_for(|r| r.phase == Phase::Complete)
        .await
        .map(|r| (**r).clone())
        .unwrap_or_else(|_| (**reports.borrow()).clone());
    shutdown.cancel();
    handle.join().await;
    report
}

/// The report as the push the agent would send (proto3 JSON mapping).
pub fn to_json(report: &Report, run_id: &str) -> String {
    let push: PushContextStateRequest = report.to_push(run_id, 1, true);
    serde_json::to_string_pretty(&push).expect("protobuf messages serialize to JSON")
}

fn status_name(status: i32) -> &'static str {
    match ResourceStatus::try_from(status) {
        Ok(ResourceStatus::Ok) => "ok",
        Ok(ResourceStatus::Invalid) => "invalid",
        Ok(ResourceStatus::Unreadable) => "unreadable",
        Ok(ResourceStatus::Oversize) => "oversize",
        Ok(ResourceStatus::Excluded) => "excluded",
        Ok(ResourceStatus::Disabled) => "disabled",
        _ => "unspecified",
    }
}

fn config_table(config: &ContextConfig) -> String {
    let mut out = String::from("context config\n");
    let list = |v: &[String]| {
        if v.is_empty() {
            "(none)".to_owned()
        } else {
            v.join(", ")
        }
    };
    let rows = [
        ("working dir", config.working_dir.clone()),
        ("instructions dirs", list(&config.instructions_dirs)),
        ("instructions file", config.instructions_file.clone()),
        ("skills dirs", list(&config.skills_dirs)),
        ("skill meta file", config.skill_meta_file.clone()),
        ("mcp config files", list(&config.mcp_config_files)),
    ];
    for (name, value) in rows {
        let _ = writeln!(out, "  {name:<18} {value}");
    }
    out
}

/// A table: the resolved config, the phase, one line per source.
pub fn to_table(report: &Report) -> String {
    let mut out = config_table(&report.context_config);
    let _ = writeln!(
        out,
        "\nmcp discovery phase: {}\n",
        report.phase.as_str_name()
    );
    let width = report
        .resources
        .iter()
        .map(|r| r.source.chars().count())
        .max()
        .unwrap_or(6)
        .clamp(6, 72);
    let _ = writeln!(out, "{:<width$}  {:<10}  DETAIL", "SOURCE", "STATUS");
    for resource in &report.resources {
        let detail = match &resource.body {
            Some(Body::InstructionFile(f)) => format!(
                "{} bytes{}",
                f.content.len(),
                if f.truncated { " (truncated)" } else { "" }
            ),
            Some(Body::Skill(s)) if !s.name.is_empty() => format!("{}: {}", s.name, s.description),
            Some(Body::McpConfig(c)) => format!("servers: {}", c.server_names.join(", ")),
            Some(Body::McpServer(s)) => {
                let transport = match s.transport {
                    1 => "stdio",
                    2 => "streamable_http",
                    _ => "?",
                };
                let names: Vec<&str> = s.tools.iter().map(|t| t.name.as_str()).collect();
                format!("{transport}, {} tools: {}", s.tools.len(), names.join(", "))
            }
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "{:<width$}  {:<10}  {}",
            resource.source,
            status_name(resource.status),
            one_line(&detail)
        );
        if !resource.error.is_empty() {
            let _ = writeln!(
                out,
                "{:<width$}  {:<10}  error: {}",
                "",
                "",
                one_line(&resource.error)
            );
        }
        if !resource.warning.is_empty() {
            let _ = writeln!(
                out,
                "{:<width$}  {:<10}  warning: {}",
                "",
                "",
                one_line(&resource.warning)
            );
        }
    }
    if report.resources.is_empty() {
        out.push_str("(no context sources found)\n");
    }
    out
}

fn one_line(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    crate::text::clamp(&flat, 400)
}
