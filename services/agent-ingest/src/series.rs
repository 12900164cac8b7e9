//! The series agent-ingest exports (besides the common ones).

use ctxsync_runtime::metrics::Series;

pub const SERIES: &[Series] = &[
    Series::counter(
        "ctxsync_ingest_requests_total",
        "Agent API requests answered, by endpoint and HTTP status.",
    )
    .zeroed(&[
        &[("endpoint", "startup"), ("status", "200")],
        &[("endpoint", "context_state"), ("status", "200")],
    ]),
    Series::histogram(
        "ctxsync_ingest_request_seconds",
        "Time to answer an agent API request, in seconds, by endpoint.",
    )
    .zeroed(&[&[("endpoint", "startup")], &[("endpoint", "context_state")]]),
    Series::histogram(
        "ctxsync_ingest_request_bytes",
        "Size of agent API request bodies, in bytes.",
    ),
];
