//! Row types and their mapping from SQL rows.

use serde::Serialize;
use serde_json::Value;
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use super::StoreError;
use crate::domain::answer::DecisionType;
use crate::domain::operation::OperationSpec;
use crate::domain::state::State;

#[derive(Debug, Clone)]
pub struct Operation {
    pub id: String,
    pub tenant: String,
    pub operation_key: String,
    pub fingerprint: String,
    pub thread_id: String,
    pub interrupt_id: String,
    pub effect: String,
    pub decision_type: DecisionType,
    pub spec: OperationSpec,
    pub decision_request: Value,
    pub state: State,
    pub decision_id: Option<String>,
    pub answer: Option<String>,
    pub permit_id: Option<String>,
    pub delivery: Option<String>,
    pub outcome_status: Option<String>,
    pub idempotency_key: String,
    pub result: Option<String>,
    pub receipt: Option<String>,
    pub receipt_outcome: Option<String>,
    pub consume_inflight: bool,
    pub consume_attempts: i64,
    pub delivery_inflight: bool,
    pub attempts: i64,
    pub last_error: Option<String>,
    pub due_at: Option<i64>,
    pub deadline: i64,
    pub poll_at: Option<i64>,
    pub resume_seq: Option<i64>,
    pub opened_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    pub version: i64,
}

impl Operation {
    /// Still has resume work that later answers of its thread must wait for.
    pub fn unfinished(&self) -> bool {
        matches!(self.state, State::Answered | State::Permitted | State::Delivering)
            || self.delivery.as_deref() == Some("pending")
    }

    pub fn from_row(row: &SqliteRow) -> Result<Self, StoreError> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| StoreError::Corrupt(format!("{what}: {e}"));
        let spec: String = row.try_get("spec")?;
        let request: String = row.try_get("decision_request")?;
        let state: String = row.try_get("state")?;
        let kind: String = row.try_get("decision_type")?;
        Ok(Operation {
            id: row.try_get("id")?,
            tenant: row.try_get("tenant")?,
            operation_key: row.try_get("operation_key")?,
            fingerprint: row.try_get("fingerprint")?,
            thread_id: row.try_get("thread_id")?,
            interrupt_id: row.try_get("interrupt_id")?,
            effect: row.try_get("effect")?,
            decision_type: DecisionType::parse(&kind).ok_or_else(|| corrupt("decision_type", &kind))?,
            spec: serde_json::from_str(&spec).map_err(|e| corrupt("spec", &e))?,
            decision_request: serde_json::from_str(&request).map_err(|e| corrupt("decision_request", &e))?,
            state: state.parse().map_err(|e: String| corrupt("state", &e))?,
            decision_id: row.try_get("decision_id")?,
            answer: row.try_get("answer")?,
            permit_id: row.try_get("permit_id")?,
            delivery: row.try_get("delivery")?,
            outcome_status: row.try_get("outcome_status")?,
            idempotency_key: row.try_get("idempotency_key")?,
            result: row.try_get("result")?,
            receipt: row.try_get("receipt")?,
            receipt_outcome: row.try_get("receipt_outcome")?,
            consume_inflight: row.try_get::<i64, _>("consume_inflight")? != 0,
            consume_attempts: row.try_get("consume_attempts")?,
            delivery_inflight: row.try_get::<i64, _>("delivery_inflight")? != 0,
            attempts: row.try_get("attempts")?,
            last_error: row.try_get("last_error")?,
            due_at: row.try_get("due_at")?,
            deadline: row.try_get("deadline")?,
            poll_at: row.try_get("poll_at")?,
            resume_seq: row.try_get("resume_seq")?,
            opened_at: row.try_get("opened_at")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            version: row.try_get("version")?,
        })
    }
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Transition {
    pub from: Option<String>,
    pub to: String,
    pub at: i64,
    pub cause: String,
    pub actor: String,
}

impl Transition {
    pub fn new(from: Option<State>, to: State, at: i64, cause: impl Into<String>, actor: &str) -> Self {
        Self {
            from: from.map(|s| s.as_str().to_string()),
            to: to.as_str().to_string(),
            at,
            cause: cause.into(),
            actor: actor.to_string(),
        }
    }

    pub fn from_row(row: &SqliteRow) -> Result<Self, StoreError> {
        Ok(Self {
            from: row.try_get("from_state")?,
            to: row.try_get("to_state")?,
            at: row.try_get("at")?,
            cause: row.try_get("cause")?,
            actor: row.try_get("actor")?,
        })
    }
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InboxEntry {
    pub id: i64,
    pub tenant: String,
    pub correlation_id: String,
    pub answer: String,
    pub answered_at: Option<String>,
    pub source: String,
    pub state: String,
    pub received_at: i64,
    pub duplicates: i64,
    pub operation_id: Option<String>,
    pub processed_at: Option<i64>,
    pub note: Option<String>,
}

impl InboxEntry {
    pub fn from_row(row: &SqliteRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: row.try_get("id")?,
            tenant: row.try_get("tenant")?,
            correlation_id: row.try_get("correlation_id")?,
            answer: row.try_get("answer")?,
            answered_at: row.try_get("answered_at")?,
            source: row.try_get("source")?,
            state: row.try_get("state")?,
            received_at: row.try_get("received_at")?,
            duplicates: row.try_get("duplicates")?,
            operation_id: row.try_get("operation_id")?,
            processed_at: row.try_get("processed_at")?,
            note: row.try_get("note")?,
        })
    }
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryRecord {
    pub operation_id: String,
    pub attempt: i64,
    pub started_at: i64,
    pub duration_ms: Option<i64>,
    pub status_code: Option<i64>,
    pub error: Option<String>,
    pub response_body: Option<String>,
}

impl DeliveryRecord {
    pub fn from_row(row: &SqliteRow) -> Result<Self, StoreError> {
        Ok(Self {
            operation_id: row.try_get("operation_id")?,
            attempt: row.try_get("attempt")?,
            started_at: row.try_get("started_at")?,
            duration_ms: row.try_get("duration_ms")?,
            status_code: row.try_get("status_code")?,
            error: row.try_get("error")?,
            response_body: row.try_get("response_body")?,
        })
    }
}
