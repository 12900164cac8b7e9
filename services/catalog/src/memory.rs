//! The discovery memory: the last successful discovery of each server key
//! (design note: the catalog's shared memory).
//!
//! Two levels: this process's map, which every read uses (preparation's fast
//! path never leaves the process), and, when the catalog shares its memory,
//! the JetStream key-value bucket every replica writes and watches
//! (`bucket`). Every change of the bucket, this replica's own writes
//! included, reaches the map through the watch; this replica's writes reach
//! its map at once too.
//!
//! Every live discovery replaces the entry; a failed live attempt forgets it
//! (everywhere). A stdio entry is reused until it is replaced or forgotten; a
//! streamable-HTTP one for at most the reuse window after its discovery
//! (its time is in the entry, so the window ends at the same moment on every
//! replica), because a third party can change it any time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::bucket::{Bucket, Change, Entry, RELEASE};
use crate::config::ServerKey;
use crate::tools::Catalog;
use ctxsync_mcp::TransportKind;

#[derive(Clone, Debug)]
pub struct Remembered {
    pub catalog: Arc<Catalog>,
    pub transport: TransportKind,
    /// When the discovery finished, by its writer's clock.
    pub discovered_at: SystemTime,
    /// The release of the catalog that discovered it.
    pub release: Arc<str>,
}

impl Remembered {
    /// Written by another release of the catalog: pinnable, but the warm-up
    /// re-discovers it first.
    pub fn is_foreign(&self) -> bool {
        &*self.release != RELEASE
    }

    fn age(&self) -> Duration {
        SystemTime::now()
            .duration_since(self.discovered_at)
            .unwrap_or_default()
    }
}

/// The first level: this process's map, and a counter raised by every change.
#[derive(Debug)]
struct Local {
    entries: Mutex<HashMap<ServerKey, Remembered>>,
    changed: watch::Sender<u64>,
}

impl Local {
    fn update(&self, change: impl FnOnce(&mut HashMap<ServerKey, Remembered>)) {
        let mut entries = self.entries.lock().expect("memory lock");
        change(&mut entries);
        metrics::gauge!("ctxsync_catalog_memory_entries").set(entries.len() as f64);
        drop(entries);
        self.changed.send_modify(|n| *n += 1);
    }

    fn apply(&self, change: Change) {
        self.update(|entries| match change {
            Change::Put(key, entry) => {
                entries.insert(
                    key,
                    Remembered {
                        catalog: Arc::new(entry.catalog),
                        transport: entry.transport,
                        discovered_at: entry.discovered_at,
                        release: entry.release.into(),
                    },
                );
            }
            Change::Delete(key) => {
                entries.remove(&key);
            }
        });
    }
}

pub struct Memory {
    local: Arc<Local>,
    http_reuse: Duration,
    bucket: Option<Arc<Bucket>>,
}

impl Memory {
    /// A memory in this process only.
    pub fn new(http_reuse: Duration) -> Self {
        Self {
            local: Arc::new(Local {
                entries: Mutex::new(HashMap::new()),
                changed: watch::Sender::new(0),
            }),
            http_reuse,
            bucket: None,
        }
    }

    /// A memory shared through `bucket` once [`Memory::start_sharing`] ran.
    pub(crate) fn shared(http_reuse: Duration, bucket: Arc<Bucket>) -> Self {
        Self {
            bucket: Some(bucket),
            ..Self::new(http_reuse)
        }
    }

    /// Loads the bucket's entries into this process's map (bounded: a
    /// bucket that fails or is slow leaves the map to fill later), then keeps
    /// the map fed by the bucket's changes until shutdown.
    pub async fn start_sharing(&self, shutdown: ctxsync_runtime::Shutdown) -> Vec<JoinHandle<()>> {
        let Some(bucket) = &self.bucket else {
            return Vec::new();
        };
        let local = self.local.clone();
        bucket
            .start(Arc::new(move |change| local.apply(change)), shutdown)
            .await
    }

    /// The bucket the memory is shared through, if any.
    pub(crate) fn bucket(&self) -> Option<&Arc<Bucket>> {
        self.bucket.as_ref()
    }

    /// The entry if the rules allow pinning it without starting the server.
    pub fn reusable(&self, key: &ServerKey) -> Option<Remembered> {
        let entries = self.local.entries.lock().expect("memory lock");
        let entry = entries.get(key)?;
        match entry.transport {
            TransportKind::Stdio => Some(entry.clone()),
            TransportKind::StreamableHttp => {
                (entry.age() <= self.http_reuse).then(|| entry.clone())
            }
        }
    }

    /// A reusable entry of this release discovered at or after `since`: the
    /// warm-up need not discover the server again.
    pub fn warmed_since(&self, key: &ServerKey, since: SystemTime) -> bool {
        self.reusable(key)
            .is_some_and(|r| !r.is_foreign() && r.discovered_at >= since)
    }

    /// Changes whenever the map changes (any replica's write included).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.local.changed.subscribe()
    }

    /// A live discovery succeeded: it replaces whatever was remembered, here
    /// and in the bucket.
    pub fn remember(&self, key: &ServerKey, transport: TransportKind, catalog: Arc<Catalog>) {
        let discovered_at = SystemTime::now();
        if let Some(bucket) = &self.bucket {
            bucket.put(
                key,
                &Entry {
                    transport,
                    catalog: (*catalog).clone(),
                    discovered_at,
                    release: RELEASE.to_owned(),
                },
            );
        }
        self.local.update(|entries| {
            entries.insert(
                key.clone(),
                Remembered {
                    catalog,
                    transport,
                    discovered_at,
                    release: RELEASE.into(),
                },
            );
        });
    }

    /// A live attempt failed: the server is left to live discovery next
    /// time, here and on every replica.
    pub fn forget(&self, key: &ServerKey) {
        if let Some(bucket) = &self.bucket {
            bucket.delete(key);
        }
        self.local.update(|entries| {
            entries.remove(key);
        });
    }

    pub fn len(&self) -> usize {
        self.local.entries.lock().expect("memory lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory")
            .field("entries", &self.len())
            .field("shared", &self.bucket.as_ref().map(|b| b.name().to_owned()))
            .finish()
    }
}
