//! snapshot-store as a NATS user with too few permissions, against a real
//! nats-server enforcing them: a refused subscription stops the start naming
//! the subject and the user; a refused event publish makes `/readyz` fail.

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::{CommonArgs, Shutdown};
use testkit::report::{instruction, pending};
use testkit::store::StoreClient;
use testkit::{NatsServer, TestDatabase};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(10);
const RUN: &str = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";

/// Users: `admin` may do anything; `store-no-sub` may subscribe only to its
/// inbox; `store-no-events` may do anything but publish the store's events.
fn server(subjects: &Subjects) -> NatsServer {
    NatsServer::start_with_config(&format!(
        r#"
authorization {{
  users = [
    {{ user: "admin", password: "admin-pw" }}
    {{ user: "store-no-sub", password: "secret-1", permissions: {{
        publish: {{ allow: [">"] }}
        subscribe: {{ allow: ["_INBOX.snapshot-store.>"] }}
    }} }}
    {{ user: "store-no-events", password: "secret-2", permissions: {{
        publish: {{ allow: [">"], deny: ["{discovery}", "{snapshots}"] }}
        subscribe: {{ allow: [">"] }}
    }} }}
  ]
}}
"#,
        discovery = subjects.discovery_changed_all(),
        snapshots = subjects.snapshot_committed_all(),
    ))
}

fn url_as(nats: &NatsServer, user: &str, password: &str) -> String {
    format!("nats://{user}:{password}@127.0.0.1:{}", nats.port())
}

/// `GET /readyz`: the status and the body.
async fn readyz(addr: SocketAddr) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(DEADLINE, stream.read_to_string(&mut answer))
        .await
        .expect("readyz answers")
        .unwrap();
    let status = answer.split(' ').nth(1).unwrap().parse().unwrap();
    let body = answer.split_once("\r\n\r\n").unwrap().1.to_owned();
    (status, body)
}

#[tokio::test]
async fn start_fails_naming_the_subject_and_the_user_when_a_subscription_is_refused() {
    testkit::init_logs();
    let prefix = testkit::unique_prefix();
    let subjects = Subjects::new(&prefix).unwrap();
    let nats = server(&subjects);
    let db = TestDatabase::create().await;
    let config = snapshot_store::Config::new(
        CommonArgs::for_nats(url_as(&nats, "store-no-sub", "secret-1"), &prefix),
        db.url(),
    );
    let started = tokio::time::timeout(DEADLINE, snapshot_store::start(config, Shutdown::new()))
        .await
        .expect("start returns");
    let message = match started {
        Ok(_) => panic!("the store started although it may not subscribe to its subjects"),
        Err(error) => error.to_string(),
    };
    assert!(
        message.contains(&format!("{:?}", subjects.store_register_agent())),
        "{message}"
    );
    assert!(message.contains(r#"user "store-no-sub""#), "{message}");
    assert!(message.contains("permissions violation"), "{message}");
    assert!(!message.contains("secret-1"), "{message}");
}

#[tokio::test]
async fn a_store_whose_events_are_refused_is_not_ready() {
    testkit::init_logs();
    let prefix = testkit::unique_prefix();
    let subjects = Subjects::new(&prefix).unwrap();
    let nats = server(&subjects);
    let db = TestDatabase::create().await;
    let config = snapshot_store::Config::new(
        CommonArgs::for_nats(url_as(&nats, "store-no-events", "secret-2"), &prefix),
        db.url(),
    );
    let shutdown = Shutdown::new();
    let store = snapshot_store::start(config, shutdown.clone())
        .await
        .expect("subscriptions are allowed: the store starts");
    let (status, body) = readyz(store.http_addr()).await;
    assert_eq!(status, 200, "{body}");

    let admin = ctxsync_runtime::nats::connect(&url_as(&nats, "admin", "admin-pw"), "test")
        .await
        .unwrap();
    let client = StoreClient::new(admin.client.clone(), subjects.clone(), DEADLINE, "w");
    let agent = client.register("a", "token-a").await;
    client.startup(&agent, RUN).await;
    // Committed; its events are what the server refuses.
    client
        .push_ok(
            &agent,
            pending(RUN, 1, vec![instruction("/w/AGENTS.md", "hi")]),
        )
        .await;

    let refused = tokio::time::timeout(DEADLINE, async {
        loop {
            let (status, body) = readyz(store.http_addr()).await;
            if status == 503 {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("readyz fails once an event publish is refused");
    assert!(refused.contains("nats_permissions"), "{refused}");
    assert!(refused.contains("store-no-events"), "{refused}");
    assert!(refused.contains("may not publish to"), "{refused}");
    assert!(
        refused.contains(&subjects.snapshot_committed(&agent)),
        "{refused}"
    );
    assert!(!refused.contains("secret-2"), "{refused}");
    // The connection itself is fine: only the permissions check fails.
    assert!(refused.contains(r#""nats":"ok""#), "{refused}");

    shutdown.cancel();
    tokio::time::timeout(DEADLINE, store.join())
        .await
        .expect("the store stops");
}
