//! Fields from the future: what an encoded message carries that this
//! contract does not define.
//!
//! prost skips a field number it does not know, so a message from a newer
//! peer decodes here (protobuf's forward compatibility) and the new fields
//! are dropped. [`for_each_unknown_field`] names them, so that a service can
//! count them and say where they were: it decodes the bytes a second time,
//! with `prost-reflect` and the descriptors of [`crate::v1::FILE_DESCRIPTOR_SET`],
//! and walks each message's unknown fields, nested messages included.
//!
//! The second decode only runs when the message prost decoded re-encodes
//! shorter than the bytes it came from, which is never the case for a
//! canonically encoded message without unknown fields (that check costs
//! well under a tenth of the decode). When it runs it costs several decodes
//! (measured here: a 40 KB push 17 µs by prost, 126 µs by reflection; 2 MB,
//! 2.3 ms and 24 ms): a price paid only for the bytes of a newer peer.

use std::fmt::Write as _;
use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DynamicMessage, MapKey, ReflectMessage as _, Value};

/// Where one unknown field was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownField<'a> {
    /// The field's number.
    pub number: u32,
    /// The full name of the message type that does not define it
    /// (`ctxsync.v1.ContextResource`): a bounded label.
    pub message: &'a str,
    /// The message it is in, from the root
    /// (`ctxsync.v1.PushContextStateRequest.resources[2]`).
    pub path: &'a str,
}

/// Why the unknown fields could not be listed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnknownFieldsError {
    /// The type is not in the descriptor set (a programming error).
    #[error("message type {0} is not in the ctxsync descriptor set")]
    UnknownType(String),
    /// The reflection decode refused bytes prost accepted.
    #[error("cannot decode {message} by reflection: {reason}")]
    Decode { message: String, reason: String },
}

fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(crate::v1::FILE_DESCRIPTOR_SET)
            .expect("the embedded descriptor set is a valid pool")
    })
}

/// Calls `visit` for every field of `encoded` (the bytes `decoded` was
/// decoded from) that `M`'s descriptors do not define, at any depth (a
/// message's own before those of the messages it holds); returns how many
/// there were.
///
/// Cheap when there are none: unknown fields make the bytes longer than
/// `decoded` re-encodes to, since prost drops them and writes every known
/// value at least as short as any encoder can (the contract has no packed
/// fields). Only then are the bytes decoded again, by reflection, which
/// costs about one more decode. A body that writes some value shorter than
/// prost does (a negative `int32` in 5 bytes rather than 10) can hide an
/// unknown field from this count; the field is dropped all the same.
pub fn for_each_unknown_field<M: prost::Message + prost::Name>(
    decoded: &M,
    encoded: &[u8],
    mut visit: impl FnMut(UnknownField<'_>),
) -> Result<usize, UnknownFieldsError> {
    if decoded.encoded_len() >= encoded.len() {
        return Ok(0);
    }
    let full_name = M::full_name();
    let descriptor = pool()
        .get_message_by_name(&full_name)
        .ok_or_else(|| UnknownFieldsError::UnknownType(full_name.clone()))?;
    let message =
        DynamicMessage::decode(descriptor, encoded).map_err(|e| UnknownFieldsError::Decode {
            message: full_name.clone(),
            reason: e.to_string(),
        })?;
    let mut path = full_name;
    let mut count = 0;
    walk(&message, &mut path, &mut |field| {
        count += 1;
        visit(field);
    });
    Ok(count)
}

/// `message`'s unknown fields, then those of the messages it holds; `path`
/// names `message` and is given back as it came.
fn walk(message: &DynamicMessage, path: &mut String, visit: &mut dyn FnMut(UnknownField<'_>)) {
    let descriptor = message.descriptor();
    for field in message.unknown_fields() {
        visit(UnknownField {
            number: field.number(),
            message: descriptor.full_name(),
            path,
        });
    }
    for (field, value) in message.fields() {
        let outer = path.len();
        path.push('.');
        path.push_str(field.name());
        match value {
            Value::Message(child) => walk(child, path, visit),
            Value::List(items) => {
                for (index, item) in items.iter().enumerate() {
                    if let Value::Message(child) = item {
                        let at = path.len();
                        let _ = write!(path, "[{index}]");
                        walk(child, path, visit);
                        path.truncate(at);
                    }
                }
            }
            Value::Map(entries) => {
                for (key, item) in entries {
                    if let Value::Message(child) = item {
                        let at = path.len();
                        push_key(path, key);
                        walk(child, path, visit);
                        path.truncate(at);
                    }
                }
            }
            _ => {}
        }
        path.truncate(outer);
    }
}

fn push_key(path: &mut String, key: &MapKey) {
    let _ = match key {
        MapKey::Bool(v) => write!(path, "[{v}]"),
        MapKey::I32(v) => write!(path, "[{v}]"),
        MapKey::I64(v) => write!(path, "[{v}]"),
        MapKey::U32(v) => write!(path, "[{v}]"),
        MapKey::U64(v) => write!(path, "[{v}]"),
        MapKey::String(v) => write!(path, "[{v:?}]"),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{
        ContextResource, McpServer, McpTool, PushContextStateRequest, StartupRequest,
        context_resource::Body,
    };
    use prost::Message;
    use prost::encoding::{WireType, encode_key, encode_varint};

    /// `field` as an unknown varint field appended to `bytes`.
    fn with_unknown_varint(mut bytes: Vec<u8>, field: u32) -> Vec<u8> {
        encode_key(field, WireType::Varint, &mut bytes);
        encode_varint(1, &mut bytes);
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

    /// Decodes `bytes` as prost does, then lists what it skipped.
    fn unknown<M: Message + Default + prost::Name>(bytes: &[u8]) -> Vec<(u32, String, String)> {
        let decoded = M::decode(bytes).expect("prost decodes it");
        let mut found = Vec::new();
        let count = for_each_unknown_field(&decoded, bytes, |field| {
            found.push((
                field.number,
                field.message.to_owned(),
                field.path.to_owned(),
            ));
        })
        .unwrap();
        assert_eq!(count, found.len());
        found
    }

    #[test]
    fn the_contract_has_no_packed_field_the_cheap_check_could_miss() {
        // One element written unpacked is a byte shorter than prost's packed
        // encoding: it could hide an unknown field from the length check.
        let contract: Vec<_> = pool()
            .all_messages()
            .filter(|m| m.package_name() == "ctxsync.v1")
            .collect();
        assert!(contract.len() > 50, "{} messages", contract.len());
        let packed: Vec<String> = contract
            .iter()
            .flat_map(|m| m.fields().collect::<Vec<_>>())
            .filter(|f| {
                f.is_list()
                    && !matches!(
                        f.kind(),
                        prost_reflect::Kind::Message(_)
                            | prost_reflect::Kind::String
                            | prost_reflect::Kind::Bytes
                    )
            })
            .map(|f| f.full_name().to_owned())
            .collect();
        assert!(
            packed.is_empty(),
            "repeated scalar fields {packed:?}: for_each_unknown_field's length check needs a second look"
        );
    }

    #[test]
    fn known_fields_at_every_depth_are_not_reported() {
        let push = PushContextStateRequest {
            agent_run_id: "r".into(),
            version: 3,
            resources: vec![server(2), server(0)],
            ..Default::default()
        };
        assert_eq!(
            unknown::<PushContextStateRequest>(&push.encode_to_vec()),
            []
        );
        assert_eq!(unknown::<StartupRequest>(&[]), []);
    }

    #[test]
    fn a_non_canonical_body_without_unknown_fields_reports_none() {
        // `version` 0 written out (prost leaves a default out): the body is
        // longer than the re-encoding, the reflection decode runs, and finds nothing.
        let mut bytes = PushContextStateRequest::default().encode_to_vec();
        encode_key(2, WireType::Varint, &mut bytes);
        encode_varint(0, &mut bytes);
        assert_eq!(unknown::<PushContextStateRequest>(&bytes), []);
    }

    #[test]
    fn an_unknown_top_level_field_is_named() {
        let bytes = with_unknown_varint(StartupRequest::default().encode_to_vec(), 99);
        assert_eq!(
            unknown::<StartupRequest>(&bytes),
            [(
                99,
                "ctxsync.v1.StartupRequest".to_owned(),
                "ctxsync.v1.StartupRequest".to_owned()
            )]
        );
    }

    #[test]
    fn unknown_nested_fields_are_named_with_their_path_in_order() {
        // resources[2].mcp_server.tools[1] gets field 7 and resources[2]
        // field 99 (length-delimited); the request itself field 536870911.
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
        prost::encoding::bytes::encode(99, &b"future".to_vec(), &mut resource);
        let mut push = PushContextStateRequest {
            resources: vec![server(1), server(1)],
            ..Default::default()
        }
        .encode_to_vec();
        prost::encoding::bytes::encode(5, &resource, &mut push);
        let push = with_unknown_varint(push, 536_870_911);
        // prost accepts it: the unknown fields are skipped.
        let decoded = PushContextStateRequest::decode(push.as_slice()).unwrap();
        assert_eq!(decoded.resources.len(), 3);
        assert_eq!(
            unknown::<PushContextStateRequest>(&push),
            [
                (
                    536_870_911,
                    "ctxsync.v1.PushContextStateRequest".to_owned(),
                    "ctxsync.v1.PushContextStateRequest".to_owned()
                ),
                (
                    99,
                    "ctxsync.v1.ContextResource".to_owned(),
                    "ctxsync.v1.PushContextStateRequest.resources[2]".to_owned()
                ),
                (
                    7,
                    "ctxsync.v1.McpTool".to_owned(),
                    "ctxsync.v1.PushContextStateRequest.resources[2].mcp_server.tools[1]"
                        .to_owned()
                ),
            ]
        );
    }
}
