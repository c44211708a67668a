//! Faults that are not crashes: a locked store, a stale lease, callbacks
//! that match nothing, an effect target that never confirms.

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::Connection;

use crate::harness::{Backend, Options, TestApp, WAIT, backend, confirm};

/// Another client holding the store's write lock: SQLite's database lock,
/// or PostgreSQL's lock on the inbox table.
enum StoreLock {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
}

impl StoreLock {
    async fn take(app: &TestApp) -> StoreLock {
        match backend() {
            Backend::Sqlite => {
                let url = format!("sqlite://{}", app.db_path().display());
                let mut c = sqlx::SqliteConnection::connect(&url).await.expect("second connection");
                sqlx::query("BEGIN EXCLUSIVE").execute(&mut c).await.expect("lock");
                StoreLock::Sqlite(c)
            }
            Backend::Postgres(_) => {
                let mut c = sqlx::PgConnection::connect(&app.store_url()).await.expect("second connection");
                sqlx::query("BEGIN").execute(&mut c).await.expect("begin");
                sqlx::query("LOCK TABLE inbox IN EXCLUSIVE MODE").execute(&mut c).await.expect("lock");
                StoreLock::Postgres(c)
            }
        }
    }

    async fn release(self) {
        match self {
            StoreLock::Sqlite(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.expect("unlock");
            }
            StoreLock::Postgres(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.expect("unlock");
            }
        }
    }
}

both_engines! {
async fn a_locked_store_answers_503_acknowledges_nothing_and_recovers() {
    let app = TestApp::spawn_with(Options {
        extra_toml: String::new(),
        store_busy_ms: Some(200),
        ..Options::default()
    })
    .await;
    let id = app.enqueue_ok(&confirm("locked")).await;
    let decision = app.decision_of(&id).await;

    let lock = StoreLock::take(&app).await;
    let (body, sig) = app.signed_callback(&decision, "yes");
    let (status, err) = app.post_callback(&body, Some(&sig)).await;
    assert_eq!(status, 503, "{err}");
    assert_eq!(err["code"], "store_unavailable");
    // The sandbox's own callback meets the same lock and keeps retrying.
    app.answer(&decision, "yes").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        app.sandbox.decision(&decision).expect("d").callback.delivered_at,
        None,
        "nothing acknowledged"
    );
    // Readers are not blocked (WAL; EXCLUSIVE lets SELECT through).
    assert_eq!(app.inbox_len().await, 0, "nothing was stored while locked");
    lock.release().await;
    // Pushary retries until it gets a 2xx; do what its next retry would.
    let start = Instant::now();
    while app.post_callback(&body, Some(&sig)).await.0 != 200 {
        assert!(start.elapsed() < WAIT, "the store never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
}
}

// PostgreSQL only: leases in the table are how replicas share threads. On
// SQLite one process serves the store and the in-process claim is the
// whole lease (docs/decisions.md §14); no lease row is ever written there,
// and a thread named to its workers is taken whatever the table says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_held_by_a_dead_worker_is_taken_over_when_its_lease_expires() {
    let Some(backend) = crate::harness::Backend::postgres("faults::a_thread_held_by_a_dead_worker") else {
        return;
    };
    crate::harness::BACKEND.scope(backend, taken_over_when_the_lease_expires()).await;
}

async fn taken_over_when_the_lease_expires() {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let now = approvald::clock::now_ms();
    assert!(
        app.store()
            .acquire_lease("default", "thread-lease", "dead-worker", now, now + 1000)
            .await
            .expect("lease")
    );
    let id = app.enqueue_ok(&confirm("lease")).await;
    app.drain().await;
    assert_eq!(app.get(&id).await["state"], "enqueued", "the thread is held by someone else");
    let start = Instant::now();
    loop {
        app.drain().await;
        if app.get(&id).await["state"] == "pending" {
            break;
        }
        assert!(start.elapsed() < WAIT, "the lease never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(start.elapsed() >= Duration::from_millis(500), "taken over only after expiry");
}

both_engines! {
async fn callbacks_that_never_match_become_visible_orphans_and_revive_if_their_operation_appears() {
    let app = TestApp::spawn_with(Options {
        manual: true,
        extra_toml: String::new(),
        orphan_after_secs: Some(0),
        ..Options::default()
    })
    .await;
    let (body, sig) = app.signed_callback("dec_stray", "yes");
    assert_eq!(app.post_callback(&body, Some(&sig)).await.0, 200);
    // (The reconciler's own first sweep may have got there first.)
    app.engine.reconcile_once().await.expect("sweep");
    let orphans = app.store().list_inbox(Some("orphaned"), 10).await.expect("inbox");
    assert_eq!(orphans.len(), 1);
    assert_eq!(orphans[0].correlation_id, "dec_stray");
    // Listed through the API too, and never deleted.
    let listed: serde_json::Value = app
        .http
        .get(format!("{}/v1/inbox?state=orphaned", app.base))
        .bearer_auth(crate::harness::TOKEN)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("json");
    assert_eq!(listed["entries"][0]["correlationId"], "dec_stray");

    // An early answer marked orphaned (the opener was down for long) comes
    // back to life once its operation records the decision id.
    let id = app.enqueue_ok(&confirm("revive")).await;
    let decision = app.create_decision_first(&id).await;
    app.sandbox.answer(&decision, "yes", approvald::sandbox::CallbackMode::Drop).await.expect("answer");
    let (b, s) = app.signed_callback(&decision, "yes");
    assert_eq!(app.post_callback(&b, Some(&s)).await.0, 200);
    app.engine.reconcile_once().await.expect("sweep");
    let entry = app.store().inbox_by_correlation("default", &decision).await.expect("store").expect("entry");
    assert_eq!(entry.state, "orphaned");
    app.drain().await;
    let op = app.get(&id).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
}
}

both_engines! {
async fn an_effect_target_that_never_confirms_is_retried_with_one_key_then_uncertain() {
    let app = TestApp::spawn().await;
    app.sandbox.set_effect_response(503, 10_000);
    let mut body = confirm("effect-down");
    body["expiresInSeconds"] = json!(3);
    let id = app.enqueue_ok(&body).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "yes").await;
    let op = app.wait_state(&id, &["uncertain", "succeeded", "failed"]).await;
    assert_eq!(op["state"], "uncertain", "{op:#}");
    let seen: Vec<_> =
        app.sandbox.effect_deliveries().into_iter().filter(|e| e.body["operationId"] == id).collect();
    assert!(seen.len() >= 2, "retried: {}", seen.len());
    assert_eq!(
        seen.iter().map(|e| e.idempotency_key.clone()).collect::<std::collections::BTreeSet<_>>().len(),
        1
    );
    assert!(seen.iter().all(|e| !e.executed));
    assert_eq!(app.sandbox.consume_calls(&decision), 1, "never a second approval");
}
}

both_engines! {
async fn a_rejection_whose_target_fails_is_retried_until_it_is_delivered() {
    let app = TestApp::spawn().await;
    app.sandbox.set_effect_response(500, 3);
    let id = app.enqueue_ok(&confirm("reject-retry")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "no").await;
    let op = app.wait_op(&id, "delivered", |o| o["delivery"] == "done").await;
    assert_eq!(op["state"], "denied");
    assert_eq!(app.deliveries_for(&id).len(), 4);
}
}

both_engines! {
async fn a_lost_consume_response_then_already_consumed_is_uncertain_and_never_runs() {
    let app = TestApp::spawn_with(Options { pushary_timeout_secs: Some(1), ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("lost-consume")).await;
    let decision = app.decision_of(&id).await;
    // Pushary consumes, but the answer arrives after approvald stopped waiting.
    app.sandbox.delay_next_consume_response(Duration::from_millis(2500));
    app.answer(&decision, "yes").await;
    let op = app.wait_state(&id, &["uncertain", "succeeded", "refused"]).await;
    assert_eq!(op["state"], "uncertain", "{op:#}");
    assert_eq!(app.sandbox.consume_calls(&decision), 2, "the retry met already_consumed");
    assert!(app.sandbox.decision(&decision).expect("d").permit.is_some(), "Pushary did spend the permit");
    assert!(app.deliveries_for(&id).is_empty(), "never run");
    assert!(op["permitId"].is_null());

    // The operator resolves it through the API, saying who and why.
    let resolve = |body: serde_json::Value| {
        app.http
            .post(format!("{}/v1/operations/{id}/resolve", app.base))
            .bearer_auth(crate::harness::TOKEN)
            .json(&body)
            .send()
    };
    let r = resolve(json!({"outcome": "failed", "by": "bob"})).await.expect("send");
    assert_eq!(r.status().as_u16(), 422);
    assert_eq!(r.json::<serde_json::Value>().await.expect("json")["field"], "note");
    let r = resolve(json!({"outcome": "maybe", "note": "n", "by": "bob"})).await.expect("send");
    assert_eq!(r.status().as_u16(), 422);
    assert_eq!(r.json::<serde_json::Value>().await.expect("json")["field"], "outcome");
    assert_eq!(app.get(&id).await["state"], "uncertain", "bad requests changed nothing");
    let r = resolve(json!({"outcome": "failed", "note": "no refund in the ledger", "by": "bob"}))
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let op = app.get(&id).await;
    assert_eq!(op["state"], "failed");
    let last = op["transitions"].as_array().expect("h").last().expect("last").clone();
    assert_eq!(last["actor"], "operator:bob");
    assert!(last["cause"].as_str().unwrap_or("").contains("no refund in the ledger"));
    let again = resolve(json!({"outcome": "succeeded", "note": "oops", "by": "bob"})).await.expect("send");
    assert_eq!(again.status().as_u16(), 409);
    assert_eq!(again.json::<serde_json::Value>().await.expect("json")["code"], "not_uncertain");

    // The inbox entry, with the exact body received, is there to inspect.
    let entry = app.store().inbox_by_correlation("default", &decision).await.expect("store").expect("entry");
    let shown: serde_json::Value = app
        .http
        .get(format!("{}/v1/inbox/{}", app.base, entry.id))
        .bearer_auth(crate::harness::TOKEN)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(shown["operationId"], id);
    assert!(shown["body"].as_str().unwrap_or("").contains(&decision));
}
}

both_engines! {
async fn pushary_5xx_is_retried_by_the_opener_with_the_identical_payload() {
    let app = TestApp::spawn().await;
    app.sandbox.fail_next_api_calls(503, 3);
    let id = app.enqueue_ok(&confirm("opener-5xx")).await;
    let decision = app.decision_of(&id).await;
    assert_eq!(app.sandbox.decisions().len(), 1, "one decision, however many attempts");
    assert_eq!(
        app.sandbox.decision(&decision).expect("d").idempotency_key.as_deref().map(str::len),
        Some(40)
    );
    let op = app.get(&id).await;
    assert!(op["transitions"].as_array().expect("h").iter().any(|t| t["to"] == "pending"));
}
}

both_engines! {
async fn pushary_5xx_during_a_poll_is_retried_until_the_answer_is_found() {
    let app = TestApp::spawn_with(Options { poll_after_secs: Some(0), ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("poll-5xx")).await;
    let decision = app.decision_of(&id).await;
    app.sandbox.answer(&decision, "yes", approvald::sandbox::CallbackMode::Drop).await.expect("answer");
    app.sandbox.fail_next_api_calls(503, 2);
    let start = Instant::now();
    loop {
        let sweep = app.engine.reconcile_once().await.expect("sweep");
        if sweep.answers_found > 0 {
            break;
        }
        assert!(start.elapsed() < WAIT, "the answer was never found");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let op = app.wait_op(&id, "done", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
}
}

both_engines! {
async fn an_unreachable_pushary_is_never_permission_and_the_deadline_still_ends_it() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let app = TestApp::spawn_with(Options {
        pushary_base_url: Some(format!("http://127.0.0.1:{port}/api/v1/server")),
        pushary_timeout_secs: Some(1),
        ..Options::default()
    })
    .await;
    let mut body = confirm("unreachable-pushary");
    body["expiresInSeconds"] = json!(2);
    let id = app.enqueue_ok(&body).await;
    let retrying = app.wait_op(&id, "retried", |o| o["lastError"].as_str().is_some()).await;
    assert_eq!(retrying["state"], "enqueued");
    assert!(retrying["lastError"].as_str().unwrap_or("").contains("unreachable"), "{retrying:#}");
    app.wait_state(&id, &["expired"]).await;
    let op = app.wait_op(&id, "expiry delivered", |o| o["delivery"] == "done").await;
    assert!(op["permitId"].is_null());
    assert_eq!(app.deliveries_for(&id).len(), 1, "the expiry is delivered as a rejection");
    assert_eq!(app.deliveries_for(&id)[0]["status"], "expired");
}
}

both_engines! {
async fn a_thread_lease_is_exclusive_until_it_expires_and_then_lost_by_its_old_owner() {
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let s = app.store();
    let now = approvald::clock::now_ms();
    assert!(s.acquire_lease("default", "t", "a", now, now + 1000).await.expect("store"));
    assert!(!s.acquire_lease("default", "t", "b", now + 999, now + 2000).await.expect("store"));
    assert!(!s.renew_lease("default", "t", "b", now + 2000).await.expect("store"));
    assert!(s.acquire_lease("default", "other-thread", "b", now, now + 1000).await.expect("store"));
    assert!(
        s.acquire_lease("default", "t", "b", now + 1000, now + 2000).await.expect("store"),
        "expired: taken"
    );
    assert!(!s.renew_lease("default", "t", "a", now + 3000).await.expect("store"), "the old owner lost it");
}
}

both_engines! {
async fn concurrent_saves_of_one_version_move_an_operation_once_and_record_only_the_winner() {
    // On SQLite concurrent saves run together in one statement of the
    // writer (src/store/save/sqlite.rs); each must still be its own
    // compare-and-set.
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let mut ids = Vec::new();
    for i in 0..12 {
        ids.push(app.enqueue_ok(&confirm(&format!("race-{i}"))).await);
    }
    let store = app.store();
    let mut racers = tokio::task::JoinSet::new();
    for id in &ids {
        let op = store.get_operation(None, id).await.expect("read").expect("exists");
        for who in ["a", "b"] {
            let mut op = op.clone();
            op.last_error = Some(format!("saved by {who}"));
            let t = approvald::store::Transition::new(
                Some(op.state),
                op.state,
                op.updated_at,
                format!("racer {who}"),
                "test",
            );
            let store = store.clone();
            racers.spawn(async move {
                let saved = store.save(&mut op, &[t], None).await.expect("save");
                (op.id.clone(), who, saved)
            });
        }
    }
    let results = racers.join_all().await;
    for id in &ids {
        let winners: Vec<&str> =
            results.iter().filter(|(i, _, saved)| i == id && *saved).map(|(_, who, _)| *who).collect();
        assert_eq!(winners.len(), 1, "{id}: exactly one racer wins, got {winners:?}");
        let op = store.get_operation(None, id).await.expect("read").expect("exists");
        assert_eq!(op.last_error.as_deref(), Some(format!("saved by {}", winners[0]).as_str()));
        let causes: Vec<String> =
            store.transitions(id).await.expect("transitions").into_iter().map(|t| t.cause).collect();
        assert!(causes.contains(&format!("racer {}", winners[0])), "{id}: {causes:?}");
        let losers = causes.iter().filter(|c| c.starts_with("racer")).count();
        assert_eq!(losers, 1, "{id}: only the winner's transition is recorded: {causes:?}");
    }
}
}

both_engines! {
async fn a_save_that_fails_beside_others_fails_alone_and_leaves_nothing_behind() {
    // However the saves are grouped (on SQLite, those queued together run
    // as one statement: src/store/save/sqlite.rs, whose unit tests build
    // such a batch), one that breaks a constraint takes only itself down,
    // with nothing of it kept (not even the calls it noted).
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let store = app.store();
    let mut ops = Vec::new();
    for i in 0..12 {
        let id = app.enqueue_ok(&confirm(&format!("fails-alone-{i}"))).await;
        ops.push(store.get_operation(None, &id).await.expect("read").expect("exists"));
    }
    // The first one holds a decision id; the second one will claim it too.
    let mut holder = ops[0].clone();
    holder.decision_id = Some("dec-held-once".into());
    assert!(store.save(&mut holder, &[], None).await.expect("save"));
    let mut savers = tokio::task::JoinSet::new();
    for (n, op) in ops.iter().enumerate().skip(1) {
        let mut op = op.clone();
        op.last_error = Some("saved beside the failing one".into());
        if n == 1 {
            op.decision_id = Some("dec-held-once".into());
        }
        op.unrecorded_calls.push(approvald::store::PusharyCall {
            operation_id: op.id.clone(),
            call: "create_decision".into(),
            started_at: op.updated_at,
            duration_ms: 1,
            status_code: Some(201),
            error: None,
        });
        let t = approvald::store::Transition::new(Some(op.state), op.state, op.updated_at, "saver", "test");
        let store = store.clone();
        savers.spawn(async move { (n, op.id.clone(), store.save(&mut op, &[t], None).await) });
    }
    for (n, id, result) in savers.join_all().await {
        let op = store.get_operation(None, &id).await.expect("read").expect("exists");
        let causes: Vec<String> =
            store.transitions(&id).await.expect("transitions").into_iter().map(|t| t.cause).collect();
        let calls = store.pushary_calls(&id).await.expect("calls");
        if n == 1 {
            let e = result.expect_err("a second holder of one decision id is refused");
            assert!(e.to_string().to_lowercase().contains("unique"), "{e}");
            assert_eq!(op.version, ops[1].version, "unchanged");
            assert!(op.decision_id.is_none() && op.last_error.is_none(), "{op:?}");
            assert!(!causes.iter().any(|c| c == "saver"), "{causes:?}");
            assert!(calls.is_empty(), "nothing of the failed save is kept: {calls:?}");
        } else {
            assert!(result.expect("saves"), "{id}: saved");
            assert_eq!(op.last_error.as_deref(), Some("saved beside the failing one"));
            assert!(causes.iter().any(|c| c == "saver"), "{causes:?}");
            assert_eq!(calls.len(), 1, "{calls:?}");
        }
    }
}
}

both_engines! {
async fn the_visits_last_read_gives_up_the_lease_only_when_nothing_is_due() {
    // On PostgreSQL the read that finds a held thread's work gives the
    // lease up in the same statement when nothing is due now (the release
    // was a round trip of its own); it keeps it while work is due.
    let app = TestApp::spawn_with(Options { manual: true, ..Options::default() }).await;
    let s = app.store();
    let now = approvald::clock::now_ms();
    async fn leases(app: &TestApp, thread: &str) -> i64 {
        let pool = app.store().pg_pool().expect("PostgreSQL");
        sqlx::query_scalar("SELECT count(*) FROM thread_leases WHERE thread_id = $1")
            .bind(thread)
            .fetch_one(pool)
            .await
            .expect("reads")
    }
    app.enqueue_ok(&confirm("due")).await;
    assert!(s.acquire_lease("default", "thread-due", "w", now, now + 60_000).await.expect("lease"));
    let (work, given_up) =
        s.next_work_or_release("default", "thread-due", approvald::clock::now_ms(), "w").await.expect("reads");
    assert!(work.is_some(), "the open step is due");
    assert!(!given_up, "work is due: the lease is kept");
    assert!(s.acquire_lease("default", "thread-idle", "w", now, now + 60_000).await.expect("lease"));
    let (work, given_up) =
        s.next_work_or_release("default", "thread-idle", approvald::clock::now_ms(), "w").await.expect("reads");
    assert!(work.is_none());
    if s.is_postgres() {
        assert!(given_up, "nothing due: the lease is given up");
        assert_eq!((leases(&app, "thread-due").await, leases(&app, "thread-idle").await), (1, 0));
        // Another's lease is never given up by this read.
        assert!(s.acquire_lease("default", "thread-other", "x", now, now + 60_000).await.expect("lease"));
        let (_, given_up) = s
            .next_work_or_release("default", "thread-other", approvald::clock::now_ms(), "w")
            .await
            .expect("reads");
        assert!(given_up, "nothing is due on it");
        assert_eq!(leases(&app, "thread-other").await, 1, "still held by its owner");
    } else {
        assert!(!given_up, "SQLite keeps no lease rows for workers (decisions §14)");
    }
}
}

/// The server restarted under a running daemon: every connection of its
/// pool cut at once. Connections used a moment ago are not pinged before
/// their next statement (only those idle for a while are), so requests
/// may be refused with 503 while the pool sheds the dead ones; a callback
/// is never acknowledged unstored, Pushary's retry then stores it, and
/// the approval completes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_under_the_daemon_cost_503s_then_the_approval_completes() {
    let Some(pg) = Backend::postgres(module_path!()) else {
        return;
    };
    crate::harness::BACKEND
        .scope(pg, async {
            let app = TestApp::spawn().await;
            let id = app.enqueue_ok(&confirm("cut")).await;
            let decision = app.decision_of(&id).await;
            // Answered at Pushary; its callback is the one posted below.
            app.sandbox
                .answer(&decision, "yes", approvald::sandbox::CallbackMode::Drop)
                .await
                .expect("answers");
            let size = app.store().pg_pool().expect("PostgreSQL").size() as usize;
            let mut admin = sqlx::PgConnection::connect(&app.store_url()).await.expect("connects");
            let cut: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = 'approvald') t",
            )
            .fetch_one(&mut admin)
            .await
            .expect("terminates");
            assert!(cut > 0, "the daemon had no connection to cut");

            let (body, sig) = app.signed_callback(&decision, "yes");
            let mut refused = 0;
            loop {
                let (status, reply) = app.post_callback(&body, Some(&sig)).await;
                match status {
                    200 => break,
                    503 => assert_eq!(reply["code"], "store_unavailable", "{reply}"),
                    other => panic!("the callback was answered {other}: {reply}"),
                }
                refused += 1;
                assert!(refused <= size + 2, "still refused after {refused} tries ({size} connections cut)");
            }
            // Reads may meet a dead connection too: 503, never anything else.
            let start = Instant::now();
            loop {
                let (status, op) = app.get_status(&id).await;
                assert!(status == 200 || status == 503, "{status}: {op}");
                if op["state"] == "succeeded" {
                    break;
                }
                assert!(start.elapsed() < WAIT, "never succeeded after the cut: {op:#}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(app.deliveries_for(&id).len(), 1, "delivered once");
        })
        .await;
}
