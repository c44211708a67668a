//! `POST/GET /v1/operations`, `GET/DELETE /v1/operations/{id}`.

use axum::Json;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{AppState, authorize, read_body, require_json};
use crate::clock::now_ms;
use crate::domain::keys::deterministic_key;
use crate::domain::operation::{self, FieldError, Limits, OperationSpec};
use crate::domain::state::State as OpState;
use crate::error::ApiError;
use crate::resource::{full_view, view};
use crate::store::{Inserted, Operation, OperationFilter, Transition};

pub(super) async fn enqueue(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let tenant = authorize(&state, &headers)?;
    require_json(&headers)?;
    let bytes = read_body(body, state.config.server.max_request_bytes).await?;
    let value = crate::domain::json::parse_strict(&bytes)
        .map_err(|e| ApiError::bad_request(e.code(), e.to_string()))?;
    let now = now_ms();
    let limits = Limits { max_expires_in_secs: state.config.operations.max_expires_in_secs };
    let spec = operation::parse(&value, limits, now).map_err(ApiError::Validation)?;
    if !state.engine.has_effect(tenant, &spec.effect) {
        return Err(ApiError::Validation(FieldError {
            field: "effect".into(),
            code: "unknown_effect",
            detail: format!("no effect target named `{}` is configured", spec.effect),
        }));
    }
    let op = new_operation(&state, tenant, spec, now);
    let first = Transition::new(None, OpState::Enqueued, now, "enqueued by the application", "api");
    match state.engine.store().insert_operation(&op, &first).await? {
        Inserted::Created => {
            tracing::info!(operation_id = %op.id, thread_id = %op.thread_id, "operation enqueued");
            state.engine.offer_thread_of(&op);
            Ok((StatusCode::CREATED, Json(view(&op, &[first], None))))
        }
        Inserted::Existing(existing) if existing.fingerprint == op.fingerprint => {
            let transitions = state.engine.store().transitions(&existing.id).await?;
            Ok((StatusCode::OK, Json(view(&existing, &transitions, None))))
        }
        Inserted::Archived { fingerprint, document } if fingerprint == op.fingerprint => {
            Ok((StatusCode::OK, Json(archived_document(&document)?)))
        }
        Inserted::Archived { .. } => Err(ApiError::Conflict {
            code: "operation_key_conflict",
            detail: format!(
                "operationKey `{}` belongs to an archived operation with different content; use a new key",
                op.operation_key
            ),
        }),
        Inserted::Existing(existing) => Err(ApiError::Conflict {
            code: "operation_key_conflict",
            detail: format!(
                "operationKey `{}` is already operation {} with different content; use a new key",
                existing.operation_key, existing.id
            ),
        }),
    }
}

/// Builds the operation and the exact `POST /decisions` payload it will
/// send, once, so retries resend identical content.
fn new_operation(state: &AppState, tenant: &str, spec: OperationSpec, now: i64) -> Operation {
    let deadline = match (&spec.deadline, spec.expires_in_seconds) {
        (Some(d), _) => chrono::DateTime::parse_from_rfc3339(d).map(|t| t.timestamp_millis()).unwrap_or(now),
        (None, Some(s)) => now + i64::try_from(s).unwrap_or(i64::MAX / 2_000) * 1000,
        (None, None) => {
            now + i64::try_from(state.config.operations.default_expires_in_secs).unwrap_or(3600) * 1000
        }
    };
    let fingerprint = spec.fingerprint();
    let expires_in = ((deadline - now) + 999) / 1000;
    let mut req = Map::new();
    req.insert("question".into(), json!(spec.question));
    req.insert("type".into(), json!(spec.kind));
    if let Some(o) = &spec.options {
        req.insert("options".into(), json!(o));
    }
    req.insert("externalId".into(), json!(spec.external_id));
    req.insert("callbackUrl".into(), json!(state.config.callback_url_for(tenant)));
    req.insert(
        "idempotencyKey".into(),
        json!(deterministic_key(&["approvald", tenant, &spec.operation_key, &fingerprint])),
    );
    let optional: [(&str, Option<Value>); 9] = [
        ("context", spec.context.clone().map(Value::from)),
        ("agentName", spec.agent_name.clone().map(Value::from)),
        ("placeholder", spec.placeholder.clone().map(Value::from)),
        ("toolName", spec.subject.tool_name.clone().map(Value::from)),
        ("toolTarget", spec.subject.tool_target.clone().map(Value::from)),
        ("actor", spec.subject.actor.clone().map(Value::from)),
        ("environment", spec.subject.environment.clone().map(Value::from)),
        ("parameters", spec.subject.parameters.clone().map(Value::Object)),
        ("presentation", spec.presentation.clone().map(Value::Object)),
    ];
    for (k, v) in optional {
        if let Some(v) = v {
            req.insert(k.into(), v);
        }
    }
    req.insert("expiresInSeconds".into(), json!(expires_in.max(1)));
    if state.config.pushary.require_reachable {
        req.insert("requireReachable".into(), json!(true));
    }
    req.insert("wait".into(), json!(false));
    Operation {
        id: format!("op_{:012x}{:014x}", now, rand::random::<u64>() >> 8),
        tenant: tenant.to_string(),
        operation_key: spec.operation_key.clone(),
        fingerprint,
        thread_id: spec.thread_id.clone(),
        interrupt_id: spec.interrupt_id.clone(),
        effect: spec.effect.clone(),
        decision_type: spec.decision_type(),
        idempotency_key: deterministic_key(&["approvald-effect", tenant, &spec.operation_key]),
        spec,
        decision_request: Value::Object(req),
        state: OpState::Enqueued,
        decision_id: None,
        answer: None,
        permit_id: None,
        delivery: None,
        outcome_status: None,
        result: None,
        receipt: None,
        receipt_outcome: None,
        consume_inflight: false,
        consume_attempts: 0,
        delivery_inflight: false,
        attempts: 0,
        last_error: None,
        due_at: Some(now),
        deadline,
        poll_at: None,
        resume_seq: None,
        opened_at: None,
        created_at: now,
        updated_at: now,
        version: 0,
        unrecorded_delivery: None,
        unrecorded_calls: Vec::new(),
    }
}

pub(super) async fn show(
    State(state): State<AppState>,
    headers: HeaderMap,
    super::IdPath(id): super::IdPath,
) -> Result<Json<Value>, ApiError> {
    let tenant = authorize(&state, &headers)?;
    let store = state.engine.store();
    let Some(op) = store.get_operation(Some(tenant), &id).await? else {
        return match store.archived_operation(Some(tenant), &id).await? {
            Some((_, document)) => Ok(Json(archived_document(&document)?)),
            None => Err(ApiError::not_found("operation")),
        };
    };
    let transitions = store.transitions(&op.id).await?;
    let deliveries = store.deliveries(&op.id).await?;
    Ok(Json(full_view(&op, &transitions, &deliveries)))
}

/// The resource as it was archived (with `archivedAt`).
fn archived_document(document: &str) -> Result<Value, ApiError> {
    serde_json::from_str(document).map_err(|e| {
        ApiError::Store(crate::store::StoreError::Corrupt(format!("archived operation document: {e}")))
    })
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct ListQuery {
    state: Option<String>,
    thread_id: Option<String>,
    limit: Option<i64>,
}

pub(super) async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let tenant = authorize(&state, &headers)?;
    let Query(q) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let st = q
        .state
        .as_deref()
        .map(str::parse::<OpState>)
        .transpose()
        .map_err(|e| ApiError::bad_request("invalid_query", format!("state: {e}")))?;
    if q.thread_id.as_deref().is_some_and(|t| t.contains('\0')) {
        return Err(ApiError::bad_request("invalid_query", "threadId must not contain NUL"));
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("invalid_query", "limit must be between 1 and 1000"));
    }
    let filter = OperationFilter { tenant: Some(tenant.into()), state: st, thread_id: q.thread_id, limit };
    let ops = state.engine.store().list_operations(&filter).await?;
    Ok(Json(json!({ "operations": ops.iter().map(|o| view(o, &[], None)).collect::<Vec<_>>() })))
}

pub(super) async fn cancel(
    State(state): State<AppState>,
    headers: HeaderMap,
    super::IdPath(id): super::IdPath,
) -> Result<Json<Value>, ApiError> {
    let tenant = authorize(&state, &headers)?;
    let op = state.engine.cancel(tenant, &id, "api").await?;
    let transitions = state.engine.store().transitions(&op.id).await?;
    Ok(Json(view(&op, &transitions, None)))
}
