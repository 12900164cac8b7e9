//! `ctxsync-bench`: the numbers the README's Benchmark section names
//! (wake, ready gate answer, push throughput, catalog preparation), measured
//! in one run against a real nats-server and a real Postgres, each next to
//! the raw floor it is compared with.
//!
//! The services (snapshot-store, agent-ingest, chat-gate, catalog) run in this
//! process, started by the stack builder (`ctxsync-stack`), or with `--mode
//! deployed` each as its own process, two replicas each, on a three-node NATS
//! cluster (the catalog section: two catalog processes sharing their memory), on a fresh database
//! (`ctxsync_bench_<random>`, dropped at the end) and a fresh subject prefix,
//! so a bench never touches an installation's data. They still talk only over
//! NATS and HTTP, exactly as when deployed separately.

mod catalog_prep;
mod env;
mod floors;
mod mcp_path;
mod push;
mod report;
mod services;
mod stats;
mod steps;
mod wake;

pub use report::Report;
pub use steps::Mode;
use steps::Sizes;
pub use steps::{BenchArgs, BenchError, Progress};

/// Runs every section and returns the report (the caller prints it).
pub async fn run(args: &BenchArgs, progress: &Progress) -> Result<Report, BenchError> {
    let sizes = Sizes::new(args.quick);
    progress.step("starting nats, postgres and the services");
    let env = Box::pin(env::Env::start(args)).await?;
    let result = sections(&env, &sizes, args.quick, progress).await;
    progress.step("stopping the services and dropping the bench database");
    env.stop().await;
    progress.done();
    result
}

async fn sections(
    env: &env::Env,
    sizes: &Sizes,
    quick: bool,
    progress: &Progress,
) -> Result<Report, BenchError> {
    let mut report = Report::new(quick, env.describe());

    progress.step("floors: raw NATS publish→subscribe");
    report.floors.nats_pub_sub =
        floors::pub_sub(env, sizes.floor_samples, std::time::Duration::ZERO).await?;
    progress.step("floors: raw NATS publish→subscribe after idleness");
    let idle_samples = (sizes.floor_samples / 6).max(50);
    report.floors.nats_pub_sub_idle = floors::pub_sub(env, idle_samples, floors::IDLE_GAP).await?;
    progress.step("floors: raw NATS two hops after idleness");
    // On a cluster, on the nodes the wake's hops use: a hop between two
    // nodes costs a route more than one within a node. Sampled between the
    // 1-chat wake's rounds, which it is the floor of.
    let placement = floors::WakePlacement::of(env).await?;
    let mut two_hops = floors::TwoHops::open(env, placement.as_ref()).await?;
    progress.step("floors: raw NATS request/reply");
    report.floors.nats_request_reply =
        floors::request_reply(env, sizes.floor_samples, placement.as_ref()).await?;
    report.floors.two_hops_placement = placement.map(|placed| placed.describe());
    progress.step("floors: raw Postgres push-shaped transaction");
    report.floors.postgres = floors::postgres(env, sizes).await?;

    progress.step(format!("registering {} agents", sizes.agents));
    let agents = env.register_agents("chat", sizes.agents).await?;

    report.wake =
        wake::all_cases(env, &agents, sizes, &mut two_hops, idle_samples, progress).await?;
    // Without 1-chat rounds (or with few), the rest of the floor now.
    let missing = idle_samples.saturating_sub(two_hops.taken());
    two_hops.sample(missing, floors::IDLE_GAP).await?;
    report.floors.nats_two_hops_idle = two_hops.latency();
    report.memory = wake::memory(&report.wake, env.services.is_deployed());
    // After the wake cases: it publishes at the fan-out case's commit instants.
    if let Some(case) = report
        .wake
        .iter()
        .find(|c| c.agents > 0 && c.chats / c.agents == floors::FAN_OUT_REPLIES)
    {
        progress.step(
            "floors: raw NATS fan-out (one publish, ten replies) at the wake's commit instants",
        );
        report.floors.nats_fan_out = floors::fan_out(env, &case.commit_offsets).await?;
    }

    progress.step("gate answer when discovery is complete");
    let (store_read, gate_ready) = wake::gate_ready(env, &agents, sizes).await?;
    report.floors.store_read = store_read;
    report.gate_ready = gate_ready;

    progress.step("polling baseline (a waiter reading the store every 500 ms)");
    report.polling = wake::polling(env, &agents, sizes, &mut two_hops, progress).await?;
    drop(two_hops);

    progress.step("push throughput through agent-ingest");
    report.push = push::throughput(env, sizes).await?;

    report.catalog = catalog_prep::measure(env, sizes, progress).await?;
    report.mcp = match report.catalog.skipped.clone() {
        Some(why) => mcp_path::McpPath {
            skipped: Some(why),
            ..Default::default()
        },
        None => std::mem::take(&mut report.catalog.mcp),
    };

    let mut metrics = env.services.metrics_text().await;
    metrics.push_str(&report.catalog.metrics_text);
    report.metrics = report::metric_families(&metrics);
    report.evaluate();
    Ok(report)
}
