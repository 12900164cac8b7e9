//! The HTTP API for chat backends in any language.
//!
//! Every request carries a tenant key (`Authorization: Bearer cxk_…`, see
//! [`crate::auth`]); the tenant is the key's, never the body's. `POST
//! /api/v1/gate` takes `{"chat_id", "agent_id", "first_turn"}` and answers the
//! decision and the projection, with the catalog's pins and their tools; `GET
//! /api/v1/agents/{agent_id}/context` answers the current projection without
//! waiting. An agent of another tenant is 404, like an unknown one. Answers
//! are plain JSON in snake_case with every field present, enums as lowercase
//! names and tool input schemas as JSON objects. Errors are `{"error":
//! {"code", "message"}}` with 400, 401, 404, 413, 415 or 503.

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ctxsync_proto::v1::{
    CatalogPin, ChatProjection, McpTransport, ResourceStatus, TurnReply, TurnRequest, catalog_pin,
    catalog_section, gate_error::Code, mcp_discovery::Phase,
};
use serde_json::{Value, json};

use crate::auth::{AuthError, Caller, TenantKeys};
use crate::core::gate::Gate;
use crate::core::source::ReadError;

/// Largest accepted request body, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What the handlers share.
#[derive(Clone)]
pub struct Api {
    pub gate: Gate,
    pub keys: TenantKeys,
}

pub fn routes(gate: Gate, keys: TenantKeys) -> Router {
    Router::new()
        .route("/api/v1/gate", post(turn))
        .route("/api/v1/agents/{agent_id}/context", get(context))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Api { gate, keys })
}

/// The caller, or the answer refusing it (before the body is looked at).
async fn caller(keys: &TenantKeys, headers: &HeaderMap) -> Result<Caller, Response> {
    let header = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or("?"));
    keys.authenticate(header).await.map_err(|refusal| {
        metrics::counter!("ctxsync_gate_refused_total", "reason" => refusal.reason()).increment(1);
        match refusal {
            AuthError::Unavailable(reason) => {
                tracing::warn!(%reason, "cannot check a tenant key");
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "cannot check the tenant key now; retry",
                )
            }
            refusal => {
                let mut response = error(
                    StatusCode::UNAUTHORIZED,
                    "unauthenticated",
                    refusal.to_string(),
                );
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"ctxsync\""),
                );
                response
            }
        }
    })
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let mut response = (
        status,
        axum::Json(json!({ "error": { "code": code, "message": message.into() } })),
    )
        .into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// The request body: exactly these fields; `first_turn` may be omitted, and
/// `tenant`, if sent, must be the key's.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TurnBody {
    chat_id: String,
    agent_id: String,
    #[serde(default)]
    first_turn: bool,
    #[serde(default)]
    tenant: String,
}

async fn turn(
    State(api): State<Api>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let caller = match caller(&api.keys, &headers).await {
        Ok(caller) => caller,
        Err(refused) => return refused,
    };
    if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
        let json = content_type
            .to_str()
            .is_ok_and(|v| v.trim_start().starts_with("application/json"));
        if !json {
            return error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("unsupported content type {content_type:?}: send application/json"),
            );
        }
    }
    let body = match body {
        Ok(body) => body,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "limit_exceeded",
                format!("request body is over the limit of {MAX_BODY_BYTES} bytes (request_bytes)"),
            );
        }
        Err(rejection) => {
            return error(StatusCode::BAD_REQUEST, "malformed", rejection.body_text());
        }
    };
    let parsed: TurnBody = match serde_json::from_slice(&body) {
        Ok(parsed) => parsed,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "malformed",
                format!(
                    "request body must be a JSON object {{\"chat_id\": string, \"agent_id\": string, \"first_turn\": bool}}: {e}"
                ),
            );
        }
    };
    if !parsed.tenant.is_empty() && parsed.tenant != caller.tenant {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid",
            "tenant differs from the tenant of your key: omit it (the key decides)",
        );
    }
    let reply = api
        .gate
        .turn(TurnRequest {
            chat_id: parsed.chat_id,
            agent_id: parsed.agent_id,
            first_turn: parsed.first_turn,
            tenant: caller.tenant,
        })
        .await;
    if let Some(e) = &reply.error {
        return match e.code() {
            Code::NotFound => error(StatusCode::NOT_FOUND, "not_found", e.message.clone()),
            _ => error(StatusCode::BAD_REQUEST, "invalid", e.message.clone()),
        };
    }
    axum::Json(reply_json(&reply)).into_response()
}

async fn context(
    State(api): State<Api>,
    headers: HeaderMap,
    Path(agent_id): Path<String>,
) -> Response {
    let caller = match caller(&api.keys, &headers).await {
        Ok(caller) => caller,
        Err(refused) => return refused,
    };
    match api.gate.context(&caller.tenant, &agent_id).await {
        Ok(projection) => axum::Json(projection_json(&projection)).into_response(),
        Err(ReadError::Invalid(message)) => error(StatusCode::BAD_REQUEST, "invalid", message),
        Err(ReadError::NotFound(message)) => error(StatusCode::NOT_FOUND, "not_found", message),
        Err(ReadError::Unavailable(message)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
        }
    }
}

fn phase_name(phase: i32) -> &'static str {
    match Phase::try_from(phase) {
        Ok(Phase::Pending) => "pending",
        Ok(Phase::Complete) => "complete",
        _ => "unspecified",
    }
}

fn status_name(status: i32) -> &'static str {
    match ResourceStatus::try_from(status) {
        Ok(ResourceStatus::Ok) => "ok",
        Ok(ResourceStatus::Invalid) => "invalid",
        Ok(ResourceStatus::Unreadable) => "unreadable",
        Ok(ResourceStatus::Oversize) => "oversize",
        Ok(ResourceStatus::Excluded) => "excluded",
        _ => "unspecified",
    }
}

fn transport_name(transport: i32) -> &'static str {
    match McpTransport::try_from(transport) {
        Ok(McpTransport::Stdio) => "stdio",
        Ok(McpTransport::StreamableHttp) => "streamable_http",
        _ => "unspecified",
    }
}

pub fn reply_json(reply: &TurnReply) -> Value {
    json!({
        "decision": reply.decision().label(),
        "waited_ms": reply.waited_ms,
        "attempt_reused": reply.attempt_reused,
        "joined_attempt": reply.joined_attempt,
        "projection": reply.projection.as_ref().map(projection_json),
    })
}

/// The projection as readable JSON: input schemas become objects.
pub fn projection_json(p: &ChatProjection) -> Value {
    let counts = p.counts.unwrap_or_default();
    let catalog = p.catalog.clone().unwrap_or_default();
    let catalog_status = match catalog.status() {
        catalog_section::Status::Ready => "ready",
        catalog_section::Status::Failed => "failed",
        _ => "not_requested",
    };
    json!({
        "agent_id": p.agent_id,
        "agent_run_id": p.agent_run_id,
        "has_snapshot": p.has_snapshot,
        "snapshot_agent_run_id": p.snapshot_agent_run_id,
        "snapshot_version": p.snapshot_version,
        "snapshot_hash": p.snapshot_hash,
        "snapshot_phase": phase_name(p.snapshot_phase),
        "phase": phase_name(p.phase),
        "stale": p.stale,
        "wait_timed_out": p.wait_timed_out,
        "store_error": p.store_error,
        "counts": {
            "servers_ok": counts.servers_ok,
            "servers_zero_tools": counts.servers_zero_tools,
            "servers_failed": counts.servers_failed,
            "invalid_config_files": counts.invalid_config_files,
            "tools": counts.tools,
            "tools_withheld": counts.tools_withheld,
            "instruction_files": counts.instruction_files,
            "skills": counts.skills,
        },
        "servers": p.servers.iter().map(|s| json!({
            "name": s.name,
            "transport": transport_name(s.transport),
            "config_path": s.config_path,
            "tools_withheld": s.tools_withheld,
            "warning": s.warning,
            "tools": s.tools.iter().map(|t| json!({
                "name": t.name,
                "server": t.server,
                "tool": t.tool,
                "description": t.description,
                "input_schema": schema_json(&t.input_schema_json),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "failed_servers": p.failed_servers.iter().map(|s| json!({
            "name": s.name,
            "config_path": s.config_path,
            "status": status_name(s.status),
            "error": s.error,
        })).collect::<Vec<_>>(),
        "invalid_config_files": p.invalid_config_files.iter().map(|f| json!({
            "path": f.path,
            "status": status_name(f.status),
            "error": f.error,
        })).collect::<Vec<_>>(),
        "instruction_files": p.instruction_files.iter().map(|f| json!({
            "path": f.path,
            "content": f.content,
            "truncated": f.truncated,
        })).collect::<Vec<_>>(),
        "skills": p.skills.iter().map(|s| json!({
            "name": s.name,
            "description": s.description,
            "dir": s.dir,
        })).collect::<Vec<_>>(),
        "summary": p.summary,
        "catalog": {
            "status": catalog_status,
            "pins": catalog.pins.iter().map(pin_json).collect::<Vec<_>>(),
            "error": catalog.error,
        },
    })
}

/// A catalog pin as the NATS reply carries it: the server, where its tools
/// came from, and the tools under the names a chat calls them by.
fn pin_json(pin: &CatalogPin) -> Value {
    let source = match pin.source() {
        catalog_pin::Source::Pinned => "pinned",
        catalog_pin::Source::Connected => "connected",
        catalog_pin::Source::Failed => "failed",
        catalog_pin::Source::Unspecified => "unspecified",
    };
    json!({
        "server_id": pin.server_id,
        "transport": transport_name(pin.transport),
        "source": source,
        "catalog_hash": pin.catalog_hash,
        "error": pin.error,
        "handshake_ms": pin.handshake_ms,
        "tools": pin.tools.iter().map(|t| json!({
            "name": t.name,
            "description": t.description,
            "input_schema": schema_json(&t.input_schema_json),
        })).collect::<Vec<_>>(),
    })
}

/// A schema that is not JSON is passed on as text rather than dropped.
fn schema_json(schema: &str) -> Value {
    serde_json::from_str::<Value>(schema).unwrap_or_else(|_| Value::String(schema.to_owned()))
}
