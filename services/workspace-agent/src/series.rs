//! The series the workspace agent exports (besides the common ones).

use ctxsync_runtime::metrics::Series;

pub const SERIES: &[Series] = &[
    Series::counter(
        "ctxsync_agent_pushes_total",
        "Discovery reports pushed, by outcome (accepted, dropped, retry, rejected).",
    )
    .zeroed(&[
        &[("outcome", "accepted")],
        &[("outcome", "dropped")],
        &[("outcome", "retry")],
        &[("outcome", "rejected")],
    ]),
    Series::counter(
        "ctxsync_agent_reclaims_total",
        "Times the process took its agent back from a late message's run.",
    ),
    Series::counter(
        "ctxsync_agent_mcp_connects_total",
        "Connections to the workspace's MCP servers, by outcome (ok, failed).",
    )
    .zeroed(&[&[("outcome", "ok")], &[("outcome", "failed")]]),
    Series::histogram(
        "ctxsync_agent_mcp_handshake_seconds",
        "MCP handshakes with the workspace's servers, in seconds.",
    ),
];
