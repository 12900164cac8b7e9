//! Records chat-gate's first-turn waits (outcome and duration, nothing else)
//! as `gate.turn.waited` events, so `ctxsync latency` can report gate waits
//! by outcome next to the catalog's own setup times.

use prost::Message;
use serde_json::json;
use sqlx::PgPool;
use tokio::task::JoinHandle;

use ctxsync_proto::v1::GateTurnWaited;
use ctxsync_runtime::Shutdown;

use crate::latency::GATE_WAIT_KIND;
use crate::store::{self, NewEvent};

pub fn spawn(
    pool: PgPool,
    mut events: async_nats::Subscriber,
    shutdown: Shutdown,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(message) = ctxsync_runtime::nats::next_until(&mut events, &shutdown).await {
            record(&pool, &message.payload).await;
        }
        // A wait announced just before shutdown is already on its way to this
        // connection: draining takes what the server sent before the
        // unsubscribe, so a stop right after a turn still counts it.
        if events.drain().await.is_ok() {
            use futures::StreamExt as _;
            while let Some(message) = events.next().await {
                record(&pool, &message.payload).await;
            }
        }
    })
}

async fn record(pool: &PgPool, payload: &[u8]) {
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
    let stored = async {
        let mut conn = pool.acquire().await?;
        store::insert_events(&mut conn, vec![event]).await
    }
    .await;
    if let Err(error) = stored {
        tracing::warn!(%error, "cannot record a gate wait");
    }
}
