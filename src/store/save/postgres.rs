//! The save on PostgreSQL: batched, one statement per batch.
//!
//! `approvald bench` found PostgreSQL's end-to-end figure bound by the
//! machine's CPU, most of it PostgreSQL's, and most of that the four saves
//! of an approval, each a statement of its own: a round trip, a backend
//! woken, an executor started and finished, a transaction committed.
//! `perf` put a quarter of PostgreSQL's time in that per-statement work
//! (protocol, `ExecutorStart`, the commit) rather than in the rows. So the
//! saves queued while others run go in together, as SQLite's do
//! (save/sqlite.rs): one statement, one round trip and one commit for all.
//!
//! The statement calls a PL/pgSQL function, temporary to its connection
//! (`pg_temp`, made on first use): the calls and the delivery attempts of
//! the whole batch first, whatever became of their operations (they
//! happened); then the compare-and-sets of all the saves, one statement;
//! then, save by save, for those that took, the release of the thread's
//! next answer and the inbox row; then their transitions. It returns the
//! places of the saves that took. The per-save texts are the same macros
//! as SQLite's trigger, with `$n` turned into the row's fields. A
//! statement is atomic: if any save in it fails, none of it stays, and
//! the batch is run again one save per statement so only the failing save
//! gets the error.
//!
//! Up to `RUNNERS` batches run at once, each on a connection of the pool,
//! so one batch is collected while others run and commit. A lone save runs
//! at once: nothing waits to fill a batch.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;

use super::SaveValue;
use super::{LeaseWith, SAVE_COLUMNS, TakeLease, params_as_fields};
use crate::store::StoreError;

/// The most saves one statement carries.
const MAX_BATCH: usize = 32;

/// Batches running at once, each on its own connection.
const RUNNERS: usize = 4;

/// The PostgreSQL type of each of `SAVE_COLUMNS`, in its order.
#[rustfmt::skip]
const TYPES: [&str; 33] = [
    // state, decision_id, answer, permit_id, delivery, outcome_status, result, receipt, receipt_outcome
    "text", "text", "text", "text", "text", "text", "text", "text", "text",
    // consume_inflight, consume_attempts, delivery_inflight, attempts, last_error
    "bigint", "bigint", "bigint", "bigint", "text",
    // due_at, poll_at, opened_at, updated_at, id, version, resume_seq
    "bigint", "bigint", "bigint", "bigint", "text", "bigint", "bigint",
    // clear_inbox_at, opened_now, tenant, transitions, deliveries, calls
    "boolean", "boolean", "text", "text", "text", "text",
    // release_next, inbox_id, thread_id, inbox_state, inbox_note, seq
    "boolean", "bigint", "text", "text", "text", "bigint",
];

/// What follows a save whose compare-and-set took, save by save in the
/// batch's order, with the parameters of the texts shared with SQLite
/// (`$n`): the release of the thread's next answer, and the inbox row.
const AFTER_TAKEN: &str = concat!(
    "IF $28 THEN ",
    release_next_answer!("$19", "$24", "$30", "$18"),
    "; END IF; \
     IF $29 IS NOT NULL THEN \
       UPDATE inbox SET state = $31, note = $32, operation_id = $19, processed_at = $18 WHERE id = $29; \
     END IF;"
);

/// The compare-and-set of every save in the batch, one statement joining
/// the batch's rows (`b`) to their operations: one executor for the
/// batch where a statement per save started and finished one each, the
/// most of the function's time after the rows' own writes (decisions
/// §24). The rows arrive sorted by operation, and each is found through
/// the primary key in that order, so batches take their rows' locks in
/// one order; should a plan ever take them otherwise, PostgreSQL detects
/// the deadlock and the batch is run again save by save.
fn compare_and_set(record: &str) -> String {
    let set = params_as_fields(update_operation!(set), "b.");
    let condition = params_as_fields(update_operation!(condition), "b.");
    format!(
        "WITH took AS ({set} FROM jsonb_to_recordset(batch) AS b({record}) WHERE {condition} \
           AND NOT b.seq = ANY(refused) RETURNING b.seq) \
         SELECT coalesce(array_agg(seq), '{{}}') INTO taken FROM took; "
    )
}

/// The rows a save carries in a JSON array (`field`), inserted for the
/// whole batch in one statement: the saves' own order, then each array's.
/// `columns` are (the table's column, the JSON key, its type);
/// `operation`, the column that names the save's operation where the rows
/// do not carry it; `only_taken` keeps the saves whose compare-and-set
/// took. A statement per save was three fourths of the statements the
/// function ran, each an executor started and finished (`approvald bench`
/// with `pg_stat_statements` tracking them all; decisions §22).
fn insert_carried(
    table: &str,
    field: &str,
    operation: Option<&str>,
    columns: &[(&str, &str, &str)],
    only_taken: bool,
) -> String {
    let mut target: Vec<String> = operation.iter().map(|c| (*c).to_owned()).collect();
    let mut picked: Vec<String> = operation.iter().map(|_| "x.id".to_owned()).collect();
    target.extend(columns.iter().map(|(c, _, _)| (*c).to_owned()));
    picked.extend(columns.iter().map(|(_, k, _)| format!("r.\"{k}\"")));
    let keys: Vec<String> = columns.iter().map(|(_, k, _)| format!("\"{k}\"")).collect();
    let typed: Vec<String> = columns.iter().map(|(_, k, t)| format!("\"{k}\" {t}")).collect();
    format!(
        "INSERT INTO {table} ({target}) SELECT {picked} \
         FROM jsonb_to_recordset(batch) AS x(seq bigint, id text, {field} text) \
         CROSS JOIN LATERAL ROWS FROM (jsonb_to_recordset(x.{field}::jsonb) AS ({typed})) \
           WITH ORDINALITY AS r({keys}, ord) \
         WHERE x.{field} <> '[]'{taken} ORDER BY x.seq, r.ord; ",
        target = target.join(", "),
        picked = picked.join(", "),
        typed = typed.join(", "),
        keys = keys.join(", "),
        taken = if only_taken { " AND x.seq = ANY(taken)" } else { "" },
    )
}

/// (column, type) pairs as `insert_carried`'s columns, each JSON key the
/// column's name.
fn same_keys<'a>(columns: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str, &'a str)> {
    columns.iter().map(|&(c, t)| (c, c, t)).collect()
}

/// Makes the batch function on the connection. Temporary: each
/// connection has its own, gone with it, so a new version of approvald
/// never finds an old one, and nothing is added to the schema.
///
/// Its statements keep their generic plans: the transitions' insert,
/// filtered by the array of saves that took, was otherwise planned anew
/// on two calls in three (PostgreSQL costs a generic plan for an array of
/// unknown length above a custom one), and every statement here reads
/// by a key, which a generic plan serves as well.
///
/// The compare-and-set joins the batch's rows to `operations`, and its
/// plan must find each row through the primary key: without statistics
/// (a new table, or autovacuum off) PostgreSQL planned a hash join over a
/// scan of the whole table, for every batch of the connection's life
/// (`EXPLAIN` of the generic plan), and three short bench runs in four
/// measured 624–678 approvals/s against 834–981 with the loop it
/// replaced. So joins other than a nested loop, and scans of a whole
/// table, are priced out of this function's plans.
///
/// The calls and the delivery attempts are inserted first, whatever
/// became of their operations (they happened); then the saves'
/// compare-and-sets; then what follows each that took, and their
/// transitions.
fn setup() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let record: Vec<String> = SAVE_COLUMNS.iter().zip(TYPES).map(|(c, t)| format!("{c} {t}")).collect();
        // The calls and the delivery attempts carry their operation; a
        // transition is named by its save.
        let deliveries = insert_carried(
            "deliveries",
            "deliveries",
            None,
            &same_keys(&[
                ("operation_id", "text"),
                ("attempt", "bigint"),
                ("started_at", "bigint"),
                ("duration_ms", "bigint"),
                ("status_code", "bigint"),
                ("error", "text"),
                ("response_body", "text"),
            ]),
            false,
        );
        let calls = insert_carried(
            "pushary_calls",
            "calls",
            None,
            &same_keys(&[
                ("operation_id", "text"),
                ("call", "text"),
                ("started_at", "bigint"),
                ("duration_ms", "bigint"),
                ("status_code", "bigint"),
                ("error", "text"),
            ]),
            false,
        );
        let transitions = insert_carried(
            "transitions",
            "transitions",
            Some("operation_id"),
            &[
                ("from_state", "from", "text"),
                ("to_state", "to", "text"),
                ("at", "at", "bigint"),
                ("cause", "cause", "text"),
                ("actor", "actor", "text"),
            ],
            true,
        );
        let record = record.join(", ");
        format!(
            "CREATE OR REPLACE FUNCTION pg_temp.approvald_save_batch(batch jsonb, carries integer) \
             RETURNS TABLE (saved_seq bigint, gave_up_lease boolean) \
             LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_hashjoin = off \
             SET enable_mergejoin = off SET enable_seqscan = off AS $fn$ \
             #variable_conflict use_column\n \
             DECLARE s record; g record; got text; taken bigint[]; gave_up bigint[] := '{{}}'; \
               refused bigint[] := '{{}}'; leased bigint[] := '{{}}'; \
             BEGIN \
             IF carries & {BRIEFLY} <> 0 THEN PERFORM set_config('lock_timeout', '{LOCK_TIMEOUT_MS}ms', true); END IF; \
             IF carries & {DELIVERIES} <> 0 THEN {deliveries}END IF; \
             IF carries & {CALLS} <> 0 THEN {calls}END IF; \
             IF carries & {TAKE} <> 0 THEN {take}END IF; \
             {cas}\
             IF NOT leased <@ taken THEN {untake}END IF; \
             IF carries & {AFTER} <> 0 AND cardinality(taken) > 0 THEN \
             FOR s IN SELECT * FROM jsonb_to_recordset(batch) AS x({record}) \
               WHERE x.seq = ANY(taken) AND (x.release_next OR x.inbox_id IS NOT NULL) ORDER BY x.seq \
             LOOP {after} END LOOP; END IF; \
             IF carries & {TRANSITIONS} <> 0 AND cardinality(taken) > 0 THEN {transitions}END IF; \
             IF carries & {RELEASE} <> 0 AND cardinality(taken) > 0 THEN {release}END IF; \
             RETURN QUERY SELECT t, t = ANY(gave_up) FROM unnest(taken) AS t; END \
             $fn$",
            cas = compare_and_set(&record),
            DELIVERIES = DELIVERIES,
            CALLS = CALLS,
            AFTER = AFTER,
            TRANSITIONS = TRANSITIONS,
            RELEASE = RELEASE,
            release = RELEASE_LEASES,
            TAKE = TAKE,
            BRIEFLY = BRIEFLY,
            LOCK_TIMEOUT_MS = LOCK_TIMEOUT_MS,
            take = TAKE_LEASES,
            untake = GIVE_BACK_UNSAVED,
            after = params_as_fields(AFTER_TAKEN, "s."),
        )
    })
}

const BATCH: &str =
    "SELECT saved_seq, gave_up_lease FROM pg_temp.approvald_save_batch($1::jsonb, $2::integer)";

/// The leases given up with the saves that end their holder's visit
/// (`release_owner`, decisions §34): a thread's lease goes if, after the
/// batch's other statements, none of its operations has a step due, now
/// or later, nor an answer waiting; the read that would have found exactly
/// that, a statement and a round trip of its own after the save, is not
/// made. A thread with anything left keeps its lease, and its holder
/// reads its work as before. (The leases' table is unlogged; the delete
/// rides in the save's durable commit.)
///
/// A statement per releasing save (at most one per approval), with the
/// thread as the statement's own values: one statement joining the batch's
/// rows to `operations` was planned, on a store of a million finished
/// rows, as a walk of the whole `operations_thread_due` index per save
/// with the thread as a filter (its statistics, taken with the work
/// drained, called it empty; its dead entries, until a vacuum, made it
/// long): 6.9 ms a call, against a lookup by the thread here. And two
/// `NOT EXISTS`, each through its per-thread partial index, as the
/// thread's read has (`Store::thread_work`): one with an `OR` was
/// planned on `operations_thread`, every row of the thread.
const RELEASE_LEASES: &str = "FOR g IN SELECT * FROM jsonb_to_recordset(batch) \
       AS x(seq bigint, tenant text, thread_id text, release_owner text) \
       WHERE x.seq = ANY(taken) AND x.release_owner IS NOT NULL ORDER BY x.seq \
     LOOP \
       DELETE FROM thread_leases WHERE tenant = g.tenant AND thread_id = g.thread_id AND owner = g.release_owner \
         AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.tenant = g.tenant AND o.thread_id = g.thread_id \
           AND o.due_at IS NOT NULL) \
         AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.tenant = g.tenant AND o.thread_id = g.thread_id \
           AND o.inbox_at IS NOT NULL AND o.decision_id IS NOT NULL); \
       IF FOUND THEN gave_up := gave_up || g.seq; END IF; \
     END LOOP; ";

/// The leases taken with their saves (`TakeLease`, decisions §35), each
/// before the compare-and-sets, in the threads' order (two batches taking
/// leases of the same threads wait for each other in one order). A lease
/// held by another is not locked, only passed by: `ON CONFLICT DO UPDATE`
/// would lock its row until this batch's durable commit, and the holder's
/// own save giving it up would wait for that commit (with two batches
/// doing so to each other's holders, for the deadlock detector). One run
/// out is taken over only if no one has its row locked (its holder, late,
/// giving it up): `SKIP LOCKED`, and the save is refused. A save
/// whose lease is held by another, whose thread has another answer
/// waiting, or whose answer is held back behind an earlier one of the
/// thread still resuming, is refused: the compare-and-set passes it by,
/// and a lease it took goes again. The checks read after the lease's
/// insert, each statement of the function on a snapshot of its own: they
/// see whatever the lease's last holder saved before it let go.
const TAKE_LEASES: &str = concat!(
    "FOR g IN SELECT * FROM jsonb_to_recordset(batch) \
       AS x(seq bigint, id text, tenant text, thread_id text, inbox_id bigint, take_owner text, \
         take_now bigint, take_until bigint) \
       WHERE x.take_owner IS NOT NULL ORDER BY x.tenant, x.thread_id, x.seq \
     LOOP \
       got := NULL; \
       INSERT INTO thread_leases (tenant, thread_id, owner, until) \
         VALUES (g.tenant, g.thread_id, g.take_owner, g.take_until) \
         ON CONFLICT (tenant, thread_id) DO NOTHING RETURNING owner INTO got; \
       IF got IS NULL THEN \
         UPDATE thread_leases l SET owner = g.take_owner, until = g.take_until \
           FROM (SELECT k.tenant, k.thread_id FROM thread_leases k \
             WHERE k.tenant = g.tenant AND k.thread_id = g.thread_id \
               AND (k.until <= g.take_now OR k.owner = g.take_owner) FOR UPDATE SKIP LOCKED) AS k \
           WHERE l.tenant = k.tenant AND l.thread_id = k.thread_id \
           RETURNING l.owner INTO got; \
       END IF; \
       IF got IS DISTINCT FROM g.take_owner THEN \
         refused := refused || g.seq; \
       ELSIF EXISTS (SELECT 1 FROM operations o WHERE o.tenant = g.tenant AND o.thread_id = g.thread_id \
           AND o.inbox_at IS NOT NULL AND o.decision_id IS NOT NULL AND o.id <> g.id) \
         OR ",
    held_back!("g.tenant", "g.thread_id", "g.inbox_id"),
    " THEN \
         DELETE FROM thread_leases WHERE tenant = g.tenant AND thread_id = g.thread_id AND owner = g.take_owner; \
         refused := refused || g.seq; \
       ELSE \
         leased := leased || g.seq; \
       END IF; \
     END LOOP; "
);

/// The leases taken for saves whose compare-and-set did not take (their
/// operations moved meanwhile) go again: a save that did not take leaves
/// no lease, and its worker reads the thread as any visit does.
const GIVE_BACK_UNSAVED: &str = "FOR g IN SELECT * FROM jsonb_to_recordset(batch) \
       AS x(seq bigint, tenant text, thread_id text, take_owner text) \
       WHERE x.seq = ANY(leased) AND NOT x.seq = ANY(taken) \
     LOOP \
       DELETE FROM thread_leases WHERE tenant = g.tenant AND thread_id = g.thread_id AND owner = g.take_owner; \
     END LOOP; ";

/// What a batch carries besides its compare-and-sets, as bits of the
/// function's second argument: a statement whose rows no save in the
/// batch has is skipped, not run empty. Each costs an executor started and
/// finished whatever it finds, and a save carries few of them (a lone
/// save, as at a quarter of full speed, took 0.5 ms of the function's
/// time, half of it outside its statements' own runs; docs/performance.md).
const DELIVERIES: i32 = 1;
const CALLS: i32 = 2;
/// The release of a thread's next answer, or an inbox row's mark.
const AFTER: i32 = 4;
const TRANSITIONS: i32 = 8;
/// A lease to give up with its save.
const RELEASE: i32 = 16;
/// A lease to take with its save.
const TAKE: i32 = 32;
/// The batch waits for no lock longer than `LOCK_TIMEOUT_MS`: the inbox's
/// transaction (decisions §36) holds the rows of the operations it marked
/// while its saves take leases, and a save batch that takes a lease
/// before it updates one of those rows would wait for it in a cycle.
/// PostgreSQL would break that after `deadlock_timeout` (a second); this
/// breaks it sooner, and the inbox stores its batch again without saves.
const BRIEFLY: i32 = 64;
const LOCK_TIMEOUT_MS: u32 = 50;

/// The bits of `rows`' carries, as `DELIVERIES` … `TRANSITIONS`.
fn carries(rows: &[&[SaveValue]]) -> i32 {
    let array =
        |row: &[SaveValue], i: usize| matches!(row.get(i), Some(SaveValue::Text(Some(t))) if &**t != "[]");
    let set = |row: &[SaveValue], i: usize| match row.get(i) {
        Some(SaveValue::Int(v)) => v.is_some_and(|v| v != 0),
        Some(SaveValue::Text(t)) => t.is_some(),
        None => false,
    };
    rows.iter().fold(0, |bits, row| {
        bits | if array(row, TRANSITIONS_AT) { TRANSITIONS } else { 0 }
            | if array(row, DELIVERIES_AT) { DELIVERIES } else { 0 }
            | if array(row, CALLS_AT) { CALLS } else { 0 }
            | if set(row, RELEASE_NEXT_AT) || set(row, INBOX_ID_AT) { AFTER } else { 0 }
    })
}

/// Places in `SAVE_COLUMNS` (checked by a test).
const TRANSITIONS_AT: usize = 24;
const DELIVERIES_AT: usize = 25;
const CALLS_AT: usize = 26;
const RELEASE_NEXT_AT: usize = 27;
const INBOX_ID_AT: usize = 28;

/// Whether the save took, and whether its thread's lease went with it.
type Reply = Result<(bool, bool), StoreError>;

struct Pending {
    values: Vec<SaveValue>,
    /// The owner of the thread's lease to give up with the save, if the
    /// thread has no work left (`RELEASE_LEASES`).
    release: Option<Arc<str>>,
    /// The lease to take with the save: owner, now, until (`TAKE_LEASES`).
    take: Option<(Arc<str>, i64, i64)>,
    reply: oneshot::Sender<Reply>,
    queued: std::time::Instant,
}

#[derive(Default)]
struct Waiting {
    saves: VecDeque<Pending>,
    /// Batches running now.
    running: usize,
}

/// The saves waiting for a batch.
pub(crate) struct PgSaveQueue {
    pool: PgPool,
    waiting: Mutex<Waiting>,
}

impl std::fmt::Debug for PgSaveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSaveQueue").finish_non_exhaustive()
    }
}

impl PgSaveQueue {
    pub(crate) fn new(pool: PgPool) -> Arc<Self> {
        Arc::new(Self { pool, waiting: Mutex::default() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // A panic elsewhere while holding it leaves the queue as it was.
        self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues one save (`values` as `bind_all!` binds them) and returns
    /// whether it took, once its batch has committed, and whether the
    /// lease of `release` (its owner) went with it.
    ///
    /// A batch runs in a task of its own, not in the caller's future: a
    /// caller dropped mid-save (an HTTP client gone) must not cut the
    /// statement of the other saves in its batch short.
    pub(crate) async fn save(
        self: &Arc<Self>,
        values: Vec<SaveValue>,
        lease: LeaseWith<'_>,
    ) -> Result<(bool, bool), StoreError> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut waiting = self.lock();
            let release = lease.release.map(Arc::from);
            let take = lease.take.map(|t| (Arc::from(t.owner), t.now, t.until));
            let queued = std::time::Instant::now();
            waiting.saves.push_back(Pending { values, release, take, reply, queued });
            // Under the same lock a runner decides to stop (`take`), so a
            // save is never left with no runner to take it.
            let start = waiting.running < RUNNERS;
            if start {
                waiting.running += 1;
            }
            start
        };
        if start {
            tokio::spawn(Arc::clone(self).run());
        }
        answer
            .await
            .map_err(|_| StoreError::Unavailable("the save's batch ended without an answer".into()))?
    }

    /// The next batch, or None (and one runner fewer) when nothing waits.
    fn take(&self) -> Option<Vec<Pending>> {
        let mut waiting = self.lock();
        if waiting.saves.is_empty() {
            waiting.running -= 1;
            return None;
        }
        let n = waiting.saves.len().min(MAX_BATCH);
        Some(waiting.saves.drain(..n).collect())
    }

    /// Runs batches until none waits.
    async fn run(self: Arc<Self>) {
        let mut place = RunnerPlace { queue: Arc::clone(&self), given_back: false };
        loop {
            let Some(mut batch) = self.take() else {
                place.given_back = true;
                return;
            };
            // A batch holds its rows' locks until it commits; taken in one
            // order by every batch, two batches cannot deadlock on them.
            // Stable: saves of one operation keep their order.
            batch.sort_by(|a, b| operation_id(&a.values).cmp(&operation_id(&b.values)));
            let rows: Vec<&[SaveValue]> = batch.iter().map(|p| p.values.as_slice()).collect();
            let leases: Vec<LeaseWith<'_>> = batch
                .iter()
                .map(|p| LeaseWith {
                    release: p.release.as_deref(),
                    take: p.take.as_ref().map(|(owner, now, until)| TakeLease {
                        owner,
                        now: *now,
                        until: *until,
                    }),
                })
                .collect();
            let started = std::time::Instant::now();
            let oldest = batch.iter().map(|p| p.queued).min().map_or(0, |q| (started - q).as_micros());
            let results = run_batch(&self.pool, &rows, &leases).await;
            tracing::trace!(
                saves = rows.len(),
                waited_us = oldest,
                ran_us = started.elapsed().as_micros(),
                "PostgreSQL save batch"
            );
            for (p, r) in batch.into_iter().zip(results) {
                let _ = p.reply.send(r);
            }
        }
    }
}

/// A runner's place among the `RUNNERS`, given back however the runner
/// ends. `take` gives it back when nothing waits; a runner that ends
/// otherwise (a panic, a bug; its runtime shutting down) gives it back
/// here, and after a panic a new runner takes the saves queued behind it.
/// The callers of the batch it was running are told it ended without an
/// answer.
struct RunnerPlace {
    queue: Arc<PgSaveQueue>,
    given_back: bool,
}

impl Drop for RunnerPlace {
    fn drop(&mut self) {
        if self.given_back {
            return;
        }
        let runtime = tokio::runtime::Handle::try_current().ok().filter(|_| std::thread::panicking());
        let respawn = {
            let mut waiting = self.queue.lock();
            let respawn = !waiting.saves.is_empty() && runtime.is_some();
            if !respawn {
                waiting.running -= 1;
            }
            respawn
        };
        if let Some(runtime) = runtime.filter(|_| respawn) {
            runtime.spawn(Arc::clone(&self.queue).run());
        }
    }
}

/// Runs `rows` as one statement; if PostgreSQL refused it (it then changed
/// nothing), runs each again on its own, so only the failing save gets the
/// error. A lost connection fails them all: whether the statement
/// committed is not known, and each caller reads the store again.
async fn run_batch(pool: &PgPool, rows: &[&[SaveValue]], leases: &[LeaseWith<'_>]) -> Vec<Reply> {
    match execute(pool, rows, leases).await {
        Ok(saved) => saved.into_iter().map(Ok).collect(),
        Err(e) if rows.len() > 1 && refused(&e) => {
            let mut each = Vec::with_capacity(rows.len());
            for (row, lease) in rows.iter().zip(leases) {
                each.push(
                    match execute(pool, std::slice::from_ref(row), std::slice::from_ref(lease)).await {
                        Ok(saved) => Ok(saved[0]),
                        Err(e) => Err(e.into()),
                    },
                );
            }
            each
        }
        Err(e) => {
            let e = StoreError::from(e);
            rows.iter().map(|_| Err(e.clone())).collect()
        }
    }
}

/// The operation a save's values name (`$19`).
fn operation_id(values: &[SaveValue]) -> Option<&str> {
    match values.get(18) {
        Some(SaveValue::Text(id)) => id.as_deref(),
        _ => None,
    }
}

/// An error PostgreSQL answered for the statement, which it then rolled
/// back (an autocommit statement is its own transaction). Not a lost
/// connection (class 08), the server shutting the session down (57P) or an
/// internal error (XX): the session may have ended after the commit.
fn refused(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => refused_by_database(db.as_ref()),
        _ => false,
    }
}

/// `refused`, for an error PostgreSQL answered.
pub(crate) fn refused_by_database(db: &dyn sqlx::error::DatabaseError) -> bool {
    !db.code().is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c.starts_with("XX"))
}

/// Runs `rows` as one statement: whether each took, and whether the lease
/// each names in `releases` went with it. Makes the function on a
/// connection that has none yet, and runs the statement again.
async fn execute(
    pool: &PgPool,
    rows: &[&[SaveValue]],
    leases: &[LeaseWith<'_>],
) -> Result<Vec<(bool, bool)>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    match run_in(&mut conn, rows, leases, false).await {
        Err(sqlx::Error::Database(e)) if crate::store::db::is_missing_temp_function(e.as_ref()) => {
            make_function(&mut conn).await?;
            run_in(&mut conn, rows, leases, false).await
        }
        other => other,
    }
}

/// Makes the batch function on `conn`, which has none yet.
pub(crate) async fn make_function(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(setup())).execute(conn).await.map(|_| ())
}

/// `execute` on `conn`, which may be in a transaction: a connection
/// without the function fails (`is_missing_temp_function`), and its
/// transaction with it. `briefly`: a lock not had within
/// `LOCK_TIMEOUT_MS` fails the statement (`BRIEFLY`).
pub(crate) async fn run_in(
    conn: &mut PgConnection,
    rows: &[&[SaveValue]],
    leases: &[LeaseWith<'_>],
    briefly: bool,
) -> Result<Vec<(bool, bool)>, sqlx::Error> {
    let batch = batch_json(rows, leases);
    let carries = carries(rows)
        | if briefly { BRIEFLY } else { 0 }
        | if leases.iter().any(|l| l.release.is_some()) { RELEASE } else { 0 }
        | if leases.iter().any(|l| l.take.is_some()) { TAKE } else { 0 };
    let returned =
        sqlx::query_as::<_, (i64, bool)>(BATCH).bind(&batch).bind(carries).fetch_all(&mut *conn).await?;
    let mut saved = vec![(false, false); rows.len()];
    for (seq, gave_up) in returned {
        if let Some(s) = usize::try_from(seq).ok().and_then(|i| saved.get_mut(i)) {
            *s = (true, gave_up);
        }
    }
    Ok(saved)
}

/// The batch as the function reads it: an array of objects named by
/// `SAVE_COLUMNS`, each with its place, the owner of the lease to give
/// up with it and the lease to take with it, where there are.
fn batch_json(rows: &[&[SaveValue]], leases: &[LeaseWith<'_>]) -> String {
    let batch: Vec<Value> = rows
        .iter()
        .zip(leases.iter().copied().chain(std::iter::repeat(LeaseWith::default())))
        .enumerate()
        .map(|(seq, (row, lease))| {
            let mut o = Map::with_capacity(SAVE_COLUMNS.len());
            for ((column, ty), v) in SAVE_COLUMNS.iter().zip(TYPES).zip(row.iter()) {
                let v = match v {
                    SaveValue::Text(t) => t.as_deref().map_or(Value::Null, |t| Value::String(t.to_owned())),
                    SaveValue::Int(Some(i)) if ty == "boolean" => Value::Bool(*i != 0),
                    SaveValue::Int(i) => i.map_or(Value::Null, Value::from),
                };
                o.insert((*column).to_owned(), v);
            }
            o.insert("seq".to_owned(), Value::from(seq));
            if let Some(owner) = lease.release {
                o.insert("release_owner".to_owned(), Value::from(owner));
            }
            if let Some(t) = lease.take {
                o.insert("take_owner".to_owned(), Value::from(t.owner));
                o.insert("take_now".to_owned(), Value::from(t.now));
                o.insert("take_until".to_owned(), Value::from(t.until));
            }
            Value::Object(o)
        })
        .collect();
    Value::Array(batch).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;
    use crate::store::save::test_rows::{self, assert_isolated, five, row};
    use crate::store::test_support::ScratchPg;

    /// A fresh, migrated database with pending operations `a`–`d` and `x`
    /// (which holds decision `dec-1`); None (said loudly) without
    /// `APPROVALD_TEST_PG_URL`.
    async fn pg(test: &str) -> Option<(ScratchPg, Store, PgPool)> {
        let db = ScratchPg::create(test).await?;
        let store = db.store.clone();
        let pool = store.pg_pool().expect("a PostgreSQL store").clone();
        for (id, decision) in [("x", Some("dec-1")), ("a", None), ("b", None), ("c", None), ("d", None)] {
            sqlx::query(
                "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
                 decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, \
                 created_at, updated_at) \
                 VALUES ($1, 't', $1, 'f', $1, 'i', 'e', 'confirm', '{}', '{}', 'pending', $2, $1, 9, 1, 1)",
            )
            .bind(id)
            .bind(decision)
            .execute(&pool)
            .await
            .expect("inserts");
        }
        Some((db, store, pool))
    }

    async fn calls(pool: &PgPool) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT operation_id, count(*) FROM pushary_calls GROUP BY operation_id ORDER BY 1")
            .fetch_all(pool)
            .await
            .expect("reads")
    }

    // Five saves in one statement: two that take, one that breaks the
    // unique decision id, one from a version the first moved, one more
    // that takes. PostgreSQL refuses the statement and the saves run again
    // one by one: the failing one gets the error and leaves nothing; the
    // stale one is told so and keeps its call record; the rest commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_of_saves_isolates_the_one_that_fails() {
        let Some((db, _store, pool)) = pg("a_batch_of_saves_isolates_the_one_that_fails").await else {
            return;
        };
        let rows = five();
        let refs: Vec<&[SaveValue]> = rows.iter().map(Vec::as_slice).collect();
        let outcomes: Vec<Result<bool, String>> = run_batch(&pool, &refs, &[LeaseWith::default(); 5])
            .await
            .into_iter()
            .map(|r| r.map(|(saved, _)| saved).map_err(|e| e.to_string()))
            .collect();
        let ops: Vec<(String, i64, Option<String>)> =
            sqlx::query_as("SELECT id, version, last_error FROM operations WHERE id <> 'x' ORDER BY id")
                .fetch_all(&pool)
                .await
                .expect("reads");
        assert_isolated(&outcomes, "operations_decision", &ops, &calls(&pool).await);
        db.drop().await;
    }

    // A save that ends its holder's visit gives the thread's lease up with
    // it only when nothing is left on the thread: no step due, now or
    // later (its own or another operation's), no answer waiting; only its
    // holder's lease, and only if the save took (decisions §34).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_gives_up_its_threads_lease_only_when_nothing_is_left() {
        let Some((db, _store, pool)) = pg("a_save_gives_up_its_threads_lease").await else {
            return;
        };
        let later = i64::MAX / 2;
        // Threads b and c have another operation with work; e is a thread
        // of its own; on f, f2's answer waits behind f's (held back: no
        // step due until f finishes).
        for (id, thread, state, due_at, inbox_at, resume_seq) in [
            ("b2", "b", "pending", Some(later), None, None),
            ("c2", "c", "pending", None, Some(3), None),
            ("e", "e", "pending", None, None, None),
            ("f", "f", "delivering", None, None, Some(1)),
            ("f2", "f", "answered", None, None, Some(2)),
        ] {
            sqlx::query(
                "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
                 decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, \
                 created_at, updated_at, due_at, inbox_at, resume_seq) \
                 VALUES ($1, 't', $1, 'f', $2, 'i', 'e', 'confirm', '{}', '{}', $3, 'dec-' || $1, $1, 9, \
                 1, 1, $4, $5, $6)",
            )
            .bind(id)
            .bind(thread)
            .bind(state)
            .bind(due_at)
            .bind(inbox_at)
            .bind(resume_seq)
            .execute(&pool)
            .await
            .expect("inserts");
        }
        for thread in ["a", "b", "c", "d", "e", "f", "x"] {
            sqlx::query(
                "INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ('t', $1, $2, $3)",
            )
            .bind(thread)
            .bind(format!("w-{thread}"))
            .bind(later)
            .execute(&pool)
            .await
            .expect("leases");
        }
        let mut leaves_a_step = row("d", 0, None);
        leaves_a_step[14] = SaveValue::Int(Some(later));
        // f finishes: its save lets f2's answer go (`release_next`), which
        // makes a step due on the thread before the lease is looked at.
        let mut finishes_f = row("f", 0, Some("dec-f"));
        finishes_f[20] = SaveValue::Int(Some(1));
        finishes_f[27] = SaveValue::Int(Some(1));
        let rows = [
            row("a", 0, None),
            row("b", 0, None),
            row("c", 0, None),
            leaves_a_step,
            row("e", 0, None),
            finishes_f,
            row("x", 7, None),
        ];
        let refs: Vec<&[SaveValue]> = rows.iter().map(Vec::as_slice).collect();
        let releases = [
            Some("w-a"),
            Some("w-b"),
            Some("w-c"),
            Some("w-d"),
            Some("someone-else"),
            Some("w-f"),
            Some("w-x"),
        ];
        let saved = execute(&pool, &refs, &releases.map(LeaseWith::releasing)).await.expect("runs");
        let given_up: Vec<bool> = saved.iter().map(|s| s.1).collect();
        assert_eq!(
            given_up,
            [true, false, false, false, false, false, false],
            "a: nothing left; b, c: another operation has work; d: its own step later; \
             e: another's lease; f: the answer it let go; x: the save did not take"
        );
        let took: Vec<bool> = saved.iter().map(|s| s.0).collect();
        assert_eq!(took, [true, true, true, true, true, true, false]);
        let leases: Vec<String> = sqlx::query_scalar("SELECT thread_id FROM thread_leases ORDER BY 1")
            .fetch_all(&pool)
            .await
            .expect("reads");
        assert_eq!(leases, ["b", "c", "d", "e", "f", "x"]);
        let f2_due: Option<i64> = sqlx::query_scalar("SELECT due_at FROM operations WHERE id = 'f2'")
            .fetch_one(&pool)
            .await
            .expect("reads");
        assert_eq!(f2_due, Some(2), "f2's answer was let go by f's save");
        // Without an owner to give up, no lease goes, though nothing is left.
        sqlx::query(
            "INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ('t', 'a', 'w-a', $1)",
        )
        .bind(later)
        .execute(&pool)
        .await
        .expect("leases again");
        let again = [row("a", 1, None)];
        let refs: Vec<&[SaveValue]> = again.iter().map(Vec::as_slice).collect();
        assert_eq!(execute(&pool, &refs, &[LeaseWith::default()]).await.expect("runs"), vec![(true, false)]);
        let held: i64 = sqlx::query_scalar("SELECT count(*) FROM thread_leases WHERE thread_id = 'a'")
            .fetch_one(&pool)
            .await
            .expect("reads");
        assert_eq!(held, 1);
        db.drop().await;
    }

    // A save that takes its thread's lease (an answer handed on by the
    // inbox, decisions §35) is made only if the lease was free or run out,
    // no other answer waits on the thread and its answer is not held back;
    // refused, or its compare-and-set failing, it leaves the operation and
    // the leases as they were.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_takes_its_threads_lease_only_when_its_answer_is_next() {
        let Some((db, _store, pool)) = pg("a_save_takes_its_threads_lease").await else {
            return;
        };
        let later = i64::MAX / 2;
        // On c, c2's answer waits too; on d, d0's earlier answer is still
        // being delivered; f is a thread of its own.
        for (id, thread, state, inbox_at, resume_seq) in [
            ("c2", "c", "pending", Some(3), None),
            ("d0", "d", "delivering", None, Some(1)),
            ("f", "f", "pending", None, None),
            ("g", "g", "pending", None, None),
        ] {
            sqlx::query(
                "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
                 decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, \
                 created_at, updated_at, inbox_at, resume_seq) \
                 VALUES ($1, 't', $1, 'f', $2, 'i', 'e', 'confirm', '{}', '{}', $3, 'dec-' || $1, $1, 9, \
                 1, 1, $4, $5)",
            )
            .bind(id)
            .bind(thread)
            .bind(state)
            .bind(inbox_at)
            .bind(resume_seq)
            .execute(&pool)
            .await
            .expect("inserts");
        }
        // b's lease is another's; f's ran out, and g's, whose late holder
        // is giving it up (its row locked).
        for (thread, owner, until) in [("b", "other", later), ("f", "gone", 1), ("g", "late", 1)] {
            sqlx::query(
                "INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ('t', $1, $2, $3)",
            )
            .bind(thread)
            .bind(owner)
            .bind(until)
            .execute(&pool)
            .await
            .expect("leases");
        }
        let mut held_back = row("d", 0, None);
        held_back[INBOX_ID_AT] = SaveValue::Int(Some(5));
        let rows = [
            row("a", 0, None),
            row("b", 0, None),
            row("c", 0, None),
            held_back,
            row("f", 0, None),
            row("g", 0, None),
            row("x", 7, None),
        ];
        let owners = ["w-a", "w-b", "w-c", "w-d", "w-f", "w-g", "w-x"];
        let leases: Vec<LeaseWith<'_>> = owners
            .iter()
            .map(|owner| LeaseWith { release: None, take: Some(TakeLease { owner, now: 100, until: later }) })
            .collect();
        let refs: Vec<&[SaveValue]> = rows.iter().map(Vec::as_slice).collect();
        let mut late = pool.begin().await.expect("begins");
        sqlx::query("SELECT 1 FROM thread_leases WHERE thread_id = 'g' FOR UPDATE")
            .execute(&mut *late)
            .await
            .expect("locks g's lease");
        let saved = execute(&pool, &refs, &leases).await.expect("runs");
        late.rollback().await.expect("lets go");
        let took: Vec<bool> = saved.iter().map(|s| s.0).collect();
        assert_eq!(
            took,
            [true, false, false, false, true, false, false],
            "a: free; b: another's lease; c: another answer waits; d: held back; f: run out; \
             g: run out but locked; x: stale version"
        );
        let held: Vec<(String, String)> =
            sqlx::query_as("SELECT thread_id, owner FROM thread_leases ORDER BY 1")
                .fetch_all(&pool)
                .await
                .expect("reads");
        let held: Vec<(&str, &str)> = held.iter().map(|(t, o)| (t.as_str(), o.as_str())).collect();
        assert_eq!(held, [("a", "w-a"), ("b", "other"), ("f", "w-f"), ("g", "late")]);
        let versions: Vec<(String, i64)> = sqlx::query_as(
            "SELECT id, version FROM operations WHERE id IN ('a', 'b', 'c', 'd', 'f', 'g', 'x') ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .expect("reads");
        let versions: Vec<(&str, i64)> = versions.iter().map(|(id, v)| (id.as_str(), *v)).collect();
        assert_eq!(versions, [("a", 1), ("b", 0), ("c", 0), ("d", 0), ("f", 1), ("g", 0), ("x", 0)]);
        db.drop().await;
    }

    // The checks of a save that takes its thread's lease read after the
    // lease's insert, which waits for the last holder's commit that gives
    // it up: what that holder saved in the same commit is seen. Here the
    // holder's last commit leaves an earlier answer still resuming, and
    // the save, begun before that commit, is refused as held back. (One
    // statement's parts would all read the snapshot from before the wait.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_taking_a_lease_sees_what_its_last_holder_committed_with_its_release() {
        let Some((db, _store, pool)) = pg("a_save_taking_a_lease_sees_its_last_holder").await else {
            return;
        };
        sqlx::query(
            "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
             decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, created_at, \
             updated_at) VALUES ('a0', 't', 'a0', 'f', 'a', 'i', 'e', 'confirm', '{}', '{}', 'pending', 'dec-a0', \
             'a0', 9, 1, 1)",
        )
        .execute(&pool)
        .await
        .expect("inserts");
        sqlx::query(
            "INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ('t', 'a', 'holder', $1)",
        )
        .bind(i64::MAX / 2)
        .execute(&pool)
        .await
        .expect("leases");
        let mut holder = pool.begin().await.expect("begins");
        sqlx::query("UPDATE operations SET state = 'delivering', resume_seq = 1 WHERE id = 'a0'")
            .execute(&mut *holder)
            .await
            .expect("the holder's last save");
        sqlx::query("DELETE FROM thread_leases WHERE thread_id = 'a'")
            .execute(&mut *holder)
            .await
            .expect("gives the lease up");
        let taking = tokio::spawn({
            let pool = pool.clone();
            async move {
                let mut answer = row("a", 0, None);
                answer[INBOX_ID_AT] = SaveValue::Int(Some(5));
                let take = TakeLease { owner: "w-a", now: 100, until: i64::MAX / 2 };
                execute(&pool, &[&answer], &[LeaseWith { release: None, take: Some(take) }])
                    .await
                    .expect("runs")
            }
        });
        // The save waits on the holder's uncommitted delete of the lease.
        let start = std::time::Instant::now();
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .expect("reads");
            if waiting > 0 {
                break;
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(20), "the save never waited");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        holder.commit().await.expect("the holder commits");
        let saved = taking.await.expect("the save ends");
        assert_eq!(saved, vec![(false, false)], "refused: an earlier answer of the thread is still resuming");
        let version: i64 = sqlx::query_scalar("SELECT version FROM operations WHERE id = 'a'")
            .fetch_one(&pool)
            .await
            .expect("reads");
        assert_eq!(version, 0);
        assert!(
            sqlx::query_scalar::<_, String>("SELECT owner FROM thread_leases")
                .fetch_all(&pool)
                .await
                .expect("reads")
                .is_empty(),
            "and leaves no lease"
        );
        db.drop().await;
    }

    // Through the queue (batches sorted by operation, a refused batch run
    // again save by save), each save's lease stays paired with its save:
    // 24 saves from as many callers at once share batches (at most
    // `RUNNERS` run at a time), every third thread has another step due,
    // and one save breaks the unique decision id (x holds dec-1).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_saves_give_up_their_own_leases() {
        let Some((db, store, pool)) = pg("queued_saves_give_up_their_own_leases").await else {
            return;
        };
        let threads: Vec<String> = (0..24).map(|i| format!("q{i:02}")).collect();
        for (i, thread) in threads.iter().enumerate() {
            for (id, due_at) in [(thread.clone(), None), (format!("{thread}-next"), Some(5))] {
                if due_at.is_some() && i % 3 != 0 {
                    continue;
                }
                sqlx::query(
                    "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, \
                     effect, decision_type, spec, decision_request, state, idempotency_key, deadline, created_at, \
                     updated_at, due_at) \
                     VALUES ($1, 't', $1, 'f', $2, 'i', 'e', 'confirm', '{}', '{}', 'pending', $1, 9, 1, 1, $3)",
                )
                .bind(&id)
                .bind(thread)
                .bind(due_at)
                .execute(&pool)
                .await
                .expect("inserts");
            }
            sqlx::query(
                "INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ('t', $1, $2, 9)",
            )
            .bind(thread)
            .bind(format!("w-{thread}"))
            .execute(&pool)
            .await
            .expect("leases");
        }
        let queue = store.pg_saves.clone().expect("a PostgreSQL store has a save queue");
        let mut callers = tokio::task::JoinSet::new();
        // In reverse order of id, so each batch's sort moves its saves.
        for (i, thread) in threads.iter().enumerate().rev() {
            let (queue, thread) = (Arc::clone(&queue), thread.clone());
            callers.spawn(async move {
                let values = row(&thread, 0, (i == 7).then_some("dec-1"));
                let saved = queue.save(values, LeaseWith::releasing(Some(&format!("w-{thread}")))).await;
                (i, saved.map_err(|e| e.to_string()))
            });
        }
        let mut outcomes = callers.join_all().await;
        outcomes.sort_by_key(|(i, _)| *i);
        for (i, outcome) in outcomes {
            match i {
                7 => assert!(outcome.is_err(), "{outcome:?}"),
                i => assert_eq!(outcome, Ok((true, i % 3 != 0)), "save {i}"),
            }
        }
        let leases: Vec<String> = sqlx::query_scalar("SELECT thread_id FROM thread_leases ORDER BY 1")
            .fetch_all(&pool)
            .await
            .expect("reads");
        let kept: Vec<&String> =
            threads.iter().enumerate().filter(|(i, _)| i % 3 == 0 || *i == 7).map(|(_, t)| t).collect();
        assert_eq!(leases.iter().collect::<Vec<_>>(), kept, "the failed save's, and those with a step due");
        db.drop().await;
    }

    // Within one statement, a save from a version an earlier row moved is
    // dropped alone (its call still recorded); the rows after it run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_save_in_a_batch_is_dropped_alone() {
        let Some((db, _store, pool)) = pg("a_stale_save_in_a_batch_is_dropped_alone").await else {
            return;
        };
        let rows = [row("a", 0, None), row("a", 0, None), row("c", 0, None)];
        let refs: Vec<&[SaveValue]> = rows.iter().map(Vec::as_slice).collect();
        let saved = execute(&pool, &refs, &[LeaseWith::default(); 3]).await.expect("runs");
        assert_eq!(saved, vec![(true, false), (false, false), (true, false)]);
        assert_eq!(calls(&pool).await, vec![("a".into(), 2), ("c".into(), 1)]);
        db.drop().await;
    }

    // The rows a batch carries go in by one statement per table: the
    // transitions of the saves that took only, in the batch's order and
    // each save's own; the delivery attempts of every save, taken or not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_records_the_transitions_of_the_saves_that_took_in_order() {
        let Some((db, _store, pool)) = pg("a_batch_records_the_transitions_in_order").await else {
            return;
        };
        let carrying = |id: &str, version: i64, steps: &[&str]| {
            let mut r = row(id, version, None);
            let transitions: Vec<Value> = steps
                .iter()
                .map(|to| serde_json::json!({"from": "pending", "to": to, "at": 5, "cause": id, "actor": "test"}))
                .collect();
            r[24] = SaveValue::Text(Some(Value::Array(transitions).to_string().into()));
            r[25] = SaveValue::Text(Some(
                format!(r#"[{{"operation_id":"{id}","attempt":{version},"started_at":1}}]"#).into(),
            ));
            r
        };
        let rows = [
            carrying("a", 0, &["answered", "permitted"]),
            carrying("a", 0, &["stale"]),
            carrying("b", 0, &["answered"]),
            carrying("c", 0, &["expired", "archived", "gone"]),
        ];
        let refs: Vec<&[SaveValue]> = rows.iter().map(Vec::as_slice).collect();
        let saved: Vec<bool> = execute(&pool, &refs, &[LeaseWith::default(); 4])
            .await
            .expect("runs")
            .into_iter()
            .map(|s| s.0)
            .collect();
        assert_eq!(saved, vec![true, false, true, true]);
        let transitions: Vec<(String, String)> =
            sqlx::query_as("SELECT operation_id, to_state FROM transitions ORDER BY id")
                .fetch_all(&pool)
                .await
                .expect("reads");
        let expected = [
            ("a", "answered"),
            ("a", "permitted"),
            ("b", "answered"),
            ("c", "expired"),
            ("c", "archived"),
            ("c", "gone"),
        ];
        assert_eq!(transitions, expected.map(|(o, t)| (o.to_owned(), t.to_owned())));
        let deliveries: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(&pool).await.expect("reads");
        assert_eq!(deliveries, 4, "every save's delivery attempt is recorded, the stale one's too");
        db.drop().await;
    }

    // The second look for the operations of stored callbacks
    // (`Store::mark_stored_unmarked`) reads the rows it is given by their
    // key, however many callbacks wait: never through the index of every
    // waiting row, which PostgreSQL chose, its statistics behind, while
    // the text named the state beside the ids.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_second_look_reads_its_rows_by_key_not_every_waiting_callback() {
        let Some((db, _store, pool)) = pg("the_second_look_reads_its_rows_by_key").await else {
            return;
        };
        sqlx::query(
            "INSERT INTO inbox (tenant, correlation_id, answer, body, body_sha256, source, state, received_at) \
             SELECT 't', 'dec_' || g, 'approve', '\\x00', 'h', 'pushary', 'new', g \
             FROM generate_series(1, 60000) AS g",
        )
        .execute(&pool)
        .await
        .expect("fills the inbox");
        let ids: Vec<i64> = (59_000..59_256).collect();
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN {}",
            crate::store::db::MARK_STORED_UNMARKED
        )))
        .bind(&ids)
        .fetch_all(&pool)
        .await
        .expect("explains");
        let plan = plan.join("\n");
        assert!(plan.contains("inbox_pkey"), "{plan}");
        for every in ["inbox_new_received", "Seq Scan on inbox"] {
            assert!(!plan.contains(every), "the plan reads every waiting callback: {plan}");
        }
        db.drop().await;
    }

    // Through the queue: saves from many tasks at once all land, each once,
    // in batches of more than one save.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_saves_from_many_callers_each_take_once() {
        let Some((db, store, pool)) = pg("queued_saves_from_many_callers_each_take_once").await else {
            return;
        };
        let queue = store.pg_saves.clone().expect("a PostgreSQL store has a save queue");
        let mut callers = tokio::task::JoinSet::new();
        for id in ["a", "b", "c", "d"] {
            for _ in 0..8 {
                let queue = Arc::clone(&queue);
                callers.spawn(async move {
                    (id, queue.save(row(id, 0, None), LeaseWith::default()).await.expect("saves").0)
                });
            }
        }
        let mut won: Vec<&str> =
            callers.join_all().await.into_iter().filter(|(_, saved)| *saved).map(|(id, _)| id).collect();
        won.sort_unstable();
        assert_eq!(won, vec!["a", "b", "c", "d"], "exactly one of each operation's eight saves takes");
        assert_eq!(calls(&pool).await.iter().map(|c| c.1).sum::<i64>(), 32, "every save's call is recorded");
        // 32 saves, at most RUNNERS statements at once: some shared one.
        let statements: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT DISTINCT xmin FROM pushary_calls) AS transactions",
        )
        .fetch_one(&pool)
        .await
        .expect("reads");
        assert!(statements < 32, "the saves were batched: {statements} transactions for 32 saves");
        db.drop().await;
    }

    #[test]
    fn every_column_has_a_type_and_the_function_names_no_parameter() {
        assert_eq!(SAVE_COLUMNS.len(), TYPES.len());
        assert_eq!(SAVE_COLUMNS[18], "id", "operation_id reads the 19th value");
        // The flags are booleans (the texts test them bare), the JSON
        // arrays and ids text, the times and counts bigint.
        for (column, ty) in SAVE_COLUMNS.iter().zip(TYPES) {
            let expected = match *column {
                "clear_inbox_at" | "opened_now" | "release_next" => "boolean",
                c if c.ends_with("_at") || c.ends_with("_inflight") || c.ends_with("attempts") => "bigint",
                "version" | "resume_seq" | "inbox_id" | "seq" => "bigint",
                _ => "text",
            };
            assert_eq!(ty, expected, "{column}");
        }
        let text = setup();
        // `$fn$` quotes the body; no `$n` parameter is left in it.
        let body = text.split("$fn$").nth(1).expect("a quoted body");
        assert!(!body.contains('$'), "{body}");
        assert!(
            body.contains(
                "WHERE operations.id = b.id AND operations.version = b.version AND NOT b.seq = ANY(refused) \
                 RETURNING b.seq"
            ),
            "{body}"
        );
    }

    #[test]
    fn a_batch_runs_only_the_statements_its_saves_carry_rows_for() {
        let at = [TRANSITIONS_AT, DELIVERIES_AT, CALLS_AT, RELEASE_NEXT_AT, INBOX_ID_AT];
        let named: Vec<&str> = at.iter().map(|&i| SAVE_COLUMNS[i]).collect();
        assert_eq!(named, ["transitions", "deliveries", "calls", "release_next", "inbox_id"]);
        let with = |mut r: Vec<SaveValue>, i: usize, v: SaveValue| {
            r[i] = v;
            r
        };
        let text = |t: &str| SaveValue::Text(Some(t.into()));
        // `row` records one call and nothing else.
        let lone = row("a", 0, None);
        assert_eq!(carries(&[&lone]), CALLS);
        let quiet = || with(row("b", 0, None), CALLS_AT, text("[]"));
        assert_eq!(carries(&[&quiet()]), 0);
        let moved = with(quiet(), TRANSITIONS_AT, text(r#"[{"from":"a","to":"b"}]"#));
        let delivered = with(quiet(), DELIVERIES_AT, text(r#"[{"attempt":1}]"#));
        assert_eq!(carries(&[&quiet(), &moved]), TRANSITIONS);
        assert_eq!(carries(&[&moved, &delivered]), TRANSITIONS | DELIVERIES);
        let releasing = with(quiet(), RELEASE_NEXT_AT, SaveValue::Int(Some(1)));
        let consuming = with(quiet(), INBOX_ID_AT, SaveValue::Int(Some(7)));
        assert_eq!(carries(&[&releasing]), AFTER);
        assert_eq!(carries(&[&consuming]), AFTER);
        assert_eq!(
            carries(&[&lone, &moved, &delivered, &consuming]),
            CALLS | TRANSITIONS | DELIVERIES | AFTER
        );
        // A save that releases nothing and consumed no inbox row runs no loop.
        assert_eq!(carries(&[&with(quiet(), INBOX_ID_AT, SaveValue::Int(None))]), 0);
    }

    /// A queue whose pool reaches no server: every statement fails at once.
    fn unreachable_queue() -> Arc<PgSaveQueue> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_millis(200))
            .connect_lazy("postgres://approvald@127.0.0.1:1/none")
            .expect("a lazy pool");
        PgSaveQueue::new(pool)
    }

    // A runner that ends without taking the last batch (its runtime shut
    // down mid-batch) gives its place back: the next save starts a runner.
    #[tokio::test]
    async fn a_runner_dropped_mid_batch_gives_its_place_back() {
        let queue = unreachable_queue();
        queue.lock().running = 1;
        drop(RunnerPlace { queue: Arc::clone(&queue), given_back: false });
        assert_eq!(queue.lock().running, 0);
        drop(RunnerPlace { queue: Arc::clone(&queue), given_back: true });
        assert_eq!(queue.lock().running, 0, "a place given back by `take` is not given back twice");
    }

    // A runner that panics hands the saves queued behind it to a new
    // runner, which answers them (here with the unreachable store's error)
    // and then gives its place back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_runner_is_replaced_and_the_queue_still_answered() {
        let queue = unreachable_queue();
        let (reply, answer) = oneshot::channel();
        {
            let mut waiting = queue.lock();
            waiting.running = 1;
            waiting.saves.push_back(Pending {
                values: test_rows::row("a", 0, None),
                release: None,
                take: None,
                reply,
                queued: std::time::Instant::now(),
            });
        }
        let doomed = Arc::clone(&queue);
        let ended = tokio::spawn(async move {
            let _place = RunnerPlace { queue: doomed, given_back: false };
            panic!("a bug in a runner");
        })
        .await;
        assert!(ended.is_err_and(|e| e.is_panic()));
        let answered = tokio::time::timeout(std::time::Duration::from_secs(20), answer)
            .await
            .expect("the queued save is answered")
            .expect("by the new runner");
        assert!(answered.is_err(), "the store is unreachable: {answered:?}");
        let start = std::time::Instant::now();
        while queue.lock().running != 0 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(20),
                "the new runner never gave its place back"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    #[test]
    fn the_batch_names_each_value_and_its_place() {
        let mut row: Vec<SaveValue> = SAVE_COLUMNS[..32].iter().map(|_| SaveValue::Text(None)).collect();
        row[18] = SaveValue::Text(Some("op-1".into())); // id
        row[19] = SaveValue::Int(Some(3)); // version
        row[21] = SaveValue::Int(Some(1)); // clear_inbox_at
        row[27] = SaveValue::Int(Some(0)); // release_next
        let json: Value =
            serde_json::from_str(&batch_json(&[&row, &row], &[None, Some("w-1")].map(LeaseWith::releasing)))
                .expect("JSON");
        assert_eq!(json[1]["id"], "op-1");
        assert_eq!(json[1]["version"], 3);
        assert_eq!(json[1]["clear_inbox_at"], true);
        assert_eq!(json[1]["release_next"], false);
        assert_eq!(json[1]["state"], Value::Null);
        assert_eq!((json[0]["seq"].clone(), json[1]["seq"].clone()), (Value::from(0), Value::from(1)));
        assert_eq!((json[0].get("release_owner"), &json[1]["release_owner"]), (None, &Value::from("w-1")));
    }
}
