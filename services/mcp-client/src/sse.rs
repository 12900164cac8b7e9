//! The legacy HTTP+SSE client transport (MCP 2024-11-05), which rmcp 3 no
//! longer ships: `GET url` opens an event stream whose first `endpoint`
//! event names the URL to POST messages to; the server's messages arrive as
//! `message` events on the stream. Events are parsed by `sse-stream` (the
//! parser rmcp itself uses); rmcp's client runs on top unchanged.
//!
//! * The endpoint must be on the stream's origin (scheme, host, port): the
//!   configured headers carry credentials, and a server cannot send them
//!   elsewhere.
//! * An event is at most [`MAX_EVENT_BYTES`], counted on the raw stream
//!   before the parser buffers it; a bigger one ends the session.

use std::borrow::Cow;
use std::collections::HashMap;

use futures::StreamExt as _;
use rmcp::RoleClient;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use sse_stream::SseStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::error::chain;

/// The largest server message taken from the stream.
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;
/// Server messages read ahead of the client.
const QUEUE: usize = 64;

/// Why the SSE transport failed; the text may name the URL (sanitize it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SseError(pub String);

/// A connected legacy SSE session.
pub struct SseTransport {
    client: reqwest::Client,
    post_url: url::Url,
    headers: reqwest::header::HeaderMap,
    incoming: mpsc::Receiver<RxJsonRpcMessage<RoleClient>>,
    reader: JoinHandle<()>,
}

impl SseTransport {
    /// Opens the stream and waits for its `endpoint` event (bound it with
    /// the caller's handshake timeout).
    pub async fn connect(
        client: reqwest::Client,
        url: &str,
        headers: HashMap<http::HeaderName, http::HeaderValue>,
    ) -> Result<SseTransport, SseError> {
        let stream_url = url::Url::parse(url)
            .map_err(|error| SseError(format!("url {url} is not valid: {error}")))?;
        let headers: reqwest::header::HeaderMap = headers.into_iter().collect();
        let response = client
            .get(stream_url.clone())
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .headers(headers.clone())
            .send()
            .await
            .map_err(|error| SseError(format!("GET {stream_url}: {}", chain(&error))))?;
        let status = response.status();
        if !status.is_success() {
            return Err(SseError(format!("GET {stream_url} answered HTTP {status}")));
        }
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        if !content_type.starts_with("text/event-stream") {
            return Err(SseError(format!(
                "GET {stream_url} answered {content_type:?}, not an event stream (text/event-stream)"
            )));
        }
        let mut events = SseStream::from_bytes_stream(bounded(response.bytes_stream()));
        let endpoint = loop {
            match events.next().await {
                None => {
                    return Err(SseError(format!(
                        "the event stream of {stream_url} ended before its endpoint event"
                    )));
                }
                Some(Err(error)) => {
                    return Err(SseError(format!(
                        "reading the event stream of {stream_url}: {error}"
                    )));
                }
                Some(Ok(event)) if event.event.as_deref() == Some("endpoint") => {
                    break event.data.unwrap_or_default();
                }
                // Comments, keep-alives and anything before the endpoint.
                Some(Ok(_)) => continue,
            }
        };
        let post_url = stream_url.join(endpoint.trim()).map_err(|error| {
            SseError(format!(
                "the endpoint event of {stream_url} is not a URL: {error}"
            ))
        })?;
        if post_url.origin() != stream_url.origin() {
            return Err(SseError(format!(
                "the endpoint event of {stream_url} points to another origin ({}): refused",
                post_url.origin().ascii_serialization()
            )));
        }
        let (sender, incoming) = mpsc::channel(QUEUE);
        let reader = tokio::spawn(async move {
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(_) => {
                        // The error may name the URL (a secret): not logged.
                        tracing::warn!("sse stream ended: broken, or an event over the limit");
                        break;
                    }
                };
                if !matches!(event.event.as_deref(), None | Some("message")) {
                    continue;
                }
                let Some(data) = event.data else { continue };
                match serde_json::from_str::<RxJsonRpcMessage<RoleClient>>(&data) {
                    Ok(message) => {
                        if sender.send(message).await.is_err() {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::debug!(%error, "sse message is not JSON-RPC; skipped");
                    }
                }
            }
        });
        Ok(SseTransport {
            client,
            post_url,
            headers,
            incoming,
            reader,
        })
    }
}

/// The body's bytes, cut off with an error once more than
/// [`MAX_EVENT_BYTES`] arrive without an event boundary (a blank line).
fn bounded(
    body: impl futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>>,
) -> impl futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> {
    body.scan(0usize, |since_boundary, chunk| {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => return std::future::ready(Some(Err(std::io::Error::other(error)))),
        };
        *since_boundary = match last_blank_line_end(&chunk) {
            Some(end) => chunk.len() - end,
            None => *since_boundary + chunk.len(),
        };
        if *since_boundary > MAX_EVENT_BYTES {
            return std::future::ready(Some(Err(std::io::Error::other(format!(
                "an event is over {MAX_EVENT_BYTES} bytes"
            )))));
        }
        std::future::ready(Some(Ok(chunk)))
    })
}

/// Where the last blank line (`\n\n` or `\n\r\n`) in `chunk` ends.
fn last_blank_line_end(chunk: &[u8]) -> Option<usize> {
    (1..chunk.len()).rev().find_map(|i| {
        let ends_line = chunk[i] == b'\n';
        let before = if chunk[i - 1] == b'\r' && i >= 2 {
            chunk[i - 2]
        } else {
            chunk[i - 1]
        };
        (ends_line && before == b'\n').then_some(i + 1)
    })
}

impl Transport<RoleClient> for SseTransport {
    type Error = SseError;

    fn name() -> Cow<'static, str> {
        "legacy HTTP+SSE".into()
    }

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), SseError>> + Send + 'static {
        let request = self
            .client
            .post(self.post_url.clone())
            .headers(self.headers.clone())
            .json(&item);
        let url = self.post_url.clone();
        async move {
            let response = request
                .send()
                .await
                .map_err(|error| SseError(format!("POST {url}: {}", chain(&error))))?;
            let status = response.status();
            if status.is_success() {
                Ok(())
            } else {
                Err(SseError(format!("POST {url} answered HTTP {status}")))
            }
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleClient>> {
        self.incoming.recv().await
    }

    async fn close(&mut self) -> Result<(), SseError> {
        self.reader.abort();
        self.incoming.close();
        Ok(())
    }
}

impl Drop for SseTransport {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blank_lines_end_events_with_either_line_ending() {
        assert_eq!(last_blank_line_end(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(last_blank_line_end(b"data: a\r\n\r\nxy"), Some(11));
        assert_eq!(last_blank_line_end(b"data: a\ndata: b\n"), None);
        assert_eq!(last_blank_line_end(b"data: a\r\ndata: b\r\n"), None);
    }
}
