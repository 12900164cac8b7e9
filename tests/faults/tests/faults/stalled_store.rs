//! A store replica stalled (SIGSTOP) past agent-ingest's store timeout while
//! the agent process is replaced: a Startup of the old process, or a replayed
//! `initial` push, waits in the stalled replica and reaches it only after
//! SIGCONT. The live process (the real `workspace-agent` with our fixture MCP
//! server) must end up stored, and a first turn answered `ready` with its tools.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ctxsync_mcp::TransportSpec;
use ctxsync_proto::v1::discovery_changed::Cause;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::{DiscoveryChanged, SnapshotCommitted};
use faults::{Cluster, Summary, addr_of, all_ready, metrics_of, poll_until, url_of, wait_until};
use futures::StreamExt;
use prost::Message;
use serde_json::{Value, json};
use testkit::agent::{Answer, FakeAgent, Sent, stored_agents};
use testkit::chat::{ChatAnswer, http_turn};
use testkit::{NatsServer, Process, ProcessBuilder, TestDatabase};

/// agent-ingest's store timeout here: what the stalled replica holds is
/// answered 503 after it. The replica still executes it when it resumes (a
/// request's budget counts from its pickup), so the store's ordering rules,
/// not the deadline, must keep it from replacing newer state.
const STORE_TIMEOUT: &str = "1s";
/// The bound on reaching the live process's report after SIGCONT.
const CONVERGE_WITHIN: Duration = Duration::from_secs(20);
/// What snapshot-store logs for each startup or push it executes.
const HANDLED: [&str; 4] = [
    "startup committed",
    "startup dropped",
    "push committed",
    "push dropped",
];
/// Attempts at getting one request into the stalled replica (each lands
/// there with probability 1/2).
const STALL_ATTEMPTS: usize = 30;

/// What the store announced for the agent.
#[derive(Debug, Clone)]
enum Seen {
    Startup {
        run_id: String,
    },
    Committed {
        run_id: String,
        version: u64,
        phase: Phase,
    },
}

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<Seen>>>);

impl Events {
    async fn follow(client: &async_nats::Client, cluster: &Cluster, agent_id: &str) -> Self {
        let events = Self::default();
        let mut changed =
            testkit::subscribe(client, cluster.subjects.discovery_changed(agent_id)).await;
        let mut committed =
            testkit::subscribe(client, cluster.subjects.snapshot_committed(agent_id)).await;
        let seen = events.clone();
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    Some(m) = changed.next() => DiscoveryChanged::decode(m.payload).ok().and_then(|e| {
                        (e.cause() == Cause::Startup).then_some(Seen::Startup { run_id: e.agent_run_id })
                    }),
                    Some(m) = committed.next() => SnapshotCommitted::decode(m.payload).ok().map(|e| {
                        Seen::Committed { phase: e.phase(), run_id: e.agent_run_id, version: e.version }
                    }),
                    else => break,
                };
                if let Some(event) = event {
                    seen.0.lock().unwrap().push(event);
                }
            }
        });
        events
    }

    /// A run that started other than `old`.
    fn new_run(&self, old: &str) -> Option<String> {
        self.0.lock().unwrap().iter().find_map(|seen| match seen {
            Seen::Startup { run_id } if run_id != old => Some(run_id.clone()),
            _ => None,
        })
    }

    /// The newest accepted report of `run`: its version and phase.
    fn newest(&self, run: &str) -> Option<(u64, Phase)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|seen| match seen {
                Seen::Committed {
                    run_id,
                    version,
                    phase,
                } if run_id == run => Some((*version, *phase)),
                _ => None,
            })
            .max_by_key(|(version, _)| *version)
    }
}

fn stdio_entry(spec: &ctxsync_mcp::ServerSpec) -> Value {
    let TransportSpec::Stdio {
        command, args, env, ..
    } = &spec.transport
    else {
        panic!("a stdio server");
    };
    json!({ "command": command, "args": args, "env": env })
}

/// An instruction file and our fixture MCP server (tools `echo` and `add`).
fn write_workspace(dir: &Path) {
    std::fs::write(dir.join("AGENTS.md"), "Use the fixture server.\n").unwrap();
    let fixture = mcp_fixture::fixture_spec("fixture", &["--mode", "normal"], &[]);
    let config = json!({ "mcpServers": { "fixture": stdio_entry(&fixture) } });
    std::fs::write(
        dir.join(".mcp.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
}

/// Two store replicas behind one agent-ingest, a gate, and a workspace.
struct Stage {
    _nats: NatsServer,
    db: TestDatabase,
    cluster: Cluster,
    _store_a: Process,
    store_b: Process,
    ingest: Process,
    gate: Process,
    nats: ctxsync_runtime::nats::NatsConnection,
    workspace: tempfile::TempDir,
    home: tempfile::TempDir,
}

impl Stage {
    async fn start() -> Self {
        testkit::init_logs();
        let nats = NatsServer::start();
        let db = TestDatabase::create().await;
        let cluster = Cluster::new(nats.url(), db.url());
        let mut store_a = cluster.store("store-a").spawn();
        let mut store_b = cluster.store("store-b").spawn();
        let mut ingest = cluster
            .ingest()
            .env("CTXSYNC_STORE_TIMEOUT", STORE_TIMEOUT)
            // No token check may wait in the stalled replica: only startups and pushes.
            .env("CTXSYNC_AUTH_CACHE_TTL", "10m")
            .spawn();
        let mut gate = cluster.gate("gate").spawn();
        all_ready(&mut [&mut store_a, &mut store_b, &mut ingest, &mut gate]).await;
        let client = cluster.nats("faults-test").await;
        cluster
            .store_client(&client.client)
            .create_test_tenant_key()
            .await;
        let workspace = tempfile::tempdir().unwrap();
        write_workspace(workspace.path());
        Self {
            _nats: nats,
            db,
            cluster,
            _store_a: store_a,
            store_b,
            ingest,
            gate,
            nats: client,
            workspace,
            home: tempfile::tempdir().unwrap(),
        }
    }

    /// The real agent process, with `token`.
    fn live_agent(&self, token: &str) -> Process {
        let token_file = self.home.path().join("token");
        std::fs::write(&token_file, token).unwrap();
        ProcessBuilder::binary("workspace-agent", "workspace-agent")
            .env("CTXSYNC_INGEST_URL", url_of(&self.ingest))
            .env("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string())
            .env(
                "CTXSYNC_WORKDIR",
                self.workspace.path().display().to_string(),
            )
            .env("HOME", self.home.path().display().to_string())
            .spawn()
    }

    /// Requests agent-ingest answered 503 so far (with store A up, each one
    /// is a request that waited in the stalled replica past its timeout).
    async fn ingest_503s(&self) -> f64 {
        metrics_of(&self.cluster.http, &self.ingest)
            .await
            .sum("ctxsync_ingest_requests_total", &[("status", "503")])
    }

    /// Waits until the resumed replica has dealt with the `held` requests
    /// that waited in it: executed (each logs its outcome after `log_from`)
    /// or dropped unexecuted as past their deadline (counted). Returns the
    /// tally.
    async fn wait_backlog_handled(&self, log_from: usize, held: f64) -> String {
        let store_b = &self.store_b;
        let http = &self.cluster.http;
        wait_until(
            "store-b dealt with the requests it held",
            Duration::from_secs(30),
            || async move {
                let log = store_b.log();
                let executed = log
                    .get(log_from..)
                    .unwrap_or_default()
                    .lines()
                    .filter(|line| HANDLED.iter().any(|outcome| line.contains(outcome)))
                    .count() as f64;
                let metrics = metrics_of(http, store_b).await;
                let expired = metrics.sum("ctxsync_rpc_expired_total", &[])
                    + metrics.sum("ctxsync_store_pushes_total", &[("outcome", "expired")])
                    + metrics.sum("ctxsync_store_startups_total", &[("outcome", "expired")]);
                let tally = format!("executed={executed} expired={expired}");
                if executed + expired >= held {
                    Ok(tally)
                } else {
                    Err(format!("{tally} of {held} held"))
                }
            },
        )
        .await
    }

    /// Waits until Postgres holds the live run's newest report, COMPLETE,
    /// under the live run id.
    async fn wait_live_report_stored(
        &self,
        events: &Events,
        agent_id: &str,
        run: &str,
    ) -> Result<(), String> {
        let pool = sqlx::PgPool::connect(self.db.url()).await.unwrap();
        let ids = [agent_id.to_owned()];
        poll_until(
            "the live process's newest report is stored",
            CONVERGE_WITHIN,
            || {
                let pool = pool.clone();
                let ids = ids.clone();
                async move {
                    let stored = stored_agents(&pool, &ids)
                        .await
                        .map_err(|e| e.to_string())?;
                    let row = stored.get(&ids[0]).ok_or("no agent row")?;
                    let newest = events.newest(run);
                    let snapshot = row.snapshot.as_ref().ok_or("no snapshot")?;
                    let holds = row.agent_run_id == run
                        && snapshot.agent_run_id == run
                        && snapshot.phase == "complete"
                        && newest.is_some_and(|(v, p)| {
                            v as i64 == snapshot.version && p == Phase::Complete
                        });
                    if holds {
                        Ok(())
                    } else {
                        Err(format!(
                            "stored {row:?}; live run {run}, its newest report {newest:?}"
                        ))
                    }
                }
            },
        )
        .await
    }

    async fn first_turn(&self, agent_id: &str) -> ChatAnswer {
        http_turn(
            &self.cluster.http,
            addr_of(&self.gate),
            "first-turn",
            agent_id,
            true,
            Duration::from_secs(30),
        )
        .await
    }
}

/// What a test gets into the stalled replica.
enum Late<'a> {
    Startup,
    Push(&'a ctxsync_proto::v1::PushContextStateRequest),
}

/// Sends until one request waits in the stalled replica (answered 503 after
/// the store timeout); the ones store A serves are answered at once.
async fn until_stuck(agent: &mut FakeAgent, late: Late<'_>) -> Sent {
    let mut answers = Vec::new();
    for _ in 0..STALL_ATTEMPTS {
        let sent = match late {
            Late::Startup => agent.startup().await.clone(),
            Late::Push(push) => agent.push(push).await.clone(),
        };
        if matches!(sent.answer, Answer::ServerError(503, _)) {
            return sent;
        }
        answers.push(sent.answer.label());
    }
    panic!("no request reached the stalled replica in {STALL_ATTEMPTS} attempts: {answers:?}");
}

fn assert_live_tools(answer: &ChatAnswer, run: &str) {
    assert!(
        answer.is("ready"),
        "first turn answered {}",
        answer.decision()
    );
    assert_eq!(answer.agent_run_id, run, "the gate's current run");
    assert_eq!(answer.snapshot_agent_run_id, run, "the snapshot's run");
    for tool in ["fixture__echo", "fixture__add"] {
        assert!(
            answer.tools.iter().any(|t| t == tool),
            "{tool} in {:?}",
            answer.tools
        );
    }
    assert!(
        !answer.tools.iter().any(|t| t.starts_with("old__")),
        "the replaced process's tools: {:?}",
        answer.tools
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_startup_of_the_replaced_process_leaves_the_live_process_stored_and_ready() {
    let stage = Stage::start().await;
    let store_client = stage.cluster.store_client(&stage.nats.client);
    let mut old = FakeAgent::register(&store_client, &url_of(&stage.ingest), "replaced").await;
    let agent_id = old.agent_id().to_owned();
    let old_run = old.run_id().to_owned();
    let events = Events::follow(&stage.nats.client, &stage.cluster, &agent_id).await;
    assert!(old.startup().await.answer.is_accepted());
    let report = testkit::report::complete(
        &old_run,
        1,
        vec![testkit::report::server("old", &["legacy"])],
    );
    assert!(old.push(&report).await.answer.is_accepted());

    let before = stage.ingest_503s().await;
    stage.store_b.pause();
    let stalled_at = Instant::now();
    // The old process's Startup (a reconnect's), held by the stalled replica.
    until_stuck(&mut old, Late::Startup).await;

    // The process is replaced: the live one starts, reports and completes
    // while store B is stalled (its own requests there are retried, and
    // reach store B after the old Startup).
    let mut live = stage.live_agent(old.token());
    let (seen, old_run) = (&events, old_run.as_str());
    let live_run = wait_until(
        "the live process's Startup",
        Duration::from_secs(60),
        || async move {
            seen.new_run(old_run)
                .ok_or_else(|| "no new run yet".to_owned())
        },
    )
    .await;
    let run = live_run.as_str();
    wait_until(
        "the live process's discovery completes",
        Duration::from_secs(60),
        || async move {
            match seen.newest(run) {
                Some((_, Phase::Complete)) => Ok(()),
                other => Err(format!("newest report {other:?}")),
            }
        },
    )
    .await;
    // The old process, not gone yet, says Startup once more: this one reaches
    // store B after everything the live process left there.
    until_stuck(&mut old, Late::Startup).await;
    let held = stage.ingest_503s().await - before;
    let log_from = stage.store_b.log().len();
    stage.store_b.resume();
    let resumed_at = Instant::now();
    let fate = stage.wait_backlog_handled(log_from, held).await;
    let stored = stage
        .wait_live_report_stored(&events, &agent_id, &live_run)
        .await;
    let recover = resumed_at.elapsed();
    let answer = stage.first_turn(&agent_id).await;
    Summary::new("stalled_store_late_startup")
        .field("held", held)
        .field("late", fate)
        .field("stalled_ms", (resumed_at - stalled_at).as_millis())
        .field("woken", u8::from(answer.is("ready")))
        .field(
            "recover_ms",
            stored
                .as_ref()
                .map_or("none".into(), |()| recover.as_millis().to_string()),
        )
        .emit();
    if let Err(failure) = stored {
        panic!("{failure}");
    }
    assert_live_tools(&answer, &live_run);
    assert!(
        live.try_exit().is_none(),
        "the live agent exited:\n{}",
        live.log_tail(30)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_initial_push_leaves_the_live_process_stored_and_ready() {
    let stage = Stage::start().await;
    let store_client = stage.cluster.store_client(&stage.nats.client);
    let mut replay = FakeAgent::register(&store_client, &url_of(&stage.ingest), "replayed").await;
    let agent_id = replay.agent_id().to_owned();
    let events = Events::follow(&stage.nats.client, &stage.cluster, &agent_id).await;

    let mut live = stage.live_agent(replay.token());
    let (seen, replay_run) = (&events, replay.run_id().to_owned());
    let replay_run = replay_run.as_str();
    let live_run = wait_until(
        "the live process's Startup",
        Duration::from_secs(60),
        || async move {
            seen.new_run(replay_run)
                .ok_or_else(|| "no run yet".to_owned())
        },
    )
    .await;
    let run = live_run.as_str();
    let completed = wait_until(
        "the live process's discovery completes",
        Duration::from_secs(60),
        || async move {
            match seen.newest(run) {
                Some((version, Phase::Complete)) => Ok(version),
                other => Err(format!("newest report {other:?}")),
            }
        },
    )
    .await;

    let before = stage.ingest_503s().await;
    stage.store_b.pause();
    let stalled_at = Instant::now();
    // The live process's first push again (a retry or a replay), held by the
    // stalled replica; where store A serves it, it must change nothing.
    let initial = testkit::report::pending(&live_run, 1, vec![]);
    until_stuck(&mut replay, Late::Push(&initial)).await;
    // The live process reports something newer while store B is stalled.
    std::fs::write(
        stage.workspace.path().join("AGENTS.md"),
        "Use the fixture server. Twice.\n",
    )
    .unwrap();
    wait_until(
        "the live process's newer report",
        Duration::from_secs(60),
        || async move {
            match seen.newest(run) {
                Some((version, Phase::Complete)) if version > completed => Ok(()),
                other => Err(format!(
                    "newest report {other:?}, before the change v{completed}"
                )),
            }
        },
    )
    .await;
    let held = stage.ingest_503s().await - before;
    let log_from = stage.store_b.log().len();
    stage.store_b.resume();
    let resumed_at = Instant::now();
    let fate = stage.wait_backlog_handled(log_from, held).await;
    let stored = stage
        .wait_live_report_stored(&events, &agent_id, &live_run)
        .await;
    let recover = resumed_at.elapsed();
    let answer = stage.first_turn(&agent_id).await;
    let replays: Vec<&str> = replay.history().iter().map(|s| s.answer.label()).collect();
    Summary::new("stalled_store_late_initial_push")
        .field("held", held)
        .field("late", fate)
        .field("stalled_ms", (resumed_at - stalled_at).as_millis())
        .field("woken", u8::from(answer.is("ready")))
        .field(
            "recover_ms",
            stored
                .as_ref()
                .map_or("none".into(), |()| recover.as_millis().to_string()),
        )
        .emit();
    if let Err(failure) = stored {
        panic!("{failure}");
    }
    assert!(
        !replays.contains(&"accepted"),
        "a replayed initial push was accepted after COMPLETE: {replays:?}"
    );
    assert_live_tools(&answer, &live_run);
    assert!(
        live.try_exit().is_none(),
        "the live agent exited:\n{}",
        live.log_tail(30)
    );
}
