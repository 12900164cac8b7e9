//! What every request handler shares: the tenant a request comes from, and
//! an answer's error (its code typed: `catalog_core::ErrorCode`; ids are
//! validated by the core).

use ctxsync_proto::subjects::Subjects;
use ctxsync_proto::v1::ServiceError;

use catalog_core::ErrorCode;
pub use catalog_core::request::{MAX_REQUEST_ID_BYTES, valid_request_id};

/// A request's tenant is its subject's (`<prefix>.catalog.<op>.<tenant>`),
/// which NATS permissions confine to the caller's own. A tenant named in the
/// body must be that one; an empty one becomes it.
pub(crate) fn tenant_of(
    body_tenant: &mut String,
    subjects: &Subjects,
    incoming: &ctxsync_runtime::rpc::Incoming,
) -> Result<(), String> {
    let subject_tenant = subjects
        .catalog_tenant(&incoming.subject)
        .ok_or_else(|| format!("subject {:?} names no tenant", incoming.subject.as_str()))?;
    if body_tenant.is_empty() {
        subject_tenant.clone_into(body_tenant);
        return Ok(());
    }
    if body_tenant != subject_tenant {
        return Err(format!(
            "tenant {:?} in the request differs from the subject's tenant {subject_tenant:?}",
            body_tenant.chars().take(80).collect::<String>()
        ));
    }
    Ok(())
}

/// The error of an answer.
pub(crate) fn error(code: ErrorCode, message: impl Into<String>) -> Option<ServiceError> {
    Some(catalog_core::request::Refusal::new(code, message).to_proto())
}
