//! `tools/call` of a 2025 session answered by the endpoint itself, in the
//! HTTP request's own task (design note: the catalog as an MCP server).
//!
//! rmcp's session worker hands a request through its own tasks (the
//! worker, the service loop, a handler, back again, then an SSE stream);
//! every hop is a wake-up, and on a replica's two cores those cost more
//! than the catalog's own work per call. A call the endpoint can answer
//! exactly as the worker would is answered here instead:
//!
//! * the session is live on this replica and initialized, and its client
//!   declared neither elicitation nor sampling (a question to the client
//!   needs the worker's routing of requests and their answers);
//! * the request is one JSON-RPC `tools/call` of a revision with sessions:
//!   no per-request protocol version, no input round, `Accept` of JSON and
//!   SSE, a JSON body. Anything else goes to rmcp untouched, which answers
//!   or refuses it as it always did (the body, once read here, is handed
//!   on whole).
//!
//! The answer is `application/json`, or an SSE stream when the call's
//! progress comes before its result (the progress in order, then the
//! result). Like the worker, a client that disconnects does not cancel the
//! call; a `notifications/cancelled` naming it does (the upstream is told),
//! and so does the session's end. Logs and list changes reach the session's
//! own stream, as for any call.

use std::collections::HashMap;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use ctxsync_mcp::relay::Relay;
use futures::{FutureExt as _, StreamExt as _};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientJsonRpcMessage, ClientNotification,
    ClientRequest, ErrorData, GetMeta, ProgressNotificationParam, ProgressToken, ProtocolVersion,
    RequestId, ServerJsonRpcMessage, ServerNotification, ServerResult,
};
use rmcp::{Peer, RoleServer};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{Endpoint, SessionState, counted};
use crate::mcp_sessions::Owner;

/// The most a request body may hold (rmcp's own bound, and its answer past it).
const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Progress steps of one call queued for its stream at most; the upstream
/// waits (its transport is read no further) while the client lags.
const PROGRESS_QUEUED: usize = 64;

/// The sessions whose calls the endpoint answers, and those calls in flight.
#[derive(Default)]
pub(super) struct Direct {
    sessions: Mutex<HashMap<String, Registered>>,
    /// By MCP session and request id (as JSON text): what cancels the call.
    calls: Mutex<HashMap<(String, String), CancellationToken>>,
}

#[derive(Clone)]
struct Registered {
    state: Weak<SessionState>,
    peer: Peer<RoleServer>,
}

impl Direct {
    /// Answers the calls of MCP session `id` here from now on, unless its
    /// client may be asked questions; returns whether it will.
    pub fn register(&self, id: &str, state: &Arc<SessionState>, peer: &Peer<RoleServer>) -> bool {
        let capabilities = peer
            .peer_info()
            .map(|info| info.capabilities.clone())
            .unwrap_or_default();
        if capabilities.elicitation.is_some() || capabilities.sampling.is_some() {
            return false;
        }
        if state.bound.get().is_none_or(|bound| bound.stateless) {
            return false;
        }
        self.sessions.lock().expect("direct sessions lock").insert(
            id.to_owned(),
            Registered {
                state: Arc::downgrade(state),
                peer: peer.clone(),
            },
        );
        true
    }

    /// The session ended (its state went).
    pub fn forget(&self, id: &str) {
        self.sessions
            .lock()
            .expect("direct sessions lock")
            .remove(id);
    }

    fn session(&self, id: &str) -> Option<(Arc<SessionState>, Peer<RoleServer>)> {
        let registered = self
            .sessions
            .lock()
            .expect("direct sessions lock")
            .get(id)
            .cloned()?;
        Some((registered.state.upgrade()?, registered.peer))
    }

    fn call_started(&self, key: (String, String), cancel: CancellationToken) {
        self.calls
            .lock()
            .expect("direct calls lock")
            .insert(key, cancel);
    }

    fn call_ended(&self, key: &(String, String)) {
        self.calls.lock().expect("direct calls lock").remove(key);
    }

    /// Cancels the session's call `request_id`, if it is one of these.
    fn cancel(&self, session: &str, request_id: &RequestId) -> bool {
        let key = (session.to_owned(), id_key(request_id));
        let cancel = self
            .calls
            .lock()
            .expect("direct calls lock")
            .get(&key)
            .cloned();
        cancel.inspect(CancellationToken::cancel).is_some()
    }
}

/// A request id as a map key: its JSON (`1` and `"1"` stay apart).
fn id_key(id: &RequestId) -> String {
    serde_json::to_string(id).unwrap_or_default()
}

/// What became of a request of session `session` (owned by the caller).
pub(super) enum Taken {
    /// Answered here.
    Answered(Response),
    /// For rmcp, as it came (its body read, and put back).
    Passed(Request),
}

/// Answers `request` if it is a call (or a cancellation of one) this
/// endpoint answers itself; otherwise hands it back.
/// `arrived` is when the request reached the endpoint: what a call spends
/// here, less its upstream's time, is the catalog's own work
/// (`ctxsync_catalog_mcp_call_work_seconds`).
pub(super) async fn take(
    endpoint: &Arc<Endpoint>,
    session: &str,
    owner: &Owner,
    request: Request,
    arrived: Instant,
) -> Taken {
    if request.method() != Method::POST || !plain_headers(request.headers()) {
        return Taken::Passed(request);
    }
    let Some((state, peer)) = endpoint.direct.session(session) else {
        return Taken::Passed(request);
    };
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(bytes) => bytes,
        Err(error) => return Taken::Answered(unreadable(&error)),
    };
    match serde_json::from_slice::<ClientJsonRpcMessage>(&bytes) {
        Ok(ClientJsonRpcMessage::Request(request))
            if request.request.get_meta().protocol_version().is_none() =>
        {
            let id = request.id;
            match request.request {
                ClientRequest::CallToolRequest(call)
                    if call.params.input_responses.is_none()
                        && call.params.request_state.is_none() =>
                {
                    let progress_token = call
                        .extensions
                        .get::<rmcp::model::RequestMetaObject>()
                        .and_then(|meta| meta.get_progress_token());
                    let answer = answer(
                        endpoint.clone(),
                        Call {
                            session: session.to_owned(),
                            owner: owner.clone(),
                            state,
                            peer,
                            id,
                            params: call.params,
                            progress_token,
                            arrived,
                        },
                    );
                    return Taken::Answered(answer.await);
                }
                _ => {}
            }
        }
        Ok(ClientJsonRpcMessage::Notification(notification)) => {
            if let ClientNotification::CancelledNotification(cancelled) = &notification.notification
                && let Some(request_id) = &cancelled.params.request_id
                && endpoint.direct.cancel(session, request_id)
            {
                return Taken::Answered(status(StatusCode::ACCEPTED, Bytes::new()));
            }
        }
        _ => {}
    }
    Taken::Passed(Request::from_parts(parts, Body::from(bytes)))
}

/// The headers rmcp takes a session's POST with: a JSON body, `Accept` of
/// both answers, and a revision with sessions if it names one.
fn plain_headers(headers: &HeaderMap) -> bool {
    let accepts = |wanted: &str| {
        headers.get_all(header::ACCEPT).iter().any(|value| {
            value.to_str().is_ok_and(|value| {
                value.split(',').any(|media| {
                    let essence = media.split(';').next().unwrap_or_default().trim();
                    essence.eq_ignore_ascii_case(wanted)
                })
            })
        })
    };
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            let essence = value.split(';').next().unwrap_or_default().trim();
            essence.eq_ignore_ascii_case("application/json")
        });
    let with_sessions = match headers.get(super::PROTOCOL_HEADER) {
        None => true,
        Some(value) => value.to_str().is_ok_and(|version| {
            ProtocolVersion::KNOWN_VERSIONS
                .iter()
                .any(|known| known.as_str() == version && known.has_initialize())
        }),
    };
    accepts("application/json") && accepts("text/event-stream") && json_body && with_sessions
}

/// A body that could not be read: rmcp's answers (413 past its bound).
fn unreadable(error: &axum::Error) -> Response {
    let too_large = std::error::Error::source(error)
        .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
    if too_large {
        return status(
            StatusCode::PAYLOAD_TOO_LARGE,
            Bytes::from(format!(
                "Payload Too Large: request body exceeds {MAX_BODY_BYTES} bytes"
            )),
        );
    }
    status(
        StatusCode::INTERNAL_SERVER_ERROR,
        Bytes::from(format!("Failed to read request body: {error}")),
    )
}

/// An answer whose body is all there (not a stream).
pub(super) fn is_whole(response: &Response) -> bool {
    axum::body::HttpBody::size_hint(response.body())
        .exact()
        .is_some()
}

fn status(code: StatusCode, body: Bytes) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = code;
    response
}

/// One call taken here.
struct Call {
    session: String,
    owner: Owner,
    state: Arc<SessionState>,
    peer: Peer<RoleServer>,
    id: RequestId,
    params: CallToolRequestParams,
    progress_token: Option<ProgressToken>,
    arrived: Instant,
}

/// A call's result as its task hands it over, with its upstream's time.
type Done = (Result<CallToolResponse, ErrorData>, Option<Duration>);
type Outcome = Result<Done, oneshot::error::RecvError>;

/// Runs the call in the request's own task (no hand-over to another task
/// and back on the way to the answer), and answers with its result, or a
/// stream once progress comes first; the call goes on in a task of its own
/// if the request's task lets go first (a disconnected client does not end
/// it, nor does a stream's answer).
async fn answer(endpoint: Arc<Endpoint>, call: Call) -> Response {
    counted("tools/call");
    let Call {
        session,
        owner,
        state,
        peer,
        id,
        params,
        progress_token,
        arrived,
    } = call;
    let busy = owner.activity.begin();
    let key = (session, id_key(&id));
    let cancel = owner.ended.child_token();
    endpoint.direct.call_started(key.clone(), cancel.clone());
    let client = state.session_client(&peer);
    let (progress, mut progressed) = mpsc::channel(PROGRESS_QUEUED);
    if let Some(token) = &progress_token {
        client.progress_to(token.clone(), progress);
    }
    let (done, mut result) = oneshot::channel();
    let relay = Relay {
        downstream: client.clone(),
        origin: Some(id.clone()),
        progress_token: progress_token.clone(),
        cancelled: cancel,
    };
    let called = endpoint.clone();
    let mut call = Detachable::new(async move {
        let _busy = busy;
        let result = match state.bound.get() {
            Some(bound) => {
                let (response, upstream) =
                    super::session_tool_call(&called, &state, &peer, bound, params, relay).await;
                (Ok(response), upstream)
            }
            None => (
                Err(ErrorData::invalid_request(
                    "the session is not initialized",
                    None,
                )),
                None,
            ),
        };
        if let Some(token) = &progress_token {
            client.stop_progress_to(token);
        }
        called.direct.call_ended(&key);
        let _ = done.send(result);
    });
    let next = loop {
        tokio::select! {
            biased;
            outcome = &mut result => break match progressed.try_recv() {
                // Progress sent before the result is queued by now.
                Ok(step) => Next::Step(step, Pending::Now(outcome)),
                Err(_) => Next::Done(outcome),
            },
            Some(step) = progressed.recv() => break Next::Step(step, Pending::Waiting(result)),
            // Its end sends the result, taken on the next turn.
            () = &mut call, if !call.is_over() => {}
        }
    };
    // A streamed answer outlives this task's part: the call goes on alone.
    drop(call);
    match next {
        Next::Done(outcome) => {
            metrics::counter!("ctxsync_catalog_mcp_direct_total", "answer" => "json").increment(1);
            let upstream = outcome.as_ref().ok().and_then(|(_, upstream)| *upstream);
            let mut response = status(StatusCode::OK, Bytes::from(reply(&id, outcome)));
            if let Some(upstream) = upstream {
                let work = arrived.elapsed().saturating_sub(upstream);
                metrics::histogram!("ctxsync_catalog_mcp_call_work_seconds")
                    .record(work.as_secs_f64());
            }
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Next::Step(step, pending) => {
            metrics::counter!("ctxsync_catalog_mcp_direct_total", "answer" => "stream")
                .increment(1);
            stream(id, step, progressed, pending)
        }
    }
}

/// A future polled in place by whoever holds it, until dropped: then the
/// rest of it runs in a task of its own.
struct Detachable(Option<Pin<Box<dyn Future<Output = ()> + Send>>>);

impl Detachable {
    /// A panic ends the future alone, as it would end a task of its own:
    /// the request's task lives on to answer that the call had no result.
    fn new(future: impl Future<Output = ()> + Send + 'static) -> Self {
        let contained = AssertUnwindSafe(future).catch_unwind().map(|_| ());
        Self(Some(Box::pin(contained)))
    }

    fn is_over(&self) -> bool {
        self.0.is_none()
    }
}

impl Future for Detachable {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(future) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        let polled = future.as_mut().poll(cx);
        if polled.is_ready() {
            self.0 = None;
        }
        polled
    }
}

impl Drop for Detachable {
    fn drop(&mut self) {
        // Outside a runtime (its shutdown) nothing runs on anyway.
        if let (Some(rest), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(rest);
        }
    }
}

/// What a call's answer goes on with.
enum Next {
    Done(Outcome),
    Step(ProgressNotificationParam, Pending),
}

/// The result of a streamed call: here, or still to come.
enum Pending {
    Now(Outcome),
    Waiting(oneshot::Receiver<Done>),
}

/// The JSON-RPC answer to `id`, as rmcp writes it for a 2025 session.
fn reply(id: &RequestId, outcome: Outcome) -> String {
    let message = match outcome.map(|(result, _)| result) {
        Ok(Ok(response)) => {
            let mut result = ServerResult::from(response);
            result.strip_result_type_for_legacy_peer();
            result.strip_non_object_output_for_legacy_peer();
            ServerJsonRpcMessage::response(result, id.clone())
        }
        Ok(Err(error)) => ServerJsonRpcMessage::error(error, Some(id.clone())),
        Err(_) => ServerJsonRpcMessage::error(
            ErrorData::internal_error("the call ended without a result", None),
            Some(id.clone()),
        ),
    };
    serde_json::to_string(&message).expect("a JSON-RPC message serializes")
}

/// One SSE event carrying `data`.
fn event(data: &str) -> Result<Bytes, Infallible> {
    Ok(Bytes::from(format!("data: {data}\n\n")))
}

fn progress_event(step: ProgressNotificationParam) -> Result<Bytes, Infallible> {
    let message = ServerJsonRpcMessage::notification(ServerNotification::ProgressNotification(
        rmcp::model::Notification::new(step),
    ));
    event(&serde_json::to_string(&message).expect("a JSON-RPC message serializes"))
}

/// The call's stream: `first`, the progress after it, then the result, as
/// rmcp streams a request's messages (`data:` events, `text/event-stream`).
fn stream(
    id: RequestId,
    first: ProgressNotificationParam,
    progressed: mpsc::Receiver<ProgressNotificationParam>,
    pending: Pending,
) -> Response {
    let rest = futures::stream::unfold(Some((progressed, pending)), move |state| {
        let id = id.clone();
        async move {
            let (mut progressed, pending) = state?;
            match pending {
                Pending::Now(outcome) => Some(match progressed.try_recv() {
                    Ok(step) => (
                        progress_event(step),
                        Some((progressed, Pending::Now(outcome))),
                    ),
                    Err(_) => (event(&reply(&id, outcome)), None),
                }),
                Pending::Waiting(mut result) => tokio::select! {
                    biased;
                    outcome = &mut result => Some(match progressed.try_recv() {
                        Ok(step) => (progress_event(step), Some((progressed, Pending::Now(outcome)))),
                        Err(_) => (event(&reply(&id, outcome)), None),
                    }),
                    Some(step) = progressed.recv() => {
                        Some((progress_event(step), Some((progressed, Pending::Waiting(result)))))
                    }
                },
            }
        }
    });
    let body = futures::stream::once(async move { progress_event(first) }).chain(rest);
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a request's task lets go of mid-way runs on to its end.
    #[tokio::test]
    async fn a_dropped_detachable_runs_on_in_a_task_of_its_own() {
        let (go_on, wait) = oneshot::channel::<()>();
        let (finished, ended) = oneshot::channel();
        let mut call = Detachable::new(async move {
            let _ = wait.await;
            let _ = finished.send("ended");
        });
        let polled = futures::poll!(&mut call);
        assert!(
            polled.is_pending() && !call.is_over(),
            "it waits on its upstream"
        );
        drop(call);
        go_on.send(()).expect("the rest of it still waits");
        let ended = tokio::time::timeout(Duration::from_secs(5), ended).await;
        assert_eq!(ended.expect("it ends in time"), Ok("ended"));
    }

    #[tokio::test]
    async fn a_panic_ends_the_detachable_alone() {
        let (done, result) = oneshot::channel::<()>();
        let mut call = Detachable::new(async move {
            let _done = done;
            panic!("a bug in the call");
        });
        (&mut call).await;
        assert!(call.is_over());
        assert!(result.await.is_err(), "the call ended without a result");
    }

    #[tokio::test]
    async fn a_detachable_polled_to_its_end_is_over() {
        let (finished, ended) = oneshot::channel();
        let mut call = Detachable::new(async move {
            let _ = finished.send(());
        });
        (&mut call).await;
        assert!(call.is_over());
        assert_eq!(ended.await, Ok(()));
    }
}
