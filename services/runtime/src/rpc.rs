//! Protobuf request/reply over NATS: a typed client call, and a server loop
//! that shares a subject in a queue group, bounds concurrency, and stops
//! taking requests on shutdown while finishing the ones in flight.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, HeaderMap};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use prost::Message;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use crate::Shutdown;
use crate::nats::{NatsConnection, SubscribeError};

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("no service answers on {subject}")]
    NoResponders { subject: String },
    #[error("no answer on {subject} within {timeout:?}")]
    TimedOut { subject: String, timeout: Duration },
    #[error("request on {subject} failed: {reason}")]
    Transport { subject: String, reason: String },
    #[error("the request is larger than the NATS server accepts (its max_payload)")]
    TooLarge { subject: String },
    #[error("malformed answer on {subject}: {source}")]
    Decode {
        subject: String,
        #[source]
        source: prost::DecodeError,
    },
}

impl RpcError {
    /// The service may answer if asked again later.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Self::NoResponders { .. } | Self::TimedOut { .. } | Self::Transport { .. }
        )
    }
}

/// Sends `request` and decodes the answer.
pub async fn request<Req: Message, Resp: Message + Default>(
    client: &Client,
    subject: String,
    request: &Req,
    headers: Option<HeaderMap>,
    timeout: Duration,
) -> Result<Resp, RpcError> {
    let mut nats_request = async_nats::Request::new()
        .payload(request.encode_to_vec().into())
        .timeout(Some(timeout));
    if let Some(headers) = headers {
        nats_request = nats_request.headers(headers);
    }
    let answer = client
        .send_request(subject.clone(), nats_request)
        .await
        .map_err(|e| match e.kind() {
            async_nats::RequestErrorKind::NoResponders => RpcError::NoResponders {
                subject: subject.clone(),
            },
            async_nats::RequestErrorKind::TimedOut => RpcError::TimedOut {
                subject: subject.clone(),
                timeout,
            },
            async_nats::RequestErrorKind::MaxPayloadExceeded => RpcError::TooLarge {
                subject: subject.clone(),
            },
            _ => RpcError::Transport {
                subject: subject.clone(),
                reason: e.to_string(),
            },
        })?;
    Resp::decode(answer.payload).map_err(|source| RpcError::Decode { subject, source })
}

/// How many requests one replica handles at once; more wait in the subscription.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// A running request loop.
pub struct Server {
    task: JoinHandle<()>,
}

impl Server {
    /// Waits for the loop to stop (after shutdown) and its in-flight requests to finish.
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// Serves `subject` in `queue_group`: each request is decoded as `Req` (a
/// malformed one is answered with `on_malformed`), handled concurrently (at
/// most [`DEFAULT_MAX_IN_FLIGHT`]), and answered with the encoded `Resp`.
pub async fn serve<Req, Resp, F, Fut>(
    connection: &NatsConnection,
    subject: String,
    queue_group: &'static str,
    shutdown: Shutdown,
    grace: Duration,
    on_malformed: fn(String) -> Resp,
    handler: F,
) -> Result<Server, SubscribeError>
where
    Req: Message + Default + Send + 'static,
    Resp: Message + Send + 'static,
    F: Fn(Req, Option<HeaderMap>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Resp> + Send + 'static,
{
    serve_with_limit(
        connection,
        subject,
        queue_group,
        shutdown,
        grace,
        DEFAULT_MAX_IN_FLIGHT,
        on_malformed,
        handler,
    )
    .await
}

/// [`serve`] with its own bound on requests in flight (a service whose
/// requests wait, like a held first turn, needs a larger one).
#[allow(clippy::too_many_arguments)]
pub async fn serve_with_limit<Req, Resp, F, Fut>(
    connection: &NatsConnection,
    subject: String,
    queue_group: &'static str,
    shutdown: Shutdown,
    grace: Duration,
    max_in_flight: usize,
    on_malformed: fn(String) -> Resp,
    handler: F,
) -> Result<Server, SubscribeError>
where
    Req: Message + Default + Send + 'static,
    Resp: Message + Send + 'static,
    F: Fn(Req, Option<HeaderMap>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Resp> + Send + 'static,
{
    serve_after(
        connection,
        subject,
        queue_group,
        shutdown,
        grace,
        max_in_flight,
        futures::stream::pending().boxed(),
        on_malformed,
        handler,
    )
    .await
}

/// [`serve_with_limit`], where `before` (typically event subscriptions of
/// the same client, each item already applied when it is yielded) is polled
/// ahead of the requests: every message the connection delivered before a
/// request has been applied when that request is handled. A request sent
/// after an event was published on the same server is therefore answered
/// with that event taken into account.
#[allow(clippy::too_many_arguments)]
pub async fn serve_after<Req, Resp, F, Fut>(
    connection: &NatsConnection,
    subject: String,
    queue_group: &'static str,
    shutdown: Shutdown,
    grace: Duration,
    max_in_flight: usize,
    mut before: BoxStream<'static, ()>,
    on_malformed: fn(String) -> Resp,
    handler: F,
) -> Result<Server, SubscribeError>
where
    Req: Message + Default + Send + 'static,
    Resp: Message + Send + 'static,
    F: Fn(Req, Option<HeaderMap>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Resp> + Send + 'static,
{
    // Only once the server has the subscription may the service call itself ready.
    let mut subscriber =
        crate::nats::subscribe(connection, subject.clone(), Some(queue_group)).await?;
    let client = connection.client.clone();
    let handler = Arc::new(handler);
    let permits = Arc::new(Semaphore::new(max_in_flight));
    let tracker = TaskTracker::new();
    let task = tokio::spawn(async move {
        loop {
            let message = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(()) = before.next() => continue,
                message = subscriber.next() => match message {
                    Some(m) => m,
                    None => break,
                },
            };
            // The connection queued everything it read before this request
            // already: apply what the first poll above did not see yet.
            while let Some(Some(())) = before.next().now_or_never() {}
            let Some(reply_to) = message.reply.clone() else {
                tracing::debug!(%subject, "request without reply subject ignored");
                continue;
            };
            // Keep applying `before` while every permit is taken: the
            // requests holding them may be waiting for exactly those items.
            let permit = loop {
                tokio::select! {
                    biased;
                    Some(()) = before.next() => {}
                    permit = permits.clone().acquire_owned() => break permit,
                }
            };
            let Ok(permit) = permit else {
                break;
            };
            let handler = handler.clone();
            let client = client.clone();
            tracker.spawn(async move {
                let response = match Req::decode(message.payload) {
                    Ok(request) => handler(request, message.headers).await,
                    Err(error) => on_malformed(format!("malformed request: {error}")),
                };
                if let Err(error) = client
                    .publish(reply_to, response.encode_to_vec().into())
                    .await
                {
                    tracing::warn!(%error, "cannot send reply");
                }
                drop(permit);
            });
        }
        // Stop taking work, then finish what is in flight.
        let _ = subscriber.unsubscribe().await;
        tracker.close();
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(%subject, "in-flight requests did not finish within the shutdown grace");
        }
        let _ = client.flush().await;
    });
    Ok(Server { task })
}
