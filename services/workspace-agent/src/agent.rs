//! The agent process: discovery, the file watcher, publication and the
//! operator HTTP endpoints, wired together.

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_runtime::config::HttpLimits;
use ctxsync_runtime::{HttpServer, Readiness};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::discovery::{self, DiscoveryHandle, DiscoverySettings};
use crate::publisher::{self, PublishError, PublishStatus, Publisher, PublisherConfig};
use crate::report::SharedReport;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub discovery: DiscoverySettings,
    pub publisher: PublisherConfig,
    /// Watch the context files and reload on change.
    pub watch: bool,
    pub watch_debounce: Duration,
    /// Serve `/healthz`, `/readyz`, `/metrics` here when set.
    pub http_addr: Option<SocketAddr>,
    /// Bounds of that listener's connections.
    pub http_limits: HttpLimits,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Publisher(#[from] PublishError),
    #[error(transparent)]
    Http(#[from] ctxsync_runtime::http::BindError),
}

/// A running agent.
pub struct Running {
    run_id: String,
    http: Option<HttpServer>,
    discovery: DiscoveryHandle,
    status: watch::Receiver<PublishStatus>,
    publisher: JoinHandle<()>,
    watcher: Option<JoinHandle<()>>,
}

impl Running {
    /// The run id of this agent process (sent in Startup and every push).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(HttpServer::local_addr)
    }

    /// The current report (what the next push sends).
    pub fn reports(&self) -> watch::Receiver<SharedReport> {
        self.discovery.reports()
    }

    /// What publication has achieved.
    pub fn publish_status(&self) -> watch::Receiver<PublishStatus> {
        self.status.clone()
    }

    /// Reloads the context now, as a file change would.
    pub fn reload(&self) {
        self.discovery.reload();
    }

    /// Waits for the agent to stop after shutdown: publication ends, every MCP
    /// connection is closed, in-flight HTTP requests finish.
    pub async fn join(self) {
        let _ = self.publisher.await;
        if let Some(watcher) = self.watcher {
            let _ = watcher.await;
        }
        self.discovery.join().await;
        if let Some(http) = self.http {
            http.join().await;
        }
    }
}

/// Starts discovery, the watcher, publication and HTTP; returns once started.
pub async fn start(
    config: AgentConfig,
    shutdown: CancellationToken,
) -> Result<Running, AgentError> {
    // Before anything records: every series described and present from the start.
    ctxsync_runtime::metrics::init(
        "workspace-agent",
        env!("CARGO_PKG_VERSION"),
        crate::series::SERIES,
    );
    let run_id = uuid::Uuid::new_v4().to_string();
    let publisher = Publisher::new(&config.publisher, run_id.clone())?;
    let (status_tx, status_rx) = watch::channel(PublishStatus::default());

    let http = match config.http_addr {
        Some(addr) => {
            let status = status_rx.clone();
            let readiness = Readiness::new().with_check("startup", move || {
                let started = status.borrow().started;
                async move {
                    if started {
                        Ok(())
                    } else {
                        Err("startup not answered yet".to_owned())
                    }
                }
            });
            Some(
                HttpServer::start(
                    addr,
                    config.http_limits.clone(),
                    axum::Router::new(),
                    readiness,
                    shutdown.clone(),
                )
                .await?,
            )
        }
        None => None,
    };

    tracing::info!(
        agent_run_id = %run_id,
        ingest_url = %config.publisher.ingest_url,
        working_dir = config.discovery.working_dir.as_deref().map(|dir| tracing::field::display(dir.display())),
        "workspace agent starting"
    );
    let discovery = discovery::start(config.discovery.clone(), shutdown.clone());
    let watcher = if config.watch {
        match crate::watch::spawn(
            discovery.context_config(),
            config.watch_debounce,
            discovery.reload_sender(),
            shutdown.clone(),
        ) {
            Ok(task) => Some(task),
            Err(error) => {
                tracing::warn!(%error, "cannot watch the context files; changes need a restart");
                None
            }
        }
    } else {
        None
    };
    let publisher = tokio::spawn(publisher::run(
        publisher,
        discovery.reports(),
        status_tx,
        shutdown,
    ));
    Ok(Running {
        run_id,
        http,
        discovery,
        status: status_rx,
        publisher,
        watcher,
    })
}

/// `start`, then wait for shutdown.
pub async fn run(config: AgentConfig, shutdown: CancellationToken) -> Result<(), AgentError> {
    let running = start(config, shutdown).await?;
    running.join().await;
    Ok(())
}
