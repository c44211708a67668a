//! Periodic sweeps: decisions past their local deadline are cancelled and
//! expired; decisions pending too long without a callback are polled, and
//! an answer found there enters the inbox like a callback.

use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::Engine;
use super::steps::reject;
use crate::clock::now_ms;
use crate::domain::state::State;
use crate::pushary::PusharyError;
use crate::store::{InboxInsert, NewInboxEntry, Operation, StoreError};

const ACTOR: &str = "reconciler";
const BATCH: i64 = 100;
const ARCHIVE_BATCH: i64 = 500;

/// What one sweep did, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Sweep {
    pub expired: usize,
    pub polled: usize,
    pub answers_found: usize,
    pub ended_remotely: usize,
    pub orphaned: u64,
    pub archived: usize,
}

impl Engine {
    pub(crate) async fn reconciler_loop(&self, shutdown: CancellationToken) {
        let mut failures = 0;
        loop {
            let wait = match self.reconcile_once().await {
                Ok(s) => {
                    failures = 0;
                    if s != Sweep::default() {
                        tracing::info!(?s, "reconciler sweep");
                    }
                    self.settings.reconcile_every
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "reconciler cannot reach the store");
                    // What it did before failing (an operation expired, an
                    // answer found) waits for the workers: tell them.
                    self.wake();
                    Duration::from_millis(u64::try_from(self.backoff_ms(failures)).unwrap_or(1000))
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One sweep of every kind. Public so tests can run one without waiting.
    pub async fn reconcile_once(&self) -> Result<Sweep, StoreError> {
        let mut sweep = Sweep::default();
        let now = now_ms();
        for op in self.store.pending_past_deadline(now, BATCH).await? {
            if self.expire(op).await? {
                sweep.expired += 1;
            }
        }
        for op in self.store.polls_due(now_ms(), BATCH).await? {
            sweep.polled += 1;
            match self.poll(op).await? {
                Polled::Answer => sweep.answers_found += 1,
                Polled::Ended => sweep.ended_remotely += 1,
                Polled::Nothing => {}
            }
        }
        sweep.orphaned = self.store.orphan_unmatched(now - self.settings.orphan_after_ms, now).await?;
        if sweep.orphaned > 0 {
            tracing::warn!(count = sweep.orphaned, "callbacks that match no operation marked orphaned");
        }
        if let Some(after) = self.settings.archive_after_ms {
            sweep.archived = self.archive_finished(now - after, now).await?;
        }
        if sweep.expired + sweep.answers_found + sweep.ended_remotely > 0 {
            self.wake();
        }
        let m = &self.metrics;
        m.inc("approvald_reconciler_sweeps_total", &[]);
        for (kind, n) in [
            ("expired", sweep.expired as u64),
            ("polled", sweep.polled as u64),
            ("answers_found", sweep.answers_found as u64),
            ("ended_remotely", sweep.ended_remotely as u64),
            ("orphaned", sweep.orphaned),
            ("archived", sweep.archived as u64),
        ] {
            m.add("approvald_reconciler_swept_total", &[("kind", kind)], n);
        }
        Ok(sweep)
    }

    /// Archives finished operations last changed before `before`, a batch
    /// per sweep so a large backlog never holds the store for long.
    async fn archive_finished(&self, before: i64, now: i64) -> Result<usize, StoreError> {
        // A replay racing the last sweep's archival (PostgreSQL) may have
        // entered the inbox after the archive row was committed; it is a
        // duplicate. By now its transaction has ended, so look for it.
        let previous =
            std::mem::take(&mut *self.archived_last_sweep.lock().unwrap_or_else(|p| p.into_inner()));
        if !previous.is_empty() {
            self.store.drop_archived_replays(&previous).await?;
        }
        let mut decisions = Vec::new();
        let mut archived = 0;
        for op in self.store.archivable(before, ARCHIVE_BATCH).await? {
            let transitions = self.store.transitions(&op.id).await?;
            let deliveries = self.store.deliveries(&op.id).await?;
            let mut document = crate::resource::full_view(&op, &transitions, &deliveries);
            document["archivedAt"] = json!(crate::clock::rfc3339(now));
            if self.store.archive(&op, &document.to_string(), now).await? {
                archived += 1;
                decisions.extend(op.decision_id.clone().map(|d| (op.tenant.clone(), d)));
            }
        }
        *self.archived_last_sweep.lock().unwrap_or_else(|p| p.into_inner()) = decisions;
        Ok(archived)
    }

    /// pending → expired: cancel the decision at Pushary, then expire.
    async fn expire(&self, mut op: Operation) -> Result<bool, StoreError> {
        let mut cause = "the local deadline passed without an answer".to_string();
        if let Some(id) = op.decision_id.clone() {
            let clock = super::steps::CallClock::start();
            let cancelled = match self.pushary(&op.tenant) {
                Ok(p) => p.cancel_decision(&id).await,
                Err(e) => Err(e),
            };
            clock.note(&mut op, "cancel_decision", &cancelled);
            match cancelled {
                Ok(_) => cause.push_str("; decision cancelled at Pushary"),
                Err(e) if e.is_retryable() => {
                    // Still expire: the effect must never run after the
                    // deadline, and the worker checks it before any consume.
                    tracing::warn!(operation_id = %op.id, error = %e, "cancel at Pushary failed");
                    cause.push_str(&format!("; cancel at Pushary failed: {e}"));
                }
                Err(e) => cause.push_str(&format!("; Pushary answered the cancel with: {e}")),
            }
        }
        op.poll_at = None;
        let t = reject(&mut op, State::Expired, cause, ACTOR);
        self.store.save(&mut op, &[t], None).await
    }

    async fn poll(&self, mut op: Operation) -> Result<Polled, StoreError> {
        let Some(id) = op.decision_id.clone() else { return Ok(Polled::Nothing) };
        let next_poll = now_ms() + self.settings.poll_after_ms;
        let clock = super::steps::CallClock::start();
        let polled = match self.pushary(&op.tenant) {
            Ok(p) => p.get_decision(&id, None).await,
            Err(e) => Err(e),
        };
        clock.note(&mut op, "get_decision", &polled);
        match polled {
            Ok(d) if d.status == "answered" => {
                let answer = d.value.unwrap_or_default();
                // Shaped like a callback body so the inbox holds one kind of record.
                let body = json!({"correlationId": id, "answer": answer, "value": answer,
                                  "answeredAt": d.answered_at, "source": "poll"});
                let bytes = serde_json::to_vec(&body).expect("a Value always serializes");
                let inserted = self
                    .store
                    .insert_inbox(&NewInboxEntry {
                        tenant: &op.tenant,
                        correlation_id: &id,
                        answer: &answer,
                        answered_at: d.answered_at.as_deref(),
                        body: &bytes,
                        source: "poll",
                        received_at: now_ms(),
                    })
                    .await?;
                op.poll_at = None;
                op.updated_at = now_ms();
                self.store.save(&mut op, &[], None).await?;
                tracing::info!(operation_id = %op.id, correlation_id = %id, missed_callback = matches!(inserted, InboxInsert::Stored(_)), "poll found an answer");
                Ok(Polled::Answer)
            }
            Ok(d) if d.status == "expired" || d.status == "cancelled" => {
                let to = if d.status == "expired" { State::Expired } else { State::Cancelled };
                op.poll_at = None;
                let t = reject(&mut op, to, format!("Pushary reports the decision {}", d.status), ACTOR);
                self.store.save(&mut op, &[t], None).await?;
                Ok(Polled::Ended)
            }
            Ok(_) => {
                op.poll_at = Some(next_poll);
                op.updated_at = now_ms();
                self.store.save(&mut op, &[], None).await?;
                Ok(Polled::Nothing)
            }
            Err(e) => {
                let retry = if matches!(e, PusharyError::Status { status: 404, .. }) {
                    next_poll
                } else {
                    now_ms() + self.backoff_ms(op.attempts + 1)
                };
                tracing::warn!(operation_id = %op.id, error = %e, "poll failed");
                op.poll_at = Some(retry.max(now_ms() + 1000));
                op.updated_at = now_ms();
                self.store.save(&mut op, &[], None).await?;
                Ok(Polled::Nothing)
            }
        }
    }
}

enum Polled {
    Answer,
    Ended,
    Nothing,
}
