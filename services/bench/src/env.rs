//! The bench's world: NATS and Postgres (given, found or private), a fresh
//! database and subject prefix, the services started in this process by the
//! stack builder (`ctxsync-stack`, as `ctxsync up` starts them), and
//! the calls a chat or an agent makes.

use std::path::PathBuf;
use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, GetAgentStateReply, GetAgentStateRequest, PushContextStateRequest,
    PushContextStateResponse, StartupRequest, StorePushReply, StorePushRequest, TurnReply,
    TurnRequest, UpdateStartupReply, UpdateStartupRequest,
};
use ctxsync_runtime::{Shutdown, rpc};
use ctxsync_stack::deps::{self, Dependency};
use ctxsync_stack::{Stack, StackBuilder};
use futures::StreamExt;
use rand::RngCore;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

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
    /// snapshot-store, agent-ingest and chat-gate, started in this process.
    pub stack: Stack,
    pub ingest_addr: std::net::SocketAddr,
    admin_url: String,
    database: String,
    shutdown: Shutdown,
    nats_dep: Dependency,
    postgres_dep: Dependency,
    data_dir: PathBuf,
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl Env {
    pub async fn start(args: &BenchArgs) -> Result<Self, BenchError> {
        let suffix = random_hex(4);
        let data_dir = std::env::temp_dir().join(format!("ctxsync-bench-{suffix}"));
        let nats_dep = deps::nats(args.nats_url.as_deref(), &data_dir)
            .await
            .step("nats")?;
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
            &nats_dep.url,
            &prefix,
            &database_url,
            &shutdown,
        ))
        .await;
        let (subjects, stack, client, pool) = match started {
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
        let ingest_addr = stack.ingest().http_addr();
        Ok(Self {
            subjects,
            nats_url: nats_dep.url.clone(),
            database_url,
            client,
            pool,
            stack,
            ingest_addr,
            admin_url,
            database,
            shutdown,
            nats_dep,
            postgres_dep,
            data_dir,
        })
    }

    /// The store (which applies its migrations to the bench database),
    /// agent-ingest and chat-gate, through the stack builder; the bench's own
    /// NATS client and Postgres pool.
    async fn start_services(
        nats_url: &str,
        prefix: &str,
        database_url: &str,
        shutdown: &Shutdown,
    ) -> Result<(Subjects, Stack, async_nats::Client, PgPool), BenchError> {
        let subjects = Subjects::new(prefix).step("subject prefix")?;
        let stack = StackBuilder::new(nats_url, prefix)
            .database(database_url)
            .store(|_| {})
            .ingest(|_| {})
            .gate(|gate| {
                // Waits end on the commit, never on a deadline, however long 10,000 chats take to line up.
                gate.pending_timeout = CALL_TIMEOUT;
                gate.stale_grace = CALL_TIMEOUT;
                gate.sweep_interval = Duration::ZERO;
                // No catalog runs here: the bench measures the gate's own path.
                gate.catalog = false;
            })
            .start(shutdown)
            .await
            .step("services")?;
        let client = ctxsync_runtime::nats::connect(nats_url, "ctxsync-bench")
            .await
            .step("nats")?
            .client;
        let pool = PgPoolOptions::new()
            .max_connections(9)
            .connect(database_url)
            .await
            .step("postgres (bench pool)")?;
        Ok((subjects, stack, client, pool))
    }

    pub fn describe(&self) -> Environment {
        Environment {
            build: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            nats: format!(
                "{} ({})",
                ctxsync_runtime::nats::redact_url(&self.nats_dep.url),
                self.nats_dep.origin
            ),
            postgres: format!(
                "{} ({})",
                ctxsync_runtime::nats::redact_url(&self.postgres_dep.url),
                self.postgres_dep.origin
            ),
            subject_prefix: self.subjects.prefix().to_owned(),
            database: self.database.clone(),
        }
    }

    /// A builder on the bench's NATS, prefix and database, for a service
    /// started later (the catalog section's).
    pub fn builder(&self) -> StackBuilder {
        StackBuilder::new(self.nats_url.clone(), self.subjects.prefix())
            .database(self.database_url.clone())
    }

    pub fn child_shutdown(&self) -> Shutdown {
        self.shutdown.child_token()
    }

    /// Stops the services, drops the bench database, removes private data.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.pool.close().await;
        let _ = tokio::time::timeout(Duration::from_secs(45), self.stack.join()).await;
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

    /// UpdateStartup with a new run id, straight to snapshot-store.
    pub async fn startup(&self, agent_id: &str, run_id: &str) -> Result<(), BenchError> {
        let reply: UpdateStartupReply = rpc::request(
            &self.client,
            self.subjects.store_update_startup(),
            &UpdateStartupRequest {
                agent_id: agent_id.to_owned(),
                startup: Some(StartupRequest {
                    agent_run_id: run_id.to_owned(),
                    agent_version: "bench".into(),
                    ..Default::default()
                }),
            },
            None,
            CALL_TIMEOUT,
        )
        .await
        .step("startup")?;
        match reply.error {
            Some(error) => Err(BenchError::new("startup", error.message)),
            None => Ok(()),
        }
    }

    /// A push straight to snapshot-store; an unaccepted push is an error.
    pub async fn push(
        &self,
        agent_id: &str,
        push: PushContextStateRequest,
    ) -> Result<(), BenchError> {
        let reply: StorePushReply = rpc::request(
            &self.client,
            self.subjects.store_push(),
            &StorePushRequest {
                agent_id: agent_id.to_owned(),
                push: Some(push),
            },
            None,
            CALL_TIMEOUT,
        )
        .await
        .step("push")?;
        if let Some(error) = reply.error {
            return Err(BenchError::new("push", error.message));
        }
        let response: PushContextStateResponse = reply.response.unwrap_or_default();
        if !response.accepted {
            return Err(BenchError::new("push", response.message));
        }
        Ok(())
    }

    /// The agent's state as snapshot-store's read API returns it.
    pub async fn read(&self, agent_id: &str) -> Result<AgentState, BenchError> {
        let reply: GetAgentStateReply = rpc::request(
            &self.client,
            self.subjects.store_get_agent_state(),
            &GetAgentStateRequest {
                agent_id: agent_id.to_owned(),
            },
            None,
            CALL_TIMEOUT,
        )
        .await
        .step("read agent state")?;
        match (reply.error, reply.state) {
            (Some(error), _) => Err(BenchError::new("read agent state", error.message)),
            (None, Some(state)) => Ok(state),
            (None, None) => Err(BenchError::new("read agent state", "no state")),
        }
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

/// Resident set size of this process, from /proc/self/status.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A fresh run id.
pub fn run_id() -> String {
    format!("bench-{}", random_hex(8))
}
