//! Events: written to `catalog.events`, then published on
//! `<prefix>.events.catalog.<kind>`; and which generations this process
//! knows are written.
//!
//! Events no answer depends on (a call's `mcp.tool.called`, a follow-up
//! preparation, a warm-up's outcome) are [`Events::queue`]d and written by
//! one background task in batches ([`EventWriter`]), after the answer went
//! out: no reply waits for a commit of bookkeeping. A batch gathers for up
//! to `--event-batch-wait` after its first event, so busy calls share one
//! transaction instead of each paying Postgres (and the cores the answers
//! need) a commit; a flush or shutdown ends the wait. The queue is bounded
//! (`--event-queue`): past it an event is dropped and counted, never a
//! reply delayed. While Postgres is down the writer holds its batch and
//! retries; at shutdown it writes what is queued within the grace. What a
//! kill -9 loses is what was queued: at most the queue's bound. A
//! preparation's own transaction (its session, pins and the generations
//! they name) is not queued: later calls, on any replica, read it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::Shutdown;
use prost::Message;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::store::{self, GenerationRef, NewEvent, StoredEvent, WrittenGenerations};

/// Events written in one statement at most.
const MAX_BATCH: usize = 512;

/// How long the writer waits before trying Postgres again, at first and at most.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What waits in the queue: an event with when it happened, or a flush,
/// answered once everything queued before it is written.
enum Queued {
    Event {
        occurred_at: DateTime<Utc>,
        event: NewEvent,
    },
    Flush(oneshot::Sender<()>),
}

/// Stores and publishes events; remembers the generations written.
pub(crate) struct Events {
    pool: PgPool,
    nats: async_nats::Client,
    subjects: Subjects,
    written: WrittenGenerations,
    queue: mpsc::Sender<Queued>,
}

impl Events {
    /// The events of a service, and the writer of its queue of at most
    /// `queue_bound` events (started with [`EventWriter::spawn`]).
    pub fn new(
        pool: PgPool,
        nats: async_nats::Client,
        subjects: Subjects,
        queue_bound: usize,
    ) -> (Arc<Self>, QueuedEvents) {
        let (queue, receiver) = mpsc::channel(queue_bound.max(1));
        let events = Arc::new(Self {
            pool,
            nats,
            subjects,
            written: WrittenGenerations::default(),
            queue,
        });
        (events.clone(), QueuedEvents { events, receiver })
    }

    /// Queues `events` for the writer and returns at once. A full queue
    /// drops the event (counted in `ctxsync_catalog_events_dropped_total`,
    /// logged at most once a second).
    pub fn queue(&self, events: Vec<NewEvent>) {
        let occurred_at = Utc::now();
        let queued = metrics::gauge!("ctxsync_catalog_events_queued");
        for event in events {
            let kind = event.kind;
            // Counted before it is sent: the writer may take it at once.
            queued.increment(1.0);
            if self
                .queue
                .try_send(Queued::Event { occurred_at, event })
                .is_err()
            {
                queued.decrement(1.0);
                metrics::counter!("ctxsync_catalog_events_dropped_total").increment(1);
                static LAST_WARNING: AtomicU64 = AtomicU64::new(0);
                let now = u64::try_from(Utc::now().timestamp()).unwrap_or_default();
                if LAST_WARNING.swap(now, Ordering::Relaxed) != now {
                    tracing::warn!(
                        kind,
                        bound = self.queue.max_capacity(),
                        "event dropped: the event queue is full (--event-queue); Postgres is slow or down"
                    );
                }
            }
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Publishes committed events; a failure is logged (the events are
    /// stored either way).
    pub async fn publish(&self, events: &[StoredEvent]) {
        for event in events {
            let subject = self.subjects.catalog_event(event.event.kind);
            let payload = event.to_proto().encode_to_vec();
            if let Err(error) = self.nats.publish(subject, payload.into()).await {
                tracing::warn!(%error, kind = event.event.kind, "cannot publish a catalog event");
            }
        }
    }

    /// Whether this process knows `generation` is written (committed).
    pub fn is_written(&self, generation: &GenerationRef<'_>) -> bool {
        self.written
            .contains(generation.key, &generation.catalog.hash)
    }

    /// Writes `generation` (in the caller's transaction) unless this process
    /// knows it is written.
    pub async fn write_generation(
        &self,
        conn: &mut PgConnection,
        generation: &GenerationRef<'_>,
    ) -> Result<(), sqlx::Error> {
        if self.is_written(generation) {
            return Ok(());
        }
        store::write_generation(conn, generation).await.map(|_| ())
    }

    /// The transaction that wrote (or found) the generation committed.
    pub fn generation_committed(&self, key: &str, hash: &str) {
        self.written.insert(key.to_owned(), hash.to_owned());
    }
}

impl Events {
    /// Waits until every event queued before the call is written (false if
    /// the writer stopped first). For a reader that must see them, such as
    /// a test.
    pub async fn flushed(&self) -> bool {
        let (written, answer) = oneshot::channel();
        if self.queue.send(Queued::Flush(written)).await.is_err() {
            return false;
        }
        answer.await.is_ok()
    }
}

/// The queue's receiving end, until its writer is spawned.
pub(crate) struct QueuedEvents {
    events: Arc<Events>,
    receiver: mpsc::Receiver<Queued>,
}

/// The task writing queued events.
pub(crate) struct EventWriter {
    task: JoinHandle<()>,
    finish: oneshot::Sender<()>,
}

impl EventWriter {
    /// Starts writing `queued`; once `shutdown` fires, whatever is not
    /// written within `grace` is given up (counted, logged).
    /// A batch gathers events for up to `batch_wait` after its first.
    pub fn spawn(
        queued: QueuedEvents,
        batch_wait: Duration,
        shutdown: Shutdown,
        grace: Duration,
    ) -> Self {
        let (finish, finished) = oneshot::channel();
        let task = tokio::spawn(write_queued(queued, batch_wait, shutdown, grace, finished));
        Self { task, finish }
    }

    /// Writes what is queued, then stops (nothing may queue any more:
    /// called after every request and task ended).
    pub async fn finish(self) {
        let _ = self.finish.send(());
        let _ = self.task.await;
    }
}

async fn write_queued(
    queued: QueuedEvents,
    batch_wait: Duration,
    shutdown: Shutdown,
    grace: Duration,
    mut finished: oneshot::Receiver<()>,
) {
    let QueuedEvents {
        events,
        mut receiver,
    } = queued;
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut finishing = false;
    loop {
        let first = if finishing {
            match receiver.try_recv() {
                Ok(first) => first,
                Err(_) => return,
            }
        } else {
            tokio::select! {
                first = receiver.recv() => match first {
                    Some(first) => first,
                    None => return,
                },
                _ = &mut finished => {
                    finishing = true;
                    continue;
                }
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    deadline = Some(tokio::time::Instant::now() + grace);
                    continue;
                }
            }
        };
        // A batch ends at its bound, at a flush (answered once the batch
        // is written), or once the queue is empty after its gathering time;
        // shutdown ends the gathering.
        // No larger than the queue: what is held (the batch in hand and the
        // queue) stays within twice its bound.
        let batch_limit = MAX_BATCH.min(receiver.max_capacity());
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        let gathered_by = tokio::time::Instant::now() + batch_wait;
        let mut next = Some(first);
        loop {
            while let Some(item) = next.take() {
                match item {
                    Queued::Event { occurred_at, event } => batch.push((occurred_at, event)),
                    Queued::Flush(flush) => {
                        flushes.push(flush);
                        break;
                    }
                }
                if batch.len() < batch_limit {
                    next = receiver.try_recv().ok();
                }
            }
            if !flushes.is_empty() || batch.len() >= batch_limit || finishing || deadline.is_some()
            {
                break;
            }
            tokio::select! {
                item = receiver.recv() => match item {
                    Some(item) => next = Some(item),
                    None => break,
                },
                () = tokio::time::sleep_until(gathered_by) => break,
                _ = &mut finished => {
                    finishing = true;
                    break;
                }
                _ = shutdown.cancelled() => {
                    deadline = Some(tokio::time::Instant::now() + grace);
                    break;
                }
            }
        }
        metrics::gauge!("ctxsync_catalog_events_queued").decrement(batch.len() as f64);
        let written =
            batch.is_empty() || write_batch(&events, batch, &shutdown, grace, &mut deadline).await;
        if written {
            for flush in flushes {
                let _ = flush.send(());
            }
            continue;
        }
        // The grace ran out with Postgres unreachable: the rest is lost too.
        let mut lost: u32 = 0;
        while let Ok(item) = receiver.try_recv() {
            lost += u32::from(matches!(item, Queued::Event { .. }));
        }
        metrics::gauge!("ctxsync_catalog_events_queued").decrement(f64::from(lost));
        metrics::counter!("ctxsync_catalog_events_lost_total").increment(u64::from(lost));
        if lost > 0 {
            tracing::error!(lost, "queued events not written within the shutdown grace");
        }
        return;
    }
}

/// Writes one batch, retrying while Postgres fails; false when shutdown's
/// grace ran out first (the batch is counted lost).
async fn write_batch(
    events: &Events,
    batch: Vec<(DateTime<Utc>, NewEvent)>,
    shutdown: &Shutdown,
    grace: Duration,
    deadline: &mut Option<tokio::time::Instant>,
) -> bool {
    let (occurred, batch): (Vec<Option<DateTime<Utc>>>, Vec<NewEvent>) = batch
        .into_iter()
        .map(|(occurred_at, event)| (Some(occurred_at), event))
        .unzip();
    let mut wait = RETRY_FIRST;
    loop {
        let written = async {
            let mut conn = events.pool.acquire().await?;
            store::insert_events_at(&mut conn, batch.clone(), &occurred).await
        }
        .await;
        match written {
            Ok(written) => {
                metrics::counter!("ctxsync_catalog_events_written_total")
                    .increment(written.len() as u64);
                events.publish(&written).await;
                return true;
            }
            Err(error) => {
                metrics::counter!("ctxsync_catalog_event_write_failures_total").increment(1);
                tracing::warn!(
                    error = %ctxsync_runtime::db::describe(&error),
                    events = batch.len(),
                    retry_in = ?wait,
                    "cannot write queued events; holding them"
                );
            }
        }
        let retry_at = tokio::time::Instant::now() + wait;
        wait = (wait * 2).min(RETRY_MAX);
        loop {
            let until = deadline.map_or(retry_at, |at| at.min(retry_at));
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    *deadline = Some(tokio::time::Instant::now() + grace);
                }
            }
        }
        if deadline.is_some_and(|at| tokio::time::Instant::now() >= at) {
            metrics::counter!("ctxsync_catalog_events_lost_total").increment(batch.len() as u64);
            tracing::error!(
                lost = batch.len(),
                "queued events not written within the shutdown grace"
            );
            return false;
        }
    }
}
