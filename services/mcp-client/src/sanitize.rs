//! Error sanitizer (design note: sanitized errors): removes from an error
//! text every secret a server process could have seen of its configuration,
//! and nothing else: the structure around a secret (a URL's scheme, host and
//! path, the working directory, home, PATH, ordinary words) stays readable.
//!
//! Secrets are found by VALUE, not by name: a server that echoes its whole
//! environment on failure must not leak a variable whose name looks harmless.
//! What is replaced with `[redacted]`:
//! * the values of the server's configured env (what the config file set);
//! * of the inherited environment (what the server process also sees): the
//!   values of variables whose name looks secret ([`is_secret_env_name`]),
//!   and any other value that looks secret ([`looks_secret`]: a token-like
//!   word of at least [`MIN_INHERITED_SECRET_LEN`] bytes mixing letters and
//!   digits, or a known token prefix). Paths, URLs (judged by their parts),
//!   words and the well-known system variables ([`is_harmless_env_name`]) stay;
//! * header values, and for `Scheme credential` values (`Bearer x`, `Basic x`)
//!   the credential alone; a `Basic` credential's decoded `user:password` too;
//! * stdio arguments: a flag's attached value (`--flag=value`, `-f=value`,
//!   `-fvalue` as getopt reads it), the argument after a flag whose name
//!   looks secret (`--token M`, `-p M`), and any argument that looks secret;
//!   the command, subcommands (`start`), package names and paths stay;
//! * of a configured URL: userinfo, query values, fragment, and path segments
//!   that look secret;
//! * of any URL found in the text: the same (scheme, host, port, path and
//!   query keys stay).
//!
//! Values shorter than [`MIN_SECRET_LEN`] bytes are not replaced: replacing `1`
//! or `on` everywhere would shred the text and hide nothing worth hiding.
//! Matching is leftmost-longest over all values at once, so a longer secret
//! wins over a secret it contains and replacements are never re-matched.
//! Control characters are cleaned ([`crate::clean_text`]) and the result is
//! capped at [`MAX_SANITIZED_LEN`] bytes on a char boundary, AFTER every
//! secret was replaced (a cut never leaves a fragment of a secret). A long
//! text with a server's stderr (`…; stderr: …`) keeps its head and the END of
//! the stderr, the part that says why the server stopped.

use std::collections::BTreeSet;

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine as _;

use crate::spec::{ServerSpec, TransportSpec};

/// Replacement for every secret.
pub const REDACTED: &str = "[redacted]";
/// Values shorter than this (in bytes) are left alone.
pub const MIN_SECRET_LEN: usize = 6;
/// A value whose name does not say it is secret must be at least this long
/// (in bytes) to look secret ([`looks_secret`]): shorter ones (`1`, `true`,
/// `info`, `0.1.0`) are settings.
pub const MIN_INHERITED_SECRET_LEN: usize = 8;
/// Maximum length of a sanitized text, in bytes.
pub const MAX_SANITIZED_LEN: usize = 4096;
const TRUNCATED_MARK: &str = " [truncated]";
const TRUNCATED_START: &str = "[truncated] ";
/// Where a server's stderr starts in an error text ([`crate::McpError`]).
const STDERR_MARK: &str = "; stderr: ";

/// Sanitizes error texts of one server. Cheap to reuse; build once per server.
#[derive(Clone, Debug)]
pub struct Sanitizer {
    matcher: Option<AhoCorasick>,
    secret_count: usize,
}

impl Sanitizer {
    /// A sanitizer for `spec` that also treats this process's environment
    /// values (which the server inherits) as secrets.
    pub fn for_server(spec: &ServerSpec) -> Sanitizer {
        Self::with_inherited_env(spec, process_env())
    }

    /// A sanitizer for `spec` with an explicit inherited environment (tests,
    /// or a process that passes its children a curated environment).
    pub fn with_inherited_env(
        spec: &ServerSpec,
        inherited: impl IntoIterator<Item = (String, String)>,
    ) -> Sanitizer {
        Self::with_secrets(spec, inherited, std::iter::empty())
    }

    /// [`Sanitizer::with_inherited_env`] plus values known to be secret
    /// wherever they appear (a variable expanded into the configuration).
    pub fn with_secrets(
        spec: &ServerSpec,
        inherited: impl IntoIterator<Item = (String, String)>,
        extra: impl IntoIterator<Item = String>,
    ) -> Sanitizer {
        let mut secrets = BTreeSet::new();
        for value in extra {
            add_value(&mut secrets, &value);
        }
        for (name, value) in inherited {
            let secret =
                is_secret_env_name(&name) || (!is_harmless_env_name(&name) && looks_secret(&value));
            if secret {
                add_value(&mut secrets, &value);
            }
        }
        match &spec.transport {
            TransportSpec::Stdio { args, env, .. } => {
                for value in env.values() {
                    add_value(&mut secrets, value);
                }
                add_args(&mut secrets, args);
            }
            TransportSpec::StreamableHttp { url, headers }
            | TransportSpec::Sse { url, headers } => {
                add_url_parts(&mut secrets, url);
                for value in headers.values() {
                    add_header_value(&mut secrets, value);
                }
            }
        }
        Self::from_secrets(secrets)
    }

    fn from_secrets(secrets: BTreeSet<String>) -> Sanitizer {
        let patterns: Vec<String> = secrets
            .into_iter()
            .filter(|s| s.len() >= MIN_SECRET_LEN)
            .collect();
        let secret_count = patterns.len();
        let matcher = if patterns.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .expect("secret patterns are plain strings"),
            )
        };
        Sanitizer {
            matcher,
            secret_count,
        }
    }

    /// How many distinct values this sanitizer replaces (for logs and tests).
    pub fn secret_count(&self) -> usize {
        self.secret_count
    }

    /// `text` with every secret replaced, URLs scrubbed, control characters
    /// cleaned ([`crate::clean_text`]) and the length capped.
    pub fn sanitize(&self, text: &str) -> String {
        let redacted = self.redact(text);
        // Cleaning drops escape sequences, which can join the parts of a
        // secret (or a URL) it split: redact again whatever the cleaning changed.
        let cleaned = match crate::text::clean_text(&redacted) {
            std::borrow::Cow::Borrowed(_) => redacted,
            std::borrow::Cow::Owned(cleaned) => self.redact(&cleaned),
        };
        cap(cleaned)
    }

    fn redact(&self, text: &str) -> String {
        let scrubbed = scrub_urls(text);
        match &self.matcher {
            Some(matcher) => matcher.replace_all(&scrubbed, &vec![REDACTED; self.secret_count]),
            None => scrubbed,
        }
    }
}

/// This process's environment; variables that are not UTF-8 cannot appear
/// in a UTF-8 error text as they are, and are skipped.
pub fn process_env() -> impl Iterator<Item = (String, String)> {
    std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
}

/// Whether a value reads as a credential although nothing names it one: a
/// single word of at least [`MIN_INHERITED_SECRET_LEN`] bytes with at least
/// two letters and two digits (`hunter22`, `a1b2c3d4e5f6`), or one starting
/// with a well-known token prefix (`sk-`, `ghp_`, `xoxb-`, `AKIA`, `eyJ`, …).
/// Paths (`/…`, `./…`, `~/…`), package names (`@scope/pkg@1.2`), URLs,
/// versions and plain words do not.
pub fn looks_secret(value: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "sk-",
        "sk_",
        "pk_",
        "rk_",
        "ghp_",
        "gho_",
        "ghu_",
        "ghs_",
        "ghr_",
        "github_pat_",
        "glpat-",
        "xoxa-",
        "xoxb-",
        "xoxp-",
        "xoxs-",
        "AKIA",
        "ASIA",
        "eyJ",
        "npm_",
        "hf_",
    ];
    let value = value.trim();
    if value.len() < MIN_INHERITED_SECRET_LEN || value.chars().any(char::is_whitespace) {
        return false;
    }
    if value.starts_with(['/', '.', '~', '@']) || value.contains("://") {
        return false;
    }
    if PREFIXES.iter().any(|prefix| value.starts_with(prefix)) {
        return true;
    }
    let digits = value.chars().filter(char::is_ascii_digit).count();
    let letters = value.chars().filter(char::is_ascii_alphabetic).count();
    let version = value
        .trim_start_matches('v')
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | '+'));
    digits >= 2 && letters >= 2 && !version
}

/// Well-known system variables whose values are not secrets (paths, locale,
/// terminal): kept in error texts, where they make paths readable. Anything
/// else inherited is a secret from [`MIN_INHERITED_SECRET_LEN`] bytes on.
pub fn is_harmless_env_name(name: &str) -> bool {
    const NAMES: &[&str] = &[
        "PATH",
        "HOME",
        "PWD",
        "OLDPWD",
        "SHELL",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TERM",
        "COLORTERM",
        "TERM_PROGRAM",
        "TZ",
        "TMPDIR",
        "TMP",
        "TEMP",
        "HOSTNAME",
        "SHLVL",
        "_",
    ];
    NAMES.contains(&name) || name.starts_with("LC_")
}

/// Whether an inherited env var's name says its value is a secret.
pub fn is_secret_env_name(name: &str) -> bool {
    let name = name.to_ascii_uppercase();
    const CONTAINS: &[&str] = &[
        "SECRET",
        "TOKEN",
        "PASSWORD",
        "PASSWD",
        "CREDENTIAL",
        "API_KEY",
        "APIKEY",
        "PRIVATE_KEY",
        "ACCESS_KEY",
        "AUTH",
        "COOKIE",
        "SESSION",
        "DATABASE_URL",
        "_DSN",
    ];
    CONTAINS.iter().any(|needle| name.contains(needle)) || name.ends_with("KEY") || name == "DSN"
}

fn add_value(secrets: &mut BTreeSet<String>, value: &str) {
    let value = value.trim();
    if value.is_empty() {
        return;
    }
    secrets.insert(value.to_string());
    // The same value as it appears in Debug output or JSON strings.
    secrets.insert(value.escape_debug().to_string());
    if let Ok(json) = serde_json::to_string(value) {
        secrets.insert(json[1..json.len() - 1].to_string());
    }
    // A secret that is a URL (DATABASE_URL) also leaks through its parts.
    if value.contains("://") {
        add_url_parts(secrets, value);
    }
}

/// A flag's value is secret; so is the argument after a flag whose name
/// looks secret, and any argument that looks secret. Subcommands, package
/// names and paths name what failed and stay.
fn add_args(secrets: &mut BTreeSet<String>, args: &[String]) {
    let mut secret_flag = false;
    for arg in args {
        let after_secret_flag = std::mem::take(&mut secret_flag);
        if arg == "--" {
            continue;
        }
        if let Some(long) = arg.strip_prefix("--") {
            // `--flag=value`: the value is secret, the flag name is not.
            match long.split_once('=') {
                Some((_, value)) => add_value(secrets, value),
                None => secret_flag = is_secret_flag(long),
            }
            continue;
        }
        if let Some(short) = arg.strip_prefix('-')
            && !short.is_empty()
        {
            // `-f=value` and `-fvalue` (getopt's attached value): whatever
            // follows the letter. Bundled switches (`-xvf`) are short and stay.
            let mut chars = short.chars();
            let letter = chars.next().unwrap_or_default();
            let rest = chars.as_str();
            if rest.is_empty() {
                secret_flag = matches!(letter, 'p' | 'P' | 'k' | 'K');
            } else {
                add_value(secrets, rest.strip_prefix('=').unwrap_or(rest));
            }
            continue;
        }
        if after_secret_flag || looks_secret(arg) {
            add_value(secrets, arg);
        }
    }
}

/// `token`, `api-key`, `password`, …: the argument after it is its value.
fn is_secret_flag(name: &str) -> bool {
    let name = name.replace('-', "_").to_ascii_uppercase();
    is_secret_env_name(&name) || matches!(name.as_str(), "PASS" | "PW" | "KEY")
}

fn add_header_value(secrets: &mut BTreeSet<String>, value: &str) {
    add_value(secrets, value);
    // `Bearer xyz`, `Basic xyz`, `Token xyz`: the credential without its scheme.
    if let Some((scheme, credential)) = value.trim().split_once(' ') {
        let credential = credential.trim();
        add_value(secrets, credential);
        if scheme.eq_ignore_ascii_case("basic")
            && let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(credential)
            && let Ok(decoded) = String::from_utf8(decoded)
        {
            add_value(secrets, &decoded);
            if let Some((_, password)) = decoded.split_once(':') {
                add_value(secrets, password);
            }
        }
    }
}

/// Userinfo, query values, fragment and secret-looking path segments of a
/// configured URL, raw and percent-decoded.
fn add_url_parts(secrets: &mut BTreeSet<String>, raw: &str) {
    let Ok(url) = url::Url::parse(raw.trim()) else {
        // Not a URL we can take apart: the whole text is the secret.
        secrets.insert(raw.trim().to_string());
        return;
    };
    let mut parts = Vec::new();
    if !url.username().is_empty() {
        parts.push(url.username().to_string());
    }
    if let Some(password) = url.password() {
        parts.push(password.to_string());
        parts.push(format!("{}:{}", url.username(), password));
    }
    parts.extend(
        url.path()
            .split('/')
            .filter(|segment| segment_is_secret(segment))
            .map(str::to_string),
    );
    if let Some(query) = url.query() {
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some((_, value)) => parts.push(value.to_string()),
                None => parts.push(pair.to_string()),
            }
        }
    }
    if let Some(fragment) = url.fragment() {
        parts.push(fragment.to_string());
    }
    for part in parts {
        if part.is_empty() {
            continue;
        }
        if let Ok(decoded) = percent_decode(&part) {
            secrets.insert(decoded);
        }
        secrets.insert(part);
    }
}

fn segment_is_secret(segment: &str) -> bool {
    looks_secret(segment) || percent_decode(segment).is_ok_and(|decoded| looks_secret(&decoded))
}

fn percent_decode(text: &str) -> Result<String, std::string::FromUtf8Error> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(high), Some(low)) = (hex_value(bytes[i + 1]), hex_value(bytes[i + 2]))
        {
            out.push(high << 4 | low);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out)
}

fn hex_value(byte: u8) -> Option<u8> {
    (byte as char).to_digit(16).map(|d| d as u8)
}

/// Scrubs every `scheme://…` URL in `text` down to scheme, host and port.
fn scrub_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(sep) = rest.find("://") {
        let scheme_start = rest[..sep]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.'))
            .map_or(0, |i| i + 1);
        let end = rest[sep..]
            .find(|c: char| {
                c.is_whitespace()
                    || matches!(c, '"' | '\'' | '`' | '<' | '>' | ')' | ']' | '}' | ',')
            })
            .map_or(rest.len(), |i| sep + i);
        // Punctuation that ends a sentence is not part of the URL.
        let end = scheme_start.max(sep)
            + rest[scheme_start.max(sep)..end]
                .trim_end_matches(['.', ',', ';', ':', '!', '?'])
                .len();
        let candidate = &rest[scheme_start..end];
        out.push_str(&rest[..scheme_start]);
        if scheme_start < sep {
            out.push_str(&scrub_url(candidate));
        } else {
            out.push_str(candidate);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A URL found in a text: scheme, host, port, path and query keys stay;
/// userinfo, query values, the fragment and secret-looking path segments go.
fn scrub_url(candidate: &str) -> String {
    let Ok(url) = url::Url::parse(candidate) else {
        // Unparseable after `://`: keep the scheme only.
        let scheme_end = candidate.find("://").unwrap_or(0);
        return format!("{}://{REDACTED}", &candidate[..scheme_end]);
    };
    let mut out = format!("{}://", url.scheme());
    if !url.username().is_empty() || url.password().is_some() {
        out.push_str(REDACTED);
        out.push('@');
    }
    // Host and port as written: the parser lowercases a host, and a secret
    // in a subdomain must still match the secrets found by value.
    let after_authority = &candidate[candidate.find("://").map_or(0, |i| i + 3)..];
    let authority = after_authority
        .split(['/', '?', '#'])
        .next()
        .unwrap_or_default();
    let written_host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    if url.host_str().is_some() {
        out.push_str(written_host);
    }
    // The path as written (the parser may have normalised it).
    let written_path = after_authority
        .find('/')
        .map(|i| &after_authority[i..])
        .map(|rest| rest.split(['?', '#']).next().unwrap_or_default())
        .unwrap_or_default();
    let segments: Vec<&str> = written_path
        .split('/')
        .map(|segment| {
            if segment_is_secret(segment) {
                REDACTED
            } else {
                segment
            }
        })
        .collect();
    out.push_str(&segments.join("/"));
    if let Some(query) = url.query() {
        out.push('?');
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) => format!("{key}={REDACTED}"),
                None => REDACTED.to_owned(),
            })
            .collect();
        out.push_str(&pairs.join("&"));
    }
    if url.fragment().is_some() {
        out.push('#');
        out.push_str(REDACTED);
    }
    out
}

/// Caps an already redacted text at [`MAX_SANITIZED_LEN`]: the head of the
/// text, or, when it carries a server's stderr, the head of the message (at
/// most half) and the end of the stderr.
fn cap(text: String) -> String {
    if text.len() <= MAX_SANITIZED_LEN {
        return text;
    }
    let Some(at) = text.find(STDERR_MARK) else {
        return cap_head(text, MAX_SANITIZED_LEN);
    };
    let stderr_at = at + STDERR_MARK.len();
    let head = cap_head(text[..stderr_at].to_owned(), MAX_SANITIZED_LEN / 2);
    let budget = MAX_SANITIZED_LEN - head.len() - TRUNCATED_START.len();
    let stderr = &text[stderr_at..];
    if stderr.len() <= budget {
        return head + stderr;
    }
    let mut cut = stderr.len() - budget;
    while !stderr.is_char_boundary(cut) {
        cut += 1;
    }
    format!("{head}{TRUNCATED_START}{}", &stderr[cut..])
}

fn cap_head(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut cut = max - TRUNCATED_MARK.len();
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text.push_str(TRUNCATED_MARK);
    text
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn stdio(args: &[&str], env: &[(&str, &str)]) -> ServerSpec {
        ServerSpec {
            name: "s".into(),
            transport: TransportSpec::Stdio {
                command: "my-server".into(),
                args: args.iter().map(|a| a.to_string()).collect(),
                env: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                cwd: None,
            },
        }
    }

    fn http(url: &str, headers: &[(&str, &str)]) -> ServerSpec {
        ServerSpec {
            name: "h".into(),
            transport: TransportSpec::StreamableHttp {
                url: url.into(),
                headers: headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            },
        }
    }

    fn no_env() -> Vec<(String, String)> {
        Vec::new()
    }

    #[test]
    fn configured_env_values_are_redacted() {
        let s = Sanitizer::with_inherited_env(
            &stdio(
                &[],
                &[("API_BASE", "value-one"), ("PLAIN", "harmless-looking")],
            ),
            no_env(),
        );
        let out = s.sanitize("failed with value-one and harmless-looking in it");
        assert_eq!(out, "failed with [redacted] and [redacted] in it");
    }

    #[test]
    fn a_secret_in_a_urls_host_is_redacted_as_written() {
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[("TUNNEL", "AbC123Tok9xY")]), no_env());
        let out = s.sanitize("cannot reach https://AbC123Tok9xY.ngrok.app/mcp: refused");
        assert_eq!(
            out,
            "cannot reach https://[redacted].ngrok.app/mcp: refused"
        );
    }

    #[test]
    fn inherited_secret_looking_env_values_are_redacted_and_others_kept() {
        let inherited = [
            ("GITHUB_TOKEN", "ghp_abcdef"),
            ("MY_CLIENT_SECRET", "shh-secret"),
            ("DB_PASSWORD", "hunter22"),
            ("STRIPE_KEY", "sk_live_1"),
            ("OPENAI_API_KEY", "sk-openai"),
            ("AWS_CREDENTIALS", "aws-creds"),
            ("DATABASE_URL", "postgres://app:pg-pass@db:5432/prod"),
            ("HOME", "/home/someone"),
            ("SHORT_TOKEN", "abc"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[]), inherited);
        let out = s.sanitize(
            "ghp_abcdef shh-secret hunter22 sk_live_1 sk-openai aws-creds pg-pass /home/someone abc",
        );
        assert_eq!(
            out,
            "[redacted] [redacted] [redacted] [redacted] [redacted] [redacted] [redacted] /home/someone abc"
        );
    }

    #[test]
    fn inherited_values_are_redacted_by_value_whatever_their_name() {
        let inherited = [
            ("HARMLESS_LOOKING", "plain9value4secret"),
            ("WORKDIR", "/workspace/project-2024"),
            ("MODE", "short"),
            ("PATH", "/usr/local/bin:/usr/bin"),
            ("HOME", "/home/someone-else"),
            ("LC_ALL", "en_US.UTF-8"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[]), inherited);
        assert_eq!(
            s.sanitize("env: HARMLESS_LOOKING=plain9value4secret MODE=short"),
            "env: HARMLESS_LOOKING=[redacted] MODE=short"
        );
        assert_eq!(
            s.sanitize("cannot start `/workspace/project-2024/x`"),
            "cannot start `/workspace/project-2024/x`"
        );
        assert_eq!(
            s.sanitize(
                "no such file: /home/someone-else/bin/x (PATH /usr/local/bin:/usr/bin, en_US.UTF-8)"
            ),
            "no such file: /home/someone-else/bin/x (PATH /usr/local/bin:/usr/bin, en_US.UTF-8)"
        );
    }

    #[test]
    fn short_flag_values_are_redacted_attached_separate_or_with_equals() {
        let s = Sanitizer::with_inherited_env(
            &stdio(
                &[
                    "-pattached-secret",
                    "-k=equals-secret",
                    "-p",
                    "separate-secret",
                    "-u",
                    "separate-word",
                    "-xvf",
                ],
                &[],
            ),
            no_env(),
        );
        assert_eq!(
            s.sanitize(
                "args -pattached-secret -k=equals-secret -p separate-secret -u separate-word -xvf"
            ),
            "args -p[redacted] -k=[redacted] -p [redacted] -u separate-word -xvf"
        );
        assert_eq!(
            s.sanitize("password attached-secret"),
            "password [redacted]"
        );
    }

    #[test]
    fn a_long_stderr_is_redacted_before_it_is_cut_and_keeps_its_end() {
        let secret = "SECRET-HEAD-SECRET-TAIL";
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[("A", secret)]), no_env());
        // Wherever the cut falls relative to the secret, no part of it survives.
        for shift in 0..secret.len() + 2 {
            let stderr = format!(
                "{}{secret}{} the end",
                "a".repeat(3000 + shift),
                "b".repeat(MAX_SANITIZED_LEN / 2)
            );
            let out = s.sanitize(&format!("handshake failed: closed{STDERR_MARK}{stderr}"));
            assert!(out.len() <= MAX_SANITIZED_LEN, "{}", out.len());
            assert!(out.starts_with("handshake failed: closed; stderr: [truncated] "));
            assert!(out.ends_with("bbb the end"), "the end of the stderr stays");
            for fragment in ["HEAD", "TAIL", "T-H", "RET"] {
                assert!(
                    !out.contains(fragment),
                    "{fragment} leaked at shift {shift}"
                );
            }
        }
        // A message longer than half the cap leaves room for the stderr's end.
        let out = s.sanitize(&format!(
            "{}{STDERR_MARK}{}z",
            "m".repeat(5000),
            "e".repeat(5000)
        ));
        assert!(out.len() <= MAX_SANITIZED_LEN);
        assert!(
            out.contains(" [truncated][truncated] "),
            "{}",
            &out[2000..2100]
        );
        assert!(out.ends_with("eez"));
    }

    #[test]
    fn secret_env_name_patterns() {
        for name in [
            "GITHUB_TOKEN",
            "client_secret",
            "PGPASSWORD",
            "SIGNING_KEY",
            "APIKEY",
            "X_API_KEY_V2",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "DATABASE_URL",
            "SENTRY_DSN",
        ] {
            assert!(is_secret_env_name(name), "{name} should look secret");
        }
        for name in ["HOME", "PATH", "PWD", "LANG", "KEYBOARD_LAYOUT", "RUST_LOG"] {
            assert!(!is_secret_env_name(name), "{name} should not look secret");
        }
    }

    #[test]
    fn header_values_are_redacted_with_and_without_scheme() {
        let basic = base64::engine::general_purpose::STANDARD.encode("alice:open-sesame");
        let s = Sanitizer::with_inherited_env(
            &http(
                "http://example.test/",
                &[
                    ("Authorization", "Bearer tok-12345"),
                    ("X-Api-Key", "raw-header-secret"),
                    ("Proxy-Authorization", &format!("Basic {basic}")),
                ],
            ),
            no_env(),
        );
        assert_eq!(
            s.sanitize("sent Authorization: Bearer tok-12345"),
            "sent Authorization: [redacted]"
        );
        assert_eq!(
            s.sanitize("token tok-12345 rejected"),
            "token [redacted] rejected"
        );
        assert_eq!(s.sanitize("key raw-header-secret"), "key [redacted]");
        assert_eq!(s.sanitize(&format!("basic {basic}")), "basic [redacted]");
        assert_eq!(
            s.sanitize("user alice:open-sesame, pw open-sesame"),
            "user [redacted], pw [redacted]"
        );
    }

    #[test]
    fn flag_values_and_secret_looking_args_are_redacted_but_not_words_or_paths() {
        let s = Sanitizer::with_inherited_env(
            &stdio(
                &[
                    "--verbose",
                    "/srv/private-root",
                    "--token=arg-secret",
                    "-k",
                    "positional-secret",
                    "start",
                    "a1b2c3d4e5f6",
                    "ab",
                ],
                &[],
            ),
            no_env(),
        );
        let out = s.sanitize(
            "my-server --verbose /srv/private-root --token=arg-secret -k positional-secret start a1b2c3d4e5f6 ab: failed",
        );
        assert_eq!(
            out,
            "my-server --verbose /srv/private-root --token=[redacted] -k [redacted] start [redacted] ab: failed"
        );
    }

    #[test]
    fn configured_url_userinfo_query_and_secret_path_segments_are_redacted() {
        let s = Sanitizer::with_inherited_env(
            &http(
                "https://bobby-user:pa55word@mcp.example.test:8443/tenant-7/t0k3n5ecret/mcp?key=q-secret&x=1",
                &[],
            ),
            no_env(),
        );
        // Pieces that appear outside a URL are found by value.
        let out =
            s.sanitize("user bobby-user pass pa55word tenant tenant-7 t0k3n5ecret key=q-secret");
        assert_eq!(
            out,
            "user [redacted] pass [redacted] tenant tenant-7 [redacted] key=[redacted]"
        );
        let out = s.sanitize(
            "error sending request for url (https://bobby-user:pa55word@mcp.example.test:8443/tenant-7/t0k3n5ecret/mcp?key=q-secret&x=1)",
        );
        assert_eq!(
            out,
            "error sending request for url (https://[redacted]@mcp.example.test:8443/tenant-7/[redacted]/mcp?key=[redacted]&x=[redacted])"
        );
    }

    #[test]
    fn any_url_in_the_text_keeps_scheme_host_port_and_path() {
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[]), no_env());
        assert_eq!(
            s.sanitize("see postgres://u:p@db.internal:5432/prod?sslmode=disable now"),
            "see postgres://[redacted]@db.internal:5432/prod?sslmode=[redacted] now"
        );
        assert_eq!(
            s.sanitize("GET http://127.0.0.1:9/ failed"),
            "GET http://127.0.0.1:9/ failed"
        );
    }

    #[test]
    fn longest_match_wins() {
        let s = Sanitizer::with_inherited_env(
            &stdio(&[], &[("A", "secret"), ("B", "secret-and-more")]),
            no_env(),
        );
        assert_eq!(
            s.sanitize("x secret-and-more y secret"),
            "x [redacted] y [redacted]"
        );
    }

    #[test]
    fn replacement_text_is_never_rematched() {
        // A secret that occurs inside "[redacted]" must not shred the marker.
        let s = Sanitizer::with_inherited_env(
            &stdio(&[], &[("A", "longsecret"), ("B", "dact")]),
            no_env(),
        );
        assert_eq!(s.sanitize("longsecret"), "[redacted]");
    }

    #[test]
    fn short_values_are_not_redacted() {
        let s =
            Sanitizer::with_inherited_env(&stdio(&["on"], &[("A", "1"), ("B", "abc")]), no_env());
        assert_eq!(s.sanitize("on 1 abc"), "on 1 abc");
    }

    #[test]
    fn debug_escaped_secrets_are_redacted() {
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[("A", "quote\"secret")]), no_env());
        assert_eq!(
            s.sanitize(r#"Err("quote\"secret")"#),
            r#"Err("[redacted]")"#
        );
    }

    #[test]
    fn control_characters_are_cleaned_and_a_secret_they_split_is_still_redacted() {
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[("A", "hunter2-secret")]), no_env());
        assert_eq!(
            s.sanitize("boom\0\0 hunter2-secret \u{1b}[31mred\u{1b}[0m"),
            "boom\u{fffd}\u{fffd} [redacted] red"
        );
        // Written with a colour change in the middle, it joins when cleaned.
        assert_eq!(
            s.sanitize("token hunter2-\u{1b}[0msecret"),
            "token [redacted]"
        );
    }

    #[test]
    fn output_is_capped_on_a_char_boundary() {
        let s = Sanitizer::with_inherited_env(&stdio(&[], &[]), no_env());
        let long = "é".repeat(5000);
        let out = s.sanitize(&long);
        assert!(out.len() <= MAX_SANITIZED_LEN, "{}", out.len());
        assert!(out.ends_with(" [truncated]"));
        assert!(out.starts_with("ééé"));
        let short = "fine".to_string();
        assert_eq!(s.sanitize(&short), "fine");
    }
}
