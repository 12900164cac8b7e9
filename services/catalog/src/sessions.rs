//! Calls: a pinned server starts on the first call of one of its tools, its
//! live catalog is compared with the session's pin, and its transport stays
//! open for the session until the session ends or idles.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ctxsync_mcp::{ConnectOptions, Connection, McpError, ServerSpec};
use ctxsync_proto::v1::{
    CatalogCallReply, CatalogCallRequest, CatalogEndSessionReply, CatalogEndSessionRequest,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::codes;
use crate::config::{ConfiguredServer, TransportKind};
use crate::mcp::{self, Failure};
use crate::prepare::{Cause, ms_precise, valid_request_id};
use crate::service::{Core, error};
use crate::store::{self, GenerationRef, NewEvent, StoredPin, kinds};
use crate::tools::{Catalog, CatalogDiff};

type SessionKey = (String, String);

/// Sessions with loaded pins and possibly open transports, in this process.
#[derive(Default)]
pub(crate) struct Sessions {
    inner: Mutex<HashMap<SessionKey, Arc<Session>>>,
}

pub(crate) struct Session {
    pins: HashMap<String, StoredPin>,
    servers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Slot>>>>,
    last_used: Mutex<Instant>,
    in_flight: AtomicUsize,
}

/// One server of one session.
#[derive(Default)]
struct Slot {
    live: Option<LiveServer>,
    /// Calls made to this server in this session.
    calls: u64,
    /// The hash last reported as `mcp.catalog.changed` (or the pin's).
    reported_hash: Option<String>,
}

struct LiveServer {
    connection: Arc<Connection>,
    diff: CatalogDiff,
    tools_changed: mpsc::UnboundedReceiver<String>,
}

impl Session {
    fn touch(&self) {
        *self.last_used.lock().expect("session lock") = Instant::now();
    }

    fn slot(&self, server_id: &str) -> Arc<tokio::sync::Mutex<Slot>> {
        self.servers
            .lock()
            .expect("session lock")
            .entry(server_id.to_owned())
            .or_default()
            .clone()
    }

    /// Closes every open transport; returns how many there were.
    async fn release(&self) -> u32 {
        let slots: Vec<_> = self
            .servers
            .lock()
            .expect("session lock")
            .drain()
            .map(|(_, slot)| slot)
            .collect();
        let mut released = 0;
        for slot in slots {
            if let Some(live) = slot.lock().await.live.take() {
                released += 1;
                close(live.connection).await;
            }
        }
        released
    }

    fn open_transports(&self) -> usize {
        self.servers
            .lock()
            .expect("session lock")
            .values()
            .filter(|slot| slot.try_lock().map(|s| s.live.is_some()).unwrap_or(true))
            .count()
    }
}

/// Graceful close if no call still holds the connection; otherwise the last
/// holder's drop kills the server.
async fn close(connection: Arc<Connection>) {
    match Arc::try_unwrap(connection) {
        Ok(connection) => connection.close().await,
        Err(shared) => drop(shared),
    }
    metrics::gauge!("ctxsync_catalog_open_transports").decrement(1.0);
}

impl Sessions {
    pub fn open_transports(&self) -> usize {
        let sessions: Vec<_> = self
            .inner
            .lock()
            .expect("sessions lock")
            .values()
            .cloned()
            .collect();
        sessions.iter().map(|s| s.open_transports()).sum()
    }

    fn remove(&self, key: &SessionKey) -> Option<Arc<Session>> {
        self.inner.lock().expect("sessions lock").remove(key)
    }

    pub async fn release_all(&self) -> u32 {
        let sessions: Vec<_> = self
            .inner
            .lock()
            .expect("sessions lock")
            .drain()
            .map(|(_, s)| s)
            .collect();
        let mut released = 0;
        for session in sessions {
            released += session.release().await;
        }
        released
    }

    /// Releases sessions idle for longer than `idle`.
    async fn release_idle(&self, idle: Duration) -> u32 {
        let idle_sessions: Vec<_> = {
            let mut inner = self.inner.lock().expect("sessions lock");
            let keys: Vec<SessionKey> = inner
                .iter()
                .filter(|(_, s)| {
                    s.in_flight.load(Ordering::SeqCst) == 0
                        && s.last_used.lock().expect("session lock").elapsed() >= idle
                })
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter().filter_map(|k| inner.remove(&k)).collect()
        };
        let mut released = 0;
        for session in idle_sessions {
            released += session.release().await;
        }
        released
    }
}

/// Releases idle sessions until shutdown.
pub(crate) fn spawn_reaper(core: Arc<Core>, shutdown: ctxsync_runtime::Shutdown) -> JoinHandle<()> {
    let idle = core.settings.session_idle_timeout;
    let every = (idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(30));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = ticks.tick() => {}
            }
            let released = core.sessions.release_idle(idle).await;
            if released > 0 {
                tracing::info!(released, "idle session transports closed");
            }
        }
    })
}

fn ms(duration: Duration) -> u64 {
    duration.as_millis().min(u64::MAX as u128) as u64
}

fn call_error(code: &str, message: impl Into<String>) -> CatalogCallReply {
    CatalogCallReply {
        error: error(code, message),
        ..Default::default()
    }
}

/// What the call path did before the tool ran, for the `mcp.tool.called` event.
struct Setup {
    connected: bool,
    duration: Duration,
}

impl Core {
    async fn session(
        &self,
        tenant: &str,
        session_id: &str,
    ) -> Result<Option<Arc<Session>>, sqlx::Error> {
        let key = (tenant.to_owned(), session_id.to_owned());
        if let Some(session) = self.sessions.inner.lock().expect("sessions lock").get(&key) {
            return Ok(Some(session.clone()));
        }
        let Some(pins) = store::load_pins(&self.pool, tenant, session_id).await? else {
            return Ok(None);
        };
        let session = Arc::new(Session {
            pins: pins.into_iter().map(|p| (p.server_id.clone(), p)).collect(),
            servers: Mutex::default(),
            last_used: Mutex::new(Instant::now()),
            in_flight: AtomicUsize::new(0),
        });
        let mut inner = self.sessions.inner.lock().expect("sessions lock");
        Ok(Some(inner.entry(key).or_insert(session).clone()))
    }

    pub(crate) async fn call(&self, request: CatalogCallRequest) -> CatalogCallReply {
        let started = Instant::now();
        let reply = self.call_inner(&request).await;
        let outcome = match &reply.error {
            Some(e) => e.code.clone(),
            None => "ok".to_owned(),
        };
        metrics::counter!("ctxsync_catalog_calls_total", "outcome" => outcome).increment(1);
        metrics::histogram!("ctxsync_catalog_call_seconds").record(started.elapsed().as_secs_f64());
        reply
    }

    async fn call_inner(&self, request: &CatalogCallRequest) -> CatalogCallReply {
        let (tenant, session_id) = (request.tenant.as_str(), request.session_id.as_str());
        let validated = valid_request_id("tenant", tenant)
            .and_then(|()| valid_request_id("session_id", session_id))
            .and_then(|()| valid_request_id("server_id", &request.server_id))
            .and_then(|()| valid_request_id("tool", &request.tool));
        if let Err(message) = validated {
            return call_error(codes::REQUEST_INVALID, message);
        }
        let arguments = if request.arguments_json.trim().is_empty() {
            serde_json::Map::new()
        } else {
            match serde_json::from_str::<serde_json::Value>(&request.arguments_json) {
                Ok(serde_json::Value::Object(map)) => map,
                // Never echo the arguments: they are the user's content.
                Ok(_) => {
                    return call_error(
                        codes::REQUEST_INVALID,
                        "arguments_json is not a JSON object",
                    );
                }
                Err(e) => {
                    return call_error(
                        codes::REQUEST_INVALID,
                        format!(
                            "arguments_json is not valid JSON (line {}, column {})",
                            e.line(),
                            e.column()
                        ),
                    );
                }
            }
        };
        let session = match self.session(tenant, session_id).await {
            Ok(Some(session)) => session,
            Ok(None) => {
                return call_error(
                    codes::SESSION_NOT_PREPARED,
                    format!("session {session_id:?} of tenant {tenant:?} was never prepared"),
                );
            }
            Err(e) => {
                return call_error(
                    codes::INTERNAL,
                    format!(
                        "cannot read the session's pins: {}",
                        ctxsync_runtime::db::describe(&e)
                    ),
                );
            }
        };
        session.in_flight.fetch_add(1, Ordering::SeqCst);
        session.touch();
        let reply = self.call_in_session(&session, request, arguments).await;
        session.touch();
        session.in_flight.fetch_sub(1, Ordering::SeqCst);
        reply
    }

    async fn call_in_session(
        &self,
        session: &Session,
        request: &CatalogCallRequest,
        arguments: serde_json::Map<String, serde_json::Value>,
    ) -> CatalogCallReply {
        let (tenant, session_id, server_id) =
            (&request.tenant, &request.session_id, &request.server_id);
        let Some(pin) = session.pins.get(server_id) else {
            return call_error(
                codes::SERVER_NOT_PINNED,
                format!("server {server_id:?} is not pinned in this session"),
            );
        };
        // Tools the server added after the pin stay unadvertised: unknown here.
        let Some(_) = pin.catalog.tool(&request.tool) else {
            return call_error(
                codes::TOOL_NOT_FOUND,
                format!(
                    "tool {:?} is not in the session's pin of server {server_id:?}",
                    request.tool
                ),
            );
        };
        let Some(server) = self
            .config()
            .enabled_servers(tenant)
            .and_then(|servers| servers.into_iter().find(|s| s.id() == server_id))
        else {
            return call_error(
                codes::SERVER_NOT_CONFIGURED,
                format!("server {server_id:?} is no longer configured or enabled"),
            );
        };
        let spec = mcp::spec_of(&server);

        let slot = session.slot(server_id);
        let (connection, diff, setup, first_call) = {
            let mut slot = slot.lock().await;
            let first_call = slot.calls == 0;
            slot.calls += 1;
            if slot.reported_hash.is_none() {
                slot.reported_hash = Some(pin.catalog.hash.clone());
            }
            let mut setup = Setup {
                connected: false,
                duration: Duration::ZERO,
            };
            if slot.live.as_ref().is_some_and(|l| l.connection.is_closed())
                && let Some(dead) = slot.live.take()
            {
                close(dead.connection).await;
            }
            if slot.live.is_none() {
                match self.connect_for_call(&server, &spec).await {
                    Ok((connection, catalog, duration, tools_changed)) => {
                        setup = Setup {
                            connected: true,
                            duration,
                        };
                        let diff = pin.catalog.diff(&catalog);
                        self.record_connect(
                            tenant,
                            session_id,
                            &server,
                            &mut slot,
                            pin,
                            &catalog,
                            Some(duration),
                        )
                        .await;
                        metrics::gauge!("ctxsync_catalog_open_transports").increment(1.0);
                        slot.live = Some(LiveServer {
                            connection: Arc::new(connection),
                            diff,
                            tools_changed,
                        });
                    }
                    Err(failure) => {
                        self.record_events(vec![
                            NewEvent {
                                kind: kinds::SERVER_CONNECT_FAILED,
                                tenant: tenant.clone(),
                                session_id: Some(session_id.clone()),
                                server_id: Some(server_id.clone()),
                                payload: json!({
                                    "transport": server.transport_kind().as_str(),
                                    "duration_ms": ms(failure.duration),
                                    "cause": Cause::Call.as_str(),
                                    "error_kind": failure.kind,
                                }),
                            },
                            self.called_event(
                                request,
                                &server,
                                first_call,
                                "server_unreachable",
                                Duration::ZERO,
                                &Setup {
                                    connected: false,
                                    duration: failure.duration,
                                },
                            ),
                        ])
                        .await;
                        return call_error(
                            codes::TOOL_SERVER_UNREACHABLE,
                            format!("server {server_id:?} is unreachable: {}", failure.message),
                        );
                    }
                }
            } else if let Some(live) = slot.live.as_mut() {
                // The server said its tools changed: compare the new list with the pin.
                let mut changed = false;
                while live.tools_changed.try_recv().is_ok() {
                    changed = true;
                }
                if changed {
                    let connection = live.connection.clone();
                    match tokio::time::timeout(
                        self.settings.connect_timeout,
                        connection.list_tools(),
                    )
                    .await
                    {
                        Ok(Ok(tools)) => {
                            let catalog = Arc::new(mcp::catalog_of(tools));
                            self.memory.remember(
                                &server.key,
                                server.transport_kind(),
                                catalog.clone(),
                            );
                            if let Some(live) = slot.live.as_mut() {
                                live.diff = pin.catalog.diff(&catalog);
                            }
                            self.record_connect(
                                tenant, session_id, &server, &mut slot, pin, &catalog, None,
                            )
                            .await;
                        }
                        Ok(Err(e)) => tracing::warn!(
                            server = %server_id, error = %Failure::from_error(&spec, &e, Duration::ZERO).message,
                            "cannot list tools after tools/list_changed"
                        ),
                        Err(_) => {
                            tracing::warn!(server = %server_id, "listing tools after tools/list_changed timed out")
                        }
                    }
                }
            }
            let live = slot.live.as_ref().expect("connected above");
            (
                live.connection.clone(),
                live.diff.clone(),
                setup,
                first_call,
            )
        };

        if diff.withdraws(&request.tool) {
            let reason = if diff.removed.contains(&request.tool) {
                "removed"
            } else {
                "changed"
            };
            self.record_events(vec![self.called_event(
                request,
                &server,
                first_call,
                "withdrawn",
                Duration::ZERO,
                &setup,
            )])
            .await;
            return call_error(
                codes::TOOL_WITHDRAWN,
                format!(
                    "tool {:?} of server {server_id:?} was {reason} since the session pinned it",
                    request.tool
                ),
            );
        }

        let limits = &server.config.limits;
        let call_started = Instant::now();
        let result = connection
            .call_tool(
                &request.tool,
                arguments,
                Duration::from_secs(limits.call_timeout_seconds),
            )
            .await;
        let call_duration = call_started.elapsed();
        let (reply, outcome) = match result {
            Ok(outcome) if outcome.content_json.len() as u64 > limits.max_content_bytes => (
                call_error(
                    codes::TOOL_RESULT_TOO_LARGE,
                    format!(
                        "the result is {} bytes, over the server's limit max_content_bytes = {}",
                        outcome.content_json.len(),
                        limits.max_content_bytes
                    ),
                ),
                "result_too_large",
            ),
            Ok(outcome) => (
                CatalogCallReply {
                    ok: true,
                    is_error: outcome.is_error,
                    content_json: outcome.content_json,
                    error: None,
                },
                if outcome.is_error { "tool_error" } else { "ok" },
            ),
            Err(McpError::Timeout { after }) => (
                call_error(
                    codes::TOOL_TIMEOUT,
                    format!("no result within {after:?} (limits.call_timeout_seconds)"),
                ),
                "timeout",
            ),
            Err(e @ McpError::Protocol { .. }) => (
                call_error(
                    codes::TOOL_CALL_FAILED,
                    Failure::from_error(&spec, &e, call_duration).message,
                ),
                "call_failed",
            ),
            Err(e) => {
                // The transport broke: the next call reconnects.
                let mut slot = slot.lock().await;
                if slot
                    .live
                    .as_ref()
                    .is_some_and(|l| Arc::ptr_eq(&l.connection, &connection))
                    && let Some(dead) = slot.live.take()
                {
                    drop(connection);
                    close(dead.connection).await;
                }
                (
                    call_error(
                        codes::TOOL_SERVER_UNREACHABLE,
                        format!(
                            "server {server_id:?} is unreachable: {}",
                            Failure::from_error(&spec, &e, call_duration).message
                        ),
                    ),
                    "server_unreachable",
                )
            }
        };
        self.record_events(vec![self.called_event(
            request,
            &server,
            first_call,
            outcome,
            call_duration,
            &setup,
        )])
        .await;
        reply
    }

    fn called_event(
        &self,
        request: &CatalogCallRequest,
        server: &ConfiguredServer,
        first_call: bool,
        outcome: &str,
        duration: Duration,
        setup: &Setup,
    ) -> NewEvent {
        NewEvent {
            kind: kinds::TOOL_CALLED,
            tenant: request.tenant.clone(),
            session_id: Some(request.session_id.clone()),
            server_id: Some(request.server_id.clone()),
            payload: json!({
                "transport": server.transport_kind().as_str(),
                "tool": request.tool,
                "outcome": outcome,
                "first_call": first_call,
                "connected": setup.connected,
                "setup_ms": ms_precise(setup.duration),
                "duration_ms": ms_precise(duration),
            }),
        }
    }

    /// Starts or opens the server, bounded by the user-facing timeout, and
    /// lists its tools: a live discovery, so it replaces or forgets the memory entry.
    async fn connect_for_call(
        &self,
        server: &ConfiguredServer,
        spec: &ServerSpec,
    ) -> Result<
        (
            Connection,
            Arc<Catalog>,
            Duration,
            mpsc::UnboundedReceiver<String>,
        ),
        Failure,
    > {
        let kind = server.transport_kind();
        let _permit = if kind == TransportKind::Stdio {
            Some(
                self.starts
                    .acquire()
                    .await
                    .expect("start semaphore never closes"),
            )
        } else {
            None
        };
        let timeout = self.settings.connect_timeout;
        let (sender, tools_changed) = mpsc::unbounded_channel();
        let started = Instant::now();
        let attempt = async {
            let connection = Connection::connect(
                spec,
                ConnectOptions {
                    handshake_timeout: timeout,
                    tools_changed: Some(sender),
                },
            )
            .await?;
            let remaining = timeout.saturating_sub(started.elapsed());
            match tokio::time::timeout(remaining, connection.list_tools()).await {
                Ok(Ok(tools)) => Ok((connection, tools)),
                Ok(Err(e)) => {
                    connection.kill().await;
                    Err(e)
                }
                Err(_) => {
                    connection.kill().await;
                    Err(McpError::Timeout { after: timeout })
                }
            }
        };
        match attempt.await {
            Ok((connection, tools)) => {
                let duration = started.elapsed();
                let catalog = Arc::new(mcp::catalog_of(tools));
                self.memory.remember(&server.key, kind, catalog.clone());
                metrics::histogram!(
                    "ctxsync_catalog_handshake_seconds",
                    "transport" => kind.as_str(),
                    "cause" => Cause::Call.as_str(),
                )
                .record(duration.as_secs_f64());
                Ok((connection, catalog, duration, tools_changed))
            }
            Err(e) => {
                self.memory.forget(&server.key);
                let failure = Failure::from_error(spec, &e, started.elapsed());
                metrics::counter!(
                    "ctxsync_catalog_handshake_failures_total",
                    "transport" => kind.as_str(),
                    "cause" => Cause::Call.as_str(),
                    "kind" => failure.kind,
                )
                .increment(1);
                tracing::info!(server = server.id(), error = %failure.message, "call-time connect failed");
                Err(failure)
            }
        }
    }

    /// After a call's (re)connect or a re-list: `mcp.server.connected` (for a
    /// handshake) and, when the live hash differs from the pin and from what
    /// was last reported, the new generation and `mcp.catalog.changed`; one
    /// transaction, published after commit.
    #[allow(clippy::too_many_arguments)]
    async fn record_connect(
        &self,
        tenant: &str,
        session_id: &str,
        server: &ConfiguredServer,
        slot: &mut Slot,
        pin: &StoredPin,
        live: &Catalog,
        handshake: Option<Duration>,
    ) {
        let transport = server.transport_kind();
        let mut events = Vec::new();
        let event = |kind: &'static str, payload| NewEvent {
            kind,
            tenant: tenant.to_owned(),
            session_id: Some(session_id.to_owned()),
            server_id: Some(server.id().to_owned()),
            payload,
        };
        if let Some(duration) = handshake {
            events.push(event(
                kinds::SERVER_CONNECTED,
                json!({
                    "transport": transport.as_str(),
                    "duration_ms": ms(duration),
                    "cause": Cause::Call.as_str(),
                    "catalog_hash": live.hash,
                    "tool_count": live.tools.len(),
                }),
            ));
        }
        let changed =
            live.hash != pin.catalog.hash && slot.reported_hash.as_deref() != Some(&live.hash);
        if changed {
            let diff = pin.catalog.diff(live);
            events.push(event(
                kinds::CATALOG_CHANGED,
                json!({
                    "transport": transport.as_str(),
                    "previous_hash": pin.catalog.hash,
                    "catalog_hash": live.hash,
                    "added": diff.added,
                    "removed": diff.removed,
                    "changed": diff.changed,
                }),
            ));
        }
        if events.is_empty() {
            return;
        }
        let written = async {
            let mut tx = self.pool.begin().await?;
            if changed && !self.written.contains(&server.key, &live.hash) {
                store::write_generation(
                    &mut tx,
                    &GenerationRef {
                        key: &server.key,
                        tenant,
                        server_id: server.id(),
                        transport,
                        catalog: live,
                    },
                )
                .await?;
            }
            let written = store::insert_events(&mut tx, events).await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(written)
        }
        .await;
        match written {
            Ok(written) => {
                if changed {
                    self.written.insert(server.key.clone(), live.hash.clone());
                    slot.reported_hash = Some(live.hash.clone());
                    tracing::info!(%tenant, server = server.id(), "catalog changed since the pin");
                }
                self.publish(&written).await;
            }
            Err(e) => {
                tracing::error!(error = %ctxsync_runtime::db::describe(&e), server = server.id(), "cannot store call-time events")
            }
        }
    }

    async fn record_events(&self, events: Vec<NewEvent>) {
        let written = async {
            let mut conn = self.pool.acquire().await?;
            store::insert_events(&mut conn, events).await
        }
        .await;
        match written {
            Ok(written) => self.publish(&written).await,
            Err(e) => {
                tracing::warn!(error = %ctxsync_runtime::db::describe(&e), "cannot store call events")
            }
        }
    }

    pub(crate) async fn end_session(
        &self,
        request: CatalogEndSessionRequest,
    ) -> CatalogEndSessionReply {
        if let Err(message) = valid_request_id("tenant", &request.tenant)
            .and_then(|()| valid_request_id("session_id", &request.session_id))
        {
            return CatalogEndSessionReply {
                error: error(codes::REQUEST_INVALID, message),
                ..Default::default()
            };
        }
        let released = match self
            .sessions
            .remove(&(request.tenant.clone(), request.session_id.clone()))
        {
            Some(session) => session.release().await,
            None => 0,
        };
        tracing::debug!(tenant = %request.tenant, released, "session ended");
        CatalogEndSessionReply {
            released,
            error: None,
        }
    }
}
