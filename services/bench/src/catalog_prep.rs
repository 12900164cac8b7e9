//! Catalog preparation: 8 operator-configured real MCP servers discovered
//! live (cold memory) versus pinned from the catalog's memory.
//!
//! The servers are the public reference servers `tests/mcp-servers/install.sh`
//! installs into `CTXSYNC_MCP_SERVERS_DIR` (default `~/.cache/ctxsync/mcp-servers`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use catalog::config::{CatalogConfig, Limits, ServerConfig, TenantConfig, TransportSpec};
use ctxsync_proto::rpc::catalog as catalog_rpc;
use ctxsync_proto::v1::{
    CatalogEndSessionRequest, CatalogPrepareReply, CatalogPrepareRequest, catalog_pin::Source,
};
use ctxsync_runtime::rpc;

use crate::env::Env;
use crate::mcp_path::{self, McpPath};
use crate::services::{Deployed, REPLICAS};
use crate::stats::Latency;
use crate::steps::{BenchError, Progress, Sizes, Step};
use ctxsync_stack::Service;

const TENANT: &str = "bench";
const PREPARE_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Default)]
pub struct CatalogPreparation {
    /// Set when the section did not run, and why.
    pub skipped: Option<String>,
    pub servers: Vec<String>,
    pub note: Option<String>,
    /// One preparation with a cold memory: every server started and handshaken.
    pub live_ms: f64,
    /// The catalog's own measure of that preparation.
    pub live_service_ms: u64,
    pub max_concurrent_starts: usize,
    /// Preparations of new sessions pinned from memory.
    pub warm: Latency,
    pub warm_all_pinned: bool,
    /// Deployed mode: the catalog processes' `/metrics`, scraped before they stop.
    pub metrics_text: String,
    /// The MCP endpoint, measured on the same catalog (the report keeps it apart).
    pub mcp: McpPath,
}

fn servers_dir() -> Option<PathBuf> {
    match std::env::var_os("CTXSYNC_MCP_SERVERS_DIR") {
        Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
        _ => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ctxsync/mcp-servers")),
    }
}

fn stdio(
    id: String,
    command: PathBuf,
    args: Vec<String>,
    env: BTreeMap<String, String>,
) -> ServerConfig {
    ServerConfig {
        id,
        transport: TransportSpec::Stdio {
            command: command.display().to_string(),
            args,
            env,
            cwd: None,
        },
        credential_ref: None,
        classification: None,
        limits: Limits::default(),
        enabled: true,
        processes: Default::default(),
        shared_pool: 1,
        naming: None,
        prefix: None,
        aliases: Default::default(),
    }
}

/// Two of each installed reference server (everything, filesystem, memory, time).
fn reference_servers(dir: &Path, scratch: &Path) -> Vec<ServerConfig> {
    let mut servers = Vec::new();
    for n in 1..=2 {
        let bin = dir.join("node_modules/.bin/mcp-server-everything");
        if bin.is_file() {
            servers.push(stdio(
                format!("everything-{n}"),
                bin,
                vec!["stdio".into()],
                BTreeMap::new(),
            ));
        }
        let bin = dir.join("node_modules/.bin/mcp-server-filesystem");
        if bin.is_file() {
            servers.push(stdio(
                format!("files-{n}"),
                bin,
                vec![scratch.display().to_string()],
                BTreeMap::new(),
            ));
        }
        let bin = dir.join("node_modules/.bin/mcp-server-memory");
        if bin.is_file() {
            let file = scratch.join(format!("memory-{n}.json"));
            servers.push(stdio(
                format!("memory-{n}"),
                bin,
                Vec::new(),
                BTreeMap::from([("MEMORY_FILE_PATH".to_owned(), file.display().to_string())]),
            ));
        }
        let bin = dir.join("venv/bin/mcp-server-time");
        if bin.is_file() {
            servers.push(stdio(
                format!("time-{n}"),
                bin,
                vec!["--local-timezone".into(), "UTC".into()],
                BTreeMap::new(),
            ));
        }
    }
    servers.sort_by(|a, b| a.id.cmp(&b.id));
    servers
}

/// Process ids whose parent is one of `parents`.
fn child_processes(parents: &[u32]) -> std::collections::HashSet<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Default::default();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // The command name may hold spaces: the fields after it follow the last ')'.
                    let rest = &stat[stat.rfind(')')? + 2..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                .is_some_and(|parent| parents.contains(&parent))
        })
        .collect()
}

async fn prepare(env: &Env, session: &str) -> Result<CatalogPrepareReply, BenchError> {
    rpc::call_for_tenant::<catalog_rpc::Prepare>(
        &env.client,
        &env.subjects,
        TENANT,
        &CatalogPrepareRequest {
            tenant: TENANT.into(),
            session_id: session.into(),
        },
        None,
        PREPARE_TIMEOUT,
    )
    .await
    .map_err(|error| match error {
        rpc::RpcError::Service {
            reason, message, ..
        } => BenchError::new("catalog prepare", format!("{reason}: {message}")),
        error => BenchError::new("catalog prepare", error),
    })
}

async fn end_session(env: &Env, session: &str) {
    let _ = rpc::call_for_tenant::<catalog_rpc::EndSession>(
        &env.client,
        &env.subjects,
        TENANT,
        &CatalogEndSessionRequest {
            tenant: TENANT.into(),
            session_id: session.into(),
        },
        None,
        PREPARE_TIMEOUT,
    )
    .await;
}

pub async fn measure(
    env: &Env,
    sizes: &Sizes,
    progress: &Progress,
) -> Result<CatalogPreparation, BenchError> {
    let Some(dir) = servers_dir() else {
        return Ok(CatalogPreparation {
            skipped: Some("HOME is not set and CTXSYNC_MCP_SERVERS_DIR is empty".into()),
            ..Default::default()
        });
    };
    let scratch = std::env::temp_dir().join(format!("{}-mcp", env.subjects.prefix()));
    std::fs::create_dir_all(&scratch).step("catalog scratch directory")?;
    let servers = reference_servers(&dir, &scratch);
    if servers.is_empty() {
        let _ = std::fs::remove_dir_all(&scratch);
        return Ok(CatalogPreparation {
            skipped: Some(format!(
                "no reference MCP server installed in {} (run tests/mcp-servers/install.sh; \
                 CTXSYNC_MCP_SERVERS_DIR selects the directory)",
                dir.display()
            )),
            ..Default::default()
        });
    }
    let result = run_catalog(env, sizes, progress, servers).await;
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

async fn run_catalog(
    env: &Env,
    sizes: &Sizes,
    progress: &Progress,
    servers: Vec<ServerConfig>,
) -> Result<CatalogPreparation, BenchError> {
    let count = servers.len();
    let ids: Vec<String> = servers.iter().map(|s| s.id.clone()).collect();
    let mut settings = catalog::Settings::default();
    // Nothing may fill the memory behind the measurement's back.
    settings.warmup.enabled = false;
    settings.connect_timeout = Duration::from_secs(60);
    // The MCP path's list throughput would measure the per-key rate limit.
    settings.mcp_rate_limit = None;
    let max_concurrent_starts = settings.max_concurrent_starts;
    let servers = CatalogConfig {
        tenants: vec![TenantConfig {
            id: TENANT.into(),
            naming: Default::default(),
            servers,
        }],
    };
    let catalogs = Catalogs::start(env, servers, settings).await?;
    let parents = catalogs.pids();

    let measured = async {
        let children_before = child_processes(&parents);
        progress.step(format!("catalog: live discovery of {count} real MCP servers"));
        let started = Instant::now();
        let live = prepare(env, "bench-live").await?;
        let live_elapsed = started.elapsed();
        let failed: Vec<String> = live
            .pins
            .iter()
            .filter(|p| p.source() != Source::Connected)
            .map(|p| format!("{}: {:?} {}", p.server_id, p.source(), p.error))
            .collect();
        if !failed.is_empty() {
            return Err(BenchError::new(
                "catalog live discovery",
                format!("not every server was discovered live: {failed:?}"),
            ));
        }
        end_session(env, "bench-live").await;
        // The catalog closes discovered servers in the background; 8 exiting
        // node and python processes would otherwise share the 2 cores with
        // the preparations measured next.
        progress.step("catalog: waiting for the discovered servers to exit");
        let exited = Instant::now();
        while child_processes(&parents)
            .difference(&children_before)
            .count()
            > 0
            && exited.elapsed() < Duration::from_secs(30)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        progress.step(format!(
            "catalog: {} preparations from memory",
            sizes.warm_preparations
        ));
        let mut warm = Vec::with_capacity(sizes.warm_preparations);
        let mut all_pinned = true;
        for n in 0..sizes.warm_preparations {
            let session = format!("bench-warm-{n}");
            let started = Instant::now();
            let reply = prepare(env, &session).await?;
            warm.push(started.elapsed());
            all_pinned &= reply.pins.len() == count
                && reply.pins.iter().all(|p| p.source() == Source::Pinned)
                && reply
                    .pins
                    .iter()
                    .zip(&live.pins)
                    .all(|(w, l)| w.catalog_hash == l.catalog_hash);
        }
        let mcp = match servers_dir()
            .map(|dir| dir.join("node_modules/.bin/mcp-server-everything"))
            .filter(|_| ids.iter().any(|id| id == "everything-1"))
        {
            Some(everything) => {
                mcp_path::measure(env, sizes, progress, catalogs.mcp_addr(), TENANT, &everything)
                    .await?
            }
            None => McpPath {
                skipped: Some("server-everything is not installed".into()),
                ..Default::default()
            },
        };
        Ok(CatalogPreparation {
            skipped: None,
            note: (count < 8).then(|| {
                format!("only {count} reference servers are installed (8 wanted): run tests/mcp-servers/install.sh")
            }),
            servers: ids.clone(),
            live_ms: live_elapsed.as_secs_f64() * 1000.0,
            live_service_ms: live.duration_ms,
            max_concurrent_starts,
            warm: Latency::of(warm),
            warm_all_pinned: all_pinned,
            metrics_text: String::new(),
            mcp,
        })
    }
    .await;
    let metrics_text = catalogs.stop().await;
    measured.map(|preparation| CatalogPreparation {
        metrics_text,
        ..preparation
    })
}

/// The catalog under measurement: in this process (single mode), or
/// `REPLICAS` catalog processes sharing their memory (deployed mode), whose
/// preparations NATS spreads over both: the warm ones on the replica that
/// did not discover pin what the other put in the shared memory.
enum Catalogs {
    InProcess(ctxsync_stack::Stack),
    Deployed(Deployed, PathBuf),
}

impl Catalogs {
    async fn start(
        env: &Env,
        servers: CatalogConfig,
        settings: catalog::Settings,
    ) -> Result<Self, BenchError> {
        if !env.services.is_deployed() {
            let stack = env
                .builder()
                .catalog(servers, settings, |_| {})
                .start(&env.child_shutdown())
                .await
                .step("catalog")?;
            return Ok(Self::InProcess(stack));
        }
        // The binary reads its servers from a file and its tunables from env.
        let file = env.log_dir().join("catalog.yaml");
        let yaml =
            serde_norway::to_string(&CatalogFile::of(&servers)).step("catalog config file")?;
        std::fs::create_dir_all(env.log_dir()).step("catalog config file")?;
        std::fs::write(&file, yaml).step("catalog config file")?;
        // One memory key for both replicas, so each trusts the entries the
        // other puts in the bucket (a random one per process shares nothing).
        let key_file = env.log_dir().join("catalog-memory.key");
        let key: String = (0..2)
            .map(|_| uuid::Uuid::new_v4().simple().to_string())
            .collect();
        std::fs::write(&key_file, key).step("catalog memory key file")?;
        let mut builder = env.builder();
        for _ in 0..REPLICAS {
            builder = builder.catalog(servers.clone(), settings.clone(), |_| {});
        }
        // The settings reach the binaries as the stack renders them; the
        // files are the binaries' alone.
        let builder = [
            ("CTXSYNC_CATALOG_CONFIG", file.display().to_string()),
            (
                "CTXSYNC_CATALOG_MEMORY_KEY_FILE",
                key_file.display().to_string(),
            ),
            ("CTXSYNC_LOG", "warn".to_owned()),
        ]
        .into_iter()
        .fold(builder, |builder, (name, value)| {
            builder.binary_env(Service::Catalog, name, value)
        });
        let deployed = Deployed::spawn(&builder, &env.log_dir()).await?;
        Ok(Self::Deployed(deployed, file))
    }

    /// Where a client reaches `/mcp` (deployed: the first replica).
    fn mcp_addr(&self) -> std::net::SocketAddr {
        match self {
            Self::InProcess(stack) => stack.catalog().http_addr(),
            Self::Deployed(deployed, _) => deployed.addrs(Service::Catalog)[0],
        }
    }

    /// Where the catalog's server processes are children of.
    fn pids(&self) -> Vec<u32> {
        match self {
            Self::InProcess(_) => vec![std::process::id()],
            Self::Deployed(deployed, _) => deployed.pids(),
        }
    }

    /// Stops the catalog; returns the processes' metrics (deployed), for the
    /// report's metric families.
    async fn stop(self) -> String {
        match self {
            Self::InProcess(stack) => {
                let _ = tokio::time::timeout(Duration::from_secs(20), stack.stop()).await;
                String::new()
            }
            Self::Deployed(deployed, file) => {
                let text = deployed.metrics_text().await;
                deployed.stop().await;
                let _ = std::fs::remove_file(file);
                text
            }
        }
    }
}

/// The catalog configuration file's shape, for the catalog binary.
#[derive(serde::Serialize)]
struct CatalogFile<'a> {
    tenants: Vec<TenantFile<'a>>,
}

#[derive(serde::Serialize)]
struct TenantFile<'a> {
    id: &'a str,
    servers: &'a [ServerConfig],
}

impl<'a> CatalogFile<'a> {
    fn of(config: &'a CatalogConfig) -> Self {
        Self {
            tenants: config
                .tenants
                .iter()
                .map(|tenant| TenantFile {
                    id: &tenant.id,
                    servers: &tenant.servers,
                })
                .collect(),
        }
    }
}
