//! The `call` command: a pinned server starts on the first use of one of its
//! tools, prompts or resources, its live catalog is compared with the
//! session's pin (an item removed or changed since is withdrawn), and its
//! transport stays open for the session's later calls.
//!
//! One call, step by step: find the pin and the configured server
//! ([`Call::target`]); make the server ready ([`Call::ready`]: connect, or
//! re-list after a list change, recording what changed); refuse a
//! withdrawn item ([`Call::withdrawn`]); use it ([`Call::invoke`]: a tool
//! call, `prompts/get` or `resources/read`); classify the result
//! ([`classify`]); record `mcp.tool.called` (`mcp.prompt.got`,
//! `mcp.resource.read`). A prompt's or resource's error codes are the
//! tool's with its own prefix (`prompt.withdrawn`, `resource.timeout`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxsync_mcp::TransportKind;
use ctxsync_mcp::{CallOutcome, Connection, McpError};
use ctxsync_proto::v1::{CatalogCallReply, CatalogCallRequest};
use serde_json::json;
use tokio::sync::Mutex;

use crate::config::{ConfiguredServer, Current, Processes};
use crate::discovery::{Cause, Discoverer, OpenServer};
use crate::events::{Events, ms, ms_precise};
use crate::mcp::{self, Failure};
use crate::processes::{Place, ProcessBound};
use crate::request::{MAX_RESOURCE_URI_BYTES, codes, error, valid_bounded, valid_request_id};
use crate::sessions::{LiveServer, Session, Sessions, Slot};
use crate::shared::{self, SharedServers};
use crate::store::{GenerationRef, NewEvent, StoredPin, kinds};
use crate::tools::{Catalog, CatalogDiff, Item};

type Arguments = serde_json::Map<String, serde_json::Value>;

/// The `call` command.
pub(crate) struct Call {
    config: Arc<Current>,
    sessions: Arc<Sessions>,
    discovery: Arc<Discoverer>,
    events: Arc<Events>,
    /// The handshake bound of a call's (re)connect, and of a re-list.
    connect_timeout: Duration,
    processes: Option<Arc<ProcessBound>>,
    shared: Arc<SharedServers>,
}

/// The pin and the configured server a call is for.
struct Target<'a> {
    request: &'a CatalogCallRequest,
    pin: &'a StoredPin,
    server: ConfiguredServer,
    /// The session's signal of servers whose tools changed.
    changes: tokio::sync::watch::Sender<u64>,
}

/// What the call path did before the tool ran, for the `mcp.tool.called` event.
struct Setup {
    connected: bool,
    duration: Duration,
}

/// The server, ready to take the call.
struct Ready {
    connection: Arc<Connection>,
    diff: CatalogDiff,
    setup: Setup,
    first_call: bool,
}

impl Call {
    pub fn new(
        config: Arc<Current>,
        sessions: Arc<Sessions>,
        discovery: Arc<Discoverer>,
        events: Arc<Events>,
        connect_timeout: Duration,
        processes: Option<Arc<ProcessBound>>,
        shared: Arc<SharedServers>,
    ) -> Self {
        Self {
            config,
            sessions,
            discovery,
            events,
            connect_timeout,
            processes,
            shared,
        }
    }

    pub async fn handle(&self, request: CatalogCallRequest) -> CatalogCallReply {
        let started = Instant::now();
        let mut reply = self.call(&request).await;
        if let Some(error) = &mut reply.error {
            error.code = code_for(item_of(&request), &error.code);
        }
        let outcome = match &reply.error {
            Some(e) => e.code.clone(),
            None => "ok".to_owned(),
        };
        metrics::counter!("ctxsync_catalog_calls_total", "outcome" => outcome).increment(1);
        metrics::histogram!("ctxsync_catalog_call_seconds").record(started.elapsed().as_secs_f64());
        reply
    }

    async fn call(&self, request: &CatalogCallRequest) -> CatalogCallReply {
        let (tenant, session_id) = (request.tenant.as_str(), request.session_id.as_str());
        let validated = valid_request_id("tenant", tenant)
            .and_then(|()| valid_request_id("session_id", session_id))
            .and_then(|()| valid_request_id("server_id", &request.server_id))
            .and_then(|()| valid_item(request));
        if let Err(message) = validated {
            return call_error(codes::REQUEST_INVALID, message);
        }
        let arguments = match arguments_of(&request.arguments_json) {
            Ok(arguments) => arguments,
            Err(message) => return call_error(codes::REQUEST_INVALID, message),
        };
        let session = match self
            .sessions
            .get_or_load(self.events.pool(), tenant, session_id)
            .await
        {
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
        session
            .in_flight(self.call_in_session(&session, request, arguments))
            .await
    }

    async fn call_in_session(
        &self,
        session: &Session,
        request: &CatalogCallRequest,
        arguments: Arguments,
    ) -> CatalogCallReply {
        let target = match self.target(session, request) {
            Ok(target) => target,
            Err(reply) => return reply,
        };
        let slot = session.slot(&request.server_id);
        let ready = match self.ready(&target, &slot).await {
            Ok(ready) => ready,
            Err(reply) => return reply,
        };
        if let Some(reply) = self.withdrawn(&target, &ready).await {
            return reply;
        }
        let Ready {
            connection,
            setup,
            first_call,
            ..
        } = ready;
        let (reply, outcome, duration) = self.invoke(&target, &slot, connection, arguments).await;
        self.record(vec![called_event(
            &target, first_call, outcome, duration, &setup,
        )])
        .await;
        reply
    }

    /// The session's pin of the server, holding the tool, and the server as
    /// configured now.
    fn target<'a>(
        &self,
        session: &'a Session,
        request: &'a CatalogCallRequest,
    ) -> Result<Target<'a>, CatalogCallReply> {
        let server_id = &request.server_id;
        let Some(pin) = session.pin(server_id) else {
            return Err(call_error(
                codes::SERVER_NOT_PINNED,
                format!("server {server_id:?} is not pinned in this session"),
            ));
        };
        // Items the server added after the pin stay unadvertised: unknown here.
        let item = item_of(request);
        if !pin.catalog.has(item) {
            return Err(call_error(
                codes::TOOL_NOT_FOUND,
                format!(
                    "{} {:?} is not in the session's pin of server {server_id:?}",
                    item.kind(),
                    item.key()
                ),
            ));
        }
        let Some(server) = self.configured(&request.tenant, server_id) else {
            return Err(call_error(
                codes::SERVER_NOT_CONFIGURED,
                format!("server {server_id:?} is no longer configured or enabled"),
            ));
        };
        Ok(Target {
            request,
            pin,
            server,
            changes: session.change_signal(),
        })
    }

    /// The server as configured now, if enabled.
    fn configured(&self, tenant: &str, server_id: &str) -> Option<ConfiguredServer> {
        self.config
            .get()
            .enabled_servers(tenant)
            .and_then(|servers| servers.into_iter().find(|s| s.id() == server_id))
    }

    /// Re-lists a server of the session that said its tools changed, without
    /// a call: its comparison with the pin is current for the next list.
    pub async fn refresh(
        &self,
        session: &Session,
        tenant: &str,
        session_id: &str,
        server_id: &str,
    ) {
        let (Some(pin), Some(server)) =
            (session.pin(server_id), self.configured(tenant, server_id))
        else {
            return;
        };
        let request = CatalogCallRequest {
            tenant: tenant.to_owned(),
            session_id: session_id.to_owned(),
            server_id: server_id.to_owned(),
            ..Default::default()
        };
        let target = Target {
            request: &request,
            pin,
            server,
            changes: session.change_signal(),
        };
        let slot = session.slot(server_id);
        let mut slot = slot.lock().await;
        let Some(live) = slot.live() else {
            return;
        };
        if !live.tools_changed() {
            return;
        }
        let connection = live.connection();
        self.relist(&target, &mut slot, &connection).await;
    }

    /// Counts the call and makes the server ready: connects it if the session
    /// has no open transport to it, else re-lists its tools if it said they
    /// changed. The slot stays locked meanwhile: one (re)connect per server
    /// and session at a time.
    async fn ready(
        &self,
        target: &Target<'_>,
        slot: &Mutex<Slot>,
    ) -> Result<Ready, CatalogCallReply> {
        let mut slot = slot.lock().await;
        let first_call = slot.count_call(target.pin);
        let mut setup = Setup {
            connected: false,
            duration: Duration::ZERO,
        };
        slot.close_if_gone().await;
        let relist = match slot.live() {
            Some(live) => live.tools_changed().then(|| live.connection()),
            None => {
                setup = self.connect(target, &mut slot, first_call).await?;
                None
            }
        };
        if let Some(connection) = relist {
            self.relist(target, &mut slot, &connection).await;
        }
        let live = slot.live().expect("connected above");
        Ok(Ready {
            connection: live.connection(),
            diff: live.diff().clone(),
            setup,
            first_call,
        })
    }

    /// Starts or opens the server: a live discovery, recorded as such. A
    /// failure answers the call.
    async fn connect(
        &self,
        target: &Target<'_>,
        slot: &mut Slot,
        first_call: bool,
    ) -> Result<Setup, CatalogCallReply> {
        if target.server.config.processes == Processes::Shared {
            return self.connect_shared(target, slot, first_call).await;
        }
        let (open, place) = self.start(target, first_call).await?;
        let diff = target.pin.catalog.diff(&open.catalog);
        self.record_live_catalog(target, slot, &open.catalog, Some(open.duration))
            .await;
        let notices = shared::notices(open.tools_changed);
        slot.open(LiveServer::new(
            Arc::new(open.connection),
            diff,
            notices.subscribe(),
            target.changes.clone(),
            place,
        ));
        Ok(Setup {
            connected: true,
            duration: open.duration,
        })
    }

    /// Attaches the session to a shared process of the server, started if
    /// the pool needs one; an existing one is listed again for this pin.
    async fn connect_shared(
        &self,
        target: &Target<'_>,
        slot: &mut Slot,
        first_call: bool,
    ) -> Result<Setup, CatalogCallReply> {
        let started = Instant::now();
        let attached = self
            .shared
            .attach(&target.server, || self.start(target, first_call))
            .await?;
        let (catalog, handshake) = match attached.started {
            Some((catalog, duration)) => (catalog, Some(duration)),
            None => {
                let listed =
                    tokio::time::timeout(self.connect_timeout, attached.connection.list_all())
                        .await;
                match listed {
                    Ok(Ok(declared)) => (Arc::new(mcp::catalog_of(declared)), None),
                    Ok(Err(e)) => {
                        let failure =
                            Failure::from_error(&target.server.spec(), &e, started.elapsed());
                        return Err(self.unreachable(target, failure, first_call).await);
                    }
                    Err(_) => {
                        let failure = Failure {
                            kind: "timeout",
                            message: format!(
                                "no tools/list answer within {:?}",
                                self.connect_timeout
                            ),
                            duration: started.elapsed(),
                        };
                        return Err(self.unreachable(target, failure, first_call).await);
                    }
                }
            }
        };
        let diff = target.pin.catalog.diff(&catalog);
        self.record_live_catalog(target, slot, &catalog, handshake)
            .await;
        slot.open(LiveServer::new(
            attached.connection,
            diff,
            attached.notices,
            target.changes.clone(),
            None,
        ));
        Ok(Setup {
            connected: handshake.is_some(),
            duration: started.elapsed(),
        })
    }

    /// Starts or opens the server, with its place under the process bound:
    /// a live discovery, recorded as such. A failure answers the call.
    async fn start(
        &self,
        target: &Target<'_>,
        first_call: bool,
    ) -> Result<(OpenServer, Option<Place>), CatalogCallReply> {
        // A stdio server is a process of this replica: it needs a place.
        let place = match &self.processes {
            Some(bound) if target.server.transport_kind() == TransportKind::Stdio => {
                Some(bound.take(&target.server.tenant).map_err(|refusal| {
                    call_error(codes::SERVER_PROCESS_LIMIT, refusal.to_string())
                })?)
            }
            _ => None,
        };
        // Boxed: a connect's future is large, and every call would carry it.
        let opened = Box::pin(self.discovery.open(&target.server, self.connect_timeout)).await;
        match opened {
            Ok(open) => Ok((open, place)),
            Err(failure) => Err(self.unreachable(target, failure, first_call).await),
        }
    }

    /// A failed connect, recorded; the answer to the call.
    async fn unreachable(
        &self,
        target: &Target<'_>,
        failure: Failure,
        first_call: bool,
    ) -> CatalogCallReply {
        let failed = Setup {
            connected: false,
            duration: failure.duration,
        };
        self.record(vec![
            server_event(
                target,
                kinds::SERVER_CONNECT_FAILED,
                json!({
                    "transport": target.server.transport_kind().as_str(),
                    "duration_ms": ms(failure.duration),
                    "cause": Cause::Call.as_str(),
                    "error_kind": failure.kind,
                }),
            ),
            called_event(
                target,
                first_call,
                "server_unreachable",
                Duration::ZERO,
                &failed,
            ),
        ])
        .await;
        call_error(
            codes::TOOL_SERVER_UNREACHABLE,
            format!(
                "server {:?} is unreachable: {}",
                target.request.server_id, failure.message
            ),
        )
    }

    /// The server said its tools changed: compare the new list with the pin.
    /// A failed re-list keeps the previous comparison.
    async fn relist(&self, target: &Target<'_>, slot: &mut Slot, connection: &Connection) {
        let server_id = &target.request.server_id;
        match tokio::time::timeout(self.connect_timeout, connection.list_all()).await {
            Ok(Ok(declared)) => {
                let catalog = Arc::new(mcp::catalog_of(declared));
                self.discovery.relisted(&target.server, catalog.clone());
                if let Some(live) = slot.live() {
                    live.set_diff(target.pin.catalog.diff(&catalog));
                }
                self.record_live_catalog(target, slot, &catalog, None).await;
            }
            Ok(Err(e)) => tracing::warn!(
                server = %server_id,
                error = %Failure::from_error(&target.server.spec(), &e, Duration::ZERO).message,
                "cannot list tools after tools/list_changed"
            ),
            Err(_) => {
                tracing::warn!(server = %server_id, "listing tools after tools/list_changed timed out")
            }
        }
    }

    /// Refuses an item removed or changed since the pin (recorded as `withdrawn`).
    async fn withdrawn(&self, target: &Target<'_>, ready: &Ready) -> Option<CatalogCallReply> {
        let item = item_of(target.request);
        if !ready.diff.withdraws_item(item) {
            return None;
        }
        let reason = if ready.diff.removes_item(item) {
            "removed"
        } else {
            "changed"
        };
        self.record(vec![called_event(
            target,
            ready.first_call,
            "withdrawn",
            Duration::ZERO,
            &ready.setup,
        )])
        .await;
        Some(call_error(
            codes::TOOL_WITHDRAWN,
            format!(
                "{} {:?} of server {:?} was {reason} since the session pinned it",
                item.kind(),
                item.key(),
                target.request.server_id
            ),
        ))
    }

    /// Calls the tool within the server's limit; a broken transport is
    /// closed, so the next call reconnects. Returns the answer, the outcome
    /// recorded and how long the call took.
    async fn invoke(
        &self,
        target: &Target<'_>,
        slot: &Mutex<Slot>,
        connection: Arc<Connection>,
        arguments: Arguments,
    ) -> (CatalogCallReply, &'static str, Duration) {
        let limits = &target.server.config.limits;
        let timeout = Duration::from_secs(limits.call_timeout_seconds);
        let started = Instant::now();
        let result = match item_of(target.request) {
            Item::Tool(name) => connection.call_tool(name, arguments, timeout).await,
            Item::Prompt(name) => connection
                .get_prompt(name, arguments, timeout)
                .await
                .map(whole_result),
            Item::Resource(uri) => connection
                .read_resource(uri, timeout)
                .await
                .map(whole_result),
        };
        let duration = started.elapsed();
        let (reply, outcome, transport_broke) = classify(target, result, duration);
        if transport_broke {
            slot.lock().await.broken(connection).await;
        }
        (reply, outcome, duration)
    }

    /// After a call's (re)connect or a re-list: `mcp.server.connected` (for a
    /// handshake) and, when the live hash differs from the pin and from what
    /// was last reported, the new generation and `mcp.catalog.changed`; one
    /// transaction, published after commit.
    async fn record_live_catalog(
        &self,
        target: &Target<'_>,
        slot: &mut Slot,
        live: &Catalog,
        handshake: Option<Duration>,
    ) {
        let (server, pin) = (&target.server, target.pin);
        let transport = server.transport_kind();
        let mut events = Vec::new();
        if let Some(duration) = handshake {
            events.push(server_event(
                target,
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
        let changed = slot.is_unreported_change(pin, &live.hash);
        if changed {
            let diff = pin.catalog.diff(live);
            events.push(server_event(
                target,
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
        let tenant = target.request.tenant.as_str();
        let written = async {
            let mut tx = self.events.pool().begin().await?;
            if changed {
                self.events
                    .write_generation(
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
            let written = crate::store::insert_events(&mut tx, events).await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(written)
        }
        .await;
        match written {
            Ok(written) => {
                if changed {
                    self.events.generation_committed(&server.key, &live.hash);
                    slot.reported(&live.hash);
                    tracing::info!(%tenant, server = server.id(), "catalog changed since the pin");
                }
                self.events.publish(&written).await;
            }
            Err(e) => {
                tracing::error!(error = %ctxsync_runtime::db::describe(&e), server = server.id(), "cannot store call-time events")
            }
        }
    }

    async fn record(&self, events: Vec<NewEvent>) {
        if let Err(e) = self.events.record(events).await {
            tracing::warn!(error = %ctxsync_runtime::db::describe(&e), "cannot store call events");
        }
    }
}

/// What the request names: its prompt, else its resource, else its tool.
fn item_of(request: &CatalogCallRequest) -> Item<'_> {
    if !request.prompt.is_empty() {
        Item::Prompt(&request.prompt)
    } else if !request.resource_uri.is_empty() {
        Item::Resource(&request.resource_uri)
    } else {
        Item::Tool(&request.tool)
    }
}

/// Exactly one of `tool`, `prompt` and `resource_uri`, each a valid id (a
/// URI may be longer).
fn valid_item(request: &CatalogCallRequest) -> Result<(), String> {
    let named = [&request.tool, &request.prompt, &request.resource_uri]
        .iter()
        .filter(|v| !v.is_empty())
        .count();
    if named > 1 {
        return Err("name exactly one of tool, prompt and resource_uri".to_owned());
    }
    match item_of(request) {
        Item::Tool(tool) => valid_request_id("tool", tool),
        Item::Prompt(prompt) => valid_request_id("prompt", prompt),
        Item::Resource(uri) => valid_bounded("resource_uri", uri, MAX_RESOURCE_URI_BYTES),
    }
}

/// The code of a tool's error, for `item`: `tool.timeout` is
/// `prompt.timeout` for a prompt; server and session codes stay.
fn code_for(item: Item<'_>, code: &str) -> String {
    match (item, code.strip_prefix("tool.")) {
        (Item::Tool(_), _) | (_, None) => code.to_owned(),
        (item, Some(rest)) => format!("{}.{rest}", item.kind()),
    }
}

/// A prompt's or resource's whole result as a call's content.
fn whole_result(json: String) -> CallOutcome {
    CallOutcome {
        is_error: false,
        content_json: json,
        structured_content_json: None,
    }
}

/// The call's arguments: a JSON object, or nothing.
fn arguments_of(json: &str) -> Result<Arguments, String> {
    if json.trim().is_empty() {
        return Ok(Arguments::new());
    }
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        // Never echo the arguments: they are the user's content.
        Ok(_) => Err("arguments_json is not a JSON object".to_owned()),
        Err(e) => Err(format!(
            "arguments_json is not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        )),
    }
}

/// The answer to a tool's result, the outcome recorded, and whether the
/// transport broke.
fn classify(
    target: &Target<'_>,
    result: Result<CallOutcome, McpError>,
    duration: Duration,
) -> (CatalogCallReply, &'static str, bool) {
    let limits = &target.server.config.limits;
    let sanitized = |e: &McpError| Failure::from_error(&target.server.spec(), e, duration).message;
    match result {
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
            false,
        ),
        Ok(outcome) => {
            let outcome_name = if outcome.is_error { "tool_error" } else { "ok" };
            (
                CatalogCallReply {
                    ok: true,
                    is_error: outcome.is_error,
                    content_json: outcome.content_json,
                    error: None,
                },
                outcome_name,
                false,
            )
        }
        Err(McpError::Timeout { after }) => (
            call_error(
                codes::TOOL_TIMEOUT,
                format!("no result within {after:?} (limits.call_timeout_seconds)"),
            ),
            "timeout",
            false,
        ),
        Err(e @ McpError::Protocol { .. }) => (
            call_error(codes::TOOL_CALL_FAILED, sanitized(&e)),
            "call_failed",
            false,
        ),
        Err(e) => (
            call_error(
                codes::TOOL_SERVER_UNREACHABLE,
                format!(
                    "server {:?} is unreachable: {}",
                    target.request.server_id,
                    sanitized(&e)
                ),
            ),
            "server_unreachable",
            true,
        ),
    }
}

/// An event about the call's server in its session.
fn server_event(target: &Target<'_>, kind: &'static str, payload: serde_json::Value) -> NewEvent {
    NewEvent {
        kind,
        tenant: target.request.tenant.clone(),
        session_id: Some(target.request.session_id.clone()),
        server_id: Some(target.request.server_id.clone()),
        payload,
    }
}

/// `mcp.tool.called`, `mcp.prompt.got` or `mcp.resource.read`.
fn called_event(
    target: &Target<'_>,
    first_call: bool,
    outcome: &str,
    duration: Duration,
    setup: &Setup,
) -> NewEvent {
    let item = item_of(target.request);
    let (kind, field) = match item {
        Item::Tool(_) => (kinds::TOOL_CALLED, "tool"),
        Item::Prompt(_) => (kinds::PROMPT_GOT, "prompt"),
        Item::Resource(_) => (kinds::RESOURCE_READ, "uri"),
    };
    server_event(
        target,
        kind,
        json!({
            "transport": target.server.transport_kind().as_str(),
            field: item.key(),
            "outcome": outcome,
            "first_call": first_call,
            "connected": setup.connected,
            "setup_ms": ms_precise(setup.duration),
            "duration_ms": ms_precise(duration),
        }),
    )
}

fn call_error(code: &str, message: impl Into<String>) -> CatalogCallReply {
    CatalogCallReply {
        error: error(code, message),
        ..Default::default()
    }
}
