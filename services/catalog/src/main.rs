//! The catalog service binary: flags and env in, `catalog::run` until SIGTERM.

use anyhow::Context as _;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "catalog",
    version,
    about = "ctxsync catalog: the MCP runtime for operator-configured servers"
)]
struct Cli {
    #[command(flatten)]
    args: catalog::Args,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = ctxsync_runtime::args::parse::<Cli>().args;
    let format = args.common.log_format;
    let telemetry = match ctxsync_runtime::telemetry::init_service("catalog", &args.common) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            return ctxsync_runtime::telemetry::exit_on_error(format, "catalog", Err(error));
        }
    };
    let code = ctxsync_runtime::telemetry::exit_on_error(format, "catalog", serve(args).await);
    drop(telemetry);
    code
}

async fn serve(args: catalog::Args) -> anyhow::Result<()> {
    let config_path = args.catalog.config.clone();
    let mcp_ca = args
        .mcp_ca_file
        .as_ref()
        .map(|path| ctxsync_tls::PemFile::new("CTXSYNC_MCP_CA_FILE (--mcp-ca-file)", path));
    ctxsync_mcp::https::trust_extra_ca(mcp_ca.as_ref())?;
    let config = args
        .catalog
        .into_config(args.common, args.database)
        .context("invalid configuration")?;
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    // Boxed: the service's start holds a large future only once.
    let running = Box::pin(catalog::start(config, shutdown)).await?;
    tokio::spawn(reload_on_sighup(config_path, running.reloader()));
    running.join().await;
    Ok(())
}

/// SIGHUP re-reads the config file; an invalid file keeps the running config.
async fn reload_on_sighup(path: std::path::PathBuf, reloader: catalog::Reloader) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; config reload disabled");
        return;
    };
    while hangups.recv().await.is_some() {
        match catalog::CatalogConfig::load(&path) {
            Ok(servers) => {
                if let Err(error) = reloader.reload(servers) {
                    tracing::error!(%error, "config not reloaded; the running config stays");
                }
            }
            Err(error) => tracing::error!(%error, "config not reloaded; the running config stays"),
        }
    }
}
