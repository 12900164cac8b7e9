//! snapshot-store: the only writer of agents and discovery snapshots.
//!
//! It serves the store API over NATS request/reply in a queue group (so
//! replicas share the load), commits each push in one transaction, and only
//! after commit publishes `DiscoveryChanged` when the phase or run id changed
//! and `SnapshotCommitted` when the content changed.

pub mod db;

use std::net::SocketAddr;
use std::time::Duration;

use async_nats::HeaderMap;
use ctxsync_proto::subjects::{STORE_QUEUE_GROUP, Subjects};
use ctxsync_proto::v1::{
    AuthenticateAgentReply, AuthenticateAgentRequest, GetAgentStateReply, GetAgentStateRequest,
    PushContextStateResponse, RegisterAgentReply, RegisterAgentRequest, StoreError as ProtoError,
    StorePushReply, StorePushRequest, UpdateStartupReply, UpdateStartupRequest, store_error::Code,
};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::trace::TraceContext;
use ctxsync_runtime::{CommonArgs, DatabaseArgs, HttpServer, Readiness, Shutdown, rpc};
use prost::Message;

pub use db::{PushOutcome, Store, StoreError};

/// snapshot-store's configuration.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
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
    Subscribe(#[from] async_nats::SubscribeError),
    #[error(transparent)]
    Http(#[from] ctxsync_runtime::http::BindError),
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

fn error_reply(error: &StoreError) -> ProtoError {
    let code = match error {
        StoreError::NotFound(_) => Code::NotFound,
        StoreError::InvalidAgentId(_) | StoreError::Invalid(_) => Code::InvalidArgument,
        StoreError::AlreadyExists { .. } => Code::AlreadyExists,
        StoreError::Database(_) | StoreError::Corrupt(_) => Code::Internal,
    };
    if code == Code::Internal {
        tracing::error!(%error, "store request failed");
    }
    ProtoError {
        code: code as i32,
        message: error.to_string(),
    }
}

/// A store reply that can carry an error instead of its answer.
trait Reply: Default {
    fn failed(error: ProtoError) -> Self;
}

macro_rules! impl_reply {
    ($($reply:ty),*) => {$(
        impl Reply for $reply {
            fn failed(error: ProtoError) -> Self {
                Self { error: Some(error), ..Default::default() }
            }
        }
    )*};
}
impl_reply!(
    RegisterAgentReply,
    AuthenticateAgentReply,
    UpdateStartupReply,
    StorePushReply,
    GetAgentStateReply
);

fn malformed<R: Reply>(message: String) -> R {
    R::failed(ProtoError {
        code: Code::InvalidArgument as i32,
        message,
    })
}

/// The reply for `result`: its answer, or the error.
fn reply<T, R: Reply>(result: Result<T, StoreError>, answer: impl FnOnce(T) -> R) -> R {
    result.map_or_else(|error| R::failed(error_reply(&error)), answer)
}

/// Publishes an event after commit. A lost event is repaired by readers
/// re-checking on reconnect, so a publish failure is logged, not retried.
async fn publish(
    nats: &async_nats::Client,
    subject: String,
    trace: Option<TraceContext>,
    event: &impl Message,
) {
    let payload = event.encode_to_vec().into();
    let published = match trace {
        Some(trace) => {
            nats.publish_with_headers(subject, trace.child().to_nats(), payload)
                .await
        }
        None => nats.publish(subject, payload).await,
    };
    if let Err(error) = published {
        tracing::warn!(%error, "cannot publish event");
    }
}

/// Connects, migrates, subscribes and starts serving.
pub async fn start(config: Config, shutdown: Shutdown) -> Result<RunningStore, StartError> {
    let subjects = config.common.subjects()?;
    let pool = ctxsync_runtime::db::connect(&config.database).await?;
    Store::migrate(&pool)
        .await
        .map_err(ctxsync_runtime::db::DbError::Migrate)?;
    let nats = ctxsync_runtime::nats::connect(&config.common.nats_url, "snapshot-store").await?;
    let store = Store::new(pool.clone());
    let grace = config.common.shutdown_grace;
    let servers = serve_all(&nats.client, &subjects, &store, &shutdown, grace).await?;
    let readiness = Readiness::new().with_nats(&nats).with_postgres(&pool);
    let http = HttpServer::start(
        config.common.http_addr,
        axum::Router::new(),
        readiness,
        shutdown,
    )
    .await?;
    tracing::info!(prefix = subjects.prefix(), "snapshot-store ready");
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

/// Serves one store subject in the store's queue group.
async fn endpoint<Req, R, F, Fut>(
    client: &async_nats::Client,
    subject: String,
    shutdown: &Shutdown,
    grace: Duration,
    handler: F,
) -> Result<rpc::Server, async_nats::SubscribeError>
where
    Req: Message + Default + Send + 'static,
    R: Reply + Message + Send + 'static,
    F: Fn(Req, Option<HeaderMap>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = R> + Send + 'static,
{
    rpc::serve(
        client.clone(),
        subject,
        STORE_QUEUE_GROUP,
        shutdown.clone(),
        grace,
        malformed::<R>,
        handler,
    )
    .await
}

async fn serve_all(
    client: &async_nats::Client,
    subjects: &Subjects,
    store: &Store,
    shutdown: &Shutdown,
    grace: Duration,
) -> Result<Vec<rpc::Server>, async_nats::SubscribeError> {
    let (s, n, j) = (store.clone(), client.clone(), subjects.clone());
    let register = endpoint(client, subjects.store_register_agent(), shutdown, grace, {
        let s = s.clone();
        move |req: RegisterAgentRequest, _| register_agent(s.clone(), req)
    });
    let authenticate = endpoint(
        client,
        subjects.store_authenticate_agent(),
        shutdown,
        grace,
        {
            let s = s.clone();
            move |req: AuthenticateAgentRequest, _| authenticate_agent(s.clone(), req)
        },
    );
    let startup = endpoint(client, subjects.store_update_startup(), shutdown, grace, {
        let (s, n, j) = (s.clone(), n.clone(), j.clone());
        move |req: UpdateStartupRequest, headers: Option<HeaderMap>| {
            let trace = TraceContext::from_nats(headers.as_ref());
            update_startup(s.clone(), n.clone(), j.clone(), trace, req)
        }
    });
    let push = endpoint(client, subjects.store_push(), shutdown, grace, {
        let (s, n, j) = (s.clone(), n.clone(), j.clone());
        move |req: StorePushRequest, headers: Option<HeaderMap>| {
            let trace = TraceContext::from_nats(headers.as_ref());
            let (s, n, j) = (s.clone(), n.clone(), j.clone());
            async move { handle_push(&s, &n, &j, trace, req).await }
        }
    });
    let get = endpoint(client, subjects.store_get_agent_state(), shutdown, grace, {
        move |req: GetAgentStateRequest, _| agent_state(s.clone(), req)
    });
    Ok(vec![
        register.await?,
        authenticate.await?,
        startup.await?,
        push.await?,
        get.await?,
    ])
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

async fn update_startup(
    store: Store,
    nats: async_nats::Client,
    subjects: Subjects,
    trace: Option<TraceContext>,
    req: UpdateStartupRequest,
) -> UpdateStartupReply {
    let result = match db::parse_agent_id(&req.agent_id) {
        Ok(agent_id) => {
            store
                .update_startup(agent_id, &req.startup.unwrap_or_default())
                .await
        }
        Err(error) => Err(error),
    };
    let result = match result {
        Ok((response, event)) => {
            tracing::info!(
                agent_id = %req.agent_id,
                trace_id = trace.map(|t| t.trace_id()).unwrap_or_default(),
                run_id_changed = response.run_id_changed,
                "startup committed"
            );
            if let Some(event) = event {
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

async fn handle_push(
    store: &Store,
    nats: &async_nats::Client,
    subjects: &Subjects,
    trace: Option<TraceContext>,
    request: StorePushRequest,
) -> StorePushReply {
    let trace_id = trace.map(|t| t.trace_id()).unwrap_or_default();
    let push = request.push.unwrap_or_default();
    let result = async {
        let agent_id = db::parse_agent_id(&request.agent_id)?;
        store.push(agent_id, &push).await
    }
    .await;
    match result {
        Ok(PushOutcome::Accepted {
            discovery_changed,
            snapshot_committed,
        }) => {
            metrics::counter!("ctxsync_store_pushes_total", "outcome" => "accepted").increment(1);
            tracing::info!(agent_id = %request.agent_id, %trace_id, version = push.version, "push committed");
            if let Some(event) = discovery_changed {
                tracing::info!(
                    agent_id = %event.agent_id,
                    %trace_id,
                    run_id = %event.snapshot_agent_run_id,
                    phase = event.phase().as_str_name(),
                    "discovery changed"
                );
                publish(
                    nats,
                    subjects.discovery_changed(&event.agent_id),
                    trace,
                    &event,
                )
                .await;
            }
            if let Some(event) = snapshot_committed {
                publish(
                    nats,
                    subjects.snapshot_committed(&event.agent_id),
                    trace,
                    &event,
                )
                .await;
            }
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
            metrics::counter!("ctxsync_store_pushes_total", "outcome" => "error").increment(1);
            StorePushReply {
                response: None,
                error: Some(error_reply(&e)),
            }
        }
    }
}
