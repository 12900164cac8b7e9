//! What every request handler shares: the tenant a request comes from, id
//! validation, and the error codes of the answers.

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::CatalogError;

/// Error codes of [`ctxsync_proto::v1::CatalogError`].
pub mod codes {
    pub const TOOL_WITHDRAWN: &str = "tool.withdrawn";
    pub const TOOL_SERVER_UNREACHABLE: &str = "tool.server_unreachable";
    pub const TOOL_NOT_FOUND: &str = "tool.not_found";
    pub const TOOL_TIMEOUT: &str = "tool.timeout";
    pub const TOOL_CALL_FAILED: &str = "tool.call_failed";
    pub const TOOL_RESULT_TOO_LARGE: &str = "tool.result_too_large";
    // A prompt's or resource's codes are the tool's with their own prefix
    // (`prompt.withdrawn`, `resource.timeout`, ...); these two are named here
    // because the MCP endpoint answers them itself.
    pub const PROMPT_NOT_FOUND: &str = "prompt.not_found";
    pub const RESOURCE_NOT_FOUND: &str = "resource.not_found";
    pub const SERVER_NOT_PINNED: &str = "server.not_pinned";
    pub const SERVER_NOT_CONFIGURED: &str = "server.not_configured";
    /// The replica runs its bound of server processes (`--max-server-processes`).
    pub const SERVER_PROCESS_LIMIT: &str = "server.process_limit";
    pub const SESSION_NOT_PREPARED: &str = "session.not_prepared";
    pub const TENANT_UNKNOWN: &str = "tenant.unknown";
    pub const REQUEST_INVALID: &str = "request.invalid";
    pub const INTERNAL: &str = "catalog.internal";
    /// The answer does not fit in one NATS message (`max_payload`).
    pub const REPLY_TOO_LARGE: &str = "catalog.reply_too_large";
}

/// Longest tenant or session id accepted in a request, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// A request's tenant is its subject's (`<prefix>.catalog.<op>.<tenant>`),
/// which NATS permissions confine to the caller's own. A tenant named in the
/// body must be that one; an empty one becomes it.
pub(crate) fn tenant_of(
    body_tenant: &mut String,
    subjects: &Subjects,
    incoming: &ctxsync_runtime::rpc::Incoming,
) -> Result<(), String> {
    let subject_tenant = subjects
        .catalog_tenant(&incoming.subject)
        .ok_or_else(|| format!("subject {:?} names no tenant", incoming.subject.as_str()))?;
    if body_tenant.is_empty() {
        subject_tenant.clone_into(body_tenant);
        return Ok(());
    }
    if body_tenant != subject_tenant {
        return Err(format!(
            "tenant {:?} in the request differs from the subject's tenant {subject_tenant:?}",
            body_tenant.chars().take(80).collect::<String>()
        ));
    }
    Ok(())
}

/// Longest resource URI accepted in a call, in bytes.
pub const MAX_RESOURCE_URI_BYTES: usize = 8192;

/// A tenant, session, server, tool or prompt id: present, storable, bounded.
pub(crate) fn valid_request_id(name: &str, value: &str) -> Result<(), String> {
    valid_bounded(name, value, MAX_REQUEST_ID_BYTES)
}

/// Present, storable, at most `max` bytes.
pub(crate) fn valid_bounded(name: &str, value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{name} is empty"));
    }
    // Ids are stored in text columns, which cannot hold NUL.
    if let Some(at) = value.find('\0') {
        return Err(format!("{name} contains U+0000 (NUL) at byte {at}"));
    }
    if value.len() > max {
        return Err(format!(
            "{name} is {} bytes, over the limit of {max}",
            value.len()
        ));
    }
    Ok(())
}

/// The error of an answer.
pub(crate) fn error(code: &str, message: impl Into<String>) -> Option<CatalogError> {
    Some(CatalogError {
        code: code.to_owned(),
        message: message.into(),
    })
}
