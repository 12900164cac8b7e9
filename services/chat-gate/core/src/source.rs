//! What the core needs from the world, as traits: where it reads an agent's
//! committed state (and learns that events may have been lost), where it
//! asks for a chat's catalog, and where it announces a first turn's wait.
//! The NATS adapters implement them over the services; tests
//! implement them in memory. Events themselves are handed to the core by
//! whoever receives them ([`crate::gate::Gate::apply_event`]).

use std::sync::Arc;

use ctxsync_proto::v1::{AgentState, CatalogSection, GateTurnWaited};
use futures::future::BoxFuture;
use tokio::sync::watch;

/// Why the state could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    /// The store did not answer, or failed: turns fail open.
    #[error("{0}")]
    Unavailable(String),
}

/// Where agents' committed states come from.
pub trait StateSource: Send + Sync + 'static {
    /// One consistent read of the agent row, its snapshot and resources.
    fn read<'a>(&'a self, agent_id: &'a str) -> BoxFuture<'a, Result<AgentState, ReadError>>;

    /// Changes whenever events may have been lost (a disconnect, a reconnect,
    /// a slow-consumer drop): views are only trusted between changes.
    fn gaps(&self) -> watch::Receiver<u64>;
}

/// Where a first turn's catalog section comes from (the chat is the catalog session).
pub trait CatalogSource: Send + Sync + 'static {
    /// Never fails: a catalog that does not answer is a `FAILED` section.
    fn prepare<'a>(&'a self, tenant: &'a str, chat_id: &'a str) -> BoxFuture<'a, CatalogSection>;
}

/// Told each first turn's decision and wait (no content), after the answer
/// is made; it must not block.
pub type WaitAnnouncer = Arc<dyn Fn(GateTurnWaited) + Send + Sync>;
