//! The `ctxsync up --demo` walkthrough: register an agent, run a real
//! workspace-agent process against a copy of the demo workspace, ask the gate
//! for a chat's first turn while discovery is still pending, and print the
//! timeline and the context the chat gets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use ctxsync_proto::rpc::gate;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    DiscoveryChanged, TurnReply, TurnRequest, discovery_changed::Cause, mcp_discovery::Phase,
};
use ctxsync_runtime::{Shutdown, rpc};
use futures::StreamExt;
use prost::Message;
use serde_json::json;

use ctxsync_stack::deps::Dependency;

pub struct DemoSetup<'a> {
    pub nats: &'a Dependency,
    pub subjects: &'a Subjects,
    pub ingest_url: String,
    pub data_dir: &'a Path,
    pub workspace: &'a Path,
}

/// How long the demo waits for each step before it gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

struct Timeline {
    start: Instant,
}

impl Timeline {
    fn mark(&self, event: &str, detail: &str) {
        println!(
            "  {:>8.1} ms  {event:<22} {detail}",
            self.start.elapsed().as_secs_f64() * 1000.0
        );
    }
}

fn reference_servers_dir() -> PathBuf {
    std::env::var_os("CTXSYNC_MCP_SERVERS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ctxsync/mcp-servers"))
        })
        .unwrap_or_default()
}

/// The stdio MCP servers the demo can run: our fixture and whichever
/// reference servers are installed, plus notes on what is missing.
fn demo_servers(demo_dir: &Path) -> (Vec<DemoServer>, Vec<String>) {
    let mut servers = Vec::new();
    let mut notes = Vec::new();
    match sibling_binary("mcp-fixture") {
        Some(fixture) => servers.push(DemoServer {
            name: "notes",
            command: fixture,
            args: vec!["--mode", "normal"],
            env: json!({}),
        }),
        None => notes.push("mcp-fixture not found next to ctxsync or on PATH".to_owned()),
    }
    let refs = reference_servers_dir();
    let bin = refs.join("node_modules/.bin");
    let candidates: [(&str, PathBuf, serde_json::Value); 3] = [
        (
            "memory",
            bin.join("mcp-server-memory"),
            json!({ "MEMORY_FILE_PATH": demo_dir.join("memory.jsonl") }),
        ),
        ("everything", bin.join("mcp-server-everything"), json!({})),
        ("time", refs.join("venv/bin/mcp-server-time"), json!({})),
    ];
    for (name, command, env) in candidates {
        if command.is_file() {
            servers.push(DemoServer {
                name,
                command,
                args: Vec::new(),
                env,
            });
        } else {
            notes.push(format!(
                "reference server {name} not installed (bash tests/mcp-servers/install.sh)"
            ));
        }
    }
    (servers, notes)
}

struct DemoServer {
    name: &'static str,
    command: PathBuf,
    args: Vec<&'static str>,
    env: serde_json::Value,
}

/// The demo tenant's catalog: the same servers, operator-configured.
pub fn catalog_config(data_dir: &Path) -> anyhow::Result<catalog::config::CatalogConfig> {
    let demo_dir = data_dir.join("demo");
    std::fs::create_dir_all(&demo_dir)?;
    let (servers, _) = demo_servers(&demo_dir);
    let servers: Vec<_> = servers
        .into_iter()
        .map(|s| {
            json!({
                "id": s.name,
                "transport": { "stdio": { "command": s.command, "args": s.args, "env": s.env } }
            })
        })
        .collect();
    // YAML is a superset of JSON.
    let yaml =
        serde_json::to_string(&json!({ "tenants": [{ "id": "demo", "servers": servers }] }))?;
    catalog::config::CatalogConfig::from_yaml(&yaml).map_err(anyhow::Error::msg)
}

/// The demo's `.mcp.json`: the demo servers, and one server that cannot
/// start (to show a failed outcome).
fn demo_mcp_config(demo_dir: &Path) -> (serde_json::Value, Vec<String>) {
    let mut servers = serde_json::Map::new();
    let (found, notes) = demo_servers(demo_dir);
    for s in found {
        servers.insert(
            s.name.into(),
            json!({ "command": s.command, "args": s.args, "env": s.env }),
        );
    }
    servers.insert(
        "broken".into(),
        json!({
            "command": demo_dir.join("no-such-mcp-server"),
            "env": { "BROKEN_API_TOKEN": "demo-secret-never-shown" }
        }),
    );
    (json!({ "mcpServers": servers }), notes)
}

async fn next_event(events: &mut async_nats::Subscriber) -> anyhow::Result<DiscoveryChanged> {
    let message = tokio::time::timeout(STEP_TIMEOUT, events.next())
        .await
        .context("no discovery event within 60 s")?
        .context("event subscription closed")?;
    Ok(DiscoveryChanged::decode(message.payload)?)
}

pub async fn run(setup: &DemoSetup<'_>, shutdown: Shutdown) -> anyhow::Result<()> {
    let timeline = Timeline {
        start: Instant::now(),
    };
    let nats = ctxsync_runtime::nats::connect(&setup.nats.url, "ctxsync-demo").await?;
    let client = &nats.client;
    println!("demo");

    let name = format!("demo-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let registered = crate::agent::register(
        client,
        setup.subjects,
        Duration::from_secs(5),
        "demo",
        "demo",
        &name,
    )
    .await?;
    let agent_id = registered.agent_id.clone();
    timeline.mark("registered", &format!("agent {agent_id} ({name})"));

    let demo_dir = setup.data_dir.join("demo").join(&name);
    let workspace = demo_dir.join("workspace");
    copy_tree(setup.workspace, &workspace).with_context(|| {
        format!(
            "cannot copy the demo workspace {} (CTXSYNC_DEMO_WORKSPACE; run from the repository root)",
            setup.workspace.display()
        )
    })?;
    let (mcp_config, notes) = demo_mcp_config(&demo_dir);
    std::fs::write(
        workspace.join(".mcp.json"),
        serde_json::to_vec_pretty(&mcp_config)?,
    )?;
    for note in notes {
        println!("  note: {note}");
    }
    let token_file = demo_dir.join("token");
    std::fs::write(&token_file, &registered.token)?;

    let mut events = client
        .subscribe(setup.subjects.discovery_changed(&agent_id))
        .await?;
    // The gate announces each first-turn wait; the catalog records it for
    // `ctxsync latency`. Seeing the announcement before returning means a
    // `--exit-after-demo` stop cannot outrun it.
    let mut waits = client.subscribe(setup.subjects.gate_turn_waited()).await?;
    ctxsync_runtime::nats::sync_with_server(client).await?;

    let agent_binary = sibling_binary("workspace-agent")
        .context("workspace-agent not found next to ctxsync or on PATH: build it (cargo build)")?;
    let mut env: BTreeMap<&str, &std::ffi::OsStr> = BTreeMap::new();
    env.insert("CTXSYNC_INGEST_URL", setup.ingest_url.as_ref());
    env.insert("CTXSYNC_AGENT_TOKEN_FILE", token_file.as_os_str());
    env.insert("CTXSYNC_WORKDIR", workspace.as_os_str());
    env.insert("CTXSYNC_INSTRUCTIONS_DIRS", demo_dir.as_os_str());
    env.insert("CTXSYNC_LOG", "warn".as_ref());
    let mut agent = tokio::process::Command::new(agent_binary)
        .envs(env)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("cannot start workspace-agent")?;

    let mut gate_answer = None;
    let answer = loop {
        let event = tokio::select! {
            event = next_event(&mut events) => event?,
            reply = async { gate_answer.as_mut().expect("guarded").await }, if gate_answer.is_some() => {
                break reply?;
            }
        };
        match (event.cause(), event.phase()) {
            (Cause::Startup, _) => timeline.mark("startup", &format!("run {}", event.agent_run_id)),
            (Cause::Push, Phase::Pending) => {
                timeline.mark(
                    "pending",
                    "first report committed, MCP servers still starting",
                );
                let (client, subjects, agent_id) =
                    (client.clone(), setup.subjects.clone(), agent_id.clone());
                timeline.mark("chat asks first turn", "chat demo-chat-1 waits on the gate");
                gate_answer = Some(Box::pin(async move {
                    rpc::call_for_tenant::<gate::Turn>(
                        &client,
                        &subjects,
                        "demo",
                        &TurnRequest {
                            chat_id: "demo-chat-1".into(),
                            agent_id,
                            first_turn: true,
                            tenant: "demo".into(),
                        },
                        None,
                        STEP_TIMEOUT,
                    )
                    .await
                    .map_err(|error| match error {
                        rpc::RpcError::Service { message, .. } => {
                            anyhow::anyhow!("the gate refused the turn: {message}")
                        }
                        error => error.into(),
                    })
                }));
            }
            (Cause::Push, Phase::Complete) => {
                timeline.mark("complete", "initial MCP discovery finished");
            }
            (_, phase) => timeline.mark("event", phase.as_str_name()),
        }
    };
    timeline.mark(
        "gate answered",
        &format!(
            "{} after waiting {} ms",
            answer.decision().as_str_name(),
            answer.waited_ms
        ),
    );
    print_projection(&answer);
    if !wait_announced(&mut waits).await {
        println!(
            "  note: the gate's wait announcement did not arrive within 5 s; `ctxsync latency` may miss it"
        );
    }

    if shutdown.is_cancelled() {
        let _ = agent.start_kill();
    } else {
        // The agent keeps publishing changes until ctxsync stops.
        tokio::spawn(async move {
            shutdown.cancelled().await;
            if let Some(pid) = agent.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let _ = tokio::time::timeout(Duration::from_secs(10), agent.wait()).await;
        });
    }
    Ok(())
}

/// Whether the gate announced the demo tenant's wait before the deadline.
async fn wait_announced(waits: &mut async_nats::Subscriber) -> bool {
    let announced = async {
        while let Some(message) = waits.next().await {
            let wait = ctxsync_proto::v1::GateTurnWaited::decode(message.payload);
            if wait.is_ok_and(|wait| wait.tenant == "demo") {
                return true;
            }
        }
        false
    };
    tokio::time::timeout(Duration::from_secs(5), announced)
        .await
        .unwrap_or(false)
}

fn print_projection(reply: &TurnReply) {
    let Some(projection) = &reply.projection else {
        println!("  (no projection)");
        return;
    };
    println!("context for the first turn");
    println!("  summary: {}", projection.summary);
    for server in &projection.servers {
        let names: Vec<&str> = server.tools.iter().map(|t| t.name.as_str()).collect();
        let shown = names.iter().take(6).copied().collect::<Vec<_>>().join(", ");
        let more = names.len().saturating_sub(6);
        println!(
            "  server {:<12} {} tools: {shown}{}",
            server.name,
            names.len(),
            if more > 0 {
                format!(", … (+{more})")
            } else {
                String::new()
            }
        );
    }
    for failed in &projection.failed_servers {
        println!("  failed {:<12} {}", failed.name, failed.error);
    }
    for file in &projection.instruction_files {
        println!(
            "  instructions {} ({} bytes)",
            file.path,
            file.content.len()
        );
    }
    for skill in &projection.skills {
        println!("  skill {}: {}", skill.name, skill.description);
    }
    if let Some(catalog) = &projection.catalog {
        println!(
            "  catalog {}{}",
            catalog.status().as_str_name(),
            if catalog.error.is_empty() {
                String::new()
            } else {
                format!(": {}", catalog.error)
            }
        );
        for pin in &catalog.pins {
            println!(
                "    pin {:<12} {} ({} tools{})",
                pin.server_id,
                pin.source().as_str_name(),
                pin.tools.len(),
                if pin.handshake_ms > 0 {
                    format!(", handshake {} ms", pin.handshake_ms)
                } else {
                    String::new()
                }
            );
        }
    }
}

/// A file next to the running binary, else on PATH.
pub fn sibling_binary(name: &str) -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(name)))
        .filter(|p| p.is_file());
    beside.or_else(|| {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// Copies a directory tree (small: the demo workspace).
pub fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
