//! The HTTP listener's bounds, over real sockets: slow or silent clients are
//! closed by their timeouts without starving real requests, a trickled body
//! is answered 408, the connection bound holds, shutdown still finishes
//! the requests in flight, and every answer says `nosniff`.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::{get, post};
use ctxsync_runtime::config::HttpLimits;
use ctxsync_runtime::{HttpServer, Readiness, Shutdown};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(10);

fn limits(header: Duration, body: Duration, idle: Duration, max_connections: usize) -> HttpLimits {
    HttpLimits::new(header, body, idle, max_connections).expect("valid test limits")
}

/// Routes for the tests: `/echo` answers the body's length; `/hold` reports
/// that it was entered, then waits for `release`; `/read-then-hold` reads its
/// body first.
#[derive(Clone)]
struct Hold {
    entered: mpsc::UnboundedSender<()>,
    release: Arc<Notify>,
}

struct Server {
    http: HttpServer,
    shutdown: Shutdown,
    entered: mpsc::UnboundedReceiver<()>,
    release: Arc<Notify>,
}

impl Server {
    async fn start(limits: HttpLimits) -> Self {
        let (entered_tx, entered) = mpsc::unbounded_channel();
        let release = Arc::new(Notify::new());
        let hold = Hold {
            entered: entered_tx,
            release: release.clone(),
        };
        let routes = axum::Router::new()
            .route(
                "/echo",
                post(|body: Bytes| async move { format!("{}", body.len()) }),
            )
            .route(
                "/hold",
                get({
                    let hold = hold.clone();
                    move || async move {
                        let _ = hold.entered.send(());
                        hold.release.notified().await;
                        "released"
                    }
                }),
            )
            .route(
                "/read-then-hold",
                post(move |body: Bytes| async move {
                    let _ = hold.entered.send(());
                    hold.release.notified().await;
                    format!("{}", body.len())
                }),
            );
        let shutdown = Shutdown::new();
        let http = HttpServer::start(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            limits,
            routes,
            Readiness::new(),
            shutdown.clone(),
        )
        .await
        .expect("listener binds");
        Self {
            http,
            shutdown,
            entered,
            release,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.http.local_addr()
    }

    async fn connect(&self) -> TcpStream {
        TcpStream::connect(self.addr()).await.expect("connects")
    }

    /// This listener's value of a counter or gauge, from the process's recorder.
    fn metric(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        let listener = format!("listener=\"{}\"", self.addr());
        let rendered = ctxsync_runtime::metrics::handle().render();
        rendered
            .lines()
            .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(&listener))
            .filter(|line| label.is_none_or(|(k, v)| line.contains(&format!("{k}=\"{v}\""))))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn until_metric(&self, name: &str, label: Option<(&str, &str)>, at_least: f64) {
        let reached = tokio::time::timeout(DEADLINE, async {
            while self.metric(name, label) < at_least {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            reached.is_ok(),
            "{name} {label:?} stayed at {} (< {at_least})",
            self.metric(name, label)
        );
    }
}

#[derive(Debug)]
struct RawResponse {
    status: u16,
    head: String,
    body: String,
}

/// Reads one response with a Content-Length body.
async fn read_response(stream: &mut (impl AsyncRead + Unpin)) -> io::Result<RawResponse> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "closed before a response head: {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .expect("a content-length");
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok(RawResponse {
        status,
        head,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Waits (bounded) for the server to close `stream`: EOF, or a reset when
/// it closed with bytes unread.
async fn closed_by_server(
    stream: &mut (impl AsyncRead + Unpin),
    within: Duration,
) -> Result<(), String> {
    let mut chunk = [0u8; 1024];
    match tokio::time::timeout(within, stream.read(&mut chunk)).await {
        Err(_) => Err(format!("still open after {within:?}")),
        Ok(Ok(0)) => Ok(()),
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionReset => Ok(()),
        Ok(Ok(n)) => Err(format!(
            "unexpected bytes: {:?}",
            String::from_utf8_lossy(&chunk[..n])
        )),
        Ok(Err(e)) => Err(format!("read failed: {e}")),
    }
}

async fn get_healthz(stream: &mut TcpStream, close: bool) -> RawResponse {
    let connection = if close { "close" } else { "keep-alive" };
    stream
        .write_all(
            format!("GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: {connection}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .expect("request sent");
    tokio::time::timeout(DEADLINE, read_response(stream))
        .await
        .expect("answered in time")
        .expect("a response")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_connections_do_not_starve_a_real_request_and_are_closed_after_the_header_timeout()
 {
    let header_timeout = Duration::from_secs(3);
    let server = Server::start(limits(
        header_timeout,
        Duration::from_secs(30),
        Duration::from_secs(60),
        1024,
    ))
    .await;

    // 300 clients: half send nothing, half a request head that never ends.
    let mut idle = Vec::new();
    for i in 0..300 {
        let opened = Instant::now();
        let mut stream = server.connect().await;
        if i % 2 == 1 {
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: ")
                .await
                .expect("partial head sent");
        }
        idle.push((opened, stream));
    }
    server
        .until_metric("ctxsync_http_connections_open", None, 300.0)
        .await;

    // A real client on the same listener is answered at once, well before
    // any of the idle connections times out.
    let asked = Instant::now();
    let mut real = server.connect().await;
    let answer = get_healthz(&mut real, true).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body, "ok\n");
    assert!(
        asked.elapsed() < header_timeout / 2,
        "the real request took {:?} with 300 idle connections open",
        asked.elapsed()
    );

    // Every idle connection is closed by the server, after the header timeout.
    let closures = idle.into_iter().map(|(opened, mut stream)| async move {
        let closed = closed_by_server(&mut stream, header_timeout + DEADLINE).await;
        (closed, opened.elapsed())
    });
    for (i, (closed, after)) in futures::future::join_all(closures)
        .await
        .into_iter()
        .enumerate()
    {
        assert_eq!(closed, Ok(()), "idle connection {i}");
        assert!(
            after >= header_timeout,
            "idle connection {i} was closed after {after:?}, before the header timeout"
        );
    }
    assert!(
        server.metric("ctxsync_http_timeouts_total", Some(("timeout", "header"))) >= 300.0,
        "header timeouts are counted"
    );
    server.shutdown.cancel();
    tokio::time::timeout(DEADLINE, server.http.join())
        .await
        .expect("the listener stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_idles_for_the_idle_timeout_and_a_started_head_gets_the_header_timeout()
 {
    let header_timeout = Duration::from_millis(300);
    let idle_timeout = Duration::from_secs(3);
    let server = Server::start(limits(
        header_timeout,
        Duration::from_secs(30),
        idle_timeout,
        16,
    ))
    .await;

    // Idle after an answered request: closed after the idle timeout, not the
    // (shorter) header timeout.
    let mut kept = server.connect().await;
    // Before the request: the server's idle time starts after it.
    let answered = Instant::now();
    assert_eq!(get_healthz(&mut kept, false).await.status, 200);
    assert_eq!(
        closed_by_server(&mut kept, idle_timeout + DEADLINE).await,
        Ok(())
    );
    assert!(
        answered.elapsed() >= idle_timeout,
        "an idle kept-alive connection was closed after {:?}",
        answered.elapsed()
    );

    // A second request's head that stops half-way: closed after the header
    // timeout from its first byte, long before the idle timeout.
    let mut slow = server.connect().await;
    assert_eq!(get_healthz(&mut slow, false).await.status, 200);
    let started = Instant::now();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: te")
        .await
        .unwrap();
    assert_eq!(closed_by_server(&mut slow, DEADLINE).await, Ok(()));
    assert!(
        started.elapsed() >= header_timeout && started.elapsed() < idle_timeout,
        "a half-sent second head was closed after {:?}",
        started.elapsed()
    );
    assert!(server.metric("ctxsync_http_timeouts_total", Some(("timeout", "idle"))) >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_answered_408_and_the_connection_closed() {
    let body_timeout = Duration::from_secs(1);
    let server = Server::start(limits(
        Duration::from_secs(5),
        body_timeout,
        Duration::from_secs(60),
        16,
    ))
    .await;

    // A body that arrives in time is served.
    let mut prompt = server.connect().await;
    prompt
        .write_all(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\n\r\nhello")
        .await
        .unwrap();
    let answer = read_response(&mut prompt).await.unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (200, "5"));

    // One byte every 100 ms: each well within the timeout, the whole not.
    let stream = server.connect().await;
    let (mut reader, mut writer) = stream.into_split();
    let sent = Instant::now();
    writer
        .write_all(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        for _ in 0..1000 {
            if writer.write_all(b"a").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let answer = tokio::time::timeout(DEADLINE, read_response(&mut reader))
        .await
        .expect("answered in time")
        .expect("a response");
    assert_eq!(answer.status, 408, "{answer:?}");
    assert!(
        answer.body.contains("CTXSYNC_HTTP_BODY_TIMEOUT"),
        "{answer:?}"
    );
    assert!(
        answer
            .head
            .to_ascii_lowercase()
            .contains("connection: close"),
        "{answer:?}"
    );
    assert!(
        sent.elapsed() >= body_timeout,
        "408 after {:?}",
        sent.elapsed()
    );
    assert!(says_nosniff(&answer), "{answer:?}");
    assert_eq!(closed_by_server(&mut reader, DEADLINE).await, Ok(()));
    trickle.abort();
    assert!(server.metric("ctxsync_http_timeouts_total", Some(("timeout", "body"))) >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_has_read_its_body_may_take_longer_than_the_body_timeout() {
    let body_timeout = Duration::from_millis(300);
    let mut server = Server::start(limits(
        Duration::from_secs(5),
        body_timeout,
        Duration::from_secs(60),
        16,
    ))
    .await;
    let mut client = server.connect().await;
    client
        .write_all(b"POST /read-then-hold HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\n\r\nabc")
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, server.entered.recv())
        .await
        .expect("the handler read the body")
        .unwrap();
    // The scenario, not a pass condition: the handler outlasts the body timeout.
    tokio::time::sleep(body_timeout * 2).await;
    server.release.notify_one();
    let answer = tokio::time::timeout(DEADLINE, read_response(&mut client))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (200, "3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_bound_the_listener_waits_for_a_free_slot() {
    let server = Server::start(limits(
        Duration::from_secs(30),
        Duration::from_secs(30),
        Duration::from_secs(60),
        3,
    ))
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(server.connect().await);
    }
    // Every slot is taken: the accept loop says it waits.
    server
        .until_metric("ctxsync_http_connection_limit_waits_total", None, 1.0)
        .await;
    assert_eq!(server.metric("ctxsync_http_connections_open", None), 3.0);

    // A fourth client is not served while the three are open...
    let mut fourth = server.connect().await;
    fourth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let early = tokio::time::timeout(Duration::from_millis(500), read_response(&mut fourth)).await;
    assert!(
        early.is_err(),
        "a client past the bound was served: {early:?}"
    );
    assert_eq!(server.metric("ctxsync_http_connections_open", None), 3.0);

    // ...and is once one of them closes.
    drop(held.pop());
    let answer = tokio::time::timeout(DEADLINE, read_response(&mut fourth))
        .await
        .expect("served once a slot freed")
        .unwrap();
    assert_eq!(answer.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_connections_and_finishes_the_request_in_flight() {
    let mut server = Server::start(limits(
        Duration::from_secs(30),
        Duration::from_secs(30),
        Duration::from_secs(60),
        16,
    ))
    .await;
    let addr = server.addr();
    let mut busy = server.connect().await;
    busy.write_all(b"GET /hold HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut idle = server.connect().await;
    tokio::time::timeout(DEADLINE, server.entered.recv())
        .await
        .expect("the request is in flight")
        .unwrap();
    server
        .until_metric("ctxsync_http_connections_open", None, 2.0)
        .await;

    server.shutdown.cancel();
    // The idle connection is closed at once (not after its 30 s header timeout).
    assert_eq!(closed_by_server(&mut idle, DEADLINE).await, Ok(()));
    // No new connections are taken.
    let refused = tokio::time::timeout(DEADLINE, async {
        loop {
            match TcpStream::connect(addr).await {
                Err(_) => return,
                Ok(mut stream) => {
                    // Accepted by the kernel before the listener closed: not served.
                    let _ = stream
                        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
                        .await;
                    assert!(
                        read_response(&mut stream).await.is_err(),
                        "served after shutdown"
                    );
                }
            }
        }
    })
    .await;
    assert!(refused.is_ok(), "the listener still accepts after shutdown");

    // The request in flight is answered, then its connection closed.
    let join = tokio::spawn(server.http.join());
    server.release.notify_one();
    let answer = tokio::time::timeout(DEADLINE, read_response(&mut busy))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (200, "released"));
    assert_eq!(closed_by_server(&mut busy, DEADLINE).await, Ok(()));
    tokio::time::timeout(DEADLINE, join)
        .await
        .expect("join returns once the request is answered")
        .unwrap();
}

/// The answer carries `X-Content-Type-Options: nosniff`.
fn says_nosniff(answer: &RawResponse) -> bool {
    answer
        .head
        .to_ascii_lowercase()
        .lines()
        .any(|line| line.trim_end() == "x-content-type-options: nosniff")
}

/// One request on a connection of its own (closed after the answer).
async fn raw_request(addr: SocketAddr, request: &str) -> RawResponse {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    stream.write_all(request.as_bytes()).await.expect("sent");
    tokio::time::timeout(DEADLINE, read_response(&mut stream))
        .await
        .expect("answered in time")
        .expect("a response")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_of_every_listener_says_nosniff() {
    let limits = || {
        limits(
            Duration::from_secs(5),
            Duration::from_secs(1),
            Duration::from_secs(60),
            16,
        )
    };
    let shutdown = Shutdown::new();
    let routes = axum::Router::new()
        .route(
            "/echo",
            post(|body: Bytes| async move { format!("{}", body.len()) }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(16));
    let api = HttpServer::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        limits(),
        routes,
        Readiness::new(),
        shutdown.clone(),
    )
    .await
    .expect("listener binds");
    let metrics = HttpServer::start_metrics(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        limits(),
        shutdown.clone(),
    )
    .await
    .expect("metrics listener binds");
    let get =
        |path: &str| format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    let post = |body: &str| {
        format!(
            "POST /echo HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let cases = [
        (api.local_addr(), get("/healthz"), 200),
        (api.local_addr(), get("/readyz"), 200),
        (api.local_addr(), get("/metrics"), 200),
        (api.local_addr(), post("hi"), 200),
        (api.local_addr(), get("/no-such-route"), 404),
        (api.local_addr(), get("/echo"), 405),
        (api.local_addr(), post(&"x".repeat(17)), 413),
        // A body that never arrives: the accept loop's own 408.
        (
            api.local_addr(),
            "POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nabc".to_owned(),
            408,
        ),
        (metrics.local_addr(), get("/metrics"), 200),
        (metrics.local_addr(), get("/healthz"), 404),
    ];
    for (addr, request, status) in cases {
        let answer = raw_request(addr, &request).await;
        let line = request.lines().next().unwrap_or_default();
        assert_eq!(answer.status, status, "{line}: {answer:?}");
        assert!(says_nosniff(&answer), "{line}: {answer:?}");
    }
    shutdown.cancel();
    api.join().await;
    metrics.join().await;
}
