//! One way to run ctxsync's services together: `ctxsync up`, the bench and
//! every test harness build their stack here.
//!
//! A [`StackBuilder`] names a NATS server, a subject prefix and (for the
//! services that own a schema) a Postgres database, then any subset of the
//! services, each with its own configuration: snapshot-store, agent-ingest,
//! chat-gate and catalog (replicas too: a service added twice runs twice).
//! [`StackBuilder::start`] runs them in this process through each library's
//! `start(config, shutdown)`, in dependency order (store, ingest, gate,
//! catalog), each under its own child of the given shutdown so one can be
//! stopped alone. [`StackBuilder::binaries`] gives, for the same selection,
//! each service's binary and the environment that configures it the same
//! way, for a caller that runs them as processes (the testkit does): each
//! configuration is rendered back into the env its binary's clap parser
//! reads by [`render`], from the parser's own definition, so every setting
//! reaches the binary (`tests/config_round_trip.rs` proves it per service).
//!
//! [`deps`] finds or starts NATS and Postgres for a stack that runs outside
//! the tests (given URL, default local port, or a private server).
//!
//! The services still talk only over NATS and HTTP, exactly as when deployed
//! separately: running them in one process shares nothing else.

pub mod deps;
pub mod render;

use std::net::SocketAddr;

use ctxsync_runtime::{CommonArgs, DatabaseArgs, Shutdown};

pub use render::RenderError;

/// One of the services a stack can run (workspace-agent runs beside a
/// stack, never in it: it belongs to a workspace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    Store,
    Ingest,
    Gate,
    Catalog,
}

impl Service {
    /// The service's name, which is also its package's and its binary's.
    pub fn name(self) -> &'static str {
        match self {
            Self::Store => "snapshot-store",
            Self::Ingest => "agent-ingest",
            Self::Gate => "chat-gate",
            Self::Catalog => "catalog",
        }
    }
}

impl std::fmt::Display for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("{service} did not start: {reason}")]
    Start { service: Service, reason: String },
    #[error("{service} needs a database: call StackBuilder::database first")]
    NoDatabase { service: Service },
    #[error(
        "the catalog as a binary reads its servers from a file: give CTXSYNC_CATALOG_CONFIG with StackBuilder::binary_env"
    )]
    CatalogConfigFile,
    #[error("the catalog's settings cannot reach its binary: {0}")]
    CatalogSettings(#[source] catalog::ConfigError),
    #[error("{service}'s configuration cannot be rendered for its binary: {source}")]
    Render {
        service: Service,
        #[source]
        source: RenderError,
    },
    #[error("no free loopback port for {service}: {reason}")]
    Port { service: Service, reason: String },
}

/// What a stack runs: where, and which services with which configuration.
pub struct StackBuilder {
    nats_url: String,
    subject_prefix: String,
    database_url: Option<String>,
    stores: Vec<snapshot_store::Config>,
    ingests: Vec<agent_ingest::Config>,
    gates: Vec<chat_gate::Config>,
    catalogs: Vec<catalog::Config>,
    binary_env: Vec<(Service, String, String)>,
}

impl StackBuilder {
    /// A stack with no service yet, on `nats_url` under `subject_prefix`.
    pub fn new(nats_url: impl Into<String>, subject_prefix: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            subject_prefix: subject_prefix.into(),
            database_url: None,
            stores: Vec::new(),
            ingests: Vec::new(),
            gates: Vec::new(),
            catalogs: Vec::new(),
            binary_env: Vec::new(),
        }
    }

    /// The Postgres database of the services that own a schema (store, catalog).
    pub fn database(mut self, url: impl Into<String>) -> Self {
        self.database_url = Some(url.into());
        self
    }

    pub fn nats_url(&self) -> &str {
        &self.nats_url
    }

    pub fn subject_prefix(&self) -> &str {
        &self.subject_prefix
    }

    pub fn database_url(&self) -> Option<&str> {
        self.database_url.as_deref()
    }

    /// The settings every service of this stack starts from: its NATS server
    /// and prefix, a loopback listener on a port the system picks.
    pub fn common(&self) -> CommonArgs {
        CommonArgs::for_nats(self.nats_url.clone(), self.subject_prefix.clone())
    }

    fn database_args(&self) -> DatabaseArgs {
        DatabaseArgs::new(self.database_url.clone().unwrap_or_default())
    }

    /// Adds a snapshot-store (again: another replica), configured by `configure`.
    pub fn store(mut self, configure: impl FnOnce(&mut snapshot_store::Config)) -> Self {
        let mut config = snapshot_store::Config::new(self.common(), String::new());
        config.database = self.database_args();
        configure(&mut config);
        self.stores.push(config);
        self
    }

    /// Adds an agent-ingest, configured by `configure`.
    pub fn ingest(mut self, configure: impl FnOnce(&mut agent_ingest::Config)) -> Self {
        let mut config = agent_ingest::Config::new(self.common());
        configure(&mut config);
        self.ingests.push(config);
        self
    }

    /// Adds a chat-gate, configured by `configure`.
    pub fn gate(mut self, configure: impl FnOnce(&mut chat_gate::Config)) -> Self {
        let mut config = chat_gate::Config::new(self.common());
        configure(&mut config);
        self.gates.push(config);
        self
    }

    /// Adds a catalog serving `servers` with `settings`, then `configure`.
    pub fn catalog(
        mut self,
        servers: catalog::config::CatalogConfig,
        settings: catalog::Settings,
        configure: impl FnOnce(&mut catalog::Config),
    ) -> Self {
        let mut config = catalog::Config {
            common: self.common(),
            database: self.database_args(),
            servers,
            settings,
        };
        configure(&mut config);
        self.catalogs.push(config);
        self
    }

    /// An env var every binary of `service` gets, past what its configuration
    /// gives (for the binaries only: in process the configuration says all).
    pub fn binary_env(
        mut self,
        service: Service,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        self.binary_env.push((service, name.into(), value.into()));
        self
    }

    fn check_databases(&self) -> Result<(), StackError> {
        if self
            .stores
            .iter()
            .any(|c| c.database.database_url.is_empty())
        {
            return Err(StackError::NoDatabase {
                service: Service::Store,
            });
        }
        if self
            .catalogs
            .iter()
            .any(|c| c.database.database_url.is_empty())
        {
            return Err(StackError::NoDatabase {
                service: Service::Catalog,
            });
        }
        Ok(())
    }

    /// Starts every service in this process, in dependency order, each under
    /// a child of `shutdown`. When one fails, the ones already started are
    /// stopped and the error names the one that failed.
    pub async fn start(self, shutdown: &Shutdown) -> Result<Stack, StackError> {
        self.check_databases()?;
        let mut stack = Stack::default();
        match Box::pin(self.start_into(&mut stack, shutdown)).await {
            Ok(()) => Ok(stack),
            Err(error) => {
                stack.stop().await;
                Err(error)
            }
        }
    }

    async fn start_into(self, stack: &mut Stack, shutdown: &Shutdown) -> Result<(), StackError> {
        for config in self.stores {
            let token = shutdown.child_token();
            let running = snapshot_store::start(config, token.clone())
                .await
                .map_err(|e| StackError::Start {
                    service: Service::Store,
                    reason: chain(&e),
                })?;
            stack.stores.push(Started::new(running, token));
        }
        for config in self.ingests {
            let token = shutdown.child_token();
            let running = agent_ingest::start(config, token.clone())
                .await
                .map_err(|e| StackError::Start {
                    service: Service::Ingest,
                    reason: chain(&e),
                })?;
            stack.ingests.push(Started::new(running, token));
        }
        for config in self.gates {
            let token = shutdown.child_token();
            let running =
                chat_gate::start(config, token.clone())
                    .await
                    .map_err(|e| StackError::Start {
                        service: Service::Gate,
                        reason: chain(&e),
                    })?;
            stack.gates.push(Started::new(running, token));
        }
        for config in self.catalogs {
            let token = shutdown.child_token();
            let running =
                catalog::start(config, token.clone())
                    .await
                    .map_err(|e| StackError::Start {
                        service: Service::Catalog,
                        reason: chain(&e),
                    })?;
            stack.catalogs.push(Started::new(running, token));
        }
        Ok(())
    }

    /// The same selection as binaries: each service's binary and the env
    /// that configures it as its configuration says (every setting, see
    /// [`render`]), in start order, then [`StackBuilder::binary_env`]'s. A
    /// listener on port 0 is given a free loopback port, so the caller knows
    /// where to ask for readiness. The catalog reads its servers from the
    /// file `CTXSYNC_CATALOG_CONFIG` names, and a memory key given in its
    /// settings from `CTXSYNC_CATALOG_MEMORY_KEY_FILE` (both binary env).
    pub fn binaries(&self) -> Result<Vec<Binary>, StackError> {
        self.check_databases()?;
        let mut binaries = Vec::new();
        for config in &self.stores {
            let mut config = config.clone();
            with_port(Service::Store, &mut config.common)?;
            binaries.push(self.binary(Service::Store, &config)?);
        }
        for config in &self.ingests {
            let mut config = config.clone();
            with_port(Service::Ingest, &mut config.common)?;
            binaries.push(self.binary(Service::Ingest, &config)?);
        }
        for config in &self.gates {
            let mut config = config.clone();
            with_port(Service::Gate, &mut config.common)?;
            binaries.push(self.binary(Service::Gate, &config)?);
        }
        for config in &self.catalogs {
            let args = self.catalog_args(config)?;
            binaries.push(self.binary(Service::Catalog, &args)?);
        }
        Ok(binaries)
    }

    /// The catalog binary's flags for `config`.
    fn catalog_args(&self, config: &catalog::Config) -> Result<catalog::Args, StackError> {
        let file = self
            .binary_env_of(Service::Catalog, "CTXSYNC_CATALOG_CONFIG")
            .ok_or(StackError::CatalogConfigFile)?;
        let key_file = self.binary_env_of(Service::Catalog, "CTXSYNC_CATALOG_MEMORY_KEY_FILE");
        let catalog =
            catalog::CatalogArgs::of(file.into(), key_file.map(Into::into), &config.settings)
                .map_err(StackError::CatalogSettings)?;
        let mut common = config.common.clone();
        with_port(Service::Catalog, &mut common)?;
        Ok(catalog::Args {
            common,
            database: config.database.clone(),
            catalog,
            // Trusted process-wide (`ctxsync_mcp::https::trust_extra_ca`), so
            // no catalog configuration holds it: binary env gives it.
            mcp_ca_file: None,
        })
    }

    /// The last value [`StackBuilder::binary_env`] gave `name` for `service`.
    fn binary_env_of(&self, service: Service, name: &str) -> Option<&str> {
        self.binary_env
            .iter()
            .rev()
            .find(|(s, n, _)| *s == service && n == name)
            .map(|(_, _, value)| value.as_str())
    }

    fn binary<T: clap::Args + serde::Serialize>(
        &self,
        service: Service,
        config: &T,
    ) -> Result<Binary, StackError> {
        let mut env =
            render::env_of(config).map_err(|source| StackError::Render { service, source })?;
        for (s, name, value) in &self.binary_env {
            if *s == service {
                env.retain(|(n, _)| n != name);
                env.push((name.clone(), value.clone()));
            }
        }
        let http_addr = env
            .iter()
            .find(|(n, _)| n == "CTXSYNC_HTTP_ADDR")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        Ok(Binary {
            service,
            http_addr,
            env,
        })
    }
}

/// One service to run as its binary.
#[derive(Debug, Clone)]
pub struct Binary {
    pub service: Service,
    /// Where it serves health, readiness and its HTTP API.
    pub http_addr: SocketAddr,
    /// Its whole configuration, as env vars.
    pub env: Vec<(String, String)>,
}

/// An error with its sources, as one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A listener on port 0 gets a free port of its address, so that a caller
/// knows where the binary listens.
fn with_port(service: Service, common: &mut CommonArgs) -> Result<(), StackError> {
    let addr = &mut common.http_addr;
    if addr.port() == 0 {
        let port = std::net::TcpListener::bind((addr.ip(), 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| StackError::Port {
                service,
                reason: e.to_string(),
            })?
            .port();
        addr.set_port(port);
    }
    Ok(())
}

/// A service started in process, with the shutdown that stops it alone.
pub struct Started<T> {
    pub running: T,
    pub shutdown: Shutdown,
}

impl<T> Started<T> {
    fn new(running: T, shutdown: Shutdown) -> Self {
        Self { running, shutdown }
    }
}

/// The services a [`StackBuilder`] started in this process, in start order
/// within each kind.
#[derive(Default)]
pub struct Stack {
    pub stores: Vec<Started<snapshot_store::RunningStore>>,
    pub ingests: Vec<Started<agent_ingest::RunningIngest>>,
    pub gates: Vec<Started<chat_gate::RunningGate>>,
    pub catalogs: Vec<Started<catalog::Running>>,
}

impl Stack {
    /// The first snapshot-store.
    pub fn store(&self) -> &snapshot_store::RunningStore {
        &self.stores.first().expect("the stack runs a store").running
    }

    /// The first agent-ingest.
    pub fn ingest(&self) -> &agent_ingest::RunningIngest {
        &self
            .ingests
            .first()
            .expect("the stack runs an ingest")
            .running
    }

    /// The first chat-gate.
    pub fn gate(&self) -> &chat_gate::RunningGate {
        &self.gates.first().expect("the stack runs a gate").running
    }

    /// The first catalog.
    pub fn catalog(&self) -> &catalog::Running {
        &self
            .catalogs
            .first()
            .expect("the stack runs a catalog")
            .running
    }

    /// Stops every service: the edges first (gates, ingests, catalogs), the
    /// store they call last, each joined before the next kind is stopped.
    pub async fn stop(self) {
        let Self {
            stores,
            ingests,
            gates,
            catalogs,
        } = self;
        for started in gates {
            started.shutdown.cancel();
            started.running.join().await;
        }
        for started in ingests {
            started.shutdown.cancel();
            started.running.join().await;
        }
        for started in catalogs {
            started.shutdown.cancel();
            started.running.join().await;
        }
        for started in stores {
            started.shutdown.cancel();
            started.running.join().await;
        }
    }

    /// Waits until every service has stopped (after its shutdown was cancelled).
    pub async fn join(self) {
        let joins = async {
            for started in self.gates {
                started.running.join().await;
            }
        };
        let ingests = async {
            for started in self.ingests {
                started.running.join().await;
            }
        };
        let catalogs = async {
            for started in self.catalogs {
                started.running.join().await;
            }
        };
        let stores = async {
            for started in self.stores {
                started.running.join().await;
            }
        };
        tokio::join!(joins, ingests, catalogs, stores);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value<'a>(binary: &'a Binary, name: &str) -> Option<&'a str> {
        binary
            .env
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_cluster_url_list_reaches_every_service_as_given() {
        let list = "nats://127.0.0.1:4001,nats://127.0.0.1:4002,nats://127.0.0.1:4003";
        let builder = StackBuilder::new(list, "pfx")
            .database("postgres://u@h/db")
            .store(|_| {})
            .store(|_| {})
            .gate(|_| {});
        assert_eq!(builder.common().nats_url, list);
        let binaries = builder.binaries().unwrap();
        assert_eq!(binaries.len(), 3);
        for binary in &binaries {
            assert_eq!(value(binary, "NATS_URL"), Some(list));
        }
    }

    use std::time::Duration;

    #[test]
    fn binaries_are_configured_as_their_configurations_say() {
        let builder = StackBuilder::new("nats://127.0.0.1:4999", "pfx")
            .database("postgres://u@h/db")
            .store(|c| c.event_state_max_bytes = 7)
            .gate(|c| {
                c.pending_timeout = Duration::from_secs(60);
                c.catalog = false;
            })
            .binary_env(Service::Gate, "CTXSYNC_GATE_MAX_VIEWS", "3");
        let binaries = builder.binaries().unwrap();
        let services: Vec<Service> = binaries.iter().map(|b| b.service).collect();
        assert_eq!(services, [Service::Store, Service::Gate]);
        let (store, gate) = (&binaries[0], &binaries[1]);
        for binary in &binaries {
            assert_eq!(value(binary, "NATS_URL"), Some("nats://127.0.0.1:4999"));
            assert_eq!(value(binary, "CTXSYNC_SUBJECT_PREFIX"), Some("pfx"));
            assert_ne!(binary.http_addr.port(), 0, "a port is chosen");
            assert_eq!(
                value(binary, "CTXSYNC_HTTP_ADDR"),
                Some(binary.http_addr.to_string().as_str())
            );
        }
        assert_eq!(value(store, "DATABASE_URL"), Some("postgres://u@h/db"));
        assert_eq!(
            value(store, "CTXSYNC_STORE_EVENT_STATE_MAX_BYTES"),
            Some("7")
        );
        assert_eq!(value(gate, "DATABASE_URL"), None);
        assert_eq!(value(gate, "CTXSYNC_GATE_PENDING_TIMEOUT"), Some("1m"));
        assert_eq!(value(gate, "CTXSYNC_GATE_CATALOG"), Some("false"));
        assert_eq!(value(gate, "CTXSYNC_GATE_MAX_VIEWS"), Some("3"));
        assert_eq!(
            gate.env
                .iter()
                .filter(|(n, _)| n == "CTXSYNC_GATE_MAX_VIEWS")
                .count(),
            1,
            "an extra env var replaces the configured one"
        );
    }

    #[test]
    fn a_service_that_owns_a_schema_needs_a_database() {
        let error = StackBuilder::new("nats://127.0.0.1:4999", "pfx")
            .store(|_| {})
            .binaries()
            .unwrap_err();
        assert!(matches!(
            error,
            StackError::NoDatabase {
                service: Service::Store
            }
        ));
    }

    #[test]
    fn a_catalog_binary_needs_its_config_file() {
        let builder = StackBuilder::new("nats://127.0.0.1:4999", "pfx")
            .database("postgres://u@h/db")
            .catalog(
                catalog::config::CatalogConfig { tenants: vec![] },
                catalog::Settings::default(),
                |_| {},
            );
        assert!(matches!(
            builder.binaries(),
            Err(StackError::CatalogConfigFile)
        ));
        let binaries = builder
            .binary_env(Service::Catalog, "CTXSYNC_CATALOG_CONFIG", "/etc/c.yaml")
            .binaries()
            .unwrap();
        assert_eq!(
            value(&binaries[0], "CTXSYNC_CATALOG_CONFIG"),
            Some("/etc/c.yaml")
        );
    }
}
