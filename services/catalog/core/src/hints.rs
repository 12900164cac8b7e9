//! What a stateless caller is told about the pins it lists (MCP
//! 2026-07-28): the pin handle it passes back, and how long the list stays
//! true (`ttlMs`).
//!
//! * **A handle names pins, and pins never change.** A list answered from
//!   the memory alone is pinned under a handle derived from what it pins
//!   (the tenant and, per server in configured order, its id, its
//!   configuration key and its catalog hash): every replica derives the same
//!   handle from the same memory, so equal lists share one preparation. A
//!   list that needed a live discovery gets a fresh handle (its outcome is
//!   known only after). Any prepared session of the tenant is a handle too
//!   (a chat's, which the gate's answer gives out). A call carrying a
//!   handle is checked against that handle's pins, so a tool changed since
//!   answers `tool.withdrawn`.
//! * **Freshness is the memory's.** A stdio server's list changes only when
//!   its configuration does or a release restarts the catalog
//!   ([`STDIO_FRESH_FOR`] caps it); a streamable-HTTP server's list is
//!   reused until its reuse window ends (the operator's, or the server's
//!   own `ttlMs` when shorter), so it is fresh for what is left of it; a
//!   server without a reusable discovery makes the list stale at once. A
//!   list is as fresh as its least fresh server, and pins that are no
//!   longer the memory's lists are stale.

use std::time::{Duration, SystemTime};

use crate::memory::{Discovery, Reuse, Transport};
use crate::naming::NameRule;
use crate::request::valid_request_id;

/// How long a list of stdio servers is said to be fresh: they change only
/// with the configuration or a release, neither of which a clock predicts.
pub const STDIO_FRESH_FOR: Duration = Duration::from_secs(24 * 60 * 60);

/// The handles the catalog derives start so (any prepared session of the
/// tenant is a handle too: a chat's, given out by the gate).
pub const PIN_HANDLE_PREFIX: &str = "pins-";

/// How long one server's remembered list stays true from `now`.
pub fn fresh_for(discovery: &Discovery, reuse: Reuse, now: SystemTime) -> Duration {
    match discovery.transport {
        Transport::Stdio => STDIO_FRESH_FOR,
        Transport::StreamableHttp => {
            let age = now
                .duration_since(discovery.discovered_at)
                .unwrap_or_default();
            discovery.http_reuse(reuse).saturating_sub(age)
        }
    }
}

/// How long a list of these servers stays true: its least fresh server's
/// time, zero if one has no reusable discovery (`None`), [`STDIO_FRESH_FOR`]
/// for no server at all.
pub fn list_fresh_for(servers: impl IntoIterator<Item = Option<Duration>>) -> Duration {
    servers
        .into_iter()
        .map(Option::unwrap_or_default)
        .min()
        .unwrap_or(STDIO_FRESH_FOR)
}

/// One pinned server as a handle derives from it.
#[derive(Debug, Clone, Copy)]
pub struct HandlePart<'a> {
    pub server_id: &'a str,
    pub server_key: &'a str,
    pub catalog_hash: &'a str,
    /// Names are part of the pins: a new rule is a new handle.
    pub naming: &'a NameRule,
}

/// The text a handle is the digest of: unambiguous (every field is
/// length-prefixed), so two different pin sets never share it.
pub fn handle_material<'a>(
    tenant: &str,
    parts: impl IntoIterator<Item = HandlePart<'a>>,
) -> String {
    let mut text = String::new();
    let mut field = |value: &str| {
        text.push_str(&value.len().to_string());
        text.push(':');
        text.push_str(value);
    };
    field(tenant);
    for part in parts {
        field(part.server_id);
        field(part.server_key);
        field(part.catalog_hash);
        field(&part.naming.to_json());
    }
    text
}

/// Why a handle a caller sent is refused before any lookup.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    #[error("the pin handle must be a string")]
    NotAString,
    #[error("{0}")]
    Invalid(String),
}

/// A handle as sent: a string that can name a session (present, without
/// NUL, within [`MAX_REQUEST_ID_BYTES`]).
pub fn valid_handle(value: &serde_json::Value) -> Result<&str, HandleError> {
    let handle = value.as_str().ok_or(HandleError::NotAString)?;
    valid_request_id("the pin handle", handle).map_err(HandleError::Invalid)?;
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::request::MAX_REQUEST_ID_BYTES;
    use crate::tools::Catalog;

    fn discovery(transport: Transport, discovered_at: SystemTime) -> Discovery {
        Discovery {
            catalog: Arc::new(Catalog {
                tools: Vec::new(),
                prompts: Vec::new(),
                resources: Vec::new(),
                hash: "h".into(),
            }),
            transport,
            discovered_at,
            release: "test".into(),
            upstream_ttl: None,
        }
    }

    const WINDOW: Reuse = Reuse {
        http_window: Duration::from_secs(60),
    };

    #[test]
    fn an_http_list_is_fresh_for_what_is_left_of_its_window() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let entry = discovery(Transport::StreamableHttp, at);
        assert_eq!(fresh_for(&entry, WINDOW, at), Duration::from_secs(60));
        let later = at + Duration::from_secs(45);
        assert_eq!(fresh_for(&entry, WINDOW, later), Duration::from_secs(15));
        let past = at + Duration::from_secs(90);
        assert_eq!(fresh_for(&entry, WINDOW, past), Duration::ZERO);
    }

    #[test]
    fn an_http_servers_own_shorter_hint_shortens_its_window() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut entry = discovery(Transport::StreamableHttp, at);
        entry.upstream_ttl = Some(Duration::from_secs(20));
        let later = at + Duration::from_secs(5);
        assert_eq!(fresh_for(&entry, WINDOW, later), Duration::from_secs(15));
        assert!(!WINDOW.allows(&entry, at + Duration::from_secs(21)));
        // Never longer than the operator's window.
        entry.upstream_ttl = Some(Duration::from_secs(600));
        assert_eq!(fresh_for(&entry, WINDOW, at), Duration::from_secs(60));
        assert!(!WINDOW.allows(&entry, at + Duration::from_secs(61)));
    }

    #[test]
    fn a_stdio_list_is_fresh_for_the_cap_whatever_its_age() {
        let at = SystemTime::UNIX_EPOCH;
        let entry = discovery(Transport::Stdio, at);
        let much_later = at + Duration::from_secs(10 * 24 * 3600);
        assert_eq!(fresh_for(&entry, WINDOW, much_later), STDIO_FRESH_FOR);
    }

    #[test]
    fn a_list_is_as_fresh_as_its_least_fresh_server() {
        let ten = Some(Duration::from_secs(10));
        assert_eq!(
            list_fresh_for([Some(STDIO_FRESH_FOR), ten]),
            Duration::from_secs(10)
        );
        assert_eq!(list_fresh_for([ten, None]), Duration::ZERO);
        assert_eq!(list_fresh_for([]), STDIO_FRESH_FOR);
    }

    #[test]
    fn handle_material_tells_apart_what_concatenation_would_not() {
        let prefixed = NameRule::prefixed("a");
        let part = |server_id, server_key, catalog_hash| HandlePart {
            server_id,
            server_key,
            catalog_hash,
            naming: &prefixed,
        };
        let a = handle_material("t", [part("ab", "c", "h")]);
        let b = handle_material("t", [part("a", "bc", "h")]);
        assert_ne!(a, b);
        assert_ne!(
            handle_material("t1", [part("a", "k", "h")]),
            handle_material("t2", [part("a", "k", "h")])
        );
        let bare = NameRule::bare();
        let renamed = HandlePart {
            naming: &bare,
            ..part("a", "k", "h")
        };
        assert_ne!(
            handle_material("t", [part("a", "k", "h")]),
            handle_material("t", [renamed])
        );
    }

    #[test]
    fn a_handle_is_a_string_that_can_name_a_session() {
        let ok = serde_json::json!("pins-0123abcd");
        assert_eq!(valid_handle(&ok), Ok("pins-0123abcd"));
        assert_eq!(valid_handle(&serde_json::json!("chat-7")), Ok("chat-7"));
        assert_eq!(
            valid_handle(&serde_json::json!(7)),
            Err(HandleError::NotAString)
        );
        let long = "a".repeat(MAX_REQUEST_ID_BYTES + 1);
        let Err(HandleError::Invalid(message)) = valid_handle(&serde_json::json!(long)) else {
            panic!("a handle over the limit is refused");
        };
        assert!(message.contains("over the limit of 256"), "{message}");
        assert!(valid_handle(&serde_json::json!("a\u{0}b")).is_err());
    }
}
