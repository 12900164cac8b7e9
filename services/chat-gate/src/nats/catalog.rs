//! The first turn's catalog section: the tenant's operator-configured MCP
//! servers pinned by the catalog service for this chat. Asked concurrently
//! with the discovery wait; a catalog that does not answer fails open.

use std::time::Duration;

use ctxsync_proto::rpc::catalog;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    CatalogPrepareRequest, CatalogSection, CatalogStatusReply, CatalogStatusRequest,
    catalog_section::Status,
};
use ctxsync_runtime::rpc;
use futures::FutureExt;
use futures::future::BoxFuture;

use gate_core::source::CatalogSource;

#[derive(Clone)]
pub struct CatalogClient {
    client: async_nats::Client,
    subjects: Subjects,
    timeout: Duration,
}

impl CatalogClient {
    pub fn new(client: async_nats::Client, subjects: &Subjects, timeout: Duration) -> Self {
        Self {
            client,
            subjects: subjects.clone(),
            timeout,
        }
    }

    /// Prepares the chat's catalog (the chat is the catalog session).
    pub async fn prepare(&self, tenant: &str, chat_id: &str) -> CatalogSection {
        let request = CatalogPrepareRequest {
            tenant: tenant.to_owned(),
            session_id: chat_id.to_owned(),
        };
        let answer = rpc::call_for_tenant::<catalog::Prepare>(
            &self.client,
            &self.subjects,
            tenant,
            &request,
            None,
            self.timeout,
        )
        .await;
        match answer {
            Ok(reply) => CatalogSection {
                status: Status::Ready as i32,
                pins: reply.pins,
                error: String::new(),
                pin_handle: reply.pin_handle,
                ttl_ms: reply.ttl_ms,
            },
            // The catalog answered: its name of the failure, for the chat.
            Err(rpc::RpcError::Service {
                reason, message, ..
            }) => failed(format!("{reason}: {message}")),
            Err(error) => {
                tracing::warn!(%error, tenant, "catalog did not answer; the turn proceeds without it");
                failed(format!("the catalog did not answer: {error}"))
            }
        }
    }
}

impl CatalogClient {
    /// The tenant's catalog servers and latency aggregates, for the context
    /// page; the catalog's own error is [`rpc::RpcError::Service`].
    pub async fn status(
        &self,
        tenant: &str,
        window_seconds: u64,
    ) -> Result<CatalogStatusReply, rpc::RpcError> {
        let request = CatalogStatusRequest {
            tenant: tenant.to_owned(),
            window_seconds,
        };
        rpc::call_for_tenant::<catalog::Status>(
            &self.client,
            &self.subjects,
            tenant,
            &request,
            None,
            self.timeout,
        )
        .await
    }
}

impl CatalogSource for CatalogClient {
    fn prepare<'a>(&'a self, tenant: &'a str, chat_id: &'a str) -> BoxFuture<'a, CatalogSection> {
        self.prepare(tenant, chat_id).boxed()
    }
}

fn failed(error: String) -> CatalogSection {
    metrics::counter!("ctxsync_gate_catalog_failures_total").increment(1);
    CatalogSection {
        status: Status::Failed as i32,
        pins: Vec::new(),
        error,
        ..Default::default()
    }
}
