//! A catalog under test: its own nats-server, its own Postgres database, and
//! servers configured from fixture or reference-server specs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use catalog::config::{CatalogConfig, Limits, ServerConfig, TenantConfig};
use catalog::{Running, Settings, WarmupSettings};
use ctxsync_mcp::{ServerSpec, TransportSpec};
use ctxsync_proto::Message;
use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::{
    CatalogCallReply, CatalogCallRequest, CatalogEndSessionReply, CatalogEndSessionRequest,
    CatalogPrepareReply, CatalogPrepareRequest,
};
use ctxsync_runtime::Shutdown;
use sqlx::PgPool;
use testkit::stack::{StackBuilder, TestStack};
use testkit::{NatsServer, TestDatabase};

pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A server config from an MCP client spec.
pub fn server(id: &str, spec: &ServerSpec) -> ServerConfig {
    ServerConfig {
        id: id.to_owned(),
        transport: spec.transport.clone(),
        credential_ref: None,
        classification: None,
        limits: Limits::default(),
        enabled: true,
        processes: Default::default(),
        shared_pool: 1,
        naming: None,
        prefix: None,
        aliases: Default::default(),
    }
}

/// The fixture on stdio with `args`, recording its starts in `record_dir`.
pub fn fixture(id: &str, record_dir: &Path, args: &[&str]) -> ServerConfig {
    let record = record_dir.display().to_string();
    let mut all = vec!["--record-dir", record.as_str()];
    all.extend_from_slice(args);
    server(id, &mcp_fixture::fixture_spec(id, &all, &[]))
}

pub fn http(id: &str, url: &str) -> ServerConfig {
    ServerConfig {
        id: id.to_owned(),
        transport: TransportSpec::StreamableHttp {
            url: url.to_owned(),
            headers: BTreeMap::new(),
        },
        credential_ref: None,
        classification: None,
        limits: Limits::default(),
        enabled: true,
        processes: Default::default(),
        shared_pool: 1,
        naming: None,
        prefix: None,
        aliases: Default::default(),
    }
}

pub fn tenants(tenants: Vec<(&str, Vec<ServerConfig>)>) -> CatalogConfig {
    CatalogConfig {
        tenants: tenants
            .into_iter()
            .map(|(id, servers)| TenantConfig {
                id: id.to_owned(),
                naming: Default::default(),
                servers,
            })
            .collect(),
    }
}

/// The memory key of every catalog a test starts: replicas and restarts
/// share their memory as replicas given one key file do.
pub const TEST_MEMORY_KEY: &[u8; 32] = b"catalog-tests-memory-key-32bytes";

/// Test settings: no warm-up unless a test turns it on.
pub fn settings() -> Settings {
    let mut settings = Settings {
        discovery_reuse: Duration::from_secs(3600),
        connect_timeout: Duration::from_secs(20),
        max_concurrent_starts: 2,
        session_idle_timeout: Duration::from_secs(600),
        warmup: WarmupSettings {
            enabled: false,
            connect_timeout: Duration::from_secs(20),
            retry_interval: Duration::from_millis(100),
            attempts: 3,
            fresh: Duration::from_secs(3600),
        },
        ..Settings::default()
    };
    settings.memory.key = Some(catalog::MemoryKey::new(TEST_MEMORY_KEY).unwrap());
    settings
}

/// The value of the series `series` (the whole name with labels, as
/// exported) on the catalog's `/metrics`; 0 when absent.
pub async fn metric(running: &Running, series: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", running.http_addr()))
        .await
        .expect("the catalog answers /metrics")
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

pub struct Harness {
    /// Shared with the replicas started by [`Harness::replica`].
    pub nats: Arc<NatsServer>,
    /// The test's database (dropped with the last harness using it), or
    /// none where the test runs a Postgres server of its own.
    db: Option<Arc<TestDatabase>>,
    database_url: String,
    pub subjects: Subjects,
    pub client: async_nats::Client,
    pub pool: PgPool,
    pub shutdown: Shutdown,
    pub running: Option<Running>,
    /// The stack's other services (a store), running until the shutdown.
    _rest: testkit::stack::Stack,
}

impl Harness {
    pub async fn start(servers: CatalogConfig, settings: Settings) -> Self {
        Self::start_fresh(servers, settings, false).await
    }

    /// With a snapshot-store beside the catalog: tenant keys can be checked
    /// (the MCP endpoint).
    pub async fn start_with_store(servers: CatalogConfig, settings: Settings) -> Self {
        Self::start_fresh(servers, settings, true).await
    }

    async fn start_fresh(servers: CatalogConfig, settings: Settings, with_store: bool) -> Self {
        let TestStack { nats, db, prefix } = TestStack::private().await;
        let url = db.url().to_owned();
        Self::launch(
            Arc::new(nats),
            Some(Arc::new(db)),
            url,
            &prefix,
            servers,
            settings,
            with_store,
        )
        .await
    }

    /// A catalog (and a store beside it, if `with_store`) on `nats` and the
    /// database at `database_url` (a Postgres server of the test's own),
    /// under a fresh prefix.
    pub async fn start_on_url(
        nats: Arc<NatsServer>,
        database_url: String,
        servers: CatalogConfig,
        settings: Settings,
        with_store: bool,
    ) -> Self {
        let prefix = testkit::unique_prefix();
        Self::launch(
            nats,
            None,
            database_url,
            &prefix,
            servers,
            settings,
            with_store,
        )
        .await
    }

    /// A catalog on `nats` and `db` under `prefix`.
    pub async fn start_on(
        nats: Arc<NatsServer>,
        db: Arc<TestDatabase>,
        prefix: &str,
        servers: CatalogConfig,
        settings: Settings,
    ) -> Self {
        let url = db.url().to_owned();
        Self::launch(nats, Some(db), url, prefix, servers, settings, false).await
    }

    async fn launch(
        nats: Arc<NatsServer>,
        db: Option<Arc<TestDatabase>>,
        database_url: String,
        prefix: &str,
        servers: CatalogConfig,
        settings: Settings,
        with_store: bool,
    ) -> Self {
        let shutdown = Shutdown::new();
        let mut builder = StackBuilder::new(nats.url(), prefix).database(&database_url);
        if with_store {
            builder = builder.store(|_| {});
        }
        let builder = builder.catalog(servers, settings, |_| {});
        let mut stack = testkit::stack::start(builder, &shutdown).await;
        let running = stack.catalogs.remove(0).running;
        let client = async_nats::connect(nats.url()).await.expect("test client");
        let pool = PgPool::connect(&database_url).await.expect("test pool");
        Self {
            nats,
            db,
            database_url,
            subjects: Subjects::new(prefix).unwrap(),
            client,
            pool,
            shutdown,
            running: Some(running),
            _rest: stack,
        }
    }

    /// Another catalog on this one's NATS server and database, under `prefix`
    /// (this one's prefix: a replica in its queue group).
    pub async fn replica(&self, prefix: &str, servers: CatalogConfig, settings: Settings) -> Self {
        Self::launch(
            self.nats.clone(),
            self.db.clone(),
            self.database_url.clone(),
            prefix,
            servers,
            settings,
            false,
        )
        .await
    }

    /// Stops the catalog, keeping NATS and the database for a replica.
    pub async fn stop_catalog(&mut self) {
        self.shutdown.cancel();
        if let Some(running) = self.running.take() {
            tokio::time::timeout(Duration::from_secs(30), running.join())
                .await
                .expect("catalog stops within 30 s");
        }
    }

    /// One tenant, `acme`, with `servers` and the test [`settings`].
    pub async fn start_acme(servers: Vec<ServerConfig>) -> Self {
        Self::start(tenants(vec![("acme", servers)]), settings()).await
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().expect("running")
    }

    async fn request<Req: Message, Resp: Message + Default>(
        &self,
        subject: String,
        request: &Req,
    ) -> Resp {
        ctxsync_runtime::rpc::request(&self.client, subject, request, None, REQUEST_TIMEOUT)
            .await
            .expect("catalog answers")
    }

    pub async fn prepare(&self, tenant: &str, session: &str) -> CatalogPrepareReply {
        self.request(
            self.subjects.catalog_prepare(tenant),
            &CatalogPrepareRequest {
                tenant: tenant.into(),
                session_id: session.into(),
            },
        )
        .await
    }

    pub async fn call(
        &self,
        tenant: &str,
        session: &str,
        server: &str,
        tool: &str,
        arguments: serde_json::Value,
    ) -> CatalogCallReply {
        self.call_raw(tenant, session, server, tool, &arguments.to_string())
            .await
    }

    /// A call with `arguments_json` exactly as given.
    pub async fn call_raw(
        &self,
        tenant: &str,
        session: &str,
        server: &str,
        tool: &str,
        arguments_json: &str,
    ) -> CatalogCallReply {
        self.request(
            self.subjects.catalog_call(tenant),
            &CatalogCallRequest {
                tenant: tenant.into(),
                session_id: session.into(),
                server_id: server.into(),
                tool: tool.into(),
                arguments_json: arguments_json.into(),
                ..Default::default()
            },
        )
        .await
    }

    pub async fn end_session(&self, tenant: &str, session: &str) -> CatalogEndSessionReply {
        self.request(
            self.subjects.catalog_session_end(tenant),
            &CatalogEndSessionRequest {
                tenant: tenant.into(),
                session_id: session.into(),
            },
        )
        .await
    }

    /// A new key of `tenant`, made through the harness's store.
    pub async fn tenant_key(&self, tenant: &str) -> String {
        testkit::store::StoreClient::new(
            self.client.clone(),
            self.subjects.clone(),
            REQUEST_TIMEOUT,
            "workspace",
        )
        .retrying_no_responders()
        .create_tenant_key(tenant)
        .await
        .0
    }

    /// How an MCP client reaches the running catalog's `/mcp` with `key`.
    pub fn mcp_spec(&self, key: &str) -> ServerSpec {
        ServerSpec {
            name: "catalog".into(),
            transport: TransportSpec::StreamableHttp {
                url: format!("http://{}/mcp", self.running().http_addr()),
                headers: BTreeMap::from([("Authorization".into(), format!("Bearer {key}"))]),
            },
        }
    }

    /// Waits until every event the running catalog queued is written.
    pub async fn events_written(&self) {
        if let Some(running) = &self.running {
            let written = tokio::time::timeout(Duration::from_secs(10), running.events_written());
            assert!(
                written.await.expect("queued events written within 10 s"),
                "the event writer stopped"
            );
        }
    }

    /// `SELECT count(*) ...`
    pub async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(&self.pool)
            .await
            .expect("count query")
    }

    /// The events of `kind` stored, once everything the catalog queued
    /// (calls, follow-ups, warm-ups: written in the background) is written.
    pub async fn events_of(
        &self,
        kind: &str,
    ) -> Vec<(Option<String>, Option<String>, serde_json::Value)> {
        self.events_written().await;
        sqlx::query_as::<_, (Option<String>, Option<String>, serde_json::Value)>(
            "SELECT session_id, server_id, payload FROM catalog.events WHERE kind = $1 ORDER BY id",
        )
        .bind(kind)
        .fetch_all(&self.pool)
        .await
        .expect("events query")
    }

    pub async fn stop(mut self) {
        self.stop_catalog().await;
    }
}

/// The catalog's name of the failure a reply carries ("" for none); the
/// envelope's code is checked to be that name's.
pub fn error_code(error: &Option<ctxsync_proto::v1::ServiceError>) -> &str {
    let Some(error) = error else { return "" };
    if let Some(name) = catalog_core::ErrorCode::of(error) {
        assert_eq!(error.code(), name.service_code(), "{error:?}");
    }
    error.reason.as_str()
}

pub fn sources(reply: &CatalogPrepareReply) -> Vec<(String, i32)> {
    reply
        .pins
        .iter()
        .map(|p| (p.server_id.clone(), p.source))
        .collect()
}

/// Waits until `condition` holds, checking every 20 ms, up to `bound`.
pub async fn eventually<F: FnMut() -> bool>(bound: Duration, mut condition: F) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if condition() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
