//! The HTTP API for chat backends in any language.
//!
//! Every request carries a tenant key (`Authorization: Bearer cxk_…`, see
//! [`crate::auth`]); the tenant is the key's, never the body's. `POST
//! /api/v1/gate` takes `{"chat_id", "agent_id", "first_turn"}` and answers the
//! decision and the projection, with the catalog's pins and their tools; `GET
//! /api/v1/agents/{agent_id}/context` answers the current projection without
//! waiting. An agent of another tenant is 404, like an unknown one. Answers
//! are the proto messages (`TurnReply`, `ChatProjection`) in the workspace's
//! one JSON convention: pbjson with the proto's field names and every field
//! present; enums by their proto names (`GATE_DECISION_READY`), tool input
//! schemas as the JSON text the server gave (`input_schema_json`). Errors are
//! an `HttpErrorReply`, `{"error": {"code", "message", "limit"}}`, with 400,
//! 401, 404, 413, 415 or 503.

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ctxsync_proto::v1::{TurnRequest, service_error::Code};

use ctxsync_runtime::tenant_keys::{Caller, TenantKeys};
use gate_core::gate::Gate;
use gate_core::source::ReadError;

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
pub(crate) async fn caller(keys: &TenantKeys, headers: &HeaderMap) -> Result<Caller, Response> {
    let header = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or("?"));
    keys.authenticate(header).await.map_err(|refusal| {
        metrics::counter!("ctxsync_gate_refused_total", "reason" => refusal.reason()).increment(1);
        ctxsync_runtime::tenant_keys::refusal_response(refusal)
    })
}

pub(crate) use ctxsync_runtime::tenant_keys::error_response as error;

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
    // A `TurnRequest` (field names in snake_case or camelCase, unknown ones
    // refused); `first_turn` may be omitted, and `tenant`, if sent, must be the key's.
    let parsed: TurnRequest = match serde_json::from_slice(&body) {
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
    axum::Json(reply).into_response()
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
        Ok(projection) => axum::Json(projection).into_response(),
        Err(ReadError::Invalid(message)) => error(StatusCode::BAD_REQUEST, "invalid", message),
        Err(ReadError::NotFound(message)) => error(StatusCode::NOT_FOUND, "not_found", message),
        Err(ReadError::Unavailable(message)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
        }
    }
}
