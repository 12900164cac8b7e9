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
//!
//! The map is bounded (entries and bytes, the bucket's own bounds): a new
//! key past either is refused and counted, said once when it fills; an
//! entry it holds is still replaced or forgotten.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use catalog_core::memory::{MemoryMap, MemoryWrite, Put, Removed, Reuse};
use catalog_core::tools::Catalog;
use catalog_core::{Discovery, Transport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::bucket::{Bucket, Change, Entry, Ignored, RELEASE};
use crate::config::ServerKey;

pub use catalog_core::memory::Bounds;

/// The first level: this process's map (the core's bounded map), and a
/// counter raised by every change.
#[derive(Debug)]
struct Local {
    map: Mutex<MemoryMap<ServerKey>>,
    changed: watch::Sender<u64>,
}

impl Local {
    /// Puts `entry` unless it is a new key past the bounds (counted, said
    /// once); whether it was put.
    fn put(&self, key: ServerKey, entry: Discovery, size: usize) -> bool {
        let mut map = self.map.lock().expect("memory lock");
        let key_text = key.as_str().to_owned();
        match map.put(key, entry, size) {
            Put::Stored => {
                self.changed_locked(map);
                true
            }
            Put::Refused { newly_full } => {
                Ignored::Full.count();
                if newly_full {
                    let bounds = map.bounds();
                    tracing::warn!(
                        server_key = key_text,
                        entries = map.len(),
                        bytes = map.bytes(),
                        max_entries = bounds.max_entries,
                        max_bytes = bounds.max_bytes,
                        "catalog memory full: servers not remembered yet are discovered live until entries are forgotten"
                    );
                }
                false
            }
        }
    }

    fn contains(&self, key: &ServerKey) -> bool {
        self.map.lock().expect("memory lock").contains(key)
    }

    fn remove(&self, key: &ServerKey) {
        let mut map = self.map.lock().expect("memory lock");
        if let Removed::Removed { room_again: true } = map.remove(key) {
            tracing::info!(entries = map.len(), "catalog memory has room again");
        }
        self.changed_locked(map);
    }

    fn changed_locked(&self, map: std::sync::MutexGuard<'_, MemoryMap<ServerKey>>) {
        metrics::gauge!("ctxsync_catalog_memory_entries").set(map.len() as f64);
        metrics::gauge!("ctxsync_catalog_memory_bytes").set(map.bytes() as f64);
        drop(map);
        self.changed.send_modify(|n| *n += 1);
    }

    fn apply(&self, change: Change) {
        match change {
            Change::Put(key, entry, size) => {
                self.put(
                    key,
                    Discovery {
                        catalog: Arc::new(entry.catalog),
                        transport: entry.transport,
                        discovered_at: entry.discovered_at,
                        release: entry.release.into(),
                        upstream_ttl: entry.upstream_ttl,
                    },
                    size,
                );
            }
            Change::Delete(key) => self.remove(&key),
        }
    }
}

pub struct Memory {
    local: Arc<Local>,
    reuse: Reuse,
    bucket: Option<Arc<Bucket>>,
}

impl Memory {
    /// A memory in this process only.
    pub fn new(http_reuse: Duration, bounds: Bounds) -> Self {
        Self {
            local: Arc::new(Local {
                map: Mutex::new(MemoryMap::new(bounds)),
                changed: watch::Sender::new(0),
            }),
            reuse: Reuse {
                http_window: http_reuse,
            },
            bucket: None,
        }
    }

    /// A memory shared through `bucket` once [`Memory::start_sharing`] ran.
    pub(crate) fn shared(http_reuse: Duration, bounds: Bounds, bucket: Arc<Bucket>) -> Self {
        Self {
            bucket: Some(bucket),
            ..Self::new(http_reuse, bounds)
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

    /// The reuse rules the memory applies.
    pub fn reuse(&self) -> Reuse {
        self.reuse
    }

    /// The entry if the rules allow pinning it without starting the server.
    pub fn reusable(&self, key: &ServerKey) -> Option<Discovery> {
        let map = self.local.map.lock().expect("memory lock");
        map.reusable(key, self.reuse, SystemTime::now()).cloned()
    }

    /// A reusable entry of this release discovered at or after `since`: the
    /// warm-up need not discover the server again.
    pub fn warmed_since(&self, key: &ServerKey, since: SystemTime) -> bool {
        let map = self.local.map.lock().expect("memory lock");
        map.warmed_since(key, self.reuse, SystemTime::now(), since, RELEASE)
    }

    /// Reads `key`'s entry from the bucket itself into this process's map,
    /// unless the map holds one as new: the watch may not have delivered
    /// another replica's acknowledged put yet. Only a put is applied (a
    /// delete read here could undo a newer write of this replica).
    pub(crate) async fn refresh(&self, key: &ServerKey) {
        let Some(bucket) = &self.bucket else {
            return;
        };
        let Some(Change::Put(key, entry, size)) = bucket.current(key).await else {
            return;
        };
        let newer_here = {
            let map = self.local.map.lock().expect("memory lock");
            map.get(&key)
                .is_some_and(|held| held.discovered_at >= entry.discovered_at)
        };
        if !newer_here {
            self.local.apply(Change::Put(key, entry, size));
        }
    }

    /// Changes whenever the map changes (any replica's write included).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.local.changed.subscribe()
    }

    /// What a live attempt decided ([`catalog_core::memory::after_live`]).
    pub fn write(&self, key: &ServerKey, transport: Transport, write: MemoryWrite) {
        match write {
            MemoryWrite::Remember(catalog, upstream_ttl) => {
                self.remember(key, transport, catalog, upstream_ttl);
            }
            MemoryWrite::Forget => self.forget(key),
        }
    }

    /// A live discovery succeeded: it replaces whatever was remembered, here
    /// and in the bucket (unless the map is full: then in neither).
    fn remember(
        &self,
        key: &ServerKey,
        transport: Transport,
        catalog: Arc<Catalog>,
        upstream_ttl: Option<Duration>,
    ) {
        let entry = Entry {
            transport,
            catalog: (*catalog).clone(),
            discovered_at: SystemTime::now(),
            release: RELEASE.to_owned(),
            upstream_ttl,
        };
        let remembered = Discovery {
            catalog,
            transport,
            discovered_at: entry.discovered_at,
            release: RELEASE.into(),
            upstream_ttl,
        };
        let size = crate::bucket::sealed_len(&entry);
        if self.local.put(key.clone(), remembered, size) {
            if let Some(bucket) = &self.bucket {
                bucket.put(key, &entry);
            }
        } else if self.local.contains(key) {
            // Too large to replace it: what it held is no longer what the server says.
            self.forget(key);
        }
    }

    /// A live attempt failed: the server is left to live discovery next
    /// time, here and on every replica.
    fn forget(&self, key: &ServerKey) {
        if let Some(bucket) = &self.bucket {
            bucket.delete(key);
        }
        self.local.remove(key);
    }

    pub fn len(&self) -> usize {
        self.local.map.lock().expect("memory lock").len()
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
