//! Tenants: each with its own token, webhook secrets and effect targets;
//! nothing of one is visible to another, not even its existence.

use serde_json::{Value, json};

use crate::harness::{Options, TOKEN, TestApp, confirm};

const ACME: &str = "acme-token-0123456789";

/// acme shares the sandbox (same Pushary key and webhook secret) but has
/// its own token, a secret of its own, and its own target name.
async fn two_tenants() -> TestApp {
    TestApp::spawn_with(Options { extra_toml: "__ACME__".into(), ..Options::default() }).await
}

async fn call(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = app.http.request(method, format!("{}{path}", app.base)).bearer_auth(token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

both_engines! {
async fn a_tenant_cannot_see_or_touch_another_tenants_operations() {
    let app = two_tenants().await;
    let id = app.enqueue_ok(&confirm("mine")).await;
    app.decision_of(&id).await;
    let get = reqwest::Method::GET;
    let (s, body) = call(&app, get.clone(), &format!("/v1/operations/{id}"), ACME, None).await;
    assert_eq!((s, body["code"].as_str()), (404, Some("not_found")), "existence must not leak: {body}");
    let (s, _) = call(&app, reqwest::Method::DELETE, &format!("/v1/operations/{id}"), ACME, None).await;
    assert_eq!(s, 404);
    let (s, _) = call(&app, reqwest::Method::POST, &format!("/v1/operations/{id}/resolve"), ACME,
        Some(json!({"outcome": "failed", "note": "x", "by": "mallory"}))).await;
    assert_eq!(s, 404);
    let (s, list) = call(&app, get.clone(), "/v1/operations", ACME, None).await;
    assert_eq!(s, 200);
    assert_eq!(list["operations"].as_array().map(Vec::len), Some(0));
    // The default tenant's inbox: listed for it, invisible to acme.
    let (b, sig) = app.signed_callback("dec_default_only", "yes");
    assert_eq!(app.post_callback(&b, Some(&sig)).await.0, 200);
    let (_, mine) = call(&app, get.clone(), "/v1/inbox", TOKEN, None).await;
    let entry = mine["entries"][0]["id"].as_i64().expect("the default tenant sees its entry");
    let (s, inbox) = call(&app, get.clone(), "/v1/inbox", ACME, None).await;
    assert_eq!((s, inbox["entries"].as_array().map(Vec::len)), (200, Some(0)));
    let (s, _) = call(&app, get.clone(), &format!("/v1/inbox/{entry}"), ACME, None).await;
    assert_eq!(s, 404);
    // The default tenant's target name is not acme's.
    let (s, err) = call(&app, reqwest::Method::POST, "/v1/operations", ACME, Some(confirm("acme-1"))).await;
    assert_eq!((s, err["code"].as_str()), (422, Some("unknown_effect")), "{err}");
    // The same operation key in two tenants is two operations.
    let mut acme_op = confirm("mine");
    acme_op["effect"] = json!("acme-orders");
    let (s, created) = call(&app, reqwest::Method::POST, "/v1/operations", ACME, Some(acme_op)).await;
    assert_eq!(s, 201, "{created}");
    assert_ne!(created["id"], json!(id));
    let (s, _) = call(&app, get.clone(), &format!("/v1/operations/{}", created["id"].as_str().unwrap_or("")), TOKEN, None).await;
    assert_eq!(s, 404, "and the other way round");
    assert_eq!(app.get(&id).await["state"], "pending", "nothing changed");
}
}

both_engines! {
async fn callbacks_verify_only_with_their_tenants_secret_and_match_only_within_it() {
    let app = two_tenants().await;
    let mut body = confirm("acme-cb");
    body["effect"] = json!("acme-orders");
    let (s, created) = call(&app, reqwest::Method::POST, "/v1/operations", ACME, Some(body)).await;
    assert_eq!(s, 201);
    let id = created["id"].as_str().expect("id").to_string();
    // acme's decision carries acme's callback route.
    let start = std::time::Instant::now();
    let op = loop {
        let (_, op) = call(&app, reqwest::Method::GET, &format!("/v1/operations/{id}"), ACME, None).await;
        if op["decisionId"].is_string() {
            break op;
        }
        assert!(start.elapsed() < crate::harness::WAIT, "acme's decision was never opened: {op}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let decision = op["decisionId"].as_str().expect("decision").to_string();
    let sent = app.sandbox.decision(&decision).expect("decision");
    assert_eq!(sent.callback_url, Some(format!("{}/v1/callbacks/pushary/acme", app.base)));

    app.sandbox.answer(&decision, "yes", approvald::sandbox::CallbackMode::Drop).await.expect("answer");
    let (cb, _) = app.signed_callback(&decision, "yes");
    let acme_only = approvald::pushary::signature::sign("whsec_acme_only", &cb);
    // acme's own secret does not open the default tenant's route.
    let (s, _) = app.post_callback(&cb, Some(&acme_only)).await;
    assert_eq!(s, 401);
    // A validly signed callback on the default route is the default
    // tenant's: it never matches acme's decision.
    let (cb2, sig) = app.signed_callback(&decision, "yes");
    assert_eq!(app.post_callback(&cb2, Some(&sig)).await.0, 200);
    app.drain().await;
    let (_, op) = call(&app, reqwest::Method::GET, &format!("/v1/operations/{id}"), ACME, None).await;
    assert_eq!(op["state"], "pending", "looked up within the tenant only: {op}");
    // Unknown tenants have no route.
    let r = app.http.post(format!("{}/v1/callbacks/pushary/nobody", app.base)).header("X-Pushary-Signature", &sig)
        .body(cb2.clone()).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 404);
    // On acme's route, with acme's secret, it resumes acme's operation.
    let r = app.http.post(format!("{}/v1/callbacks/pushary/acme", app.base)).header("X-Pushary-Signature", &acme_only)
        .body(cb.clone()).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let start = std::time::Instant::now();
    loop {
        let (_, op) = call(&app, reqwest::Method::GET, &format!("/v1/operations/{id}"), ACME, None).await;
        if op["state"] == "succeeded" {
            break;
        }
        assert!(start.elapsed() < crate::harness::WAIT, "acme's operation never resumed: {op}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let d = app.deliveries_for(&id);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0]["status"], "approved");
}
}
