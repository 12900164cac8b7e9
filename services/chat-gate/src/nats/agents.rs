//! The tenant's agents from snapshot-store, for the context page.

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::service_error::Code;
use ctxsync_runtime::rpc::RpcError;
use ctxsync_runtime::store::{AgentPage, StoreClient};

use gate_core::source::ReadError;

#[derive(Clone)]
pub struct AgentLister {
    store: StoreClient,
}

impl AgentLister {
    pub fn new(client: async_nats::Client, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            store: StoreClient::new(client, subjects, timeout),
        }
    }

    /// One page of `tenant`'s agents, ordered by id, after `after` (empty: from the first).
    pub async fn list(
        &self,
        tenant: &str,
        limit: u32,
        after: &str,
    ) -> Result<AgentPage, ReadError> {
        self.store
            .list_agents(tenant, limit, after)
            .await
            .map_err(|error| match error {
                // A list names no agent: a refusal is the request's, or the store's.
                RpcError::Service {
                    code: Code::NotFound,
                    message,
                    ..
                } => ReadError::Unavailable(format!("snapshot-store failed: {message}")),
                error => crate::nats::store::read_error(error),
            })
    }
}
