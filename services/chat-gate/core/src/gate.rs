//! The first-turn gate: decides whether a turn runs now or after waiting for
//! the current agent process's discovery, and answers with the projection.
//!
//! One wait ("attempt") per (chat, agent, run id) runs in its own task, so
//! concurrent callers join it and a caller that goes away cancels nothing.
//! An event whose view ends waits ends them where it is applied (see
//! [`Gate::apply_event`]): their callers wake without a hop through each
//! wait's task, which then only goes away.
//! A timed-out attempt is remembered for a while so the chat's later first
//! turns don't wait again; a finished one is forgotten at once. Every turn
//! is answered from the agent's view (see [`crate::watch`]): a fresh one at
//! once, otherwise after one read.
//!
//! On shutdown the gate drains: waits go on (still woken by events) for
//! [`GateSettings::drain`], then the ones left are answered
//! `GATE_DECISION_SHUTTING_DOWN` (ask again; not remembered as timed out).
//! A turn that would start a new wait after shutdown is answered so at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ctxsync_proto::rpc::Reply as _;
use ctxsync_proto::v1::{
    GateDecision, GateTurnWaited, ServiceError, TurnReply, TurnRequest, service_error::Code,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::projection::{self, Readiness};
use crate::source::{CatalogSource, ReadError, StateSource, WaitAnnouncer};
use crate::watch::{EventUpdate, Interest, Published, Trust, View, ViewLimits, Watches};

/// Longest accepted `chat_id` and `tenant`, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// How long the gate waits, and for what (the defaults are chat-gate's
/// flags': `chat_gate::Config::default().settings()`).
#[derive(Debug, Clone)]
pub struct GateSettings {
    /// Wait for a PENDING discovery of the current run.
    pub pending_timeout: Duration,
    /// Wait for the current run to report when there is no snapshot or only a stale one.
    pub stale_grace: Duration,
    /// Bound of one store read (and so of a refresh of a remembered attempt).
    pub store_timeout: Duration,
    /// How long a timed-out attempt is remembered.
    pub attempt_ttl: Duration,
    /// How many agents' views are kept, and for how long after their last turn.
    pub views: ViewLimits,
    /// After shutdown is signalled, waits go on this long (see [`drain_window`]);
    /// then the ones left are answered `shutting_down`.
    pub drain: Duration,
}

/// How long waits go on within a shutdown grace: all of it but a fifth (at
/// most 1 s), left to send the answers before NATS is drained.
pub fn drain_window(grace: Duration) -> Duration {
    grace - (grace / 5).min(Duration::from_secs(1))
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct AttemptKey {
    chat_id: String,
    agent_id: String,
    agent_run_id: String,
}

/// How an attempt ended.
#[derive(Debug)]
struct Outcome {
    decision: GateDecision,
    view: Arc<View>,
    /// When the wait ended: its callers' own work is timed from here.
    ended_at: Instant,
}

enum Attempt {
    Waiting(Arc<Waiting>),
    TimedOut { expires_at: Instant },
}

/// A wait in progress. Ended once, by whoever gets there first: the event
/// that brings a view ending it, or the wait's own task (a read, the
/// deadline, the drain).
struct Waiting {
    /// Shared with the attempt's entry: one copy of its ids per wait.
    key: Arc<AttemptKey>,
    started: Instant,
    /// The answer, for every caller joined to the wait.
    outcome: OutcomeSlot,
    /// Set (under the attempts lock) by whoever ends the wait; its task
    /// learns of an end it did not make from `outcome`.
    ended: std::sync::atomic::AtomicBool,
}

/// A wait's answer, set once, and its callers woken. Lighter than a watch
/// channel (whose sender carries eight notifiers): every waiting chat
/// holds one.
#[derive(Default)]
struct OutcomeSlot {
    value: std::sync::OnceLock<Arc<Outcome>>,
    set: tokio::sync::Notify,
}

impl OutcomeSlot {
    fn set(&self, outcome: Arc<Outcome>) {
        let _ = self.value.set(outcome);
        self.set.notify_waiters();
    }

    async fn get(&self) -> Arc<Outcome> {
        loop {
            // Made before the check: a set in between still wakes it.
            let set = self.set.notified();
            if let Some(outcome) = self.value.get() {
                return outcome.clone();
            }
            set.await;
        }
    }
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// A view ended it (ready or legacy).
    Woken,
    /// Its deadline passed first (or its views ended).
    TimedOut,
    /// The drain cut it short.
    Stopped,
}

#[derive(Default)]
struct Attempts {
    by_key: HashMap<Arc<AttemptKey>, Attempt>,
    /// The waiting ones of each agent, for the events that end them.
    waiting: HashMap<String, Vec<Arc<Waiting>>>,
}

/// Counters of one gate instance (the Prometheus metrics are process-wide).
#[derive(Debug)]
struct Stats {
    attempts_started: AtomicU64,
    attempts_joined: AtomicU64,
    /// Waits in progress (watched by [`Gate::until_no_waits`]).
    waiting: watch::Sender<usize>,
}

/// A turn's answer and, for a first turn answered without an error, its
/// wait as the latency report records it (no content), to be announced
/// once the answer is on its way.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub reply: TurnReply,
    pub waited: Option<GateTurnWaited>,
}

#[derive(Clone)]
pub struct Gate {
    inner: Arc<Inner>,
}

struct Inner {
    settings: GateSettings,
    catalog: Option<Arc<dyn CatalogSource>>,
    /// Where first-turn decisions are announced for the latency report.
    waits: Option<WaitAnnouncer>,
    watches: Watches,
    attempts: Mutex<Attempts>,
    stats: Stats,
    shutdown: CancellationToken,
    /// Cancelled when the drain window after shutdown has passed.
    drained: CancellationToken,
}

fn error_reply(code: Code, message: impl Into<String>) -> TurnReply {
    TurnReply::failed(ServiceError::new(code, message))
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// Checks a request before anything is read or waited for.
pub fn validate(request: &TurnRequest) -> Result<(), String> {
    if uuid::Uuid::parse_str(&request.agent_id).is_err() {
        return Err(format!(
            "agent_id must be a UUID, got {:?}",
            truncate(&request.agent_id, 64)
        ));
    }
    if request.chat_id.is_empty() {
        return Err("chat_id is required".into());
    }
    ctxsync_proto::ids::tenant(&request.tenant).map_err(|e| e.to_string())?;
    for (field, value) in [("chat_id", &request.chat_id), ("tenant", &request.tenant)] {
        if value.len() > MAX_ID_BYTES {
            return Err(format!(
                "{field} is {} bytes, over the limit of {MAX_ID_BYTES} ({field}_bytes)",
                value.len()
            ));
        }
        // Both reach Postgres (catalog sessions, gate-wait records): no NUL.
        if let Some(at) = value.find('\0') {
            return Err(format!("{field} contains U+0000 (NUL) at byte {at}"));
        }
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What the store answers for an unknown agent, so that another tenant's
/// agent cannot be told apart from one that does not exist.
pub fn not_found_message(agent_id: &str) -> String {
    match uuid::Uuid::parse_str(agent_id) {
        Ok(id) => format!("agent {id} not found"),
        Err(_) => format!("agent {agent_id:?} not found"),
    }
}

/// Another tenant's agent is answered exactly like an unknown one (and counted).
fn owned_by(view: &View, tenant: &str, agent_id: &str) -> Result<(), ReadError> {
    if view.tenant() == tenant {
        return Ok(());
    }
    metrics::counter!("ctxsync_gate_refused_total", "reason" => "wrong_tenant").increment(1);
    tracing::info!(
        agent_id,
        tenant,
        "request for another tenant's agent refused"
    );
    Err(ReadError::NotFound(not_found_message(agent_id)))
}

/// Where a turn's catalog preparation ended.
enum CatalogOutcome {
    Section(ctxsync_proto::v1::CatalogSection),
    /// Cut short by the drain.
    Drained,
    /// Not started: the agent is not the caller's.
    NotAsked,
}

fn read_error_reply(agent_id: &str, error: ReadError) -> TurnReply {
    match error {
        ReadError::NotFound(message) => error_reply(Code::NotFound, message),
        ReadError::Invalid(message) => error_reply(Code::InvalidArgument, message),
        ReadError::Unavailable(reason) => {
            tracing::warn!(agent_id, %reason, "store unavailable: the turn proceeds without context");
            TurnReply {
                decision: GateDecision::StoreUnavailable as i32,
                projection: Some(projection::unavailable(agent_id, &reason)),
                ..Default::default()
            }
        }
    }
}

/// A turn cut short by the drain before the agent's state was known.
fn shutting_down_reply(agent_id: &str, waited: Duration) -> TurnReply {
    let waited_ms = millis(waited);
    TurnReply {
        decision: GateDecision::ShuttingDown as i32,
        waited_ms,
        projection: Some(projection::shutting_down(agent_id, waited_ms)),
        ..Default::default()
    }
}

fn answer(view: &View, decision: GateDecision, waited: Duration) -> TurnReply {
    let mut projection = view.projection.clone();
    let waited_ms = millis(waited);
    projection::finish(&mut projection, decision, waited_ms);
    TurnReply {
        decision: decision as i32,
        waited_ms,
        projection: Some(projection),
        ..Default::default()
    }
}

fn record(reply: &TurnReply) {
    let decision = reply
        .error
        .as_ref()
        .map(|e| match e.code() {
            Code::NotFound => "not_found",
            _ => "invalid",
        })
        .unwrap_or_else(|| reply.decision().label());
    metrics::counter!("ctxsync_gate_turns_total", "decision" => decision).increment(1);
}

impl Gate {
    /// Views are read from `source` and trusted only between changes of its
    /// gaps. `shutdown` starts the drain (see the module docs).
    pub fn new(
        settings: GateSettings,
        source: Arc<dyn StateSource>,
        shutdown: CancellationToken,
    ) -> Self {
        let drained = CancellationToken::new();
        tokio::spawn({
            let (shutdown, drained, window) = (shutdown.clone(), drained.clone(), settings.drain);
            async move {
                shutdown.cancelled().await;
                tracing::info!(
                    drain_ms = millis(window),
                    "shutdown: waiting first turns go on within the drain window"
                );
                tokio::time::sleep(window).await;
                drained.cancel();
            }
        });
        Self {
            inner: Arc::new(Inner {
                watches: Watches::new(source, settings.views),
                settings,
                catalog: None,
                waits: None,
                attempts: Mutex::new(Attempts::default()),
                stats: Stats {
                    attempts_started: AtomicU64::new(0),
                    attempts_joined: AtomicU64::new(0),
                    waiting: watch::channel(0).0,
                },
                shutdown,
                drained,
            }),
        }
    }

    /// Cancelled once the drain window after shutdown has passed: no wait is
    /// left then, and none starts.
    pub fn drained(&self) -> &CancellationToken {
        &self.inner.drained
    }

    /// Returns once no wait is in progress.
    pub async fn until_no_waits(&self) {
        let mut waiting = self.inner.stats.waiting.subscribe();
        let _ = waiting.wait_for(|n| *n == 0).await;
    }

    pub fn watches(&self) -> &Watches {
        &self.inner.watches
    }

    pub fn settings(&self) -> &GateSettings {
        &self.inner.settings
    }

    /// Waits (attempts) in progress now.
    pub fn waiters_held(&self) -> usize {
        *self.inner.stats.waiting.borrow()
    }

    /// Callers that joined a wait already in progress, since this gate started.
    pub fn attempts_joined(&self) -> u64 {
        self.inner.stats.attempts_joined.load(Ordering::SeqCst)
    }

    /// Waits started since this gate started.
    pub fn attempts_started(&self) -> u64 {
        self.inner.stats.attempts_started.load(Ordering::SeqCst)
    }

    /// Attempts in memory: waiting ones and remembered timed-out ones.
    pub fn attempts_held(&self) -> usize {
        self.inner
            .attempts
            .lock()
            .expect("attempts lock")
            .by_key
            .len()
    }

    /// Store reads made by this gate so far.
    pub fn store_reads(&self) -> u64 {
        self.inner.watches.reads()
    }

    /// An event for `agent_id` (it says what a commit left); agents nobody
    /// asked about are not kept. A view it brings that ends waits ends the
    /// agent's waits here, so their callers are the next to run (no hop
    /// through each wait's task first). Returns how many waits it ended.
    pub fn apply_event(&self, agent_id: &str, update: EventUpdate) -> usize {
        let Some(view) = self.inner.watches.on_event(agent_id, update) else {
            return 0;
        };
        if !view.readiness.ends_wait() {
            return 0;
        }
        let ended = {
            let mut attempts = self.inner.attempts.lock().expect("attempts lock");
            match attempts.waiting.remove(agent_id) {
                Some(waits) => waits
                    .into_iter()
                    .filter(|waiting| {
                        end_locked(&mut attempts, waiting, End::Woken, &self.inner.settings)
                    })
                    .collect::<Vec<_>>(),
                None => return 0,
            }
        };
        let woken = ended.len();
        for waiting in ended {
            self.send_outcome(
                &waiting,
                view.readiness.decision(),
                view.clone(),
                End::Woken,
            );
        }
        woken
    }

    /// Events may have been lost: distrusts every view and re-reads the ones
    /// someone waits on; returns how many are re-read.
    pub fn recheck_all(&self) -> usize {
        self.inner.watches.recheck_all()
    }

    /// The slow safety sweep (`sweep`, zero for none) and the expiry of
    /// remembered attempts and idle views, until `stop`.
    pub fn spawn_housekeeping(&self, sweep: Duration, stop: CancellationToken) -> JoinHandle<()> {
        let gate = self.clone();
        let settings = self.settings();
        let prune_every = (settings.attempt_ttl.min(settings.views.idle_ttl) / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(30));
        tokio::spawn(async move {
            let mut prune = tokio::time::interval(prune_every);
            prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut next_sweep = (!sweep.is_zero()).then(|| Instant::now() + sweep);
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
                        let agents = gate.recheck_all();
                        if agents > 0 {
                            tracing::debug!(agents, "safety sweep re-read waited-on agents");
                        }
                        next_sweep = Some(Instant::now() + sweep);
                    }
                }
            }
        })
    }

    /// Forgets timed-out attempts and idle views past their time; returns
    /// how many attempts remain.
    pub fn prune(&self) -> usize {
        let views = self.inner.watches.prune();
        metrics::gauge!("ctxsync_gate_views").set(views as f64);
        let now = Instant::now();
        let mut attempts = self.inner.attempts.lock().expect("attempts lock");
        attempts.by_key.retain(|_, attempt| match attempt {
            Attempt::TimedOut { expires_at } => *expires_at > now,
            Attempt::Waiting(_) => true,
        });
        attempts.by_key.len()
    }

    /// The current projection of an agent, without waiting.
    /// Another tenant's agent is `NotFound`, like an unknown one.
    pub async fn context(
        &self,
        tenant: &str,
        agent_id: &str,
    ) -> Result<ctxsync_proto::v1::ChatProjection, ReadError> {
        if uuid::Uuid::parse_str(agent_id).is_err() {
            return Err(ReadError::Invalid(format!(
                "agent_id must be a UUID, got {:?}",
                truncate(agent_id, 64)
            )));
        }
        let timeout = self.inner.settings.store_timeout;
        let (view, _) = self
            .inner
            .watches
            .register(agent_id, timeout)
            .await?
            .fresh_view(Trust::ReadFirst, timeout)
            .await?;
        owned_by(&view, tenant, agent_id)?;
        let mut projection = view.projection.clone();
        let decision = match view.readiness {
            Readiness::Legacy => GateDecision::Legacy,
            Readiness::Ready => GateDecision::Ready,
            _ => GateDecision::NotFirstTurn,
        };
        projection::finish(&mut projection, decision, 0);
        Ok(projection)
    }

    /// Also prepares the tenant's catalog on first turns.
    pub fn with_catalog(mut self, catalog: Arc<dyn CatalogSource>) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("with_catalog is called before the gate is shared")
            .catalog = Some(catalog);
        self
    }

    /// Also announces each first turn's decision and wait (no content), for
    /// the latency report.
    pub fn with_announcer(mut self, announce: WaitAnnouncer) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("with_announcer is called before the gate is shared")
            .waits = Some(announce);
        self
    }

    /// Hands a first turn's wait to the announcer, if one is set.
    fn announce_wait(&self, waited: Option<GateTurnWaited>) {
        if let (Some(announce), Some(waited)) = (&self.inner.waits, waited) {
            announce(waited);
        }
    }

    /// May this turn run, and with which context. For callers outside the
    /// gate's NATS connection (HTTP, in-process): the agent's state is read,
    /// since an event of a commit the caller has seen may still be in flight.
    pub async fn turn(&self, request: TurnRequest) -> TurnReply {
        let answer = self.turn_with(request, Trust::ReadFirst).await;
        self.announce_wait(answer.waited);
        answer.reply
    }

    /// [`Gate::turn`] for a request that came after every event its caller
    /// could have seen was applied (the gate's NATS turn server applies the
    /// events its connection delivered before a turn first): a fresh view
    /// answers without a read.
    ///
    /// A first turn's wait is handed back, not announced: the caller sends
    /// it after the answer, on the answer's own way out (the announcer would
    /// start a task of its own, whose wake-up competes with the answer's).
    pub async fn turn_after_events(&self, request: TurnRequest) -> Answer {
        self.turn_with(request, Trust::FreshView).await
    }

    async fn turn_with(&self, request: TurnRequest, trust: Trust) -> Answer {
        // A first turn with a tenant also gets the tenant's catalog pins, asked
        // at the same time as the wait so neither delays the other.
        let catalog = match (
            &self.inner.catalog,
            request.first_turn,
            request.tenant.is_empty(),
        ) {
            (Some(catalog), true, false) => {
                let (catalog, tenant, chat) = (
                    catalog.clone(),
                    request.tenant.clone(),
                    request.chat_id.clone(),
                );
                Some(async move { catalog.prepare(&tenant, &chat).await })
            }
            _ => None,
        };
        let (first_turn, tenant) = (request.first_turn, request.tenant.clone());
        // Boxed: a turn's task keeps its future's largest state while it
        // waits, and only a turn that prepares a catalog needs this one.
        let reply = match catalog {
            Some(catalog) => Box::pin(self.decide_with_catalog(request, trust, catalog)).await,
            None => self.decide(request, trust, None).await,
        };
        record(&reply);
        let waited = (first_turn && reply.error.is_none()).then(|| GateTurnWaited {
            tenant,
            outcome: reply.decision().label().to_owned(),
            wait_ms: reply.waited_ms,
        });
        Answer { reply, waited }
    }

    /// The decision and, at the same time, the catalog's preparation. A
    /// preparation the drain cuts short makes the turn `shutting_down` too:
    /// the caller asks again and gets both.
    async fn decide_with_catalog(
        &self,
        request: TurnRequest,
        trust: Trust,
        catalog: impl std::future::Future<Output = ctxsync_proto::v1::CatalogSection>,
    ) -> TurnReply {
        let drained = self.inner.drained.clone();
        let (entitled, confirmed) = tokio::sync::oneshot::channel();
        let catalog = async move {
            // Nothing is prepared before the agent is known to be the
            // caller's: a turn answered not-found creates no session.
            if confirmed.await.is_err() {
                return CatalogOutcome::NotAsked;
            }
            tokio::select! {
                section = catalog => CatalogOutcome::Section(section),
                _ = drained.cancelled() => CatalogOutcome::Drained,
            }
        };
        let decide = self.decide(request, trust, Some(entitled));
        tokio::pin!(catalog, decide);
        let mut section = None;
        let mut reply = loop {
            tokio::select! {
                reply = &mut decide => break reply,
                done = &mut catalog, if section.is_none() => section = Some(done),
            }
        };
        if reply.error.is_some() || reply.decision() == GateDecision::ShuttingDown {
            // Asked again anyway (or not entitled): the catalog's answer is
            // not worth waiting for.
            return reply;
        }
        let section = match section {
            Some(section) => section,
            None => catalog.await,
        };
        let Some(projection) = reply.projection.as_mut() else {
            return reply;
        };
        match section {
            CatalogOutcome::Section(section) => projection::add_catalog(projection, section),
            CatalogOutcome::NotAsked => {}
            CatalogOutcome::Drained => {
                reply.decision = GateDecision::ShuttingDown as i32;
                projection::finish(projection, GateDecision::ShuttingDown, reply.waited_ms);
            }
        }
        reply
    }

    /// `entitled` is told once the agent is known to be the caller's (or the
    /// store cannot say): only then may the turn's catalog be prepared.
    async fn decide(
        &self,
        request: TurnRequest,
        trust: Trust,
        entitled: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> TurnReply {
        let started = Instant::now();
        if let Err(message) = validate(&request) {
            return error_reply(Code::InvalidArgument, message);
        }
        let agent_id = request.agent_id.as_str();
        let timeout = self.inner.settings.store_timeout;
        // Register before looking: an event committed after this point finds
        // the watch, and a read (if the view is not fresh) starts after it.
        // Past the drain window nothing is read any more.
        // Boxed: a waiting turn's task keeps its future's largest state,
        // and the lookup's is much larger than the wait's.
        let looked_up = Box::pin(async {
            let interest = self.inner.watches.register(agent_id, timeout).await?;
            let (view, views) = interest.fresh_view(trust, timeout).await?;
            Ok::<_, ReadError>((interest, view, views))
        });
        let (interest, view, views) = tokio::select! {
            biased;
            looked_up = looked_up => match looked_up {
                Ok(looked_up) => looked_up,
                Err(error) => {
                    if matches!(error, ReadError::Unavailable(_)) {
                        // The catalog is the caller's own tenant's either way.
                        entitled.map(|tx| tx.send(()));
                    }
                    return read_error_reply(agent_id, error);
                }
            },
            _ = self.inner.drained.cancelled() => {
                return shutting_down_reply(agent_id, started.elapsed());
            }
        };
        if let Err(not_found) = owned_by(&view, &request.tenant, agent_id) {
            return read_error_reply(agent_id, not_found);
        }
        entitled.map(|tx| tx.send(()));
        if !request.first_turn {
            return answer(&view, GateDecision::NotFirstTurn, Duration::ZERO);
        }
        let key = AttemptKey {
            chat_id: request.chat_id.clone(),
            agent_id: agent_id.to_owned(),
            agent_run_id: view.agent_run_id().to_owned(),
        };
        match view.readiness {
            Readiness::Ready => {
                self.forget_timed_out(&key);
                return answer(&view, GateDecision::Ready, started.elapsed());
            }
            Readiness::Legacy => {
                self.forget_timed_out(&key);
                return answer(&view, GateDecision::Legacy, started.elapsed());
            }
            Readiness::Pending | Readiness::NoSnapshot | Readiness::Stale => {}
        }

        let (waited_for, joined) = {
            let mut attempts = self.inner.attempts.lock().expect("attempts lock");
            match attempts.by_key.get(&key) {
                Some(Attempt::TimedOut { expires_at }) if *expires_at > Instant::now() => {
                    drop(attempts);
                    // The view above was this turn's one refresh: still not ready.
                    let mut reply = answer(&view, view.readiness.decision(), started.elapsed());
                    reply.attempt_reused = true;
                    return reply;
                }
                Some(Attempt::Waiting(waiting)) => {
                    self.inner
                        .stats
                        .attempts_joined
                        .fetch_add(1, Ordering::SeqCst);
                    metrics::counter!("ctxsync_gate_attempts_joined_total").increment(1);
                    (waiting.clone(), true)
                }
                _ if self.inner.shutdown.is_cancelled() => {
                    drop(attempts);
                    // This replica is going away: a new wait would only be
                    // cut short. Another replica waits for the whole of it.
                    return answer(&view, GateDecision::ShuttingDown, started.elapsed());
                }
                _ => {
                    let key = Arc::new(key);
                    let waiting = Arc::new(Waiting {
                        key: key.clone(),
                        started,
                        outcome: OutcomeSlot::default(),
                        ended: std::sync::atomic::AtomicBool::new(false),
                    });
                    attempts
                        .by_key
                        .insert(key, Attempt::Waiting(waiting.clone()));
                    attempts
                        .waiting
                        .entry(agent_id.to_owned())
                        .or_default()
                        .push(waiting.clone());
                    // Counted here, not in the task: an event may end the
                    // wait before the task first runs.
                    self.inner.stats.waiting.send_modify(|n| *n += 1);
                    metrics::gauge!("ctxsync_gate_waiters").increment(1.0);
                    drop(attempts);
                    self.inner
                        .stats
                        .attempts_started
                        .fetch_add(1, Ordering::SeqCst);
                    let gate = self.clone();
                    let waited_for = waiting.clone();
                    tokio::spawn(async move {
                        gate.wait(waiting, interest, view, views).await;
                    });
                    (waited_for, false)
                }
            }
        };
        let done = waited_for.outcome.get().await;
        let mut reply = answer(&done.view, done.decision, started.elapsed());
        reply.joined_attempt = joined;
        metrics::histogram!("ctxsync_gate_answer_work_seconds")
            .record(done.ended_at.elapsed().as_secs_f64());
        reply
    }

    fn forget_timed_out(&self, key: &AttemptKey) {
        let mut attempts = self.inner.attempts.lock().expect("attempts lock");
        if matches!(attempts.by_key.get(key), Some(Attempt::TimedOut { .. })) {
            attempts.by_key.remove(key);
        }
    }

    /// One attempt: waits until a view ends the wait, or the deadline; or
    /// goes away once an event ended it (see [`Gate::apply_event`]).
    async fn wait(
        self,
        waiting: Arc<Waiting>,
        interest: Interest,
        mut view: Arc<View>,
        mut views: watch::Receiver<Published>,
    ) {
        let settings = &self.inner.settings;
        let key = &waiting.key;
        tracing::debug!(agent_id = %key.agent_id, chat_id = %key.chat_id, readiness = ?view.readiness, "first turn waits for discovery");

        let (decision, end) = loop {
            if view.readiness.ends_wait() {
                break (view.readiness.decision(), End::Woken);
            }
            // The grace covers "not reported yet"; once the run reports
            // PENDING, the pending timeout applies (both from the start).
            let limit = if view.readiness == Readiness::Pending {
                settings.pending_timeout
            } else {
                settings.stale_grace
            };
            tokio::select! {
                // An event ended it: nothing is left to do.
                biased;
                _ = waiting.outcome.get() => return,
                // A view that ends the wait wins over a deadline passing at the same time.
                changed = views.changed() => {
                    if changed.is_err() {
                        break (view.readiness.decision(), End::TimedOut);
                    }
                    let published = views.borrow_and_update().clone();
                    // A failed read keeps the last view: the reader retries it.
                    if let Some(Ok(next)) = published.result {
                        view = next;
                    }
                }
                _ = tokio::time::sleep_until(waiting.started + limit) => {
                    break (view.readiness.decision(), End::TimedOut);
                }
                _ = self.inner.drained.cancelled() => {
                    break (GateDecision::ShuttingDown, End::Stopped);
                }
            }
        };
        drop(interest);
        let ended = {
            let mut attempts = self.inner.attempts.lock().expect("attempts lock");
            let ended = end_locked(&mut attempts, &waiting, end, settings);
            if ended && let Some(waits) = attempts.waiting.get_mut(&key.agent_id) {
                waits.retain(|other| !Arc::ptr_eq(other, &waiting));
                if waits.is_empty() {
                    attempts.waiting.remove(&key.agent_id);
                }
            }
            ended
        };
        if ended {
            self.send_outcome(&waiting, decision, view, end);
        }
    }

    /// Sends an ended wait's answer, then records it: the callers' wake
    /// comes before the bookkeeping.
    fn send_outcome(&self, waiting: &Waiting, decision: GateDecision, view: Arc<View>, end: End) {
        let woken_by_commit = (end == End::Woken)
            .then_some(view.woken_by_commit)
            .flatten();
        waiting.outcome.set(Arc::new(Outcome {
            decision,
            view,
            ended_at: Instant::now(),
        }));
        let key = &waiting.key;
        let label = decision.label();
        let waited = waiting.started.elapsed();
        metrics::counter!("ctxsync_gate_waits_total", "outcome" => label).increment(1);
        metrics::histogram!("ctxsync_gate_wait_seconds", "outcome" => label)
            .record(waited.as_secs_f64());
        if let Some(commit) = woken_by_commit {
            let latency = SystemTime::now()
                .duration_since(commit)
                .unwrap_or_default()
                .as_secs_f64();
            metrics::histogram!("ctxsync_gate_wake_seconds").record(latency);
        }
        tracing::debug!(agent_id = %key.agent_id, chat_id = %key.chat_id, outcome = label, waited_ms = millis(waited), "first-turn wait ended");
        metrics::gauge!("ctxsync_gate_waiters").decrement(1.0);
        // After the answer: whoever waits for no waits finds it sent.
        self.inner.stats.waiting.send_modify(|n| *n -= 1);
    }
}

/// Ends `waiting` in the attempts (under their lock) unless it has ended
/// already; returns whether this call ended it. A timed-out attempt is
/// remembered, so the chat's later first turns don't wait again. The
/// caller removes it from the agent's waits.
fn end_locked(
    attempts: &mut Attempts,
    waiting: &Arc<Waiting>,
    end: End,
    settings: &GateSettings,
) -> bool {
    if waiting.ended.load(Ordering::SeqCst) {
        return false;
    }
    waiting.ended.store(true, Ordering::SeqCst);
    if end == End::TimedOut {
        attempts.by_key.insert(
            waiting.key.clone(),
            Attempt::TimedOut {
                expires_at: Instant::now() + settings.attempt_ttl,
            },
        );
    } else {
        attempts.by_key.remove(&waiting.key);
    }
    true
}
