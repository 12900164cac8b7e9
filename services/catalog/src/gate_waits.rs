//! Records chat-gate's first-turn waits (outcome and duration, nothing else)
//! as `gate.turn.waited` events, so `ctxsync latency` can report gate waits
//! by outcome next to the catalog's own setup times. They are queued for the
//! event writer, in its batches, like every event no answer depends on.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use serde_json::json;
use tokio::task::JoinHandle;

use ctxsync_proto::v1::GateTurnWaited;
use ctxsync_runtime::Shutdown;

use crate::events::Events;
use crate::latency::GATE_WAIT_KIND;
use crate::store::NewEvent;

pub fn spawn(
    queue: Arc<Events>,
    client: async_nats::Client,
    mut events: async_nats::Subscriber,
    shutdown: Shutdown,
    grace: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(message) = ctxsync_runtime::nats::next_until(&mut events, &shutdown).await {
            record(&queue, &message.payload);
        }
        // A wait announced just before shutdown may still be in the socket:
        // a stop right after a turn (another client already saw the wait)
        // still counts it. A slow server delays the stop by a second at most.
        let drained = ctxsync_runtime::nats::drain_delivered(
            &client,
            &mut events,
            grace.min(ctxsync_runtime::nats::DRAIN_ROUND_TRIP_BOUND),
        );
        if drained.await.is_ok() {
            use futures::StreamExt as _;
            while let Some(message) = events.next().await {
                record(&queue, &message.payload);
            }
        }
    })
}

fn record(queue: &Events, payload: &[u8]) {
    let Ok(wait) = GateTurnWaited::decode(payload) else {
        tracing::debug!("malformed gate wait event ignored");
        return;
    };
    let event = NewEvent {
        kind: GATE_WAIT_KIND,
        tenant: wait.tenant,
        session_id: None,
        server_id: None,
        payload: json!({ "outcome": wait.outcome, "wait_ms": wait.wait_ms }),
    };
    queue.queue(vec![event]);
}
