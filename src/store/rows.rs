//! Row types and their mapping from SQL rows.

use serde::Serialize;
use serde_json::Value;
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::StoreError;
use crate::domain::answer::DecisionType;
use crate::domain::operation::OperationSpec;
use crate::domain::state::State;

/// Reads a column; the bounds say the engine can decode it.
fn get<'r, R, T>(row: &'r R, column: &'r str) -> Result<T, StoreError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    T: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(row.try_get(column)?)
}

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
    /// A delivery attempt made but not yet recorded: the next `save` of
    /// this operation records it in its own transaction (one commit for
    /// the attempt and what it led to). Not a column.
    pub unrecorded_delivery: Option<DeliveryRecord>,
    /// Pushary calls made for it since the last save, recorded by the next.
    pub unrecorded_calls: Vec<PusharyCall>,
}

impl Operation {
    /// Still has resume work that later answers of its thread must wait for.
    pub fn unfinished(&self) -> bool {
        matches!(self.state, State::Answered | State::Permitted | State::Delivering)
            || self.delivery.as_deref() == Some("pending")
    }

    pub fn from_row<R>(row: &R) -> Result<Self, StoreError>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| StoreError::Corrupt(format!("{what}: {e}"));
        let spec: String = get(row, "spec")?;
        let request: String = get(row, "decision_request")?;
        let state: String = get(row, "state")?;
        let kind: String = get(row, "decision_type")?;
        Ok(Operation {
            id: get(row, "id")?,
            tenant: get(row, "tenant")?,
            operation_key: get(row, "operation_key")?,
            fingerprint: get(row, "fingerprint")?,
            thread_id: get(row, "thread_id")?,
            interrupt_id: get(row, "interrupt_id")?,
            effect: get(row, "effect")?,
            decision_type: DecisionType::parse(&kind).ok_or_else(|| corrupt("decision_type", &kind))?,
            spec: serde_json::from_str(&spec).map_err(|e| corrupt("spec", &e))?,
            decision_request: serde_json::from_str(&request).map_err(|e| corrupt("decision_request", &e))?,
            state: state.parse().map_err(|e: String| corrupt("state", &e))?,
            decision_id: get(row, "decision_id")?,
            answer: get(row, "answer")?,
            permit_id: get(row, "permit_id")?,
            delivery: get(row, "delivery")?,
            outcome_status: get(row, "outcome_status")?,
            idempotency_key: get(row, "idempotency_key")?,
            result: get(row, "result")?,
            receipt: get(row, "receipt")?,
            receipt_outcome: get(row, "receipt_outcome")?,
            consume_inflight: get::<_, i64>(row, "consume_inflight")? != 0,
            consume_attempts: get(row, "consume_attempts")?,
            delivery_inflight: get::<_, i64>(row, "delivery_inflight")? != 0,
            attempts: get(row, "attempts")?,
            last_error: get(row, "last_error")?,
            due_at: get(row, "due_at")?,
            deadline: get(row, "deadline")?,
            poll_at: get(row, "poll_at")?,
            resume_seq: get(row, "resume_seq")?,
            opened_at: get(row, "opened_at")?,
            created_at: get(row, "created_at")?,
            updated_at: get(row, "updated_at")?,
            version: get(row, "version")?,
            unrecorded_delivery: None,
            unrecorded_calls: Vec::new(),
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

    pub fn from_row<R>(row: &R) -> Result<Self, StoreError>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        Ok(Self {
            from: get(row, "from_state")?,
            to: get(row, "to_state")?,
            at: get(row, "at")?,
            cause: get(row, "cause")?,
            actor: get(row, "actor")?,
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
    pub fn from_row<R>(row: &R) -> Result<Self, StoreError>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        Self::from_row_prefixed(row, "")
    }

    /// The entry from columns named with `prefix`, for a query that reads
    /// them beside an operation's columns of the same names.
    pub fn from_row_prefixed<R>(row: &R, prefix: &str) -> Result<Self, StoreError>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        let col = |name: &str| format!("{prefix}{name}");
        Ok(Self {
            id: row.try_get(col("id").as_str())?,
            tenant: row.try_get(col("tenant").as_str())?,
            correlation_id: row.try_get(col("correlation_id").as_str())?,
            answer: row.try_get(col("answer").as_str())?,
            answered_at: row.try_get(col("answered_at").as_str())?,
            source: row.try_get(col("source").as_str())?,
            state: row.try_get(col("state").as_str())?,
            received_at: row.try_get(col("received_at").as_str())?,
            duplicates: row.try_get(col("duplicates").as_str())?,
            operation_id: row.try_get(col("operation_id").as_str())?,
            processed_at: row.try_get(col("processed_at").as_str())?,
            note: row.try_get(col("note").as_str())?,
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
    pub fn from_row<R>(row: &R) -> Result<Self, StoreError>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        Ok(Self {
            operation_id: get(row, "operation_id")?,
            attempt: get(row, "attempt")?,
            started_at: get(row, "started_at")?,
            duration_ms: get(row, "duration_ms")?,
            status_code: get(row, "status_code")?,
            error: get(row, "error")?,
            response_body: get(row, "response_body")?,
        })
    }
}

/// One call to Pushary made for an operation, whatever came of it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PusharyCall {
    pub operation_id: String,
    pub call: String,
    pub started_at: i64,
    pub duration_ms: i64,
    pub status_code: Option<i64>,
    pub error: Option<String>,
}

impl PusharyCall {
    pub fn from_row<R>(row: &R) -> Result<Self, StoreError>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        Ok(Self {
            operation_id: get(row, "operation_id")?,
            call: get(row, "call")?,
            started_at: get(row, "started_at")?,
            duration_ms: get(row, "duration_ms")?,
            status_code: get(row, "status_code")?,
            error: get(row, "error")?,
        })
    }
}
