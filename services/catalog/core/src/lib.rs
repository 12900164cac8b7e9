//! The catalog's decisions, with no transport: what a preparation pins
//! (from the memory, or live), what a call does (allowed, withdrawn,
//! unknown, no longer configured, a start first, a re-list first), what the
//! memory keeps, and which events and writes follow each. The `catalog`
//! crate is its adapter: it reads the configuration, the memory and the
//! session's pins, asks the core, and carries out the answer (SQL, NATS,
//! server processes). This crate cannot name `async_nats`, `sqlx`, `axum`
//! or an MCP transport: its manifest does not depend on them.
//!
//! Modules use only each other, in one direction:
//! `prepare`, `call` → `request`, `pins`, `memory`, `events` → `tools` → `code`;
//! `hints` → `memory`, `request`, `naming`; `prepare`, `pins` → `naming` → `tools` → `uri_template`.

pub mod call;
pub mod code;
pub mod events;
pub mod hints;
pub mod memory;
pub mod naming;
pub mod pins;
pub mod prepare;
pub mod request;
pub mod tools;
pub mod uri_template;

pub use code::{ErrorCode, ItemError, ItemKind};
pub use memory::{Discovery, Failure, Live, Transport};
pub use request::Refusal;
