use clap::Parser;

/// snapshot-store: commits agents' discovery reports and publishes discovery events.
#[derive(Parser)]
#[command(name = "snapshot-store", version)]
struct Cli {
    #[command(flatten)]
    config: snapshot_store::Config,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let format = cli.config.common.log_format;
    let telemetry =
        match ctxsync_runtime::telemetry::init_service("snapshot-store", &cli.config.common) {
            Ok(telemetry) => telemetry,
            Err(error) => {
                return ctxsync_runtime::telemetry::exit_on_error(
                    format,
                    "snapshot-store",
                    Err(error),
                );
            }
        };
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    let result = snapshot_store::run(cli.config, shutdown).await;
    let code = ctxsync_runtime::telemetry::exit_on_error(format, "snapshot-store", result);
    drop(telemetry);
    code
}
