//! The events the catalog's decisions produce, as data: the adapter stores
//! them (in the transaction of what they describe) and publishes them after
//! commit. No payload holds arguments, results, error texts or secrets.

use std::time::Duration;

use serde_json::Value;

/// Payload version of every event this build writes. New fields are additive.
pub const PAYLOAD_VERSION: i32 = 1;

pub mod kinds {
    pub const SERVER_PINNED: &str = "mcp.server.pinned";
    pub const SERVER_CONNECTED: &str = "mcp.server.connected";
    pub const SERVER_CONNECT_FAILED: &str = "mcp.server.connect_failed";
    pub const CATALOG_CHANGED: &str = "mcp.catalog.changed";
    pub const TOOL_CALLED: &str = "mcp.tool.called";
    pub const PROMPT_GOT: &str = "mcp.prompt.got";
    pub const RESOURCE_READ: &str = "mcp.resource.read";
    pub const SESSION_PREPARED: &str = "catalog.session.prepared";
}

/// An event to write.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub kind: &'static str,
    pub tenant: String,
    pub session_id: Option<String>,
    pub server_id: Option<String>,
    pub payload: Value,
}

impl NewEvent {
    /// An event about `server_id` in a session.
    pub fn of_server(
        kind: &'static str,
        tenant: &str,
        session_id: &str,
        server_id: &str,
        payload: Value,
    ) -> Self {
        Self {
            kind,
            tenant: tenant.to_owned(),
            session_id: Some(session_id.to_owned()),
            server_id: Some(server_id.to_owned()),
            payload,
        }
    }
}

/// Why a live discovery ran: it is timed and labelled by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Preparation,
    Call,
    Warmup,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Preparation => "preparation",
            Self::Call => "call",
            Self::Warmup => "warmup",
        }
    }
}

/// Whole milliseconds, for durations in answers and event payloads.
pub fn ms(duration: Duration) -> u64 {
    duration.as_millis().min(u64::MAX as u128) as u64
}

/// Milliseconds with microsecond precision, for phases that take less than one.
pub fn ms_precise(duration: Duration) -> f64 {
    duration.as_micros() as f64 / 1000.0
}
