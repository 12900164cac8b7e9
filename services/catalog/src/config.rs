//! The operator's server configuration: tenants and their MCP servers, read
//! from a YAML file (format in the crate README and `deploy/catalog.example.yaml`).
//!
//! A server's memory key is the SHA-256 of its whole canonical configuration,
//! tenant included, so any change (endpoint, env, headers, credential
//! reference, classification, limits) is a different entry. `enabled` is not
//! part of it: switching a server off and on again does not change its tools.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub use ctxsync_mcp::TransportSpec;
use ctxsync_mcp::{ServerSpec, TransportKind};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use catalog_core::naming::{self, Declared, NameRule, Named};
use catalog_core::tools::Catalog;

/// Longest alias: MCP clients commonly cap tool names at 64 bytes; 128
/// leaves room and still bounds what a config can ask for.
const MAX_ALIAS_BYTES: usize = 128;

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogConfig {
    pub tenants: Vec<TenantConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub id: String,
    /// How MCP clients see the servers' tool and prompt names.
    #[serde(default)]
    pub naming: Naming,
    #[serde(default)]
    pub servers: Vec<ServerConfig>,
}

/// A naming strategy: the tenant's, or a server's override of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Naming {
    /// `server__tool` (the server's `prefix` if set, else its id).
    #[default]
    Prefix,
    /// The server's own names; two servers offering one is a config error.
    Bare,
}

/// One operator-configured MCP server.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub id: String,
    /// `stdio: {...}` or `streamable_http: {...}` (a one-key map, not a YAML tag).
    #[serde(with = "serde_norway::with::singleton_map")]
    pub transport: TransportSpec,
    /// Names the credential the server uses (e.g. a vault path). The catalog
    /// does not resolve it; it is part of the key so a different credential is
    /// a different entry.
    #[serde(default)]
    pub credential_ref: Option<String>,
    /// The operator's data classification of the server (e.g. `internal`).
    #[serde(default)]
    pub classification: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default = "enabled_default", skip_serializing)]
    pub enabled: bool,
    /// Whether each session starts its own process (the default) or the
    /// tenant's sessions share a small pool. Not part of the key: sharing
    /// does not change what the server offers.
    #[serde(default, skip_serializing)]
    pub processes: Processes,
    /// Processes of a shared server at most (1 to [`MAX_SHARED_POOL`]).
    #[serde(default = "shared_pool_default", skip_serializing)]
    pub shared_pool: usize,
    /// Overrides the tenant's naming strategy for this server. Names are
    /// not part of the key: they do not change what the server offers.
    #[serde(default, skip_serializing)]
    pub naming: Option<Naming>,
    /// The prefix of its names instead of its id (`prefix` naming).
    #[serde(default, skip_serializing)]
    pub prefix: Option<String>,
    /// Names chosen for single tools or prompts: its own name → offered.
    #[serde(default, skip_serializing)]
    pub aliases: std::collections::BTreeMap<String, String>,
}

fn enabled_default() -> bool {
    true
}

fn shared_pool_default() -> usize {
    1
}

/// Largest pool of one shared server.
pub const MAX_SHARED_POOL: usize = 16;

/// How a server's processes are given to sessions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Processes {
    /// Each session that calls the server starts its own (stdio) or opens its
    /// own connection (HTTP), closed when the session ends.
    #[default]
    PerSession,
    /// One process (or a pool of `shared_pool`) for all the tenant's sessions,
    /// started on first use, stopped after the shared idle time unused.
    Shared,
}

// Env values and headers are secrets: Debug shows their names only.
impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConfig")
            .field("id", &self.id)
            .field("transport", &self.transport.kind())
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

/// A server's `limits:` in the file; a field left out has its default, the
/// one place those are written.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Bound of one tool call.
    pub call_timeout_seconds: u64,
    /// Bound of one tool result's content (JSON bytes); a larger result is refused.
    pub max_content_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            call_timeout_seconds: 60,
            max_content_bytes: 1024 * 1024,
        }
    }
}

/// The SHA-256 (hex) of a server's canonical configuration, tenant included.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerKey(String);

impl ServerKey {
    pub fn of(tenant: &str, server: &ServerConfig) -> Self {
        #[derive(Serialize)]
        struct Canonical<'a> {
            tenant: &'a str,
            server: &'a ServerConfig,
        }
        // Struct fields serialize in declaration order and maps are BTreeMaps:
        // the bytes are deterministic, and defaults are filled in, so an
        // omitted default and the same value written out are one entry.
        let bytes = serde_json::to_vec(&Canonical { tenant, server })
            .expect("a server config always serializes");
        Self(hex::encode(Sha256::digest(&bytes)))
    }

    /// A key as the memory bucket names it: 64 lowercase hex digits.
    pub fn from_hex(text: &str) -> Option<Self> {
        (text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A prefix for logs.
    pub fn short(&self) -> &str {
        &self.0[..12]
    }
}

impl fmt::Debug for ServerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ServerKey({})", self.short())
    }
}

impl fmt::Display for ServerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A configured server with its key.
#[derive(Debug, Clone)]
pub struct ConfiguredServer {
    pub tenant: String,
    pub key: ServerKey,
    pub config: ServerConfig,
    /// Its names, by the tenant's strategy and its own overrides.
    pub naming: NameRule,
}

impl ConfiguredServer {
    pub fn id(&self) -> &str {
        &self.config.id
    }

    pub fn transport_kind(&self) -> TransportKind {
        self.config.transport.kind()
    }

    /// What the MCP client connects to: the server id and its transport.
    pub fn spec(&self) -> ServerSpec {
        ServerSpec {
            name: self.config.id.clone(),
            transport: self.config.transport.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // The io error is in the message, not a source: at the edge the
    // error's chain is printed too, and would say it twice.
    #[error("cannot read the catalog config {path} (CTXSYNC_CATALOG_CONFIG): {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("invalid catalog config {path} (CTXSYNC_CATALOG_CONFIG): {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("invalid catalog config: {0}")]
    Invalid(String),
}

impl CatalogConfig {
    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let config: Self = serde_norway::from_str(text).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_owned(),
            error,
        })?;
        Self::from_yaml(&text).map_err(|reason| ConfigError::Parse {
            path: path.to_owned(),
            reason,
        })
    }

    fn validate(&self) -> Result<(), String> {
        let mut tenants = HashSet::new();
        for tenant in &self.tenants {
            ctxsync_proto::ids::tenant(&tenant.id).map_err(|e| e.to_string())?;
            if !tenants.insert(tenant.id.as_str()) {
                return Err(format!("tenant {:?} is configured twice", tenant.id));
            }
            let mut servers = HashSet::new();
            for server in &tenant.servers {
                let id = &server.id;
                ctxsync_proto::ids::name("server id", id)
                    .map_err(|e| format!("tenant {:?}: {e}", tenant.id))?;
                // `__` separates server and tool in the tool names chats see.
                if id.contains("__") {
                    return Err(format!(
                        "tenant {:?}: server id {id:?} contains \"__\", which separates server and tool names",
                        tenant.id
                    ));
                }
                if !(1..=MAX_SHARED_POOL).contains(&server.shared_pool) {
                    return Err(format!(
                        "tenant {:?}: server {id:?}: shared_pool must be 1 to {MAX_SHARED_POOL}",
                        tenant.id
                    ));
                }
                if !servers.insert(id.as_str()) {
                    return Err(format!(
                        "tenant {:?}: server {id:?} is configured twice",
                        tenant.id
                    ));
                }
                match &server.transport {
                    TransportSpec::Stdio { command, .. } if command.trim().is_empty() => {
                        return Err(format!(
                            "tenant {:?}: server {id:?}: stdio command is empty",
                            tenant.id
                        ));
                    }
                    TransportSpec::StreamableHttp { url, .. }
                        if !(url.starts_with("http://") || url.starts_with("https://")) =>
                    {
                        // The URL may hold credentials: don't echo it.
                        return Err(format!(
                            "tenant {:?}: server {id:?}: streamable_http url must start with http:// or https://",
                            tenant.id
                        ));
                    }
                    _ => {}
                }
                if let Some(prefix) = &server.prefix {
                    ctxsync_proto::ids::name("prefix", prefix)
                        .map_err(|e| format!("tenant {:?}: server {id:?}: {e}", tenant.id))?;
                    if prefix.contains(naming::SEPARATOR) {
                        return Err(format!(
                            "tenant {:?}: server {id:?}: prefix {prefix:?} contains \"__\", which ends the prefix",
                            tenant.id
                        ));
                    }
                }
                for (own, offered) in &server.aliases {
                    if own.is_empty() || offered.is_empty() || offered.len() > MAX_ALIAS_BYTES {
                        return Err(format!(
                            "tenant {:?}: server {id:?}: alias {own:?} -> {offered:?} must name 1 to {MAX_ALIAS_BYTES} bytes",
                            tenant.id
                        ));
                    }
                }
                if server.limits.call_timeout_seconds == 0 {
                    return Err(format!(
                        "tenant {:?}: server {id:?}: limits.call_timeout_seconds must be at least 1",
                        tenant.id
                    ));
                }
            }
        }
        // Prefixes and aliases are known now; the servers' own names when
        // the memory is (`Running::reload`, the start).
        if let Some(collision) = self.collisions(|_| None).into_iter().next() {
            return Err(collision);
        }
        Ok(())
    }

    /// The enabled servers of `tenant`, in configured order; `None` for an unknown tenant.
    pub fn enabled_servers(&self, tenant: &str) -> Option<Vec<ConfiguredServer>> {
        let tenant = self.tenants.iter().find(|t| t.id == tenant)?;
        Some(
            tenant
                .servers
                .iter()
                .filter(|s| s.enabled)
                .map(|s| ConfiguredServer {
                    tenant: tenant.id.clone(),
                    key: ServerKey::of(&tenant.id, s),
                    naming: name_rule(tenant.naming, s),
                    config: s.clone(),
                })
                .collect(),
        )
    }

    /// The name collisions of every tenant's enabled servers, their
    /// catalogs taken from `known` where it has one (the memory).
    pub fn collisions(&self, known: impl Fn(&ServerKey) -> Option<Arc<Catalog>>) -> Vec<String> {
        let mut found = Vec::new();
        for tenant in &self.tenants {
            let servers = self.enabled_servers(&tenant.id).unwrap_or_default();
            let catalogs: Vec<_> = servers.iter().map(|s| known(&s.key)).collect();
            let named: Vec<Named<'_>> = servers
                .iter()
                .zip(&catalogs)
                .map(|(s, catalog)| Named {
                    server_id: s.id(),
                    rule: &s.naming,
                    declared: catalog.as_deref().map(Declared::of_catalog),
                })
                .collect();
            found.extend(
                naming::collisions(&named)
                    .into_iter()
                    .map(|c| format!("tenant {:?}: {c}", tenant.id)),
            );
        }
        found
    }

    /// Every enabled server of every tenant, tenants and servers in configured order.
    pub fn all_enabled_servers(&self) -> Vec<ConfiguredServer> {
        self.tenants
            .iter()
            .flat_map(|t| self.enabled_servers(&t.id).unwrap_or_default())
            .collect()
    }
}

/// A server's rule: its own strategy if set, else the tenant's.
fn name_rule(tenant: Naming, server: &ServerConfig) -> NameRule {
    let prefix = match server.naming.unwrap_or(tenant) {
        Naming::Bare => None,
        Naming::Prefix => Some(server.prefix.clone().unwrap_or_else(|| server.id.clone())),
    };
    NameRule {
        prefix,
        aliases: server.aliases.clone(),
    }
}

/// The configuration in force, replaced whole on reload; read by the parts
/// that need it (preparation, calls, the warm-up) when they start a request.
#[derive(Debug)]
pub(crate) struct Current(RwLock<Arc<Resolved>>);

impl Current {
    pub fn new(config: CatalogConfig) -> Self {
        Self(RwLock::new(Arc::new(Resolved::of(config))))
    }

    pub fn get(&self) -> Arc<Resolved> {
        self.0.read().expect("config lock").clone()
    }

    pub fn replace(&self, config: CatalogConfig) {
        let resolved = Arc::new(Resolved::of(config));
        *self.0.write().expect("config lock") = resolved;
    }
}

/// A configuration with its enabled servers resolved once, at load: a
/// server's memory key hashes its whole configuration, which every
/// preparation and call would otherwise redo for every server of the tenant.
#[derive(Debug)]
pub(crate) struct Resolved {
    config: CatalogConfig,
    /// Each tenant's enabled servers, in configured order.
    servers: HashMap<String, Vec<ConfiguredServer>>,
}

impl Resolved {
    fn of(config: CatalogConfig) -> Self {
        let servers = config
            .tenants
            .iter()
            .filter_map(|t| Some((t.id.clone(), config.enabled_servers(&t.id)?)))
            .collect();
        Self { config, servers }
    }

    /// [`CatalogConfig::enabled_servers`], resolved at load.
    pub fn enabled_servers(&self, tenant: &str) -> Option<Vec<ConfiguredServer>> {
        self.servers.get(tenant).cloned()
    }

    /// `tenant`'s enabled server `id`, if configured.
    pub fn enabled_server(&self, tenant: &str, id: &str) -> Option<ConfiguredServer> {
        self.servers
            .get(tenant)?
            .iter()
            .find(|s| s.id() == id)
            .cloned()
    }

    /// [`CatalogConfig::all_enabled_servers`], resolved at load.
    pub fn all_enabled_servers(&self) -> Vec<ConfiguredServer> {
        self.config
            .tenants
            .iter()
            .flat_map(|t| self.servers.get(&t.id).into_iter().flatten().cloned())
            .collect()
    }
}

impl std::ops::Deref for Resolved {
    type Target = CatalogConfig;

    fn deref(&self) -> &CatalogConfig {
        &self.config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
tenants:
  - id: acme
    servers:
      - id: time
        transport:
          stdio:
            command: uvx
            args: [mcp-server-time]
            env: {TZ: UTC}
        classification: internal
      - id: docs
        transport:
          streamable_http:
            url: https://mcp.example.com/mcp
            headers: {Authorization: "Bearer s3cret"}
        credential_ref: vault:acme/docs
        limits: {call_timeout_seconds: 30}
      - id: off
        enabled: false
        transport:
          stdio: {command: x}
"#;

    fn key_of(yaml: &str, server: &str) -> ServerKey {
        let config = CatalogConfig::from_yaml(yaml).unwrap();
        config
            .enabled_servers("acme")
            .unwrap()
            .into_iter()
            .find(|s| s.id() == server)
            .unwrap()
            .key
    }

    #[test]
    fn parses_and_lists_enabled_servers_in_order() {
        let config = CatalogConfig::from_yaml(EXAMPLE).unwrap();
        let ids: Vec<_> = config
            .enabled_servers("acme")
            .unwrap()
            .iter()
            .map(|s| s.id().to_owned())
            .collect();
        assert_eq!(ids, ["time", "docs"]);
        assert!(config.enabled_servers("nobody").is_none());
    }

    #[test]
    fn any_change_is_a_different_key_but_defaults_are_not() {
        let base = key_of(EXAMPLE, "time");
        assert_eq!(base, key_of(EXAMPLE, "time"));
        for changed in [
            EXAMPLE.replace("TZ: UTC", "TZ: CET"),
            EXAMPLE.replace(
                "[mcp-server-time]",
                "[mcp-server-time, --local-timezone=UTC]",
            ),
            EXAMPLE.replace("classification: internal", "classification: public"),
            EXAMPLE
                .replace("id: acme", "id: other")
                .replace("\"acme\"", "\"other\""),
        ] {
            let config = CatalogConfig::from_yaml(&changed).unwrap();
            let tenant = &config.tenants[0].id;
            let key = config.enabled_servers(tenant).unwrap()[0].key.clone();
            assert_ne!(key, base, "{changed}");
        }
        let docs = key_of(EXAMPLE, "docs");
        assert_ne!(
            docs,
            key_of(&EXAMPLE.replace("s3cret", "other"), "docs"),
            "a header change is a different entry"
        );
        assert_ne!(
            docs,
            key_of(&EXAMPLE.replace("acme/docs", "acme/docs2"), "docs")
        );
        assert_ne!(
            docs,
            key_of(
                &EXAMPLE.replace("call_timeout_seconds: 30", "call_timeout_seconds: 31"),
                "docs"
            )
        );
        let explicit = EXAMPLE.replace(
            "classification: internal",
            "classification: internal\n        limits: {call_timeout_seconds: 60}\n        enabled: true",
        );
        assert_eq!(
            base,
            key_of(&explicit, "time"),
            "defaults written out are the same entry"
        );
    }

    #[test]
    fn rejects_bad_configs_with_reasons() {
        let dup = "tenants: [{id: a, servers: [{id: s, transport: {stdio: {command: x}}}, {id: s, transport: {stdio: {command: y}}}]}]";
        assert!(CatalogConfig::from_yaml(dup).unwrap_err().contains("twice"));
        let bad_id = "tenants: [{id: a, servers: [{id: a__b, transport: {stdio: {command: x}}}]}]";
        assert!(CatalogConfig::from_yaml(bad_id).unwrap_err().contains("__"));
        let bad_url = "tenants: [{id: a, servers: [{id: s, transport: {streamable_http: {url: 'ftp://u:secret@h'}}}]}]";
        let error = CatalogConfig::from_yaml(bad_url).unwrap_err();
        assert!(
            error.contains("http://") && !error.contains("secret"),
            "{error}"
        );
        let unknown =
            "tenants: [{id: a, servers: [{id: s, transport: {stdio: {command: x}}, colour: red}]}]";
        assert!(
            CatalogConfig::from_yaml(unknown)
                .unwrap_err()
                .contains("colour")
        );
    }

    #[test]
    fn debug_hides_secrets() {
        let config = CatalogConfig::from_yaml(EXAMPLE).unwrap();
        let text = format!("{config:?}");
        assert!(!text.contains("s3cret") && !text.contains("UTC"), "{text}");
    }

    #[test]
    fn the_deploy_example_parses_and_sharing_is_not_part_of_the_key() {
        let example = include_str!("../../../deploy/catalog.example.yaml");
        let config = CatalogConfig::from_yaml(example).unwrap();
        let files = &config.tenants[0].servers[1];
        assert_eq!(files.processes, Processes::Shared);
        let mut per_session = files.clone();
        per_session.processes = Processes::PerSession;
        assert_eq!(
            ServerKey::of("acme", files),
            ServerKey::of("acme", &per_session)
        );

        let pool_too_large = "tenants:\n  - id: a\n    servers:\n      - id: s\n        transport: {stdio: {command: x}}\n        shared_pool: 17";
        let error = CatalogConfig::from_yaml(pool_too_large).unwrap_err();
        assert!(error.contains("shared_pool must be 1 to 16"), "{error}");
    }

    #[test]
    fn names_are_configured_per_tenant_and_server_and_not_part_of_the_key() {
        let yaml = "tenants: [{id: a, naming: bare, servers: [
            {id: one, transport: {stdio: {command: x}}},
            {id: two, transport: {stdio: {command: y}}, naming: prefix, prefix: t, aliases: {add: sum}}]}]";
        let config = CatalogConfig::from_yaml(yaml).unwrap();
        let servers = config.enabled_servers("a").unwrap();
        assert_eq!(servers[0].naming, NameRule::bare());
        assert_eq!(servers[1].naming.offered("echo"), "t__echo");
        assert_eq!(servers[1].naming.offered("add"), "sum");
        let mut plain = config.tenants[0].servers[1].clone();
        plain.aliases.clear();
        plain.prefix = None;
        assert_eq!(
            ServerKey::of("a", &plain),
            ServerKey::of("a", &config.tenants[0].servers[1])
        );

        let example = include_str!("../../../deploy/catalog.example.yaml");
        let files = &CatalogConfig::from_yaml(example)
            .unwrap()
            .enabled_servers("acme")
            .unwrap()[1];
        assert_eq!(files.naming.offered("read_text_file"), "read");
        assert_eq!(files.naming.offered("write_file"), "fs__write_file");
    }

    #[test]
    fn a_prefix_or_alias_that_cannot_be_a_name_is_refused_saying_which() {
        let with = |extra: &str| {
            CatalogConfig::from_yaml(&format!(
                "tenants: [{{id: a, servers: [{{id: s, transport: {{stdio: {{command: x}}}}, {extra}}}]}}]"
            ))
            .unwrap_err()
        };
        assert!(with("prefix: a__b").contains("prefix \"a__b\" contains \"__\""));
        let long = "x".repeat(129);
        assert!(with(&format!("aliases: {{echo: {long}}}")).contains("must name 1 to 128 bytes"));
        let same_prefix = "tenants: [{id: a, servers: [
            {id: one, transport: {stdio: {command: x}}, prefix: p},
            {id: two, transport: {stdio: {command: y}}, prefix: p}]}]";
        let error = CatalogConfig::from_yaml(same_prefix).unwrap_err();
        assert!(
            error.contains("\"one\" and \"two\"") && error.contains("p__*"),
            "{error}"
        );
    }
}
