//! The turn server: `<prefix>.gate.turn.<tenant>` in the gate's queue group,
//! with the gate's ordering rule for events and turns.
//!
//! **Events delivered before a turn are applied first.** The store's events
//! (a stream of the same NATS client, each item applied as it is yielded)
//! are polled ahead of the turns, and once a turn arrives whatever the
//! connection already queued is applied before it is handled. A turn sent
//! after an event was published on the same server is therefore answered
//! with that event taken into account, which is what lets a fresh view answer
//! without a read ([`Gate::turn_after_events`]). The events keep being
//! applied while every turn permit is taken (the turns holding them may be
//! waiting for exactly those events) and, after shutdown, while the turns in
//! flight finish; [`TurnServer::join`] hands the stream back for the other
//! callers (HTTP, in-process) still waiting.

use std::sync::Arc;
use std::time::Duration;

use ctxsync_proto::rpc::Reply as _;
use ctxsync_proto::subjects::GATE_QUEUE_GROUP;
use ctxsync_proto::v1::{ServiceError, TurnReply, TurnRequest};
use ctxsync_runtime::Shutdown;
use ctxsync_runtime::nats::{NatsConnection, SubscribeError};
use ctxsync_runtime::rpc::{ReplyInboxes, deadline_of, expired, reply_permitted};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use prost::Message;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use gate_core::gate::{Answer, Gate};

/// Where and how many turns one replica serves.
#[derive(Debug, Clone)]
pub struct TurnServing {
    /// `<prefix>.gate.turn.*`: the last token is the caller's tenant.
    pub subject: String,
    /// Turns held at once (waiting first turns included); more wait in the subscription.
    pub max_in_flight: usize,
    /// After shutdown, the turns already routed here and in flight end within this.
    pub grace: Duration,
    /// Where each first turn's wait is announced, right after its answer
    /// (`<prefix>.events.gate.waited`, recorded by the catalog).
    pub waits_subject: String,
}

/// A running turn server.
pub struct TurnServer {
    task: JoinHandle<BoxStream<'static, ()>>,
}

impl TurnServer {
    /// Subscribes (confirmed by the server before it returns), then serves
    /// turns to `gate`, applying `events` ahead of them (see the module docs).
    pub async fn start(
        nats: &NatsConnection,
        serving: TurnServing,
        gate: Gate,
        events: BoxStream<'static, ()>,
        shutdown: Shutdown,
    ) -> Result<Self, SubscribeError> {
        // Turns arrive on the connection the events do (the responder, when
        // one is configured): the ordering rule above holds within one.
        let responder = nats.responder();
        let subscriber = ctxsync_runtime::nats::subscribe(
            responder,
            serving.subject.clone(),
            Some(GATE_QUEUE_GROUP),
        )
        .await?;
        metrics::counter!("ctxsync_rpc_expired_total", "subject" => serving.subject.clone())
            .increment(0);
        metrics::counter!("ctxsync_rpc_reply_refused_total", "subject" => serving.subject.clone())
            .increment(0);
        let inboxes = nats.reply_inboxes().clone();
        let task = tokio::spawn(serve(
            subscriber,
            responder.client.clone(),
            inboxes,
            serving,
            gate,
            events,
            shutdown,
        ));
        Ok(Self { task })
    }

    /// Waits for the server to stop (after shutdown) and its turns in flight
    /// to be answered; hands back the events, still subscribed, for the
    /// turns of other callers that may still wait for them.
    pub async fn join(self) -> Option<BoxStream<'static, ()>> {
        self.task.await.ok()
    }
}

fn malformed(message: String) -> TurnReply {
    TurnReply::failed(ServiceError::invalid_argument(message))
}

/// The turn's request, or why it is malformed: the subject's tenant, which
/// NATS permissions confine, never the body's.
fn request_of(message: async_nats::Message) -> Result<TurnRequest, String> {
    let tenant = message.subject.rsplit('.').next().unwrap_or_default();
    let mut request = TurnRequest::decode(message.payload)
        .map_err(|error| format!("malformed request: {error}"))?;
    if !request.tenant.is_empty() && request.tenant != tenant {
        return Err("tenant in the request differs from the subject's tenant: omit it".into());
    }
    tenant.clone_into(&mut request.tenant);
    Ok(request)
}

async fn serve(
    mut subscriber: async_nats::Subscriber,
    client: async_nats::Client,
    inboxes: ReplyInboxes,
    serving: TurnServing,
    gate: Gate,
    mut events: BoxStream<'static, ()>,
    shutdown: Shutdown,
) -> BoxStream<'static, ()> {
    let TurnServing {
        subject,
        max_in_flight,
        grace,
        waits_subject,
    } = serving;
    // Cloned per turn without copying the text.
    let waits_subject = async_nats::Subject::from(waits_subject);
    // Shared: each waiting turn holds a pointer, not a client's handles.
    let client = Arc::new(client);
    let permits = Arc::new(Semaphore::new(max_in_flight.max(1)));
    let tracker = TaskTracker::new();
    // Set at shutdown: everything after it (the turns the server had already
    // routed here, then the ones in flight) ends by then.
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let message = tokio::select! {
            biased;
            _ = shutdown.cancelled(), if deadline.is_none() => {
                deadline = Some(tokio::time::Instant::now() + grace);
                // Stop taking turns: the server routes new ones to other
                // replicas; the ones it already sent here still arrive, are
                // answered, and then the subscription ends. The events are
                // applied meanwhile: turns in flight may wait for them.
                let bound = grace.min(ctxsync_runtime::nats::DRAIN_ROUND_TRIP_BOUND);
                let drain = ctxsync_runtime::nats::drain_delivered(&client, &mut subscriber, bound);
                if applying_events(&mut events, drain).await.is_err() {
                    break;
                }
                continue;
            }
            _ = sleep_until_some(deadline) => break,
            Some(()) = events.next() => continue,
            message = subscriber.next() => match message {
                Some(m) => m,
                None => break,
            },
        };
        let taken = tokio::time::Instant::now();
        // The connection queued everything it read before this turn already:
        // apply what the first poll above did not see yet.
        while let Some(Some(())) = events.next().now_or_never() {}
        let Some(reply_to) = message.reply.clone() else {
            tracing::debug!(%subject, "turn without reply subject ignored");
            continue;
        };
        if !reply_permitted(&inboxes, &subject, &message.subject, &reply_to) {
            continue;
        }
        let permit = applying_events(&mut events, permits.clone().acquire_owned()).await;
        let Ok(permit) = permit else {
            break;
        };
        // Picked up after its sender gave up: nobody reads the answer.
        if expired(deadline_of(message.headers.as_ref(), taken)) {
            metrics::counter!("ctxsync_rpc_expired_total", "subject" => subject.clone())
                .increment(1);
            tracing::debug!(%subject, "turn past its deadline dropped unexecuted");
            continue;
        }
        // Decoded before its task: a waiting chat holds its request, not the
        // message nor the buffers it was read from.
        let request = request_of(message);
        let (gate, client, waits_subject) = (gate.clone(), client.clone(), waits_subject.clone());
        tracker.spawn(async move {
            let answer = match request {
                Ok(request) => gate.turn_after_events(request).await,
                Err(why) => Answer {
                    reply: malformed(why),
                    waited: None,
                },
            };
            if let Err(error) = client
                .publish(reply_to, answer.reply.encode_to_vec().into())
                .await
            {
                tracing::warn!(%error, "cannot send a turn's answer");
            }
            // Queued behind the answer on the same connection, which writes
            // both together: the announcement costs the answer nothing.
            if let Some(waited) = answer.waited
                && let Err(error) = client
                    .publish(waits_subject, waited.encode_to_vec().into())
                    .await
            {
                tracing::debug!(%error, "cannot announce a gate wait");
            }
            drop(permit);
        });
    }
    // Stop taking turns, then finish the ones in flight, still applying the
    // events: those turns may be waiting for them.
    let _ = subscriber.unsubscribe().await;
    tracker.close();
    let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + grace);
    let finished =
        tokio::time::timeout_at(deadline, applying_events(&mut events, tracker.wait())).await;
    if finished.is_err() {
        tracing::warn!(%subject, "turns in flight did not finish within the shutdown grace");
    }
    let _ = client.flush().await;
    events
}

/// Runs `work` to its end, applying the events as they come meanwhile (first,
/// as everywhere here): the turns in flight may be waiting for them.
async fn applying_events<T>(
    events: &mut BoxStream<'static, ()>,
    work: impl Future<Output = T>,
) -> T {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            Some(()) = events.next() => {}
            done = &mut work => return done,
        }
    }
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
