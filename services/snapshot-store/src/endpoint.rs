//! The store's NATS plumbing: one subject served in the store's queue
//! group, replies that carry an error instead of their answer, and events
//! published after commit.

use std::time::Duration;

use ctxsync_proto::subjects::STORE_QUEUE_GROUP;
use ctxsync_proto::v1::{
    AuthenticateAgentReply, GetAgentStateReply, RegisterAgentReply, StoreError as ProtoError,
    StorePushReply, UpdateStartupReply, store_error::Code,
};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::rpc;
use ctxsync_runtime::shutdown::Shutdown;
use ctxsync_runtime::trace::TraceContext;
use prost::Message;

use crate::db::StoreError;

pub(crate) fn error_reply(error: &StoreError) -> ProtoError {
    let code = match error {
        StoreError::NotFound(_)
        | StoreError::KeyNotFound(_)
        | StoreError::NoSuchAgentName { .. } => Code::NotFound,
        StoreError::InvalidAgentId(_) | StoreError::Invalid(_) | StoreError::MissingTenant => {
            Code::InvalidArgument
        }
        StoreError::AlreadyExists { .. } | StoreError::KeyExists => Code::AlreadyExists,
        StoreError::DeadlineExceeded => Code::DeadlineExceeded,
        StoreError::Database(_) | StoreError::Corrupt(_) => Code::Internal,
    };
    if code == Code::Internal {
        tracing::error!(%error, "store request failed");
    }
    ProtoError {
        code: code as i32,
        message: error.to_string(),
    }
}

/// A store reply that can carry an error instead of its answer.
pub(crate) trait Reply: Default {
    fn failed(error: ProtoError) -> Self;
}

macro_rules! impl_reply {
    ($($reply:ty),*) => {$(
        impl Reply for $reply {
            fn failed(error: ProtoError) -> Self {
                Self { error: Some(error), ..Default::default() }
            }
        }
    )*};
}
impl_reply!(
    RegisterAgentReply,
    AuthenticateAgentReply,
    UpdateStartupReply,
    StorePushReply,
    GetAgentStateReply,
    ctxsync_proto::v1::ListAgentsReply,
    ctxsync_proto::v1::RotateAgentTokenReply,
    ctxsync_proto::v1::CreateTenantKeyReply,
    ctxsync_proto::v1::ListTenantKeysReply,
    ctxsync_proto::v1::RevokeTenantKeyReply,
    ctxsync_proto::v1::VerifyTenantKeyReply
);

fn malformed<R: Reply>(message: String) -> R {
    R::failed(ProtoError {
        code: Code::InvalidArgument as i32,
        message,
    })
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

/// Serves one store subject in the store's queue group.
pub(crate) async fn endpoint<Req, R, F, Fut>(
    nats: &NatsConnection,
    subject: String,
    shutdown: &Shutdown,
    grace: Duration,
    handler: F,
) -> Result<rpc::Server, ctxsync_runtime::nats::SubscribeError>
where
    Req: Message + Default + Send + 'static,
    R: Reply + Message + Send + 'static,
    F: Fn(Req, rpc::Incoming) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = R> + Send + 'static,
{
    rpc::serve(
        nats,
        subject,
        STORE_QUEUE_GROUP,
        shutdown.clone(),
        grace,
        malformed::<R>,
        handler,
    )
    .await
}
