//! The catalog's error codes, typed: an answer's code is one of these, and
//! callers match on the type; the text is only for the wire
//! ([`ErrorCode::as_str`], [`ErrorCode::from_wire`]).

use std::fmt;

use ctxsync_proto::v1::{ServiceError, service_error::Code};

/// What a call names: a prompt's or resource's codes carry its kind as
/// their prefix (`prompt.withdrawn`, `resource.timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemKind {
    Tool,
    Prompt,
    Resource,
}

impl ItemKind {
    pub const ALL: [Self; 3] = [Self::Tool, Self::Prompt, Self::Resource];

    /// `tool`, `prompt` or `resource`: for codes, messages and events.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tool => "tool",
            Self::Prompt => "prompt",
            Self::Resource => "resource",
        }
    }
}

impl fmt::Display for ItemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What went wrong with the item a call names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemError {
    /// Removed or changed since the session pinned it.
    Withdrawn,
    /// Its server cannot be reached (connect, or a transport that broke).
    ServerUnreachable,
    /// Not in the session's pin (added since the pin included).
    NotFound,
    /// No result within the server's `limits.call_timeout_seconds`.
    Timeout,
    /// The server answered the call with a protocol error.
    CallFailed,
    /// The result is over the server's `limits.max_content_bytes`.
    ResultTooLarge,
}

impl ItemError {
    pub const ALL: [Self; 6] = [
        Self::Withdrawn,
        Self::ServerUnreachable,
        Self::NotFound,
        Self::Timeout,
        Self::CallFailed,
        Self::ResultTooLarge,
    ];
}

/// The catalog's name of a failure: the `reason` of the
/// [`ctxsync_proto::v1::ServiceError`] its answer carries, whose `code` is
/// [`ErrorCode::service_code`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// `<item>.<error>`: `tool.withdrawn`, `prompt.not_found`, ...
    Item(ItemKind, ItemError),
    /// `server.not_pinned`: the session pinned no such server.
    ServerNotPinned,
    /// `server.not_configured`: pinned, but no longer configured or enabled.
    ServerNotConfigured,
    /// `server.process_limit`: the replica or the tenant runs its bound of
    /// server processes.
    ServerProcessLimit,
    /// `session.not_prepared`
    SessionNotPrepared,
    /// `tenant.unknown`
    TenantUnknown,
    /// `request.invalid`
    RequestInvalid,
    /// `catalog.internal`
    Internal,
    /// `catalog.reply_too_large`: the answer does not fit in one NATS message.
    ReplyTooLarge,
}

impl ErrorCode {
    /// The tool's code for `error`.
    pub const fn tool(error: ItemError) -> Self {
        Self::Item(ItemKind::Tool, error)
    }

    /// The code as sent and stored (never changes: callers compare it).
    pub fn as_str(self) -> &'static str {
        use ItemError as E;
        use ItemKind as K;
        match self {
            Self::Item(K::Tool, E::Withdrawn) => "tool.withdrawn",
            Self::Item(K::Tool, E::ServerUnreachable) => "tool.server_unreachable",
            Self::Item(K::Tool, E::NotFound) => "tool.not_found",
            Self::Item(K::Tool, E::Timeout) => "tool.timeout",
            Self::Item(K::Tool, E::CallFailed) => "tool.call_failed",
            Self::Item(K::Tool, E::ResultTooLarge) => "tool.result_too_large",
            Self::Item(K::Prompt, E::Withdrawn) => "prompt.withdrawn",
            Self::Item(K::Prompt, E::ServerUnreachable) => "prompt.server_unreachable",
            Self::Item(K::Prompt, E::NotFound) => "prompt.not_found",
            Self::Item(K::Prompt, E::Timeout) => "prompt.timeout",
            Self::Item(K::Prompt, E::CallFailed) => "prompt.call_failed",
            Self::Item(K::Prompt, E::ResultTooLarge) => "prompt.result_too_large",
            Self::Item(K::Resource, E::Withdrawn) => "resource.withdrawn",
            Self::Item(K::Resource, E::ServerUnreachable) => "resource.server_unreachable",
            Self::Item(K::Resource, E::NotFound) => "resource.not_found",
            Self::Item(K::Resource, E::Timeout) => "resource.timeout",
            Self::Item(K::Resource, E::CallFailed) => "resource.call_failed",
            Self::Item(K::Resource, E::ResultTooLarge) => "resource.result_too_large",
            Self::ServerNotPinned => "server.not_pinned",
            Self::ServerNotConfigured => "server.not_configured",
            Self::ServerProcessLimit => "server.process_limit",
            Self::SessionNotPrepared => "session.not_prepared",
            Self::TenantUnknown => "tenant.unknown",
            Self::RequestInvalid => "request.invalid",
            Self::Internal => "catalog.internal",
            Self::ReplyTooLarge => "catalog.reply_too_large",
        }
    }

    /// The envelope's code, what callers decide on: whether asking again
    /// may help (`unavailable`, `deadline_exceeded`), whether the request
    /// or the session's state is at fault.
    pub fn service_code(self) -> Code {
        use ItemError as E;
        match self {
            Self::RequestInvalid => Code::InvalidArgument,
            Self::Item(_, E::NotFound | E::Withdrawn)
            | Self::ServerNotConfigured
            | Self::TenantUnknown => Code::NotFound,
            Self::SessionNotPrepared | Self::ServerNotPinned => Code::FailedPrecondition,
            Self::Item(_, E::ServerUnreachable) => Code::Unavailable,
            Self::Item(_, E::Timeout) => Code::DeadlineExceeded,
            Self::Item(_, E::ResultTooLarge) | Self::ServerProcessLimit | Self::ReplyTooLarge => {
                Code::ResourceExhausted
            }
            Self::Item(_, E::CallFailed) | Self::Internal => Code::Internal,
        }
    }

    /// The catalog's name of the failure an envelope carries, if it names one.
    pub fn of(error: &ServiceError) -> Option<Self> {
        Self::from_wire(&error.reason)
    }

    /// Every code.
    pub fn all() -> impl Iterator<Item = Self> {
        let items = ItemKind::ALL
            .into_iter()
            .flat_map(|kind| ItemError::ALL.into_iter().map(move |e| Self::Item(kind, e)));
        items.chain([
            Self::ServerNotPinned,
            Self::ServerNotConfigured,
            Self::ServerProcessLimit,
            Self::SessionNotPrepared,
            Self::TenantUnknown,
            Self::RequestInvalid,
            Self::Internal,
            Self::ReplyTooLarge,
        ])
    }

    /// The code a wire text names; `None` for a text no catalog sends.
    pub fn from_wire(text: &str) -> Option<Self> {
        Self::all().find(|code| code.as_str() == text)
    }

    /// The item a code is about, with what went wrong.
    pub fn item(self) -> Option<(ItemKind, ItemError)> {
        match self {
            Self::Item(kind, error) => Some((kind, error)),
            _ => None,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_reads_back_from_its_wire_text_and_the_texts_are_distinct() {
        let texts: std::collections::BTreeSet<&str> =
            ErrorCode::all().map(|c| c.as_str()).collect();
        assert_eq!(texts.len(), ErrorCode::all().count());
        for code in ErrorCode::all() {
            assert_eq!(ErrorCode::from_wire(code.as_str()), Some(code));
        }
        assert_eq!(ErrorCode::from_wire("tool.something_else"), None);
        // Every name has an envelope code of its own kind.
        for code in ErrorCode::all() {
            assert_ne!(code.service_code(), Code::Unspecified, "{code}");
        }
        // An item's code carries its kind as prefix.
        for code in ErrorCode::all() {
            if let Some((kind, _)) = code.item() {
                assert!(code.as_str().starts_with(&format!("{kind}.")), "{code}");
            }
        }
    }
}
