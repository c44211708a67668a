//! The example effect target: what an application's endpoint should do with
//! approvald's deliveries. It verifies the Standard Webhooks signature,
//! requires an `Idempotency-Key`, executes the first delivery per key, and
//! answers repeats with the stored result without executing again.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::post;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Shared, iso};
use crate::webhooks::verify;

/// Headers a developer looking at a delivery wants to see.
const HEADERS_OF_INTEREST: [&str; 6] =
    ["idempotency-key", "webhook-id", "webhook-timestamp", "webhook-signature", "content-type", "user-agent"];

#[derive(Default)]
pub(crate) struct EffectState {
    pub deliveries: Vec<EffectDeliveryView>,
    results: HashMap<String, Executed>,
    /// `(status, remaining)`: answer this many deliveries with this status.
    forced: Option<(u16, usize)>,
    /// How long each delivery takes before it is answered, so tests can see
    /// whether two executions overlap in time.
    pub work: std::time::Duration,
}

struct Executed {
    result: Value,
    executions: usize,
}

/// One delivery the example effect target received.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EffectDeliveryView {
    pub seq: usize,
    pub received_at: String,
    /// The `{name}` of `/sandbox/effect/{name}`, if one was used.
    pub target: Option<String>,
    /// The status the target answered.
    pub status: u16,
    /// The Standard Webhooks signature verified (always false without a secret).
    pub verified: bool,
    /// This delivery ran the effect.
    pub executed: bool,
    /// This delivery repeated a key that had already executed.
    pub replay: bool,
    pub idempotency_key: Option<String>,
    pub headers: BTreeMap<String, String>,
    /// The JSON body, or the raw text if it was not JSON.
    pub body: Value,
    /// Executions for this key so far, this delivery included.
    pub executions: usize,
    pub error: Option<String>,
    /// When the target began and finished handling it (Unix microseconds).
    pub started_us: i64,
    pub finished_us: i64,
}

impl EffectState {
    pub fn executions(&self, key: &str) -> usize {
        self.results.get(key).map_or(0, |e| e.executions)
    }

    pub fn set_override(&mut self, status: u16, count: usize) {
        self.forced = (count > 0).then_some((status, count));
    }

    fn take_forced(&mut self) -> Option<u16> {
        let (status, remaining) = self.forced.as_mut()?;
        let status = *status;
        *remaining -= 1;
        if *remaining == 0 {
            self.forced = None;
        }
        Some(status)
    }
}

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new().route("/sandbox/effect", post(receive)).route("/sandbox/effect/{name}", post(receive_named))
}

async fn receive(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let started = work(&shared).await;
    handle(&shared, None, &headers, &body, started)
}

/// Spends the configured work time (outside the state lock); returns when it began.
async fn work(shared: &Shared) -> i64 {
    let started = Utc::now().timestamp_micros();
    let work = shared.lock().effect.work;
    if !work.is_zero() {
        tokio::time::sleep(work).await;
    }
    started
}

async fn receive_named(
    State(shared): State<Arc<Shared>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = work(&shared).await;
    handle(&shared, Some(name), &headers, &body, started)
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// `Ok(verified)`, or why the delivery must be rejected.
fn check_signature(key: Option<&[u8]>, headers: &HeaderMap, body: &[u8]) -> Result<bool, String> {
    let Some(key) = key else {
        return Ok(false);
    };
    let (Some(id), Some(timestamp), Some(signature)) = (
        header(headers, "webhook-id"),
        header(headers, "webhook-timestamp"),
        header(headers, "webhook-signature"),
    ) else {
        return Err("missing webhook-id, webhook-timestamp or webhook-signature".to_string());
    };
    verify(key, &id, &timestamp, &signature, body, Utc::now().timestamp())
        .map(|()| true)
        .map_err(|e| format!("signature rejected: {e:?}"))
}

fn handle(
    shared: &Shared,
    target: Option<String>,
    headers: &HeaderMap,
    raw: &[u8],
    started_us: i64,
) -> Response {
    let signature = check_signature(shared.effect_key.as_deref(), headers, raw);
    let idempotency_key = header(headers, "idempotency-key").filter(|k| !k.is_empty());
    let parsed: Option<Value> = serde_json::from_slice(raw).ok();
    let interesting: BTreeMap<String, String> =
        HEADERS_OF_INTEREST.iter().filter_map(|&h| header(headers, h).map(|v| (h.to_string(), v))).collect();

    let (status, response) = shared.mutate(|s| {
        let effect = &mut s.effect;
        let mut delivery = EffectDeliveryView {
            seq: effect.deliveries.len() + 1,
            received_at: iso(Utc::now()),
            target,
            status: 200,
            verified: matches!(signature, Ok(true)),
            executed: false,
            replay: false,
            idempotency_key: idempotency_key.clone(),
            headers: interesting,
            body: parsed.clone().unwrap_or_else(|| Value::String(String::from_utf8_lossy(raw).into_owned())),
            executions: 0,
            error: None,
            started_us,
            finished_us: Utc::now().timestamp_micros(),
        };
        // The forced status comes first: it stands for the application being
        // down, which happens before any checking.
        let outcome = if let Some(status) = effect.take_forced() {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err((status, "forced by the sandbox".to_string()))
        } else if let Err(reason) = &signature {
            Err((StatusCode::UNAUTHORIZED, reason.clone()))
        } else if parsed.is_none() {
            Err((StatusCode::BAD_REQUEST, "the body is not JSON".to_string()))
        } else if let Some(key) = &idempotency_key {
            let replay = effect.results.contains_key(key);
            let executed = effect.results.entry(key.clone()).or_insert_with(|| Executed {
                result: json!({"executed": true, "idempotencyKey": key}),
                executions: 1,
            });
            delivery.executed = !replay;
            delivery.replay = replay;
            delivery.executions = executed.executions;
            Ok(executed.result.clone())
        } else {
            Err((StatusCode::BAD_REQUEST, "the Idempotency-Key header is required".to_string()))
        };
        let (status, response) = match outcome {
            Ok(result) => (StatusCode::OK, result),
            Err((status, error)) => {
                delivery.error = Some(error.clone());
                delivery.executions = idempotency_key.as_deref().map_or(0, |k| effect.executions(k));
                (status, json!({"error": error}))
            }
        };
        delivery.status = status.as_u16();
        effect.deliveries.push(delivery);
        (status, response)
    });
    (status, Json(response)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_responses_count_down() {
        let mut e = EffectState::default();
        e.set_override(503, 2);
        assert_eq!(e.take_forced(), Some(503));
        assert_eq!(e.take_forced(), Some(503));
        assert_eq!(e.take_forced(), None);
        e.set_override(500, 0);
        assert_eq!(e.take_forced(), None);
    }
}
