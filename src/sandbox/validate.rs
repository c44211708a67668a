//! Request validation, with the bounds the SDK and the API document. Errors
//! name the field and the rule, since the SDK raises them as its message.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::domain::keys::fingerprint;

/// The fields that make up a decision's subject: what a consume must re-state.
pub(crate) const SUBJECT_KEYS: [&str; 6] =
    ["toolName", "toolTarget", "actor", "environment", "parameters", "externalId"];

const MAX_QUESTION_CHARS: usize = 500;
const MAX_EXTERNAL_ID_UTF16: usize = 256;
const MAX_PARAMETERS: usize = 32;
const MAX_PARAMETER_KEY_CHARS: usize = 64;
const MAX_PARAMETER_STRING_CHARS: usize = 200;
const MAX_INPUT_ANSWER_CHARS: usize = 5000;
const MIN_SELECT_OPTIONS: usize = 2;
const DEFAULT_EXPIRES_IN_SECONDS: i64 = 3600;
/// Far beyond any real use; it only keeps date arithmetic in range.
const MAX_EXPIRES_IN_SECONDS: i64 = 365 * 24 * 3600;
/// Keys that change how long the call blocks, not what is asked: a retry may
/// differ in them and still be the same request.
const TRANSPORT_KEYS: [&str; 2] = ["wait", "timeoutSeconds"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Confirm,
    Select,
    Input,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Confirm => "confirm",
            Self::Select => "select",
            Self::Input => "input",
        }
    }
}

/// A validated `POST /decisions` body.
#[derive(Debug)]
pub(crate) struct CreateRequest {
    pub question: String,
    pub kind: Kind,
    pub options: Option<Vec<String>>,
    /// Only the subject keys that were sent, as sent.
    pub subject: Map<String, Value>,
    pub callback_url: Option<String>,
    pub context: Option<String>,
    pub agent_name: Option<String>,
    pub placeholder: Option<String>,
    pub presentation: Option<Value>,
    pub expires_in_seconds: i64,
    pub wait: bool,
    pub timeout_seconds: Option<u64>,
    pub idempotency_key: Option<String>,
    pub require_reachable: bool,
    /// Identifies the payload for idempotency: the canonical JSON of the
    /// body without its transport keys.
    pub fingerprint: String,
}

impl CreateRequest {
    pub fn external_id(&self) -> Option<&str> {
        self.subject.get("externalId").and_then(Value::as_str)
    }
}

pub(crate) fn parse_create(mut body: Map<String, Value>) -> Result<CreateRequest, ApiError> {
    // The SDK never sends null; treating it as absent keeps "absent = absent"
    // for clients that do.
    body.retain(|_, v| !v.is_null());

    let question = string(&body, "question")?.ok_or_else(|| ApiError::invalid("question is required"))?;
    if question.trim().is_empty() {
        return Err(ApiError::invalid("question must not be blank"));
    }
    if question.chars().count() > MAX_QUESTION_CHARS {
        return Err(ApiError::invalid(format!("question must be at most {MAX_QUESTION_CHARS} characters")));
    }

    let kind = match string(&body, "type")?.as_deref() {
        None | Some("confirm") => Kind::Confirm,
        Some("select") => Kind::Select,
        Some("input") => Kind::Input,
        Some(other) => {
            return Err(ApiError::invalid(format!("type must be confirm, select or input, not {other:?}")));
        }
    };
    let options = parse_options(&body, kind)?;

    let mut subject = Map::new();
    for key in ["toolName", "toolTarget", "actor", "environment"] {
        if let Some(value) = string(&body, key)? {
            subject.insert(key.to_string(), Value::String(value));
        }
    }
    if let Some(parameters) = body.get("parameters") {
        check_parameters(parameters)?;
        subject.insert("parameters".to_string(), parameters.clone());
    }
    if let Some(external_id) = string(&body, "externalId")? {
        check_external_id(&external_id)?;
        subject.insert("externalId".to_string(), Value::String(external_id));
    }

    let callback_url = string(&body, "callbackUrl")?;
    if let Some(url) = &callback_url {
        let parsed =
            url::Url::parse(url).map_err(|e| ApiError::invalid(format!("callbackUrl is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ApiError::invalid("callbackUrl must be an http or https URL"));
        }
    }

    let presentation = body.get("presentation").cloned();
    if presentation.as_ref().is_some_and(|p| !p.is_object()) {
        return Err(ApiError::invalid("presentation must be an object"));
    }
    // Accepted for parity with the SDK; the sandbox has no email or Slack routing.
    string(&body, "email")?;
    boolean(&body, "poweredBy")?;

    let expires_in_seconds = match integer(&body, "expiresInSeconds")? {
        None => DEFAULT_EXPIRES_IN_SECONDS,
        Some(n) if (1..=MAX_EXPIRES_IN_SECONDS).contains(&n) => n,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "expiresInSeconds must be between 1 and {MAX_EXPIRES_IN_SECONDS}"
            )));
        }
    };
    let timeout_seconds = match integer(&body, "timeoutSeconds")? {
        None => None,
        Some(n) if n >= 1 => Some(n.unsigned_abs()),
        Some(_) => return Err(ApiError::invalid("timeoutSeconds must be at least 1")),
    };
    let idempotency_key = string(&body, "idempotencyKey")?;
    if idempotency_key.as_ref().is_some_and(|k| k.trim().is_empty() || k.chars().count() > 256) {
        return Err(ApiError::invalid("idempotencyKey must be 1 to 256 characters"));
    }

    let mut payload = body.clone();
    payload.retain(|k, _| !TRANSPORT_KEYS.contains(&k.as_str()));

    Ok(CreateRequest {
        question,
        kind,
        options,
        subject,
        callback_url,
        context: string(&body, "context")?,
        agent_name: string(&body, "agentName")?,
        placeholder: string(&body, "placeholder")?,
        presentation,
        expires_in_seconds,
        wait: boolean(&body, "wait")?.unwrap_or(false),
        timeout_seconds,
        idempotency_key,
        require_reachable: boolean(&body, "requireReachable")?.unwrap_or(false),
        fingerprint: fingerprint(&Value::Object(payload)),
    })
}

fn parse_options(body: &Map<String, Value>, kind: Kind) -> Result<Option<Vec<String>>, ApiError> {
    let Some(raw) = body.get("options") else {
        if kind == Kind::Select {
            return Err(ApiError::invalid(format!(
                "a select decision needs at least {MIN_SELECT_OPTIONS} options"
            )));
        }
        return Ok(None);
    };
    if kind != Kind::Select {
        return Err(ApiError::invalid("options are only valid for a select decision"));
    }
    let Some(items) = raw.as_array() else {
        return Err(ApiError::invalid("options must be an array of strings"));
    };
    let mut options: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        let option = item.as_str().ok_or_else(|| ApiError::invalid("options must be an array of strings"))?;
        if option.trim().is_empty() {
            return Err(ApiError::invalid("an option must not be blank"));
        }
        // Answers are matched by exact text, so two equal options would be
        // indistinguishable answers.
        if options.iter().any(|o| o == option) {
            return Err(ApiError::invalid(format!("option {option:?} is listed twice")));
        }
        options.push(option.to_string());
    }
    if options.len() < MIN_SELECT_OPTIONS {
        return Err(ApiError::invalid(format!(
            "a select decision needs at least {MIN_SELECT_OPTIONS} options"
        )));
    }
    Ok(Some(options))
}

pub(crate) fn check_external_id(external_id: &str) -> Result<(), ApiError> {
    if external_id.trim().is_empty() {
        return Err(ApiError::invalid("externalId must not be blank"));
    }
    if external_id.encode_utf16().count() > MAX_EXTERNAL_ID_UTF16 {
        return Err(ApiError::invalid(format!(
            "externalId must be at most {MAX_EXTERNAL_ID_UTF16} UTF-16 code units"
        )));
    }
    Ok(())
}

fn check_parameters(parameters: &Value) -> Result<(), ApiError> {
    let Some(map) = parameters.as_object() else {
        return Err(ApiError::invalid("parameters must be an object of flat facts"));
    };
    if map.len() > MAX_PARAMETERS {
        return Err(ApiError::invalid(format!("parameters may have at most {MAX_PARAMETERS} keys")));
    }
    for (key, value) in map {
        let len = key.chars().count();
        if !(1..=MAX_PARAMETER_KEY_CHARS).contains(&len) {
            return Err(ApiError::invalid(format!(
                "parameter key {key:?} must be 1 to {MAX_PARAMETER_KEY_CHARS} characters"
            )));
        }
        match value {
            // serde_json cannot represent NaN or infinities, so every number is finite.
            Value::Bool(_) | Value::Number(_) => {}
            Value::String(s) if s.chars().count() <= MAX_PARAMETER_STRING_CHARS => {}
            Value::String(_) => {
                return Err(ApiError::invalid(format!(
                    "parameter {key:?} must be at most {MAX_PARAMETER_STRING_CHARS} characters"
                )));
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "parameter {key:?} must be a boolean, a finite number or a string (nothing nested)"
                )));
            }
        }
    }
    Ok(())
}

/// Checks an answer against the decision's type, as the phone's buttons would.
pub(crate) fn check_answer(kind: Kind, options: Option<&[String]>, answer: &str) -> Result<(), ApiError> {
    match kind {
        Kind::Confirm if answer == "yes" || answer == "no" => Ok(()),
        Kind::Confirm => Err(ApiError::invalid("a confirm answer must be exactly \"yes\" or \"no\"")),
        Kind::Select if options.unwrap_or_default().iter().any(|o| o == answer) => Ok(()),
        Kind::Select => Err(ApiError::invalid("a select answer must be one of the options, exactly")),
        Kind::Input => {
            let len = answer.chars().count();
            if (1..=MAX_INPUT_ANSWER_CHARS).contains(&len) {
                Ok(())
            } else {
                Err(ApiError::invalid(format!(
                    "an input answer must be 1 to {MAX_INPUT_ANSWER_CHARS} characters"
                )))
            }
        }
    }
}

pub(crate) fn string(body: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid(format!("{key} must be a string"))),
    }
}

fn boolean(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(format!("{key} must be a boolean"))),
    }
}

fn integer(body: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| ApiError::invalid(format!("{key} must be an integer"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<CreateRequest, ApiError> {
        parse_create(v.as_object().cloned().expect("test bodies are objects"))
    }

    fn error_of(v: Value) -> String {
        parse(v).expect_err("the body should be refused").error
    }

    #[test]
    fn accepts_a_full_confirm() {
        let req = parse(json!({
            "question": "Refund order 42?", "type": "confirm", "externalId": "u1",
            "toolName": "refund", "parameters": {"amount": 12.5, "full": true, "currency": "EUR"},
            "wait": false, "idempotencyKey": "k1", "context": null
        }))
        .expect("valid");
        assert_eq!(req.kind, Kind::Confirm);
        assert_eq!(req.external_id(), Some("u1"));
        assert_eq!(req.subject.keys().collect::<Vec<_>>(), ["externalId", "parameters", "toolName"]);
        assert_eq!(req.context, None);
        assert_eq!(req.expires_in_seconds, DEFAULT_EXPIRES_IN_SECONDS);
    }

    #[test]
    fn fingerprint_ignores_wait_and_key_order_only() {
        let a = parse(json!({"question": "q", "wait": true, "toolName": "t"})).expect("valid");
        let b = parse(json!({"toolName": "t", "question": "q", "wait": false, "timeoutSeconds": 5}))
            .expect("valid");
        let c = parse(json!({"toolName": "t2", "question": "q"})).expect("valid");
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_ne!(a.fingerprint, c.fingerprint);
    }

    #[test]
    fn refuses_broken_bounds() {
        assert!(error_of(json!({"question": " "})).contains("blank"));
        assert!(error_of(json!({"question": "x".repeat(501)})).contains("500"));
        assert!(error_of(json!({"question": "q", "type": "poll"})).contains("type"));
        assert!(error_of(json!({"question": "q", "type": "select"})).contains("options"));
        assert!(error_of(json!({"question": "q", "type": "select", "options": ["a"]})).contains("options"));
        assert!(
            error_of(json!({"question": "q", "type": "select", "options": ["a", "a"]})).contains("twice")
        );
        assert!(error_of(json!({"question": "q", "externalId": ""})).contains("blank"));
        assert!(error_of(json!({"question": "q", "externalId": "😀".repeat(129)})).contains("UTF-16"));
        assert!(parse(json!({"question": "q", "externalId": "😀".repeat(128)})).is_ok());
        assert!(error_of(json!({"question": "q", "parameters": {"a": {"b": 1}}})).contains("nested"));
        assert!(error_of(json!({"question": "q", "parameters": {"a": "x".repeat(201)}})).contains("200"));
        assert!(error_of(json!({"question": "q", "parameters": {"": 1}})).contains("key"));
        let many: Map<String, Value> = (0..33).map(|i| (format!("k{i}"), json!(i))).collect();
        assert!(error_of(json!({"question": "q", "parameters": many})).contains("32"));
        assert!(error_of(json!({"question": "q", "expiresInSeconds": 0})).contains("expiresInSeconds"));
        assert!(error_of(json!({"question": "q", "callbackUrl": "ftp://x"})).contains("callbackUrl"));
        assert!(error_of(json!({"question": "q", "toolName": 3})).contains("toolName"));
    }

    #[test]
    fn answers_follow_the_type() {
        let options = vec!["Standard".to_string(), "Express".to_string()];
        assert!(check_answer(Kind::Confirm, None, "yes").is_ok());
        assert!(check_answer(Kind::Confirm, None, "no").is_ok());
        assert!(check_answer(Kind::Confirm, None, "Yes").is_err());
        assert!(check_answer(Kind::Confirm, None, "approve").is_err());
        assert!(check_answer(Kind::Select, Some(&options), "Express").is_ok());
        assert!(check_answer(Kind::Select, Some(&options), "express").is_err());
        assert!(check_answer(Kind::Input, None, "").is_err());
        assert!(check_answer(Kind::Input, None, &"x".repeat(5000)).is_ok());
        assert!(check_answer(Kind::Input, None, &"x".repeat(5001)).is_err());
    }
}
