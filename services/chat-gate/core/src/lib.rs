//! chat-gate's decisions, with no transport: which turns wait and for what
//! (`gate`), the views of agents kept current by events (`watch`), and what a
//! chat may use of a snapshot (`projection`). It reads and learns through the
//! traits of `source`; chat-gate's NATS and HTTP modules are adapters around
//! it. This crate depends on no transport (no async-nats, sqlx or axum), so
//! it cannot use them.
//!
//! Modules here use only each other, in one direction:
//! `gate` → `watch` → `projection`, and all of them → `source`.

pub mod gate;
pub mod projection;
pub mod source;
pub mod watch;

pub use gate::{Answer, Gate, GateSettings, drain_window};
pub use source::{CatalogSource, ReadError, StateSource, WaitAnnouncer};
pub use watch::{EventUpdate, ViewLimits};
