//! `rpc::serve` at shutdown, against a real nats-server: a request the server
//! routed to a replica before the replica was told to stop is answered, even
//! when it reaches the replica's connection after the stop began (a rolling
//! restart under load; a slow network).

use std::time::Duration;

use ctxsync_runtime::Shutdown;
use ctxsync_runtime::nats::{NatsTarget, connect, sync_with_server};
use ctxsync_runtime::rpc::{self, ReplyInboxes};
use futures::StreamExt as _;
use prost::Message as _;
use testkit::{LateProxy, NatsServer};

const DEADLINE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_request_routed_here_before_a_stop_is_answered_though_it_arrives_late() {
    let nats = NatsServer::start();
    let late = LateProxy::start(nats.port()).await;
    let target = NatsTarget {
        reply_inboxes: ReplyInboxes::parse("_INBOX.").unwrap(),
        ..NatsTarget::from(late.url().as_str())
    };
    let connection = connect(target, "rpc-drain-test").await.unwrap();
    let shutdown = Shutdown::new();
    let server = rpc::serve(
        &connection,
        "t.store.get".to_owned(),
        "rpc-drain-test",
        shutdown.clone(),
        Duration::from_secs(5),
        |_| String::new(),
        |request: String, _| std::future::ready(format!("answer to {request}")),
    )
    .await
    .unwrap();

    let caller = async_nats::connect(nats.url()).await.unwrap();
    let inbox = caller.new_inbox();
    let mut answers = caller.subscribe(inbox.clone()).await.unwrap();
    sync_with_server(&caller).await.unwrap();

    // From now on what the server sends the replica arrives 300 ms late.
    late.delay_to_client(Duration::from_millis(300));
    caller
        .publish_with_reply(
            "t.store.get",
            inbox,
            "late".to_owned().encode_to_vec().into(),
        )
        .await
        .unwrap();
    // The server has read the request, so it has routed it to the replica
    // (its only responder): it is on its way when the stop begins.
    sync_with_server(&caller).await.unwrap();
    shutdown.cancel();
    // Other traffic on the replica's connection (a busy service always has
    // some) turns its handler, which forgets a drained subscription at once:
    // what reaches the connection after that would be lost.
    let busy = tokio::spawn({
        let client = connection.client.clone();
        async move {
            loop {
                let _ = client.publish("t.elsewhere", bytes::Bytes::new()).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });

    let answer = tokio::time::timeout(DEADLINE, answers.next())
        .await
        .expect("the request routed before the stop is answered")
        .expect("subscription open");
    assert_eq!(
        String::decode(answer.payload).unwrap(),
        "answer to late",
        "its own answer"
    );
    busy.abort();
    tokio::time::timeout(DEADLINE, server.join())
        .await
        .expect("the server stops within its grace");
}
