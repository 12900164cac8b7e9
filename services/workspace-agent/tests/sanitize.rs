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
                "positional-secret-arg",
            ]),
        )],
        "s",
    )
    .await;
    assert!(error.contains("--api-key=[redacted]"), "{error}");
    assert_hidden(&error, &["flag-value-secret", "positional-secret-arg"]);
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
async fn url_userinfo_path_and_query_are_redacted() {
    let port = testkit::free_port();
    let url = format!(
        "http://alice:url-password-1@127.0.0.1:{port}/tenant-path-secret/mcp?api_key=query-secret-2"
    );
    let error = error_of(&[("u", json!({"url": url}))], "u").await;
    assert_hidden(
        &error,
        &[
            "alice",
            "url-password-1",
            "tenant-path-secret",
            "query-secret-2",
        ],
    );
    assert!(error.contains("127.0.0.1"), "host and port stay: {error}");
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
