//! The catalog's MCP endpoint, warm: a `tools/call` through `/mcp` against
//! the same call made directly on a warm stdio connection to the same
//! upstream (server-everything), warm `tools/list` throughput with a plain
//! HTTP client that is not the bottleneck, and a new client's first list.
//!
//! The call's floor is the direct call, made by the same client library
//! (rmcp, through `ctxsync-mcp`) on the same machine in the same run: what
//! the ratio shows is what the catalog adds. Beside it, what no HTTP
//! gateway can avoid: the same call through a bare forwarder in this
//! process (HTTP in, the call on its own warm stdio connection, HTTP out:
//! no key, no session, no bookkeeping), by the plain HTTP client; and the
//! catalog's own work per call, as its `/metrics` count it (the upstream's
//! time left out).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use ctxsync_mcp::{ConnectOptions, Connection, ServerSpec, TransportSpec};
use serde_json::{Value, json};

use crate::env::Env;
use crate::floors::IDLE_GAP;
use crate::stats::Latency;
use crate::steps::{BenchError, Progress, Sizes, Step};

const TIMEOUT: Duration = Duration::from_secs(60);
/// The revision of the sessions the bench opens.
const SESSION_VERSION: &str = "2025-11-25";

#[derive(Debug, Clone, Default)]
pub struct McpPath {
    pub skipped: Option<String>,
    pub call_through_catalog: Latency,
    pub call_direct: Latency,
    /// Both again with [`IDLE_GAP`] of idleness before each call: every
    /// process on the way (the upstream's too) as quiet as between an
    /// agent's calls, however long the path is. These series,
    /// `call_forwarder_idle` and `call_plain_http_idle` are taken
    /// interleaved, call by call ([`idle_series`]): whatever else the
    /// machine does meanwhile falls on all four alike.
    pub call_through_catalog_idle: Latency,
    pub call_direct_idle: Latency,
    /// The call through `/mcp` made by a plain HTTP JSON-RPC client.
    pub call_plain_http: Latency,
    /// The same, [`IDLE_GAP`] of idleness before each call, interleaved
    /// with the three above: the catalog beside the bare forwarder with
    /// the same client, less the client library's own hops.
    pub call_plain_http_idle: Latency,
    /// The call through `/mcp` by a 2026-07-28 (stateless) client.
    pub call_stateless: Latency,
    /// The call through a bare HTTP forwarder, plain HTTP client.
    pub call_forwarder: Latency,
    /// The same, [`IDLE_GAP`] of idleness before each call: what no HTTP
    /// gateway can avoid beside `call_direct_idle`.
    pub call_forwarder_idle: Latency,
    /// The catalog's own work per call through `/mcp` (its
    /// `ctxsync_catalog_mcp_call_work_seconds`, mean over the calls), in
    /// microseconds; `None` if it counted none.
    pub catalog_work_us: Option<f64>,
    /// The same calls as the catalog timed them from taking one to its
    /// result (its `ctxsync_catalog_call_seconds`, mean): the session's
    /// lookup and the upstream's round trip from the catalog's process.
    pub catalog_call_us: Option<f64>,
    pub list_clients: usize,
    pub lists: u64,
    pub lists_per_second: f64,
    pub list: Latency,
    pub first_list: Latency,
    pub tools: usize,
}

impl McpPath {
    /// What the catalog adds to a warm call, p50, in microseconds.
    pub fn catalog_own_us(&self) -> f64 {
        self.call_through_catalog.p50_us - self.call_direct.p50_us
    }
}

fn echo_arguments() -> serde_json::Map<String, Value> {
    json!({"message": "x"})
        .as_object()
        .cloned()
        .unwrap_or_default()
}

/// Calls made, untimed, before a series is timed: the connection and the
/// server warm.
const WARMUP_CALLS: u64 = 20;

/// Times `samples` calls (`call(id)`, checked by it) after the warm-up
/// ones, back to back.
async fn timed<F, Fut>(samples: usize, mut call: F) -> Result<Latency, BenchError>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<(), BenchError>>,
{
    let mut durations = Vec::with_capacity(samples);
    for id in 0..samples as u64 + WARMUP_CALLS {
        let started = Instant::now();
        call(id).await?;
        if id >= WARMUP_CALLS {
            durations.push(started.elapsed());
        }
    }
    Ok(Latency::of(durations))
}

/// `samples` warm calls of `tool` by the client library, back to back.
async fn calls(client: &Connection, tool: &str, samples: usize) -> Result<Latency, BenchError> {
    timed(samples, |_| call(client, tool)).await
}

/// One warm call of `tool` by the client library, checked.
async fn call(client: &Connection, tool: &str) -> Result<(), BenchError> {
    let outcome = client
        .call_tool(tool, echo_arguments(), TIMEOUT)
        .await
        .step("mcp tools/call")?;
    if outcome.is_error {
        return Err(BenchError::new(
            "mcp tools/call",
            format!("{tool} answered an error: {}", outcome.content_json),
        ));
    }
    Ok(())
}

/// The same call through `/mcp` (`through`, by the client library, and
/// `plain`, by the plain HTTP client), directly (`direct`) and through the
/// bare forwarder, `samples` of each after the warm-up ones, each after
/// [`IDLE_GAP`] of idleness, taken in turn call by call: taken one series
/// after another, a drift in what else the machine does (another process's
/// burst, a writer's commit) would read as a difference between the paths.
async fn idle_series(
    through: &Connection,
    plain: &PlainSession,
    direct: &Connection,
    forwarder: &Forwarder,
    samples: usize,
) -> Result<IdleSeries, BenchError> {
    let http = reqwest::Client::new();
    let mut series: [Vec<Duration>; 4] = Default::default();
    for id in 0..samples as u64 + WARMUP_CALLS {
        for (path, durations) in series.iter_mut().enumerate() {
            tokio::time::sleep(IDLE_GAP).await;
            let started = Instant::now();
            match path {
                0 => call(through, "everything-1__echo").await?,
                1 => call(direct, "echo").await?,
                2 => forwarder.call(&http, id).await?,
                _ => plain.call(id).await?,
            }
            if id >= WARMUP_CALLS {
                durations.push(started.elapsed());
            }
        }
    }
    let [through, direct, forwarded, plain] = series.map(Latency::of);
    Ok(IdleSeries {
        through,
        direct,
        forwarded,
        plain,
    })
}

/// [`idle_series`]' four series.
#[derive(Default)]
struct IdleSeries {
    through: Latency,
    direct: Latency,
    forwarded: Latency,
    plain: Latency,
}

/// The catalog's `/mcp` for `key`, as an MCP client reaches it.
fn catalog_spec(addr: SocketAddr, key: &str) -> ServerSpec {
    ServerSpec {
        name: "catalog".into(),
        transport: TransportSpec::StreamableHttp {
            url: format!("http://{addr}/mcp"),
            headers: [("Authorization".to_owned(), format!("Bearer {key}"))].into(),
        },
    }
}

/// Measures the MCP path of the catalog at `addr` (serving tenant
/// `tenant`, whose servers include `everything-1`), with `everything` the
/// server-everything binary for the direct calls.
pub async fn measure(
    env: &Env,
    sizes: &Sizes,
    progress: &Progress,
    addr: SocketAddr,
    tenant: &str,
    everything: &Path,
) -> Result<McpPath, BenchError> {
    let key = ctxsync_cli::tenant::create(&env.client, &env.subjects, TIMEOUT, tenant, "bench")
        .await
        .step("tenant key for /mcp")?
        .key;
    let spec = catalog_spec(addr, &key);
    let sessions = ConnectOptions {
        sessions_only: true,
        ..ConnectOptions::new(TIMEOUT)
    };

    progress.step("mcp: a new client's first list, warm memory");
    let mut first = Vec::with_capacity(sizes.mcp_first_lists);
    let mut tools = 0;
    for _ in 0..sizes.mcp_first_lists {
        let started = Instant::now();
        let client = Connection::connect(&spec, sessions.clone())
            .await
            .step("mcp initialize")?;
        tools = client.list_tools().await.step("mcp tools/list")?.len();
        first.push(started.elapsed());
        client.close().await;
    }

    progress.step(format!(
        "mcp: {} warm calls through /mcp and directly",
        sizes.mcp_calls
    ));
    let client = Connection::connect(&spec, sessions.clone())
        .await
        .step("mcp initialize")?;
    let before = histograms(addr).await;
    let through = calls(&client, "everything-1__echo", sizes.mcp_calls).await?;
    let after = histograms(addr).await;
    let catalog_work_us = crate::stats::mean_between(&before, &after, WORK_SECONDS);
    let catalog_call_us = crate::stats::mean_between(&before, &after, CALL_SECONDS);
    let stateless_client = Connection::connect(&spec, ConnectOptions::new(TIMEOUT))
        .await
        .step("mcp, 2026-07-28")?;
    let stateless = calls(&stateless_client, "everything-1__echo", sizes.mcp_calls).await?;
    stateless_client.close().await;
    let direct_spec = ServerSpec {
        name: "everything-direct".into(),
        transport: TransportSpec::Stdio {
            command: everything.display().to_string(),
            args: vec!["stdio".into()],
            env: Default::default(),
            cwd: None,
        },
    };
    let direct_client = Connection::connect(&direct_spec, ConnectOptions::new(TIMEOUT))
        .await
        .step("server-everything, directly")?;
    let direct = calls(&direct_client, "echo", sizes.mcp_calls).await?;

    let plain_session = PlainSession::open(addr, &key).await?;
    let plain = timed(sizes.mcp_calls, |id| plain_session.call(id)).await?;
    let forwarder = Forwarder::start(&direct_spec).await?;
    let forwarded = forwarder.calls(sizes.mcp_calls).await;
    let idle = match forwarded {
        Ok(_) => {
            idle_series(
                &client,
                &plain_session,
                &direct_client,
                &forwarder,
                sizes.mcp_calls,
            )
            .await
        }
        Err(_) => Ok(IdleSeries::default()),
    };
    forwarder.stop().await;
    direct_client.close().await;
    client.close().await;
    let (forwarded, idle) = (forwarded?, idle?);

    progress.step(format!(
        "mcp: warm tools/list throughput, {} sessions",
        sizes.mcp_list_clients
    ));
    let (lists, elapsed, list) =
        list_throughput(addr, &key, sizes.mcp_list_clients, sizes.throughput_window).await?;
    Ok(McpPath {
        skipped: None,
        call_through_catalog: through,
        call_direct: direct,
        call_through_catalog_idle: idle.through,
        call_direct_idle: idle.direct,
        call_plain_http: plain,
        call_stateless: stateless,
        call_forwarder: forwarded,
        call_forwarder_idle: idle.forwarded,
        call_plain_http_idle: idle.plain,
        catalog_work_us,
        catalog_call_us,
        list_clients: sizes.mcp_list_clients,
        lists,
        lists_per_second: lists as f64 / elapsed.as_secs_f64(),
        list,
        first_list: Latency::of(first),
        tools,
    })
}

/// One JSON-RPC POST of a session (or the `initialize` that opens one):
/// the answer's JSON (an SSE stream's `data:` line, or a JSON body) and the
/// session id the server named.
async fn post(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    session: Option<&str>,
    body: &Value,
) -> Result<(Option<Value>, Option<String>), String> {
    let mut request = http
        .post(url)
        .bearer_auth(key)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(session) = session {
        request = request
            .header("mcp-session-id", session)
            .header("mcp-protocol-version", SESSION_VERSION);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    let session = response
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = response.text().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {text}"));
    }
    if text.trim().is_empty() {
        return Ok((None, session));
    }
    let json = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim)
        .find(|data| !data.is_empty())
        .unwrap_or(text.as_str());
    let value: Value = serde_json::from_str(json).map_err(|e| format!("{e}: {json}"))?;
    if let Some(error) = value.get("error") {
        return Err(format!("JSON-RPC error: {error}"));
    }
    Ok((Some(value), session))
}

/// A session opened by hand: initialize, then initialized.
async fn open_session(http: &reqwest::Client, url: &str, key: &str) -> Result<String, String> {
    let initialize = json!({
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {
            "protocolVersion": SESSION_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "ctxsync-bench", "version": "1"},
        },
    });
    let (_, session) = post(http, url, key, None, &initialize).await?;
    let session = session.ok_or("initialize answered without Mcp-Session-Id")?;
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    post(http, url, key, Some(&session), &initialized).await?;
    Ok(session)
}

/// `clients` sessions listing their tools one request after another for
/// `window`: lists answered, the time taken, and each list's latency.
async fn list_throughput(
    addr: SocketAddr,
    key: &str,
    clients: usize,
    window: Duration,
) -> Result<(u64, Duration, Latency), BenchError> {
    let url = format!("http://{addr}/mcp");
    let http = reqwest::Client::new();
    let mut sessions = Vec::with_capacity(clients);
    for _ in 0..clients {
        let session = open_session(&http, &url, key)
            .await
            .map_err(|e| BenchError::new("mcp session", e))?;
        // The first list pins the session's memory: unmeasured.
        list_once(&http, &url, key, &session, 1).await?;
        sessions.push(session);
    }
    let started = Instant::now();
    let workers = sessions.into_iter().map(|session| {
        let (http, url, key) = (http.clone(), url.clone(), key.to_owned());
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut id = 1;
            while started.elapsed() < window {
                id += 1;
                let sent = Instant::now();
                list_once(&http, &url, &key, &session, id).await?;
                latencies.push(sent.elapsed());
            }
            Ok::<_, BenchError>(latencies)
        })
    });
    let mut latencies = Vec::new();
    for worker in futures::future::join_all(workers).await {
        latencies.extend(worker.step("mcp list worker")??);
    }
    let elapsed = started.elapsed();
    Ok((latencies.len() as u64, elapsed, Latency::of(latencies)))
}

/// A session of `/mcp` opened by hand, called with a plain HTTP JSON-RPC
/// client (reqwest): the catalog without the client library.
struct PlainSession {
    http: reqwest::Client,
    url: String,
    key: String,
    session: String,
}

impl PlainSession {
    async fn open(addr: SocketAddr, key: &str) -> Result<Self, BenchError> {
        let url = format!("http://{addr}/mcp");
        let http = reqwest::Client::new();
        let session = open_session(&http, &url, key)
            .await
            .map_err(|e| BenchError::new("mcp session", e))?;
        Ok(Self {
            http,
            url,
            key: key.to_owned(),
            session,
        })
    }

    /// One call of `everything-1__echo`, checked.
    async fn call(&self, id: u64) -> Result<(), BenchError> {
        let call = json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "everything-1__echo", "arguments": {"message": "x"}},
        });
        let (answer, _) = post(&self.http, &self.url, &self.key, Some(&self.session), &call)
            .await
            .map_err(|e| BenchError::new("mcp tools/call", e))?;
        let result = answer.as_ref().map(|a| &a["result"]);
        if result.is_none_or(|r| r["isError"] == true || r["content"].is_null()) {
            return Err(BenchError::new(
                "mcp tools/call",
                format!("not an echo: {answer:?}"),
            ));
        }
        Ok(())
    }
}

async fn list_once(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    session: &str,
    id: u64,
) -> Result<(), BenchError> {
    let list = json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"});
    let (answer, _) = post(http, url, key, Some(session), &list)
        .await
        .map_err(|e| BenchError::new("mcp tools/list", e))?;
    let listed = answer
        .as_ref()
        .and_then(|a| a["result"]["tools"].as_array())
        .map_or(0, Vec::len);
    if listed == 0 {
        return Err(BenchError::new(
            "mcp tools/list",
            format!("no tools listed: {answer:?}"),
        ));
    }
    Ok(())
}

/// The catalog's own work on a call it answered itself (arrival to
/// answer, less the upstream's time).
const WORK_SECONDS: &str = "ctxsync_catalog_mcp_call_work_seconds";
/// A call as the catalog's call path timed it (session lookup and upstream).
const CALL_SECONDS: &str = "ctxsync_catalog_call_seconds";

/// The `/metrics` text of the listener at `addr`, if it answers.
async fn histograms(addr: SocketAddr) -> Option<String> {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// A bare HTTP→stdio forwarder: each POSTed JSON-RPC `tools/call` is made
/// on its own warm connection to a server, and answered as JSON. What any
/// HTTP gateway pays at least; nothing of the catalog's.
struct Forwarder {
    addr: SocketAddr,
    upstream: std::sync::Arc<Connection>,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start(spec: &ServerSpec) -> Result<Self, BenchError> {
        let upstream = std::sync::Arc::new(
            Connection::connect(spec, ConnectOptions::new(TIMEOUT))
                .await
                .step("the forwarder's upstream")?,
        );
        let forwarding = upstream.clone();
        let app = axum::Router::new().route(
            "/",
            axum::routing::post(move |body: axum::body::Bytes| {
                let upstream = forwarding.clone();
                async move { forward(&upstream, &body).await }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .step("the forwarder's listener")?;
        let addr = listener.local_addr().step("the forwarder's listener")?;
        // As the services' listeners: small answers go out at once.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            upstream,
            task,
        })
    }

    /// `samples` warm calls of `echo` through it, back to back (a few
    /// first, untimed), by the plain HTTP client.
    async fn calls(&self, samples: usize) -> Result<Latency, BenchError> {
        let http = reqwest::Client::new();
        timed(samples, |id| self.call(&http, id)).await
    }

    /// One call of `echo` through it, by the plain HTTP client `http`.
    async fn call(&self, http: &reqwest::Client, id: u64) -> Result<(), BenchError> {
        let call = json!({
            "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"message": "x"}},
        });
        let url = format!("http://{}/", self.addr);
        let (answer, _) = post(http, &url, "-", None, &call)
            .await
            .map_err(|e| BenchError::new("forwarder tools/call", e))?;
        if answer
            .as_ref()
            .is_none_or(|a| a["result"]["isError"] != false)
        {
            return Err(BenchError::new(
                "forwarder tools/call",
                format!("not an echo: {answer:?}"),
            ));
        }
        Ok(())
    }

    async fn stop(self) {
        self.task.abort();
        if let Ok(upstream) = std::sync::Arc::try_unwrap(self.upstream) {
            upstream.close().await;
        }
    }
}

/// One forwarded call: the JSON-RPC answer to the POSTed request.
async fn forward(upstream: &Connection, body: &[u8]) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "not JSON").into_response();
    };
    let params = &request["params"];
    let name = params["name"].as_str().unwrap_or_default();
    let arguments = params["arguments"].as_object().cloned().unwrap_or_default();
    let result = match upstream.call_tool(name, arguments, TIMEOUT).await {
        Ok(outcome) => json!({
            "content": serde_json::from_str::<Value>(&outcome.content_json).unwrap_or_default(),
            "isError": outcome.is_error,
        }),
        Err(error) => {
            json!({"content": [{"type": "text", "text": error.to_string()}], "isError": true})
        }
    };
    axum::Json(json!({"jsonrpc": "2.0", "id": request["id"], "result": result})).into_response()
}
