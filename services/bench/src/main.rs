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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Cli { args } = ctxsync_runtime::args::parse::<Cli>();
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
