//! The enqueue API: authentication, idempotency and every bound.

use serde_json::{Value, json};

use crate::harness::{TOKEN, TestApp, confirm};

both_engines! {
async fn enqueue_is_idempotent_on_the_operation_key() {
    let app = TestApp::spawn().await;
    let body = confirm("idem");
    let (s1, first) = app.enqueue(&body).await;
    assert_eq!(s1, 201);
    assert_eq!(first["state"], "enqueued");
    // Same key and content, even with keys in another order: the same operation.
    let mut reordered = serde_json::Map::new();
    for (k, v) in body.as_object().expect("object").iter().rev() {
        reordered.insert(k.clone(), v.clone());
    }
    let (s2, second) = app.enqueue(&Value::Object(reordered)).await;
    assert_eq!(s2, 200);
    assert_eq!(second["id"], first["id"]);
    // Same key, different content: a conflict, never a silent update.
    let mut changed = body.clone();
    changed["parameters"]["amount"] = json!(41);
    let (s3, err) = app.enqueue(&changed).await;
    assert_eq!(s3, 409, "{err}");
    assert_eq!(err["code"], "operation_key_conflict");
    let stored = app.get(first["id"].as_str().expect("id")).await;
    assert_eq!(stored["operationKey"], "op-idem");
    let listed = app.store().list_operations(&Default::default()).await.expect("list");
    assert_eq!(listed.len(), 1);
    let op = &listed[0];
    assert_eq!(op.spec.subject.parameters.as_ref().expect("params")["amount"], 40);
}
}

both_engines! {
async fn every_violated_bound_is_a_422_naming_the_field_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let many: serde_json::Map<String, Value> = (0..33).map(|i| (format!("k{i}"), json!(i))).collect();
    let cases: Vec<(&str, Value, &str)> = vec![
        ("question", json!("q".repeat(501)), "question"),
        ("question", json!(""), "question"),
        ("externalId", json!("   "), "externalId"),
        ("externalId", json!("u".repeat(257)), "externalId"),
        ("type", json!("poll"), "type"),
        ("options", json!(["a"]), "options"),
        ("parameters", Value::Object(many), "parameters"),
        ("parameters", json!({"nested": {"a": 1}}), "parameters.nested"),
        ("parameters", json!({"list": [1]}), "parameters.list"),
        ("parameters", json!({"long": "v".repeat(201)}), "parameters.long"),
        (
            "parameters",
            json!({ "k".repeat(65): 1 }),
            &*Box::leak(format!("parameters.{}", "k".repeat(65)).into_boxed_str()),
        ),
        ("expiresInSeconds", json!(0), "expiresInSeconds"),
        ("expiresInSeconds", json!("60"), "expiresInSeconds"),
        ("deadline", json!("not a time"), "deadline"),
        ("effect", json!("nowhere"), "effect"),
        ("threadId", json!(12), "threadId"),
        ("unexpected", json!(true), "unexpected"),
    ];
    for (key, value, field) in cases {
        let mut body = confirm("bounds");
        body[key] = value.clone();
        let (status, err) = app.enqueue(&body).await;
        assert_eq!(status, 422, "{key}={value}: {err}");
        assert_eq!(err["field"], field, "{key}={value}: {err}");
        assert!(err["code"].as_str().is_some_and(|c| !c.is_empty()));
        assert!(err["detail"].as_str().is_some_and(|d| d.contains(field)), "{err}");
    }
    for missing in ["operationKey", "threadId", "interruptId", "effect", "externalId", "question"] {
        let mut body = confirm("bounds");
        body.as_object_mut().expect("object").remove(missing);
        let (status, err) = app.enqueue(&body).await;
        assert_eq!(status, 422);
        assert_eq!(err["field"], missing);
        assert_eq!(err["code"], "missing_field");
    }
    let mut select = confirm("bounds");
    select["type"] = json!("select");
    let (status, err) = app.enqueue(&select).await;
    assert_eq!((status, err["field"].as_str()), (422, Some("options")));
    assert!(app.store().list_operations(&Default::default()).await.expect("list").is_empty());
}
}

both_engines! {
async fn requests_without_a_valid_token_or_json_are_refused() {
    let app = TestApp::spawn().await;
    let url = format!("{}/v1/operations", app.base);
    let no_token = app.http.post(&url).json(&confirm("auth")).send().await.expect("send");
    assert_eq!(no_token.status().as_u16(), 401);
    let wrong = app
        .http
        .post(&url)
        .bearer_auth("test-token-0123456780")
        .json(&confirm("auth"))
        .send()
        .await
        .expect("send");
    assert_eq!(wrong.status().as_u16(), 401);
    let body: Value = wrong.json().await.expect("json");
    assert_eq!(body["code"], "unauthorized");
    assert!(!body.to_string().contains(TOKEN));
    let not_json = app
        .http
        .post(&url)
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(not_json.status().as_u16(), 400);
    assert_eq!(not_json.json::<Value>().await.expect("json")["code"], "invalid_json");
    let wrong_type = app
        .http
        .post(&url)
        .bearer_auth(TOKEN)
        .header("content-type", "text/plain")
        .body("{}")
        .send()
        .await
        .expect("send");
    assert_eq!(wrong_type.status().as_u16(), 415);
    let too_big = app
        .http
        .post(&url)
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(vec![b' '; 300_000])
        .send()
        .await
        .expect("send");
    assert_eq!(too_big.status().as_u16(), 413);
    let unknown = app.http.get(format!("{url}/op_nope")).bearer_auth(TOKEN).send().await.expect("send");
    assert_eq!(unknown.status().as_u16(), 404);
    assert_eq!(unknown.json::<Value>().await.expect("json")["code"], "not_found");
    let bad_filter =
        app.http.get(format!("{url}?state=bogus")).bearer_auth(TOKEN).send().await.expect("send");
    assert_eq!(bad_filter.status().as_u16(), 400);
    assert!(app.store().list_operations(&Default::default()).await.expect("list").is_empty());
}
}

both_engines! {
async fn list_filters_by_state_and_thread() {
    let app = TestApp::spawn().await;
    let a = app.enqueue_ok(&confirm("list-a")).await;
    let _b = app.enqueue_ok(&confirm("list-b")).await;
    app.wait_state(&a, &["pending"]).await;
    let resp: Value = app
        .http
        .get(format!("{}/v1/operations?threadId=thread-list-a", app.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let ops = resp["operations"].as_array().expect("list");
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0]["id"], a);
}
}
