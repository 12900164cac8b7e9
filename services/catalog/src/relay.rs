//! The downstream side of relays: the MCP client of a session of `/mcp`
//! (or of one stateless request) as what upstream servers send reaches it.
//!
//! * Progress goes out with the client's own token, so rmcp's transport
//!   puts it on the stream of the client's request.
//! * An upstream's elicitation or sampling request is asked of the client
//!   on the stream of the call it came during (rmcp's originating-request
//!   marker), and only when the client declared the capability; otherwise
//!   the upstream is answered `-32601`. A stateless (2026-07-28) client
//!   cannot be asked: that revision has no server-to-client requests.
//! * Log messages are forwarded with the server named in `logger`
//!   (`server` or `server/logger`); resource updates only for URIs the
//!   client subscribed to.
//!
//! Each relayed kind is counted in `ctxsync_catalog_mcp_relayed_total`.

// Logging and sampling are deprecated for 2026-07-28 (SEP-2577); the 2025
// clients and servers relayed between still speak them.
#![allow(deprecated)]

use std::collections::HashSet;
use std::sync::Mutex;

use ctxsync_mcp::relay::Downstream;
use futures::future::BoxFuture;
use rmcp::model::{
    ClientResult, CreateMessageRequest, CreateMessageRequestParams, CreateMessageResult,
    ElicitRequest, ElicitRequestParams, ElicitResult, ErrorData, LoggingLevel,
    LoggingMessageNotificationParam, ProgressNotificationParam, RequestId,
    ResourceUpdatedNotificationParam, ServerRequest,
};
use rmcp::service::{OriginatingRequestId, ServiceError};
use rmcp::{Peer, RoleServer};

/// Counts one relayed message of `kind`.
pub(crate) fn relayed(kind: &'static str) {
    metrics::counter!("ctxsync_catalog_mcp_relayed_total", "kind" => kind).increment(1);
}

/// A client of `/mcp`, as upstream servers reach it.
pub(crate) struct Client {
    peer: Peer<RoleServer>,
    elicitation: bool,
    sampling: bool,
    /// What `logging/setLevel` asked, applied to each upstream it uses.
    level: Mutex<Option<LoggingLevel>>,
    /// The resource URIs it subscribed to.
    subscribed: Mutex<HashSet<String>>,
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

    /// Sends `request` on the stream of `origin` when there is one.
    fn ask(
        &self,
        origin: Option<RequestId>,
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
        Box::pin(async move {
            match peer.send_request(request).await {
                Ok(answer) => Ok(answer),
                Err(ServiceError::McpError(error)) => Err(error),
                Err(error) => Err(ErrorData::internal_error(
                    format!("the client did not answer: {error}"),
                    None,
                )),
            }
        })
    }
}

impl Downstream for Client {
    fn progress(&self, progress: ProgressNotificationParam) -> BoxFuture<'static, ()> {
        relayed("progress");
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
        request: ElicitRequestParams,
    ) -> BoxFuture<'static, Result<ElicitResult, ErrorData>> {
        relayed("elicitation");
        let asked = self.ask(
            origin,
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
        request: CreateMessageRequestParams,
    ) -> BoxFuture<'static, Result<CreateMessageResult, ErrorData>> {
        relayed("sampling");
        let asked = self.ask(
            origin,
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
