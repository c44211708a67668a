//! One step of an operation, chosen by its state. Each step makes at most
//! one outside call, and records what it is about to do before a call that
//! cannot be repeated blindly (consume, an approval's delivery), so a crash
//! leaves evidence instead of a second approval.

use serde_json::{Map, Value, json};
use tracing::Instrument as _;

use super::Engine;
use crate::clock::now_ms;
use crate::domain::answer::{self, Verdict};
use crate::domain::state::{OutcomeStatus, State};
use crate::pushary::PusharyError;
use crate::store::{InboxEntry, LeaseWith, Operation, StoreError, TakeLease, Transition};

pub(crate) const ACTOR: &str = "worker";

/// Moves `op` to `to` in memory and returns the transition to record.
pub(crate) fn transition(op: &mut Operation, to: State, cause: impl Into<String>, actor: &str) -> Transition {
    debug_assert!(op.state.can_become(to), "{} -> {}", op.state, to);
    let now = now_ms();
    let t = Transition::new(Some(op.state), to, now, cause, actor);
    // The operation, thread and decision ids come from the caller's span.
    tracing::info!(from = %op.state, to = %to, cause = %t.cause, "transition");
    op.state = to;
    op.updated_at = now;
    t
}

/// Ends `op` in a fail-closed state whose outcome is delivered as a rejection.
pub(crate) fn reject(op: &mut Operation, to: State, cause: impl Into<String>, actor: &str) -> Transition {
    let t = transition(op, to, cause, actor);
    op.outcome_status = OutcomeStatus::rejection_for(to).map(|s| s.as_str().to_string());
    op.delivery = Some("pending".into());
    op.attempts = 0;
    op.due_at = Some(op.updated_at);
    if op.permit_id.is_some() && op.receipt.is_none() {
        op.receipt = Some("pending".into());
        op.receipt_outcome = Some("failed".into());
    }
    t
}

/// Times one Pushary call for the operation's timeline.
pub(crate) struct CallClock {
    started_at: i64,
    clock: std::time::Instant,
}

impl CallClock {
    pub(crate) fn start() -> Self {
        Self { started_at: now_ms(), clock: std::time::Instant::now() }
    }

    /// Notes the call on `op`; the next save of `op` records it, in the
    /// same transaction as what the call led to.
    pub(crate) fn note<T>(self, op: &mut Operation, call: &str, result: &Result<T, PusharyError>) {
        let (status_code, error) = match result {
            Ok(_) => (None, None),
            Err(e) => (e.status().map(i64::from), Some(e.to_string())),
        };
        op.unrecorded_calls.push(crate::store::PusharyCall {
            operation_id: op.id.clone(),
            call: call.to_string(),
            started_at: self.started_at,
            duration_ms: i64::try_from(self.clock.elapsed().as_millis()).unwrap_or(i64::MAX),
            status_code,
            error,
        });
    }
}

/// An answer being applied; the first save of the step it leads to
/// settles its inbox entry.
pub(crate) struct Applying<'a> {
    inbox_id: i64,
    note: &'a str,
}

/// Whether anything remains for a worker to do.
pub(crate) fn needs_work(op: &Operation) -> bool {
    matches!(op.state, State::Enqueued | State::Answered | State::Permitted | State::Delivering)
        || op.delivery.as_deref() == Some("pending")
        || op.receipt.as_deref() == Some("pending")
}

/// The span of applying `entry` to `op`: every line logged while resuming
/// carries the three ids.
pub(crate) fn resume_span(entry: &InboxEntry, op: &Operation) -> tracing::Span {
    tracing::info_span!("resume", operation_id = %op.id, thread_id = %op.thread_id,
        correlation_id = %entry.correlation_id, inbox_id = entry.id)
}

/// What the step that applies an answer does after its first save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Nothing more in this step: the save was all of it.
    Saved,
    /// Spend the permit, the attempt recorded by the save (`Engine::consume`).
    Consume { earlier_unknown: bool },
}

/// `op`, pending, as the answer `entry` leaves it, with its transition
/// and the note that settles the entry. `held_back`: an earlier answer of
/// the thread still has resume work, so this one waits for it.
pub(crate) fn answer_operation(
    entry: &InboxEntry,
    mut op: Operation,
    held_back: bool,
) -> (Operation, Transition, &'static str) {
    let now = now_ms();
    let early = op.opened_at.is_some_and(|opened| entry.received_at < opened);
    let note = if early { "early answer: arrived before the decision id was recorded" } else { "matched" };
    op.answer = Some(entry.answer.clone());
    let t = if now >= op.deadline {
        reject(
            &mut op,
            State::Expired,
            format!("answer arrived via {} after the deadline", entry.source),
            ACTOR,
        )
    } else {
        op.due_at = Some(now);
        transition(&mut op, State::Answered, format!("answer received via {}", entry.source), ACTOR)
    };
    op.poll_at = None;
    op.resume_seq = Some(entry.id);
    if held_back {
        op.due_at = None;
    }
    (op, t, note)
}

/// The decision on `op`'s answer, in memory, with `pending` (transitions
/// made in memory before it) and what follows its save: a rejection or a
/// data answer is saved and done; an approval records its attempt to spend
/// the permit (`consume_inflight`) before the call.
pub(crate) fn decide_in_memory(
    mut op: Operation,
    mut pending: Vec<Transition>,
) -> (Operation, Vec<Transition>, Then) {
    let answer = op.answer.clone().unwrap_or_default();
    let options = op.spec.options.clone().unwrap_or_default();
    let then = match answer::validate(op.decision_type, &options, &answer) {
        Verdict::Invalid(why) => {
            pending.push(reject(&mut op, State::Invalid, format!("invalid answer: {why}"), ACTOR));
            Then::Saved
        }
        Verdict::Denied => {
            pending.push(reject(&mut op, State::Denied, "the recipient answered no", ACTOR));
            Then::Saved
        }
        Verdict::Data => {
            let t = transition(&mut op, State::Delivering, "answer is data; delivering it", ACTOR);
            op.outcome_status = Some(OutcomeStatus::Answered.as_str().into());
            op.delivery = Some("pending".into());
            op.attempts = 0;
            op.due_at = Some(op.updated_at);
            pending.push(t);
            Then::Saved
        }
        Verdict::Approved => {
            let now = now_ms();
            if now >= op.deadline {
                pending.push(reject(
                    &mut op,
                    State::Expired,
                    "deadline passed before the permit was consumed",
                    ACTOR,
                ));
                Then::Saved
            } else {
                // Whether an earlier attempt may have spent the permit
                // without us learning of it (lost response, or a crash
                // mid-call).
                let earlier_unknown = op.consume_inflight;
                op.consume_inflight = true;
                op.consume_attempts += 1;
                op.updated_at = now;
                Then::Consume { earlier_unknown }
            }
        }
    };
    (op, pending, then)
}

/// The first save of the answer `entry` to `op` when the inbox stores it
/// (decisions §36): `op` as the answer and the decision on it leave it,
/// the transitions to record, the note that settles the entry, and what
/// follows the save. None unless `op` is pending: a stale answer is left
/// to a worker, which records that it changed nothing.
pub(crate) fn first_save_of_answer(
    entry: &InboxEntry,
    op: Operation,
) -> Option<(Operation, Vec<Transition>, &'static str, Then)> {
    if op.state != State::Pending {
        return None;
    }
    let (op, t, note) = answer_operation(entry, op, false);
    if op.state != State::Answered {
        return Some((op, vec![t], note, Then::Saved));
    }
    let (op, pending, then) = decide_in_memory(op, vec![t]);
    Some((op, pending, note, then))
}

impl Engine {
    /// Saves a step of an operation on the thread this worker holds
    /// (`Store::save_held`): `work_thread` goes on with what the save left
    /// due now, and a step scheduled for later is the tick keeper's, told
    /// here so it wakes for it. A save that finishes the operation gives
    /// up the thread's lease if nothing is left on the thread, and the
    /// visit ends with it (`Store::save_held_releasing`). The first save of
    /// an answer handed on by the inbox takes the lease (`TakeLease`).
    async fn save(
        &self,
        op: &mut Operation,
        transitions: &[Transition],
        inbox: Option<(i64, &str, Option<&str>)>,
    ) -> Result<bool, StoreError> {
        let release = super::lease_to_give_up(op);
        let take = super::lease_to_take();
        let now = now_ms();
        let lease = LeaseWith {
            release: release.as_deref(),
            take: take.as_deref().map(|owner| TakeLease { owner, now, until: now + self.settings.lease_ms }),
        };
        let (saved, gave_up) = self.store.save_held_releasing(op, transitions, inbox, lease).await?;
        if saved && take.is_some() {
            super::took_lease(now);
        }
        if gave_up {
            super::gave_up_lease();
        }
        if saved && let Some(at) = op.due_at {
            self.scheduled(at);
        }
        if saved {
            super::due_next(op);
        }
        Ok(saved)
    }

    /// Applies an inbox entry to the operation its correlation id names.
    /// `held_back`: an earlier answer of the thread still has resume work,
    /// so this one waits (answers of a thread resume in arrival order; it
    /// is released when that one finishes).
    pub(crate) async fn apply_answer(
        &self,
        entry: InboxEntry,
        op: Operation,
        held_back: bool,
    ) -> Result<(), StoreError> {
        let span = resume_span(&entry, &op);
        self.apply_answer_inner(entry, op, held_back).instrument(span).await
    }

    async fn apply_answer_inner(
        &self,
        entry: InboxEntry,
        op: Operation,
        held_back: bool,
    ) -> Result<(), StoreError> {
        if op.state != State::Pending {
            // Already answered, expired or cancelled: the callback changes nothing.
            let note = format!("operation already {}; nothing changed", op.state);
            tracing::info!(operation_id = %op.id, thread_id = %op.thread_id, correlation_id = %entry.correlation_id, "{note}");
            return self.store.settle_inbox(entry.id, "ignored", &note, Some(&op.id), now_ms()).await;
        }
        let (mut op, t, note) = answer_operation(&entry, op, held_back);
        let applying = Applying { inbox_id: entry.id, note };
        if op.state == State::Answered && !held_back {
            // Decided at once: nothing happens outside between applying the
            // answer and deciding on it, so one commit records both.
            return self.decide(op, vec![t], Some(&applying)).await;
        }
        self.save_first(&mut op, &[t], Some(&applying)).await.map(|_| ())
    }

    /// The first save of a step, which may also apply an answer: settles
    /// its inbox entry in the same commit and counts the resume.
    async fn save_first(
        &self,
        op: &mut Operation,
        pending: &[Transition],
        applying: Option<&Applying<'_>>,
    ) -> Result<bool, StoreError> {
        let inbox = applying.map(|a| (a.inbox_id, "processed", Some(a.note)));
        let saved = self.save(op, pending, inbox).await?;
        if saved && applying.is_some() {
            tracing::info!(state = %op.state, "answer applied");
            self.metrics.inc("approvald_resumes_total", &[("state", op.state.as_str())]);
        }
        Ok(saved)
    }

    /// One step of a due operation.
    pub(crate) async fn step(&self, op: Operation) -> Result<(), StoreError> {
        let span = tracing::info_span!("step", operation_id = %op.id, thread_id = %op.thread_id,
            correlation_id = op.decision_id.as_deref().unwrap_or(""), state = %op.state);
        self.step_inner(op).instrument(span).await
    }

    async fn step_inner(&self, op: Operation) -> Result<(), StoreError> {
        match op.state {
            State::Enqueued => self.open(op).await,
            State::Answered => self.decide(op, Vec::new(), None).await,
            State::Permitted | State::Delivering => self.deliver_approval_or_data(op, Vec::new()).await,
            _ if op.delivery.as_deref() == Some("pending") => self.deliver_rejection(op).await,
            _ if op.receipt.as_deref() == Some("pending") => self.record_receipt(op).await,
            _ => {
                let mut op = op;
                op.due_at = None;
                self.save(&mut op, &[], None).await.map(|_| ())
            }
        }
    }

    /// Schedules the next attempt after a retryable failure.
    fn retry_later(&self, op: &mut Operation, error: &str) {
        op.attempts += 1;
        op.last_error = Some(error.to_string());
        op.updated_at = now_ms();
        op.due_at = Some(op.updated_at + self.backoff_ms(op.attempts));
    }

    /// enqueued → pending (decision opened) | unreachable | expired.
    async fn open(&self, mut op: Operation) -> Result<(), StoreError> {
        let now = now_ms();
        if now >= op.deadline {
            let t =
                reject(&mut op, State::Expired, "deadline passed before the decision could be opened", ACTOR);
            self.save(&mut op, &[t], None).await?;
            return Ok(());
        }
        let clock = CallClock::start();
        let created = match self.pushary(&op.tenant) {
            Ok(p) => p.create_decision(&op.decision_request).await,
            Err(e) => Err(e),
        };
        clock.note(&mut op, "create_decision", &created);
        match created {
            Ok(created) => {
                op.decision_id = Some(created.decision_id.clone());
                op.opened_at = Some(now_ms());
                op.attempts = 0;
                op.last_error = None;
                op.poll_at = Some(now_ms() + self.settings.poll_after_ms);
                op.due_at = None;
                let t = transition(
                    &mut op,
                    State::Pending,
                    format!("decision {} opened", created.decision_id),
                    ACTOR,
                );
                if self.save(&mut op, &[t], None).await? {
                    tracing::info!(operation_id = %op.id, thread_id = %op.thread_id, correlation_id = %created.decision_id, "decision opened");
                    // An answer that came before the id was known (orphaned,
                    // or stored while this save ran) goes to work now.
                    self.store.mark_early_answer(&op.tenant, &created.decision_id).await?;
                }
            }
            Err(PusharyError::Status { status: 409, message, .. })
                if op.decision_request.get("requireReachable") == Some(&Value::Bool(true)) =>
            {
                let t =
                    reject(&mut op, State::Unreachable, format!("recipient not reachable: {message}"), ACTOR);
                self.save(&mut op, &[t], None).await?;
            }
            Err(e) => {
                // Retried with the identical payload until the deadline;
                // a 4xx here is a configuration problem an operator can fix.
                tracing::warn!(operation_id = %op.id, error = %e, "opening the decision failed; will retry");
                self.retry_later(&mut op, &e.to_string());
                self.save(&mut op, &[], None).await?;
            }
        }
        Ok(())
    }

    /// answered → permitted | denied | invalid | refused | delivering (data) | uncertain | expired.
    /// `pending`: transitions made in memory that the first save records;
    /// `applying`: the answer being applied, settled by that save.
    async fn decide(
        &self,
        op: Operation,
        pending: Vec<Transition>,
        applying: Option<&Applying<'_>>,
    ) -> Result<(), StoreError> {
        let (mut op, pending, then) = decide_in_memory(op, pending);
        if !self.save_first(&mut op, &pending, applying).await? {
            return Ok(());
        }
        match then {
            Then::Consume { earlier_unknown } => self.consume(op, earlier_unknown).await,
            Then::Saved => Ok(()),
        }
    }

    /// Goes on from an approval applied in its callback's commit, the
    /// attempt to spend its permit recorded there (decisions §36): the
    /// deadline is looked at again, as the commit may have been a while
    /// before a worker came. Past it, no call was made, and the operation
    /// expires with the attempt cleared.
    pub(crate) async fn consume_applied(&self, mut op: Operation) -> Result<(), StoreError> {
        if now_ms() >= op.deadline {
            op.consume_inflight = false;
            let t = reject(&mut op, State::Expired, "deadline passed before the permit was consumed", ACTOR);
            self.save(&mut op, &[t], None).await?;
            return Ok(());
        }
        // `Engine::first_save` makes none over an attempt on record.
        self.consume(op, false).await
    }

    /// Spends the permit, its attempt recorded (`consume_inflight`), and
    /// goes on to the delivery. `earlier_unknown`: an earlier attempt may
    /// have spent it without our learning of it (a lost response, or a
    /// crash mid-call).
    pub(crate) async fn consume(&self, mut op: Operation, earlier_unknown: bool) -> Result<(), StoreError> {
        crate::fault::point("after_consume_inflight_recorded");
        let clock = CallClock::start();
        let result = match self.pushary(&op.tenant) {
            Ok(p) => p.consume(&consume_body(&op)).await,
            Err(e) => Err(e),
        };
        clock.note(&mut op, "consume", &result);
        crate::fault::point("after_consume_returned");
        match result {
            Ok(permit) => {
                op.permit_id = Some(permit.permit_id.clone());
                op.consume_inflight = false;
                op.attempts = 0;
                op.last_error = None;
                op.due_at = Some(now_ms());
                let t = transition(
                    &mut op,
                    State::Permitted,
                    format!("permit {} consumed", permit.permit_id),
                    ACTOR,
                );
                // Straight on to the delivery: the permit is recorded in the
                // commit that starts the attempt (nothing happens outside
                // between the two, so a crash before it is the same crash
                // as one before a separate "permitted" commit).
                return self.deliver_approval_or_data(op, vec![t]).await;
            }
            Err(e) if e.refusal() == Some("already_consumed") && earlier_unknown => {
                // Our own earlier attempt may have spent it: the outcome is
                // unknown, never a reason to run.
                op.consume_inflight = false;
                op.due_at = None;
                op.delivery = Some("unknown".into());
                let t = transition(
                    &mut op,
                    State::Uncertain,
                    "permit already consumed after an attempt whose response was lost",
                    ACTOR,
                );
                self.save(&mut op, &[t], None).await?;
            }
            Err(e) if e.refusal().is_some() || (e.status().is_some() && !e.is_retryable()) => {
                op.consume_inflight = false;
                let why = e.refusal().map_or_else(|| e.to_string(), str::to_string);
                let t = reject(&mut op, State::Refused, format!("permit refused: {why}"), ACTOR);
                self.save(&mut op, &[t], None).await?;
            }
            Err(e) => {
                // Transport failure is never permission: keep the flag set so
                // an `already_consumed` on retry reads as uncertain.
                tracing::warn!(operation_id = %op.id, error = %e, "consume failed; will retry");
                self.retry_later(&mut op, &e.to_string());
                self.save(&mut op, &[], None).await?;
            }
        }
        Ok(())
    }

    /// permitted/delivering: deliver the approval (or data answer) to the effect.
    /// `pending`: transitions made in memory that the first save records.
    async fn deliver_approval_or_data(
        &self,
        mut op: Operation,
        mut pending: Vec<Transition>,
    ) -> Result<(), StoreError> {
        let approval = op.permit_id.is_some();
        let now = now_ms();
        if op.state == State::Permitted {
            if now >= op.deadline {
                let t = reject(&mut op, State::Expired, "deadline passed before the effect ran", ACTOR);
                pending.push(t);
                self.save(&mut op, &pending, None).await?;
                return Ok(());
            }
            let t = transition(&mut op, State::Delivering, "delivering the approval", ACTOR);
            op.outcome_status = Some(OutcomeStatus::Approved.as_str().into());
            op.delivery = Some("pending".into());
            op.attempts = 0;
            // Saved below together with the attempt it starts: nothing
            // happens outside between the two, so one commit records both.
            pending.push(t);
        }
        if op.delivery_inflight && approval {
            // A process died mid-delivery: the effect may have run. Only a
            // target that deduplicates on the idempotency key may see it again.
            let safe = self.effect(&op.tenant, &op.effect).is_some_and(|t| t.redeliver_safe);
            if !safe {
                return self
                    .uncertain(op, "a delivery attempt was interrupted; the effect may have run")
                    .await;
            }
            tracing::info!(operation_id = %op.id, "redelivering an interrupted approval to a redeliver-safe target");
        }
        if approval && now >= op.deadline {
            return self.uncertain(op, "the effect did not confirm before the deadline").await;
        }
        op.delivery_inflight = true;
        op.attempts += 1;
        op.updated_at = now;
        if !self.save(&mut op, &pending, None).await? {
            return Ok(());
        }
        crate::fault::point("after_delivering_recorded");
        let outcome = self.post_outcome(&mut op).await?;
        crate::fault::point("after_effect_answered");
        op.delivery_inflight = false;
        match outcome {
            super::delivery::Outcome::Done(body) => {
                op.result = body;
                op.delivery = Some("done".into());
                op.last_error = None;
                if approval {
                    op.receipt = Some("pending".into());
                    op.receipt_outcome = Some("succeeded".into());
                }
                let t = transition(&mut op, State::Succeeded, "the effect target confirmed", ACTOR);
                op.due_at = needs_work(&op).then_some(op.updated_at);
                return self.save(&mut op, &[t], None).await.map(|_| ());
            }
            super::delivery::Outcome::Refused(code, body) => {
                op.result = body;
                op.delivery = Some("failed".into());
                if approval {
                    op.receipt = Some("pending".into());
                    op.receipt_outcome = Some("failed".into());
                }
                let t = transition(
                    &mut op,
                    State::Failed,
                    format!("the effect target refused with {code}"),
                    ACTOR,
                );
                op.due_at = needs_work(&op).then_some(op.updated_at);
                return self.save(&mut op, &[t], None).await.map(|_| ());
            }
            super::delivery::Outcome::Retry(error) => {
                self.retry_later(&mut op, &error);
                let past_deadline = op.due_at.is_some_and(|d| d >= op.deadline);
                if approval && past_deadline {
                    return self
                        .uncertain(op, &format!("no confirmation before the deadline: {error}"))
                        .await;
                }
                if !approval && op.updated_at - op.created_at > self.settings.rejection_window_ms {
                    op.delivery = Some("abandoned".into());
                    let t = transition(&mut op, State::Failed, format!("delivery abandoned: {error}"), ACTOR);
                    op.due_at = None;
                    self.save(&mut op, &[t], None).await?;
                    return Ok(());
                }
                self.save(&mut op, &[], None).await?;
            }
        }
        Ok(())
    }

    async fn uncertain(&self, mut op: Operation, cause: &str) -> Result<(), StoreError> {
        op.delivery_inflight = false;
        op.delivery = Some("unknown".into());
        let t = transition(&mut op, State::Uncertain, cause, ACTOR);
        op.due_at = None;
        tracing::warn!(operation_id = %op.id, thread_id = %op.thread_id, "operation uncertain: {cause}");
        self.save(&mut op, &[t], None).await.map(|_| ())
    }

    /// A fail-closed outcome is delivered so the app can resume with a rejection.
    async fn deliver_rejection(&self, mut op: Operation) -> Result<(), StoreError> {
        op.attempts += 1;
        op.updated_at = now_ms();
        let outcome = self.post_outcome(&mut op).await?;
        match outcome {
            super::delivery::Outcome::Done(body) => {
                op.result = body;
                op.delivery = Some("done".into());
                op.last_error = None;
            }
            super::delivery::Outcome::Refused(code, body) => {
                op.result = body;
                op.delivery = Some("failed".into());
                op.last_error = Some(format!("the effect target refused the outcome with {code}"));
            }
            super::delivery::Outcome::Retry(error) => {
                op.last_error = Some(error);
                op.due_at = Some(op.updated_at + self.backoff_ms(op.attempts));
                if op.updated_at - op.created_at > self.settings.rejection_window_ms {
                    op.delivery = Some("abandoned".into());
                } else {
                    return self.save(&mut op, &[], None).await.map(|_| ());
                }
            }
        }
        op.due_at = needs_work(&op).then_some(now_ms());
        self.save(&mut op, &[], None).await.map(|_| ())
    }

    /// Tells Pushary how the permitted action ended; the first receipt wins.
    async fn record_receipt(&self, mut op: Operation) -> Result<(), StoreError> {
        let (Some(permit), Some(outcome)) = (op.permit_id.clone(), op.receipt_outcome.clone()) else {
            op.receipt = None;
            op.due_at = needs_work(&op).then_some(now_ms());
            return self.save(&mut op, &[], None).await.map(|_| ());
        };
        crate::fault::point("before_receipt");
        let summary = format!("approvald operation {} ended {}", op.id, op.state);
        let clock = CallClock::start();
        let recorded = match self.pushary(&op.tenant) {
            Ok(p) => p.record_receipt(&permit, &outcome, Some(&summary)).await,
            Err(e) => Err(e),
        };
        clock.note(&mut op, "record_receipt", &recorded);
        match recorded {
            Ok(_) => {
                op.receipt = Some("recorded".into());
                op.last_error = None;
            }
            Err(e) if !e.is_retryable() => {
                op.receipt = Some("rejected".into());
                op.last_error = Some(format!("receipt not recorded: {e}"));
            }
            Err(e) => {
                self.retry_later(&mut op, &format!("receipt: {e}"));
                return self.save(&mut op, &[], None).await.map(|_| ());
            }
        }
        op.updated_at = now_ms();
        op.due_at = needs_work(&op).then_some(op.updated_at);
        self.save(&mut op, &[], None).await.map(|_| ())
    }
}

/// The consume request restates exactly the subject the decision was
/// created with: the same keys, taken from the stored create payload.
pub(crate) fn consume_body(op: &Operation) -> Value {
    let mut body = Map::new();
    body.insert("authorizationId".into(), json!(op.decision_id.clone().unwrap_or_default()));
    for key in ["toolName", "toolTarget", "actor", "environment", "parameters", "externalId"] {
        if let Some(v) = op.decision_request.get(key) {
            body.insert(key.into(), v.clone());
        }
    }
    Value::Object(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::answer::DecisionType;

    fn pending(decision_type: DecisionType, deadline: i64) -> Operation {
        let body = json!({"operationKey": "k", "threadId": "th", "interruptId": "i", "effect": "orders",
            "externalId": "u", "question": "Proceed?", "toolName": "ship", "parameters": {},
            "type": decision_type.as_str(), "options": ["red", "blue"]});
        let limits = crate::domain::operation::Limits { max_expires_in_secs: 3600 };
        let body = match decision_type {
            DecisionType::Select => body,
            _ => {
                let mut b = body;
                b.as_object_mut().expect("an object").remove("options");
                b
            }
        };
        let spec = crate::domain::operation::parse(&body, limits, 0).expect("a valid body");
        Operation {
            id: "op-1".into(),
            tenant: "t".into(),
            operation_key: "k".into(),
            fingerprint: "f".into(),
            thread_id: "th".into(),
            interrupt_id: "i".into(),
            effect: "orders".into(),
            decision_type,
            spec,
            decision_request: json!({}),
            state: State::Pending,
            decision_id: Some("dec-1".into()),
            answer: None,
            permit_id: None,
            delivery: None,
            outcome_status: None,
            idempotency_key: "ik".into(),
            result: None,
            receipt: None,
            receipt_outcome: None,
            consume_inflight: false,
            consume_attempts: 0,
            delivery_inflight: false,
            attempts: 0,
            last_error: None,
            due_at: None,
            deadline,
            poll_at: Some(5),
            resume_seq: None,
            opened_at: Some(10),
            created_at: 1,
            updated_at: 1,
            version: 3,
            unrecorded_delivery: None,
            unrecorded_calls: Vec::new(),
        }
    }

    fn entry(answer: &str, received_at: i64) -> InboxEntry {
        InboxEntry {
            id: 42,
            tenant: "t".into(),
            correlation_id: "dec-1".into(),
            answer: answer.into(),
            answered_at: None,
            source: "callback".into(),
            state: "new".into(),
            received_at,
            duplicates: 0,
            operation_id: None,
            processed_at: None,
            note: None,
        }
    }

    const LATER: i64 = i64::MAX / 2;

    #[test]
    fn an_approval_records_its_attempt_to_spend_the_permit_before_the_call() {
        let (op, ts, note, then) =
            first_save_of_answer(&entry("yes", 20), pending(DecisionType::Confirm, LATER)).expect("pending");
        assert_eq!(then, Then::Consume { earlier_unknown: false });
        assert_eq!((op.state, op.consume_inflight, op.consume_attempts), (State::Answered, true, 1));
        assert_eq!((op.answer.as_deref(), op.resume_seq, op.poll_at), (Some("yes"), Some(42), None));
        assert!(op.due_at.is_some(), "due, should the call be cut short by a crash");
        assert_eq!(ts.iter().map(|t| t.to.as_str()).collect::<Vec<_>>(), ["answered"]);
        assert_eq!(note, "matched");
        assert_eq!(op.version, 3, "the save bumps it, not the decision");
    }

    #[test]
    fn a_rejection_or_a_data_answer_is_all_of_its_step() {
        let cases = [
            (DecisionType::Confirm, "no", State::Denied, Some("pending")),
            (DecisionType::Confirm, "maybe", State::Invalid, Some("pending")),
            (DecisionType::Select, "red", State::Delivering, Some("pending")),
            (DecisionType::Select, "green", State::Invalid, Some("pending")),
            (DecisionType::Input, "ship it", State::Delivering, Some("pending")),
        ];
        for (kind, answer, to, delivery) in cases {
            let (op, ts, _, then) =
                first_save_of_answer(&entry(answer, 20), pending(kind, LATER)).expect("pending");
            assert_eq!(then, Then::Saved, "{answer}");
            assert_eq!(
                (op.state, op.delivery.as_deref(), op.consume_inflight),
                (to, delivery, false),
                "{answer}"
            );
            assert_eq!(
                ts.iter().map(|t| t.to.as_str()).collect::<Vec<_>>(),
                ["answered", to.as_str()],
                "{answer}"
            );
        }
    }

    #[test]
    fn an_answer_after_the_deadline_expires_the_operation() {
        let (op, ts, _, then) =
            first_save_of_answer(&entry("yes", 20), pending(DecisionType::Confirm, 9)).expect("pending");
        assert_eq!((op.state, then, op.consume_inflight), (State::Expired, Then::Saved, false));
        assert_eq!(op.answer.as_deref(), Some("yes"), "kept for the record");
        assert_eq!(ts.len(), 1);
    }

    #[test]
    fn an_answer_before_the_decision_id_was_recorded_is_noted_early() {
        let (_, _, note, _) =
            first_save_of_answer(&entry("yes", 5), pending(DecisionType::Confirm, LATER)).expect("pending");
        assert_eq!(note, "early answer: arrived before the decision id was recorded");
    }

    #[test]
    fn only_a_pending_operation_is_answered() {
        for state in [State::Enqueued, State::Answered, State::Expired, State::Cancelled, State::Succeeded] {
            let mut op = pending(DecisionType::Confirm, LATER);
            op.state = state;
            assert!(first_save_of_answer(&entry("yes", 20), op).is_none(), "{state}");
        }
    }

    #[test]
    fn a_held_back_answer_waits_for_the_one_before_it() {
        let (op, t, _) = answer_operation(&entry("yes", 20), pending(DecisionType::Confirm, LATER), true);
        assert_eq!((op.state, op.due_at, t.to.as_str()), (State::Answered, None, "answered"));
        let (op, _, _) = answer_operation(&entry("yes", 20), pending(DecisionType::Confirm, LATER), false);
        assert!(op.due_at.is_some());
    }

    #[test]
    fn a_second_attempt_to_spend_the_permit_knows_of_the_first() {
        let mut op = pending(DecisionType::Confirm, LATER);
        op.state = State::Answered;
        op.answer = Some("yes".into());
        op.consume_inflight = true;
        op.consume_attempts = 1;
        let (op, ts, then) = decide_in_memory(op, Vec::new());
        assert_eq!(then, Then::Consume { earlier_unknown: true });
        assert_eq!(op.consume_attempts, 2);
        assert!(ts.is_empty());
    }
}
