//! The operator HTTP listener: `/healthz` (the process is alive), `/readyz`
//! (every dependency check passes), `/metrics` (Prometheus text), plus any
//! routes the service adds. Every listener bounds its connections in time
//! and number (see [`serve`] and [`crate::config::HttpArgs`]).

pub mod browsers;
mod serve;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::config::HttpLimits;
use crate::shutdown::Shutdown;

type CheckFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;
type Check = Arc<dyn Fn() -> CheckFuture + Send + Sync>;

/// Named readiness checks; `/readyz` is 200 only when all pass.
#[derive(Clone, Default)]
pub struct Readiness {
    checks: Vec<(&'static str, Check)>,
}

impl Readiness {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_check<F, Fut>(mut self, name: &'static str, check: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        self.checks
            .push((name, Arc::new(move || Box::pin(check()) as CheckFuture)));
        self
    }

    /// Ready while the NATS server answers a round trip on every connection
    /// (so it has read every subscription made or re-sent before) and has
    /// refused no subject (`nats_permissions` names them and the user).
    pub fn with_nats(self, connection: &crate::nats::NatsConnection) -> Self {
        let permissions = connection.clone();
        let connection = connection.clone();
        self.with_check("nats", move || {
            let connection = connection.clone();
            async move { connection.check_round_trip().await }
        })
        .with_check("nats_permissions", move || {
            std::future::ready(permissions.permissions_check())
        })
    }

    /// Ready while Postgres answers a trivial query.
    pub fn with_postgres(self, pool: &sqlx::PgPool) -> Self {
        let pool = pool.clone();
        self.with_check("postgres", move || {
            let pool = pool.clone();
            async move {
                sqlx::query("SELECT 1")
                    .execute(&pool)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        })
    }

    pub async fn evaluate(&self) -> Vec<(&'static str, Result<(), String>)> {
        let mut results = Vec::with_capacity(self.checks.len());
        for (name, check) in &self.checks {
            let outcome = tokio::time::timeout(std::time::Duration::from_secs(2), check())
                .await
                .unwrap_or_else(|_| Err("check timed out".to_owned()));
            results.push((*name, outcome));
        }
        results
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(readiness): State<Readiness>) -> impl IntoResponse {
    let results = readiness.evaluate().await;
    let ready = results.iter().all(|(_, r)| r.is_ok());
    let body: serde_json::Map<String, serde_json::Value> = results
        .into_iter()
        .map(|(name, result)| {
            let value = match result {
                Ok(()) => "ok".to_owned(),
                Err(reason) => reason,
            };
            (name.to_owned(), serde_json::Value::String(value))
        })
        .collect();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        axum::Json(serde_json::json!({ "ready": ready, "checks": body })),
    )
}

async fn metrics_text() -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::handle().render(),
    )
}

/// The operator routes, to merge with a service's own.
pub fn operator_routes(readiness: Readiness) -> Router {
    health_routes(readiness).route("/metrics", get(metrics_text))
}

/// `/healthz` and `/readyz` without `/metrics` (served on a listener of its own).
fn health_routes(readiness: Readiness) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(readiness)
}

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} ({setting}): {source}")]
pub struct BindError {
    pub addr: SocketAddr,
    /// The env var that set the address.
    pub setting: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// A bound, serving HTTP listener.
pub struct HttpServer {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl HttpServer {
    /// Binds `addr` and serves `routes` plus the operator routes until
    /// `shutdown`, each connection within `limits`.
    pub async fn start(
        addr: SocketAddr,
        limits: HttpLimits,
        routes: Router,
        readiness: Readiness,
        shutdown: Shutdown,
    ) -> Result<Self, BindError> {
        let app = routes.merge(operator_routes(readiness));
        Self::serve(addr, "CTXSYNC_HTTP_ADDR", limits, app, shutdown).await
    }

    /// Like [`HttpServer::start`] without `/metrics` (404 here): for a
    /// service whose metrics have their own listener ([`HttpServer::start_metrics`]).
    pub async fn start_without_metrics(
        addr: SocketAddr,
        limits: HttpLimits,
        routes: Router,
        readiness: Readiness,
        shutdown: Shutdown,
    ) -> Result<Self, BindError> {
        let app = routes.merge(health_routes(readiness));
        Self::serve(addr, "CTXSYNC_HTTP_ADDR", limits, app, shutdown).await
    }

    /// A listener serving only `/metrics` (`CTXSYNC_METRICS_ADDR`), so that
    /// scrapes need not reach a public API port.
    pub async fn start_metrics(
        addr: SocketAddr,
        limits: HttpLimits,
        shutdown: Shutdown,
    ) -> Result<Self, BindError> {
        let app = Router::new().route("/metrics", get(metrics_text));
        Self::serve(addr, "CTXSYNC_METRICS_ADDR", limits, app, shutdown).await
    }

    async fn serve(
        addr: SocketAddr,
        setting: &'static str,
        limits: HttpLimits,
        app: Router,
        shutdown: Shutdown,
    ) -> Result<Self, BindError> {
        let _ = crate::metrics::handle();
        ctxsync_tls::install_default_provider();
        serve::raise_open_files_limit();
        let error = |source| BindError {
            addr,
            setting,
            source,
        };
        let listener = TcpListener::bind(addr).await.map_err(error)?;
        let local_addr = listener.local_addr().map_err(error)?;
        let tls = limits.tls().is_some();
        let task = tokio::spawn(serve::serve(listener, app, limits.clone(), shutdown));
        tracing::info!(
            addr = %local_addr,
            tls,
            header_timeout = %humantime::format_duration(limits.header_timeout()),
            body_timeout = %humantime::format_duration(limits.body_timeout()),
            idle_timeout = %humantime::format_duration(limits.idle_timeout()),
            max_connections = limits.max_connections(),
            "http listening"
        );
        Ok(Self { local_addr, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits, after shutdown was signalled, until the listener is closed and
    /// every request that was in flight has been answered.
    pub async fn join(self) {
        let _ = self.task.await;
    }
}
