//! What a push says, as the rules compare it: its phase and its content hash.

use ctxsync_proto::v1::{ContextConfig, PushContextStateRequest, mcp_discovery::Phase};
use prost::Message;
use sha2::{Digest, Sha256};

/// Phases in the order a run moves through them.
pub fn phase_rank(phase: Phase) -> u8 {
    match phase {
        Phase::Unspecified => 0,
        Phase::Pending => 1,
        Phase::Complete => 2,
    }
}

/// The push's phase; a push without a discovery message (a legacy agent's)
/// is `Unspecified`.
pub fn push_phase(push: &PushContextStateRequest) -> Phase {
    push.mcp_discovery
        .as_ref()
        .and_then(|d| Phase::try_from(d.phase).ok())
        .unwrap_or(Phase::Unspecified)
}

/// A push's phase and content, computed once before the lock is taken.
#[derive(Debug, Clone, PartialEq)]
pub struct PushContent {
    pub phase: Phase,
    /// The push's context config, the default one when it sends none.
    pub context_config: ContextConfig,
    /// `context_config` encoded, as stored.
    pub config: Vec<u8>,
    /// [`Self::hash_of`] the push.
    pub hash: String,
}

impl PushContent {
    pub fn of(push: &PushContextStateRequest) -> Self {
        let phase = push_phase(push);
        let context_config = push.context_config.clone().unwrap_or_default();
        let config = context_config.encode_to_vec();
        let hash = Self::hash_of(push, phase, &config);
        Self {
            phase,
            context_config,
            config,
            hash,
        }
    }

    /// SHA-256 over everything a snapshot says but its version (and
    /// `initial`): an unchanged re-push has the same hash. Every part is
    /// length-prefixed, so no two different snapshots run into one another.
    pub fn hash_of(push: &PushContextStateRequest, phase: Phase, config: &[u8]) -> String {
        let mut hasher = Sha256::new();
        hasher.update((push.agent_run_id.len() as u64).to_be_bytes());
        hasher.update(push.agent_run_id.as_bytes());
        hasher.update((phase as i32).to_be_bytes());
        hasher.update((config.len() as u64).to_be_bytes());
        hasher.update(config);
        for resource in &push.resources {
            let encoded = resource.encode_to_vec();
            hasher.update((encoded.len() as u64).to_be_bytes());
            hasher.update(&encoded);
        }
        hex::encode(hasher.finalize())
    }
}
