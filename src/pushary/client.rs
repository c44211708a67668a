//! The server-side Pushary client, speaking the published SDK's wire form:
//! `Authorization: Bearer`, JSON with camelCase keys and absent keys
//! omitted, ids percent-encoded as one path segment.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::secret::Secret;

#[derive(Debug, thiserror::Error)]
pub enum PusharyError {
    /// No response: never an answer and never permission.
    #[error("pushary unreachable: {0}")]
    Transport(String),
    #[error("pushary answered {status}: {message}")]
    Status { status: u16, message: String, refusal: Option<String>, body: Value },
    #[error("pushary response unusable: {0}")]
    Decode(String),
}

impl PusharyError {
    /// Worth sending the identical request again.
    pub fn is_retryable(&self) -> bool {
        match self {
            PusharyError::Transport(_) => true,
            PusharyError::Status { status, .. } => *status >= 500 || *status == 429,
            PusharyError::Decode(_) => false,
        }
    }

    pub fn refusal(&self) -> Option<&str> {
        match self {
            PusharyError::Status { refusal, .. } => refusal.as_deref(),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            PusharyError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedDecision {
    pub decision_id: String,
    #[serde(default)]
    pub status: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    /// Not needed to act on a poll (the caller knows the id it asked for),
    /// and the SDK never reads it, so its absence is tolerated.
    #[serde(default)]
    pub decision_id: Option<String>,
    pub status: String,
    #[serde(default)]
    pub answered: Option<bool>,
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub answered_at: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Permit {
    pub permit_id: String,
}

#[derive(Clone)]
pub struct PusharyClient {
    http: reqwest::Client,
    base_url: String,
    api_key: Secret,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
}

/// Percent-encodes an id as one path segment, like Python's
/// `urllib.parse.quote(id, safe="")`: everything but unreserved characters.
pub fn encode_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl PusharyClient {
    pub fn new(base_url: &str, api_key: Secret, timeout: Duration) -> Result<Self, PusharyError> {
        crate::config::validate_api_key(api_key.expose())
            .map_err(|p| PusharyError::Decode(format!("api key {p}")))?;
        let http = crate::http::client_builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| PusharyError::Transport(e.to_string()))?;
        Ok(Self { http, base_url: base_url.trim_end_matches('/').to_string(), api_key, metrics: None })
    }

    /// Counts this client's calls (latency and errors) in `metrics`.
    pub fn with_metrics(mut self, metrics: std::sync::Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    async fn call(
        &self,
        name: &'static str,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, PusharyError> {
        let started = std::time::Instant::now();
        let result = self.send(method, path, body).await;
        if let Some(m) = &self.metrics {
            m.observe("approvald_pushary_request_duration_seconds", &[("call", name)], started.elapsed());
            if let Err(e) = &result {
                let kind = match e {
                    PusharyError::Transport(_) => "transport",
                    PusharyError::Decode(_) => "decode",
                    PusharyError::Status { .. } => "status",
                };
                m.inc("approvald_pushary_errors_total", &[("call", name), ("kind", kind)]);
            }
        }
        result
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, PusharyError> {
        let url = format!("{}{}", self.base_url, path);
        let mut req = self
            .http
            .request(method, &url)
            .bearer_auth(self.api_key.expose())
            .header(reqwest::header::CONTENT_TYPE, "application/json");
        if let Some(b) = body {
            req = req.body(serde_json::to_vec(b).expect("a Value always serializes"));
        }
        let resp = req.send().await.map_err(|e| PusharyError::Transport(without_url(&e)))?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| PusharyError::Transport(without_url(&e)))?;
        if (200..300).contains(&status) {
            return Ok(success_body(&bytes));
        }
        Err(status_error(status, &bytes))
    }

    fn parse<T: for<'de> Deserialize<'de>>(value: Value) -> Result<T, PusharyError> {
        serde_json::from_value(value).map_err(|e| PusharyError::Decode(e.to_string()))
    }

    /// `POST /decisions` with a payload built once at enqueue, so every
    /// retry resends identical content under the same idempotency key.
    pub async fn create_decision(&self, payload: &Value) -> Result<CreatedDecision, PusharyError> {
        Self::parse(self.call("create_decision", reqwest::Method::POST, "/decisions", Some(payload)).await?)
    }

    pub async fn get_decision(&self, id: &str, wait: Option<u32>) -> Result<Decision, PusharyError> {
        let mut path = format!("/decisions/{}", encode_segment(id));
        if let Some(w) = wait {
            path.push_str(&format!("?wait={w}"));
        }
        Self::parse(self.call("get_decision", reqwest::Method::GET, &path, None).await?)
    }

    pub async fn answer_decision(&self, id: &str, answer: &str) -> Result<Value, PusharyError> {
        let path = format!("/decisions/{}", encode_segment(id));
        self.call("answer_decision", reqwest::Method::POST, &path, Some(&json!({ "answer": answer }))).await
    }

    pub async fn cancel_decision(&self, id: &str) -> Result<Value, PusharyError> {
        let path = format!("/decisions/{}", encode_segment(id));
        self.call("cancel_decision", reqwest::Method::DELETE, &path, None).await
    }

    /// `POST /authorizations/consume`: `body` restates the exact subject the
    /// decision was created with.
    pub async fn consume(&self, body: &Value) -> Result<Permit, PusharyError> {
        Self::parse(self.call("consume", reqwest::Method::POST, "/authorizations/consume", Some(body)).await?)
    }

    pub async fn record_receipt(
        &self,
        permit_id: &str,
        outcome: &str,
        summary: Option<&str>,
    ) -> Result<Value, PusharyError> {
        let path = format!("/authorizations/{}/receipt", encode_segment(permit_id));
        let mut body = json!({ "outcome": outcome });
        if let Some(s) = summary {
            body["summary"] = json!(s);
        }
        self.call("record_receipt", reqwest::Method::POST, &path, Some(&body)).await
    }

    pub async fn webhook_secret(&self) -> Result<Secret, PusharyError> {
        let v = self.call("webhook_secret", reqwest::Method::GET, "/webhook-secret", None).await?;
        secret_field(v)
    }

    pub async fn rotate_webhook_secret(&self) -> Result<Secret, PusharyError> {
        let v = self.call("rotate_webhook_secret", reqwest::Method::POST, "/webhook-secret", None).await?;
        secret_field(v)
    }
}

/// A 2xx body as the SDK reads it: empty, non-UTF-8 or non-JSON is `{}`, a
/// JSON value that is not an object is `{"data": value}`, an object as is.
fn success_body(bytes: &[u8]) -> Value {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(object @ Value::Object(_)) => object,
        Ok(other) => json!({ "data": other }),
        Err(_) => json!({}),
    }
}

/// A non-2xx answer as the SDK reads it: the message is the body's `error`
/// when it is a string, else its `message` when that is a string, else
/// `HTTP {status}`; a body that is not a JSON object reads as `{}`.
fn status_error(status: u16, bytes: &[u8]) -> PusharyError {
    let body = match serde_json::from_slice::<Value>(bytes) {
        Ok(object @ Value::Object(_)) => object,
        _ => json!({}),
    };
    let message = body
        .get("error")
        .and_then(Value::as_str)
        .or_else(|| body.get("message").and_then(Value::as_str))
        .map(str::to_string)
        .unwrap_or_else(|| format!("HTTP {status}"));
    let refusal = body.get("refusal").and_then(Value::as_str).map(str::to_string);
    PusharyError::Status { status, message, refusal, body }
}

fn secret_field(v: Value) -> Result<Secret, PusharyError> {
    v.get("secret")
        .and_then(Value::as_str)
        .map(Secret::new)
        .ok_or_else(|| PusharyError::Decode("no `secret` in the response".into()))
}

/// reqwest errors print the URL; ids in it are fine but keep messages short.
fn without_url(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else if e.is_body() || e.is_decode() {
        "response body failed"
    } else {
        "request failed"
    };
    let mut source = std::error::Error::source(e);
    let mut detail = String::new();
    while let Some(s) = source {
        detail = s.to_string();
        source = s.source();
    }
    if detail.is_empty() { kind.to_string() } else { format!("{kind}: {detail}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_encode_like_python_quote_with_no_safe_chars() {
        assert_eq!(encode_segment("dec_01AZ-._~"), "dec_01AZ-._~");
        assert_eq!(encode_segment("a/b"), "a%2Fb");
        assert_eq!(encode_segment("../x"), "..%2Fx");
        assert_eq!(encode_segment("a b?c#d%"), "a%20b%3Fc%23d%25");
        assert_eq!(encode_segment("ü"), "%C3%BC");
    }

    #[test]
    fn success_bodies_read_like_the_sdk() {
        assert_eq!(success_body(b""), json!({}));
        assert_eq!(success_body(b"OK"), json!({}));
        assert_eq!(success_body(&[0xff, 0xfe]), json!({}));
        assert_eq!(success_body(b"[1,2]"), json!({"data": [1, 2]}));
        assert_eq!(success_body(b"null"), json!({"data": null}));
        assert_eq!(success_body(br#"{"a":1}"#), json!({"a": 1}));
    }

    fn parts(e: PusharyError) -> (u16, String, Option<String>, Value) {
        match e {
            PusharyError::Status { status, message, refusal, body } => (status, message, refusal, body),
            other => panic!("expected a status error, got {other:?}"),
        }
    }

    #[test]
    fn error_bodies_read_like_the_sdk() {
        let (_, message, refusal, body) =
            parts(status_error(409, br#"{"error":"Nope","message":"m","refusal":"expired"}"#));
        assert_eq!((message.as_str(), refusal.as_deref()), ("Nope", Some("expired")));
        assert_eq!(body["message"], "m");
        assert_eq!(parts(status_error(400, br#"{"message":"only message"}"#)).1, "only message");
        // A non-string `error` falls through to `message`.
        assert_eq!(parts(status_error(400, br#"{"error":{"code":7},"message":"m"}"#)).1, "m");
        assert_eq!(parts(status_error(400, br#"{"error":null}"#)).1, "HTTP 400");
        for raw in [&b"<html>Bad Gateway</html>"[..], b"", b"[\"x\"]", b"\"text\""] {
            let (status, message, refusal, body) = parts(status_error(502, raw));
            assert_eq!((status, message.as_str(), refusal, body), (502, "HTTP 502", None, json!({})));
        }
        assert_eq!(parts(status_error(403, br#"{"refusal":7}"#)).2, None);
    }

    #[test]
    fn responses_tolerate_unknown_and_missing_fields() {
        let created: CreatedDecision =
            PusharyClient::parse(json!({"decisionId": "d", "brandNew": {"x": [1]}})).expect("extra ignored");
        assert_eq!((created.decision_id.as_str(), created.status), ("d", None));
        let d: Decision = PusharyClient::parse(json!({"status": "pending"})).expect("optional missing");
        assert_eq!((d.decision_id, d.answered, d.value, d.answered_at), (None, None, None, None));
        let d: Decision = PusharyClient::parse(
            json!({"decisionId": "d", "status": "answered", "answered": true, "value": "yes",
                   "answeredAt": null, "createdAt": "x", "somethingElse": 1}),
        )
        .expect("extra ignored");
        assert_eq!((d.status.as_str(), d.value.as_deref()), ("answered", Some("yes")));
        let p: Permit = PusharyClient::parse(json!({"permitId": "p", "authority": "human"})).expect("permit");
        assert_eq!(p.permit_id, "p");
        // What cannot be acted on is a decode error, never a default.
        assert!(matches!(PusharyClient::parse::<CreatedDecision>(json!({})), Err(PusharyError::Decode(_))));
        assert!(matches!(
            PusharyClient::parse::<Decision>(json!({"value": "yes"})),
            Err(PusharyError::Decode(_))
        ));
        assert!(matches!(
            PusharyClient::parse::<Permit>(json!({"data": null})),
            Err(PusharyError::Decode(_))
        ));
        assert!(matches!(secret_field(json!({})), Err(PusharyError::Decode(_))));
    }

    #[test]
    fn retryable_errors_are_transport_and_server_side() {
        assert!(PusharyError::Transport("x".into()).is_retryable());
        let s =
            |status| PusharyError::Status { status, message: String::new(), refusal: None, body: json!({}) };
        assert!(s(503).is_retryable());
        assert!(s(429).is_retryable());
        assert!(!s(409).is_retryable());
        assert!(!s(403).is_retryable());
    }
}
