//! `rpc::serve` against a real nats-server: a request is answered only on a
//! reply subject under the permitted inbox prefixes; one aimed elsewhere is
//! refused unexecuted and counted, and nothing is published where it aimed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ctxsync_runtime::nats::{NatsTarget, connect, sync_with_server};
use ctxsync_runtime::rpc::{self, ReplyInboxes};
use ctxsync_runtime::{Shutdown, metrics};
use futures::{FutureExt as _, StreamExt as _};
use prost::Message as _;
use testkit::NatsServer;

const DEADLINE: Duration = Duration::from_secs(10);

/// Counts handled requests and answers each with its own body.
async fn echo_server(
    nats: &NatsServer,
    inboxes: &str,
    subject: &str,
    shutdown: &Shutdown,
) -> (rpc::Server, Arc<AtomicUsize>) {
    let target = NatsTarget {
        reply_inboxes: ReplyInboxes::parse(inboxes).unwrap(),
        ..NatsTarget::from(nats.url().as_str())
    };
    let connection = connect(target, "rpc-replies-test").await.unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let server = rpc::serve(
        &connection,
        subject.to_owned(),
        "rpc-replies-test",
        shutdown.clone(),
        Duration::from_secs(1),
        |_| String::new(),
        move |request: String, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            std::future::ready(request)
        },
    )
    .await
    .unwrap();
    (server, handled)
}

fn body(text: &str) -> bytes::Bytes {
    text.to_owned().encode_to_vec().into()
}

fn refused(subject: &str) -> f64 {
    let series = format!("ctxsync_rpc_reply_refused_total{{subject=\"{subject}\"}}");
    metrics::handle()
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series}"))
}

#[tokio::test]
async fn answers_are_sent_only_into_permitted_inboxes() {
    let nats = NatsServer::start();
    let shutdown = Shutdown::new();
    // A service subject (the store's kind): any inbox, nothing else.
    let (_store, store_handled) = echo_server(&nats, "_INBOX.", "t.store.get", &shutdown).await;
    // A tenant subject (the gate's kind), answered only into the tenant's inboxes.
    let (_gate, gate_handled) =
        echo_server(&nats, "_INBOX.chat-{tenant}.", "t.gate.turn.*", &shutdown).await;

    let watcher = async_nats::connect(nats.url()).await.unwrap();
    let mut aimed_at = watcher.subscribe("t.events.>").await.unwrap();
    let mut kv = watcher.subscribe("$KV.>").await.unwrap();
    let mut other_inbox = watcher.subscribe("_INBOX.chat-other.>").await.unwrap();
    sync_with_server(&watcher).await.unwrap();

    let caller = async_nats::ConnectOptions::new()
        .custom_inbox_prefix("_INBOX.chat-demo")
        .connect(nats.url())
        .await
        .unwrap();
    for aim in [
        "t.events.discovery.a",
        "$KV.bucket.key",
        "t.events.tenant_key.revoked",
    ] {
        caller
            .publish_with_reply("t.store.get", aim, body("aimed"))
            .await
            .unwrap();
    }
    for aim in [
        "_INBOX.chat-other.n.1",
        "$KV.bucket.key",
        "t.events.snapshot.a",
    ] {
        caller
            .publish_with_reply("t.gate.turn.demo", aim, body("aimed"))
            .await
            .unwrap();
    }
    // Requests into the caller's own inbox are answered; each server takes
    // its requests in order, so the aimed ones were handled before these.
    for subject in ["t.store.get", "t.gate.turn.demo"] {
        let answer = tokio::time::timeout(DEADLINE, caller.request(subject, body("proper")))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            String::decode(answer.payload).unwrap(),
            "proper",
            "{subject}"
        );
    }
    // Another tenant's subject with the caller's inbox: not that tenant's inbox.
    caller
        .publish_with_reply("t.gate.turn.other", caller.new_inbox(), body("crossed"))
        .await
        .unwrap();
    let answer = tokio::time::timeout(DEADLINE, caller.request("t.gate.turn.demo", body("last")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::decode(answer.payload).unwrap(), "last");

    sync_with_server(&watcher).await.unwrap();
    for (what, subscription) in [
        ("an event subject", &mut aimed_at),
        ("a bucket", &mut kv),
        ("another tenant's inbox", &mut other_inbox),
    ] {
        assert!(
            subscription.next().now_or_never().flatten().is_none(),
            "an answer was published into {what}"
        );
    }
    assert_eq!(
        store_handled.load(Ordering::SeqCst),
        1,
        "refused requests are not executed"
    );
    assert_eq!(gate_handled.load(Ordering::SeqCst), 2);
    assert_eq!(refused("t.store.get"), 3.0);
    assert_eq!(refused("t.gate.turn.*"), 4.0);
    shutdown.cancel();
}
