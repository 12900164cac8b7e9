//! MCP config files as people write them: Claude Code / Claude Desktop /
//! Cursor / Roo (`{"mcpServers": {...}}`) and VS Code (`{"servers": {...},
//! "inputs": [...]}`), JSON with comments and trailing commas (JSONC) and an
//! optional UTF-8 byte order mark.
//!
//! * Transport from `type` (`stdio`; `http`, `streamable-http`,
//!   `streamable_http`, `streamableHttp`; `sse`), else `command` → stdio,
//!   else `url` → streamable HTTP (falling back to legacy SSE on a 4xx).
//! * Variables in `command`, `args`, `env`, `cwd`, `url`, `headers` and
//!   `headersHelper`: `${VAR}`, `${VAR:-default}`, `${env:VAR}`,
//!   `${workspaceFolder}`, `${workspaceFolderBasename}`, `${userHome}`,
//!   `${pathSeparator}` and `${input:id}` (a headless agent cannot prompt:
//!   the value comes from `CTXSYNC_MCP_INPUT_<ID>`). A variable that is unset
//!   and has no default is a config error on that server naming the variable
//!   and the field; the file's other servers still start.
//! * A server runs in the directory its config file belongs to (see
//!   [`config_root`]) unless `cwd` says otherwise (relative: against that
//!   directory); a relative `command` with a `/` resolves there, `~` against
//!   home.
//! * `"disabled": true`: not started, reported disabled.
//! * A missing file has no row; an unreadable, oversize or invalid file is
//!   reported on its own row (syntax errors name the line, the column and
//!   what was expected); a server with a config error is not started, the
//!   file's other servers are.
//! * Servers are deduplicated by name across files, first occurrence wins; the
//!   shadowed one is a warning on its file. At most `max_servers` are started
//!   per workspace; the file rows say how many were not, and why.
//!
//! Messages never quote a configured value (only server names, keys, variable
//! names and `type`): the file may hold secrets, and none of its content is sent.

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
/// Where a VS Code `${input:id}` value comes from: this prefix and the id in
/// upper case, every character but letters and digits as `_`.
pub const INPUT_ENV_PREFIX: &str = "CTXSYNC_MCP_INPUT_";
/// The env var and flag that set the workspace's server cap (for messages).
pub const MAX_SERVERS_OPTION: &str = "CTXSYNC_MCP_MAX_SERVERS (--mcp-max-servers)";

pub fn config_source(path: &Path) -> String {
    format!("mcp_config:{}", path.display())
}

/// The env var a VS Code input's value is read from.
pub fn input_env_name(id: &str) -> String {
    let id: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("{INPUT_ENV_PREFIX}{id}")
}

/// The directory a config file belongs to, where its servers run: the
/// workspace folder of `<dir>/.mcp.json`, `<dir>/.vscode/mcp.json`,
/// `<dir>/.cursor/mcp.json` and `<dir>/.roo/mcp.json` (`<dir>`), else the
/// agent's working directory (an operator's file such as `/etc/mcp.json`).
pub fn config_root(path: &Path, working_dir: Option<&Path>) -> Option<PathBuf> {
    let parent = path.parent();
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if file_name == ".mcp.json" {
        return parent.map(Path::to_path_buf);
    }
    if file_name == "mcp.json"
        && let Some(dir) = parent
        && let Some(dir_name) = dir.file_name().and_then(|n| n.to_str())
        && matches!(dir_name, ".vscode" | ".cursor" | ".roo")
    {
        return dir.parent().map(Path::to_path_buf);
    }
    working_dir
        .map(Path::to_path_buf)
        .or_else(|| parent.map(Path::to_path_buf))
}

/// A server declared by a config file (the first occurrence of its name).
#[derive(Clone, PartialEq, Eq)]
pub struct DeclaredServer {
    pub name: String,
    /// As configured, after variable expansion; a stdio server's `cwd` is set.
    pub transport: TransportSpec,
    pub config_path: PathBuf,
    /// The directory the config file belongs to (where `headersHelper` runs).
    pub root: Option<PathBuf>,
    /// `headersHelper`: a shell command whose output (a JSON object) is
    /// laid over `headers` when the server is contacted.
    pub headers_helper: Option<String>,
    /// Values substituted from the environment: secrets to the sanitizer
    /// wherever they ended up (a path in `args`, a host in `url`).
    pub expanded_secrets: Vec<String>,
}

// Hand-written so a debug print never shows env values, headers or URLs.
impl fmt::Debug for DeclaredServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeclaredServer")
            .field("name", &self.name)
            .field("transport", &self.transport.name())
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

/// A server that is declared but not started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unstarted {
    pub name: String,
    pub config_path: PathBuf,
    pub transport: v1::McpTransport,
    /// Empty for a disabled server; the config error otherwise.
    pub error: String,
}

/// Every config file's row and the servers to discover, in declaration order.
#[derive(Debug, Default)]
pub struct McpConfigs {
    pub files: Vec<v1::ContextResource>,
    pub servers: Vec<DeclaredServer>,
    /// `"disabled": true`.
    pub disabled: Vec<Unstarted>,
    /// Named servers whose configuration cannot be used (an unset variable,
    /// a missing input, a bad field).
    pub failed: Vec<Unstarted>,
    /// Servers over the workspace's cap, not started.
    pub skipped: usize,
}

/// How [`load`] reads the files.
#[derive(Debug, Clone, Copy)]
pub struct LoadContext<'a> {
    pub env: &'a BTreeMap<String, String>,
    pub home: Option<&'a Path>,
    pub working_dir: Option<&'a Path>,
    /// Servers started per workspace, at most.
    pub max_servers: usize,
}

/// Reads every config file, in order; a file reached twice is read once.
pub fn load(paths: &[PathBuf], context: LoadContext<'_>) -> McpConfigs {
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
        let root = config_root(path, context.working_dir);
        let vars = Vars {
            env: context.env,
            home: context.home,
            root: root.as_deref(),
        };
        let parsed = match parse(&text, &vars) {
            Ok(parsed) => parsed,
            Err(error) => {
                row.status = ResourceStatus::Invalid as i32;
                row.error = format!("{}: {error}", path.display());
                row.body = Some(config_body(path, Vec::new()));
                out.files.push(row);
                continue;
            }
        };
        let mut errors = Vec::new();
        let mut warnings = parsed.warnings;
        let mut names = Vec::new();
        let mut skipped_here = 0usize;
        for (name, entry) in parsed.servers {
            names.push(name.clone());
            if let Some(first) = first_declared.get(&name) {
                warnings.push(format!(
                    "server {name:?} is shadowed by the one in {} (first occurrence wins)",
                    first.display()
                ));
                continue;
            }
            let named = check_name(&name).is_ok();
            if named {
                first_declared.insert(name.clone(), path.clone());
            }
            match entry {
                Err((error, transport)) => {
                    if named {
                        out.failed.push(Unstarted {
                            name,
                            config_path: path.clone(),
                            transport,
                            error: error.clone(),
                        });
                    }
                    errors.push(error);
                }
                Ok(Entry::Disabled(transport)) => out.disabled.push(Unstarted {
                    name,
                    config_path: path.clone(),
                    transport,
                    error: String::new(),
                }),
                Ok(Entry::Server(server)) => {
                    if out.servers.len() >= context.max_servers {
                        skipped_here += 1;
                        continue;
                    }
                    out.servers.push(DeclaredServer {
                        name,
                        transport: server.transport,
                        config_path: path.clone(),
                        root: root.clone(),
                        headers_helper: server.headers_helper,
                        expanded_secrets: server.expanded_secrets,
                    });
                }
            }
        }
        if skipped_here > 0 {
            out.skipped += skipped_here;
            warnings.push(format!(
                "{skipped_here} {} of this file not started: the workspace's limit of {} started servers was reached ({MAX_SERVERS_OPTION})",
                if skipped_here == 1 { "server" } else { "servers" },
                context.max_servers
            ));
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
    String::from_utf8(bytes).map(Some).map_err(|error| {
        (
            ResourceStatus::Invalid,
            format!(
                "{}: invalid JSON: not UTF-8 text (byte {} is not valid UTF-8)",
                path.display(),
                error.utf8_error().valid_up_to() + 1
            ),
        )
    })
}

/// What variables expand to, for one file.
#[derive(Debug, Clone, Copy)]
pub struct Vars<'a> {
    pub env: &'a BTreeMap<String, String>,
    pub home: Option<&'a Path>,
    /// The directory the file belongs to (`${workspaceFolder}`).
    pub root: Option<&'a Path>,
}

/// A usable server entry, before names are deduplicated.
#[derive(Debug)]
pub struct ParsedServer {
    pub transport: TransportSpec,
    pub headers_helper: Option<String>,
    pub expanded_secrets: Vec<String>,
}

#[derive(Debug)]
pub enum Entry {
    Server(ParsedServer),
    Disabled(v1::McpTransport),
}

/// An entry, or its config error and the transport it names.
pub type EntryResult = Result<Entry, (String, v1::McpTransport)>;

/// One file's servers in file order, each usable, disabled, or with its
/// error (and the transport it names, for its row).
#[derive(Debug)]
pub struct ParsedConfig {
    pub servers: Vec<(String, EntryResult)>,
    pub warnings: Vec<String>,
}

/// Parses one config file's text. `Err` is a structural error of the whole
/// file, in words (its caller adds the file's path).
pub fn parse(text: &str, vars: &Vars<'_>) -> Result<ParsedConfig, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let json = jsonc_to_json(text)?;
    // Syntax first: serde_json's syntax errors give a position, never content.
    serde_json::from_str::<de::IgnoredAny>(&json).map_err(|e| syntax_error(&e))?;
    let top: Top = serde_json::from_str(&json).map_err(|e| syntax_error(&e))?;
    let entries = match top {
        Top::NotObject => {
            return Err("invalid MCP config: the top level is not a JSON object".to_owned());
        }
        Top::Object { servers: None, .. } => {
            return Err("invalid MCP config: no \"mcpServers\" object (Claude Code, Claude Desktop, Cursor, Roo) or \"servers\" object (VS Code)".to_owned());
        }
        Top::Object {
            servers: Some((key, Ordered::NotObject)),
            ..
        } => {
            return Err(format!(
                "invalid MCP config: \"{key}\" is not a JSON object"
            ));
        }
        Top::Object {
            servers: Some((_, Ordered::Object(entries))),
            ..
        } => entries,
    };
    let servers = entries
        .into_iter()
        .map(|(name, value)| {
            let entry =
                entry_of(&name, &value, vars).map_err(|error| (error, declared_transport(&value)));
            (name, entry)
        })
        .collect();
    Ok(ParsedConfig {
        servers,
        warnings: Vec::new(),
    })
}

/// The transport an entry names, for the row of a server that is not started.
fn declared_transport(value: &Value) -> v1::McpTransport {
    let object = value.as_object();
    let get = |key: &str| object.and_then(|o| o.get(key)).and_then(Value::as_str);
    match (get("type"), get("command"), get("url")) {
        (Some("sse"), _, _) => v1::McpTransport::Sse,
        (Some("stdio"), _, _) | (None, Some(_), _) => v1::McpTransport::Stdio,
        (Some(_), _, _) | (None, None, Some(_)) => v1::McpTransport::StreamableHttp,
        (None, None, None) => v1::McpTransport::Unspecified,
    }
}

/// JSONC to JSON with every byte in place: comments become spaces (line
/// breaks kept) and a comma before `}` or `]` a space, so serde_json's
/// line and column are the file's.
pub fn jsonc_to_json(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = bytes.to_vec();
    let mut i = 0;
    let mut line = 1;
    let mut line_start = 0;
    // Where the last comma outside strings is, until something else is seen.
    let mut pending_comma: Option<usize> = None;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                pending_comma = None;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    // A raw line break ends the scan: serde_json reports it.
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                if bytes.get(i) == Some(&b'"') {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    out[i] = b' ';
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                let (open_line, open_column) = (line, i - line_start + 1);
                out[i] = b' ';
                out[i + 1] = b' ';
                i += 2;
                loop {
                    if i >= bytes.len() {
                        return Err(format!(
                            "invalid JSON at line {open_line}, column {open_column}: a /* comment is never closed with */"
                        ));
                    }
                    if bytes[i] == b'*' && bytes.get(i + 1) == Some(&b'/') {
                        out[i] = b' ';
                        out[i + 1] = b' ';
                        i += 2;
                        break;
                    }
                    if bytes[i] == b'\n' {
                        line += 1;
                        line_start = i + 1;
                    } else {
                        out[i] = b' ';
                    }
                    i += 1;
                }
            }
            b',' => {
                pending_comma = Some(i);
                i += 1;
            }
            b'}' | b']' => {
                if let Some(comma) = pending_comma.take() {
                    out[comma] = b' ';
                }
                i += 1;
            }
            b'\n' => {
                line += 1;
                line_start = i + 1;
                i += 1;
            }
            b' ' | b'\t' | b'\r' => i += 1,
            _ => {
                pending_comma = None;
                i += 1;
            }
        }
    }
    // Only ASCII bytes inside comments were replaced, and whole comments:
    // still UTF-8.
    Ok(String::from_utf8(out).unwrap_or_else(|_| text.to_owned()))
}

/// A serde_json syntax error in words a person who edits the file understands.
fn syntax_error(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let message = text
        .rsplit_once(" at line ")
        .map_or(text.as_str(), |(message, _)| message);
    let words = match message {
        "EOF while parsing an object" => "the file ends inside an object: a closing } is missing",
        "EOF while parsing a list" => "the file ends inside a list: a closing ] is missing",
        "EOF while parsing a string" => "the file ends inside a string: a closing \" is missing",
        "EOF while parsing a value" if error.line() <= 1 && error.column() == 0 => {
            "the file is empty"
        }
        "EOF while parsing a value" => "the file ends where a value was expected",
        "expected `:`" => "expected a : between a key and its value",
        "expected `,` or `}`" => "expected a , before the next entry or a } to close the object",
        "expected `,` or `]`" => "expected a , before the next item or a ] to close the list",
        "key must be a string" => "expected a key in double quotes, like \"name\"",
        "expected value" => {
            "expected a value (a string in double quotes, a number, an object, a list, true, false or null)"
        }
        "expected ident" => "expected true, false or null",
        "trailing characters" => "unexpected text after the end of the top-level object",
        "invalid escape" => {
            "a string has an invalid escape (allowed: \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)"
        }
        "invalid number" | "number out of range" => "a number is not valid",
        "recursion limit exceeded" => "objects and lists are nested too deeply",
        other if other.starts_with("control character") => {
            "a string holds a raw line break or control character (write it as \\n, \\t, …)"
        }
        other => other,
    };
    format!(
        "invalid JSON at line {}, column {}: {words}",
        error.line(),
        error.column()
    )
}

/// Server names: non-empty, no `__` (tools are named `server__tool`), no
/// trailing `_` (`a_` + `__` + `tool` would split wrongly), no control
/// characters (a name is part of a `source` key; NUL there could never be
/// stored). A leading `_` is fine.
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
    if name.ends_with('_') {
        return Err(format!("server name {name:?} ends with \"_\""));
    }
    Ok(())
}

/// Expands one field's text, collecting values taken from the environment.
struct Expander<'a, 'v> {
    vars: &'a Vars<'v>,
    name: &'a str,
    secrets: Vec<String>,
}

impl Expander<'_, '_> {
    fn expand(&mut self, field: &str, value: &str) -> Result<String, String> {
        let mut from_env = Vec::new();
        let expanded = expand_vars(value, self.vars, &mut from_env)
            .map_err(|missing| format!("server {:?}: {field} {missing}", self.name))?;
        for (var, value) in from_env {
            if !ctxsync_mcp::is_harmless_env_name(&var) {
                self.secrets.push(value);
            }
        }
        Ok(expanded)
    }
}

fn entry_of(name: &str, value: &Value, vars: &Vars<'_>) -> Result<Entry, String> {
    check_name(name)?;
    let err = |what: &str| format!("server {name:?}: {what}");
    let object = value
        .as_object()
        .ok_or_else(|| err("is not a JSON object"))?;
    if object.get("disabled") == Some(&Value::Bool(true)) {
        return Ok(Entry::Disabled(declared_transport(value)));
    }
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
    let mut expander = Expander {
        vars,
        name,
        secrets: Vec::new(),
    };
    let command = string("command")?.filter(|c| !c.trim().is_empty());
    let url = string("url")?.filter(|u| !u.trim().is_empty());
    let kind = match string("type")?.as_deref() {
        Some("stdio") => Kind::Stdio,
        Some("http" | "streamable-http" | "streamable_http" | "streamableHttp") => Kind::Http,
        Some("sse") => Kind::Sse,
        Some(other) => {
            let shown: String = other.chars().take(40).collect();
            return Err(err(&format!(
                "unknown type {shown:?} (expected \"stdio\", \"http\" or \"sse\")"
            )));
        }
        None if command.is_some() => Kind::Stdio,
        None if url.is_some() => Kind::Http,
        None => return Err(err("has neither \"command\" nor \"url\"")),
    };
    let transport = match kind {
        Kind::Stdio => {
            let command =
                command.ok_or_else(|| err("type is \"stdio\" but \"command\" is missing"))?;
            let command = expander.expand("\"command\"", &command)?;
            let args = match object.get("args") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| err("\"args\" is not an array of strings"))?,
                Some(_) => return Err(err("\"args\" is not an array of strings")),
            };
            let args = args
                .iter()
                .enumerate()
                .map(|(i, arg)| expander.expand(&format!("\"args\"[{i}]"), arg))
                .collect::<Result<Vec<_>, _>>()?;
            let mut env_values = string_map("env")?;
            for (key, value) in env_values.iter_mut() {
                *value = expander.expand(&format!("\"env\" {key:?}"), value)?;
            }
            // Where it runs: `cwd` (relative to the file's folder), else that folder.
            let cwd = match string("cwd")? {
                None => vars.root.map(Path::to_path_buf),
                Some(raw) => {
                    let raw = expander.expand("\"cwd\"", &raw)?;
                    Some(resolve_path(&raw, vars.home, vars.root).ok_or_else(|| {
                        err("\"cwd\" is relative and the agent has no working directory")
                    })?)
                }
            };
            let command = resolve_command(&command, vars.home, cwd.as_deref());
            TransportSpec::Stdio {
                command,
                args,
                env: env_values,
                cwd,
            }
        }
        Kind::Http | Kind::Sse => {
            let what = if matches!(kind, Kind::Sse) {
                "sse"
            } else {
                "http"
            };
            let url =
                url.ok_or_else(|| err(&format!("type is \"{what}\" but \"url\" is missing")))?;
            let url = expander.expand("\"url\"", &url)?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(err("\"url\" is not an http:// or https:// URL"));
            }
            let mut headers = string_map("headers")?;
            for (key, value) in headers.iter_mut() {
                *value = expander.expand(&format!("\"headers\" {key:?}"), value)?;
            }
            if matches!(kind, Kind::Sse) {
                TransportSpec::Sse { url, headers }
            } else {
                TransportSpec::StreamableHttp { url, headers }
            }
        }
    };
    let headers_helper = match string("headersHelper")? {
        Some(helper) if matches!(kind, Kind::Stdio) => {
            let _ = helper;
            return Err(err("\"headersHelper\" is for HTTP servers, not stdio ones"));
        }
        Some(helper) => Some(expander.expand("\"headersHelper\"", &helper)?),
        None => None,
    };
    Ok(Entry::Server(ParsedServer {
        transport,
        headers_helper,
        expanded_secrets: expander.secrets,
    }))
}

/// `~` and `~/x` against home; a relative path with a `/` (`scripts/srv.py`,
/// `./bin/srv`) against the server's directory, as a shell there would; a
/// bare name (`npx`) is looked up on PATH when started.
fn resolve_command(command: &str, home: Option<&Path>, cwd: Option<&Path>) -> String {
    if command == "~" || command.starts_with("~/") {
        if let Some(resolved) = resolve_path(command, home, None) {
            return resolved.display().to_string();
        }
        return command.to_owned();
    }
    if command.contains('/')
        && !Path::new(command).is_absolute()
        && let Some(cwd) = cwd
    {
        return cwd.join(command).display().to_string();
    }
    command.to_owned()
}

enum Kind {
    Stdio,
    Http,
    Sse,
}

/// Expands every variable form of the module docs in `value`. `from_env`
/// receives each environment variable used and its value. `Err` says which
/// variable is missing, in words. A `${…}` that is no variable (`${1}`,
/// an unclosed `${`) is kept as written.
pub fn expand_vars(
    value: &str,
    vars: &Vars<'_>,
    from_env: &mut Vec<(String, String)>,
) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            return Ok(out);
        };
        let inner = &after[..end];
        let written = &rest[start..start + 2 + end + 1];
        rest = &after[end + 1..];
        let is_name =
            |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if let Some(id) = inner.strip_prefix("input:") {
            let var = input_env_name(id);
            match vars.env.get(&var) {
                Some(v) => {
                    from_env.push((var, v.clone()));
                    out.push_str(v);
                }
                None => {
                    return Err(format!(
                        "needs the input {id:?}, which a headless agent cannot prompt for: set {var}"
                    ));
                }
            }
            continue;
        }
        let (var, default) = match inner.strip_prefix("env:") {
            Some(var) => (var, None),
            None => match inner.split_once(":-") {
                Some((var, default)) => (var, Some(default)),
                None => (inner, None),
            },
        };
        match var {
            "workspaceFolder" | "workspaceRoot" if default.is_none() => match vars.root {
                Some(root) => {
                    out.push_str(&root.display().to_string());
                    continue;
                }
                None => {
                    return Err(
                        "uses ${workspaceFolder} but the agent has no working directory".to_owned(),
                    );
                }
            },
            "workspaceFolderBasename" if default.is_none() => {
                if let Some(name) = vars.root.and_then(Path::file_name) {
                    out.push_str(&name.to_string_lossy());
                }
                continue;
            }
            "userHome" if default.is_none() => match vars.home {
                Some(home) => {
                    out.push_str(&home.display().to_string());
                    continue;
                }
                None => {
                    return Err("uses ${userHome} but the agent has no home directory".to_owned());
                }
            },
            "pathSeparator" | "/" if default.is_none() => {
                out.push('/');
                continue;
            }
            _ => {}
        }
        if !is_name(var) {
            if inner.contains(':')
                && !inner.contains(":-")
                && is_name(inner.split(':').next().unwrap_or_default())
            {
                return Err(format!(
                    "uses the variable {written:?}, which ctxsync does not support"
                ));
            }
            out.push_str(written);
            continue;
        }
        match (vars.env.get(var), default) {
            (Some(v), Some(default)) if v.is_empty() => out.push_str(default),
            (Some(v), _) => {
                from_env.push((var.to_owned(), v.clone()));
                out.push_str(v);
            }
            (None, Some(default)) => out.push_str(default),
            (None, None) => {
                return Err(format!(
                    "uses the variable {var:?}, which is not set and has no default (write ${{{var}:-default}} to give one)"
                ));
            }
        }
    }
    out.push_str(rest);
    Ok(out)
}

// Key-order-preserving JSON objects without turning on serde_json's
// `preserve_order` for the whole workspace, and without serde's type errors
// (which quote the offending value).

enum Top {
    NotObject,
    /// The servers object and the key it was under (`mcpServers` first).
    Object {
        servers: Option<(&'static str, Ordered)>,
    },
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
                let mut mcp_servers = None;
                let mut servers = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "mcpServers" => mcp_servers = Some(map.next_value::<Ordered>()?),
                        // VS Code's `.vscode/mcp.json`.
                        "servers" => servers = Some(map.next_value::<Ordered>()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let servers = mcp_servers
                    .map(|o| ("mcpServers", o))
                    .or(servers.map(|o| ("servers", o)));
                Ok(Top::Object { servers })
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
        let env = env(vars);
        parse(
            text,
            &Vars {
                env: &env,
                home: Some(Path::new("/home/u")),
                root: Some(Path::new(WORK)),
            },
        )
        .unwrap()
    }

    fn spec_of(parsed: &ParsedConfig, index: usize) -> &TransportSpec {
        match &parsed.servers[index].1 {
            Ok(Entry::Server(server)) => &server.transport,
            other => panic!("server {index} is not usable: {other:?}"),
        }
    }

    fn error_of(parsed: &ParsedConfig, index: usize) -> &str {
        match &parsed.servers[index].1 {
            Err((error, _)) => error,
            other => panic!("server {index} has no error: {other:?}"),
        }
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
        let defs: Vec<&TransportSpec> = (0..4).map(|i| spec_of(&parsed, i)).collect();
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
    fn variables_expand_in_every_field_and_an_unset_one_fails_its_server_alone() {
        let parsed = parse_ok(
            r#"{"mcpServers": {
                "s": {"command": "${BIN_DIR}/srv", "args": ["--db", "${DB:-local.db}", "${workspaceFolder}/data"],
                      "env": {"TOKEN": "${GH_TOKEN}", "MIX": "a-${A}-${MISSING:-dflt}-$A"}, "cwd": "${SUB:-sub}"},
                "h": {"url": "${BASE}/mcp", "headers": {"Authorization": "Bearer ${GH_TOKEN}"}},
                "gone": {"command": "x", "env": {"K": "${NOPE}"}},
                "gone_url": {"url": "https://${NO_HOST}/mcp"},
                "fine": {"command": "x"}
            }}"#,
            &[
                ("GH_TOKEN", "ghp_secret"),
                ("A", "1"),
                ("BIN_DIR", "/opt/bin"),
                ("BASE", "https://mcp.example.test"),
            ],
        );
        let TransportSpec::Stdio {
            command,
            args,
            env,
            cwd,
        } = spec_of(&parsed, 0)
        else {
            panic!()
        };
        assert_eq!(command, "/opt/bin/srv");
        assert_eq!(args, &["--db", "local.db", "/work/ws/data"]);
        assert_eq!(env["TOKEN"], "ghp_secret");
        assert_eq!(env["MIX"], "a-1-dflt-$A");
        assert_eq!(cwd.as_deref(), Some(Path::new("/work/ws/sub")));
        let Ok(Entry::Server(s)) = &parsed.servers[0].1 else {
            panic!()
        };
        assert!(s.expanded_secrets.contains(&"ghp_secret".to_owned()));
        assert!(s.expanded_secrets.contains(&"/opt/bin".to_owned()));
        let TransportSpec::StreamableHttp { url, headers } = spec_of(&parsed, 1) else {
            panic!()
        };
        assert_eq!(url, "https://mcp.example.test/mcp");
        assert_eq!(headers["Authorization"], "Bearer ghp_secret");
        assert_eq!(
            error_of(&parsed, 2),
            "server \"gone\": \"env\" \"K\" uses the variable \"NOPE\", which is not set and has no default (write ${NOPE:-default} to give one)"
        );
        assert_eq!(
            error_of(&parsed, 3),
            "server \"gone_url\": \"url\" uses the variable \"NO_HOST\", which is not set and has no default (write ${NO_HOST:-default} to give one)"
        );
        assert!(matches!(parsed.servers[4].1, Ok(Entry::Server(_))));
    }

    #[test]
    fn vs_code_files_use_servers_inputs_and_their_variables() {
        let text = r#"{
            // VS Code: .vscode/mcp.json
            "inputs": [{"type": "promptString", "id": "api-key", "description": "key", "password": true}],
            "servers": {
                "local": {"type": "stdio", "command": "${workspaceFolder}/bin/srv", "env": {"HOME_DIR": "${userHome}", "LANGV": "${env:LANG_X}"}},
                "remote": {"type": "http", "url": "https://h.test/mcp", "headers": {"Authorization": "Bearer ${input:api-key}"}},
            },
        }"#;
        let parsed = parse_ok(text, &[("LANG_X", "de")]);
        let TransportSpec::Stdio { command, env, .. } = spec_of(&parsed, 0) else {
            panic!()
        };
        assert_eq!(command, "/work/ws/bin/srv");
        assert_eq!(env["HOME_DIR"], "/home/u");
        assert_eq!(env["LANGV"], "de");
        assert_eq!(
            error_of(&parsed, 1),
            "server \"remote\": \"headers\" \"Authorization\" needs the input \"api-key\", which a headless agent cannot prompt for: set CTXSYNC_MCP_INPUT_API_KEY"
        );
        let parsed = parse_ok(
            text,
            &[("LANG_X", "de"), ("CTXSYNC_MCP_INPUT_API_KEY", "k-123456")],
        );
        let TransportSpec::StreamableHttp { headers, .. } = spec_of(&parsed, 1) else {
            panic!()
        };
        assert_eq!(headers["Authorization"], "Bearer k-123456");
    }

    #[test]
    fn jsonc_comments_trailing_commas_and_a_bom_are_read() {
        let text = "\u{feff}{\n  // a comment, with \"quotes\" and a , comma\n  \"mcpServers\": {\n    /* block\n       comment */\n    \"a\": {\"command\": \"x\", \"args\": [\"//not a comment\", \"/*nor this*/\",],},\n  },\n}\n";
        let parsed = parse_ok(text, &[]);
        let TransportSpec::Stdio { args, .. } = spec_of(&parsed, 0) else {
            panic!()
        };
        assert_eq!(args, &["//not a comment", "/*nor this*/"]);
    }

    #[test]
    fn syntax_errors_name_the_line_column_and_what_was_expected() {
        let env = env(&[]);
        let vars = Vars {
            env: &env,
            home: None,
            root: Some(Path::new(WORK)),
        };
        let cases = [
            (
                "{\n  \"mcpServers\": {\n    \"a\": {\"command\": \"sk-live-123\"}\n",
                "invalid JSON at line 4, column 0: the file ends inside an object: a closing } is missing",
            ),
            (
                "{\n  \"mcpServers\": {\n    a: {}\n  }\n}",
                "invalid JSON at line 3, column 5: expected a key in double quotes, like \"name\"",
            ),
            (
                "{\"mcpServers\": {\"a\": {\"command\" \"x\"}}}",
                "invalid JSON at line 1, column 33: expected a : between a key and its value",
            ),
            (
                "{\"mcpServers\": {} /* open",
                "invalid JSON at line 1, column 19: a /* comment is never closed with */",
            ),
            ("", "invalid JSON at line 1, column 0: the file is empty"),
            (
                r#"["sk-live-123"]"#,
                "invalid MCP config: the top level is not a JSON object",
            ),
            (
                r#"{"other": {}}"#,
                "invalid MCP config: no \"mcpServers\" object (Claude Code, Claude Desktop, Cursor, Roo) or \"servers\" object (VS Code)",
            ),
            (
                r#"{"mcpServers": "sk-live-123"}"#,
                "invalid MCP config: \"mcpServers\" is not a JSON object",
            ),
        ];
        for (text, expected) in cases {
            let error = parse(text, &vars).unwrap_err();
            assert_eq!(error, expected, "{text}");
            assert!(!error.contains("sk-live-123"), "{error}");
        }
    }

    #[test]
    fn disabled_servers_and_sse_and_headers_helper_are_read() {
        let parsed = parse_ok(
            r#"{"mcpServers": {
                "off": {"command": "x", "disabled": true},
                "off_http": {"url": "http://h/mcp", "disabled": true},
                "on": {"command": "x", "disabled": false},
                "legacy": {"type": "sse", "url": "http://h/sse"},
                "helped": {"url": "http://h/mcp", "headersHelper": "./auth.sh"},
                "_lead": {"command": "x"},
                "tilde": {"command": "~/bin/srv"},
                "rel": {"command": "scripts/srv.py", "cwd": "tools"},
                "bare": {"command": "python3"}
            }}"#,
            &[],
        );
        assert!(matches!(
            parsed.servers[0].1,
            Ok(Entry::Disabled(v1::McpTransport::Stdio))
        ));
        assert!(matches!(
            parsed.servers[1].1,
            Ok(Entry::Disabled(v1::McpTransport::StreamableHttp))
        ));
        assert!(matches!(parsed.servers[2].1, Ok(Entry::Server(_))));
        assert!(
            matches!(spec_of(&parsed, 3), TransportSpec::Sse { url, .. } if url == "http://h/sse")
        );
        let Ok(Entry::Server(helped)) = &parsed.servers[4].1 else {
            panic!()
        };
        assert_eq!(helped.headers_helper.as_deref(), Some("./auth.sh"));
        assert!(
            matches!(spec_of(&parsed, 5), TransportSpec::Stdio { cwd: Some(cwd), .. } if cwd == Path::new(WORK))
        );
        assert!(
            matches!(spec_of(&parsed, 6), TransportSpec::Stdio { command, .. } if command == "/home/u/bin/srv")
        );
        assert!(
            matches!(spec_of(&parsed, 7), TransportSpec::Stdio { command, cwd: Some(cwd), .. }
            if command == "/work/ws/tools/scripts/srv.py" && cwd == Path::new("/work/ws/tools"))
        );
        assert!(
            matches!(spec_of(&parsed, 8), TransportSpec::Stdio { command, .. } if command == "python3")
        );
    }

    #[test]
    fn config_files_belong_to_their_workspace_folder() {
        let work = Some(Path::new("/agent/wd"));
        for (path, root) in [
            ("/w/p/.mcp.json", "/w/p"),
            ("/w/p/.vscode/mcp.json", "/w/p"),
            ("/w/p/.cursor/mcp.json", "/w/p"),
            ("/w/p/.roo/mcp.json", "/w/p"),
            ("/etc/mcp.json", "/agent/wd"),
            ("/home/u/.claude.json", "/agent/wd"),
        ] {
            assert_eq!(
                config_root(Path::new(path), work),
                Some(PathBuf::from(root)),
                "{path}"
            );
        }
    }

    #[test]
    fn semantic_errors_are_per_server_and_quote_no_values() {
        let parsed = parse_ok(
            r#"{"mcpServers": {
                "none": {"args": ["sk-live-123"]},
                "bad_type": {"type": "websocket", "url": "http://u:sk-live-123@h/"},
                "a__b": {"command": "x"},
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
            .filter_map(|(n, d)| d.as_ref().err().map(|(e, _)| (n.as_str(), e.as_str())))
            .collect();
        assert!(errors["none"].contains("neither \"command\" nor \"url\""));
        assert!(errors["bad_type"].contains("unknown type \"websocket\""));
        assert!(errors["a__b"].contains("contains \"__\""));
        assert!(errors["trail_"].contains("ends with \"_\""));
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
        load(
            paths,
            LoadContext {
                env: &env(&[]),
                home: None,
                working_dir: Some(dir),
                max_servers: 100,
            },
        )
    }

    #[test]
    fn servers_over_the_cap_are_counted_on_their_file_row() {
        let tmp = tempfile::tempdir().unwrap();
        let entries: Vec<String> = (0..5)
            .map(|i| format!(r#""s{i}": {{"command": "x"}}"#))
            .collect();
        let file = write(
            tmp.path(),
            "a.json",
            &format!(r#"{{"mcpServers": {{{}}}}}"#, entries.join(",")),
        );
        let configs = load(
            std::slice::from_ref(&file),
            LoadContext {
                env: &env(&[]),
                home: None,
                working_dir: Some(tmp.path()),
                max_servers: 2,
            },
        );
        let names: Vec<&str> = configs.servers.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["s0", "s1"]);
        assert_eq!(configs.skipped, 3);
        assert_eq!(configs.files[0].status, ResourceStatus::Ok as i32);
        assert_eq!(
            configs.files[0].warning,
            "3 servers of this file not started: the workspace's limit of 2 started servers was reached (CTXSYNC_MCP_MAX_SERVERS (--mcp-max-servers))"
        );
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
        assert_eq!(
            configs.files[0].error,
            format!(
                "{}: invalid JSON at line 1, column 21: the file ends where a value was expected",
                bad.display()
            )
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
            root: None,
            headers_helper: Some("echo sk-live-123".into()),
            expanded_secrets: vec!["sk-live-123".into()],
        };
        assert!(!format!("{server:?}").contains("sk-live-123"));
    }
}
