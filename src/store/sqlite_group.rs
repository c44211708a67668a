//! Group commit for SQLite's writes.
//!
//! SQLite admits one writer and a durable commit costs an fsync, so a
//! process that commits each write on its own can do no more writes per
//! second than the disk does fsyncs, however many workers it runs. Here
//! every write of the process runs, in arrival order, inside one open
//! transaction on one connection (each write that opens a transaction gets
//! a SAVEPOINT, so its own failure rolls back only its own statements); a
//! committer task commits whatever has run since the last commit, and each
//! writer returns only once the commit that holds its writes succeeded.
//! While one commit flushes, the next writers queue; they run and commit
//! together. Nothing is acknowledged before its own commit.
//!
//! If a commit fails, every writer in it gets the error: their writes are
//! gone together, as a failed transaction's would be. A writer that read
//! another's uncommitted write shares its fate, because they commit
//! together or not at all.

use std::sync::{Arc, Weak};

use sqlx::{Sqlite, SqliteConnection, SqlitePool, Transaction};
use tokio::sync::{Mutex, MutexGuard, Notify, watch};

use super::StoreError;

/// The outcome of one commit, shared by every writer in it.
type CommitOutcome = Option<Result<(), String>>;

#[derive(Debug)]
pub(crate) struct SqliteGroup {
    pool: SqlitePool,
    state: Mutex<State>,
    /// Wakes the committer: a writer has run.
    kick: Arc<Notify>,
}

#[derive(Debug)]
struct State {
    tx: Option<Transaction<'static, Sqlite>>,
    /// Turns taken in the open transaction.
    turns: u32,
    /// Tells the writers of the open transaction how its commit went.
    outcome: watch::Sender<CommitOutcome>,
}

/// A writer's turn: holds the connection, in the open transaction, until
/// `finish`.
pub(crate) struct Turn<'a> {
    guard: MutexGuard<'a, State>,
    kick: &'a Notify,
}

impl SqliteGroup {
    pub(crate) fn new(pool: SqlitePool) -> Arc<Self> {
        let kick = Arc::new(Notify::new());
        let group = Arc::new(Self {
            pool,
            state: Mutex::new(State { tx: None, turns: 0, outcome: watch::channel(None).0 }),
            kick: Arc::clone(&kick),
        });
        tokio::spawn(committer(Arc::downgrade(&group), kick));
        group
    }

    /// Waits for this writer's turn (in arrival order) and opens the
    /// shared transaction if none is open.
    pub(crate) async fn turn(&self) -> Result<Turn<'_>, StoreError> {
        let mut guard = self.state.lock().await;
        if guard.tx.is_none() {
            guard.tx = Some(self.pool.begin_with("BEGIN IMMEDIATE").await?);
        }
        guard.turns += 1;
        Ok(Turn { guard, kick: &self.kick })
    }
}

impl Turn<'_> {
    pub(crate) fn conn(&mut self) -> &mut SqliteConnection {
        self.guard.tx.as_mut().expect("a turn always has the transaction open")
    }

    /// Ends the turn. A writer that succeeded waits for the commit that
    /// holds its writes; one that failed has nothing of its own to commit
    /// (its savepoint is rolled back) and returns at once.
    pub(crate) async fn finish<T>(self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        let mut outcome = self.guard.outcome.subscribe();
        drop(self);
        let value = result?;
        let settled = outcome.wait_for(Option::is_some).await;
        match settled.as_deref() {
            Ok(Some(Ok(()))) => Ok(value),
            Ok(Some(Err(e))) => Err(StoreError::Unavailable(format!("commit failed: {e}"))),
            // The committer is gone with the store: the commit never happened.
            Ok(None) | Err(_) => {
                Err(StoreError::Unavailable("the store was closed before the commit".into()))
            }
        }
    }
}

impl Drop for Turn<'_> {
    // Also on a cancelled writer, so a transaction is never left open
    // holding SQLite's write lock.
    fn drop(&mut self) {
        self.kick.notify_one();
    }
}

impl Drop for SqliteGroup {
    fn drop(&mut self) {
        self.kick.notify_one();
    }
}

/// Commits the open transaction each time a writer has run. Its turn on
/// the lock comes after every writer that queued while the last commit
/// flushed, so they all ride on this one.
async fn committer(group: Weak<SqliteGroup>, kick: Arc<Notify>) {
    loop {
        kick.notified().await;
        let Some(group) = group.upgrade() else { return };
        let mut state = group.state.lock().await;
        let Some(tx) = state.tx.take() else { continue };
        let started = std::time::Instant::now();
        let result = tx.commit().await.map_err(|e| e.to_string());
        tracing::trace!(
            turns = state.turns,
            commit_us = started.elapsed().as_micros(),
            "SQLite group commit"
        );
        state.turns = 0;
        if let Err(e) = &result {
            tracing::error!(error = %e, "SQLite group commit failed; its writers get the error");
        }
        let next = watch::channel(None).0;
        let done = std::mem::replace(&mut state.outcome, next);
        done.send_replace(Some(result));
    }
}
