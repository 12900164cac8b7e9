//! The service's tunables and its flags (every one also an env var). The
//! flags hold the defaults: [`Settings::default`] is what they give unset.

use std::path::PathBuf;
use std::time::Duration;

use ctxsync_runtime::config::humantime_string;

use crate::config::{CatalogConfig, ConfigError};
use crate::endpoint::{RateLimit, SessionLimits};

/// Tunables of the service, as durations (the binary reads them in seconds).
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a streamable-HTTP discovery may be reused (`discovery_reuse_seconds`).
    pub discovery_reuse: Duration,
    /// The user-facing handshake bound: preparation and a call's (re)connect.
    pub connect_timeout: Duration,
    /// Stdio servers started at once for preparations and calls.
    pub max_concurrent_starts: usize,
    /// A session's transports are released after this long without a call.
    pub session_idle_timeout: Duration,
    pub warmup: WarmupSettings,
    /// The MCP endpoint's list page size (tools per `tools/list` page).
    pub mcp_page_size: usize,
    /// Requests a tenant key may make to the MCP endpoint (`None`: no limit).
    pub mcp_rate_limit: Option<RateLimit>,
    /// MCP sessions a key and a tenant may hold open, and their idle expiry.
    pub mcp_sessions: SessionLimits,
    /// Server processes (stdio transports of sessions) this replica runs at
    /// most at once; `None`: no bound.
    pub max_server_processes: Option<usize>,
    /// … and at most per tenant; `None`: no bound.
    pub max_server_processes_per_tenant: Option<usize>,
    /// A shared server process no session held this long is stopped.
    pub shared_idle_timeout: Duration,
    /// Events queued for the background writer at most (past it one is
    /// dropped and counted, no answer delayed).
    pub event_queue: usize,
    /// How long a batch of events gathers after its first before it is
    /// written (a flush or shutdown writes at once).
    pub event_batch_wait: Duration,
    pub memory: MemorySettings,
    /// The Hosts and Origins `/mcp` answers (DNS-rebinding defence).
    pub browsers: ctxsync_runtime::http::browsers::BrowserArgs,
}

/// The memory shared by the catalog's replicas (a JetStream key-value bucket).
#[derive(Debug, Clone)]
pub struct MemorySettings {
    /// The bucket's name; `None` derives it from the subject prefix
    /// (`<prefix>_catalog_memory`, see `memory_bucket_name`).
    pub bucket: Option<String>,
    /// Replicas of the bucket when the catalog creates it (1 to 5).
    pub replicas: usize,
    /// An entry nobody discovered again for this long ages out of the bucket.
    pub max_age: Duration,
    /// The secret every entry is sealed with; `None`: a random key of this
    /// process (its entries are applied by no other replica).
    pub key: Option<crate::bucket::MemoryKey>,
    /// Entries the memory (this process's map, and the bucket the catalog
    /// creates) holds at most …
    pub max_entries: usize,
    /// … and bytes of values.
    pub max_bytes: u64,
}

/// The flags' defaults.
impl Default for MemorySettings {
    fn default() -> Self {
        Settings::default().memory
    }
}

/// The fewest replicas of a bucket, and the most JetStream keeps.
pub const MEMORY_REPLICAS: std::ops::RangeInclusive<usize> = 1..=5;
/// The shortest `max_age` of the memory bucket.
pub const MIN_MEMORY_MAX_AGE: Duration = Duration::from_secs(60);

/// The memory bucket of the subject prefix `prefix`: its characters outside
/// `[A-Za-z0-9_-]` (the only ones a bucket name allows) become `_`, and then
/// a short hash of the prefix keeps two prefixes apart.
/// The bucket of the MCP sessions other replicas may restore, beside the
/// memory's `memory_bucket`.
pub fn mcp_sessions_bucket_name(memory_bucket: &str) -> String {
    format!("{memory_bucket}_mcp_sessions")
}

pub fn memory_bucket_name(prefix: &str) -> String {
    let sanitized: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if sanitized == prefix {
        format!("{prefix}_catalog_memory")
    } else {
        use sha2::Digest as _;
        let digest = hex::encode(sha2::Sha256::digest(prefix.as_bytes()));
        format!("{sanitized}_{}_catalog_memory", &digest[..8])
    }
}

/// A bucket name the catalog can use (its claims bucket adds `_claims`,
/// its sessions bucket `_mcp_sessions`).
pub fn valid_memory_bucket(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 200 {
        return Err("must be 1 to 200 characters".into());
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err("may hold only the characters A-Z, a-z, 0-9, _ and -".into());
    }
    Ok(())
}

impl MemorySettings {
    /// Checks the tunables; the errors name the env vars.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(name) = &self.bucket {
            valid_memory_bucket(name).map_err(|reason| {
                ConfigError::Invalid(format!("CTXSYNC_CATALOG_MEMORY_BUCKET {name:?} {reason}"))
            })?;
        }
        if !MEMORY_REPLICAS.contains(&self.replicas) {
            return Err(ConfigError::Invalid(format!(
                "CTXSYNC_CATALOG_MEMORY_REPLICAS must be from {} to {}, not {}",
                MEMORY_REPLICAS.start(),
                MEMORY_REPLICAS.end(),
                self.replicas
            )));
        }
        if self.max_entries == 0 {
            return Err(ConfigError::Invalid(
                "CTXSYNC_CATALOG_MEMORY_MAX_ENTRIES must be at least 1".into(),
            ));
        }
        let min_bytes = crate::bucket::MAX_VALUE_BYTES as u64;
        if self.max_bytes < min_bytes {
            return Err(ConfigError::Invalid(format!(
                "CTXSYNC_CATALOG_MEMORY_MAX_BYTES must be at least {min_bytes} (one entry of the largest size), not {}",
                self.max_bytes
            )));
        }
        if self.max_age < MIN_MEMORY_MAX_AGE {
            return Err(ConfigError::Invalid(format!(
                "CTXSYNC_CATALOG_MEMORY_MAX_AGE must be at least {}, not {}",
                humantime::format_duration(MIN_MEMORY_MAX_AGE),
                humantime::format_duration(self.max_age)
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct WarmupSettings {
    pub enabled: bool,
    /// Its own handshake bound: nothing waits on the warm-up.
    pub connect_timeout: Duration,
    /// Pause between rounds of retrying the servers that failed.
    pub retry_interval: Duration,
    /// Rounds in all, the first included.
    pub attempts: u32,
    /// An entry of this release discovered less than this long before the
    /// start (by any replica) is pinned, not discovered again: a restarted
    /// or added replica starts no server the others discovered lately. At
    /// least `connect_timeout` (replicas started together share one discovery).
    pub fresh: Duration,
}

/// The flags' defaults.
impl Default for Settings {
    fn default() -> Self {
        CatalogArgs::defaults()
            .settings()
            .expect("the default settings are valid")
    }
}

/// Everything `start` needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub common: ctxsync_runtime::CommonArgs,
    pub database: ctxsync_runtime::DatabaseArgs,
    pub servers: CatalogConfig,
    pub settings: Settings,
}

/// The catalog binary's flags: all it reads (see `CommonArgs` on `Serialize`).
#[derive(Debug, Clone, PartialEq, clap::Args, serde::Serialize)]
pub struct Args {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: ctxsync_runtime::CommonArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub database: ctxsync_runtime::DatabaseArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub catalog: CatalogArgs,
    /// PEM CA certificate(s) to trust for https:// MCP servers, besides the system's roots.
    #[arg(long, env = "CTXSYNC_MCP_CA_FILE")]
    pub mcp_ca_file: Option<PathBuf>,
}

/// The catalog's own flags (every one also an env var).
#[derive(Debug, Clone, PartialEq, clap::Args, serde::Serialize)]
pub struct CatalogArgs {
    /// The tenants-and-servers YAML file.
    #[arg(long = "config", env = "CTXSYNC_CATALOG_CONFIG")]
    pub config: PathBuf,

    #[command(flatten)]
    #[serde(flatten)]
    pub browsers: ctxsync_runtime::http::browsers::BrowserArgs,

    /// How long a streamable-HTTP server's discovery is reused, in seconds.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_DISCOVERY_REUSE_SECONDS",
        default_value_t = 3600
    )]
    pub discovery_reuse_seconds: u64,

    /// Handshake bound when a user waits (preparation, a call's connect), in seconds.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 10
    )]
    pub connect_timeout_seconds: u64,

    /// Stdio servers started at once for preparations and calls.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MAX_CONCURRENT_STARTS",
        default_value_t = 2
    )]
    pub max_concurrent_starts: usize,

    /// Events (calls, follow-up preparations, warm-ups) queued for writing
    /// at most; past it an event is dropped and counted
    /// (`ctxsync_catalog_events_dropped_total`), never an answer delayed.
    #[arg(long, env = "CTXSYNC_CATALOG_EVENT_QUEUE", default_value_t = 8192)]
    pub event_queue: usize,

    /// How long a batch of queued events gathers after its first before it
    /// is written: busy calls then share one transaction (0: write at once).
    #[arg(long, env = "CTXSYNC_CATALOG_EVENT_BATCH_WAIT", default_value = "50ms", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "humantime_string")]
    pub event_batch_wait: Duration,

    /// A session's transports are released after this many seconds without a call.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_SESSION_IDLE_SECONDS",
        default_value_t = 600
    )]
    pub session_idle_seconds: u64,

    /// Warm the discovery memory after start.
    #[arg(long, env = "CTXSYNC_CATALOG_WARMUP", default_value_t = true, action = clap::ArgAction::Set)]
    pub warmup: bool,

    /// The warm-up's handshake bound, in seconds.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_WARMUP_CONNECT_TIMEOUT_SECONDS",
        default_value_t = 60
    )]
    pub warmup_connect_timeout_seconds: u64,

    /// Seconds between warm-up rounds retrying the servers that failed.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_WARMUP_RETRY_SECONDS",
        default_value_t = 60
    )]
    pub warmup_retry_seconds: u64,

    /// Warm-up rounds in all; servers still failing after the last are abandoned.
    #[arg(long, env = "CTXSYNC_CATALOG_WARMUP_ATTEMPTS", default_value_t = 5)]
    pub warmup_attempts: u32,

    /// Seconds within which a server's entry (of this release, by any
    /// replica) is fresh: the warm-up pins it instead of starting the server.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_WARMUP_FRESH_SECONDS",
        default_value_t = 3600
    )]
    pub warmup_fresh_seconds: u64,

    /// The JetStream key-value bucket the replicas share their memory in
    /// (default: `<prefix>_catalog_memory`, the subject prefix's characters
    /// outside [A-Za-z0-9_-] made `_`).
    #[arg(long, env = "CTXSYNC_CATALOG_MEMORY_BUCKET")]
    pub memory_bucket: Option<String>,

    /// Replicas of the memory bucket when the catalog creates it (1 to 5).
    #[arg(long, env = "CTXSYNC_CATALOG_MEMORY_REPLICAS", default_value_t = 1)]
    pub memory_replicas: usize,

    /// A memory entry nobody discovered again for this long ages out of the bucket.
    #[arg(long, env = "CTXSYNC_CATALOG_MEMORY_MAX_AGE", default_value = "7d", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "humantime_string")]
    pub memory_max_age: Duration,

    /// A file holding the secret (at least 32 bytes) every replica seals its
    /// memory entries with; entries sealed otherwise are ignored. Unset: a
    /// random key of this process, so no other replica's entry is used.
    #[arg(long, env = "CTXSYNC_CATALOG_MEMORY_KEY_FILE")]
    pub memory_key_file: Option<PathBuf>,

    /// Entries the memory holds at most (this process's map and the bucket it creates).
    // Far more server configurations than a replica's tenants have.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MEMORY_MAX_ENTRIES",
        default_value_t = 4096
    )]
    pub memory_max_entries: usize,

    /// Bytes of entries the memory holds at most (likewise).
    // 64 MiB.
    #[arg(long, env = "CTXSYNC_CATALOG_MEMORY_MAX_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub memory_max_bytes: u64,

    /// Tools per page of the MCP endpoint's `tools/list`.
    #[arg(long, env = "CTXSYNC_CATALOG_MCP_PAGE_SIZE", default_value_t = 100)]
    pub mcp_page_size: usize,

    /// MCP endpoint requests per second per tenant key; 0 means no limit.
    // A client's handshake and calls, not a flood.
    #[arg(long, env = "CTXSYNC_CATALOG_MCP_RATE_LIMIT", default_value_t = 20.0)]
    pub mcp_rate_limit: f64,

    /// Requests a tenant key may make at once above its rate (the bucket).
    #[arg(long, env = "CTXSYNC_CATALOG_MCP_RATE_BURST", default_value_t = 40)]
    pub mcp_rate_burst: u32,

    /// MCP sessions one tenant key holds open at most.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_KEY",
        default_value_t = 32
    )]
    pub mcp_max_sessions_per_key: usize,

    /// MCP sessions one tenant holds open at most (all its keys).
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_TENANT",
        default_value_t = 128
    )]
    pub mcp_max_sessions_per_tenant: usize,

    /// An MCP session without a message for this many seconds ends.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MCP_SESSION_IDLE_SECONDS",
        default_value_t = 300
    )]
    pub mcp_session_idle_seconds: u64,

    /// Server processes (sessions' stdio servers) this replica runs at most
    /// at once; 0 means no bound.
    // Tens of MB each.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MAX_SERVER_PROCESSES",
        default_value_t = 64
    )]
    pub max_server_processes: usize,

    /// Server processes one tenant's sessions run on this replica at most;
    /// 0 means no bound.
    // A quarter of them: one tenant never takes them all.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MAX_SERVER_PROCESSES_PER_TENANT",
        default_value_t = 16
    )]
    pub max_server_processes_per_tenant: usize,

    /// Seconds a shared server process may go without a session before it stops.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_SHARED_IDLE_SECONDS",
        default_value_t = 300
    )]
    pub shared_idle_seconds: u64,
}

impl CatalogArgs {
    /// The flags unset (the servers file, which has no default, named `catalog.yaml`).
    pub fn defaults() -> Self {
        ctxsync_runtime::args::defaults_with(&["--config", "catalog.yaml"])
    }

    /// Reads the config file and validates the tunables.
    pub fn into_config(
        self,
        common: ctxsync_runtime::CommonArgs,
        database: ctxsync_runtime::DatabaseArgs,
    ) -> Result<Config, ConfigError> {
        let servers = CatalogConfig::load(&self.config)?;
        Ok(Config {
            common,
            database,
            servers,
            settings: self.settings()?,
        })
    }

    /// The tunables, validated (the memory key read from its file).
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        let positive = |name: &str, value: u64| {
            if value == 0 {
                Err(ConfigError::Invalid(format!("{name} must be at least 1")))
            } else {
                Ok(Duration::from_secs(value))
            }
        };
        if self.max_concurrent_starts == 0 {
            return Err(ConfigError::Invalid(
                "CTXSYNC_CATALOG_MAX_CONCURRENT_STARTS must be at least 1".into(),
            ));
        }
        if self.event_queue == 0 {
            return Err(ConfigError::Invalid(
                "CTXSYNC_CATALOG_EVENT_QUEUE must be at least 1".into(),
            ));
        }
        if self.warmup_attempts == 0 {
            return Err(ConfigError::Invalid(
                "CTXSYNC_CATALOG_WARMUP_ATTEMPTS must be at least 1".into(),
            ));
        }
        let key = match &self.memory_key_file {
            None => None,
            Some(path) => Some(crate::bucket::MemoryKey::from_file(path).map_err(|reason| {
                ConfigError::Invalid(format!(
                    "CTXSYNC_CATALOG_MEMORY_KEY_FILE (--memory-key-file) {}: {reason}",
                    path.display()
                ))
            })?),
        };
        let memory = MemorySettings {
            bucket: self.memory_bucket.clone(),
            replicas: self.memory_replicas,
            max_age: self.memory_max_age,
            key,
            max_entries: self.memory_max_entries,
            max_bytes: self.memory_max_bytes,
        };
        let at_least_one = |name: &str, value: usize| {
            if value == 0 {
                Err(ConfigError::Invalid(format!("{name} must be at least 1")))
            } else {
                Ok(value)
            }
        };
        let mcp_sessions = SessionLimits {
            per_key: at_least_one(
                "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_KEY",
                self.mcp_max_sessions_per_key,
            )?,
            per_tenant: at_least_one(
                "CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_TENANT",
                self.mcp_max_sessions_per_tenant,
            )?,
            idle: positive(
                "CTXSYNC_CATALOG_MCP_SESSION_IDLE_SECONDS",
                self.mcp_session_idle_seconds,
            )?,
        };
        memory.validate()?;
        Ok(Settings {
            discovery_reuse: Duration::from_secs(self.discovery_reuse_seconds),
            connect_timeout: positive(
                "CTXSYNC_CATALOG_CONNECT_TIMEOUT_SECONDS",
                self.connect_timeout_seconds,
            )?,
            max_concurrent_starts: self.max_concurrent_starts,
            event_queue: self.event_queue,
            event_batch_wait: self.event_batch_wait,
            browsers: self.browsers.clone(),
            session_idle_timeout: positive(
                "CTXSYNC_CATALOG_SESSION_IDLE_SECONDS",
                self.session_idle_seconds,
            )?,
            warmup: WarmupSettings {
                enabled: self.warmup,
                connect_timeout: positive(
                    "CTXSYNC_CATALOG_WARMUP_CONNECT_TIMEOUT_SECONDS",
                    self.warmup_connect_timeout_seconds,
                )?,
                retry_interval: Duration::from_secs(self.warmup_retry_seconds),
                attempts: self.warmup_attempts,
                fresh: Duration::from_secs(self.warmup_fresh_seconds),
            },
            memory,
            mcp_page_size: self.mcp_page_size.max(1),
            mcp_rate_limit: rate_limit(self.mcp_rate_limit, self.mcp_rate_burst)?,
            mcp_sessions,
            max_server_processes: (self.max_server_processes > 0)
                .then_some(self.max_server_processes),
            max_server_processes_per_tenant: (self.max_server_processes_per_tenant > 0)
                .then_some(self.max_server_processes_per_tenant),
            shared_idle_timeout: positive(
                "CTXSYNC_CATALOG_SHARED_IDLE_SECONDS",
                self.shared_idle_seconds,
            )?,
        })
    }

    /// The flags that give `settings` back (the inverse of
    /// [`CatalogArgs::settings`]), with the servers read from `config` and
    /// the memory key from `memory_key_file`. A key given as bytes (not
    /// random) has no flag: without its file it is refused, never dropped.
    pub fn of(
        config: PathBuf,
        memory_key_file: Option<PathBuf>,
        settings: &Settings,
    ) -> Result<Self, ConfigError> {
        // Taken apart whole: a new setting does not compile here until it has its flag.
        let Settings {
            discovery_reuse,
            connect_timeout,
            max_concurrent_starts,
            event_queue,
            event_batch_wait,
            browsers,
            session_idle_timeout,
            warmup:
                WarmupSettings {
                    enabled: warmup,
                    connect_timeout: warmup_connect_timeout,
                    retry_interval: warmup_retry,
                    attempts: warmup_attempts,
                    fresh: warmup_fresh,
                },
            mcp_page_size,
            mcp_rate_limit,
            mcp_sessions:
                SessionLimits {
                    per_key: mcp_max_sessions_per_key,
                    per_tenant: mcp_max_sessions_per_tenant,
                    idle: mcp_session_idle,
                },
            max_server_processes,
            max_server_processes_per_tenant,
            shared_idle_timeout,
            memory:
                MemorySettings {
                    bucket: memory_bucket,
                    replicas: memory_replicas,
                    max_age: memory_max_age,
                    key: memory_key,
                    max_entries: memory_max_entries,
                    max_bytes: memory_max_bytes,
                },
        } = settings;
        if memory_key.as_ref().is_some_and(|key| !key.is_random()) && memory_key_file.is_none() {
            return Err(ConfigError::Invalid(
                "the memory key has no flag: give the file that holds it (CTXSYNC_CATALOG_MEMORY_KEY_FILE)"
                    .into(),
            ));
        }
        let seconds = |name: &str, value: Duration| {
            if value.subsec_nanos() == 0 {
                Ok(value.as_secs())
            } else {
                Err(ConfigError::Invalid(format!(
                    "{name} takes whole seconds, not {}",
                    humantime::format_duration(value)
                )))
            }
        };
        let (mcp_rate_limit, mcp_rate_burst) = match mcp_rate_limit {
            Some(RateLimit { per_second, burst }) => (*per_second, *burst),
            // No limit is a rate of 0; the burst, then unused, stays at its default.
            None => (0.0, Self::defaults().mcp_rate_burst),
        };
        Ok(Self {
            config,
            discovery_reuse_seconds: seconds(
                "CTXSYNC_CATALOG_DISCOVERY_REUSE_SECONDS",
                *discovery_reuse,
            )?,
            connect_timeout_seconds: seconds(
                "CTXSYNC_CATALOG_CONNECT_TIMEOUT_SECONDS",
                *connect_timeout,
            )?,
            max_concurrent_starts: *max_concurrent_starts,
            event_queue: *event_queue,
            event_batch_wait: *event_batch_wait,
            browsers: browsers.clone(),
            session_idle_seconds: seconds(
                "CTXSYNC_CATALOG_SESSION_IDLE_SECONDS",
                *session_idle_timeout,
            )?,
            warmup: *warmup,
            warmup_connect_timeout_seconds: seconds(
                "CTXSYNC_CATALOG_WARMUP_CONNECT_TIMEOUT_SECONDS",
                *warmup_connect_timeout,
            )?,
            warmup_retry_seconds: seconds("CTXSYNC_CATALOG_WARMUP_RETRY_SECONDS", *warmup_retry)?,
            warmup_attempts: *warmup_attempts,
            warmup_fresh_seconds: seconds("CTXSYNC_CATALOG_WARMUP_FRESH_SECONDS", *warmup_fresh)?,
            memory_bucket: memory_bucket.clone(),
            memory_replicas: *memory_replicas,
            memory_max_age: *memory_max_age,
            memory_key_file,
            memory_max_entries: *memory_max_entries,
            memory_max_bytes: *memory_max_bytes,
            mcp_page_size: *mcp_page_size,
            mcp_rate_limit,
            mcp_rate_burst,
            mcp_max_sessions_per_key: *mcp_max_sessions_per_key,
            mcp_max_sessions_per_tenant: *mcp_max_sessions_per_tenant,
            mcp_session_idle_seconds: seconds(
                "CTXSYNC_CATALOG_MCP_SESSION_IDLE_SECONDS",
                *mcp_session_idle,
            )?,
            max_server_processes: max_server_processes.unwrap_or(0),
            max_server_processes_per_tenant: max_server_processes_per_tenant.unwrap_or(0),
            shared_idle_seconds: seconds(
                "CTXSYNC_CATALOG_SHARED_IDLE_SECONDS",
                *shared_idle_timeout,
            )?,
        })
    }
}

fn rate_limit(per_second: f64, burst: u32) -> Result<Option<RateLimit>, ConfigError> {
    if !per_second.is_finite() || per_second < 0.0 {
        return Err(ConfigError::Invalid(
            "CTXSYNC_CATALOG_MCP_RATE_LIMIT must be a number of at least 0".into(),
        ));
    }
    if per_second == 0.0 {
        return Ok(None);
    }
    if burst == 0 {
        return Err(ConfigError::Invalid(
            "CTXSYNC_CATALOG_MCP_RATE_BURST must be at least 1".into(),
        ));
    }
    Ok(Some(RateLimit { per_second, burst }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_names_come_from_the_prefix_and_stay_apart() {
        assert_eq!(memory_bucket_name("acme"), "acme_catalog_memory");
        let dotted = memory_bucket_name("acme.prod");
        assert!(dotted.starts_with("acme_prod_") && dotted.ends_with("_catalog_memory"));
        assert_ne!(dotted, memory_bucket_name("acme_prod"));
        assert_ne!(dotted, memory_bucket_name("acme-prod"));
        for prefix in ["a.b.c", "é.x", "t1234"] {
            valid_memory_bucket(&memory_bucket_name(prefix)).unwrap();
        }
    }

    #[test]
    fn memory_settings_are_validated_by_name() {
        let error = |memory: MemorySettings| memory.validate().unwrap_err().to_string();
        let bad_name = error(MemorySettings {
            bucket: Some("a.b".into()),
            ..Default::default()
        });
        assert!(
            bad_name.contains("CTXSYNC_CATALOG_MEMORY_BUCKET"),
            "{bad_name}"
        );
        let replicas = error(MemorySettings {
            replicas: 6,
            ..Default::default()
        });
        assert!(
            replicas.contains("CTXSYNC_CATALOG_MEMORY_REPLICAS"),
            "{replicas}"
        );
        let max_age = error(MemorySettings {
            max_age: Duration::from_secs(5),
            ..Default::default()
        });
        assert!(
            max_age.contains("CTXSYNC_CATALOG_MEMORY_MAX_AGE"),
            "{max_age}"
        );
        MemorySettings::default().validate().unwrap();
    }
}

#[cfg(test)]
mod args_tests {
    use super::*;
    use clap::Parser as _;

    #[derive(Debug, clap::Parser)]
    struct Args {
        #[command(flatten)]
        common: ctxsync_runtime::CommonArgs,
        #[command(flatten)]
        database: ctxsync_runtime::DatabaseArgs,
        #[command(flatten)]
        catalog: CatalogArgs,
    }

    fn config(extra: &[&str]) -> Result<Config, String> {
        let dir = tempfile::tempdir().unwrap();
        let servers = dir.path().join("catalog.yaml");
        std::fs::write(&servers, "tenants: []\n").unwrap();
        let mut argv = vec![
            "catalog".to_owned(),
            "--database-url".to_owned(),
            "postgres://localhost/x".to_owned(),
            "--config".to_owned(),
            servers.display().to_string(),
        ];
        argv.extend(extra.iter().map(|a| a.to_string()));
        let args = Args::try_parse_from(argv).map_err(|e| e.to_string())?;
        args.catalog
            .into_config(args.common, args.database)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_defaults_bound_every_per_key_resource() {
        let settings = config(&[]).unwrap().settings;
        // The values README documents.
        let rate = settings.mcp_rate_limit.unwrap();
        assert_eq!((rate.per_second, rate.burst), (20.0, 40));
        assert_eq!(settings.max_server_processes, Some(64));
        assert_eq!(settings.max_server_processes_per_tenant, Some(16));
        assert_eq!(
            settings.mcp_sessions,
            SessionLimits {
                per_key: 32,
                per_tenant: 128,
                idle: Duration::from_secs(300),
            }
        );
        assert!(settings.memory.key.is_none(), "a random key at start");
        assert_eq!(settings.memory.max_entries, 4096);
        assert_eq!(settings.memory.max_bytes, 64 * 1024 * 1024);
        assert_eq!(settings.memory.max_age, Duration::from_secs(7 * 24 * 3600));
        // Settings::default() is the flags unset.
        let default = Settings::default();
        assert_eq!(
            CatalogArgs::of("c.yaml".into(), None, &default).unwrap(),
            CatalogArgs::of("c.yaml".into(), None, &settings).unwrap()
        );
    }

    /// Every setting away from its default.
    fn changed() -> Settings {
        Settings {
            discovery_reuse: Duration::from_secs(7),
            connect_timeout: Duration::from_secs(8),
            max_concurrent_starts: 3,
            event_queue: 10,
            event_batch_wait: Duration::from_millis(7),
            browsers: ctxsync_runtime::http::browsers::BrowserArgs {
                http_allowed_hosts: ctxsync_runtime::http::browsers::AllowedHosts::parse(
                    "mcp.example.com",
                )
                .unwrap(),
                http_allowed_origins: ctxsync_runtime::http::browsers::AllowedOrigins::parse(
                    "https://chat.example.com",
                )
                .unwrap(),
            },
            session_idle_timeout: Duration::from_secs(9),
            warmup: WarmupSettings {
                enabled: false,
                connect_timeout: Duration::from_secs(11),
                retry_interval: Duration::from_secs(12),
                attempts: 13,
                fresh: Duration::from_secs(1300),
            },
            mcp_page_size: 14,
            mcp_rate_limit: Some(RateLimit {
                per_second: 1.5,
                burst: 15,
            }),
            mcp_sessions: SessionLimits {
                per_key: 16,
                per_tenant: 17,
                idle: Duration::from_secs(18),
            },
            max_server_processes: None,
            max_server_processes_per_tenant: Some(19),
            shared_idle_timeout: Duration::from_secs(20),
            memory: MemorySettings {
                bucket: Some("shared_memory".into()),
                replicas: 3,
                max_age: Duration::from_secs(3600),
                key: None,
                max_entries: 21,
                max_bytes: 8 * 1024 * 1024,
            },
        }
    }

    #[test]
    fn the_flags_of_settings_give_them_back() {
        let flags = CatalogArgs::of("c.yaml".into(), None, &changed()).unwrap();
        assert_ne!(
            flags,
            CatalogArgs::of("c.yaml".into(), None, &Settings::default()).unwrap()
        );
        let again = CatalogArgs::of("c.yaml".into(), None, &flags.settings().unwrap()).unwrap();
        assert_eq!(again, flags);
        // No limit is a rate of 0, and back.
        let unlimited = Settings {
            mcp_rate_limit: None,
            ..changed()
        };
        let flags = CatalogArgs::of("c.yaml".into(), None, &unlimited).unwrap();
        assert_eq!(flags.mcp_rate_limit, 0.0);
        assert!(flags.settings().unwrap().mcp_rate_limit.is_none());
    }

    #[test]
    fn settings_without_a_flag_are_refused_not_dropped() {
        let keyed = Settings {
            memory: MemorySettings {
                key: Some(crate::MemoryKey::new(&[7; 32]).unwrap()),
                ..MemorySettings::default()
            },
            ..Settings::default()
        };
        let error = CatalogArgs::of("c.yaml".into(), None, &keyed).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("CTXSYNC_CATALOG_MEMORY_KEY_FILE"),
            "{error}"
        );
        let flags = CatalogArgs::of("c.yaml".into(), Some("/run/key".into()), &keyed).unwrap();
        assert_eq!(flags.memory_key_file, Some("/run/key".into()));
        let fraction = Settings {
            connect_timeout: Duration::from_millis(1500),
            ..Settings::default()
        };
        let error = CatalogArgs::of("c.yaml".into(), None, &fraction).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("CTXSYNC_CATALOG_CONNECT_TIMEOUT_SECONDS takes whole seconds"),
            "{error}"
        );
    }

    #[test]
    fn a_memory_key_file_that_cannot_be_used_names_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "0123456789\n").unwrap();
        let error = config(&["--memory-key-file", short.to_str().unwrap()]).unwrap_err();
        assert!(
            error.contains("CTXSYNC_CATALOG_MEMORY_KEY_FILE (--memory-key-file)")
                && error.contains("holds 10 bytes"),
            "{error}"
        );
        let missing = dir.path().join("missing");
        let error = config(&["--memory-key-file", missing.to_str().unwrap()]).unwrap_err();
        assert!(
            error.contains("CTXSYNC_CATALOG_MEMORY_KEY_FILE") && error.contains("cannot be read"),
            "{error}"
        );
        let good = dir.path().join("good");
        std::fs::write(&good, "x".repeat(48)).unwrap();
        let settings = config(&["--memory-key-file", good.to_str().unwrap()])
            .unwrap()
            .settings;
        assert!(!settings.memory.key.unwrap().is_random());
        let error = config(&["--mcp-max-sessions-per-key", "0"]).unwrap_err();
        assert!(
            error.contains("CTXSYNC_CATALOG_MCP_MAX_SESSIONS_PER_KEY"),
            "{error}"
        );
    }
}
