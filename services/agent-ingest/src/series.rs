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
    Series::counter(
        "ctxsync_ingest_unknown_fields_total",
        "Protobuf fields accepted and dropped because this ingest does not know them (from newer agents), by the message type that does not define them.",
    )
    // Every message type of the agent API's two requests.
    .zeroed(&[
        &[("message", "ctxsync.v1.StartupRequest")],
        &[("message", "ctxsync.v1.PushContextStateRequest")],
        &[("message", "ctxsync.v1.MCPDiscovery")],
        &[("message", "ctxsync.v1.ContextResource")],
        &[("message", "ctxsync.v1.InstructionFile")],
        &[("message", "ctxsync.v1.Skill")],
        &[("message", "ctxsync.v1.McpConfig")],
        &[("message", "ctxsync.v1.McpServer")],
        &[("message", "ctxsync.v1.McpTool")],
        &[("message", "ctxsync.v1.ContextConfig")],
    ]),
];
