//! chat-gate: the chats' side of ctxsync.
//!
//! Before a turn, a chat backend asks the gate whether the turn may run and
//! with which context. A first turn waits for the current agent process's
//! MCP discovery to complete, woken by snapshot-store's discovery event (one
//! subscription per replica, never a polling loop), bounded by a deadline;
//! the answer carries the chat projection of the committed snapshot (tools of
//! a previous process withheld). Views of agents stay in memory, kept current
//! by the events (which carry the committed state), so most turns need no
//! store read. The API is NATS request/reply on
//! `<prefix>.gate.turn.<tenant>` in a queue group (NATS permissions confine a
//! chat backend's user to its tenant's subject), and HTTP (`POST
//! /api/v1/gate`, `GET /api/v1/agents/{agent_id}/context`) authenticated by
//! a tenant key. Either way an agent of another tenant is not found.

pub mod auth;
pub mod catalog;
pub mod gate;
pub mod http;
pub mod projection;
pub mod series;
pub mod store;
pub mod watch;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use ctxsync_proto::subjects::{GATE_QUEUE_GROUP, Subjects};
use ctxsync_proto::v1::{
    DiscoveryChanged, GateError, SnapshotCommitted, TurnReply, TurnRequest, gate_error::Code,
};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::telemetry::continue_trace;
use ctxsync_runtime::{CommonArgs, HttpServer, Readiness, Shutdown, rpc};
use futures::StreamExt;
use futures::stream::BoxStream;
use prost::Message;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use gate::{Gate, GateSettings};

/// chat-gate's configuration.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonArgs,

    /// How long a first turn waits for a PENDING discovery of the current agent process.
    #[arg(long, env = "CTXSYNC_GATE_PENDING_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub pending_timeout: Duration,

    /// How long a first turn waits when the current process has not reported
    /// yet (no snapshot, or only a previous process's).
    #[arg(long, env = "CTXSYNC_GATE_STALE_GRACE", default_value = "3s", value_parser = humantime::parse_duration)]
    pub stale_grace: Duration,

    /// Bound of one read from snapshot-store; past it the turn fails open.
    #[arg(long, env = "CTXSYNC_GATE_STORE_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub store_timeout: Duration,

    /// How long a chat's timed-out wait is remembered, so its later turns don't wait again.
    #[arg(long, env = "CTXSYNC_GATE_ATTEMPT_TTL", default_value = "10m", value_parser = humantime::parse_duration)]
    pub attempt_ttl: Duration,

    /// Bound of a first turn's catalog preparation; past it the turn proceeds
    /// and the projection says the catalog is unavailable.
    #[arg(long, env = "CTXSYNC_GATE_CATALOG_TIMEOUT", default_value = "12s", value_parser = humantime::parse_duration)]
    pub catalog_timeout: Duration,

    /// Prepare the tenant's catalog on first turns (false: the catalog
    /// section says it was not requested; for deployments without a catalog).
    #[arg(long, env = "CTXSYNC_GATE_CATALOG", default_value_t = true, action = clap::ArgAction::Set)]
    pub catalog: bool,

    /// Turns one replica holds at once over NATS (waiting first turns included);
    /// more wait in the subscription.
    #[arg(long, env = "CTXSYNC_GATE_MAX_TURNS", default_value_t = 20_000)]
    pub max_turns: usize,

    /// Agents whose views are kept in memory (held ones are never evicted;
    /// past this, idle ones go, oldest first).
    #[arg(long, env = "CTXSYNC_GATE_MAX_VIEWS", default_value_t = 10_000)]
    pub max_views: usize,

    /// How long an agent's view is kept after its last turn (events keep it
    /// current meanwhile, so a new chat on a busy agent needs no store read).
    #[arg(long, env = "CTXSYNC_GATE_VIEW_TTL", default_value = "10m", value_parser = humantime::parse_duration)]
    pub view_ttl: Duration,

    /// Safety net only: re-read every waited-on agent this often in case an
    /// event was lost without a reconnect. Waits end on events, not on this.
    /// 0 disables it.
    #[arg(long, env = "CTXSYNC_GATE_SWEEP_INTERVAL", default_value = "2m", value_parser = humantime::parse_duration)]
    pub sweep_interval: Duration,
}

impl Config {
    /// The defaults, on the given NATS server and prefix (for tests and embedding).
    pub fn new(common: CommonArgs) -> Self {
        let settings = GateSettings::default();
        Self {
            common,
            pending_timeout: settings.pending_timeout,
            stale_grace: settings.stale_grace,
            store_timeout: settings.store_timeout,
            attempt_ttl: settings.attempt_ttl,
            catalog_timeout: Duration::from_secs(12),
            catalog: true,
            max_turns: 20_000,
            max_views: settings.views.max_views,
            view_ttl: settings.views.idle_ttl,
            sweep_interval: Duration::from_secs(120),
        }
    }

    fn settings(&self) -> Result<GateSettings, StartError> {
        if self.store_timeout.is_zero() {
            return Err(StartError::Setting {
                env: "CTXSYNC_GATE_STORE_TIMEOUT",
                value: "0s".into(),
                reason: "must be above zero",
            });
        }
        if self.max_views == 0 {
            return Err(StartError::Setting {
                env: "CTXSYNC_GATE_MAX_VIEWS",
                value: "0".into(),
                reason: "must be above zero (views are how waits are woken)",
            });
        }
        Ok(GateSettings {
            pending_timeout: self.pending_timeout,
            stale_grace: self.stale_grace,
            store_timeout: self.store_timeout,
            attempt_ttl: self.attempt_ttl,
            views: watch::ViewLimits {
                max_views: self.max_views,
                idle_ttl: self.view_ttl,
            },
            drain: gate::drain_window(self.common.shutdown_grace),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ctxsync_runtime::config::ConfigError),
    #[error("invalid {env} {value:?}: {reason}")]
    Setting {
        env: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error(transparent)]
    Nats(#[from] ctxsync_runtime::nats::NatsConnectError),
    #[error(transparent)]
    Subscribe(#[from] ctxsync_runtime::nats::SubscribeError),
    #[error(transparent)]
    Http(#[from] ctxsync_runtime::http::BindError),
}

/// A running chat-gate.
pub struct RunningGate {
    gate: Gate,
    http: HttpServer,
    server: rpc::Server,
    tasks: Vec<JoinHandle<()>>,
    /// Stops `tasks` (they also stop when the drain window closes).
    tasks_stop: CancellationToken,
    nats: NatsConnection,
    grace: Duration,
}

impl RunningGate {
    pub fn http_addr(&self) -> SocketAddr {
        self.http.local_addr()
    }

    /// The gate itself, for in-process callers and tests.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// Waits for shutdown, then drains: no new turns are taken, waiting
    /// first turns go on (woken by the events, still applied) until they end
    /// or the drain window closes, their answers go out, and NATS is drained.
    pub async fn join(self) {
        // The NATS turns: answered while the turn server applies the events.
        let events = self.server.join_keeping_before().await;
        // HTTP and in-process turns may still wait: keep applying the events
        // until they are answered (at the latest when the drain window closes).
        let gate = self.gate.clone();
        let http = self.http.join();
        let turns_done = async move {
            http.await;
            gate.until_no_waits().await;
        };
        tokio::pin!(turns_done);
        match events {
            Some(mut events) => loop {
                tokio::select! {
                    biased;
                    () = &mut turns_done => break,
                    Some(()) = events.next() => {}
                }
            },
            None => turns_done.await,
        }
        self.tasks_stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        ctxsync_runtime::nats::drain(&self.nats, self.grace).await;
        tracing::info!("chat-gate stopped");
    }
}

fn timestamp_to_system(ts: Option<&pbjson_types::Timestamp>) -> Option<SystemTime> {
    let ts = ts?;
    let seconds = u64::try_from(ts.seconds).ok()?;
    let nanos = u32::try_from(ts.nanos).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(seconds, nanos))
}

async fn subscribe(
    nats: &NatsConnection,
    subject: String,
) -> Result<async_nats::Subscriber, StartError> {
    Ok(ctxsync_runtime::nats::subscribe(nats, subject, None).await?)
}

/// The store's events as one stream, each applied to its agent's view as it
/// is yielded. The turn server polls it ahead of the turns, so a turn sent
/// after an event was published is answered with the event applied.
fn apply_events(
    gate: Gate,
    discovery: async_nats::Subscriber,
    snapshots: async_nats::Subscriber,
) -> BoxStream<'static, ()> {
    let on_discovery = gate.clone();
    let discovery = discovery.map(move |message| {
        let trace = ctxsync_runtime::trace::TraceContext::from_nats(message.headers.as_ref());
        let _span = continue_trace(tracing::info_span!("gate.discovery"), trace.as_ref()).entered();
        match DiscoveryChanged::decode(message.payload) {
            Ok(event) => {
                // Every replica sees every event: one line per event and
                // replica is chatter at INFO (the store logs the commit once).
                tracing::debug!(
                    agent_id = %event.agent_id,
                    trace_id = trace.map(|t| t.trace_id()).unwrap_or_default(),
                    phase = event.phase().as_str_name(),
                    revision = event.revision,
                    watched = on_discovery.watches().is_watched(&event.agent_id),
                    "discovery event: updating the agent's view"
                );
                let committed_at = timestamp_to_system(event.committed_at.as_ref());
                on_discovery.watches().on_event(
                    &event.agent_id,
                    watch::EventUpdate::new(event.revision, event.state, committed_at),
                );
            }
            Err(error) => {
                tracing::warn!(subject = %message.subject, %error, "malformed discovery event ignored")
            }
        }
    });
    let snapshots = snapshots.map(move |message| {
        // Most commits are of agents nobody asks about: skip decoding their
        // states (the subject ends with the agent id).
        let agent_id = message.subject.rsplit('.').next().unwrap_or_default();
        if !gate.watches().is_watched(agent_id) {
            return;
        }
        match SnapshotCommitted::decode(message.payload) {
            Ok(event) => {
                let committed_at = timestamp_to_system(event.committed_at.as_ref());
                gate.watches().on_event(
                    &event.agent_id,
                    watch::EventUpdate::new(event.revision, event.state, committed_at),
                )
            }
            Err(error) => {
                tracing::warn!(subject = %message.subject, %error, "malformed snapshot event ignored")
            }
        }
    });
    futures::stream::select(discovery, snapshots).boxed()
}

/// Events published while disconnected (or dropped as a slow consumer) are
/// lost. Views are distrusted as soon as the gap is counted (they compare
/// epochs); once connected, every agent someone waits on is read again.
/// Runs through the drain: waits still going on after shutdown are re-read too.
/// Also forgets the remembered tenant keys: a revocation may be among the
/// lost events.
fn recheck_after_gaps(
    gate: Gate,
    keys: auth::TenantKeys,
    nats: &NatsConnection,
    stop: CancellationToken,
) -> JoinHandle<()> {
    let mut gaps = nats.gaps();
    let nats = nats.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                changed = gaps.changed() => if changed.is_err() { break },
            }
            keys.forget_all();
            if !nats.is_connected() {
                // The reconnect is another gap: re-read then, not into the void.
                continue;
            }
            let agents = gate.watches().recheck_all();
            tracing::info!(
                agents,
                "events may have been lost: re-reading every waited-on agent"
            );
        }
    })
}

/// The slow safety sweep and the expiry of remembered attempts (through the
/// drain, like the re-reads after a gap).
fn housekeeping(gate: Gate, sweep: Duration, stop: CancellationToken) -> JoinHandle<()> {
    let settings = gate.settings();
    let prune_every = (settings.attempt_ttl.min(settings.views.idle_ttl) / 4)
        .clamp(Duration::from_millis(50), Duration::from_secs(30));
    tokio::spawn(async move {
        let mut prune = tokio::time::interval(prune_every);
        prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_sweep = (!sweep.is_zero()).then(|| tokio::time::Instant::now() + sweep);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = prune.tick() => {
                    let held = gate.prune();
                    metrics::gauge!("ctxsync_gate_attempts_held").set(held as f64);
                }
                _ = async {
                    match next_sweep {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    let agents = gate.watches().recheck_all();
                    if agents > 0 {
                        tracing::debug!(agents, "safety sweep re-read waited-on agents");
                    }
                    next_sweep = Some(tokio::time::Instant::now() + sweep);
                }
            }
        }
    })
}

fn malformed(message: String) -> TurnReply {
    TurnReply {
        error: Some(GateError {
            code: Code::InvalidArgument as i32,
            message,
        }),
        ..Default::default()
    }
}

/// Connects, subscribes to the events, then starts serving turns.
pub async fn start(config: Config, shutdown: Shutdown) -> Result<RunningGate, StartError> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init("chat-gate", env!("CARGO_PKG_VERSION"), series::SERIES);
    let subjects: Subjects = config.common.subjects()?;
    let http_limits = config.common.http.limits()?;
    let settings = config.settings()?;
    let nats = ctxsync_runtime::nats::connect(&config.common, "chat-gate").await?;
    let store = store::StoreReader::new(nats.client.clone(), &subjects, settings.store_timeout);
    let catalog =
        catalog::CatalogClient::new(nats.client.clone(), &subjects, config.catalog_timeout);
    let mut gate = Gate::new(settings, store, nats.gaps(), shutdown.clone())
        .with_wait_events(nats.client.clone(), subjects.gate_turn_waited());
    if config.catalog {
        gate = gate.with_catalog(catalog);
    }

    let keys = auth::TenantKeys::new(nats.client.clone(), &subjects, config.store_timeout);

    // The event subscriptions are in place (confirmed by a round trip, not
    // just written) before the first turn is served.
    let discovery = subscribe(&nats, subjects.discovery_changed_all()).await?;
    let snapshots = subscribe(&nats, subjects.snapshot_committed_all()).await?;
    let revocations = subscribe(&nats, subjects.tenant_key_revoked()).await?;
    let tasks_stop = gate.drained().child_token();
    let tasks = vec![
        recheck_after_gaps(gate.clone(), keys.clone(), &nats, tasks_stop.clone()),
        housekeeping(gate.clone(), config.sweep_interval, tasks_stop.clone()),
        tokio::spawn({
            let (keys, stop) = (keys.clone(), tasks_stop.clone());
            async move {
                tokio::select! {
                    () = keys.follow_revocations(revocations) => {}
                    () = stop.cancelled() => {}
                }
            }
        }),
    ];

    let handler_gate = gate.clone();
    let server = rpc::serve_after(
        &nats,
        subjects.gate_turn_all(),
        GATE_QUEUE_GROUP,
        shutdown.clone(),
        config.common.shutdown_grace,
        config.max_turns.max(1),
        apply_events(gate.clone(), discovery, snapshots),
        malformed,
        move |mut request: TurnRequest, incoming: rpc::Incoming| {
            let gate = handler_gate.clone();
            // The subject's tenant, which NATS permissions confine: never the body's.
            let tenant = incoming.last_token();
            let mismatch = !request.tenant.is_empty() && request.tenant != tenant;
            tenant.clone_into(&mut request.tenant);
            async move {
                if mismatch {
                    return malformed(
                        "tenant in the request differs from the subject's tenant: omit it".into(),
                    );
                }
                gate.turn_after_events(request).await
            }
        },
    )
    .await?;

    let readiness = Readiness::new().with_nats(&nats);
    let http = HttpServer::start(
        config.common.http_addr,
        http_limits,
        http::routes(gate.clone(), keys),
        readiness,
        shutdown,
    )
    .await?;
    tracing::info!(prefix = subjects.prefix(), "chat-gate ready");
    Ok(RunningGate {
        gate,
        http,
        server,
        tasks,
        tasks_stop,
        nats,
        grace: config.common.shutdown_grace,
    })
}

/// Runs until `shutdown`, then stops gracefully.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), StartError> {
    start(config, shutdown).await?.join().await;
    Ok(())
}
