//! Soak: thousands of operations across hundreds of threads with random
//! answers, duplicate, late and dropped callbacks and random SIGKILLs of
//! the real binary; then every invariant, and a summary table.
//! `APPROVALD_SOAK_OPS` sets the size (default 2000).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use approvald::config::StoreConfig;
use approvald::sandbox::CallbackMode;
use approvald::store::Store;
use rand::Rng;
use rand::seq::IndexedRandom;
use serde_json::{Value, json};

use crate::daemon::Daemon;
use crate::harness::TOKEN;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The sandbox calls back (and retries until acknowledged).
    Send,
    /// The sandbox loses the callback; the reconciler's poll must find it.
    Drop,
    /// The callback is posted by the test, 1–3 times concurrently.
    Direct,
}

struct Planned {
    body: Value,
    answer: String,
    mode: Mode,
    id: Option<String>,
    decision: Option<String>,
}

const STEP_LIMIT: Duration = Duration::from_secs(300);

async fn retrying<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < STEP_LIMIT, "{what} never succeeded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn plan(n: usize, rng: &mut impl Rng) -> Vec<Planned> {
    (0..n)
        .map(|i| {
            let thread = i % 200;
            let kind = rng.random_range(0..10);
            let mut body = json!({
                "operationKey": format!("soak-{i}"), "threadId": format!("soak-thread-{thread}"),
                "interruptId": format!("int-{i}"), "effect": "orders", "externalId": format!("user-{thread}"),
                "question": format!("Approve step {i}?"), "toolName": "refund", "toolTarget": format!("order-{i}"),
                "parameters": {"amount": i % 97},
            });
            let (answer, mode) = match kind {
                0 => {
                    body["type"] = json!("select");
                    body["options"] = json!(["a", "b", "c"]);
                    (["a", "b", "c", "d"].choose(rng).copied().unwrap_or("a").to_string(), Mode::Direct)
                }
                1 => {
                    body["type"] = json!("input");
                    ("free text".to_string(), Mode::Send)
                }
                _ => {
                    let answer = match rng.random_range(0..20) {
                        0 => "YES",
                        1..=6 => "no",
                        _ => "yes",
                    };
                    let mode = if answer == "YES" {
                        Mode::Direct
                    } else {
                        match rng.random_range(0..10) {
                            0..=1 => Mode::Drop,
                            2..=4 => Mode::Direct,
                            _ => Mode::Send,
                        }
                    };
                    (answer.to_string(), mode)
                }
            };
            Planned { body, answer, mode, id: None, decision: None }
        })
        .collect()
}

async fn post_callback(d: &Daemon, body: &[u8], sig: &str) -> Option<String> {
    let r = d
        .http
        .post(format!("{}/v1/callbacks/pushary", d.base))
        .header("X-Pushary-Signature", sig)
        .body(body.to_vec())
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json::<Value>().await.ok()?["status"].as_str().map(str::to_string)
}

async fn restart(d: &mut Daemon, rng: &mut impl Rng) {
    tokio::time::sleep(Duration::from_millis(rng.random_range(0..150))).await;
    d.kill();
    d.start(None).await;
}

both_engines! {
async fn soak_thousands_of_operations_with_duplicates_drops_and_kills() {
    let _heavy = crate::harness::HEAVY.lock().await;
    let n: usize = std::env::var("APPROVALD_SOAK_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let mut rng = rand::rng();
    let mut d = Daemon::new("").await;
    d.start(None).await;
    let mut ops = plan(n, &mut rng);
    let started = Instant::now();

    // Enqueue in chunks, 16 at a time; a kill now and then mid-stream.
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let mut set = tokio::task::JoinSet::new();
        for &i in chunk {
            let http = d.http.clone();
            let url = format!("{}/v1/operations", d.base);
            let body = ops[i].body.clone();
            set.spawn(async move {
                let id = retrying("enqueue", || async {
                    let r = http.post(&url).bearer_auth(TOKEN).json(&body).send().await.ok()?;
                    if !r.status().is_success() {
                        return None;
                    }
                    r.json::<Value>().await.ok()?["id"].as_str().map(str::to_string)
                })
                .await;
                (i, id)
            });
            if set.len() >= 16 {
                let (i, id) = set.join_next().await.expect("task").expect("join");
                ops[i].id = Some(id);
            }
        }
        while let Some(r) = set.join_next().await {
            let (i, id) = r.expect("join");
            ops[i].id = Some(id);
        }
        if rng.random_bool(0.25) {
            restart(&mut d, &mut rng).await;
        }
    }

    // Answer everything, in chunks, killing now and then while callbacks and workers are in flight.
    let mut direct_posts = 0usize;
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        for &i in chunk {
            let id = ops[i].id.clone().expect("enqueued");
            let op = retrying("decision opened", || async {
                let op = d.get(&id).await?;
                (op["state"] != "enqueued").then_some(op)
            })
            .await;
            let Some(decision) = op["decisionId"].as_str().map(str::to_string) else { continue };
            ops[i].decision = Some(decision.clone());
            let valid_at_sandbox = !(ops[i].answer == "YES" || ops[i].answer == "d");
            match ops[i].mode {
                Mode::Send => {
                    d.sandbox.answer(&decision, &ops[i].answer, CallbackMode::Send).await.expect("answer")
                }
                Mode::Drop => {
                    d.sandbox.answer(&decision, &ops[i].answer, CallbackMode::Drop).await.expect("answer")
                }
                Mode::Direct => {
                    if valid_at_sandbox {
                        d.sandbox
                            .answer(&decision, &ops[i].answer, CallbackMode::Drop)
                            .await
                            .expect("answer");
                    }
                    let body =
                        serde_json::to_vec(&json!({"correlationId": decision, "answer": ops[i].answer,
                        "value": ops[i].answer, "answeredAt": "2026-11-29T10:00:00.000Z"}))
                        .expect("json");
                    let sig = approvald::pushary::signature::sign(&d.sandbox.webhook_secret(), &body);
                    let copies = rng.random_range(1..=3);
                    let mut set = tokio::task::JoinSet::new();
                    for _ in 0..copies {
                        let (dd, b, s) = (d.http.clone(), body.clone(), sig.clone());
                        let base = d.base.clone();
                        set.spawn(async move {
                            retrying("direct callback", || async {
                                let r = dd
                                    .post(format!("{base}/v1/callbacks/pushary"))
                                    .header("X-Pushary-Signature", &s)
                                    .body(b.clone())
                                    .send()
                                    .await
                                    .ok()?;
                                r.status().is_success().then_some(())
                            })
                            .await
                        });
                    }
                    set.join_all().await;
                    direct_posts += copies;
                }
            }
        }
        // Always once (the first chunk), then at random.
        if chunk[0] == 0 || rng.random_bool(0.4) {
            restart(&mut d, &mut rng).await;
        }
    }

    // Everything must settle: terminal, receipts recorded or refused.
    let store = Store::connect(&StoreConfig::with_defaults(d.store_url(), 2))
    .await
    .expect("open the store");
    crate::harness::wait_settled(&store, STEP_LIMIT, || d.stderr()).await;

    // Late replays of answered decisions change nothing.
    let mut late = 0usize;
    let before = store.count_by_state().await.expect("counts");
    for p in ops.choose_multiple(&mut rng, n / 10) {
        let Some(decision) = &p.decision else { continue };
        let body =
            serde_json::to_vec(&json!({"correlationId": decision, "answer": p.answer, "value": p.answer,
            "answeredAt": "2026-11-29T10:00:00.000Z"}))
            .expect("json");
        let sig = approvald::pushary::signature::sign(&d.sandbox.webhook_secret(), &body);
        let status = retrying("late callback", || post_callback(&d, &body, &sig)).await;
        assert_eq!(status, "duplicate");
        late += 1;
    }
    assert_eq!(store.count_by_state().await.expect("counts"), before, "late callbacks changed nothing");

    // Invariants, operation by operation.
    let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
    let mut violations = Vec::new();
    let executions: HashMap<String, usize> =
        d.sandbox.effect_deliveries().iter().filter(|e| e.executed).fold(HashMap::new(), |mut m, e| {
            *m.entry(e.body["operationId"].as_str().unwrap_or("").to_string()).or_default() += 1;
            m
        });
    for p in &ops {
        let id = p.id.as_deref().expect("id");
        let op = store.get_operation(None, id).await.expect("store").expect("op");
        *by_state.entry(op.state.as_str().to_string()).or_default() += 1;
        let ran = executions.get(id).copied().unwrap_or(0);
        if ran > 1 {
            violations.push(format!("{id}: effect executed {ran} times"));
        }
        if !op.state.is_terminal() {
            violations.push(format!("{id}: not terminal ({})", op.state));
        }
        if ran == 1 && op.outcome_status.as_deref() == Some("approved") && op.permit_id.is_none() {
            violations.push(format!("{id}: ran an approval without a permit"));
        }
        if let Some(dec) = &p.decision {
            let consumes = d.sandbox.consume_calls(dec);
            let approved = p.answer == "yes" && p.body.get("type").is_none();
            if !approved && consumes > 0 {
                violations.push(format!("{id}: consumed a permit for answer {:?}", p.answer));
            }
            if op.state.as_str() == "succeeded" && approved && ran != 1 {
                violations.push(format!("{id}: succeeded approval executed {ran} times"));
            }
            let dv = d.sandbox.decision(dec).expect("decision");
            if dv.callback.delivered_at.is_some() && op.state.is_open() {
                violations.push(format!("{id}: an acknowledged callback was not processed"));
            }
        }
    }

    // Inbox figures.
    let inbox = store.list_inbox(None, 1_000_000).await.expect("inbox");
    let received = inbox.len();
    let duplicates: i64 = inbox.iter().map(|e| e.duplicates).sum();
    let orphaned = inbox.iter().filter(|e| e.state == "orphaned").count();
    let polled = inbox.iter().filter(|e| e.source == "poll").count();

    println!("\nsoak: {n} operations, 200 threads, {:.1} s", started.elapsed().as_secs_f64());
    println!("+----------------------------+--------+");
    println!("| operations by final state  |  count |");
    println!("+----------------------------+--------+");
    for (s, c) in &by_state {
        println!("| {s:<26} | {c:>6} |");
    }
    println!("+----------------------------+--------+");
    println!("| callbacks stored           | {received:>6} |");
    println!("|   of which found by poll   | {polled:>6} |");
    println!("| duplicate callbacks        | {duplicates:>6} |");
    println!("| direct posts (with copies) | {direct_posts:>6} |");
    println!("| late replays               | {late:>6} |");
    println!("| orphaned                   | {orphaned:>6} |");
    println!("| kills survived (SIGKILL)   | {:>6} |", d.kills);
    println!("| invariant violations       | {:>6} |", violations.len());
    println!("+----------------------------+--------+");
    assert!(violations.is_empty(), "violations:\n{}", violations.join("\n"));
    assert!(d.kills >= 1, "the soak must kill the daemon at least once");
    assert_eq!(orphaned, 0);
}
}
