//! The ctxsync contract: the protobuf messages every service exchanges, their
//! proto3 JSON mapping, the NATS subject names, and the request/reply calls
//! that join them (`rpc`).
//!
//! Messages are generated at build time from `ctxsync/v1/*.proto` with protox
//! and prost, so building needs no `protoc`.

mod decision;
pub mod ids;
pub mod rpc;
pub mod subjects;
pub mod unknown;
pub mod validate;

#[allow(clippy::all, clippy::pedantic, rust_2018_idioms, missing_docs)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/ctxsync.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/ctxsync.v1.serde.rs"));

    /// The protobuf descriptor set of every ctxsync message (for reflection and tooling).
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/ctxsync_descriptor.bin"));
}

pub use prost::Message;

pub use v1::FILE_DESCRIPTOR_SET;

/// Limits of the agent API, enforced at agent-ingest and again at the store.
pub mod limits {
    /// `agent_run_id`, in bytes.
    pub const MAX_RUN_ID_BYTES: usize = 64;
    /// Resources in one push.
    pub const MAX_RESOURCES: usize = 1000;
    /// One resource's encoded body, in bytes.
    pub const MAX_RESOURCE_BODY_BYTES: usize = 256 * 1024;
    /// One HTTP request body, in bytes.
    pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;
    /// A resource's `source`, in bytes.
    pub const MAX_SOURCE_BYTES: usize = 1024;
    /// A resource's `error` or `warning` text, in bytes.
    pub const MAX_ERROR_BYTES: usize = 4096;
    /// `agent_version`, in bytes.
    pub const MAX_AGENT_VERSION_BYTES: usize = 256;
}
