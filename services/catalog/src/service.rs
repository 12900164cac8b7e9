//! Service plumbing: connect, migrate, subscribe, listen, then warm up.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ctxsync_proto::subjects::{CATALOG_QUEUE_GROUP, Subjects};
use ctxsync_proto::v1::{
    CatalogCallReply, CatalogCallRequest, CatalogEndSessionReply, CatalogEndSessionRequest,
    CatalogError, CatalogPrepareReply, CatalogPrepareRequest,
};
use ctxsync_runtime::{HttpServer, Readiness, Shutdown, db, http, nats, rpc};
use prost::Message;
use sqlx::PgPool;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::memory::Memory;
use crate::sessions::Sessions;
use crate::store::{self, StoredEvent, WrittenGenerations};
use crate::warmup::{self, WarmupStatus};
use crate::{CatalogConfig, Config, Settings, codes};

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
}

/// State shared by the request handlers, the warm-up and the session reaper.
pub(crate) struct Core {
    servers: std::sync::RwLock<Arc<CatalogConfig>>,
    pub settings: Settings,
    pub memory: Memory,
    pub pool: PgPool,
    pub nats: async_nats::Client,
    pub subjects: Subjects,
    pub written: WrittenGenerations,
    /// Bounds stdio starts for preparations and calls (not the warm-up's).
    pub starts: Semaphore,
    pub sessions: Sessions,
    /// Servers closing after a discovery; shutdown waits for them.
    pub closing: tokio_util::task::TaskTracker,
}

impl Core {
    /// The server configuration in force now.
    pub fn config(&self) -> Arc<CatalogConfig> {
        self.servers.read().expect("config lock").clone()
    }

    /// A reply NATS would refuse to carry becomes an error naming the limit
    /// (the requester would otherwise only see a timeout).
    pub fn fit_reply<R: Message>(&self, reply: R, too_large: impl FnOnce(String) -> R) -> R {
        let max = self.nats.server_info().max_payload;
        let size = reply.encoded_len();
        if max > 0 && size > max {
            metrics::counter!("ctxsync_catalog_replies_too_large_total").increment(1);
            too_large(format!(
                "the answer is {size} bytes, over the NATS server's max_payload of {max} bytes"
            ))
        } else {
            reply
        }
    }

    /// Publishes committed events on `<prefix>.events.catalog.<kind>`; a
    /// failure is logged (the events are stored either way).
    pub async fn publish(&self, events: &[StoredEvent]) {
        for event in events {
            let subject = self.subjects.catalog_event(event.event.kind);
            let payload = event.to_proto().encode_to_vec();
            if let Err(error) = self.nats.publish(subject, payload.into()).await {
                tracing::warn!(%error, kind = event.event.kind, "cannot publish a catalog event");
            }
        }
    }
}

pub(crate) fn error(code: &str, message: impl Into<String>) -> Option<CatalogError> {
    Some(CatalogError {
        code: code.to_owned(),
        message: message.into(),
    })
}

/// Replaces a running catalog's server configuration.
#[derive(Clone)]
pub struct Reloader(Arc<Core>);

impl Reloader {
    pub fn reload(&self, servers: CatalogConfig) {
        let count = servers.all_enabled_servers().len();
        *self.0.servers.write().expect("config lock") = Arc::new(servers);
        tracing::info!(servers = count, "catalog config reloaded");
    }
}

/// A running catalog.
pub struct Running {
    http: HttpServer,
    servers: Vec<rpc::Server>,
    tasks: Vec<JoinHandle<()>>,
    nats: nats::NatsConnection,
    core: Arc<Core>,
    ready_at: SystemTime,
    warmup: watch::Receiver<WarmupStatus>,
    grace: Duration,
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
        self.core.memory.len()
    }

    /// Replaces the server configuration (e.g. on SIGHUP). Sessions keep
    /// their pins; a changed server is a different memory entry, and entries
    /// of the old configuration stay (a change back finds them again).
    pub fn reload(&self, servers: CatalogConfig) {
        self.reloader().reload(servers);
    }

    /// A handle that reloads the configuration while `join` runs.
    pub fn reloader(&self) -> Reloader {
        Reloader(self.core.clone())
    }

    /// Transports open for sessions.
    pub fn open_transports(&self) -> usize {
        self.core.sessions.open_transports()
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
        let released = self.core.sessions.release_all().await;
        tracing::info!(released, "session transports closed");
        self.core.closing.close();
        if tokio::time::timeout(self.grace, self.core.closing.wait())
            .await
            .is_err()
        {
            tracing::warn!("servers still closing after the shutdown grace are killed");
        }
        nats::drain(&self.nats, self.grace).await;
        self.http.join().await;
    }
}

pub async fn start(config: Config, shutdown: Shutdown) -> Result<Running, Error> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init("catalog", env!("CARGO_PKG_VERSION"), crate::series::SERIES);
    let subjects = config.common.subjects()?;
    let http_limits = config.common.http.limits()?;
    let pool = db::connect(&config.database).await?;
    store::migrate(&pool).await?;
    let connection = nats::connect(&config.common, "catalog").await?;
    let grace = config.common.shutdown_grace;
    let core = Arc::new(Core {
        servers: std::sync::RwLock::new(Arc::new(config.servers)),
        memory: Memory::new(config.settings.discovery_reuse),
        starts: Semaphore::new(config.settings.max_concurrent_starts.max(1)),
        settings: config.settings,
        pool: pool.clone(),
        nats: connection.client.clone(),
        subjects: subjects.clone(),
        written: WrittenGenerations::default(),
        sessions: Sessions::default(),
        closing: tokio_util::task::TaskTracker::new(),
    });

    let mut servers = Vec::new();
    let handler_core = core.clone();
    servers.push(
        rpc::serve(
            &connection,
            subjects.catalog_prepare_all(),
            CATALOG_QUEUE_GROUP,
            shutdown.clone(),
            grace,
            |message| CatalogPrepareReply {
                error: error(codes::REQUEST_INVALID, message),
                ..Default::default()
            },
            move |mut request: CatalogPrepareRequest, incoming: rpc::Incoming| {
                let core = handler_core.clone();
                let tenant = crate::tenant_of(&mut request.tenant, &incoming);
                async move {
                    if let Err(message) = tenant {
                        return CatalogPrepareReply {
                            error: error(codes::REQUEST_INVALID, message),
                            ..Default::default()
                        };
                    }
                    let reply = core.prepare(request).await;
                    core.fit_reply(reply, |message| CatalogPrepareReply {
                        error: error(codes::REPLY_TOO_LARGE, message),
                        ..Default::default()
                    })
                }
            },
        )
        .await?,
    );
    let handler_core = core.clone();
    servers.push(
        rpc::serve(
            &connection,
            subjects.catalog_call_all(),
            CATALOG_QUEUE_GROUP,
            shutdown.clone(),
            grace,
            |message| CatalogCallReply {
                error: error(codes::REQUEST_INVALID, message),
                ..Default::default()
            },
            move |mut request: CatalogCallRequest, incoming: rpc::Incoming| {
                let core = handler_core.clone();
                let tenant = crate::tenant_of(&mut request.tenant, &incoming);
                async move {
                    if let Err(message) = tenant {
                        return CatalogCallReply {
                            error: error(codes::REQUEST_INVALID, message),
                            ..Default::default()
                        };
                    }
                    let reply = core.call(request).await;
                    core.fit_reply(reply, |message| CatalogCallReply {
                        error: error(codes::REPLY_TOO_LARGE, message),
                        ..Default::default()
                    })
                }
            },
        )
        .await?,
    );
    let handler_core = core.clone();
    servers.push(
        rpc::serve(
            &connection,
            subjects.catalog_session_end_all(),
            CATALOG_QUEUE_GROUP,
            shutdown.clone(),
            grace,
            |message| CatalogEndSessionReply {
                error: error(codes::REQUEST_INVALID, message),
                ..Default::default()
            },
            move |mut request: CatalogEndSessionRequest, incoming: rpc::Incoming| {
                let core = handler_core.clone();
                let tenant = crate::tenant_of(&mut request.tenant, &incoming);
                async move {
                    match tenant {
                        Ok(()) => core.end_session(request).await,
                        Err(message) => CatalogEndSessionReply {
                            error: error(codes::REQUEST_INVALID, message),
                            ..Default::default()
                        },
                    }
                }
            },
        )
        .await?,
    );
    // Gate waits, for the latency report: one replica stores each.
    let gate_waits = nats::subscribe(
        &connection,
        subjects.gate_turn_waited(),
        Some(CATALOG_QUEUE_GROUP),
    )
    .await?;
    let gate_waits = crate::gate_waits::spawn(pool.clone(), gate_waits, shutdown.clone());

    let readiness = Readiness::new().with_nats(&connection).with_postgres(&pool);
    let http = HttpServer::start(
        config.common.http_addr,
        http_limits,
        axum::Router::new(),
        readiness,
        shutdown.clone(),
    )
    .await?;
    let ready_at = SystemTime::now();
    let ready_instant = Instant::now();
    tracing::info!(
        tenants = core.config().tenants.len(),
        servers = core.config().all_enabled_servers().len(),
        "catalog serving"
    );

    // Only now, with the port bound and the subscriptions up: no server
    // startup competes with becoming ready, and readiness never waits on one.
    let (warmup_task, warmup) = warmup::spawn(core.clone(), shutdown.clone(), ready_instant);
    let reaper = crate::sessions::spawn_reaper(core.clone(), shutdown.clone());
    Ok(Running {
        http,
        servers,
        tasks: vec![warmup_task, reaper, gate_waits],
        nats: connection,
        core,
        ready_at,
        warmup,
        grace,
    })
}

/// `start`, then wait for shutdown.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let running = start(config, shutdown).await?;
    running.join().await;
    Ok(())
}
