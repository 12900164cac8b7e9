//! `tracing` setup: text or JSON lines on stderr, filtered by `CTXSYNC_LOG`.

use tracing_subscriber::EnvFilter;

use crate::LogFormat;

/// Installs the global subscriber. Returns an error naming the bad filter.
pub fn init(format: LogFormat, filter: &str) -> Result<(), TelemetryError> {
    let env_filter =
        EnvFilter::try_new(with_quiet_rmcp(filter)).map_err(|e| TelemetryError::Filter {
            value: filter.to_owned(),
            reason: e.to_string(),
        })?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
    result.map_err(|e| TelemetryError::Install(e.to_string()))
}

/// rmcp logs transport failures with the full server URL (credentials,
/// path and query included): it is silenced unless the operator names it.
pub fn with_quiet_rmcp(filter: &str) -> String {
    if filter.contains("rmcp") {
        filter.to_owned()
    } else if filter.trim().is_empty() {
        "rmcp=off".to_owned()
    } else {
        format!("{filter},rmcp=off")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid CTXSYNC_LOG {value:?}: {reason}")]
    Filter { value: String, reason: String },
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
}
