//! Every setting of every service reaches its binary: each service's
//! configuration, with every setting away from its default, rendered by the
//! stack's own path (`StackBuilder::binaries`) and parsed by the service's
//! own clap definition, is the configuration given.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{ArgAction, Command, FromArgMatches};
use ctxsync_runtime::args::defaults_with;
use ctxsync_runtime::config::{HttpArgs, ReplyInboxes};
use ctxsync_runtime::{CommonArgs, DatabaseArgs, LogFormat, NatsTlsArgs};
use ctxsync_stack::{Binary, Service, StackBuilder};

/// Every shared setting away from its default; `port` keeps two services apart.
fn common(port: u16) -> CommonArgs {
    CommonArgs {
        nats_url: "nats://svc:secret@10.0.0.1:4222,nats://svc:secret@10.0.0.2:4222".into(),
        nats_tls: NatsTlsArgs {
            nats_ca_file: Some("/etc/ctxsync/nats-ca.pem".into()),
            nats_client_cert: Some("/etc/ctxsync/nats.pem".into()),
            nats_client_key: Some("/etc/ctxsync/nats.key".into()),
        },
        nats_responder_url: Some("nats://responder:secret@10.0.0.1:4222".into()),
        reply_inbox_prefixes: ReplyInboxes::parse("_INBOX.svc.,_INBOX.chat-{tenant}.").unwrap(),
        subject_prefix: "roundtrip".into(),
        http_addr: SocketAddr::from(([127, 0, 0, 1], port)),
        log_format: LogFormat::Json,
        log_filter: "debug,async_nats=warn".into(),
        shutdown_grace: Duration::from_millis(2500),
        otlp_endpoint: Some("http://collector:4318".into()),
        http: HttpArgs {
            http_header_timeout: Duration::from_secs(11),
            http_body_timeout: Duration::from_secs(31),
            http_idle_timeout: Duration::from_secs(61),
            http_max_connections: 7,
            tls_cert: Some("/etc/ctxsync/tls.pem".into()),
            tls_key: Some("/etc/ctxsync/tls.key".into()),
        },
    }
}

fn database() -> DatabaseArgs {
    DatabaseArgs {
        database_url: "postgres://store:secret@db:5432/roundtrip".into(),
        db_max_connections: 3,
    }
}

fn store() -> snapshot_store::Config {
    snapshot_store::Config {
        common: common(18081),
        database: database(),
        event_state_max_bytes: 7,
        push_transactions: 3,
    }
}

fn ingest() -> agent_ingest::Config {
    agent_ingest::Config {
        common: common(18080),
        store_timeout: Duration::from_secs(6),
        auth_cache_ttl: Duration::from_millis(31_500),
        metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 19090))),
    }
}

/// Hosts and origins away from their defaults.
fn browsers(hosts: &str, origins: &str) -> ctxsync_runtime::http::browsers::BrowserArgs {
    use ctxsync_runtime::http::browsers::{AllowedHosts, AllowedOrigins, BrowserArgs};
    BrowserArgs {
        http_allowed_hosts: AllowedHosts::parse(hosts).unwrap(),
        http_allowed_origins: AllowedOrigins::parse(origins).unwrap(),
    }
}

fn gate() -> chat_gate::Config {
    chat_gate::Config {
        common: common(18082),
        browsers: browsers(
            "gate.example.com,gate.internal:8082",
            "https://chat.example.com",
        ),
        pending_timeout: Duration::from_secs(16),
        stale_grace: Duration::from_secs(4),
        store_timeout: Duration::from_secs(3),
        attempt_ttl: Duration::from_secs(11 * 60),
        catalog_timeout: Duration::from_secs(13),
        catalog: false,
        max_turns: 7,
        max_views: 8,
        view_ttl: Duration::from_secs(9 * 60),
        sweep_interval: Duration::from_secs(3 * 60),
        max_streams_per_key: 2,
        max_streams_per_tenant: 3,
        max_tickets_per_tenant: 4,
    }
}

/// Every catalog setting away from its default, its memory key from `key_file`.
fn catalog_settings(key_file: &Path) -> catalog::Settings {
    catalog::Settings {
        browsers: browsers(
            "mcp.example.com",
            "https://a.example,https://b.example:8443",
        ),
        discovery_reuse: Duration::from_secs(7),
        connect_timeout: Duration::from_secs(8),
        max_concurrent_starts: 3,
        event_queue: 10,
        event_batch_wait: Duration::from_millis(7),
        session_idle_timeout: Duration::from_secs(9),
        warmup: catalog::WarmupSettings {
            enabled: false,
            connect_timeout: Duration::from_secs(11),
            retry_interval: Duration::from_secs(12),
            attempts: 13,
            fresh: Duration::from_secs(1300),
        },
        mcp_page_size: 14,
        mcp_rate_limit: Some(catalog::RateLimit {
            per_second: 1.5,
            burst: 15,
        }),
        mcp_sessions: catalog::SessionLimits {
            per_key: 16,
            per_tenant: 17,
            idle: Duration::from_secs(18),
        },
        max_server_processes: None,
        max_server_processes_per_tenant: Some(19),
        shared_idle_timeout: Duration::from_secs(20),
        memory: catalog::MemorySettings {
            bucket: Some("roundtrip_memory".into()),
            replicas: 3,
            max_age: Duration::from_secs(3600),
            key: Some(catalog::MemoryKey::from_file(key_file).unwrap()),
            max_entries: 21,
            max_bytes: 8 * 1024 * 1024,
        },
    }
}

/// `T` parsed from `env` as its binary parses its own: each variable is the
/// value of the flag that names it (clap gives a variable's value and a
/// flag's the same parser and action), and no variable of this process
/// is read.
fn parse<T: clap::Args + FromArgMatches>(env: &[(String, String)], required: &[&str]) -> T {
    let command = T::augment_args(Command::new("service")).mut_args(|a| a.env(None::<&str>));
    let defined = T::augment_args(Command::new("service"));
    let mut argv: Vec<String> = vec!["service".into()];
    argv.extend(required.iter().map(|a| (*a).to_owned()));
    for (name, value) in env {
        let flag = defined
            .get_arguments()
            .find(|flag| flag.get_env() == Some(OsStr::new(name)))
            .unwrap_or_else(|| panic!("{name} is read by no flag of the service"));
        assert!(
            matches!(flag.get_action(), ArgAction::Set),
            "{name}: a flag that takes its value"
        );
        argv.push(format!("--{}={value}", flag.get_long().unwrap()));
    }
    let matches = command
        .try_get_matches_from(argv)
        .unwrap_or_else(|e| panic!("the service refuses its env: {e}"));
    T::from_arg_matches(&matches).unwrap()
}

/// Every field of `config` is away from the service's default: the test
/// leaves no setting untried (a new flag must be added to its fixture).
fn every_setting_changed<T: clap::Args + FromArgMatches + serde::Serialize>(
    config: &T,
    required: &[&str],
) {
    let fields = |value: serde_json::Value| match value {
        serde_json::Value::Object(fields) => fields,
        other => panic!("not a struct: {other}"),
    };
    let given = fields(serde_json::to_value(config).unwrap());
    let default = fields(serde_json::to_value(defaults_with::<T>(required)).unwrap());
    assert_eq!(given.len(), default.len());
    for (id, value) in &given {
        assert_ne!(Some(value), default.get(id), "{id} is at its default");
    }
}

fn binaries_of(builder: &StackBuilder) -> Vec<Binary> {
    let binaries = builder.binaries().unwrap();
    assert_eq!(
        binaries.iter().map(|b| b.service).collect::<Vec<_>>(),
        [
            Service::Store,
            Service::Ingest,
            Service::Gate,
            Service::Catalog
        ]
    );
    binaries
}

#[test]
fn every_setting_of_every_service_reaches_its_binary() {
    let dir = tempfile::tempdir().unwrap();
    let servers: PathBuf = dir.path().join("catalog.yaml");
    std::fs::write(&servers, "tenants: []\n").unwrap();
    let key_file = dir.path().join("memory.key");
    std::fs::write(&key_file, "k".repeat(48)).unwrap();
    let servers_arg = servers.display().to_string();
    let key_arg = key_file.display().to_string();
    let ca_arg = "/etc/ctxsync/mcp-ca.pem";
    let settings = catalog_settings(&key_file);

    let builder = StackBuilder::new("nats://127.0.0.1:4222", "ignored")
        .database("postgres://127.0.0.1/ignored")
        .store(|c| *c = store())
        .ingest(|c| *c = ingest())
        .gate(|c| *c = gate())
        .catalog(
            catalog::CatalogConfig { tenants: vec![] },
            settings.clone(),
            |c| {
                c.common = common(18083);
                c.database = database();
            },
        )
        .binary_env(Service::Catalog, "CTXSYNC_CATALOG_CONFIG", &servers_arg)
        .binary_env(
            Service::Catalog,
            "CTXSYNC_CATALOG_MEMORY_KEY_FILE",
            &key_arg,
        )
        .binary_env(Service::Catalog, "CTXSYNC_MCP_CA_FILE", ca_arg);
    let binaries = binaries_of(&builder);

    every_setting_changed(&store(), &[]);
    assert_eq!(
        parse::<snapshot_store::Config>(&binaries[0].env, &[]),
        store()
    );
    every_setting_changed(&ingest(), &[]);
    assert_eq!(
        parse::<agent_ingest::Config>(&binaries[1].env, &[]),
        ingest()
    );
    every_setting_changed(&gate(), &[]);
    assert_eq!(parse::<chat_gate::Config>(&binaries[2].env, &[]), gate());

    // The catalog's flags are its settings' (whole seconds, a rate of 0 for
    // no limit); parsed, they give the settings back.
    let parsed = parse::<catalog::Args>(&binaries[3].env, &[]);
    let expected = catalog::Args {
        common: common(18083),
        database: database(),
        catalog: catalog::CatalogArgs::of(servers.clone(), Some(key_file.clone()), &settings)
            .unwrap(),
        mcp_ca_file: Some(ca_arg.into()),
    };
    every_setting_changed(&expected, &["--config", "catalog.yaml"]);
    assert_eq!(parsed, expected);
    let reached = parsed.catalog.settings().unwrap();
    assert_eq!(
        catalog::CatalogArgs::of(servers, Some(key_file), &reached).unwrap(),
        expected.catalog
    );
    assert!(reached.memory.key.is_some_and(|key| !key.is_random()));

    for binary in &binaries {
        assert_eq!(
            binary.http_addr.to_string(),
            binary
                .env
                .iter()
                .find(|(n, _)| n == "CTXSYNC_HTTP_ADDR")
                .unwrap()
                .1
        );
    }
}

#[test]
fn a_memory_key_without_its_file_is_refused_not_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("memory.key");
    std::fs::write(&key_file, "k".repeat(48)).unwrap();
    let error = StackBuilder::new("nats://127.0.0.1:4222", "pfx")
        .database("postgres://127.0.0.1/x")
        .catalog(
            catalog::CatalogConfig { tenants: vec![] },
            catalog_settings(&key_file),
            |_| {},
        )
        .binary_env(Service::Catalog, "CTXSYNC_CATALOG_CONFIG", "/etc/c.yaml")
        .binaries()
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("CTXSYNC_CATALOG_MEMORY_KEY_FILE"),
        "{error}"
    );
}
