//! What every section shares: the sizes it runs at, the progress line, and
//! the error that names the step that failed.

use std::fmt::Display;
use std::io::{IsTerminal, Write};
use std::time::Duration;

/// `ctxsync-bench` options.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Smaller sizes, for CI: finishes in well under a minute in a debug build.
    #[arg(long)]
    pub quick: bool,

    /// Print the results as JSON on stdout (the progress line stays on stderr).
    #[arg(long)]
    pub json: bool,

    /// How the services run: `single` (in the bench's process, as `ctxsync
    /// up` runs them) or `deployed` (each its own process, two replicas each,
    /// on a three-node NATS cluster the bench starts unless NATS_URL is given).
    #[arg(long, value_enum, default_value_t = Mode::Single)]
    pub mode: Mode,

    /// NATS server URL or a comma-separated list of a cluster's URLs; when
    /// unset, 127.0.0.1:4222 if it answers, else a private nats-server.
    #[arg(long, env = "NATS_URL", value_parser = ctxsync_runtime::config::NatsUrlParser)]
    pub nats_url: Option<String>,

    /// Postgres URL of a role that may create databases; the bench creates and
    /// drops its own database there. When unset, 127.0.0.1:5432 if it answers,
    /// else a private Postgres.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
}

/// Why the bench could not run (a missed target is not an error).
#[derive(Debug, thiserror::Error)]
#[error("{step}: {reason}")]
pub struct BenchError {
    pub step: String,
    pub reason: String,
}

impl BenchError {
    pub(crate) fn new(step: impl Into<String>, reason: impl Display) -> Self {
        Self {
            step: step.into(),
            reason: reason.to_string(),
        }
    }
}

/// Attaches the bench step to any error.
pub(crate) trait Step<T> {
    fn step(self, step: &str) -> Result<T, BenchError>;
}

impl<T, E: Display> Step<T> for Result<T, E> {
    fn step(self, step: &str) -> Result<T, BenchError> {
        self.map_err(|e| BenchError::new(step, e))
    }
}

/// Discoveries completed at once in a wake round.
pub(crate) const COMPLETE_CONCURRENCY: usize = 8;

/// How much work each section does.
#[derive(Debug, Clone)]
pub(crate) struct Sizes {
    pub agents: usize,
    /// Chats waiting at once in the wake cases (spread over `agents`).
    pub wake_chats: [usize; 3],
    /// Rounds of the single-chat wake case.
    pub single_wake_rounds: usize,
    pub floor_samples: usize,
    pub gate_ready_samples: usize,
    pub throughput_window: Duration,
    pub throughput_clients: usize,
    pub polling_rounds: usize,
    pub polling_interval: Duration,
    pub warm_preparations: usize,
    /// New MCP clients' first lists, warm calls per side, and sessions
    /// listing at once (the MCP path).
    pub mcp_first_lists: usize,
    pub mcp_calls: usize,
    pub mcp_list_clients: usize,
}

impl Sizes {
    pub fn new(quick: bool) -> Self {
        if quick {
            Self {
                agents: 100,
                wake_chats: [1, 100, 1000],
                single_wake_rounds: 20,
                floor_samples: 300,
                gate_ready_samples: 200,
                throughput_window: Duration::from_millis(1500),
                throughput_clients: 8,
                polling_rounds: 6,
                polling_interval: Duration::from_millis(500),
                warm_preparations: 10,
                mcp_first_lists: 10,
                mcp_calls: 200,
                mcp_list_clients: 16,
            }
        } else {
            Self {
                agents: 1000,
                wake_chats: [1, 1000, 10_000],
                single_wake_rounds: 100,
                floor_samples: 3000,
                gate_ready_samples: 2000,
                throughput_window: Duration::from_secs(5),
                throughput_clients: 8,
                polling_rounds: 20,
                polling_interval: Duration::from_millis(500),
                warm_preparations: 50,
                mcp_first_lists: 50,
                mcp_calls: 1000,
                mcp_list_clients: 16,
            }
        }
    }
}

/// The progress line on stderr: rewritten in place on a terminal, one line
/// per step otherwise (CI logs).
pub struct Progress {
    terminal: bool,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            terminal: std::io::stderr().is_terminal(),
        }
    }
}

impl Progress {
    pub fn step(&self, message: impl Display) {
        let mut err = std::io::stderr().lock();
        if self.terminal {
            let _ = write!(err, "\r\x1b[2K[bench] {message}");
        } else {
            let _ = writeln!(err, "[bench] {message}");
        }
        let _ = err.flush();
    }

    pub fn done(&self) {
        if self.terminal {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}

/// How the services run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    /// In the bench's process, on one NATS server.
    #[default]
    Single,
    /// Each service its own process (the built binaries), two replicas
    /// each, on a three-node NATS cluster the bench starts.
    Deployed,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Single => "single",
            Self::Deployed => "deployed",
        }
    }
}
