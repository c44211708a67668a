//! Read-only queries for the people who run approvald: the operator page's
//! filters and charts, and the gauges `/metrics` reports. None of them is
//! on the approval path. The charts and gauges read an index, not a whole
//! table, except the count of operations by state (one pass over a small
//! index). The operation list reads the index its filters match (a
//! tenant's, by state, a tenant's by thread); a list of every tenant by
//! thread, by recipient, by time or unfiltered (the CLI's, the operator
//! page's) reads and sorts the table.

use sqlx::Row;

use super::db::Backend;
use super::rows::{Operation, PusharyCall};
use super::{Store, StoreError};

// The operations finished from `$1` on, counted by minute and state.
// Finished operations have neither a step due nor a poll: the
// `operations_finished` index, read from `$1` (on SQLite without it:
// 234 ms with 200,000 finished operations, against 16 ms for the 10,000
// in the window; decisions §37).
indexed_read!(
    FINISHED_BY_MINUTE,
    "SELECT (updated_at / 60000) * 60000 AS minute, state, COUNT(*) AS n FROM operations",
    "operations_finished",
    "WHERE due_at IS NULL AND poll_at IS NULL AND updated_at >= $1 \
     AND state IN ('succeeded', 'failed', 'expired', 'cancelled', 'denied', 'invalid', \
                   'refused', 'unreachable', 'uncertain') \
     GROUP BY 1, 2 ORDER BY 1, 2"
);

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
        self.filtered_operations(f, if f.limit > 0 { f.limit.min(1000) } else { 100 }).await
    }

    /// The operations `f` matches, newest first, at most `limit`. The text
    /// names only the filters given, so an index serves a tenant's list,
    /// a list by state and a tenant's list by thread; one text for every combination (`$n IS NULL OR ...`) is
    /// served by none, and read the whole table and sorted it (decisions
    /// §37).
    pub(super) async fn filtered_operations(
        &self,
        f: &OperatorFilter,
        limit: i64,
    ) -> Result<Vec<Operation>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(filtered_text(PG, f)));
            for text in [&f.tenant, &f.state, &f.thread_id, &f.recipient].into_iter().flatten() {
                q = q.bind(text.as_str());
            }
            for at in [f.created_after, f.created_before].into_iter().flatten() {
                q = q.bind(at);
            }
            let rows = q.bind(limit).fetch_all(pool).await?;
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

/// `filtered_operations`' text: a condition for each filter given, in the
/// order it binds them (the text filters, then the times), then the limit.
pub(super) fn filtered_text(pg: bool, f: &OperatorFilter) -> String {
    let recipient =
        if pg { "(spec::jsonb ->> 'externalId') =" } else { "json_extract(spec, '$.externalId') =" };
    let conditions = [
        f.tenant.as_ref().map(|_| "tenant ="),
        f.state.as_ref().map(|_| "state ="),
        f.thread_id.as_ref().map(|_| "thread_id ="),
        f.recipient.as_ref().map(|_| recipient),
        f.created_after.map(|_| "created_at >="),
        f.created_before.map(|_| "created_at <="),
    ];
    let mut sql = String::from(concat!("SELECT ", op_cols!(), " FROM operations"));
    let mut n = 0;
    for condition in conditions.into_iter().flatten() {
        n += 1;
        sql.push_str(if n == 1 { " WHERE " } else { " AND " });
        sql.push_str(&format!("{condition} ${n}"));
    }
    sql.push_str(&format!(" ORDER BY created_at DESC, id DESC LIMIT ${}", n + 1));
    sql
}

#[cfg(test)]
mod tests {
    use super::{OperatorFilter, filtered_text};
    use crate::store::db::test_support::sqlite_store;

    /// A valid spec whose decision goes to `recipient`.
    fn spec(recipient: &str) -> String {
        let body = serde_json::json!({"operationKey": "k", "threadId": "x", "interruptId": "i",
            "effect": "orders", "externalId": recipient, "question": "Proceed?", "toolName": "ship",
            "parameters": {}});
        let limits = crate::domain::operation::Limits { max_expires_in_secs: 3600 };
        let spec = crate::domain::operation::parse(&body, limits, 0).expect("a valid body");
        serde_json::to_string(&spec).expect("serializes")
    }

    // Every combination of filters binds what its text names, in order:
    // the rows are those a plain filter over all of them keeps, newest first.
    #[tokio::test]
    async fn every_combination_of_filters_finds_what_it_names() {
        let (_dir, store, pool) = sqlite_store().await;
        // (id, tenant, state, thread, recipient, created_at)
        let mut rows = Vec::new();
        for i in 0..24_i64 {
            let tenant = ["a", "b"][usize::try_from(i % 2).expect("small")];
            let state = ["pending", "succeeded", "uncertain"][usize::try_from(i % 3).expect("small")];
            let thread = ["t1", "t2", "t3", "t4"][usize::try_from(i % 4).expect("small")];
            let recipient = ["u1", "u2", "u3", "u4", "u5"][usize::try_from(i % 5).expect("small")];
            rows.push((format!("op{i:02}"), tenant, state, thread, recipient, 100 + i * 10));
        }
        for (id, tenant, state, thread, recipient, at) in &rows {
            sqlx::query(
                "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
                 decision_type, spec, decision_request, state, idempotency_key, deadline, created_at, updated_at) \
                 VALUES ($1, $2, $1, 'f', $3, 'i', 'e', 'confirm', $4, '{}', $5, $1, 9, $6, $6)",
            )
            .bind(id)
            .bind(tenant)
            .bind(thread)
            .bind(spec(recipient))
            .bind(state)
            .bind(at)
            .execute(&pool)
            .await
            .expect("inserts");
        }
        for mask in 0..64_u32 {
            let on = |bit: u32| mask & (1 << bit) != 0;
            let f = OperatorFilter {
                tenant: on(0).then(|| "a".into()),
                state: on(1).then(|| "succeeded".into()),
                thread_id: on(2).then(|| "t2".into()),
                recipient: on(3).then(|| "u2".into()),
                created_after: on(4).then_some(150),
                created_before: on(5).then_some(300),
                limit: 0,
            };
            let mut wanted: Vec<&(String, &str, &str, &str, &str, i64)> = rows
                .iter()
                .filter(|(_, tenant, state, thread, recipient, at)| {
                    f.tenant.as_deref().is_none_or(|t| t == *tenant)
                        && f.state.as_deref().is_none_or(|s| s == *state)
                        && f.thread_id.as_deref().is_none_or(|t| t == *thread)
                        && f.recipient.as_deref().is_none_or(|r| r == *recipient)
                        && f.created_after.is_none_or(|a| *at >= a)
                        && f.created_before.is_none_or(|b| *at <= b)
                })
                .collect();
            wanted.sort_by_key(|r| std::cmp::Reverse(r.5));
            let wanted: Vec<&str> = wanted.iter().take(5).map(|r| r.0.as_str()).collect();
            let found = store.filtered_operations(&f, 5).await.expect("lists");
            let found: Vec<&str> = found.iter().map(|o| o.id.as_str()).collect();
            assert_eq!(found, wanted, "{}", filtered_text(false, &f));
        }
    }

    // A list by state, a tenant's by thread or a tenant's reads an index, newest
    // first, instead of the whole table (decisions §37). A tenant's list by
    // state may read either index: the tenant's newest rows until enough
    // are in the state, or the state's newest rows of any tenant.
    #[tokio::test]
    async fn a_list_by_state_thread_or_tenant_reads_an_index_on_sqlite() {
        let (_dir, _store, pool) = sqlite_store().await;
        let by = |tenant: bool, state: bool, thread: bool| OperatorFilter {
            tenant: tenant.then(|| "a".into()),
            state: state.then(|| "uncertain".into()),
            thread_id: thread.then(|| "t".into()),
            ..Default::default()
        };
        let (by_state, by_tenant) = (
            "SEARCH operations USING INDEX operations_state (state=?)",
            "SEARCH operations USING INDEX operations_created (tenant=?)",
        );
        for (f, wanted) in [
            (by(false, true, false), vec![by_state]),
            (by(true, true, false), vec![by_state, by_tenant]),
            (
                by(true, false, true),
                vec!["SEARCH operations USING INDEX operations_thread (tenant=? AND thread_id=?)"],
            ),
            (by(true, false, false), vec![by_tenant]),
        ] {
            let sql = filtered_text(false, &f);
            let mut q = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")));
            for text in [&f.tenant, &f.state, &f.thread_id].into_iter().flatten() {
                q = q.bind(text.as_str());
            }
            let rows = q.bind(5_i64).fetch_all(&pool).await.expect("explains");
            let plan: Vec<String> = rows.iter().map(|r| sqlx::Row::get(r, "detail")).collect();
            assert!(plan.first().is_some_and(|p| wanted.contains(&p.as_str())), "{sql}: {plan:?}");
        }
    }
}
