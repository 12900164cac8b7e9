//! Protobuf request/reply over NATS: a typed client call, and a server loop
//! that shares a subject in a queue group, bounds concurrency, and stops
//! taking requests on shutdown while finishing the ones in flight.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::{Client, HeaderMap};
use futures::StreamExt;
use prost::Message;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use crate::nats::{NatsConnection, SubscribeError};
use crate::shutdown::Shutdown;

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

/// The NATS header that carries a request's deadline: milliseconds since the
/// Unix epoch after which its sender no longer waits for the answer. A server
/// drops a request it picks up past its deadline without executing it: work
/// nobody waits for is not done. Deadlines are an economy, never what keeps
/// state correct (replicas' clocks may disagree; the ordering rules of the
/// services do not read clocks).
pub const DEADLINE_HEADER: &str = "Ctxsync-Deadline";

/// The deadline a request carries, if any.
pub fn deadline_of(headers: Option<&HeaderMap>) -> Option<SystemTime> {
    let millis: u64 = headers?.get(DEADLINE_HEADER)?.as_str().parse().ok()?;
    UNIX_EPOCH.checked_add(Duration::from_millis(millis))
}

/// True once `deadline` has passed (a request without one never expires).
pub fn expired(deadline: Option<SystemTime>) -> bool {
    deadline.is_some_and(|deadline| SystemTime::now() >= deadline)
}

/// Sends `request` and decodes the answer. The request carries its deadline
/// (now + `timeout`) in [`DEADLINE_HEADER`].
pub async fn request<Req: Message, Resp: Message + Default>(
    client: &Client,
    subject: String,
    request: &Req,
    headers: Option<HeaderMap>,
    timeout: Duration,
) -> Result<Resp, RpcError> {
    request_into(client, None, subject, request, headers, timeout).await
}

/// [`request`] on behalf of `tenant`: the answer comes back on an inbox
/// under the client's own prefix and the tenant (`_INBOX.<client>.<tenant>.…`),
/// so a service that answers a tenant's requests only into that tenant's
/// inboxes (`CTXSYNC_REPLY_INBOX_PREFIXES=…,_INBOX.chat-gate.{tenant}.`)
/// answers this one, and no tenant can aim an answer at another's.
pub async fn request_for_tenant<Req: Message, Resp: Message + Default>(
    client: &Client,
    tenant: &str,
    subject: String,
    request: &Req,
    headers: Option<HeaderMap>,
    timeout: Duration,
) -> Result<Resp, RpcError> {
    let inbox = client.new_inbox();
    let inbox = match inbox.rsplit_once('.') {
        Some((prefix, id)) => format!("{prefix}.{tenant}.{id}"),
        None => inbox,
    };
    request_into(client, Some(inbox), subject, request, headers, timeout).await
}

async fn request_into<Req: Message, Resp: Message + Default>(
    client: &Client,
    inbox: Option<String>,
    subject: String,
    request: &Req,
    headers: Option<HeaderMap>,
    timeout: Duration,
) -> Result<Resp, RpcError> {
    let mut headers = headers.unwrap_or_default();
    let deadline = SystemTime::now()
        .checked_add(timeout)
        .and_then(|at| at.duration_since(UNIX_EPOCH).ok())
        .map_or(u128::MAX, |since_epoch| since_epoch.as_millis());
    headers.insert(DEADLINE_HEADER, deadline.to_string().as_str());
    let mut nats_request = async_nats::Request::new()
        .payload(request.encode_to_vec().into())
        .timeout(Some(timeout))
        .headers(headers);
    if let Some(inbox) = inbox {
        nats_request = nats_request.inbox(inbox);
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

/// What a handler learns of a request besides its body: the subject it came
/// on (some subjects carry the caller's tenant, confined by NATS
/// permissions) and its headers (trace context, deadline).
#[derive(Debug, Clone)]
pub struct Incoming {
    pub subject: async_nats::Subject,
    pub headers: Option<HeaderMap>,
}

impl Incoming {
    /// The subject's last token (`<prefix>.gate.turn.<tenant>` → the tenant).
    pub fn last_token(&self) -> &str {
        self.subject.rsplit('.').next().unwrap_or_default()
    }

    /// The request's deadline, if it carries one.
    pub fn deadline(&self) -> Option<SystemTime> {
        deadline_of(self.headers.as_ref())
    }
}

pub use crate::config::{ReplyInboxes, ReplyInboxesError};

/// Whether a request on `subject` (served as `pattern`) may be answered on
/// `reply`; a refusal is counted and logged (at most once a second: the
/// reply subject is the caller's to choose, and so is the rate).
pub fn reply_permitted(inboxes: &ReplyInboxes, pattern: &str, subject: &str, reply: &str) -> bool {
    // A served pattern ending in a wildcard token is a tenant subject.
    let tenant = pattern
        .ends_with(".*")
        .then(|| subject.rsplit('.').next().unwrap_or_default());
    if inboxes.permits(reply, tenant) {
        return true;
    }
    metrics::counter!("ctxsync_rpc_reply_refused_total", "subject" => pattern.to_owned())
        .increment(1);
    static LAST_WARNING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_WARNING.swap(now, std::sync::atomic::Ordering::Relaxed) != now {
        let shown: String = reply.chars().take(120).collect();
        tracing::warn!(
            subject = %subject,
            reply = %shown,
            permitted = %inboxes,
            "request refused unexecuted: its reply subject is outside the permitted inboxes"
        );
    }
    false
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
/// On shutdown the subscription is drained: the server sends no more
/// requests here, the ones it already sent are still answered, and all of
/// them finish within `grace` of the signal.
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
    F: Fn(Req, Incoming) -> Fut + Send + Sync + 'static,
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
/// requests wait needs a larger one).
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
    F: Fn(Req, Incoming) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Resp> + Send + 'static,
{
    // Only once the server has the subscription may the service call itself ready.
    let responder = connection.responder();
    let mut subscriber =
        crate::nats::subscribe(responder, subject.clone(), Some(queue_group)).await?;
    metrics::counter!("ctxsync_rpc_expired_total", "subject" => subject.clone()).increment(0);
    metrics::counter!("ctxsync_rpc_reply_refused_total", "subject" => subject.clone()).increment(0);
    let client = responder.client.clone();
    let inboxes = connection.reply_inboxes().clone();
    let handler = Arc::new(handler);
    let permits = Arc::new(Semaphore::new(max_in_flight));
    let tracker = TaskTracker::new();
    let task = tokio::spawn(async move {
        // Set at shutdown: everything after it (the requests the server had
        // already routed here, then the ones in flight) ends by then.
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            let message = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    deadline = Some(tokio::time::Instant::now() + grace);
                    // Stop taking work: the server routes new requests to
                    // other replicas; the ones it already sent here still
                    // arrive, are answered, and then the subscription ends.
                    if subscriber.drain().await.is_err() {
                        break;
                    }
                    continue;
                }
                _ = sleep_until_some(deadline) => break,
                message = subscriber.next() => match message {
                    Some(m) => m,
                    None => break,
                },
            };
            let Some(reply_to) = message.reply.clone() else {
                tracing::debug!(%subject, "request without reply subject ignored");
                continue;
            };
            if !reply_permitted(&inboxes, &subject, &message.subject, &reply_to) {
                continue;
            }
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let handler = handler.clone();
            let client = client.clone();
            let subject = subject.clone();
            tracker.spawn(async move {
                // Picked up after its sender gave up (a stalled replica, a
                // long queue): nobody reads the answer, so nothing is done.
                if expired(deadline_of(message.headers.as_ref())) {
                    metrics::counter!("ctxsync_rpc_expired_total", "subject" => subject.clone())
                        .increment(1);
                    tracing::debug!(%subject, "request past its deadline dropped unexecuted");
                    return;
                }
                let incoming = Incoming {
                    subject: message.subject,
                    headers: message.headers,
                };
                let response = match Req::decode(message.payload) {
                    Ok(request) => handler(request, incoming).await,
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
        let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + grace);
        let finished = tokio::time::timeout_at(deadline, tracker.wait()).await;
        if finished.is_err() {
            tracing::warn!(%subject, "in-flight requests did not finish within the shutdown grace");
        }
        let _ = client.flush().await;
    });
    Ok(Server { task })
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_go_only_into_the_permitted_inboxes() {
        let any = ReplyInboxes::default();
        assert!(any.permits("_INBOX.chat-demo.abc.1", None));
        assert!(any.permits("_INBOX.x", Some("demo")));
        for aimed in [
            "$KV.ctxsync_catalog_memory.0123abcd",
            "ctxsync.events.discovery.agent-1",
            "ctxsync.events.tenant_key.revoked",
            "ctxsync.catalog.prepare.other",
            "_INBOX.",
            "_INBOX",
            "_INBOX.>",
            "_INBOX.*.x",
            "_INBOX..x",
            "_INBOXES.x",
            "",
        ] {
            assert!(!any.permits(aimed, None), "{aimed:?} permitted");
            assert!(!any.permits(aimed, Some("demo")), "{aimed:?} permitted");
        }

        let per_tenant = ReplyInboxes::parse("_INBOX.chat-{tenant}., _INBOX.chat-gate.").unwrap();
        assert!(per_tenant.permits("_INBOX.chat-demo.n.1", Some("demo")));
        assert!(per_tenant.permits("_INBOX.chat-gate.n.1", Some("demo")));
        assert!(!per_tenant.permits("_INBOX.chat-other.n.1", Some("demo")));
        assert!(!per_tenant.permits("_INBOX.chat-demo.n.1", Some("dem")));
        // A tenant entry never applies where no tenant is named.
        assert!(!per_tenant.permits("_INBOX.chat-demo.n.1", None));
        assert!(per_tenant.permits("_INBOX.chat-gate.n.1", None));
    }

    #[test]
    fn unusable_prefixes_are_named() {
        for (value, reason) in [
            ("", "empty"),
            ("_INBOX", "ending with a dot"),
            ("_INBOX.>.", "wildcard"),
            ("_INBOX.{tenant}.{tenant}.", "at most once"),
            ("_INBOX.{user}.", "placeholder"),
            ("_INBOX.,", "empty"),
        ] {
            let error = ReplyInboxes::parse(value).unwrap_err().to_string();
            assert!(
                error.starts_with("invalid CTXSYNC_REPLY_INBOX_PREFIXES entry"),
                "{error}"
            );
            assert!(error.contains(reason), "{value}: {error}");
        }
        assert_eq!(
            ReplyInboxes::parse("_INBOX.").unwrap(),
            ReplyInboxes::default()
        );
    }

    #[test]
    fn a_tenant_subject_is_one_served_with_a_wildcard_last_token() {
        let per_tenant = ReplyInboxes::parse("_INBOX.chat-{tenant}.").unwrap();
        assert!(reply_permitted(
            &per_tenant,
            "ctxsync.gate.turn.*",
            "ctxsync.gate.turn.demo",
            "_INBOX.chat-demo.n.1"
        ));
        assert!(!reply_permitted(
            &per_tenant,
            "ctxsync.gate.turn.*",
            "ctxsync.gate.turn.demo",
            "_INBOX.chat-other.n.1"
        ));
        assert!(!reply_permitted(
            &per_tenant,
            "ctxsync.store.agent.get",
            "ctxsync.store.agent.get",
            "_INBOX.chat-demo.n.1"
        ));
    }
}
