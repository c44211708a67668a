//! Hostile HTTP: each gets a clear 4xx (or 503) with a stable code, and
//! nothing changes.

use std::time::Instant;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{Options, TOKEN, TestApp, WAIT, confirm};

async fn counts(app: &TestApp) -> (usize, usize) {
    (app.store().list_operations(&Default::default()).await.expect("ops").len(), app.inbox_len().await)
}

/// Sends the start of a request and then stalls; returns the stream.
async fn stall(app: &TestApp, path: &str, extra_headers: &str) -> tokio::net::TcpStream {
    let addr = app.base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n{extra_headers}\r\n{{\"corr"
    );
    s.write_all(head.as_bytes()).await.expect("write");
    s
}

async fn read_status(s: &mut tokio::net::TcpStream) -> (u16, String) {
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(WAIT, s.read(&mut buf))
        .await
        .expect("an answer within the bound")
        .expect("read");
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

both_engines! {
async fn slow_bodies_time_out_and_a_full_receiver_answers_503() {
    let app = TestApp::spawn_with(Options {
        // Long enough that the stalled request still holds the slot when the
        // next callback arrives on a loaded machine.
        server_toml: "request_timeout_secs = 6\nmax_concurrent_callbacks = 1".into(),
        ..Options::default()
    })
    .await;
    let before = counts(&app).await;
    let stalled = || stall(&app, "/v1/callbacks/pushary", "X-Pushary-Signature: 00\r\n");
    let mut slow = stalled().await;
    // Wait until the stalled request holds the one callback slot, probing
    // with a callback that cannot be stored (a wrong signature: 401 while
    // the slot is free, 503 once it is held). A signed probe would be
    // stored if it came first, on a loaded machine.
    let start = Instant::now();
    loop {
        let (status, err) = app.post_callback(b"{}", Some("00")).await;
        if status == 503 {
            break;
        }
        assert_eq!(status, 401, "{err}");
        assert!(start.elapsed() < WAIT, "the stalled request never took the slot");
        // On a loaded machine the stalled request can reach the receiver
        // while a probe holds the slot, and be refused at once (503): it
        // will never hold the slot, so stall another.
        let still_stalled =
            matches!(slow.try_read(&mut [0u8; 512]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        if !still_stalled {
            slow = stalled().await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // The one callback slot is taken by the stalled request: the next is refused.
    let (body, sig) = app.signed_callback("dec_busy", "yes");
    let (status, refused) = app.post_callback(&body, Some(&sig)).await;
    assert_eq!((status, refused["code"].as_str()), (503, Some("overloaded")), "{refused}");
    let (status, text) = read_status(&mut slow).await;
    assert_eq!(status, 408, "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    assert_eq!(counts(&app).await, before, "nothing stored");
    // With the slot free again, the same callback is taken.
    assert_eq!(app.post_callback(&body, Some(&sig)).await.0, 200);
}
}

both_engines! {
async fn oversized_headers_are_refused() {
    let app = TestApp::spawn().await;
    let before = counts(&app).await;
    let r = app
        .http
        .post(format!("{}/v1/operations", app.base))
        .bearer_auth(TOKEN)
        .header("x-padding", "p".repeat(20_000))
        .json(&confirm("headers"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 431);
    assert_eq!(r.json::<Value>().await.expect("json")["code"], "headers_too_large");
    assert_eq!(counts(&app).await, before);
}
}

both_engines! {
async fn malformed_signed_callbacks_get_stable_codes_and_store_nothing() {
    let app = TestApp::spawn().await;
    let sign = |b: &[u8]| approvald::pushary::signature::sign(&app.webhook_secret, b);
    let deep = format!("{}{}", "[".repeat(64), "]".repeat(64));
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("invalid UTF-8", b"{\"correlationId\":\"d\",\"answer\":\"\xff\"}".to_vec(), 400, "invalid_utf8"),
        ("duplicate keys", br#"{"correlationId":"d","answer":"no","answer":"yes"}"#.to_vec(), 400, "duplicate_key"),
        ("deep nesting", deep.into_bytes(), 400, "too_deep"),
        ("NaN", br#"{"correlationId":"d","answer":"yes","n":NaN}"#.to_vec(), 400, "invalid_json"),
        ("number out of range", br#"{"correlationId":"d","answer":"yes","n":1e400}"#.to_vec(), 400, "invalid_json"),
        ("NUL in the answer", br#"{"correlationId":"d","answer":"yes\u0000"}"#.to_vec(), 400, "invalid_value"),
        ("answer not a string", br#"{"correlationId":"d","answer":true}"#.to_vec(), 400, "not_a_decision_callback"),
        ("correlation id too long", format!(r#"{{"correlationId":"{}","answer":"yes"}}"#, "d".repeat(300)).into_bytes(), 400, "invalid_correlation_id"),
    ];
    for (name, body, status, code) in cases {
        let (got, err) = app.post_callback(&body, Some(&sign(&body))).await;
        assert_eq!((got, err["code"].as_str()), (status, Some(code)), "{name}: {err}");
        assert!(err["detail"].as_str().is_some_and(|d| !d.is_empty()), "{name}");
        assert_eq!(app.inbox_len().await, 0, "{name}: nothing stored");
    }
}
}

both_engines! {
async fn malformed_enqueues_get_stable_codes_and_store_nothing() {
    let app = TestApp::spawn().await;
    let post = |body: Vec<u8>| {
        app.http
            .post(format!("{}/v1/operations", app.base))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let dup = br#"{"operationKey":"a","operationKey":"b","threadId":"t","interruptId":"i","effect":"orders","externalId":"u","question":"q"}"#;
    let mut big = confirm("big");
    big["expiresInSeconds"] = json!(1e30);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("duplicate keys", dup.to_vec(), 400, "duplicate_key"),
        ("invalid UTF-8", b"{\"operationKey\":\"\xfe\"}".to_vec(), 400, "invalid_utf8"),
        ("NaN", br#"{"expiresInSeconds": NaN}"#.to_vec(), 400, "invalid_json"),
        ("out of range", serde_json::to_vec(&big).expect("json"), 422, "invalid_type"),
        ("deep", format!("{{\"presentation\":{}1{}}}", "{\"a\":".repeat(40), "}".repeat(40)).into_bytes(), 400, "too_deep"),
    ];
    for (name, body, status, code) in cases {
        let r = post(body).await.expect("send");
        let got = r.status().as_u16();
        let err: Value = r.json().await.expect("json");
        assert_eq!((got, err["code"].as_str()), (status, Some(code)), "{name}: {err}");
        assert!(app.store().list_operations(&Default::default()).await.expect("ops").is_empty(), "{name}");
    }
}
}

both_engines! {
async fn path_ids_with_traversal_or_sql_are_not_found_and_sql_in_keys_is_only_data() {
    let app = TestApp::spawn().await;
    for path in [
        "/v1/operations/..%2F..%2Fetc%2Fpasswd",
        "/v1/operations/op_1'%20OR%20'1'='1",
        "/v1/operations/%2F",
        "/v1/inbox/1%20OR%201=1",
        "/v1/inbox/..",
    ] {
        let r = app.http.get(format!("{}{path}", app.base)).bearer_auth(TOKEN).send().await.expect("send");
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["code"], "not_found", "{path}");
    }
    let mut body = confirm("sql");
    body["operationKey"] = json!("k'; DROP TABLE operations;--");
    body["threadId"] = json!("t\" OR \"1\"=\"1");
    let id = app.enqueue_ok(&body).await;
    let op = app.get(&id).await;
    assert_eq!(op["operationKey"], "k'; DROP TABLE operations;--");
    assert_eq!(op["threadId"], "t\" OR \"1\"=\"1");
    app.decision_of(&id).await;
}
}

both_engines! {
async fn look_alike_answers_are_invalid_and_consume_nothing() {
    let app = TestApp::spawn().await;
    for (n, answer) in ["ｙｅｓ", "yes\u{200b}", "ye\u{0455}", "YES", "yes\u{7}"].iter().enumerate() {
        let id = app.enqueue_ok(&confirm(&format!("alike-{n}"))).await;
        let decision = app.decision_of(&id).await;
        let (b, sig) = app.signed_callback(&decision, answer);
        assert_eq!(app.post_callback(&b, Some(&sig)).await.0, 200);
        let op = app.wait_op(&id, "invalid delivered", |o| o["delivery"] == "done").await;
        assert_eq!(op["state"], "invalid", "{answer:?}");
        assert_eq!(app.sandbox.consume_calls(&decision), 0, "{answer:?}");
    }
}
}

both_engines! {
async fn a_replay_of_any_earlier_callback_changes_nothing() {
    let app = TestApp::spawn().await;
    let mut replays = Vec::new();
    for (n, answer) in ["yes", "no"].iter().enumerate() {
        let id = app.enqueue_ok(&confirm(&format!("replay-{n}"))).await;
        let decision = app.decision_of(&id).await;
        app.answer(&decision, answer).await;
        app.wait_op(&id, "done", |o| o["delivery"] == "done" && o["receipt"] != "pending").await;
        let dv = app.sandbox.decision(&decision).expect("decision");
        let body = dv.callback.body.expect("the exact bytes the sandbox sent").into_bytes();
        replays.push((id, decision, body));
    }
    let before: Vec<Value> = futures_ops(&app, &replays).await;
    let deliveries = app.sandbox.effect_deliveries().len();
    for (_, _, body) in &replays {
        let sig = approvald::pushary::signature::sign(&app.webhook_secret, body);
        for _ in 0..3 {
            assert_eq!(app.post_callback(body, Some(&sig)).await, (200, json!({"status": "duplicate"})));
        }
    }
    app.drain().await;
    assert_eq!(futures_ops(&app, &replays).await, before, "nothing changed");
    assert_eq!(app.sandbox.effect_deliveries().len(), deliveries);
    for (_, decision, _) in &replays {
        assert!(app.sandbox.consume_calls(decision) <= 1);
    }
}
}

async fn futures_ops(app: &TestApp, ops: &[(String, String, Vec<u8>)]) -> Vec<Value> {
    let mut out = Vec::new();
    for (id, _, _) in ops {
        let mut op = app.get(id).await;
        op.as_object_mut().expect("object").remove("deliveries");
        out.push(op);
    }
    out
}
