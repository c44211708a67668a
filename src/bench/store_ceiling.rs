//! SQLite's own ceiling for the inbox's writes: what the database gives a
//! receiver that did nothing but store callbacks, with approvald's schema,
//! in the largest batches the ingest's clients can form. No HTTP, no
//! signature, no approvald: one connection commits multi-row inserts of
//! ≈300-byte callbacks with random decision ids (as Pushary's are), each
//! batch one durable transaction (WAL, synchronous=FULL).
//!
//! The ingest run's clients wait for their acknowledgements, so a batch
//! holds at most one callback per client. The inbox's unique key on the
//! decision id is what a callback's deduplication needs; with random ids,
//! each stored callback writes a leaf page of that index of its own, so a
//! callback costs the disk more than a row of the baseline's table, and
//! the batch cannot make that page shared. Where this rate is below the
//! ingest target, the target is out of reach on this machine for any
//! receiver keeping this guarantee, whatever approvald does
//! (docs/performance.md).

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::ConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};

use super::load::payload;
use crate::config::StoreConfig;
use crate::store::Store;

/// Callbacks/s stored in batches of `batch` for `secs`, on a fresh store
/// in `dir` that already holds `fill` waiting callbacks (the inbox as the
/// ingest run left it).
pub async fn sqlite_inbox(dir: &Path, fill: u64, batch: usize, secs: f64) -> anyhow::Result<f64> {
    let path = dir.join(format!("ceiling-{batch}.db"));
    let url = format!("sqlite://{}", path.display());
    // approvald's own schema, every index included, as `serve` migrates it.
    let store = Store::connect(&StoreConfig::with_defaults(url.clone(), 1)).await?;
    store.migrate().await?;
    store.close().await;
    let mut conn = SqliteConnectOptions::from_str(&url)?
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .connect()
        .await?;
    let body = payload("dec_ceiling");
    let sha = "0".repeat(64);
    sqlx::query(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < $1) \
         INSERT INTO inbox (tenant, correlation_id, answer, body, body_sha256, source, state, received_at) \
         SELECT 'default', 'dec_' || lower(hex(randomblob(12))), 'yes', $2, $3, 'callback', 'new', 0 FROM g",
    )
    .bind(i64::try_from(fill)?)
    .bind(&body)
    .bind(&sha)
    .execute(&mut conn)
    .await?;
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(&mut conn).await?;
    let text = format!(
        "INSERT INTO inbox (tenant, correlation_id, answer, answered_at, body, body_sha256, source, state, \
         received_at) VALUES {} ON CONFLICT (tenant, correlation_id) DO NOTHING",
        vec!["('default', ?, 'yes', NULL, ?, ?, 'callback', 'new', ?)"; batch].join(", ")
    );
    let run = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut stored = 0u64;
    while start.elapsed() < run {
        let ids: Vec<String> =
            (0..batch).map(|_| format!("dec_{:024x}", rand::random::<u128>() >> 32)).collect();
        let now = crate::clock::now_ms();
        let mut q = sqlx::query(sqlx::AssertSqlSafe(text.clone()));
        for id in &ids {
            q = q.bind(id).bind(&body).bind(&sha).bind(now);
        }
        let mut tx = sqlx::Connection::begin(&mut conn).await?;
        stored += q.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
    }
    let rate = stored as f64 / start.elapsed().as_secs_f64();
    sqlx::Connection::close(conn).await?;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(rate)
}

#[cfg(test)]
mod tests {
    // The ceiling's rows fit approvald's inbox as migrated (a migration
    // that changed the inbox's columns would fail this), every batch is
    // stored, and its file is gone afterwards.
    #[tokio::test]
    async fn the_ceiling_stores_batches_in_approvalds_inbox_and_cleans_up() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let rate = super::sqlite_inbox(dir.path(), 100, 8, 0.2).await.expect("measures");
        assert!(rate > 0.0, "{rate}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("reads").collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
