//! The NATS connection every service opens: named, quick to reconnect, and
//! observable (reconnects are counted and announced to whoever needs to
//! re-check state they may have missed while disconnected; subjects the
//! server refuses this user are remembered, logged and fail readiness).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};

use crate::config::{
    CommonArgs, NATS_RESPONDER_URL_OPTION, NATS_URL_OPTION, NatsTlsArgs, NatsUrlError,
    ReplyInboxes, parse_nats_urls, parse_nats_urls_of, redact_nats_urls,
};
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
    permissions: Arc<Permissions>,
    /// The second connection (`NATS_RESPONDER_URL`) that receives requests
    /// and sends the answers, when one is configured.
    responder: Option<Box<NatsConnection>>,
    reply_inboxes: ReplyInboxes,
}

impl NatsConnection {
    /// The connection requests are received and answered on: the
    /// responder connection when one is configured, else this one.
    pub fn responder(&self) -> &NatsConnection {
        self.responder.as_deref().unwrap_or(self)
    }

    /// Where this service's answers may go.
    pub fn reply_inboxes(&self) -> &ReplyInboxes {
        &self.reply_inboxes
    }

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

    /// Ready for traffic: connected, and a round trip with the server has
    /// come back on every connection. async-nats reports a reconnect as soon
    /// as the handshake is done, before the server has read the
    /// subscriptions it sends again; until then requests to this service
    /// find no responders, so connected alone is not ready.
    pub async fn check_round_trip(&self) -> Result<(), String> {
        if !self.is_connected() {
            return Err("not connected".to_owned());
        }
        let responder = self.responder.as_deref().map(|r| &r.client);
        for client in std::iter::once(&self.client).chain(responder) {
            sync_with_server(client).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Connected (both connections, when a responder is configured).
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
            && self
                .responder
                .as_deref()
                .is_none_or(NatsConnection::is_connected)
    }

    /// The user this connection logs in as (for messages; never a password or token).
    pub fn user(&self) -> &NatsUser {
        &self.permissions.user
    }

    /// What the server refused this user since the start (publishes) or the
    /// last reconnect (subscriptions, which a reconnect sends again): `Err`
    /// naming the subjects and the user while there is any.
    pub fn permissions_check(&self) -> Result<(), String> {
        self.permissions.check()?;
        match &self.responder {
            Some(responder) => responder.permissions_check(),
            None => Ok(()),
        }
    }
}

/// The NATS user of a connection, as shown in messages: the user of
/// `user:password@` in the URL; a user part without a password is a token
/// and is never shown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsUser(Option<String>);

impl NatsUser {
    /// The user of `url`, one URL or a list (every entry that names a user
    /// names the same one).
    pub fn from_url(url: &str) -> Self {
        let user = parse_nats_urls(url).ok().and_then(|servers| {
            servers
                .iter()
                .find_map(|addr| match (addr.username(), addr.password()) {
                    (Some(user), Some(_)) => Some(user.to_owned()),
                    _ => None,
                })
        });
        Self(user)
    }

    pub fn name(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl fmt::Display for NatsUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(user) => write!(f, "user {user:?}"),
            None => f.write_str("no user"),
        }
    }
}

/// What a permissions violation refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Operation {
    Subscribe,
    Publish,
    /// Publishing with this subject as the reply subject.
    PublishReply,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Self::Subscribe => "subscribe",
            Self::Publish => "publish",
            Self::PublishReply => "publish_reply",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Subscribe => "subscribe to",
            Self::Publish => "publish to",
            Self::PublishReply => "publish with the reply subject",
        })
    }
}

/// A `-ERR 'Permissions Violation for ...'` of nats-server, parsed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Violation {
    pub operation: Operation,
    pub subject: String,
}

impl Violation {
    /// Parses nats-server's texts: `Permissions Violation for Subscription to
    /// "s"` (then ` using queue "q"` for a queue group), `... for Publish to
    /// "s"`, `... for Publish with Reply of "s"`.
    pub fn parse(text: &str) -> Option<Self> {
        const FORMS: [(&str, Operation); 3] = [
            (
                "permissions violation for subscription to ",
                Operation::Subscribe,
            ),
            ("permissions violation for publish to ", Operation::Publish),
            (
                "permissions violation for publish with reply of ",
                Operation::PublishReply,
            ),
        ];
        let text = text.trim().trim_matches('\'');
        FORMS.iter().find_map(|(prefix, operation)| {
            let head = text.get(..prefix.len())?;
            if !head.eq_ignore_ascii_case(prefix) {
                return None;
            }
            Some(Self {
                operation: *operation,
                subject: go_quoted(&text[prefix.len()..])?,
            })
        })
    }
}

/// The Go `%q` string at the start of `text`.
fn go_quoted(text: &str) -> Option<String> {
    let mut chars = text.strip_prefix('"')?.chars();
    let mut out = String::new();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => out.push(chars.next()?),
            c => out.push(c),
        }
    }
    None
}

/// Distinct refusals remembered for readiness and logged; more are counted.
const MAX_REMEMBERED_VIOLATIONS: usize = 16;

/// The permission violations the server reported to one connection.
#[derive(Debug)]
struct Permissions {
    client: String,
    user: NatsUser,
    refused: Mutex<Refused>,
}

#[derive(Debug, Default)]
struct Refused {
    seen: BTreeSet<Violation>,
    /// Distinct refusals past [`MAX_REMEMBERED_VIOLATIONS`].
    more: usize,
}

impl Permissions {
    fn refused(&self) -> std::sync::MutexGuard<'_, Refused> {
        self.refused.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, violation: Violation) {
        metrics::counter!(
            "ctxsync_nats_permission_violations_total",
            "client" => self.client.clone(),
            "operation" => violation.operation.as_str()
        )
        .increment(1);
        let mut refused = self.refused();
        if refused.seen.contains(&violation) {
            return;
        }
        if refused.seen.len() >= MAX_REMEMBERED_VIOLATIONS {
            refused.more += 1;
            if refused.more == 1 {
                tracing::error!(
                    client = %self.client,
                    nats_user = self.user.name().unwrap_or("(none)"),
                    "nats refuses this user more subjects than are listed"
                );
            }
            return;
        }
        tracing::error!(
            client = %self.client,
            nats_user = self.user.name().unwrap_or("(none)"),
            operation = %violation.operation,
            subject = %violation.subject,
            "nats refused a subject: permissions violation (check the user's permissions)"
        );
        refused.seen.insert(violation);
    }

    fn is_refused(&self, violation: &Violation) -> bool {
        self.refused().seen.contains(violation)
    }

    /// A reconnect sends every subscription again: the server judges them anew.
    fn forget_subscriptions(&self) {
        let mut refused = self.refused();
        refused.seen.retain(|v| v.operation != Operation::Subscribe);
        if refused.seen.is_empty() {
            refused.more = 0;
        }
    }

    fn check(&self) -> Result<(), String> {
        let refused = self.refused();
        if refused.seen.is_empty() && refused.more == 0 {
            return Ok(());
        }
        let listed: Vec<String> = refused
            .seen
            .iter()
            .map(|v| format!("{} {:?}", v.operation, v.subject))
            .collect();
        let mut message = format!("nats refuses {}: may not {}", self.user, listed.join(", "));
        if refused.more > 0 {
            message.push_str(&format!(" (and {} more)", refused.more));
        }
        Err(message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NatsConnectError {
    #[error(transparent)]
    Url(#[from] NatsUrlError),
    /// `url` is the whole `NATS_URL` (or `NATS_RESPONDER_URL`: `option`),
    /// credentials redacted.
    #[error("cannot connect to NATS at {url} ({option}): {reason}")]
    Connect {
        option: &'static str,
        url: String,
        reason: String,
    },
}

/// Where NATS is and how to reach it: the URL (`nats://` or `tls://`, with
/// `user:password@` when the server wants them), or a comma-separated list
/// of a cluster's URLs, and the TLS options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsTarget {
    pub url: String,
    pub tls: NatsTlsArgs,
    /// A second connection's URL, for receiving and answering requests.
    pub responder_url: Option<String>,
    pub reply_inboxes: ReplyInboxes,
}

impl From<&str> for NatsTarget {
    fn from(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            ..Self::default()
        }
    }
}

impl From<&String> for NatsTarget {
    fn from(url: &String) -> Self {
        Self::from(url.as_str())
    }
}

impl From<&CommonArgs> for NatsTarget {
    fn from(common: &CommonArgs) -> Self {
        Self {
            url: common.nats_url.clone(),
            tls: common.nats_tls.clone(),
            responder_url: common.nats_responder_url.clone(),
            reply_inboxes: common.reply_inbox_prefixes.clone(),
        }
    }
}

/// Connects once (no retry: a bad NATS_URL is a startup error), then
/// reconnects forever with a short backoff. With a list of URLs the first
/// connect tries each (in random order) until one answers, and a reconnect
/// goes to any of them or to a peer the cluster announced (async-nats adds
/// the `connect_urls` of the server's INFO to its pool). TLS is used for
/// `tls://` URLs and whenever a TLS option is set, always with rustls on ring.
///
/// With a responder URL a second connection, named `<client_name>-rpc`,
/// receives the requests the service answers (see [`NatsConnection::responder`]).
pub async fn connect(
    target: impl Into<NatsTarget>,
    client_name: &str,
) -> Result<NatsConnection, NatsConnectError> {
    let target = target.into();
    let mut connection =
        connect_one(NATS_URL_OPTION, &target.url, &target.tls, client_name).await?;
    if let Some(url) = target.responder_url.as_deref() {
        let responder = connect_one(
            NATS_RESPONDER_URL_OPTION,
            url,
            &target.tls,
            &format!("{client_name}-rpc"),
        )
        .await?;
        connection.responder = Some(Box::new(responder));
        if !target.reply_inboxes.names_tenants() {
            tracing::warn!(
                reply_inbox_prefixes = %target.reply_inboxes,
                "answers may go into any tenant's inbox: set CTXSYNC_REPLY_INBOX_PREFIXES to the tenants' own (e.g. _INBOX.chat-{{tenant}}.)"
            );
        }
    }
    connection.reply_inboxes = target.reply_inboxes;
    Ok(connection)
}

async fn connect_one(
    option: &'static str,
    url: &str,
    tls: &NatsTlsArgs,
    client_name: &str,
) -> Result<NatsConnection, NatsConnectError> {
    ctxsync_tls::install_default_provider();
    let servers = parse_nats_urls_of(option, url)?;
    // Connect errors name the env var alone (`NATS_URL`), as operators set it.
    let option = option.split(' ').next().unwrap_or(option);
    // The recorder first: a series recorded before it is installed is lost.
    let _ = crate::metrics::handle();
    // Present from the start, so `increase()` alerts see the first reconnect.
    metrics::counter!("ctxsync_nats_reconnects_total", "client" => client_name.to_owned())
        .increment(0);
    let (reconnect_tx, reconnects) = watch::channel(0u64);
    let (gap_tx, gaps) = watch::channel(0u64);
    let (closed_tx, closed) = watch::channel(false);
    let seen_connect = Arc::new(AtomicBool::new(false));
    let name = client_name.to_owned();
    for operation in [Operation::Publish, Operation::Subscribe] {
        metrics::counter!("ctxsync_nats_permission_violations_total", "client" => client_name.to_owned(), "operation" => operation.as_str())
            .increment(0);
    }
    metrics::counter!("ctxsync_nats_slow_consumer_total", "client" => client_name.to_owned())
        .increment(0);
    let permissions = Arc::new(Permissions {
        client: client_name.to_owned(),
        user: NatsUser::from_url(url),
        refused: Mutex::default(),
    });
    let on_event = permissions.clone();
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
            let permissions = on_event.clone();
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
                        permissions.forget_subscriptions();
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
                    Event::ServerError(async_nats::ServerError::Other(text)) => {
                        match Violation::parse(&text) {
                            Some(violation) => permissions.record(violation),
                            None => tracing::warn!(client = %name, error = %text, "nats server error"),
                        }
                    }
                    Event::ServerError(error) => {
                        tracing::warn!(client = %name, %error, "nats server error")
                    }
                    other => tracing::info!(client = %name, event = %other, "nats event"),
                }
            }
        });
    let tls_url = servers.iter().any(|addr| addr.tls_required());
    if tls_url || tls.is_set() {
        // Our config rather than async-nats' own: ring, explicitly.
        let config = match tls.client_config() {
            Ok(Some(config)) => Ok(config),
            Ok(None) => ctxsync_tls::client_config(None, None),
            Err(error) => Err(error),
        }
        .map_err(|error| NatsConnectError::Connect {
            option,
            url: redact_nats_urls(url),
            reason: error.to_string(),
        })?;
        options = options.tls_client_config(config).require_tls(true);
    }
    // async-nats ignores user:password in the URL: pass them explicitly
    // (every entry that names them names the same, `parse_nats_urls` checks).
    if let Some((user, password)) = servers
        .iter()
        .find_map(|addr| Some((addr.username()?, addr.password()?)))
    {
        options = options.user_and_password(user.to_owned(), password.to_owned());
    }
    let client = options
        .connect(servers)
        .await
        .map_err(|e| NatsConnectError::Connect {
            option,
            url: redact_nats_urls(url),
            reason: e.to_string(),
        })?;
    Ok(NatsConnection {
        client,
        reconnects,
        gaps,
        closed,
        permissions,
        responder: None,
        reply_inboxes: ReplyInboxes::default(),
    })
}

/// Flushes pending publishes and drains the connection, waiting (bounded) for
/// the Closed event: `drain()` itself returns before draining has finished.
pub async fn drain(connection: &NatsConnection, deadline: Duration) {
    if let Some(responder) = &connection.responder {
        Box::pin(drain(responder, deadline)).await;
    }
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

/// Kept here too: callers know it as the NATS URL redaction.
pub use crate::config::redact_url;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_servers_permission_violations() {
        let parsed = |text: &str| Violation::parse(text).map(|v| (v.operation, v.subject));
        assert_eq!(
            parsed(r#"Permissions Violation for Subscription to "a.b.>""#),
            Some((Operation::Subscribe, "a.b.>".into()))
        );
        assert_eq!(
            parsed(r#"Permissions Violation for Subscription to "a.b" using queue "store""#),
            Some((Operation::Subscribe, "a.b".into()))
        );
        assert_eq!(
            parsed(r#"'Permissions Violation for Publish to "x.\"y"'"#),
            Some((Operation::Publish, r#"x."y"#.into()))
        );
        assert_eq!(
            parsed(r#"permissions violation for publish with reply of "_INBOX.a.b""#),
            Some((Operation::PublishReply, "_INBOX.a.b".into()))
        );
        assert_eq!(parsed("Authorization Violation"), None);
        assert_eq!(
            parsed(r#"Permissions Violation for Publish to "unterminated"#),
            None
        );
    }

    #[test]
    fn the_user_comes_from_the_url_without_password_or_token() {
        assert_eq!(
            NatsUser::from_url("nats://gate:secret@host:4222").to_string(),
            "user \"gate\""
        );
        assert_eq!(
            NatsUser::from_url("nats://host:4222").to_string(),
            "no user"
        );
        // A user part alone is a token.
        assert_eq!(
            NatsUser::from_url("nats://s3cr3t@host:4222").to_string(),
            "no user"
        );
    }

    #[test]
    fn refusals_fail_the_check_naming_the_subjects_and_the_user() {
        let permissions = Permissions {
            client: "test".into(),
            user: NatsUser(Some("store".into())),
            refused: Mutex::default(),
        };
        assert_eq!(permissions.check(), Ok(()));
        let violation = |operation, subject: &str| Violation {
            operation,
            subject: subject.into(),
        };
        permissions.record(violation(Operation::Subscribe, "p.store.>"));
        permissions.record(violation(Operation::Publish, "p.snapshot.a"));
        permissions.record(violation(Operation::Publish, "p.snapshot.a"));
        assert_eq!(
            permissions.check(),
            Err(
                "nats refuses user \"store\": may not subscribe to \"p.store.>\", \
                 publish to \"p.snapshot.a\""
                    .into()
            )
        );
        for i in 0..MAX_REMEMBERED_VIOLATIONS + 5 {
            permissions.record(violation(Operation::Publish, &format!("p.x.{i}")));
        }
        assert!(permissions.check().unwrap_err().ends_with("(and 7 more)"));
        // A reconnect subscribes again; refused publishes stay.
        permissions.forget_subscriptions();
        let message = permissions.check().unwrap_err();
        assert!(!message.contains("p.store.>"), "{message}");
        assert!(message.contains("publish to \"p.snapshot.a\""), "{message}");
    }

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

/// The longest a stop's round trip before a drain ([`drain_delivered`]) may
/// hold it up: a slow server delays a stop by this much at most.
pub const DRAIN_ROUND_TRIP_BOUND: Duration = Duration::from_secs(1);

/// Unsubscribes `subscriber` (of `client`) once everything the server routed
/// to it so far has arrived, so its stream yields those messages and then
/// ends. async-nats' own drain sends UNSUB and forgets the subscription on
/// its next turn without waiting for the server: what is still in the socket
/// would be lost. A round trip first (skipped when disconnected, when nothing
/// more can arrive; at most `bound`) puts it in the subscription. What the
/// server routes here between the round trip's echo and its reading of the
/// UNSUB (one turn of this client, well under a millisecond on a healthy
/// connection) can still be lost: async-nats offers no UNSUB that keeps the
/// subscription until the server confirms it.
pub async fn drain_delivered(
    client: &Client,
    subscriber: &mut async_nats::Subscriber,
    bound: Duration,
) -> Result<(), async_nats::UnsubscribeError> {
    if client.connection_state() == async_nats::connection::State::Connected {
        let synced = tokio::time::timeout(bound, sync_with_server(client)).await;
        if !matches!(synced, Ok(Ok(()))) {
            tracing::debug!("no round trip with nats before a drain: late messages may be missed");
        }
    }
    subscriber.drain().await
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

#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("nats refused the subscription to {subject:?} ({user}): permissions violation")]
    Refused { subject: String, user: NatsUser },
    #[error("cannot subscribe to {subject:?} ({user}): {reason}")]
    Failed {
        subject: String,
        user: NatsUser,
        reason: String,
    },
}

/// Subscribes to `subject` (in `queue_group` when given) and returns once
/// the server has it, or the server's refusal: every subscription a service
/// makes at start goes through here, so a user without the permission stops
/// the start instead of waiting for messages that never come.
pub async fn subscribe(
    connection: &NatsConnection,
    subject: String,
    queue_group: Option<&str>,
) -> Result<async_nats::Subscriber, SubscribeError> {
    let failed = |reason: String| SubscribeError::Failed {
        subject: subject.clone(),
        user: connection.user().clone(),
        reason,
    };
    let client = &connection.client;
    let subscriber = match queue_group {
        Some(group) => {
            client
                .queue_subscribe(subject.clone(), group.to_owned())
                .await
        }
        None => client.subscribe(subject.clone()).await,
    }
    .map_err(|e| failed(e.to_string()))?;
    let violation = Violation {
        operation: Operation::Subscribe,
        subject: subject.clone(),
    };
    // The server's `-ERR` precedes the round trip's echo on the socket, but
    // async-nats hands it to the event callback on a task of its own: a
    // second round trip gives that task its turn before the last look.
    for _ in 0..2 {
        sync_with_server(client)
            .await
            .map_err(|e| failed(e.to_string()))?;
        if connection.permissions.is_refused(&violation) {
            return Err(SubscribeError::Refused {
                subject,
                user: connection.user().clone(),
            });
        }
    }
    Ok(subscriber)
}

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
