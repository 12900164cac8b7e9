//! Graceful shutdown: SIGTERM or SIGINT cancels a token every task watches.

use tokio_util::sync::CancellationToken;

/// Cancelled when the process should stop taking work and finish in-flight work.
pub type Shutdown = CancellationToken;

/// A token cancelled on the first SIGTERM or SIGINT.
pub fn on_signals() -> Shutdown {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        let signal = wait_for_signal().await;
        tracing::info!(signal, "shutdown requested");
        trigger.cancel();
    });
    token
}

async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM; only SIGINT stops the process");
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    }
}
