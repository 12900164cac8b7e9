//! TLS of the runtime's connections, against real peers and a CA made at test
//! time: the HTTP listener serves HTTPS (and bounds a stalled handshake by
//! its header timeout), NATS over `tls://` with a CA file (and a client
//! certificate), and Postgres `sslmode`/`sslrootcert` against a private
//! Postgres with `ssl=on`.

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_runtime::config::{HttpArgs, HttpLimits, NatsTlsArgs};
use ctxsync_runtime::nats::NatsTarget;
use ctxsync_runtime::{DatabaseArgs, HttpServer, Readiness, Shutdown};
use futures::StreamExt as _;
use testkit::tls::TestCa;
use testkit::{NatsServer, PrivatePostgres};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(10);

async fn https_server(ca: &TestCa, header_timeout: Duration) -> (HttpServer, Shutdown) {
    let files = ca.issue_server("listener");
    let args = HttpArgs {
        http_header_timeout: header_timeout,
        tls_cert: Some(files.cert),
        tls_key: Some(files.key),
        ..HttpArgs::default()
    };
    let limits = args.limits().expect("valid TLS options");
    assert!(limits.tls().is_some());
    let shutdown = Shutdown::new();
    let routes = axum::Router::new().route("/hello", axum::routing::get(|| async { "hello" }));
    let http = HttpServer::start(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        limits,
        routes,
        Readiness::new(),
        shutdown.clone(),
    )
    .await
    .expect("listener binds");
    (http, shutdown)
}

fn metric(name: &str, addr: SocketAddr, label: Option<(&str, &str)>) -> f64 {
    let listener = format!("listener=\"{addr}\"");
    ctxsync_runtime::metrics::handle()
        .render()
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(&listener))
        .filter(|line| label.is_none_or(|(k, v)| line.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn the_listener_serves_https_with_the_given_certificate_and_refuses_plain_http() {
    let ca = TestCa::new();
    let (http, shutdown) = https_server(&ca, Duration::from_secs(10)).await;
    let addr = http.local_addr();
    let client = ca.https_client();
    for host in [addr.to_string(), format!("localhost:{}", addr.port())] {
        let answer = client
            .get(format!("https://{host}/hello"))
            .timeout(DEADLINE)
            .send()
            .await
            .expect("an https answer");
        assert!(answer.status().is_success(), "{}", answer.status());
        assert_eq!(answer.text().await.unwrap(), "hello");
    }
    let ready = client
        .get(format!("https://{addr}/readyz"))
        .send()
        .await
        .unwrap();
    assert!(ready.status().is_success());

    // A client that does not trust the test CA refuses the certificate.
    let untrusted = reqwest::Client::builder()
        .tls_backend_preconfigured(ctxsync_tls::client_config(None, None).unwrap())
        .build()
        .unwrap();
    let refused = untrusted
        .get(format!("https://{addr}/hello"))
        .timeout(DEADLINE)
        .send()
        .await
        .expect_err("an untrusted certificate is refused");
    let chain = format!("{:?}", refused);
    assert!(chain.contains("UnknownIssuer"), "{chain}");

    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = reqwest::Client::new()
        .get(format!("http://{addr}/hello"))
        .timeout(DEADLINE)
        .send()
        .await;
    assert!(
        plain.is_err() || !plain.unwrap().status().is_success(),
        "plain http was served"
    );
    assert!(
        metric("ctxsync_http_tls_handshake_failures_total", addr, None) >= 1.0,
        "the refused handshakes are counted"
    );
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, http.join()).await.unwrap();
}

#[tokio::test]
async fn a_stalled_tls_handshake_is_closed_by_the_header_timeout() {
    let ca = TestCa::new();
    let header_timeout = Duration::from_millis(300);
    let (http, shutdown) = https_server(&ca, header_timeout).await;
    let addr = http.local_addr();
    // One says nothing; one sends the first bytes of a ClientHello and stops.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00])
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    for stream in [&mut silent, &mut partial] {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(DEADLINE, stream.read(&mut buf))
            .await
            .expect("the server closes the connection within the deadline");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "closed without an answer: {read:?}"
        );
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed >= header_timeout - Duration::from_millis(50),
        "closed after {elapsed:?}, before the header timeout"
    );
    assert!(
        metric(
            "ctxsync_http_timeouts_total",
            addr,
            Some(("timeout", "header"))
        ) >= 2.0
    );
    // Real clients are still served.
    let answer = ca
        .https_client()
        .get(format!("https://{addr}/hello"))
        .timeout(DEADLINE)
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success());
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, http.join()).await.unwrap();
}

#[test]
fn tls_files_come_in_pairs_and_bad_ones_name_the_variable_and_the_path() {
    let ca = TestCa::new();
    let files = ca.issue_server("s");
    let only_cert = HttpArgs {
        tls_cert: Some(files.cert.clone()),
        ..HttpArgs::default()
    };
    assert_eq!(
        only_cert.limits().unwrap_err().to_string(),
        "CTXSYNC_TLS_CERT (--tls-cert) is set but CTXSYNC_TLS_KEY (--tls-key) is not: give both or neither"
    );
    let only_key = HttpArgs {
        tls_key: Some(files.key.clone()),
        ..HttpArgs::default()
    };
    assert_eq!(
        only_key.limits().unwrap_err().to_string(),
        "CTXSYNC_TLS_KEY (--tls-key) is set but CTXSYNC_TLS_CERT (--tls-cert) is not: give both or neither"
    );
    let missing = ca.dir().join("missing.pem");
    let bad = HttpArgs {
        tls_cert: Some(missing.clone()),
        tls_key: Some(files.key.clone()),
        ..HttpArgs::default()
    };
    let message = bad.limits().unwrap_err().to_string();
    assert!(
        message.starts_with(&format!(
            "invalid CTXSYNC_TLS_CERT (--tls-cert) {missing:?}: cannot read it"
        )),
        "{message}"
    );
    // Without TLS options the listener is plain HTTP, as before.
    assert_eq!(HttpArgs::default().limits().unwrap(), HttpLimits::default());
}

/// A nats-server with TLS, verifying client certificates when `verify`.
fn tls_nats(ca: &TestCa, verify: bool) -> NatsServer {
    let files = ca.issue_server("nats");
    let verify = if verify {
        format!("verify: true\n  ca_file: {:?}\n", ca.ca_path())
    } else {
        String::new()
    };
    NatsServer::start_with_config(&format!(
        "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  {verify}  timeout: 2\n}}\n",
        files.cert, files.key
    ))
}

async fn round_trip(connection: &ctxsync_runtime::nats::NatsConnection) {
    let client = &connection.client;
    let mut echo = client.subscribe("tls.echo").await.unwrap();
    let responder = client.clone();
    tokio::spawn(async move {
        if let Some(message) = echo.next().await
            && let Some(reply) = message.reply
        {
            let _ = responder.publish(reply, message.payload).await;
        }
    });
    client.flush().await.unwrap();
    let answer = tokio::time::timeout(DEADLINE, client.request("tls.echo", "ping".into()))
        .await
        .expect("an answer within the deadline")
        .expect("a reply");
    assert_eq!(&answer.payload[..], b"ping");
}

fn with_ca(ca: &TestCa) -> NatsTlsArgs {
    NatsTlsArgs {
        nats_ca_file: Some(ca.ca_path().to_owned()),
        ..NatsTlsArgs::default()
    }
}

#[tokio::test]
async fn nats_over_tls_with_a_ca_file() {
    let ca = TestCa::new();
    let nats = tls_nats(&ca, false);
    let tls_url = format!("tls://127.0.0.1:{}", nats.port());
    // tls:// with the CA, and nats:// with the CA (a CA file requires TLS).
    for url in [tls_url.clone(), nats.url()] {
        let connection = ctxsync_runtime::nats::connect(
            NatsTarget {
                url: url.clone(),
                tls: with_ca(&ca),
                ..NatsTarget::default()
            },
            "tls-test",
        )
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
        round_trip(&connection).await;
    }
    // Without the CA, the server's certificate is not trusted.
    let error = ctxsync_runtime::nats::connect(tls_url.as_str(), "tls-test")
        .await
        .expect_err("an untrusted server certificate is refused")
        .to_string();
    assert!(
        error.starts_with("cannot connect to NATS at tls://127.0.0.1:")
            && error.contains("(NATS_URL)"),
        "{error}"
    );
    // A CA file that does not exist is named, with its option.
    let missing = ca.dir().join("absent.pem");
    let error = ctxsync_runtime::nats::connect(
        NatsTarget {
            url: tls_url,
            tls: NatsTlsArgs {
                nats_ca_file: Some(missing.clone()),
                ..NatsTlsArgs::default()
            },
            ..NatsTarget::default()
        },
        "tls-test",
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        error.contains(&format!(
            "invalid CTXSYNC_NATS_CA_FILE (--nats-ca-file) {missing:?}: cannot read it"
        )),
        "{error}"
    );
}

#[tokio::test]
async fn nats_with_a_client_certificate() {
    let ca = TestCa::new();
    let nats = tls_nats(&ca, true);
    let url = format!("tls://127.0.0.1:{}", nats.port());
    let client = ca.issue_client("ctxsync-service");
    let connection = ctxsync_runtime::nats::connect(
        NatsTarget {
            url: url.clone(),
            tls: NatsTlsArgs {
                nats_ca_file: Some(ca.ca_path().to_owned()),
                nats_client_cert: Some(client.cert),
                nats_client_key: Some(client.key),
            },
            ..NatsTarget::default()
        },
        "tls-test",
    )
    .await
    .expect("a client certificate the server trusts");
    round_trip(&connection).await;
    // Without one, the server refuses the connection.
    let refused = tokio::time::timeout(
        DEADLINE,
        ctxsync_runtime::nats::connect(
            NatsTarget {
                url,
                tls: with_ca(&ca),
                ..NatsTarget::default()
            },
            "tls-test",
        ),
    )
    .await
    .expect("an answer within the deadline");
    assert!(refused.is_err(), "connected without a client certificate");
}

fn database(url: String) -> DatabaseArgs {
    DatabaseArgs {
        database_url: url,
        db_max_connections: 2,
    }
}

async fn ssl_in_use(pool: &sqlx::PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn postgres_sslmode_and_sslrootcert_are_honoured() {
    let ca = TestCa::new();
    let postgres = PrivatePostgres::start_with_tls(&ca.issue_server("postgres")).await;
    let url = postgres.url();
    let ca_path = ca.ca_path().display().to_string();

    let verified = ctxsync_runtime::db::connect(&database(format!(
        "{url}?sslmode=verify-full&sslrootcert={ca_path}"
    )))
    .await
    .expect("verify-full against the test CA");
    assert!(ssl_in_use(&verified).await, "the connection is encrypted");
    verified.close().await;

    let plain = ctxsync_runtime::db::connect(&database(format!("{url}?sslmode=disable")))
        .await
        .unwrap();
    assert!(!ssl_in_use(&plain).await, "sslmode=disable stays plain");
    plain.close().await;

    // verify-full without the CA: the system's roots do not know it.
    let error = ctxsync_runtime::db::connect(&database(format!("{url}?sslmode=verify-full")))
        .await
        .expect_err("an unknown CA is refused")
        .to_string();
    assert!(error.contains("(DATABASE_URL)"), "{error}");

    // As in libpq, require with an sslrootcert verifies against it: another CA fails.
    let other = TestCa::named("another CA");
    let error = ctxsync_runtime::db::connect(&database(format!(
        "{url}?sslmode=require&sslrootcert={}",
        other.ca_path().display()
    )))
    .await
    .expect_err("require with another CA's root is refused")
    .to_string();
    assert!(error.contains("(DATABASE_URL)"), "{error}");

    // A root certificate file that does not exist is a clear startup error.
    let error = ctxsync_runtime::db::connect(&database(format!(
        "{url}?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"
    )))
    .await
    .unwrap_err()
    .to_string();
    assert!(
        error.contains(
            "invalid sslrootcert of DATABASE_URL \"/nonexistent/ca.pem\": cannot read it"
        ),
        "{error}"
    );
}

#[tokio::test]
async fn sslmode_require_against_a_server_without_tls_fails_clearly() {
    let postgres = PrivatePostgres::start().await;
    let error =
        ctxsync_runtime::db::connect(&database(format!("{}?sslmode=require", postgres.url())))
            .await
            .expect_err("require against a server without TLS")
            .to_string();
    assert!(
        error.starts_with("cannot connect to Postgres at postgres://")
            && error.contains("(DATABASE_URL)"),
        "{error}"
    );
    assert!(error.contains("server does not support TLS"), "{error}");
}
