//! The operation resource of API.md, as the API returns it and as it is
//! archived.

use serde_json::{Value, json};

use crate::clock::rfc3339;
use crate::store::{DeliveryRecord, Operation, Transition};

/// The operation resource of API.md.
pub fn view(op: &Operation, transitions: &[Transition], deliveries: Option<Value>) -> Value {
    let mut v = json!({
        "id": op.id,
        "operationKey": op.operation_key,
        "threadId": op.thread_id,
        "interruptId": op.interrupt_id,
        "checkpointId": op.spec.checkpoint_id,
        "effect": op.effect,
        "type": op.decision_type.as_str(),
        "state": op.state.as_str(),
        "decisionId": op.decision_id,
        "answer": op.answer,
        "permitId": op.permit_id,
        "idempotencyKey": op.idempotency_key,
        "outcome": op.outcome_status,
        "delivery": op.delivery,
        "receipt": op.receipt,
        "lastError": op.last_error,
        // The effect target's response body: JSON when it was JSON.
        "result": op.result.as_deref().map(|r| serde_json::from_str::<Value>(r).unwrap_or_else(|_| json!(r))),
        "createdAt": rfc3339(op.created_at),
        "updatedAt": rfc3339(op.updated_at),
        "deadline": rfc3339(op.deadline),
        "transitions": transitions.iter().map(|t| json!({
            "from": t.from, "to": t.to, "at": rfc3339(t.at), "cause": t.cause, "actor": t.actor,
        })).collect::<Vec<_>>(),
    });
    if let Some(d) = deliveries {
        v["deliveries"] = d;
    }
    v
}

/// The full resource: transitions, delivery attempts.
pub fn full_view(op: &Operation, transitions: &[Transition], deliveries: &[DeliveryRecord]) -> Value {
    let deliveries = deliveries
        .iter()
        .map(|d| {
            json!({"attempt": d.attempt, "startedAt": rfc3339(d.started_at), "durationMs": d.duration_ms,
                   "statusCode": d.status_code, "error": d.error})
        })
        .collect();
    view(op, transitions, Some(Value::Array(deliveries)))
}
