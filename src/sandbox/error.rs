//! Error responses in Pushary's shape: a non-2xx status with a JSON body
//! carrying `error` (what the SDK shows) and `message`, plus extra fields
//! such as `refusal` where the protocol defines them.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::Refusal;

#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub error: String,
    pub message: String,
    pub extra: Map<String, Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, error: impl Into<String>, message: impl Into<String>) -> Self {
        Self { status, error: error.into(), message: message.into(), extra: Map::new() }
    }

    /// A request that breaks a documented bound. The `error` names the problem
    /// precisely, because it is what the SDK surfaces as the exception text.
    pub fn invalid(error: impl Into<String>) -> Self {
        let error = error.into();
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, error.clone(), error)
    }

    pub fn bad_request(error: impl Into<String>) -> Self {
        let error = error.into();
        Self::new(StatusCode::BAD_REQUEST, error.clone(), error)
    }

    pub fn not_found(what: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("{what} not found"), format!("No {what} with that id."))
    }

    pub fn conflict(error: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, error, message)
    }

    pub fn refusal(refusal: Refusal, message: impl Into<String>) -> Self {
        let status = match refusal {
            Refusal::NotAuthorized | Refusal::ActionMismatch => StatusCode::FORBIDDEN,
            Refusal::Expired | Refusal::AlreadyConsumed => StatusCode::CONFLICT,
        };
        Self::new(status, message, refusal_message(refusal)).with("refusal", refusal.as_str())
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    /// The text a person should read (the page, the handle's `Err`).
    pub fn message(&self) -> String {
        self.error.clone()
    }
}

fn refusal_message(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::NotAuthorized => "There is no approved authorization with that id.",
        Refusal::ActionMismatch => "The re-stated action differs from the one that was approved.",
        Refusal::Expired => "The authorization was not spent in time.",
        Refusal::AlreadyConsumed => "The authorization was already spent.",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = Map::new();
        body.insert("error".into(), Value::String(self.error));
        body.insert("message".into(), Value::String(self.message));
        body.extend(self.extra);
        (self.status, Json(Value::Object(body))).into_response()
    }
}

/// A request body read under the size cap and parsed as JSON, with failures
/// reported in Pushary's error shape instead of axum's plain text. An empty
/// body is `Value::Null`, so body-less POSTs (rotate the secret) still parse.
pub(crate) struct JsonBody(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            ApiError::new(rejection.status(), rejection.body_text(), rejection.body_text())
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(Value::Null));
        }
        serde_json::from_slice(&bytes)
            .map(Self)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
    }
}

/// The body as an object, or a 400 naming what was expected.
pub(crate) fn object(body: Value) -> Result<Map<String, Value>, ApiError> {
    match body {
        Value::Object(map) => Ok(map),
        Value::Null => Ok(Map::new()),
        _ => Err(ApiError::bad_request("the request body must be a JSON object")),
    }
}

pub(crate) fn unauthorized(error: &str) -> Response {
    (StatusCode::UNAUTHORIZED, Json(json!({"error": error, "message": error}))).into_response()
}
