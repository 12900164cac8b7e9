//! chat-gate's shutdown drain, against a real nats-server, Postgres and
//! snapshot-store: waiting first turns (over NATS, HTTP and in process) go on
//! within the shutdown grace, woken by the events as usual; the ones left at
//! the end of the grace are answered `shutting_down`; new turns go to other
//! replicas.

mod common;

use std::time::{Duration, SystemTime};

use common::*;
use ctxsync_proto::v1::*;
use ctxsync_runtime::rpc::{self, RpcError};
use gate_core::drain_window;

const AGENTS: usize = 5;

/// `AGENTS` agents whose current run is still discovering (PENDING).
async fn pending_agents(h: &Harness) -> Vec<String> {
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let agent = h.register(&format!("agent-{i}")).await;
        h.startup(&agent, RUN_A).await;
        h.push_ok(&agent, pending(RUN_A, 1, vec![])).await;
        agents.push(agent);
    }
    agents
}

/// How a first turn was answered, whichever way it was asked.
#[derive(Debug)]
struct Answered {
    agent: usize,
    via: &'static str,
    decision: String,
    tools: Vec<String>,
    summary: String,
    at: SystemTime,
}

enum Waiting {
    Nats(tokio::task::JoinHandle<(TurnReply, SystemTime)>),
    Http(tokio::task::JoinHandle<(serde_json::Value, SystemTime)>),
    InProcess(tokio::task::JoinHandle<(TurnReply, SystemTime)>),
}

impl Waiting {
    fn is_finished(&self) -> bool {
        match self {
            Self::Nats(t) | Self::InProcess(t) => t.is_finished(),
            Self::Http(t) => t.is_finished(),
        }
    }

    async fn answer(self, agent: usize) -> Answered {
        let from_reply = |via, (reply, at): (TurnReply, SystemTime)| {
            assert_eq!(reply.error, None, "the turn was refused");
            let p = reply.projection.clone().expect("projection");
            Answered {
                agent,
                via,
                decision: reply.decision().label().to_owned(),
                tools: tool_names(&reply),
                summary: p.summary,
                at,
            }
        };
        match self {
            Self::Nats(turn) => from_reply("nats", answer(turn).await),
            Self::InProcess(turn) => from_reply("in-process", answer(turn).await),
            Self::Http(turn) => {
                let (body, at) = tokio::time::timeout(TIMEOUT, turn)
                    .await
                    .expect("the HTTP turn answers in time")
                    .expect("the HTTP turn task does not panic");
                let tools = body["projection"]["servers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|s| s["tools"].as_array().unwrap().iter())
                    .map(|t| t["name"].as_str().unwrap().to_owned())
                    .collect();
                Answered {
                    agent,
                    via: "http",
                    decision: GateDecision::from_str_name(body["decision"].as_str().unwrap())
                        .expect("a decision")
                        .label()
                        .to_owned(),
                    tools,
                    summary: body["projection"]["summary"].as_str().unwrap().to_owned(),
                    at,
                }
            }
        }
    }
}

/// Ten first turns on `agents`: four over NATS, four over HTTP, two in process.
fn ten_first_turns(h: &Harness, agents: &[String]) -> Vec<(usize, Waiting)> {
    (0..10)
        .map(|i| {
            let agent = i % agents.len();
            let chat = format!("chat-{i}");
            let turn = match i % 5 {
                0 | 1 => Waiting::Nats(h.spawn_turn(&chat, &agents[agent])),
                2 | 3 => Waiting::Http(h.spawn_http_turn(&chat, &agents[agent])),
                _ => Waiting::InProcess(h.spawn_turn_in_process(&chat, &agents[agent])),
            };
            (agent, turn)
        })
        .collect()
}

/// Signals shutdown and joins the gate in the background; returns when the
/// signal was given and the join's task (which yields when join returned).
fn shut_down(h: &mut Harness) -> (SystemTime, tokio::task::JoinHandle<SystemTime>) {
    let running = h.gate.take().expect("gate running");
    let signalled = SystemTime::now();
    h.gate_shutdown.cancel();
    let joined = tokio::spawn(async move {
        running.join().await;
        SystemTime::now()
    });
    (signalled, joined)
}

fn since(earlier: SystemTime, later: SystemTime) -> Duration {
    later.duration_since(earlier).unwrap_or_default()
}

/// Re-asks until the draining gate's subscription is gone: a turn then
/// finds no responder (nothing else serves the subject yet).
async fn until_no_responders(h: &Harness, agent: &str) {
    let (client, subject) = (
        h.client.clone(),
        h.subjects.gate_turn(testkit::chat::TEST_TENANT),
    );
    let probe = TurnRequest {
        chat_id: "probe".into(),
        agent_id: agent.into(),
        first_turn: false,
        tenant: testkit::chat::TEST_TENANT.into(),
    };
    until("the draining gate takes no new turns".into(), move || {
        let (client, subject, probe) = (client.clone(), subject.clone(), probe.clone());
        async move {
            let reply: Result<TurnReply, _> =
                rpc::request(&client, subject, &probe, None, TIMEOUT).await;
            matches!(reply, Err(RpcError::NoResponders { .. }))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeps_waiting_first_turns_until_discovery_completes_and_takes_no_new_turns() {
    let grace = Duration::from_secs(20);
    let mut h = Harness::spawn_with(|c| c.common.shutdown_grace = grace).await;
    let agents = pending_agents(&h).await;
    let gate = h.gate().clone();
    let turns = ten_first_turns(&h, &agents);
    h.until_waiting(10).await;

    let (signalled, joined) = shut_down(&mut h);

    // The replica stops taking turns, and keeps the ones it holds.
    until_no_responders(&h, &agents[0]).await;
    assert_eq!(gate.waiters_held(), 10, "no wait was cut short");
    assert!(turns.iter().all(|(_, turn)| !turn.is_finished()));
    let started_before = gate.attempts_started();

    // New turns go to another replica.
    let replica = h.spawn_replica(|_| {}).await;
    let late: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, agent)| (i, h.spawn_turn(&format!("late-{i}"), agent)))
        .collect();
    let other = replica.gate().clone();
    until("the other replica holds the new turns".into(), move || {
        let held = other.waiters_held();
        async move { held == AGENTS }
    })
    .await;
    assert_eq!(gate.waiters_held(), 10);
    assert_eq!(gate.attempts_started(), started_before, "none came here");

    // Discovery completes within the grace: the draining gate still applies
    // the events, and every waiting turn is woken.
    for (i, agent) in agents.iter().enumerate() {
        h.push_ok(
            agent,
            complete(RUN_A, 2, vec![server("s", &[&format!("t{i}")])]),
        )
        .await;
    }
    let mut answered = Vec::new();
    for (agent, turn) in turns {
        answered.push(turn.answer(agent).await);
    }
    for a in &answered {
        assert_eq!(a.decision, "ready", "{a:?}");
        assert_eq!(a.tools, [format!("s__t{}", a.agent)], "{a:?}");
    }
    let vias = |via| answered.iter().filter(|a| a.via == via).count();
    assert_eq!((vias("nats"), vias("http"), vias("in-process")), (4, 4, 2));
    for (i, turn) in late {
        let (reply, _) = answer(turn).await;
        assert_eq!(reply.decision(), GateDecision::Ready);
        assert_eq!(tool_names(&reply), [format!("s__t{i}")]);
    }

    let joined = tokio::time::timeout(TIMEOUT, joined)
        .await
        .expect("the gate stops")
        .unwrap();
    let took = since(signalled, joined);
    println!("join returned {} ms after the signal", took.as_millis());
    assert!(took < grace, "the drain ended with its waits ({took:?})");
    assert_eq!(gate.attempts_held(), 0);
    replica.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_left_at_the_end_of_the_grace_are_answered_shutting_down_before_join_returns() {
    let grace = Duration::from_secs(2);
    let mut h = Harness::spawn_with(|c| c.common.shutdown_grace = grace).await;
    let agents = pending_agents(&h).await;
    let gate = h.gate().clone();
    let turns = ten_first_turns(&h, &agents);
    h.until_waiting(10).await;
    let started_before = gate.attempts_started();

    let (signalled, joined) = shut_down(&mut h);

    // A first turn that would start a new wait now is told at once to ask elsewhere.
    let at_once = gate
        .turn(TurnRequest {
            chat_id: "after-the-signal".into(),
            agent_id: agents[0].clone(),
            first_turn: true,
            tenant: testkit::chat::TEST_TENANT.into(),
        })
        .await;
    assert_eq!(at_once.decision(), GateDecision::ShuttingDown);
    assert!(
        since(signalled, SystemTime::now()) < drain_window(grace),
        "answered before the drain ended"
    );
    assert_eq!(gate.attempts_started(), started_before, "no new wait");

    // Discovery never completes. Every answer leaves before join returns
    // (join drains the NATS connection and closes the HTTP listener after
    // them): each arrives, within the grace.
    let joined = tokio::time::timeout(TIMEOUT, joined)
        .await
        .expect("the gate stops")
        .unwrap();
    let mut answered = Vec::new();
    for (agent, turn) in turns {
        answered.push(turn.answer(agent).await);
    }
    for a in &answered {
        assert_eq!(a.decision, "shutting_down", "{a:?}");
        assert!(
            a.summary
                .starts_with("This chat-gate replica is shutting down"),
            "{a:?}"
        );
        let after = since(signalled, a.at);
        // Held through the drain window, not cut short at the signal.
        assert!(after >= drain_window(grace), "{a:?} after {after:?}");
        assert!(after < grace, "{a:?} after {after:?}");
    }
    let took = since(signalled, joined);
    println!("join returned {} ms after the signal", took.as_millis());
    assert!(took <= grace, "join within the grace ({took:?})");
    assert_eq!(
        gate.attempts_held(),
        0,
        "a wait cut short is not remembered as timed out"
    );
    assert_eq!(gate.waiters_held(), 0);
}

/// A first turn the server routed to the gate before its stop began is
/// answered, even when it reaches the gate's connection after the stop
/// began (a rolling restart under load): the subscription's drain alone
/// would drop what is still on its way, and the chat would wait for its
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_routed_here_before_a_stop_is_answered_though_it_arrives_late() {
    use futures::StreamExt as _;
    use prost::Message as _;
    let mut h =
        Harness::spawn_behind_proxy(|c| c.common.shutdown_grace = Duration::from_secs(5)).await;
    let agent = h
        .agent_reporting(complete(RUN_A, 1, vec![server("ws", &["t"])]))
        .await;
    let gate = h.gate().clone();
    // The gate knows the agent (its first read and watch are behind it).
    let warm = h.turn("chat-warm", &agent, true).await;
    assert_eq!(warm.decision(), GateDecision::Ready);

    let inbox = h.client.new_inbox();
    let mut answers = h.client.subscribe(inbox.clone()).await.unwrap();
    ctxsync_runtime::nats::sync_with_server(&h.client)
        .await
        .unwrap();
    // From now on what the server sends the gate arrives 300 ms late.
    h.proxy
        .as_ref()
        .expect("behind the late proxy")
        .delay_to_client(Duration::from_millis(300));
    h.client
        .publish_with_reply(
            h.subjects.gate_turn(testkit::chat::TEST_TENANT),
            inbox,
            first_turn_request("chat-late", &agent)
                .encode_to_vec()
                .into(),
        )
        .await
        .unwrap();
    // The server has read the turn, so it has routed it to the gate (the
    // subject's only responder): it is on its way when the stop begins.
    ctxsync_runtime::nats::sync_with_server(&h.client)
        .await
        .unwrap();
    let (_, joined) = shut_down(&mut h);
    // Other traffic on the gate's connection (a busy gate always has some:
    // here reads for turns in process, on agents nobody registered) turns
    // its handler, which forgets a drained subscription at once: what
    // reaches the connection after that would be lost.
    let busy = tokio::spawn(async move {
        for i in 0u32.. {
            let (gate, unknown) = (gate.clone(), format!("00000000-0000-4000-8000-{i:012}"));
            tokio::spawn(async move { gate.turn(first_turn_request("chat-busy", &unknown)).await });
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });

    let answer = tokio::time::timeout(TIMEOUT, answers.next())
        .await
        .expect("the turn routed before the stop is answered")
        .expect("subscription open");
    let reply = TurnReply::decode(answer.payload).unwrap();
    assert_eq!(reply.error, None, "the turn was refused");
    assert_eq!(reply.decision(), GateDecision::Ready);
    assert_eq!(tool_names(&reply), ["ws__t"]);
    tokio::time::timeout(TIMEOUT, joined)
        .await
        .expect("the gate stops within its grace")
        .expect("the join task does not panic");
    busy.abort();
}
