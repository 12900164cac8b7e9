//! ctxsync's own MCP test server and helpers for tests that use it or the
//! reference servers.
//!
//! # The fixture binary
//! `mcp-fixture --mode normal|slow-start|hang|crash|zero-tools|changing-tools|secret-error|crash-nul|nul-tools|echo-env-crash|secret-list-error`
//! (every flag also an env var, `MCP_FIXTURE_*`):
//! * `normal`: tools `echo {text}` and `add {a, b}`; `--page-size N` paginates `tools/list`;
//! * `slow-start --delay-ms N`: sleeps before reading stdin;
//! * `hang`: never answers, and starts a grandchild `sleep 600` in its process group;
//! * `crash`: writes `mcp-fixture: crashing at start as asked` to stderr, exits with status 3;
//! * `zero-tools`: a valid server with no tools;
//! * `changing-tools --tools-file F [--watch]`: tools `[{"name","description"}]` are read from
//!   `F` on every list; with `--watch` a change of `F` sends `notifications/tools/list_changed`;
//!   a tool named `sleep` answers after its argument `ms` milliseconds (call timeouts);
//! * `secret-error [--url URL]`: rejects `initialize` with an error (also on stderr) echoing
//!   the values of its `FIXTURE_*` env vars, all its args and the URL;
//! * `crash-nul`: writes `mcp-fixture: \0\0bad \e[31mbytes\e[0m\x01 before failing\0\r\n`
//!   to stderr, exits with status 3;
//! * `nul-tools`: tools `echo` and `add` (as `normal`) whose descriptions hold NUL, other
//!   control characters and terminal colours (and `echo`'s schema a NUL);
//! * `echo-env-crash [--edge-var NAME]`: writes its whole environment (`NAME=value` lines)
//!   and its args to stderr, then the value of `NAME` followed by filler so that the last
//!   4 KiB of stderr start in its middle, and exits with status 3;
//! * `secret-list-error`: completes the handshake, then rejects `tools/list` with what
//!   `secret-error` echoes;
//! * `--record-dir D`: see [`read_starts`] and [`live_pids`];
//! * `--http 127.0.0.1:PORT`: streamable HTTP at `/mcp`; prints `http://ADDR/mcp` on stdout;
//!   with `--sse`, the legacy HTTP+SSE transport instead: `GET /sse` (prints `http://ADDR/sse`)
//!   and `POST /message?sessionId=…`; a POST to `/sse` is answered 405;
//!   `--require-header 'Name: value'` answers 401 to any request without that header.
//!
//! # Finding the binary
//! Tests in other crates add `mcp-fixture = { path = "../../tests/mcp-fixture" }`
//! under `[dev-dependencies]` (for this library) and call [`fixture_binary`] or
//! [`fixture_spec`]. Cargo does not build a dependency's binaries; when
//! `target/<profile>/mcp-fixture` is missing, [`fixture_binary`] builds it once
//! with `cargo build -p mcp-fixture` (or set `MCP_FIXTURE_BIN`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use ctxsync_mcp::{ServerSpec, TransportSpec};
use tokio::io::{AsyncBufReadExt, BufReader};

pub mod reference;

/// Path of the built `mcp-fixture` binary: `MCP_FIXTURE_BIN`, or
/// `target/<profile>/mcp-fixture` next to the running test's `deps/`.
///
/// Cargo does not build a dependency's binaries, so when the binary is missing
/// and the test runs under cargo (`CARGO` is set), it runs
/// `cargo build -p mcp-fixture --bin mcp-fixture` once (same profile) and
/// panics with instructions if that fails.
pub fn fixture_binary() -> PathBuf {
    static BINARY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BINARY.get_or_init(locate_or_build).clone()
}

fn locate_or_build() -> PathBuf {
    if let Some(path) = std::env::var_os("MCP_FIXTURE_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test-binary> → target/<profile>/mcp-fixture
    let profile_dir = exe
        .parent()
        .and_then(|deps| {
            if deps.ends_with("deps") {
                deps.parent()
            } else {
                Some(deps)
            }
        })
        .expect("test executable has a directory")
        .to_path_buf();
    let binary = profile_dir.join("mcp-fixture");
    if binary.is_file() {
        return binary;
    }
    let built = std::env::var_os("CARGO").is_some_and(|cargo| {
        let mut build = std::process::Command::new(cargo);
        build.args(["build", "-p", "mcp-fixture", "--bin", "mcp-fixture"]);
        if let Some(target_dir) = profile_dir.parent() {
            build.arg("--target-dir").arg(target_dir);
        }
        if profile_dir.file_name().is_some_and(|p| p == "release") {
            build.arg("--release");
        }
        build.status().is_ok_and(|status| status.success())
    });
    assert!(
        built && binary.is_file(),
        "mcp-fixture binary not found at {}: run `cargo build -p mcp-fixture`",
        binary.display()
    );
    binary
}

/// A stdio [`ServerSpec`] running the fixture with `args` and `env`.
pub fn fixture_spec(name: &str, args: &[&str], env: &[(&str, &str)]) -> ServerSpec {
    ServerSpec {
        name: name.to_string(),
        transport: TransportSpec::Stdio {
            command: fixture_binary().display().to_string(),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cwd: None,
        },
    }
}

/// One line of `starts.log` in a record dir.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Start {
    pub pid: u32,
    pub unix_ms: u128,
    /// Live copies (this one included) when it started.
    pub concurrent: usize,
}

/// Appends `line` to `file` in a record dir: one small write per line, so
/// appends of concurrent copies do not interleave.
fn append_line(record_dir: &Path, file: &str, line: &str) {
    use std::io::Write as _;
    if let Ok(mut log) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(record_dir.join(file))
    {
        let _ = log.write_all(format!("{line}\n").as_bytes());
    }
}

/// The lines of `file` in a record dir; none if it was never written.
fn read_lines(record_dir: &Path, file: &str) -> Vec<String> {
    std::fs::read_to_string(record_dir.join(file))
        .map(|text| text.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Appends one line to `cancelled.log`: a call the client cancelled
/// (`sleep`), by its request id.
pub fn record_cancellation(record_dir: &Path, request_id: &str) {
    let line = format!("{} {request_id}", std::process::id());
    append_line(record_dir, "cancelled.log", &line);
}

/// Appends one line to `sleeping.log`: a `sleep` call began, by its
/// request id (a test cancels only what the server is doing).
pub fn record_sleeping(record_dir: &Path, request_id: &str) {
    append_line(record_dir, "sleeping.log", request_id);
}

/// The request ids of the `sleep` calls that began, in order.
pub fn read_sleeping(record_dir: &Path) -> Vec<String> {
    read_lines(record_dir, "sleeping.log")
}

/// Appends one line to `progress.log`: a client's progress the fixture
/// received.
pub fn record_progress(record_dir: &Path, progress: f64) {
    append_line(record_dir, "progress.log", &progress.to_string());
}

/// The client progress values the fixture received, in arrival order.
pub fn read_progress(record_dir: &Path) -> Vec<f64> {
    read_lines(record_dir, "progress.log")
        .iter()
        .filter_map(|l| l.parse().ok())
        .collect()
}

/// The calls recorded as cancelled (`pid request-id` lines).
pub fn read_cancellations(record_dir: &Path) -> Vec<String> {
    read_lines(record_dir, "cancelled.log")
}

/// Every recorded start, in order. Empty when nothing ever started.
pub fn read_starts(record_dir: &Path) -> Vec<Start> {
    let Ok(text) = std::fs::read_to_string(record_dir.join("starts.log")) else {
        return Vec::new();
    };
    text.lines()
        .map(|line| {
            let mut fields = line.split_whitespace();
            let pid = fields.next().and_then(|f| f.parse().ok());
            let unix_ms = fields.next().and_then(|f| f.parse().ok());
            let concurrent = fields
                .next()
                .and_then(|f| f.strip_prefix("concurrent="))
                .and_then(|f| f.parse().ok());
            match (pid, unix_ms, concurrent) {
                (Some(pid), Some(unix_ms), Some(concurrent)) => Start {
                    pid,
                    unix_ms,
                    concurrent,
                },
                _ => panic!("malformed starts.log line {line:?}"),
            }
        })
        .collect()
}

/// Pids of fixture copies that are running now (a killed copy leaves its
/// `live/<pid>` file behind; it is not counted).
pub fn live_pids(record_dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(record_dir.join("live")) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| pid_alive(*pid))
        .collect();
    pids.sort_unstable();
    pids
}

/// Whether `pid` runs (a zombie counts as dead). Linux `/proc`.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => process_state(&stat).is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// Pids of live (non-zombie) processes whose process group is `pgid`.
pub fn process_group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let state = process_state(&stat);
            let group = stat_field(&stat, 2).and_then(|f| f.parse::<u32>().ok());
            group == Some(pgid) && state.is_some_and(|s| s != 'Z' && s != 'X')
        })
        .collect()
}

/// Waits (up to `bound`) until no process of group `pgid` is alive; returns
/// the survivors (empty on success).
pub async fn wait_group_gone(pgid: u32, bound: Duration) -> Vec<u32> {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let members = process_group_members(pgid);
        if members.is_empty() || tokio::time::Instant::now() >= deadline {
            return members;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// `/proc/<pid>/stat`: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
fn after_comm(stat: &str) -> Option<&str> {
    stat.rfind(')').map(|i| &stat[i + 1..])
}

fn process_state(stat: &str) -> Option<char> {
    after_comm(stat)?.split_whitespace().next()?.chars().next()
}

/// Field `index` after the comm: 0 = state, 1 = ppid, 2 = pgrp.
fn stat_field(stat: &str, index: usize) -> Option<&str> {
    after_comm(stat)?.split_whitespace().nth(index)
}

/// The fixture serving streamable HTTP; killed on drop.
pub struct HttpFixture {
    child: tokio::process::Child,
    url: String,
}

impl HttpFixture {
    /// [`Self::start`] serving HTTPS with the PEM `cert` chain and `key`.
    pub async fn start_tls(cert: &Path, key: &Path, args: &[&str]) -> HttpFixture {
        let cert = cert.to_str().expect("a UTF-8 path");
        let key = key.to_str().expect("a UTF-8 path");
        let mut all = vec!["--tls-cert", cert, "--tls-key", key];
        all.extend_from_slice(args);
        Self::start(&all).await
    }

    /// Starts `mcp-fixture --http 127.0.0.1:0 <args>` and waits for its URL.
    pub async fn start(args: &[&str]) -> HttpFixture {
        let mut child = tokio::process::Command::new(fixture_binary())
            .args(["--http", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawning mcp-fixture --http");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            BufReader::new(stdout).read_line(&mut line),
        )
        .await
        .expect("mcp-fixture --http printed no address within 10s")
        .expect("reading mcp-fixture stdout");
        let url = line.trim().to_string();
        assert!(
            url.starts_with("http://") || url.starts_with("https://"),
            "unexpected first line {url:?}"
        );
        HttpFixture { child, url }
    }

    /// Starts `mcp-fixture --http 127.0.0.1:0 --sse <args>`: the legacy
    /// HTTP+SSE transport, [`Self::url`] the stream's (`…/sse`).
    pub async fn start_sse(args: &[&str]) -> HttpFixture {
        let mut all = vec!["--sse"];
        all.extend_from_slice(args);
        Self::start(&all).await
    }

    /// `http://127.0.0.1:PORT/mcp` (`https://` with TLS; `/sse` with `--sse`).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub fn spec(&self, name: &str) -> ServerSpec {
        ServerSpec {
            name: name.to_string(),
            transport: TransportSpec::StreamableHttp {
                url: self.url.clone(),
                headers: Default::default(),
            },
        }
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_handles_spaces_in_comm() {
        let stat = "1234 (my (odd) name) S 1 999 999 0 -1";
        assert_eq!(process_state(stat), Some('S'));
        assert_eq!(stat_field(stat, 2), Some("999"));
    }

    #[test]
    fn this_process_is_alive_and_in_its_group() {
        let pid = std::process::id();
        assert!(pid_alive(pid));
        assert!(!pid_alive(u32::MAX - 1));
    }
}
