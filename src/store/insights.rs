//! Read-only queries for the people who run approvald: the operator page's
//! filters and charts, and the gauges `/metrics` reports. None of them is
//! on the approval path. The charts and gauges read an index, not a whole
//! table, except the count of operations by state (one pass over a small
//! index). The operation list reads the whole table unless its filters
//! match an index (by state, by thread), and sorts it.

use sqlx::Row;

use super::db::Backend;
use super::rows::{Operation, PusharyCall};
use super::{Store, StoreError};

/// The operations finished from `$1` on, counted by minute and state, as
/// `(PostgreSQL, SQLite)` texts. Finished operations have neither a step
/// due nor a poll: the `operations_finished` index, read from `$1`, which
/// SQLite is told (without statistics it read every finished operation
/// through `operations_state`: 234 ms with 200,000 of them, against 16 ms
/// by the index for the 10,000 in the window; decisions §37).
macro_rules! finished_by_minute {
    ($index:literal) => {
        concat!(
            "SELECT (updated_at / 60000) * 60000 AS minute, state, COUNT(*) AS n FROM operations",
            $index,
            " WHERE due_at IS NULL AND poll_at IS NULL AND updated_at >= $1 \
               AND state IN ('succeeded', 'failed', 'expired', 'cancelled', 'denied', 'invalid', \
                             'refused', 'unreachable', 'uncertain') \
             GROUP BY 1, 2 ORDER BY 1, 2"
        )
    };
}
pub(crate) const FINISHED_BY_MINUTE: (&str, &str) =
    (finished_by_minute!(""), finished_by_minute!(" INDEXED BY operations_finished"));

/// What the operator page filters operations by. Empty fields match all.
#[derive(Debug, Default, Clone)]
pub struct OperatorFilter {
    pub tenant: Option<String>,
    pub state: Option<String>,
    pub thread_id: Option<String>,
    /// The decision's recipient (`externalId`).
    pub recipient: Option<String>,
    /// Only operations created at or after this time (ms).
    pub created_after: Option<i64>,
    /// Only operations created at or before this time (ms).
    pub created_before: Option<i64>,
    pub limit: i64,
}

/// Finished operations per minute by final state, and the inbox's depth per
/// minute, over a window.
#[derive(Debug, Default)]
pub struct Activity {
    /// (minute start in ms, final state, count)
    pub finished: Vec<(i64, String, i64)>,
    /// (received_at, processed_at) of every callback received in the window
    /// or still waiting.
    pub inbox: Vec<(i64, Option<i64>)>,
}

impl Store {
    pub async fn operator_operations(&self, f: &OperatorFilter) -> Result<Vec<Operation>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let recipient = if PG { "(spec::jsonb ->> 'externalId')" } else { "json_extract(spec, '$.externalId')" };
            let sql = format!(
                concat!(
                    "SELECT ",
                    op_cols!(),
                    " FROM operations WHERE ($1 IS NULL OR tenant = $1) AND ($2 IS NULL OR state = $2) \
                      AND ($3 IS NULL OR thread_id = $3) AND ($4 IS NULL OR {} = $4) \
                      AND ($5 IS NULL OR created_at >= $5) AND ($6 IS NULL OR created_at <= $6) \
                      ORDER BY created_at DESC, id DESC LIMIT $7"
                ),
                recipient
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(f.tenant.as_deref())
                .bind(f.state.as_deref())
                .bind(f.thread_id.as_deref())
                .bind(f.recipient.as_deref())
                .bind(f.created_after)
                .bind(f.created_before)
                .bind(if f.limit > 0 { f.limit.min(1000) } else { 100 })
                .fetch_all(pool)
                .await?;
            rows.iter().map(Operation::from_row).collect()
        })
    }

    /// The Pushary calls made for one operation, oldest first.
    pub async fn pushary_calls(&self, operation_id: &str) -> Result<Vec<PusharyCall>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(
                "SELECT operation_id, call, started_at, duration_ms, status_code, error FROM pushary_calls \
                 WHERE operation_id = $1 ORDER BY id",
            )
            .bind(operation_id)
            .fetch_all(pool)
            .await?;
            rows.iter().map(PusharyCall::from_row).collect()
        })
    }

    /// Operations by state, for `/metrics` and the page's header.
    pub async fn operation_counts(&self) -> Result<Vec<(String, i64)>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query("SELECT state, COUNT(*) AS n FROM operations GROUP BY state ORDER BY state")
                .fetch_all(pool)
                .await?;
            rows.iter().map(|r| Ok((r.try_get("state")?, r.try_get("n")?))).collect()
        })
    }

    /// Inbox entries waiting (`new`) and orphaned, and when the oldest
    /// waiting one arrived. Both read partial indexes.
    pub async fn inbox_depth(&self) -> Result<(i64, i64, Option<i64>), StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let row = sqlx::query(
                "SELECT (SELECT COUNT(*) FROM inbox WHERE state = 'new') AS waiting, \
                        (SELECT COUNT(*) FROM inbox WHERE state = 'orphaned') AS orphaned, \
                        (SELECT MIN(received_at) FROM inbox WHERE state = 'new') AS oldest",
            )
            .fetch_one(pool)
            .await?;
            Ok((row.try_get("waiting")?, row.try_get("orphaned")?, row.try_get("oldest")?))
        })
    }

    /// What the page's charts draw, from `since` (ms) on.
    pub async fn activity(&self, since: i64) -> Result<Activity, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let finished = sqlx::query(if PG { FINISHED_BY_MINUTE.0 } else { FINISHED_BY_MINUTE.1 })
            .bind(since)
            .fetch_all(pool)
            .await?;
            let inbox = sqlx::query(
                "SELECT received_at, processed_at FROM inbox WHERE received_at >= $1 \
                 UNION ALL SELECT received_at, processed_at FROM inbox WHERE state = 'new' AND received_at < $1",
            )
            .bind(since)
            .fetch_all(pool)
            .await?;
            Ok(Activity {
                finished: finished
                    .iter()
                    .map(|r| Ok((r.try_get("minute")?, r.try_get("state")?, r.try_get("n")?)))
                    .collect::<Result<_, StoreError>>()?,
                inbox: inbox
                    .iter()
                    .map(|r| Ok((r.try_get("received_at")?, r.try_get("processed_at")?)))
                    .collect::<Result<_, StoreError>>()?,
            })
        })
    }
}
