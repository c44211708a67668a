//! Cancelling an operation on the application's request, at Pushary too.

use super::Engine;
use super::steps::reject;
use crate::domain::state::State;
use crate::pushary::PusharyError;
use crate::store::{Operation, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    #[error("no operation with that id")]
    NotFound,
    #[error("the operation is {0} and can no longer be cancelled")]
    NotCancellable(State),
    #[error("the decision was already answered at Pushary; its answer will be processed")]
    AlreadyAnswered,
    #[error("Pushary could not cancel the decision: {0}")]
    Pushary(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Engine {
    pub async fn cancel(&self, tenant: &str, id: &str, actor: &str) -> Result<Operation, CancelError> {
        // A worker may move the operation between our read and write; the
        // version check makes us read again instead of overwriting it.
        for _ in 0..5 {
            let mut op = self.store.get_operation(Some(tenant), id).await?.ok_or(CancelError::NotFound)?;
            match op.state {
                State::Enqueued => {}
                State::Pending => {
                    let decision = op.decision_id.clone().unwrap_or_default();
                    match self.pushary.cancel_decision(&decision).await {
                        Ok(resp) => {
                            let cancelled = resp.get("cancelled").and_then(serde_json::Value::as_bool);
                            let status = resp.get("status").and_then(serde_json::Value::as_str);
                            if cancelled == Some(false) && status == Some("answered") {
                                return Err(CancelError::AlreadyAnswered);
                            }
                        }
                        // Pushary no longer knows it: nothing left to cancel there.
                        Err(PusharyError::Status { status: 404, .. }) => {}
                        Err(e) => return Err(CancelError::Pushary(e.to_string())),
                    }
                }
                other => return Err(CancelError::NotCancellable(other)),
            }
            op.poll_at = None;
            let t = reject(&mut op, State::Cancelled, format!("cancelled by {actor}"), actor);
            if self.store.save(&mut op, &[t], None).await? {
                self.wake();
                return Ok(op);
            }
        }
        Err(CancelError::Store(StoreError::Unavailable("the operation kept changing; retry".into())))
    }
}
