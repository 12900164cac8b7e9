//! `store.agent.list`: one tenant's agents, in pages of a bounded size,
//! states as `store.agent.get` gives them but without instruction contents;
//! a list without a tenant is refused.

mod common;

use common::*;
use ctxsync_proto::rpc::store;
use ctxsync_proto::v1::service_error::Code;
use ctxsync_proto::v1::*;

async fn list(h: &StoreHarness, tenant: &str, limit: u32, after: &str) -> ListAgentsReply {
    h.api
        .request::<store::ListAgents>(&ListAgentsRequest {
            tenant: tenant.into(),
            limit,
            after_agent_id: after.into(),
        })
        .await
}

#[tokio::test]
async fn a_tenants_agents_are_listed_in_pages_without_instruction_contents() {
    let h = StoreHarness::spawn().await;
    let mut mine = Vec::new();
    for name in ["a", "b", "c"] {
        mine.push(h.register(name).await);
    }
    mine.sort();
    let run = "0b7f2c1e-7d1a-4c59-9d2f-4a1b2c3d4e5f";
    h.startup(&mine[0], run).await;
    h.push_ok(
        &mine[0],
        complete(run, 1, vec![instruction("/w/AGENTS.md", "be kind")]),
    )
    .await;
    let other = h.api.clone().in_tenant("globex").register("z", "z").await;

    let first = list(&h, h.api.tenant(), 2, "").await;
    assert_eq!(first.error, None);
    let ids: Vec<&str> = first
        .states
        .iter()
        .map(|s| s.agent.as_ref().unwrap().agent_id.as_str())
        .collect();
    assert_eq!(ids, [mine[0].as_str(), mine[1].as_str()]);
    assert_eq!(first.next_after_agent_id, mine[1]);
    let stored = h.state(&mine[0]).await;
    let listed = &first.states[0];
    assert_eq!(listed.revision, stored.revision);
    assert_eq!(listed.snapshot, stored.snapshot);
    let Some(context_resource::Body::InstructionFile(file)) = &listed.resources[0].body else {
        panic!("{listed:?}");
    };
    assert_eq!(
        (file.path.as_str(), file.content.as_str()),
        ("/w/AGENTS.md", "")
    );

    let rest = list(&h, h.api.tenant(), 2, &first.next_after_agent_id).await;
    let ids: Vec<&str> = rest
        .states
        .iter()
        .map(|s| s.agent.as_ref().unwrap().agent_id.as_str())
        .collect();
    assert_eq!(ids, [mine[2].as_str()]);
    assert_eq!(rest.next_after_agent_id, "", "the last page");

    let theirs = list(&h, "globex", 0, "").await;
    assert_eq!(theirs.states.len(), 1);
    assert_eq!(theirs.states[0].agent.as_ref().unwrap().agent_id, other);

    let refused = list(&h, "", 0, "").await;
    assert_eq!(refused.error.unwrap().code(), Code::InvalidArgument);
    let refused = list(&h, "globex", 0, "not-a-uuid").await;
    assert_eq!(refused.error.unwrap().code(), Code::InvalidArgument);
}
