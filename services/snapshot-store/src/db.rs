//! The store's transactions. Every write to an agent locks its row first, so
//! startups and pushes for one agent are serialized across any number of
//! store replicas, and the run-id check reads what the write commits against.
//! Every accepted write raises the agent's revision under that lock, so
//! accepted writes are numbered in commit order.

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use ctxsync_proto::ids;
use ctxsync_proto::v1::{
    Agent, AgentState, ContextConfig, ContextResource, DiscoveryChanged, PushContextStateRequest,
    PushDropReason, Snapshot, SnapshotCommitted, StartupRequest, StartupResponse,
    mcp_discovery::Phase,
};
use ctxsync_proto::validate::{self, ValidationError};
use pbjson_types::Timestamp;
use prost::Message;
use sqlx::postgres::PgRow;
use sqlx::{Connection as _, PgConnection, PgPool, Postgres, Row, Transaction};
use store_core::{PushContent, PushPlan, StartupPlan, StoredAgent, StoredSnapshot};
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("agent {0} not found")]
    NotFound(Uuid),
    #[error("no agent named {name:?} in {tenant}/{workspace}")]
    NoSuchAgentName {
        tenant: String,
        workspace: String,
        name: String,
    },
    #[error("tenant key {0:?} not found")]
    KeyNotFound(String),
    #[error("a tenant key with this digest exists already: generate a new key")]
    KeyExists,
    #[error("invalid agent id {0:?}")]
    InvalidAgentId(String),
    #[error("a list of agents needs a tenant")]
    MissingTenant,
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error("an agent named {name:?} already exists in {tenant}/{workspace}")]
    AlreadyExists {
        tenant: String,
        workspace: String,
        name: String,
    },
    /// Shown as SQLSTATE and message only ([`ctxsync_runtime::db::describe`]).
    #[error("database error: {}", ctxsync_runtime::db::describe(.0))]
    Database(sqlx::Error),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// COMMIT failed in a way that leaves unknown whether it landed.
    #[error("the commit's outcome is unknown: {0}")]
    CommitUnknown(String),
    /// The store is shutting down and took no more work.
    #[error("the store is stopping")]
    Stopped,
    /// The request's sender gave up before it could commit: rolled back.
    #[error("the request's deadline passed before it committed: nothing was written")]
    DeadlineExceeded,
}

/// Agents in one page of a list when the request names no limit, and at most.
const LIST_AGENTS_DEFAULT: u32 = 50;
const LIST_AGENTS_MAX: u32 = 200;

/// How many superseded runs are remembered per agent (oldest forgotten first).
/// A run older than that could take the agent back with a late startup only
/// until the live process reclaims it.
const SUPERSEDED_RUNS_KEPT: i64 = 100;

/// Postgres' SQLSTATE for `lock_timeout` (lock_not_available).
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// What a startup did.
#[derive(Debug)]
pub struct StartupOutcome {
    /// `drop_reason` is set when the startup was dropped (nothing written).
    pub response: StartupResponse,
    /// The run-id-changed event to publish, if the run id changed; it carries
    /// the state after the commit.
    pub discovery_changed: Option<Box<DiscoveryChanged>>,
}

/// What a push did.
#[derive(Debug)]
pub enum PushOutcome {
    /// Both events are to carry `state`, the state after the commit (left
    /// out of them here: the publisher moves the one state from one event to
    /// the other instead of copying it).
    Accepted {
        /// The phase-or-run-id-changed event to publish, if either changed.
        discovery_changed: Option<Box<DiscoveryChanged>>,
        /// The every-push event.
        snapshot_committed: Box<SnapshotCommitted>,
        state: Box<AgentState>,
    },
    Dropped {
        reason: PushDropReason,
        message: String,
    },
}

pub fn parse_agent_id(id: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(id).map_err(|_| StoreError::InvalidAgentId(id.to_owned()))
}

pub fn phase_to_db(phase: Phase) -> &'static str {
    match phase {
        Phase::Unspecified => "unspecified",
        Phase::Pending => "pending",
        Phase::Complete => "complete",
    }
}

fn phase_from_db(text: &str) -> Result<Phase, StoreError> {
    match text {
        "unspecified" => Ok(Phase::Unspecified),
        "pending" => Ok(Phase::Pending),
        "complete" => Ok(Phase::Complete),
        other => Err(StoreError::Corrupt(format!("unknown phase {other:?}"))),
    }
}

/// Begins a transaction whose lock waits end at `deadline`: a replica that
/// stalls while holding an agent's row lock cannot keep the others' requests
/// waiting past the moment their senders give up.
async fn begin(
    pool: &PgPool,
    deadline: Option<tokio::time::Instant>,
) -> Result<Transaction<'static, Postgres>, StoreError> {
    Ok(match begin_statement(deadline)? {
        None => pool.begin().await?,
        Some(statement) => pool.begin_with(sqlx::AssertSqlSafe(statement)).await?,
    })
}

/// [`begin`] on a connection the caller holds.
async fn begin_on(
    connection: &mut PgConnection,
    deadline: Option<tokio::time::Instant>,
) -> Result<Transaction<'_, Postgres>, StoreError> {
    Ok(match begin_statement(deadline)? {
        None => connection.begin().await?,
        Some(statement) => {
            connection
                .begin_with(sqlx::AssertSqlSafe(statement))
                .await?
        }
    })
}

/// The BEGIN that bounds the transaction's lock waits by `deadline`, if any.
fn begin_statement(deadline: Option<tokio::time::Instant>) -> Result<Option<String>, StoreError> {
    let Some(deadline) = deadline else {
        return Ok(None);
    };
    let remaining = deadline
        .checked_duration_since(tokio::time::Instant::now())
        .ok_or(StoreError::DeadlineExceeded)?;
    // lock_timeout 0 would mean "no limit".
    let millis = remaining.as_millis().clamp(1, i32::MAX as u128);
    Ok(Some(format!("BEGIN; SET LOCAL lock_timeout = {millis}")))
}

impl From<sqlx::Error> for StoreError {
    /// A lock wait that ran out of time (`lock_timeout` is only set from a
    /// request's deadline) is the deadline passing.
    fn from(error: sqlx::Error) -> Self {
        match &error {
            sqlx::Error::Database(db) if db.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                Self::DeadlineExceeded
            }
            _ => Self::Database(error),
        }
    }
}

/// Commits unless the sender has given up: then rolls back, so work nobody
/// waits for never lands (it would be late by definition).
async fn commit_before(
    tx: Transaction<'_, Postgres>,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), StoreError> {
    if ctxsync_runtime::rpc::expired(deadline) {
        tx.rollback().await?;
        return Err(StoreError::DeadlineExceeded);
    }
    tx.commit().await?;
    Ok(())
}

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
}

impl Store {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the schema's migrations (their bookkeeping lives in the schema too,
    /// so other services' migrations in the same database don't collide).
    pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.create_schema("snapshot");
        migrator.dangerous_set_table_name("snapshot._sqlx_migrations");
        migrator.run(pool).await
    }

    pub async fn register(
        &self,
        tenant: &str,
        workspace: &str,
        name: &str,
        token_sha256: &[u8],
    ) -> Result<Uuid, StoreError> {
        let checked = [
            ("tenant", ids::tenant(tenant)),
            ("workspace", ids::name("workspace", workspace)),
            ("name", ids::name("agent name", name)),
        ];
        if let Some((field, Err(error))) = checked.into_iter().find(|(_, c)| c.is_err()) {
            return Err(StoreError::Invalid(ValidationError::Invalid {
                field: field.into(),
                reason: error.to_string(),
            }));
        }
        if token_sha256.len() != 32 {
            return Err(StoreError::Invalid(ValidationError::Invalid {
                field: "token_sha256".into(),
                reason: format!("must be 32 bytes, got {}", token_sha256.len()),
            }));
        }
        let agent_id = Uuid::new_v4();
        let inserted = sqlx::query(
            "INSERT INTO snapshot.agents (agent_id, tenant, workspace, name, token_sha256)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (tenant, workspace, name) DO NOTHING",
        )
        .bind(agent_id)
        .bind(tenant)
        .bind(workspace)
        .bind(name)
        .bind(token_sha256)
        .execute(&self.pool)
        .await?;
        if inserted.rows_affected() == 0 {
            return Err(StoreError::AlreadyExists {
                tenant: tenant.into(),
                workspace: workspace.into(),
                name: name.into(),
            });
        }
        Ok(agent_id)
    }

    /// Replaces the token of the agent named `tenant/workspace/name`.
    pub async fn rotate_token(
        &self,
        tenant: &str,
        workspace: &str,
        name: &str,
        token_sha256: &[u8],
    ) -> Result<Uuid, StoreError> {
        if token_sha256.len() != 32 {
            return Err(StoreError::Invalid(ValidationError::Invalid {
                field: "token_sha256".into(),
                reason: format!("must be 32 bytes, got {}", token_sha256.len()),
            }));
        }
        let row = sqlx::query(
            "UPDATE snapshot.agents SET token_sha256 = $4
             WHERE tenant = $1 AND workspace = $2 AND name = $3
             RETURNING agent_id",
        )
        .bind(tenant)
        .bind(workspace)
        .bind(name)
        .bind(token_sha256)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => Ok(row.get("agent_id")),
            None => Err(StoreError::NoSuchAgentName {
                tenant: tenant.into(),
                workspace: workspace.into(),
                name: name.into(),
            }),
        }
    }

    pub async fn authenticate(&self, token_sha256: &[u8]) -> Result<Option<Uuid>, StoreError> {
        let row = sqlx::query("SELECT agent_id FROM snapshot.agents WHERE token_sha256 = $1")
            .bind(token_sha256)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.get("agent_id")))
    }

    /// UpdateStartup: overwrites the agent's run id (empty included), unless
    /// the startup names a run the agent already moved away from: that one is
    /// late or replayed and is dropped, unless it is a reclaim
    /// ([`store_core::plan_startup`] decides; this carries it out).
    pub async fn update_startup(
        &self,
        agent_id: Uuid,
        startup: &StartupRequest,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<StartupOutcome, StoreError> {
        validate::startup(startup)?;
        // A re-announcement of the current run changes nothing: answered
        // without the lock or a write (live agents repeat it periodically).
        let row = sqlx::query(
            "SELECT agent_run_id, agent_version FROM snapshot.agents WHERE agent_id = $1",
        )
        .bind(agent_id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound(agent_id))?;
        let stored = StoredAgent {
            agent_run_id: row.get("agent_run_id"),
            agent_version: row.get("agent_version"),
        };
        if let Some(response) = store_core::repeated_startup(stored, startup) {
            return Ok(StartupOutcome {
                response,
                discovery_changed: None,
            });
        }

        let mut tx = begin(&self.pool, deadline).await?;
        let locked = lock_agent(&mut tx, agent_id).await?.agent;
        let stored = StoredAgent {
            agent_run_id: &locked.agent_run_id,
            agent_version: &locked.agent_version,
        };
        let superseded = store_core::superseded_matters(stored, startup)
            && sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM snapshot.superseded_runs
                                WHERE agent_id = $1 AND agent_run_id = $2)",
            )
            .bind(agent_id)
            .bind(&startup.agent_run_id)
            .fetch_one(&mut *tx)
            .await?;
        let write = match store_core::plan_startup(stored, startup, superseded) {
            StartupPlan::Repeated(response) | StartupPlan::Dropped(response) => {
                tx.rollback().await?;
                return Ok(StartupOutcome {
                    response,
                    discovery_changed: None,
                });
            }
            StartupPlan::Write(write) => write,
        };
        sqlx::query(
            "UPDATE snapshot.agents
             SET agent_run_id = $2, agent_version = $3, startup_at = clock_timestamp()
             WHERE agent_id = $1",
        )
        .bind(agent_id)
        .bind(&write.agent_run_id)
        .bind(&startup.agent_version)
        .execute(&mut *tx)
        .await?;
        if write.records_superseded() {
            record_superseded(
                &mut tx,
                agent_id,
                &write.previous_agent_run_id,
                &write.agent_run_id,
            )
            .await?;
        }
        // Only an event needs the state; read under the lock, it is exactly
        // what commits.
        let state = if write.publishes() {
            Some(read_state(&mut *tx, agent_id).await?)
        } else {
            None
        };
        commit_before(tx, deadline).await?;
        let committed_at = Timestamp::from(Utc::now());
        let discovery_changed = state.map(|state| {
            Box::new(write.discovery_changed(&agent_id.to_string(), state, committed_at))
        });
        Ok(StartupOutcome {
            response: write.response(),
            discovery_changed,
        })
    }

    /// PushContextState: every rule of the report path in one transaction
    /// ([`store_core::plan_push`] decides; this carries it out).
    pub async fn push(
        &self,
        agent_id: Uuid,
        push: PushContextStateRequest,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<PushOutcome, StoreError> {
        validate::push(&push)?;
        let version = checked_version(&push)?;
        let started = Instant::now();
        let content = PushContent::of(&push);

        let mut tx = begin(&self.pool, deadline).await?;
        let locked = lock_agent(&mut tx, agent_id).await?;
        let row = sqlx::query(
            "SELECT agent_run_id AS snapshot_run_id, version, phase, hash
             FROM snapshot.snapshots WHERE agent_id = $1",
        )
        .bind(agent_id)
        .fetch_optional(&mut *tx)
        .await?;
        let stored = match &row {
            Some(row) => Some(StoredSnapshot {
                agent_run_id: row.get("snapshot_run_id"),
                // Only ever written from a validated version: never negative.
                version: row.get::<i64, _>("version") as u64,
                phase: phase_from_db(row.get("phase"))?,
                hash: row.get("hash"),
            }),
            None => None,
        };
        let write = match store_core::plan_push(&locked.agent.agent_run_id, stored, &push, &content)
        {
            PushPlan::Dropped { reason, message } => {
                tx.rollback().await?;
                record_push_transaction(started, "dropped");
                return Ok(PushOutcome::Dropped { reason, message });
            }
            PushPlan::Write(write) => write,
        };

        // clock_timestamp(), not now(): now() is the transaction's start,
        // before the lock wait. RETURNING gives the stored value, rounded as
        // a read returns it.
        let received_at: DateTime<Utc> = sqlx::query_scalar(
            "INSERT INTO snapshot.snapshots
                 (agent_id, agent_run_id, version, phase, hash, context_config, received_at)
             VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp())
             ON CONFLICT (agent_id) DO UPDATE SET
                 agent_run_id = EXCLUDED.agent_run_id, version = EXCLUDED.version,
                 phase = EXCLUDED.phase, hash = EXCLUDED.hash,
                 context_config = EXCLUDED.context_config, received_at = EXCLUDED.received_at
             RETURNING received_at",
        )
        .bind(agent_id)
        .bind(&push.agent_run_id)
        .bind(version)
        .bind(phase_to_db(content.phase))
        .bind(&content.hash)
        .bind(&content.config)
        .fetch_one(&mut *tx)
        .await?;

        if write.rewrites_resources {
            write_resources(&mut tx, agent_id, &push.resources).await?;
        }
        if let Err(error) = commit_before(tx, deadline).await {
            record_push_transaction(started, "expired");
            return Err(error);
        }
        record_push_transaction(started, "accepted");

        // The event's commit time is when COMMIT returned, not when the row
        // was stamped inside the transaction: waits are measured from it.
        let committed_at = Timestamp::from(Utc::now());
        let id = agent_id.to_string();
        let discovery_changed = write
            .discovery_changed(&id, locked.revision, committed_at)
            .map(Box::new);
        let snapshot_committed =
            Box::new(write.snapshot_committed(&id, locked.revision, committed_at));
        let state = write.state(
            locked.agent,
            locked.revision,
            content.context_config,
            push.resources,
            received_at.into(),
        );
        Ok(PushOutcome::Accepted {
            discovery_changed,
            snapshot_committed,
            state: Box::new(state),
        })
    }

    /// Several agents' pushes in one transaction (group commit): every rule
    /// of [`Self::push`] applied to each, with its own answer, but one lock
    /// statement, one snapshot read, one upsert and one resource rewrite for
    /// all of them, and one commit. Each report stays atomic: the batch
    /// commits whole or not at all.
    ///
    /// The agents must be distinct (a second push for one agent waits for
    /// the next batch). A batch never waits for a row lock: an agent whose
    /// row another transaction holds (or that does not exist) is handed back
    /// [`BatchOutcome::Unlocked`], to be pushed alone. The lock raises each
    /// locked agent's revision; an agent whose push is not written gets its
    /// revision back before the commit, so a dropped push raises none.
    /// `deadline` is the earliest of the pushes'.
    pub async fn push_batch(
        &self,
        connection: &mut PgConnection,
        mut pushes: Vec<(Uuid, PushContextStateRequest)>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Vec<BatchOutcome>, BatchError> {
        let started = Instant::now();
        let mut outcomes: Vec<Option<Result<PushOutcome, StoreError>>> =
            (0..pushes.len()).map(|_| None).collect();
        let planned = match self
            .write_batch(connection, &pushes, &mut outcomes, deadline, started)
            .await
        {
            Ok(planned) => planned,
            Err(error) => return Err(BatchError::Before { error, pushes }),
        };
        if let Some((tx, writes)) = planned {
            match commit_before(tx, deadline).await {
                Ok(()) => {}
                Err(error @ StoreError::DeadlineExceeded) => {
                    record_push_transaction(started, "expired");
                    return Err(BatchError::Before { error, pushes });
                }
                Err(error) => return Err(BatchError::Commit(error)),
            }
            let committed_at = Timestamp::from(Utc::now());
            for batch in writes {
                record_push_transaction(started, "accepted");
                let id = batch.agent_id.to_string();
                let discovery_changed = batch
                    .write
                    .discovery_changed(&id, batch.revision, committed_at)
                    .map(Box::new);
                let snapshot_committed = Box::new(batch.write.snapshot_committed(
                    &id,
                    batch.revision,
                    committed_at,
                ));
                let state = batch.write.state(
                    batch.agent,
                    batch.revision,
                    batch.content.context_config,
                    std::mem::take(&mut pushes[batch.n].1.resources),
                    batch.received_at.into(),
                );
                outcomes[batch.n] = Some(Ok(PushOutcome::Accepted {
                    discovery_changed,
                    snapshot_committed,
                    state: Box::new(state),
                }));
            }
        }
        metrics::histogram!("ctxsync_store_push_batch_size").record(outcomes.len() as f64);
        Ok(outcomes
            .into_iter()
            .zip(pushes)
            .map(|(outcome, (_, push))| match outcome {
                Some(outcome) => BatchOutcome::Done(outcome),
                None => BatchOutcome::Unlocked(push),
            })
            .collect())
    }

    /// [`Self::push_batch`] up to its commit: the pushes that are not
    /// written are answered in `outcomes` (but those whose agent row it did
    /// not lock); the written ones are returned with the transaction that
    /// wrote them (none: it was rolled back).
    async fn write_batch<'c>(
        &self,
        connection: &'c mut PgConnection,
        pushes: &[(Uuid, PushContextStateRequest)],
        outcomes: &mut [Option<Result<PushOutcome, StoreError>>],
        deadline: Option<tokio::time::Instant>,
        started: Instant,
    ) -> Result<Option<(Transaction<'c, Postgres>, Vec<BatchWrite>)>, StoreError> {
        let mut checked = Vec::with_capacity(pushes.len());
        for (n, (agent_id, push)) in pushes.iter().enumerate() {
            match validate::push(push)
                .map_err(StoreError::from)
                .and_then(|()| checked_version(push))
            {
                Ok(version) => checked.push((n, *agent_id, version)),
                Err(error) => outcomes[n] = Some(Err(error)),
            }
        }
        let ids: Vec<Uuid> = checked.iter().map(|c| c.1).collect();

        let mut tx = begin_on(connection, deadline).await?;
        // Locks and raises in one statement, as a single push does; the
        // revisions of agents whose push is not written are put back below.
        let agent_rows = sqlx::query(
            "UPDATE snapshot.agents a SET revision = a.revision + 1
             FROM (SELECT agent_id FROM snapshot.agents WHERE agent_id = ANY($1)
                   ORDER BY agent_id FOR UPDATE SKIP LOCKED) locked
             WHERE a.agent_id = locked.agent_id
             RETURNING a.agent_id, a.tenant, a.workspace, a.name, a.agent_run_id,
                       a.agent_version, a.created_at, a.startup_at, a.revision",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        let mut agents: HashMap<Uuid, (Agent, u64)> = agent_rows
            .iter()
            .map(|row| {
                let id: Uuid = row.get("agent_id");
                (id, (agent_from_row(id, row), revision_from_row(row)))
            })
            .collect();
        // A later statement than the lock's: see lock_agent.
        let snapshot_rows = sqlx::query(
            "SELECT agent_id, agent_run_id, version, phase, hash
             FROM snapshot.snapshots WHERE agent_id = ANY($1)",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        let snapshots: HashMap<Uuid, &PgRow> = snapshot_rows
            .iter()
            .map(|row| (row.get("agent_id"), row))
            .collect();

        let mut writes = Vec::with_capacity(checked.len());
        let mut unwritten = Vec::new();
        for (n, agent_id, version) in checked {
            let push = &pushes[n].1;
            // Locked by another transaction, or absent: left unanswered.
            let Some((agent, revision)) = agents.remove(&agent_id) else {
                continue;
            };
            let stored = match snapshots.get(&agent_id) {
                None => None,
                Some(row) => match phase_from_db(row.get("phase")) {
                    Ok(phase) => Some(StoredSnapshot {
                        agent_run_id: row.get("agent_run_id"),
                        // Only ever written from a validated version: never negative.
                        version: row.get::<i64, _>("version") as u64,
                        phase,
                        hash: row.get("hash"),
                    }),
                    Err(error) => {
                        outcomes[n] = Some(Err(error));
                        unwritten.push(agent_id);
                        continue;
                    }
                },
            };
            let content = PushContent::of(push);
            match store_core::plan_push(&agent.agent_run_id, stored, push, &content) {
                PushPlan::Dropped { reason, message } => {
                    record_push_transaction(started, "dropped");
                    outcomes[n] = Some(Ok(PushOutcome::Dropped { reason, message }));
                    unwritten.push(agent_id);
                }
                PushPlan::Write(write) => writes.push(BatchWrite {
                    n,
                    agent_id,
                    agent,
                    version,
                    content,
                    write,
                    revision,
                    received_at: DateTime::<Utc>::MIN_UTC,
                }),
            }
        }
        if writes.is_empty() {
            tx.rollback().await?;
            return Ok(None);
        }
        if !unwritten.is_empty() {
            // Still under the lock, so no one saw the raise.
            sqlx::query(
                "UPDATE snapshot.agents SET revision = revision - 1 WHERE agent_id = ANY($1)",
            )
            .bind(&unwritten)
            .execute(&mut *tx)
            .await?;
        }
        write_rows(&mut tx, pushes, &mut writes).await?;
        Ok(Some((tx, writes)))
    }

    /// One page of a tenant's agents (ordered by id, after `after`), each
    /// read like [`Self::agent_state`] but with instruction files' content
    /// left out; and the id to continue after when there may be more.
    pub async fn list_agents(
        &self,
        tenant: &str,
        limit: u32,
        after: Option<Uuid>,
    ) -> Result<(Vec<AgentState>, Option<Uuid>), StoreError> {
        if tenant.is_empty() {
            return Err(StoreError::MissingTenant);
        }
        let limit = match limit {
            0 => LIST_AGENTS_DEFAULT,
            n => n.min(LIST_AGENTS_MAX),
        };
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT agent_id FROM snapshot.agents
             WHERE tenant = $1 AND ($2::uuid IS NULL OR agent_id > $2)
             ORDER BY agent_id LIMIT $3",
        )
        .bind(tenant)
        .bind(after)
        .bind(i64::from(limit) + 1)
        .fetch_all(&self.pool)
        .await?;
        let more = ids.len() > limit as usize;
        let mut states = Vec::with_capacity(ids.len().min(limit as usize));
        for id in ids.into_iter().take(limit as usize) {
            let mut state = match read_state(&self.pool, id).await {
                Ok(state) => state,
                // Deleted between the two reads: not listed.
                Err(StoreError::NotFound(_)) => continue,
                Err(error) => return Err(error),
            };
            for resource in &mut state.resources {
                if let Some(ctxsync_proto::v1::context_resource::Body::InstructionFile(file)) =
                    resource.body.as_mut()
                {
                    file.content.clear();
                }
            }
            states.push(state);
        }
        let next = if more {
            states
                .last()
                .and_then(|s| s.agent.as_ref())
                .and_then(|a| Uuid::parse_str(&a.agent_id).ok())
        } else {
            None
        };
        Ok((states, next))
    }

    /// The agent row, its snapshot and resources, in one statement (one consistent read).
    pub async fn agent_state(&self, agent_id: Uuid) -> Result<AgentState, StoreError> {
        read_state(&self.pool, agent_id).await
    }
}

/// The agent row, its snapshot and resources, in one statement (one consistent
/// read), on the pool or inside a transaction.
async fn read_state<'e, E>(executor: E, agent_id: Uuid) -> Result<AgentState, StoreError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let rows = sqlx::query(
        "SELECT a.tenant, a.workspace, a.name, a.agent_run_id, a.agent_version,
                a.created_at, a.startup_at, a.revision,
                s.agent_run_id AS snapshot_run_id, s.version, s.phase, s.hash,
                s.context_config, s.received_at,
                r.source, r.kind, r.status, r.error, r.warning, r.body
         FROM snapshot.agents a
         LEFT JOIN snapshot.snapshots s USING (agent_id)
         LEFT JOIN snapshot.resources r ON r.agent_id = a.agent_id
         WHERE a.agent_id = $1
         ORDER BY r.position",
    )
    .bind(agent_id)
    .fetch_all(executor)
    .await?;
    let Some(first) = rows.first() else {
        return Err(StoreError::NotFound(agent_id));
    };
    let agent = agent_from_row(agent_id, first);
    let revision = revision_from_row(first);
    let snapshot = match first.get::<Option<String>, _>("snapshot_run_id") {
        None => None,
        Some(snapshot_run_id) => {
            let config: Vec<u8> = first.get("context_config");
            Some(Snapshot {
                agent_run_id: snapshot_run_id,
                version: first.get::<i64, _>("version") as u64,
                phase: phase_from_db(first.get("phase"))? as i32,
                hash: first.get("hash"),
                received_at: Some(first.get::<DateTime<Utc>, _>("received_at").into()),
                context_config: Some(
                    ContextConfig::decode(config.as_slice())
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                ),
            })
        }
    };
    let mut resources = Vec::new();
    if snapshot.is_some() {
        for row in &rows {
            let Some(source) = row.get::<Option<String>, _>("source") else {
                continue;
            };
            let body: Vec<u8> = row.get("body");
            let mut resource = ContextResource::decode(body.as_slice())
                .map_err(|e| StoreError::Corrupt(e.to_string()))?;
            resource.source = source;
            resource.kind = i32::from(row.get::<i16, _>("kind"));
            resource.status = i32::from(row.get::<i16, _>("status"));
            resource.error = row.get("error");
            resource.warning = row.get("warning");
            resources.push(resource);
        }
    }
    Ok(AgentState {
        agent: Some(agent),
        snapshot,
        resources,
        revision,
    })
}

/// The proto Agent of an agents row; the one conversion for reads and for
/// the lock's RETURNING, so both give equal messages.
fn agent_from_row(agent_id: Uuid, row: &PgRow) -> Agent {
    Agent {
        agent_id: agent_id.to_string(),
        tenant: row.get("tenant"),
        workspace: row.get("workspace"),
        name: row.get("name"),
        agent_run_id: row.get("agent_run_id"),
        agent_version: row.get("agent_version"),
        created_at: Some(row.get::<DateTime<Utc>, _>("created_at").into()),
        startup_at: row
            .get::<Option<DateTime<Utc>>, _>("startup_at")
            .map(Timestamp::from),
    }
}

fn revision_from_row(row: &PgRow) -> u64 {
    // Starts at 0 and only rises by one: never negative.
    row.get::<i64, _>("revision") as u64
}

fn record_push_transaction(started: Instant, outcome: &'static str) {
    metrics::histogram!("ctxsync_store_push_transaction_seconds", "outcome" => outcome)
        .record(started.elapsed().as_secs_f64());
}

/// The agent row as the lock returned it, with its raised revision.
struct LockedAgent {
    agent: Agent,
    revision: u64,
}

/// Locks the agent row for the rest of the transaction, raises its revision
/// and returns the row. An UPDATE locks the row as FOR UPDATE would; a
/// dropped push rolls back, so its revision never shows.
///
/// The lock is its own statement: under READ COMMITTED a statement that waited
/// for the lock would still read the rows it joins from before the wait, so
/// the snapshot must be read by a later statement.
async fn lock_agent(tx: &mut PgConnection, agent_id: Uuid) -> Result<LockedAgent, StoreError> {
    let row = sqlx::query(
        "UPDATE snapshot.agents SET revision = revision + 1 WHERE agent_id = $1
         RETURNING tenant, workspace, name, agent_run_id, agent_version,
                   created_at, startup_at, revision",
    )
    .bind(agent_id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(StoreError::NotFound(agent_id))?;
    Ok(LockedAgent {
        agent: agent_from_row(agent_id, &row),
        revision: revision_from_row(&row),
    })
}

/// After the run moved from `previous` to `current`: `previous` is superseded
/// (a late startup naming it will be dropped) and `current` is not (it may be
/// a reclaim). Only the newest [`SUPERSEDED_RUNS_KEPT`] are remembered.
async fn record_superseded(
    tx: &mut PgConnection,
    agent_id: Uuid,
    previous: &str,
    current: &str,
) -> Result<(), sqlx::Error> {
    if !current.is_empty() {
        sqlx::query(
            "DELETE FROM snapshot.superseded_runs WHERE agent_id = $1 AND agent_run_id = $2",
        )
        .bind(agent_id)
        .bind(current)
        .execute(&mut *tx)
        .await?;
    }
    if previous.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO snapshot.superseded_runs (agent_id, agent_run_id) VALUES ($1, $2)
         ON CONFLICT (agent_id, agent_run_id) DO UPDATE SET superseded_at = clock_timestamp()",
    )
    .bind(agent_id)
    .bind(previous)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM snapshot.superseded_runs
         WHERE agent_id = $1 AND agent_run_id IN (
             SELECT agent_run_id FROM snapshot.superseded_runs WHERE agent_id = $1
             ORDER BY superseded_at DESC OFFSET $2)",
    )
    .bind(agent_id)
    .bind(SUPERSEDED_RUNS_KEPT)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What a batch did with one of its pushes.
#[derive(Debug)]
pub enum BatchOutcome {
    /// Its answer.
    Done(Result<PushOutcome, StoreError>),
    /// Nothing: its agent's row was locked by another transaction (or is
    /// absent), so the push, handed back, is for [`Store::push`] alone.
    Unlocked(PushContextStateRequest),
}

/// Why a batch of pushes was not committed.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Failed before COMMIT was sent: nothing was written, so each push
    /// (handed back) can be tried again on its own.
    #[error("{error}")]
    Before {
        error: StoreError,
        pushes: Vec<(Uuid, PushContextStateRequest)>,
    },
    /// COMMIT itself failed: whether it landed is unknown, so no push of the
    /// batch may be tried again (a second try could answer "stale version"
    /// for a push that was written).
    #[error("{0}")]
    Commit(StoreError),
}

/// A push of a batch that is written.
struct BatchWrite {
    /// Its place in the batch.
    n: usize,
    agent_id: Uuid,
    /// The agent row as locked, and its raised revision.
    agent: Agent,
    revision: u64,
    version: i64,
    content: PushContent,
    write: store_core::PushWrite,
    /// Set by [`write_rows`]: the stored receive time.
    received_at: DateTime<Utc>,
}

/// The version as the snapshots table stores it.
fn checked_version(push: &PushContextStateRequest) -> Result<i64, StoreError> {
    i64::try_from(push.version).map_err(|_| {
        ValidationError::Invalid {
            field: "version".into(),
            reason: "must fit in a signed 64-bit integer".into(),
        }
        .into()
    })
}

/// A batch's rows: the written agents' snapshots upserted, the changed
/// ones' resources replaced; each write learns its stored receive time.
async fn write_rows(
    tx: &mut PgConnection,
    pushes: &[(Uuid, PushContextStateRequest)],
    writes: &mut [BatchWrite],
) -> Result<(), StoreError> {
    let ids: Vec<Uuid> = writes.iter().map(|w| w.agent_id).collect();

    let run_ids: Vec<&str> = writes
        .iter()
        .map(|w| pushes[w.n].1.agent_run_id.as_str())
        .collect();
    let versions: Vec<i64> = writes.iter().map(|w| w.version).collect();
    let phases: Vec<&str> = writes
        .iter()
        .map(|w| phase_to_db(w.content.phase))
        .collect();
    let hashes: Vec<&str> = writes.iter().map(|w| w.content.hash.as_str()).collect();
    let configs: Vec<&[u8]> = writes.iter().map(|w| w.content.config.as_slice()).collect();
    // clock_timestamp(), as in a single push: the time after the lock wait.
    let received: HashMap<Uuid, DateTime<Utc>> = sqlx::query(
        "INSERT INTO snapshot.snapshots
             (agent_id, agent_run_id, version, phase, hash, context_config, received_at)
         SELECT *, clock_timestamp()
         FROM UNNEST($1::uuid[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::bytea[])
         ON CONFLICT (agent_id) DO UPDATE SET
             agent_run_id = EXCLUDED.agent_run_id, version = EXCLUDED.version,
             phase = EXCLUDED.phase, hash = EXCLUDED.hash,
             context_config = EXCLUDED.context_config, received_at = EXCLUDED.received_at
         RETURNING agent_id, received_at",
    )
    .bind(&ids)
    .bind(&run_ids)
    .bind(&versions)
    .bind(&phases)
    .bind(&hashes)
    .bind(&configs)
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(|row| (row.get("agent_id"), row.get("received_at")))
    .collect();
    for write in writes.iter_mut() {
        let Some(&received_at) = received.get(&write.agent_id) else {
            return Err(StoreError::Corrupt(format!(
                "agent {} locked but not written",
                write.agent_id
            )));
        };
        write.received_at = received_at;
    }

    let rewritten: Vec<Uuid> = writes
        .iter()
        .filter(|w| w.write.rewrites_resources)
        .map(|w| w.agent_id)
        .collect();
    if !rewritten.is_empty() {
        sqlx::query("DELETE FROM snapshot.resources WHERE agent_id = ANY($1)")
            .bind(&rewritten)
            .execute(&mut *tx)
            .await?;
        let mut rows = ResourceRows::default();
        for write in writes.iter().filter(|w| w.write.rewrites_resources) {
            rows.extend(write.agent_id, &pushes[write.n].1.resources);
        }
        rows.insert(tx).await?;
    }
    Ok(())
}

/// Resource rows for one UNNEST insert, of one agent or several.
#[derive(Default)]
struct ResourceRows<'a> {
    agent_ids: Vec<Uuid>,
    sources: Vec<&'a str>,
    positions: Vec<i32>,
    kinds: Vec<i16>,
    statuses: Vec<i16>,
    errors: Vec<&'a str>,
    warnings: Vec<&'a str>,
    bodies: Vec<Vec<u8>>,
}

impl<'a> ResourceRows<'a> {
    fn extend(&mut self, agent_id: Uuid, resources: &'a [ContextResource]) {
        for (position, resource) in resources.iter().enumerate() {
            self.agent_ids.push(agent_id);
            self.sources.push(resource.source.as_str());
            self.positions.push(position as i32);
            // Validated enums fit in a smallint.
            self.kinds.push(resource.kind as i16);
            self.statuses.push(resource.status as i16);
            self.errors.push(resource.error.as_str());
            self.warnings.push(resource.warning.as_str());
            self.bodies.push(
                ContextResource {
                    body: resource.body.clone(),
                    ..Default::default()
                }
                .encode_to_vec(),
            );
        }
    }

    async fn insert(self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        if self.agent_ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO snapshot.resources
                 (agent_id, source, position, kind, status, error, warning, body)
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::int4[], $4::int2[],
                                  $5::int2[], $6::text[], $7::text[], $8::bytea[])",
        )
        .bind(&self.agent_ids)
        .bind(&self.sources)
        .bind(&self.positions)
        .bind(&self.kinds)
        .bind(&self.statuses)
        .bind(&self.errors)
        .bind(&self.warnings)
        .bind(&self.bodies)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// Replaces the agent's resources: sources absent from the push are deleted.
async fn write_resources(
    tx: &mut PgConnection,
    agent_id: Uuid,
    resources: &[ContextResource],
) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM snapshot.resources WHERE agent_id = $1")
        .bind(agent_id)
        .execute(&mut *tx)
        .await?;
    let mut rows = ResourceRows::default();
    rows.extend(agent_id, resources);
    rows.insert(tx).await
}
