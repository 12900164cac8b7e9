//! Shared server processes: a server configured `processes: shared` runs as
//! one process (or a pool of at most `shared_pool`) for all its tenant's
//! sessions, started on the first call that needs one and stopped after
//! `shared_idle` with no session attached.
//!
//! A session attaches to the member with the fewest sessions; a new member
//! starts only while every member has a session and the pool is not full.
//! Starts of one server are serialized (the pool's lock is held through the
//! start), so concurrent first calls share the one process they start.
//! A session's slot holds the member's connection like its own; ending the
//! session only lets go of it, and the pool stops it once idle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use catalog_core::tools::Catalog;
use ctxsync_mcp::Connection;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

use crate::config::{ConfiguredServer, ServerKey};
use crate::discovery::OpenServer;
use crate::processes::Place;

/// Change notices of one connection, as many sessions can follow them:
/// every `tools/list_changed` the server sends becomes one `()`.
pub(crate) fn notices(mut tools_changed: mpsc::UnboundedReceiver<String>) -> broadcast::Sender<()> {
    let (sender, _) = broadcast::channel(16);
    let forward = sender.clone();
    tokio::spawn(async move {
        while tools_changed.recv().await.is_some() {
            let _ = forward.send(());
        }
    });
    sender
}

struct Member {
    connection: Arc<Connection>,
    notices: broadcast::Sender<()>,
    /// Since when no session holds it.
    idle_since: Option<Instant>,
    /// Its place under the replica's process bound.
    _place: Option<Place>,
}

impl Member {
    fn sessions(&self) -> usize {
        Arc::strong_count(&self.connection) - 1
    }
}

type Pool = Arc<tokio::sync::Mutex<Vec<Member>>>;

/// A session's hold on a shared process.
pub(crate) struct Attached {
    pub connection: Arc<Connection>,
    pub notices: broadcast::Receiver<()>,
    /// Set when this attach started the process: its live catalog and handshake time.
    pub started: Option<(Arc<Catalog>, Duration)>,
}

/// The shared processes of this replica, by server.
pub(crate) struct SharedServers {
    pools: Mutex<HashMap<ServerKey, Pool>>,
    idle: Duration,
}

impl SharedServers {
    pub fn new(idle: Duration) -> Self {
        Self {
            pools: Mutex::default(),
            idle,
        }
    }

    fn pool(&self, key: &ServerKey) -> Pool {
        self.pools
            .lock()
            .expect("shared pools lock")
            .entry(key.clone())
            .or_default()
            .clone()
    }

    /// A process of `server` for a session: the least used member, or one
    /// `start` starts (with its place under the bound) while the pool has room.
    pub async fn attach<E, Fut>(
        &self,
        server: &ConfiguredServer,
        start: impl FnOnce() -> Fut,
    ) -> Result<Attached, E>
    where
        Fut: Future<Output = Result<(OpenServer, Option<Place>), E>>,
    {
        let pool = self.pool(&server.key);
        let mut members = pool.lock().await;
        // A member whose server went away is dropped (its drop kills what is left).
        members.retain(|m| !m.connection.is_closed());
        let least = members
            .iter()
            .enumerate()
            .min_by_key(|(_, m)| m.sessions())
            .map(|(at, m)| (at, m.sessions()));
        let full = members.len() >= server.config.shared_pool;
        if let Some((at, sessions)) = least
            && (sessions == 0 || full)
        {
            let member = &mut members[at];
            member.idle_since = None;
            return Ok(Attached {
                connection: member.connection.clone(),
                notices: member.notices.subscribe(),
                started: None,
            });
        }
        let (open, place) = start().await?;
        let notices = notices(open.tools_changed);
        let connection = Arc::new(open.connection);
        members.push(Member {
            connection: connection.clone(),
            notices: notices.clone(),
            idle_since: None,
            _place: place,
        });
        metrics::gauge!("ctxsync_catalog_shared_processes").increment(1.0);
        tracing::info!(tenant = %server.tenant, server = server.id(), pool = members.len(), "shared server started");
        Ok(Attached {
            connection,
            notices: notices.subscribe(),
            started: Some((open.catalog, open.duration)),
        })
    }

    fn pools(&self) -> Vec<Pool> {
        self.pools
            .lock()
            .expect("shared pools lock")
            .values()
            .cloned()
            .collect()
    }

    /// Shared processes running now.
    pub fn running(&self) -> usize {
        self.pools()
            .iter()
            .map(|pool| pool.try_lock().map(|m| m.len()).unwrap_or(0))
            .sum()
    }

    /// Stops the members no session held for the idle time (`all`: every
    /// member, at shutdown); returns how many.
    pub async fn stop_idle(&self, all: bool) -> usize {
        let mut stopped = Vec::new();
        for pool in self.pools() {
            let mut members = pool.lock().await;
            let now = Instant::now();
            let mut kept = Vec::with_capacity(members.len());
            for mut member in members.drain(..) {
                let idle = member.sessions() == 0;
                member.idle_since = match member.idle_since {
                    Some(since) if idle => Some(since),
                    _ if idle => Some(now),
                    _ => None,
                };
                let expired = member
                    .idle_since
                    .is_some_and(|since| now.duration_since(since) >= self.idle);
                if all || expired {
                    stopped.push(member);
                } else {
                    kept.push(member);
                }
            }
            *members = kept;
        }
        let count = stopped.len();
        for member in stopped {
            metrics::gauge!("ctxsync_catalog_shared_processes").decrement(1.0);
            match Arc::try_unwrap(member.connection) {
                Ok(connection) => connection.close().await,
                // A session still holds it (shutdown): its drop kills the server.
                Err(shared) => drop(shared),
            }
        }
        count
    }
}

/// Stops idle shared processes until shutdown, then all of them.
pub(crate) fn spawn_reaper(
    shared: Arc<SharedServers>,
    shutdown: ctxsync_runtime::Shutdown,
) -> JoinHandle<()> {
    let periodic = crate::sessions::spawn_periodic(shared.idle, shutdown, {
        let shared = shared.clone();
        move || {
            let shared = shared.clone();
            async move {
                let stopped = shared.stop_idle(false).await;
                if stopped > 0 {
                    tracing::info!(stopped, "idle shared servers stopped");
                }
            }
        }
    });
    tokio::spawn(async move {
        let _ = periodic.await;
        shared.stop_idle(true).await;
    })
}
