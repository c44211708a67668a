//! PostgreSQL: an answer's first save commits with the callback that
//! brings it (decisions §36). The inbox's statement returns the pending
//! operation each answer marks (§35); the engine decides on the answer in
//! memory (`FirstSaves`), and the saves, each taking its thread's lease
//! as `TakeLease` does, run in the batch's transaction before its commit.
//! An answer's way to its effect then waits for two durable commits, not
//! three, and the machine makes one commit and one save statement fewer
//! per approval.

use std::collections::HashMap;

use sqlx::postgres::{PgRow, Postgres};

use super::db::{Store, StoredRows, handed_answers, read_stored_rows};
use super::inbox_writer::OwnedInboxEntry;
use super::save::{Applied, FirstSaves, LeaseWith, SaveValue, TakeLease, run_in};
use super::{InboxInsert, StoreError};

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
                    a.saved(true);
                    applied.push(a);
                }
            }
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
