//! Flags and env vars every service reads. Each flag has an env var of the same
//! meaning; flags win over env, env wins over the default.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ctxsync_tls::{PemFile, TlsError};

use ctxsync_proto::subjects::{SubjectError, Subjects};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Options shared by every service.
///
/// Every configuration is also `Serialize`, field by field under its flag's
/// id (flattened parts flattened), each value as its flag reads it: that is
/// how a stack renders a configuration back into the env a binary parses.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct CommonArgs {
    /// NATS server URL, or a comma-separated list of the cluster's URLs
    /// (`nats://a:4222,nats://b:4222`): the service connects to one of them
    /// and fails over to another when its node goes.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", value_parser = NatsUrlParser)]
    pub nats_url: String,

    #[command(flatten)]
    #[serde(flatten)]
    pub nats_tls: NatsTlsArgs,

    /// NATS URL (or cluster list) of a second connection, as another NATS
    /// user, that receives the requests this service answers and sends the
    /// answers (for chat-gate also the store's events, which its turns are
    /// ordered after). Unset: the one connection of NATS_URL does both. A
    /// deployment sets it so that the user that answers may publish only
    /// into inboxes: no reply can be aimed elsewhere.
    #[arg(long, env = "NATS_RESPONDER_URL", value_parser = NatsResponderUrlParser)]
    pub nats_responder_url: Option<String>,

    /// Comma-separated prefixes a request's reply subject must start with to
    /// be answered; `{tenant}` in an entry stands for the tenant a tenant
    /// subject names (`_INBOX.chat-{tenant}.`) and such an entry applies to
    /// tenant subjects only. Requests whose reply subject is elsewhere are
    /// refused unexecuted and counted.
    #[arg(long, env = "CTXSYNC_REPLY_INBOX_PREFIXES", default_value = "_INBOX.", value_parser = ReplyInboxes::parse_arg)]
    pub reply_inbox_prefixes: ReplyInboxes,

    /// Prefix of every NATS subject, so environments can share one NATS server.
    #[arg(long, env = "CTXSYNC_SUBJECT_PREFIX", default_value = ctxsync_proto::subjects::DEFAULT_PREFIX)]
    pub subject_prefix: String,

    /// Address of the HTTP listener (health, readiness, metrics and the service's API).
    #[arg(long, env = "CTXSYNC_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,

    /// Log format.
    #[arg(long, env = "CTXSYNC_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "CTXSYNC_LOG", default_value = "info")]
    pub log_filter: String,

    /// How long in-flight work may take to finish after SIGTERM.
    #[arg(long, env = "CTXSYNC_SHUTDOWN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "humantime_string")]
    pub shutdown_grace: Duration,

    /// OTLP/HTTP collector to export spans to, e.g. `http://collector:4318`
    /// (`/v1/traces` is appended). Unset: no spans are exported.
    #[arg(long, env = "CTXSYNC_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    #[command(flatten)]
    #[serde(flatten)]
    pub http: HttpArgs,
}

/// The flags' defaults.
impl Default for CommonArgs {
    fn default() -> Self {
        crate::args::defaults()
    }
}

/// A duration as its flag reads it (humantime, e.g. `1m 30s`).
pub fn humantime_string<S: serde::Serializer>(
    value: &Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_str(&humantime::format_duration(*value))
}

impl CommonArgs {
    /// The defaults on `nats_url` and `subject_prefix`, with an ephemeral
    /// HTTP port (for tests and embedding).
    pub fn for_nats(nats_url: impl Into<String>, subject_prefix: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            subject_prefix: subject_prefix.into(),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..Self::default()
        }
    }

    pub fn subjects(&self) -> Result<Subjects, ConfigError> {
        Subjects::new(&self.subject_prefix).map_err(|source| ConfigError::SubjectPrefix {
            value: self.subject_prefix.clone(),
            source,
        })
    }

    /// The URL spans are posted to, when `--otlp-endpoint` is set.
    pub fn otlp_traces_url(&self) -> Result<Option<String>, ConfigError> {
        match self.otlp_endpoint.as_deref().map(str::trim) {
            None | Some("") => Ok(None),
            Some(value) => otlp_traces_url(value).map(Some),
        }
    }
}

/// TLS towards NATS beyond a `tls://` URL: a CA to trust and a client
/// certificate for servers that verify clients.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct NatsTlsArgs {
    /// PEM CA certificate(s) to trust for NATS, besides the system's roots;
    /// set, the connection must use TLS (even with a `nats://` URL).
    #[arg(long, env = "CTXSYNC_NATS_CA_FILE")]
    pub nats_ca_file: Option<PathBuf>,

    /// PEM client certificate to present to NATS (mutual TLS); needs --nats-client-key.
    #[arg(long, env = "CTXSYNC_NATS_CLIENT_CERT")]
    pub nats_client_cert: Option<PathBuf>,

    /// PEM private key of --nats-client-cert.
    #[arg(long, env = "CTXSYNC_NATS_CLIENT_KEY")]
    pub nats_client_key: Option<PathBuf>,
}

const NATS_CA_OPTION: &str = "CTXSYNC_NATS_CA_FILE (--nats-ca-file)";
const NATS_CLIENT_CERT_OPTION: &str = "CTXSYNC_NATS_CLIENT_CERT (--nats-client-cert)";
const NATS_CLIENT_KEY_OPTION: &str = "CTXSYNC_NATS_CLIENT_KEY (--nats-client-key)";

impl NatsTlsArgs {
    /// Whether any option asks for TLS.
    pub fn is_set(&self) -> bool {
        self.nats_ca_file.is_some()
            || self.nats_client_cert.is_some()
            || self.nats_client_key.is_some()
    }

    /// The client config these options describe (`None` when none is set).
    pub fn client_config(&self) -> Result<Option<ctxsync_tls::rustls::ClientConfig>, TlsError> {
        if !self.is_set() {
            return Ok(None);
        }
        let ca = self
            .nats_ca_file
            .clone()
            .map(|path| PemFile::new(NATS_CA_OPTION, path));
        let client = ctxsync_tls::pair(
            self.nats_client_cert
                .clone()
                .map(|path| PemFile::new(NATS_CLIENT_CERT_OPTION, path)),
            self.nats_client_key
                .clone()
                .map(|path| PemFile::new(NATS_CLIENT_KEY_OPTION, path)),
            NATS_CLIENT_CERT_OPTION,
            NATS_CLIENT_KEY_OPTION,
        )?;
        ctxsync_tls::client_config(ca.as_ref(), client.as_ref().map(|(c, k)| (c, k))).map(Some)
    }
}

/// The base URL plus `/v1/traces`, as OTLP/HTTP's `OTEL_EXPORTER_OTLP_ENDPOINT`
/// is read; a URL that already names `/v1/traces` is kept.
fn otlp_traces_url(value: &str) -> Result<String, ConfigError> {
    let invalid = |reason: String| ConfigError::OtlpEndpoint {
        value: redact_url(value),
        reason,
    };
    let mut url = url::Url::parse(value).map_err(|e| invalid(e.to_string()))?;
    match url.scheme() {
        "http" => {}
        // The exporter's client is built without TLS: collectors are reached in-cluster.
        "https" => {
            return Err(invalid(
                "https is not supported: use the collector's http endpoint".into(),
            ));
        }
        other => return Err(invalid(format!("expected an http URL, not {other}"))),
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid("the URL has no host".into()));
    }
    // Export errors quote the URL: credentials go in OTEL_EXPORTER_OTLP_HEADERS.
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            "credentials in the URL are not supported: set OTEL_EXPORTER_OTLP_HEADERS".into(),
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid("the URL has a query or fragment".into()));
    }
    if !url.path().trim_end_matches('/').ends_with("/v1/traces") {
        url.path_segments_mut()
            .map_err(|()| invalid("the URL cannot be a base".into()))?
            .pop_if_empty()
            .extend(["v1", "traces"]);
    }
    Ok(url.to_string())
}

/// Bounds of an HTTP listener, so that clients that connect and then send
/// slowly (or nothing) cannot hold its connections and file descriptors.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct HttpArgs {
    /// A connection must send a complete request head within this time (from
    /// its accept, or from the first byte of a later request); else it is closed.
    #[arg(long, env = HEADER_TIMEOUT_ENV, default_value = "10s", value_parser = timeout_parser(HEADER_TIMEOUT_ENV))]
    #[serde(serialize_with = "humantime_string")]
    pub http_header_timeout: Duration,

    /// A request's body must have arrived within this time from its head;
    /// else it is answered 408 and the connection closed.
    #[arg(long, env = BODY_TIMEOUT_ENV, default_value = "30s", value_parser = timeout_parser(BODY_TIMEOUT_ENV))]
    #[serde(serialize_with = "humantime_string")]
    pub http_body_timeout: Duration,

    /// A kept-alive connection with no request in flight is closed after this long.
    #[arg(long, env = IDLE_TIMEOUT_ENV, default_value = "60s", value_parser = timeout_parser(IDLE_TIMEOUT_ENV))]
    #[serde(serialize_with = "humantime_string")]
    pub http_idle_timeout: Duration,

    /// Connections served at once; past it the listener stops accepting until one closes.
    #[arg(long, env = MAX_CONNECTIONS_ENV, default_value_t = 1024, value_parser = count_parser(MAX_CONNECTIONS_ENV))]
    pub http_max_connections: usize,

    /// PEM certificate chain (leaf first) to serve HTTPS with; needs --tls-key.
    /// Unset: plain HTTP.
    #[arg(long, env = TLS_CERT_ENV)]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = TLS_KEY_ENV)]
    pub tls_key: Option<PathBuf>,
}

const HEADER_TIMEOUT_ENV: &str = "CTXSYNC_HTTP_HEADER_TIMEOUT";
const BODY_TIMEOUT_ENV: &str = "CTXSYNC_HTTP_BODY_TIMEOUT";
const IDLE_TIMEOUT_ENV: &str = "CTXSYNC_HTTP_IDLE_TIMEOUT";
const MAX_CONNECTIONS_ENV: &str = "CTXSYNC_HTTP_MAX_CONNECTIONS";
const TLS_CERT_ENV: &str = "CTXSYNC_TLS_CERT";
const TLS_KEY_ENV: &str = "CTXSYNC_TLS_KEY";
/// How the TLS options are named in messages.
const TLS_CERT_OPTION: &str = "CTXSYNC_TLS_CERT (--tls-cert)";
const TLS_KEY_OPTION: &str = "CTXSYNC_TLS_KEY (--tls-key)";

/// The flags' defaults.
impl Default for HttpArgs {
    fn default() -> Self {
        crate::args::defaults()
    }
}

impl HttpArgs {
    /// The limits, checked again (the fields can be set without the parser),
    /// with the TLS certificate and key loaded when given.
    pub fn limits(&self) -> Result<HttpLimits, ConfigError> {
        let limits = HttpLimits::new(
            self.http_header_timeout,
            self.http_body_timeout,
            self.http_idle_timeout,
            self.http_max_connections,
        )?;
        Ok(limits.with_tls(self.tls()?))
    }

    /// The server TLS config of `--tls-cert` and `--tls-key`: both or neither.
    pub fn tls(&self) -> Result<Option<ServerTls>, ConfigError> {
        let pair = ctxsync_tls::pair(
            self.tls_cert
                .clone()
                .map(|path| PemFile::new(TLS_CERT_OPTION, path)),
            self.tls_key
                .clone()
                .map(|path| PemFile::new(TLS_KEY_OPTION, path)),
            TLS_CERT_OPTION,
            TLS_KEY_OPTION,
        )?;
        let Some((cert, key)) = pair else {
            return Ok(None);
        };
        Ok(Some(ServerTls(ctxsync_tls::server_config(&cert, &key)?)))
    }
}

/// A listener's TLS: its certificate and key, loaded.
#[derive(Clone)]
pub struct ServerTls(Arc<ctxsync_tls::rustls::ServerConfig>);

impl ServerTls {
    pub fn new(config: Arc<ctxsync_tls::rustls::ServerConfig>) -> Self {
        Self(config)
    }

    pub fn config(&self) -> Arc<ctxsync_tls::rustls::ServerConfig> {
        self.0.clone()
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

/// The same loaded config (there is no other way to compare two).
impl PartialEq for ServerTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ServerTls {}

/// Checked [`HttpArgs`]: every timeout above zero and at most a day, at least
/// one connection; and the listener's TLS, when it serves HTTPS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpLimits {
    header_timeout: Duration,
    body_timeout: Duration,
    idle_timeout: Duration,
    max_connections: usize,
    tls: Option<ServerTls>,
}

/// Longer timeouts are mistakes (and would overflow deadlines).
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);
/// More than any process's file descriptors.
const MAX_CONNECTIONS: usize = 1_000_000;

/// [`HttpArgs`]' defaults, checked.
impl Default for HttpLimits {
    fn default() -> Self {
        HttpArgs::default()
            .limits()
            .expect("the default HTTP limits are valid")
    }
}

impl HttpLimits {
    pub fn new(
        header_timeout: Duration,
        body_timeout: Duration,
        idle_timeout: Duration,
        max_connections: usize,
    ) -> Result<Self, ConfigError> {
        let invalid = |env: &'static str, value: String, reason: String| ConfigError::Http {
            env,
            value,
            reason,
        };
        for (env, timeout) in [
            (HEADER_TIMEOUT_ENV, header_timeout),
            (BODY_TIMEOUT_ENV, body_timeout),
            (IDLE_TIMEOUT_ENV, idle_timeout),
        ] {
            check_timeout(timeout).map_err(|reason| {
                invalid(env, humantime::format_duration(timeout).to_string(), reason)
            })?;
        }
        check_count(max_connections)
            .map_err(|reason| invalid(MAX_CONNECTIONS_ENV, max_connections.to_string(), reason))?;
        Ok(Self {
            header_timeout,
            body_timeout,
            idle_timeout,
            max_connections,
            tls: None,
        })
    }

    /// Serve HTTPS with `tls` (plain HTTP with `None`).
    pub fn with_tls(mut self, tls: Option<ServerTls>) -> Self {
        self.tls = tls;
        self
    }

    pub fn tls(&self) -> Option<&ServerTls> {
        self.tls.as_ref()
    }

    pub fn header_timeout(&self) -> Duration {
        self.header_timeout
    }

    pub fn body_timeout(&self) -> Duration {
        self.body_timeout
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    pub fn max_connections(&self) -> usize {
        self.max_connections
    }
}

fn check_timeout(timeout: Duration) -> Result<(), String> {
    if timeout.is_zero() {
        Err("must be above zero".into())
    } else if timeout > MAX_TIMEOUT {
        Err(format!(
            "must be at most {}",
            humantime::format_duration(MAX_TIMEOUT)
        ))
    } else {
        Ok(())
    }
}

fn check_count(count: usize) -> Result<(), String> {
    if count == 0 {
        Err("must be at least 1".into())
    } else if count > MAX_CONNECTIONS {
        Err(format!("must be at most {MAX_CONNECTIONS}"))
    } else {
        Ok(())
    }
}

/// clap quotes the flag and the value; the error adds the env var.
fn timeout_parser(
    env: &'static str,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |value| {
        let timeout = humantime::parse_duration(value)
            .map_err(|e| format!("invalid {env} {value:?}: {e}"))?;
        check_timeout(timeout).map_err(|reason| format!("invalid {env} {value:?}: {reason}"))?;
        Ok(timeout)
    }
}

fn count_parser(
    env: &'static str,
) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |value| {
        let count = value
            .trim()
            .parse::<usize>()
            .map_err(|e| format!("invalid {env} {value:?}: {e}"))?;
        check_count(count).map_err(|reason| format!("invalid {env} {value:?}: {reason}"))?;
        Ok(count)
    }
}

/// Options of services that own a database.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct DatabaseArgs {
    /// Postgres URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/ctxsync"
    )]
    pub database_url: String,

    /// Maximum connections in the pool.
    #[arg(long, env = "CTXSYNC_DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,
}

impl DatabaseArgs {
    /// The defaults on `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            ..crate::args::defaults()
        }
    }
}

/// Where a service's answers may go: a request whose reply subject starts
/// with none of these prefixes is refused unexecuted. A prefix holding
/// `{tenant}` applies to tenant subjects only (their last token is the
/// caller's tenant), so a tenant's requests are answered only into that
/// tenant's own inboxes.
///
/// The default (`--reply-inbox-prefixes`') answers any inbox (`_INBOX.` is
/// where every NATS client receives its replies), never a subject that
/// means something (an event, a bucket, another service's requests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyInboxes {
    prefixes: Vec<String>,
}

/// `--reply-inbox-prefixes`' default.
impl Default for ReplyInboxes {
    fn default() -> Self {
        CommonArgs::default().reply_inbox_prefixes
    }
}

/// As the flag reads it: the prefixes, comma-separated.
impl serde::Serialize for ReplyInboxes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

const TENANT_PLACEHOLDER: &str = "{tenant}";

/// A `CTXSYNC_REPLY_INBOX_PREFIXES` that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid CTXSYNC_REPLY_INBOX_PREFIXES entry {entry:?}: {reason}")]
pub struct ReplyInboxesError {
    pub entry: String,
    pub reason: &'static str,
}

impl ReplyInboxes {
    /// Comma-separated prefixes, each ending with `.`, without wildcards or
    /// blanks, with `{tenant}` at most once and as a whole token.
    pub fn parse(value: &str) -> Result<Self, ReplyInboxesError> {
        let mut prefixes = Vec::new();
        for entry in value.split(',').map(str::trim) {
            let invalid = |reason| ReplyInboxesError {
                entry: entry.to_owned(),
                reason,
            };
            if entry.is_empty() {
                return Err(invalid("an empty entry"));
            }
            if !entry.ends_with('.') || entry.starts_with('.') || entry.contains("..") {
                return Err(invalid(
                    "expected whole subject tokens ending with a dot, e.g. _INBOX.",
                ));
            }
            if entry.contains(['*', '>', ' ', '\t']) {
                return Err(invalid("a prefix holds no wildcard or blank"));
            }
            let placeholders = entry.matches(TENANT_PLACEHOLDER).count();
            let without = entry.replace(TENANT_PLACEHOLDER, "");
            if placeholders > 1 || without.contains(['{', '}']) {
                return Err(invalid("the only placeholder is {tenant}, at most once"));
            }
            prefixes.push(entry.to_owned());
        }
        Ok(Self { prefixes })
    }

    /// Whether an entry confines tenants to their own inboxes.
    pub fn names_tenants(&self) -> bool {
        self.prefixes.iter().any(|p| p.contains(TENANT_PLACEHOLDER))
    }

    /// clap's parser of the setting.
    pub fn parse_arg(value: &str) -> Result<Self, ReplyInboxesError> {
        Self::parse(value)
    }

    /// Whether a request (on a tenant subject: `tenant` is its tenant) may
    /// be answered on `reply`.
    pub fn permits(&self, reply: &str, tenant: Option<&str>) -> bool {
        // A reply subject is a plain subject: no wildcard, no empty token.
        if reply.is_empty()
            || reply.contains(['*', '>', ' ', '\t', '\r', '\n'])
            || reply.split('.').any(str::is_empty)
        {
            return false;
        }
        self.prefixes.iter().any(|prefix| {
            let allowed = match (prefix.split_once(TENANT_PLACEHOLDER), tenant) {
                (None, _) => std::borrow::Cow::Borrowed(prefix.as_str()),
                (Some((head, tail)), Some(tenant)) if !tenant.is_empty() => {
                    std::borrow::Cow::Owned(format!("{head}{tenant}{tail}"))
                }
                (Some(_), _) => return false,
            };
            reply.len() > allowed.len() && reply.starts_with(allowed.as_ref())
        })
    }
}

impl std::fmt::Display for ReplyInboxes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.prefixes.join(","))
    }
}

/// How `NATS_URL` is named in messages.
pub const NATS_URL_OPTION: &str = "NATS_URL (--nats-url)";
/// How `NATS_RESPONDER_URL` is named in messages.
pub const NATS_RESPONDER_URL_OPTION: &str = "NATS_RESPONDER_URL (--nats-responder-url)";

/// An entry of `NATS_URL` that is not a NATS server URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {option} entry {entry:?}: {reason}")]
pub struct NatsUrlError {
    /// The setting, as named in messages.
    pub option: &'static str,
    /// The entry, credentials redacted.
    pub entry: String,
    pub reason: String,
}

/// The servers of a `NATS_URL`: one URL or a comma-separated list (blanks
/// around entries ignored). Each entry is `nats://` or `tls://` (a bare
/// `host:port` means `nats://`) with a host; user and password, when given,
/// must be the same in every entry that names them (the client sends one).
pub fn parse_nats_urls(value: &str) -> Result<Vec<async_nats::ServerAddr>, NatsUrlError> {
    parse_nats_urls_of(NATS_URL_OPTION, value)
}

/// [`parse_nats_urls`] for the setting named `option` in messages.
pub fn parse_nats_urls_of(
    option: &'static str,
    value: &str,
) -> Result<Vec<async_nats::ServerAddr>, NatsUrlError> {
    let invalid = |entry: &str, reason: &str| NatsUrlError {
        option,
        entry: redact_nats_entry(entry),
        reason: reason.to_owned(),
    };
    if value.trim().is_empty() {
        return Err(invalid(value, "no URL given"));
    }
    let mut servers = Vec::new();
    let mut credentials: Option<(String, Option<String>)> = None;
    for entry in value.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err(invalid(
                entry,
                "an empty entry (two commas, or a comma at an end)",
            ));
        }
        let with_scheme = if entry.contains("://") {
            entry.to_owned()
        } else {
            format!("nats://{entry}")
        };
        let url = url::Url::parse(&with_scheme).map_err(|e| invalid(entry, &e.to_string()))?;
        match url.scheme() {
            "nats" | "tls" => {}
            other => {
                return Err(invalid(
                    entry,
                    &format!("expected a nats:// or tls:// URL, not {other}"),
                ));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid(entry, "the URL has no host"));
        }
        if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
            return Err(invalid(entry, "the URL has a path, query or fragment"));
        }
        if !url.username().is_empty() {
            let these = (url.username().to_owned(), url.password().map(str::to_owned));
            match &credentials {
                Some(first) if *first != these => {
                    return Err(invalid(
                        entry,
                        "its credentials differ from an earlier entry's (the client sends one user)",
                    ));
                }
                Some(_) => {}
                None => credentials = Some(these),
            }
        }
        let addr =
            async_nats::ServerAddr::from_url(url).map_err(|e| invalid(entry, &e.to_string()))?;
        servers.push(addr);
    }
    Ok(servers)
}

/// `NATS_URL` (one URL or a list) for messages: each entry's credentials
/// redacted. A raw comma in a password splits it across two entries: a
/// piece with `@` loses all before it, and a piece whose port is not a
/// number is redacted whole, so no part of it is shown either way.
pub fn redact_nats_urls(value: &str) -> String {
    value
        .split(',')
        .map(|entry| redact_nats_entry(entry.trim()))
        .collect::<Vec<_>>()
        .join(",")
}

fn redact_nats_entry(entry: &str) -> String {
    let (scheme, rest) = match entry.find("://") {
        Some(end) => entry.split_at(end + 3),
        None => ("", entry),
    };
    if let Some(at) = rest.rfind('@') {
        return format!("{scheme}[redacted]@{}", &rest[at + 1..]);
    }
    let authority = rest.split('/').next().unwrap_or_default();
    match authority.rsplit_once(':') {
        Some((_, port)) if !port.chars().all(|c| c.is_ascii_digit()) => {
            format!("{scheme}[redacted]")
        }
        _ => entry.to_owned(),
    }
}

/// clap's check of `--nats-url` (`value_parser = NatsUrlParser`): the value
/// is kept as given. Its error is ours alone: clap's own would quote the
/// whole value, credentials included.
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsUrlParser;

/// [`NatsUrlParser`] of `--nats-responder-url`.
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsResponderUrlParser;

impl clap::builder::TypedValueParser for NatsResponderUrlParser {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        parse_url_arg(NATS_RESPONDER_URL_OPTION, cmd, value)
    }
}

impl clap::builder::TypedValueParser for NatsUrlParser {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        parse_url_arg(NATS_URL_OPTION, cmd, value)
    }
}

fn parse_url_arg(
    option: &'static str,
    cmd: &clap::Command,
    value: &std::ffi::OsStr,
) -> Result<String, clap::Error> {
    use clap::error::ErrorKind;
    let value = value.to_str().ok_or_else(|| {
        clap::Error::raw(
            ErrorKind::InvalidUtf8,
            format!("invalid {option}: not UTF-8\n"),
        )
        .with_cmd(cmd)
    })?;
    parse_nats_urls_of(option, value)
        .map(|_| value.to_owned())
        .map_err(|e| clap::Error::raw(ErrorKind::ValueValidation, format!("{e}\n")).with_cmd(cmd))
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid CTXSYNC_SUBJECT_PREFIX {value:?}: {source}")]
    SubjectPrefix {
        value: String,
        #[source]
        source: SubjectError,
    },
    #[error("invalid CTXSYNC_OTLP_ENDPOINT {value:?}: {reason}")]
    OtlpEndpoint { value: String, reason: String },
    #[error("invalid {env} {value:?}: {reason}")]
    Http {
        env: &'static str,
        value: String,
        reason: String,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// Strips user info from a URL (NATS or Postgres) for error messages.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}[redacted]@{}", &url[..scheme_end + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_url_is_one_url_or_a_list() {
        let hosts = |value: &str| -> Vec<String> {
            parse_nats_urls(value)
                .unwrap_or_else(|e| panic!("{value}: {e}"))
                .iter()
                .map(|addr| format!("{}:{}", addr.host(), addr.port()))
                .collect()
        };
        assert_eq!(hosts("nats://127.0.0.1:4222"), ["127.0.0.1:4222"]);
        assert_eq!(
            hosts("nats://a:4222, nats://b:4223 ,tls://c:4224"),
            ["a:4222", "b:4223", "c:4224"]
        );
        // A bare host:port is nats://, the port defaults to 4222.
        assert_eq!(hosts("a:5000,b"), ["a:5000", "b:4222"]);
        // The same credentials may be repeated.
        assert_eq!(
            parse_nats_urls("nats://u:pw@a:1,nats://u:pw@b:2,nats://c:3")
                .unwrap()
                .len(),
            3
        );
        // The flag and the env var take the list as it is.
        let parsed = parse(&["--nats-url", "nats://a:1,nats://b:2"]).unwrap();
        assert_eq!(parsed.nats_url, "nats://a:1,nats://b:2");
    }

    #[test]
    fn a_bad_nats_url_entry_is_named_without_credentials() {
        for (given, entry, reason) in [
            ("", "", "no URL given"),
            (" , ", "", "an empty entry"),
            ("nats://a:1,,nats://b:2", "", "an empty entry"),
            ("nats://a:1,", "", "an empty entry"),
            (
                "nats://a:1,http://b:2",
                "http://b:2",
                "expected a nats:// or tls:// URL, not http",
            ),
            // A port that is not a number may be a password cut at a comma.
            (
                "nats://a:1,nats://b:port",
                "nats://[redacted]",
                "invalid port number",
            ),
            (
                "nats://u:se,cret@a:1",
                "nats://[redacted]",
                "invalid port number",
            ),
            ("nats://u:secret@a:1,nats://:2", "nats://:2", "empty host"),
            (
                "nats://a:1/path",
                "nats://a:1/path",
                "path, query or fragment",
            ),
            (
                "nats://u:secret@a:1,nats://v:secret2@b:2",
                "nats://[redacted]@b:2",
                "credentials differ",
            ),
            ("ftp://u:secret@a:1", "ftp://[redacted]@a:1", "not ftp"),
        ] {
            let message = parse_nats_urls(given).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!("invalid NATS_URL (--nats-url) entry {entry:?}: ")),
                "{given}: {message}"
            );
            assert!(message.contains(reason), "{given}: {message}");
            assert!(!message.contains("secret"), "{message}");
            // clap refuses the same value naming the same entry, and
            // quotes nothing else of it.
            let refused = parse(&["--nats-url", given]).unwrap_err();
            assert!(refused.contains(&message), "{refused}");
            assert!(!refused.contains("secret"), "{refused}");
        }
    }

    #[test]
    fn a_list_of_nats_urls_is_redacted_entry_by_entry() {
        assert_eq!(
            redact_nats_urls("nats://u:pw@a:1, nats://b:2,tls://t0ken@c"),
            "nats://[redacted]@a:1,nats://b:2,tls://[redacted]@c"
        );
        // A raw comma in a password shows no part of it.
        let shown = redact_nats_urls("nats://user:se,cret@a:1");
        assert!(!shown.contains("se") && !shown.contains("cret"), "{shown}");
    }

    fn traces_url(endpoint: &str) -> Result<Option<String>, ConfigError> {
        CommonArgs {
            otlp_endpoint: Some(endpoint.to_owned()),
            ..CommonArgs::for_nats("nats://127.0.0.1:4222", "ctxsync")
        }
        .otlp_traces_url()
    }

    #[test]
    fn otlp_endpoint_is_a_base_url_of_http() {
        let unset = CommonArgs::for_nats("nats://127.0.0.1:4222", "ctxsync");
        assert_eq!(unset.otlp_traces_url().unwrap(), None);
        assert_eq!(traces_url("  ").unwrap(), None);
        for (given, used) in [
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            (
                "http://collector:4318/otlp",
                "http://collector:4318/otlp/v1/traces",
            ),
            (
                "http://collector:4318/v1/traces",
                "http://collector:4318/v1/traces",
            ),
        ] {
            assert_eq!(traces_url(given).unwrap().as_deref(), Some(used), "{given}");
        }
    }

    #[test]
    fn a_bad_otlp_endpoint_names_the_variable_and_the_value() {
        for (given, reason) in [
            ("collector:4318", "expected an http URL, not collector"),
            ("not a url", "relative URL without a base"),
            ("https://collector:4318", "https is not supported"),
            ("grpc://collector:4317", "expected an http URL, not grpc"),
            ("http://collector:4318/?x=1", "query or fragment"),
        ] {
            let message = traces_url(given).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!("invalid CTXSYNC_OTLP_ENDPOINT {given:?}: ")),
                "{message}"
            );
            assert!(message.contains(reason), "{message}");
        }
        for given in [
            "ftp://user:secret@collector",
            "http://user:secret@collector:4318",
        ] {
            let message = traces_url(given).unwrap_err().to_string();
            assert!(!message.contains("secret"), "{message}");
            assert!(message.contains("[redacted]@collector"), "{message}");
        }
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        common: CommonArgs,
    }

    fn parse(args: &[&str]) -> Result<CommonArgs, String> {
        use clap::Parser as _;
        Cli::try_parse_from(std::iter::once("service").chain(args.iter().copied()))
            .map(|cli| cli.common)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn http_limits_default_to_the_documented_values() {
        let limits = parse(&[]).unwrap().http.limits().unwrap();
        assert_eq!(limits, HttpLimits::default());
        assert_eq!(limits.header_timeout(), Duration::from_secs(10));
        assert_eq!(limits.body_timeout(), Duration::from_secs(30));
        assert_eq!(limits.idle_timeout(), Duration::from_secs(60));
        assert_eq!(limits.max_connections(), 1024);
        let set = parse(&[
            "--http-header-timeout",
            "2s",
            "--http-body-timeout",
            "500ms",
            "--http-idle-timeout",
            "1m",
            "--http-max-connections",
            "7",
        ])
        .unwrap()
        .http
        .limits()
        .unwrap();
        assert_eq!(
            set,
            HttpLimits::new(
                Duration::from_secs(2),
                Duration::from_millis(500),
                Duration::from_secs(60),
                7
            )
            .unwrap()
        );
    }

    #[test]
    fn a_bad_http_limit_names_the_variable_and_the_value() {
        for (flag, value, env, reason) in [
            (
                "--http-header-timeout",
                "0s",
                "CTXSYNC_HTTP_HEADER_TIMEOUT",
                "above zero",
            ),
            (
                "--http-body-timeout",
                "soon",
                "CTXSYNC_HTTP_BODY_TIMEOUT",
                "",
            ),
            (
                "--http-idle-timeout",
                "400days",
                "CTXSYNC_HTTP_IDLE_TIMEOUT",
                "at most 1day",
            ),
            (
                "--http-max-connections",
                "0",
                "CTXSYNC_HTTP_MAX_CONNECTIONS",
                "at least 1",
            ),
            (
                "--http-max-connections",
                "many",
                "CTXSYNC_HTTP_MAX_CONNECTIONS",
                "",
            ),
        ] {
            let message = parse(&[flag, value]).unwrap_err();
            assert!(
                message.contains(&format!("invalid {env} {value:?}: ")),
                "{message}"
            );
            assert!(message.contains(reason), "{message}");
        }
        // Set without the parser, they are refused when the service starts.
        let zero = HttpArgs {
            http_idle_timeout: Duration::ZERO,
            ..HttpArgs::default()
        };
        assert_eq!(
            zero.limits().unwrap_err().to_string(),
            "invalid CTXSYNC_HTTP_IDLE_TIMEOUT \"0s\": must be above zero"
        );
        assert!(
            HttpLimits::new(
                Duration::from_secs(1),
                Duration::from_secs(1),
                Duration::from_secs(1),
                0
            )
            .unwrap_err()
            .to_string()
            .starts_with("invalid CTXSYNC_HTTP_MAX_CONNECTIONS \"0\"")
        );
    }
}
