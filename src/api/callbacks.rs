//! `POST /v1/callbacks/pushary`: thin by design. Read the raw body under a
//! cap, verify the signature on those exact bytes, commit to the inbox,
//! then acknowledge. Nothing is parsed before it is verified, and no resume
//! work happens here.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use serde_json::{Value, json};

use super::{AppState, DEFAULT_TENANT, read_body};
use crate::clock::now_ms;
use crate::error::ApiError;
use crate::pushary::signature;
use crate::store::{InboxInsert, OwnedInboxEntry};

pub const SIGNATURE_HEADER: &str = "x-pushary-signature";

/// How long a tenant's secrets from the store are reused before re-reading.
const SECRET_CACHE: std::time::Duration = std::time::Duration::from_secs(2);

/// The secrets that verify a tenant's callbacks now: the configured ones
/// and those rotated in with `approvald secret rotate`, less any retired
/// (by a rotation) whose window has closed.
async fn effective_secrets(
    state: &AppState,
    tenant: &str,
    configured: &[crate::secret::Secret],
) -> Result<std::sync::Arc<[crate::secret::Secret]>, ApiError> {
    let cached = state.secret_cache.lock().unwrap_or_else(|p| p.into_inner()).get(tenant).cloned();
    if let Some((_, secrets)) = cached.filter(|(at, _)| at.elapsed() < SECRET_CACHE) {
        return Ok(secrets);
    }
    let now = now_ms();
    let stored = state.engine.store().webhook_secrets(tenant).await?;
    let open = |until: &Option<i64>| until.is_none_or(|u| u > now);
    let mut out: Vec<crate::secret::Secret> = configured
        .iter()
        .filter(|c| !stored.iter().any(|(s, until)| s == c.expose() && !open(until)))
        .cloned()
        .collect();
    for (s, until) in &stored {
        if open(until) && !out.iter().any(|o| o.expose() == s) {
            out.push(crate::secret::Secret::new(s.clone()));
        }
    }
    // Shared, not copied, by every callback until the next re-read.
    let out: std::sync::Arc<[crate::secret::Secret]> = out.into();
    state
        .secret_cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(tenant.to_string(), (std::time::Instant::now(), std::sync::Arc::clone(&out)));
    Ok(out)
}

/// `/v1/callbacks/pushary`: the default tenant's callbacks.
pub(super) async fn receive_default(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let metrics = std::sync::Arc::clone(&state.engine.metrics);
    counted(&metrics, receive(state, DEFAULT_TENANT.to_string(), headers, body).await)
}

/// `/v1/callbacks/pushary/{tenant}`: verified with that tenant's secrets only.
pub(super) async fn receive_tenant(
    State(state): State<AppState>,
    super::IdPath(tenant): super::IdPath,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let metrics = std::sync::Arc::clone(&state.engine.metrics);
    counted(&metrics, receive(state, tenant, headers, body).await)
}

/// Counts a callback's result: accepted (stored or duplicate) or refused,
/// by the error code it was answered with.
fn counted(
    metrics: &crate::metrics::Metrics,
    result: Result<Json<Value>, ApiError>,
) -> Result<Json<Value>, ApiError> {
    match &result {
        Ok(Json(v)) => {
            let status = v.get("status").and_then(Value::as_str).unwrap_or("stored");
            metrics.inc("approvald_callbacks_accepted_total", &[("result", status)]);
        }
        Err(e) => metrics.inc("approvald_callbacks_rejected_total", &[("reason", e.code())]),
    }
    result
}

async fn receive(
    state: AppState,
    tenant: String,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    // Taken before any work and held until the answer is sent; none left
    // means 503, and Pushary retries.
    let _slot = state.callback_slots.try_acquire().map_err(|_| ApiError::Overloaded)?;
    let Some(configured) = state.webhook_secrets.get(&tenant) else {
        return Err(ApiError::NotFound { detail: "no such callback route".into() });
    };
    let secrets = effective_secrets(&state, &tenant, configured).await?;
    let bytes = read_body(body, state.config.server.max_callback_bytes).await?;
    let sig = headers
        .get(SIGNATURE_HEADER)
        .ok_or(ApiError::Unauthorized { detail: "missing X-Pushary-Signature" })?
        .to_str()
        .map_err(|_| ApiError::Unauthorized { detail: "the signature does not verify" })?;
    if !signature::verify(secrets.iter().map(|s| s.expose()), &bytes, sig) {
        tracing::warn!(bytes = bytes.len(), "callback rejected: signature does not verify");
        return Err(ApiError::Unauthorized { detail: "the signature does not verify" });
    }
    let cb =
        crate::domain::callback::parse(&bytes).map_err(|e| ApiError::bad_request(e.code(), e.detail()))?;
    let (correlation_id, answer, answered_at) =
        (cb.correlation_id.as_str(), cb.answer.as_str(), cb.answered_at.as_deref());
    let inserted = state
        .inbox
        .insert(OwnedInboxEntry {
            tenant: tenant.clone(),
            correlation_id: correlation_id.to_string(),
            answer: answer.to_string(),
            answered_at: answered_at.map(str::to_string),
            body: bytes.to_vec(),
            source: "callback",
            received_at: now_ms(),
        })
        .await?;
    // Committed (synchronous=FULL): only now may Pushary stop retrying.
    match inserted {
        InboxInsert::Stored(id) => {
            tracing::info!(tenant, correlation_id, inbox_id = id, "callback stored");
            Ok(Json(json!({"status": "stored"})))
        }
        InboxInsert::Duplicate(id) => {
            tracing::info!(correlation_id, inbox_id = id, "duplicate callback");
            Ok(Json(json!({"status": "duplicate"})))
        }
        InboxInsert::Archived => {
            tracing::info!(correlation_id, "callback for an archived operation: a replay, ignored");
            Ok(Json(json!({"status": "duplicate"})))
        }
    }
}
