//! What every ctxsync service shares: command-line/env config, `tracing`
//! setup, graceful shutdown, the NATS connection, protobuf request/reply over
//! NATS (and snapshot-store's client), and the operator HTTP endpoints (`/healthz`, `/readyz`, `/metrics`).

pub mod args;
pub mod config;
pub mod db;
pub mod http;
pub mod metrics;
pub mod nats;
pub mod rpc;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod tenant_keys;
pub mod trace;

pub use config::{CommonArgs, DatabaseArgs, LogFormat, NatsTlsArgs};
pub use http::{HttpServer, Readiness};
pub use shutdown::Shutdown;
