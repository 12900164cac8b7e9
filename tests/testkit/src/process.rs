//! A child process of one of our binaries, owned by one test: spawned with its
//! env, its output captured to a file (shown when the test fails), readiness
//! awaited on its `/readyz`, and the faults a test injects — SIGSTOP/SIGCONT,
//! SIGKILL, SIGTERM — plus a restart with the same env (so the same ports).

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// How a [`Process`] is started; kept to start it again.
#[derive(Debug, Clone)]
pub struct ProcessBuilder {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl ProcessBuilder {
    /// Binary `bin` of workspace package `package` (built if missing).
    pub fn binary(package: &str, bin: &str) -> Self {
        Self::program(bin, crate::binary::workspace_binary(package, bin))
    }

    /// Any program, named `name` in messages.
    pub fn program(name: &str, program: impl Into<PathBuf>) -> Self {
        Self {
            name: name.to_owned(),
            program: program.into(),
            args: Vec::new(),
            // Plain text logs: they are read by tests and shown on failure.
            env: vec![
                ("CTXSYNC_LOG".into(), "info".into()),
                ("NO_COLOR".into(), "1".into()),
            ],
        }
    }

    /// A name for messages (e.g. `store-a` for one of two replicas).
    pub fn named(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Sets `key` (replacing an earlier value).
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.into()));
        self
    }

    pub fn envs<K: AsRef<str>, V: Into<String>>(
        mut self,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        for (key, value) in env {
            self = self.env(key.as_ref(), value);
        }
        self
    }

    /// The certificate chain it serves HTTPS with: `CTXSYNC_TLS_CERT`, when set.
    fn tls_cert(&self) -> Option<PathBuf> {
        self.env
            .iter()
            .find(|(k, _)| k == "CTXSYNC_TLS_CERT")
            .map(|(_, v)| PathBuf::from(v))
    }

    /// The address `/readyz` is asked on: `CTXSYNC_HTTP_ADDR`, when set.
    fn http_addr(&self) -> Option<SocketAddr> {
        self.env
            .iter()
            .find(|(k, _)| k == "CTXSYNC_HTTP_ADDR")
            .and_then(|(_, v)| v.parse().ok())
    }

    pub fn spawn(self) -> Process {
        let logs = tempfile::Builder::new()
            .prefix("ctxsync-process-")
            .tempdir()
            .expect("cannot create a temp dir for process output");
        let log = logs.path().join(format!("{}.log", self.name));
        let mut process = Process {
            builder: self,
            log,
            _logs: logs,
            child: None,
            spawns: 0,
        };
        process.start();
        process
    }
}

/// A running (or stopped, or killed) child process; killed when dropped. Its
/// stdout and stderr go to one file, appended across restarts.
pub struct Process {
    builder: ProcessBuilder,
    log: PathBuf,
    _logs: tempfile::TempDir,
    child: Option<Child>,
    spawns: u32,
}

impl Process {
    /// `bin` of `package` with `env` (`CTXSYNC_LOG=info` unless given).
    pub fn spawn(package: &str, bin: &str, env: &[(&str, String)]) -> Self {
        ProcessBuilder::binary(package, bin)
            .envs(env.iter().map(|(k, v)| (*k, v.clone())))
            .spawn()
    }

    fn start(&mut self) {
        assert!(
            self.child.is_none(),
            "{} is still running: kill or terminate it before restarting",
            self.name()
        );
        self.spawns += 1;
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", self.log.display()));
        if self.spawns > 1 {
            use std::io::Write as _;
            let _ = writeln!(&log, "---- {} start #{} ----", self.name(), self.spawns);
        }
        let stderr = log.try_clone().expect("clone the log file handle");
        let child = Command::new(&self.builder.program)
            .args(&self.builder.args)
            .envs(self.builder.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} ({}): {e}",
                    self.name(),
                    self.builder.program.display()
                )
            });
        self.child = Some(child);
    }

    /// Sets `key` (or removes it, given `None`) for the next start.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.builder.env.retain(|(k, _)| k != key);
        if let Some(value) = value {
            self.builder.env.push((key.to_owned(), value.to_owned()));
        }
    }

    pub fn name(&self) -> &str {
        &self.builder.name
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `CTXSYNC_HTTP_ADDR`, when it was given.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.builder.http_addr()
    }

    /// The file holding its output.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Everything it wrote so far (every start).
    pub fn log(&self) -> String {
        std::fs::read(&self.log)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// Its last `lines` lines of output.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The exit status, if it has exited (None while it runs or after a kill).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let status = child.try_wait().ok().flatten()?;
        self.child = None;
        Some(status)
    }

    fn failure(&self, what: &str) -> String {
        format!(
            "{} {what}; its last output:\n{}",
            self.name(),
            self.log_tail(40)
        )
    }

    /// Waits until `/readyz` answers 200 and returns how long that took;
    /// panics (with its output) past `within` or when it exits.
    pub async fn wait_ready(&mut self, within: Duration) -> Duration {
        let addr = self
            .http_addr()
            .unwrap_or_else(|| panic!("{} has no CTXSYNC_HTTP_ADDR to ask", self.name()));
        ctxsync_tls::install_default_provider();
        let mut http = reqwest::Client::builder().timeout(Duration::from_secs(2));
        // Serving HTTPS: asked over https, trusting the certificates of its own
        // chain (a [`crate::tls::TestCa`] chain ends with the CA).
        let scheme = match self.builder.tls_cert() {
            Some(chain) => {
                let pem = std::fs::read(&chain)
                    .unwrap_or_else(|e| panic!("cannot read {}: {e}", chain.display()));
                for cert in reqwest::Certificate::from_pem_bundle(&pem).expect("a PEM chain") {
                    http = http.add_root_certificate(cert);
                }
                "https"
            }
            None => "http",
        };
        let http = http.build().expect("http client");
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_exit() {
                panic!(
                    "{}",
                    self.failure(&format!("exited with {status} before it was ready"))
                );
            }
            let last = match http.get(format!("{scheme}://{addr}/readyz")).send().await {
                Ok(response) if response.status().is_success() => return started.elapsed(),
                Ok(response) => format!(
                    "{}: {}",
                    response.status(),
                    response.text().await.unwrap_or_default()
                ),
                Err(error) => error.to_string(),
            };
            if started.elapsed() > within {
                panic!(
                    "{}",
                    self.failure(&format!(
                        "was not ready within {within:?} (last /readyz: {last})"
                    ))
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn signal(&self, signal: Signal) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running: cannot send {signal}", self.name()));
        signal::kill(Pid::from_raw(pid as i32), signal)
            .unwrap_or_else(|e| panic!("cannot send {signal} to {}: {e}", self.name()));
    }

    /// SIGSTOP: the process stalls (its sockets stay open) until [`Self::resume`].
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
    }

    /// SIGCONT after [`Self::pause`].
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// SIGTERM, without waiting.
    pub fn send_terminate(&self) {
        self.signal(Signal::SIGTERM);
    }

    /// SIGKILL (stopped or not) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for it to exit; panics (with its output) past `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_exit() {
                return status;
            }
            assert!(self.child.is_some(), "{} is not running", self.name());
            if started.elapsed() > within {
                panic!(
                    "{}",
                    self.failure(&format!("did not exit within {within:?}"))
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGTERM, then its exit status (within `within`).
    pub async fn terminate(&mut self, within: Duration) -> ExitStatus {
        self.send_terminate();
        self.wait_exit(within).await
    }

    /// Starts it again with the same program, args and env (so the same
    /// ports); it must have exited or been killed.
    pub fn restart(&mut self) {
        self.start();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- output of {} ({} start(s)) ----\n{}",
                self.name(),
                self.spawns,
                self.log_tail(60)
            );
        }
    }
}
