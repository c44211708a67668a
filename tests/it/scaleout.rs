//! PostgreSQL scale-out: roles split across processes, NOTIFY wake-up,
//! and migrations run again and concurrently.

use std::process::Command;

use serde_json::Value;

use crate::daemon::Daemon;
use crate::harness::{BACKEND, Backend, TOKEN, confirm};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// An API process, a receiver process and a worker process share one
/// database. The worker's safety-net poll is an hour, so the work can only
/// have been picked up through LISTEN/NOTIFY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_split_across_processes_and_notify_wakes_the_worker() {
    let Some(backend) = Backend::postgres("scaleout::roles_split_across_processes") else { return };
    BACKEND
        .scope(backend, async {
            let d = Daemon::new("").await;
            let env = |role: &str| {
                vec![
                    ("APPROVALD_ROLE", role.to_string()),
                    ("APPROVALD_WORKER__IDLE_POLL_SECS", "3600".to_string()),
                ]
            };
            let (api_port, rx_port, w_port) = (free_port(), free_port(), free_port());
            let mut api = d.spawn_replica(api_port, &env("api")).await;
            let mut receiver = d.spawn_replica(rx_port, &env("receiver")).await;
            let mut worker = d.spawn_replica(w_port, &env("worker")).await;
            let http = &d.http;

            // Each role serves only its routes.
            let r = http
                .post(format!("http://127.0.0.1:{rx_port}/v1/operations"))
                .bearer_auth(TOKEN)
                .json(&confirm("x"))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status().as_u16(), 404, "the receiver serves no API");
            let r = http
                .post(format!("http://127.0.0.1:{api_port}/v1/callbacks/pushary"))
                .body("{}")
                .send()
                .await
                .expect("send");
            assert_eq!(r.status().as_u16(), 404, "the API serves no receiver");
            let r = http.get(format!("http://127.0.0.1:{w_port}/readyz")).send().await.expect("send");
            assert!(r.status().is_success(), "the worker answers health checks");

            let r = http
                .post(format!("http://127.0.0.1:{api_port}/v1/operations"))
                .bearer_auth(TOKEN)
                .json(&confirm("roles"))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status().as_u16(), 201);
            let id = r.json::<Value>().await.expect("json")["id"].as_str().expect("id").to_string();
            let get = |id: String| async move {
                http.get(format!("http://127.0.0.1:{api_port}/v1/operations/{id}"))
                    .bearer_auth(TOKEN)
                    .send()
                    .await
                    .ok()?
                    .json::<Value>()
                    .await
                    .ok()
            };
            let start = std::time::Instant::now();
            let decision = loop {
                let op = get(id.clone()).await.expect("op");
                if let Some(dec) = op["decisionId"].as_str() {
                    break dec.to_string();
                }
                assert!(
                    start.elapsed() < crate::harness::WAIT,
                    "the worker never opened the decision (no NOTIFY?)"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            };
            d.sandbox.answer(&decision, "yes", approvald::sandbox::CallbackMode::Drop).await.expect("answer");
            let body = serde_json::to_vec(&serde_json::json!({"correlationId": decision, "answer": "yes"}))
                .expect("json");
            let sig = approvald::pushary::signature::sign(&d.sandbox.webhook_secret(), &body);
            let r = http
                .post(format!("http://127.0.0.1:{rx_port}/v1/callbacks/pushary"))
                .header("X-Pushary-Signature", sig)
                .body(body)
                .send()
                .await
                .expect("send");
            assert_eq!(r.status().as_u16(), 200);
            let start = std::time::Instant::now();
            loop {
                let op = get(id.clone()).await.expect("op");
                if op["state"] == "succeeded" {
                    break;
                }
                assert!(
                    start.elapsed() < crate::harness::WAIT,
                    "the callback stored by the receiver was never worked: {op}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            for c in [&mut api, &mut receiver, &mut worker] {
                let _ = c.kill();
                let _ = c.wait();
            }
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_again_and_concurrently_leaves_the_schema_correct() {
    let Some(Backend::Postgres(admin)) = Backend::postgres("scaleout::migrate_again_and_concurrently") else {
        return;
    };
    let db = crate::harness::PgDb::create(&admin).await;
    let migrate = || {
        Command::new(env!("CARGO_BIN_EXE_approvald"))
            .arg("migrate")
            .env("APPROVALD_STORE__URL", &db.url)
            .env("APPROVALD_PUSHARY__API_KEY", "pk_test.secret")
            .spawn()
            .expect("migrate starts")
    };
    // Two at once, then a third on the migrated schema.
    let (mut a, mut b) = (migrate(), migrate());
    assert!(a.wait().expect("a").success());
    assert!(b.wait().expect("b").success());
    assert!(migrate().wait().expect("again").success());
    let store =
        approvald::store::Store::connect(&approvald::config::StoreConfig::with_defaults(db.url.clone(), 1))
            .await
            .expect("connect");
    assert_eq!(store.migration_status().await.expect("status"), (Some(10), 10));
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1",
    )
    .fetch_all(store.pg_pool().expect("pg"))
    .await
    .expect("tables");
    assert_eq!(
        tables,
        [
            "approvald_migrations",
            "archived_operations",
            "deliveries",
            "inbox",
            "operations",
            "pushary_calls",
            "thread_leases",
            "transitions",
            "webhook_secrets"
        ]
    );
    let applied: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM approvald_migrations")
        .fetch_one(store.pg_pool().expect("pg"))
        .await
        .expect("count");
    assert_eq!(applied, 10, "each migration applied once");
    // The audit rows carry no foreign keys (migration 0009).
    let foreign_keys: Vec<String> =
        sqlx::query_scalar("SELECT conname::text FROM pg_constraint WHERE contype = 'f' ORDER BY 1")
            .fetch_all(store.pg_pool().expect("pg"))
            .await
            .expect("foreign keys");
    assert!(foreign_keys.is_empty(), "foreign keys left: {foreign_keys:?}");
    // Leases write no WAL (migration 0007); the operations they guard do.
    let persistence: Vec<(String, String)> = sqlx::query_as(
        "SELECT relname::text, relpersistence::text FROM pg_class \
         WHERE relname IN ('thread_leases', 'operations') ORDER BY 1",
    )
    .fetch_all(store.pg_pool().expect("pg"))
    .await
    .expect("persistence");
    assert_eq!(
        persistence,
        [("operations".to_string(), "p".to_string()), ("thread_leases".to_string(), "u".to_string())]
    );
    store.close().await;
}
