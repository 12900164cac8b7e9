//! Push commit throughput through agent-ingest's HTTP API: concurrent agents,
//! protobuf bodies, different content on every push.

use std::time::{Duration, Instant};

use ctxsync_proto::v1::{
    ContextConfig, ContextResource, InstructionFile, McpConfig, McpDiscovery, McpServer, McpTool,
    McpTransport, PushContextStateRequest, PushContextStateResponse, ResourceKind, ResourceStatus,
    Skill, StartupRequest, StartupResponse, context_resource::Body, mcp_discovery::Phase,
};
use prost::Message;

use crate::env::{BenchAgent, Env};
use crate::stats::Latency;
use crate::steps::{BenchError, Sizes, Step};

#[derive(Debug, Clone, Default)]
pub struct PushThroughput {
    pub agents: usize,
    pub pushes: u64,
    pub per_second: f64,
    pub latency: Latency,
}

fn resource(source: String, kind: ResourceKind, body: Body) -> ContextResource {
    ContextResource {
        source,
        kind: kind as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(body),
        ..Default::default()
    }
}

/// A server resource offering `tools`.
pub fn server(name: &str, tools: &[String]) -> ContextResource {
    resource(
        format!("mcp_server:{name}"),
        ResourceKind::McpServer,
        Body::McpServer(McpServer {
            name: name.to_owned(),
            transport: McpTransport::Stdio as i32,
            config_path: "/bench/.mcp.json".into(),
            tools: tools
                .iter()
                .map(|tool| McpTool {
                    name: tool.clone(),
                    description: format!("bench tool {tool}"),
                    input_schema_json:
                        r#"{"type":"object","properties":{"path":{"type":"string"}}}"#.into(),
                })
                .collect(),
        }),
    )
}

/// The five resources of a bench push; `counter` changes the content.
pub fn resources(counter: u64) -> Vec<ContextResource> {
    let filler = "Follow the project's conventions. ".repeat(30);
    vec![
        resource(
            "instruction_file:/bench/AGENTS.md".into(),
            ResourceKind::InstructionFile,
            Body::InstructionFile(InstructionFile {
                path: "/bench/AGENTS.md".into(),
                content: format!("# Bench workspace, revision {counter}\n{filler}"),
                truncated: false,
            }),
        ),
        resource(
            "instruction_file:/home/bench/.ctxsync/AGENTS.md".into(),
            ResourceKind::InstructionFile,
            Body::InstructionFile(InstructionFile {
                path: "/home/bench/.ctxsync/AGENTS.md".into(),
                content: "Be brief.".into(),
                truncated: false,
            }),
        ),
        resource(
            "skill:/bench/.agents/skills/review".into(),
            ResourceKind::Skill,
            Body::Skill(Skill {
                dir: "/bench/.agents/skills/review".into(),
                name: "review".into(),
                description: "Review a change".into(),
            }),
        ),
        resource(
            "mcp_config:/bench/.mcp.json".into(),
            ResourceKind::McpConfig,
            Body::McpConfig(McpConfig {
                path: "/bench/.mcp.json".into(),
                server_names: vec!["files".into()],
            }),
        ),
        server("files", &["read".to_owned(), "write".to_owned()]),
    ]
}

pub fn push_request(
    run_id: &str,
    version: u64,
    phase: Phase,
    resources: Vec<ContextResource>,
) -> PushContextStateRequest {
    PushContextStateRequest {
        agent_run_id: run_id.to_owned(),
        version,
        initial: version == 1,
        mcp_discovery: Some(McpDiscovery {
            phase: phase as i32,
        }),
        resources,
        context_config: Some(ContextConfig {
            working_dir: "/bench".into(),
            instructions_file: "AGENTS.md".into(),
            ..Default::default()
        }),
    }
}

async fn post<Resp: Message + Default>(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    body: Vec<u8>,
) -> Result<Resp, String> {
    let response = http
        .post(url)
        .bearer_auth(token)
        .header("content-type", "application/x-protobuf")
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
    }
    Resp::decode(bytes).map_err(|e| e.to_string())
}

/// Startup and a first push (unmeasured): the token is verified and cached,
/// the connection open, the snapshot row exists.
async fn start_agent(
    http: &reqwest::Client,
    base: &str,
    agent: &BenchAgent,
) -> Result<String, String> {
    let run_id = crate::env::run_id();
    let _: StartupResponse = post(
        http,
        &format!("{base}/api/v1/agent/startup"),
        &agent.token,
        StartupRequest {
            agent_run_id: run_id.clone(),
            agent_version: "bench".into(),
            ..Default::default()
        }
        .encode_to_vec(),
    )
    .await?;
    let body = push_request(&run_id, 1, Phase::Complete, resources(1)).encode_to_vec();
    let response: PushContextStateResponse = post(
        http,
        &format!("{base}/api/v1/agent/context-state"),
        &agent.token,
        body,
    )
    .await?;
    if !response.accepted {
        return Err(format!("first push dropped: {}", response.message));
    }
    Ok(run_id)
}

async fn agent_loop(
    http: reqwest::Client,
    url: String,
    agent: BenchAgent,
    run_id: String,
    started: Instant,
    window: Duration,
) -> Result<Vec<Duration>, String> {
    let mut latencies = Vec::new();
    let mut version = 1;
    while started.elapsed() < window {
        version += 1;
        let body =
            push_request(&run_id, version, Phase::Complete, resources(version)).encode_to_vec();
        let sent = Instant::now();
        let response: PushContextStateResponse = post(&http, &url, &agent.token, body).await?;
        if !response.accepted {
            return Err(format!("push {version} dropped: {}", response.message));
        }
        latencies.push(sent.elapsed());
    }
    Ok(latencies)
}

pub async fn throughput(env: &Env, sizes: &Sizes) -> Result<PushThroughput, BenchError> {
    let clients = sizes.throughput_clients;
    let agents = env.register_agents("push", clients).await?;
    let http = reqwest::Client::new();
    // Agents spread over the agent-ingest replicas (one in single mode).
    let bases: Vec<String> = (0..agents.len())
        .map(|i| format!("http://{}", env.ingest_addrs[i % env.ingest_addrs.len()]))
        .collect();
    let mut run_ids = Vec::with_capacity(agents.len());
    for result in futures::future::join_all(
        agents
            .iter()
            .zip(&bases)
            .map(|(a, base)| start_agent(&http, base, a)),
    )
    .await
    {
        run_ids.push(result.step("push through agent-ingest")?);
    }
    let started = Instant::now();
    let workers = agents
        .into_iter()
        .zip(run_ids)
        .zip(bases)
        .map(|((agent, run_id), base)| {
            tokio::spawn(agent_loop(
                http.clone(),
                format!("{base}/api/v1/agent/context-state"),
                agent,
                run_id,
                started,
                sizes.throughput_window,
            ))
        });
    let mut latencies = Vec::new();
    for worker in futures::future::join_all(workers).await {
        latencies.extend(
            worker
                .step("push worker")?
                .step("push through agent-ingest")?,
        );
    }
    let elapsed = started.elapsed().as_secs_f64();
    let pushes = latencies.len() as u64;
    Ok(PushThroughput {
        agents: clients,
        pushes,
        per_second: pushes as f64 / elapsed,
        latency: Latency::of(latencies),
    })
}
