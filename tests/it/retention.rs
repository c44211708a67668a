//! Retention: finished operations are archived out of the working tables,
//! and what must outlive them still holds: a replayed callback, an enqueue
//! of the same key, a cancel or resolve all change nothing.

use serde_json::{Value, json};

use crate::harness::{Options, TOKEN, TestApp, confirm};

/// Runs an approval and a denial to the end; returns (id, decision, the
/// exact callback body Pushary sent) for each.
async fn finished_pair(app: &TestApp) -> Vec<(String, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (n, answer) in ["yes", "no"].iter().enumerate() {
        let id = app.enqueue_ok(&confirm(&format!("archived-{n}"))).await;
        let decision = app.decision_of(&id).await;
        app.answer(&decision, answer).await;
        app.wait_op(&id, "finished", |o| o["delivery"] == "done" && o["receipt"] != "pending").await;
        let body = app.sandbox.decision(&decision).expect("decision").callback.body.expect("sent");
        out.push((id, decision, body.into_bytes()));
    }
    out
}

async fn request(app: &TestApp, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut rb = app.http.request(method, format!("{}{path}", app.base)).bearer_auth(TOKEN);
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let r = rb.send().await.expect("send");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

both_engines! {
async fn a_replay_after_the_operation_was_archived_changes_nothing() {
    let app = TestApp::spawn_with(Options { archive_after_ms: Some(0), ..Options::default() }).await;
    let ops = finished_pair(&app).await;
    let mut before = Vec::new();
    for (id, _, _) in &ops {
        before.push(app.get(id).await);
    }
    let deliveries = app.sandbox.effect_deliveries().len();

    let sweep = app.engine.reconcile_once().await.expect("sweep");
    assert_eq!(sweep.archived, 2, "{sweep:?}");
    let store = app.store();
    for (i, (id, _, _)) in ops.iter().enumerate() {
        assert!(store.get_operation(None, id).await.expect("store").is_none(), "out of the working table");
        assert!(store.transitions(id).await.expect("store").is_empty());
        assert!(store.deliveries(id).await.expect("store").is_empty());
        // The resource is still served, as it was, plus when it was archived.
        let mut archived = app.get(id).await;
        assert!(archived["archivedAt"].is_string(), "{archived:#}");
        archived.as_object_mut().expect("object").remove("archivedAt");
        assert_eq!(archived, before[i]);
    }
    assert_eq!(app.inbox_len().await, 0, "inbox rows archived with their operations");

    // Replays of every earlier callback: acknowledged as duplicates, nothing changes.
    for (_, _, body) in &ops {
        let sig = approvald::pushary::signature::sign(&app.webhook_secret, body);
        for _ in 0..3 {
            assert_eq!(app.post_callback(body, Some(&sig)).await, (200, json!({"status": "duplicate"})));
        }
    }
    let sweep = app.engine.reconcile_once().await.expect("sweep");
    assert_eq!(sweep.archived, 0);
    assert_eq!(app.inbox_len().await, 0, "no replay entered the inbox");
    assert_eq!(app.sandbox.effect_deliveries().len(), deliveries, "no effect ran again");
    for (i, (id, decision, _)) in ops.iter().enumerate() {
        assert!(app.sandbox.consume_calls(decision) <= 1);
        let mut now = app.get(id).await;
        now.as_object_mut().expect("object").remove("archivedAt");
        assert_eq!(now, before[i], "nothing changed");
    }

    // The key is still taken: same content answers with the archived
    // operation, different content conflicts; it cannot be cancelled or resolved.
    let (id, _, _) = &ops[0];
    let (status, body) = app.enqueue(&confirm("archived-0")).await;
    assert_eq!((status, body["id"].as_str()), (200, Some(id.as_str())), "{body:#}");
    let mut other = confirm("archived-0");
    other["question"] = json!("Something else?");
    let (status, body) = app.enqueue(&other).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("operation_key_conflict")), "{body:#}");
    let (status, body) = request(&app, reqwest::Method::DELETE, &format!("/v1/operations/{id}"), None).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("not_cancellable")), "{body:#}");
    let resolve = json!({"outcome": "failed", "note": "n", "by": "bob"});
    let path = format!("/v1/operations/{id}/resolve");
    let (status, body) = request(&app, reqwest::Method::POST, &path, Some(resolve)).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("not_uncertain")), "{body:#}");
    let mut now = app.get(id).await;
    now.as_object_mut().expect("object").remove("archivedAt");
    assert_eq!(now, before[0], "refused requests changed nothing");
    assert_eq!(store.get_operation(None, id).await.expect("store").map(|o| o.id), None);
}
}

both_engines! {
async fn only_finished_operations_with_nothing_left_to_do_are_archived() {
    let app = TestApp::spawn_with(Options { archive_after_ms: Some(0), ..Options::default() }).await;
    // Pending: waits for its answer.
    let pending = app.enqueue_ok(&confirm("still-pending")).await;
    app.decision_of(&pending).await;
    // Uncertain: waits for an operator (the effect target keeps failing).
    app.sandbox.set_effect_response(503, 10_000);
    let uncertain_body = {
        let mut b = confirm("ends-uncertain");
        b["expiresInSeconds"] = json!(2);
        b
    };
    let uncertain = app.enqueue_ok(&uncertain_body).await;
    let decision = app.decision_of(&uncertain).await;
    app.answer(&decision, "yes").await;
    app.wait_state(&uncertain, &["uncertain"]).await;
    app.sandbox.set_effect_response(200, 0);

    let sweep = app.engine.reconcile_once().await.expect("sweep");
    assert_eq!(sweep.archived, 0, "{sweep:?}");
    for id in [&pending, &uncertain] {
        assert!(app.store().get_operation(None, id).await.expect("store").is_some(), "{id} kept");
    }
}
}

both_engines! {
async fn archiving_waits_for_the_retention_time() {
    let app = TestApp::spawn_with(Options { archive_after_ms: Some(3_600_000), ..Options::default() }).await;
    let ops = finished_pair(&app).await;
    let sweep = app.engine.reconcile_once().await.expect("sweep");
    assert_eq!(sweep.archived, 0);
    for (id, _, _) in &ops {
        assert!(app.store().get_operation(None, id).await.expect("store").is_some());
        assert!(app.get(id).await.get("archivedAt").is_none());
    }
}
}
