//! agent-ingest: the agents' HTTP edge.
//!
//! It authenticates an agent by its bearer token (the agent id comes from the
//! token, so a token can only ever write its own agent), enforces the limits
//! of the agent API before anything reaches the store, and forwards startups
//! and pushes to snapshot-store over NATS. It owns nothing durable.

mod auth;
mod error;
pub mod series;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use ctxsync_proto::limits::MAX_REQUEST_BYTES;
use ctxsync_proto::v1::{
    PushContextStateRequest, StartupDropReason, StartupRequest, service_error::Code,
};
use ctxsync_proto::validate;
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::rpc::RpcError;
use ctxsync_runtime::store::StoreClient;
use ctxsync_runtime::trace::{TRACEPARENT, TraceContext};
use ctxsync_runtime::{CommonArgs, HttpServer, Readiness, Shutdown};
use prost::Message;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument as _;

pub use error::ApiError;

/// agent-ingest's configuration: its flags (see [`CommonArgs`] on `Serialize`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct Config {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonArgs,

    /// How long to wait for snapshot-store before answering 503.
    #[arg(long, env = "CTXSYNC_STORE_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub store_timeout: Duration,

    /// How long a verified token is trusted without asking the store again.
    #[arg(long, env = "CTXSYNC_AUTH_CACHE_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub auth_cache_ttl: Duration,

    /// Serve `/metrics` on this address, and no longer on the agents' API
    /// listener (CTXSYNC_HTTP_ADDR), which is often public. Unset: on the API listener.
    #[arg(long, env = "CTXSYNC_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

/// The flags' defaults.
impl Default for Config {
    fn default() -> Self {
        ctxsync_runtime::args::defaults()
    }
}

impl Config {
    /// The defaults, on `common`.
    pub fn new(common: CommonArgs) -> Self {
        Self {
            common,
            ..Self::default()
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
    Http(#[from] ctxsync_runtime::http::BindError),
}

struct AppState {
    store: StoreClient,
    auth: auth::Authenticator,
}

/// A running agent-ingest.
pub struct RunningIngest {
    http: HttpServer,
    metrics: Option<HttpServer>,
    nats: NatsConnection,
    grace: Duration,
}

impl RunningIngest {
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr()
    }

    /// The metrics listener's address, when `metrics_addr` was set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(HttpServer::local_addr)
    }

    /// Waits for shutdown, lets in-flight requests finish, drains NATS.
    pub async fn join(self) {
        self.http.join().await;
        if let Some(metrics) = self.metrics {
            metrics.join().await;
        }
        ctxsync_runtime::nats::drain(&self.nats, self.grace).await;
        tracing::info!("agent-ingest stopped");
    }
}

pub async fn start(config: Config, shutdown: Shutdown) -> Result<RunningIngest, StartError> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init("agent-ingest", env!("CARGO_PKG_VERSION"), series::SERIES);
    let subjects = config.common.subjects()?;
    let http_limits = config.common.http.limits()?;
    let nats = ctxsync_runtime::nats::connect(&config.common, "agent-ingest").await?;
    let state = Arc::new(AppState {
        auth: auth::Authenticator::new(
            nats.client.clone(),
            subjects.clone(),
            config.store_timeout,
            config.auth_cache_ttl,
        ),
        store: StoreClient::new(nats.client.clone(), &subjects, config.store_timeout),
    });
    let max_payload = nats.client.server_info().max_payload;
    if max_payload < ctxsync_proto::limits::MAX_REQUEST_BYTES + 64 * 1024 {
        tracing::warn!(
            max_payload,
            needed = ctxsync_proto::limits::MAX_REQUEST_BYTES + 64 * 1024,
            "the NATS server's max_payload is below the agent API's request limit: \
             large pushes will be refused with 413; set max_payload: 8MB"
        );
    }
    let routes = router(state);
    let readiness = Readiness::new().with_nats(&nats);
    let (http, metrics) = match config.metrics_addr {
        Some(metrics_addr) => {
            // The metrics listener is internal (scrapers in the cluster):
            // plain HTTP, with the API listener's other limits.
            let metrics = HttpServer::start_metrics(
                metrics_addr,
                http_limits.clone().with_tls(None),
                shutdown.clone(),
            )
            .await?;
            let http = HttpServer::start_without_metrics(
                config.common.http_addr,
                http_limits,
                routes,
                readiness,
                shutdown,
            )
            .await?;
            (http, Some(metrics))
        }
        None => {
            let http = HttpServer::start(
                config.common.http_addr,
                http_limits,
                routes,
                readiness,
                shutdown,
            )
            .await?;
            (http, None)
        }
    };
    tracing::info!(addr = %http.local_addr(), "agent-ingest ready");
    Ok(RunningIngest {
        http,
        metrics,
        nats,
        grace: config.common.shutdown_grace,
    })
}

pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), StartError> {
    start(config, shutdown).await?.join().await;
    Ok(())
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/api/v1/agent/startup", post(startup))
        .route("/api/v1/agent/context-state", post(context_state))
        .with_state(state)
}

/// The wire format of a request, and of its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Protobuf,
    Json,
}

impl Format {
    fn of_request(headers: &HeaderMap) -> Result<Self, ApiError> {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = content_type.split(';').next().unwrap_or("").trim();
        match essence.to_ascii_lowercase().as_str() {
            "application/x-protobuf" | "application/protobuf" => Ok(Self::Protobuf),
            "application/json" => Ok(Self::Json),
            _ => Err(ApiError::UnsupportedMediaType(content_type.to_owned())),
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Self::Protobuf => "application/x-protobuf",
            Self::Json => "application/json",
        }
    }
}

/// Reads the body within the request limit: a declared length over it is
/// refused before reading, a stream that runs over it is cut off.
async fn read_body(request: Request) -> Result<bytes::Bytes, ApiError> {
    if let Some(length) = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        && length > MAX_REQUEST_BYTES
    {
        return Err(ApiError::TooLarge {
            actual: Some(length),
        });
    }
    let body = http_body_util::Limited::new(request.into_body(), MAX_REQUEST_BYTES);
    match http_body_util::BodyExt::collect(body).await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::TooLarge { actual: None })
        }
        Err(error) => Err(ApiError::Malformed(format!("cannot read body: {error}"))),
    }
}

/// Protobuf accepts fields the contract does not define (protobuf's forward
/// compatibility: a newer agent's additions reach an older ingest): prost
/// skips them, so the store never sees them, and they are counted and logged.
/// JSON refuses them (pbjson), as it refuses unknown enum names: JSON bodies
/// are written by hand, where an unknown name is a typo, not a newer agent
/// (README, "Agents → agent-ingest"). Unknown enum numbers decode in both
/// and are refused by `validate`.
fn decode<T: Message + Default + DeserializeOwned + prost::Name>(
    format: Format,
    body: &[u8],
) -> Result<T, ApiError> {
    match format {
        Format::Protobuf => {
            let message = T::decode(body)
                .map_err(|e| ApiError::Malformed(format!("invalid protobuf: {e}")))?;
            count_unknown_fields(&message, body);
            Ok(message)
        }
        Format::Json => serde_json::from_slice(body)
            .map_err(|e| ApiError::Malformed(format!("invalid json: {e}"))),
    }
}

/// Unknown fields logged per request at most (all are counted).
const MAX_LOGGED_UNKNOWN_FIELDS: usize = 8;

/// Counts the fields of `body` that `message` (decoded from it) dropped, by
/// the message type that does not define them, and logs the first few at
/// debug with their number and place.
fn count_unknown_fields<T: Message + prost::Name>(message: &T, body: &[u8]) {
    // A handful of message types: one counter increment per type, not per field.
    let mut per_message: Vec<(String, u64)> = Vec::new();
    let mut seen = 0;
    let found = ctxsync_proto::unknown::for_each_unknown_field(message, body, |field| {
        match per_message
            .iter_mut()
            .find(|(name, _)| name == field.message)
        {
            Some((_, count)) => *count += 1,
            None => per_message.push((field.message.to_owned(), 1)),
        }
        seen += 1;
        if seen <= MAX_LOGGED_UNKNOWN_FIELDS {
            tracing::debug!(
                number = field.number,
                path = field.path,
                "unknown protobuf field accepted and dropped"
            );
        }
    });
    match found {
        Ok(0) => {}
        Ok(found) => {
            for (name, count) in per_message {
                metrics::counter!("ctxsync_ingest_unknown_fields_total", "message" => name)
                    .increment(count);
            }
            tracing::debug!(
                found,
                message = T::full_name(),
                "request carried fields this ingest does not know"
            );
        }
        // prost decoded it: not a reason to refuse the request.
        Err(error) => tracing::warn!(%error, "cannot list a request's unknown fields"),
    }
}

fn encode<T: Message + Serialize>(format: Format, message: &T) -> Response {
    let body = match format {
        Format::Protobuf => message.encode_to_vec(),
        Format::Json => match serde_json::to_vec(message) {
            Ok(json) => json,
            Err(error) => return ApiError::Internal(error.to_string()).into_response(),
        },
    };
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(format.content_type()),
        )],
        Body::from(body),
    )
        .into_response()
}

/// Authenticates, reads, decodes: what both endpoints do before their own work.
async fn accept<T: Message + Default + DeserializeOwned + prost::Name>(
    state: &AppState,
    request: Request,
) -> Result<(String, Format, T), ApiError> {
    let agent_id = state.auth.authenticate(request.headers()).await?;
    let format = Format::of_request(request.headers())?;
    let body = read_body(request).await?;
    metrics::histogram!("ctxsync_ingest_request_bytes").record(body.len() as f64);
    let message = decode(format, &body)?;
    Ok((agent_id, format, message))
}

/// What a failed store call answers the agent: the store's refusals by
/// their code, a request over the bus's limit 413, and 503 while the store
/// cannot be asked.
fn store_failed(error: RpcError) -> ApiError {
    match error {
        RpcError::Service {
            code: Code::InvalidArgument,
            message,
            ..
        } => ApiError::Malformed(message),
        // The token matched an agent that no longer exists.
        RpcError::Service {
            code: Code::NotFound,
            ..
        } => ApiError::Unauthenticated("unknown agent token"),
        RpcError::Service { message, .. } => ApiError::StoreUnavailable(message),
        RpcError::TooLarge { .. } => ApiError::BusTooSmall,
        error if error.is_unavailable() => ApiError::StoreUnavailable(error.to_string()),
        error => ApiError::Internal(error.to_string()),
    }
}

/// The request's trace (continued from its `traceparent` header, else new).
fn trace_of(request: &Request) -> TraceContext {
    request
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse)
        .map_or_else(TraceContext::new_root, |parent| parent.child())
}

async fn startup(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let started = Instant::now();
    let trace = trace_of(&request);
    let span =
        ctxsync_runtime::telemetry::continue_trace(tracing::info_span!("ingest.startup"), &trace);
    let result = async {
        let (agent_id, format, startup): (_, _, StartupRequest) = accept(&state, request).await?;
        validate::startup(&startup).map_err(ApiError::Validation)?;
        let response = state
            .store
            .update_startup(&agent_id, startup, Some(trace.child().to_nats()))
            .await
            .map_err(store_failed)?;
        if response.drop_reason() == StartupDropReason::Unspecified {
            tracing::info!(agent_id = %agent_id, trace_id = %trace.trace_id(), run_id_changed = response.run_id_changed, "agent startup");
        } else {
            tracing::info!(
                agent_id = %agent_id,
                trace_id = %trace.trace_id(),
                reason = response.drop_reason().as_str_name(),
                "agent startup dropped by the store"
            );
        }
        Ok(encode(format, &response))
    }
    .instrument(span)
    .await;
    finish("startup", started, result)
}

async fn context_state(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let started = Instant::now();
    let trace = trace_of(&request);
    let span =
        ctxsync_runtime::telemetry::continue_trace(tracing::info_span!("ingest.push"), &trace);
    let result = async {
        let (agent_id, format, push): (_, _, PushContextStateRequest) =
            accept(&state, request).await?;
        validate::push(&push).map_err(ApiError::Validation)?;
        let version = push.version;
        let response = state
            .store
            .push(&agent_id, push, Some(trace.child().to_nats()))
            .await
            .map_err(store_failed)?;
        if response.accepted {
            tracing::info!(agent_id = %agent_id, trace_id = %trace.trace_id(), version, "push forwarded");
        } else {
            tracing::info!(
                agent_id = %agent_id,
                trace_id = %trace.trace_id(),
                version,
                reason = response.drop_reason().as_str_name(),
                "push dropped by the store"
            );
        }
        Ok(encode(format, &response))
    }
    .instrument(span)
    .await;
    finish("context_state", started, result)
}

fn finish(
    endpoint: &'static str,
    started: Instant,
    result: Result<Response, ApiError>,
) -> Response {
    let response = result.unwrap_or_else(|error| {
        error.log(endpoint);
        error.into_response()
    });
    let status = response.status();
    metrics::counter!("ctxsync_ingest_requests_total", "endpoint" => endpoint, "status" => status.as_u16().to_string())
        .increment(1);
    metrics::histogram!("ctxsync_ingest_request_seconds", "endpoint" => endpoint)
        .record(started.elapsed().as_secs_f64());
    if status == StatusCode::OK {
        tracing::debug!(endpoint, "request served");
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(code: Code) -> RpcError {
        RpcError::Service {
            subject: "p.store.agent.push".into(),
            code,
            message: "why".into(),
            reason: String::new(),
        }
    }

    /// What the agent is answered for each way a store call fails.
    #[test]
    fn store_failures_answer_by_code_and_kind() {
        let cases = [
            (refusal(Code::InvalidArgument), StatusCode::BAD_REQUEST),
            (refusal(Code::NotFound), StatusCode::UNAUTHORIZED),
            (refusal(Code::Internal), StatusCode::SERVICE_UNAVAILABLE),
            (
                refusal(Code::DeadlineExceeded),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (
                RpcError::TooLarge {
                    subject: "s".into(),
                },
                StatusCode::PAYLOAD_TOO_LARGE,
            ),
            (
                RpcError::NoResponders {
                    subject: "s".into(),
                },
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (
                RpcError::Incomplete {
                    subject: "s".into(),
                    field: "response",
                },
                StatusCode::INTERNAL_SERVER_ERROR,
            ),
        ];
        for (error, status) in cases {
            let shown = error.to_string();
            assert_eq!(
                store_failed(error).into_response().status(),
                status,
                "{shown}"
            );
        }
        assert_eq!(
            store_failed(refusal(Code::InvalidArgument)).to_string(),
            "why",
            "the store's reason, not the transport's wording"
        );
    }
}
