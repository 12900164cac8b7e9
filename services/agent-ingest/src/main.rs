use clap::Parser;

/// agent-ingest: the workspace agents' HTTP edge.
#[derive(Parser)]
#[command(name = "agent-ingest", version)]
struct Cli {
    #[command(flatten)]
    config: agent_ingest::Config,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let _telemetry = ctxsync_runtime::telemetry::init_service("agent-ingest", &cli.config.common)?;
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    agent_ingest::run(cli.config, shutdown).await?;
    Ok(())
}
