//! The discovery memory as data: the last successful discovery of each
//! server key, and the rules of what may be pinned from it.
//!
//! * Every live discovery replaces the server's entry; a failed live
//!   attempt forgets it ([`after_live`]).
//! * A stdio entry is reused until it is replaced or forgotten; a
//!   streamable-HTTP one for at most the reuse window after its discovery
//!   ([`Reuse`]), because a third party can change it any time. The window
//!   runs from the discovery time in the entry, so it ends at the same
//!   moment wherever the entry is held.
//! * The map is bounded in entries and bytes ([`MemoryMap::put`]): a new
//!   key past either is refused (and said once, when it fills); an entry it
//!   holds is still replaced or forgotten.
//! * A write the shared bucket did not take is tried again once it works,
//!   unless something newer was written there meanwhile ([`write_back`]).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ctxsync_proto::v1::McpTransport;

use crate::tools::Catalog;

/// How a server is reached: what the memory's reuse and the process bounds
/// key on. A legacy SSE server is reached over HTTP, so it is of the HTTP kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    Stdio,
    StreamableHttp,
}

impl Transport {
    /// As stored and in event payloads (`stdio`, `streamable_http`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stdio => "stdio",
            Self::StreamableHttp => "streamable_http",
        }
    }

    /// The transport named by [`Transport::as_str`]; `None` for any other text.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "stdio" => Some(Self::Stdio),
            "streamable_http" => Some(Self::StreamableHttp),
            _ => None,
        }
    }

    pub fn to_proto(self) -> McpTransport {
        match self {
            Self::Stdio => McpTransport::Stdio,
            Self::StreamableHttp => McpTransport::StreamableHttp,
        }
    }
}

/// One server's last successful discovery.
#[derive(Clone, Debug)]
pub struct Discovery {
    pub catalog: Arc<Catalog>,
    pub transport: Transport,
    /// When the discovery finished, by its writer's clock.
    pub discovered_at: SystemTime,
    /// The release of the catalog that discovered it.
    pub release: Arc<str>,
    /// How long the server itself said its lists stay fresh (the shortest
    /// `ttlMs` they carried), if it said.
    pub upstream_ttl: Option<Duration>,
}

impl Discovery {
    /// How long after the discovery its lists may be reused: the server's
    /// own hint when shorter than the operator's window, else the window.
    pub fn http_reuse(&self, reuse: Reuse) -> Duration {
        self.upstream_ttl
            .map_or(reuse.http_window, |ttl| ttl.min(reuse.http_window))
    }

    /// Written by another release than `release`: pinnable, but the warm-up
    /// re-discovers it first.
    pub fn is_foreign(&self, release: &str) -> bool {
        &*self.release != release
    }
}

/// When a remembered discovery may be pinned without starting its server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reuse {
    /// How long a streamable-HTTP discovery is reused after it finished.
    pub http_window: Duration,
}

impl Reuse {
    pub fn allows(&self, discovery: &Discovery, now: SystemTime) -> bool {
        match discovery.transport {
            Transport::Stdio => true,
            Transport::StreamableHttp => {
                let age = now
                    .duration_since(discovery.discovered_at)
                    .unwrap_or_default();
                age <= discovery.http_reuse(*self)
            }
        }
    }
}

/// A successful live discovery.
#[derive(Clone, Debug)]
pub struct Live {
    pub catalog: Arc<Catalog>,
    /// Connect and discovery.
    pub duration: Duration,
    /// The server's own cache hint for its lists, if it gave one.
    pub upstream_ttl: Option<Duration>,
}

/// A failed live attempt, safe to log, store and send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Stable name of the error kind (`timeout`, `spawn`, `exited`, ...).
    pub kind: &'static str,
    /// Sanitized of the server's secrets.
    pub message: String,
    pub duration: Duration,
}

/// What a live attempt does to the server's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryWrite {
    /// Replaces whatever was remembered (with the server's own cache hint).
    Remember(Arc<Catalog>, Option<Duration>),
    /// Leaves the server to live discovery next time.
    Forget,
}

/// Every live discovery replaces the entry; a failed live attempt forgets it.
pub fn after_live(result: &Result<Live, Failure>) -> MemoryWrite {
    match result {
        Ok(live) => MemoryWrite::Remember(live.catalog.clone(), live.upstream_ttl),
        Err(_) => MemoryWrite::Forget,
    }
}

/// How much a [`MemoryMap`] may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub max_entries: usize,
    pub max_bytes: u64,
}

/// What [`MemoryMap::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Stored,
    /// A new key past the bounds, or a value that does not fit: not stored.
    /// `newly_full` once, when the map first refuses since it last had room.
    Refused {
        newly_full: bool,
    },
}

/// What [`MemoryMap::remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    Absent,
    /// `room_again` when the map had refused a put and has room now.
    Removed {
        room_again: bool,
    },
}

/// Remembered discoveries by server key, bounded in entries and bytes (a
/// value's size is what it takes where it is shared).
#[derive(Debug)]
pub struct MemoryMap<K> {
    entries: HashMap<K, (Discovery, usize)>,
    bytes: u64,
    bounds: Bounds,
    /// Whether a put was refused since the map last had room.
    full: bool,
}

impl<K: Eq + Hash> MemoryMap<K> {
    pub fn new(bounds: Bounds) -> Self {
        Self {
            entries: HashMap::new(),
            bytes: 0,
            bounds,
            full: false,
        }
    }

    /// Stores `discovery` under `key` unless it is a new key past the entry
    /// bound or the bytes would pass theirs.
    pub fn put(&mut self, key: K, discovery: Discovery, size: usize) -> Put {
        let replaced = self.entries.get(&key).map_or(0, |(_, old)| *old as u64);
        let bytes = self.bytes - replaced + size as u64;
        let grows = !self.entries.contains_key(&key);
        if (grows && self.entries.len() >= self.bounds.max_entries) || bytes > self.bounds.max_bytes
        {
            let newly_full = !self.full;
            self.full = true;
            return Put::Refused { newly_full };
        }
        self.bytes = bytes;
        self.entries.insert(key, (discovery, size));
        Put::Stored
    }

    pub fn remove(&mut self, key: &K) -> Removed {
        let Some((_, size)) = self.entries.remove(key) else {
            return Removed::Absent;
        };
        self.bytes -= size as u64;
        let room_again = std::mem::take(&mut self.full);
        Removed::Removed { room_again }
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    pub fn get(&self, key: &K) -> Option<&Discovery> {
        self.entries.get(key).map(|(discovery, _)| discovery)
    }

    /// The entry if `reuse` allows pinning it at `now` without a start.
    pub fn reusable(&self, key: &K, reuse: Reuse, now: SystemTime) -> Option<&Discovery> {
        self.get(key).filter(|d| reuse.allows(d, now))
    }

    /// A reusable entry of `release` discovered at or after `since`: the
    /// warm-up need not discover the server again.
    pub fn warmed_since(
        &self,
        key: &K,
        reuse: Reuse,
        now: SystemTime,
        since: SystemTime,
        release: &str,
    ) -> bool {
        self.reusable(key, reuse, now)
            .is_some_and(|d| !d.is_foreign(release) && d.discovered_at >= since)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The sizes of the values held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn bounds(&self) -> Bounds {
        self.bounds
    }
}

/// A write of this replica that the shared bucket did not take (it was
/// unreachable, or refused for any reason but being full): the entry it
/// put, or the forgetting, and when it was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unshared {
    /// An entry discovered at this time.
    Put(SystemTime),
    /// The entry was forgotten (a failed live attempt) at this time.
    Forget(SystemTime),
}

/// What the bucket holds for the key when an unshared write is tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InBucket {
    Nothing,
    /// A replica's entry discovered at this time.
    Entry(SystemTime),
    /// A delete marker stored at this time (the bucket's clock).
    Forgotten(SystemTime),
    /// A value no replica sealed: never applied by anyone.
    Unreadable,
}

/// Whether an unshared write goes into the bucket once it works again:
/// only where nothing newer was written meanwhile (a discovery or a
/// forgetting of another replica is never undone by an older one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteBack {
    Write,
    /// The bucket holds something as new or newer: the write is dropped.
    Superseded,
    /// Forgetting what the bucket does not hold: nothing to do.
    AlreadyForgotten,
}

/// What to do with `unshared` over `in_bucket`: the later of the two wins.
/// On a tie a put leaves the bucket's entry (every replica has it already)
/// and a forgetting still forgets (that only costs a live discovery).
pub fn write_back(unshared: Unshared, in_bucket: InBucket) -> WriteBack {
    match (unshared, in_bucket) {
        (Unshared::Put(at), InBucket::Entry(there) | InBucket::Forgotten(there)) if there >= at => {
            WriteBack::Superseded
        }
        (Unshared::Put(_), _) => WriteBack::Write,
        (Unshared::Forget(at), InBucket::Entry(there)) if there > at => WriteBack::Superseded,
        (Unshared::Forget(_), InBucket::Entry(_)) => WriteBack::Write,
        (
            Unshared::Forget(_),
            InBucket::Nothing | InBucket::Forgotten(_) | InBucket::Unreadable,
        ) => WriteBack::AlreadyForgotten,
    }
}
