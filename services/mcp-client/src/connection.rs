// Logging and sampling are deprecated for 2026-07-28 (SEP-2577); the 2025
// servers and clients this module relays between still speak them.
#![allow(deprecated)]

use std::collections::HashMap;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotificationParam, ClientCapabilities,
    ClientConfig, ClientRequest, CompleteRequestParams, CompleteResult, CreateMessageRequestMethod,
    CreateMessageRequestParams, CreateMessageResult, ElicitRequestParams, ElicitResult,
    ElicitationCapability, ElicitationCreateRequestMethod, ErrorData, FormElicitationCapability,
    GetPromptRequestParams, Implementation, InputRequest, InputResponses, JsonObject,
    LoggingMessageNotificationParam, Prompt, ProtocolVersion, ReadResourceRequestParams, Resource,
    ResourceTemplate, ResourceUpdatedNotificationParam, SamplingCapability, ServerResult,
    SetLevelRequestParams, SubscribeRequestParams, Tool, UnsubscribeRequestParams,
};
use rmcp::service::{
    ClientInitializeError, ClientLifecycleMode, ClientServiceExt as _, NotificationContext,
    RunningService, ServiceError,
};
use rmcp::service::{PeerRequestOptions, RequestContext};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStderr};
use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;

use crate::error::McpError;
use crate::error::chain;
use crate::relay::{Asker, InOrder, Relay, Routes};
use crate::spec::{
    Declarations, PromptDecl, ResourceDecl, ServerInfo, ServerSpec, ToolDecl, TransportSpec,
};
use crate::text::clean_text;

/// How much of a stdio server's stderr is kept for error messages (the tail).
/// Far more than an error text holds ([`crate::MAX_SANITIZED_LEN`]): the
/// sanitizer must see every secret whole before the text is cut, so the cut
/// happens after it (it keeps the end of the stderr), never here.
pub const STDERR_TAIL_BYTES: usize = 64 * 1024;
/// After stdin is closed, how long a server gets to exit before SIGTERM, and
/// after SIGTERM before SIGKILL.
const EXIT_GRACE: Duration = Duration::from_secs(2);
/// How long `close()` may take at most.
const CLOSE_BUDGET: Duration = Duration::from_secs(5);
/// After a handshake ends in a closed connection, how long to wait for the
/// exit status and the rest of stderr.
const EXIT_REPORT_WAIT: Duration = Duration::from_secs(1);

/// How to connect. No default: the bound is the caller's setting (the
/// agent's `--handshake-timeout`, the catalog's connect timeouts).
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Bound on spawn + `initialize` (rmcp has no timeout of its own).
    pub handshake_timeout: Duration,
    /// Receives the server's name on every `notifications/tools/list_changed`.
    pub tools_changed: Option<UnboundedSender<String>>,
    /// Speak only the revisions with `initialize` (an MCP session) to an
    /// HTTP server, even one offering 2026-07-28.
    pub sessions_only: bool,
    /// Declare elicitation and sampling, and relay what the server sends
    /// to the clients of its calls ([`crate::relay`]). Discovery and calls
    /// of one server must agree: servers offer tools by what a client declares.
    pub relays: bool,
}

impl ConnectOptions {
    /// A handshake within `handshake_timeout`, no one told of list changes.
    pub fn new(handshake_timeout: Duration) -> Self {
        Self {
            handshake_timeout,
            tools_changed: None,
            sessions_only: false,
            relays: false,
        }
    }
}

/// The result of a tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallOutcome {
    /// The server flagged the result as a tool error (`isError`).
    pub is_error: bool,
    /// The `content` array as JSON text.
    pub content_json: String,
    /// `structuredContent` as JSON text, when the server sent it.
    pub structured_content_json: Option<String>,
}

/// Our side of the MCP session: reports `tools/list_changed`; advertises
/// elicitation and sampling only when it relays them (the same every time, so
/// servers offer the same tools every time).
#[derive(Clone)]
struct ClientSide {
    server_name: String,
    tools_changed: Option<UnboundedSender<String>>,
    relays: bool,
    routes: Arc<Routes>,
}

impl ClientSide {
    fn list_changed(&self, notification: &'static str) {
        tracing::debug!(server = %self.server_name, notification, "list change received");
        if let Some(sender) = &self.tools_changed {
            // A closed receiver only means nobody listens any more.
            let _ = sender.send(self.server_name.clone());
        }
    }
}

impl ClientHandler for ClientSide {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.list_changed("tools/list_changed");
    }

    // Prompts and resources are pinned like tools: a change of either is
    // the same "list again" signal.
    async fn on_prompt_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.list_changed("prompts/list_changed");
    }

    async fn on_resource_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.list_changed("resources/list_changed");
    }

    fn get_info(&self) -> ClientConfig {
        let mut capabilities = ClientCapabilities::default();
        if self.relays {
            capabilities.elicitation =
                Some(ElicitationCapability::new().with_form(FormElicitationCapability::default()));
            capabilities.sampling = Some(SamplingCapability::default());
        }
        ClientConfig::new(
            capabilities,
            Implementation::new("ctxsync", env!("CARGO_PKG_VERSION")),
        )
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        match self.routes.asker(|d| d.can_elicit()) {
            Some(relay) => {
                let asker = asker_of(&context);
                relay.downstream.elicit(relay.origin, asker, request).await
            }
            None => Err(ErrorData::method_not_found::<ElicitationCreateRequestMethod>()),
        }
    }

    async fn create_message(
        &self,
        request: CreateMessageRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<CreateMessageResult, ErrorData> {
        match self.routes.asker(|d| d.can_sample()) {
            Some(relay) => {
                let asker = asker_of(&context);
                relay.downstream.sample(relay.origin, asker, request).await
            }
            None => Err(ErrorData::method_not_found::<CreateMessageRequestMethod>()),
        }
    }

    async fn on_logging_message(
        &self,
        message: LoggingMessageNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        for downstream in self.routes.followers() {
            downstream.log(&self.server_name, message.clone());
        }
    }

    async fn on_resource_updated(
        &self,
        updated: ResourceUpdatedNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        for downstream in self.routes.followers() {
            downstream.resource_updated(&self.server_name, &updated.uri);
        }
    }
}

/// An initialized MCP session with one server.
pub struct Connection {
    server_name: String,
    service: RunningService<RoleClient, ClientSide>,
    process: Option<ServerProcess>,
    server_info: ServerInfo,
    routes: Arc<Routes>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("server_name", &self.server_name)
            .field("pid", &self.pid())
            .field("server_info", &self.server_info)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Starts (stdio) or opens (HTTP) the server and completes the MCP handshake
    /// within `options.handshake_timeout`. On any failure nothing is left
    /// running.
    pub async fn connect(
        spec: &ServerSpec,
        options: ConnectOptions,
    ) -> Result<Connection, McpError> {
        let routes = Arc::new(Routes::default());
        let handler = ClientSide {
            server_name: spec.name.clone(),
            tools_changed: options.tools_changed.clone(),
            relays: options.relays,
            routes: routes.clone(),
        };
        let timeout = options.handshake_timeout;
        let (service, process) = match &spec.transport {
            TransportSpec::Stdio {
                command,
                args,
                env,
                cwd,
            } => {
                let mut command_line = tokio::process::Command::new(command);
                command_line
                    .args(args)
                    .envs(env)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    // Own process group: signals reach npx/shell grandchildren too.
                    .process_group(0)
                    .kill_on_drop(true);
                if let Some(cwd) = cwd {
                    if !cwd.is_dir() {
                        return Err(McpError::Spawn {
                            command: command.clone(),
                            reason: format!("working directory {} does not exist", cwd.display()),
                        });
                    }
                    command_line.current_dir(cwd);
                }
                let mut child = command_line.spawn().map_err(|error| McpError::Spawn {
                    command: command.clone(),
                    reason: spawn_reason(command, &error),
                })?;
                let (stdin, stdout, stderr) = (
                    child.stdin.take().expect("stdin is piped"),
                    child.stdout.take().expect("stdout is piped"),
                    child.stderr.take().expect("stderr is piped"),
                );
                let mut process = ServerProcess::new(child, stderr);
                let transport = InOrder::new(
                    rmcp::transport::async_rw::AsyncRwTransport::new_client(stdout, stdin),
                    routes.clone(),
                );
                match tokio::time::timeout(timeout, handler.clone().serve(transport)).await {
                    Ok(Ok(service)) => (service, Some(process)),
                    Ok(Err(error)) => return Err(process.handshake_failure(error).await),
                    Err(_) => {
                        process.kill().await;
                        return Err(McpError::Timeout { after: timeout });
                    }
                }
            }
            TransportSpec::StreamableHttp { url, headers } => {
                let custom_headers = header_map(url, headers)?;
                // Our client, not rmcp's default: rustls on ring with the
                // operator's extra CA (see `crate::https`).
                let client = crate::https::http_client()?;
                let started = Instant::now();
                let handshake = connect_streamable(
                    || handler.clone(),
                    &client,
                    url,
                    &custom_headers,
                    options.sessions_only,
                );
                let streamable = match tokio::time::timeout(timeout, handshake).await {
                    Ok(Ok(service)) => Ok(service),
                    Ok(Err(error)) => Err(error),
                    Err(_) => return Err(McpError::Timeout { after: timeout }),
                };
                match streamable {
                    Ok(service) => (service, None),
                    // The specification's backwards compatibility: a 4xx to
                    // the first POST may be a legacy HTTP+SSE server.
                    Err(error) if is_legacy_hint(&error) => {
                        let first = http_handshake_error(error);
                        let handler = handler.clone();
                        let left = timeout.saturating_sub(started.elapsed());
                        match connect_sse(handler, client, url, custom_headers, left).await {
                            Ok(service) => (service, None),
                            Err(second) => {
                                return Err(McpError::Transport {
                                    message: format!(
                                        "streamable HTTP: {}; legacy HTTP+SSE: {}",
                                        error_message(&first),
                                        error_message(&second)
                                    ),
                                });
                            }
                        }
                    }
                    Err(error) => return Err(http_handshake_error(error)),
                }
            }
            TransportSpec::Sse { url, headers } => {
                let custom_headers = header_map(url, headers)?;
                let client = crate::https::http_client()?;
                let service = connect_sse(handler, client, url, custom_headers, timeout).await?;
                (service, None)
            }
        };
        let server_info = service
            .peer_info()
            .map(|info| ServerInfo {
                name: info
                    .server_info
                    .as_ref()
                    .map(|i| i.name.clone())
                    .unwrap_or_default(),
                version: info
                    .server_info
                    .as_ref()
                    .map(|i| i.version.clone())
                    .unwrap_or_default(),
                protocol_version: info.protocol_version.to_string(),
            })
            .unwrap_or_default();
        Ok(Connection {
            server_name: spec.name.clone(),
            service,
            process,
            server_info,
            routes,
        })
    }

    /// Every tool the server offers, following `nextCursor` pagination.
    pub async fn list_tools(&self) -> Result<Vec<ToolDecl>, McpError> {
        Ok(self.list_tools_hinted().await?.0)
    }

    async fn list_tools_hinted(&self) -> Result<(Vec<ToolDecl>, Option<u64>), McpError> {
        let listed = self
            .service
            .peer()
            .list_all_tools_with_cache_hint()
            .await
            .map_err(|error| self.service_error(error))?;
        Ok((
            listed.items.into_iter().map(tool_decl).collect(),
            listed.ttl_ms,
        ))
    }

    /// Tools, prompts and resources, one list after the other, and the
    /// shortest cache hint among them.
    pub async fn list_all(&self) -> Result<Declarations, McpError> {
        let (tools, tools_ttl) = self.list_tools_hinted().await?;
        let (prompts, prompts_ttl) = self.list_prompts_hinted().await?;
        let (mut resources, resources_ttl) = self.list_resources_hinted().await?;
        // Templates are pinned as resources keyed by their URI template
        // (see `ResourceDecl`).
        resources.extend(
            self.list_resource_templates()
                .await?
                .into_iter()
                .map(template_decl),
        );
        let ttl = [tools_ttl, prompts_ttl, resources_ttl]
            .into_iter()
            .flatten()
            .min()
            .map(Duration::from_millis);
        Ok(Declarations {
            tools,
            prompts,
            resources,
            ttl,
        })
    }

    /// Every prompt the server offers (following pagination); none when it
    /// does not advertise prompts or answers `prompts/list` with an error
    /// (a server's tools stay usable whatever its prompts do).
    pub async fn list_prompts(&self) -> Result<Vec<PromptDecl>, McpError> {
        Ok(self.list_prompts_hinted().await?.0)
    }

    async fn list_prompts_hinted(&self) -> Result<(Vec<PromptDecl>, Option<u64>), McpError> {
        if !self.offers(|c| c.prompts.is_some()) {
            return Ok((Vec::new(), None));
        }
        let listed = self.service.peer().list_all_prompts_with_cache_hint().await;
        let (items, ttl) = self.or_none("prompts/list", listed)?;
        Ok((items.into_iter().map(prompt_decl).collect(), ttl))
    }

    /// Every resource the server offers (following pagination); none when it
    /// does not advertise resources or answers `resources/list` with an error.
    pub async fn list_resources(&self) -> Result<Vec<ResourceDecl>, McpError> {
        Ok(self.list_resources_hinted().await?.0)
    }

    async fn list_resources_hinted(&self) -> Result<(Vec<ResourceDecl>, Option<u64>), McpError> {
        if !self.offers(|c| c.resources.is_some()) {
            return Ok((Vec::new(), None));
        }
        let listed = self
            .service
            .peer()
            .list_all_resources_with_cache_hint()
            .await;
        let (items, ttl) = self.or_none("resources/list", listed)?;
        Ok((items.into_iter().map(resource_decl).collect(), ttl))
    }

    fn offers(&self, capability: impl Fn(&rmcp::model::ServerCapabilities) -> bool) -> bool {
        self.service
            .peer_info()
            .is_some_and(|info| capability(&info.capabilities))
    }

    /// A list the server refused (a JSON-RPC error) is an empty one; a broken
    /// transport or a timeout is still an error.
    fn or_none<T>(
        &self,
        method: &str,
        listed: Result<rmcp::service::MergedList<T>, ServiceError>,
    ) -> Result<(Vec<T>, Option<u64>), McpError> {
        match listed {
            Ok(listed) => Ok((listed.items, listed.ttl_ms)),
            Err(ServiceError::McpError(data)) => {
                tracing::debug!(server = %self.server_name, method, code = data.code.0, "list refused: taken as empty");
                Ok((Vec::new(), None))
            }
            Err(error) => Err(self.service_error(error)),
        }
    }

    /// `prompts/get`: the result (`description`, `messages`) as JSON text;
    /// gives up (and cancels the request) after `timeout`.
    pub async fn get_prompt(
        &self,
        name: &str,
        arguments: JsonObject,
        timeout: Duration,
    ) -> Result<String, McpError> {
        let mut request = GetPromptRequestParams::new(name);
        if !arguments.is_empty() {
            request = request.with_arguments(arguments);
        }
        let result = tokio::time::timeout(timeout, self.service.peer().get_prompt(request))
            .await
            .map_err(|_| McpError::Timeout { after: timeout })?
            .map_err(|error| self.service_error(error))?;
        Ok(serde_json::to_string(&result).expect("a prompt result serializes to JSON"))
    }

    /// `resources/read`: the result (`contents`) as JSON text; gives up (and
    /// cancels the request) after `timeout`.
    pub async fn read_resource(&self, uri: &str, timeout: Duration) -> Result<String, McpError> {
        let request = ReadResourceRequestParams::new(uri);
        let result = tokio::time::timeout(timeout, self.service.peer().read_resource(request))
            .await
            .map_err(|_| McpError::Timeout { after: timeout })?
            .map_err(|error| self.service_error(error))?;
        Ok(serde_json::to_string(&result).expect("a resource result serializes to JSON"))
    }

    /// Calls `name` with `arguments`; gives up (and cancels the request) after `timeout`.
    pub async fn call_tool(
        &self,
        name: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
    ) -> Result<CallOutcome, McpError> {
        let request = CallToolRequestParams::new(name.to_string()).with_arguments(arguments);
        let result = tokio::time::timeout(timeout, self.service.peer().call_tool(request))
            .await
            .map_err(|_| McpError::Timeout { after: timeout })?
            .map_err(|error| self.service_error(error))?;
        Ok(outcome_of(result))
    }

    /// [`Connection::call_tool`] for a client: the call's progress reaches
    /// it, the server's questions during the call (2025 requests, or
    /// 2026-07-28 input rounds) go to it, and its cancellation reaches the
    /// server as `notifications/cancelled`.
    pub async fn call_tool_relayed(
        &self,
        name: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
        relay: &Relay,
    ) -> Result<CallOutcome, McpError> {
        self.apply_level(relay).await;
        let mut in_flight = self.routes.begin(relay);
        let mut params = CallToolRequestParams::new(name.to_string()).with_arguments(arguments);
        let deadline = tokio::time::Instant::now() + timeout;
        for _round in 0..MAX_INPUT_ROUNDS {
            // Cancelled before it is sent (while the server started, say):
            // nothing to send. A cancellation sent right behind a request
            // could overtake it (rmcp writes each message from its own task).
            if relay.cancelled.is_cancelled() {
                return Err(McpError::Cancelled);
            }
            let request = ClientRequest::CallToolRequest(CallToolRequest::new(params.clone()));
            let handle = self
                .service
                .peer()
                .send_request_with_option(request, PeerRequestOptions::no_options())
                .await
                .map_err(|error| self.service_error(error))?;
            self.routes
                .route_progress(&mut in_flight, handle.progress_token.clone());
            let id = handle.id.clone();
            let response = tokio::select! {
                response = handle.await_response() => response,
                () = relay.cancelled.cancelled() => {
                    self.cancel(id, "the client cancelled the call").await;
                    return Err(McpError::Cancelled);
                }
                () = tokio::time::sleep_until(deadline) => {
                    self.cancel(id, "request timeout").await;
                    return Err(McpError::Timeout { after: timeout });
                }
            };
            match response.map_err(|error| self.service_error(error))? {
                ServerResult::CallToolResult(result) => return Ok(outcome_of(result)),
                ServerResult::InputRequiredResult(required) => {
                    let requests = required.input_requests.unwrap_or_default();
                    params.input_responses = Some(fulfil(requests, relay).await?);
                    params.request_state = required.request_state;
                }
                _ => {
                    return Err(McpError::Protocol {
                        message: "unexpected response type".to_string(),
                    });
                }
            }
        }
        Err(McpError::Protocol {
            message: format!("more than {MAX_INPUT_ROUNDS} rounds of input requests"),
        })
    }

    /// Routes what the server sends to `relay`'s client while the guard
    /// lives (a prompt or resource read: its questions, its updates).
    pub fn relaying(&self, relay: &Relay) -> crate::relay::InFlight {
        self.routes.begin(relay)
    }

    /// `notifications/cancelled` for request `id` (best effort: a closed
    /// transport has nothing left to cancel).
    async fn cancel(&self, id: rmcp::model::RequestId, reason: &str) {
        let cancelled = CancelledNotificationParam::new(Some(id), Some(reason.to_owned()));
        if let Err(error) = self.service.peer().notify_cancelled(cancelled).await {
            tracing::debug!(server = %self.server_name, error = %error, "cancellation not sent");
        }
    }

    /// Sends the client's log level first if the server has not had it.
    async fn apply_level(&self, relay: &Relay) {
        if !self.offers(|c| c.logging.is_some()) {
            return;
        }
        if let Some(level) = self.routes.level_to_send(relay.downstream.log_level()) {
            let sent = self
                .service
                .peer()
                .set_level(SetLevelRequestParams::new(level))
                .await;
            if let Err(error) = sent {
                tracing::debug!(server = %self.server_name, error = %error, "log level not applied");
            }
        }
    }

    /// `logging/setLevel` for a client that follows this connection.
    pub async fn relay_level(&self, relay: &Relay) {
        let _in_flight = self.routes.begin(relay);
        self.apply_level(relay).await;
    }

    /// `completion/complete` as the client asked it.
    pub async fn complete(
        &self,
        params: CompleteRequestParams,
        timeout: Duration,
    ) -> Result<CompleteResult, McpError> {
        tokio::time::timeout(timeout, self.service.peer().complete(params))
            .await
            .map_err(|_| McpError::Timeout { after: timeout })?
            .map_err(|error| self.service_error(error))
    }

    /// Every resource template the server offers (none if it has no resources).
    pub async fn list_resource_templates(&self) -> Result<Vec<ResourceTemplate>, McpError> {
        if !self.offers(|c| c.resources.is_some()) {
            return Ok(Vec::new());
        }
        match self.service.peer().list_all_resource_templates().await {
            Ok(templates) => Ok(templates),
            Err(ServiceError::McpError(_)) => Ok(Vec::new()),
            Err(error) => Err(self.service_error(error)),
        }
    }

    /// `resources/subscribe` for `relay`'s client: its updates reach it.
    pub async fn subscribe(
        &self,
        uri: &str,
        relay: &Relay,
        timeout: Duration,
    ) -> Result<(), McpError> {
        let _in_flight = self.routes.begin(relay);
        // The 2025 revisions' subscription, which the client spoke.
        let subscribed = self
            .service
            .peer()
            .subscribe(SubscribeRequestParams::new(uri));
        tokio::time::timeout(timeout, subscribed)
            .await
            .map_err(|_| McpError::Timeout { after: timeout })?
            .map_err(|error| self.service_error(error))
    }

    /// `resources/unsubscribe`.
    pub async fn unsubscribe(&self, uri: &str, timeout: Duration) -> Result<(), McpError> {
        let unsubscribed = self
            .service
            .peer()
            .unsubscribe(UnsubscribeRequestParams::new(uri));
        tokio::time::timeout(timeout, unsubscribed)
            .await
            .map_err(|_| McpError::Timeout { after: timeout })?
            .map_err(|error| self.service_error(error))
    }

    pub fn server_info(&self) -> ServerInfo {
        self.server_info.clone()
    }

    pub fn server_name(&self) -> &str {
        &self.server_name
    }

    /// The stdio server's pid, which is also its process-group id.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pgid.as_raw() as u32)
    }

    /// Whether the session has ended (server gone or connection closed).
    pub fn is_closed(&self) -> bool {
        self.service.is_transport_closed()
    }

    /// Graceful close: ends the session (stdin closed / HTTP session deleted),
    /// waits for the server to exit, then SIGTERM, then SIGKILL to the whole
    /// process group. Takes at most a few seconds.
    pub async fn close(self) {
        self.close_within(CLOSE_BUDGET).await;
    }

    /// [`Connection::close`] bounded by `budget`; whatever is still running
    /// when it runs out is killed.
    pub async fn close_within(mut self, budget: Duration) {
        let deadline = Instant::now() + budget;
        let _ = self.service.close_with_timeout(budget).await;
        if let Some(process) = &mut self.process {
            process.stop_by(deadline).await;
        }
    }

    /// Immediate SIGKILL to the whole process group (stdio) or a dropped
    /// session (HTTP).
    pub async fn kill(mut self) {
        if let Some(process) = &mut self.process {
            process.kill().await;
        }
        let _ = self
            .service
            .close_with_timeout(Duration::from_millis(200))
            .await;
    }

    fn service_error(&self, error: ServiceError) -> McpError {
        match error {
            ServiceError::McpError(data) => McpError::Protocol {
                message: format!("{} (code {})", clean_text(&data.message), data.code.0),
            },
            ServiceError::Timeout { timeout } => McpError::Timeout { after: timeout },
            ServiceError::UnexpectedResponse => McpError::Protocol {
                message: "unexpected response type".to_string(),
            },
            other => {
                let mut message = chain(&other);
                if let Some(process) = &self.process {
                    let tail = process.stderr.tail();
                    if !tail.trim().is_empty() {
                        message.push_str("; stderr: ");
                        message.push_str(tail.trim());
                    }
                }
                McpError::Transport { message }
            }
        }
    }
}

/// Rounds of 2026-07-28 input requests one relayed call may take (rmcp's
/// own helpers stop at the same count).
const MAX_INPUT_ROUNDS: usize = rmcp::model::DEFAULT_MRTR_MAX_ROUNDS;

fn outcome_of(result: rmcp::model::CallToolResult) -> CallOutcome {
    CallOutcome {
        is_error: result.is_error.unwrap_or(false),
        content_json: serde_json::to_string(&result.content)
            .expect("tool content serializes to JSON"),
        structured_content_json: result
            .structured_content
            .as_ref()
            .map(|value| value.to_string()),
    }
}

/// The server asking, for the client's progress on its question.
fn asker_of(context: &RequestContext<RoleClient>) -> Asker {
    Asker {
        peer: Some(context.peer.clone()),
        progress_token: context.meta.get_progress_token(),
    }
}

/// Answers a 2026-07-28 server's input requests through the call's client.
async fn fulfil(
    requests: rmcp::model::InputRequests,
    relay: &Relay,
) -> Result<InputResponses, McpError> {
    let mut responses = InputResponses::new();
    for (key, request) in requests {
        let downstream = &relay.downstream;
        let answered = match request {
            InputRequest::Elicitation(request) if downstream.can_elicit() => downstream
                .elicit(relay.origin.clone(), Asker::none(), request.params)
                .await
                .map(|r| serde_json::to_value(r).expect("an elicitation result is JSON")),
            InputRequest::CreateMessage(request) if downstream.can_sample() => downstream
                .sample(relay.origin.clone(), Asker::none(), request.params)
                .await
                .map(|r| serde_json::to_value(r).expect("a sampling result is JSON")),
            InputRequest::ListRoots(_) => Ok(serde_json::json!({ "roots": [] })),
            _ => {
                return Err(McpError::Protocol {
                    message: "the server asked for input its client did not declare it can give"
                        .to_string(),
                });
            }
        };
        let value = answered.map_err(|error| McpError::Protocol {
            message: format!(
                "the client refused the server's input request: {}",
                error.message
            ),
        })?;
        responses.insert(key, value);
    }
    Ok(responses)
}

/// The server's declaration, its texts cleaned of control characters. The
/// schema needs no cleaning: JSON text escapes them (`\u0000`).
fn tool_decl(tool: Tool) -> ToolDecl {
    ToolDecl {
        name: clean_text(&tool.name).into_owned(),
        description: tool
            .description
            .map(|d| clean_text(&d).into_owned())
            .unwrap_or_default(),
        input_schema_json: serde_json::to_string(&*tool.input_schema)
            .expect("a JSON object serializes"),
    }
}

/// A prompt's declaration; its name cleaned of control characters (the
/// JSON text escapes them).
fn prompt_decl(prompt: Prompt) -> PromptDecl {
    PromptDecl {
        name: clean_text(&prompt.name).into_owned(),
        declaration_json: serde_json::to_string(&prompt).expect("a prompt serializes to JSON"),
    }
}

fn resource_decl(resource: Resource) -> ResourceDecl {
    ResourceDecl {
        uri: clean_text(&resource.uri).into_owned(),
        declaration_json: serde_json::to_string(&resource).expect("a resource serializes to JSON"),
    }
}

fn template_decl(template: ResourceTemplate) -> ResourceDecl {
    ResourceDecl {
        uri: clean_text(&template.uri_template).into_owned(),
        declaration_json: serde_json::to_string(&template)
            .expect("a resource template serializes to JSON"),
    }
}

fn spawn_reason(command: &str, error: &std::io::Error) -> String {
    match error.kind() {
        std::io::ErrorKind::NotFound if command.contains('/') => {
            format!("no such file: {command}")
        }
        std::io::ErrorKind::NotFound => format!("command not found on PATH: {command}"),
        std::io::ErrorKind::PermissionDenied => format!("permission denied: {command}"),
        _ => error.to_string(),
    }
}

/// The configured headers, checked: a bad one is a config error naming the
/// header, never its value.
fn header_map(
    url: &str,
    headers: &std::collections::BTreeMap<String, String>,
) -> Result<HashMap<http::HeaderName, http::HeaderValue>, McpError> {
    url::Url::parse(url).map_err(|error| McpError::InvalidSpec {
        message: format!("url {url} is not valid: {error}"),
    })?;
    let mut custom_headers = HashMap::new();
    for (name, value) in headers {
        let header_name =
            http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| McpError::InvalidSpec {
                message: format!("header name {name:?} is not valid"),
            })?;
        // The value is a secret: say which header, never what it holds.
        let header_value =
            http::HeaderValue::from_str(value).map_err(|_| McpError::InvalidSpec {
                message: format!("the value of header {name} is not a valid header value"),
            })?;
        custom_headers.insert(header_name, header_value);
    }
    Ok(custom_headers)
}

/// A streamable-HTTP server, asked in its own era: `server/discover` first
/// and 2026-07-28 (stateless) when the server offers it; otherwise the
/// `initialize` handshake of the session revisions. A server that fails the
/// discovery in any way (an unknown method, a 4xx to a request without a
/// session, a version it does not serve) gets a fresh `initialize`, so what
/// it answers there is what is reported.
async fn connect_streamable(
    handler: impl Fn() -> ClientSide,
    client: &reqwest::Client,
    url: &str,
    headers: &HashMap<http::HeaderName, http::HeaderValue>,
    sessions_only: bool,
) -> Result<RunningService<RoleClient, ClientSide>, ClientInitializeError> {
    let transport = || {
        InOrder::new(
            StreamableHttpClientTransport::with_client(
                client.clone(),
                StreamableHttpClientTransportConfig::with_uri(url).custom_headers(headers.clone()),
            ),
            handler().routes,
        )
    };
    let stateless = ClientLifecycleMode::Auto {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
        legacy_version: None,
    };
    if sessions_only {
        return handler().serve(transport()).await;
    }
    let side = handler();
    let listener = side
        .tools_changed
        .clone()
        .map(|sender| (side.server_name.clone(), sender));
    match side.serve_with_lifecycle(transport(), stateless).await {
        Ok(service) => {
            if let Some((server_name, sender)) = listener {
                tokio::spawn(listen_for_changes(
                    service.peer().clone(),
                    server_name,
                    sender,
                ));
            }
            Ok(service)
        }
        // Not the error: its text names the URL, credentials included; the
        // handshake's error below is sanitized where it is reported.
        Err(_) => {
            tracing::debug!("server/discover did not succeed; initialize instead");
            handler().serve(transport()).await
        }
    }
}

/// A stateless server's list changes come only on a `subscriptions/listen`
/// stream: followed until it or the connection ends, each change reported
/// as a session's `list_changed` notification is.
async fn listen_for_changes(
    peer: rmcp::Peer<RoleClient>,
    server_name: String,
    sender: UnboundedSender<String>,
) {
    let filter = rmcp::model::SubscriptionFilter::builder()
        .tools_list_changed()
        .prompts_list_changed()
        .resources_list_changed()
        .build();
    let mut subscription = match peer.listen(filter).await {
        Ok(subscription) => subscription,
        Err(error) => {
            tracing::debug!(server = %server_name, %error, "the server offers no subscriptions/listen");
            return;
        }
    };
    while let Ok(Some(notification)) = subscription.next().await {
        use rmcp::model::ServerNotification as N;
        if matches!(
            notification,
            N::ToolListChangedNotification(_)
                | N::PromptListChangedNotification(_)
                | N::ResourceListChangedNotification(_)
        ) {
            tracing::debug!(server = %server_name, "list change received on subscriptions/listen");
            if sender.send(server_name.clone()).is_err() {
                return;
            }
        }
    }
}

/// Opens a legacy SSE session and runs the handshake over it, both within
/// `timeout`.
async fn connect_sse(
    handler: ClientSide,
    client: reqwest::Client,
    url: &str,
    headers: HashMap<http::HeaderName, http::HeaderValue>,
    timeout: Duration,
) -> Result<RunningService<RoleClient, ClientSide>, McpError> {
    let handshake = async {
        let transport = crate::sse::SseTransport::connect(client, url, headers)
            .await
            .map_err(|error| McpError::Transport { message: error.0 })?;
        let transport = InOrder::new(transport, handler.routes.clone());
        handler.serve(transport).await.map_err(http_handshake_error)
    };
    match tokio::time::timeout(timeout, handshake).await {
        Ok(result) => result,
        Err(_) => Err(McpError::Timeout { after: timeout }),
    }
}

/// The error's text without its variant's prefix, for a message that joins two.
fn error_message(error: &McpError) -> String {
    match error {
        McpError::Transport { message } => message.clone(),
        other => other.to_string(),
    }
}

/// Whether a failed streamable-HTTP initialize is the 4xx answer the
/// specification says to retry as a legacy HTTP+SSE server.
fn is_legacy_hint(error: &ClientInitializeError) -> bool {
    use rmcp::transport::streamable_http_client::StreamableHttpError;
    let ClientInitializeError::TransportError { error, .. } = error else {
        return false;
    };
    match error
        .error
        .downcast_ref::<StreamableHttpError<reqwest::Error>>()
    {
        Some(StreamableHttpError::UnexpectedServerResponse(text)) => text.starts_with("HTTP 4"),
        Some(StreamableHttpError::Client(inner)) => inner
            .status()
            .is_some_and(|status| status.is_client_error()),
        Some(StreamableHttpError::UnexpectedContentType(_)) => true,
        _ => false,
    }
}

fn http_handshake_error(error: ClientInitializeError) -> McpError {
    match error {
        // The transport's type name in rmcp's text says nothing to an operator:
        // report what was being done and the error's own cause chain.
        ClientInitializeError::TransportError { error, context } => McpError::Transport {
            message: format!("{context}: {}", http_error_text(error.error.as_ref())),
        },
        ClientInitializeError::JsonRpcError(data) => McpError::Handshake {
            message: format!("server rejected initialize: {}", clean_text(&data.message)),
            stderr_tail: String::new(),
        },
        other => McpError::Handshake {
            message: chain(&other),
            stderr_tail: String::new(),
        },
    }
}

/// rmcp's HTTP client error does not expose reqwest's error as its source, so
/// the cause ("connection refused", "dns error") would be lost without this.
fn http_error_text(error: &(dyn std::error::Error + Send + Sync + 'static)) -> String {
    use rmcp::transport::streamable_http_client::StreamableHttpError;
    match error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
        Some(StreamableHttpError::Client(inner)) => chain(inner),
        _ => chain(error),
    }
}

/// A stdio server: the group-leader child and the tail of its stderr.
struct ServerProcess {
    child: Child,
    pgid: Pid,
    stderr: StderrTail,
    /// Set once the group has been SIGKILLed after the leader was reaped, so
    /// `Drop` never signals a group id that may have been reused.
    finished: bool,
}

impl ServerProcess {
    fn new(child: Child, stderr: ChildStderr) -> Self {
        let pid = child.id().expect("a just-spawned child has a pid");
        ServerProcess {
            child,
            pgid: Pid::from_raw(pid as i32),
            stderr: StderrTail::capture(stderr),
            finished: false,
        }
    }

    fn signal_group(&self, signal: Signal) {
        if self.finished {
            return;
        }
        // ESRCH: the group is already gone, which is what we want.
        let _ = killpg(self.pgid, signal);
    }

    async fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining, self.child.wait()).await {
            Ok(Ok(status)) => Some(status),
            _ => None,
        }
    }

    /// The leader has been waited for: kill whatever it left in the group.
    fn finish(&mut self) {
        self.signal_group(Signal::SIGKILL);
        self.finished = true;
    }

    async fn kill(&mut self) {
        self.signal_group(Signal::SIGKILL);
        let _ = self.child.wait().await;
        self.finish();
    }

    /// stdin is already closed: give the server until `deadline` to exit
    /// (SIGTERM halfway), then SIGKILL the group.
    async fn stop_by(&mut self, deadline: Instant) {
        let now = Instant::now();
        let term_at = (now + EXIT_GRACE).min(now + deadline.saturating_duration_since(now) / 2);
        if self.wait_until(term_at).await.is_none() {
            self.signal_group(Signal::SIGTERM);
            let kill_at = (Instant::now() + EXIT_GRACE).min(deadline);
            if self.wait_until(kill_at).await.is_none() {
                self.kill().await;
                return;
            }
        }
        self.finish();
    }

    /// Turns a failed handshake into an error that says how the process ended.
    async fn handshake_failure(&mut self, error: ClientInitializeError) -> McpError {
        // Any transport failure (a closed stream, a broken pipe while sending
        // initialize) may be a process that already exited: say how it ended.
        // Only an answer from the server rules that out.
        let answered = matches!(error, ClientInitializeError::JsonRpcError(_));
        let status = if !answered {
            self.wait_until(Instant::now() + EXIT_REPORT_WAIT).await
        } else {
            None
        };
        match status {
            Some(status) => {
                self.stderr.wait_for_eof(EXIT_REPORT_WAIT).await;
                self.finish();
                McpError::Exited {
                    status: status.to_string(),
                    stderr_tail: self.stderr.tail(),
                }
            }
            None => {
                self.kill().await;
                let message = match error {
                    ClientInitializeError::JsonRpcError(data) => {
                        format!("server rejected initialize: {}", clean_text(&data.message))
                    }
                    other => chain(&other),
                };
                McpError::Handshake {
                    message,
                    stderr_tail: self.stderr.tail(),
                }
            }
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // Dropped without close (a cancelled future, a panic): leave nothing behind.
        // tokio reaps the killed leader in the background.
        self.signal_group(Signal::SIGKILL);
    }
}

/// The last [`STDERR_TAIL_BYTES`] of a child's stderr, read by a background task.
struct StderrTail {
    buffer: Arc<Mutex<Vec<u8>>>,
    /// Whether the start of the output was dropped to keep the window.
    dropped: Arc<std::sync::atomic::AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

impl StderrTail {
    fn capture(mut stderr: ChildStderr) -> Self {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sink = buffer.clone();
        let dropped_flag = dropped.clone();
        let reader = tokio::spawn(async move {
            let mut chunk = [0u8; 1024];
            while let Ok(n) = stderr.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                let mut buffer = sink.lock().expect("stderr buffer lock");
                buffer.extend_from_slice(&chunk[..n]);
                // Trimmed at twice the window, so a chatty server costs one
                // move per window of output, not one per read.
                if buffer.len() > 2 * STDERR_TAIL_BYTES {
                    let excess = buffer.len() - STDERR_TAIL_BYTES;
                    buffer.drain(..excess);
                    dropped_flag.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        StderrTail {
            buffer,
            dropped,
            reader: Some(reader),
        }
    }

    async fn wait_for_eof(&mut self, bound: Duration) {
        if let Some(reader) = self.reader.as_mut()
            && tokio::time::timeout(bound, reader).await.is_ok()
        {
            self.reader = None;
        }
    }

    fn tail(&self) -> String {
        let buffer = self.buffer.lock().expect("stderr buffer lock");
        let mut kept: &[u8] = &buffer[buffer.len().saturating_sub(STDERR_TAIL_BYTES)..];
        if buffer.len() > STDERR_TAIL_BYTES
            || self.dropped.load(std::sync::atomic::Ordering::Relaxed)
        {
            // The window's first line lost its start: a secret cut there would
            // pass the sanitizer as a fragment, so the partial line goes.
            kept = match kept.iter().position(|&b| b == b'\n') {
                Some(newline) => &kept[newline + 1..],
                None => match kept.iter().position(u8::is_ascii_whitespace) {
                    Some(space) => &kept[space + 1..],
                    None => &[],
                },
            };
        }
        // A server may write anything to stderr, NUL and terminal colours included.
        clean_text(String::from_utf8_lossy(kept).trim())
            .trim()
            .to_string()
    }
}

impl Drop for StderrTail {
    fn drop(&mut self) {
        if let Some(reader) = self.reader.take() {
            reader.abort();
        }
    }
}
