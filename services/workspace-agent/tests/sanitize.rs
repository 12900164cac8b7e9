//! Every error that leaves the agent is sanitized: one test per category, each
//! with a server that really echoes the secret in its error.
//! (Inherited secret-looking env values: see `cli.rs`, which runs the binary
//! with its own environment.)

mod common;

use std::time::Duration;

use common::*;
use ctxsync_proto::v1::{ResourceStatus, mcp_discovery::Phase};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use workspace_agent::discovery;

/// Discovers `servers` and returns the error of server `name`.
async fn error_of(servers: &[(&str, serde_json::Value)], name: &str) -> String {
    testkit::init_logs();
    let ws = Workspace::new();
    ws.write_servers(servers);
    let shutdown = CancellationToken::new();
    let handle = discovery::start(ws.settings(Duration::from_secs(20)), shutdown.clone());
    let mut reports = handle.reports();
    let report = wait_report(&mut reports, "complete", |r| r.phase == Phase::Complete).await;
    let row = server(&report, name).expect("server row").clone();
    shutdown.cancel();
    handle.join().await;
    assert_eq!(row.status, ResourceStatus::Invalid as i32, "{row:?}");
    assert!(row.error.len() <= 4096);
    row.error
}

fn assert_hidden(error: &str, secrets: &[&str]) {
    for secret in secrets {
        assert!(!error.contains(secret), "{secret:?} leaked: {error}");
    }
    assert!(error.contains("[redacted]"), "{error}");
}

#[tokio::test]
async fn configured_env_values_are_redacted() {
    let error = error_of(
        &[(
            "s",
            fixture_with_env(
                &["--mode", "secret-error"],
                &[("FIXTURE_PLAIN_SETTING", "configured-value-1234")],
            ),
        )],
        "s",
    )
    .await;
    // The name says nothing secret; it is redacted because it is configured.
    assert!(
        error.contains("FIXTURE_PLAIN_SETTING=[redacted]"),
        "{error}"
    );
    assert_hidden(&error, &["configured-value-1234"]);
}

#[tokio::test]
async fn stdio_args_and_flag_values_are_redacted() {
    let error = error_of(
        &[(
            "s",
            fixture(&[
                "--mode",
                "secret-error",
                "--",
                "--api-key=flag-value-secret",
                "--token",
                "after-token-flag",
                "p0sitional9secret",
                "start",
            ]),
        )],
        "s",
    )
    .await;
    assert!(error.contains("--api-key=[redacted]"), "{error}");
    assert!(
        error.contains("--token [redacted] [redacted] start"),
        "a subcommand is no secret: {error}"
    );
    assert_hidden(
        &error,
        &["flag-value-secret", "after-token-flag", "p0sitional9secret"],
    );
}

#[tokio::test]
async fn header_credential_with_a_scheme_is_redacted() {
    // The HTTP server echoes what it was given (its own args) in its error.
    let fixture =
        mcp_fixture::HttpFixture::start(&["--mode", "secret-error", "bearer-cred-5678"]).await;
    let error = error_of(
        &[(
            "h",
            json!({"type": "http", "url": fixture.url(), "headers": {"Authorization": "Bearer bearer-cred-5678"}}),
        )],
        "h",
    )
    .await;
    assert!(error.contains("refused the credentials"), "{error}");
    assert_hidden(&error, &["bearer-cred-5678"]);
    fixture.stop().await;
}

#[tokio::test]
async fn header_credential_without_a_scheme_is_redacted() {
    let fixture =
        mcp_fixture::HttpFixture::start(&["--mode", "secret-error", "raw-api-key-9012"]).await;
    let error = error_of(
        &[(
            "h",
            json!({"url": fixture.url(), "headers": {"X-Api-Key": "raw-api-key-9012"}}),
        )],
        "h",
    )
    .await;
    assert!(error.contains("refused the credentials"), "{error}");
    assert_hidden(&error, &["raw-api-key-9012"]);
    fixture.stop().await;
}

#[tokio::test]
async fn url_userinfo_and_query_values_are_redacted_and_the_path_stays() {
    let port = testkit::free_port();
    let url = format!(
        "http://alice-user:url-password-1@127.0.0.1:{port}/tenant-path/mcp?api_key=query-secret-2"
    );
    let error = error_of(&[("u", json!({"url": url}))], "u").await;
    assert_hidden(&error, &["alice-user", "url-password-1", "query-secret-2"]);
    assert!(
        error.contains(&format!(
            "http://127.0.0.1:{port}/tenant-path/mcp?api_key=[redacted]"
        )),
        "scheme, host, port, path and query key stay: {error}"
    );
}

#[tokio::test]
async fn long_errors_are_capped() {
    // Short (unredacted) args the server echoes, far more than 4 KiB of them.
    let mut args = vec!["--mode", "secret-error"];
    args.extend(std::iter::repeat_n("ab", 4000));
    let error = error_of(&[("s", fixture(&args))], "s").await;
    assert!(error.len() <= 4096, "{} bytes", error.len());
    assert!(
        error.len() > 3000,
        "capped, not emptied: {} bytes",
        error.len()
    );
}

/// Realistic error texts (issue 25): each secret goes, every other byte stays.
#[test]
fn realistic_errors_lose_their_secrets_and_nothing_else() {
    use ctxsync_mcp::{Sanitizer, ServerSpec, TransportSpec};
    let inherited = [
        ("CTXSYNC_WORKDIR", "/workspace"),
        ("HOME", "/home/ctxsync"),
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("RUST_LOG", "info"),
        ("BUILD_LABEL", "LEAK3xa1b2c3d4e5"),
        ("GITHUB_TOKEN", "ghp_16charsecret"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let http = ServerSpec {
        name: "context7".into(),
        transport: TransportSpec::StreamableHttp {
            url: "https://mcp.context7.com/mcp?api_key=ctx7sk-12ab34cd".into(),
            headers: [(
                "Authorization".to_owned(),
                "Bearer ctx7-bearer-99x".to_owned(),
            )]
            .into(),
        },
    };
    let stdio = ServerSpec {
        name: "tool".into(),
        transport: TransportSpec::Stdio {
            command: "/workspace/no-such-mcp-server".into(),
            args: [
                "start",
                "--port",
                "8080",
                "--token",
                "tk_9f8e7d6c5b4a",
                "-v",
            ]
            .map(str::to_owned)
            .to_vec(),
            env: [("MODE".to_owned(), "production-eu".to_owned())].into(),
            cwd: Some("/workspace".into()),
        },
    };
    let cases = [
        (
            &http,
            "transport error: send initialize request: error sending request for url (https://mcp.context7.com/mcp?api_key=ctx7sk-12ab34cd): client error (Connect): 401 for Bearer ctx7-bearer-99x",
            "transport error: send initialize request: error sending request for url (https://mcp.context7.com/mcp?api_key=[redacted]): client error (Connect): 401 for [redacted]",
        ),
        (
            &stdio,
            "cannot start `/workspace/no-such-mcp-server`: no such file: /workspace/no-such-mcp-server (HOME /home/ctxsync, PATH /usr/local/bin:/usr/bin:/bin, RUST_LOG info)",
            "cannot start `/workspace/no-such-mcp-server`: no such file: /workspace/no-such-mcp-server (HOME /home/ctxsync, PATH /usr/local/bin:/usr/bin:/bin, RUST_LOG info)",
        ),
        (
            &stdio,
            "server exited during the handshake (exit status: 2); stderr: cannot start with argv [start --port 8080 --token tk_9f8e7d6c5b4a -v] in mode production-eu; label LEAK3xa1b2c3d4e5; gh ghp_16charsecret",
            "server exited during the handshake (exit status: 2); stderr: cannot start with argv [start --port 8080 --token [redacted] -v] in mode [redacted]; label [redacted]; gh [redacted]",
        ),
    ];
    for (spec, raw, expected) in cases {
        let sanitizer = Sanitizer::with_inherited_env(spec, inherited.clone());
        assert_eq!(sanitizer.sanitize(raw), expected);
    }
}
