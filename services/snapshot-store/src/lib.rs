//! snapshot-store: the only writer of agents and discovery snapshots.
//!
//! It serves the store API over NATS request/reply in a queue group (so
//! replicas share the load), commits each push in one transaction (alone,
//! or with other agents' pushes that came while it waited), and only
//! after commit publishes `DiscoveryChanged` when the phase or run id changed
//! and `SnapshotCommitted` after every accepted push. Both carry the agent's
//! state after the commit, unless it is over the event size limit.

pub mod db;
mod endpoint;
pub mod push_batch;
pub mod series;
pub mod tenant_keys;

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_proto::rpc::store;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    AgentState, AuthenticateAgentReply, AuthenticateAgentRequest, GetAgentStateReply,
    GetAgentStateRequest, PushContextStateResponse, RegisterAgentReply, RegisterAgentRequest,
    StartupDropReason, StorePushReply, StorePushRequest, UpdateStartupReply, UpdateStartupRequest,
};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::telemetry::continue_trace;
use ctxsync_runtime::trace::TraceContext;
use ctxsync_runtime::{CommonArgs, DatabaseArgs, HttpServer, Readiness, Shutdown, rpc};
use prost::Message;
use tracing::Instrument as _;

pub use db::{PushOutcome, StartupOutcome, Store, StoreError};
use endpoint::{endpoint, error_reply, publish, reply};
pub use push_batch::PushBatcher;

/// snapshot-store's configuration: its flags (see [`CommonArgs`] on `Serialize`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct Config {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub database: DatabaseArgs,
    /// Largest encoded agent state an event carries, in bytes; a bigger one
    /// is left out (watchers read it instead), 0 never attaches it. The NATS
    /// server's max_payload less 8 KiB bounds it too.
    #[arg(
        long,
        env = "CTXSYNC_STORE_EVENT_STATE_MAX_BYTES",
        default_value_t = 256 * 1024
    )]
    pub event_state_max_bytes: usize,
    /// Push transactions in flight at once; pushes that arrive while all are
    /// busy are committed together in the next one (group commit). Each has
    /// a Postgres connection of its own beside the pool's. At most the
    /// pool's connections (CTXSYNC_DB_MAX_CONNECTIONS).
    #[arg(long, env = PUSH_TRANSACTIONS_ENV, default_value_t = 2)]
    pub push_transactions: usize,
}

const PUSH_TRANSACTIONS_ENV: &str = "CTXSYNC_STORE_PUSH_TRANSACTIONS";

/// The flags' defaults.
impl Default for Config {
    fn default() -> Self {
        ctxsync_runtime::args::defaults()
    }
}

impl Config {
    /// A configuration with every store-specific option at its default.
    pub fn new(common: CommonArgs, database_url: impl Into<String>) -> Self {
        Self {
            common,
            database: DatabaseArgs::new(database_url),
            ..Self::default()
        }
    }
}

/// Room left in a NATS message for the rest of the event and its headers.
const EVENT_HEADROOM_BYTES: usize = 8 * 1024;

/// The bound on the state an event carries.
#[derive(Debug, Clone, Copy)]
struct StateLimit {
    /// The configured bound; 0 never attaches the state.
    max_bytes: usize,
}

impl StateLimit {
    /// The bound now: the server's max_payload is read per event, since a
    /// reconnect may reach a server with another one.
    fn effective(self, nats: &async_nats::Client) -> usize {
        // max_payload() is the client's copy of the server's limit (an atomic
        // read); server_info() would clone the whole INFO on every event.
        self.max_bytes
            .min(nats.max_payload().saturating_sub(EVENT_HEADROOM_BYTES))
    }

    /// Leaves `state` out of an event when it is over the limit.
    fn apply(self, nats: &async_nats::Client, agent_id: &str, state: &mut Option<AgentState>) {
        if self.max_bytes == 0 {
            *state = None;
            return;
        }
        let Some(size) = state.as_ref().map(Message::encoded_len) else {
            return;
        };
        let limit = self.effective(nats);
        if size > limit {
            *state = None;
            metrics::counter!("ctxsync_store_event_state_omitted_total").increment(1);
            tracing::debug!(%agent_id, size, limit, "agent state left out of the event: over the limit");
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ctxsync_runtime::config::ConfigError),
    #[error(transparent)]
    Nats(#[from] ctxsync_runtime::nats::NatsConnectError),
    #[error(transparent)]
    Database(#[from] ctxsync_runtime::db::DbError),
    #[error("cannot subscribe to the store subjects: {0}")]
    Subscribe(#[from] ctxsync_runtime::nats::SubscribeError),
    #[error(transparent)]
    Http(#[from] ctxsync_runtime::http::BindError),
    #[error(
        "invalid {PUSH_TRANSACTIONS_ENV} {value}: must be from 1 to the pool's connections ({connections})"
    )]
    PushTransactions { value: usize, connections: u32 },
}

/// A running snapshot-store.
pub struct RunningStore {
    http: HttpServer,
    servers: Vec<rpc::Server>,
    nats: NatsConnection,
    grace: Duration,
}

impl RunningStore {
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr()
    }

    /// Waits for shutdown, then finishes in-flight requests and drains NATS.
    pub async fn join(self) {
        for server in self.servers {
            server.join().await;
        }
        ctxsync_runtime::nats::drain(&self.nats, self.grace).await;
        self.http.join().await;
        tracing::info!("snapshot-store stopped");
    }
}

/// Connects, migrates, subscribes and starts serving.
pub async fn start(config: Config, shutdown: Shutdown) -> Result<RunningStore, StartError> {
    // Boxed: the startup's state (TLS and pool settings included) is too
    // large to carry inline in every caller's future.
    Box::pin(start_unboxed(config, shutdown)).await
}

async fn start_unboxed(config: Config, shutdown: Shutdown) -> Result<RunningStore, StartError> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init("snapshot-store", env!("CARGO_PKG_VERSION"), series::SERIES);
    let subjects = config.common.subjects()?;
    let http_limits = config.common.http.limits()?;
    let connections = config.database.db_max_connections;
    if config.push_transactions == 0 || config.push_transactions > connections as usize {
        return Err(StartError::PushTransactions {
            value: config.push_transactions,
            connections,
        });
    }
    let pool = ctxsync_runtime::db::connect(&config.database).await?;
    Store::migrate(&pool)
        .await
        .map_err(ctxsync_runtime::db::DbError::Migrate)?;
    let nats = ctxsync_runtime::nats::connect(&config.common, "snapshot-store").await?;
    let store = Store::new(pool.clone());
    let grace = config.common.shutdown_grace;
    let limit = StateLimit {
        max_bytes: config.event_state_max_bytes,
    };
    let pushes = PushBatcher::start(store.clone(), config.push_transactions);
    let servers = serve_all(&nats, &subjects, &store, &pushes, limit, &shutdown, grace).await?;
    let readiness = Readiness::new().with_nats(&nats).with_postgres(&pool);
    let http = HttpServer::start(
        config.common.http_addr,
        http_limits,
        axum::Router::new(),
        readiness,
        shutdown,
    )
    .await?;
    let event_state_max_bytes = limit.effective(&nats.client);
    if limit.max_bytes > 0 && event_state_max_bytes == 0 {
        tracing::warn!(
            max_payload = nats.client.server_info().max_payload,
            "the nats server's max_payload leaves no room for states in events: watchers will read them"
        );
    }
    tracing::info!(
        prefix = subjects.prefix(),
        event_state_max_bytes,
        "snapshot-store ready"
    );
    Ok(RunningStore {
        http,
        servers,
        nats,
        grace,
    })
}

/// Runs until `shutdown`, then stops gracefully.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), StartError> {
    start(config, shutdown).await?.join().await;
    Ok(())
}

async fn serve_all(
    nats: &NatsConnection,
    subjects: &Subjects,
    store: &Store,
    pushes: &PushBatcher,
    limit: StateLimit,
    shutdown: &Shutdown,
    grace: Duration,
) -> Result<Vec<rpc::Server>, ctxsync_runtime::nats::SubscribeError> {
    // Events go out on the connection the answers do (the responder's, if
    // one is configured): an answer never overtakes its commit's event.
    let client = &nats.responder().client;
    let (s, n, j) = (store.clone(), client.clone(), subjects.clone());
    let register = endpoint(store::RegisterAgent, nats, subjects, shutdown, grace, {
        let s = s.clone();
        move |req: RegisterAgentRequest, _| register_agent(s.clone(), req)
    });
    let rotate = endpoint(store::RotateAgentToken, nats, subjects, shutdown, grace, {
        let s = s.clone();
        move |req: ctxsync_proto::v1::RotateAgentTokenRequest, _| {
            let s = s.clone();
            async move {
                let result = s
                    .rotate_token(&req.tenant, &req.workspace, &req.name, &req.token_sha256)
                    .await;
                reply(result, |id| {
                    tracing::info!(agent_id = %id, tenant = %req.tenant, workspace = %req.workspace, name = %req.name, "agent token rotated");
                    ctxsync_proto::v1::RotateAgentTokenReply {
                        agent_id: id.to_string(),
                        error: None,
                    }
                })
            }
        }
    });
    let authenticate = endpoint(store::AuthenticateAgent, nats, subjects, shutdown, grace, {
        let s = s.clone();
        move |req: AuthenticateAgentRequest, _| authenticate_agent(s.clone(), req)
    });
    let startup = endpoint(store::UpdateStartup, nats, subjects, shutdown, grace, {
        let (s, n, j) = (s.clone(), n.clone(), j.clone());
        move |req: UpdateStartupRequest, incoming: rpc::Incoming| {
            let trace = TraceContext::from_nats(incoming.headers.as_ref());
            let span = continue_trace(tracing::info_span!("store.startup"), trace.as_ref());
            let deadline = incoming.deadline();
            update_startup(s.clone(), n.clone(), j.clone(), limit, trace, deadline, req)
                .instrument(span)
        }
    });
    let push = endpoint(store::PushContextState, nats, subjects, shutdown, grace, {
        let (p, n, j) = (pushes.clone(), n.clone(), j.clone());
        move |req: StorePushRequest, incoming: rpc::Incoming| {
            let trace = TraceContext::from_nats(incoming.headers.as_ref());
            let span = continue_trace(tracing::info_span!("store.push"), trace.as_ref());
            let deadline = incoming.deadline();
            let (p, n, j) = (p.clone(), n.clone(), j.clone());
            async move { handle_push(&p, &n, &j, limit, trace, deadline, req).await }
                .instrument(span)
        }
    });
    let get = endpoint(store::GetAgentState, nats, subjects, shutdown, grace, {
        let s = s.clone();
        move |req: GetAgentStateRequest, _| agent_state(s.clone(), req)
    });
    let list = endpoint(store::ListAgents, nats, subjects, shutdown, grace, {
        let s = s.clone();
        move |req: ctxsync_proto::v1::ListAgentsRequest, _| list_agents(s.clone(), req)
    });
    let mut servers = vec![
        register.await?,
        rotate.await?,
        authenticate.await?,
        startup.await?,
        push.await?,
        get.await?,
        list.await?,
    ];
    servers.extend(tenant_keys::serve(nats, subjects, &s, shutdown, grace).await?);
    Ok(servers)
}

async fn register_agent(store: Store, req: RegisterAgentRequest) -> RegisterAgentReply {
    let result = store
        .register(&req.tenant, &req.workspace, &req.name, &req.token_sha256)
        .await;
    reply(result, |id| {
        tracing::info!(
            agent_id = %id,
            tenant = %req.tenant,
            workspace = %req.workspace,
            name = %req.name,
            "agent registered"
        );
        RegisterAgentReply {
            agent_id: id.to_string(),
            error: None,
        }
    })
}

async fn authenticate_agent(store: Store, req: AuthenticateAgentRequest) -> AuthenticateAgentReply {
    reply(store.authenticate(&req.token_sha256).await, |id| {
        AuthenticateAgentReply {
            agent_id: id.map(|id| id.to_string()).unwrap_or_default(),
            error: None,
        }
    })
}

#[allow(clippy::too_many_arguments)]
async fn update_startup(
    store: Store,
    nats: async_nats::Client,
    subjects: Subjects,
    limit: StateLimit,
    trace: Option<TraceContext>,
    deadline: Option<tokio::time::Instant>,
    req: UpdateStartupRequest,
) -> UpdateStartupReply {
    let result = match db::parse_agent_id(&req.agent_id) {
        Ok(agent_id) => {
            store
                .update_startup(agent_id, &req.startup.unwrap_or_default(), deadline)
                .await
        }
        Err(error) => Err(error),
    };
    let trace_id = trace.map(|t| t.trace_id()).unwrap_or_default();
    let outcome = match &result {
        Ok(outcome) if outcome.response.drop_reason() != StartupDropReason::Unspecified => {
            tracing::info!(
                agent_id = %req.agent_id,
                %trace_id,
                reason = outcome.response.drop_reason().as_str_name(),
                message = %outcome.response.message,
                "startup dropped"
            );
            "dropped"
        }
        Ok(_) => "accepted",
        Err(StoreError::DeadlineExceeded) => "expired",
        Err(_) => "error",
    };
    metrics::counter!("ctxsync_store_startups_total", "outcome" => outcome).increment(1);
    let result = match result {
        Ok(StartupOutcome {
            response,
            discovery_changed,
        }) => {
            if response.drop_reason() == StartupDropReason::Unspecified {
                tracing::info!(
                    agent_id = %req.agent_id,
                    %trace_id,
                    run_id_changed = response.run_id_changed,
                    "startup committed"
                );
            }
            if let Some(mut event) = discovery_changed {
                limit.apply(&nats, &event.agent_id, &mut event.state);
                publish(
                    &nats,
                    subjects.discovery_changed(&event.agent_id),
                    trace,
                    &event,
                )
                .await;
            }
            Ok(response)
        }
        Err(error) => Err(error),
    };
    reply(result, |response| UpdateStartupReply {
        response: Some(response),
        error: None,
    })
}

async fn agent_state(store: Store, req: GetAgentStateRequest) -> GetAgentStateReply {
    let result = match db::parse_agent_id(&req.agent_id) {
        Ok(agent_id) => store.agent_state(agent_id).await,
        Err(error) => Err(error),
    };
    reply(result, |state| GetAgentStateReply {
        state: Some(state),
        error: None,
    })
}

async fn list_agents(
    store: Store,
    req: ctxsync_proto::v1::ListAgentsRequest,
) -> ctxsync_proto::v1::ListAgentsReply {
    let result = async {
        let after = match req.after_agent_id.as_str() {
            "" => None,
            id => Some(db::parse_agent_id(id)?),
        };
        store.list_agents(&req.tenant, req.limit, after).await
    }
    .await;
    reply(result, |(states, next)| {
        ctxsync_proto::v1::ListAgentsReply {
            states,
            next_after_agent_id: next.map(|id| id.to_string()).unwrap_or_default(),
            error: None,
        }
    })
}

async fn handle_push(
    pushes: &PushBatcher,
    nats: &async_nats::Client,
    subjects: &Subjects,
    limit: StateLimit,
    trace: Option<TraceContext>,
    deadline: Option<tokio::time::Instant>,
    request: StorePushRequest,
) -> StorePushReply {
    let trace_id = trace.map(|t| t.trace_id()).unwrap_or_default();
    let push = request.push.unwrap_or_default();
    let version = push.version;
    let result = async {
        let agent_id = db::parse_agent_id(&request.agent_id)?;
        pushes.push(agent_id, push, deadline).await
    }
    .await;
    match result {
        Ok(PushOutcome::Accepted {
            discovery_changed,
            mut snapshot_committed,
            state,
        }) => {
            // Chats waiting for discovery wake on DiscoveryChanged: it goes
            // out first, before the logs, the metrics and the other event.
            // Both events carry the same state (a watcher follows them on
            // two subscriptions and may see either first): its size is
            // checked once, and it moves from one event to the other.
            let mut state = Some(*state);
            limit.apply(nats, &request.agent_id, &mut state);
            if let Some(mut event) = discovery_changed {
                event.state = state;
                publish(
                    nats,
                    subjects.discovery_changed(&event.agent_id),
                    trace,
                    &event,
                )
                .await;
                state = event.state.take();
                tracing::info!(
                    agent_id = %event.agent_id,
                    %trace_id,
                    run_id = %event.snapshot_agent_run_id,
                    phase = event.phase().as_str_name(),
                    "discovery changed"
                );
            }
            snapshot_committed.state = state;
            publish(
                nats,
                subjects.snapshot_committed(&snapshot_committed.agent_id),
                trace,
                &snapshot_committed,
            )
            .await;
            metrics::counter!("ctxsync_store_pushes_total", "outcome" => "accepted").increment(1);
            tracing::info!(agent_id = %request.agent_id, %trace_id, version, "push committed");
            StorePushReply {
                response: Some(PushContextStateResponse {
                    accepted: true,
                    ..Default::default()
                }),
                error: None,
            }
        }
        Ok(PushOutcome::Dropped { reason, message }) => {
            metrics::counter!("ctxsync_store_pushes_total", "outcome" => "dropped", "reason" => reason.as_str_name())
                .increment(1);
            tracing::info!(agent_id = %request.agent_id, %trace_id, reason = reason.as_str_name(), %message, "push dropped");
            StorePushReply {
                response: Some(PushContextStateResponse {
                    accepted: false,
                    drop_reason: reason as i32,
                    message,
                }),
                error: None,
            }
        }
        Err(e) => {
            let outcome = match e {
                StoreError::DeadlineExceeded => "expired",
                _ => "error",
            };
            metrics::counter!("ctxsync_store_pushes_total", "outcome" => outcome).increment(1);
            StorePushReply {
                response: None,
                error: Some(error_reply(&e)),
            }
        }
    }
}
