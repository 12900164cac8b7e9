//! The tenant's agents from snapshot-store, for the context page.

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{AgentState, ListAgentsReply, ListAgentsRequest, store_error::Code};
use ctxsync_runtime::rpc;

use gate_core::source::ReadError;

/// One page of agents and the id to continue after (empty at the end).
pub type AgentPage = (Vec<AgentState>, String);

#[derive(Clone)]
pub struct AgentLister {
    client: async_nats::Client,
    subject: String,
    timeout: Duration,
}

impl AgentLister {
    pub fn new(client: async_nats::Client, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            client,
            subject: subjects.store_list_agents(),
            timeout,
        }
    }

    /// One page of `tenant`'s agents, ordered by id, after `after` (empty: from the first).
    pub async fn list(
        &self,
        tenant: &str,
        limit: u32,
        after: &str,
    ) -> Result<AgentPage, ReadError> {
        let request = ListAgentsRequest {
            tenant: tenant.to_owned(),
            limit,
            after_agent_id: after.to_owned(),
        };
        let reply: ListAgentsReply = tokio::time::timeout(
            self.timeout,
            rpc::request(
                &self.client,
                self.subject.clone(),
                &request,
                None,
                self.timeout,
            ),
        )
        .await
        .map_err(|_| {
            ReadError::Unavailable(format!(
                "snapshot-store did not answer within {:?}",
                self.timeout
            ))
        })?
        .map_err(|e| ReadError::Unavailable(format!("snapshot-store unavailable: {e}")))?;
        match reply.error {
            Some(error) if error.code() == Code::InvalidArgument => {
                Err(ReadError::Invalid(error.message))
            }
            Some(error) => Err(ReadError::Unavailable(format!(
                "snapshot-store failed: {}",
                error.message
            ))),
            None => Ok((reply.states, reply.next_after_agent_id)),
        }
    }
}
