//! Bearer-token authentication. The store keeps only SHA-256 digests of
//! tokens; verified digests are cached briefly so a busy agent doesn't cost a
//! store round trip per push.

use std::time::Duration;

use axum::http::{HeaderMap, header};
use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::rpc::RpcError;
use ctxsync_runtime::store::StoreClient;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Tokens remembered at most; past it the least recently used is forgotten.
const MAX_CACHED_TOKENS: u64 = 100_000;

/// Verified token digests and their agent ids, for `ttl` after the check.
type TokenCache = moka::sync::Cache<[u8; 32], String>;

fn token_cache(ttl: Duration) -> TokenCache {
    moka::sync::Cache::builder()
        .max_capacity(MAX_CACHED_TOKENS)
        .eviction_policy(moka::policy::EvictionPolicy::lru())
        .time_to_live(ttl)
        .build()
}

pub(crate) struct Authenticator {
    store: StoreClient,
    cache: TokenCache,
}

impl Authenticator {
    pub(crate) fn new(
        nats: async_nats::Client,
        subjects: Subjects,
        timeout: Duration,
        ttl: Duration,
    ) -> Self {
        Self {
            store: StoreClient::new(nats, &subjects, timeout),
            cache: token_cache(ttl),
        }
    }

    /// The agent id the request's bearer token belongs to.
    pub(crate) async fn authenticate(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let token = bearer_token(headers)?;
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(agent_id) = self.cache.get(&digest) {
            return Ok(agent_id);
        }
        let agent_id = self
            .store
            .authenticate_agent(digest.to_vec())
            .await
            .map_err(|error| match error {
                RpcError::Service { message, .. } => ApiError::StoreUnavailable(message),
                error => ApiError::StoreUnavailable(error.to_string()),
            })?
            .ok_or(ApiError::Unauthenticated("unknown agent token"))?;
        self.cache.insert(digest, agent_id.clone());
        Ok(agent_id)
    }
}

fn bearer_token(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or(ApiError::Unauthenticated("missing bearer token"))?
        .to_str()
        .map_err(|_| ApiError::Unauthenticated("malformed authorization header"))?;
    let (scheme, token) = value
        .split_once(' ')
        .ok_or(ApiError::Unauthenticated("malformed authorization header"))?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(ApiError::Unauthenticated(
            "authorization is not a bearer token",
        ));
    }
    Ok(token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u64) -> [u8; 32] {
        Sha256::digest(n.to_le_bytes()).into()
    }

    #[test]
    fn the_cache_holds_at_most_its_bound_and_keeps_the_recent_tokens() {
        let cache = token_cache(Duration::from_secs(30));
        for n in 0..MAX_CACHED_TOKENS + 1000 {
            cache.insert(digest(n), format!("agent-{n}"));
        }
        cache.run_pending_tasks();
        assert_eq!(cache.entry_count(), MAX_CACHED_TOKENS);
        // The oldest went, not the newest (the old cache forgot everything).
        assert!(cache.get(&digest(0)).is_none());
        let newest = MAX_CACHED_TOKENS + 999;
        assert_eq!(cache.get(&digest(newest)), Some(format!("agent-{newest}")));
    }

    #[test]
    fn a_verified_token_is_forgotten_after_the_ttl() {
        let ttl = Duration::from_millis(50);
        let cache = token_cache(ttl);
        cache.insert(digest(1), "agent-1".into());
        assert_eq!(cache.get(&digest(1)).as_deref(), Some("agent-1"));
        // moka reads its own clock, not tokio's: real time has to pass.
        std::thread::sleep(ttl * 2);
        assert_eq!(cache.get(&digest(1)), None);
        // A zero TTL remembers nothing.
        let cache = token_cache(Duration::ZERO);
        cache.insert(digest(2), "agent-2".into());
        assert_eq!(cache.get(&digest(2)), None);
    }
}
