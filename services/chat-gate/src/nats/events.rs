//! The store's events, applied to the core's views as they arrive, and the
//! re-reads after a NATS gap.

use std::time::SystemTime;

use chrono::{DateTime, Utc};

use ctxsync_proto::v1::{DiscoveryChanged, SnapshotCommitted};
use ctxsync_runtime::nats::NatsConnection;
use ctxsync_runtime::telemetry::continue_trace;
use futures::StreamExt;
use futures::stream::BoxStream;
use prost::Message;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use ctxsync_runtime::tenant_keys::TenantKeys;
use gate_core::gate::Gate;
use gate_core::watch::EventUpdate;

/// The revision of a [`SnapshotCommitted`] alone (its tag there): prost
/// skips the other fields, the state included, without building them.
#[derive(Clone, PartialEq, prost::Message)]
struct RevisionOnly {
    #[prost(uint64, tag = "7")]
    revision: u64,
}

/// Every applied event, as the context page's live stream sees it: the
/// agent and what the event said (its state when it carried one).
pub type PageFeed = tokio::sync::broadcast::Sender<std::sync::Arc<(String, EventUpdate)>>;

/// Hands an event to the page's streams, if any page is open.
fn feed_page(feed: &PageFeed, agent_id: &str, update: &EventUpdate) {
    if feed.receiver_count() > 0 {
        let _ = feed.send(std::sync::Arc::new((agent_id.to_owned(), update.clone())));
    }
}

/// One line at INFO per event that ended waits, with the trace of the push
/// whose commit it announces: an operator follows one report from the agent
/// to the chats it woke at the default level (events that wake nobody stay
/// at DEBUG, see below).
fn woken_by(agent_id: &str, trace: Option<&ctxsync_runtime::trace::TraceContext>, woken: usize) {
    if woken > 0 {
        tracing::info!(
            agent_id,
            trace_id = trace.map(|t| t.trace_id()).unwrap_or_default(),
            woken,
            "first-turn waits woken by a commit"
        );
    }
}

/// The store's events as one stream, each applied to its agent's view as it
/// is yielded (and handed to the page's streams, `feed`). The turn server polls it ahead of the turns (see
/// [`super::turns`]), so a turn sent after an event was published is
/// answered with the event applied.
pub fn apply_events(
    gate: Gate,
    discovery: async_nats::Subscriber,
    snapshots: async_nats::Subscriber,
    feed: PageFeed,
) -> BoxStream<'static, ()> {
    let on_discovery = gate.clone();
    let discovery_feed = feed.clone();
    let discovery = discovery.map(move |message| {
        let taken = std::time::Instant::now();
        let trace = ctxsync_runtime::trace::TraceContext::from_nats(message.headers.as_ref());
        let _span = continue_trace(tracing::info_span!("gate.discovery"), trace.as_ref()).entered();
        match DiscoveryChanged::decode(message.payload) {
            Ok(event) => {
                // Every replica sees every event: one line per event and
                // replica is chatter at INFO (the store logs the commit once).
                tracing::debug!(
                    agent_id = %event.agent_id,
                    trace_id = trace.map(|t| t.trace_id()).unwrap_or_default(),
                    phase = event.phase().as_str_name(),
                    revision = event.revision,
                    watched = on_discovery.watches().is_watched(&event.agent_id),
                    "discovery event: updating the agent's view"
                );
                let committed_at = event
                    .committed_at
                    .and_then(|at| DateTime::<Utc>::try_from(at).ok())
                    .map(SystemTime::from);
                let update = EventUpdate::new(event.revision, event.state, committed_at);
                feed_page(&discovery_feed, &event.agent_id, &update);
                let woken = on_discovery.apply_event(&event.agent_id, update);
                if woken > 0 {
                    metrics::histogram!("ctxsync_gate_event_work_seconds")
                        .record(taken.elapsed().as_secs_f64());
                }
                woken_by(&event.agent_id, trace.as_ref(), woken);
            }
            Err(error) => {
                tracing::warn!(subject = %message.subject, %error, "malformed discovery event ignored")
            }
        }
    });
    let snapshots = snapshots.map(move |message| {
        let trace = ctxsync_runtime::trace::TraceContext::from_nats(message.headers.as_ref());
        // Most commits are of agents nobody asks about: skip decoding their
        // states (the subject ends with the agent id).
        let agent_id = message.subject.rsplit('.').next().unwrap_or_default();
        if feed.receiver_count() == 0 {
            if !gate.watches().is_watched(agent_id) {
                return;
            }
            // A commit that changed the discovery is also announced by its
            // DiscoveryChanged, usually applied just before: this one then
            // changes nothing, and decoding its state would only delay the
            // turns that event woke (they run once this task yields).
            if let Ok(head) = RevisionOnly::decode(&message.payload[..])
                && gate.watches().shows(agent_id, head.revision)
            {
                return;
            }
        }
        match SnapshotCommitted::decode(message.payload) {
            Ok(event) => {
                let committed_at = event
                    .committed_at
                    .and_then(|at| DateTime::<Utc>::try_from(at).ok())
                    .map(SystemTime::from);
                let update = EventUpdate::new(event.revision, event.state, committed_at);
                feed_page(&feed, &event.agent_id, &update);
                let woken = gate.apply_event(&event.agent_id, update);
                woken_by(&event.agent_id, trace.as_ref(), woken);
            }
            Err(error) => {
                tracing::warn!(subject = %message.subject, %error, "malformed snapshot event ignored")
            }
        }
    });
    futures::stream::select(discovery, snapshots).boxed()
}

/// Events published while disconnected (or dropped as a slow consumer) are
/// lost. Views are distrusted as soon as the gap is counted (they compare
/// epochs); once connected, every agent someone waits on is read again.
/// Runs through the drain: waits still going on after shutdown are re-read too.
/// Also forgets the remembered tenant keys: a revocation may be among the
/// lost events.
pub fn recheck_after_gaps(
    gate: Gate,
    keys: TenantKeys,
    nats: &NatsConnection,
    stop: CancellationToken,
) -> JoinHandle<()> {
    let mut gaps = nats.gaps();
    let nats = nats.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                changed = gaps.changed() => if changed.is_err() { break },
            }
            keys.forget_all();
            if !nats.is_connected() {
                // The reconnect is another gap: re-read then, not into the void.
                continue;
            }
            let agents = gate.recheck_all();
            tracing::info!(
                agents,
                "events may have been lost: re-reading every waited-on agent"
            );
        }
    })
}
