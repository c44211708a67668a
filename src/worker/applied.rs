//! An answer's first save made in the commit that stores its callback,
//! and the visit that goes on from it (decisions §36; SQLite §38, where
//! the thread's claim stands in for its lease).

use std::cell::RefCell;
use std::sync::atomic::Ordering;

use tracing::Instrument as _;

use super::{Engine, Handed, MAX_HANDED, VISIT, Visit, due_next, steps};
use crate::clock::now_ms;
use crate::domain::state::State;
use crate::store::{AnswerSave, Applied, InboxEntry, Operation, StoreError};

impl Engine {
    /// The first save of `entry`'s answer to `op` (pending, as the inbox's
    /// statement marked it), for the inbox to make in the commit that
    /// stores the answer: the answer applied and decided on in memory,
    /// with the thread's lease for a visit of this process, which goes on
    /// from it (`go_on_from_applied`). None where no workers run here,
    /// where too many answers wait for their visits already, and where
    /// the worker's own rules apply: an operation no longer pending, or an
    /// attempt to spend its permit on record, and once the workers are
    /// stopping. A save that does not take
    /// changed nothing; the transitions this logs were then not made, and
    /// the visit that reads the thread logs what it does instead.
    pub fn first_save(&self, entry: &InboxEntry, op: &Operation) -> Option<AnswerSave> {
        if !self.workers_here.load(Ordering::SeqCst)
            || self.stopping()
            || op.consume_inflight
            || self.handed_lock().len() >= MAX_HANDED
        {
            return None;
        }
        let span = steps::resume_span(entry, op);
        let _entered = span.enter();
        let (op, transitions, note, _) = steps::first_save_of_answer(entry, op.clone())?;
        // On SQLite the claim is the lease (§14): held from here, through
        // the commit, for the visit that goes on; a worker on the thread
        // now reads the answer itself.
        if !self.store.is_postgres() && !self.claims.reserve(&(op.tenant.clone(), op.thread_id.clone())) {
            return None;
        }
        let turn = self.next_owner.fetch_add(1, Ordering::Relaxed);
        let now = now_ms();
        Some(AnswerSave {
            op,
            transitions,
            note,
            owner: format!("{}/{turn}", self.owner),
            now,
            until: now + self.settings.lease_ms,
        })
    }

    /// Goes on from an answer applied in its callback's commit, holding the
    /// lease that commit took: spends the permit if the save recorded the
    /// attempt, or leaves the step it saved to the visit. Returns the
    /// visit as it then stands, or None if the lease ran out before a
    /// worker came and is another's now. A third of the lease gone, it is
    /// renewed first, as a visit renews it before each step.
    pub(super) async fn go_on_from_applied(&self, applied: Applied) -> Result<Option<Visit>, StoreError> {
        let Applied { entry, save } = applied;
        let AnswerSave { op, owner, now: took_at, .. } = save;
        let now = now_ms();
        let shared = self.store.is_postgres();
        let leased_at = if shared && now - took_at >= self.settings.lease_ms / 3 {
            let renewed = self
                .store
                .renew_lease(&op.tenant, &op.thread_id, &owner, now + self.settings.lease_ms)
                .await?;
            if !renewed {
                tracing::warn!(tenant = %op.tenant, thread_id = %op.thread_id,
                    "the lease of an applied answer ran out before a worker came; leaving the thread to its new owner");
                return Ok(None);
            }
            now
        } else {
            took_at
        };
        let span = steps::resume_span(&entry, &op);
        let visit =
            Visit { lease_owner: shared.then_some(owner), took_at: Some(leased_at), ..Visit::default() };
        let went_on = async {
            tracing::info!(state = %op.state, "answer applied");
            self.metrics.inc("approvald_resumes_total", &[("state", op.state.as_str())]);
            if op.state == State::Answered && op.consume_inflight {
                self.consume_applied(op).await?;
            } else {
                if let Some(at) = op.due_at {
                    self.scheduled(at);
                }
                due_next(&op);
            }
            Ok::<_, StoreError>(VISIT.with(|v| std::mem::take(&mut *v.borrow_mut())))
        };
        VISIT.scope(RefCell::new(visit), went_on.instrument(span)).await.map(Some)
    }

    /// Lets go of the leases (on SQLite, the claims) of answers applied
    /// for visits that will not come: the workers are stopping. Their
    /// threads are free at once for another process, which finds each
    /// consume on record and spends the permit knowing an earlier attempt
    /// may have (none was made).
    pub(super) async fn let_applied_go(&self) {
        let applied: Vec<Box<Applied>> = self
            .handed_lock()
            .extract_if(|_, h| matches!(h, Handed::Applied(_)))
            .filter_map(|(_, h)| match h {
                Handed::Applied(a) => Some(a),
                Handed::Answer(_) => None,
            })
            .collect();
        for a in applied {
            let op = &a.save.op;
            if !self.store.is_postgres() {
                self.give_claim_back(&a.save);
                continue;
            }
            if let Err(e) = self.store.release_lease(&op.tenant, &op.thread_id, &a.save.owner).await {
                tracing::warn!(error = %e, thread_id = %op.thread_id, "cannot let go of an applied answer's lease; it runs out");
            }
        }
    }
}

impl crate::store::FirstSave for Engine {
    fn first_save(&self, entry: &InboxEntry, op: &Operation) -> Option<AnswerSave> {
        Engine::first_save(self, entry, op)
    }

    fn not_made(&self, save: &AnswerSave) {
        self.give_claim_back(save);
    }
}

impl Engine {
    /// SQLite: the claim held for `save`'s visit goes (§38), and a worker
    /// that was told of the thread meanwhile, and passed it by, is told
    /// again. Nothing held (PostgreSQL, or a claim taken over): nothing.
    pub(super) fn give_claim_back(&self, save: &AnswerSave) {
        let key = (save.op.tenant.clone(), save.op.thread_id.clone());
        if self.claims.unreserve(&key) == super::claims::Missed::Offered {
            self.offer(&[key]);
        }
    }
}
