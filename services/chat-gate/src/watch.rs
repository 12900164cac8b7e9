//! Agents being waited on: one in-memory watch per agent, refreshed by the
//! discovery events, never by a polling loop.
//!
//! A watch exists while something holds an [`Interest`] in the agent. It owns
//! one reader task that reads the agent's state from the store, one read at a
//! time, whenever an event (or a reconnect, or a caller) asks for it, and
//! publishes each result with the sequence number of the read. Reads are
//! sequential, so results are published in the order they started: a caller
//! that registered before taking its ticket accepts only reads that started
//! after it registered, so nothing committed before it registered is missed,
//! and anything committed after is announced by an event that finds the watch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ctxsync_proto::v1::{AgentState, ChatProjection, DiscoveryChanged, SnapshotCommitted};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::projection::{self, Readiness};
use crate::store::{ReadError, StoreReader};

/// Retries of a failed read while someone waits: short first (a store that
/// reconnects after a NATS restart is back within a second), then capped.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// Events remembered while a read is in flight before a re-read is forced anyway.
const MAX_RECHECKS: usize = 16;

/// One read of an agent's state and its projection, shared by every waiter.
#[derive(Debug)]
pub struct View {
    pub state: AgentState,
    pub readiness: Readiness,
    /// Built once per read; answers clone it and add their summary.
    pub projection: ChatProjection,
    /// Commit time of the event that caused this read, for the wake latency.
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

    pub fn agent_run_id(&self) -> &str {
        self.state
            .agent
            .as_ref()
            .map(|a| a.agent_run_id.as_str())
            .unwrap_or_default()
    }
}

/// A read's result with the order in which it started.
#[derive(Debug, Clone, Default)]
pub struct Published {
    pub seq: u64,
    pub result: Option<Result<Arc<View>, ReadError>>,
}

/// What an event says the state is after its commit; a view that already
/// shows it needs no new read.
#[derive(Debug, Clone)]
pub struct Expectation {
    agent_run_id: Option<String>,
    /// `None`: the agent has no snapshot.
    snapshot: Option<ExpectedSnapshot>,
}

#[derive(Debug, Clone)]
struct ExpectedSnapshot {
    run_id: String,
    version: u64,
    phase: Option<i32>,
    hash: Option<String>,
}

impl Expectation {
    pub fn discovery(event: &DiscoveryChanged) -> Self {
        Self {
            agent_run_id: Some(event.agent_run_id.clone()),
            snapshot: event.has_snapshot.then(|| ExpectedSnapshot {
                run_id: event.snapshot_agent_run_id.clone(),
                version: event.snapshot_version,
                phase: Some(event.phase),
                hash: None,
            }),
        }
    }

    pub fn snapshot(event: &SnapshotCommitted) -> Self {
        Self {
            agent_run_id: None,
            snapshot: Some(ExpectedSnapshot {
                run_id: event.agent_run_id.clone(),
                version: event.version,
                phase: Some(event.phase),
                hash: Some(event.hash.clone()),
            }),
        }
    }

    fn shown_by(&self, view: &View) -> bool {
        let state = &view.state;
        if let Some(run_id) = &self.agent_run_id
            && Some(run_id.as_str()) != state.agent.as_ref().map(|a| a.agent_run_id.as_str())
        {
            return false;
        }
        match (&self.snapshot, &state.snapshot) {
            (None, None) => true,
            (Some(expected), Some(actual)) => {
                expected.run_id == actual.agent_run_id
                    && expected.version == actual.version
                    && expected.phase.is_none_or(|p| p == actual.phase)
                    && expected.hash.as_ref().is_none_or(|h| *h == actual.hash)
            }
            _ => false,
        }
    }
}

#[derive(Default)]
struct ReadState {
    /// A read was asked for and has not started: anything asking now is covered by it.
    requested: bool,
    reading: bool,
    /// Events that arrived during the read in flight: re-read unless its result shows them.
    recheck: Vec<Expectation>,
    /// Re-read after the read in flight whatever it shows (reconnect, sweep).
    force: bool,
    /// Commit time of the newest event not yet covered by a started read.
    commit_at: Option<SystemTime>,
    latest: Option<Arc<View>>,
}

pub struct AgentWatch {
    agent_id: String,
    holders: AtomicUsize,
    refresh: Notify,
    started: AtomicU64,
    views: watch::Sender<Published>,
    state: Mutex<ReadState>,
    stop: CancellationToken,
}

impl AgentWatch {
    /// Asks for a read that starts after this call. Asks made before the
    /// reader picks a request up share that one read.
    fn request_read(&self) {
        let mut state = self.state.lock().expect("watch state lock");
        if state.reading {
            state.force = true;
        } else if !state.requested {
            state.requested = true;
            drop(state);
            self.refresh.notify_one();
        }
    }

    fn on_event(&self, expectation: Expectation, commit_at: Option<SystemTime>) {
        let mut state = self.state.lock().expect("watch state lock");
        if !state.reading
            && state
                .latest
                .as_ref()
                .is_some_and(|view| expectation.shown_by(view))
        {
            return;
        }
        if commit_at.is_some() {
            state.commit_at = commit_at;
        }
        if state.reading {
            if state.recheck.len() < MAX_RECHECKS {
                state.recheck.push(expectation);
            } else {
                state.force = true;
            }
        } else if !state.requested {
            state.requested = true;
            drop(state);
            self.refresh.notify_one();
        }
    }

    async fn reader(self: Arc<Self>, store: StoreReader) {
        let mut retry_at: Option<Instant> = None;
        let mut backoff = RETRY_MIN;
        loop {
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = self.refresh.notified() => {}
                _ = sleep_until_some(retry_at) => {}
            }
            retry_at = None;
            let commit_at = {
                let mut state = self.state.lock().expect("watch state lock");
                state.requested = false;
                state.reading = true;
                state.force = false;
                state.recheck.clear();
                state.commit_at.take()
            };
            let seq = self.started.fetch_add(1, Ordering::SeqCst) + 1;
            let result = store
                .read(&self.agent_id)
                .await
                .map(|s| Arc::new(View::new(&self.agent_id, s, commit_at)));
            let again = {
                let mut state = self.state.lock().expect("watch state lock");
                state.reading = false;
                let again = match &result {
                    Ok(view) => {
                        state.latest = Some(view.clone());
                        state.force || state.recheck.iter().any(|e| !e.shown_by(view))
                    }
                    Err(_) => false,
                };
                state.force = false;
                state.recheck.clear();
                again
            };
            match &result {
                Err(ReadError::Unavailable(reason)) => {
                    tracing::debug!(agent_id = %self.agent_id, %reason, "store read failed; retrying while waiters remain");
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
                _ => backoff = RETRY_MIN,
            }
            self.views.send_replace(Published {
                seq,
                result: Some(result),
            });
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

/// Every watched agent, by id.
#[derive(Clone)]
pub struct Watches {
    inner: Arc<WatchesInner>,
}

struct WatchesInner {
    agents: Mutex<HashMap<String, Arc<AgentWatch>>>,
    store: StoreReader,
}

impl Watches {
    pub fn new(store: StoreReader) -> Self {
        Self {
            inner: Arc::new(WatchesInner {
                agents: Mutex::new(HashMap::new()),
                store,
            }),
        }
    }

    /// Registers interest in `agent_id`: from now on its events refresh the watch.
    pub fn register(&self, agent_id: &str) -> Interest {
        let mut agents = self.inner.agents.lock().expect("watches lock");
        let watch = agents
            .entry(agent_id.to_owned())
            .or_insert_with(|| {
                let (views, _) = watch::channel(Published::default());
                let watch = Arc::new(AgentWatch {
                    agent_id: agent_id.to_owned(),
                    holders: AtomicUsize::new(0),
                    refresh: Notify::new(),
                    started: AtomicU64::new(0),
                    views,
                    state: Mutex::new(ReadState::default()),
                    stop: CancellationToken::new(),
                });
                tokio::spawn(watch.clone().reader(self.inner.store.clone()));
                watch
            })
            .clone();
        watch.holders.fetch_add(1, Ordering::SeqCst);
        Interest {
            watches: self.clone(),
            watch,
        }
    }

    fn get(&self, agent_id: &str) -> Option<Arc<AgentWatch>> {
        self.inner
            .agents
            .lock()
            .expect("watches lock")
            .get(agent_id)
            .cloned()
    }

    /// A discovery event or a snapshot event for `agent_id`.
    pub fn on_event(
        &self,
        agent_id: &str,
        expectation: Expectation,
        commit_at: Option<SystemTime>,
    ) {
        if let Some(watch) = self.get(agent_id) {
            watch.on_event(expectation, commit_at);
        }
    }

    /// Re-reads every watched agent (after a reconnect, events may have been lost).
    pub fn recheck_all(&self) -> usize {
        let watches: Vec<Arc<AgentWatch>> = self
            .inner
            .agents
            .lock()
            .expect("watches lock")
            .values()
            .cloned()
            .collect();
        for watch in &watches {
            watch.request_read();
        }
        watches.len()
    }

    /// Whether a waiter (or reader) holds a watch on `agent_id` now.
    pub fn is_watched(&self, agent_id: &str) -> bool {
        self.get(agent_id).is_some()
    }

    /// Agents currently watched.
    pub fn len(&self) -> usize {
        self.inner.agents.lock().expect("watches lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Holds an agent's watch open; dropping the last one stops its reader.
pub struct Interest {
    watches: Watches,
    watch: Arc<AgentWatch>,
}

impl Interest {
    /// A read that started after this interest was registered, bounded by
    /// `timeout`, and a receiver of every later read.
    pub async fn fresh_view(
        &self,
        timeout: Duration,
    ) -> Result<(Arc<View>, watch::Receiver<Published>), ReadError> {
        let mut views = self.watch.views.subscribe();
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
        let mut agents = self.watches.inner.agents.lock().expect("watches lock");
        if self.watch.holders.fetch_sub(1, Ordering::SeqCst) == 1 {
            if agents
                .get(&self.watch.agent_id)
                .is_some_and(|w| Arc::ptr_eq(w, &self.watch))
            {
                agents.remove(&self.watch.agent_id);
            }
            self.watch.stop.cancel();
        }
    }
}
