//! The typed calls against a real nats-server: a call declared in
//! `ctxsync_proto::rpc` is served (`rpc::serve_rpc`) and asked
//! (`StoreClient`, `rpc::call_for_tenant`) with its own types; the service's
//! error envelope reaches the caller as `RpcError::Service` with its code; a
//! request that does not decode is answered `invalid_argument` without
//! reaching the handler; a tenant's call is answered on the tenant's inbox.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ctxsync_proto::rpc::{Reply as _, gate, store};
use ctxsync_proto::subjects::{STORE_QUEUE_GROUP, Subjects};
use ctxsync_proto::v1::{
    Agent, AgentState, GateDecision, GetAgentStateReply, ServiceError, TurnReply,
    service_error::Code,
};
use ctxsync_runtime::Shutdown;
use ctxsync_runtime::nats::{NatsTarget, connect};
use ctxsync_runtime::rpc::{self, ReplyInboxes, RpcError};
use ctxsync_runtime::store::StoreClient;
use prost::Message as _;
use testkit::NatsServer;

const DEADLINE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_declared_call_is_served_and_asked_with_its_own_types() {
    let nats = NatsServer::start();
    let shutdown = Shutdown::new();
    let subjects = Subjects::new("typed").unwrap();

    let store_side = connect(NatsTarget::from(nats.url().as_str()), "typed-store")
        .await
        .unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let _store = rpc::serve_rpc(
        store::GetAgentState,
        &store_side,
        &subjects,
        STORE_QUEUE_GROUP,
        shutdown.clone(),
        Duration::from_secs(1),
        move |request, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            std::future::ready(match request.agent_id.as_str() {
                "known" => Ok(GetAgentStateReply {
                    state: Some(AgentState {
                        agent: Some(Agent {
                            agent_id: "known".into(),
                            ..Default::default()
                        }),
                        revision: 3,
                        ..Default::default()
                    }),
                    error: None,
                }),
                other => Err(ServiceError::new(
                    Code::NotFound,
                    format!("agent {other} not found"),
                )),
            })
        },
    )
    .await
    .unwrap();

    let caller = async_nats::connect(nats.url()).await.unwrap();
    let client = StoreClient::new(caller.clone(), &subjects, DEADLINE);
    let state = client.agent_state("known").await.unwrap();
    assert_eq!(state.revision, 3);
    assert_eq!(state.agent.unwrap().agent_id, "known");

    match client.agent_state("gone").await {
        Err(RpcError::Service {
            code: Code::NotFound,
            message,
            subject,
            ..
        }) => {
            assert_eq!(message, "agent gone not found");
            assert_eq!(subject, "typed.store.agent.get");
        }
        other => panic!("expected the store's not_found, got {other:?}"),
    }
    assert_eq!(handled.load(Ordering::SeqCst), 2);

    // Bytes that are no GetAgentStateRequest (a truncated varint): refused
    // with the call's own reply type, never handled.
    let answer = tokio::time::timeout(
        DEADLINE,
        caller.request("typed.store.agent.get", vec![0x08, 0xff].into()),
    )
    .await
    .unwrap()
    .unwrap();
    let refused = GetAgentStateReply::decode(answer.payload).unwrap();
    let error = refused.error().expect("refused");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(
        error.message.starts_with("malformed request"),
        "{}",
        error.message
    );
    assert_eq!(
        handled.load(Ordering::SeqCst),
        2,
        "a malformed request is not handled"
    );

    // A tenant's call: served on every tenant's subject, answered only into
    // the tenant's own inboxes, so only the tenant's inbox gets the answer.
    let gate_side = connect(
        NatsTarget {
            reply_inboxes: ReplyInboxes::parse("_INBOX.chat.{tenant}.").unwrap(),
            ..NatsTarget::from(nats.url().as_str())
        },
        "typed-gate",
    )
    .await
    .unwrap();
    let _gate = rpc::serve_rpc(
        gate::Turn,
        &gate_side,
        &subjects,
        "typed-gate",
        shutdown.clone(),
        Duration::from_secs(1),
        |request, incoming| {
            std::future::ready(if incoming.last_token() == "demo" {
                Ok(TurnReply {
                    decision: GateDecision::Ready as i32,
                    waited_ms: request.chat_id.len() as u32,
                    ..Default::default()
                })
            } else {
                Err(ServiceError::invalid_argument("another tenant"))
            })
        },
    )
    .await
    .unwrap();
    let chat = async_nats::ConnectOptions::new()
        .custom_inbox_prefix("_INBOX.chat")
        .connect(nats.url())
        .await
        .unwrap();
    let turn = rpc::call_for_tenant::<gate::Turn>(
        &chat,
        &subjects,
        "demo",
        &ctxsync_proto::v1::TurnRequest {
            chat_id: "chat-1".into(),
            agent_id: "a".into(),
            first_turn: true,
            tenant: String::new(),
        },
        None,
        DEADLINE,
    )
    .await
    .unwrap();
    assert_eq!((turn.decision(), turn.waited_ms), (GateDecision::Ready, 6));
    shutdown.cancel();
}
