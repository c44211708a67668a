//! The save on SQLite: batched, one statement per batch, run by one task.
//!
//! SQLite's one writer is the bound of the end-to-end figure
//! (docs/performance.md), and most of the time a save held it was not
//! SQLite's: every statement is a hand-off to sqlx's connection thread and
//! back, and on two busy cores each thread woken waits about 40 µs for a
//! core (`/proc/<pid>/task/*/schedstat` of the daemon under
//! `approvald bench`) before it runs. A save of 70–100 µs of SQLite held
//! the writer 230–400 µs. So the saves queued while the writer was taken
//! go in together: one statement, one hand-off each way for all of them.
//!
//! The statement is `INSERT INTO approvald_save VALUES (…), (…) RETURNING
//! seq`, and the table's trigger does each save's work
//! (`SAVE_STEPS`). The calls and the delivery attempt are recorded first,
//! whatever became of the operation (they happened); `RAISE(IGNORE)` then
//! ends that row's trigger and drops the row if its compare-and-set did
//! not take, so the rows returned are the saves that took. A statement is
//! atomic: if any save in it fails, none of it stays and the group's other
//! writes do, and the batch is run again one save per statement so only
//! the failing save gets the error. A save is never half done, so none
//! needs a savepoint, and one whose caller is gone can only be committed
//! whole.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

use sqlx::Row as _;
use tokio::sync::{Notify, oneshot};

use crate::store::StoreError;
use crate::store::sqlite_group::{Committed, SqliteGroup, Turn};

/// The most saves one statement carries (33 values each).
const MAX_BATCH: usize = 32;

/// The columns of `approvald_save`: the save's values, then its place.
use super::SAVE_COLUMNS as COLUMNS;
use super::{SaveValue, Values};

/// One save's statements, with the parameters of the texts shared with
/// PostgreSQL (`$n`).
const SAVE_STEPS: &str = concat!(
    "INSERT INTO deliveries (operation_id, attempt, started_at, duration_ms, status_code, error, response_body) \
       SELECT json_extract(j.value, '$.operation_id'), json_extract(j.value, '$.attempt'), \
         json_extract(j.value, '$.started_at'), json_extract(j.value, '$.duration_ms'), \
         json_extract(j.value, '$.status_code'), json_extract(j.value, '$.error'), \
         json_extract(j.value, '$.response_body') FROM json_each($26) j; \
     INSERT INTO pushary_calls (operation_id, call, started_at, duration_ms, status_code, error) \
       SELECT json_extract(j.value, '$.operation_id'), json_extract(j.value, '$.call'), \
         json_extract(j.value, '$.started_at'), json_extract(j.value, '$.duration_ms'), \
         json_extract(j.value, '$.status_code'), json_extract(j.value, '$.error') FROM json_each($27) j; ",
    update_operation!(),
    "; SELECT RAISE(IGNORE) WHERE changes() = 0; \
     INSERT INTO transitions (operation_id, from_state, to_state, at, cause, actor) \
       SELECT $19, json_extract(j.value, '$.from'), json_extract(j.value, '$.to'), \
         json_extract(j.value, '$.at'), json_extract(j.value, '$.cause'), json_extract(j.value, '$.actor') \
       FROM json_each($25) j; ",
    release_next_answer!("$19", "$24", "$30", "$18"),
    " AND $28; \
     UPDATE inbox SET state = $31, note = $32, operation_id = $19, processed_at = $18 WHERE id = $29;"
);

/// Creates the save's table and triggers on the connection, if it has
/// none yet (any connection may be the next group commit's). They are
/// TEMP: each connection has its own, gone with it, so a new version of
/// approvald never finds an old one. Rows padding a batch to its
/// statement's size have no id and do nothing; the second trigger keeps
/// the table empty.
fn setup() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        format!(
            "CREATE TEMP TABLE IF NOT EXISTS approvald_save ({columns}); \
             CREATE TEMP TRIGGER IF NOT EXISTS approvald_save_run BEFORE INSERT ON approvald_save \
             WHEN NEW.id IS NOT NULL BEGIN {steps} END; \
             CREATE TEMP TRIGGER IF NOT EXISTS approvald_save_done AFTER INSERT ON approvald_save \
             BEGIN DELETE FROM approvald_save; END;",
            columns = COLUMNS.join(", "),
            steps = with_new_columns(SAVE_STEPS),
        )
    })
}

/// `$n` → `NEW.<the n-th column>`: a trigger has no parameters.
fn with_new_columns(sql: &str) -> String {
    super::params_as_fields(sql, "NEW.")
}

/// The batch statement for `rows` rows (a power of two up to
/// `MAX_BATCH`), built once: a handful of texts, each prepared once per
/// connection. It starts with the setup (`IF NOT EXISTS`, so a no-op but
/// once per connection): the TEMP trigger is made by the writer as it
/// first saves, not when a connection opens, because SQLite checks TEMP
/// triggers in `ALTER TABLE … RENAME` and `DROP COLUMN`, and a migration
/// run on a connection holding one that names a table not yet there
/// would fail.
fn batch_text(rows: usize) -> &'static str {
    const SIZES: usize = MAX_BATCH.ilog2() as usize + 1;
    static TEXTS: [std::sync::OnceLock<String>; SIZES] = [const { std::sync::OnceLock::new() }; SIZES];
    let rows = rows.clamp(1, MAX_BATCH).next_power_of_two();
    TEXTS[rows.trailing_zeros() as usize].get_or_init(|| {
        let row = format!("({})", vec!["?"; COLUMNS.len()].join(", "));
        format!("{} INSERT INTO approvald_save VALUES {} RETURNING seq", setup(), vec![row; rows].join(", "))
    })
}

/// What a caller gets back: whether its save took, and the commit it
/// waits for before it may say so.
type Reply = Result<(bool, Committed), StoreError>;

struct Pending {
    values: Vec<SaveValue>,
    reply: oneshot::Sender<Reply>,
}

/// The saves waiting for the writer, and the task that runs them.
pub(crate) struct SaveQueue {
    pending: Mutex<Waiting>,
    ready: Arc<Notify>,
}

#[derive(Default)]
struct Waiting {
    saves: VecDeque<Pending>,
    /// The runner is gone (it returned or panicked): a save queued now
    /// would wait forever, so it is refused.
    closed: bool,
}

impl std::fmt::Debug for SaveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveQueue").finish_non_exhaustive()
    }
}

impl SaveQueue {
    pub(crate) fn new(group: &Arc<SqliteGroup>) -> Arc<Self> {
        let ready = Arc::new(Notify::new());
        let queue = Arc::new(Self { pending: Mutex::new(Waiting::default()), ready: Arc::clone(&ready) });
        crate::store::sqlite_group::spawn(run(Arc::downgrade(group), Arc::downgrade(&queue), ready));
        queue
    }

    /// Queues one save (`values` as `bind_all!` binds them) and returns
    /// whether it took, once the commit that holds it succeeded.
    pub(crate) async fn save(&self, values: Values) -> Result<bool, StoreError> {
        let (reply, answer) = oneshot::channel();
        {
            let mut waiting = self.lock();
            if waiting.closed {
                return Err(closed());
            }
            waiting.saves.push_back(Pending { values: values.0, reply });
        }
        self.ready.notify_one();
        let (saved, committed) = answer.await.map_err(|_| closed())??;
        committed.wait().await?;
        Ok(saved)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // A panic elsewhere while holding it leaves the queue as it was.
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn closed() -> StoreError {
    StoreError::Unavailable("the store was closed before the save ran".into())
}

/// Closes the queue when the runner ends, however it ends, and refuses
/// what waits in it.
struct CloseOnDrop(Weak<SaveQueue>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let Some(queue) = self.0.upgrade() else { return };
        let mut waiting = queue.lock();
        waiting.closed = true;
        for p in waiting.saves.drain(..) {
            let _ = p.reply.send(Err(closed()));
        }
    }
}

impl Drop for SaveQueue {
    fn drop(&mut self) {
        self.ready.notify_one();
    }
}

/// Runs the queued saves, a batch per turn of the writer, until the store
/// is gone. It holds neither the queue nor the group between batches. The
/// batch is taken once the turn is: saves that queued while it waited
/// (behind a commit, or another writer) go in with it.
async fn run(group: Weak<SqliteGroup>, queue: Weak<SaveQueue>, ready: Arc<Notify>) {
    let _close = CloseOnDrop(queue.clone());
    loop {
        ready.notified().await;
        loop {
            let Some(queue) = queue.upgrade() else { return };
            if queue.lock().saves.is_empty() {
                break;
            }
            let Some(group) = group.upgrade() else { return };
            match group.turn().await {
                Ok(turn) => {
                    let batch: Vec<Pending> = {
                        let mut waiting = queue.lock();
                        let n = waiting.saves.len().min(MAX_BATCH);
                        waiting.saves.drain(..n).collect()
                    };
                    run_batch(turn, batch).await;
                }
                Err(e) => {
                    for p in queue.lock().saves.drain(..) {
                        let _ = p.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }
}

/// How a batch statement failed.
enum Failed {
    /// SQLite undid the statement and kept the transaction: the saves
    /// may run again, one by one.
    Statement(StoreError),
    /// The transaction may be gone (SQLite rolls it back on a full disk,
    /// an I/O error, `SQLITE_BUSY` or no memory), or the statement's
    /// changes stand but its answer was lost: nothing of the open group
    /// transaction may be committed.
    Transaction(StoreError),
}

impl From<sqlx::Error> for Failed {
    fn from(e: sqlx::Error) -> Self {
        // SQLite's primary result codes (the low byte of the extended one).
        const ROLLS_BACK: [i64; 6] = [
            5,  /* BUSY */
            7,  /* NOMEM */
            9,  /* INTERRUPT */
            10, /* IOERR */
            11, /* CORRUPT */
            13, /* FULL */
        ];
        let statement_only = match &e {
            sqlx::Error::Database(db) => db
                .code()
                .and_then(|c| c.parse::<i64>().ok())
                .is_some_and(|code| !ROLLS_BACK.contains(&(code & 0xff))),
            _ => false,
        };
        if statement_only { Failed::Statement(e.into()) } else { Failed::Transaction(e.into()) }
    }
}

/// Runs `batch` in the writer's turn and tells each caller how its save
/// went; those that took wait for the turn's commit.
async fn run_batch(mut turn: Turn<'_>, batch: Vec<Pending>) {
    turn.ran_writes(batch.len() as u64);
    let rows: Vec<&[SaveValue]> = batch.iter().map(|p| p.values.as_slice()).collect();
    let results: Result<Vec<Result<bool, StoreError>>, StoreError> = match execute(turn.conn(), &rows).await {
        Ok(saved) => Ok(saved.into_iter().map(Ok).collect()),
        Err(Failed::Statement(e)) if rows.len() == 1 => Ok(vec![Err(e)]),
        // The statement changed nothing: each save again on its own, so
        // only the one that fails gets the error.
        Err(Failed::Statement(_)) => {
            let mut each = Vec::with_capacity(rows.len());
            let mut lost = None;
            for row in &rows {
                match execute(turn.conn(), std::slice::from_ref(row)).await {
                    Ok(saved) => each.push(Ok(saved[0])),
                    Err(Failed::Statement(e)) => each.push(Err(e)),
                    Err(Failed::Transaction(e)) => {
                        lost = Some(e);
                        break;
                    }
                }
            }
            lost.map_or(Ok(each), Err)
        }
        Err(Failed::Transaction(e)) => Err(e),
    };
    match results {
        Ok(results) => {
            let committed = turn.release();
            for (p, result) in batch.into_iter().zip(results) {
                let _ = p.reply.send(result.map(|saved| (saved, committed.clone())));
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "abandoning the open SQLite group transaction after a failed save batch");
            turn.abandon(&format!("a save batch failed: {e}"));
            for p in batch {
                let _ = p.reply.send(Err(e.clone()));
            }
        }
    }
}

/// Runs the answers' first saves in the inbox's turn (decisions §38):
/// whether each took. A statement SQLite refuses changes nothing, and its
/// saves are reported as not taken, their answers left to their threads'
/// reads; an error means the group's transaction may be gone.
pub(crate) async fn run_in_turn(
    conn: &mut sqlx::SqliteConnection,
    rows: &[&[SaveValue]],
) -> Result<Vec<bool>, StoreError> {
    let mut took = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(MAX_BATCH) {
        match execute(conn, chunk).await {
            Ok(saved) => took.extend(saved),
            Err(Failed::Statement(e)) => {
                tracing::warn!(error = %e, "the answers' first saves were refused; their threads' reads apply them");
                took.extend(std::iter::repeat_n(false, chunk.len()));
            }
            Err(Failed::Transaction(e)) => return Err(e),
        }
    }
    Ok(took)
}

/// Runs `rows` as one statement: whether each took.
async fn execute(conn: &mut sqlx::SqliteConnection, rows: &[&[SaveValue]]) -> Result<Vec<bool>, Failed> {
    let text = batch_text(rows.len());
    let mut q = sqlx::query(text);
    for (seq, row) in rows.iter().enumerate() {
        for v in row.iter() {
            q = match v {
                SaveValue::Text(t) => q.bind(t.clone()),
                SaveValue::Int(i) => q.bind(*i),
            };
        }
        q = q.bind(seq as i64);
    }
    let padded = rows.len().next_power_of_two();
    for _ in rows.len()..padded {
        for _ in 0..COLUMNS.len() {
            q = q.bind(None::<i64>);
        }
    }
    let returned = q.fetch_all(conn).await?;
    let mut saved = vec![false; rows.len()];
    for row in returned {
        // Padding rows come back too, without a place. A row that cannot
        // be read leaves the saves done but their answer unknown.
        let seq = row.try_get::<Option<i64>, _>("seq").map_err(|e| Failed::Transaction(e.into()))?;
        if let Some(s) = seq.and_then(|i| usize::try_from(i).ok()).and_then(|i| saved.get_mut(i)) {
            *s = true;
        }
    }
    Ok(saved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use crate::store::db::test_support::{insert_operation, sqlite_store};
    use crate::store::save::test_rows::{assert_isolated, five, row};

    async fn store() -> (tempfile::TempDir, Store, sqlx::SqlitePool) {
        let (dir, store, pool) = sqlite_store().await;
        for (id, decision) in [("x", Some("dec-1")), ("a", None), ("b", None), ("c", None), ("d", None)] {
            insert_operation(&pool, id, id, decision).await;
        }
        (dir, store, pool)
    }

    #[test]
    fn parameters_become_the_new_rows_columns_and_json_paths_stay() {
        assert_eq!(
            with_new_columns("s = $1 AND j = '$.from' AND n = $32 AND k = $19"),
            "s = NEW.state AND j = '$.from' AND n = NEW.inbox_note AND k = NEW.id"
        );
    }

    // Five saves in one statement (padded to eight rows): two that take,
    // one that breaks the unique decision id, one from a version the first
    // moved, one more that takes. The statement fails and the saves run
    // again one by one: the failing one gets the error and leaves nothing;
    // the stale one is told so and keeps its call record; the rest commit.
    #[tokio::test]
    async fn a_batch_of_saves_isolates_the_one_that_fails() {
        let (_dir, store, pool) = store().await;
        let group = store.sqlite_group.clone().expect("a SQLite store has a write group");
        let mut answers = Vec::new();
        let mut batch = Vec::new();
        for values in five() {
            let (reply, answer) = oneshot::channel();
            batch.push(Pending { values, reply });
            answers.push(answer);
        }
        run_batch(group.turn().await.expect("a turn"), batch).await;
        let mut outcomes = Vec::new();
        for answer in answers {
            outcomes.push(match answer.await.expect("answered") {
                Ok((saved, committed)) => {
                    committed.wait().await.expect("committed");
                    Ok(saved)
                }
                Err(e) => Err(e.to_string()),
            });
        }
        let ops: Vec<(String, i64, Option<String>)> =
            sqlx::query_as("SELECT id, version, last_error FROM operations WHERE id <> 'x' ORDER BY id")
                .fetch_all(&pool)
                .await
                .expect("reads");
        let calls: Vec<(String, i64)> = sqlx::query_as(
            "SELECT operation_id, count(*) FROM pushary_calls GROUP BY operation_id ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .expect("reads");
        assert_isolated(&outcomes, "UNIQUE", &ops, &calls);
    }

    // Within one statement (three rows, padded to four), a save from a
    // version an earlier row moved is dropped alone; the rows after it run.
    #[tokio::test]
    async fn a_stale_save_in_a_batch_is_dropped_alone() {
        let (_dir, store, pool) = store().await;
        let group = store.sqlite_group.clone().expect("a SQLite store has a write group");
        let rows = [row("a", 0, None), row("a", 0, None), row("c", 0, None)];
        let mut turn = group.turn().await.expect("a turn");
        let refs: Vec<&[SaveValue]> = rows.iter().map(Vec::as_slice).collect();
        let saved = execute(turn.conn(), &refs).await.map_err(|_| "the batch failed").expect("runs");
        // Read on the connection that ran it: the table is TEMP.
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM approvald_save")
            .fetch_one(&mut *turn.conn())
            .await
            .expect("reads");
        assert_eq!(left, 0, "the save table stays empty");
        turn.release().wait().await.expect("commits");
        assert_eq!(saved, vec![true, false, true]);
        let calls: Vec<(String, i64)> = sqlx::query_as(
            "SELECT operation_id, count(*) FROM pushary_calls GROUP BY operation_id ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .expect("reads");
        assert_eq!(calls, vec![("a".into(), 2), ("c".into(), 1)], "the stale save's call is recorded");
    }

    // Through the queue: saves from many tasks at once all land, each once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_saves_from_many_callers_each_take_once() {
        let (_dir, store, pool) = store().await;
        let queue = store.sqlite_saves.clone().expect("a SQLite store has a save queue");
        let mut callers = tokio::task::JoinSet::new();
        for id in ["a", "b", "c", "d"] {
            for _ in 0..3 {
                let queue = Arc::clone(&queue);
                callers
                    .spawn(async move { (id, queue.save(Values(row(id, 0, None))).await.expect("saves")) });
            }
        }
        let mut won: Vec<&str> =
            callers.join_all().await.into_iter().filter(|(_, saved)| *saved).map(|(id, _)| id).collect();
        won.sort_unstable();
        assert_eq!(won, vec!["a", "b", "c", "d"], "exactly one of each operation's three saves takes");
        let versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM operations WHERE id <> 'x' ORDER BY id")
                .fetch_all(&pool)
                .await
                .expect("reads");
        assert_eq!(versions, vec![1, 1, 1, 1]);
    }
}
