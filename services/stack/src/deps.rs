//! Finding or starting what ctxsync depends on, for `ctxsync up` and the
//! bench: NATS and Postgres. A given URL is used as is; otherwise the default
//! local port is tried, and only then a private server is started from PATH
//! under the data directory (and stopped on exit).

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tokio::process::{Child, Command};

const LOCAL_NATS: &str = "127.0.0.1:4222";
const LOCAL_POSTGRES_ADMIN: &str = "postgres://postgres@127.0.0.1:5432/postgres";
const DATABASE: &str = "ctxsync";
const COMPOSE_HINT: &str =
    "or run everything in containers: docker compose -f deploy/compose.yaml up";

#[derive(Debug, thiserror::Error)]
pub enum DependencyError {
    #[error(
        "{binary} not found on PATH and nothing answers on {addr}: install it ({install}), set {env}, {COMPOSE_HINT}"
    )]
    Missing {
        binary: &'static str,
        addr: &'static str,
        install: &'static str,
        env: &'static str,
    },
    #[error("cannot start {what}: {reason}")]
    Start { what: &'static str, reason: String },
    #[error("cannot prepare the {DATABASE} database at {url} (DATABASE_URL): {reason}")]
    Database { url: String, reason: String },
}

/// Where a dependency came from, for the startup summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Given,
    LocalDefault,
    Private { data_dir: PathBuf },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Given => write!(f, "given"),
            Self::LocalDefault => write!(f, "found on the default local port"),
            Self::Private { data_dir } => {
                write!(f, "started privately, data in {}", data_dir.display())
            }
        }
    }
}

/// A dependency in use; a private server is stopped when this drops.
pub struct Dependency {
    pub url: String,
    pub origin: Origin,
    _child: Option<Child>,
}

fn answers(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .ok()
        .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_millis(300)).ok())
        .is_some()
}

fn on_path(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

fn free_port() -> Result<u16, DependencyError> {
    Ok(free_ports(1)?[0])
}

/// `count` distinct free ports: each listener stays bound until all are
/// chosen, so no two are the same.
fn free_ports(count: usize) -> Result<Vec<u16>, DependencyError> {
    let listeners = (0..count)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>();
    listeners
        .and_then(|ls| {
            ls.iter()
                .map(|l| l.local_addr().map(|a| a.port()))
                .collect()
        })
        .map_err(|e| DependencyError::Start {
            what: "a private server",
            reason: format!("no free port: {e}"),
        })
}

async fn wait_listening(
    child: &mut Child,
    port: u16,
    what: &'static str,
) -> Result<(), DependencyError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(DependencyError::Start {
                what,
                reason: format!("exited with {status}"),
            });
        }
        if answers(&format!("127.0.0.1:{port}")) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(DependencyError::Start {
        what,
        reason: format!("did not listen on port {port} within 20 s"),
    })
}

/// NATS: the given URL, else 127.0.0.1:4222 if it answers, else a private
/// `nats-server` with JetStream under `data_dir/nats`.
pub async fn nats(given: Option<&str>, data_dir: &Path) -> Result<Dependency, DependencyError> {
    if let Some(url) = given {
        return Ok(Dependency {
            url: url.to_owned(),
            origin: Origin::Given,
            _child: None,
        });
    }
    if answers(LOCAL_NATS) {
        return Ok(Dependency {
            url: format!("nats://{LOCAL_NATS}"),
            origin: Origin::LocalDefault,
            _child: None,
        });
    }
    let binary = on_path("nats-server").ok_or(DependencyError::Missing {
        binary: "nats-server",
        addr: LOCAL_NATS,
        install: "Debian: apt-get install nats-server",
        env: "NATS_URL",
    })?;
    let dir = data_dir.join("nats");
    std::fs::create_dir_all(&dir).map_err(|e| DependencyError::Start {
        what: "nats-server",
        reason: format!("cannot create {}: {e}", dir.display()),
    })?;
    let port = free_port()?;
    // Agent requests up to 4 MiB travel in one message.
    let config = dir.join("nats.conf");
    std::fs::write(&config, "max_payload: 8MB\n").map_err(|e| DependencyError::Start {
        what: "nats-server",
        reason: format!("cannot write {}: {e}", config.display()),
    })?;
    let mut child = Command::new(binary)
        .arg("-c")
        .arg(&config)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| DependencyError::Start {
            what: "nats-server",
            reason: e.to_string(),
        })?;
    wait_listening(&mut child, port, "nats-server").await?;
    Ok(Dependency {
        url: format!("nats://127.0.0.1:{port}"),
        origin: Origin::Private { data_dir: dir },
        _child: Some(child),
    })
}

/// `url` with its database replaced by `name` (its query kept).
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{name}", &base[..path_start]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Creates the `ctxsync` database through an admin connection if it is missing.
async fn ensure_database(admin_url: &str) -> Result<String, DependencyError> {
    let fail = |reason: String| DependencyError::Database {
        url: ctxsync_runtime::nats::redact_url(admin_url),
        reason,
    };
    let mut admin = PgConnection::connect(admin_url)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(DATABASE)
            .fetch_one(&mut admin)
            .await
            .map_err(|e| fail(e.to_string()))?;
    if !exists {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
            .execute(&mut admin)
            .await
            .map_err(|e| fail(e.to_string()))?;
    }
    let _ = admin.close().await;
    Ok(with_database(admin_url, DATABASE))
}

/// Postgres: the given URL, else 127.0.0.1:5432 if it answers (creating the
/// `ctxsync` database), else `initdb` and a private `postgres` under `data_dir/postgres`.
pub async fn postgres(given: Option<&str>, data_dir: &Path) -> Result<Dependency, DependencyError> {
    if let Some(url) = given {
        return Ok(Dependency {
            url: url.to_owned(),
            origin: Origin::Given,
            _child: None,
        });
    }
    if answers("127.0.0.1:5432") {
        let url = ensure_database(LOCAL_POSTGRES_ADMIN).await?;
        return Ok(Dependency {
            url,
            origin: Origin::LocalDefault,
            _child: None,
        });
    }
    let missing = DependencyError::Missing {
        binary: "initdb and postgres",
        addr: "127.0.0.1:5432",
        install: "Debian: apt-get install postgresql",
        env: "DATABASE_URL",
    };
    let initdb = on_path("initdb").ok_or(missing)?;
    let postgres = initdb.with_file_name("postgres");
    let dir = data_dir.join("postgres");
    if !dir.join("PG_VERSION").exists() {
        let output = Command::new(&initdb)
            .args(["-U", "postgres", "--auth=trust", "-D"])
            .arg(&dir)
            .output()
            .await
            .map_err(|e| DependencyError::Start {
                what: "initdb",
                reason: e.to_string(),
            })?;
        if !output.status.success() {
            return Err(DependencyError::Start {
                what: "initdb",
                reason: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
    }
    let port = free_port()?;
    let mut child = Command::new(postgres)
        .arg("-D")
        .arg(&dir)
        .args([
            "-p",
            &port.to_string(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-k",
        ])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| DependencyError::Start {
            what: "postgres",
            reason: e.to_string(),
        })?;
    wait_listening(&mut child, port, "postgres").await?;
    let url = ensure_database(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).await?;
    Ok(Dependency {
        url,
        origin: Origin::Private { data_dir: dir },
        _child: Some(child),
    })
}

/// Runs one statement on a fresh admin connection (`CREATE DATABASE` and
/// `DROP DATABASE` cannot run in a transaction or a pool's session state).
pub async fn admin_execute(admin_url: &str, sql: String) -> Result<(), sqlx::Error> {
    let mut admin = PgConnection::connect(admin_url).await?;
    let result = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut admin)
        .await;
    let _ = admin.close().await;
    result.map(|_| ())
}

/// Three private `nats-server` processes clustered over routes on loopback
/// ports, each with JetStream under `data_dir/nats-cluster/n<i>`: the
/// deployment's normal case, for the bench's deployed mode. Stopped when
/// this drops.
pub struct ClusterDependency {
    urls: Vec<String>,
    /// The nodes' monitoring ports, in the order of `urls`.
    monitors: Vec<u16>,
    data_dir: PathBuf,
    _children: Vec<Child>,
}

impl ClusterDependency {
    pub const SIZE: usize = 3;

    /// The nodes' client URLs.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The URLs comma-joined: a `NATS_URL` naming the whole cluster.
    pub fn url_list(&self) -> String {
        self.urls.join(",")
    }

    /// The node (index into [`ClusterDependency::urls`]) of each client
    /// connection named `name` now, from the nodes' `/connz`.
    pub async fn nodes_of(&self, name: &str) -> Result<Vec<usize>, String> {
        let mut nodes = Vec::new();
        for (node, &port) in self.monitors.iter().enumerate() {
            let connz = monitor_get(port, "/connz?limit=4096").await?;
            let connections = connz["connections"].as_array().cloned().unwrap_or_default();
            let named = connections.iter().filter(|c| c["name"] == name).count();
            nodes.extend(std::iter::repeat_n(node, named));
        }
        Ok(nodes)
    }

    pub fn origin(&self) -> Origin {
        Origin::Private {
            data_dir: self.data_dir.clone(),
        }
    }
}

/// Starts a [`ClusterDependency`] and returns once every node routes to both
/// others and answers its health check (JetStream in contact with its meta
/// leader), within 30 s.
///
/// The nine ports are chosen free, but another process may take one before
/// its node binds it: a node that exits at start is retried on fresh ports,
/// up to [`CLUSTER_ATTEMPTS`] times. Each node logs to `n<i>/nats.log`
/// (under `retry-<attempt>/` after the first attempt).
pub async fn nats_cluster(data_dir: &Path) -> Result<ClusterDependency, DependencyError> {
    let binary = on_path("nats-server").ok_or(DependencyError::Missing {
        binary: "nats-server",
        addr: LOCAL_NATS,
        install: "Debian: apt-get install nats-server",
        env: "NATS_URL",
    })?;
    let dir = data_dir.join("nats-cluster");
    let mut attempt = 1;
    loop {
        // A fresh folder per attempt: a killed node of the last one may not
        // have let go of its JetStream store yet.
        let nodes_dir = match attempt {
            1 => dir.clone(),
            n => dir.join(format!("retry-{n}")),
        };
        match cluster_attempt(&binary, &nodes_dir).await {
            Err(ClusterStart::NodeExited(reason)) if attempt < CLUSTER_ATTEMPTS => {
                tracing::warn!(attempt, %reason, "a nats cluster node exited at start: retrying on fresh ports");
                attempt += 1;
            }
            Err(ClusterStart::NodeExited(reason) | ClusterStart::Failed(reason)) => {
                return Err(DependencyError::Start {
                    what: "a nats cluster",
                    reason,
                });
            }
            Ok(cluster) => return Ok(cluster),
        }
    }
}

/// Starts of a private cluster before its nodes' early exits are an error.
const CLUSTER_ATTEMPTS: usize = 3;

enum ClusterStart {
    /// A node exited before the cluster formed (e.g. its port was taken).
    NodeExited(String),
    Failed(String),
}

async fn cluster_attempt(binary: &Path, dir: &Path) -> Result<ClusterDependency, ClusterStart> {
    let failed = |reason: String| ClusterStart::Failed(reason);
    let ports: Vec<(u16, u16, u16)> = free_ports(3 * ClusterDependency::SIZE)
        .map_err(|e| failed(e.to_string()))?
        .chunks(3)
        .map(|p| (p[0], p[1], p[2]))
        .collect();
    let mut children = Vec::new();
    for (i, (client, route, monitor)) in ports.iter().enumerate() {
        let node_dir = dir.join(format!("n{i}"));
        std::fs::create_dir_all(&node_dir)
            .map_err(|e| failed(format!("cannot create {}: {e}", node_dir.display())))?;
        let routes: Vec<String> = ports
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, (_, route, _))| format!("\"nats-route://127.0.0.1:{route}\""))
            .collect();
        let config = format!(
            "server_name: \"n{i}\"\nlisten: \"127.0.0.1:{client}\"\nhttp: \"127.0.0.1:{monitor}\"\n\
             max_payload: 8MB\nlog_file: \"{log}\"\njetstream {{ store_dir: \"{store}\" }}\n\
             cluster {{\n  name: \"ctxsync\"\n  listen: \"127.0.0.1:{route}\"\n  routes: [{routes}]\n}}\n",
            log = node_dir.join("nats.log").display(),
            store = node_dir.join("js").display(),
            routes = routes.join(", "),
        );
        let path = node_dir.join("nats.conf");
        std::fs::write(&path, config)
            .map_err(|e| failed(format!("cannot write {}: {e}", path.display())))?;
        children.push(
            Command::new(binary)
                .arg("-c")
                .arg(&path)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| failed(e.to_string()))?,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let monitors: Vec<u16> = ports.iter().map(|(_, _, monitor)| *monitor).collect();
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(ClusterStart::NodeExited(format!(
                    "node {i} exited with {status} (its log: {})",
                    dir.join(format!("n{i}/nats.log")).display()
                )));
            }
        }
        let missing = cluster_not_formed(&monitors).await;
        match missing {
            None => break,
            Some(reason) if Instant::now() > deadline => {
                return Err(failed(format!("not formed within 30 s: {reason}")));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    Ok(ClusterDependency {
        urls: ports
            .iter()
            .map(|(client, _, _)| format!("nats://127.0.0.1:{client}"))
            .collect(),
        monitors,
        data_dir: dir.to_owned(),
        _children: children,
    })
}

/// What keeps the nodes behind `monitors` (their monitoring ports) from
/// being a formed cluster, if anything.
async fn cluster_not_formed(monitors: &[u16]) -> Option<String> {
    for (i, &port) in monitors.iter().enumerate() {
        let routes = match monitor_get(port, "/routez").await {
            Ok(routez) => routez["num_routes"].as_u64().unwrap_or_default(),
            Err(error) => return Some(format!("node {i}: {error}")),
        };
        if routes < (monitors.len() - 1) as u64 {
            return Some(format!("node {i} has {routes} routes"));
        }
        match monitor_get(port, "/healthz").await {
            Ok(health) if health["status"] == "ok" => {}
            Ok(health) => return Some(format!("node {i} is not healthy: {health}")),
            Err(error) => return Some(format!("node {i}: {error}")),
        }
    }
    None
}

/// A GET of a nats-server monitoring endpoint on loopback, as JSON.
async fn monitor_get(port: u16, path: &str) -> Result<serde_json::Value, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("monitoring port {port}: {e}"))?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
            .await
            .map_err(|e| format!("monitoring port {port}: {e}"))?;
        let mut response = String::new();
        stream
            .read_to_string(&mut response)
            .await
            .map_err(|e| format!("monitoring port {port}: {e}"))?;
        Ok::<_, String>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .map_err(|_| format!("monitoring port {port}: no answer within 2 s"))??;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .ok_or_else(|| format!("no HTTP body from {path}"))?;
    serde_json::from_str(body).map_err(|e| format!("{path} is not JSON ({e})"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn database_is_swapped() {
        assert_eq!(
            super::with_database("postgres://postgres@127.0.0.1:5432/postgres", "ctxsync"),
            "postgres://postgres@127.0.0.1:5432/ctxsync"
        );
        assert_eq!(
            super::with_database("postgres://u@h:5432/postgres?sslmode=disable", "x"),
            "postgres://u@h:5432/x?sslmode=disable"
        );
        assert_eq!(
            super::with_database("postgres://u@h:5432", "x"),
            "postgres://u@h:5432/x"
        );
    }
}
