//! The bench's results: JSON for machines (a `BenchReport` message), a table
//! for people, and every ratio against its target (README, Benchmark).

use std::fmt::Write as _;

use ctxsync_proto::v1;

use crate::catalog_prep::CatalogPreparation;
use crate::env::Environment;
use crate::floors::Floors;
use crate::mcp_path::McpPath;
use crate::push::PushThroughput;
use crate::stats::{Latency, ratio};
use crate::wake::{GateReady, Memory, Polling, WakeCase};

/// Metric families issue 7 asks every service to expose (as named by the services).
const EXPECTED_METRICS: &[(&str, &str)] = &[
    (
        "ctxsync_store_pushes_total",
        "pushes accepted and dropped by reason",
    ),
    ("ctxsync_ingest_request_bytes", "request sizes"),
    (
        "ctxsync_store_push_transaction_seconds",
        "store transaction durations",
    ),
    ("ctxsync_gate_waits_total", "gate waits by outcome"),
    (
        "ctxsync_gate_wait_seconds",
        "gate wait durations by outcome",
    ),
    ("ctxsync_gate_wake_seconds", "wake latency"),
    ("ctxsync_gate_waiters", "waiters held"),
    (
        "ctxsync_catalog_handshake_seconds",
        "catalog handshake durations",
    ),
    ("ctxsync_catalog_preparations_total", "catalog preparations"),
];

#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub ratio: f64,
    pub target: String,
    pub met: bool,
    /// The floor divided by, with its value.
    pub floor: String,
    /// False for an earlier ratio kept for comparison (see `BenchTarget`).
    pub like_for_like: bool,
}

/// The memory each waiting chat may hold in the gate.
const BYTES_PER_WAITING_CHAT: f64 = 4096.0;

#[derive(Debug, Clone, Default)]
pub struct MetricsSeen {
    /// Every `ctxsync_*` family the process's /metrics rendered after the run.
    pub families: Vec<String>,
    /// Expected families that were not rendered.
    pub missing: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Report {
    pub mode: &'static str,
    pub environment: Environment,
    pub floors: Floors,
    pub wake: Vec<WakeCase>,
    pub gate_ready: GateReady,
    pub push: PushThroughput,
    pub catalog: CatalogPreparation,
    pub polling: Polling,
    pub memory: Memory,
    pub mcp: McpPath,
    pub targets: Vec<Target>,
    /// Every chat of every section got the right answer.
    pub all_answers_correct: bool,
    pub metrics: MetricsSeen,
}

/// The `ctxsync_*` metric families in the services' `/metrics` text.
pub fn metric_families(text: &str) -> MetricsSeen {
    let mut families: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| name.starts_with("ctxsync_"))
        .map(str::to_owned)
        .collect();
    families.sort();
    families.dedup();
    let missing = EXPECTED_METRICS
        .iter()
        .filter(|(name, _)| !families.iter().any(|f| f == name))
        .map(|(name, what)| format!("{name} ({what})"))
        .collect();
    MetricsSeen { families, missing }
}

fn at_most(name: String, ratio: f64, limit: f64, floor: String) -> Target {
    Target {
        name,
        ratio,
        target: format!("≤ {limit}×"),
        met: ratio > 0.0 && ratio <= limit,
        floor,
        like_for_like: true,
    }
}

fn at_least(name: String, ratio: f64, limit: f64, floor: String) -> Target {
    Target {
        name,
        ratio,
        target: format!("≥ {limit}×"),
        met: ratio >= limit,
        floor,
        like_for_like: true,
    }
}

/// An earlier ratio, kept for comparison: its floor is not of the measured
/// figure's shape.
fn for_comparison(target: Target) -> Target {
    Target {
        like_for_like: false,
        ..target
    }
}

/// A floor as the targets name it: what it is and its p50.
fn floor_p50(what: &str, latency: &Latency) -> String {
    format!("{what} p50 {}", time(latency.p50_us))
}

/// A count of chats, agents or samples as its 32-bit field (a JSON number).
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Latency {
    fn to_proto(&self) -> v1::BenchLatency {
        v1::BenchLatency {
            samples: count(self.samples),
            p50_us: self.p50_us,
            p99_us: self.p99_us,
            max_us: self.max_us,
            mean_us: self.mean_us,
        }
    }
}

fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn time(us: f64) -> String {
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "ok" } else { "MISS" }
}

impl Report {
    pub fn new(quick: bool, environment: Environment) -> Self {
        Self {
            mode: if quick { "quick" } else { "full" },
            environment,
            floors: Floors::default(),
            wake: Vec::new(),
            gate_ready: GateReady::default(),
            push: PushThroughput::default(),
            catalog: CatalogPreparation::default(),
            polling: Polling::default(),
            memory: Memory::default(),
            mcp: McpPath::default(),
            targets: Vec::new(),
            all_answers_correct: false,
            metrics: MetricsSeen::default(),
        }
    }

    /// Computes every ratio against its target.
    pub fn evaluate(&mut self) {
        let f = &self.floors;
        let mut targets = Vec::new();
        // A 1-chat wake is two hops after a quiet spell (the store's event
        // to the gate, the gate's answer to the chat): its floor is two
        // hops measured after the same idleness.
        if let Some(single) = self.wake.iter().find(|c| c.chats == 1)
            && f.nats_two_hops_idle.samples > 0
        {
            targets.push(at_most(
                "wake p50, 1 chat / raw NATS two hops after idleness p50".into(),
                ratio(single.latency.p50_us, f.nats_two_hops_idle.p50_us),
                1.5,
                floor_p50(
                    &format!(
                        "raw NATS 2 hops, {} ms idle before each{},",
                        crate::floors::IDLE_GAP.as_millis(),
                        f.two_hops_placement
                            .as_ref()
                            .map(|placed| format!(" ({placed})"))
                            .unwrap_or_default()
                    ),
                    &f.nats_two_hops_idle,
                ),
            ));
        }
        // Fan-out: a case of as many chats per agent as the floor's replies
        // per publish is compared with the floor of the same shape.
        let fan = &f.nats_fan_out;
        if fan.latency.samples > 0
            && let Some(case) = self
                .wake
                .iter()
                .filter(|c| c.chats > 1 && c.agents > 0)
                .find(|c| c.chats / c.agents == fan.replies_per_publish)
        {
            targets.push(at_most(
                format!(
                    "wake p50, {} chats on {} agents / raw fan-out (1 → {}) p50",
                    thousands(case.chats),
                    thousands(case.agents),
                    fan.replies_per_publish
                ),
                ratio(case.latency.p50_us, fan.latency.p50_us),
                1.0,
                floor_p50(
                    &format!(
                        "raw NATS 1 → {} fan-out at the wake's commit instants,",
                        fan.replies_per_publish
                    ),
                    &fan.latency,
                ),
            ));
        }
        targets.push(at_most(
            "gate answer when ready p50 / raw request/reply p50".into(),
            ratio(self.gate_ready.latency.p50_us, f.nats_request_reply.p50_us),
            2.0,
            floor_p50("raw NATS request/reply", &f.nats_request_reply),
        ));
        targets.push(at_least(
            "push throughput via agent-ingest / raw Postgres (8 clients)".into(),
            ratio(self.push.per_second, f.postgres.per_second),
            0.5,
            format!(
                "raw Postgres push-shaped transactions, {} clients, {:.0} tx/s",
                f.postgres.clients, f.postgres.per_second
            ),
        ));
        if self.catalog.skipped.is_none() {
            targets.push(at_least(
                "catalog live preparation / warm preparation p50".into(),
                ratio(self.catalog.live_ms * 1000.0, self.catalog.warm.p50_us),
                1000.0,
                format!(
                    "warm preparation (from memory) p50 {}",
                    time(self.catalog.warm.p50_us)
                ),
            ));
        }
        if self.mcp.skipped.is_none() {
            // Each call after the same idleness: back to back, the direct
            // call finds its upstream hot, while through /mcp the upstream
            // idles for the rest of the path between calls.
            targets.push(at_most(
                "warm tools/call via /mcp / direct p50, 2 ms idle before each".into(),
                ratio(
                    self.mcp.call_through_catalog_idle.p50_us,
                    self.mcp.call_direct_idle.p50_us,
                ),
                1.5,
                format!(
                    "{}; any HTTP hop here, a bare forwarder after the same idleness: {:.2}× direct",
                    floor_p50(
                        "server-everything echo on a warm stdio connection, 2 ms idle before each, taken in turn with the /mcp calls,",
                        &self.mcp.call_direct_idle,
                    ),
                    ratio(
                        self.mcp.call_forwarder_idle.p50_us,
                        self.mcp.call_direct_idle.p50_us
                    )
                ),
            ));
        }
        targets.push(at_least(
            "polling wake p50 / our wake p50 (same commits)".into(),
            ratio(
                self.polling.polling_latency.p50_us,
                self.polling.wake_latency.p50_us,
            ),
            300.0,
            floor_p50("our wake on the same commits", &self.polling.wake_latency),
        ));
        // Only the gate processes' own memory is compared (deployed mode);
        // in one process the bench's chats are counted too.
        if self.memory.gate_alone && self.memory.chats > 0 {
            targets.push(at_most(
                "memory per waiting chat (gate processes) / 4 KiB".into(),
                self.memory.bytes_per_chat / BYTES_PER_WAITING_CHAT,
                1.0,
                format!(
                    "{:.0} bytes per chat over {} chats",
                    self.memory.bytes_per_chat,
                    thousands(self.memory.chats)
                ),
            ));
        }
        // The earlier wake ratios: a back-to-back floor under wakes that
        // follow idleness (and concurrent wakes under a one-at-a-time floor).
        let pub_sub = f.nats_pub_sub.p50_us;
        for case in &self.wake {
            targets.push(for_comparison(at_most(
                format!(
                    "wake p50, {} chat{} / raw pub→sub p50",
                    thousands(case.chats),
                    if case.chats == 1 { "" } else { "s" }
                ),
                ratio(case.latency.p50_us, pub_sub),
                3.0,
                floor_p50("raw NATS pub→sub, back to back,", &f.nats_pub_sub),
            )));
        }
        if let Some(single) = self.wake.iter().find(|c| c.chats == 1)
            && f.nats_pub_sub_idle.samples > 0
        {
            // Both hops after idleness, as if the gate's answer found NATS
            // and the chat as quiet as the commit found them.
            targets.push(for_comparison(at_most(
                "wake p50, 1 chat / 2 × raw pub→sub after idleness p50".into(),
                ratio(single.latency.p50_us, 2.0 * f.nats_pub_sub_idle.p50_us),
                1.5,
                format!("2 × {}", time(f.nats_pub_sub_idle.p50_us)),
            )));
        }
        if let Some(single) = self.wake.iter().find(|c| c.chats == 1) {
            let bound = 2.0 * pub_sub + f.store_read.p50_us;
            targets.push(for_comparison(at_most(
                "wake p50, 1 chat / (2× raw pub→sub + one store read) p50".into(),
                ratio(single.latency.p50_us, bound),
                1.0,
                format!(
                    "2 × {} + store read {}",
                    time(pub_sub),
                    time(f.store_read.p50_us)
                ),
            )));
        }
        if self.mcp.skipped.is_none() {
            targets.push(for_comparison(at_most(
                "warm tools/call via /mcp / direct p50, back to back".into(),
                ratio(
                    self.mcp.call_through_catalog.p50_us,
                    self.mcp.call_direct.p50_us,
                ),
                1.5,
                floor_p50(
                    "server-everything echo on a warm stdio connection, back to back,",
                    &self.mcp.call_direct,
                ),
            )));
        }
        self.targets = targets;
        self.all_answers_correct = !self.wake.is_empty()
            && self
                .wake
                .iter()
                .all(|c| c.correct == c.chats * c.rounds && c.wrong.is_empty())
            && self.gate_ready.correct == self.gate_ready.asked
            && self.polling.wake_latency.samples == self.polling.rounds;
    }

    /// The report as its proto message, in the one JSON convention.
    pub fn render_json(&self) -> String {
        serde_json::to_string_pretty(&self.to_proto()).expect("the report serializes")
    }

    pub fn to_proto(&self) -> v1::BenchReport {
        let e = &self.environment;
        let f = &self.floors;
        let g = &self.gate_ready;
        let p = &self.push;
        let c = &self.catalog;
        let pl = &self.polling;
        let m = &self.memory;
        v1::BenchReport {
            mode: self.mode.to_owned(),
            environment: Some(v1::BenchEnvironment {
                build: e.build.to_owned(),
                cores: count(e.cores),
                nats: e.nats.clone(),
                postgres: e.postgres.clone(),
                subject_prefix: e.subject_prefix.clone(),
                database: e.database.clone(),
                services: e.services.clone(),
            }),
            floors: Some(v1::BenchFloors {
                nats_pub_sub: Some(f.nats_pub_sub.to_proto()),
                nats_pub_sub_idle: Some(f.nats_pub_sub_idle.to_proto()),
                nats_two_hops_idle: Some(f.nats_two_hops_idle.to_proto()),
                two_hops_placement: f.two_hops_placement.clone(),
                idle_gap_ms: count(crate::floors::IDLE_GAP.as_millis() as usize),
                nats_request_reply: Some(f.nats_request_reply.to_proto()),
                postgres: Some(v1::BenchPostgresFloor {
                    single_client: Some(f.postgres.single_client.to_proto()),
                    upsert_to_commit: Some(f.postgres.upsert_to_commit.to_proto()),
                    clients: count(f.postgres.clients),
                    transactions: f.postgres.transactions,
                    per_second: f.postgres.per_second,
                }),
                store_read: Some(f.store_read.to_proto()),
                nats_fan_out: Some(v1::BenchFanOutFloor {
                    publishes: count(f.nats_fan_out.publishes),
                    replies_per_publish: count(f.nats_fan_out.replies_per_publish),
                    latency: Some(f.nats_fan_out.latency.to_proto()),
                    span_us: f.nats_fan_out.span.as_micros() as u64,
                }),
            }),
            wake: self
                .wake
                .iter()
                .map(|case| v1::BenchWakeCase {
                    chats: count(case.chats),
                    agents: count(case.agents),
                    rounds: count(case.rounds),
                    waiting_at_commit: count(case.waiting_at_commit),
                    answered: count(case.answered),
                    correct: count(case.correct),
                    wrong: case.wrong.clone(),
                    latency: Some(case.latency.to_proto()),
                    event_latency: Some(case.event_latency.to_proto()),
                    event_to_answer: Some(case.event_to_answer.to_proto()),
                    rss_before_bytes: case.rss_before_bytes,
                    rss_waiting_bytes: case.rss_waiting_bytes,
                    gate_watches: count(case.gate_watches),
                    note: case.note.clone(),
                    gate_event_work_us: case.gate_event_work_us,
                    gate_answer_work_us: case.gate_answer_work_us,
                })
                .collect(),
            gate_ready: Some(v1::BenchGateReady {
                asked: count(g.asked),
                correct: count(g.correct),
                wrong: g.wrong.clone(),
                latency: Some(g.latency.to_proto()),
            }),
            push: Some(v1::BenchPush {
                agents: count(p.agents),
                pushes: p.pushes,
                per_second: p.per_second,
                latency: Some(p.latency.to_proto()),
            }),
            catalog: Some(v1::BenchCatalog {
                skipped: c.skipped.clone(),
                servers: c.servers.clone(),
                note: c.note.clone(),
                live_ms: c.live_ms,
                live_service_ms: c.live_service_ms,
                max_concurrent_starts: count(c.max_concurrent_starts),
                warm: Some(c.warm.to_proto()),
                warm_all_pinned: c.warm_all_pinned,
            }),
            polling: Some(v1::BenchPolling {
                rounds: count(pl.rounds),
                interval_ms: pl.interval_ms,
                polling_latency: Some(pl.polling_latency.to_proto()),
                wake_latency: Some(pl.wake_latency.to_proto()),
                two_hops_same_idle: Some(pl.two_hops_same_idle.to_proto()),
            }),
            memory: Some(v1::BenchMemory {
                chats: count(m.chats),
                waiting_in_gate: count(m.waiting_in_gate),
                rss_delta_bytes: m.rss_delta_bytes,
                bytes_per_chat: m.bytes_per_chat,
                note: m.note.clone(),
                gate_alone: m.gate_alone,
            }),
            targets: self
                .targets
                .iter()
                .map(|t| v1::BenchTarget {
                    name: t.name.clone(),
                    ratio: t.ratio,
                    target: t.target.clone(),
                    met: t.met,
                    floor: t.floor.clone(),
                    like_for_like: t.like_for_like,
                })
                .collect(),
            all_answers_correct: self.all_answers_correct,
            metrics: Some(v1::BenchMetrics {
                families: self.metrics.families.clone(),
                missing: self.metrics.missing.clone(),
            }),
            mcp: Some(v1::BenchMcp {
                skipped: self.mcp.skipped.clone(),
                call_through_catalog: Some(self.mcp.call_through_catalog.to_proto()),
                call_direct: Some(self.mcp.call_direct.to_proto()),
                call_through_catalog_idle: Some(self.mcp.call_through_catalog_idle.to_proto()),
                call_direct_idle: Some(self.mcp.call_direct_idle.to_proto()),
                call_plain_http: Some(self.mcp.call_plain_http.to_proto()),
                call_stateless: Some(self.mcp.call_stateless.to_proto()),
                call_forwarder: Some(self.mcp.call_forwarder.to_proto()),
                call_forwarder_idle: Some(self.mcp.call_forwarder_idle.to_proto()),
                call_plain_http_idle: Some(self.mcp.call_plain_http_idle.to_proto()),
                catalog_work_us: self.mcp.catalog_work_us,
                catalog_call_us: self.mcp.catalog_call_us,
                catalog_own_us: self.mcp.catalog_own_us(),
                list_clients: count(self.mcp.list_clients),
                lists: self.mcp.lists,
                lists_per_second: self.mcp.lists_per_second,
                list: Some(self.mcp.list.to_proto()),
                first_list: Some(self.mcp.first_list.to_proto()),
                tools: count(self.mcp.tools),
            }),
        }
    }

    /// The MCP endpoint's lines.
    fn render_mcp(&self, out: &mut String) {
        let mcp = &self.mcp;
        if let Some(why) = &mcp.skipped {
            let _ = writeln!(out, "  mcp: skipped: {why}");
            return;
        }
        let row = |out: &mut String, label: &str, l: &Latency, extra: &str| {
            let _ = writeln!(
                out,
                "  {label:<46} {:>10} {:>10}   n={:<6} {extra}",
                time(l.p50_us),
                time(l.p99_us),
                l.samples
            );
        };
        let _ = writeln!(
            out,
            "\n{:<48} {:>10} {:>10}",
            "mcp: the catalog's /mcp, warm (server-everything)", "p50", "p99"
        );
        row(
            out,
            "tools/call echo through /mcp (2025 session)",
            &mcp.call_through_catalog,
            &format!(
                "{:.2}× direct",
                ratio(mcp.call_through_catalog.p50_us, mcp.call_direct.p50_us)
            ),
        );
        row(
            out,
            "  the same, 2 ms idle before each",
            &mcp.call_through_catalog_idle,
            &format!(
                "{:.2}× direct after the same idleness",
                ratio(
                    mcp.call_through_catalog_idle.p50_us,
                    mcp.call_direct_idle.p50_us
                )
            ),
        );
        row(
            out,
            "  the same through /mcp, plain HTTP client",
            &mcp.call_plain_http,
            &format!(
                "{:.2}× direct",
                ratio(mcp.call_plain_http.p50_us, mcp.call_direct.p50_us)
            ),
        );
        row(
            out,
            "    the same, 2 ms idle before each",
            &mcp.call_plain_http_idle,
            &format!(
                "{:.2}× direct, {:.2}× the bare forwarder (same client)",
                ratio(mcp.call_plain_http_idle.p50_us, mcp.call_direct_idle.p50_us),
                ratio(
                    mcp.call_plain_http_idle.p50_us,
                    mcp.call_forwarder_idle.p50_us
                )
            ),
        );
        row(
            out,
            "  the same through /mcp, 2026-07-28 client",
            &mcp.call_stateless,
            &format!(
                "{:.2}× direct",
                ratio(mcp.call_stateless.p50_us, mcp.call_direct.p50_us)
            ),
        );
        row(
            out,
            "  floor: the same call direct (stdio, warm)",
            &mcp.call_direct,
            "",
        );
        row(
            out,
            "  floor: the same, 2 ms idle before each",
            &mcp.call_direct_idle,
            "",
        );
        row(
            out,
            "  any HTTP hop: a bare forwarder, plain client",
            &mcp.call_forwarder,
            &format!(
                "{:.2}× direct (no key, session or bookkeeping)",
                ratio(mcp.call_forwarder.p50_us, mcp.call_direct.p50_us)
            ),
        );
        row(
            out,
            "    the same, 2 ms idle before each",
            &mcp.call_forwarder_idle,
            &format!(
                "{:.2}× direct after the same idleness",
                ratio(mcp.call_forwarder_idle.p50_us, mcp.call_direct_idle.p50_us)
            ),
        );
        let _ = writeln!(
            out,
            "  {:<46} {:>10}            (the client's HTTP and the catalog, less direct)",
            "  through /mcp less direct, p50",
            time(mcp.catalog_own_us().max(0.0))
        );
        if let Some(work) = mcp.catalog_work_us {
            let _ = writeln!(
                out,
                "  {:<46} {:>10}            (its /metrics: arrival to answer, less the upstream)",
                "  the catalog's own work per call, mean",
                time(work)
            );
        }
        if let Some(call) = mcp.catalog_call_us {
            let _ = writeln!(
                out,
                "  {:<46} {:>10}            (its /metrics: session lookup and the upstream's round trip)",
                "  the call inside the catalog, mean",
                time(call)
            );
        }
        row(
            out,
            &format!("tools/list, {} sessions at once", mcp.list_clients),
            &mcp.list,
            &format!(
                "{:.0} lists/s of {} tools (plain HTTP JSON-RPC client)",
                mcp.lists_per_second, mcp.tools
            ),
        );
        row(
            out,
            "new client: initialize → tools/list",
            &mcp.first_list,
            "rmcp client",
        );
    }

    /// The table for people.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let e = &self.environment;
        let _ = writeln!(
            out,
            "ctxsync-bench ({} mode, {} build, {} cores)",
            self.mode, e.build, e.cores
        );
        let _ = writeln!(out, "  services  {}", e.services);
        let _ = writeln!(out, "  nats      {}", e.nats);
        let _ = writeln!(out, "  postgres  {}", e.postgres);
        let _ = writeln!(
            out,
            "  database {} and subject prefix {} (fresh, dropped afterwards)",
            e.database, e.subject_prefix
        );
        let row = |out: &mut String, label: &str, l: &Latency, extra: &str| {
            let _ = writeln!(
                out,
                "  {label:<46} {:>10} {:>10}   n={:<6} {extra}",
                time(l.p50_us),
                time(l.p99_us),
                l.samples
            );
        };

        let _ = writeln!(out, "\n{:<48} {:>10} {:>10}", "floors", "p50", "p99");
        let f = &self.floors;
        row(&mut out, "raw NATS publish→subscribe", &f.nats_pub_sub, "");
        row(
            &mut out,
            &format!(
                "  the same, {} ms idle before each",
                crate::floors::IDLE_GAP.as_millis()
            ),
            &f.nats_pub_sub_idle,
            "",
        );
        row(
            &mut out,
            &format!(
                "raw NATS two hops, {} ms idle before each",
                crate::floors::IDLE_GAP.as_millis()
            ),
            &f.nats_two_hops_idle,
            f.two_hops_placement.as_deref().unwrap_or_default(),
        );
        let fan = &f.nats_fan_out;
        row(
            &mut out,
            &format!(
                "raw NATS fan-out, 1 publish → {} replies",
                fan.replies_per_publish
            ),
            &fan.latency,
            &format!(
                "{} publishes at the wake's commit instants, over {:.0} ms",
                fan.publishes,
                fan.span.as_secs_f64() * 1e3
            ),
        );
        row(
            &mut out,
            "raw NATS request/reply",
            &f.nats_request_reply,
            if f.two_hops_placement.is_some() {
                "from the chat's node to each gate replica's node in turn"
            } else {
                ""
            },
        );
        row(
            &mut out,
            "raw Postgres push-shaped transaction, 1 client",
            &f.postgres.single_client,
            "",
        );
        row(
            &mut out,
            "  of which snapshot upsert → COMMIT returned",
            &f.postgres.upsert_to_commit,
            "",
        );
        let _ = writeln!(
            out,
            "  {:<46} {:>10.0} tx/s ({} transactions)",
            format!("raw Postgres, {} clients", f.postgres.clients),
            f.postgres.per_second,
            f.postgres.transactions
        );
        row(
            &mut out,
            "snapshot-store read over NATS (breakdown)",
            &f.store_read,
            "",
        );

        let _ = writeln!(
            out,
            "\n{:<48} {:>10} {:>10}",
            "wake: store commit → waiting chat's answer", "p50", "p99"
        );
        for case in &self.wake {
            let label = if case.chats == 1 {
                format!("1 chat ({} rounds)", case.rounds)
            } else {
                format!(
                    "{} chats over {} agents",
                    thousands(case.chats),
                    thousands(case.agents)
                )
            };
            let total = case.chats * case.rounds;
            let mut extra = format!(
                "{}/{} correct, {:.1}× pub→sub",
                case.correct,
                total,
                ratio(case.latency.p50_us, f.nats_pub_sub.p50_us)
            );
            // A wake follows a quiet spell: also against the floor measured so.
            if case.chats == 1 && f.nats_two_hops_idle.samples > 0 {
                let _ = write!(
                    extra,
                    " ({:.2}× two idle hops)",
                    ratio(case.latency.p50_us, f.nats_two_hops_idle.p50_us)
                );
            }
            row(&mut out, &label, &case.latency, &extra);
            row(
                &mut out,
                "  of which commit → event at a subscriber",
                &case.event_latency,
                "",
            );
            row(
                &mut out,
                "  and event → chat's answer",
                &case.event_to_answer,
                "",
            );
            for (label, work, what) in [
                (
                    "    the gate applying the event, mean",
                    case.gate_event_work_us,
                    "its /metrics: taken off the subscription to the wait woken",
                ),
                (
                    "    the gate building the answer, mean",
                    case.gate_answer_work_us,
                    "its /metrics: the wait's end to the turn's answer built",
                ),
            ] {
                if let Some(work) = work {
                    let _ = writeln!(out, "  {label:<46} {:>10}            ({what})", time(work));
                }
            }
            for wrong in &case.wrong {
                let _ = writeln!(out, "    WRONG {wrong}");
            }
            if let Some(note) = &case.note {
                let _ = writeln!(out, "    note: {note}");
            }
        }

        let _ = writeln!(out);
        let g = &self.gate_ready;
        row(
            &mut out,
            "gate answer, discovery already complete",
            &g.latency,
            &format!(
                "{}/{} correct, {:.1}× request/reply",
                g.correct,
                g.asked,
                ratio(g.latency.p50_us, f.nats_request_reply.p50_us)
            ),
        );
        for wrong in &g.wrong {
            let _ = writeln!(out, "    WRONG {wrong}");
        }
        let p = &self.push;
        row(
            &mut out,
            &format!("push via agent-ingest HTTP, {} agents", p.agents),
            &p.latency,
            &format!(
                "{:.0} pushes/s, {:.2}× raw Postgres",
                p.per_second,
                ratio(p.per_second, f.postgres.per_second)
            ),
        );
        let c = &self.catalog;
        match &c.skipped {
            Some(why) => {
                let _ = writeln!(out, "  catalog: skipped: {why}");
            }
            None => {
                let _ = writeln!(
                    out,
                    "  {:<46} {:>10}            (service-side {} ms, {} starts at once)",
                    format!("catalog, {} real servers, live", c.servers.len()),
                    time(c.live_ms * 1000.0),
                    c.live_service_ms,
                    c.max_concurrent_starts
                );
                row(
                    &mut out,
                    &format!("catalog, {} servers, from memory", c.servers.len()),
                    &c.warm,
                    &format!(
                        "{}, {:.0}× faster",
                        if c.warm_all_pinned {
                            "all pinned"
                        } else {
                            "NOT all pinned"
                        },
                        ratio(c.live_ms * 1000.0, c.warm.p50_us)
                    ),
                );
                if let Some(note) = &c.note {
                    let _ = writeln!(out, "    note: {note}");
                }
            }
        }
        let pl = &self.polling;
        row(
            &mut out,
            &format!("polling waiter, every {} ms", pl.interval_ms),
            &pl.polling_latency,
            "",
        );
        row(
            &mut out,
            "our wake on the same commits",
            &pl.wake_latency,
            &format!(
                "{:.0}× faster than polling",
                ratio(pl.polling_latency.p50_us, pl.wake_latency.p50_us)
            ),
        );
        if pl.two_hops_same_idle.samples > 0 {
            row(
                &mut out,
                "  raw NATS two hops after the same idleness",
                &pl.two_hops_same_idle,
                &format!(
                    "our wake {:.2}× it; polling {:.0}× it",
                    ratio(pl.wake_latency.p50_us, pl.two_hops_same_idle.p50_us),
                    ratio(pl.polling_latency.p50_us, pl.two_hops_same_idle.p50_us)
                ),
            );
        }
        let m = &self.memory;
        let _ = writeln!(
            out,
            "  {:<46} {:>10.0} bytes  ({} chats, {} held by the gate, RSS +{:.1} MiB of {}; an upper bound)",
            "memory per waiting chat",
            m.bytes_per_chat,
            thousands(m.chats),
            thousands(m.waiting_in_gate),
            m.rss_delta_bytes as f64 / (1024.0 * 1024.0),
            if m.gate_alone {
                "the gate processes"
            } else {
                "the whole process, chats included"
            }
        );
        self.render_mcp(&mut out);

        let _ = writeln!(
            out,
            "\ntargets (README, Benchmark), each against a floor of its shape"
        );
        // Two decimals near the targets' small limits (0.49 must not print as 0.5).
        let shown = |ratio: f64| {
            if ratio < 10.0 {
                format!("{ratio:.2}")
            } else {
                format!("{ratio:.1}")
            }
        };
        for t in self.targets.iter().filter(|t| t.like_for_like) {
            let _ = writeln!(
                out,
                "  {:<62} {:>9}×  target {:<8} {}\n      floor: {}",
                t.name,
                shown(t.ratio),
                t.target,
                verdict(t.met),
                t.floor
            );
        }
        let _ = writeln!(
            out,
            "\nfor comparison, other floors: NOT like-for-like (back to back, or both hops idle), no verdict"
        );
        for t in self.targets.iter().filter(|t| !t.like_for_like) {
            let _ = writeln!(
                out,
                "  {:<62} {:>9}×  (once read against {})\n      floor: {}",
                t.name,
                shown(t.ratio),
                t.target,
                t.floor
            );
        }
        let _ = writeln!(
            out,
            "  every chat answered READY with its agent's current tools: {}",
            if self.all_answers_correct {
                "yes"
            } else {
                "NO"
            }
        );
        if !self.metrics.missing.is_empty() {
            let _ = writeln!(
                out,
                "\nmetrics not exposed: {}",
                self.metrics.missing.join(", ")
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;

    use super::*;
    use crate::wake::WakeCase;

    fn report() -> Report {
        let mut report = Report::new(
            true,
            Environment {
                build: "debug",
                cores: 2,
                nats: "nats://127.0.0.1:4222 (given)".into(),
                postgres: "postgres://postgres@127.0.0.1:5432/postgres (given)".into(),
                subject_prefix: "bench0123abcd".into(),
                database: "bench-db-0123abcd".into(),
                services: "single: every service in the bench's process".into(),
            },
        );
        let micros =
            |us: &[u64]| Latency::of(us.iter().map(|&u| Duration::from_micros(u)).collect());
        report.floors.nats_pub_sub = micros(&[100, 120, 300]);
        report.floors.nats_request_reply = micros(&[150]);
        report.floors.nats_two_hops_idle = micros(&[200]);
        report.floors.postgres.clients = 8;
        report.floors.postgres.transactions = 5_000_000_000;
        report.floors.postgres.per_second = 1234.5;
        let mut case = WakeCase::default();
        (case.chats, case.agents, case.rounds) = (1, 1, 3);
        (case.answered, case.correct) = (3, 3);
        case.latency = micros(&[200, 250, 400]);
        case.rss_before_bytes = Some(10 << 20);
        report.wake = vec![case];
        report.push.pushes = 42;
        report.push.per_second = 700.0;
        report.catalog.skipped = Some("no reference MCP server installed".into());
        report.mcp.skipped = Some("no reference MCP server installed".into());
        report.memory.rss_delta_bytes = -4096;
        report.evaluate();
        report
    }

    #[test]
    fn json_is_a_bench_report_in_the_one_json_convention() {
        let report = report();
        let text = report.render_json();
        let json: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["mode"], "quick");
        // Counts of 32 bits and doubles are numbers; 64-bit integers are strings.
        assert_eq!(json["environment"]["cores"], 2);
        assert_eq!(json["floors"]["nats_pub_sub"]["samples"], 3);
        assert_eq!(json["floors"]["nats_pub_sub"]["p50_us"], 120.0);
        assert_eq!(json["floors"]["postgres"]["per_second"], 1234.5);
        assert_eq!(json["floors"]["postgres"]["transactions"], "5000000000");
        assert_eq!(json["push"]["pushes"], "42");
        assert_eq!(json["memory"]["rss_delta_bytes"], "-4096");
        assert_eq!(json["wake"][0]["rss_before_bytes"], "10485760");
        // Every field is present with its default; an unset optional is left out.
        assert_eq!(json["floors"]["store_read"]["samples"], 0);
        assert_eq!(json["wake"][0]["wrong"], Value::Array(Vec::new()));
        assert!(json["wake"][0].get("rss_waiting_bytes").is_none(), "{json}");
        assert!(json["wake"][0].get("note").is_none(), "{json}");
        assert_eq!(
            json["catalog"]["skipped"],
            "no reference MCP server installed"
        );
        // The 1-chat wake against two idle hops, the gate answer, push and
        // polling; then the two earlier wake ratios, kept for comparison.
        assert_eq!(json["targets"].as_array().map(Vec::len), Some(6));
        assert_eq!(json["targets"][0]["met"], true);
        assert_eq!(json["targets"][0]["like_for_like"], true);
        assert_eq!(
            json["targets"][0]["floor"],
            "raw NATS 2 hops, 2 ms idle before each, p50 200 µs"
        );
        assert_eq!(json["targets"][5]["like_for_like"], false);
        assert_eq!(json["mcp"]["skipped"], "no reference MCP server installed");
        assert_eq!(json["all_answers_correct"], true);
        // pbjson reads back the message it wrote.
        let parsed: v1::BenchReport = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed, report.to_proto());
    }
}
