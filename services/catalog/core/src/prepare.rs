//! Preparation's decisions: which of a tenant's enabled servers are pinned
//! from memory and which must be discovered live ([`Plan`]), and what the
//! one transaction of a first preparation writes, in configured-server
//! order ([`writes`]): a generation and a pin per pinned server, an event
//! per server, then `catalog.session.prepared`. A server whose discovery
//! failed is answered as failed and not pinned.

use std::sync::Arc;
use std::time::Duration;

use ctxsync_proto::v1::CatalogPin;
use ctxsync_proto::v1::catalog_pin::Source;
use serde_json::json;

use crate::code::ErrorCode;
use crate::events::{Cause, NewEvent, kinds, ms, ms_precise};
use crate::memory::{Failure, Live, Transport};
use crate::naming::NameRule;
use crate::pins::{NewPin, PinSource};
use crate::request::Refusal;
use crate::tools::Catalog;

/// A configured, enabled server of the tenant, as the decisions need it.
#[derive(Debug, Clone, Copy)]
pub struct ServerRef<'a> {
    pub id: &'a str,
    /// The server key (the hash of its whole configuration).
    pub key: &'a str,
    pub transport: Transport,
    /// How its items are named to MCP clients (kept with the pin).
    pub naming: &'a NameRule,
}

/// How one server is pinned.
#[derive(Debug, Clone)]
pub enum Outcome {
    Remembered(Arc<Catalog>),
    Connected(Live),
    Failed(Failure),
}

impl Outcome {
    /// The catalog pinned, unless the server failed.
    pub fn catalog(&self) -> Option<&Arc<Catalog>> {
        match self {
            Self::Remembered(catalog) | Self::Connected(Live { catalog, .. }) => Some(catalog),
            Self::Failed(_) => None,
        }
    }
}

/// The tenant has no configuration.
pub fn tenant_unknown(tenant: &str) -> Refusal {
    Refusal::new(
        ErrorCode::TenantUnknown,
        format!("tenant {tenant:?} is not configured"),
    )
}

/// A preparation's plan: each server, in configured order, pinned from
/// memory where the rules allow, else discovered live.
#[derive(Debug)]
pub struct Plan {
    outcomes: Vec<Option<Outcome>>,
}

impl Plan {
    /// `reusable[i]`: the memory's discovery of the i-th server if the rules
    /// allow pinning it without a start ([`crate::memory::MemoryMap::reusable`]).
    pub fn new(reusable: impl IntoIterator<Item = Option<Arc<Catalog>>>) -> Self {
        Self {
            outcomes: reusable
                .into_iter()
                .map(|r| r.map(Outcome::Remembered))
                .collect(),
        }
    }

    /// Whether a server would be started. A session is prepared once: it is
    /// looked up first only then (otherwise the write itself finds it, one
    /// round trip fewer for new chats).
    pub fn must_discover(&self) -> bool {
        self.outcomes.iter().any(Option::is_none)
    }

    /// The positions of the servers to discover live, in configured order.
    pub fn to_discover(&self) -> Vec<usize> {
        self.outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| o.is_none())
            .map(|(i, _)| i)
            .collect()
    }

    /// Every outcome, given the live results of [`Plan::to_discover`] in its order.
    pub fn discovered(self, live: impl IntoIterator<Item = Result<Live, Failure>>) -> Vec<Outcome> {
        let mut live = live.into_iter();
        self.outcomes
            .into_iter()
            .map(|outcome| {
                outcome.unwrap_or_else(|| match live.next().expect("one result per live server") {
                    Ok(l) => Outcome::Connected(l),
                    Err(f) => Outcome::Failed(f),
                })
            })
            .collect()
    }
}

/// Servers by how they were pinned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub pinned: u32,
    pub connected: u32,
    pub failed: u32,
}

/// What a first preparation's transaction writes, in configured-server order.
#[derive(Debug)]
pub struct Writes<'a> {
    /// Each with the generation it needs (written before its pin).
    pub pins: Vec<NewPin<'a>>,
    /// One per server; `catalog.session.prepared` follows ([`prepared_event`]).
    pub events: Vec<NewEvent>,
    pub counts: Counts,
}

/// The pins and events of `outcomes` (one per server of `servers`).
pub fn writes<'a>(
    tenant: &str,
    session_id: &str,
    servers: &[ServerRef<'a>],
    outcomes: &'a [Outcome],
) -> Writes<'a> {
    let mut writes = Writes {
        pins: Vec::new(),
        events: Vec::new(),
        counts: Counts::default(),
    };
    for (server, outcome) in servers.iter().zip(outcomes) {
        let transport = server.transport.as_str();
        let event =
            |kind, payload| NewEvent::of_server(kind, tenant, session_id, server.id, payload);
        let (catalog, source) = match outcome {
            Outcome::Remembered(catalog) => {
                writes.counts.pinned += 1;
                writes.events.push(event(
                    kinds::SERVER_PINNED,
                    json!({
                        "transport": transport,
                        "catalog_hash": catalog.hash,
                        "tool_count": catalog.tools.len(),
                        "prompt_count": catalog.prompts.len(),
                        "resource_count": catalog.resources.len(),
                    }),
                ));
                (catalog, PinSource::Pinned)
            }
            Outcome::Connected(live) => {
                writes.counts.connected += 1;
                writes.events.push(event(
                    kinds::SERVER_CONNECTED,
                    json!({
                        "transport": transport,
                        "duration_ms": ms(live.duration),
                        "cause": Cause::Preparation.as_str(),
                        "catalog_hash": live.catalog.hash,
                        "tool_count": live.catalog.tools.len(),
                        "prompt_count": live.catalog.prompts.len(),
                        "resource_count": live.catalog.resources.len(),
                    }),
                ));
                (&live.catalog, PinSource::Connected)
            }
            Outcome::Failed(failure) => {
                writes.counts.failed += 1;
                writes.events.push(event(
                    kinds::SERVER_CONNECT_FAILED,
                    json!({
                        "transport": transport,
                        "duration_ms": ms(failure.duration),
                        "cause": Cause::Preparation.as_str(),
                        "error_kind": failure.kind,
                    }),
                ));
                continue;
            }
        };
        writes.pins.push(NewPin {
            server_id: server.id,
            key: server.key,
            transport: server.transport,
            source,
            catalog,
            naming: server.naming,
        });
    }
    writes
}

/// The phases of a first preparation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    /// Since the request arrived.
    pub total: Duration,
    /// Reading the memory.
    pub lookup: Duration,
    /// The live discoveries, all at once.
    pub discovery: Duration,
    /// The transaction before its last statement (the generations it
    /// writes first; none on a warm preparation).
    pub write: Duration,
}

/// `catalog.session.prepared` of a first preparation.
pub fn prepared_event(
    tenant: &str,
    session_id: &str,
    servers: usize,
    counts: Counts,
    timings: Timings,
) -> NewEvent {
    NewEvent {
        kind: kinds::SESSION_PREPARED,
        tenant: tenant.to_owned(),
        session_id: Some(session_id.to_owned()),
        server_id: None,
        payload: json!({
            "follow_up": false,
            "duration_ms": ms_precise(timings.total),
            "lookup_ms": ms_precise(timings.lookup),
            "discovery_ms": ms_precise(timings.discovery),
            "write_ms": ms_precise(timings.write),
            "servers": servers,
            "pinned": counts.pinned,
            "connected": counts.connected,
            "failed": counts.failed,
        }),
    }
}

/// `catalog.session.prepared` of a session asked for again: it answers its
/// stored pins.
pub fn follow_up_event(
    tenant: &str,
    session_id: &str,
    servers: usize,
    duration: Duration,
) -> NewEvent {
    NewEvent {
        kind: kinds::SESSION_PREPARED,
        tenant: tenant.to_owned(),
        session_id: Some(session_id.to_owned()),
        server_id: None,
        payload: json!({
            "follow_up": true,
            "duration_ms": ms_precise(duration),
            "servers": servers,
        }),
    }
}

/// The pins a first preparation answers, one per server (a failed one with
/// its sanitized error and no declarations).
pub fn reply_pins(servers: &[ServerRef<'_>], outcomes: Vec<Outcome>) -> Vec<CatalogPin> {
    servers
        .iter()
        .zip(outcomes)
        .map(|(server, outcome)| {
            let transport = server.transport.to_proto() as i32;
            let server_id = server.id.to_owned();
            let naming = Some(server.naming.to_proto());
            match outcome {
                Outcome::Remembered(catalog) => CatalogPin {
                    server_id,
                    transport,
                    source: Source::Pinned as i32,
                    naming,
                    ..catalog.to_pin()
                },
                Outcome::Connected(live) => CatalogPin {
                    server_id,
                    transport,
                    source: Source::Connected as i32,
                    handshake_ms: ms(live.duration),
                    naming,
                    ..live.catalog.to_pin()
                },
                Outcome::Failed(failure) => CatalogPin {
                    server_id,
                    transport,
                    source: Source::Failed as i32,
                    error: failure.message,
                    handshake_ms: ms(failure.duration),
                    ..Default::default()
                },
            }
        })
        .collect()
}
