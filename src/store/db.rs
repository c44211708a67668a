//! The store's statements, written once for both engines: SQLite (one
//! node, WAL, `synchronous=FULL` by default) and PostgreSQL (any number of
//! replicas). Placeholders are `$N`, which both accept. SQLite write
//! transactions start with `BEGIN IMMEDIATE`, so a read-then-write never
//! deadlocks on the lock upgrade; PostgreSQL's run at READ COMMITTED, where
//! every write is a compare-and-set or an upsert that re-checks its
//! condition on the current row.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection, Row, SqlStr};

use super::inbox_writer::OwnedInboxEntry;
use super::rows::{DeliveryRecord, InboxEntry, Operation, Transition};
use super::save::{Applied, FirstSaves};
use super::sqlite_group::SqliteGroup;
use super::work_signal::WorkSignal;
use super::{InboxInsert, Inserted, NewInboxEntry, OperationFilter, StoreError};
use crate::config::StoreConfig;

macro_rules! op_cols {
    () => {
        "id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, decision_type, spec, \
         decision_request, state, decision_id, answer, permit_id, delivery, outcome_status, idempotency_key, \
         result, receipt, receipt_outcome, consume_inflight, consume_attempts, delivery_inflight, attempts, \
         last_error, due_at, deadline, poll_at, resume_seq, opened_at, created_at, updated_at, version"
    };
}

/// A read of `operations` as `(PostgreSQL, SQLite)` texts, `$head`
/// (ending `FROM operations`) then `$rest`: on SQLite it names the index
/// it was written for. Without statistics (approvald runs no `ANALYZE`)
/// SQLite's planner took `operations_state` for the reconciler's sweeps
/// and the operator's chart, reading every pending or every finished
/// operation and sorting them: with 1,000,000 finished operations the
/// retention read took 619 ms a sweep, against 0.01 ms by
/// `operations_finished` (benches/sqlite_sweep_plan.py; decisions §37).
/// PostgreSQL's planner, with its statistics, takes these indexes itself.
macro_rules! indexed_read {
    ($name:ident, $head:expr, $index:literal, $rest:literal) => {
        pub(crate) const $name: (&str, &str) =
            (concat!($head, " ", $rest), concat!($head, " INDEXED BY ", $index, " ", $rest));
    };
}

macro_rules! sweep_sql {
    ($name:ident, $index:literal, $rest:literal) => {
        indexed_read!($name, concat!("SELECT ", op_cols!(), " FROM operations"), $index, $rest);
    };
}

sweep_sql!(
    PENDING_PAST_DEADLINE,
    "operations_pending_deadline",
    "WHERE state = 'pending' AND deadline <= $1 ORDER BY deadline LIMIT $2"
);
sweep_sql!(
    POLLS_DUE,
    "operations_poll",
    "WHERE poll_at <= $1 AND state = 'pending' ORDER BY poll_at LIMIT $2"
);
sweep_sql!(
    ARCHIVABLE,
    "operations_finished",
    "WHERE due_at IS NULL AND poll_at IS NULL AND inbox_at IS NULL AND updated_at < $1 \
     AND state IN ('succeeded', 'failed', 'expired', 'cancelled', 'denied', \
                   'invalid', 'refused', 'unreachable') \
     AND (delivery IS NULL OR delivery <> 'pending') AND (receipt IS NULL OR receipt <> 'pending') \
     ORDER BY updated_at LIMIT $2"
);

macro_rules! inbox_cols {
    () => {
        "id, tenant, correlation_id, answer, answered_at, source, state, received_at, duplicates, \
         operation_id, processed_at, note"
    };
}

/// `inbox_cols!` named `i_…`, to be read beside an operation's columns.
macro_rules! inbox_cols_as_i {
    () => {
        "id AS i_id, tenant AS i_tenant, correlation_id AS i_correlation_id, answer AS i_answer, \
         answered_at AS i_answered_at, source AS i_source, state AS i_state, received_at AS i_received_at, \
         duplicates AS i_duplicates, operation_id AS i_operation_id, processed_at AS i_processed_at, \
         note AS i_note"
    };
}

/// An SQL expression that lets the transaction in which it runs commit
/// without waiting for the WAL's flush (`synchronous_commit` off until
/// that transaction ends, never beyond). For the lease's transactions on
/// PostgreSQL, which write nothing that must outlive a crash (the leases'
/// table is unlogged) but whose reads of `operations` may prune a page:
/// that writes WAL, and the commit then waited for a flush on every
/// answer's way to its effect (decisions §23). The worker's next durable
/// commit flushes the WAL past it anyway.
macro_rules! commit_without_flush {
    () => {
        "set_config('synchronous_commit', 'off', true)"
    };
}

/// Whether the `inbox` row in scope waits behind an earlier answer of the
/// thread (`$thread`) that still has resume work: answers of a thread
/// resume in arrival order. Read with the entry, not by a query of its own.
/// With three arguments, for the answer whose tenant, thread and inbox id
/// they name (the save that takes its thread's lease, decisions §35).
macro_rules! held_back {
    ($thread:literal) => {
        held_back!("inbox.tenant", $thread, "inbox.id")
    };
    ($tenant:literal, $thread:literal, $inbox_id:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM operations e WHERE e.tenant = ",
            $tenant,
            " AND e.thread_id = ",
            $thread,
            " AND e.resume_seq IS NOT NULL AND e.resume_seq < ",
            $inbox_id,
            " AND (e.state IN ('answered', 'permitted', 'delivering') OR e.delivery = 'pending'))"
        )
    };
}

/// Runs `$body` with `$pool` bound to the engine's pool, `$begin` to the
/// statement that opens a write transaction and `$pg` to whether it is
/// PostgreSQL. The body is compiled once per engine.
macro_rules! with_pool {
    // A write. On SQLite it takes its turn in the process's group commit
    // (see `sqlite_group`): `$conn` is inside a transaction that commits
    // with the writes queued beside it, and the write returns after that
    // commit. A body that opens its own transaction gets a SAVEPOINT there.
    ($self:ident, $conn:ident, $pg:ident, write => $body:block) => {{
        match &$self.backend {
            Backend::Sqlite(_) => {
                let group = $self.sqlite_group.as_ref().expect("a SQLite store has a write group");
                let mut turn = group.turn().await?;
                let result: Result<_, StoreError> = async {
                    let $conn: &mut sqlx::SqliteConnection = turn.conn();
                    #[allow(dead_code)]
                    const $pg: bool = false;
                    $body
                }
                .await;
                turn.finish(result).await
            }
            Backend::Postgres(pool) => {
                let mut acquired = pool.acquire().await?;
                let $conn: &mut sqlx::PgConnection = &mut acquired;
                #[allow(dead_code)]
                const $pg: bool = true;
                $body
            }
        }
    }};
    ($self:ident, $pool:ident, $begin:ident, $pg:ident => $body:block) => {
        match &$self.backend {
            Backend::Sqlite($pool) => {
                #[allow(dead_code)]
                const $begin: &str = "BEGIN IMMEDIATE";
                #[allow(dead_code)]
                const $pg: bool = false;
                $body
            }
            Backend::Postgres($pool) => {
                #[allow(dead_code)]
                const $begin: &str = "BEGIN";
                #[allow(dead_code)]
                const $pg: bool = true;
                $body
            }
        }
    };
}

/// The read of threads with work (`Store::threads_with_work`), stopping
/// each kind of work (`k`) at `limit` rows.
fn threads_with_work_text(limit: &str) -> String {
    format!(
        "SELECT tenant, thread_id, t, 0 AS k FROM ( \
           SELECT o.tenant, o.thread_id, o.due_at AS t FROM operations o WHERE o.due_at <= $1 \
             AND NOT EXISTS (SELECT 1 FROM thread_leases l WHERE l.tenant = o.tenant \
                             AND l.thread_id = o.thread_id AND l.until > $1) \
             ORDER BY o.due_at LIMIT {limit}) d \
         UNION ALL \
         SELECT tenant, thread_id, t, 1 AS k FROM ( \
           SELECT o.tenant, o.thread_id, o.inbox_at AS t FROM operations o WHERE o.inbox_at IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM thread_leases l WHERE l.tenant = o.tenant \
                             AND l.thread_id = o.thread_id AND l.until > $1) \
             ORDER BY o.inbox_at LIMIT {limit}) a \
         ORDER BY t"
    )
}

macro_rules! insert_transition {
    ($tx:ident, $operation_id:expr, $t:expr) => {
        sqlx::query(
            "INSERT INTO transitions (operation_id, from_state, to_state, at, cause, actor) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind($operation_id)
        .bind(&$t.from)
        .bind(&$t.to)
        .bind($t.at)
        .bind(&$t.cause)
        .bind(&$t.actor)
        .execute(&mut *$tx)
    };
}

/// Marks the operations whose answer now waits in the inbox, among the
/// inbox rows `$lo..=$hi`, and adds their threads to `$threads`.
macro_rules! mark_waiting_answers {
    ($tx:ident, $lo:expr, $hi:expr, $now:expr, $threads:expr) => {
        for row in sqlx::query(
            "UPDATE operations SET inbox_at = $3 WHERE inbox_at IS NULL AND decision_id IS NOT NULL \
             AND (tenant, decision_id) IN (SELECT i.tenant, i.correlation_id FROM inbox i \
               WHERE i.id BETWEEN $1 AND $2 AND i.state = 'new') RETURNING tenant, thread_id",
        )
        .bind($lo)
        .bind($hi)
        .bind($now)
        .fetch_all(&mut *$tx)
        .await?
        {
            $threads.push((row.try_get("tenant")?, row.try_get("thread_id")?));
        }
    };
}

/// The results of a batch's entries, counting those it did not store
/// (`$stored[i]` is `None`): a later body for a decision already in the
/// inbox is its duplicate (reviving an orphaned row, whose operation is
/// then marked, its thread added to `$threads`), one for an archived
/// decision a replay. Rare, so statement by statement, on `$conn`.
macro_rules! inbox_repeats {
    ($conn:ident, $entries:expr, $stored:expr, $now:expr, $threads:expr) => {{
        let mut results = Vec::with_capacity($entries.len());
        for (e, id) in $entries.iter().zip($stored.iter()) {
            let r = match *id {
                Some(id) => InboxInsert::Stored(id),
                None => {
                    let id: Option<i64> = sqlx::query_scalar(
                        "UPDATE inbox SET duplicates = duplicates + 1, \
                         state = CASE WHEN state = 'orphaned' THEN 'new' ELSE state END \
                         WHERE tenant = $1 AND correlation_id = $2 RETURNING id",
                    )
                    .bind(&e.tenant)
                    .bind(&e.correlation_id)
                    .fetch_optional(&mut *$conn)
                    .await?;
                    // A repeat may find (or revive) a row still waiting:
                    // make sure its operation is marked.
                    if let Some(id) = id {
                        mark_waiting_answers!($conn, id, id, $now, $threads);
                    }
                    id.map_or(InboxInsert::Archived, InboxInsert::Duplicate)
                }
            };
            results.push(r);
        }
        results
    }};
}

macro_rules! insert_delivery {
    ($exec:expr, $d:expr) => {
        sqlx::query(
            "INSERT INTO deliveries (operation_id, attempt, started_at, duration_ms, status_code, error, \
             response_body) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&$d.operation_id)
        .bind($d.attempt)
        .bind($d.started_at)
        .bind($d.duration_ms)
        .bind($d.status_code)
        .bind(&$d.error)
        .bind(&$d.response_body)
        .execute($exec)
    };
}

/// What a worker holding a thread does next (`Store::next_work_for_thread`).
#[derive(Debug)]
pub enum ThreadWork {
    /// The thread's oldest waiting answer, its operation, and whether it is
    /// held back behind an earlier answer's resume work.
    Answer(Box<InboxEntry>, Operation, bool),
    /// The thread's earliest step that is due.
    Due(Operation),
    /// Nothing is due now; the thread's next step is due at this time
    /// (ms). Whoever lets the thread go sees that a worker wakes for it:
    /// a read of the store for work that comes when it is due may find
    /// the thread still held and pass it by (decisions §33).
    Later(i64),
}

/// What a batch of callbacks did: one result per entry, and the threads
/// whose operations now have an answer waiting (none: no worker need wake),
/// for the workers of this process to take without first reading the store
/// for work.
#[derive(Debug)]
pub struct BatchInsert {
    pub results: Vec<InboxInsert>,
    pub threads: Vec<(String, String)>,
    /// PostgreSQL: the rows stored that marked no operation, for
    /// `mark_stored_unmarked` once they are acknowledged.
    pub unmarked: Vec<i64>,
    /// PostgreSQL: answers stored for pending operations, each with its
    /// operation as marked, one per thread of the batch at most: a worker
    /// applies such an answer at once, taking the thread's lease with its
    /// first save (`TakeLease`, decisions §35).
    pub answers: Vec<(InboxEntry, Operation)>,
    /// Answers applied by their first saves in the batch's own
    /// transaction, each holding its thread's lease (decisions §36) or,
    /// on SQLite, its claim (§38).
    pub applied: Vec<Applied>,
}

/// Stores the rows of `v` (but its padding) that are not repeats of an
/// archived decision; a repeat of a stored one conflicts and is counted by
/// the caller.
///
/// `insert_inbox_rows!(plain)` leaves the conflict clause out: the whole
/// statement then fails on a repeat (PostgreSQL's first try, see
/// `Store::insert_inbox_batch`).
macro_rules! insert_inbox_rows {
    () => {
        insert_inbox_rows!("ON CONFLICT (tenant, correlation_id) DO NOTHING ")
    };
    (plain) => {
        insert_inbox_rows!("")
    };
    ($conflict:literal) => {
        concat!(
            "INSERT INTO inbox (tenant, correlation_id, answer, answered_at, body, body_sha256, source, state, \
             received_at) SELECT tenant, correlation_id, answer, answered_at, body, body_sha256, source, 'new', \
             received_at FROM v WHERE v.tenant IS NOT NULL AND NOT EXISTS (SELECT 1 FROM archived_operations a \
               WHERE a.tenant = v.tenant AND a.decision_id = v.correlation_id) ",
            $conflict,
            "RETURNING id, tenant, correlation_id"
        )
    };
}

/// Texts of an inbox batch, one per power of two from 1 to `MAX_BATCH`
/// rows, each built once: a handful of texts serve every batch size and
/// each is prepared once per connection.
pub(super) type BatchTexts = [std::sync::OnceLock<String>; super::MAX_BATCH.ilog2() as usize + 1];

/// The text for `rows` rows (a batch's, or a read's limit) from `texts`,
/// built by `build` the first time (and every time for a size that is not
/// a power of two up to `MAX_BATCH`).
pub(super) fn batch_text(
    texts: &'static BatchTexts,
    rows: usize,
    build: fn(usize) -> String,
) -> std::borrow::Cow<'static, str> {
    match texts.get(rows.trailing_zeros() as usize) {
        Some(text) if rows.is_power_of_two() => std::borrow::Cow::Borrowed(text.get_or_init(|| build(rows))),
        _ => std::borrow::Cow::Owned(build(rows)),
    }
}

/// Binds the `unique` entries of an inbox batch (with their bodies'
/// `hashes`) to `$q`, eight values a row, then NULL rows, which the insert
/// skips, up to `$rows`.
macro_rules! bind_inbox_rows {
    ($q:ident, $entries:expr, $unique:expr, $hashes:expr, $rows:expr) => {
        for (&i, hash) in $unique.iter().zip($hashes) {
            let e = &$entries[i];
            $q = $q
                .bind(&e.tenant)
                .bind(&e.correlation_id)
                .bind(&e.answer)
                .bind(&e.answered_at)
                .bind(&e.body)
                .bind(hash)
                .bind(e.source)
                .bind(e.received_at);
        }
        for _ in $unique.len()..$rows {
            let none: Option<String> = None;
            $q = $q
                .bind(none.clone())
                .bind(none.clone())
                .bind(none.clone())
                .bind(none.clone())
                .bind(None::<Vec<u8>>)
                .bind(none.clone())
                .bind(none)
                .bind(None::<i64>);
        }
    };
}

/// How a PostgreSQL batch's insert finds the operations its rows answer.
#[derive(Clone, Copy)]
enum Finding {
    /// Marks them (`inbox_at`), with the conflict clause when `plain` is
    /// false (a repeat in the batch).
    Mark { plain: bool },
    /// Locks them, as the mark would, and leaves them unmarked: the
    /// applying transaction's (decisions §39), whose first saves write
    /// the operations' next version, and which marks only those not saved.
    Lock,
}

/// PostgreSQL's batch insert text for `rows` rows (a power of two); it
/// is on every batch's path. SQLite's is in `inbox_sqlite`. `plain`: the
/// first try's, without the conflict clause.
fn inbox_insert_text(rows: usize, finding: Finding) -> std::borrow::Cow<'static, str> {
    static TEXTS: BatchTexts = [const { std::sync::OnceLock::new() }; _];
    static PLAIN: BatchTexts = [const { std::sync::OnceLock::new() }; _];
    static LOCK: BatchTexts = [const { std::sync::OnceLock::new() }; _];
    match finding {
        Finding::Mark { plain: true } => {
            batch_text(&PLAIN, rows, |rows| build_inbox_insert_text(rows, insert_inbox_rows!(plain), false))
        }
        Finding::Mark { plain: false } => {
            batch_text(&TEXTS, rows, |rows| build_inbox_insert_text(rows, insert_inbox_rows!(), false))
        }
        Finding::Lock => {
            batch_text(&LOCK, rows, |rows| build_inbox_insert_text(rows, insert_inbox_rows!(plain), true))
        }
    }
}

fn build_inbox_insert_text(rows: usize, insert: &str, lock: bool) -> String {
    let mut sql = String::from(
        "WITH v (tenant, correlation_id, answer, answered_at, body, body_sha256, source, received_at) AS \
         (VALUES ",
    );
    for n in 0..rows {
        if n > 0 {
            sql.push_str(", ");
        }
        let p = n * 8;
        sql.push_str(&format!(
            "(${}, ${}, ${}, ${}, ${}, ${}, ${}, ${})",
            p + 1,
            p + 2,
            p + 3,
            p + 4,
            p + 5,
            p + 6,
            p + 7,
            p + 8
        ));
    }
    // The operations the stored rows answer are marked by the same
    // statement (it sees the rows through `ins`), committed on its own:
    // one round trip where BEGIN, insert, mark and COMMIT were four, on
    // every callback's way to its acknowledgement. In the applying
    // transaction they are found and locked instead (`Finding::Lock`).
    sql.push_str("), ins AS (");
    sql.push_str(insert);
    // The marked operation comes back whole, as the mark left it (the
    // latest version: an UPDATE reads the row it locks), so its answer can
    // be handed to a worker with it (decisions §35).
    let marked: Vec<String> = op_cols!().split(',').map(|c| format!("o.{}", c.trim())).collect();
    let find = if lock {
        // The same rows the mark would take, their latest versions, locked
        // as the mark's update would lock them.
        format!(
            "SELECT {} FROM operations o JOIN ins ON o.tenant = ins.tenant AND o.decision_id = ins.correlation_id \
             WHERE o.inbox_at IS NULL AND o.decision_id IS NOT NULL FOR NO KEY UPDATE OF o",
            marked.join(", ")
        )
    } else {
        format!(
            "UPDATE operations o SET inbox_at = ${} FROM ins WHERE o.inbox_at IS NULL \
             AND o.decision_id IS NOT NULL AND o.tenant = ins.tenant AND o.decision_id = ins.correlation_id \
             RETURNING {}",
            rows * 8 + 1,
            marked.join(", ")
        )
    };
    sql.push_str(&format!(
        "), m AS ({find}) SELECT ins.id AS inbox_id, ins.tenant AS inbox_tenant, \
         ins.correlation_id AS inbox_correlation_id, m.* \
         FROM ins LEFT JOIN m ON m.tenant = ins.tenant AND m.decision_id = ins.correlation_id"
    ));
    sql
}

/// The answers a batch hands on (`BatchInsert::answers`): of the rows at
/// `pending` in `rows`, each its thread's one answer in the batch (of
/// several, the worker must take the first by arrival, which its read of
/// the thread finds), with its operation decoded only then, on the
/// writer's way to its acknowledgements. The batch is committed: an
/// operation that does not decode is left to the worker's read of its
/// thread, which reports it, not made the callbacks' error.
pub(super) fn handed_answers(
    rows: &[sqlx::postgres::PgRow],
    pending: &[usize],
    threads: &[(String, String)],
    entries: &[OwnedInboxEntry],
    first: &HashMap<(&str, &str), usize>,
) -> Vec<(InboxEntry, Operation)> {
    let answers_per_thread = answers_per_thread(threads);
    let mut answers = Vec::new();
    for &place in pending {
        let row = &rows[place];
        let Ok(op) = Operation::from_row(row) else { continue };
        let key = (op.tenant.clone(), op.thread_id.clone());
        let (Ok(id), Ok(correlation_id)) =
            (row.try_get::<i64, _>("inbox_id"), row.try_get::<&str, _>("inbox_correlation_id"))
        else {
            continue;
        };
        if answers_per_thread.get(&key) == Some(&1)
            && let Some(&i) = first.get(&(op.tenant.as_str(), correlation_id))
        {
            answers.push((stored_entry(&entries[i], id), op));
        }
    }
    answers
}

/// How many of a batch's answers each thread got (`threads` has a
/// thread once for each operation the batch marked, or found and locked,
/// §39): only a thread's one answer is handed on or applied at once,
/// since of several the first by arrival goes first, which its read
/// decides.
pub(super) fn answers_per_thread(threads: &[(String, String)]) -> HashMap<&(String, String), usize> {
    let mut per_thread: HashMap<&(String, String), usize> = HashMap::new();
    for t in threads {
        *per_thread.entry(t).or_default() += 1;
    }
    per_thread
}

/// The inbox row `id` as the batch stored it from `e`.
pub(super) fn stored_entry(e: &OwnedInboxEntry, id: i64) -> InboxEntry {
    InboxEntry {
        id,
        tenant: e.tenant.clone(),
        correlation_id: e.correlation_id.clone(),
        answer: e.answer.clone(),
        answered_at: e.answered_at.clone(),
        source: e.source.to_owned(),
        state: "new".to_owned(),
        received_at: e.received_at,
        duplicates: 0,
        operation_id: None,
        processed_at: None,
        note: None,
    }
}

pub(super) fn record_stored(
    first: &HashMap<(&str, &str), usize>,
    stored: &mut [Option<i64>],
    tenant: &str,
    correlation_id: &str,
    id: i64,
) {
    if let Some(&i) = first.get(&(tenant, correlation_id)) {
        stored[i] = Some(id);
    }
}

/// What a batch's insert returned, read: by entry, the id of the row it
/// stored (first entries only); the threads of the operations the rows
/// marked (or found, §39); the rows that marked none; and the places, in
/// the rows, of those that marked a pending operation.
pub(super) struct StoredRows {
    pub(super) stored: Vec<Option<i64>>,
    pub(super) threads: Vec<(String, String)>,
    pub(super) unmarked: Vec<i64>,
    pub(super) pending: Vec<usize>,
}

pub(super) fn read_stored_rows(
    rows: &[sqlx::postgres::PgRow],
    first: &HashMap<(&str, &str), usize>,
    entries: usize,
) -> Result<StoredRows, StoreError> {
    let mut out = StoredRows {
        stored: vec![None; entries],
        threads: Vec::new(),
        unmarked: Vec::new(),
        pending: Vec::new(),
    };
    for (place, row) in rows.iter().enumerate() {
        let tenant: &str = row.try_get("inbox_tenant")?;
        let id = row.try_get("inbox_id")?;
        match row.try_get::<Option<String>, _>("thread_id")? {
            Some(thread) => {
                out.threads.push((tenant.to_string(), thread));
                if row.try_get::<Option<&str>, _>("state")? == Some("pending") {
                    out.pending.push(place);
                }
            }
            None => out.unmarked.push(id),
        }
        record_stored(first, &mut out.stored, tenant, row.try_get("inbox_correlation_id")?, id);
    }
    Ok(out)
}

/// From the inbox rows `$1` to their operations, by the operations'
/// decision index (`EXPLAIN ANALYZE`: 0.36 ms for 40 rows). Each row is
/// looked up by its key in a LATERAL subquery with a LIMIT, which
/// PostgreSQL runs per id through the primary key, and its state is
/// checked outside it: with `WHERE id = ANY($1) AND state = 'new'`,
/// PostgreSQL, its statistics behind an inbox that grows by thousands a
/// second, added the partial `inbox_new_received` index to the key's in a
/// `BitmapAnd`, and read every waiting callback on every call (60,000
/// rows, 3.6 ms against 1.6; in `approvald bench`'s ingest 7.3 ms a call,
/// more of PostgreSQL's time than the callbacks' own inserts, decisions
/// §22); without the state, it may scan the whole inbox instead.
pub(crate) const MARK_STORED_UNMARKED: &str = "WITH i AS MATERIALIZED (SELECT r.tenant, r.correlation_id, r.received_at \
     FROM unnest($1::bigint[]) AS k(id) CROSS JOIN LATERAL (SELECT tenant, correlation_id, received_at, state \
       FROM inbox WHERE inbox.id = k.id LIMIT 1) AS r WHERE r.state = 'new') \
     UPDATE operations o SET inbox_at = i.received_at FROM i WHERE o.tenant = i.tenant \
     AND o.decision_id = i.correlation_id AND o.decision_id IS NOT NULL AND o.inbox_at IS NULL \
     RETURNING o.tenant, o.thread_id";

/// How a thread's work is read (`Store::thread_work`).
#[derive(Clone, Copy)]
enum Visit<'a> {
    Read,
    /// The holder's read, giving the lease up if nothing is due now.
    Release {
        owner: &'a str,
    },
    /// The lease taken first, in the same round trip.
    Take {
        owner: &'a str,
        until: i64,
    },
}

/// The PostgreSQL thread read of `next_work_for_thread`, with the
/// operation and its waiting answer as whole rows (`o`, `i.r`).
macro_rules! pg_thread_work_rows {
    () => {
        concat!(
            "SELECT o, i.r, i.held, 1 FROM operations o LEFT JOIN LATERAL (SELECT inbox AS r, ",
            held_back!("$2"),
            " AS held FROM inbox WHERE inbox.tenant = o.tenant AND inbox.correlation_id = o.decision_id LIMIT 1) i \
               ON (i.r).state = 'new' \
             WHERE o.tenant = $1 AND o.thread_id = $2 AND o.inbox_at IS NOT NULL AND o.decision_id IS NOT NULL \
             UNION ALL SELECT o, NULL::inbox, NULL::boolean, 0 FROM operations o \
             WHERE o.tenant = $1 AND o.thread_id = $2 AND o.due_at IS NOT NULL \
               AND (o.inbox_at IS NULL OR o.decision_id IS NULL)"
        )
    };
}

/// Makes `pg_temp.approvald_take_thread` on the connection: the lease
/// (as `acquire_lease`), then, only if it was taken, a row saying so and
/// the thread's work. Temporary, as the save's function is
/// (save/postgres.rs). PL/pgSQL prepares each statement once per
/// connection and, the function being volatile, runs each on a snapshot
/// of its own.
/// It commits without waiting for the WAL (`commit_without_flush!`).
fn take_thread_setup() -> &'static str {
    concat!(
        "CREATE OR REPLACE FUNCTION pg_temp.approvald_take_thread(text, text, text, bigint, bigint) \
         RETURNS TABLE (w_op operations, w_inbox inbox, w_held boolean, w_waits integer) \
         LANGUAGE plpgsql AS $fn$ \
         #variable_conflict use_column\n \
         DECLARE got text; \
         BEGIN \
           PERFORM ",
        commit_without_flush!(),
        "; \
           INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ($1, $2, $3, $5) \
             ON CONFLICT (tenant, thread_id) DO UPDATE SET owner = excluded.owner, until = excluded.until \
             WHERE thread_leases.until <= $4 OR thread_leases.owner = excluded.owner \
             RETURNING owner INTO got; \
           IF got IS DISTINCT FROM $3 THEN RETURN; END IF; \
           RETURN QUERY SELECT NULL::operations, NULL::inbox, NULL::boolean, -1; \
           RETURN QUERY ",
        pg_thread_work_rows!(),
        "; END $fn$"
    )
}

/// The call, its rows named as `next_work_for_thread`'s: the operation's
/// columns by name (`op_cols!`), not `(t.w_op).*`, whose list would follow
/// the table's and change under a prepared statement when a migration
/// adds a column.
fn take_thread_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let op: Vec<String> =
            op_cols!().split(',').map(|c| format!("(t.w_op).{0} AS {0}", c.trim())).collect();
        let inbox: Vec<String> =
            inbox_cols!().split(',').map(|c| format!("(t.w_inbox).{0} AS i_{0}", c.trim())).collect();
        format!(
            "SELECT {}, t.w_waits AS answer_waits, {}, t.w_held AS i_held_back \
             FROM pg_temp.approvald_take_thread($1, $2, $3, $4, $5) AS t",
            op.join(", "),
            inbox.join(", ")
        )
    })
}

/// The error of calling a connection's temporary function before it was
/// made there: no such function, or no temporary schema yet.
pub(super) fn is_missing_temp_function(e: &dyn sqlx::error::DatabaseError) -> bool {
    matches!(e.code().as_deref(), Some("42883" | "3F000"))
}

/// Our migrations table is named for us so no other library's collides.
const MIGRATIONS_TABLE: &str = "approvald_migrations";

const SQLITE_MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../../migrations/sqlite/0001_init.sql")),
    (2, "webhook secrets", include_str!("../../migrations/sqlite/0002_webhook_secrets.sql")),
    (3, "archive", include_str!("../../migrations/sqlite/0003_archive.sql")),
    (4, "inbox_at", include_str!("../../migrations/sqlite/0004_inbox_at.sql")),
    (5, "thread work", include_str!("../../migrations/sqlite/0005_thread_work.sql")),
    (6, "pushary calls", include_str!("../../migrations/sqlite/0006_pushary_calls.sql")),
    (7, "drop inbox_new", include_str!("../../migrations/sqlite/0007_drop_inbox_new.sql")),
    (8, "operations created", include_str!("../../migrations/sqlite/0008_operations_created.sql")),
];
const POSTGRES_MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../../migrations/postgres/0001_init.sql")),
    (2, "webhook secrets", include_str!("../../migrations/postgres/0002_webhook_secrets.sql")),
    (3, "archive", include_str!("../../migrations/postgres/0003_archive.sql")),
    (4, "inbox_at", include_str!("../../migrations/postgres/0004_inbox_at.sql")),
    (5, "thread work", include_str!("../../migrations/postgres/0005_thread_work.sql")),
    (6, "pushary calls", include_str!("../../migrations/postgres/0006_pushary_calls.sql")),
    (7, "unlogged leases", include_str!("../../migrations/postgres/0007_unlogged_leases.sql")),
    (8, "drop inbox_new", include_str!("../../migrations/postgres/0008_drop_inbox_new.sql")),
    (
        9,
        "audit rows without foreign keys",
        include_str!("../../migrations/postgres/0009_audit_rows_without_foreign_keys.sql"),
    ),
    (10, "operations created", include_str!("../../migrations/postgres/0010_operations_created.sql")),
];

fn migrator(files: &'static [(i64, &'static str, &'static str)]) -> Migrator {
    let migrations = files
        .iter()
        .map(|(v, d, sql)| {
            Migration::new(*v, (*d).into(), MigrationType::Simple, SqlStr::from_static(sql), false)
        })
        .collect();
    let mut m = Migrator::with_migrations(migrations);
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
}

#[derive(Clone, Debug)]
pub(super) enum Backend {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

#[derive(Clone, Debug)]
pub struct Store {
    pub(super) backend: Backend,
    /// SQLite admits one writer at a time and makes the others poll with
    /// growing sleeps (its busy handler), and each commit costs an fsync.
    /// Writers of this process take turns here instead, in order, and
    /// commit in groups; the busy timeout remains for other processes (the
    /// CLI).
    pub(super) sqlite_group: Option<std::sync::Arc<SqliteGroup>>,
    /// SQLite: the saves waiting for the writer, run in batches (`save`).
    pub(super) sqlite_saves: Option<std::sync::Arc<super::save::SaveQueue>>,
    /// PostgreSQL: the saves, run in batches (`save`).
    pub(super) pg_saves: Option<std::sync::Arc<super::save::PgSaveQueue>>,
    work_signal: std::sync::Arc<WorkSignal>,
}

/// A PostgreSQL connection idle this long is pinged before it is used.
const PING_AFTER_IDLE: Duration = Duration::from_secs(30);

impl Store {
    /// Opens `store.url`: `sqlite://…` or `postgres://…`.
    pub async fn connect(config: &StoreConfig) -> Result<Self, StoreError> {
        let backend = if config.url.starts_with("postgres") {
            let options = PgConnectOptions::from_str(&config.url)
                .map_err(|e| StoreError::Unavailable(format!("bad store.url: {e}")))?
                .application_name("approvald")
                // A write that waits this long for a lock fails (the receiver
                // then answers 503), as SQLite's busy_timeout does.
                .options([("lock_timeout", format!("{}ms", config.busy_timeout_ms))]);
            let pool = PgPoolOptions::new()
                .max_connections(config.max_connections)
                .acquire_timeout(Duration::from_millis(config.busy_timeout_ms.max(1000)))
                // sqlx pings every connection it hands out: a round trip and
                // a backend woken before each statement, with the connection
                // held through it. Under `approvald bench` that was a dozen
                // per approval, and the pool's waits at full speed were
                // milliseconds. A connection idle for a while is still
                // pinged (a restarted server or a dropped link shows there,
                // not in the statement); one in use a moment ago is not,
                // and if it broke since, its statement fails like any
                // statement on a link that breaks (the caller sees the
                // store unavailable; sqlx discards the connection).
                .test_before_acquire(false)
                .before_acquire(|conn, meta| {
                    Box::pin(async move {
                        if meta.idle_for >= PING_AFTER_IDLE {
                            conn.ping().await?;
                        }
                        Ok(true)
                    })
                })
                .connect_with(options)
                .await?;
            Backend::Postgres(pool)
        } else {
            let synchronous = match config.sqlite_synchronous.as_str() {
                "normal" => SqliteSynchronous::Normal,
                "extra" => SqliteSynchronous::Extra,
                _ => SqliteSynchronous::Full,
            };
            let options = SqliteConnectOptions::from_str(&config.url)
                .map_err(|e| StoreError::Unavailable(format!("bad store.url: {e}")))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(synchronous)
                .busy_timeout(Duration::from_millis(config.busy_timeout_ms))
                .foreign_keys(true)
                // The save's table and sorts stay off the disk.
                .pragma("temp_store", "memory")
                // Every connection fills a cache of its own with the same
                // hot pages; at SQLite's default (2 MiB each) the caches
                // warming up over minutes were most of the daemon's memory
                // growth under a long ingest (decisions §28).
                .pragma("cache_size", format!("-{}", config.sqlite_cache_kib));
            let pool = SqlitePoolOptions::new()
                .max_connections(config.max_connections)
                .acquire_timeout(Duration::from_secs(10))
                // A ping is a hand-off to the connection's thread and back
                // before every read; a file does not hang up.
                .test_before_acquire(false)
                .connect_with(options)
                .await?;
            Backend::Sqlite(pool)
        };
        let sqlite_group = match &backend {
            Backend::Sqlite(pool) => Some(SqliteGroup::new(pool.clone())),
            Backend::Postgres(_) => None,
        };
        let work_signal = WorkSignal::new();
        let sqlite_saves = sqlite_group.as_ref().map(super::save::SaveQueue::new);
        let pg_saves = match &backend {
            Backend::Postgres(pool) => Some(super::save::PgSaveQueue::new(pool.clone())),
            Backend::Sqlite(_) => None,
        };
        Ok(Self { backend, sqlite_group, sqlite_saves, pg_saves, work_signal })
    }

    /// SQLite: how much of the time since the store was opened its one
    /// writer was taken. None on PostgreSQL, whose writers do not queue
    /// behind one another in this process.
    pub fn sqlite_writer_busy(&self) -> Option<super::WriterBusy> {
        self.sqlite_group.as_ref().map(|g| g.busy())
    }

    /// Names this store handle (and its clones) in the NOTIFYs it sends.
    /// Every writer in a process that signals work also wakes that
    /// process's workers directly, so a listener skips its own signals
    /// rather than waking a second worker to look for work already taken.
    pub fn instance(&self) -> &str {
        &self.work_signal.instance
    }

    pub fn is_postgres(&self) -> bool {
        matches!(self.backend, Backend::Postgres(_))
    }

    /// The PostgreSQL pool, for LISTEN; `None` on SQLite.
    pub fn pg_pool(&self) -> Option<&PgPool> {
        match &self.backend {
            Backend::Postgres(p) => Some(p),
            Backend::Sqlite(_) => None,
        }
    }

    /// Tells workers on every replica that work was committed (PostgreSQL
    /// LISTEN/NOTIFY; see `work_signal`). Nothing on SQLite.
    pub fn signal_work(&self) {
        if let Backend::Postgres(pool) = &self.backend {
            self.work_signal.signal(pool);
        }
    }

    /// This process runs workers, which take the work it commits itself:
    /// its NOTIFYs can wait a little and carry several signals.
    pub fn workers_here(&self) {
        self.work_signal.workers_here();
    }

    /// Applies pending migrations. Safe to run again, and (PostgreSQL)
    /// from several processes at once: sqlx takes an advisory lock.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let result = match &self.backend {
            Backend::Sqlite(pool) => migrator(SQLITE_MIGRATIONS).run(pool).await,
            Backend::Postgres(pool) => migrator(POSTGRES_MIGRATIONS).run(pool).await,
        };
        result.map_err(|e| StoreError::Migrate(e.to_string()))
    }

    /// The migrations this binary knows, oldest first: (version, description).
    pub fn known_migrations(&self) -> Vec<(i64, &'static str)> {
        let files = if self.is_postgres() { POSTGRES_MIGRATIONS } else { SQLITE_MIGRATIONS };
        files.iter().map(|(v, d, _)| (*v, *d)).collect()
    }

    /// Applies pending migrations up to and including `version`, as
    /// `migrate` does (same lock, same checks); lets the CLI report each.
    pub async fn migrate_to(&self, version: i64) -> Result<(), StoreError> {
        let result = match &self.backend {
            Backend::Sqlite(pool) => migrator(SQLITE_MIGRATIONS).run_to(version, pool).await,
            Backend::Postgres(pool) => migrator(POSTGRES_MIGRATIONS).run_to(version, pool).await,
        };
        result.map_err(|e| StoreError::Migrate(e.to_string()))
    }

    /// The newest migration applied, and the newest this binary knows.
    pub async fn migration_status(&self) -> Result<(Option<i64>, i64), StoreError> {
        let files = if self.is_postgres() { POSTGRES_MIGRATIONS } else { SQLITE_MIGRATIONS };
        let latest = files.iter().map(|m| m.0).max().unwrap_or(0);
        with_pool!(self, pool, BEGIN, PG => {
            let applied: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT MAX(version) FROM {MIGRATIONS_TABLE} WHERE success = TRUE"
            )))
            .fetch_one(pool)
            .await
            .unwrap_or(None);
            Ok((applied, latest))
        })
    }

    pub async fn close(&self) {
        if let Some(group) = &self.sqlite_group {
            group.close().await;
        }
        match &self.backend {
            Backend::Sqlite(p) => p.close().await,
            Backend::Postgres(p) => p.close().await,
        }
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            sqlx::query("SELECT 1").execute(pool).await?;
            Ok(())
        })
    }

    /// PostgreSQL: whether this connection's role may make temporary
    /// objects in its database, with the database's and the role's names.
    /// The batched save and the thread take are temporary functions
    /// (decisions §19, §20); without the privilege every save fails.
    /// None on SQLite.
    pub async fn pg_temp_privilege(&self) -> Result<Option<(bool, String, String)>, StoreError> {
        let Backend::Postgres(pool) = &self.backend else { return Ok(None) };
        let row: (bool, String, String) = sqlx::query_as(
            "SELECT has_database_privilege(current_database(), 'TEMPORARY'), current_database()::text, \
             current_user::text",
        )
        .fetch_one(pool)
        .await?;
        Ok(Some(row))
    }

    // ---- operations -------------------------------------------------------------------------

    /// Inserts a new operation, or returns the one already stored under its key.
    pub async fn insert_operation(&self, op: &Operation, first: &Transition) -> Result<Inserted, StoreError> {
        with_pool!(self, conn, PG, write => {
            let mut tx = conn.begin().await?;
            // The key of an archived operation is still taken.
            let archived: Option<(String, String)> = sqlx::query_as(
                "SELECT fingerprint, document FROM archived_operations WHERE tenant = $1 AND operation_key = $2",
            )
            .bind(&op.tenant)
            .bind(&op.operation_key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some((fingerprint, document)) = archived {
                tx.rollback().await?;
                return Ok(Inserted::Archived { fingerprint, document });
            }
            let done = sqlx::query(
                "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
                 decision_type, spec, decision_request, state, idempotency_key, due_at, deadline, created_at, \
                 updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $15) \
                 ON CONFLICT (tenant, operation_key) DO NOTHING",
            )
            .bind(&op.id)
            .bind(&op.tenant)
            .bind(&op.operation_key)
            .bind(&op.fingerprint)
            .bind(&op.thread_id)
            .bind(&op.interrupt_id)
            .bind(&op.effect)
            .bind(op.decision_type.as_str())
            .bind(serde_json::to_string(&op.spec).expect("spec serializes"))
            .bind(op.decision_request.to_string())
            .bind(op.state.as_str())
            .bind(&op.idempotency_key)
            .bind(op.due_at)
            .bind(op.deadline)
            .bind(op.created_at)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                let row = sqlx::query(concat!(
                    "SELECT ",
                    op_cols!(),
                    " FROM operations WHERE tenant = $1 AND operation_key = $2"
                ))
                .bind(&op.tenant)
                .bind(&op.operation_key)
                .fetch_one(&mut *tx)
                .await?;
                tx.rollback().await?;
                return Ok(Inserted::Existing(Box::new(Operation::from_row(&row)?)));
            }
            insert_transition!(tx, &op.id, first).await?;
            tx.commit().await?;
            self.signal_work();
            Ok(Inserted::Created)
        })
    }

    pub async fn get_operation(
        &self,
        tenant: Option<&str>,
        id: &str,
    ) -> Result<Option<Operation>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let row = sqlx::query(concat!(
                "SELECT ",
                op_cols!(),
                " FROM operations WHERE id = $1 AND ($2 IS NULL OR tenant = $2)"
            ))
            .bind(id)
            .bind(tenant)
            .fetch_optional(pool)
            .await?;
            row.as_ref().map(Operation::from_row).transpose()
        })
    }

    pub async fn list_operations(&self, f: &OperationFilter) -> Result<Vec<Operation>, StoreError> {
        let filter = super::OperatorFilter {
            tenant: f.tenant.clone(),
            state: f.state.map(|s| s.as_str().to_string()),
            thread_id: f.thread_id.clone(),
            ..Default::default()
        };
        self.filtered_operations(&filter, if f.limit > 0 { f.limit } else { 100 }).await
    }

    pub async fn transitions(&self, operation_id: &str) -> Result<Vec<Transition>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(
                "SELECT from_state, to_state, at, cause, actor FROM transitions WHERE operation_id = $1 ORDER BY id",
            )
            .bind(operation_id)
            .fetch_all(pool)
            .await?;
            rows.iter().map(Transition::from_row).collect()
        })
    }

    pub async fn deliveries(&self, operation_id: &str) -> Result<Vec<DeliveryRecord>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(
                "SELECT operation_id, attempt, started_at, duration_ms, status_code, error, response_body \
                 FROM deliveries WHERE operation_id = $1 ORDER BY id",
            )
            .bind(operation_id)
            .fetch_all(pool)
            .await?;
            rows.iter().map(DeliveryRecord::from_row).collect()
        })
    }

    pub async fn record_delivery(&self, d: &DeliveryRecord) -> Result<(), StoreError> {
        with_pool!(self, conn, PG, write => {
            insert_delivery!(&mut *conn, d).await?;
            Ok(())
        })
    }

    // ---- retention ---------------------------------------------------------------------------

    /// Finished operations with no work left (no delivery or receipt to
    /// retry) whose last change is older than `finished_before`. `uncertain`
    /// ones wait for an operator and are never archived.
    pub async fn archivable(&self, finished_before: i64, limit: i64) -> Result<Vec<Operation>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(if PG { ARCHIVABLE.0 } else { ARCHIVABLE.1 })
            .bind(finished_before)
            .bind(limit)
            .fetch_all(pool)
            .await?;
            rows.iter().map(Operation::from_row).collect()
        })
    }

    /// Moves one operation into `archived_operations` as `document` and
    /// deletes its rows (transitions, deliveries, its inbox entry), in one
    /// transaction, if it is unchanged since it was read.
    pub async fn archive(&self, op: &Operation, document: &str, now: i64) -> Result<bool, StoreError> {
        with_pool!(self, conn, PG, write => {
            let mut tx = conn.begin().await?;
            // The archive row first: from its commit on, a replayed callback
            // finds it, before and after the inbox row is gone.
            let done = sqlx::query(
                "INSERT INTO archived_operations (id, tenant, operation_key, fingerprint, decision_id, state, \
                 finished_at, archived_at, document) \
                 SELECT id, tenant, operation_key, fingerprint, decision_id, state, updated_at, $3, $4 \
                 FROM operations WHERE id = $1 AND version = $2",
            )
            .bind(&op.id)
            .bind(op.version)
            .bind(now)
            .bind(document)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            for table in ["transitions", "deliveries", "pushary_calls"] {
                sqlx::query(AssertSqlSafe(format!("DELETE FROM {table} WHERE operation_id = $1")))
                    .bind(&op.id)
                    .execute(&mut *tx)
                    .await?;
            }
            if let Some(decision) = &op.decision_id {
                sqlx::query("DELETE FROM inbox WHERE tenant = $1 AND correlation_id = $2")
                    .bind(&op.tenant)
                    .bind(decision)
                    .execute(&mut *tx)
                    .await?;
            }
            // Still the version archived: the insert above locked nothing,
            // and a save that took meanwhile must not be deleted unseen
            // (on PostgreSQL no foreign key of its transitions stops it,
            // migration 0009).
            let gone = sqlx::query("DELETE FROM operations WHERE id = $1 AND version = $2")
                .bind(&op.id)
                .bind(op.version)
                .execute(&mut *tx)
                .await?;
            if gone.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            tx.commit().await?;
            Ok(true)
        })
    }

    /// An archived operation's state and document, within the tenant when given.
    pub async fn archived_operation(
        &self,
        tenant: Option<&str>,
        id: &str,
    ) -> Result<Option<(String, String)>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            Ok(sqlx::query_as(
                "SELECT state, document FROM archived_operations WHERE id = $1 AND ($2 IS NULL OR tenant = $2)",
            )
            .bind(id)
            .bind(tenant)
            .fetch_optional(pool)
            .await?)
        })
    }

    /// Callbacks that entered the inbox for one of these archived
    /// decisions (a replay racing its archival on PostgreSQL) are
    /// duplicates: drop them. By key, so the cost does not grow with the inbox.
    pub async fn drop_archived_replays(&self, decisions: &[(String, String)]) -> Result<u64, StoreError> {
        with_pool!(self, conn, PG, write => {
            let mut dropped = 0;
            for (tenant, decision) in decisions {
                dropped += sqlx::query(
                    "DELETE FROM inbox WHERE tenant = $1 AND correlation_id = $2 AND state = 'new' \
                     AND EXISTS (SELECT 1 FROM archived_operations a WHERE a.tenant = $1 AND a.decision_id = $2)",
                )
                .bind(tenant)
                .bind(decision)
                .execute(&mut *conn)
                .await?
                .rows_affected();
            }
            Ok(dropped)
        })
    }

    // ---- inbox ------------------------------------------------------------------------------

    /// Commits one verified callback (the reconciler's polled answers).
    pub async fn insert_inbox(&self, e: &NewInboxEntry<'_>) -> Result<InboxInsert, StoreError> {
        let owned = OwnedInboxEntry {
            tenant: e.tenant.to_string(),
            correlation_id: e.correlation_id.to_string(),
            answer: e.answer.to_string(),
            answered_at: e.answered_at.map(str::to_string),
            body: e.body.to_vec(),
            source: if e.source == "poll" { "poll" } else { "callback" },
            received_at: e.received_at,
        };
        let mut batch = self.insert_inbox_batch(std::slice::from_ref(&owned)).await?;
        // Stored already: a failure here leaves the answer to the poll, as
        // before, and is not the insert's.
        if let Err(e) = self.mark_stored_unmarked(&batch.unmarked).await {
            tracing::warn!(error = %e, "cannot look again for the operation of a stored answer");
        }
        Ok(batch.results.remove(0))
    }

    /// Commits a batch of verified callbacks in one transaction; one
    /// result per entry, in order. The same rules as `insert_inbox`: one
    /// row per (tenant, correlation id), later bodies count as duplicates,
    /// a callback for an archived operation is a replay.
    pub async fn insert_inbox_batch(&self, entries: &[OwnedInboxEntry]) -> Result<BatchInsert, StoreError> {
        self.insert_inbox_batch_with(entries, None).await
    }

    /// `insert_inbox_batch`, which also makes, in the same transaction,
    /// the first save of each answer `first_saves` gives one for
    /// (decisions §36, on SQLite §38): `BatchInsert::applied`.
    pub async fn insert_inbox_batch_with(
        &self,
        entries: &[OwnedInboxEntry],
        first_saves: Option<FirstSaves<'_>>,
    ) -> Result<BatchInsert, StoreError> {
        // The first of several entries for one decision is the one stored.
        let mut first: HashMap<(&str, &str), usize> = HashMap::new();
        let mut unique: Vec<usize> = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            if let std::collections::hash_map::Entry::Vacant(v) =
                first.entry((e.tenant.as_str(), e.correlation_id.as_str()))
            {
                v.insert(i);
                unique.push(i);
            }
        }
        let now = entries.iter().map(|e| e.received_at).max().unwrap_or(0);
        let hashes: Vec<String> =
            unique.iter().map(|&i| crate::domain::keys::sha256_hex(&entries[i].body)).collect();
        // Rows are padded (with NULLs, which the insert skips) to the next
        // power of two, so a handful of texts serve every batch size and each
        // is prepared once per connection, not parsed and planned per batch.
        // A text per size would fill the statement cache; rows in one array
        // or JSON parameter would hide the batch's size from the planner,
        // which then joins a guessed hundred rows to `operations` by
        // scanning it.
        if !self.is_postgres() {
            return self.insert_inbox_batch_sqlite(entries, &first, &unique, &hashes, now, first_saves).await;
        }
        let Backend::Postgres(pool) = &self.backend else { unreachable!("SQLite returned above") };
        let rows = unique.len().next_power_of_two();
        let query = |finding| {
            let mut q = match inbox_insert_text(rows, finding) {
                std::borrow::Cow::Borrowed(text) => sqlx::query(text),
                std::borrow::Cow::Owned(text) => sqlx::query(AssertSqlSafe(text)),
            };
            bind_inbox_rows!(q, entries, unique, &hashes, rows);
            // The mark's time; the lock has none.
            if matches!(finding, Finding::Lock) { q } else { q.bind(now) }
        };
        let mut conn = pool.acquire().await?;
        // A repeat failed the plain statement already: the conflict clause.
        let mut repeats = false;
        if let Some(first_saves) = first_saves {
            // The answers' first saves commit with their callbacks
            // (decisions §36); a batch that cannot (a repeat, a save
            // PostgreSQL refused) is stored as below, its answers handed on.
            // Once more on a connection that lacked the save function.
            for _ in 0..2 {
                let mut tx = conn.begin().await?;
                match query(Finding::Lock).fetch_all(&mut *tx).await {
                    Ok(rows) => {
                        match self.commit_applying(tx, &rows, entries, &first, first_saves, now).await? {
                            super::inbox_apply::Applying::Done(done) => return Ok(done),
                            super::inbox_apply::Applying::Again { make_function: true } => {
                                super::save::make_function(&mut conn).await?;
                            }
                            super::inbox_apply::Applying::Again { make_function: false } => break,
                        }
                    }
                    Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                        tx.rollback().await?;
                        repeats = true;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        // The insert is a statement of its own; the repeats (rare) get a
        // transaction after it. It is tried first without the conflict
        // clause: `ON CONFLICT` makes every row a speculative insertion (a
        // look in the unique index before the insert, and a record
        // confirming it after), which cost the machine about a seventh
        // more CPU per stored row in pgbench (decisions §30). A repeat of
        // a stored callback (Pushary sends again only what was not
        // acknowledged) fails the statement, which then runs with it.
        let stored_rows = match query(Finding::Mark { plain: !repeats }).fetch_all(&mut *conn).await {
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() && !repeats => {
                query(Finding::Mark { plain: false }).fetch_all(&mut *conn).await?
            }
            r => r?,
        };
        let StoredRows { stored, mut threads, mut unmarked, pending } =
            read_stored_rows(&stored_rows, &first, entries.len())?;
        let mut done = match stored.iter().copied().collect::<Option<Vec<i64>>>() {
            Some(ids) => {
                let answers = handed_answers(&stored_rows, &pending, &threads, entries, &first);
                let mut done = self.batch_done(ids.into_iter().map(InboxInsert::Stored).collect(), threads);
                done.answers = answers;
                done
            }
            None => {
                let mut tx = conn.begin().await?;
                let results = inbox_repeats!(tx, entries, stored, now, threads);
                tx.commit().await?;
                // A repeat may have revived an orphan by a snapshot older
                // than its operation's decision id: looked at again too.
                unmarked.extend(results.iter().filter_map(|r| match r {
                    InboxInsert::Duplicate(id) => Some(*id),
                    _ => None,
                }));
                self.batch_done(results, threads)
            }
        };
        done.unmarked = unmarked;
        Ok(done)
    }

    /// Marks the operations that the inbox rows `ids`, stored before and
    /// then marking none, answer after all, and returns their threads.
    /// PostgreSQL only: a row's statement marks by the snapshot it began
    /// with, and may have begun before the save that records its
    /// operation's decision id committed, while that save's own look for
    /// a waiting answer began before the row committed (see
    /// `mark_early_answer`). Begun after the row's commit, this one sees
    /// every decision id committed before it. Nearly always it finds
    /// nothing: a callback for a decision no operation has opened. It may
    /// mark an operation whose answer a worker applied meanwhile (its
    /// inbox row is read by its snapshot); such a stale mark wakes a worker
    /// once, which finds no answer waiting and clears it.
    pub async fn mark_stored_unmarked(&self, ids: &[i64]) -> Result<Vec<(String, String)>, StoreError> {
        let Backend::Postgres(pool) = &self.backend else { return Ok(Vec::new()) };
        let mut threads = Vec::new();
        // Chunks of a batch's size keep the plan the nested loop below:
        // with thousands of ids the planner hashes a scan of `operations`.
        for ids in ids.chunks(super::MAX_BATCH) {
            Self::mark_stored_unmarked_chunk(pool, ids, &mut threads).await?;
        }
        Ok(self.batch_done(Vec::new(), threads).threads)
    }

    async fn mark_stored_unmarked_chunk(
        pool: &PgPool,
        ids: &[i64],
        threads: &mut Vec<(String, String)>,
    ) -> Result<(), StoreError> {
        let rows = sqlx::query(MARK_STORED_UNMARKED).bind(ids).fetch_all(pool).await?;
        for r in &rows {
            threads.push((r.try_get("tenant")?, r.try_get("thread_id")?));
        }
        Ok(())
    }

    /// A committed batch: other replicas are told when operations now
    /// have an answer waiting.
    pub(super) fn batch_done(
        &self,
        results: Vec<InboxInsert>,
        mut threads: Vec<(String, String)>,
    ) -> BatchInsert {
        threads.sort_unstable();
        threads.dedup();
        if !threads.is_empty() {
            self.signal_work();
        }
        BatchInsert { results, threads, unmarked: Vec::new(), answers: Vec::new(), applied: Vec::new() }
    }

    pub async fn list_inbox(&self, state: Option<&str>, limit: i64) -> Result<Vec<InboxEntry>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(concat!(
                "SELECT ",
                inbox_cols!(),
                " FROM inbox WHERE ($1 IS NULL OR state = $1) ORDER BY id DESC LIMIT $2"
            ))
            .bind(state)
            .bind(if limit > 0 { limit } else { 100 })
            .fetch_all(pool)
            .await?;
            rows.iter().map(InboxEntry::from_row).collect()
        })
    }

    pub async fn inbox_by_correlation(
        &self,
        tenant: &str,
        correlation_id: &str,
    ) -> Result<Option<InboxEntry>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let row = sqlx::query(concat!(
                "SELECT ",
                inbox_cols!(),
                " FROM inbox WHERE tenant = $1 AND correlation_id = $2"
            ))
            .bind(tenant)
            .bind(correlation_id)
            .fetch_optional(pool)
            .await?;
            row.as_ref().map(InboxEntry::from_row).transpose()
        })
    }

    pub async fn inbox_entry(&self, id: i64) -> Result<Option<(InboxEntry, Vec<u8>)>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let row = sqlx::query(concat!("SELECT ", inbox_cols!(), ", body FROM inbox WHERE id = $1"))
                .bind(id)
                .fetch_optional(pool)
                .await?;
            match row {
                None => Ok(None),
                Some(r) => Ok(Some((InboxEntry::from_row(&r)?, r.try_get("body")?))),
            }
        })
    }

    /// Marks callbacks that matched no operation for too long. They stay
    /// in the inbox, visible; nothing is deleted.
    pub async fn orphan_unmatched(&self, received_before: i64, now: i64) -> Result<u64, StoreError> {
        with_pool!(self, conn, PG, write => {
            let done = sqlx::query(
                "UPDATE inbox SET state = 'orphaned', processed_at = $2, \
                 note = 'no operation matched this decision in time' \
                 WHERE state = 'new' AND received_at <= $1 AND NOT EXISTS (SELECT 1 FROM operations o \
                   WHERE o.tenant = inbox.tenant AND o.decision_id = inbox.correlation_id)",
            )
            .bind(received_before)
            .bind(now)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected())
        })
    }

    /// After an open is committed: an answer that came before its
    /// operation knew the decision id goes to work. It may have been
    /// marked orphaned, or (PostgreSQL) stored while the open was being
    /// saved: the callback's statement did not see the id, not committed
    /// yet, and the save's did not see the callback, not committed when
    /// it began, so neither marked the answer as waiting, and it waited
    /// for the reconciler's poll. This statement begins after the open's
    /// commit, so it sees any callback committed before that; one
    /// committed later is marked by its receiver, which looks again after
    /// its own commit (`mark_stored_unmarked`). Called after every open.
    pub async fn mark_early_answer(&self, tenant: &str, correlation_id: &str) -> Result<(), StoreError> {
        macro_rules! revive {
            () => {
                "UPDATE inbox SET state = 'new', note = 'revived: its operation now knows the decision id' \
                 WHERE tenant = $1 AND correlation_id = $2 AND state = 'orphaned'"
            };
        }
        if let Backend::Postgres(pool) = &self.backend {
            // One round trip. Sub-statements share a snapshot, so the
            // revived row is read from `r`, not from the inbox.
            sqlx::query(concat!(
                "WITH r AS (",
                revive!(),
                " RETURNING received_at), w AS (SELECT received_at FROM r UNION ALL \
                   SELECT i.received_at FROM inbox i WHERE i.tenant = $1 AND i.correlation_id = $2 \
                   AND i.state = 'new' LIMIT 1) \
                 UPDATE operations SET inbox_at = w.received_at FROM w \
                 WHERE tenant = $1 AND decision_id = $2 AND inbox_at IS NULL"
            ))
            .bind(tenant)
            .bind(correlation_id)
            .execute(pool)
            .await?;
            return Ok(());
        }
        // SQLite: the open's save and every callback's insert take turns
        // on one writer, and the later of the two sees the other, so only
        // a revived orphan needs its mark.
        with_pool!(self, conn, PG, write => {
            let revived = sqlx::query(revive!()).bind(tenant).bind(correlation_id).execute(&mut *conn).await?;
            if revived.rows_affected() == 0 {
                return Ok(());
            }
            sqlx::query(
                "UPDATE operations SET inbox_at = (SELECT i.received_at FROM inbox i \
                   WHERE i.tenant = $1 AND i.correlation_id = $2 AND i.state = 'new') \
                 WHERE tenant = $1 AND decision_id = $2 AND inbox_at IS NULL",
            )
            .bind(tenant)
            .bind(correlation_id)
            .execute(&mut *conn)
            .await?;
            Ok(())
        })
    }

    // ---- webhook secret rotation ------------------------------------------------------------

    /// Rotated-in secrets and retirements for a tenant: (secret, valid_until).
    pub async fn webhook_secrets(&self, tenant: &str) -> Result<Vec<(String, Option<i64>)>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query("SELECT secret, valid_until FROM webhook_secrets WHERE tenant = $1")
                .bind(tenant)
                .fetch_all(pool)
                .await?;
            rows.iter().map(|r| Ok((r.try_get("secret")?, r.try_get("valid_until")?))).collect()
        })
    }

    /// Stores `new` as a current secret and retires every other known one
    /// (`others`, e.g. from the config file, and earlier rotations) at `until`.
    pub async fn rotate_webhook_secret(
        &self,
        tenant: &str,
        new: &str,
        others: &[String],
        now: i64,
        until: i64,
    ) -> Result<(), StoreError> {
        with_pool!(self, conn, PG, write => {
            let mut tx = conn.begin().await?;
            sqlx::query(
                "UPDATE webhook_secrets SET valid_until = $3 WHERE tenant = $1 AND secret <> $2 \
                 AND (valid_until IS NULL OR valid_until > $3)",
            )
            .bind(tenant)
            .bind(new)
            .bind(until)
            .execute(&mut *tx)
            .await?;
            for other in others.iter().filter(|o| o.as_str() != new) {
                sqlx::query(
                    "INSERT INTO webhook_secrets (tenant, secret, created_at, valid_until) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (tenant, secret) DO NOTHING",
                )
                .bind(tenant)
                .bind(other)
                .bind(now)
                .bind(until)
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query(
                "INSERT INTO webhook_secrets (tenant, secret, created_at, valid_until) VALUES ($1, $2, $3, NULL) \
                 ON CONFLICT (tenant, secret) DO UPDATE SET valid_until = NULL",
            )
            .bind(tenant)
            .bind(new)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    // ---- work selection and leases -----------------------------------------------------------

    /// Threads with something to do now: a matched inbox entry, or an
    /// operation whose `due_at` has come. Leased threads are skipped. At
    /// most `limit` threads, and whether the read was cut short: either
    /// kind of work filled its `limit` rows, which a thread with many
    /// operations can do alone, so others may wait unread.
    pub async fn threads_with_work(
        &self,
        now: i64,
        limit: i64,
    ) -> Result<(Vec<(String, String)>, bool), StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            // Each kind of work is read in its index's order and stops after
            // `limit` free threads, so the cost does not grow with the backlog.
            // Each kind's rows stop at `cap`.
            let (rows, cap) = if PG {
                // A literal LIMIT, rounded up so that a few texts serve every
                // limit: with a parameter the generic plan is costed for a
                // tenth of the rows, so PostgreSQL judged it dearer than a
                // fresh plan and planned the statement on every call
                // (`pg_stat_statements` under `approvald bench`: 2,438 plans
                // in 2,527 calls, 0.39 ms of planning each).
                // Each text is built once, as the inbox's batch texts are.
                static TEXTS: BatchTexts = [const { std::sync::OnceLock::new() }; _];
                let rounded = usize::try_from(limit.max(16)).unwrap_or(16).next_power_of_two();
                let q = match batch_text(&TEXTS, rounded, |n| threads_with_work_text(&n.to_string())) {
                    std::borrow::Cow::Borrowed(text) => sqlx::query(text),
                    std::borrow::Cow::Owned(text) => sqlx::query(AssertSqlSafe(text)),
                };
                (q.bind(now).fetch_all(pool).await?, i64::try_from(rounded).unwrap_or(i64::MAX))
            } else {
                // `LIMIT $2 + 0`, not `LIMIT $2`: SQLite (3.51) plans with the
                // value bound to a bare LIMIT parameter and so expires the
                // statement whenever it is bound again, which re-prepared this
                // one on every call (a uprobe on `sqlite3Reprepare` under
                // `approvald bench`: 1,233 times in a run of 1,000 approvals).
                static TEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| threads_with_work_text("$2 + 0"));
                (sqlx::query(AssertSqlSafe(TEXT.as_str())).bind(now).bind(limit).fetch_all(pool).await?, limit)
            };
            let mut threads: Vec<(String, String)> = Vec::new();
            let mut per_kind = [0_i64; 2];
            for r in &rows {
                let key: (String, String) = (r.try_get("tenant")?, r.try_get("thread_id")?);
                if let Some(n) = per_kind.get_mut(usize::try_from(r.try_get::<i32, _>("k")?).unwrap_or(0)) {
                    *n += 1;
                }
                if !threads.contains(&key) {
                    threads.push(key);
                }
            }
            let cut_short =
                threads.len() > usize::try_from(limit).unwrap_or(16) || per_kind.iter().any(|&n| n >= cap);
            threads.truncate(usize::try_from(limit).unwrap_or(16));
            Ok((threads, cut_short))
        })
    }

    /// Takes the thread if it is free or its lease has run out.
    pub async fn acquire_lease(
        &self,
        tenant: &str,
        thread_id: &str,
        owner: &str,
        now: i64,
        until: i64,
    ) -> Result<bool, StoreError> {
        with_pool!(self, conn, PG, write => {
            let got: Option<String> = sqlx::query_scalar(
                "INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ($1, $2, $3, $5) \
                 ON CONFLICT (tenant, thread_id) DO UPDATE SET owner = excluded.owner, until = excluded.until \
                 WHERE thread_leases.until <= $4 OR thread_leases.owner = excluded.owner \
                 RETURNING owner",
            )
            .bind(tenant)
            .bind(thread_id)
            .bind(owner)
            .bind(now)
            .bind(until)
            .fetch_optional(&mut *conn)
            .await?;
            Ok(got.as_deref() == Some(owner))
        })
    }

    /// Extends a lease we hold; false means it was lost to another worker.
    pub async fn renew_lease(
        &self,
        tenant: &str,
        thread_id: &str,
        owner: &str,
        until: i64,
    ) -> Result<bool, StoreError> {
        with_pool!(self, conn, PG, write => {
            let done = sqlx::query(
                "UPDATE thread_leases SET until = $4 WHERE tenant = $1 AND thread_id = $2 AND owner = $3",
            )
            .bind(tenant)
            .bind(thread_id)
            .bind(owner)
            .bind(until)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    pub async fn release_lease(&self, tenant: &str, thread_id: &str, owner: &str) -> Result<(), StoreError> {
        with_pool!(self, conn, PG, write => {
            sqlx::query("DELETE FROM thread_leases WHERE tenant = $1 AND thread_id = $2 AND owner = $3")
                .bind(tenant)
                .bind(thread_id)
                .bind(owner)
                .execute(&mut *conn)
                .await?;
            Ok(())
        })
    }

    /// SQLite serves one node, so at start no other process can hold a
    /// lease: whatever is there was left by a process that died.
    pub async fn release_all_leases(&self) -> Result<u64, StoreError> {
        with_pool!(self, conn, PG, write => {
            Ok(sqlx::query("DELETE FROM thread_leases").execute(&mut *conn).await?.rows_affected())
        })
    }

    /// What a worker holding the thread does next: its oldest unprocessed
    /// inbox entry that matches an operation, else its earliest due step.
    ///
    /// One read of the thread's operations finds both kinds, so a held
    /// thread with no answer waiting (each save leaves the next step due,
    /// so this is most visits) costs one round trip, not two. Whether an
    /// answer is held back is read with its entry: answers of a thread
    /// resume in arrival order, so one waits while an earlier answer still
    /// has resume work.
    pub async fn next_work_for_thread(
        &self,
        tenant: &str,
        thread_id: &str,
        now: i64,
    ) -> Result<Option<ThreadWork>, StoreError> {
        Ok(self.thread_work(tenant, thread_id, now, Visit::Read).await?.0)
    }

    /// `next_work_for_thread` for the worker holding the thread's lease
    /// as `owner`, which it gives up in the same statement when nothing is
    /// due now (PostgreSQL; SQLite has no lease rows, §14): the last read
    /// of every visit and the release were two round trips. Returns
    /// whether nothing was due now, so that the lease, if `owner` held it,
    /// was given up. A callback committed after the read's snapshot finds
    /// the lease still held and its worker passes the thread by; the
    /// holder's claim hears of it and has the thread looked at again when
    /// it lets go (`src/worker/claims.rs`, decisions §33).
    pub async fn next_work_or_release(
        &self,
        tenant: &str,
        thread_id: &str,
        now: i64,
        owner: &str,
    ) -> Result<(Option<ThreadWork>, bool), StoreError> {
        self.thread_work(tenant, thread_id, now, Visit::Release { owner }).await
    }

    /// Takes the thread's lease as `owner` until `until` (if it is free or
    /// run out) and reads its work, in one round trip (PostgreSQL; a
    /// worker on SQLite takes no lease rows, §14): None if another holds
    /// it. The read sees every commit made before the lease was taken,
    /// the last holder's saves with them: it is a statement of its own
    /// inside a function (`pg_temp.approvald_take_thread`), which takes
    /// its snapshot after the lease's insert, where one statement's parts
    /// would all read the snapshot taken before it waited for a release.
    pub async fn take_thread(
        &self,
        tenant: &str,
        thread_id: &str,
        owner: &str,
        now: i64,
        until: i64,
    ) -> Result<Option<Option<ThreadWork>>, StoreError> {
        let (work, taken) = self.thread_work(tenant, thread_id, now, Visit::Take { owner, until }).await?;
        Ok(taken.then_some(work))
    }

    /// Reads a thread's work (`visit`); the flag is whether the lease was
    /// given up (`Visit::Release`) or taken (`Visit::Take`).
    async fn thread_work(
        &self,
        tenant: &str,
        thread_id: &str,
        now: i64,
        visit: Visit<'_>,
    ) -> Result<(Option<ThreadWork>, bool), StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            // Two arms, each read through its per-thread index (migration
            // 0005). One WHERE with an OR let PostgreSQL's planner serve the
            // answer arm from the global `inbox_at` index, whose statistics
            // lag behind thousands of answers queued a second: it read every
            // waiting answer of every thread on every turn (3,001 rows,
            // 0.78 ms, against 0.03 ms; `approvald bench`'s growth run fell
            // to 45%). No ORDER BY … LIMIT either, which would tempt it down
            // the global due_at index; a thread's live operations are few.
            // An operation's waiting answer is looked up by its unique key,
            // never joined by a plan that depends on statistics (they lag
            // behind an inbox that grows by thousands a second, and a stale
            // plan scans it): on PostgreSQL a LATERAL subquery with a LIMIT,
            // which runs per operation through the key's index, so the
            // answer comes with its operation in one round trip; SQLite
            // reads in process and looks each one up below. The subquery
            // names no state: with `state = 'new'` in it PostgreSQL may
            // serve it from the partial `inbox_new_received` index, which
            // the last VACUUM saw empty, walking every waiting callback
            // with a filter (2,998 rows, 0.48 ms, against 0.03 ms by the
            // unique key). The key is unique, so the state is checked on
            // the one row, in the join (a LIMIT keeps it out of the scan).
            // The due arm reads every step of the thread with a due time,
            // later ones too, and keeps those due by `now` below: with
            // `due_at <= $3` in the text, PostgreSQL's generic plan guessed
            // a third of the thread's rows for the range, so on a store with
            // a million finished rows its plan cache judged the generic plan
            // dearer than a fresh one and planned every call anew (0.73 ms
            // of planning per read, two reads per approval; `approvald
            // bench` growth 66%). Without it the two plans cost the same and
            // the cached one is kept.
            macro_rules! pg_thread_work {
                () => {
                    concat!(
                        "SELECT ",
                        op_cols!(),
                        ", 1 AS answer_waits, i.* FROM operations o LEFT JOIN LATERAL (SELECT ",
                        inbox_cols_as_i!(),
                        ", ",
                        held_back!("$2"),
                        " AS i_held_back FROM inbox WHERE inbox.tenant = o.tenant \
                           AND inbox.correlation_id = o.decision_id LIMIT 1) i ON i.i_state = 'new' \
                         WHERE o.tenant = $1 AND o.thread_id = $2 AND o.inbox_at IS NOT NULL \
                           AND o.decision_id IS NOT NULL \
                         UNION ALL SELECT ",
                        op_cols!(),
                        ", 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL \
                         FROM operations WHERE tenant = $1 AND thread_id = $2 AND due_at IS NOT NULL \
                           AND (inbox_at IS NULL OR decision_id IS NULL)"
                    )
                };
            }
            // The lease goes when no row is work now (see `flag` below),
            // committed without waiting for the WAL (`commit_without_flush!`).
            let sql = if PG && matches!(visit, Visit::Take { .. }) {
                take_thread_text()
            } else if PG && matches!(visit, Visit::Release { .. }) {
                concat!(
                    "WITH w AS (",
                    pg_thread_work!(),
                    "), r AS (DELETE FROM thread_leases WHERE tenant = $1 AND thread_id = $2 AND owner = $4 \
                       AND NOT EXISTS (SELECT 1 FROM w WHERE w.answer_waits = 1 OR w.due_at <= $3) \
                       AND ",
                    commit_without_flush!(),
                    " IS NOT NULL) \
                     SELECT * FROM w"
                )
            } else if PG {
                pg_thread_work!()
            } else {
                concat!(
                    "SELECT ",
                    op_cols!(),
                    ", 1 AS answer_waits FROM operations WHERE tenant = $1 AND thread_id = $2 \
                       AND inbox_at IS NOT NULL AND decision_id IS NOT NULL \
                     UNION ALL SELECT ",
                    op_cols!(),
                    ", 0 FROM operations WHERE tenant = $1 AND thread_id = $2 AND due_at IS NOT NULL \
                       AND (inbox_at IS NULL OR decision_id IS NULL)"
                )
            };
            let query = || sqlx::query(sql).bind(tenant).bind(thread_id);
            let mut rows = match visit {
                Visit::Release { owner } if PG => query().bind(now).bind(owner).fetch_all(pool).await?,
                Visit::Take { owner, until } if PG => {
                    let take = || query().bind(owner).bind(now).bind(until);
                    let mut conn = pool.acquire().await?;
                    match take().fetch_all(&mut *conn).await {
                        Err(sqlx::Error::Database(e)) if is_missing_temp_function(e.as_ref()) => {
                            sqlx::raw_sql(sqlx::AssertSqlSafe(take_thread_setup())).execute(&mut *conn).await?;
                            take().fetch_all(&mut *conn).await?
                        }
                        other => other?,
                    }
                }
                _ => query().fetch_all(pool).await?,
            };
            // The function's first row says the lease was taken.
            let taken = PG && rows.first().is_some_and(|row| row.try_get::<i32, _>("answer_waits").is_ok_and(|a| a < 0));
            if taken {
                rows.remove(0);
            }
            let mut first: Option<(InboxEntry, Operation, bool)> = None;
            let mut decisions = Vec::new();
            let mut due: Option<Operation> = None;
            let mut later: Option<i64> = None;
            for row in &rows {
                let op = Operation::from_row(row)?;
                if let Some(at) = op.due_at.filter(|&at| at > now) {
                    later = Some(later.map_or(at, |l| l.min(at)));
                }
                if op.due_at.is_some_and(|at| at <= now)
                    && due.as_ref().is_none_or(|d| (op.due_at, op.created_at) < (d.due_at, d.created_at))
                {
                    due = Some(op.clone());
                }
                if row.try_get::<i32, _>("answer_waits")? == 0 {
                    continue;
                }
                let decision = op.decision_id.clone().unwrap_or_default();
                let found = if PG {
                    match row.try_get::<Option<i64>, _>("i_id")? {
                        Some(_) => Some((InboxEntry::from_row_prefixed(row, "i_")?, row.try_get("i_held_back")?)),
                        None => None,
                    }
                } else {
                    let row = sqlx::query(concat!(
                        "SELECT ",
                        inbox_cols!(),
                        ", ",
                        held_back!("$3"),
                        " AS held_back FROM inbox WHERE tenant = $1 AND correlation_id = $2 AND state = 'new'"
                    ))
                    .bind(tenant)
                    .bind(&decision)
                    .bind(thread_id)
                    .fetch_optional(pool)
                    .await?;
                    match row {
                        Some(row) => Some((InboxEntry::from_row(&row)?, row.try_get("held_back")?)),
                        None => None,
                    }
                };
                decisions.push(decision);
                if let Some((entry, held_back)) = found
                    && first.as_ref().is_none_or(|(e, _, _)| entry.id < e.id)
                {
                    first = Some((entry, op, held_back));
                }
            }
            // Taken, or (the release's read) given up: the DELETE's
            // condition, no answer waiting and nothing due now, is what
            // this loop found in the same rows.
            let flag = match visit {
                Visit::Take { .. } => taken,
                Visit::Release { .. } => PG && decisions.is_empty() && due.is_none(),
                Visit::Read => false,
            };
            if let Some((entry, op, held_back)) = first {
                return Ok((Some(ThreadWork::Answer(Box::new(entry), op, held_back)), flag));
            }
            if !decisions.is_empty() {
                // Marked, yet nothing waits: never expected, but a stale
                // mark would make workers take this thread forever.
                self.clear_stale_inbox_marks(tenant, &decisions).await?;
            }
            Ok((due.map(ThreadWork::Due).or(later.map(ThreadWork::Later)), flag))
        })
    }

    async fn clear_stale_inbox_marks(&self, tenant: &str, decisions: &[String]) -> Result<(), StoreError> {
        with_pool!(self, conn, PG, write => {
            for decision in decisions {
                sqlx::query(
                    "UPDATE operations SET inbox_at = NULL WHERE tenant = $1 AND decision_id = $2 \
                     AND NOT EXISTS (SELECT 1 FROM inbox i WHERE i.tenant = $1 AND i.correlation_id = $2 \
                       AND i.state = 'new')",
                )
                .bind(tenant)
                .bind(decision)
                .execute(&mut *conn)
                .await?;
            }
            Ok(())
        })
    }

    /// When the earliest scheduled step is due, whether or not its time has come.
    pub async fn next_due_at(&self) -> Result<Option<i64>, StoreError> {
        self.next_due_after(i64::MIN).await
    }

    /// When the earliest step scheduled after `now` is due, so the idle
    /// tick keeper sleeps until then. Steps due already are being worked
    /// (their holder goes on with them) or wait for a worker already told
    /// of them; counting them made the keeper wake every millisecond while
    /// any approval was in flight, and read the store each time.
    pub async fn next_due_after(&self, now: i64) -> Result<Option<i64>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            Ok(sqlx::query_scalar("SELECT MIN(due_at) FROM operations WHERE due_at > $1")
                .bind(now)
                .fetch_one(pool)
                .await?)
        })
    }

    /// Marks an inbox entry that changes nothing (its operation moved on).
    pub async fn settle_inbox(
        &self,
        id: i64,
        state: &str,
        note: &str,
        operation_id: Option<&str>,
        at: i64,
    ) -> Result<(), StoreError> {
        with_pool!(self, conn, PG, write => {
            sqlx::query(
                "UPDATE inbox SET state = $1, note = $2, operation_id = $3, processed_at = $4 WHERE id = $5",
            )
            .bind(state)
            .bind(note)
            .bind(operation_id)
            .bind(at)
            .bind(id)
            .execute(&mut *conn)
            .await?;
            if let Some(op) = operation_id {
                sqlx::query("UPDATE operations SET inbox_at = NULL WHERE id = $1").bind(op).execute(&mut *conn).await?;
            }
            Ok(())
        })
    }

    // ---- reconciler -------------------------------------------------------------------------

    pub async fn pending_past_deadline(&self, now: i64, limit: i64) -> Result<Vec<Operation>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(if PG { PENDING_PAST_DEADLINE.0 } else { PENDING_PAST_DEADLINE.1 })
            .bind(now)
            .bind(limit)
            .fetch_all(pool)
            .await?;
            rows.iter().map(Operation::from_row).collect()
        })
    }

    pub async fn polls_due(&self, now: i64, limit: i64) -> Result<Vec<Operation>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query(if PG { POLLS_DUE.0 } else { POLLS_DUE.1 })
            .bind(now)
            .bind(limit)
            .fetch_all(pool)
            .await?;
            rows.iter().map(Operation::from_row).collect()
        })
    }

    /// Counts for a summary: operations by state.
    pub async fn count_by_state(&self) -> Result<Vec<(String, i64)>, StoreError> {
        with_pool!(self, pool, BEGIN, PG => {
            let rows = sqlx::query("SELECT state, COUNT(*) AS n FROM operations GROUP BY state ORDER BY state")
                .fetch_all(pool)
                .await?;
            rows.iter().map(|r| Ok((r.try_get("state")?, r.try_get("n")?))).collect()
        })
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::{Backend, SqlitePool, Store};
    use crate::config::StoreConfig;

    /// A fresh, migrated database on `APPROVALD_TEST_PG_URL`'s server,
    /// dropped by `drop`; None (said loudly for `test`) without the variable.
    pub(crate) struct ScratchPg {
        pub(crate) store: Store,
        admin: String,
        name: String,
    }

    impl ScratchPg {
        pub(crate) async fn create(test: &str) -> Option<Self> {
            use sqlx::Connection as _;
            let admin = pg_test_url(test)?;
            let name = format!("approvald_unit_{:016x}", rand::random::<u64>());
            let mut c = sqlx::PgConnection::connect(&admin).await.expect("connects to the server");
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&mut c)
                .await
                .expect("creates");
            let url = match admin.rsplit_once('/') {
                Some((server, _)) => format!("{server}/{name}"),
                None => unreachable!("a PostgreSQL URL names a database"),
            };
            let store = Store::connect(&StoreConfig::with_defaults(url, 4)).await.expect("opens");
            store.migrate().await.expect("migrates");
            Some(Self { store, admin, name })
        }

        pub(crate) async fn drop(self) {
            use sqlx::Connection as _;
            if let Some(pool) = self.store.pg_pool() {
                pool.close().await;
            }
            let mut c = sqlx::PgConnection::connect(&self.admin).await.expect("connects to the server");
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)))
                .execute(&mut c)
                .await
                .expect("drops");
        }
    }

    /// `APPROVALD_TEST_PG_URL`, the server PostgreSQL tests run on; None,
    /// said loudly for `test`, when it is not set.
    pub(crate) fn pg_test_url(test: &str) -> Option<String> {
        let url = std::env::var("APPROVALD_TEST_PG_URL").ok().filter(|u| !u.is_empty());
        if url.is_none() {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test} on PostgreSQL: APPROVALD_TEST_PG_URL is not set (.ci/run sets it)"
            );
        }
        url
    }

    /// A migrated SQLite store in a temporary directory, and its pool.
    pub(crate) async fn sqlite_store() -> (tempfile::TempDir, Store, SqlitePool) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let config = StoreConfig::with_defaults(format!("sqlite://{}", dir.path().join("s.db").display()), 2);
        let store = Store::connect(&config).await.expect("opens");
        store.migrate().await.expect("migrates");
        let Backend::Sqlite(pool) = store.backend.clone() else { unreachable!("a SQLite URL") };
        (dir, store, pool)
    }

    /// A pending operation `id` on `thread` (tenant `t`), waiting for the
    /// answer to `decision` when it has one.
    pub(crate) async fn insert_operation(pool: &SqlitePool, id: &str, thread: &str, decision: Option<&str>) {
        sqlx::query(
            "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
             decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, created_at, \
             updated_at) VALUES ($1, 't', $1, 'f', $2, 'i', 'e', 'confirm', '{}', '{}', 'pending', $3, $1, 9, 1, 1)",
        )
        .bind(id)
        .bind(thread)
        .bind(decision)
        .execute(pool)
        .await
        .expect("inserts");
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::sqlite_store;

    #[test]
    fn an_inbox_batch_is_tried_without_the_conflict_clause_and_retried_with_it() {
        for rows in [1, 4, 256] {
            let (plain, retry) = (
                super::inbox_insert_text(rows, super::Finding::Mark { plain: true }),
                super::inbox_insert_text(rows, super::Finding::Mark { plain: false }),
            );
            assert!(!plain.contains("ON CONFLICT"), "{plain}");
            assert!(plain.contains("v.correlation_id) RETURNING id, tenant, correlation_id"), "{plain}");
            assert!(
                retry.contains("ON CONFLICT (tenant, correlation_id) DO NOTHING RETURNING id"),
                "{retry}"
            );
        }
    }

    // On PostgreSQL the inbox's statement hands on each answer stored for
    // a pending operation with the operation as marked (decisions §35):
    // not an answer for an operation already answered, nor one for a
    // decision no operation has, nor one of two for one thread, whose
    // order the worker's read of the thread decides.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_inbox_hands_on_each_threads_one_answer_with_its_operation() {
        let Some(db) = super::test_support::ScratchPg::create("the_inbox_hands_on_answers").await else {
            return;
        };
        let pool = db.store.pg_pool().expect("a PostgreSQL store").clone();
        let body = serde_json::json!({"operationKey": "k", "threadId": "x", "interruptId": "i", "effect": "orders",
            "externalId": "u", "question": "Proceed?", "toolName": "ship", "parameters": {}});
        let limits = crate::domain::operation::Limits { max_expires_in_secs: 3600 };
        let spec = crate::domain::operation::parse(&body, limits, 0).expect("a valid body");
        let spec = serde_json::to_string(&spec).expect("serializes");
        for (id, thread, state) in [
            ("p1", "t1", "pending"),
            ("p2", "t2", "pending"),
            ("p3", "t2", "pending"),
            ("p4", "t4", "answered"),
        ] {
            sqlx::query(
                "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
                 decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, \
                 created_at, updated_at) \
                 VALUES ($1, 't', $1, 'f', $2, 'i', 'e', 'confirm', $4, '{}', $3, 'dec-' || $1, $1, 9, 1, 1)",
            )
            .bind(id)
            .bind(thread)
            .bind(state)
            .bind(&spec)
            .execute(&pool)
            .await
            .expect("inserts");
        }
        let entry = |decision: &str| crate::store::OwnedInboxEntry {
            tenant: "t".into(),
            correlation_id: decision.into(),
            answer: "yes".into(),
            answered_at: None,
            body: decision.as_bytes().to_vec(),
            source: "callback",
            received_at: 7,
        };
        let entries: Vec<_> = ["dec-p1", "dec-p2", "dec-p3", "dec-p4", "dec-none"].map(entry).into();
        let batch = db.store.insert_inbox_batch(&entries).await.expect("stores");
        let threads: Vec<&str> = batch.threads.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(threads, ["t1", "t2", "t4"]);
        assert_eq!(batch.answers.len(), 1, "{:?}", batch.answers);
        let (handed, op) = &batch.answers[0];
        let stored = match batch.results[0] {
            crate::store::InboxInsert::Stored(id) => id,
            ref other => panic!("stored, not {other:?}"),
        };
        assert_eq!(
            (handed.id, handed.correlation_id.as_str(), handed.state.as_str()),
            (stored, "dec-p1", "new")
        );
        assert_eq!(
            (op.id.as_str(), op.thread_id.as_str(), op.version),
            ("p1", "t1", 0),
            "the operation as marked"
        );
        db.drop().await;
    }

    // Each sweep reads the range of its own index, in its order: no scan of
    // every operation of a state, and no sort; the operator's chart of
    // finished operations reads the range of its index (decisions §37).
    #[tokio::test]
    async fn the_reconcilers_sweeps_read_their_own_index_on_sqlite() {
        let (_dir, _store, pool) = sqlite_store().await;
        let search = |index: &str| format!("SEARCH operations USING INDEX {index}");
        for (sql, plan_wanted) in [
            (super::PENDING_PAST_DEADLINE.1, vec![search("operations_pending_deadline (deadline<?)")]),
            (super::POLLS_DUE.1, vec![search("operations_poll (poll_at<?)")]),
            (super::ARCHIVABLE.1, vec![search("operations_finished (updated_at<?)")]),
            // The operator page's chart: the minutes and states counted.
            (
                crate::store::insights::FINISHED_BY_MINUTE.1,
                vec![search("operations_finished (updated_at>?)"), "USE TEMP B-TREE FOR GROUP BY".into()],
            ),
        ] {
            let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                .bind(1_i64)
                .bind(100_i64)
                .fetch_all(&pool)
                .await
                .expect("explains");
            let plan: Vec<String> = rows.iter().map(|r| sqlx::Row::get(r, "detail")).collect();
            assert_eq!(plan, plan_wanted, "{sql}");
        }
    }

    #[tokio::test]
    async fn every_sqlite_connection_caches_what_the_config_says() {
        let (_dir, _store, pool) = sqlite_store().await;
        // Both of the pool's connections, not only the first one handed out.
        let (mut a, mut b) = (pool.acquire().await.expect("a"), pool.acquire().await.expect("b"));
        for conn in [&mut a, &mut b] {
            let kib: i64 =
                sqlx::query_scalar("PRAGMA cache_size").fetch_one(&mut **conn).await.expect("reads");
            assert_eq!(kib, -1024, "a negative cache_size is KiB");
        }
    }
}
