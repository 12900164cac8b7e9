//! Every request/reply call over NATS, declared once: a zero-sized marker
//! per call names its subject, its request and its reply together, and the
//! reply carries either its answer or the one error envelope,
//! [`ServiceError`]. Servers and clients both take the marker
//! (`ctxsync_runtime::rpc::serve_rpc`, `ctxsync_runtime::rpc::call`), so a
//! subject is never served or asked with other types than its own.
//!
//! Transport-free: this crate names subjects and messages; the runtime
//! moves them over NATS.

use prost::Message;

use crate::subjects::Subjects;
use crate::v1::{ServiceError, service_error::Code};

/// One request/reply call of a service.
pub trait Rpc: Send + Sync + 'static {
    type Request: Message + Default + Send + 'static;
    type Reply: Reply + Send + 'static;
    /// The subject this call's servers subscribe to (for a call of
    /// [`TenantSubject`], with a wildcard as its last token).
    fn served(subjects: &Subjects) -> String;
}

/// A call every caller sends on the same subject.
pub trait FixedSubject: Rpc {
    fn subject(subjects: &Subjects) -> String {
        Self::served(subjects)
    }
}

/// A call whose subject's last token is the caller's tenant, which NATS
/// permissions confine to the caller's own.
pub trait TenantSubject: Rpc {
    fn subject(subjects: &Subjects, tenant: &str) -> String;
}

/// A reply that carries its answer or, instead of it, a [`ServiceError`]
/// (its field `error`).
pub trait Reply: Message + Default {
    /// The error the service answered, if it answered one.
    fn error(&self) -> Option<&ServiceError>;
    /// Takes the error out: what remains is the answer.
    fn take_error(&mut self) -> Option<ServiceError>;
    /// The reply carrying `error` instead of an answer.
    fn failed(error: ServiceError) -> Self;
}

/// A reply is the envelope's when it has `error: Option<ServiceError>`.
macro_rules! replies {
    ($($reply:ty),* $(,)?) => {$(
        impl $crate::rpc::Reply for $reply {
            fn error(&self) -> Option<&$crate::v1::ServiceError> {
                self.error.as_ref()
            }
            fn take_error(&mut self) -> Option<$crate::v1::ServiceError> {
                self.error.take()
            }
            fn failed(error: $crate::v1::ServiceError) -> Self {
                Self { error: Some(error), ..Default::default() }
            }
        }
    )*};
}

/// Declares calls on fixed subjects: `Marker(Request) -> Reply, Subjects::method;`.
macro_rules! fixed_calls {
    ($service:ident: $($(#[$doc:meta])* $name:ident($request:ty) -> $reply:ty, $subject:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $name;
        impl $crate::rpc::Rpc for $name {
            type Request = $request;
            type Reply = $reply;
            fn served(subjects: &$crate::subjects::Subjects) -> String {
                subjects.$subject()
            }
        }
        impl $crate::rpc::FixedSubject for $name {}
        impl $service for $name {}
    )*};
}

/// snapshot-store's calls (`<prefix>.store.…`, queue group
/// [`crate::subjects::STORE_QUEUE_GROUP`]).
pub mod store {
    use crate::v1::*;

    /// A call snapshot-store serves (what `StoreClient` may ask).
    pub trait StoreRpc: crate::rpc::FixedSubject {}

    fixed_calls! {
        StoreRpc:
        /// Registers an agent by its token's SHA-256 (operators).
        RegisterAgent(RegisterAgentRequest) -> RegisterAgentReply, store_register_agent;
        /// Gives a registered agent a new token (operators).
        RotateAgentToken(RotateAgentTokenRequest) -> RotateAgentTokenReply, store_rotate_agent_token;
        /// Which agent a token's SHA-256 belongs to (agent-ingest).
        AuthenticateAgent(AuthenticateAgentRequest) -> AuthenticateAgentReply, store_authenticate_agent;
        /// An agent process's Startup.
        UpdateStartup(UpdateStartupRequest) -> UpdateStartupReply, store_update_startup;
        /// An agent's report (PushContextState).
        PushContextState(StorePushRequest) -> StorePushReply, store_push;
        /// An agent's row, snapshot and resources, read in one transaction.
        GetAgentState(GetAgentStateRequest) -> GetAgentStateReply, store_get_agent_state;
        /// One page of a tenant's agents with their states.
        ListAgents(ListAgentsRequest) -> ListAgentsReply, store_list_agents;
        /// Records a new tenant key by its SHA-256 (operators).
        CreateTenantKey(CreateTenantKeyRequest) -> CreateTenantKeyReply, store_tenant_key_create;
        /// Lists tenant keys (operators).
        ListTenantKeys(ListTenantKeysRequest) -> ListTenantKeysReply, store_tenant_key_list;
        /// Revokes a tenant key (operators); announced on `events.tenant_key.revoked`.
        RevokeTenantKey(RevokeTenantKeyRequest) -> RevokeTenantKeyReply, store_tenant_key_revoke;
        /// Which tenant a key's SHA-256 belongs to (the tenant-key verifier).
        VerifyTenantKey(VerifyTenantKeyRequest) -> VerifyTenantKeyReply, store_tenant_key_verify;
    }

    replies!(
        RegisterAgentReply,
        RotateAgentTokenReply,
        AuthenticateAgentReply,
        UpdateStartupReply,
        StorePushReply,
        GetAgentStateReply,
        ListAgentsReply,
        CreateTenantKeyReply,
        ListTenantKeysReply,
        RevokeTenantKeyReply,
        VerifyTenantKeyReply,
    );
}

/// Declares calls on per-tenant subjects:
/// `Marker(Request) -> Reply, Subjects::served_method, Subjects::tenant_method;`.
macro_rules! tenant_calls {
    ($($(#[$doc:meta])* $name:ident($request:ty) -> $reply:ty, $served:ident, $subject:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $name;
        impl $crate::rpc::Rpc for $name {
            type Request = $request;
            type Reply = $reply;
            fn served(subjects: &$crate::subjects::Subjects) -> String {
                subjects.$served()
            }
        }
        impl $crate::rpc::TenantSubject for $name {
            fn subject(subjects: &$crate::subjects::Subjects, tenant: &str) -> String {
                subjects.$subject(tenant)
            }
        }
    )*};
}

/// chat-gate's calls (queue group [`crate::subjects::GATE_QUEUE_GROUP`]).
pub mod gate {
    use crate::v1::{TurnReply, TurnRequest};

    tenant_calls! {
        /// May this turn run, and with which context (`<prefix>.gate.turn.<tenant>`).
        Turn(TurnRequest) -> TurnReply, gate_turn_all, gate_turn;
    }

    replies!(TurnReply);
}

/// The catalog's calls (`<prefix>.catalog.<op>.<tenant>`, queue group
/// [`crate::subjects::CATALOG_QUEUE_GROUP`]); an error's `reason` is the
/// catalog's dotted name of the failure (`tool.withdrawn`, …).
pub mod catalog {
    use crate::v1::*;

    tenant_calls! {
        /// Pins the tenant's servers for a session (a chat).
        Prepare(CatalogPrepareRequest) -> CatalogPrepareReply, catalog_prepare_all, catalog_prepare;
        /// Calls a pinned tool, gets a prompt or reads a resource.
        Call(CatalogCallRequest) -> CatalogCallReply, catalog_call_all, catalog_call;
        /// Ends a session: its pins are forgotten, its processes released.
        EndSession(CatalogEndSessionRequest) -> CatalogEndSessionReply, catalog_session_end_all, catalog_session_end;
        /// The tenant's servers and latency aggregates (the context page).
        Status(CatalogStatusRequest) -> CatalogStatusReply, catalog_status_all, catalog_status;
    }

    replies!(
        CatalogPrepareReply,
        CatalogCallReply,
        CatalogEndSessionReply,
        CatalogStatusReply,
    );
}

impl ServiceError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code: code as i32,
            message: message.into(),
            reason: String::new(),
        }
    }

    /// A request that cannot be decoded or breaks a rule.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// With the service's finer name of the failure (see [`ServiceError::reason`]).
    pub fn with_reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = reason.into();
        self
    }
}

impl Code {
    /// The code's short name in logs and messages: `not_found`, `internal`, …
    pub fn name(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::InvalidArgument => "invalid_argument",
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::Internal => "internal",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Unavailable => "unavailable",
            Self::FailedPrecondition => "failed_precondition",
            Self::ResourceExhausted => "resource_exhausted",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::store::*;
    use super::*;
    use crate::v1::*;

    #[test]
    fn each_call_names_its_own_subject() {
        let s = Subjects::new("p").unwrap();
        assert_eq!(PushContextState::subject(&s), "p.store.agent.push");
        assert_eq!(GetAgentState::subject(&s), "p.store.agent.get");
        assert_eq!(VerifyTenantKey::subject(&s), "p.store.tenant_key.verify");
        assert_eq!(
            <gate::Turn as TenantSubject>::subject(&s, "acme"),
            "p.gate.turn.acme"
        );
        assert_eq!(gate::Turn::served(&s), "p.gate.turn.*");
        let all = [
            RegisterAgent::subject(&s),
            RotateAgentToken::subject(&s),
            AuthenticateAgent::subject(&s),
            UpdateStartup::subject(&s),
            PushContextState::subject(&s),
            GetAgentState::subject(&s),
            ListAgents::subject(&s),
            CreateTenantKey::subject(&s),
            ListTenantKeys::subject(&s),
            RevokeTenantKey::subject(&s),
            VerifyTenantKey::subject(&s),
        ];
        let distinct: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len(), "{all:?}");
        assert!(all.iter().all(|subject| subject.starts_with("p.store.")));
    }

    #[test]
    fn a_failed_reply_carries_only_the_envelope() {
        let error = ServiceError::new(Code::NotFound, "agent x not found");
        let mut reply = GetAgentStateReply::failed(error.clone());
        assert_eq!(reply.state, None);
        assert_eq!(reply.error(), Some(&error));
        let decoded = GetAgentStateReply::decode(reply.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded.error, Some(error.clone()));
        assert_eq!(reply.take_error(), Some(error));
        assert_eq!(reply, GetAgentStateReply::default());
    }

    /// The envelope keeps the field and code numbers of the store's and the
    /// gate's former errors: a peer of the release before reads the same
    /// codes, and an unknown code reads as unspecified.
    #[test]
    fn the_envelope_reads_the_former_errors_codes() {
        // StoreError { code: ALREADY_EXISTS (3), message: "x" } as an older store sent it.
        let former = [0x08, 0x03, 0x12, 0x01, b'x'];
        let error = ServiceError::decode(former.as_slice()).unwrap();
        assert_eq!(error.code(), Code::AlreadyExists);
        assert_eq!(error.message, "x");
        assert_eq!(error.reason, "");
        for (number, code) in [
            (1, Code::InvalidArgument),
            (2, Code::NotFound),
            (3, Code::AlreadyExists),
            (4, Code::Internal),
            (5, Code::DeadlineExceeded),
        ] {
            assert_eq!(code as i32, number, "{code:?}");
        }
        // GateError's codes on NATS were INVALID_ARGUMENT (1) and NOT_FOUND (2).
        let turn = TurnReply::failed(ServiceError::new(Code::NotFound, "no agent"));
        assert_eq!(turn.error.as_ref().unwrap().code, 2);
        let newer = [0x08, 0x7f];
        assert_eq!(
            ServiceError::decode(newer.as_slice()).unwrap().code(),
            Code::Unspecified
        );
    }

    #[test]
    fn code_names_are_the_enum_names_in_lower_case() {
        for number in 0..=8 {
            let code = Code::try_from(number).unwrap();
            let expected = code
                .as_str_name()
                .strip_prefix("CODE_")
                .unwrap()
                .to_lowercase();
            assert_eq!(code.name(), expected);
        }
        let error = ServiceError::invalid_argument("bad").with_reason("request.invalid");
        assert_eq!(
            (error.code(), error.reason.as_str()),
            (Code::InvalidArgument, "request.invalid")
        );
    }
}
