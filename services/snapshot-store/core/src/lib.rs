//! snapshot-store's decisions, with no transport and no database: given what
//! the store read of an agent under its row lock and the startup or push that
//! came in, which of them is written, which is dropped and why, and which
//! events the commit publishes. The store's SQL reads the inputs, carries out
//! the plan in the same transaction, and publishes what the plan built.
//!
//! The rules are those of late, replayed and repeated messages:
//!
//! - a push from a run other than the agent's current one is dropped
//!   ([`PushDropReason::StaleRun`]); an agent with no run id (a legacy one, or
//!   none started yet) takes any run's push;
//! - within a run, versions only move forward ([`PushDropReason::StaleVersion`],
//!   `initial` included: it is a run's first push, never a reset) and so does
//!   the phase ([`PushDropReason::PhaseRegression`]); a new run starts over;
//! - a startup naming a run the agent already moved away from is dropped
//!   ([`StartupDropReason::SupersededRun`]) unless it is a reclaim;
//! - a repeated startup of the current run is answered without a write;
//! - `DiscoveryChanged` goes out only when the phase or the run id changed,
//!   `SnapshotCommitted` after every accepted push;
//! - resources are rewritten only when the content hash changed.
//!
//! [`PushDropReason::StaleRun`]: ctxsync_proto::v1::PushDropReason::StaleRun
//! [`PushDropReason::StaleVersion`]: ctxsync_proto::v1::PushDropReason::StaleVersion
//! [`PushDropReason::PhaseRegression`]: ctxsync_proto::v1::PushDropReason::PhaseRegression
//! [`StartupDropReason::SupersededRun`]: ctxsync_proto::v1::StartupDropReason::SupersededRun

mod content;
mod push;
mod startup;

pub use content::{PushContent, phase_rank, push_phase};
pub use push::{PushPlan, PushWrite, StoredSnapshot, plan_push};
pub use startup::{
    StartupPlan, StartupWrite, StoredAgent, plan_startup, repeated_startup, superseded_matters,
};
