//! The receiver: verify before anything, store before acknowledging,
//! deduplicate, never resume twice.

use approvald::sandbox::CallbackMode;
use serde_json::json;

use crate::harness::{Options, TestApp, confirm};

both_engines! {
async fn unverified_or_malformed_callbacks_are_rejected_and_store_nothing() {
    let app = TestApp::spawn().await;
    let (body, good_sig) = app.signed_callback("dec_x", "yes");
    let forged = approvald::pushary::signature::sign("whsec_attacker", &body);
    let wrong_secret_of_same_shape =
        approvald::pushary::signature::sign(&format!("{}x", app.webhook_secret), &body);
    let mut tampered = body.clone();
    tampered[20] ^= 1;
    let huge = vec![b' '; 64 * 1024 + 1];
    let huge_sig = approvald::pushary::signature::sign(&app.webhook_secret, &huge);
    let not_json = b"answer=yes".to_vec();
    let not_json_sig = approvald::pushary::signature::sign(&app.webhook_secret, &not_json);
    let no_fields = br#"{"correlationId": 5, "answer": "yes"}"#.to_vec();
    let no_fields_sig = approvald::pushary::signature::sign(&app.webhook_secret, &no_fields);

    type Case<'a> = (&'a str, Vec<u8>, Option<String>, u16, &'a str);
    let cases: Vec<Case> = vec![
        ("missing signature", body.clone(), None, 401, "unauthorized"),
        ("empty signature", body.clone(), Some(String::new()), 401, "unauthorized"),
        ("forged signature", body.clone(), Some(forged), 401, "unauthorized"),
        ("wrong secret", body.clone(), Some(wrong_secret_of_same_shape), 401, "unauthorized"),
        ("uppercase signature", body.clone(), Some(good_sig.to_uppercase()), 401, "unauthorized"),
        ("tampered body", tampered, Some(good_sig.clone()), 401, "unauthorized"),
        ("body over 64 KiB", huge, Some(huge_sig), 413, "payload_too_large"),
        ("signed non-JSON", not_json, Some(not_json_sig), 400, "invalid_json"),
        ("signed JSON without string fields", no_fields, Some(no_fields_sig), 400, "not_a_decision_callback"),
    ];
    for (name, b, sig, status, code) in cases {
        let (got, err) = app.post_callback(&b, sig.as_deref()).await;
        assert_eq!(got, status, "{name}: {err}");
        assert_eq!(err["code"], code, "{name}: {err}");
        assert!(err["detail"].as_str().is_some_and(|d| !d.is_empty()), "{name}: {err}");
        assert_eq!(app.inbox_len().await, 0, "{name}: the inbox must be unchanged");
    }
    // The valid one is stored, proving the cases above failed for their own reason.
    assert_eq!(app.post_callback(&body, Some(&good_sig)).await.0, 200);
    assert_eq!(app.inbox_len().await, 1);
}
}

both_engines! {
async fn the_same_callback_five_times_and_concurrently_resumes_once() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_ok(&confirm("dup")).await;
    let decision = app.decision_of(&id).await;
    // The sandbox records the answer but loses its callback; we deliver it ourselves.
    app.sandbox.answer(&decision, "yes", CallbackMode::Drop).await.expect("answer");
    let (body, sig) = app.signed_callback(&decision, "yes");
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(app.post_callback(&body, Some(&sig)).await);
    }
    let concurrent = futures_join(&app, &body, &sig, 5).await;
    assert!(statuses.iter().chain(concurrent.iter()).all(|(s, _)| *s == 200), "{statuses:?} {concurrent:?}");
    let stored = statuses.iter().chain(concurrent.iter()).filter(|(_, v)| v["status"] == "stored").count();
    assert_eq!(stored, 1, "exactly one is stored; the rest are duplicates");

    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
    assert_eq!(app.deliveries_for(&id).len(), 1);
    let inbox = app.store().list_inbox(None, 10).await.expect("inbox");
    assert_eq!(inbox.len(), 1);
    assert_eq!(inbox[0].duplicates, 9);

    // A late replay after completion is acknowledged and changes nothing.
    let before = app.get(&id).await;
    assert_eq!(app.post_callback(&body, Some(&sig)).await, (200, json!({"status": "duplicate"})));
    let (other_body, other_sig) = app.signed_callback(&decision, "no");
    assert_eq!(app.post_callback(&other_body, Some(&other_sig)).await, (200, json!({"status": "duplicate"})));
    app.drain().await;
    let after = app.get(&id).await;
    assert_eq!(before["transitions"], after["transitions"]);
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
    assert_eq!(app.deliveries_for(&id).len(), 1);
}
}

async fn futures_join(app: &TestApp, body: &[u8], sig: &str, n: usize) -> Vec<(u16, serde_json::Value)> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let http = app.http.clone();
        let url = format!("{}/v1/callbacks/pushary", app.base);
        let body = body.to_vec();
        let sig = sig.to_string();
        set.spawn(async move {
            let r = http.post(url).header("X-Pushary-Signature", sig).body(body).send().await.expect("post");
            (r.status().as_u16(), r.json().await.unwrap_or(serde_json::Value::Null))
        });
    }
    set.join_all().await
}

// The callback arrives while approvald has not yet recorded the decision
// id (here: Pushary created the decision, approvald has not heard back).
// It waits in the inbox and is processed once the id is recorded.
both_engines! {
async fn an_early_callback_waits_in_the_inbox_until_the_decision_id_is_recorded() {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("early")).await;
    // The exact request approvald will send, sent first by someone else.
    let decision = app.create_decision_first(&id).await;
    app.answer(&decision, "yes").await;
    assert!(
        app.sandbox
            .wait_for(crate::harness::WAIT, |s| s
                .decision(&decision)
                .is_some_and(|d| d.callback.delivered_at.is_some()))
            .await,
        "the callback reaches approvald"
    );
    let entry = app.store().inbox_by_correlation("default", &decision).await.expect("store").expect("stored");
    assert_eq!(entry.state, "new");
    assert_eq!(app.get(&id).await["state"], "enqueued", "not matched yet: the decision id is unknown");

    app.drain().await;
    let op = app.get(&id).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    assert_eq!(op["decisionId"], decision, "the opener got the same decision back");
    let entry = app.store().inbox_by_correlation("default", &decision).await.expect("store").expect("stored");
    assert_eq!(entry.state, "processed");
    assert!(entry.note.as_deref().unwrap_or("").contains("early"), "{entry:?}");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
    assert_eq!(app.deliveries_for(&id).len(), 1);
}
}

both_engines! {
async fn a_callback_for_an_unknown_decision_is_kept_not_lost() {
    let app = TestApp::spawn().await;
    let (body, sig) = app.signed_callback("dec_nobody_knows", "yes");
    let (status, v) = app.post_callback(&body, Some(&sig)).await;
    assert_eq!(status, 200, "{v}");
    let entry =
        app.store().inbox_by_correlation("default", "dec_nobody_knows").await.expect("store").expect("kept");
    assert_eq!(entry.state, "new");
}
}

both_engines! {
async fn a_store_that_cannot_commit_answers_503_so_pushary_retries() {
    let app = TestApp::spawn().await;
    app.store().close().await;
    let (body, sig) = app.signed_callback("dec_while_down", "yes");
    let (status, err) = app.post_callback(&body, Some(&sig)).await;
    assert_eq!(status, 503, "{err}");
    assert_eq!(err["code"], "store_unavailable");
    assert!(!err["detail"].as_str().unwrap_or("").contains(".db"), "no file paths in errors: {err}");
}
}

both_engines! {
async fn callbacks_committed_together_each_get_their_own_answer() {
    use approvald::store::{InboxInsert, OwnedInboxEntry};
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let entry = |c: &str| OwnedInboxEntry {
        tenant: "default".into(),
        correlation_id: c.into(),
        answer: "yes".into(),
        answered_at: None,
        body: format!(r#"{{"correlationId":"{c}","answer":"yes"}}"#).into_bytes(),
        source: "callback",
        received_at: 1,
    };
    let store = app.store();
    // One batch: two new decisions, one of them twice.
    let r = store.insert_inbox_batch(&[entry("dec_a"), entry("dec_b"), entry("dec_a")]).await.expect("batch").results;
    let (InboxInsert::Stored(a), InboxInsert::Stored(b)) = (r[0], r[1]) else { panic!("{r:?}") };
    assert_ne!(a, b);
    assert_eq!(r[2], InboxInsert::Duplicate(a), "a second body in the same batch is a duplicate");
    // A later batch: old and new mixed.
    let r = store.insert_inbox_batch(&[entry("dec_b"), entry("dec_c")]).await.expect("batch").results;
    assert_eq!(r[0], InboxInsert::Duplicate(b));
    assert!(matches!(r[1], InboxInsert::Stored(c) if c > b), "{r:?}");
    assert_eq!(app.inbox_len().await, 3);
    let a_row = store.inbox_by_correlation("default", "dec_a").await.expect("store").expect("row");
    assert_eq!(a_row.duplicates, 1);

    // Through HTTP, concurrently: every decision stored exactly once, every
    // other copy acknowledged as a duplicate.
    let mut tasks = Vec::new();
    for n in 0..60 {
        let (body, sig) = app.signed_callback(&format!("dec_http_{}", n % 30), "yes");
        let (http, url) = (app.http.clone(), format!("{}/v1/callbacks/pushary", app.base));
        tasks.push(tokio::spawn(async move {
            let r = http.post(url).header("x-pushary-signature", sig).body(body).send().await.expect("send");
            assert_eq!(r.status().as_u16(), 200);
            r.json::<serde_json::Value>().await.expect("json")["status"].as_str().expect("status").to_string()
        }));
    }
    let mut stored = 0;
    for t in tasks {
        if t.await.expect("task") == "stored" {
            stored += 1;
        }
    }
    assert_eq!(stored, 30);
    assert_eq!(app.inbox_len().await, 33);
}
}

/// Marks the operation as having an answer waiting, behind the engine's back.
async fn mark_answer_waiting(app: &TestApp, id: &str) {
    let sql = "UPDATE operations SET inbox_at = 1 WHERE id = $1";
    if let Some(pool) = app.store().pg_pool() {
        sqlx::query(sql).bind(id).execute(pool).await.expect("mark");
    } else {
        let pool = sqlx::SqlitePool::connect(&app.store_url()).await.expect("sqlite");
        sqlx::query(sql).bind(id).execute(&pool).await.expect("mark");
        pool.close().await;
    }
}

// A waiting-answer mark with nothing waiting behind it (never expected)
// heals itself instead of making workers take the thread forever.
both_engines! {
async fn a_stale_waiting_answer_mark_heals_itself() {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("stale-mark")).await;
    app.drain().await;
    assert_eq!(app.get(&id).await["state"], "pending");
    mark_answer_waiting(&app, &id).await;
    // The thread is offered once, finds nothing, and the mark is gone.
    assert!(app.engine.try_execute_task().await.expect("store"));
    assert!(!app.engine.try_execute_task().await.expect("store"), "not offered again");
    assert_eq!(app.get(&id).await["state"], "pending", "nothing else changed");
}
}

// The same with the operation's callback still in the inbox, processed: the
// mark finds no answer waiting (only a `new` entry waits), so the finished
// approval is not resumed again and the mark is cleared.
both_engines! {
async fn a_stale_mark_over_a_processed_answer_resumes_nothing() {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("stale-processed")).await;
    app.drain().await;
    let decision = app.decision_of(&id).await;
    app.sandbox.answer(&decision, "yes", CallbackMode::Drop).await.expect("answer");
    let (body, sig) = app.signed_callback(&decision, "yes");
    assert_eq!(app.post_callback(&body, Some(&sig)).await.0, 200);
    app.drain().await;
    let before = app.get(&id).await;
    assert_eq!(before["state"], "succeeded");
    assert_eq!(before["receipt"], "recorded");
    let inbox = app.store().list_inbox(None, 10).await.expect("inbox");
    assert_eq!(inbox.len(), 1);
    assert_eq!(inbox[0].state, "processed");

    mark_answer_waiting(&app, &id).await;
    assert!(app.engine.try_execute_task().await.expect("store"));
    assert!(!app.engine.try_execute_task().await.expect("store"), "not offered again");
    let after = app.get(&id).await;
    assert_eq!(before["transitions"], after["transitions"], "nothing resumed");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
    assert_eq!(app.deliveries_for(&id).len(), 1);
}
}

// Correlation ids are random, so every index that holds them takes each
// stored callback at a random place: a page dirtied, written to the log
// and flushed per callback. The inbox's unique key is the one such index
// dedupe needs; a second one (`inbox_new` until migration 7/8) cost SQLite
// ingest a third of its rate (docs/performance.md).
both_engines! {
async fn the_inbox_indexes_correlation_ids_once_its_unique_key() {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let names: Vec<String> = if let Some(pool) = app.store().pg_pool() {
        sqlx::query_scalar(
            "SELECT indexname::text FROM pg_indexes WHERE tablename = 'inbox' AND indexdef LIKE '%correlation_id%'",
        )
        .fetch_all(pool)
        .await
        .expect("lists indexes")
    } else {
        let pool = sqlx::SqlitePool::connect(&app.store_url()).await.expect("sqlite");
        let names = sqlx::query_scalar(
            "SELECT il.name FROM pragma_index_list('inbox') il WHERE EXISTS \
             (SELECT 1 FROM pragma_index_info(il.name) ii WHERE ii.name = 'correlation_id')",
        )
        .fetch_all(&pool)
        .await
        .expect("lists indexes");
        pool.close().await;
        names
    };
    assert_eq!(names.len(), 1, "one index over correlation_id, the unique key: {names:?}");
    assert!(!names.iter().any(|n| n == "inbox_new"), "{names:?}");
    // The unique key still dedupes: a repeat is a duplicate, not a second row.
    let (body, sig) = app.signed_callback("dec_once", "yes");
    assert_eq!(app.post_callback(&body, Some(&sig)).await.1["status"], "stored");
    assert_eq!(app.post_callback(&body, Some(&sig)).await.1["status"], "duplicate");
    assert_eq!(app.inbox_len().await, 1);
}
}

// A lease's transaction writes nothing that must outlive a crash (the
// leases' table is unlogged), so it commits without waiting for the WAL's
// flush: `synchronous_commit` off for that transaction alone. The setting
// must not outlive it: a connection left with it off would commit the
// next save on it asynchronously, and a callback's answer, a consume in
// flight or a receipt could then be lost to a crash after being acted on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_commits_without_waiting_for_the_wal_and_leaves_its_connection_durable() {
    on_postgres(module_path!(), async {
        let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
        let id = app.enqueue_ok(&confirm("async-lease")).await;
        // One connection, so the lease's statements and the checks share it.
        let store = approvald::store::Store::connect(&approvald::config::StoreConfig::with_defaults(app.store_url(), 1))
        .await
        .expect("connects");
        let pool = store.pg_pool().expect("PostgreSQL").clone();
        sqlx::raw_sql(
            "CREATE TABLE lease_commit_modes (n bigserial, event text, mode text); \
             CREATE FUNCTION record_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               INSERT INTO lease_commit_modes (event, mode) VALUES (TG_OP, current_setting('synchronous_commit')); \
               RETURN NULL; END $$; \
             CREATE TRIGGER record_commit_mode AFTER INSERT OR UPDATE OR DELETE ON thread_leases \
               FOR EACH ROW EXECUTE FUNCTION record_commit_mode();",
        )
        .execute(&pool)
        .await
        .expect("a trigger recording each lease write's commit mode");
        let mode = || async {
            sqlx::query_scalar::<_, String>("SHOW synchronous_commit").fetch_one(&pool).await.expect("shows")
        };
        let now = approvald::clock::now_ms();
        match store.take_thread("default", "thread-async-lease", "w", now, now + 60_000).await.expect("store") {
            Some(Some(approvald::store::ThreadWork::Due(op))) => assert_eq!(op.id, id),
            other => panic!("the thread taken with its due step: {other:?}"),
        }
        assert_eq!(mode().await, "on", "the lease's setting outlived its transaction");
        sqlx::query("UPDATE operations SET due_at = NULL WHERE id = $1")
            .bind(&id)
            .execute(&pool)
            .await
            .expect("nothing due");
        let (work, released) = store
            .next_work_or_release("default", "thread-async-lease", approvald::clock::now_ms(), "w")
            .await
            .expect("store");
        assert!(work.is_none() && released, "nothing left: the lease is given up");
        assert_eq!(mode().await, "on", "the release's setting outlived its transaction");
        let modes: Vec<(String, String)> =
            sqlx::query_as("SELECT event, mode FROM lease_commit_modes ORDER BY n")
                .fetch_all(&pool)
                .await
                .expect("reads");
        assert_eq!(
            modes,
            [("INSERT".to_owned(), "off".to_owned()), ("DELETE".to_owned(), "off".to_owned())],
            "the lease taken and given up, each in a transaction that does not wait for the WAL"
        );
    })
    .await;
}

/// Runs `body` on PostgreSQL only (with `APPROVALD_TEST_PG_URL`; loudly
/// skipped without it): the races below need concurrent writers, which
/// SQLite's one writer never has.
async fn on_postgres(test: &str, body: impl std::future::Future<Output = ()>) {
    if let Some(backend) = crate::harness::Backend::postgres(test) {
        crate::harness::BACKEND.scope(backend, body).await;
    }
}

/// A trigger that makes `event` on `table` wait, after its statement took
/// its snapshot, while the session lock `KEY` is held elsewhere: the way
/// to line two committing writers up at will.
const KEY: i64 = 8128;

async fn hold_at(app: &TestApp, table: &str, event: &str, when: &str) -> sqlx::PgConnection {
    hold(app, &format!("TRIGGER test_hold BEFORE {event} ON {table}"), when).await
}

/// `hold_at` with the trigger's clause given whole (`trigger`: from
/// `CREATE` up to `FOR EACH ROW`).
async fn hold(app: &TestApp, trigger: &str, when: &str) -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let pool = app.store().pg_pool().expect("PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION test_hold() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF {when} THEN PERFORM pg_advisory_xact_lock({KEY}); END IF; RETURN NEW; END $$"
    )))
    .execute(pool)
    .await
    .expect("trigger function");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE {trigger} FOR EACH ROW EXECUTE FUNCTION test_hold()")))
        .execute(pool)
        .await
        .expect("trigger");
    let mut lock = sqlx::PgConnection::connect(&app.store_url()).await.expect("connects");
    sqlx::query("SELECT pg_advisory_lock($1)").bind(KEY).execute(&mut lock).await.expect("locks");
    lock
}

/// How many writers wait at the trigger of `hold_at` now.
async fn writers_held(app: &TestApp) -> i64 {
    let pool = app.store().pg_pool().expect("PostgreSQL");
    sqlx::query_scalar(
        // Advisory locks are per database, and pg_locks shows the
        // cluster's: another test's waiter must not count.
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND classid = 0 AND objid = $1 AND objsubid = 1",
    )
    .bind(KEY)
    .fetch_one(pool)
    .await
    .expect("pg_locks")
}

/// Waits (bounded) until a writer waits at the trigger of `hold_at`.
async fn wait_held(app: &TestApp) {
    let start = std::time::Instant::now();
    while writers_held(app).await == 0 {
        assert!(start.elapsed() < crate::harness::WAIT, "no writer reached the trigger");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A manual app with an operation whose decision Pushary created and its
/// human approved, with the callback not sent, before approvald opened it.
async fn answered_before_opened(name: &str) -> (TestApp, String, String) {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm(name)).await;
    let decision = app.create_decision_first(&id).await;
    app.sandbox.answer(&decision, "yes", CallbackMode::Drop).await.expect("answer");
    (app, id, decision)
}

/// Lets the writer held by `hold` go, and checks the callback posted
/// meanwhile is acknowledged.
async fn release_and_expect_stored(lock: &mut sqlx::PgConnection, callback: tokio::task::JoinHandle<u16>) {
    sqlx::query("SELECT pg_advisory_unlock($1)").bind(KEY).execute(&mut *lock).await.expect("unlocks");
    let status =
        tokio::time::timeout(crate::harness::WAIT, callback).await.expect("answered").expect("joins");
    assert_eq!(status, 200);
}

/// Posts a signed callback from a task of its own; yields its status.
fn post_in_background(app: &TestApp, body: Vec<u8>, sig: String) -> tokio::task::JoinHandle<u16> {
    let (http, url) = (app.http.clone(), format!("{}/v1/callbacks/pushary", app.base));
    tokio::spawn(async move {
        let resp = http
            .post(url)
            .header("content-type", "application/json")
            .header("X-Pushary-Signature", sig)
            .body(body)
            .send()
            .await
            .expect("callback request");
        resp.status().as_u16()
    })
}

/// Drives the engine until the operation succeeds (bounded), resumed
/// once: one consume, one delivery.
async fn applied_once(app: &TestApp, id: &str, decision: &str) {
    let op = drain_until_succeeded(app, id).await;
    assert_eq!(op["decisionId"], decision);
    assert_eq!(app.sandbox.consume_calls(decision), 1);
    assert_eq!(app.deliveries_for(id).len(), 1);
}

/// Drives the engine by hand until the operation succeeds (bounded).
async fn drain_until_succeeded(app: &TestApp, id: &str) -> serde_json::Value {
    let start = std::time::Instant::now();
    loop {
        app.drain().await;
        let op = app.get(id).await;
        if op["state"] == "succeeded" {
            return op;
        }
        assert!(
            start.elapsed() < crate::harness::WAIT,
            "the answer waiting in the inbox was never applied: {op:#}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

// The callback commits while the save that records its decision id is
// running: the callback's statement did not see the id (not committed),
// and the save's did not see the callback (not committed when it began).
// Neither marked the answer as waiting. Here the callback is stored by
// another replica's receiver that stops before it looks again (below), so
// only the statement run after every open is left to find it: at once,
// not at the poll a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_committed_while_its_decision_id_is_saved_is_applied_at_once() {
    on_postgres(module_path!(), async {
        let (app, id, decision) = answered_before_opened("race-open").await;
        let mut lock =
            hold_at(&app, "operations", "UPDATE", "OLD.decision_id IS NULL AND NEW.decision_id IS NOT NULL").await;
        let engine = std::sync::Arc::clone(&app.engine);
        let opener = tokio::spawn(async move { while engine.try_execute_task().await.expect("store") {} });
        wait_held(&app).await;
        let (body, _) = app.signed_callback(&decision, "yes");
        let pool = app.store().pg_pool().expect("PostgreSQL");
        sqlx::query(
            "INSERT INTO inbox (tenant, correlation_id, answer, body, body_sha256, source, state, received_at) \
             VALUES ('default', $1, 'yes', $2, 'x', 'callback', 'new', 1)",
        )
        .bind(&decision)
        .bind(&body)
        .execute(pool)
        .await
        .expect("stored while the open is saved");
        let marked: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE inbox_at IS NOT NULL")
            .fetch_one(pool)
            .await
            .expect("reads");
        assert_eq!(marked, 0, "the open is not committed: nothing is marked");
        sqlx::query("SELECT pg_advisory_unlock($1)").bind(KEY).execute(&mut lock).await.expect("unlocks");
        tokio::time::timeout(crate::harness::WAIT, opener).await.expect("the opener finishes").expect("joins");
        applied_once(&app, &id, &decision).await;
    })
    .await;
}

// The other order: the save that records the decision id commits while the
// callback's statement is running. The callback's statement did not see
// the id (its snapshot is older), and the statement after the open did not
// see the callback (not committed yet). The receiver marks it after its
// commit, once more, by a statement of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_id_saved_while_its_callback_is_stored_is_applied_at_once() {
    on_postgres(module_path!(), async {
        let (app, id, decision) = answered_before_opened("race-inbox").await;
        let mut lock = hold_at(&app, "inbox", "INSERT", "true").await;
        let (body, sig) = app.signed_callback(&decision, "yes");
        let callback = post_in_background(&app, body, sig);
        wait_held(&app).await;
        app.drain().await;
        assert_eq!(app.get(&id).await["state"], "pending", "opened while its callback is being stored");
        release_and_expect_stored(&mut lock, callback).await;
        applied_once(&app, &id, &decision).await;
    })
    .await;
}

// PostgreSQL's first inbox writer holds every callback that arrived during
// its last batch; a batch of it held up (here its insert waits on a lock)
// must not hold up the callbacks queued behind it: the standby writer
// commits them (decisions §29). With one writer the callback behind is
// answered only once the held statement fails on its lock timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_behind_a_held_up_batch_is_committed_meanwhile() {
    on_postgres(module_path!(), async {
        let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
        let mut lock = hold_at(&app, "inbox", "INSERT", "NEW.correlation_id = 'dec_held'").await;
        let (body, sig) = app.signed_callback("dec_held", "yes");
        let held = post_in_background(&app, body, sig);
        wait_held(&app).await;
        let (body, sig) = app.signed_callback("dec_behind", "yes");
        let behind = post_in_background(&app, body, sig);
        let status = tokio::time::timeout(crate::harness::WAIT, behind)
            .await
            .expect("the callback behind is answered")
            .expect("joins");
        assert_eq!(status, 200);
        assert_eq!(writers_held(&app).await, 1, "answered while the first batch still waits");
        assert!(!held.is_finished(), "the held callback is not answered before its commit");
        release_and_expect_stored(&mut lock, held).await;
        for decision in ["dec_held", "dec_behind"] {
            let entry = app.store().inbox_by_correlation("default", decision).await.expect("store");
            assert_eq!(entry.expect("stored").state, "new", "{decision}");
        }
    })
    .await;
}

// A repeat of a callback revives its orphaned row by a snapshot older than
// the save that records the decision id, and commits after that save,
// while the statement after the open waits for the row and then finds it
// neither orphaned (revived since) nor new (by its own snapshot). The
// receiver's second look takes revived rows too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revived_orphan_committed_after_its_decision_id_is_applied_at_once() {
    on_postgres(module_path!(), async {
        let (app, id, decision) = answered_before_opened("race-revive").await;
        let (body, sig) = app.signed_callback(&decision, "yes");
        let pool = app.store().pg_pool().expect("PostgreSQL");
        sqlx::query(
            "INSERT INTO inbox (tenant, correlation_id, answer, body, body_sha256, source, state, received_at) \
             VALUES ('default', $1, 'yes', $2, 'x', 'callback', 'orphaned', 1)",
        )
        .bind(&decision)
        .bind(&body)
        .execute(pool)
        .await
        .expect("an early answer, orphaned");
        // At the repeat's commit, after its statements ran.
        let mut lock = hold(
            &app,
            "CONSTRAINT TRIGGER test_hold AFTER UPDATE ON inbox DEFERRABLE INITIALLY DEFERRED",
            "OLD.state = 'orphaned' AND NEW.state = 'new'",
        )
        .await;
        let callback = post_in_background(&app, body, sig);
        wait_held(&app).await;
        let engine = std::sync::Arc::clone(&app.engine);
        let opener = tokio::spawn(async move { while engine.try_execute_task().await.expect("store") {} });
        let start = std::time::Instant::now();
        while app.get(&id).await["state"] != "pending" {
            assert!(start.elapsed() < crate::harness::WAIT, "the open never committed");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // The statement after the open waits for the repeat's row.
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE 'WITH r AS%'",
            )
            .fetch_one(pool)
            .await
            .expect("pg_stat_activity");
            if waiting > 0 {
                break;
            }
            assert!(start.elapsed() < crate::harness::WAIT, "the statement after the open never waited");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        release_and_expect_stored(&mut lock, callback).await;
        tokio::time::timeout(crate::harness::WAIT, opener).await.expect("the opener finishes").expect("joins");
        applied_once(&app, &id, &decision).await;
    })
    .await;
}

// A worker takes a thread's lease and reads its work in one round trip
// (`Store::take_thread`). When it waited for the last holder's release,
// the read must see what was committed meanwhile: a statement's parts all
// read the snapshot taken before the wait, so the read is a statement of
// its own inside the function. Here a change commits while the taker
// waits for the release; the read sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_taken_as_its_last_holder_lets_go_is_read_as_that_holder_left_it() {
    on_postgres(module_path!(), async {
        use sqlx::Connection as _;
        let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
        let id = app.enqueue_ok(&confirm("snap")).await;
        let pool = app.store().pg_pool().expect("PostgreSQL").clone();
        sqlx::query("UPDATE operations SET due_at = NULL WHERE id = $1")
            .bind(&id)
            .execute(&pool)
            .await
            .expect("undue");
        let now = approvald::clock::now_ms();
        assert!(
            app.store().acquire_lease("default", "thread-snap", "a", now, now + 60_000).await.expect("lease")
        );
        // The holder lets go, in a transaction not yet committed.
        let mut holder = sqlx::PgConnection::connect(&app.store_url()).await.expect("connects");
        sqlx::query("BEGIN").execute(&mut holder).await.expect("begins");
        sqlx::query("DELETE FROM thread_leases WHERE thread_id = 'thread-snap'")
            .execute(&mut holder)
            .await
            .expect("releases");
        let store = app.store().clone();
        let taker = tokio::spawn(async move {
            let now = approvald::clock::now_ms();
            store.take_thread("default", "thread-snap", "b", now, now + 60_000).await.expect("store")
        });
        let start = std::time::Instant::now();
        loop {
            // By the text's start: pg_stat_activity keeps only its first
            // kilobyte (`track_activity_query_size`).
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE 'SELECT (t.w_op).%'",
            )
            .fetch_one(&pool)
            .await
            .expect("pg_stat_activity");
            if waiting > 0 {
                break;
            }
            assert!(start.elapsed() < crate::harness::WAIT, "the taker never waited for the release");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Committed while the taker waits: its step is due now.
        sqlx::query("UPDATE operations SET due_at = 1 WHERE id = $1")
            .bind(&id)
            .execute(&pool)
            .await
            .expect("due");
        sqlx::query("COMMIT").execute(&mut holder).await.expect("commits");
        let taken = tokio::time::timeout(crate::harness::WAIT, taker).await.expect("taken").expect("joins");
        match taken {
            Some(Some(approvald::store::ThreadWork::Due(op))) => assert_eq!(op.id, id),
            other => panic!("the thread's due step, as committed before the lease was taken: {other:?}"),
        }
        // Held now: another taker gets nothing.
        let now = approvald::clock::now_ms();
        assert!(
            app.store()
                .take_thread("default", "thread-snap", "c", now, now + 60_000)
                .await
                .expect("store")
                .is_none()
        );
    })
    .await;
}
