//! The workloads: the database's own single-row commit baseline, callback
//! ingest, the end-to-end approval loop, idle, and the growth fill.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use super::raw_http::RawClient;
use super::report::Latencies;
use super::target::EffectLog;
use crate::sandbox::{CallbackMode, SandboxHandle};

/// A ≈300-byte payload, the size of a real callback.
pub fn payload(correlation_id: &str) -> Vec<u8> {
    let mut body = json!({
        "correlationId": correlation_id,
        "decisionId": correlation_id,
        "answer": "yes",
        "value": "yes",
        "type": "confirm",
        "answeredAt": "2026-11-29T12:00:00.000Z",
        "externalId": "user_0123456789abcdef",
        "pad": "",
    })
    .to_string();
    let pad = 300usize.saturating_sub(body.len());
    body = body.replace("\"pad\":\"\"", &format!("\"pad\":\"{}\"", "x".repeat(pad)));
    body.into_bytes()
}

/// Single-row durable INSERT transactions/s of a ≈300-byte row: what the
/// database gives one statement per commit, at `clients` concurrency
/// (SQLite serializes writers, so one connection there).
pub async fn baseline(url: &str, clients: usize, secs: f64) -> anyhow::Result<f64> {
    let body = String::from_utf8(payload("dec_baseline")).expect("ascii");
    let run = Duration::from_secs_f64(secs);
    let count = Arc::new(AtomicU64::new(0));
    if url.starts_with("postgres") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(u32::try_from(clients).unwrap_or(64))
            .connect(url)
            .await
            .context("baseline: connecting")?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS bench_baseline (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)",
        )
        .execute(&pool)
        .await?;
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let (pool, body, count) = (pool.clone(), body.clone(), Arc::clone(&count));
            tasks.push(tokio::spawn(async move {
                while start.elapsed() < run {
                    if sqlx::query("INSERT INTO bench_baseline (body) VALUES ($1)")
                        .bind(&body)
                        .execute(&pool)
                        .await
                        .is_ok()
                    {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        for t in tasks {
            t.await?;
        }
        let rate = count.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
        sqlx::query("TRUNCATE bench_baseline").execute(&pool).await?;
        pool.close().await;
        Ok(rate)
    } else {
        let mut conn = sqlite_baseline(url).await?;
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < run {
            sqlx::query("INSERT INTO bench_baseline (body) VALUES ($1)")
                .bind(&body)
                .execute(&mut conn)
                .await?;
            n += 1;
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        sqlx::query("DELETE FROM bench_baseline").execute(&mut conn).await?;
        Ok(rate)
    }
}

/// The baseline's SQLite file beside the store's, with the settings
/// approvald uses (WAL, synchronous=FULL), and its table.
async fn sqlite_baseline(url: &str) -> anyhow::Result<sqlx::SqliteConnection> {
    use sqlx::ConnectOptions;
    use std::str::FromStr;
    let path = url.trim_start_matches("sqlite://").to_string() + ".baseline";
    let mut conn = sqlx::sqlite::SqliteConnectOptions::from_str(&format!("sqlite://{path}"))?
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
        .connect()
        .await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_baseline (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// The latency of `n` single-row durable commits on one connection, each
/// after `pause` with nothing to do, as a single approval's commits come
/// (a lone commit costs several back-to-back ones; docs/performance.md).
/// The floor under a single approval, which waits for three in turn. The
/// connection's first insert (its statement prepared, its caches cold)
/// is not timed, and the rows are deleted after.
pub async fn commit_latencies(url: &str, n: usize, pause: Duration) -> anyhow::Result<Vec<Duration>> {
    use sqlx::Connection as _;
    let body = String::from_utf8(payload("dec_baseline")).expect("ascii");
    let mut times = Vec::with_capacity(n);
    macro_rules! timed_commits {
        ($conn:ident) => {
            sqlx::query("INSERT INTO bench_baseline (body) VALUES ($1)")
                .bind(&body)
                .execute(&mut $conn)
                .await?;
            for _ in 0..n {
                tokio::time::sleep(pause).await;
                let t = Instant::now();
                sqlx::query("INSERT INTO bench_baseline (body) VALUES ($1)")
                    .bind(&body)
                    .execute(&mut $conn)
                    .await?;
                times.push(t.elapsed());
            }
            sqlx::query("DELETE FROM bench_baseline").execute(&mut $conn).await?;
        };
    }
    if url.starts_with("postgres") {
        let mut conn = sqlx::PgConnection::connect(url).await.context("commit latency: connecting")?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS bench_baseline (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)",
        )
        .execute(&mut conn)
        .await?;
        timed_commits!(conn);
        conn.close().await?;
    } else {
        let mut conn = sqlite_baseline(url).await?;
        timed_commits!(conn);
    }
    Ok(times)
}

/// What an ingest run measured.
pub struct Ingest {
    pub acked_per_sec: f64,
    pub latency: Latencies,
    pub errors: u64,
}

/// `clients` keep-alive connections POST signed callbacks with unique
/// correlation ids for `secs`; with `rate`, the total is paced to it.
pub async fn ingest(
    base: &str,
    secret: &str,
    clients: usize,
    secs: f64,
    rate: Option<f64>,
    progress: &str,
) -> anyhow::Result<Ingest> {
    let path = "/v1/callbacks/pushary";
    let run = Duration::from_secs_f64(secs);
    let run_id = format!("{:08x}", rand::random::<u32>());
    let acked = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let ticker = super::report::progress(progress, Arc::clone(&acked), Arc::clone(&done));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (base, secret, run_id) = (base.to_string(), secret.to_string(), run_id.clone());
        let (acked, errors) = (Arc::clone(&acked), Arc::clone(&errors));
        // Paced clients send at fixed times, whether or not earlier ones were slow
        // (open loop), so a stall shows up in the latency instead of hiding it.
        let interval = rate.map(|r| Duration::from_secs_f64(clients as f64 / r));
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut n = 0u64;
            let mut conn = None;
            let offset = interval.map_or(Duration::ZERO, |i| i.mul_f64(c as f64 / clients as f64));
            loop {
                let due = interval.map(|i| start + offset + i.mul_f64(n as f64));
                if let Some(due) = due {
                    tokio::time::sleep_until(due.into()).await;
                }
                if start.elapsed() >= run {
                    break;
                }
                let body = payload(&format!("dec_{run_id}_{c}_{n}"));
                let sig = crate::pushary::signature::sign(&secret, &body);
                let sent = due.unwrap_or_else(Instant::now);
                if conn.is_none() {
                    conn = RawClient::connect(&base).await.ok();
                }
                let r = match conn.as_mut() {
                    Some(c) => c.post(path, ("x-pushary-signature", &sig), &body).await,
                    None => Err(std::io::ErrorKind::NotConnected.into()),
                };
                match r {
                    Ok(status) if (200..300).contains(&status) => {
                        lat.push(sent.elapsed());
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        // A broken connection is replaced on the next request.
                        conn = None;
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                n += 1;
            }
            lat
        }));
    }
    let mut latency = Latencies::default();
    for t in tasks {
        latency.extend(t.await?);
    }
    let elapsed = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let _ = ticker.await;
    Ok(Ingest {
        acked_per_sec: acked.load(Ordering::Relaxed) as f64 / elapsed,
        latency,
        errors: errors.load(Ordering::Relaxed),
    })
}

/// What an end-to-end run measured.
pub struct EndToEnd {
    pub approvals_per_sec: f64,
    pub latency: Latencies,
    pub count: usize,
}

/// Enqueues `count` operations (one thread each) and waits until every one
/// is open at the sandbox; returns their decision ids.
pub async fn open_operations(
    base: &str,
    token: &str,
    sandbox: &SandboxHandle,
    count: usize,
    tag: &str,
) -> anyhow::Result<Vec<String>> {
    let http = crate::http::client_builder().build()?;
    let (before, _) = sandbox.counts();
    let sem = Arc::new(tokio::sync::Semaphore::new(32));
    let mut tasks = Vec::new();
    for n in 0..count {
        let (http, sem) = (http.clone(), Arc::clone(&sem));
        let url = format!("{base}/v1/operations");
        let body = json!({
            "operationKey": format!("bench-{tag}-{n}"),
            "threadId": format!("thread-{tag}-{n}"),
            "interruptId": format!("int-{n}"),
            "effect": "bench",
            "question": "Approve the benchmark action?",
            "type": "confirm",
            "externalId": format!("user_{tag}"),
            "expiresInSeconds": 3600,
        });
        let token = token.to_string();
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await;
            let r = http.post(url).bearer_auth(token).json(&body).send().await?;
            anyhow::ensure!(r.status().is_success(), "enqueue answered {}", r.status());
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let start = Instant::now();
    while sandbox.counts().0 < before + count {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(600),
            "operations were not all opened in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut decisions = sandbox.decisions();
    decisions.sort_by_key(|d| d.created_at.clone());
    Ok(decisions
        .into_iter()
        .filter(|d| d.external_id.as_deref() == Some(format!("user_{tag}").as_str()) && d.status == "pending")
        .map(|d| d.decision_id)
        .collect())
}

/// Answers every decision at the sandbox (which sends the signed callback)
/// at full speed or paced to `rate`, and waits for every receipt.
pub async fn answer_all(
    sandbox: &SandboxHandle,
    effects: &EffectLog,
    decisions: &[String],
    rate: Option<f64>,
    progress: &str,
) -> anyhow::Result<EndToEnd> {
    let (_, receipts_before) = sandbox.counts();
    let done_count = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let ticker = super::report::progress(progress, Arc::clone(&done_count), Arc::clone(&done));
    let start = Instant::now();
    let mut answered = Vec::with_capacity(decisions.len());
    for (n, d) in decisions.iter().enumerate() {
        if let Some(r) = rate {
            tokio::time::sleep_until((start + Duration::from_secs_f64(n as f64 / r)).into()).await;
        }
        sandbox.answer(d, "yes", CallbackMode::Send).await.map_err(|e| anyhow::anyhow!("answer {d}: {e}"))?;
        answered.push(Instant::now());
        done_count.store((sandbox.counts().1 - receipts_before) as u64, Ordering::Relaxed);
    }
    let target = receipts_before + decisions.len();
    loop {
        let (_, receipts) = sandbox.counts();
        done_count.store((receipts - receipts_before) as u64, Ordering::Relaxed);
        if receipts >= target {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(600),
            "approvals did not all complete in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let _ = ticker.await;
    let mut latency = Latencies::default();
    for (d, at) in decisions.iter().zip(&answered) {
        if let Some(arrived) = effects.arrived(d) {
            latency.push(arrived.saturating_duration_since(*at));
        }
    }
    Ok(EndToEnd { approvals_per_sec: decisions.len() as f64 / elapsed, latency, count: decisions.len() })
}

/// Fills the store with `rows` finished operations and their inbox rows,
/// copied from a finished template, as a long-running deployment has.
pub async fn fill(url: &str, rows: u64, progress: &str) -> anyhow::Result<()> {
    let chunk = 100_000u64;
    let cols = "tenant, fingerprint, interrupt_id, effect, decision_type, spec, decision_request, state, answer, \
                permit_id, delivery, outcome_status, result, receipt, receipt_outcome, consume_inflight, \
                consume_attempts, delivery_inflight, attempts, deadline, opened_at, created_at, updated_at";
    let ops = format!(
        "WITH RECURSIVE g(n) AS (SELECT $1 UNION ALL SELECT n + 1 FROM g WHERE n < $2) \
         INSERT INTO operations (id, operation_key, thread_id, idempotency_key, decision_id, {cols}) \
         SELECT 'op_fill_' || n, 'fill-' || n, 'fill-thread-' || (n % 10000), 'fill-key-' || n, 'dec_fill_' || n, \
         {cols} FROM g, (SELECT * FROM operations WHERE state = 'succeeded' LIMIT 1) t"
    );
    let inbox = "WITH RECURSIVE g(n) AS (SELECT $1 UNION ALL SELECT n + 1 FROM g WHERE n < $2) \
         INSERT INTO inbox (tenant, correlation_id, answer, body, body_sha256, source, state, received_at, \
         operation_id, processed_at) \
         SELECT 'default', 'dec_fill_' || n, 'yes', $3, 'fill', 'callback', 'processed', 0, 'op_fill_' || n, 0 FROM g";
    let body = payload("dec_fill");
    let mut at = 1u64;
    while at <= rows {
        let end = (at + chunk - 1).min(rows);
        let (a, b) = (i64::try_from(at)?, i64::try_from(end)?);
        if url.starts_with("postgres") {
            let pool = sqlx::PgPool::connect(url).await?;
            sqlx::query(sqlx::AssertSqlSafe(ops.clone())).bind(a).bind(b).execute(&pool).await?;
            sqlx::query(inbox).bind(a).bind(b).bind(&body).execute(&pool).await?;
            pool.close().await;
        } else {
            let pool = sqlx::SqlitePool::connect(url).await?;
            sqlx::query(sqlx::AssertSqlSafe(ops.clone())).bind(a).bind(b).execute(&pool).await?;
            sqlx::query(inbox).bind(a).bind(b).bind(&body).execute(&pool).await?;
            pool.close().await;
        }
        eprint!("\r{progress}: {end}/{rows} rows   ");
        at = end + 1;
    }
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await?;
        // A deployment's finished rows were vacuumed long ago. Without this,
        // autovacuum's first pass over the million fresh rows (an
        // insert-triggered vacuum) runs during the measurement and takes a
        // core of this two-core machine from it.
        sqlx::query("VACUUM (ANALYZE)").execute(&pool).await?;
        // And checkpointed: otherwise the checkpoint the fill's gigabyte
        // of WAL calls for writes the fill's pages out during the
        // measurement, on the same disk and cores.
        sqlx::query("CHECKPOINT").execute(&pool).await?;
        pool.close().await;
    } else {
        let pool = sqlx::SqlitePool::connect(url).await?;
        sqlx::query("ANALYZE").execute(&pool).await?;
        // The same for SQLite's write-ahead log, which the fill grew.
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(&pool).await?;
        pool.close().await;
    }
    eprintln!();
    Ok(())
}
