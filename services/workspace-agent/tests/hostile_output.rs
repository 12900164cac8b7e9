//! A workspace whose MCP servers and files say hostile things (NUL bytes and
//! terminal escapes on stderr, in tool descriptions, in instruction files and
//! skill front matter) still publishes: against the real agent-ingest,
//! snapshot-store, nats-server and Postgres, the report is committed COMPLETE
//! with every row, its texts cleaned.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, ContextResource, ResourceStatus, context_resource::Body, mcp_discovery::Phase,
};
use ctxsync_runtime::Shutdown;
use futures::StreamExt;
use testkit::stack::TestStack;
use testkit::store::StoreClient;
use workspace_agent::{AgentConfig, AgentToken, Backoff, PublisherConfig};

/// Every text of a resource (sources and paths included).
fn texts(resource: &ContextResource) -> Vec<&str> {
    let mut out = vec![
        resource.source.as_str(),
        resource.error.as_str(),
        resource.warning.as_str(),
    ];
    match &resource.body {
        None => {}
        Some(Body::InstructionFile(f)) => out.extend([f.path.as_str(), f.content.as_str()]),
        Some(Body::Skill(s)) => {
            out.extend([s.dir.as_str(), s.name.as_str(), s.description.as_str()])
        }
        Some(Body::McpConfig(c)) => {
            out.push(c.path.as_str());
            out.extend(c.server_names.iter().map(String::as_str));
        }
        Some(Body::McpServer(s)) => {
            out.extend([s.name.as_str(), s.config_path.as_str()]);
            for tool in &s.tools {
                out.extend([
                    tool.name.as_str(),
                    tool.description.as_str(),
                    tool.input_schema_json.as_str(),
                ]);
            }
        }
    }
    out
}

fn row<'a>(state: &'a AgentState, source: &str) -> &'a ContextResource {
    state
        .resources
        .iter()
        .find(|r| r.source == source)
        .unwrap_or_else(|| panic!("no {source} row in {:#?}", state.resources))
}

#[tokio::test]
async fn hostile_server_output_and_files_are_cleaned_and_published() {
    let stack = TestStack::private().await;
    let (nats, prefix) = (&stack.nats, &stack.prefix);
    let shutdown = Shutdown::new();
    let services =
        testkit::stack::start(stack.builder().store(|_| {}).ingest(|_| {}), &shutdown).await;
    let ingest = services.ingest();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = Subjects::new(prefix).unwrap();
    let store = StoreClient::new(
        client.clone(),
        subjects.clone(),
        Duration::from_secs(10),
        "ws",
    )
    .retrying_no_responders();
    let token = format!("tok_{}", uuid::Uuid::new_v4().simple());
    let agent_id = store.register("hostile", &token).await;
    let mut commits = testkit::subscribe(&client, subjects.snapshot_committed(&agent_id)).await;

    let ws = Workspace::new();
    std::fs::write(
        ws.work().join("AGENTS.md"),
        "be brief\0\r\n\u{1b}[31mred\u{1b}[0m\n",
    )
    .unwrap();
    let skill = ws.work().join(".agents/skills/review");
    std::fs::create_dir_all(&skill).unwrap();
    std::fs::write(
        skill.join("SKILL.md"),
        "---\nname: \"review\\0\"\ndescription: \"Reviews\\e[1m code\\0\"\n---\n",
    )
    .unwrap();
    ws.write_servers(&[
        ("crashing", fixture(&["--mode", "crash-nul"])),
        ("described", fixture(&["--mode", "nul-tools"])),
        ("plain", fixture(&["--mode", "normal"])),
    ]);

    let mut publisher = PublisherConfig::new(
        format!("http://{}", ingest.http_addr()),
        AgentToken::new(&token),
    );
    publisher.backoff = Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(500),
    };
    let agent_shutdown = Shutdown::new();
    let agent = workspace_agent::start(
        AgentConfig {
            discovery: ws.settings(Duration::from_secs(20)),
            publisher,
            watch: false,
            watch_debounce: Duration::from_millis(100),
            http_addr: None,
            http_limits: Default::default(),
        },
        agent_shutdown.clone(),
    )
    .await
    .unwrap();

    // Woken by commits, bounded: the COMPLETE report of this run is stored.
    let deadline = Instant::now() + DEADLINE;
    let state =
        loop {
            let state = store.state(&agent_id).await;
            if state.snapshot.as_ref().is_some_and(|s| {
                s.agent_run_id == agent.run_id() && s.phase == Phase::Complete as i32
            }) {
                break state;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, commits.next()).await {
                Ok(Some(_)) => {}
                _ => panic!(
                    "no COMPLETE report was stored; publish status {:?}, state {state:#?}",
                    agent.publish_status().borrow()
                ),
            }
        };

    let crashing = row(&state, "mcp_server:crashing");
    assert_eq!(crashing.status, ResourceStatus::Invalid as i32);
    assert!(
        crashing
            .error
            .contains("\u{fffd}\u{fffd}bad bytes\u{fffd} before failing"),
        "{}",
        crashing.error
    );
    let described = row(&state, "mcp_server:described");
    assert_eq!(described.status, ResourceStatus::Ok as i32);
    let Some(Body::McpServer(server)) = &described.body else {
        panic!("{described:?}")
    };
    assert_eq!(
        server.tools[0].description,
        "Returns its text\u{fffd} argument, loudly\u{fffd}"
    );
    assert_eq!(
        row(&state, "mcp_server:plain").status,
        ResourceStatus::Ok as i32
    );
    let agents_md = row(
        &state,
        &format!("instruction_file:{}", ws.work().join("AGENTS.md").display()),
    );
    let Some(Body::InstructionFile(file)) = &agents_md.body else {
        panic!("{agents_md:?}")
    };
    assert_eq!(file.content, "be brief\u{fffd}\nred\n");
    let review = row(&state, &format!("skill:{}", skill.display()));
    let Some(Body::Skill(front)) = &review.body else {
        panic!("{review:?}")
    };
    assert_eq!(
        (front.name.as_str(), front.description.as_str()),
        ("review\u{fffd}", "Reviews code\u{fffd}")
    );

    // No stored text holds a control character but newline and tab.
    for resource in &state.resources {
        for text in texts(resource) {
            assert!(
                !text
                    .chars()
                    .any(|c| c.is_control() && c != '\n' && c != '\t'),
                "{} holds a control character: {text:?}",
                resource.source
            );
        }
    }
    agent_shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), agent.join())
        .await
        .expect("agent stops in time");
    shutdown.cancel();
}
