//! The shared memory's JetStream side: a key-value bucket holding one entry
//! per server key, and a second bucket of warm-up claims
//! (design note: the catalog's shared memory).
//!
//! * The memory bucket's key is the server key (already a SHA-256, so it
//!   says nothing of the configuration); its value a `CatalogMemoryEntry`:
//!   transport, tools, catalog hash, discovery time and the writer's release,
//!   sealed: `cxm1`, then an HMAC-SHA256 of the bucket, the key and the entry
//!   under the [`MemoryKey`] only catalog replicas hold, then the entry. A
//!   value without a valid seal (anyone else's write, a reply aimed at the
//!   bucket) is ignored and counted, never applied. A delete carries no seal:
//!   forgetting is always safe, it costs a live discovery.
//! * Claims carry no seal: a claim only decides which replica warms a
//!   server; a forged one delays a warm-up (the server is then discovered
//!   at its first use), never changes what is pinned.
//! * Both buckets are created when missing (`memory_replicas`, the memory's
//!   `max_age`, the claims' expiry; the memory bounded in entries, bytes
//!   and value size, refusing what is past them); an existing bucket is
//!   used as it is.
//! * A supervisor task keeps a watch of the memory bucket open, feeding every
//!   change to the in-process memory; when the bucket fails (JetStream off,
//!   unreachable, refused) it says so once, retries with a backoff and says
//!   once when it is back. Claims meanwhile do nothing: the catalog serves
//!   from its in-process memory. Writes the bucket did not take are held,
//!   the latest per key, and written back once it works again, each only
//!   where the bucket holds nothing newer (`write_back`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use catalog_core::Transport;
use catalog_core::memory::{InBucket, Unshared, WriteBack};
use catalog_core::tools::Catalog;
use ctxsync_mcp::{Declarations, PromptDecl, ResourceDecl, ToolDecl};
use ctxsync_proto::v1::{CatalogMemoryEntry, McpTool, McpTransport};
use futures::StreamExt as _;
use prost::Message as _;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::config::ServerKey;
use crate::mcp;

/// The largest sealed value the memory takes (one server's declarations).
/// The header a key-value delete or purge carries (async-nats keeps its own private).
const KV_OPERATION: &str = "KV-Operation";

pub const MAX_VALUE_BYTES: usize = 1024 * 1024;
/// The shortest memory key.
pub const MIN_MEMORY_KEY_BYTES: usize = 32;
/// What a sealed value starts with.
const SEAL_MAGIC: &[u8; 4] = b"cxm1";
const TAG_BYTES: usize = 32;
/// What the tag is of, besides the bucket, the key and the entry.
const SEAL_CONTEXT: &[u8] = b"ctxsync catalog memory entry v1";

/// The secret only catalog replicas hold: each memory entry carries an
/// HMAC-SHA256 under it, so only a replica's writes are ever applied.
#[derive(Clone)]
pub struct MemoryKey {
    key: ring::hmac::Key,
    /// Made up by this process (no key file): shared with no replica.
    random: bool,
}

impl std::fmt::Debug for MemoryKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryKey")
            .field("random", &self.random)
            .finish_non_exhaustive()
    }
}

impl MemoryKey {
    /// A key from `secret` (at least [`MIN_MEMORY_KEY_BYTES`]).
    pub fn new(secret: &[u8]) -> Result<Self, String> {
        if secret.len() < MIN_MEMORY_KEY_BYTES {
            return Err(format!(
                "holds {} bytes; at least {MIN_MEMORY_KEY_BYTES} are needed (e.g. the output of `openssl rand -base64 48`)",
                secret.len()
            ));
        }
        Ok(Self {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
            random: false,
        })
    }

    /// The key a file holds (trailing whitespace, such as a final newline, is
    /// not part of it); the error says why it cannot be used, not what it holds.
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot be read: {e}"))?;
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |at| at + 1);
        Self::new(&bytes[..end])
    }

    /// A key of this process alone: its entries are applied by no other replica.
    pub fn random() -> Self {
        let rng = ring::rand::SystemRandom::new();
        let key = ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng)
            .expect("the system's random source works");
        Self { key, random: true }
    }

    pub fn is_random(&self) -> bool {
        self.random
    }

    fn message(bucket: &str, key: &str, entry: &[u8]) -> Vec<u8> {
        let mut message =
            Vec::with_capacity(SEAL_CONTEXT.len() + bucket.len() + key.len() + entry.len() + 2);
        // Bucket names and keys hold no NUL: the separators keep them apart.
        for part in [SEAL_CONTEXT, bucket.as_bytes(), key.as_bytes()] {
            message.extend_from_slice(part);
            message.push(0);
        }
        message.extend_from_slice(entry);
        message
    }

    /// `entry` sealed for `key` of `bucket`.
    pub fn seal(&self, bucket: &str, key: &str, entry: &[u8]) -> Bytes {
        let tag = ring::hmac::sign(&self.key, &Self::message(bucket, key, entry));
        let mut sealed = Vec::with_capacity(SEAL_MAGIC.len() + TAG_BYTES + entry.len());
        sealed.extend_from_slice(SEAL_MAGIC);
        sealed.extend_from_slice(tag.as_ref());
        sealed.extend_from_slice(entry);
        sealed.into()
    }

    /// The entry of a sealed value, if a holder of this key sealed it for
    /// `key` of `bucket`.
    pub fn open<'v>(&self, bucket: &str, key: &str, value: &'v [u8]) -> Result<&'v [u8], Ignored> {
        let Some(rest) = value.strip_prefix(SEAL_MAGIC.as_slice()) else {
            return Err(Ignored::Unsealed);
        };
        if rest.len() < TAG_BYTES {
            return Err(Ignored::Unsealed);
        }
        let (tag, entry) = rest.split_at(TAG_BYTES);
        ring::hmac::verify(&self.key, &Self::message(bucket, key, entry), tag)
            .map_err(|_| Ignored::BadTag)?;
        Ok(entry)
    }
}

/// Why a value of the memory bucket is not applied (the label of
/// `ctxsync_catalog_memory_refused_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// Not a sealed value: written by something other than a catalog.
    Unsealed,
    /// Sealed under another key, or for another key or bucket.
    BadTag,
    /// Sealed, but not an entry.
    Undecodable,
    /// Its key is no server key.
    BadKey,
    /// Over [`MAX_VALUE_BYTES`].
    TooLarge,
    /// The memory holds as many entries or bytes as it may.
    Full,
}

impl Ignored {
    pub fn label(self) -> &'static str {
        match self {
            Self::Unsealed => "unsealed",
            Self::BadTag => "bad_tag",
            Self::Undecodable => "undecodable",
            Self::BadKey => "bad_key",
            Self::TooLarge => "too_large",
            Self::Full => "full",
        }
    }

    /// Counts one value not applied.
    pub fn count(self) {
        metrics::counter!("ctxsync_catalog_memory_refused_total", "reason" => self.label())
            .increment(1);
    }
}

/// This catalog's release: entries of another one are re-discovered first.
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");

/// How long a start waits for the bucket's entries before serving without
/// them, and the warm-up, after that, for a bucket not open yet.
pub(crate) const LOAD_BOUND: Duration = Duration::from_secs(10);
/// The pauses between attempts to reopen a failed bucket: 1 s, doubling to
/// at most 30 s, for as long as it fails.
fn reopen_delays() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder as _;
    backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_secs(1))
        .with_factor(2.0)
        .with_max_delay(Duration::from_secs(30))
        .without_max_times()
        .build()
}

/// Where the shared memory lives and how it is kept.
#[derive(Debug, Clone)]
pub struct BucketSettings {
    /// The memory bucket; the claims bucket is its name with `_claims`.
    pub name: String,
    /// Replicas of both buckets (a JetStream cluster keeps up to 5).
    pub replicas: usize,
    /// Entries nobody re-puts for this long age out of the memory bucket.
    pub max_age: Duration,
    /// A claim lapses after this long (a dead replica's claim included).
    pub claim_ttl: Duration,
    /// Seals the entries this replica writes and opens those it reads.
    pub key: MemoryKey,
    /// The memory bucket holds at most this many entries …
    pub max_entries: usize,
    /// … and this many bytes (both set when the catalog creates it).
    pub max_bytes: u64,
}

/// The claims bucket of a memory bucket.
pub fn claims_bucket(name: &str) -> String {
    format!("{name}_claims")
}

/// One remembered discovery as the bucket holds it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub transport: Transport,
    pub catalog: Catalog,
    pub discovered_at: SystemTime,
    pub release: String,
    /// The server's own cache hint for its lists, if it gave one.
    pub upstream_ttl: Option<Duration>,
}

/// A change of the memory bucket, in bucket order.
#[derive(Debug)]
pub enum Change {
    /// An entry and the size of its value in the bucket.
    Put(ServerKey, Entry, usize),
    Delete(ServerKey),
}

#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("cannot open the key-value bucket {bucket}: {reason}")]
    Open { bucket: String, reason: String },
    #[error("the watch of the key-value bucket {bucket} failed: {reason}")]
    Watch { bucket: String, reason: String },
    #[error("the watch of the key-value bucket {bucket} ended")]
    WatchEnded { bucket: String },
}

pub fn encode(entry: &Entry) -> Bytes {
    let transport = entry.transport.to_proto();
    let discovered_at_unix_ms = entry
        .discovered_at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    CatalogMemoryEntry {
        transport: transport as i32,
        tools: entry.catalog.tools.iter().map(|t| t.to_proto()).collect(),
        catalog_hash: entry.catalog.hash.clone(),
        discovered_at_unix_ms,
        release: entry.release.clone(),
        upstream_ttl_ms: entry
            .upstream_ttl
            .map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
        prompts: entry.catalog.prompts.iter().map(|p| p.to_proto()).collect(),
        resources: entry
            .catalog
            .resources
            .iter()
            .map(|r| r.to_proto())
            .collect(),
    }
    .encode_to_vec()
    .into()
}

/// The size of `entry`'s sealed value in the bucket.
pub fn sealed_len(entry: &Entry) -> usize {
    SEAL_MAGIC.len() + TAG_BYTES + encode(entry).len()
}

/// The entry a value holds; its catalog hash is computed again from its declarations.
pub fn decode(value: &[u8]) -> Result<Entry, String> {
    let stored = CatalogMemoryEntry::decode(value).map_err(|e| e.to_string())?;
    let transport = match McpTransport::try_from(stored.transport) {
        Ok(McpTransport::Stdio) => Transport::Stdio,
        Ok(McpTransport::StreamableHttp) => Transport::StreamableHttp,
        _ => return Err(format!("unknown transport {}", stored.transport)),
    };
    let tools = stored
        .tools
        .into_iter()
        .map(
            |McpTool {
                 name,
                 description,
                 input_schema_json,
             }| ToolDecl {
                name,
                description,
                input_schema_json,
            },
        )
        .collect();
    let prompts = stored
        .prompts
        .into_iter()
        .map(|p| PromptDecl {
            name: p.name,
            declaration_json: p.declaration_json,
        })
        .collect();
    let resources = stored
        .resources
        .into_iter()
        .map(|r| ResourceDecl {
            uri: r.uri,
            declaration_json: r.declaration_json,
        })
        .collect();
    Ok(Entry {
        transport,
        catalog: mcp::catalog_of(Declarations {
            tools,
            prompts,
            resources,
            ttl: None,
        }),
        discovered_at: UNIX_EPOCH + Duration::from_millis(stored.discovered_at_unix_ms),
        release: stored.release,
        upstream_ttl: stored.upstream_ttl_ms.map(Duration::from_millis),
    })
}

/// Whether the bucket works, logged once per change of state.
#[derive(Debug, Default)]
struct Health(Mutex<Option<bool>>);

impl Health {
    fn up(&self, bucket: &str) {
        let mut state = self.0.lock().expect("health lock");
        if *state != Some(true) {
            *state = Some(true);
            metrics::gauge!("ctxsync_catalog_memory_shared").set(1.0);
            tracing::info!(bucket, "catalog memory shared through the key-value bucket");
        }
    }

    fn down(&self, bucket: &str, error: &dyn std::fmt::Display) {
        let mut state = self.0.lock().expect("health lock");
        if *state != Some(false) {
            *state = Some(false);
            metrics::gauge!("ctxsync_catalog_memory_shared").set(0.0);
            tracing::warn!(
                bucket, %error,
                "catalog memory bucket unavailable; serving from this process's memory until it is back"
            );
        }
    }
}

#[derive(Clone)]
struct Stores {
    memory: kv::Store,
    claims: kv::Store,
}

enum Write {
    /// A sealed entry, and when it was discovered.
    Put(ServerKey, Bytes, SystemTime),
    /// Forgotten at this time.
    Delete(ServerKey, SystemTime),
    /// Answered once every write queued before it was tried.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// How often the writes the bucket did not take are tried again while it
/// seems to work (a reopened bucket tries them at once).
const WRITE_BACK_INTERVAL: Duration = Duration::from_secs(5);
/// Reads and revision-checked writes of one held write before it waits for
/// the next try.
const WRITE_BACK_COMPARES: usize = 3;

/// A write the bucket did not take: the sealed entry or the forgetting,
/// with its time.
#[derive(Clone)]
enum Missed {
    Put(Bytes, SystemTime),
    Forget(SystemTime),
}

impl Missed {
    fn unshared(&self) -> Unshared {
        match self {
            Self::Put(_, at) => Unshared::Put(*at),
            Self::Forget(at) => Unshared::Forget(*at),
        }
    }
}

/// This replica's writes the bucket did not take, the latest per key.
/// Bounded like the memory itself (its keys are configured servers).
#[derive(Default)]
struct Held(std::collections::BTreeMap<ServerKey, Missed>);

impl Held {
    fn hold(&mut self, bucket: &Bucket, key: ServerKey, missed: Missed) {
        if !self.0.contains_key(&key) && self.0.len() >= bucket.settings.max_entries {
            Ignored::Full.count();
            return;
        }
        self.0.insert(key, missed);
    }

    /// A later write of `key` reached the bucket: nothing of it is held.
    fn taken(&mut self, key: &ServerKey) {
        self.0.remove(key);
    }

    fn get(&self, key: &ServerKey) -> Option<Missed> {
        self.0.get(key).cloned()
    }

    fn keys(&self) -> Vec<ServerKey> {
        self.0.keys().cloned().collect()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The last message of `key`'s subject as the stream leader holds it.
async fn last_entry(stores: &Stores, key: &ServerKey) -> Result<Option<kv::Entry>, String> {
    let subject = format!("{}{}", stores.memory.prefix, key.as_str());
    let message = match stores
        .memory
        .stream
        .get_last_raw_message_by_subject(&subject)
        .await
    {
        Ok(message) => message,
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
        Err(error) => return Err(error.to_string()),
    };
    let operation = message
        .headers
        .get(KV_OPERATION)
        .and_then(|op| op.as_str().parse().ok())
        .unwrap_or(kv::Operation::Put);
    Ok(Some(kv::Entry {
        bucket: stores.memory.name.clone(),
        key: key.as_str().to_owned(),
        value: message.payload,
        revision: message.sequence,
        delta: 0,
        created: message.time,
        operation,
        seen_current: true,
    }))
}

/// The outcome of a warm-up claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This replica holds it: warm the server, then release it.
    Held,
    /// Another replica is warming the server.
    Taken,
    /// No bucket to claim in: warm the server without a claim.
    Unshared,
}

/// The buckets of one catalog process.
pub struct Bucket {
    js: jetstream::Context,
    settings: BucketSettings,
    stores: watch::Sender<Option<Stores>>,
    writes: mpsc::UnboundedSender<Write>,
    pending_writes: Mutex<Option<mpsc::UnboundedReceiver<Write>>>,
    health: Health,
    /// Whether the bucket refused a put for being full, logged once per change.
    full: Mutex<bool>,
    /// Written into claims: which process holds one (no secret).
    replica: String,
}

impl Bucket {
    pub fn new(client: async_nats::Client, settings: BucketSettings) -> Arc<Self> {
        let (writes, pending) = mpsc::unbounded_channel();
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        Arc::new(Self {
            js: jetstream::new(client),
            settings,
            stores: watch::Sender::new(None),
            writes,
            pending_writes: Mutex::new(Some(pending)),
            health: Health::default(),
            full: Mutex::new(false),
            replica: format!("pid {} started {started}", std::process::id()),
        })
    }

    pub fn name(&self) -> &str {
        &self.settings.name
    }

    /// Keeps the bucket watched and written until shutdown: every change is
    /// given to `apply`. Returns once the bucket's entries were applied (or
    /// it failed, or `LOAD_BOUND` passed), with the tasks doing it.
    pub async fn start(
        self: &Arc<Self>,
        apply: Arc<dyn Fn(Change) + Send + Sync>,
        shutdown: ctxsync_runtime::Shutdown,
    ) -> Vec<JoinHandle<()>> {
        let (loaded_tx, loaded) = oneshot::channel();
        let supervisor = tokio::spawn({
            let bucket = self.clone();
            let shutdown = shutdown.clone();
            async move {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = bucket.supervise(apply, loaded_tx) => {}
                }
            }
        });
        let pending = self
            .pending_writes
            .lock()
            .expect("writes lock")
            .take()
            .expect("a bucket is started once");
        let writer = tokio::spawn(self.clone().write_all(pending, shutdown));
        if tokio::time::timeout(LOAD_BOUND, loaded).await.is_err() {
            tracing::warn!(
                bucket = self.name(),
                bound_ms = LOAD_BOUND.as_millis() as u64,
                "the memory bucket's entries did not load in time; serving, they follow"
            );
        }
        vec![supervisor, writer]
    }

    /// Queues a put of `key` (in order with the other writes), sealed; an
    /// entry over the value bound stays in this process (counted).
    pub fn put(&self, key: &ServerKey, entry: &Entry) {
        let sealed = self
            .settings
            .key
            .seal(self.name(), key.as_str(), &encode(entry));
        if sealed.len() > MAX_VALUE_BYTES {
            Ignored::TooLarge.count();
            tracing::warn!(
                bucket = self.name(),
                server_key = key.as_str(),
                bytes = sealed.len(),
                max_bytes = MAX_VALUE_BYTES,
                "a memory entry over the bucket's value bound is kept in this process only"
            );
            return;
        }
        let _ = self
            .writes
            .send(Write::Put(key.clone(), sealed, entry.discovered_at));
    }

    /// The bucket refused a put for being full (or took one again): said once per change.
    fn set_full(&self, full: bool, key: &ServerKey) {
        let mut state = self.full.lock().expect("full lock");
        if *state == full {
            return;
        }
        *state = full;
        if full {
            tracing::warn!(
                bucket = self.name(),
                server_key = key.as_str(),
                max_entries = self.settings.max_entries,
                max_bytes = self.settings.max_bytes,
                "the memory bucket is full: new entries stay in this process until entries age out or are forgotten"
            );
        } else {
            tracing::info!(
                bucket = self.name(),
                "the memory bucket takes entries again"
            );
        }
    }

    /// Queues a delete of `key`.
    pub fn delete(&self, key: &ServerKey) {
        let _ = self
            .writes
            .send(Write::Delete(key.clone(), SystemTime::now()));
    }

    /// Waits until every write queued before the call was tried (acknowledged
    /// by JetStream, or failed), at most `within`: a warm-up releases its
    /// claim only once the entry it discovered is in the bucket, so another
    /// replica that claims next finds it there instead of discovering again.
    pub async fn flushed(&self, within: Duration) -> bool {
        let (done, answer) = tokio::sync::oneshot::channel();
        if self.writes.send(Write::Flush(done)).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, answer).await, Ok(Ok(())))
    }

    /// Waits until the buckets are open, at most `within`; whether they are.
    pub async fn opened(&self, within: Duration) -> bool {
        let mut stores = self.stores.subscribe();
        tokio::time::timeout(within, stores.wait_for(Option::is_some))
            .await
            .is_ok_and(|opened| opened.is_ok())
    }

    /// Claims `key` for a warm-up attempt (atomic: fails if a live claim exists).
    pub async fn claim(&self, key: &ServerKey) -> Claim {
        let Some(stores) = self.stores.borrow().clone() else {
            return Claim::Unshared;
        };
        match stores
            .claims
            .create(key.as_str(), Bytes::from(self.replica.clone()))
            .await
        {
            Ok(_) => Claim::Held,
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => Claim::Taken,
            Err(error) => {
                self.health.down(self.name(), &error);
                Claim::Unshared
            }
        }
    }

    /// The entry of `key` as the bucket's stream leader holds it now, read
    /// after a claim: the watch that feeds this process's map can lag a put
    /// another replica had acknowledged before releasing its claim, and a
    /// direct get may be answered by a follower that lags too.
    pub async fn current(&self, key: &ServerKey) -> Option<Change> {
        let stores = self.stores.borrow().clone()?;
        let entry = match last_entry(&stores, key).await {
            Ok(entry) => entry?,
            Err(error) => {
                tracing::debug!(%error, server_key = key.short(), "cannot read a memory entry from the bucket");
                return None;
            }
        };
        match self.change_of(&entry) {
            Ok(change) => Some(change),
            Err(ignored) => {
                ignored.count();
                None
            }
        }
    }

    /// Releases this replica's claim of `key` after its attempt.
    pub async fn release(&self, key: &ServerKey) {
        let Some(stores) = self.stores.borrow().clone() else {
            return;
        };
        if let Err(error) = stores.claims.delete(key.as_str()).await {
            // It lapses at its expiry anyway.
            tracing::debug!(%error, server_key = key.short(), "cannot release a warm-up claim");
        }
    }

    /// Writes the queued puts and deletes in order. One the bucket does not
    /// take (no bucket, or it failed) is held, the latest per key, and
    /// written back once the bucket works again, where nothing newer was
    /// written meanwhile: a discovery made while the bucket was away still
    /// reaches the other replicas and the next restart.
    async fn write_all(
        self: Arc<Self>,
        mut pending: mpsc::UnboundedReceiver<Write>,
        shutdown: ctxsync_runtime::Shutdown,
    ) {
        let mut held = Held::default();
        let mut reopened = self.stores.subscribe();
        let mut retry = tokio::time::interval(WRITE_BACK_INTERVAL);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let write = tokio::select! {
                write = pending.recv() => match write {
                    Some(write) => write,
                    None => break,
                },
                // At shutdown, what is queued already is still written.
                _ = shutdown.cancelled() => match pending.try_recv() {
                    Ok(write) => write,
                    Err(_) => break,
                },
                Ok(()) = reopened.changed(), if !held.is_empty() => {
                    self.write_back(&mut held).await;
                    continue;
                }
                _ = retry.tick(), if !held.is_empty() => {
                    self.write_back(&mut held).await;
                    continue;
                }
            };
            let stores = self.stores.borrow().clone();
            let (key, missed, result) = match (write, stores) {
                (Write::Flush(done), _) => {
                    let _ = done.send(());
                    continue;
                }
                (Write::Put(key, value, at), None) => {
                    held.hold(&self, key, Missed::Put(value, at));
                    continue;
                }
                (Write::Delete(key, at), None) => {
                    held.hold(&self, key, Missed::Forget(at));
                    continue;
                }
                (Write::Put(key, value, at), Some(stores)) => {
                    let result = stores.memory.put(key.as_str(), value.clone()).await;
                    let result = result.map(|_| true).map_err(|e| e.to_string());
                    (key, Missed::Put(value, at), result)
                }
                (Write::Delete(key, at), Some(stores)) => {
                    let result = stores.memory.delete(key.as_str()).await;
                    let result = result.map(|()| false).map_err(|e| e.to_string());
                    (key, Missed::Forget(at), result)
                }
            };
            match result {
                Ok(put) => {
                    held.taken(&key);
                    self.health.up(self.name());
                    if put {
                        self.set_full(false, &key);
                    }
                }
                // Discard-new limits: the bucket works, it is full.
                Err(error) if is_full(&error) => {
                    held.taken(&key);
                    Ignored::Full.count();
                    self.set_full(true, &key);
                }
                Err(error) => {
                    self.health.down(self.name(), &error);
                    held.hold(&self, key, missed);
                }
            }
        }
    }

    /// Tries the held writes again; those the bucket still does not take
    /// stay held for the next try.
    async fn write_back(&self, held: &mut Held) {
        let Some(stores) = self.stores.borrow().clone() else {
            return;
        };
        let (mut written, mut superseded, mut refused_full) = (0usize, 0usize, 0usize);
        for key in held.keys() {
            let Some(missed) = held.get(&key) else {
                continue;
            };
            match self.write_back_one(&stores, &key, &missed).await {
                Ok(Some(WriteBack::Write)) => written += 1,
                Ok(Some(WriteBack::Superseded | WriteBack::AlreadyForgotten)) => superseded += 1,
                Ok(None) => refused_full += 1,
                Err(error) => {
                    tracing::debug!(%error, server_key = key.short(), "a held memory write is not taken yet");
                    break;
                }
            }
            held.taken(&key);
        }
        if written > 0 {
            self.health.up(self.name());
        }
        if written + superseded + refused_full > 0 {
            tracing::info!(
                bucket = self.name(),
                written,
                superseded,
                refused_full,
                still_held = held.len(),
                "memory writes the bucket had missed were tried again"
            );
        }
    }

    /// One held write, made only over what the bucket held when it was
    /// compared (a revision-checked write: a replica writing meanwhile
    /// makes it compare again). `None`: refused, the bucket is full.
    async fn write_back_one(
        &self,
        stores: &Stores,
        key: &ServerKey,
        missed: &Missed,
    ) -> Result<Option<WriteBack>, String> {
        for _ in 0..WRITE_BACK_COMPARES {
            let last = last_entry(stores, key).await?;
            let revision = last.as_ref().map_or(0, |entry| entry.revision);
            let in_bucket = match &last {
                None => InBucket::Nothing,
                Some(entry) => match self.change_of(entry) {
                    Ok(Change::Put(_, entry, _)) => InBucket::Entry(entry.discovered_at),
                    Ok(Change::Delete(_)) => InBucket::Forgotten(entry.created.into()),
                    Err(_) => InBucket::Unreadable,
                },
            };
            let decision = catalog_core::memory::write_back(missed.unshared(), in_bucket);
            if decision != WriteBack::Write {
                return Ok(Some(decision));
            }
            let result = match missed {
                Missed::Put(value, _) => stores
                    .memory
                    .update(key.as_str(), value.clone(), revision)
                    .await
                    .map(drop),
                Missed::Forget(_) => {
                    stores
                        .memory
                        .delete_expect_revision(key.as_str(), Some(revision))
                        .await
                }
            };
            match result {
                Ok(()) => return Ok(Some(WriteBack::Write)),
                Err(error) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(error) if is_full(&error.to_string()) => {
                    Ignored::Full.count();
                    self.set_full(true, key);
                    return Ok(None);
                }
                Err(error) => return Err(error.to_string()),
            }
        }
        Err(format!(
            "the entry changed under each of {WRITE_BACK_COMPARES} compares"
        ))
    }

    async fn supervise(
        &self,
        apply: Arc<dyn Fn(Change) + Send + Sync>,
        loaded: oneshot::Sender<()>,
    ) {
        let mut loaded = Some(loaded);
        let mut delays = reopen_delays();
        loop {
            let error = self.open_and_watch(&*apply, &mut loaded).await;
            self.stores.send_replace(None);
            self.health.down(self.name(), &error);
            if let Some(loaded) = loaded.take() {
                let _ = loaded.send(());
            }
            let delay = delays.next().expect("reopen delays never end");
            tokio::time::sleep(delay).await;
        }
    }

    /// Opens both buckets and applies the memory bucket's changes until the
    /// watch fails; returns why.
    async fn open_and_watch(
        &self,
        apply: &(dyn Fn(Change) + Send + Sync),
        loaded: &mut Option<oneshot::Sender<()>>,
    ) -> BucketError {
        let name = self.name().to_owned();
        let open_error = |reason: String| BucketError::Open {
            bucket: name.clone(),
            reason,
        };
        let memory = match self.open(&name, self.settings.max_age).await {
            Ok(store) => store,
            Err(reason) => return open_error(reason),
        };
        let claims = match self
            .open(&claims_bucket(&name), self.settings.claim_ttl)
            .await
        {
            Ok(store) => store,
            Err(reason) => return open_error(reason),
        };
        let stored = match memory.status().await {
            Ok(status) => status.info.state.messages,
            Err(error) => return open_error(error.to_string()),
        };
        let mut changes = match memory.watch_with_history(">").await {
            Ok(watch) => watch,
            Err(error) => return open_error(error.to_string()),
        };
        self.stores.send_replace(Some(Stores { memory, claims }));
        self.health.up(&name);
        if stored == 0
            && let Some(loaded) = loaded.take()
        {
            let _ = loaded.send(());
        }
        while let Some(change) = changes.next().await {
            let entry = match change {
                Ok(entry) => entry,
                Err(error) => {
                    return BucketError::Watch {
                        bucket: name,
                        reason: error.to_string(),
                    };
                }
            };
            let caught_up = entry.seen_current || entry.delta == 0;
            match self.change_of(&entry) {
                Ok(change) => apply(change),
                Err(ignored) => {
                    ignored.count();
                    tracing::warn!(
                        bucket = %name, key = %entry.key, reason = ignored.label(),
                        "a memory bucket value no catalog replica wrote is ignored"
                    );
                }
            }
            if caught_up && let Some(loaded) = loaded.take() {
                let _ = loaded.send(());
            }
        }
        BucketError::WatchEnded { bucket: name }
    }

    /// The change a watched bucket entry makes, if a replica wrote it.
    fn change_of(&self, entry: &kv::Entry) -> Result<Change, Ignored> {
        let key = ServerKey::from_hex(&entry.key).ok_or(Ignored::BadKey)?;
        match entry.operation {
            kv::Operation::Delete | kv::Operation::Purge => Ok(Change::Delete(key)),
            kv::Operation::Put => {
                if entry.value.len() > MAX_VALUE_BYTES {
                    return Err(Ignored::TooLarge);
                }
                let sealed = self
                    .settings
                    .key
                    .open(self.name(), &entry.key, &entry.value)?;
                let decoded = decode(sealed).map_err(|_| Ignored::Undecodable)?;
                Ok(Change::Put(key, decoded, entry.value.len()))
            }
        }
    }

    /// The bucket `name`, created with `max_age` when missing.
    async fn open(&self, name: &str, max_age: Duration) -> Result<kv::Store, String> {
        open_bucket(
            &self.js,
            &BucketShape {
                name,
                max_age,
                replicas: self.settings.replicas,
                // The memory is bounded where it is kept; claims are one per server.
                max_messages: i64::try_from(self.settings.max_entries).unwrap_or(i64::MAX),
                max_bytes: i64::try_from(self.settings.max_bytes).unwrap_or(i64::MAX),
                max_value_bytes: MAX_VALUE_BYTES,
            },
        )
        .await
    }
}

/// How a key-value bucket of the catalog is made.
pub(crate) struct BucketShape<'a> {
    pub name: &'a str,
    pub max_age: Duration,
    pub replicas: usize,
    pub max_messages: i64,
    pub max_bytes: i64,
    pub max_value_bytes: usize,
}

/// The bucket `shape.name`, created as `shape` says when missing.
pub(crate) async fn open_bucket(
    js: &jetstream::Context,
    shape: &BucketShape<'_>,
) -> Result<kv::Store, String> {
    let name = shape.name;
    match js.get_key_value(name).await {
        Ok(store) => return Ok(store),
        Err(error) if error.kind() == jetstream::context::KeyValueErrorKind::GetBucket => {}
        Err(error) => return Err(error.to_string()),
    }
    // The bucket's stream, made directly: `create_key_value` first asks
    // for the account's info, which async-nats cannot parse from
    // nats-server 2.9. The stream is what a key-value bucket is: one
    // subject per key, the last value kept, rollups allowed.
    let config = jetstream::stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age: shape.max_age,
        duplicate_window: shape.max_age.min(Duration::from_secs(120)),
        num_replicas: shape.replicas,
        storage: jetstream::stream::StorageType::File,
        discard: jetstream::stream::DiscardPolicy::New,
        max_messages: shape.max_messages,
        max_bytes: shape.max_bytes,
        // Headers and subject besides the value.
        max_message_size: i32::try_from(shape.max_value_bytes + 4096).unwrap_or(i32::MAX),
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        ..Default::default()
    };
    match js.create_stream(config).await {
        Ok(_) => {}
        // Another replica created it meanwhile: the get below finds it.
        Err(error) => tracing::debug!(bucket = name, %error, "bucket not created"),
    }
    js.get_key_value(name).await.map_err(|e| e.to_string())
}

/// Whether a put failed for the bucket's discard-new limits (full).
fn is_full(error: &str) -> bool {
    let error = error.to_ascii_lowercase();
    error.contains("maximum messages") || error.contains("maximum bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use catalog_core::tools::Tool;

    #[test]
    fn a_failed_bucket_is_reopened_after_1_s_doubling_to_30_s() {
        let delays: Vec<u64> = reopen_delays().take(8).map(|d| d.as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn an_entry_round_trips_and_its_hash_is_computed_again() {
        let catalog = mcp::catalog_of(Declarations {
            tools: vec![ToolDecl {
                name: "echo".into(),
                description: "Echo".into(),
                input_schema_json: r#"{"type":"object"}"#.into(),
            }],
            prompts: vec![PromptDecl {
                name: "greet".into(),
                declaration_json: r#"{"name":"greet","arguments":[{"name":"who"}]}"#.into(),
            }],
            resources: vec![ResourceDecl {
                uri: "test://a".into(),
                declaration_json: r#"{"uri":"test://a","name":"a"}"#.into(),
            }],
            ttl: None,
        });
        let entry = Entry {
            transport: Transport::StreamableHttp,
            catalog: catalog.clone(),
            discovered_at: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            release: "9.9.9".into(),
            upstream_ttl: Some(Duration::from_millis(1500)),
        };
        let decoded = decode(&encode(&entry)).unwrap();
        assert_eq!(decoded.catalog, catalog);
        assert_eq!(decoded.transport, Transport::StreamableHttp);
        assert_eq!(decoded.discovered_at, entry.discovered_at);
        assert_eq!(decoded.release, "9.9.9");
        assert_eq!(decoded.upstream_ttl, Some(Duration::from_millis(1500)));

        let mut forged = CatalogMemoryEntry::decode(&*encode(&entry)).unwrap();
        forged.catalog_hash = "forged".into();
        forged.tools.push(
            Tool {
                name: "x".into(),
                description: String::new(),
                input_schema_json: "{}".into(),
            }
            .to_proto(),
        );
        let decoded = decode(&forged.encode_to_vec()).unwrap();
        assert_ne!(decoded.catalog.hash, "forged");
        assert_eq!(decoded.catalog.tools.len(), 2);
        assert!(decode(b"\xff\xff").is_err());
    }

    #[test]
    fn only_a_value_sealed_under_the_key_for_its_key_and_bucket_opens() {
        let key = MemoryKey::new(&[7; 32]).unwrap();
        let entry = b"an entry";
        let sealed = key.seal("bucket", "k1", entry);
        assert_eq!(key.open("bucket", "k1", &sealed), Ok(&entry[..]));
        assert_eq!(
            key.open("bucket", "k2", &sealed),
            Err(Ignored::BadTag),
            "another key"
        );
        assert_eq!(
            key.open("other", "k1", &sealed),
            Err(Ignored::BadTag),
            "another bucket"
        );
        let other = MemoryKey::new(&[8; 32]).unwrap();
        assert_eq!(other.open("bucket", "k1", &sealed), Err(Ignored::BadTag));
        assert_eq!(
            MemoryKey::random().open("bucket", "k1", &sealed),
            Err(Ignored::BadTag)
        );
        let mut tampered = sealed.to_vec();
        *tampered.last_mut().unwrap() ^= 1;
        assert_eq!(key.open("bucket", "k1", &tampered), Err(Ignored::BadTag));
        assert_eq!(key.open("bucket", "k1", entry), Err(Ignored::Unsealed));
        assert_eq!(
            key.open("bucket", "k1", b"cxm1short"),
            Err(Ignored::Unsealed)
        );
        assert!(
            MemoryKey::new(&[1; 31])
                .unwrap_err()
                .contains("at least 32")
        );
        assert!(format!("{key:?}").starts_with("MemoryKey"));
    }

    #[test]
    fn a_key_file_is_read_without_its_final_newline_and_refused_when_short() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, format!("{}\n", "k".repeat(32))).unwrap();
        let from_file = MemoryKey::from_file(&path).unwrap();
        let sealed = MemoryKey::new("k".repeat(32).as_bytes())
            .unwrap()
            .seal("b", "k", b"e");
        assert!(from_file.open("b", "k", &sealed).is_ok());
        std::fs::write(&path, "short\n").unwrap();
        assert!(
            MemoryKey::from_file(&path)
                .unwrap_err()
                .contains("holds 5 bytes")
        );
        let missing = MemoryKey::from_file(&dir.path().join("missing")).unwrap_err();
        assert!(missing.starts_with("cannot be read"), "{missing}");
    }
}
