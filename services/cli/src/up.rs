//! `ctxsync up`: every service in one process (still talking over NATS), with
//! defaults that work on a fresh machine; `--demo` also runs a workspace agent
//! against a demo workspace and shows a chat's first turn being held and woken.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use ctxsync_proto::rpc::{TenantSubject, catalog as catalog_rpc};
use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::Shutdown;
use ctxsync_stack::{StackBuilder, deps};

/// `ctxsync up` options.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// NATS server URL or a comma-separated list of a cluster's URLs; when
    /// unset, 127.0.0.1:4222 if it answers, else a private nats-server.
    #[arg(long, env = "NATS_URL", value_parser = ctxsync_runtime::config::NatsUrlParser)]
    pub nats_url: Option<String>,

    /// Postgres URL; when unset, 127.0.0.1:5432 if it answers (database `ctxsync`), else a private Postgres.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,

    /// Where private servers and demo files live.
    #[arg(long, env = "CTXSYNC_DATA_DIR", default_value = ".ctxsync")]
    pub data_dir: PathBuf,

    /// Prefix of every NATS subject.
    #[arg(long, env = "CTXSYNC_SUBJECT_PREFIX", default_value = ctxsync_proto::subjects::DEFAULT_PREFIX)]
    pub subject_prefix: String,

    /// agent-ingest's listener (the agent API, health, metrics).
    #[arg(long, env = "CTXSYNC_INGEST_ADDR", default_value = "127.0.0.1:8080")]
    pub ingest_addr: SocketAddr,

    /// snapshot-store's listener (health, metrics).
    #[arg(long, env = "CTXSYNC_STORE_ADDR", default_value = "127.0.0.1:8081")]
    pub store_addr: SocketAddr,

    /// chat-gate's listener (the gate API, health, metrics).
    #[arg(long, env = "CTXSYNC_GATE_ADDR", default_value = "127.0.0.1:8082")]
    pub gate_addr: SocketAddr,

    /// catalog's listener (health, metrics).
    #[arg(long, env = "CTXSYNC_CATALOG_ADDR", default_value = "127.0.0.1:8083")]
    pub catalog_addr: SocketAddr,

    /// The catalog's tenants-and-servers YAML (see deploy/catalog.example.yaml);
    /// when unset the catalog runs with no servers (with `--demo`: the demo's).
    #[arg(long, env = "CTXSYNC_CATALOG_CONFIG")]
    pub catalog_config: Option<PathBuf>,

    /// Also run a workspace agent against the demo workspace and show a first turn.
    #[arg(long)]
    pub demo: bool,

    /// The demo workspace to copy and discover.
    #[arg(
        long,
        env = "CTXSYNC_DEMO_WORKSPACE",
        default_value = "deploy/demo/workspace"
    )]
    pub demo_workspace: PathBuf,

    /// Stop after the demo instead of serving until SIGTERM.
    #[arg(long)]
    pub exit_after_demo: bool,

    /// Log filter for the services.
    #[arg(long, env = "CTXSYNC_LOG", default_value = "warn")]
    pub log_filter: String,
}

/// Validate, then act: a busy port or a missing demo workspace is refused
/// naming `up`'s own setting, before a dependency starts or an agent is
/// registered.
fn check_before_starting(args: &UpArgs) -> anyhow::Result<()> {
    let listeners = [
        ("--ingest-addr", "CTXSYNC_INGEST_ADDR", args.ingest_addr),
        ("--store-addr", "CTXSYNC_STORE_ADDR", args.store_addr),
        ("--gate-addr", "CTXSYNC_GATE_ADDR", args.gate_addr),
        ("--catalog-addr", "CTXSYNC_CATALOG_ADDR", args.catalog_addr),
    ];
    for (flag, env, addr) in listeners {
        if addr.port() == 0 {
            continue;
        }
        std::net::TcpListener::bind(addr).map_err(|error| {
            anyhow::anyhow!(
                "cannot listen on {addr} ({flag} / {env}): {error}; choose another port with {flag}"
            )
        })?;
    }
    if args.demo && !args.demo_workspace.is_dir() {
        anyhow::bail!(
            "the demo workspace {} (--demo-workspace / CTXSYNC_DEMO_WORKSPACE) is not a directory: \
             run from the repository root or point it at deploy/demo/workspace",
            args.demo_workspace.display()
        );
    }
    Ok(())
}

/// Runs agent-ingest, snapshot-store, chat-gate and catalog (one stack,
/// built by `ctxsync-stack`) until `shutdown`.
pub async fn run(args: UpArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    check_before_starting(&args)?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create CTXSYNC_DATA_DIR {}", args.data_dir.display()))?;
    let data_dir = args
        .data_dir
        .canonicalize()
        .context("cannot resolve CTXSYNC_DATA_DIR")?;
    let nats = deps::nats(args.nats_url.as_deref(), &data_dir).await?;
    let postgres = deps::postgres(args.database_url.as_deref(), &data_dir).await?;
    println!("dependencies");
    println!("  nats      {}  ({})", nats.url, nats.origin);
    println!(
        "  postgres  {}  ({})",
        ctxsync_runtime::nats::redact_url(&postgres.url),
        postgres.origin
    );

    let servers =
        match (&args.catalog_config, args.demo) {
            (Some(path), _) => catalog::config::CatalogConfig::load(path)
                .context("invalid CTXSYNC_CATALOG_CONFIG")?,
            (None, true) => crate::demo::catalog_config(&data_dir)?,
            (None, false) => catalog::config::CatalogConfig::from_yaml("tenants: []")
                .map_err(anyhow::Error::msg)?,
        };
    let stack = StackBuilder::new(nats.url.clone(), args.subject_prefix.clone())
        .database(postgres.url.clone())
        .store(|c| c.common.http_addr = args.store_addr)
        .ingest(|c| c.common.http_addr = args.ingest_addr)
        .gate(|c| c.common.http_addr = args.gate_addr)
        .catalog(servers, catalog::Settings::default(), |c| {
            c.common.http_addr = args.catalog_addr
        })
        .start(&shutdown)
        .await?;
    let (store, ingest, gate, catalog) =
        (stack.store(), stack.ingest(), stack.gate(), stack.catalog());

    println!("services");
    println!(
        "  agent-ingest    http://{}  (POST /api/v1/agent/startup, /api/v1/agent/context-state)",
        ingest.http_addr()
    );
    println!(
        "  snapshot-store  http://{}  (health, metrics)",
        store.http_addr()
    );
    println!(
        "  chat-gate       http://{}  (POST /api/v1/gate, GET /api/v1/agents/{{id}}/context; Bearer key from `ctxsync tenant key create`)",
        gate.http_addr()
    );
    let subjects = Subjects::new(&args.subject_prefix)?;
    println!(
        "  context page    http://{}/ui/  (enter a tenant key)",
        gate.http_addr()
    );
    println!(
        "  catalog         http://{}  (NATS {}, {})",
        catalog.http_addr(),
        catalog_rpc::Prepare::subject(&subjects, "<tenant>"),
        catalog_rpc::Call::subject(&subjects, "<tenant>"),
    );
    println!("  subjects        {}.>", args.subject_prefix);

    let mut demo_result = Ok(());
    if args.demo {
        demo_result = crate::demo::run(
            &crate::demo::DemoSetup {
                nats: &nats,
                subjects: &subjects,
                ingest_url: format!("http://{}", ingest.http_addr()),
                data_dir: &data_dir,
                workspace: &args.demo_workspace,
            },
            shutdown.clone(),
        )
        .await;
        if args.exit_after_demo || demo_result.is_err() {
            shutdown.cancel();
        }
    }
    if !shutdown.is_cancelled() {
        println!("ready; stop with Ctrl-C or SIGTERM");
    }
    shutdown.cancelled().await;
    let stopping = Instant::now();
    stack.join().await;
    eprintln!("stopped in {:?}", stopping.elapsed());
    drop(postgres);
    drop(nats);
    demo_result
}
