//! The warm-up (design note: the catalog's memory, pins and warm-up): once
//! the service is ready and serving, discover every enabled server in the
//! background, one at a time, with its own handshake timeout; retry the
//! failures every `retry_interval` for at most `attempts` rounds; log what is
//! still failing as abandoned. No session state: it fills the memory, records
//! each handshake it made (`mcp.server.connected`, cause `warmup`, for
//! `ctxsync latency`), and nothing waits on it.
//!
//! Across replicas (design note: the catalog's shared memory) a server is
//! warmed by one replica at a time: each attempt is claimed first in the
//! claims bucket; a replica that finds the claim taken leaves the server for
//! the end of its round and then pins what the claimer found. A server
//! whose entry of this release is fresh (discovered less than `fresh`
//! before this replica started, at least the handshake bound: replicas
//! started together share one discovery) is not discovered again, so a
//! rolling restart starts no server; entries of another release go first.
//! A bucket not open yet is waited for, at most 10 s (`LOAD_BOUND`).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use catalog_core::events::ms;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::bucket::{Claim, LOAD_BOUND, RELEASE};
use crate::config::{ConfiguredServer, Current};
use crate::discovery::{Cause, Discoverer};
use crate::events::Events;
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
    /// Entries of this release discovered since then need no discovery
    /// (the start less the fresh window).
    warmed_since: SystemTime,
    /// How long a claimed server is waited for at the end of a round.
    claim_ttl: std::time::Duration,
}

/// What the warm-up did with one server in one round.
enum Step {
    Discovered,
    Failed,
    /// Another replica holds its claim: looked at again at the round's end.
    Claimed,
}

impl Warmup {
    pub fn new(
        config: Arc<Current>,
        discovery: Arc<Discoverer>,
        events: Arc<Events>,
        settings: WarmupSettings,
        started: SystemTime,
        claim_ttl: std::time::Duration,
    ) -> Self {
        let fresh = settings.fresh.max(settings.connect_timeout);
        let warmed_since = started.checked_sub(fresh).unwrap_or(started);
        Self {
            config,
            discovery,
            events,
            settings,
            warmed_since,
            claim_ttl,
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
        self.events.queue(vec![event]);
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
        let memory = self.discovery.memory();
        // A bucket not open yet (JetStream still forming) would make every
        // server look unknown here: nothing waits on the warm-up, so it
        // gives the bucket's reopening a few more attempts. Not the
        // handshake bound: without JetStream at all it would wait in vain.
        if let Some(bucket) = memory.bucket()
            && !bucket.opened(LOAD_BOUND).await
        {
            tracing::info!(
                bucket = bucket.name(),
                waited_ms = LOAD_BOUND.as_millis() as u64,
                "the warm-up goes on without the shared memory"
            );
        }
        // Keys are unique: tenant and server id are part of each.
        let mut pending: Vec<ConfiguredServer> = self.config.get().all_enabled_servers();
        // Entries another release wrote are served only until re-discovered: first.
        pending.sort_by_key(|s| {
            !memory
                .reusable(&s.key)
                .is_some_and(|r| r.is_foreign(RELEASE))
        });
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
            let mut claimed = Vec::new();
            for server in pending {
                match self.warm_one(&server, round, status).await {
                    Step::Discovered => {}
                    Step::Failed => failed.push(server),
                    Step::Claimed => claimed.push(server),
                }
            }
            // What other replicas were warming: pinned once they found it.
            for server in self.await_claimers(claimed, status).await {
                tracing::info!(
                    tenant = %server.tenant, server = server.id(), round,
                    reason = "another replica claimed it and put nothing within the claim's lifetime",
                    "mcp_discovery_warmup_not_shared"
                );
                failed.push(server);
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

    /// One server in one round: skipped when warm, else claimed and discovered.
    async fn warm_one(
        &self,
        server: &ConfiguredServer,
        round: u32,
        status: &watch::Sender<WarmupStatus>,
    ) -> Step {
        let memory = self.discovery.memory();
        // A chat or another replica may have discovered it meanwhile.
        if memory.warmed_since(&server.key, self.warmed_since) {
            self.shared(server, status);
            return Step::Discovered;
        }
        let claim = match memory.bucket() {
            Some(bucket) => bucket.claim(&server.key).await,
            None => Claim::Unshared,
        };
        if claim == Claim::Taken {
            return Step::Claimed;
        }
        if claim == Claim::Held {
            // The replica that released the claim before us acknowledged its
            // entry first; our watch may not have delivered it yet.
            memory.refresh(&server.key).await;
        }
        let result = if memory.warmed_since(&server.key, self.warmed_since) {
            // Discovered between the look and the claim.
            None
        } else {
            Some(
                self.discovery
                    .discover(server, self.settings.connect_timeout, Cause::Warmup)
                    .await,
            )
        };
        if claim == Claim::Held
            && let Some(bucket) = memory.bucket()
        {
            // The discovery's entry first: released earlier, the claim lets
            // another replica discover the server again before it sees the entry.
            bucket.flushed(self.settings.connect_timeout).await;
            bucket.release(&server.key).await;
        }
        match result {
            None => {
                self.shared(server, status);
                Step::Discovered
            }
            Some(Ok(live)) => {
                metrics::counter!("ctxsync_catalog_warmup_servers_total", "outcome" => "discovered")
                    .increment(1);
                tracing::info!(
                    tenant = %server.tenant, server = server.id(), round,
                    tools = live.catalog.tools.len(), duration_ms = live.duration.as_millis() as u64,
                    "mcp_discovery_warmup_discovered"
                );
                self.record_handshake(server, live.duration).await;
                let label = label(server);
                status.send_modify(|s| {
                    s.failing.retain(|l| *l != label);
                    s.discovered.push(label);
                });
                Step::Discovered
            }
            Some(Err(failure)) => {
                metrics::counter!("ctxsync_catalog_warmup_servers_total", "outcome" => "failed")
                    .increment(1);
                tracing::warn!(
                    tenant = %server.tenant, server = server.id(), round,
                    error_kind = failure.kind, error = %failure.message,
                    "mcp_discovery_warmup_failed"
                );
                let label = label(server);
                status.send_modify(|s| {
                    if !s.failing.contains(&label) {
                        s.failing.push(label);
                    }
                });
                Step::Failed
            }
        }
    }

    /// A server the memory holds warm without this replica starting it.
    fn shared(&self, server: &ConfiguredServer, status: &watch::Sender<WarmupStatus>) {
        metrics::counter!("ctxsync_catalog_warmup_servers_total", "outcome" => "shared")
            .increment(1);
        tracing::debug!(tenant = %server.tenant, server = server.id(), "mcp_discovery_warmup_shared");
        let label = label(server);
        status.send_modify(|s| {
            s.failing.retain(|l| *l != label);
            if !s.discovered.contains(&label) {
                s.discovered.push(label);
            }
        });
    }

    /// Waits, at most a claim's lifetime, until the memory holds every
    /// server another replica claimed; returns those it still lacks.
    async fn await_claimers(
        &self,
        mut claimed: Vec<ConfiguredServer>,
        status: &watch::Sender<WarmupStatus>,
    ) -> Vec<ConfiguredServer> {
        if claimed.is_empty() {
            return claimed;
        }
        let memory = self.discovery.memory();
        let mut changes = memory.changes();
        let deadline = tokio::time::Instant::now() + self.claim_ttl;
        loop {
            changes.mark_unchanged();
            claimed.retain(|s| {
                let warm = memory.warmed_since(&s.key, self.warmed_since);
                if warm {
                    self.shared(s, status);
                }
                !warm
            });
            if claimed.is_empty() {
                return claimed;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return claimed,
            }
        }
    }
}
