//! Group commit for the callback receiver: callbacks arriving together are
//! committed together, in one transaction, and each is acknowledged only
//! after the commit that holds it. One fsync then covers many callbacks,
//! which is what lets ingest outrun single-row commits (docs/performance.md).
//!
//! Writers take whatever is queued when they are free (up to `MAX_BATCH`),
//! so a lone callback is committed at once, with no batching delay. SQLite
//! has one writer (it serializes writes anyway); PostgreSQL has two, so
//! one batch is collected while another is being flushed. Not more: the
//! WAL's flushes are one at a time, so each extra writer split the same
//! callbacks into smaller batches, each paying a statement and a flush of
//! its own (decisions §27: the machine's CPU per callback was up to a third
//! higher with four writers than with two, and they acknowledged fewer).

use std::sync::Arc;

use tokio::sync::{Mutex, mpsc, oneshot};

use super::{InboxInsert, Store, StoreError};

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

/// Told the threads whose operations now have an answer waiting.
type OnStored = Arc<dyn Fn(&[(String, String)]) + Send + Sync>;

type Job = (OwnedInboxEntry, oneshot::Sender<Result<InboxInsert, StoreError>>);

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
                Ok(threads) if !threads.is_empty() => on_stored(&threads),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot look again for the operations of stored callbacks")
                }
            }
        }
    });
    tx
}

impl InboxWriter {
    /// Starts the writer tasks. They end when every handle is dropped,
    /// after committing what was queued.
    /// `on_stored` gets the threads whose operations now have an answer
    /// waiting, after the commit that holds it.
    pub fn start(store: Store, on_stored: impl Fn(&[(String, String)]) + Send + Sync + 'static) -> Self {
        let (tx, rx) = mpsc::channel::<Job>(MAX_BATCH * 4);
        let rx = Arc::new(Mutex::new(rx));
        let on_stored: OnStored = Arc::new(on_stored);
        let pg = store.is_postgres();
        let second_look = pg.then(|| spawn_second_look(store.clone(), Arc::clone(&on_stored)));
        let writers = if pg { 2 } else { 1 };
        for _ in 0..writers {
            let (store, rx, on_stored) = (store.clone(), Arc::clone(&rx), Arc::clone(&on_stored));
            let second_look = second_look.clone();
            let look_again = move |unmarked: Vec<i64>| {
                let second_look = second_look.clone();
                async move {
                    if let Some(tx) = second_look.filter(|_| !unmarked.is_empty()) {
                        let _ = tx.send(unmarked).await;
                    }
                }
            };
            let task = async move {
                let mut jobs = Vec::with_capacity(MAX_BATCH);
                loop {
                    {
                        let mut rx = rx.lock().await;
                        if rx.recv_many(&mut jobs, MAX_BATCH).await == 0 {
                            return;
                        }
                    }
                    let (entries, replies): (Vec<OwnedInboxEntry>, Vec<_>) = jobs.drain(..).unzip();
                    match store.insert_inbox_batch(&entries).await {
                        Ok(batch) => {
                            // Committed, nothing acknowledged and no worker
                            // woken yet: a crash here leaves the callbacks to
                            // the next process (tests/it/crash.rs). Here rather
                            // than in the handler, so that no worker of this
                            // process has begun on them when the process dies.
                            crate::fault::point("after_inbox_commit");
                            if !batch.threads.is_empty() {
                                on_stored(&batch.threads);
                            }
                            for (reply, r) in replies.into_iter().zip(batch.results) {
                                let _ = reply.send(Ok(r));
                            }
                            look_again(batch.unmarked).await;
                        }
                        // One bad entry must not fail its neighbours: retry
                        // them one by one (in an outage each fails fast).
                        Err(e) if entries.len() > 1 => {
                            tracing::warn!(error = %e, batch = entries.len(), "inbox batch failed; retrying singly");
                            for (entry, reply) in entries.into_iter().zip(replies) {
                                let mut r = store.insert_inbox_batch(std::slice::from_ref(&entry)).await;
                                if let Ok(b) = &r
                                    && !b.threads.is_empty()
                                {
                                    on_stored(&b.threads);
                                }
                                let unmarked =
                                    r.as_mut().map(|b| std::mem::take(&mut b.unmarked)).unwrap_or_default();
                                let _ = reply.send(r.map(|mut b| b.results.remove(0)));
                                look_again(unmarked).await;
                            }
                        }
                        Err(e) => {
                            for reply in replies {
                                let _ = reply.send(Err(StoreError::Unavailable(e.to_string())));
                            }
                        }
                    }
                }
            };
            if pg {
                tokio::spawn(task);
            } else {
                super::sqlite_group::spawn(task);
            }
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
