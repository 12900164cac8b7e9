//! The oracle: decides from a history alone whether every first turn could
//! have been answered so by a correct system, and whether every acked
//! report was kept.
//!
//! The promise it checks, with the bounds it allows ([`Bounds`]):
//! * a `ready` answer shows the tools of a report of the run it names, and
//!   that run was current at some moment of the request: no run whose
//!   successor's Startup was acked more than the view lag before the
//!   request began;
//! * never a version older than one of the same run whose ack completed
//!   more than the view lag before the request began;
//! * `ready` only on a complete report; the tools exactly the report's;
//! * a wait ends within the wake bound once discovery is complete on the
//!   current run (from the later of the request and the completing ack);
//!   a `pending` answer (the deadline passed) is an anomaly when a
//!   completing report of a run that stayed current was acked more than
//!   the wake bound before it; a late Startup of another run may take the
//!   agent over until the live process reclaims it (within the reclaim
//!   bound of that Startup's last possible landing);
//! * a later turn is answered at once (`not_first_turn`, no wait), and a
//!   first turn never as a later one;
//! * every acked report is kept: the store's final state of each agent is
//!   its last acked run, at a version no lower than any acked push of it.
//!
//! A fault stretches a bound: when one is active during the interval a
//! bound covers, the bound ends no earlier than the fault's healing plus
//! the recovery allowance; a skewed clock stretches none. An answer that says the store could not be read
//! is not held to the promise (it says so). An operation whose outcome is
//! unknown (`info`) may have taken effect at any time after its invocation.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::history::{Answer, Body, Decision, Event, Kind};

/// The fault that stretches no bound.
pub const UNEXCUSED_FAULT: &str = "clock_skew";

/// How far the oracle lets the system lag.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// An acked report reaches every gate's view within this.
    pub view_lag: Duration,
    /// A waiting first turn is answered within this of discovery completing.
    pub wake: Duration,
    /// After a fault heals, the system is back within this.
    pub fault_recovery: Duration,
    /// A request takes effect within this of its invocation, or never
    /// (agent-ingest's store timeout: the store drops one taken late).
    pub request_budget: Duration,
    /// A live agent process takes its agent back within this of a late
    /// Startup of another run landing (the harness's processes report at
    /// most 1.5 s apart, and reclaim on the first drop).
    pub reclaim: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            view_lag: Duration::from_secs(1),
            wake: Duration::from_secs(1),
            fault_recovery: Duration::from_secs(10),
            request_budget: Duration::from_secs(5),
            reclaim: Duration::from_secs(3),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AnomalyKind {
    /// `ready` with the tools of a run superseded before the request began.
    SupersededRun,
    /// `ready` with a run or version no agent reported (or the store refused).
    UnknownReport,
    /// `ready` with tools other than the report's.
    WrongTools,
    /// `ready` with a version older than one acked before the request began.
    OldVersion,
    /// `ready` on a report whose discovery was still pending.
    ReadyWhilePending,
    /// A wait that went on past the wake bound after discovery completed.
    SlowWake,
    /// `pending` although discovery had completed on a current run.
    PendingAfterComplete,
    /// An acked report the store does not hold at the end.
    LostAck,
    /// A later turn that waited, or was answered as a first turn.
    HeldFollowUp,
    /// A first turn answered as a later one.
    FirstTurnAsLater,
}

/// One thing no correct system would have done, with the operations
/// involved and the agent's history around them.
#[derive(Debug, Clone)]
pub struct Anomaly {
    pub kind: AnomalyKind,
    pub ops: Vec<u64>,
    pub message: String,
    pub context: Vec<Event>,
}

/// What the oracle found.
#[derive(Debug, Default)]
pub struct Verdict {
    pub operations: usize,
    pub turns_checked: usize,
    pub reports_acked: usize,
    pub faults: BTreeMap<String, usize>,
    pub anomalies: Vec<Anomaly>,
}

impl Verdict {
    pub fn acked_lost(&self) -> usize {
        self.anomalies
            .iter()
            .filter(|a| a.kind == AnomalyKind::LostAck)
            .count()
    }

    pub fn of_kind(&self, kind: AnomalyKind) -> usize {
        self.anomalies.iter().filter(|a| a.kind == kind).count()
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "operations={} turns_checked={} reports_acked={} faults={:?} anomalies={} acked_lost={}",
            self.operations,
            self.turns_checked,
            self.reports_acked,
            self.faults,
            self.anomalies.len(),
            self.acked_lost()
        )?;
        for anomaly in &self.anomalies {
            write!(
                f,
                "\n{:?} (ops {:?}): {}",
                anomaly.kind, anomaly.ops, anomaly.message
            )?;
            for event in &anomaly.context {
                write!(f, "\n    {}", crate::history::line(event))?;
            }
        }
        Ok(())
    }
}

/// An operation: its invocation and, when it came, its completion.
#[derive(Debug)]
struct Op<'h> {
    id: u64,
    at: u64,
    body: &'h Body,
    done: Option<(Kind, u64, &'h Body)>,
}

impl Op<'_> {
    fn kind(&self) -> Option<Kind> {
        self.done.map(|(kind, _, _)| kind)
    }

    fn acked_at(&self) -> Option<u64> {
        match self.done {
            Some((Kind::Ok, at, _)) => Some(at),
            _ => None,
        }
    }

    /// It may have taken effect: acked, or its outcome unknown.
    fn may_have_happened(&self) -> bool {
        !matches!(self.kind(), Some(Kind::Fail))
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

struct Checker<'h> {
    bounds: Bounds,
    events: &'h [Event],
    /// Faults as (start, healed) on the monotonic clock; never healed: MAX.
    faults: Vec<(u64, u64)>,
}

impl Checker<'_> {
    /// The end of a bound of `base` starting at `from`, stretched by every
    /// fault active during it to the fault's healing plus the recovery.
    fn deadline(&self, from: u64, base: Duration) -> u64 {
        self.deadline_since(from, from, base)
    }

    /// [`Self::deadline`], where a fault counts from `since` on (the
    /// request's invocation: a fault while it was on its way delays it
    /// however late discovery completed).
    fn deadline_since(&self, since: u64, from: u64, base: Duration) -> u64 {
        let mut deadline = from.saturating_add(micros(base));
        loop {
            let stretched = self
                .faults
                .iter()
                .filter(|(start, healed)| *start <= deadline && *healed >= since)
                .map(|(_, healed)| healed.saturating_add(micros(self.bounds.fault_recovery)))
                .fold(deadline, u64::max);
            if stretched == deadline {
                return deadline;
            }
            deadline = stretched;
        }
    }

    /// The agent's events within the interval, a little beyond it.
    fn context(&self, agent: &str, from: u64, to: u64) -> Vec<Event> {
        let margin = 2_000_000;
        self.events
            .iter()
            .filter(|e| e.body.agent() == Some(agent))
            .filter(|e| e.mono_us + margin >= from && e.mono_us <= to.saturating_add(margin))
            .take(40)
            .cloned()
            .collect()
    }
}

/// The agent's operations, by kind.
#[derive(Default)]
struct AgentOps<'h> {
    /// In the order they were invoked.
    startups: Vec<Op<'h>>,
    pushes: Vec<Op<'h>>,
    /// `pushes` by run: a long run has thousands of pushes, a run a few.
    pushes_by_run: BTreeMap<&'h str, Vec<usize>>,
    turns: Vec<Op<'h>>,
    follow_ups: Vec<Op<'h>>,
    finals: Vec<(u64, &'h Body)>,
}

impl<'h> AgentOps<'h> {
    fn index(&mut self) {
        self.startups.sort_by_key(|s| s.at);
        for (i, push) in self.pushes.iter().enumerate() {
            self.pushes_by_run
                .entry(run_of(push.body))
                .or_default()
                .push(i);
        }
    }

    fn pushes_of(&self, run: &str) -> impl Iterator<Item = &Op<'h>> {
        self.pushes_by_run
            .get(run)
            .into_iter()
            .flatten()
            .map(|&i| &self.pushes[i])
    }

    /// The earliest ack of a complete report of `run`, and its op.
    fn completed(&self, run: &str) -> Option<(u64, u64)> {
        self.pushes_of(run)
            .filter(|p| matches!(p.body, Body::Push { complete: true, .. }))
            .filter_map(|p| Some((p.acked_at()?, p.id)))
            .min()
    }

    /// The acked Startups whose run was current at `at`: no Startup of
    /// another run that may have taken effect was invoked between them
    /// and `at`.
    fn current_at(&self, at: u64) -> Vec<&Op<'h>> {
        let before = self.startups.partition_point(|s| s.at <= at);
        let mut current = Vec::new();
        let mut run = None;
        for startup in self.startups[..before].iter().rev() {
            if !startup.may_have_happened() {
                continue;
            }
            let this = run_of(startup.body);
            if *run.get_or_insert(this) != this {
                break;
            }
            if startup.acked_at().is_some() {
                current.push(startup);
            }
        }
        current
    }

    /// From when the run of `first` (the earliest acked Startup of the runs
    /// current at `answered`) surely held the agent, as far as a takeover
    /// goes: None while it may not have. The store cannot order two
    /// processes' first Startups, so one of another run invoked earlier but
    /// not acked before `first` was invoked may land after it and take the
    /// agent over, until the live process reclaims it: by its latest
    /// Startup invoked before the answer, or within the reclaim bound of the
    /// latest such landing.
    fn held_since(&self, checker: &Checker<'_>, first: &Op<'h>, answered: u64) -> Option<u64> {
        let run = run_of(first.body);
        let budget = checker.bounds.request_budget;
        let landing = self
            .startups
            .iter()
            .take_while(|s| s.at < first.at)
            .filter(|s| run_of(s.body) != run && s.may_have_happened())
            .filter(|s| s.acked_at().is_none_or(|acked| acked > first.at))
            .map(|s| checker.deadline(s.at, budget))
            .filter(|&landing| landing > first.at)
            .max();
        let Some(landing) = landing else {
            // No Startup could have taken the agent over.
            return Some(0);
        };
        let reclaim = self
            .startups
            .iter()
            .filter(|s| s.at > first.at && s.at <= answered && run_of(s.body) == run)
            .rfind(|s| s.may_have_happened());
        let bound = checker.deadline(landing, checker.bounds.reclaim);
        let Some(reclaim) = reclaim else {
            return Some(bound);
        };
        // Unanswered by then: the takeover may still hold.
        let acked = reclaim.acked_at().filter(|&acked| acked <= answered)?;
        // Sent after the last possible landing, it surely ended it.
        Some(if reclaim.at > landing {
            acked
        } else {
            acked.max(bound)
        })
    }
}

/// Checks `events` against the promise within `bounds`.
pub fn check(events: &[Event], bounds: Bounds) -> Verdict {
    let mut verdict = Verdict::default();
    let mut ops: BTreeMap<u64, Op<'_>> = BTreeMap::new();
    let mut faults: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut agents: BTreeMap<&str, AgentOps<'_>> = BTreeMap::new();
    for event in events {
        match (&event.body, event.kind) {
            (Body::Fault { fault, .. }, Kind::Invoke) => {
                *verdict.faults.entry(fault.clone()).or_default() += 1;
                // A skewed wall clock must change no answer: it excuses
                // nothing (the restarts onto it are faults of their own).
                if fault != UNEXCUSED_FAULT {
                    faults.insert(event.op, (event.mono_us, u64::MAX));
                }
            }
            (Body::Fault { .. }, _) => {
                if let Some(fault) = faults.get_mut(&event.op) {
                    fault.1 = event.mono_us;
                }
            }
            (Body::Final { agent, .. }, _) => {
                agents
                    .entry(agent.as_str())
                    .or_default()
                    .finals
                    .push((event.mono_us, &event.body));
            }
            (_, Kind::Invoke) => {
                ops.insert(
                    event.op,
                    Op {
                        id: event.op,
                        at: event.mono_us,
                        body: &event.body,
                        done: None,
                    },
                );
            }
            (_, kind) => {
                if let Some(op) = ops.get_mut(&event.op) {
                    op.done = Some((kind, event.mono_us, &event.body));
                }
            }
        }
    }
    verdict.operations = ops.len();
    for op in ops.into_values() {
        let Some(agent) = op.body.agent() else {
            continue;
        };
        let entry = agents.entry(agent).or_default();
        match op.body {
            Body::Startup { .. } => entry.startups.push(op),
            Body::Push { .. } => entry.pushes.push(op),
            Body::Turn { .. } => entry.turns.push(op),
            Body::FollowUp { .. } => entry.follow_ups.push(op),
            _ => {}
        }
    }
    for agent_ops in agents.values_mut() {
        agent_ops.index();
    }
    let checker = Checker {
        bounds,
        events,
        faults: faults.into_values().collect(),
    };
    for (agent, agent_ops) in &agents {
        verdict.reports_acked += agent_ops
            .startups
            .iter()
            .chain(&agent_ops.pushes)
            .filter(|op| op.acked_at().is_some())
            .count();
        let checks: [(&[Op<'_>], CheckTurn); 2] = [
            (&agent_ops.turns, check_turn),
            (&agent_ops.follow_ups, check_follow_up),
        ];
        for (turns, check) in checks {
            for turn in turns {
                let Some((Kind::Ok, answered, body)) = turn.done else {
                    continue;
                };
                let Some(answer) = body.answer() else {
                    continue;
                };
                verdict.turns_checked += 1;
                if answer.store_unavailable {
                    continue;
                }
                check(
                    &checker,
                    agent,
                    agent_ops,
                    turn,
                    answered,
                    answer,
                    &mut verdict,
                );
            }
        }
        for (at, body) in &agent_ops.finals {
            check_final(&checker, agent, agent_ops, *at, body, &mut verdict);
        }
    }
    verdict
}

/// Judges one answered turn of an agent.
type CheckTurn = fn(&Checker<'_>, &str, &AgentOps<'_>, &Op<'_>, u64, &Answer, &mut Verdict);

fn run_of(body: &Body) -> &str {
    match body {
        Body::Startup { run_id, .. } | Body::Push { run_id, .. } | Body::Final { run_id, .. } => {
            run_id
        }
        _ => "",
    }
}

fn check_turn(
    checker: &Checker<'_>,
    agent: &str,
    ops: &AgentOps<'_>,
    turn: &Op<'_>,
    answered: u64,
    answer: &Answer,
    verdict: &mut Verdict,
) {
    let asked = turn.at;
    let mut anomaly = |kind, involved: Vec<u64>, message: String| {
        let mut all = vec![turn.id];
        all.extend(involved);
        verdict.anomalies.push(Anomaly {
            kind,
            ops: all,
            message,
            context: checker.context(agent, asked, answered),
        });
    };
    let lag = checker.bounds.view_lag;
    let wake = checker.bounds.wake;
    match answer.decision {
        Decision::Ready => {
            let run = answer.snapshot_run_id.as_str();
            let Some(startup) = ops
                .startups
                .iter()
                .find(|s| run_of(s.body) == run && s.may_have_happened() && s.at <= answered)
            else {
                anomaly(
                    AnomalyKind::UnknownReport,
                    vec![],
                    format!("ready with run {run}, which no Startup began before the answer"),
                );
                return;
            };
            // A later run whose Startup was acked long before the request.
            // Startups are in invocation order, and none acked after the
            // request began (or within the lag before it) can be one, so
            // only those are checked against their stretched deadline.
            if let Some(started) = startup.acked_at() {
                let from = ops.startups.partition_point(|s| s.at < started);
                let until = ops.startups.partition_point(|s| s.at <= asked);
                let next = ops.startups[from..until.max(from)]
                    .iter()
                    .filter(|next| run_of(next.body) != run)
                    .filter_map(|next| Some((next.acked_at()?, next)))
                    .filter(|(acked, _)| acked.saturating_add(micros(lag)) < asked)
                    .find(|(acked, _)| checker.deadline(*acked, lag) < asked);
                if let Some((acked, next)) = next {
                    anomaly(
                        AnomalyKind::SupersededRun,
                        vec![startup.id, next.id],
                        format!(
                            "ready with run {run}, superseded by run {} acked {} µs before the request",
                            run_of(next.body),
                            asked - acked
                        ),
                    );
                    return;
                }
            }
            let version = answer.snapshot_version;
            let report = ops.pushes_of(run).find(|p| {
                matches!(p.body, Body::Push { version: v, .. } if *v == version)
                    && p.may_have_happened()
            });
            let Some(report) = report else {
                anomaly(
                    AnomalyKind::UnknownReport,
                    vec![],
                    format!(
                        "ready with run {run} version {version}, which no accepted push reported"
                    ),
                );
                return;
            };
            let Body::Push {
                tools, complete, ..
            } = report.body
            else {
                return;
            };
            let (mut shown, mut reported) = (answer.tools.clone(), tools.clone());
            shown.sort();
            reported.sort();
            if shown != reported {
                anomaly(
                    AnomalyKind::WrongTools,
                    vec![report.id],
                    format!(
                        "ready with tools {shown:?}; run {run} version {version} reported {reported:?}"
                    ),
                );
            }
            if !complete {
                anomaly(
                    AnomalyKind::ReadyWhilePending,
                    vec![report.id],
                    format!("ready on run {run} version {version}, whose discovery was pending"),
                );
            }
            for newer in ops.pushes_of(run) {
                let Body::Push { version: v, .. } = newer.body else {
                    continue;
                };
                if *v > version
                    && let Some(acked) = newer.acked_at()
                    && checker.deadline(acked, lag) < asked
                {
                    anomaly(
                        AnomalyKind::OldVersion,
                        vec![report.id, newer.id],
                        format!(
                            "ready with version {version} of run {run}; version {v} was acked {} µs before the request",
                            asked - acked
                        ),
                    );
                    break;
                }
            }
            // The wait ends within the wake bound of discovery completing.
            if let Some((acked, push)) = ops.completed(run)
                && answered > checker.deadline_since(asked, acked.max(asked), wake)
            {
                anomaly(
                    AnomalyKind::SlowWake,
                    vec![push],
                    format!(
                        "answered {} µs after the later of the request and the completing ack",
                        answered - acked.max(asked)
                    ),
                );
            }
        }
        Decision::Pending => {
            // A completing report of a run that was current from its ack to
            // the answer: the wait should have ended.
            let current = ops.current_at(answered);
            if let Some(first) = current.last()
                && let Some(held) = ops.held_since(checker, first, answered)
            {
                let run = run_of(first.body);
                if let Some((acked, push)) = ops.completed(run) {
                    let from = acked.max(asked).max(held);
                    if checker.deadline_since(asked, from, wake) < answered {
                        anomaly(
                            AnomalyKind::PendingAfterComplete,
                            vec![first.id, push],
                            format!(
                                "pending, though run {run}'s discovery was complete {} µs before the answer",
                                answered - from
                            ),
                        );
                    }
                }
            }
        }
        Decision::Stale => {
            if !answer.tools.is_empty() {
                anomaly(
                    AnomalyKind::WrongTools,
                    vec![],
                    format!("stale, yet tools are shown: {:?}", answer.tools),
                );
            }
        }
        Decision::Unknown => {
            if let Some((op, message)) = reported_before(checker, ops, asked) {
                anomaly(AnomalyKind::LostAck, vec![op], message);
            }
        }
        Decision::NotFirstTurn => anomaly(
            AnomalyKind::FirstTurnAsLater,
            vec![],
            "a first turn answered as a later one".into(),
        ),
    }
}

/// An acked report of the agent that every gate's view holds by `asked`:
/// its op and what answering "never reported" then means.
fn reported_before(checker: &Checker<'_>, ops: &AgentOps<'_>, asked: u64) -> Option<(u64, String)> {
    ops.startups
        .iter()
        .chain(&ops.pushes)
        .filter_map(|op| Some((op.acked_at()?, op.id)))
        .find(|(acked, _)| checker.deadline(*acked, checker.bounds.view_lag) < asked)
        .map(|(acked, op)| {
            (
                op,
                format!(
                    "answered as never reported, {} µs after a report was acked",
                    asked - acked
                ),
            )
        })
}

/// A later turn is answered at once with the chat's context as it is: it
/// never waits for discovery, whatever the agent's state.
fn check_follow_up(
    checker: &Checker<'_>,
    agent: &str,
    ops: &AgentOps<'_>,
    turn: &Op<'_>,
    answered: u64,
    answer: &Answer,
    verdict: &mut Verdict,
) {
    let asked = turn.at;
    let found = match answer.decision {
        Decision::Unknown => reported_before(checker, ops, asked)
            .map(|(op, message)| (AnomalyKind::LostAck, op, message)),
        Decision::NotFirstTurn if answer.waited_ms > 0 => Some((
            AnomalyKind::HeldFollowUp,
            turn.id,
            format!("a later turn waited {} ms", answer.waited_ms),
        )),
        Decision::NotFirstTurn if answered > checker.deadline(asked, checker.bounds.wake) => {
            Some((
                AnomalyKind::HeldFollowUp,
                turn.id,
                format!(
                    "a later turn answered {} µs after it was asked",
                    answered - asked
                ),
            ))
        }
        Decision::NotFirstTurn => None,
        decision => Some((
            AnomalyKind::HeldFollowUp,
            turn.id,
            format!("a later turn answered as a first turn ({decision:?})"),
        )),
    };
    if let Some((kind, op, message)) = found {
        let mut involved = vec![turn.id];
        if op != turn.id {
            involved.push(op);
        }
        verdict.anomalies.push(Anomaly {
            kind,
            ops: involved,
            message,
            context: checker.context(agent, asked, answered),
        });
    }
}

fn check_final(
    checker: &Checker<'_>,
    agent: &str,
    ops: &AgentOps<'_>,
    at: u64,
    body: &Body,
    verdict: &mut Verdict,
) {
    let Body::Final {
        run_id, version, ..
    } = body
    else {
        return;
    };
    let mut lost = |ops: Vec<u64>, message: String| {
        verdict.anomalies.push(Anomaly {
            kind: AnomalyKind::LostAck,
            ops,
            message,
            context: checker.context(agent, at.saturating_sub(10_000_000), at),
        });
    };
    // The last Startup that took effect for sure: acked, and no other
    // Startup that may have taken effect was invoked after it.
    let last = ops
        .startups
        .iter()
        .filter(|s| s.acked_at().is_some())
        .max_by_key(|s| s.at);
    if let Some(last) = last {
        let later = ops
            .startups
            .iter()
            .any(|s| s.at > last.at && s.may_have_happened());
        if !later && run_of(last.body) != run_id {
            lost(
                vec![last.id],
                format!(
                    "the store ends on run {run_id}; run {} was the last acked",
                    run_of(last.body)
                ),
            );
        }
    }
    for push in &ops.pushes {
        let Body::Push {
            run_id: pushed_run,
            version: pushed,
            ..
        } = push.body
        else {
            continue;
        };
        if pushed_run == run_id && pushed > version && push.acked_at().is_some() {
            lost(
                vec![push.id],
                format!(
                    "the store ends on version {version} of run {run_id}; version {pushed} was acked"
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Answer, Via};

    const MS: u64 = 1_000;

    /// A history written by hand: each call adds an operation.
    #[derive(Default)]
    struct History {
        events: Vec<Event>,
        next: u64,
    }

    impl History {
        fn op(&mut self, body: Body, at_ms: u64, done: Option<(Kind, u64, Body)>) -> u64 {
            self.next += 1;
            let op = self.next;
            self.events.push(Event {
                op,
                kind: Kind::Invoke,
                mono_us: at_ms * MS,
                wall_ms: at_ms,
                body,
            });
            if let Some((kind, done_ms, body)) = done {
                self.events.push(Event {
                    op,
                    kind,
                    mono_us: done_ms * MS,
                    wall_ms: done_ms,
                    body,
                });
            }
            op
        }

        fn startup(&mut self, run: &str, at: u64, acked: u64) -> &mut Self {
            self.startup_as(run, false, at, (Kind::Ok, acked))
        }

        /// A Startup whose sender gave up at `gave_up`: it may land later.
        fn startup_unknown(&mut self, run: &str, at: u64, gave_up: u64) -> &mut Self {
            self.startup_as(run, false, at, (Kind::Info, gave_up))
        }

        fn reclaim(&mut self, run: &str, at: u64, acked: u64) -> &mut Self {
            self.startup_as(run, true, at, (Kind::Ok, acked))
        }

        fn startup_as(
            &mut self,
            run: &str,
            reclaim: bool,
            at: u64,
            done: (Kind, u64),
        ) -> &mut Self {
            let body = Body::Startup {
                agent: "a".into(),
                run_id: run.into(),
                reclaim,
            };
            self.op(body.clone(), at, Some((done.0, done.1, body)));
            self
        }

        fn push(
            &mut self,
            run: &str,
            version: u64,
            complete: bool,
            tools: &[&str],
            at: u64,
            acked: u64,
        ) -> &mut Self {
            let body = Body::Push {
                agent: "a".into(),
                run_id: run.into(),
                version,
                complete,
                tools: tools.iter().map(|t| t.to_string()).collect(),
            };
            self.op(body.clone(), at, Some((Kind::Ok, acked, body)));
            self
        }

        fn turn(&mut self, at: u64, answered: u64, answer: Answer) -> &mut Self {
            let chat = format!("c{}", self.next);
            let turn = |answer| Body::Turn {
                agent: "a".into(),
                chat: chat.clone(),
                via: Via::Http,
                answer,
            };
            self.op(
                turn(None),
                at,
                Some((Kind::Ok, answered, turn(Some(answer)))),
            );
            self
        }

        fn follow_up(&mut self, at: u64, answered: u64, answer: Answer) -> &mut Self {
            let chat = format!("c{}", self.next);
            let turn = |answer| Body::FollowUp {
                agent: "a".into(),
                chat: chat.clone(),
                via: Via::Nats,
                answer,
            };
            self.op(
                turn(None),
                at,
                Some((Kind::Ok, answered, turn(Some(answer)))),
            );
            self
        }

        fn fault(&mut self, from: u64, healed: u64) -> &mut Self {
            self.fault_of("kill", from, healed)
        }

        fn fault_of(&mut self, kind: &str, from: u64, healed: u64) -> &mut Self {
            let body = Body::Fault {
                fault: kind.into(),
                target: "snapshot-store-0".into(),
            };
            self.op(body.clone(), from, Some((Kind::Ok, healed, body)));
            self
        }

        fn final_state(&mut self, run: &str, version: u64, at: u64) -> &mut Self {
            self.next += 1;
            self.events.push(Event {
                op: self.next,
                kind: Kind::Ok,
                mono_us: at * MS,
                wall_ms: at,
                body: Body::Final {
                    agent: "a".into(),
                    run_id: run.into(),
                    version,
                },
            });
            self
        }

        fn check(&self) -> Verdict {
            check(&self.events, Bounds::default())
        }
    }

    fn answer(decision: Decision, run: &str, version: u64, tools: &[&str]) -> Answer {
        Answer {
            decision,
            run_id: run.into(),
            snapshot_run_id: run.into(),
            snapshot_version: version,
            tools: tools.iter().map(|t| t.to_string()).collect(),
            waited_ms: 0,
            store_unavailable: false,
        }
    }

    fn ready(run: &str, version: u64, tools: &[&str]) -> Answer {
        answer(Decision::Ready, run, version, tools)
    }

    /// Run r1 complete, then r2 started and complete: the agent's usual life.
    fn two_runs() -> History {
        let mut h = History::default();
        h.startup("r1", 0, 10)
            .push("r1", 1, true, &["s__x"], 20, 30)
            .startup("r2", 1000, 1010)
            .push("r2", 1, false, &[], 1020, 1030)
            .push("r2", 2, true, &["s__y"], 1040, 1050);
        h
    }

    #[test]
    fn a_correct_history_has_no_anomaly() {
        let mut h = two_runs();
        h.turn(40, 45, ready("r1", 1, &["s__x"]))
            // Asked while r2 was pending, woken by its completion.
            .turn(1035, 1060, ready("r2", 2, &["s__y"]))
            // Within the view lag of r2's Startup, r1's tools may still show.
            .turn(1500, 1510, ready("r1", 1, &["s__x"]))
            .turn(3000, 3005, ready("r2", 2, &["s__y"]))
            .final_state("r2", 2, 4000);
        let verdict = h.check();
        assert!(verdict.anomalies.is_empty(), "{verdict}");
        assert_eq!(verdict.turns_checked, 4);
        assert_eq!(verdict.reports_acked, 5);
    }

    #[test]
    fn a_superseded_runs_tools_are_an_anomaly() {
        let mut h = two_runs();
        h.turn(3000, 3005, ready("r1", 1, &["s__x"]));
        let verdict = h.check();
        assert_eq!(verdict.of_kind(AnomalyKind::SupersededRun), 1, "{verdict}");
        assert_eq!(verdict.anomalies.len(), 1, "{verdict}");
        assert!(!verdict.anomalies[0].context.is_empty());
    }

    #[test]
    fn an_older_version_than_one_acked_before_the_request_is_an_anomaly() {
        let mut h = two_runs();
        h.push("r2", 3, true, &["s__z"], 1100, 1110)
            .turn(3000, 3005, ready("r2", 2, &["s__y"]));
        let verdict = h.check();
        assert_eq!(verdict.of_kind(AnomalyKind::OldVersion), 1, "{verdict}");
    }

    #[test]
    fn tools_other_than_the_reports_and_reports_never_sent_are_anomalies() {
        let mut h = two_runs();
        h.turn(3000, 3005, ready("r2", 2, &["s__y", "s__planted"]))
            .turn(3100, 3105, ready("r2", 9, &["s__y"]))
            .turn(3200, 3205, ready("r2", 1, &[]));
        let verdict = h.check();
        assert_eq!(verdict.of_kind(AnomalyKind::WrongTools), 1, "{verdict}");
        assert_eq!(verdict.of_kind(AnomalyKind::UnknownReport), 1, "{verdict}");
        assert_eq!(
            verdict.of_kind(AnomalyKind::ReadyWhilePending),
            1,
            "{verdict}"
        );
    }

    #[test]
    fn a_wait_past_complete_is_an_anomaly_unless_a_fault_explains_it() {
        let mut h = two_runs();
        // Asked while r2 was pending, answered 5 s after it completed.
        h.turn(1035, 6050, ready("r2", 2, &["s__y"]));
        assert_eq!(h.check().of_kind(AnomalyKind::SlowWake), 1, "{}", h.check());

        let mut faulted = two_runs();
        faulted
            .fault(1000, 2000)
            .turn(1035, 6050, ready("r2", 2, &["s__y"]));
        let verdict = faulted.check();
        assert!(
            verdict.anomalies.is_empty(),
            "a fault until 2 s plus 10 s of recovery: {verdict}"
        );
        assert_eq!(verdict.faults["kill"], 1);

        // A link cut while the request was on its way, healed before r2
        // completed: the request may arrive as late as the recovery.
        let mut delayed = two_runs();
        delayed
            .fault(1025, 1030)
            .turn(1020, 6050, ready("r2", 2, &["s__y"]));
        assert!(delayed.check().anomalies.is_empty(), "{}", delayed.check());
        let mut before = two_runs();
        before
            .fault(500, 600)
            .turn(1020, 6050, ready("r2", 2, &["s__y"]));
        assert_eq!(
            before.check().of_kind(AnomalyKind::SlowWake),
            1,
            "a fault healed before the request excuses nothing: {}",
            before.check()
        );

        let mut skewed = two_runs();
        skewed
            .fault_of(UNEXCUSED_FAULT, 1000, 2000)
            .turn(1035, 6050, ready("r2", 2, &["s__y"]));
        let verdict = skewed.check();
        assert_eq!(
            verdict.of_kind(AnomalyKind::SlowWake),
            1,
            "a skewed clock excuses nothing: {verdict}"
        );
        assert_eq!(verdict.faults[UNEXCUSED_FAULT], 1);
    }

    #[test]
    fn pending_after_discovery_completed_on_the_current_run_is_an_anomaly() {
        let mut h = two_runs();
        h.turn(1060, 16060, answer(Decision::Pending, "r2", 1, &[]));
        assert_eq!(
            h.check().of_kind(AnomalyKind::PendingAfterComplete),
            1,
            "{}",
            h.check()
        );
        // Pending while r2's discovery really was pending is what it should say.
        let mut fine = History::default();
        fine.startup("r2", 1000, 1010)
            .push("r2", 1, false, &[], 1020, 1030)
            .turn(1035, 16035, answer(Decision::Pending, "r2", 1, &[]));
        assert!(fine.check().anomalies.is_empty(), "{}", fine.check());
    }

    /// A dead process's Startup (r6) stalls, lands after its successor's
    /// (r7) was acked and takes the agent over: the store cannot tell them
    /// apart. Pending answers are excused until the live process reclaims,
    /// and no longer than the reclaim bound after the latest landing.
    #[test]
    fn a_late_startup_of_another_run_excuses_pending_until_the_live_process_reclaims() {
        let late = || {
            let mut h = History::default();
            h.startup_unknown("r6", 0, 5000)
                .startup("r7", 200, 210)
                .push("r7", 1, false, &[], 220, 230)
                .push("r7", 2, true, &["s__x"], 300, 310);
            h
        };
        let pending = || answer(Decision::Pending, "r6", 0, &[]);

        // Answered while r6 may hold the agent (it may land until 5 s,
        // and r7 takes it back within 3 s of that).
        let mut taken_over = late();
        taken_over.turn(3500, 8500, pending());
        assert!(
            taken_over.check().anomalies.is_empty(),
            "{}",
            taken_over.check()
        );

        // Reclaimed at 9.5 s: a pending answer after that is a missed wake.
        let mut reclaimed = late();
        reclaimed
            .reclaim("r7", 9500, 9510)
            .push("r7", 3, true, &["s__x"], 9520, 9530)
            .turn(3500, 8500, pending())
            .turn(9600, 14600, pending());
        let verdict = reclaimed.check();
        assert_eq!(
            verdict.of_kind(AnomalyKind::PendingAfterComplete),
            1,
            "{verdict}"
        );
        assert_eq!(verdict.anomalies.len(), 1, "{verdict}");

        // A reclaim sent but not answered by the time of the answer: the
        // takeover may still hold.
        let mut reclaiming = late();
        reclaiming
            .reclaim("r7", 9500, 14700)
            .turn(9600, 14600, pending());
        assert!(
            reclaiming.check().anomalies.is_empty(),
            "{}",
            reclaiming.check()
        );

        // Never reclaimed (the chaos run's agents before they did): pending
        // long after the reclaim bound is an anomaly.
        let mut never = late();
        never.turn(12000, 17000, pending());
        assert_eq!(
            never.check().of_kind(AnomalyKind::PendingAfterComplete),
            1,
            "{}",
            never.check()
        );

        // A Startup of another run acked before r7's was invoked landed
        // before it: it excuses nothing.
        let mut ordered = History::default();
        ordered
            .startup("r6", 0, 100)
            .startup("r7", 200, 210)
            .push("r7", 1, true, &["s__x"], 300, 310)
            .turn(3500, 8500, pending());
        assert_eq!(
            ordered.check().of_kind(AnomalyKind::PendingAfterComplete),
            1,
            "{}",
            ordered.check()
        );
    }

    #[test]
    fn an_acked_report_the_store_does_not_hold_is_lost() {
        let mut h = two_runs();
        h.final_state("r2", 1, 4000);
        let verdict = h.check();
        assert_eq!(verdict.acked_lost(), 1, "{verdict}");
        let mut old_run = two_runs();
        old_run.final_state("r1", 1, 4000);
        assert_eq!(old_run.check().acked_lost(), 1, "{}", old_run.check());
    }

    #[test]
    fn an_answer_that_says_the_store_was_unreachable_is_not_held_to_the_promise() {
        let mut h = two_runs();
        let mut unreachable = answer(Decision::Pending, "r1", 1, &[]);
        unreachable.store_unavailable = true;
        h.turn(3000, 18000, unreachable);
        assert!(h.check().anomalies.is_empty(), "{}", h.check());
    }

    #[test]
    fn a_later_turn_that_waits_or_is_answered_as_a_first_is_an_anomaly() {
        let mut h = two_runs();
        // While r2 is pending, a later turn is answered at once.
        h.follow_up(1032, 1034, answer(Decision::NotFirstTurn, "r2", 1, &[]));
        assert!(h.check().anomalies.is_empty(), "{}", h.check());

        let mut waited = answer(Decision::NotFirstTurn, "r2", 1, &[]);
        waited.waited_ms = 900;
        h.follow_up(1032, 1940, waited)
            .follow_up(1032, 4000, answer(Decision::NotFirstTurn, "r2", 1, &[]))
            .follow_up(3000, 3005, ready("r2", 2, &["s__y"]))
            .turn(
                3000,
                3005,
                answer(Decision::NotFirstTurn, "r2", 2, &["s__y"]),
            );
        let verdict = h.check();
        assert_eq!(verdict.of_kind(AnomalyKind::HeldFollowUp), 3, "{verdict}");
        assert_eq!(
            verdict.of_kind(AnomalyKind::FirstTurnAsLater),
            1,
            "{verdict}"
        );
        assert_eq!(verdict.anomalies.len(), 4, "{verdict}");
    }
}
