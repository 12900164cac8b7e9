//! What a request must be before anything is looked up or started: ids
//! present, storable and bounded; a call naming exactly one item, with
//! arguments that are a JSON object. A refusal names the field and never
//! echoes a value the user wrote (arguments are the user's content).

use ctxsync_proto::v1::{CatalogCallRequest, CatalogPrepareRequest, ServiceError};

use crate::code::ErrorCode;
use crate::tools::Item;

/// Longest tenant, session, server, tool or prompt id accepted, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Longest resource URI accepted in a call, in bytes.
pub const MAX_RESOURCE_URI_BYTES: usize = 8192;

/// A call's arguments.
pub type Arguments = serde_json::Map<String, serde_json::Value>;

/// An answer's error: its typed code and a message safe to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl Refusal {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::RequestInvalid, message)
    }

    /// As the wire says it: the envelope's code, the catalog's name as reason.
    pub fn to_proto(&self) -> ServiceError {
        ServiceError::new(self.code.service_code(), self.message.clone())
            .with_reason(self.code.as_str())
    }
}

/// A tenant, session, server, tool or prompt id: present, storable, bounded.
pub fn valid_request_id(name: &str, value: &str) -> Result<(), String> {
    valid_bounded(name, value, MAX_REQUEST_ID_BYTES)
}

/// Present, storable, at most `max` bytes.
pub fn valid_bounded(name: &str, value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{name} is empty"));
    }
    // Ids are stored in text columns, which cannot hold NUL.
    if let Some(at) = value.find('\0') {
        return Err(format!("{name} contains U+0000 (NUL) at byte {at}"));
    }
    if value.len() > max {
        return Err(format!(
            "{name} is {} bytes, over the limit of {max}",
            value.len()
        ));
    }
    Ok(())
}

/// A preparation's tenant and session ids.
pub fn valid_preparation(request: &CatalogPrepareRequest) -> Result<(), Refusal> {
    valid_request_id("tenant", &request.tenant)
        .and_then(|()| valid_request_id("session_id", &request.session_id))
        .map_err(Refusal::invalid)
}

/// A call's ids, its one item and its arguments; the arguments parsed.
pub fn valid_call(request: &CatalogCallRequest) -> Result<Arguments, Refusal> {
    valid_request_id("tenant", &request.tenant)
        .and_then(|()| valid_request_id("session_id", &request.session_id))
        .and_then(|()| valid_request_id("server_id", &request.server_id))
        .and_then(|()| valid_item(request))
        .and_then(|()| arguments_of(&request.arguments_json))
        .map_err(Refusal::invalid)
}

/// What the request names: its prompt, else its resource, else its tool.
pub fn item_of(request: &CatalogCallRequest) -> Item<'_> {
    if !request.prompt.is_empty() {
        Item::Prompt(&request.prompt)
    } else if !request.resource_uri.is_empty() {
        Item::Resource(&request.resource_uri)
    } else {
        Item::Tool(&request.tool)
    }
}

/// Exactly one of `tool`, `prompt` and `resource_uri`, each a valid id (a
/// URI may be longer).
fn valid_item(request: &CatalogCallRequest) -> Result<(), String> {
    let named = [&request.tool, &request.prompt, &request.resource_uri]
        .iter()
        .filter(|v| !v.is_empty())
        .count();
    if named > 1 {
        return Err("name exactly one of tool, prompt and resource_uri".to_owned());
    }
    match item_of(request) {
        Item::Tool(tool) => valid_request_id("tool", tool),
        Item::Prompt(prompt) => valid_request_id("prompt", prompt),
        Item::Resource(uri) => valid_bounded("resource_uri", uri, MAX_RESOURCE_URI_BYTES),
    }
}

/// The call's arguments: a JSON object, or nothing.
fn arguments_of(json: &str) -> Result<Arguments, String> {
    if json.trim().is_empty() {
        return Ok(Arguments::new());
    }
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        // Never echo the arguments: they are the user's content.
        Ok(_) => Err("arguments_json is not a JSON object".to_owned()),
        Err(e) => Err(format!(
            "arguments_json is not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        )),
    }
}
