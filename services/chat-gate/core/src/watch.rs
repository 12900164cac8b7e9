//! Views of agents: one in-memory watch per agent, kept current by the
//! store's events, never by a polling loop.
//!
//! A watch is created by the first turn that asks about an agent. Until a
//! state shows that the agent exists (a read found it, or an event carried
//! it) the watch is a *lookup*: it holds one of a bounded number of lookup
//! slots and goes away with its last turn, so ids of agents that don't exist
//! leave nothing behind. Once the agent is known to exist the watch is a
//! *view*: it stays after its last turn ends, idle, until it expires or is
//! evicted (views are bounded separately, so lookups never evict them). Events
//! carry the state they committed, so a watch applies them without a read;
//! states are ordered by the agent's revision, so a late or repeated event
//! never moves a view back. An event too large to carry its state asks for a
//! read instead. Reads are made by the watch's reader task, one at a time,
//! and published with the sequence number of the read.
//!
//! A view is *fresh* when a read that started after the watch was created
//! succeeded and every event since then was applied, all within one NATS
//! gap epoch (see [`StateSource::gaps`]). A fresh
//! view answers without a read; anything else reads first. Freshness ends at
//! a disconnect, a reconnect, a slow-consumer drop, or an event without state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use ctxsync_proto::v1::{AgentState, ChatProjection};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::projection::{self, Readiness};
use crate::source::{ReadError, StateSource};

/// Retries of a failed read (one is only made while someone waits): short
/// first (a store that reconnects after a NATS restart is back within a
/// second), doubling, then capped.
pub const RETRY_MIN: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(1);

/// The delays before each retry of a failed read, from [`RETRY_MIN`]
/// doubling up to [`RETRY_MAX`], without end (the reader stops with its
/// watch) and without jitter, as before. A pure iterator: the reader sleeps
/// on tokio's clock, which tests pause.
pub fn retry_delays() -> ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(RETRY_MIN)
        .with_factor(2.0)
        .with_max_delay(RETRY_MAX)
        .without_max_times()
        .build()
}

/// One state of an agent and its projection, shared by every waiter.
#[derive(Debug)]
pub struct View {
    pub state: AgentState,
    pub readiness: Readiness,
    /// Built once per state; answers clone it and add their summary.
    pub projection: ChatProjection,
    /// Commit time of the event that brought this state, for the wake latency.
    pub woken_by_commit: Option<SystemTime>,
}

impl View {
    pub fn new(agent_id: &str, state: AgentState, woken_by_commit: Option<SystemTime>) -> Self {
        Self {
            readiness: Readiness::of(&state),
            projection: projection::build(agent_id, &state),
            state,
            woken_by_commit,
        }
    }

    /// The tenant the agent was registered under.
    pub fn tenant(&self) -> &str {
        self.state
            .agent
            .as_ref()
            .map(|a| a.tenant.as_str())
            .unwrap_or_default()
    }

    pub fn agent_run_id(&self) -> &str {
        self.state
            .agent
            .as_ref()
            .map(|a| a.agent_run_id.as_str())
            .unwrap_or_default()
    }

    pub fn revision(&self) -> u64 {
        self.state.revision
    }
}

/// The newest view after a read, with the order in which that read started.
#[derive(Debug, Clone, Default)]
pub struct Published {
    pub seq: u64,
    pub result: Option<Result<Arc<View>, ReadError>>,
}

/// What an event says about an agent after its commit.
#[derive(Debug, Clone)]
pub struct EventUpdate {
    pub revision: u64,
    /// The committed state; absent when it was over the store's event limit.
    pub state: Option<AgentState>,
    pub committed_at: Option<SystemTime>,
}

impl EventUpdate {
    pub fn new(revision: u64, state: Option<AgentState>, committed_at: Option<SystemTime>) -> Self {
        Self {
            revision,
            state,
            committed_at,
        }
    }
}

#[derive(Default)]
struct ReadState {
    /// A read was asked for and has not started: anything asking now is covered by it.
    requested: bool,
    reading: bool,
    /// Newest revision announced without its state during the read in
    /// flight: read again unless that read shows it.
    announced: u64,
    /// Read again after the read in flight whatever it shows (a gap, a sweep).
    force: bool,
    /// Commit time of the newest stateless event not yet covered by a started read.
    commit_at: Option<SystemTime>,
    latest: Option<Arc<View>>,
    /// Sequence number of the last finished read.
    finished: u64,
    /// The gap epoch within which `latest` is fresh, if it is.
    fresh_in: Option<u64>,
}

impl ReadState {
    fn shows(&self, revision: u64) -> bool {
        self.latest
            .as_ref()
            .is_some_and(|v| v.revision() >= revision)
    }
}

pub struct AgentWatch {
    agent_id: String,
    holders: AtomicUsize,
    /// A state showed the agent exists (only set under the watches lock; never unset).
    exists: AtomicBool,
    /// The lookup slot held until the agent is known to exist or the watch goes.
    lookup: Mutex<Option<OwnedSemaphorePermit>>,
    /// When the last holder left (only read and written under the watches lock).
    idle_since: Mutex<Option<Instant>>,
    refresh: Notify,
    started: AtomicU64,
    views: watch::Sender<Published>,
    state: Mutex<ReadState>,
    stop: CancellationToken,
}

impl AgentWatch {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReadState> {
        self.state.lock().expect("watch state lock")
    }

    /// Asks for a read that starts after this call. Asks made before the
    /// reader picks a request up share that one read.
    fn request_read(&self) {
        let mut state = self.lock();
        if state.reading {
            state.force = true;
        } else if !state.requested {
            state.requested = true;
            drop(state);
            self.refresh.notify_one();
        }
    }

    /// Applies an event; returns the view it published, if it brought one.
    fn on_event(&self, update: EventUpdate) -> Option<Arc<View>> {
        if self.lock().shows(update.revision) {
            return None;
        }
        match update.state {
            Some(state) => {
                // Built outside the lock: a projection of a large state takes a while.
                let view = Arc::new(View::new(&self.agent_id, state, update.committed_at));
                let mut state = self.lock();
                if state.shows(view.revision()) {
                    return None;
                }
                state.latest = Some(view.clone());
                // Published under the lock, so views never go out of order.
                self.views.send_replace(Published {
                    seq: state.finished,
                    result: Some(Ok(view.clone())),
                });
                drop(state);
                metrics::counter!("ctxsync_gate_view_updates_total", "source" => "event")
                    .increment(1);
                Some(view)
            }
            None => {
                let mut state = self.lock();
                if state.shows(update.revision) {
                    return None;
                }
                if update.committed_at.is_some() {
                    state.commit_at = update.committed_at;
                }
                if state.reading {
                    state.announced = state.announced.max(update.revision);
                    return None;
                }
                state.fresh_in = None;
                if self.holders.load(Ordering::SeqCst) > 0 && !state.requested {
                    state.requested = true;
                    drop(state);
                    self.refresh.notify_one();
                }
                None
            }
        }
    }

    /// A gap or a sweep: the view is no longer trusted; a held one is re-read.
    fn distrust(&self) -> bool {
        self.lock().fresh_in = None;
        let held = self.holders.load(Ordering::SeqCst) > 0;
        if held {
            self.request_read();
        }
        held
    }

    async fn reader(
        self: Arc<Self>,
        watches: Weak<WatchesInner>,
        source: Arc<dyn StateSource>,
        reads: Arc<AtomicU64>,
        gaps: watch::Receiver<u64>,
    ) {
        let mut retry_at: Option<Instant> = None;
        let mut delays = retry_delays();
        loop {
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = self.refresh.notified() => {}
                _ = sleep_until_some(retry_at) => {}
            }
            retry_at = None;
            let epoch = *gaps.borrow();
            let commit_at = {
                let mut state = self.lock();
                state.requested = false;
                state.reading = true;
                state.force = false;
                state.announced = 0;
                state.commit_at.take()
            };
            let seq = self.started.fetch_add(1, Ordering::SeqCst) + 1;
            reads.fetch_add(1, Ordering::Relaxed);
            let result = source.read(&self.agent_id).await;
            // Before the view is published: whoever sees it sees a view, not a lookup.
            if result.is_ok()
                && let Some(watches) = watches.upgrade()
            {
                watches.confirm(&self);
            }
            let again = {
                let mut state = self.lock();
                state.reading = false;
                state.finished = seq;
                let again = match result {
                    Ok(read) => {
                        if !state.shows(read.revision) || state.latest.is_none() {
                            let view = View::new(&self.agent_id, read, commit_at);
                            state.latest = Some(Arc::new(view));
                            metrics::counter!("ctxsync_gate_view_updates_total", "source" => "read")
                                .increment(1);
                        }
                        let again = state.force || !state.shows(state.announced);
                        state.fresh_in = (!again && *gaps.borrow() == epoch).then_some(epoch);
                        delays = retry_delays();
                        self.views.send_replace(Published {
                            seq,
                            result: state.latest.clone().map(Ok),
                        });
                        again
                    }
                    Err(error) => {
                        state.fresh_in = None;
                        if let ReadError::Unavailable(reason) = &error {
                            tracing::debug!(agent_id = %self.agent_id, %reason, "store read failed; retrying while waiters remain");
                            retry_at = delays.next().map(|delay| Instant::now() + delay);
                        }
                        self.views.send_replace(Published {
                            seq,
                            result: Some(Err(error)),
                        });
                        false
                    }
                };
                state.force = false;
                state.announced = 0;
                again
            };
            if again {
                self.request_read();
            }
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// How many views are kept, and for how long after their last turn.
#[derive(Debug, Clone, Copy)]
pub struct ViewLimits {
    /// Views of agents known to exist; past it idle ones are evicted, oldest
    /// first. Also the number of lookups (agents not yet known to exist) at
    /// once: more wait for a slot.
    pub max_views: usize,
    /// An idle watch is dropped this long after its last turn.
    pub idle_ttl: Duration,
}

/// Every watched agent, by id.
#[derive(Clone)]
pub struct Watches {
    inner: Arc<WatchesInner>,
}

struct WatchesInner {
    table: Mutex<Table>,
    /// One slot per lookup: ids that may not exist can't hold more watches than this.
    lookups: Arc<Semaphore>,
    source: Arc<dyn StateSource>,
    /// Reads started so far.
    reads: Arc<AtomicU64>,
    gaps: watch::Receiver<u64>,
    limits: ViewLimits,
}

struct Table {
    agents: HashMap<String, Arc<AgentWatch>>,
    /// How many of `agents` are views (known to exist); the rest are lookups.
    views: usize,
}

impl Table {
    fn holds(&self, watch: &Arc<AgentWatch>) -> bool {
        self.agents
            .get(&watch.agent_id)
            .is_some_and(|held| Arc::ptr_eq(held, watch))
    }

    fn publish_len(&self) {
        metrics::gauge!("ctxsync_gate_views").set(self.agents.len() as f64);
    }
}

impl WatchesInner {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("watches lock")
    }

    /// A state showed the agent exists: its lookup becomes a view (counted
    /// against `max_views`) and frees its lookup slot.
    fn confirm(&self, watch: &Arc<AgentWatch>) {
        if watch.exists.load(Ordering::SeqCst) {
            return;
        }
        let mut table = self.table();
        if watch.exists.swap(true, Ordering::SeqCst) {
            return;
        }
        drop(watch.lookup.lock().expect("lookup lock").take());
        if table.holds(watch) {
            table.views += 1;
            if table.views > self.limits.max_views {
                evict_oldest_idle(&mut table, self.limits.max_views);
            }
        }
    }
}

impl Watches {
    /// Views read from `source`, trusted between changes of its gaps (see the module docs).
    pub fn new(source: Arc<dyn StateSource>, limits: ViewLimits) -> Self {
        let gaps = source.gaps();
        Self {
            inner: Arc::new(WatchesInner {
                table: Mutex::new(Table {
                    agents: HashMap::new(),
                    views: 0,
                }),
                lookups: Arc::new(Semaphore::new(limits.max_views)),
                source,
                reads: Arc::new(AtomicU64::new(0)),
                gaps,
                limits,
            }),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.inner.table()
    }

    /// Registers interest in `agent_id`: its events keep the watch current.
    /// An agent without a watch takes a lookup slot first, waiting at most
    /// `wait` for one.
    pub async fn register(&self, agent_id: &str, wait: Duration) -> Result<Interest, ReadError> {
        let mut slot: Option<OwnedSemaphorePermit> = None;
        loop {
            {
                let mut table = self.table();
                if let Some(watch) = table.agents.get(agent_id).cloned() {
                    return Ok(self.hold(watch));
                }
                if let Some(slot) = slot.take() {
                    let watch = self.insert(&mut table, agent_id, slot);
                    return Ok(self.hold(watch));
                }
            }
            // Taken outside the lock; the agent may have got a watch meanwhile.
            let lookups = self.inner.lookups.clone();
            slot = Some(match lookups.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => match tokio::time::timeout(wait, lookups.acquire_owned()).await {
                    Ok(Ok(slot)) => slot,
                    _ => {
                        metrics::counter!("ctxsync_gate_lookups_refused_total").increment(1);
                        return Err(ReadError::Unavailable(format!(
                            "{} agents not seen before are being looked up at once \
                             (CTXSYNC_GATE_MAX_VIEWS); none finished within {wait:?}",
                            self.inner.limits.max_views
                        )));
                    }
                },
            });
        }
    }

    /// A new watch (a lookup until a state shows the agent exists), under the lock.
    fn insert(
        &self,
        table: &mut Table,
        agent_id: &str,
        slot: OwnedSemaphorePermit,
    ) -> Arc<AgentWatch> {
        let (views, _) = watch::channel(Published::default());
        let watch = Arc::new(AgentWatch {
            agent_id: agent_id.to_owned(),
            holders: AtomicUsize::new(0),
            exists: AtomicBool::new(false),
            lookup: Mutex::new(Some(slot)),
            idle_since: Mutex::new(None),
            refresh: Notify::new(),
            started: AtomicU64::new(0),
            views,
            state: Mutex::new(ReadState::default()),
            stop: CancellationToken::new(),
        });
        tokio::spawn(watch.clone().reader(
            Arc::downgrade(&self.inner),
            self.inner.source.clone(),
            self.inner.reads.clone(),
            self.inner.gaps.clone(),
        ));
        table.agents.insert(agent_id.to_owned(), watch.clone());
        table.publish_len();
        watch
    }

    /// One more holder, under the watches lock.
    fn hold(&self, watch: Arc<AgentWatch>) -> Interest {
        watch.holders.fetch_add(1, Ordering::SeqCst);
        *watch.idle_since.lock().expect("idle lock") = None;
        Interest {
            watches: self.clone(),
            watch,
        }
    }

    fn get(&self, agent_id: &str) -> Option<Arc<AgentWatch>> {
        self.table().agents.get(agent_id).cloned()
    }

    /// An event for `agent_id`; agents without a watch are not kept.
    /// Returns the view the event brought, if it published one.
    pub fn on_event(&self, agent_id: &str, update: EventUpdate) -> Option<Arc<View>> {
        let watch = self.get(agent_id)?;
        if update.state.is_some() {
            self.inner.confirm(&watch);
        }
        watch.on_event(update)
    }

    /// Whether `agent_id`'s view already shows `revision` (an event of that
    /// revision would change nothing).
    pub fn shows(&self, agent_id: &str, revision: u64) -> bool {
        self.get(agent_id)
            .is_some_and(|watch| watch.lock().shows(revision))
    }

    fn all(&self) -> Vec<Arc<AgentWatch>> {
        self.table().agents.values().cloned().collect()
    }

    /// Distrusts every view (events may have been lost) and re-reads the
    /// ones someone waits on; returns how many are re-read.
    pub fn recheck_all(&self) -> usize {
        self.all().iter().filter(|watch| watch.distrust()).count()
    }

    /// Drops idle watches past their time; returns how many remain.
    pub fn prune(&self) -> usize {
        let now = Instant::now();
        let ttl = self.inner.limits.idle_ttl;
        let mut table = self.table();
        let before = table.agents.len();
        let mut views_expired = 0;
        table.agents.retain(|_, watch| {
            let expired = watch
                .idle_since
                .lock()
                .expect("idle lock")
                .is_some_and(|since| now.duration_since(since) >= ttl);
            if expired {
                watch.stop.cancel();
                views_expired += usize::from(watch.exists.load(Ordering::SeqCst));
            }
            !expired
        });
        table.views -= views_expired;
        let evicted = before - table.agents.len();
        if evicted > 0 {
            metrics::counter!("ctxsync_gate_views_evicted_total", "why" => "idle")
                .increment(evicted as u64);
        }
        table.publish_len();
        table.agents.len()
    }

    /// Reads of agents' states started so far.
    pub fn reads(&self) -> u64 {
        self.inner.reads.load(Ordering::Relaxed)
    }

    /// Whether `agent_id` has a watch (held or idle).
    pub fn is_watched(&self, agent_id: &str) -> bool {
        self.get(agent_id).is_some()
    }

    /// Agents with a watch, held or idle (views and lookups).
    pub fn len(&self) -> usize {
        self.table().agents.len()
    }

    /// Watches of agents known to exist.
    pub fn views(&self) -> usize {
        self.table().views
    }

    /// Watches of agents not yet known to exist (each held by a turn).
    pub fn lookups(&self) -> usize {
        let table = self.table();
        table.agents.len() - table.views
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Agents some turn is asking about now.
    pub fn held(&self) -> usize {
        self.table()
            .agents
            .values()
            .filter(|w| w.holders.load(Ordering::SeqCst) > 0)
            .count()
    }
}

/// Evicts idle views, oldest first, down to nine tenths of `max` (so a
/// full table doesn't scan on every new agent). Held watches are never
/// evicted (and a lookup is always held).
fn evict_oldest_idle(table: &mut Table, max: usize) {
    let target = max - max / 10;
    let mut idle: Vec<(Instant, String)> = table
        .agents
        .iter()
        .filter_map(|(id, watch)| {
            let since = (*watch.idle_since.lock().expect("idle lock"))?;
            Some((since, id.clone()))
        })
        .collect();
    idle.sort_unstable();
    let excess = table.views.saturating_sub(target);
    let mut evicted = 0u64;
    for (_, id) in idle.into_iter().take(excess) {
        if let Some(watch) = table.agents.remove(&id) {
            watch.stop.cancel();
            if watch.exists.load(Ordering::SeqCst) {
                table.views -= 1;
            }
            evicted += 1;
        }
    }
    table.publish_len();
    metrics::counter!("ctxsync_gate_views_evicted_total", "why" => "capacity").increment(evicted);
}

/// Whether a fresh view may answer without a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    /// The caller's request came after every event it could have seen was
    /// applied (the NATS turn server guarantees it): a fresh view will do.
    FreshView,
    /// The caller may have seen a commit whose event is still in flight: read.
    ReadFirst,
}

/// Holds an agent's watch: while any is held, the watch re-reads when it
/// must; after the last is dropped, the watch stays idle until it expires.
pub struct Interest {
    watches: Watches,
    watch: Arc<AgentWatch>,
}

impl Interest {
    /// A view as new as every commit announced before this call (with
    /// [`Trust::FreshView`], a fresh one at once; otherwise a read that
    /// started after it, bounded by `timeout`), and a receiver of every later view.
    pub async fn fresh_view(
        &self,
        trust: Trust,
        timeout: Duration,
    ) -> Result<(Arc<View>, watch::Receiver<Published>), ReadError> {
        let mut views = self.watch.views.subscribe();
        if trust == Trust::FreshView {
            let state = self.watch.lock();
            if let (Some(view), Some(epoch)) = (&state.latest, state.fresh_in)
                && !state.requested
                && !state.reading
                && *self.watches.inner.gaps.borrow() == epoch
            {
                return Ok((view.clone(), views));
            }
        }
        // The ticket is taken before asking: the read asked for (or one
        // already asked for and not yet started) has a sequence number at least this.
        let ticket = self.watch.started.load(Ordering::SeqCst) + 1;
        self.watch.request_read();
        let published =
            match tokio::time::timeout(timeout, views.wait_for(|p| p.seq >= ticket)).await {
                Ok(Ok(published)) => published.clone(),
                Ok(Err(_)) => {
                    return Err(ReadError::Unavailable("the gate is stopping".into()));
                }
                Err(_) => {
                    return Err(ReadError::Unavailable(format!(
                        "snapshot-store did not answer within {timeout:?}"
                    )));
                }
            };
        match published.result {
            Some(Ok(view)) => Ok((view, views)),
            Some(Err(error)) => Err(error),
            None => Err(ReadError::Unavailable("no read was published".into())),
        }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        // Under the watches lock, so eviction sees holders and idle_since
        // agree, and a lookup is not removed while a turn registers on it.
        let mut table = self.watches.table();
        if self.watch.holders.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        if self.watch.exists.load(Ordering::SeqCst) {
            *self.watch.idle_since.lock().expect("idle lock") = Some(Instant::now());
            return;
        }
        // Nobody asks about it and nothing showed the agent exists: no view
        // stays behind (the next turn registers and reads anew).
        if table.holds(&self.watch) {
            table.agents.remove(&self.watch.agent_id);
            table.publish_len();
        }
        self.watch.stop.cancel();
        drop(self.watch.lookup.lock().expect("lookup lock").take());
    }
}
