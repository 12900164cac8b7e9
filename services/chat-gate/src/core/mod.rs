//! The gate's decisions, with no transport: which turns wait and for what
//! (`gate`), the views of agents kept current by events (`watch`), and what a
//! chat may use of a snapshot (`projection`). It reads and learns through the
//! traits of `source`; the NATS and HTTP modules of this crate are adapters
//! around it, and nothing here uses them.
//!
//! Modules here use only each other, in one direction:
//! `gate` → `watch` → `projection`, and all of them → `source`.

pub mod gate;
pub mod projection;
pub mod source;
pub mod watch;

pub use gate::{Gate, GateSettings, drain_window};
pub use source::{CatalogSource, ReadError, StateSource, WaitAnnouncer};
pub use watch::{EventUpdate, ViewLimits};
