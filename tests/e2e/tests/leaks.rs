//! No secret leaks (issue 12): a distinct marker is planted in every place a
//! secret can be configured, MCP servers fail in every way that echoes them,
//! and every place a secret could end up is searched for every marker:
//! a `pg_dump` of the database, every NATS message published during the run,
//! every process's output (text and JSON logs at debug), every HTTP answer,
//! `--help` of every binary and `ctxsync agent show` (text and JSON).
//!
//! Each scenario runs the real binaries against a nats-server with users and
//! passwords and a Postgres role with a password. Zero markers may be found;
//! a failure lists every marker and where it was found.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use sqlx::{Connection, Executor, PgConnection};
use testkit::{NatsServer, ProcessBuilder, TestDatabase, workspace_binary};

const DEADLINE: Duration = Duration::from_secs(60);

fn addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], testkit::free_port()))
}

/// One planted secret: where it was put, and the marker (letters and digits
/// only, so no escaping — JSON, URL, Debug — changes how it reads).
struct Marker {
    place: &'static str,
    value: String,
}

/// Every secret planted in a run, each with its own marker.
struct Markers {
    run: String,
    list: Vec<Marker>,
}

impl Markers {
    fn new() -> Self {
        Self {
            run: uuid::Uuid::new_v4().simple().to_string()[..10].to_owned(),
            list: Vec::new(),
        }
    }

    /// A new marker for `place`, e.g. `LEAK3mcpenv7f3a9c01d2`.
    fn plant(&mut self, place: &'static str) -> String {
        let value = format!("LEAK{}x{}", self.list.len(), self.run);
        self.list.push(Marker {
            place,
            value: value.clone(),
        });
        value
    }

    /// A secret this run did not choose (the agent token): searched as well.
    fn found(&mut self, place: &'static str, value: String) {
        self.list.push(Marker { place, value });
    }
}

/// Every text searched, named by where it came from.
#[derive(Default)]
struct Haystack {
    texts: Vec<(String, String)>,
}

impl Haystack {
    fn add(&mut self, source: impl Into<String>, text: impl Into<String>) {
        self.texts.push((source.into(), text.into()));
    }

    fn add_output(&mut self, source: impl Into<String>, output: &Output) {
        let source = source.into();
        self.add(
            format!("{source} (stdout)"),
            String::from_utf8_lossy(&output.stdout),
        );
        self.add(
            format!("{source} (stderr)"),
            String::from_utf8_lossy(&output.stderr),
        );
    }

    /// Panics listing every marker found and where, with the line around it.
    fn assert_no_marker(&self, markers: &Markers) {
        let mut found = Vec::new();
        for marker in &markers.list {
            for (source, text) in &self.texts {
                if let Some(at) = text.find(&marker.value) {
                    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
                    let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
                    let line: String = text[start..end].chars().take(400).collect();
                    found.push(format!(
                        "{} ({}) found in {source}: {line}",
                        marker.place, marker.value
                    ));
                }
            }
        }
        assert!(
            found.is_empty(),
            "{} secret(s) leaked:\n{}",
            found.len(),
            found.join("\n")
        );
        // Not vacuous: every source was read and holds something.
        assert!(self.texts.len() > 20, "{} sources", self.texts.len());
    }
}

fn pg_dump() -> PathBuf {
    if let Some(dir) = std::env::var_os(testkit::POSTGRES_BIN_DIR_ENV) {
        return PathBuf::from(dir).join("pg_dump");
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|version| version.path().join("bin/pg_dump"))
        .filter(|path| path.exists())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| PathBuf::from("pg_dump"))
}

fn run(mut command: Command, what: &str) -> Output {
    command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"))
}

/// `postgres://user:password@host:port/db` from the superuser URL of `db`.
fn url_as(db: &TestDatabase, user: &str, password: &str) -> String {
    let url = db.url();
    let rest = &url[url.find("://").unwrap() + 3..];
    let host = &rest[rest.find('@').map_or(0, |i| i + 1)..];
    format!("postgres://{user}:{password}@{host}")
}

async fn admin(db: &TestDatabase) -> PgConnection {
    PgConnection::connect(db.url())
        .await
        .expect("superuser connection")
}

async fn execute(connection: &mut PgConnection, sql: String) {
    connection
        .execute(sqlx::AssertSqlSafe(sql.clone()))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Collects every message published on the server (subject, headers and
/// payload) through a user of its own, until [`Spy::collected`].
struct Spy {
    client: async_nats::Client,
    seen: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
    end_subject: String,
}

impl Spy {
    async fn start(port: u16, password: String) -> Spy {
        let client = async_nats::ConnectOptions::new()
            .user_and_password("spy".to_owned(), password)
            .connect(format!("nats://127.0.0.1:{port}"))
            .await
            .expect("spy connects");
        let mut all = testkit::subscribe(&client, ">".to_owned()).await;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let end_subject = format!("leaks.end.{}", uuid::Uuid::new_v4().simple());
        let end = end_subject.clone();
        let task = tokio::spawn(async move {
            while let Some(message) = all.next().await {
                if message.subject.as_str() == end {
                    return;
                }
                let mut seen = sink.lock().unwrap();
                seen.extend_from_slice(message.subject.as_bytes());
                seen.push(b'\n');
                if let Some(headers) = &message.headers {
                    for (name, values) in headers.iter() {
                        for value in values {
                            seen.extend_from_slice(format!("{name}: {value}\n").as_bytes());
                        }
                    }
                }
                seen.extend_from_slice(&message.payload);
                seen.push(b'\n');
            }
        });
        Spy {
            client,
            seen,
            task,
            end_subject,
        }
    }

    /// Everything published before this call: the end marker the spy sends
    /// itself arrives after every message the server took before it.
    async fn collected(self) -> (String, usize) {
        self.client
            .publish(self.end_subject.clone(), "end".into())
            .await
            .unwrap();
        self.client.flush().await.unwrap();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the spy sees its end marker")
            .unwrap();
        let seen = self.seen.lock().unwrap();
        let messages = seen.iter().filter(|&&b| b == b'\n').count();
        (String::from_utf8_lossy(&seen).into_owned(), messages)
    }
}

fn fixture_entry(args: &[&str], env: &[(&str, &str)]) -> Value {
    let spec = mcp_fixture::fixture_spec("x", args, env);
    let ctxsync_mcp::TransportSpec::Stdio {
        command, args, env, ..
    } = &spec.transport
    else {
        panic!("a stdio server");
    };
    json!({ "command": command, "args": args, "env": env })
}

/// Every way of passing a secret argument to a stdio server.
fn secret_args(markers: &mut Markers) -> Vec<String> {
    vec![
        "--".to_owned(),
        format!("--token={}", markers.plant("arg --token=M")),
        "--token".to_owned(),
        markers.plant("arg --token M"),
        format!("-p{}", markers.plant("arg -pM")),
        "-p".to_owned(),
        markers.plant("arg -p M"),
        format!("-k={}", markers.plant("arg -k=M")),
    ]
}

/// The whole stack at `CTXSYNC_LOG=debug` in `format`, with secrets planted
/// everywhere; returns nothing: it asserts.
async fn scenario(format: &str) {
    testkit::init_logs();
    let mut markers = Markers::new();
    let mut haystack = Haystack::default();

    // --- NATS: services connect as `svc` with a password; the spy has its own user.
    let nats_password = markers.plant("NATS password (NATS_URL)");
    let spy_password = format!("spy{}", markers.run);
    let nats = NatsServer::start_with_config(&format!(
        "authorization {{\n  users = [\n    {{ user: svc, password: \"{nats_password}\" }}\n    {{ user: spy, password: \"{spy_password}\" }}\n  ]\n}}\n"
    ));
    let nats_url = format!("nats://svc:{nats_password}@127.0.0.1:{}", nats.port());
    let spy = Spy::start(nats.port(), spy_password).await;

    // --- Postgres: the services' role has a password.
    let db = TestDatabase::create().await;
    let pg_password = markers.plant("Postgres password (DATABASE_URL)");
    let role = format!("leak_{}", markers.run);
    let ro_role = format!("leak_ro_{}", markers.run);
    let ro_password = markers.plant("Postgres password of a role refused by the server");
    {
        let mut admin = admin(&db).await;
        execute(
            &mut admin,
            format!("CREATE ROLE {role} LOGIN PASSWORD '{pg_password}'"),
        )
        .await;
        execute(
            &mut admin,
            format!("CREATE ROLE {ro_role} LOGIN PASSWORD '{ro_password}'"),
        )
        .await;
        execute(
            &mut admin,
            format!("GRANT ALL ON DATABASE \"{}\" TO {role}", db.name()),
        )
        .await;
        execute(&mut admin, format!("GRANT ALL ON SCHEMA public TO {role}")).await;
        let _ = admin.close().await;
    }
    let database_url = url_as(&db, &role, &pg_password);

    // --- Hostile MCP servers for the workspace and the catalog.
    let http_header = markers.plant("HTTP header in .mcp.json");
    let header_fixture =
        mcp_fixture::HttpFixture::start(&["--mode", "secret-error", &http_header]).await;
    let closed_port = testkit::free_port();
    let url_password = markers.plant("URL userinfo in .mcp.json");
    let url_query = markers.plant("URL query in .mcp.json");
    let url_path = markers.plant("URL path in .mcp.json");
    let https_password = markers.plant("https URL userinfo in .mcp.json");
    let mcp_env = markers.plant("MCP server env in .mcp.json");
    let edge = markers.plant("MCP server env cut by the old 4 KiB stderr tail");
    let handshake_env = markers.plant("MCP server env echoed in a handshake error");
    let list_env = markers.plant("MCP server env echoed in a tools/list error");
    let inherited = markers.plant("inherited env of workspace-agent (harmless name)");

    let mut crash_args = vec!["--mode", "echo-env-crash", "--edge-var", "FIXTURE_EDGE"]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
    crash_args.extend(secret_args(&mut markers));
    let crash_args: Vec<&str> = crash_args.iter().map(String::as_str).collect();
    let mut handshake_args = vec!["--mode".to_owned(), "secret-error".to_owned()];
    handshake_args.extend(secret_args(&mut markers));
    let handshake_args: Vec<&str> = handshake_args.iter().map(String::as_str).collect();

    let mcp_json = json!({ "mcpServers": {
        "echoenv": fixture_entry(&crash_args, &[("FIXTURE_SETTING", &mcp_env), ("FIXTURE_EDGE", &edge)]),
        "handshake": fixture_entry(&handshake_args, &[("FIXTURE_PLAIN", &handshake_env)]),
        "listerror": fixture_entry(&["--mode", "secret-list-error"], &[("FIXTURE_LIST", &list_env)]),
        "header": {"type": "http", "url": header_fixture.url(), "headers": {"Authorization": format!("Bearer {http_header}")}},
        "refused": {"url": format!("http://user:{url_password}@127.0.0.1:{closed_port}/{url_path}/mcp?key={url_query}")},
        "refusedtls": {"url": format!("https://user:{https_password}@127.0.0.1:{closed_port}/mcp")},
        "fine": fixture_entry(&["--mode", "normal"], &[]),
    }});

    let catalog_env = markers.plant("catalog config env");
    let catalog_header = markers.plant("catalog config header");
    let catalog_url_password = markers.plant("catalog config URL userinfo");
    let catalog_handshake_env = markers.plant("catalog config env echoed in a handshake error");
    let mut catalog_crash_args = vec!["--mode".to_owned(), "echo-env-crash".to_owned()];
    catalog_crash_args.extend(secret_args(&mut markers));
    let fixture_bin = mcp_fixture::fixture_binary();
    let catalog_config = json!({ "tenants": [{ "id": "acme", "servers": [
        { "id": "echoenv", "transport": { "stdio": {
            "command": fixture_bin, "args": catalog_crash_args,
            "env": { "FIXTURE_CATALOG": catalog_env } } } },
        { "id": "handshake", "transport": { "stdio": {
            "command": fixture_bin, "args": ["--mode", "secret-error"],
            "env": { "FIXTURE_CATALOG_HS": catalog_handshake_env } } } },
        { "id": "header", "transport": { "streamable_http": {
            "url": format!("http://user:{catalog_url_password}@127.0.0.1:{closed_port}/mcp"),
            "headers": { "Authorization": format!("Bearer {catalog_header}") } } } },
        { "id": "fine", "transport": { "stdio": {
            "command": fixture_bin, "args": ["--mode", "normal"] } } },
    ]}]});

    let workdir = tempfile::tempdir().unwrap();
    std::fs::write(
        workdir.path().join("AGENTS.md"),
        "Instructions for the leak test.\n",
    )
    .unwrap();
    std::fs::write(
        workdir.path().join(".mcp.json"),
        serde_json::to_vec_pretty(&mcp_json).unwrap(),
    )
    .unwrap();
    let catalog_file = workdir.path().join("catalog.yaml");
    // JSON is YAML.
    std::fs::write(&catalog_file, catalog_config.to_string()).unwrap();

    // --- The services, at debug, in `format`.
    let prefix = testkit::unique_prefix();
    let (store_addr, ingest_addr, gate_addr, catalog_addr, agent_addr) =
        (addr(), addr(), addr(), addr(), addr());
    let service = |package: &str, bin: &str, http_addr: SocketAddr| {
        ProcessBuilder::binary(package, bin)
            .env("NATS_URL", &nats_url)
            .env("CTXSYNC_SUBJECT_PREFIX", &prefix)
            .env("CTXSYNC_HTTP_ADDR", http_addr.to_string())
            .env("CTXSYNC_LOG", "debug")
            .env("CTXSYNC_LOG_FORMAT", format)
    };
    let mut store = service("snapshot-store", "snapshot-store", store_addr)
        .env("DATABASE_URL", &database_url)
        .spawn();
    let mut ingest = service("agent-ingest", "agent-ingest", ingest_addr).spawn();
    let mut gate = service("chat-gate", "chat-gate", gate_addr)
        .env("CTXSYNC_GATE_PENDING_TIMEOUT", "60s")
        .spawn();
    let mut catalog = service("catalog", "catalog", catalog_addr)
        .env("DATABASE_URL", &database_url)
        .env("CTXSYNC_CATALOG_CONFIG", catalog_file.display().to_string())
        .env("CTXSYNC_CATALOG_CONNECT_TIMEOUT_SECONDS", "20")
        .spawn();
    for process in [&mut store, &mut ingest, &mut gate, &mut catalog] {
        process.wait_ready(DEADLINE).await;
    }

    let ctxsync = |args: &[&str]| {
        let mut command = Command::new(workspace_binary("ctxsync-cli", "ctxsync"));
        command
            .args(args)
            .env("NATS_URL", &nats_url)
            .env("DATABASE_URL", &database_url)
            .env("CTXSYNC_SUBJECT_PREFIX", &prefix);
        command
    };
    let registered = run(
        ctxsync(&[
            "agent",
            "register",
            "--tenant",
            "acme",
            "--workspace",
            "w",
            "--name",
            "leaky",
            "--json",
        ]),
        "ctxsync agent register",
    );
    assert!(
        registered.status.success(),
        "{}",
        String::from_utf8_lossy(&registered.stderr)
    );
    // The token is shown once, here, by design: this output is not searched.
    let registered: Value = serde_json::from_slice(&registered.stdout).unwrap();
    let agent_id = registered["agent_id"].as_str().unwrap().to_owned();
    let token = registered["token"].as_str().unwrap().to_owned();
    markers.found("agent token", token.clone());
    // The chat backend's tenant key, shown once, here (not searched); it
    // then travels in every gate request's Authorization header.
    let created = run(
        ctxsync(&["tenant", "key", "create", "--tenant", "acme", "--json"]),
        "ctxsync tenant key create",
    );
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let created: Value = serde_json::from_slice(&created.stdout).unwrap();
    let tenant_key = created["key"].as_str().unwrap().to_owned();
    markers.found("tenant key", tenant_key.clone());
    let home = tempfile::tempdir().unwrap();
    let token_file = home.path().join("token");
    std::fs::write(&token_file, &token).unwrap();

    // Discovery's completion, seen as the gate sees it.
    let watcher = async_nats::ConnectOptions::new()
        .user_and_password("svc".to_owned(), nats_password.clone())
        .connect(format!("nats://127.0.0.1:{}", nats.port()))
        .await
        .expect("watcher connects");
    let subjects = ctxsync_proto::subjects::Subjects::new(&prefix).unwrap();
    let mut events = testkit::subscribe(&watcher, subjects.discovery_changed(&agent_id)).await;

    // --- The agent: every server of its workspace fails but one.
    let mut agent = ProcessBuilder::binary("workspace-agent", "workspace-agent")
        .env("CTXSYNC_INGEST_URL", format!("http://{ingest_addr}"))
        .env("CTXSYNC_AGENT_TOKEN_FILE", token_file.display().to_string())
        .env("CTXSYNC_WORKDIR", workdir.path().display().to_string())
        .env("CTXSYNC_HTTP_ADDR", agent_addr.to_string())
        .env("CTXSYNC_MCP_HANDSHAKE_TIMEOUT", "20s")
        .env("CTXSYNC_NO_WATCH", "true")
        .env("CTXSYNC_LOG", "debug")
        .env("CTXSYNC_LOG_FORMAT", format)
        .env("HOME", home.path().display().to_string())
        .env("BUILD_LABEL", &inherited)
        .spawn();

    loop {
        let message = tokio::time::timeout(DEADLINE, events.next())
            .await
            .expect("discovery completes within the deadline")
            .expect("subscription open");
        let event =
            <ctxsync_proto::v1::DiscoveryChanged as prost::Message>::decode(message.payload)
                .unwrap();
        if event.phase() == ctxsync_proto::v1::mcp_discovery::Phase::Complete {
            break;
        }
    }

    // --- A first turn naming the tenant: the workspace's failures and the
    //     catalog's preparation (every server discovered live).
    let http = reqwest::Client::new();
    let turn = http
        .post(format!("http://{gate_addr}/api/v1/gate"))
        .bearer_auth(&tenant_key)
        .json(&json!({ "chat_id": "chat-1", "agent_id": agent_id, "first_turn": true }))
        .timeout(DEADLINE)
        .send()
        .await
        .expect("gate answers");
    let status = turn.status();
    let answer = turn.text().await.unwrap();
    assert!(status.is_success(), "{status}: {answer}");
    let parsed: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(parsed["decision"], "GATE_DECISION_READY", "{answer}");
    haystack.add("gate HTTP answer (first turn)", &answer);
    // The failures are there, sanitized: the test is not vacuous.
    assert!(answer.contains("[redacted]"), "{answer}");
    for server in ["echoenv", "handshake", "listerror", "header", "refused"] {
        assert!(answer.contains(server), "{server} missing: {answer}");
    }

    let context = http
        .get(format!(
            "http://{gate_addr}/api/v1/agents/{agent_id}/context"
        ))
        .bearer_auth(&tenant_key)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    haystack.add("gate HTTP answer (context)", context);
    for (name, at) in [
        ("snapshot-store", store_addr),
        ("agent-ingest", ingest_addr),
        ("chat-gate", gate_addr),
        ("catalog", catalog_addr),
        ("workspace-agent", agent_addr),
    ] {
        for path in ["metrics", "readyz", "healthz"] {
            if let Ok(response) = http.get(format!("http://{at}/{path}")).send().await {
                haystack.add(
                    format!("{name} /{path}"),
                    response.text().await.unwrap_or_default(),
                );
            }
        }
    }

    // --- Operator views.
    for args in [
        vec!["agent", "show", agent_id.as_str()],
        vec!["agent", "show", agent_id.as_str(), "--json"],
    ] {
        let output = run(ctxsync(&args), "ctxsync agent show");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("[redacted]"),
            "the report with its errors"
        );
        haystack.add_output(format!("ctxsync {}", args.join(" ")), &output);
    }
    let inspect = run(
        {
            let mut command = Command::new(workspace_binary("workspace-agent", "workspace-agent"));
            command
                .args(["inspect", "--json"])
                .env("CTXSYNC_WORKDIR", workdir.path())
                .env("CTXSYNC_MCP_HANDSHAKE_TIMEOUT", "20s")
                .env("HOME", home.path())
                .env("BUILD_LABEL", &inherited);
            command
        },
        "workspace-agent inspect",
    );
    haystack.add_output("workspace-agent inspect --json", &inspect);

    // --- Startup errors: a refused NATS password, a non-Postgres URL, a
    //     Postgres refusal (and none of the server's internals).
    let wrong_nats = markers.plant("wrong NATS password");
    let refused_nats = run(
        {
            let mut command = Command::new(workspace_binary("chat-gate", "chat-gate"));
            command
                .env(
                    "NATS_URL",
                    format!("nats://svc:{wrong_nats}@127.0.0.1:{}", nats.port()),
                )
                .env("CTXSYNC_HTTP_ADDR", addr().to_string())
                .env("CTXSYNC_LOG", "debug")
                .env("CTXSYNC_LOG_FORMAT", format);
            command
        },
        "chat-gate with a wrong NATS password",
    );
    assert!(!refused_nats.status.success());
    let stderr = String::from_utf8_lossy(&refused_nats.stderr);
    assert!(stderr.contains("NATS_URL"), "{stderr}");
    haystack.add_output("chat-gate with a wrong NATS password", &refused_nats);

    let mysql_password = markers.plant("password in a mysql:// DATABASE_URL");
    let mut mysql = ctxsync(&["migrate"]);
    mysql.env(
        "DATABASE_URL",
        format!("mysql://root:{mysql_password}@127.0.0.1:{closed_port}/app"),
    );
    let mysql = run(mysql, "ctxsync migrate with a mysql URL");
    assert!(!mysql.status.success());
    let stderr = String::from_utf8_lossy(&mysql.stderr);
    assert!(
        stderr.contains("invalid DATABASE_URL") && stderr.contains("not mysql://"),
        "{stderr}"
    );
    haystack.add_output("ctxsync migrate (mysql URL)", &mysql);

    let mut refused_pg = ctxsync(&["migrate"]);
    refused_pg.env("DATABASE_URL", url_as(&db, &ro_role, &ro_password));
    let refused_pg = run(refused_pg, "ctxsync migrate without the right to");
    assert!(!refused_pg.status.success());
    let stderr = String::from_utf8_lossy(&refused_pg.stderr);
    assert!(stderr.contains("SQLSTATE"), "{stderr}");
    assert!(!stderr.contains(" at line "), "server internals: {stderr}");
    haystack.add_output("ctxsync migrate (refused by Postgres)", &refused_pg);

    // --- --help of every binary, its env holding this run's secrets.
    let help_env = [
        ("NATS_URL", nats_url.clone()),
        ("DATABASE_URL", database_url.clone()),
        ("CTXSYNC_INGEST_URL", format!("http://u:{nats_password}@h")),
        ("CTXSYNC_AGENT_TOKEN_FILE", token.clone()),
        ("CTXSYNC_CATALOG_CONFIG", catalog_env.clone()),
    ];
    let mut helps_with_env = 0;
    for (package, bin, args) in [
        ("snapshot-store", "snapshot-store", vec![]),
        ("agent-ingest", "agent-ingest", vec![]),
        ("chat-gate", "chat-gate", vec![]),
        ("catalog", "catalog", vec![]),
        ("workspace-agent", "workspace-agent", vec![]),
        ("workspace-agent", "workspace-agent", vec!["inspect"]),
        ("ctxsync-cli", "ctxsync", vec![]),
        ("ctxsync-cli", "ctxsync", vec!["up"]),
        ("ctxsync-bench", "ctxsync-bench", vec![]),
        ("ctxsync-cli", "ctxsync", vec!["migrate"]),
        ("ctxsync-cli", "ctxsync", vec!["latency"]),
        ("ctxsync-cli", "ctxsync", vec!["agent", "register"]),
        ("ctxsync-cli", "ctxsync", vec!["agent", "show"]),
    ] {
        let mut command = Command::new(workspace_binary(package, bin));
        command
            .args(&args)
            .arg("--help")
            .envs(help_env.iter().map(|(k, v)| (k, v)));
        let output = run(command, "--help");
        let name = format!("{bin} {} --help", args.join(" "));
        assert!(output.status.success(), "{name}");
        // Not every level has env vars (`ctxsync`, `ctxsync agent register`).
        if String::from_utf8_lossy(&output.stdout).contains("[env: ") {
            helps_with_env += 1;
        }
        haystack.add_output(name, &output);
    }
    assert!(helps_with_env >= 10, "{helps_with_env} helps name env vars");

    // --- Stop everything, then read what stayed behind.
    for process in [&mut agent, &mut gate, &mut ingest, &mut catalog, &mut store] {
        let status = process.terminate(Duration::from_secs(20)).await;
        assert!(status.success(), "{} exited with {status}", process.name());
    }
    let (published, messages) = spy.collected().await;
    assert!(messages > 10, "{messages} messages seen");
    haystack.add("NATS messages", published);
    for process in [&agent, &gate, &ingest, &catalog, &store] {
        let log = process.log();
        assert!(
            log.contains("DEBUG") || log.contains("\"level\":\"DEBUG\""),
            "{} logs at debug",
            process.name()
        );
        haystack.add(format!("{} output", process.name()), log);
    }
    header_fixture.stop().await;

    let dump = run(
        {
            let mut command = Command::new(pg_dump());
            command.arg("--dbname").arg(db.url());
            command
        },
        "pg_dump",
    );
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let dump_text = String::from_utf8_lossy(&dump.stdout).into_owned();
    assert!(
        dump_text.contains("[redacted]"),
        "the dump holds the sanitized errors"
    );
    haystack.add("pg_dump", dump_text);

    haystack.assert_no_marker(&markers);

    let mut admin = admin(&db).await;
    for role in [&role, &ro_role] {
        execute(
            &mut admin,
            format!("REASSIGN OWNED BY {role} TO CURRENT_USER"),
        )
        .await;
        execute(&mut admin, format!("DROP OWNED BY {role}")).await;
        execute(&mut admin, format!("DROP ROLE {role}")).await;
    }
    let _ = admin.close().await;
    drop(workdir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_planted_secret_leaks_with_text_logs_at_debug() {
    scenario("text").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_planted_secret_leaks_with_json_logs_at_debug() {
    scenario("json").await;
}
