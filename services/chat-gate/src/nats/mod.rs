//! The gate over NATS: the core's state source (snapshot-store reads) and
//! catalog, the store's events applied to the views, the wait announcements,
//! and the turn server that answers `<prefix>.gate.turn.<tenant>`.

pub mod agents;
pub mod catalog;
pub mod events;
pub mod store;
pub mod turns;

pub use agents::AgentLister;
pub use catalog::CatalogClient;
pub use store::StoreReader;
pub use turns::{TurnServer, TurnServing};

use gate_core::source::WaitAnnouncer;

/// Publishes each first turn's decision and wait on `subject` (where the
/// catalog records it for `ctxsync latency`) for the turns answered outside
/// the turn server (HTTP, in process), from its own task so the turn's
/// answer is not held up. The turn server sends its own after each answer.
pub fn announcer(client: async_nats::Client, subject: String) -> WaitAnnouncer {
    std::sync::Arc::new(move |event| {
        let (client, subject) = (client.clone(), subject.clone());
        tokio::spawn(async move {
            let payload = prost::Message::encode_to_vec(&event).into();
            if let Err(error) = client.publish(subject, payload).await {
                tracing::debug!(%error, "cannot announce a gate wait");
            }
        });
    })
}
