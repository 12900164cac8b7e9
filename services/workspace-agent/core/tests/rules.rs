//! One test per publication rule (see the crate docs), on paused tokio time:
//! the machine is fed events as the driver would, and a wait is slept on the
//! paused clock (at once) before its timer fires.

use std::sync::Arc;
use std::time::Duration;

use ctxsync_proto::v1::{PushDropReason, StartupDropReason, mcp_discovery::Phase};
use publisher_core::{
    Action, Backoff, Config, Event, Failure, FailureKind, Machine, Publishable, PushReply,
    RECLAIM_WINDOW, StartupReply,
};
use tokio::time::Instant;

#[derive(Debug, PartialEq)]
struct Report {
    name: &'static str,
    phase: Phase,
}

impl Publishable for Report {
    fn phase(&self) -> Phase {
        self.phase
    }

    fn resource_count(&self) -> usize {
        1
    }
}

fn report(name: &'static str) -> Arc<Report> {
    Arc::new(Report {
        name,
        phase: Phase::Complete,
    })
}

const MIN: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_secs(1);

fn config() -> Config {
    Config {
        run_id: "run-1".to_owned(),
        backoff: Backoff {
            initial: MIN,
            max: MAX,
        },
        reannounce_interval: Duration::ZERO,
        jitter_seed: Some(1),
    }
}

fn network() -> Failure {
    Failure::new(FailureKind::Network, "cannot reach agent-ingest: refused")
}

fn unavailable(retry_after: Option<Duration>) -> Failure {
    Failure::new(
        FailureKind::Unavailable { retry_after },
        "agent-ingest is unavailable (503): unavailable: store down",
    )
}

fn applied() -> Event<Report> {
    Event::StartupAnswered(Ok(StartupReply::Applied {
        run_id_changed: true,
        previous_run_id: String::new(),
    }))
}

fn superseded() -> Event<Report> {
    Event::StartupAnswered(Ok(StartupReply::Dropped {
        reason: StartupDropReason::SupersededRun,
        message: "superseded".to_owned(),
        current_run_id: "ghost".to_owned(),
    }))
}

fn accepted() -> Event<Report> {
    Event::PushAnswered(Ok(PushReply::Accepted))
}

fn dropped(reason: PushDropReason) -> Event<Report> {
    Event::PushAnswered(Ok(PushReply::Dropped {
        reason,
        message: "dropped".to_owned(),
    }))
}

/// A push as sent: (version, initial, report name).
type Sent = (u64, bool, &'static str);

/// The machine and its last action, driven as `publisher.rs` drives it.
struct Sim {
    machine: Machine<Report>,
    action: Action<Report>,
}

impl Sim {
    fn new(config: Config) -> Self {
        Self {
            machine: Machine::new(config),
            action: Action::Idle,
        }
    }

    /// Starts with `first` as discovery's first report; Startup is applied.
    fn started(config: Config, first: &'static str) -> Self {
        let mut sim = Self::new(config);
        sim.feed(Event::Report(report(first)));
        assert_eq!(sim.action, Action::Startup { reclaim: false });
        sim.feed(applied());
        sim
    }

    fn feed(&mut self, event: Event<Report>) -> &Action<Report> {
        self.action = self.machine.handle(event, Instant::now());
        &self.action
    }

    /// Sleeps (on the paused clock) until the wait asked for ends and fires
    /// its timer; returns how long that was.
    async fn wait(&mut self) -> Duration {
        let Action::Wait { until } = self.action else {
            panic!("expected a wait, got {:?}", self.action);
        };
        let from = Instant::now();
        tokio::time::sleep_until(until).await;
        self.feed(Event::Timer);
        Instant::now() - from
    }

    fn push(&self) -> Sent {
        match &self.action {
            Action::Push {
                version,
                initial,
                report,
            } => (*version, *initial, report.name),
            other => panic!("expected a push, got {other:?}"),
        }
    }

    fn startup(&self) -> bool {
        match self.action {
            Action::Startup { reclaim } => reclaim,
            ref other => panic!("expected a startup, got {other:?}"),
        }
    }
}

/// The floor and cap of the wait before retry `attempt` (1-based).
fn bounds(attempt: u32) -> (Duration, Duration) {
    let exp = MIN.saturating_mul(1 << (attempt - 1).min(20)).min(MAX);
    (exp / 2, exp)
}

#[tokio::test(start_paused = true)]
async fn startup_comes_before_any_push_and_is_retried_until_applied() {
    let mut sim = Sim::new(config());
    sim.feed(Event::Report(report("a")));
    assert!(!sim.startup(), "the first Startup is no reclaim");
    // A report while Startup is in flight waits for it.
    assert_eq!(sim.feed(Event::Report(report("b"))), &Action::AwaitAnswer);

    // Any failure is retried, a refusal too, and a startup dropped for a
    // reason this agent does not act on.
    let failures = [
        Err(network()),
        Err(Failure::new(FailureKind::Rejected, "rejected (400)")),
        Err(unavailable(None)),
    ];
    for failure in failures {
        sim.feed(Event::StartupAnswered(failure));
        assert!(sim.machine.status().last_error.is_some());
        sim.wait().await;
        assert!(!sim.startup());
    }
    assert!(!sim.machine.status().started);
    assert_eq!(sim.machine.status().attempts, 0, "no push before Startup");

    sim.feed(applied());
    assert!(sim.machine.status().started);
    assert_eq!(sim.machine.status().last_error, None);
    assert_eq!(
        sim.push(),
        (1, true, "b"),
        "the first push, of the latest report"
    );
}

#[tokio::test(start_paused = true)]
async fn reports_are_coalesced_and_a_retry_sends_only_the_latest() {
    let mut sim = Sim::started(config(), "a");
    assert_eq!(sim.push(), (1, true, "a"));
    // Two reports during the push, one during the backoff: none is queued.
    assert_eq!(sim.feed(Event::Report(report("b"))), &Action::AwaitAnswer);
    sim.feed(Event::Report(report("c")));
    sim.feed(Event::PushAnswered(Err(unavailable(None))));
    let Action::Wait { until } = sim.action else {
        panic!("{:?}", sim.action)
    };
    sim.feed(Event::Report(report("d")));
    assert_eq!(
        sim.action,
        Action::Wait { until },
        "a report does not cut a backoff short"
    );
    sim.wait().await;
    assert_eq!(sim.push(), (2, true, "d"));
    sim.feed(accepted());
    assert_eq!(sim.action, Action::Idle, "nothing newer: nothing sent");
    assert_eq!(sim.machine.status().attempts, 2);

    // A report that came during an accepted push is sent next.
    sim.feed(Event::Report(report("e")));
    assert_eq!(sim.push().2, "e");
    sim.feed(Event::Report(report("f")));
    sim.feed(accepted());
    assert_eq!(sim.push(), (4, false, "f"));
    sim.feed(accepted());
    assert_eq!(
        sim.machine.status().accepted_report.as_ref().unwrap().name,
        "f"
    );
}

#[tokio::test(start_paused = true)]
async fn versions_strictly_increase_across_retries_reclaims_and_reannouncements() {
    let mut sim = Sim::started(
        Config {
            reannounce_interval: Duration::from_secs(30),
            ..config()
        },
        "a",
    );
    let mut versions = vec![sim.push().0];
    // A retry of a push that may have committed.
    sim.feed(Event::PushAnswered(Err(network())));
    sim.wait().await;
    versions.push(sim.push().0);
    // A reclaim after STALE_RUN.
    sim.feed(dropped(PushDropReason::StaleRun));
    assert!(sim.startup());
    sim.feed(applied());
    versions.push(sim.push().0);
    sim.feed(accepted());
    // A re-announcement that finds the agent taken over.
    sim.wait().await;
    assert!(!sim.startup());
    sim.feed(superseded());
    sim.wait().await; // the second reclaim within a minute backs off
    assert!(sim.startup());
    sim.feed(applied());
    versions.push(sim.push().0);
    sim.feed(accepted());
    sim.feed(Event::Report(report("b")));
    versions.push(sim.push().0);
    assert_eq!(versions, [1, 2, 3, 4, 5]);
}

#[tokio::test(start_paused = true)]
async fn initial_is_set_until_a_push_has_been_answered() {
    let mut sim = Sim::started(config(), "a");
    assert_eq!(sim.push(), (1, true, "a"));
    sim.feed(Event::PushAnswered(Err(network())));
    sim.wait().await;
    assert_eq!(sim.push(), (2, true, "a"), "no answer yet: still initial");
    sim.feed(Event::PushAnswered(Err(Failure::new(
        FailureKind::Rejected,
        "rejected (400)",
    ))));
    sim.feed(Event::Report(report("b")));
    assert_eq!(sim.push(), (3, true, "b"), "a refusal is no answer");
    // A dropped push was answered: the store knows this run.
    sim.feed(dropped(PushDropReason::StaleVersion));
    sim.feed(Event::Report(report("c")));
    assert_eq!(sim.push(), (4, false, "c"));
    sim.feed(accepted());
    sim.feed(Event::Report(report("d")));
    assert_eq!(sim.push(), (5, false, "d"));
}

#[tokio::test(start_paused = true)]
async fn each_push_carries_its_reports_phase_pending_then_complete() {
    let mut sim = Sim::new(config());
    let pending = Arc::new(Report {
        name: "pending",
        phase: Phase::Pending,
    });
    sim.feed(Event::Report(Arc::clone(&pending)));
    sim.feed(applied());
    // A PENDING report goes out at once: a slow server holds nothing back.
    let Action::Push { report: sent, .. } = &sim.action else {
        panic!("{:?}", sim.action)
    };
    assert_eq!(sent.phase, Phase::Pending);
    sim.feed(accepted());
    assert_eq!(sim.machine.status().accepted, Some((1, Phase::Pending)));

    sim.feed(Event::Report(report("complete")));
    assert_eq!(sim.push(), (2, false, "complete"));
    sim.feed(accepted());
    let status = sim.machine.status();
    assert_eq!(status.accepted, Some((2, Phase::Complete)));
    assert_eq!(
        status.accepted_report.as_ref().unwrap().phase,
        Phase::Complete
    );
}

#[tokio::test(start_paused = true)]
async fn failures_back_off_exponentially_capped_with_jitter_and_honour_retry_after() {
    let waits_of = |seed| async move {
        let mut sim = Sim::started(
            Config {
                jitter_seed: Some(seed),
                ..config()
            },
            "a",
        );
        let mut waits = Vec::new();
        for _ in 0..8 {
            sim.feed(Event::PushAnswered(Err(network())));
            waits.push(sim.wait().await);
            sim.push();
        }
        (sim, waits)
    };
    let (mut sim, waits) = waits_of(1).await;
    for (attempt, wait) in (1..).zip(&waits) {
        let (floor, cap) = bounds(attempt);
        assert!(*wait >= floor && *wait <= cap, "retry {attempt}: {wait:?}");
    }
    assert!(waits[6] >= MAX / 2 && waits[7] <= MAX, "capped: {waits:?}");
    let (_, other) = waits_of(2).await;
    assert_ne!(waits, other, "jitter: another draw, other waits");

    // Retry-After is a floor, itself capped.
    sim.feed(Event::PushAnswered(Err(unavailable(Some(
        Duration::from_millis(700),
    )))));
    // Attempt 9 waits at least MAX / 2 anyway; a floor above it shows.
    let wait = sim.wait().await;
    assert!(
        wait >= Duration::from_millis(700) && wait <= MAX,
        "{wait:?}"
    );
    sim.feed(Event::PushAnswered(Err(unavailable(Some(
        Duration::from_secs(60),
    )))));
    assert!(sim.wait().await <= MAX, "Retry-After capped at the max");

    // An answer ends the run of failures: the next one starts low again.
    sim.feed(accepted());
    sim.feed(Event::Report(report("b")));
    sim.feed(Event::PushAnswered(Err(network())));
    let (floor, cap) = bounds(1);
    let wait = sim.wait().await;
    assert!(wait >= floor && wait <= cap, "{wait:?}");

    // Startup backs off the same way, with Retry-After as a floor.
    let mut sim = Sim::new(config());
    sim.feed(Event::Report(report("a")));
    sim.feed(Event::StartupAnswered(Err(unavailable(Some(
        Duration::from_millis(400),
    )))));
    let wait = sim.wait().await;
    assert!(
        wait >= Duration::from_millis(400) && wait <= MAX,
        "{wait:?}"
    );
    for attempt in 2..=4 {
        sim.feed(Event::StartupAnswered(Err(network())));
        let (floor, cap) = bounds(attempt);
        let wait = sim.wait().await;
        assert!(
            wait >= floor && wait <= cap,
            "startup retry {attempt}: {wait:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_unauthorized_agent_is_retried_and_never_started() {
    let unauthorized = || {
        Failure::new(
            FailureKind::Unauthorized,
            "agent-ingest refused the agent token (401): unauthenticated: unknown token",
        )
    };
    let mut sim = Sim::new(config());
    sim.feed(Event::Report(report("a")));
    for _ in 0..5 {
        sim.feed(Event::StartupAnswered(Err(unauthorized())));
        let status = sim.machine.status();
        assert!(!status.started);
        assert!(status.last_error.as_deref().unwrap().contains("401"));
        sim.wait().await;
        assert!(!sim.startup(), "retried");
    }
    // The token registered meanwhile; a 401 on a push is retried too.
    sim.feed(applied());
    assert_eq!(sim.push().0, 1);
    sim.feed(Event::PushAnswered(Err(unauthorized())));
    sim.feed(Event::Report(report("b")));
    sim.wait().await;
    assert_eq!(sim.push(), (2, true, "b"));
}

#[tokio::test(start_paused = true)]
async fn a_push_dropped_as_stale_run_reclaims_the_agent_and_republishes_the_current_report() {
    let mut sim = Sim::started(config(), "a");
    sim.feed(accepted());
    sim.feed(Event::Report(report("b")));
    assert_eq!(sim.push().2, "b");
    sim.feed(dropped(PushDropReason::StaleRun));
    assert!(sim.startup(), "a reclaim, at once (the first in a while)");
    assert!(
        sim.machine
            .status()
            .last_error
            .as_deref()
            .unwrap()
            .contains("PUSH_DROP_REASON_STALE_RUN")
    );
    sim.feed(applied());
    assert_eq!(sim.push(), (3, false, "b"), "the current report again");
    assert_eq!(sim.machine.status().reclaims, 1);

    // A second reclaim within a minute backs off first; a report that
    // came meanwhile, or during the reclaim, is the current one.
    sim.feed(dropped(PushDropReason::StaleRun));
    assert!(
        matches!(sim.action, Action::Wait { .. }),
        "{:?}",
        sim.action
    );
    sim.feed(Event::Report(report("c")));
    sim.wait().await;
    assert!(sim.startup());
    assert_eq!(sim.feed(Event::Report(report("d"))), &Action::AwaitAnswer);
    sim.feed(applied());
    assert_eq!(sim.push(), (4, false, "d"));
    assert_eq!(sim.machine.status().reclaims, 2);
}

#[tokio::test(start_paused = true)]
async fn a_startup_dropped_as_superseded_run_turns_into_a_reclaim() {
    let mut sim = Sim::new(config());
    sim.feed(Event::Report(report("a")));
    sim.feed(superseded());
    assert!(sim.startup(), "reclaim at once");
    // A reclaim is never dropped as superseded: a store that does is retried.
    sim.feed(superseded());
    assert!(
        sim.machine
            .status()
            .last_error
            .as_deref()
            .unwrap()
            .contains("STARTUP_DROP_REASON_SUPERSEDED_RUN")
    );
    sim.wait().await; // the backoff of the dropped startup
    sim.wait().await; // the second reclaim of the window
    assert!(sim.startup());
    sim.feed(applied());
    assert_eq!(sim.push(), (1, true, "a"));
    assert_eq!(sim.machine.status().reclaims, 1);
}

#[tokio::test(start_paused = true)]
async fn reclaims_within_a_minute_of_each_other_back_off() {
    let mut sim = Sim::started(config(), "a");
    let mut waits = Vec::new();
    for _ in 0..4 {
        sim.feed(dropped(PushDropReason::StaleRun));
        let wait = match sim.action {
            Action::Wait { .. } => sim.wait().await,
            _ => Duration::ZERO,
        };
        waits.push(wait);
        assert!(sim.startup());
        sim.feed(applied());
        sim.push();
    }
    assert_eq!(waits[0], Duration::ZERO, "the first reclaim goes at once");
    for (attempt, wait) in (1..).zip(&waits[1..]) {
        let (floor, cap) = bounds(attempt);
        assert!(
            *wait >= floor && *wait <= cap,
            "reclaim {attempt}: {wait:?}"
        );
    }
    // A minute later the episode is over.
    tokio::time::advance(RECLAIM_WINDOW).await;
    sim.feed(dropped(PushDropReason::StaleRun));
    assert!(sim.startup(), "no wait after a quiet minute");
}

#[tokio::test(start_paused = true)]
async fn an_idle_publisher_reannounces_every_interval() {
    let every = Duration::from_secs(30);
    let started = Instant::now();
    let mut sim = Sim::started(
        Config {
            reannounce_interval: every,
            ..config()
        },
        "a",
    );
    sim.feed(accepted());
    assert_eq!(
        sim.action,
        Action::Wait {
            until: started + every
        }
    );
    sim.wait().await;
    assert!(!sim.startup(), "a re-announcement is no reclaim");
    sim.feed(applied());
    assert_eq!(
        sim.action,
        Action::Wait {
            until: started + every * 2
        },
        "nothing changed: nothing pushed"
    );
    // A report during the wait goes out at once.
    tokio::time::advance(Duration::from_secs(10)).await;
    sim.feed(Event::Report(report("b")));
    assert_eq!(sim.push(), (2, false, "b"));
    sim.feed(accepted());
    sim.wait().await;
    assert!(
        Instant::now() >= started + every * 2,
        "every interval, not an interval after the last push"
    );
    // Taken over meanwhile: reclaimed, and the current report again.
    sim.feed(superseded());
    assert!(sim.startup());
    sim.feed(applied());
    assert_eq!(sim.push(), (3, false, "b"));
    assert_eq!(sim.machine.status().reclaims, 1);

    // Zero: never.
    let mut sim = Sim::started(config(), "a");
    sim.feed(accepted());
    assert_eq!(sim.action, Action::Idle);
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_whatever_is_awaited() {
    let mut sim = Sim::new(config());
    sim.feed(Event::Report(report("a")));
    assert_eq!(
        sim.feed(Event::Shutdown),
        &Action::Stop,
        "a startup in flight"
    );

    let mut sim = Sim::started(config(), "a");
    sim.feed(Event::PushAnswered(Err(network())));
    assert!(matches!(sim.action, Action::Wait { .. }));
    assert_eq!(sim.feed(Event::Shutdown), &Action::Stop, "a backoff");

    let mut sim = Sim::started(config(), "a");
    assert_eq!(sim.feed(Event::Shutdown), &Action::Stop, "a push in flight");
    assert_eq!(
        sim.feed(Event::Report(report("b"))),
        &Action::Stop,
        "for good"
    );

    let mut sim = Sim::started(config(), "a");
    sim.feed(accepted());
    assert_eq!(sim.feed(Event::Shutdown), &Action::Stop, "idle");
}

#[tokio::test(start_paused = true)]
async fn a_refused_or_dropped_push_waits_for_the_next_report() {
    let mut sim = Sim::started(config(), "a");
    sim.feed(Event::PushAnswered(Err(Failure::new(
        FailureKind::Rejected,
        "agent-ingest rejected the request (400): invalid: bad",
    ))));
    assert_eq!(
        sim.action,
        Action::Idle,
        "the same report would be refused again"
    );
    assert!(
        sim.machine
            .status()
            .last_error
            .as_deref()
            .unwrap()
            .contains("400")
    );
    sim.feed(Event::Report(report("b")));
    assert_eq!(sim.push(), (2, true, "b"));
    for reason in [
        PushDropReason::StaleVersion,
        PushDropReason::PhaseRegression,
    ] {
        sim.feed(dropped(reason));
        assert_eq!(sim.action, Action::Idle, "{reason:?}");
        sim.feed(Event::Report(report("c")));
        sim.push();
    }
    // Another 5xx is retried.
    sim.feed(Event::PushAnswered(Err(Failure::new(
        FailureKind::ServerError,
        "agent-ingest rejected the request (500): internal",
    ))));
    sim.wait().await;
    assert_eq!(sim.push().2, "c");
    sim.feed(accepted());
    assert_eq!(
        sim.machine.status().last_error,
        None,
        "cleared by an answer"
    );
}
