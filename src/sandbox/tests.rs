//! Drives a real sandbox over HTTP, as approvald and the SDK do.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::pushary::signature;

const WAIT: Duration = Duration::from_secs(10);

/// A callback receiver that answers 500 to the first `fail` requests.
#[derive(Clone, Default)]
struct Receiver {
    received: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
    fail: Arc<AtomicUsize>,
}

impl Receiver {
    async fn start(&self, shutdown: CancellationToken) -> String {
        async fn hook(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
            r.received.lock().expect("receiver lock").push((headers, body));
            let failing =
                r.fail.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
            if failing { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::OK }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
        let addr = listener.local_addr().expect("receiver address");
        let app = Router::new().route("/hook", post(hook)).with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
        });
        format!("http://{addr}/hook")
    }

    fn last(&self) -> (HeaderMap, Bytes) {
        self.received.lock().expect("receiver lock").last().cloned().expect("a callback was received")
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl Client {
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.base)).bearer_auth(&self.key);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the sandbox answers");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(Method::POST, path, Some(body)).await
    }
}

async fn delivered(sandbox: &SandboxHandle, id: &str) -> bool {
    sandbox
        .wait_for(WAIT, |h| h.decision(id).is_some_and(|d| d.callback.state == CallbackState::Delivered))
        .await
}

#[tokio::test]
async fn the_whole_protocol_over_http() {
    let shutdown = CancellationToken::new();
    let effect_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let config = SandboxConfig { effect_secret: Some(effect_secret.to_string()), ..SandboxConfig::default() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind sandbox");
    let sandbox = start(listener, config, shutdown.clone()).await.expect("sandbox starts");
    let receiver = Receiver::default();
    let hook = receiver.start(shutdown.clone()).await;
    let http = crate::http::client_builder().build().expect("client");
    let api = Client { http: http.clone(), base: sandbox.base_url(), key: sandbox.api_key() };

    // Authentication.
    let anonymous = Client { key: "pk_x.wrong".into(), http: http.clone(), base: sandbox.base_url() };
    let (status, body) = anonymous.call(Method::GET, "/webhook-secret", None).await;
    assert_eq!(status, 401);
    assert!(body["error"].is_string());

    // Create, then the idempotent retry and the conflicting reuse.
    let create = json!({
        "question": "Refund order 42?", "type": "confirm", "externalId": "user-1",
        "callbackUrl": hook, "context": "thread=t-1", "toolName": "refund", "toolTarget": "order-42",
        "parameters": {"amount": 12.5, "currency": "EUR"}, "idempotencyKey": "op-1", "wait": false,
    });
    let (status, created) = api.post("/decisions", create.clone()).await;
    assert_eq!(status, 200, "{created}");
    let id = created["decisionId"].as_str().expect("decision id").to_string();
    assert_eq!((created["status"].clone(), created["answered"].clone()), (json!("pending"), json!(false)));
    assert_eq!((created["reachable"].clone(), created["deviceCount"].clone()), (json!(true), json!(1)));
    assert_eq!(api.post("/decisions", create.clone()).await, (200, created.clone()));
    let mut changed = create.clone();
    changed["parameters"]["amount"] = json!(13);
    let (status, conflict) = api.post("/decisions", changed).await;
    assert_eq!(status, 409);
    assert_eq!(conflict["error"], "idempotency key reused with a different payload");

    // An unreachable recipient with requireReachable: 409 and nothing created.
    let before = sandbox.decisions().len();
    let (status, body) = api
        .post("/decisions", json!({"question": "q", "externalId": "unreachable-9", "requireReachable": true}))
        .await;
    assert_eq!((status, body["reachable"].clone()), (409, json!(false)));
    assert_eq!(sandbox.decisions().len(), before);

    // A long-poll wakes on the answer; the callback arrives signed, after one
    // failed attempt, with the exact body.
    receiver.fail.store(1, Ordering::SeqCst);
    let poll = {
        let api = Client { http: http.clone(), base: sandbox.base_url(), key: sandbox.api_key() };
        let path = format!("/decisions/{id}?wait=20");
        tokio::spawn(async move { api.call(Method::GET, &path, None).await })
    };
    assert_eq!(api.post(&format!("/decisions/{id}"), json!({"answer": "Yes"})).await.0, 422);
    let (status, answered) = api.post(&format!("/decisions/{id}"), json!({"answer": "yes"})).await;
    assert_eq!((status, answered["status"].clone()), (200, json!("answered")));
    let (status, polled) = tokio::time::timeout(WAIT, poll).await.expect("the poll woke").expect("poll task");
    assert_eq!((status, polled["value"].clone()), (200, json!("yes")));
    assert!(delivered(&sandbox, &id).await, "the callback was delivered");
    let view = sandbox.decision(&id).expect("view");
    assert_eq!(view.callback.attempts, 2);
    let (headers, raw) = receiver.last();
    let sig = headers.get("x-pushary-signature").and_then(|v| v.to_str().ok()).expect("signature header");
    assert!(signature::verify([sandbox.webhook_secret().as_str()], &raw, sig));
    let expected = format!(
        r#"{{"correlationId":"{id}","answer":"yes","value":"yes","answeredAt":"{}","context":"thread=t-1"}}"#,
        view.answered_at.as_deref().expect("answered at")
    );
    assert_eq!(String::from_utf8_lossy(&raw), expected);
    assert_eq!(api.post(&format!("/decisions/{id}"), json!({"answer": "no"})).await.0, 409);

    // Consume: a different action is refused, the exact one is permitted once.
    let mut stated = json!({
        "authorizationId": id, "toolName": "refund", "toolTarget": "order-42",
        "parameters": {"currency": "EUR", "amount": 12.5}, "externalId": "user-1",
    });
    stated["toolTarget"] = json!("order-43");
    let (status, refused) = api.post("/authorizations/consume", stated.clone()).await;
    assert_eq!((status, refused["refusal"].clone()), (403, json!("action_mismatch")));
    stated["toolTarget"] = json!("order-42");
    let (status, permit) = api.post("/authorizations/consume", stated.clone()).await;
    assert_eq!(status, 200, "{permit}");
    let permit_id = permit["permitId"].as_str().expect("permit id").to_string();
    let (status, again) = api.post("/authorizations/consume", stated.clone()).await;
    assert_eq!((status, again["refusal"].clone()), (409, json!("already_consumed")));
    assert_eq!(sandbox.consume_calls(&id), 3);

    // Receipts: the first wins.
    let receipt_path = format!("/authorizations/{permit_id}/receipt");
    assert_eq!(api.post(&receipt_path, json!({"outcome": "succeeded", "summary": "refunded"})).await.0, 200);
    let (status, second) = api.post(&receipt_path, json!({"outcome": "failed"})).await;
    assert_eq!((status, second["outcome"].clone()), (200, json!("succeeded")));
    assert_eq!(sandbox.receipts(&permit_id).map(|r| r.outcome), Some("succeeded".to_string()));
    assert_eq!(api.post("/authorizations/pmt_unknown/receipt", json!({"outcome": "failed"})).await.0, 404);

    // A lost callback and a forced refusal.
    let (_, second) = api
        .post("/decisions", json!({"question": "Deploy?", "toolName": "deploy", "callbackUrl": hook}))
        .await;
    let second_id = second["decisionId"].as_str().expect("id").to_string();
    let callbacks_before = receiver.received.lock().expect("lock").len();
    sandbox.answer(&second_id, "yes", CallbackMode::Drop).await.expect("answered");
    assert_eq!(sandbox.decision(&second_id).map(|d| d.callback.state), Some(CallbackState::Dropped));
    sandbox.set_consume_refusal(&second_id, Some(Refusal::Expired));
    let stated = json!({"authorizationId": second_id, "toolName": "deploy"});
    assert_eq!(api.post("/authorizations/consume", stated.clone()).await.1["refusal"], "expired");
    assert_eq!(api.post("/authorizations/consume", stated).await.0, 200);

    // Rotation: later callbacks are signed with the new secret only.
    let old = sandbox.webhook_secret();
    let (_, rotated) = api.call(Method::POST, "/webhook-secret", None).await;
    let new = rotated["secret"].as_str().expect("secret").to_string();
    assert_ne!(new, old);
    let (_, third) = api
        .post(
            "/decisions",
            json!({"question": "Pick", "type": "select", "options": ["a", "b"], "callbackUrl": hook}),
        )
        .await;
    let third_id = third["decisionId"].as_str().expect("id").to_string();
    sandbox.answer(&third_id, "b", CallbackMode::Send).await.expect("answered");
    assert!(delivered(&sandbox, &third_id).await);
    assert_eq!(
        receiver.received.lock().expect("lock").len(),
        callbacks_before + 1,
        "the dropped one never came"
    );
    let (headers, raw) = receiver.last();
    let sig = headers.get("x-pushary-signature").and_then(|v| v.to_str().ok()).expect("signature header");
    assert!(signature::verify([new.as_str()], &raw, sig));
    assert!(!signature::verify([old.as_str()], &raw, sig));

    // Cancel: pending → cancelled; an answered one reports its status.
    let (_, fourth) = api.post("/decisions", json!({"question": "Later?"})).await;
    let fourth_id = fourth["decisionId"].as_str().expect("id");
    let (_, cancelled) = api.call(Method::DELETE, &format!("/decisions/{fourth_id}"), None).await;
    assert_eq!(cancelled, json!({"decisionId": fourth_id, "cancelled": true, "status": "cancelled"}));
    let (_, not_cancelled) = api.call(Method::DELETE, &format!("/decisions/{third_id}"), None).await;
    assert_eq!(
        (not_cancelled["cancelled"].clone(), not_cancelled["status"].clone()),
        (json!(false), json!("answered"))
    );
    assert_eq!(api.call(Method::GET, "/decisions/dec_nope", None).await.0, 404);

    // Expiry needs no event: a long-poll and `wait_for` both see it.
    let (_, short) = api.post("/decisions", json!({"question": "Quick?", "expiresInSeconds": 1})).await;
    let short_id = short["decisionId"].as_str().expect("id").to_string();
    let (status, expired) = api.call(Method::GET, &format!("/decisions/{short_id}?wait=10"), None).await;
    assert_eq!((status, expired["status"].clone()), (200, json!("expired")));
    let (_, short) = api.post("/decisions", json!({"question": "Quick again?", "expiresInSeconds": 1})).await;
    let short_id = short["decisionId"].as_str().expect("id").to_string();
    assert!(sandbox.wait_for(WAIT, |h| h.decision(&short_id).is_some_and(|d| d.status == "expired")).await);
    assert_eq!(api.post(&format!("/decisions/{short_id}"), json!({"answer": "yes"})).await.0, 409);

    // The example effect target: signed, executes once per key.
    let key = crate::webhooks::decode_secret(effect_secret).expect("key");
    let deliver = |body: &'static str, key_header: &'static str, signed: bool| {
        let http = http.clone();
        let url = sandbox.effect_url();
        let key = key.clone();
        async move {
            let ts = chrono::Utc::now().timestamp();
            let sig = if signed {
                crate::webhooks::sign(&key, "msg_1", ts, body.as_bytes())
            } else {
                "v1,AAAA".into()
            };
            http.post(url)
                .header("webhook-id", "msg_1")
                .header("webhook-timestamp", ts.to_string())
                .header("webhook-signature", sig)
                .header("idempotency-key", key_header)
                .body(body)
                .send()
                .await
                .expect("effect answers")
                .status()
                .as_u16()
        }
    };
    let outcome = r#"{"operationId":"op_1","status":"approved","approved":true}"#;
    assert_eq!(deliver(outcome, "idem-1", false).await, 401);
    sandbox.set_effect_response(503, 1);
    assert_eq!(deliver(outcome, "idem-1", true).await, 503);
    assert_eq!(sandbox.effect_executions("idem-1"), 0);
    assert_eq!(deliver(outcome, "idem-1", true).await, 200);
    assert_eq!(deliver(outcome, "idem-1", true).await, 200);
    assert_eq!(sandbox.effect_executions("idem-1"), 1);
    let deliveries = sandbox.effect_deliveries();
    assert_eq!(deliveries.iter().map(|d| d.status).collect::<Vec<_>>(), [401, 503, 200, 200]);
    assert!(deliveries[2].verified && deliveries[2].executed && deliveries[3].replay);

    // The control routes and the page mirror the handle.
    let control = http
        .get(format!("http://{}/sandbox/api/decisions/{id}", sandbox.addr))
        .send()
        .await
        .expect("control");
    let view: DecisionView = control.json().await.expect("a decision view");
    assert_eq!(view.permit.and_then(|p| p.receipt).map(|r| r.outcome), Some("succeeded".into()));
    let page = http.get(sandbox.page_url()).send().await.expect("page").text().await.expect("html");
    assert!(page.contains("Refund order 42?") && page.contains("op_1"));

    shutdown.cancel();
}

#[tokio::test]
async fn the_page_answers_like_the_phone() {
    let shutdown = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind sandbox");
    let sandbox = start(listener, SandboxConfig::default(), shutdown.clone()).await.expect("sandbox starts");
    let http =
        crate::http::client_builder().redirect(reqwest::redirect::Policy::none()).build().expect("client");
    let api = Client { http: http.clone(), base: sandbox.base_url(), key: sandbox.api_key() };
    let (_, created) = api
        .post("/decisions", json!({"question": "Ship <b>now</b>?", "parameters": {"note": "\"quoted\""}}))
        .await;
    let id = created["decisionId"].as_str().expect("id");

    let page = http.get(sandbox.page_url()).send().await.expect("page").text().await.expect("html");
    assert!(page.contains("Ship &lt;b&gt;now&lt;/b&gt;?") && !page.contains("<b>now"));
    assert!(page.contains("&quot;quoted&quot;"));

    let form = |answer: &str| format!("back=%2F&answer={answer}");
    let answer_url = format!("http://{}/sandbox/decisions/{id}/answer", sandbox.addr);
    let bad = http.post(&answer_url).body(form("maybe")).send().await.expect("answer");
    assert_eq!(bad.status(), StatusCode::SEE_OTHER);
    let location =
        bad.headers().get("location").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(location.starts_with("/?error="), "{location}");
    let good = http.post(&answer_url).body(form("yes")).send().await.expect("answer");
    assert_eq!(good.headers().get("location").and_then(|v| v.to_str().ok()), Some("/"));
    let view = sandbox.decision(id).expect("view");
    assert_eq!((view.value.as_deref(), view.answered_via.as_deref()), (Some("yes"), Some("page")));

    let (_, link) = api.post("/enroll", json!({"externalId": "unreachable-2"})).await;
    let link = link["universalLink"].as_str().expect("universal link").to_string();
    assert_eq!(http.get(&link).send().await.expect("enroll").status(), StatusCode::OK);
    assert_eq!(http.get(&link).send().await.expect("enroll").status(), StatusCode::GONE);
    let (status, _) = api
        .post("/decisions", json!({"question": "q", "externalId": "unreachable-2", "requireReachable": true}))
        .await;
    assert_eq!(status, 200);
    shutdown.cancel();
}

/// A receiver that holds every callback until `open` is sent, counting
/// those it holds at once.
#[derive(Clone)]
struct GatedReceiver {
    held: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    open: tokio::sync::watch::Receiver<bool>,
}

#[tokio::test]
async fn a_burst_of_answers_sends_a_bounded_number_of_callbacks_at_once() {
    async fn hook(State(r): State<GatedReceiver>) -> StatusCode {
        let now = r.held.fetch_add(1, Ordering::SeqCst) + 1;
        r.most.fetch_max(now, Ordering::SeqCst);
        let mut open = r.open.clone();
        let _ = open.wait_for(|o| *o).await;
        r.held.fetch_sub(1, Ordering::SeqCst);
        StatusCode::OK
    }
    async fn until(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !condition() {
            assert!(tokio::time::Instant::now() < deadline, "{what} within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let shutdown = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind sandbox");
    let sandbox = start(listener, SandboxConfig::default(), shutdown.clone()).await.expect("sandbox starts");
    let (gate, open) = tokio::sync::watch::channel(false);
    let receiver = GatedReceiver { held: Arc::default(), most: Arc::default(), open };
    let hook_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
    let hook_url = format!("http://{}/hook", hook_listener.local_addr().expect("receiver address"));
    let app = Router::new().route("/hook", post(hook)).with_state(receiver.clone());
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = axum::serve(hook_listener, app).with_graceful_shutdown(stop.cancelled_owned()).await;
    });
    let api = Client {
        http: crate::http::client_builder().build().expect("client"),
        base: sandbox.base_url(),
        key: sandbox.api_key(),
    };
    let extra = 16;
    let mut ids = Vec::new();
    for n in 0..callbacks::IN_FLIGHT + extra {
        let body = json!({"question": "q", "externalId": format!("user-{n}"), "callbackUrl": hook_url});
        let (status, created) = api.post("/decisions", body).await;
        assert_eq!(status, 200, "{created}");
        ids.push(created["decisionId"].as_str().expect("decision id").to_string());
    }
    for id in &ids {
        sandbox.answer(id, "yes", CallbackMode::Send).await.expect("answered");
    }

    until("the bound reached", || receiver.held.load(Ordering::SeqCst) == callbacks::IN_FLIGHT).await;
    until("the rest queued behind it", || sandbox.callbacks_queued() == extra).await;
    assert_eq!(receiver.most.load(Ordering::SeqCst), callbacks::IN_FLIGHT);

    gate.send_replace(true);
    for id in &ids {
        assert!(delivered(&sandbox, id).await, "{id} delivered once the receiver answers");
    }
    assert_eq!((receiver.most.load(Ordering::SeqCst), sandbox.callbacks_queued()), (callbacks::IN_FLIGHT, 0));
    shutdown.cancel();
}
