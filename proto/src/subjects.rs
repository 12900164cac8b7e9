//! NATS subject names. Every subject lives under a prefix (default `ctxsync`)
//! so several environments or tests can share one NATS server.

use std::fmt;

/// The default subject prefix.
pub const DEFAULT_PREFIX: &str = "ctxsync";

/// Queue group shared by the replicas of snapshot-store.
pub const STORE_QUEUE_GROUP: &str = "snapshot-store";
/// Queue group shared by the replicas of chat-gate.
pub const GATE_QUEUE_GROUP: &str = "chat-gate";
/// Queue group shared by the replicas of catalog.
pub const CATALOG_QUEUE_GROUP: &str = "catalog";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubjectError {
    #[error("subject prefix is empty")]
    Empty,
    #[error("subject prefix {prefix:?} has an empty token, a wildcard or whitespace")]
    Invalid { prefix: String },
}

/// The subject names under one prefix. A request/reply subject's call (its
/// request and reply types) is declared in [`crate::rpc`]: the store's are
/// asked and served only through those declarations (`tests/tidy`).
#[derive(Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl fmt::Debug for Subjects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Subjects({})", self.prefix)
    }
}

impl Default for Subjects {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

impl Subjects {
    /// Validates the prefix: dot-separated non-empty tokens without wildcards or whitespace.
    pub fn new(prefix: &str) -> Result<Self, SubjectError> {
        if prefix.is_empty() {
            return Err(SubjectError::Empty);
        }
        let valid = prefix.split('.').all(|token| {
            !token.is_empty()
                && !token
                    .chars()
                    .any(|c| c == '*' || c == '>' || c.is_whitespace())
        });
        if !valid {
            return Err(SubjectError::Invalid {
                prefix: prefix.to_owned(),
            });
        }
        Ok(Self {
            prefix: prefix.to_owned(),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn join(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }

    /// snapshot-store: register an agent (request/reply).
    pub fn store_register_agent(&self) -> String {
        self.join("store.agent.register")
    }
    /// snapshot-store: give a registered agent a new token (request/reply; operators only).
    pub fn store_rotate_agent_token(&self) -> String {
        self.join("store.agent.rotate_token")
    }
    /// snapshot-store: look an agent up by token hash (request/reply).
    pub fn store_authenticate_agent(&self) -> String {
        self.join("store.agent.authenticate")
    }
    /// snapshot-store: UpdateStartup (request/reply).
    pub fn store_update_startup(&self) -> String {
        self.join("store.agent.startup")
    }
    /// snapshot-store: PushContextState (request/reply).
    pub fn store_push(&self) -> String {
        self.join("store.agent.push")
    }
    /// snapshot-store: read an agent's row, snapshot and resources (request/reply).
    pub fn store_get_agent_state(&self) -> String {
        self.join("store.agent.get")
    }
    /// snapshot-store: one page of a tenant's agents with their states (request/reply; chat-gate's page).
    pub fn store_list_agents(&self) -> String {
        self.join("store.agent.list")
    }
    /// snapshot-store: issue a tenant key (request/reply; operators only).
    pub fn store_tenant_key_create(&self) -> String {
        self.join("store.tenant_key.create")
    }
    /// snapshot-store: list tenant keys (request/reply; operators only).
    pub fn store_tenant_key_list(&self) -> String {
        self.join("store.tenant_key.list")
    }
    /// snapshot-store: revoke a tenant key (request/reply; operators only).
    pub fn store_tenant_key_revoke(&self) -> String {
        self.join("store.tenant_key.revoke")
    }
    /// snapshot-store: which tenant a key digest belongs to (request/reply; chat-gate).
    pub fn store_tenant_key_verify(&self) -> String {
        self.join("store.tenant_key.verify")
    }
    /// A tenant key was revoked: gates drop it from their caches.
    pub fn tenant_key_revoked(&self) -> String {
        self.join("events.tenant_key.revoked")
    }
    /// Every snapshot-store request subject, for subscribing.
    pub fn store_all(&self) -> String {
        self.join("store.>")
    }

    /// The phase-or-run-id-changed event for one agent.
    pub fn discovery_changed(&self, agent_id: &str) -> String {
        self.join(&format!("events.discovery.{agent_id}"))
    }
    /// The phase-or-run-id-changed events of every agent.
    pub fn discovery_changed_all(&self) -> String {
        self.join("events.discovery.*")
    }
    /// The every-commit event for one agent.
    pub fn snapshot_committed(&self, agent_id: &str) -> String {
        self.join(&format!("events.snapshot.{agent_id}"))
    }
    /// The every-commit events of every agent.
    pub fn snapshot_committed_all(&self) -> String {
        self.join("events.snapshot.*")
    }

    /// chat-gate: may this turn run, and with which context (request/reply),
    /// for an agent of `tenant`. The tenant is part of the subject so that
    /// NATS permissions can confine a chat backend to its own.
    pub fn gate_turn(&self, tenant: &str) -> String {
        self.join(&format!("gate.turn.{tenant}"))
    }
    /// chat-gate: the turn subjects of every tenant, for subscribing.
    pub fn gate_turn_all(&self) -> String {
        self.join("gate.turn.*")
    }

    /// chat-gate: one event per first-turn decision (outcome and wait only).
    pub fn gate_turn_waited(&self) -> String {
        self.join("events.gate.waited")
    }

    /// The benchmark's raw floors (`pubsub`, `echo`): plain NATS traffic of
    /// the same shape as the services', under the same prefix.
    pub fn bench_floor(&self, name: &str) -> String {
        self.join(&format!("bench.floor.{name}"))
    }

    /// catalog: prepare a session of `tenant`'s catalog (request/reply).
    pub fn catalog_prepare(&self, tenant: &str) -> String {
        self.join(&format!("catalog.prepare.{tenant}"))
    }
    /// catalog: call a tool of a server pinned in a session of `tenant` (request/reply).
    pub fn catalog_call(&self, tenant: &str) -> String {
        self.join(&format!("catalog.call.{tenant}"))
    }
    /// catalog: end a session of `tenant` and stop its servers (request/reply).
    pub fn catalog_session_end(&self, tenant: &str) -> String {
        self.join(&format!("catalog.session.end.{tenant}"))
    }
    /// catalog: the state of `tenant`'s catalog servers and its latency
    /// aggregates (request/reply); counts and durations, never content.
    pub fn catalog_status(&self, tenant: &str) -> String {
        self.join(&format!("catalog.status.{tenant}"))
    }
    /// catalog: the status subjects of every tenant, for subscribing.
    pub fn catalog_status_all(&self) -> String {
        self.join("catalog.status.*")
    }
    /// catalog: the preparation subjects of every tenant, for subscribing.
    pub fn catalog_prepare_all(&self) -> String {
        self.join("catalog.prepare.*")
    }
    /// catalog: the call subjects of every tenant, for subscribing.
    pub fn catalog_call_all(&self) -> String {
        self.join("catalog.call.*")
    }
    /// catalog: the session-end subjects of every tenant, for subscribing.
    pub fn catalog_session_end_all(&self) -> String {
        self.join("catalog.session.end.*")
    }
    /// catalog: the tenant a request subject names (`<prefix>.catalog.<op>.<tenant>`
    /// of [`Subjects::catalog_prepare`], [`Subjects::catalog_call`],
    /// [`Subjects::catalog_session_end`] or [`Subjects::catalog_status`]);
    /// `None` for any other subject.
    pub fn catalog_tenant<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".catalog.")?;
        ["prepare.", "call.", "session.end.", "status."]
            .iter()
            .find_map(|op| rest.strip_prefix(op))
            .filter(|tenant| !tenant.is_empty() && !tenant.contains('.'))
    }
    /// catalog: events of one kind (e.g. `mcp.catalog.changed`).
    pub fn catalog_event(&self, kind: &str) -> String {
        self.join(&format!("events.catalog.{kind}"))
    }
    /// catalog: every catalog event.
    pub fn catalog_events_all(&self) -> String {
        self.join("events.catalog.>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_tenant_reads_the_request_subjects_it_builds() {
        let subjects = Subjects::new("a.b").unwrap();
        for subject in [
            subjects.catalog_prepare("acme"),
            subjects.catalog_call("acme"),
            subjects.catalog_session_end("acme"),
            subjects.catalog_status("acme"),
        ] {
            assert_eq!(subjects.catalog_tenant(&subject), Some("acme"), "{subject}");
        }
        for other in [
            subjects.gate_turn("acme"),
            subjects.catalog_event("mcp.tool.called"),
            Subjects::new("a").unwrap().catalog_call("acme"),
            "a.b.catalog.call.".to_owned(),
        ] {
            assert_eq!(subjects.catalog_tenant(&other), None, "{other}");
        }
    }

    #[test]
    fn prefix_is_validated() {
        assert_eq!(Subjects::new(""), Err(SubjectError::Empty));
        assert!(Subjects::new("a..b").is_err());
        assert!(Subjects::new("a.*").is_err());
        assert!(Subjects::new("a b").is_err());
        assert_eq!(
            Subjects::new("test.x1").unwrap().store_push(),
            "test.x1.store.agent.push"
        );
    }

    #[test]
    fn tenant_subjects_end_with_the_tenant() {
        let s = Subjects::default();
        assert_eq!(s.gate_turn("acme"), "ctxsync.gate.turn.acme");
        assert_eq!(s.gate_turn_all(), "ctxsync.gate.turn.*");
        assert_eq!(s.catalog_call("acme"), "ctxsync.catalog.call.acme");
        assert_eq!(
            s.catalog_session_end("acme"),
            "ctxsync.catalog.session.end.acme"
        );
        assert_eq!(s.catalog_session_end_all(), "ctxsync.catalog.session.end.*");
    }

    #[test]
    fn agent_subjects_nest_under_wildcards() {
        let s = Subjects::default();
        assert_eq!(s.discovery_changed("a1"), "ctxsync.events.discovery.a1");
        assert_eq!(s.discovery_changed_all(), "ctxsync.events.discovery.*");
    }
}
