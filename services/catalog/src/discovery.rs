//! Live discovery: starting or opening a configured server and listing its
//! tools, prompts and resources. It alone writes the memory, and so the
//! shared memory bucket: a success replaces the server's entry (put), a
//! failure forgets it (delete). It bounds the stdio servers started at once for
//! users (preparations and calls; the warm-up runs on its own) and tracks the
//! servers closing after a discovery, so shutdown can wait for them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use catalog_core::events::ms;
use catalog_core::memory::{MemoryWrite, after_live};
use catalog_core::tools::Catalog;
use catalog_core::{Failure, Live};
use ctxsync_mcp::{Connection, Declarations, McpError, TransportKind};
use tokio::sync::{Semaphore, SemaphorePermit, mpsc};
use tokio_util::task::TaskTracker;

pub(crate) use catalog_core::events::Cause;

use crate::config::ConfiguredServer;
use crate::mcp;
use crate::memory::Memory;

/// A server opened for a session's calls: its connection stays open.
pub(crate) struct OpenServer {
    pub connection: Connection,
    pub catalog: Arc<Catalog>,
    pub duration: Duration,
    /// The server's `tools/list_changed` notifications.
    pub tools_changed: mpsc::UnboundedReceiver<String>,
}

pub(crate) struct Discoverer {
    memory: Memory,
    /// Bounds stdio starts for preparations and calls (not the warm-up's).
    starts: Semaphore,
    /// Servers closing after a discovery; shutdown waits for them.
    closing: TaskTracker,
}

impl Discoverer {
    pub fn new(memory: Memory, max_concurrent_starts: usize) -> Self {
        Self {
            memory,
            starts: Semaphore::new(max_concurrent_starts.max(1)),
            closing: TaskTracker::new(),
        }
    }

    /// What the memory says, for pinning without a start.
    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// Discovers `server` live: connect, list, close (in the background for
    /// a user, before returning for the warm-up, which goes strictly one
    /// server at a time).
    pub async fn discover(
        &self,
        server: &ConfiguredServer,
        timeout: Duration,
        cause: Cause,
    ) -> Result<Live, Failure> {
        // The warm-up never takes a start slot from a user.
        let _permit = if cause == Cause::Warmup {
            None
        } else {
            self.start_slot(server).await
        };
        let spec = server.spec();
        let started = Instant::now();
        let result = ctxsync_mcp::open_and_list_all(&spec, timeout, None)
            .await
            .map_err(|failed| failed.error);
        let result = match result {
            // The warm-up goes strictly one server at a time: it waits for the exit.
            Ok(opened) if cause == Cause::Warmup => {
                opened
                    .connection
                    .close_within(timeout.saturating_sub(started.elapsed()))
                    .await;
                Ok((opened.declared, opened.duration))
            }
            // A user waits for the declarations, not for the server to exit.
            Ok(opened) => {
                self.closing.spawn(opened.connection.close());
                Ok((opened.declared, opened.duration))
            }
            Err(error) => Err(error),
        };
        let result = match result {
            Ok((declared, duration)) => Ok(self.succeeded(server, declared, duration, cause)),
            Err(error) => Err(self.failed(server, &error, started.elapsed(), cause)),
        };
        self.learn(server, &result);
        let live = result?;
        tracing::debug!(
            tenant = %server.tenant, server = server.id(), cause = cause.as_str(),
            tools = live.catalog.tools.len(), prompts = live.catalog.prompts.len(),
            resources = live.catalog.resources.len(), duration_ms = ms(live.duration),
            "live discovery"
        );
        Ok(live)
    }

    /// Starts or opens `server` for a session's calls and lists its tools
    /// within `timeout`: a live discovery whose connection stays open.
    pub async fn open(
        &self,
        server: &ConfiguredServer,
        timeout: Duration,
    ) -> Result<OpenServer, Failure> {
        let _permit = self.start_slot(server).await;
        let (sender, tools_changed) = mpsc::unbounded_channel();
        let started = Instant::now();
        match ctxsync_mcp::open_and_list_all(&server.spec(), timeout, Some(sender)).await {
            Ok(opened) => {
                let live = self.succeeded(server, opened.declared, opened.duration, Cause::Call);
                self.learn(server, &Ok(live.clone()));
                Ok(OpenServer {
                    catalog: live.catalog,
                    connection: opened.connection,
                    duration: opened.duration,
                    tools_changed,
                })
            }
            Err(failed) => {
                let failure = self.failed(server, &failed.error, started.elapsed(), Cause::Call);
                self.learn(server, &Err(failure.clone()));
                tracing::info!(server = server.id(), error = %failure.message, "call-time connect failed");
                Err(failure)
            }
        }
    }

    /// An open server listed its tools again (after `tools/list_changed`):
    /// the list replaces the memory entry.
    pub fn relisted(
        &self,
        server: &ConfiguredServer,
        catalog: Arc<Catalog>,
        upstream_ttl: Option<Duration>,
    ) {
        let transport = mcp::transport_of(server.transport_kind());
        self.memory.write(
            &server.key,
            transport,
            MemoryWrite::Remember(catalog, upstream_ttl),
        );
    }

    /// Waits until every server closing after a discovery has exited, at
    /// most `grace`; returns whether they all did.
    pub async fn closed_within(&self, grace: Duration) -> bool {
        self.closing.close();
        tokio::time::timeout(grace, self.closing.wait())
            .await
            .is_ok()
    }

    async fn start_slot(&self, server: &ConfiguredServer) -> Option<SemaphorePermit<'_>> {
        if server.transport_kind() != TransportKind::Stdio {
            return None;
        }
        Some(
            self.starts
                .acquire()
                .await
                .expect("start semaphore never closes"),
        )
    }

    fn succeeded(
        &self,
        server: &ConfiguredServer,
        declared: Declarations,
        duration: Duration,
        cause: Cause,
    ) -> Live {
        metrics::histogram!(
            "ctxsync_catalog_handshake_seconds",
            "transport" => server.transport_kind().as_str(),
            "cause" => cause.as_str(),
        )
        .record(duration.as_secs_f64());
        Live {
            upstream_ttl: declared.ttl,
            catalog: Arc::new(mcp::catalog_of(declared)),
            duration,
        }
    }

    fn failed(
        &self,
        server: &ConfiguredServer,
        error: &McpError,
        duration: Duration,
        cause: Cause,
    ) -> Failure {
        let failure = mcp::failure(&server.spec(), error, duration);
        metrics::counter!(
            "ctxsync_catalog_handshake_failures_total",
            "transport" => server.transport_kind().as_str(),
            "cause" => cause.as_str(),
            "kind" => failure.kind,
        )
        .increment(1);
        failure
    }

    /// What a live attempt teaches the memory (the core's rule: a success
    /// replaces the entry, a failure forgets it), here and in the bucket.
    fn learn(&self, server: &ConfiguredServer, result: &Result<Live, Failure>) {
        let transport = mcp::transport_of(server.transport_kind());
        self.memory
            .write(&server.key, transport, after_live(result));
    }
}
