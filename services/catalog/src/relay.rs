//! The downstream side of relays: the MCP client of a session of `/mcp`
//! (or of one stateless request) as what upstream servers send reaches it.
//!
//! * Progress goes out with the client's own token, so rmcp's transport
//!   puts it on the stream of the client's request; a call the endpoint
//!   answers itself (`endpoint::direct`) takes its progress to its own
//!   stream ([`Client::progress_to`]).
//! * An upstream's elicitation or sampling request is asked of the client
//!   on the stream of the call it came during (rmcp's originating-request
//!   marker), and only when the client declared the capability; otherwise
//!   the upstream is answered `-32601`. A stateless (2026-07-28) client is
//!   asked in input rounds instead ([`InputRounds`]): that revision has no
//!   server-to-client requests.
//! * Log messages are forwarded with the server named in `logger`
//!   (`server` or `server/logger`); resource updates only for URIs the
//!   client subscribed to.
//!
//! Each relayed kind is counted in `ctxsync_catalog_mcp_relayed_total`.

// Logging and sampling are deprecated for 2026-07-28 (SEP-2577); the 2025
// clients and servers relayed between still speak them.
#![allow(deprecated)]

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ctxsync_mcp::relay::{Asker, Downstream};
use ctxsync_proto::v1::CatalogCallReply;
use futures::future::BoxFuture;
use rmcp::model::{
    ClientCapabilities, ClientResult, CreateMessageRequest, CreateMessageRequestParams,
    CreateMessageResult, ElicitRequest, ElicitRequestParams, ElicitResult, ErrorData, InputRequest,
    InputRequests, InputResponses, LoggingLevel, LoggingMessageNotificationParam,
    ProgressNotificationParam, ProgressToken, RequestId, ResourceUpdatedNotificationParam,
    ServerRequest,
};
use rmcp::service::{OriginatingRequestId, PeerRequestOptions, ServiceError};
use rmcp::{Peer, RoleServer};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// How long the client's progress on a question is still relayed back
/// after its answer.
const PROGRESS_AFTER_ANSWER: Duration = Duration::from_secs(2);

/// Counts one relayed message of `kind`.
pub(crate) fn relayed(kind: &'static str) {
    metrics::counter!("ctxsync_catalog_mcp_relayed_total", "kind" => kind).increment(1);
}

/// The server that asked a question, and its progress token.
type AskedBy = (rmcp::Peer<rmcp::RoleClient>, ProgressToken);

/// A client of `/mcp`, as upstream servers reach it.
pub(crate) struct Client {
    peer: Peer<RoleServer>,
    elicitation: bool,
    sampling: bool,
    /// What `logging/setLevel` asked, applied to each upstream it uses.
    level: Mutex<Option<LoggingLevel>>,
    /// The resource URIs it subscribed to.
    subscribed: Mutex<HashSet<String>>,
    /// The token of a question asked of it → the server that asked and
    /// that server's token: its progress on the question goes back there.
    asked: std::sync::Arc<Mutex<HashMap<ProgressToken, AskedBy>>>,
    /// The progress tokens of calls the endpoint answers itself → their streams.
    direct: Mutex<HashMap<ProgressToken, mpsc::Sender<ProgressNotificationParam>>>,
}

impl Client {
    /// The client behind `peer`, with the capabilities it declared.
    pub fn of(peer: &Peer<RoleServer>, stateless: bool) -> Self {
        let capabilities = peer
            .peer_info()
            .map(|info| info.capabilities.clone())
            .unwrap_or_default();
        Self {
            peer: peer.clone(),
            elicitation: !stateless && capabilities.elicitation.is_some(),
            sampling: !stateless && capabilities.sampling.is_some(),
            level: Mutex::new(None),
            subscribed: Mutex::default(),
            asked: Default::default(),
            direct: Mutex::default(),
        }
    }

    /// Progress with the client's `token` goes to `stream` (a call the
    /// endpoint answers itself), until [`Client::stop_progress_to`].
    pub fn progress_to(
        &self,
        token: ProgressToken,
        stream: mpsc::Sender<ProgressNotificationParam>,
    ) {
        self.direct
            .lock()
            .expect("direct progress lock")
            .insert(token, stream);
    }

    pub fn stop_progress_to(&self, token: &ProgressToken) {
        self.direct
            .lock()
            .expect("direct progress lock")
            .remove(token);
    }

    /// The client's progress on a question a server asked it goes back to
    /// that server, with its own token; other progress is dropped.
    pub async fn progress_back(&self, mut progress: ProgressNotificationParam) {
        let back = self
            .asked
            .lock()
            .expect("asked lock")
            .get(&progress.progress_token)
            .cloned();
        let Some((server, token)) = back else {
            tracing::debug!("progress of no question asked of the client");
            return;
        };
        relayed("progress");
        progress.progress_token = token;
        if let Err(error) = server.notify_progress(progress).await {
            tracing::debug!(%error, "progress not relayed back");
        }
    }

    pub fn set_level(&self, level: LoggingLevel) {
        *self.level.lock().expect("level lock") = Some(level);
    }

    pub fn subscribe(&self, uri: &str) {
        self.subscribed
            .lock()
            .expect("subscriptions lock")
            .insert(uri.to_owned());
    }

    pub fn unsubscribe(&self, uri: &str) {
        self.subscribed
            .lock()
            .expect("subscriptions lock")
            .remove(uri);
    }

    /// Sends `request` on the stream of `origin` when there is one; the
    /// client's progress on it goes back to `asker` meanwhile.
    fn ask(
        &self,
        origin: Option<RequestId>,
        asker: Asker,
        mut request: ServerRequest,
    ) -> BoxFuture<'static, Result<ClientResult, ErrorData>> {
        if let Some(origin) = origin {
            let extensions = match &mut request {
                ServerRequest::ElicitRequest(r) => Some(&mut r.extensions),
                ServerRequest::CreateMessageRequest(r) => Some(&mut r.extensions),
                _ => None,
            };
            if let Some(extensions) = extensions {
                extensions.insert(OriginatingRequestId(origin));
            }
        }
        let peer = self.peer.clone();
        let asked = self.asked.clone();
        Box::pin(async move {
            let failed = |error: ServiceError| match error {
                ServiceError::McpError(error) => error,
                error => {
                    ErrorData::internal_error(format!("the client did not answer: {error}"), None)
                }
            };
            let handle = peer
                .send_request_with_option(request, PeerRequestOptions::no_options())
                .await
                .map_err(failed)?;
            let token = handle.progress_token.clone();
            if let (Some(server), Some(upstream)) = (asker.peer, asker.progress_token) {
                asked
                    .lock()
                    .expect("asked lock")
                    .insert(token.clone(), (server, upstream));
            }
            let answer = handle.await_response().await;
            // Each message the client posts is handled on its own, so its
            // progress sent just before its answer can be handled just
            // after it: the token outlives the answer a little.
            tokio::spawn(async move {
                tokio::time::sleep(PROGRESS_AFTER_ANSWER).await;
                asked.lock().expect("asked lock").remove(&token);
            });
            answer.map_err(failed)
        })
    }
}

impl Downstream for Client {
    fn progress(&self, progress: ProgressNotificationParam) -> BoxFuture<'static, ()> {
        relayed("progress");
        let stream = self
            .direct
            .lock()
            .expect("direct progress lock")
            .get(&progress.progress_token)
            .cloned();
        if let Some(stream) = stream {
            // A closed stream (its client went away) drops the step.
            return Box::pin(async move {
                let _ = stream.send(progress).await;
            });
        }
        let peer = self.peer.clone();
        Box::pin(async move {
            if let Err(error) = peer.notify_progress(progress).await {
                tracing::debug!(%error, "progress not relayed");
            }
        })
    }

    fn can_elicit(&self) -> bool {
        self.elicitation
    }

    fn can_sample(&self) -> bool {
        self.sampling
    }

    fn elicit(
        &self,
        origin: Option<RequestId>,
        asker: Asker,
        request: ElicitRequestParams,
    ) -> BoxFuture<'static, Result<ElicitResult, ErrorData>> {
        relayed("elicitation");
        let asked = self.ask(
            origin,
            asker,
            ServerRequest::ElicitRequest(ElicitRequest::new(request)),
        );
        Box::pin(async move {
            match asked.await? {
                ClientResult::ElicitResult(result) => Ok(result),
                _ => Err(ErrorData::internal_error(
                    "the client's answer to elicitation/create is not an elicitation result",
                    None,
                )),
            }
        })
    }

    fn sample(
        &self,
        origin: Option<RequestId>,
        asker: Asker,
        request: CreateMessageRequestParams,
    ) -> BoxFuture<'static, Result<CreateMessageResult, ErrorData>> {
        relayed("sampling");
        let asked = self.ask(
            origin,
            asker,
            ServerRequest::CreateMessageRequest(CreateMessageRequest::new(request)),
        );
        Box::pin(async move {
            match asked.await? {
                ClientResult::CreateMessageResult(result) => Ok(*result),
                _ => Err(ErrorData::internal_error(
                    "the client's answer to sampling/createMessage is not a message",
                    None,
                )),
            }
        })
    }

    fn log(&self, server: &str, mut message: LoggingMessageNotificationParam) {
        relayed("logging");
        message.logger = Some(match message.logger.take() {
            Some(logger) => format!("{server}/{logger}"),
            None => server.to_owned(),
        });
        let peer = self.peer.clone();
        tokio::spawn(async move {
            if let Err(error) = peer.notify_logging_message(message).await {
                tracing::debug!(%error, "log message not relayed");
            }
        });
    }

    fn resource_updated(&self, _server: &str, uri: &str) {
        if !self
            .subscribed
            .lock()
            .expect("subscriptions lock")
            .contains(uri)
        {
            return;
        }
        relayed("resource_updated");
        let peer = self.peer.clone();
        let updated = ResourceUpdatedNotificationParam::new(uri);
        tokio::spawn(async move {
            if let Err(error) = peer.notify_resource_updated(updated).await {
                tracing::debug!(%error, "resource update not relayed");
            }
        });
    }

    fn log_level(&self) -> Option<LoggingLevel> {
        *self.level.lock().expect("level lock")
    }
}

/// A stateless (2026-07-28) client's calls waiting on its input: that
/// revision has no server-to-client requests, so an upstream's question
/// during a call is answered to the client as an `input_required` result
/// whose `requestState` names the call, which stays open on this replica
/// until the client retries with its `inputResponses` (or the round
/// expires: the upstream is then told the client did not answer).
///
/// Bounded: at most [`MAX_ROUNDS`] calls wait at once per replica, each at
/// most [`ROUND_TTL`]; a retry of another tenant's round is unknown to it.
#[derive(Default)]
pub(crate) struct InputRounds {
    waiting: Mutex<HashMap<String, Waiting>>,
}

/// Calls waiting on their client, per replica.
pub(crate) const MAX_ROUNDS: usize = 1024;
/// How long a call waits for its client's retry.
pub(crate) const ROUND_TTL: Duration = Duration::from_secs(300);

struct Waiting {
    tenant: String,
    since: Instant,
    answer: oneshot::Sender<InputResponses>,
    steps: mpsc::Receiver<Step>,
    /// Cancels the call (a retry's request cancelled).
    cancel: CancellationToken,
    client: std::sync::Arc<RoundClient>,
}

/// What a relayed stateless call does next.
pub(crate) enum Step {
    /// The upstream asks; the call waits for `answer`.
    Ask {
        requests: InputRequests,
        answer: oneshot::Sender<InputResponses>,
    },
    /// The call is over.
    Done(CatalogCallReply),
}

/// Where a stateless call stands for its client.
pub(crate) enum Round {
    Done(CatalogCallReply),
    /// Answer the client `input_required` with these and `request_state`.
    Ask {
        requests: InputRequests,
        request_state: String,
    },
}

impl InputRounds {
    /// The call's next step for its client; a question parks the call
    /// under a fresh request state.
    /// `asking` is the client's request now: its cancellation cancels the call.
    pub async fn next(
        &self,
        tenant: &str,
        mut steps: mpsc::Receiver<Step>,
        cancel: CancellationToken,
        asking: &CancellationToken,
        client: std::sync::Arc<RoundClient>,
    ) -> Result<Round, ErrorData> {
        let step = tokio::select! {
            step = steps.recv() => step,
            () = asking.cancelled() => {
                cancel.cancel();
                return Err(ErrorData::internal_error("the client cancelled the call", None));
            }
        };
        match step {
            None => Err(ErrorData::internal_error(
                "the relayed call ended without an answer",
                None,
            )),
            Some(Step::Done(reply)) => Ok(Round::Done(reply)),
            Some(Step::Ask { requests, answer }) => {
                client.asked_by(None);
                let request_state = format!("round-{}", uuid::Uuid::new_v4());
                let mut waiting = self.waiting.lock().expect("rounds lock");
                waiting.retain(|_, w| w.since.elapsed() < ROUND_TTL);
                if waiting.len() >= MAX_ROUNDS {
                    return Err(ErrorData::internal_error(
                        format!(
                            "{MAX_ROUNDS} calls already wait for their clients' input on this replica; retry later"
                        ),
                        None,
                    ));
                }
                waiting.insert(
                    request_state.clone(),
                    Waiting {
                        tenant: tenant.to_owned(),
                        since: Instant::now(),
                        answer,
                        steps,
                        cancel,
                        client,
                    },
                );
                relayed("input_round");
                Ok(Round::Ask {
                    requests,
                    request_state,
                })
            }
        }
    }

    /// A client's retry: its answers go to the waiting call, whose next
    /// step follows.
    pub async fn resume(
        &self,
        tenant: &str,
        request_state: &str,
        responses: InputResponses,
        asking: &CancellationToken,
        request: Option<(Peer<RoleServer>, ProgressToken)>,
    ) -> Result<Round, ErrorData> {
        let waiting = {
            let mut waiting = self.waiting.lock().expect("rounds lock");
            match waiting.get(request_state) {
                Some(w) if w.tenant == tenant && w.since.elapsed() < ROUND_TTL => {
                    waiting.remove(request_state)
                }
                _ => None,
            }
        };
        let Some(waiting) = waiting else {
            return Err(ErrorData::invalid_params(
                "requestState names no call waiting for input on this replica (expired, answered, or never asked): call again",
                None,
            ));
        };
        waiting.client.asked_by(request);
        if waiting.answer.send(responses).is_err() {
            return Err(ErrorData::internal_error("the waiting call ended", None));
        }
        self.next(
            tenant,
            waiting.steps,
            waiting.cancel,
            asking,
            waiting.client,
        )
        .await
    }
}

/// A stateless client as upstreams reach it during one call: a question
/// becomes an input round.
pub(crate) struct RoundClient {
    elicitation: bool,
    sampling: bool,
    steps: mpsc::Sender<Step>,
    next_key: std::sync::atomic::AtomicU64,
    /// The request of the client's that is open now (the call, or its
    /// latest retry) and its progress token: progress goes on its stream.
    asking: Mutex<Option<(Peer<RoleServer>, ProgressToken)>>,
}

impl RoundClient {
    pub fn new(capabilities: &ClientCapabilities, steps: mpsc::Sender<Step>) -> Self {
        Self {
            elicitation: capabilities.elicitation.is_some(),
            sampling: capabilities.sampling.is_some(),
            steps,
            next_key: std::sync::atomic::AtomicU64::new(1),
            asking: Mutex::new(None),
        }
    }

    /// The client's request open now, if it asked for progress; `None`
    /// once it was answered.
    pub fn asked_by(&self, request: Option<(Peer<RoleServer>, ProgressToken)>) {
        *self.asking.lock().expect("asking lock") = request;
    }

    /// Asks the client `request` in a round and waits for its answer.
    fn ask(
        &self,
        request: InputRequest,
    ) -> BoxFuture<'static, Result<serde_json::Value, ErrorData>> {
        let n = self
            .next_key
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = format!("input-{n}");
        let steps = self.steps.clone();
        Box::pin(async move {
            let (answer, answered) = oneshot::channel();
            let requests = InputRequests::from([(key.clone(), request)]);
            steps
                .send(Step::Ask { requests, answer })
                .await
                .map_err(|_| ErrorData::internal_error("the client's call is gone", None))?;
            let mut responses = answered.await.map_err(|_| {
                ErrorData::internal_error("the client did not answer within its round", None)
            })?;
            responses.remove(&key).ok_or_else(|| {
                ErrorData::invalid_params(
                    format!("the client's inputResponses hold no {key:?}"),
                    None,
                )
            })
        })
    }
}

impl Downstream for RoundClient {
    // Each round is a request of its own: progress goes on the one open
    // now, and between rounds there is none to go on.
    fn progress(&self, mut progress: ProgressNotificationParam) -> BoxFuture<'static, ()> {
        let Some((peer, token)) = self.asking.lock().expect("asking lock").clone() else {
            return Box::pin(async {});
        };
        relayed("progress");
        progress.progress_token = token;
        Box::pin(async move {
            if let Err(error) = peer.notify_progress(progress).await {
                tracing::debug!(%error, "progress not relayed");
            }
        })
    }

    fn can_elicit(&self) -> bool {
        self.elicitation
    }

    fn can_sample(&self) -> bool {
        self.sampling
    }

    fn elicit(
        &self,
        _origin: Option<RequestId>,
        _asker: Asker,
        request: ElicitRequestParams,
    ) -> BoxFuture<'static, Result<ElicitResult, ErrorData>> {
        relayed("elicitation");
        let asked = self.ask(InputRequest::Elicitation(ElicitRequest::new(request)));
        Box::pin(async move {
            serde_json::from_value(asked.await?).map_err(|e| {
                ErrorData::invalid_params(
                    format!("the client's elicitation answer does not parse: {e}"),
                    None,
                )
            })
        })
    }

    fn sample(
        &self,
        _origin: Option<RequestId>,
        _asker: Asker,
        request: CreateMessageRequestParams,
    ) -> BoxFuture<'static, Result<CreateMessageResult, ErrorData>> {
        relayed("sampling");
        let asked = self.ask(InputRequest::CreateMessage(CreateMessageRequest::new(
            request,
        )));
        Box::pin(async move {
            serde_json::from_value(asked.await?).map_err(|e| {
                ErrorData::invalid_params(
                    format!("the client's sampling answer does not parse: {e}"),
                    None,
                )
            })
        })
    }

    // Logs and resource updates reach a stateless client on its own
    // requests' streams only; between rounds there is none.
    fn log(&self, _server: &str, _message: LoggingMessageNotificationParam) {}

    fn resource_updated(&self, _server: &str, _uri: &str) {}

    fn log_level(&self) -> Option<LoggingLevel> {
        None
    }
}
