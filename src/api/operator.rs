//! Operator routes: resolve an `uncertain` operation; read the inbox.

use axum::Json;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{AppState, authorize, read_body, require_json};
use crate::clock::rfc3339;
use crate::error::ApiError;
use crate::resource::view;
use crate::store::InboxEntry;

pub(super) async fn resolve(
    State(state): State<AppState>,
    headers: HeaderMap,
    super::IdPath(id): super::IdPath,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let tenant = authorize(&state, &headers)?;
    require_json(&headers)?;
    let bytes = read_body(body, 16 * 1024).await?;
    let v = crate::domain::json::parse_strict(&bytes)
        .map_err(|e| ApiError::bad_request(e.code(), e.to_string()))?;
    let field = |name: &'static str| -> Result<String, ApiError> {
        v.get(name).and_then(Value::as_str).map(str::to_string).ok_or_else(|| {
            ApiError::Validation(crate::domain::operation::FieldError {
                field: name.into(),
                code: "missing_field",
                detail: format!("`{name}` is required (a string)"),
            })
        })
    };
    let (outcome, note, by) = (field("outcome")?, field("note")?, field("by")?);
    if by.trim().is_empty() || by.len() > 128 || note.len() > 2000 {
        return Err(ApiError::bad_request(
            "out_of_bounds",
            "`by` must be 1-128 bytes and `note` at most 2000",
        ));
    }
    let op = state.engine.resolve(Some(tenant), &id, &outcome, &note, &by).await?;
    let transitions = state.engine.store().transitions(&op.id).await?;
    Ok(Json(view(&op, &transitions, None)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InboxQuery {
    state: Option<String>,
    limit: Option<i64>,
}

pub fn inbox_view(e: &InboxEntry) -> Value {
    json!({
        "id": e.id, "correlationId": e.correlation_id, "answer": e.answer, "answeredAt": e.answered_at,
        "source": e.source, "state": e.state, "receivedAt": rfc3339(e.received_at), "duplicates": e.duplicates,
        "operationId": e.operation_id, "processedAt": e.processed_at.map(rfc3339), "note": e.note,
    })
}

pub(super) async fn inbox_list(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<InboxQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let tenant = authorize(&state, &headers)?;
    let Query(q) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    if q.state.as_deref().is_some_and(|s| !matches!(s, "new" | "processed" | "ignored" | "orphaned")) {
        return Err(ApiError::bad_request(
            "invalid_query",
            "state must be new, processed, ignored or orphaned",
        ));
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("invalid_query", "limit must be between 1 and 1000"));
    }
    let entries = state.engine.store().list_inbox(q.state.as_deref(), limit).await?;
    let entries: Vec<Value> = entries.iter().filter(|e| e.tenant == tenant).map(inbox_view).collect();
    Ok(Json(json!({ "entries": entries })))
}

pub(super) async fn inbox_show(
    State(state): State<AppState>,
    headers: HeaderMap,
    super::IdPath(id): super::IdPath,
) -> Result<Json<Value>, ApiError> {
    let tenant = authorize(&state, &headers)?;
    let id: i64 = id.parse().map_err(|_| ApiError::not_found("inbox entry"))?;
    let (entry, body) = state
        .engine
        .store()
        .inbox_entry(id)
        .await?
        .filter(|(e, _)| e.tenant == tenant)
        .ok_or_else(|| ApiError::not_found("inbox entry"))?;
    let mut v = inbox_view(&entry);
    v["body"] = json!(String::from_utf8_lossy(&body));
    Ok(Json(v))
}
