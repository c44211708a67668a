//! Work is found by the wake-ups that name it, not by the safety-net poll:
//! these tests set that poll to an hour, so anything left to it fails them.
//! A worker reads the store for work only when something may have put work
//! there that no one named (docs/decisions.md §33); a thread named to a
//! worker while another held it is named again when its holder lets go.

use std::time::{Duration, Instant};

use approvald::sandbox::CallbackMode;
use serde_json::json;

use crate::harness::{Options, TOKEN, TestApp, WAIT, confirm};

const HOUR: Duration = Duration::from_secs(3600);

both_engines! {
async fn a_burst_of_answers_on_few_threads_finishes_without_the_safety_net() {
    let app = TestApp::spawn_with(Options { idle_poll: Some(HOUR), ..Options::default() }).await;
    let (threads, per_thread) = (6, 8);
    let mut ids = Vec::new();
    for k in 0..per_thread {
        for t in 0..threads {
            let mut body = confirm(&format!("burst-{t}-{k}"));
            body["threadId"] = json!(format!("burst-thread-{t}"));
            ids.push(app.enqueue_ok(&body).await);
        }
    }
    let mut decisions = Vec::new();
    for id in &ids {
        decisions.push(app.decision_of(id).await);
    }
    // Every answer at once: each thread is named to the workers again and
    // again while one of them holds it.
    let mut answers = tokio::task::JoinSet::new();
    for d in decisions {
        let sandbox = app.sandbox.clone();
        answers.spawn(async move { sandbox.answer(&d, "yes", CallbackMode::Send).await.expect("sandbox answers") });
    }
    answers.join_all().await;
    let start = Instant::now();
    for id in &ids {
        let op = app.wait_op(id, "receipt recorded", |o| o["receipt"] == "recorded").await;
        assert_eq!(op["state"], "succeeded", "{id}");
    }
    assert!(start.elapsed() < WAIT, "took {:?}", start.elapsed());
}
}

both_engines! {
async fn a_retry_scheduled_for_later_runs_without_the_safety_net() {
    let app = TestApp::spawn_with(Options { idle_poll: Some(HOUR), ..Options::default() }).await;
    app.sandbox.set_effect_response(503, 3);
    let id = app.enqueue_ok(&confirm("later")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "yes").await;
    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
    let attempts = app.sandbox.effect_deliveries().iter().filter(|e| e.body["operationId"] == id).count();
    assert_eq!(attempts, 4, "three 503s, each retried at its scheduled time, then a success");
}
}

// Operations enqueued while their thread is being worked are found by the
// holder or named again when it lets go.
both_engines! {
async fn operations_enqueued_while_their_thread_is_worked_are_opened() {
    let app = TestApp::spawn_with(Options { idle_poll: Some(HOUR), ..Options::default() }).await;
    let mut enqueues = tokio::task::JoinSet::new();
    for k in 0..24 {
        let (http, base) = (app.http.clone(), app.base.clone());
        enqueues.spawn(async move {
            let mut body = confirm(&format!("opening-{k}"));
            body["threadId"] = json!(format!("opening-thread-{}", k % 3));
            let r = http.post(format!("{base}/v1/operations")).bearer_auth(TOKEN).json(&body).send().await;
            let v: serde_json::Value = r.expect("enqueue").json().await.expect("json");
            v["id"].as_str().expect("id").to_owned()
        });
    }
    // `decision_of` waits at most WAIT for each: an operation left to the
    // safety net would wait an hour.
    for id in enqueues.join_all().await {
        app.decision_of(&id).await;
    }
}
}

// A worker held by a slow call is not woken for other work: wake-ups go
// to idle workers. Each approval after the first wakes the idle worker
// that has waited longest; once every idle one has worked, a worker that
// stayed registered through its visit would be the longest waiter, and
// the next approval would wait for that visit's call to return.
both_engines! {
async fn a_worker_held_by_a_slow_call_does_not_take_wake_ups_from_idle_ones() {
    let app = TestApp::spawn_with(Options { idle_poll: Some(HOUR), ..Options::default() }).await;
    let slow = app.enqueue_ok(&confirm("slow")).await;
    let others: Vec<String> = {
        let mut ids = Vec::new();
        // Eight workers by default: seven idle ones, then the busy one.
        for k in 0..9 {
            ids.push(app.enqueue_ok(&confirm(&format!("quick-{k}"))).await);
        }
        ids
    };
    let slow_decision = app.decision_of(&slow).await;
    let mut decisions = Vec::new();
    for id in &others {
        decisions.push(app.decision_of(id).await);
    }
    // Under the client's 5-second timeout, so the slow call still succeeds.
    let hold = Duration::from_secs(4);
    app.sandbox.delay_next_consume_response(hold);
    app.answer(&slow_decision, "yes").await;
    let held_at = Instant::now();
    assert!(
        app.sandbox.wait_for(WAIT, |s| s.consume_calls(&slow_decision) == 1).await,
        "the slow approval's consume never came"
    );
    for (id, decision) in others.iter().zip(&decisions) {
        let start = Instant::now();
        app.answer(decision, "yes").await;
        app.wait_op(id, "delivered", |o| o["delivery"] == "done").await;
        assert!(start.elapsed() < Duration::from_secs(2), "{id} waited {:?} for a busy worker", start.elapsed());
    }
    assert!(held_at.elapsed() < hold, "the check ran while the slow call was held");
    let op = app.wait_op(&slow, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
}
}
