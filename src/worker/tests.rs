//! How workers find work (decisions §33), on a real store: a thread named
//! while held is named again, the store is read only when told, a read
//! that held threads were hidden from is made again, and the tick keeper
//! sleeps until the next scheduled step.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::Notify;

use super::{Engine, EngineSettings, Missed};
use crate::clock::now_ms;
use crate::store::Store;
use crate::store::test_support::{ScratchPg, insert_operation, sqlite_store};

const HOUR: Duration = Duration::from_secs(3600);

fn engine(store: Store) -> Engine {
    let settings = EngineSettings {
        lease_ms: 30_000,
        retry_initial_ms: 20,
        retry_max_ms: 1_000,
        rejection_window_ms: 60_000,
        poll_after_ms: 3_600_000,
        orphan_after_ms: 3_600_000,
        archive_after_ms: None,
        reconcile_every: HOUR,
        concurrency: 0,
        idle_poll: HOUR,
    };
    let engine = Engine::new(store, HashMap::new(), settings, Arc::new(Notify::new()));
    engine.workers_here.store(true, Ordering::SeqCst);
    engine
}

/// Finished operations on `threads` whose `due_at` has come: a visit
/// only clears it.
async fn due_finished(pool: &sqlx::SqlitePool, threads: impl IntoIterator<Item = String>) {
    due_finished_at(pool, threads.into_iter().map(|t| (format!("op-{t}"), t)), 1).await;
}

/// Finished operations (id, thread) whose `due_at` is `at`.
async fn due_finished_at(pool: &sqlx::SqlitePool, ops: impl IntoIterator<Item = (String, String)>, at: i64) {
    let body = serde_json::json!({"operationKey": "k", "threadId": "x", "interruptId": "i", "effect": "orders",
        "externalId": "u", "question": "Proceed?", "toolName": "ship", "parameters": {}});
    let limits = crate::domain::operation::Limits { max_expires_in_secs: 3600 };
    let spec = crate::domain::operation::parse(&body, limits, 0).expect("a valid body");
    for (id, thread) in ops {
        insert_operation(pool, &id, &thread, None).await;
    }
    sqlx::query("UPDATE operations SET state = 'succeeded', due_at = $2, spec = $1 WHERE due_at IS NULL")
        .bind(serde_json::to_string(&spec).expect("serializes"))
        .bind(at)
        .execute(pool)
        .await
        .expect("due");
}

fn key(thread: &str) -> (String, String) {
    ("t".to_owned(), thread.to_owned())
}

/// Whether a wake-up is waiting for the workers (taking it).
async fn woken(engine: &Engine) -> bool {
    // `timeout` polls the future before its deadline.
    tokio::time::timeout(Duration::ZERO, engine.wake.notified()).await.is_ok()
}

fn queued(engine: &Engine) -> Vec<(String, String)> {
    engine.queue().iter().cloned().collect()
}

#[tokio::test]
async fn a_thread_named_while_held_is_named_again_when_let_go() {
    let (_dir, store, _pool) = sqlite_store().await;
    let engine = engine(store);
    engine.unread.store(false, Ordering::SeqCst);
    let claim = engine.claims.take(key("held")).expect("free");
    engine.offer(&[key("held")]);
    assert!(woken(&engine).await, "an offer wakes a worker");
    assert!(!engine.visit_next(false).await.expect("store"), "the thread is held: nothing visited");
    assert!(queued(&engine).is_empty(), "the worker took the name and found it held");
    engine.let_go(claim);
    assert_eq!(queued(&engine), [key("held")], "named again");
    assert!(woken(&engine).await, "and a worker woken for it");
}

#[tokio::test]
async fn a_worker_reads_the_store_for_work_only_when_told() {
    let (_dir, store, pool) = sqlite_store().await;
    due_finished(&pool, ["quiet".to_owned()]).await;
    let engine = engine(store);
    engine.unread.store(false, Ordering::SeqCst);
    assert!(!engine.visit_next(false).await.expect("store"), "not told: the store is not read");
    engine.wake();
    assert!(engine.visit_next(false).await.expect("store"), "told: the store is read, the thread visited");
    assert!(!engine.unread.load(Ordering::SeqCst), "one read answers one telling");
    assert!(engine.try_execute_task().await.is_ok_and(|visited| !visited), "nothing left");
}

#[tokio::test]
async fn a_read_that_fills_its_limit_leaves_the_store_to_be_read_again() {
    let (_dir, store, pool) = sqlite_store().await;
    due_finished(&pool, (0..20).map(|i| format!("thread-{i}"))).await;
    let engine = engine(store);
    assert!(engine.visit_next(false).await.expect("store"), "told at start");
    assert!(engine.unread.load(Ordering::SeqCst), "16 read of 20: there may be more");
    assert_eq!(queued(&engine).len(), 15, "the rest of the read wait their turn");
}

#[tokio::test]
async fn the_tick_keeper_sleeps_until_the_next_step_scheduled_for_later() {
    let (_dir, store, pool) = sqlite_store().await;
    let engine = engine(store);
    assert_eq!(engine.next_nap().await, HOUR, "nothing scheduled: the safety net");
    // Scheduled by another process: only the store knows it.
    insert_operation(&pool, "op-1", "elsewhere", None).await;
    let stored_at = now_ms() + 1_800_000;
    sqlx::query("UPDATE operations SET due_at = $1").bind(stored_at).execute(&pool).await.expect("due");
    let nap = engine.next_nap().await;
    assert!(nap <= Duration::from_secs(1800) && nap > Duration::from_secs(1790), "{nap:?}");
    // Scheduled here, sooner.
    let soon = now_ms() + 600_000;
    engine.scheduled(soon);
    let nap = engine.next_nap().await;
    assert!(nap <= Duration::from_secs(600) && nap > Duration::from_secs(590), "{nap:?}");
    // A step due already is its holder's (or a told worker's), not the keeper's.
    sqlx::query("UPDATE operations SET due_at = 1").execute(&pool).await.expect("due");
    assert!(engine.next_nap().await > Duration::from_secs(590));
}

#[tokio::test]
async fn a_step_scheduled_here_keeps_the_keeper_until_a_read_comes_after_it() {
    let (_dir, store, _pool) = sqlite_store().await;
    let engine = engine(store);
    let (passed, later) = (now_ms() + 2, now_ms() + 600_000);
    engine.scheduled(passed);
    engine.scheduled(later);
    // Its time passes while the keeper is busy: it wakes at once.
    let bound = std::time::Instant::now() + Duration::from_secs(5);
    while now_ms() <= passed {
        assert!(std::time::Instant::now() < bound, "the clock moves");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(engine.next_nap().await, Duration::from_millis(1), "overdue: look now");
    engine.wake();
    assert!(!engine.visit_next(false).await.expect("store"), "the read finds nothing left");
    assert_eq!(engine.schedule_lock().iter().copied().collect::<Vec<_>>(), [later], "the read came after it");
}

#[tokio::test]
async fn a_store_read_a_held_thread_was_hidden_from_is_made_again() {
    let Some(db) = ScratchPg::create("worker::tests::a_store_read_a_held_thread_was_hidden_from").await
    else {
        return;
    };
    let engine = engine(db.store.clone());
    // Its last read began before the store's: what woke that read may be
    // what it missed.
    let before = engine.claims.take(key("before")).expect("free");
    // Its last read began after the store's: it saw all that read could.
    let after = engine.claims.take(key("after")).expect("free");
    engine.wake();
    assert!(!engine.visit_next(false).await.expect("store"), "nothing to visit");
    assert!(!engine.unread.load(Ordering::SeqCst), "the read took the telling");
    after.reading();
    assert_eq!(after.release().1, Missed::Nothing);
    engine.let_go(before);
    assert!(engine.unread.load(Ordering::SeqCst), "read again");
    assert!(woken(&engine).await, "by a worker woken for it");
    drop(engine);
    db.drop().await;
}

#[tokio::test]
async fn a_process_without_workers_names_threads_to_no_one() {
    let (_dir, store, _pool) = sqlite_store().await;
    let engine = engine(store);
    engine.workers_here.store(false, Ordering::SeqCst);
    for i in 0..100 {
        engine.offer(&[key(&format!("thread-{i}"))]);
    }
    assert!(queued(&engine).is_empty(), "a receiver's offers would pile up in a queue no one takes from");
    assert!(!woken(&engine).await);
}

#[tokio::test]
async fn a_read_filled_by_one_threads_steps_leaves_the_store_to_be_read_again() {
    let (_dir, store, pool) = sqlite_store().await;
    due_finished_at(&pool, (0..20).map(|i| (format!("op-{i}"), "busy".to_owned())), 1).await;
    due_finished_at(&pool, [("op-late".to_owned(), "waiting".to_owned())], 2).await;
    let engine = engine(store);
    let held = engine.claims.take(key("busy")).expect("free");
    assert!(!engine.visit_next(false).await.expect("store"), "the one thread read is held");
    assert!(engine.unread.load(Ordering::SeqCst), "its 16 steps filled the read: there may be more");
    drop(held);
}

#[tokio::test]
async fn a_thread_let_go_with_a_step_due_later_has_the_keeper_wake_for_it() {
    let (_dir, store, pool) = sqlite_store().await;
    let at = now_ms() + 600_000;
    due_finished_at(&pool, [("op-1".to_owned(), "later".to_owned())], at).await;
    let engine = engine(store);
    engine.unread.store(false, Ordering::SeqCst);
    engine.offer(&[key("later")]);
    assert!(engine.visit_next(false).await.expect("store"), "visited");
    assert_eq!(engine.schedule_lock().iter().copied().collect::<Vec<_>>(), [at], "kept for the keeper");
    let nap = engine.next_nap().await;
    assert!(nap <= Duration::from_secs(600) && nap > Duration::from_secs(590), "{nap:?}");
    // Due by the time it is let go: the workers look at once.
    woken(&engine).await;
    engine.due_later(now_ms() - 1);
    assert!(engine.unread.load(Ordering::SeqCst) && woken(&engine).await);
}

/// Finished operations (id, thread) on PostgreSQL whose `due_at` is `at`.
async fn pg_due_finished_at(pool: &sqlx::PgPool, ops: &[(&str, &str)], at: i64) {
    let body = serde_json::json!({"operationKey": "k", "threadId": "x", "interruptId": "i", "effect": "orders",
        "externalId": "u", "question": "Proceed?", "toolName": "ship", "parameters": {}});
    let limits = crate::domain::operation::Limits { max_expires_in_secs: 3600 };
    let spec = crate::domain::operation::parse(&body, limits, 0).expect("a valid body");
    for (id, thread) in ops {
        sqlx::query(
            "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
             decision_type, spec, decision_request, state, idempotency_key, deadline, created_at, updated_at, \
             due_at) VALUES ($1, 't', $1, 'f', $2, 'i', 'e', 'confirm', $3, '{}', 'succeeded', $1, 9, 1, 1, $4)",
        )
        .bind(id)
        .bind(thread)
        .bind(serde_json::to_string(&spec).expect("serializes"))
        .bind(at)
        .execute(pool)
        .await
        .expect("inserts");
    }
}

/// Visits `thread` as a worker does, lease first, with a read of the
/// store for work (which the lease hides the thread from) begun after
/// that first read: how the visit ended (whether the lease was given up),
/// whether a save gave it up, and what letting the thread go asks for.
async fn visit_leased(engine: &Engine, thread: &str) -> (bool, bool, Missed) {
    let claim = engine.claims.take(key(thread)).expect("free");
    let owner = format!("test-{thread}");
    let now = now_ms();
    let first =
        engine.store.take_thread("t", thread, &owner, now, now + 30_000).await.expect("store").expect("free");
    engine.claims.hidden_from_read();
    let visit = super::Visit { lease_owner: Some(owner.clone()), ..super::Visit::default() };
    let (given_up, by_save) = super::VISIT
        .scope(std::cell::RefCell::new(visit), async {
            let given_up =
                engine.work_thread(&claim, &owner, true, now_ms(), Some(first)).await.expect("visits");
            (given_up, super::VISIT.with(|v| v.borrow().gave_up))
        })
        .await;
    (given_up, by_save, claim.release().1)
}

/// A scratch PostgreSQL store for `test` with finished operations
/// `(id, thread, due_at)`, and an engine on it; None without a server.
async fn pg_engine(test: &str, ops: &[(&str, &str, i64)]) -> Option<(ScratchPg, sqlx::PgPool, Engine)> {
    let db = ScratchPg::create(test).await?;
    let pool = db.store.pg_pool().expect("PostgreSQL").clone();
    for (id, thread, at) in ops {
        pg_due_finished_at(&pool, &[(id, thread)], *at).await;
    }
    let engine = engine(db.store.clone());
    Some((db, pool, engine))
}

async fn leases(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT thread_id FROM thread_leases ORDER BY 1").fetch_all(pool).await.expect("reads")
}

/// `owner` holds the lease of `thread` (tenant `t`) until `until`.
async fn hold_lease<'c>(conn: impl sqlx::PgExecutor<'c>, thread: &str, owner: &str, until: i64) {
    sqlx::query("INSERT INTO thread_leases (tenant, thread_id, owner, until) VALUES ('t', $1, $2, $3)")
        .bind(thread)
        .bind(owner)
        .bind(until)
        .execute(conn)
        .await
        .expect("leased");
}

/// Operations (id `op-N`, thread) pending on decision `dec-N`, their
/// deadlines passed: an answer expires each with one save, and no call
/// leaves the process.
async fn pg_pending(pool: &sqlx::PgPool, ops: &[(&str, &str)]) {
    pg_due_finished_at(pool, ops, 1).await;
    sqlx::query(
        "UPDATE operations SET state = 'pending', due_at = NULL, decision_id = 'dec-' || substr(id, 4)",
    )
    .execute(pool)
    .await
    .expect("pending");
}

/// The answers to dec-1 and dec-2 stored in one batch that applies what
/// it may (decisions §36).
async fn apply_two_answers(engine: &Engine) -> crate::store::BatchInsert {
    let first_saves: crate::store::FirstSaves<'_> = engine;
    let answers = [callback("dec-1", "yes"), callback("dec-2", "yes")];
    engine.store.insert_inbox_batch_with(&answers, Some(first_saves)).await.expect("stores")
}

/// A verified callback answering `decision`.
fn callback(decision: &str, answer: &str) -> crate::store::OwnedInboxEntry {
    crate::store::OwnedInboxEntry {
        tenant: "t".into(),
        correlation_id: decision.into(),
        answer: answer.into(),
        answered_at: None,
        body: b"{}".to_vec(),
        source: "callback",
        received_at: now_ms(),
    }
}

// The save that finishes the last work of a thread gives its lease up,
// and the visit ends there: no read of the thread after it (decisions §34).
// The save is the visit's last look at the thread, and counts as one for
// the reads of the store its lease hid the thread from.
#[tokio::test]
async fn a_visit_ends_with_the_save_that_finishes_its_thread() {
    let Some((db, pool, engine)) =
        pg_engine("worker::tests::a_visit_ends_with_the_save_that_finishes", &[("op-1", "done", 1)]).await
    else {
        return;
    };
    // The save's look at the thread began after the store's read: it saw
    // what that read could, and nothing is asked for.
    assert_eq!(visit_leased(&engine, "done").await, (true, true, Missed::Nothing), "given up by the save");
    assert!(leases(&pool).await.is_empty());
    let due: Option<i64> = sqlx::query_scalar("SELECT due_at FROM operations WHERE id = 'op-1'")
        .fetch_one(&pool)
        .await
        .expect("reads");
    assert_eq!(due, None, "the step was saved");
    drop(engine);
    db.drop().await;
}

// A thread with a step left for later keeps its lease through the save;
// the visit's last read gives it up and hands the step to the keeper.
#[tokio::test]
async fn a_save_leaves_the_lease_to_the_read_when_the_thread_has_a_step_later() {
    let later = now_ms() + 600_000;
    let ops = [("op-1", "busy", 1), ("op-2", "busy", later)];
    let Some((db, pool, engine)) =
        pg_engine("worker::tests::a_save_leaves_the_lease_to_the_read", &ops).await
    else {
        return;
    };
    assert_eq!(visit_leased(&engine, "busy").await, (true, false, Missed::Nothing), "given up by the read");
    assert!(leases(&pool).await.is_empty());
    assert_eq!(engine.schedule_lock().iter().copied().collect::<Vec<_>>(), [later], "kept for the keeper");
    drop(engine);
    db.drop().await;
}

// A visit whose last look at the thread was its first read (nothing was
// due) has the store read again when it lets go: a read of the store for
// work begun after that look may have been woken by work for this thread,
// which the lease hid from it.
#[tokio::test]
async fn a_visit_that_finds_nothing_answers_a_store_read_begun_after_its_look() {
    let ops = [("op-1", "idle", now_ms() + 600_000)];
    let Some((db, _pool, engine)) =
        pg_engine("worker::tests::a_visit_that_finds_nothing_answers", &ops).await
    else {
        return;
    };
    assert_eq!(
        visit_leased(&engine, "idle").await,
        (false, false, Missed::HiddenFromRead),
        "released after the visit"
    );
    drop(engine);
    db.drop().await;
}

// An answer the inbox hands on with its operation (decisions §35) is
// applied by a visit whose first save takes the thread's lease, without
// the lease's own read: the handed answer is the one applied. With the
// lease another's, the save is refused and changes nothing, and the
// visit passes the thread by as any other visit would; handed on again
// once its operation has moved, it is stale and changes nothing either.
#[tokio::test]
async fn an_answer_handed_on_is_applied_by_a_save_that_takes_the_lease() {
    let Some((db, pool, engine)) = pg_engine("worker::tests::an_answer_handed_on_is_applied", &[]).await
    else {
        return;
    };
    pg_pending(&pool, &[("op-1", "th")]).await;
    hold_lease(&pool, "th", "other", i64::MAX / 2).await;
    let entry = callback("dec-1", "stored");
    let mut batch = engine.store.insert_inbox_batch(&[entry]).await.expect("stores");
    assert_eq!(batch.answers.len(), 1);
    // Told apart from the stored answer, which a read of the thread finds.
    batch.answers[0].0.answer = "handed".into();
    let state = || async {
        sqlx::query_as::<_, (String, Option<String>, i64)>("SELECT state, answer, version FROM operations")
            .fetch_one(&pool)
            .await
            .expect("reads")
    };
    engine.stored(&batch.threads, batch.answers.clone(), Vec::new());
    assert!(!engine.visit_next(false).await.expect("visits"), "passed by: the lease is another's");
    assert_eq!(state().await, ("pending".to_owned(), None, 0));
    let owners: Vec<String> =
        sqlx::query_scalar("SELECT owner FROM thread_leases").fetch_all(&pool).await.expect("reads");
    assert_eq!(owners, ["other"]);
    assert!(engine.handed_lock().is_empty(), "taken by the visit");

    sqlx::query("DELETE FROM thread_leases").execute(&pool).await.expect("let go");
    engine.stored(&batch.threads, batch.answers.clone(), Vec::new());
    assert!(engine.visit_next(false).await.expect("visits"));
    let (expired, answer, version) = state().await;
    assert_eq!((expired.as_str(), answer.as_deref()), ("expired", Some("handed")));
    let owners: Vec<String> =
        sqlx::query_scalar("SELECT owner FROM thread_leases").fetch_all(&pool).await.expect("reads");
    assert!(owners.is_empty(), "the visit gave the lease it took up: {owners:?}");

    engine.stored(&batch.threads, batch.answers, Vec::new());
    engine.visit_next(false).await.expect("visits");
    assert_eq!(state().await.2, version, "a stale answer changes nothing");
    assert!(leases(&pool).await.is_empty(), "and leaves no lease");
    let expiries: i64 = sqlx::query_scalar("SELECT count(*) FROM transitions WHERE to_state = 'expired'")
        .fetch_one(&pool)
        .await
        .expect("reads");
    assert_eq!(expiries, 1);
    drop(engine);
    db.drop().await;
}

// An answer's first save commits with its callback (decisions §36): the
// batch that stores two answers applies the one whose thread is free, its
// save taking the lease for the visit that goes on from it, and leaves the
// one whose thread is leased elsewhere stored and waiting, as a plain
// batch would; the visit then goes on from the applied answer without
// applying it again.
#[tokio::test]
async fn an_answer_is_applied_in_the_commit_that_stores_it() {
    let Some((db, pool, engine)) = pg_engine("worker::tests::an_answer_is_applied_in_the_commit", &[]).await
    else {
        return;
    };
    pg_pending(&pool, &[("op-1", "free"), ("op-2", "held")]).await;
    hold_lease(&pool, "held", "other", i64::MAX / 2).await;
    let batch = apply_two_answers(&engine).await;
    assert!(batch.results.iter().all(|r| matches!(r, crate::store::InboxInsert::Stored(_))));
    assert_eq!(batch.applied.len(), 1, "the leased thread's answer is not applied: {batch:?}");
    assert!(batch.answers.is_empty(), "nor handed on: its save was refused");
    let applied = &batch.applied[0];
    assert_eq!((applied.save.op.id.as_str(), applied.save.op.version), ("op-1", 1));
    let ops: Vec<(String, String, i64, Option<i64>)> =
        sqlx::query_as("SELECT id, state, version, inbox_at FROM operations ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!(ops[0].1, "expired", "committed with the callback, before any visit");
    assert_eq!((ops[0].2, ops[0].3), (1, None));
    assert_eq!(ops[1].1, "pending");
    assert!(ops[1].3.is_some(), "its answer waits, marked");
    let inbox: Vec<(String, String)> =
        sqlx::query_as("SELECT correlation_id, state FROM inbox ORDER BY correlation_id")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!(inbox, [("dec-1".into(), "processed".into()), ("dec-2".into(), "new".into())]);
    let owners: Vec<(String, String)> =
        sqlx::query_as("SELECT thread_id, owner FROM thread_leases ORDER BY thread_id")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!(owners, [("free".into(), applied.save.owner.clone()), ("held".into(), "other".into())]);

    // Its lease ran out before a worker came, and is another's: the
    // visit leaves the thread to it.
    let mut late = batch.applied.clone();
    late[0].save.now -= 60_000;
    let lease_owner = |owner: String| {
        let pool = pool.clone();
        async move {
            sqlx::query("UPDATE thread_leases SET owner = $1 WHERE thread_id = 'free'")
                .bind(owner)
                .execute(&pool)
                .await
                .expect("updates")
        }
    };
    lease_owner("thief".into()).await;
    engine.stored(&[key("free")], Vec::new(), late);
    assert!(!engine.visit_next(false).await.expect("visits"), "passed by");
    assert!(engine.handed_lock().is_empty(), "taken by the visit");
    let delivery: Option<String> = sqlx::query_scalar("SELECT delivery FROM operations WHERE id = 'op-1'")
        .fetch_one(&pool)
        .await
        .expect("reads");
    assert_eq!(delivery.as_deref(), Some("pending"), "not gone on from");
    lease_owner(applied.save.owner.clone()).await;

    engine.stored(&batch.threads, batch.answers, batch.applied);
    assert!(engine.visit_next(false).await.expect("visits"));
    assert!(engine.visit_next(false).await.is_ok());
    let expired: Vec<(String, i64)> =
        sqlx::query_as("SELECT to_state, count(*) FROM transitions GROUP BY to_state ORDER BY to_state")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!(expired, [("expired".into(), 1)], "applied once");
    assert_eq!(leases(&pool).await, ["held"], "the visit let the lease its answer's commit took go");
    assert!(engine.handed_lock().is_empty(), "taken by the visit");
    drop(engine);
    db.drop().await;
}

// The applying batch finds its operations without marking them, and marks
// those no first save took (decisions §39): an answer for an operation
// that is no longer pending is marked, as a plain batch marks it, and one
// applied is not, its save being the operation's one new version.
#[tokio::test]
async fn an_applying_batch_marks_only_the_operations_it_did_not_save() {
    let Some((db, pool, engine)) = pg_engine("worker::tests::an_applying_batch_marks_only", &[]).await else {
        return;
    };
    pg_pending(&pool, &[("op-1", "one"), ("op-2", "two")]).await;
    sqlx::query("UPDATE operations SET state = 'answered' WHERE id = 'op-2'")
        .execute(&pool)
        .await
        .expect("updates");
    // Every row version the batch writes, counted.
    for ddl in [
        "CREATE TABLE written (id TEXT NOT NULL)",
        "CREATE FUNCTION count_written() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN INSERT INTO written VALUES (NEW.id); RETURN NEW; END$$",
        "CREATE TRIGGER written AFTER UPDATE ON operations FOR EACH ROW EXECUTE FUNCTION count_written()",
    ] {
        sqlx::query(ddl).execute(&pool).await.expect("counts writes");
    }
    let batch = apply_two_answers(&engine).await;
    assert_eq!(batch.applied.len(), 1, "{batch:?}");
    let written: Vec<(String, i64)> =
        sqlx::query_as("SELECT id, count(*) FROM written GROUP BY id ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!(written, [("op-1".into(), 1), ("op-2".into(), 1)], "one version each: the save, the mark");
    let ops: Vec<(String, i64, Option<i64>)> =
        sqlx::query_as("SELECT id, version, inbox_at FROM operations ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!((ops[0].1, ops[0].2), (1, None), "saved, not marked");
    assert_eq!(ops[1].1, 0);
    assert!(ops[1].2.is_some(), "marked, as a plain batch marks it");
    drop(engine);
    db.drop().await;
}

// An approval applied in its callback's commit, its permit's spending on
// record, whose deadline passed before a worker came: the visit makes no
// call and expires it, the attempt cleared (no call was made). And when
// the workers stop, the leases of applied answers no visit took go.
#[tokio::test]
async fn an_applied_approval_past_its_deadline_expires_without_a_call() {
    let Some((db, pool, engine)) =
        pg_engine("worker::tests::an_applied_approval_past_its_deadline", &[]).await
    else {
        return;
    };
    pg_due_finished_at(&pool, &[("op-1", "late"), ("op-2", "idle")], 1).await;
    sqlx::query(
        "UPDATE operations SET state = 'answered', due_at = NULL, answer = 'yes', consume_inflight = 1, \
         consume_attempts = 1, decision_id = 'dec-' || substr(id, 4)",
    )
    .execute(&pool)
    .await
    .expect("answered");
    let now = now_ms();
    let applied = |id: &'static str, thread: &'static str| {
        let store = engine.store.clone();
        async move {
            let op = store.get_operation(Some("t"), id).await.expect("reads").expect("exists");
            hold_lease(store.pg_pool().expect("PostgreSQL"), thread, &format!("applier/{id}"), now + 30_000)
                .await;
            let entry = crate::store::InboxEntry {
                id: 1,
                tenant: "t".into(),
                correlation_id: op.decision_id.clone().expect("opened"),
                answer: "yes".into(),
                answered_at: None,
                source: "callback".into(),
                state: "processed".into(),
                received_at: now,
                duplicates: 0,
                operation_id: None,
                processed_at: None,
                note: None,
            };
            let save = crate::store::AnswerSave {
                op,
                transitions: Vec::new(),
                note: "matched",
                owner: format!("applier/{id}"),
                now,
                until: now + 30_000,
            };
            crate::store::Applied { entry, save }
        }
    };
    let late = applied("op-1", "late").await;
    let idle = applied("op-2", "idle").await;
    engine.stored(&[key("late")], Vec::new(), vec![late]);
    assert!(engine.visit_next(false).await.expect("visits"));
    let (state, inflight): (String, i64) =
        sqlx::query_as("SELECT state, consume_inflight FROM operations WHERE id = 'op-1'")
            .fetch_one(&pool)
            .await
            .expect("reads");
    assert_eq!((state.as_str(), inflight), ("expired", 0));
    let calls: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pushary_calls").fetch_one(&pool).await.expect("reads");
    assert_eq!(calls, 0, "no call was made");

    // Not visited: its lease goes when the workers stop.
    engine.stored(&[], Vec::new(), vec![idle]);
    assert_eq!(leases(&pool).await, ["idle"]);
    engine.let_applied_go().await;
    assert!(leases(&pool).await.is_empty());
    assert!(engine.handed_lock().is_empty());
    drop(engine);
    db.drop().await;
}

// The inbox's saves wait briefly for a lease another transaction is
// taking or giving up (decisions §36): past the lock timeout the batch is
// stored again without them, its answer handed on, rather than waiting
// on a transaction that may be waiting on it.
#[tokio::test]
async fn the_inbox_waits_briefly_for_a_lease_in_anothers_hands() {
    let Some((db, pool, engine)) = pg_engine("worker::tests::the_inbox_waits_briefly_for_a_lease", &[]).await
    else {
        return;
    };
    pg_pending(&pool, &[("op-1", "busy")]).await;
    let mut other = pool.begin().await.expect("begins");
    hold_lease(&mut *other, "busy", "other", 1).await; // uncommitted
    let entry = callback("dec-1", "yes");
    let first_saves: crate::store::FirstSaves<'_> = &engine;
    // Well short of the connection's own lock timeout (`store.busy_timeout_ms`, 5 s).
    let batch = tokio::time::timeout(
        Duration::from_secs(2),
        engine.store.insert_inbox_batch_with(std::slice::from_ref(&entry), Some(first_saves)),
    )
    .await
    .expect("does not wait for the other transaction")
    .expect("stores");
    assert!(matches!(batch.results[..], [crate::store::InboxInsert::Stored(_)]));
    assert!(batch.applied.is_empty());
    assert_eq!(batch.answers.len(), 1, "handed on as a plain batch's");
    other.rollback().await.expect("rolls back");
    let state: String =
        sqlx::query_scalar("SELECT state FROM operations").fetch_one(&pool).await.expect("reads");
    assert_eq!(state, "pending");
    drop(engine);
    db.drop().await;
}

/// Operations (id `op-N`, thread) pending on decision `dec-N` on SQLite,
/// their deadlines passed: an answer expires each with one save, and no
/// call leaves the process.
async fn sqlite_pending(pool: &sqlx::SqlitePool, ops: &[(&str, &str)]) {
    due_finished_at(pool, ops.iter().map(|(id, thread)| (id.to_string(), thread.to_string())), 1).await;
    sqlx::query(
        "UPDATE operations SET state = 'pending', due_at = NULL, decision_id = 'dec-' || substr(id, 4)",
    )
    .execute(pool)
    .await
    .expect("pending");
}

/// The engine's first saves, each made stale (the operation moved since):
/// none takes. Each thread is named to a worker while its save is made.
struct Stale<'a>(&'a Engine);

impl crate::store::FirstSave for Stale<'_> {
    fn first_save(
        &self,
        e: &crate::store::InboxEntry,
        op: &crate::store::Operation,
    ) -> Option<crate::store::AnswerSave> {
        let mut save = self.0.first_save(e, op)?;
        save.op.version += 5;
        let key = (op.tenant.clone(), op.thread_id.clone());
        assert!(self.0.claims.take(key).is_none(), "held for the save");
        Some(save)
    }

    fn not_made(&self, save: &crate::store::AnswerSave) {
        crate::store::FirstSave::not_made(self.0, save)
    }
}

// SQLite: an answer is applied in the turn that stores its callback, and
// commits with it, when a read of its thread would have returned it
// first to a worker holding the thread: the thread free of this
// process's workers, no other answer waiting on it and none before it
// still resuming, its one answer in the batch (decisions §38). The
// thread's claim is held from the save to the visit that goes on.
#[tokio::test]
async fn an_answer_is_applied_in_the_commit_that_stores_it_on_sqlite() {
    let (_dir, store, pool) = sqlite_store().await;
    let engine = engine(store);
    let threads = [
        ("op-1", "free"),
        ("op-2", "busy"),
        ("op-3", "behind"),
        ("op-5", "two"),
        ("op-6", "two"),
        ("op-7", "waits"),
        ("op-8", "waits"),
    ];
    sqlite_pending(&pool, &threads).await;
    // An earlier answer of `behind` still resumes; one waits on `waits`.
    sqlx::raw_sql(
        "INSERT INTO operations (id, tenant, operation_key, fingerprint, thread_id, interrupt_id, effect, \
           decision_type, spec, decision_request, state, decision_id, idempotency_key, deadline, created_at, \
           updated_at, resume_seq) \
         SELECT 'op-4', 't', 'op-4', 'f', 'behind', 'i', 'e', 'confirm', spec, '{}', 'delivering', 'dec-4', \
           'op-4', 9, 1, 1, 0 FROM operations WHERE id = 'op-1'; \
         UPDATE operations SET inbox_at = 5 WHERE id = 'op-8'",
    )
    .execute(&pool)
    .await
    .expect("inserts");
    let worker = engine.claims.take(key("busy")).expect("free");
    let batch = ["dec-1", "dec-2", "dec-3", "dec-5", "dec-6", "dec-7"].map(|d| callback(d, "yes"));

    // Stale, none takes: each thread's claim goes again.
    let stale = Stale(&engine);
    let first = engine.store.insert_inbox_batch_with(&batch[..1], Some(&stale)).await.expect("stores");
    assert!(first.applied.is_empty(), "{first:?}");
    let (state, inbox_at, inbox_state): (String, Option<i64>, String) = sqlx::query_as(
        "SELECT o.state, o.inbox_at, i.state FROM operations o JOIN inbox i ON i.correlation_id = o.decision_id \
         WHERE o.id = 'op-1'",
    )
    .fetch_one(&pool)
    .await
    .expect("reads");
    assert_eq!((state.as_str(), inbox_at.is_some(), inbox_state.as_str()), ("pending", true, "new"));
    assert!(engine.claims.reserve(&key("free")), "its claim went with the save");
    assert_eq!(engine.claims.unreserve(&key("free")), Missed::Nothing);
    assert_eq!(queued(&engine), [key("free")], "named while held for the save: named again");
    engine.queue().clear();
    sqlx::query("DELETE FROM inbox").execute(&pool).await.expect("deletes");
    sqlx::query("UPDATE operations SET inbox_at = NULL WHERE id <> 'op-8'")
        .execute(&pool)
        .await
        .expect("clears");

    let first_saves: crate::store::FirstSaves<'_> = &engine;
    let batch = engine.store.insert_inbox_batch_with(&batch, Some(first_saves)).await.expect("stores");
    assert!(batch.results.iter().all(|r| matches!(r, crate::store::InboxInsert::Stored(_))));
    let applied: Vec<(&str, i64)> =
        batch.applied.iter().map(|a| (a.save.op.id.as_str(), a.save.op.version)).collect();
    assert_eq!(applied, [("op-1", 1)], "only the free thread's one answer");
    let ops: Vec<(String, String, Option<i64>)> =
        sqlx::query_as("SELECT id, state, inbox_at FROM operations WHERE id <> 'op-4' ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!((ops[0].1.as_str(), ops[0].2), ("expired", None), "committed with its callback");
    assert!(ops[1..].iter().all(|(_, state, inbox_at)| state == "pending" && inbox_at.is_some()), "{ops:?}");
    let processed: Vec<String> =
        sqlx::query_scalar("SELECT correlation_id FROM inbox WHERE state = 'processed'")
            .fetch_all(&pool)
            .await
            .expect("reads");
    assert_eq!(processed, ["dec-1"]);
    assert!(!engine.claims.reserve(&key("free")), "held for the visit that goes on");

    // Named before it is handed on, the thread is passed by; handed on,
    // the next worker goes on from the answer, holding the claim, and
    // the thread is named again when it lets go.
    engine.unread.store(false, Ordering::SeqCst);
    engine.offer(&[key("free")]);
    assert!(!engine.visit_next(false).await.expect("visits"), "not before it is handed on");
    engine.stored(&[key("free")], batch.answers, batch.applied);
    assert!(engine.visit_next(false).await.expect("visits"));
    assert!(engine.handed_lock().is_empty(), "taken by the visit");
    assert_eq!(queued(&engine), [key("free")], "named while applied: named again");
    engine.offer(&batch.threads);
    drop(worker);
    for _ in 0..16 {
        if !engine.visit_next(false).await.expect("visits") {
            break;
        }
    }
    assert_eq!(engine.claims.busy(), 0);
    let expired: Vec<(String, i64)> = sqlx::query_as(
        "SELECT operation_id, count(*) FROM transitions WHERE to_state = 'expired' GROUP BY operation_id",
    )
    .fetch_all(&pool)
    .await
    .expect("reads");
    // `op-8`'s mark had no answer behind it, and was cleared.
    let once = ["op-1", "op-2", "op-3", "op-5", "op-6", "op-7"].map(|id| (id.to_string(), 1));
    assert_eq!(expired, once, "each answer applied once, by its commit or by its thread's read");

    // Applied, and no visit came before the workers stopped: the claim goes.
    sqlite_pending(&pool, &[("op-9", "late")]).await;
    let late = engine.store.insert_inbox_batch_with(&[callback("dec-9", "yes")], Some(first_saves)).await;
    let late = late.expect("stores");
    assert_eq!(late.applied.len(), 1);
    engine.stored(&[], Vec::new(), late.applied);
    assert_eq!(engine.claims.busy(), 1);
    engine.let_applied_go().await;
    assert_eq!(engine.claims.busy(), 0);
    assert!(engine.handed_lock().is_empty());
}
