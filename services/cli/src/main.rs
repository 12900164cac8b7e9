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
    /// Moved: the benchmark is its own binary, `ctxsync-bench` (package ctxsync-bench).
    #[command(hide = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
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
    /// Issue, list and revoke the tenant keys chat backends present to chat-gate.
    Tenant {
        #[command(flatten)]
        connection: Connection,
        #[command(subcommand)]
        command: TenantCommand,
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
    /// Register an agent and print its id and token (the token is shown only
    /// once), or write the token to --token-file.
    Register {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        workspace: String,
        #[arg(long)]
        name: String,
        /// Write the token to this file (mode 0600, replaced atomically)
        /// instead of printing it.
        #[arg(long)]
        token_file: Option<std::path::PathBuf>,
        /// With --token-file, when the agent exists already: fail, keep it
        /// (reuse the file's valid token, else give it a new one), or rotate
        /// (always a new token).
        #[arg(long, value_enum, default_value = "fail", requires = "token_file")]
        if_exists: ctxsync_cli::agent::IfExists,
        /// Print JSON.
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

#[derive(Subcommand)]
enum TenantCommand {
    /// Tenant keys (`Authorization: Bearer <key>` on chat-gate's HTTP API).
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Issue a key for a tenant and print it (shown only once; the store keeps its SHA-256).
    Create {
        #[arg(long)]
        tenant: String,
        /// A note on who uses the key (no secrets; shown by `list`).
        #[arg(long, default_value = "")]
        label: String,
        /// Print `{"key_id": ..., "tenant": ..., "key": ...}`.
        #[arg(long)]
        json: bool,
    },
    /// List keys (never the keys themselves): all tenants', or one's.
    List {
        #[arg(long)]
        tenant: Option<String>,
        /// Also list revoked keys.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by its id (`tk_…`, from `list`); gates refuse it at once.
    Revoke { key_id: String },
}

/// An error is one line (its causes after colons) and exit code 1: an
/// operator gets what went wrong and what to do, never a backtrace, whatever
/// `RUST_BACKTRACE` says.
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

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Up(args) => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, &args.log_filter)?;
            let shutdown = ctxsync_runtime::shutdown::on_signals();
            ctxsync_cli::up::run(args, shutdown).await
        }
        Command::Bench { args } => anyhow::bail!(
            "the benchmark moved out of the operator CLI: run `cargo build --release -p ctxsync-bench && target/release/ctxsync-bench {}`",
            args.join(" ")
        ),
        Command::Migrate { database } => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn")?;
            let pool = ctxsync_runtime::db::connect(&database).await?;
            snapshot_store::Store::migrate(&pool).await.map_err(|e| {
                anyhow::anyhow!(
                    "snapshot schema migrations failed: {}",
                    ctxsync_runtime::db::describe_migrate(&e)
                )
            })?;
            catalog::store::migrate(&pool).await.map_err(|e| {
                anyhow::anyhow!(
                    "catalog schema migrations failed: {}",
                    ctxsync_runtime::db::describe_migrate(&e)
                )
            })?;
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
            catalog::store::migrate(&pool).await.map_err(|e| {
                anyhow::anyhow!(
                    "catalog schema migrations failed: {}",
                    ctxsync_runtime::db::describe_migrate(&e)
                )
            })?;
            let report = catalog::latency::report(&pool, since)
                .await
                .map_err(|e| anyhow::anyhow!("{}", ctxsync_runtime::db::describe(&e)))?;
            if json {
                println!("{}", report.render_json());
            } else {
                print!("{}", report.render_text());
            }
            Ok(())
        }
        Command::Tenant {
            connection,
            command: TenantCommand::Key { command },
        } => {
            ctxsync_runtime::telemetry::init(ctxsync_runtime::LogFormat::Text, "warn")?;
            tenant_key(connection, command).await
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
    // Validate, then act: a bad name is refused before anything is connected.
    if let AgentCommand::Register {
        tenant,
        workspace,
        name,
        ..
    } = &command
    {
        ctxsync_proto::ids::tenant(tenant).context("invalid --tenant")?;
        ctxsync_proto::ids::name("workspace", workspace).context("invalid --workspace")?;
        ctxsync_proto::ids::name("agent name", name).context("invalid --name")?;
    }
    let (subjects, nats) = connect(&connection).await?;
    let timeout = connection.timeout;
    match command {
        AgentCommand::Register {
            tenant,
            workspace,
            name,
            token_file: Some(token_file),
            if_exists,
            json,
        } => {
            let registered = ctxsync_cli::agent::register_to_file(
                &nats.client,
                &subjects,
                timeout,
                &tenant,
                &workspace,
                &name,
                &token_file,
                if_exists,
            )
            .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&registered.to_proto())?);
            } else {
                println!("agent_id   {}", registered.agent_id);
                println!("token_file {}", registered.token_file);
                println!("outcome    {}", registered.outcome);
            }
        }
        AgentCommand::Register {
            tenant,
            workspace,
            name,
            token_file: None,
            json,
            ..
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
                println!("{}", serde_json::to_string_pretty(&registered.to_proto())?);
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

/// The operator's NATS connection (TLS options included) and subjects.
async fn connect(
    connection: &Connection,
) -> anyhow::Result<(
    ctxsync_proto::subjects::Subjects,
    ctxsync_runtime::nats::NatsConnection,
)> {
    let subjects = ctxsync_proto::subjects::Subjects::new(&connection.subject_prefix)
        .context("invalid CTXSYNC_SUBJECT_PREFIX")?;
    let target = ctxsync_runtime::nats::NatsTarget {
        url: connection.nats_url.clone(),
        tls: connection.nats_tls.clone(),
        ..Default::default()
    };
    let nats = ctxsync_runtime::nats::connect(target, "ctxsync-cli").await?;
    Ok((subjects, nats))
}

async fn tenant_key(connection: Connection, command: KeyCommand) -> anyhow::Result<()> {
    let (subjects, nats) = connect(&connection).await?;
    let timeout = connection.timeout;
    match command {
        KeyCommand::Create {
            tenant,
            label,
            json,
        } => {
            let created =
                ctxsync_cli::tenant::create(&nats.client, &subjects, timeout, &tenant, &label)
                    .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&created.to_proto())?);
            } else {
                println!("key_id {}", created.key_id);
                println!("tenant {}", created.tenant);
                println!("key    {}", created.key);
                eprintln!("store the key now: it is not shown again");
            }
        }
        KeyCommand::List { tenant, all, json } => {
            let keys =
                ctxsync_cli::tenant::list(&nats.client, &subjects, timeout, tenant.as_deref(), all)
                    .await?;
            if json {
                // The store's own messages (no secret: the key itself is never stored).
                println!("{}", serde_json::to_string_pretty(&keys)?);
            } else {
                print!("{}", ctxsync_cli::tenant::render(&keys));
            }
        }
        KeyCommand::Revoke { key_id } => {
            let key =
                ctxsync_cli::tenant::revoke(&nats.client, &subjects, timeout, &key_id).await?;
            println!("revoked {} (tenant {})", key.key_id, key.tenant);
        }
    }
    Ok(())
}
