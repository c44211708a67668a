//! Delivering an outcome to an effect target: JSON body, `Idempotency-Key`,
//! Standard Webhooks signature headers, a bounded response body.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Engine;
use crate::clock::{now_ms, rfc3339};
use crate::store::{DeliveryRecord, Operation, StoreError};

/// The largest response body kept as the operation's result.
pub const MAX_RESULT_BYTES: usize = 16 * 1024;

#[derive(Debug, Clone)]
pub struct EffectTarget {
    pub url: String,
    /// Signing keys with the time each stops being used (none: current);
    /// during a rotation both sign, so receivers can switch over.
    pub keys: Vec<(Vec<u8>, Option<i64>)>,
    pub timeout: Duration,
    /// Deduplicates on `Idempotency-Key`, so an interrupted approval may be
    /// delivered again instead of ending `uncertain`.
    pub redeliver_safe: bool,
}

pub(crate) enum Outcome {
    /// 2xx: the effect is done; its (bounded) body.
    Done(Option<String>),
    /// 4xx other than 429: refused for good.
    Refused(u16, Option<String>),
    /// 429, 5xx, timeout or no connection: try again with the same key.
    Retry(String),
}

/// The delivery body of API.md.
pub fn outcome_body(op: &Operation) -> Value {
    let status = op.outcome_status.clone().unwrap_or_default();
    let approved = status == "approved" && op.permit_id.is_some();
    let spec = &op.spec;
    let mut subject = json!({ "externalId": spec.external_id });
    for (k, v) in [
        ("toolName", &spec.subject.tool_name),
        ("toolTarget", &spec.subject.tool_target),
        ("actor", &spec.subject.actor),
        ("environment", &spec.subject.environment),
    ] {
        if let Some(v) = v {
            subject[k] = json!(v);
        }
    }
    subject["parameters"] = json!(spec.subject.parameters.clone().unwrap_or_default());
    json!({
        "operationId": op.id,
        "operationKey": op.operation_key,
        "threadId": op.thread_id,
        "interruptId": op.interrupt_id,
        "checkpointId": spec.checkpoint_id,
        "decisionId": op.decision_id,
        "correlationId": op.decision_id,
        "type": op.decision_type.as_str(),
        "status": status,
        "approved": approved,
        "answer": op.answer,
        "permitId": if approved { json!(op.permit_id) } else { Value::Null },
        "idempotencyKey": op.idempotency_key,
        "revision": spec.revision,
        "subject": subject,
        "deadline": rfc3339(op.deadline),
    })
}

impl Engine {
    /// One delivery attempt. Whatever its result, it is recorded in
    /// `deliveries` by the next save of `op` (the one that records what the
    /// attempt led to), in the same transaction.
    pub(crate) async fn post_outcome(&self, op: &mut Operation) -> Result<Outcome, StoreError> {
        let Some(target) = self.effect(&op.tenant, &op.effect) else {
            // The target was removed from config after enqueue; an operator must act.
            return Ok(Outcome::Retry(format!("effect target `{}` is not configured", op.effect)));
        };
        let body = serde_json::to_vec(&outcome_body(op)).expect("a Value always serializes");
        let msg_id = format!("msg_{}", op.id);
        let ts = now_ms() / 1000;
        let now = now_ms();
        let keys: Vec<Vec<u8>> = target
            .keys
            .iter()
            .filter(|(_, until)| until.is_none_or(|u| u > now))
            .map(|(k, _)| k.clone())
            .collect();
        let signature = crate::webhooks::signature_header(&keys, &msg_id, ts, &body);
        let started_at = now_ms();
        let clock = Instant::now();
        let sent = self
            .http
            .post(&target.url)
            .timeout(target.timeout)
            .header("content-type", "application/json")
            .header("idempotency-key", &op.idempotency_key)
            .header("webhook-id", &msg_id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", signature)
            .body(body)
            .send()
            .await;
        let mut record = DeliveryRecord {
            operation_id: op.id.clone(),
            attempt: op.attempts,
            started_at,
            duration_ms: None,
            status_code: None,
            error: None,
            response_body: None,
        };
        let outcome = match sent {
            Err(e) => {
                let why = if e.is_timeout() { "timed out".to_string() } else { format!("no response: {e}") };
                record.error = Some(why.clone());
                Outcome::Retry(why)
            }
            Ok(mut resp) => {
                let code = resp.status().as_u16();
                let mut kept = Vec::new();
                // Read at most MAX_RESULT_BYTES; the rest is dropped unread.
                while kept.len() < MAX_RESULT_BYTES {
                    match resp.chunk().await {
                        Ok(Some(chunk)) => kept.extend_from_slice(&chunk),
                        _ => break,
                    }
                }
                kept.truncate(MAX_RESULT_BYTES);
                let text = (!kept.is_empty()).then(|| String::from_utf8_lossy(&kept).into_owned());
                record.status_code = Some(i64::from(code));
                record.response_body = text.clone();
                match code {
                    200..=299 => Outcome::Done(text),
                    429 | 500..=599 => Outcome::Retry(format!("effect target answered {code}")),
                    _ => Outcome::Refused(code, text),
                }
            }
        };
        let class = match record.status_code {
            None => "transport",
            Some(200..=299) => "2xx",
            Some(400..=499) => "4xx",
            Some(500..=599) => "5xx",
            Some(_) => "other",
        };
        self.metrics.observe("approvald_delivery_duration_seconds", &[("outcome", class)], clock.elapsed());
        self.metrics.inc("approvald_deliveries_total", &[("outcome", class)]);
        record.duration_ms = Some(i64::try_from(clock.elapsed().as_millis()).unwrap_or(i64::MAX));
        op.unrecorded_delivery = Some(record);
        Ok(outcome)
    }
}
