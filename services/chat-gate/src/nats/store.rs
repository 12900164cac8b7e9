//! The core's state source over NATS: reads of an agent's state from
//! snapshot-store, and the connection's gaps.

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{AgentState, service_error::Code};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::rpc::RpcError;
use ctxsync_runtime::store::StoreClient;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::watch;

use gate_core::source::{ReadError, StateSource};

#[derive(Clone)]
pub struct StoreReader {
    store: StoreClient,
    gaps: watch::Receiver<u64>,
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
    /// Reads within `timeout` in all: two attempts of half of it each (see
    /// [`Self::read`]), so the core's own bound on a read still holds.
    pub fn new(nats: &NatsConnection, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            store: StoreClient::new(nats.client.clone(), subjects, timeout / 2),
            gaps: nats.gaps(),
        }
    }

    /// One consistent read of the agent row, its snapshot and resources.
    /// A read that timed out or found no responder is asked once more: it
    /// changes nothing, and a request lost with a NATS connection (a node
    /// leaving in lame duck, a store replica replaced) would otherwise fail
    /// the turn open. A store that is down is still said so within the
    /// store timeout.
    pub async fn read(&self, agent_id: &str) -> Result<AgentState, ReadError> {
        let mut result = self.store.agent_state(agent_id).await;
        if matches!(
            result,
            Err(RpcError::TimedOut { .. } | RpcError::NoResponders { .. })
        ) {
            metrics::counter!("ctxsync_gate_store_reads_total", "outcome" => "retried")
                .increment(1);
            result = self.store.agent_state(agent_id).await;
        }
        let result = result.map_err(read_error);
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

/// What a failed store call means to the gate: the store's refusals of the
/// request itself by their code; anything else, the store is unavailable
/// (turns fail open).
pub(crate) fn read_error(error: RpcError) -> ReadError {
    match error {
        RpcError::Service {
            code: Code::NotFound,
            message,
            ..
        } => ReadError::NotFound(message),
        RpcError::Service {
            code: Code::InvalidArgument,
            message,
            ..
        } => ReadError::Invalid(message),
        RpcError::Service { message, .. } => {
            ReadError::Unavailable(format!("snapshot-store failed: {message}"))
        }
        RpcError::TimedOut { timeout, .. } => {
            ReadError::Unavailable(format!("snapshot-store did not answer within {timeout:?}"))
        }
        error => ReadError::Unavailable(format!("snapshot-store unavailable: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn refusal(code: Code) -> RpcError {
        RpcError::Service {
            subject: "p.store.agent.get".into(),
            code,
            message: "why".into(),
            reason: String::new(),
        }
    }

    #[test]
    fn the_stores_refusals_are_read_by_code_and_the_rest_fails_open() {
        assert_eq!(
            read_error(refusal(Code::NotFound)),
            ReadError::NotFound("why".into())
        );
        assert_eq!(
            read_error(refusal(Code::InvalidArgument)),
            ReadError::Invalid("why".into())
        );
        assert_eq!(
            read_error(refusal(Code::Internal)),
            ReadError::Unavailable("snapshot-store failed: why".into())
        );
        assert_eq!(
            read_error(RpcError::TimedOut {
                subject: "s".into(),
                timeout: Duration::from_secs(2)
            }),
            ReadError::Unavailable("snapshot-store did not answer within 2s".into())
        );
        assert_eq!(
            read_error(RpcError::NoResponders {
                subject: "s".into()
            }),
            ReadError::Unavailable("snapshot-store unavailable: no service answers on s".into())
        );
    }
}
