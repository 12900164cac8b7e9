//! Group commit for pushes: pushes that arrive while the replica's push
//! transactions are all busy are committed together in the next one.
//!
//! A push that finds a transaction free goes at once, in a batch of one.
//! Under load, one batch does for many agents what a push does for one, in
//! the same number of statements ([`Store::push_batch`]): Postgres' work
//! per push shrinks, and so does the CPU it takes from the rest of the
//! machine. A push whose agent's row is locked elsewhere leaves the batch
//! and waits alone ([`Store::push`]), holding no transaction slot.
//!
//! Each transaction slot has a Postgres connection of its own, outside the
//! pool ([`Connections`]): sqlx tests a pooled connection with a round trip
//! each time it goes back, which for a push is one statement in eight, and
//! it would wake a Postgres backend right as the push's events go out.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ctxsync_proto::v1::PushContextStateRequest;
use ctxsync_runtime::db::PING_IF_IDLE_FOR;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions as _, Connection as _, PgConnection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use uuid::Uuid;

use crate::db::{BatchError, BatchOutcome, PushOutcome, Store, StoreError};

/// Most pushes one transaction commits: bounds its statements' arrays and
/// the time its row locks are held.
pub const MAX_BATCH: usize = 64;

/// Pushes waiting for a transaction, at most; a push beyond it waits for
/// room (the rpc server's in-flight bound is what stops new requests).
const QUEUE: usize = 1024;

/// The `application_name` of the batcher's connections (suffixed to the
/// pool's, if it has one).
pub const PUSH_CONNECTION_NAME: &str = "snapshot-store pushes";

type Answer = oneshot::Sender<Result<PushOutcome, StoreError>>;

struct Queued {
    agent_id: Uuid,
    push: PushContextStateRequest,
    deadline: Option<tokio::time::Instant>,
    answer: Answer,
}

/// Where a replica's pushes go to be committed.
#[derive(Clone)]
pub struct PushBatcher {
    queue: mpsc::Sender<Queued>,
}

impl PushBatcher {
    /// Starts the batcher: at most `transactions` push transactions at once.
    /// It stops when the last handle is dropped, after answering what it holds.
    pub fn start(store: Store, transactions: usize) -> Self {
        let (queue, pushes) = mpsc::channel(QUEUE);
        let transactions = transactions.max(1);
        let pool_options = store.pool().connect_options();
        // Named apart in pg_stat_activity (after the operator's name, if any).
        let name = match pool_options.get_application_name() {
            Some(name) => format!("{name} {PUSH_CONNECTION_NAME}"),
            None => PUSH_CONNECTION_NAME.to_owned(),
        };
        let connections = Arc::new(Connections {
            options: (*pool_options).clone().application_name(&name),
            take_timeout: store.pool().options().get_acquire_timeout(),
            idle: Mutex::new(Vec::with_capacity(transactions)),
        });
        tokio::spawn(batch_loop(
            store,
            connections,
            pushes,
            Arc::new(Semaphore::new(transactions)),
            transactions,
        ));
        Self { queue }
    }

    /// Commits one push, alone or with others, and answers as
    /// [`Store::push`] does.
    pub async fn push(
        &self,
        agent_id: Uuid,
        push: PushContextStateRequest,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<PushOutcome, StoreError> {
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            agent_id,
            push,
            deadline,
            answer,
        };
        if self.queue.send(queued).await.is_err() {
            return Err(StoreError::Stopped);
        }
        answered.await.unwrap_or(Err(StoreError::Stopped))
    }
}

/// The batcher's connections, at most one per transaction slot (a slot's
/// permit is held while its connection is out). Idle ones wait here with
/// the moment they came back.
struct Connections {
    options: PgConnectOptions,
    /// The pool's acquire timeout: a stalled Postgres holds no slot longer.
    take_timeout: Duration,
    idle: Mutex<Vec<(PgConnection, Instant)>>,
}

impl Connections {
    /// An idle connection, pinged first if it sat idle over
    /// [`PING_IF_IDLE_FOR`] as the pool's are (Postgres may have restarted
    /// since; a dead one is dropped); else a new one. Within the pool's
    /// acquire timeout, as the pool's.
    async fn take(&self) -> Result<PgConnection, sqlx::Error> {
        tokio::time::timeout(self.take_timeout, self.take_unbounded())
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    }

    async fn take_unbounded(&self) -> Result<PgConnection, sqlx::Error> {
        loop {
            let idle = self.idle.lock().expect("connections lock").pop();
            let Some((mut connection, since)) = idle else {
                return self.options.connect().await;
            };
            if since.elapsed() <= PING_IF_IDLE_FOR || connection.ping().await.is_ok() {
                return Ok(connection);
            }
        }
    }

    /// Back after a transaction that ended cleanly (committed or rolled
    /// back); one whose transaction failed is dropped instead, its state unknown.
    fn put_back(&self, connection: PgConnection) {
        self.idle
            .lock()
            .expect("connections lock")
            .push((connection, Instant::now()));
    }

    /// Closes the idle connections (a goodbye to Postgres, not a dropped socket).
    async fn close(&self) {
        let idle = std::mem::take(&mut *self.idle.lock().expect("connections lock"));
        for (connection, _) in idle {
            let _ = connection.close().await;
        }
    }
}

async fn batch_loop(
    store: Store,
    connections: Arc<Connections>,
    mut pushes: mpsc::Receiver<Queued>,
    permits: Arc<Semaphore>,
    transactions: usize,
) {
    // Pushes for an agent that already had one in the batch being formed:
    // they go first into the next, in the order they came.
    let mut held: VecDeque<Queued> = VecDeque::new();
    loop {
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let first = match held.pop_front() {
            Some(queued) => queued,
            None => match pushes.recv().await {
                Some(queued) => queued,
                None => {
                    // Every batch has ended once every slot is free.
                    drop(permit);
                    let all = u32::try_from(transactions).unwrap_or(u32::MAX);
                    let _ = permits.acquire_many(all).await;
                    connections.close().await;
                    return;
                }
            },
        };
        let mut agents = HashSet::from([first.agent_id]);
        let mut batch = vec![first];
        let mut next_held = VecDeque::new();
        while batch.len() < MAX_BATCH {
            let Some(queued) = held.pop_front().or_else(|| pushes.try_recv().ok()) else {
                break;
            };
            if agents.insert(queued.agent_id) {
                batch.push(queued);
            } else {
                next_held.push_back(queued);
            }
        }
        next_held.extend(held.drain(..));
        held = next_held;
        tokio::spawn(commit(store.clone(), connections.clone(), batch, permit));
    }
}

/// Commits one batch and answers each of its pushes. The permit is held
/// for the batch's transaction only, which never waits for a row lock:
/// pushes that would wait go alone afterwards, holding none, so an agent
/// another replica holds locked stalls no other agent's push.
async fn commit(
    store: Store,
    connections: Arc<Connections>,
    batch: Vec<Queued>,
    permit: OwnedSemaphorePermit,
) {
    let (live, expired): (Vec<Queued>, Vec<Queued>) = batch
        .into_iter()
        .partition(|q| !ctxsync_runtime::rpc::expired(q.deadline));
    for queued in expired {
        let _ = queued.answer.send(Err(StoreError::DeadlineExceeded));
    }
    if live.is_empty() {
        return;
    }
    let deadline = live.iter().filter_map(|q| q.deadline).min();
    let mut waiting = Vec::with_capacity(live.len());
    let mut pushes = Vec::with_capacity(live.len());
    for queued in live {
        pushes.push((queued.agent_id, queued.push));
        waiting.push((queued.agent_id, queued.deadline, queued.answer));
    }
    let result = match connections.take().await {
        Ok(mut connection) => {
            let result = store.push_batch(&mut connection, pushes, deadline).await;
            if result.is_ok() {
                connections.put_back(connection);
            }
            result
        }
        Err(error) => Err(BatchError::Before {
            error: error.into(),
            pushes,
        }),
    };
    drop(permit);
    let mut alone_ones = tokio::task::JoinSet::new();
    let mut go_alone = |(agent_id, deadline, answer): (Uuid, _, Answer), push| {
        let store = store.clone();
        alone_ones.spawn(async move {
            let outcome = store.push(agent_id, push, deadline).await;
            let _ = answer.send(outcome);
        });
    };
    match result {
        Ok(outcomes) => {
            for (waiter, outcome) in waiting.into_iter().zip(outcomes) {
                match outcome {
                    BatchOutcome::Done(outcome) => {
                        let _ = waiter.2.send(outcome);
                    }
                    BatchOutcome::Unlocked(push) => go_alone(waiter, push),
                }
            }
        }
        // Nothing was written: one push's trouble (the earliest deadline
        // passing) must not fail the others, so each is tried on its own.
        Err(BatchError::Before { error, pushes }) => {
            tracing::debug!(%error, pushes = pushes.len(), "push batch not committed: each push tried alone");
            for (waiter, (_, push)) in waiting.into_iter().zip(pushes) {
                go_alone(waiter, push);
            }
        }
        Err(BatchError::Commit(error)) => {
            tracing::warn!(%error, pushes = waiting.len(), "push batch commit failed: outcome unknown");
            for (_, _, answer) in waiting {
                let _ = answer.send(Err(StoreError::CommitUnknown(error.to_string())));
            }
        }
    }
    while alone_ones.join_next().await.is_some() {}
}
