//! The floors every ratio is taken against: raw NATS publish→subscribe, raw
//! NATS request/reply, raw NATS fan-out (one publish answered by ten
//! replies), and a raw Postgres transaction of the same shape as a push
//! commit (no service code in the loop).

use std::time::{Duration, Instant};

use futures::StreamExt;
use sqlx::PgPool;
use uuid::Uuid;

use crate::env::Env;
use crate::stats::Latency;
use crate::steps::{BenchError, Sizes, Step};

const WARMUP: usize = 50;
/// Idleness before each publish of the idle pub→sub floor: about a push's
/// transaction, which precedes each wake.
pub const IDLE_GAP: Duration = Duration::from_millis(2);
const PAYLOAD: &[u8] = &[b'x'; 128];

#[derive(Debug, Clone, Default)]
pub struct Floors {
    pub nats_pub_sub: Latency,
    /// `nats_pub_sub` with [`IDLE_GAP`] of idleness before each publish:
    /// threads (ours and the server's) park as they do before a wake.
    pub nats_pub_sub_idle: Latency,
    /// Two hops after [`IDLE_GAP`] of idleness (publisher → relay → a third
    /// connection): the shape of a 1-chat wake (the store's event to the
    /// gate, the gate's answer to the chat). On a cluster, on the nodes the
    /// wake's hops use (`two_hops_placement`).
    pub nats_two_hops_idle: Latency,
    /// Where the two hops ran, on a cluster (see [`WakePlacement::describe`]).
    pub two_hops_placement: Option<String>,
    pub nats_request_reply: Latency,
    pub postgres: PostgresFloor,
    /// snapshot-store's read API round trip (what the gate does once per wake), for the breakdown.
    pub store_read: Latency,
    pub nats_fan_out: FanOutFloor,
}

/// The fan-out wake in raw NATS: `publishes` publishes (the agents'
/// commits), each answered by `replies_per_publish` replies (the agent's
/// waiting chats) from a responder on another connection to a third one;
/// each reply is timed from its publish. The publishes go out at the
/// instants the fan-out wake case's pushes committed (`span` from the first
/// to the last), so the floor carries the wake's own load over time.
#[derive(Debug, Clone, Default)]
pub struct FanOutFloor {
    pub publishes: usize,
    pub replies_per_publish: usize,
    pub span: Duration,
    pub latency: Latency,
}

/// Replies per publish of the fan-out floor: the chats per agent of the
/// largest wake case.
pub const FAN_OUT_REPLIES: usize = 10;

#[derive(Debug, Clone, Default)]
pub struct PostgresFloor {
    pub single_client: Latency,
    /// For the breakdown: from the snapshot upsert (where snapshot-store takes
    /// `clock_timestamp()` as the commit time) to COMMIT returning, 1 client.
    pub upsert_to_commit: Latency,
    pub clients: usize,
    pub transactions: u64,
    pub per_second: f64,
}

async fn connect(env: &Env, name: &str) -> Result<async_nats::Client, BenchError> {
    Ok(ctxsync_runtime::nats::connect(&env.nats_url, name)
        .await
        .step("nats")?
        .client)
}

/// A subscription on `subject` that `client`'s server has confirmed.
async fn subscribed(
    client: &async_nats::Client,
    subject: &str,
) -> Result<async_nats::Subscriber, BenchError> {
    let subscriber = client
        .subscribe(subject.to_owned())
        .await
        .step("subscribe")?;
    ctxsync_runtime::nats::sync_with_server(client)
        .await
        .step("subscribe")?;
    Ok(subscriber)
}

/// One message at a time from one connection to a subscriber on another,
/// each publish after `idle` of idleness (none: back to back).
pub async fn pub_sub(env: &Env, samples: usize, idle: Duration) -> Result<Latency, BenchError> {
    let publisher = connect(env, "bench-floor-pub").await?;
    let subscriber = connect(env, "bench-floor-sub").await?;
    let subject = env.subjects.bench_floor("pubsub");
    let mut messages = subscribed(&subscriber, &subject).await?;
    primed(&publisher, &subject, &mut messages, "pub→sub").await?;
    let latencies = timed_publishes(
        &publisher,
        &subject,
        &mut messages,
        samples,
        idle,
        "pub→sub",
    )
    .await?;
    Ok(Latency::of(latencies))
}

/// The two-hop floor, kept open so that its samples can be taken between
/// the 1-chat wake's rounds: a floor sampled minutes apart from what it is
/// compared with moves with whatever else the machine did meanwhile.
///
/// Each path publishes (after `idle` of idleness) to a relay on a second
/// connection, which publishes what it got to a receiver on a third. On a
/// cluster there is one path per pair of a store replica's node and a gate
/// replica's, taken in turn (a wake's store and gate replicas are each one
/// of theirs at random), the relay on the gate's node and the receiver on
/// the chat's.
pub struct TwoHops {
    paths: Vec<HopPath>,
    next: usize,
    samples: Vec<Duration>,
}

struct HopPath {
    publisher: async_nats::Client,
    first: String,
    arrivals: async_nats::Subscriber,
    forward: tokio::task::JoinHandle<()>,
}

impl Drop for HopPath {
    fn drop(&mut self) {
        self.forward.abort();
    }
}

impl TwoHops {
    /// Opens the paths (on one server, one; on a cluster, placed as the
    /// wake's hops are) and warms them up.
    pub async fn open(env: &Env, placement: Option<&WakePlacement>) -> Result<Self, BenchError> {
        let mut paths = Vec::new();
        match placement {
            None => {
                let publisher = connect(env, "bench-floor-hop-pub").await?;
                let relay = connect(env, "bench-floor-hop-relay").await?;
                let receiver = connect(env, "bench-floor-hop-sub").await?;
                paths.push(HopPath::open(env, 0, publisher, relay, &receiver).await?);
            }
            Some(placement) => {
                for &store in &placement.stores {
                    for &gate in &placement.gates {
                        let publisher = placement.connect_on(store, "bench-floor-hop-pub").await?;
                        let relay = placement.connect_on(gate, "bench-floor-hop-relay").await?;
                        let receiver = placement
                            .connect_on(placement.chat, "bench-floor-hop-sub")
                            .await?;
                        let path =
                            HopPath::open(env, paths.len(), publisher, relay, &receiver).await?;
                        paths.push(path);
                    }
                }
            }
        }
        let mut two_hops = Self {
            paths,
            next: 0,
            samples: Vec::new(),
        };
        for _ in 0..WARMUP {
            two_hops.once(IDLE_GAP).await?;
        }
        Ok(two_hops)
    }

    /// Takes `count` samples, each after `idle` of idleness, on the paths in
    /// turn.
    pub async fn sample(&mut self, count: usize, idle: Duration) -> Result<(), BenchError> {
        for _ in 0..count {
            let took = self.once(idle).await?;
            self.samples.push(took);
        }
        Ok(())
    }

    /// One sample after `idle` of idleness, on the next path, kept apart
    /// from this floor's own samples.
    pub async fn once(&mut self, idle: Duration) -> Result<Duration, BenchError> {
        let n = self.next % self.paths.len();
        self.next += 1;
        self.paths[n].once(idle).await
    }

    pub fn taken(&self) -> usize {
        self.samples.len()
    }

    /// The samples taken so far.
    pub fn latency(&self) -> Latency {
        Latency::of(self.samples.clone())
    }
}

impl HopPath {
    async fn open(
        env: &Env,
        n: usize,
        publisher: async_nats::Client,
        relay: async_nats::Client,
        receiver: &async_nats::Client,
    ) -> Result<Self, BenchError> {
        let first = env.subjects.bench_floor(&format!("hop1-{n}"));
        let second = env.subjects.bench_floor(&format!("hop2-{n}"));
        let mut relayed = relay.subscribe(first.clone()).await.step("subscribe")?;
        let mut arrivals = receiver.subscribe(second.clone()).await.step("subscribe")?;
        for client in [&relay, receiver] {
            ctxsync_runtime::nats::sync_with_server(client)
                .await
                .step("subscribe")?;
        }
        let forward = tokio::spawn(async move {
            while let Some(message) = relayed.next().await {
                let _ = relay.publish(second.clone(), message.payload).await;
            }
        });
        // On a cluster the subscriptions reach the other nodes a moment later:
        // the first message that comes all the way through says they have.
        primed(&publisher, &first, &mut arrivals, "two hops").await?;
        Ok(Self {
            publisher,
            first,
            arrivals,
            forward,
        })
    }

    async fn once(&mut self, idle: Duration) -> Result<Duration, BenchError> {
        timed_publish(
            &self.publisher,
            &self.first,
            &mut self.arrivals,
            idle,
            "two hops",
        )
        .await
    }
}

/// Publishes on `subject` until one arrives on `arrivals` (at most 5 s).
/// On a cluster a subscription reaches the other nodes a moment after its
/// own node confirmed it: until then a publish there is dropped unseen.
async fn primed(
    publisher: &async_nats::Client,
    subject: &str,
    arrivals: &mut async_nats::Subscriber,
    what: &str,
) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        publisher
            .publish(subject.to_owned(), PAYLOAD.into())
            .await
            .step("publish")?;
        let waited = tokio::time::timeout(Duration::from_millis(100), arrivals.next()).await;
        if waited.is_ok_and(|arrived| arrived.is_some()) {
            // Late copies of earlier tries, if any, go before the timing.
            while let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(20), arrivals.next()).await
            {}
            return Ok(());
        }
    }
    Err(BenchError::new(what, "no message came through within 5 s"))
}

/// Where the 1-chat wake's hops run on a cluster: the nodes of the store's
/// replicas (one of which commits and publishes the event), of the gate's
/// (one of which holds the waiting turn and answers it) and of the bench's
/// own connection (the chat's).
#[derive(Debug, Clone)]
pub struct WakePlacement {
    urls: Vec<String>,
    pub stores: Vec<usize>,
    pub gates: Vec<usize>,
    pub chat: usize,
}

impl WakePlacement {
    /// Read from the cluster's nodes; `None` on one server.
    pub async fn of(env: &Env) -> Result<Option<Self>, BenchError> {
        let Some(cluster) = env.cluster() else {
            return Ok(None);
        };
        let nodes = |name: &'static str| async move {
            cluster
                .nodes_of(name)
                .await
                .map_err(|e| BenchError::new("where the wake's connections are", e))
        };
        let stores = nodes("snapshot-store").await?;
        let gates = nodes("chat-gate").await?;
        let chat = nodes("ctxsync-bench").await?;
        match (stores.is_empty(), gates.is_empty(), chat.as_slice()) {
            (false, false, [chat]) => Ok(Some(Self {
                urls: cluster.urls().to_vec(),
                stores,
                gates,
                chat: *chat,
            })),
            _ => Err(BenchError::new(
                "where the wake's connections are",
                format!("stores on {stores:?}, gates on {gates:?}, the bench on {chat:?}"),
            )),
        }
    }

    /// A connection to the cluster's node `node`.
    async fn connect_on(&self, node: usize, name: &str) -> Result<async_nats::Client, BenchError> {
        Ok(ctxsync_runtime::nats::connect(&self.urls[node], name)
            .await
            .step("nats")?
            .client)
    }

    /// e.g. `store on n0 n1 → gate on n1 n2 → chat on n2`.
    pub fn describe(&self) -> String {
        let nodes = |of: &[usize]| {
            of.iter()
                .map(|n| format!("n{n}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!(
            "store on {} → gate on {} → chat on n{}",
            nodes(&self.stores),
            nodes(&self.gates),
            self.chat
        )
    }
}

/// `WARMUP + samples` publishes on `subject`, each after `idle` of
/// idleness and timed until it arrives on `arrivals`: the timed ones.
async fn timed_publishes(
    publisher: &async_nats::Client,
    subject: &str,
    arrivals: &mut async_nats::Subscriber,
    samples: usize,
    idle: Duration,
    what: &str,
) -> Result<Vec<Duration>, BenchError> {
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..WARMUP + samples {
        let took = timed_publish(publisher, subject, arrivals, idle, what).await?;
        if i >= WARMUP {
            latencies.push(took);
        }
    }
    Ok(latencies)
}

/// One publish on `subject` after `idle` of idleness, timed until it
/// arrives on `arrivals`.
async fn timed_publish(
    publisher: &async_nats::Client,
    subject: &str,
    arrivals: &mut async_nats::Subscriber,
    idle: Duration,
    what: &str,
) -> Result<Duration, BenchError> {
    if !idle.is_zero() {
        tokio::time::sleep(idle).await;
    }
    let started = Instant::now();
    publisher
        .publish(subject.to_owned(), PAYLOAD.into())
        .await
        .step("publish")?;
    tokio::time::timeout(Duration::from_secs(5), arrivals.next())
        .await
        .map_err(|_| BenchError::new(what, "a message did not arrive within 5 s"))?
        .ok_or_else(|| BenchError::new(what, "subscription closed"))?;
    Ok(started.elapsed())
}

/// One request at a time to a responder on another connection: the shape
/// of a turn the gate answers at once. On a cluster the requester is on the
/// chat's node and there is a responder on each gate replica's node, asked
/// in turn (a turn goes to one of the gate's replicas at random); left to
/// the cluster's own placement, the floor moved with where its two
/// connections happened to land, not with anything the gate does.
pub async fn request_reply(
    env: &Env,
    samples: usize,
    placement: Option<&WakePlacement>,
) -> Result<Latency, BenchError> {
    let (requester, responders) = match placement {
        None => (
            connect(env, "bench-floor-req").await?,
            vec![connect(env, "bench-floor-rep").await?],
        ),
        Some(placement) => {
            let mut responders = Vec::with_capacity(placement.gates.len());
            for &gate in &placement.gates {
                responders.push(placement.connect_on(gate, "bench-floor-rep").await?);
            }
            let requester = placement
                .connect_on(placement.chat, "bench-floor-req")
                .await?;
            (requester, responders)
        }
    };
    let mut subjects = Vec::with_capacity(responders.len());
    let mut echoes = tokio::task::JoinSet::new();
    for (n, responder) in responders.into_iter().enumerate() {
        let subject = env.subjects.bench_floor(&format!("echo-{n}"));
        let mut requests = subscribed(&responder, &subject).await?;
        echoes.spawn(async move {
            while let Some(message) = requests.next().await {
                if let Some(reply) = message.reply {
                    let _ = responder.publish(reply, message.payload).await;
                }
            }
        });
        // On a cluster the responder's subscription reaches the requester's
        // node a moment later: until then a request finds no responder.
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Err(error) = requester.request(subject.clone(), PAYLOAD.into()).await {
            if Instant::now() > deadline {
                return Err(BenchError::new(
                    "request/reply",
                    format!("no answer within 5 s: {error}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        subjects.push(subject);
    }
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..WARMUP + samples {
        let subject = subjects[i % subjects.len()].clone();
        let started = Instant::now();
        requester
            .request(subject, PAYLOAD.into())
            .await
            .step("request/reply")?;
        if i >= WARMUP {
            latencies.push(started.elapsed());
        }
    }
    echoes.abort_all();
    Ok(Latency::of(latencies))
}

/// The fan-out floor of a wake case with `FAN_OUT_REPLIES` chats per agent:
/// one publish per agent, each at the offset its commit had from the case's
/// first commit (`commit_offsets`). Measured against a burst from several
/// publishers instead, the floor's p50 moved 2.3–13.2 ms between runs while
/// the wake it divides stayed at 3.3–6.4 ms: that floor timed a queue of
/// its own, not what the wake's commits put on NATS.
pub async fn fan_out(env: &Env, commit_offsets: &[Duration]) -> Result<FanOutFloor, BenchError> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    let publishes = commit_offsets.len();
    let publisher = connect(env, "bench-floor-fan-pub").await?;
    let responder = connect(env, "bench-floor-fan-rep").await?;
    let receiver = connect(env, "bench-floor-fan-chats").await?;
    let subject = env.subjects.bench_floor("fanout");
    let replies_subject = env.subjects.bench_floor("fanout-replies");
    let mut commits = responder
        .subscribe(subject.clone())
        .await
        .step("subscribe")?;
    let mut replies = receiver
        .subscribe(replies_subject.clone())
        .await
        .step("subscribe")?;
    for client in [&responder, &receiver] {
        ctxsync_runtime::nats::sync_with_server(client)
            .await
            .step("subscribe")?;
    }
    // Both legs reach across the cluster before the timing: a probe's
    // payload names no publish, so a late copy of it is not counted.
    primed(&publisher, &subject, &mut commits, "fan-out").await?;
    primed(&responder, &replies_subject, &mut replies, "fan-out").await?;
    // The responder answers each publish with ten replies, each naming it.
    let fan = tokio::spawn(async move {
        while let Some(message) = commits.next().await {
            for _ in 0..FAN_OUT_REPLIES {
                let _ = responder
                    .publish(replies_subject.clone(), message.payload.clone())
                    .await;
            }
            let _ = responder.flush().await;
        }
    });
    let sent: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let wanted = publishes * FAN_OUT_REPLIES;
    let collect = tokio::spawn({
        let sent = sent.clone();
        async move {
            let mut latencies = Vec::with_capacity(wanted);
            while latencies.len() < wanted {
                let Some(message) = replies.next().await else {
                    break;
                };
                let arrived = Instant::now();
                let Some(id) = message
                    .payload
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_be_bytes)
                else {
                    continue;
                };
                let at = sent.lock().expect("sent times").get(&id).copied();
                if let Some(at) = at {
                    latencies.push(arrived.saturating_duration_since(at));
                }
            }
            latencies
        }
    });
    // Each reply is timed from when its publish went out, so a publish
    // the timer wakes late for does not count the lateness.
    let start = tokio::time::Instant::now();
    for (id, offset) in commit_offsets.iter().enumerate() {
        tokio::time::sleep_until(start + *offset).await;
        let mut payload = (id as u64).to_be_bytes().to_vec();
        payload.extend_from_slice(PAYLOAD);
        sent.lock()
            .expect("sent times")
            .insert(id as u64, Instant::now());
        publisher
            .publish(subject.clone(), payload.into())
            .await
            .step("fan-out publish")?;
        publisher.flush().await.step("fan-out publish")?;
    }
    let latencies = tokio::time::timeout(Duration::from_secs(60), collect)
        .await
        .map_err(|_| BenchError::new("fan-out", "the replies did not arrive within 60 s"))?
        .step("fan-out collector")?;
    fan.abort();
    if latencies.len() < wanted {
        return Err(BenchError::new(
            "fan-out",
            format!("{} of {wanted} replies arrived", latencies.len()),
        ));
    }
    Ok(FanOutFloor {
        publishes,
        replies_per_publish: FAN_OUT_REPLIES,
        span: commit_offsets.last().copied().unwrap_or_default(),
        latency: Latency::of(latencies),
    })
}

/// The raw floor writes the store's own tables (`snapshot.*`, made by
/// snapshot-store's migrations when it started on the bench database), for
/// agents of a tenant no service is asked about, so it pays for the same
/// constraints and indexes as a push.
const RAW_TENANT: &str = "bench-raw";

/// The rows of one raw push: the same resources a bench push sends.
struct RawRows {
    sources: Vec<String>,
    positions: Vec<i32>,
    kinds: Vec<i16>,
    statuses: Vec<i16>,
    errors: Vec<String>,
    warnings: Vec<String>,
    bodies: Vec<Vec<u8>>,
}

fn raw_rows(counter: u64) -> RawRows {
    use prost::Message;
    let resources = crate::push::resources(counter);
    RawRows {
        sources: resources.iter().map(|r| r.source.clone()).collect(),
        positions: (0..resources.len() as i32).collect(),
        kinds: resources.iter().map(|r| r.kind as i16).collect(),
        statuses: resources.iter().map(|r| r.status as i16).collect(),
        errors: resources.iter().map(|r| r.error.clone()).collect(),
        warnings: resources.iter().map(|r| r.warning.clone()).collect(),
        bodies: resources
            .into_iter()
            .map(|r| {
                ctxsync_proto::v1::ContextResource {
                    body: r.body,
                    ..Default::default()
                }
                .encode_to_vec()
            })
            .collect(),
    }
}

/// The statements of snapshot-store's push transaction, on its tables:
/// lock the agent row raising its revision (its own statement, returning the
/// row), read the snapshot, upsert it, replace the resources (DELETE + UNNEST
/// insert), commit.
async fn raw_push(
    pool: &PgPool,
    agent_id: Uuid,
    version: i64,
    rows: &RawRows,
) -> Result<Duration, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let run_id: String = sqlx::query_scalar(
        "UPDATE snapshot.agents SET revision = revision + 1 WHERE agent_id = $1
         RETURNING agent_run_id, tenant, workspace, name, agent_version,
                   created_at, startup_at, revision",
    )
    .bind(agent_id)
    .fetch_one(&mut *tx)
    .await?;
    let _snapshot = sqlx::query(
        "SELECT agent_run_id AS snapshot_run_id, version, phase, hash
         FROM snapshot.snapshots WHERE agent_id = $1",
    )
    .bind(agent_id)
    .fetch_optional(&mut *tx)
    .await?;
    let _received_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "INSERT INTO snapshot.snapshots
             (agent_id, agent_run_id, version, phase, hash, context_config, received_at)
         VALUES ($1, $2, $3, 'complete', $4, $5, clock_timestamp())
         ON CONFLICT (agent_id) DO UPDATE SET
             agent_run_id = EXCLUDED.agent_run_id, version = EXCLUDED.version,
             phase = EXCLUDED.phase, hash = EXCLUDED.hash,
             context_config = EXCLUDED.context_config, received_at = EXCLUDED.received_at
         RETURNING received_at",
    )
    .bind(agent_id)
    .bind(&run_id)
    .bind(version)
    .bind(format!("{version:064x}"))
    .bind(&[0u8; 64][..])
    .fetch_one(&mut *tx)
    .await?;
    let upserted = Instant::now();
    sqlx::query("DELETE FROM snapshot.resources WHERE agent_id = $1")
        .bind(agent_id)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO snapshot.resources
             (agent_id, source, position, kind, status, error, warning, body)
         SELECT $1, * FROM UNNEST($2::text[], $3::int4[], $4::int2[], $5::int2[],
                                  $6::text[], $7::text[], $8::bytea[])",
    )
    .bind(agent_id)
    .bind(&rows.sources)
    .bind(&rows.positions)
    .bind(&rows.kinds)
    .bind(&rows.statuses)
    .bind(&rows.errors)
    .bind(&rows.warnings)
    .bind(&rows.bodies)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(upserted.elapsed())
}

pub async fn postgres(env: &Env, sizes: &Sizes) -> Result<PostgresFloor, BenchError> {
    let pool = &env.pool;
    let clients = sizes.throughput_clients;
    let agents: Vec<Uuid> = (0..clients).map(|_| Uuid::new_v4()).collect();
    for agent in &agents {
        // A digest no token has: two random UUIDs.
        let token_sha256 = [&agent.as_bytes()[..], &Uuid::new_v4().as_bytes()[..]].concat();
        sqlx::query(
            "INSERT INTO snapshot.agents (agent_id, tenant, workspace, name, token_sha256, agent_run_id)
             VALUES ($1, $2, $2, $1::text, $3, 'raw')",
        )
        .bind(agent)
        .bind(RAW_TENANT)
        .bind(token_sha256)
        .execute(pool)
        .await
        .step("raw postgres: agents")?;
    }

    let single_samples = (sizes.floor_samples / 3).max(50);
    let mut latencies = Vec::with_capacity(single_samples);
    let mut tails = Vec::with_capacity(single_samples);
    for i in 0..WARMUP + single_samples {
        let rows = raw_rows(i as u64);
        let started = Instant::now();
        let tail = raw_push(pool, agents[0], i as i64, &rows)
            .await
            .step("raw postgres transaction")?;
        if i >= WARMUP {
            latencies.push(started.elapsed());
            tails.push(tail);
        }
    }

    let window = sizes.throughput_window;
    let started = Instant::now();
    let workers = agents.iter().enumerate().map(|(n, &agent)| {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut done = 0u64;
            let mut version = 1_000_000;
            while started.elapsed() < window {
                version += 1;
                let rows = raw_rows((n as u64) << 32 | version as u64);
                raw_push(&pool, agent, version, &rows).await?;
                done += 1;
            }
            Ok::<u64, sqlx::Error>(done)
        })
    });
    let mut transactions = 0;
    for worker in futures::future::join_all(workers).await {
        transactions += worker
            .step("raw postgres worker")?
            .step("raw postgres transaction")?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(PostgresFloor {
        single_client: Latency::of(latencies),
        upsert_to_commit: Latency::of(tails),
        clients,
        transactions,
        per_second: transactions as f64 / elapsed,
    })
}
