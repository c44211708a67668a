//! The reconciler: deadlines and missed callbacks.

use std::time::{Duration, Instant};

use approvald::sandbox::CallbackMode;
use serde_json::json;

use crate::harness::{Options, TestApp, WAIT, confirm};

both_engines! {
async fn an_unanswered_decision_expires_at_its_deadline_and_is_cancelled_at_pushary() {
    let app = TestApp::spawn().await;
    let mut body = confirm("expire");
    // Pushary's lifetime is sent in whole seconds, rounded up, so the local
    // deadline passes ~0.5 s before Pushary would expire the decision itself.
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(1500);
    body["deadline"] = json!(deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    let id = app.enqueue_ok(&body).await;
    let decision = app.decision_of(&id).await;
    let start = Instant::now();
    loop {
        app.engine.reconcile_once().await.expect("sweep");
        if app.get(&id).await["state"] == "expired" {
            break;
        }
        assert!(start.elapsed() < WAIT, "never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let op = app.wait_op(&id, "expiry delivered", |o| o["delivery"] == "done").await;
    assert_eq!(app.sandbox.decision(&decision).expect("exists").status, "cancelled");
    assert_eq!(app.sandbox.consume_calls(&decision), 0);
    let d = app.deliveries_for(&id);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0]["status"], "expired");
    assert_eq!(d[0]["approved"], false);
    assert!(op["transitions"].as_array().expect("history").iter().any(|t| t["actor"] == "reconciler"));

    // Answering after the deadline is refused at the sandbox, and a late
    // signed callback changes nothing here.
    let (b, sig) = app.signed_callback(&decision, "yes");
    assert_eq!(app.post_callback(&b, Some(&sig)).await.0, 200);
    app.drain().await;
    assert_eq!(app.get(&id).await["state"], "expired");
    assert_eq!(app.sandbox.consume_calls(&decision), 0);
}
}

both_engines! {
async fn a_dropped_callback_is_found_by_polling_and_the_operation_completes() {
    let app = TestApp::spawn_with(Options { poll_after_secs: Some(0), ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("dropped")).await;
    let decision = app.decision_of(&id).await;
    app.sandbox.answer(&decision, "yes", CallbackMode::Drop).await.expect("answer");
    assert_eq!(app.inbox_len().await, 0, "no callback arrived");
    let start = Instant::now();
    loop {
        let sweep = app.engine.reconcile_once().await.expect("sweep");
        if sweep.answers_found > 0 {
            break;
        }
        assert!(start.elapsed() < WAIT, "the poll never found the answer");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
    assert_eq!(app.deliveries_for(&id).len(), 1);
    let entry = app.store().inbox_by_correlation("default", &decision).await.expect("store").expect("entry");
    assert_eq!(entry.source, "poll");
}
}

both_engines! {
async fn a_decision_cancelled_at_pushary_is_found_by_polling() {
    let app = TestApp::spawn_with(Options { poll_after_secs: Some(0), ..Options::default() }).await;
    let id = app.enqueue_ok(&confirm("remote-cancel")).await;
    let decision = app.decision_of(&id).await;
    let resp = app
        .http
        .delete(format!("{}/decisions/{decision}", app.sandbox.base_url()))
        .bearer_auth(app.sandbox.api_key())
        .send()
        .await
        .expect("cancel at the sandbox");
    assert!(resp.status().is_success());
    let start = Instant::now();
    while app.get(&id).await["state"] != "cancelled" {
        app.engine.reconcile_once().await.expect("sweep");
        assert!(start.elapsed() < WAIT, "never noticed the cancellation");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let d = app.wait_deliveries(&id, 1).await;
    assert_eq!(d[0]["status"], "cancelled");
}
}
