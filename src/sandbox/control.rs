//! `/sandbox/api/`: inspection and fault injection over HTTP, mirroring the
//! `SandboxHandle` methods for tests that run the sandbox in a child process.
//! No authentication: this is a local development tool.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::response::Json;
use axum::routing::{get, post};
use chrono::Utc;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::{ApiError, JsonBody};
use super::{CallbackMode, DecisionView, EffectDeliveryView, Refusal, Shared, answer_decision};

type ApiResult = Result<Json<Value>, ApiError>;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/info", get(info))
        .route("/decisions", get(decisions))
        .route("/decisions/{id}", get(decision))
        .route("/decisions/{id}/answer", post(answer))
        .route("/decisions/{id}/consume-refusal", post(consume_refusal))
        .route("/decisions/{id}/consume-calls", get(consume_calls))
        .route("/receipts/{permit_id}", get(receipt))
        .route("/effect/deliveries", get(effect_deliveries))
        .route("/effect/executions/{key}", get(effect_executions))
        .route("/effect/response", post(effect_response))
        .route("/faults/api", post(api_failure))
        .route("/faults/consume-delay", post(consume_delay))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiFailure {
    status: u16,
    count: usize,
}

async fn api_failure(State(shared): State<Arc<Shared>>, JsonBody(body): JsonBody) -> ApiResult {
    let f: ApiFailure = parse(body)?;
    if !(400..=599).contains(&f.status) {
        return Err(ApiError::bad_request("status must be an HTTP error status (400-599)"));
    }
    super::SandboxHandle::from_shared(shared).fail_next_api_calls(f.status, f.count);
    Ok(Json(json!({"status": f.status, "count": f.count})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ConsumeDelay {
    delay_ms: u64,
}

async fn consume_delay(State(shared): State<Arc<Shared>>, JsonBody(body): JsonBody) -> ApiResult {
    let d: ConsumeDelay = parse(body)?;
    super::SandboxHandle::from_shared(shared)
        .delay_next_consume_response(std::time::Duration::from_millis(d.delay_ms));
    Ok(Json(json!({"delayMs": d.delay_ms})))
}

/// Parses a control body, mapping shape errors to a 400 that names the field.
fn parse<T: for<'de> Deserialize<'de>>(body: Value) -> Result<T, ApiError> {
    let body = if body.is_null() { json!({}) } else { body };
    serde_json::from_value(body).map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

/// Where everything is, so a test that started `approvald dev` as a child
/// process can find the key and secret it needs.
async fn info(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let addr = shared.addr;
    Json(json!({
        "baseUrl": format!("http://{addr}/api/v1/server"),
        "pageUrl": format!("http://{addr}/"),
        "effectUrl": format!("http://{addr}/sandbox/effect"),
        "publicUrl": shared.public_url,
        "apiKey": shared.api_key,
        "webhookSecret": shared.lock().webhook_secret,
        "effectSecretConfigured": shared.effect_key.is_some(),
    }))
}

async fn decisions(State(shared): State<Arc<Shared>>) -> Json<Vec<DecisionView>> {
    Json(shared.lock().decision_views(Utc::now()))
}

async fn decision(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Json<DecisionView>, ApiError> {
    shared.lock().decision_view(&id, Utc::now()).map(Json).ok_or_else(|| ApiError::not_found("decision"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerRequest {
    answer: String,
    #[serde(default)]
    callback: CallbackMode,
}

async fn answer(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody,
) -> ApiResult {
    let request: AnswerRequest = parse(body)?;
    answer_decision(&shared, &id, &request.answer, "sandbox", request.callback).map(Json)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RefusalRequest {
    /// `null` or absent clears a pending forced refusal.
    refusal: Option<Refusal>,
}

async fn consume_refusal(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody,
) -> ApiResult {
    let request: RefusalRequest = parse(body)?;
    shared.mutate(|s| s.set_forced_refusal(&id, request.refusal));
    Ok(Json(json!({"decisionId": id, "refusal": request.refusal})))
}

async fn consume_calls(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Json<Value> {
    let calls = shared.lock().consume_calls(&id);
    Json(json!({"decisionId": id, "consumeCalls": calls}))
}

async fn receipt(State(shared): State<Arc<Shared>>, Path(permit_id): Path<String>) -> ApiResult {
    let receipt = shared.lock().receipt_view(&permit_id).ok_or_else(|| ApiError::not_found("receipt"))?;
    Ok(Json(json!(receipt)))
}

async fn effect_deliveries(State(shared): State<Arc<Shared>>) -> Json<Vec<EffectDeliveryView>> {
    Json(shared.lock().effect.deliveries.clone())
}

async fn effect_executions(State(shared): State<Arc<Shared>>, Path(key): Path<String>) -> Json<Value> {
    let executions = shared.lock().effect.executions(&key);
    Json(json!({"idempotencyKey": key, "executions": executions}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EffectResponseRequest {
    status: u16,
    count: usize,
}

async fn effect_response(State(shared): State<Arc<Shared>>, JsonBody(body): JsonBody) -> ApiResult {
    let request: EffectResponseRequest = parse(body)?;
    if !(100..=599).contains(&request.status) {
        return Err(ApiError::invalid("status must be an HTTP status code (100 to 599)"));
    }
    shared.mutate(|s| s.effect.set_override(request.status, request.count));
    Ok(Json(json!({"status": request.status, "count": request.count})))
}
