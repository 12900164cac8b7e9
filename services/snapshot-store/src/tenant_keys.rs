//! Tenant keys: the credentials chat backends present to chat-gate.
//!
//! The store keeps the SHA-256 of each key, never the key; operators create,
//! list and revoke keys with `ctxsync tenant key`, and chat-gate asks which
//! tenant a digest belongs to. A revocation is committed first, then
//! announced on `<prefix>.events.tenant_key.revoked` so gates drop the key
//! from their caches at once (a gate that misses the event forgets its cached
//! keys on the reconnect that follows the gap).

use std::time::Duration;

use chrono::{DateTime, Utc};
use ctxsync_proto::ids;
use ctxsync_proto::rpc::store;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    CreateTenantKeyReply, CreateTenantKeyRequest, ListTenantKeysReply, ListTenantKeysRequest,
    RevokeTenantKeyReply, RevokeTenantKeyRequest, TenantKey, TenantKeyRevoked,
    VerifyTenantKeyReply, VerifyTenantKeyRequest,
};
use ctxsync_proto::validate::ValidationError;
use ctxsync_runtime::nats::{NatsConnection, SubscribeError};
use ctxsync_runtime::{Shutdown, rpc};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::db::{Store, StoreError};
use crate::endpoint::{endpoint, publish, reply};

/// Longest key label, in bytes.
pub const MAX_LABEL_BYTES: usize = 256;

/// Postgres' SQLSTATE for a unique violation (the same digest twice).
const UNIQUE_VIOLATION: &str = "23505";

/// The longest list answered at once (one tenant rarely has more than a handful).
const MAX_LISTED: i64 = 10_000;

fn invalid(field: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Invalid(ValidationError::Invalid {
        field: field.into(),
        reason: reason.into(),
    })
}

fn check_digest(digest: &[u8]) -> Result<(), StoreError> {
    if digest.len() == 32 {
        Ok(())
    } else {
        Err(invalid(
            "key_sha256",
            format!("must be 32 bytes, got {}", digest.len()),
        ))
    }
}

fn key_of(row: &PgRow) -> TenantKey {
    let created_at: DateTime<Utc> = row.get("created_at");
    let revoked_at: Option<DateTime<Utc>> = row.get("revoked_at");
    TenantKey {
        key_id: row.get("key_id"),
        tenant: row.get("tenant"),
        label: row.get("label"),
        created_at: Some(created_at.into()),
        revoked_at: revoked_at.map(Into::into),
    }
}

/// A fresh key id: `tk_` and 16 hex digits (random, names the key, grants nothing).
fn new_key_id() -> String {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    format!("tk_{}", hex::encode(&bytes[..8]))
}

impl Store {
    /// Records a new key of `tenant` by its digest.
    pub async fn create_tenant_key(
        &self,
        tenant: &str,
        label: &str,
        key_sha256: &[u8],
    ) -> Result<TenantKey, StoreError> {
        ids::tenant(tenant).map_err(|e| invalid("tenant", e.to_string()))?;
        if label.len() > MAX_LABEL_BYTES {
            return Err(invalid(
                "label",
                format!(
                    "is {} bytes, over the limit of {MAX_LABEL_BYTES} (label_bytes)",
                    label.len()
                ),
            ));
        }
        if let Some(c) = label.chars().find(|c| c.is_control()) {
            return Err(invalid(
                "label",
                format!("contains the control character {c:?}"),
            ));
        }
        check_digest(key_sha256)?;
        let row = sqlx::query(
            "INSERT INTO snapshot.tenant_keys (key_id, tenant, label, key_sha256)
             VALUES ($1, $2, $3, $4)
             RETURNING key_id, tenant, label, created_at, revoked_at",
        )
        .bind(new_key_id())
        .bind(tenant)
        .bind(label)
        .bind(key_sha256)
        .fetch_one(self.pool())
        .await
        .map_err(|error| match &error {
            sqlx::Error::Database(db) if db.code().as_deref() == Some(UNIQUE_VIOLATION) => {
                StoreError::KeyExists
            }
            _ => error.into(),
        })?;
        Ok(key_of(&row))
    }

    /// Keys, newest last; of one tenant when `tenant` is not empty.
    pub async fn list_tenant_keys(
        &self,
        tenant: &str,
        include_revoked: bool,
    ) -> Result<Vec<TenantKey>, StoreError> {
        if !tenant.is_empty() {
            ids::tenant(tenant).map_err(|e| invalid("tenant", e.to_string()))?;
        }
        let rows = sqlx::query(
            "SELECT key_id, tenant, label, created_at, revoked_at FROM snapshot.tenant_keys
             WHERE ($1 = '' OR tenant = $1) AND ($2 OR revoked_at IS NULL)
             ORDER BY created_at, key_id
             LIMIT $3",
        )
        .bind(tenant)
        .bind(include_revoked)
        .bind(MAX_LISTED)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.iter().map(key_of).collect())
    }

    /// Revokes a key; revoking it again keeps the first revocation's time.
    /// Returns the key and whether this call revoked it.
    pub async fn revoke_tenant_key(&self, key_id: &str) -> Result<(TenantKey, bool), StoreError> {
        let well_formed = key_id.len() == 19
            && key_id.starts_with("tk_")
            && key_id[3..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !well_formed {
            return Err(invalid(
                "key_id",
                format!(
                    "{:?} is not a key id (tk_ and 16 hex digits, as `ctxsync tenant key list` shows)",
                    key_id.chars().take(40).collect::<String>()
                ),
            ));
        }
        let mut tx = self.pool().begin().await?;
        let before = sqlx::query(
            "SELECT revoked_at IS NULL AS active FROM snapshot.tenant_keys
             WHERE key_id = $1 FOR UPDATE",
        )
        .bind(key_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(before) = before else {
            return Err(StoreError::KeyNotFound(key_id.to_owned()));
        };
        let was_active: bool = before.get("active");
        let row = sqlx::query(
            "UPDATE snapshot.tenant_keys SET revoked_at = coalesce(revoked_at, clock_timestamp())
             WHERE key_id = $1
             RETURNING key_id, tenant, label, created_at, revoked_at",
        )
        .bind(key_id)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok((key_of(&row), was_active))
    }

    /// The valid key with this digest, if any.
    pub async fn verify_tenant_key(
        &self,
        key_sha256: &[u8],
    ) -> Result<Option<TenantKey>, StoreError> {
        check_digest(key_sha256)?;
        let row = sqlx::query(
            "SELECT key_id, tenant, label, created_at, revoked_at FROM snapshot.tenant_keys
             WHERE key_sha256 = $1 AND revoked_at IS NULL",
        )
        .bind(key_sha256)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.as_ref().map(key_of))
    }
}

/// Serves the tenant-key subjects.
pub(crate) async fn serve(
    nats: &NatsConnection,
    subjects: &Subjects,
    store: &Store,
    shutdown: &Shutdown,
    grace: Duration,
) -> Result<Vec<rpc::Server>, SubscribeError> {
    let create = endpoint(store::CreateTenantKey, nats, subjects, shutdown, grace, {
        let store = store.clone();
        move |req: CreateTenantKeyRequest, _| {
            let store = store.clone();
            async move {
                let result = store
                    .create_tenant_key(&req.tenant, &req.label, &req.key_sha256)
                    .await;
                reply(result, |key| {
                    tracing::info!(key_id = %key.key_id, tenant = %key.tenant, "tenant key created");
                    CreateTenantKeyReply {
                        key: Some(key),
                        error: None,
                    }
                })
            }
        }
    });
    let list = endpoint(store::ListTenantKeys, nats, subjects, shutdown, grace, {
        let store = store.clone();
        move |req: ListTenantKeysRequest, _| {
            let store = store.clone();
            async move {
                let result = store
                    .list_tenant_keys(&req.tenant, req.include_revoked)
                    .await;
                reply(result, |keys| ListTenantKeysReply { keys, error: None })
            }
        }
    });
    let revoke = endpoint(store::RevokeTenantKey, nats, subjects, shutdown, grace, {
        let (store, client, subjects) = (
            store.clone(),
            nats.responder().client.clone(),
            subjects.clone(),
        );
        move |req: RevokeTenantKeyRequest, _| {
            let (store, client, subjects) = (store.clone(), client.clone(), subjects.clone());
            async move {
                let result = store.revoke_tenant_key(&req.key_id).await;
                if let Ok((key, _)) = &result {
                    // Announced on every revoke, repeated ones included: a
                    // gate that missed the first announcement hears this one.
                    let event = TenantKeyRevoked {
                        key_id: key.key_id.clone(),
                        tenant: key.tenant.clone(),
                    };
                    publish(&client, subjects.tenant_key_revoked(), None, &event).await;
                    if let Err(error) = client.flush().await {
                        tracing::warn!(%error, "cannot flush the revocation event");
                    }
                }
                reply(result, |(key, revoked_now)| {
                    tracing::info!(key_id = %key.key_id, tenant = %key.tenant, revoked_now, "tenant key revoked");
                    RevokeTenantKeyReply {
                        key: Some(key),
                        error: None,
                    }
                })
            }
        }
    });
    let verify = endpoint(store::VerifyTenantKey, nats, subjects, shutdown, grace, {
        let store = store.clone();
        move |req: VerifyTenantKeyRequest, _| {
            let store = store.clone();
            async move {
                let result = store.verify_tenant_key(&req.key_sha256).await;
                reply(result, |key| VerifyTenantKeyReply { key, error: None })
            }
        }
    });
    Ok(vec![
        create.await?,
        list.await?,
        revoke.await?,
        verify.await?,
    ])
}
