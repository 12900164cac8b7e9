//! The workspace agent's publication decisions, with no transport.
//!
//! [`Machine`] is fed [`Event`]s (a new report from discovery, the answer
//! or failure of the request it asked for, a timer, shutdown) with the time
//! they happened, and answers the next [`Action`] (send a Startup, send a
//! push, wait until an instant, idle, stop). The driver in `workspace-agent`
//! (`publisher.rs`) performs the HTTP calls; nothing here can name one.
//!
//! The rules (each has a test in `tests/rules.rs`):
//!
//! * Startup first, retried (any failure) until the store applies it; no push
//!   before.
//! * Reports are coalesced: only the latest is sent, never a queue; a retry
//!   sends the latest too.
//! * Every push carries a higher version than the one before, across
//!   retries, reclaims and re-announcements; `initial` is set until a push
//!   has been answered (accepted or dropped).
//! * Each push carries its report's phase (PENDING until discovery's
//!   initial round is over, then COMPLETE): a PENDING report is published
//!   at once, not held back for the COMPLETE one.
//! * 401, 429/503 (with `Retry-After` as a floor), 5xx and network errors are
//!   retried with capped exponential backoff and jitter ([`Backoff`]); any
//!   other refusal of a push waits for the next report.
//! * A push dropped as `STALE_RUN`, or a Startup dropped as `SUPERSEDED_RUN`,
//!   while this process runs means a late message of a gone process took the
//!   agent over: Startup with `reclaim`, then the current report again.
//!   Reclaims within a minute of each other back off.
//! * Every `reannounce_interval` (zero: never) an idle publisher sends
//!   Startup again, so a takeover is noticed when nothing changes.
//! * Shutdown stops at once, whatever is awaited.

mod backoff;
mod machine;

pub use backoff::{Backoff, Delays};
pub use machine::{
    Action, Config, DEFAULT_REANNOUNCE_INTERVAL, Event, Failure, FailureKind, Machine, Publishable,
    PushReply, RECLAIM_WINDOW, StartupReply, Status,
};
