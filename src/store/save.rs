//! `Store::save`: one step of an operation, recorded atomically with its
//! transitions, the inbox row it consumed, the Pushary calls and delivery
//! attempt it made, and the release of the thread's next held-back answer.
//!
//! It is the hottest write (four or five per approval), so on both engines
//! the saves queued while others run go in together (docs/decisions.md §15,
//! §16, §19): one statement for a batch of saves, whose trigger (SQLite,
//! save/sqlite.rs) or function (PostgreSQL, save/postgres.rs) does each
//! save's work, written once here as macros with `$n` for the n-th value.
//! The JSON-array values (transitions, calls, deliveries) keep the texts
//! few and fixed, each prepared once per connection.

use serde_json::{Value, json};

use super::StoreError;
use super::db::{Backend, Store};
use super::rows::{InboxEntry, Operation, Transition};
use crate::domain::state::State;

/// The compare-and-set of the operation row. `inbox_at` (an answer waits
/// for this operation) is cleared with the inbox row the save consumes,
/// and set when a decision id is recorded for which an answer already
/// waits (it arrived before the id). The row's own columns are named with
/// the table's name, since PostgreSQL's batch joins the saves' rows, which
/// have columns of the same names.
macro_rules! update_operation {
    // The update without its condition: PostgreSQL's batch puts the rows
    // it joins between the two (save/postgres.rs).
    (set) => {
        "UPDATE operations SET state = $1, decision_id = $2, answer = $3, permit_id = $4, delivery = $5, \
         outcome_status = $6, result = $7, receipt = $8, receipt_outcome = $9, consume_inflight = $10, \
         consume_attempts = $11, delivery_inflight = $12, attempts = $13, last_error = $14, due_at = $15, \
         poll_at = $16, opened_at = $17, updated_at = $18, resume_seq = $21, \
         version = operations.version + 1, \
         inbox_at = CASE WHEN $22 THEN NULL \
           WHEN $23 AND operations.inbox_at IS NULL THEN (SELECT i.received_at FROM inbox i \
             WHERE i.tenant = $24 AND i.correlation_id = $2 AND i.state = 'new') \
           ELSE operations.inbox_at END"
    };
    (condition) => {
        "operations.id = $19 AND operations.version = $20"
    };
    () => {
        concat!(update_operation!(set), " WHERE ", update_operation!(condition))
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

mod postgres;
mod sqlite;
pub(super) use postgres::{PgSaveQueue, make_function, refused_by_database, run_in};
pub(super) use sqlite::{SaveQueue, run_in_turn as run_in_sqlite_turn};
use std::sync::Arc;

/// What a save binds, in `bind_all!`'s order (`$n` is the n-th), then its
/// place in its batch: the columns of SQLite's save table and the fields
/// of PostgreSQL's batch rows, which the two engines' save texts name in
/// place of `$n` (`params_as_fields`).
const SAVE_COLUMNS: [&str; 33] = [
    "state",
    "decision_id",
    "answer",
    "permit_id",
    "delivery",
    "outcome_status",
    "result",
    "receipt",
    "receipt_outcome",
    "consume_inflight",
    "consume_attempts",
    "delivery_inflight",
    "attempts",
    "last_error",
    "due_at",
    "poll_at",
    "opened_at",
    "updated_at",
    "id",
    "version",
    "resume_seq",
    "clear_inbox_at",
    "opened_now",
    "tenant",
    "transitions",
    "deliveries",
    "calls",
    "release_next",
    "inbox_id",
    "thread_id",
    "inbox_state",
    "inbox_note",
    "seq",
];

/// `$n` → `<prefix><the n-th of SAVE_COLUMNS>`: a trigger or a function
/// reads a row's fields, not parameters. A `$` not followed by a
/// parameter's number (`'$.from'`, a JSON path) is kept as it is.
fn params_as_fields(sql: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(sql.len() * 2);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..].bytes().take_while(u8::is_ascii_digit).count();
        match rest[at + 1..at + 1 + digits].parse::<usize>() {
            Ok(n) if (1..SAVE_COLUMNS.len()).contains(&n) => {
                out.push_str(prefix);
                out.push_str(SAVE_COLUMNS[n - 1]);
            }
            _ => out.push_str(&rest[at..at + 1 + digits]),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// A value of a save's row, owned: it is bound by the task that runs the
/// batch, after its caller has moved on to waiting. Text is shared, so
/// binding it (again, if the batch is re-run save by save) copies nothing.
#[derive(Debug)]
pub(crate) enum SaveValue {
    Text(Option<Arc<str>>),
    Int(Option<i64>),
}

/// Collects what `bind_all!` binds, in its order.
#[derive(Debug, Default)]
pub(crate) struct Values(pub(crate) Vec<SaveValue>);

impl Values {
    pub(crate) fn bind(mut self, v: impl Into<SaveValue>) -> Self {
        self.0.push(v.into());
        self
    }
}

impl From<&str> for SaveValue {
    fn from(v: &str) -> Self {
        SaveValue::Text(Some(v.into()))
    }
}
impl From<&String> for SaveValue {
    fn from(v: &String) -> Self {
        SaveValue::Text(Some(v.as_str().into()))
    }
}
impl From<&Option<String>> for SaveValue {
    fn from(v: &Option<String>) -> Self {
        SaveValue::Text(v.as_deref().map(Arc::from))
    }
}
impl From<Option<&str>> for SaveValue {
    fn from(v: Option<&str>) -> Self {
        SaveValue::Text(v.map(Arc::from))
    }
}
impl From<i64> for SaveValue {
    fn from(v: i64) -> Self {
        SaveValue::Int(Some(v))
    }
}
impl From<Option<i64>> for SaveValue {
    fn from(v: Option<i64>) -> Self {
        SaveValue::Int(v)
    }
}
impl From<bool> for SaveValue {
    fn from(v: bool) -> Self {
        SaveValue::Int(Some(i64::from(v)))
    }
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

/// The values of a save of `op` (`bind_all!`): its transitions, and the
/// inbox entry it settles (`(id, state, note)`).
pub(super) fn save_values(
    op: &Operation,
    transitions: &[Transition],
    inbox: Option<(i64, &str, Option<&str>)>,
) -> Values {
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
    bind_all!(Values::default(), op, x)
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
        self.save_held_releasing(op, transitions, inbox, LeaseWith::default()).await.map(|(saved, _)| saved)
    }

    /// `save_held`, which on PostgreSQL also gives up the thread's lease
    /// held by `release` (its owner) if, the save made, none of the
    /// thread's operations has a step due (now or later) or an answer
    /// waiting: what the visit's last read would have found before giving
    /// it up (decisions §34); and takes the lease first, if `lease` says so
    /// (`TakeLease`, §35). Returns whether the save took and whether the
    /// lease went; SQLite takes no lease rows (§14) and gives up none.
    pub async fn save_held_releasing(
        &self,
        op: &mut Operation,
        transitions: &[Transition],
        inbox: Option<(i64, &str, Option<&str>)>,
        lease: LeaseWith<'_>,
    ) -> Result<(bool, bool), StoreError> {
        let values = save_values(op, transitions, inbox);
        let (saved, released) = match &self.backend {
            Backend::Postgres(_) => {
                let queue = self.pg_saves.as_ref().expect("a PostgreSQL store has a save queue");
                queue.save(values.0, lease).await?
            }
            Backend::Sqlite(_) => {
                let queue = self.sqlite_saves.as_ref().expect("a SQLite store has a save queue");
                (queue.save(values).await?, false)
            }
        };
        recorded(op, saved);
        Ok((saved, released))
    }
}

/// What a worker's save does with its thread's lease, on PostgreSQL.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseWith<'a> {
    /// Give up the lease held by this owner if, the save made, nothing is
    /// left on the thread (decisions §34).
    pub release: Option<&'a str>,
    /// Take the lease before the save, which is made only if it was.
    pub take: Option<TakeLease<'a>>,
}

#[cfg(test)]
impl<'a> LeaseWith<'a> {
    pub fn releasing(owner: Option<&'a str>) -> Self {
        Self { release: owner, take: None }
    }
}

/// The lease of the saved operation's thread, taken in the save's own
/// transaction (decisions §35): by the first save of an answer handed to
/// a worker with its operation by the inbox's statement, which is then
/// made only if the thread was free (or its lease had run out), no other
/// answer waits on the thread and no earlier answer of it still has
/// resume work (held back). Refused, the save changes nothing and leaves
/// no lease: it reports that it did not take, and the worker reads the
/// thread as any visit does. Each check runs after the lease's insert,
/// on a snapshot of its own, so it sees the last holder's saves.
#[derive(Debug, Clone, Copy)]
pub struct TakeLease<'a> {
    pub owner: &'a str,
    pub now: i64,
    pub until: i64,
}

/// An answer's first save made in the transaction that stores its
/// callback, on PostgreSQL (decisions §36): the operation as the answer
/// and the decision on it leave it, the transitions to record, the note
/// that settles the answer's inbox row, and the thread's lease to take
/// (`owner`, from `now` to `until`), refused as `TakeLease` is.
#[derive(Debug, Clone)]
pub struct AnswerSave {
    pub op: Operation,
    pub transitions: Vec<Transition>,
    pub note: &'static str,
    pub owner: String,
    pub now: i64,
    pub until: i64,
}

/// Asked by the inbox, for each answer it stores for a pending operation
/// (one per thread of the batch), the save that applies it, if any.
pub trait FirstSave: Send + Sync {
    fn first_save(&self, entry: &InboxEntry, op: &Operation) -> Option<AnswerSave>;

    /// SQLite: a save `first_save` gave was not made, or its commit
    /// failed. Whatever was held for it (the thread's claim, decisions
    /// §38) goes. PostgreSQL's saves give their leases back themselves.
    fn not_made(&self, save: &AnswerSave);
}

pub type FirstSaves<'a> = &'a dyn FirstSave;

/// An answer applied in its callback's commit: its entry as stored, and
/// its save as made (the operation's version bumped; the lease taken).
#[derive(Debug, Clone)]
pub struct Applied {
    pub entry: InboxEntry,
    pub save: AnswerSave,
}

/// What a save leaves on `op`: its calls and delivery attempt recorded
/// (whether it took or not), and, if it took, its version moved on.
fn recorded(op: &mut Operation, saved: bool) {
    op.unrecorded_delivery = None;
    op.unrecorded_calls.clear();
    if saved {
        op.version += 1;
    }
}

impl Applied {
    /// The values of its first save: the answer applied, its inbox row
    /// settled.
    pub(super) fn values(&self) -> Values {
        save_values(
            &self.save.op,
            &self.save.transitions,
            Some((self.entry.id, "processed", Some(self.save.note))),
        )
    }

    /// Its first save took: the operation as it now stands.
    pub(super) fn saved(&mut self) {
        recorded(&mut self.save.op, true);
    }
}

/// What the two engines' batch tests share: a save's values, and what a
/// batch that holds a failing save must leave.
#[cfg(test)]
mod test_rows {
    use std::sync::Arc;

    use super::{SAVE_COLUMNS, SaveValue};

    /// A save of `id` (its own thread, tenant `t`) from `version`,
    /// recording one call.
    pub(super) fn row(id: &str, version: i64, decision_id: Option<&str>) -> Vec<SaveValue> {
        SAVE_COLUMNS[..32]
            .iter()
            .map(|c| match *c {
                "state" => SaveValue::Text(Some("pending".into())),
                "decision_id" => SaveValue::Text(decision_id.map(Arc::from)),
                "last_error" => SaveValue::Text(Some(format!("saved from {version}").into())),
                "consume_inflight" | "consume_attempts" | "delivery_inflight" | "attempts" => {
                    SaveValue::Int(Some(0))
                }
                "clear_inbox_at" | "opened_now" | "release_next" => SaveValue::Int(Some(0)),
                "updated_at" => SaveValue::Int(Some(2)),
                "id" | "thread_id" => SaveValue::Text(Some(id.into())),
                "tenant" => SaveValue::Text(Some("t".into())),
                "version" => SaveValue::Int(Some(version)),
                "transitions" | "deliveries" => SaveValue::Text(Some("[]".into())),
                "calls" => SaveValue::Text(Some(
                    format!(r#"[{{"operation_id":"{id}","call":"create_decision","started_at":1,"duration_ms":1}}]"#)
                        .into(),
                )),
                _ => SaveValue::Text(None),
            })
            .collect()
    }

    /// The five saves both engines' tests batch: two that take, one that
    /// breaks the unique decision id, one from a version the first moved,
    /// one more that takes.
    pub(super) fn five() -> [Vec<SaveValue>; 5] {
        [
            row("a", 0, None),
            row("b", 0, Some("dec-1")),
            row("c", 0, None),
            row("a", 0, None),
            row("d", 0, None),
        ]
    }

    /// What `five` must come to: the failing save gets the error
    /// (`unique`, the engine's word for it) and leaves nothing; the stale
    /// one is told so; the rest commit. `ops` and `calls` are read back.
    pub(super) fn assert_isolated(
        outcomes: &[Result<bool, String>],
        unique: &str,
        ops: &[(String, i64, Option<String>)],
        calls: &[(String, i64)],
    ) {
        assert_eq!(outcomes[0], Ok(true));
        assert!(outcomes[1].as_ref().is_err_and(|e| e.contains(unique)), "{:?}", outcomes[1]);
        assert_eq!(outcomes[2..], [Ok(true), Ok(false), Ok(true)]);
        let saved = Some("saved from 0".to_string());
        assert_eq!(
            ops,
            [
                ("a".into(), 1, saved.clone()),
                ("b".into(), 0, None),
                ("c".into(), 1, saved.clone()),
                ("d".into(), 1, saved)
            ]
        );
        assert_eq!(
            calls,
            [("a".into(), 2), ("c".into(), 1), ("d".into(), 1)],
            "the stale save's call is recorded"
        );
    }
}
