//! `mcp-fixture`: a small MCP server with the failure modes ctxsync's tests need.
//! See the crate docs in `lib.rs` for the modes and the record-dir format.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod sse;

use anyhow::Context as _;
use axum::response::IntoResponse as _;
use clap::{Parser, ValueEnum};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, DiscoverResult,
    ErrorData, GetPromptRequestParams, GetPromptResponse, GetPromptResult, Implementation,
    InitializeRequestParams, InitializeResult, ListPromptsResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, Prompt, PromptArgument, PromptMessage,
    ProtocolVersion, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Resource,
    ResourceContents, Role, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{Peer, RoleServer, ServerHandler, ServiceExt};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Tools `echo` and `add`.
    Normal,
    /// Like normal, after sleeping `--delay-ms` before reading stdin.
    SlowStart,
    /// Never answers; also starts a grandchild (`sleep`) in its process group.
    Hang,
    /// Writes a line to stderr and exits with status 3 before the handshake.
    Crash,
    /// A valid server with no tools.
    ZeroTools,
    /// Tools read from `--tools-file` on every list; `--watch` notifies changes.
    /// The file is an array of tools, or an object with `tools`, `prompts`
    /// and `resources` (this mode alone offers prompts and resources).
    ChangingTools,
    /// Rejects `initialize` with an error (also written to stderr) that echoes
    /// its env values, its args and `--url`.
    SecretError,
    /// Writes NUL bytes, other control characters and terminal colours to
    /// stderr, then exits with status 3 before the handshake.
    CrashNul,
    /// Tools `echo` and `add` whose descriptions (and schema) hold NUL and
    /// other control characters.
    NulTools,
    /// Writes its whole environment and its args to stderr, then (with
    /// `--edge-var NAME`) the value of NAME followed by filler so that the
    /// last 4 KiB of stderr start in the middle of it, and exits with status 3
    /// before the handshake.
    EchoEnvCrash,
    /// Completes the handshake, then rejects `tools/list` with an error
    /// echoing what `secret-error` echoes.
    SecretListError,
}

#[derive(Debug, Parser)]
#[command(name = "mcp-fixture", about = "ctxsync's MCP test server")]
struct Args {
    #[arg(long, env = "MCP_FIXTURE_MODE", value_enum, default_value = "normal")]
    mode: Mode,
    /// Slow-start delay.
    #[arg(long, env = "MCP_FIXTURE_DELAY_MS", default_value_t = 0)]
    delay_ms: u64,
    /// JSON `[{"name": "...", "description": "..."}]` (changing-tools).
    #[arg(long, env = "MCP_FIXTURE_TOOLS_FILE")]
    tools_file: Option<PathBuf>,
    /// Send `notifications/tools/list_changed` when the tools file changes.
    #[arg(long, env = "MCP_FIXTURE_WATCH")]
    watch: bool,
    /// Tools per `tools/list` page; 0 = everything in one page.
    #[arg(long, env = "MCP_FIXTURE_PAGE_SIZE", default_value_t = 0)]
    page_size: usize,
    /// Record starts and live copies here (see lib docs).
    #[arg(long, env = "MCP_FIXTURE_RECORD_DIR")]
    record_dir: Option<PathBuf>,
    /// Serve streamable HTTP on this address (path `/mcp`) instead of stdio.
    #[arg(long, env = "MCP_FIXTURE_HTTP")]
    http: Option<String>,
    /// With --http: serve the legacy HTTP+SSE transport instead (`GET /sse`
    /// opens the stream, its `endpoint` event names `/message?sessionId=…`).
    #[arg(long, env = "MCP_FIXTURE_SSE", requires = "http")]
    sse: bool,
    /// With --http: answer 401 to every request without this header,
    /// written `Name: value`.
    #[arg(long, env = "MCP_FIXTURE_REQUIRE_HEADER", requires = "http")]
    require_header: Option<String>,
    /// With --http: serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(long, env = "MCP_FIXTURE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert.
    #[arg(long, env = "MCP_FIXTURE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// A URL (with credentials) the secret-error mode pretends it called.
    #[arg(long, env = "MCP_FIXTURE_URL")]
    url: Option<String>,
    /// echo-env-crash: the env var whose value ends up cut by a 4 KiB tail.
    #[arg(long, env = "MCP_FIXTURE_EDGE_VAR")]
    edge_var: Option<String>,
    /// The protocol revisions served: `all` (up to 2026-07-28, both eras),
    /// `stateless` (2026-07-28 only) or `sessions` (up to 2025-11-25, no
    /// `server/discover`, as a server written before 2026 answers).
    #[arg(long, env = "MCP_FIXTURE_PROTOCOLS", value_enum, default_value = "all")]
    protocols: Protocols,
    /// The `ttlMs` cache hint on every list (an hour by default: a server
    /// that says its lists hold; a shorter one shortens the catalog's reuse).
    #[arg(long, env = "MCP_FIXTURE_TTL_MS", default_value_t = 3_600_000)]
    ttl_ms: u64,
    /// Ignored positional arguments (echoed by secret-error).
    #[arg(trailing_var_arg = true)]
    rest: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Protocols {
    All,
    Stateless,
    Sessions,
}

#[derive(Clone, Debug, Deserialize)]
struct ToolSpec {
    name: String,
    #[serde(default)]
    description: String,
}

#[derive(Clone, Debug, Deserialize)]
struct PromptSpec {
    name: String,
    #[serde(default)]
    description: String,
    /// Argument names (optional arguments).
    #[serde(default)]
    arguments: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
struct ResourceSpec {
    uri: String,
    name: String,
    /// What `resources/read` answers.
    #[serde(default)]
    text: String,
}

/// `--tools-file`: an array of tools, or tools, prompts and resources.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum ToolsFile {
    Tools(Vec<ToolSpec>),
    All {
        #[serde(default)]
        tools: Vec<ToolSpec>,
        #[serde(default)]
        prompts: Vec<PromptSpec>,
        #[serde(default)]
        resources: Vec<ResourceSpec>,
    },
}

#[derive(Clone)]
pub(crate) struct Fixture {
    args: Arc<Args>,
    /// Peers to notify when the tools file changes (one per session).
    peers: Arc<Mutex<Vec<Peer<RoleServer>>>>,
}

impl Fixture {
    fn tools(&self) -> Result<Vec<Tool>, ErrorData> {
        match self.args.mode {
            Mode::ZeroTools => Ok(Vec::new()),
            Mode::ChangingTools => {
                let path = self.args.tools_file.as_ref().ok_or_else(|| {
                    ErrorData::internal_error("changing-tools needs --tools-file", None)
                })?;
                let specs = match read_tools_file(path)
                    .map_err(|e| ErrorData::internal_error(format!("{e:#}"), None))?
                {
                    ToolsFile::Tools(tools) | ToolsFile::All { tools, .. } => tools,
                };
                Ok(specs
                    .into_iter()
                    .map(|spec| {
                        Tool::new(
                            spec.name,
                            spec.description,
                            object(json!({"type": "object"})),
                        )
                    })
                    .collect())
            }
            Mode::NulTools => Ok(vec![
                Tool::new(
                    "echo",
                    "Returns its text\0 argument, \u{1b}[1mloudly\u{1b}[0m\u{7}",
                    object(json!({
                        "type": "object",
                        "properties": {"text": {"type": "string", "description": "the text\u{0}"}},
                        "required": ["text"]
                    })),
                ),
                Tool::new(
                    "add",
                    "Adds\u{1} two\r\nnumbers\0",
                    object(json!({
                        "type": "object",
                        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                        "required": ["a", "b"]
                    })),
                ),
            ]),
            _ => Ok(vec![
                Tool::new(
                    "echo",
                    "Returns its text argument",
                    object(json!({
                        "type": "object",
                        "properties": {"text": {"type": "string"}},
                        "required": ["text"]
                    })),
                ),
                Tool::new(
                    "add",
                    "Adds two numbers",
                    object(json!({
                        "type": "object",
                        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                        "required": ["a", "b"]
                    })),
                ),
            ]),
        }
    }

    fn secret_message(&self) -> String {
        let env: Vec<String> = std::env::vars()
            .filter(|(name, _)| name.starts_with("FIXTURE_") || name.starts_with("MCP_FIXTURE_"))
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        let args: Vec<String> = std::env::args().skip(1).collect();
        format!(
            "upstream {} refused the credentials; env: {}; args: {}",
            self.args.url.as_deref().unwrap_or("(no --url)"),
            env.join(" "),
            args.join(" ")
        )
    }
}

fn object(value: Value) -> Arc<serde_json::Map<String, Value>> {
    match value {
        Value::Object(map) => Arc::new(map),
        _ => unreachable!("schemas are objects"),
    }
}

impl Fixture {
    /// The tools file's prompts and resources (none in other modes).
    fn prompts_and_resources(&self) -> Result<(Vec<PromptSpec>, Vec<ResourceSpec>), ErrorData> {
        let Some(path) = &self.args.tools_file else {
            return Ok((Vec::new(), Vec::new()));
        };
        if self.args.mode != Mode::ChangingTools {
            return Ok((Vec::new(), Vec::new()));
        }
        match read_tools_file(path)
            .map_err(|e| ErrorData::internal_error(format!("{e:#}"), None))?
        {
            ToolsFile::Tools(_) => Ok((Vec::new(), Vec::new())),
            ToolsFile::All {
                prompts, resources, ..
            } => Ok((prompts, resources)),
        }
    }
}

fn read_tools_file(path: &Path) -> anyhow::Result<ToolsFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

impl ServerHandler for Fixture {
    fn get_info(&self) -> ServerConfig {
        let capabilities = if self.args.mode == Mode::ChangingTools {
            ServerCapabilities::builder()
                .enable_prompts()
                .enable_prompts_list_changed()
                .enable_resources()
                .enable_resources_list_changed()
                .enable_tools()
                .enable_tool_list_changed()
                .build()
        } else {
            ServerCapabilities::builder()
                .enable_tools()
                .enable_tool_list_changed()
                .build()
        };
        ServerConfig::new(capabilities).with_server_info(Implementation::new(
            "mcp-fixture",
            env!("CARGO_PKG_VERSION"),
        ))
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        match self.args.protocols {
            Protocols::All => Cow::Borrowed(ProtocolVersion::KNOWN_VERSIONS),
            Protocols::Stateless => Cow::Owned(vec![ProtocolVersion::V_2026_07_28]),
            Protocols::Sessions => Cow::Borrowed(ProtocolVersion::known_up_to(
                &ProtocolVersion::LATEST_WITH_INITIALIZE,
            )),
        }
    }

    async fn discover(
        &self,
        _context: RequestContext<RoleServer>,
    ) -> Result<DiscoverResult, ErrorData> {
        if self.args.protocols == Protocols::Sessions {
            return Err(ErrorData::new(
                rmcp::model::ErrorCode::METHOD_NOT_FOUND,
                "method not found: server/discover",
                None,
            ));
        }
        // The handshake's failure, in the era without a handshake.
        if self.args.mode == Mode::SecretError {
            let message = self.secret_message();
            eprintln!("mcp-fixture: {message}");
            return Err(ErrorData::internal_error(message, None));
        }
        let mut versions = self.supported_protocol_versions().into_owned();
        versions.reverse();
        Ok(DiscoverResult::from_server_info(versions, self.get_info()))
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        if self.args.mode == Mode::SecretError {
            let message = self.secret_message();
            eprintln!("mcp-fixture: {message}");
            return Err(ErrorData::internal_error(message, None));
        }
        context.peer.set_peer_info(request.clone());
        self.negotiate_initialize(&request)
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.peers.lock().expect("peers lock").push(context.peer);
    }

    /// A client's progress (on `ask`'s question) is recorded.
    async fn on_progress(
        &self,
        progress: rmcp::model::ProgressNotificationParam,
        _context: NotificationContext<RoleServer>,
    ) {
        if let Some(dir) = &self.args.record_dir {
            mcp_fixture::record_progress(dir, progress.progress);
        }
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        if self.args.mode == Mode::SecretListError {
            let message = self.secret_message();
            eprintln!("mcp-fixture: {message}");
            return Err(ErrorData::internal_error(message, None));
        }
        let tools = self.tools()?;
        let page_size = self.args.page_size;
        if page_size == 0 {
            return Ok(ListToolsResult::with_all_items(tools).with_ttl_ms(self.args.ttl_ms));
        }
        let start: usize = match request.and_then(|r| r.cursor) {
            Some(cursor) => cursor
                .parse()
                .map_err(|_| ErrorData::invalid_params("bad cursor", None))?,
            None => 0,
        };
        let end = (start + page_size).min(tools.len());
        let mut page = ListToolsResult::with_all_items(tools[start.min(end)..end].to_vec())
            .with_ttl_ms(self.args.ttl_ms);
        if end < tools.len() {
            page.next_cursor = Some(end.to_string());
        }
        Ok(page)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let arguments = request.arguments.unwrap_or_default();
        let result = match request.name.as_ref() {
            "echo" => {
                let text = arguments
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                CallToolResult::success(vec![ContentBlock::text(text)])
            }
            "add" => {
                let a = arguments.get("a").and_then(Value::as_f64);
                let b = arguments.get("b").and_then(Value::as_f64);
                match (a, b) {
                    (Some(a), Some(b)) => {
                        CallToolResult::success(vec![ContentBlock::text((a + b).to_string())])
                    }
                    _ => CallToolResult::error(vec![ContentBlock::text("a and b must be numbers")]),
                }
            }
            // Not listed by any mode but changing-tools' file: a call that
            // takes `ms` milliseconds (call timeouts). A cancellation ends it
            // at once and is recorded (`cancelled.log` in the record dir).
            "sleep" => {
                let ms = arguments.get("ms").and_then(Value::as_u64).unwrap_or(0);
                if let Some(dir) = &self.args.record_dir {
                    mcp_fixture::record_sleeping(dir, &context.id.to_string());
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    () = context.ct.cancelled() => {
                        if let Some(dir) = &self.args.record_dir {
                            mcp_fixture::record_cancellation(dir, &context.id.to_string());
                        }
                        return Err(ErrorData::internal_error("cancelled", None));
                    }
                }
                CallToolResult::success(vec![ContentBlock::text("slept")])
            }
            // Not listed by any mode but changing-tools' file: asks the
            // client to sample `prompt` and answers its reply's text.
            "ask" => {
                let prompt = arguments
                    .get("prompt")
                    .and_then(Value::as_str)
                    .unwrap_or("hi");
                CallToolResult::success(vec![ContentBlock::text(ask(&context.peer, prompt).await?)])
            }
            other => {
                return Err(ErrorData::invalid_params(
                    format!("unknown tool {other}"),
                    None,
                ));
            }
        };
        Ok(result.into())
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        let (prompts, _) = self.prompts_and_resources()?;
        Ok(ListPromptsResult::with_all_items(
            prompts
                .into_iter()
                .map(|p| {
                    let arguments = p.arguments.into_iter().map(PromptArgument::new).collect();
                    Prompt::new(p.name, Some(p.description), Some(arguments))
                })
                .collect(),
        )
        .with_ttl_ms(self.args.ttl_ms))
    }

    /// One user message naming the prompt and its arguments.
    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        let (prompts, _) = self.prompts_and_resources()?;
        let Some(prompt) = prompts.into_iter().find(|p| p.name == request.name) else {
            return Err(ErrorData::invalid_params(
                format!("unknown prompt {}", request.name),
                None,
            ));
        };
        let arguments = Value::Object(request.arguments.unwrap_or_default());
        let text = format!("prompt {} with {arguments}", prompt.name);
        Ok(
            GetPromptResult::new(vec![PromptMessage::new_text(Role::User, text)])
                .with_description(prompt.description)
                .into(),
        )
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let (_, resources) = self.prompts_and_resources()?;
        Ok(ListResourcesResult::with_all_items(
            resources
                .into_iter()
                .map(|r| Resource::new(r.uri, r.name).with_mime_type("text/plain"))
                .collect(),
        )
        .with_ttl_ms(self.args.ttl_ms))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let (_, resources) = self.prompts_and_resources()?;
        let Some(resource) = resources.into_iter().find(|r| r.uri == request.uri) else {
            return Err(ErrorData::resource_not_found(
                format!("unknown resource {}", request.uri),
                None,
            ));
        };
        Ok(
            ReadResourceResult::new(vec![ResourceContents::text(resource.text, resource.uri)])
                .into(),
        )
    }
}

/// Notifies every session when the tools file's content changes (polling:
/// simple and the same on every filesystem).
async fn watch_tools_file(path: PathBuf, peers: Arc<Mutex<Vec<Peer<RoleServer>>>>) {
    let mut last = std::fs::read(&path).ok();
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = std::fs::read(&path).ok();
        if now != last {
            last = now;
            let current: Vec<Peer<RoleServer>> = peers.lock().expect("peers lock").clone();
            for peer in current {
                let _ = peer.notify_tool_list_changed().await;
                let _ = peer.notify_prompt_list_changed().await;
                let _ = peer.notify_resource_list_changed().await;
            }
        }
    }
}

/// Start records: `starts.log` gets `pid unix_ms concurrent=N` per start, where N
/// counts the live copies (files in `live/` whose pid still runs) including
/// this one; `live/<pid>` exists while the copy runs.
struct Recording {
    live_file: PathBuf,
}

impl Recording {
    fn start(dir: &Path) -> anyhow::Result<Recording> {
        use std::io::Write as _;
        let live = dir.join("live");
        std::fs::create_dir_all(&live).with_context(|| format!("creating {}", live.display()))?;
        let pid = std::process::id();
        let live_file = live.join(pid.to_string());
        std::fs::write(&live_file, b"").context("writing live file")?;
        let concurrent = mcp_fixture::live_pids(dir).len();
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("starts.log"))
            .context("opening starts.log")?;
        // One write per line: appends of one small line do not interleave.
        log.write_all(format!("{pid} {unix_ms} concurrent={concurrent}\n").as_bytes())?;
        Ok(Recording { live_file })
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.live_file);
    }
}

/// `ask`: the client samples `prompt`; its reply's text.
#[allow(deprecated)] // Sampling: the 2025 revisions' request, which `ask` tests.
async fn ask(peer: &Peer<RoleServer>, prompt: &str) -> Result<String, ErrorData> {
    let params = rmcp::model::CreateMessageRequestParams::new(
        vec![rmcp::model::SamplingMessage::user_text(prompt)],
        16,
    );
    let reply = peer
        .create_message(params)
        .await
        .map_err(|e| ErrorData::internal_error(format!("the client did not sample: {e}"), None))?;
    Ok(serde_json::to_value(&reply.message.content)
        .ok()
        .and_then(|c| c.get("text").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_default())
}

/// A TCP listener whose connections are TLS sessions (a failed handshake is
/// dropped and the next connection accepted).
struct TlsListener {
    inner: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, peer)) = self.inner.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let handshake = self.acceptor.accept(stream);
            match tokio::time::timeout(Duration::from_secs(5), handshake).await {
                Ok(Ok(stream)) => return (stream, peer),
                Ok(Err(error)) => eprintln!("mcp-fixture: tls handshake failed: {error}"),
                Err(_) => eprintln!("mcp-fixture: tls handshake timed out"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    let _recording = match &args.record_dir {
        Some(dir) => Some(Recording::start(dir)?),
        None => None,
    };
    match args.mode {
        Mode::Crash => {
            eprintln!("mcp-fixture: crashing at start as asked");
            drop(_recording);
            std::process::exit(3);
        }
        Mode::CrashNul => {
            use std::io::Write as _;
            let mut stderr = std::io::stderr();
            stderr
                .write_all(b"mcp-fixture: \0\0bad \x1b[31mbytes\x1b[0m\x01 before failing\0\r\n")?;
            stderr.flush()?;
            drop(_recording);
            std::process::exit(3);
        }
        Mode::EchoEnvCrash => {
            use std::io::Write as _;
            let mut stderr = std::io::stderr();
            for (name, value) in std::env::vars_os() {
                writeln!(
                    stderr,
                    "{}={}",
                    name.to_string_lossy(),
                    value.to_string_lossy()
                )?;
            }
            writeln!(
                stderr,
                "args: {}",
                std::env::args().collect::<Vec<_>>().join(" ")
            )?;
            if let Some(name) = &args.edge_var {
                let value = std::env::var(name).unwrap_or_default();
                // What follows the value is 4096 bytes less half of it: a
                // 4 KiB tail starts in its middle.
                let filler = 4096usize.saturating_sub(value.len().div_ceil(2) + 1);
                writeln!(stderr, "{value}")?;
                stderr.write_all(&b"x".repeat(filler))?;
            }
            stderr.flush()?;
            drop(_recording);
            std::process::exit(3);
        }
        Mode::Hang => {
            // A grandchild in our process group: proves the whole group is stopped.
            let _grandchild = tokio::process::Command::new("sleep").arg("600").spawn()?;
            std::future::pending::<()>().await;
        }
        Mode::SlowStart => tokio::time::sleep(Duration::from_millis(args.delay_ms)).await,
        _ => {}
    }

    let fixture = Fixture {
        args: args.clone(),
        peers: Arc::new(Mutex::new(Vec::new())),
    };
    if args.watch
        && let Some(path) = &args.tools_file
    {
        tokio::spawn(watch_tools_file(path.clone(), fixture.peers.clone()));
    }

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    match &args.http {
        Some(address) => {
            let cancel = tokio_util::sync::CancellationToken::new();
            let sse_fixture = fixture.clone();
            let service: StreamableHttpService<Fixture, LocalSessionManager> =
                StreamableHttpService::new(
                    move || Ok(fixture.clone()),
                    Default::default(),
                    StreamableHttpServerConfig::default()
                        .with_sse_keep_alive(None)
                        .with_cancellation_token(cancel.child_token()),
                );
            let (mut router, path) = if args.sse {
                (sse::router(sse_fixture), "sse")
            } else {
                (axum::Router::new().nest_service("/mcp", service), "mcp")
            };
            if let Some(required) = &args.require_header {
                let (name, value) = required
                    .split_once(':')
                    .context("--require-header is `Name: value`")?;
                let (name, value) = (name.trim().to_owned(), value.trim().to_owned());
                router = router.layer(axum::middleware::from_fn(
                    move |request: axum::extract::Request, next: axum::middleware::Next| {
                        let present = request
                            .headers()
                            .get(name.as_str())
                            .is_some_and(|v| v.as_bytes() == value.as_bytes());
                        async move {
                            if present {
                                next.run(request).await
                            } else {
                                axum::http::StatusCode::UNAUTHORIZED.into_response()
                            }
                        }
                    },
                ));
            }
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("binding {address}"))?;
            let stopped = {
                let cancel = cancel.clone();
                async move { cancel.cancelled_owned().await }
            };
            match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => {
                    let config = ctxsync_tls::server_config(
                        &ctxsync_tls::PemFile::new("--tls-cert", cert),
                        &ctxsync_tls::PemFile::new("--tls-key", key),
                    )?;
                    println!("https://{}/{path}", listener.local_addr()?);
                    let listener = TlsListener {
                        inner: listener,
                        acceptor: tokio_rustls::TlsAcceptor::from(config),
                    };
                    let server = axum::serve(listener, router).with_graceful_shutdown(stopped);
                    tokio::select! {
                        result = server => result?,
                        _ = terminate.recv() => cancel.cancel(),
                    }
                }
                _ => {
                    println!("http://{}/{path}", listener.local_addr()?);
                    let server = axum::serve(listener, router).with_graceful_shutdown(stopped);
                    tokio::select! {
                        result = server => result?,
                        _ = terminate.recv() => cancel.cancel(),
                    }
                }
            }
        }
        None => {
            let running = match fixture.serve(rmcp::transport::stdio()).await {
                Ok(running) => running,
                // secret-error ends here: the error has been sent to the client.
                Err(error) => {
                    eprintln!("mcp-fixture: handshake ended: {error}");
                    drop(_recording);
                    std::process::exit(1);
                }
            };
            tokio::select! {
                _ = running.waiting() => {}
                _ = terminate.recv() => {}
            }
        }
    }
    Ok(())
}
