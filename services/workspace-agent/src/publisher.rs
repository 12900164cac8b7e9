//! Publication to agent-ingest: Startup first, then one push per change.
//!
//! [`Publisher`] is one HTTP call each (protobuf both ways); [`run`] is the
//! driver of `publisher_core`'s [`Machine`], which decides everything (what
//! to send, when to retry, when to reclaim or re-announce: its crate docs
//! list the rules). The driver performs the requests it asks for, sleeps
//! until the instants it names, and feeds back each answer, each new report
//! from discovery and shutdown.

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use ctxsync_proto::v1::{
    PushContextStateRequest, PushContextStateResponse, PushDropReason, StartupDropReason,
    StartupRequest, StartupResponse, mcp_discovery::Phase,
};
use prost::Message;
use publisher_core::{
    Action, Event, Failure, FailureKind, Machine, Publishable, PushReply, StartupReply,
};
pub use publisher_core::{Backoff, DEFAULT_REANNOUNCE_INTERVAL};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::report::{Report, SharedReport};

/// Sent in Startup as `agent_version`.
pub const AGENT_VERSION: &str = concat!("workspace-agent/", env!("CARGO_PKG_VERSION"));

pub const STARTUP_PATH: &str = "/api/v1/agent/startup";
pub const PUSH_PATH: &str = "/api/v1/agent/context-state";
const PROTOBUF: &str = "application/x-protobuf";

/// The agent token. Never printed: `Debug` shows a placeholder.
#[derive(Clone)]
pub struct AgentToken(String);

impl AgentToken {
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// Reads a token file (surrounding whitespace trimmed).
    pub fn from_file(path: &std::path::Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenError::Read {
            path: path.display().to_string(),
            reason: crate::context::io_reason(&e),
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(TokenError::Empty {
                path: path.display().to_string(),
            });
        }
        Ok(Self(token.to_owned()))
    }
}

impl fmt::Debug for AgentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AgentToken([redacted])")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the agent token file {path} (CTXSYNC_AGENT_TOKEN_FILE): {reason}")]
    Read { path: String, reason: String },
    #[error("the agent token file {path} (CTXSYNC_AGENT_TOKEN_FILE) is empty")]
    Empty { path: String },
}

#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// agent-ingest's base URL, e.g. `https://ingest.example:8443` or `http://127.0.0.1:8081`.
    pub ingest_url: String,
    /// A PEM CA to trust for an `https://` ingest URL, besides the system's roots.
    pub ingest_ca_file: Option<PathBuf>,
    pub token: AgentToken,
    pub agent_version: String,
    pub request_timeout: Duration,
    pub backoff: Backoff,
    /// How often the agent re-announces itself (a Startup of its run) to
    /// notice a takeover by a late message while nothing changes; zero never.
    pub reannounce_interval: Duration,
}

impl PublisherConfig {
    pub fn new(ingest_url: impl Into<String>, token: AgentToken) -> Self {
        Self {
            ingest_url: ingest_url.into(),
            ingest_ca_file: None,
            token,
            agent_version: AGENT_VERSION.to_owned(),
            request_timeout: Duration::from_secs(10),
            backoff: Backoff::default(),
            reannounce_interval: crate::args::Cli::defaults().reannounce_interval,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("agent-ingest refused the agent token (401): {message}")]
    Unauthorized { message: String },
    #[error("agent-ingest is unavailable (503): {message}")]
    Unavailable {
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("agent-ingest asks to slow down (429): {message}")]
    TooManyRequests {
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("cannot reach agent-ingest: {0}")]
    Network(String),
    #[error("agent-ingest rejected the request ({status}): {message}")]
    Rejected { status: u16, message: String },
    #[error("cannot decode agent-ingest's answer: {0}")]
    Decode(String),
    #[error("invalid CTXSYNC_INGEST_URL {value:?}: {reason}")]
    Url { value: String, reason: String },
    #[error(transparent)]
    Tls(#[from] ctxsync_tls::TlsError),
}

impl PublishError {
    /// Worth sending again later (with the latest state).
    pub fn is_retryable(&self) -> bool {
        self.kind().is_retryable()
    }

    /// How the publication rules see this failure.
    pub fn kind(&self) -> FailureKind {
        match self {
            PublishError::Unauthorized { .. } => FailureKind::Unauthorized,
            PublishError::Unavailable { retry_after, .. }
            | PublishError::TooManyRequests { retry_after, .. } => FailureKind::Unavailable {
                retry_after: *retry_after,
            },
            PublishError::Network(_) => FailureKind::Network,
            PublishError::Rejected { status, .. } if *status >= 500 => FailureKind::ServerError,
            PublishError::Rejected { .. }
            | PublishError::Decode(_)
            | PublishError::Url { .. }
            | PublishError::Tls(_) => FailureKind::Rejected,
        }
    }

    fn to_failure(&self) -> Failure {
        Failure::new(self.kind(), self.to_string())
    }
}

/// How `ingest_ca_file` is named in messages.
pub const INGEST_CA_OPTION: &str = "CTXSYNC_INGEST_CA_FILE (--ingest-ca-file)";

/// One agent process's client of agent-ingest.
#[derive(Clone)]
pub struct Publisher {
    http: reqwest::Client,
    base: String,
    token: AgentToken,
    run_id: String,
    agent_version: String,
    backoff: Backoff,
    reannounce_interval: Duration,
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("base", &self.base)
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    pub fn new(config: &PublisherConfig, run_id: impl Into<String>) -> Result<Self, PublishError> {
        let base = config.ingest_url.trim().trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(PublishError::Url {
                value: config.ingest_url.clone(),
                reason: "expected an https:// or http:// URL".to_owned(),
            });
        }
        // rustls on ring, the system's roots plus the operator's CA (the
        // token travels in every request: https outside a trusted network).
        let ca = config
            .ingest_ca_file
            .as_ref()
            .map(|path| ctxsync_tls::PemFile::new(INGEST_CA_OPTION, path));
        let tls = ctxsync_tls::client_config(ca.as_ref(), None)?;
        let http = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|e| PublishError::Network(e.to_string()))?;
        Ok(Self {
            http,
            base,
            token: config.token.clone(),
            run_id: run_id.into(),
            agent_version: config.agent_version.clone(),
            backoff: config.backoff,
            reannounce_interval: config.reannounce_interval,
        })
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Announces this process's run; `reclaim` takes the agent back from a
    /// run that replaced it (see the module docs).
    pub async fn startup(&self, reclaim: bool) -> Result<StartupResponse, PublishError> {
        let request = StartupRequest {
            agent_run_id: self.run_id.clone(),
            agent_version: self.agent_version.clone(),
            reclaim,
        };
        self.call(STARTUP_PATH, &request).await
    }

    pub async fn push(
        &self,
        request: &PushContextStateRequest,
    ) -> Result<PushContextStateResponse, PublishError> {
        self.call(PUSH_PATH, request).await
    }

    async fn call<Req: Message, Resp: Message + Default>(
        &self,
        path: &str,
        request: &Req,
    ) -> Result<Resp, PublishError> {
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .header(reqwest::header::CONTENT_TYPE, PROTOBUF)
            .header(reqwest::header::ACCEPT, PROTOBUF)
            .bearer_auth(&self.token.0)
            .body(request.encode_to_vec())
            .send()
            .await
            .map_err(|e| PublishError::Network(error_chain(&e)))?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = response
            .bytes()
            .await
            .map_err(|e| PublishError::Network(error_chain(&e)))?;
        if status.is_success() {
            return Resp::decode(body.as_ref()).map_err(|e| PublishError::Decode(e.to_string()));
        }
        Err(refusal(status.as_u16(), retry_after, &body))
    }
}

/// The error of a non-2xx answer: which of them are retried, and after how
/// long, is `publisher_core`'s decision (see [`PublishError::kind`]).
fn refusal(status: u16, retry_after: Option<Duration>, body: &[u8]) -> PublishError {
    let message = error_message(body);
    match status {
        401 => PublishError::Unauthorized { message },
        503 => PublishError::Unavailable {
            message,
            retry_after,
        },
        429 => PublishError::TooManyRequests {
            message,
            retry_after,
        },
        code => PublishError::Rejected {
            status: code,
            message,
        },
    }
}

fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = source.and_then(|s| s.source());
    }
    text
}

/// The `message` of agent-ingest's JSON error body, else the body's start.
fn error_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Envelope {
        error: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        code: String,
        message: String,
    }
    match serde_json::from_slice::<Envelope>(body) {
        Ok(e) => format!("{}: {}", e.error.code, e.error.message),
        Err(_) => crate::text::clamp(&String::from_utf8_lossy(body), 512),
    }
}

/// What publication has achieved so far (for readiness, `inspect` and tests).
pub type PublishStatus = publisher_core::Status<Report>;

impl Publishable for Report {
    fn phase(&self) -> Phase {
        self.phase
    }

    fn resource_count(&self) -> usize {
        self.resources.len()
    }
}

/// The request in flight, as the event that will report its answer.
type Request<'a> = Pin<Box<dyn Future<Output = Event<Report>> + Send + 'a>>;

/// Publishes until `shutdown`: runs the publication [`Machine`] (see the
/// module docs). Discovery ending (its reports closed) stops it too.
pub async fn run(
    publisher: Publisher,
    mut reports: watch::Receiver<SharedReport>,
    status: watch::Sender<PublishStatus>,
    shutdown: CancellationToken,
) {
    let mut machine = Machine::new(publisher_core::Config {
        run_id: publisher.run_id.clone(),
        backoff: publisher.backoff,
        reannounce_interval: publisher.reannounce_interval,
        jitter_seed: None,
    });
    let first = reports.borrow_and_update().clone();
    let mut action = machine.handle(Event::Report(first), tokio::time::Instant::now());
    let mut request: Option<Request<'_>> = None;
    let mut wait_until = None;
    loop {
        if machine.take_status_change() {
            status.send_replace(machine.status().clone());
        }
        match action {
            Action::Stop => return,
            Action::Startup { reclaim } => {
                request = Some(Box::pin(startup(&publisher, reclaim)));
                wait_until = None;
            }
            Action::Push {
                version,
                initial,
                report,
            } => {
                let push = report.to_push(&publisher.run_id, version, initial);
                request = Some(Box::pin(push_state(&publisher, push)));
                wait_until = None;
            }
            Action::AwaitAnswer => {}
            Action::Wait { until } => wait_until = Some(until),
            Action::Idle => wait_until = None,
        }
        let event = tokio::select! {
            event = answer(request.as_mut()), if request.is_some() => {
                request = None;
                event
            }
            changed = reports.changed() => match changed {
                Ok(()) => Event::Report(reports.borrow_and_update().clone()),
                Err(_) => Event::Shutdown,
            },
            () = sleep_until(wait_until), if request.is_none() && wait_until.is_some() => Event::Timer,
            () = shutdown.cancelled() => Event::Shutdown,
        };
        action = machine.handle(event, tokio::time::Instant::now());
    }
}

async fn answer(request: Option<&mut Request<'_>>) -> Event<Report> {
    match request {
        Some(request) => request.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(until: Option<tokio::time::Instant>) {
    match until {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}

async fn startup(publisher: &Publisher, reclaim: bool) -> Event<Report> {
    let answer = publisher
        .startup(reclaim)
        .await
        .map(|reply| match reply.drop_reason() {
            StartupDropReason::Unspecified => StartupReply::Applied {
                run_id_changed: reply.run_id_changed,
                previous_run_id: reply.previous_agent_run_id,
            },
            reason => StartupReply::Dropped {
                reason,
                message: reply.message,
                current_run_id: reply.previous_agent_run_id,
            },
        });
    Event::StartupAnswered(answer.map_err(|e| e.to_failure()))
}

async fn push_state(publisher: &Publisher, request: PushContextStateRequest) -> Event<Report> {
    let answer = publisher.push(&request).await.map(|reply| {
        if reply.accepted {
            PushReply::Accepted
        } else {
            PushReply::Dropped {
                reason: PushDropReason::try_from(reply.drop_reason)
                    .unwrap_or(PushDropReason::Unspecified),
                message: reply.message,
            }
        }
    });
    Event::PushAnswered(answer.map_err(|e| e.to_failure()))
}

/// A `Report` built by hand is rarely needed outside tests; this keeps the
/// proto import in one place for callers that build pushes themselves.
pub fn phase_of(request: &PushContextStateRequest) -> Phase {
    request
        .mcp_discovery
        .as_ref()
        .and_then(|d| Phase::try_from(d.phase).ok())
        .unwrap_or(Phase::Unspecified)
}

/// Shared so the HTTP readiness check can look without holding the sender.
pub type StatusReceiver = watch::Receiver<PublishStatus>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_has_the_kind_the_publication_rules_act_on() {
        let body = br#"{"error":{"code":"unavailable","message":"store down"}}"#;
        let after = Some(Duration::from_secs(1));
        let cases = [
            (401, FailureKind::Unauthorized),
            (503, FailureKind::Unavailable { retry_after: after }),
            (429, FailureKind::Unavailable { retry_after: after }),
            (500, FailureKind::ServerError),
            (502, FailureKind::ServerError),
            (400, FailureKind::Rejected),
            (413, FailureKind::Rejected),
        ];
        for (status, kind) in cases {
            let error = refusal(status, after, body);
            assert_eq!(error.kind(), kind, "{status}");
            let text = error.to_string();
            assert!(text.contains(&status.to_string()), "{text}");
            assert!(text.contains("unavailable: store down"), "{text}");
        }
        assert_eq!(
            PublishError::Network("refused".into()).kind(),
            FailureKind::Network
        );
        assert!(!PublishError::Decode("bad".into()).is_retryable());
    }

    #[test]
    fn token_is_never_printed() {
        let token = AgentToken::new("tok_very_secret");
        assert!(!format!("{token:?}").contains("tok_very_secret"));
        let config = PublisherConfig::new("http://127.0.0.1:1", token);
        assert!(!format!("{config:?}").contains("tok_very_secret"));
        let publisher = Publisher::new(&config, "run").unwrap();
        assert!(!format!("{publisher:?}").contains("tok_very_secret"));
    }

    #[test]
    fn token_file_is_trimmed_and_an_empty_one_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("token");
        std::fs::write(&path, "  tok_abc\n").unwrap();
        assert_eq!(AgentToken::from_file(&path).unwrap().0, "tok_abc");
        std::fs::write(&path, "\n").unwrap();
        let error = AgentToken::from_file(&path).unwrap_err().to_string();
        assert!(error.contains("is empty") && error.contains("CTXSYNC_AGENT_TOKEN_FILE"));
        let error = AgentToken::from_file(&tmp.path().join("nope"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("not found"), "{error}");
    }

    #[test]
    fn only_http_and_https_urls_are_accepted() {
        ctxsync_tls::install_default_provider();
        for url in ["https://ingest", "http://ingest:8081/"] {
            let config = PublisherConfig::new(url, AgentToken::new("t"));
            Publisher::new(&config, "r").unwrap();
        }
        let config = PublisherConfig::new("ftp://ingest", AgentToken::new("t"));
        let error = Publisher::new(&config, "r").unwrap_err().to_string();
        assert!(error.contains("CTXSYNC_INGEST_URL"), "{error}");
    }

    #[test]
    fn a_missing_ingest_ca_file_names_the_option_and_the_path() {
        let mut config = PublisherConfig::new("https://ingest", AgentToken::new("t"));
        config.ingest_ca_file = Some("/nonexistent/ca.pem".into());
        let error = Publisher::new(&config, "r").unwrap_err().to_string();
        assert!(
            error.starts_with(
                "invalid CTXSYNC_INGEST_CA_FILE (--ingest-ca-file) \"/nonexistent/ca.pem\": cannot read it"
            ),
            "{error}"
        );
    }
}

/// The driver against a fake agent-ingest on loopback (no NATS, no store).
#[cfg(test)]
mod driver_tests {
    use std::sync::{Arc, Mutex};

    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;

    use super::*;

    fn report() -> SharedReport {
        Arc::new(Report {
            context_config: Default::default(),
            phase: Phase::Complete,
            resources: Vec::new(),
        })
    }

    fn publisher(addr: std::net::SocketAddr) -> Publisher {
        ctxsync_tls::install_default_provider();
        let mut config = PublisherConfig::new(format!("http://{addr}"), AgentToken::new("t"));
        config.request_timeout = Duration::from_secs(60);
        config.backoff = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_secs(2),
        };
        Publisher::new(&config, "run").unwrap()
    }

    /// A push answered 429 with `Retry-After: 1` is sent again no sooner
    /// than that (the backoff alone would wait about 10 ms).
    #[tokio::test]
    async fn a_429_is_retried_after_its_retry_after() {
        let pushes: Arc<Mutex<Vec<std::time::Instant>>> = Arc::default();
        let seen = Arc::clone(&pushes);
        let app = axum::Router::new()
            .route(
                STARTUP_PATH,
                axum::routing::post(|| async { StartupResponse::default().encode_to_vec() }),
            )
            .route(
                PUSH_PATH,
                axum::routing::post(move || {
                    let seen = Arc::clone(&seen);
                    async move {
                        let mut seen = seen.lock().unwrap();
                        seen.push(std::time::Instant::now());
                        if seen.len() == 1 {
                            return (
                                StatusCode::TOO_MANY_REQUESTS,
                                [(header::RETRY_AFTER, "1")],
                                r#"{"error":{"code":"rate_limited","message":"slow down"}}"#,
                            )
                                .into_response();
                        }
                        PushContextStateResponse {
                            accepted: true,
                            ..Default::default()
                        }
                        .encode_to_vec()
                        .into_response()
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });

        let (_reports, reports_rx) = watch::channel(report());
        let (status_tx, mut status) = watch::channel(PublishStatus::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            publisher(addr),
            reports_rx,
            status_tx,
            shutdown.clone(),
        ));
        let throttled = tokio::time::timeout(
            Duration::from_secs(10),
            status.wait_for(|s| s.last_error.as_deref().is_some_and(|e| e.contains("429"))),
        )
        .await
        .expect("the 429 is reported")
        .unwrap()
        .clone();
        assert!(throttled.started && throttled.accepted.is_none());
        let done = tokio::time::timeout(
            Duration::from_secs(10),
            status.wait_for(|s| s.accepted.is_some()),
        )
        .await
        .expect("the retry is accepted")
        .unwrap()
        .clone();
        assert_eq!(
            done.accepted,
            Some((2, Phase::Complete)),
            "the retry is version 2"
        );
        let pushes = pushes.lock().unwrap().clone();
        assert_eq!(pushes.len(), 2);
        assert!(
            pushes[1] - pushes[0] >= Duration::from_secs(1),
            "{pushes:?}"
        );
        shutdown.cancel();
        task.await.unwrap();
    }

    /// A request that hangs (the server never answers) does not hold up
    /// shutdown until the request timeout.
    #[tokio::test]
    async fn shutdown_ends_publication_while_a_request_hangs() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted_tx, accepted) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (connection, _) = listener.accept().await.unwrap();
            let _ = accepted_tx.send(());
            // Held open, never answered.
            std::future::pending::<()>().await;
            drop(connection);
        });
        let (_reports, reports_rx) = watch::channel(report());
        let (status_tx, _status) = watch::channel(PublishStatus::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            publisher(addr),
            reports_rx,
            status_tx,
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(10), accepted)
            .await
            .expect("the startup is sent")
            .unwrap();
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("publication stops with its startup in flight")
            .unwrap();
    }
}
