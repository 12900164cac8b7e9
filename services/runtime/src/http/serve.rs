//! The accept loop and per-connection watch behind [`super::HttpServer`].
//!
//! hyper's own header read timeout also runs between requests of a kept-alive
//! connection (so idle could never outlast it) and nothing in hyper or
//! tower-http bounds a body's total arrival, so each connection is watched here:
//!
//! * header timeout: a new connection must send a complete request head
//!   within it; a later request's head, within it of its first byte;
//! * idle timeout: a kept-alive connection with no request in flight and no
//!   byte of a next request is closed after it;
//! * body timeout: a body not read to its end within it of the head is
//!   answered 408 and the connection closed;
//! * at most `max_connections` are served at once; past it the listener stops
//!   accepting (the kernel's backlog holds the rest) until one closes;
//! * with TLS, the handshake counts against the header timeout of the first
//!   request: a client that stalls the handshake is closed just the same.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

use crate::config::HttpLimits;
use crate::shutdown::Shutdown;

/// How long the listener pauses after an accept error that is not about one
/// connection (out of file descriptors, say), instead of spinning on it.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// At most one warning per this interval while the connection bound is reached.
const LIMIT_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown`; then stops accepting, closes
/// connections with no request in flight and waits for the others' requests.
pub(super) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: Shutdown,
) {
    let label: Arc<str> = listener
        .local_addr()
        .map(|addr| addr.to_string())
        .unwrap_or_default()
        .into();
    // Present from the start, so `increase()` alerts see the first one.
    metrics::counter!("ctxsync_http_connection_limit_waits_total", "listener" => label.to_string())
        .increment(0);
    metrics::counter!("ctxsync_http_accept_errors_total", "listener" => label.to_string())
        .increment(0);
    metrics::gauge!("ctxsync_http_connections_open", "listener" => label.to_string())
        .increment(0.0);
    for timeout in Timeout::ALL {
        metrics::counter!(
            "ctxsync_http_timeouts_total",
            "listener" => label.to_string(),
            "timeout" => timeout.as_str()
        )
        .increment(0);
    }
    metrics::counter!("ctxsync_http_tls_handshake_failures_total", "listener" => label.to_string())
        .increment(0);
    let tls = limits.tls().map(|tls| TlsAcceptor::from(tls.config()));
    let slots = Arc::new(Semaphore::new(limits.max_connections()));
    let connections = TaskTracker::new();
    let mut last_limit_warning: Option<Instant> = None;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                metrics::counter!("ctxsync_http_connection_limit_waits_total", "listener" => label.to_string())
                    .increment(1);
                if last_limit_warning.is_none_or(|at| at.elapsed() >= LIMIT_WARNING_INTERVAL) {
                    last_limit_warning = Some(Instant::now());
                    tracing::warn!(
                        listener = %label,
                        max_connections = limits.max_connections(),
                        "http connection limit reached: not accepting until a connection closes \
                         (CTXSYNC_HTTP_MAX_CONNECTIONS)"
                    );
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    slot = slots.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break,
                    },
                }
            }
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    if !is_connection_error(&error) {
                        metrics::counter!("ctxsync_http_accept_errors_total", "listener" => label.to_string())
                            .increment(1);
                        tracing::error!(listener = %label, %error, "cannot accept http connections");
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => {}
                        }
                    }
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(serve_connection(
            stream,
            tls.clone(),
            app.clone(),
            limits.clone(),
            shutdown.clone(),
            slot,
            label.clone(),
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Errors of one connection that the peer caused; the listener is fine.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timeout {
    Header,
    Body,
    Idle,
}

impl Timeout {
    const ALL: [Self; 3] = [Self::Header, Self::Body, Self::Idle];

    fn as_str(self) -> &'static str {
        match self {
            Self::Header => "header",
            Self::Body => "body",
            Self::Idle => "idle",
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    app: Router,
    limits: HttpLimits,
    shutdown: Shutdown,
    _slot: OwnedSemaphorePermit,
    label: Arc<str>,
) {
    let _open = OpenConnection::new(&label);
    // From the accept: a TLS handshake spends the first head's header timeout.
    let activity = Arc::new(Activity::new());
    let Some(acceptor) = tls else {
        return serve_http(stream, activity, app, &limits, shutdown, label).await;
    };
    let deadline = activity
        .deadline(&limits)
        .map_or_else(Instant::now, |(at, _)| at);
    let handshake = tokio::select! {
        _ = shutdown.cancelled() => return,
        handshake = tokio::time::timeout_at(deadline, acceptor.accept(stream)) => handshake,
    };
    match handshake {
        Ok(Ok(stream)) => serve_http(stream, activity, app, &limits, shutdown, label).await,
        Ok(Err(error)) => {
            metrics::counter!("ctxsync_http_tls_handshake_failures_total", "listener" => label.to_string())
                .increment(1);
            tracing::debug!(listener = %label, %error, "tls handshake failed");
        }
        Err(_) => {
            metrics::counter!(
                "ctxsync_http_timeouts_total",
                "listener" => label.to_string(),
                "timeout" => Timeout::Header.as_str()
            )
            .increment(1);
            tracing::debug!(listener = %label, "tls handshake did not finish within the header timeout");
        }
    }
}

/// Serves HTTP/1.1 on `stream` (the socket, or the TLS session over it).
async fn serve_http<S>(
    stream: S,
    activity: Arc<Activity>,
    app: Router,
    limits: &HttpLimits,
    shutdown: Shutdown,
    label: Arc<str>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let body_timeout = limits.body_timeout();
    let io = TokioIo::new(WatchedStream {
        stream,
        activity: activity.clone(),
    });
    let service = {
        let activity = activity.clone();
        let label = label.clone();
        hyper::service::service_fn(move |request| {
            // Called as soon as the head is parsed: from here the request is in flight.
            let in_flight = activity.request_started();
            handle(app.clone(), request, body_timeout, in_flight, label.clone())
        })
    };
    let connection = hyper::server::conn::http1::Builder::new()
        // Replaced by `Activity`'s deadlines (see the module comment).
        .header_read_timeout(None)
        .serve_connection(io, service);
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        let changed = activity.changed.notified();
        let deadline = activity.deadline(limits);
        if draining && deadline.is_some() {
            // Shutting down and no request in flight: nothing to finish.
            break;
        }
        tokio::select! {
            served = connection.as_mut() => {
                if let Err(error) = served {
                    tracing::debug!(listener = %label, %error, "http connection ended with an error");
                }
                break;
            }
            () = changed => {}
            () = sleep_until(deadline.map(|(at, _)| at)) => {
                if let Some((at, timeout)) = activity.deadline(limits)
                    && at <= Instant::now()
                {
                    metrics::counter!(
                        "ctxsync_http_timeouts_total",
                        "listener" => label.to_string(),
                        "timeout" => timeout.as_str()
                    )
                    .increment(1);
                    tracing::debug!(listener = %label, timeout = timeout.as_str(), "http connection closed by its timeout");
                    break;
                }
            }
            _ = shutdown.cancelled(), if !draining => {
                draining = true;
                // Closes the connection once its request in flight is answered.
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One request: the app's answer, or 408 when the body has not been read to
/// its end within `body_timeout` and the app has not answered yet; either
/// with `X-Content-Type-Options: nosniff`.
async fn handle(
    app: Router,
    request: Request<Incoming>,
    body_timeout: Duration,
    in_flight: InFlight,
    label: Arc<str>,
) -> Result<Response<InFlightBody>, Infallible> {
    let (parts, body) = request.into_parts();
    let response = if body.is_end_stream() {
        app.oneshot(Request::from_parts(parts, Body::new(body)))
            .await
    } else {
        let arrived = Arc::new(AtomicBool::new(false));
        let body = Body::new(ArrivalBody {
            inner: body,
            arrived: arrived.clone(),
        });
        let call = app.oneshot(Request::from_parts(parts, body));
        tokio::pin!(call);
        tokio::select! {
            biased;
            response = &mut call => response,
            () = tokio::time::sleep(body_timeout) => {
                if arrived.load(Ordering::Acquire) {
                    call.await
                } else {
                    // Nothing was done with a body that never arrived: the
                    // handler is dropped with it.
                    metrics::counter!(
                        "ctxsync_http_timeouts_total",
                        "listener" => label.to_string(),
                        "timeout" => Timeout::Body.as_str()
                    )
                    .increment(1);
                    tracing::debug!(listener = %label, "request body did not arrive in time: 408");
                    Ok(body_timed_out(body_timeout))
                }
            }
        }
    };
    let mut response = match response {
        Ok(response) => response,
        Err(never) => match never {},
    };
    // Every answer of every listener, errors and 408s included: a browser
    // never renders a JSON error or an event stream as something else.
    response.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    Ok(response.map(|body| InFlightBody {
        inner: body,
        _in_flight: in_flight,
    }))
}

fn body_timed_out(body_timeout: Duration) -> axum::response::Response {
    let message = format!(
        "the request body did not arrive within {} (CTXSYNC_HTTP_BODY_TIMEOUT)",
        humantime::format_duration(body_timeout)
    );
    let mut response = (
        StatusCode::REQUEST_TIMEOUT,
        axum::Json(serde_json::json!({
            "error": { "code": "request_timeout", "message": message }
        })),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// What a connection is doing, for its deadlines.
struct Activity {
    state: Mutex<ActivityState>,
    /// Woken on every change, so the connection's deadline is recomputed.
    changed: Notify,
}

struct ActivityState {
    in_flight: usize,
    /// A request has been received on this connection.
    served: bool,
    /// The accept, or the end of the last request.
    since: Instant,
    /// The first byte of the next request head, while none is in flight.
    head_started: Option<Instant>,
    /// Bytes arrived while a request was in flight (pipelined or early).
    read_while_busy: bool,
}

impl Activity {
    fn new() -> Self {
        Self {
            state: Mutex::new(ActivityState {
                in_flight: 0,
                served: false,
                since: Instant::now(),
                head_started: None,
                read_while_busy: false,
            }),
            changed: Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        // The state stays consistent even if a holder panicked: every update is one assignment.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the connection is to be closed unless something changes; `None`
    /// while a request is in flight (the body timeout and the handler govern).
    fn deadline(&self, limits: &HttpLimits) -> Option<(Instant, Timeout)> {
        let state = self.state();
        if state.in_flight > 0 {
            None
        } else if !state.served {
            Some((state.since + limits.header_timeout(), Timeout::Header))
        } else if let Some(started) = state.head_started {
            Some((started + limits.header_timeout(), Timeout::Header))
        } else {
            Some((state.since + limits.idle_timeout(), Timeout::Idle))
        }
    }

    fn bytes_read(&self) {
        let mut state = self.state();
        if state.in_flight > 0 {
            state.read_while_busy = true;
        } else if state.head_started.is_none() {
            state.head_started = Some(Instant::now());
            drop(state);
            self.changed.notify_one();
        }
    }

    fn request_started(self: &Arc<Self>) -> InFlight {
        {
            let mut state = self.state();
            state.in_flight += 1;
            state.served = true;
            state.head_started = None;
        }
        self.changed.notify_one();
        InFlight(self.clone())
    }
}

/// A request in flight, until its response has been written (or dropped).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut state = self.0.state();
            state.in_flight = state.in_flight.saturating_sub(1);
            if state.in_flight == 0 {
                let now = Instant::now();
                state.since = now;
                if std::mem::take(&mut state.read_while_busy) {
                    state.head_started = Some(now);
                }
            }
        }
        self.0.changed.notify_one();
    }
}

/// The response body, holding its request in flight until hyper has written it.
struct InFlightBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for InFlightBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that notes when it has been read to its end.
struct ArrivalBody {
    inner: Incoming,
    arrived: Arc<AtomicBool>,
}

impl HttpBody for ArrivalBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            self.arrived.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket (or TLS session), reporting arriving bytes to the connection's
/// [`Activity`].
struct WatchedStream<S> {
    stream: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for WatchedStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.bytes_read();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WatchedStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Counts an open connection in `ctxsync_http_connections_open` while alive.
struct OpenConnection(String);

impl OpenConnection {
    fn new(label: &str) -> Self {
        metrics::gauge!("ctxsync_http_connections_open", "listener" => label.to_owned())
            .increment(1.0);
        Self(label.to_owned())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics::gauge!("ctxsync_http_connections_open", "listener" => self.0.clone())
            .decrement(1.0);
    }
}

/// Raises the soft limit of open files to the hard limit, once per process
/// (as Go does since 1.19): every connection and client is a descriptor, and
/// the soft default (often 1024) is what 300 idle clients exhausted.
pub(super) fn raise_open_files_limit() {
    static RAISED: Once = Once::new();
    RAISED.call_once(|| {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        match getrlimit(Resource::RLIMIT_NOFILE) {
            Ok((soft, hard)) if soft < hard => {
                match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                    Ok(()) => tracing::debug!(
                        from = soft,
                        to = hard,
                        "raised the open files limit to its hard limit"
                    ),
                    Err(error) => tracing::debug!(
                        soft,
                        hard,
                        %error,
                        "cannot raise the open files limit"
                    ),
                }
            }
            Ok((soft, _)) => {
                tracing::debug!(limit = soft, "the open files limit is at its hard limit")
            }
            Err(error) => tracing::debug!(%error, "cannot read the open files limit"),
        }
    });
}
