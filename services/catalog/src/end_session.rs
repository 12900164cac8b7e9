//! The `end_session` command: the session's transports are closed and its
//! servers stop. Its pins stay stored (a later call loads them again).

use std::sync::Arc;

use ctxsync_proto::v1::{CatalogEndSessionReply, CatalogEndSessionRequest};

use catalog_core::ErrorCode;

use crate::request::{error, valid_request_id};
use crate::sessions::Sessions;

/// The `end_session` command.
pub(crate) struct EndSession {
    sessions: Arc<Sessions>,
}

impl EndSession {
    pub fn new(sessions: Arc<Sessions>) -> Self {
        Self { sessions }
    }

    pub async fn handle(&self, request: CatalogEndSessionRequest) -> CatalogEndSessionReply {
        if let Err(message) = valid_request_id("tenant", &request.tenant)
            .and_then(|()| valid_request_id("session_id", &request.session_id))
        {
            return CatalogEndSessionReply {
                error: error(ErrorCode::RequestInvalid, message),
                ..Default::default()
            };
        }
        let released = self
            .sessions
            .end(&request.tenant, &request.session_id)
            .await;
        tracing::debug!(tenant = %request.tenant, released, "session ended");
        CatalogEndSessionReply {
            released,
            error: None,
        }
    }
}
