//! The store's NATS plumbing: each call of `ctxsync_proto::rpc::store`
//! served in the store's queue group, replies that carry the error envelope
//! instead of their answer, and events published after commit.

use std::time::Duration;

use ctxsync_proto::rpc::Reply;
use ctxsync_proto::rpc::store::StoreRpc;
use ctxsync_proto::subjects::{STORE_QUEUE_GROUP, Subjects};
use ctxsync_proto::v1::{ServiceError, service_error::Code};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::rpc;
use ctxsync_runtime::shutdown::Shutdown;
use ctxsync_runtime::trace::TraceContext;
use prost::Message;

use crate::db::StoreError;

/// The envelope a store error travels in; the code is what callers decide on.
pub(crate) fn error_reply(error: &StoreError) -> ServiceError {
    let code = match error {
        StoreError::NotFound(_)
        | StoreError::KeyNotFound(_)
        | StoreError::NoSuchAgentName { .. } => Code::NotFound,
        StoreError::InvalidAgentId(_) | StoreError::Invalid(_) | StoreError::MissingTenant => {
            Code::InvalidArgument
        }
        StoreError::AlreadyExists { .. } | StoreError::KeyExists => Code::AlreadyExists,
        StoreError::DeadlineExceeded => Code::DeadlineExceeded,
        StoreError::Stopped => Code::Unavailable,
        StoreError::Database(_) | StoreError::Corrupt(_) | StoreError::CommitUnknown(_) => {
            Code::Internal
        }
    };
    if code == Code::Internal {
        tracing::error!(%error, "store request failed");
    }
    ServiceError::new(code, error.to_string())
}

/// The reply for `result`: its answer, or the error.
pub(crate) fn reply<T, R: Reply>(result: Result<T, StoreError>, answer: impl FnOnce(T) -> R) -> R {
    result.map_or_else(|error| R::failed(error_reply(&error)), answer)
}

/// Publishes an event after commit. A lost event is repaired by readers
/// re-checking on reconnect, so a publish failure is logged, not retried.
pub(crate) async fn publish(
    nats: &async_nats::Client,
    subject: String,
    trace: Option<TraceContext>,
    event: &impl Message,
) {
    let payload = event.encode_to_vec().into();
    let published = match trace {
        Some(trace) => {
            nats.publish_with_headers(subject, trace.child().to_nats(), payload)
                .await
        }
        None => nats.publish(subject, payload).await,
    };
    if let Err(error) = published {
        tracing::warn!(%error, "cannot publish event");
    }
}

/// Serves the store call `M` (named by its marker) in the store's queue
/// group; the handler's reply carries its answer or its error (see
/// [`reply`]). The future is `serve_rpc`'s own (no state of its own).
pub(crate) fn endpoint<'a, M, F, Fut>(
    call: M,
    nats: &'a NatsConnection,
    subjects: &Subjects,
    shutdown: &Shutdown,
    grace: Duration,
    handler: F,
) -> impl std::future::Future<Output = Result<rpc::Server, ctxsync_runtime::nats::SubscribeError>>
+ use<'a, M, F, Fut>
where
    M: StoreRpc,
    F: Fn(M::Request, rpc::Incoming) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = M::Reply> + Send + 'static,
{
    rpc::serve_rpc(
        call,
        nats,
        subjects,
        STORE_QUEUE_GROUP,
        shutdown.clone(),
        grace,
        move |request, incoming| {
            let reply = handler(request, incoming);
            async move { Ok(reply.await) }
        },
    )
}
