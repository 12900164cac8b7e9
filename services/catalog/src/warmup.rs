//! The warm-up (design note: the catalog's memory, pins and warm-up): once
//! the service is ready and serving, discover every enabled server in the
//! background, one at a time, with its own handshake timeout; retry the
//! failures every `retry_interval` for at most `attempts` rounds; log what is
//! still failing as abandoned. No session state: it fills the memory, records
//! each handshake it made (`mcp.server.connected`, cause `warmup`, for
//! `ctxsync latency`), and nothing waits on it.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{ConfiguredServer, Current};
use crate::discovery::{Cause, Discoverer};
use crate::events::{Events, ms};
use crate::settings::WarmupSettings;
use crate::store::{NewEvent, kinds};

/// The warm-up's progress, for tests and operators.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmupStatus {
    /// Rounds started so far.
    pub rounds: u32,
    /// Servers (`tenant/server`) discovered by the warm-up.
    pub discovered: Vec<String>,
    /// Servers whose latest warm-up attempt failed (retried next round).
    pub failing: Vec<String>,
    /// Servers still failing after the last round.
    pub abandoned: Vec<String>,
    /// The warm-up has ended (or was disabled, or stopped by shutdown).
    pub finished: bool,
}

fn label(server: &ConfiguredServer) -> String {
    format!("{}/{}", server.tenant, server.id())
}

/// The warm-up: what it reads (the configuration in force), fills (the
/// memory, through live discovery) and records (its handshakes).
pub(crate) struct Warmup {
    config: Arc<Current>,
    discovery: Arc<Discoverer>,
    events: Arc<Events>,
    settings: WarmupSettings,
}

impl Warmup {
    pub fn new(
        config: Arc<Current>,
        discovery: Arc<Discoverer>,
        events: Arc<Events>,
        settings: WarmupSettings,
    ) -> Self {
        Self {
            config,
            discovery,
            events,
            settings,
        }
    }

    /// The handshake's duration and transport, nothing the server said.
    async fn record_handshake(&self, server: &ConfiguredServer, duration: std::time::Duration) {
        let event = NewEvent {
            kind: kinds::SERVER_CONNECTED,
            tenant: server.tenant.clone(),
            session_id: None,
            server_id: Some(server.id().to_owned()),
            payload: serde_json::json!({
                "transport": server.transport_kind().as_str(),
                "duration_ms": ms(duration),
                "cause": Cause::Warmup.as_str(),
            }),
        };
        if let Err(error) = self.events.record(vec![event]).await {
            tracing::warn!(
                error = %ctxsync_runtime::db::describe(&error), server = server.id(),
                "cannot record a warm-up handshake"
            );
        }
    }

    /// Runs the warm-up in the background until it ends or shutdown.
    /// Reports its progress on `status_tx`.
    pub fn spawn(
        self,
        shutdown: ctxsync_runtime::Shutdown,
        ready_at: Instant,
        status_tx: watch::Sender<WarmupStatus>,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            if self.settings.enabled {
                tokio::select! {
                    _ = shutdown.cancelled() => tracing::info!("warm-up stopped by shutdown"),
                    _ = self.warm(&status_tx, ready_at) => {}
                }
            }
            status_tx.send_modify(|s| s.finished = true);
        })
    }

    async fn warm(&self, status: &watch::Sender<WarmupStatus>, ready_at: Instant) {
        let settings = &self.settings;
        // Keys are unique: tenant and server id are part of each.
        let mut pending: Vec<ConfiguredServer> = self.config.get().all_enabled_servers();
        tracing::info!(
            servers = pending.len(),
            after_ready_ms = ready_at.elapsed().as_millis() as u64,
            "mcp_discovery_warmup_started"
        );
        for round in 1..=settings.attempts {
            if pending.is_empty() {
                break;
            }
            if round > 1 {
                tokio::time::sleep(settings.retry_interval).await;
            }
            status.send_modify(|s| s.rounds = round);
            metrics::counter!("ctxsync_catalog_warmup_rounds_total").increment(1);
            let mut failed = Vec::new();
            for server in pending {
                // A chat may have discovered it meanwhile: the memory is fresh.
                if self.discovery.memory().reusable(&server.key).is_some() {
                    continue;
                }
                match self
                    .discovery
                    .discover(&server, settings.connect_timeout, Cause::Warmup)
                    .await
                {
                    Ok(live) => {
                        metrics::counter!("ctxsync_catalog_warmup_servers_total", "outcome" => "discovered")
                        .increment(1);
                        tracing::info!(
                            tenant = %server.tenant, server = server.id(), round,
                            tools = live.catalog.tools.len(), duration_ms = live.duration.as_millis() as u64,
                            "mcp_discovery_warmup_discovered"
                        );
                        self.record_handshake(&server, live.duration).await;
                        let label = label(&server);
                        status.send_modify(|s| {
                            s.failing.retain(|l| *l != label);
                            s.discovered.push(label);
                        });
                    }
                    Err(failure) => {
                        metrics::counter!("ctxsync_catalog_warmup_servers_total", "outcome" => "failed")
                        .increment(1);
                        tracing::warn!(
                            tenant = %server.tenant, server = server.id(), round,
                            error_kind = failure.kind, error = %failure.message,
                            "mcp_discovery_warmup_failed"
                        );
                        let label = label(&server);
                        status.send_modify(|s| {
                            if !s.failing.contains(&label) {
                                s.failing.push(label);
                            }
                        });
                        failed.push(server);
                    }
                }
            }
            pending = failed;
        }
        for server in &pending {
            metrics::counter!("ctxsync_catalog_warmup_servers_total", "outcome" => "abandoned")
                .increment(1);
            tracing::warn!(
                tenant = %server.tenant, server = server.id(), rounds = settings.attempts,
                "mcp_discovery_warmup_abandoned"
            );
        }
        status.send_modify(|s| s.abandoned = pending.iter().map(label).collect());
    }
}
