//! A Pushary decision callback, read from bytes whose signature has already
//! been verified. Pure, so the fuzzer can drive it.

use serde_json::Value;

use super::json::{JsonError, parse_strict};

pub const MAX_CORRELATION_ID: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callback {
    pub correlation_id: String,
    pub answer: String,
    pub answered_at: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallbackError {
    Json(JsonError),
    NotADecisionCallback,
    BadCorrelationId,
    Nul,
}

impl CallbackError {
    pub fn code(&self) -> &'static str {
        match self {
            CallbackError::Json(e) => e.code(),
            CallbackError::NotADecisionCallback => "not_a_decision_callback",
            CallbackError::BadCorrelationId => "invalid_correlation_id",
            CallbackError::Nul => "invalid_value",
        }
    }

    pub fn detail(&self) -> String {
        match self {
            CallbackError::Json(e) => format!("callback: {e}"),
            CallbackError::NotADecisionCallback => {
                "a decision callback needs string `correlationId` and `answer`".into()
            }
            CallbackError::BadCorrelationId => "correlationId must be 1 to 256 bytes".into(),
            CallbackError::Nul => "callback fields must not contain NUL characters".into(),
        }
    }
}

pub fn parse(bytes: &[u8]) -> Result<Callback, CallbackError> {
    let v = parse_strict(bytes).map_err(CallbackError::Json)?;
    let (Some(correlation_id), Some(answer)) =
        (v.get("correlationId").and_then(Value::as_str), v.get("answer").and_then(Value::as_str))
    else {
        return Err(CallbackError::NotADecisionCallback);
    };
    if correlation_id.is_empty() || correlation_id.len() > MAX_CORRELATION_ID {
        return Err(CallbackError::BadCorrelationId);
    }
    let answered_at = v.get("answeredAt").and_then(Value::as_str);
    // PostgreSQL text cannot hold NUL, and no valid answer contains one.
    if [correlation_id, answer, answered_at.unwrap_or("")].iter().any(|s| s.contains('\0')) {
        return Err(CallbackError::Nul);
    }
    Ok(Callback {
        correlation_id: correlation_id.to_string(),
        answer: answer.to_string(),
        answered_at: answered_at.map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_wire_form_and_refuses_the_rest() {
        let c = parse(
            br#"{"correlationId":"dec_1","answer":"yes","value":"yes","answeredAt":"t","context":"c"}"#,
        )
        .expect("valid");
        assert_eq!(
            (c.correlation_id.as_str(), c.answer.as_str(), c.answered_at.as_deref()),
            ("dec_1", "yes", Some("t"))
        );
        assert_eq!(parse(br#"{"correlationId":"d"}"#), Err(CallbackError::NotADecisionCallback));
        assert_eq!(parse(br#"{"correlationId":"","answer":"yes"}"#), Err(CallbackError::BadCorrelationId));
        assert_eq!(parse(br#"{"correlationId":"d","answer":"y\u0000"}"#), Err(CallbackError::Nul));
        assert_eq!(parse(b"[]"), Err(CallbackError::NotADecisionCallback));
    }
}
