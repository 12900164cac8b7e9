//! chat-gate as a NATS user with too few permissions, against a real
//! nats-server enforcing them: a refused subscription (an event subscription,
//! or the turn subject's queue subscription) stops the start with an error
//! naming the subject and the user, instead of a gate that says it is ready.

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_proto::subjects::Subjects;
use ctxsync_runtime::{CommonArgs, Shutdown};
use testkit::NatsServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(10);

async fn start_error(nats: &NatsServer, prefix: &str, user: &str, password: &str) -> String {
    let url = format!("nats://{user}:{password}@127.0.0.1:{}", nats.port());
    let config = chat_gate::Config::new(CommonArgs::for_nats(url, prefix));
    let started = tokio::time::timeout(DEADLINE, chat_gate::start(config, Shutdown::new()))
        .await
        .expect("start returns");
    match started {
        Ok(_) => panic!("chat-gate started as {user}, which may not subscribe to its subjects"),
        Err(error) => error.to_string(),
    }
}

#[tokio::test]
async fn start_fails_naming_the_refused_subject_and_the_user() {
    testkit::init_logs();
    let prefix = testkit::unique_prefix();
    let s = Subjects::new(&prefix).unwrap();
    // `no-events` may not read the store's events; `no-turns` may read them
    // but not serve turns.
    let nats = NatsServer::start_with_config(&format!(
        r#"
authorization {{
  users = [
    {{ user: "no-events", password: "secret-1", permissions: {{
        publish: {{ allow: [">"] }}
        subscribe: {{ allow: ["_INBOX.chat-gate.>", "{turn}", "{revoked}"] }}
    }} }}
    {{ user: "no-turns", password: "secret-2", permissions: {{
        publish: {{ allow: [">"] }}
        subscribe: {{ allow: ["_INBOX.chat-gate.>", "{discovery}", "{snapshots}", "{revoked}"] }}
    }} }}
  ]
}}
"#,
        turn = s.gate_turn_all(),
        revoked = s.tenant_key_revoked(),
        discovery = s.discovery_changed_all(),
        snapshots = s.snapshot_committed_all(),
    ));

    let message = start_error(&nats, &prefix, "no-events", "secret-1").await;
    assert!(
        message.contains(&format!(
            "nats refused the subscription to {:?} (user \"no-events\")",
            s.discovery_changed_all()
        )),
        "{message}"
    );
    assert!(!message.contains("secret-1"), "{message}");

    let message = start_error(&nats, &prefix, "no-turns", "secret-2").await;
    assert!(
        message.contains(&format!(
            "nats refused the subscription to {:?} (user \"no-turns\")",
            s.gate_turn_all()
        )),
        "{message}"
    );
    assert!(!message.contains("secret-2"), "{message}");
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

fn gate_user(subscribe: &[String]) -> String {
    let allow: Vec<String> = subscribe.iter().map(|s| format!("{s:?}")).collect();
    format!(
        r#"
authorization {{
  users = [
    {{ user: "gate", password: "secret", permissions: {{
        publish: {{ allow: [">"] }}
        subscribe: {{ allow: [{}] }}
    }} }}
  ]
}}
"#,
        allow.join(", ")
    )
}

#[tokio::test]
async fn a_subscription_refused_after_a_reconnect_makes_the_gate_unready() {
    testkit::init_logs();
    let prefix = testkit::unique_prefix();
    let s = Subjects::new(&prefix).unwrap();
    let inbox = "_INBOX.chat-gate.>".to_owned();
    let mut nats = NatsServer::start_with_config(&gate_user(&[
        inbox.clone(),
        s.gate_turn_all(),
        s.tenant_key_revoked(),
        s.discovery_changed_all(),
        s.snapshot_committed_all(),
    ]));
    let url = format!("nats://gate:secret@127.0.0.1:{}", nats.port());
    let shutdown = Shutdown::new();
    let gate = chat_gate::start(
        chat_gate::Config::new(CommonArgs::for_nats(url, &prefix)),
        shutdown.clone(),
    )
    .await
    .expect("every subscription is allowed: the gate starts");
    let (status, body) = readyz(gate.http_addr()).await;
    assert_eq!(status, 200, "{body}");

    // The server comes back without the discovery events for this user: the
    // client subscribes again on reconnect and is refused.
    nats.restart_with_config(&gate_user(&[
        inbox,
        s.gate_turn_all(),
        s.tenant_key_revoked(),
        s.snapshot_committed_all(),
    ]));
    let refused = tokio::time::timeout(DEADLINE, async {
        loop {
            let (status, body) = readyz(gate.http_addr()).await;
            if status == 503 && body.contains("nats_permissions") && body.contains(r#""nats":"ok""#)
            {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("readyz fails once the resubscription is refused");
    assert!(refused.contains(r#"user \"gate\""#), "{refused}");
    assert!(
        refused.contains(&format!(
            r#"may not subscribe to \"{}\""#,
            s.discovery_changed_all()
        )),
        "{refused}"
    );
    assert!(!refused.contains("secret"), "{refused}");

    shutdown.cancel();
    tokio::time::timeout(DEADLINE, gate.join())
        .await
        .expect("the gate stops");
}
