//! The series the catalog exports (besides the common ones).

use ctxsync_runtime::metrics::Series;

/// Every transport × cause of a handshake.
const HANDSHAKES: &[&[(&str, &str)]] = &[
    &[("transport", "stdio"), ("cause", "preparation")],
    &[("transport", "stdio"), ("cause", "call")],
    &[("transport", "stdio"), ("cause", "warmup")],
    &[("transport", "streamable_http"), ("cause", "preparation")],
    &[("transport", "streamable_http"), ("cause", "call")],
    &[("transport", "streamable_http"), ("cause", "warmup")],
];

pub const SERIES: &[Series] = &[
    Series::counter(
        "ctxsync_catalog_pins_total",
        "Servers pinned by preparations, by source (pinned from memory, connected live, failed).",
    )
    .zeroed(&[
        &[("source", "pinned")],
        &[("source", "connected")],
        &[("source", "failed")],
    ]),
    Series::histogram(
        "ctxsync_catalog_handshake_seconds",
        "MCP handshakes with operator servers, in seconds, by transport and cause.",
    )
    .zeroed(HANDSHAKES),
    Series::counter(
        "ctxsync_catalog_handshake_failures_total",
        "MCP handshakes with operator servers that failed, by transport and cause.",
    )
    .zeroed(HANDSHAKES),
    Series::counter(
        "ctxsync_catalog_preparations_total",
        "Catalog preparations, by outcome (first, follow_up, error).",
    )
    .zeroed(&[
        &[("outcome", "first")],
        &[("outcome", "follow_up")],
        &[("outcome", "error")],
    ]),
    Series::histogram(
        "ctxsync_catalog_preparation_seconds",
        "Time of a catalog preparation, in seconds, by outcome.",
    )
    .zeroed(&[
        &[("outcome", "first")],
        &[("outcome", "follow_up")],
        &[("outcome", "error")],
    ]),
    Series::counter(
        "ctxsync_catalog_warmup_rounds_total",
        "Warm-up rounds over servers never discovered.",
    ),
    Series::counter(
        "ctxsync_catalog_warmup_servers_total",
        "Servers tried by the warm-up, by outcome (discovered, shared: found warm in the memory, failed, abandoned).",
    )
    .zeroed(&[
        &[("outcome", "discovered")],
        &[("outcome", "shared")],
        &[("outcome", "failed")],
        &[("outcome", "abandoned")],
    ]),
    Series::counter(
        "ctxsync_catalog_calls_total",
        "Tool calls through the catalog, by outcome (ok or the error code).",
    )
    .zeroed(&[&[("outcome", "ok")]]),
    Series::histogram(
        "ctxsync_catalog_call_seconds",
        "Time of a tool call through the catalog, in seconds.",
    ),
    Series::gauge(
        "ctxsync_catalog_open_transports",
        "Connections to MCP servers open now.",
    ),
    Series::gauge(
        "ctxsync_catalog_memory_entries",
        "Server configurations whose last discovery is remembered.",
    ),
    Series::gauge(
        "ctxsync_catalog_memory_bytes",
        "Bytes of the remembered discoveries in this process's map (as sealed in the bucket).",
    ),
    Series::counter(
        "ctxsync_catalog_memory_refused_total",
        "Memory entries not applied or not written, by reason (unsealed, bad_tag, undecodable, bad_key, too_large, full).",
    )
    .zeroed(&[
        &[("reason", "unsealed")],
        &[("reason", "bad_tag")],
        &[("reason", "undecodable")],
        &[("reason", "full")],
    ]),
    Series::gauge(
        "ctxsync_catalog_memory_shared",
        "1 while the memory's key-value bucket works, 0 while the catalog serves from its own process's memory.",
    ),
    Series::gauge(
        "ctxsync_catalog_events_queued",
        "Events waiting for the background writer.",
    ),
    Series::counter(
        "ctxsync_catalog_events_written_total",
        "Queued events written to catalog.events.",
    ),
    Series::counter(
        "ctxsync_catalog_events_dropped_total",
        "Events dropped because the event queue was full (--event-queue).",
    ),
    Series::counter(
        "ctxsync_catalog_events_lost_total",
        "Queued events not written within the shutdown grace (Postgres unreachable).",
    ),
    Series::counter(
        "ctxsync_catalog_event_write_failures_total",
        "Failed writes of a batch of queued events (each retried).",
    ),
    Series::counter(
        "ctxsync_catalog_replies_too_large_total",
        "Answers over the NATS server's max_payload, replaced by an error.",
    ),
    Series::counter(
        "ctxsync_catalog_auth_total",
        "Tenant key checks of the MCP endpoint, by outcome (ok or the refusal).",
    )
    .zeroed(&[&[("outcome", "ok")], &[("outcome", "unknown_key")]]),
    Series::counter(
        "ctxsync_catalog_mcp_refused_total",
        "MCP endpoint requests refused, by reason (missing, malformed, unknown_key, store_unavailable, rate_limited, sessions_per_key, sessions_per_tenant, other_tenant, unknown_session).",
    )
    .zeroed(&[
        &[("reason", "missing")],
        &[("reason", "unknown_key")],
        &[("reason", "rate_limited")],
        &[("reason", "sessions_per_key")],
        &[("reason", "sessions_per_tenant")],
        &[("reason", "other_tenant")],
        &[("reason", "unknown_session")],
    ]),
    Series::counter(
        "ctxsync_catalog_mcp_requests_total",
        "MCP endpoint requests served, by method.",
    )
    .zeroed(&[
        &[("method", "initialize")],
        &[("method", "tools/list")],
        &[("method", "tools/call")],
    ]),
    Series::histogram(
        "ctxsync_catalog_mcp_initialize_seconds",
        "Time of an MCP initialize (the catalog session's preparation), in seconds.",
    ),
    Series::gauge(
        "ctxsync_catalog_mcp_sessions",
        "MCP sessions open now.",
    ),
    Series::counter(
        "ctxsync_catalog_mcp_sessions_revoked_total",
        "MCP sessions ended because their tenant key was revoked.",
    ),
    Series::counter(
        "ctxsync_catalog_mcp_sessions_idle_total",
        "MCP sessions ended because nothing was asked of them for the idle bound.",
    ),
    Series::histogram(
        "ctxsync_catalog_mcp_call_work_seconds",
        "The catalog's own work on a call of a 2025 MCP session it answered itself as JSON: from the request's arrival at /mcp to its answer, less the upstream server's time, in seconds.",
    ),
    Series::counter(
        "ctxsync_catalog_mcp_direct_total",
        "Calls of 2025 MCP sessions the endpoint answered itself, by answer (json, or stream when progress came first).",
    )
    .zeroed(&[&[("answer", "json")], &[("answer", "stream")]]),
    Series::counter(
        "ctxsync_catalog_mcp_sessions_restored_total",
        "MCP sessions another replica started, restored here from the sessions bucket.",
    ),
    Series::counter(
        "ctxsync_catalog_mcp_sessions_unsealed_total",
        "Values of the MCP sessions bucket not sealed by a replica, ignored.",
    ),
    Series::counter(
        "ctxsync_catalog_mcp_list_changed_total",
        "List-changed notifications (tools, prompts, resources) sent to MCP sessions.",
    ),
    Series::counter(
        "ctxsync_catalog_mcp_relayed_total",
        "Messages relayed between MCP clients of /mcp and upstream servers, by kind.",
    )
    .zeroed(&[
        &[("kind", "progress")],
        &[("kind", "cancellation")],
        &[("kind", "logging")],
        &[("kind", "completion")],
        &[("kind", "resource_updated")],
        &[("kind", "elicitation")],
        &[("kind", "sampling")],
        &[("kind", "input_round")],
    ]),
    Series::counter(
        "ctxsync_catalog_name_collisions_total",
        "Tool, prompt or resource names two servers of a tenant offer, by where found (config: a config refused; discovery: a live discovery brought it).",
    )
    .zeroed(&[&[("found", "config")], &[("found", "discovery")]]),
    Series::gauge(
        "ctxsync_catalog_shared_processes",
        "Shared server processes running now (servers configured processes: shared).",
    ),
    Series::counter(
        "ctxsync_catalog_process_limit_refusals_total",
        "Calls refused because a process bound is reached, by bound (total: --max-server-processes, tenant: --max-server-processes-per-tenant).",
    )
    .zeroed(&[&[("bound", "total")], &[("bound", "tenant")]]),
];
