//! The stack builder ([`ctxsync_stack`]) on a test's own NATS and Postgres,
//! and its services as binaries ([`Process`]es) when a test needs processes.

use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
pub use ctxsync_stack::{Binary, Service, Stack, StackBuilder, StackError, Started};

use crate::nats::{NatsCluster, NatsServer};
use crate::postgres::TestDatabase;
use crate::process::{Process, ProcessBuilder};

/// A private nats-server, a fresh database and a subject prefix of the test's
/// own: what a stack runs on in a test.
pub struct TestStack {
    pub nats: NatsServer,
    pub db: TestDatabase,
    pub prefix: String,
}

impl TestStack {
    /// A nats-server on a free port and a fresh database (logs routed to the test).
    pub async fn private() -> Self {
        crate::isolation::init_logs();
        Self::on(NatsServer::start()).await
    }

    /// `nats` (a test-made server, e.g. with its own config) and a fresh database.
    pub async fn on(nats: NatsServer) -> Self {
        crate::isolation::init_logs();
        Self {
            nats,
            db: TestDatabase::create().await,
            prefix: crate::isolation::unique_prefix(),
        }
    }

    /// A builder on this NATS server, prefix and database, with no service yet.
    pub fn builder(&self) -> StackBuilder {
        StackBuilder::new(self.nats.url(), self.prefix.clone()).database(self.db.url())
    }

    pub fn subjects(&self) -> Subjects {
        Subjects::new(&self.prefix).expect("the test prefix is valid")
    }
}

/// [`TestStack`] on a three-node cluster: every service of its builder is
/// given the cluster's URL list, so it fails over when its node goes.
pub struct ClusterStack {
    pub nats: NatsCluster,
    pub db: TestDatabase,
    pub prefix: String,
}

impl ClusterStack {
    /// A fresh three-node cluster and a fresh database (logs routed to the test).
    pub async fn private() -> Self {
        crate::isolation::init_logs();
        // Three processes and their routes: off the runtime's threads.
        let nats = tokio::task::spawn_blocking(NatsCluster::start)
            .await
            .expect("the cluster starts");
        Self {
            nats,
            db: TestDatabase::create().await,
            prefix: crate::isolation::unique_prefix(),
        }
    }

    /// A builder on the whole cluster (its URL list), this prefix and database.
    pub fn builder(&self) -> StackBuilder {
        StackBuilder::new(self.nats.url_list(), self.prefix.clone()).database(self.db.url())
    }

    pub fn subjects(&self) -> Subjects {
        Subjects::new(&self.prefix).expect("the test prefix is valid")
    }
}

/// Starts `builder`'s services in this process, panicking with the reason
/// if one does not start.
pub async fn start(builder: StackBuilder, shutdown: &ctxsync_runtime::Shutdown) -> Stack {
    builder
        .start(shutdown)
        .await
        .unwrap_or_else(|error| panic!("the stack starts: {error}"))
}

/// One service of a stack running as its binary.
pub struct BinaryService {
    pub service: Service,
    pub http_addr: std::net::SocketAddr,
    pub process: Process,
}

/// Runs `builder`'s services as their binaries (built if missing) and waits
/// until each is ready, in start order, within `within` each.
pub async fn spawn_binaries(builder: &StackBuilder, within: Duration) -> Vec<BinaryService> {
    let binaries = builder
        .binaries()
        .unwrap_or_else(|error| panic!("the stack's binaries: {error}"));
    let mut services = Vec::new();
    for Binary {
        service,
        http_addr,
        env,
    } in binaries
    {
        let mut process = ProcessBuilder::binary(service.name(), service.name())
            .envs(env)
            .spawn();
        process.wait_ready(within).await;
        services.push(BinaryService {
            service,
            http_addr,
            process,
        });
    }
    services
}
