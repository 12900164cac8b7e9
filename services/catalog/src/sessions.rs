//! Sessions in this process: their pins (loaded once from the store) and,
//! per pinned server, the transport a call opened, which stays open until
//! the session ends, idles, or the service shuts down.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use catalog_core::pins::ServerUse;
use catalog_core::tools::{CatalogDiff, Item};
use ctxsync_mcp::Connection;
use sqlx::PgPool;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

use crate::processes::Place;
use crate::store::{self, StoredPin};

/// What a session's open servers withdrew since the pin, as
/// `(server, tool or prompt name)` and `(server, resource URI)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Withdrawn {
    pub tools: BTreeSet<(String, String)>,
    pub prompts: BTreeSet<(String, String)>,
    pub resources: BTreeSet<(String, String)>,
}

/// How long listing a session's withdrawals waits for a busy server slot.
const WITHDRAWN_LOCK_WAIT: Duration = Duration::from_secs(2);

type SessionKey = (String, String);

/// Sessions with loaded pins and possibly open transports.
#[derive(Default)]
pub(crate) struct Sessions {
    inner: Mutex<HashMap<SessionKey, Arc<Session>>>,
}

impl Sessions {
    /// The session, its pins loaded from the store the first time; `None`
    /// if it was never prepared.
    pub async fn get_or_load(
        &self,
        pool: &PgPool,
        tenant: &str,
        session_id: &str,
    ) -> Result<Option<Arc<Session>>, sqlx::Error> {
        let key = (tenant.to_owned(), session_id.to_owned());
        if let Some(session) = self.inner.lock().expect("sessions lock").get(&key) {
            return Ok(Some(session.clone()));
        }
        let Some(pins) = store::load_pins(pool, tenant, session_id).await? else {
            return Ok(None);
        };
        let session = Arc::new(Session {
            pins: pins.into_iter().map(|p| (p.server_id.clone(), p)).collect(),
            servers: Mutex::default(),
            last_used: Mutex::new(Instant::now()),
            in_flight: AtomicUsize::new(0),
            changes: watch::channel(0).0,
        });
        let mut inner = self.inner.lock().expect("sessions lock");
        Ok(Some(inner.entry(key).or_insert(session).clone()))
    }

    pub fn open_transports(&self) -> usize {
        let sessions: Vec<_> = self
            .inner
            .lock()
            .expect("sessions lock")
            .values()
            .cloned()
            .collect();
        sessions.iter().map(|s| s.open_transports()).sum()
    }

    /// The pinned tools, prompts and resources of a session that its open
    /// transports found removed or changed since the pin.
    pub async fn withdrawn(&self, tenant: &str, session_id: &str) -> Withdrawn {
        let session = self
            .inner
            .lock()
            .expect("sessions lock")
            .get(&(tenant.to_owned(), session_id.to_owned()))
            .cloned();
        match session {
            Some(session) => session.withdrawn().await,
            None => Withdrawn::default(),
        }
    }

    /// Forgets the session and closes its transports; returns how many.
    pub async fn end(&self, tenant: &str, session_id: &str) -> u32 {
        let session = self
            .inner
            .lock()
            .expect("sessions lock")
            .remove(&(tenant.to_owned(), session_id.to_owned()));
        match session {
            Some(session) => session.release().await,
            None => 0,
        }
    }

    pub async fn release_all(&self) -> u32 {
        let sessions: Vec<_> = self
            .inner
            .lock()
            .expect("sessions lock")
            .drain()
            .map(|(_, s)| s)
            .collect();
        let mut released = 0;
        for session in sessions {
            released += session.release().await;
        }
        released
    }

    /// Releases sessions idle for longer than `idle`.
    async fn release_idle(&self, idle: Duration) -> u32 {
        let idle_sessions: Vec<_> = {
            let mut inner = self.inner.lock().expect("sessions lock");
            let keys: Vec<SessionKey> = inner
                .iter()
                .filter(|(_, s)| {
                    s.in_flight.load(Ordering::SeqCst) == 0
                        && s.last_used.lock().expect("session lock").elapsed() >= idle
                })
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter().filter_map(|k| inner.remove(&k)).collect()
        };
        let mut released = 0;
        for session in idle_sessions {
            released += session.release().await;
        }
        released
    }
}

/// Releases sessions idle for `idle` until shutdown.
pub(crate) fn spawn_reaper(
    sessions: Arc<Sessions>,
    idle: Duration,
    shutdown: ctxsync_runtime::Shutdown,
) -> JoinHandle<()> {
    spawn_periodic(idle, shutdown, move || {
        let sessions = sessions.clone();
        async move {
            let released = sessions.release_idle(idle).await;
            if released > 0 {
                tracing::info!(released, "idle session transports closed");
            }
        }
    })
}

/// Runs `tick` a few times per `period` (within 10 ms to 30 s) until shutdown.
pub(crate) fn spawn_periodic<F, Fut>(
    period: Duration,
    shutdown: ctxsync_runtime::Shutdown,
    mut tick: F,
) -> JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let every = (period / 4).clamp(Duration::from_millis(10), Duration::from_secs(30));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = ticks.tick() => {}
            }
            tick().await;
        }
    })
}

pub(crate) struct Session {
    pins: HashMap<String, StoredPin>,
    servers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Slot>>>>,
    last_used: Mutex<Instant>,
    in_flight: AtomicUsize,
    /// Bumped whenever an open server says its tools changed.
    changes: watch::Sender<u64>,
}

impl Session {
    /// Changes whenever one of the session's open servers says its tools changed.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// What a server opened for this session bumps when its tools change.
    pub fn change_signal(&self) -> watch::Sender<u64> {
        self.changes.clone()
    }

    /// The slots of the servers the session has used, by server.
    fn slots(&self) -> Vec<(String, Arc<tokio::sync::Mutex<Slot>>)> {
        self.servers
            .lock()
            .expect("session lock")
            .iter()
            .map(|(server, slot)| (server.clone(), slot.clone()))
            .collect()
    }

    /// The open servers that said their tools changed since the last look.
    pub fn servers_changed(&self) -> Vec<String> {
        self.slots()
            .into_iter()
            .filter(|(_, slot)| {
                slot.try_lock()
                    .map(|s| s.live.as_ref().is_some_and(LiveServer::has_tools_changed))
                    .unwrap_or(true)
            })
            .map(|(server, _)| server)
            .collect()
    }

    pub fn pin(&self, server_id: &str) -> Option<&StoredPin> {
        self.pins.get(server_id)
    }

    /// The ids of the servers with a slot (opened at least once).
    pub fn opened_servers(&self) -> Vec<String> {
        self.servers
            .lock()
            .expect("servers lock")
            .keys()
            .cloned()
            .collect()
    }

    /// Runs `call` as a call in flight: the session is not idle meanwhile.
    pub async fn in_flight<T>(&self, call: impl Future<Output = T>) -> T {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        let result = call.await;
        self.touch();
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// The state of one pinned server in this session.
    pub fn slot(&self, server_id: &str) -> Arc<tokio::sync::Mutex<Slot>> {
        self.servers
            .lock()
            .expect("session lock")
            .entry(server_id.to_owned())
            .or_default()
            .clone()
    }

    fn touch(&self) {
        *self.last_used.lock().expect("session lock") = Instant::now();
    }

    async fn withdrawn(&self) -> Withdrawn {
        let mut withdrawn = Withdrawn::default();
        for (server, slot) in self.slots() {
            let Some(pin) = self.pins.get(&server) else {
                continue;
            };
            // A slot busy with a re-list (after the server said its tools
            // changed) is waited for, so a list right after it sees the
            // withdrawal; one busy longer (a long call) is looked at on the
            // next list.
            let Ok(slot) = tokio::time::timeout(WITHDRAWN_LOCK_WAIT, slot.lock()).await else {
                continue;
            };
            if let Some(live) = &slot.live {
                let catalog = &pin.catalog;
                let of = |item: Item<'_>| {
                    live.diff
                        .withdraws_item(item)
                        .then(|| (server.clone(), item.key().to_owned()))
                };
                let tools = catalog.tools.iter().map(|t| Item::Tool(&t.name));
                withdrawn.tools.extend(tools.filter_map(of));
                let prompts = catalog.prompts.iter().map(|p| Item::Prompt(&p.name));
                withdrawn.prompts.extend(prompts.filter_map(of));
                let resources = catalog.resources.iter().map(|r| Item::Resource(&r.uri));
                withdrawn.resources.extend(resources.filter_map(of));
            }
        }
        withdrawn
    }

    /// Closes every open transport; returns how many there were.
    async fn release(&self) -> u32 {
        let slots: Vec<_> = self
            .servers
            .lock()
            .expect("session lock")
            .drain()
            .map(|(_, slot)| slot)
            .collect();
        let mut released = 0;
        for slot in slots {
            if let Some(live) = slot.lock().await.live.take() {
                released += 1;
                close(live.connection).await;
            }
        }
        released
    }

    fn open_transports(&self) -> usize {
        self.servers
            .lock()
            .expect("session lock")
            .values()
            .filter(|slot| slot.try_lock().map(|s| s.live.is_some()).unwrap_or(true))
            .count()
    }
}

/// One server of one session.
#[derive(Default)]
pub(crate) struct Slot {
    live: Option<LiveServer>,
    /// Its calls in this session and the change last reported (the core's).
    server_use: ServerUse,
}

impl Slot {
    /// Counts a call; returns whether it is the server's first in the session.
    pub fn count_call(&mut self, pin: &StoredPin) -> bool {
        self.server_use.count_call(pin)
    }

    pub fn server_use(&self) -> &ServerUse {
        &self.server_use
    }

    /// The change to `hash` is stored and reported.
    pub fn reported(&mut self, hash: &str) {
        self.server_use.reported(hash);
    }

    /// Closes the transport if its server has gone (the call reconnects).
    pub async fn close_if_gone(&mut self) {
        if self.live.as_ref().is_some_and(|l| l.connection.is_closed())
            && let Some(dead) = self.live.take()
        {
            close(dead.connection).await;
        }
    }

    /// The open transport.
    pub fn live(&mut self) -> Option<&mut LiveServer> {
        self.live.as_mut()
    }

    pub fn open(&mut self, live: LiveServer) -> &mut LiveServer {
        metrics::gauge!("ctxsync_catalog_open_transports").increment(1.0);
        self.live.insert(live)
    }

    /// The transport of `connection` broke: it is closed, the next call reconnects.
    pub async fn broken(&mut self, connection: Arc<Connection>) {
        if self
            .live
            .as_ref()
            .is_some_and(|l| Arc::ptr_eq(&l.connection, &connection))
            && let Some(dead) = self.live.take()
        {
            drop(connection);
            close(dead.connection).await;
        }
    }
}

/// A server's open transport in a session and how its tools differ from the pin.
pub(crate) struct LiveServer {
    connection: Arc<Connection>,
    diff: CatalogDiff,
    /// Set when the server says its tools changed; cleared by a look.
    tools_changed: Arc<AtomicBool>,
    /// The process's place under the replica's bound, released with it.
    _place: Option<Place>,
}

impl LiveServer {
    /// `notices` (the server's `tools/list_changed`) are followed until the
    /// server closes them: each sets the flag and bumps `signal` (the session's).
    pub fn new(
        connection: Arc<Connection>,
        diff: CatalogDiff,
        mut notices: broadcast::Receiver<()>,
        signal: watch::Sender<u64>,
        place: Option<Place>,
    ) -> Self {
        let flag = Arc::new(AtomicBool::new(false));
        tokio::spawn({
            let flag = flag.clone();
            async move {
                // A lagged receiver missed notices, not the change.
                while let Ok(()) | Err(broadcast::error::RecvError::Lagged(_)) =
                    notices.recv().await
                {
                    flag.store(true, Ordering::SeqCst);
                    signal.send_modify(|n| *n += 1);
                }
            }
        });
        Self {
            connection,
            diff,
            tools_changed: flag,
            _place: place,
        }
    }

    /// Whether its server has gone (the transport closed).
    pub fn is_closed(&self) -> bool {
        self.connection.is_closed()
    }

    /// Whether the server said its tools changed since the last look, without looking.
    pub fn has_tools_changed(&self) -> bool {
        self.tools_changed.load(Ordering::SeqCst)
    }

    pub fn connection(&self) -> Arc<Connection> {
        self.connection.clone()
    }

    pub fn diff(&self) -> &CatalogDiff {
        &self.diff
    }

    pub fn set_diff(&mut self, diff: CatalogDiff) {
        self.diff = diff;
    }

    /// Whether the server said its tools changed since the last look.
    pub fn tools_changed(&mut self) -> bool {
        self.tools_changed.swap(false, Ordering::SeqCst)
    }
}

/// Graceful close if no call still holds the connection; otherwise the last
/// holder's drop kills the server.
async fn close(connection: Arc<Connection>) {
    match Arc::try_unwrap(connection) {
        Ok(connection) => connection.close().await,
        Err(shared) => drop(shared),
    }
    metrics::gauge!("ctxsync_catalog_open_transports").decrement(1.0);
}
