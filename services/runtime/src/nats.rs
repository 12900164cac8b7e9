//! The NATS connection every service opens: named, quick to reconnect, and
//! observable (reconnects are counted and announced to whoever needs to
//! re-check state they may have missed while disconnected).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use tokio::sync::watch;

/// The reconnect backoff never grows past this: a waiting chat must not sit
/// out a 4 s default backoff after NATS comes back.
const MAX_RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// A connected client plus a counter of completed reconnects.
#[derive(Clone, Debug)]
pub struct NatsConnection {
    pub client: Client,
    reconnects: watch::Receiver<u64>,
    gaps: watch::Receiver<u64>,
    closed: watch::Receiver<bool>,
}

impl NatsConnection {
    /// Changes each time the client has reconnected (after the initial connect).
    pub fn reconnects(&self) -> watch::Receiver<u64> {
        self.reconnects.clone()
    }

    /// Changes each time messages may have been lost: on a disconnect, a
    /// reconnect, or a subscription dropping messages as a slow consumer.
    /// State kept up to date by messages is only trusted within one value.
    pub fn gaps(&self) -> watch::Receiver<u64> {
        self.gaps.clone()
    }

    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot connect to NATS at {url} (NATS_URL): {reason}")]
pub struct NatsConnectError {
    pub url: String,
    pub reason: String,
}

/// Connects once (no retry: a bad NATS_URL is a startup error), then
/// reconnects forever with a short backoff.
pub async fn connect(url: &str, client_name: &str) -> Result<NatsConnection, NatsConnectError> {
    // Present from the start, so `increase()` alerts see the first reconnect.
    metrics::counter!("ctxsync_nats_reconnects_total", "client" => client_name.to_owned())
        .increment(0);
    let (reconnect_tx, reconnects) = watch::channel(0u64);
    let (gap_tx, gaps) = watch::channel(0u64);
    let (closed_tx, closed) = watch::channel(false);
    let seen_connect = Arc::new(AtomicBool::new(false));
    let name = client_name.to_owned();
    let mut options = ConnectOptions::new()
        .name(client_name)
        // Reply inboxes under the client's own name, so NATS permissions can
        // give each service user its own inboxes and nobody else's.
        .custom_inbox_prefix(format!("_INBOX.{client_name}"))
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(Duration::from_secs(10)))
        .reconnect_delay_callback(|attempts| {
            let step = Duration::from_millis(50).saturating_mul(attempts.min(10) as u32);
            step.min(MAX_RECONNECT_DELAY)
        })
        .event_callback(move |event| {
            let tx = reconnect_tx.clone();
            let gap_tx = gap_tx.clone();
            let closed_tx = closed_tx.clone();
            let seen_connect = seen_connect.clone();
            let name = name.clone();
            async move {
                match event {
                    // The first Connected is the initial connect, not a reconnect.
                    Event::Connected if !seen_connect.swap(true, Ordering::SeqCst) => {
                        tracing::debug!(client = %name, "nats connected");
                    }
                    Event::Connected => {
                        metrics::counter!("ctxsync_nats_reconnects_total", "client" => name.clone())
                            .increment(1);
                        tracing::info!(client = %name, "nats reconnected");
                        gap_tx.send_modify(|n| *n += 1);
                        tx.send_modify(|n| *n += 1);
                    }
                    Event::Disconnected => {
                        gap_tx.send_modify(|n| *n += 1);
                        tracing::warn!(client = %name, "nats disconnected");
                    }
                    Event::SlowConsumer(sid) => {
                        gap_tx.send_modify(|n| *n += 1);
                        metrics::counter!("ctxsync_nats_slow_consumer_total", "client" => name.clone())
                            .increment(1);
                        tracing::warn!(client = %name, sid, "nats subscription dropped messages as a slow consumer");
                    }
                    Event::Closed => {
                        tracing::debug!(client = %name, "nats connection closed");
                        closed_tx.send_replace(true);
                    }
                    Event::ClientError(error) => {
                        tracing::debug!(client = %name, %error, "nats client error")
                    }
                    other => tracing::info!(client = %name, event = %other, "nats event"),
                }
            }
        });
    // async-nats ignores user:password in the URL: pass them explicitly.
    if let Ok(addr) = url.parse::<async_nats::ServerAddr>()
        && let (Some(user), Some(password)) = (addr.username(), addr.password())
    {
        options = options.user_and_password(user.to_owned(), password.to_owned());
    }
    let client = options.connect(url).await.map_err(|e| NatsConnectError {
        url: redact_url(url),
        reason: e.to_string(),
    })?;
    Ok(NatsConnection {
        client,
        reconnects,
        gaps,
        closed,
    })
}

/// Flushes pending publishes and drains the connection, waiting (bounded) for
/// the Closed event: `drain()` itself returns before draining has finished.
pub async fn drain(connection: &NatsConnection, deadline: Duration) {
    let client = &connection.client;
    let _ = tokio::time::timeout(deadline, client.flush()).await;
    if let Err(error) = client.drain().await {
        tracing::warn!(%error, "nats drain failed");
        return;
    }
    let mut closed = connection.closed.clone();
    if tokio::time::timeout(deadline, closed.wait_for(|closed| *closed))
        .await
        .is_err()
    {
        tracing::warn!("nats drain did not finish before the deadline");
    }
}

/// Strips user info from a URL for error messages.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}[redacted]@{}", &url[..scheme_end + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_credentials() {
        assert_eq!(
            super::redact_url("nats://user:pw@host:4222"),
            "nats://[redacted]@host:4222"
        );
        assert_eq!(super::redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(
            super::redact_url("postgres://u:p@h/db"),
            "postgres://[redacted]@h/db"
        );
    }
}

/// Returns once the server has processed everything this client sent before
/// (subscriptions included): `flush()` only writes to the socket, so a
/// message to ourselves is the round trip that proves it.
pub async fn sync_with_server(client: &Client) -> Result<(), SyncError> {
    use futures::StreamExt;
    let inbox = client.new_inbox();
    let mut echo = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| SyncError(e.to_string()))?;
    client
        .publish(inbox, Default::default())
        .await
        .map_err(|e| SyncError(e.to_string()))?;
    let answered = tokio::time::timeout(Duration::from_secs(10), echo.next()).await;
    let _ = echo.unsubscribe().await;
    match answered {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(SyncError("subscription closed".into())),
        Err(_) => Err(SyncError("no round trip within 10 s".into())),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("nats server did not confirm the subscriptions: {0}")]
pub struct SyncError(String);

/// The subscription's next message, or `None` once it ends or `shutdown` is
/// cancelled: the loop condition of every event follower.
pub async fn next_until(
    subscriber: &mut async_nats::Subscriber,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Option<async_nats::Message> {
    use futures::StreamExt;
    tokio::select! {
        _ = shutdown.cancelled() => None,
        message = subscriber.next() => message,
    }
}
