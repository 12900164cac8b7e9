//! Names users choose: a tenant's `bare` strategy (the servers' own names),
//! a server's own prefix and aliases, collisions refused at load and
//! reported (never applied to existing pins) when a live discovery brings
//! them. Against the real catalog, NATS, Postgres and the fixture.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use catalog::config::{Naming, ServerConfig};
use common::*;
use ctxsync_mcp::{ConnectOptions, Connection};

const DEADLINE: Duration = Duration::from_secs(30);

/// The tools an MCP session offers, sorted.
async fn offered_tools(client: &Connection) -> Vec<String> {
    let mut names: Vec<String> = client
        .list_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    names.sort();
    names
}

async fn mcp_client(harness: &Harness, key: &str) -> Connection {
    let options = ConnectOptions {
        sessions_only: true,
        ..ConnectOptions::new(DEADLINE)
    };
    Connection::connect(&harness.mcp_spec(key), options)
        .await
        .expect("an MCP client connects to the catalog")
}

fn bare(servers: Vec<ServerConfig>) -> catalog::CatalogConfig {
    let mut config = tenants(vec![("acme", servers)]);
    config.tenants[0].naming = Naming::Bare;
    config
}

#[tokio::test(flavor = "multi_thread")]
async fn bare_names_are_the_servers_own_and_a_prefix_or_alias_overrides_them() {
    let record = tempfile::tempdir().unwrap();
    let notes = fixture("notes", record.path(), &[]);
    let calc = ServerConfig {
        naming: Some(Naming::Prefix),
        prefix: Some("c".into()),
        aliases: BTreeMap::from([("add".into(), "sum".into())]),
        ..fixture("calc", record.path(), &[])
    };
    let harness = Harness::start_with_store(bare(vec![notes, calc]), settings()).await;
    let key = harness.tenant_key("acme").await;
    let client = mcp_client(&harness, &key).await;

    assert_eq!(
        offered_tools(&client).await,
        ["add", "c__echo", "echo", "sum"]
    );

    // Each name reaches its own server under the server's own name.
    let sum = client
        .call_tool(
            "sum",
            serde_json::json!({"a": 2, "b": 3})
                .as_object()
                .unwrap()
                .clone(),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(sum.content_json.contains("\"5\""), "{}", sum.content_json);
    let echoed = client
        .call_tool(
            "echo",
            serde_json::json!({"text": "bare"})
                .as_object()
                .unwrap()
                .clone(),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(
        echoed.content_json.contains("bare"),
        "{}",
        echoed.content_json
    );

    // The gate's pins carry the rule each name was made with.
    let reply = harness.prepare("acme", "gate").await;
    let rules: Vec<(String, bool, String)> = reply
        .pins
        .iter()
        .map(|p| {
            let rule = p.naming.clone().unwrap();
            (p.server_id.clone(), rule.bare, rule.prefix)
        })
        .collect();
    assert_eq!(
        rules,
        [
            ("notes".to_owned(), true, String::new()),
            ("calc".to_owned(), false, "c".to_owned())
        ]
    );
    client.close().await;
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_collision_is_refused_at_load_and_a_discovered_one_leaves_pins_untouched() {
    let record = tempfile::tempdir().unwrap();
    let one = || fixture("one", record.path(), &[]);
    let two = || fixture("two", record.path(), &[]);

    // Aliases are known at load: two servers aliasing one name is refused.
    let aliased = |server: ServerConfig| ServerConfig {
        aliases: BTreeMap::from([("echo".into(), "say".into())]),
        ..server
    };
    let refused = catalog::CatalogConfig::from_yaml(
        "tenants: [{id: acme, naming: bare, servers: [
            {id: one, transport: {stdio: {command: x}}, aliases: {echo: say}},
            {id: two, transport: {stdio: {command: y}}, aliases: {add: say}}]}]",
    )
    .unwrap_err();
    assert!(
        refused.contains("\"one\"") && refused.contains("\"two\"") && refused.contains("\"say\""),
        "{refused}"
    );

    let harness = Harness::start_with_store(bare(vec![aliased(one())]), settings()).await;
    let first = harness.prepare("acme", "before").await;
    assert_eq!(first.error, None);
    let tools = |reply: &ctxsync_proto::v1::CatalogPrepareReply| -> Vec<(String, Vec<String>)> {
        reply
            .pins
            .iter()
            .map(|p| {
                (
                    p.server_id.clone(),
                    p.tools.iter().map(|t| t.name.clone()).collect(),
                )
            })
            .collect()
    };

    // `two` is not known yet: the config loads; the next preparation
    // discovers it live and its `add` collides with `one`'s.
    harness
        .running()
        .reload(bare(vec![aliased(one()), two()]))
        .unwrap();
    let after = harness.prepare("acme", "after").await;
    assert_eq!(after.error, None);
    let two_pin = after.pins.iter().find(|p| p.server_id == "two").unwrap();
    assert_eq!(
        two_pin.name_collisions,
        ["servers \"one\" and \"two\" both offer the tool \"add\""]
    );
    let discovered = metric(
        harness.running(),
        "ctxsync_catalog_name_collisions_total{found=\"discovery\"}",
    )
    .await;
    assert!(discovered >= 1.0, "the discovered collision is counted");

    // The earlier session's pins are as they were.
    let again = harness.prepare("acme", "before").await;
    assert!(again.follow_up);
    assert_eq!(tools(&again), tools(&first));

    // An MCP session offers `add` once, `one`'s (first in configured order).
    let key = harness.tenant_key("acme").await;
    let client = mcp_client(&harness, &key).await;
    assert_eq!(offered_tools(&client).await, ["add", "echo", "say"]);
    client.close().await;

    // Now the memory knows both: the same config is refused, naming both.
    let error = harness
        .running()
        .reload(bare(vec![aliased(one()), two()]))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("servers \"one\" and \"two\" both offer the tool \"add\""),
        "{error}"
    );
    harness.stop().await;
}
