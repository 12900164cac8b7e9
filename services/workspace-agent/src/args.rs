//! The agent binary's flags, here so that the library's defaults are
//! theirs (see [`Cli::defaults`]) instead of restating them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ctxsync_runtime::LogFormat;
use ctxsync_runtime::config::HttpArgs;

// No doc comment: the help's about is the package's description.
#[derive(Debug, Parser)]
#[command(name = "workspace-agent", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// agent-ingest's base URL (`https://` or `http://`).
    #[arg(long, env = "CTXSYNC_INGEST_URL")]
    pub ingest_url: Option<String>,

    /// PEM CA certificate(s) to trust for an https:// ingest URL, besides the system's roots.
    #[arg(long, env = "CTXSYNC_INGEST_CA_FILE")]
    pub ingest_ca_file: Option<PathBuf>,

    /// File holding this agent's token.
    #[arg(long, env = "CTXSYNC_AGENT_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    #[command(flatten)]
    pub common: Common,

    /// Address for /healthz, /readyz and /metrics (none when unset).
    #[arg(long, env = "CTXSYNC_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,

    #[command(flatten)]
    pub http: HttpArgs,

    /// Wait this long after a context file changes before reloading.
    #[arg(long, env = "CTXSYNC_WATCH_DEBOUNCE", default_value = "300ms", value_parser = humantime::parse_duration)]
    pub watch_debounce: Duration,

    /// Do not watch the context files.
    #[arg(long, env = "CTXSYNC_NO_WATCH")]
    pub no_watch: bool,

    /// Re-announce this process to the store this often, so a takeover of
    /// its agent by a late message is noticed and undone even when nothing
    /// changes (0s: never).
    #[arg(long, env = "CTXSYNC_REANNOUNCE_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub reannounce_interval: Duration,
}

#[derive(Debug, clap::Args)]
pub struct Common {
    /// The workspace's working directory (relative paths resolve against it).
    #[arg(long, env = "CTXSYNC_WORKDIR", global = true)]
    pub workdir: Option<PathBuf>,

    /// Per-server bound on the MCP handshake (and on listing tools).
    #[arg(long, env = "CTXSYNC_MCP_HANDSHAKE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration, global = true)]
    pub handshake_timeout: Duration,

    /// PEM CA certificate(s) to trust for https:// MCP servers, besides the system's roots.
    #[arg(long, env = "CTXSYNC_MCP_CA_FILE", global = true)]
    pub mcp_ca_file: Option<PathBuf>,

    /// MCP servers connecting at the same time, at most.
    #[arg(
        long,
        env = "CTXSYNC_MCP_CONCURRENCY",
        default_value_t = 8,
        global = true
    )]
    pub mcp_concurrency: usize,

    /// MCP servers started per workspace, at most; the rest are reported
    /// as not started (on their config file's row).
    #[arg(
        long,
        env = "CTXSYNC_MCP_MAX_SERVERS",
        // Far more than a person configures, far less than a push can carry rows for.
        default_value_t = 200,
        global = true
    )]
    pub mcp_max_servers: usize,

    /// Log format.
    #[arg(
        long,
        env = "CTXSYNC_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,

    /// Log filter (tracing EnvFilter syntax); `inspect` defaults to warnings only.
    #[arg(
        long = "log-filter",
        visible_alias = "log",
        env = "CTXSYNC_LOG",
        global = true
    )]
    pub log_filter: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run discovery once and print the resolved config and the full report
    /// (nothing is published).
    Inspect {
        /// Print the report as JSON (the push the agent would send).
        #[arg(long)]
        json: bool,
    },
}

impl Cli {
    /// The flags unset (no argument given, no env var read).
    pub fn defaults() -> Self {
        use clap::CommandFactory as _;
        let command = Self::command().mut_args(|arg| arg.env(None::<&'static str>));
        let matches = command
            .try_get_matches_from(["workspace-agent"])
            .expect("the agent's defaults parse");
        clap::FromArgMatches::from_arg_matches(&matches).expect("the agent's defaults parse")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let cli = Cli::defaults();
        assert_eq!(cli.reannounce_interval, Duration::from_secs(30));
        assert_eq!(cli.watch_debounce, Duration::from_millis(300));
        assert_eq!(cli.common.handshake_timeout, Duration::from_secs(30));
        assert_eq!(cli.common.mcp_max_servers, 200);
        assert_eq!(cli.common.mcp_concurrency, 8);
        assert!(cli.command.is_none() && !cli.no_watch);
    }
}
