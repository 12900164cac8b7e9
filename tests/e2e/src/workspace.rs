//! What the process tests share: a workspace's `.mcp.json` entry for a
//! server, and waiting for the discovery event a step expects.

use std::time::Duration;

use ctxsync_mcp::TransportSpec;
use ctxsync_proto::v1::DiscoveryChanged;
use futures::StreamExt as _;
use prost::Message as _;
use serde_json::{Value, json};

/// The `.mcp.json` entry of a stdio server (command, args, env).
pub fn stdio_entry(spec: &ctxsync_mcp::ServerSpec) -> Value {
    let TransportSpec::Stdio {
        command, args, env, ..
    } = &spec.transport
    else {
        panic!("a stdio server");
    };
    json!({ "command": command, "args": args, "env": env })
}

/// Discovery events until one matches, each within `deadline`.
pub async fn event_where(
    events: &mut async_nats::Subscriber,
    deadline: Duration,
    matches: impl Fn(&DiscoveryChanged) -> bool,
) -> DiscoveryChanged {
    loop {
        let message = tokio::time::timeout(deadline, events.next())
            .await
            .expect("a discovery event within the deadline")
            .expect("subscription open");
        let event = DiscoveryChanged::decode(message.payload).expect("a DiscoveryChanged");
        if matches(&event) {
            return event;
        }
    }
}
