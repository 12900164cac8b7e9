//! Fault injection across the real binaries: what the cases in `tests/`
//! share. A [`Cluster`] is one test's NATS server, subject prefix and
//! database, and builds the services' processes with them; [`check_pushes`]
//! compares what a fake agent was told was accepted with what Postgres holds;
//! [`Summary`] prints the one `FAULT-SUMMARY` line each case ends with.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::io::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::{ContextResource, PushContextStateRequest};
use ctxsync_runtime::nats::NatsConnection;
use testkit::agent::{FakeAgent, Kind, Sent, StoredAgent};
use testkit::chat::{ChatAnswer, http_turn, nats_turn};
use testkit::metrics::Metrics;
use testkit::store::StoreClient;
use testkit::{Process, ProcessBuilder};

/// Bound of a service's start (a cold binary on a loaded 2-core machine).
pub const READY_WITHIN: Duration = Duration::from_secs(60);

/// Env var naming a file each `FAULT-SUMMARY` line is also appended to.
pub const SUMMARY_FILE_ENV: &str = "CTXSYNC_FAULT_SUMMARY_FILE";

/// One test's shared dependencies, and the services built on them.
pub struct Cluster {
    pub nats_url: String,
    pub subjects: Subjects,
    pub database_url: String,
    pub http: reqwest::Client,
}

impl Cluster {
    /// Services on `nats_url` and `database_url`, under a prefix of their own.
    pub fn new(nats_url: String, database_url: &str) -> Self {
        let prefix = testkit::unique_prefix();
        Self {
            nats_url,
            subjects: Subjects::new(&prefix).expect("a valid prefix"),
            database_url: database_url.to_owned(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("http client"),
        }
    }

    pub fn prefix(&self) -> &str {
        self.subjects.prefix()
    }

    /// `bin` of `package` on this cluster's NATS and prefix, with its
    /// operator HTTP listener on a free port.
    pub fn service(&self, package: &str, bin: &str) -> ProcessBuilder {
        ProcessBuilder::binary(package, bin)
            .env("NATS_URL", self.nats_url.clone())
            .env("CTXSYNC_SUBJECT_PREFIX", self.prefix())
            .env("CTXSYNC_HTTP_ADDR", testkit::free_addr().to_string())
    }

    /// A snapshot-store replica named `name`.
    pub fn store(&self, name: &str) -> ProcessBuilder {
        self.service("snapshot-store", "snapshot-store")
            .named(name)
            .env("DATABASE_URL", self.database_url.clone())
    }

    pub fn ingest(&self) -> ProcessBuilder {
        self.service("agent-ingest", "agent-ingest")
    }

    /// A chat-gate replica named `name`.
    pub fn gate(&self, name: &str) -> ProcessBuilder {
        self.service("chat-gate", "chat-gate").named(name)
    }

    /// The catalog with the configuration file `config`, warm-up off.
    pub fn catalog(&self, config: &std::path::Path) -> ProcessBuilder {
        self.service("catalog", "catalog")
            .env("DATABASE_URL", self.database_url.clone())
            .env("CTXSYNC_CATALOG_CONFIG", config.display().to_string())
            .env("CTXSYNC_CATALOG_WARMUP", "false")
    }

    /// A NATS client of the test (short reconnect backoff, like the services').
    pub async fn nats(&self, name: &str) -> NatsConnection {
        ctxsync_runtime::nats::connect(&self.nats_url, name)
            .await
            .expect("the test connects to nats")
    }

    /// The store's NATS API (agents are registered through it).
    pub fn store_client(&self, client: &async_nats::Client) -> StoreClient {
        StoreClient::new(
            client.clone(),
            self.subjects.clone(),
            Duration::from_secs(10),
            "faults",
        )
        .retrying_no_responders()
    }
}

/// Waits until every process is ready; returns the longest wait.
pub async fn all_ready(processes: &mut [&mut Process]) -> Duration {
    let mut longest = Duration::ZERO;
    for process in processes.iter_mut() {
        longest = longest.max(process.wait_ready(READY_WITHIN).await);
    }
    longest
}

/// The base URL of a process's HTTP listener.
pub fn url_of(process: &Process) -> String {
    format!("http://{}", addr_of(process))
}

pub fn addr_of(process: &Process) -> SocketAddr {
    process
        .http_addr()
        .unwrap_or_else(|| panic!("{} has no http address", process.name()))
}

/// One scrape of a process's `/metrics`; panics when it does not answer.
pub async fn metrics_of(http: &reqwest::Client, process: &Process) -> Metrics {
    Metrics::scrape(http, addr_of(process))
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", process.name()))
}

/// Asks `probe` until it answers `Ok`, for at most `within`; panics naming
/// `what` and the last answer. Every wait of the suite goes through here:
/// bounded in time, ending on the state it waits for.
pub async fn wait_until<T, F, Fut>(what: &str, within: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    poll_until(what, within, probe)
        .await
        .unwrap_or_else(|failure| panic!("{failure}"))
}

/// [`wait_until`] that returns the failure instead of panicking, for a case
/// that prints its summary before it asserts.
pub async fn poll_until<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    loop {
        match probe().await {
            Ok(value) => return Ok(value),
            Err(last) if started.elapsed() > within => {
                return Err(format!("{what}: not within {within:?}; last: {last}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Waits until gauge `name` of `process` equals `expected`.
pub async fn wait_gauge(
    http: &reqwest::Client,
    process: &Process,
    name: &str,
    expected: f64,
    within: Duration,
) {
    let addr = addr_of(process);
    wait_until(
        &format!("{} {name} == {expected}", process.name()),
        within,
        || async move {
            let value = Metrics::scrape(http, addr).await?.sum(name, &[]);
            if value == expected {
                Ok(())
            } else {
                Err(format!("{name} = {value}"))
            }
        },
    )
    .await;
}

/// The `FAULT-SUMMARY` line of one case: `case=<name>` then `key=value`
/// fields, written straight to stderr (so it shows for passing tests too)
/// and appended to `$CTXSYNC_FAULT_SUMMARY_FILE` when set.
pub struct Summary {
    line: String,
}

impl Summary {
    pub fn new(case: &str) -> Self {
        Self {
            line: format!("FAULT-SUMMARY case={case}"),
        }
    }

    pub fn field(mut self, key: &str, value: impl Display) -> Self {
        self.line.push_str(&format!(" {key}={value}"));
        self
    }

    pub fn emit(&self) {
        let line = format!("{}\n", self.line);
        // Not eprintln!: the test harness captures that for passing tests.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        if let Some(path) = std::env::var_os(SUMMARY_FILE_ENV)
            && let Ok(mut file) = std::fs::File::options()
                .create(true)
                .append(true)
                .open(path)
        {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

/// A push of `run_id` at `version` whose one resource says which push wrote
/// it: its `warning` is `v<version>` (see [`check_pushes`]).
pub fn tagged_push(run_id: &str, version: u64, phase: Phase) -> PushContextStateRequest {
    let resource = ContextResource {
        warning: format!("v{version}"),
        ..testkit::report::instruction("/w/AGENTS.md", &format!("written by push {version}"))
    };
    testkit::report::push(run_id, version, version == 1, Some(phase), vec![resource])
}

/// The comparison of what agents were told with what Postgres holds.
#[derive(Debug, Default, Clone)]
pub struct PushCheck {
    /// Pushes sent.
    pub sent: u64,
    /// Answered 2xx and accepted.
    pub acked: u64,
    /// Answered 2xx and dropped by the store.
    pub dropped: u64,
    /// Answered 5xx (or not at all): the agent may not assume anything.
    pub unanswered: u64,
    /// Answered 4xx.
    pub refused: u64,
    /// Accepted commits Postgres counts (revisions less the startups).
    pub stored: u64,
    /// Acked pushes that Postgres does not hold (nor anything newer of theirs).
    pub lost: u64,
    /// Every rule broken, per agent.
    pub problems: Vec<String>,
}

/// Checks, per agent, the rules a store must keep whatever it went through:
/// the stored snapshot is of the agent's run, its version is one that was
/// sent and is at least the highest acked one (a lower one means an acked
/// push was lost), its resources are the ones that push sent, and the
/// revision is `startup_commits` plus the accepted pushes: at least the
/// acked ones, at most the sent ones.
pub fn check_pushes(
    histories: &[(String, Vec<Sent>)],
    stored: &HashMap<String, StoredAgent>,
    startup_commits: i64,
) -> PushCheck {
    let mut check = PushCheck::default();
    for (agent_id, history) in histories {
        let pushes: Vec<&Sent> = history.iter().filter(|s| s.kind == Kind::Push).collect();
        let sent = pushes.len() as u64;
        let acked: Vec<u64> = pushes
            .iter()
            .filter(|s| s.answer.is_accepted())
            .map(|s| s.version)
            .collect();
        check.sent += sent;
        check.acked += acked.len() as u64;
        for push in &pushes {
            match push.answer.label() {
                "dropped" => check.dropped += 1,
                "4xx" => check.refused += 1,
                "5xx" | "transport" => check.unanswered += 1,
                _ => {}
            }
        }
        let Some(row) = stored.get(agent_id) else {
            check
                .problems
                .push(format!("agent {agent_id}: not in Postgres"));
            check.lost += acked.len() as u64;
            continue;
        };
        let accepted_commits = row.revision - startup_commits;
        check.stored += accepted_commits.max(0) as u64;
        if accepted_commits < acked.len() as i64 || accepted_commits > sent as i64 {
            check.problems.push(format!(
                "agent {agent_id}: revision {} means {accepted_commits} accepted pushes, \
                 but {} were acked and {sent} sent",
                row.revision,
                acked.len()
            ));
        }
        let highest_acked = acked.iter().copied().max();
        let Some(snapshot) = &row.snapshot else {
            if highest_acked.is_some() {
                check.lost += acked.len() as u64;
                check.problems.push(format!(
                    "agent {agent_id}: no snapshot, {} pushes acked",
                    acked.len()
                ));
            }
            continue;
        };
        let stored_version = snapshot.version as u64;
        let lost = acked.iter().filter(|v| **v > stored_version).count() as u64;
        if lost > 0 {
            check.lost += lost;
            check.problems.push(format!(
                "agent {agent_id}: stored version {stored_version} is below {lost} acked \
                 pushes (highest acked {})",
                highest_acked.unwrap_or_default()
            ));
        }
        if !pushes.iter().any(|s| s.version == stored_version) {
            check.problems.push(format!(
                "agent {agent_id}: stored version {stored_version} was never sent"
            ));
        }
        let run_id = pushes.first().map(|s| s.run_id.as_str()).unwrap_or("");
        if snapshot.agent_run_id != run_id || row.agent_run_id != run_id {
            check.problems.push(format!(
                "agent {agent_id}: run ids {:?} (agent) / {:?} (snapshot), sent {run_id:?}",
                row.agent_run_id, snapshot.agent_run_id
            ));
        }
        let tag = format!("v{stored_version}");
        if snapshot.resource_warnings != [tag.clone()] {
            check.problems.push(format!(
                "agent {agent_id}: snapshot v{stored_version} holds the resources of {:?}",
                snapshot.resource_warnings
            ));
        }
    }
    check
}

/// Pushes `push` until agent-ingest answers it 2xx (accepted or dropped), at
/// most `attempts` times, pausing 200 ms after a 5xx or a transport error as
/// an agent backs off; panics on a 4xx or when no attempt was answered 2xx.
pub async fn push_until_answered(
    agent: &mut testkit::agent::FakeAgent,
    push: &PushContextStateRequest,
    attempts: u32,
) -> testkit::agent::Answer {
    use testkit::agent::Answer;
    let mut last = None;
    for _ in 0..attempts {
        let answer = agent.push(push).await.answer.clone();
        match &answer {
            Answer::Accepted | Answer::Dropped(_) => return answer,
            Answer::ClientError(status, body) => {
                panic!("push v{} refused {status}: {body}", push.version)
            }
            Answer::ServerError(..) | Answer::Transport(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        last = Some(answer);
    }
    panic!(
        "push v{} of agent {} not answered 2xx in {attempts} attempts; last: {last:?}",
        push.version,
        agent.agent_id()
    );
}

/// Registers `count` agents named `<name>-<i>`, each started with its first
/// push PENDING: chats asking about them wait.
pub async fn pending_agents(
    store: &StoreClient,
    ingest_url: &str,
    name: &str,
    count: usize,
) -> Vec<FakeAgent> {
    let mut agents = Vec::with_capacity(count);
    for i in 0..count {
        let mut agent = FakeAgent::register(store, ingest_url, &format!("{name}-{i}")).await;
        assert!(agent.startup().await.answer.is_accepted());
        let pending = tagged_push(agent.run_id(), 1, Phase::Pending);
        assert!(agent.push(&pending).await.answer.is_accepted());
        agents.push(agent);
    }
    agents
}

/// A waiting first turn per agent over the gate's HTTP API (chat `http-<id>`)
/// and one over NATS through `client` (chat `nats-<id>`), each bounded by 150 s.
pub fn first_turns_both_ways(
    http: &reqwest::Client,
    gate: SocketAddr,
    client: &async_nats::Client,
    subjects: &Subjects,
    agents: &[FakeAgent],
) -> Vec<tokio::task::JoinHandle<ChatAnswer>> {
    const WAIT: Duration = Duration::from_secs(150);
    let mut chats = Vec::with_capacity(agents.len() * 2);
    for agent in agents {
        let agent_id = agent.agent_id().to_owned();
        let (http, id) = (http.clone(), agent_id.clone());
        chats.push(tokio::spawn(async move {
            http_turn(&http, gate, &format!("http-{id}"), &id, true, WAIT).await
        }));
        let (client, subjects) = (client.clone(), subjects.clone());
        chats.push(tokio::spawn(async move {
            nats_turn(
                &client,
                &subjects,
                &format!("nats-{agent_id}"),
                &agent_id,
                true,
                WAIT,
            )
            .await
        }));
    }
    chats
}

/// Where Debian's faketime package puts libfaketime, on either architecture:
/// preloaded (`LD_PRELOAD`, with `FAKETIME` the skew), it skews a process's
/// wall clock.
pub fn libfaketime() -> Option<std::path::PathBuf> {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| std::path::PathBuf::from(format!("/usr/lib/{arch}/faketime/libfaketime.so.1")))
        .find(|path| path.is_file())
}

/// `builder` on a wall clock `skew` off (`+10m`, `-90s`); its monotonic
/// clock is left alone, as no machine's jumps.
pub fn with_clock_skew(
    builder: ProcessBuilder,
    libfaketime: &std::path::Path,
    skew: &str,
) -> ProcessBuilder {
    builder
        .env("LD_PRELOAD", libfaketime.to_string_lossy())
        .env("FAKETIME", skew)
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
}
