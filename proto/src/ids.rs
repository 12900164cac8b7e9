//! The identifiers operators and callers choose — tenant, workspace, agent
//! name, catalog server id — and the one rule each follows wherever it is
//! accepted (CLI, store, catalog config, gate, keys).
//!
//! A tenant is also a NATS subject token (`<prefix>.gate.turn.<tenant>`), so
//! it has no dot; the others may.

/// The longest tenant id, in bytes.
pub const MAX_TENANT_BYTES: usize = 64;
/// The longest workspace, agent name or server id, in bytes.
pub const MAX_NAME_BYTES: usize = 128;

/// Why an identifier was refused; the message says the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value:?} {rule}")]
pub struct IdError {
    pub what: &'static str,
    pub value: String,
    pub rule: &'static str,
}

const TENANT_RULE: &str = "must be 1 to 64 characters of letters, digits, '-' or '_'";
const NAME_RULE: &str = "must be 1 to 128 characters of letters, digits, '-', '_' or '.', starting with a letter or digit";

fn refuse(what: &'static str, value: &str, rule: &'static str) -> IdError {
    // Bounded, so a hostile value does not become a huge error.
    let value: String = value.chars().take(80).collect();
    IdError { what, value, rule }
}

/// Tenant ids whose chat users' inboxes (`_INBOX.chat-<tenant>`, as the
/// deployment names them) would be chat-gate's own (`chat-gate`,
/// `chat-gate-rpc`): a tenant so named could aim answers at the gate.
pub const RESERVED_TENANTS: &[&str] = &["gate", "gate-rpc"];

const RESERVED_RULE: &str =
    "is reserved: its chat user's inbox (_INBOX.chat-<tenant>) would be chat-gate's own";

/// A tenant id: `[A-Za-z0-9_-]{1,64}`, not one of [`RESERVED_TENANTS`].
pub fn tenant(value: &str) -> Result<(), IdError> {
    if RESERVED_TENANTS
        .iter()
        .any(|reserved| value.eq_ignore_ascii_case(reserved))
    {
        return Err(refuse("tenant", value, RESERVED_RULE));
    }
    let ok = !value.is_empty()
        && value.len() <= MAX_TENANT_BYTES
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(refuse("tenant", value, TENANT_RULE))
    }
}

/// A workspace, agent name or server id (`what` says which):
/// `[A-Za-z0-9][A-Za-z0-9._-]{0,127}`.
pub fn name(what: &'static str, value: &str) -> Result<(), IdError> {
    let ok = value.len() <= MAX_NAME_BYTES
        && value
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(refuse(what, value, NAME_RULE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_are_one_subject_token() {
        for ok in ["acme", "a", "ACME_2-prod", &"t".repeat(64)] {
            assert_eq!(tenant(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "acme.corp",
            "bad tenant",
            "a*",
            "a>",
            "é",
            &"t".repeat(65),
            "a\0",
        ] {
            let error = tenant(bad).unwrap_err();
            assert!(error.to_string().contains("letters, digits"), "{error}");
        }
        for reserved in ["gate", "gate-rpc", "GATE"] {
            let error = tenant(reserved).unwrap_err();
            assert!(error.to_string().contains("is reserved"), "{error}");
        }
    }

    #[test]
    fn names_allow_dots_but_start_with_a_letter_or_digit() {
        for ok in ["ws1", "agent-1.prod", "a_b", &"n".repeat(128)] {
            assert_eq!(name("workspace", ok), Ok(()), "{ok}");
        }
        for bad in ["", ".hidden", "-x", "two words", "a/b", &"n".repeat(129)] {
            let error = name("agent name", bad).unwrap_err();
            assert!(error.to_string().starts_with("agent name"), "{error}");
        }
    }

    #[test]
    fn a_long_hostile_value_is_cut_in_the_error() {
        let error = tenant(&"x".repeat(10_000)).unwrap_err();
        assert!(error.to_string().len() < 300);
    }
}
