//! The discovery report and the ingest limits it is kept within.
//!
//! Rather than send something agent-ingest rejects as a whole, the agent cleans
//! control characters (NUL among them) from every text, cuts
//! error and warning texts to 4096 bytes, shortens over-long `source` keys
//! (keeping them unique with a hash), marks a resource whose body is over
//! 256 KiB `oversize` (its bulky content removed), keeps at most 1000
//! resources (MCP rows first, then instruction files, then skills) and keeps the
//! whole push under the 4 MiB request limit the same way.

use std::sync::Arc;

use ctxsync_proto::limits;
use ctxsync_proto::v1::{
    self, ContextResource, McpDiscovery, PushContextStateRequest, ResourceKind, ResourceStatus,
    context_resource::Body, mcp_discovery::Phase,
};
use prost::Message;
use sha2::{Digest, Sha256};

use crate::text::{clamp, floor_char_boundary};

/// What the agent knows at one moment; the publisher turns it into a push.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub context_config: v1::ContextConfig,
    pub phase: Phase,
    pub resources: Vec<ContextResource>,
}

pub type SharedReport = Arc<Report>;

impl Report {
    pub fn to_push(&self, run_id: &str, version: u64, initial: bool) -> PushContextStateRequest {
        PushContextStateRequest {
            agent_run_id: run_id.to_owned(),
            version,
            initial,
            mcp_discovery: Some(McpDiscovery {
                phase: self.phase as i32,
            }),
            resources: self.resources.clone(),
            context_config: Some(self.context_config.clone()),
        }
    }

    /// The resource with this `source`, if any.
    pub fn resource(&self, source: &str) -> Option<&ContextResource> {
        self.resources.iter().find(|r| r.source == source)
    }
}

/// Room left in a request for everything but the resources.
const REQUEST_HEADROOM_BYTES: usize = 64 * 1024;

/// Applies every ingest limit (see the module docs), after
/// [`clean_resources`] (cleaning can change a text's length).
pub fn enforce_limits(mut resources: Vec<ContextResource>) -> Vec<ContextResource> {
    enforce_each(&mut resources);
    enforce_total(resources)
}

/// The limits of one resource at a time (cleaning, text and body sizes):
/// done once when a row is made, so a report is only put together.
pub fn enforce_each(resources: &mut [ContextResource]) {
    clean_resources(resources);
    for resource in resources.iter_mut() {
        if resource.error.len() > limits::MAX_ERROR_BYTES {
            resource.error = clamp(&resource.error, limits::MAX_ERROR_BYTES);
        }
        if resource.warning.len() > limits::MAX_ERROR_BYTES {
            resource.warning = clamp(&resource.warning, limits::MAX_ERROR_BYTES);
        }
        if resource.source.len() > limits::MAX_SOURCE_BYTES {
            resource.source = shorten_source(&resource.source);
        }
        let size = body_len(resource);
        if size > limits::MAX_RESOURCE_BODY_BYTES {
            mark_oversize(resource, size, limits::MAX_RESOURCE_BODY_BYTES, "resource");
        }
    }
}

/// The limits of a whole push (resource count, request size), over rows
/// [`enforce_each`] has seen.
pub fn enforce_total(mut resources: Vec<ContextResource>) -> Vec<ContextResource> {
    if resources.len() > limits::MAX_RESOURCES {
        let rank = |r: &ContextResource| match ResourceKind::try_from(r.kind) {
            Ok(ResourceKind::McpConfig) => 0,
            Ok(ResourceKind::McpServer) => 1,
            Ok(ResourceKind::InstructionFile) => 2,
            _ => 3,
        };
        tracing::warn!(
            count = resources.len(),
            limit = limits::MAX_RESOURCES,
            "more context sources than one push may carry; the excess (skills first) is left out"
        );
        resources.sort_by_key(rank);
        resources.truncate(limits::MAX_RESOURCES);
    }
    let budget = limits::MAX_REQUEST_BYTES - REQUEST_HEADROOM_BYTES;
    let mut total: usize = resources.iter().map(|r| r.encoded_len() + 4).sum();
    while total > budget {
        let Some(largest) = resources
            .iter_mut()
            .filter(|r| r.status != ResourceStatus::Oversize as i32)
            .max_by_key(|r| body_len(r))
        else {
            break;
        };
        let before = largest.encoded_len();
        let size = body_len(largest);
        mark_oversize(largest, size, budget, "push");
        total = total - before + largest.encoded_len();
    }
    resources
}

/// The last pass before publication: no text the agent sends holds a control
/// character but `\n` and `\t` ([`ctxsync_mcp::clean_text`]), so nothing a
/// server or a file says can make ingest refuse the report (NUL is refused:
/// Postgres cannot store it). Sources and paths name things and stay
/// distinct: only NUL, which no path can hold, is replaced there.
pub fn clean_resources(resources: &mut [ContextResource]) {
    use ctxsync_mcp::clean_string as clean;
    for resource in resources {
        replace_nul(&mut resource.source);
        clean(&mut resource.error);
        clean(&mut resource.warning);
        match resource.body.as_mut() {
            None => {}
            Some(Body::InstructionFile(file)) => {
                replace_nul(&mut file.path);
                clean(&mut file.content);
            }
            Some(Body::Skill(skill)) => {
                replace_nul(&mut skill.dir);
                clean(&mut skill.name);
                clean(&mut skill.description);
            }
            Some(Body::McpConfig(config)) => {
                replace_nul(&mut config.path);
                config.server_names.iter_mut().for_each(clean);
            }
            Some(Body::McpServer(server)) => {
                clean(&mut server.name);
                replace_nul(&mut server.config_path);
                for tool in &mut server.tools {
                    clean(&mut tool.name);
                    clean(&mut tool.description);
                    // JSON text from the client escapes control characters;
                    // any other source must not smuggle a NUL in.
                    replace_nul(&mut tool.input_schema_json);
                }
            }
        }
    }
}

fn replace_nul(text: &mut String) {
    if text.contains('\0') {
        *text = text.replace('\0', "\u{fffd}");
    }
}

fn body_len(resource: &ContextResource) -> usize {
    resource.body.as_ref().map_or(0, |body| match body {
        Body::InstructionFile(b) => b.encoded_len(),
        Body::Skill(b) => b.encoded_len(),
        Body::McpConfig(b) => b.encoded_len(),
        Body::McpServer(b) => b.encoded_len(),
    })
}

/// Keeps the body's identity (path, name) and drops its bulk.
fn mark_oversize(resource: &mut ContextResource, size: usize, limit: usize, what: &str) {
    let dropped = match resource.body.as_mut() {
        Some(Body::InstructionFile(b)) => {
            b.content.clear();
            "content"
        }
        Some(Body::Skill(b)) => {
            b.description.clear();
            "description"
        }
        Some(Body::McpConfig(b)) => {
            b.server_names.clear();
            "server names"
        }
        Some(Body::McpServer(b)) => {
            b.tools.clear();
            "tools"
        }
        None => "nothing",
    };
    resource.status = ResourceStatus::Oversize as i32;
    resource.error = clamp(
        &format!(
            "encodes to {size} bytes, over the {limit}-byte {what} limit; its {dropped} are not sent"
        ),
        limits::MAX_ERROR_BYTES,
    );
}

/// `kind:` + as much of the rest as fits + `…#` + 16 hex digits of its SHA-256.
pub fn shorten_source(source: &str) -> String {
    let digest = hex::encode(Sha256::digest(source.as_bytes()));
    let suffix = format!("…#{}", &digest[..16]);
    let keep = floor_char_boundary(source, limits::MAX_SOURCE_BYTES - suffix.len());
    format!("{}{suffix}", &source[..keep])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(name: &str, tools: usize, schema_bytes: usize) -> ContextResource {
        ContextResource {
            source: format!("mcp_server:{name}"),
            kind: ResourceKind::McpServer as i32,
            status: ResourceStatus::Ok as i32,
            body: Some(Body::McpServer(v1::McpServer {
                name: name.into(),
                tools: (0..tools)
                    .map(|i| v1::McpTool {
                        name: format!("t{i}"),
                        description: String::new(),
                        input_schema_json: "x".repeat(schema_bytes),
                    })
                    .collect(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn long_texts_and_sources_are_cut_to_the_limits() {
        let mut r = server("s", 1, 10);
        r.error = "e".repeat(10_000);
        r.warning = "w".repeat(5_000);
        let long_a = format!("instruction_file:/{}a", "d".repeat(2000));
        let long_b = format!("instruction_file:/{}b", "d".repeat(2000));
        let mut a = r.clone();
        a.source = long_a;
        let mut b = r.clone();
        b.source = long_b;
        let out = enforce_limits(vec![r, a, b]);
        for r in &out {
            assert!(r.error.len() <= limits::MAX_ERROR_BYTES);
            assert!(r.warning.len() <= limits::MAX_ERROR_BYTES);
            assert!(r.source.len() <= limits::MAX_SOURCE_BYTES);
        }
        assert_ne!(
            out[1].source, out[2].source,
            "shortened sources stay unique"
        );
        assert!(out[1].source.starts_with("instruction_file:/ddd"));
    }

    #[test]
    fn every_text_is_cleaned_of_control_characters_before_publication() {
        let mut failed = server("s", 2, 0);
        failed.error = "stderr: \0\0\u{1b}[31mboom\u{1b}[0m".into();
        failed.warning = "w\u{7}".into();
        if let Some(Body::McpServer(body)) = failed.body.as_mut() {
            body.tools[0].name = "t\0".into();
            body.tools[1].description = "d\r\n\0".into();
            body.tools[1].input_schema_json = "{\"a\":\"\0\"}".into();
        }
        let file = ContextResource {
            source: "instruction_file:/w/A\0.md".into(),
            kind: ResourceKind::InstructionFile as i32,
            status: ResourceStatus::Ok as i32,
            body: Some(Body::InstructionFile(v1::InstructionFile {
                path: "/w/A\0.md".into(),
                content: "line\n\tindented\0".into(),
                truncated: false,
            })),
            ..Default::default()
        };
        let out = enforce_limits(vec![failed, file]);
        assert_eq!(out[0].error, "stderr: \u{fffd}\u{fffd}boom");
        assert_eq!(out[0].warning, "w\u{fffd}");
        let Some(Body::McpServer(body)) = &out[0].body else {
            panic!()
        };
        assert_eq!(body.tools[0].name, "t\u{fffd}");
        assert_eq!(body.tools[1].description, "d\n\u{fffd}");
        assert_eq!(body.tools[1].input_schema_json, "{\"a\":\"\u{fffd}\"}");
        assert_eq!(out[1].source, "instruction_file:/w/A\u{fffd}.md");
        let Some(Body::InstructionFile(body)) = &out[1].body else {
            panic!()
        };
        assert_eq!(body.content, "line\n\tindented\u{fffd}");
        let push = Report {
            context_config: v1::ContextConfig::default(),
            phase: Phase::Pending,
            resources: out,
        }
        .to_push("run", 1, true);
        ctxsync_proto::validate::push(&push).expect("the cleaned report is valid");
    }

    #[test]
    fn an_oversize_body_is_marked_and_emptied() {
        let out = enforce_limits(vec![server("big", 300, 1024), server("small", 2, 10)]);
        assert_eq!(out[0].status, ResourceStatus::Oversize as i32);
        assert!(out[0].error.contains("262144-byte"), "{}", out[0].error);
        let Some(Body::McpServer(body)) = &out[0].body else {
            panic!()
        };
        assert!(body.tools.is_empty());
        assert_eq!(body.name, "big");
        assert_eq!(out[1].status, ResourceStatus::Ok as i32);
    }

    #[test]
    fn too_many_resources_keep_mcp_rows_first() {
        let mut resources: Vec<ContextResource> = (0..1100)
            .map(|i| ContextResource {
                source: format!("skill:/s/{i}"),
                kind: ResourceKind::Skill as i32,
                status: ResourceStatus::Ok as i32,
                ..Default::default()
            })
            .collect();
        resources.push(server("s", 1, 1));
        let out = enforce_limits(resources);
        assert_eq!(out.len(), limits::MAX_RESOURCES);
        assert_eq!(out[0].source, "mcp_server:s");
    }

    #[test]
    fn the_whole_push_stays_under_the_request_limit() {
        // 20 servers of ~250 KiB each: each fits alone, together they do not.
        let resources: Vec<ContextResource> = (0..20)
            .map(|i| server(&format!("s{i}"), 250, 1000))
            .collect();
        let out = enforce_limits(resources);
        let total: usize = out.iter().map(|r| r.encoded_len() + 4).sum();
        assert!(total <= limits::MAX_REQUEST_BYTES - REQUEST_HEADROOM_BYTES);
        assert!(out.iter().any(|r| r.status == ResourceStatus::Ok as i32));
        assert!(
            out.iter()
                .any(|r| r.status == ResourceStatus::Oversize as i32)
        );
    }
}
