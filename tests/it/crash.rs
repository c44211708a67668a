//! Crash harness: the real binary, killed with SIGKILL at every fault
//! point, restarted, and checked against the guarantees.

use approvald::sandbox::CallbackMode;
use serde_json::Value;

use crate::daemon::Daemon;
use crate::harness::confirm;

const TERMINAL: &[&str] = &[
    "succeeded",
    "failed",
    "uncertain",
    "expired",
    "cancelled",
    "denied",
    "invalid",
    "refused",
    "unreachable",
];

/// Invariants after the dust settles: at most one execution per operation,
/// at most one consume that succeeded, and the operation terminal.
fn check(d: &Daemon, op: &Value, decision: &str) {
    let key = op["idempotencyKey"].as_str().map(str::to_string);
    let executions = d
        .sandbox
        .effect_deliveries()
        .iter()
        .filter(|e| e.body["operationId"] == op["id"] && e.executed)
        .count();
    assert!(executions <= 1, "the effect ran {executions} times: {op:#}");
    if let Some(k) = key {
        assert!(d.sandbox.effect_executions(&k) <= 1);
    }
    let dv = d.sandbox.decision(decision).expect("decision");
    assert!(dv.permit.is_some() || op["permitId"].is_null(), "a permit id never issued: {op:#}");
    assert!(TERMINAL.contains(&op["state"].as_str().unwrap_or("")), "not terminal: {op:#}");
}

/// Starts armed with `fault`, runs one approval into it, restarts clean and
/// waits for the operation to settle. Returns (operation, decision id).
async fn crash_at(fault: &str, extra: &str, callback: CallbackMode) -> (Daemon, Value, String) {
    let mut d = Daemon::new(extra).await;
    d.start(Some(fault)).await;
    let id = d.enqueue(&confirm(fault)).await;
    let op = d.wait_op(&id, "pending", |o| o["state"] == "pending").await;
    let decision = op["decisionId"].as_str().expect("decision").to_string();
    d.sandbox.answer(&decision, "yes", callback).await.expect("answer");
    d.wait_for_fault(fault).await;
    d.start(None).await;
    let op = d
        .wait_op(&id, "settled", |o| {
            TERMINAL.contains(&o["state"].as_str().unwrap_or("")) && o["receipt"] != "pending"
        })
        .await;
    (d, op, decision)
}

both_engines! {
async fn killed_after_the_inbox_commit_before_the_ack_the_callback_is_still_processed() {
    let (d, op, decision) = crash_at("after_inbox_commit", "", CallbackMode::Send).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    assert_eq!(d.sandbox.consume_calls(&decision), 1);
    check(&d, &op, &decision);
    // Pushary saw no 2xx for the first attempt and retries until one comes;
    // the retry is acknowledged as a duplicate and changes nothing.
    let delivered = d
        .sandbox
        .wait_for(crate::harness::WAIT, |s| {
            s.decision(&decision).is_some_and(|v| v.callback.delivered_at.is_some())
        })
        .await;
    assert!(delivered, "the sandbox's retry is acknowledged");
    let dv = d.sandbox.decision(&decision).expect("decision");
    assert!(dv.callback.attempts >= 2, "{:?}", dv.callback);
    let after = d.get(op["id"].as_str().expect("id")).await.expect("op");
    assert_eq!(after["transitions"], op["transitions"], "the duplicate changed nothing");
    assert_eq!(d.sandbox.consume_calls(&decision), 1);
}
}

both_engines! {
async fn killed_before_the_consume_call_the_permit_is_consumed_once_on_restart() {
    let (d, op, decision) = crash_at("after_consume_inflight_recorded", "", CallbackMode::Send).await;
    // The first consume never left the process; the retry is the first one Pushary sees.
    assert_eq!(op["state"], "succeeded", "{op:#}");
    assert_eq!(d.sandbox.consume_calls(&decision), 1);
    check(&d, &op, &decision);
}
}

both_engines! {
async fn killed_after_consume_returned_before_recording_the_permit_ends_uncertain_never_run() {
    let (d, op, decision) = crash_at("after_consume_returned", "", CallbackMode::Send).await;
    assert_eq!(op["state"], "uncertain", "{op:#}");
    assert_eq!(d.sandbox.consume_calls(&decision), 2, "one consume, one retry that was refused");
    assert!(
        d.sandbox.effect_deliveries().iter().all(|e| e.body["operationId"] != op["id"]),
        "never delivered"
    );
    check(&d, &op, &decision);
    // The operator checks, finds nothing ran, and resolves it.
    let out = d.cli(&[
        "ops",
        "resolve",
        op["id"].as_str().expect("id"),
        "--outcome",
        "failed",
        "--note",
        "effect log shows no refund",
        "--by",
        "alice",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let resolved = d.wait_op(op["id"].as_str().expect("id"), "resolved", |o| o["state"] == "failed").await;
    let last = resolved["transitions"].as_array().expect("history").last().expect("last").clone();
    assert_eq!(last["actor"], "operator:alice");
    assert!(last["cause"].as_str().unwrap_or("").contains("no refund"));
}
}

both_engines! {
async fn killed_after_delivering_was_recorded_before_the_call_ends_uncertain_not_redelivered() {
    let (d, op, decision) = crash_at("after_delivering_recorded", "", CallbackMode::Send).await;
    assert_eq!(op["state"], "uncertain", "{op:#}");
    assert_eq!(d.sandbox.consume_calls(&decision), 1);
    check(&d, &op, &decision);
}
}

both_engines! {
async fn killed_after_delivering_was_recorded_a_redeliver_safe_target_gets_it_again_once() {
    let (d, op, decision) =
        crash_at("after_delivering_recorded", "redeliver_safe = true", CallbackMode::Send).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    check(&d, &op, &decision);
}
}

both_engines! {
async fn killed_after_the_effect_answered_2xx_ends_uncertain_with_one_execution() {
    let (d, op, decision) = crash_at("after_effect_answered", "", CallbackMode::Send).await;
    assert_eq!(op["state"], "uncertain", "{op:#}");
    let key = op["idempotencyKey"].as_str().map(str::to_string);
    let executed = d.sandbox.effect_deliveries().iter().filter(|e| e.body["operationId"] == op["id"]).count();
    assert_eq!(executed, 1, "delivered once, never again");
    assert!(key.is_none() || d.sandbox.effect_executions(key.as_deref().unwrap_or("")) <= 1);
    check(&d, &op, &decision);
}
}

both_engines! {
async fn killed_after_the_effect_answered_a_redeliver_safe_target_replays_without_a_second_execution() {
    let (d, op, decision) =
        crash_at("after_effect_answered", "redeliver_safe = true", CallbackMode::Send).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    let deliveries: Vec<_> =
        d.sandbox.effect_deliveries().into_iter().filter(|e| e.body["operationId"] == op["id"]).collect();
    assert_eq!(deliveries.len(), 2, "delivered again with the same key");
    assert_eq!(deliveries.iter().filter(|e| e.executed).count(), 1, "executed once");
    check(&d, &op, &decision);
}
}

both_engines! {
async fn killed_before_the_receipt_the_receipt_is_recorded_after_restart() {
    let (d, op, decision) = crash_at("before_receipt", "", CallbackMode::Send).await;
    assert_eq!(op["state"], "succeeded", "{op:#}");
    assert_eq!(op["receipt"], "recorded");
    let permit = op["permitId"].as_str().expect("permit");
    assert_eq!(d.sandbox.receipts(permit).expect("receipt").outcome, "succeeded");
    check(&d, &op, &decision);
}
}
