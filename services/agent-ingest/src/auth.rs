//! Bearer-token authentication. The store keeps only SHA-256 digests of
//! tokens; verified digests are cached briefly so a busy agent doesn't cost a
//! store round trip per push.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};
use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::rpc::RpcError;
use ctxsync_runtime::store::StoreClient;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Entries beyond this are evicted wholesale: a bound, not an LRU, is enough here.
const MAX_CACHED_TOKENS: usize = 100_000;

pub(crate) struct Authenticator {
    store: StoreClient,
    ttl: Duration,
    cache: Mutex<HashMap<[u8; 32], (String, Instant)>>,
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
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The agent id the request's bearer token belongs to.
    pub(crate) async fn authenticate(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let token = bearer_token(headers)?;
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(agent_id) = self.cached(&digest) {
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
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED_TOKENS {
            cache.clear();
        }
        cache.insert(digest, (agent_id.clone(), Instant::now() + self.ttl));
        Ok(agent_id)
    }

    fn cached(&self, digest: &[u8; 32]) -> Option<String> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .get(digest)
            .filter(|(_, expires)| *expires > Instant::now())
            .map(|(id, _)| id.clone())
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
