//! Replicas whose wall clocks disagree by minutes. Found by the chaos run:
//! a request carried its deadline as a time of day, so a store whose clock
//! ran ahead took every request for late and dropped it (and rolled back
//! every push), and a gate ahead dropped every NATS turn. A request now
//! carries its budget, which each server reckons on its own monotonic clock.

use std::time::Duration;

use ctxsync_proto::v1::mcp_discovery::Phase;
use faults::{Cluster, Summary, all_ready, metrics_of, tagged_push, url_of, with_clock_skew};
use testkit::agent::{FakeAgent, stored_agents};
use testkit::chat::{http_turn, nats_turn};
use testkit::{NatsServer, Process, TestDatabase};

/// How far the first log line's time is from the true one.
fn skew_of(process: &Process) -> chrono::TimeDelta {
    let log = process.log();
    let stamp = log
        .lines()
        .find_map(|line| line.split_whitespace().next())
        .and_then(|word| chrono::DateTime::parse_from_rfc3339(word).ok())
        .unwrap_or_else(|| panic!("{} logged no timestamped line:\n{log}", process.name()));
    stamp.with_timezone(&chrono::Utc) - chrono::Utc::now()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_whose_wall_clocks_disagree_by_minutes_answer_every_request() {
    testkit::init_logs();
    let faketime = faults::libfaketime()
        .expect("libfaketime is missing: run tests/setup.sh (Debian: apt-get install faketime)");
    let nats = NatsServer::start();
    let db = TestDatabase::create().await;
    let cluster = Cluster::new(nats.url(), db.url());
    // The store and the gate 10 minutes ahead of this test, agent-ingest 10
    // minutes behind: the store sees each of ingest's requests sent 20
    // minutes ago, and the gate each of this test's 10 minutes ago.
    let mut store = with_clock_skew(cluster.store("store"), &faketime, "+10m").spawn();
    let mut ingest = with_clock_skew(
        cluster.ingest().env("CTXSYNC_STORE_TIMEOUT", "2s"),
        &faketime,
        "-10m",
    )
    .spawn();
    let mut gate = with_clock_skew(cluster.gate("gate"), &faketime, "+10m").spawn();
    all_ready(&mut [&mut store, &mut ingest, &mut gate]).await;
    for (process, minutes) in [(&store, 10), (&ingest, -10), (&gate, 10)] {
        let skew = skew_of(process);
        assert!(
            (skew.num_seconds() - minutes * 60).abs() < 60,
            "{} runs {minutes} min off: its log says {skew}",
            process.name()
        );
    }

    let connection = cluster.nats("faults-test").await;
    let api = cluster.store_client(&connection.client);
    api.create_test_tenant_key().await;
    let mut agent = FakeAgent::register(&api, &url_of(&ingest), "skewed").await;
    let mut accepted = 0;
    let startup = agent.startup().await.answer.clone();
    assert!(startup.is_accepted(), "startup: {startup:?}");
    accepted += 1;
    for (version, phase) in [(1, Phase::Pending), (2, Phase::Complete)] {
        let push = tagged_push(agent.run_id(), version, phase);
        let answer = agent.push(&push).await.answer.clone();
        assert!(answer.is_accepted(), "push {version}: {answer:?}");
        accepted += 1;
    }

    let http = reqwest::Client::new();
    let within = Duration::from_secs(10);
    let over_nats = nats_turn(
        &connection.client,
        &cluster.subjects,
        "chat-nats",
        agent.agent_id(),
        true,
        within,
    )
    .await;
    let over_http = http_turn(
        &http,
        faults::addr_of(&gate),
        "chat-http",
        agent.agent_id(),
        true,
        within,
    )
    .await;
    for answer in [&over_nats, &over_http] {
        assert!(answer.is("ready"), "{answer:?}");
        assert_eq!(answer.agent_run_id, agent.run_id(), "{answer:?}");
        assert!(
            answer.elapsed < Duration::from_secs(1),
            "answered at once, not after a store read timed out: {answer:?}"
        );
    }

    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let stored = stored_agents(&pool, &[agent.agent_id().to_owned()])
        .await
        .unwrap();
    let stored = &stored[agent.agent_id()];
    let snapshot = stored.snapshot.as_ref().expect("a snapshot is stored");
    assert_eq!(
        (
            snapshot.agent_run_id.as_str(),
            snapshot.version,
            snapshot.phase.as_str()
        ),
        (agent.run_id(), 2, "complete"),
        "{stored:?}"
    );
    let mut expired = 0.0;
    for process in [&store, &gate] {
        expired += metrics_of(&http, process)
            .await
            .sum("ctxsync_rpc_expired_total", &[]);
    }
    assert_eq!(expired, 0.0, "no request was taken for late");
    Summary::new("clock_skew")
        .field("store_skew", "+10m")
        .field("ingest_skew", "-10m")
        .field("gate_skew", "+10m")
        .field("accepted", accepted)
        .field("turns_ready", 2)
        .field("expired", expired)
        .emit();
}
