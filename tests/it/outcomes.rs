//! The approval loop end to end: every answer and refusal, over real HTTP.

use approvald::sandbox::Refusal;
use serde_json::json;

use crate::harness::{Options, TestApp, WAIT, confirm};

both_engines! {
async fn confirm_yes_consumes_once_delivers_the_permit_and_records_the_receipt() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_ok(&confirm("yes")).await;
    let decision = app.decision_of(&id).await;
    let created = app.sandbox.decision(&decision).expect("decision exists at the sandbox");
    assert_eq!(created.tool_name.as_deref(), Some("refund"));
    assert_eq!(created.callback_url, Some(format!("{}/v1/callbacks/pushary", app.base)));

    app.answer(&decision, "yes").await;
    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
    assert_eq!(app.sandbox.consume_calls(&decision), 1);

    let deliveries = app.deliveries_for(&id);
    assert_eq!(deliveries.len(), 1, "{deliveries:#?}");
    let d = &deliveries[0];
    let permit = op["permitId"].as_str().expect("permit id");
    assert_eq!(d["status"], "approved");
    assert_eq!(d["approved"], true);
    assert_eq!(d["permitId"], permit);
    assert_eq!(d["decisionId"], decision);
    assert_eq!(d["interruptId"], "interrupt-yes");
    assert_eq!(d["checkpointId"], "cp-1");
    assert_eq!(d["revision"], "rev-3");
    assert_eq!(d["subject"]["parameters"]["amount"], 40);
    let effect =
        app.sandbox.effect_deliveries().into_iter().find(|e| e.body["operationId"] == id).expect("seen");
    assert!(effect.verified, "the Standard Webhooks signature must verify");
    assert!(effect.executed);
    assert_eq!(effect.idempotency_key.as_deref(), d["idempotencyKey"].as_str());

    let receipt = app.sandbox.receipts(permit).expect("receipt at the sandbox");
    assert_eq!(receipt.outcome, "succeeded");
    let states: Vec<&str> = op["transitions"]
        .as_array()
        .expect("history")
        .iter()
        .map(|t| t["to"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(states, ["enqueued", "pending", "answered", "permitted", "delivering", "succeeded"]);
    assert_eq!(op["result"]["executed"], true, "the effect's 2xx body is kept as the result");
    // What the saves recorded beside the operation: one delivery attempt,
    // and each Pushary call once (on PostgreSQL each kind of row is a
    // statement the batch runs only when it carries one).
    let attempts = app.store().deliveries(&id).await.expect("store");
    assert_eq!(attempts.iter().map(|a| (a.attempt, a.status_code)).collect::<Vec<_>>(), [(1, Some(200))]);
    let mut calls: Vec<String> =
        app.store().pushary_calls(&id).await.expect("store").into_iter().map(|c| c.call).collect();
    calls.sort();
    assert_eq!(calls, ["consume", "create_decision", "record_receipt"]);
}
}

both_engines! {
async fn confirm_no_is_denied_and_delivered_as_a_rejection_without_consuming() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_ok(&confirm("no")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "no").await;
    let op = app.wait_op(&id, "rejection delivered", |o| o["delivery"] == "done").await;
    assert_eq!(op["state"], "denied");
    assert_eq!(app.sandbox.consume_calls(&decision), 0);
    let d = app.deliveries_for(&id);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0]["status"], "denied");
    assert_eq!(d[0]["approved"], false);
    assert!(d[0]["permitId"].is_null());
    assert_eq!(d[0]["answer"], "no");
}
}

both_engines! {
async fn select_and_input_answers_are_delivered_as_data_without_a_permit() {
    let app = TestApp::spawn().await;
    let mut select = confirm("select");
    select["type"] = json!("select");
    select["options"] = json!(["Zürich – Lager 2", "Bern"]);
    let mut input = confirm("input");
    input["type"] = json!("input");
    let sid = app.enqueue_ok(&select).await;
    let iid = app.enqueue_ok(&input).await;
    let sd = app.decision_of(&sid).await;
    let id_ = app.decision_of(&iid).await;
    app.answer(&sd, "Zürich – Lager 2").await;
    app.answer(&id_, "ship it on monday").await;
    for (op_id, decision, answer) in [(&sid, &sd, "Zürich – Lager 2"), (&iid, &id_, "ship it on monday")] {
        let op = app.wait_state(op_id, &["succeeded", "failed", "invalid"]).await;
        assert_eq!(op["state"], "succeeded", "{op:#}");
        assert_eq!(app.sandbox.consume_calls(decision), 0);
        let d = app.deliveries_for(op_id);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0]["status"], "answered");
        assert_eq!(d[0]["approved"], false);
        assert_eq!(d[0]["answer"], answer);
        assert!(d[0]["permitId"].is_null());
    }
}
}

// Answers the sandbox would never send, delivered as validly signed
// callbacks (a buggy or compromised peer): each fails closed.
both_engines! {
async fn malformed_answers_are_invalid_and_consume_nothing() {
    let app = TestApp::spawn().await;
    let mut cases = vec![];
    for (n, answer) in ["YES", " yes", "yes ", "Yes"].iter().enumerate() {
        cases.push((confirm(&format!("bad-confirm-{n}")), answer.to_string()));
    }
    let mut select = confirm("bad-select");
    select["type"] = json!("select");
    select["options"] = json!(["a", "b"]);
    cases.push((select, "c".into()));
    let mut input = confirm("bad-input");
    input["type"] = json!("input");
    cases.push((input, String::new()));
    let mut long = confirm("long-input");
    long["type"] = json!("input");
    cases.push((long, "x".repeat(5001)));

    for (body, answer) in cases {
        let id = app.enqueue_ok(&body).await;
        let decision = app.decision_of(&id).await;
        let (b, sig) = app.signed_callback(&decision, &answer);
        assert_eq!(app.post_callback(&b, Some(&sig)).await.0, 200);
        let op = app.wait_op(&id, "invalid delivered", |o| o["delivery"] == "done").await;
        assert_eq!(op["state"], "invalid", "answer {answer:?}: {op:#}");
        assert_eq!(app.sandbox.consume_calls(&decision), 0, "answer {answer:?}");
        let d = app.deliveries_for(&id);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0]["status"], "invalid");
        assert_eq!(d[0]["approved"], false);
    }
}
}

both_engines! {
async fn each_permit_refusal_ends_refused_and_nothing_approved_is_delivered() {
    let app = TestApp::spawn().await;
    for (n, refusal) in
        [Refusal::NotAuthorized, Refusal::ActionMismatch, Refusal::Expired, Refusal::AlreadyConsumed]
            .into_iter()
            .enumerate()
    {
        let id = app.enqueue_ok(&confirm(&format!("refusal-{n}"))).await;
        let decision = app.decision_of(&id).await;
        app.sandbox.set_consume_refusal(&decision, Some(refusal));
        app.answer(&decision, "yes").await;
        let op = app.wait_op(&id, "refusal delivered", |o| o["delivery"] == "done").await;
        assert_eq!(op["state"], "refused", "{refusal:?}: {op:#}");
        assert!(op["permitId"].is_null());
        assert_eq!(app.sandbox.consume_calls(&decision), 1);
        let d = app.deliveries_for(&id);
        assert_eq!(d.len(), 1, "{refusal:?}");
        assert_eq!(d[0]["status"], "refused");
        assert_eq!(d[0]["approved"], false);
        let cause = op["transitions"].as_array().expect("history").last().expect("last")["cause"].clone();
        assert!(cause.as_str().unwrap_or("").contains(refusal.as_str()), "{cause}");
    }
}
}

both_engines! {
async fn a_refused_recipient_is_unreachable_when_reachability_is_required() {
    let app = TestApp::spawn_with(Options { require_reachable: true, ..Options::default() }).await;
    let mut body = confirm("unreachable");
    body["externalId"] = json!("unreachable-user");
    let id = app.enqueue_ok(&body).await;
    let op = app.wait_op(&id, "unreachable delivered", |o| o["delivery"] == "done").await;
    assert_eq!(op["state"], "unreachable");
    assert!(op["decisionId"].is_null());
    assert!(app.sandbox.decisions().is_empty(), "no decision may be created");
    assert_eq!(app.deliveries_for(&id)[0]["status"], "unreachable");
}
}

both_engines! {
async fn delete_cancels_at_pushary_and_delivers_the_cancellation() {
    let app = TestApp::spawn().await;
    let id = app.enqueue_ok(&confirm("cancel")).await;
    let decision = app.decision_of(&id).await;
    let resp = app
        .http
        .delete(format!("{}/v1/operations/{id}", app.base))
        .bearer_auth(crate::harness::TOKEN)
        .send()
        .await
        .expect("delete");
    assert_eq!(resp.status().as_u16(), 200);
    let op = app.wait_op(&id, "cancellation delivered", |o| o["delivery"] == "done").await;
    assert_eq!(op["state"], "cancelled");
    assert_eq!(app.sandbox.decision(&decision).expect("exists").status, "cancelled");
    assert_eq!(app.deliveries_for(&id)[0]["status"], "cancelled");
    // A second cancel is refused and changes nothing.
    let again = app
        .http
        .delete(format!("{}/v1/operations/{id}", app.base))
        .bearer_auth(crate::harness::TOKEN)
        .send()
        .await
        .expect("delete");
    assert_eq!(again.status().as_u16(), 409);
    let body: serde_json::Value = again.json().await.expect("json");
    assert_eq!(body["code"], "not_cancellable");
}
}

both_engines! {
async fn an_effect_that_fails_with_5xx_is_retried_with_the_same_key_then_succeeds() {
    let app = TestApp::spawn().await;
    app.sandbox.set_effect_response(503, 2);
    let id = app.enqueue_ok(&confirm("retry")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "yes").await;
    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "succeeded");
    let seen: Vec<_> =
        app.sandbox.effect_deliveries().into_iter().filter(|e| e.body["operationId"] == id).collect();
    assert_eq!(seen.len(), 3, "two 503s then a success");
    let keys: std::collections::BTreeSet<_> = seen.iter().map(|e| e.idempotency_key.clone()).collect();
    assert_eq!(keys.len(), 1, "every attempt carries the same Idempotency-Key");
    let ids: std::collections::BTreeSet<_> =
        seen.iter().map(|e| e.headers.get("webhook-id").cloned()).collect();
    assert_eq!(ids.len(), 1, "webhook-id is stable across retries");
    assert_eq!(seen.iter().filter(|e| e.executed).count(), 1);
    assert_eq!(app.sandbox.consume_calls(&decision), 1);
}
}

both_engines! {
async fn an_effect_that_refuses_with_4xx_ends_failed_with_a_failed_receipt() {
    let app = TestApp::spawn().await;
    app.sandbox.set_effect_response(422, 1);
    let id = app.enqueue_ok(&confirm("refuse")).await;
    let decision = app.decision_of(&id).await;
    app.answer(&decision, "yes").await;
    let op = app.wait_op(&id, "receipt recorded", |o| o["receipt"] == "recorded").await;
    assert_eq!(op["state"], "failed");
    let permit = op["permitId"].as_str().expect("permit");
    assert_eq!(app.sandbox.receipts(permit).expect("receipt").outcome, "failed");
}
}

// Guarantee 4: answers of one thread resume in arrival order. The first
// answer's effect fails and is retried; the second answer waits for it.
both_engines! {
async fn answers_of_one_thread_resume_in_arrival_order_even_while_the_first_is_retried() {
    let app = TestApp::spawn().await;
    let mut a = confirm("order-a");
    let mut b = confirm("order-b");
    let mut c = confirm("order-c");
    for body in [&mut a, &mut b, &mut c] {
        body["threadId"] = json!("thread-ordered");
    }
    let (ia, ib, ic) = (app.enqueue_ok(&a).await, app.enqueue_ok(&b).await, app.enqueue_ok(&c).await);
    let (da, db, dc) = (app.decision_of(&ia).await, app.decision_of(&ib).await, app.decision_of(&ic).await);
    app.sandbox.set_effect_response(503, 3);
    app.answer(&da, "yes").await;
    app.wait_deliveries(&ia, 1).await;
    // Callbacks are sent concurrently; wait for b's so the arrival order is a, b, c.
    app.answer(&db, "no").await;
    assert!(
        app.sandbox
            .wait_for(WAIT, |s| s.decision(&db).is_some_and(|d| d.callback.delivered_at.is_some()))
            .await
    );
    app.answer(&dc, "yes").await;
    for id in [&ia, &ib, &ic] {
        app.wait_op(id, "delivered", |o| o["delivery"] == "done").await;
    }
    let order: Vec<String> = app
        .sandbox
        .effect_deliveries()
        .iter()
        .filter(|e| e.status == 200)
        .map(|e| e.body["operationId"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(order, [ia.clone(), ib.clone(), ic.clone()], "completed in arrival order");
    let all: Vec<String> = app
        .sandbox
        .effect_deliveries()
        .iter()
        .map(|e| e.body["operationId"].as_str().unwrap_or("").to_string())
        .collect();
    let last_a = all.iter().rposition(|x| *x == ia).expect("a delivered");
    let first_b = all.iter().position(|x| *x == ib).expect("b delivered");
    assert!(last_a < first_b, "b was not attempted before a finished: {all:?}");
}
}
