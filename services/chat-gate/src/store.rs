//! Reads of an agent's state from snapshot-store over NATS.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{AgentState, GetAgentStateReply, GetAgentStateRequest, store_error::Code};
use ctxsync_runtime::rpc;

/// Why the state could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    /// The store did not answer, or failed: turns fail open.
    #[error("{0}")]
    Unavailable(String),
}

#[derive(Clone)]
pub struct StoreReader {
    client: async_nats::Client,
    subject: String,
    timeout: Duration,
    reads: Arc<AtomicU64>,
}

impl StoreReader {
    pub fn new(client: async_nats::Client, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            client,
            subject: subjects.store_get_agent_state(),
            timeout,
            reads: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Store reads made so far by this gate.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// One consistent read of the agent row, its snapshot and resources.
    pub async fn read(&self, agent_id: &str) -> Result<AgentState, ReadError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let request = GetAgentStateRequest {
            agent_id: agent_id.to_owned(),
        };
        let answer = tokio::time::timeout(
            self.timeout,
            rpc::request::<_, GetAgentStateReply>(
                &self.client,
                self.subject.clone(),
                &request,
                None,
                self.timeout,
            ),
        )
        .await;
        let result = match answer {
            Err(_) => Err(ReadError::Unavailable(format!(
                "snapshot-store did not answer within {:?}",
                self.timeout
            ))),
            Ok(Err(error)) => Err(ReadError::Unavailable(format!(
                "snapshot-store unavailable: {error}"
            ))),
            Ok(Ok(reply)) => match (reply.error, reply.state) {
                (Some(error), _) => Err(match error.code() {
                    Code::NotFound => ReadError::NotFound(error.message),
                    Code::InvalidArgument => ReadError::Invalid(error.message),
                    _ => {
                        ReadError::Unavailable(format!("snapshot-store failed: {}", error.message))
                    }
                }),
                (None, Some(state)) => Ok(state),
                (None, None) => Err(ReadError::Unavailable(
                    "snapshot-store answered without a state".into(),
                )),
            },
        };
        let outcome = match &result {
            Ok(_) => "ok",
            Err(ReadError::NotFound(_)) => "not_found",
            Err(ReadError::Invalid(_)) => "invalid",
            Err(ReadError::Unavailable(_)) => "unavailable",
        };
        metrics::counter!("ctxsync_gate_store_reads_total", "outcome" => outcome).increment(1);
        result
    }
}
