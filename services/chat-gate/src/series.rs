//! The series chat-gate exports (besides the common ones).

use ctxsync_runtime::metrics::Series;

/// Every decision a turn or a wait ends with (`GateDecision::label`).
const WAIT_OUTCOMES: &[&[(&str, &str)]] = &[
    &[("outcome", "ready")],
    &[("outcome", "timed_out_pending")],
    &[("outcome", "timed_out_no_snapshot")],
    &[("outcome", "timed_out_stale")],
    &[("outcome", "store_unavailable")],
    &[("outcome", "shutting_down")],
];

pub const SERIES: &[Series] = &[
    Series::counter(
        "ctxsync_gate_auth_total",
        "HTTP requests' tenant-key checks, by outcome (ok, missing, malformed, unknown_key, store_unavailable).",
    )
    .zeroed(&[
        &[("outcome", "ok")],
        &[("outcome", "missing")],
        &[("outcome", "malformed")],
        &[("outcome", "unknown_key")],
        &[("outcome", "store_unavailable")],
    ]),
    Series::counter(
        "ctxsync_gate_refused_total",
        "Requests refused before any agent state was shown, by reason (missing, malformed, unknown_key, store_unavailable, wrong_tenant).",
    )
    .zeroed(&[
        &[("reason", "missing")],
        &[("reason", "malformed")],
        &[("reason", "unknown_key")],
        &[("reason", "store_unavailable")],
        &[("reason", "wrong_tenant")],
    ]),
    Series::counter(
        "ctxsync_gate_turns_total",
        "Turns answered, by decision (or not_found, invalid for refused requests).",
    )
    .zeroed(&[
        &[("decision", "ready")],
        &[("decision", "legacy")],
        &[("decision", "not_first_turn")],
        &[("decision", "timed_out_pending")],
        &[("decision", "timed_out_no_snapshot")],
        &[("decision", "timed_out_stale")],
        &[("decision", "store_unavailable")],
        &[("decision", "shutting_down")],
        &[("decision", "not_found")],
        &[("decision", "invalid")],
    ]),
    Series::counter(
        "ctxsync_gate_waits_total",
        "First-turn waits ended, by outcome (the decision they ended with).",
    )
    .zeroed(WAIT_OUTCOMES),
    Series::histogram(
        "ctxsync_gate_wait_seconds",
        "How long a first turn waited for discovery, in seconds, by outcome.",
    )
    .zeroed(WAIT_OUTCOMES),
    Series::histogram(
        "ctxsync_gate_wake_seconds",
        "From the store's commit of a completed discovery to the waiting turn's wake, in seconds.",
    ),
    Series::histogram(
        "ctxsync_gate_event_work_seconds",
        "The gate's own work on a discovery event that ended waits: from taking it off the subscription to every wait it ended woken, in seconds.",
    ),
    Series::histogram(
        "ctxsync_gate_answer_work_seconds",
        "The gate's own work on a first turn whose wait ended: from the wait's end to the turn's answer built, in seconds.",
    ),
    Series::counter(
        "ctxsync_gate_page_refused_total",
        "Context-page event streams and tickets refused at a bound, by reason (streams_per_key, streams_per_tenant, tickets_per_tenant, tickets_full).",
    )
    .zeroed(&[
        &[("reason", "streams_per_key")],
        &[("reason", "streams_per_tenant")],
        &[("reason", "tickets_per_tenant")],
        &[("reason", "tickets_full")],
    ]),
    Series::gauge(
        "ctxsync_gate_page_streams",
        "Context-page event streams open now.",
    ),
    Series::gauge(
        "ctxsync_gate_waiters",
        "First turns waiting for discovery now.",
    ),
    Series::gauge(
        "ctxsync_gate_attempts_held",
        "Recent first-turn attempts remembered (so a retry does not wait again).",
    ),
    Series::counter(
        "ctxsync_gate_attempts_joined_total",
        "Turns that joined a wait already running for the same chat.",
    ),
    Series::gauge(
        "ctxsync_gate_views",
        "Agent views held, lookups in flight included.",
    ),
    Series::counter(
        "ctxsync_gate_view_updates_total",
        "Agent view updates, by source (event, read).",
    )
    .zeroed(&[&[("source", "event")], &[("source", "read")]]),
    Series::counter(
        "ctxsync_gate_views_evicted_total",
        "Agent views dropped, by why (idle, capacity).",
    )
    .zeroed(&[&[("why", "idle")], &[("why", "capacity")]]),
    Series::counter(
        "ctxsync_gate_lookups_refused_total",
        "Lookups of unseen agents refused: no lookup slot within the store timeout.",
    ),
    Series::counter(
        "ctxsync_gate_store_reads_total",
        "Agent reads from snapshot-store, by outcome (ok, not_found, invalid, unavailable; retried: a first attempt timed out or found no responder, asked once more).",
    )
    .zeroed(&[
        &[("outcome", "ok")],
        &[("outcome", "retried")],
        &[("outcome", "not_found")],
        &[("outcome", "invalid")],
        &[("outcome", "unavailable")],
    ]),
    Series::counter(
        "ctxsync_gate_catalog_failures_total",
        "Catalog preparations that failed, answered with a failed catalog section.",
    ),
    Series::counter(
        "ctxsync_gate_catalog_asked_again_total",
        "Catalog preparations asked once more, by why (no_responders; no_answer_yet: none at half the catalog timeout).",
    )
    .zeroed(&[&[("why", "no_responders")], &[("why", "no_answer_yet")]]),
];
