//! One error type for the HTTP API, mapped to `{code, detail, field}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::domain::operation::FieldError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{detail}")]
    Unauthorized { detail: &'static str },
    #[error("{detail}")]
    NotFound { detail: String },
    #[error("{detail}")]
    BadRequest { code: &'static str, detail: String },
    #[error("{}", .0.detail)]
    Validation(FieldError),
    #[error("{detail}")]
    Conflict { code: &'static str, detail: String },
    #[error("{detail}")]
    PayloadTooLarge { detail: String },
    #[error("{detail}")]
    UnsupportedMediaType { detail: String },
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{detail}")]
    Upstream { code: &'static str, detail: String },
    #[error("too many requests at once; retry later")]
    Overloaded,
    #[error("the request did not arrive in time")]
    Timeout,
    #[error("the request headers are too large")]
    HeadersTooLarge,
}

impl ApiError {
    pub fn not_found(what: &str) -> Self {
        ApiError::NotFound { detail: format!("no {what} with that id") }
    }

    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> Self {
        ApiError::BadRequest { code, detail: detail.into() }
    }

    /// The stable `code` this error answers with.
    pub fn code(&self) -> &'static str {
        self.parts().1
    }

    fn parts(&self) -> (StatusCode, &'static str, String, Option<String>) {
        match self {
            ApiError::Unauthorized { detail } => {
                (StatusCode::UNAUTHORIZED, "unauthorized", detail.to_string(), None)
            }
            ApiError::NotFound { detail } => (StatusCode::NOT_FOUND, "not_found", detail.clone(), None),
            ApiError::BadRequest { code, detail } => (StatusCode::BAD_REQUEST, code, detail.clone(), None),
            ApiError::Validation(f) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                f.code,
                format!("{}: {}", if f.field.is_empty() { "body" } else { &f.field }, f.detail),
                (!f.field.is_empty()).then(|| f.field.clone()),
            ),
            ApiError::Conflict { code, detail } => (StatusCode::CONFLICT, code, detail.clone(), None),
            ApiError::PayloadTooLarge { detail } => {
                (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", detail.clone(), None)
            }
            ApiError::UnsupportedMediaType { detail } => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", detail.clone(), None)
            }
            // The store's own message may name files or hosts; keep it in the log.
            ApiError::Store(StoreError::Corrupt(_)) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "store_corrupt",
                "the store holds data this version cannot read".into(),
                None,
            ),
            ApiError::Store(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                "the store cannot be reached or written; retry later".into(),
                None,
            ),
            ApiError::Upstream { code, detail } => (StatusCode::BAD_GATEWAY, code, detail.clone(), None),
            ApiError::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, "overloaded", self.to_string(), None),
            ApiError::Timeout => (StatusCode::REQUEST_TIMEOUT, "request_timeout", self.to_string(), None),
            ApiError::HeadersTooLarge => {
                (StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "headers_too_large", self.to_string(), None)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code, detail, field) = self.parts();
        if status.is_server_error() {
            tracing::warn!(error = %self, code, "request failed");
        }
        let mut body = json!({ "code": code, "detail": detail });
        if let Some(f) = field {
            body["field"] = json!(f);
        }
        let mut resp = (status, Json(body)).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        resp
    }
}

impl From<crate::worker::CancelError> for ApiError {
    fn from(e: crate::worker::CancelError) -> Self {
        use crate::worker::CancelError as C;
        match e {
            C::NotFound => ApiError::not_found("operation"),
            C::NotCancellable(_) => ApiError::Conflict { code: "not_cancellable", detail: e.to_string() },
            C::AlreadyAnswered => ApiError::Conflict { code: "already_answered", detail: e.to_string() },
            C::Pushary(_) => ApiError::Upstream { code: "pushary_unavailable", detail: e.to_string() },
            C::Store(s) => ApiError::Store(s),
        }
    }
}

impl From<crate::worker::ResolveError> for ApiError {
    fn from(e: crate::worker::ResolveError) -> Self {
        use crate::worker::ResolveError as R;
        match e {
            R::NotFound => ApiError::not_found("operation"),
            R::NotUncertain(_) => ApiError::Conflict { code: "not_uncertain", detail: e.to_string() },
            R::BadOutcome => ApiError::Validation(crate::domain::operation::FieldError {
                field: "outcome".into(),
                code: "invalid_value",
                detail: e.to_string(),
            }),
            R::NoNote => ApiError::Validation(crate::domain::operation::FieldError {
                field: "note".into(),
                code: "missing_field",
                detail: e.to_string(),
            }),
            R::Store(s) => ApiError::Store(s),
        }
    }
}
