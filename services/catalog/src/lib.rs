//! The catalog: the MCP runtime for operator-configured servers.
//!
//! * It remembers the last successful discovery of every configured server,
//!   keyed by the server's whole configuration ([`config::ServerKey`]), in
//!   this process and in a JetStream key-value bucket its replicas share.
//! * `<prefix>.catalog.prepare.<tenant>` pins every enabled server of the
//!   tenant for a session, from memory without starting it where the rules
//!   allow, else live; one Postgres transaction per preparation.
//! * `<prefix>.catalog.call.<tenant>` starts a pinned server on the first call
//!   of one of its tools and compares its live catalog with the pin.
//! * The tenant is the subject's (`Subjects::catalog_tenant`), so NATS permissions bind a
//!   caller to its own tenant's sessions and tools.
//! * Once serving, it warms its memory in the background, one server at a
//!   time, each server claimed so that one replica warms it.
//! * `/mcp` on its HTTP listener serves the same sessions to MCP clients
//!   (streamable HTTP, tenant keys): `endpoint`.
//! * [`latency::report`] aggregates the stored events.
//!
//! The decisions are the core's (`catalog_core`: what a preparation pins,
//! what a call does, what the memory keeps, which events follow); this
//! crate is its adapter. One part per concern, each owning its data:
//! [`memory`] over `bucket` (the shared level) and `discovery` (live
//! discovery, which alone writes the memory), one type per command
//! (`prepare::Prepare`, `call::Call`, `end_session::EndSession`) over the
//! `sessions` they share, `warmup`, and `events` (storing and publishing).
//! `service` wires them to NATS. Modules import each other without cycles;
//! this root only declares and re-exports.
//!
//! The config file format is documented in the crate's README.md.

mod bucket;
mod call;
pub mod config;
mod discovery;
mod end_session;
mod endpoint;
mod events;
mod gate_waits;
pub mod latency;
mod mcp;
mod mcp_sessions;
mod mcp_store;
pub mod memory;
mod prepare;
mod processes;
mod rate_limit;
mod relay;
mod request;
pub mod series;
mod service;
mod sessions;
pub mod settings;
mod shared;
mod status;
pub mod store;
pub use catalog_core::tools;
mod warmup;

pub use bucket::MemoryKey;
pub use catalog_core::ErrorCode;
pub use config::{CatalogConfig, ConfigError};
pub use endpoint::{PIN_HANDLE_META, RateLimit, SessionLimits, TOOL_NAME_SEPARATOR};
pub use request::MAX_REQUEST_ID_BYTES;
pub use service::{Error, ReloadError, Reloader, Running, run, start};
pub use settings::{Args, CatalogArgs, Config, MemorySettings, Settings, WarmupSettings};
pub use warmup::WarmupStatus;
