use clap::Parser;

/// snapshot-store: commits agents' discovery reports and publishes discovery events.
#[derive(Parser)]
#[command(name = "snapshot-store", version)]
struct Cli {
    #[command(flatten)]
    config: snapshot_store::Config,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let _telemetry =
        ctxsync_runtime::telemetry::init_service("snapshot-store", &cli.config.common)?;
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    snapshot_store::run(cli.config, shutdown).await?;
    Ok(())
}
