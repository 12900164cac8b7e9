//! Who is asking over HTTP: every request carries a tenant key
//! (`Authorization: Bearer cxk_…`), and the tenant comes from the key.
//! Shared by every service that serves tenants over HTTP (chat-gate's API
//! and context page, the catalog's MCP endpoint).
//!
//! Keys live in snapshot-store as SHA-256 digests. A key is checked there
//! once and then remembered for [`KEY_CACHE_TTL`]; a revocation event drops
//! it from the cache at once, and any gap in the event stream (a NATS
//! disconnect) forgets every remembered key, so a revoked key never outlives
//! its revocation here by more than the event's delivery. A missing or
//! malformed credential never reaches the store; an unknown well-formed key
//! is remembered as unknown for a short time, and store lookups run a few at
//! a time, so guessing keys cannot load the store.

use std::sync::Arc;
use std::time::Duration;

use crate::rpc::RpcError;
use crate::store::StoreClient;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::TenantKeyRevoked;
use futures::StreamExt;
use prost::Message;
use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, broadcast};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use ctxsync_proto::v1::{HttpError, HttpErrorReply};

use crate::nats::NatsConnection;

/// How a tenant key starts.
pub const KEY_PREFIX: &str = "cxk_";
/// Base64url characters after the prefix (32 random bytes).
const KEY_BODY_CHARS: usize = 43;

/// How long a verified key is trusted without asking the store again.
pub const KEY_CACHE_TTL: Duration = Duration::from_secs(300);
/// How long an unknown key is answered 401 without asking the store again.
const UNKNOWN_KEY_TTL: Duration = Duration::from_secs(2);
/// Keys remembered at most (valid and unknown each); past it the least
/// recently used go.
const MAX_CACHED_KEYS: u64 = 10_000;
/// Store lookups of keys at once.
const MAX_LOOKUPS: usize = 8;

/// A caller a tenant key names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    pub key_id: String,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing credential: send Authorization: Bearer <tenant key>")]
    Missing,
    #[error("malformed credential: expected Authorization: Bearer cxk_<43 characters>")]
    Malformed,
    #[error("unknown or revoked tenant key")]
    Unknown,
    #[error("cannot check the tenant key now: {0}")]
    Unavailable(String),
}

impl AuthError {
    /// The label of a refusal's metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed => "malformed",
            Self::Unknown => "unknown_key",
            Self::Unavailable(_) => "store_unavailable",
        }
    }
}

type Digest32 = [u8; 32];

/// What the store said of a key, remembered for a while: valid keys for
/// [`KEY_CACHE_TTL`], unknown ones for [`UNKNOWN_KEY_TTL`].
struct Cache {
    valid: moka::sync::Cache<Digest32, Caller>,
    unknown: moka::sync::Cache<Digest32, ()>,
}

impl Cache {
    fn new() -> Self {
        Self {
            valid: moka::sync::Cache::builder()
                .max_capacity(MAX_CACHED_KEYS)
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .time_to_live(KEY_CACHE_TTL)
                // A revocation drops its key's entries by predicate (`revoked`).
                .support_invalidation_closures()
                .build(),
            unknown: moka::sync::Cache::builder()
                .max_capacity(MAX_CACHED_KEYS)
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .time_to_live(UNKNOWN_KEY_TTL)
                .build(),
        }
    }

    /// Forgets every entry naming `key_id`: no read returns one cached
    /// before this call (moka applies the predicate to reads until its
    /// maintenance has removed them).
    fn forget_key(&self, key_id: &str) {
        let key_id = key_id.to_owned();
        self.valid
            .invalidate_entries_if(move |_, caller| caller.key_id == key_id)
            .expect("the valid-key cache supports invalidation closures");
    }

    /// Forgets everything: no read returns an entry cached before this call.
    fn forget_all(&self) {
        self.valid.invalidate_all();
        self.unknown.invalidate_all();
    }
}

/// What holders of a key's resources (event streams, MCP sessions) learn
/// of revocations, so that a revoked key stops working at once, not when
/// its cache entry ages out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyChange {
    /// The key with this id was revoked: end what it holds.
    Revoked { key_id: String },
    /// Revocation events may have been lost (a NATS gap): every holder
    /// checks its key again ([`TenantKeys::authenticate`]).
    Unknown,
}

/// Changes queued for a slow holder; past it the holder sees `Lagged` and
/// must treat it as [`KeyChange::Unknown`].
const KEY_CHANGES_BUFFER: usize = 256;

/// Verifies tenant keys against snapshot-store, with a cache.
#[derive(Clone)]
pub struct TenantKeys {
    store: StoreClient,
    timeout: Duration,
    cache: Arc<Cache>,
    lookups: Arc<Semaphore>,
    /// The counter of outcomes (`outcome` label), named by the service.
    metric: &'static str,
    changes: broadcast::Sender<KeyChange>,
}

/// The key's format, checked before anything is looked up.
pub fn well_formed(key: &str) -> bool {
    key.strip_prefix(KEY_PREFIX).is_some_and(|body| {
        body.len() == KEY_BODY_CHARS
            && body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

/// The bearer credential of an `Authorization` header value.
pub fn bearer(header: Option<&str>) -> Result<&str, AuthError> {
    let header = header.ok_or(AuthError::Missing)?;
    let (scheme, credential) = header.trim().split_once(' ').ok_or(AuthError::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Malformed);
    }
    let credential = credential.trim();
    if well_formed(credential) {
        Ok(credential)
    } else {
        Err(AuthError::Malformed)
    }
}

impl TenantKeys {
    /// `metric` names the counter of outcomes (`ctxsync_<service>_auth_total`).
    pub fn new(
        client: async_nats::Client,
        subjects: &Subjects,
        timeout: Duration,
        metric: &'static str,
    ) -> Self {
        Self {
            store: StoreClient::new(client, subjects, timeout),
            timeout,
            cache: Arc::new(Cache::new()),
            lookups: Arc::new(Semaphore::new(MAX_LOOKUPS)),
            metric,
            changes: broadcast::channel(KEY_CHANGES_BUFFER).0,
        }
    }

    /// Revocations (and gaps) from now on. A receiver that lags behind
    /// (`RecvError::Lagged`) has missed changes and checks its key again.
    pub fn changes(&self) -> broadcast::Receiver<KeyChange> {
        self.changes.subscribe()
    }

    /// The caller an `Authorization` header names.
    pub async fn authenticate(&self, header: Option<&str>) -> Result<Caller, AuthError> {
        let result = match bearer(header) {
            Ok(key) => self.verify(key).await,
            Err(error) => Err(error),
        };
        let outcome = match &result {
            Ok(_) => "ok",
            Err(error) => error.reason(),
        };
        metrics::counter!(self.metric, "outcome" => outcome).increment(1);
        result
    }

    async fn verify(&self, key: &str) -> Result<Caller, AuthError> {
        let digest: Digest32 = Sha256::digest(key.as_bytes()).into();
        if let Some(known) = self.cached(&digest) {
            return known;
        }
        let _permit = tokio::time::timeout(self.timeout, self.lookups.acquire())
            .await
            .map_err(|_| AuthError::Unavailable("too many key checks at once".into()))?
            .expect("the lookup semaphore is never closed");
        // Another request may have looked the same key up meanwhile.
        if let Some(known) = self.cached(&digest) {
            return known;
        }
        // Whatever keeps the store from answering, its refusals included,
        // says nothing about the key: it is not remembered as unknown.
        let key = self
            .store
            .verify_tenant_key(digest.to_vec())
            .await
            .map_err(|error| match error {
                RpcError::Service { message, .. } => AuthError::Unavailable(message),
                error => AuthError::Unavailable(error.to_string()),
            })?;
        match key {
            Some(key) => {
                let caller = Caller {
                    tenant: key.tenant,
                    key_id: key.key_id,
                };
                self.cache.valid.insert(digest, caller.clone());
                Ok(caller)
            }
            None => {
                self.cache.unknown.insert(digest, ());
                Err(AuthError::Unknown)
            }
        }
    }

    fn cached(&self, digest: &Digest32) -> Option<Result<Caller, AuthError>> {
        if let Some(caller) = self.cache.valid.get(digest) {
            return Some(Ok(caller));
        }
        self.cache
            .unknown
            .contains_key(digest)
            .then_some(Err(AuthError::Unknown))
    }

    /// Drops a revoked key from the cache and tells the holders of its resources.
    pub fn revoked(&self, key_id: &str) {
        self.cache.forget_key(key_id);
        // No receiver is not an error: nothing holds a resource of any key.
        let _ = self.changes.send(KeyChange::Revoked {
            key_id: key_id.to_owned(),
        });
    }

    /// Forgets every remembered key (events may have been lost) and asks
    /// every holder to check its key again.
    pub fn forget_all(&self) {
        self.cache.forget_all();
        let _ = self.changes.send(KeyChange::Unknown);
    }

    /// A future that resolves once `key` (which authenticated as `caller`)
    /// stops being valid: at its revocation event, or when a check after a
    /// gap in the events finds it unknown. It listens from this call on, not
    /// from its first poll: call it before the last check of the key, so a
    /// revocation between the two is not missed. A check the store cannot
    /// answer now is retried every second: a resource is not ended for an
    /// outage, nor kept past one without its key being checked.
    pub fn until_revoked(
        &self,
        caller: &Caller,
        key: &str,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut changes = self.changes();
        let (keys, caller, key) = (self.clone(), caller.clone(), key.to_owned());
        async move {
            loop {
                let recheck = match changes.recv().await {
                    Ok(KeyChange::Revoked { key_id }) if key_id == caller.key_id => return,
                    Ok(KeyChange::Revoked { .. }) => false,
                    Ok(KeyChange::Unknown) | Err(broadcast::error::RecvError::Lagged(_)) => true,
                    // The follower stopped (shutdown): nothing will revoke the key any more.
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                };
                if !recheck {
                    continue;
                }
                loop {
                    match keys.verify(&key).await {
                        Ok(now) if now.key_id == caller.key_id => break,
                        Ok(_)
                        | Err(AuthError::Unknown | AuthError::Missing | AuthError::Malformed) => {
                            return;
                        }
                        Err(AuthError::Unavailable(_)) => {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            }
        }
    }

    /// Keys remembered as valid now.
    pub fn cached_keys(&self) -> usize {
        // moka counts once its pending maintenance has run.
        self.cache.valid.run_pending_tasks();
        self.cache.valid.entry_count() as usize
    }

    /// Applies revocation events until the subscription ends.
    pub async fn follow_revocations(self, mut events: async_nats::Subscriber) {
        while let Some(message) = events.next().await {
            match TenantKeyRevoked::decode(message.payload) {
                Ok(event) => {
                    tracing::info!(key_id = %event.key_id, tenant = %event.tenant, "tenant key revoked: forgotten");
                    self.revoked(&event.key_id);
                }
                Err(error) => {
                    tracing::warn!(%error, "malformed revocation event ignored")
                }
            }
        }
    }
}

/// Keeps the cache true until `stop`: applies revocation events, and forgets
/// every remembered key after a gap in the event stream (a revocation may
/// be among the lost events).
pub fn spawn_follow(
    keys: TenantKeys,
    revocations: async_nats::Subscriber,
    nats: &NatsConnection,
    stop: CancellationToken,
) -> JoinHandle<()> {
    let mut gaps = nats.gaps();
    tokio::spawn(async move {
        let follow = keys.clone().follow_revocations(revocations);
        tokio::pin!(follow);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = &mut follow => break,
                changed = gaps.changed() => match changed {
                    Ok(()) => keys.forget_all(),
                    Err(_) => break,
                },
            }
        }
    })
}

/// An HTTP error answer: `HttpErrorReply` as JSON, with `Retry-After` on 503.
pub fn error_response(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let error = HttpErrorReply {
        error: Some(HttpError {
            code: code.to_owned(),
            message: message.into(),
            limit: String::new(),
        }),
    };
    let mut response = (status, axum::Json(error)).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// The answer refusing a caller: 401 with `WWW-Authenticate` for a missing,
/// malformed or unknown key, 503 when the store cannot be asked now.
pub fn refusal_response(refusal: AuthError) -> Response {
    match refusal {
        AuthError::Unavailable(reason) => {
            tracing::warn!(%reason, "cannot check a tenant key");
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "cannot check the tenant key now; retry",
            )
        }
        refusal => {
            let mut response = error_response(
                StatusCode::UNAUTHORIZED,
                "unauthenticated",
                refusal.to_string(),
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"ctxsync\""),
            );
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u64) -> Digest32 {
        Sha256::digest(n.to_le_bytes()).into()
    }

    fn caller(n: u64) -> Caller {
        Caller {
            tenant: "acme".into(),
            key_id: format!("key-{n}"),
        }
    }

    #[test]
    fn each_cache_holds_at_most_its_bound_and_keeps_the_recent_keys() {
        let cache = Cache::new();
        for n in 0..MAX_CACHED_KEYS + 100 {
            cache.valid.insert(digest(n), caller(n));
            cache.unknown.insert(digest(n), ());
        }
        cache.valid.run_pending_tasks();
        cache.unknown.run_pending_tasks();
        assert_eq!(cache.valid.entry_count(), MAX_CACHED_KEYS);
        assert_eq!(cache.unknown.entry_count(), MAX_CACHED_KEYS);
        let newest = MAX_CACHED_KEYS + 99;
        assert_eq!(cache.valid.get(&digest(newest)), Some(caller(newest)));
        assert!(cache.valid.get(&digest(0)).is_none());
        assert!(cache.unknown.contains_key(&digest(newest)));
        assert!(!cache.unknown.contains_key(&digest(0)));
    }

    #[test]
    fn a_revoked_key_is_never_read_again_and_other_keys_stay() {
        let cache = Cache::new();
        for n in 0..100 {
            cache.valid.insert(digest(n), caller(n));
        }
        cache.forget_key("key-7");
        // At once: before moka's maintenance has run.
        assert_eq!(cache.valid.get(&digest(7)), None);
        assert_eq!(cache.valid.get(&digest(8)), Some(caller(8)));
        cache.valid.run_pending_tasks();
        assert_eq!(cache.valid.get(&digest(7)), None);
        assert_eq!(cache.valid.entry_count(), 99);
        // Checked again after the revocation (a new key with its id cannot
        // exist, but the predicate only covers what was cached before).
        cache.valid.insert(digest(7), caller(7));
        assert_eq!(cache.valid.get(&digest(7)), Some(caller(7)));
    }

    #[test]
    fn a_gap_forgets_every_key_valid_and_unknown() {
        let cache = Cache::new();
        cache.valid.insert(digest(1), caller(1));
        cache.unknown.insert(digest(2), ());
        cache.forget_all();
        assert_eq!(cache.valid.get(&digest(1)), None);
        assert!(!cache.unknown.contains_key(&digest(2)));
        // What is checked after the gap is remembered again.
        cache.valid.insert(digest(1), caller(1));
        assert_eq!(cache.valid.get(&digest(1)), Some(caller(1)));
    }

    #[test]
    fn bearer_credentials_are_checked_before_any_lookup() {
        let key = format!("{KEY_PREFIX}{}", "a".repeat(KEY_BODY_CHARS));
        assert_eq!(bearer(None), Err(AuthError::Missing));
        assert_eq!(bearer(Some("Basic abc")), Err(AuthError::Malformed));
        assert_eq!(bearer(Some("Bearer")), Err(AuthError::Malformed));
        assert_eq!(
            bearer(Some("Bearer cxs_agenttoken")),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            bearer(Some(&format!("Bearer {key}x"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(bearer(Some(&format!("bearer  {key}"))), Ok(key.as_str()));
    }
}
