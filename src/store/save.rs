//! `Store::save`: one step of an operation, recorded atomically with its
//! transitions, the inbox row it consumed, the Pushary calls and delivery
//! attempt it made, and the release of the thread's next held-back answer.
//!
//! It is the hottest write (four or five per approval), so each engine
//! gets the fewest round trips it allows (docs/decisions.md §15): on
//! PostgreSQL one statement of data-modifying CTEs, committed on its own
//! (no BEGIN/COMMIT round trips); on SQLite one statement, whose trigger
//! does the work, for every save queued by then (save/sqlite.rs: each
//! statement is a hand-off to sqlx's connection thread and back, which
//! every other writer waits behind). Rows of any number go in as one JSON
//! array parameter, so the statement texts are few and fixed, each
//! prepared once per connection.

use serde_json::{Value, json};
use sqlx::Row as _;

use super::StoreError;
use super::db::{Backend, Store};
use super::rows::{Operation, Transition};
use crate::domain::state::State;

/// The compare-and-set of the operation row. `inbox_at` (an answer waits
/// for this operation) is cleared with the inbox row the save consumes,
/// and set when a decision id is recorded for which an answer already
/// waits (it arrived before the id).
macro_rules! update_operation {
    () => {
        "UPDATE operations SET state = $1, decision_id = $2, answer = $3, permit_id = $4, delivery = $5, \
         outcome_status = $6, result = $7, receipt = $8, receipt_outcome = $9, consume_inflight = $10, \
         consume_attempts = $11, delivery_inflight = $12, attempts = $13, last_error = $14, due_at = $15, \
         poll_at = $16, opened_at = $17, updated_at = $18, resume_seq = $21, version = version + 1, \
         inbox_at = CASE WHEN $22 THEN NULL \
           WHEN $23 AND inbox_at IS NULL THEN (SELECT i.received_at FROM inbox i \
             WHERE i.tenant = $24 AND i.correlation_id = $2 AND i.state = 'new') \
           ELSE inbox_at END \
         WHERE id = $19 AND version = $20"
    };
}

/// The thread's next answer held back behind this one may go, once no
/// other answer of the thread has resume work left (the saved operation
/// has none: this runs only when it is finished).
macro_rules! release_next_answer {
    ($id:literal, $tenant:literal, $thread:literal, $now:literal) => {
        concat!(
            "UPDATE operations SET due_at = ",
            $now,
            " WHERE id = ( \
               SELECT c.id FROM operations c WHERE c.tenant = ",
            $tenant,
            " AND c.thread_id = ",
            $thread,
            " AND c.id <> ",
            $id,
            " AND c.resume_seq IS NOT NULL AND c.due_at IS NULL \
                 AND (c.state IN ('answered', 'permitted', 'delivering') OR c.delivery = 'pending') \
               ORDER BY c.resume_seq LIMIT 1) \
             AND NOT EXISTS (SELECT 1 FROM operations e WHERE e.tenant = ",
            $tenant,
            " AND e.thread_id = ",
            $thread,
            " AND e.id <> ",
            $id,
            " AND e.resume_seq IS NOT NULL AND e.due_at IS NOT NULL \
               AND (e.state IN ('answered', 'permitted', 'delivering') OR e.delivery = 'pending'))"
        )
    };
}

mod sqlite;
pub(super) use sqlite::SaveQueue;

/// PostgreSQL: everything in one statement, so one round trip and one
/// implicit transaction. Sub-statements share one snapshot, which is why
/// the release of the next answer names the saved operation (`<> $19`)
/// instead of reading its new state.
const PG_UPDATE: &str = concat!("WITH u AS (", update_operation!(), " RETURNING id)");
const PG_DELIVERIES: &str = ", d AS (INSERT INTO deliveries (operation_id, attempt, started_at, duration_ms, \
       status_code, error, response_body) SELECT r.operation_id, r.attempt, r.started_at, r.duration_ms, \
       r.status_code, r.error, r.response_body FROM jsonb_to_recordset($26::text::jsonb) AS r(operation_id text, \
       attempt bigint, started_at bigint, duration_ms bigint, status_code bigint, error text, response_body text))";
const PG_CALLS: &str = ", c AS (INSERT INTO pushary_calls (operation_id, call, started_at, duration_ms, status_code, \
       error) SELECT r.operation_id, r.call, r.started_at, r.duration_ms, r.status_code, r.error \
       FROM jsonb_to_recordset($27::text::jsonb) AS r(operation_id text, call text, started_at bigint, \
       duration_ms bigint, status_code bigint, error text))";
const PG_TRANSITIONS: &str = ", t AS (INSERT INTO transitions (operation_id, from_state, to_state, at, cause, actor) \
       SELECT u.id, r.\"from\", r.\"to\", r.at, r.cause, r.actor FROM u, \
       jsonb_to_recordset($25::text::jsonb) AS r(\"from\" text, \"to\" text, at bigint, cause text, actor text))";
const PG_RELEASE: &str = concat!(
    ", n AS (",
    release_next_answer!("$19", "$24", "$30", "$18"),
    " AND $28 AND EXISTS (SELECT 1 FROM u))"
);
const PG_INBOX: &str = ", i AS (UPDATE inbox SET state = $31, note = $32, operation_id = $19, processed_at = $18 \
       WHERE id = $29 AND EXISTS (SELECT 1 FROM u))";

/// The PostgreSQL save with only the sub-statements this one needs
/// (`parts`: deliveries, calls, transitions, release, inbox, as bits).
/// Every sub-statement is a table opened with all its indexes, a plan node
/// set up and a trigger queue run on every execution, written rows or not:
/// `perf` put a fifth of PostgreSQL's time in executor start and finish.
/// The 32 texts are built once; each is prepared once per connection.
fn pg_save(parts: usize) -> &'static str {
    static TEXTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let texts = TEXTS.get_or_init(|| {
        (0..32)
            .map(|bits: usize| {
                let mut sql = String::from(PG_UPDATE);
                for (bit, part) in
                    [PG_DELIVERIES, PG_CALLS, PG_TRANSITIONS, PG_RELEASE, PG_INBOX].iter().enumerate()
                {
                    if bits & (1 << bit) != 0 {
                        sql.push_str(part);
                    }
                }
                sql.push_str(" SELECT count(*) AS saved FROM u");
                sql
            })
            .collect()
    });
    &texts[parts & 31]
}

fn transitions_json(transitions: &[Transition]) -> String {
    Value::Array(
        transitions
            .iter()
            .map(|t| json!({"from": t.from, "to": t.to, "at": t.at, "cause": t.cause, "actor": t.actor}))
            .collect(),
    )
    .to_string()
}

fn unrecorded_json(op: &Operation) -> (String, String) {
    let deliveries: Vec<Value> = op
        .unrecorded_delivery
        .iter()
        .map(|d| {
            json!({"operation_id": d.operation_id, "attempt": d.attempt, "started_at": d.started_at,
                "duration_ms": d.duration_ms, "status_code": d.status_code, "error": d.error,
                "response_body": d.response_body})
        })
        .collect();
    let calls: Vec<Value> = op
        .unrecorded_calls
        .iter()
        .map(|c| {
            json!({"operation_id": c.operation_id, "call": c.call, "started_at": c.started_at,
                "duration_ms": c.duration_ms, "status_code": c.status_code, "error": c.error})
        })
        .collect();
    (Value::Array(deliveries).to_string(), Value::Array(calls).to_string())
}

/// What a save binds besides the operation's columns.
struct Extras<'a> {
    /// The save consumes an inbox entry: no answer waits any more.
    clear_inbox_at: bool,
    /// A decision id is being recorded: an answer may already wait for it.
    opened_now: bool,
    transitions: String,
    deliveries: String,
    calls: String,
    release_next: bool,
    inbox_id: Option<i64>,
    inbox_state: Option<&'a str>,
    inbox_note: Option<&'a str>,
}

/// Binds `$1`–`$32`, the same on both engines.
macro_rules! bind_all {
    ($q:expr, $op:expr, $x:expr) => {
        $q.bind($op.state.as_str())
            .bind(&$op.decision_id)
            .bind(&$op.answer)
            .bind(&$op.permit_id)
            .bind(&$op.delivery)
            .bind(&$op.outcome_status)
            .bind(&$op.result)
            .bind(&$op.receipt)
            .bind(&$op.receipt_outcome)
            .bind(i64::from($op.consume_inflight))
            .bind($op.consume_attempts)
            .bind(i64::from($op.delivery_inflight))
            .bind($op.attempts)
            .bind(&$op.last_error)
            .bind($op.due_at)
            .bind($op.poll_at)
            .bind($op.opened_at)
            .bind($op.updated_at)
            .bind(&$op.id)
            .bind($op.version)
            .bind($op.resume_seq)
            .bind($x.clear_inbox_at)
            .bind($x.opened_now)
            .bind(&$op.tenant)
            .bind(&$x.transitions)
            .bind(&$x.deliveries)
            .bind(&$x.calls)
            .bind($x.release_next)
            .bind($x.inbox_id)
            .bind(&$op.thread_id)
            .bind($x.inbox_state)
            .bind($x.inbox_note)
    };
}

impl Store {
    /// Records `op` (compare-and-set on its version) with its transitions,
    /// the inbox entry it consumed (`(id, state, note)`), and the calls and
    /// delivery attempt noted on it. Returns false, changing nothing but
    /// the record of calls and attempts, if another writer moved `op` first.
    /// Workers on every replica are told when it leaves work due.
    pub async fn save(
        &self,
        op: &mut Operation,
        transitions: &[Transition],
        inbox: Option<(i64, &str, Option<&str>)>,
    ) -> Result<bool, StoreError> {
        let saved = self.save_held(op, transitions, inbox).await?;
        if saved && (op.due_at.is_some() || op.resume_seq.is_some()) {
            self.signal_work();
        }
        Ok(saved)
    }

    /// `save` by the worker holding the operation's thread, which goes on
    /// with the thread's due work itself: no other worker is told. On
    /// PostgreSQL telling them was a NOTIFY per save, and each woke a
    /// worker (on every replica) to read the work queue and find nothing
    /// it could take, as the thread is held.
    pub async fn save_held(
        &self,
        op: &mut Operation,
        transitions: &[Transition],
        inbox: Option<(i64, &str, Option<&str>)>,
    ) -> Result<bool, StoreError> {
        let (deliveries, calls) = unrecorded_json(op);
        let x = Extras {
            clear_inbox_at: inbox.is_some(),
            opened_now: op.state == State::Pending && op.decision_id.is_some(),
            transitions: transitions_json(transitions),
            deliveries,
            calls,
            release_next: op.resume_seq.is_some() && !op.unfinished(),
            inbox_id: inbox.map(|i| i.0),
            inbox_state: inbox.map(|i| i.1),
            inbox_note: inbox.and_then(|i| i.2),
        };
        let saved = match &self.backend {
            Backend::Postgres(pool) => {
                let parts = usize::from(op.unrecorded_delivery.is_some())
                    | usize::from(!op.unrecorded_calls.is_empty()) << 1
                    | usize::from(!transitions.is_empty()) << 2
                    | usize::from(x.release_next) << 3
                    | usize::from(inbox.is_some()) << 4;
                let row = bind_all!(sqlx::query(pg_save(parts)), op, x).fetch_one(pool).await?;
                row.try_get::<i64, _>("saved")? == 1
            }
            Backend::Sqlite(_) => {
                let queue = self.sqlite_saves.as_ref().expect("a SQLite store has a save queue");
                queue.save(bind_all!(sqlite::Values::default(), op, x)).await?
            }
        };
        op.unrecorded_delivery = None;
        op.unrecorded_calls.clear();
        if saved {
            op.version += 1;
        }
        Ok(saved)
    }
}
