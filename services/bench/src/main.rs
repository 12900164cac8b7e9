//! `ctxsync-bench`: the benchmark, apart from the operator commands.

use clap::Parser;

/// Measure wake, gate, push and catalog latency against raw NATS and Postgres
/// (targets: README, Benchmark).
#[derive(Parser)]
#[command(name = "ctxsync-bench", version)]
struct Cli {
    #[command(flatten)]
    args: ctxsync_bench::BenchArgs,
}

/// An error is one line and exit code 1, never a backtrace.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(ctxsync_runtime::args::parse::<Cli>()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(Cli { args }: Cli) -> anyhow::Result<()> {
    // sqlx's slow-statement warnings (CREATE/DROP DATABASE) would break the progress line.
    ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn,sqlx=error")?;
    let progress = ctxsync_bench::Progress::default();
    let report = Box::pin(ctxsync_bench::run(&args, &progress)).await?;
    if args.json {
        println!("{}", report.render_json());
    } else {
        print!("{}", report.render());
    }
    Ok(())
}
