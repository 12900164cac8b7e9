//! The service's tunables and its flags (every one also an env var).

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{CatalogConfig, ConfigError};

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
    pub mcp_rate_limit: Option<crate::endpoint::RateLimit>,
    /// Server processes (stdio transports of sessions) this replica runs at
    /// most at once; `None`: no bound.
    pub max_server_processes: Option<usize>,
    /// A shared server process no session held this long is stopped.
    pub shared_idle_timeout: Duration,
    pub memory: MemorySettings,
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
}

impl Default for MemorySettings {
    fn default() -> Self {
        Self {
            bucket: None,
            replicas: 1,
            max_age: DEFAULT_MEMORY_MAX_AGE,
        }
    }
}

/// Seven days.
pub const DEFAULT_MEMORY_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The fewest replicas of a bucket, and the most JetStream keeps.
pub const MEMORY_REPLICAS: std::ops::RangeInclusive<usize> = 1..=5;
/// The shortest `max_age` of the memory bucket.
pub const MIN_MEMORY_MAX_AGE: Duration = Duration::from_secs(60);

/// The memory bucket of the subject prefix `prefix`: its characters outside
/// `[A-Za-z0-9_-]` (the only ones a bucket name allows) become `_`, and then
/// a short hash of the prefix keeps two prefixes apart.
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

/// A bucket name the catalog can use (its claims bucket adds `_claims`).
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
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            discovery_reuse: Duration::from_secs(3600),
            connect_timeout: Duration::from_secs(10),
            max_concurrent_starts: 2,
            session_idle_timeout: Duration::from_secs(600),
            warmup: WarmupSettings {
                enabled: true,
                connect_timeout: Duration::from_secs(60),
                retry_interval: Duration::from_secs(60),
                attempts: 5,
            },
            memory: MemorySettings::default(),
            mcp_page_size: 100,
            mcp_rate_limit: None,
            max_server_processes: None,
            shared_idle_timeout: Duration::from_secs(300),
        }
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

/// The catalog's own flags (every one also an env var).
#[derive(Debug, Clone, clap::Args)]
pub struct CatalogArgs {
    /// The tenants-and-servers YAML file.
    #[arg(long = "config", env = "CTXSYNC_CATALOG_CONFIG")]
    pub config: PathBuf,

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
    pub memory_max_age: Duration,
    /// Tools per page of the MCP endpoint's `tools/list`.
    #[arg(long, env = "CTXSYNC_CATALOG_MCP_PAGE_SIZE", default_value_t = 100)]
    pub mcp_page_size: usize,

    /// MCP endpoint requests per second per tenant key; 0 means no limit.
    #[arg(long, env = "CTXSYNC_CATALOG_MCP_RATE_LIMIT", default_value_t = 0.0)]
    pub mcp_rate_limit: f64,

    /// Requests a tenant key may make at once above its rate (the bucket).
    #[arg(long, env = "CTXSYNC_CATALOG_MCP_RATE_BURST", default_value_t = 20)]
    pub mcp_rate_burst: u32,

    /// Server processes (sessions' stdio servers) this replica runs at most
    /// at once; 0 means no bound.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_MAX_SERVER_PROCESSES",
        default_value_t = 0
    )]
    pub max_server_processes: usize,

    /// Seconds a shared server process may go without a session before it stops.
    #[arg(
        long,
        env = "CTXSYNC_CATALOG_SHARED_IDLE_SECONDS",
        default_value_t = 300
    )]
    pub shared_idle_seconds: u64,
}

impl CatalogArgs {
    /// Reads the config file and validates the tunables.
    pub fn into_config(
        self,
        common: ctxsync_runtime::CommonArgs,
        database: ctxsync_runtime::DatabaseArgs,
    ) -> Result<Config, ConfigError> {
        let servers = CatalogConfig::load(&self.config)?;
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
        if self.warmup_attempts == 0 {
            return Err(ConfigError::Invalid(
                "CTXSYNC_CATALOG_WARMUP_ATTEMPTS must be at least 1".into(),
            ));
        }
        let memory = MemorySettings {
            bucket: self.memory_bucket,
            replicas: self.memory_replicas,
            max_age: self.memory_max_age,
        };
        memory.validate()?;
        Ok(Config {
            common,
            database,
            servers,
            settings: Settings {
                discovery_reuse: Duration::from_secs(self.discovery_reuse_seconds),
                connect_timeout: positive(
                    "CTXSYNC_CATALOG_CONNECT_TIMEOUT_SECONDS",
                    self.connect_timeout_seconds,
                )?,
                max_concurrent_starts: self.max_concurrent_starts,
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
                },
                memory,
                mcp_page_size: self.mcp_page_size.max(1),
                mcp_rate_limit: rate_limit(self.mcp_rate_limit, self.mcp_rate_burst)?,
                max_server_processes: (self.max_server_processes > 0)
                    .then_some(self.max_server_processes),
                shared_idle_timeout: positive(
                    "CTXSYNC_CATALOG_SHARED_IDLE_SECONDS",
                    self.shared_idle_seconds,
                )?,
            },
        })
    }
}

fn rate_limit(
    per_second: f64,
    burst: u32,
) -> Result<Option<crate::endpoint::RateLimit>, ConfigError> {
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
    Ok(Some(crate::endpoint::RateLimit { per_second, burst }))
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
