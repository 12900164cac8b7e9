//! The discovery actor: owns every MCP connection and the current report.
//!
//! * The initial discovery connects every declared server in parallel (at most
//!   `max_concurrent_connects` handshakes at once), each bounded by the
//!   handshake timeout (connect and `tools/list` together, counted from when
//!   its turn comes). Each outcome updates
//!   the report the moment it arrives; a server still connecting has no
//!   `mcp_server` row yet (its file's `mcp_config` row lists it). The phase is
//!   PENDING until every server of the initial discovery has succeeded, failed or
//!   timed out (zero servers: COMPLETE at once), then COMPLETE for good.
//! * A failed server's row has status `invalid` and the sanitized error; a
//!   server with zero tools is `ok`.
//! * Reload (config files changed): instruction files, skills and config files
//!   are read again; only servers whose configuration changed are reconnected.
//!   A failed reconnect keeps the previous connection (status ok plus a
//!   warning); a removed server is closed and leaves the report.
//! * `notifications/tools/list_changed` re-lists that server's tools.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxsync_mcp::{Connection, McpError, OpenStep, Sanitizer, ToolDecl};
use ctxsync_proto::v1::{
    self, ContextResource, ResourceKind, ResourceStatus, context_resource::Body,
    mcp_discovery::Phase,
};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::context;
use crate::context_config::ContextConfig;
use crate::mcp_config::{self, DeclaredServer};
use crate::report::{Report, SharedReport, enforce_limits};

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
}

impl DiscoverySettings {
    pub fn context_config(&self) -> ContextConfig {
        ContextConfig::resolve(&self.env, self.home.as_deref(), self.working_dir.as_deref())
    }
}

/// A live connection and what it listed.
struct Live {
    connection: Arc<Connection>,
    server: DeclaredServer,
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
}

enum Event {
    Connected {
        name: String,
        generation: u64,
        outcome: Result<(Box<Connection>, Vec<ToolDecl>), String>,
        took: Duration,
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
        semaphore: Arc::new(Semaphore::new(settings.max_concurrent_connects.max(1))),
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
    semaphore: Arc<Semaphore>,
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
                Some(event) = events.recv() => self.on_event(event),
                Some(name) = tools_changed.recv() => self.on_tools_changed(&name),
                Some(()) = reload.recv() => {
                    // Coalesce a burst of triggers into one reload.
                    while reload.try_recv().is_ok() {}
                    self.reload();
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
            &self.settings.env,
            self.settings.home.as_deref(),
            config.working_dir.as_deref(),
        );
        rows.extend(configs.files);
        self.static_rows = rows;
        configs.servers
    }

    fn add(&mut self, server: DeclaredServer) {
        let generation = self.bump();
        self.spawn_connect(&server, generation);
        self.slots.insert(
            server.name.clone(),
            Slot {
                server,
                generation,
                state: SlotState::Pending { previous: None },
            },
        );
    }

    fn bump(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    fn sanitizer(&self, server: &DeclaredServer) -> Sanitizer {
        let inherited: Vec<(String, String)> = self
            .settings
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(ctxsync_mcp::process_env())
            .collect();
        Sanitizer::with_inherited_env(&server.spec(), inherited)
    }

    fn spawn_connect(&mut self, server: &DeclaredServer, generation: u64) {
        let spec = server.spec();
        let sanitizer = self.sanitizer(server);
        let name = server.name.clone();
        let timeout = self.settings.handshake_timeout;
        let semaphore = self.semaphore.clone();
        let events = self.events_tx.clone();
        let tools_changed = self.tools_changed_tx.clone();
        let shutdown = self.shutdown.clone();
        self.tasks.push(tokio::spawn(async move {
            let work = async {
                let Ok(_permit) = semaphore.acquire_owned().await else {
                    return None;
                };
                let started = Instant::now();
                let outcome = connect_and_list(&spec, timeout, tools_changed).await;
                Some((outcome, started.elapsed()))
            };
            // Shutdown drops the work: a dropped connection kills its server.
            let Some(Some((outcome, took))) = shutdown.run_until_cancelled(work).await else {
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
            } => self.on_connected(name, generation, outcome, took),
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
            }
        }
    }

    fn on_connected(
        &mut self,
        name: String,
        generation: u64,
        outcome: Result<(Box<Connection>, Vec<ToolDecl>), String>,
        took: Duration,
    ) {
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
        let sanitizer = self.sanitizer(&live.server);
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
            if slot.server.transport == server.transport {
                // Moved between files or unchanged: no reconnect.
                slot.server.config_path = server.config_path.clone();
                if let SlotState::Live(live) = &mut slot.state
                    && live.server.transport == server.transport
                {
                    live.server.config_path = server.config_path;
                }
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
            self.slots
                .get_mut(&server.name)
                .expect("present")
                .generation = generation;
            self.spawn_connect(&server, generation);
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
        let mut resources = self.static_rows.clone();
        for (name, slot) in &self.slots {
            let row = match &slot.state {
                SlotState::Pending { previous: None } => continue,
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
            resources.push(row);
        }
        Report {
            context_config: self.context_config.to_proto(),
            phase: self.phase,
            resources: enforce_limits(resources),
        }
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
            transport: server.transport.kind().to_proto() as i32,
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
