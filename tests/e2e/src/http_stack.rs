//! The services that answer HTTP, in this process on a private NATS server
//! and database, as the HTTP-wide tests (the OpenAPI document, schemathesis,
//! `nosniff`) start them: store, ingest, gate, and a catalog with no servers
//! (its status answer costs no MCP start); one agent registered and the test
//! tenant's key created.

use std::time::Duration;

use testkit::stack::{Stack, TestStack};
use testkit::store::StoreClient;

/// How long ingest and the gate wait for the store. These tests judge the
/// shape of every answer, not its latency: on a loaded 2-core CI machine
/// the store once took over the default 5 s to answer, and the 503 that
/// followed was correct behaviour but no finding about the document. Below
/// schemathesis' own request timeout (10 s), so a store that never answers
/// still shows as the 503 it is.
const STORE_TIMEOUT: Duration = Duration::from_secs(9);

pub struct HttpStack {
    pub test: TestStack,
    pub shutdown: ctxsync_runtime::Shutdown,
    pub stack: Stack,
    pub store: StoreClient,
    /// The registered agent, whose token is the one given to [`start`].
    pub agent_id: String,
}

/// Starts the stack and registers agent `name` with `token`.
pub async fn start(name: &str, token: &str) -> HttpStack {
    start_with_gate(name, token, |_| {}).await
}

/// [`start`] with the gate's configuration changed by `configure`.
pub async fn start_with_gate(
    name: &str,
    token: &str,
    configure: impl FnOnce(&mut chat_gate::Config),
) -> HttpStack {
    let test = TestStack::private().await;
    let shutdown = ctxsync_runtime::Shutdown::new();
    let stack = testkit::stack::start(
        test.builder()
            .store(|_| {})
            .ingest(|config| config.store_timeout = STORE_TIMEOUT)
            .gate(|config| {
                config.store_timeout = STORE_TIMEOUT;
                configure(config);
            })
            .catalog(
                catalog::config::CatalogConfig { tenants: vec![] },
                catalog::Settings::default(),
                |_| {},
            ),
        &shutdown,
    )
    .await;
    let nats = async_nats::connect(test.nats.url()).await.unwrap();
    let store = StoreClient::new(nats, test.subjects(), Duration::from_secs(10), "workspace")
        .retrying_no_responders();
    let agent_id = store.register(name, token).await;
    store.create_test_tenant_key().await;
    HttpStack {
        test,
        shutdown,
        stack,
        store,
        agent_id,
    }
}
