//! `workspace-agent`: publish this workspace's context to agent-ingest, or
//! `workspace-agent inspect` to print it once without publishing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use workspace_agent::args::{Cli, Command, Common};
use workspace_agent::{AgentConfig, AgentToken, DiscoverySettings, PublisherConfig};

const MCP_CA_OPTION: &str = "CTXSYNC_MCP_CA_FILE (--mcp-ca-file)";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let format = cli.common.log_format;
    let inspect = matches!(cli.command, Some(Command::Inspect { .. }));
    let filter = cli
        .common
        .log_filter
        .clone()
        .unwrap_or_else(|| if inspect { "warn" } else { "info" }.to_owned());
    // Crates that log credentials (rmcp, async_nats, ...) are capped there.
    if let Err(error) = ctxsync_runtime::telemetry::init(format, &filter) {
        return ctxsync_runtime::telemetry::exit_on_error(format, "workspace-agent", Err(error));
    }
    ctxsync_runtime::telemetry::exit_on_error(format, "workspace-agent", run(cli).await)
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let mcp_ca = cli
        .common
        .mcp_ca_file
        .as_ref()
        .map(|path| ctxsync_tls::PemFile::new(MCP_CA_OPTION, path));
    ctxsync_mcp::https::trust_extra_ca(mcp_ca.as_ref())?;
    let settings = discovery_settings(&cli.common)?;

    match cli.command {
        Some(Command::Inspect { json }) => {
            let report = workspace_agent::inspect::discover_once(settings).await;
            if json {
                let run_id = uuid::Uuid::new_v4().to_string();
                println!("{}", workspace_agent::inspect::to_json(&report, &run_id));
            } else {
                print!("{}", workspace_agent::inspect::to_table(&report));
            }
            Ok(())
        }
        None => {
            let ingest_url = cli
                .ingest_url
                .context("--ingest-url (CTXSYNC_INGEST_URL) is required")?;
            let token_file = cli
                .token_file
                .context("--token-file (CTXSYNC_AGENT_TOKEN_FILE) is required")?;
            let token = AgentToken::from_file(&token_file)?;
            let mut publisher = PublisherConfig::new(ingest_url, token);
            publisher.ingest_ca_file = cli.ingest_ca_file;
            publisher.reannounce_interval = cli.reannounce_interval;
            let config = AgentConfig {
                discovery: settings,
                publisher,
                watch: !cli.no_watch,
                watch_debounce: cli.watch_debounce,
                http_addr: cli.http_addr,
                http_limits: cli.http.limits()?,
            };
            let shutdown = ctxsync_runtime::shutdown::on_signals();
            workspace_agent::run(config, shutdown).await?;
            Ok(())
        }
    }
}

fn discovery_settings(common: &Common) -> anyhow::Result<DiscoverySettings> {
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let working_dir = match &common.workdir {
        Some(dir) if dir.is_absolute() => dir.clone(),
        Some(dir) => cwd.join(dir),
        None => cwd,
    };
    if !working_dir.is_dir() {
        anyhow::bail!(
            "the working directory {} (CTXSYNC_WORKDIR) is not a directory",
            working_dir.display()
        );
    }
    if common.mcp_concurrency == 0 {
        anyhow::bail!("CTXSYNC_MCP_CONCURRENCY must be at least 1");
    }
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let home = env
        .get("HOME")
        .map(PathBuf::from)
        .filter(|h| Path::new(h).is_absolute());
    Ok(DiscoverySettings {
        env,
        home,
        working_dir: Some(working_dir),
        handshake_timeout: common.handshake_timeout,
        max_concurrent_connects: common.mcp_concurrency,
        max_servers: common.mcp_max_servers,
    })
}
