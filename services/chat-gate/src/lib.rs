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
//!
//! The decisions live in [`core`] (the `gate-core` crate, which depends on
//! no transport, so it touches neither NATS nor HTTP); [`nats`] and [`http`]
//! (with the tenant keys of [`ctxsync_runtime::tenant_keys`]) are adapters
//! around it, and this file wires them up.

pub use gate_core as core;
pub mod http;
pub mod nats;
pub mod page;
pub mod series;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ctxsync_proto::rpc::Rpc as _;
use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::{CommonArgs, HttpServer, Readiness, Shutdown, tenant_keys};
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use gate_core::{Gate, GateSettings};

/// chat-gate's configuration: its flags (see [`CommonArgs`] on `Serialize`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct Config {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonArgs,

    /// The Hosts and Origins the API and the context page answer
    /// (DNS-rebinding defence; `/healthz`, `/readyz`, `/metrics` answer any).
    #[command(flatten)]
    #[serde(flatten)]
    pub browsers: ctxsync_runtime::http::browsers::BrowserArgs,

    /// How long a first turn waits for a PENDING discovery of the current agent process.
    #[arg(long, env = "CTXSYNC_GATE_PENDING_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub pending_timeout: Duration,

    /// How long a first turn waits when the current process has not reported
    /// yet (no snapshot, or only a previous process's).
    #[arg(long, env = "CTXSYNC_GATE_STALE_GRACE", default_value = "3s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub stale_grace: Duration,

    /// Bound of one read from snapshot-store; past it the turn fails open.
    #[arg(long, env = "CTXSYNC_GATE_STORE_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub store_timeout: Duration,

    /// How long a chat's timed-out wait is remembered, so its later turns don't wait again.
    #[arg(long, env = "CTXSYNC_GATE_ATTEMPT_TTL", default_value = "10m", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub attempt_ttl: Duration,

    /// Bound of a first turn's catalog preparation; past it the turn proceeds
    /// and the projection says the catalog is unavailable.
    #[arg(long, env = "CTXSYNC_GATE_CATALOG_TIMEOUT", default_value = "12s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
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
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub view_ttl: Duration,

    /// Safety net only: re-read every waited-on agent this often in case an
    /// event was lost without a reconnect. Waits end on events, not on this.
    /// 0 disables it.
    #[arg(long, env = "CTXSYNC_GATE_SWEEP_INTERVAL", default_value = "2m", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
    pub sweep_interval: Duration,

    /// Context-page event streams open at once with one tenant key; past it
    /// a stream is refused with 429.
    #[arg(long, env = "CTXSYNC_GATE_MAX_STREAMS_PER_KEY", default_value_t = 8)]
    pub max_streams_per_key: usize,

    /// Context-page event streams open at once for one tenant (all its keys).
    #[arg(
        long,
        env = "CTXSYNC_GATE_MAX_STREAMS_PER_TENANT",
        default_value_t = 32
    )]
    pub max_streams_per_tenant: usize,

    /// Unredeemed event tickets one tenant holds at once.
    #[arg(
        long,
        env = "CTXSYNC_GATE_MAX_TICKETS_PER_TENANT",
        default_value_t = 32
    )]
    pub max_tickets_per_tenant: usize,
}

/// The flags' defaults.
impl Default for Config {
    fn default() -> Self {
        ctxsync_runtime::args::defaults()
    }
}

impl Config {
    /// The defaults, on the given NATS server and prefix (for tests and embedding).
    pub fn new(common: CommonArgs) -> Self {
        Self {
            common,
            ..Self::default()
        }
    }

    /// The context page's bounds, checked.
    pub fn page_limits(&self) -> Result<page::PageLimits, StartError> {
        for (env, value) in [
            ("CTXSYNC_GATE_MAX_STREAMS_PER_KEY", self.max_streams_per_key),
            (
                "CTXSYNC_GATE_MAX_STREAMS_PER_TENANT",
                self.max_streams_per_tenant,
            ),
            (
                "CTXSYNC_GATE_MAX_TICKETS_PER_TENANT",
                self.max_tickets_per_tenant,
            ),
        ] {
            if value == 0 {
                return Err(StartError::Setting {
                    env,
                    value: "0".into(),
                    reason: "must be above zero (the context page needs one)",
                });
            }
        }
        Ok(page::PageLimits {
            streams_per_key: self.max_streams_per_key,
            streams_per_tenant: self.max_streams_per_tenant,
            tickets_per_tenant: self.max_tickets_per_tenant,
        })
    }

    /// The gate core's settings, checked.
    pub fn settings(&self) -> Result<GateSettings, StartError> {
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
            views: gate_core::ViewLimits {
                max_views: self.max_views,
                idle_ttl: self.view_ttl,
            },
            drain: gate_core::drain_window(self.common.shutdown_grace),
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
    server: nats::TurnServer,
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
        let events = self.server.join().await;
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

async fn subscribe(
    nats: &NatsConnection,
    subject: String,
) -> Result<async_nats::Subscriber, StartError> {
    Ok(ctxsync_runtime::nats::subscribe(nats, subject, None).await?)
}

/// Connects, subscribes to the events, then starts serving turns.
pub async fn start(config: Config, shutdown: Shutdown) -> Result<RunningGate, StartError> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init("chat-gate", env!("CARGO_PKG_VERSION"), series::SERIES);
    let subjects: Subjects = config.common.subjects()?;
    let http_limits = config.common.http.limits()?;
    let settings = config.settings()?;
    let page_limits = config.page_limits()?;
    let nats = ctxsync_runtime::nats::connect(&config.common, "chat-gate").await?;
    let store = nats::StoreReader::new(&nats, &subjects, settings.store_timeout);
    let page_reader = store.clone();
    let mut gate = Gate::new(settings, Arc::new(store), shutdown.clone()).with_announcer(
        nats::announcer(nats.client.clone(), subjects.gate_turn_waited()),
    );
    let page_catalog = config
        .catalog
        .then(|| nats::CatalogClient::new(nats.client.clone(), &subjects, config.catalog_timeout));
    if let Some(catalog) = &page_catalog {
        gate = gate.with_catalog(Arc::new(catalog.clone()));
    }

    let keys = tenant_keys::TenantKeys::new(
        nats.client.clone(),
        &subjects,
        config.store_timeout,
        "ctxsync_gate_auth_total",
    );

    // The event subscriptions are in place (confirmed by a round trip, not
    // just written) before the first turn is served. They share the turns'
    // connection (the responder's, when one is configured): events
    // delivered before a turn are applied before it (`nats::turns`).
    let events = nats.responder();
    let discovery = subscribe(events, subjects.discovery_changed_all()).await?;
    let snapshots = subscribe(events, subjects.snapshot_committed_all()).await?;
    let revocations = subscribe(events, subjects.tenant_key_revoked()).await?;
    let tasks_stop = gate.drained().child_token();
    let tasks = vec![
        nats::events::recheck_after_gaps(gate.clone(), keys.clone(), events, tasks_stop.clone()),
        gate.spawn_housekeeping(config.sweep_interval, tasks_stop.clone()),
        tenant_keys::spawn_follow(keys.clone(), revocations, events, tasks_stop.clone()),
    ];

    // The context page's live streams (`page`), fed with the applied events.
    let page_feed: nats::events::PageFeed = tokio::sync::broadcast::channel(1024).0;
    let server = nats::TurnServer::start(
        &nats,
        nats::TurnServing {
            subject: ctxsync_proto::rpc::gate::Turn::served(&subjects),
            max_in_flight: config.max_turns,
            grace: config.common.shutdown_grace,
            waits_subject: subjects.gate_turn_waited(),
        },
        gate.clone(),
        nats::events::apply_events(gate.clone(), discovery, snapshots, page_feed.clone()),
        shutdown.clone(),
    )
    .await?;

    let readiness = Readiness::new().with_nats(&nats);
    let http = HttpServer::start(
        config.common.http_addr,
        http_limits,
        ctxsync_runtime::http::browsers::guarded(
            http::routes(gate.clone(), keys.clone()).merge(page::routes({
                let page = page::Page::new(
                    keys,
                    nats::AgentLister::new(nats.client.clone(), &subjects, config.store_timeout),
                    page_reader,
                    page_feed,
                    page_limits,
                    shutdown.clone(),
                );
                match page_catalog {
                    Some(catalog) => page.with_catalog(catalog),
                    None => page,
                }
            })),
            &config.browsers,
        ),
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
