//! Publication to agent-ingest: Startup first, then one push per change.
//!
//! [`Publisher`] is one HTTP call each (protobuf both ways); [`run`] is the
//! loop: Startup until it succeeds, then the latest report each time it
//! changes. On 503, a network error or a 401 it retries with capped exponential
//! backoff and jitter, and every retry sends the *latest* report (reports are
//! coalesced, never queued). Every request carries a higher version than the
//! one before, so a retry of a push that did commit is not a stale version.
//! `initial` is set until a push has been answered.
//!
//! The agent heals itself: when the store says its run was replaced (a push
//! dropped as `STALE_RUN`, or a startup dropped as `SUPERSEDED_RUN`) while
//! this process is running, the replacement can only be a late message of a
//! process that is gone, so it reclaims the agent (Startup with `reclaim`)
//! and republishes its current report. It also re-announces itself every
//! `reannounce_interval`, so a takeover is noticed even when nothing changes.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use ctxsync_proto::v1::{
    PushContextStateRequest, PushContextStateResponse, PushDropReason, StartupDropReason,
    StartupRequest, StartupResponse, mcp_discovery::Phase,
};
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::report::SharedReport;

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

/// Capped exponential backoff with jitter.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(10),
        }
    }
}

impl Backoff {
    /// The wait before retry number `attempt` (1-based): a random point in the
    /// upper half of `initial * 2^(attempt-1)`, capped at `max`; never below a
    /// server's `Retry-After` (itself capped at `max`).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exp = self
            .initial
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
            .min(self.max);
        let half = exp / 2;
        let jitter = half.mul_f64(rand::random::<f64>());
        let delay = half + jitter;
        match retry_after {
            Some(after) => delay.max(after.min(self.max)),
            None => delay,
        }
    }
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
        match self {
            PublishError::Unavailable { .. }
            | PublishError::Network(_)
            | PublishError::Unauthorized { .. } => true,
            PublishError::Rejected { status, .. } => *status >= 500,
            PublishError::Decode(_) | PublishError::Url { .. } | PublishError::Tls(_) => false,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            PublishError::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
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
        let message = error_message(&body);
        Err(match status.as_u16() {
            401 => PublishError::Unauthorized { message },
            503 => PublishError::Unavailable {
                message,
                retry_after,
            },
            code => PublishError::Rejected {
                status: code,
                message,
            },
        })
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
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublishStatus {
    /// Startup was answered.
    pub started: bool,
    /// The version and phase of the last push the store accepted.
    pub accepted: Option<(u64, Phase)>,
    /// The report of the last accepted push.
    pub accepted_report: Option<SharedReport>,
    /// Pushes sent (answered or not).
    pub attempts: u64,
    /// Times this process took its agent back from a run that replaced it.
    pub reclaims: u64,
    /// The last failure, cleared by the next answer.
    pub last_error: Option<String>,
}

/// Reclaims within this window count as one episode: more than one means
/// something keeps taking the agent over (two processes sharing a token), so
/// they back off instead of fighting at full speed.
const RECLAIM_WINDOW: Duration = Duration::from_secs(60);

/// Startup until the store applies it; false when shutdown came first.
/// A startup dropped as superseded turns into a reclaim.
async fn announce(
    publisher: &Publisher,
    mut reclaim: bool,
    reclaims: &mut Vec<tokio::time::Instant>,
    status: &watch::Sender<PublishStatus>,
    shutdown: &CancellationToken,
) -> bool {
    let run_id = &publisher.run_id;
    let mut attempt: u32 = 0;
    loop {
        if reclaim {
            let now = tokio::time::Instant::now();
            reclaims.retain(|at| now.duration_since(*at) < RECLAIM_WINDOW);
            reclaims.push(now);
            if reclaims.len() > 1 {
                let delay = publisher.backoff.delay(reclaims.len() as u32 - 1, None);
                tracing::error!(
                    agent_run_id = %run_id,
                    reclaims = reclaims.len(),
                    delay_ms = delay.as_millis() as u64,
                    "this agent keeps being taken over by another run: is a second agent process using the same token?"
                );
                if sleep_or_shutdown(delay, shutdown).await {
                    return false;
                }
            }
        }
        match publisher.startup(reclaim).await {
            Ok(answer) if answer.drop_reason() == StartupDropReason::SupersededRun && !reclaim => {
                tracing::warn!(
                    agent_run_id = %run_id,
                    current_agent_run_id = %answer.previous_agent_run_id,
                    message = %answer.message,
                    "the store says another run replaced this one while it is running: reclaiming the agent"
                );
                reclaim = true;
            }
            Ok(answer) if answer.drop_reason() != StartupDropReason::Unspecified => {
                // A reclaim is never dropped as superseded; anything else is
                // a store this agent does not understand: keep trying.
                attempt += 1;
                let error = format!(
                    "startup dropped ({}): {}",
                    answer.drop_reason().as_str_name(),
                    answer.message
                );
                tracing::warn!(agent_run_id = %run_id, %error, attempt, "startup dropped; retrying");
                status.send_modify(|s| s.last_error = Some(error));
                if sleep_or_shutdown(publisher.backoff.delay(attempt, None), shutdown).await {
                    return false;
                }
            }
            Ok(answer) => {
                if reclaim {
                    metrics::counter!("ctxsync_agent_reclaims_total").increment(1);
                    tracing::warn!(
                        agent_run_id = %run_id,
                        previous_agent_run_id = %answer.previous_agent_run_id,
                        "agent reclaimed: republishing the current report"
                    );
                } else if answer.run_id_changed {
                    tracing::info!(
                        agent_run_id = %run_id,
                        previous_agent_run_id = %answer.previous_agent_run_id,
                        "startup reported"
                    );
                }
                status.send_modify(|s| {
                    s.started = true;
                    s.reclaims += u64::from(reclaim);
                    s.last_error = None;
                });
                return true;
            }
            Err(error) => {
                attempt += 1;
                log_failure("startup", &error, attempt);
                status.send_modify(|s| s.last_error = Some(error.to_string()));
                let delay = publisher.backoff.delay(attempt, error.retry_after());
                if sleep_or_shutdown(delay, shutdown).await {
                    return false;
                }
            }
        }
    }
}

/// What woke the publication loop.
enum Wake {
    Report,
    Reannounce,
}

/// Publishes until `shutdown`: Startup, then each new report (see module docs).
pub async fn run(
    publisher: Publisher,
    mut reports: watch::Receiver<SharedReport>,
    status: watch::Sender<PublishStatus>,
    shutdown: CancellationToken,
) {
    let run_id = publisher.run_id.clone();
    let mut reclaims = Vec::new();
    if !announce(&publisher, false, &mut reclaims, &status, &shutdown).await {
        return;
    }

    let mut version: u64 = 0;
    let mut initial = true;
    let mut attempt: u32 = 0;
    // The current report has not been published yet.
    let mut unsent = true;
    let reannounce_every = publisher.reannounce_interval;
    let mut next_reannounce = tokio::time::Instant::now() + reannounce_every;
    loop {
        if !unsent {
            let wake = tokio::select! {
                changed = reports.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    Wake::Report
                }
                () = tokio::time::sleep_until(next_reannounce), if !reannounce_every.is_zero() => Wake::Reannounce,
                () = shutdown.cancelled() => return,
            };
            if let Wake::Reannounce = wake {
                next_reannounce = tokio::time::Instant::now() + reannounce_every;
                let before = status.borrow().reclaims;
                if !announce(&publisher, false, &mut reclaims, &status, &shutdown).await {
                    return;
                }
                // Taken back from another run: what the store holds may be
                // that run's, so the current report goes out again.
                unsent = status.borrow().reclaims > before;
                continue;
            }
        }
        let report: SharedReport = reports.borrow_and_update().clone();
        version += 1;
        let request = report.to_push(&run_id, version, initial);
        status.send_modify(|s| s.attempts += 1);
        let outcome = tokio::select! {
            outcome = publisher.push(&request) => outcome,
            () = shutdown.cancelled() => return,
        };
        match outcome {
            Ok(answer) => {
                attempt = 0;
                unsent = false;
                initial = false;
                if answer.accepted {
                    metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "accepted")
                        .increment(1);
                    tracing::info!(
                        agent_run_id = %run_id,
                        version,
                        phase = report.phase.as_str_name(),
                        resources = report.resources.len(),
                        "context state published"
                    );
                    status.send_modify(|s| {
                        s.accepted = Some((version, report.phase));
                        s.accepted_report = Some(report.clone());
                        s.last_error = None;
                    });
                    continue;
                }
                metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "dropped")
                    .increment(1);
                let reason = PushDropReason::try_from(answer.drop_reason)
                    .unwrap_or(PushDropReason::Unspecified);
                status.send_modify(|s| {
                    s.last_error = Some(format!(
                        "push dropped ({}): {}",
                        reason.as_str_name(),
                        answer.message
                    ));
                });
                if reason == PushDropReason::StaleRun {
                    // This process is running, so the run that replaced it
                    // can only be a late message of one that is gone.
                    tracing::warn!(
                        agent_run_id = %run_id,
                        version,
                        message = %answer.message,
                        "the store dropped the push as from a previous run: reclaiming the agent"
                    );
                    if !announce(&publisher, true, &mut reclaims, &status, &shutdown).await {
                        return;
                    }
                    unsent = true;
                } else {
                    tracing::error!(
                        agent_run_id = %run_id,
                        version,
                        drop_reason = reason.as_str_name(),
                        message = %answer.message,
                        "the store dropped the push"
                    );
                }
            }
            Err(error) if error.is_retryable() => {
                metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "retry").increment(1);
                attempt += 1;
                log_failure("push", &error, attempt);
                status.send_modify(|s| s.last_error = Some(error.to_string()));
                unsent = true;
                let delay = publisher.backoff.delay(attempt, error.retry_after());
                if sleep_or_shutdown(delay, &shutdown).await {
                    return;
                }
            }
            Err(error) => {
                metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "rejected")
                    .increment(1);
                // The same report would be rejected again: wait for the next change.
                tracing::error!(agent_run_id = %run_id, version, %error, "push rejected");
                status.send_modify(|s| s.last_error = Some(error.to_string()));
                unsent = false;
                attempt = 0;
            }
        }
    }
}

fn log_failure(what: &str, error: &PublishError, attempt: u32) {
    match error {
        PublishError::Unauthorized { .. } => tracing::error!(
            %error, attempt,
            "{what} failed: agent-ingest does not accept this agent token (check CTXSYNC_AGENT_TOKEN_FILE); retrying"
        ),
        _ => tracing::warn!(%error, attempt, "{what} failed; retrying with the latest state"),
    }
}

/// Sleeps `delay`; true when shutdown came first.
async fn sleep_or_shutdown(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => false,
        () = shutdown.cancelled() => true,
    }
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
    fn backoff_grows_is_capped_and_jittered() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        for attempt in 1..=30 {
            let d = b.delay(attempt, None);
            let exp = Duration::from_millis(100)
                .saturating_mul(1 << (attempt - 1).min(20))
                .min(Duration::from_secs(1));
            assert!(d >= exp / 2 && d <= exp, "attempt {attempt}: {d:?}");
        }
        let samples: std::collections::BTreeSet<Duration> =
            (0..20).map(|_| b.delay(5, None)).collect();
        assert!(samples.len() > 1, "jitter varies the delay");
        assert!(b.delay(1, Some(Duration::from_millis(700))) >= Duration::from_millis(700));
        assert!(b.delay(1, Some(Duration::from_secs(60))) <= Duration::from_secs(1));
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
