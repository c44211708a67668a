//! Callback delivery, as Pushary does it: a signed POST to the decision's
//! `callbackUrl`, retried with exponential backoff until a 2xx, at most
//! `IN_FLIGHT` at once.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::views::CallbackState;
use super::{Shared, iso};
use crate::pushary::signature::sign;

const MAX_ATTEMPTS: usize = 50;
const FIRST_DELAY: Duration = Duration::from_millis(200);
const MAX_DELAY: Duration = Duration::from_secs(30);

/// The most callbacks sent at once, to all receivers together, over as
/// many kept-alive connections: a webhook sender bounds what it has in
/// flight. Without a bound, a burst of answers (the bench answers
/// thousands at once) opened a connection per callback, and their set-ups
/// held up the sandbox's own API (the permit consumes) for half a second.
pub(super) const IN_FLIGHT: usize = 64;

#[derive(Debug)]
pub(super) struct CallbackJob {
    pub decision_id: String,
    pub url: String,
    pub body: Vec<u8>,
}

// Field order is the wire order: the body is signed as bytes, and receivers
// (and the shared test vectors) see exactly this serialization.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CallbackBody<'a> {
    correlation_id: &'a str,
    answer: &'a str,
    value: &'a str,
    answered_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    context: Option<&'a str>,
}

/// The exact callback body: compact JSON, `context` only when one was given.
pub(super) fn body(
    decision_id: &str,
    answer: &str,
    answered_at: DateTime<Utc>,
    context: Option<&str>,
) -> Vec<u8> {
    let body = CallbackBody {
        correlation_id: decision_id,
        answer,
        value: answer,
        answered_at: iso(answered_at),
        context,
    };
    serde_json::to_vec(&body).expect("a struct of strings always serializes")
}

pub(super) fn spawn(shared: Arc<Shared>, job: CallbackJob) {
    tokio::spawn(deliver(shared, job));
}

async fn deliver(shared: Arc<Shared>, job: CallbackJob) {
    let mut delays = ExponentialBuilder::default()
        .with_min_delay(FIRST_DELAY)
        .with_max_delay(MAX_DELAY)
        .with_factor(2.0)
        .with_max_times(MAX_ATTEMPTS - 1)
        .build();
    loop {
        let sent = async {
            shared.callbacks_queued.fetch_add(1, Ordering::Relaxed);
            let slot = shared.callback_slots.acquire().await;
            shared.callbacks_queued.fetch_sub(1, Ordering::Relaxed);
            let _slot = slot.expect("the semaphore is never closed");
            // Read per attempt, once it may be sent: after a rotation even
            // retries of older callbacks, and those that waited for a slot,
            // carry the new secret, and the old one stops verifying at once.
            let secret = shared.lock().webhook_secret.clone();
            let signature = sign(&secret, &job.body);
            shared
                .http
                .post(&job.url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header("X-Pushary-Signature", signature)
                .body(job.body.clone())
                .send()
                .await
        }
        .await;
        let outcome = match &sent {
            Ok(response) => Ok(response.status().as_u16()),
            Err(error) => Err(error.to_string()),
        };
        let delivered = matches!(outcome, Ok(status) if (200..300).contains(&status));
        let next_delay = if delivered { None } else { delays.next() };
        record_attempt(&shared, &job.decision_id, outcome, delivered, next_delay.is_none());
        let Some(delay) = next_delay else {
            if !delivered {
                tracing::warn!(decision = %job.decision_id, "sandbox callback gave up after {MAX_ATTEMPTS} attempts");
            }
            return;
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shared.shutdown.cancelled() => {
                shared.mutate(|s| {
                    if let Some(d) = s.decisions.get_mut(&job.decision_id) {
                        d.callback.state = CallbackState::Stopped;
                    }
                });
                return;
            }
        }
    }
}

fn record_attempt(
    shared: &Shared,
    decision_id: &str,
    outcome: Result<u16, String>,
    delivered: bool,
    last: bool,
) {
    shared.mutate(|s| {
        let Some(decision) = s.decisions.get_mut(decision_id) else {
            return;
        };
        let callback = &mut decision.callback;
        callback.attempts += 1;
        match outcome {
            Ok(status) => {
                callback.last_status = Some(status);
                callback.last_error = None;
            }
            Err(error) => {
                callback.last_status = None;
                callback.last_error = Some(error);
            }
        }
        if delivered {
            callback.state = CallbackState::Delivered;
            callback.delivered_at = Some(iso(Utc::now()));
        } else if last {
            callback.state = CallbackState::GaveUp;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    // The shared vector `answered-no-with-context` from vectors/pushary.json.
    #[test]
    fn body_matches_the_vector_bytes() {
        let at =
            DateTime::parse_from_rfc3339("2026-11-29T09:01:00Z").expect("valid time").with_timezone(&Utc);
        let bytes = body("dec_01HZX4", "no", at, Some("thread=t-42"));
        assert_eq!(
            String::from_utf8(bytes.clone()).expect("utf-8"),
            r#"{"correlationId":"dec_01HZX4","answer":"no","value":"no","answeredAt":"2026-11-29T09:01:00.000Z","context":"thread=t-42"}"#
        );
        assert_eq!(
            sign("whsec_test_1", &bytes),
            "893dba1b69b9cb17ce24cc3a9439def241716162faae387bf056dde0a67773cd"
        );
        let without = body("dec_01HZX3", "yes", at, None);
        assert!(!String::from_utf8_lossy(&without).contains("context"));
    }
}
