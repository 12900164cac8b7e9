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
pub mod metrics;
mod nats;
mod postgres;
mod private_postgres;
mod process;
pub mod report;
pub mod stack;
pub mod store;
pub mod tls;

pub use binary::workspace_binary;
pub use nats::NatsServer;
pub use postgres::TestDatabase;
pub use private_postgres::{POSTGRES_BIN_DIR_ENV, PrivatePostgres};
pub use process::{Process, ProcessBuilder};

/// A subject prefix unique to one test, for tests that share a NATS server.
pub fn unique_prefix() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// Routes `tracing` output through the test harness (shown for failing tests).
pub fn init_logs() {
    ctxsync_tls::install_default_provider();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CTXSYNC_TEST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_test_writer()
        .try_init();
}

/// A loopback address on a free port (see [`free_port`]).
pub fn free_addr() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// Reserves a free TCP port on loopback (released before returning).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("cannot reserve a loopback port")
}

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
