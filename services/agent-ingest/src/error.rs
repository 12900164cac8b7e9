use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use ctxsync_proto::limits::MAX_REQUEST_BYTES;
use ctxsync_proto::validate::ValidationError;

/// Why a request was refused. Every variant answers a JSON error body.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthenticated(&'static str),
    #[error("unsupported content type {0:?}: send application/x-protobuf or application/json")]
    UnsupportedMediaType(String),
    #[error("{}", too_large_message(*.actual))]
    TooLarge { actual: Option<usize> },
    #[error("{0}")]
    Malformed(String),
    #[error(transparent)]
    Validation(ValidationError),
    #[error(
        "request is larger than the message bus accepts: the NATS server's max_payload \
         must be at least 8MB (request_bytes)"
    )]
    BusTooSmall,
    #[error("snapshot-store is unavailable: {0}")]
    StoreUnavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

fn too_large_message(actual: Option<usize>) -> String {
    match actual {
        Some(actual) => format!(
            "request body is {actual} bytes, over the limit of {MAX_REQUEST_BYTES} (request_bytes)"
        ),
        None => {
            format!("request body is over the limit of {MAX_REQUEST_BYTES} bytes (request_bytes)")
        }
    }
}

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            Self::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::TooLarge { .. } | Self::BusTooSmall => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Malformed(_) | Self::Validation(_) => StatusCode::BAD_REQUEST,
            Self::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            Self::Unauthenticated(_) => "unauthenticated",
            Self::UnsupportedMediaType(_) => "unsupported_media_type",
            Self::TooLarge { .. } | Self::BusTooSmall => "limit_exceeded",
            Self::Malformed(_) => "malformed",
            Self::Validation(ValidationError::Limit { .. }) => "limit_exceeded",
            Self::Validation(ValidationError::Invalid { .. }) => "invalid",
            Self::StoreUnavailable(_) => "unavailable",
            Self::Internal(_) => "internal",
        }
    }

    fn limit(&self) -> Option<&'static str> {
        match self {
            Self::TooLarge { .. } | Self::BusTooSmall => Some("request_bytes"),
            Self::Validation(v) => v.limit(),
            _ => None,
        }
    }

    pub(crate) fn log(&self, endpoint: &'static str) {
        match self {
            Self::StoreUnavailable(_) | Self::Internal(_) | Self::BusTooSmall => {
                tracing::warn!(endpoint, error = %self, "request failed")
            }
            _ => tracing::info!(endpoint, code = self.code(), error = %self, "request refused"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let error = ctxsync_proto::v1::HttpErrorReply {
            error: Some(ctxsync_proto::v1::HttpError {
                code: self.code().to_owned(),
                message: self.to_string(),
                limit: self.limit().unwrap_or_default().to_owned(),
            }),
        };
        let mut response = (self.status(), axum::Json(error)).into_response();
        if matches!(self, Self::StoreUnavailable(_)) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if matches!(self, Self::Unauthenticated(_)) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
