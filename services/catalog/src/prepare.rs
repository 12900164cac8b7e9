//! Preparation: pin every enabled server of the tenant for a session, from
//! memory without starting it where the rules allow, else live; then write
//! the generations it needs, the pins and the events in ONE transaction, in
//! configured-server order. A failure commits none of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{CatalogPin, CatalogPrepareReply, CatalogPrepareRequest, McpTransport};
use serde_json::json;

use crate::config::{ConfiguredServer, TransportKind};
use crate::mcp::{self, Failure};
use crate::service::{Core, error};
use crate::store::{self, GenerationRef, NewEvent, NewPin, PinSource, kinds};
use crate::tools::Catalog;
use crate::{MAX_REQUEST_ID_BYTES, codes};

/// Why a live discovery ran: it is timed and labelled by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    Preparation,
    Call,
    Warmup,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Preparation => "preparation",
            Self::Call => "call",
            Self::Warmup => "warmup",
        }
    }
}

/// A successful live discovery.
pub(crate) struct Live {
    pub catalog: Arc<Catalog>,
    pub duration: Duration,
}

enum Outcome {
    Remembered(Arc<Catalog>),
    Connected(Live),
    Failed(Failure),
}

pub(crate) fn valid_request_id(name: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{name} is empty"));
    }
    // Ids are stored in text columns, which cannot hold NUL.
    if let Some(at) = value.find('\0') {
        return Err(format!("{name} contains U+0000 (NUL) at byte {at}"));
    }
    if value.len() > MAX_REQUEST_ID_BYTES {
        return Err(format!(
            "{name} is {} bytes, over the limit of {MAX_REQUEST_ID_BYTES}",
            value.len()
        ));
    }
    Ok(())
}

fn ms(duration: Duration) -> u64 {
    duration.as_millis().min(u64::MAX as u128) as u64
}

/// Milliseconds with microsecond precision, for phases that take less than one.
pub(crate) fn ms_precise(duration: Duration) -> f64 {
    duration.as_micros() as f64 / 1000.0
}

fn transport_proto(text: &str) -> McpTransport {
    match text {
        "stdio" => McpTransport::Stdio,
        "streamable_http" => McpTransport::StreamableHttp,
        _ => McpTransport::Unspecified,
    }
}

impl Core {
    /// Discovers `server` live (connect, list, close). Success replaces the
    /// memory entry; failure forgets it.
    pub(crate) async fn discover_live(
        &self,
        server: &ConfiguredServer,
        timeout: Duration,
        cause: Cause,
    ) -> Result<Live, Failure> {
        let kind = server.transport_kind();
        // The warm-up runs one server at a time on its own and never takes a
        // start slot from a user.
        let _permit = if kind == TransportKind::Stdio && cause != Cause::Warmup {
            Some(
                self.starts
                    .acquire()
                    .await
                    .expect("start semaphore never closes"),
            )
        } else {
            None
        };
        let spec = mcp::spec_of(server);
        let started = Instant::now();
        let result = if cause == Cause::Warmup {
            // Closed before the next server starts: one at a time, strictly.
            ctxsync_mcp::discover(&spec, timeout).await
        } else {
            self.discover_closing_later(&spec, timeout).await
        };
        match result {
            Ok(discovery) => {
                let catalog = Arc::new(mcp::catalog_of(discovery.tools));
                self.memory.remember(&server.key, kind, catalog.clone());
                metrics::histogram!(
                    "ctxsync_catalog_handshake_seconds",
                    "transport" => kind.as_str(),
                    "cause" => cause.as_str(),
                )
                .record(discovery.duration.as_secs_f64());
                tracing::debug!(
                    tenant = %server.tenant, server = server.id(), cause = cause.as_str(),
                    tools = catalog.tools.len(), duration_ms = ms(discovery.duration),
                    "live discovery"
                );
                Ok(Live {
                    catalog,
                    duration: discovery.duration,
                })
            }
            Err(error) => {
                self.memory.forget(&server.key);
                let failure = Failure::from_error(&spec, &error, started.elapsed());
                metrics::counter!(
                    "ctxsync_catalog_handshake_failures_total",
                    "transport" => kind.as_str(),
                    "cause" => cause.as_str(),
                    "kind" => failure.kind,
                )
                .increment(1);
                Err(failure)
            }
        }
    }

    /// Connect and list within `timeout`, then close in the background: a
    /// user waits for the tools, not for the server to exit.
    async fn discover_closing_later(
        &self,
        spec: &ctxsync_mcp::ServerSpec,
        timeout: Duration,
    ) -> Result<ctxsync_mcp::Discovery, ctxsync_mcp::McpError> {
        let started = Instant::now();
        let connection = ctxsync_mcp::Connection::connect(
            spec,
            ctxsync_mcp::ConnectOptions {
                handshake_timeout: timeout,
                tools_changed: None,
            },
        )
        .await?;
        let remaining = timeout.saturating_sub(started.elapsed());
        let tools = match tokio::time::timeout(remaining, connection.list_tools()).await {
            Ok(Ok(tools)) => tools,
            Ok(Err(error)) => {
                connection.kill().await;
                return Err(error);
            }
            Err(_) => {
                connection.kill().await;
                return Err(ctxsync_mcp::McpError::Timeout { after: timeout });
            }
        };
        let duration = started.elapsed();
        let server_info = connection.server_info();
        self.closing.spawn(connection.close());
        Ok(ctxsync_mcp::Discovery {
            tools,
            server_info,
            duration,
        })
    }

    pub(crate) async fn prepare(&self, request: CatalogPrepareRequest) -> CatalogPrepareReply {
        let started = Instant::now();
        let reply = self.prepare_inner(&request, started).await;
        let outcome = match (&reply.error, reply.follow_up) {
            (Some(_), _) => "error",
            (None, true) => "follow_up",
            (None, false) => "first",
        };
        metrics::counter!("ctxsync_catalog_preparations_total", "outcome" => outcome).increment(1);
        metrics::histogram!("ctxsync_catalog_preparation_seconds", "outcome" => outcome)
            .record(started.elapsed().as_secs_f64());
        reply
    }

    async fn prepare_inner(
        &self,
        request: &CatalogPrepareRequest,
        started: Instant,
    ) -> CatalogPrepareReply {
        let tenant = request.tenant.as_str();
        let session_id = request.session_id.as_str();
        if let Err(message) = valid_request_id("tenant", tenant)
            .and_then(|()| valid_request_id("session_id", session_id))
        {
            return CatalogPrepareReply {
                error: error(codes::REQUEST_INVALID, message),
                ..Default::default()
            };
        }
        let Some(servers) = self.config().enabled_servers(tenant) else {
            return CatalogPrepareReply {
                error: error(
                    codes::TENANT_UNKNOWN,
                    format!("tenant {tenant:?} is not configured"),
                ),
                ..Default::default()
            };
        };
        let mut outcomes: Vec<Option<Outcome>> = servers
            .iter()
            .map(|s| {
                self.memory
                    .reusable(&s.key)
                    .map(|r| Outcome::Remembered(r.catalog))
            })
            .collect();
        let lookup = started.elapsed();

        // A session is prepared once; asking again answers its stored pins.
        // Checked up front only when a server would be started: otherwise the
        // write itself finds the session (one round trip fewer for new chats).
        if outcomes.iter().any(Option::is_none) {
            match store::load_pins(&self.pool, tenant, session_id).await {
                Ok(Some(_)) => return self.follow_up(tenant, session_id, started).await,
                Ok(None) => {}
                Err(e) => {
                    return internal(format!(
                        "cannot read the session's pins: {}",
                        ctxsync_runtime::db::describe(&e)
                    ));
                }
            }
        }

        let discovery_started = Instant::now();
        let live = futures::future::join_all(
            servers
                .iter()
                .zip(&outcomes)
                .filter(|(_, outcome)| outcome.is_none())
                .map(|(server, _)| async move {
                    self.discover_live(server, self.settings.connect_timeout, Cause::Preparation)
                        .await
                }),
        )
        .await;
        let mut live = live.into_iter();
        for outcome in &mut outcomes {
            if outcome.is_none() {
                *outcome = Some(match live.next().expect("one result per live server") {
                    Ok(l) => Outcome::Connected(l),
                    Err(f) => Outcome::Failed(f),
                });
            }
        }
        let outcomes: Vec<Outcome> = outcomes.into_iter().map(|o| o.expect("filled")).collect();
        let discovery = discovery_started.elapsed();

        let write_started = Instant::now();
        let written = match self
            .write_preparation(
                tenant,
                session_id,
                &servers,
                &outcomes,
                started,
                lookup,
                discovery,
                write_started,
            )
            .await
        {
            Ok(Some(events)) => events,
            // A concurrent request prepared the session first.
            Ok(None) => return self.follow_up(tenant, session_id, started).await,
            Err(e) => {
                tracing::error!(%tenant, error = %ctxsync_runtime::db::describe(&e), "preparation not committed");
                return internal(format!(
                    "cannot store the preparation: {}",
                    ctxsync_runtime::db::describe(&e)
                ));
            }
        };
        for (server, outcome) in servers.iter().zip(&outcomes) {
            if let Outcome::Remembered(c) | Outcome::Connected(Live { catalog: c, .. }) = outcome {
                self.written.insert(server.key.clone(), c.hash.clone());
            }
        }
        self.publish(&written).await;

        let pins = servers
            .iter()
            .zip(outcomes)
            .map(|(server, outcome)| {
                let transport = server.transport_kind().to_proto() as i32;
                match outcome {
                    Outcome::Remembered(catalog) => CatalogPin {
                        server_id: server.id().to_owned(),
                        transport,
                        source: Source::Pinned as i32,
                        catalog_hash: catalog.hash.clone(),
                        tools: catalog.tools.iter().map(|t| t.to_proto()).collect(),
                        ..Default::default()
                    },
                    Outcome::Connected(live) => CatalogPin {
                        server_id: server.id().to_owned(),
                        transport,
                        source: Source::Connected as i32,
                        catalog_hash: live.catalog.hash.clone(),
                        tools: live.catalog.tools.iter().map(|t| t.to_proto()).collect(),
                        handshake_ms: ms(live.duration),
                        ..Default::default()
                    },
                    Outcome::Failed(failure) => CatalogPin {
                        server_id: server.id().to_owned(),
                        transport,
                        source: Source::Failed as i32,
                        error: failure.message,
                        handshake_ms: ms(failure.duration),
                        ..Default::default()
                    },
                }
            })
            .collect();
        CatalogPrepareReply {
            pins,
            error: None,
            follow_up: false,
            duration_ms: ms(started.elapsed()),
        }
    }

    /// The one transaction of a preparation. `None` if the session exists.
    #[allow(clippy::too_many_arguments)]
    async fn write_preparation(
        &self,
        tenant: &str,
        session_id: &str,
        servers: &[ConfiguredServer],
        outcomes: &[Outcome],
        started: Instant,
        lookup: Duration,
        discovery: Duration,
        write_started: Instant,
    ) -> Result<Option<Vec<store::StoredEvent>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        if !store::insert_session(&mut tx, tenant, session_id).await? {
            tx.rollback().await?;
            return Ok(None);
        }
        let mut pins = Vec::new();
        let mut events = Vec::new();
        let (mut pinned, mut connected, mut failed) = (0u32, 0u32, 0u32);
        for (server, outcome) in servers.iter().zip(outcomes) {
            let transport = server.transport_kind();
            let event = |kind: &'static str, payload| NewEvent {
                kind,
                tenant: tenant.to_owned(),
                session_id: Some(session_id.to_owned()),
                server_id: Some(server.id().to_owned()),
                payload,
            };
            let (catalog, source) = match outcome {
                Outcome::Remembered(catalog) => {
                    pinned += 1;
                    events.push(event(
                        kinds::SERVER_PINNED,
                        json!({
                            "transport": transport.as_str(),
                            "catalog_hash": catalog.hash,
                            "tool_count": catalog.tools.len(),
                        }),
                    ));
                    (catalog, PinSource::Pinned)
                }
                Outcome::Connected(live) => {
                    connected += 1;
                    events.push(event(
                        kinds::SERVER_CONNECTED,
                        json!({
                            "transport": transport.as_str(),
                            "duration_ms": ms(live.duration),
                            "cause": Cause::Preparation.as_str(),
                            "catalog_hash": live.catalog.hash,
                            "tool_count": live.catalog.tools.len(),
                        }),
                    ));
                    (&live.catalog, PinSource::Connected)
                }
                Outcome::Failed(failure) => {
                    failed += 1;
                    events.push(event(
                        kinds::SERVER_CONNECT_FAILED,
                        json!({
                            "transport": transport.as_str(),
                            "duration_ms": ms(failure.duration),
                            "cause": Cause::Preparation.as_str(),
                            "error_kind": failure.kind,
                        }),
                    ));
                    continue;
                }
            };
            // Configured-server order: the Nth server's generation is written
            // after the N-1 before it, all in this transaction.
            if !self.written.contains(&server.key, &catalog.hash) {
                store::write_generation(
                    &mut tx,
                    &GenerationRef {
                        key: &server.key,
                        tenant,
                        server_id: server.id(),
                        transport,
                        catalog,
                    },
                )
                .await?;
            }
            pins.push(NewPin {
                server_id: server.id(),
                key: &server.key,
                catalog_hash: &catalog.hash,
                transport,
                source,
            });
        }
        store::insert_pins(&mut tx, tenant, session_id, &pins).await?;
        events.push(NewEvent {
            kind: kinds::SESSION_PREPARED,
            tenant: tenant.to_owned(),
            session_id: Some(session_id.to_owned()),
            server_id: None,
            payload: json!({
                "follow_up": false,
                "duration_ms": ms_precise(started.elapsed()),
                "lookup_ms": ms_precise(lookup),
                "discovery_ms": ms_precise(discovery),
                "write_ms": ms_precise(write_started.elapsed()),
                "servers": servers.len(),
                "pinned": pinned,
                "connected": connected,
                "failed": failed,
            }),
        });
        let written = store::insert_events(&mut tx, events).await?;
        tx.commit().await?;
        for (source, n) in [
            ("pinned", pinned),
            ("connected", connected),
            ("failed", failed),
        ] {
            metrics::counter!("ctxsync_catalog_pins_total", "source" => source)
                .increment(u64::from(n));
        }
        Ok(Some(written))
    }

    async fn follow_up(
        &self,
        tenant: &str,
        session_id: &str,
        started: Instant,
    ) -> CatalogPrepareReply {
        let pins = match store::load_pins(&self.pool, tenant, session_id).await {
            Ok(Some(pins)) => pins,
            Ok(None) => return internal("the session's pins vanished".to_owned()),
            Err(e) => {
                return internal(format!(
                    "cannot read the session's pins: {}",
                    ctxsync_runtime::db::describe(&e)
                ));
            }
        };
        let duration = started.elapsed();
        let event = NewEvent {
            kind: kinds::SESSION_PREPARED,
            tenant: tenant.to_owned(),
            session_id: Some(session_id.to_owned()),
            server_id: None,
            payload: json!({
                "follow_up": true,
                "duration_ms": ms_precise(duration),
                "servers": pins.len(),
            }),
        };
        match self.pool.acquire().await {
            Ok(mut conn) => match store::insert_events(&mut conn, vec![event]).await {
                Ok(written) => self.publish(&written).await,
                Err(e) => {
                    tracing::warn!(error = %ctxsync_runtime::db::describe(&e), "cannot record a follow-up preparation")
                }
            },
            Err(e) => {
                tracing::warn!(error = %ctxsync_runtime::db::describe(&e), "cannot record a follow-up preparation")
            }
        }
        CatalogPrepareReply {
            pins: pins
                .into_iter()
                .map(|pin| CatalogPin {
                    server_id: pin.server_id,
                    transport: transport_proto(&pin.transport) as i32,
                    source: match pin.source {
                        PinSource::Pinned => Source::Pinned,
                        PinSource::Connected => Source::Connected,
                    } as i32,
                    catalog_hash: pin.catalog.hash,
                    tools: pin.catalog.tools.iter().map(|t| t.to_proto()).collect(),
                    ..Default::default()
                })
                .collect(),
            error: None,
            follow_up: true,
            duration_ms: ms(started.elapsed()),
        }
    }
}

fn internal(message: String) -> CatalogPrepareReply {
    CatalogPrepareReply {
        error: error(codes::INTERNAL, message),
        ..Default::default()
    }
}
