//! `ctxsync tenant key create|list|revoke`: the credentials chat backends
//! present to chat-gate. A key is printed once, at creation; the store keeps
//! only its SHA-256.

use std::fmt::Write as _;
use std::time::Duration;

use base64::Engine;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{CreateTenantKeyRequest, TenantKey};
use ctxsync_runtime::store::StoreClient;
use rand::RngCore;
use sha2::Digest;

use crate::agent::AgentCommandError;

/// A fresh tenant key: 32 random bytes, URL-safe base64, prefix `cxk_`.
pub fn new_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "cxk_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// A key just created: its id and the key itself (shown once).
#[derive(Debug)]
pub struct CreatedKey {
    pub key_id: String,
    pub tenant: String,
    pub key: String,
}

impl CreatedKey {
    /// What `--json` prints.
    pub fn to_proto(&self) -> ctxsync_proto::v1::TenantKeyCreated {
        ctxsync_proto::v1::TenantKeyCreated {
            key_id: self.key_id.clone(),
            tenant: self.tenant.clone(),
            key: self.key.clone(),
        }
    }
}

/// Checked here too, so a typo never reaches the store.
fn check_tenant(tenant: &str) -> Result<(), AgentCommandError> {
    ctxsync_proto::ids::tenant(tenant)
        .map_err(|e| AgentCommandError::Invalid(format!("--tenant: {e}")))
}

pub async fn create(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    tenant: &str,
    label: &str,
) -> Result<CreatedKey, AgentCommandError> {
    check_tenant(tenant)?;
    let key = new_key();
    let stored = StoreClient::new(nats.clone(), subjects, timeout)
        .create_tenant_key(CreateTenantKeyRequest {
            tenant: tenant.into(),
            label: label.into(),
            key_sha256: sha2::Sha256::digest(key.as_bytes()).to_vec(),
        })
        .await?;
    Ok(CreatedKey {
        key_id: stored.key_id,
        tenant: stored.tenant,
        key,
    })
}

pub async fn list(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    tenant: Option<&str>,
    include_revoked: bool,
) -> Result<Vec<TenantKey>, AgentCommandError> {
    if let Some(tenant) = tenant {
        check_tenant(tenant)?;
    }
    let keys = StoreClient::new(nats.clone(), subjects, timeout)
        .list_tenant_keys(tenant.unwrap_or_default(), include_revoked)
        .await?;
    Ok(keys)
}

pub async fn revoke(
    nats: &async_nats::Client,
    subjects: &Subjects,
    timeout: Duration,
    key_id: &str,
) -> Result<TenantKey, AgentCommandError> {
    let key = StoreClient::new(nats.clone(), subjects, timeout)
        .revoke_tenant_key(key_id)
        .await?;
    Ok(key)
}

fn time(ts: Option<&pbjson_types::Timestamp>) -> String {
    ts.and_then(|ts| chrono::DateTime::from_timestamp(ts.seconds, 0))
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|| "-".into())
}

/// One line per key: id, tenant, created, revoked, label. Never a key.
pub fn render(keys: &[TenantKey]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<20} {:<21} {:<21} LABEL",
        "KEY ID", "TENANT", "CREATED", "REVOKED"
    );
    for key in keys {
        let _ = writeln!(
            out,
            "{:<20} {:<20} {:<21} {:<21} {}",
            key.key_id,
            key.tenant,
            time(key.created_at.as_ref()),
            time(key.revoked_at.as_ref()),
            key.label
        );
    }
    out
}
