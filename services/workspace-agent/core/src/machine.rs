//! The publication state machine (the rules are in the crate docs).

use std::sync::Arc;
use std::time::Duration;

use ctxsync_proto::v1::{PushDropReason, StartupDropReason, mcp_discovery::Phase};
use tokio::time::Instant;

use crate::backoff::{Backoff, Delays};

/// What the machine needs to know of a report (the driver's type).
pub trait Publishable {
    fn phase(&self) -> Phase;
    /// For logs only.
    fn resource_count(&self) -> usize;
}

/// The default of [`Config::reannounce_interval`].
pub const DEFAULT_REANNOUNCE_INTERVAL: Duration = Duration::from_secs(30);

/// Reclaims within this window count as one episode: more than one means
/// something keeps taking the agent over (two processes sharing a token), so
/// they back off instead of fighting at full speed.
pub const RECLAIM_WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct Config {
    /// This process's run id (logs only: the driver puts it in requests).
    pub run_id: String,
    pub backoff: Backoff,
    /// How often an idle publisher sends Startup again; zero never.
    pub reannounce_interval: Duration,
    /// Fixes the jitter of every backoff (tests); `None` draws it at random.
    pub jitter_seed: Option<u64>,
}

impl Config {
    pub fn new(run_id: impl Into<String>) -> Self {
        Self {
            run_id: run_id.into(),
            backoff: Backoff::default(),
            reannounce_interval: DEFAULT_REANNOUNCE_INTERVAL,
            jitter_seed: None,
        }
    }
}

/// What happened, fed to [`Machine::handle`].
#[derive(Debug)]
pub enum Event<R> {
    /// Discovery's latest report (it replaces any report not yet sent).
    Report(Arc<R>),
    /// The answer to the [`Action::Startup`] asked for.
    StartupAnswered(Result<StartupReply, Failure>),
    /// The answer to the [`Action::Push`] asked for.
    PushAnswered(Result<PushReply, Failure>),
    /// The instant of an [`Action::Wait`] has come.
    Timer,
    Shutdown,
}

/// A Startup the store answered (2xx).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupReply {
    Applied {
        run_id_changed: bool,
        previous_run_id: String,
    },
    Dropped {
        reason: StartupDropReason,
        message: String,
        /// The run the store holds instead.
        current_run_id: String,
    },
}

/// A push the store answered (2xx).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushReply {
    Accepted,
    Dropped {
        reason: PushDropReason,
        message: String,
    },
}

/// A request that got no 2xx answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    /// Shown in logs and [`Status::last_error`] (never holds the token).
    pub error: String,
}

impl Failure {
    pub fn new(kind: FailureKind, error: impl Into<String>) -> Self {
        Self {
            kind,
            error: error.into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// 401: the token may be registered later.
    Unauthorized,
    /// 429 or 503; `Retry-After` when the server gave one.
    Unavailable { retry_after: Option<Duration> },
    /// No answer (connect, timeout, a cut body).
    Network,
    /// Another 5xx.
    ServerError,
    /// Any other refusal (4xx, an undecodable answer): sending the same
    /// report again would be refused again.
    Rejected,
}

impl FailureKind {
    /// Worth sending again later (with the latest report).
    pub fn is_retryable(self) -> bool {
        !matches!(self, FailureKind::Rejected)
    }

    pub fn retry_after(self) -> Option<Duration> {
        match self {
            FailureKind::Unavailable { retry_after } => retry_after,
            _ => None,
        }
    }
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<R> {
    /// Send Startup; answer with [`Event::StartupAnswered`].
    Startup {
        reclaim: bool,
    },
    /// Send this push; answer with [`Event::PushAnswered`].
    Push {
        version: u64,
        initial: bool,
        report: Arc<R>,
    },
    /// Keep awaiting the answer already asked for.
    AwaitAnswer,
    /// Send nothing before `until`, then [`Event::Timer`]; reports may come
    /// meanwhile.
    Wait {
        until: Instant,
    },
    /// Nothing to send until a new report.
    Idle,
    Stop,
}

/// What publication has achieved so far (for readiness, `inspect` and tests).
#[derive(Debug, Clone, PartialEq)]
pub struct Status<R> {
    /// Startup was answered.
    pub started: bool,
    /// The version and phase of the last push the store accepted.
    pub accepted: Option<(u64, Phase)>,
    /// The report of the last accepted push.
    pub accepted_report: Option<Arc<R>>,
    /// Pushes sent (answered or not).
    pub attempts: u64,
    /// Times this process took its agent back from a run that replaced it.
    pub reclaims: u64,
    /// The last failure, cleared by the next answer.
    pub last_error: Option<String>,
}

impl<R> Default for Status<R> {
    fn default() -> Self {
        Self {
            started: false,
            accepted: None,
            accepted_report: None,
            attempts: 0,
            reclaims: 0,
            last_error: None,
        }
    }
}

/// A Startup that is due until the store applies it.
#[derive(Debug)]
struct Announce {
    reclaim: bool,
    /// The reclaim episode was counted for the next send.
    paced: bool,
    failures: u32,
    delays: Delays,
}

#[derive(Debug)]
enum InFlight<R> {
    Startup {
        reclaim: bool,
    },
    Push {
        version: u64,
        report: Arc<R>,
        /// Which report (by arrival) it is.
        seq: u64,
    },
}

/// The publisher's state; see the crate docs.
#[derive(Debug)]
pub struct Machine<R> {
    config: Config,
    status: Status<R>,
    status_changed: bool,
    announce: Option<Announce>,
    started_once: bool,
    in_flight: Option<InFlight<R>>,
    /// A backoff: nothing is sent before it.
    hold_until: Option<Instant>,
    latest: Option<Arc<R>>,
    /// Reports received so far.
    latest_seq: u64,
    /// The latest report has not been sent (or must be sent again).
    unsent: bool,
    version: u64,
    initial: bool,
    push_failures: u32,
    push_delays: Delays,
    reclaims: Vec<Instant>,
    next_reannounce: Option<Instant>,
    stopped: bool,
}

impl<R: Publishable> Machine<R> {
    pub fn new(config: Config) -> Self {
        let announce = Announce::new(false, &config);
        let push_delays = config.backoff.delays(config.jitter_seed);
        Self {
            config,
            status: Status::default(),
            status_changed: false,
            announce: Some(announce),
            started_once: false,
            in_flight: None,
            hold_until: None,
            latest: None,
            latest_seq: 0,
            unsent: false,
            version: 0,
            initial: true,
            push_failures: 0,
            push_delays,
            reclaims: Vec::new(),
            next_reannounce: None,
            stopped: false,
        }
    }

    pub fn status(&self) -> &Status<R> {
        &self.status
    }

    /// Whether [`Machine::status`] changed since the last call.
    pub fn take_status_change(&mut self) -> bool {
        std::mem::take(&mut self.status_changed)
    }

    /// Takes in what happened at `now` and says what to do next.
    pub fn handle(&mut self, event: Event<R>, now: Instant) -> Action<R> {
        match event {
            Event::Report(report) => {
                self.latest = Some(report);
                self.latest_seq += 1;
                self.unsent = true;
            }
            Event::StartupAnswered(answer) => match self.in_flight.take() {
                Some(InFlight::Startup { reclaim }) => self.startup_answered(reclaim, answer, now),
                other => self.unexpected_answer(other, "startup"),
            },
            Event::PushAnswered(answer) => match self.in_flight.take() {
                Some(InFlight::Push {
                    version,
                    report,
                    seq,
                }) => self.push_answered(version, report, seq, answer, now),
                other => self.unexpected_answer(other, "push"),
            },
            Event::Timer => {}
            Event::Shutdown => self.stopped = true,
        }
        self.next(now)
    }

    fn unexpected_answer(&mut self, in_flight: Option<InFlight<R>>, what: &str) {
        tracing::debug!(what, "an answer to no request of its kind is ignored");
        self.in_flight = in_flight;
    }

    fn next(&mut self, now: Instant) -> Action<R> {
        if self.stopped {
            self.in_flight = None;
            return Action::Stop;
        }
        if self.in_flight.is_some() {
            return Action::AwaitAnswer;
        }
        if let Some(until) = self.hold_until {
            if now < until {
                return Action::Wait { until };
            }
            self.hold_until = None;
        }
        if let Some(announce) = &mut self.announce {
            if announce.reclaim && !announce.paced {
                announce.paced = true;
                self.reclaims
                    .retain(|at| now.duration_since(*at) < RECLAIM_WINDOW);
                self.reclaims.push(now);
                if self.reclaims.len() > 1 {
                    let delay = self.config.backoff.delay_seeded(
                        self.reclaims.len() as u32 - 1,
                        None,
                        self.config.jitter_seed,
                    );
                    tracing::error!(
                        agent_run_id = %self.config.run_id,
                        reclaims = self.reclaims.len(),
                        delay_ms = delay.as_millis() as u64,
                        "this agent keeps being taken over by another run: is a second agent process using the same token?"
                    );
                    let until = now + delay;
                    self.hold_until = Some(until);
                    if now < until {
                        return Action::Wait { until };
                    }
                }
            }
            let reclaim = announce.reclaim;
            self.in_flight = Some(InFlight::Startup { reclaim });
            return Action::Startup { reclaim };
        }
        if self.unsent
            && let Some(report) = &self.latest
        {
            let report = Arc::clone(report);
            self.version += 1;
            self.in_flight = Some(InFlight::Push {
                version: self.version,
                report: Arc::clone(&report),
                seq: self.latest_seq,
            });
            self.update_status(|s| s.attempts += 1);
            return Action::Push {
                version: self.version,
                initial: self.initial,
                report,
            };
        }
        match self.next_reannounce {
            Some(at) if now >= at => {
                self.next_reannounce = Some(now + self.config.reannounce_interval);
                self.announce = Some(Announce::new(false, &self.config));
                self.next(now)
            }
            Some(until) => Action::Wait { until },
            None => Action::Idle,
        }
    }

    fn startup_answered(
        &mut self,
        reclaim: bool,
        answer: Result<StartupReply, Failure>,
        now: Instant,
    ) {
        let run_id = self.config.run_id.clone();
        let Some(announce) = self.announce.as_mut() else {
            return;
        };
        announce.paced = false;
        match answer {
            Ok(StartupReply::Dropped {
                reason: StartupDropReason::SupersededRun,
                message,
                current_run_id,
            }) if !reclaim => {
                tracing::warn!(
                    agent_run_id = %run_id,
                    current_agent_run_id = %current_run_id,
                    %message,
                    "the store says another run replaced this one while it is running: reclaiming the agent"
                );
                announce.reclaim = true;
            }
            Ok(StartupReply::Dropped {
                reason, message, ..
            }) => {
                // A reclaim is never dropped as superseded; anything else is
                // a store this agent does not understand: keep trying.
                announce.failures += 1;
                let attempt = announce.failures;
                let error = format!("startup dropped ({}): {message}", reason.as_str_name());
                tracing::warn!(agent_run_id = %run_id, %error, attempt, "startup dropped; retrying");
                self.hold_until = Some(now + announce.delays.next_delay(None));
                self.update_status(|s| s.last_error = Some(error));
            }
            Ok(StartupReply::Applied {
                run_id_changed,
                previous_run_id,
            }) => {
                if reclaim {
                    metrics::counter!("ctxsync_agent_reclaims_total").increment(1);
                    tracing::warn!(
                        agent_run_id = %run_id,
                        previous_agent_run_id = %previous_run_id,
                        "agent reclaimed: republishing the current report"
                    );
                    // What the store holds may be the other run's.
                    self.unsent = true;
                } else if run_id_changed {
                    tracing::info!(
                        agent_run_id = %run_id,
                        previous_agent_run_id = %previous_run_id,
                        "startup reported"
                    );
                }
                self.announce = None;
                if !self.started_once {
                    self.started_once = true;
                    let every = self.config.reannounce_interval;
                    self.next_reannounce = (!every.is_zero()).then(|| now + every);
                }
                self.update_status(|s| {
                    s.started = true;
                    s.reclaims += u64::from(reclaim);
                    s.last_error = None;
                });
            }
            Err(failure) => {
                announce.failures += 1;
                log_failure("startup", &failure, announce.failures);
                let delay = announce.delays.next_delay(failure.kind.retry_after());
                self.hold_until = Some(now + delay);
                self.update_status(|s| s.last_error = Some(failure.error));
            }
        }
    }

    fn push_answered(
        &mut self,
        version: u64,
        report: Arc<R>,
        seq: u64,
        answer: Result<PushReply, Failure>,
        now: Instant,
    ) {
        let run_id = self.config.run_id.clone();
        // Only a newer report is left to send, unless said otherwise below.
        let newer = self.latest_seq != seq;
        match answer {
            Ok(reply) => {
                self.reset_push_failures();
                self.initial = false;
                self.unsent = newer;
                match reply {
                    PushReply::Accepted => {
                        metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "accepted")
                            .increment(1);
                        tracing::info!(
                            agent_run_id = %run_id,
                            version,
                            phase = report.phase().as_str_name(),
                            resources = report.resource_count(),
                            "context state published"
                        );
                        let phase = report.phase();
                        self.update_status(|s| {
                            s.accepted = Some((version, phase));
                            s.accepted_report = Some(report);
                            s.last_error = None;
                        });
                    }
                    PushReply::Dropped { reason, message } => {
                        metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "dropped")
                            .increment(1);
                        if reason == PushDropReason::StaleRun {
                            // This process is running, so the run that replaced it
                            // can only be a late message of one that is gone.
                            tracing::warn!(
                                agent_run_id = %run_id,
                                version,
                                %message,
                                "the store dropped the push as from a previous run: reclaiming the agent"
                            );
                            self.announce = Some(Announce::new(true, &self.config));
                            self.unsent = true;
                        } else {
                            tracing::error!(
                                agent_run_id = %run_id,
                                version,
                                drop_reason = reason.as_str_name(),
                                %message,
                                "the store dropped the push"
                            );
                        }
                        let error = format!("push dropped ({}): {message}", reason.as_str_name());
                        self.update_status(|s| s.last_error = Some(error));
                    }
                }
            }
            Err(failure) if failure.kind.is_retryable() => {
                metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "retry").increment(1);
                self.push_failures += 1;
                log_failure("push", &failure, self.push_failures);
                self.unsent = true;
                let delay = self.push_delays.next_delay(failure.kind.retry_after());
                self.hold_until = Some(now + delay);
                self.update_status(|s| s.last_error = Some(failure.error));
            }
            Err(failure) => {
                metrics::counter!("ctxsync_agent_pushes_total", "outcome" => "rejected")
                    .increment(1);
                // The same report would be rejected again: wait for the next change.
                tracing::error!(agent_run_id = %run_id, version, error = %failure.error, "push rejected");
                self.unsent = newer;
                self.reset_push_failures();
                self.update_status(|s| s.last_error = Some(failure.error));
            }
        }
    }

    fn reset_push_failures(&mut self) {
        if self.push_failures > 0 {
            self.push_failures = 0;
            self.push_delays = self.config.backoff.delays(self.config.jitter_seed);
        }
    }

    fn update_status(&mut self, change: impl FnOnce(&mut Status<R>)) {
        change(&mut self.status);
        self.status_changed = true;
    }
}

impl Announce {
    fn new(reclaim: bool, config: &Config) -> Self {
        Self {
            reclaim,
            paced: false,
            failures: 0,
            delays: config.backoff.delays(config.jitter_seed),
        }
    }
}

fn log_failure(what: &str, failure: &Failure, attempt: u32) {
    let error = &failure.error;
    match failure.kind {
        FailureKind::Unauthorized => tracing::error!(
            %error, attempt,
            "{what} failed: agent-ingest does not accept this agent token (check CTXSYNC_AGENT_TOKEN_FILE); retrying"
        ),
        _ => tracing::warn!(%error, attempt, "{what} failed; retrying with the latest state"),
    }
}
