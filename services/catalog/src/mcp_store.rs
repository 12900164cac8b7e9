//! The MCP sessions of the revisions with `initialize` (2025-11-25 and
//! before), restorable on any replica
//! (design note: the catalog as an MCP server).
//!
//! * A session's owner (tenant and key id, never the key) and the client's
//!   `initialize` parameters are kept, sealed with the memory's key, in a
//!   JetStream key-value bucket beside the memory's, under the session id.
//! * A replica given a request of a session it does not hold restores it
//!   from there, for the owner's tenant only: rmcp replays the handshake,
//!   and since the catalog session is named after the MCP session, the
//!   replay finds the same pins.
//! * A session ended on purpose (DELETE, idle expiry, revocation) is
//!   forgotten here too; one whose replica stops or dies is not, so another
//!   replica goes on with it. Entries age out with the idle expiry of
//!   sessions nobody uses.
//! * Without JetStream sessions stay where they started, as before.

use std::time::Duration;

use async_nats::jetstream::kv;
use ctxsync_runtime::tenant_keys::Caller;
use rmcp::model::InitializeRequestParams;
use rmcp::transport::streamable_http_server::session::{
    SessionState, SessionStore, SessionStoreError,
};
use tokio::sync::OnceCell;

use crate::bucket::MemoryKey;

/// The owner of a live session of this replica, by id.
pub(crate) type Owners = Box<dyn Fn(&str) -> Option<Caller> + Send + Sync>;

/// Sessions stored at most (the bucket refuses more: those stay local).
const MAX_STORED_SESSIONS: i64 = 100_000;
/// A stored session's size bound (its `initialize` parameters).
const MAX_STORED_BYTES: usize = 64 * 1024;

#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    tenant: String,
    key_id: String,
    initialize: InitializeRequestParams,
}

/// The bucket of restorable sessions.
pub(crate) struct StoredSessions {
    js: async_nats::jetstream::Context,
    name: String,
    replicas: usize,
    max_age: Duration,
    seal: MemoryKey,
    store: OnceCell<kv::Store>,
    /// The live sessions' owners, which are stored.
    owners: Owners,
}

impl StoredSessions {
    pub fn new(
        client: async_nats::Client,
        name: String,
        replicas: usize,
        idle: Duration,
        seal: MemoryKey,
        owners: Owners,
    ) -> Self {
        Self {
            js: async_nats::jetstream::new(client),
            name,
            replicas,
            // Unused that long, a session has expired on its replica anyway.
            max_age: idle.max(Duration::from_secs(1)),
            seal,
            store: OnceCell::new(),
            owners,
        }
    }

    /// The bucket, created when missing (retried on the next use if that fails).
    async fn bucket(&self) -> Result<&kv::Store, String> {
        self.store
            .get_or_try_init(|| async {
                let shape = crate::bucket::BucketShape {
                    name: &self.name,
                    max_age: self.max_age,
                    replicas: self.replicas,
                    max_messages: MAX_STORED_SESSIONS,
                    // Bounded by its count and value size.
                    max_bytes: async_nats::jetstream::stream::Config::default().max_bytes,
                    max_value_bytes: MAX_STORED_BYTES,
                };
                crate::bucket::open_bucket(&self.js, &shape).await
            })
            .await
    }

    async fn read(&self, session_id: &str) -> Result<Option<Stored>, String> {
        let bucket = self.bucket().await?;
        let Some(value) = bucket.get(session_id).await.map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let Ok(opened) = self.seal.open(&self.name, session_id, &value) else {
            metrics::counter!("ctxsync_catalog_mcp_sessions_unsealed_total").increment(1);
            return Ok(None);
        };
        Ok(serde_json::from_slice(opened).ok())
    }

    /// The tenant a stored session belongs to.
    pub async fn owner_of(&self, session_id: &str) -> Option<Caller> {
        match self.read(session_id).await {
            Ok(stored) => stored.map(|s| Caller {
                tenant: s.tenant,
                key_id: s.key_id,
            }),
            Err(error) => {
                tracing::debug!(%error, "cannot read the sessions bucket");
                None
            }
        }
    }

    /// Forgets a session ended on purpose.
    pub async fn forget(&self, session_id: &str) {
        if let Ok(bucket) = self.bucket().await
            && let Err(error) = bucket.delete(session_id).await
        {
            tracing::debug!(%error, "cannot forget a stored mcp session");
        }
    }
}

#[async_trait::async_trait]
impl SessionStore for StoredSessions {
    async fn load(&self, session_id: &str) -> Result<Option<SessionState>, SessionStoreError> {
        let stored = self
            .read(session_id)
            .await
            .map_err(SessionStoreError::from)?;
        Ok(stored.map(|s| SessionState::new(s.initialize)))
    }

    async fn store(&self, session_id: &str, state: &SessionState) -> Result<(), SessionStoreError> {
        let Some(owner) = (self.owners)(session_id) else {
            return Ok(());
        };
        let stored = Stored {
            tenant: owner.tenant,
            key_id: owner.key_id,
            initialize: state.initialize_params.clone(),
        };
        let value = serde_json::to_vec(&stored)?;
        if value.len() > MAX_STORED_BYTES {
            return Err(
                "the session's initialize parameters are over 64 KiB: kept on this replica only"
                    .into(),
            );
        }
        let sealed = self.seal.seal(&self.name, session_id, &value);
        self.bucket()
            .await
            .map_err(SessionStoreError::from)?
            .put(session_id, sealed)
            .await?;
        Ok(())
    }

    async fn delete(&self, session_id: &str) -> Result<(), SessionStoreError> {
        self.forget(session_id).await;
        Ok(())
    }
}
