//! The `ctxsync` operator commands, as a library the binary and tests share.

pub mod agent;
pub mod demo;
pub mod tenant;
pub mod up;

use std::time::Duration;

/// How the CLI reaches the services.
#[derive(Debug, Clone, clap::Args)]
pub struct Connection {
    /// NATS server URL, or a comma-separated list of a cluster's URLs.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", value_parser = ctxsync_runtime::config::NatsUrlParser)]
    pub nats_url: String,

    #[command(flatten)]
    pub nats_tls: ctxsync_runtime::NatsTlsArgs,

    /// Prefix of every NATS subject.
    #[arg(long, env = "CTXSYNC_SUBJECT_PREFIX", default_value = ctxsync_proto::subjects::DEFAULT_PREFIX)]
    pub subject_prefix: String,

    /// How long to wait for a service's answer.
    #[arg(long, env = "CTXSYNC_CLI_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}
