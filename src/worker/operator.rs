//! What people do to operations: the application cancels one (at Pushary
//! too); an operator resolves one whose outcome is `uncertain`.

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
            let Some(mut op) = self.store.get_operation(Some(tenant), id).await? else {
                return Err(match archived_state(&self.store, Some(tenant), id).await? {
                    Some(state) => CancelError::NotCancellable(state),
                    None => CancelError::NotFound,
                });
            };
            match op.state {
                State::Enqueued => {}
                State::Pending => {
                    let decision = op.decision_id.clone().unwrap_or_default();
                    let clock = super::steps::CallClock::start();
                    let cancelled = match self.pushary(&op.tenant) {
                        Ok(p) => p.cancel_decision(&decision).await,
                        Err(e) => Err(e),
                    };
                    clock.note(&mut op, "cancel_decision", &cancelled);
                    match cancelled {
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
                self.offer_thread_of(&op);
                return Ok(op);
            }
        }
        Err(CancelError::Store(StoreError::Unavailable("the operation kept changing; retry".into())))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no operation with that id")]
    NotFound,
    #[error("only an uncertain operation can be resolved; this one is {0}")]
    NotUncertain(State),
    #[error("outcome must be `succeeded` or `failed`")]
    BadOutcome,
    #[error("a note saying why is required")]
    NoNote,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Engine {
    pub async fn resolve(
        &self,
        tenant: Option<&str>,
        id: &str,
        outcome: &str,
        note: &str,
        by: &str,
    ) -> Result<Operation, ResolveError> {
        let op = resolve(&self.store, tenant, id, outcome, note, by).await?;
        self.offer_thread_of(&op);
        Ok(op)
    }
}

/// An operator states how an `uncertain` operation really ended. The
/// transition records who and why; a spent permit gets its receipt, which a
/// running worker records at Pushary. Works on the store alone, so the CLI
/// can use it with the daemon running.
pub async fn resolve(
    store: &crate::store::Store,
    tenant: Option<&str>,
    id: &str,
    outcome: &str,
    note: &str,
    by: &str,
) -> Result<Operation, ResolveError> {
    {
        let to = match outcome {
            "succeeded" => State::Succeeded,
            "failed" => State::Failed,
            _ => return Err(ResolveError::BadOutcome),
        };
        if note.trim().is_empty() {
            return Err(ResolveError::NoNote);
        }
        let Some(mut op) = store.get_operation(tenant, id).await? else {
            return Err(match archived_state(store, tenant, id).await? {
                Some(state) => ResolveError::NotUncertain(state),
                None => ResolveError::NotFound,
            });
        };
        if !op.state.operator_can_resolve(to) {
            return Err(ResolveError::NotUncertain(op.state));
        }
        let now = crate::clock::now_ms();
        let actor = format!("operator:{by}");
        let t = crate::store::Transition::new(
            Some(op.state),
            to,
            now,
            format!("resolved by {by}: {note}"),
            &actor,
        );
        op.state = to;
        op.updated_at = now;
        op.delivery = Some(if to == State::Succeeded { "done" } else { "failed" }.into());
        if op.permit_id.is_some() {
            op.receipt = Some("pending".into());
            op.receipt_outcome = Some(outcome.to_string());
            op.due_at = Some(now);
        }
        if !store.save(&mut op, &[t], None).await? {
            return Err(ResolveError::Store(StoreError::Unavailable(
                "the operation changed meanwhile; retry".into(),
            )));
        }
        Ok(op)
    }
}

/// The final state of an archived operation: finished, so neither
/// cancellable nor resolvable, and the caller should hear why.
async fn archived_state(
    store: &crate::store::Store,
    tenant: Option<&str>,
    id: &str,
) -> Result<Option<State>, StoreError> {
    Ok(store.archived_operation(tenant, id).await?.and_then(|(state, _)| state.parse().ok()))
}
