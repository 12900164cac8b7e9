//! A Postgres server of the test's own: `initdb` into a temp dir, `postgres`
//! on a free loopback port with trust auth, killed hard (the whole process
//! group, SIGKILL, as a crash would) and restarted on the same port and data
//! directory (crash recovery included).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use sqlx::{Connection, Executor, PgConnection};

/// Env var naming the directory of `initdb` and `postgres`, when they are
/// neither under `/usr/lib/postgresql/<version>/bin` nor on `PATH`.
pub const POSTGRES_BIN_DIR_ENV: &str = "CTXSYNC_TEST_POSTGRES_BIN_DIR";

const INSTALL_HINT: &str = "install the PostgreSQL server (Debian: apt-get install postgresql) \
     or point CTXSYNC_TEST_POSTGRES_BIN_DIR at the directory holding initdb and postgres";

/// A private Postgres instance, stopped and removed when dropped.
pub struct PrivatePostgres {
    bin_dir: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    /// uid and gid to run as: Postgres refuses to run as root.
    run_as: Option<(u32, u32)>,
    child: Option<Child>,
    starts: u32,
    /// `ssl=on` with this certificate and key (copies the server may read).
    tls: Option<crate::tls::CertFiles>,
    /// Server settings (`name=value`) given with `-c` at every start.
    settings: Vec<String>,
}

fn has_server_binaries(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("postgres").is_file()
}

/// Where `initdb` and `postgres` are: the env var, Debian's versioned
/// directories (newest first), or `PATH`.
fn find_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(POSTGRES_BIN_DIR_ENV) {
        let dir = PathBuf::from(dir);
        assert!(
            has_server_binaries(&dir),
            "{POSTGRES_BIN_DIR_ENV}={} holds no initdb and postgres: {INSTALL_HINT}",
            dir.display()
        );
        return dir;
    }
    let mut versioned: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, bin)| has_server_binaries(bin))
        .collect();
    versioned.sort();
    if let Some((_, dir)) = versioned.pop() {
        return dir;
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("initdb"))
            .find(|candidate| candidate.is_file())
    });
    if let Some(initdb) = on_path {
        let real = std::fs::canonicalize(&initdb).unwrap_or(initdb);
        if let Some(dir) = real.parent().filter(|dir| has_server_binaries(dir)) {
            return dir.to_path_buf();
        }
    }
    panic!("cannot find initdb and postgres: {INSTALL_HINT}");
}

/// Postgres will not run as root: as root, run it as the `postgres` user.
fn run_as() -> Option<(u32, u32)> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    let user = nix::unistd::User::from_name("postgres")
        .ok()
        .flatten()
        .unwrap_or_else(|| {
            panic!(
                "the tests run as root and Postgres refuses root: create a `postgres` user \
                 (Debian's postgresql package does) or run the tests as another user"
            )
        });
    Some((user.uid.as_raw(), user.gid.as_raw()))
}

impl PrivatePostgres {
    /// `initdb` and start; returns once it answers queries.
    pub async fn start() -> Self {
        Self::start_inner(None, &[]).await
    }

    /// [`Self::start`] with `pg_stat_statements` loaded (`CREATE EXTENSION
    /// pg_stat_statements` in a database makes its view readable there):
    /// for a test that counts the statements a service runs.
    pub async fn start_counting_statements() -> Self {
        Self::start_inner(None, &["shared_preload_libraries=pg_stat_statements"]).await
    }

    /// [`Self::start`] with `ssl=on`, serving `cert` (clients may still
    /// connect without TLS unless they ask for it with `sslmode`).
    pub async fn start_with_tls(cert: &crate::tls::CertFiles) -> Self {
        Self::start_inner(Some(cert), &[]).await
    }

    async fn start_inner(tls: Option<&crate::tls::CertFiles>, settings: &[&str]) -> Self {
        ctxsync_tls::install_default_provider();
        let bin_dir = find_bin_dir();
        let run_as = run_as();
        let dir = tempfile::Builder::new()
            .prefix("ctxsync-postgres-")
            .tempdir()
            .expect("cannot create a temp dir for Postgres");
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap_or_else(|e| {
                panic!("cannot give {} to postgres: {e}", dir.path().display())
            });
        }
        let mut server = Self {
            bin_dir,
            dir,
            port: 0,
            run_as,
            child: None,
            starts: 0,
            tls: None,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
        };
        server.initdb();
        if let Some(files) = tls {
            server.tls = Some(server.install_tls(files));
        }
        let mut last_error = String::new();
        // A reserved port can be taken before postgres binds it: retry on another.
        for _ in 0..5 {
            server.port = crate::isolation::free_port();
            match server.spawn_and_wait(Duration::from_secs(30)).await {
                Ok(()) => return server,
                Err(error) => {
                    server.kill_hard();
                    last_error = error;
                }
            }
        }
        panic!("postgres did not start: {last_error}");
    }

    fn command(&self, binary: &str) -> Command {
        let mut command = Command::new(self.bin_dir.join(binary));
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt as _;
            command.uid(uid).gid(gid);
        }
        command.env("LC_ALL", "C").stdin(Stdio::null());
        command
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn initdb(&self) {
        let output = self
            .command("initdb")
            .arg("-D")
            .arg(self.data_dir())
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",
                "--no-instructions",
            ])
            .output()
            .unwrap_or_else(|e| panic!("cannot run initdb ({e}): {INSTALL_HINT}"));
        assert!(
            output.status.success(),
            "initdb failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }

    /// Copies of `files` the server accepts: owned by its user, the key 0600.
    fn install_tls(&self, files: &crate::tls::CertFiles) -> crate::tls::CertFiles {
        use std::os::unix::fs::PermissionsExt as _;
        let copy = crate::tls::CertFiles {
            cert: self.dir.path().join("server.pem"),
            key: self.dir.path().join("server.key"),
        };
        std::fs::copy(&files.cert, &copy.cert).expect("copy the server certificate");
        std::fs::copy(&files.key, &copy.key).expect("copy the server key");
        std::fs::set_permissions(&copy.key, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the server key");
        if let Some((uid, gid)) = self.run_as {
            for path in [&copy.cert, &copy.key] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))
                    .unwrap_or_else(|e| panic!("cannot give {} to postgres: {e}", path.display()));
            }
        }
        copy
    }

    fn spawn(&mut self) {
        use std::os::unix::process::CommandExt as _;
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the postgres log");
        let stderr = log.try_clone().expect("clone the log handle");
        self.starts += 1;
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-k")
            .arg(self.dir.path())
            .args(self.tls.iter().flat_map(|tls| {
                [
                    "-c".to_owned(),
                    "ssl=on".to_owned(),
                    "-c".to_owned(),
                    format!("ssl_cert_file={}", tls.cert.display()),
                    "-c".to_owned(),
                    format!("ssl_key_file={}", tls.key.display()),
                ]
            }))
            .args(
                self.settings
                    .iter()
                    .flat_map(|s| ["-c".to_owned(), s.clone()]),
            )
            // Its own process group: a hard kill takes every backend with the postmaster.
            .process_group(0)
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run postgres ({e}): {INSTALL_HINT}"));
        self.child = Some(child);
    }

    async fn spawn_and_wait(&mut self, within: Duration) -> Result<(), String> {
        self.spawn();
        self.wait_accepting(within).await
    }

    /// Waits until a connection runs a query (through crash recovery).
    async fn wait_accepting(&mut self, within: Duration) -> Result<(), String> {
        let started = Instant::now();
        let url = self.url();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(format!(
                    "postgres exited with {status}; its log:\n{}",
                    self.log_tail(30)
                ));
            }
            let last = match PgConnection::connect(&url).await {
                Ok(mut connection) => {
                    let answered = connection.execute("SELECT 1").await;
                    let _ = connection.close().await;
                    match answered {
                        Ok(_) => return Ok(()),
                        Err(error) => error.to_string(),
                    }
                }
                Err(error) => error.to_string(),
            };
            if started.elapsed() > within {
                return Err(format!(
                    "postgres on port {} did not answer within {within:?} ({last}); its log:\n{}",
                    self.port,
                    self.log_tail(30)
                ));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The superuser URL of its `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The postmaster's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its server log (every start).
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGKILL to the postmaster and every backend at once (no shutdown, no
    /// checkpoint), then reaps the postmaster.
    pub fn kill_hard(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal::killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data directory; returns once it
    /// answers queries (after crash recovery), and how long that took.
    pub async fn restart(&mut self) -> Duration {
        assert!(self.child.is_none(), "postgres is running: kill it first");
        let started = Instant::now();
        let deadline = Duration::from_secs(30);
        let mut last_error = String::new();
        // Backends of the killed instance may still be exiting: retry briefly.
        while started.elapsed() < deadline {
            match self.spawn_and_wait(deadline - started.elapsed()).await {
                Ok(()) => return started.elapsed(),
                Err(error) => {
                    self.kill_hard();
                    last_error = error;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        panic!("postgres did not restart within {deadline:?}: {last_error}");
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.kill_hard();
        if std::thread::panicking() {
            eprintln!(
                "---- private postgres log ({} start(s)) ----\n{}",
                self.starts,
                self.log_tail(40)
            );
        }
    }
}
