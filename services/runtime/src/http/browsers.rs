//! Which browsers' requests an API answers: the defence against DNS
//! rebinding the MCP transport specification asks for (a server MUST
//! validate `Origin` and answer an invalid one 403). A page of another site
//! whose name an attacker points at this listener sends that name as `Host`
//! and its own `Origin`: so a request is answered only when its `Host` is an
//! allowed host (the loopback names by default, for local use) and, when it
//! carries an `Origin` (browsers do on fetches), that origin is the
//! listener's own (its authority is the `Host`) or an allowed origin.
//! Clients that are not browsers send no `Origin` and pass on `Host` alone.
//! Applied to the routes a browser could reach (the gate's API and page,
//! the catalog's `/mcp`), never to `/healthz`, `/readyz` and `/metrics`,
//! which probes and scrapers ask by address.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;

const ALLOWED_HOSTS_ENV: &str = "CTXSYNC_HTTP_ALLOWED_HOSTS";
const ALLOWED_ORIGINS_ENV: &str = "CTXSYNC_HTTP_ALLOWED_ORIGINS";

/// The flags of a listener browsers could reach.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct BrowserArgs {
    /// Host names (or `host:port`) the API answers, comma-separated; `*`
    /// answers any (a proxy in front checks it). Add the names clients use
    /// in a deployment.
    #[arg(long, env = ALLOWED_HOSTS_ENV, default_value = "localhost,127.0.0.1,[::1]", value_parser = AllowedHosts::parse_arg)]
    pub http_allowed_hosts: AllowedHosts,

    /// Browser origins (`scheme://host[:port]`, comma-separated) whose
    /// requests the API answers besides its own; `*` any. Unset: only the
    /// listener's own pages (and clients that send no Origin).
    #[arg(long, env = ALLOWED_ORIGINS_ENV, default_value = "", value_parser = AllowedOrigins::parse_arg)]
    pub http_allowed_origins: AllowedOrigins,
}

/// The flags' defaults.
impl Default for BrowserArgs {
    fn default() -> Self {
        crate::args::defaults()
    }
}

/// A list setting that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid {setting} entry {entry:?}: {reason}")]
pub struct BrowserArgsError {
    setting: &'static str,
    entry: String,
    reason: &'static str,
}

/// `CTXSYNC_HTTP_ALLOWED_HOSTS`: names, each with or without a port, or `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts(Vec<String>);

/// `CTXSYNC_HTTP_ALLOWED_ORIGINS`: `scheme://host[:port]` entries, or `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedOrigins(Vec<String>);

fn entries(value: &str) -> impl Iterator<Item = String> + '_ {
    value
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(str::to_ascii_lowercase)
}

impl AllowedHosts {
    pub fn parse(value: &str) -> Result<Self, BrowserArgsError> {
        let hosts: Vec<String> = entries(value).collect();
        for entry in &hosts {
            let invalid = |reason| BrowserArgsError {
                setting: ALLOWED_HOSTS_ENV,
                entry: entry.clone(),
                reason,
            };
            if entry.contains("://") || entry.contains('/') {
                return Err(invalid("a host name or host:port, not a URL"));
            }
            if entry != "*" && split_authority(entry).is_none() {
                return Err(invalid("a host name or host:port"));
            }
        }
        Ok(Self(hosts))
    }

    pub fn parse_arg(value: &str) -> Result<Self, String> {
        Self::parse(value).map_err(|e| e.to_string())
    }

    /// Whether a request's `Host` (`name[:port]`) is one of these.
    fn permits(&self, authority: &str) -> bool {
        let authority = authority.to_ascii_lowercase();
        let Some((name, _)) = split_authority(&authority) else {
            return false;
        };
        self.0
            .iter()
            .any(|entry| entry == "*" || *entry == authority || *entry == name)
    }
}

impl AllowedOrigins {
    pub fn parse(value: &str) -> Result<Self, BrowserArgsError> {
        let origins: Vec<String> = entries(value).collect();
        for entry in &origins {
            let well_formed = entry == "*"
                || entry.split_once("://").is_some_and(|(scheme, authority)| {
                    matches!(scheme, "http" | "https")
                        && !authority.contains('/')
                        && split_authority(authority).is_some()
                });
            if !well_formed {
                return Err(BrowserArgsError {
                    setting: ALLOWED_ORIGINS_ENV,
                    entry: entry.clone(),
                    reason: "an origin: http:// or https://, a host and an optional port, no path",
                });
            }
        }
        Ok(Self(origins))
    }

    pub fn parse_arg(value: &str) -> Result<Self, String> {
        Self::parse(value).map_err(|e| e.to_string())
    }

    fn permits(&self, origin: &str) -> bool {
        let origin = origin.to_ascii_lowercase();
        self.0.iter().any(|entry| entry == "*" || *entry == origin)
    }
}

/// `name[:port]` split, the name of an IPv6 literal in brackets; `None`
/// when it is no authority.
fn split_authority(authority: &str) -> Option<(&str, Option<&str>)> {
    let (name, port) = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let (name, rest) = authority.split_at(end + 1);
        match rest {
            "" => (name, None),
            rest => (name, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (authority, None),
        }
    };
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b));
    (port_ok && name_ok).then_some((name, port))
}

impl fmt::Display for AllowedHosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

impl fmt::Display for AllowedOrigins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

impl serde::Serialize for AllowedHosts {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl serde::Serialize for AllowedOrigins {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Why a request was refused, if it was. The Host is the header's, or the
/// request target's authority where it has one (HTTP/2, absolute form).
fn refusal(args: &BrowserArgs, headers: &HeaderMap, target: Option<&str>) -> Option<&'static str> {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or(target);
    let Some(host) = host.filter(|host| args.http_allowed_hosts.permits(host)) else {
        return Some("host");
    };
    let origin = headers.get(header::ORIGIN)?;
    let Ok(origin) = origin.to_str() else {
        return Some("origin");
    };
    let own = origin
        .split_once("://")
        .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host));
    (!own && !args.http_allowed_origins.permits(origin)).then_some("origin")
}

/// The middleware (`axum::middleware::from_fn_with_state`): a request whose
/// `Host` or `Origin` is not allowed is answered 403 and counted in
/// `ctxsync_http_browser_refused_total{reason}`.
pub async fn guard(State(args): State<Arc<BrowserArgs>>, request: Request, next: Next) -> Response {
    let target = request.uri().authority().map(|a| a.as_str());
    match refusal(&args, request.headers(), target) {
        None => next.run(request).await,
        Some(reason) => {
            metrics::counter!("ctxsync_http_browser_refused_total", "reason" => reason)
                .increment(1);
            let (setting, what) = match reason {
                "host" => (ALLOWED_HOSTS_ENV, "its Host"),
                _ => (ALLOWED_ORIGINS_ENV, "its Origin"),
            };
            tracing::debug!(reason, "request refused: {what} is not allowed");
            crate::tenant_keys::error_response(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("{what} is not allowed here ({setting})"),
            )
        }
    }
}

/// `router` answering only the requests [`guard`] lets through.
pub fn guarded(router: axum::Router, args: &BrowserArgs) -> axum::Router {
    router.layer(axum::middleware::from_fn_with_state(
        Arc::new(args.clone()),
        guard,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(args: &BrowserArgs, headers: &HeaderMap) -> Option<&'static str> {
        refusal(args, headers, None)
    }

    #[test]
    fn without_a_host_header_the_request_targets_authority_is_checked() {
        let args = BrowserArgs::default();
        let none = headers(None, None);
        assert_eq!(refusal(&args, &none, Some("127.0.0.1:8080")), None);
        assert_eq!(
            refusal(&args, &none, Some("evil.example.com")),
            Some("host")
        );
    }

    fn headers(host: Option<&str>, origin: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(host) = host {
            headers.insert(header::HOST, host.parse().unwrap());
        }
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, origin.parse().unwrap());
        }
        headers
    }

    #[test]
    fn loopback_hosts_pass_by_default_and_a_rebound_name_does_not() {
        let args = BrowserArgs::default();
        for host in ["localhost:8080", "127.0.0.1:9", "[::1]:80", "LOCALHOST"] {
            assert_eq!(refused(&args, &headers(Some(host), None)), None, "{host}");
        }
        for host in ["evil.example.com", "evil.example.com:8080", "127.0.0.2"] {
            assert_eq!(refused(&args, &headers(Some(host), None)), Some("host"));
        }
        assert_eq!(refused(&args, &headers(None, None)), Some("host"));
    }

    #[test]
    fn an_origin_passes_when_it_is_the_listeners_own_or_allowed() {
        let mut args = BrowserArgs::default();
        let own = headers(Some("127.0.0.1:8080"), Some("http://127.0.0.1:8080"));
        assert_eq!(refused(&args, &own), None);
        let other = headers(Some("127.0.0.1:8080"), Some("http://evil.example.com"));
        assert_eq!(refused(&args, &other), Some("origin"));
        let port = headers(Some("127.0.0.1:8080"), Some("http://127.0.0.1:9999"));
        assert_eq!(refused(&args, &port), Some("origin"));
        assert_eq!(
            refused(&args, &headers(Some("localhost"), Some("null"))),
            Some("origin")
        );
        args.http_allowed_origins = AllowedOrigins::parse("https://chat.example.com").unwrap();
        let allowed = headers(Some("localhost:1"), Some("https://CHAT.example.com"));
        assert_eq!(refused(&args, &allowed), None);
    }

    #[test]
    fn configured_hosts_match_with_or_without_a_port_and_star_matches_any() {
        let mut args = BrowserArgs {
            http_allowed_hosts: AllowedHosts::parse("gate.example.com, mcp.example.com:443")
                .unwrap(),
            ..BrowserArgs::default()
        };
        assert_eq!(
            refused(&args, &headers(Some("gate.example.com:8080"), None)),
            None
        );
        assert_eq!(
            refused(&args, &headers(Some("mcp.example.com:443"), None)),
            None
        );
        assert_eq!(
            refused(&args, &headers(Some("mcp.example.com:80"), None)),
            Some("host")
        );
        assert_eq!(
            refused(&args, &headers(Some("localhost"), None)),
            Some("host")
        );
        args.http_allowed_hosts = AllowedHosts::parse("*").unwrap();
        assert_eq!(
            refused(&args, &headers(Some("anything.example"), None)),
            None
        );
    }

    #[test]
    fn malformed_entries_are_refused_naming_the_setting() {
        let error = AllowedHosts::parse("http://gate.example.com").unwrap_err();
        assert!(error.to_string().contains(ALLOWED_HOSTS_ENV), "{error}");
        let error = AllowedOrigins::parse("gate.example.com").unwrap_err();
        assert!(error.to_string().contains(ALLOWED_ORIGINS_ENV), "{error}");
        assert!(AllowedOrigins::parse("https://a.example/path").is_err());
        assert_eq!(
            AllowedHosts::parse(" a.example ,b.example:8")
                .unwrap()
                .to_string(),
            "a.example,b.example:8"
        );
    }
}
