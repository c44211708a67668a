//! PostgreSQL: an answer's first save commits with the callback that
//! brings it (decisions §36). The inbox's statement returns the pending
//! operation each answer marks (§35); the engine decides on the answer in
//! memory (`FirstSaves`), and the saves, each taking its thread's lease
//! as `TakeLease` does, run in the batch's transaction before its commit.
//! An answer's way to its effect then waits for two durable commits, not
//! three, and the machine makes one commit and one save statement fewer
//! per approval. The insert locks the operations it finds rather than
//! marking them, and marks only those no first save took (§39): an
//! applied answer's operation gets one new row version in the
//! transaction, its save's, not two.

use std::collections::{HashMap, HashSet};

use sqlx::Row;
use sqlx::postgres::{PgRow, Postgres};

use super::db::{Store, StoredRows, handed_answers, read_stored_rows};
use super::inbox_writer::OwnedInboxEntry;
use super::save::{Applied, FirstSaves, LeaseWith, SaveValue, TakeLease, run_in};
use super::{InboxInsert, StoreError};

/// Marks the operations `$1` (ids) as having an answer waiting since `$2`,
/// as the plain insert's mark does.
const MARK_FOUND: &str = "UPDATE operations SET inbox_at = $2 WHERE id = ANY($1) AND inbox_at IS NULL";

/// What became of a batch inserted in a transaction with its answers'
/// first saves.
pub(super) enum Applying {
    /// Committed.
    Done(super::BatchInsert),
    /// Rolled back, nothing stored: the batch goes again the plain way.
    /// `make_function`: the connection lacked the save function, which
    /// the caller makes first, so that its next batch applies again.
    Again { make_function: bool },
}

impl Store {
    /// Commits `tx`, in which the batch's insert returned `rows`, with
    /// the first saves `first_saves` gives for its pending answers. A
    /// save that does not take (its thread leased elsewhere, an answer
    /// before it, its operation moved) changes nothing and its answer is
    /// left to a worker's read of the thread; one PostgreSQL refuses
    /// rolls the whole batch back (`Applying::Again`), as does a repeat.
    pub(super) async fn commit_applying(
        &self,
        mut tx: sqlx::Transaction<'_, Postgres>,
        rows: &[PgRow],
        entries: &[OwnedInboxEntry],
        first: &HashMap<(&str, &str), usize>,
        first_saves: FirstSaves<'_>,
        now: i64,
    ) -> Result<Applying, StoreError> {
        let StoredRows { stored, threads, unmarked, pending } = read_stored_rows(rows, first, entries.len())?;
        let Some(ids) = stored.into_iter().collect::<Option<Vec<i64>>>() else {
            tx.rollback().await?;
            return Ok(Applying::Again { make_function: false });
        };
        let mut handed = Vec::new();
        let mut applying = Vec::new();
        for (entry, op) in handed_answers(rows, &pending, &threads, entries, first) {
            match first_saves.first_save(&entry, &op) {
                Some(save) => applying.push(Applied { entry, save }),
                None => handed.push((entry, op)),
            }
        }
        let mut applied = Vec::with_capacity(applying.len());
        if !applying.is_empty() {
            let values: Vec<_> = applying.iter().map(Applied::values).collect();
            let rows: Vec<&[SaveValue]> = values.iter().map(|v| v.0.as_slice()).collect();
            let leases: Vec<LeaseWith<'_>> = applying
                .iter()
                .map(|a| LeaseWith {
                    release: None,
                    take: Some(TakeLease { owner: &a.save.owner, now: a.save.now, until: a.save.until }),
                })
                .collect();
            let saved = match run_in(&mut tx, &rows, &leases, true).await {
                Ok(saved) => saved,
                Err(sqlx::Error::Database(e)) if super::save::refused_by_database(e.as_ref()) => {
                    let make_function = super::db::is_missing_temp_function(e.as_ref());
                    if !make_function {
                        tracing::warn!(error = %e, "the answers' first saves were refused; the batch is stored without them");
                    }
                    tx.rollback().await?;
                    return Ok(Applying::Again { make_function });
                }
                Err(e) => return Err(e.into()),
            };
            drop(leases);
            for (mut a, (took, _)) in applying.into_iter().zip(saved) {
                if took {
                    a.saved();
                    applied.push(a);
                }
            }
        }
        // The insert found its rows' operations without marking them
        // (decisions §39): those no first save took are marked now, as the
        // plain insert marks them, so that a worker's read finds their
        // answers.
        let saved: HashSet<&str> = applied.iter().map(|a| a.save.op.id.as_str()).collect();
        let mut unsaved = Vec::new();
        for row in rows {
            if let Some(id) = row.try_get::<Option<String>, _>("id")?
                && !saved.contains(id.as_str())
            {
                unsaved.push(id);
            }
        }
        if !unsaved.is_empty() {
            sqlx::query(MARK_FOUND).bind(&unsaved).bind(now).execute(&mut *tx).await?;
        }
        if let Err(e) = tx.commit().await {
            // The commit may have been made and its answer lost: the
            // leases its saves took go, lest their threads wait for them to
            // run out. Had it not been made, this deletes nothing. Nothing
            // is handed on: without the commit no consume is on record.
            for a in &applied {
                let op = &a.save.op;
                let _ = self.release_lease(&op.tenant, &op.thread_id, &a.save.owner).await;
            }
            return Err(e.into());
        }
        let mut done = self.batch_done(ids.into_iter().map(InboxInsert::Stored).collect(), threads);
        done.answers = handed;
        done.applied = applied;
        done.unmarked = unmarked;
        Ok(Applying::Done(done))
    }
}
