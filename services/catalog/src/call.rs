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

use catalog_core::call::{self as core, Answer, CallRef, Open, Setup, Step};
use catalog_core::request::{Arguments, Refusal, valid_call};
use catalog_core::tools::{Catalog, CatalogDiff, Item};
use catalog_core::{ErrorCode, Failure, Transport};
use ctxsync_mcp::relay::Relay;
use ctxsync_mcp::{CallOutcome, Connection};
use ctxsync_proto::v1::{CatalogCallReply, CatalogCallRequest};
use tokio::sync::Mutex;

use crate::config::{ConfiguredServer, Current, Processes};
use crate::discovery::{Discoverer, OpenServer};
use crate::events::Events;
use crate::mcp::{self, transport_of};
use crate::processes::{Place, ProcessBound};
use crate::sessions::{LiveServer, Session, Sessions, Slot};
use crate::shared::{self, SharedServers};
use crate::store::{GenerationRef, NewEvent, StoredPin};

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

/// A pinned server's connection, as a request other than a call uses it.
pub(crate) struct Used {
    pub connection: Arc<Connection>,
    /// For sanitizing what its errors say.
    pub spec: ctxsync_mcp::ServerSpec,
    /// The server's call timeout bounds the request.
    pub timeout: Duration,
}

impl Used {
    /// The server's failure as a JSON-RPC error, sanitized of the secrets
    /// its configuration holds.
    pub fn error(&self, error: ctxsync_mcp::McpError) -> rmcp::model::ErrorData {
        let message = match mcp::call_failure(&self.spec, error) {
            core::CallFailure::Timeout { after } => format!("no answer within {after:?}"),
            core::CallFailure::Cancelled => "the client cancelled the request".to_owned(),
            core::CallFailure::Protocol { message } | core::CallFailure::Transport { message } => {
                message
            }
        };
        rmcp::model::ErrorData::internal_error(message, None)
    }
}

/// The pin and the configured server a call is for.
struct Target<'a> {
    call: CallRef<'a>,
    pin: &'a StoredPin,
    server: ConfiguredServer,
    transport: Transport,
    /// The session's signal of servers whose tools changed.
    changes: tokio::sync::watch::Sender<u64>,
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
        self.handle_relayed(request, None).await
    }

    /// [`Call::handle`] for an MCP client of `/mcp`: what the server sends
    /// during the call reaches the client through `relay`.
    pub async fn handle_relayed(
        &self,
        request: CatalogCallRequest,
        relay: Option<Relay>,
    ) -> CatalogCallReply {
        self.handle_timed(request, relay).await.0
    }

    /// [`Call::handle_relayed`], and how long the upstream server took to
    /// answer (`None` if the call never reached it): the rest of the call's
    /// time is the catalog's own.
    pub async fn handle_timed(
        &self,
        request: CatalogCallRequest,
        relay: Option<Relay>,
    ) -> (CatalogCallReply, Option<Duration>) {
        let started = Instant::now();
        let (reply, upstream) = self.call(&request, relay.as_ref()).await;
        let outcome = match &reply.error {
            Some(e) => e.reason.clone(),
            None => "ok".to_owned(),
        };
        metrics::counter!("ctxsync_catalog_calls_total", "outcome" => outcome).increment(1);
        metrics::histogram!("ctxsync_catalog_call_seconds").record(started.elapsed().as_secs_f64());
        (reply, upstream)
    }

    async fn call(
        &self,
        request: &CatalogCallRequest,
        relay: Option<&Relay>,
    ) -> (CatalogCallReply, Option<Duration>) {
        let arguments = match valid_call(request) {
            Ok(arguments) => arguments,
            Err(refusal) => return (core::refused(&refusal), None),
        };
        let session = match self.session(&request.tenant, &request.session_id).await {
            Ok(session) => session,
            Err(reply) => return (reply, None),
        };
        session
            .in_flight(self.call_in_session(&session, request, arguments, relay))
            .await
    }

    async fn session(
        &self,
        tenant: &str,
        session_id: &str,
    ) -> Result<Arc<Session>, CatalogCallReply> {
        match self
            .sessions
            .get_or_load(self.events.pool(), tenant, session_id)
            .await
        {
            Ok(Some(session)) => Ok(session),
            Ok(None) => Err(core::refused(&core::session_not_prepared(
                tenant, session_id,
            ))),
            Err(e) => Err(call_error(
                ErrorCode::Internal,
                format!(
                    "cannot read the session's pins: {}",
                    ctxsync_runtime::db::describe(&e)
                ),
            )),
        }
    }

    /// The session's connection to a pinned server, which starts (or
    /// opens) on this first use like a call's: what a completion, a
    /// resource subscription or a log level is sent on.
    pub async fn connection(
        &self,
        tenant: &str,
        session_id: &str,
        server_id: &str,
    ) -> Result<Used, CatalogCallReply> {
        let session = self.session(tenant, session_id).await?;
        let call = CallRef {
            tenant,
            session_id,
            server_id,
            // About the server, not one of its items.
            item: Item::Tool(""),
        };
        let (pin, server) = core::server_target(
            server_id,
            session.pin(server_id),
            self.configured(tenant, server_id),
        )
        .map_err(|refusal| core::refused(&refusal))?;
        let target = Target {
            call,
            pin,
            transport: transport_of(server.transport_kind()),
            server,
            changes: session.change_signal(),
        };
        let slot = session.slot(server_id);
        let ready = session.in_flight(self.ready(&target, &slot)).await?;
        Ok(Used {
            connection: ready.connection,
            spec: target.server.spec(),
            timeout: Duration::from_secs(target.server.config.limits.call_timeout_seconds),
        })
    }

    /// The session's connections that are open now (nothing is started).
    pub async fn open_connections(&self, tenant: &str, session_id: &str) -> Vec<Arc<Connection>> {
        let Ok(session) = self.session(tenant, session_id).await else {
            return Vec::new();
        };
        let mut open = Vec::new();
        for server_id in session.opened_servers() {
            let slot = session.slot(&server_id);
            let mut slot = slot.lock().await;
            if let Some(live) = slot.live().filter(|live| !live.is_closed()) {
                open.push(live.connection());
            }
        }
        open
    }

    async fn call_in_session(
        &self,
        session: &Session,
        request: &CatalogCallRequest,
        arguments: Arguments,
        relay: Option<&Relay>,
    ) -> (CatalogCallReply, Option<Duration>) {
        let target = match self.target(session, request) {
            Ok(target) => target,
            Err(reply) => return (reply, None),
        };
        let slot = session.slot(&request.server_id);
        let ready = match self.ready(&target, &slot).await {
            Ok(ready) => ready,
            Err(reply) => return (reply, None),
        };
        if let Some(reply) = self.withdrawn(&target, &ready).await {
            return (reply, None);
        }
        let Ready {
            connection,
            setup,
            first_call,
            ..
        } = ready;
        let (reply, outcome, duration) = self
            .invoke(&target, &slot, connection, arguments, relay)
            .await;
        self.record(vec![called_event(
            &target, first_call, outcome, duration, &setup,
        )]);
        // A connect on this first use is the upstream's time too.
        let upstream = duration
            + if setup.connected {
                setup.duration
            } else {
                Duration::ZERO
            };
        (reply, Some(upstream))
    }

    /// The session's pin of the server, holding the item, and the server as
    /// configured now: the core decides whether the call may go on.
    fn target<'a>(
        &self,
        session: &'a Session,
        request: &'a CatalogCallRequest,
    ) -> Result<Target<'a>, CatalogCallReply> {
        let call = CallRef::of(request);
        let (pin, server) = core::target(
            &call,
            session.pin(&request.server_id),
            self.configured(&request.tenant, &request.server_id),
        )
        .map_err(|refusal| core::refused(&refusal))?;
        Ok(Target {
            call,
            pin,
            transport: transport_of(server.transport_kind()),
            server,
            changes: session.change_signal(),
        })
    }

    /// The server as configured now, if enabled.
    fn configured(&self, tenant: &str, server_id: &str) -> Option<ConfiguredServer> {
        self.config.get().enabled_server(tenant, server_id)
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
        let target = Target {
            call: CallRef {
                tenant,
                session_id,
                server_id,
                // A re-list is about the server, not one of its items.
                item: Item::Tool(""),
            },
            pin,
            transport: transport_of(server.transport_kind()),
            server,
            changes: session.change_signal(),
        };
        let slot = session.slot(server_id);
        let mut slot = slot.lock().await;
        let Some(live) = slot.live() else {
            return;
        };
        // Only a server that said its list changed is listed again.
        let open = Open {
            closed: false,
            list_changed: live.tools_changed(),
        };
        if core::step(Some(open)) != Step::Relist {
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
        let mut setup = Setup::default();
        let open = slot.live().map(|live| Open {
            closed: live.is_closed(),
            list_changed: live.tools_changed(),
        });
        match core::step(open) {
            Step::Connect => {
                slot.close_if_gone().await;
                setup = self.connect(target, &mut slot, first_call).await?;
            }
            Step::Relist => {
                let connection = slot.live().expect("open").connection();
                self.relist(target, &mut slot, &connection).await;
            }
            Step::Use => {}
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
        let diff = self
            .record_live_catalog(target, slot, &open.catalog, Some(open.duration))
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
                        let failure = mcp::failure(&target.server.spec(), &e, started.elapsed());
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
        let diff = self
            .record_live_catalog(target, slot, &catalog, handshake)
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
            Some(bound) if target.transport == Transport::Stdio => {
                Some(bound.take(&target.server.tenant).map_err(|refusal| {
                    call_error(ErrorCode::ServerProcessLimit, refusal.to_string())
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
        let (refusal, events) =
            core::unreachable(&target.call, target.transport, &failure, first_call);
        self.record(events);
        core::refused(&refusal)
    }

    /// The server said its tools changed: compare the new list with the pin.
    /// A failed re-list keeps the previous comparison.
    async fn relist(&self, target: &Target<'_>, slot: &mut Slot, connection: &Connection) {
        let server_id = target.call.server_id;
        match tokio::time::timeout(self.connect_timeout, connection.list_all()).await {
            Ok(Ok(declared)) => {
                let upstream_ttl = declared.ttl;
                let catalog = Arc::new(mcp::catalog_of(declared));
                self.discovery
                    .relisted(&target.server, catalog.clone(), upstream_ttl);
                let diff = self.record_live_catalog(target, slot, &catalog, None).await;
                if let Some(live) = slot.live() {
                    live.set_diff(diff);
                }
            }
            Ok(Err(e)) => tracing::warn!(
                server = %server_id,
                error = %mcp::failure(&target.server.spec(), &e, Duration::ZERO).message,
                "cannot list tools after tools/list_changed"
            ),
            Err(_) => {
                tracing::warn!(server = %server_id, "listing tools after tools/list_changed timed out")
            }
        }
    }

    /// Refuses an item removed or changed since the pin (recorded as `withdrawn`).
    async fn withdrawn(&self, target: &Target<'_>, ready: &Ready) -> Option<CatalogCallReply> {
        let refusal = core::withdrawal(&target.call, &ready.diff)?;
        self.record(vec![core::called_event(
            &target.call,
            target.transport,
            ready.first_call,
            "withdrawn",
            Duration::ZERO,
            ready.setup,
        )]);
        Some(core::refused(&refusal))
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
        relay: Option<&Relay>,
    ) -> (CatalogCallReply, &'static str, Duration) {
        let limits = &target.server.config.limits;
        let timeout = Duration::from_secs(limits.call_timeout_seconds);
        let started = Instant::now();
        // A tool call registers itself (with its progress token); a prompt
        // or resource read only routes the server's questions meanwhile.
        let _relaying = relay
            .filter(|_| !matches!(target.call.item, Item::Tool(_)))
            .map(|relay| connection.relaying(relay));
        let result = match (target.call.item, relay) {
            (Item::Tool(name), Some(relay)) => {
                connection
                    .call_tool_relayed(name, arguments, timeout, relay)
                    .await
            }
            (Item::Tool(name), None) => connection.call_tool(name, arguments, timeout).await,
            (Item::Prompt(name), _) => connection
                .get_prompt(name, arguments, timeout)
                .await
                .map(whole_result),
            (Item::Resource(uri), _) => connection
                .read_resource(uri, timeout)
                .await
                .map(whole_result),
        };
        let duration = started.elapsed();
        let spec = target.server.spec();
        let result = result
            .map(|outcome| Answer {
                is_error: outcome.is_error,
                content_json: outcome.content_json,
            })
            .map_err(|e| mcp::call_failure(&spec, e));
        let classified = core::classify(&target.call, result, limits.max_content_bytes);
        if classified.outcome == "cancelled" {
            crate::relay::relayed("cancellation");
        }
        if classified.transport_broke {
            slot.lock().await.broken(connection).await;
        }
        (classified.reply, classified.outcome, duration)
    }

    /// After a call's (re)connect or a re-list: what the core says the live
    /// catalog writes (`mcp.server.connected` for a handshake; for a hash
    /// not reported yet the new generation and `mcp.catalog.changed`), in
    /// one transaction, published after commit. Returns the pin's diff.
    async fn record_live_catalog(
        &self,
        target: &Target<'_>,
        slot: &mut Slot,
        live: &Catalog,
        handshake: Option<Duration>,
    ) -> CatalogDiff {
        let server = &target.server;
        let core::LiveRecord {
            diff,
            events,
            changed,
        } = core::live_catalog(
            &target.call,
            target.transport,
            target.pin,
            live,
            handshake,
            slot.server_use(),
        );
        if events.is_empty() {
            return diff;
        }
        let tenant = target.call.tenant;
        let written = async {
            let mut tx = self.events.pool().begin().await?;
            if changed {
                self.events
                    .write_generation(
                        &mut tx,
                        &GenerationRef {
                            key: server.key.as_str(),
                            tenant,
                            server_id: server.id(),
                            transport: target.transport,
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
                    self.events
                        .generation_committed(server.key.as_str(), &live.hash);
                    slot.reported(&live.hash);
                    tracing::info!(%tenant, server = server.id(), "catalog changed since the pin");
                }
                self.events.publish(&written).await;
            }
            Err(e) => {
                tracing::error!(error = %ctxsync_runtime::db::describe(&e), server = server.id(), "cannot store call-time events")
            }
        }
        diff
    }

    /// Queued: no answer waits for its bookkeeping.
    fn record(&self, events: Vec<NewEvent>) {
        self.events.queue(events);
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

/// The call's `mcp.tool.called` (`mcp.prompt.got`, `mcp.resource.read`).
fn called_event(
    target: &Target<'_>,
    first_call: bool,
    outcome: &str,
    duration: Duration,
    setup: &Setup,
) -> NewEvent {
    core::called_event(
        &target.call,
        target.transport,
        first_call,
        outcome,
        duration,
        *setup,
    )
}

fn call_error(code: ErrorCode, message: impl Into<String>) -> CatalogCallReply {
    core::refused(&Refusal::new(code, message))
}
