//! The Pushary server API under `/api/v1/server`, as the SDK calls it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use axum::{Router, http::StatusCode};
use chrono::Utc;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::error::{ApiError, JsonBody, object, unauthorized};
use super::state::{Created, Status};
use super::validate::{check_external_id, parse_create, string};
use super::{CallbackMode, MAX_WAIT, Shared, answer_decision};

type ApiResult = Result<Json<Value>, ApiError>;

pub(super) fn router(shared: Arc<Shared>) -> Router<Arc<Shared>> {
    Router::new()
        .route("/decisions", post(create))
        .route("/decisions/{id}", get(fetch).post(answer).delete(cancel))
        .route("/webhook-secret", get(webhook_secret).post(rotate_webhook_secret))
        .route("/enroll", post(enroll))
        .route("/authorizations/consume", post(consume))
        .route("/authorizations/{permit_id}/receipt", post(receipt))
        .route("/authorize", post(authorize))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not found", "No such API route.") })
        // `layer`, not `route_layer`: unknown paths need the key too, so the
        // API reveals nothing without it.
        .layer(middleware::from_fn_with_state(shared, require_api_key))
}

async fn require_api_key(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        None | Some("") => unauthorized("missing API key: send Authorization: Bearer <api key>"),
        // Comparing digests keeps the comparison time independent of where
        // the presented key first differs.
        Some(key) if Sha256::digest(key) != Sha256::digest(&shared.api_key) => {
            unauthorized("invalid API key")
        }
        Some(_) => match shared.take_api_failure() {
            Some(status) => ApiError::new(
                StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                "injected failure",
                "The sandbox was told to fail this call.",
            )
            .into_response(),
            None => next.run(request).await,
        },
    }
}

/// Blocks until the decision leaves `pending` (answer, cancel or expiry),
/// `max` passes, or the sandbox shuts down.
async fn wait_settled(shared: &Shared, id: &str, max: Duration) {
    shared
        .wait_until(max, |s, now| match s.decision(id) {
            Some(d) if d.status(now) == Status::Pending => Err(Some(d.expires_at)),
            _ => Ok(()),
        })
        .await;
}

async fn create(State(shared): State<Arc<Shared>>, JsonBody(body): JsonBody) -> ApiResult {
    let request = parse_create(object(body)?)?;
    let wait = request
        .wait
        .then(|| request.timeout_seconds.map_or(MAX_WAIT, |s| Duration::from_secs(s).min(MAX_WAIT)));
    let created =
        shared.mutate(|s| s.create(request, &shared.public_url, &shared.unreachable_prefix, Utc::now()))?;
    let id = match created {
        Created::Replay(response) => return Ok(Json(response)),
        Created::New(id) => id,
    };
    if let Some(max) = wait {
        wait_settled(&shared, &id, max).await;
    }
    let now = Utc::now();
    let state = shared.lock();
    let decision = state.decision(&id).ok_or_else(|| ApiError::not_found("decision"))?;
    let mut response = decision.create_json(&shared.public_url, now);
    if wait.is_some()
        && decision.status(now) == Status::Pending
        && let Some(map) = response.as_object_mut()
    {
        map.insert(
            "hint".into(),
            json!("Nobody answered within the wait window; poll pollUrl or wait for the callback."),
        );
    }
    Ok(Json(response))
}

async fn fetch(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> ApiResult {
    let wait = match query.get("wait") {
        None => None,
        Some(raw) => {
            let seconds: u64 =
                raw.parse().map_err(|_| ApiError::bad_request("wait must be a whole number of seconds"))?;
            Some(Duration::from_secs(seconds).min(MAX_WAIT))
        }
    };
    if shared.lock().decision(&id).is_none() {
        return Err(ApiError::not_found("decision"));
    }
    if let Some(max) = wait.filter(|w| !w.is_zero()) {
        wait_settled(&shared, &id, max).await;
    }
    let state = shared.lock();
    let decision = state.decision(&id).ok_or_else(|| ApiError::not_found("decision"))?;
    Ok(Json(decision.json(Utc::now())))
}

async fn answer(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    JsonBody(body): JsonBody,
) -> ApiResult {
    let body = object(body)?;
    let answer = string(&body, "answer")?.ok_or_else(|| ApiError::invalid("answer is required"))?;
    answer_decision(&shared, &id, &answer, "api", CallbackMode::Send).map(Json)
}

async fn cancel(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> ApiResult {
    shared.mutate(|s| s.cancel(&id, Utc::now())).map(Json)
}

async fn webhook_secret(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({"secret": shared.lock().webhook_secret}))
}

async fn rotate_webhook_secret(State(shared): State<Arc<Shared>>) -> Json<Value> {
    Json(json!({"secret": shared.mutate(|s| s.rotate_webhook_secret())}))
}

async fn enroll(State(shared): State<Arc<Shared>>, JsonBody(body): JsonBody) -> ApiResult {
    let body = object(body)?;
    let external_id =
        string(&body, "externalId")?.ok_or_else(|| ApiError::invalid("externalId is required"))?;
    check_external_id(&external_id)?;
    Ok(Json(shared.mutate(|s| s.enroll(external_id, &shared.public_url, Utc::now()))))
}

async fn consume(State(shared): State<Arc<Shared>>, JsonBody(body): JsonBody) -> ApiResult {
    let body = object(body)?;
    let result = shared.mutate(|s| s.consume(&body, shared.permit_ttl, Utc::now()));
    if let Some(delay) = shared.take_consume_delay() {
        // Consumed (or refused) already; only the answer is late.
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shared.shutdown.cancelled() => {}
        }
    }
    result.map(Json)
}

async fn receipt(
    State(shared): State<Arc<Shared>>,
    Path(permit_id): Path<String>,
    JsonBody(body): JsonBody,
) -> ApiResult {
    let body = object(body)?;
    shared.mutate(|s| s.receipt(&permit_id, &body, Utc::now())).map(Json)
}

/// The sandbox has no policy rules, and only a rule that names an action can
/// allow or deny it, so every evaluation sends the action to a person.
async fn authorize(JsonBody(body): JsonBody) -> ApiResult {
    let body = object(body)?;
    if string(&body, "toolName")?.is_none_or(|t| t.trim().is_empty()) {
        return Err(ApiError::invalid("toolName is required"));
    }
    Ok(Json(json!({
        "verdict": "requires_human",
        "policy": null,
        "reason": "No policy rule names this action, so a person decides.",
        "authorizationId": null,
    })))
}
