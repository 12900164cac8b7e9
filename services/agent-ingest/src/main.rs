use clap::Parser;

/// agent-ingest: the workspace agents' HTTP edge.
#[derive(Parser)]
#[command(name = "agent-ingest", version)]
struct Cli {
    #[command(flatten)]
    config: agent_ingest::Config,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let format = cli.config.common.log_format;
    let telemetry =
        match ctxsync_runtime::telemetry::init_service("agent-ingest", &cli.config.common) {
            Ok(telemetry) => telemetry,
            Err(error) => {
                return ctxsync_runtime::telemetry::exit_on_error(
                    format,
                    "agent-ingest",
                    Err(error),
                );
            }
        };
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    let result = agent_ingest::run(cli.config, shutdown).await;
    let code = ctxsync_runtime::telemetry::exit_on_error(format, "agent-ingest", result);
    drop(telemetry);
    code
}
