//! The discovery actor: owns every MCP connection and the current report.
//!
//! * At most `max_servers` servers are started per workspace (the config
//!   file rows say how many were not). The initial discovery connects them
//!   through a queue, at most `max_concurrent_connects` at once (a task is
//!   spawned when its turn comes, not before), each bounded by the
//!   handshake timeout (connect and `tools/list` together, counted from when
//!   its turn comes). Each outcome updates
//!   the report the moment it arrives; a server still connecting has no
//!   `mcp_server` row yet (its file's `mcp_config` row lists it). The phase is
//!   PENDING until every server of the initial discovery has succeeded, failed or
//!   timed out (zero servers: COMPLETE at once), then COMPLETE for good.
//! * A failed server's row has status `invalid` and the sanitized error; a
//!   server with zero tools is `ok`; a disabled one is `disabled`; one whose
//!   config cannot be used (an unset variable) is `invalid` with that error.
//! * The report is put together from rows made when their outcome arrives
//!   (never rebuilt from every server per outcome), once per batch of events.
//! * An HTTP server's `headersHelper` runs (in the config file's folder, at
//!   most [`HEADERS_HELPER_TIMEOUT`], [`HEADERS_HELPER_MAX_BYTES`] of output)
//!   before each connect; its JSON object is laid over `headers`, every value
//!   a secret.
//! * Reload (config files changed): instruction files, skills and config files
//!   are read again; only servers whose configuration changed are reconnected.
//!   A failed reconnect keeps the previous connection (status ok plus a
//!   warning); a removed server is closed and leaves the report.
//! * `notifications/tools/list_changed` re-lists that server's tools.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxsync_mcp::{Connection, McpError, OpenStep, Sanitizer, ToolDecl};
use ctxsync_proto::v1::{
    self, ContextResource, ResourceKind, ResourceStatus, context_resource::Body,
    mcp_discovery::Phase,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::context;
use crate::context_config::ContextConfig;
use crate::mcp_config::{self, DeclaredServer, LoadContext, Unstarted};
use crate::report::{Report, SharedReport, enforce_each, enforce_total};

pub fn server_source(name: &str) -> String {
    format!("mcp_server:{name}")
}

/// What discovery needs to know.
#[derive(Debug, Clone)]
pub struct DiscoverySettings {
    /// The agent's environment: context config variables, `${VAR}` expansion
    /// in MCP configs, and secret-looking values for the sanitizer.
    pub env: BTreeMap<String, String>,
    pub home: Option<PathBuf>,
    pub working_dir: Option<PathBuf>,
    pub handshake_timeout: Duration,
    pub max_concurrent_connects: usize,
    /// Servers started per workspace, at most (the rest are reported skipped).
    pub max_servers: usize,
}

/// How long a `headersHelper` may run.
pub const HEADERS_HELPER_TIMEOUT: Duration = Duration::from_secs(10);
/// How much a `headersHelper` may print.
pub const HEADERS_HELPER_MAX_BYTES: usize = 64 * 1024;

impl DiscoverySettings {
    pub fn context_config(&self) -> ContextConfig {
        ContextConfig::resolve(&self.env, self.home.as_deref(), self.working_dir.as_deref())
    }
}

/// A live connection and what it listed.
struct Live {
    connection: Arc<Connection>,
    server: DeclaredServer,
    /// The connect's sanitizer (it knows the `headersHelper` values).
    sanitizer: Sanitizer,
    tools: Vec<ToolDecl>,
    warning: String,
}

enum SlotState {
    /// Connecting; `previous` is the connection a changed config replaces.
    Pending {
        previous: Option<Live>,
    },
    Live(Live),
    Failed {
        error: String,
    },
}

struct Slot {
    server: DeclaredServer,
    generation: u64,
    state: SlotState,
    /// The slot's row as of its last change (`None` while connecting).
    row: Option<ContextResource>,
}

enum Event {
    Connected {
        name: String,
        generation: u64,
        outcome: Result<(Box<Connection>, Vec<ToolDecl>), String>,
        took: Duration,
        sanitizer: Sanitizer,
    },
    Relisted {
        name: String,
        generation: u64,
        outcome: Result<Vec<ToolDecl>, String>,
    },
}

/// Handle on a running discovery actor.
pub struct DiscoveryHandle {
    reports: watch::Receiver<SharedReport>,
    reload: mpsc::UnboundedSender<()>,
    context_config: ContextConfig,
    task: JoinHandle<()>,
}

impl DiscoveryHandle {
    /// The current report; changes on every outcome.
    pub fn reports(&self) -> watch::Receiver<SharedReport> {
        self.reports.clone()
    }

    pub fn context_config(&self) -> &ContextConfig {
        &self.context_config
    }

    /// Re-reads every config now (what the file watcher triggers).
    pub fn reload(&self) {
        let _ = self.reload.send(());
    }

    pub fn reload_sender(&self) -> mpsc::UnboundedSender<()> {
        self.reload.clone()
    }

    /// Waits until the actor has stopped (after shutdown) and closed its connections.
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// Reads the context, starts the initial MCP discovery and returns at once.
pub fn start(settings: DiscoverySettings, shutdown: CancellationToken) -> DiscoveryHandle {
    let context_config = settings.context_config();
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (tools_changed_tx, tools_changed_rx) = mpsc::unbounded_channel();
    let (reload_tx, reload_rx) = mpsc::unbounded_channel();
    let mut actor = Actor {
        queue: VecDeque::new(),
        connecting: 0,
        settings,
        context_config: context_config.clone(),
        static_rows: Vec::new(),
        slots: BTreeMap::new(),
        initial_pending: BTreeSet::new(),
        phase: Phase::Pending,
        next_generation: 0,
        events_tx,
        tools_changed_tx,
        shutdown: shutdown.clone(),
        tasks: Vec::new(),
    };
    let declared = actor.read_context();
    for server in declared {
        actor.initial_pending.insert(server.name.clone());
        actor.add(server);
    }
    actor.pump();
    actor.check_complete();
    let (reports_tx, reports_rx) = watch::channel(Arc::new(actor.report()));
    let task = tokio::spawn(actor.run(reports_tx, events_rx, tools_changed_rx, reload_rx));
    DiscoveryHandle {
        reports: reports_rx,
        reload: reload_tx,
        context_config,
        task,
    }
}

struct Actor {
    settings: DiscoverySettings,
    context_config: ContextConfig,
    /// Instruction files, skills and config files.
    static_rows: Vec<ContextResource>,
    slots: BTreeMap<String, Slot>,
    /// Servers of the initial discovery without an outcome yet.
    initial_pending: BTreeSet<String>,
    phase: Phase,
    next_generation: u64,
    /// Connects waiting for their turn: (server, generation).
    queue: VecDeque<(String, u64)>,
    /// Connects running now.
    connecting: usize,
    events_tx: mpsc::UnboundedSender<Event>,
    tools_changed_tx: mpsc::UnboundedSender<String>,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Actor {
    async fn run(
        mut self,
        reports: watch::Sender<SharedReport>,
        mut events: mpsc::UnboundedReceiver<Event>,
        mut tools_changed: mpsc::UnboundedReceiver<String>,
        mut reload: mpsc::UnboundedReceiver<()>,
    ) {
        let shutdown = self.shutdown.clone();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(event) = events.recv() => {
                    self.on_event(event);
                    // Every outcome already there, then one report.
                    while let Ok(event) = events.try_recv() {
                        self.on_event(event);
                    }
                    self.pump();
                }
                Some(name) = tools_changed.recv() => self.on_tools_changed(&name),
                Some(()) = reload.recv() => {
                    // Coalesce a burst of triggers into one reload.
                    while reload.try_recv().is_ok() {}
                    self.reload();
                    self.pump();
                }
            }
            self.tasks.retain(|t| !t.is_finished());
            let report = Arc::new(self.report());
            reports.send_if_modified(|current| {
                if **current == *report {
                    false
                } else {
                    *current = report;
                    true
                }
            });
        }
        self.close_all().await;
    }

    /// Reads instruction files, skills and config files; returns the servers.
    fn read_context(&mut self) -> Vec<DeclaredServer> {
        let config = &self.context_config;
        let mut rows = context::read_instruction_files(config);
        rows.extend(context::read_skills(config));
        let configs = mcp_config::load(
            &config.mcp_config_files,
            LoadContext {
                env: &self.settings.env,
                home: self.settings.home.as_deref(),
                working_dir: config.working_dir.as_deref(),
                max_servers: self.settings.max_servers,
            },
        );
        rows.extend(configs.files);
        if configs.skipped > 0 {
            tracing::warn!(
                skipped = configs.skipped,
                limit = self.settings.max_servers,
                "more mcp servers than the workspace may start; the rest are not started"
            );
        }
        for unstarted in &configs.disabled {
            rows.push(unstarted_row(unstarted, ResourceStatus::Disabled));
        }
        for unstarted in &configs.failed {
            rows.push(unstarted_row(unstarted, ResourceStatus::Invalid));
        }
        enforce_each(&mut rows);
        self.static_rows = rows;
        configs.servers
    }

    fn add(&mut self, server: DeclaredServer) {
        let generation = self.bump();
        self.queue.push_back((server.name.clone(), generation));
        self.slots.insert(
            server.name.clone(),
            Slot {
                server,
                generation,
                state: SlotState::Pending { previous: None },
                row: None,
            },
        );
    }

    /// Starts queued connects while fewer than the bound run.
    fn pump(&mut self) {
        let bound = self.settings.max_concurrent_connects.max(1);
        while self.connecting < bound {
            let Some((name, generation)) = self.queue.pop_front() else {
                break;
            };
            // Superseded by a later config, or removed: nothing to start.
            let Some(slot) = self.slots.get(&name) else {
                continue;
            };
            if slot.generation != generation {
                continue;
            }
            let server = slot.server.clone();
            self.connecting += 1;
            self.spawn_connect(&server, generation);
        }
    }

    fn bump(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    fn inherited(&self) -> Vec<(String, String)> {
        self.settings
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(ctxsync_mcp::process_env())
            .collect()
    }

    fn spawn_connect(&mut self, server: &DeclaredServer, generation: u64) {
        let server = server.clone();
        let inherited = self.inherited();
        let env = self.settings.env.clone();
        let name = server.name.clone();
        let timeout = self.settings.handshake_timeout;
        let events = self.events_tx.clone();
        let tools_changed = self.tools_changed_tx.clone();
        let shutdown = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            let work = async {
                let started = Instant::now();
                let mut spec = server.spec();
                // The helper's values are headers: the sanitizer sees them.
                let helped = match &server.headers_helper {
                    None => Ok(()),
                    Some(helper) => run_headers_helper(helper, server.root.as_deref(), &env)
                        .await
                        .map(|extra| add_headers(&mut spec, extra)),
                };
                let sanitizer = Sanitizer::with_secrets(
                    &spec,
                    inherited,
                    server.expanded_secrets.iter().cloned(),
                );
                let outcome = match helped {
                    Ok(()) => connect_and_list(&spec, timeout, tools_changed).await,
                    Err(error) => Err(error),
                };
                (outcome, started.elapsed(), sanitizer)
            };
            // Shutdown drops the work: a dropped connection kills its server.
            let Some((outcome, took, sanitizer)) =
                shutdown.run_until_cancelled(Box::pin(work)).await
            else {
                return;
            };
            let outcome = outcome
                .map(|(connection, tools)| (Box::new(connection), tools))
                .map_err(|error| sanitizer.sanitize(&error));
            let event = Event::Connected {
                name,
                generation,
                outcome,
                took,
                sanitizer,
            };
            if let Err(mpsc::error::SendError(Event::Connected {
                outcome: Ok((connection, _)),
                ..
            })) = events.send(event)
            {
                connection.close().await;
            }
        }));
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected {
                name,
                generation,
                outcome,
                took,
                sanitizer,
            } => self.on_connected(name, generation, outcome, took, sanitizer),
            Event::Relisted {
                name,
                generation,
                outcome,
            } => {
                let Some(slot) = self.slots.get_mut(&name) else {
                    return;
                };
                if slot.generation != generation {
                    return;
                }
                let SlotState::Live(live) = &mut slot.state else {
                    return;
                };
                match outcome {
                    Ok(tools) => {
                        tracing::info!(server = %name, tools = tools.len(), "tools re-listed after list_changed");
                        live.tools = tools;
                        live.warning.clear();
                    }
                    Err(error) => {
                        tracing::warn!(server = %name, %error, "re-listing tools failed; keeping the previous list");
                        live.warning = format!(
                            "re-listing tools after tools/list_changed failed, the previous list is kept: {error}"
                        );
                    }
                }
                slot.row = slot_row(&name, slot);
            }
        }
    }

    fn on_connected(
        &mut self,
        name: String,
        generation: u64,
        outcome: Result<(Box<Connection>, Vec<ToolDecl>), String>,
        took: Duration,
        sanitizer: Sanitizer,
    ) {
        self.connecting = self.connecting.saturating_sub(1);
        let current = self
            .slots
            .get(&name)
            .is_some_and(|slot| slot.generation == generation);
        if !current {
            // Superseded by a later config (or removed): not ours to keep.
            if let Ok((connection, _)) = outcome {
                self.close_later(Arc::new(*connection));
            }
            return;
        }
        let slot = self.slots.get_mut(&name).expect("checked above");
        let previous = match std::mem::replace(
            &mut slot.state,
            SlotState::Failed {
                error: String::new(),
            },
        ) {
            SlotState::Pending { previous } => previous,
            SlotState::Live(live) => Some(live),
            SlotState::Failed { .. } => None,
        };
        let mut to_close = None;
        slot.state = match outcome {
            Ok((connection, tools)) => {
                metrics::counter!("ctxsync_agent_mcp_connects_total", "outcome" => "ok")
                    .increment(1);
                metrics::histogram!("ctxsync_agent_mcp_handshake_seconds")
                    .record(took.as_secs_f64());
                tracing::info!(server = %name, tools = tools.len(), took_ms = took.as_millis() as u64, "mcp server discovered");
                to_close = previous.map(|p| p.connection);
                SlotState::Live(Live {
                    connection: Arc::new(*connection),
                    server: slot.server.clone(),
                    sanitizer,
                    tools,
                    warning: String::new(),
                })
            }
            Err(error) => {
                metrics::counter!("ctxsync_agent_mcp_connects_total", "outcome" => "failed")
                    .increment(1);
                match previous {
                    Some(mut live) => {
                        tracing::warn!(server = %name, %error, "reconnect failed; keeping the previous connection");
                        live.warning = format!(
                            "reconnecting after a config change failed, the previous connection is kept: {error}"
                        );
                        SlotState::Live(live)
                    }
                    None => {
                        tracing::warn!(server = %name, %error, "mcp server failed");
                        SlotState::Failed { error }
                    }
                }
            }
        };
        slot.row = slot_row(&name, slot);
        if let Some(connection) = to_close {
            self.close_later(connection);
        }
        self.initial_pending.remove(&name);
        self.check_complete();
    }

    fn on_tools_changed(&mut self, name: &str) {
        let Some(slot) = self.slots.get(name) else {
            return;
        };
        let SlotState::Live(live) = &slot.state else {
            return;
        };
        let connection = live.connection.clone();
        let generation = slot.generation;
        let sanitizer = live.sanitizer.clone();
        let events = self.events_tx.clone();
        let timeout = self.settings.handshake_timeout;
        let name = name.to_owned();
        let shutdown = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            let listed = shutdown
                .run_until_cancelled(tokio::time::timeout(timeout, connection.list_tools()))
                .await;
            let outcome = match listed {
                None => return,
                Some(Ok(Ok(tools))) => Ok(tools),
                Some(Ok(Err(error))) => Err(sanitizer.sanitize(&error.to_string())),
                Some(Err(_)) => Err(format!(
                    "tools/list did not answer within {}",
                    humantime::format_duration(timeout)
                )),
            };
            let _ = events.send(Event::Relisted {
                name,
                generation,
                outcome,
            });
        }));
    }

    fn reload(&mut self) {
        self.context_config = self.settings.context_config();
        let declared = self.read_context();
        let wanted: BTreeSet<String> = declared.iter().map(|s| s.name.clone()).collect();
        let removed: Vec<String> = self
            .slots
            .keys()
            .filter(|name| !wanted.contains(*name))
            .cloned()
            .collect();
        for name in removed {
            tracing::info!(server = %name, "mcp server removed from config");
            if let Some(slot) = self.slots.remove(&name) {
                match slot.state {
                    SlotState::Live(live)
                    | SlotState::Pending {
                        previous: Some(live),
                    } => self.close_later(live.connection),
                    _ => {}
                }
            }
            self.initial_pending.remove(&name);
        }
        for server in declared {
            let Some(slot) = self.slots.get_mut(&server.name) else {
                tracing::info!(server = %server.name, "mcp server added to config");
                self.add(server);
                continue;
            };
            if slot.server.transport == server.transport
                && slot.server.headers_helper == server.headers_helper
            {
                // Moved between files or unchanged: no reconnect.
                slot.server.config_path = server.config_path.clone();
                if let SlotState::Live(live) = &mut slot.state
                    && live.server.transport == server.transport
                {
                    live.server.config_path = server.config_path;
                }
                slot.row = slot_row(&server.name, slot);
                continue;
            }
            tracing::info!(server = %server.name, "mcp server config changed; reconnecting");
            let previous =
                match std::mem::replace(&mut slot.state, SlotState::Pending { previous: None }) {
                    SlotState::Live(live) => Some(live),
                    SlotState::Pending { previous } => previous,
                    SlotState::Failed { .. } => None,
                };
            slot.state = SlotState::Pending { previous };
            slot.server = server.clone();
            let generation = self.bump();
            let slot = self.slots.get_mut(&server.name).expect("present");
            slot.generation = generation;
            slot.row = slot_row(&server.name, slot);
            self.queue.push_back((server.name.clone(), generation));
        }
        self.check_complete();
    }

    fn check_complete(&mut self) {
        if self.phase == Phase::Pending && self.initial_pending.is_empty() {
            self.phase = Phase::Complete;
            tracing::info!(servers = self.slots.len(), "initial mcp discovery complete");
        }
    }

    fn close_later(&mut self, connection: Arc<Connection>) {
        self.tasks.push(tokio::spawn(close(connection)));
    }

    async fn close_all(mut self) {
        let mut closing = Vec::new();
        for (_, slot) in std::mem::take(&mut self.slots) {
            match slot.state {
                SlotState::Live(live)
                | SlotState::Pending {
                    previous: Some(live),
                } => closing.push(close(live.connection)),
                _ => {}
            }
        }
        futures::future::join_all(closing).await;
        // Connect tasks end on shutdown (dropping their half-made connections).
        for task in self.tasks {
            let _ = task.await;
        }
    }

    fn report(&self) -> Report {
        let mut resources = Vec::with_capacity(self.static_rows.len() + self.slots.len());
        resources.extend(self.static_rows.iter().cloned());
        resources.extend(self.slots.values().filter_map(|slot| slot.row.clone()));
        Report {
            context_config: self.context_config.to_proto(),
            phase: self.phase,
            resources: enforce_total(resources),
        }
    }
}

/// A slot's row for its current state, its limits applied.
fn slot_row(name: &str, slot: &Slot) -> Option<ContextResource> {
    let row = match &slot.state {
        SlotState::Pending { previous: None } => return None,
        SlotState::Live(live)
        | SlotState::Pending {
            previous: Some(live),
        } => server_row(
            name,
            &live.server,
            &live.tools,
            ResourceStatus::Ok,
            "",
            &live.warning,
        ),
        SlotState::Failed { error } => {
            server_row(name, &slot.server, &[], ResourceStatus::Invalid, error, "")
        }
    };
    let mut rows = [row];
    enforce_each(&mut rows);
    let [row] = rows;
    Some(row)
}

/// The row of a server that is not started: disabled, or with a config error.
fn unstarted_row(server: &Unstarted, status: ResourceStatus) -> ContextResource {
    ContextResource {
        source: server_source(&server.name),
        kind: ResourceKind::McpServer as i32,
        status: status as i32,
        error: server.error.clone(),
        warning: String::new(),
        body: Some(Body::McpServer(v1::McpServer {
            name: server.name.clone(),
            transport: server.transport as i32,
            config_path: server.config_path.display().to_string(),
            tools: Vec::new(),
        })),
    }
}

/// Runs a `headersHelper` with `sh -c` in `root`: its stdout must be a JSON
/// object of strings. The error never quotes the output (it holds secrets).
async fn run_headers_helper(
    helper: &str,
    root: Option<&std::path::Path>,
    env: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, String> {
    use tokio::io::AsyncReadExt as _;
    let mut command = tokio::process::Command::new("sh");
    command
        .arg("-c")
        .arg(helper)
        .env_clear()
        .envs(env)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(root) = root {
        command.current_dir(root);
    }
    let mut child = command
        .spawn()
        .map_err(|error| format!("headersHelper could not start: {error}"))?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let run = async {
        let mut output = Vec::new();
        let read = (&mut stdout)
            .take(HEADERS_HELPER_MAX_BYTES as u64 + 1)
            .read_to_end(&mut output)
            .await;
        if output.len() > HEADERS_HELPER_MAX_BYTES {
            // Still writing: its whole group goes.
            kill_group(child.id());
        }
        let status = child.wait().await;
        (read, status, output)
    };
    let (read, status, output) = match tokio::time::timeout(HEADERS_HELPER_TIMEOUT, run).await {
        Ok(done) => done,
        Err(_) => {
            kill_group(child.id());
            return Err(format!(
                "headersHelper did not finish within {}",
                humantime::format_duration(HEADERS_HELPER_TIMEOUT)
            ));
        }
    };
    read.map_err(|error| format!("headersHelper output could not be read: {error}"))?;
    if output.len() > HEADERS_HELPER_MAX_BYTES {
        return Err(format!(
            "headersHelper printed more than {HEADERS_HELPER_MAX_BYTES} bytes"
        ));
    }
    let status =
        status.map_err(|error| format!("headersHelper could not be waited for: {error}"))?;
    if !status.success() {
        return Err(format!("headersHelper failed ({status})"));
    }
    match serde_json::from_slice::<serde_json::Value>(&output) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(name, value)| match value {
                serde_json::Value::String(value) => Ok((name, value)),
                _ => Err(format!(
                    "headersHelper printed a JSON object whose {name:?} is not a string"
                )),
            })
            .collect(),
        _ => Err("headersHelper did not print a JSON object of header names to strings".to_owned()),
    }
}

/// SIGKILL to a helper's process group (it leads one).
fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid {
        // ESRCH: already gone.
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

fn add_headers(spec: &mut ctxsync_mcp::ServerSpec, extra: BTreeMap<String, String>) {
    match &mut spec.transport {
        ctxsync_mcp::TransportSpec::StreamableHttp { headers, .. }
        | ctxsync_mcp::TransportSpec::Sse { headers, .. } => headers.extend(extra),
        ctxsync_mcp::TransportSpec::Stdio { .. } => {}
    }
}

fn server_row(
    name: &str,
    server: &DeclaredServer,
    tools: &[ToolDecl],
    status: ResourceStatus,
    error: &str,
    warning: &str,
) -> ContextResource {
    ContextResource {
        source: server_source(name),
        kind: ResourceKind::McpServer as i32,
        status: status as i32,
        error: error.to_owned(),
        warning: warning.to_owned(),
        body: Some(Body::McpServer(v1::McpServer {
            name: name.to_owned(),
            transport: server.transport.to_proto() as i32,
            config_path: server.config_path.display().to_string(),
            tools: tools
                .iter()
                .map(|t| v1::McpTool {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    input_schema_json: t.input_schema_json.clone(),
                })
                .collect(),
        })),
    }
}

/// Connect plus list within `timeout`. The error is raw (unsanitized).
async fn connect_and_list(
    spec: &ctxsync_mcp::ServerSpec,
    timeout: Duration,
    tools_changed: mpsc::UnboundedSender<String>,
) -> Result<(Connection, Vec<ToolDecl>), String> {
    match ctxsync_mcp::open_and_list(spec, timeout, Some(tools_changed)).await {
        Ok(opened) => Ok((opened.connection, opened.declared.tools)),
        Err(failed) => Err(match (failed.step, failed.error) {
            (OpenStep::ListTools, McpError::Timeout { .. }) => format!(
                "tools/list did not answer within {}",
                humantime::format_duration(timeout)
            ),
            (OpenStep::ListTools, error) => format!("tools/list failed: {error}"),
            (OpenStep::Connect, error) => error.to_string(),
        }),
    }
}

async fn close(connection: Arc<Connection>) {
    // A re-list in flight may hold a clone; the last holder's drop kills the server.
    if let Ok(connection) = Arc::try_unwrap(connection) {
        connection.close().await;
    }
}
