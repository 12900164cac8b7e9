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
async fn main() -> anyhow::Result<()> {
    let cli = ctxsync_runtime::args::parse::<Cli>();
    let _telemetry = ctxsync_runtime::telemetry::init_service("chat-gate", &cli.config.common)?;
    let shutdown = ctxsync_runtime::shutdown::on_signals();
    chat_gate::run(cli.config, shutdown).await?;
    Ok(())
}
