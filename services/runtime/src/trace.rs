//! W3C trace context (`traceparent`) carried in HTTP and NATS headers, so one
//! push and the chat answer it released share a trace id in every service's
//! logs.

use std::fmt;

use rand::RngCore;

/// The header name, in HTTP and in NATS message headers.
pub const TRACEPARENT: &str = "traceparent";

/// One hop of a trace: the trace id shared end to end, and this hop's span id.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    sampled: bool,
}

impl fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for TraceContext {
    /// The `traceparent` header value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            u8::from(self.sampled)
        )
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = u8::from_str_radix(text.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TraceContext {
    /// A new trace.
    pub fn new_root() -> Self {
        let mut rng = rand::rng();
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        rng.fill_bytes(&mut trace_id);
        rng.fill_bytes(&mut span_id);
        Self {
            trace_id,
            span_id,
            sampled: true,
        }
    }

    /// Parses a `traceparent` value; `None` for anything malformed (a bad
    /// header starts a new trace rather than failing the request).
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let version = parts.next()?;
        let trace_id: [u8; 16] = parse_hex(parts.next()?)?;
        let span_id: [u8; 8] = parse_hex(parts.next()?)?;
        let flags: [u8; 1] = parse_hex(parts.next()?)?;
        if version != "00" || parts.next().is_some() || trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    /// The next hop of the same trace.
    pub fn child(&self) -> Self {
        let mut span_id = [0u8; 8];
        rand::rng().fill_bytes(&mut span_id);
        Self { span_id, ..*self }
    }

    pub fn trace_id(&self) -> String {
        hex(&self.trace_id)
    }

    /// The context of a NATS message, if it carries one.
    pub fn from_nats(headers: Option<&async_nats::HeaderMap>) -> Option<Self> {
        headers
            .and_then(|h| h.get(TRACEPARENT))
            .and_then(|v| Self::parse(v.as_str()))
    }

    /// NATS headers carrying this context.
    pub fn to_nats(&self) -> async_nats::HeaderMap {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(TRACEPARENT, self.to_string().as_str());
        headers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed_values() {
        let root = TraceContext::new_root();
        let parsed = TraceContext::parse(&root.to_string()).unwrap();
        assert_eq!(parsed, root);
        let child = root.child();
        assert_eq!(child.trace_id(), root.trace_id());
        assert_ne!(child.to_string(), root.to_string());
        for bad in [
            "",
            "00-xyz-0000000000000001-01",
            "00-00000000000000000000000000000000-0000000000000001-01",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
        assert_eq!(
            TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
                .unwrap()
                .trace_id(),
            "0af7651916cd43dd8448eb211c80319c"
        );
    }

    #[test]
    fn nats_headers_carry_the_context() {
        let root = TraceContext::new_root();
        let headers = root.to_nats();
        assert_eq!(TraceContext::from_nats(Some(&headers)), Some(root));
        assert_eq!(TraceContext::from_nats(None), None);
    }
}
