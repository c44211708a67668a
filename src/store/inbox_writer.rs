//! Group commit for the callback receiver: callbacks arriving together are
//! committed together, in one transaction, and each is acknowledged only
//! after the commit that holds it. One fsync then covers many callbacks,
//! which is what lets ingest outrun single-row commits (docs/performance.md).
//!
//! A writer takes whatever is queued when it is free (up to `MAX_BATCH`),
//! so a lone callback is committed at once, with no batching delay, and
//! the next batch holds every callback that arrived during the last one.
//! SQLite has one writer (it serializes writes anyway). PostgreSQL has one
//! and a standby: the standby commits the callbacks queued behind a batch
//! of the first that takes longer than `STANDBY_AFTER`, so a batch held up
//! does not hold up the rest (decisions §29). Two writers taking turns
//! split the same callbacks into smaller batches, each paying a statement
//! and a flush of its own, and the WAL's flushes are one at a time anyway
//! (§27: more writers, more CPU per callback, fewer acknowledged).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, Notify, mpsc, oneshot};

use super::{Applied, InboxEntry, InboxInsert, Operation, Store, StoreError};

/// Largest number of callbacks in one transaction.
pub const MAX_BATCH: usize = 256;

/// A verified callback, owned, on its way to the inbox.
#[derive(Debug, Clone)]
pub struct OwnedInboxEntry {
    pub tenant: String,
    pub correlation_id: String,
    pub answer: String,
    pub answered_at: Option<String>,
    pub body: Vec<u8>,
    pub source: &'static str,
    pub received_at: i64,
}

/// Told the threads whose operations now have an answer waiting, the
/// answers handed on with their operations (`BatchInsert::answers`) and
/// those applied in the batch's commit (`BatchInsert::applied`).
type OnStored = Arc<dyn Fn(&[(String, String)], Vec<(InboxEntry, Operation)>, Vec<Applied>) + Send + Sync>;

/// Asked for the first save of each answer stored for a pending
/// operation, made in the batch's own commit (decisions §36, §38).
pub type AnswerSaves = Arc<dyn super::save::FirstSave>;

type Job = (OwnedInboxEntry, oneshot::Sender<Result<InboxInsert, StoreError>>);

/// The callbacks waiting for a writer, shared by the writers.
type Queue = Arc<Mutex<mpsc::Receiver<Job>>>;

/// How long PostgreSQL's first writer may take over a batch before the
/// standby commits what is queued behind it. Several times a batch's
/// usual commit, even on a slow-flushing day (decisions §29).
const STANDBY_AFTER: Duration = Duration::from_millis(10);

/// The receiver's handle; cheap to clone.
#[derive(Clone, Debug)]
pub struct InboxWriter {
    tx: mpsc::Sender<Job>,
}

/// Looks once more, after the commit and off the acknowledgement's path,
/// for the operations of stored rows that marked none: their decision ids
/// may have been committed while the rows' statement ran
/// (`Store::mark_stored_unmarked`). One task for every writer, taking all
/// the rows queued by then in one statement: under load such rows are
/// every callback for a decision nobody opened (the bench's ingest), and a
/// look per batch, on the writer's own way to its next batch, cost a
/// fourth of PostgreSQL's ingest rate. Lost in a crash, or failing, the
/// answers wait for the reconciler's poll, as they would have.
fn spawn_second_look(store: Store, on_stored: OnStored) -> mpsc::Sender<Vec<i64>> {
    let (tx, mut rx) = mpsc::channel::<Vec<i64>>(64);
    tokio::spawn(async move {
        let mut queued = Vec::new();
        while rx.recv_many(&mut queued, 64).await > 0 {
            let ids: Vec<i64> = queued.drain(..).flatten().collect();
            match store.mark_stored_unmarked(&ids).await {
                Ok(threads) if !threads.is_empty() => on_stored(&threads, Vec::new(), Vec::new()),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot look again for the operations of stored callbacks")
                }
            }
        }
    });
    tx
}

/// The first PostgreSQL writer's batches, watched by the standby.
#[derive(Default)]
struct Watch {
    /// Odd while the first writer is committing a batch: each batch adds
    /// one when it begins and one when it ends, so the standby can tell
    /// the batch it timed from the next.
    turn: AtomicU64,
    /// Told when a batch begins, and when the first writer stops.
    begun: Notify,
    stopped: AtomicBool,
}

/// What every writer does with a batch: commit it, then answer each
/// callback and hand on its thread.
#[derive(Clone)]
struct Committer {
    store: Store,
    on_stored: OnStored,
    first_saves: Option<AnswerSaves>,
    /// The last batch stored answers for pending operations: the next
    /// makes their first saves in its transaction (decisions §36). A batch
    /// of callbacks for which none is pending (a flood of strays, the
    /// bench's ingest) is its one statement again, without the
    /// transaction's two round trips on the writer's way to its next.
    answers_seen: Arc<AtomicBool>,
    second_look: Option<mpsc::Sender<Vec<i64>>>,
}

impl Committer {
    async fn look_again(&self, unmarked: Vec<i64>) {
        if let Some(tx) = self.second_look.as_ref().filter(|_| !unmarked.is_empty()) {
            let _ = tx.send(unmarked).await;
        }
    }

    async fn commit(&self, jobs: &mut Vec<Job>) {
        let (entries, replies): (Vec<OwnedInboxEntry>, Vec<_>) = jobs.drain(..).unzip();
        // SQLite's batch gives its first saves no statement of their own
        // unless it has answers to apply: nothing to spare it.
        let first_saves = self
            .first_saves
            .as_deref()
            .filter(|_| !self.store.is_postgres() || self.answers_seen.load(Ordering::Relaxed))
            .map(|f| f as super::FirstSaves<'_>);
        match self.store.insert_inbox_batch_with(&entries, first_saves).await {
            Ok(mut batch) => {
                // Committed, nothing acknowledged and no worker woken yet:
                // a crash here leaves the callbacks to the next process
                // (tests/it/crash.rs). Here rather than in the handler, so
                // that no worker of this process has begun on them when
                // the process dies.
                crate::fault::point("after_inbox_commit");
                self.answers_seen
                    .store(!batch.answers.is_empty() || !batch.applied.is_empty(), Ordering::Relaxed);
                if !batch.threads.is_empty() {
                    (self.on_stored)(
                        &batch.threads,
                        std::mem::take(&mut batch.answers),
                        std::mem::take(&mut batch.applied),
                    );
                }
                for (reply, r) in replies.into_iter().zip(batch.results) {
                    let _ = reply.send(Ok(r));
                }
                self.look_again(batch.unmarked).await;
            }
            // One bad entry must not fail its neighbours: retry them one by
            // one (in an outage each fails fast).
            Err(e) if entries.len() > 1 => {
                tracing::warn!(error = %e, batch = entries.len(), "inbox batch failed; retrying singly");
                for (entry, reply) in entries.into_iter().zip(replies) {
                    let mut r =
                        self.store.insert_inbox_batch_with(std::slice::from_ref(&entry), first_saves).await;
                    if let Ok(b) = &mut r
                        && !b.threads.is_empty()
                    {
                        (self.on_stored)(
                            &b.threads,
                            std::mem::take(&mut b.answers),
                            std::mem::take(&mut b.applied),
                        );
                    }
                    let unmarked = r.as_mut().map(|b| std::mem::take(&mut b.unmarked)).unwrap_or_default();
                    let _ = reply.send(r.map(|mut b| b.results.remove(0)));
                    self.look_again(unmarked).await;
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(StoreError::Unavailable(e.to_string())));
                }
            }
        }
    }
}

/// The writer: takes whatever is queued when it is free. `watch`, on
/// PostgreSQL, tells the standby when each batch begins and ends.
async fn first_writer(committer: Committer, rx: Queue, watch: Option<Arc<Watch>>) {
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    loop {
        if rx.lock().await.recv_many(&mut jobs, MAX_BATCH).await == 0 {
            break;
        }
        if let Some(w) = &watch {
            w.turn.fetch_add(1, Ordering::AcqRel);
            w.begun.notify_one();
        }
        committer.commit(&mut jobs).await;
        if let Some(w) = &watch {
            w.turn.fetch_add(1, Ordering::AcqRel);
        }
    }
    if let Some(w) = watch {
        w.stopped.store(true, Ordering::Release);
        w.begun.notify_one();
    }
}

/// PostgreSQL's second writer: idle while the first keeps up, it commits
/// what is queued behind a batch of the first that has taken longer than
/// `STANDBY_AFTER`, and goes on doing so until that batch is done. So the
/// first writer's batches hold every callback that arrived during the
/// last one, and a batch held up (a row lock, a backend or task not run)
/// does not hold up the callbacks behind it.
async fn standby_writer(committer: Committer, rx: Queue, watch: Arc<Watch>) {
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    loop {
        watch.begun.notified().await;
        if watch.stopped.load(Ordering::Acquire) {
            return;
        }
        let turn = watch.turn.load(Ordering::Acquire);
        if turn.is_multiple_of(2) {
            continue;
        }
        tokio::time::sleep(STANDBY_AFTER).await;
        while watch.turn.load(Ordering::Acquire) == turn {
            if rx.lock().await.recv_many(&mut jobs, MAX_BATCH).await == 0 {
                return;
            }
            committer.commit(&mut jobs).await;
        }
    }
}

impl InboxWriter {
    /// Starts the writer tasks. They end when every handle is dropped,
    /// after committing what was queued.
    /// `on_stored` gets the threads whose operations now have an answer
    /// waiting, after the commit that holds it; `first_saves` gives the
    /// answers' first saves the commit makes.
    pub fn start(
        store: Store,
        on_stored: impl Fn(&[(String, String)], Vec<(InboxEntry, Operation)>, Vec<Applied>)
        + Send
        + Sync
        + 'static,
        first_saves: Option<AnswerSaves>,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<Job>(MAX_BATCH * 4);
        let rx: Queue = Arc::new(Mutex::new(rx));
        let on_stored: OnStored = Arc::new(on_stored);
        let pg = store.is_postgres();
        let second_look = pg.then(|| spawn_second_look(store.clone(), Arc::clone(&on_stored)));
        let answers_seen = Arc::new(AtomicBool::new(true));
        let committer = Committer { store, on_stored, first_saves, answers_seen, second_look };
        if pg {
            let watch = Arc::new(Watch::default());
            tokio::spawn(standby_writer(committer.clone(), Arc::clone(&rx), Arc::clone(&watch)));
            tokio::spawn(first_writer(committer, rx, Some(watch)));
        } else {
            super::sqlite_group::spawn(first_writer(committer, rx, None));
        }
        Self { tx }
    }

    /// Commits one callback (with whatever else is queued) and returns
    /// once it is durable.
    pub async fn insert(&self, entry: OwnedInboxEntry) -> Result<InboxInsert, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send((entry, reply))
            .await
            .map_err(|_| StoreError::Unavailable("the inbox writer has stopped".into()))?;
        answer.await.map_err(|_| StoreError::Unavailable("the inbox writer has stopped".into()))?
    }
}
