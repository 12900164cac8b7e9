//! The process-wide Prometheus recorder. Services in one process (`ctxsync up`,
//! tests) share it, so it is installed once.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Latency buckets in seconds, from 100 µs to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// Buckets of a service's own work on a request (`*_work_seconds`), in
/// seconds, from 10 µs to 100 ms: microseconds are what it is about.
const WORK_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1,
];

/// Size buckets in bytes, from 1 KiB to 4 MiB.
const SIZE_BUCKETS: &[f64] = &[
    1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
];

/// Installs the recorder on first use and returns the handle that renders it.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("static bucket list is not empty")
                .set_buckets_for_metric(Matcher::Suffix("_bytes".into()), SIZE_BUCKETS)
                .expect("static bucket list is not empty")
                .set_buckets_for_metric(Matcher::Suffix("_work_seconds".into()), WORK_BUCKETS)
                .expect("static bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            handle
        })
        .clone()
}

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric a service exports: its name, kind and `# HELP` text, and the
/// label sets it is recorded with from the start (at zero, so `/metrics` lists
/// it before its first event and `increase()` sees the first one). Series
/// whose labels are only known at run time (a NATS client, a listener) are
/// zeroed where that value appears.
#[derive(Debug, Clone, Copy)]
pub struct Series {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// Label sets recorded at zero; empty: one series without labels.
    pub zeroed: &'static [&'static [(&'static str, &'static str)]],
}

impl Series {
    pub const fn counter(name: &'static str, help: &'static str) -> Self {
        Self::new(name, Kind::Counter, help)
    }

    pub const fn gauge(name: &'static str, help: &'static str) -> Self {
        Self::new(name, Kind::Gauge, help)
    }

    pub const fn histogram(name: &'static str, help: &'static str) -> Self {
        Self::new(name, Kind::Histogram, help)
    }

    const fn new(name: &'static str, kind: Kind, help: &'static str) -> Self {
        Self {
            name,
            kind,
            help,
            zeroed: &[&[]],
        }
    }

    /// Recorded at zero with these label sets instead of none.
    pub const fn zeroed(
        mut self,
        label_sets: &'static [&'static [(&'static str, &'static str)]],
    ) -> Self {
        self.zeroed = label_sets;
        self
    }

    /// Described only: zeroed at run time where its labels are known.
    pub const fn dynamic(mut self) -> Self {
        self.zeroed = &[];
        self
    }
}

/// Series every service exports (NATS, RPC, HTTP listeners, build info).
pub const COMMON: &[Series] = &[
    Series::gauge(
        "ctxsync_build_info",
        "Always 1: the running service and its version (labels service, version).",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_nats_reconnects_total",
        "Times the NATS connection was re-established after a loss, by client.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_nats_slow_consumer_total",
        "Messages NATS dropped for a subscription that fell behind, by client.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_nats_permission_violations_total",
        "Publishes and subscriptions the NATS server refused, by client and operation.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_rpc_expired_total",
        "Requests picked up past their deadline and dropped unexecuted, by subject.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_rpc_reply_refused_total",
        "Requests refused unexecuted because their reply subject was outside the permitted inboxes, by subject.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_http_browser_refused_total",
        "API requests answered 403 because their Host or Origin is not allowed, by reason (host, origin).",
    )
    .zeroed(&[&[("reason", "host")], &[("reason", "origin")]]),
    Series::gauge(
        "ctxsync_http_connections_open",
        "HTTP connections open now, by listener address.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_http_connection_limit_waits_total",
        "Times a listener stopped accepting at its connection limit, by listener address.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_http_timeouts_total",
        "HTTP connections closed for a timeout (header, body, idle), by listener address.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_http_accept_errors_total",
        "Errors accepting HTTP connections (e.g. out of file descriptors), by listener address.",
    )
    .dynamic(),
    Series::counter(
        "ctxsync_http_tls_handshake_failures_total",
        "TLS handshakes that failed or timed out on an HTTPS listener, by listener address.",
    )
    .dynamic(),
];

/// Installs the recorder, describes `series` and records their zero values.
/// Call before anything records (a series recorded before the recorder is
/// installed is lost). Idempotent: services sharing a process may all call it.
pub fn register(series: &[Series]) {
    let _ = handle();
    for series in series {
        match series.kind {
            Kind::Counter => metrics::describe_counter!(series.name, series.help),
            Kind::Gauge => metrics::describe_gauge!(series.name, series.help),
            Kind::Histogram => metrics::describe_histogram!(series.name, series.help),
        }
        for labels in series.zeroed {
            let labels: Vec<metrics::Label> = labels
                .iter()
                .map(|(key, value)| metrics::Label::new(*key, *value))
                .collect();
            match series.kind {
                Kind::Counter => metrics::counter!(series.name, labels).increment(0),
                // Adding zero leaves a value another service in the process set.
                Kind::Gauge => metrics::gauge!(series.name, labels).increment(0.0),
                // Registered: rendered with empty buckets until the first sample.
                Kind::Histogram => drop(metrics::histogram!(series.name, labels)),
            }
        }
    }
}

/// A service's start: installs the recorder, registers the common series and
/// the service's own, and sets `ctxsync_build_info{service, version}` to 1.
pub fn init(service: &str, version: &str, own: &[Series]) {
    register(COMMON);
    register(own);
    metrics::gauge!(
        "ctxsync_build_info",
        "service" => service.to_owned(),
        "version" => version.to_owned()
    )
    .set(1.0);
}
