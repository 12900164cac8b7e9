//! The workspace agent: runs inside a workspace, discovers its context
//! (instruction files, skills, MCP servers from `.mcp.json` files) and keeps
//! agent-ingest told with one discovery report per change.
//!
//! * [`context_config`] — where to look (`CTXSYNC_*` env vars, resolved locally);
//! * [`context`] — instruction files and skills;
//! * [`mcp_config`] — MCP config files, servers deduplicated by name;
//! * [`discovery`] — the actor that connects servers (via `ctxsync-mcp`) and
//!   keeps the current [`report::Report`];
//! * [`publisher`] — Startup and pushes to agent-ingest over HTTP, as
//!   `publisher_core`'s state machine decides (retried, coalesced, reclaimed);
//! * [`agent`] — all of it wired together (`start`/`run`); [`inspect`] — once, printed.
//!
//! Resource `source` keys: `instruction_file:<path>`, `skill:<dir>`,
//! `mcp_config:<path>`, `mcp_server:<name>`.

pub mod agent;
pub mod args;
pub mod context;
pub mod context_config;
pub mod discovery;
pub mod inspect;
pub mod mcp_config;
pub mod publisher;
pub mod report;
pub mod series;
mod text;
pub mod watch;

pub use agent::{AgentConfig, AgentError, Running, run, start};
pub use context_config::ContextConfig;
pub use discovery::DiscoverySettings;
pub use publisher::{
    AGENT_VERSION, AgentToken, Backoff, PublishError, PublishStatus, Publisher, PublisherConfig,
};
pub use report::Report;
