//! The resume engine: workers that take one thread at a time (by lease),
//! process its inbox entries in arrival order and drive its operations one
//! step at a time; and the reconciler's sweeps.

mod applied;
mod claims;
mod delivery;
mod operator;
mod reconciler;
mod steps;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use delivery::{EffectTarget, outcome_body};
pub use operator::{CancelError, ResolveError, resolve};
pub use reconciler::Sweep;

use claims::{Claim, Claims, Missed, ThreadKey};

use crate::clock::now_ms;
use crate::config::Config;
use crate::pushary::PusharyClient;
use crate::store::{Applied, InboxEntry, Operation, Store, StoreError, ThreadWork};

/// What a worker's visit to a thread carries from one step to the next.
#[derive(Debug, Default)]
struct Visit {
    /// The operation the last save on the held thread left due now, as
    /// saved (its version bumped): the next step of the same approval,
    /// which the worker then takes without a read of the store. Each save
    /// replaces it; a save that leaves nothing due now clears it.
    due_next: Option<Operation>,
    /// The owner of the thread's lease, on a store with leases: a save
    /// that finishes its operation gives the lease up with it if the
    /// thread has nothing left (decisions §34).
    lease_owner: Option<String>,
    /// A save gave the lease up: the visit is over.
    gave_up: bool,
    /// The visit's first save takes the lease (an answer handed on by the
    /// inbox, decisions §35); it did at `took_at` (ms), if it did.
    taking: bool,
    took_at: Option<i64>,
}

/// The most answers handed on that wait for their threads' next visit.
const MAX_HANDED: usize = 4096;

/// An answer the inbox hands on for its thread's next visit here.
#[derive(Debug)]
enum Handed {
    /// Stored for a pending operation, with the operation as marked: the
    /// visit applies it, its first save taking the lease (decisions §35).
    Answer(Box<(InboxEntry, Operation)>),
    /// Applied in its callback's commit, which took the lease for the
    /// visit that goes on from it (§36). Never dropped unvisited: the
    /// lease would keep the thread from everyone until it ran out.
    Applied(Box<Applied>),
}

tokio::task_local! {
    static VISIT: RefCell<Visit>;
}

/// Records `op`, just saved, as the worker's next work if it is due now.
/// Outside a worker's visit to a thread (the operator, the reconciler) it
/// does nothing.
fn due_next(op: &Operation) {
    let due = op.due_at.is_some_and(|at| at <= now_ms());
    let _ = VISIT.try_with(|v| v.borrow_mut().due_next = due.then(|| op.clone()));
}

/// The owner of the lease a save of `op` on the visited thread may give
/// up: only a save that leaves `op` finished, with nothing due (a save
/// that opens a decision goes on to look for an early answer, and one
/// that leaves a step for later keeps the thread's next step in its
/// holder's hands). None outside a visit, and on SQLite.
fn lease_to_give_up(op: &Operation) -> Option<String> {
    if !op.state.is_terminal() || op.due_at.is_some() || steps::needs_work(op) {
        return None;
    }
    VISIT.try_with(|v| v.borrow().lease_owner.clone()).ok().flatten()
}

/// The owner of the lease the save about to be made must take first: the
/// visit's first save of an answer handed on by the inbox. Asked once.
fn lease_to_take() -> Option<String> {
    VISIT
        .try_with(|v| {
            let mut v = v.borrow_mut();
            if std::mem::take(&mut v.taking) { v.lease_owner.clone() } else { None }
        })
        .ok()
        .flatten()
}

/// The save just made took the visit's lease, at `at`.
fn took_lease(at: i64) {
    let _ = VISIT.try_with(|v| v.borrow_mut().took_at = Some(at));
}

/// The save just made gave up the visit's lease.
fn gave_up_lease() {
    let _ = VISIT.try_with(|v| v.borrow_mut().gave_up = true);
}

/// Whether a save of this visit gave up its lease.
fn visit_gave_up() -> bool {
    VISIT.try_with(|v| v.borrow().gave_up).unwrap_or(false)
}

/// Timings and switches the engine takes from configuration.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    pub lease_ms: i64,
    pub retry_initial_ms: u64,
    pub retry_max_ms: u64,
    pub rejection_window_ms: i64,
    pub poll_after_ms: i64,
    pub orphan_after_ms: i64,
    /// Finished operations older than this are archived; None keeps them.
    pub archive_after_ms: Option<i64>,
    pub reconcile_every: Duration,
    pub concurrency: usize,
    /// Safety-net poll for work when no wake-up arrives.
    pub idle_poll: Duration,
}

impl EngineSettings {
    pub fn from_config(c: &Config) -> Self {
        Self {
            lease_ms: secs_ms(c.worker.lease_secs),
            retry_initial_ms: c.worker.retry_initial_ms,
            retry_max_ms: c.worker.retry_max_secs.saturating_mul(1000),
            rejection_window_ms: secs_ms(c.worker.rejection_delivery_window_secs),
            poll_after_ms: secs_ms(c.reconciler.poll_after_secs),
            orphan_after_ms: secs_ms(c.reconciler.orphan_after_secs),
            archive_after_ms: (c.retention.archive_after_secs > 0)
                .then(|| secs_ms(c.retention.archive_after_secs)),
            reconcile_every: Duration::from_secs(c.reconciler.interval_secs),
            concurrency: c.worker.concurrency,
            idle_poll: Duration::from_secs(c.worker.idle_poll_secs),
        }
    }
}

fn secs_ms(s: u64) -> i64 {
    i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)
}

/// What the engine holds for one tenant: its Pushary account and targets.
pub struct TenantRuntime {
    pub pushary: PusharyClient,
    pub effects: HashMap<String, EffectTarget>,
}

pub struct Engine {
    pub(crate) store: Store,
    pub(crate) tenants: HashMap<String, TenantRuntime>,
    pub(crate) http: reqwest::Client,
    pub(crate) settings: EngineSettings,
    pub(crate) wake: Arc<Notify>,
    /// Wakes the tick keeper (worker 0) early: a step was scheduled before
    /// `tick_at`, the time it means to wake next (ms; MAX while it works).
    tick: Notify,
    tick_at: AtomicI64,
    /// Times of steps this process scheduled for later, until a read of
    /// the store for work at or after them: the tick keeper wakes for each
    /// (`next_nap`).
    schedule: std::sync::Mutex<BTreeSet<i64>>,
    owner: String,
    next_owner: AtomicU64,
    /// Decisions archived by the last sweep, whose racing replays the next
    /// sweep removes (see `reconciler::archive_finished`).
    pub(crate) archived_last_sweep: std::sync::Mutex<Vec<(String, String)>>,
    /// Threads a worker of this process is on.
    claims: Claims,
    /// Threads with work, read from the store or named by whoever gave
    /// them work, not yet handed to a worker.
    candidates: std::sync::Mutex<VecDeque<ThreadKey>>,
    /// Answers the inbox stored for pending operations, for the worker
    /// that takes the thread next (decisions §35 and §36, PostgreSQL; §38,
    /// SQLite, applied answers only).
    handed: std::sync::Mutex<HashMap<ThreadKey, Handed>>,
    /// The store may hold work that no candidate names: a worker that
    /// runs out of candidates reads the store only then (decisions §33).
    unread: AtomicBool,
    /// Workers run in this process (`spawn`); without them, naming a
    /// thread to them would only fill a queue no one takes from.
    workers_here: AtomicBool,
    /// The workers' shutdown (`spawn`): once it is cancelled they take no
    /// more visits, so the inbox makes no more first saves for them
    /// (decisions §36).
    shutdown: std::sync::OnceLock<CancellationToken>,
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
}

impl Engine {
    pub fn new(
        store: Store,
        tenants: HashMap<String, TenantRuntime>,
        settings: EngineSettings,
        wake: Arc<Notify>,
    ) -> Self {
        let http = crate::http::client_builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client with default TLS builds");
        let owner = format!("{}-{:08x}", std::process::id(), rand::random::<u32>());
        Self {
            store,
            tenants,
            http,
            settings,
            wake,
            tick: Notify::new(),
            tick_at: AtomicI64::new(i64::MAX),
            schedule: std::sync::Mutex::default(),
            owner,
            next_owner: AtomicU64::new(0),
            archived_last_sweep: std::sync::Mutex::default(),
            claims: Claims::default(),
            candidates: std::sync::Mutex::default(),
            handed: std::sync::Mutex::default(),
            // Whatever was left in the store before this process started.
            unread: AtomicBool::new(true),
            workers_here: AtomicBool::new(false),
            shutdown: std::sync::OnceLock::new(),
            metrics: Arc::default(),
        }
    }

    /// Counts into `metrics` (shared with the HTTP side and the Pushary clients).
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// The tenant's Pushary client. A tenant removed from config since its
    /// operations were enqueued reads as unreachable: retried, never permission.
    pub(crate) fn pushary(&self, tenant: &str) -> Result<&PusharyClient, crate::pushary::PusharyError> {
        self.tenants.get(tenant).map(|t| &t.pushary).ok_or_else(|| {
            crate::pushary::PusharyError::Transport(format!("tenant `{tenant}` is not configured"))
        })
    }

    pub(crate) fn effect(&self, tenant: &str, name: &str) -> Option<&EffectTarget> {
        self.tenants.get(tenant).and_then(|t| t.effects.get(name))
    }

    pub fn has_effect(&self, tenant: &str, name: &str) -> bool {
        self.effect(tenant, name).is_some()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Wakes idle workers to read the store for work: work came that no
    /// one named a thread for (a sweep's, another replica's signal). Wakes
    /// one idle worker (or the next to look, if none is idle). A worker
    /// that finds more work than it takes wakes the next, so a burst wakes
    /// as many workers as it needs, and one callback wakes one.
    pub fn wake(&self) {
        self.mark_unread();
        self.wake.notify_one();
    }

    /// The store may hold work no candidate names: the next worker to run
    /// out of candidates reads it.
    fn mark_unread(&self) {
        self.unread.store(true, Ordering::SeqCst);
    }

    /// `offer` for the thread of `op`, just given work.
    pub fn offer_thread_of(&self, op: &Operation) {
        self.offer(&[(op.tenant.clone(), op.thread_id.clone())]);
    }

    /// Threads that were just given work (answers stored for them, an
    /// operation enqueued), put before the workers with a wake-up, so the
    /// one woken takes its thread without reading the store for work first
    /// (a round trip on every callback's way to its effect). A process
    /// without workers names threads to no one: the store's signal reaches
    /// the workers elsewhere.
    pub fn offer(&self, threads: &[ThreadKey]) {
        if !self.workers_here.load(Ordering::SeqCst) {
            return;
        }
        let mut queue = self.queue();
        for t in threads {
            if !queue.contains(t) {
                queue.push_back(t.clone());
            }
        }
        drop(queue);
        self.wake.notify_one();
    }

    /// `offer` for the threads of answers just stored (`threads`), with the
    /// answers the inbox handed on (`BatchInsert::answers`): the worker
    /// that takes such a thread applies its answer at once, its first save
    /// taking the thread's lease, where a visit takes the lease and reads
    /// the thread's work first, a round trip on every answer's way to its
    /// effect (decisions §35). A thread held meanwhile is named again when
    /// let go, and its answer is then applied by the save's rules: a stale
    /// one (the answer applied since) changes nothing.
    /// `applied`: answers applied in the commit that stored them, each
    /// holding its thread's lease for the visit that goes on from it
    /// (decisions §36).
    pub fn stored(
        &self,
        threads: &[ThreadKey],
        answers: Vec<(InboxEntry, Operation)>,
        applied: Vec<Applied>,
    ) {
        if (!answers.is_empty() || !applied.is_empty()) && self.workers_here.load(Ordering::SeqCst) {
            let mut handed = self.handed_lock();
            // Not bounded: `first_save` makes none past the bound.
            for a in applied {
                let key = (a.save.op.tenant.clone(), a.save.op.thread_id.clone());
                // Saved as the workers stopped, after they let the applied
                // answers go: no visit comes, and on SQLite the claim goes
                // (on PostgreSQL the lease runs out).
                if self.stopping() && !self.store.is_postgres() {
                    self.give_claim_back(&a.save);
                    continue;
                }
                handed.insert(key.clone(), Handed::Applied(Box::new(a)));
                // SQLite: the claim held since the save goes to the next
                // worker to take the thread, who finds the answer above.
                self.claims.hand_over(&key);
            }
            for (entry, op) in answers {
                // Bounded: an entry goes when its thread is next visited
                // here, and one whose thread another replica holds may wait
                // long for that. Past the bound, answers are read instead.
                // One applied already holds the thread's lease, and stays.
                let key = (op.tenant.clone(), op.thread_id.clone());
                if handed.len() < MAX_HANDED && !matches!(handed.get(&key), Some(Handed::Applied(_))) {
                    handed.insert(key, Handed::Answer(Box::new((entry, op))));
                }
            }
        }
        self.offer(threads);
    }

    /// The workers are stopping, or stopped.
    fn stopping(&self) -> bool {
        self.shutdown.get().is_some_and(CancellationToken::is_cancelled)
    }

    fn handed_lock(&self) -> std::sync::MutexGuard<'_, HashMap<ThreadKey, Handed>> {
        self.handed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<ThreadKey>> {
        self.candidates.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A step of an operation on a held thread comes due at `at`. Due now,
    /// the holder does it; later, the tick keeper must wake for it, and it
    /// only knows the schedule it read before its nap. Returns whether the
    /// step is for later (kept for the keeper).
    pub(crate) fn scheduled(&self, at: i64) -> bool {
        if at <= now_ms() {
            return false;
        }
        self.schedule_lock().insert(at);
        if at < self.tick_at.load(Ordering::SeqCst) {
            self.tick.notify_one();
        }
        true
    }

    /// A thread let go has a step due at `at`, which a read of the store
    /// made while it was still held may have passed by: the tick keeper
    /// wakes for it, or, due already, the workers look now.
    fn due_later(&self, at: i64) {
        if !self.scheduled(at) {
            self.wake();
        }
    }

    fn schedule_lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<i64>> {
        self.schedule.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long the tick keeper may sleep: until the next step scheduled
    /// here that no read of the store has come after, the next one the
    /// store holds for later (scheduled by any replica), or the safety-net
    /// tick, whichever is first. Steps due already are not counted from
    /// the store: they are being worked, their holder going on with them,
    /// or wait for a worker told of them; counting them woke the keeper
    /// every millisecond while any approval was in flight, to read the
    /// store each time (decisions §33).
    async fn next_nap(&self) -> Duration {
        let now = now_ms();
        let local = self.schedule_lock().first().copied();
        let stored = self.store.next_due_after(now).await.ok().flatten();
        let next = local.into_iter().chain(stored).min();
        let nap = self.settings.idle_poll;
        next.map_or(nap, |at| nap.min(Duration::from_millis(u64::try_from(at - now).unwrap_or(0).max(1))))
    }

    /// The delay before retry number `attempt` (1-based), exponential with
    /// jitter, capped. Attempts are counted in the store, so the schedule
    /// survives restarts.
    pub(crate) fn backoff_ms(&self, attempt: i64) -> i64 {
        let n = usize::try_from(attempt.max(1) - 1).unwrap_or(0).min(64);
        let delay = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(self.settings.retry_initial_ms))
            .with_max_delay(Duration::from_millis(self.settings.retry_max_ms))
            .with_jitter()
            .without_max_times()
            .build()
            .nth(n)
            .unwrap_or(Duration::from_millis(self.settings.retry_max_ms));
        i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)
    }

    /// Takes one thread that has work, does all of it that is due, and
    /// releases it. Returns whether any thread was worked. Tests call this
    /// to drain the queue without sleeping: it reads the store for work
    /// whenever no candidate is left, where a worker reads it only when
    /// something may have put work there that no candidate names.
    pub async fn try_execute_task(&self) -> Result<bool, StoreError> {
        self.visit_next(true).await
    }

    /// `try_execute_task`; `read_store`: read the store for work when the
    /// candidates run out even if nothing says it holds any.
    async fn visit_next(&self, read_store: bool) -> Result<bool, StoreError> {
        let turn = self.next_owner.fetch_add(1, Ordering::Relaxed);
        let visit_owner = format!("{}/{turn}", self.owner);
        let mut refilled = false;
        loop {
            let Some((claim, more)) = self.next_candidate(&mut refilled, read_store).await? else {
                return Ok(false);
            };
            // This visit's, unless an answer applied for it names another.
            let mut owner = visit_owner.clone();
            let (tenant, thread) = claim.key().clone();
            // SQLite serves one process (docs/decisions.md §13): the claim
            // is the whole lease, and two writes per visit are saved.
            let shared = self.store.is_postgres();
            if more {
                self.wake.notify_one();
            }
            // On SQLite only applied answers are handed on (§38).
            let handed = self.handed_lock().remove(claim.key());
            // An answer handed on: applied at once, its first save taking
            // the lease; refused, the thread is taken as any other.
            let mut carried = None;
            if let Some(Handed::Applied(applied)) = handed {
                // Applied in its callback's commit, which took the lease
                // for this visit (decisions §36).
                owner.clone_from(&applied.save.owner);
                match self.go_on_from_applied(*applied).await {
                    Ok(Some(v)) => carried = Some(v),
                    // The lease ran out before a worker came, and is
                    // another's: the thread is its now.
                    Ok(None) => continue,
                    Err(e) => {
                        if shared {
                            let _ = self.store.release_lease(&tenant, &thread, &owner).await;
                        }
                        self.let_go(claim);
                        return Err(e);
                    }
                }
            } else if let Some(Handed::Answer(answer)) = handed {
                let (entry, op) = *answer;
                let visit = Visit { lease_owner: Some(owner.clone()), taking: true, ..Visit::default() };
                let first = VISIT
                    .scope(RefCell::new(visit), async {
                        let applied = self.apply_answer(entry, op, false).await;
                        applied.map(|()| VISIT.with(|v| std::mem::take(&mut *v.borrow_mut())))
                    })
                    .await;
                match first {
                    Ok(v) if v.took_at.is_some() => carried = Some(v),
                    // Its log's transitions were not saved; the visit below
                    // logs what it does instead.
                    Ok(_) => tracing::debug!(
                        tenant,
                        thread_id = thread,
                        "the handed answer's save was refused; the thread is read instead"
                    ),
                    Err(e) => {
                        // The save may have taken the lease before the
                        // visit failed (as after `take_thread` below).
                        let _ = self.store.release_lease(&tenant, &thread, &owner).await;
                        self.let_go(claim);
                        return Err(e);
                    }
                }
            }
            let now = now_ms();
            // On PostgreSQL the lease and the first read of the thread's
            // work are one round trip.
            let first = if shared && carried.is_none() {
                match self
                    .store
                    .take_thread(&tenant, &thread, &owner, now, now + self.settings.lease_ms)
                    .await
                {
                    Ok(Some(work)) => Some(work),
                    // Leased elsewhere: its holder's process hears of new
                    // work from the store's signal, and applies any answer
                    // handed on for the thread meanwhile from the store.
                    Ok(None) => {
                        // Not an answer applied since this visit looked
                        // (the lease it found is the one its commit took
                        // for this process): the thread goes to the
                        // workers again, for the visit that goes on from
                        // it. Let go first: an answer applied after the
                        // look below is offered after it, and finds the
                        // thread free.
                        let key = claim.key().clone();
                        drop(claim);
                        let applied = {
                            let mut handed = self.handed_lock();
                            match handed.get(&key) {
                                Some(Handed::Applied(_)) => true,
                                Some(Handed::Answer(_)) => {
                                    handed.remove(&key);
                                    false
                                }
                                None => false,
                            }
                        };
                        if applied {
                            self.offer(&[key]);
                        }
                        continue;
                    }
                    Err(e) => {
                        // The lease may have been taken before the read
                        // failed: let it go rather than leave the thread
                        // to wait out the lease. The owner names this
                        // visit alone, so this deletes nothing else.
                        let _ = self.store.release_lease(&tenant, &thread, &owner).await;
                        self.let_go(claim);
                        return Err(e);
                    }
                }
            } else {
                None
            };
            // The handed answer's visit goes on with what its saves left
            // due, holding the lease they took, unless one gave it up; the
            // lease's clock, for its renewal, runs from its taking.
            let leased_at = carried.as_ref().and_then(|v| v.took_at).unwrap_or(now);
            let visit = match carried {
                Some(v) => Visit {
                    due_next: v.due_next,
                    lease_owner: shared.then(|| owner.clone()),
                    gave_up: v.gave_up,
                    ..Visit::default()
                },
                None => Visit { lease_owner: shared.then(|| owner.clone()), ..Visit::default() },
            };
            if visit.gave_up {
                self.let_go(claim);
                return Ok(true);
            }
            let result = VISIT
                .scope(RefCell::new(visit), self.work_thread(&claim, &owner, shared, leased_at, first))
                .await;
            // Release even after an error, so the thread does not wait out
            // the lease, unless the visit's last read gave it up.
            let given_up = result.as_ref().is_ok_and(|given_up| *given_up);
            let released = if shared && !given_up {
                self.store.release_lease(&tenant, &thread, &owner).await
            } else {
                Ok(())
            };
            self.let_go(claim);
            result?;
            released?;
            return Ok(true);
        }
    }

    /// Lets a visited thread go, and answers what came for it that the
    /// visit's last read may have missed. (A visit that failed leaves the
    /// store to be read again by its worker's loop.)
    fn let_go(&self, claim: Claim<'_>) {
        match claim.release() {
            (key, Missed::Offered) => self.offer(&[key]),
            (_, Missed::HiddenFromRead) => self.wake(),
            (_, Missed::Nothing) => {}
        }
    }

    /// The next thread with work that no worker of this process is on,
    /// claimed, and whether more candidates wait. Candidates are read from
    /// the store in one query and handed out one by one: a query per
    /// worker visit cost more SQLite time than the work itself (0.7 ms
    /// each, 17,000 of them for 2,000 approvals in `approvald bench`). A
    /// candidate may be stale (its work done since); visiting it costs one
    /// index read. The store is read when the queue runs dry, at most once
    /// per call (`refilled`), so a call always ends; and only if something
    /// may have put work there that no candidate names (`unread`, which
    /// one reader takes), unless `read_store`: after a visit, a read that
    /// found nothing cost an approval about 0.1 ms of PostgreSQL's time and
    /// a round trip (decisions §33).
    async fn next_candidate(
        &self,
        refilled: &mut bool,
        read_store: bool,
    ) -> Result<Option<(Claim<'_>, bool)>, StoreError> {
        loop {
            {
                let mut queue = self.queue();
                while let Some(key) = queue.pop_front() {
                    // Another worker of this process has the thread: skip
                    // it without asking the store (its holder names it again).
                    if let Some(claim) = self.claims.take(key) {
                        return Ok(Some((claim, !queue.is_empty())));
                    }
                }
            }
            if *refilled || !(read_store || self.unread.swap(false, Ordering::SeqCst)) {
                return Ok(None);
            }
            *refilled = true;
            if self.store.is_postgres() {
                self.claims.hidden_from_read();
            }
            let now = now_ms();
            // This read takes every step due by now, unless its thread is
            // held (whose holder goes on with it).
            self.schedule_lock().retain(|&at| at > now);
            // Threads our own workers are on still show as having work
            // until they commit; look past them.
            let limit = 16 + self.claims.busy();
            // A failed read is made again by the worker's loop.
            let (found, cut_short) =
                self.store.threads_with_work(now, i64::try_from(limit).unwrap_or(16)).await?;
            if cut_short {
                // There may be more than the read took: the next worker
                // to finish a visit reads again.
                self.mark_unread();
            }
            self.queue().extend(found);
        }
    }

    /// Does the thread's due work; returns whether the lease was given up,
    /// with the read that found no more (`Store::next_work_or_release`) or
    /// with the save that finished the thread's work (`Visit::gave_up`).
    /// `read`: the thread's work as read with its lease, if it was
    /// (`Store::take_thread`).
    async fn work_thread(
        &self,
        claim: &Claim<'_>,
        owner: &str,
        leased: bool,
        leased_at: i64,
        mut read: Option<Option<ThreadWork>>,
    ) -> Result<bool, StoreError> {
        let (tenant, thread) = (claim.key().0.as_str(), claim.key().1.as_str());
        // The lease was taken at `leased_at`; renewing it is a write, so it
        // is done only once a third of it has passed, not before every step
        // (each step's calls are bounded by timeouts shorter than the lease).
        let mut renewed = leased_at;
        // Bounded, so one busy thread cannot starve the others.
        for _ in 0..64 {
            let now = now_ms();
            if leased && now - renewed >= self.settings.lease_ms / 3 {
                if !self.store.renew_lease(tenant, thread, owner, now + self.settings.lease_ms).await? {
                    tracing::warn!(
                        tenant,
                        thread_id = thread,
                        "lease lost; leaving the thread to its new owner"
                    );
                    return Ok(false);
                }
                renewed = now;
            }
            // The step just saved left its operation due now (the next step
            // of an approval: consume, deliver, record the receipt): the
            // holder goes on with it as saved, without reading it back.
            let saved = VISIT.try_with(|v| v.borrow_mut().due_next.take()).ok().flatten().filter(|op| {
                op.tenant == tenant && op.thread_id == thread && op.due_at.is_some_and(|at| at <= now)
            });
            let (work, given_up) = match (read.take(), saved) {
                (Some(work), _) => (work, false),
                (None, Some(op)) => (Some(ThreadWork::Due(op)), false),
                (None, None) if leased => {
                    claim.reading();
                    self.store.next_work_or_release(tenant, thread, now, owner).await?
                }
                (None, None) => {
                    claim.reading();
                    (self.store.next_work_for_thread(tenant, thread, now).await?, false)
                }
            };
            if leased && matches!(work, Some(ThreadWork::Answer(..) | ThreadWork::Due(_))) {
                // The step's save may be the visit's last look at the thread,
                // giving up the lease (`lease_to_give_up`), and it begins
                // after this. Not when no step follows: the visit's last
                // look was then its read, and a mark after it would pass
                // over the store's reads begun during it.
                claim.reading();
            }
            match work {
                Some(ThreadWork::Answer(entry, op, held_back)) => {
                    self.apply_answer(*entry, op, held_back).await?
                }
                Some(ThreadWork::Due(op)) => self.step(op).await?,
                Some(ThreadWork::Later(at)) => {
                    self.due_later(at);
                    return Ok(given_up);
                }
                None => return Ok(given_up),
            }
            if visit_gave_up() {
                return Ok(true);
            }
        }
        // Saves on a held thread tell no one (`Store::save_held`); work
        // left at the bound is offered to the other workers and replicas.
        self.wake();
        self.store.signal_work();
        Ok(false)
    }

    /// Runs `concurrency` workers and the reconciler until `shutdown`.
    pub fn spawn(self: &Arc<Self>, shutdown: CancellationToken) -> Vec<tokio::task::JoinHandle<()>> {
        self.store.workers_here();
        self.workers_here.store(true, Ordering::SeqCst);
        let _ = self.shutdown.set(shutdown.clone());
        let mut handles = Vec::new();
        for i in 0..self.settings.concurrency {
            let engine = Arc::clone(self);
            let shutdown = shutdown.clone();
            handles.push(tokio::spawn(async move { engine.worker_loop(i, shutdown).await }));
        }
        let engine = Arc::clone(self);
        let reconcile_shutdown = shutdown.clone();
        handles.push(tokio::spawn(async move { engine.reconciler_loop(reconcile_shutdown).await }));
        if self.store.is_postgres() {
            let engine = Arc::clone(self);
            handles.push(tokio::spawn(async move { engine.listen_loop(shutdown).await }));
        }
        handles
    }

    /// PostgreSQL: wake on NOTIFY from any replica, so new work is picked
    /// up within milliseconds rather than on the safety-net tick.
    async fn listen_loop(&self, shutdown: CancellationToken) {
        let Some(pool) = self.store.pg_pool() else { return };
        let mut failures = 0;
        while !shutdown.is_cancelled() {
            let listener = async {
                let mut l = sqlx::postgres::PgListener::connect_with(pool).await?;
                l.listen(crate::store::WORK_CHANNEL).await?;
                Ok::<_, sqlx::Error>(l)
            };
            let mut listener = match listener.await {
                Ok(l) => l,
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "cannot LISTEN; relying on polling until it works");
                    let delay =
                        Duration::from_millis(u64::try_from(self.backoff_ms(failures)).unwrap_or(1000));
                    tokio::select! { () = shutdown.cancelled() => break, () = tokio::time::sleep(delay) => {} }
                    continue;
                }
            };
            failures = 0;
            // Anything committed while we were not listening.
            self.wake();
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    n = listener.try_recv() => match n {
                        // Our own: whoever signalled woke our workers already.
                        Ok(Some(n)) if n.payload() == self.store.instance() => {}
                        // Another's signal; or (None) the connection was
                        // lost and is made again on the next call, and what
                        // was sent meanwhile is not heard: look anyway.
                        Ok(_) => self.wake(),
                        Err(e) => {
                            tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                            break;
                        }
                    }
                }
            }
        }
    }

    async fn worker_loop(&self, index: usize, shutdown: CancellationToken) {
        let mut failures: i64 = 0;
        while !shutdown.is_cancelled() {
            match self.visit_next(false).await {
                Ok(true) => {
                    failures = 0;
                    continue;
                }
                Ok(false) => failures = 0,
                Err(e) => {
                    failures += 1;
                    let delay = self.backoff_ms(failures);
                    tracing::warn!(worker = index, error = %e, retry_in_ms = delay, "worker cannot reach the store");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(u64::try_from(delay).unwrap_or(1000))) => {}
                    }
                    // What failed (a visit, a read of the store for work)
                    // may have left work behind.
                    self.mark_unread();
                    continue;
                }
            }
            // Registered only now, about to idle: a worker registered through
            // its visits took wake-ups meant for idle ones (tokio gives
            // `notify_one` to the longest waiter), and their work waited for
            // its visit to end. One given since the look above went to an
            // idle sibling, or is kept for the next to register: this one.
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Sleep until woken, until the earliest scheduled retry, or the
            // safety-net tick. One worker keeps the tick; it wakes the others
            // when it finds more than it can take, so an idle process wakes
            // a few times a minute, not once per worker per tick.
            // The tick keeper also wakes for the earliest scheduled retry (and
            // wakes the others if it finds more than it takes); asking the
            // store for it on every worker's every nap cost two reads per
            // approval under load.
            let mut nap = self.settings.idle_poll * 12;
            let tick = self.tick.notified();
            tokio::pin!(tick);
            if index == 0 {
                // Registered before the schedule is read: a step scheduled
                // after the read wakes us (`scheduled`).
                tick.as_mut().enable();
                nap = self.next_nap().await;
                let wake_at = now_ms().saturating_add(i64::try_from(nap.as_millis()).unwrap_or(i64::MAX));
                self.tick_at.store(wake_at, Ordering::SeqCst);
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = &mut notified => {}
                // The safety net, and the tick keeper's schedule: both are
                // for work that no one names.
                () = &mut tick, if index == 0 => self.mark_unread(),
                () = tokio::time::sleep(nap) => self.mark_unread(),
            }
            if index == 0 {
                self.tick_at.store(i64::MAX, Ordering::SeqCst);
            }
        }
        self.let_applied_go().await;
    }
}

#[cfg(test)]
mod tests;
