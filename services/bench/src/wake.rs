//! The chats' side: wake latency from the store's commit to a waiting chat's
//! answer (1 to 10,000 chats waiting), the gate's answer when discovery is
//! already complete, the polling baseline, and memory held per waiting chat.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use chrono::{DateTime, Utc};

use ctxsync_proto::v1::{
    AgentState, DiscoveryChanged, GateDecision, TurnReply, TurnRequest, discovery_changed::Cause,
    mcp_discovery::Phase,
};
use ctxsync_runtime::rpc;
use ctxsync_runtime::store::StoreClient;
use futures::StreamExt;
use prost::Message;

use crate::env::{BenchAgent, CALL_TIMEOUT, Env, run_id};
use crate::floors;
use crate::push::{push_request, resources, server};
use crate::stats::{Latency, mean_between};
use crate::steps::{BenchError, Progress, Sizes, Step};

/// The waiters' count stops growing for this long: no more chats will line up.
const STALL: Duration = Duration::from_millis(1500);
/// The gate's own work on an event that ended waits (chat-gate's series.rs).
const EVENT_WORK_SECONDS: &str = "ctxsync_gate_event_work_seconds";
/// The gate's own work from a wait's end to its turn's answer built.
const ANSWER_WORK_SECONDS: &str = "ctxsync_gate_answer_work_seconds";
/// At most this many wrong answers are quoted in the report.
const QUOTED_ERRORS: usize = 5;

#[derive(Debug, Clone, Default)]
pub struct WakeCase {
    pub chats: usize,
    pub agents: usize,
    /// Rounds measured (the single-chat case repeats; the others run once).
    pub rounds: usize,
    /// Chats the gate held waiting when discovery completed (summed over rounds).
    pub waiting_at_commit: usize,
    pub answered: usize,
    /// Answers with decision READY, the agent's current run and exactly its tools.
    pub correct: usize,
    pub wrong: Vec<String>,
    pub latency: Latency,
    /// For the breakdown: from the commit to a plain subscriber (the bench)
    /// receiving the discovery event, per agent.
    pub event_latency: Latency,
    /// For the breakdown: from the event reaching a plain subscriber to the chat's answer.
    pub event_to_answer: Latency,
    /// For the breakdown (the 1-chat rounds): the gate's own work, mean, as
    /// its `/metrics` count it: applying an event that ended waits, and
    /// from a wait's end to its turn's answer built.
    pub gate_event_work_us: Option<f64>,
    pub gate_answer_work_us: Option<f64>,
    /// RSS of the process before the chats asked and while they waited.
    pub rss_before_bytes: Option<u64>,
    pub rss_waiting_bytes: Option<u64>,
    /// Agents the gate watched while the chats waited.
    pub gate_watches: usize,
    pub note: Option<String>,
    /// When the completing pushes committed, from the first commit, in
    /// order: the fan-out floor publishes at these instants.
    pub commit_offsets: Vec<Duration>,
    samples: Vec<Duration>,
    event_samples: Vec<Duration>,
    after_event_samples: Vec<Duration>,
}

#[derive(Debug, Clone, Default)]
pub struct Memory {
    pub chats: usize,
    pub waiting_in_gate: usize,
    pub rss_delta_bytes: i64,
    /// RSS delta over the chats: an upper bound (it includes the bench's own
    /// request futures and the NATS buffers on both sides).
    pub bytes_per_chat: f64,
    pub note: String,
    /// Of the gate processes alone (deployed), not of the bench's process.
    pub gate_alone: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Polling {
    pub rounds: usize,
    pub interval_ms: u64,
    /// From the commit to the polling waiter seeing it.
    pub polling_latency: Latency,
    /// Our wake of a chat waiting on the same commits.
    pub wake_latency: Latency,
    /// Raw NATS two hops, one per round, each after that round's idleness
    /// before its commit.
    pub two_hops_same_idle: Latency,
}

fn since(commit: SystemTime, at: SystemTime) -> Duration {
    at.duration_since(commit).unwrap_or_default()
}

/// The tool an agent offers once its discovery of this round completes.
fn tool_of(round_run_id: &str) -> String {
    format!("t_{}", round_run_id.trim_start_matches("bench-"))
}

/// Why an answer is not the right one for an agent whose run `run_id` completed with `tool`.
fn check(reply: &TurnReply, run_id: &str, tool: &str) -> Result<(), String> {
    if let Some(error) = &reply.error {
        return Err(format!("error: {}", error.message));
    }
    if reply.decision() != GateDecision::Ready {
        return Err(format!("decision {}", reply.decision().as_str_name()));
    }
    let projection = reply.projection.as_ref().ok_or("no projection")?;
    if projection.agent_run_id != run_id {
        return Err(format!(
            "run {} instead of {run_id}",
            projection.agent_run_id
        ));
    }
    let tools: Vec<&str> = projection
        .servers
        .iter()
        .flat_map(|s| s.tools.iter().map(|t| t.name.as_str()))
        .collect();
    let expected = format!("bench__{tool}");
    if tools != [expected.as_str()] {
        return Err(format!("tools {tools:?} instead of [{expected}]"));
    }
    Ok(())
}

async fn first_turn(
    client: async_nats::Client,
    subject: String,
    chat_id: String,
    agent_id: String,
) -> (Result<TurnReply, String>, SystemTime) {
    let reply = rpc::request(
        &client,
        subject,
        &TurnRequest {
            chat_id,
            agent_id,
            first_turn: true,
            tenant: super::env::BENCH_TENANT.into(),
        },
        None,
        CALL_TIMEOUT,
    )
    .await
    .map_err(|e| e.to_string());
    (reply, SystemTime::now())
}

async fn read_state(store: &StoreClient, agent_id: &str) -> Result<AgentState, String> {
    store.agent_state(agent_id).await.map_err(|e| e.to_string())
}

/// Waits until `extra` more chats wait in the gate than `baseline`, or the
/// count stops growing; returns how many wait.
async fn until_waiting(env: &Env, baseline: usize, extra: usize) -> usize {
    let deadline = Instant::now() + CALL_TIMEOUT;
    let mut last = 0;
    let mut last_change = Instant::now();
    loop {
        let waiting = env.services.gate_waiters().await.saturating_sub(baseline);
        if waiting >= extra || Instant::now() > deadline {
            return waiting;
        }
        if waiting != last {
            last = waiting;
            last_change = Instant::now();
        } else if waiting > 0 && last_change.elapsed() > STALL {
            return waiting;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Puts each agent in a new run whose discovery is PENDING.
async fn new_pending_runs(env: &Env, agents: &[BenchAgent]) -> Result<Vec<String>, BenchError> {
    let runs: Vec<Result<String, BenchError>> = futures::stream::iter(agents)
        .map(|agent| async move {
            let run = run_id();
            env.startup(&agent.id, &run).await?;
            let mut pending = resources(0);
            pending.truncate(1);
            env.push(&agent.id, push_request(&run, 1, Phase::Pending, pending))
                .await?;
            Ok(run)
        })
        .buffered(16)
        .collect()
        .await;
    runs.into_iter().collect()
}

/// Completes each agent's run: its discovery found one server with one tool.
async fn complete_runs(
    env: &Env,
    agents: &[BenchAgent],
    runs: &[String],
) -> Result<(), BenchError> {
    let pushes: Vec<Result<(), BenchError>> = futures::stream::iter(agents.iter().zip(runs))
        .map(|(agent, run)| async move {
            let mut complete = resources(1);
            complete.truncate(1);
            complete.push(server("bench", &[tool_of(run)]));
            env.push(&agent.id, push_request(run, 2, Phase::Complete, complete))
                .await
        })
        .buffer_unordered(crate::steps::COMPLETE_CONCURRENCY)
        .collect()
        .await;
    pushes.into_iter().collect()
}

/// Commit times of the agents' completing pushes, from their discovery
/// events, and how long after the commit each event arrived here.
async fn collect_commits(
    mut events: async_nats::Subscriber,
    wanted: HashMap<String, String>,
) -> Result<(HashMap<String, SystemTime>, HashMap<String, SystemTime>), BenchError> {
    let mut commits = HashMap::with_capacity(wanted.len());
    let mut arrivals = HashMap::with_capacity(wanted.len());
    let collect = async {
        while commits.len() < wanted.len() {
            let Some(message) = events.next().await else {
                break;
            };
            let arrived = SystemTime::now();
            let Ok(event) = DiscoveryChanged::decode(message.payload) else {
                continue;
            };
            if event.cause() == Cause::Push
                && event.phase() == Phase::Complete
                && wanted.get(&event.agent_id) == Some(&event.snapshot_agent_run_id)
                && let Some(at) = event.committed_at
                && let Ok(commit) = DateTime::<Utc>::try_from(at)
            {
                let commit = SystemTime::from(commit);
                arrivals.insert(event.agent_id.clone(), arrived);
                commits.insert(event.agent_id.clone(), commit);
            }
        }
    };
    let timed_out = tokio::time::timeout(Duration::from_secs(60), collect)
        .await
        .is_err();
    let _ = events.unsubscribe().await;
    if timed_out || commits.len() < wanted.len() {
        return Err(BenchError::new(
            "wake",
            format!(
                "only {} of {} discovery events arrived within 60 s",
                commits.len(),
                wanted.len()
            ),
        ));
    }
    Ok((commits, arrivals))
}

/// One round: `chats` chats over `agents` wait for a PENDING discovery; the
/// discovery completes; every chat's answer is checked and timed from the commit.
async fn round(
    env: &Env,
    agents: &[BenchAgent],
    chats: usize,
    label: &str,
    progress: Option<&Progress>,
) -> Result<WakeCase, BenchError> {
    let runs = new_pending_runs(env, agents).await?;
    let events = env
        .client
        .subscribe(env.subjects.discovery_changed_all())
        .await
        .step("subscribe to discovery events")?;
    ctxsync_runtime::nats::sync_with_server(&env.client)
        .await
        .step("subscribe to discovery events")?;
    let baseline = env.services.gate_waiters().await;
    let rss_before = env.services.gate_rss();

    let subject = env.subjects.gate_turn(super::env::BENCH_TENANT);
    let tasks: Vec<_> = (0..chats)
        .map(|c| {
            let index = c % agents.len();
            let task = tokio::spawn(first_turn(
                env.client.clone(),
                subject.clone(),
                format!("{label}-chat-{c}"),
                agents[index].id.clone(),
            ));
            (index, task)
        })
        .collect();
    if let Some(progress) = progress {
        progress.step(format!("wake: {chats} chats lining up in the gate"));
    }
    let waiting = until_waiting(env, baseline, chats).await;
    let rss_waiting = env.services.gate_rss();
    let gate_watches = env.services.gate_views().await;
    if let Some(progress) = progress {
        progress.step(format!(
            "wake: {waiting} of {chats} chats waiting; completing discovery of {} agents",
            agents.len()
        ));
    }

    // The events are timed as they arrive, while the other pushes still commit.
    let wanted: HashMap<String, String> = agents
        .iter()
        .zip(&runs)
        .map(|(a, r)| (a.id.clone(), r.clone()))
        .collect();
    let collector = tokio::spawn(collect_commits(events, wanted));
    complete_runs(env, agents, &runs).await?;
    let (commits, arrivals) = collector.await.step("event collector")??;
    let event_samples: Vec<Duration> = agents
        .iter()
        .map(|a| since(commits[&a.id], arrivals[&a.id]))
        .collect();

    let mut case = WakeCase {
        chats,
        agents: agents.len(),
        rounds: 1,
        waiting_at_commit: waiting,
        rss_before_bytes: rss_before,
        rss_waiting_bytes: rss_waiting,
        gate_watches,
        commit_offsets: offsets_from_first(commits.values().copied()),
        ..Default::default()
    };
    let mut latencies = Vec::with_capacity(chats);
    let mut after_event = Vec::with_capacity(chats);
    for (index, task) in tasks {
        let (reply, at) = task.await.step("chat task")?;
        let agent = &agents[index];
        let outcome = reply.and_then(|reply| {
            case.answered += 1;
            check(&reply, &runs[index], &tool_of(&runs[index]))
        });
        match outcome {
            Ok(()) => {
                case.correct += 1;
                latencies.push(since(commits[&agent.id], at));
                after_event.push(since(arrivals[&agent.id], at));
            }
            Err(why) if case.wrong.len() < QUOTED_ERRORS => {
                case.wrong.push(format!("agent {}: {why}", agent.id));
            }
            Err(_) => {}
        }
    }
    case.latency = Latency::of(latencies.clone());
    case.samples = latencies;
    case.event_latency = Latency::of(event_samples.clone());
    case.event_samples = event_samples;
    case.event_to_answer = Latency::of(after_event.clone());
    case.after_event_samples = after_event;
    Ok(case)
}

/// `times` in order, as offsets from the earliest.
fn offsets_from_first(times: impl Iterator<Item = SystemTime>) -> Vec<Duration> {
    let mut times: Vec<SystemTime> = times.collect();
    times.sort();
    let Some(&first) = times.first() else {
        return Vec::new();
    };
    times.iter().map(|&t| since(first, t)).collect()
}

fn in_front_note(waiting: usize, chats: usize) -> Option<String> {
    (waiting < chats).then(|| {
        format!(
            "only {waiting} of {chats} chats were held waiting by the gate when discovery completed; \
             the others were still queued in front of it (chat-gate's limit of turns in flight, \
             CTXSYNC_GATE_MAX_TURNS), so their answers include that queue"
        )
    })
}

/// Every wake case. The two-hop floor's `floor_samples` are taken between
/// the 1-chat rounds, a share before each, so the floor and the wake it is
/// compared with are measured in the same minutes.
pub async fn all_cases(
    env: &Env,
    agents: &[BenchAgent],
    sizes: &Sizes,
    two_hops: &mut floors::TwoHops,
    floor_samples: usize,
    progress: &Progress,
) -> Result<Vec<WakeCase>, BenchError> {
    let mut cases = Vec::new();
    for (n, &chats) in sizes.wake_chats.iter().enumerate() {
        if chats == 1 {
            let mut latencies = Vec::new();
            let mut event_latencies = Vec::new();
            let mut after_event = Vec::new();
            let mut total = WakeCase {
                chats: 1,
                agents: 1,
                ..Default::default()
            };
            let before = Some(env.services.metrics_text().await);
            for r in 0..sizes.single_wake_rounds {
                if r.is_multiple_of(10) {
                    progress.step(format!(
                        "wake: 1 chat, round {} of {}",
                        r + 1,
                        sizes.single_wake_rounds
                    ));
                }
                let per_round = floor_samples.div_ceil(sizes.single_wake_rounds);
                two_hops.sample(per_round, floors::IDLE_GAP).await?;
                let agent = &agents[r % agents.len()..][..1];
                let one = round(env, agent, 1, &format!("w{n}r{r}"), None).await?;
                total.rounds += 1;
                total.waiting_at_commit += one.waiting_at_commit;
                total.answered += one.answered;
                total.correct += one.correct;
                total.wrong.extend(one.wrong);
                total.wrong.truncate(QUOTED_ERRORS);
                latencies.extend(one.samples);
                event_latencies.extend(one.event_samples);
                after_event.extend(one.after_event_samples);
            }
            total.latency = Latency::of(latencies);
            total.event_latency = Latency::of(event_latencies);
            total.event_to_answer = Latency::of(after_event);
            let after = Some(env.services.metrics_text().await);
            total.gate_event_work_us = mean_between(&before, &after, EVENT_WORK_SECONDS);
            total.gate_answer_work_us = mean_between(&before, &after, ANSWER_WORK_SECONDS);
            cases.push(total);
        } else {
            let used = &agents[..agents.len().min(chats)];
            let mut case = round(env, used, chats, &format!("w{n}"), Some(progress)).await?;
            case.note = in_front_note(case.waiting_at_commit, chats);
            cases.push(case);
        }
    }
    Ok(cases)
}

/// Memory held per waiting chat, from the largest wake case; `gate_alone`
/// when the RSS read was of the gate processes alone.
pub fn memory(cases: &[WakeCase], gate_alone: bool) -> Memory {
    let Some(case) = cases.iter().max_by_key(|c| c.chats) else {
        return Memory::default();
    };
    let delta = match (case.rss_before_bytes, case.rss_waiting_bytes) {
        (Some(before), Some(waiting)) => waiting as i64 - before as i64,
        _ => 0,
    };
    Memory {
        chats: case.chats,
        waiting_in_gate: case.waiting_at_commit,
        rss_delta_bytes: delta,
        bytes_per_chat: delta as f64 / case.chats.max(1) as f64,
        note: if gate_alone {
            format!(
                "VmRSS delta of the gate processes while {} chats waited, over {} chats: an upper \
                 bound (it includes their NATS connections' buffers for the turns; the allocator \
                 may also keep freed memory)",
                case.chats, case.chats
            )
        } else {
            format!(
                "VmRSS delta of the whole process while {} chats waited, over {} chats: an upper \
                 bound (it includes the bench's own request futures, the chats' NATS inboxes and \
                 the services' buffers; the allocator may also keep freed memory)",
                case.chats, case.chats
            )
        },
        gate_alone,
    }
}

/// First turns of new chats on an agent whose discovery is complete, one at
/// a time; and, for the breakdown, the store read the gate makes for each.
pub async fn gate_ready(
    env: &Env,
    agents: &[BenchAgent],
    sizes: &Sizes,
) -> Result<(Latency, GateReady), BenchError> {
    let agent = &agents[0];
    // The agent's last wake round completed its run.
    let state = env.read(&agent.id).await?;
    let run = state.agent.map(|a| a.agent_run_id).unwrap_or_default();
    let tool = tool_of(&run);

    let mut reads = Vec::with_capacity(sizes.gate_ready_samples);
    for _ in 0..sizes.gate_ready_samples {
        let started = Instant::now();
        read_state(&env.store(), &agent.id)
            .await
            .map_err(|e| BenchError::new("store read", e))?;
        reads.push(started.elapsed());
    }

    let mut latencies = Vec::with_capacity(sizes.gate_ready_samples);
    let mut ready = GateReady::default();
    for i in 0..sizes.gate_ready_samples {
        let started = Instant::now();
        let reply = env
            .first_turn(format!("ready-chat-{i}"), agent.id.clone())
            .await;
        let elapsed = started.elapsed();
        match reply.and_then(|r| check(&r, &run, &tool)) {
            Ok(()) => {
                ready.correct += 1;
                latencies.push(elapsed);
            }
            Err(why) if ready.wrong.len() < QUOTED_ERRORS => ready.wrong.push(why),
            Err(_) => {}
        }
    }
    ready.asked = sizes.gate_ready_samples;
    ready.latency = Latency::of(latencies);
    Ok((Latency::of(reads), ready))
}

#[derive(Debug, Clone, Default)]
pub struct GateReady {
    pub asked: usize,
    pub correct: usize,
    pub wrong: Vec<String>,
    pub latency: Latency,
}

fn ready_in(state: &AgentState, run: &str) -> Option<SystemTime> {
    let agent_run = state.agent.as_ref().map(|a| a.agent_run_id.as_str());
    let snapshot = state.snapshot.as_ref()?;
    if agent_run != Some(run) || snapshot.agent_run_id != run || snapshot.phase() != Phase::Complete
    {
        return None;
    }
    let at = DateTime::<Utc>::try_from(snapshot.received_at?).ok()?;
    Some(SystemTime::from(at))
}

/// Where in the poller's period round `round` of `rounds` commits: one
/// phase at random within each of `rounds` equal slices of the period. A
/// poller's wait is the rest of its period, so the median of phases drawn
/// at random from the whole period would move by tens of milliseconds from
/// run to run with 20 rounds; one per slice, it is the period's half within
/// a slice's width, the same median without the draw's spread.
fn commit_phase(round: usize, rounds: usize, interval: Duration) -> Duration {
    let slice = interval / rounds.max(1) as u32;
    slice * (round % rounds.max(1)) as u32 + slice.mul_f64(rand::random::<f64>())
}

/// A peer system's waiter: read the store every `interval` until the run is
/// complete. A gate chat waits on the same commit, for the head-to-head ratio.
///
/// A commit after a long quiet spell finds every thread of the path parked
/// (the store's, NATS's, the gate's, the chat's), and waking them costs far
/// more on some machines than on others. So after each round the two-hop
/// floor is sampled once after the same idleness as that round's commit:
/// the wake's own shape in raw NATS, in the same minutes.
pub async fn polling(
    env: &Env,
    agents: &[BenchAgent],
    sizes: &Sizes,
    two_hops: &mut floors::TwoHops,
    progress: &Progress,
) -> Result<Polling, BenchError> {
    let interval = sizes.polling_interval;
    let mut polled = Vec::new();
    let mut woken = Vec::new();
    let mut raw = Vec::new();
    for r in 0..sizes.polling_rounds {
        progress.step(format!(
            "polling baseline: round {} of {}",
            r + 1,
            sizes.polling_rounds
        ));
        // Agents the wake rounds did not just use.
        let agent = &agents[agents.len() - 1 - r % agents.len()..][..1];
        let runs = new_pending_runs(env, agent).await?;
        let run = runs[0].clone();
        let baseline = env.services.gate_waiters().await;
        let chat = tokio::spawn(first_turn(
            env.client.clone(),
            env.subjects.gate_turn(super::env::BENCH_TENANT),
            format!("poll-chat-{r}"),
            agent[0].id.clone(),
        ));
        until_waiting(env, baseline, 1).await;

        let store = env.store();
        let agent_id = agent[0].id.clone();
        let poll_run = run.clone();
        let ticking = tokio::time::Instant::now();
        let poller = tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(ticking, interval);
            loop {
                tick.tick().await;
                let state = read_state(&store, &agent_id).await?;
                if ready_in(&state, &poll_run).is_some() {
                    return Ok::<_, String>(SystemTime::now());
                }
            }
        });
        // Both waiters are timed from the instant COMMIT returned, as the
        // wake rounds are (the event says when): the snapshot's received_at
        // is stamped before COMMIT and would add the commit's own time.
        let events = env
            .client
            .subscribe(env.subjects.discovery_changed(&agent[0].id))
            .await
            .step("subscribe to discovery events")?;
        ctxsync_runtime::nats::sync_with_server(&env.client)
            .await
            .step("subscribe to discovery events")?;
        let phase = commit_phase(r, sizes.polling_rounds, interval);
        tokio::time::sleep_until(ticking + phase).await;
        complete_runs(env, agent, &runs).await?;
        let wanted = HashMap::from([(agent[0].id.clone(), run.clone())]);
        let (commits, _) = collect_commits(events, wanted).await?;
        let commit = commits[&agent[0].id];

        let seen = poller
            .await
            .step("poller")?
            .map_err(|e| BenchError::new("poller", e))?;
        polled.push(since(commit, seen));
        let (reply, at) = chat.await.step("chat task")?;
        let reply = reply.map_err(|e| BenchError::new("polling round chat", e))?;
        check(&reply, &run, &tool_of(&run))
            .map_err(|e| BenchError::new("polling round chat", e))?;
        woken.push(since(commit, at));
        raw.push(two_hops.once(phase).await?);
    }
    Ok(Polling {
        rounds: sizes.polling_rounds,
        interval_ms: interval.as_millis() as u64,
        polling_latency: Latency::of(polled),
        wake_latency: Latency::of(woken),
        two_hops_same_idle: Latency::of(raw),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each round commits within its own slice of the period, so the
    /// rounds cover the period evenly and their median wait is its half.
    #[test]
    fn each_polling_round_commits_in_its_own_slice_of_the_period() {
        let interval = Duration::from_millis(500);
        let slice = Duration::from_millis(25);
        for round in 0..20 {
            let phase = commit_phase(round, 20, interval);
            let start = slice * round as u32;
            assert!(
                phase >= start && phase < start + slice,
                "round {round} commits at {phase:?}, outside [{start:?}, {:?})",
                start + slice
            );
        }
        assert!(
            commit_phase(0, 0, interval) < interval,
            "no rounds: no panic"
        );
    }
}
