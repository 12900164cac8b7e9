//! The series snapshot-store exports (besides the common ones).

use ctxsync_runtime::metrics::Series;

pub const SERIES: &[Series] = &[
    Series::counter(
        "ctxsync_store_pushes_total",
        "Agent pushes handled, by outcome (accepted, dropped with a reason, expired, error).",
    )
    .zeroed(&[
        &[("outcome", "accepted")],
        &[("outcome", "expired")],
        &[("outcome", "error")],
    ]),
    Series::counter(
        "ctxsync_store_startups_total",
        "Agent startups handled, by outcome (accepted, dropped, expired, error).",
    )
    .zeroed(&[
        &[("outcome", "accepted")],
        &[("outcome", "dropped")],
        &[("outcome", "expired")],
        &[("outcome", "error")],
    ]),
    Series::histogram(
        "ctxsync_store_push_transaction_seconds",
        "Time of a push's Postgres transaction, in seconds, by outcome.",
    )
    .zeroed(&[&[("outcome", "accepted")]]),
    Series::histogram(
        "ctxsync_store_push_batch_size",
        "Pushes taken together into one group-commit transaction.",
    ),
    Series::counter(
        "ctxsync_store_event_state_omitted_total",
        "Discovery events published without the agent's state, which was over the size limit.",
    ),
];
