use clap::Parser;

/// chat-gate: lets a chat's first turn wait for the agent's discovery and
/// answers the chat projection of its context.
#[derive(Parser)]
#[command(name = "chat-gate", version)]
struct Cli {
    #[command(flatten)]
    config: chat_gate::Config,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let format = cli.config.common.log_format;
    let telemetry = match ctxsync_runtime::telemetry::init_service("chat-gate", &cli.config.common)
    {
        Ok(telemetry) => telemetry,
        Err(error) => {
            return ctxsync_runtime::telemetry::exit_on_error(format, "chat-gate", Err(error));
        }
    };
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    let result = chat_gate::run(cli.config, shutdown).await;
    let code = ctxsync_runtime::telemetry::exit_on_error(format, "chat-gate", result);
    drop(telemetry);
    code
}
