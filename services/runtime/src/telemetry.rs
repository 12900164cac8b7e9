//! `tracing` setup: text or JSON lines on stderr, filtered by `CTXSYNC_LOG`;
//! and, when `--otlp-endpoint` is set, spans exported over OTLP/HTTP
//! (protobuf, batched) carrying the trace ids the services log.

use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::ConfigError;
use crate::trace::{TRACEPARENT, TraceContext};
use crate::{CommonArgs, LogFormat};

/// Bound on one export, retries included: spans are best effort, a batch not
/// sent by then is dropped (and the drop logged).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Installs the global subscriber (logs only). Returns an error naming the bad filter.
pub fn init(format: LogFormat, filter: &str) -> Result<(), TelemetryError> {
    // Without an exporter the guard holds nothing to flush.
    init_with(format, filter, None).map(drop)
}

/// A service's telemetry: its logs, and its spans when `--otlp-endpoint` is
/// set. Keep the returned guard until exit: dropping it flushes the spans.
pub fn init_service(service_name: &str, common: &CommonArgs) -> Result<Telemetry, TelemetryError> {
    let otlp = common.otlp_traces_url()?.map(|traces_url| Otlp {
        traces_url,
        service_name: service_name.to_owned(),
    });
    init_with(common.log_format, &common.log_filter, otlp)
}

/// Where and as whom spans are exported.
#[derive(Debug, Clone)]
pub struct Otlp {
    /// The full URL spans are posted to (`.../v1/traces`).
    pub traces_url: String,
    /// `service.name` of every exported span.
    pub service_name: String,
}

/// Installs the global subscriber, with an OTLP span exporter when `otlp` is given.
pub fn init_with(
    format: LogFormat,
    filter: &str,
    otlp: Option<Otlp>,
) -> Result<Telemetry, TelemetryError> {
    // Before any client is built: reqwest's (the OTLP exporter's included)
    // take rustls' process default, and ring is the one this build has.
    ctxsync_tls::install_default_provider();
    let env_filter =
        EnvFilter::try_new(with_quiet_rmcp(filter)).map_err(|e| TelemetryError::Filter {
            value: filter.to_owned(),
            reason: e.to_string(),
        })?;
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt: Box<dyn Layer<Registry> + Send + Sync> = match format {
        LogFormat::Text => fmt.with_filter(env_filter).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_filter(env_filter)
            .boxed(),
    };
    let mut layers = vec![fmt];
    let provider = match otlp {
        Some(otlp) => {
            let provider = tracer_provider(&otlp)?;
            EXPORTING.store(true, std::sync::atomic::Ordering::Relaxed);
            let tracer = provider.tracer("ctxsync");
            // Spans are exported whatever CTXSYNC_LOG says; rmcp's events hold
            // URLs with credentials, and the exporter's own would loop back.
            let targets = Targets::new()
                .with_default(LevelFilter::INFO)
                .with_target("rmcp", LevelFilter::OFF)
                .with_target("opentelemetry", LevelFilter::OFF);
            layers.push(
                tracing_opentelemetry::layer()
                    .with_tracer(tracer)
                    .with_filter(targets)
                    .boxed(),
            );
            Some(provider)
        }
        None => None,
    };
    tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .map_err(|e| TelemetryError::Install(e.to_string()))?;
    Ok(Telemetry { provider })
}

fn tracer_provider(otlp: &Otlp) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(&otlp.traces_url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(otlp.service_name.clone())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Holds the span exporter, if any. Dropping it flushes and stops it.
#[must_use = "dropping the guard stops the span export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exports(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans ended so far.
    pub fn flush(&self) -> Result<(), TelemetryError> {
        match &self.provider {
            Some(provider) => provider
                .force_flush()
                .map_err(|e| TelemetryError::Flush(e.to_string())),
            None => Ok(()),
        }
    }

    /// Sends the spans ended so far and stops the export.
    pub fn shutdown(mut self) -> Result<(), TelemetryError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), TelemetryError> {
        match self.provider.take() {
            Some(provider) => provider
                .shutdown_with_timeout(EXPORT_TIMEOUT * 2)
                .map_err(|e| TelemetryError::Flush(e.to_string())),
            None => Ok(()),
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(error) = self.stop() {
            // The subscriber may be the only log sink left: still say it.
            tracing::warn!(%error, "spans not exported at exit");
        }
    }
}

/// Whether this process installed a span exporter: without one, every push
/// would otherwise format and parse a traceparent for nothing.
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes `span`, in the exported spans, a child of `trace`'s hop, so every
/// service's spans of one push share its trace id. Call it before the span
/// is first entered; without an exporter it does nothing.
pub fn continue_trace<'a>(
    span: tracing::Span,
    trace: impl Into<Option<&'a TraceContext>>,
) -> tracing::Span {
    if !EXPORTING.load(std::sync::atomic::Ordering::Relaxed) {
        return span;
    }
    if let Some(trace) = trace.into() {
        let carrier = HashMap::from([(TRACEPARENT.to_owned(), trace.to_string())]);
        let _ = span.set_parent(TraceContextPropagator::new().extract(&carrier));
    }
    span
}

/// rmcp logs transport failures with the full server URL (credentials,
/// path and query included): it is silenced unless the operator names it.
pub fn with_quiet_rmcp(filter: &str) -> String {
    if filter.contains("rmcp") {
        filter.to_owned()
    } else if filter.trim().is_empty() {
        "rmcp=off".to_owned()
    } else {
        format!("{filter},rmcp=off")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid CTXSYNC_LOG {value:?}: {reason}")]
    Filter { value: String, reason: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot build the OTLP span exporter: {0}")]
    Exporter(String),
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
    #[error("cannot export spans: {0}")]
    Flush(String),
}
