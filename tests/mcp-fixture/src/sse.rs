//! `--http ADDR --sse`: the legacy HTTP+SSE transport (MCP 2024-11-05), which
//! rmcp 3 no longer serves. `GET /sse` opens a session's event stream and
//! sends an `endpoint` event; `POST /message?sessionId=ID` carries one
//! client message (answered 202, the reply goes on the stream). A POST to
//! `/sse` is answered 405, as a legacy server answers a streamable-HTTP client.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use futures::StreamExt as _;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use rmcp::{RoleServer, ServiceExt};
use tokio::sync::mpsc;

type Inbox = mpsc::UnboundedSender<RxJsonRpcMessage<RoleServer>>;

/// What an MCP server must be to be served here (the fixture's handler;
/// generic so this module needs nothing of the crate root).
pub(crate) trait Handler: rmcp::ServerHandler + Clone + Send + Sync + 'static {}

impl<H: rmcp::ServerHandler + Clone + Send + Sync + 'static> Handler for H {}

struct Sessions<H> {
    fixture: H,
    next: Arc<AtomicU64>,
    inboxes: Arc<Mutex<HashMap<String, Inbox>>>,
}

impl<H: Clone> Clone for Sessions<H> {
    fn clone(&self) -> Self {
        Self {
            fixture: self.fixture.clone(),
            next: self.next.clone(),
            inboxes: self.inboxes.clone(),
        }
    }
}

pub(crate) fn router<H: Handler>(fixture: H) -> axum::Router {
    let sessions = Sessions {
        fixture,
        next: Arc::new(AtomicU64::new(1)),
        inboxes: Arc::new(Mutex::new(HashMap::new())),
    };
    axum::Router::new()
        .route("/sse", axum::routing::get(open::<H>))
        .route("/message", axum::routing::post(message::<H>))
        .with_state(sessions)
}

/// One session's server side: messages in from POSTs, out to the stream.
struct Channels {
    inbox: mpsc::UnboundedReceiver<RxJsonRpcMessage<RoleServer>>,
    outbox: mpsc::UnboundedSender<TxJsonRpcMessage<RoleServer>>,
}

#[derive(Debug, thiserror::Error)]
#[error("the event stream is gone")]
struct Gone;

impl Transport<RoleServer> for Channels {
    type Error = Gone;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Gone>> + Send + 'static {
        let sent = self.outbox.send(item).map_err(|_| Gone);
        async move { sent }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        self.inbox.recv().await
    }

    async fn close(&mut self) -> Result<(), Gone> {
        self.inbox.close();
        Ok(())
    }
}

async fn open<H: Handler>(
    State(sessions): State<Sessions<H>>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let id = sessions.next.fetch_add(1, Ordering::Relaxed).to_string();
    let (inbox_tx, inbox) = mpsc::unbounded_channel();
    let (outbox, mut outbox_rx) = mpsc::unbounded_channel();
    sessions
        .inboxes
        .lock()
        .expect("sessions lock")
        .insert(id.clone(), inbox_tx);
    let fixture = sessions.fixture.clone();
    tokio::spawn(async move {
        match fixture.serve(Channels { inbox, outbox }).await {
            Ok(running) => {
                let _ = running.waiting().await;
            }
            Err(error) => eprintln!("mcp-fixture: sse handshake ended: {error}"),
        }
    });
    let endpoint = Event::default()
        .event("endpoint")
        .data(format!("/message?sessionId={id}"));
    let messages = futures::stream::poll_fn(move |cx| outbox_rx.poll_recv(cx)).map(|message| {
        Ok(Event::default()
            .event("message")
            .data(serde_json::to_string(&message).expect("a message serializes")))
    });
    Sse::new(futures::stream::once(async move { Ok(endpoint) }).chain(messages))
}

#[derive(serde::Deserialize)]
struct SessionQuery {
    #[serde(rename = "sessionId")]
    session_id: String,
}

async fn message<H: Handler>(
    State(sessions): State<Sessions<H>>,
    Query(query): Query<SessionQuery>,
    body: String,
) -> StatusCode {
    let Ok(message) = serde_json::from_str::<RxJsonRpcMessage<RoleServer>>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    let inbox = sessions
        .inboxes
        .lock()
        .expect("sessions lock")
        .get(&query.session_id)
        .cloned();
    match inbox {
        Some(inbox) if inbox.send(message).is_ok() => StatusCode::ACCEPTED,
        _ => StatusCode::NOT_FOUND,
    }
}
