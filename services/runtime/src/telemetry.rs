//! `tracing` setup: text or JSON lines on stderr, filtered by `CTXSYNC_LOG`
//! (third-party crates that log credentials capped: [`QUIET_CRATES`]);
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
use crate::config::{CommonArgs, LogFormat};
use crate::trace::{TRACEPARENT, TraceContext};

/// Bound on one export, retries included: spans are best effort, a batch not
/// sent by then is dropped (and the drop logged).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Installs the global subscriber (logs only), for a tool whose JSON lines
/// carry its executable's name as `service`. Returns an error naming the bad
/// filter.
pub fn init(format: LogFormat, filter: &str) -> Result<(), TelemetryError> {
    let service = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_name()?.to_str().map(str::to_owned))
        .unwrap_or_else(|| "ctxsync".to_owned());
    // Without an exporter the guard holds nothing to flush.
    init_with(format, filter, &service, None).map(drop)
}

/// How a process that could not start (or stopped on an error) says so:
/// as a log line in the chosen format, `service` included, then exit 1.
/// Before the subscriber exists (a bad log filter), the line is written here.
pub fn exit_on_error<E: std::fmt::Display>(
    format: LogFormat,
    service: &str,
    result: Result<(), E>,
) -> std::process::ExitCode {
    let Err(error) = result else {
        return std::process::ExitCode::SUCCESS;
    };
    let message = format!("{error:#}");
    if tracing::dispatcher::has_been_set() {
        tracing::error!(error = %message, "{service} stopped");
    } else {
        match format {
            LogFormat::Json => eprintln!(
                "{}",
                serde_json::json!({
                    "timestamp": chrono_like_now(),
                    "level": "ERROR",
                    "service": service,
                    "error": message,
                    "message": format!("{service} stopped"),
                })
            ),
            LogFormat::Text => eprintln!("ERROR {service} stopped: {message}"),
        }
    }
    std::process::ExitCode::FAILURE
}

/// RFC 3339 UTC, as the subscriber writes it, without a time crate here.
fn chrono_like_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        now.subsec_micros()
    )
}

/// Writes each JSON log line with `"service":<name>` first, so collectors
/// can tell the processes apart; text lines pass unchanged. The fmt layer
/// asks for one writer per event and writes the whole line at once.
#[derive(Clone, Copy)]
struct ServiceTagged {
    /// `"service":"<name>",` as JSON.
    prefix: &'static str,
}

impl ServiceTagged {
    fn new(service: &str) -> Self {
        let prefix = format!("{{\"service\":{},", serde_json::Value::from(service));
        Self {
            prefix: Box::leak(prefix.into_boxed_str()),
        }
    }
}

struct ServiceTaggedWriter {
    prefix: &'static str,
    first: bool,
}

impl std::io::Write for ServiceTaggedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut stderr = std::io::stderr().lock();
        if std::mem::take(&mut self.first) && buf.first() == Some(&b'{') {
            let mut line = Vec::with_capacity(self.prefix.len() + buf.len());
            line.extend_from_slice(self.prefix.as_bytes());
            line.extend_from_slice(&buf[1..]);
            stderr.write_all(&line)?;
            return Ok(buf.len());
        }
        stderr.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ServiceTagged {
    type Writer = ServiceTaggedWriter;

    fn make_writer(&'a self) -> Self::Writer {
        ServiceTaggedWriter {
            prefix: self.prefix,
            first: true,
        }
    }
}

/// Colour only for a person at a terminal: never into files or pipes, and
/// never with `NO_COLOR` set.
fn use_colour() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// A service's telemetry: its logs, and its spans when `--otlp-endpoint` is
/// set. Keep the returned guard until exit: dropping it flushes the spans.
pub fn init_service(service_name: &str, common: &CommonArgs) -> Result<Telemetry, TelemetryError> {
    let otlp = common.otlp_traces_url()?.map(|traces_url| Otlp {
        traces_url,
        service_name: service_name.to_owned(),
    });
    init_with(common.log_format, &common.log_filter, service_name, otlp)
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
    service: &str,
    otlp: Option<Otlp>,
) -> Result<Telemetry, TelemetryError> {
    // Before any client is built: reqwest's (the OTLP exporter's included)
    // take rustls' process default, and ring is the one this build has.
    ctxsync_tls::install_default_provider();
    let env_filter =
        EnvFilter::try_new(with_quiet_crates(filter)).map_err(|e| TelemetryError::Filter {
            value: filter.to_owned(),
            reason: e.to_string(),
        })?;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(ServiceTagged::new(service))
        .with_ansi(use_colour());
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

/// Third-party crates whose verbose levels log credentials, and the most
/// verbose level each keeps unless the operator's filter names it:
/// * `rmcp` logs transport failures with the full server URL (credentials,
///   path and query included) at every level: off;
/// * `async_nats` logs the server address, password included, on every
///   connect attempt at debug, and each connection event at info, which
///   `nats::connect` logs already (once);
/// * `sqlx::postgres::notice` relays the server's notices ("already exists,
///   skipping" on every start's migrations) at info;
/// * `sqlx`, `hyper`, `hyper_util`, `reqwest`, `h2`, `rustls` and `tower_http`
///   log connection details, statements and headers at debug and below.
pub const QUIET_CRATES: &[(&str, LevelFilter)] = &[
    ("rmcp", LevelFilter::OFF),
    ("async_nats", LevelFilter::WARN),
    ("sqlx", LevelFilter::INFO),
    ("sqlx::postgres::notice", LevelFilter::WARN),
    ("hyper", LevelFilter::INFO),
    ("hyper_util", LevelFilter::INFO),
    ("reqwest", LevelFilter::INFO),
    ("h2", LevelFilter::INFO),
    ("rustls", LevelFilter::INFO),
    ("tower_http", LevelFilter::INFO),
];

/// `filter` with every crate of [`QUIET_CRATES`] capped at its level, unless
/// a directive of `filter` names it (`async_nats=debug`, `rmcp::transport`):
/// then the operator chose. A cap is only added where the filter's default
/// level is more verbose (`CTXSYNC_LOG=warn` stays warn for every crate).
pub fn with_quiet_crates(filter: &str) -> String {
    let directives: Vec<&str> = filter
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    let target_of = |directive: &str| -> Option<String> {
        // `target[span{field}]=level`, `target=level`, `target` or `level`.
        let head = directive.split('=').next().unwrap_or("");
        let head = head.split('[').next().unwrap_or("").trim();
        if head.is_empty() || (!directive.contains('=') && head.parse::<LevelFilter>().is_ok()) {
            None
        } else {
            Some(head.to_owned())
        }
    };
    // The most verbose level a directive without a target enables (the
    // default level); EnvFilter's default without one is ERROR.
    let default = directives
        .iter()
        .filter(|d| target_of(d).is_none())
        .filter_map(|d| d.rsplit('=').next()?.trim().parse::<LevelFilter>().ok())
        .max()
        .unwrap_or(LevelFilter::ERROR);
    let mut out = directives.join(",");
    for (krate, cap) in QUIET_CRATES {
        let named = directives
            .iter()
            .filter_map(|d| target_of(d))
            .any(|target| target == *krate || target.starts_with(&format!("{krate}::")));
        if named || default <= *cap {
            continue;
        }
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(&format!("{krate}={}", cap.to_string().to_lowercase()));
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_logging_crates_are_capped_unless_named() {
        let debug = with_quiet_crates("debug");
        for cap in [
            "rmcp=off",
            "async_nats=warn",
            "sqlx=info",
            "sqlx::postgres::notice=warn",
            "hyper=info",
            "reqwest=info",
            "h2=info",
            "rustls=info",
        ] {
            assert!(
                debug.split(',').any(|d| d == cap),
                "{cap} missing in {debug}"
            );
        }
        assert!(debug.starts_with("debug,"), "{debug}");

        // Named by the operator: the operator's choice stands.
        let named = with_quiet_crates("debug,async_nats=debug,rmcp::transport=trace");
        assert!(!named.contains("async_nats=warn"), "{named}");
        assert!(!named.contains("rmcp=off"), "{named}");
        assert!(named.contains("sqlx=info"), "{named}");

        // Quieter than a cap: nothing is raised.
        assert_eq!(with_quiet_crates("warn"), "warn,rmcp=off");
        assert_eq!(
            with_quiet_crates("info"),
            "info,rmcp=off,async_nats=warn,sqlx::postgres::notice=warn"
        );
        assert_eq!(with_quiet_crates(""), "rmcp=off");
        assert_eq!(
            with_quiet_crates("ctxsync_runtime=debug"),
            "ctxsync_runtime=debug,rmcp=off"
        );
        let trace = with_quiet_crates("info,catalog=trace,trace");
        assert!(trace.contains("async_nats=warn"), "{trace}");
        for filter in [debug, named, trace] {
            EnvFilter::try_new(&filter).unwrap_or_else(|e| panic!("{filter}: {e}"));
        }
    }
}
