//! Bearer-token authentication. The store keeps only SHA-256 digests of
//! tokens; verified digests are cached briefly so a busy agent doesn't cost a
//! store round trip per push.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{AuthenticateAgentReply, AuthenticateAgentRequest};
use ctxsync_runtime::rpc;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Entries beyond this are evicted wholesale: a bound, not an LRU, is enough here.
const MAX_CACHED_TOKENS: usize = 100_000;

pub(crate) struct Authenticator {
    nats: async_nats::Client,
    subjects: Subjects,
    timeout: Duration,
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
            nats,
            subjects,
            timeout,
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
        let reply: AuthenticateAgentReply = rpc::request(
            &self.nats,
            self.subjects.store_authenticate_agent(),
            &AuthenticateAgentRequest {
                token_sha256: digest.to_vec(),
            },
            None,
            self.timeout,
        )
        .await
        .map_err(|e| ApiError::StoreUnavailable(e.to_string()))?;
        if let Some(error) = reply.error {
            return Err(ApiError::StoreUnavailable(error.message));
        }
        if reply.agent_id.is_empty() {
            return Err(ApiError::Unauthenticated("unknown agent token"));
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED_TOKENS {
            cache.clear();
        }
        cache.insert(digest, (reply.agent_id.clone(), Instant::now() + self.ttl));
        Ok(reply.agent_id)
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
