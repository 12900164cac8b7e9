//! `catalog.status.<tenant>`: the tenant's configured servers with what the
//! memory holds of each and the warm-up's state for it, and the tenant's
//! latency aggregates. The tenant is the subject's; the answer carries ids,
//! hashes, counts and durations, never a message, argument or result.

use std::sync::Arc;
use std::time::Duration;

use catalog_core::ErrorCode;
use ctxsync_proto::v1::{
    CatalogServerStatus, CatalogSetupBucket, CatalogStatusReply, CatalogStatusRequest,
    LatencyGateWaits, catalog_server_status::Warmup,
};
use tokio::sync::watch;

use crate::config::Current;
use crate::discovery::Discoverer;
use crate::latency;
use crate::request::error;
use crate::warmup::WarmupStatus;

/// The window when the request names none.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The longest window answered.
pub const MAX_WINDOW: Duration = Duration::from_secs(90 * 24 * 3600);

pub(crate) struct Status {
    config: Arc<Current>,
    discovery: Arc<Discoverer>,
    warmup: watch::Receiver<WarmupStatus>,
    pool: sqlx::PgPool,
}

impl Status {
    pub fn new(
        config: Arc<Current>,
        discovery: Arc<Discoverer>,
        warmup: watch::Receiver<WarmupStatus>,
        pool: sqlx::PgPool,
    ) -> Self {
        Self {
            config,
            discovery,
            warmup,
            pool,
        }
    }

    pub async fn handle(&self, request: CatalogStatusRequest) -> CatalogStatusReply {
        let tenant = request.tenant;
        let warmup = self.warmup.borrow().clone();
        let servers = self
            .config
            .get()
            .enabled_servers(&tenant)
            .unwrap_or_default()
            .into_iter()
            .map(|server| {
                let label = format!("{}/{}", server.tenant, server.id());
                let state = if warmup.discovered.contains(&label) {
                    Warmup::Discovered
                } else if warmup.abandoned.contains(&label) {
                    Warmup::Abandoned
                } else if warmup.failing.contains(&label) {
                    Warmup::Failing
                } else {
                    Warmup::Pending
                };
                let remembered = self.discovery.memory().reusable(&server.key);
                CatalogServerStatus {
                    server_id: server.id().to_owned(),
                    transport: server.transport_kind().to_proto() as i32,
                    remembered: remembered.is_some(),
                    tool_count: remembered
                        .as_ref()
                        .map_or(0, |r| r.catalog.tools.len() as u32),
                    catalog_hash: remembered
                        .map(|r| r.catalog.hash.clone())
                        .unwrap_or_default(),
                    warmup: state as i32,
                }
            })
            .collect();
        let window = match request.window_seconds {
            0 => DEFAULT_WINDOW,
            seconds => Duration::from_secs(seconds).min(MAX_WINDOW),
        };
        match latency::tenant_series(&self.pool, &tenant, window).await {
            Ok(series) => CatalogStatusReply {
                servers,
                window_start: Some(series.window_start.into()),
                bucket_seconds: series.bucket.as_secs(),
                setup: series
                    .setup
                    .iter()
                    .map(|b| CatalogSetupBucket {
                        start: Some(b.start.into()),
                        setup: Some(b.setup.to_proto()),
                    })
                    .collect(),
                gate_waits: series
                    .gate_waits
                    .iter()
                    .map(|g| LatencyGateWaits {
                        outcome: g.outcome.clone(),
                        wait: Some(g.wait.to_proto()),
                    })
                    .collect(),
                error: None,
            },
            Err(failure) => {
                tracing::warn!(
                    error = %ctxsync_runtime::db::describe(&failure), tenant,
                    "cannot read the latency aggregates"
                );
                CatalogStatusReply {
                    servers,
                    error: error(
                        ErrorCode::Internal,
                        "cannot read the latency aggregates".to_owned(),
                    ),
                    ..Default::default()
                }
            }
        }
    }
}
