//! What a connection relays between a server (upstream) and the clients
//! whose calls it carries (downstream): a call's progress and cancellation,
//! the server's elicitation and sampling requests, its log messages and
//! resource updates.
//!
//! Routing: progress by the token the call was sent with; a request the
//! server makes (which names no call on stdio) to the oldest call in
//! flight whose client can answer it, else `-32601`; log messages and
//! resource updates to every client that used the connection and is still
//! there (held weakly: a client that went away is dropped, not kept alive).
//! One connection serves one tenant, so no route crosses tenants.
// Logging and sampling are deprecated for 2026-07-28 (SEP-2577); the 2025
// clients and servers we relay between still speak them.
#![allow(deprecated)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use futures::future::BoxFuture;
use rmcp::RoleClient;
use rmcp::model::{
    CreateMessageRequestParams, CreateMessageResult, ElicitRequestParams, ElicitResult, ErrorData,
    LoggingLevel, LoggingMessageNotificationParam, ProgressNotificationParam, ProgressToken,
    RequestId,
};
use rmcp::model::{JsonRpcMessage, ServerNotification};
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use tokio_util::sync::CancellationToken;

/// The client side of calls and subscriptions, as the server's messages
/// reach it. Implemented by the catalog's MCP endpoint for each session.
pub trait Downstream: Send + Sync {
    /// A progress step of a call, already carrying the client's own token;
    /// done once it is queued to the client (ahead of anything sent after).
    fn progress(&self, progress: ProgressNotificationParam) -> BoxFuture<'static, ()>;
    /// Whether the client declared elicitation (form).
    fn can_elicit(&self) -> bool;
    /// Whether the client declared sampling.
    fn can_sample(&self) -> bool;
    /// Asks the client, on the stream of its request `origin` (the call
    /// the server asks during) when known; the client's progress on it
    /// goes back to `asker`.
    fn elicit(
        &self,
        origin: Option<RequestId>,
        asker: Asker,
        request: ElicitRequestParams,
    ) -> BoxFuture<'static, Result<ElicitResult, ErrorData>>;
    fn sample(
        &self,
        origin: Option<RequestId>,
        asker: Asker,
        request: CreateMessageRequestParams,
    ) -> BoxFuture<'static, Result<CreateMessageResult, ErrorData>>;
    /// A log message of `server` (its logger names the server).
    fn log(&self, server: &str, message: LoggingMessageNotificationParam);
    /// `notifications/resources/updated` of `server` for `uri`.
    fn resource_updated(&self, server: &str, uri: &str);
    /// The level the client asked with `logging/setLevel`, if it did.
    fn log_level(&self) -> Option<LoggingLevel>;
}

/// The server that asks a client something, and the progress token its
/// request carries: the client's progress on the question goes back there.
#[derive(Clone)]
pub struct Asker {
    pub peer: Option<rmcp::Peer<RoleClient>>,
    pub progress_token: Option<ProgressToken>,
}

impl Asker {
    /// A question whose progress has nowhere to go (an input round's).
    pub fn none() -> Self {
        Self {
            peer: None,
            progress_token: None,
        }
    }
}

/// One call's relay: who asked, with which progress token, and when they
/// gave up.
#[derive(Clone)]
pub struct Relay {
    pub downstream: Arc<dyn Downstream>,
    /// The client's request this call answers (its stream carries what the
    /// server asks meanwhile).
    pub origin: Option<RequestId>,
    /// The client's `progressToken`, when it asked for progress.
    pub progress_token: Option<ProgressToken>,
    /// Cancelled when the client cancels the call or goes away.
    pub cancelled: CancellationToken,
}

/// A connection's routes.
#[derive(Default)]
pub(crate) struct Routes {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The upstream token a call was sent with → the call's relay.
    progress: HashMap<ProgressToken, Relay>,
    /// Calls in flight, oldest first.
    calls: Vec<(u64, Relay)>,
    next_call: u64,
    /// Clients that used the connection (by address, so each once).
    followers: Vec<(usize, Weak<dyn Downstream>)>,
    /// The level last sent with `logging/setLevel`.
    level: Option<LoggingLevel>,
}

/// A call's place in the routes, given back when the call ends (whatever
/// way it ends: drop).
pub struct InFlight {
    routes: Arc<Routes>,
    id: u64,
    token: Option<ProgressToken>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut inner = self.routes.inner.lock().expect("routes lock");
        inner.calls.retain(|(id, _)| *id != self.id);
        if let Some(token) = &self.token {
            inner.progress.remove(token);
        }
    }
}

impl Routes {
    /// Registers a call in flight, its client as a follower (its progress
    /// is routed once its token is known: [`Routes::route_progress`]).
    pub fn begin(self: &Arc<Self>, relay: &Relay) -> InFlight {
        let mut inner = self.inner.lock().expect("routes lock");
        let id = inner.next_call;
        inner.next_call += 1;
        inner.calls.push((id, relay.clone()));
        let key = Arc::as_ptr(&relay.downstream) as *const () as usize;
        inner.followers.retain(|(_, d)| d.strong_count() > 0);
        if !inner.followers.iter().any(|(k, _)| *k == key) {
            inner
                .followers
                .push((key, Arc::downgrade(&relay.downstream)));
        }
        InFlight {
            routes: self.clone(),
            id,
            token: None,
        }
    }

    /// Routes the progress of `upstream_token` to the call (when its client
    /// asked for progress).
    pub fn route_progress(&self, call: &mut InFlight, upstream_token: ProgressToken) {
        let mut inner = self.inner.lock().expect("routes lock");
        let relay = inner
            .calls
            .iter()
            .find(|(id, _)| *id == call.id)
            .map(|(_, relay)| relay.clone());
        if let Some(relay) = relay.filter(|r| r.progress_token.is_some()) {
            inner.progress.insert(upstream_token.clone(), relay);
            call.token = Some(upstream_token);
        }
    }

    /// Forwards a progress step to its call's client; `None` if no relayed
    /// call asked for it.
    pub fn progress(
        &self,
        mut progress: ProgressNotificationParam,
    ) -> Option<BoxFuture<'static, ()>> {
        let relay = {
            let inner = self.inner.lock().expect("routes lock");
            inner.progress.get(&progress.progress_token).cloned()
        }?;
        progress.progress_token = relay.progress_token?;
        Some(relay.downstream.progress(progress))
    }

    /// The oldest call in flight whose client can answer.
    pub fn asker(&self, can: impl Fn(&dyn Downstream) -> bool) -> Option<Relay> {
        let inner = self.inner.lock().expect("routes lock");
        inner
            .calls
            .iter()
            .map(|(_, relay)| relay)
            .find(|relay| can(relay.downstream.as_ref()))
            .cloned()
    }

    /// Every client still following the connection.
    pub fn followers(&self) -> Vec<Arc<dyn Downstream>> {
        let mut inner = self.inner.lock().expect("routes lock");
        inner.followers.retain(|(_, d)| d.strong_count() > 0);
        inner
            .followers
            .iter()
            .filter_map(|(_, d)| d.upgrade())
            .collect()
    }

    /// The level to send before a call, if it differs from the last sent.
    pub fn level_to_send(&self, wanted: Option<LoggingLevel>) -> Option<LoggingLevel> {
        let mut inner = self.inner.lock().expect("routes lock");
        match wanted {
            Some(level) if inner.level != Some(level) => {
                inner.level = Some(level);
                Some(level)
            }
            _ => None,
        }
    }
}

/// A transport that hands each progress notification to its call's client
/// as it is read, before the messages read after it: a call's last progress
/// reaches the client ahead of its result. (rmcp runs notification handlers
/// as tasks of their own, which the result can overtake.)
pub(crate) struct InOrder<T> {
    inner: T,
    routes: Arc<Routes>,
}

impl<T> InOrder<T> {
    pub fn new(inner: T, routes: Arc<Routes>) -> Self {
        Self { inner, routes }
    }
}

impl<T: Transport<RoleClient>> Transport<RoleClient> for InOrder<T> {
    type Error = T::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleClient>> {
        let message = self.inner.receive().await?;
        if let JsonRpcMessage::Notification(notification) = &message
            && let ServerNotification::ProgressNotification(progress) = &notification.notification
        {
            match self.routes.progress(progress.params.clone()) {
                Some(forwarded) => forwarded.await,
                None => tracing::debug!("progress of no relayed call"),
            }
        }
        Some(message)
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}
