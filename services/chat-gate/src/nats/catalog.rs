//! The first turn's catalog section: the tenant's operator-configured MCP
//! servers pinned by the catalog service for this chat. Asked concurrently
//! with the discovery wait; a catalog that does not answer fails open.

use std::time::Duration;

use ctxsync_proto::rpc::catalog;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    CatalogPrepareReply, CatalogPrepareRequest, CatalogSection, CatalogStatusReply,
    CatalogStatusRequest, catalog_section::Status,
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
        let answer = self.prepared(&request).await;
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
    /// The preparation's answer within the catalog timeout, asked again
    /// when the first request looks lost: at once if no catalog listened,
    /// and, with the first still waited for, at half the timeout if neither
    /// answered by then. Core NATS delivers a request at most once, and one
    /// in flight when a connection closes (a catalog replaced, a NATS node
    /// in lame duck) is gone; a slow live discovery is not, so the first
    /// request is never abandoned for the second. Asking twice is safe: a
    /// preparation is idempotent per session (the second answers the pins
    /// the first committed, whichever replica each reached).
    async fn prepared(
        &self,
        request: &CatalogPrepareRequest,
    ) -> Result<CatalogPrepareReply, rpc::RpcError> {
        let started = tokio::time::Instant::now();
        let first = self.ask(request, self.timeout);
        tokio::pin!(first);
        let second_at = self.timeout / 2;
        tokio::select! {
            answer = &mut first => match answer {
                Err(rpc::RpcError::NoResponders { .. }) => {
                    asked_again("no_responders");
                    self.ask(request, self.timeout.saturating_sub(started.elapsed())).await
                }
                answer => answer,
            },
            () = tokio::time::sleep(second_at) => {
                asked_again("no_answer_yet");
                let second = self.ask(request, self.timeout.saturating_sub(second_at));
                first_answer(first, second).await
            }
        }
    }

    async fn ask(
        &self,
        request: &CatalogPrepareRequest,
        timeout: Duration,
    ) -> Result<CatalogPrepareReply, rpc::RpcError> {
        rpc::call_for_tenant::<catalog::Prepare>(
            &self.client,
            &self.subjects,
            &request.tenant,
            request,
            None,
            timeout,
        )
        .await
    }
}

/// The first of two requests' answers, where an answer that may mean the
/// request was lost waits for the other's.
async fn first_answer<T>(
    first: impl Future<Output = Result<T, rpc::RpcError>>,
    second: impl Future<Output = Result<T, rpc::RpcError>>,
) -> Result<T, rpc::RpcError> {
    let lost = |answer: &Result<T, rpc::RpcError>| {
        matches!(
            answer,
            Err(rpc::RpcError::TimedOut { .. } | rpc::RpcError::NoResponders { .. })
        )
    };
    tokio::pin!(first, second);
    tokio::select! {
        answer = &mut first => if lost(&answer) { second.await } else { answer },
        answer = &mut second => if lost(&answer) { first.await } else { answer },
    }
}

fn asked_again(why: &'static str) {
    metrics::counter!("ctxsync_gate_catalog_asked_again_total", "why" => why).increment(1);
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
