//! Flags and env vars every service reads. Each flag has an env var of the same
//! meaning; flags win over env, env wins over the default.

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_proto::subjects::{SubjectError, Subjects};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Options shared by every service.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,

    /// Prefix of every NATS subject, so environments can share one NATS server.
    #[arg(long, env = "CTXSYNC_SUBJECT_PREFIX", default_value = ctxsync_proto::subjects::DEFAULT_PREFIX)]
    pub subject_prefix: String,

    /// Address of the HTTP listener (health, readiness, metrics and the service's API).
    #[arg(long, env = "CTXSYNC_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,

    /// Log format.
    #[arg(long, env = "CTXSYNC_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "CTXSYNC_LOG", default_value = "info")]
    pub log_filter: String,

    /// How long in-flight work may take to finish after SIGTERM.
    #[arg(long, env = "CTXSYNC_SHUTDOWN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,

    /// OTLP/HTTP collector to export spans to, e.g. `http://collector:4318`
    /// (`/v1/traces` is appended). Unset: no spans are exported.
    #[arg(long, env = "CTXSYNC_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl CommonArgs {
    /// Defaults suitable for tests and embedding: an ephemeral HTTP port.
    pub fn for_nats(nats_url: impl Into<String>, subject_prefix: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            subject_prefix: subject_prefix.into(),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            log_format: LogFormat::Text,
            log_filter: "info".into(),
            shutdown_grace: Duration::from_secs(10),
            otlp_endpoint: None,
        }
    }

    pub fn subjects(&self) -> Result<Subjects, ConfigError> {
        Subjects::new(&self.subject_prefix).map_err(|source| ConfigError::SubjectPrefix {
            value: self.subject_prefix.clone(),
            source,
        })
    }

    /// The URL spans are posted to, when `--otlp-endpoint` is set.
    pub fn otlp_traces_url(&self) -> Result<Option<String>, ConfigError> {
        match self.otlp_endpoint.as_deref().map(str::trim) {
            None | Some("") => Ok(None),
            Some(value) => otlp_traces_url(value).map(Some),
        }
    }
}

/// The base URL plus `/v1/traces`, as OTLP/HTTP's `OTEL_EXPORTER_OTLP_ENDPOINT`
/// is read; a URL that already names `/v1/traces` is kept.
fn otlp_traces_url(value: &str) -> Result<String, ConfigError> {
    let invalid = |reason: String| ConfigError::OtlpEndpoint {
        value: crate::nats::redact_url(value),
        reason,
    };
    let mut url = url::Url::parse(value).map_err(|e| invalid(e.to_string()))?;
    match url.scheme() {
        "http" => {}
        // The exporter's client is built without TLS: collectors are reached in-cluster.
        "https" => {
            return Err(invalid(
                "https is not supported: use the collector's http endpoint".into(),
            ));
        }
        other => return Err(invalid(format!("expected an http URL, not {other}"))),
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid("the URL has no host".into()));
    }
    // Export errors quote the URL: credentials go in OTEL_EXPORTER_OTLP_HEADERS.
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            "credentials in the URL are not supported: set OTEL_EXPORTER_OTLP_HEADERS".into(),
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid("the URL has a query or fragment".into()));
    }
    if !url.path().trim_end_matches('/').ends_with("/v1/traces") {
        url.path_segments_mut()
            .map_err(|()| invalid("the URL cannot be a base".into()))?
            .pop_if_empty()
            .extend(["v1", "traces"]);
    }
    Ok(url.to_string())
}

/// Options of services that own a database.
#[derive(Debug, Clone, clap::Args)]
pub struct DatabaseArgs {
    /// Postgres URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/ctxsync"
    )]
    pub database_url: String,

    /// Maximum connections in the pool.
    #[arg(long, env = "CTXSYNC_DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,
}

impl DatabaseArgs {
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            db_max_connections: 16,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid CTXSYNC_SUBJECT_PREFIX {value:?}: {source}")]
    SubjectPrefix {
        value: String,
        #[source]
        source: SubjectError,
    },
    #[error("invalid CTXSYNC_OTLP_ENDPOINT {value:?}: {reason}")]
    OtlpEndpoint { value: String, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traces_url(endpoint: &str) -> Result<Option<String>, ConfigError> {
        CommonArgs {
            otlp_endpoint: Some(endpoint.to_owned()),
            ..CommonArgs::for_nats("nats://127.0.0.1:4222", "ctxsync")
        }
        .otlp_traces_url()
    }

    #[test]
    fn otlp_endpoint_is_a_base_url_of_http() {
        let unset = CommonArgs::for_nats("nats://127.0.0.1:4222", "ctxsync");
        assert_eq!(unset.otlp_traces_url().unwrap(), None);
        assert_eq!(traces_url("  ").unwrap(), None);
        for (given, used) in [
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            (
                "http://collector:4318/otlp",
                "http://collector:4318/otlp/v1/traces",
            ),
            (
                "http://collector:4318/v1/traces",
                "http://collector:4318/v1/traces",
            ),
        ] {
            assert_eq!(traces_url(given).unwrap().as_deref(), Some(used), "{given}");
        }
    }

    #[test]
    fn a_bad_otlp_endpoint_names_the_variable_and_the_value() {
        for (given, reason) in [
            ("collector:4318", "expected an http URL, not collector"),
            ("not a url", "relative URL without a base"),
            ("https://collector:4318", "https is not supported"),
            ("grpc://collector:4317", "expected an http URL, not grpc"),
            ("http://collector:4318/?x=1", "query or fragment"),
        ] {
            let message = traces_url(given).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!("invalid CTXSYNC_OTLP_ENDPOINT {given:?}: ")),
                "{message}"
            );
            assert!(message.contains(reason), "{message}");
        }
        for given in [
            "ftp://user:secret@collector",
            "http://user:secret@collector:4318",
        ] {
            let message = traces_url(given).unwrap_err().to_string();
            assert!(!message.contains("secret"), "{message}");
            assert!(message.contains("[redacted]@collector"), "{message}");
        }
    }
}
