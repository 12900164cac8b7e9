//! Hostile input at agent-ingest, over real HTTP in front of a real
//! snapshot-store, nats-server and Postgres: NUL in strings is refused by
//! name, and a property test throws generated startups and pushes (valid and
//! hostile, some with unknown protobuf fields) at it: every answer is 2xx or
//! 4xx, a refused or dropped request changes nothing, an accepted one is
//! stored, and an unknown field is never the reason for a refusal.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use ctxsync_proto::limits;
use ctxsync_proto::rpc::store;
use ctxsync_proto::v1::mcp_discovery::Phase;
use ctxsync_proto::v1::*;
use ctxsync_runtime::Shutdown;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngSeed, TestCaseError, TestRunner};
use prost::Message;
use reqwest::StatusCode;
use serde_json::json;
use testkit::report::{instruction, pending, server};
use testkit::stack::{Stack, StackBuilder, TestStack};
use testkit::store::StoreClient;
use testkit::{NatsServer, TestDatabase};

const TIMEOUT: Duration = Duration::from_secs(10);
const TOKEN: &str = "tok-hostile";
const RUN_A: &str = "6f1c7a52-37a8-4c1e-9a51-0d7c9e1b2a33";
const RUN_B: &str = "0b0e4f7e-2d1c-4b7a-8f00-3c2a1e9d8b71";
const STARTUP: &str = "/api/v1/agent/startup";
const CONTEXT_STATE: &str = "/api/v1/agent/context-state";

struct Harness {
    _nats: NatsServer,
    _db: TestDatabase,
    api: StoreClient,
    /// snapshot-store and agent-ingest, running until `_shutdown` is cancelled.
    _stack: Stack,
    base: String,
    http: reqwest::Client,
    agent_id: String,
    _shutdown: Shutdown,
}

impl Harness {
    async fn spawn() -> Self {
        let TestStack { nats, db, prefix } = TestStack::private().await;
        let shutdown = Shutdown::new();
        let stack = testkit::stack::start(
            StackBuilder::new(nats.url(), &prefix)
                .database(db.url())
                .store(|_| {})
                .ingest(|_| {}),
            &shutdown,
        )
        .await;
        let client = async_nats::connect(nats.url()).await.unwrap();
        let subjects = ctxsync_proto::subjects::Subjects::new(&prefix).unwrap();
        let api = StoreClient::new(client, subjects, TIMEOUT, "ws").retrying_no_responders();
        let agent_id = api.register("hostile", TOKEN).await;
        Self {
            _nats: nats,
            _db: db,
            api,
            base: format!("http://{}", stack.ingest().http_addr()),
            _stack: stack,
            http: reqwest::Client::new(),
            agent_id,
            _shutdown: shutdown,
        }
    }

    async fn state(&self) -> AgentState {
        self.api.state(&self.agent_id).await
    }

    async fn post(&self, path: &str, content_type: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
        if body.len() > limits::MAX_REQUEST_BYTES {
            return self.post_head_only(path, content_type, body.len()).await;
        }
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
            .header("content-type", content_type)
            .body(body)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("ingest answers");
        let status = response.status();
        (status, response.bytes().await.unwrap().to_vec())
    }
}

impl Harness {
    /// A request declaring a `length`-byte body and sending none of it: ingest
    /// answers a body over its limit before reading it and closes, so a client
    /// still writing would see a broken pipe instead of the answer.
    async fn post_head_only(
        &self,
        path: &str,
        content_type: &str,
        length: usize,
    ) -> (StatusCode, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.base.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {TOKEN}\r\n\
             content-type: {content_type}\r\ncontent-length: {length}\r\nconnection: close\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut answer))
            .await
            .expect("answered without the body")
            .unwrap();
        let text = String::from_utf8_lossy(&answer);
        let status: u16 = text
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP answer: {text}"));
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.as_bytes().to_vec())
            .unwrap_or_default();
        (StatusCode::from_u16(status).unwrap(), body)
    }
}

/// The JSON error's code and message.
fn error_of(body: &[u8]) -> (String, String) {
    let body: serde_json::Value = serde_json::from_slice(body).expect("a JSON error body");
    (
        body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

const PROTOBUF: &str = "application/x-protobuf";
const JSON: &str = "application/json";

#[tokio::test]
async fn nul_in_any_string_is_a_400_naming_the_field_and_writes_nothing() {
    let h = Harness::spawn().await;
    let startup = StartupRequest {
        agent_run_id: RUN_A.into(),
        agent_version: "1.0".into(),
        ..Default::default()
    };
    let (status, _) = h.post(STARTUP, PROTOBUF, startup.encode_to_vec()).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = h
        .post(
            CONTEXT_STATE,
            PROTOBUF,
            pending(RUN_A, 1, vec![instruction("/w/AGENTS.md", "kept")]).encode_to_vec(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let before = h.state().await;

    let mut failed = server("s", &["a", "b"]);
    failed.error = "stderr: \0\0boom".into();
    let mut described = server("t", &["x", "y"]);
    if let Some(context_resource::Body::McpServer(body)) = described.body.as_mut() {
        body.tools[1].description = "a tool\0".into();
    }
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            STARTUP,
            StartupRequest {
                agent_run_id: "run\0".into(),
                ..Default::default()
            }
            .encode_to_vec(),
            "agent_run_id",
        ),
        (
            STARTUP,
            StartupRequest {
                agent_run_id: RUN_B.into(),
                agent_version: "v\0".into(),
                ..Default::default()
            }
            .encode_to_vec(),
            "agent_version",
        ),
        (
            CONTEXT_STATE,
            pending(RUN_A, 2, vec![instruction("/a", "x"), failed]).encode_to_vec(),
            "resources[1].error",
        ),
        (
            CONTEXT_STATE,
            pending(RUN_A, 2, vec![described]).encode_to_vec(),
            "resources[0].mcp_server.tools[1].description",
        ),
    ];
    for (path, body, field) in cases {
        let (status, answer) = h.post(path, PROTOBUF, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{field}");
        let (code, message) = error_of(&answer);
        assert_eq!(code, "invalid");
        assert!(
            message.starts_with(&format!("{field}: contains U+0000")),
            "{message}"
        );
    }
    // JSON's \u0000 is the same NUL.
    let (status, answer) = h
        .post(STARTUP, JSON, br#"{"agentRunId": "run-\u0000"}"#.to_vec())
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_of(&answer)
            .1
            .starts_with("agent_run_id: contains U+0000")
    );
    assert_eq!(h.state().await, before);
}

#[tokio::test]
async fn nul_in_an_agent_registration_is_refused_by_name() {
    let h = Harness::spawn().await;
    for (field, tenant, workspace, name) in [
        ("tenant", "ac\0me", "ws", "n1"),
        ("workspace", "acme", "w\0", "n2"),
        ("name", "acme", "ws", "\0"),
    ] {
        let reply = h
            .api
            .request::<store::RegisterAgent>(&RegisterAgentRequest {
                tenant: tenant.into(),
                workspace: workspace.into(),
                name: name.into(),
                token_sha256: testkit::report::sha(name),
            })
            .await;
        let error = reply.error.expect("refused");
        assert_eq!(
            error.code(),
            service_error::Code::InvalidArgument,
            "{field}"
        );
        // NUL is outside every identifier's alphabet: refused by the rule.
        assert!(
            error.message.starts_with(&format!("{field}: "))
                && error.message.contains("must be 1 to"),
            "{}",
            error.message
        );
        assert!(reply.agent_id.is_empty());
    }
}

#[tokio::test]
async fn a_version_past_i64_is_refused_by_name() {
    let h = Harness::spawn().await;
    let before = h.state().await;
    let (status, answer) = h
        .post(
            CONTEXT_STATE,
            PROTOBUF,
            pending(RUN_A, u64::MAX, vec![]).encode_to_vec(),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (code, message) = error_of(&answer);
    assert_eq!(code, "invalid");
    assert!(message.starts_with("version: "), "{message}");
    assert_eq!(h.state().await, before);
}

// ---- the property test -------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Startup,
    ContextState,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Self::Startup => STARTUP,
            Self::ContextState => CONTEXT_STATE,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Protobuf,
    Json,
}

/// One generated request.
#[derive(Clone)]
enum Input {
    Startup(StartupRequest, Encoding),
    Push(PushContextStateRequest, Encoding),
    /// A push's protobuf with an unknown field (one from a newer agent), at
    /// the top or in an extra resource appended at the end.
    UnknownField {
        push: PushContextStateRequest,
        number: u32,
        in_resource: bool,
    },
    /// Random bytes as protobuf.
    Bytes(Endpoint, Vec<u8>),
    /// Random JSON (keys mostly from the contract).
    Json(Endpoint, serde_json::Value),
    /// Random bytes as JSON.
    JsonBytes(Endpoint, Vec<u8>),
}

/// Short: a failing case's inputs can be megabytes.
impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = match self {
            Self::Startup(request, encoding) => format!("Startup({encoding:?}, {request:?})"),
            Self::Push(request, encoding) => format!("Push({encoding:?}, {request:?})"),
            Self::UnknownField {
                push,
                number,
                in_resource,
            } => format!("UnknownField({number}, in_resource: {in_resource}, {push:?})"),
            Self::Bytes(endpoint, bytes) => format!("Bytes({endpoint:?}, {bytes:?})"),
            Self::Json(endpoint, value) => format!("Json({endpoint:?}, {value})"),
            Self::JsonBytes(endpoint, bytes) => format!("JsonBytes({endpoint:?}, {bytes:?})"),
        };
        if text.len() > 2000 {
            let mut cut = 2000;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push('…');
        }
        f.write_str(&text)
    }
}

impl Input {
    fn endpoint(&self) -> Endpoint {
        match self {
            Self::Startup(..) => Endpoint::Startup,
            Self::Push(..) | Self::UnknownField { .. } => Endpoint::ContextState,
            Self::Bytes(e, _) | Self::Json(e, _) | Self::JsonBytes(e, _) => *e,
        }
    }

    /// The body and its content type.
    fn body(&self) -> (Encoding, Vec<u8>) {
        match self {
            Self::Startup(request, Encoding::Json) => match serde_json::to_vec(request) {
                Ok(json) => (Encoding::Json, json),
                Err(_) => (Encoding::Protobuf, request.encode_to_vec()),
            },
            Self::Startup(request, Encoding::Protobuf) => {
                (Encoding::Protobuf, request.encode_to_vec())
            }
            // pbjson cannot write an unknown enum number: those go as protobuf.
            Self::Push(request, Encoding::Json) => match serde_json::to_vec(request) {
                Ok(json) => (Encoding::Json, json),
                Err(_) => (Encoding::Protobuf, request.encode_to_vec()),
            },
            Self::Push(request, Encoding::Protobuf) => {
                (Encoding::Protobuf, request.encode_to_vec())
            }
            Self::UnknownField {
                push,
                number,
                in_resource,
            } => {
                use prost::encoding::{WireType, encode_key, encode_varint};
                let mut bytes = push.encode_to_vec();
                let mut unknown = Vec::new();
                encode_key(*number, WireType::Varint, &mut unknown);
                encode_varint(7, &mut unknown);
                if *in_resource {
                    let mut resource = instruction("/unknown", "u").encode_to_vec();
                    resource.extend_from_slice(&unknown);
                    prost::encoding::bytes::encode(5, &resource, &mut bytes);
                } else {
                    bytes.extend_from_slice(&unknown);
                }
                (Encoding::Protobuf, bytes)
            }
            Self::Bytes(_, bytes) => (Encoding::Protobuf, bytes.clone()),
            Self::Json(_, value) => (Encoding::Json, serde_json::to_vec(value).unwrap()),
            Self::JsonBytes(_, bytes) => (Encoding::Json, bytes.clone()),
        }
    }
}

/// Mostly plain, often hostile: NUL and other control characters, C1,
/// BOM, multi-byte characters.
fn text() -> impl Strategy<Value = String> {
    let hostile_char = prop_oneof![
        Just('\0'),
        Just('\u{1}'),
        Just('\u{1b}'),
        Just('\t'),
        Just('\n'),
        Just('\r'),
        Just('\u{7f}'),
        Just('\u{85}'),
        Just('\u{feff}'),
        Just('é'),
        Just('🦀'),
        proptest::char::range('a', 'z'),
    ];
    // A push has a dozen strings or more: mostly plain, so that whole
    // pushes are often valid too.
    prop_oneof![
        24 => "[a-z0-9/._:-]{0,16}",
        2 => vec(hostile_char, 0..16).prop_map(String::from_iter),
        1 => vec(any::<char>(), 0..16).prop_map(String::from_iter),
    ]
}

/// Strings at, just under and just over `limit` bytes (ASCII or ending in a
/// two-byte character).
fn around(limit: usize) -> impl Strategy<Value = String> {
    (limit - 1..=limit + 1, any::<bool>()).prop_map(|(bytes, multibyte)| {
        if multibyte && bytes >= 2 {
            format!("{}é", "x".repeat(bytes - 2))
        } else {
            "x".repeat(bytes)
        }
    })
}

fn run_id() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => Just(RUN_A.to_owned()),
        6 => Just(RUN_B.to_owned()),
        1 => Just(String::new()),
        1 => text(),
        1 => around(limits::MAX_RUN_ID_BYTES),
    ]
}

fn enum_value(max_valid: i32) -> impl Strategy<Value = i32> {
    prop_oneof![8 => 1..=max_valid, 1 => Just(0), 1 => any::<i32>()]
}

fn version() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1..40u64,
        1 => Just(0),
        1 => Just(i64::MAX as u64),
        1 => Just(i64::MAX as u64 + 1),
        1 => Just(u64::MAX),
    ]
}

fn source() -> impl Strategy<Value = String> {
    // A small pool, so duplicates happen.
    prop_oneof![
        6 => prop::sample::select(vec![
            "instruction_file:/w/AGENTS.md",
            "skill:/w/.agents/skills/review",
            "mcp_config:/w/.mcp.json",
            "mcp_server:notes",
            "mcp_server:github",
        ])
        .prop_map(str::to_owned),
        2 => text(),
        1 => around(limits::MAX_SOURCE_BYTES),
    ]
}

fn note() -> impl Strategy<Value = String> {
    prop_oneof![4 => Just(String::new()), 3 => text(), 1 => around(limits::MAX_ERROR_BYTES)]
}

fn tool() -> impl Strategy<Value = McpTool> {
    (
        text(),
        text(),
        prop_oneof![Just(r#"{"type":"object"}"#.to_owned()), text()],
    )
        .prop_map(|(name, description, input_schema_json)| McpTool {
            name,
            description,
            input_schema_json,
        })
}

fn body() -> impl Strategy<Value = Option<context_resource::Body>> {
    use context_resource::Body;
    // An instruction file's body is 10 bytes over its content at this size:
    // these contents put it just under, at and over the body limit.
    let big_content = (limits::MAX_RESOURCE_BODY_BYTES - 12..=limits::MAX_RESOURCE_BODY_BYTES - 8)
        .prop_map(|n| "c".repeat(n));
    prop_oneof![
        1 => Just(None),
        3 => (prop_oneof![4 => Just("/big".to_owned()), 1 => text()],
              prop_oneof![8 => text(), 1 => big_content], any::<bool>())
            .prop_map(|(path, content, truncated)| Some(Body::InstructionFile(InstructionFile { path, content, truncated }))),
        2 => (text(), text(), text())
            .prop_map(|(dir, name, description)| Some(Body::Skill(Skill { dir, name, description }))),
        2 => (text(), vec(text(), 0..4))
            .prop_map(|(path, server_names)| Some(Body::McpConfig(McpConfig { path, server_names }))),
        3 => (text(), enum_value(2), text(), vec(tool(), 0..4))
            .prop_map(|(name, transport, config_path, tools)| Some(Body::McpServer(McpServer { name, transport, config_path, tools }))),
    ]
}

fn kind_of(body: &Option<context_resource::Body>) -> i32 {
    use context_resource::Body;
    (match body {
        Some(Body::InstructionFile(_)) | None => ResourceKind::InstructionFile,
        Some(Body::Skill(_)) => ResourceKind::Skill,
        Some(Body::McpConfig(_)) => ResourceKind::McpConfig,
        Some(Body::McpServer(_)) => ResourceKind::McpServer,
    }) as i32
}

fn resource() -> impl Strategy<Value = ContextResource> {
    (
        source(),
        enum_value(5),
        note(),
        note(),
        body(),
        prop_oneof![9 => Just(None), 1 => any::<i32>().prop_map(Some)],
    )
        .prop_map(
            |(source, status, error, warning, body, kind)| ContextResource {
                source,
                kind: kind.unwrap_or_else(|| kind_of(&body)),
                status,
                error,
                warning,
                body,
            },
        )
}

fn resources() -> impl Strategy<Value = Vec<ContextResource>> {
    let many = (limits::MAX_RESOURCES - 1..=limits::MAX_RESOURCES + 1).prop_map(|n| {
        (0..n)
            .map(|i| instruction(&format!("/f{i}"), "x"))
            .collect()
    });
    // 15 and 16 fit in a request; 17 and 18 are over its 4 MiB (413 before
    // the body is read).
    let huge = (15..=18usize).prop_map(|n| {
        (0..n)
            .map(|i| instruction(&format!("/h{i}"), &"h".repeat(250 * 1024)))
            .collect()
    });
    prop_oneof![
        20 => vec(resource(), 0..6),
        1 => many,
        2 => huge,
    ]
}

fn context_config() -> impl Strategy<Value = Option<ContextConfig>> {
    prop_oneof![
        2 => Just(None),
        1 => (text(), vec(text(), 0..3), text(), vec(text(), 0..3), text(), vec(text(), 0..3))
            .prop_map(|(working_dir, instructions_dirs, instructions_file, skills_dirs, skill_meta_file, mcp_config_files)| {
                Some(ContextConfig { working_dir, instructions_dirs, instructions_file, skills_dirs, skill_meta_file, mcp_config_files })
            }),
    ]
}

fn push() -> impl Strategy<Value = PushContextStateRequest> {
    (
        run_id(),
        version(),
        any::<bool>(),
        prop_oneof![1 => Just(None), 6 => enum_value(2).prop_map(Some)],
        resources(),
        context_config(),
    )
        .prop_map(
            |(agent_run_id, version, initial, phase, resources, context_config)| {
                PushContextStateRequest {
                    agent_run_id,
                    version,
                    initial,
                    mcp_discovery: phase.map(|phase| McpDiscovery { phase }),
                    resources,
                    context_config,
                }
            },
        )
}

/// `text` without NUL, cut to `max` bytes on a char boundary.
fn tame_text(text: &mut String, max: usize) {
    text.retain(|c| c != '\0');
    let mut cut = text.len().min(max);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
}

/// Makes a generated push valid but for its run id and version, which decide
/// whether the store accepts it: control characters other than NUL stay (they
/// are storable), everything over a limit or unknown is brought within.
fn tame(mut push: PushContextStateRequest) -> PushContextStateRequest {
    use context_resource::Body;
    tame_text(&mut push.agent_run_id, limits::MAX_RUN_ID_BYTES);
    push.version = push.version.min(i64::MAX as u64);
    if let Some(discovery) = push.mcp_discovery.as_mut() {
        discovery.phase = discovery.phase.rem_euclid(3);
    }
    push.resources.truncate(limits::MAX_RESOURCES.min(15));
    let mut sources = std::collections::HashSet::new();
    for (index, resource) in push.resources.iter_mut().enumerate() {
        tame_text(&mut resource.source, limits::MAX_SOURCE_BYTES - 8);
        if !sources.insert(resource.source.clone()) || resource.source.is_empty() {
            resource.source.push_str(&format!("#{index}"));
            sources.insert(resource.source.clone());
        }
        tame_text(&mut resource.error, limits::MAX_ERROR_BYTES);
        tame_text(&mut resource.warning, limits::MAX_ERROR_BYTES);
        resource.status = 1 + resource.status.rem_euclid(5);
        resource.kind = kind_of(&resource.body);
        let text = |t: &mut String| tame_text(t, usize::MAX);
        match resource.body.as_mut() {
            None => {}
            Some(Body::InstructionFile(f)) => {
                text(&mut f.path);
                tame_text(&mut f.content, limits::MAX_RESOURCE_BODY_BYTES - 1024);
            }
            Some(Body::Skill(k)) => {
                text(&mut k.dir);
                text(&mut k.name);
                text(&mut k.description);
            }
            Some(Body::McpConfig(c)) => {
                text(&mut c.path);
                c.server_names.iter_mut().for_each(text);
            }
            Some(Body::McpServer(m)) => {
                m.transport = m.transport.rem_euclid(3);
                text(&mut m.name);
                text(&mut m.config_path);
                for tool in &mut m.tools {
                    text(&mut tool.name);
                    text(&mut tool.description);
                    text(&mut tool.input_schema_json);
                }
            }
        }
    }
    if let Some(config) = push.context_config.as_mut() {
        let text = |t: &mut String| tame_text(t, usize::MAX);
        text(&mut config.working_dir);
        text(&mut config.instructions_file);
        text(&mut config.skill_meta_file);
        config.instructions_dirs.iter_mut().for_each(text);
        config.skills_dirs.iter_mut().for_each(text);
        config.mcp_config_files.iter_mut().for_each(text);
    }
    push
}

fn startup() -> impl Strategy<Value = StartupRequest> {
    (
        run_id(),
        prop_oneof![4 => text(), 1 => around(limits::MAX_AGENT_VERSION_BYTES)],
        any::<bool>(),
    )
        .prop_map(|(agent_run_id, agent_version, reclaim)| StartupRequest {
            agent_run_id,
            agent_version,
            reclaim,
        })
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let key = prop_oneof![
        3 => prop::sample::select(vec![
            "agentRunId", "agent_run_id", "agentVersion", "reclaim", "version", "initial",
            "mcpDiscovery", "phase", "resources", "source", "kind", "status", "error",
            "warning", "instructionFile", "skill", "mcpConfig", "mcpServer", "path",
            "content", "tools", "name", "contextConfig",
        ])
        .prop_map(str::to_owned),
        1 => "[a-zA-Z_]{1,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        Just(json!("PHASE_COMPLETE")),
        Just(json!("RESOURCE_KIND_SKILL")),
        Just(json!(RUN_A)),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, move |inner| {
        prop_oneof![
            vec(inner.clone(), 0..5).prop_map(Value::Array),
            btree_map(key.clone(), inner, 0..6)
                .prop_map(|map: BTreeMap<String, Value>| Value::Object(map.into_iter().collect())),
        ]
    })
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    prop_oneof![Just(Endpoint::Startup), Just(Endpoint::ContextState)]
}

fn encoding() -> impl Strategy<Value = Encoding> {
    prop_oneof![3 => Just(Encoding::Protobuf), 2 => Just(Encoding::Json)]
}

fn input() -> impl Strategy<Value = Input> {
    // Field numbers the contract does not define: PushContextStateRequest
    // has 1-6, ContextResource 1-5 and 10-13.
    let unknown = prop_oneof![7..=9u32, 14..=1000u32, Just(536_870_911u32)];
    prop_oneof![
        4 => (startup(), encoding()).prop_map(|(s, e)| Input::Startup(s, e)),
        6 => (push(), encoding()).prop_map(|(p, e)| Input::Push(p, e)),
        6 => (push(), encoding()).prop_map(|(p, e)| Input::Push(tame(p), e)),
        1 => (prop_oneof![push(), push().prop_map(tame)], unknown, any::<bool>()).prop_map(|(push, number, in_resource)| Input::UnknownField { push, number, in_resource }),
        1 => (endpoint(), vec(any::<u8>(), 0..256)).prop_map(|(e, b)| Input::Bytes(e, b)),
        2 => (endpoint(), json_value()).prop_map(|(e, v)| Input::Json(e, v)),
        1 => (endpoint(), vec(any::<u8>(), 0..64)).prop_map(|(e, b)| Input::JsonBytes(e, b)),
    ]
}

/// What the cases did, so the test can show (and require) that it reached
/// every outcome.
#[derive(Debug, Default)]
struct Outcomes {
    startups_applied: usize,
    startups_dropped: usize,
    pushes_accepted: usize,
    pushes_dropped: usize,
    refused: BTreeMap<u16, usize>,
}

fn decode<T: Message + Default + serde::de::DeserializeOwned>(
    encoding: Encoding,
    bytes: &[u8],
) -> T {
    match encoding {
        Encoding::Protobuf => T::decode(bytes).expect("an answered request decodes"),
        Encoding::Json => serde_json::from_slice(bytes).expect("an answered request decodes"),
    }
}

async fn check(h: &Harness, input: Input, outcomes: &Mutex<Outcomes>) -> Result<(), TestCaseError> {
    let endpoint = input.endpoint();
    let (encoding, body) = input.body();
    let content_type = match encoding {
        Encoding::Protobuf => PROTOBUF,
        Encoding::Json => JSON,
    };
    let before = h.state().await;
    let (status, answer) = h.post(endpoint.path(), content_type, body.clone()).await;
    let after = h.state().await;
    prop_assert!(
        status.is_success() || status.is_client_error(),
        "answered {status}: {}",
        String::from_utf8_lossy(&answer)
    );
    if let Input::UnknownField { .. } = &input {
        // Accepted as protobuf intends: the answer is the one the push
        // without the field gets, refused only for what else it holds.
        let known = PushContextStateRequest::decode(body.as_slice()).expect("prost decodes it");
        if ctxsync_proto::validate::push(&known).is_ok() {
            prop_assert!(
                status.is_success(),
                "answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }
    if status.is_client_error() {
        prop_assert_eq!(&after, &before, "a refused request changed the state");
        *outcomes
            .lock()
            .unwrap()
            .refused
            .entry(status.as_u16())
            .or_default() += 1;
        return Ok(());
    }
    // 2xx: the answer says what happened, and the state agrees.
    match endpoint {
        Endpoint::Startup => {
            let sent: StartupRequest = decode(encoding, &body);
            let response: StartupResponse = decode(encoding, &answer);
            if response.drop_reason == 0 {
                let agent = after.agent.as_ref().unwrap();
                prop_assert_eq!(&agent.agent_run_id, &sent.agent_run_id);
                prop_assert_eq!(&agent.agent_version, &sent.agent_version);
                outcomes.lock().unwrap().startups_applied += 1;
            } else {
                prop_assert_eq!(&after, &before, "a dropped startup changed the state");
                outcomes.lock().unwrap().startups_dropped += 1;
            }
        }
        Endpoint::ContextState => {
            let sent: PushContextStateRequest = decode(encoding, &body);
            let response: PushContextStateResponse = decode(encoding, &answer);
            if response.accepted {
                let snapshot = after.snapshot.as_ref().unwrap();
                prop_assert_eq!(&snapshot.agent_run_id, &sent.agent_run_id);
                prop_assert_eq!(snapshot.version, sent.version);
                let phase = sent
                    .mcp_discovery
                    .map_or(Phase::Unspecified as i32, |d| d.phase);
                prop_assert_eq!(snapshot.phase, phase);
                prop_assert_eq!(&after.resources, &sent.resources);
                outcomes.lock().unwrap().pushes_accepted += 1;
            } else {
                prop_assert_eq!(&after, &before, "a dropped push changed the state");
                outcomes.lock().unwrap().pushes_dropped += 1;
            }
        }
    }
    Ok(())
}

/// 200 cases from a fixed seed (`PROPTEST_CASES` and `PROPTEST_RNG_SEED`
/// override both); no failure file is written into the repository: a
/// failure prints its minimal input and the seed reproduces it.
fn proptest_config() -> ProptestConfig {
    let mut config = ProptestConfig {
        failure_persistence: None,
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    };
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = 200;
    }
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        config.rng_seed = RngSeed::Fixed(0x0c75_5e11);
    }
    config
}

#[test]
fn any_input_is_answered_2xx_or_4xx_and_a_refused_one_changes_nothing() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let h = runtime.block_on(Harness::spawn());
    let outcomes = Mutex::new(Outcomes::default());
    let mut runner = TestRunner::new(proptest_config());
    let result = runner.run(&input(), |input| {
        runtime.block_on(check(&h, input, &outcomes))
    });
    let outcomes = outcomes.into_inner().unwrap();
    eprintln!("{outcomes:?}");
    if let Err(failure) = result {
        panic!("{failure}");
    }
    // The generator reaches every outcome (or this test could pass on nothing).
    assert!(outcomes.startups_applied >= 5, "{outcomes:?}");
    assert!(outcomes.pushes_accepted >= 5, "{outcomes:?}");
    assert!(outcomes.pushes_dropped >= 1, "{outcomes:?}");
    assert!(
        outcomes.refused.get(&400).copied().unwrap_or(0) >= 20,
        "{outcomes:?}"
    );
    drop(h);
    runtime.shutdown_timeout(Duration::from_secs(5));
}
