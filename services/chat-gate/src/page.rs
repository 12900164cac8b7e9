//! The context page: what each agent of a tenant offers a chat, live.
//!
//! `GET /ui/` serves the page (HTML, CSS and JS compiled into the binary: no
//! build step, nothing loaded from elsewhere). The page asks for a tenant key,
//! keeps it in the browser's session storage and sends it as a bearer token
//! to the JSON APIs; the tenant is always the key's:
//! * `GET /api/v1/agents?q=&after=&limit=` — the tenant's agents
//!   (`AgentListReply`), each summarised from its committed state with the
//!   same projection a first turn gets;
//! * `GET /api/v1/agents/{agent_id}/context` (in [`crate::http`]) — one
//!   agent's projection;
//! * `POST /api/v1/events/ticket` — a single-use ticket, valid
//!   [`TICKET_TTL`], for
//! * `GET /api/v1/events?ticket=…` — server-sent events (`event: agent`, a
//!   `PageEvent`) for the tenant's agents, fed by the store events the gate
//!   applies to its views (the ones that wake waiting chats); no polling.
//!   An EventSource cannot send headers and a key never goes in a URL, hence
//!   the ticket. A ticket remembers the key it was issued for: redeeming it
//!   checks that key again, and a stream ends within a second of its key's
//!   revocation (and after [`STREAM_MAX_AGE`] anyway: the page gets a new
//!   ticket). Streams per key and per tenant, and tickets per tenant, are
//!   bounded ([`PageLimits`]); past a bound the answer is 429, and one
//!   tenant's streams never take another's place.
//!
//! * `GET /api/v1/catalog?window_seconds=` — the tenant's catalog servers
//!   (pin source from memory, warm-up state) and its latency aggregates
//!   (`CatalogStatusReply`), asked of the catalog on `catalog.status.<tenant>`.
//!
//! Nothing secret is rendered: the projection holds sanitized errors and no
//! MCP config content, and the key is never echoed.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ctxsync_proto::v1::{
    AgentListReply, AgentState, AgentSummary, ChatProjection, EventTicketReply, Freshness,
    GateDecision, PageEvent,
};
use futures::StreamExt;

use crate::http::{caller, error};
use crate::nats::events::PageFeed;
use crate::nats::{AgentLister, CatalogClient, StoreReader};
use ctxsync_runtime::rpc;
use ctxsync_runtime::tenant_keys::{Caller, TenantKeys};
use gate_core::projection::{self, Readiness};
use gate_core::source::ReadError;

/// How long an event-stream ticket can be redeemed.
pub const TICKET_TTL: Duration = Duration::from_secs(30);
/// Tickets outstanding at most, all tenants together (past it a ticket is
/// refused, never another tenant's evicted).
const MAX_TICKETS: usize = 10_000;
/// Agents one stream remembers having sent (past it, it forgets them all).
const MAX_SENT: usize = 10_000;

/// The page's per-key and per-tenant bounds (their defaults are
/// chat-gate's flags': `Config::default().page_limits()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLimits {
    /// Event streams open at once with one key.
    pub streams_per_key: usize,
    /// Event streams open at once for one tenant (all its keys).
    pub streams_per_tenant: usize,
    /// Tickets outstanding at once for one tenant.
    pub tickets_per_tenant: usize,
}

/// A ticket: whose it is and the key it was issued for (checked again on
/// redemption: a key revoked meanwhile opens nothing).
struct Ticket {
    caller: Caller,
    key: String,
    issued: Instant,
}

/// Streams open now, per key id and per tenant.
#[derive(Default)]
struct OpenStreams {
    per_key: HashMap<String, usize>,
    per_tenant: HashMap<String, usize>,
}

/// One open stream's place in [`OpenStreams`], given back when the stream ends.
struct StreamSlot {
    open: Arc<Mutex<OpenStreams>>,
    caller: Caller,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().expect("stream count lock");
        let OpenStreams {
            per_key,
            per_tenant,
        } = &mut *open;
        for (map, id) in [
            (per_key, &self.caller.key_id),
            (per_tenant, &self.caller.tenant),
        ] {
            if let Some(count) = map.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    map.remove(id);
                }
            }
        }
        metrics::gauge!("ctxsync_gate_page_streams").decrement(1.0);
    }
}

/// Why the page refused to open a stream or issue a ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    StreamsPerKey,
    StreamsPerTenant,
    TicketsPerTenant,
    TicketsFull,
}

impl Refusal {
    fn reason(self) -> &'static str {
        match self {
            Self::StreamsPerKey => "streams_per_key",
            Self::StreamsPerTenant => "streams_per_tenant",
            Self::TicketsPerTenant => "tickets_per_tenant",
            Self::TicketsFull => "tickets_full",
        }
    }

    fn answer(self, limits: PageLimits) -> Response {
        let (limit, message) = match self {
            Self::StreamsPerKey => (
                "CTXSYNC_GATE_MAX_STREAMS_PER_KEY",
                format!(
                    "this key has {} event streams open, the most it may: close one",
                    limits.streams_per_key
                ),
            ),
            Self::StreamsPerTenant => (
                "CTXSYNC_GATE_MAX_STREAMS_PER_TENANT",
                format!(
                    "this tenant has {} event streams open, the most it may: close one",
                    limits.streams_per_tenant
                ),
            ),
            Self::TicketsPerTenant => (
                "CTXSYNC_GATE_MAX_TICKETS_PER_TENANT",
                format!(
                    "this tenant holds {} unredeemed event tickets, the most it may: redeem or let them expire ({} s)",
                    limits.tickets_per_tenant,
                    TICKET_TTL.as_secs()
                ),
            ),
            Self::TicketsFull => (
                "tickets",
                format!("{MAX_TICKETS} event tickets are outstanding on this gate: retry"),
            ),
        };
        metrics::counter!("ctxsync_gate_page_refused_total", "reason" => self.reason())
            .increment(1);
        too_many(limit, message)
    }
}

/// A 429 `HttpErrorReply` naming the bound, with `Retry-After`.
fn too_many(limit: &str, message: String) -> Response {
    let reply = ctxsync_proto::v1::HttpErrorReply {
        error: Some(ctxsync_proto::v1::HttpError {
            code: "too_many".to_owned(),
            message,
            limit: limit.to_owned(),
        }),
    };
    let mut response = (StatusCode::TOO_MANY_REQUESTS, axum::Json(reply)).into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
/// How long one event stream lasts before the page asks for a new ticket.
pub const STREAM_MAX_AGE: Duration = ctxsync_runtime::tenant_keys::KEY_CACHE_TTL;
/// Agents of one list answer at most.
const MAX_LIST: u32 = 200;

const INDEX_HTML: &str = include_str!("../ui/index.html");
const APP_JS: &str = include_str!("../ui/app.js");
const STYLE_CSS: &str = include_str!("../ui/style.css");

/// What the page's handlers share.
#[derive(Clone)]
pub struct Page {
    pub keys: TenantKeys,
    pub lister: AgentLister,
    pub reader: StoreReader,
    pub feed: PageFeed,
    /// The catalog, when the gate prepares catalogs.
    pub catalog: Option<CatalogClient>,
    /// Ends every stream: a shutdown is not held up by open pages.
    shutdown: tokio_util::sync::CancellationToken,
    limits: PageLimits,
    /// A map, not a cache crate's (moka): a tenant at its bound is refused,
    /// never made room for by evicting (a cache picks its victims itself,
    /// across tenants), and each issue counts the tenant's live tickets,
    /// which a cache's lazy expiry would leave stale.
    tickets: Arc<Mutex<HashMap<String, Ticket>>>,
    streams: Arc<Mutex<OpenStreams>>,
}

impl Page {
    pub fn new(
        keys: TenantKeys,
        lister: AgentLister,
        reader: StoreReader,
        feed: PageFeed,
        limits: PageLimits,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Self {
        Self {
            keys,
            lister,
            reader,
            feed,
            catalog: None,
            shutdown,
            limits,
            tickets: Arc::default(),
            streams: Arc::default(),
        }
    }

    pub fn with_catalog(mut self, catalog: CatalogClient) -> Self {
        self.catalog = Some(catalog);
        self
    }

    fn issue_ticket(&self, caller: &Caller, key: &str) -> Result<String, Refusal> {
        let ticket = format!(
            "cxt_{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let mut tickets = self.tickets.lock().expect("ticket lock");
        tickets.retain(|_, t| t.issued.elapsed() < TICKET_TTL);
        let held = tickets
            .values()
            .filter(|t| t.caller.tenant == caller.tenant)
            .count();
        if held >= self.limits.tickets_per_tenant {
            return Err(Refusal::TicketsPerTenant);
        }
        if tickets.len() >= MAX_TICKETS {
            return Err(Refusal::TicketsFull);
        }
        tickets.insert(
            ticket.clone(),
            Ticket {
                caller: caller.clone(),
                key: key.to_owned(),
                issued: Instant::now(),
            },
        );
        Ok(ticket)
    }

    /// A ticket, once: a redeemed or expired ticket is gone.
    fn redeem(&self, ticket: &str) -> Option<Ticket> {
        let mut tickets = self.tickets.lock().expect("ticket lock");
        let ticket = tickets.remove(ticket)?;
        (ticket.issued.elapsed() < TICKET_TTL).then_some(ticket)
    }

    /// A place for one more stream of `caller`, within both bounds.
    fn open_stream(&self, caller: &Caller) -> Result<StreamSlot, Refusal> {
        let mut open = self.streams.lock().expect("stream count lock");
        if open.per_key.get(&caller.key_id).copied().unwrap_or(0) >= self.limits.streams_per_key {
            return Err(Refusal::StreamsPerKey);
        }
        if open.per_tenant.get(&caller.tenant).copied().unwrap_or(0)
            >= self.limits.streams_per_tenant
        {
            return Err(Refusal::StreamsPerTenant);
        }
        *open.per_key.entry(caller.key_id.clone()).or_default() += 1;
        *open.per_tenant.entry(caller.tenant.clone()).or_default() += 1;
        metrics::gauge!("ctxsync_gate_page_streams").increment(1.0);
        Ok(StreamSlot {
            open: self.streams.clone(),
            caller: caller.clone(),
        })
    }
}

pub fn routes(page: Page) -> Router {
    Router::new()
        .route(
            "/ui",
            get(|| async { axum::response::Redirect::permanent("/ui/") }),
        )
        .route(
            "/ui/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/ui/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }),
        )
        .route("/api/v1/agents", get(list))
        .route("/api/v1/catalog", get(catalog_status))
        .route("/api/v1/events/ticket", post(ticket))
        .route("/api/v1/events", get(events))
        .with_state(page)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Nothing from elsewhere, no inline scripts, no framing.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// An agent's line in the list, from its committed state (the projection a
/// first turn would get decides phase, freshness and counts).
pub fn summary(state: &AgentState) -> AgentSummary {
    let agent = state.agent.clone().unwrap_or_default();
    let projected = projection::build(&agent.agent_id, state);
    let freshness = if state.snapshot.is_none() {
        Freshness::NoReport
    } else if agent.agent_run_id.is_empty() {
        Freshness::Legacy
    } else if projected.stale {
        Freshness::Stale
    } else {
        Freshness::Current
    };
    AgentSummary {
        agent_id: agent.agent_id,
        name: agent.name,
        workspace: agent.workspace,
        phase: projected.phase,
        freshness: freshness as i32,
        last_report_at: state.snapshot.as_ref().and_then(|s| s.received_at),
        counts: projected.counts,
        revision: state.revision,
    }
}

/// The projection `GET /api/v1/agents/{agent_id}/context` answers for `state`.
pub fn context(agent_id: &str, state: &AgentState) -> ChatProjection {
    let mut projected = projection::build(agent_id, state);
    let decision = match Readiness::of(state) {
        Readiness::Legacy => GateDecision::Legacy,
        Readiness::Ready => GateDecision::Ready,
        _ => GateDecision::NotFirstTurn,
    };
    projection::finish(&mut projected, decision, 0);
    projected
}

#[derive(serde::Deserialize)]
struct ListQuery {
    #[serde(default)]
    q: String,
    #[serde(default)]
    after: String,
    #[serde(default)]
    limit: u32,
}

/// A query string that does not parse is refused like every other bad
/// request (an `HttpErrorReply`), once the caller is known.
fn parsed<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, Box<Response>> {
    query.map(|Query(query)| query).map_err(|rejection| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!("invalid query string: {}", rejection.body_text()),
        ))
    })
}

async fn list(
    State(page): State<Page>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    let caller = match caller(&page.keys, &headers).await {
        Ok(caller) => caller,
        Err(refused) => return refused,
    };
    let query = match parsed(query) {
        Ok(query) => query,
        Err(refused) => return *refused,
    };
    let limit = match query.limit {
        0 => 50,
        n => n.min(MAX_LIST),
    };
    match page.lister.list(&caller.tenant, limit, &query.after).await {
        Ok((states, next)) => {
            let needle = query.q.to_lowercase();
            let agents = states
                .iter()
                .filter(|s| s.agent.as_ref().is_some_and(|a| a.tenant == caller.tenant))
                .map(summary)
                .filter(|s| {
                    needle.is_empty()
                        || s.name.to_lowercase().contains(&needle)
                        || s.workspace.to_lowercase().contains(&needle)
                        || s.agent_id.contains(&needle)
                })
                .collect();
            axum::Json(AgentListReply {
                agents,
                next_after_agent_id: next,
            })
            .into_response()
        }
        Err(ReadError::Invalid(message)) => error(StatusCode::BAD_REQUEST, "invalid", message),
        Err(ReadError::NotFound(message)) => error(StatusCode::NOT_FOUND, "not_found", message),
        Err(ReadError::Unavailable(message)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
        }
    }
}

#[derive(serde::Deserialize)]
struct CatalogQuery {
    #[serde(default)]
    window_seconds: u64,
}

async fn catalog_status(
    State(page): State<Page>,
    headers: HeaderMap,
    query: Result<Query<CatalogQuery>, QueryRejection>,
) -> Response {
    let caller = match caller(&page.keys, &headers).await {
        Ok(caller) => caller,
        Err(refused) => return refused,
    };
    let query = match parsed(query) {
        Ok(query) => query,
        Err(refused) => return *refused,
    };
    let Some(catalog) = &page.catalog else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            "this gate does not use a catalog",
        );
    };
    match catalog.status(&caller.tenant, query.window_seconds).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(rpc::RpcError::Service {
            reason, message, ..
        }) => {
            tracing::warn!(%reason, tenant = %caller.tenant, "catalog status failed");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!("{reason}: {message}"),
            )
        }
        Err(failure) => {
            tracing::warn!(error = %failure, tenant = %caller.tenant, "catalog did not answer a status request");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!("the catalog did not answer: {failure}"),
            )
        }
    }
}

async fn ticket(State(page): State<Page>, headers: HeaderMap) -> Response {
    let caller = match caller(&page.keys, &headers).await {
        Ok(caller) => caller,
        Err(refused) => return refused,
    };
    // Authenticated above: the header holds a well-formed key.
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| ctxsync_runtime::tenant_keys::bearer(Some(v)).ok())
        .unwrap_or_default();
    let ticket = match page.issue_ticket(&caller, key) {
        Ok(ticket) => ticket,
        Err(refusal) => return refusal.answer(page.limits),
    };
    let mut response = axum::Json(EventTicketReply {
        ticket,
        expires_in_seconds: TICKET_TTL.as_secs() as u32,
    })
    .into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[derive(serde::Deserialize)]
struct EventsQuery {
    #[serde(default)]
    ticket: String,
}

async fn events(
    State(page): State<Page>,
    query: Result<Query<EventsQuery>, QueryRejection>,
) -> Response {
    let query = match parsed(query) {
        Ok(query) => query,
        Err(refused) => return *refused,
    };
    let unknown_ticket = || {
        error(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "unknown, used or expired event ticket: get one with POST /api/v1/events/ticket",
        )
    };
    let Some(ticket) = page.redeem(&query.ticket) else {
        return unknown_ticket();
    };
    // Listening for the key's revocation starts before the key is checked
    // again, so a revocation between the check and the stream's first poll
    // still ends the stream.
    let revoked: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
        Box::pin(page.keys.until_revoked(&ticket.caller, &ticket.key));
    // The key the ticket was issued for, checked again: revoked meanwhile,
    // the ticket opens nothing.
    let bearer = format!("Bearer {}", ticket.key);
    match page.keys.authenticate(Some(&bearer)).await {
        Ok(now) if now == ticket.caller => {}
        Ok(_) | Err(ctxsync_runtime::tenant_keys::AuthError::Unknown) => return unknown_ticket(),
        Err(refusal) => return ctxsync_runtime::tenant_keys::refusal_response(refusal),
    }
    let slot = match page.open_stream(&ticket.caller) {
        Ok(slot) => slot,
        Err(refusal) => return refusal.answer(page.limits),
    };
    let tenant = ticket.caller.tenant.clone();
    let receiver = page.feed.subscribe();
    let deadline = tokio::time::Instant::now() + STREAM_MAX_AGE;
    let reader = page.reader.clone();
    let shutdown = page.shutdown.clone();
    // The first message says the stream is live: the page re-reads what it
    // shows, so nothing committed before the subscription is missed.
    let hello = futures::stream::once(async {
        Ok::<_, Infallible>(Event::default().event("ready").data("{}"))
    });
    // Each commit publishes two events (discovery and snapshot): the stream
    // sends an agent once per revision, newest only.
    let sent: HashMap<String, u64> = HashMap::new();
    // The slot lives in the stream's state: it is given back when the
    // stream ends, however it ends (the client gone included).
    let state = (receiver, sent, revoked, slot);
    let changes = futures::stream::unfold(state, move |(mut receiver, mut sent, mut revoked, slot)| {
        let (tenant, reader, shutdown) = (tenant.clone(), reader.clone(), shutdown.clone());
        async move {
            loop {
                let next = tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = &mut revoked => {
                        tracing::info!(tenant = %tenant, "event stream ended: its key was revoked");
                        return None;
                    }
                    next = tokio::time::timeout_at(deadline, receiver.recv()) => next,
                };
                let change = match next {
                    Err(_) => return None,
                    Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return None,
                    // Events were missed: the page re-reads everything.
                    Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {
                        sent.clear();
                        return Some((
                            Event::default().event("resync").data("{}"),
                            (receiver, sent, revoked, slot),
                        ));
                    }
                    Ok(Ok(change)) => change,
                };
                let (agent_id, update) = &*change;
                if sent.get(agent_id).is_some_and(|&r| r >= update.revision) {
                    continue;
                }
                let state = match &update.state {
                    Some(state) => state.clone(),
                    // Too large to carry: read it (the read says whose it is).
                    None => match reader.read(agent_id).await {
                        Ok(state) => state,
                        Err(_) => continue,
                    },
                };
                if state.agent.as_ref().is_none_or(|a| a.tenant != tenant) {
                    continue;
                }
                if sent.len() >= MAX_SENT {
                    sent.clear();
                }
                sent.insert(agent_id.clone(), state.revision);
                let event = PageEvent {
                    agent_id: agent_id.clone(),
                    revision: state.revision,
                    committed_at: update
                        .committed_at
                        .map(|at| chrono::DateTime::<chrono::Utc>::from(at).into()),
                    summary: Some(summary(&state)),
                    projection: Some(context(agent_id, &state)),
                };
                let data = serde_json::to_string(&event).unwrap_or_default();
                return Some((
                    Event::default().event("agent").data(data),
                    (receiver, sent, revoked, slot),
                ));
            }
        }
    })
    .map(Ok::<_, Infallible>);
    let mut response = Sse::new(hello.chain(changes))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
