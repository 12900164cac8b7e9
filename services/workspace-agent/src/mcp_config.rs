//! MCP config files: `{"mcpServers": {"name": {"command", "args", "env", "cwd",
//! "type", "url", "headers"}}}`.
//!
//! * transport from `type` (`stdio`; `http`, `streamable-http`,
//!   `streamable_http` or `streamableHttp`), else `command` → stdio, else `url`
//!   → streamable HTTP;
//! * `${VAR}` and `${VAR:-default}` in `env` and `headers` values are expanded
//!   from the agent's environment (an unset variable without a default expands
//!   to nothing and is a warning on the file);
//! * a relative `cwd` resolves against the working directory, `~` against home;
//! * a missing file has no row; an unreadable, oversize or invalid file is
//!   reported on its own row, invalid JSON and semantic errors alike; a server
//!   with a semantic error is not started, the file's other servers are;
//! * servers are deduplicated by name across files, first occurrence wins; the
//!   shadowed one is a warning on its file.
//!
//! Messages never quote a configured value (only server names, keys and
//! `type`): the file may hold secrets, and none of its content is sent.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};

use ctxsync_mcp::{ServerSpec, TransportSpec};
use ctxsync_proto::v1::{self, ResourceKind, ResourceStatus, context_resource::Body};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::context::{FileId, file_id, io_reason};
use crate::context_config::resolve_path;

/// MCP config files larger than this are not parsed (status oversize).
pub const MAX_MCP_CONFIG_BYTES: u64 = 1024 * 1024;

pub fn config_source(path: &Path) -> String {
    format!("mcp_config:{}", path.display())
}

/// A server declared by a config file (the first occurrence of its name).
#[derive(Clone, PartialEq, Eq)]
pub struct DeclaredServer {
    pub name: String,
    /// As configured, after `${VAR}` expansion.
    pub transport: TransportSpec,
    pub config_path: PathBuf,
}

// Hand-written so a debug print never shows env values, headers or URLs.
impl fmt::Debug for DeclaredServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeclaredServer")
            .field("name", &self.name)
            .field("transport", &self.transport.kind())
            .field("config_path", &self.config_path)
            .finish_non_exhaustive()
    }
}

impl DeclaredServer {
    pub fn spec(&self) -> ServerSpec {
        ServerSpec {
            name: self.name.clone(),
            transport: self.transport.clone(),
        }
    }
}

/// Every config file's row and the servers to discover, in declaration order.
#[derive(Debug, Default)]
pub struct McpConfigs {
    pub files: Vec<v1::ContextResource>,
    pub servers: Vec<DeclaredServer>,
}

/// Reads every config file, in order; a file reached twice is read once.
pub fn load(
    paths: &[PathBuf],
    env: &BTreeMap<String, String>,
    home: Option<&Path>,
    working_dir: Option<&Path>,
) -> McpConfigs {
    let mut out = McpConfigs::default();
    let mut seen_ids: BTreeSet<FileId> = BTreeSet::new();
    let mut first_declared: BTreeMap<String, PathBuf> = BTreeMap::new();
    for path in paths {
        if let Some(id) = file_id(path)
            && !seen_ids.insert(id)
        {
            continue;
        }
        let mut row = v1::ContextResource {
            source: config_source(path),
            kind: ResourceKind::McpConfig as i32,
            status: ResourceStatus::Ok as i32,
            ..Default::default()
        };
        let text = match read_config(path) {
            Ok(None) => continue,
            Ok(Some(text)) => text,
            Err((status, error)) => {
                row.status = status as i32;
                row.error = error;
                row.body = Some(config_body(path, Vec::new()));
                out.files.push(row);
                continue;
            }
        };
        let parsed = match parse(&text, env, home, working_dir) {
            Ok(parsed) => parsed,
            Err(error) => {
                row.status = ResourceStatus::Invalid as i32;
                row.error = error;
                row.body = Some(config_body(path, Vec::new()));
                out.files.push(row);
                continue;
            }
        };
        let mut errors = Vec::new();
        let mut warnings = parsed.warnings;
        let mut names = Vec::new();
        for (name, transport) in parsed.servers {
            names.push(name.clone());
            let transport = match transport {
                Ok(transport) => transport,
                Err(error) => {
                    errors.push(error);
                    continue;
                }
            };
            if let Some(first) = first_declared.get(&name) {
                warnings.push(format!(
                    "server {name:?} is shadowed by the one in {} (first occurrence wins)",
                    first.display()
                ));
                continue;
            }
            first_declared.insert(name.clone(), path.clone());
            out.servers.push(DeclaredServer {
                name,
                transport,
                config_path: path.clone(),
            });
        }
        if !errors.is_empty() {
            row.status = ResourceStatus::Invalid as i32;
            row.error = errors.join("; ");
        }
        row.warning = warnings.join("; ");
        row.body = Some(config_body(path, names));
        out.files.push(row);
    }
    out
}

fn config_body(path: &Path, server_names: Vec<String>) -> Body {
    Body::McpConfig(v1::McpConfig {
        path: path.display().to_string(),
        server_names,
    })
}

type Failure = (ResourceStatus, String);

fn read_config(path: &Path) -> Result<Option<String>, Failure> {
    let metadata = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err((ResourceStatus::Unreadable, io_reason(&e))),
    };
    if !metadata.is_file() {
        return Err((ResourceStatus::Unreadable, "not a regular file".to_owned()));
    }
    if metadata.len() > MAX_MCP_CONFIG_BYTES {
        return Err((
            ResourceStatus::Oversize,
            format!(
                "file is {} bytes, over the {MAX_MCP_CONFIG_BYTES}-byte limit for MCP config files",
                metadata.len()
            ),
        ));
    }
    let mut bytes = Vec::new();
    fs::File::open(path)
        .and_then(|f| f.take(MAX_MCP_CONFIG_BYTES).read_to_end(&mut bytes))
        .map_err(|e| (ResourceStatus::Unreadable, io_reason(&e)))?;
    String::from_utf8(bytes).map(Some).map_err(|_| {
        (
            ResourceStatus::Invalid,
            "invalid JSON: not UTF-8 text".to_owned(),
        )
    })
}

/// One file's servers in file order, each valid or with its error.
#[derive(Debug)]
pub struct ParsedConfig {
    pub servers: Vec<(String, Result<TransportSpec, String>)>,
    pub warnings: Vec<String>,
}

/// Parses one config file's text. `Err` is a structural error of the whole file.
pub fn parse(
    text: &str,
    env: &BTreeMap<String, String>,
    home: Option<&Path>,
    working_dir: Option<&Path>,
) -> Result<ParsedConfig, String> {
    // Syntax first: serde_json's syntax errors give a position, never content.
    serde_json::from_str::<de::IgnoredAny>(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let top: Top = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let entries = match top {
        Top::NotObject => return Err("the top level is not a JSON object".to_owned()),
        Top::Object(None) => return Err("no \"mcpServers\" object".to_owned()),
        Top::Object(Some(Ordered::NotObject)) => {
            return Err("\"mcpServers\" is not a JSON object".to_owned());
        }
        Top::Object(Some(Ordered::Object(entries))) => entries,
    };
    let mut warnings = Vec::new();
    let servers = entries
        .into_iter()
        .map(|(name, value)| {
            let transport = transport_of(&name, &value, env, home, working_dir, &mut warnings);
            (name, transport)
        })
        .collect();
    Ok(ParsedConfig { servers, warnings })
}

/// Server names: non-empty, no `__` (tools are named `server__tool`), no
/// leading or trailing `_`, no control characters (a name is part of a
/// `source` key; NUL there could never be stored).
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("a server has an empty name".to_owned());
    }
    if name.chars().any(char::is_control) {
        return Err(format!("server name {name:?} contains a control character"));
    }
    if name.contains("__") {
        return Err(format!("server name {name:?} contains \"__\""));
    }
    if name.starts_with('_') || name.ends_with('_') {
        return Err(format!("server name {name:?} starts or ends with \"_\""));
    }
    Ok(())
}

fn transport_of(
    name: &str,
    value: &Value,
    env: &BTreeMap<String, String>,
    home: Option<&Path>,
    working_dir: Option<&Path>,
    warnings: &mut Vec<String>,
) -> Result<TransportSpec, String> {
    check_name(name)?;
    let err = |what: &str| format!("server {name:?}: {what}");
    let object = value
        .as_object()
        .ok_or_else(|| err("is not a JSON object"))?;
    let string = |key: &str| -> Result<Option<String>, String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(err(&format!("{key:?} is not a string"))),
        }
    };
    let string_map = |key: &str| -> Result<BTreeMap<String, String>, String> {
        match object.get(key) {
            None | Some(Value::Null) => Ok(BTreeMap::new()),
            Some(Value::Object(map)) => map
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    _ => Err(err(&format!("{key:?} value of {k:?} is not a string"))),
                })
                .collect(),
            Some(_) => Err(err(&format!("{key:?} is not an object of strings"))),
        }
    };
    let command = string("command")?.filter(|c| !c.trim().is_empty());
    let url = string("url")?.filter(|u| !u.trim().is_empty());
    let kind = match string("type")?.as_deref() {
        Some("stdio") => Kind::Stdio,
        Some("http" | "streamable-http" | "streamable_http" | "streamableHttp") => Kind::Http,
        Some(other) => {
            let shown: String = other.chars().take(40).collect();
            return Err(err(&format!(
                "unknown type {shown:?} (expected \"stdio\" or \"http\")"
            )));
        }
        None if command.is_some() => Kind::Stdio,
        None if url.is_some() => Kind::Http,
        None => return Err(err("has neither \"command\" nor \"url\"")),
    };
    match kind {
        Kind::Stdio => {
            let command =
                command.ok_or_else(|| err("type is \"stdio\" but \"command\" is missing"))?;
            let args = match object.get("args") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| err("\"args\" is not an array of strings"))?,
                Some(_) => return Err(err("\"args\" is not an array of strings")),
            };
            let mut env_values = string_map("env")?;
            for (key, value) in env_values.iter_mut() {
                *value = expand(value, env, &mut |var| {
                    warnings.push(err(&format!(
                        "env {key:?} refers to the unset variable {var:?}"
                    )))
                });
            }
            let cwd = match string("cwd")? {
                None => None,
                Some(raw) => Some(resolve_path(&raw, home, working_dir).ok_or_else(|| {
                    err("\"cwd\" is relative and the agent has no working directory")
                })?),
            };
            Ok(TransportSpec::Stdio {
                command,
                args,
                env: env_values,
                cwd,
            })
        }
        Kind::Http => {
            let url = url.ok_or_else(|| err("type is \"http\" but \"url\" is missing"))?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(err("\"url\" is not an http:// or https:// URL"));
            }
            let mut headers = string_map("headers")?;
            for (key, value) in headers.iter_mut() {
                *value = expand(value, env, &mut |var| {
                    warnings.push(err(&format!(
                        "header {key:?} refers to the unset variable {var:?}"
                    )))
                });
            }
            Ok(TransportSpec::StreamableHttp { url, headers })
        }
    }
}

enum Kind {
    Stdio,
    Http,
}

/// Expands `${VAR}` and `${VAR:-default}`; `unset` is told each unset variable
/// used without a default. Anything else (`$VAR`, an unclosed `${`) is kept.
pub fn expand(value: &str, env: &BTreeMap<String, String>, unset: &mut dyn FnMut(&str)) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            return out;
        };
        let inner = &after[..end];
        let (var, default) = match inner.split_once(":-") {
            Some((var, default)) => (var, Some(default)),
            None => (inner, None),
        };
        let valid = !var.is_empty() && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            out.push_str(&rest[start..start + 2 + end + 1]);
        } else {
            match (env.get(var), default) {
                (Some(v), _) if !(v.is_empty() && default.is_some()) => out.push_str(v),
                (_, Some(default)) => out.push_str(default),
                (None, None) => unset(var),
                (Some(_), None) => {}
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

// Key-order-preserving JSON objects without turning on serde_json's
// `preserve_order` for the whole workspace, and without serde's type errors
// (which quote the offending value).

enum Top {
    NotObject,
    Object(Option<Ordered>),
}

enum Ordered {
    NotObject,
    Object(Vec<(String, Value)>),
}

macro_rules! not_object {
    ($ret:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($ret)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($ret)
        }
    };
}

impl<'de> serde::Deserialize<'de> for Top {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TopVisitor;
        impl<'de> Visitor<'de> for TopVisitor {
            type Value = Top;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON document")
            }
            not_object!(Top::NotObject);
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top, A::Error> {
                let mut servers = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "mcpServers" {
                        servers = Some(map.next_value::<Ordered>()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Top::Object(servers))
            }
        }
        deserializer.deserialize_any(TopVisitor)
    }
}

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OrderedVisitor;
        impl<'de> Visitor<'de> for OrderedVisitor {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            not_object!(Ordered::NotObject);
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordered, A::Error> {
                let mut entries: Vec<(String, Value)> = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let value = map.next_value::<Value>()?;
                    // A repeated key: the last one wins, as in serde_json.
                    entries.retain(|(k, _)| *k != key);
                    entries.push((key, value));
                }
                Ok(Ordered::Object(entries))
            }
        }
        deserializer.deserialize_any(OrderedVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const WORK: &str = "/work/ws";

    fn parse_ok(text: &str, vars: &[(&str, &str)]) -> ParsedConfig {
        parse(
            text,
            &env(vars),
            Some(Path::new("/home/u")),
            Some(Path::new(WORK)),
        )
        .unwrap()
    }

    #[test]
    fn transport_comes_from_type_else_command_else_url() {
        let parsed = parse_ok(
            r#"{"mcpServers": {
                "z-cmd": {"command": "npx", "args": ["-y", "pkg"]},
                "a-url": {"url": "http://127.0.0.1:1/mcp"},
                "typed-http": {"type": "http", "url": "https://example.test/mcp", "command": "ignored"},
                "typed-stdio": {"type": "stdio", "command": "srv", "cwd": "sub"}
            }}"#,
            &[],
        );
        let names: Vec<&str> = parsed.servers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["z-cmd", "a-url", "typed-http", "typed-stdio"],
            "file order"
        );
        let defs: Vec<&TransportSpec> = parsed
            .servers
            .iter()
            .map(|(_, d)| d.as_ref().unwrap())
            .collect();
        assert!(
            matches!(defs[0], TransportSpec::Stdio { command, args, .. } if command == "npx" && args == &["-y", "pkg"])
        );
        assert!(
            matches!(defs[1], TransportSpec::StreamableHttp { url, .. } if url == "http://127.0.0.1:1/mcp")
        );
        assert!(matches!(defs[2], TransportSpec::StreamableHttp { .. }));
        assert!(
            matches!(defs[3], TransportSpec::Stdio { cwd: Some(cwd), .. } if cwd == Path::new("/work/ws/sub"))
        );
    }

    #[test]
    fn env_and_header_values_expand_variables() {
        let parsed = parse_ok(
            r#"{"mcpServers": {
                "s": {"command": "x", "env": {"TOKEN": "${GH_TOKEN}", "MIX": "a-${A}-${MISSING:-dflt}-$A", "GONE": "${NOPE}"}},
                "h": {"url": "http://h/mcp", "headers": {"Authorization": "Bearer ${GH_TOKEN}"}}
            }}"#,
            &[("GH_TOKEN", "ghp_secret"), ("A", "1")],
        );
        let TransportSpec::Stdio { env, .. } = parsed.servers[0].1.as_ref().unwrap() else {
            panic!()
        };
        assert_eq!(env["TOKEN"], "ghp_secret");
        assert_eq!(env["MIX"], "a-1-dflt-$A");
        assert_eq!(env["GONE"], "");
        let TransportSpec::StreamableHttp { headers, .. } = parsed.servers[1].1.as_ref().unwrap()
        else {
            panic!()
        };
        assert_eq!(headers["Authorization"], "Bearer ghp_secret");
        assert_eq!(parsed.warnings.len(), 1);
        assert!(parsed.warnings[0].contains("\"NOPE\""));
        assert!(!parsed.warnings[0].contains("ghp_secret"));
    }

    #[test]
    fn structural_errors_name_no_content() {
        let cases = [
            (
                r#"{"mcpServers": {"a": {"command": "sk-live-123"}"#,
                "invalid JSON",
            ),
            (r#"["sk-live-123"]"#, "top level is not a JSON object"),
            (r#"{"servers": {}}"#, "no \"mcpServers\" object"),
            (
                r#"{"mcpServers": "sk-live-123"}"#,
                "\"mcpServers\" is not a JSON object",
            ),
        ];
        for (text, expected) in cases {
            let error = parse(text, &env(&[]), None, Some(Path::new(WORK))).unwrap_err();
            assert!(error.contains(expected), "{text}: {error}");
            assert!(!error.contains("sk-live-123"), "{error}");
        }
    }

    #[test]
    fn semantic_errors_are_per_server_and_quote_no_values() {
        let parsed = parse_ok(
            r#"{"mcpServers": {
                "none": {"args": ["sk-live-123"]},
                "bad_type": {"type": "sse", "url": "http://u:sk-live-123@h/"},
                "a__b": {"command": "x"},
                "_lead": {"command": "x"},
                "trail_": {"command": "x"},
                "": {"command": "x"},
                "args": {"command": "x", "args": "sk-live-123"},
                "envnum": {"command": "x", "env": {"K": 1}},
                "ftp": {"url": "ftp://sk-live-123"},
                "ok_name": {"command": "x"}
            }}"#,
            &[],
        );
        let errors: BTreeMap<&str, &str> = parsed
            .servers
            .iter()
            .filter_map(|(n, d)| d.as_ref().err().map(|e| (n.as_str(), e.as_str())))
            .collect();
        assert!(errors["none"].contains("neither \"command\" nor \"url\""));
        assert!(errors["bad_type"].contains("unknown type \"sse\""));
        assert!(errors["a__b"].contains("contains \"__\""));
        assert!(errors["_lead"].contains("starts or ends with \"_\""));
        assert!(errors["trail_"].contains("starts or ends with \"_\""));
        assert!(errors[""].contains("empty name"));
        assert!(errors["args"].contains("\"args\" is not an array of strings"));
        assert!(errors["envnum"].contains("\"env\" value of \"K\" is not a string"));
        assert!(errors["ftp"].contains("not an http"));
        assert!(!errors.contains_key("ok_name"));
        for error in errors.values() {
            assert!(!error.contains("sk-live-123"), "{error}");
        }
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).unwrap();
        path
    }

    fn load_files(paths: &[PathBuf], dir: &Path) -> McpConfigs {
        load(paths, &env(&[]), None, Some(dir))
    }

    #[test]
    fn zero_servers_and_a_missing_file_are_not_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let empty = write(tmp.path(), "empty.json", r#"{"mcpServers": {}}"#);
        let configs = load_files(
            &[tmp.path().join("missing.json"), empty.clone()],
            tmp.path(),
        );
        assert!(configs.servers.is_empty());
        assert_eq!(configs.files.len(), 1, "no row for the missing file");
        assert_eq!(
            configs.files[0].source,
            format!("mcp_config:{}", empty.display())
        );
        assert_eq!(configs.files[0].status, ResourceStatus::Ok as i32);
        assert!(configs.files[0].error.is_empty());
    }

    #[test]
    fn invalid_json_is_attributed_to_its_file_and_the_others_still_count() {
        let tmp = tempfile::tempdir().unwrap();
        let bad = write(tmp.path(), "bad.json", "{\"mcpServers\": {\"a\": ");
        let good = write(
            tmp.path(),
            "good.json",
            r#"{"mcpServers": {"g": {"command": "x"}}}"#,
        );
        let configs = load_files(&[bad.clone(), good.clone()], tmp.path());
        assert_eq!(configs.files[0].source, config_source(&bad));
        assert_eq!(configs.files[0].status, ResourceStatus::Invalid as i32);
        assert!(
            configs.files[0].error.starts_with("invalid JSON"),
            "{}",
            configs.files[0].error
        );
        assert_eq!(configs.files[1].status, ResourceStatus::Ok as i32);
        assert_eq!(configs.servers.len(), 1);
        assert_eq!(configs.servers[0].config_path, good);
    }

    #[test]
    fn semantic_error_is_attributed_to_its_file_and_valid_siblings_are_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let file = write(
            tmp.path(),
            "a.json",
            r#"{"mcpServers": {"broken": {"args": []}, "a__b": {"command": "x"}, "fine": {"command": "x"}}}"#,
        );
        let configs = load_files(std::slice::from_ref(&file), tmp.path());
        let row = &configs.files[0];
        assert_eq!(row.status, ResourceStatus::Invalid as i32);
        assert!(row.error.contains("server \"broken\""), "{}", row.error);
        assert!(row.error.contains("\"a__b\""), "{}", row.error);
        let Some(Body::McpConfig(body)) = &row.body else {
            panic!()
        };
        assert_eq!(body.server_names, ["broken", "a__b", "fine"]);
        let names: Vec<&str> = configs.servers.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["fine"]);
    }

    #[test]
    fn first_occurrence_wins_across_files_and_the_shadowed_one_is_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        let first = write(
            tmp.path(),
            "first.json",
            r#"{"mcpServers": {"shared": {"command": "first"}, "only1": {"command": "x"}}}"#,
        );
        let second = write(
            tmp.path(),
            "second.json",
            r#"{"mcpServers": {"shared": {"url": "http://second/mcp"}, "only2": {"command": "y"}}}"#,
        );
        let configs = load_files(&[first.clone(), second.clone()], tmp.path());
        let servers: Vec<(&str, &Path)> = configs
            .servers
            .iter()
            .map(|s| (s.name.as_str(), s.config_path.as_path()))
            .collect();
        assert_eq!(
            servers,
            [
                ("shared", first.as_path()),
                ("only1", first.as_path()),
                ("only2", second.as_path())
            ]
        );
        assert!(
            matches!(&configs.servers[0].transport, TransportSpec::Stdio { command, .. } if command == "first")
        );
        assert!(configs.files[0].warning.is_empty());
        assert_eq!(configs.files[1].status, ResourceStatus::Ok as i32);
        assert!(
            configs.files[1].warning.contains("\"shared\" is shadowed"),
            "{}",
            configs.files[1].warning
        );
    }

    #[test]
    fn a_file_listed_twice_is_read_once() {
        let tmp = tempfile::tempdir().unwrap();
        let file = write(
            tmp.path(),
            "a.json",
            r#"{"mcpServers": {"s": {"command": "x"}}}"#,
        );
        let link = tmp.path().join("link.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let configs = load_files(&[file, link], tmp.path());
        assert_eq!(configs.files.len(), 1);
        assert!(configs.files[0].warning.is_empty());
    }

    #[test]
    fn debug_output_hides_configured_values() {
        let server = DeclaredServer {
            name: "s".into(),
            transport: TransportSpec::Stdio {
                command: "x".into(),
                args: vec!["--token=sk-live-123".into()],
                env: BTreeMap::new(),
                cwd: None,
            },
            config_path: PathBuf::from("/a.json"),
        };
        assert!(!format!("{server:?}").contains("sk-live-123"));
    }
}
