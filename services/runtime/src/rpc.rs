//! Protobuf request/reply over NATS: a typed client call, and a server loop
//! that shares a subject in a queue group, bounds concurrency, and stops
//! taking requests on shutdown while finishing the ones in flight.
//!
//! Calls are declared in [`ctxsync_proto::rpc`] (subject, request and reply
//! together); [`call`], [`call_for_tenant`] and [`serve_rpc`] take that
//! declaration, and every failure, the transport's or the service's
//! [`ServiceError`] envelope, is one [`RpcError`]. [`request`] and [`serve`]
//! are the untyped primitives beneath them.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::{Client, HeaderMap};
use ctxsync_proto::rpc::{FixedSubject, Reply, Rpc, TenantSubject};
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{ServiceError, service_error::Code};
use futures::StreamExt;
use prost::Message;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::nats::{NatsConnection, SubscribeError};
use crate::shutdown::Shutdown;

/// Why a call got no answer: the transport's failures, or the service's
/// own error ([`RpcError::Service`]), on which callers match by code.
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
    /// The answer decoded but lacks what every answer of its call carries.
    #[error("malformed answer on {subject}: it carries no {field}")]
    Incomplete {
        subject: String,
        field: &'static str,
    },
    /// The service answered its error envelope instead of an answer.
    #[error("{subject} answered {}: {message}", .code.name())]
    Service {
        subject: String,
        code: Code,
        message: String,
        /// The service's finer name of the failure, where it documents one.
        reason: String,
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

    /// The service's code, when the service answered an error.
    pub fn code(&self) -> Option<Code> {
        match self {
            Self::Service { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The service's error as `subject` answered it.
    pub fn service(subject: impl Into<String>, error: ServiceError) -> Self {
        Self::Service {
            subject: subject.into(),
            code: error.code(),
            message: error.message,
            reason: error.reason,
        }
    }

    /// The envelope this error travels as when a service passes it on: a
    /// service's error as it was, anything else `internal` (or
    /// `unavailable` when asking again may succeed).
    pub fn to_service_error(&self) -> ServiceError {
        match self {
            Self::Service {
                code,
                message,
                reason,
                ..
            } => ServiceError::new(*code, message.clone()).with_reason(reason.clone()),
            error if error.is_unavailable() => {
                ServiceError::new(Code::Unavailable, error.to_string())
            }
            error => ServiceError::new(Code::Internal, error.to_string()),
        }
    }
}

/// Calls `M` on its subject: its reply, or every failure (the service's
/// error envelope included) as an [`RpcError`]. The request carries its
/// budget (`timeout`) in [`TIMEOUT_HEADER`].
pub async fn call<M: FixedSubject>(
    client: &Client,
    subjects: &Subjects,
    request: &M::Request,
    headers: Option<HeaderMap>,
    timeout: Duration,
) -> Result<M::Reply, RpcError> {
    let subject = M::subject(subjects);
    let reply = request_into(client, None, subject.clone(), request, headers, timeout).await?;
    answered(subject, reply)
}

/// [`call`] on behalf of `tenant`, on the tenant's subject, answered on an
/// inbox naming the tenant (see [`request_for_tenant`]).
pub async fn call_for_tenant<M: TenantSubject>(
    client: &Client,
    subjects: &Subjects,
    tenant: &str,
    request: &M::Request,
    headers: Option<HeaderMap>,
    timeout: Duration,
) -> Result<M::Reply, RpcError> {
    let subject = M::subject(subjects, tenant);
    let reply =
        request_for_tenant(client, tenant, subject.clone(), request, headers, timeout).await?;
    answered(subject, reply)
}

/// A reply's answer, or its error envelope as [`RpcError::Service`].
fn answered<R: Reply>(subject: String, mut reply: R) -> Result<R, RpcError> {
    match reply.take_error() {
        Some(error) => Err(RpcError::service(subject, error)),
        None => Ok(reply),
    }
}

/// The NATS header that carries how long a request's sender waits for the
/// answer, in milliseconds from sending. A server reckons the request's
/// deadline from the moment it takes the request, on its own monotonic
/// clock, and drops one whose deadline passed before it was executed: work
/// nobody waits for is not done. A budget rather than a time of day: the
/// processes' wall clocks may disagree by any amount (a replica whose clock
/// ran ahead would otherwise drop every request as late), and what is lost
/// is only the time a request spent on its way. Deadlines are an economy,
/// never what keeps state correct (the ordering rules read no clock).
pub const TIMEOUT_HEADER: &str = "Ctxsync-Timeout";

/// The deadline of a request taken at `taken`, if it carries a budget.
pub fn deadline_of(headers: Option<&HeaderMap>, taken: Instant) -> Option<Instant> {
    let millis: u64 = headers?.get(TIMEOUT_HEADER)?.as_str().parse().ok()?;
    taken.checked_add(Duration::from_millis(millis))
}

/// True once `deadline` has passed (a request without one never expires).
pub fn expired(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|deadline| Instant::now() >= deadline)
}

/// Sends `request` and decodes the answer. The request carries its budget
/// (`timeout`) in [`TIMEOUT_HEADER`]. Untyped: a declared call is
/// made with [`call`]; this remains for tests of raw NATS behaviour (a
/// payload no declared call would send, a subject of another tenant).
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
    headers.insert(TIMEOUT_HEADER, timeout.as_millis().to_string().as_str());
    let mut nats_request = async_nats::Request::new()
        .payload(request.encode_to_vec().into())
        .timeout(Some(timeout))
        .headers(headers);
    if let Some(inbox) = inbox {
        nats_request = nats_request.inbox(inbox);
    }
    // Bounded here too: a publish waiting for a reconnect is not bounded by
    // the request's own timeout.
    let sent = tokio::time::timeout(timeout, client.send_request(subject.clone(), nats_request));
    let answer = sent
        .await
        .map_err(|_| RpcError::TimedOut {
            subject: subject.clone(),
            timeout,
        })?
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
    /// When the server took the request off its subscription.
    pub taken: Instant,
}

impl Incoming {
    /// The subject's last token (`<prefix>.gate.turn.<tenant>` → the tenant).
    pub fn last_token(&self) -> &str {
        self.subject.rsplit('.').next().unwrap_or_default()
    }

    /// The request's deadline, if it carries one.
    pub fn deadline(&self) -> Option<Instant> {
        deadline_of(self.headers.as_ref(), self.taken)
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

/// Serves the call `M` (named by its marker, e.g. `store::GetAgentState`)
/// on its subject in `queue_group`, as [`serve`] does: the handler answers
/// `M`'s reply or the error envelope that takes its place, and a request
/// that does not decode as `M`'s is answered `invalid_argument` without
/// reaching the handler.
// Not `async`: the future is [`serve`]'s own, with no state of its own, so a
// service awaiting many of them holds no larger futures than before.
pub fn serve_rpc<'a, M, F, Fut>(
    _call: M,
    connection: &'a NatsConnection,
    subjects: &Subjects,
    queue_group: &'static str,
    shutdown: Shutdown,
    grace: Duration,
    handler: F,
) -> impl Future<Output = Result<Server, SubscribeError>> + use<'a, M, F, Fut>
where
    M: Rpc,
    F: Fn(M::Request, Incoming) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<M::Reply, ServiceError>> + Send + 'static,
{
    serve(
        connection,
        M::served(subjects),
        queue_group,
        shutdown,
        grace,
        malformed::<M::Reply>,
        move |request, incoming| {
            let answer = handler(request, incoming);
            async move { answer.await.unwrap_or_else(M::Reply::failed) }
        },
    )
}

fn malformed<R: Reply>(message: String) -> R {
    R::failed(ServiceError::invalid_argument(message))
}

/// Serves `subject` in `queue_group`: each request is decoded as `Req` (a
/// malformed one is answered with `on_malformed`), handled concurrently (at
/// most [`DEFAULT_MAX_IN_FLIGHT`]), and answered with the encoded `Resp`.
/// On shutdown the subscription is drained: the server sends no more
/// requests here, the ones it already sent are still answered, and all of
/// them finish within `grace` of the signal. Untyped: a declared call is
/// served with [`serve_rpc`], which this is beneath.
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
        let mut deadline: Option<Instant> = None;
        loop {
            let message = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if deadline.is_none() => {
                    deadline = Some(Instant::now() + grace);
                    // Stop taking work: the server routes new requests to
                    // other replicas; the ones it already sent here still
                    // arrive, are answered, and then the subscription ends.
                    let bound = grace.min(crate::nats::DRAIN_ROUND_TRIP_BOUND);
                    if crate::nats::drain_delivered(&client, &mut subscriber, bound)
                        .await
                        .is_err()
                    {
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
            let taken = Instant::now();
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
                if expired(deadline_of(message.headers.as_ref(), taken)) {
                    metrics::counter!("ctxsync_rpc_expired_total", "subject" => subject.clone())
                        .increment(1);
                    tracing::debug!(%subject, "request past its deadline dropped unexecuted");
                    return;
                }
                let incoming = Incoming {
                    subject: message.subject,
                    headers: message.headers,
                    taken,
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
        let deadline = deadline.unwrap_or_else(|| Instant::now() + grace);
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
    use ctxsync_proto::v1::{GetAgentStateReply, StorePushReply};

    #[test]
    fn a_service_error_is_matched_on_its_code_and_keeps_the_rest() {
        let refused = StorePushReply::failed(
            ServiceError::new(Code::DeadlineExceeded, "nothing was written").with_reason("r.x"),
        );
        let error = answered("p.store.agent.push".into(), refused).unwrap_err();
        assert!(
            matches!(
                &error,
                RpcError::Service { code: Code::DeadlineExceeded, message, reason, subject }
                    if message == "nothing was written" && reason == "r.x" && subject == "p.store.agent.push"
            ),
            "{error:?}"
        );
        assert_eq!(error.code(), Some(Code::DeadlineExceeded));
        assert!(!error.is_unavailable(), "a refusal is an answer");
        assert_eq!(
            error.to_string(),
            "p.store.agent.push answered deadline_exceeded: nothing was written"
        );
        // Passed on as it came.
        let passed_on = error.to_service_error();
        assert_eq!(
            (
                passed_on.code(),
                passed_on.message.as_str(),
                passed_on.reason.as_str()
            ),
            (Code::DeadlineExceeded, "nothing was written", "r.x")
        );

        let answer = GetAgentStateReply {
            state: Some(Default::default()),
            error: None,
        };
        assert_eq!(answered("s".into(), answer.clone()).unwrap(), answer);
    }

    #[test]
    fn transport_failures_have_no_code_and_pass_on_as_unavailable_or_internal() {
        let gone = RpcError::NoResponders {
            subject: "s".into(),
        };
        assert_eq!(gone.code(), None);
        assert!(gone.is_unavailable());
        assert_eq!(gone.to_service_error().code(), Code::Unavailable);
        let broken = RpcError::Incomplete {
            subject: "s".into(),
            field: "state",
        };
        assert_eq!(broken.code(), None);
        assert!(!broken.is_unavailable());
        assert_eq!(broken.to_service_error().code(), Code::Internal);
        assert_eq!(
            broken.to_string(),
            "malformed answer on s: it carries no state"
        );
    }

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
