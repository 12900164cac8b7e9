//! The discovery memory: the last successful discovery of each server key,
//! in this process only (a release restarts the process and so empties it).
//!
//! Every live discovery replaces the entry; a failed live attempt forgets it.
//! A stdio entry is reused for the life of the process; a streamable-HTTP one
//! for at most the reuse window, because a third party can change it any time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::ServerKey;
use crate::tools::Catalog;
use ctxsync_mcp::TransportKind;

#[derive(Clone, Debug)]
pub struct Remembered {
    pub catalog: Arc<Catalog>,
    pub transport: TransportKind,
    pub discovered_at: Instant,
}

#[derive(Debug)]
pub struct Memory {
    entries: Mutex<HashMap<ServerKey, Remembered>>,
    http_reuse: Duration,
}

impl Memory {
    pub fn new(http_reuse: Duration) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            http_reuse,
        }
    }

    /// The entry if the rules allow pinning it without starting the server.
    pub fn reusable(&self, key: &ServerKey) -> Option<Remembered> {
        let entries = self.entries.lock().expect("memory lock");
        let entry = entries.get(key)?;
        match entry.transport {
            TransportKind::Stdio => Some(entry.clone()),
            TransportKind::StreamableHttp => {
                (entry.discovered_at.elapsed() <= self.http_reuse).then(|| entry.clone())
            }
        }
    }

    /// A live discovery succeeded: it replaces whatever was remembered.
    pub fn remember(&self, key: &ServerKey, transport: TransportKind, catalog: Arc<Catalog>) {
        let mut entries = self.entries.lock().expect("memory lock");
        entries.insert(
            key.clone(),
            Remembered {
                catalog,
                transport,
                discovered_at: Instant::now(),
            },
        );
        metrics::gauge!("ctxsync_catalog_memory_entries").set(entries.len() as f64);
    }

    /// A live attempt failed: the server is left to live discovery next time.
    pub fn forget(&self, key: &ServerKey) {
        let mut entries = self.entries.lock().expect("memory lock");
        entries.remove(key);
        metrics::gauge!("ctxsync_catalog_memory_entries").set(entries.len() as f64);
    }

    pub fn len(&self) -> usize {
        self.entries.lock().expect("memory lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
