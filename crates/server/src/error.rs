//! Errors as the APIs shape them: OpenAI's `{"error": {"message", "type", "code"}}` and
//! Anthropic's `{"type": "error", "error": {"type", "message"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chat::view::ErrorKind;
use serde_json::json;

/// A refused request: its status, OpenAI's error type and code, and a message that says what
/// to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's error type (`invalid_request_error`, `authentication_error`, …).
    pub kind: &'static str,
    /// A machine-readable code, where one applies (`context_length_exceeded`, …).
    pub code: Option<&'static str>,
    /// What went wrong, in words.
    pub message: String,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, code: None, message: message.into() }
    }

    fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// 400: the request is malformed or asks for something unsupported.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 401: no key, or the wrong one.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
            .with_code("invalid_api_key")
    }

    /// 404: no such route.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message).with_code("not_found")
    }

    /// 413: the body is over the limit.
    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
            .with_code("request_too_large")
    }

    /// 503: no room now (the queue timed out), or no model loaded.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            .with_code("overloaded")
    }

    /// The error a failed completion maps to.
    pub fn from_kind(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        let message = message.into();
        match kind {
            ErrorKind::PromptTooLong => {
                ApiError::invalid(message).with_code("context_length_exceeded")
            }
            ErrorKind::BadImage => ApiError::invalid(message).with_code("invalid_image"),
            ErrorKind::OutOfMemory => ApiError::invalid(message).with_code("insufficient_memory"),
            ErrorKind::Invalid | ErrorKind::NotFound => ApiError::invalid(message),
            ErrorKind::ModelMissing | ErrorKind::Busy | ErrorKind::ModelLoad => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .with_code("model_not_loaded")
            }
            ErrorKind::Cancelled => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            }
            _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message),
        }
    }

    /// The error of a refusal from [`chat::Chat`].
    pub fn from_chat(error: &chat::Error) -> ApiError {
        ApiError::from_kind(error.kind(), error.to_string())
    }

    /// OpenAI's body.
    pub fn openai_body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "code": self.code,
                           "param": null } })
    }

    /// Anthropic's type for this error.
    fn anthropic_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "api_error",
        }
    }

    /// Anthropic's body.
    pub fn anthropic_body(&self) -> serde_json::Value {
        json!({ "type": "error",
                "error": { "type": self.anthropic_type(), "message": self.message } })
    }

    /// The response in Anthropic's shape.
    pub fn anthropic(self) -> Response {
        (self.status, Json(self.anthropic_body())).into_response()
    }
}

/// The response in OpenAI's shape.
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.openai_body())).into_response()
    }
}

/// Reads a JSON body: 413 past the size limit, 400 for anything that is not the expected
/// JSON (the message names the field serde stopped at).
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!("the request body is too large: {rejection}"))
        } else {
            ApiError::invalid(format!("cannot read the request body: {rejection}"))
        }
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid: {e}")))
}
