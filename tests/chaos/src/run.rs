//! The harness: the deployed shape as separate processes (three NATS
//! nodes, two replicas each of snapshot-store, agent-ingest and chat-gate,
//! a Postgres server of its own), a workload of agents and chat backends,
//! and faults on a schedule drawn from the seed; every operation goes into
//! the history, which the oracle then judges.
//!
//! Faults: kill -9 and restart of any service process, SIGSTOP/SIGCONT of
//! one for longer than the timeouts, a NATS node killed and restarted,
//! Postgres killed and restarted, loss, blackholes and slow links on one
//! link at a time ([`network`]), and a service on a skewed wall clock.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::{Rng as _, SeedableRng as _};
use testkit::agent::{Answer as Acked, FakeAgent};
use testkit::report::{complete, pending, server};
use testkit::{NatsCluster, PrivatePostgres, Process};
use tokio::sync::{Mutex, mpsc};

use crate::history::{Answer, Body, Decision, Event, Kind, Via};
use crate::network::{self, Link};
use crate::oracle::{AnomalyKind, Bounds, Verdict};

/// What a run does.
#[derive(Debug, Clone)]
pub struct Options {
    pub duration: Duration,
    pub seed: u64,
    pub history: PathBuf,
    pub agents: usize,
    pub chats: usize,
    /// Each gate's first-turn deadline (short, so timeouts happen).
    pub pending_timeout: Duration,
    /// Loss, slow links and blackholes (the run must be in a network
    /// namespace of its own: [`network::run_again_in_namespace`]).
    pub network_faults: bool,
    /// libfaketime, to run a service on a skewed wall clock; none: no skew.
    pub faketime: Option<PathBuf>,
}

/// Writes the history's events, in order, to its file and keeps them.
#[derive(Clone)]
struct Recorder {
    events: mpsc::UnboundedSender<Event>,
    started: Instant,
    next: Arc<AtomicU64>,
}

impl Recorder {
    /// A recorder and the events it records, in order.
    fn new() -> (Self, mpsc::UnboundedReceiver<Event>) {
        let (events, received) = mpsc::unbounded_channel();
        let recorder = Self {
            events,
            started: Instant::now(),
            next: Arc::new(AtomicU64::new(1)),
        };
        (recorder, received)
    }

    fn event(&self, op: u64, kind: Kind, body: Body) {
        let event = Event {
            op,
            kind,
            mono_us: u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            wall_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            body,
        };
        let _ = self.events.send(event);
    }

    fn invoke(&self, body: Body) -> u64 {
        let op = self.next.fetch_add(1, Ordering::SeqCst);
        self.event(op, Kind::Invoke, body);
        op
    }
}

/// How an agent's request ended, as the history says it.
fn kind_of(answer: &Acked) -> Kind {
    match answer {
        Acked::Accepted => Kind::Ok,
        // Refused by the store or the API: certainly not applied.
        Acked::Dropped(_) | Acked::ClientError(..) => Kind::Fail,
        // No answer, or the store did not answer ingest in time: it may
        // have been committed all the same.
        Acked::ServerError(..) | Acked::Transport(_) => Kind::Info,
    }
}

/// The service processes, for the faults.
struct Services {
    processes: Vec<Process>,
}

/// One registered agent.
#[derive(Clone)]
struct AgentKey {
    id: String,
    token: String,
}

/// Runs the deployed shape under the workload and faults for
/// `options.duration`, writes the history, and judges it.
pub async fn run(options: Options) -> anyhow::Result<(Verdict, Vec<Event>)> {
    let nats = tokio::task::spawn_blocking(NatsCluster::start).await?;
    let nats = Arc::new(Mutex::new(nats));
    let postgres = Arc::new(Mutex::new(PrivatePostgres::start().await));
    let database_url = postgres.lock().await.url();
    let nats_urls = nats.lock().await.url_list();
    let cluster = faults::Cluster::new(nats_urls, &database_url);
    let pending_timeout = format!("{}ms", options.pending_timeout.as_millis());
    let mut processes = vec![
        cluster.store("store-a").spawn(),
        cluster.store("store-b").spawn(),
        cluster.ingest().named("ingest-a").spawn(),
        cluster.ingest().named("ingest-b").spawn(),
        cluster
            .gate("gate-a")
            .env("CTXSYNC_GATE_PENDING_TIMEOUT", pending_timeout.clone())
            .spawn(),
        cluster
            .gate("gate-b")
            .env("CTXSYNC_GATE_PENDING_TIMEOUT", pending_timeout)
            .spawn(),
    ];
    let mut all: Vec<&mut Process> = processes.iter_mut().collect();
    faults::all_ready(&mut all).await;
    let ingests: Vec<String> = processes[2..4].iter().map(faults::url_of).collect();
    let gates: Vec<std::net::SocketAddr> = processes[4..6].iter().map(faults::addr_of).collect();
    let services = Arc::new(Mutex::new(Services { processes }));

    let connection = cluster.nats("chaos").await;
    let store = cluster.store_client(&connection.client);
    store.create_test_tenant_key().await;
    let mut agents = Vec::new();
    for i in 0..options.agents {
        let agent = FakeAgent::register(&store, &ingests[0], &format!("chaos-{i}")).await;
        agents.push(AgentKey {
            id: agent.agent_id().to_owned(),
            token: agent.token().to_owned(),
        });
    }

    let (recorder, mut events_rx) = Recorder::new();
    let history_path = options.history.clone();
    let writer = tokio::spawn(async move {
        use std::io::Write as _;
        let file = std::fs::File::create(&history_path)?;
        let mut out = std::io::BufWriter::new(file);
        let mut kept = Vec::new();
        while let Some(event) = events_rx.recv().await {
            writeln!(out, "{}", crate::history::line(&event))?;
            kept.push(event);
        }
        out.flush()?;
        anyhow::Ok(kept)
    });

    let stop = Arc::new(AtomicBool::new(false));
    let mut lives = Vec::new();
    for (i, agent) in agents.iter().enumerate() {
        lives.push(tokio::spawn(agent_life(
            recorder.clone(),
            agent.clone(),
            ingests.clone(),
            options.seed ^ (i as u64 + 1),
            stop.clone(),
        )));
    }
    let gates = Gates {
        client: reqwest::Client::new(),
        http: gates,
        nats: connection.client.clone(),
        subjects: cluster.subjects.clone(),
    };
    let mut tasks = Vec::new();
    for c in 0..options.chats {
        tasks.push(tokio::spawn(chat_backend(
            recorder.clone(),
            gates.clone(),
            agents.iter().map(|a| a.id.clone()).collect(),
            options.seed ^ (0x1000 + c as u64),
            stop.clone(),
        )));
    }
    let links = {
        let nats = nats.lock().await;
        let mut links = Vec::new();
        for node in 0..NatsCluster::SIZE {
            links.push(Link {
                name: format!("nats-{node}-clients"),
                port: nats.node_port(node),
            });
            links.push(Link {
                name: format!("nats-{node}-routes"),
                port: nats.route_port(node),
            });
        }
        links.push(Link {
            name: "postgres".into(),
            port: postgres.lock().await.port(),
        });
        for process in &services.lock().await.processes {
            if let Some(addr) = process.http_addr() {
                links.push(Link {
                    name: format!("{}-http", process.name()),
                    port: addr.port(),
                });
            }
        }
        links
    };
    let schedule = Schedule {
        recorder: recorder.clone(),
        services: services.clone(),
        nats: nats.clone(),
        postgres: postgres.clone(),
        links,
        faketime: options.faketime.clone(),
        network: options.network_faults,
    };
    let faults_task = tokio::spawn(schedule.run(options.seed, stop.clone()));

    tokio::time::sleep(options.duration).await;
    stop.store(true, Ordering::SeqCst);
    let mut live = Vec::new();
    for life in lives {
        live.extend(life.await?);
    }
    for task in tasks {
        task.await?;
    }
    faults_task.await??;
    // Everything healed: each process up again before the final reads.
    {
        let mut services = services.lock().await;
        let mut all: Vec<&mut Process> = services.processes.iter_mut().collect();
        faults::all_ready(&mut all).await;
    }
    // Each live process re-announces, as an idle agent does, so one taken
    // over by a late Startup near the end holds its agent again.
    // (Consumed: each holds a recorder, and the history ends when the last
    // recorder is dropped.)
    for process in live {
        process.reannounce().await;
    }
    for agent in &agents {
        let state = store.state(&agent.id).await;
        let run_id = state.agent.map(|a| a.agent_run_id).unwrap_or_default();
        let version = state
            .snapshot
            .filter(|s| s.agent_run_id == run_id)
            .map_or(0, |s| s.version);
        let op = recorder.next.fetch_add(1, Ordering::SeqCst);
        recorder.event(
            op,
            Kind::Ok,
            Body::Final {
                agent: agent.id.clone(),
                run_id,
                version,
            },
        );
    }
    drop(recorder);
    let events = writer.await??;
    Ok((crate::oracle::check(&events, Bounds::default()), events))
}

/// The oracle proven able to fail on this run's own history: each planted
/// anomaly, appended or changed after every fault has healed and its
/// recovery passed, must be reported. Returns each plant and whether it was.
pub fn planted(events: &[Event], bounds: Bounds) -> Vec<(AnomalyKind, bool)> {
    let end = events.iter().map(|e| e.mono_us).max().unwrap_or(0)
        + u64::try_from((bounds.fault_recovery + Duration::from_secs(20)).as_micros()).unwrap_or(0);
    let wall = events.iter().map(|e| e.wall_ms).max().unwrap_or(0);
    let next = events.iter().map(|e| e.op).max().unwrap_or(0) + 1;
    let turn = |agent: &str, answer: Answer, asked: u64, answered: u64| {
        let body = |answer| Body::Turn {
            agent: agent.to_owned(),
            chat: "planted".into(),
            via: Via::Http,
            answer,
        };
        let (invoke, done) = (body(None), body(Some(answer)));
        [(Kind::Invoke, asked, invoke), (Kind::Ok, answered, done)].map(|(kind, at, body)| Event {
            op: next,
            kind,
            mono_us: at,
            wall_ms: wall,
            body,
        })
    };
    let ready: Vec<(&str, &Answer)> = events
        .iter()
        .filter_map(|e| match &e.body {
            Body::Turn {
                agent,
                answer: Some(answer),
                ..
            } if answer.decision == Decision::Ready => Some((agent.as_str(), answer)),
            _ => None,
        })
        .collect();
    let finals: BTreeMap<&str, (&str, u64)> = events
        .iter()
        .filter_map(|e| match &e.body {
            Body::Final {
                agent,
                run_id,
                version,
            } => Some((agent.as_str(), (run_id.as_str(), *version))),
            _ => None,
        })
        .collect();
    let mut plants: Vec<(AnomalyKind, Vec<Event>)> = Vec::new();
    // The last ready answer of an agent's current run, once more with a tool it never had.
    if let Some((agent, answer)) = ready.iter().rev().find(|(agent, a)| {
        finals
            .get(agent)
            .is_some_and(|(run, _)| *run == a.snapshot_run_id)
    }) {
        let mut wrong = (*answer).clone();
        wrong.tools.push("s__planted".into());
        plants.push((
            AnomalyKind::WrongTools,
            turn(agent, wrong, end, end + 1_000).to_vec(),
        ));
        // The same answer after a wait of 6 s on a run complete long before.
        plants.push((
            AnomalyKind::SlowWake,
            turn(agent, (*answer).clone(), end, end + 6_000_000).to_vec(),
        ));
        // The same answer to a later turn of the chat: it waited.
        let mut held = turn(agent, (*answer).clone(), end, end + 1_000);
        for event in &mut held {
            if let Body::Turn {
                agent,
                chat,
                via,
                answer,
            } = &event.body
            {
                event.body = Body::FollowUp {
                    agent: agent.clone(),
                    chat: chat.clone(),
                    via: *via,
                    answer: answer.clone(),
                };
            }
        }
        plants.push((AnomalyKind::HeldFollowUp, held.to_vec()));
    }
    // A superseded run's tools, shown long after its successor was acked.
    if let Some((agent, answer)) = ready.iter().find(|(agent, a)| {
        finals
            .get(agent)
            .is_some_and(|(run, _)| *run != a.snapshot_run_id)
    }) {
        plants.push((
            AnomalyKind::SupersededRun,
            turn(agent, (*answer).clone(), end, end + 1_000).to_vec(),
        ));
    }
    let mut verdicts = Vec::new();
    for (kind, extra) in plants {
        let mut planted = events.to_vec();
        planted.extend(extra);
        verdicts.push((
            kind,
            crate::oracle::check(&planted, bounds).of_kind(kind) > 0,
        ));
    }
    // An acked push the store no longer holds: the final state one version
    // back, on an agent whose final version is one an acked push wrote (a
    // final version from a push whose ack never came would excuse it).
    let acked_ops: BTreeSet<u64> = events
        .iter()
        .filter(|e| e.kind == Kind::Ok)
        .map(|e| e.op)
        .collect();
    let acked_pushes: BTreeSet<(&str, &str, u64)> = events
        .iter()
        .filter(|e| e.kind == Kind::Invoke && acked_ops.contains(&e.op))
        .filter_map(|e| match &e.body {
            Body::Push {
                agent,
                run_id,
                version,
                ..
            } => Some((agent.as_str(), run_id.as_str(), *version)),
            _ => None,
        })
        .collect();
    let lost = events.iter().position(|e| {
        matches!(&e.body, Body::Final { agent, run_id, version }
            if *version > 0 && acked_pushes.contains(&(agent.as_str(), run_id.as_str(), *version)))
    });
    if let Some(at) = lost {
        let mut planted = events.to_vec();
        if let Body::Final { version, .. } = &mut planted[at].body {
            *version -= 1;
        }
        verdicts.push((
            AnomalyKind::LostAck,
            crate::oracle::check(&planted, bounds).acked_lost() > 0,
        ));
    }
    verdicts
}

/// An agent's processes, one after another: each starts, reports pending,
/// completes with some tools, edits its config a few times; some are
/// replaced while the old process still pushes for a while. Returns the
/// process that was live when the run stopped.
async fn agent_life(
    recorder: Recorder,
    agent: AgentKey,
    ingests: Vec<String>,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Option<LiveProcess> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut process = 0u64;
    let mut leftovers = Vec::new();
    let mut live = None;
    while !stop.load(Ordering::SeqCst) {
        process += 1;
        let run_id = format!("run-{process}-{}", rng.random::<u32>());
        let ingest = ingests[rng.random_range(0..ingests.len())].clone();
        let Some(mut current) =
            LiveProcess::start(recorder.clone(), agent.clone(), ingest, run_id).await
        else {
            live = None;
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        current.publish(false, vec![]).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..800))).await;
        for _ in 0..rng.random_range(1..5) {
            let tools: Vec<String> = ["a", "b", "c", "d"]
                .into_iter()
                .filter(|_| rng.random_bool(0.5))
                .map(str::to_owned)
                .collect();
            current.publish(true, tools).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..1500))).await;
            if stop.load(Ordering::SeqCst) {
                break;
            }
        }
        if !stop.load(Ordering::SeqCst) && rng.random_bool(0.3) {
            // Replaced: this process keeps pushing a little after the next starts.
            let delay = Duration::from_millis(rng.random_range(100..1000));
            leftovers.push(tokio::spawn(current.clone().linger(delay, 2)));
        }
        live = Some(current);
    }
    for leftover in leftovers {
        let _ = leftover.await;
    }
    live
}

/// One agent process: its run, the ingest it talks to and its latest
/// version. The live process heals a takeover by a late Startup of another
/// run (ARCHITECTURE.md, "Late, replayed and repeated messages") as the
/// real publisher does: told its run was replaced, it reclaims once and
/// sends its report again. A replaced process ([`Self::linger`]) never does.
#[derive(Clone)]
struct LiveProcess {
    recorder: Recorder,
    agent: AgentKey,
    ingest: String,
    run_id: String,
    version: u64,
}

impl LiveProcess {
    /// The process's Startup; the process if it was acked.
    async fn start(
        recorder: Recorder,
        agent: AgentKey,
        ingest: String,
        run_id: String,
    ) -> Option<Self> {
        let process = Self {
            recorder,
            agent,
            ingest,
            run_id,
            version: 0,
        };
        let started = process.send(Request::Startup { reclaim: false }).await;
        started.is_accepted().then_some(process)
    }

    /// Its next report; after a `STALE_RUN` drop, a reclaim and the same
    /// report again at the next version.
    async fn publish(&mut self, complete: bool, tools: Vec<String>) -> Kind {
        self.version += 1;
        let report = Request::Push {
            version: self.version,
            complete,
            tools: tools.clone(),
        };
        let answer = self.send(report).await;
        if !is_drop(&answer, "PUSH_DROP_REASON_STALE_RUN") {
            return kind_of(&answer);
        }
        let reclaimed = self.send(Request::Startup { reclaim: true }).await;
        if !reclaimed.is_accepted() {
            return kind_of(&reclaimed);
        }
        self.version += 1;
        let again = Request::Push {
            version: self.version,
            complete,
            tools,
        };
        kind_of(&self.send(again).await)
    }

    /// The idle re-announce: a Startup of its run, and a reclaim if it was
    /// dropped because another run replaced it.
    async fn reannounce(&self) -> Kind {
        let answer = self.send(Request::Startup { reclaim: false }).await;
        if is_drop(&answer, "STARTUP_DROP_REASON_SUPERSEDED_RUN") {
            return kind_of(&self.send(Request::Startup { reclaim: true }).await);
        }
        kind_of(&answer)
    }

    /// A replaced process: `pushes` more reports, `delay` apart, with new
    /// tools; their drops are answered by nothing.
    async fn linger(self, delay: Duration, pushes: u64) {
        for extra in 1..=pushes {
            tokio::time::sleep(delay).await;
            let report = Request::Push {
                version: self.version + extra,
                complete: true,
                tools: vec![format!("old{extra}")],
            };
            self.send(report).await;
        }
    }

    /// One request of the process, recorded with its outcome.
    async fn send(&self, request: Request) -> Acked {
        let mut client = FakeAgent::with_token(&self.ingest, &self.agent.id, &self.agent.token);
        client.set_run_id(&self.run_id);
        let (agent, run_id) = (self.agent.id.clone(), self.run_id.clone());
        match request {
            Request::Startup { reclaim } => {
                let body = Body::Startup {
                    agent,
                    run_id,
                    reclaim,
                };
                let op = self.recorder.invoke(body.clone());
                let sent = if reclaim {
                    client.reclaim().await
                } else {
                    client.startup().await
                };
                let answer = sent.answer.clone();
                self.recorder.event(op, kind_of(&answer), body);
                answer
            }
            Request::Push {
                version,
                complete: is_complete,
                tools,
            } => {
                let names: Vec<&str> = tools.iter().map(String::as_str).collect();
                let request = if is_complete {
                    complete(&run_id, version, vec![server("s", &names)])
                } else {
                    pending(&run_id, version, vec![])
                };
                let shown = if is_complete {
                    tools.iter().map(|t| format!("s__{t}")).collect()
                } else {
                    vec![]
                };
                let body = Body::Push {
                    agent,
                    run_id,
                    version,
                    complete: is_complete,
                    tools: shown,
                };
                let op = self.recorder.invoke(body.clone());
                let answer = client.push(&request).await.answer.clone();
                self.recorder.event(op, kind_of(&answer), body);
                answer
            }
        }
    }
}

/// What a process sends.
enum Request {
    Startup {
        reclaim: bool,
    },
    Push {
        version: u64,
        complete: bool,
        tools: Vec<String>,
    },
}

fn is_drop(answer: &Acked, reason: &str) -> bool {
    matches!(answer, Acked::Dropped(dropped) if dropped == reason)
}

/// A chat backend: first turns for random agents on random gates.
async fn chat_backend(
    recorder: Recorder,
    gates: Gates,
    agents: Vec<String>,
    seed: u64,
    stop: Arc<AtomicBool>,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let agent = agents[rng.random_range(0..agents.len())].clone();
        let chat = format!("chat-{seed:x}-{n}");
        // A first turn, and for half the chats a later turn right after it
        // (whatever the first was answered, or if it was not).
        for first_turn in [true, false] {
            if !first_turn && rng.random_bool(0.5) {
                break;
            }
            let via = if rng.random_bool(0.5) {
                Via::Http
            } else {
                Via::Nats
            };
            let body = |answer| {
                if first_turn {
                    Body::Turn {
                        agent: agent.clone(),
                        chat: chat.clone(),
                        via,
                        answer,
                    }
                } else {
                    Body::FollowUp {
                        agent: agent.clone(),
                        chat: chat.clone(),
                        via,
                        answer,
                    }
                }
            };
            let op = recorder.invoke(body(None));
            let (kind, answer) = match via {
                Via::Http => {
                    let gate = gates.http[rng.random_range(0..gates.http.len())];
                    http_turn(&gates.client, gate, &chat, &agent, first_turn).await
                }
                Via::Nats => nats_turn(&gates, &chat, &agent, first_turn).await,
            };
            recorder.event(op, kind, body(answer));
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(10..200))).await;
    }
}

/// Where chat backends ask: the gates' HTTP addresses and their NATS subject.
#[derive(Clone)]
struct Gates {
    client: reqwest::Client,
    http: Vec<std::net::SocketAddr>,
    nats: async_nats::Client,
    subjects: ctxsync_proto::subjects::Subjects,
}

/// How long a chat backend waits for a turn's answer: past every gate
/// deadline and fault.
const TURN_TIMEOUT: Duration = Duration::from_secs(60);

/// A turn over HTTP and what the history says of it.
async fn http_turn(
    http: &reqwest::Client,
    gate: std::net::SocketAddr,
    chat: &str,
    agent: &str,
    first_turn: bool,
) -> (Kind, Option<Answer>) {
    let sent = http
        .post(format!("http://{gate}/api/v1/gate"))
        .bearer_auth(testkit::chat::TEST_TENANT_KEY)
        .json(&serde_json::json!({"chat_id": chat, "agent_id": agent, "first_turn": first_turn}))
        .timeout(TURN_TIMEOUT)
        .send()
        .await;
    let Ok(response) = sent else {
        return (Kind::Info, None);
    };
    let status = response.status();
    let Ok(body) = response.json::<serde_json::Value>().await else {
        return (Kind::Info, None);
    };
    if status == reqwest::StatusCode::NOT_FOUND {
        return (Kind::Ok, Some(unknown()));
    }
    if !status.is_success() {
        return (Kind::Info, None);
    }
    let Some(decision) = decision_of(body["decision"].as_str().unwrap_or_default()) else {
        return (Kind::Info, None);
    };
    let projection = &body["projection"];
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let tools = projection["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["tools"].as_array().into_iter().flatten())
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect();
    // pbjson writes 64-bit integers as strings.
    let version = &projection["snapshot_version"];
    let snapshot_version = version
        .as_u64()
        .or_else(|| version.as_str().and_then(|v| v.parse().ok()))
        .unwrap_or(0);
    let answer = Answer {
        decision,
        run_id: text(&projection["agent_run_id"]),
        snapshot_run_id: text(&projection["snapshot_agent_run_id"]),
        snapshot_version,
        tools,
        waited_ms: body["waited_ms"].as_u64().unwrap_or(0),
        store_unavailable: body["decision"] == "GATE_DECISION_STORE_UNAVAILABLE"
            || !text(&projection["store_error"]).is_empty(),
    };
    (Kind::Ok, Some(answer))
}

/// A turn over NATS (`<prefix>.gate.turn.<tenant>`) and what the history
/// says of it.
async fn nats_turn(
    gates: &Gates,
    chat: &str,
    agent: &str,
    first_turn: bool,
) -> (Kind, Option<Answer>) {
    use ctxsync_proto::v1::{TurnReply, TurnRequest, service_error::Code};
    let request = TurnRequest {
        chat_id: chat.into(),
        agent_id: agent.into(),
        first_turn,
        tenant: String::new(),
    };
    let subject = gates.subjects.gate_turn(testkit::chat::TEST_TENANT);
    let reply: TurnReply =
        match ctxsync_runtime::rpc::request(&gates.nats, subject, &request, None, TURN_TIMEOUT)
            .await
        {
            Ok(reply) => reply,
            Err(_) => return (Kind::Info, None),
        };
    if let Some(error) = &reply.error {
        return if error.code() == Code::NotFound {
            (Kind::Ok, Some(unknown()))
        } else {
            (Kind::Info, None)
        };
    }
    let Some(decision) = decision_of(reply.decision().as_str_name()) else {
        return (Kind::Info, None);
    };
    let projection = reply.projection.unwrap_or_default();
    let answer = Answer {
        decision,
        tools: projection
            .servers
            .iter()
            .flat_map(|server| server.tools.iter().map(|tool| tool.name.clone()))
            .collect(),
        run_id: projection.agent_run_id,
        snapshot_run_id: projection.snapshot_agent_run_id,
        snapshot_version: projection.snapshot_version,
        waited_ms: u64::from(reply.waited_ms),
        store_unavailable: reply.decision
            == ctxsync_proto::v1::GateDecision::StoreUnavailable as i32
            || !projection.store_error.is_empty(),
    };
    (Kind::Ok, Some(answer))
}

/// The history's name of a decision (its proto name); `None` for those
/// that are no answer to judge (shutting down, refused).
fn decision_of(name: &str) -> Option<Decision> {
    Some(match name {
        "GATE_DECISION_READY" => Decision::Ready,
        "GATE_DECISION_TIMED_OUT_PENDING"
        | "GATE_DECISION_TIMED_OUT_NO_SNAPSHOT"
        | "GATE_DECISION_TIMED_OUT_STALE"
        | "GATE_DECISION_STORE_UNAVAILABLE" => Decision::Pending,
        "GATE_DECISION_NOT_FIRST_TURN" => Decision::NotFirstTurn,
        _ => return None,
    })
}

fn unknown() -> Answer {
    Answer {
        decision: Decision::Unknown,
        run_id: String::new(),
        snapshot_run_id: String::new(),
        snapshot_version: 0,
        tools: vec![],
        waited_ms: 0,
        store_unavailable: false,
    }
}

/// What the fault schedule acts on.
struct Schedule {
    recorder: Recorder,
    services: Arc<Mutex<Services>>,
    nats: Arc<Mutex<NatsCluster>>,
    postgres: Arc<Mutex<PrivatePostgres>>,
    /// The links network faults are put on.
    links: Vec<Link>,
    /// libfaketime, for clock skew; none: no clock skew.
    faketime: Option<PathBuf>,
    network: bool,
}

/// The kinds of fault, with how often each is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultKind {
    Kill,
    Stop,
    NatsKill,
    PostgresKill,
    Loss,
    Slow,
    Blackhole,
    ClockSkew,
}

impl Schedule {
    fn kinds(&self) -> Vec<(FaultKind, u32)> {
        let mut kinds = vec![
            (FaultKind::Kill, 4),
            (FaultKind::Stop, 3),
            (FaultKind::NatsKill, 2),
            (FaultKind::PostgresKill, 1),
        ];
        if self.network {
            kinds.extend([
                (FaultKind::Loss, 3),
                (FaultKind::Slow, 2),
                (FaultKind::Blackhole, 2),
            ]);
        }
        if self.faketime.is_some() {
            kinds.push((FaultKind::ClockSkew, 2));
        }
        kinds
    }

    /// Faults one at a time, each on for a while and then healed, drawn
    /// from the seed: which, on what, for how long.
    async fn run(self, seed: u64, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xfa17);
        let kinds = self.kinds();
        let total: u32 = kinds.iter().map(|(_, weight)| weight).sum();
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(2000..6000))).await;
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let lasting = Duration::from_millis(rng.random_range(1000..8000));
            let mut draw = rng.random_range(0..total);
            let kind = kinds
                .iter()
                .find(|(_, weight)| {
                    let hit = draw < *weight;
                    draw = draw.saturating_sub(*weight);
                    hit
                })
                .map_or(FaultKind::Kill, |(kind, _)| *kind);
            self.inject(kind, lasting, &mut rng).await?;
        }
        Ok(())
    }

    async fn inject(
        &self,
        kind: FaultKind,
        lasting: Duration,
        rng: &mut rand::rngs::StdRng,
    ) -> anyhow::Result<()> {
        let recorder = &self.recorder;
        match kind {
            FaultKind::Kill => {
                let mut services = self.services.lock().await;
                let i = rng.random_range(0..services.processes.len());
                let process = &mut services.processes[i];
                let op = recorder.invoke(fault("kill", process.name()));
                process.kill();
                tokio::time::sleep(lasting).await;
                process.restart();
                process.wait_ready(Duration::from_secs(60)).await;
                recorder.event(op, Kind::Ok, fault("kill", process.name()));
            }
            FaultKind::Stop => {
                let services = self.services.lock().await;
                let i = rng.random_range(0..services.processes.len());
                let process = &services.processes[i];
                let op = recorder.invoke(fault("stop", process.name()));
                process.pause();
                tokio::time::sleep(lasting).await;
                process.resume();
                recorder.event(op, Kind::Ok, fault("stop", process.name()));
            }
            FaultKind::NatsKill => {
                let mut nats = self.nats.lock().await;
                let node = rng.random_range(0..NatsCluster::SIZE);
                let target = format!("nats-{node}");
                let op = recorder.invoke(fault("nats_kill", &target));
                tokio::task::block_in_place(|| nats.kill(node));
                tokio::time::sleep(lasting).await;
                // Blocks until the node routes to the others again.
                tokio::task::block_in_place(|| nats.restart(node));
                recorder.event(op, Kind::Ok, fault("nats_kill", &target));
            }
            FaultKind::PostgresKill => {
                let mut postgres = self.postgres.lock().await;
                let op = recorder.invoke(fault("postgres_kill", "postgres"));
                postgres.kill_hard();
                tokio::time::sleep(lasting).await;
                postgres.restart().await;
                recorder.event(op, Kind::Ok, fault("postgres_kill", "postgres"));
            }
            FaultKind::Loss | FaultKind::Slow | FaultKind::Blackhole => {
                let link = &self.links[rng.random_range(0..self.links.len())];
                let (name, target) = match kind {
                    FaultKind::Loss => {
                        let percent = rng.random_range(5..=40);
                        tokio::task::block_in_place(|| network::lossy(link, percent))?;
                        ("loss", format!("{} {percent}%", link.name))
                    }
                    FaultKind::Slow => {
                        let kbit = rng.random_range(64..=1024);
                        tokio::task::block_in_place(|| network::slow(link, kbit))?;
                        ("slow", format!("{} {kbit}kbit", link.name))
                    }
                    _ => {
                        tokio::task::block_in_place(|| network::blackhole(link))?;
                        ("blackhole", link.name.clone())
                    }
                };
                let op = recorder.invoke(fault(name, &target));
                tokio::time::sleep(lasting).await;
                tokio::task::block_in_place(network::heal)?;
                recorder.event(op, Kind::Ok, fault(name, &target));
            }
            FaultKind::ClockSkew => {
                let Some(faketime) = &self.faketime else {
                    return Ok(());
                };
                let mut services = self.services.lock().await;
                let i = rng.random_range(0..services.processes.len());
                let process = &mut services.processes[i];
                let minutes =
                    rng.random_range(1..=30i64) * if rng.random_bool(0.5) { 1 } else { -1 };
                let skew = format!("{minutes:+}m");
                let name = process.name().to_owned();
                // Restarting onto the skewed clock, and back, are kills.
                let op = recorder.invoke(fault("kill", &name));
                process.kill();
                process.set_env("LD_PRELOAD", Some(&faketime.to_string_lossy()));
                process.set_env("FAKETIME", Some(&skew));
                // Only the wall clock is skewed: a monotonic clock jumps
                // on no machine.
                process.set_env("FAKETIME_DONT_FAKE_MONOTONIC", Some("1"));
                process.restart();
                process.wait_ready(Duration::from_secs(60)).await;
                recorder.event(op, Kind::Ok, fault("kill", &name));
                // While it runs skewed, nothing is excused (see the oracle).
                let target = format!("{name} {skew}");
                let skewed = recorder.invoke(fault("clock_skew", &target));
                tokio::time::sleep(lasting * 3).await;
                recorder.event(skewed, Kind::Ok, fault("clock_skew", &target));
                let op = recorder.invoke(fault("kill", &name));
                process.kill();
                for key in ["LD_PRELOAD", "FAKETIME", "FAKETIME_DONT_FAKE_MONOTONIC"] {
                    process.set_env(key, None);
                }
                process.restart();
                process.wait_ready(Duration::from_secs(60)).await;
                recorder.event(op, Kind::Ok, fault("kill", &name));
            }
        }
        Ok(())
    }
}

fn fault(kind: &str, target: &str) -> Body {
    Body::Fault {
        fault: kind.to_owned(),
        target: target.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use testkit::{NatsServer, TestDatabase};

    use super::*;

    fn outcomes(events: &mut mpsc::UnboundedReceiver<Event>) -> Vec<(Kind, Body)> {
        let mut done = Vec::new();
        while let Ok(event) = events.try_recv() {
            if event.kind != Kind::Invoke {
                done.push((event.kind, event.body));
            }
        }
        done
    }

    /// The run the agent's row holds.
    async fn row_run(store: &testkit::store::StoreClient, agent: &AgentKey) -> String {
        let state = store.state(&agent.id).await;
        state.agent.expect("the agent").agent_run_id
    }

    fn startup(run: &str, reclaim: bool, agent: &AgentKey) -> Body {
        Body::Startup {
            agent: agent.id.clone(),
            run_id: run.into(),
            reclaim,
        }
    }

    fn push(run: &str, version: u64, tools: &[&str], agent: &AgentKey) -> Body {
        Body::Push {
            agent: agent.id.clone(),
            run_id: run.into(),
            version,
            complete: true,
            tools: tools.iter().map(|t| format!("s__{t}")).collect(),
        }
    }

    /// One CI run's planted lost ack went uncaught: it was planted on an
    /// agent whose final version came from a push whose sender gave up, so
    /// one version back lost nothing acked. The plant needs an acked final.
    #[test]
    fn a_lost_ack_is_planted_where_the_final_version_was_acked() {
        let mut events = Vec::new();
        let mut at = 0;
        let mut record = |op: u64, kinds: &[Kind], body: Body| {
            for &kind in kinds {
                at += 1_000;
                events.push(Event {
                    op,
                    kind,
                    mono_us: at,
                    wall_ms: at / 1_000,
                    body: body.clone(),
                });
            }
        };
        let key = |id: &str| AgentKey {
            id: id.into(),
            token: String::new(),
        };
        let (gave_up, acked) = (key("gave-up"), key("acked"));
        let acked_op = [Kind::Invoke, Kind::Ok];
        for (n, agent) in [(1, &gave_up), (3, &acked)] {
            record(n, &acked_op, startup("r1", false, agent));
            record(n + 1, &acked_op, push("r1", 1, &["a"], agent));
        }
        // Its sender gave up, yet the push landed: the store ends on it.
        record(
            5,
            &[Kind::Invoke, Kind::Info],
            push("r1", 2, &["b"], &gave_up),
        );
        // The final reads are completions only, as the run records them.
        for (op, agent, version) in [(6, &gave_up, 2), (7, &acked, 1)] {
            let body = Body::Final {
                agent: agent.id.clone(),
                run_id: "r1".into(),
                version,
            };
            record(op, &[Kind::Ok], body);
        }

        let verdicts = planted(&events, Bounds::default());
        assert_eq!(verdicts, vec![(AnomalyKind::LostAck, true)]);
    }

    /// The chaos run's agents once left a late Startup's takeover standing
    /// until their next process (three `PendingAfterComplete` in one run):
    /// the live process now reclaims and reports again, a replaced one never.
    #[tokio::test]
    async fn the_live_process_takes_its_agent_back_and_a_replaced_one_never_does() {
        let nats = NatsServer::start();
        let db = TestDatabase::create().await;
        let cluster = faults::Cluster::new(nats.url(), db.url());
        let mut store_process = cluster.store("store").spawn();
        let mut ingest_process = cluster.ingest().spawn();
        faults::all_ready(&mut [&mut store_process, &mut ingest_process]).await;
        let ingest = faults::url_of(&ingest_process);
        let connection = cluster.nats("chaos-test").await;
        let store = cluster.store_client(&connection.client);
        store.create_test_tenant_key().await;
        let registered = FakeAgent::register(&store, &ingest, "reclaiming").await;
        let agent = AgentKey {
            id: registered.agent_id().to_owned(),
            token: registered.token().to_owned(),
        };
        let (recorder, mut events) = Recorder::new();
        let stored_run = |state: ctxsync_proto::v1::AgentState| {
            let snapshot = state.snapshot.expect("a snapshot");
            (
                state.agent.expect("the agent").agent_run_id,
                snapshot.agent_run_id,
                snapshot.version,
            )
        };

        let mut live =
            LiveProcess::start(recorder.clone(), agent.clone(), ingest.clone(), "r7".into())
                .await
                .expect("r7 starts");
        assert_eq!(live.publish(true, vec!["a".into()]).await, Kind::Ok);
        // A dead process's first Startup lands late: r6 never held the
        // agent, so the store cannot tell it from a new process.
        let late = store.startup(&agent.id, "r6").await;
        assert!(late.error.is_none(), "{:?}", late.error);
        assert_eq!(row_run(&store, &agent).await, "r6");
        outcomes(&mut events);

        assert_eq!(live.publish(true, vec!["b".into()]).await, Kind::Ok);
        assert_eq!(
            outcomes(&mut events),
            vec![
                (Kind::Fail, push("r7", 2, &["b"], &agent)),
                (Kind::Ok, startup("r7", true, &agent)),
                (Kind::Ok, push("r7", 3, &["b"], &agent)),
            ],
            "a stale-run drop, one reclaim, the report again at the next version"
        );
        assert_eq!(
            stored_run(store.state(&agent.id).await),
            ("r7".into(), "r7".into(), 3)
        );

        // Replaced by r8, r7 lingers: its drops are answered by nothing.
        let next = LiveProcess::start(recorder.clone(), agent.clone(), ingest.clone(), "r8".into())
            .await
            .expect("r8 starts");
        live.clone().linger(Duration::ZERO, 1).await;
        let lingered = outcomes(&mut events);
        assert_eq!(lingered.len(), 2, "{lingered:?}");
        assert_eq!(lingered[1].0, Kind::Fail, "{lingered:?}");
        assert_eq!(row_run(&store, &agent).await, "r8");

        // Taken over while idle, the live process's re-announce is dropped
        // as superseded and it reclaims.
        let late = store.startup(&agent.id, "r5").await;
        assert!(late.error.is_none(), "{:?}", late.error);
        outcomes(&mut events);
        assert_eq!(next.reannounce().await, Kind::Ok);
        assert_eq!(
            outcomes(&mut events),
            vec![
                (Kind::Fail, startup("r8", false, &agent)),
                (Kind::Ok, startup("r8", true, &agent)),
            ]
        );
        assert_eq!(row_run(&store, &agent).await, "r8");
        // And when nothing took it, a re-announce changes nothing.
        assert_eq!(next.reannounce().await, Kind::Ok);
        assert_eq!(
            outcomes(&mut events),
            vec![(Kind::Ok, startup("r8", false, &agent))]
        );
    }
}
