//! Service plumbing: connect, migrate, subscribe, listen, then warm up.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ctxsync_proto::rpc::{Reply, Rpc, catalog};
use ctxsync_proto::subjects::{CATALOG_QUEUE_GROUP, Subjects};
use ctxsync_proto::v1::{
    CatalogCallRequest, CatalogEndSessionRequest, CatalogPrepareRequest, CatalogStatusRequest,
};
use ctxsync_runtime::tenant_keys::{self, TenantKeys};
use ctxsync_runtime::{HttpServer, Readiness, Shutdown, db, http, nats, rpc};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::bucket::{Bucket, BucketSettings};
use crate::call::Call;
use crate::config::{CatalogConfig, Current};
use crate::discovery::Discoverer;
use crate::end_session::EndSession;
use crate::endpoint::{Commands, Endpoint};
use crate::events::{EventWriter, Events};
use crate::memory::Memory;
use crate::prepare::Prepare;
use crate::request::tenant_of;
use crate::sessions::{self, Sessions};
use crate::settings::{Config, mcp_sessions_bucket_name, memory_bucket_name};
use crate::shared::SharedServers;
use crate::status::Status;
use crate::store;
use crate::warmup::{Warmup, WarmupStatus};
use catalog_core::ErrorCode;
use catalog_core::request::Refusal;

/// How long a tenant key's check by the store may take.
const KEY_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ctxsync_runtime::config::ConfigError),
    #[error(transparent)]
    Db(#[from] db::DbError),
    #[error("cannot apply the catalog schema migrations: {}", db::describe_migrate(.0))]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error(transparent)]
    Nats(#[from] nats::NatsConnectError),
    #[error(transparent)]
    Subscribe(#[from] nats::SubscribeError),
    #[error(transparent)]
    Bind(#[from] http::BindError),
    #[error(transparent)]
    Settings(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Names(#[from] ReloadError),
}

/// A warm-up claim outlives its attempt's handshake bound by this much
/// before it lapses (a dead replica's claim included).
const CLAIM_MARGIN: Duration = Duration::from_secs(30);

/// A reply NATS would refuse to carry becomes an error naming the limit
/// (`catalog.reply_too_large`).
fn fit_reply<R: Reply>(client: &async_nats::Client, reply: R) -> R {
    let max = client.server_info().max_payload;
    let size = reply.encoded_len();
    if max > 0 && size > max {
        metrics::counter!("ctxsync_catalog_replies_too_large_total").increment(1);
        R::failed(
            Refusal::new(
                ErrorCode::ReplyTooLarge,
                format!(
                    "the answer is {size} bytes, over the NATS server's max_payload of {max} bytes"
                ),
            )
            .to_proto(),
        )
    } else {
        reply
    }
}

/// Serves the catalog call `M` on its subject of every tenant: a request
/// whose body names another tenant than its subject is refused
/// (`request.invalid`) without reaching `handle`.
fn serve_command<'a, M, F, Fut>(
    call: M,
    connection: &'a nats::NatsConnection,
    subjects: &Subjects,
    shutdown: &Shutdown,
    grace: Duration,
    tenant: fn(&mut M::Request) -> &mut String,
    handle: F,
) -> impl Future<Output = Result<rpc::Server, nats::SubscribeError>> + use<'a, M, F, Fut>
where
    M: Rpc,
    F: Fn(M::Request) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = M::Reply> + Send + 'static,
{
    let own_subjects = subjects.clone();
    rpc::serve_rpc(
        call,
        connection,
        subjects,
        CATALOG_QUEUE_GROUP,
        shutdown.clone(),
        grace,
        move |mut request: M::Request, incoming: rpc::Incoming| {
            let answer = tenant_of(tenant(&mut request), &own_subjects, &incoming)
                .map(|()| handle(request))
                .map_err(|message| Refusal::invalid(message).to_proto());
            async move {
                match answer {
                    Ok(answer) => Ok(answer.await),
                    Err(refused) => Err(refused),
                }
            }
        },
    )
}

/// Replaces a running catalog's server configuration.
#[derive(Clone)]
pub struct Reloader {
    config: Arc<Current>,
    discovery: Arc<Discoverer>,
}

/// A configuration the running catalog refused; the one in force stays.
#[derive(Debug, thiserror::Error)]
#[error("catalog config refused: {}", .collisions.join("; "))]
pub struct ReloadError {
    /// Each name two servers would offer, naming both.
    pub collisions: Vec<String>,
}

impl Reloader {
    /// Replaces the configuration unless, with the names the memory knows,
    /// two servers of a tenant would offer one name.
    pub fn reload(&self, servers: CatalogConfig) -> Result<(), ReloadError> {
        refuse_collisions(&servers, &self.discovery)?;
        let count = servers.all_enabled_servers().len();
        self.config.replace(servers);
        tracing::info!(servers = count, "catalog config reloaded");
        Ok(())
    }
}

/// The configuration's name collisions given what the memory knows of each
/// server's tools and prompts.
fn refuse_collisions(config: &CatalogConfig, discovery: &Discoverer) -> Result<(), ReloadError> {
    let memory = discovery.memory();
    let collisions = config.collisions(|key| memory.reusable(key).map(|d| d.catalog));
    if collisions.is_empty() {
        Ok(())
    } else {
        metrics::counter!("ctxsync_catalog_name_collisions_total", "found" => "config")
            .increment(collisions.len() as u64);
        Err(ReloadError { collisions })
    }
}

/// A running catalog.
pub struct Running {
    http: HttpServer,
    servers: Vec<rpc::Server>,
    tasks: Vec<JoinHandle<()>>,
    nats: nats::NatsConnection,
    config: Arc<Current>,
    discovery: Arc<Discoverer>,
    sessions: Arc<Sessions>,
    ready_at: SystemTime,
    warmup: watch::Receiver<WarmupStatus>,
    grace: Duration,
    events: Arc<Events>,
    event_writer: EventWriter,
    shared: Arc<SharedServers>,
    processes: Option<Arc<crate::processes::ProcessBound>>,
    endpoint: Arc<Endpoint>,
    /// Stops the shared processes after the sessions let go of them.
    shared_reaper: Option<JoinHandle<()>>,
}

impl Running {
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http.local_addr()
    }

    /// When the HTTP port was bound and every subscription was up; the
    /// warm-up starts after this.
    pub fn ready_at(&self) -> SystemTime {
        self.ready_at
    }

    /// The warm-up's progress.
    pub fn warmup(&self) -> watch::Receiver<WarmupStatus> {
        self.warmup.clone()
    }

    /// Servers remembered in the discovery memory.
    pub fn remembered(&self) -> usize {
        self.discovery.memory().len()
    }

    /// Whether the next preparation would pin `tenant`'s `server`, as
    /// configured now, from memory (without starting it).
    pub fn remembers(&self, tenant: &str, server: &str) -> bool {
        self.config
            .get()
            .enabled_server(tenant, server)
            .is_some_and(|s| self.discovery.memory().reusable(&s.key).is_some())
    }

    /// Replaces the server configuration (e.g. on SIGHUP). Sessions keep
    /// their pins; a changed server is a different memory entry, and entries
    /// of the old configuration stay (a change back finds them again).
    pub fn reload(&self, servers: CatalogConfig) -> Result<(), ReloadError> {
        self.reloader().reload(servers)
    }

    /// A handle that reloads the configuration while `join` runs.
    pub fn reloader(&self) -> Reloader {
        Reloader {
            config: self.config.clone(),
            discovery: self.discovery.clone(),
        }
    }

    /// Transports open for sessions.
    pub fn open_transports(&self) -> usize {
        self.sessions.open_transports()
    }

    /// Server processes holding a place under `--max-server-processes`
    /// (under the tenants' bound without it; 0 without either).
    pub fn bounded_processes(&self) -> usize {
        self.processes.as_ref().map_or(0, |bound| bound.in_use())
    }

    /// `tenant`'s server processes holding a place under
    /// `--max-server-processes-per-tenant` (0 without it).
    pub fn tenant_processes(&self, tenant: &str) -> usize {
        self.processes
            .as_ref()
            .map_or(0, |bound| bound.in_use_by(tenant))
    }

    /// MCP sessions open now on the endpoint.
    pub fn mcp_sessions(&self) -> usize {
        self.endpoint.open_sessions()
    }

    /// Shared server processes running now.
    pub fn shared_processes(&self) -> usize {
        self.shared.running()
    }

    /// Waits until every event queued so far (calls, follow-up
    /// preparations, warm-ups: written in the background) is written.
    pub async fn events_written(&self) -> bool {
        self.events.flushed().await
    }

    /// Waits for shutdown: stops taking requests, finishes those in flight,
    /// closes every transport, drains NATS.
    pub async fn join(self) {
        for server in self.servers {
            server.join().await;
        }
        for task in self.tasks {
            let _ = task.await;
        }
        let released = self.sessions.release_all().await;
        tracing::info!(released, "session transports closed");
        if let Some(reaper) = self.shared_reaper {
            let _ = reaper.await;
        }
        // Nothing queues events any more: what is queued is written now.
        self.event_writer.finish().await;
        if !self.discovery.closed_within(self.grace).await {
            tracing::warn!("servers still closing after the shutdown grace are killed");
        }
        nats::drain(&self.nats, self.grace).await;
        self.http.join().await;
    }
}

pub async fn start(config: Config, shutdown: Shutdown) -> Result<Running, Error> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init("catalog", env!("CARGO_PKG_VERSION"), crate::series::SERIES);
    let started = SystemTime::now();
    let subjects = config.common.subjects()?;
    let http_limits = config.common.http.limits()?;
    let pool = db::connect(&config.database).await?;
    store::migrate(&pool).await?;
    let connection = nats::connect(&config.common, "catalog").await?;
    let grace = config.common.shutdown_grace;
    let settings = config.settings;
    let current = Arc::new(Current::new(config.servers));
    // The shared memory is loaded before any subscription: a restarted
    // replica's first preparation pins from it.
    settings.memory.validate()?;
    let memory_key = settings.memory.key.clone().unwrap_or_else(|| {
        tracing::warn!(
            "no CTXSYNC_CATALOG_MEMORY_KEY_FILE (--memory-key-file): this replica seals its memory entries with a key of its own, \
             so it uses no other replica's entries; give every replica the same key file to share the memory"
        );
        crate::bucket::MemoryKey::random()
    });
    let memory_bucket = settings
        .memory
        .bucket
        .clone()
        .unwrap_or_else(|| memory_bucket_name(subjects.prefix()));
    let memory_key_for_sessions = memory_key.clone();
    let bucket = Bucket::new(
        connection.client.clone(),
        BucketSettings {
            name: memory_bucket.clone(),
            replicas: settings.memory.replicas,
            max_age: settings.memory.max_age,
            claim_ttl: settings.warmup.connect_timeout + CLAIM_MARGIN,
            key: memory_key,
            max_entries: settings.memory.max_entries,
            max_bytes: settings.memory.max_bytes,
        },
    );
    let memory = Memory::shared(
        settings.discovery_reuse,
        crate::memory::Bounds {
            max_entries: settings.memory.max_entries,
            max_bytes: settings.memory.max_bytes,
        },
        bucket,
    );
    let sharing = memory.start_sharing(shutdown.clone()).await;
    tracing::info!(remembered = memory.len(), "catalog memory loaded");
    let discovery = Arc::new(Discoverer::new(memory, settings.max_concurrent_starts));
    // Names collide only where the memory knows both servers' items.
    refuse_collisions(&current.get(), &discovery)?;
    let (events, queued_events) = Events::new(
        pool.clone(),
        connection.client.clone(),
        subjects.clone(),
        settings.event_queue,
    );
    let event_writer = EventWriter::spawn(
        queued_events,
        settings.event_batch_wait,
        shutdown.clone(),
        grace,
    );
    let sessions = Arc::new(Sessions::default());
    let prepare = Arc::new(Prepare::new(
        current.clone(),
        discovery.clone(),
        events.clone(),
        settings.connect_timeout,
    ));
    let shared = Arc::new(SharedServers::new(settings.shared_idle_timeout));
    let processes = (settings.max_server_processes.is_some()
        || settings.max_server_processes_per_tenant.is_some())
    .then(|| {
        Arc::new(crate::processes::ProcessBound::new(
            settings.max_server_processes,
            settings.max_server_processes_per_tenant,
        ))
    });
    let call = Arc::new(Call::new(
        current.clone(),
        sessions.clone(),
        discovery.clone(),
        events.clone(),
        settings.connect_timeout,
        processes.clone(),
        shared.clone(),
    ));
    let keys = TenantKeys::new(
        connection.client.clone(),
        &subjects,
        KEY_CHECK_TIMEOUT,
        "ctxsync_catalog_auth_total",
    );
    let endpoint = Arc::new(Endpoint::new(
        Commands {
            prepare: prepare.clone(),
            call: call.clone(),
            sessions: sessions.clone(),
            pool: pool.clone(),
        },
        keys.clone(),
        settings.mcp_page_size,
        settings.mcp_rate_limit,
        settings.mcp_sessions,
        Some(crate::endpoint::StoredSettings {
            client: connection.client.clone(),
            bucket: mcp_sessions_bucket_name(&memory_bucket),
            replicas: settings.memory.replicas,
            seal: memory_key_for_sessions,
        }),
        shutdown.clone(),
    ));
    let end_session = Arc::new(EndSession::new(sessions.clone()));
    let (warmup_tx, warmup) = watch::channel(WarmupStatus::default());
    let status = Arc::new(Status::new(
        current.clone(),
        discovery.clone(),
        warmup.clone(),
        pool.clone(),
    ));

    let client = connection.client.clone();
    let status_client = client.clone();
    let servers = vec![
        serve_command(
            catalog::Prepare,
            &connection,
            &subjects,
            &shutdown,
            grace,
            |request: &mut CatalogPrepareRequest| &mut request.tenant,
            {
                let client = client.clone();
                move |request| {
                    let (prepare, client) = (prepare.clone(), client.clone());
                    async move { fit_reply(&client, prepare.handle(request).await) }
                }
            },
        )
        .await?,
        serve_command(
            catalog::Call,
            &connection,
            &subjects,
            &shutdown,
            grace,
            |request: &mut CatalogCallRequest| &mut request.tenant,
            move |request| {
                let (call, client) = (call.clone(), client.clone());
                async move { fit_reply(&client, call.handle(request).await) }
            },
        )
        .await?,
        serve_command(
            catalog::EndSession,
            &connection,
            &subjects,
            &shutdown,
            grace,
            |request: &mut CatalogEndSessionRequest| &mut request.tenant,
            move |request| {
                let end_session = end_session.clone();
                async move { end_session.handle(request).await }
            },
        )
        .await?,
        serve_command(
            catalog::Status,
            &connection,
            &subjects,
            &shutdown,
            grace,
            |request: &mut CatalogStatusRequest| &mut request.tenant,
            move |request| {
                let (status, client) = (status.clone(), status_client.clone());
                async move { fit_reply(&client, status.handle(request).await) }
            },
        )
        .await?,
    ];
    // Gate waits, for the latency report: one replica stores each.
    let gate_waits = nats::subscribe(
        &connection,
        subjects.gate_turn_waited(),
        Some(CATALOG_QUEUE_GROUP),
    )
    .await?;
    let gate_waits = crate::gate_waits::spawn(
        events.clone(),
        connection.client.clone(),
        gate_waits,
        shutdown.clone(),
        grace,
    );
    // Every replica applies every revocation to its own key cache.
    let revocations = nats::subscribe(&connection, subjects.tenant_key_revoked(), None).await?;
    let follow_keys = tenant_keys::spawn_follow(keys, revocations, &connection, shutdown.clone());

    let readiness = Readiness::new().with_nats(&connection).with_postgres(&pool);
    let http = HttpServer::start(
        config.common.http_addr,
        http_limits,
        ctxsync_runtime::http::browsers::guarded(
            crate::endpoint::routes(endpoint.clone(), shutdown.child_token()),
            &settings.browsers,
        ),
        readiness,
        shutdown.clone(),
    )
    .await?;
    let ready_at = SystemTime::now();
    let ready_instant = Instant::now();
    tracing::info!(
        tenants = current.get().tenants.len(),
        servers = current.get().all_enabled_servers().len(),
        "catalog serving"
    );

    // Only now, with the port bound and the subscriptions up: no server
    // startup competes with becoming ready, and readiness never waits on one.
    let claim_ttl = settings.warmup.connect_timeout + CLAIM_MARGIN;
    let warmup_task = Warmup::new(
        current.clone(),
        discovery.clone(),
        events.clone(),
        settings.warmup,
        started,
        claim_ttl,
    )
    .spawn(shutdown.clone(), ready_instant, warmup_tx);
    let reaper = sessions::spawn_reaper(
        sessions.clone(),
        settings.session_idle_timeout,
        shutdown.clone(),
    );
    Ok(Running {
        http,
        servers,
        tasks: [warmup_task, reaper, gate_waits, follow_keys]
            .into_iter()
            .chain(sharing)
            .collect(),
        processes,
        endpoint,
        shared_reaper: Some(crate::shared::spawn_reaper(
            shared.clone(),
            shutdown.clone(),
        )),
        shared,
        nats: connection,
        config: current,
        discovery,
        sessions,
        ready_at,
        warmup,
        grace,
        events,
        event_writer,
    })
}

/// `start`, then wait for shutdown.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let running = start(config, shutdown).await?;
    running.join().await;
    Ok(())
}
