//! Group commit for SQLite's writes.
//!
//! SQLite admits one writer and a durable commit costs an fsync, so a
//! process that commits each write on its own can do no more writes per
//! second than the disk does fsyncs, however many workers it runs. Here
//! every write of the process runs, in the order it takes its turn (saves
//! in the order they queued: they take turns in batches), inside one open
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::{Connection, Database, Sqlite, SqliteConnection, SqlitePool};
use sqlx_core::transaction::TransactionManager;
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
    /// Since start, for `/metrics`: how much of the time the one writer
    /// was taken (writers running, commits flushing). Near all of it, the
    /// node writes as fast as SQLite lets one process (docs/performance.md).
    busy: Counters,
    /// Tests hold the commits back, to put several turns in one
    /// transaction for certain: the committer has a thread of its own.
    #[cfg(test)]
    paused: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct Counters {
    writing_us: AtomicU64,
    committing_us: AtomicU64,
    writes: AtomicU64,
    commits: AtomicU64,
}

/// What the writer has done since the store was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WriterBusy {
    /// Writers holding their turn (running their statements).
    pub writing: Duration,
    /// Commits flushing, every writer waiting.
    pub committing: Duration,
    pub writes: u64,
    pub commits: u64,
}

/// Begins, commits and rolls back the writer's transaction on its own
/// connection, keeping sqlx's count of open transactions, so a write's
/// `begin()` inside it makes a SAVEPOINT.
type Tm = <Sqlite as Database>::TransactionManager;

#[derive(Debug)]
struct State {
    /// The writer's own connection, taken out of the pool: every write of
    /// the process runs on it. A pool hands out its connections in turn,
    /// and a SQLite connection drops its whole page cache when another
    /// connection has written since its last transaction, so a writer
    /// that moved between connections began each transaction cold,
    /// reading its index pages from the OS again (docs/performance.md).
    /// Replaced after a failed commit or an abandoned transaction, when
    /// what SQLite has open on it is not known. Whether a transaction is
    /// open on it is sqlx's count of them, kept by `Tm`: one account.
    conn: Option<SqliteConnection>,
    /// Turns taken in the open transaction.
    turns: u32,
    /// For the trace line of each commit (`RUST_LOG=approvald::store=trace`):
    /// how long its writers waited for their turns and held them, and when
    /// the last commit was. What bounds the writer is read from these
    /// (docs/performance.md).
    wait_us: u64,
    hold_us: u64,
    last_commit: Option<std::time::Instant>,
    /// Tells the writers of the open transaction how its commit went.
    outcome: watch::Sender<CommitOutcome>,
}

impl State {
    /// A transaction is open on the writer's connection.
    fn open(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| Tm::get_transaction_depth(c) > 0)
    }
}

/// A writer's turn: holds the connection, in the open transaction, until
/// `finish`.
pub(crate) struct Turn<'a> {
    guard: MutexGuard<'a, State>,
    kick: &'a Notify,
    busy: &'a Counters,
    held: std::time::Instant,
    /// The callers' writes it ran, for `/metrics`: one, or a batch's.
    writes: u64,
}

impl SqliteGroup {
    pub(crate) fn new(pool: SqlitePool) -> Arc<Self> {
        let kick = Arc::new(Notify::new());
        let group = Arc::new(Self {
            pool,
            state: Mutex::new(State {
                conn: None,
                turns: 0,
                wait_us: 0,
                hold_us: 0,
                last_commit: None,
                outcome: watch::channel(None).0,
            }),
            kick: Arc::clone(&kick),
            busy: Counters::default(),
            #[cfg(test)]
            paused: false.into(),
        });
        spawn(committer(Arc::downgrade(&group), kick));
        group
    }

    /// Waits for this writer's turn (in arrival order) and opens the
    /// shared transaction if none is open.
    pub(crate) async fn turn(&self) -> Result<Turn<'_>, StoreError> {
        let asked = std::time::Instant::now();
        let mut guard = self.state.lock().await;
        // The writer is taken from here: opening the transaction is part of its work.
        let held = std::time::Instant::now();
        guard.wait_us += asked.elapsed().as_micros() as u64;
        if !guard.open() {
            if guard.conn.is_none() {
                guard.conn = Some(self.pool.acquire().await?.detach());
            }
            let conn = guard.conn.as_mut().expect("just opened");
            if let Err(e) = Tm::begin(conn, Some(sqlx::SqlSafeStr::into_sql_str("BEGIN IMMEDIATE"))).await {
                guard.conn = None;
                return Err(e.into());
            }
        }
        guard.turns += 1;
        Ok(Turn { guard, kick: &self.kick, busy: &self.busy, held, writes: 1 })
    }

    pub(crate) fn busy(&self) -> WriterBusy {
        let us = |c: &AtomicU64| Duration::from_micros(c.load(Ordering::Relaxed));
        WriterBusy {
            writing: us(&self.busy.writing_us),
            committing: us(&self.busy.committing_us),
            writes: self.busy.writes.load(Ordering::Relaxed),
            commits: self.busy.commits.load(Ordering::Relaxed),
        }
    }
}

impl Turn<'_> {
    pub(crate) fn conn(&mut self) -> &mut SqliteConnection {
        self.guard.conn.as_mut().expect("a turn always has the transaction open")
    }

    /// Ends the turn. A writer that succeeded waits for the commit that
    /// holds its writes; one that failed has nothing of its own to commit
    /// (its statement, or its transaction's savepoint, was undone) and
    /// returns at once.
    pub(crate) async fn finish<T>(self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        let committed = self.release();
        let value = result?;
        committed.wait().await?;
        Ok(value)
    }

    /// Ends the turn without waiting: what it ran is in the open
    /// transaction, whose commit the returned handle waits for. For a turn
    /// that ran the writes of several callers (the batched saves).
    pub(crate) fn release(self) -> Committed {
        let committed = Committed(self.guard.outcome.subscribe());
        drop(self);
        committed
    }

    /// Gives up the open transaction (rolled back as it is dropped): every
    /// writer in it, this turn's and those waiting for its commit, gets
    /// `reason`. For a turn whose writes may have been half kept.
    pub(crate) fn abandon(mut self, reason: &str) {
        give_up(&mut self.guard, reason);
    }

    /// The turn ran `n` callers' writes, not one: `/metrics` counts writes.
    pub(crate) fn ran_writes(&mut self, n: u64) {
        self.writes = n;
    }
}

/// The commit of the transaction a turn's writes went into.
#[derive(Clone, Debug)]
pub(crate) struct Committed(watch::Receiver<CommitOutcome>);

impl Committed {
    pub(crate) async fn wait(mut self) -> Result<(), StoreError> {
        let settled = self.0.wait_for(Option::is_some).await;
        match settled.as_deref() {
            Ok(Some(Ok(()))) => Ok(()),
            Ok(Some(Err(e))) => Err(StoreError::Unavailable(format!("commit failed: {e}"))),
            // The committer is gone with the store: the commit never happened.
            Ok(None) | Err(_) => {
                Err(StoreError::Unavailable("the store was closed before the commit".into()))
            }
        }
    }
}

/// The open transaction goes: rolled back as its connection is dropped,
/// and every writer in it gets `reason`.
fn give_up(state: &mut State, reason: &str) {
    state.conn = None;
    state.turns = 0;
    let next = watch::channel(None).0;
    std::mem::replace(&mut state.outcome, next).send_replace(Some(Err(reason.to_string())));
}

impl Drop for Turn<'_> {
    // Also on a cancelled writer, so a transaction is never left open
    // holding SQLite's write lock.
    fn drop(&mut self) {
        // A writer that panicked in its turn (the inbox's runs the
        // engine's decisions, decisions §38) may have left its writes half
        // made: they are not committed with the others.
        if std::thread::panicking() && self.guard.conn.is_some() {
            give_up(&mut self.guard, "a writer panicked in its turn");
        }
        let held = self.held.elapsed().as_micros() as u64;
        self.guard.hold_us += held;
        self.busy.writing_us.fetch_add(held, Ordering::Relaxed);
        self.busy.writes.fetch_add(self.writes, Ordering::Relaxed);
        self.kick.notify_one();
    }
}

impl Drop for SqliteGroup {
    fn drop(&mut self) {
        self.kick.notify_one();
    }
}

/// Runs a task of SQLite's writer (the committer, the batched saves, the
/// inbox writer) on a thread of its own, one per process, not among the
/// request handlers. Each statement the writer runs is two hand-offs
/// between its task and its connection's thread; on the shared runtime
/// the task, woken, waited behind every handler queued on the two cores
/// (hundreds of microseconds under load, per statement, with the one
/// writer held), where here it runs when its thread is woken
/// (docs/performance.md). Tasks end with their store, and the thread then
/// sleeps, taking nothing.
pub(crate) fn spawn<F>(task: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    static WRITER: std::sync::OnceLock<tokio::runtime::Handle> = std::sync::OnceLock::new();
    let handle = WRITER.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime for the SQLite writer");
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .expect("a thread for the SQLite writer");
        handle
    });
    handle.spawn(task);
}

/// Commits the open transaction each time a writer has run. Its turn on
/// the lock comes after every writer that queued while the last commit
/// flushed, so they all ride on this one.
async fn committer(group: Weak<SqliteGroup>, kick: Arc<Notify>) {
    loop {
        kick.notified().await;
        let Some(group) = group.upgrade() else { return };
        let mut state = group.state.lock().await;
        #[cfg(test)]
        if group.paused.load(Ordering::Relaxed) {
            continue;
        }
        group.commit(&mut state).await;
    }
}

impl SqliteGroup {
    /// Commits the open transaction, if any, and tells its writers.
    async fn commit(&self, state: &mut State) {
        if !state.open() {
            return;
        }
        let started = std::time::Instant::now();
        let conn = state.conn.as_mut().expect("an open transaction has its connection");
        // With a savepoint left open, sqlx releases it and calls that the
        // commit: the writers would be told their writes are durable. The
        // count is read once the commit is answered, so a savepoint's
        // roll-back queued before it has been done (read before, it may
        // not have been).
        let result = match Tm::commit(conn).await.map(|()| Tm::get_transaction_depth(conn)) {
            Ok(0) => Ok(()),
            Ok(depth) => Err(format!("the writer's transaction is still {depth} deep after its commit")),
            Err(e) => Err(e.to_string()),
        };
        if result.is_err() {
            state.conn = None;
        }
        let commit_us = started.elapsed().as_micros() as u64;
        self.busy.committing_us.fetch_add(commit_us, Ordering::Relaxed);
        self.busy.commits.fetch_add(1, Ordering::Relaxed);
        let cycle_us = state.last_commit.map_or(0, |l| l.elapsed().as_micros());
        state.last_commit = Some(std::time::Instant::now());
        tracing::trace!(
            turns = state.turns,
            wait_us = state.wait_us,
            hold_us = state.hold_us,
            cycle_us,
            commit_us,
            "SQLite group commit"
        );
        state.turns = 0;
        state.wait_us = 0;
        state.hold_us = 0;
        if let Err(e) = &result {
            tracing::error!(error = %e, "SQLite group commit failed; its writers get the error");
        }
        let next = watch::channel(None).0;
        let done = std::mem::replace(&mut state.outcome, next);
        done.send_replace(Some(result));
    }

    /// Holds the commits back (`true`) or lets them go on.
    #[cfg(test)]
    pub(crate) fn pause_commits(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
        self.kick.notify_one();
    }

    /// Commits what is open and closes the writer's connection, for a
    /// store being closed. A later write opens a new one.
    pub(crate) async fn close(&self) {
        let mut state = self.state.lock().await;
        self.commit(&mut state).await;
        if let Some(conn) = state.conn.take() {
            let _ = conn.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

    use super::*;

    async fn group() -> (tempfile::TempDir, SqlitePool, Arc<SqliteGroup>) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let url = format!("sqlite://{}", dir.path().join("g.db").display());
        let options = SqliteConnectOptions::from_str(&url).expect("a SQLite URL").create_if_missing(true);
        let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options).await.expect("opens");
        sqlx::raw_sql("CREATE TABLE t (v INTEGER NOT NULL)").execute(&pool).await.expect("creates");
        let group = SqliteGroup::new(pool.clone());
        (dir, pool, group)
    }

    async fn values(pool: &SqlitePool) -> Vec<i64> {
        sqlx::query_scalar("SELECT v FROM t ORDER BY v").fetch_all(pool).await.expect("reads")
    }

    // An abandoned transaction takes every write in it down, the earlier
    // writers' too, and the next writer starts a new one.
    #[tokio::test]
    async fn an_abandoned_turn_fails_every_write_of_its_transaction() {
        let (_dir, pool, group) = group().await;
        group.pause_commits(true);
        let mut first = group.turn().await.expect("a turn");
        sqlx::query("INSERT INTO t VALUES (1)").execute(&mut *first.conn()).await.expect("runs");
        let committed = first.release();
        let mut second = group.turn().await.expect("a turn, before the commit");
        sqlx::query("INSERT INTO t VALUES (2)").execute(&mut *second.conn()).await.expect("runs");
        second.abandon("broken");
        group.pause_commits(false);
        assert!(committed.wait().await.is_err_and(|e| e.to_string().contains("broken")));
        let mut third = group.turn().await.expect("a turn");
        let r = sqlx::query("INSERT INTO t VALUES (3)").execute(&mut *third.conn()).await.map(|_| ());
        third.finish(r.map_err(StoreError::from)).await.expect("commits");
        assert_eq!(values(&pool).await, vec![3]);
    }

    // A writer that panics in its turn takes the open transaction down:
    // its half-made writes are never committed, nor those beside them.
    #[tokio::test]
    async fn a_turn_dropped_by_a_panic_abandons_its_transaction() {
        let (_dir, pool, group) = group().await;
        group.pause_commits(true);
        let mut first = group.turn().await.expect("a turn");
        sqlx::query("INSERT INTO t VALUES (1)").execute(&mut *first.conn()).await.expect("runs");
        let committed = first.release();
        let mut turn = group.turn().await.expect("a turn");
        sqlx::query("INSERT INTO t VALUES (2)").execute(&mut *turn.conn()).await.expect("runs");
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = turn;
            panic!("mid-turn");
        }));
        assert!(panicked.is_err());
        group.pause_commits(false);
        assert!(committed.wait().await.is_err_and(|e| e.to_string().contains("panicked")));
        write(&group, "INSERT INTO t VALUES (3)").await.expect("commits");
        assert_eq!(values(&pool).await, vec![3]);
    }

    async fn write(group: &SqliteGroup, sql: &'static str) -> Result<(), StoreError> {
        let mut turn = group.turn().await?;
        let r = sqlx::query(sql).execute(&mut *turn.conn()).await.map(|_| ());
        turn.finish(r.map_err(StoreError::from)).await
    }

    // Every write runs on the writer's one connection, commit after
    // commit (a TEMP table lives on the connection that made it); after
    // an abandoned transaction, on a new one.
    #[tokio::test]
    async fn the_writer_keeps_its_connection_until_a_transaction_is_abandoned() {
        let (_dir, pool, group) = group().await;
        write(&group, "CREATE TEMP TABLE mine (v INTEGER)").await.expect("commits");
        for _ in 0..3 {
            write(&group, "INSERT INTO temp.mine VALUES (1)").await.expect("the same connection");
        }
        group.turn().await.expect("a turn").abandon("broken");
        let err = write(&group, "INSERT INTO temp.mine VALUES (1)").await.expect_err("a new connection");
        assert!(err.to_string().contains("no such table"), "{err}");
        write(&group, "INSERT INTO t VALUES (7)").await.expect("commits");
        assert_eq!(values(&pool).await, vec![7]);
        // Closing commits what is open; a later write opens a connection again.
        let mut turn = group.turn().await.expect("a turn");
        sqlx::query("INSERT INTO t VALUES (8)").execute(&mut *turn.conn()).await.expect("runs");
        let committed = turn.release();
        group.close().await;
        committed.wait().await.expect("committed by close");
        write(&group, "INSERT INTO t VALUES (9)").await.expect("commits after close");
        assert_eq!(values(&pool).await, vec![7, 8, 9]);
    }

    // The writer's tasks run on its own thread, whichever runtime
    // started them, so they never queue behind request handlers.
    #[tokio::test]
    async fn the_writer_tasks_run_on_a_thread_of_their_own() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        spawn(async move {
            let _ = tx.send(std::thread::current().name().map(str::to_string));
        });
        let name = tokio::time::timeout(Duration::from_secs(10), rx).await.expect("runs").expect("answers");
        assert_eq!(name.as_deref(), Some("sqlite-writer"));
    }

    // A savepoint left open at the commit fails the commit rather than
    // being released in its place: nothing is reported durable that is
    // not. The next write gets a new connection.
    #[tokio::test]
    async fn a_savepoint_left_open_fails_the_commit() {
        let (_dir, pool, group) = group().await;
        let mut turn = group.turn().await.expect("a turn");
        sqlx::query("INSERT INTO t VALUES (1)").execute(&mut *turn.conn()).await.expect("runs");
        Tm::begin(turn.conn(), None).await.expect("a savepoint");
        let err = turn.finish(Ok(())).await.expect_err("the commit fails");
        assert!(err.to_string().contains("deep"), "{err}");
        write(&group, "INSERT INTO t VALUES (2)").await.expect("a new connection commits");
        assert_eq!(values(&pool).await, vec![2]);
    }

    // What `/metrics` reports of the writer: every turn is a write, every
    // flush a commit, and their time adds up.
    #[tokio::test]
    async fn the_writer_counts_its_writes_commits_and_time() {
        let (_dir, pool, group) = group().await;
        assert_eq!(group.busy(), WriterBusy::default());
        // One after another: each waits for its own commit, so three commits.
        for v in 0..3 {
            let mut turn = group.turn().await.expect("a turn");
            let r = sqlx::query("INSERT INTO t VALUES ($1)").bind(v).execute(&mut *turn.conn()).await;
            turn.finish(r.map(|_| ()).map_err(StoreError::from)).await.expect("commits");
        }
        let after = group.busy();
        assert_eq!((after.writes, after.commits), (3, 3));
        assert!(after.writing > Duration::ZERO && after.committing > Duration::ZERO, "{after:?}");
        // Two writers at once: the second may ride on the first one's commit.
        let first = {
            let mut turn = group.turn().await.expect("a turn");
            let r = sqlx::query("INSERT INTO t VALUES (10)").execute(&mut *turn.conn()).await;
            turn.finish(r.map(|_| ()).map_err(StoreError::from))
        };
        let second = async {
            let mut turn = group.turn().await.expect("a turn");
            let r = sqlx::query("INSERT INTO t VALUES (11)").execute(&mut *turn.conn()).await;
            turn.finish(r.map(|_| ()).map_err(StoreError::from)).await
        };
        let (a, b) = tokio::join!(first, second);
        a.expect("commits");
        b.expect("commits");
        let end = group.busy();
        assert_eq!(end.writes, 5, "{end:?}");
        assert!((4..=5).contains(&end.commits), "{end:?}");
        assert!(end.writing >= after.writing && end.committing >= after.committing, "{end:?}");
        assert_eq!(values(&pool).await, vec![0, 1, 2, 10, 11]);
    }
}
