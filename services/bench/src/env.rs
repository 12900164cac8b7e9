//! The bench's world: NATS and Postgres (given, found or private; a private
//! three-node cluster in deployed mode), a fresh database and subject prefix,
//! the services configured by the stack builder (`ctxsync-stack`) and run in
//! this process as `ctxsync up` runs them, or as processes, two replicas each
//! ([`Services`]), and the calls a chat or an agent makes.

use std::path::PathBuf;
use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, PushContextStateRequest, StartupRequest, TurnReply, TurnRequest,
};
use ctxsync_runtime::store::StoreClient;
use ctxsync_runtime::{Shutdown, rpc};
use ctxsync_stack::StackBuilder;
use ctxsync_stack::deps::{self, ClusterDependency, Dependency};
use futures::StreamExt;
use rand::RngCore;
use sqlx::PgPool;

use crate::services::{Deployed, REPLICAS, Services};
use crate::steps::Mode;
use crate::steps::{BenchArgs, BenchError, Step};

/// Bound of one call the bench makes to a service (waits included).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The tenant of every agent the bench registers.
pub const BENCH_TENANT: &str = "bench";

/// Where the bench ran, for the report.
#[derive(Debug, Clone)]
pub struct Environment {
    pub build: &'static str,
    pub cores: usize,
    pub nats: String,
    pub postgres: String,
    pub subject_prefix: String,
    pub database: String,
    pub services: String,
}

/// A registered agent and its token.
#[derive(Debug, Clone)]
pub struct BenchAgent {
    pub id: String,
    pub token: String,
}

pub struct Env {
    pub subjects: Subjects,
    pub nats_url: String,
    pub database_url: String,
    /// The chats' and agents' side of NATS (the services have their own connections).
    pub client: async_nats::Client,
    /// For the raw Postgres floor.
    pub pool: PgPool,
    /// snapshot-store, agent-ingest and chat-gate.
    pub services: Services,
    /// Every agent-ingest replica's listener.
    pub ingest_addrs: Vec<std::net::SocketAddr>,
    admin_url: String,
    database: String,
    shutdown: Shutdown,
    nats_dep: NatsDependency,
    postgres_dep: Dependency,
    data_dir: PathBuf,
}

/// The NATS the bench runs on: one server (given, found or private) or a
/// private three-node cluster.
enum NatsDependency {
    One(Dependency),
    Cluster(ClusterDependency),
}

impl NatsDependency {
    fn url(&self) -> String {
        match self {
            Self::One(dep) => dep.url.clone(),
            Self::Cluster(cluster) => cluster.url_list(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::One(dep) => format!(
                "{} ({})",
                ctxsync_runtime::config::redact_nats_urls(&dep.url),
                dep.origin
            ),
            Self::Cluster(cluster) => format!(
                "{} ({} nodes, {})",
                cluster.url_list(),
                ClusterDependency::SIZE,
                cluster.origin()
            ),
        }
    }
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl Env {
    /// The private cluster the bench runs on (deployed mode), if any.
    pub fn cluster(&self) -> Option<&ClusterDependency> {
        match &self.nats_dep {
            NatsDependency::Cluster(cluster) => Some(cluster),
            NatsDependency::One(_) => None,
        }
    }

    pub async fn start(args: &BenchArgs) -> Result<Self, BenchError> {
        let suffix = random_hex(4);
        let data_dir = std::env::temp_dir().join(format!("ctxsync-bench-{suffix}"));
        // Deployed on a cluster of its own unless NATS is given.
        let nats_dep = match (args.mode, args.nats_url.as_deref()) {
            (Mode::Deployed, None) => {
                NatsDependency::Cluster(deps::nats_cluster(&data_dir).await.step("nats cluster")?)
            }
            (_, given) => NatsDependency::One(deps::nats(given, &data_dir).await.step("nats")?),
        };
        let postgres_dep = deps::postgres(args.database_url.as_deref(), &data_dir)
            .await
            .step("postgres")?;
        let admin_url = postgres_dep.url.clone();
        let database = format!("ctxsync_bench_{suffix}");
        deps::admin_execute(&admin_url, format!("CREATE DATABASE {database}"))
            .await
            .map_err(|e| {
                BenchError::new(
                    format!(
                        "cannot create the bench database at {} (DATABASE_URL)",
                        ctxsync_runtime::nats::redact_url(&admin_url)
                    ),
                    e,
                )
            })?;
        let database_url = deps::with_database(&admin_url, &database);
        let prefix = format!("bench{suffix}");
        let shutdown = Shutdown::new();
        let started = Box::pin(Self::start_services(
            args.mode,
            &nats_dep.url(),
            &prefix,
            &database_url,
            &shutdown,
            &data_dir,
        ))
        .await;
        let (subjects, services, client, pool) = match started {
            Ok(services) => services,
            Err(error) => {
                // Nothing of the bench may stay behind.
                shutdown.cancel();
                let _ = deps::admin_execute(
                    &admin_url,
                    format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"),
                )
                .await;
                drop((nats_dep, postgres_dep));
                let _ = std::fs::remove_dir_all(&data_dir);
                return Err(error);
            }
        };
        let ingest_addrs = services.ingest_addrs();
        Ok(Self {
            subjects,
            nats_url: nats_dep.url(),
            database_url,
            client,
            pool,
            services,
            ingest_addrs,
            admin_url,
            database,
            shutdown,
            nats_dep,
            postgres_dep,
            data_dir,
        })
    }

    /// The store (which applies its migrations to the bench database),
    /// agent-ingest and chat-gate, through the stack builder (in this
    /// process, or `REPLICAS` processes of each); the bench's own NATS client
    /// and Postgres pool.
    async fn start_services(
        mode: Mode,
        nats_url: &str,
        prefix: &str,
        database_url: &str,
        shutdown: &Shutdown,
        data_dir: &std::path::Path,
    ) -> Result<(Subjects, Services, async_nats::Client, PgPool), BenchError> {
        let subjects = Subjects::new(prefix).step("subject prefix")?;
        let replicas = match mode {
            Mode::Single => 1,
            Mode::Deployed => REPLICAS,
        };
        let mut builder = StackBuilder::new(nats_url, prefix).database(database_url);
        for _ in 0..replicas {
            builder = builder.store(|_| {});
        }
        for _ in 0..replicas {
            builder = builder.ingest(|_| {});
        }
        for _ in 0..replicas {
            builder = builder.gate(|gate| {
                // Waits end on the commit, never on a deadline, however long 10,000 chats take to line up.
                gate.pending_timeout = CALL_TIMEOUT;
                gate.stale_grace = CALL_TIMEOUT;
                gate.sweep_interval = Duration::ZERO;
                // No catalog runs here: the bench measures the gate's own path.
                gate.catalog = false;
                // The processes' logs: warnings only, like the bench's own.
                gate.common.log_filter = "warn".into();
            });
        }
        let services = match mode {
            Mode::Single => Services::InProcess(builder.start(shutdown).await.step("services")?),
            Mode::Deployed => {
                let builder = builder
                    .binary_env(ctxsync_stack::Service::Store, "CTXSYNC_LOG", "warn")
                    .binary_env(ctxsync_stack::Service::Ingest, "CTXSYNC_LOG", "warn");
                Services::Deployed(Deployed::spawn(&builder, &data_dir.join("logs")).await?)
            }
        };
        let client = ctxsync_runtime::nats::connect(nats_url, "ctxsync-bench")
            .await
            .step("nats")?
            .client;
        // The services' pool settings: the raw floors pay no check the
        // services skip.
        let pool = ctxsync_runtime::db::pool_options()
            .max_connections(9)
            .connect(database_url)
            .await
            .step("postgres (bench pool)")?;
        Ok((subjects, services, client, pool))
    }

    pub fn describe(&self) -> Environment {
        Environment {
            build: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            nats: self.nats_dep.describe(),
            postgres: format!(
                "{} ({})",
                ctxsync_runtime::nats::redact_url(&self.postgres_dep.url),
                self.postgres_dep.origin
            ),
            subject_prefix: self.subjects.prefix().to_owned(),
            database: self.database.clone(),
            services: self.services.describe(),
        }
    }

    /// A builder on the bench's NATS, prefix and database, for a service
    /// started later (the catalog section's).
    pub fn builder(&self) -> StackBuilder {
        StackBuilder::new(self.nats_url.clone(), self.subjects.prefix())
            .database(self.database_url.clone())
    }

    /// Where deployed processes log (and the catalog's config file lives).
    pub fn log_dir(&self) -> PathBuf {
        self.data_dir.join("logs")
    }

    pub fn child_shutdown(&self) -> Shutdown {
        self.shutdown.child_token()
    }

    /// Stops the services, drops the bench database, removes private data.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.pool.close().await;
        self.services.stop(Duration::from_secs(45)).await;
        if let Err(error) = deps::admin_execute(
            &self.admin_url,
            format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.database),
        )
        .await
        {
            eprintln!(
                "[bench] cannot drop the bench database {}: {error}",
                self.database
            );
        }
        drop(self.nats_dep);
        drop(self.postgres_dep);
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }

    /// Registers `n` agents (tenant `bench`, names `<name>-<i>`) through snapshot-store.
    pub async fn register_agents(
        &self,
        name: &str,
        n: usize,
    ) -> Result<Vec<BenchAgent>, BenchError> {
        let results: Vec<_> = futures::stream::iter(0..n)
            .map(|i| async move {
                ctxsync_cli::agent::register(
                    &self.client,
                    &self.subjects,
                    CALL_TIMEOUT,
                    BENCH_TENANT,
                    "bench",
                    &format!("{name}-{i}"),
                )
                .await
            })
            .buffered(16)
            .collect()
            .await;
        results
            .into_iter()
            .map(|r| {
                r.map(|registered| BenchAgent {
                    id: registered.agent_id,
                    token: registered.token,
                })
                .step("register agent")
            })
            .collect()
    }

    /// snapshot-store's client on the chats' and agents' connection.
    pub fn store(&self) -> StoreClient {
        StoreClient::new(self.client.clone(), &self.subjects, CALL_TIMEOUT)
    }

    /// UpdateStartup with a new run id, straight to snapshot-store.
    pub async fn startup(&self, agent_id: &str, run_id: &str) -> Result<(), BenchError> {
        let startup = StartupRequest {
            agent_run_id: run_id.to_owned(),
            agent_version: "bench".into(),
            ..Default::default()
        };
        self.store()
            .update_startup(agent_id, startup, None)
            .await
            .step("startup")?;
        Ok(())
    }

    /// A push straight to snapshot-store; an unaccepted push is an error.
    pub async fn push(
        &self,
        agent_id: &str,
        push: PushContextStateRequest,
    ) -> Result<(), BenchError> {
        let response = self.store().push(agent_id, push, None).await.step("push")?;
        if !response.accepted {
            return Err(BenchError::new("push", response.message));
        }
        Ok(())
    }

    /// The agent's state as snapshot-store's read API returns it.
    pub async fn read(&self, agent_id: &str) -> Result<AgentState, BenchError> {
        self.store()
            .agent_state(agent_id)
            .await
            .step("read agent state")
    }

    /// A chat's first turn over NATS `gate.turn`.
    pub async fn first_turn(&self, chat_id: String, agent_id: String) -> Result<TurnReply, String> {
        rpc::request(
            &self.client,
            self.subjects.gate_turn(BENCH_TENANT),
            &TurnRequest {
                chat_id,
                agent_id,
                first_turn: true,
                tenant: BENCH_TENANT.into(),
            },
            None,
            CALL_TIMEOUT,
        )
        .await
        .map_err(|e| e.to_string())
    }
}

/// A fresh run id.
pub fn run_id() -> String {
    format!("bench-{}", random_hex(8))
}
