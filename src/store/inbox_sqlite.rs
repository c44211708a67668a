//! The inbox batch on SQLite: one call to SQLite for the whole batch.
//!
//! The batch's savepoint, its insert, the marking of the operations its
//! rows answer and the savepoint's release go to sqlx's connection
//! thread as one text of four statements, so the writer is held for one
//! hand-off to that thread and back, not four. Each hand-off, under
//! ingest, cost about 100 µs of waiting for a core with the one writer
//! held: more than SQLite's own work on a batch (decisions §18).
//!
//! The marking returns each operation it marks, whole, with what decides
//! whether its answer may be applied at once: the answers' first saves
//! then go in the same turn of the writer, so they commit with their
//! callbacks (decisions §38, SQLite's §36).

use std::collections::HashMap;

use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use super::db::{
    BatchInsert, BatchTexts, Store, answers_per_thread, batch_text, record_stored, stored_entry,
};
use super::inbox_writer::OwnedInboxEntry;
use super::save::{Applied, FirstSaves, SaveValue, run_in_sqlite_turn};
use super::sqlite_group::Turn;
use super::{InboxEntry, InboxInsert, Operation, StoreError};
use crate::domain::state::State;

/// The savepoint the batch's text opens (sqlx's own are `_sqlx_savepoint_N`).
const SAVEPOINT: &str = "approvald_inbox";

/// The text for `rows` rows (a power of two, padded with NULL rows the
/// insert skips).
fn text(rows: usize) -> std::borrow::Cow<'static, str> {
    static TEXTS: BatchTexts = [const { std::sync::OnceLock::new() }; _];
    batch_text(&TEXTS, rows, build)
}

fn build(rows: usize) -> String {
    let mut sql = format!(
        "SAVEPOINT {SAVEPOINT}; WITH v (tenant, correlation_id, answer, answered_at, body, body_sha256, source, \
         received_at) AS (VALUES "
    );
    // Anonymous parameters: SQLite finds a numbered one by a linear scan
    // of the statement's names, which is quadratic in a batch's size.
    // sqlx numbers them on across the text's statements.
    sql.push_str(&vec!["(?, ?, ?, ?, ?, ?, ?, ?)"; rows].join(", "));
    sql.push_str(concat!(") ", insert_inbox_rows!(), "; "));
    // The rows just stored are the last `changes()` ids ending at
    // `last_insert_rowid()` (none stored: an empty range), both still
    // describing the insert here, the statement that completed last. One
    // writer, one statement: the ids are consecutive unless a row
    // conflicted, which used one up; such a batch has a repeat, and
    // `repeats` marks its stored rows again by their ids.
    sql.push_str(
        "UPDATE operations SET inbox_at = ? WHERE inbox_at IS NULL AND decision_id IS NOT NULL \
         AND (tenant, decision_id) IN (SELECT i.tenant, i.correlation_id FROM inbox i \
           WHERE i.id BETWEEN last_insert_rowid() - changes() + 1 AND last_insert_rowid() \
           AND i.state = 'new') RETURNING ",
    );
    sql.push_str(MARKED);
    sql.push_str(&format!("; RELEASE {SAVEPOINT}"));
    sql
}

/// What the marking returns of each operation it marks: the row as the
/// mark left it, and the two conditions under which a read of its thread
/// would not return its answer first (`Store::next_work_for_thread`):
/// another answer waits on the thread, or an earlier answer of the
/// thread still resumes (its answer is held back). The one writer holds
/// its turn from here to the answer's save: nothing changes between.
/// (Two answers of one thread marked by this statement are not applied
/// at all, so neither's look at the other matters.)
const MARKED: &str = concat!(
    op_cols!(),
    ", EXISTS (SELECT 1 FROM operations w WHERE w.tenant = operations.tenant \
       AND w.thread_id = operations.thread_id AND w.inbox_at IS NOT NULL AND w.decision_id IS NOT NULL \
       AND w.id <> operations.id) AS others_wait, ",
    held_back!(
        "operations.tenant",
        "operations.thread_id",
        "(SELECT i.id FROM inbox i WHERE i.tenant = operations.tenant AND i.correlation_id = operations.decision_id)"
    ),
    " AS held_back"
);

impl Store {
    /// `Store::insert_inbox_batch_with` on SQLite, for the `unique`
    /// entries (the first of each decision in the batch) with their
    /// bodies' `hashes`.
    pub(super) async fn insert_inbox_batch_sqlite(
        &self,
        entries: &[OwnedInboxEntry],
        first: &HashMap<(&str, &str), usize>,
        unique: &[usize],
        hashes: &[String],
        now: i64,
        first_saves: Option<FirstSaves<'_>>,
    ) -> Result<BatchInsert, StoreError> {
        let rows = unique.len().next_power_of_two();
        let sql = text(rows);
        let mut q = match sql {
            std::borrow::Cow::Borrowed(text) => sqlx::query(text),
            std::borrow::Cow::Owned(text) => sqlx::query(sqlx::AssertSqlSafe(text)),
        };
        bind_inbox_rows!(q, entries, unique, hashes, rows);
        q = q.bind(now);
        let group = self.sqlite_group.as_ref().expect("a SQLite store has a write group");
        let mut turn = group.turn().await?;
        let found = match q.fetch_all(&mut *turn.conn()).await {
            Ok(found) => found,
            Err(e) => return undo(turn, e).await,
        };
        // From here the batch's writes stand in the group's transaction:
        // a failure must take the transaction down with it, never leave
        // them to commit with their callers told they failed.
        let mut stored: Vec<Option<i64>> = vec![None; entries.len()];
        let mut threads: Vec<(String, String)> = Vec::new();
        let mut marked: Vec<&SqliteRow> = Vec::new();
        let decoded: Result<(), sqlx::Error> = found.iter().try_for_each(|row| {
            if let Ok(thread) = row.try_get::<Option<String>, _>("thread_id") {
                if let Some(thread) = thread {
                    threads.push((row.try_get("tenant")?, thread));
                    marked.push(row);
                }
            } else {
                let (tenant, correlation_id) = (row.try_get("tenant")?, row.try_get("correlation_id")?);
                record_stored(first, &mut stored, tenant, correlation_id, row.try_get("id")?);
            }
            Ok(())
        });
        if let Err(e) = decoded {
            turn.abandon(&e.to_string());
            return Err(e.into());
        }
        let mut applied = Vec::new();
        let results = if stored.iter().all(Option::is_some) {
            if let Some(first_saves) = first_saves {
                let answers = applicable(&marked, &threads, &stored, entries, first);
                match apply_first(&mut turn, answers, first_saves).await {
                    Ok(a) => applied = a,
                    Err(e) => {
                        turn.abandon(&e.to_string());
                        return Err(e);
                    }
                }
            }
            stored.iter().map(|id| InboxInsert::Stored(id.expect("all stored"))).collect()
        } else {
            // A batch with a repeat is stored without first saves, as on
            // PostgreSQL: its answers are left to their threads' reads.
            match repeats(turn.conn(), entries, &stored, now, &mut threads).await {
                Ok(results) => results,
                Err(e) => {
                    turn.abandon(&e.to_string());
                    return Err(e.into());
                }
            }
        };
        if let Err(e) = turn.finish(Ok(())).await {
            if let Some(first_saves) = first_saves {
                applied.iter().for_each(|a| first_saves.not_made(&a.save));
            }
            return Err(e);
        }
        let mut done = self.batch_done(results, threads);
        done.applied = applied;
        Ok(done)
    }
}

/// The answers of a batch that may be applied in its turn: each for a
/// pending operation, its thread's one answer in the batch, no other
/// answer waiting on the thread and none before it still resuming. An
/// operation that does not decode is left to its thread's read, which
/// reports it.
fn applicable(
    marked: &[&SqliteRow],
    threads: &[(String, String)],
    stored: &[Option<i64>],
    entries: &[OwnedInboxEntry],
    first: &HashMap<(&str, &str), usize>,
) -> Vec<(InboxEntry, Operation)> {
    let answers_per_thread = answers_per_thread(threads);
    let mut answers = Vec::new();
    for row in marked {
        // The cheap looks first: the writer is held.
        let clear = |flag| row.try_get::<bool, _>(flag).is_ok_and(|set| !set);
        let one = |tenant: String, thread: String| answers_per_thread.get(&(tenant, thread)) == Some(&1);
        let alone = match (row.try_get("tenant"), row.try_get("thread_id"), row.try_get::<&str, _>("state")) {
            (Ok(tenant), Ok(thread), Ok(state)) => state == State::Pending.as_str() && one(tenant, thread),
            _ => false,
        };
        if !(alone && clear("others_wait") && clear("held_back")) {
            continue;
        }
        let Ok(op) = Operation::from_row(*row) else { continue };
        let Some(decision) = op.decision_id.as_deref() else { continue };
        if let Some(&i) = first.get(&(op.tenant.as_str(), decision))
            && let Some(id) = stored[i]
        {
            answers.push((stored_entry(&entries[i], id), op));
        }
    }
    answers
}

/// Makes the first saves `first_saves` gives for `answers` in the
/// inbox's turn, before its commit: the answers applied. A save that did
/// not take (its operation moved) changed nothing, and its answer is left
/// to its thread's read. An error: the group's transaction may be gone.
async fn apply_first(
    turn: &mut Turn<'_>,
    answers: Vec<(InboxEntry, Operation)>,
    first_saves: FirstSaves<'_>,
) -> Result<Vec<Applied>, StoreError> {
    let applying: Vec<Applied> = answers
        .into_iter()
        .filter_map(|(entry, op)| first_saves.first_save(&entry, &op).map(|save| Applied { entry, save }))
        .collect();
    if applying.is_empty() {
        return Ok(Vec::new());
    }
    let values: Vec<_> = applying.iter().map(Applied::values).collect();
    let rows: Vec<&[SaveValue]> = values.iter().map(|v| v.0.as_slice()).collect();
    turn.ran_writes(1 + rows.len() as u64);
    let took = match run_in_sqlite_turn(turn.conn(), &rows).await {
        Ok(took) => took,
        Err(e) => {
            applying.iter().for_each(|a| first_saves.not_made(&a.save));
            return Err(e);
        }
    };
    let mut applied = Vec::with_capacity(applying.len());
    for (mut a, took) in applying.into_iter().zip(took) {
        if took {
            a.saved();
            applied.push(a);
        } else {
            first_saves.not_made(&a.save);
        }
    }
    Ok(applied)
}

/// A failed text: SQLite undid the statement that failed; the savepoint
/// undoes those before it, and the group's other writes stay. If that
/// cannot be done, what the transaction holds is not known, and it goes.
async fn undo(mut turn: Turn<'_>, e: sqlx::Error) -> Result<BatchInsert, StoreError> {
    let sql = format!("ROLLBACK TO {SAVEPOINT}; RELEASE {SAVEPOINT}");
    if let Err(undo) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *turn.conn()).await {
        turn.abandon(&format!("{e}; undoing the inbox batch: {undo}"));
        return Err(e.into());
    }
    turn.finish(Err(e.into())).await
}

/// `inbox_repeats!` on the writer's connection. A conflicting row still
/// takes an id (`AUTOINCREMENT` hands it out before the conflict is
/// found), so the ids stored around a repeat are not consecutive, and the
/// text's marking may have missed some: they are marked again here, by
/// the range of the ids stored (marking is idempotent).
async fn repeats(
    conn: &mut SqliteConnection,
    entries: &[OwnedInboxEntry],
    stored: &[Option<i64>],
    now: i64,
    threads: &mut Vec<(String, String)>,
) -> Result<Vec<InboxInsert>, sqlx::Error> {
    if let (Some(lo), Some(hi)) = (stored.iter().flatten().min(), stored.iter().flatten().max()) {
        mark_waiting_answers!(conn, *lo, *hi, now, threads);
    }
    Ok(inbox_repeats!(conn, entries, stored, now, threads))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::db::test_support::{insert_operation, sqlite_store};

    async fn store() -> (tempfile::TempDir, Store, sqlx::SqlitePool) {
        let (dir, store, pool) = sqlite_store().await;
        // Operations waiting for the answers to decisions dec-0 and dec-1.
        for n in 0..2 {
            insert_operation(&pool, &format!("op-{n}"), &format!("thread-{n}"), Some(&format!("dec-{n}")))
                .await;
        }
        (dir, store, pool)
    }

    fn entry(correlation_id: &str) -> OwnedInboxEntry {
        OwnedInboxEntry {
            tenant: "t".into(),
            correlation_id: correlation_id.into(),
            answer: "yes".into(),
            answered_at: None,
            body: format!("{{\"decisionId\":\"{correlation_id}\"}}").into_bytes(),
            source: "callback",
            received_at: 5,
        }
    }

    async fn inbox(pool: &sqlx::SqlitePool) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT correlation_id, duplicates FROM inbox ORDER BY id")
            .fetch_all(pool)
            .await
            .expect("reads")
    }

    async fn marked(pool: &sqlx::SqlitePool) -> Vec<String> {
        sqlx::query_scalar("SELECT id FROM operations WHERE inbox_at IS NOT NULL ORDER BY id")
            .fetch_all(pool)
            .await
            .expect("reads")
    }

    // One text stores the new rows, counts the repeats (in the batch and
    // of rows stored before), and marks the operations the stored rows
    // answer, naming their threads.
    #[tokio::test]
    async fn a_batch_stores_counts_repeats_and_marks_what_it_answers() {
        let (_dir, store, pool) = store().await;
        let first = store.insert_inbox_batch(&[entry("dec-0"), entry("other")]).await.expect("stores");
        assert!(matches!(first.results[..], [InboxInsert::Stored(_), InboxInsert::Stored(_)]), "{first:?}");
        assert_eq!(first.threads, vec![("t".to_string(), "thread-0".to_string())]);
        // A repeat of a stored row between two new ones uses up an id.
        let batch = [entry("dec-1"), entry("dec-0"), entry("new")];
        let second = store.insert_inbox_batch(&batch).await.expect("stores");
        assert!(
            matches!(
                second.results[..],
                [InboxInsert::Stored(_), InboxInsert::Duplicate(_), InboxInsert::Stored(_)]
            ),
            "{second:?}"
        );
        assert_eq!(second.threads, vec![("t".to_string(), "thread-1".to_string())]);
        assert_eq!(marked(&pool).await, vec!["op-0", "op-1"]);
        // Repeats inside one batch count too.
        let third =
            store.insert_inbox_batch(&[entry("dec-1"), entry("late"), entry("late")]).await.expect("stores");
        assert!(
            matches!(
                third.results[..],
                [InboxInsert::Duplicate(_), InboxInsert::Stored(_), InboxInsert::Duplicate(_)]
            ),
            "{third:?}"
        );
        let rows = inbox(&pool).await;
        let want = [("dec-0", 1), ("other", 0), ("dec-1", 1), ("new", 0), ("late", 1)];
        assert_eq!(rows, want.map(|(c, d)| (c.to_string(), d)).to_vec());
        assert_eq!(marked(&pool).await, vec!["op-0", "op-1"]);
    }

    // A batch whose insert fails, and one whose marking fails after its
    // insert ran, leave nothing of theirs; a write that ran before them in
    // the same open transaction commits; the next batch stores.
    #[tokio::test]
    async fn a_failed_batch_leaves_nothing_and_its_neighbours_commit() {
        let (_dir, store, pool) = store().await;
        sqlx::raw_sql(
            "CREATE TABLE beside (v INTEGER); \
             CREATE TRIGGER no_bad BEFORE INSERT ON inbox WHEN NEW.correlation_id = 'bad' \
               BEGIN SELECT RAISE(ABORT, 'a bad row'); END; \
             CREATE TRIGGER no_mark BEFORE UPDATE OF inbox_at ON operations WHEN OLD.decision_id = 'dec-1' \
               BEGIN SELECT RAISE(ABORT, 'a bad mark'); END",
        )
        .execute(&pool)
        .await
        .expect("creates");
        let group = store.sqlite_group.as_ref().expect("a SQLite group");
        group.pause_commits(true);
        let mut turn = group.turn().await.expect("a turn");
        sqlx::query("INSERT INTO beside VALUES (1)").execute(&mut *turn.conn()).await.expect("runs");
        let beside = turn.release();
        // Commits are paused: a batch that did not fail would wait for one.
        let failing = |batch: [OwnedInboxEntry; 2]| {
            let store = &store;
            async move {
                let stored = store.insert_inbox_batch(&batch);
                tokio::time::timeout(std::time::Duration::from_secs(10), stored).await.expect("fails at once")
            }
        };
        let err = failing([entry("dec-0"), entry("bad")]).await.expect_err("the insert fails");
        assert!(err.to_string().contains("a bad row"), "{err}");
        let err = failing([entry("dec-1"), entry("x")]).await.expect_err("the mark fails");
        assert!(err.to_string().contains("a bad mark"), "{err}");
        group.pause_commits(false);
        beside.wait().await.expect("the write beside them commits");
        let kept: Vec<i64> =
            sqlx::query_scalar("SELECT v FROM beside").fetch_all(&pool).await.expect("reads");
        assert_eq!(kept, vec![1]);
        assert_eq!(inbox(&pool).await, vec![]);
        assert_eq!(marked(&pool).await, Vec::<String>::new());
        store.insert_inbox_batch(&[entry("dec-0")]).await.expect("stores");
        assert_eq!(inbox(&pool).await, vec![("dec-0".to_string(), 0)]);
        assert_eq!(marked(&pool).await, vec!["op-0"]);
    }
}
