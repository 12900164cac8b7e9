//! The OpenAPI document of ctxsync's HTTP APIs, with its schemas generated
//! from the protobuf descriptors (the JSON the services answer is those
//! messages serialised by pbjson: proto field names, every field present,
//! 64-bit integers as strings, enums by name), and a small validator that
//! checks a live answer against a schema.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message as _;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorSet};
use serde_json::{Map, Value, json};

/// Every message and enum of the contract, by full name without the leading dot.
pub struct Descriptors {
    messages: BTreeMap<String, DescriptorProto>,
    enums: BTreeMap<String, EnumDescriptorProto>,
}

impl Descriptors {
    pub fn load() -> Self {
        let set = FileDescriptorSet::decode(ctxsync_proto::FILE_DESCRIPTOR_SET)
            .expect("the contract's descriptors decode");
        let mut descriptors = Self {
            messages: BTreeMap::new(),
            enums: BTreeMap::new(),
        };
        for file in set.file {
            let package = file.package().to_owned();
            for message in file.message_type {
                descriptors.add_message(&package, message);
            }
            for enumeration in file.enum_type {
                descriptors
                    .enums
                    .insert(format!("{package}.{}", enumeration.name()), enumeration);
            }
        }
        descriptors
    }

    fn add_message(&mut self, scope: &str, message: DescriptorProto) {
        let name = format!("{scope}.{}", message.name());
        for nested in &message.nested_type {
            self.add_message(&name, nested.clone());
        }
        for enumeration in &message.enum_type {
            self.enums.insert(
                format!("{name}.{}", enumeration.name()),
                enumeration.clone(),
            );
        }
        self.messages.insert(name, message);
    }

    /// The schemas of `roots` and of every message they reach, keyed by
    /// full name (`ctxsync.v1.TurnReply`).
    pub fn schemas(&self, roots: &[&str]) -> BTreeMap<String, Value> {
        let mut schemas = BTreeMap::new();
        let mut pending: Vec<String> = roots.iter().map(|r| (*r).to_owned()).collect();
        while let Some(name) = pending.pop() {
            if schemas.contains_key(&name) {
                continue;
            }
            let (schema, reached) = self.message_schema(&name);
            schemas.insert(name, schema);
            pending.extend(reached);
        }
        schemas
    }

    /// The schemas of what the services parse as `roots` (and every message
    /// they reach), keyed `request.<full name>`: what pbjson accepts, not
    /// what it writes. Every field may be absent (proto3 defaults), the
    /// camelCase JSON name is accepted beside the proto name, a message field
    /// may be `null`, numbers may be sent as decimal strings and enums by
    /// number; an unknown field is refused.
    pub fn request_schemas(&self, roots: &[&str]) -> BTreeMap<String, Value> {
        let mut schemas = BTreeMap::new();
        let mut pending: Vec<String> = roots.iter().map(|r| (*r).to_owned()).collect();
        while let Some(name) = pending.pop() {
            let key = format!("{REQUEST}{name}");
            if schemas.contains_key(&key) {
                continue;
            }
            let (schema, reached) = self.request_schema(&name);
            schemas.insert(key, schema);
            pending.extend(reached);
        }
        schemas
    }

    fn request_schema(&self, name: &str) -> (Value, BTreeSet<String>) {
        let message = self
            .messages
            .get(name)
            .unwrap_or_else(|| panic!("no message {name} in the contract"));
        let mut reached = BTreeSet::new();
        let mut properties = Map::new();
        let mut one_name = Vec::new();
        for field in &message.field {
            let schema = if let Some(entry) = self.map_entry(field) {
                let value = entry
                    .field
                    .iter()
                    .find(|f| f.number() == 2)
                    .expect("a map entry has a value");
                json!({ "type": "object", "additionalProperties": self.request_value(value, &mut reached) })
            } else if field.label() == Label::Repeated {
                json!({ "type": "array", "items": self.request_value(field, &mut reached) })
            } else {
                let value = self.request_value(field, &mut reached);
                // pbjson reads a message field, and any field of a oneof, as
                // an Option: `null` is "unset".
                if field.r#type() == Type::Message || field.oneof_index.is_some() {
                    json!({ "anyOf": [value, { "type": "null" }] })
                } else {
                    value
                }
            };
            let json_name = field.json_name();
            if !json_name.is_empty() && json_name != field.name() {
                properties.insert(json_name.to_owned(), schema.clone());
                // A field named twice is refused as a duplicate.
                one_name.push(json!({ "not": { "required": [field.name(), json_name] } }));
            }
            properties.insert(field.name().to_owned(), schema);
        }
        let mut schema = json!({
            "type": "object",
            "properties": properties,
            "additionalProperties": false,
        });
        if !one_name.is_empty() {
            schema["allOf"] = Value::Array(one_name);
        }
        (schema, reached)
    }

    fn request_value(
        &self,
        field: &prost_types::FieldDescriptorProto,
        reached: &mut BTreeSet<String>,
    ) -> Value {
        match field.r#type() {
            // proto3 JSON parsing: any number as a JSON number or a decimal string.
            Type::Int32
            | Type::Sint32
            | Type::Sfixed32
            | Type::Uint32
            | Type::Fixed32
            | Type::Int64
            | Type::Sint64
            | Type::Sfixed64
            | Type::Uint64
            | Type::Fixed64 => json!({ "type": ["integer", "string"] }),
            Type::Double | Type::Float => json!({ "type": ["number", "string"] }),
            Type::Enum => {
                let name = field.type_name().trim_start_matches('.');
                let enumeration = self
                    .enums
                    .get(name)
                    .unwrap_or_else(|| panic!("no enum {name}"));
                let names = enumeration.value.iter().map(|v| Value::from(v.name()));
                let numbers = enumeration.value.iter().map(|v| Value::from(v.number()));
                json!({ "enum": names.chain(numbers).collect::<Vec<_>>() })
            }
            Type::Message | Type::Group if !field.type_name().starts_with(".google.protobuf.") => {
                let name = field.type_name().trim_start_matches('.');
                reached.insert(name.to_owned());
                json!({ "$ref": format!("#/components/schemas/{REQUEST}{name}") })
            }
            _ => self.scalar_or_ref(field, reached),
        }
    }

    fn message_schema(&self, name: &str) -> (Value, BTreeSet<String>) {
        let message = self
            .messages
            .get(name)
            .unwrap_or_else(|| panic!("no message {name} in the contract"));
        let mut reached = BTreeSet::new();
        let mut properties = Map::new();
        let mut required = Vec::new();
        for field in &message.field {
            // Absent when unset: a field of a oneof (a proto3 `optional` is a
            // synthetic one) and a singular message field (pbjson writes no null).
            let in_oneof = field.oneof_index.is_some();
            let singular_message =
                field.r#type() == Type::Message && field.label() != Label::Repeated;
            if !in_oneof && !singular_message {
                required.push(Value::from(field.name()));
            }
            let schema = if let Some(entry) = self.map_entry(field) {
                let value = entry
                    .field
                    .iter()
                    .find(|f| f.number() == 2)
                    .expect("a map entry has a value");
                json!({ "type": "object", "additionalProperties": self.scalar_or_ref(value, &mut reached) })
            } else if field.label() == Label::Repeated {
                json!({ "type": "array", "items": self.scalar_or_ref(field, &mut reached) })
            } else {
                self.scalar_or_ref(field, &mut reached)
            };
            properties.insert(field.name().to_owned(), schema);
        }
        let mut schema = json!({
            "type": "object",
            "properties": properties,
            "additionalProperties": false,
        });
        if !required.is_empty() {
            schema["required"] = Value::Array(required);
        }
        (schema, reached)
    }

    fn map_entry(&self, field: &prost_types::FieldDescriptorProto) -> Option<&DescriptorProto> {
        if field.r#type() != Type::Message {
            return None;
        }
        let message = self
            .messages
            .get(field.type_name().trim_start_matches('.'))?;
        message
            .options
            .as_ref()
            .is_some_and(|o| o.map_entry())
            .then_some(message)
    }

    fn scalar_or_ref(
        &self,
        field: &prost_types::FieldDescriptorProto,
        reached: &mut BTreeSet<String>,
    ) -> Value {
        match field.r#type() {
            Type::String => json!({ "type": "string" }),
            Type::Bytes => json!({ "type": "string", "format": "byte" }),
            Type::Bool => json!({ "type": "boolean" }),
            Type::Int32 | Type::Sint32 | Type::Sfixed32 | Type::Uint32 | Type::Fixed32 => {
                json!({ "type": "integer" })
            }
            // proto3 JSON: 64-bit integers travel as decimal strings.
            Type::Int64 | Type::Sint64 | Type::Sfixed64 | Type::Uint64 | Type::Fixed64 => {
                json!({ "type": "string", "format": "int64" })
            }
            Type::Double | Type::Float => json!({ "type": "number" }),
            Type::Enum => {
                let name = field.type_name().trim_start_matches('.');
                let enumeration = self
                    .enums
                    .get(name)
                    .unwrap_or_else(|| panic!("no enum {name}"));
                let values: Vec<Value> = enumeration
                    .value
                    .iter()
                    .map(|v| Value::from(v.name()))
                    .collect();
                json!({ "type": "string", "enum": values })
            }
            Type::Message | Type::Group => match field.type_name().trim_start_matches('.') {
                "google.protobuf.Timestamp" => json!({ "type": "string", "format": "date-time" }),
                "google.protobuf.Duration" => json!({ "type": "string" }),
                "google.protobuf.Struct" => json!({ "type": "object" }),
                "google.protobuf.Value" => json!({}),
                "google.protobuf.ListValue" => json!({ "type": "array" }),
                name => {
                    reached.insert(name.to_owned());
                    json!({ "$ref": format!("#/components/schemas/{name}") })
                }
            },
        }
    }
}

/// Why `value` does not fit `schema` (empty: it fits). `$ref`s resolve in
/// `document`'s `components.schemas`.
pub fn violations(document: &Value, schema: &Value, value: &Value) -> Vec<String> {
    let mut found = Vec::new();
    check(document, schema, value, "$", &mut found);
    found
}

fn check(document: &Value, schema: &Value, value: &Value, at: &str, found: &mut Vec<String>) {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.trim_start_matches("#/components/schemas/");
        let target = &document["components"]["schemas"][name];
        if target.is_null() {
            found.push(format!("{at}: unknown schema {reference}"));
            return;
        }
        return check(document, target, value, at, found);
    }
    let fits = match schema["type"].as_str() {
        None => true,
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        Some(other) => {
            found.push(format!("{at}: schema type {other} not understood"));
            return;
        }
    };
    if !fits {
        found.push(format!("{at}: {value} is not {}", schema["type"]));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        found.push(format!("{at}: {value} is none of {allowed:?}"));
    }
    if let Some(items) = schema.get("items") {
        for (i, item) in value.as_array().into_iter().flatten().enumerate() {
            check(document, items, item, &format!("{at}[{i}]"), found);
        }
    }
    if let Some(object) = value.as_object() {
        let properties = schema["properties"].as_object();
        for name in schema["required"].as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or_default();
            if !object.contains_key(name) {
                found.push(format!("{at}: {name} missing"));
            }
        }
        for (name, field) in object {
            let path = format!("{at}.{name}");
            match (
                properties.and_then(|p| p.get(name)),
                &schema["additionalProperties"],
            ) {
                (Some(property), _) => check(document, property, field, &path, found),
                (None, Value::Bool(false)) => found.push(format!("{path}: not in the schema")),
                (None, additional) if additional.is_object() => {
                    check(document, additional, field, &path, found)
                }
                (None, _) => {}
            }
        }
    }
}

/// One operation of an HTTP API.
struct Operation {
    method: &'static str,
    path: &'static str,
    summary: &'static str,
    security: &'static str,
    request: Option<&'static str>,
    /// Path and query parameters: (name, where, description).
    parameters: &'static [(&'static str, &'static str, &'static str)],
    answer: &'static str,
    /// `application/json`, or `text/event-stream` whose events carry `answer`.
    media: &'static str,
    refusals: &'static [(u16, &'static str)],
}

const JSON: &str = "application/json";
const EVENT_STREAM: &str = "text/event-stream";
const AGENT_ID: &[(&str, &str, &str)] = &[("agent_id", "path", "the agent's id (a UUID)")];

const AGENT_REFUSALS: &[(u16, &str)] = &[
    (400, "malformed or invalid, naming the field or limit"),
    (401, "missing or unknown agent token"),
    (413, "body over the request limit"),
    (415, "neither application/json nor application/x-protobuf"),
    (503, "the store did not answer in time; retry (Retry-After)"),
];

const CATALOG_REFUSALS: &[(u16, &str)] = &[
    (400, "malformed query"),
    (401, "missing, unknown or revoked tenant key"),
    (
        403,
        "its Host or browser Origin is not allowed (CTXSYNC_HTTP_ALLOWED_HOSTS, CTXSYNC_HTTP_ALLOWED_ORIGINS)",
    ),
    (404, "this gate does not use a catalog"),
    (
        503,
        "the catalog did not answer in time or failed; retry (Retry-After)",
    ),
];

const CHAT_REFUSALS: &[(u16, &str)] = &[
    (400, "malformed or invalid, naming the field"),
    (401, "missing, unknown or revoked tenant key"),
    (
        403,
        "its Host or browser Origin is not allowed (CTXSYNC_HTTP_ALLOWED_HOSTS, CTXSYNC_HTTP_ALLOWED_ORIGINS)",
    ),
    (
        404,
        "no such agent in the key's tenant (another tenant's agent included)",
    ),
    (413, "body over the request limit"),
    (415, "not application/json"),
    (
        503,
        "the store or the key check did not answer in time; retry (Retry-After)",
    ),
];

/// The event stream's and its tickets' refusals: the chat refusals, and 429
/// past the per-key and per-tenant bounds.
const PAGE_STREAM_REFUSALS: &[(u16, &str)] = &[
    (400, "malformed or invalid, naming the field"),
    (
        401,
        "missing, unknown or revoked tenant key, or an unknown, used or expired ticket",
    ),
    (
        403,
        "its Host or browser Origin is not allowed (CTXSYNC_HTTP_ALLOWED_HOSTS, CTXSYNC_HTTP_ALLOWED_ORIGINS)",
    ),
    (
        404,
        "no such agent in the key's tenant (another tenant's agent included)",
    ),
    (413, "body over the request limit"),
    (415, "not application/json"),
    (
        429,
        "past a bound of the key or tenant (streams per key and per tenant, tickets per tenant; `limit` names the setting); retry (Retry-After)",
    ),
    (
        503,
        "the store or the key check did not answer in time; retry (Retry-After)",
    ),
];

const OPERATIONS: &[Operation] = &[
    Operation {
        method: "post",
        path: "/api/v1/agent/startup",
        summary: "agent-ingest: a workspace agent process announces its run",
        security: "agentToken",
        request: Some("ctxsync.v1.StartupRequest"),
        parameters: &[],
        answer: "ctxsync.v1.StartupResponse",
        media: JSON,
        refusals: AGENT_REFUSALS,
    },
    Operation {
        method: "post",
        path: "/api/v1/agent/context-state",
        summary: "agent-ingest: a workspace agent pushes its discovery report",
        security: "agentToken",
        request: Some("ctxsync.v1.PushContextStateRequest"),
        parameters: &[],
        answer: "ctxsync.v1.PushContextStateResponse",
        media: JSON,
        refusals: AGENT_REFUSALS,
    },
    Operation {
        method: "post",
        path: "/api/v1/gate",
        summary: "chat-gate: may this turn run, and with which context (a first turn waits for discovery)",
        security: "tenantKey",
        request: Some("ctxsync.v1.TurnRequest"),
        parameters: &[],
        answer: "ctxsync.v1.TurnReply",
        media: JSON,
        refusals: CHAT_REFUSALS,
    },
    Operation {
        method: "get",
        path: "/api/v1/agents/{agent_id}/context",
        summary: "chat-gate: the agent's current projection, without waiting",
        security: "tenantKey",
        request: None,
        parameters: AGENT_ID,
        answer: "ctxsync.v1.ChatProjection",
        media: JSON,
        refusals: CHAT_REFUSALS,
    },
    Operation {
        method: "get",
        path: "/api/v1/agents",
        summary: "chat-gate (context page): the key's tenant's agents, a page at a time",
        security: "tenantKey",
        request: None,
        parameters: &[
            (
                "q",
                "query",
                "only agents whose name, workspace or id contains this (case-insensitive)",
            ),
            (
                "after",
                "query",
                "the `next_after_agent_id` of the previous page",
            ),
            (
                "limit",
                "query",
                "agents per page: 50 by default, at most 200",
            ),
        ],
        answer: "ctxsync.v1.AgentListReply",
        media: JSON,
        refusals: CHAT_REFUSALS,
    },
    Operation {
        method: "get",
        path: "/api/v1/catalog",
        summary: "chat-gate (context page): the key's tenant's catalog servers (memory, warm-up state) and its latency aggregates",
        security: "tenantKey",
        request: None,
        parameters: &[(
            "window_seconds",
            "query",
            "the latency window: the last 24 hours by default, at most 90 days",
        )],
        answer: "ctxsync.v1.CatalogStatusReply",
        media: JSON,
        refusals: CATALOG_REFUSALS,
    },
    Operation {
        method: "post",
        path: "/api/v1/events/ticket",
        summary: "chat-gate (context page): a single-use ticket (30 s) for the event stream, which cannot send headers",
        security: "tenantKey",
        request: None,
        parameters: &[],
        answer: "ctxsync.v1.EventTicketReply",
        media: JSON,
        refusals: PAGE_STREAM_REFUSALS,
    },
    Operation {
        method: "get",
        path: "/api/v1/events",
        summary: "chat-gate (context page): server-sent `agent` events, one per committed change of the ticket's tenant's agents",
        security: "ticket",
        request: None,
        parameters: &[(
            "ticket",
            "query",
            "a ticket from POST /api/v1/events/ticket",
        )],
        answer: "ctxsync.v1.PageEvent",
        media: EVENT_STREAM,
        refusals: PAGE_STREAM_REFUSALS,
    },
];

/// What a path or query parameter may hold: the numbers are parsed as
/// unsigned integers (`limit` a u32, 0 meaning the default and anything past
/// the most clamped; `window_seconds` a u64, clamped likewise), agent ids
/// are UUIDs.
fn parameter_schema(name: &str) -> Value {
    match name {
        "limit" => json!({ "type": "integer", "minimum": 0, "maximum": u32::MAX }),
        "window_seconds" => json!({ "type": "integer", "minimum": 0, "maximum": u64::MAX }),
        "agent_id" => json!({ "type": "string", "format": "uuid" }),
        // Empty: the first page.
        "after" => json!({ "anyOf": [{ "type": "string", "format": "uuid" }, { "const": "" }] }),
        _ => json!({ "type": "string" }),
    }
}

/// The prefix of a request body's schemas ([`Descriptors::request_schemas`]).
pub const REQUEST: &str = "request.";

/// The error every API answers with.
pub const ERROR_SCHEMA: &str = "ctxsync.v1.HttpErrorReply";

/// The whole document: the operations above, the operator endpoints every
/// service serves, and the schemas of every message they carry.
pub fn document() -> Value {
    let descriptors = Descriptors::load();
    let mut roots: Vec<&str> = vec![ERROR_SCHEMA];
    let mut request_roots: Vec<&str> = Vec::new();
    let mut paths = Map::new();
    let reference = |name: &str| json!({ "$ref": format!("#/components/schemas/{name}") });
    for operation in OPERATIONS {
        roots.push(operation.answer);
        let mut responses = Map::new();
        let answer = if operation.media == EVENT_STREAM {
            // OpenAPI 3.1: an event stream's schema describes each event.
            json!({
                "description": "a stream of server-sent events: `ready` once it is live, \
                    `agent` (this message as JSON in its data) per committed change, \
                    `resync` when changes were missed (re-read everything)",
                "content": { EVENT_STREAM: { "schema": { "oneOf": [
                    {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": { "const": "agent" },
                            "data": {
                                "type": "string",
                                "contentMediaType": JSON,
                                "contentSchema": reference(operation.answer),
                            },
                        },
                    },
                    {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": { "enum": ["ready", "resync"] },
                            "data": { "const": "{}" },
                        },
                    },
                ] } } },
            })
        } else {
            json!({
                "description": "the answer",
                "content": { JSON: { "schema": reference(operation.answer) } },
            })
        };
        responses.insert("200".into(), answer);
        for (status, why) in operation.refusals {
            responses.insert(
                status.to_string(),
                json!({
                    "description": why,
                    "content": { "application/json": { "schema": reference(ERROR_SCHEMA) } },
                }),
            );
        }
        let security = if operation.security == "ticket" {
            json!([])
        } else {
            json!([{ operation.security: [] }])
        };
        let mut entry = json!({
            "summary": operation.summary,
            "security": security,
            "responses": responses,
        });
        if let Some(request) = operation.request {
            request_roots.push(request);
            let mut content = json!({ "application/json": {
                "schema": reference(&format!("{REQUEST}{request}"))
            } });
            if operation.security == "agentToken" {
                content["application/x-protobuf"] =
                    json!({ "schema": { "type": "string", "format": "binary" } });
            }
            entry["requestBody"] = json!({ "required": true, "content": content });
        }
        if !operation.parameters.is_empty() {
            let parameters: Vec<Value> = operation
                .parameters
                .iter()
                .map(|(name, place, description)| {
                    json!({
                        "name": name, "in": place, "description": description,
                        "required": *place == "path" || *name == "ticket",
                        "schema": parameter_schema(name),
                    })
                })
                .collect();
            entry["parameters"] = Value::Array(parameters);
        }
        paths
            .entry(operation.path)
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("a path item")
            .insert(operation.method.into(), entry);
    }
    let operator = |summary: &str, media: &str, schema: Value| {
        json!({ "get": {
            "summary": summary,
            "responses": { "200": { "description": "ok", "content": { media: { "schema": schema } } } },
        }})
    };
    let mut page = operator(
        "chat-gate: the context page (HTML, no external resources; asks for a tenant key)",
        "text/html",
        json!({ "type": "string" }),
    );
    page["get"]["responses"]["403"] = json!({
        "description": "its Host or browser Origin is not allowed (CTXSYNC_HTTP_ALLOWED_HOSTS, CTXSYNC_HTTP_ALLOWED_ORIGINS)",
        "content": { JSON: { "schema": { "$ref": format!("#/components/schemas/{ERROR_SCHEMA}") } } },
    });
    paths.insert("/ui/".into(), page);
    paths.insert(
        "/healthz".into(),
        operator(
            "every service: the process is up",
            "text/plain",
            json!({ "type": "string" }),
        ),
    );
    paths.insert(
        "/readyz".into(),
        operator(
            "every service: its dependencies answer (503 with the failing checks when not)",
            "application/json",
            json!({ "type": "object" }),
        ),
    );
    paths.insert(
        "/metrics".into(),
        operator(
            "every service: Prometheus text format",
            "text/plain",
            json!({ "type": "string" }),
        ),
    );
    let schemas: Map<String, Value> = descriptors
        .schemas(&roots)
        .into_iter()
        .chain(descriptors.request_schemas(&request_roots))
        .collect();
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "ctxsync HTTP APIs",
            "version": "v1",
            "description": "agent-ingest (workspace agents) and chat-gate (chat backends). Every answer is a ctxsync.v1 protobuf message in proto3 JSON: proto field names, every field present, 64-bit integers as strings, enums by name. Generated from proto/ by tests/e2e/tests/openapi.rs; do not edit by hand.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {
                "agentToken": { "type": "http", "scheme": "bearer", "description": "an agent's token (`ctxsync agent register`)" },
                "tenantKey": { "type": "http", "scheme": "bearer", "description": "a tenant key (`ctxsync tenant key create`)" },
            },
            "schemas": schemas,
        },
    })
}
