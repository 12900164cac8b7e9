//! Opening a server: connect and list its tools within one deadline, the one
//! way every caller (the agent's discovery, the catalog's preparation, calls
//! and warm-up) starts talking to a server.

use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::connection::{ConnectOptions, Connection};
use crate::error::McpError;
use crate::spec::{Declarations, ServerInfo, ServerSpec, ToolDecl};

/// A bound over the client's own handshake bound: a connect that hangs
/// outside the handshake (it should not) is dropped, and a dropped half-made
/// connection kills its process group.
const CONNECT_BACKSTOP: Duration = Duration::from_secs(2);

/// A server connected and listed, its connection left open.
#[derive(Debug)]
pub struct Opened {
    pub connection: Connection,
    /// Its tools; its prompts and resources only from [`open_and_list_all`].
    pub declared: Declarations,
    /// Connect plus list.
    pub duration: Duration,
}

/// What to list after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listing {
    Tools,
    /// Tools, prompts and resources.
    All,
}

/// The step of [`open_and_list`] that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenStep {
    /// Spawn or open, and the MCP handshake.
    Connect,
    /// `tools/list` after a completed handshake (and, for
    /// [`open_and_list_all`], `prompts/list` and `resources/list`).
    ListTools,
}

/// A failed [`open_and_list`]; nothing of the server is left running. The
/// text is the error's (see [`McpError`]: it may hold secrets).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct OpenError {
    pub step: OpenStep,
    pub error: McpError,
}

/// Connects, then lists every tool (following pagination), both within
/// `timeout` counted from the call. On a failure or when the time is up, a
/// connected server is killed (its whole process group, the leader reaped)
/// and the step that failed is returned; a timeout is `McpError::Timeout`
/// with `after: timeout`. `tools_changed` receives the server's name on
/// every `tools/list_changed` while the connection lives.
pub async fn open_and_list(
    spec: &ServerSpec,
    timeout: Duration,
    tools_changed: Option<UnboundedSender<String>>,
) -> Result<Opened, OpenError> {
    open(spec, timeout, tools_changed, Listing::Tools).await
}

/// [`open_and_list`], also listing the server's prompts and resources
/// (when it advertises them) within the same deadline: what a gateway
/// serves. The connection relays (elicitation and sampling declared, see
/// [`crate::relay`]), for its discovery and its calls alike.
pub async fn open_and_list_all(
    spec: &ServerSpec,
    timeout: Duration,
    tools_changed: Option<UnboundedSender<String>>,
) -> Result<Opened, OpenError> {
    open(spec, timeout, tools_changed, Listing::All).await
}

async fn open(
    spec: &ServerSpec,
    timeout: Duration,
    tools_changed: Option<UnboundedSender<String>>,
    listing: Listing,
) -> Result<Opened, OpenError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let failed = |step, error| OpenError { step, error };
    let options = ConnectOptions {
        tools_changed,
        relays: listing == Listing::All,
        ..ConnectOptions::new(timeout)
    };
    let connection = match tokio::time::timeout(
        timeout + CONNECT_BACKSTOP,
        Connection::connect(spec, options),
    )
    .await
    {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => return Err(failed(OpenStep::Connect, error)),
        Err(_) => {
            return Err(failed(
                OpenStep::Connect,
                McpError::Timeout { after: timeout },
            ));
        }
    };
    let remaining = deadline.saturating_duration_since(Instant::now());
    let listed = async {
        match listing {
            Listing::Tools => Ok(Declarations {
                tools: connection.list_tools().await?,
                ..Declarations::default()
            }),
            Listing::All => connection.list_all().await,
        }
    };
    match tokio::time::timeout(remaining, listed).await {
        Ok(Ok(declared)) => Ok(Opened {
            connection,
            declared,
            duration: started.elapsed(),
        }),
        Ok(Err(error)) => {
            connection.kill().await;
            Err(failed(OpenStep::ListTools, error))
        }
        Err(_) => {
            connection.kill().await;
            Err(failed(
                OpenStep::ListTools,
                McpError::Timeout { after: timeout },
            ))
        }
    }
}

/// The outcome of a one-shot discovery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovery {
    pub tools: Vec<ToolDecl>,
    pub server_info: ServerInfo,
    /// Connect plus list, not counting the close.
    pub duration: Duration,
}

/// [`open_and_list`], then a close, all within `timeout`: whatever still runs
/// when it is up is killed. A server that does not answer in time is killed
/// (its whole process group) and `McpError::Timeout` is returned.
pub async fn discover(spec: &ServerSpec, timeout: Duration) -> Result<Discovery, McpError> {
    let deadline = Instant::now() + timeout;
    let opened = open_and_list(spec, timeout, None)
        .await
        .map_err(|failed| failed.error)?;
    let server_info = opened.connection.server_info();
    opened
        .connection
        .close_within(deadline.saturating_duration_since(Instant::now()))
        .await;
    Ok(Discovery {
        tools: opened.declared.tools,
        server_info,
        duration: opened.duration,
    })
}
