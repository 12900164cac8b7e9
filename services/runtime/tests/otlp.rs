//! OTLP span export against a collector stand-in that decodes what it gets.
//! Telemetry is global per process: this file is its own test binary.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use clap::Parser;
use ctxsync_runtime::CommonArgs;
use ctxsync_runtime::telemetry::{self, TelemetryError};
use ctxsync_runtime::trace::TraceContext;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tokio::sync::mpsc;

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
}

/// A collector's `POST /v1/traces`: every request body, decoded.
async fn collector() -> (
    SocketAddr,
    mpsc::UnboundedReceiver<ExportTraceServiceRequest>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(
                |State(tx): State<mpsc::UnboundedSender<_>>, body: Bytes| async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            let _ = tx.send(request);
                            // An empty ExportTraceServiceResponse.
                            (
                                StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                Vec::new(),
                            )
                        }
                        Err(_) => (
                            StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"not an ExportTraceServiceRequest".to_vec(),
                        ),
                    }
                },
            ),
        )
        .with_state(tx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, rx)
}

fn service_name(request: &ExportTraceServiceRequest) -> Vec<String> {
    request
        .resource_spans
        .iter()
        .filter_map(|r| r.resource.as_ref())
        .flat_map(|r| &r.attributes)
        .filter(|kv| kv.key == "service.name")
        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(name) => Some(name.clone()),
            _ => None,
        })
        .collect()
}

fn spans(request: &ExportTraceServiceRequest) -> impl Iterator<Item = &Span> {
    request
        .resource_spans
        .iter()
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn spans_reach_the_collector_with_our_trace_id_and_the_service_name() {
    let (addr, mut received) = collector().await;
    let cli = Cli::try_parse_from(["svc", "--otlp-endpoint", &format!("http://{addr}")]).unwrap();
    let guard = telemetry::init_service("otlp-test", &cli.common).unwrap();
    assert!(guard.exports());

    let trace = TraceContext::parse(PARENT).unwrap();
    let span = telemetry::continue_trace(tracing::info_span!("test.hop"), &trace);
    span.in_scope(|| {
        tracing::info!(trace_id = %trace.trace_id(), "inside the hop");
        tracing::info_span!("test.inner").in_scope(|| {});
    });
    drop(span);
    // An unrelated span: a trace of its own.
    tracing::info_span!("test.unrelated").in_scope(|| {});

    // The flush blocks until the collector answered: off the runtime's threads.
    let guard = tokio::task::spawn_blocking(move || {
        guard.flush().expect("spans flushed");
        guard
    })
    .await
    .unwrap();

    let mut exported = Vec::new();
    let mut names = Vec::new();
    while exported.len() < 3 {
        let request = tokio::time::timeout(Duration::from_secs(10), received.recv())
            .await
            .expect("the collector received the spans")
            .unwrap();
        names.extend(service_name(&request));
        exported.extend(spans(&request).cloned());
    }
    assert!(
        !names.is_empty() && names.iter().all(|n| n == "otlp-test"),
        "{names:?}"
    );
    let by_name = |name: &str| {
        exported
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name} in {exported:?}"))
    };
    let hop = by_name("test.hop");
    assert_eq!(hex(&hop.trace_id), trace.trace_id());
    assert_eq!(hex(&hop.parent_span_id), "00f067aa0ba902b7");
    assert!(
        hop.events.iter().any(|e| e.name == "inside the hop"),
        "{:?}",
        hop.events
    );
    let inner = by_name("test.inner");
    assert_eq!(inner.trace_id, hop.trace_id);
    assert_eq!(inner.parent_span_id, hop.span_id);
    assert_ne!(by_name("test.unrelated").trace_id, hop.trace_id);

    tokio::task::spawn_blocking(move || guard.shutdown())
        .await
        .unwrap()
        .expect("export stopped");
}

#[test]
fn an_invalid_endpoint_fails_at_start_naming_the_variable_and_the_value() {
    let cli = Cli::try_parse_from(["svc", "--otlp-endpoint", "collector:4318"]).unwrap();
    // Fails before anything is installed, so it can share the process.
    let error = telemetry::init_service("otlp-test", &cli.common)
        .err()
        .expect("an invalid endpoint is refused");
    assert!(matches!(error, TelemetryError::Config(_)), "{error:?}");
    assert_eq!(
        error.to_string(),
        r#"invalid CTXSYNC_OTLP_ENDPOINT "collector:4318": expected an http URL, not collector"#
    );
}
