//! The core's state source over NATS: reads of an agent's state from
//! snapshot-store, and the connection's gaps.

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{AgentState, GetAgentStateReply, GetAgentStateRequest, store_error::Code};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::rpc;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::watch;

use gate_core::source::{ReadError, StateSource};

#[derive(Clone)]
pub struct StoreReader {
    client: async_nats::Client,
    gaps: watch::Receiver<u64>,
    subject: String,
    timeout: Duration,
}

impl StateSource for StoreReader {
    fn read<'a>(&'a self, agent_id: &'a str) -> BoxFuture<'a, Result<AgentState, ReadError>> {
        self.read(agent_id).boxed()
    }

    fn gaps(&self) -> watch::Receiver<u64> {
        self.gaps.clone()
    }
}

impl StoreReader {
    pub fn new(nats: &NatsConnection, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            client: nats.client.clone(),
            gaps: nats.gaps(),
            subject: subjects.store_get_agent_state(),
            timeout,
        }
    }

    /// One consistent read of the agent row, its snapshot and resources.
    pub async fn read(&self, agent_id: &str) -> Result<AgentState, ReadError> {
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
