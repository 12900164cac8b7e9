use std::time::Duration;

/// Why talking to an MCP server failed.
///
/// The `Display` text can contain secrets (URLs with credentials, argument
/// values, the server's stderr): pass it through [`crate::Sanitizer`] before it
/// is logged, stored or sent anywhere.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// The spec cannot be used as given (e.g. a header value with a newline).
    #[error("invalid server configuration: {message}")]
    InvalidSpec { message: String },

    /// The process could not be started at all.
    #[error("cannot start `{command}`: {reason}")]
    Spawn { command: String, reason: String },

    /// The server process ended before the handshake completed.
    #[error(
        "server exited during the handshake ({status}){}",
        stderr_suffix(stderr_tail)
    )]
    Exited { status: String, stderr_tail: String },

    /// The handshake failed for another reason (rejected, garbage, transport).
    #[error("handshake failed: {message}{}", stderr_suffix(stderr_tail))]
    Handshake {
        message: String,
        stderr_tail: String,
    },

    /// No answer within the bound the caller set.
    #[error("no answer from the server within {}", humanize(*after))]
    Timeout { after: Duration },

    /// The connection broke or an HTTP request failed after the handshake.
    #[error("transport error: {message}")]
    Transport { message: String },

    /// The server answered with an error or something that is not MCP.
    #[error("protocol error: {message}")]
    Protocol { message: String },

    /// The client the call was relayed for cancelled it; the server was
    /// sent `notifications/cancelled`.
    #[error("the client cancelled the call")]
    Cancelled,
}

impl McpError {
    /// A short stable name of the variant, for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            McpError::InvalidSpec { .. } => "invalid_spec",
            McpError::Spawn { .. } => "spawn",
            McpError::Exited { .. } => "exited",
            McpError::Handshake { .. } => "handshake",
            McpError::Timeout { .. } => "timeout",
            McpError::Transport { .. } => "transport",
            McpError::Protocol { .. } => "protocol",
            McpError::Cancelled => "cancelled",
        }
    }
}

fn stderr_suffix(tail: &str) -> String {
    let tail = tail.trim();
    if tail.is_empty() {
        String::new()
    } else {
        format!("; stderr: {tail}")
    }
}

fn humanize(after: Duration) -> String {
    if after.subsec_millis() == 0 {
        format!("{}s", after.as_secs())
    } else {
        format!("{}ms", after.as_millis())
    }
}

/// An error and its sources joined with `: ` (rmcp and reqwest keep the useful
/// part of the message in the source chain).
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
