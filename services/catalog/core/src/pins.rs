//! A session's pins as data: what a preparation writes, what a call reads
//! back, and one pinned server's use within its session.

use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::{CatalogPin, McpTransport};

use crate::memory::Transport;
use crate::naming::NameRule;
use crate::tools::Catalog;

/// How a pin was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinSource {
    /// From the memory, without a start.
    Pinned,
    /// From a live discovery.
    Connected,
}

impl PinSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pinned => "pinned",
            Self::Connected => "connected",
        }
    }

    /// As stored; anything but `connected` reads as pinned.
    pub fn parse(text: &str) -> Self {
        if text == "connected" {
            Self::Connected
        } else {
            Self::Pinned
        }
    }

    pub fn to_proto(self) -> Source {
        match self {
            Self::Pinned => Source::Pinned,
            Self::Connected => Source::Connected,
        }
    }
}

/// A pin to write, with the generation it names.
#[derive(Debug, Clone)]
pub struct NewPin<'a> {
    pub server_id: &'a str,
    pub key: &'a str,
    pub transport: Transport,
    pub source: PinSource,
    pub catalog: &'a Catalog,
    pub naming: &'a NameRule,
}

/// A stored pin with its generation's declarations.
#[derive(Debug, Clone)]
pub struct StoredPin {
    pub server_id: String,
    pub server_key: String,
    /// As stored (`stdio`, `streamable_http`).
    pub transport: String,
    pub source: PinSource,
    pub catalog: Catalog,
    /// The names it was pinned with.
    pub naming: NameRule,
}

impl StoredPin {
    /// The pin as a follow-up preparation answers it.
    pub fn to_proto(&self) -> CatalogPin {
        CatalogPin {
            server_id: self.server_id.clone(),
            transport: Transport::from_name(&self.transport)
                .map_or(McpTransport::Unspecified, Transport::to_proto)
                as i32,
            source: self.source.to_proto() as i32,
            naming: Some(self.naming.to_proto()),
            ..self.catalog.to_pin()
        }
    }
}

/// One pinned server's use in its session: its calls, and the hash last
/// reported as `mcp.catalog.changed` (so each change is reported once per
/// session, server and hash).
#[derive(Debug, Clone, Default)]
pub struct ServerUse {
    calls: u64,
    reported_hash: Option<String>,
}

impl ServerUse {
    /// Counts a call of `pin`; returns whether it is the server's first in
    /// the session.
    pub fn count_call(&mut self, pin: &StoredPin) -> bool {
        if self.reported_hash.is_none() {
            self.reported_hash = Some(pin.catalog.hash.clone());
        }
        self.calls += 1;
        self.calls == 1
    }

    /// Whether the live `hash` differs from the pin's and from what was last
    /// reported.
    pub fn is_unreported_change(&self, pin: &StoredPin, hash: &str) -> bool {
        hash != pin.catalog.hash && self.reported_hash.as_deref() != Some(hash)
    }

    /// `hash`'s change is stored and reported.
    pub fn reported(&mut self, hash: &str) {
        self.reported_hash = Some(hash.to_owned());
    }
}
