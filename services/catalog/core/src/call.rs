//! A call's decisions, step by step: is the item callable in the session
//! ([`target`]); what the server needs first ([`step`]: a start, a re-list
//! after it said its list changed, or nothing); what a live catalog means
//! for the pin ([`live_catalog`]: `mcp.server.connected`, and for a hash
//! not reported yet a new generation and `mcp.catalog.changed`); whether
//! the item was withdrawn ([`withdrawal`]); and what the server's answer is
//! ([`classify`]). Every step says which events follow; the adapter carries
//! them out (processes, transactions, NATS).

use std::time::Duration;

use ctxsync_proto::v1::{CatalogCallReply, CatalogCallRequest};
use serde_json::json;

use crate::code::{ErrorCode, ItemError};
use crate::events::{Cause, NewEvent, kinds, ms, ms_precise};
use crate::memory::{Failure, Transport};
use crate::pins::{ServerUse, StoredPin};
use crate::request::{Refusal, item_of};
use crate::tools::{Catalog, CatalogDiff, Item};

/// The call a decision is about.
#[derive(Debug, Clone, Copy)]
pub struct CallRef<'a> {
    pub tenant: &'a str,
    pub session_id: &'a str,
    pub server_id: &'a str,
    pub item: Item<'a>,
}

impl<'a> CallRef<'a> {
    pub fn of(request: &'a CatalogCallRequest) -> Self {
        Self {
            tenant: &request.tenant,
            session_id: &request.session_id,
            server_id: &request.server_id,
            item: item_of(request),
        }
    }

    /// The code of `error` for this call's item (`prompt.timeout` for a prompt).
    pub fn code(&self, error: ItemError) -> ErrorCode {
        ErrorCode::Item(self.item.kind(), error)
    }

    fn event(&self, kind: &'static str, payload: serde_json::Value) -> NewEvent {
        NewEvent::of_server(kind, self.tenant, self.session_id, self.server_id, payload)
    }
}

/// The session was never prepared (for this tenant).
pub fn session_not_prepared(tenant: &str, session_id: &str) -> Refusal {
    Refusal::new(
        ErrorCode::SessionNotPrepared,
        format!("session {session_id:?} of tenant {tenant:?} was never prepared"),
    )
}

/// Whether the call may go on, with its pin and server: the session pinned
/// the server (`pin`), the pin holds the item (an item added since stays
/// unadvertised: unknown here), and the server is still configured and
/// enabled (`server`, as configured now).
pub fn target<'p, S>(
    call: &CallRef<'_>,
    pin: Option<&'p StoredPin>,
    server: Option<S>,
) -> Result<(&'p StoredPin, S), Refusal> {
    let server_id = call.server_id;
    let Some(pin) = pin else {
        return Err(not_pinned(server_id));
    };
    if !pin.catalog.has(call.item) {
        return Err(Refusal::new(
            call.code(ItemError::NotFound),
            format!(
                "{} {:?} is not in the session's pin of server {server_id:?}",
                call.item.kind(),
                call.item.key()
            ),
        ));
    }
    let Some(server) = server else {
        return Err(not_configured(server_id));
    };
    Ok((pin, server))
}

/// [`target`] for a request about the server rather than one of its items
/// (a completion, a subscription, a log level).
pub fn server_target<'p, S>(
    server_id: &str,
    pin: Option<&'p StoredPin>,
    server: Option<S>,
) -> Result<(&'p StoredPin, S), Refusal> {
    match (pin, server) {
        (None, _) => Err(not_pinned(server_id)),
        (Some(_), None) => Err(not_configured(server_id)),
        (Some(pin), Some(server)) => Ok((pin, server)),
    }
}

fn not_pinned(server_id: &str) -> Refusal {
    Refusal::new(
        ErrorCode::ServerNotPinned,
        format!("server {server_id:?} is not pinned in this session"),
    )
}

fn not_configured(server_id: &str) -> Refusal {
    Refusal::new(
        ErrorCode::ServerNotConfigured,
        format!("server {server_id:?} is no longer configured or enabled"),
    )
}

/// The session's open transport to the server, as a call finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Open {
    /// The server has gone (its transport closed).
    pub closed: bool,
    /// The server said its list changed since the last look.
    pub list_changed: bool,
}

/// What the server needs before the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No open transport (or a dead one): start or open it, a live discovery.
    Connect,
    /// It said its list changed: list it again and compare with the pin.
    Relist,
    /// Ready as it is.
    Use,
}

/// The lazy start: a pinned server starts on the first call that needs it
/// (and again after its transport died); an open one is re-listed only
/// after it said its list changed.
pub fn step(open: Option<Open>) -> Step {
    match open {
        None | Some(Open { closed: true, .. }) => Step::Connect,
        Some(Open {
            list_changed: true, ..
        }) => Step::Relist,
        Some(_) => Step::Use,
    }
}

/// What a live catalog of the pinned server writes.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveRecord {
    /// The comparison of the pin with the live catalog.
    pub diff: CatalogDiff,
    pub events: Vec<NewEvent>,
    /// The live hash differs from the pin's and from what was last reported:
    /// its generation is written with the events, and once committed
    /// [`ServerUse::reported`].
    pub changed: bool,
}

/// After a call's (re)connect (`handshake`: how long it took) or a
/// re-list (`None`): `mcp.server.connected` for a handshake, and for a hash
/// not reported yet in the session, `mcp.catalog.changed`.
pub fn live_catalog(
    call: &CallRef<'_>,
    transport: Transport,
    pin: &StoredPin,
    live: &Catalog,
    handshake: Option<Duration>,
    server_use: &ServerUse,
) -> LiveRecord {
    let diff = pin.catalog.diff(live);
    let mut events = Vec::new();
    if let Some(duration) = handshake {
        events.push(call.event(
            kinds::SERVER_CONNECTED,
            json!({
                "transport": transport.as_str(),
                "duration_ms": ms(duration),
                "cause": Cause::Call.as_str(),
                "catalog_hash": live.hash,
                "tool_count": live.tools.len(),
            }),
        ));
    }
    let changed = server_use.is_unreported_change(pin, &live.hash);
    if changed {
        events.push(call.event(
            kinds::CATALOG_CHANGED,
            json!({
                "transport": transport.as_str(),
                "previous_hash": pin.catalog.hash,
                "catalog_hash": live.hash,
                "added": diff.added,
                "removed": diff.removed,
                "changed": diff.changed,
            }),
        ));
    }
    LiveRecord {
        diff,
        events,
        changed,
    }
}

/// What the call path did before the item was used, for its event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Setup {
    /// It started or opened the server (a handshake).
    pub connected: bool,
    pub duration: Duration,
}

/// `mcp.tool.called`, `mcp.prompt.got` or `mcp.resource.read`.
pub fn called_event(
    call: &CallRef<'_>,
    transport: Transport,
    first_call: bool,
    outcome: &str,
    duration: Duration,
    setup: Setup,
) -> NewEvent {
    let (kind, field) = match call.item {
        Item::Tool(_) => (kinds::TOOL_CALLED, "tool"),
        Item::Prompt(_) => (kinds::PROMPT_GOT, "prompt"),
        Item::Resource(_) => (kinds::RESOURCE_READ, "uri"),
    };
    call.event(
        kind,
        json!({
            "transport": transport.as_str(),
            field: call.item.key(),
            "outcome": outcome,
            "first_call": first_call,
            "connected": setup.connected,
            "setup_ms": ms_precise(setup.duration),
            "duration_ms": ms_precise(duration),
        }),
    )
}

/// A connect that failed: the answer and its two events
/// (`mcp.server.connect_failed`, then the call's with `server_unreachable`).
pub fn unreachable(
    call: &CallRef<'_>,
    transport: Transport,
    failure: &Failure,
    first_call: bool,
) -> (Refusal, Vec<NewEvent>) {
    let failed = Setup {
        connected: false,
        duration: failure.duration,
    };
    let events = vec![
        call.event(
            kinds::SERVER_CONNECT_FAILED,
            json!({
                "transport": transport.as_str(),
                "duration_ms": ms(failure.duration),
                "cause": Cause::Call.as_str(),
                "error_kind": failure.kind,
            }),
        ),
        called_event(
            call,
            transport,
            first_call,
            "server_unreachable",
            Duration::ZERO,
            failed,
        ),
    ];
    let refusal = Refusal::new(
        call.code(ItemError::ServerUnreachable),
        format!(
            "server {:?} is unreachable: {}",
            call.server_id, failure.message
        ),
    );
    (refusal, events)
}

/// An item removed or changed since the pin is refused (its event's outcome
/// is `withdrawn`); an unchanged one, or one the pin never had, is not.
pub fn withdrawal(call: &CallRef<'_>, diff: &CatalogDiff) -> Option<Refusal> {
    let item = call.item;
    if !diff.withdraws_item(item) {
        return None;
    }
    let reason = if diff.removes_item(item) {
        "removed"
    } else {
        "changed"
    };
    Some(Refusal::new(
        call.code(ItemError::Withdrawn),
        format!(
            "{} {:?} of server {:?} was {reason} since the session pinned it",
            item.kind(),
            item.key(),
            call.server_id
        ),
    ))
}

/// A server's answer to a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The server's own tool error (a result, not a failure).
    pub is_error: bool,
    pub content_json: String,
}

/// Why a call got no answer; messages sanitized of the server's secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallFailure {
    /// Nothing within the server's call timeout.
    Timeout { after: Duration },
    /// The server answered with a protocol error.
    Protocol { message: String },
    /// The transport broke: it is closed, the next call reconnects.
    Transport { message: String },
    /// The client cancelled the call; the server was told. Nobody reads the
    /// answer, but the event records the outcome.
    Cancelled,
}

/// The call's reply, the outcome its event records, and whether the
/// transport broke.
#[derive(Debug, Clone, PartialEq)]
pub struct Classified {
    pub reply: CatalogCallReply,
    pub outcome: &'static str,
    pub transport_broke: bool,
}

/// A server's answer within the server's limit (`max_content_bytes`).
pub fn classify(
    call: &CallRef<'_>,
    result: Result<Answer, CallFailure>,
    max_content_bytes: u64,
) -> Classified {
    let refused = |error, message: String, outcome, transport_broke| Classified {
        reply: refused(&Refusal::new(call.code(error), message)),
        outcome,
        transport_broke,
    };
    match result {
        Ok(answer) if answer.content_json.len() as u64 > max_content_bytes => refused(
            ItemError::ResultTooLarge,
            format!(
                "the result is {} bytes, over the server's limit max_content_bytes = {max_content_bytes}",
                answer.content_json.len(),
            ),
            "result_too_large",
            false,
        ),
        Ok(answer) => Classified {
            outcome: if answer.is_error { "tool_error" } else { "ok" },
            reply: CatalogCallReply {
                ok: true,
                is_error: answer.is_error,
                content_json: answer.content_json,
                error: None,
            },
            transport_broke: false,
        },
        Err(CallFailure::Timeout { after }) => refused(
            ItemError::Timeout,
            format!("no result within {after:?} (limits.call_timeout_seconds)"),
            "timeout",
            false,
        ),
        Err(CallFailure::Protocol { message }) => {
            refused(ItemError::CallFailed, message, "call_failed", false)
        }
        Err(CallFailure::Cancelled) => refused(
            ItemError::CallFailed,
            "the client cancelled the call".to_owned(),
            "cancelled",
            false,
        ),
        Err(CallFailure::Transport { message }) => refused(
            ItemError::ServerUnreachable,
            format!("server {:?} is unreachable: {message}", call.server_id),
            "server_unreachable",
            true,
        ),
    }
}

/// A call refused with `refusal`.
pub fn refused(refusal: &Refusal) -> CatalogCallReply {
    CatalogCallReply {
        error: Some(refusal.to_proto()),
        ..Default::default()
    }
}
