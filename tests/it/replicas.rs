//! Several approvald processes on one PostgreSQL: 500 threads × 4
//! operations, callbacks to random replicas with duplicates, one replica
//! SIGKILLed midway. Exactly-once resumes, no overlap within a thread,
//! per-thread order equal to callback arrival order, nothing acknowledged lost.

use std::collections::{BTreeMap, HashMap};
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use approvald::config::StoreConfig;
use approvald::sandbox::CallbackMode;
use approvald::store::Store;
use rand::Rng;
use serde_json::{Value, json};

use crate::daemon::Daemon;
use crate::harness::{BACKEND, Backend, TOKEN};

const PER_THREAD: usize = 4;
const LIMIT: Duration = Duration::from_secs(300);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_one_killed_resume_everything_once_in_order() {
    let Some(backend) = Backend::postgres("replicas::three_replicas_one_killed") else { return };
    let _heavy = crate::harness::HEAVY.lock().await;
    BACKEND.scope(backend, run()).await;
}

async fn run() {
    // `APPROVALD_REPLICA_THREADS` shrinks the run for local experiments.
    let threads: usize =
        std::env::var("APPROVALD_REPLICA_threads").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let d = Daemon::new("").await;
    d.sandbox.set_effect_work(Duration::from_millis(2));
    let env = [
        ("APPROVALD_RECONCILER__POLL_AFTER_SECS", "3600".to_string()),
        ("APPROVALD_WORKER__LEASE_SECS", "5".to_string()),
    ];
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut children: Vec<Option<Child>> = Vec::new();
    for &p in &ports {
        children.push(Some(d.spawn_replica(p, &env).await));
    }
    let bases: Arc<Vec<String>> = Arc::new(ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect());
    let killed = Arc::new(AtomicBool::new(false));
    let started = Instant::now();

    // Enqueue round-robin across replicas.
    let mut ids: Vec<Vec<String>> = vec![Vec::new(); threads];
    let mut set = tokio::task::JoinSet::new();
    for t in 0..threads {
        for k in 0..PER_THREAD {
            let (http, base) = (d.http.clone(), bases[(t + k) % 3].clone());
            set.spawn(async move {
                let body = json!({"operationKey": format!("r-{t}-{k}"), "threadId": format!("rt-{t}"),
                    "interruptId": format!("i-{t}-{k}"), "effect": "orders", "externalId": format!("u-{t}"),
                    "question": "Proceed?", "toolName": "ship", "parameters": {"k": k}});
                let r =
                    http.post(format!("{base}/v1/operations")).bearer_auth(TOKEN).json(&body).send().await;
                let v: Value = r.expect("enqueue").json().await.expect("json");
                (t, k, v["id"].as_str().expect("id").to_string())
            });
            if set.len() >= 16 {
                let (t, k, id) = set.join_next().await.expect("task").expect("join");
                ids[t].push(format!("{k}:{id}"));
            }
        }
    }
    while let Some(r) = set.join_next().await {
        let (t, k, id) = r.expect("join");
        ids[t].push(format!("{k}:{id}"));
    }
    let ids: Vec<Vec<String>> = ids
        .into_iter()
        .map(|mut v| {
            v.sort();
            v.into_iter().map(|s| s.split_once(':').expect("k:id").1.to_string()).collect()
        })
        .collect();

    let store = Store::connect(&StoreConfig::with_defaults(d.store_url(), 2)).await.expect("store");
    // All decisions opened (by whichever replica took each thread).
    let opened = Instant::now();
    loop {
        let counts = store.count_by_state().await.expect("counts");
        if counts.iter().all(|(s, _)| s != "enqueued") {
            break;
        }
        assert!(opened.elapsed() < LIMIT, "decisions never all opened: {counts:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Answer: per thread in order, callbacks to random live replicas, 30% duplicated.
    let acknowledged = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut set = tokio::task::JoinSet::new();
    let mut answered_threads = 0usize;
    let mut victim: Option<Child> = None;
    for (t, thread_ops) in ids.iter().enumerate() {
        let (http, bases, dead, acks) =
            (d.http.clone(), Arc::clone(&bases), Arc::clone(&killed), Arc::clone(&acknowledged));
        let sandbox = d.sandbox.clone();
        let secret = d.sandbox.webhook_secret();
        let thread_ops = thread_ops.clone();
        let store = store.clone();
        set.spawn(async move {
            for id in &thread_ops {
                let op = store.get_operation(None, id).await.expect("store").expect("op");
                let decision = op.decision_id.clone().expect("opened");
                let answer = if rand::rng().random_bool(0.7) { "yes" } else { "no" };
                sandbox.answer(&decision, answer, CallbackMode::Drop).await.expect("answer");
                let body = serde_json::to_vec(&json!({"correlationId": decision, "answer": answer,
                    "value": answer, "answeredAt": "2026-11-29T10:00:00.000Z"}))
                .expect("json");
                let sig = approvald::pushary::signature::sign(&secret, &body);
                let copies = if rand::rng().random_bool(0.3) { 2 } else { 1 };
                let deadline = Instant::now() + LIMIT;
                let mut acked = 0;
                while acked < copies {
                    let mut r = rand::rng().random_range(0..3);
                    if r == 0 && dead.load(Ordering::SeqCst) {
                        r = 1 + rand::rng().random_range(0..2);
                    }
                    let sent = http
                        .post(format!("{}/v1/callbacks/pushary", bases[r]))
                        .header("X-Pushary-Signature", &sig)
                        .body(body.clone())
                        .send()
                        .await;
                    if sent.is_ok_and(|s| s.status().is_success()) {
                        acked += 1;
                    } else {
                        assert!(Instant::now() < deadline, "no replica took the callback");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                acks.lock().expect("lock").push(id.clone());
            }
            let _ = t;
        });
        answered_threads += 1;
        while set.len() >= 32 {
            set.join_next().await.expect("task").expect("join");
        }
        if answered_threads == threads / 2 {
            // Midway, with work in flight: one replica dies.
            killed.store(true, Ordering::SeqCst);
            victim = children[0].take();
            if let Some(c) = victim.as_mut() {
                c.kill().expect("SIGKILL");
                c.wait().expect("reaped");
            }
        }
    }
    while let Some(r) = set.join_next().await {
        r.expect("join");
    }

    crate::harness::wait_settled(&store, LIMIT, String::new).await;

    // Checks.
    let deliveries = d.sandbox.effect_deliveries();
    let mut executions: HashMap<String, Vec<(i64, i64)>> = HashMap::new();
    for e in deliveries.iter().filter(|e| e.executed) {
        executions
            .entry(e.body["operationId"].as_str().unwrap_or("").to_string())
            .or_default()
            .push((e.started_us, e.finished_us));
    }
    let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
    let (mut twice, mut missing, mut overlaps, mut out_of_order, mut lost) = (0, 0, 0, 0, 0);
    for thread_ops in &ids {
        let mut spans = Vec::new();
        for id in thread_ops {
            let op = store.get_operation(None, id).await.expect("store").expect("op");
            *by_state.entry(op.state.as_str().to_string()).or_default() += 1;
            let ran = executions.get(id).map_or(0, Vec::len);
            if ran > 1 {
                twice += 1;
            }
            if ran == 0 && op.state.as_str() != "uncertain" {
                missing += 1;
            }
            if op.state.is_open() {
                lost += 1;
            }
            if let Some(v) = executions.get(id) {
                spans.push((v[0].0, v[0].1, id.clone()));
            }
        }
        let send_order: Vec<&String> = thread_ops.iter().filter(|id| executions.contains_key(*id)).collect();
        spans.sort();
        if spans.iter().map(|s| &s.2).collect::<Vec<_>>() != send_order {
            out_of_order += 1;
        }
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            overlaps += 1;
        }
    }
    let acked = acknowledged.lock().expect("lock").len();
    println!(
        "\nreplicas: 3 processes on PostgreSQL, {threads} threads x {PER_THREAD} operations, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!("  final states: {by_state:?}");
    println!("  callbacks acknowledged: {acked}; replica killed midway: {}", victim.is_some());
    println!("  resumed more than once: {twice}");
    println!("  never resumed (not uncertain): {missing}");
    println!("  threads with overlapping executions: {overlaps}");
    println!("  threads out of arrival order: {out_of_order}");
    println!("  acknowledged but not processed: {lost}");
    assert!(victim.is_some());
    assert_eq!(acked, threads * PER_THREAD);
    assert_eq!((twice, missing, overlaps, out_of_order, lost), (0, 0, 0, 0, 0));
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
}
