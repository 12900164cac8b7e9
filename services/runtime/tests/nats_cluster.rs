//! `nats::connect` on a three-node cluster given as a URL list: the first
//! connect skips dead entries, and a client whose node is killed fails over
//! to another node with its subscriptions.

use std::time::Duration;

use futures::StreamExt as _;
use testkit::NatsCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_with_dead_entries_connects_to_a_live_one() {
    let nats = tokio::task::spawn_blocking(NatsCluster::start)
        .await
        .unwrap();
    // Five dead entries and one live: async-nats tries them in random order,
    // so nearly every run meets a dead one first.
    let dead: Vec<String> = (0..5)
        .map(|_| format!("nats://127.0.0.1:{}", testkit::free_port()))
        .collect();
    let list = format!("{},{}", dead.join(","), nats.node_url(2));
    let connection = ctxsync_runtime::nats::connect(list.as_str(), "list-test")
        .await
        .unwrap_or_else(|e| panic!("{list}: {e}"));
    assert_eq!(nats.node_of(&connection.client), Some(2));
    ctxsync_runtime::nats::sync_with_server(&connection.client)
        .await
        .expect("a round trip");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_node_is_killed_fails_over_with_its_subscriptions() {
    let mut nats = tokio::task::spawn_blocking(NatsCluster::start)
        .await
        .unwrap();
    let subscriber = ctxsync_runtime::nats::connect(nats.url_list().as_str(), "failover-sub")
        .await
        .expect("connects");
    let node = nats
        .node_of(&subscriber.client)
        .expect("on a node of the cluster");
    let other = (node + 1) % NatsCluster::SIZE;
    let publisher = ctxsync_runtime::nats::connect(nats.node_url(other).as_str(), "failover-pub")
        .await
        .expect("connects");
    let mut messages = testkit::subscribe(&subscriber.client, "failover.test".into()).await;
    let mut reconnects = subscriber.reconnects();
    nats.kill(node);
    tokio::time::timeout(Duration::from_secs(10), reconnects.wait_for(|n| *n > 0))
        .await
        .expect("reconnects within 10 s")
        .unwrap();
    let now_on = nats
        .node_of(&subscriber.client)
        .expect("on a node of the cluster");
    assert_ne!(now_on, node);
    // Resubscribed on the new node, and the interest reached the publisher's
    // node: a round trip from both sides, then a message is delivered.
    ctxsync_runtime::nats::sync_with_server(&subscriber.client)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        publisher
            .client
            .publish("failover.test", "after".into())
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_millis(200), messages.next()).await {
            Ok(Some(message)) => {
                assert_eq!(message.payload.as_ref(), b"after");
                break;
            }
            Ok(None) => panic!("the subscription ended"),
            Err(_) if tokio::time::Instant::now() > deadline => {
                panic!("no message through the cluster within 10 s of the failover")
            }
            // Route interest propagates asynchronously: publish again.
            Err(_) => {}
        }
    }
}
