//! Test infrastructure shared by every crate's integration tests.
//!
//! Each test gets its own `nats-server` process on a free port (JetStream on,
//! its own store directory) and its own Postgres database, both removed when
//! the handle drops. A missing `nats-server` or an unreachable Postgres fails
//! the test with a message that says what to install or start: tests never
//! skip silently.
//!
//! [`report`] builds the discovery reports agents push; [`store`] is a typed
//! client of snapshot-store's NATS API.
//!
//! [`LateProxy`] delays what a nats-server and one client send each other,
//! to put a message in flight while the test stops the client, or to keep
//! what the client sends after a reconnect from the server for a while; it
//! also cuts the client off until restored.
//!
//! For tests across real processes: [`Process`] runs one of our binaries
//! (readiness, SIGSTOP/SIGCONT, kill -9, SIGTERM, restart with the same env),
//! [`PrivatePostgres`] is a Postgres server of the test's own that can be
//! killed hard and restarted, [`agent::FakeAgent`] pushes through
//! agent-ingest and records every answer, [`chat`] asks chat-gate for turns
//! over HTTP and NATS, and [`metrics`] reads a service's `/metrics`.
//!
//! [`stack`] is the one way a test runs the services together: the
//! `ctxsync-stack` builder on the test's own NATS and database, in process
//! or as binaries.

pub mod agent;
mod binary;
pub mod chat;
mod isolation;
mod late_proxy;
pub mod metrics;
mod nats;
mod postgres;
mod private_postgres;
mod process;
pub mod report;
mod round_robin;
pub mod stack;
pub mod store;
pub mod tls;

pub use binary::workspace_binary;
pub use isolation::{free_addr, free_port, init_logs, unique_prefix};
pub use late_proxy::LateProxy;
pub use nats::{NatsCluster, NatsServer};
pub use postgres::TestDatabase;
pub use private_postgres::{POSTGRES_BIN_DIR_ENV, PrivatePostgres};
pub use process::{Process, ProcessBuilder};
pub use round_robin::RoundRobin;

/// Subscribes to `subject` and confirms it with a round trip, so it is in place on
/// the server before the test makes anything publish.
pub async fn subscribe(client: &async_nats::Client, subject: String) -> async_nats::Subscriber {
    let subscriber = client.subscribe(subject).await.expect("subscribe");
    // flush() only writes to the socket: a round trip proves the server has it.
    ctxsync_runtime::nats::sync_with_server(client)
        .await
        .expect("the server confirms the subscription");
    subscriber
}
