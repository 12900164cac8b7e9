use anyhow::Context;
use clap::{Parser, Subcommand};
use ctxsync_cli::Connection;

/// ctxsync operator commands.
#[derive(Parser)]
#[command(name = "ctxsync", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run agent-ingest, snapshot-store, chat-gate and catalog in one process (`--demo`: and show a first turn).
    Up(ctxsync_cli::up::UpArgs),
    /// Measure wake, gate, push and catalog latency against raw NATS and Postgres (DESIGN §7).
    Bench(ctxsync_cli::bench::BenchArgs),
    /// Apply every service's database migrations and exit (run once before the services start).
    Migrate {
        #[command(flatten)]
        database: ctxsync_runtime::DatabaseArgs,
    },
    /// Print latency aggregates of recent chat setups (never any content).
    Latency {
        /// How far back to look, e.g. 1h, 7d.
        #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
        since: std::time::Duration,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        database: ctxsync_runtime::DatabaseArgs,
    },
    /// Register agents and inspect what they reported.
    Agent {
        #[command(flatten)]
        connection: Connection,
        #[command(subcommand)]
        command: AgentCommand,
    },
}

#[derive(Subcommand)]
enum AgentCommand {
    /// Register an agent and print its id and token (the token is shown only once).
    Register {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        workspace: String,
        #[arg(long)]
        name: String,
        /// Print `{"agent_id": ..., "token": ...}`.
        #[arg(long)]
        json: bool,
    },
    /// Print an agent's committed discovery report.
    Show {
        agent_id: String,
        /// Print the report as proto3 JSON.
        #[arg(long)]
        json: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Up(args) => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, &args.log_filter)?;
            let shutdown = ctxsync_runtime::shutdown::on_signals();
            ctxsync_cli::up::run(args, shutdown).await
        }
        Command::Bench(args) => {
            // sqlx's slow-statement warnings (CREATE/DROP DATABASE) would break the progress line.
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn,sqlx=error")?;
            let progress = ctxsync_cli::bench::Progress::default();
            let report = Box::pin(ctxsync_cli::bench::run(&args, &progress)).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.render());
            }
            Ok(())
        }
        Command::Migrate { database } => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn")?;
            let pool = ctxsync_runtime::db::connect(&database).await?;
            snapshot_store::Store::migrate(&pool)
                .await
                .context("snapshot schema migrations failed")?;
            catalog::store::migrate(&pool)
                .await
                .context("catalog schema migrations failed")?;
            println!("migrations applied: snapshot, catalog");
            Ok(())
        }
        Command::Latency {
            since,
            json,
            database,
        } => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn")?;
            let pool = ctxsync_runtime::db::connect(&database).await?;
            catalog::store::migrate(&pool)
                .await
                .context("catalog schema migrations failed")?;
            let report = catalog::latency::report(&pool, since).await?;
            if json {
                println!("{}", report.render_json());
            } else {
                print!("{}", report.render_text());
            }
            Ok(())
        }
        Command::Agent {
            connection,
            command,
        } => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn")?;
            agent(connection, command).await
        }
    }
}

async fn agent(connection: Connection, command: AgentCommand) -> anyhow::Result<()> {
    let subjects = ctxsync_proto::subjects::Subjects::new(&connection.subject_prefix)
        .context("invalid CTXSYNC_SUBJECT_PREFIX")?;
    let target = ctxsync_runtime::nats::NatsTarget {
        url: connection.nats_url.clone(),
        tls: connection.nats_tls.clone(),
    };
    let nats = ctxsync_runtime::nats::connect(target, "ctxsync-cli").await?;
    let timeout = connection.timeout;
    match command {
        AgentCommand::Register {
            tenant,
            workspace,
            name,
            json,
        } => {
            let registered = ctxsync_cli::agent::register(
                &nats.client,
                &subjects,
                timeout,
                &tenant,
                &workspace,
                &name,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&registered)?);
            } else {
                println!("agent_id {}", registered.agent_id);
                println!("token    {}", registered.token);
                eprintln!("store the token now: it is not shown again");
            }
        }
        AgentCommand::Show { agent_id, json } => {
            let state =
                ctxsync_cli::agent::show(&nats.client, &subjects, timeout, &agent_id).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&state)?);
            } else {
                print!("{}", ctxsync_cli::agent::render(&state));
            }
        }
    }
    Ok(())
}
