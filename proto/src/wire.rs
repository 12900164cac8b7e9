//! Refusing unknown fields in protobuf bodies.
//!
//! prost skips fields it does not know; pbjson refuses them in JSON. So that
//! both encodings say no to the same thing, [`check_known_fields`] walks an
//! encoded message against the descriptors of [`crate::v1::FILE_DESCRIPTOR_SET`]
//! and names the first field number the contract does not define, with where
//! it is (`unknown field 99 in ctxsync.v1.PushContextStateRequest.resources[2]`).
//!
//! The walk reads tags and lengths only: no value is decoded and nothing is
//! allocated unless a field is refused. Run it after the body decoded (so it
//! is well-formed protobuf); it still reports malformed input rather than
//! panicking when it is not.

use std::collections::HashMap;
use std::sync::OnceLock;

use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorSet, field_descriptor_proto::Label};

/// Nesting deeper than this is refused (prost's own decode limit is 100).
const MAX_DEPTH: usize = 100;

/// Why a protobuf body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A field number the message type does not define.
    #[error("unknown field {number} in {path}")]
    UnknownField { number: u64, path: String },
    /// Bytes that are not protobuf (the decode normally refuses them first).
    #[error("malformed protobuf in {path}: {reason}")]
    Malformed { path: String, reason: &'static str },
    /// The type is not in the descriptor set (a programming error).
    #[error("message type {0} is not in the ctxsync descriptor set")]
    UnknownType(String),
}

/// Refuses the first field of `bytes` (an encoded `M`, nested messages
/// included) that `M`'s descriptor does not define.
pub fn check_known_fields<M: prost::Name>(bytes: &[u8]) -> Result<(), WireError> {
    check_known_fields_of(&M::full_name(), bytes)
}

/// [`check_known_fields`] by the message's full name (`ctxsync.v1.StartupRequest`).
pub fn check_known_fields_of(full_name: &str, bytes: &[u8]) -> Result<(), WireError> {
    let schema = schema();
    let Some(&root) = schema.by_name.get(full_name) else {
        return Err(WireError::UnknownType(full_name.to_owned()));
    };
    walk(schema, root, bytes, 0).map_err(|failure| failure.into_error(schema, root))
}

/// One message type: its fields sorted by number.
struct MessageType {
    full_name: String,
    fields: Vec<Field>,
    /// `slots[number]` is the field's index + 1 (0: undefined), for the
    /// small field numbers every ctxsync message uses; larger ones are searched.
    slots: Vec<u16>,
}

/// Field numbers below this are looked up in `slots`.
const DIRECT_LOOKUP: u64 = 256;

impl MessageType {
    fn field(&self, number: u64) -> Option<usize> {
        if number < DIRECT_LOOKUP {
            let slot = *self.slots.get(number as usize)?;
            return (slot > 0).then(|| usize::from(slot) - 1);
        }
        self.fields.binary_search_by_key(&number, |f| f.number).ok()
    }
}

struct Field {
    number: u64,
    name: String,
    repeated: bool,
    /// The message type of a message field (map entries included).
    message: Option<usize>,
}

struct Schema {
    messages: Vec<MessageType>,
    by_name: HashMap<String, usize>,
}

fn schema() -> &'static Schema {
    static SCHEMA: OnceLock<Schema> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let set = FileDescriptorSet::decode(crate::v1::FILE_DESCRIPTOR_SET)
            .expect("the embedded descriptor set decodes");
        Schema::from_descriptors(&set)
    })
}

impl Schema {
    fn from_descriptors(set: &FileDescriptorSet) -> Self {
        // Two passes: names first, so a field can refer to a type declared later.
        let mut declared: Vec<(String, &DescriptorProto)> = Vec::new();
        for file in &set.file {
            let package = file.package();
            for message in &file.message_type {
                collect(package, message, &mut declared);
            }
        }
        let by_name: HashMap<String, usize> = declared
            .iter()
            .enumerate()
            .map(|(index, (name, _))| (name.clone(), index))
            .collect();
        let messages = declared
            .iter()
            .map(|(full_name, descriptor)| {
                let mut fields: Vec<Field> = descriptor
                    .field
                    .iter()
                    .map(|field| Field {
                        number: u64::try_from(field.number()).unwrap_or_default(),
                        name: field.name().to_owned(),
                        repeated: field.label() == Label::Repeated,
                        message: field
                            .type_name
                            .as_deref()
                            .and_then(|t| by_name.get(t.trim_start_matches('.')).copied()),
                    })
                    .collect();
                fields.sort_by_key(|f| f.number);
                let direct = fields.iter().filter(|f| f.number < DIRECT_LOOKUP);
                let mut slots = vec![
                    0u16;
                    direct
                        .clone()
                        .map(|f| f.number as usize + 1)
                        .max()
                        .unwrap_or(0)
                ];
                for (index, field) in direct.enumerate() {
                    slots[field.number as usize] = index as u16 + 1;
                }
                MessageType {
                    full_name: full_name.clone(),
                    fields,
                    slots,
                }
            })
            .collect();
        Self { messages, by_name }
    }
}

fn collect<'a>(
    scope: &str,
    message: &'a DescriptorProto,
    out: &mut Vec<(String, &'a DescriptorProto)>,
) {
    let full_name = if scope.is_empty() {
        message.name().to_owned()
    } else {
        format!("{scope}.{}", message.name())
    };
    for nested in &message.nested_type {
        collect(&full_name, nested, out);
    }
    out.push((full_name, message));
}

/// Where the walk stopped: the innermost cause, then one step per enclosing
/// field on the way out.
struct Failure {
    kind: FailureKind,
    /// Innermost first: (message type, field index in it, element index if repeated).
    steps: Vec<(usize, usize, Option<usize>)>,
}

enum FailureKind {
    Unknown(u64),
    Malformed(&'static str),
}

impl Failure {
    fn new(kind: FailureKind) -> Self {
        Self {
            kind,
            steps: Vec::new(),
        }
    }

    fn into_error(self, schema: &Schema, root: usize) -> WireError {
        let mut path = schema.messages[root].full_name.clone();
        for &(message, field, index) in self.steps.iter().rev() {
            path.push('.');
            path.push_str(&schema.messages[message].fields[field].name);
            if let Some(index) = index {
                path.push_str(&format!("[{index}]"));
            }
        }
        match self.kind {
            FailureKind::Unknown(number) => WireError::UnknownField { number, path },
            FailureKind::Malformed(reason) => WireError::Malformed { path, reason },
        }
    }
}

/// One field occurrence: its number and where its value is.
struct Occurrence {
    number: u64,
    /// The value of a length-delimited field; empty for the other wire types.
    payload: std::ops::Range<usize>,
    length_delimited: bool,
}

/// Reads the field starting at `*pos` and moves past it.
fn next_field(bytes: &[u8], pos: &mut usize) -> Result<Occurrence, Failure> {
    let key = read_varint(bytes, pos)?;
    let number = key >> 3;
    if number == 0 {
        return Err(Failure::new(FailureKind::Malformed("field number 0")));
    }
    let skip = |pos: &mut usize, n: usize| -> Result<(), Failure> {
        if bytes.len() - *pos < n {
            return Err(Failure::new(FailureKind::Malformed("truncated value")));
        }
        *pos += n;
        Ok(())
    };
    match key & 7 {
        0 => {
            read_varint(bytes, pos)?;
        }
        1 => skip(pos, 8)?,
        5 => skip(pos, 4)?,
        2 => {
            let length = usize::try_from(read_varint(bytes, pos)?)
                .map_err(|_| Failure::new(FailureKind::Malformed("length overflows")))?;
            let start = *pos;
            skip(pos, length)?;
            return Ok(Occurrence {
                number,
                payload: start..start + length,
                length_delimited: true,
            });
        }
        _ => {
            return Err(Failure::new(FailureKind::Malformed(
                "unsupported wire type",
            )));
        }
    }
    Ok(Occurrence {
        number,
        payload: 0..0,
        length_delimited: false,
    })
}

fn read_varint(bytes: &[u8], pos: &mut usize) -> Result<u64, Failure> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let Some(&byte) = bytes.get(*pos) else {
            return Err(Failure::new(FailureKind::Malformed("truncated varint")));
        };
        *pos += 1;
        if shift == 63 && byte > 1 {
            return Err(Failure::new(FailureKind::Malformed("varint overflows")));
        }
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(Failure::new(FailureKind::Malformed("varint overflows")))
}

fn walk(schema: &Schema, message: usize, bytes: &[u8], depth: usize) -> Result<(), Failure> {
    if depth > MAX_DEPTH {
        return Err(Failure::new(FailureKind::Malformed("nested too deeply")));
    }
    let message_type = &schema.messages[message];
    let mut pos = 0;
    while pos < bytes.len() {
        let start = pos;
        let occurrence = next_field(bytes, &mut pos)?;
        let Some(field_index) = message_type.field(occurrence.number) else {
            return Err(Failure::new(FailureKind::Unknown(occurrence.number)));
        };
        let field = &message_type.fields[field_index];
        if let (Some(child), true) = (field.message, occurrence.length_delimited)
            && let Err(mut failure) =
                walk(schema, child, &bytes[occurrence.payload.clone()], depth + 1)
        {
            let index = field
                .repeated
                .then(|| occurrences_before(bytes, start, occurrence.number));
            failure.steps.push((message, field_index, index));
            return Err(failure);
        }
    }
    Ok(())
}

/// How often field `number` occurs in `bytes[..end]` (only on a refusal: the
/// element index of a repeated field in the error's path).
fn occurrences_before(bytes: &[u8], end: usize, number: u64) -> usize {
    let mut pos = 0;
    let mut count = 0;
    while pos < end {
        match next_field(bytes, &mut pos) {
            Ok(occurrence) if occurrence.number == number => count += 1,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{
        ContextResource, McpServer, McpTool, PushContextStateRequest, StartupRequest,
        context_resource::Body,
    };

    /// `field` as an unknown varint field appended to `bytes`.
    fn with_unknown_varint(mut bytes: Vec<u8>, field: u64) -> Vec<u8> {
        prost::encoding::encode_key(field as u32, prost::encoding::WireType::Varint, &mut bytes);
        prost::encoding::encode_varint(1, &mut bytes);
        bytes
    }

    fn server(tools: usize) -> ContextResource {
        ContextResource {
            source: "mcp_server:s".into(),
            kind: 4,
            status: 1,
            body: Some(Body::McpServer(McpServer {
                name: "s".into(),
                tools: (0..tools)
                    .map(|i| McpTool {
                        name: format!("t{i}"),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn known_fields_pass_at_every_depth() {
        let push = PushContextStateRequest {
            agent_run_id: "r".into(),
            version: 3,
            resources: vec![server(2), server(0)],
            ..Default::default()
        };
        check_known_fields::<PushContextStateRequest>(&push.encode_to_vec()).unwrap();
        check_known_fields::<StartupRequest>(&[]).unwrap();
    }

    #[test]
    fn an_unknown_top_level_field_is_named() {
        let bytes = with_unknown_varint(StartupRequest::default().encode_to_vec(), 99);
        let error = check_known_fields::<StartupRequest>(&bytes).unwrap_err();
        assert_eq!(
            error.to_string(),
            "unknown field 99 in ctxsync.v1.StartupRequest"
        );
    }

    #[test]
    fn an_unknown_nested_field_is_named_with_its_path() {
        // resources[2].mcp_server.tools[1] gets field 7.
        let tool = with_unknown_varint(
            McpTool {
                name: "x".into(),
                ..Default::default()
            }
            .encode_to_vec(),
            7,
        );
        let mut server_body = McpServer {
            name: "s".into(),
            tools: vec![McpTool::default()],
            ..Default::default()
        }
        .encode_to_vec();
        prost::encoding::bytes::encode(4, &tool, &mut server_body);
        let mut resource = ContextResource {
            source: "mcp_server:z".into(),
            ..Default::default()
        }
        .encode_to_vec();
        prost::encoding::bytes::encode(13, &server_body, &mut resource);
        let mut push = PushContextStateRequest {
            resources: vec![server(1), server(1)],
            ..Default::default()
        }
        .encode_to_vec();
        prost::encoding::bytes::encode(5, &resource, &mut push);
        // prost itself accepts it: the unknown field is skipped.
        let decoded = PushContextStateRequest::decode(push.as_slice()).unwrap();
        assert_eq!(decoded.resources.len(), 3);
        let error = check_known_fields::<PushContextStateRequest>(&push).unwrap_err();
        assert_eq!(
            error.to_string(),
            "unknown field 7 in ctxsync.v1.PushContextStateRequest.resources[2].mcp_server.tools[1]"
        );
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        for bytes in [&[0xff, 0xff][..], &[0x0a, 0x05, 0x01], &[0x0b], &[0x00]] {
            let error = check_known_fields::<PushContextStateRequest>(bytes).unwrap_err();
            assert!(matches!(error, WireError::Malformed { .. }), "{error}");
        }
    }
}
