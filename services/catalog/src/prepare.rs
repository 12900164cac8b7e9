//! Preparation: pin every enabled server of the tenant for a session, from
//! memory without starting it where the rules allow, else live; then write
//! the generations it needs, the pins and the events in ONE transaction, in
//! configured-server order. A failure commits none of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ctxsync_mcp::TransportKind;
use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{CatalogPin, CatalogPrepareReply, CatalogPrepareRequest, McpTransport};
use serde_json::json;

use crate::config::{ConfiguredServer, Current};
use crate::discovery::{Cause, Discoverer, Live};
use crate::events::{Events, ms, ms_precise};
use crate::mcp::Failure;
use crate::request::{codes, error, valid_request_id};
use crate::store::{self, GenerationRef, NewEvent, NewPin, PinSource, StoredEvent, kinds};
use crate::tools::Catalog;

/// The `prepare` command.
pub(crate) struct Prepare {
    config: Arc<Current>,
    discovery: Arc<Discoverer>,
    events: Arc<Events>,
    /// The handshake bound of a live discovery a user waits for.
    connect_timeout: Duration,
}

/// How one server is pinned.
enum Outcome {
    Remembered(Arc<Catalog>),
    Connected(Live),
    Failed(Failure),
}

/// The phases of a first preparation, for its `catalog.session.prepared` event.
struct Timings {
    started: Instant,
    lookup: Duration,
    discovery: Duration,
}

impl Prepare {
    pub fn new(
        config: Arc<Current>,
        discovery: Arc<Discoverer>,
        events: Arc<Events>,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            config,
            discovery,
            events,
            connect_timeout,
        }
    }

    pub async fn handle(&self, request: CatalogPrepareRequest) -> CatalogPrepareReply {
        let started = Instant::now();
        let reply = self.prepare(&request, started).await;
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

    async fn prepare(
        &self,
        request: &CatalogPrepareRequest,
        started: Instant,
    ) -> CatalogPrepareReply {
        let tenant = request.tenant.as_str();
        let session_id = request.session_id.as_str();
        if let Err(message) = valid_request_id("tenant", tenant)
            .and_then(|()| valid_request_id("session_id", session_id))
        {
            return reply_error(codes::REQUEST_INVALID, message);
        }
        let Some(servers) = self.config.get().enabled_servers(tenant) else {
            return reply_error(
                codes::TENANT_UNKNOWN,
                format!("tenant {tenant:?} is not configured"),
            );
        };
        let remembered = self.remembered(&servers);
        let lookup = started.elapsed();

        // A session is prepared once; asking again answers its stored pins.
        // Checked up front only when a server would be started: otherwise the
        // write itself finds the session (one round trip fewer for new chats).
        if remembered.iter().any(Option::is_none) {
            match store::load_pins(self.events.pool(), tenant, session_id).await {
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
        let outcomes = self.discover_the_rest(&servers, remembered).await;
        let timings = Timings {
            started,
            lookup,
            discovery: discovery_started.elapsed(),
        };

        let written = match self
            .write(tenant, session_id, &servers, &outcomes, &timings)
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
                self.events.generation_committed(&server.key, &c.hash);
            }
        }
        self.events.publish(&written).await;
        CatalogPrepareReply {
            pins: servers.iter().zip(outcomes).map(pin_of).collect(),
            error: None,
            follow_up: false,
            duration_ms: ms(started.elapsed()),
        }
    }

    /// Each server's memory entry, where the rules allow pinning it without a start.
    fn remembered(&self, servers: &[ConfiguredServer]) -> Vec<Option<Outcome>> {
        servers
            .iter()
            .map(|s| {
                self.discovery
                    .memory()
                    .reusable(&s.key)
                    .map(|r| Outcome::Remembered(r.catalog))
            })
            .collect()
    }

    /// Discovers live, all at once, every server the memory could not pin.
    async fn discover_the_rest(
        &self,
        servers: &[ConfiguredServer],
        mut outcomes: Vec<Option<Outcome>>,
    ) -> Vec<Outcome> {
        let live = futures::future::join_all(
            servers
                .iter()
                .zip(&outcomes)
                .filter(|(_, outcome)| outcome.is_none())
                .map(|(server, _)| {
                    self.discovery
                        .discover(server, self.connect_timeout, Cause::Preparation)
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
        outcomes.into_iter().map(|o| o.expect("filled")).collect()
    }

    /// The one transaction of a preparation. `None` if the session exists.
    async fn write(
        &self,
        tenant: &str,
        session_id: &str,
        servers: &[ConfiguredServer],
        outcomes: &[Outcome],
        timings: &Timings,
    ) -> Result<Option<Vec<StoredEvent>>, sqlx::Error> {
        let write_started = Instant::now();
        let mut tx = self.events.pool().begin().await?;
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
                            "prompt_count": catalog.prompts.len(),
                            "resource_count": catalog.resources.len(),
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
                            "prompt_count": live.catalog.prompts.len(),
                            "resource_count": live.catalog.resources.len(),
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
            self.events
                .write_generation(
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
                "duration_ms": ms_precise(timings.started.elapsed()),
                "lookup_ms": ms_precise(timings.lookup),
                "discovery_ms": ms_precise(timings.discovery),
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
        let pins = match store::load_pins(self.events.pool(), tenant, session_id).await {
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
        if let Err(e) = self.events.record(vec![event]).await {
            tracing::warn!(error = %ctxsync_runtime::db::describe(&e), "cannot record a follow-up preparation");
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
                    ..pin.catalog.to_pin()
                })
                .collect(),
            error: None,
            follow_up: true,
            duration_ms: ms(started.elapsed()),
        }
    }
}

/// The pin a first preparation answers for `server`.
fn pin_of((server, outcome): (&ConfiguredServer, Outcome)) -> CatalogPin {
    let transport = server.transport_kind().to_proto() as i32;
    match outcome {
        Outcome::Remembered(catalog) => CatalogPin {
            server_id: server.id().to_owned(),
            transport,
            source: Source::Pinned as i32,
            ..catalog.to_pin()
        },
        Outcome::Connected(live) => CatalogPin {
            server_id: server.id().to_owned(),
            transport,
            source: Source::Connected as i32,
            handshake_ms: ms(live.duration),
            ..live.catalog.to_pin()
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
}

/// A stored pin's transport, as stored (`stdio`, `streamable_http`).
fn transport_proto(text: &str) -> McpTransport {
    TransportKind::from_name(text).map_or(McpTransport::Unspecified, TransportKind::to_proto)
}

fn reply_error(code: &str, message: impl Into<String>) -> CatalogPrepareReply {
    CatalogPrepareReply {
        error: error(code, message),
        ..Default::default()
    }
}

fn internal(message: String) -> CatalogPrepareReply {
    reply_error(codes::INTERNAL, message)
}
