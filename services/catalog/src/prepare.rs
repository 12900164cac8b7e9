//! Preparation, the adapter: reads the configuration and the memory, asks
//! the core what to pin (`catalog_core::prepare`), discovers live what it
//! must, then writes the generations the pins need, the pins and the events
//! in ONE transaction, in configured-server order. A failure commits none
//! of it.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use catalog_core::events::ms;
use catalog_core::memory::Reuse;
use catalog_core::prepare::{self as core, Outcome, Plan, ServerRef, Timings};
use catalog_core::request::{Refusal, valid_preparation};
use catalog_core::{Discovery, hints};
use catalog_core::{ErrorCode, Failure, Live};
use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{CatalogPin, CatalogPrepareReply, CatalogPrepareRequest};
use sha2::Digest as _;

use crate::config::{ConfiguredServer, Current};
use crate::discovery::{Cause, Discoverer};
use crate::events::Events;
use crate::mcp::transport_of;
use crate::store::{self, GenerationRef, StoredEvent, StoredPin};

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
        let mut reply = self.prepare(&request, started).await;
        measured(&reply, started);
        if reply.error.is_none() {
            // The session is its pins' handle on the MCP endpoint too.
            reply.pin_handle.clone_from(&request.session_id);
            reply.ttl_ms = self.snapshot(&request.tenant).map_or(0, |now| {
                let pinned = pinned_hashes(&reply.pins);
                u32::try_from(now.fresh_for_pinned(&pinned).as_millis()).unwrap_or(u32::MAX)
            });
        }
        reply
    }

    /// [`Prepare::pin`], measured as any preparation.
    pub async fn handle_snapshot(
        &self,
        tenant: &str,
        session_id: &str,
        snapshot: Snapshot,
    ) -> CatalogPrepareReply {
        let started = Instant::now();
        let reply = self.pin(tenant, session_id, snapshot, started).await;
        measured(&reply, started);
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
        match self.snapshot(&request.tenant) {
            Ok(snapshot) => {
                self.pin(&request.tenant, &request.session_id, snapshot, started)
                    .await
            }
            Err(refusal) => refused(&refusal),
        }
    }

    /// Changes whenever the memory does.
    pub fn memory_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.discovery.memory().changes()
    }

    /// What the memory holds now for `tenant`'s enabled servers, read once.
    pub fn snapshot(&self, tenant: &str) -> Result<Snapshot, Refusal> {
        let servers = self
            .config
            .get()
            .enabled_servers(tenant)
            .ok_or_else(|| core::tenant_unknown(tenant))?;
        let memory = self.discovery.memory();
        let remembered = servers.iter().map(|s| memory.reusable(&s.key)).collect();
        Ok(Snapshot {
            tenant: tenant.to_owned(),
            servers,
            remembered,
            reuse: memory.reuse(),
        })
    }

    /// Prepares a session pinning exactly `snapshot` (live where it holds
    /// nothing) under `session_id`, or answers its pins if it exists.
    async fn pin(
        &self,
        tenant: &str,
        session_id: &str,
        snapshot: Snapshot,
        started: Instant,
    ) -> CatalogPrepareReply {
        let servers = snapshot.servers;
        let refs: Vec<ServerRef<'_>> = servers.iter().map(server_ref).collect();
        let plan = Plan::new(
            snapshot
                .remembered
                .into_iter()
                .map(|r| r.map(|d| d.catalog)),
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
            pins: answered(core::reply_pins(&refs, outcomes), tenant),
            error: None,
            follow_up: false,
            duration_ms: ms(started.elapsed()),
            ..Default::default()
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
    /// Generations this process does not know are written go first, in
    /// configured-server order (a pin names its generation); the session,
    /// its pins and its events then go in one statement, which is the
    /// whole transaction when every generation is known (a warm
    /// preparation: one round trip to Postgres).
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
        let core::Writes {
            pins,
            mut events,
            counts,
        } = core::writes(tenant, session_id, servers, outcomes);
        let generations: Vec<GenerationRef<'_>> = pins
            .iter()
            .map(|pin| GenerationRef {
                key: pin.key,
                tenant,
                server_id: pin.server_id,
                transport: pin.transport,
                catalog: pin.catalog,
            })
            .filter(|generation| !self.events.is_written(generation))
            .collect();
        let mut tx = None;
        if !generations.is_empty() {
            let conn = tx.insert(self.events.pool().begin().await?);
            // Filtered above: each is written (or found) once here.
            for generation in &generations {
                store::write_generation(conn, generation).await?;
            }
        }
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
        let written = match &mut tx {
            Some(conn) => store::insert_prepared(conn, tenant, session_id, &pins, events).await?,
            None => {
                let mut conn = self.events.pool().acquire().await?;
                store::insert_prepared(&mut conn, tenant, session_id, &pins, events).await?
            }
        };
        let Some(written) = written else {
            if let Some(tx) = tx {
                tx.rollback().await?;
            }
            return Ok(None);
        };
        if let Some(tx) = tx {
            tx.commit().await?;
        }
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

    /// The pins prepared under `session_id`, `None` if nothing is.
    pub async fn pins_of(
        &self,
        tenant: &str,
        session_id: &str,
    ) -> Result<Option<Vec<ctxsync_proto::v1::CatalogPin>>, String> {
        match store::load_pins(self.events.pool(), tenant, session_id).await {
            Ok(pins) => Ok(pins.map(|pins| stored(&pins))),
            Err(e) => Err(format!(
                "cannot read the session's pins: {}",
                ctxsync_runtime::db::describe(&e)
            )),
        }
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
            pins: stored(&pins),
            error: None,
            follow_up: true,
            duration_ms: ms(started.elapsed()),
            ..Default::default()
        }
    }
}

/// A tenant's enabled servers and what the memory held for each, read at
/// one moment: what a stateless list pins and names its handle after.
#[derive(Clone)]
pub(crate) struct Snapshot {
    tenant: String,
    servers: Vec<ConfiguredServer>,
    remembered: Vec<Option<Discovery>>,
    reuse: Reuse,
}

impl Snapshot {
    /// The handle of these pins when the memory holds every server (the
    /// same on every replica); `None` when one must be discovered live.
    pub fn handle(&self) -> Option<String> {
        let parts = self
            .servers
            .iter()
            .zip(&self.remembered)
            .map(|(server, remembered)| {
                remembered.as_ref().map(|d| hints::HandlePart {
                    server_id: server.id(),
                    server_key: server.key.as_str(),
                    catalog_hash: &d.catalog.hash,
                    naming: &server.naming,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let material = hints::handle_material(&self.tenant, parts);
        let digest = sha2::Sha256::digest(material.as_bytes());
        Some(format!(
            "{}{}",
            hints::PIN_HANDLE_PREFIX,
            hex::encode(digest)
        ))
    }

    /// What each server's lists are now; `None` while one must be discovered.
    pub fn lists(&self) -> Option<Vec<(String, Arc<catalog_core::tools::Catalog>)>> {
        self.servers
            .iter()
            .zip(&self.remembered)
            .map(|(server, remembered)| {
                remembered
                    .as_ref()
                    .map(|d| (server.id().to_owned(), d.catalog.clone()))
            })
            .collect()
    }

    /// How long `pinned` (server id and catalog hash, the failed left out)
    /// stays true: as long as the memory's lists when they are what it
    /// holds for every server, else not at all (the memory has newer ones,
    /// or a server none).
    pub fn fresh_for_pinned(&self, pinned: &[(String, String)]) -> Duration {
        let current = self.servers.len() == pinned.len()
            && self
                .servers
                .iter()
                .zip(&self.remembered)
                .all(|(server, remembered)| {
                    remembered.as_ref().is_some_and(|d| {
                        pinned
                            .iter()
                            .any(|(id, hash)| id == server.id() && *hash == d.catalog.hash)
                    })
                });
        if current {
            self.fresh_for()
        } else {
            Duration::ZERO
        }
    }

    /// How long a list of these pins stays true from now.
    pub fn fresh_for(&self) -> Duration {
        let now = SystemTime::now();
        hints::list_fresh_for(
            self.remembered
                .iter()
                .map(|r| r.as_ref().map(|d| hints::fresh_for(d, self.reuse, now))),
        )
    }
}

fn measured(reply: &CatalogPrepareReply, started: Instant) {
    let outcome = match (&reply.error, reply.follow_up) {
        (Some(_), _) => "error",
        (None, true) => "follow_up",
        (None, false) => "first",
    };
    metrics::counter!("ctxsync_catalog_preparations_total", "outcome" => outcome).increment(1);
    metrics::histogram!("ctxsync_catalog_preparation_seconds", "outcome" => outcome)
        .record(started.elapsed().as_secs_f64());
}

/// The server id and catalog hash of every pin that is not a failure.
pub(crate) fn pinned_hashes(pins: &[ctxsync_proto::v1::CatalogPin]) -> Vec<(String, String)> {
    use ctxsync_proto::v1::catalog_pin::Source;
    pins.iter()
        .filter(|pin| pin.source() != Source::Failed)
        .map(|pin| (pin.server_id.clone(), pin.catalog_hash.clone()))
        .collect()
}

/// What the core needs of a configured server.
/// A new preparation's pins as answered, each marked with the names it
/// loses to an earlier pin. A collision that a live discovery brought (the
/// configuration was checked against the memory's names) is logged and
/// counted; the sessions pinned before keep their pins.
fn answered(mut pins: Vec<CatalogPin>, tenant: &str) -> Vec<CatalogPin> {
    let collisions = catalog_core::naming::mark_pins(&mut pins);
    let live = |server: &str| {
        pins.iter()
            .any(|p| p.server_id == server && p.source() == Source::Connected)
    };
    for collision in collisions {
        if live(&collision.first) || live(&collision.second) {
            metrics::counter!("ctxsync_catalog_name_collisions_total", "found" => "discovery")
                .increment(1);
            tracing::warn!(%tenant, first = %collision.first, second = %collision.second, name = %collision.name, "a live discovery brought a name collision: {collision}; the first server keeps the name");
        }
    }
    pins
}

/// A stored session's pins as answered, marked like a new preparation's.
fn stored(pins: &[StoredPin]) -> Vec<CatalogPin> {
    let mut answered: Vec<CatalogPin> = pins.iter().map(StoredPin::to_proto).collect();
    catalog_core::naming::mark_pins(&mut answered);
    answered
}

fn server_ref(server: &ConfiguredServer) -> ServerRef<'_> {
    ServerRef {
        id: server.id(),
        key: server.key.as_str(),
        transport: transport_of(server.transport_kind()),
        naming: &server.naming,
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
