//! TLS of `https://` MCP servers: rustls on ring, trusting the system's roots
//! plus, when the operator gives one, an extra CA (`CTXSYNC_MCP_CA_FILE` of
//! workspace-agent and catalog), for the whole process.

use std::sync::{Arc, OnceLock};

use ctxsync_tls::rustls::ClientConfig;
use ctxsync_tls::{PemFile, TlsError};

use crate::error::McpError;

static TRUST: OnceLock<Arc<ClientConfig>> = OnceLock::new();

/// Trusts `extra_ca` (besides the system's roots) for every `https://` MCP
/// server this process connects to. Call once at startup, before the first
/// connection; a later call changes nothing and says so.
pub fn trust_extra_ca(extra_ca: Option<&PemFile>) -> Result<(), TlsError> {
    let config = Arc::new(ctxsync_tls::client_config(extra_ca, None)?);
    if TRUST.set(config).is_err() {
        tracing::warn!("the MCP https trust was already set: the new one is ignored");
    }
    Ok(())
}

/// The HTTP client of one streamable-HTTP connection.
pub(crate) fn http_client() -> Result<reqwest::Client, McpError> {
    ctxsync_tls::install_default_provider();
    let config = match TRUST.get() {
        Some(config) => config.clone(),
        None => {
            // No extra CA: the system's roots (cannot fail without a file).
            let config =
                ctxsync_tls::client_config(None, None).map_err(|e| McpError::Transport {
                    message: e.to_string(),
                })?;
            TRUST.get_or_init(|| Arc::new(config)).clone()
        }
    };
    reqwest::Client::builder()
        .tls_backend_preconfigured((*config).clone())
        .build()
        .map_err(|e| McpError::Transport {
            message: format!("cannot build the http client: {e}"),
        })
}
