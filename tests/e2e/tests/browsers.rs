//! The DNS-rebinding defence on the listeners a browser could reach: the
//! gate's API and context page and the catalog's `/mcp` answer 403 to a
//! request whose `Host` is not an allowed host or whose `Origin` is neither
//! the listener's own nor an allowed origin; clients that send no Origin,
//! the listener's own pages and a configured origin pass, and the operator
//! endpoints answer whatever the Host (probes ask by address). On the real
//! services in this process, over TCP.

use std::net::SocketAddr;
use std::time::Duration;

use ctxsync_runtime::http::browsers::AllowedOrigins;
use reqwest::Client;
use serde_json::json;
use testkit::chat::TEST_TENANT_KEY;

const DEADLINE: Duration = Duration::from_secs(30);
const CHAT_ORIGIN: &str = "https://chat.example.com";

/// The status of `method path` on `addr` with these `Host` and `Origin`
/// headers (the listener's own address as Host when `host` is `None`), and
/// the error code of a 403.
async fn status(
    http: &Client,
    addr: SocketAddr,
    method: reqwest::Method,
    path: &str,
    host: Option<&str>,
    origin: Option<&str>,
) -> (u16, String) {
    let mut request = http
        .request(method, format!("http://{addr}{path}"))
        .bearer_auth(TEST_TENANT_KEY)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "browsers-test", "version": "1"}}})
            .to_string(),
        )
        .timeout(DEADLINE);
    if let Some(host) = host {
        request = request.header("host", host);
    }
    if let Some(origin) = origin {
        request = request.header("origin", origin);
    }
    let response = request.send().await.expect("an answer");
    let status = response.status().as_u16();
    let code = if status == 403 {
        let body: serde_json::Value = response.json().await.expect("a JSON refusal");
        body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    } else {
        String::new()
    };
    (status, code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_host_or_origin_is_refused_403_and_browsers_own_pages_pass() {
    let e2e::http_stack::HttpStack {
        test: _test,
        shutdown,
        stack,
        ..
    } = e2e::http_stack::start_with_gate("browsers", &"b".repeat(43), |config| {
        config.browsers.http_allowed_origins = AllowedOrigins::parse(CHAT_ORIGIN).unwrap();
    })
    .await;
    let http = Client::new();
    let gate = stack.gate().http_addr();
    let catalog = stack.catalog().http_addr();
    let get = reqwest::Method::GET;
    let post = reqwest::Method::POST;

    for (service, addr, method, path) in [
        ("chat-gate API", gate, get.clone(), "/api/v1/agents"),
        ("chat-gate page", gate, get.clone(), "/ui/"),
        ("catalog /mcp", catalog, post.clone(), "/mcp"),
    ] {
        let own = format!("http://{addr}");
        let answered = |(status, _): &(u16, String)| *status != 403;
        // Clients that are not browsers, and the listener's own pages.
        let plain = status(&http, addr, method.clone(), path, None, None).await;
        assert!(answered(&plain), "{service}: no Origin: {plain:?}");
        let same = status(&http, addr, method.clone(), path, None, Some(&own)).await;
        assert!(answered(&same), "{service}: its own origin: {same:?}");
        let local = format!("localhost:{}", addr.port());
        let by_name = status(&http, addr, method.clone(), path, Some(&local), None).await;
        assert!(answered(&by_name), "{service}: Host {local}: {by_name:?}");

        // A page elsewhere, and a name rebound to this address.
        let foreign = Some("http://evil.example.com");
        assert_eq!(
            status(&http, addr, method.clone(), path, None, foreign).await,
            (403, "forbidden".to_owned()),
            "{service}: a foreign Origin"
        );
        let rebound = Some("evil.example.com");
        assert_eq!(
            status(&http, addr, method.clone(), path, rebound, foreign).await,
            (403, "forbidden".to_owned()),
            "{service}: a rebound name"
        );
        assert_eq!(
            status(&http, addr, method.clone(), path, rebound, None).await,
            (403, "forbidden".to_owned()),
            "{service}: a foreign Host"
        );
        // Probes and scrapers ask by any name.
        for operator in ["/healthz", "/metrics"] {
            let (probe, _) = status(&http, addr, get.clone(), operator, rebound, foreign).await;
            assert_eq!(probe, 200, "{service}: {operator} with a foreign Host");
        }
    }

    // An origin the gate is configured with passes there, and only there.
    let (allowed, _) = status(
        &http,
        gate,
        get.clone(),
        "/api/v1/agents",
        None,
        Some(CHAT_ORIGIN),
    )
    .await;
    assert_ne!(allowed, 403, "the gate's configured origin");
    let (elsewhere, _) = status(&http, catalog, post, "/mcp", None, Some(CHAT_ORIGIN)).await;
    assert_eq!(elsewhere, 403, "the catalog is not configured with it");

    shutdown.cancel();
    stack.join().await;
}
