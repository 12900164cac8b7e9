//! The latency report (`ctxsync latency`): read-only aggregates over the
//! catalog's stored events. It prints counts, durations, server ids,
//! transports and outcomes — never a message, argument, result or title.

use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ctxsync_proto::v1;
use sqlx::{PgPool, Row};

use crate::store::kinds;

/// The report's default window.
pub const DEFAULT_SINCE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Count and percentiles of one duration, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub count: u64,
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub max_ms: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Preparations {
    /// Preparations that pinned a new session.
    pub first: Stats,
    /// Preparations of an already prepared session (stored pins answered).
    pub follow_up: Stats,
    /// Phases of the first preparations.
    pub memory_lookup: Stats,
    pub live_discovery: Stats,
    pub write: Stats,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerPins {
    pub tenant: String,
    pub server_id: String,
    /// Pinned from memory without starting the server.
    pub pinned: u64,
    /// Discovered live by a handshake at preparation.
    pub connected: u64,
    /// Live discovery failed at preparation (not pinned).
    pub failed: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerHandshakes {
    pub tenant: String,
    pub server_id: String,
    pub transport: String,
    /// `preparation` or `call`.
    pub cause: String,
    pub duration: Stats,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calls {
    /// A session's first call to a server: setup (start) plus the call.
    pub first_call: Stats,
    /// Later calls to a server already started in the session.
    pub follow_up_call: Stats,
    /// The start (connect plus discovery) a call paid.
    pub setup: Stats,
    pub by_outcome: Vec<Count>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Count {
    pub name: String,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub window_start: DateTime<Utc>,
    pub generated_at: DateTime<Utc>,
    pub preparations: Preparations,
    pub pins: Vec<ServerPins>,
    pub pinned_total: u64,
    pub connected_total: u64,
    pub failed_total: u64,
    pub handshakes: Vec<ServerHandshakes>,
    pub calls: Calls,
    /// `mcp.catalog.changed` events per server (`tenant/server`).
    pub catalog_changes: Vec<Count>,
    /// Gate waits by outcome, when waits were recorded in the catalog's events
    /// (kind `gate.turn.waited`, payload `{outcome, wait_ms}`); empty otherwise.
    pub gate_waits: Vec<GateWaits>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GateWaits {
    pub outcome: String,
    pub wait: Stats,
}

/// The kind under which gate waits are read, if a writer records them.
pub const GATE_WAIT_KIND: &str = "gate.turn.waited";

fn stats_of(row: &sqlx::postgres::PgRow) -> Result<Stats, sqlx::Error> {
    Ok(Stats {
        count: row.try_get::<i64, _>("n")? as u64,
        p50_ms: row.try_get("p50")?,
        p90_ms: row.try_get("p90")?,
        max_ms: row.try_get("max")?,
    })
}

/// `count`, `p50`, `p90`, `max` of `expr`, a float8 expression over
/// `payload`. Only ever called with constants of this module.
fn aggregates(expr: &str) -> String {
    format!(
        "count(*) AS n, percentile_cont(0.5) WITHIN GROUP (ORDER BY {expr}) AS p50, \
         percentile_cont(0.9) WITHIN GROUP (ORDER BY {expr}) AS p90, max({expr}) AS max"
    )
}

async fn stats_query(
    pool: &PgPool,
    sql: String,
    kind: &str,
    since: DateTime<Utc>,
    follow_up: Option<bool>,
) -> Result<Stats, sqlx::Error> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(kind).bind(since);
    if let Some(follow_up) = follow_up {
        query = query.bind(follow_up);
    }
    stats_of(&query.fetch_one(pool).await?)
}

/// Aggregates the events since `now - since`.
pub async fn report(pool: &PgPool, since: Duration) -> Result<Report, sqlx::Error> {
    let generated_at = Utc::now();
    let window_start = generated_at
        - chrono::Duration::from_std(since).unwrap_or_else(|_| chrono::Duration::days(36500));
    let prepared = |field: &str, follow_up: bool| {
        let sql = format!(
            "SELECT {} FROM catalog.events WHERE kind = $1 AND occurred_at >= $2 \
             AND coalesce((payload->>'follow_up')::boolean, false) = $3",
            aggregates(&format!("(payload->>'{field}')::float8"))
        );
        stats_query(
            pool,
            sql,
            kinds::SESSION_PREPARED,
            window_start,
            Some(follow_up),
        )
    };
    let preparations = Preparations {
        first: prepared("duration_ms", false).await?,
        follow_up: prepared("duration_ms", true).await?,
        memory_lookup: prepared("lookup_ms", false).await?,
        live_discovery: prepared("discovery_ms", false).await?,
        write: prepared("write_ms", false).await?,
    };

    let rows = sqlx::query(
        "SELECT tenant, server_id,
                count(*) FILTER (WHERE kind = $1) AS pinned,
                count(*) FILTER (WHERE kind = $2) AS connected,
                count(*) FILTER (WHERE kind = $3) AS failed
         FROM catalog.events
         WHERE occurred_at >= $4 AND kind IN ($1, $2, $3)
           AND coalesce(payload->>'cause', 'preparation') = 'preparation'
         GROUP BY tenant, server_id
         ORDER BY tenant, server_id",
    )
    .bind(kinds::SERVER_PINNED)
    .bind(kinds::SERVER_CONNECTED)
    .bind(kinds::SERVER_CONNECT_FAILED)
    .bind(window_start)
    .fetch_all(pool)
    .await?;
    let mut pins = Vec::new();
    for row in rows {
        pins.push(ServerPins {
            tenant: row.try_get("tenant")?,
            server_id: row
                .try_get::<Option<String>, _>("server_id")?
                .unwrap_or_default(),
            pinned: row.try_get::<i64, _>("pinned")? as u64,
            connected: row.try_get::<i64, _>("connected")? as u64,
            failed: row.try_get::<i64, _>("failed")? as u64,
        });
    }

    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT tenant, server_id, coalesce(payload->>'transport', 'unknown') AS transport, \
                coalesce(payload->>'cause', 'unknown') AS cause, {} \
         FROM catalog.events WHERE kind = $1 AND occurred_at >= $2 \
         GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 4, 3",
        aggregates("(payload->>'duration_ms')::float8")
    )))
    .bind(kinds::SERVER_CONNECTED)
    .bind(window_start)
    .fetch_all(pool)
    .await?;
    let mut handshakes = Vec::new();
    for row in rows {
        handshakes.push(ServerHandshakes {
            tenant: row.try_get("tenant")?,
            server_id: row
                .try_get::<Option<String>, _>("server_id")?
                .unwrap_or_default(),
            transport: row.try_get("transport")?,
            cause: row.try_get("cause")?,
            duration: stats_of(&row)?,
        });
    }

    let call_stats = |filter: &str, setup_only: bool| {
        let expr = if setup_only {
            "(payload->>'setup_ms')::float8"
        } else {
            "(coalesce((payload->>'setup_ms')::float8, 0) + coalesce((payload->>'duration_ms')::float8, 0))"
        };
        let sql = format!(
            "SELECT {} FROM catalog.events WHERE kind = $1 AND occurred_at >= $2 AND {filter}",
            aggregates(expr)
        );
        stats_query(pool, sql, kinds::TOOL_CALLED, window_start, None)
    };
    let first_call = call_stats("(payload->>'first_call')::boolean", false).await?;
    let follow_up_call = call_stats("NOT (payload->>'first_call')::boolean", false).await?;
    let setup = call_stats("(payload->>'connected')::boolean", true).await?;
    let by_outcome = counts(
        pool,
        "SELECT coalesce(payload->>'outcome', 'unknown') AS name, count(*) AS n
         FROM catalog.events WHERE kind = $1 AND occurred_at >= $2
         GROUP BY 1 ORDER BY 2 DESC, 1",
        kinds::TOOL_CALLED,
        window_start,
    )
    .await?;
    let catalog_changes = counts(
        pool,
        "SELECT tenant || '/' || coalesce(server_id, '') AS name, count(*) AS n
         FROM catalog.events WHERE kind = $1 AND occurred_at >= $2
         GROUP BY 1 ORDER BY 1",
        kinds::CATALOG_CHANGED,
        window_start,
    )
    .await?;

    let gate_waits = gate_waits(pool, None, window_start).await?;

    Ok(Report {
        window_start,
        generated_at,
        pinned_total: pins.iter().map(|p| p.pinned).sum(),
        connected_total: pins.iter().map(|p| p.connected).sum(),
        failed_total: pins.iter().map(|p| p.failed).sum(),
        preparations,
        pins,
        handshakes,
        calls: Calls {
            first_call,
            follow_up_call,
            setup,
            by_outcome,
        },
        catalog_changes,
        gate_waits,
    })
}

/// First preparations of one bucket of a [`tenant_series`] window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SetupBucket {
    pub start: DateTime<Utc>,
    pub setup: Stats,
}

/// One tenant's aggregates over a window, for the context page's charts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantSeries {
    pub window_start: DateTime<Utc>,
    pub bucket: Duration,
    /// Every bucket of the window, oldest first; empty ones have count 0.
    pub setup: Vec<SetupBucket>,
    pub gate_waits: Vec<GateWaits>,
}

/// Buckets of a [`tenant_series`] window.
pub const SERIES_BUCKETS: u32 = 12;

/// `tenant`'s first-preparation percentiles per twelfth of the window since
/// `now - window`, and its gate waits by outcome over the window.
pub async fn tenant_series(
    pool: &PgPool,
    tenant: &str,
    window: Duration,
) -> Result<TenantSeries, sqlx::Error> {
    let bucket = (window / SERIES_BUCKETS).max(Duration::from_secs(1));
    let now = Utc::now();
    let window_start = now
        - chrono::Duration::from_std(bucket * SERIES_BUCKETS)
            .unwrap_or_else(|_| chrono::Duration::days(36500));
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT least(floor(extract(epoch FROM occurred_at - $3) / $4)::int8, $5) AS bucket, {} \
         FROM catalog.events WHERE kind = $1 AND tenant = $2 AND occurred_at >= $3 \
         AND NOT coalesce((payload->>'follow_up')::boolean, false) \
         GROUP BY 1 ORDER BY 1",
        aggregates("(payload->>'duration_ms')::float8")
    )))
    .bind(kinds::SESSION_PREPARED)
    .bind(tenant)
    .bind(window_start)
    .bind(bucket.as_secs_f64())
    // An event of the window's last instant belongs to the last bucket.
    .bind(i64::from(SERIES_BUCKETS) - 1)
    .fetch_all(pool)
    .await?;
    let step = chrono::Duration::from_std(bucket).unwrap_or_else(|_| chrono::Duration::days(1));
    let mut setup: Vec<SetupBucket> = (0..SERIES_BUCKETS)
        .map(|n| SetupBucket {
            start: window_start + step * n as i32,
            setup: Stats::default(),
        })
        .collect();
    for row in rows {
        let index = row.try_get::<i64, _>("bucket")?;
        let index = (index.max(0) as usize).min(setup.len() - 1);
        setup[index].setup = stats_of(&row)?;
    }
    let gate_waits = gate_waits(pool, Some(tenant), window_start).await?;
    Ok(TenantSeries {
        window_start,
        bucket,
        setup,
        gate_waits,
    })
}

/// chat-gate's first-turn waits by outcome since `since`: every tenant's,
/// or one's.
async fn gate_waits(
    pool: &PgPool,
    tenant: Option<&str>,
    since: DateTime<Utc>,
) -> Result<Vec<GateWaits>, sqlx::Error> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT coalesce(payload->>'outcome', 'unknown') AS outcome, {} \
         FROM catalog.events \
         WHERE kind = $1 AND occurred_at >= $2 AND ($3::text IS NULL OR tenant = $3) \
         GROUP BY 1 ORDER BY 1",
        aggregates("(payload->>'wait_ms')::float8")
    )))
    .bind(GATE_WAIT_KIND)
    .bind(since)
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(GateWaits {
                outcome: row.try_get("outcome")?,
                wait: stats_of(row)?,
            })
        })
        .collect()
}

async fn counts(
    pool: &PgPool,
    query: &'static str,
    kind: &str,
    since: DateTime<Utc>,
) -> Result<Vec<Count>, sqlx::Error> {
    let rows = sqlx::query(query)
        .bind(kind)
        .bind(since)
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|row| {
            Ok(Count {
                name: row.try_get("name")?,
                count: row.try_get::<i64, _>("n")? as u64,
            })
        })
        .collect()
}

fn fmt_ms(value: Option<f64>) -> String {
    match value {
        None => "-".to_owned(),
        Some(ms) if ms >= 1000.0 => format!("{:.2} s", ms / 1000.0),
        Some(ms) => format!("{ms:.1} ms"),
    }
}

fn stats_line(out: &mut String, label: &str, stats: &Stats) {
    let _ = writeln!(
        out,
        "  {label:<40} {:>6} {:>10} {:>10} {:>10}",
        stats.count,
        fmt_ms(stats.p50_ms),
        fmt_ms(stats.p90_ms),
        fmt_ms(stats.max_ms)
    );
}

fn header(out: &mut String, title: &str) {
    let _ = writeln!(
        out,
        "\n{title:<42} {:>6} {:>10} {:>10} {:>10}",
        "count", "p50", "p90", "max"
    );
}

impl Report {
    /// Human-readable tables.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "catalog latency since {} (generated {})",
            self.window_start.format("%Y-%m-%d %H:%M:%S UTC"),
            self.generated_at.format("%Y-%m-%d %H:%M:%S UTC")
        );
        header(&mut out, "Preparation");
        stats_line(&mut out, "first (new session)", &self.preparations.first);
        stats_line(
            &mut out,
            "follow-up (already prepared)",
            &self.preparations.follow_up,
        );
        stats_line(
            &mut out,
            "  phase: memory lookup",
            &self.preparations.memory_lookup,
        );
        stats_line(
            &mut out,
            "  phase: live discovery",
            &self.preparations.live_discovery,
        );
        stats_line(
            &mut out,
            "  phase: write (one transaction)",
            &self.preparations.write,
        );

        let _ = writeln!(
            out,
            "\n{:<42} {:>9} {:>9} {:>9}",
            "Pins at preparation", "pinned", "connected", "failed"
        );
        for pin in &self.pins {
            let _ = writeln!(
                out,
                "  {:<40} {:>9} {:>9} {:>9}",
                format!("{}/{}", pin.tenant, pin.server_id),
                pin.pinned,
                pin.connected,
                pin.failed
            );
        }
        let _ = writeln!(
            out,
            "  {:<40} {:>9} {:>9} {:>9}",
            "total", self.pinned_total, self.connected_total, self.failed_total
        );

        header(&mut out, "Handshakes (connect + discovery)");
        if self.handshakes.is_empty() {
            let _ = writeln!(out, "  none");
        }
        for h in &self.handshakes {
            stats_line(
                &mut out,
                &format!(
                    "{}/{} {} at {}",
                    h.tenant, h.server_id, h.transport, h.cause
                ),
                &h.duration,
            );
        }

        header(&mut out, "Calls");
        stats_line(
            &mut out,
            "first call to a server (setup + call)",
            &self.calls.first_call,
        );
        stats_line(&mut out, "later calls", &self.calls.follow_up_call);
        stats_line(&mut out, "setup paid by calls", &self.calls.setup);
        let outcomes: Vec<String> = self
            .calls
            .by_outcome
            .iter()
            .map(|c| format!("{} {}", c.name, c.count))
            .collect();
        let _ = writeln!(
            out,
            "  outcomes: {}",
            if outcomes.is_empty() {
                "none".to_owned()
            } else {
                outcomes.join(", ")
            }
        );

        let changes: Vec<String> = self
            .catalog_changes
            .iter()
            .map(|c| format!("{} {}", c.name, c.count))
            .collect();
        let _ = writeln!(
            out,
            "\nCatalog changes since pin: {}",
            if changes.is_empty() {
                "none".to_owned()
            } else {
                changes.join(", ")
            }
        );

        if self.gate_waits.is_empty() {
            let _ = writeln!(out, "\nGate waits: none recorded in the catalog's events");
        } else {
            header(&mut out, "Gate waits by outcome");
            for g in &self.gate_waits {
                stats_line(&mut out, &g.outcome, &g.wait);
            }
        }
        out
    }

    /// The report as its proto message, in the one JSON convention.
    pub fn render_json(&self) -> String {
        serde_json::to_string_pretty(&self.to_proto()).expect("the report serializes")
    }

    pub fn to_proto(&self) -> v1::LatencyReport {
        let count = |c: &Count| v1::LatencyCount {
            name: c.name.clone(),
            count: c.count,
        };
        v1::LatencyReport {
            window_start: Some(self.window_start.into()),
            generated_at: Some(self.generated_at.into()),
            preparations: Some(v1::LatencyPreparations {
                first: Some(self.preparations.first.to_proto()),
                follow_up: Some(self.preparations.follow_up.to_proto()),
                memory_lookup: Some(self.preparations.memory_lookup.to_proto()),
                live_discovery: Some(self.preparations.live_discovery.to_proto()),
                write: Some(self.preparations.write.to_proto()),
            }),
            pins: self
                .pins
                .iter()
                .map(|p| v1::LatencyServerPins {
                    tenant: p.tenant.clone(),
                    server_id: p.server_id.clone(),
                    pinned: p.pinned,
                    connected: p.connected,
                    failed: p.failed,
                })
                .collect(),
            pinned_total: self.pinned_total,
            connected_total: self.connected_total,
            failed_total: self.failed_total,
            handshakes: self
                .handshakes
                .iter()
                .map(|h| v1::LatencyHandshakes {
                    tenant: h.tenant.clone(),
                    server_id: h.server_id.clone(),
                    transport: h.transport.clone(),
                    cause: h.cause.clone(),
                    duration: Some(h.duration.to_proto()),
                })
                .collect(),
            calls: Some(v1::LatencyCalls {
                first_call: Some(self.calls.first_call.to_proto()),
                follow_up_call: Some(self.calls.follow_up_call.to_proto()),
                setup: Some(self.calls.setup.to_proto()),
                by_outcome: self.calls.by_outcome.iter().map(count).collect(),
            }),
            catalog_changes: self.catalog_changes.iter().map(count).collect(),
            gate_waits: self
                .gate_waits
                .iter()
                .map(|g| v1::LatencyGateWaits {
                    outcome: g.outcome.clone(),
                    wait: Some(g.wait.to_proto()),
                })
                .collect(),
        }
    }
}

impl Stats {
    pub fn to_proto(&self) -> v1::LatencyStats {
        v1::LatencyStats {
            count: self.count,
            p50_ms: self.p50_ms,
            p90_ms: self.p90_ms,
            max_ms: self.max_ms,
        }
    }
}
