//! deploy/k8s/nats/nats.conf (used by compose and Kubernetes): it parses, its
//! per-service permissions are exactly what the code's subjects need, and a
//! real nats-server running it enforces them.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use ctxsync_proto::subjects::{CATALOG_QUEUE_GROUP, GATE_QUEUE_GROUP, STORE_QUEUE_GROUP, Subjects};
use deploy_checks::{deploy_dir, nats_conf, run, subject_matches, tool};
use futures::{FutureExt as _, StreamExt as _};
use tokio::sync::mpsc;

const DEADLINE: Duration = Duration::from_secs(10);

fn config_path() -> std::path::PathBuf {
    deploy_dir().join("k8s/nats/nats.conf")
}

/// `(user, password variable)` for every user of the config.
fn users() -> Vec<(String, String, serde_json::Value)> {
    let text = std::fs::read_to_string(config_path()).expect("nats.conf");
    let config = nats_conf::parse(&text).expect("nats.conf in the supported format");
    config["authorization"]["users"]
        .as_array()
        .expect("authorization.users")
        .iter()
        .map(|u| {
            (
                u["user"].as_str().expect("user").to_owned(),
                u["password"].as_str().expect("password").to_owned(),
                u["permissions"].clone(),
            )
        })
        .collect()
}

fn list(value: &serde_json::Value) -> BTreeSet<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().expect("subject").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// What each user must be able to do, from the subject names the code uses.
struct Needs {
    publish: Vec<String>,
    subscribe: Vec<String>,
}

fn inbox(user: &str) -> String {
    format!("_INBOX.{user}.>")
}

/// The users that connect through `ctxsync_runtime::nats::connect`: besides
/// receiving replies on their inbox, they publish into it to confirm their
/// subscriptions with a round trip (`flush()` is none).
const RUNTIME_CLIENTS: [&str; 7] = [
    "snapshot-store",
    "agent-ingest",
    "chat-gate",
    "chat-gate-rpc",
    "catalog",
    "catalog-rpc",
    "ctxsync-cli",
];

/// The users that answer requests: they may publish into any inbox (that
/// is where answers go) and, unlike `allow_responses`, nowhere a request
/// could name besides.
const ANSWERING_USERS: [&str; 3] = ["snapshot-store", "chat-gate-rpc", "catalog-rpc"];

/// What the catalog's key-value buckets (its shared memory, warm-up
/// claims and restorable MCP sessions) publish through async-nats: the
/// JetStream API of their streams, flow control of its watch, and the
/// buckets' own subjects.
fn catalog_bucket_subjects(s: &Subjects) -> Vec<String> {
    let memory = catalog::settings::memory_bucket_name(s.prefix());
    let claims = format!("{memory}_claims");
    let sessions = catalog::settings::mcp_sessions_bucket_name(&memory);
    let mut subjects = Vec::new();
    for bucket in [&memory, &claims, &sessions] {
        subjects.push(format!("$JS.API.STREAM.INFO.KV_{bucket}"));
        subjects.push(format!("$JS.API.STREAM.CREATE.KV_{bucket}"));
        subjects.push(format!("$KV.{bucket}.0123abcd"));
    }
    subjects.extend([
        // The watch: an ordered consumer, recreated (and the old one
        // deleted) after a gap; a named create on newer servers.
        format!("$JS.API.CONSUMER.CREATE.KV_{memory}"),
        format!("$JS.API.CONSUMER.CREATE.KV_{memory}.w.$KV.{memory}.>"),
        format!("$JS.API.CONSUMER.DELETE.KV_{memory}.w"),
        format!("$JS.FC.KV_{memory}.w.1.2.3"),
        // A claim held reads the entry from the stream's leader (the watch
        // may lag the put of the replica that released the claim).
        format!("$JS.API.STREAM.MSG.GET.KV_{memory}"),
        // A refused claim reads who holds it.
        format!("$JS.API.DIRECT.GET.KV_{claims}.$KV.{claims}.0123abcd"),
        // A replica restoring a session reads it.
        format!("$JS.API.DIRECT.GET.KV_{sessions}.$KV.{sessions}.0123abcd"),
    ]);
    subjects
}

fn needs(s: &Subjects) -> BTreeMap<&'static str, Needs> {
    let mut needs = BTreeMap::from([
        (
            "snapshot-store",
            Needs {
                publish: vec![
                    s.discovery_changed("agent-1"),
                    s.snapshot_committed("agent-1"),
                    s.tenant_key_revoked(),
                    // Its answers, into the asking service's inbox.
                    "_INBOX.agent-ingest.n.1".to_owned(),
                ],
                subscribe: vec![
                    s.store_register_agent(),
                    s.store_authenticate_agent(),
                    s.store_update_startup(),
                    s.store_push(),
                    s.store_get_agent_state(),
                    s.store_tenant_key_create(),
                    s.store_tenant_key_verify(),
                    s.store_all(),
                ],
            },
        ),
        (
            "agent-ingest",
            Needs {
                publish: vec![
                    s.store_authenticate_agent(),
                    s.store_update_startup(),
                    s.store_push(),
                ],
                subscribe: vec![],
            },
        ),
        (
            "chat-gate",
            Needs {
                publish: vec![
                    s.store_get_agent_state(),
                    s.store_list_agents(),
                    s.store_tenant_key_verify(),
                    s.catalog_prepare("demo"),
                    s.catalog_status("demo"),
                    s.gate_turn_waited(),
                ],
                subscribe: vec![],
            },
        ),
        (
            "chat-gate-rpc",
            Needs {
                // Answers to turns, into the asking tenant's inbox.
                publish: vec!["_INBOX.chat-demo.n.1".to_owned()],
                subscribe: vec![
                    s.gate_turn_all(),
                    s.discovery_changed_all(),
                    s.snapshot_committed_all(),
                    s.tenant_key_revoked(),
                ],
            },
        ),
        (
            "catalog",
            Needs {
                publish: [
                    s.catalog_event("mcp.catalog.changed"),
                    s.catalog_events_all(),
                    // The MCP endpoint's tenant keys.
                    s.store_tenant_key_verify(),
                ]
                .into_iter()
                .chain(catalog_bucket_subjects(s))
                .collect(),
                subscribe: vec![s.gate_turn_waited(), s.tenant_key_revoked()],
            },
        ),
        (
            "catalog-rpc",
            Needs {
                // Answers to the gate's and the tenants' requests.
                publish: vec![
                    "_INBOX.chat-gate.demo.n.1".to_owned(),
                    "_INBOX.chat-demo.n.1".to_owned(),
                ],
                subscribe: vec![
                    s.catalog_prepare_all(),
                    s.catalog_call_all(),
                    s.catalog_session_end_all(),
                    s.catalog_status_all(),
                ],
            },
        ),
        (
            "ctxsync-cli",
            Needs {
                publish: vec![
                    s.store_register_agent(),
                    s.store_rotate_agent_token(),
                    s.store_authenticate_agent(),
                    s.store_get_agent_state(),
                    s.store_tenant_key_create(),
                    s.store_tenant_key_list(),
                    s.store_tenant_key_revoke(),
                ],
                subscribe: vec![],
            },
        ),
        (
            "chat-demo",
            Needs {
                publish: vec![
                    s.gate_turn("demo"),
                    s.catalog_prepare("demo"),
                    s.catalog_call("demo"),
                    s.catalog_session_end("demo"),
                ],
                subscribe: vec![inbox("chat-demo")],
            },
        ),
    ]);
    for user in RUNTIME_CLIENTS {
        let need = needs.get_mut(user).unwrap();
        need.publish.push(inbox(user));
        need.subscribe.push(inbox(user));
    }
    needs
}

#[test]
fn config_parses_with_nats_server_and_needs_every_password() {
    let nats_server = tool("nats-server");
    let mut with_passwords = Command::new(&nats_server);
    with_passwords.args(["-t", "-c"]).arg(config_path());
    for (_, variable, _) in users() {
        with_passwords.env(variable.trim_start_matches('$'), "p");
    }
    run(&mut with_passwords);

    // A missing password is a startup error, not an empty password.
    let mut missing = Command::new(&nats_server);
    missing.args(["-t", "-c"]).arg(config_path());
    for (_, variable, _) in users().into_iter().skip(1) {
        missing.env(variable.trim_start_matches('$'), "p");
    }
    let output = missing.output().expect("nats-server runs");
    assert!(
        !output.status.success(),
        "nats-server accepted a config whose password variable is unset"
    );
}

#[test]
fn permissions_are_exactly_what_the_code_needs() {
    let subjects = Subjects::default();
    let needs = needs(&subjects);
    let users = users();
    let names: BTreeSet<&str> = users.iter().map(|(u, _, _)| u.as_str()).collect();
    assert_eq!(
        names,
        needs.keys().copied().collect(),
        "one NATS user per service and client"
    );

    for (user, password, permissions) in &users {
        let need = &needs[user.as_str()];
        let expected_variable = format!("$NATS_PASSWORD_{}", user.to_uppercase().replace('-', "_"));
        assert_eq!(
            password, &expected_variable,
            "{user}: password comes from the environment"
        );
        let publish = list(&permissions["publish"]["allow"]);
        let subscribe = list(&permissions["subscribe"]["allow"]);
        for (what, allowed, needed) in [
            ("publish", &publish, &need.publish),
            ("subscribe", &subscribe, &need.subscribe),
        ] {
            for subject in needed {
                assert!(
                    allowed.iter().any(|p| subject_matches(p, subject)),
                    "{user} cannot {what} {subject}: {allowed:?}"
                );
            }
            // Nothing spare: every allowed pattern serves a subject the code uses.
            for pattern in allowed {
                assert!(
                    needed.iter().any(|s| subject_matches(pattern, s)),
                    "{user} may {what} {pattern}, which no code needs"
                );
            }
        }
        assert!(
            permissions["publish"].get("deny").is_none()
                && permissions["subscribe"].get("deny").is_none(),
            "{user}: allow lists only"
        );
        // allow_responses would let a request aim the user's answer at any
        // subject (a bucket, an event, another tenant's requests).
        assert!(
            permissions.get("allow_responses").is_none(),
            "{user}: allow_responses"
        );
        for pattern in &subscribe {
            if pattern.starts_with("_INBOX") {
                assert_eq!(pattern, &inbox(user), "{user}: only its own inbox prefix");
            }
        }
        for pattern in &publish {
            if ANSWERING_USERS.contains(&user.as_str()) {
                if pattern.starts_with("_INBOX") {
                    assert_eq!(pattern, "_INBOX.>", "{user}: answers go into inboxes");
                }
            } else if pattern.starts_with("_INBOX") {
                assert_eq!(pattern, &inbox(user), "{user}: only its own inbox prefix");
            }
        }
    }

    // The two separations the deployment promises.
    let by_user: BTreeMap<&str, &serde_json::Value> =
        users.iter().map(|(u, _, p)| (u.as_str(), p)).collect();
    let ingest_reads = list(&by_user["agent-ingest"]["subscribe"]["allow"]);
    for chat_traffic in [
        subjects.gate_turn("demo"),
        subjects.discovery_changed("a"),
        subjects.snapshot_committed("a"),
        "_INBOX.chat-demo.x.y".to_owned(),
        "_INBOX.chat-gate.x.y".to_owned(),
    ] {
        assert!(
            !ingest_reads
                .iter()
                .any(|p| subject_matches(p, &chat_traffic)),
            "agent-ingest can read {chat_traffic}"
        );
    }
    // A user that answers tenants' requests can publish nothing a tenant
    // could aim its answer at besides an inbox.
    for answering in ["chat-gate-rpc", "catalog-rpc"] {
        assert_eq!(
            list(&by_user[answering]["publish"]["allow"]),
            BTreeSet::from(["_INBOX.>".to_owned()]),
            "{answering}"
        );
    }
    let gate_writes = list(&by_user["chat-gate"]["publish"]["allow"]);
    for store_write in [
        subjects.store_push(),
        subjects.store_update_startup(),
        subjects.store_register_agent(),
        subjects.store_authenticate_agent(),
    ] {
        assert!(
            !gate_writes.iter().any(|p| subject_matches(p, &store_write)),
            "chat-gate can write {store_write}"
        );
    }
}

#[test]
fn user_names_are_the_nats_client_names_the_services_use() {
    // The inbox prefix `_INBOX.<user>` is the client's name: they must agree.
    let in_code = deploy_checks::nats_client_names_in_code();
    let names: BTreeSet<String> = in_code.iter().map(|(_, name)| name.clone()).collect();
    for service in [
        "snapshot-store",
        "agent-ingest",
        "chat-gate",
        "catalog",
        "ctxsync-cli",
    ] {
        assert!(
            names.contains(service),
            "no service connects to NATS as {service:?}: {in_code:?}"
        );
    }
    let users: BTreeSet<String> = users().into_iter().map(|(u, _, _)| u).collect();
    for name in &names {
        if LOCAL_ONLY_CLIENTS.contains(&name.as_str()) {
            continue;
        }
        assert!(
            users.contains(name),
            "{name} connects to NATS but has no NATS user in nats.conf"
        );
    }
}

/// Clients that never connect to a deployment's NATS: the benchmark runs every
/// service in its own process against a NATS server of its own.
/// `ctxsync up --demo` likewise runs them in one process, connected as `ctxsync-demo`.
const LOCAL_ONLY_CLIENTS: &[&str] = &["ctxsync-bench", "ctxsync-demo"];

/// A nats-server running the deployment's config on free ports.
struct Server {
    child: Child,
    port: u16,
    passwords: BTreeMap<String, String>,
    _store: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    async fn start() -> Server {
        Self::start_with(false).await
    }

    /// The deployment's config as it is (it keeps no JetStream store), or
    /// with JetStream turned on.
    async fn start_with(jetstream: bool) -> Server {
        Self::start_with_tenants(jetstream, &[]).await
    }

    /// The deployment's config plus a chat user for each of `tenants`,
    /// copied from the shipped `chat-demo` user as its comment says to.
    async fn start_with_tenants(jetstream: bool, tenants: &[&str]) -> Server {
        let store = tempfile::tempdir().unwrap();
        let mut text = std::fs::read_to_string(config_path()).unwrap();
        let demo = users()
            .into_iter()
            .find(|(user, _, _)| user == "chat-demo")
            .expect("the shipped chat-demo user");
        let mut extra = Vec::new();
        for tenant in tenants {
            let permissions = demo.2.to_string().replace("demo", tenant);
            let variable = format!("NATS_PASSWORD_CHAT_{}", tenant.to_uppercase());
            extra.push((format!("chat-{tenant}"), variable.clone()));
            let block = format!(
                "    {{\n      user: \"chat-{tenant}\"\n      password: ${variable}\n      permissions: {permissions}\n    }}\n"
            );
            let end = text.rfind("  ]").expect("the users list ends");
            text.insert_str(end, &block);
        }
        let shipped_store = "store_dir: \"/data/jetstream\"";
        assert!(text.contains(shipped_store), "nats.conf turns JetStream on");
        if jetstream {
            // The shipped store is the volume's: here the test's own.
            text = text.replace(
                shipped_store,
                &format!(
                    "store_dir: {:?}",
                    store.path().join("js").display().to_string()
                ),
            );
        } else {
            // As a server deployed without JetStream: the shipped block removed.
            let start = text.find("\njetstream {").expect("the jetstream block");
            let end = start + text[start..].find("\n}\n").expect("the block ends") + 3;
            text.replace_range(start..end, "\n");
        }
        let config = store.path().join("nats.conf");
        std::fs::write(&config, text).unwrap();
        let every: Vec<(String, String)> = users()
            .into_iter()
            .map(|(user, variable, _)| (user, variable))
            .chain(extra)
            .collect();
        // A reserved port can be taken by another test between reservation
        // and bind (the server then exits): retry on others.
        let mut last_exit = None;
        for _ in 0..5 {
            let port = testkit::free_port();
            let monitor = testkit::free_port();
            let mut command = Command::new(tool("nats-server"));
            command
                .arg("-c")
                .arg(&config)
                .args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "-m",
                    &monitor.to_string(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut passwords = BTreeMap::new();
            for (user, variable) in &every {
                let password = format!("pw-{user}-{port}");
                command.env(variable.trim_start_matches('$'), &password);
                passwords.insert(user.clone(), password);
            }
            let child = command.spawn().expect("nats-server starts");
            let mut server = Server {
                child,
                port,
                passwords,
                _store: tempfile::tempdir().unwrap(),
            };
            let ready = async {
                loop {
                    if let Ok(Some(status)) = server.child.try_wait() {
                        return Err(status);
                    }
                    if tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .is_ok()
                    {
                        return Ok(());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            match tokio::time::timeout(DEADLINE, ready)
                .await
                .expect("nats-server listens")
            {
                Ok(()) => {
                    server._store = store;
                    return server;
                }
                Err(status) => last_exit = Some((port, status)),
            }
        }
        panic!("nats-server exited at every start; the last: {last_exit:?}");
    }

    /// Connects as `user` the way the services are configured: credentials of
    /// that user, inbox prefix `_INBOX.<user>`. Server errors go to the receiver.
    async fn connect(&self, user: &str) -> (Client, mpsc::UnboundedReceiver<String>) {
        let (errors_tx, errors) = mpsc::unbounded_channel();
        let client =
            ConnectOptions::with_user_and_password(user.to_owned(), self.passwords[user].clone())
                .custom_inbox_prefix(format!("_INBOX.{user}"))
                .event_callback(move |event| {
                    let errors_tx = errors_tx.clone();
                    async move {
                        if let Event::ServerError(error) = event {
                            let _ = errors_tx.send(error.to_string().to_lowercase());
                        }
                    }
                })
                .connect(format!("nats://127.0.0.1:{}", self.port))
                .await
                .unwrap_or_else(|e| panic!("{user} connects: {e}"));
        (client, errors)
    }

    fn url_for(&self, user: &str) -> String {
        format!(
            "nats://{user}:{}@127.0.0.1:{}",
            self.passwords[user], self.port
        )
    }
}

/// What the deployment sets `CTXSYNC_REPLY_INBOX_PREFIXES` to for the gate and the catalog.
const GATE_REPLY_INBOXES: &str = "_INBOX.chat-{tenant}.";
const CATALOG_REPLY_INBOXES: &str = "_INBOX.chat-{tenant}.,_INBOX.chat-gate.{tenant}.";

/// A service's settings as deployed: its answers on the connection of the
/// `responder` user, into the inboxes `inboxes` lists.
fn answering_as(
    common: &mut ctxsync_runtime::CommonArgs,
    server: &Server,
    responder: &str,
    inboxes: &str,
) {
    common.nats_responder_url = Some(server.url_for(responder));
    common.reply_inbox_prefixes = ctxsync_runtime::rpc::ReplyInboxes::parse(inboxes).unwrap();
}

/// Waits for the server's permissions-violation error naming `subject`.
async fn violation(errors: &mut mpsc::UnboundedReceiver<String>, kind: &str, subject: &str) {
    let wanted = format!("permissions violation for {kind} to \"{subject}\"").to_lowercase();
    let found = tokio::time::timeout(DEADLINE, async {
        while let Some(error) = errors.recv().await {
            if error.contains(&wanted) {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "no `{wanted}` from the server");
}

/// Answers every request on `subscriber` with its own subject, in a task.
fn echo_responder(
    client: Client,
    mut subscriber: async_nats::Subscriber,
) -> mpsc::UnboundedReceiver<String> {
    let (seen_tx, seen) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(message) = subscriber.next().await {
            let _ = seen_tx.send(message.subject.to_string());
            if let Some(reply) = message.reply {
                client
                    .publish(reply, message.subject.to_string().into())
                    .await
                    .unwrap();
                client.flush().await.unwrap();
            }
        }
    });
    seen
}

/// Requests `subject` and returns the answer. `flush()` is no round trip, so a
/// responder's subscription may not have reached the server yet: "no
/// responders" is retried until the deadline.
async fn request(client: &Client, subject: String) -> String {
    let attempt = async {
        loop {
            match client.request(subject.clone(), "ping".into()).await {
                Ok(reply) => return String::from_utf8(reply.payload.to_vec()).unwrap(),
                Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("request {subject}: {e}"),
            }
        }
    };
    tokio::time::timeout(DEADLINE, attempt)
        .await
        .unwrap_or_else(|_| panic!("no reply to {subject} in time"))
}

#[tokio::test]
async fn snapshot_store_serves_agent_ingest_and_its_events_reach_chat_gate() {
    let server = Server::start().await;
    let s = Subjects::default();
    let (store, _) = server.connect("snapshot-store").await;
    let (ingest, _) = server.connect("agent-ingest").await;
    let (gate, _) = server.connect("chat-gate").await;
    let (gate_events, _) = server.connect("chat-gate-rpc").await;

    let store_subscription = store
        .queue_subscribe(s.store_all(), STORE_QUEUE_GROUP.into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&store)
        .await
        .unwrap();
    let _seen = echo_responder(store.clone(), store_subscription);
    let mut discovery = gate_events
        .subscribe(s.discovery_changed_all())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&gate_events)
        .await
        .unwrap();

    for subject in [
        s.store_push(),
        s.store_update_startup(),
        s.store_authenticate_agent(),
    ] {
        assert_eq!(
            request(&ingest, subject.clone()).await,
            subject,
            "agent-ingest's request answered by snapshot-store"
        );
    }
    // chat-gate's own user reads the store.
    assert_eq!(
        request(&gate, s.store_get_agent_state()).await,
        s.store_get_agent_state()
    );
    store
        .publish(s.discovery_changed("agent-1"), "changed".into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&store)
        .await
        .unwrap();
    let event = tokio::time::timeout(DEADLINE, discovery.next())
        .await
        .expect("event in time")
        .unwrap();
    assert_eq!(event.subject.as_str(), s.discovery_changed("agent-1"));
}

#[tokio::test]
async fn agent_ingest_cannot_read_chat_traffic() {
    let server = Server::start().await;
    let s = Subjects::default();
    let (ingest, mut ingest_errors) = server.connect("agent-ingest").await;
    let (gate, _) = server.connect("chat-gate-rpc").await;
    let (chat, _) = server.connect("chat-demo").await;
    let (store, _) = server.connect("snapshot-store").await;

    let mut spies = Vec::new();
    for subject in [
        s.gate_turn_all(),
        s.discovery_changed_all(),
        "_INBOX.>".to_owned(),
    ] {
        spies.push(ingest.subscribe(subject.clone()).await.unwrap());
        violation(&mut ingest_errors, "subscription", &subject).await;
    }

    let turns = gate
        .queue_subscribe(s.gate_turn_all(), GATE_QUEUE_GROUP.into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&gate)
        .await
        .unwrap();
    let _turns_seen = echo_responder(gate.clone(), turns);
    let store_requests = store
        .queue_subscribe(s.store_all(), STORE_QUEUE_GROUP.into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&store)
        .await
        .unwrap();
    let _store_seen = echo_responder(store.clone(), store_requests);

    // Chat traffic flows: a turn and its reply, an event.
    assert_eq!(
        request(&chat, s.gate_turn("demo")).await,
        s.gate_turn("demo")
    );
    store
        .publish(s.discovery_changed("agent-1"), "changed".into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&store)
        .await
        .unwrap();
    // A reply to agent-ingest travels the same server-to-client connection
    // after anything routed to it before: once it is here, nothing else is coming.
    assert_eq!(request(&ingest, s.store_push()).await, s.store_push());
    for spy in &mut spies {
        assert!(
            spy.next().now_or_never().flatten().is_none(),
            "agent-ingest received chat traffic"
        );
    }
}

#[tokio::test]
async fn chat_gate_cannot_write_to_the_store() {
    let server = Server::start().await;
    let s = Subjects::default();
    let (gate, mut gate_errors) = server.connect("chat-gate").await;
    let (store, _) = server.connect("snapshot-store").await;
    let subscription = store
        .queue_subscribe(s.store_all(), STORE_QUEUE_GROUP.into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&store)
        .await
        .unwrap();
    let mut seen = echo_responder(store.clone(), subscription);

    // The store's subscription is in place: a read reaches it.
    assert_eq!(
        request(&gate, s.store_get_agent_state()).await,
        s.store_get_agent_state()
    );
    assert_eq!(seen.recv().await.unwrap(), s.store_get_agent_state());

    for write in [
        s.store_push(),
        s.store_update_startup(),
        s.store_register_agent(),
    ] {
        gate.publish(write.clone(), "forged".into()).await.unwrap();
        ctxsync_runtime::nats::sync_with_server(&gate)
            .await
            .unwrap();
        violation(&mut gate_errors, "publish", &write).await;
    }
    // The server handles one client's messages in order: the read arrives,
    // and the store saw nothing before it.
    assert_eq!(
        request(&gate, s.store_get_agent_state()).await,
        s.store_get_agent_state()
    );
    assert_eq!(
        seen.recv().await.unwrap(),
        s.store_get_agent_state(),
        "the store received a write from chat-gate"
    );
}

#[tokio::test]
async fn answers_go_only_into_inboxes() {
    let server = Server::start_with(true).await;
    let s = Subjects::default();
    let bucket = catalog::settings::memory_bucket_name(s.prefix());
    let aimed = [
        format!("$KV.{bucket}.0123abcd"),
        s.discovery_changed("agent-1"),
        s.snapshot_committed("agent-1"),
        s.tenant_key_revoked(),
        s.gate_turn_waited(),
        s.catalog_prepare("other"),
        s.catalog_call("other"),
        s.gate_turn("other"),
    ];
    // The users that answer tenants' requests may publish nothing of these:
    // whatever reply subject a request names, the server refuses it.
    for user in ["chat-gate-rpc", "catalog-rpc"] {
        let (client, mut errors) = server.connect(user).await;
        for subject in &aimed {
            client
                .publish(subject.clone(), "aimed".into())
                .await
                .unwrap();
            ctxsync_runtime::nats::sync_with_server(&client)
                .await
                .unwrap();
            violation(&mut errors, "publish", subject).await;
        }
    }
    // snapshot-store answers only the services (no tenant may ask it), and
    // still publishes nothing of the bucket or another service's requests.
    let (store, mut store_errors) = server.connect("snapshot-store").await;
    for subject in [&aimed[0], &aimed[4], &aimed[5], &aimed[7]] {
        store
            .publish(subject.clone(), "aimed".into())
            .await
            .unwrap();
        ctxsync_runtime::nats::sync_with_server(&store)
            .await
            .unwrap();
        violation(&mut store_errors, "publish", subject).await;
    }

    // While a request is answered into the asker's inbox.
    let (chat, _) = server.connect("chat-demo").await;
    let (catalog, _) = server.connect("catalog-rpc").await;
    let calls = catalog
        .queue_subscribe(s.catalog_call_all(), CATALOG_QUEUE_GROUP.into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&catalog)
        .await
        .unwrap();
    let _seen = echo_responder(catalog.clone(), calls);
    assert_eq!(
        request(&chat, s.catalog_call("demo")).await,
        s.catalog_call("demo")
    );
}

/// The shipped chat user of tenant `demo`, against the real server: its own
/// tenant's turns and catalog work; every subject of another tenant, the
/// wildcards, the store and other clients' inboxes are refused by the server.
#[tokio::test]
async fn a_chat_user_is_confined_to_its_own_tenant() {
    let server = Server::start().await;
    let s = Subjects::default();
    let (gate, _) = server.connect("chat-gate-rpc").await;
    let (catalog, _) = server.connect("catalog-rpc").await;
    let (chat, mut chat_errors) = server.connect("chat-demo").await;
    let turns = gate
        .queue_subscribe(s.gate_turn_all(), GATE_QUEUE_GROUP.into())
        .await
        .unwrap();
    let mut turns_seen = echo_responder(gate.clone(), turns);
    let prepares = catalog
        .queue_subscribe(s.catalog_prepare_all(), CATALOG_QUEUE_GROUP.into())
        .await
        .unwrap();
    let mut prepares_seen = echo_responder(catalog.clone(), prepares);
    ctxsync_runtime::nats::sync_with_server(&gate)
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&catalog)
        .await
        .unwrap();

    assert_eq!(
        request(&chat, s.gate_turn("demo")).await,
        s.gate_turn("demo")
    );
    assert_eq!(
        request(&chat, s.catalog_prepare("demo")).await,
        s.catalog_prepare("demo")
    );
    assert_eq!(turns_seen.recv().await.unwrap(), s.gate_turn("demo"));
    assert_eq!(
        prepares_seen.recv().await.unwrap(),
        s.catalog_prepare("demo")
    );

    for foreign in [
        s.gate_turn("other"),
        s.catalog_prepare("other"),
        s.catalog_call("other"),
        s.catalog_session_end("other"),
        s.gate_turn_all(),
        s.store_get_agent_state(),
        s.store_tenant_key_verify(),
    ] {
        chat.publish(foreign.clone(), "forged".into())
            .await
            .unwrap();
        // (This user may not publish into its own inbox: no round trip to itself.)
        chat.flush().await.unwrap();
        violation(&mut chat_errors, "publish", &foreign).await;
    }
    for spy in [
        "_INBOX.>".to_owned(),
        "_INBOX.chat-other.>".to_owned(),
        "_INBOX.chat-gate.>".to_owned(),
        s.discovery_changed_all(),
        s.catalog_events_all(),
    ] {
        let _refused = chat.subscribe(spy.clone()).await.unwrap();
        violation(&mut chat_errors, "subscription", &spy).await;
    }
    // Nothing of the refused publishes reached a responder: the next
    // request of this client is the next thing each one saw.
    assert_eq!(
        request(&chat, s.gate_turn("demo")).await,
        s.gate_turn("demo")
    );
    assert_eq!(turns_seen.recv().await.unwrap(), s.gate_turn("demo"));
    assert_eq!(
        request(&chat, s.catalog_prepare("demo")).await,
        s.catalog_prepare("demo")
    );
    assert_eq!(
        prepares_seen.recv().await.unwrap(),
        s.catalog_prepare("demo")
    );
}

#[tokio::test]
async fn each_service_can_round_trip_through_its_own_inbox_only() {
    let server = Server::start().await;
    for user in RUNTIME_CLIENTS {
        let (client, mut errors) = server.connect(user).await;
        let own = client.new_inbox();
        assert!(own.starts_with(&format!("_INBOX.{user}.")), "{own}");
        let mut echo = client.subscribe(own.clone()).await.unwrap();
        client.publish(own.clone(), "sync".into()).await.unwrap();
        let got = tokio::time::timeout(DEADLINE, echo.next()).await;
        assert!(
            matches!(got, Ok(Some(_))),
            "{user}: no round trip through {own}"
        );
        // An answering user may publish into any inbox (its answers), but
        // no bucket; the others only into their own inbox.
        let other = if ANSWERING_USERS.contains(&user) {
            "$KV.ctxsync_catalog_memory.forged"
        } else if user == "agent-ingest" {
            "_INBOX.chat-gate.x.1"
        } else {
            "_INBOX.agent-ingest.x.1"
        };
        client
            .publish(other.to_owned(), "forged".into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        violation(&mut errors, "publish", other).await;
    }
}

/// The services connect through `ctxsync_runtime::nats::connect(NATS_URL, name)`
/// with NATS_URL = `nats://<user>:<password>@nats:4222`, as compose and the
/// Kubernetes base configure them: it must authenticate with the URL's
/// credentials and receive replies on `_INBOX.<name>`.
#[tokio::test]
async fn runtime_connection_works_with_the_deployment_credentials() {
    let server = Server::start().await;
    let s = Subjects::default();
    let (store, _) = server.connect("snapshot-store").await;
    let subscription = store
        .queue_subscribe(s.store_all(), STORE_QUEUE_GROUP.into())
        .await
        .unwrap();
    ctxsync_runtime::nats::sync_with_server(&store)
        .await
        .unwrap();
    let _seen = echo_responder(store.clone(), subscription);

    let connection = ctxsync_runtime::nats::connect(
        &server.url_for("agent-ingest"),
        "agent-ingest",
    )
    .await
    .expect(
        "ctxsync_runtime::nats::connect must authenticate with the user and password in NATS_URL",
    );
    let inbox = connection.client.new_inbox();
    assert!(
        inbox.starts_with("_INBOX.agent-ingest."),
        "ctxsync_runtime::nats::connect(.., \"agent-ingest\") must set the inbox prefix \
         `_INBOX.agent-ingest`, got {inbox}"
    );
    let reply = tokio::time::timeout(
        DEADLINE,
        connection.client.request(s.store_push(), "ping".into()),
    )
    .await;
    assert!(
        matches!(reply, Ok(Ok(_))),
        "a request through ctxsync_runtime::nats::connect(.., \"agent-ingest\") got no reply: its inbox \
         prefix must be `_INBOX.agent-ingest` (the only inbox that user may subscribe to): {reply:?}"
    );
}

/// agent-ingest forwards bodies up to `MAX_REQUEST_BYTES` as one NATS message:
/// the server's max_payload (1 MiB by default) must hold it with its envelope.
#[tokio::test]
async fn max_payload_holds_the_largest_push() {
    let server = Server::start().await;
    let (ingest, _) = server.connect("agent-ingest").await;
    let max_payload = ingest.server_info().max_payload;
    let largest = ctxsync_proto::limits::MAX_REQUEST_BYTES;
    assert!(
        max_payload >= largest + largest / 4,
        "nats.conf max_payload {max_payload} is too small for a {largest}-byte push"
    );
}

/// The catalog under its own user: as deployed (JetStream off) it is ready
/// and serves from its process's memory; with JetStream on, its warm-up
/// claims, discovers and puts into the bucket. No operation of either is
/// refused (a refusal would fail `/readyz`).
#[tokio::test]
async fn the_catalog_shares_its_memory_within_its_permissions() {
    for jetstream in [false, true] {
        let server = Server::start_with(jetstream).await;
        let db = testkit::TestDatabase::create().await;
        let record = tempfile::tempdir().unwrap();
        let yaml = format!(
            "tenants: [{{id: demo, servers: [{{id: fx, transport: {{stdio: {{command: {:?}, args: [--record-dir, {:?}]}}}}}}]}}]",
            mcp_fixture::fixture_binary().display().to_string(),
            record.path().display().to_string(),
        );
        let servers = catalog::CatalogConfig::from_yaml(&yaml).unwrap();
        let key = servers.enabled_servers("demo").unwrap()[0].key.clone();
        let shutdown = ctxsync_runtime::Shutdown::new();
        let builder = testkit::stack::StackBuilder::new(
            server.url_for("catalog"),
            Subjects::default().prefix(),
        )
        .database(db.url())
        .catalog(servers, catalog::Settings::default(), |config| {
            answering_as(
                &mut config.common,
                &server,
                "catalog-rpc",
                CATALOG_REPLY_INBOXES,
            );
        });
        let stack = testkit::stack::start(builder, &shutdown).await;
        let mut warmup = stack.catalog().warmup();
        let status = tokio::time::timeout(Duration::from_secs(30), warmup.wait_for(|s| s.finished))
            .await
            .expect("the warm-up finishes")
            .unwrap()
            .clone();
        assert_eq!(
            status.discovered,
            ["demo/fx"],
            "jetstream {jetstream}: {status:?}"
        );

        let (gate, _) = server.connect("chat-gate").await;
        let reply: ctxsync_proto::v1::CatalogPrepareReply =
            ctxsync_runtime::rpc::request_for_tenant(
                &gate,
                "demo",
                Subjects::default().catalog_prepare("demo"),
                &ctxsync_proto::v1::CatalogPrepareRequest {
                    tenant: "demo".into(),
                    session_id: format!("s-{jetstream}"),
                },
                None,
                DEADLINE,
            )
            .await
            .unwrap();
        assert_eq!(reply.pins.len(), 1, "{reply:?}");
        assert_eq!(
            reply.pins[0].source,
            ctxsync_proto::v1::catalog_pin::Source::Pinned as i32
        );
        let readyz = format!("http://{}/readyz", stack.catalog().http_addr());
        let ready = reqwest::get(&readyz).await.unwrap();
        let code = ready.status();
        let body = ready.text().await.unwrap();
        assert_eq!(
            code, 200,
            "jetstream {jetstream}: no permissions violation: {body}"
        );
        if jetstream {
            let (catalog_user, _) = server.connect("catalog").await;
            let bucket = async_nats::jetstream::new(catalog_user)
                .get_key_value(catalog::settings::memory_bucket_name(
                    Subjects::default().prefix(),
                ))
                .await
                .expect("the catalog created its bucket");
            let keys: Vec<String> = bucket
                .keys()
                .await
                .unwrap()
                .map(|key| key.unwrap())
                .collect()
                .await;
            assert_eq!(keys, [key.as_str()], "the warm-up put its discovery");
        }
        shutdown.cancel();
        stack.stop().await;
    }
}

/// Tenant `demo`, with the shipped `chat-demo` user, aims the reply subject
/// of its own requests (a turn, a preparation, a call, a session end) at the
/// catalog's bucket entry of tenant `other`, at every event subject, at
/// tenant `other`'s subjects and inboxes, and at the services' own inboxes.
/// The real gate and catalog run as deployed (their own users, answers on
/// `*-rpc` connections, tenants' inboxes only): nothing is published there,
/// each refusal is counted, and tenant `other`'s first turn still pins its
/// server's tools from the bucket entry that was aimed at.
#[tokio::test]
async fn a_tenant_cannot_aim_a_services_answer_anywhere_but_its_own_inbox() {
    use ctxsync_proto::v1::{
        CatalogCallRequest, CatalogEndSessionRequest, CatalogPrepareRequest, TurnReply, TurnRequest,
    };
    use prost::Message as _;

    let server = Server::start_with_tenants(true, &["other"]).await;
    let s = Subjects::default();
    let db = testkit::TestDatabase::create().await;
    let record = tempfile::tempdir().unwrap();
    let fixture = mcp_fixture::fixture_binary().display().to_string();
    let server_of = |dir: &str| {
        format!(
            "{{id: fx, transport: {{stdio: {{command: {fixture:?}, args: [--record-dir, {:?}]}}}}}}",
            record.path().join(dir).display().to_string()
        )
    };
    let yaml = format!(
        "tenants: [{{id: demo, servers: [{}]}}, {{id: other, servers: [{}]}}]",
        server_of("demo"),
        server_of("other")
    );
    let servers = catalog::CatalogConfig::from_yaml(&yaml).unwrap();
    let others_key = servers.enabled_servers("other").unwrap()[0].key.clone();
    let shutdown = ctxsync_runtime::Shutdown::new();
    let builder = testkit::stack::StackBuilder::new(server.url_for("snapshot-store"), s.prefix())
        .database(db.url())
        .store(|_| {})
        .gate(|config| {
            config.common.nats_url = server.url_for("chat-gate");
            answering_as(
                &mut config.common,
                &server,
                "chat-gate-rpc",
                GATE_REPLY_INBOXES,
            );
            config.stale_grace = Duration::from_millis(300);
        })
        .catalog(servers, catalog::Settings::default(), |config| {
            config.common.nats_url = server.url_for("catalog");
            answering_as(
                &mut config.common,
                &server,
                "catalog-rpc",
                CATALOG_REPLY_INBOXES,
            );
        });
    let stack = testkit::stack::start(builder, &shutdown).await;
    let mut warmup = stack.catalog().warmup();
    tokio::time::timeout(Duration::from_secs(30), warmup.wait_for(|s| s.finished))
        .await
        .expect("the warm-up finishes")
        .unwrap();
    let (catalog_user, _) = server.connect("catalog").await;
    let bucket = async_nats::jetstream::new(catalog_user)
        .get_key_value(catalog::settings::memory_bucket_name(s.prefix()))
        .await
        .expect("the catalog created its bucket");
    // (The catalog's user reads its bucket through consumers only.)
    let latest = |bucket: async_nats::jetstream::kv::Store, key: String| async move {
        let history: Vec<_> = bucket.history(key).await.unwrap().collect().await;
        let last = history.into_iter().last().expect("an entry").unwrap();
        (last.revision, last.value)
    };
    let entry_before = latest(bucket.clone(), others_key.to_string()).await;
    let keys_before = bucket.keys().await.unwrap().count().await;

    // The agents of both tenants, registered as the operator would.
    let (cli, _) = server.connect("ctxsync-cli").await;
    let operator = testkit::store::StoreClient::new(cli, s.clone(), DEADLINE, "ws");
    let demo_agent = operator.clone().in_tenant("demo").register("a", "a").await;
    let other_agent = operator.clone().in_tenant("other").register("b", "b").await;

    // Watchers of every subject aimed at, each as a user that may read it.
    let (gate_rpc, _) = server.connect("chat-gate-rpc").await;
    let (catalog_rpc, _) = server.connect("catalog-rpc").await;
    let (gate_user, _) = server.connect("chat-gate").await;
    let (catalog_main, _) = server.connect("catalog").await;
    let (chat_other, _) = server.connect("chat-other").await;
    let aims: Vec<(String, &Client)> = vec![
        (
            format!(
                "$KV.{}.{}",
                catalog::settings::memory_bucket_name(s.prefix()),
                others_key.as_str()
            ),
            &gate_rpc, // (read through the bucket's revision below)
        ),
        (s.discovery_changed(&other_agent), &gate_rpc),
        (s.snapshot_committed(&other_agent), &gate_rpc),
        (s.tenant_key_revoked(), &gate_rpc),
        (s.gate_turn("other"), &gate_rpc),
        (s.catalog_prepare("other"), &catalog_rpc),
        (s.catalog_call("other"), &catalog_rpc),
        (s.gate_turn_waited(), &catalog_main),
        ("_INBOX.chat-other.aimed.1".to_owned(), &chat_other),
        ("_INBOX.chat-gate.aimed.1".to_owned(), &gate_user),
        ("_INBOX.chat-gate.other.aimed.1".to_owned(), &gate_user),
        ("_INBOX.catalog.aimed.1".to_owned(), &catalog_main),
    ];
    let mut watchers = Vec::new();
    // A round trip on a watcher's connection: the chat user may not publish
    // into its own inbox, so it asks its catalog (a subject nobody watches).
    let round_trip = |client: Client, chat: bool| {
        let subject = s.catalog_session_end("other");
        async move {
            if chat {
                let _: ctxsync_proto::v1::CatalogEndSessionReply = ctxsync_runtime::rpc::request(
                    &client,
                    subject,
                    &CatalogEndSessionRequest {
                        tenant: "other".into(),
                        session_id: "none".into(),
                    },
                    None,
                    DEADLINE,
                )
                .await
                .unwrap();
            } else {
                ctxsync_runtime::nats::sync_with_server(&client)
                    .await
                    .unwrap();
            }
        }
    };
    for (subject, watcher) in aims.iter().skip(1) {
        watchers.push((
            subject.clone(),
            watcher.subscribe(subject.clone()).await.unwrap(),
        ));
        round_trip((*watcher).clone(), subject.starts_with("_INBOX.chat-other")).await;
    }

    // The requests of tenant demo, each aimed at every subject.
    let (chat_demo, _) = server.connect("chat-demo").await;
    let requests: Vec<(String, Vec<u8>)> = vec![
        (
            s.gate_turn("demo"),
            TurnRequest {
                chat_id: "c".into(),
                agent_id: demo_agent.clone(),
                first_turn: true,
                tenant: String::new(),
            }
            .encode_to_vec(),
        ),
        (
            s.catalog_prepare("demo"),
            CatalogPrepareRequest {
                tenant: "demo".into(),
                session_id: "s".into(),
            }
            .encode_to_vec(),
        ),
        (
            s.catalog_call("demo"),
            CatalogCallRequest {
                tenant: "demo".into(),
                session_id: "s".into(),
                server_id: "fx".into(),
                tool: "echo".into(),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            s.catalog_session_end("demo"),
            CatalogEndSessionRequest {
                tenant: "demo".into(),
                session_id: "s".into(),
            }
            .encode_to_vec(),
        ),
    ];
    for (subject, body) in &requests {
        for (aim, _) in &aims {
            chat_demo
                .publish_with_reply(subject.clone(), aim.clone(), body.clone().into())
                .await
                .unwrap();
        }
    }
    chat_demo.flush().await.unwrap();
    // Each service takes its requests in order: once a proper request sent
    // after the aimed ones is answered, every aimed one has been handled.
    let turn: TurnReply = ctxsync_runtime::rpc::request(
        &chat_demo,
        s.gate_turn("demo"),
        &TurnRequest {
            chat_id: "c2".into(),
            agent_id: demo_agent.clone(),
            first_turn: false,
            tenant: String::new(),
        },
        None,
        DEADLINE,
    )
    .await
    .expect("a turn answered into the tenant's own inbox");
    assert_eq!(turn.error, None);
    let prepared: ctxsync_proto::v1::CatalogPrepareReply = ctxsync_runtime::rpc::request(
        &chat_demo,
        s.catalog_prepare("demo"),
        &CatalogPrepareRequest {
            tenant: "demo".into(),
            session_id: "s3".into(),
        },
        None,
        DEADLINE,
    )
    .await
    .expect("a preparation answered into the tenant's own inbox");
    assert_eq!(prepared.pins.len(), 1, "{prepared:?}");
    let _: ctxsync_proto::v1::CatalogEndSessionReply = ctxsync_runtime::rpc::request(
        &chat_demo,
        s.catalog_session_end("demo"),
        &CatalogEndSessionRequest {
            tenant: "demo".into(),
            session_id: "s3".into(),
        },
        None,
        DEADLINE,
    )
    .await
    .expect("a session end answered into the tenant's own inbox");
    let call: ctxsync_proto::v1::CatalogCallReply = ctxsync_runtime::rpc::request(
        &chat_demo,
        s.catalog_call("demo"),
        &CatalogCallRequest::default(),
        None,
        DEADLINE,
    )
    .await
    .expect("a call answered into the tenant's own inbox");
    drop(call);

    // Nothing reached any aimed subject (a round trip on each watcher's
    // connection delivers whatever the server had routed to it before).
    for (subject, mut watcher) in watchers {
        let client = aims.iter().find(|(s, _)| *s == subject).unwrap().1;
        round_trip(client.clone(), subject.starts_with("_INBOX.chat-other")).await;
        assert!(
            watcher.next().now_or_never().flatten().is_none(),
            "an answer was published on {subject}"
        );
    }
    assert_eq!(
        latest(bucket.clone(), others_key.to_string()).await,
        entry_before,
        "tenant other's bucket entry was overwritten"
    );
    assert_eq!(bucket.keys().await.unwrap().count().await, keys_before);

    // Every aimed request was refused and counted, per subject served.
    let metrics = reqwest::get(format!("http://{}/metrics", stack.catalog().http_addr()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for served in [
        s.gate_turn_all(),
        s.catalog_prepare_all(),
        s.catalog_call_all(),
        s.catalog_session_end_all(),
    ] {
        let series = format!("ctxsync_rpc_reply_refused_total{{subject=\"{served}\"}}");
        let counted: f64 = metrics
            .lines()
            .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in {metrics}"));
        assert_eq!(counted, aims.len() as f64, "{series}");
    }

    // Tenant other's first turn still pins its server, tools and all.
    let reply: TurnReply = ctxsync_runtime::rpc::request(
        &chat_other,
        s.gate_turn("other"),
        &TurnRequest {
            chat_id: "theirs".into(),
            agent_id: other_agent.clone(),
            first_turn: true,
            tenant: String::new(),
        },
        None,
        DEADLINE,
    )
    .await
    .unwrap();
    let section = reply
        .projection
        .as_ref()
        .and_then(|p| p.catalog.as_ref())
        .expect("a catalog section");
    assert_eq!(section.pins.len(), 1, "{section:?}");
    assert_eq!(
        section.pins[0].source,
        ctxsync_proto::v1::catalog_pin::Source::Pinned as i32,
        "pinned from the bucket's entry: {section:?}"
    );
    assert!(!section.pins[0].tools.is_empty(), "{section:?}");
    shutdown.cancel();
    stack.stop().await;
}
