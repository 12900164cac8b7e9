//! Preparation, the adapter: reads the configuration and the memory, asks
//! the core what to pin (`catalog_core::prepare`), discovers live what it
//! must, then writes the generations the pins need, the pins and the events
//! in ONE transaction, in configured-server order. A failure commits none
//! of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use catalog_core::events::ms;
use catalog_core::prepare::{self as core, Outcome, Plan, ServerRef, Timings};
use catalog_core::request::{Refusal, valid_preparation};
use catalog_core::{ErrorCode, Failure, Live};
use ctxsync_proto::v1::{CatalogPrepareReply, CatalogPrepareRequest};

use crate::config::{ConfiguredServer, Current};
use crate::discovery::{Cause, Discoverer};
use crate::events::Events;
use crate::mcp::transport_of;
use crate::store::{self, GenerationRef, StoredEvent};

/// The `prepare` command.
pub(crate) struct Prepare {
    config: Arc<Current>,
    discovery: Arc<Discoverer>,
    events: Arc<Events>,
    /// The handshake bound of a live discovery a user waits for.
    connect_timeout: Duration,
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
        if let Err(refusal) = valid_preparation(request) {
            return refused(&refusal);
        }
        let (tenant, session_id) = (request.tenant.as_str(), request.session_id.as_str());
        let Some(servers) = self.config.get().enabled_servers(tenant) else {
            return refused(&core::tenant_unknown(tenant));
        };
        let refs: Vec<ServerRef<'_>> = servers.iter().map(server_ref).collect();
        let memory = self.discovery.memory();
        let plan = Plan::new(
            servers
                .iter()
                .map(|s| memory.reusable(&s.key).map(|r| r.catalog)),
        );
        let lookup = started.elapsed();

        if plan.must_discover() {
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
        let outcomes = self.discover(&servers, plan).await;
        let timings = Timings {
            lookup,
            discovery: discovery_started.elapsed(),
            ..Timings::default()
        };

        let written = match self
            .write(tenant, session_id, &refs, &outcomes, started, timings)
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
            if let Some(catalog) = outcome.catalog() {
                self.events
                    .generation_committed(server.key.as_str(), &catalog.hash);
            }
        }
        self.events.publish(&written).await;
        CatalogPrepareReply {
            pins: core::reply_pins(&refs, outcomes),
            error: None,
            follow_up: false,
            duration_ms: ms(started.elapsed()),
        }
    }

    /// Discovers live, all at once, every server the plan could not pin
    /// from memory.
    async fn discover(&self, servers: &[ConfiguredServer], plan: Plan) -> Vec<Outcome> {
        let live: Vec<Result<Live, Failure>> =
            futures::future::join_all(plan.to_discover().into_iter().map(|i| {
                self.discovery
                    .discover(&servers[i], self.connect_timeout, Cause::Preparation)
            }))
            .await;
        plan.discovered(live)
    }

    /// The one transaction of a preparation. `None` if the session exists.
    async fn write(
        &self,
        tenant: &str,
        session_id: &str,
        servers: &[ServerRef<'_>],
        outcomes: &[Outcome],
        started: Instant,
        timings: Timings,
    ) -> Result<Option<Vec<StoredEvent>>, sqlx::Error> {
        let write_started = Instant::now();
        let mut tx = self.events.pool().begin().await?;
        if !store::insert_session(&mut tx, tenant, session_id).await? {
            tx.rollback().await?;
            return Ok(None);
        }
        let core::Writes {
            pins,
            mut events,
            counts,
        } = core::writes(tenant, session_id, servers, outcomes);
        // Configured-server order: the Nth pin's generation is written after
        // the N-1 before it, all in this transaction.
        for pin in &pins {
            self.events
                .write_generation(
                    &mut tx,
                    &GenerationRef {
                        key: pin.key,
                        tenant,
                        server_id: pin.server_id,
                        transport: pin.transport,
                        catalog: pin.catalog,
                    },
                )
                .await?;
        }
        store::insert_pins(&mut tx, tenant, session_id, &pins).await?;
        events.push(core::prepared_event(
            tenant,
            session_id,
            servers.len(),
            counts,
            Timings {
                total: started.elapsed(),
                write: write_started.elapsed(),
                ..timings
            },
        ));
        let written = store::insert_events(&mut tx, events).await?;
        tx.commit().await?;
        for (source, n) in [
            ("pinned", counts.pinned),
            ("connected", counts.connected),
            ("failed", counts.failed),
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
        let event = core::follow_up_event(tenant, session_id, pins.len(), started.elapsed());
        self.events.queue(vec![event]);
        CatalogPrepareReply {
            pins: pins.iter().map(|pin| pin.to_proto()).collect(),
            error: None,
            follow_up: true,
            duration_ms: ms(started.elapsed()),
        }
    }
}

/// What the core needs of a configured server.
fn server_ref(server: &ConfiguredServer) -> ServerRef<'_> {
    ServerRef {
        id: server.id(),
        key: server.key.as_str(),
        transport: transport_of(server.transport_kind()),
    }
}

fn refused(refusal: &Refusal) -> CatalogPrepareReply {
    CatalogPrepareReply {
        error: Some(refusal.to_proto()),
        ..Default::default()
    }
}

fn internal(message: String) -> CatalogPrepareReply {
    refused(&Refusal::new(ErrorCode::Internal, message))
}
