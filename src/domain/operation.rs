//! The enqueue request: parsed field by field so every error names its
//! field, then normalized into the immutable `OperationSpec` whose canonical
//! JSON is the operation's fingerprint.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::answer::DecisionType;
use super::keys;

pub const MAX_QUESTION_CHARS: usize = 500;
pub const MAX_EXTERNAL_ID_UTF16: usize = 256;
pub const MAX_PARAMETERS: usize = 32;
pub const MAX_PARAMETER_KEY_CHARS: usize = 64;
pub const MAX_PARAMETER_STRING_CHARS: usize = 200;
pub const MAX_ID_CHARS: usize = 256;
pub const MAX_OPTIONS: usize = 20;
pub const MAX_OPTION_CHARS: usize = 200;
pub const MAX_TEXT_CHARS: usize = 2000;
pub const MAX_SHORT_CHARS: usize = 256;
pub const MAX_PRESENTATION_BYTES: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub code: &'static str,
    pub detail: String,
}

fn err(field: &str, code: &'static str, detail: impl Into<String>) -> FieldError {
    FieldError { field: field.to_string(), code, detail: detail.into() }
}

/// Subject fields Pushary binds the permit to, sent again verbatim on consume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_target: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
}

/// The validated, immutable content of an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperationSpec {
    pub operation_key: String,
    pub thread_id: String,
    pub interrupt_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_id: Option<String>,
    pub effect: String,
    pub external_id: String,
    pub question: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub options: Option<Vec<String>>,
    #[serde(flatten)]
    pub subject: Subject,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placeholder: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presentation: Option<Map<String, Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_seconds: Option<u64>,
    /// RFC 3339, as given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

impl OperationSpec {
    pub fn decision_type(&self) -> DecisionType {
        DecisionType::parse(&self.kind).unwrap_or(DecisionType::Confirm)
    }

    pub fn fingerprint(&self) -> String {
        keys::fingerprint(&serde_json::to_value(self).expect("a spec always serializes"))
    }
}

const FIELDS: &[&str] = &[
    "operationKey",
    "threadId",
    "interruptId",
    "checkpointId",
    "effect",
    "externalId",
    "question",
    "type",
    "options",
    "toolName",
    "toolTarget",
    "actor",
    "environment",
    "parameters",
    "context",
    "placeholder",
    "presentation",
    "agentName",
    "revision",
    "expiresInSeconds",
    "deadline",
];

/// Bounds that come from configuration rather than the protocol.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_expires_in_secs: u64,
}

/// Parses and validates an enqueue body. `now_ms` anchors `deadline` checks.
pub fn parse(body: &Value, limits: Limits, now_ms: i64) -> Result<OperationSpec, FieldError> {
    let obj = body.as_object().ok_or_else(|| err("", "invalid_body", "the body must be a JSON object"))?;
    if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(err(unknown, "unknown_field", format!("`{unknown}` is not a field of an operation")));
    }
    let kind = opt_string(obj, "type")?.unwrap_or_else(|| "confirm".into());
    let decision_type = DecisionType::parse(&kind)
        .ok_or_else(|| err("type", "invalid_value", "must be `confirm`, `select` or `input`"))?;

    let options = match obj.get("options") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                let s =
                    item.as_str().ok_or_else(|| err("options", "invalid_type", "options must be strings"))?;
                check_text("options", s, 1, MAX_OPTION_CHARS)?;
                if out.iter().any(|o: &String| o == s) {
                    return Err(err("options", "invalid_value", format!("option `{s}` is listed twice")));
                }
                out.push(s.to_string());
            }
            Some(out)
        }
        Some(_) => return Err(err("options", "invalid_type", "must be an array of strings")),
    };
    match (decision_type, &options) {
        (DecisionType::Select, None) => {
            return Err(err("options", "missing_field", "a select decision needs options"));
        }
        // The SDK documents at least two options for a select.
        (DecisionType::Select, Some(o)) if o.len() < 2 || o.len() > MAX_OPTIONS => {
            return Err(err("options", "out_of_bounds", format!("give 2 to {MAX_OPTIONS} options")));
        }
        (DecisionType::Confirm | DecisionType::Input, Some(_)) => {
            return Err(err("options", "invalid_value", "options are only for select decisions"));
        }
        _ => {}
    }

    let external_id = req_string(obj, "externalId")?;
    if external_id.trim().is_empty() {
        return Err(err("externalId", "out_of_bounds", "must not be blank"));
    }
    if external_id.encode_utf16().count() > MAX_EXTERNAL_ID_UTF16 {
        return Err(err("externalId", "out_of_bounds", "must be at most 256 UTF-16 code units"));
    }
    let question = req_string(obj, "question")?;
    check_text("question", &question, 1, MAX_QUESTION_CHARS)?;
    if question.trim().is_empty() {
        return Err(err("question", "out_of_bounds", "must not be blank"));
    }

    let expires_in_seconds = match obj.get("expiresInSeconds") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let n = v.as_u64().ok_or_else(|| {
                err("expiresInSeconds", "invalid_type", "must be a whole number of seconds")
            })?;
            if n == 0 || n > limits.max_expires_in_secs {
                return Err(err(
                    "expiresInSeconds",
                    "out_of_bounds",
                    format!("must be between 1 and {}", limits.max_expires_in_secs),
                ));
            }
            Some(n)
        }
    };
    let deadline = opt_string(obj, "deadline")?;
    if let Some(d) = &deadline {
        if expires_in_seconds.is_some() {
            return Err(err(
                "deadline",
                "invalid_value",
                "give either deadline or expiresInSeconds, not both",
            ));
        }
        let at = chrono::DateTime::parse_from_rfc3339(d)
            .map_err(|_| err("deadline", "invalid_value", "must be an RFC 3339 time"))?;
        let ms = at.timestamp_millis();
        let max = now_ms.saturating_add(i64::try_from(limits.max_expires_in_secs).unwrap_or(i64::MAX) * 1000);
        if ms < now_ms + 1000 || ms > max {
            return Err(err(
                "deadline",
                "out_of_bounds",
                format!("must be at least 1 s and at most {} s in the future", limits.max_expires_in_secs),
            ));
        }
    }

    let spec = OperationSpec {
        operation_key: id_field(obj, "operationKey")?,
        thread_id: id_field(obj, "threadId")?,
        interrupt_id: id_field(obj, "interruptId")?,
        checkpoint_id: opt_id_field(obj, "checkpointId")?,
        effect: {
            let e = req_string(obj, "effect")?;
            validate_name(&e).map_err(|p| err("effect", "invalid_value", p))?;
            e
        },
        external_id,
        question,
        kind,
        options,
        subject: Subject {
            tool_name: opt_short(obj, "toolName")?,
            tool_target: opt_short(obj, "toolTarget")?,
            actor: opt_short(obj, "actor")?,
            environment: opt_short(obj, "environment")?,
            parameters: parameters(obj)?,
        },
        context: opt_text(obj, "context", MAX_TEXT_CHARS)?,
        placeholder: opt_short(obj, "placeholder")?,
        presentation: match obj.get("presentation") {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => {
                if serde_json::to_vec(m).map(|v| v.len()).unwrap_or(usize::MAX) > MAX_PRESENTATION_BYTES {
                    return Err(err("presentation", "out_of_bounds", "must be at most 4096 bytes of JSON"));
                }
                Some(m.clone())
            }
            Some(_) => return Err(err("presentation", "invalid_type", "must be a JSON object")),
        },
        agent_name: opt_short(obj, "agentName")?,
        revision: opt_id_field(obj, "revision")?,
        expires_in_seconds,
        deadline,
    };
    Ok(spec)
}

/// Names of effect targets (config keys): short, URL- and log-safe.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err("may contain only letters, digits, `_` and `-`".into());
    }
    Ok(())
}

fn parameters(obj: &Map<String, Value>) -> Result<Option<Map<String, Value>>, FieldError> {
    let map = match obj.get("parameters") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(err("parameters", "invalid_type", "must be a flat JSON object")),
    };
    if map.len() > MAX_PARAMETERS {
        return Err(err("parameters", "out_of_bounds", format!("at most {MAX_PARAMETERS} keys")));
    }
    for (k, v) in map {
        let field = format!("parameters.{k}");
        let n = k.chars().count();
        if n == 0 || n > MAX_PARAMETER_KEY_CHARS {
            return Err(err(&field, "out_of_bounds", "keys must be 1 to 64 characters"));
        }
        match v {
            Value::Bool(_) => {}
            // serde_json has no NaN or infinity, so every number here is finite.
            Value::Number(num) => {
                if num.as_f64().is_none_or(|f| !f.is_finite()) {
                    return Err(err(&field, "out_of_bounds", "numbers must be finite"));
                }
            }
            Value::String(s) => {
                if s.chars().count() > MAX_PARAMETER_STRING_CHARS {
                    return Err(err(&field, "out_of_bounds", "strings must be at most 200 characters"));
                }
            }
            _ => {
                return Err(err(
                    &field,
                    "invalid_type",
                    "values must be booleans, numbers or strings (flat)",
                ));
            }
        }
    }
    Ok(Some(map.clone()))
}

fn req_string(obj: &Map<String, Value>, field: &str) -> Result<String, FieldError> {
    opt_string(obj, field)?.ok_or_else(|| err(field, "missing_field", format!("`{field}` is required")))
}

fn opt_string(obj: &Map<String, Value>, field: &str) -> Result<Option<String>, FieldError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(err(field, "invalid_type", "must be a string")),
    }
}

fn check_text(field: &str, s: &str, min: usize, max: usize) -> Result<(), FieldError> {
    let n = s.chars().count();
    if n < min || n > max {
        return Err(err(field, "out_of_bounds", format!("must be {min} to {max} characters")));
    }
    if s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(err(field, "invalid_value", "must not contain control characters"));
    }
    Ok(())
}

fn id_field(obj: &Map<String, Value>, field: &str) -> Result<String, FieldError> {
    let s = req_string(obj, field)?;
    check_id(field, &s)?;
    Ok(s)
}

fn opt_id_field(obj: &Map<String, Value>, field: &str) -> Result<Option<String>, FieldError> {
    let s = opt_string(obj, field)?;
    if let Some(s) = &s {
        check_id(field, s)?;
    }
    Ok(s)
}

fn check_id(field: &str, s: &str) -> Result<(), FieldError> {
    check_text(field, s, 1, MAX_ID_CHARS)?;
    if s.chars().any(char::is_control) || s.trim() != s {
        return Err(err(field, "invalid_value", "must not contain control characters or surrounding spaces"));
    }
    Ok(())
}

fn opt_short(obj: &Map<String, Value>, field: &str) -> Result<Option<String>, FieldError> {
    opt_text(obj, field, MAX_SHORT_CHARS)
}

fn opt_text(obj: &Map<String, Value>, field: &str, max: usize) -> Result<Option<String>, FieldError> {
    let s = opt_string(obj, field)?;
    if let Some(s) = &s {
        check_text(field, s, 1, max)?;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LIMITS: Limits = Limits { max_expires_in_secs: 86400 };
    const NOW: i64 = 1_800_000_000_000;

    fn base() -> Value {
        json!({"operationKey": "op-1", "threadId": "t-1", "interruptId": "i-1", "effect": "orders",
               "externalId": "user-1", "question": "Refund 40 EUR?"})
    }

    fn with(key: &str, v: Value) -> Value {
        let mut b = base();
        b[key] = v;
        b
    }

    fn field_of(v: Value) -> String {
        parse(&v, LIMITS, NOW).expect_err("should fail").field
    }

    #[test]
    fn minimal_is_a_confirm() {
        let s = parse(&base(), LIMITS, NOW).expect("valid");
        assert_eq!(s.decision_type(), DecisionType::Confirm);
        assert_eq!(s.kind, "confirm");
    }

    #[test]
    fn every_required_field_is_named_when_missing() {
        for f in ["operationKey", "threadId", "interruptId", "effect", "externalId", "question"] {
            let mut b = base();
            b.as_object_mut().expect("object").remove(f);
            assert_eq!(field_of(b), f);
        }
    }

    #[test]
    fn bounds_name_their_field() {
        assert_eq!(field_of(with("question", json!("x".repeat(501)))), "question");
        assert_eq!(field_of(with("question", json!("   "))), "question");
        assert!(parse(&with("question", json!("x".repeat(500))), LIMITS, NOW).is_ok());
        assert_eq!(field_of(with("externalId", json!(" "))), "externalId");
        assert_eq!(field_of(with("externalId", json!("😀".repeat(129)))), "externalId");
        assert!(parse(&with("externalId", json!("😀".repeat(128))), LIMITS, NOW).is_ok());
        assert_eq!(field_of(with("type", json!("vote"))), "type");
        assert_eq!(field_of(with("type", json!("select"))), "options");
        assert_eq!(field_of(with("options", json!(["a"]))), "options");
        let mut sel = with("type", json!("select"));
        sel["options"] = json!([]);
        assert_eq!(field_of(sel.clone()), "options");
        sel["options"] = json!(["only"]);
        assert_eq!(field_of(sel.clone()), "options");
        sel["options"] = json!(["a", "a"]);
        assert_eq!(field_of(sel.clone()), "options");
        sel["options"] = json!(["a", "b"]);
        assert!(parse(&sel, LIMITS, NOW).is_ok());
        assert_eq!(field_of(with("expiresInSeconds", json!(0))), "expiresInSeconds");
        assert_eq!(field_of(with("expiresInSeconds", json!(-5))), "expiresInSeconds");
        assert_eq!(field_of(with("expiresInSeconds", json!(1.5))), "expiresInSeconds");
        assert_eq!(field_of(with("expiresInSeconds", json!(86401))), "expiresInSeconds");
        assert_eq!(field_of(with("deadline", json!("tomorrow"))), "deadline");
        assert_eq!(field_of(with("deadline", json!("2020-01-01T00:00:00Z"))), "deadline");
        assert_eq!(field_of(with("effect", json!("../etc"))), "effect");
        assert_eq!(field_of(with("surprise", json!(1))), "surprise");
        assert_eq!(field_of(with("threadId", json!(7))), "threadId");
        assert_eq!(field_of(with("threadId", json!(" t"))), "threadId");
        assert_eq!(field_of(with("operationKey", json!("a".repeat(257)))), "operationKey");
        assert_eq!(field_of(with("presentation", json!("x"))), "presentation");
    }

    #[test]
    fn parameter_bounds() {
        let many: Map<String, Value> = (0..33).map(|i| (format!("k{i}"), json!(i))).collect();
        assert_eq!(field_of(with("parameters", Value::Object(many))), "parameters");
        let ok: Map<String, Value> = (0..32).map(|i| (format!("k{i}"), json!(i))).collect();
        assert!(parse(&with("parameters", Value::Object(ok)), LIMITS, NOW).is_ok());
        assert_eq!(field_of(with("parameters", json!({"a": {"b": 1}}))), "parameters.a");
        assert_eq!(field_of(with("parameters", json!({"a": [1]}))), "parameters.a");
        assert_eq!(field_of(with("parameters", json!({"a": null}))), "parameters.a");
        assert_eq!(field_of(with("parameters", json!({"a": "x".repeat(201)}))), "parameters.a");
        let long_key = "k".repeat(65);
        assert_eq!(
            field_of(with("parameters", json!({ long_key.clone(): 1 }))),
            format!("parameters.{long_key}")
        );
        assert_eq!(field_of(with("parameters", json!({"": 1}))), "parameters.");
        assert_eq!(field_of(with("parameters", json!([1]))), "parameters");
        assert!(
            parse(&with("parameters", json!({"amount": 40.5, "ok": true, "cur": "EUR"})), LIMITS, NOW)
                .is_ok()
        );
    }

    #[test]
    fn fingerprint_is_stable_and_content_sensitive() {
        let a = parse(&with("parameters", json!({"b": 1, "a": 2})), LIMITS, NOW).expect("valid");
        let b = parse(&with("parameters", json!({"a": 2, "b": 1})), LIMITS, NOW).expect("valid");
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = parse(&with("parameters", json!({"a": 3, "b": 1})), LIMITS, NOW).expect("valid");
        assert_ne!(a.fingerprint(), c.fingerprint());
    }
}
