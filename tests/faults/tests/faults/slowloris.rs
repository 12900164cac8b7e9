//! Slowloris on every HTTP listener: ~300 idle or partial-header
//! connections each, while a real request is still answered promptly, and
//! the server closes the slow connections after its header read timeout.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{Cluster, Summary, addr_of, all_ready, tagged_push, url_of};
use testkit::agent::FakeAgent;
use testkit::chat::http_turn;
use testkit::{NatsServer, Process, ProcessBuilder, TestDatabase};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SLOW_PER_LISTENER: usize = 300;
/// `CTXSYNC_HTTP_HEADER_TIMEOUT` of every process here.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// What "promptly" means for a real request among the slow connections.
const PROMPTLY: Duration = Duration::from_secs(3);

/// Opens `count` connections to `addr`: even ones send nothing, odd ones
/// half a request head and then nothing.
async fn open_slow(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut connections = Vec::with_capacity(count);
    for i in 0..count {
        let mut stream = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("slow connection {i} to {addr}: {e}"));
        if i % 2 == 1 {
            stream
                .write_all(
                    b"POST /api/v1/agent/context-state HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",
                )
                .await
                .expect("half a request head");
        }
        connections.push(stream);
    }
    connections
}

/// Waits until the server closed each connection (EOF or reset; whatever
/// it answered first, e.g. a 408, is read and ignored); returns how many it
/// closed by `deadline`.
async fn closed_by_server(connections: Vec<TcpStream>, deadline: tokio::time::Instant) -> usize {
    let waits = connections.into_iter().map(|mut stream| async move {
        let mut buffer = [0u8; 1024];
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    });
    futures::future::join_all(waits)
        .await
        .into_iter()
        .filter(|closed| *closed)
        .count()
}

async fn ready_promptly(http: &reqwest::Client, process: &Process) -> Duration {
    let started = Instant::now();
    let response = http
        .get(format!("{}/readyz", url_of(process)))
        .timeout(PROMPTLY)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{} /readyz among slow connections: {e}", process.name()));
    assert!(
        response.status().is_success(),
        "{} /readyz: {}",
        process.name(),
        response.status()
    );
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_connections_on_every_listener_neither_block_real_requests_nor_stay_open() {
    testkit::init_logs();
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    let header_timeout = format!("{}s", HEADER_TIMEOUT.as_secs());
    let with_timeout = |builder: ProcessBuilder| {
        builder
            .env("CTXSYNC_HTTP_HEADER_TIMEOUT", header_timeout.clone())
            .spawn()
    };
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("catalog.yaml");
    std::fs::write(&config, "tenants:\n  - id: acme\n    servers: []\n").unwrap();
    let mut store = with_timeout(cluster.store("store"));
    let mut ingest = with_timeout(cluster.ingest());
    let mut gate = with_timeout(cluster.gate("gate"));
    let mut catalog = with_timeout(cluster.catalog(&config));
    all_ready(&mut [&mut store, &mut ingest, &mut gate, &mut catalog]).await;
    let client = cluster.nats("faults-test").await;
    let store_client = cluster.store_client(&client.client);
    store_client.create_test_tenant_key().await;
    let ingest_url = url_of(&ingest);
    let mut agent = FakeAgent::register(&store_client, &ingest_url, "pusher").await;
    assert!(agent.startup().await.answer.is_accepted());
    let complete = tagged_push(agent.run_id(), 1, Phase::Complete);
    assert!(agent.push(&complete).await.answer.is_accepted());

    // The real workspace agent's listener (it reports an empty workspace).
    let workspace = tempfile::tempdir().unwrap();
    let worker = FakeAgent::register(&store_client, &ingest_url, "workspace").await;
    let token_file = workspace.path().join("token");
    std::fs::write(&token_file, worker.token()).unwrap();
    let mut workspace_agent = with_timeout(
        ProcessBuilder::binary("workspace-agent", "workspace-agent")
            .env("CTXSYNC_INGEST_URL", ingest_url.clone())
            .env("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string())
            .env("CTXSYNC_WORKDIR", workspace.path().display().to_string())
            .env("HOME", workspace.path().display().to_string())
            .env("CTXSYNC_HTTP_ADDR", testkit::free_addr().to_string()),
    );
    workspace_agent.wait_ready(faults::READY_WITHIN).await;

    let listeners = [&store, &ingest, &gate, &catalog, &workspace_agent];
    let mut slow = Vec::new();
    for process in listeners {
        slow.push((
            process.name().to_owned(),
            open_slow(addr_of(process), SLOW_PER_LISTENER).await,
        ));
    }
    let opened_at = tokio::time::Instant::now();

    // Real requests are still answered, promptly.
    let mut slowest = Duration::ZERO;
    let started = Instant::now();
    let push = tagged_push(agent.run_id(), 2, Phase::Complete);
    let pushed = agent.push(&push).await.clone();
    assert!(
        pushed.answer.is_accepted(),
        "a push among slow connections: {:?}",
        pushed.answer
    );
    assert!(
        pushed.elapsed < PROMPTLY,
        "the push took {:?}",
        pushed.elapsed
    );
    slowest = slowest.max(started.elapsed());
    let turn = http_turn(
        &cluster.http,
        addr_of(&gate),
        "chat",
        agent.agent_id(),
        true,
        PROMPTLY,
    )
    .await;
    assert!(
        turn.is("ready"),
        "a turn among slow connections: {}",
        turn.decision()
    );
    slowest = slowest.max(turn.elapsed);
    for process in [&store, &catalog, &workspace_agent, &ingest, &gate] {
        slowest = slowest.max(ready_promptly(&cluster.http, process).await);
    }

    // The server closes every slow connection after its header timeout.
    let deadline = opened_at + HEADER_TIMEOUT + Duration::from_secs(8);
    let mut closed = Vec::new();
    for (name, connections) in slow {
        let count = closed_by_server(connections, deadline).await;
        closed.push((name, count));
    }
    let closed_in = opened_at.elapsed();
    let total_closed: usize = closed.iter().map(|(_, n)| n).sum();
    Summary::new("slowloris_every_listener")
        .field("listeners", listeners.len())
        .field("slow", listeners.len() * SLOW_PER_LISTENER)
        .field("closed", total_closed)
        .field("real_request_ms_max", slowest.as_millis())
        .field("closed_within_ms", closed_in.as_millis())
        .emit();
    for (name, count) in &closed {
        assert_eq!(
            *count,
            SLOW_PER_LISTENER,
            "{name} closed {count} of {SLOW_PER_LISTENER} slow connections within {:?} of opening",
            HEADER_TIMEOUT + Duration::from_secs(8)
        );
    }
}
