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
        }
    }

    pub fn subjects(&self) -> Result<Subjects, ConfigError> {
        Subjects::new(&self.subject_prefix).map_err(|source| ConfigError::SubjectPrefix {
            value: self.subject_prefix.clone(),
            source,
        })
    }
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
}
