//! The MCP endpoint: `/mcp` on the catalog's HTTP listener, streamable HTTP
//! (rmcp's server side), for any MCP client.
//!
//! * Every request carries a tenant key (`Authorization: Bearer cxk_…`),
//!   verified through the store like chat-gate's ([`TenantKeys`]); no key, a
//!   malformed or an unknown one is answered 401 before MCP sees it, and a
//!   key over its rate limit 429.
//! * One MCP session (2025-11-25 and before) is one catalog session, driven in-process: `initialize`
//!   prepares it ([`Prepare`]: pins from memory, live discovery where there
//!   is none), `tools/list` answers its pins named by each pin's rule
//!   (`catalog_core::naming`: `server__tool` by default, the tenant's
//!   `bare`, a server's prefix or aliases) less the tools withdrawn since, `tools/call` goes through [`Call`]
//!   (lazy start, withdrawal rules, the server's call timeout), and the end
//!   of the MCP session (DELETE, idle expiry, shutdown) ends the catalog
//!   session, which stops its servers.
//! * Prompts are served the same way (`prompts/list` named like tools,
//!   `prompts/get` through [`Call`]); resources by their own URIs
//!   (`resources/read` goes to the server that declared the URI, the first
//!   in configured order when two did).
//! * A catalog error is a tool result with `isError: true`: its code and
//!   message in `structuredContent.error` and as text. For a prompt or a
//!   resource it is a JSON-RPC error carrying the code in `data.code`.
//! * When a call finds tools, prompts or resources withdrawn that the
//!   client was not told about, the session is sent the matching
//!   `notifications/*/list_changed`.
//! * A session answers only the tenant whose key created it, from its
//!   creation on (`mcp_sessions`): a request naming it with another
//!   tenant's key is 404 like an unknown session, whatever it is and
//!   whether or not the session is initialized (and refused inside MCP too).
//! * A 2026-07-28 request has no session: it is answered from a pin handle
//!   (`_meta["ctxsync.dev/pins"]`), the one it carries or the memory's now
//!   (`Endpoint::stateless`), and its lists carry `ttlMs`/`cacheScope`
//!   from the memory (`catalog_core::hints`); `subscriptions/listen`
//!   announces list changes.
//! * Every per-key resource is bounded: requests (a token bucket per key),
//!   open sessions per key and per tenant (429 past them; one key or tenant
//!   at its bound leaves the others theirs), idle sessions expire, and the
//!   server processes a session starts are bounded per tenant and in all
//!   (`processes`). A revoked key's sessions end at once, streams included.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use catalog_core::naming::NameRule;
use catalog_core::uri_template;
use ctxsync_mcp::relay::Relay;
use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{
    CatalogCallReply, CatalogCallRequest, CatalogPrepareRequest, ServiceError,
};
use ctxsync_runtime::tenant_keys::{self, Caller, TenantKeys};
use futures::StreamExt as _;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CompleteRequestParams, CompleteResult,
    ContentBlock, DiscoverResult, ErrorCode, ErrorData, Extensions, GetPromptRequestParams,
    GetPromptResponse, GetPromptResult, Implementation, InitializeRequestParams, InitializeResult,
    JsonObject, ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, Prompt, ProtocolVersion, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Reference, Resource, ResourceTemplate,
    ServerCapabilities, ServerConfig, ServerNotification, SubscribeRequestParams,
    SubscriptionFilter, Tool, UnsubscribeRequestParams,
};
// Logging is deprecated for 2026-07-28 (SEP-2577); 2025 clients set levels.
#[allow(deprecated)]
use rmcp::model::SetLevelRequestParams;
use rmcp::service::{NotificationContext, RequestContext, SubscriptionContext};
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{Peer, RoleServer, ServerHandler};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::call::Call;
use crate::mcp_sessions::McpSessions;
pub use crate::mcp_sessions::SessionLimits;
use crate::prepare::Prepare;
use crate::rate_limit::Limiter;
pub use crate::rate_limit::RateLimit;
use crate::relay;
use crate::sessions::{Sessions, Withdrawn};

mod direct;

/// Separates a server's id from its tool's name, as the gate does.
pub const TOOL_NAME_SEPARATOR: &str = catalog_core::naming::SEPARATOR;

/// The header carrying the MCP session id.
const SESSION_HEADER: &str = "mcp-session-id";

/// The header carrying a request's protocol version.
const PROTOCOL_HEADER: &str = "mcp-protocol-version";

/// The first revision without sessions: a request naming it (or a later one)
/// is served statelessly and creates no MCP session.
const FIRST_STATELESS_VERSION: &str = "2026-07-28";

/// Where a stateless list's pin handle is given (the result's `_meta`) and
/// passed back (a request's `_meta`).
pub const PIN_HANDLE_META: &str = "ctxsync.dev/pins";

/// How many stateless pin sets this replica keeps built (they never change,
/// so a kept one is never stale; past it, the oldest is built again).
const PINNED_KEPT: usize = 1024;

/// The catalog's parts the endpoint drives in-process.
pub(crate) struct Commands {
    pub prepare: Arc<Prepare>,
    pub call: Arc<Call>,
    pub sessions: Arc<Sessions>,
    pub pool: sqlx::PgPool,
}

/// Where the endpoint keeps its sessions for the other replicas.
pub(crate) struct StoredSettings {
    pub client: async_nats::Client,
    pub bucket: String,
    pub replicas: usize,
    pub seal: crate::bucket::MemoryKey,
}

/// The endpoint: the commands, the key check and its limits.
pub(crate) struct Endpoint {
    commands: Commands,
    keys: TenantKeys,
    page_size: usize,
    limiter: Limiter,
    /// The MCP sessions: their owners and bounds.
    mcp_sessions: Arc<McpSessions>,
    /// Stateless pin sets built, by tenant and handle (bounded, oldest out).
    pinned: Mutex<PinnedKept>,
    /// Stateless clients' calls waiting on their input (bounded).
    rounds: relay::InputRounds,
    /// The 2025 sessions whose calls the endpoint answers itself.
    direct: direct::Direct,
}

/// The pin sets kept, and their order of arrival for eviction.
#[derive(Default)]
struct PinnedKept {
    by_handle: std::collections::HashMap<(String, String), Arc<Bound>>,
    order: std::collections::VecDeque<(String, String)>,
}

impl PinnedKept {
    fn get(&self, tenant: &str, handle: &str) -> Option<Arc<Bound>> {
        self.by_handle
            .get(&(tenant.to_owned(), handle.to_owned()))
            .cloned()
    }

    fn keep(&mut self, bound: Arc<Bound>) {
        let key = (bound.tenant.clone(), bound.session_id.clone());
        if self.by_handle.insert(key.clone(), bound).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > PINNED_KEPT {
            if let Some(oldest) = self.order.pop_front() {
                self.by_handle.remove(&oldest);
            }
        }
    }
}

impl Endpoint {
    pub fn new(
        commands: Commands,
        keys: TenantKeys,
        page_size: usize,
        rate_limit: Option<RateLimit>,
        session_limits: SessionLimits,
        stored: Option<StoredSettings>,
        stopping: CancellationToken,
    ) -> Self {
        let store = stored.map(|stored| {
            move |sessions| {
                crate::mcp_store::StoredSessions::new(
                    stored.client,
                    stored.bucket,
                    stored.replicas,
                    session_limits.idle,
                    stored.seal,
                    sessions,
                )
            }
        });
        Self {
            commands,
            mcp_sessions: McpSessions::new(keys.clone(), session_limits, store, stopping),
            keys,
            page_size: page_size.max(1),
            limiter: Limiter::new(rate_limit),
            pinned: Mutex::default(),
            rounds: relay::InputRounds::default(),
            direct: direct::Direct::default(),
        }
    }

    /// The pins a stateless request is answered from: those of the handle
    /// it carries, else those of the memory now (pinned once under the
    /// handle they derive); and how long its lists stay true.
    async fn stateless(
        &self,
        caller: &Caller,
        meta: &rmcp::model::RequestMetaObject,
    ) -> Result<Stateless, ErrorData> {
        let tenant = caller.tenant.as_str();
        let snapshot = self
            .commands
            .prepare
            .snapshot(tenant)
            .map_err(|refusal| rpc_error(&refusal.to_proto()))?;
        let current = snapshot.handle();
        let wanted = match meta.0.0.get(PIN_HANDLE_META) {
            Some(value) => Some(
                catalog_core::hints::valid_handle(value)
                    .map_err(|e| handle_refused(e.to_string()))?
                    .to_owned(),
            ),
            None => None,
        };
        let handle = wanted
            .clone()
            .or_else(|| current.clone())
            .unwrap_or_else(|| {
                format!(
                    "{}{}",
                    catalog_core::hints::PIN_HANDLE_PREFIX,
                    uuid::Uuid::new_v4()
                )
            });
        let kept = self
            .pinned
            .lock()
            .expect("pinned lock")
            .get(tenant, &handle);
        let bound = match kept {
            Some(bound) => bound,
            None => {
                let pins = if wanted.is_some() && wanted != current {
                    // Its own preparation, or another's (a chat's, the gate
                    // gave out): never prepared by this request.
                    self.commands
                        .prepare
                        .pins_of(tenant, &handle)
                        .await
                        .map_err(|message| ErrorData::internal_error(message, None))?
                        .ok_or_else(|| {
                            handle_refused(
                                "the pin handle names no pins of this tenant; list again without it"
                                    .to_owned(),
                            )
                        })?
                } else {
                    let reply = self
                        .commands
                        .prepare
                        .handle_snapshot(tenant, &handle, snapshot.clone())
                        .await;
                    if let Some(error) = reply.error {
                        return Err(prepare_failed(&error));
                    }
                    reply.pins
                };
                let bound = Arc::new(Bound::of(tenant, &handle, &pins, true));
                self.pinned.lock().expect("pinned lock").keep(bound.clone());
                bound
            }
        };
        // Pins older than the memory's are still served, but stale at once:
        // a list without the handle gives the current ones.
        let fresh_for = snapshot.fresh_for_pinned(&bound.pinned);
        Ok(Stateless { bound, fresh_for })
    }

    /// MCP sessions open now.
    pub fn open_sessions(&self) -> usize {
        self.mcp_sessions.open()
    }
}

/// `/mcp`, behind the tenant-key check, until `stop`.
pub(crate) fn routes(endpoint: Arc<Endpoint>, stop: CancellationToken) -> axum::Router {
    let factory = endpoint.clone();
    // Callers are authenticated by key, not by the Host they name.
    let mut config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_cancellation_token(stop);
    config.session_store = endpoint.mcp_sessions.stored().map(|stored| {
        stored as Arc<dyn rmcp::transport::streamable_http_server::session::SessionStore>
    });
    let service: StreamableHttpService<McpSession, McpSessions> = StreamableHttpService::new(
        move || Ok(McpSession::new(factory.clone())),
        endpoint.mcp_sessions.clone(),
        config,
    );
    axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(endpoint, authenticate))
}

fn refused(reason: &'static str) {
    metrics::counter!("ctxsync_catalog_mcp_refused_total", "reason" => reason).increment(1);
}

/// The tenant key before MCP: the caller goes into the request's extensions.
async fn authenticate(
    State(endpoint): State<Arc<Endpoint>>,
    mut request: Request,
    next: Next,
) -> Response {
    let arrived = Instant::now();
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or("?"));
    let caller = match endpoint.keys.authenticate(header).await {
        Ok(caller) => caller,
        Err(refusal) => {
            refused(refusal.reason());
            return tenant_keys::refusal_response(refusal);
        }
    };
    if let Err(wait) = endpoint.limiter.admit(&caller.key_id) {
        refused("rate_limited");
        let mut response = tenant_keys::error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            "the tenant key's request rate limit is reached; retry",
        );
        response.headers_mut().insert(
            header::RETRY_AFTER,
            axum::http::HeaderValue::from(crate::rate_limit::retry_after_seconds(wait)),
        );
        return response;
    }
    let session = request
        .headers()
        .get(SESSION_HEADER)
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    let Some(session) = session else {
        // A POST without a session may create one: it needs a place first.
        // A stateless request creates none.
        let stateless = request
            .headers()
            .get(PROTOCOL_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|version| version >= FIRST_STATELESS_VERSION);
        if request.method() != axum::http::Method::POST || stateless {
            request.extensions_mut().insert(caller);
            return next.run(request).await;
        }
        let key = tenant_keys::bearer(header).unwrap_or_default().to_owned();
        return with_session_place(&endpoint, caller, key, request, next).await;
    };
    // Another tenant's session is answered like one that does not exist,
    // whatever the request (POST of any message, GET, DELETE).
    let owner = match endpoint.mcp_sessions.owner(&session) {
        Some(owner) if owner.caller.tenant == caller.tenant => owner,
        Some(_) => {
            refused("other_tenant");
            return session_not_found();
        }
        // Another replica's session, if it stored it: restored here, for
        // its own tenant, under this replica's bounds.
        None => match endpoint.mcp_sessions.stored_owner(&session).await {
            Some(stored) if stored.tenant == caller.tenant => {
                let key = tenant_keys::bearer(header).unwrap_or_default().to_owned();
                return with_session_place(&endpoint, caller, key, request, next).await;
            }
            Some(_) => {
                refused("other_tenant");
                return session_not_found();
            }
            None => {
                refused("unknown_session");
                return session_not_found();
            }
        },
    };
    request.extensions_mut().insert(caller);
    let response = {
        // The session is not idle while it is asked something.
        let _busy = owner.activity.begin();
        match direct::take(&endpoint, &session, &owner, request, arrived).await {
            // Whole already (its length known): nothing to end.
            direct::Taken::Answered(response) if direct::is_whole(&response) => {
                return response;
            }
            direct::Taken::Answered(response) => response,
            direct::Taken::Passed(request) => next.run(request).await,
        }
    };
    ended_with_session(response, &owner)
}

/// A stream of the session (GET, a POST's answer) ends when the session does.
fn ended_with_session(response: Response, owner: &crate::mcp_sessions::Owner) -> Response {
    let ended = owner.ended.clone();
    response.map(|body| {
        axum::body::Body::from_stream(
            body.into_data_stream()
                .take_until(async move { ended.cancelled_owned().await }),
        )
    })
}

/// Serves a request that may create or restore a session with a place
/// for it under the caller's bounds (or the 429 that refuses one).
async fn with_session_place(
    endpoint: &Arc<Endpoint>,
    caller: Caller,
    key: String,
    mut request: Request,
    next: Next,
) -> Response {
    let reservation = match reserve(endpoint, &caller, &key) {
        Ok(reservation) => reservation,
        Err(response) => return *response,
    };
    request.extensions_mut().insert(caller);
    crate::mcp_sessions::creating(reservation, next.run(request)).await
}

/// A place for a session of `caller` (created or restored), or the 429
/// naming the bound that refuses it.
fn reserve(
    endpoint: &Arc<Endpoint>,
    caller: &Caller,
    key: &str,
) -> Result<crate::mcp_sessions::Reservation, Box<Response>> {
    endpoint.mcp_sessions.reserve(caller, key).map_err(|full| {
        refused(full.reason());
        tracing::info!(
            tenant = %caller.tenant, key_id = %caller.key_id, limit = %full.limit(),
            "mcp session refused: the bound is reached"
        );
        let mut response = http_error(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many",
            full.message(),
            full.limit(),
        );
        response.headers_mut().insert(
            header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
        Box::new(response)
    })
}

fn session_not_found() -> Response {
    tenant_keys::error_response(
        StatusCode::NOT_FOUND,
        "session_not_found",
        "no such MCP session for this tenant key",
    )
}

/// An `HttpErrorReply` naming the limit that refused the request.
fn http_error(status: StatusCode, code: &str, message: String, limit: &str) -> Response {
    let error = ctxsync_proto::v1::HttpErrorReply {
        error: Some(ctxsync_proto::v1::HttpError {
            code: code.to_owned(),
            message,
            limit: limit.to_owned(),
        }),
    };
    axum::response::IntoResponse::into_response((status, axum::Json(error)))
}

/// The caller the key check put into the HTTP request's extensions.
fn caller_of(extensions: &Extensions) -> Result<Caller, ErrorData> {
    extensions
        .get::<axum::http::request::Parts>()
        .and_then(|parts| parts.extensions.get::<Caller>())
        .cloned()
        .ok_or_else(|| ErrorData::internal_error("the request carries no verified caller", None))
}

/// A pinned tool as offered to MCP clients (named `server__tool`).
struct Offered {
    server: String,
    /// The server's own name of the tool.
    name: String,
    tool: Tool,
}

/// A pinned prompt as offered (named `server__prompt`).
struct OfferedPrompt {
    server: String,
    name: String,
    prompt: Prompt,
}

/// A pinned resource as offered (by its own URI).
struct OfferedResource {
    server: String,
    resource: Resource,
}

/// A pinned resource template as offered (its own URI template).
struct OfferedTemplate {
    server: String,
    template: ResourceTemplate,
}

/// The catalog session an MCP session is bound to at `initialize`, or a
/// stateless request to by its pin handle (then `session_id` is the handle).
struct Bound {
    tenant: String,
    session_id: String,
    /// Pinned for stateless requests: shared, so no request's end ends it.
    stateless: bool,
    /// Each pinned server's id and catalog hash (the failed left out).
    pinned: Vec<(String, String)>,
    tools: Vec<Offered>,
    prompts: Vec<OfferedPrompt>,
    resources: Vec<OfferedResource>,
    templates: Vec<OfferedTemplate>,
}

/// What a stateless request is answered from.
struct Stateless {
    bound: Arc<Bound>,
    /// How long its lists stay true (their `ttlMs`).
    fresh_for: std::time::Duration,
}

impl Bound {
    /// The pins of a preparation as offered to MCP clients.
    fn of(
        tenant: &str,
        session_id: &str,
        pins: &[ctxsync_proto::v1::CatalogPin],
        stateless: bool,
    ) -> Self {
        let pins_all = pins;
        let pins: Vec<_> = pins
            .iter()
            .filter(|pin| pin.source() != Source::Failed)
            .collect();
        // A name two pins offer (a collision a live discovery brought) is
        // served by the first in configured order, like a resource URI.
        let mut tools: Vec<Offered> = Vec::new();
        let mut prompts: Vec<OfferedPrompt> = Vec::new();
        for pin in &pins {
            let rule = NameRule::of_pin(pin.naming.as_ref(), &pin.server_id);
            for tool in &pin.tools {
                let offered = rule.offered(&tool.name);
                if tools.iter().any(|t| t.tool.name == offered) {
                    tracing::debug!(server = %pin.server_id, name = %offered, "tool name offered by an earlier server");
                    continue;
                }
                tools.push(Offered {
                    server: pin.server_id.clone(),
                    name: tool.name.clone(),
                    tool: Tool::new(
                        offered,
                        tool.description.clone(),
                        schema_of(&tool.input_schema_json),
                    ),
                });
            }
            for prompt in &pin.prompts {
                let mut declared = declared_prompt(prompt);
                declared.name = rule.offered(&prompt.name);
                if prompts.iter().any(|p| p.prompt.name == declared.name) {
                    tracing::debug!(server = %pin.server_id, name = %declared.name, "prompt name offered by an earlier server");
                    continue;
                }
                prompts.push(OfferedPrompt {
                    server: pin.server_id.clone(),
                    name: prompt.name.clone(),
                    prompt: declared,
                });
            }
        }
        let mut resources: Vec<OfferedResource> = Vec::new();
        let mut templates: Vec<OfferedTemplate> = Vec::new();
        for pin in &pins {
            for resource in &pin.resources {
                if resource.template {
                    if templates
                        .iter()
                        .any(|t| t.template.uri_template == resource.uri)
                    {
                        continue;
                    }
                    templates.push(OfferedTemplate {
                        server: pin.server_id.clone(),
                        template: declared_template(resource),
                    });
                    continue;
                }
                // Two servers declaring one URI: the first in configured order serves it.
                if resources.iter().any(|r| r.resource.uri == resource.uri) {
                    tracing::debug!(server = %pin.server_id, uri = %resource.uri, "resource uri offered by an earlier server");
                    continue;
                }
                resources.push(OfferedResource {
                    server: pin.server_id.clone(),
                    resource: declared_resource(resource),
                });
            }
        }
        Self {
            tenant: tenant.to_owned(),
            session_id: session_id.to_owned(),
            stateless,
            pinned: crate::prepare::pinned_hashes(pins_all),
            tools,
            prompts,
            resources,
            templates,
        }
    }

    /// The server a read of `uri` goes to: the resource's, else the first
    /// template's that `uri` expands.
    fn resource_server(&self, uri: &str) -> Option<&str> {
        let exact = self.resources.iter().find(|o| o.resource.uri == uri);
        let templated = || {
            self.templates
                .iter()
                .find(|o| uri_template::matches(&o.template.uri_template, uri))
        };
        match exact {
            Some(offered) => Some(&offered.server),
            None => templated().map(|o| o.server.as_str()),
        }
    }

    /// A catalog call of this session to `server` (the caller names what).
    fn call(&self, server: &str) -> CatalogCallRequest {
        CatalogCallRequest {
            tenant: self.tenant.clone(),
            session_id: self.session_id.clone(),
            server_id: server.to_owned(),
            ..Default::default()
        }
    }
}

/// A withdrawal's key: the server and the item's name (or URI).
fn key(server: &str, name: &str) -> (String, String) {
    (server.to_owned(), name.to_owned())
}

/// Which lists a change of the withdrawals touched.
#[derive(Debug, Clone, Copy, Default)]
struct ListsChanged {
    tools: bool,
    prompts: bool,
    resources: bool,
}

/// One MCP session's state; its drop ends the catalog session.
struct SessionState {
    endpoint: Arc<Endpoint>,
    bound: OnceLock<Arc<Bound>>,
    /// A stateless request's list freshness (set with `bound`).
    fresh_for: OnceLock<std::time::Duration>,
    /// Whether the session's change watcher runs.
    watching: std::sync::atomic::AtomicBool,
    /// The withdrawals the client's last lists left out (or it was told
    /// changed).
    announced: Mutex<Withdrawn>,
    /// Cancelled when the session ends: stops its watcher.
    ended: CancellationToken,
    /// The client, as upstreams reach it (held here: the connections it
    /// follows hold it weakly, so it goes with the session).
    client: OnceLock<Arc<relay::Client>>,
    /// The MCP session's id (a 2025 session's, set at `initialize`).
    mcp_session_id: OnceLock<String>,
}

impl SessionState {
    /// The client behind a 2025 session, reached through `peer`.
    fn session_client(&self, peer: &Peer<RoleServer>) -> Arc<relay::Client> {
        self.client
            .get_or_init(|| Arc::new(relay::Client::of(peer, false)))
            .clone()
    }

    /// Remembers `withdrawn` as what the client knows; which lists it changes.
    fn announce(&self, withdrawn: Withdrawn) -> ListsChanged {
        let mut announced = self.announced.lock().expect("announced lock");
        let news = ListsChanged {
            tools: announced.tools != withdrawn.tools,
            prompts: announced.prompts != withdrawn.prompts,
            resources: announced.resources != withdrawn.resources,
        };
        *announced = withdrawn;
        news
    }
}

impl Drop for SessionState {
    fn drop(&mut self) {
        self.ended.cancel();
        if let Some(id) = self.mcp_session_id.get() {
            self.endpoint.direct.forget(id);
        }
        let Some(bound) = self.bound.take() else {
            return;
        };
        if bound.stateless {
            return;
        }
        metrics::gauge!("ctxsync_catalog_mcp_sessions").decrement(1.0);
        let sessions = self.endpoint.commands.sessions.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let released = sessions.end(&bound.tenant, &bound.session_id).await;
                tracing::info!(tenant = %bound.tenant, session = %bound.session_id, released, "mcp session ended");
            });
        }
    }
}

/// The MCP server of one session.
#[derive(Clone)]
pub(crate) struct McpSession {
    endpoint: Arc<Endpoint>,
    state: Arc<SessionState>,
}

impl McpSession {
    fn new(endpoint: Arc<Endpoint>) -> Self {
        Self {
            state: Arc::new(SessionState {
                endpoint: endpoint.clone(),
                bound: OnceLock::new(),
                fresh_for: OnceLock::new(),
                watching: std::sync::atomic::AtomicBool::new(false),
                announced: Mutex::default(),
                ended: CancellationToken::new(),
                client: OnceLock::new(),
                mcp_session_id: OnceLock::new(),
            }),
            endpoint,
        }
    }

    /// The pins the request is answered from, for its own tenant only: the
    /// session's, or a stateless request's (by its handle, else the memory's).
    async fn bound(&self, context: &RequestContext<RoleServer>) -> Result<&Bound, ErrorData> {
        let caller = caller_of(&context.extensions)?;
        if self.state.bound.get().is_none() && is_stateless(context) {
            let stateless = self.endpoint.stateless(&caller, &context.meta).await?;
            let _ = self.state.fresh_for.set(stateless.fresh_for);
            let _ = self.state.bound.set(stateless.bound);
        }
        let bound =
            self.state.bound.get().ok_or_else(|| {
                ErrorData::invalid_request("the session is not initialized", None)
            })?;
        if bound.tenant != caller.tenant {
            refused("other_tenant");
            return Err(ErrorData::invalid_request(
                "no such MCP session for this tenant key",
                None,
            ));
        }
        Ok(bound)
    }

    async fn withdrawn(&self, bound: &Bound) -> Withdrawn {
        withdrawn(&self.endpoint, bound).await
    }

    /// A catalog call for the session, then the lists that changed under
    /// the client meanwhile are announced to it (a session's only: a
    /// stateless client hears of changes through `subscriptions/listen`).
    async fn relay(
        &self,
        bound: &Bound,
        call: CatalogCallRequest,
        context: &RequestContext<RoleServer>,
    ) -> CatalogCallReply {
        let relay = self.relay_for(context);
        announced_call(
            &self.endpoint,
            &self.state,
            &context.peer,
            bound,
            call,
            relay,
        )
        .await
        .0
    }

    /// A stateless client's call: what its server asks meanwhile comes back
    /// to it as input rounds (`relay::InputRounds`); `retry` is a round's
    /// answer (its `requestState` and `inputResponses`).
    async fn call_in_rounds(
        &self,
        bound: &Bound,
        call: CatalogCallRequest,
        retry: Option<(String, rmcp::model::InputResponses)>,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let rounds = &self.endpoint.rounds;
        let progress = context
            .meta
            .get_progress_token()
            .map(|token| (context.peer.clone(), token));
        let round = match retry {
            Some((state, responses)) => {
                rounds
                    .resume(&bound.tenant, &state, responses, &context.ct, progress)
                    .await?
            }
            None => {
                let (steps, next) = tokio::sync::mpsc::channel(1);
                let capabilities = context.meta.client_capabilities().unwrap_or_default();
                let cancel = CancellationToken::new();
                let client = Arc::new(relay::RoundClient::new(&capabilities, steps.clone()));
                client.asked_by(progress);
                let relay = Relay {
                    downstream: client.clone(),
                    origin: None,
                    // Routes the call's progress; `RoundClient` sends it
                    // with the open request's own token.
                    progress_token: context.meta.get_progress_token(),
                    cancelled: cancel.clone(),
                };
                // The call outlives this request when it asks a round.
                let endpoint = self.endpoint.clone();
                tokio::spawn(async move {
                    let reply = endpoint
                        .commands
                        .call
                        .handle_relayed(call, Some(relay))
                        .await;
                    let _ = steps.send(relay::Step::Done(reply)).await;
                });
                rounds
                    .next(&bound.tenant, next, cancel, &context.ct, client)
                    .await?
            }
        };
        Ok(match round {
            relay::Round::Done(reply) => result_of(reply).into(),
            relay::Round::Ask {
                requests,
                request_state,
            } => CallToolResponse::InputRequired(rmcp::model::InputRequiredResult::new(
                Some(requests),
                Some(request_state),
            )),
        })
    }

    /// The client behind the session (or the stateless request).
    fn client(&self, context: &RequestContext<RoleServer>) -> Arc<relay::Client> {
        if !is_stateless(context) {
            return self.state.session_client(&context.peer);
        }
        self.state
            .client
            .get_or_init(|| Arc::new(relay::Client::of(&context.peer, true)))
            .clone()
    }

    /// What the upstream sends during `context`'s request reaches its client.
    fn relay_for(&self, context: &RequestContext<RoleServer>) -> Relay {
        Relay {
            downstream: self.client(context),
            origin: Some(context.id.clone()),
            progress_token: context.meta.get_progress_token(),
            cancelled: context.ct.clone(),
        }
    }

    /// The session's connection to `server`, started on this first use.
    async fn used(&self, bound: &Bound, server: &str) -> Result<crate::call::Used, ErrorData> {
        self.endpoint
            .commands
            .call
            .connection(&bound.tenant, &bound.session_id, server)
            .await
            .map_err(|reply| match reply.error {
                Some(error) => rpc_error(&error),
                None => ErrorData::internal_error("the server cannot be used", None),
            })
    }

    /// One page of what `pick` keeps of the session's pins (less the
    /// withdrawals, which the client now knows), the next cursor, and for a
    /// stateless request the list's hints.
    async fn listed<T: Clone>(
        &self,
        request: Option<PaginatedRequestParams>,
        context: &RequestContext<RoleServer>,
        pick: impl FnOnce(&Bound, &Withdrawn) -> Vec<T>,
    ) -> Result<Listed<T>, ErrorData> {
        let bound = self.bound(context).await?;
        let withdrawn = self.withdrawn(bound).await;
        let items = pick(bound, &withdrawn);
        self.state.announce(withdrawn);
        let cursor = request.and_then(|r| r.cursor);
        let (items, next) = page(&items, cursor.as_deref(), self.endpoint.page_size)?;
        let hints = bound.stateless.then(|| Hints {
            handle: bound.session_id.clone(),
            fresh_for: self.state.fresh_for.get().copied().unwrap_or_default(),
        });
        Ok(Listed { items, next, hints })
    }

    /// Binds the catalog session named after the MCP session (`mcp-<id>`):
    /// a restore's replay on another replica finds the same pins.
    async fn prepare(&self, caller: Caller, mcp_session: Option<&str>) -> Result<(), ErrorData> {
        if let Some(id) = mcp_session {
            let _ = self.state.mcp_session_id.set(id.to_owned());
        }
        let session_id = match mcp_session {
            Some(id) => format!("mcp-{id}"),
            None => format!("mcp-{}", uuid::Uuid::new_v4()),
        };
        let reply = self
            .endpoint
            .commands
            .prepare
            .handle(CatalogPrepareRequest {
                tenant: caller.tenant.clone(),
                session_id: session_id.clone(),
            })
            .await;
        if let Some(error) = reply.error {
            return Err(prepare_failed(&error));
        }
        let bound = Bound::of(&caller.tenant, &session_id, &reply.pins, false);
        if self.state.bound.set(Arc::new(bound)).is_ok() {
            metrics::gauge!("ctxsync_catalog_mcp_sessions").increment(1.0);
        }
        Ok(())
    }
}

/// The catalog call of `request`: its tool named as the server names it,
/// or the tool error of a tool the session did not pin.
fn offered_call(
    bound: &Bound,
    request: CallToolRequestParams,
) -> Result<CatalogCallRequest, CallToolResult> {
    let name = request.name.as_ref();
    let Some(offered) = bound.tools.iter().find(|o| o.tool.name == name) else {
        return Err(result_of(CatalogCallReply {
            error: crate::request::error(
                catalog_core::ErrorCode::tool(catalog_core::ItemError::NotFound),
                format!("tool {name:?} is not in this session's pins"),
            ),
            ..Default::default()
        }));
    };
    let arguments = request.arguments.unwrap_or_default();
    Ok(CatalogCallRequest {
        tool: offered.name.clone(),
        arguments_json: serde_json::Value::Object(arguments).to_string(),
        ..bound.call(&offered.server)
    })
}

/// A `tools/call` of a 2025 session, however it reached the endpoint
/// (rmcp's session worker, or `direct`): the catalog call, then the lists
/// that changed under the client meanwhile announced on the session. Also
/// how long the upstream server took, if the call reached it.
async fn session_tool_call(
    endpoint: &Arc<Endpoint>,
    state: &SessionState,
    peer: &Peer<RoleServer>,
    bound: &Bound,
    request: CallToolRequestParams,
    relay: Relay,
) -> (CallToolResponse, Option<std::time::Duration>) {
    let call = match offered_call(bound, request) {
        Ok(call) => call,
        Err(refused) => return (refused.into(), None),
    };
    let (reply, upstream) = announced_call(endpoint, state, peer, bound, call, relay).await;
    (result_of(reply).into(), upstream)
}

/// A catalog call for the session, then the lists that changed under the
/// client meanwhile announced to it (a session's only: a stateless client
/// hears of changes through `subscriptions/listen`). Also how long the
/// upstream server took, if the call reached it.
async fn announced_call(
    endpoint: &Endpoint,
    state: &SessionState,
    peer: &Peer<RoleServer>,
    bound: &Bound,
    call: CatalogCallRequest,
    relay: Relay,
) -> (CatalogCallReply, Option<std::time::Duration>) {
    let timed = endpoint.commands.call.handle_timed(call, Some(relay)).await;
    if !bound.stateless {
        notify_lists_changed(state.announce(withdrawn(endpoint, bound).await), peer);
    }
    timed
}

/// Which of the three lists differ between two readings of the memory.
fn lists_changed(
    before: &[(String, Arc<catalog_core::tools::Catalog>)],
    now: &[(String, Arc<catalog_core::tools::Catalog>)],
) -> ListsChanged {
    let differ =
        |same: fn(&catalog_core::tools::Catalog, &catalog_core::tools::Catalog) -> bool| {
            before.len() != now.len()
                || before
                    .iter()
                    .zip(now)
                    .any(|((a_id, a), (b_id, b))| a_id != b_id || !same(a, b))
        };
    ListsChanged {
        tools: differ(|a, b| a.tools == b.tools),
        prompts: differ(|a, b| a.prompts == b.prompts),
        resources: differ(|a, b| a.resources == b.resources),
    }
}

/// Whether the request is of a revision without sessions (2026-07-28 on).
fn is_stateless(context: &RequestContext<RoleServer>) -> bool {
    context
        .meta
        .protocol_version()
        .is_some_and(|version| !version.has_initialize())
}

/// A page of a list, and what a stateless caller is told about it.
struct Listed<T> {
    items: Vec<T>,
    next: Option<String>,
    hints: Option<Hints>,
}

/// A stateless list's pin handle and freshness.
struct Hints {
    handle: String,
    fresh_for: std::time::Duration,
}

impl Hints {
    /// The result's `_meta` (the handle), `ttlMs` and `cacheScope`: private,
    /// since the pins are the tenant's whose key asked.
    fn apply(
        hints: Option<Self>,
        meta: &mut Option<rmcp::model::MetaObject>,
        ttl_ms: &mut Option<u64>,
        cache_scope: &mut Option<rmcp::model::CacheScope>,
    ) {
        let Some(hints) = hints else { return };
        let mut object = rmcp::model::MetaObject::new();
        object
            .0
            .insert(PIN_HANDLE_META.to_owned(), json!(hints.handle));
        *meta = Some(object);
        *ttl_ms = Some(u64::try_from(hints.fresh_for.as_millis()).unwrap_or(u64::MAX));
        *cache_scope = Some(rmcp::model::CacheScope::Private);
    }
}

/// A preparation's error as the JSON-RPC error of the request that needed it.
fn prepare_failed(error: &ServiceError) -> ErrorData {
    ErrorData::internal_error(
        format!("{}: {}", error.reason, error.message),
        Some(json!({"code": error.reason})),
    )
}

/// A pin handle the catalog cannot answer from: invalid params, coded as an
/// unprepared session.
fn handle_refused(message: String) -> ErrorData {
    ErrorData::invalid_params(
        message,
        Some(json!({"code": catalog_core::ErrorCode::SessionNotPrepared.as_str()})),
    )
}

/// What the catalog session's open servers withdrew since the pins.
async fn withdrawn(endpoint: &Endpoint, bound: &Bound) -> Withdrawn {
    endpoint
        .commands
        .sessions
        .withdrawn(&bound.tenant, &bound.session_id)
        .await
}

/// A pinned prompt's declaration as the server gave it (its name, description
/// and nothing else if the stored text is not a prompt).
fn declared_prompt(pinned: &ctxsync_proto::v1::McpPrompt) -> Prompt {
    serde_json::from_str(&pinned.declaration_json).unwrap_or_else(|_| {
        Prompt::new(
            pinned.name.clone(),
            Some(pinned.description.clone()).filter(|d| !d.is_empty()),
            None,
        )
    })
}

/// A pinned resource's declaration as the server gave it, with its pinned URI.
fn declared_resource(pinned: &ctxsync_proto::v1::McpResource) -> Resource {
    let mut declared: Resource = serde_json::from_str(&pinned.declaration_json)
        .unwrap_or_else(|_| Resource::new(pinned.uri.clone(), pinned.name.clone()));
    declared.uri.clone_from(&pinned.uri);
    declared
}

fn declared_template(pinned: &ctxsync_proto::v1::McpResource) -> ResourceTemplate {
    let mut declared: ResourceTemplate = serde_json::from_str(&pinned.declaration_json)
        .unwrap_or_else(|_| ResourceTemplate::new(pinned.uri.clone(), pinned.name.clone()));
    declared.uri_template.clone_from(&pinned.uri);
    declared
}

/// Sends the `notifications/*/list_changed` of the lists that changed,
/// without holding up the caller.
fn notify_lists_changed(changed: ListsChanged, peer: &Peer<RoleServer>) {
    for (list, is_changed) in [
        ("tools", changed.tools),
        ("prompts", changed.prompts),
        ("resources", changed.resources),
    ] {
        if !is_changed {
            continue;
        }
        metrics::counter!("ctxsync_catalog_mcp_list_changed_total", "list" => list).increment(1);
        let peer = peer.clone();
        tokio::spawn(async move {
            let sent = match list {
                "tools" => peer.notify_tool_list_changed().await,
                "prompts" => peer.notify_prompt_list_changed().await,
                _ => peer.notify_resource_list_changed().await,
            };
            if let Err(error) = sent {
                tracing::debug!(%error, list, "cannot send a list_changed notification");
            }
        });
    }
}

/// Until the session ends: when one of its open servers says its tools,
/// prompts or resources changed, re-lists it and tells the client of the
/// lists that withdrew something.
async fn watch_changes(
    endpoint: Arc<Endpoint>,
    state: std::sync::Weak<SessionState>,
    peer: Peer<RoleServer>,
    ended: CancellationToken,
) {
    let Some((tenant, session_id)) = state.upgrade().and_then(|s| {
        s.bound
            .get()
            .map(|b| (b.tenant.clone(), b.session_id.clone()))
    }) else {
        return;
    };
    let session = match endpoint
        .commands
        .sessions
        .get_or_load(&endpoint.commands.pool, &tenant, &session_id)
        .await
    {
        Ok(Some(session)) => session,
        Ok(None) => return,
        Err(error) => {
            tracing::warn!(error = %ctxsync_runtime::db::describe(&error), "cannot follow an mcp session's servers");
            return;
        }
    };
    let mut changes = session.changes();
    loop {
        tokio::select! {
            () = ended.cancelled() => break,
            changed = changes.changed() => if changed.is_err() { break },
        }
        refresh_changed(&endpoint, &session, &tenant, &session_id).await;
        let Some(state) = state.upgrade() else { break };
        let Some(bound) = state.bound.get() else {
            break;
        };
        notify_lists_changed(state.announce(withdrawn(&endpoint, bound).await), &peer);
    }
}

/// Re-lists the session's open servers that said their lists changed.
async fn refresh_changed(
    endpoint: &Endpoint,
    session: &crate::sessions::Session,
    tenant: &str,
    session_id: &str,
) {
    for server in session.servers_changed() {
        endpoint
            .commands
            .call
            .refresh(session, tenant, session_id, &server)
            .await;
    }
}

/// A tool's input schema as an object; anything else offers an empty object schema.
fn schema_of(json: &str) -> Arc<JsonObject> {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(map)) => Arc::new(map),
        _ => Arc::new(
            json!({"type": "object"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        ),
    }
}

/// One page of `items` after `cursor` (an offset), and the next cursor.
pub(crate) fn page<T: Clone>(
    items: &[T],
    cursor: Option<&str>,
    size: usize,
) -> Result<(Vec<T>, Option<String>), ErrorData> {
    let start = match cursor {
        None => 0,
        Some(cursor) => cursor
            .parse::<usize>()
            .ok()
            .filter(|start| *start <= items.len())
            .ok_or_else(|| ErrorData::invalid_params("unknown cursor", None))?,
    };
    let end = (start + size).min(items.len());
    let next = (end < items.len()).then(|| end.to_string());
    Ok((items[start..end].to_vec(), next))
}

/// A catalog answer as an MCP tool result.
fn result_of(reply: CatalogCallReply) -> CallToolResult {
    if let Some(error) = reply.error {
        let mut result = CallToolResult::error(vec![ContentBlock::text(format!(
            "{}: {}",
            error.reason, error.message
        ))]);
        result.structured_content =
            Some(json!({"error": {"code": error.reason, "message": error.message}}));
        return result;
    }
    let content = serde_json::from_str::<Vec<ContentBlock>>(&reply.content_json)
        .unwrap_or_else(|_| vec![ContentBlock::text(reply.content_json)]);
    if reply.is_error {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    }
}

/// A catalog error as the JSON-RPC error of `prompts/get` or `resources/read`:
/// a prompt not there is invalid params, a resource not there MCP's own
/// "resource not found"; the catalog's name of it in `data.code`.
fn rpc_error(error: &ServiceError) -> ErrorData {
    use catalog_core::{ErrorCode as Catalog, ItemError, ItemKind};
    let rpc_code = match Catalog::of(error) {
        Some(Catalog::Item(ItemKind::Resource, ItemError::NotFound | ItemError::Withdrawn)) => {
            ErrorCode::RESOURCE_NOT_FOUND
        }
        Some(
            Catalog::Item(_, ItemError::NotFound | ItemError::Withdrawn) | Catalog::RequestInvalid,
        ) => ErrorCode::INVALID_PARAMS,
        _ => ErrorCode::INTERNAL_ERROR,
    };
    let reason = error.reason.as_str();
    ErrorData::new(
        rpc_code,
        format!("{reason}: {}", error.message),
        Some(json!({"code": reason, "message": error.message})),
    )
}

/// The error of a prompt or resource the session did not pin.
fn not_pinned(kind: catalog_core::ItemKind, message: String) -> ErrorData {
    let code = catalog_core::ErrorCode::Item(kind, catalog_core::ItemError::NotFound);
    rpc_error(&catalog_core::request::Refusal::new(code, message).to_proto())
}

/// A prompt's or resource's result as the catalog relayed it (its JSON text).
fn relayed<T: serde::de::DeserializeOwned>(reply: CatalogCallReply) -> Result<T, ErrorData> {
    if let Some(error) = &reply.error {
        return Err(rpc_error(error));
    }
    serde_json::from_str(&reply.content_json).map_err(|e| {
        ErrorData::internal_error(format!("the server's result cannot be relayed: {e}"), None)
    })
}

fn counted(method: &'static str) {
    metrics::counter!("ctxsync_catalog_mcp_requests_total", "method" => method).increment(1);
}

impl ServerHandler for McpSession {
    fn get_info(&self) -> ServerConfig {
        #[allow(deprecated)] // Logging: relayed for 2025 clients (see the import).
        let capabilities = ServerCapabilities::builder()
            .enable_completions()
            .enable_logging()
            .enable_prompts()
            .enable_prompts_list_changed()
            .enable_resources()
            .enable_resources_list_changed()
            .enable_resources_subscribe()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        let server = Implementation::new("ctxsync-catalog", env!("CARGO_PKG_VERSION"));
        ServerConfig::new(capabilities).with_server_info(server)
    }

    /// Both eras: the versions with sessions (`initialize` binds a catalog
    /// session) and 2026-07-28 (stateless requests, pinned by handle).
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::KNOWN_VERSIONS)
    }

    /// Every revision served, newest first.
    async fn discover(
        &self,
        _context: RequestContext<RoleServer>,
    ) -> Result<DiscoverResult, ErrorData> {
        counted("server/discover");
        let mut versions = self.supported_protocol_versions().into_owned();
        versions.sort_by(|a, b| b.as_str().cmp(a.as_str()));
        Ok(DiscoverResult::from_server_info(versions, self.get_info()))
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        counted("initialize");
        let caller = caller_of(&context.extensions)?;
        let started = Instant::now();
        let mcp_session = context
            .extensions
            .get::<crate::mcp_sessions::McpSessionId>()
            .map(|id| id.0.to_string());
        self.prepare(caller, mcp_session.as_deref()).await?;
        metrics::histogram!("ctxsync_catalog_mcp_initialize_seconds")
            .record(started.elapsed().as_secs_f64());
        context.peer.set_peer_info(request.clone());
        // Before the client learns the session's id: its first call finds it.
        if let Some(id) = self.state.mcp_session_id.get() {
            let direct = self
                .endpoint
                .direct
                .register(id, &self.state, &context.peer);
            tracing::debug!(mcp_session = %id, direct, "mcp session bound");
        }
        self.negotiate_initialize(&request)
    }

    /// A client's progress on a question a server asked it goes back there.
    async fn on_progress(
        &self,
        progress: rmcp::model::ProgressNotificationParam,
        _context: NotificationContext<RoleServer>,
    ) {
        if let Some(client) = self.state.client.get() {
            client.progress_back(progress).await;
        }
    }

    /// The owner was bound at the session's creation (`mcp_sessions`): the
    /// notification only starts following the session's servers.
    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        let watching = &self.state.watching;
        if !watching.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tokio::spawn(watch_changes(
                self.endpoint.clone(),
                Arc::downgrade(&self.state),
                context.peer.clone(),
                self.state.ended.clone(),
            ));
        }
    }

    /// Changes of the three lists, as the memory learns them.
    fn accepted_subscription_filter(
        &self,
        _requested: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        Some(
            SubscriptionFilter::builder()
                .tools_list_changed()
                .prompts_list_changed()
                .resources_list_changed()
                .build(),
        )
    }

    /// Until the client ends it: whenever the memory's lists for the
    /// caller's tenant change (a live discovery found them different, on any
    /// replica), and, for a listen carrying a pin handle, whenever a server
    /// this replica opened for those pins withdraws something, the lists
    /// that changed are announced.
    async fn listen(&self, context: SubscriptionContext) -> Result<(), ErrorData> {
        counted("subscriptions/listen");
        let request = context.request_context();
        let caller = caller_of(&request.extensions)?;
        let tenant = caller.tenant.as_str();
        let commands = &self.endpoint.commands;
        let mut memory_changes = commands.prepare.memory_changes();
        let lists_now = || {
            commands
                .prepare
                .snapshot(tenant)
                .ok()
                .and_then(|s| s.lists())
        };
        let mut last = lists_now();
        let handle = request
            .meta
            .0
            .0
            .get(PIN_HANDLE_META)
            .and_then(|value| catalog_core::hints::valid_handle(value).ok())
            .map(str::to_owned);
        let pinned = match &handle {
            Some(handle) => commands
                .sessions
                .get_or_load(&commands.pool, tenant, handle)
                .await
                .ok()
                .flatten(),
            None => None,
        };
        let mut pin_changes = pinned.as_ref().map(|session| session.changes());
        let mut announced = match &handle {
            Some(handle) => commands.sessions.withdrawn(tenant, handle).await,
            None => Withdrawn::default(),
        };
        loop {
            let pin_changed = async {
                match &mut pin_changes {
                    Some(changes) => changes.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let changed = tokio::select! {
                () = context.cancelled() => return Ok(()),
                changed = memory_changes.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    // While a server must be discovered its lists are not known yet.
                    let Some(now) = lists_now() else { continue };
                    let changed = last
                        .as_ref()
                        .map_or(ListsChanged::default(), |before| lists_changed(before, &now));
                    last = Some(now);
                    changed
                }
                alive = pin_changed => {
                    let (Some(session), Some(handle), true) = (&pinned, &handle, alive) else {
                        pin_changes = None;
                        continue;
                    };
                    refresh_changed(&self.endpoint, session, tenant, handle).await;
                    let withdrawn = commands.sessions.withdrawn(tenant, handle).await;
                    let changed = ListsChanged {
                        tools: announced.tools != withdrawn.tools,
                        prompts: announced.prompts != withdrawn.prompts,
                        resources: announced.resources != withdrawn.resources,
                    };
                    announced = withdrawn;
                    changed
                }
            };
            for (list, is_changed, notification) in [
                (
                    "tools",
                    changed.tools,
                    ServerNotification::ToolListChangedNotification(Default::default()),
                ),
                (
                    "prompts",
                    changed.prompts,
                    ServerNotification::PromptListChangedNotification(Default::default()),
                ),
                (
                    "resources",
                    changed.resources,
                    ServerNotification::ResourceListChangedNotification(Default::default()),
                ),
            ] {
                if !is_changed {
                    continue;
                }
                metrics::counter!("ctxsync_catalog_mcp_list_changed_total", "list" => list)
                    .increment(1);
                if context.sink().send(notification).await.is_err() {
                    return Ok(());
                }
            }
        }
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        counted("tools/list");
        let listed = self
            .listed(request, &context, |bound, withdrawn| {
                let offered = bound.tools.iter();
                let kept = offered.filter(|o| !withdrawn.tools.contains(&key(&o.server, &o.name)));
                kept.map(|o| o.tool.clone()).collect()
            })
            .await?;
        let mut result = ListToolsResult::with_all_items(listed.items);
        result.next_cursor = listed.next;
        Hints::apply(
            listed.hints,
            &mut result.meta,
            &mut result.ttl_ms,
            &mut result.cache_scope,
        );
        Ok(result)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        counted("tools/call");
        let bound = self.bound(&context).await?;
        if !is_stateless(&context) {
            let relay = self.relay_for(&context);
            let (response, _) = session_tool_call(
                &self.endpoint,
                &self.state,
                &context.peer,
                bound,
                request,
                relay,
            )
            .await;
            return Ok(response);
        }
        let mut request = request;
        let retry = request
            .request_state
            .take()
            .map(|state| (state, request.input_responses.take().unwrap_or_default()));
        let call = match offered_call(bound, request) {
            Ok(call) => call,
            Err(refused) => return Ok(refused.into()),
        };
        self.call_in_rounds(bound, call, retry, &context).await
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        counted("prompts/list");
        let listed = self
            .listed(request, &context, |bound, withdrawn| {
                let offered = bound.prompts.iter();
                let kept =
                    offered.filter(|o| !withdrawn.prompts.contains(&key(&o.server, &o.name)));
                kept.map(|o| o.prompt.clone()).collect()
            })
            .await?;
        let mut result = ListPromptsResult::with_all_items(listed.items);
        result.next_cursor = listed.next;
        Hints::apply(
            listed.hints,
            &mut result.meta,
            &mut result.ttl_ms,
            &mut result.cache_scope,
        );
        Ok(result)
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        counted("prompts/get");
        let bound = self.bound(&context).await?;
        let Some(offered) = bound.prompts.iter().find(|o| o.prompt.name == request.name) else {
            return Err(not_pinned(
                catalog_core::ItemKind::Prompt,
                format!("prompt {:?} is not in this session's pins", request.name),
            ));
        };
        let arguments = request.arguments.unwrap_or_default();
        let call = CatalogCallRequest {
            prompt: offered.name.clone(),
            arguments_json: serde_json::Value::Object(arguments).to_string(),
            ..bound.call(&offered.server)
        };
        let reply = self.relay(bound, call, &context).await;
        relayed::<GetPromptResult>(reply).map(GetPromptResponse::from)
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        counted("resources/list");
        let listed = self
            .listed(request, &context, |bound, withdrawn| {
                let offered = bound.resources.iter();
                let kept = offered.filter(|o| {
                    !withdrawn
                        .resources
                        .contains(&key(&o.server, &o.resource.uri))
                });
                kept.map(|o| o.resource.clone()).collect()
            })
            .await?;
        let mut result = ListResourcesResult::with_all_items(listed.items);
        result.next_cursor = listed.next;
        Hints::apply(
            listed.hints,
            &mut result.meta,
            &mut result.ttl_ms,
            &mut result.cache_scope,
        );
        Ok(result)
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        counted("resources/read");
        let bound = self.bound(&context).await?;
        let Some(server) = bound.resource_server(&request.uri) else {
            return Err(not_pinned(
                catalog_core::ItemKind::Resource,
                format!("resource {:?} is not in this session's pins", request.uri),
            ));
        };
        let call = CatalogCallRequest {
            resource_uri: request.uri.clone(),
            ..bound.call(server)
        };
        let reply = self.relay(bound, call, &context).await;
        relayed::<ReadResourceResult>(reply).map(ReadResourceResponse::from)
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        counted("resources/templates/list");
        let listed = self
            .listed(request, &context, |bound, withdrawn| {
                let offered = bound.templates.iter();
                let kept = offered.filter(|o| {
                    !withdrawn
                        .resources
                        .contains(&key(&o.server, &o.template.uri_template))
                });
                kept.map(|o| o.template.clone()).collect()
            })
            .await?;
        let mut result = ListResourceTemplatesResult::with_all_items(listed.items);
        result.next_cursor = listed.next;
        Hints::apply(
            listed.hints,
            &mut result.meta,
            &mut result.ttl_ms,
            &mut result.cache_scope,
        );
        Ok(result)
    }

    /// A prompt's argument by its offered name, or a resource template's,
    /// completed by the server that declared it (started if needed).
    async fn complete(
        &self,
        mut request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        counted("completion/complete");
        let bound = self.bound(&context).await?;
        let server = match &mut request.r#ref {
            Reference::Prompt(prompt) => {
                let offered = bound.prompts.iter().find(|o| o.prompt.name == prompt.name);
                let Some(offered) = offered else {
                    return Err(not_pinned(
                        catalog_core::ItemKind::Prompt,
                        format!("prompt {:?} is not in this session's pins", prompt.name),
                    ));
                };
                prompt.name.clone_from(&offered.name);
                offered.server.clone()
            }
            Reference::Resource(template) => {
                let offered = bound
                    .templates
                    .iter()
                    .find(|o| o.template.uri_template == template.uri);
                let Some(offered) = offered else {
                    return Err(not_pinned(
                        catalog_core::ItemKind::Resource,
                        format!(
                            "resource template {:?} is not in this session's pins",
                            template.uri
                        ),
                    ));
                };
                offered.server.clone()
            }
            _ => {
                return Err(ErrorData::invalid_params(
                    "unknown completion reference",
                    None,
                ));
            }
        };
        let used = self.used(bound, &server).await?;
        relay::relayed("completion");
        let _relaying = used.connection.relaying(&self.relay_for(&context));
        used.connection
            .complete(request, used.timeout)
            .await
            .map_err(|error| used.error(error))
    }

    /// Subscribes the client to a pinned resource (or a URI a template
    /// expands) at its server, started if needed; its updates reach it.
    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        counted("resources/subscribe");
        let bound = self.bound(&context).await?;
        let Some(server) = bound.resource_server(&request.uri) else {
            return Err(not_pinned(
                catalog_core::ItemKind::Resource,
                format!("resource {:?} is not in this session's pins", request.uri),
            ));
        };
        let used = self.used(bound, server).await?;
        self.client(&context).subscribe(&request.uri);
        used.connection
            .subscribe(&request.uri, &self.relay_for(&context), used.timeout)
            .await
            .map_err(|error| used.error(error))
    }

    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        counted("resources/unsubscribe");
        let bound = self.bound(&context).await?;
        self.client(&context).unsubscribe(&request.uri);
        let Some(server) = bound.resource_server(&request.uri) else {
            return Ok(());
        };
        let used = self.used(bound, server).await?;
        used.connection
            .unsubscribe(&request.uri, used.timeout)
            .await
            .map_err(|error| used.error(error))
    }

    /// The client's level, applied to the servers it has open now and to
    /// each it opens later (before its first call).
    #[allow(deprecated)] // Logging: see the import.
    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        counted("logging/setLevel");
        let bound = self.bound(&context).await?;
        self.client(&context).set_level(request.level);
        let relay = self.relay_for(&context);
        let call = &self.endpoint.commands.call;
        for connection in call
            .open_connections(&bound.tenant, &bound.session_id)
            .await
        {
            connection.relay_level(&relay).await;
        }
        Ok(())
    }
}
